"""Precision: FP8 (block-scaled) training. ``convert_to_fp8`` swaps linear layers for
Fp8BlockLinear (keeping the last and named ones in bf16); ``enable_fp8_all_gather`` makes FSDP2
gather those weights as FP8 bytes + scales."""

from gem_platform.precision.convert import convert_to_fp8
from gem_platform.precision.fsdp import Fp8AllGatherWeight, enable_fp8_all_gather

__all__ = ["Fp8AllGatherWeight", "convert_to_fp8", "enable_fp8_all_gather"]
