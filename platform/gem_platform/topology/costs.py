"""Bytes each collective moves per training step, from the model's sizes.

Convention: ``bytes_per_rank`` is what one rank sends per step under the bandwidth-optimal
algorithm (ring all-gather / reduce-scatter / all-reduce, pairwise all_to_all), the quantity
NCCL's "bus bandwidth" is measured against; so time on a tier ~= bytes_per_rank / link
bandwidth of that tier. ``total_bytes`` = bytes_per_rank x participating ranks: the load the
whole tier carries. Latency terms and message splitting are ignored: these are the numbers that
show which tier carries what, not a runtime prediction.
"""

from __future__ import annotations

from dataclasses import dataclass

from gem_platform.topology.cluster import Tier


@dataclass(frozen=True)
class ModelSizes:
    """What the communication volume depends on; the trainer computes it from the model.

    dense_params: parameters of the dense (non-expert, non-embedding) network.
    expert_params: parameters of ONE expert; num_experts: experts per expert layer set.
    embedding_table_bytes: bytes of each embedding table (rows x dim x dtype bytes).
    pooled_embedding_bytes_per_sample: bytes of one sample's pooled embeddings, summed over
        features (sum of pooled dims x dtype bytes): what the embedding all_to_all carries.
    embedding_lookup_bytes_per_sample: bytes of the rows one sample looks up (ids x dim x
        dtype bytes), i.e. its sparse gradient; None = same as the pooled bytes (1 id/feature).
    expert_activation_bytes_per_sample: bytes of one sample's input to an expert (its output
        is assumed the same size).
    local_batch: samples per rank per step.
    param_bytes / grad_bytes: dtype sizes of gathered parameters and reduced gradients.
    reshard_after_forward: FSDP frees gathered parameters after forward and gathers them again
        in backward (two all-gathers per step), the memory-saving default.
    """

    dense_params: int
    expert_params: int = 0
    num_experts: int = 0
    embedding_table_bytes: tuple[int, ...] = ()
    pooled_embedding_bytes_per_sample: int = 0
    embedding_lookup_bytes_per_sample: int | None = None
    expert_activation_bytes_per_sample: int = 0
    local_batch: int = 1
    param_bytes: int = 2
    grad_bytes: int = 4
    reshard_after_forward: bool = True

    @property
    def embedding_bytes(self) -> int:
        return sum(self.embedding_table_bytes)

    @property
    def lookup_bytes_per_sample(self) -> int:
        if self.embedding_lookup_bytes_per_sample is None:
            return self.pooled_embedding_bytes_per_sample
        return self.embedding_lookup_bytes_per_sample


def ring_all_gather_bytes(total: float, n: int) -> float:
    """All-gather of a ``total``-byte tensor over n ranks: each sends its 1/n piece to n-1
    ranks' worth of ring steps: total x (n-1)/n."""
    return total * (n - 1) / n if n > 1 else 0.0


def ring_reduce_scatter_bytes(total: float, n: int) -> float:
    """Reduce-scatter of a ``total``-byte tensor over n ranks: total x (n-1)/n, like all-gather."""
    return ring_all_gather_bytes(total, n)


def ring_all_reduce_bytes(total: float, n: int) -> float:
    """All-reduce = reduce-scatter + all-gather: 2 x total x (n-1)/n."""
    return 2 * ring_all_gather_bytes(total, n)


def all_to_all_bytes(buffer: float, n: int) -> float:
    """all_to_all where each rank's ``buffer`` is split evenly over n ranks: the 1/n addressed
    to itself stays local, buffer x (n-1)/n leaves."""
    return buffer * (n - 1) / n if n > 1 else 0.0


@dataclass(frozen=True)
class Collective:
    """One collective of a step, on one kind of process group."""

    name: str
    op: str
    group: str
    group_size: int
    num_groups: int
    tier: Tier
    calls_per_step: int
    payload_bytes: int
    bytes_per_rank: int
    counts: str

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_rank * self.group_size * self.num_groups


def fsdp_collectives(
    label: str,
    group: str,
    params: int,
    shard: int,
    num_groups: int,
    tier: Tier,
    sizes: ModelSizes,
) -> list[Collective]:
    """FSDP on a shard group of ``shard`` ranks: all-gather of the full parameters before use
    (twice with reshard_after_forward: forward and backward), reduce-scatter of the gradients
    after backward. Payload = the unsharded parameters (or gradients)."""
    gathers = 2 if sizes.reshard_after_forward else 1
    ag_payload = params * sizes.param_bytes
    rs_payload = params * sizes.grad_bytes
    return [
        Collective(
            f"{label} param all-gather",
            "all_gather",
            group,
            shard,
            num_groups,
            tier,
            gathers,
            ag_payload,
            round(gathers * ring_all_gather_bytes(ag_payload, shard)),
            f"{params:,} params x {sizes.param_bytes} B, gathered over {shard} ranks, "
            f"{gathers}x per step",
        ),
        Collective(
            f"{label} grad reduce-scatter",
            "reduce_scatter",
            group,
            shard,
            num_groups,
            tier,
            1,
            rs_payload,
            round(ring_reduce_scatter_bytes(rs_payload, shard)),
            f"{params:,} grads x {sizes.grad_bytes} B, reduced over {shard} ranks",
        ),
    ]


