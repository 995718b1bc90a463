"""The sweep spec: a base recipe, its arms (a list of overrides or a grid), seeds per arm and a
concurrency limit, loaded from YAML and resolved into one validated recipe per arm.

Every arm's recipe is validated before anything runs, so a typo in the last arm fails in a
second instead of after the first arms trained.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from gem_platform.errors import GemError, RecipeError
from gem_platform.recipe import Recipe, apply_overrides, read_yaml_file, recipe_from_dict
from gem_platform.sweep.gates import Expectation, Gates
from gem_platform.tracking import resolve_tracking_uri
from gem_platform.validation import describe_invalid

# The parent run's params sweep.arm.<name> and sweep.recipe.<name> must fit MLflow's 250-char keys.
MAX_ARM_NAME = 200


class SweepError(GemError):
    """The sweep spec is malformed, or a sweep can't be found, resumed or compared."""


def _override_list(value: Any) -> list[str]:
    """An arm is a list of ``a.b=v`` strings or a mapping ``{a.b: v}``; both become strings."""
    if isinstance(value, dict):
        return [f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in value.items()]
    if value is None:
        return []
    return value


def _percent(value: Any) -> Any:
    """'0.1%' -> 0.1; numbers pass through (pydantic checks the rest)."""
    if isinstance(value, str):
        return value.strip().removesuffix("%").strip()
    return value


class SpecGates(BaseModel):
    """The gates a sweep's parent run records verdicts for (``gemctl compare`` takes its own
    on the command line). NE and QPS in percent of the baseline, AUC absolute."""

    model_config = ConfigDict(extra="forbid")

    max_ne_regression: float | None = Field(0.1, ge=0, description="percent, e.g. 0.1%")
    max_auc_drop: float | None = Field(None, ge=0)
    max_qps_drop: float | None = Field(None, ge=0, description="percent, e.g. 5%")
    expect: dict[str, dict[str, Literal["pass", "fail"]]] = Field(
        default_factory=dict, description="a control's expected verdicts: arm -> metric "
        "(ne_ctr, ...) -> pass or fail; `gemctl compare --expect ARM:METRIC=VERDICT` the same")

    @field_validator("max_ne_regression", "max_qps_drop", mode="before")
    @classmethod
    def _strip_percent(cls, value: Any) -> Any:
        return _percent(value)

    def as_gates(self) -> Gates:
        expect = tuple(Expectation.of(arm, metric, word)
                       for arm, metrics in self.expect.items() for metric, word in metrics.items())
        return Gates(self.max_ne_regression, self.max_auc_drop, self.max_qps_drop, expect)


