"""The rotation family (y = r ⊙ acc + bias; out = R(θ)·y per column pair, a QK-norm
before or after the rotation): dy = R(−θ)·dout, an elementwise rotation back, the
QK-norm's backward where the program has one, then the rowscale rule."""

from __future__ import annotations

from ...codegen.program import EpilogueProgram, Kind, scaled_acc_prefix
from ...codegen import op_table
from .common import Rule, expect, shaped, through_scaled_acc, up


def _multiplier(prog: EpilogueProgram, v: str, i: int):
    """[n = head_rstd(v, d, eps); n_g = n * g; (s = n_g + keep)] at body[i]: (the
    multiplier's value, instructions used, (d, eps, keep operand or None))."""
    body = prog.body
    expect(body[i].op == "head_rstd" and body[i].args[0] == v)
    expect(body[i + 1].op == "mul" and body[i + 1].args == (body[i].out, "g"))
    d, eps = body[i].args[1:]
    s, used, keep = body[i + 1].out, 2, None
    if i + 2 < len(body) and body[i + 2].op == "add" and body[i + 2].args[0] == s:
        expect(body[i + 2].args == (s, "keep"))
        s, used, keep = body[i + 2].out, 3, "keep"
    return s, used, (int(d), float(eps), keep)


def _rope_parts(prog: EpilogueProgram):
    """[y = acc * r] [y_b = y + bias] [QK-norm: y_n = y · (n·g + keep)] [y_s = y ·
    colscale] [QK-norm's multiplier of y_s] rot = rope(y, pos, freq) or rope_table(y, cs
    [, on]) [rot_n = rot · (n·g + keep)] -> out: (the column scale's name, the angle's
    operands, the QK-norm's (d, eps, keep, after the rotation) or None)."""
    v, i = scaled_acc_prefix(prog)
    body = prog.body
    expect(prog.gemm)
    norm, after = None, None
    if body[i].op == "head_rstd":
        s, used, spec = _multiplier(prog, v, i)
        if body[i + used].op == "mul" and body[i + used].args == (v, s):  # before
            v, i, norm = body[i + used].out, i + used + 1, (*spec, False)
        else:
            after, i, norm = s, i + used, (*spec, True)
    scale = None
    if body[i].op == "mul" and body[i].args == (v, "colscale"):  # the attention scaling
        v, scale, i = body[i].out, "colscale", i + 1
    if norm is None and body[i].op == "head_rstd":  # after the rotation, of the scaled value
        after, used, spec = _multiplier(prog, v, i)
        i, norm = i + used, (*spec, True)
    rot = body[i]
    expect(rot.op in ("rope", "rope_table") and rot.args[0] == v)
    out = rot.out
    if after is not None:
        expect(len(body) == i + 2 and body[i + 1].op == "mul" and
               body[i + 1].args == (rot.out, after))
        out = body[i + 1].out
    expect(len(body) == i + (2 if after is not None else 1))
    angle = rot.args[1:]
    expect({o.name for o in prog.operands} <= {"r", "bias", "colscale", "g", "keep", *angle})
    expect([(o.value, o.kind) for o in prog.outputs] == [(out, Kind.TILE)])
    return scale, angle, norm


def _rotate(prog, by_name, angle, x, inverse: bool):
    """The program's rotation of x (float32/64), or its inverse R(−θ): −freq negates both
    float-float parts, so the angle exactly; a table's sin column negated."""
    if any(i.op == "rope_table" for i in prog.body):
        cs = up(by_name[angle[0]])
        if inverse:
            cs = cs.clone()
            cs[:, 1::2] = -cs[:, 1::2]
        flags = [by_name[name] for name in angle[1:]]  # rope_table's rotate-or-not flag
        return op_table.rotate_pairs_by_table(x, cs, *flags)
    pos, freq = angle
    f = by_name[freq].reshape(1, -1)
    return op_table.rotate_pairs(x, by_name[pos].reshape(-1, 1), -f if inverse else f)


def _normed_value(a, b, by_name, scale):
    """What the QK-norm reads, recomputed: r·acc (+ bias) (· colscale where the norm is
    after the rotation). The statistic needs it and the forward keeps only the rotated
    output: the one GEMM this backward recomputes (16-bit operands, float32
    accumulation, as the forward's)."""
    v = up(a @ b.t())
    if "r" in by_name:
        v = v * up(by_name["r"]).reshape(-1, 1)
    if "bias" in by_name:
        v = v + up(by_name["bias"]).reshape(1, -1)
    if scale is not None:
        v = v * up(by_name[scale]).reshape(1, -1)
    return v


def _norm_terms(v, by_name, norm):
    """(n, g, s = n·g + keep, d) of the QK-norm over v."""
    d, eps, keep = norm[:3]
    n = op_table.head_rstd(v, d, eps)
    g = up(by_name["g"]).reshape(1, -1)
    return n, g, n * g + (up(by_name[keep]).reshape(1, -1) if keep else 0), d


def _through_statistic(v, n, d, per_head):
    """−v·(n³/d)·Σ_head(…): the gradient through the per-head statistic n of v, given
    each head's Σ_j dy_j·(value scaled by n)_j·g_j / n."""
    m, cols = v.shape
    return -v * (n.reshape(m, cols // d, d) ** 3 * per_head / d).reshape(m, cols)


def _head_sum(t, d):
    m, cols = t.shape
    return t.reshape(m, cols // d, d).sum(-1, keepdim=True)


def _rope_vjp(prog, a, b, operands, outputs, grads):
    """A rotation is orthogonal: dy = R(θ)ᵀ·dout = R(−θ)·dout, one elementwise pass.
    A QK-norm y·(n·g + keep) before it: dv = dy·(n·g + keep) − v·(n³/d)·Σ_head(dy·v·g),
    dg = Σ_rows dy·v·n; after it, on rot = R(θ)·v: drot = dout·(n·g + keep), dv = R(−θ)·
    drot − v·(n³/d)·Σ_head(dout·rot·g), dg = Σ_rows dout·rot·n. Positions, frequencies
    and tables get no gradient (the pattern only rewrites ones that need none)."""
    (dout,) = grads
    if dout is None:
        return None, None, [None] * len(operands)
    scale, angle, norm = _rope_parts(prog)
    by_name = dict(zip((o.name for o in prog.operands), operands))
    dout = up(dout)
    dg = None
    if norm is not None and norm[3]:  # after the rotation, of the (scaled) value it reads
        v = _normed_value(a, b, by_name, scale)
        n, g, s, d = _norm_terms(v, by_name, norm)
        rot = _rotate(prog, by_name, angle, v, inverse=False)
        dy = _rotate(prog, by_name, angle, dout * s, inverse=True) + \
            _through_statistic(v, n, d, _head_sum(dout * rot * g, d))
        dg = (dout * rot * n).sum(0)
    else:
        dy = _rotate(prog, by_name, angle, dout, inverse=True)
    if scale is not None:
        dy = dy * up(by_name[scale]).reshape(1, -1)
    if norm is not None and not norm[3]:  # before the rotation, of y = r·acc (+ bias)
        v = _normed_value(a, b, by_name, None)
        n, g, s, d = _norm_terms(v, by_name, norm)
        dy, dg = dy * s + _through_statistic(v, n, d, _head_sum(dy * v * g, d)), \
            (dy * v * n).sum(0)
    grad_a, grad_b, grads = through_scaled_acc(prog, a, b, operands, dy)
    if dg is not None:
        grads[[o.name for o in prog.operands].index("g")] = dg.to(by_name["g"].dtype)
    return grad_a, grad_b, grads


RULE = Rule(shaped(_rope_parts), _rope_vjp)
