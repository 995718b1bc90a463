"""parallel.embedding_host_split: replicated tables split over the ranks of each host train
exactly as whole replicated tables do, hold 1/P of the rows (and of Adagrad's state) per rank,
move the bytes `gemctl plan` prices, and checkpoint and resume as split.

Four gloo ranks stand for 2 hosts x 2 (parallel.gpus_per_host=2)."""

from __future__ import annotations

import dataclasses
import functools
import tempfile
from pathlib import Path

import pytest
import torch

from gem_platform.data.meta import SparseFeatureSpec
from gem_platform.parallel.host_split import GATHER_RANGE as GATHER
from gem_platform.parallel.host_split import REDUCE_RANGE as REDUCE
from gem_platform.parallel.host_split import WAIT_RANGE as WAIT
from tests.parallel.harness import shard_batch, spawn, tiny_meta, tiny_recipe

WORLD, PER_HOST = 4, 2
STEPS, SAVE_AT = 20, 15


def even_meta():
    """Tables whose rows divide by the split (50, 20 and 8 rows): no padding, so the bytes
    moved are exactly the tables' bytes."""
    return dataclasses.replace(
        tiny_meta(), num_items=49,
        sparse_features=[SparseFeatureSpec("user_id", 20), SparseFeatureSpec("genre", 8, True)])


def recipe(split: bool):
    return tiny_recipe(workers=WORLD, gpus_per_host=PER_HOST, embedding_host_split=split)


def _build(split: bool):
    from gem_platform.parallel import parallelize
    from gem_platform.train.loop import build_model

    r = recipe(split)
    par = parallelize(build_model(r, even_meta(), torch.device("cpu")), r)
    dense = torch.optim.AdamW(par.dense_params, lr=r.train.lr, weight_decay=0.0)
    sparse = torch.optim.Adagrad(par.sparse_params, lr=r.train.sparse_lr, eps=r.train.sparse_eps)
    return r, par, [dense, sparse]


def _steps(r, par, optimizers, rank: int, steps: range, peaks: list[int]) -> list[float]:
    """The product loop's order of calls; ``peaks`` gets the split's table bytes at the start
    of each backward (the step's memory peak: every activation still held)."""
    from gem_platform.train.loop import compute_loss

    losses = []
    for s in steps:
        batch = shard_batch(even_meta(), rank, s)
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        logits = par.model(batch)
        if par.host_split is not None:
            logits.register_hook(lambda g: peaks.append(par.host_split.table_bytes()))
        loss, _ = compute_loss(logits, batch)
        loss.backward()
        par.sync_gradients()
        par.clip_grad_norm_(r.train.grad_clip)
        for opt in optimizers:
            opt.step()
        par.after_optimizer_step()
        losses.append(float(loss.detach()))
    return losses


def _full_state(par, sparse_opt) -> dict[str, torch.Tensor]:
    """Every table and its Adagrad sum, whole (gathered from the pieces where split)."""
    from torch.distributed.tensor import DTensor

    out = {}
    whole = lambda t: t.full_tensor() if isinstance(t, DTensor) else t  # noqa: E731
    names = {id(p): n for n, p in par.model.named_parameters()}
    for p in par.sparse_params:
        out[names[id(p)]] = whole(p.detach()).clone()
        out[names[id(p)] + ".sum"] = whole(sparse_opt.state[p]["sum"]).clone()
    return out


def _plan_collectives(r):
    from gem_platform.model.gem import GemModel
    from gem_platform.model.sizes import model_sizes
    from gem_platform.topology import ClusterShape, build_plan

    with torch.device("meta"):
        sizes = model_sizes(GemModel(r.model, even_meta()), r)
    plan = build_plan(r.parallel, ClusterShape(WORLD, PER_HOST), sizes)
    return plan, {(c.op, c.group): c for c in plan.collectives}


def _job(folder: str, rank: int, world: int) -> dict:
    from gem_platform.checkpoint.store import Stateful

    r, par, opts = _build(False)
    plain = _steps(r, par, opts, rank, range(STEPS), [])
    plain_state = _full_state(par, opts[1])
    plain_bytes = sum(p.untyped_storage().nbytes() for p in par.sparse_params)

    r, par, opts = _build(True)
    peaks: list[int] = []
    split = _steps(r, par, opts, rank, range(SAVE_AT), peaks)
    state = Stateful(par.model, opts, r.parallel.model_dump(mode="json"), world)
    state.save(Path(folder), SAVE_AT, rank, {"step": SAVE_AT})
    split += _steps(r, par, opts, rank, range(SAVE_AT, STEPS), peaks)
    split_state = _full_state(par, opts[1])
    adagrad_bytes = sum(opts[1].state[p]["sum"].to_local().untyped_storage().nbytes()
                        for p in par.sparse_params)
    pieces_bytes = par.host_split.flat.untyped_storage().nbytes()
    records = list(par.host_split.records)

    r, par, opts = _build(True)
    Stateful(par.model, opts, r.parallel.model_dump(mode="json"), world).load(Path(folder), rank)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        resumed = _steps(r, par, opts, rank, range(SAVE_AT, STEPS), [])
    ranges = [e.name for e in sorted(prof.events(), key=lambda e: e.time_range.start)
              if e.name.startswith("gem.host_split")]
    return dict(ranges=ranges, plain=plain, split=split, resumed=resumed, plain_state=plain_state,
                split_state=split_state, resumed_state=_full_state(par, opts[1]),
                plain_bytes=plain_bytes, pieces_bytes=pieces_bytes, adagrad_bytes=adagrad_bytes,
                peaks=peaks, records=records, strategy=par.strategy)


