"""The Triton-interpreter switch has one reader, gem_kernels.dispatch.interpreting: kernels,
the platform and the CLI ask it instead of reading TRITON_INTERPRET themselves."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from gem_kernels.dispatch import interpreting, triton_available_on

REPO = Path(__file__).resolve().parents[2]
_READ = re.compile(r"""(environ\.get|getenv)\(\s*.TRITON_INTERPRET|environ\[.TRITON_INTERPRET""")


@pytest.mark.parametrize("value, expected", [("1", True), ("0", False), (None, False)])
def test_interpreting_follows_the_switch_at_each_call(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", value)
    assert interpreting() is expected
    assert triton_available_on(torch.device("cpu")) is expected


def test_only_dispatch_reads_the_switch():
    readers = []
    for root in ("kernels", "platform", "gemctl", "bench"):
        for path in (REPO / root).rglob("*.py"):
            rel = path.relative_to(REPO).as_posix()
            if rel == "kernels/gem_kernels/dispatch.py" or rel.startswith(
                    "bench/gem_bench/kernels/"):
                continue
            if _READ.search(path.read_text()):
                readers.append(rel)
    assert readers == [], f"read TRITON_INTERPRET through dispatch.interpreting(): {readers}"
