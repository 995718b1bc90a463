"""Work done once per run: launch.submit prepares each dataset once and hands its meta to the
ranks (which do not prepare it again), and a rank reads its rank and picks its device once.
The real functions run; the test only counts their calls."""

from __future__ import annotations

from gem_platform.launch import submit
from gem_platform.recipe import recipe_from_dict
from tests.tiny_training import tiny_tree


def test_a_run_prepares_its_dataset_once_and_picks_its_device_once(tmp_path, monkeypatch):
    import gem_platform.data.prepare as prepare
    import gem_platform.train.loop as loop

    calls = {"prepare": 0, "device": 0, "rank": 0}

    def counted(name, real):
        def call(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)
        return call

    prepare_dataset = counted("prepare", prepare.prepare_dataset)
    monkeypatch.setattr(prepare, "prepare_dataset", prepare_dataset)
    monkeypatch.setattr(loop, "prepare_dataset", prepare_dataset)
    monkeypatch.setattr(loop, "pick_device", counted("device", loop.pick_device))
    current = loop.RankInfo.current
    monkeypatch.setattr(loop.RankInfo, "current",
                        classmethod(lambda cls: counted("rank", current)()))
    tree = tiny_tree(tmp_path / "data", steps=2)
    tree["tracking"] = {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "experiment": "once"}
    outcome = submit(recipe_from_dict(tree), local=True, echo=lambda event: None)
    assert outcome.summary["train/steps"] == 2.0
    assert calls == {"prepare": 1, "device": 1, "rank": 1}
