"""Embedding tables split over the ranks of each host (``parallel.embedding_host_split``).

The third generation of sparse sharding, on the replicated-tables path: where data
parallelism keeps every table whole on every rank, each rank keeps only its 1/P of every
table's rows (P = ranks per host), as a DTensor placed (Replicate over hosts, Shard(0) over the
host). The pieces are FSDP2's:

- before the lookups, one all-gather inside the host (one flat buffer for every table, each
  table's rows padded to a multiple of P) rebuilds the whole tables; the lookups run on them
  as ordinary parameters;
- right after the lookups the gathered copy's storage is freed (the lookups' backward needs
  the ids, not the rows), so the copy is gone before the step's memory peak; the gradients
  still reach the gathered copy's (now empty) parameters, which autograd only reads the shape of;
- after the backward, one reduce-scatter inside the host sums each rank's piece of the table
  gradients and one all-reduce across hosts finishes the sum; divided by the world size it
  is the data-parallel mean, so the split trains exactly as whole replicated tables do;
- the optimizer (Adagrad) sees only the DTensor pieces: its state stays split;
- after the optimizer step the next step's all-gather starts at once (an async work handle),
  so it overlaps whatever the loop does until the next forward; the forward waits on it,
  and gathers again if the pieces changed in between (a checkpoint loaded).

Every collective it issues is recorded (op, group, bytes) so that tests can hold it to the
plan `gemctl plan` prints for the layout.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.profiler import record_function
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

from gem_platform.topology.costs import ring_all_gather_bytes, ring_all_reduce_bytes

# Profiler ranges: the gather's launch (after the optimizer step), the lookup's wait on it,
# and the gradients' reduction after the backward.
GATHER_RANGE = "gem.host_split_all_gather"
WAIT_RANGE = "gem.host_split_wait"
REDUCE_RANGE = "gem.host_split_reduce"
HOST_GROUP = "embedding_host"
REPLICATE_GROUP = "embedding_split_replicate"


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective the split issued: its op, group kind and size, the bytes of the whole
    tensor it concerns (payload) and what one rank sends of it (ring algorithms)."""

    op: str
    group: str
    group_size: int
    payload_bytes: int
    sent_bytes: int


@dataclass
class _Table:
    """One table's place in the flat buffers: its module, shape, rows per rank (padded) and
    offset (elements) inside a rank's flat piece."""

    module: nn.Module
    rows: int
    dim: int
    chunk: int
    offset: int

    @property
    def padded(self) -> int:
        return self.chunk * self.dim

    def local_rows(self, index: int) -> int:
        return max(0, min(self.chunk, self.rows - index * self.chunk))


@dataclass
class _Pending:
    """An all-gather in flight: its output buffer, work handle and the pieces' version."""

    out: torch.Tensor
    work: dist.Work | None
    version: int


def split_tables(model: nn.Module) -> list[nn.Module]:
    """The lookup modules (nn.Embedding of EmbeddingCollections, nn.EmbeddingBag of
    EmbeddingBagCollections) whose ``weight`` the split takes over, in a fixed order."""
    out: list[nn.Module] = []
    for module in model.modules():
        if isinstance(module, EmbeddingCollection):
            out += list(module.embeddings.values())
        elif isinstance(module, EmbeddingBagCollection):
            out += list(module.embedding_bags.values())
    return out


@dataclass
class HostSplitGroups:
    """The process groups of the split: this rank's host and the ranks of the other hosts
    holding the same piece, with the 2-D mesh (hosts, host ranks) the pieces live on."""

    host: dist.ProcessGroup
    replicate: dist.ProcessGroup
    mesh: DeviceMesh
    index: int  # this rank's place in its host
    per_host: int
    hosts: int


def build_split_groups(host_ranks: list[list[int]], device_type: str) -> HostSplitGroups:
    """Groups from the topology's host blocks (collective: every rank calls it). The replicate
    groups are the ranks at the same place in every host."""
    rank, world = dist.get_rank(), dist.get_world_size()
    per_host, hosts = len(host_ranks[0]), len(host_ranks)
    layout = torch.tensor(host_ranks)
    if per_host == world:
        host = dist.group.WORLD
    else:
        host, _ = dist.new_subgroups_by_enumeration(host_ranks)
    replicate, _ = dist.new_subgroups_by_enumeration(layout.t().tolist())
    mesh = DeviceMesh.from_group([replicate, host], device_type, mesh=layout,
                                 mesh_dim_names=("host_replicate", "host_split"))
    row, col = (layout == rank).nonzero()[0].tolist()
    del row
    return HostSplitGroups(host, replicate, mesh, col, per_host, hosts)


