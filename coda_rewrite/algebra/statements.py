"""The identities every rewrite rests on, proved with sympy for general sizes and backed
by a numeric witness (random float64, small random shapes).

Each ``prove_*`` function returns a Proof (statement, side conditions, steps, witness) or
raises ``Unproved``: a statement that sympy cannot reduce is a checker bug, never a
licence to rewrite. Proofs depend only on the statement's shape, so each is computed once
per process (``functools.cache``); a 32-layer model asks for the same few.

Index conventions: i a row (token), j an output feature, k the contracted feature,
K its (symbolic) length; W is in nn.Linear's [out, in] layout, so a GEMM is
Σ_k H[i, k]·W[j, k].
"""

from __future__ import annotations

import functools

import sympy as sp
import torch

from ..codegen import reference
from ..numerics import rel_err
from .decision import Proof
from .isolated import off_thread

i, j, k, f = sp.symbols("i j k f", integer=True, nonnegative=True)
K, m = sp.symbols("K m", integer=True, positive=True)


class Unproved(AssertionError):
    """sympy did not reduce a statement to an identity (a checker bug)."""


def _zero(expr) -> bool:
    return sp.simplify(sp.powsimp(sp.expand(expr))) == 0


def _require(expr, what: str) -> None:
    if not _zero(expr):
        raise Unproved(f"{what}: {sp.sstr(expr)} did not simplify to 0")


def _refute(expr, what: str) -> None:
    if _zero(expr):
        raise Unproved(f"{what} was 'proved', but it is false: the checker is unsound")


def _gen(seed: int):
    return torch.Generator().manual_seed(seed)


def _witness(name: str, fn, tol: float = 1e-12, trials: int = 3) -> str:
    worst = 0.0
    for seed in range(trials):  # off the caller's thread: see algebra/isolated.py
        worst = max(worst, off_thread(fn, seed))
    if not worst <= tol:
        raise Unproved(f"numeric witness of {name} disagrees: rel. error {worst:.2e}")
    return f"float64, {trials} random shapes: max rel. error {worst:.1e}"


def _shape(seed: int, *lo_hi):
    g = _gen(seed + 1000)
    return [int(torch.randint(lo, hi + 1, (1,), generator=g)) for lo, hi in lo_hi]


# ---- GEMM algebra ---------------------------------------------------------------------

Sum = sp.Sum
r, H, W, g_, b_ = (sp.IndexedBase(n) for n in ("r", "H", "W", "gamma", "b"))


def _gemm(x):
    return Sum(x, (k, 0, K - 1))


@functools.cache
def prove_row_scale_deferral() -> Proof:
    lhs = _gemm(r[i] * H[i, k] * W[j, k])
    rhs = r[i] * _gemm(H[i, k] * W[j, k])
    _require(lhs - rhs, "row-scale deferral")
    _refute(_gemm(r[k] * H[i, k] * W[j, k]) - r[k] * _gemm(H[i, k] * W[j, k]),
            "deferral of a factor that varies along the contracted dim")
    sigma = sp.Function("sigma")
    s = sigma(i)
    _require(_gemm(r[s] * H[s, k] * W[j, k]) - r[s] * _gemm(H[s, k] * W[j, k]),
             "deferral through a row selection")

    def num(seed):
        mm, kk, nn = _shape(seed, (1, 9), (1, 9), (1, 9))
        g = _gen(seed)
        rr, hh, ww = (torch.randn(mm, generator=g, dtype=torch.float64),
                      torch.randn(mm, kk, generator=g, dtype=torch.float64),
                      torch.randn(nn, kk, generator=g, dtype=torch.float64))
        return rel_err(rr[:, None] * (hh @ ww.T), (rr[:, None] * hh) @ ww.T)

    return Proof(
        "Σ_k (r[i]·H[i,k])·W[j,k] = r[i]·Σ_k H[i,k]·W[j,k]",
        ("r is one scalar per row (constant in k)",
         "the GEMM contracts over the feature dim k, not over rows",
         "rows selected/gathered/permuted before the GEMM (i ↦ σ(i)) select r the same way"),
        (f"{sp.sstr(lhs)} − {sp.sstr(rhs)} simplifies to 0",
         "with σ(i) for i (any row selection) the same reduction holds",
         "with r[k] in place of r[i] the difference does not vanish: refused"),
        _witness("row-scale deferral", num))


@functools.cache
def prove_per_feature_fold() -> Proof:
    lhs = _gemm(H[i, k] * g_[k] * W[j, k])
    rhs = _gemm(H[i, k] * (g_[k] * W[j, k]))
    _require(lhs - rhs, "per-feature folding")
    _refute(lhs - g_[i] * _gemm(H[i, k] * W[j, k]), "deferring γ as if it were per row")

    def num(seed):
        mm, kk, nn = _shape(seed, (1, 9), (1, 9), (1, 9))
        g = _gen(seed)
        hh, gg, ww = (torch.randn(mm, kk, generator=g, dtype=torch.float64),
                      torch.randn(kk, generator=g, dtype=torch.float64),
                      torch.randn(nn, kk, generator=g, dtype=torch.float64))
        return rel_err((hh * gg) @ ww.T, hh @ (ww * gg).T)

    return Proof(
        "Σ_k (H[i,k]·γ[k])·W[j,k] = Σ_k H[i,k]·(γ[k]·W[j,k])   (W' = W·diag(γ))",
        ("γ is one value per contracted feature k",
         "W' is recomputed from the live γ and W on every call (training updates both)"),
        ("associativity of the product inside the sum",
         "γ[k] cannot leave the sum as a row factor: γ[i]·Σ_k H·W differs (refused)"),
        _witness("per-feature folding", num))


@functools.cache
def prove_bias_distribution() -> Proof:
    lhs = _gemm((r[i] * H[i, k] + b_[k]) * W[j, k]).expand()
    rhs = r[i] * _gemm(H[i, k] * W[j, k]) + _gemm(b_[k] * W[j, k])
    _require(lhs - rhs, "bias distribution")

    def num(seed):
        mm, kk, nn = _shape(seed, (1, 9), (1, 9), (1, 9))
        g = _gen(seed)
        rr, hh, bb, ww = (torch.randn(mm, generator=g, dtype=torch.float64),
                          torch.randn(mm, kk, generator=g, dtype=torch.float64),
                          torch.randn(kk, generator=g, dtype=torch.float64),
                          torch.randn(nn, kk, generator=g, dtype=torch.float64))
        return rel_err(rr[:, None] * (hh @ ww.T) + (bb @ ww.T)[None],
                    (rr[:, None] * hh + bb) @ ww.T)

    return Proof(
        "Σ_k (r[i]·H[i,k] + b[k])·W[j,k] = r[i]·Σ_k H[i,k]·W[j,k] + Σ_k b[k]·W[j,k]",
        ("b is one value per contracted feature (a bias after the norm)",
         "b·Wᵀ is recomputed from the live b and W on every call"),
        ("linearity of the sum: the bias becomes the per-feature term (b·Wᵀ)[j] of the "
         "consumer's epilogue",),
        _witness("bias distribution", num))


@functools.cache
def prove_layernorm_centring() -> Proof:
    """LN(z)·Wᵀ + b = r·(z·W'ᵀ − μ·s) + b' (patterns/layernorm.py), and the backward's
    W' gradient: (r·dy)ᵀ·z plus s's share −(r·μ·dy)ᵀ·1 is (r·dy)ᵀ·(z − μ)."""
    z, mu, beta, dy = (sp.IndexedBase(n) for n in ("z", "mu", "beta", "dy"))
    ln = (z[i, k] - mu[i]) * r[i] * g_[k] + beta[k]
    w_fold = g_[k] * W[j, k]
    s = _gemm(w_fold)
    lhs = _gemm(ln * W[j, k]) + b_[j]
    rhs = r[i] * (_gemm(z[i, k] * w_fold) - mu[i] * s) + (_gemm(beta[k] * W[j, k]) + b_[j])
    _require(sp.expand(lhs - rhs).doit(), "LayerNorm centring")
    # the sum must be of the folded weights: s from the unfolded W is another function
    s_unfolded = _gemm(W[j, k])
    _refute(sp.expand(lhs - (r[i] * (_gemm(z[i, k] * w_fold) - mu[i] * s_unfolded)
                             + _gemm(beta[k] * W[j, k]) + b_[j])).doit(),
            "centring with s summed from the unfolded weights")
    # a mean that varies along the contracted features does not leave the sum
    _refute(sp.expand(_gemm((z[i, k] - mu[k]) * w_fold)
                      - (_gemm(z[i, k] * w_fold) - mu[k] * s)).doit(),
            "centring by a per-feature value")
    # backward: d/dW'[j, k] of Σ_ij dy·r·(Σ_k z·W' − μ·Σ_k W'), summed over rows i
    rows = sp.Symbol("M", integer=True, positive=True)
    grad_direct = Sum(dy[i, j] * r[i] * z[i, k], (i, 0, rows - 1))
    grad_through_s = -Sum(dy[i, j] * r[i] * mu[i], (i, 0, rows - 1))
    _require(sp.expand(grad_direct + grad_through_s
                       - Sum(dy[i, j] * r[i] * (z[i, k] - mu[i]), (i, 0, rows - 1))).doit(),
             "the centred weight gradient")

    def num(seed):
        mm, kk, nn = _shape(seed, (1, 9), (1, 9), (1, 9))
        g = _gen(seed)
        zz = 3.0 + torch.randn(mm, kk, generator=g, dtype=torch.float64)
        gg, bb = (torch.randn(kk, generator=g, dtype=torch.float64) for _ in range(2))
        ww = torch.randn(nn, kk, generator=g, dtype=torch.float64)
        b0 = torch.randn(nn, generator=g, dtype=torch.float64)
        eps = 1e-5
        want = torch.nn.functional.layer_norm(zz, (kk,), gg, bb, eps) @ ww.T + b0
        var, mean = torch.var_mean(zz, -1, keepdim=True, correction=0)
        wf = ww * gg
        got = torch.rsqrt(var + eps) * (zz @ wf.T - mean * wf.sum(-1)) + (bb @ ww.T + b0)
        return rel_err(got, want)

    return Proof(
        "Σ_k LN(z)[i,k]·W[j,k] + b[j] = r[i]·(Σ_k z[i,k]·W'[j,k] − μ[i]·s[j]) + b'[j]",
        ("μ and r are one scalar each per row (constant in k)",
         "W' = W∘γ, s_j = Σ_k W'[j,k] from the same (rounded) W', b' = β·Wᵀ + b, all "
         "recomputed from the live parameters (or kept while none changed)"),
        (f"{sp.sstr(lhs)} − {sp.sstr(rhs)} simplifies to 0",
         "with s summed from the unfolded W, or a mean that varies along k, the "
         "difference does not vanish: refused",
         "backward: W'’s gradient through acc and through s sums to (r·dy)ᵀ·(z − μ), "
         "the form the backward rule computes (no cancellation of two mean-sized terms)"),
        _witness("LayerNorm centring", num))


