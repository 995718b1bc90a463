"""Topology: the cluster as zones of hosts of ranks, the process groups of each parallel
dimension, the network tier each collective crosses, and rank placement on Ray."""

from gem_platform.topology.config import ParallelConfig

__all__ = ["ParallelConfig"]
