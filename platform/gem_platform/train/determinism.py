"""Deterministic training (``train.deterministic``): the same recipe, seed and code on the same
device give bitwise-identical losses and metrics.

``deterministic_mode(seed)`` turns on, for its duration:

- ``torch.use_deterministic_algorithms(True)``: ops that have a deterministic implementation
  use it (on CUDA, ``index_add_``, ``scatter_add_`` and the backward of ``index_select``,
  ``gather`` and advanced indexing sort instead of accumulating with atomics); an op that has
  none raises a RuntimeError naming itself instead of varying silently;
- no NaN fill of new allocations (``torch.utils.deterministic.fill_uninitialized_memory``
  off): with deterministic algorithms on, torch otherwise fills every ``torch.empty`` with NaN
  (one fill kernel per allocation, in TorchRec's, the attention ops' and the eager glue's
  outputs), so that a kernel reading memory nobody wrote would give the same NaN every run.
  Deterministic runs trained with that fill on never carried a NaN into a loss, so no such
  read reaches what the model computes unmasked; the fill's launches slow the host-bound
  small recipes. A read that mattered would make runs differ, which ``repro_bench`` and the
  GPU determinism tests check;
- cuDNN's deterministic algorithms, without benchmark autotuning;
- ``gem_kernels.set_deterministic_backward(True)``: every attention op's backward runs
  without floating-point atomics;
- Inductor's deterministic mode (``torch._inductor.config.deterministic``): compiled
  regions choose reduction and template configs without benchmarking them on the device, so two
  compilations of one graph make the same kernels (recent torch turns it on with
  ``use_deterministic_algorithms``; setting it keeps older builds in step);
- ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (the workspace setting cuBLAS needs to be reproducible)
  unless it already holds ``:4096:8`` or ``:16:8``. PyTorch checks it at the first cuBLAS
  call made with deterministic algorithms on, and keeps the answer (torch 2.11). Given the
  CUDA ``device`` it trains on, the mode makes that call itself and then removes the variable
  it set: while the variable is set, torch parses it with a regular expression at every cuBLAS
  call, which costs a host-bound step milliseconds; unset, each (handle, stream) keeps one
  workspace of torch's default size, so results stay reproducible. Where a torch build checks
  at every call instead, the variable stays set;
- Python's, NumPy's and torch's global RNGs (CPU and every GPU) seeded with ``seed``.

On exit the torch (the fill included), cuDNN, Inductor and kernel switches return to what
they were (the kernel switch to ``None``: following torch's setting); the RNGs stay seeded
and the environment variable stays as the mode left it.
The data order needs nothing here: the batcher's permutation is a function of
(``loader.seed``, rank, epoch), and synthetic data of ``data.synthetic.seed``.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

from gem_kernels import set_deterministic_backward
from gem_platform.errors import GemError

CUBLAS_ENV = "CUBLAS_WORKSPACE_CONFIG"
CUBLAS_DETERMINISTIC = (":4096:8", ":16:8")


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global RNGs (torch: CPU and every CUDA device)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _cublas_workspace() -> bool:
    """Set the cuBLAS workspace variable where it is unset; True where this call set it."""
    value = os.environ.get(CUBLAS_ENV)
    if value is None:
        os.environ[CUBLAS_ENV] = CUBLAS_DETERMINISTIC[0]
        return True
    if value not in CUBLAS_DETERMINISTIC:
        raise GemError(
            f"train.deterministic is on but {CUBLAS_ENV}={value!r} in the environment; cuBLAS "
            f"is reproducible only with {' or '.join(CUBLAS_DETERMINISTIC)}.",
            f"Unset {CUBLAS_ENV} (training sets {CUBLAS_DETERMINISTIC[0]}) or set it to one "
            "of those values, or turn train.deterministic off.")
    return False


def _unset_once_checked(device: torch.device) -> None:
    """Make torch check the cuBLAS variable now, on ``device``, then unset it (see the module
    docstring); set it back where this torch refuses a deterministic matmul without it."""
    probe = torch.ones(2, 2, device=device)
    probe @ probe  # torch checks the variable at its first deterministic cuBLAS call
    del os.environ[CUBLAS_ENV]
    try:
        probe @ probe
    except RuntimeError:  # this torch checks at every call
        os.environ[CUBLAS_ENV] = CUBLAS_DETERMINISTIC[0]


@contextmanager
def deterministic_mode(seed: int, device: torch.device | None = None) -> Iterator[None]:
    """Deterministic algorithms everywhere and seeded RNGs for the block's duration, for
    training on ``device`` (see the module docstring for what it sets and what it restores)."""
    cublas_set = _cublas_workspace()
    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    inductor = _inductor_config()
    inductor_before = getattr(inductor, "deterministic", None)
    if inductor_before is not None:
        inductor.deterministic = True
    fill_before = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    set_deterministic_backward(True)
    seed_everything(seed)
    try:
        if cublas_set and device is not None and device.type == "cuda":
            _unset_once_checked(device)
        yield
    finally:
        enabled, warn_only, cudnn_deterministic, cudnn_benchmark = before
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
        torch.utils.deterministic.fill_uninitialized_memory = fill_before
        torch.backends.cudnn.deterministic = cudnn_deterministic
        torch.backends.cudnn.benchmark = cudnn_benchmark
        set_deterministic_backward(None)
        if inductor_before is not None:
            inductor.deterministic = inductor_before


def _inductor_config():  # noqa: ANN202 (a module)
    """torch._inductor.config, or None where this torch build has no Inductor."""
    try:
        import torch._inductor.config as config
    except ImportError:
        return None
    return config