# ---- reductions -----------------------------------------------------------------------

_a, _b, _c = sp.symbols("a b c", real=True)
REDUCTIONS = {
    "sum": (lambda x, y: x + y, sp.Integer(0)),
    "max": (lambda x, y: sp.Max(x, y), -sp.oo),
    "max_abs": (lambda x, y: sp.Max(sp.Abs(x), sp.Abs(y)), sp.Integer(0)),
}


@functools.cache
def prove_reduction_decomposition(kind: str) -> Proof:
    """Per-tile partials merged in any order equal the full row reduction."""
    merge, identity = REDUCTIONS[kind]
    if kind == "max_abs":  # merges |values|: associative on the folded magnitudes
        merge = lambda x, y: sp.Max(x, y)  # noqa: E731
        _a2, _b2, _c2 = (sp.Abs(v) for v in (_a, _b, _c))
    else:
        _a2, _b2, _c2 = _a, _b, _c
    _require(merge(merge(_a2, _b2), _c2) - merge(_a2, merge(_b2, _c2)), f"{kind} associativity")
    _require(merge(_a2, _b2) - merge(_b2, _a2), f"{kind} commutativity")
    if kind == "max":
        if sp.Max(_a, identity) != _a:
            raise Unproved("max identity")
    else:
        _require(merge(_a2, identity) - _a2, f"{kind} identity")

    torch_op = {"sum": torch.sum, "max": torch.amax,
                "max_abs": lambda t, dim: t.abs().amax(dim)}[kind]

    def num(seed):
        mm, nn, tile = _shape(seed, (1, 5), (1, 40), (1, 16))
        x = torch.randn(mm, nn, generator=_gen(seed), dtype=torch.float64)
        parts = [torch_op(x[:, s:s + tile], dim=1) for s in range(0, nn, tile)]
        merged = parts[0]
        for p in parts[1:]:
            merged = merged + p if kind == "sum" else torch.maximum(merged, p)
        return rel_err(merged, torch_op(x, dim=1))

    return Proof(
        f"{kind} over a row = the {kind}-merge of per-tile partials, in any order",
        (f"the merge is associative and commutative with identity {identity} "
         "(a ragged tile's padding must hold the identity)",),
        ("associativity and commutativity verified symbolically; by induction over tiles "
         "any merge order of the partials equals the full reduction",),
        _witness(f"{kind} decomposition", num))


@functools.cache
def refute_mean_of_means() -> str:
    """Why a mean of tile means is rejected unless the tiles are equal-sized."""
    s1, s2 = sp.symbols("s1 s2", real=True)
    n1, n2 = sp.symbols("n1 n2", positive=True, integer=True)
    diff = (s1 / n1 + s2 / n2) / 2 - (s1 + s2) / (n1 + n2)
    _refute(diff, "mean of tile means")
    _require(diff.subs(n2, n1), "mean of equal-sized tile means")
    return ("(s1/n1 + s2/n2)/2 − (s1+s2)/(n1+n2) ≠ 0 unless n1 = n2: merge sums and "
            "divide once (a ragged last tile has fewer columns)")


@functools.cache
def prove_lse_merge() -> Proof:
    """(m, s) ⊕ (m', s') = (M, s·e^(m−M) + s'·e^(m'−M)), M = max(m, m')."""
    ms = sp.symbols("m1:4", real=True)
    ss = sp.symbols("s1:4", positive=True)

    def merge(x, y):
        big = sp.Max(x[0], y[0])
        return big, x[1] * sp.exp(x[0] - big) + y[1] * sp.exp(y[0] - big)

    p = list(zip(ms, ss))
    left, right = merge(merge(p[0], p[1]), p[2]), merge(p[0], merge(p[1], p[2]))
    _require(left[0] - right[0], "LSE merge associativity (max)")
    _require(left[1] - right[1], "LSE merge associativity (sum)")
    _require(left[1] * sp.exp(left[0]) - sum(s_ * sp.exp(m_) for m_, s_ in p),
             "LSE merge represents Σ exp over the union")
    naive = sp.exp(-sp.oo - (-sp.oo))
    if naive is not sp.nan:
        raise Unproved("expected the naive merge of two empty states to be undefined")

    def num(seed):
        mm, nn, tile = _shape(seed, (1, 5), (2, 40), (1, 16))
        x = torch.randn(mm, nn, generator=_gen(seed), dtype=torch.float64) * 10
        state = None
        for s0 in range(0, nn, tile):
            part = x[:, s0:s0 + tile]
            mx = part.amax(1)
            cur = (mx, torch.exp(part - mx[:, None]).sum(1))
            if state is None:
                state = cur
            else:
                big = torch.maximum(state[0], cur[0])
                state = (big, state[1] * torch.exp(state[0] - big)
                         + cur[1] * torch.exp(cur[0] - big))
        return rel_err(state[0] + torch.log(state[1]), torch.logsumexp(x, 1))

    return Proof(
        "(m,s) ⊕ (m',s') = (M, s·e^(m−M) + s'·e^(m'−M)), M = max(m,m'); log-sum-exp of "
        "the union = M + log(s·e^(m−M) + s'·e^(m'−M))",
        ("a state (m, s) stands for Σ exp = s·e^m",
         "merging two empty states (−∞, 0) must be defined as (−∞, 0): computed naively "
         "e^(−∞−(−∞)) is NaN, so the merge guards M = −∞"),
        ("associativity: both groupings give M = max(m1,m2,m3) and s = Σ s_t·e^(m_t−M)",
         "the merged state represents s1·e^m1 + s2·e^m2 + s3·e^m3 (the union's Σ exp)",
         "e^(−∞ − (−∞)) = nan in sympy: the empty-state side condition is real"),
        _witness("LSE merge", num, tol=1e-12))


# ---- permutations, RoPE, gated activations --------------------------------------------

@functools.cache
def prove_permutation_invariance() -> Proof:
    n = sp.Symbol("n", integer=True, positive=True)
    Q, Km, P = (sp.MatrixSymbol(s, n, n) for s in ("Q", "K", "P"))
    expr = ((Q * P) * (Km * P).T).doit()
    if expr.subs(P * P.T, sp.Identity(n)) != Q * Km.T:
        raise Unproved("(QP)(KP)ᵀ did not reduce to QKᵀ")
    only_q = (Q * P) * Km.T
    if only_q == Q * Km.T:
        raise Unproved("a permutation of q alone was 'proved' invariant")

    def num(seed):
        mm, d = _shape(seed, (1, 7), (2, 12))
        g = _gen(seed)
        q, kk = (torch.randn(mm, d, generator=g, dtype=torch.float64) for _ in range(2))
        perm = torch.randperm(d, generator=g)
        return rel_err(q[:, perm] @ kk[:, perm].T, q @ kk.T)

    return Proof(
        "(Q·P)·(K·P)ᵀ = Q·Kᵀ for a permutation matrix P",
        ("the same P acts on the head dim of q and of k",
         "q and k flow nowhere else (a returned KV cache would expose the permuted order)"),
        ("(QP)(KP)ᵀ = Q·P·Pᵀ·Kᵀ and P·Pᵀ = I for a permutation",
         "with P on q alone, Q·P·Kᵀ ≠ Q·Kᵀ: refused"),
        _witness("permutation invariance", num))


@functools.cache
def prove_head_norm_permutation() -> Proof:
    """A per-head RMSNorm commutes with a permutation of the head's features (the pair
    order RoPE's re-layout gives each head), its weight permuted alike; and a statistic
    over any other grouping of the columns is a different function."""
    for d in (2, 4, 6, 8, 12, 16):  # every head width's pair order, exactly
        h = d // 2
        xs = sp.symbols(f"x0:{d}", real=True)
        gs = sp.symbols(f"g0:{d}", real=True)
        eps = sp.Symbol("eps", positive=True)
        order = [q for f in range(h) for q in (f, f + h)]  # y[2f] = x[f], y[2f+1] = x[f+h]
        stat = sp.Add(*(x ** 2 for x in xs)) / d + eps
        stat_permuted = sp.Add(*(xs[q] ** 2 for q in order)) / d + eps
        _require(stat_permuted - stat, f"per-head statistic under the pair order (d={d})")
        for p, q in enumerate(order):  # feature p of the fused head is eager's feature q
            _require(xs[q] * gs[q] / sp.sqrt(stat_permuted) - xs[q] * gs[q] / sp.sqrt(stat),
                     f"normalised feature {p} (d={d})")
    x0, x1, x2, x3 = sp.symbols("x0:4", real=True)  # two heads of 2 vs one group of 4
    _refute((x0 ** 2 + x1 ** 2) / 2 - (x0 ** 2 + x1 ** 2 + x2 ** 2 + x3 ** 2) / 4,
            "a statistic over two heads equal to one head's")

    def num(seed):
        from ..codegen import layouts, op_table
        mm, heads, h = _shape(seed, (1, 6), (1, 4), (1, 8))
        d = 2 * h
        g = _gen(seed)
        x = torch.randn(mm, heads * d, generator=g, dtype=torch.float64) * 3
        gamma = torch.randn(d, generator=g, dtype=torch.float64)
        eps = 1e-6
        xh = x.unflatten(-1, (heads, d))
        eager = xh * torch.rsqrt(xh.square().mean(-1, keepdim=True) + eps) * gamma
        permuted = layouts.pair_order(xh).flatten(-2)
        fused = permuted * op_table.head_rstd(permuted, d, eps) * \
            layouts.pair_order(gamma).repeat(heads)
        return rel_err(fused, layouts.pair_order(eager).flatten(-2))

    return Proof(
        "rms_head(x·P)·(γ·P) = (rms_head(x)·γ)·P for a permutation P within each head, "
        "rms_head(x) = x / sqrt(mean over the head's d features of x² + eps)",
        ("P permutes features within a head, never across heads",
         "the statistic's groups are exactly the heads (the tile holds whole heads)",
         "the norm's weight is permuted with the features"),
        ("a sum of squares over a head is the same sum in any order (checked exactly for "
         "the pair order at d = 2 … 16)",
         "each normalised feature is its own value over the shared statistic, times its own "
         "weight: it moves with the permutation",
         "a statistic over another grouping (two heads as one) differs: refuted"),
        _witness("per-head norm under the pair order", num))


