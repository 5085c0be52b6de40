"""The rotation family (y = r ⊙ acc + bias [QK-norm]; out = R(θ)·y per column pair):
dy = R(−θ)·dout, an elementwise rotation back, then the QK-norm's backward where the
program has one, then the rowscale rule."""

from __future__ import annotations

from ...codegen.program import EpilogueProgram, Kind, scaled_acc_prefix
from ...codegen import op_table
from .common import Rule, expect, shaped, through_scaled_acc, up


def _norm_part(prog: EpilogueProgram, v: str, i: int):
    """[n = head_rstd(v, d, eps); n_g = n * g; (s = n_g + keep;) y_n = v * s] at body[i]:
    (value after it, instructions used, (d, eps, keep operand or None)); (v, 0, None)
    without a QK-norm."""
    body = prog.body
    if i >= len(body) or body[i].op != "head_rstd":
        return v, 0, None
    n, d, eps = body[i].args[0], body[i].args[1], body[i].args[2]
    expect(n == v and body[i + 1].op == "mul" and body[i + 1].args == (body[i].out, "g"))
    s, used, keep = body[i + 1].out, 2, None
    if body[i + 2].op == "add":
        expect(body[i + 2].args == (s, "keep"))
        s, used, keep = body[i + 2].out, 3, "keep"
    expect(body[i + used].op == "mul" and body[i + used].args == (v, s))
    return body[i + used].out, used + 1, (int(d), float(eps), keep)


def _rope_parts(prog: EpilogueProgram) -> tuple[str | None, tuple[str, ...], tuple | None]:
    """[y = acc * r] [y_b = y + bias] [QK-norm] [y_s = y_b * colscale] out = rope(y, pos,
    freq) or rope_table(y, cs [, on]) -> out: (the column scale's name, the angle's
    operands, the QK-norm's (d, eps, keep) or None)."""
    v, i = scaled_acc_prefix(prog)
    body = prog.body
    expect(prog.gemm and body[-1].op in ("rope", "rope_table"))
    v, used, norm = _norm_part(prog, v, i)
    i += used
    scale = None
    if len(body) == i + 2:  # the rope type's attention scaling per column
        expect(body[i].op == "mul" and body[i].args == (v, "colscale"))
        v, scale = body[i].out, "colscale"
    expect(len(body) in (i + 1, i + 2) and body[-1].args[0] == v)
    angle = body[-1].args[1:]
    expect({o.name for o in prog.operands} <= {"r", "bias", "colscale", "g", "keep", *angle})
    expect([(o.value, o.kind) for o in prog.outputs] == [(body[-1].out, Kind.TILE)])
    return scale, angle, norm


def _norm_vjp(prog, a, b, by_name, norm, dy):
    """Through y = v·(n·g + keep), n = head_rstd(v, d, eps) per head of d columns:
    dv = dy·(n·g + keep) − v·(n³/d)·Σ_head(dy·v·g), dg = Σ_rows dy·v·n. The statistic
    needs v = r·acc (+ bias), which the forward does not keep: the one GEMM this backward
    recomputes (16-bit operands, float32 accumulation, as the forward's)."""
    d, eps, keep = norm
    v = up(a @ b.t())
    if "r" in by_name:
        v = v * up(by_name["r"]).reshape(-1, 1)
    if "bias" in by_name:
        v = v + up(by_name["bias"]).reshape(1, -1)
    n = op_table.head_rstd(v, d, eps)
    g = up(by_name["g"]).reshape(1, -1)
    s = n * g + (up(by_name[keep]).reshape(1, -1) if keep else 0)
    m, cols = v.shape
    per_head = (dy * v * g).reshape(m, cols // d, d).sum(-1, keepdim=True)
    dv = dy * s - v * (n.reshape(m, cols // d, d) ** 3 * per_head / d).reshape(m, cols)
    dg = (dy * v * n).sum(0)
    return dv, dg


def _rope_vjp(prog, a, b, operands, outputs, grads):
    """A rotation is orthogonal: dy = R(θ)ᵀ·dout = R(−θ)·dout, one elementwise pass
    (−freq negates both float-float parts, so the angle exactly; a table's sin column
    negated). Positions, frequencies and tables get no gradient (the pattern only
    rewrites ones that need none)."""
    (dout,) = grads
    if dout is None:
        return None, None, [None] * len(operands)
    scale, angle, norm = _rope_parts(prog)
    by_name = dict(zip((o.name for o in prog.operands), operands))
    if prog.body[-1].op == "rope_table":
        cs = up(by_name[angle[0]]).clone()
        cs[:, 1::2] = -cs[:, 1::2]
        flags = [by_name[name] for name in angle[1:]]  # rope_table's rotate-or-not column flag
        dy = op_table.rotate_pairs_by_table(up(dout), cs, *flags)
    else:
        pos, freq = angle
        dy = op_table.rotate_pairs(up(dout), by_name[pos].reshape(-1, 1),
                                    -by_name[freq].reshape(1, -1))
    if scale is not None:
        dy = dy * up(by_name[scale]).reshape(1, -1)
    if norm is None:
        return through_scaled_acc(prog, a, b, operands, dy)
    dy, dg = _norm_vjp(prog, a, b, by_name, norm, dy)
    grad_a, grad_b, grads = through_scaled_acc(prog, a, b, operands, dy)
    names = [o.name for o in prog.operands]
    grads[names.index("g")] = dg.to(by_name["g"].dtype)
    return grad_a, grad_b, grads


RULE = Rule(shaped(_rope_parts), _rope_vjp)
