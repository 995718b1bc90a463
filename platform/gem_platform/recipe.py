"""The recipe: one typed, validated description of a run (model, data, loader, training,
parallelism, precision, tracking), loaded from YAML with dotted ``--set`` overrides.

Every error names the field path and what is allowed, so a user can fix a recipe without
reading code.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from gem_platform.balance.config import LoaderConfig
from gem_platform.data.config import DataConfig
from gem_platform.errors import RecipeError
from gem_platform.topology.config import ParallelConfig

AttentionKind = Literal["full", "sliding", "block64", "padded"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Strict):
    """GEM-style network: sequence tower, cross and pooled attention, DHEN experts, heads."""

    d_model: int = Field(64, ge=8, description="width of sequence tokens")
    num_heads: int = Field(2, ge=1)
    seq_layers: int = Field(1, ge=0)
    attention: AttentionKind = Field(
        "full",
        description="sequence self-attention: full jagged, sliding window, 64-token blocks, or "
        "the padded dense baseline",
    )
    window: int = Field(64, ge=1, description="left window (tokens) for attention=sliding")
    causal: bool = Field(True, description="tokens attend only to older events")
    rope: bool = Field(False, description="rotary positions in block64 attention")
    qk_norm: bool = Field(True, description="RMS-normalize q and k: bounds the scores")
    gdpa_activation: Literal["silu", "gelu", "gelu_tanh", "identity"] = "silu"
    pooled_queries: int = Field(4, ge=1, description="queries of the pooled attention")
    sparse_dim: int = Field(16, ge=2, description="TorchRec embedding dim of sparse features")
    dhen_layers: int = Field(2, ge=1)
    num_experts: int = Field(2, ge=1, description="MLP experts per DHEN layer")
    expert_hidden: int = Field(128, ge=8)
    head_hidden: int = Field(64, ge=8)
    kernel: Literal["auto", "triton", "pytorch"] = Field(
        "auto", description="auto = Triton on CUDA, PyTorch reference elsewhere"
    )

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelConfig:
        if self.d_model % self.num_heads:
            raise ValueError(
                f"model.d_model={self.d_model} must be divisible by model.num_heads="
                f"{self.num_heads}"
            )
        if self.rope and (self.d_model // self.num_heads) % 2:
            raise ValueError("model.rope needs an even head dim (d_model / num_heads)")
        return self


class TrainConfig(_Strict):
    steps: int = Field(200, ge=1)
    lr: float = Field(2e-3, gt=0)
    sparse_lr: float = Field(0.05, gt=0, description="Adagrad learning rate of embeddings")
    weight_decay: float = Field(0.01, ge=0)
    warmup_steps: int = Field(20, ge=0)
    grad_clip: float | None = Field(1.0, gt=0)
    seed: int = 0
    log_every: int = Field(10, ge=1)
    eval_every: int = Field(0, ge=0, description="0 = evaluate only at the end")
    eval_max_samples: int | None = Field(None, ge=1)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    checkpoint_every: int = Field(0, ge=0, description="save a checkpoint every N steps; 0 = off")
    keep_checkpoints: int = Field(2, ge=1, description="checkpoints kept (the newest)")
    max_failures: int = Field(
        1, ge=0, description="worker-group restarts from the last checkpoint after a failure")
    peak_tflops: float | None = Field(
        None, gt=0, description="peak for MFU; default: table by GPU and dtype, measured on CPU"
    )
    perf_warmup_steps: int = Field(
        10, ge=0, description="steps each process trains before the final QPS and MFU start "
        "counting (kernel compilation and autotuning, allocator growth); at least one step "
        "is always counted")


class PrecisionConfig(_Strict):
    mode: Literal["fp32", "bf16", "fp8_block"] = "fp32"
    block: Literal[32, 128] = Field(
        128, description="128: cuBLAS blockwise scaled_mm (the faster route on H200); "
        "32: square 32x32 blocks, Triton GEMM")
    hadamard: bool = False
    hadamard_block: int = Field(128, ge=32, le=128)
    stochastic_rounding: bool = False
    wgrad: Literal["bf16", "fp8"] = "bf16"
    keep_last_bf16: int = Field(
        1, ge=0, description="the last N linear layers that would otherwise run in FP8 stay bf16")
    keep_bf16: list[str] = Field(default_factory=list, description="module name patterns")
    min_features: int = Field(
        0, ge=0, description="linear layers whose narrower side (min of in and out features) "
        "is below this stay bf16. On the H200 an FP8 layer's training call is slower than "
        "bf16 at 256-1024 features (0.16-0.50x: launch-bound) and level to 1.10x at 2048 "
        "(block 128), docs/bench/fp8_layer_cost*.json; 0 converts every layer")

    @model_validator(mode="after")
    def _hadamard_pow2(self) -> PrecisionConfig:
        hb = self.hadamard_block
        if hb & (hb - 1):
            raise ValueError(f"precision.hadamard_block={hb} must be a power of two (32, 64, 128)")
        return self


class TrackingConfig(_Strict):
    uri: str | None = Field(
        None, description="MLflow tracking URI; default MLFLOW_TRACKING_URI or ./mlflow.db"
    )
    experiment: str = "gem"
    run_name: str | None = None
    tags: dict[str, str] = Field(default_factory=dict)


class Recipe(_Strict):
    name: str = "gem"
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    loader: LoaderConfig = Field(default_factory=LoaderConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)

    @model_validator(mode="after")
    def _combinations(self) -> Recipe:
        if self.precision.mode == "fp8_block" and self.model.d_model % 32:
            raise ValueError(
                f"precision.mode=fp8_block needs model.d_model divisible by 32 "
                f"(got {self.model.d_model})"
            )
        if self.model.rope and self.model.attention != "block64":
            raise ValueError("model.rope applies to model.attention=block64 only")
        if self.train.device == "cpu" and self.parallel.use_gpu:
            raise ValueError("train.device=cpu contradicts parallel.use_gpu=true")
        # Raises RecipeError itself (naming the fields and the valid sizes).
        self.parallel.validate_against_world()
        return self

    def loader_config(self) -> LoaderConfig:
        """The loader section with its attention-cost width taken from the model, so the
        batcher's cost model always matches the network it balances for."""
        return self.loader.model_copy(update={"model_dim": self.model.d_model})

    def flat(self) -> dict[str, Any]:
        """Dotted keys -> values: what MLflow records as run params."""
        return flatten(self.model_dump(mode="json"))

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, path + "."))
        else:
            out[path] = value
    return out


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b.c=VALUE`` -> (["a","b","c"], VALUE parsed as YAML: 50 -> int, true -> bool)."""
    if "=" not in text:
        raise RecipeError(
            f"Override '{text}' has no '='.", "Write overrides as --set section.field=value, "
            "e.g. --set train.steps=50."
        )
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if not all(p.strip() for p in parts):
        raise RecipeError(f"Override '{text}' has an empty field name.",
                          "Use a dotted path such as model.attention=block64.")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return parts, value


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    tree = copy.deepcopy(tree)
    for text in overrides:
        parts, value = parse_override(text)
        node = tree
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise RecipeError(
                    f"Override '{text}': '{'.'.join(parts[: i + 1])}' is a value, not a section.",
                    "Check the field path against `gemctl validate --schema`.",
                )
            node = child
        node[parts[-1]] = value
    return tree


def _format_validation_error(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(recipe)"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown field (check its spelling and section)"
        elif e["type"] == "literal_error":
            msg = f"{msg} (got {e.get('input')!r})"
        lines.append(f"{loc}: {msg.rstrip('.')}")
    return f"Recipe {source} is invalid: " + "; ".join(lines) + "."


def recipe_from_dict(tree: Any, source: str = "<dict>") -> Recipe:
    if tree is None:
        tree = {}
    if not isinstance(tree, dict):
        raise RecipeError(
            f"Recipe {source} must be a YAML mapping of sections, not {type(tree).__name__}.",
            "Start from recipes/demo.yaml.",
        )
    try:
        return Recipe.model_validate(tree)
    except ValidationError as err:
        raise RecipeError(
            _format_validation_error(err, source),
            "Fix the named fields; `gemctl validate RECIPE` checks a recipe without running it.",
        ) from None


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Read YAML safely, apply ``--set`` overrides, validate. Raises RecipeError."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"Recipe file {path} does not exist.",
                          "Pass the path of a YAML recipe, e.g. recipes/demo.yaml.")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise RecipeError(f"Recipe file {path} can't be read ({err}).",
                          "Check the file's permissions and that it is UTF-8 text.") from None
    try:
        tree = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise RecipeError(f"Recipe {path} is not valid YAML{where}: {problem}.",
                          "Fix the YAML syntax (indentation, colons, quotes).") from None
    if overrides:
        if tree is not None and not isinstance(tree, dict):
            return recipe_from_dict(tree, str(path))
        tree = apply_overrides(tree or {}, overrides)
    return recipe_from_dict(tree, str(path))