class SweepSpec(BaseModel):
    """What ``gemctl sweep SPEC.yaml`` reads."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$",
                      description="sweep name: letters, digits, '_', '.', '-'")
    base: str = Field(description="base recipe, relative to the spec file")
    seeds: list[int] = Field([0], min_length=1, description="train.seed of each run of an arm")
    max_concurrent: int = Field(1, ge=1, description="trials running at the same time")
    baseline: str | None = Field(None, description="arm the others are compared with; "
                                 "default: the first arm")
    set: list[str] = Field(default_factory=list, description="overrides applied to every arm")
    deterministic: bool = Field(True, description="train.deterministic for every arm (bitwise "
                                "repeatable trials); 'set' or an arm may still override it")
    gates: SpecGates = Field(default_factory=SpecGates, description="gates whose verdicts "
                             "the parent run records")
    arms: dict[str, list[str]] | None = None
    grid: dict[str, list[Any]] | None = None

    @field_validator("arms", mode="before")
    @classmethod
    def _arms_as_lists(cls, value: Any) -> Any:
        if isinstance(value, dict):
            return {str(k): _override_list(v) for k, v in value.items()}
        return value

    @field_validator("seeds")
    @classmethod
    def _unique_seeds(cls, value: list[int]) -> list[int]:
        if len(set(value)) != len(value):
            raise ValueError(f"seeds {value} repeat a seed; each seed runs once per arm")
        return value

    @model_validator(mode="after")
    def _one_axis(self) -> SweepSpec:
        if (self.arms is None) == (self.grid is None):
            raise ValueError("give exactly one of 'arms' (name -> overrides) or 'grid' "
                             "(field -> values)")
        names = self.arm_overrides()
        if not names:
            raise ValueError("the sweep has no arms")
        for name in names:
            if not name or any(ch in name for ch in "/'\"\\"):
                raise ValueError(f"arm name {name!r} must be non-empty, without / or quotes")
            if len(name) > MAX_ARM_NAME:
                raise ValueError(f"arm name {name[:40]!r}... is {len(name)} characters; at most "
                                 f"{MAX_ARM_NAME} (it names the arm's runs and params)")
        if self.grid is not None:
            for key, values in self.grid.items():
                if not values:
                    raise ValueError(f"grid.{key} has no values")
        if self.baseline is not None and self.baseline not in names:
            raise ValueError(f"baseline {self.baseline!r} is not an arm (arms: "
                             f"{', '.join(names)})")
        unknown = [arm for arm in self.gates.expect if arm not in names]
        if unknown:
            raise ValueError(f"gates.expect names {unknown[0]!r}, which is not an arm (arms: "
                             f"{', '.join(names)})")
        return self

    def arm_overrides(self) -> dict[str, list[str]]:
        """Arm name -> overrides, in the order written (a grid expands to its product)."""
        if self.arms is not None:
            return dict(self.arms)
        grid = self.grid or {}
        keys = list(grid)
        out: dict[str, list[str]] = {}
        for combo in itertools.product(*(grid[k] for k in keys)):
            name = ",".join(f"{k.split('.')[-1]}={v}" for k, v in zip(keys, combo, strict=True))
            out[name] = [f"{k}={v}" for k, v in zip(keys, combo, strict=True)]
        return out


_UNKNOWN_SPEC_FIELD = f"unknown field (allowed: {', '.join(SweepSpec.model_fields)})"


@dataclass(frozen=True)
class Arm:
    """One arm: its overrides and the recipe they resolve to (before the seed is set)."""

    name: str
    overrides: list[str]
    recipe: Recipe


@dataclass(frozen=True)
class SweepPlan:
    """A resolved sweep: what the runner executes and what a resume is matched against."""

    name: str
    spec_path: str
    base_path: str
    seeds: list[int]
    max_concurrent: int
    baseline: str
    arms: list[Arm]
    experiment: str
    gates: Gates = Gates(max_ne_regression_pct=0.1)

    def trials(self) -> list[tuple[str, int]]:
        """(arm, seed) pairs in run order: every arm's first seed before any second seed, so
        an early look at a half-finished sweep already compares all arms."""
        return [(arm.name, seed) for seed in self.seeds for arm in self.arms]

    def arm(self, name: str) -> Arm:
        return next(a for a in self.arms if a.name == name)

    def baseline_among(self, arms: Collection[str]) -> str:
        """The arm a comparison of runs of ``arms`` is against: the spec's baseline where they
        hold it, else the first of this plan's arms among them, so a sweep narrowed with
        --arms to arms without its baseline still ends with a comparison."""
        if self.baseline in arms:
            return self.baseline
        return next((a.name for a in self.arms if a.name in arms), self.baseline)

    @property
    def own_baseline(self) -> str:
        """The baseline of this plan's own runs (``--arms`` may leave the spec's out)."""
        return self.baseline_among({a.name for a in self.arms})

    def past_one_epoch(self, world_size: int | None = None) -> dict[str, float]:
        """Arms whose trials would train more than one pass over their training split -> the
        passes (generated data only; ``world_size`` as for Recipe.planned_epochs)."""
        planned = {a.name: a.recipe.planned_epochs(world_size) for a in self.arms}
        return {name: e for name, e in planned.items() if e is not None and e > 1.0}

    def trial_recipe(self, arm: str, seed: int) -> Recipe:
        tree = self.arm(arm).recipe.model_dump(mode="json")
        tree["train"]["seed"] = seed
        return Recipe.model_validate(tree)

    def fingerprint(self) -> str:
        """Hash of everything that decides the results: same fingerprint = same sweep. Only
        settings that differ from their defaults enter, so a new recipe setting (whose default
        keeps the old behaviour) does not turn an interrupted sweep into a new one."""
        body = {"name": self.name, "seeds": self.seeds,
                "arms": {a.name: a.recipe.model_dump(mode="json", exclude_defaults=True)
                         for a in self.arms}}
        for arm in body["arms"].values():
            arm.get("tracking", {}).pop("tags", None)
        raw = json.dumps(body, sort_keys=True, default=str).encode()
        return hashlib.sha256(raw).hexdigest()[:16]

    def arm_fingerprints(self) -> dict[str, str]:
        """What decides a trial's result apart from its seed, per arm: a hash of its recipe
        without where the data lives (results move between machines with the sweep) or
        tracking. Only settings that differ from their defaults enter, so a new recipe setting
        (whose default keeps the old behaviour) leaves existing results resumable. Results
        files and tracked sweeps record it, so a comparison can refuse two recipes under one
        arm name."""
        out = {}
        for arm in self.arms:
            tree = arm.recipe.model_dump(mode="json", exclude_defaults=True)
            tree.pop("tracking", None)
            tree.get("data", {}).pop("path", None)
            raw = json.dumps(tree, sort_keys=True, default=str).encode()
            out[arm.name] = hashlib.sha256(raw).hexdigest()[:16]
        return out

    def datasets(self) -> dict[str, str]:
        """Each distinct data path of the arms -> its recipe's dataset source."""
        return {a.recipe.data.path: a.recipe.data.source for a in self.arms}

    def fingerprint_record(self) -> dict[str, Any]:
        """The fingerprint with what it stands for: the resolved recipe of every arm, the
        code, the datasets (prepared first) and the environment. Recorded on the parent run
        (``fingerprint.json``) and in in-process results files."""
        from gem_platform.provenance import dataset_fingerprint, provenance

        record = provenance()
        datasets: dict[str, dict[str, Any] | None] = {}
        for path in self.datasets():
            try:
                datasets[path] = dataset_fingerprint(path)
            except FileNotFoundError:  # not prepared yet
                datasets[path] = None
        return {"fingerprint": self.fingerprint(), "sweep": self.name, "seeds": self.seeds,
                "code": record["code"], "environment": record["environment"],
                "datasets": {p: ({k: d[k] for k in ("path", "digest", "source", "num_train",
                                                     "num_eval", "shards")} if d else None)
                             for p, d in datasets.items()},
                "deterministic": {a.name: a.recipe.train.deterministic for a in self.arms},
                "recipes": {a.name: a.recipe.model_dump(mode="json", exclude={"tracking"})
                            for a in self.arms}}

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "spec": self.spec_path, "base": self.base_path,
                "seeds": self.seeds, "max_concurrent": self.max_concurrent,
                "baseline": self.baseline, "experiment": self.experiment,
                "arms": {a.name: a.overrides for a in self.arms}}


