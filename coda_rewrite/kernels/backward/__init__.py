"""Backward of ``coda::gemm_epilogue``: no GEMM is recomputed, and every GEMM runs on
the 16-bit operands (tensor cores, float32 accumulation), as eager's backward does.

For out = f(acc, θ) with acc = a·bᵀ, the backward is two GEMMs around the epilogue's
vector-Jacobian product:  d_acc = (∂f/∂acc)ᵀ·d_out,  grad_a = d_acc·b,
grad_b = d_accᵀ·a.  Where the VJP needs the accumulator itself it is read back from
what the forward kept, never recomputed:

* ``rowscale`` (y = r ⊙ acc + bias): d_acc = r ⊙ dy, and the one term that needs acc,
  dr[i] = Σ_j dy[i, j]·acc[i, j], equals Σ_k a[i, k]·(dy·b)[i, k]: a row dot with the
  GEMM the backward computes anyway (G = dy·b, grad_a = r ⊙ G). The backward keeps the
  GEMM + epilogue shape (the CODA paper's Theorem 1).
* ``residual_rmsnorm`` / ``rmsnorm_rowscale``: everything depends on z = acc + residual,
  which the forward stores (the residual stream); r is stored too.
  dz_total = dz + dh2 ⊙ γ' − dr ⊙ r³ ⊙ z / d.

* ``gated`` (p = r ⊙ acc + bias; y = act(p[:, 0::2]) ⊙ p[:, 1::2]): the forward
  stores p (what eager keeps as the gate and up outputs) next to y; dp comes from the
  activation's derivative on p, or, where the down projection took the fused backward
  (kernels/gated_down.py: dSwiGLU in its dgrad GEMM's epilogue), arrives as p's own
  gradient; the rest is the rowscale rule with dy := dp.

* ``rope`` (y = r ⊙ acc + bias; out = R(θ)·y per column pair): dy = R(−θ)·dout, an
  elementwise rotation back, then the rowscale rule.

* ``centred`` (a LayerNorm deferred: y = r ⊙ (acc − μ ⊙ s) + bias): the rowscale rule
  with the centred input c = z − μ in place of z, W'’s whole gradient as dyᵀ·(r·c)
  (centred.py says why s, the row sums of W', is detached in the graph).

* ``lse_target`` (y = r ⊙ acc + bias; z = g(y), a constant map before the loss if any;
  loss = lse(z) − z[t]; lse): dz = softmax(z)·(dloss + dlse) − onehot(t)·dloss
  (+ dlogits), dy = dz·g'(z). In training the forward writes z and the backward forms
  dy in one pass of QuACK's cross-entropy backward kernel ((softmax − onehot)·dloss per
  row, g' applied after it); without written logits one GEMM recomputes them and its
  epilogue forms softmax(z)·dsm·g' (softmax_grad_program: a generated kernel on
  Hopper). Either way it lands once, in the GEMM dtype, and no float32 [rows, vocab]
  tensor exists; then the two GEMMs, r on their narrow side: (dy·b)·r and dyᵀ·(r·a).

The gradient of an output nothing reads arrives as None (the op does not materialise a
zero tensor for it: the logits or the gated pre-activation kept for the backward).

Each family's rule is a module of this package, chosen by the program's family tag
(codegen/program.py: ``EpilogueProgram.family``), never by guessing from its shape; the
rule still checks the shape it was written for, and a tagged program of another shape
is an error, not a silent fall back. A program without a tag takes the general rule: the
accumulator recomputed as one 16-bit GEMM and the epilogue differentiated by autograd on
the reference.
"""

from __future__ import annotations

import functools

import torch

from ...codegen.program import EpilogueProgram, ProgramError
from ...codegen import reference
from . import centred, cross_entropy, gated, residual_rmsnorm, rope, rowscale
from .common import Rule, gemm_grads

# family tag -> its rule
RULES: dict[str, Rule] = {
    "rowscale": rowscale.RULE,
    "centred": centred.RULE,
    "residual_rmsnorm": residual_rmsnorm.RULE,
    "gated": gated.RULE,
    "rope": rope.RULE,
    "cross_entropy": cross_entropy.RULE,
}


@functools.lru_cache(maxsize=1024)
def _rule(prog: EpilogueProgram) -> Rule | None:
    """The family's rule for a tagged program, None for an untagged one (the general
    rule). Cached: the forward asks on every call."""
    if not prog.family:
        return None
    rule = RULES.get(prog.family)
    if rule is None:
        raise ProgramError(f"{prog.key}: no backward rule for the family {prog.family!r}")
    if not rule.fits(prog):
        raise ProgramError(f"{prog.key}: tagged {prog.family!r} but not of the shape that "
                           "family's backward rule is written for")
    return rule


def saves(prog: EpilogueProgram) -> tuple[list[int], set[str]]:
    """(outputs the backward reads, operand names it needs only the dtype of)."""
    rule = _rule(prog)
    return rule.saves(prog) if rule is not None else ([], set())


# ---- any other program ----------------------------------------------------------------

def _general_vjp(prog, a, b, operands, outputs, grads):
    """Recompute acc as one 16-bit GEMM; autograd through the reference epilogue."""
    acc = (a @ b.t()) if prog.gemm else None
    leaves = [t for t in (acc, *operands) if t is not None and t.is_floating_point()]
    with torch.enable_grad():
        detached = {id(t): t.detach().requires_grad_(True) for t in leaves}

        def d(t):
            return None if t is None else detached.get(id(t), t)

        outs = reference.run_program(prog, a, b, [d(t) for t in operands], acc=d(acc))
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        wrt = list(detached.values())
        got = torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs],
                                  allow_unused=True) if pairs else [None] * len(wrt)
    by_id = dict(zip(detached.keys(), got))
    grad_a = grad_b = None
    if prog.gemm and by_id.get(id(acc)) is not None:
        grad_a, grad_b = gemm_grads(by_id[id(acc)], a, b)
    return grad_a, grad_b, [by_id.get(id(t)) for t in operands]


def vjp(prog: EpilogueProgram, a, b, operands, outputs, grads):
    """(grad_a, grad_b, [grad per operand]) for ``prog``."""
    device = (a if a is not None else operands[0]).device
    with torch.autocast(device_type=device.type, enabled=False):
        rule = _rule(prog)
        if rule is not None:
            return rule.vjp(prog, a, b, operands, outputs, grads)
        return _general_vjp(prog, a, b, operands, outputs, grads)
