"""The sparse input pipelined: the input distribution of batch i+1 runs under batch i's step.

A TorchRec-sharded embedding module does three things per call: ``input_dist`` (the
KeyedJaggedTensor all-to-all that sends each id to the rank holding its row; two stages, the
lengths then the values), ``compute`` (the lookup) and ``output_dist`` (the embeddings back).
Only the first depends on nothing but the batch, so it can start one step early. This module
does what TorchRec's TrainPipelineSparseDist does, from the same pieces of the sharded
modules, without tracing the model: TorchRec's pipeline finds each sharded module's input by
tracing the forward with torch.fx, which stops at the model's shape-dependent branches
("symbolically traced variables cannot be used as inputs to control flow"), and the forward
builds the items' KeyedJaggedTensor from the batch rather than taking it from a batch field.

- ``start(batch)``: the lengths all-to-all of every sharded module, issued before the
  forward of the batch before it (``SPARSE_INPUT_DIST`` in a profiler trace);
- ``advance()``: once that forward is queued, the values all-to-all, running under its
  backward;
- ``forward_with(batch)``: while active, each sharded module's forward takes the distributed
  input already in flight for ``batch`` and only computes its lookup and output dist.

Lookups and updates keep their order (the fused optimizer updates the tables in batch i's
backward, before batch i+1's lookup), so the losses are those of the unpipelined step. The
model says what each sharded module receives through ``sparse_inputs(batch)``.
Collectives stay in the same order on every rank, so a collective that comes between two
steps (evaluation, checkpoint) is safe while a distribution is in flight. On CUDA the
distribution is issued on the current stream (the all-to-all itself runs on the
communicator's stream).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.profiler import record_function
from torchrec.distributed.types import ShardedModule

SPARSE_INPUT_DIST = "gem.sparse_input_dist"
SPARSE_INPUT_DIST_VALUES = "gem.sparse_input_dist_values"
SparseInputs = Callable[[Any], dict[str, Any]]


@dataclass(eq=False)
class _InFlight:
    """One batch's distributions, by module name: (context, awaitable of the input)."""

    batch: Any
    started: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    advanced: bool = False


class SparseInputPipeline:
    """Start each batch's input distribution one step ahead (see the module docstring).

    ``modules`` are the model's TorchRec-sharded modules by attribute name, ``inputs(batch)``
    what the model passes each of them for ``batch`` (same names)."""

    def __init__(self, modules: dict[str, ShardedModule], inputs: SparseInputs) -> None:
        self.modules, self.inputs = modules, inputs
        self._flight: list[_InFlight] = []

    @classmethod
    def for_model(cls, model: nn.Module) -> SparseInputPipeline | None:
        """The pipeline of ``model``'s sharded modules, or None when it has none or doesn't
        say what they receive (``sparse_inputs``)."""
        inputs = getattr(model, "sparse_inputs", None)
        if inputs is None:
            return None
        modules = {name: m for name, m in model.named_children() if isinstance(m, ShardedModule)}
        return cls(modules, inputs) if modules else None

    def start(self, batch: Any) -> None:
        """Issue ``batch``'s lengths all-to-all for every sharded module (once per batch)."""
        if any(f.batch is batch for f in self._flight):
            return
        flight = _InFlight(batch)
        with record_function(SPARSE_INPUT_DIST):
            features = self.inputs(batch)
            for name, module in self.modules.items():
                ctx = module.create_context()
                flight.started[name] = (ctx, module.input_dist(ctx, features[name]))
        self._flight.append(flight)

    def advance(self, batch: Any = None) -> None:
        """Issue the values all-to-all of ``batch`` (default: of every batch in flight), once
        its lengths are exchanged."""
        for flight in self._flight:
            if flight.advanced or (batch is not None and flight.batch is not batch):
                continue
            with record_function(SPARSE_INPUT_DIST_VALUES):
                flight.started = {name: (ctx, splits.wait())
                                  for name, (ctx, splits) in flight.started.items()}
            flight.advanced = True

    def pending(self) -> int:
        """Batches whose distribution is in flight."""
        return len(self._flight)

    @contextlib.contextmanager
    def forward_with(self, batch: Any) -> Iterator[None]:
        """While active, the sharded modules' forwards use ``batch``'s distributed input
        (started now if it was not); each module must be called exactly once (RuntimeError
        otherwise)."""
        self.start(batch)
        self.advance(batch)
        flight = next(f for f in self._flight if f.batch is batch)
        self._flight.remove(flight)
        forwards = {name: _DistributedForward(module, *flight.started[name])
                    for name, module in self.modules.items()}
        for name, module in self.modules.items():
            module.forward = forwards[name]
        try:
            yield
        finally:
            for module in self.modules.values():
                module.__dict__.pop("forward", None)
        unused = [name for name, f in forwards.items() if f.request is not None]
        if unused:
            raise RuntimeError(f"the model's forward did not call {', '.join(unused)}, whose "
                               "input was distributed for it: sparse_inputs names modules the "
                               "forward does not use")


class _DistributedForward:
    """A sharded module's forward whose input distribution is already in flight."""

    def __init__(self, module: ShardedModule, ctx: Any, request: Any) -> None:
        self.module, self.ctx, self.request = module, ctx, request

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.request is None:
            raise RuntimeError(f"{type(self.module).__name__} was called twice in one pipelined "
                               "forward: its distributed input serves one call")
        data, self.request = self.request.wait(), None
        return self.module.compute_and_output_dist(self.ctx, data)
