"""The recipe: one typed, validated description of a run (model, data, loader, training,
parallelism, precision, tracking), loaded from YAML with dotted ``--set`` overrides.

Every error names the field path and what is allowed, so a user can fix a recipe without
reading code. What a recipe may hold: plain YAML (no Python tags), each key once, aliases
expanding to at most MAX_YAML_NODES values, at most MAX_RECIPE_BYTES; numbers finite and
within each field's range, booleans only where a field is boolean. Error messages quote at
most ECHO_CHARS of any value the user gave.
"""

from __future__ import annotations

import copy
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from gem_platform.balance.config import LoaderConfig
from gem_platform.data.config import DataConfig
from gem_platform.errors import RecipeError
from gem_platform.model_variants import check_kernel
from gem_platform.topology.config import ParallelConfig
from gem_platform.topology.table_bounds import oversized, synthetic_tables
from gem_platform.tracking_names import KEY_RULE, tag_problems
from gem_platform.validation import describe_invalid, shorten

AttentionKind = Literal["full", "sliding", "block64", "padded"]

MAX_RECIPE_BYTES = 1 << 20  # recipes are small YAML files; anything larger is a mistake
MAX_YAML_NODES = 100_000  # values a document may expand to through aliases (YAML bombs)
MAX_YAML_DEPTH = 64  # nesting of collections; a recipe needs 4
MAX_INT = 2**53  # integers above this lose precision in JSON and float64: never sane here


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class WideScale(_Strict):
    """Per task, the scale model.wide's weights are read at. CVR learns from the clicked
    samples only, so each id's CVR weight sees a fraction of the samples its CTR weight sees
    and is read at a smaller scale (a lower effective learning rate, less noise)."""

    ctr: float = Field(0.45, gt=0, le=10, description="scale of the CTR weights")
    cvr: float = Field(0.2, gt=0, le=10, description="scale of the CVR weights")


