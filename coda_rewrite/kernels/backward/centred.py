"""The centred family (a LayerNorm deferred into its GEMM, patterns/layernorm.py):

    y = r ⊙ (acc − μ ⊙ s) + bias,   acc = z·W'ᵀ,  s_j = Σ_k W'[j, k]  (s detached)

With G = dy·W' (the GEMM the backward computes anyway) and c = z − μ (a transient):

    grad_z  = r ⊙ G                       grad_W' = (r ⊙ dy)ᵀ·c
    dr[i]   = Σ_k c[i, k]·G[i, k]         dμ[i]   = −r[i]·(dy·s)[i]
    dbias   = Σ_i dy[i, :]

grad_W' is W'’s whole gradient, s's share included: (r·dy)ᵀ·z and s's −(r·μ·dy)ᵀ·1 are
both of the size of the mean and would cancel after a 16-bit rounding of the first;
centring first (statements.prove_layernorm_centring proves the two equal) keeps the
rounding at the spread's size, as eager's dyᵀ·LN(z) does. So the graph passes s
detached (codegen/layouts.layernorm_weights) and s gets no gradient here. No GEMM is
recomputed; what is saved is z (which eager's norm saves too) instead of LN(z)."""

from __future__ import annotations

from ...codegen.program import ACC, EpilogueProgram
from .common import Rule, expect, shaped, up, wgrad


def _parts(prog: EpilogueProgram) -> bool:
    """The program patterns/layernorm.centred_program builds, with or without a bias."""
    names = [o.name for o in prog.operands]
    expect(prog.gemm and names in (["r", "mu", "s"], ["r", "mu", "s", "bias"]))
    body = [(i.op, i.args) for i in prog.body]
    mu_s, t, y = (i.out for i in prog.body[:3])
    want = [("mul", ("mu", "s")), ("sub", (ACC, mu_s)), ("mul", (t, "r"))]
    if "bias" in names:
        want.append(("add", (y, "bias")))
    expect(body == want and [o.value for o in prog.outputs] == [prog.body[-1].out])
    return True


def _centred_vjp(prog, a, b, operands, outputs, grads):
    (dy,) = grads
    names = [o.name for o in prog.operands]
    if dy is None:
        return None, None, [None] * len(operands)
    by_name = dict(zip(names, operands))
    dy = up(dy)
    r, mu = up(by_name["r"])[:, None], up(by_name["mu"])[:, None]
    g = up(dy.to(b.dtype) @ b)                        # G = dy·W'
    centred = up(a) - mu                              # z − μ
    grad_a = (g * r).to(a.dtype)
    grad_b = wgrad(dy, centred, r)          # (z − μ)·r: eager's x̂
    grads_by_name = {
        "r": (g * centred).sum(-1).to(by_name["r"].dtype),
        "mu": (-r[:, 0] * (dy.to(by_name["s"].dtype) @ by_name["s"])).to(
            by_name["mu"].dtype),
    }
    if "bias" in by_name:
        grads_by_name["bias"] = dy.sum(0).to(by_name["bias"].dtype)
    return grad_a, grad_b, [grads_by_name.get(n) for n in names]


RULE = Rule(shaped(_parts), _centred_vjp)