@functools.cache
def prove_head_norm_through_rotation() -> Proof:
    """A per-head RMSNorm after a rotation of the head's feature pairs has the statistic
    of the unrotated head: each pair's rotation keeps its sum of squares."""
    x1, x2, th = sp.symbols("x1 x2 theta", real=True)
    c, s_ = sp.cos(th), sp.sin(th)
    _require(sp.trigsimp((x1 * c - x2 * s_) ** 2 + (x1 * s_ + x2 * c) ** 2 - x1 ** 2 - x2 ** 2),
             "a rotated pair's sum of squares")
    _refute((x1 * c - x2 * s_) ** 2 - x1 ** 2, "one rotated feature's square")

    def num(seed):
        from ..codegen import op_table
        mm, heads, h = _shape(seed, (1, 6), (1, 4), (1, 8))
        d = 2 * h
        g = _gen(seed)
        x = torch.randn(mm, heads * d, generator=g, dtype=torch.float64)
        pos = torch.arange(mm, dtype=torch.float64)[:, None] * 5 + 1
        freq = torch.rand(1, heads * d, generator=g, dtype=torch.float64)
        rot = op_table.rotate_pairs(x, pos, freq)
        return rel_err(op_table.head_rstd(rot, d, 1e-6), op_table.head_rstd(x, d, 1e-6))

    return Proof(
        "rms_head(R(θ)·x) = rms_head(x) for a rotation R(θ) of each adjacent feature pair "
        "of a head: a norm after the rotation takes the statistic of what the rotation "
        "reads",
        ("the rotation's pairs lie within a head",
         "features the rotation passes through (a partial rotary) are unchanged"),
        ("(x1·cos θ − x2·sin θ)² + (x1·sin θ + x2·cos θ)² = x1² + x2²",
         "one rotated feature's square alone differs: refuted",
         "the norm's weight then multiplies the rotated features in their (pair) order"),
        _witness("per-head statistic through a rotation", num))


@functools.cache
def prove_rope_interleave() -> Proof:
    """Half-split RoPE conjugated by the interleave permutation = RoPE on adjacent pairs."""
    x, c, s = sp.IndexedBase("x"), sp.IndexedBase("cos"), sp.IndexedBase("sin")
    # half-split (Hugging Face rotate_half): features f and f + m rotate together
    half_lo = x[f] * c[f] - x[f + m] * s[f]
    half_hi = x[f + m] * c[f] + x[f] * s[f]
    # interleave π: y[2f] = x[f], y[2f+1] = x[f+m]; adjacent-pair RoPE on y
    y = {2 * f: x[f], 2 * f + 1: x[f + m]}
    pair_even = y[2 * f] * c[f] - y[2 * f + 1] * s[f]
    pair_odd = y[2 * f + 1] * c[f] + y[2 * f] * s[f]
    _require(pair_even - half_lo, "RoPE interleave (even lane)")
    _require(pair_odd - half_hi, "RoPE interleave (odd lane)")

    def num(seed):
        (half,) = _shape(seed, (1, 8))
        d = 2 * half
        g = _gen(seed)
        xx = torch.randn(3, d, generator=g, dtype=torch.float64)
        ang = torch.randn(half, generator=g, dtype=torch.float64)
        cos, sin = torch.cat([ang.cos()] * 2), torch.cat([ang.sin()] * 2)
        rot = torch.cat([-xx[:, half:], xx[:, :half]], -1)
        ref = xx * cos + rot * sin
        perm = torch.stack([torch.arange(half), torch.arange(half) + half], 1).flatten()
        yy = xx[:, perm].reshape(3, half, 2)
        out = torch.stack([yy[..., 0] * ang.cos() - yy[..., 1] * ang.sin(),
                           yy[..., 1] * ang.cos() + yy[..., 0] * ang.sin()], -1).flatten(1)
        return rel_err(out, ref[:, perm])

    return Proof(
        "π(rope_half(x)) = rope_pairs(π(x)),  π: y[2f] = x[f], y[2f+1] = x[f + d/2]",
        ("the same cos/sin per frequency f in both conventions",
         "π is applied to the output features of W_q and W_k alike (permutation invariance)"),
        ("lane 2f: x[f]·cos f − x[f+m]·sin f on both sides",
         "lane 2f+1: x[f+m]·cos f + x[f]·sin f on both sides"),
        _witness("RoPE interleave", num))


@functools.cache
def prove_rotation_facts() -> Proof:
    """What the fused rotation relies on besides the interleave: frequency 0 passes a
    column pair through (v in the q/k/v GEMM), and so does a table read under a 0 flag
    (cos' = on·cos + 1 − on, sin' = on·sin; the table itself under a 1), R(−θ) undoes
    R(θ) (the backward), a scale commutes with the rotation (the rope type's attention
    scaling)."""
    x1, x2, th, sc, c, s, on = sp.symbols("x1 x2 theta s c s_ on", real=True)

    def rot(a, b, t):
        return a * sp.cos(t) - b * sp.sin(t), a * sp.sin(t) + b * sp.cos(t)

    for lane, (got, want) in enumerate(zip(rot(x1, x2, 0), (x1, x2))):
        _require(got - want, f"zero-frequency pass-through (lane {lane})")
    flagged = (on * c + 1 - on, on * s)
    for value, want in ((0, (1, 0)), (1, (c, s))):
        for got, w in zip(flagged, want):
            _require(got.subs(on, value) - w, f"table flag {value}")
    back = rot(*rot(x1, x2, th), -th)
    for lane, (got, want) in enumerate(zip(back, (x1, x2))):
        _require(sp.simplify(got - want), f"R(-θ)·R(θ) = I (lane {lane})")
    for lane, (got, want) in enumerate(zip(rot(sc * x1, sc * x2, th),
                                           (sc * v for v in rot(x1, x2, th)))):
        _require(got - want, f"scale commutes with the rotation (lane {lane})")

    def num(seed):
        g = _gen(seed)
        xx = torch.randn(2, 64, generator=g, dtype=torch.float64)
        t = torch.randn(64, generator=g, dtype=torch.float64) * 100

        def r(v, a):
            return torch.stack((v[0] * a.cos() - v[1] * a.sin(),
                                v[0] * a.sin() + v[1] * a.cos()))
        return max(rel_err(r(r(xx, t), -t), xx), rel_err(r(xx, torch.zeros_like(t)), xx))

    return Proof(
        "R(0)·y = y,  R(−θ)·R(θ)·y = y,  R(θ)·(s·y) = s·R(θ)·y  (R(θ) a 2×2 rotation);  "
        "a table under flag 0 is (cos, sin) = (1, 0), under flag 1 itself",
        ("cos 0 = 1 and sin 0 = 0 exactly (and in the kernel: MUFU sin/cos of 0)",),
        ("cos²θ + sin²θ = 1", "the rotation is linear"),
        _witness("rotation facts", num))


@functools.cache
def prove_complex_rotation() -> Proof:
    """TorchTitan's complex product is the pairwise rotation the epilogue computes."""
    x1, x2, c, s = sp.symbols("x1 x2 c s", real=True)
    prod = sp.expand((x1 + sp.I * x2) * (c + sp.I * s))
    _require(sp.re(prod) - (x1 * c - x2 * s), "complex rotation (real part)")
    _require(sp.im(prod) - (x1 * s + x2 * c), "complex rotation (imaginary part)")

    def num(seed):
        g = _gen(seed)
        xx = torch.randn(5, 8, generator=g, dtype=torch.float64)
        ang = torch.randn(5, 4, generator=g, dtype=torch.float64)
        table = torch.polar(torch.ones_like(ang), ang)
        ref = torch.view_as_real(torch.view_as_complex(xx.reshape(5, 4, 2)) * table).flatten(1)
        out = torch.stack((xx[:, 0::2] * ang.cos() - xx[:, 1::2] * ang.sin(),
                           xx[:, 0::2] * ang.sin() + xx[:, 1::2] * ang.cos()), -1).flatten(1)
        return rel_err(out, ref)

    return Proof(
        "view_as_real((x[2p] + i·x[2p+1])·(c_p + i·s_p)) = (x[2p]·c_p − x[2p+1]·s_p, "
        "x[2p]·s_p + x[2p+1]·c_p)",
        ("the table holds (c_p, s_p) = (real, imaginary) of each pair's factor",),
        ("(a + ib)(c + is) = (ac − bs) + i(as + bc)",),
        _witness("complex rotation", num))


def _pairwise_rotation(x: torch.Tensor, angle: torch.Tensor) -> torch.Tensor:
    """What the epilogue computes for adjacent pairs: (x[2p]·c_p − x[2p+1]·s_p,
    x[2p]·s_p + x[2p+1]·c_p), c_p, s_p the cos and sin of angle[p] (the pair witnesses'
    common reference)."""
    c, s = angle.cos(), angle.sin()
    return torch.stack((x[:, 0::2] * c - x[:, 1::2] * s, x[:, 0::2] * s + x[:, 1::2] * c),
                       -1).flatten(1)


@functools.cache
def prove_pair_rotation() -> Proof:
    """The interleaved spelling (GLM, Cohere, GPT-J: x·C + rotate_pairs(x)·S with the
    tables' features repeated per pair) is the pairwise rotation the epilogue computes."""
    x, c, s = sp.IndexedBase("x"), sp.IndexedBase("c"), sp.IndexedBase("s")
    p = sp.Symbol("p", integer=True, nonnegative=True)
    rotate_pairs = {2 * p: -x[2 * p + 1], 2 * p + 1: x[2 * p]}
    table = {2 * p: p, 2 * p + 1: p}  # C[2p] = C[2p+1] = c_p (repeat_interleave)
    want = {2 * p: x[2 * p] * c[p] - x[2 * p + 1] * s[p],
            2 * p + 1: x[2 * p] * s[p] + x[2 * p + 1] * c[p]}
    for lane in (2 * p, 2 * p + 1):
        got = x[lane] * c[table[lane]] + rotate_pairs[lane] * s[table[lane]]
        _require(got - want[lane], f"interleaved rotation (lane {lane})")

    def num(seed):
        g = _gen(seed)
        xx = torch.randn(5, 8, generator=g, dtype=torch.float64)
        ang = torch.randn(5, 4, generator=g, dtype=torch.float64)
        cos, sin = ang.cos().repeat_interleave(2, -1), ang.sin().repeat_interleave(2, -1)
        ref = xx * cos + torch.stack((-xx[:, 1::2], xx[:, 0::2]), -1).flatten(1) * sin
        return rel_err(_pairwise_rotation(xx, ang), ref)

    return Proof(
        "x·C + rotate_pairs(x)·S = (x[2p]·c_p − x[2p+1]·s_p, x[2p]·s_p + x[2p+1]·c_p),  "
        "rotate_pairs(x)[2p, 2p+1] = (−x[2p+1], x[2p])",
        ("C[2p] = C[2p+1] = c_p and S[2p] = S[2p+1] = s_p (each pair's angle repeated)",),
        ("lane 2p: x[2p]·c_p − x[2p+1]·s_p", "lane 2p+1: x[2p+1]·c_p + x[2p]·s_p"),
        _witness("interleaved rotation", num))


