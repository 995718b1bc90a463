"""User-ad cross attention (long Q, short KV), pooled attention (short Q, long KV) and the
DHEN-style expert interaction, in GDPA form: activation instead of softmax."""

from __future__ import annotations

import torch
from torch import nn

from gem_kernels import host_to_device
from gem_platform.model.attention import generalized_attention
from gem_platform.model.flops import record_attention


def _offsets_on(device: torch.device, b: int, per_sample: int) -> torch.Tensor:
    """(b+1,) offsets of b samples of per_sample rows each, built on the host and copied
    without a sync, their host copy remembered: GDPA builds its tile schedules on the host
    and would otherwise read them back from the device (a stream sync per call)."""
    return host_to_device(torch.arange(b + 1, dtype=torch.int64) * per_sample, device,
                          remember=True)


class CrossAttention(nn.Module):
    """Each history token (query) attends to its own sample's context tokens (ad, features)."""

    def __init__(self, dim: int, heads: int, activation: str, kernel: str) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.activation, self.kernel = activation, kernel
        self.norm = nn.LayerNorm(dim)
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, x_offsets: torch.Tensor, max_len: int,
                ctx: torch.Tensor) -> torch.Tensor:
        b, n_ctx, d = ctx.shape
        q = self.q(self.norm(x)).view(-1, self.heads, self.head_dim)
        k, v = self.kv(ctx.reshape(b * n_ctx, d)).view(b * n_ctx, 2, self.heads,
                                                       self.head_dim).unbind(1)
        kv_offsets = _offsets_on(ctx.device, b, n_ctx)
        # every history token attends to its own sample's n_ctx context tokens
        record_attention(float(x.shape[0] * n_ctx), self.heads, self.head_dim)
        o = generalized_attention(q.to(v.dtype), k, v, x_offsets, kv_offsets, max_len, n_ctx,
                                  activation=self.activation, norm="kv_len", kernel=self.kernel)
        return x + self.out(o.reshape(x.shape[0], d))


def segment_mean(values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """(B, ...) fp32 mean of each sample's rows of jagged ``values`` (T, ...); 0 for a sample
    with no rows. A segmented sum on the device: no host sync, and its gradient is a gather."""
    sums = torch.segment_reduce(values.float(), "sum", offsets=offsets, axis=0, initial=0)
    lengths = (offsets[1:] - offsets[:-1]).clamp_min(1).to(sums.dtype)
    return sums / lengths.view(-1, *([1] * (sums.dim() - 1)))


class PooledAttention(nn.Module):
    """A few queries per sample (learned, shifted by the candidate ad) summarize the history.

    With ``mean_base`` each query's output is GDPA's plus the sample's mean value vector:
    weights (1 + act(score)) / L instead of act(score) / L. GDPA's activation is ~0 at the
    small scores of an untrained model, so GDPA alone starts with an output and a gradient
    near zero and the model can sit on a plateau that ignores the history for hundreds of
    steps; with the mean it starts as a mean pool (as softmax attention does) and learns
    where to look."""

    def __init__(self, dim: int, heads: int, num_queries: int, activation: str,
                 kernel: str, mean_base: bool = True) -> None:
        super().__init__()
        self.heads, self.head_dim, self.nq = heads, dim // heads, num_queries
        self.activation, self.kernel, self.mean_base = activation, kernel, mean_base
        self.queries = nn.Parameter(torch.randn(num_queries, dim) * dim**-0.5)
        self.ad_to_query = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, x_offsets: torch.Tensor, max_len: int,
                ad: torch.Tensor) -> torch.Tensor:
        b, d = ad.shape
        q = (self.queries[None] + self.ad_to_query(ad)[:, None]).reshape(b * self.nq, d)
        q = q.view(-1, self.heads, self.head_dim)
        k, v = self.kv(x).view(x.shape[0], 2, self.heads, self.head_dim).unbind(1)
        q_offsets = _offsets_on(ad.device, b, self.nq)
        # each of a sample's nq queries attends to all of that sample's history tokens
        record_attention(float(self.nq * x.shape[0]), self.heads, self.head_dim)
        o = generalized_attention(q.to(v.dtype), k, v, q_offsets, x_offsets, self.nq, max_len,
                                  activation=self.activation, norm="kv_len", kernel=self.kernel)
        o = o.view(b, self.nq, d)
        if self.mean_base:
            o = o + segment_mean(v, x_offsets).view(b, 1, d).to(o.dtype)
        return self.out(o)


