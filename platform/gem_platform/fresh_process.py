"""Call a function in a fresh (spawned) Python process, its progress events streamed back.

A training run leaves state in its process that changes the next run's figures: compiled
graphs and Dynamo's caches, the allocator's pools, cuBLAS's workspace setting (read once per
process). Benchmark arms, sweep trials and repeatability checks that must not depend on what
ran before them each get a process of their own. ``fn`` must be importable by name (spawn
pickles it so) and return a picklable value; when it has an ``echo`` parameter, its progress
callback, what it echoes (text or gem_platform.progress events) comes back as it is sent.
"""

from __future__ import annotations

import inspect
import multiprocessing
import pickle
import queue
from collections.abc import Callable
from typing import Any

POLL_S = 1.0  # how often the parent checks that the child is still alive


def call_in_fresh_process(fn: Callable[..., Any], *args: Any,
                          echo: Callable[[Any], None] = print) -> Any:
    """``fn(*args)`` in a spawned process, with ``echo=`` when ``fn`` takes it: each event it
    echoes goes to ``echo`` here. Its exception is raised here (as a RuntimeError naming it
    when it does not pickle); a child that dies without answering (killed, out of host
    memory) raises a RuntimeError."""
    ctx = multiprocessing.get_context("spawn")
    channel = ctx.Queue()
    child = ctx.Process(target=_child, args=(channel, fn, args), name=f"gem-{fn.__name__}")
    child.start()
    try:
        while True:
            try:
                kind, payload = channel.get(timeout=POLL_S)
            except queue.Empty:
                if not child.is_alive():
                    raise RuntimeError(f"{fn.__name__} in a fresh process exited with code "
                                       f"{child.exitcode} before returning") from None
                continue
            if kind == "event":
                echo(payload)
            elif kind == "error":
                raise payload
            else:
                return payload
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.terminate()


def _child(channel: Any, fn: Callable[..., Any], args: tuple) -> None:
    from gem_platform.log_mask import mask_process_output

    mask_process_output()  # its output reaches the parent's log file or terminal directly
    streams = "echo" in inspect.signature(fn).parameters
    kwargs = {"echo": lambda event: channel.put(("event", event))} if streams else {}
    try:
        result = fn(*args, **kwargs)
    except BaseException as err:  # handed to the parent
        channel.put(("error", _picklable(err)))
    else:
        channel.put(("result", result))


def _picklable(err: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:  # noqa: BLE001 (any pickling failure)
        return RuntimeError(f"{type(err).__name__}: {err}")