@functools.cache
def prove_written_pair_rotation() -> Proof:
    """torchtune's spelling (each adjacent pair's elements split out, x0 = x[2p] and
    x1 = x[2p+1], rotated by tables of one entry per pair and stacked back in place) is the
    pairwise rotation the epilogue computes."""
    x, c, s = sp.IndexedBase("x"), sp.IndexedBase("c"), sp.IndexedBase("s")
    p = sp.Symbol("p", integer=True, nonnegative=True)
    x0, x1 = x[2 * p], x[2 * p + 1]
    stacked = {2 * p: x0 * c[p] - x1 * s[p], 2 * p + 1: x1 * c[p] + x0 * s[p]}
    want = {2 * p: x[2 * p] * c[p] - x[2 * p + 1] * s[p],
            2 * p + 1: x[2 * p] * s[p] + x[2 * p + 1] * c[p]}
    for lane in (2 * p, 2 * p + 1):
        _require(stacked[lane] - want[lane], f"written-out pair rotation (lane {lane})")

    def num(seed):
        g = _gen(seed)
        xx = torch.randn(5, 8, generator=g, dtype=torch.float64)
        ang = torch.randn(5, 4, generator=g, dtype=torch.float64)
        pairs, cache = xx.reshape(5, 4, 2), torch.stack((ang.cos(), ang.sin()), -1)
        written = torch.stack((pairs[..., 0] * cache[..., 0] - pairs[..., 1] * cache[..., 1],
                               pairs[..., 1] * cache[..., 0] + pairs[..., 0] * cache[..., 1]),
                              -1).flatten(1)
        return rel_err(written, _pairwise_rotation(xx, ang))

    return Proof(
        "stack(x0·C − x1·S, x1·C + x0·S).flatten(-2) = (x[2p]·c_p − x[2p+1]·s_p, "
        "x[2p]·s_p + x[2p+1]·c_p),  x0, x1 = x[2p], x[2p+1]",
        ("C[p] = c_p and S[p] = s_p (one entry per pair: the table rows as they are)",),
        ("lane 2p: x[2p]·c_p − x[2p+1]·s_p", "lane 2p+1: x[2p+1]·c_p + x[2p]·s_p"),
        _witness("written-out pair rotation", num))


@functools.cache
def prove_logits_map_derivative() -> Proof:
    """A map before the loss, z = g(y) = c₂·tanh(y·a) (a: the product of the scalings
    before the tanh, c₂ after it; a map without tanh is the line z = c·y): its derivative
    is a function of z alone, so the backward reads the stored (or recomputed) z and
    never y."""
    y, a, c2 = sp.symbols("y a c2", real=True, nonzero=True)
    z = c2 * sp.tanh(a * y)
    _require(sp.simplify(sp.diff(z, y) - a * c2 * (1 - (z / c2) ** 2)), "softcap derivative")
    _require(sp.diff(c2 * a * y, y) - c2 * a, "scaled logits derivative")

    def num(seed):
        g = _gen(seed)
        yy = (torch.randn(64, generator=g, dtype=torch.float64) * 40).requires_grad_()
        aa, cc = 1 / 30.0, 30.0
        with torch.enable_grad():  # the first decision may run under the user's no_grad
            zz = cc * torch.tanh(yy * aa)
            (auto,) = torch.autograd.grad(zz.sum(), yy)
        return rel_err(aa * cc * (1 - (zz.detach() / cc) ** 2), auto)

    return Proof(
        "z = c₂·tanh(a·y)  ⇒  dz/dy = a·c₂·(1 − (z / c₂)²);  "
        "z = c·y  ⇒  dz/dy = c",
        ("at most one tanh in the map (the pattern refuses two)",),
        ("d tanh(u)/du = 1 − tanh²(u)", "tanh(a·y) = z / c₂"),
        _witness("logits map derivative", num))


@functools.cache
def prove_gated_interleave() -> Proof:
    X, Wg, Wu = sp.IndexedBase("X"), sp.IndexedBase("Wg"), sp.IndexedBase("Wu")
    act = sp.Function("act")
    w_int = {2 * j: Wg, 2 * j + 1: Wu}  # interleaved rows: [g0, u0, g1, u1, ...]
    acc = {c: _gemm(X[i, k] * w_int[c][j, k]) for c in w_int}
    lhs = act(r[i] * acc[2 * j]) * (r[i] * acc[2 * j + 1])
    rhs = act(r[i] * _gemm(X[i, k] * Wg[j, k])) * (r[i] * _gemm(X[i, k] * Wu[j, k]))
    _require(lhs - rhs, "gated activation under interleave")

    def num(seed):
        mm, kk, nn = _shape(seed, (1, 6), (1, 8), (1, 6))
        g = _gen(seed)
        xx = torch.randn(mm, kk, generator=g, dtype=torch.float64)
        wg, wu = (torch.randn(nn, kk, generator=g, dtype=torch.float64) for _ in range(2))
        rr = torch.rand(mm, generator=g, dtype=torch.float64) + 0.5
        wi = torch.stack([wg, wu], 1).reshape(2 * nn, kk)
        a = rr[:, None] * (xx @ wi.T)
        out = torch.nn.functional.silu(a[:, 0::2]) * a[:, 1::2]
        ref = torch.nn.functional.silu(rr[:, None] * (xx @ wg.T)) * (rr[:, None] * (xx @ wu.T))
        return rel_err(out, ref)

    return Proof(
        "act(r[i]·acc[i,2j])·(r[i]·acc[i,2j+1]) = act(r[i]·(X·W_gᵀ)[i,j])·(r[i]·(X·W_uᵀ)[i,j])",
        ("W_int interleaves the rows of W_g and W_u: W_int[2j] = W_g[j], W_int[2j+1] = W_u[j]",
         "the deferred row scale r is applied before the activation (it is not linear)"),
        ("acc[i,2j] is the gate GEMM's (i,j) entry and acc[i,2j+1] the up GEMM's",),
        _witness("gated interleave", num))


# the gate activations, and the derivative each backward epilogue computes (QuACK's
# closed forms in quack.activation: dswiglu, dgelu_tanh_approx, dgelu_erf)
_c1 = sp.sqrt(2 / sp.pi)
GATE_ACTIVATIONS = {
    "silu": (lambda x: x / (1 + sp.exp(-x)),
             lambda x: (1 / (1 + sp.exp(-x))) * (1 + x * (1 - 1 / (1 + sp.exp(-x))))),
    "gelu_tanh": (
        lambda x: x / 2 * (1 + sp.tanh(_c1 * (x + sp.Rational(44715, 10 ** 6) * x ** 3))),
        lambda x: (sp.Rational(1, 2) * (1 + sp.tanh(_c1 * (x + sp.Rational(44715, 10 ** 6)
                                                            * x ** 3)))
                   + x / 2 * (1 - sp.tanh(_c1 * (x + sp.Rational(44715, 10 ** 6) * x ** 3))
                              ** 2) * _c1 * (1 + 3 * sp.Rational(44715, 10 ** 6) * x ** 2))),
    "gelu_erf": (lambda x: x / 2 * (1 + sp.erf(x / sp.sqrt(2))),
                 lambda x: (1 + sp.erf(x / sp.sqrt(2))) / 2
                 + x * sp.exp(-x ** 2 / 2) / sp.sqrt(2 * sp.pi)),
}


@functools.cache
def prove_gated_backward() -> Proof:
    """The down projection's backward through a gated activation, as the dgrad GEMM's
    epilogue forms it (kernels/dgated.py): out = (act(g) ⊙ u)·W_dᵀ, so with
    dh = dout·W_d,  ∂L/∂g = dh ⊙ u ⊙ act'(g),  ∂L/∂u = dh ⊙ act(g),  ∂L/∂W_d = doutᵀ·h,
    h = act(g) ⊙ u recomputed from the stored pre-activation. The chain rule is checked
    on a symbolic 2-row × 3-feature × 2-output instance with act left undefined (no
    property of act is used), then each kernel's closed-form act' against sympy's
    derivative of the activation it differentiates."""
    rows, feats, outs = 2, 3, 2
    act = sp.Function("act")
    g = sp.Matrix(rows, feats, lambda a, b: sp.Symbol(f"g{a}{b}", real=True))
    u = sp.Matrix(rows, feats, lambda a, b: sp.Symbol(f"u{a}{b}", real=True))
    wd = sp.Matrix(outs, feats, lambda a, b: sp.Symbol(f"w{a}{b}", real=True))
    dout = sp.Matrix(rows, outs, lambda a, b: sp.Symbol(f"d{a}{b}", real=True))
    h = g.applyfunc(act).multiply_elementwise(u)
    loss = sum((dout.multiply_elementwise(h * wd.T))[:, :])
    dh = dout * wd
    for a in range(rows):
        for b in range(feats):
            _require(sp.diff(loss, g[a, b]) - dh[a, b] * u[a, b] * sp.diff(act(g[a, b]),
                                                                         g[a, b]),
                     "dL/dg = dh·u·act'(g)")
            _require(sp.diff(loss, u[a, b]) - dh[a, b] * act(g[a, b]), "dL/du = dh·act(g)")
    grad_w = dout.T * h
    for a in range(outs):
        for b in range(feats):
            _require(sp.diff(loss, wd[a, b]) - grad_w[a, b], "dL/dW_d = doutᵀ·h")
    x = sp.Symbol("x", real=True)
    for name, (f, closed) in GATE_ACTIVATIONS.items():
        _require(sp.simplify(sp.diff(f(x), x) - closed(x)), f"{name}: the kernel's act'")

    def num(seed):
        mm, nn, hh = _shape(seed, (1, 6), (1, 7), (1, 5))
        gen = _gen(seed)
        gg, uu = (torch.randn(mm, nn, generator=gen, dtype=torch.float64,
                              requires_grad=True) for _ in range(2))
        ww = torch.randn(hh, nn, generator=gen, dtype=torch.float64, requires_grad=True)
        dd = torch.randn(mm, hh, generator=gen, dtype=torch.float64)
        with torch.enable_grad():
            out = (torch.nn.functional.silu(gg) * uu) @ ww.T
            auto = torch.autograd.grad(out, (gg, uu, ww), dd)
        dh_ = dd @ ww.detach()
        sig = torch.sigmoid(gg.detach())
        closed = (dh_ * uu.detach() * sig * (1 + gg.detach() * (1 - sig)),
                  dh_ * torch.nn.functional.silu(gg.detach()),
                  dd.T @ (torch.nn.functional.silu(gg.detach()) * uu.detach()))
        return max(rel_err(c, a) for c, a in zip(closed, auto))

    return Proof(
        "out = (act(g)⊙u)·W_dᵀ, dh = dout·W_d  ⇒  ∂L/∂g = dh⊙u⊙act'(g), ∂L/∂u = dh⊙act(g), "
        "∂L/∂W_d = doutᵀ·(act(g)⊙u)",
        ("the down projection reads the gated product and nothing else reads it: its "
         "gradient is all of the product's",
         "p is the pre-activation the gated GEMM stored, h = act(p_g)⊙p_u its output"),
        ("the chain rule on a symbolic instance, act undefined",
         "act' of SiLU, tanh-GELU and exact GELU in the kernels' closed forms equal "
         "sympy's derivatives"),
        _witness("gated backward", num))


