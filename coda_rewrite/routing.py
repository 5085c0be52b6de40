"""The routed form of a dense experts layer: the ops patterns/dense_experts.py puts in the
graph in place of every token run through every expert (the inverse permutation and the
per-token sum also serve the routed experts' backward, kernels/grouped.GroupedGated).

Llama 4's experts (transformers' Llama4TextExperts) run densely: each token's input is
scaled by its routing score for expert e (zero off the router's top-k) and every
expert's MLP runs on every token, as two torch.bmm over the stacked weights; the outputs
are summed over the experts. Where an expert's MLP maps a zero row to zero, only the
top-k (token, expert) pairs contribute, so the same sum is

    rows  = the T·k pairs sorted by expert (a stable sort of the top-k ids)
    x[s]  = tokens[token(s)] · scores[token(s), expert(s)]            (S × K)
    y     = grouped GEMMs over the rows (the expert's gate/up, the activation, its down)
    out   = Σ over each token's k rows, back in token order

E/k times fewer GEMM FLOPs (16 for Llama-4-Scout's 16 experts and top-1), and the
[E, T, 2I] intermediate is [T·k, 2I]. The sums run in each token's own order (the
inverse permutation: no atomic adds, deterministic).

The gather of each routed row's token and the sum back over each token's rows are
adjoint, and both are permutations of the same (token, slot) pairs, so each one's
gradient is the other (gather_tokens, sum_to_tokens; statements.prove_token_routing):
autograd alone would differentiate ``rows[inverse]`` and ``tokens[perm // k]`` as
index_put scatters with atomic adds, a zero-filled buffer and a pass each, where a
gather is one pass Inductor fuses into its neighbours.
"""

from __future__ import annotations

import torch


def sort_by_expert(index: torch.Tensor, experts: int):
    """(perm, offsets, inverse) of the top-k (token, slot) pairs ``index`` [T, k] sorted
    by expert: row s of the routed problem is pair perm[s] (token perm[s] // k), the
    rows of expert e end at offsets[e] (int32, what grouped GEMMs take), and pair p is
    row inverse[p]. The counts are a histogram over E bins of the ids as float32
    (exact below 2²⁴ rows; histc takes no integers on the CPU), a fixed-size output
    where bincount's size would depend on the data."""
    flat = index.reshape(-1)
    ids, perm = torch.sort(flat, stable=True)
    counts = torch.histc(ids.float(), bins=experts, min=0, max=experts - 1)
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    return perm, offsets, inverse_permutation(perm)


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """inv with inv[perm[s]] = s: where each (token, slot) pair's row went."""
    return torch.empty_like(perm).scatter_(
        0, perm, torch.arange(perm.shape[0], device=perm.device, dtype=perm.dtype))


def gather_scaled(tokens: torch.Tensor, scores: torch.Tensor, index: torch.Tensor,
                  perm: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """Each routed row's token scaled by its score for its expert: tokens [T, K], scores
    [T, E], index [T, k] -> [T·k, K] in expert order (``inverse``: perm's inverse, for
    the gather's gradient). The product in the dtypes eager multiplies in (tokens · the
    scores' column, promoted alike)."""
    k = index.shape[1]
    weight = scores.gather(1, index).reshape(-1)[perm]
    return gather_tokens(tokens, perm, inverse, k) * weight.unsqueeze(-1)


# up to this many rows per token the sum is spelled as k gathers added (below)
UNROLLED_TOP_K = 16


def back_to_tokens(rows: torch.Tensor, inverse: torch.Tensor, top_k: int) -> torch.Tensor:
    """Σ over each token's k routed rows [T·k, N] -> [T, N], in the rows' dtype, summed
    in float32 for 16-bit rows (as torch's sum over the experts, one rounding).

    Spelled as k row gathers added in token order rather than ``rows[inverse]
    .reshape(T, k, N).sum(1)``: Inductor makes the latter a reduction over k whose
    gathered loads are a few elements wide (0.320 ms at 8192 tokens × top-8 × 2048
    columns in bf16 on the H200, a quarter of the bandwidth), the former one pointwise
    pass with k coalesced row loads (0.081 ms; 0.278 → 0.140 at top-2 × 4096, 0.281 →
    0.167 at top-4 × 2880; benchmarks in BENCHMARKS.md, fourteenth session)."""
    if top_k > UNROLLED_TOP_K:
        return rows[inverse].reshape(-1, top_k, rows.shape[-1]).sum(1)
    acc_dtype = torch.float32 if rows.dtype in (torch.float16, torch.bfloat16) else rows.dtype
    slots = inverse.reshape(-1, top_k)
    acc = rows[slots[:, 0]].to(acc_dtype)
    for j in range(1, top_k):
        acc = acc + rows[slots[:, j]].to(acc_dtype)
    return acc.to(rows.dtype)


class _Adjoint(torch.autograd.Function):
    """The routing's gather (``gather``: tokens[perm // k]) or its sum back
    (back_to_tokens), differentiated as the other: token t's rows are the pairs
    t·k .. t·k + k - 1 and row s is pair perm[s], so ∂out[t]/∂rows[s] of the sum back
    is 1 exactly where t = perm[s] // k (inverse is perm's inverse: inv[p] = s ⟺
    p = perm[s]), and the gather's gradient is each token's k rows summed in its own
    order (float32 sums: no atomic adds, deterministic)."""

    @staticmethod
    def forward(x, perm, inverse, top_k, gather):
        return x[perm // top_k] if gather else back_to_tokens(x, inverse, top_k)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, perm, inverse, ctx.top_k, ctx.gather = inputs
        ctx.save_for_backward(perm, inverse)

    @staticmethod
    def backward(ctx, grad):
        perm, inverse = ctx.saved_tensors
        other = sum_to_tokens if ctx.gather else gather_tokens
        return other(grad, perm, inverse, ctx.top_k), None, None, None, None


def sum_to_tokens(rows: torch.Tensor, perm: torch.Tensor, inverse: torch.Tensor,
                  top_k: int) -> torch.Tensor:
    """back_to_tokens(rows, inverse, top_k), differentiated as a gather (rows [T·k, N]
    in the order of ``perm``, a permutation of the T·k (token, slot) pairs, ``inverse``
    its inverse)."""
    if torch.is_grad_enabled() and rows.requires_grad:
        return _Adjoint.apply(rows, perm, inverse, top_k, False)
    return back_to_tokens(rows, inverse, top_k)


def gather_tokens(tokens: torch.Tensor, perm: torch.Tensor, inverse: torch.Tensor,
                  top_k: int) -> torch.Tensor:
    """tokens[perm // top_k] (each routed row's token), differentiated as a sum per
    token in its own order (``inverse``: perm's inverse)."""
    if torch.is_grad_enabled() and tokens.requires_grad:
        return _Adjoint.apply(tokens, perm, inverse, top_k, True)
    return tokens[perm // top_k]