def _read_yaml(path: Path, what: str = "Sweep spec",
               example: str = "recipes/ablations/attention.yaml") -> Any:
    """The YAML document at ``path``, read as strictly as a recipe (duplicate keys, empty
    files and alias bombs refused); SweepError naming the file otherwise."""
    try:
        return read_yaml_file(path, what, example)
    except RecipeError as err:
        raise SweepError(err.problem, err.fix) from None


def _absolute_paths(tree: dict[str, Any], cwd: Path) -> dict[str, Any]:
    """Trials run in Ray worker processes: give them paths that don't depend on their cwd."""
    data = tree.setdefault("data", {})
    path = Path(str(data.get("path", "gem_data/synthetic")))
    data["path"] = str(path if path.is_absolute() else cwd / path)
    return tree


def _is_sweep_spec(tree: dict[str, Any]) -> bool:
    return "base" in tree and ("arms" in tree or "grid" in tree)


def _base_path(spec_path: Path, base: str) -> Path:
    """The base recipe's path (relative to the spec), checked to be a file."""
    fix = "Write 'base' relative to the spec file, e.g. ../demo.yaml."
    try:
        base_path = (spec_path.parent / base).resolve()
        exists = base_path.is_file()
    except (OSError, ValueError, RuntimeError) as err:  # too long, a NUL, a symlink loop
        raise SweepError(f"Sweep spec {spec_path}: base {base[:200]!r} is not a usable path "
                         f"({str(err)[:120]}).", fix) from None
    if not exists:
        raise SweepError(f"Sweep spec {spec_path}: base recipe {base[:200]} ({base_path}) does "
                         "not exist.", fix)
    return base_path