@pytest.mark.slow
def test_host_split_trains_as_replicated_tables_and_resumes():
    with tempfile.TemporaryDirectory() as folder:
        results = spawn(functools.partial(_job, folder), WORLD)
    plan, priced = _plan_collectives(recipe(True))
    for rank, res in enumerate(results):
        assert res["strategy"] == "embedding_host_split"
        # Losses of this rank's shards equal whole replicated tables', step by step; so do
        # the tables and Adagrad's accumulated squares (which a wrongly scaled gradient
        # would change even where Adagrad's update does not).
        assert res["split"] == pytest.approx(res["plain"], rel=1e-5, abs=1e-6), rank
        assert len(set(res["plain"])) > 1
        for name, tensor in res["plain_state"].items():
            torch.testing.assert_close(res["split_state"][name], tensor, rtol=1e-5, atol=1e-6)
        # Resumed from the step-15 checkpoint: the same last five steps and the same state.
        assert res["resumed"] == pytest.approx(res["split"][SAVE_AT:], rel=1e-6, abs=1e-7)
        for name, tensor in res["split_state"].items():
            torch.testing.assert_close(res["resumed_state"][name], tensor, rtol=1e-6, atol=1e-7)
        # Rows and optimizer state per rank: 1/P of the whole tables, also at the peak.
        assert res["pieces_bytes"] * PER_HOST == res["plain_bytes"]
        assert res["adagrad_bytes"] * PER_HOST == res["plain_bytes"]
        assert res["peaks"] == [res["pieces_bytes"]] * STEPS
        assert plan.memory_per_rank()["embedding_tables"] == res["pieces_bytes"]
        _assert_bytes_as_planned(res["records"], priced)
        # In a trace: the first forward after loading waits on its own gather; from then on
        # each step's gather is launched right after the optimizer step before it.
        steps = STEPS - SAVE_AT
        assert res["ranges"] == [WAIT, REDUCE] + [GATHER, WAIT, REDUCE] * (steps - 1) + [GATHER]


def _assert_bytes_as_planned(records, priced) -> None:
    """Each collective moves the plan's payload and per-rank bytes. The all-gather runs once
    per step plus the prefetch started after the last step (each forward uses the one started
    after the step before: no second gather)."""
    calls = {key: 0 for key in priced}
    for rec in records:
        c = priced[rec.op, rec.group]
        assert (rec.group_size, rec.payload_bytes, rec.sent_bytes) == (
            c.group_size, c.payload_bytes, c.bytes_per_rank), rec
        calls[rec.op, rec.group] += 1
    assert calls["all_gather", "embedding_host"] == STEPS + 1
    assert calls["reduce_scatter", "embedding_host"] == STEPS
    assert calls["all_reduce", "embedding_split_replicate"] == STEPS


@pytest.mark.parametrize("field", [
    {"embedding_sharding": "row_wise"}, {"embedding_group": 2}, {"hsdp_shard_group": 2},
    {"expert_parallel": 2}])
def test_host_split_beside_other_strategies_is_refused(field):
    """Splitting TorchRec-sharded tables over a host is planned but not trained, nor is the
    split beside HSDP or expert parallelism: refused, naming the field and the fix."""
    from gem_platform.errors import RecipeError

    r = tiny_recipe(workers=WORLD, gpus_per_host=PER_HOST, embedding_host_split=True, **field)
    with pytest.raises(RecipeError, match="embedding_host_split") as err:
        r.parallel.check_host_split_trained()
    assert f"parallel.{next(iter(field))}" in str(err.value)
    assert "Remove parallel.embedding_host_split" in str(err.value)


def _layout_recipe(world: int, split: bool, per_host: int):
    return tiny_recipe(workers=world, gpus_per_host=per_host, embedding_host_split=split)