class MlpExpert(nn.Module):
    def __init__(self, in_dim: int, hidden: int, out_dim: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(in_dim, hidden), nn.SiLU(), nn.Linear(hidden, out_dim))

    def forward(self, flat: torch.Tensor) -> torch.Tensor:
        return self.net(flat)


class _SelfGram(torch.autograd.Function):
    """``t @ t^T`` per sample, whose backward is one contiguous ``(g + g^T) @ t``.

    Autograd's backward of ``bmm(t, t^T)`` adds a second, transposed bmm output to the input
    gradient. Inductor (torch 2.11, H200) fused that strided read into the DHEN layer's looped
    LayerNorm-backward reduction, which stores the summed gradient in its first loop and loads
    it back in its second with nothing ordering the two across threads: the compiled input
    gradient was up to 28% off and changed from run to run
    (docs/bench/determinism_h200_dhen_race.json). With one contiguous product that kernel reads
    no transposed input and repeats; it also costs one bmm instead of two."""

    @staticmethod
    def forward(ctx, t: torch.Tensor) -> torch.Tensor:  # noqa: ANN001 (ctx)
        ctx.save_for_backward(t)
        return torch.bmm(t, t.transpose(1, 2))

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: ANN001 (ctx)
        (t,) = ctx.saved_tensors
        grad = grad.to(t.dtype)
        return torch.bmm(grad + grad.transpose(1, 2), t)


def self_gram(tokens: torch.Tensor) -> torch.Tensor:
    """(B, N, N) dot products of each sample's N tokens with each other, in autocast's dtype
    inside an autocast region (as ``torch.bmm`` would compute them)."""
    kind = tokens.device.type
    if torch.is_autocast_enabled(kind):
        tokens = tokens.to(torch.get_autocast_dtype(kind))
    return _SelfGram.apply(tokens)


def pair_picker(num_tokens: int) -> torch.Tensor:
    """(N*N, P) one-hot float matrix whose product with a flattened (N, N) Gram gives its P
    upper-triangle entries (token pairs i < j), in ``torch.triu_indices`` order."""
    rows, cols = torch.triu_indices(num_tokens, num_tokens, offset=1)
    pick = torch.zeros(num_tokens * num_tokens, rows.numel())
    pick[rows * num_tokens + cols, torch.arange(rows.numel())] = 1.0
    return pick


class DotInteraction(nn.Module):
    """Pairwise dot products of feature tokens, projected back to the token layout.

    The pairs are picked from the Gram by a product with a one-hot matrix rather than by an
    index: exact either way (one nonzero term per output, accumulated in fp32; fp32 Grams
    exactly where fp32 matmuls are not allowed TF32). An index's backward is a scatter-add,
    which Inductor does not generate under deterministic algorithms: it calls ATen's sort-based
    ``index_put_`` outside the compiled kernels instead. The product's backward is one small
    matmul in every mode."""

    def __init__(self, num_tokens: int, out_dim: int) -> None:
        super().__init__()
        # a buffer, so it moves with the model (a host tensor would be copied every forward)
        self.register_buffer("pick", pair_picker(num_tokens), persistent=False)
        self.proj = nn.Linear(self.pick.shape[1], out_dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        gram = self_gram(tokens) * tokens.shape[-1] ** -0.5
        return self.proj(gram.flatten(1) @ self.pick.to(gram.dtype))


class DhenLayer(nn.Module):
    """One layer of a deep hierarchical ensemble: heterogeneous experts (MLPs and a dot-product
    interaction) see the same feature tokens; their outputs are summed into a residual update."""

    def __init__(self, num_tokens: int, dim: int, num_experts: int, hidden: int) -> None:
        super().__init__()
        flat = num_tokens * dim
        # the ensemble size, also when expert parallelism swaps `experts` for an exchange
        self.num_experts = num_experts
        self.norm = nn.LayerNorm(dim)
        self.experts = nn.ModuleList(MlpExpert(flat, hidden, flat) for _ in range(num_experts))
        self.dot = DotInteraction(num_tokens, flat)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        b, n, d = tokens.shape
        h = self.norm(tokens)
        flat = h.reshape(b, n * d)
        update = self.dot(h)
        for expert in self.experts:
            update = update + expert(flat)
        return tokens + update.view(b, n, d) / (self.num_experts + 1)