def load_sweep(path: str | Path, overrides: list[str] | None = None,
               tracking_uri: str | None = None) -> SweepPlan:
    """Read and validate a sweep spec and every arm's recipe. Raises SweepError/RecipeError.

    ``overrides`` (``--set``) apply to the base recipe before each arm's own overrides.
    """
    path = Path(path)
    raw = _read_yaml(path)
    if not isinstance(raw, dict):
        raise SweepError(f"Sweep spec {path} must be a YAML mapping, not "
                         f"{type(raw).__name__}.", "See recipes/ablations/attention.yaml.")
    try:
        spec = SweepSpec.model_validate(raw)
    except ValidationError as err:
        raise SweepError(describe_invalid(err, f"Sweep spec {path}", root="(spec)",
                                          unknown=_UNKNOWN_SPEC_FIELD),
                         "Fix the named fields; see recipes/ablations/*.yaml.") from None
    base_path = _base_path(path, spec.base)
    base_tree = _read_yaml(base_path, "Base recipe", "recipes/demo.yaml")
    if not isinstance(base_tree, dict) or _is_sweep_spec(base_tree):
        kind = "a sweep spec" if isinstance(base_tree, dict) else \
            f"a YAML {type(base_tree).__name__}"
        raise SweepError(f"Sweep spec {path}: base {spec.base} is {kind}, not a recipe.",
                         "Point 'base' at a recipe (a mapping of sections such as model, "
                         "train, data), e.g. base: ../demo.yaml.")
    # Trials are deterministic unless the spec says otherwise ('set', --set or an arm may
    # still override it).
    determinism = [f"train.deterministic={str(spec.deterministic).lower()}"]
    try:
        base_tree = apply_overrides(base_tree, [*determinism, *spec.set, *(overrides or [])])
    except RecipeError as err:
        raise SweepError(f"Sweep spec {path}, 'set' or --set: {err.problem}", err.fix) from None
    cwd = Path.cwd()
    arms = []
    experiment = None
    for name, arm_overrides in spec.arm_overrides().items():
        try:
            tree = _absolute_paths(apply_overrides(base_tree, arm_overrides), cwd)
            recipe = recipe_from_dict(tree, f"{base_path.name} + arm '{name}'")
        except RecipeError as err:
            raise SweepError(f"Sweep spec {path}, arm '{name}': {err.problem}",
                             err.fix) from None
        experiment = experiment or recipe.tracking.experiment
        uri = resolve_tracking_uri(tracking_uri or recipe.tracking.uri)
        tracking = recipe.tracking.model_copy(update={"experiment": experiment, "uri": uri})
        recipe = recipe.model_copy(update={"tracking": tracking})
        arms.append(Arm(name, list(arm_overrides), recipe))
    return SweepPlan(name=spec.name, spec_path=str(path), base_path=str(base_path),
                     seeds=spec.seeds, max_concurrent=spec.max_concurrent,
                     baseline=spec.baseline or arms[0].name, arms=arms,
                     experiment=experiment or "gem", gates=spec.gates.as_gates())
