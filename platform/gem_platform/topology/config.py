"""The recipe's `parallel:` section: how many workers, how they map onto hosts and zones, and
the size of each parallel dimension (HSDP shard group, expert parallelism, embedding groups).

Sizes are checked against the world size here (divisibility); whether a group stays inside the
network tier it should is checked against the concrete cluster in `mesh.py`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from gem_platform.errors import RecipeError

EmbeddingSharding = Literal["auto", "table_wise", "row_wise", "column_wise", "table_row_wise"]
Backend = Literal["auto", "gloo", "nccl"]


# Ranks a run or a plan may span: more than any cluster trains one model on together. A plan
# lists every rank's process groups and a run starts a worker per rank, so a larger size is a
# typo (an extra digit), refused at once rather than planned for minutes.
MAX_WORLD = 131_072
MAX_CPUS_PER_WORKER = 4096


def divisors(n: int) -> list[int]:
    """All positive divisors of ``n``, ascending (used to suggest valid sizes in errors); in
    sqrt(n) steps, so an error about a huge size is still immediate."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def _suggest(n: int, limit: int = 12) -> str:
    """Divisors of ``n`` for an error message, elided in the middle when there are many."""
    ds = [str(d) for d in divisors(n)]
    if len(ds) > limit:
        ds = ds[: limit // 2] + ["..."] + ds[-limit // 2 :]
    return ", ".join(ds)


def _require_divides(field: str, value: int, of_field: str, of_value: int) -> None:
    if of_value % value != 0:
        raise RecipeError(
            f"parallel.{field}={value} does not divide {of_field}={of_value}.",
            f"Choose a divisor of {of_value} ({_suggest(of_value)}).",
        )


class ParallelConfig(BaseModel):
    """How a run is spread over workers. Every size counts ranks unless its name says hosts.

    ``hsdp_shard_group``: ranks that FSDP-shard the dense parameters; groups of that size are
    replicated (gradient all-reduce) across the rest. None shards over all ranks (plain FSDP),
    1 keeps full replicas (DDP-like).
    ``expert_parallel``: GPUs of one host that each hold a different expert and exchange
    activations over NVLink. ``expert_shard_hosts``: hosts over which each expert's parameters
    are FSDP-sharded (None = as many hosts as the dense shard group spans).
    ``embedding_group``: ranks that together hold one full copy of the embedding tables
    (all_to_all stays inside it; groups are data parallel). None = all ranks.
    ``embedding_host_split``: split each rank's embedding shard again over the GPUs of its host
    (all-gather before lookups, reduce-scatter after, over NVLink). With replicated tables
    (no layout, no embedding group) the shard is the whole tables: each rank keeps 1/P of
    them, P = ranks per host, and the pieces' gradients are all-reduced across hosts.
    """

    model_config = ConfigDict(extra="forbid")

    workers: int = Field(2, ge=1, le=MAX_WORLD, description="World size of the run.")
    gpus_per_host: int | None = Field(
        None, ge=1, le=MAX_WORLD,
        description="Ranks per host; None = discover (CPU workers: 1 per host)."
    )
    hosts_per_zone: int | None = Field(
        None, ge=1, le=MAX_WORLD,
        description="Hosts per network zone; None = discover (or one zone)."
    )
    hsdp_shard_group: int | None = Field(None, ge=1, le=MAX_WORLD)
    expert_parallel: int = Field(1, ge=1, le=MAX_WORLD)
    expert_shard_hosts: int | None = Field(None, ge=1, le=MAX_WORLD)
    embedding_group: int | None = Field(None, ge=1, le=MAX_WORLD)
    embedding_host_split: bool = False
    embedding_sharding: EmbeddingSharding = "auto"
    backend: Backend = "auto"
    use_gpu: bool = False
    cpus_per_worker: int = Field(1, ge=1, le=MAX_CPUS_PER_WORKER)
    zone_label: str = "gem.zone"

    def resolved_backend(self) -> Literal["gloo", "nccl"]:
        """NCCL for GPU workers, gloo for CPU workers, unless set explicitly."""
        if self.backend != "auto":
            return self.backend
        return "nccl" if self.use_gpu else "gloo"

    def ranks_per_host(self) -> int | None:
        """Ranks on one host: the configured value, 1 for CPU workers, None = discover GPUs."""
        if self.gpus_per_host is not None:
            return self.gpus_per_host
        return None if self.use_gpu else 1

    def tables_replicated(self) -> bool:
        """True when no embedding layout or group is asked for: the tables are not sharded by
        TorchRec but kept whole on every rank (or, split over each host, in pieces)."""
        return self.embedding_sharding == "auto" and self.embedding_group is None

    def check_host_split_trained(self) -> None:
        """RecipeError naming the field when embedding_host_split is combined with a strategy
        training does not run beside it: the split is trained on replicated tables with
        data-parallel dense parameters (gemctl plan prices the other combinations too)."""
        if not self.embedding_host_split:
            return
        others = {"embedding_sharding": self.embedding_sharding != "auto",
                  "embedding_group": self.embedding_group is not None,
                  "hsdp_shard_group": self.hsdp_shard_group is not None,
                  "expert_parallel": self.expert_parallel > 1}
        asked = [f"parallel.{name}={getattr(self, name)}" for name, on in others.items() if on]
        if asked:
            raise RecipeError(
                "parallel.embedding_host_split is trained on replicated tables with "
                f"data-parallel dense parameters only; this recipe also sets {', '.join(asked)}. "
                "Splitting TorchRec-sharded tables over a host, and HSDP or expert parallelism "
                "beside the split, are planned by gemctl plan but not trained yet.",
                "Remove parallel.embedding_host_split, or leave embedding_sharding at auto and "
                "embedding_group, hsdp_shard_group and expert_parallel unset.",
            )

    def shard_size(self, world: int | None = None) -> int:
        """Ranks in one dense shard group (the whole world when unset)."""
        world = self.workers if world is None else world
        return world if self.hsdp_shard_group is None else self.hsdp_shard_group

    def embedding_size(self, world: int | None = None) -> int:
        """Ranks holding one full copy of the embedding tables."""
        world = self.workers if world is None else world
        return world if self.embedding_group is None else self.embedding_group

    def validate_against_world(self, world: int | None = None) -> None:
        """Raise RecipeError (naming the field and the valid choices) when a size doesn't divide
        the world size, the host size or the host count. ``world`` defaults to ``workers``;
        host checks run when the ranks per host are known (set, or 1 for CPU workers)."""
        world = self.workers if world is None else world
        self.validate_world(world)
        per_host = self.ranks_per_host()
        if per_host is not None:
            self.validate_hosts(world, per_host)

    def validate_world(self, world: int) -> None:
        """Checks that need only the world size."""
        wfield = "parallel.workers"
        if self.hsdp_shard_group is not None:
            _require_divides("hsdp_shard_group", self.hsdp_shard_group, wfield, world)
        if self.embedding_group is not None:
            _require_divides("embedding_group", self.embedding_group, wfield, world)
        _require_divides("expert_parallel", self.expert_parallel, wfield, world)

    def validate_hosts(self, world: int, per_host: int) -> None:
        """Checks against ``per_host`` ranks on every host. A partial last zone is allowed:
        whether groups stay inside zones is checked on the placement (mesh.py)."""
        wfield = "parallel.workers"
        if per_host > world:
            raise RecipeError(
                f"parallel.gpus_per_host={per_host} is larger than {wfield}={world}.",
                f"Set parallel.workers to a multiple of {per_host} or lower gpus_per_host.",
            )
        _require_divides("gpus_per_host", per_host, wfield, world)
        if per_host % self.expert_parallel != 0:
            raise RecipeError(
                f"parallel.expert_parallel={self.expert_parallel} does not divide "
                f"parallel.gpus_per_host={per_host}: the GPUs of an expert group exchange "
                "activations every expert layer and must share a host (NVLink).",
                f"Choose a divisor of {per_host} ({_suggest(per_host)}).",
            )
        hosts = world // per_host
        if self.expert_shard_hosts is not None:
            _require_divides("expert_shard_hosts", self.expert_shard_hosts, "the host count", hosts)
