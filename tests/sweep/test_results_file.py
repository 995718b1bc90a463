"""A results file's header describes the trials it holds, not the call that wrote it last."""
import json
from pathlib import Path

from gem_platform.sweep.results import TrialRun, load_results, looks_of, rounds_of, write_results


def test_a_resumed_file_lists_every_seed_it_holds(tmp_path: Path):
    """A sweep resumed for seeds 2-3 writes its header with its own plan's seeds and device;
    the file holds seeds 0-3 (the earlier call's too) from two cards and commits, and its
    header says so."""
    trials = [TrialRun(f"{arm}{seed}", arm, str(seed), {"eval/ne_ctr": 0.9},
                       commit="b2" if seed in (2, 3) else "a1",
                       device="NVIDIA H200" if seed in (2, 3) else "NVIDIA H100 80GB HBM3")
              for seed in (0, 1, 10, 2, 3) for arm in ("base", "arm")]
    header = {"sweep": "s", "baseline": "base", "seeds": [2, 3],
              "provenance": {"seeds": [2, 3], "fingerprint": "f00d"}}
    write_results(tmp_path / "r.json", header, trials)
    kept, written = load_results(tmp_path / "r.json")
    assert written["seeds"] == [0, 1, 2, 3, 10] and len(kept) == 10
    assert written["devices"] == ["NVIDIA H100 80GB HBM3", "NVIDIA H200"]
    assert written["commits"] == ["a1", "b2"]
    assert written["provenance"] == header["provenance"]  # the last call's own record
    empty = json.loads(write_results(tmp_path / "empty.json", header, []).read_text())
    assert empty["seeds"] == [2, 3]  # nothing trained yet: the plan's


def test_the_looks_are_the_paired_counts_after_each_round():
    """A round that adds no pair (or only trials of other arms) is no new look; seeds the gate
    does not pair (another device) don't count; under 2 pairs there is no interval to read."""
    rounds = [["base/0", "arm/0"], ["base/1", "arm/1", "base/2", "other/2"], ["arm/2"],
              ["arm/3"], ["base/4", "arm/4"]]
    assert looks_of(rounds, "arm", "base", ["0", "1", "2", "3", "4"]) == [2, 3, 4]
    assert looks_of(rounds, "arm", "base", ["0", "1", "2"]) == [2, 3]  # 4 trained apart
    assert looks_of(rounds, "other", "base", ["2"]) == []


def test_a_file_without_rounds_is_one_round():
    trials = [TrialRun(f"{a}{s}", a, s, {}) for s in ("0", "1") for a in ("base", "arm")]
    assert rounds_of({}, trials) == [["base/0", "arm/0", "base/1", "arm/1"]]
    assert rounds_of({"rounds": [["arm/0"], [3]]}, trials) == rounds_of({}, trials)  # malformed
    assert rounds_of({"rounds": [["arm/0"], []]}, trials) == [["arm/0"], []]
    assert rounds_of({}) == []
