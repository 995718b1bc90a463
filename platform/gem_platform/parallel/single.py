"""Embedding tables of a single-process run: TorchRec's fused path where it runs.

With fbgemm-gpu's CUDA build, one GPU trains its tables the way many GPUs do: TorchRec's
DistributedModelParallel over a one-rank process group, table-wise, FBGEMM's TBE lookup with
exact row-wise Adagrad applied inside the backward (only the rows a batch touched are read and
written). Without it (CPU, or CUDA with only fbgemm-gpu-cpu) tables stay plain modules with a
dense gradient of every row and a dense Adagrad step over whole tables; on CUDA that costs a
pass over every table each step, which one log line says.

On CPU the fused path runs too (fbgemm-gpu-cpu's kernels) when the recipe asks for a sharding
layout (``parallel.embedding_sharding``): the same code, testable without a GPU.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

log = logging.getLogger(__name__)

# A probe op of the TBE family: registered for the CUDA dispatch key only by the CUDA build.
_TBE_PROBE = "fbgemm::asynchronous_complete_cumsum"


def fused_tbe_available(device: torch.device) -> bool:
    """True when TorchRec's fused TBE path can run on ``device``: always on CPU (fbgemm-gpu-cpu),
    on CUDA only with fbgemm-gpu's CUDA build."""
    try:
        import fbgemm_gpu  # noqa: F401  (registers the fbgemm ops)
    except ImportError:
        return False
    if device.type != "cuda":
        return True
    return torch._C._dispatch_has_kernel_for_dispatch_key(_TBE_PROBE, "CUDA")


_PLAIN_TABLES = threading.local()


@contextlib.contextmanager
def plain_tables() -> Iterator[None]:
    """Within this block (this thread), single-process runs keep plain tables with a dense
    optimizer step even where the fused path runs: the off-the-shelf baseline of a benchmark."""
    before = getattr(_PLAIN_TABLES, "on", False)
    _PLAIN_TABLES.on = True
    try:
        yield
    finally:
        _PLAIN_TABLES.on = before


def wants_fused_tables(device: torch.device, sharding_requested: bool) -> bool:
    """Whether a single process trains its tables through TorchRec's fused path: by default
    on CUDA when the fused TBE runs there, and wherever a sharding layout is asked for
    (never inside ``plain_tables()``)."""
    if getattr(_PLAIN_TABLES, "on", False):
        return False
    if sharding_requested:
        return True
    return device.type == "cuda" and fused_tbe_available(device)


def ensure_process_group(device: torch.device) -> dist.ProcessGroup:
    """The default process group, created with one rank (NCCL on CUDA, gloo on CPU) when the
    process has none: DistributedModelParallel needs one even on a single device. It lives
    as long as the process, like a Ray worker's."""
    if not dist.is_initialized():
        # on CUDA, gloo beside NCCL: the loop's few CPU collectives (counters) need a backend
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timedelta(minutes=10), **kwargs)
    if dist.get_world_size() != 1:
        raise RuntimeError("ensure_process_group is for single-process runs; this process "
                           f"belongs to a group of {dist.get_world_size()} ranks")
    return dist.group.WORLD


def dense_table_cost(tables: list[nn.Parameter]) -> str:
    """One line: what the dense whole-table path costs per step (rows, bytes moved)."""
    rows = sum(p.shape[0] for p in tables)
    nbytes = sum(p.numel() * p.element_size() for p in tables)
    # dense gradient written, then Adagrad reads grad, state, weight and writes state, weight
    moved = 6 * nbytes
    return (f"embedding tables train with dense gradients of all {rows:,} rows and a dense "
            f"Adagrad step (~{moved / 2**30:.1f} GiB of memory traffic per step): fbgemm-gpu's "
            "CUDA build is not installed, so TorchRec's fused sparse path (FBGEMM TBE, "
            "optimizer in the backward) cannot run; install fbgemm-gpu to use it")


def warn_dense_tables(tables: list[nn.Parameter], device: torch.device) -> None:
    """Log the dense path's cost once per run on CUDA where the fused path cannot run (on CPU
    the dense path is the default; inside ``plain_tables()`` it was asked for)."""
    if device.type == "cuda" and tables and not fused_tbe_available(device):
        log.warning(dense_table_cost(tables))