def _build_as(r):
    from gem_platform.parallel import parallelize
    from gem_platform.train.loop import build_model

    par = parallelize(build_model(r, even_meta(), torch.device("cpu")), r)
    dense = torch.optim.AdamW(par.dense_params, lr=r.train.lr, weight_decay=0.0)
    sparse = torch.optim.Adagrad(par.sparse_params, lr=r.train.sparse_lr, eps=r.train.sparse_eps)
    return par, [dense, sparse]


# (saved as: split, ranks per host) -> (resumed as): split pieces to whole tables, whole
# tables to pieces, and pieces of a 2-rank host re-cut for hosts of one rank.
RESHARDS = {"split_to_whole": ((True, 2), (False, 2)), "whole_to_split": ((False, 2), (True, 2)),
            "split_to_other_hosts": ((True, 2), (True, 1))}


def _reshard_job(folder: str, rank: int, world: int) -> dict:
    from gem_platform.checkpoint.store import Stateful

    out = {}
    for name, (before, after) in RESHARDS.items():
        r = _layout_recipe(world, *before)
        par, opts = _build_as(r)
        _steps(r, par, opts, rank, range(2), [])
        path = Path(folder) / name
        Stateful(par.model, opts, r.parallel.model_dump(mode="json"), world).save(
            path, 2, rank, {"step": 2})
        saved = _full_state(par, opts[1])
        r = _layout_recipe(world, *after)
        par, opts = _build_as(r)
        Stateful(par.model, opts, r.parallel.model_dump(mode="json"), world).load(path, rank)
        out[name] = saved, _full_state(par, opts[1]), par.strategy
    return out


@pytest.mark.slow
def test_split_checkpoint_resumes_under_another_split_or_whole_tables():
    """torch.distributed.checkpoint reshards the split pieces (DTensors) and their Adagrad
    state by their global offsets: every table and Adagrad sum after loading equals the
    saved one, compared whole."""
    with tempfile.TemporaryDirectory() as folder:
        results = spawn(functools.partial(_reshard_job, folder), 2)
    for res in results:
        for name, (saved, loaded, strategy) in res.items():
            assert strategy == ("data_parallel" if name == "split_to_whole"
                                else "embedding_host_split")
            assert saved.keys() == loaded.keys()
            for key, tensor in saved.items():
                torch.testing.assert_close(loaded[key], tensor, rtol=0, atol=0,
                                           msg=f"{name}: {key}")


class _SkipsItems(torch.nn.Module):
    """Item and feature tables, of which a forward may look up only the features (as GemModel
    does with model.item_vectors=planted)."""

    def __init__(self) -> None:
        super().__init__()
        from torchrec import (
            EmbeddingBagCollection,
            EmbeddingBagConfig,
            EmbeddingCollection,
            EmbeddingConfig,
        )

        self.items = EmbeddingCollection(tables=[EmbeddingConfig(
            name="item", embedding_dim=4, num_embeddings=6, feature_names=["i"])])
        self.features = EmbeddingBagCollection(tables=[EmbeddingBagConfig(
            name="f", embedding_dim=4, num_embeddings=5, feature_names=["f"])])

    def forward(self, ids, use_items: bool) -> torch.Tensor:
        from torchrec import KeyedJaggedTensor

        kjt = lambda key: KeyedJaggedTensor.from_lengths_sync(  # noqa: E731
            [key], ids, torch.ones_like(ids))
        out = self.features(kjt("f")).values().sum()
        if use_items:
            out = out + self.items(kjt("i"))["i"].values().sum()
        return out


def test_a_forward_that_skips_a_table_frees_it_and_leaves_it_untouched():
    """A forward that looks up only some tables still frees every gathered copy by its end;
    the skipped table gets no gradient (no update, as whole tables), and the next forward
    looks up the pieces as they are now, never a stale copy."""
    from gem_platform.parallel.host_split import HostSplitTables, build_split_groups
    from gem_platform.parallel.single import ensure_process_group

    created = not torch.distributed.is_initialized()
    ensure_process_group(torch.device("cpu"))
    try:
        model = _SkipsItems()
        split = HostSplitTables.apply(model, build_split_groups([[0]], "cpu"), 1)
        ids = torch.tensor([0, 3, 4])
        model(ids, use_items=False).backward()
        assert split.table_bytes() == split.flat.untyped_storage().nbytes()
        split.reduce_gradients()
        items, features = split.shards
        assert items.grad is None and features.grad is not None
        with torch.no_grad():
            features.to_local().add_(1.0)
        before = model(ids, use_items=True)
        with torch.no_grad():
            features.to_local().add_(1.0)
        assert float(model(ids, use_items=True) - before) == pytest.approx(3 * 4)
        assert split.table_bytes() == split.flat.untyped_storage().nbytes()
    finally:
        if created:  # later tests start their own default group
            torch.distributed.destroy_process_group()
