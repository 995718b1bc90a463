"""A Ctrl-C or SIGTERM that lands while DCP writes a checkpoint stays an interrupt (the run
ends KILLED), not a CheckpointException (which would record it FAILED)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from gem_platform.checkpoint.store import interrupts_kept


class _StoppedWriter(FileSystemWriter):
    """A writer interrupted (as a signal handler raising KeyboardInterrupt would) or failing
    while it writes the tensors."""

    def __init__(self, path, error: BaseException) -> None:
        super().__init__(path)
        self.error = error

    def write_data(self, plan, planner):  # noqa: ANN001 (DCP's own types)
        raise self.error


def _save(tmp_path, error: BaseException) -> None:
    dcp.save({"w": torch.ones(4)}, storage_writer=_StoppedWriter(tmp_path, error))


def test_dcp_wraps_an_interrupt_itself(tmp_path):
    with pytest.raises(CheckpointException):
        _save(tmp_path, KeyboardInterrupt("signal 15"))


def test_an_interrupted_save_raises_the_interrupt(tmp_path):
    with pytest.raises(KeyboardInterrupt, match="signal 15"), interrupts_kept():
        _save(tmp_path, KeyboardInterrupt("signal 15"))


def test_a_failed_save_stays_a_checkpoint_failure(tmp_path):
    with pytest.raises(CheckpointException), interrupts_kept():
        _save(tmp_path, OSError("disk full"))
