"""How a model is spread over ranks: one entry point, :func:`parallelize`, returning the model
to call plus how its gradients are synchronized and which parameters each optimizer owns."""

from gem_platform.parallel.api import Parallelized, parallelize

__all__ = ["Parallelized", "parallelize"]