@functools.cache
def prove_sharded_gemm() -> Proof:
    """The layouts algebra/sharding.py runs a row-scaled GEMM in, and the producer it
    refuses (tensor parallelism)."""
    j0, i0 = sp.symbols("j0 i0", integer=True, nonnegative=True)
    y = lambda ii, jj: r[ii] * _gemm(H[ii, k] * W[jj, k])  # noqa: E731
    # columns: rank p holds W's rows J_p = j0 + [0, n_p) and computes those columns
    W_p = sp.Lambda((j, k), W[j0 + j, k])
    _require(r[i] * _gemm(H[i, k] * W_p(j, k)) - y(i, j0 + j), "column-split GEMM")
    # rows: rank p holds rows I_p = i0 + [0, m_p) of H and of r
    _require(r[i0 + i] * _gemm(H[i0 + i, k] * W[j, k]) - y(i0 + i, j), "row-split GEMM")
    # a partial-sum producer: the norm's statistic of z = z1 + z2 is not the sum of the
    # ranks' statistics (the cross term)
    z1, z2 = sp.IndexedBase("z1"), sp.IndexedBase("z2")
    cross = sp.expand((z1[j] + z2[j]) ** 2 - z1[j] ** 2 - z2[j] ** 2)
    _require(cross - 2 * z1[j] * z2[j], "the cross term of a partial sum's square")
    _refute(Sum(cross, (j, 0, K - 1)), "the norm statistic of a partial sum")

    def num(seed):
        mm, kk, nn = _shape(seed, (2, 9), (1, 9), (1, 5))
        g = _gen(seed)
        rr, hh, ww = (torch.randn(mm, generator=g, dtype=torch.float64),
                      torch.randn(mm, kk, generator=g, dtype=torch.float64),
                      torch.randn(2 * nn, kk, generator=g, dtype=torch.float64))
        full = rr[:, None] * (hh @ ww.T)
        cols = torch.cat([rr[:, None] * (hh @ w.T) for w in ww.chunk(2)], dim=1)
        rows = torch.cat([r_[:, None] * (h @ ww.T) for r_, h in zip(rr.chunk(2), hh.chunk(2))])
        return max(rel_err(cols, full), rel_err(rows, full))

    return Proof(
        "(r ⊙ H·Wᵀ)[:, J_p] = r ⊙ (H·W[J_p]ᵀ),  (r ⊙ H·Wᵀ)[I_p] = r[I_p] ⊙ (H[I_p]·Wᵀ)",
        ("(e) every value the row scale crosses is a complete sum on every rank "
         "(no Partial placement) and is not split along the contracted features",
         "columns: H and r replicated, W split by rows (ColwiseParallel); rows: H and r "
         "split by rows, W replicated",
         "a program with a per-row output needs whole rows: not run on column shards"),
        ("each rank's block is the full product restricted to its indices (a "
         "substitution j ↦ j0 + j, i ↦ i0 + i)",
         "a replicated operand's gradient is the sum of the ranks' partial gradients "
         "(the sum decomposition): reduced by DTensor where it is needed",
         "refuted for a partial-sum producer: Σ_j (z1+z2)² − Σ z1² − Σ z2² = 2·Σ_j z1·z2 "
         "≠ 0, so the norm is fused after the reduce"),
        _witness("sharded GEMM", num))


@functools.cache
def prove_routed_experts() -> Proof:
    """The routed experts' grouped GEMMs with their epilogues (patterns/routed_experts.py):
    a grouped GEMM is row-local (row s reads its own gathered row H[σ(s)] and its own
    expert's weight W[e(s)]), so the gather can be the GEMM's own row read, a per-row
    factor (the router's combine weight) moves into the epilogue, and a row fill before
    a row-local map is dead where the same rows are filled after it."""
    X, Wx = sp.IndexedBase("X"), sp.IndexedBase("W")
    sigma, e, act, f = (sp.Function(n) for n in ("sigma", "e", "act", "f"))
    s_ = sp.Symbol("s", integer=True, nonnegative=True)
    gathered = _gemm(H[sigma(s_), k] * Wx[e(s_), j, k])
    read = _gemm(X[s_, k] * Wx[e(s_), j, k]).replace(  # the GEMM reads row X[s] = H[σ(s)]
        lambda v: isinstance(v, sp.Indexed) and v.base == X,
        lambda v: H[sigma(v.indices[0]), v.indices[1]])
    _require(gathered - read, "the gather as the grouped GEMM's row read")
    _require(r[s_] * _gemm(H[s_, k] * Wx[e(s_), j, k])
             - _gemm((r[s_] * H[s_, k]) * Wx[e(s_), j, k]), "a per-row factor per expert")
    # an expert bias gathered by the row's expert id: with ids(s) = e(s) (the sorted ids
    # the offsets count; witnessed below) it is the epilogue's per-expert vector
    B, ids = sp.IndexedBase("B"), sp.Function("ids")
    gathered_bias = (_gemm(H[s_, k] * Wx[e(s_), j, k]) + B[ids(s_), j]).subs(ids(s_), e(s_))
    _require(gathered_bias - (_gemm(H[s_, k] * Wx[e(s_), j, k]) + B[e(s_), j]),
             "the gathered expert bias as a per-expert epilogue vector")
    # fills, by cases of the row's mask bit: fill(x, M, c) = c where M, x elsewhere
    x0, x1, c, c2, g0, u0 = sp.symbols("x0 x1 c c2 g0 u0")
    for masked in (True, False):
        def fill(v, cst):
            return cst if masked else v
        _require(fill(f(fill(x0, c)), c2) - fill(f(x0), c2),
                 "a fill before a row-local map, filled again after it")
        _require(act(fill(g0, c)) * fill(u0, c) - fill(act(g0) * u0, act(c) * c),
                 "a fill of (gate, up) moved past the gated product")
    # not for a map that mixes rows: row 0 of f = x0 + x1 reads the filled row 1
    _refute(sp.Symbol("c") + x0 - (x1 + x0), "a fill before a map that mixes rows is dead")

    def num(seed):
        n_exp, t, kk, ii, top = _shape(seed, (1, 4), (1, 6), (1, 6), (1, 4), (1, 2))
        g = _gen(seed)
        rows = t * top
        h = torch.randn(t, kk, generator=g, dtype=torch.float64)
        idx = torch.randint(0, t, (rows,), generator=g)
        ends = torch.sort(torch.randint(0, rows + 1, (n_exp,), generator=g)).values
        w_gu = torch.randn(n_exp, 2 * ii, kk, generator=g, dtype=torch.float64)
        w_d = torch.randn(n_exp, kk, ii, generator=g, dtype=torch.float64)
        cw = torch.rand(rows, generator=g, dtype=torch.float64)
        pre = reference.grouped_mm(h[idx], w_gu.transpose(-2, -1), ends)
        gate, up = pre.chunk(2, dim=-1)
        y = reference.grouped_mm(torch.nn.functional.silu(gate) * up,
                                 w_d.transpose(-2, -1), ends) * cw[:, None]
        pair = reference.expert_pairs_interleaved(w_gu)
        acc = reference.grouped_mm(h[idx], pair.transpose(-2, -1), ends)
        hh = torch.nn.functional.silu(acc[:, 0::2]) * acc[:, 1::2]
        fused = cw[:, None] * reference.grouped_mm(hh, w_d.transpose(-2, -1), ends)
        # the sorted expert ids (E: a sentinel) against the experts the offsets make of
        # the rows: cumsum(histc(ids, E bins over [0, E-1])), rows past the end excepted
        ids = torch.sort(torch.randint(0, n_exp + 1, (rows,), generator=g)).values
        offs = torch.cumsum(torch.histc(ids.double(), bins=n_exp, min=0, max=n_exp - 1), 0)
        offs = offs.to(torch.int64)
        live = int(offs[-1])
        grouped = reference.expert_of_rows(offs, rows)[:live]
        mismatch = float((grouped != ids[:live]).any()) + float(live != int((ids < n_exp).sum()))
        return max(rel_err(fused, y), mismatch)

    return Proof(
        "row s: (Σ_k H[σ(s),k]·W_gu[e(s),·,k] → act(gate)·up) · W_d[e(s)]ᵀ · w[s] = "
        "grouped GEMMs with σ as the row read, the pair activation and w[s] in the epilogues",
        ("a grouped GEMM is row-local: row s reads row s of its input and expert e(s)'s "
         "weight only",
         "W_gu's rows per expert are [gate; up] halves, read interleaved (gated interleave), "
         "or stored interleaved",
         "an expert bias is gathered by sorted expert ids whose per-expert counts are the "
         "offsets (ids(s) = e(s) for every row before the last offset)",
         "the combine weight w[s] is one scalar per routed row (constant in k)",
         "a fill of rows before a row-local map is dead where the same rows are filled "
         "after it; a fill of (gate, up) by c is a fill of act(gate)·up by act(c)·c"),
        ("the gather: substituting X[s,k] = H[σ(s),k] in the GEMM",
         "w[s] leaves the sum over k (row-scale deferral, per expert)",
         "fills by cases of the mask bit; for a map that mixes rows the fill is not dead "
         "(refused)"),
        _witness("routed experts", num))