def replicate_all_reduce(
    label: str,
    group: str,
    params: int,
    shard: int,
    replicas: int,
    num_groups: int,
    tier: Tier,
    sizes: ModelSizes,
) -> Collective:
    """HSDP: each rank all-reduces its 1/shard slice of the gradients with the ``replicas``
    ranks holding the same slice, once per step. Payload = params / shard x grad bytes."""
    payload = params * sizes.grad_bytes / shard
    return Collective(
        f"{label} grad all-reduce",
        "all_reduce",
        group,
        replicas,
        num_groups,
        tier,
        1,
        round(payload),
        round(ring_all_reduce_bytes(payload, replicas)),
        f"1/{shard} of {params:,} grads x {sizes.grad_bytes} B, across {replicas} replicas",
    )


def expert_all_to_all(ep: int, num_groups: int, tier: Tier, sizes: ModelSizes) -> Collective:
    """Expert parallelism: every expert of an EP group processes every sample of the group, so
    each rank sends its local batch's expert inputs to the ep-1 partners and gets their
    outputs back (dispatch + combine), and the same again for the gradients in backward: 4
    all_to_alls of a buffer of ep x local_batch x activation bytes."""
    buffer = ep * sizes.local_batch * sizes.expert_activation_bytes_per_sample
    return Collective(
        "expert activation all_to_all",
        "all_to_all",
        "expert",
        ep,
        num_groups,
        tier,
        4,
        buffer,
        round(4 * all_to_all_bytes(buffer, ep)),
        f"{sizes.local_batch} samples x {sizes.expert_activation_bytes_per_sample} B to each "
        f"of {ep - 1} partner(s); dispatch+combine, forward+backward",
    )


def embedding_all_to_all(
    group: int, num_groups: int, tier: Tier, sizes: ModelSizes, group_name: str = "embedding"
) -> Collective:
    """Sharded embeddings: a rank's samples need pooled embeddings from every shard of its
    group; with tables spread evenly, (group-1)/group of them come from other ranks. One
    all_to_all forward (pooled embeddings), one backward (their gradients). The id all_to_all
    before lookups is not counted (ids are a few bytes vs dim x dtype bytes per row)."""
    buffer = sizes.local_batch * sizes.pooled_embedding_bytes_per_sample
    return Collective(
        "embedding pooled all_to_all",
        "all_to_all",
        group_name,
        group,
        num_groups,
        tier,
        2,
        buffer,
        round(2 * all_to_all_bytes(buffer, group)),
        f"{sizes.local_batch} samples x {sizes.pooled_embedding_bytes_per_sample} B pooled, "
        f"within {group} ranks; forward+backward",
    )


def embedding_replica_sync(
    group: int, replicas: int, num_groups: int, tier: Tier, sizes: ModelSizes
) -> Collective:
    """Data parallelism across embedding-table copies: the rows a step touched must agree
    between copies. Estimate: a shard owner's rows touched by its group's batch ~= local_batch
    x lookup bytes per sample (group x local_batch samples over group shards), all-reduced
    across the ``replicas`` copies of that shard. An upper bound when ids repeat."""
    payload = sizes.local_batch * sizes.lookup_bytes_per_sample
    return Collective(
        "embedding replica row sync",
        "all_reduce",
        "embedding_replicate",
        replicas,
        num_groups,
        tier,
        1,
        payload,
        round(ring_all_reduce_bytes(payload, replicas)),
        f"rows touched: {sizes.local_batch} samples x {sizes.lookup_bytes_per_sample} B, "
        f"across {replicas} copies of the tables",
    )


def embedding_host_split(
    group: int, per_host: int, num_groups: int, tier: Tier, sizes: ModelSizes
) -> list[Collective]:
    """Third-generation split: a rank's 1/group shard of the tables is split again over the
    per_host GPUs of its host; it is all-gathered over NVLink before lookups and its gradient
    reduce-scattered after backward. Payload = embedding bytes / group."""
    payload = sizes.embedding_bytes / group
    ag = ring_all_gather_bytes(payload, per_host)
    note = f"1/{group} of {sizes.embedding_bytes:,} B of tables, over {per_host} ranks of a host"
    return [
        Collective(
            "embedding shard all-gather",
            "all_gather",
            "embedding_host",
            per_host,
            num_groups,
            tier,
            1,
            round(payload),
            round(ag),
            note,
        ),
        Collective(
            "embedding shard reduce-scatter",
            "reduce_scatter",
            "embedding_host",
            per_host,
            num_groups,
            tier,
            1,
            round(payload),
            round(ag),
            note,
        ),
    ]


def embedding_split_replicate(
    per_host: int, hosts: int, num_groups: int, tier: Tier, sizes: ModelSizes
) -> Collective:
    """Host-split replicated tables: each rank's 1/per_host piece of the tables' gradient
    (reduce-scattered inside its host) is all-reduced with the ranks holding the same piece on
    the other ``hosts`` hosts. Payload = embedding bytes / per_host."""
    payload = sizes.embedding_bytes / per_host
    return Collective(
        "embedding split grad all-reduce",
        "all_reduce",
        "embedding_split_replicate",
        hosts,
        num_groups,
        tier,
        1,
        round(payload),
        round(ring_all_reduce_bytes(payload, hosts)),
        f"1/{per_host} of {sizes.embedding_bytes:,} B of table gradients, across {hosts} hosts",
    )