@dataclass
class HostSplitTables:
    """The split tables of one model on this rank; see the module docstring."""

    groups: HostSplitGroups
    world: int
    tables: list[_Table] = field(default_factory=list)
    shards: list[nn.Parameter] = field(default_factory=list)
    flat: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    records: list[CollectiveRecord] = field(default_factory=list)
    _pending: _Pending | None = None
    _gathered: list[nn.Parameter] = field(default_factory=list)
    _served: set[int] = field(default_factory=set)
    _owned: dict[int, list[int]] = field(default_factory=dict)  # collection -> its tables
    _live: bool = False

    @classmethod
    def apply(cls, model: nn.Module, groups: HostSplitGroups, world: int) -> HostSplitTables:
        """Split every table of ``model`` in place (every rank must hold the same weights) and
        hook its lookup modules, and ``model`` itself: a forward of the model starts with a
        fresh gather and ends with every gathered table freed, whichever lookups it ran."""
        split = cls(groups, world)
        modules = split_tables(model)
        split._take_tables(modules)
        index = {id(m): i for i, m in enumerate(modules)}
        for collection in model.modules():
            if isinstance(collection, EmbeddingCollection | EmbeddingBagCollection):
                split._owned[id(collection)] = [index[id(m)] for m in split_tables(collection)]
                collection.register_forward_pre_hook(split._before_lookup)
                collection.register_forward_hook(split._after_lookup)
        model.register_forward_pre_hook(split._before_forward)
        model.register_forward_hook(split._after_forward)
        return split

    def _take_tables(self, modules: list[nn.Module]) -> None:
        p, offset = self.groups.per_host, 0
        for module in modules:
            rows, dim = module.weight.shape
            chunk = -(-rows // p)
            self.tables.append(_Table(module, rows, dim, chunk, offset))
            offset += chunk * dim
        weights = [t.module.weight for t in self.tables]
        self.flat = torch.zeros(offset, dtype=weights[0].dtype, device=weights[0].device)
        me = self.groups.index
        for table, weight in zip(self.tables, weights, strict=True):
            n = table.local_rows(me)
            local = self._local_view(table, self.flat)
            local.copy_(weight.detach()[me * table.chunk: me * table.chunk + n])
            shard = nn.Parameter(DTensor.from_local(
                local, self.groups.mesh, [Replicate(), Shard(0)], run_check=False,
                shape=torch.Size((table.rows, table.dim)), stride=(table.dim, 1)))
            table.module._parameters["weight"] = shard
            self.shards.append(shard)
            weight.data = torch.empty(0, dtype=weight.dtype, device=weight.device)

    def _local_view(self, table: _Table, flat: torch.Tensor) -> torch.Tensor:
        n = table.local_rows(self.groups.index)
        return flat[table.offset: table.offset + n * table.dim].view(n, table.dim)

    def table_bytes(self) -> int:
        """Bytes of table rows this rank holds now: its pieces plus any gathered copy."""
        held = self.flat.untyped_storage().nbytes()
        return held + sum(g.untyped_storage().nbytes() for g in self._gathered)

    # -- all-gather ---------------------------------------------------------------------

    def _record(self, op: str, group: str, size: int, payload: int, sent: float) -> None:
        self.records.append(CollectiveRecord(op, group, size, payload, round(sent)))

    def prefetch(self) -> None:
        """Start the all-gather of the pieces as they are now (async); the next lookup waits
        on it. Called after each optimizer step."""
        if self._pending is None:
            with record_function(GATHER_RANGE):
                self._pending = self._start_gather()

    def _start_gather(self) -> _Pending:
        p = self.groups.per_host
        out = torch.empty(p * self.flat.numel(), dtype=self.flat.dtype, device=self.flat.device)
        payload = out.numel() * out.element_size()
        self._record("all_gather", HOST_GROUP, p, payload, ring_all_gather_bytes(payload, p))
        work = None
        if p > 1:
            work = dist.all_gather_into_tensor(out, self.flat, group=self.groups.host,
                                               async_op=True)
        else:
            out.copy_(self.flat)
        return _Pending(out, work, self.flat._version)

    def _gather(self) -> torch.Tensor:
        """The gathered flat buffer of every rank's pieces: the prefetched one if the pieces
        did not change since it started, else a fresh gather."""
        pending, self._pending = self._pending, None
        if pending is not None and pending.work is not None:
            pending.work.wait()
        if pending is None or pending.version != self.flat._version:
            pending = self._start_gather()
            self._pending = None
            if pending.work is not None:
                pending.work.wait()
        return pending.out

    def _before_forward(self, module: nn.Module, args: object) -> None:
        self._live = False

    def _after_forward(self, module: nn.Module, args: object, output: object) -> None:
        """Free what no lookup of this forward used (e.g. a table the model skips)."""
        self._release(range(len(self.tables)))
        if not torch.is_grad_enabled():
            self._gathered = []

    def _before_lookup(self, module: nn.Module, args: object) -> None:
        """At a forward's first lookup (or a lookup module run twice): gather every table
        once, then install this module's whole tables in place of its pieces. Gradients of
        an earlier forward never reduced are dropped."""
        if not self._live or id(module) in self._served:
            self._gathered, self._served = [], set()
            with record_function(WAIT_RANGE):
                out = self._gather().view(self.groups.per_host, -1)
            for table in self.tables:
                full = out[:, table.offset: table.offset + table.padded]
                full = full.reshape(-1, table.dim)[: table.rows].clone()
                self._gathered.append(nn.Parameter(full, requires_grad=torch.is_grad_enabled()))
            del out
            self._live = True
        for i in self._owned[id(module)]:
            self.tables[i].module._parameters["weight"] = self._gathered[i]

    def _after_lookup(self, module: nn.Module, args: object, output: object) -> None:
        """Right after a lookup module ran: free its gathered tables (their backward reads
        only the shape) and put its pieces back."""
        self._served.add(id(module))
        self._release(self._owned[id(module)])

    def _release(self, indices: Iterable[int]) -> None:
        for i in indices:
            if i < len(self._gathered):
                self.tables[i].module._parameters["weight"] = self.shards[i]
                self._gathered[i].untyped_storage().resize_(0)

    # -- gradients ----------------------------------------------------------------------

    def reduce_gradients(self) -> None:
        """After backward: reduce-scatter the gathered tables' gradients inside the host,
        all-reduce the pieces across hosts, average over the world, and hand each piece's
        gradient to its DTensor (what the optimizer steps)."""
        gathered, self._gathered = self._gathered, []
        if gathered:
            with record_function(REDUCE_RANGE):
                self._reduce_into_pieces(gathered)

    def _reduce_into_pieces(self, gathered: list[nn.Parameter]) -> None:
        p, n = self.groups.per_host, self.flat.numel()
        grads = torch.zeros(p, n, dtype=self.flat.dtype, device=self.flat.device)
        for table, full in zip(self.tables, gathered, strict=True):
            if full.grad is not None:
                block = grads[:, table.offset: table.offset + table.padded]
                block.copy_(_padded(full.grad, p * table.chunk).view(p, -1))
        mine = self._reduce(grads)
        for table, shard, full in zip(self.tables, self.shards, gathered, strict=True):
            if full.grad is None:  # a table this step did not look up: no update, as unsplit
                shard.grad = None
                continue
            local = self._local_view(table, mine)
            shard.grad = DTensor.from_local(local, self.groups.mesh, [Replicate(), Shard(0)],
                                            run_check=False, shape=shard.shape,
                                            stride=shard.stride())

    def _reduce(self, grads: torch.Tensor) -> torch.Tensor:
        p, h = self.groups.per_host, self.groups.hosts
        payload = grads.numel() * grads.element_size()
        self._record("reduce_scatter", HOST_GROUP, p, payload, ring_all_gather_bytes(payload, p))
        mine = torch.empty(grads.shape[1], dtype=grads.dtype, device=grads.device)
        if p > 1:
            dist.reduce_scatter_tensor(mine, grads.view(-1), group=self.groups.host)
        else:
            mine.copy_(grads.view(-1))
        piece = mine.numel() * mine.element_size()
        self._record("all_reduce", REPLICATE_GROUP, h, piece, ring_all_reduce_bytes(piece, h))
        if h > 1:
            dist.all_reduce(mine, group=self.groups.replicate)
        return mine.div_(self.world)


def _padded(grad: torch.Tensor, rows: int) -> torch.Tensor:
    if grad.shape[0] == rows:
        return grad
    out = grad.new_zeros(rows, grad.shape[1])
    out[: grad.shape[0]] = grad
    return out