@functools.cache
def prove_routed_backward() -> Proof:
    """The routed experts' down projection backward as its grouped dgrad epilogue forms
    it (kernels/grouped_dgated.py): o[s] = w[s]·(h[s]·W[e]ᵀ + b[e]) for routed row s of
    expert e, h = act(g) ⊙ u, so with acc = dout·W[e] (the dgrad GEMM, per expert)

        ∂L/∂g = (w·acc) ⊙ u ⊙ act'(g)     ∂L/∂u = (w·acc) ⊙ act(g)
        ∂L/∂w[s] = Σ_i h[s,i]·acc[s,i] + Σ_j dout[s,j]·b[e,j]
        ∂L/∂W[e] = doutᵀ·(w ⊙ h)          ∂L/∂b[e] = Σ_s w[s]·dout[s]

    (the router weight's gradient needs no stored output: the transposition
    Σ_j dout·(h·Wᵀ) = Σ_i h·(dout·W)). Checked by the chain rule on a symbolic
    2-row × 2-feature × 2-output instance of one expert (rows are independent and
    experts row-local: prove_routed_experts), act undefined; the numeric witness runs
    the op's reference against autograd on a float64 routing with an empty expert."""
    rows, feats, outs = 2, 2, 2
    act = sp.Function("act")

    def sym(name, n, c):
        return sp.Matrix(n, c, lambda a, b: sp.Symbol(f"{name}{a}{b}", real=True))
    g, u, wd, dout = sym("g", rows, feats), sym("u", rows, feats), sym("w", outs, feats), \
        sym("d", rows, outs)
    wr = sp.Matrix(rows, 1, lambda a, _: sp.Symbol(f"r{a}", real=True))
    bias = sp.Matrix(1, outs, lambda _, b: sp.Symbol(f"b{b}", real=True))
    h = g.applyfunc(act).multiply_elementwise(u)
    pre = h * wd.T + sp.ones(rows, 1) * bias
    o = sp.Matrix(rows, outs, lambda a, b: wr[a] * pre[a, b])
    loss = sum(dout.multiply_elementwise(o)[:, :])
    acc = dout * wd
    for a in range(rows):
        for c in range(feats):
            dh = wr[a] * acc[a, c]
            _require(sp.diff(loss, g[a, c]) - dh * u[a, c] * sp.diff(act(g[a, c]), g[a, c]),
                     "dL/dg = (w·acc)·u·act'(g)")
            _require(sp.diff(loss, u[a, c]) - dh * act(g[a, c]), "dL/du = (w·acc)·act(g)")
        _require(sp.diff(loss, wr[a]) - sum(h[a, c] * acc[a, c] for c in range(feats))
                 - sum(dout[a, c] * bias[c] for c in range(outs)),
                 "dL/dw = Σ h·acc + Σ dout·b")
    hw = sp.Matrix(rows, feats, lambda a, c: wr[a] * h[a, c])
    grad_w = dout.T * hw
    for a in range(outs):
        for c in range(feats):
            _require(sp.diff(loss, wd[a, c]) - grad_w[a, c], "dL/dW = doutᵀ·(w⊙h)")
        _require(sp.diff(loss, bias[a]) - sum(wr[q] * dout[q, a] for q in range(rows)),
                 "dL/db = Σ w·dout")

    def num(seed):
        from ..kernels.grouped_dgated import run_reference
        n_exp, hid, inter, rows_ = _shape(seed, (2, 4), (1, 5), (1, 5), (3, 9))
        gen = _gen(seed)
        f64 = torch.float64
        ends = torch.sort(torch.randint(0, rows_ + 1, (n_exp,), generator=gen)).values
        ends[0] = 0  # an expert with no row
        wd_ = torch.randn(n_exp, hid, inter, generator=gen, dtype=f64, requires_grad=True)
        p = torch.randn(rows_, 2 * inter, generator=gen, dtype=f64, requires_grad=True)
        wr_ = torch.rand(rows_, generator=gen, dtype=f64, requires_grad=True)
        dd = torch.randn(rows_, hid, generator=gen, dtype=f64)
        live = (torch.arange(rows_) < int(ends[-1]))[:, None]
        with torch.enable_grad():
            h_ = torch.nn.functional.silu(p[:, 0::2]) * p[:, 1::2]
            o_ = reference.grouped_mm(h_, wd_.transpose(-2, -1), ends) * wr_[:, None]
            auto = torch.autograd.grad((torch.where(live, o_, 0) * dd).sum(), (p, wr_, wd_))
        dp, hw_, dscore = run_reference("swiglu", (), dd, wd_.detach(), ends, p.detach(),
                                        wr_.detach())
        dw = torch.zeros_like(wd_)
        start = 0
        for e, end in enumerate(ends.tolist()):
            dw[e] = dd[start:end].T @ hw_[start:end]
            start = end
        lv = live[:, 0]
        return max(rel_err(dp[lv], auto[0][lv]), rel_err(dscore[lv], auto[1][lv]),
                   rel_err(dw, auto[2]))

    return Proof(
        "o[s] = w[s]·(h[s]·W[e]ᵀ + b[e]), acc = dout·W[e]  ⇒  ∂L/∂(g, u) = pair'(p)·(w·acc), "
        "∂L/∂w = Σ h·acc + Σ dout·b[e], ∂L/∂W[e] = doutᵀ·(w⊙h), ∂L/∂b[e] = Σ w·dout",
        ("the down GEMM reads the gated GEMM's output h = pair(p) itself: its whole "
         "gradient goes to the stored pre-activation p",
         "w[s] is one scalar per routed row"),
        ("the chain rule on a symbolic instance of one expert, act undefined",
         "the router weight's gradient by transposition: Σ_j dout·(h·Wᵀ) = Σ_i h·(dout·W)"),
        _witness("routed experts' backward", num))



@functools.cache
def prove_dense_experts() -> Proof:
    """A dense experts layer on its routed rows only (patterns/dense_experts.py): with
    F_e(x) = (act(x·G_e) ⊙ (x·U_e))·D_e (no bias) and scores s[t, e] zero off token t's
    top-k set S_t,

        Σ_e F_e(s[t, e]·x_t)  =  Σ_{e ∈ S_t} F_e(s[t, e]·x_t)

    because F_e(0) = act(0)·0·D_e = 0 for any finite act(0). Checked on a symbolic
    instance (3 experts, top-2 {0, 2}, 2 input features, 1 gated feature, act undefined)
    and refuted where an expert has a bias (F_e(0) ≠ 0) or the off-top-k score is not
    zero; the sigmoid of the −∞ fill is 0 (sympy's limit). The numeric witness compares
    the dense sum with coda_rewrite/routing.py's sort, gather, grouped GEMMs and per-token
    sum on random routings."""
    act = sp.Function("act")
    feats, experts, chosen = 2, 3, (0, 2)
    x = [sp.Symbol(f"x{a}", real=True) for a in range(feats)]
    s = [sp.Symbol(f"s{e}", positive=True) for e in range(experts)]

    def expert(e, scale, bias=0):
        gate = sum(scale * x[a] * sp.Symbol(f"G{e}{a}") for a in range(feats))
        up = sum(scale * x[a] * sp.Symbol(f"U{e}{a}") for a in range(feats))
        return (act(gate) * up + bias) * sp.Symbol(f"D{e}")

    def dense(bias=0, off=0):
        return sum(expert(e, s[e] if e in chosen else off, bias) for e in range(experts))
    routed = sum(expert(e, s[e]) for e in chosen)
    _require(dense() - routed, "the dense sum over experts equals the routed rows' sum")
    _refute(dense(bias=sp.Symbol("b")) - sum(expert(e, s[e], sp.Symbol("b"))
                                             for e in chosen),
            "an expert with a bias maps a zero row to zero")
    _refute(dense(off=sp.Symbol("c", positive=True)) - routed,
            "a score that is not zero off the top-k drops out")
    _require(sp.limit(1 / (1 + sp.exp(-sp.Symbol("z"))), sp.Symbol("z"), -sp.oo),
             "sigmoid(-oo) = 0")

    def num(seed):
        from .. import routing
        e, t, kk, ii, top = _shape(seed, (1, 5), (1, 6), (1, 5), (1, 3), (1, 3))
        top = min(top, e)
        g = _gen(seed)
        f64 = torch.float64
        x_, logits = torch.randn(t, kk, generator=g, dtype=f64), \
            torch.randn(t, e, generator=g, dtype=f64)
        w_gu = torch.randn(e, kk, 2 * ii, generator=g, dtype=f64)
        w_d = torch.randn(e, ii, kk, generator=g, dtype=f64)
        vals, idx = torch.topk(logits, top, dim=1)
        scores = torch.sigmoid(torch.full_like(logits, float("-inf")).scatter(1, idx, vals))
        rows = x_.repeat(e, 1) * scores.t().reshape(-1, 1)
        gate, up = torch.bmm(rows.view(e, t, kk), w_gu).chunk(2, dim=-1)
        want = torch.bmm(torch.nn.functional.silu(gate) * up, w_d).sum(0)
        perm, offsets, inverse = routing.sort_by_expert(idx, e)
        p = reference.grouped_mm(routing.gather_scaled(x_, scores, idx, perm, inverse), w_gu,
                                 offsets)
        gate, up = p.chunk(2, dim=-1)
        o = reference.grouped_mm(torch.nn.functional.silu(gate) * up, w_d, offsets)
        return rel_err(routing.back_to_tokens(o, inverse, top), want)

    return Proof(
        "Σ_e F_e(s[t,e]·x_t) = Σ_{e in top-k(t)} F_e(s[t,e]·x_t): a dense experts layer "
        "equals its routed rows (sorted by expert, grouped GEMMs, summed per token)",
        ("each expert's MLP maps a zero row to zero: no bias, act(0) finite",
         "scores are exactly zero off each token's top-k set (the fill's image is 0)",
         "the top-k indices are distinct per token: each chosen pair is one routed row"),
        ("F_e(0·x) = act(0)·0·D_e = 0 term by term (sympy, act undefined)",
         "refuted with an expert bias, and with a nonzero score off the top-k"),
        _witness("dense experts on their routed rows", num))


