"""The residual + RMSNorm family (the producer's epilogue, or the row-wise program):
everything depends on z = c·(acc + bias) + residual (c: a scalar residual multiplier, 1
where there is none), which the forward stores; r is stored too.
dz_total = dz + dh2 ⊙ γ' − dr ⊙ r³ ⊙ z / d;  d(acc) = c·dz_total."""

from __future__ import annotations

import torch

from ...codegen.program import ACC, Kind
from .common import Rule, expect, gemm_grads, shaped, up

def _residual_rmsnorm_parts(prog):
    """z = [c ·] (acc (+ bias)) + residual  |  z = x;  [s = gamma + c];  h2 = z * s or h2 = z;
    ss = row_sum(square(z)); r = rsqrt(ss / d + eps) -> outputs (z,) h2, r."""
    body = list(prog.body)
    kinds = {o.name: o.kind for o in prog.operands}
    names = [o.name for o in prog.operands]
    i = 0
    acc_scale = 1.0
    if prog.gemm:
        v = ACC
        if body[i].args == (ACC, "bias"):
            expect(body[i].op == "add" and kinds["bias"] == Kind.PER_FEATURE)
            v = body[i].out
            i += 1
        if body[i].op == "mul" and body[i].args[0] == v and \
                not isinstance(body[i].args[1], str):   # a scalar residual multiplier
            acc_scale = float(body[i].args[1])
            i += 1
        expect(body[i].op == "add" and body[i].args[1] == "residual")
        z = body[i].out
        i += 1
    else:
        expect(names[0] == "x" and kinds["x"] == Kind.TILE)
        z = "x"
    offset = 0.0
    h2 = z
    if "gamma" in kinds:
        if body[i].op == "add" and body[i].args[0] == "gamma":
            offset = float(body[i].args[1])
            i += 1
        expect(body[i].op == "mul" and body[i].args[0] == z)
        h2 = body[i].out
        i += 1
    sq, ss, mean, den, r = body[i:i + 5]
    expect((sq.op, sq.args) == ("square", (z,)))
    expect((ss.op, ss.args) == ("row_sum", (sq.out,)))
    expect(mean.op == "div" and mean.args[0] == ss.out and not isinstance(mean.args[1], str))
    expect(den.op == "add" and den.args[0] == mean.out)
    expect((r.op, r.args) == ("rsqrt", (den.out,)))
    expect(len(body) == i + 5)
    outs = [o.value for o in prog.outputs]
    expect(outs == ([z] if prog.gemm else []) + [h2, r.out])
    return dict(z=z, offset=offset, d=float(mean.args[1]), has_gamma="gamma" in kinds,
                acc_scale=acc_scale)


def _residual_rmsnorm_vjp(prog, a, b, operands, outputs, grads):
    parts = _residual_rmsnorm_parts(prog)
    by_name = dict(zip((o.name for o in prog.operands), operands))
    if prog.gemm:
        dz, dh2, dr = grads
        z, _, r = outputs
    else:
        dh2, dr = grads
        dz = None
        z = by_name["x"]
        r = outputs[1]
    zf, rf = up(z), up(r)[:, None]
    total = torch.zeros_like(zf) if dz is None else up(dz).clone()
    grad_gamma = None
    if dh2 is not None:
        if parts["has_gamma"]:
            scale = up(by_name["gamma"]) + parts["offset"]
            total += up(dh2) * scale
            grad_gamma = (up(dh2) * zf).sum(0).to(by_name["gamma"].dtype)
        else:
            total += up(dh2)
    grad_eps = None
    if dr is not None:
        drf = up(dr)[:, None]
        total += drf * (-(rf ** 3) / parts["d"]) * zf
        grad_eps = (drf * (-0.5) * rf ** 3).sum()
    grads_by_name = {"gamma": grad_gamma}
    if prog.gemm:
        grads_by_name["residual"] = total.to(by_name["residual"].dtype)  # a dtype stand-in
        d_acc = total * parts["acc_scale"] if parts["acc_scale"] != 1.0 else total
        if "bias" in by_name:
            grads_by_name["bias"] = d_acc.sum(0).to(by_name["bias"].dtype)
        grad_a, grad_b = gemm_grads(d_acc, a, b)
    else:
        grads_by_name["x"] = total.to(z.dtype)
        grad_a = grad_b = None
    if "eps" in by_name and grad_eps is not None:
        grads_by_name["eps"] = grad_eps.to(by_name["eps"].dtype).reshape(by_name["eps"].shape)
    return grad_a, grad_b, [grads_by_name.get(o.name) for o in prog.operands]


def _residual_rmsnorm_saves(prog):
    """Outputs kept for the backward (z, r), and operands it only needs the dtype of."""
    return ([0, 2] if prog.gemm else [1]), {"residual"}


RULE = Rule(shaped(_residual_rmsnorm_parts), _residual_rmsnorm_vjp, _residual_rmsnorm_saves)
