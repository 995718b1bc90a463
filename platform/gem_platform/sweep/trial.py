"""One trial of a sweep, run by Ray Tune: train one (arm, seed) as a child MLflow run.

An arm with ``parallel.workers == 1`` trains inside the trial process (the Tune function
trainable is the training run); an arm with more workers makes the trial the driver of a Ray
Train ``TorchTrainer`` (Train V2), so every trial is a real training run of its recipe.

Before training, the trial looks its (sweep, arm, seed) up in MLflow: a finished run is
reused (a resumed sweep never trains it twice) and an unfinished one, left by an interrupted
launch, is deleted so the sweep ends with exactly one child run per trial.
"""

from __future__ import annotations

from typing import Any

from gem_platform.progress import in_trial
from gem_platform.recipe import Recipe
from gem_platform.sweep import store
from gem_platform.sweep.results import finite_metrics

REPORT_KEYS = ("eval/ne_ctr", "eval/auc_ctr", "eval/ne_cvr", "eval/auc_cvr", "perf/qps")


def trial_tags(sweep_id: str, parent_run_id: str, arm: str, seed: int) -> dict[str, str]:
    return {store.TAG_PARENT: parent_run_id, store.TAG_SWEEP: sweep_id,
            store.TAG_ROLE: store.ROLE_CHILD, store.TAG_ARM: arm, store.TAG_SEED: str(seed)}


def child_recipe(recipe: Recipe, sweep_id: str, parent_run_id: str, arm: str, seed: int
                 ) -> Recipe:
    tracking = recipe.tracking.model_copy(update={
        "run_name": f"{sweep_id}/{arm}/seed{seed}",
        "tags": {**recipe.tracking.tags, **trial_tags(sweep_id, parent_run_id, arm, seed)},
    })
    return recipe.model_copy(update={"tracking": tracking})


def _report(summary: dict[str, Any], run_id: str, reused: bool) -> dict[str, Any]:
    finite = finite_metrics(summary)
    return {"run_id": run_id, "reused": reused,
            **{key: finite[key] for key in REPORT_KEYS if key in finite}}


def settle_earlier_attempts(recipe: Recipe, sweep_id: str, arm: str, seed: int
                            ) -> dict[str, Any] | None:
    """Return the finished run's report if this trial already ran; delete unfinished ones."""
    c = store.client(recipe.tracking.uri or "")
    exp = c.get_experiment_by_name(recipe.tracking.experiment)
    if exp is None:
        return None
    finished = None
    for run in store.trial_runs(c, exp.experiment_id, sweep_id, arm, seed):
        if run.info.status == "FINISHED" and finished is None:
            finished = run
        else:
            c.delete_run(run.info.run_id)
    if finished is None:
        return None
    return _report(finished.data.metrics, finished.info.run_id, reused=True)


def run_trial(config: dict[str, Any], plan_dict: dict[str, Any]) -> None:
    """Tune function trainable: ``config["trial"]`` holds the arm and seed, ``plan_dict`` the
    sweep (its id, parent run, one resolved recipe per arm and the Ray queue its progress
    events go to)."""
    from ray import tune

    from gem_platform.launch import submit
    from gem_platform.log_mask import mask_process_output

    mask_process_output()  # MLflow prints the run's URL when the trial closes its run
    arm, seed = config["trial"]["arm"], int(config["trial"]["seed"])
    sweep_id, parent = plan_dict["sweep_id"], plan_dict["parent_run_id"]
    recipe = Recipe.model_validate(plan_dict["recipes"][arm])
    recipe.train.seed = seed
    done = settle_earlier_attempts(recipe, sweep_id, arm, seed)
    if done is not None:
        tune.report(done)
        return
    recipe = child_recipe(recipe, sweep_id, parent, arm, seed)
    events = plan_dict.get("progress")
    outcome = submit(recipe, local=recipe.parallel.workers == 1,
                     echo=in_trial(f"{arm} seed {seed}",
                                   print if events is None else events.put))
    tune.report(_report(outcome.summary, outcome.run_id, reused=False))