@functools.cache
def prove_batched_experts() -> Proof:
    """Per-pair expert GEMMs in the grouped spelling (patterns/batched_experts.py). With
    pairs s = t·k + j, ids[s] the expert of pair s and F(e, t) expert e's MLP on token t,
    the batched spelling computes

        out[t] = Σ_j w[t·k + j] · F(ids[t·k + j], t)

    and the grouped one sorts the pairs by id (perm; stable), counts each expert's rows
    (offsets = cumsum of a histogram over [0, E)), runs row r with the expert whose rows
    hold r (offsets[e − 1] ≤ r < offsets[e]) on token perm[r] // k, scales it by
    w[perm[r]] and sums each token's rows through perm's inverse. Checked by sympy, F
    undefined, for every assignment of ids in [0, E) at (T, k, E) = (2, 2, 3), (3, 1, 2)
    and (1, 3, 4); refuted with an id of E (eager's W[ids] raises there, the histogram
    drops it) and with an id of −1 (eager wraps it to E − 1)."""
    import itertools

    def batched(ids, t_count, k, e):
        f = sp.Function("F")
        return [sum(sp.Symbol(f"w{t * k + j}") * f(ids[t * k + j] % e, t) for j in range(k))
                for t in range(t_count)]

    def grouped(ids, t_count, k, e):
        f = sp.Function("F")
        n = t_count * k
        perm = sorted(range(n), key=lambda s: ids[s])
        counts = [sum(1 for i in ids if i == x) for x in range(e)]
        offsets = list(itertools.accumulate(counts))
        rows = [sp.Symbol(f"w{perm[r]}") * f(next(x for x in range(e) if r < offsets[x]),
                                              perm[r] // k) if r < offsets[-1] else 0
                for r in range(n)]
        inv = [0] * n
        for r, p in enumerate(perm):
            inv[p] = r
        return [sum(rows[inv[t * k + j]] for j in range(k)) for t in range(t_count)]

    for t_count, k, e in ((2, 2, 3), (3, 1, 2), (1, 3, 4)):
        for ids in itertools.product(range(e), repeat=t_count * k):
            for a, b in zip(batched(ids, t_count, k, e), grouped(ids, t_count, k, e)):
                _require(a - b, "the grouped rows compute every pair's expert")
    for bad in ((0, 3, 1, 2), (0, -1, 1, 2)):
        diff = [a - b for a, b in zip(batched(bad, 2, 2, 3), grouped(bad, 2, 2, 3))]
        _refute(sum(d ** 2 for d in diff), "ids outside [0, E) computed alike")

    def num(seed):
        from .. import routing
        e, t, kk, ii, top = _shape(seed, (1, 5), (1, 6), (1, 5), (1, 3), (1, 3))
        g = _gen(seed)
        f64 = torch.float64
        x_ = torch.randn(t, kk, generator=g, dtype=f64)
        ids = torch.randint(0, e, (t * top,), generator=g)
        w = torch.rand(t * top, generator=g, dtype=f64)
        w_gu = torch.randn(e, 2 * ii, kk, generator=g, dtype=f64)
        w_d = torch.randn(e, kk, ii, generator=g, dtype=f64)
        p = torch.bmm(w_gu[ids], x_.repeat_interleave(top, 0).unsqueeze(-1)).squeeze(-1)
        gate, up = p.chunk(2, dim=-1)
        o = torch.bmm(w_d[ids], (torch.nn.functional.silu(gate) * up).unsqueeze(-1))
        want = (o.squeeze(-1) * w[:, None]).view(t, top, kk).sum(1)
        ids_g, perm = torch.sort(ids, stable=True)
        offsets = torch.cumsum(torch.histc(ids_g.double(), e, 0, e - 1), 0).int()
        p = reference.grouped_mm(x_[perm // top], w_gu.mT, offsets)
        gate, up = p.chunk(2, dim=-1)
        o = reference.grouped_mm(torch.nn.functional.silu(gate) * up, w_d.mT, offsets)
        got = routing.back_to_tokens(o * w[perm][:, None], routing.inverse_permutation(perm),
                                     top)
        return rel_err(got, want)

    return Proof(
        "Σ_j w[t·k+j]·F(ids[t·k+j], t) = Σ over token t's rows of the pairs sorted by "
        "expert, each row's expert the one whose offsets hold it",
        ("every id lies in [0, E)",
         "pair s = t·k + j belongs to token t (k copies of each token in a row)"),
        ("sympy, F undefined: every assignment of ids at (T, k, E) = (2, 2, 3), (3, 1, 2), "
         "(1, 3, 4)", "refuted with an id of E and with an id of -1"),
        _witness("per-pair expert GEMMs in the grouped spelling", num))


@functools.cache
def prove_token_routing() -> Proof:
    """The routing's gather and its sum back are each other's gradient (coda_rewrite/
    routing.py: gather_tokens, sum_to_tokens). With perm a permutation of the N = T·k
    (token, slot) pairs p = t·k + j, row s of the routed problem pair perm[s], and
    inv its inverse,

        gather   X[s] = H[perm[s] // k]             ∂L/∂H[t] = Σ_j G[inv[t·k + j]]
        sum back O[t] = Σ_j R[inv[t·k + j]]         ∂L/∂R[s] = G'[perm[s] // k]

    since inv[p] = s exactly where p = perm[s]: autograd's index_put scatters are sums
    with one term each (the sum back) or a token's k terms (the gather). Checked by
    sympy's derivatives for every permutation of 4 pairs (k = 1, 2, 4) and 6 pairs
    (k = 2, 3; every 31st permutation); the witness differentiates the indexing spelling
    with autograd on random permutations."""
    import itertools

    def check(n, k, perms):
        t_count = n // k
        h = [sp.Symbol(f"h{t}") for t in range(t_count)]
        r = [sp.Symbol(f"r{s}") for s in range(n)]
        g = [sp.Symbol(f"g{s}") for s in range(n)]
        gt = [sp.Symbol(f"G{t}") for t in range(t_count)]
        for perm in perms:
            inv = [0] * n
            for s, p in enumerate(perm):
                inv[p] = s
            gather_loss = sum(g[s] * h[perm[s] // k] for s in range(n))
            sum_loss = sum(gt[t] * sum(r[inv[t * k + j]] for j in range(k))
                           for t in range(t_count))
            for t in range(t_count):
                _require(sp.diff(gather_loss, h[t]) - sum(g[inv[t * k + j]] for j in range(k)),
                         "the gather's gradient: each token's rows summed through inv")
            for s in range(n):
                _require(sp.diff(sum_loss, r[s]) - gt[perm[s] // k],
                         "the sum back's gradient: a gather by perm // k")
    for k in (1, 2, 4):
        check(4, k, itertools.permutations(range(4)))
    for k in (2, 3):
        check(6, k, itertools.islice(itertools.permutations(range(6)), 0, None, 31))

    def num(seed):
        from .. import routing
        t, k, n = _shape(seed, (1, 9), (1, 4), (1, 5))
        g = _gen(seed)
        perm = torch.randperm(t * k, generator=g)
        inv = routing.inverse_permutation(perm)
        h = torch.randn(t, n, generator=g, dtype=torch.float64, requires_grad=True)
        r = torch.randn(t * k, n, generator=g, dtype=torch.float64, requires_grad=True)
        dx, dy = torch.randn(t * k, n, generator=g, dtype=torch.float64), \
            torch.randn(t, n, generator=g, dtype=torch.float64)
        want = torch.autograd.grad(((h[perm // k] * dx).sum() +
                                    (r[inv].view(t, k, n).sum(1) * dy).sum()), (h, r))
        got = torch.autograd.grad(((routing.gather_tokens(h, perm, inv, k) * dx).sum() +
                                   (routing.sum_to_tokens(r, perm, inv, k) * dy).sum()),
                                  (h, r))
        return max(rel_err(a, b) for a, b in zip(got, want))

    return Proof(
        "∂/∂H of H[perm // k] is Σ over each token's rows through inv; ∂/∂R of "
        "Σ_j R[inv[t·k + j]] is a gather by perm // k",
        ("perm is a permutation of the T·k (token, slot) pairs and inv its inverse",
         "pair p = t·k + j belongs to token t (the top-k ids flattened row by row)"),
        ("sympy's derivatives on every permutation of 4 pairs (k = 1, 2, 4) and every "
         "31st of 6 pairs (k = 2, 3)",),
        _witness("the routing's gather and sum back as each other's gradient", num))


@functools.cache
def prove_fp8_gated_mlp() -> Proof:
    """The FP8 gated MLP's scales (codegen/fp8.py): where they go is exact algebra; that
    no scaled value leaves e4m3's range is a bound, proved here from three facts."""
    Q, Wq, s, c = (sp.IndexedBase(n) for n in ("Q", "Wq", "s", "c"))
    S = sp.Symbol("S", positive=True)
    # dequantisation: x̂ = Q/S (one static S), ŵ_j = Wq_j·s_j  =>  the GEMM's epilogue
    # multiplies the accumulator of the e4m3 products by s_j/S
    _require(_gemm((Q[i, k] / S) * (Wq[j, k] * s[j])) - s[j] / S * _gemm(Q[i, k] * Wq[j, k]),
             "per-row weight and static input scales out of the GEMM")
    # the activation bound's factor: c on the up lane, 1/c on the down projection's column
    act, g, u = sp.Function("act"), sp.Symbol("g"), sp.Symbol("u")
    _require(act(g) * (c[j] * u) - c[j] * (act(g) * u), "c on the up lane scales act(g)·u")
    a_ = sp.IndexedBase("a")
    i_ = sp.Symbol("I", integer=True, positive=True)
    _require(Sum((c[j] * a_[i, j]) * (W[f, j] / c[j]), (j, 0, i_ - 1))
             - Sum(a_[i, j] * W[f, j], (j, 0, i_ - 1)),
             "1/c folded into the down projection's columns")
    # |n_k| ≤ √N for a normalised row: N − n_k² = N·(R + eps·N)/(z_k² + R + eps·N) ≥ 0,
    # R = Σ_{l≠k} z_l² ≥ 0
    zk, R = sp.symbols("z_k R", nonnegative=True)
    eps_, N = sp.symbols("epsilon N", positive=True)
    n2 = zk ** 2 / ((zk ** 2 + R) / N + eps_)
    slack = sp.factor(sp.simplify(N - n2))
    _require(slack - N * (R + eps_ * N) / (zk ** 2 + R + eps_ * N), "√N bound's slack")
    if not slack.is_nonnegative:
        raise Unproved(f"|n_k| ≤ √N: slack {slack} not shown nonnegative")
    # Cauchy–Schwarz: Lagrange's identity (term-wise in (k, l); checked at K = 4)
    xs, ws = sp.symbols("x0:4"), sp.symbols("w0:4")
    lagrange = (sum(x * x for x in xs) * sum(w * w for w in ws)
                - sum(x * w for x, w in zip(xs, ws)) ** 2
                - sum((xs[a] * ws[b] - xs[b] * ws[a]) ** 2
                      for a in range(4) for b in range(a + 1, 4)))
    _require(lagrange, "Lagrange's identity (Cauchy–Schwarz)")
    # |act(g)| ≤ |g|: act(g) = g·h(g) with 0 ≤ h ≤ 1 (sigmoid, Φ, (1 + tanh)/2)
    x = sp.Symbol("x", real=True)
    for name, h in (("silu", 1 / (1 + sp.exp(-x))), ("gelu_erf", (1 + sp.erf(x / sp.sqrt(2))) / 2),
                    ("gelu_tanh", (1 + sp.tanh(_c1 * (x + sp.Rational(44715, 10 ** 6) * x ** 3)))
                     / 2)):
        _require(GATE_ACTIVATIONS[name][0](x) - x * h, f"{name} = x·h(x)")

    def num(seed):
        from ..codegen import fp8
        mm, kk, nn = _shape(seed, (2, 9), (16, 64), (2, 9))
        g = _gen(seed)
        z = torch.randn(mm, kk, generator=g, dtype=torch.float64)
        z[0] = 0
        z[0, 0] = 1e3  # one feature carries the whole row: n_0 = √N (the bound is tight)
        wg, wu = (torch.randn(nn, kk, generator=g, dtype=torch.float64) for _ in range(2))
        wu[0] = wg[0] = 0
        wg[0, 0] = wu[0, 0] = 1.0  # aligned with that row: |act·u| near its bound
        wd = torch.randn(3, nn, generator=g, dtype=torch.float64)
        q = fp8.quantize_normalized(z, 1e-6, kk)
        w_int, ws_int, w_d, ws_d = fp8.mlp_weights(wg, wu, wd, None, 0.0, kk)
        y = (q.double() @ w_int.double().T) * ws_int.double()
        act = torch.nn.functional.silu(y[:, 0::2]) * y[:, 1::2]
        if act.abs().max() > fp8.E4M3_MAX:
            return float("inf")  # a scaled product outside e4m3's range
        out = (fp8.saturate(act).double() @ w_d.double().T) * ws_d.double()
        n = z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + 1e-6)
        ref = (torch.nn.functional.silu(n @ wg.T) * (n @ wu.T)) @ wd.T
        return rel_err(out, ref) / 0.25  # e4m3: ≤ 2⁻⁴ per value, three roundings

    return Proof(
        "act((x̂·Ŵ_gᵀ)[i,j])·(x̂·Ŵ_uᵀ)[i,j]·c_j ∈ [−448, 448] and Σ_j (c_j·a_ij)·(W_d[h,j]/c_j)"
        " = (a·W_dᵀ)[i,h], with x̂ = Q/S, Ŵ = Wq·diag(s), c_j = 448/B_j, "
        "B_j = N·(1 + 2⁻³)²·‖Ŵ_g[j]‖·‖Ŵ_u[j]‖",
        ("the GEMMs' input is a normalised row n = z·rsqrt(mean(z²) + eps), quantised as "
         "Q = e4m3(n·S), S = 448/√N",
         "the gate activation is SiLU or GELU (tanh or erf): act(g) = g·h(g), 0 ≤ h ≤ 1",
         "γ is folded into the gate/up weights before they are quantised (per-feature fold)"),
        ("Σ_k (Q/S)·(Wq·s_j) = (s_j/S)·Σ_k Q·Wq: the scales leave the sum (sympy)",
         "N − n_k² = N·(R + eps·N)/(z_k² + R + eps·N) ≥ 0 with R = Σ_{l≠k} z_l², so |n_k| ≤ √N "
         "and ‖n‖ ≤ √N; e4m3's rounding (2⁻⁴ relative, subnormal steps below) keeps ‖x̂‖ ≤ "
         "√N·(1 + 2⁻³)",
         "Cauchy–Schwarz (Lagrange's identity, sympy at K = 4): |g_ij| ≤ ‖x̂_i‖·‖Ŵ_g[j]‖, "
         "|u_ij| ≤ ‖x̂_i‖·‖Ŵ_u[j]‖; |act(g)| ≤ |g| (act = x·h(x), sympy)",
         "so |act(g)·u·c_j| ≤ 448; c_j and 1/c_j cancel through the down GEMM (sympy)"),
        _witness("FP8 gated MLP (a row and weights at the bound)", num, tol=1.0))


def prove_fp8_normalized_linears() -> Proof:
    """The linears of a normalised row as one e4m3 GEMM (codegen/fp8.linear_weights): the
    scales leave the sum, and the input's static scale keeps it inside e4m3's range."""
    Q, Wq, s, b = (sp.IndexedBase(n) for n in ("Q", "Wq", "s", "b"))
    S = sp.Symbol("S", positive=True)
    _require(_gemm((Q[i, k] / S) * (Wq[j, k] * s[j])) + b[j]
             - (s[j] / S * _gemm(Q[i, k] * Wq[j, k]) + b[j]),
             "per-row weight and static input scales out of the GEMM, the bias after")
    zk, R = sp.symbols("z_k R", nonnegative=True)
    eps_, N = sp.symbols("epsilon N", positive=True)
    slack = sp.factor(sp.simplify(N - zk ** 2 / ((zk ** 2 + R) / N + eps_)))
    _require(slack - N * (R + eps_ * N) / (zk ** 2 + R + eps_ * N), "√N bound's slack")
    if not slack.is_nonnegative:
        raise Unproved(f"|n_k| ≤ √N: slack {slack} not shown nonnegative")

    def num(seed):
        from ..codegen import fp8
        mm, kk, nn = _shape(seed, (2, 9), (16, 64), (2, 9))
        g = _gen(seed)
        z = torch.randn(mm, kk, generator=g, dtype=torch.float64)
        z[0] = 0
        z[0, 0] = 1e3  # one feature carries the whole row: n_0 = √N, scaled to 448
        w = [torch.randn(nn + i, kk, generator=g, dtype=torch.float64) for i in range(3)]
        bias = torch.randn(nn + 1, generator=g, dtype=torch.float64)
        q = fp8.quantize_normalized(z, 1e-6, kk)
        if q.float().abs().max() > fp8.E4M3_MAX:
            return float("inf")
        w8, ws, b = fp8.linear_weights(w, [None, bias, None], None, 0.0, kk)
        out = (q.double() @ w8.double().T) * ws.double() + b.double()
        n = z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + 1e-6)
        ref = torch.cat([n @ w[0].T, n @ w[1].T + bias, n @ w[2].T], dim=-1)
        return rel_err(out, ref) / 0.13  # e4m3: ≤ 2⁻⁴ per value, two roundings

    return Proof(
        "Σ_k x̂_ik·Ŵ[j,k] + b_j = (s_j/S)·Σ_k Q_ik·Wq_jk + b_j with x̂ = Q/S, Ŵ = Wq·diag(s), "
        "and |n_k·S| ≤ 448 for S = 448/√N",
        ("the linears' input is a normalised row n = z·rsqrt(mean(z²) + eps), quantised as "
         "Q = e4m3(n·S), S = 448/√N",
         "γ is folded into the weights before their rows are quantised (per-feature fold)",
         "the linears' weights are stacked along their outputs: one GEMM, each output a "
         "column range of it"),
        ("Σ_k (Q/S)·(Wq·s_j) = (s_j/S)·Σ_k Q·Wq: the scales leave the sum (sympy)",
         "N − n_k² = N·(R + eps·N)/(z_k² + R + eps·N) ≥ 0 with R = Σ_{l≠k} z_l², so "
         "|n_k·S| ≤ 448 (sympy)"),
        _witness("FP8 linears of a normalised row (a row at the bound)", num, tol=1.0))


def prove_fp8_rowwise_linear() -> Proof:
    """A linear of row-wise scaled e4m3 rows (codegen/fp8.rowwise_program): both scales
    leave the sum, and each scaled row is within e4m3's range by its scale's definition."""
    Q, Wq, r, s, b = (sp.IndexedBase(n) for n in ("Q", "Wq", "r", "s", "b"))
    _require(_gemm((Q[i, k] * r[i]) * (Wq[j, k] * s[j])) + b[j]
             - (r[i] * s[j] * _gemm(Q[i, k] * Wq[j, k]) + b[j]),
             "per-row activation and weight scales out of the GEMM, the bias after")
    x, amax = sp.Symbol("x", real=True), sp.Symbol("a", positive=True)
    # |x| ≤ amax  =>  |x / (amax/448)| = 448·|x|/amax ≤ 448
    _require(sp.simplify(448 - sp.Abs(x / (amax / 448))
                         - 448 * (amax - sp.Abs(x)) / amax), "the scaled row's slack")

    def num(seed):
        from ..codegen import fp8
        mm, kk, nn = _shape(seed, (2, 9), (16, 64), (2, 9))
        g = _gen(seed)
        x = torch.randn(mm, kk, generator=g, dtype=torch.float64)
        x[0, 0] = 1e4
        w = torch.randn(nn, kk, generator=g, dtype=torch.float64)
        r = fp8.row_scales(x)
        q = fp8.quantize_by(x, r)
        if q.float().abs().max() > fp8.E4M3_MAX:
            return float("inf")
        w8, ws, _ = fp8.rowwise_weights(w, None)
        out = (q.double() @ w8.double().T) * r.double() * ws.double()
        return rel_err(out, x @ w.T) / 0.13  # e4m3: ≤ 2⁻⁴ per value, two roundings

    return Proof(
        "Σ_k (Q_ik·r_i)·(Wq_jk·s_j) + b_j = r_i·s_j·Σ_k Q_ik·Wq_jk + b_j, and "
        "|x_ik/r_i| ≤ 448 for r_i = max_k |x_ik|/448",
        ("the activation's rows are scaled by their own amax (torchao's row-wise recipe); "
         "the weight's rows by theirs",
         "in training the backward's GEMMs are this product on other operands, each "
         "scaled along the dim its GEMM keeps: dx = dy·W on (dy's rows, W's columns), "
         "dW = dyᵀ·x on (dy's columns, x's columns)"),
        ("Σ_k (Q·r_i)·(Wq·s_j) = r_i·s_j·Σ_k Q·Wq: the scales leave the sum (sympy)",
         "448 − 448·|x|/amax = 448·(amax − |x|)/amax ≥ 0 (sympy)"),
        _witness("FP8 row-wise linear (an outlier row)", num, tol=1.0))


def all_statements() -> list[tuple[str, Proof]]:
    """Every identity the pass relies on, proved (and cached)."""
    out = [("row-scale deferral", prove_row_scale_deferral()),
           ("per-feature folding", prove_per_feature_fold()),
           ("bias distribution", prove_bias_distribution()),
           ("LayerNorm centring", prove_layernorm_centring())]
    out += [(f"{kind} decomposition", prove_reduction_decomposition(kind))
            for kind in REDUCTIONS]
    out += [("log-sum-exp merge", prove_lse_merge()),
            ("permutation invariance", prove_permutation_invariance()),
            ("RoPE interleave", prove_rope_interleave()),
            ("per-head norm under a permutation", prove_head_norm_permutation()),
            ("per-head norm through a rotation", prove_head_norm_through_rotation()),
            ("rotation facts", prove_rotation_facts()),
            ("complex rotation", prove_complex_rotation()),
            ("interleaved rotation", prove_pair_rotation()),
            ("written-out pair rotation", prove_written_pair_rotation()),
            ("logits map derivative", prove_logits_map_derivative()),
            ("gated activation interleave", prove_gated_interleave()),
            ("gated backward in the down projection's dgrad", prove_gated_backward()),
            ("sharded GEMM (tensor parallelism)", prove_sharded_gemm()),
            ("routed experts' grouped GEMMs", prove_routed_experts()),
            ("routed experts' backward in the down projection's dgrad",
             prove_routed_backward()),
            ("dense experts on their routed rows", prove_dense_experts()),
            ("per-pair expert GEMMs in the grouped spelling", prove_batched_experts()),
            ("the routing's gather and sum back as each other's gradient",
             prove_token_routing()),
            ("FP8 gated MLP: scales out of the GEMMs, values within e4m3's range",
             prove_fp8_gated_mlp()),
            ("FP8 linears of a normalised row: one e4m3 GEMM, its input within range",
             prove_fp8_normalized_linears()),
            ("FP8 row-wise linear: both scales out of the GEMM", prove_fp8_rowwise_linear())]
    return out

