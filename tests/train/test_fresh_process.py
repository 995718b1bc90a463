"""A function called in a fresh process: its lines come back in order, its result returns, its
exception is raised here, and a child that dies without answering is an error, not a hang."""

from __future__ import annotations

import os

import pytest

from gem_platform.errors import GemError
from gem_platform.fresh_process import call_in_fresh_process


def count_to(n: int, echo) -> dict:
    for i in range(n):
        echo(f"line {i}")
    return {"pid": os.getpid(), "n": n}


def refuse(echo) -> None:
    echo("about to fail")
    raise GemError("no such recipe field 'x'", "Drop --set x=1.")


def run_out_of_memory(echo) -> None:
    from gem_platform.train.device_memory import DeviceMemoryError

    raise DeviceMemoryError("Recipe 'r' ran out of device memory while training", "lower N")


class Unpicklable(Exception):
    def __init__(self, handle) -> None:
        super().__init__("holds a lock")
        self.handle = handle


def raise_unpicklable(echo) -> None:
    import threading

    raise Unpicklable(threading.Lock())


def die(echo) -> None:
    echo("dying")
    os._exit(3)


def test_lines_and_result_come_back_from_another_process():
    lines: list[str] = []
    out = call_in_fresh_process(count_to, 3, echo=lines.append)
    assert out["n"] == 3 and out["pid"] != os.getpid()
    assert lines == ["line 0", "line 1", "line 2"]


def test_errors_are_raised_here():
    lines: list[str] = []
    with pytest.raises(GemError, match="no such recipe field") as err:
        call_in_fresh_process(refuse, echo=lines.append)
    assert err.value.fix == "Drop --set x=1." and lines == ["about to fail"]
    # a parallel sweep retries a trial on this type (a MemoryError), so it must arrive as itself
    with pytest.raises(MemoryError, match="ran out of device memory") as oom:
        call_in_fresh_process(run_out_of_memory, echo=lines.append)
    assert type(oom.value).__name__ == "DeviceMemoryError" and oom.value.fix == "lower N"
    with pytest.raises(RuntimeError, match="Unpicklable: holds a lock"):
        call_in_fresh_process(raise_unpicklable, echo=lines.append)
    with pytest.raises(RuntimeError, match="exited with code 3 before returning"):
        call_in_fresh_process(die, echo=lines.append)  # (its last lines may be lost)


def square(x: int) -> int:
    return x * x


def test_a_function_without_echo_is_called_without_it():
    assert call_in_fresh_process(square, 7) == 49