class ModelConfig(_Strict):
    """GEM-style network: sequence tower, cross and pooled attention, DHEN experts, heads."""

    d_model: int = Field(64, ge=8, le=65536, description="width of sequence tokens")
    num_heads: int = Field(2, ge=1, le=1024, description="attention heads (divide d_model)")
    seq_layers: int = Field(1, ge=0, le=256, description="sequence self-attention layers")
    attention: AttentionKind = Field(
        "full",
        description="sequence self-attention: full jagged, sliding window, 64-token blocks, or "
        "the padded dense baseline",
    )
    window: int = Field(64, ge=1, le=1 << 20,
                        description="left window (tokens) for attention=sliding")
    causal: bool = Field(True, description="tokens attend only to older events")
    rope: bool = Field(False, description="rotary positions (RoPE) in the sequence "
                       "self-attention, any kind: attention reads exact distances between events")
    qk_norm: bool = Field(True, description="RMS-normalize q and k: bounds the scores")
    gdpa_activation: Literal["silu", "gelu", "gelu_tanh", "identity"] = Field(
        "silu", description="element-wise activation of the cross and pooled attention (GDPA)")
    pooled_queries: int = Field(4, ge=1, le=4096, description="queries of the pooled attention")
    pooled_base: Literal["mean", "none"] = Field(
        "mean", description="what the pooled attention adds to its GDPA output: mean = each "
        "sample's mean value vector, so the attention starts as a mean pool of the history and "
        "learns to weight it (GDPA's SiLU/GELU is ~0 at the small scores of an untrained model, "
        "so without it the history's path to the prediction starts nearly closed); none = GDPA "
        "alone")
    newest_token: bool = Field(
        False, description="the newest history event's token (after the causal sequence tower "
        "it has attended to the whole history with softmax) joins the DHEN tokens: a "
        "summary of the recent events whatever the history's length, which GDPA's pooled "
        "mean over the whole history cannot give")
    recent_mean: int = Field(
        0, ge=0, le=1 << 20, description="N > 0: one more DHEN token, the mean of each "
        "history's newest N tokens after the sequence tower (a short-term summary; the pooled "
        "attention's GDPA divides by the whole history's length, so the last few events of a "
        "long history weigh little in it); 0 = none")
    newest_attention: bool = Field(
        False, description="one more DHEN token: what the last sequence layer's attention "
        "read for the newest event (its attention output at that token, before the residual "
        "add and the norms), a direct path from what the newest event attended to. It follows "
        "model.attention, so block64 or a window cannot see past its block. On the GPU "
        "recall control alone it changed nothing; category keys through one projection "
        "(model.attention_qk=category, model.shared_qk) let the model learn that control's "
        "term with or without it (docs/quality)")
    attention_qk: Literal["token", "category"] = Field(
        "token", description="what the sequence self-attention's queries and keys are computed "
        "from: token = each event's whole token (item, category, action, recency, age and "
        "affinity summed); category = the event's category row alone, values still from the "
        "whole token (side information in queries and keys only, as NOVA's non-invasive "
        "fusion), so attention can find events of a kind directly; with model.shared_qk it "
        "does from the first step (docs/quality: the recall control). Needs a dataset whose "
        "items carry categories and learned item tables")
    shared_qk: bool = Field(
        False, description="one projection for the sequence self-attention's queries and "
        "keys (shared-QK attention, as in the Reformer): each event's score against another "
        "starts as the similarity of their inputs (with model.attention_qk=category, of their "
        "categories), so attention finds events like the querying one from the first step. "
        "With category keys it is what lets full attention learn the recall world's term "
        "(docs/quality); with token keys it gains nothing there")
    item_vectors: Literal["learned", "planted"] = Field(
        "learned", description="what stands for an item (history event or candidate): "
        "learned = its rows in the item and category tables; planted = the synthetic world's "
        "own latent vector of the item, fixed (synthetic data only): a diagnostic that tells "
        "whether quality is held back by learning the tables or by the rest of the network")
    sparse_dim: int = Field(16, ge=2, le=65536,
                            description="TorchRec embedding dim of sparse features")
    wide: bool = Field(
        False, description="first-order (wide) terms added to the logits, as in Wide & Deep: "
        "per task, a learned weight for each sparse feature's id and for the candidate's item "
        "and category (TorchRec tables trained like the others, starting at zero), and one "
        "for each dense feature and each product of two (up to 32 dense features); per-id "
        "effects are learned directly, as a logistic regression on one-hot ids learns them, "
        "instead of only through the deep network (docs/quality: the CPU demo)")
    wide_scale: WideScale = Field(
        default_factory=WideScale, description="per task, the scale the wide "
        "weights are read at: under Adagrad a step moves a wide weight's logit about scale^2 "
        "times as far as at scale 1, as if its learning rate were that fraction of "
        "train.sparse_lr")
    dhen_layers: int = Field(2, ge=1, le=256, description="DHEN interaction layers")
    num_experts: int = Field(2, ge=1, le=1024, description="MLP experts per DHEN layer")
    expert_hidden: int = Field(128, ge=8, le=1 << 20, description="hidden width of an expert")
    head_hidden: int = Field(64, ge=8, le=1 << 20, description="hidden width of the CTR/CVR heads")
    kernel: str = Field(
        "auto", description="auto = Triton on CUDA, PyTorch reference elsewhere; triton; "
        "pytorch; or the name of an installed model variant (gem_platform.model_variants), "
        "e.g. baseline = off-the-shelf parts (varlen_attn or padded SDPA, padded GDPA): the e2e "
        "bench's baseline"
    )

    @field_validator("kernel")
    @classmethod
    def _known_kernel(cls, value: str) -> str:
        return check_kernel(value)

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelConfig:
        if self.d_model % self.num_heads:
            raise ValueError(
                f"model.d_model={self.d_model} must be divisible by model.num_heads="
                f"{self.num_heads}"
            )
        if self.newest_attention and self.seq_layers < 1:
            raise ValueError("model.newest_attention reads the last sequence layer's "
                             "attention: set model.seq_layers >= 1 or newest_attention false")
        if self.attention_qk == "category" and self.item_vectors == "planted":
            raise ValueError("model.attention_qk=category reads the category table, which "
                             "model.item_vectors=planted replaces: use one or the other")
        if self.rope and (self.d_model // self.num_heads) % 2:
            raise ValueError("model.rope needs an even head dim (d_model / num_heads)")
        return self


class TrainConfig(_Strict):
    steps: int = Field(200, ge=1, le=10**9, description="training steps")
    lr: float = Field(2e-3, gt=0, le=10, description="AdamW learning rate of the dense part")
    sparse_lr: float = Field(0.05, gt=0, le=100, description="Adagrad learning rate of embeddings")
    sparse_eps: float = Field(
        1e-10, gt=0, le=1.0,
        description="Adagrad epsilon of the embedding tables: update = lr * g / (sqrt(sum g^2) + "
        "eps). At 1e-10 a row's first update is lr per element whatever its gradient, so a row "
        "seen once takes a full step from one sample; an eps near the size of one sample's "
        "gradient keeps rarely seen rows quiet while frequent rows train as plain Adagrad")
    sparse_accumulator_init: float = Field(
        0.0, ge=0, le=100,
        description="starting value of every Adagrad accumulator of the embedding tables "
        "(the sum of squared gradients): update = lr * g / sqrt(init + sum g^2). At 0 a row's "
        "first update is lr per element whatever its gradient, so the first, noisy gradients "
        "of a fresh table move rows by full steps; a small init (1e-4 to 1e-3, with a larger "
        "train.sparse_lr) makes the early steps proportional to the gradient, as TensorFlow's "
        "Adagrad (init 0.1) does")
    weight_decay: float = Field(0.01, ge=0, le=10, description="AdamW weight decay")
    warmup_steps: int = Field(20, ge=0, le=10**9, description="linear learning-rate warm-up steps")
    grad_clip: float | None = Field(1.0, gt=0, le=1e6,
                                    description="gradient-norm clip; null = no clipping")
    seed: int = Field(0, ge=0, le=2**32 - 1,
                      description="seed of initialization (with train.deterministic, of the "
                      "Python, NumPy and torch RNGs too); the data order follows loader.seed, "
                      "the synthetic data data.synthetic.seed")
    deterministic: bool = Field(
        False, description="bitwise-reproducible training on the same device and code: "
        "deterministic torch algorithms and cuBLAS workspace, cuDNN without autotuning, "
        "atomic-free attention backwards; costs throughput")
    log_every: int = Field(10, ge=1, le=10**9,
                           description="progress line and metrics every N steps")
    eval_every: int | None = Field(
        None, ge=0, le=10**9,
        description="held-out evaluation every N steps on the fixed train.eval_sample (the "
        "learning curve, its warnings and time to quality read it); null = about ten per run, "
        "every max(steps // 10, log_every) steps; 0 = only the final evaluation")
    eval_sample: int = Field(
        2048, ge=1, le=MAX_INT,
        description="held-out samples each scheduled evaluation scores: the first N of the "
        "eval split (shared evenly by the workers), the same at every evaluation so the curve "
        "compares like with like; capped by eval_max_samples. Each scheduled evaluation costs "
        "a forward pass over these samples, outside the steps' time. Its scores carry 95% "
        "intervals: at 2,048 samples CTR AUC moves by ~±0.03 and CVR's (scored on the clicked "
        "samples alone) by more, so raise it to compare curves finely")
    eval_max_samples: int | None = Field(
        None, ge=1, le=MAX_INT,
        description="held-out samples the final evaluation scores (the summary's eval/*); "
        "null = all")
    target_ne: float | None = Field(
        None, gt=0, le=10,
        description="held-out CTR NE to measure time to quality against: the summary's "
        "quality/train_s_to_target and quality/samples_to_target (training time, evaluation "
        "excluded); null = none (the curve in the summary still allows any target later)")
    stop_at_target: bool = Field(
        False, description="end training at the first scheduled evaluation whose held-out "
        "CTR NE is at or below train.target_ne, as MLPerf's benchmarks stop at their target: "
        "the run finishes (final evaluation, summary) with the steps it took; needs "
        "train.target_ne and scheduled evaluations (eval_every not 0)")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto = CUDA when available, else CPU")
    checkpoint_every: int = Field(0, ge=0, le=10**9,
                                  description="save a checkpoint every N steps; 0 = off")
    keep_checkpoints: int = Field(2, ge=1, le=1000, description="checkpoints kept (the newest)")
    max_failures: int = Field(
        1, ge=0, le=100,
        description="worker-group restarts from the last checkpoint after a failure")
    storage: str | None = Field(
        None, min_length=1, max_length=2048,
        description="where Ray runs keep checkpoints and Ray Train's run folder: a path every "
        "node mounts (e.g. /mnt/shared/gem) or an object-store URI (s3://bucket/prefix, gs://...; "
        "credentials from the environment); null = gem_runs/ray on the driver, which only a "
        "single-node cluster shares. In-process runs keep theirs under gem_runs/local")
    peak_tflops: float | None = Field(
        None, gt=0, le=1e6,
        description="peak for MFU; default: table by GPU and dtype, measured on CPU"
    )
    perf_warmup_steps: int = Field(
        10, ge=0, le=10**9,
        description="steps each process trains before the final QPS and MFU start counting "
        "(kernel compilation and autotuning, allocator growth); at least one step is always "
        "counted")
    compile: bool | None = Field(
        None, description="torch.compile each sequence layer, DHEN layer and the head (the "
        "attention ops as custom ops inside); null = on for CUDA, off on CPU")
    compile_regions: list[str] | None = Field(
        None, description="with train.compile: only these regions compile, by name or prefix "
        "(sequence, sequence.blocks.0, dhen, dhen.1, head); the others run eager; null = all. "
        "For finding which region a compiled run's difference comes from")
    compile_backend: Literal["inductor", "aot_eager"] | None = Field(
        None, description="inductor generates fused kernels; aot_eager only traces (the graphs "
        "run through ATen's kernels, without code generation); null = inductor, deterministic "
        "runs included (they repeat bit for bit through either)")
    activation_memory_gb: float | None = Field(
        None, gt=0, le=1e5,
        description="budget for the activations the sequence layers, DHEN layers and head keep "
        "for the backward at the recipe's batch; regions recompute in the backward, cheapest "
        "first, until the estimate fits; null = none recompute")
    saved_activations: Literal["bf16", "fp8"] = Field(
        "bf16",
        description="how the training forward keeps activations for the backward: bf16 = as "
        "computed; fp8 = bf16/fp16 saved tensors of at least 4096 elements are stored as "
        "float8_e4m3fn with one fp32 scale per 128 elements and widened back in the backward "
        "(fp32 tensors such as attention and norm statistics, integer tensors and tensors "
        "shaped like a weight stay exact; needs precision.mode bf16 or fp8_block; recomputed "
        "regions keep nothing to compress)")
    prefetch_batches: int = Field(
        2, ge=0, le=64,
        description="batches collated ahead on a background thread (pinned and copied on a "
        "side stream on CUDA); 0 = collate on the training thread")
    pipeline_sparse: bool = Field(
        True,
        description="where TorchRec shards the embedding tables over several workers, start "
        "the next batch's embedding input all-to-all before this batch's forward, so it runs "
        "under this step's compute (losses unchanged); false = each step distributes its "
        "own input")

    @model_validator(mode="after")
    def _stop_needs_a_target(self) -> TrainConfig:
        if self.stop_at_target and (self.target_ne is None or self.eval_every == 0):
            raise ValueError(
                "train.stop_at_target needs train.target_ne (the held-out CTR NE to stop at) "
                "and scheduled evaluations (train.eval_every not 0): set both, or drop "
                "stop_at_target")
        return self

    def eval_interval(self) -> int:
        """Steps between scheduled held-out evaluations (eval_every; 0 = none before the
        final one)."""
        if self.eval_every is None:
            return max(self.steps // 10, self.log_every)
        return self.eval_every


class PrecisionConfig(_Strict):
    mode: Literal["fp32", "bf16", "fp8_block"] = Field(
        "fp32", description="training precision of the linear layers")
    block: Literal[32, 128] = Field(
        128, description="128: cuBLAS blockwise scaled_mm (the faster route on H200); "
        "32: square 32x32 blocks, Triton GEMM")
    hadamard: bool = Field(False, description="random Hadamard transform before quantizing")
    hadamard_block: int = Field(128, ge=32, le=128,
                                description="Hadamard block size (a power of two)")
    stochastic_rounding: bool = Field(False, description="stochastic rounding into FP8")
    wgrad: Literal["bf16", "fp8"] = Field("bf16", description="precision of weight gradients")
    keep_last_bf16: int = Field(
        1, ge=0, le=10_000,
        description="the last N linear layers that would otherwise run in FP8 stay bf16")
    keep_bf16: list[str] = Field(default_factory=list, description="module name patterns")
    min_features: int = Field(
        0, ge=0, le=1 << 24,
        description="linear layers whose narrower side (min of in and out features) is below "
        "this stay bf16 (docs/bench/fp8_layer_cost*.json measure where FP8 starts to pay); "
        "0 converts every layer")

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
    experiment: str = Field("gem", min_length=1, max_length=500,
                            description="MLflow experiment the run goes into")
    run_name: str | None = Field(None, max_length=250,
                                 description="MLflow run name; default: MLflow picks one")
    tags: dict[str, str] = Field(default_factory=dict, description="extra MLflow run tags "
                                 "(keys: letters, digits, '_', '-', '.', ' ', ':', '/')")

    @field_validator("tags")
    @classmethod
    def _tags_the_store_accepts(cls, tags: dict[str, str]) -> dict[str, str]:
        """Refused here, before a run exists, rather than by the store once it does."""
        problems = tag_problems(tags, param_prefix="tracking.tags.")
        if problems:
            raise ValueError("; ".join(problems[:3]) + f" ({KEY_RULE})")
        return tags


class Recipe(_Strict):
    """A whole run: model, data, loader, training, parallelism, precision and tracking."""

    name: str = Field("gem", min_length=1, max_length=100, pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$",
                      description="recipe name (letters, digits, '_', '.', '-'): names run folders")
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
        if self.train.device == "cpu" and self.parallel.use_gpu:
            raise ValueError("train.device=cpu contradicts parallel.use_gpu=true")
        if self.train.saved_activations == "fp8" and self.precision.mode == "fp32":
            raise ValueError(
                "train.saved_activations=fp8 stores the bf16/fp16 activations kept for the "
                "backward in 8 bits, but precision.mode=fp32 keeps every activation in fp32, so "
                "nothing would be compressed: set precision.mode=bf16 (or fp8_block), or "
                "train.saved_activations=bf16")
        if self.model.item_vectors == "planted" and self.data.source != "synthetic":
            raise ValueError(
                f"model.item_vectors=planted needs synthetic data (data.source is "
                f"{self.data.source!r}): only a generated world knows its items' vectors; use "
                "model.item_vectors=learned")
        if self.data.source == "synthetic" and (why := oversized(synthetic_tables(
                self.data.synthetic, self.model.d_model, self.model.sparse_dim))):
            raise ValueError(f"{why}; give the dataset a size a cluster can hold")
        # Raises RecipeError itself (naming the fields and the valid sizes).
        self.parallel.validate_against_world()
        return self

    def loader_config(self) -> LoaderConfig:
        """The loader section with its attention-cost width taken from the model, so the
        batcher's cost model always matches the network it balances for."""
        return self.loader.model_copy(update={"model_dim": self.model.d_model})

    def planned_epochs(self, world_size: int | None = None) -> float | None:
        """Passes over the training split that train.steps take at the global batch (the local
        batch on each of ``world_size`` ranks: parallel.workers unless given, 1 for a run in
        one process), known before any data exists for generated data only (None otherwise).
        Past 1, deep CTR models commonly memorize the per-id rows they saw, so an ablation's
        verdicts there compare overfitted arms."""
        if self.data.source != "synthetic":
            return None
        ranks = self.parallel.workers if world_size is None else world_size
        global_batch = self.loader.local_batch_size * ranks
        return self.train.steps * global_batch / self.data.synthetic.num_train

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


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key: Any, first: yaml.Mark, again: yaml.Mark) -> None:
        super().__init__(f"the key {shorten(key)!r} appears twice (lines {first.line + 1} and "
                         f"{again.line + 1})")


class _TooLarge(yaml.YAMLError):
    pass


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys (PyYAML keeps the last one silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, yaml.Mark] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                if key in seen:
                    raise _DuplicateKey(key, seen[key], key_node.start_mark)
                seen[key] = key_node.start_mark
            except TypeError:  # an unhashable key: SafeLoader reports it below
                break
        return super().construct_mapping(node, deep=deep)


def _expanded_size(node: yaml.Node, memo: dict[int, int], limit: int, depth: int = 0) -> int:
    """How many values ``node`` stands for once every alias is expanded (linear time: a node
    shared through aliases is measured once); nesting deeper than MAX_YAML_DEPTH is refused."""
    key = id(node)
    if key in memo:
        if memo[key] < 0:
            raise _TooLarge("an alias refers to the collection that contains it")
        return memo[key]
    if depth > MAX_YAML_DEPTH:
        raise _TooLarge(f"it nests deeper than {MAX_YAML_DEPTH} levels")
    memo[key] = -1
    if isinstance(node, yaml.SequenceNode):
        size = 1 + sum(_expanded_size(child, memo, limit, depth + 1) for child in node.value)
    elif isinstance(node, yaml.MappingNode):
        size = 1 + sum(_expanded_size(k, memo, limit, depth + 1)
                       + _expanded_size(v, memo, limit, depth + 1) for k, v in node.value)
    else:
        size = 1
    if size > limit:
        raise _TooLarge(f"its aliases expand to more than {limit:,} values")
    memo[key] = size
    return size


def parse_yaml(text: str) -> Any:
    """Parse one YAML document safely: plain data only, duplicate keys refused, alias expansion
    bounded to MAX_YAML_NODES values. Raises yaml.YAMLError (with a mark where known)."""
    loader = _StrictLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _expanded_size(node, {}, MAX_YAML_NODES)
        return loader.construct_document(node)
    except RecursionError:  # PyYAML composes recursively: nesting beyond Python's stack
        raise _TooLarge(f"it nests deeper than {MAX_YAML_DEPTH} levels") from None
    finally:
        loader.dispose()


def _yaml_problem(err: yaml.YAMLError) -> str:
    mark = getattr(err, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    problem = getattr(err, "problem", None) or (str(err).splitlines() or ["unreadable"])[0]
    return f"{where}: {shorten(problem, 200)}"


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b.c=VALUE`` -> (["a","b","c"], VALUE parsed as YAML: 50 -> int, true -> bool)."""
    if "=" not in text:
        raise RecipeError(
            f"Override '{shorten(text)}' has no '='.", "Write overrides as "
            "--set section.field=value, e.g. --set train.steps=50."
        )
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if not all(p.strip() for p in parts):
        raise RecipeError(f"Override '{shorten(text)}' has an empty field name.",
                          "Use a dotted path such as model.attention=block64.")
    try:
        value = parse_yaml(raw) if raw.strip() else ""
    except _TooLarge as err:
        raise RecipeError(f"Override '{shorten(text)}' is refused: {err}.",
                          "Pass a plain value.") from None
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
                    f"Override '{shorten(text)}': '{'.'.join(parts[: i + 1])}' is a value, "
                    "not a section.",
                    "Check the field path against `gemctl validate --schema`.",
                )
            node = child
        node[parts[-1]] = value
    return tree


def _number_kind(annotation: Any) -> str | None:
    """'int' or 'float' when a field holds a plain number (possibly optional), else None."""
    args = typing.get_args(annotation) if isinstance(
        annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union else ()
    kinds = {a for a in (args or (annotation,)) if a is not type(None)}
    if kinds == {int}:
        return "int"
    if kinds <= {int, float} and kinds:
        return "float"
    return None


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """Pydantic models a field holds directly, in a list, or as mapping values."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def number_problems(model: type[BaseModel], tree: Any, prefix: str = "") -> list[str]:
    """What pydantic's lax mode lets through but no run can use: a boolean where a number
    belongs (``steps: true`` would be 1), a non-finite float, an integer beyond 2**53.
    Returns one ``field.path: problem`` per offending value."""
    if not isinstance(tree, dict):
        return []
    problems = []
    for name, field in model.model_fields.items():
        if name not in tree:
            continue
        value, path = tree[name], f"{prefix}{name}"
        kind = _number_kind(field.annotation)
        if kind is not None:
            if isinstance(value, bool):
                problems.append(f"{path}: expected {'an integer' if kind == 'int' else 'a number'}"
                                f", got the boolean {str(value).lower()}")
            elif isinstance(value, float) and not math.isfinite(value):
                problems.append(f"{path}: must be a finite number, got {value}")
            elif isinstance(value, int | float) and abs(value) > MAX_INT:
                problems.append(f"{path}: {shorten(value, 30)} is out of any sane range")
            continue
        for sub in _models_in(field.annotation):
            if isinstance(value, list):
                for i, item in enumerate(value):
                    problems += number_problems(sub, item, f"{path}.{i}.")
            else:
                problems += number_problems(sub, value, f"{path}.")
    return problems


SCHEMA_HINT = ("Fix the named fields; `gemctl validate --schema` lists every field, its type "
               "and range.")


def recipe_from_dict(tree: Any, source: str = "<dict>") -> Recipe:
    if tree is None:
        raise RecipeError(f"Recipe {source} is empty.",
                          "Write at least a name and the sections you change; start from "
                          "recipes/demo.yaml.")
    if not isinstance(tree, dict):
        raise RecipeError(
            f"Recipe {source} must be a YAML mapping of sections, not {type(tree).__name__}.",
            "Start from recipes/demo.yaml.",
        )
    problems = number_problems(Recipe, tree)
    if problems:
        raise RecipeError(f"Recipe {source} is invalid: " + "; ".join(problems[:10]) + ".",
                          SCHEMA_HINT)
    try:
        return Recipe.model_validate(tree)
    except ValidationError as err:
        raise RecipeError(describe_invalid(err, f"Recipe {source}"), SCHEMA_HINT) from None


def read_yaml_file(path: str | Path, what: str = "Recipe", example: str = "recipes/demo.yaml"
                   ) -> Any:
    """The parsed YAML document in ``path``; RecipeError (naming the file and the fix) when it
    is missing, a directory, too large, unreadable, empty or not valid YAML."""
    path = Path(path)
    shown = shorten(str(path), 200)
    try:
        is_dir, is_file = path.is_dir(), path.is_file()
    except (OSError, ValueError) as err:  # a name too long for the filesystem, a NUL byte
        raise RecipeError(f"{what} path {shown!r} can't be used ({shorten(str(err), 120)}).",
                          f"Pass the path of a YAML file, e.g. {example}.") from None
    if is_dir:
        raise RecipeError(f"{what} {shown} is a directory, not a file.",
                          f"Pass the path of a YAML file, e.g. {example}.")
    if not is_file:
        raise RecipeError(f"{what} file {shown} does not exist.",
                          f"Pass the path of a YAML file, e.g. {example}.")
    try:
        if path.stat().st_size > MAX_RECIPE_BYTES:
            raise RecipeError(f"{what} {shown} is {path.stat().st_size:,} bytes; a {what.lower()} "
                              f"is a small YAML file (at most {MAX_RECIPE_BYTES:,}).",
                              "Check that you passed the right file.")
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise RecipeError(f"{what} file {shown} can't be read ({shorten(str(err), 200)}).",
                          "Check the file's permissions and that it is UTF-8 text.") from None
    try:
        tree = parse_yaml(text)
    except yaml.YAMLError as err:
        raise RecipeError(f"{what} {shown} is not valid YAML{_yaml_problem(err)}.",
                          "Fix the YAML: indentation, colons, quotes, each key once, no "
                          "alias bombs.") from None
    if tree is None:
        raise RecipeError(f"{what} {shown} is empty.",
                          f"Write the {what.lower()}'s fields; start from {example}.")
    return tree


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Read YAML safely, apply ``--set`` overrides, validate. Raises RecipeError."""
    source = shorten(str(path), 200)
    tree = read_yaml_file(path)
    if overrides:
        if not isinstance(tree, dict):
            return recipe_from_dict(tree, source)
        tree = apply_overrides(tree, overrides)
    return recipe_from_dict(tree, source)


def _type_name(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return " | ".join(str(a) for a in args)
    if origin is typing.Union or isinstance(annotation, types.UnionType):
        return " | ".join("null" if a is type(None) else _type_name(a) for a in args)
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]"
    return getattr(annotation, "__name__", str(annotation))


def field_rows(model: type[BaseModel] | None = None, prefix: str = ""
               ) -> list[tuple[str, str, str, str]]:
    """(dotted field, type and range, default, description) for every field of the recipe,
    sections expanded: what `gemctl validate --schema` prints."""
    rows = []
    for name, field in (model or Recipe).model_fields.items():
        path = f"{prefix}{name}"
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            rows += field_rows(field.annotation, f"{path}.")
            continue
        kind = _type_name(field.annotation)
        bounds = [f"{op} {getattr(m, attr)}" for m in field.metadata
                  for attr, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))
                  if getattr(m, attr, None) is not None]
        if bounds:
            kind += f" ({', '.join(bounds)})"
        if field.is_required():
            default = "(required)"
        elif field.default_factory is not None:
            made = field.default_factory()  # type: ignore[call-arg]
            default = shorten(made.model_dump() if isinstance(made, BaseModel) else made, 60)
        else:
            default = "null" if field.default is None else shorten(field.default, 60)
        rows.append((path, kind, str(default), field.description or ""))
    return rows


def recipe_json_schema() -> dict[str, Any]:
    """The recipe's JSON Schema (pydantic's), with every field's description."""
    return Recipe.model_json_schema()
