"""The rotation family (y = r ⊙ acc + bias; out = R(θ)·y per column pair): dy = R(−θ)·dout,
an elementwise rotation back, then the rowscale rule."""

from __future__ import annotations

from ...codegen.program import EpilogueProgram, Kind, scaled_acc_prefix
from ...codegen import op_table
from .common import Rule, expect, shaped, through_scaled_acc, up

def _rope_parts(prog: EpilogueProgram) -> tuple[str | None, tuple[str, ...]]:
    """[y = acc * r] [y_b = y + bias] [y_s = y_b * colscale] out = rope(y, pos, freq) or
    rope_table(y, cs [, on]) -> out: (the column scale's name, the angle's operands)."""
    v, i = scaled_acc_prefix(prog)
    body = prog.body
    expect(prog.gemm and body[-1].op in ("rope", "rope_table"))
    scale = None
    if len(body) == i + 2:  # the rope type's attention scaling per column
        expect(body[i].op == "mul" and body[i].args == (v, "colscale"))
        v, scale = body[i].out, "colscale"
    expect(len(body) in (i + 1, i + 2) and body[-1].args[0] == v)
    angle = body[-1].args[1:]
    expect({o.name for o in prog.operands} <= {"r", "bias", "colscale", *angle})
    expect([(o.value, o.kind) for o in prog.outputs] == [(body[-1].out, Kind.TILE)])
    return scale, angle


def _rope_vjp(prog, a, b, operands, outputs, grads):
    """A rotation is orthogonal: dy = R(θ)ᵀ·dout = R(−θ)·dout, one elementwise pass
    (−freq negates both float-float parts, so the angle exactly; a table's sin column
    negated). Positions, frequencies and tables get no gradient (the pattern only
    rewrites ones that need none)."""
    (dout,) = grads
    if dout is None:
        return None, None, [None] * len(operands)
    scale, angle = _rope_parts(prog)
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
    return through_scaled_acc(prog, a, b, operands, dy)


RULE = Rule(shaped(_rope_parts), _rope_vjp)
