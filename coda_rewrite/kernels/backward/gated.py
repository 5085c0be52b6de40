"""The gated family (p = r ⊙ acc + bias; y = act(p[:, 0::2]) ⊙ p[:, 1::2]): the forward
stores p (what eager keeps as the gate and up outputs); dp comes from the activation's
derivative on p, or arrives as p's own gradient where the down projection's dgrad GEMM
formed it in its epilogue (kernels/gated_down.py), then the rowscale rule with dy := dp."""

from __future__ import annotations

from ...codegen.program import EpilogueProgram, Kind, scaled_acc_prefix
from ...codegen import reference
from .common import Rule, expect, shaped, through_scaled_acc, up

def _gated_parts(prog: EpilogueProgram):
    """[y = acc * r] [y_b = y + bias] act = pairop(y) -> outputs act (pair), y (tile)."""
    from ...codegen.program import PAIRWISE
    v, i = scaled_acc_prefix(prog)
    body = prog.body
    expect(len(body) == i + 1 and body[i].op in PAIRWISE and body[i].args[0] == v)
    expect({o.name for o in prog.operands} <= {"r", "bias"} and prog.gemm)
    outs = [(o.value, o.kind) for o in prog.outputs]
    expect(outs == [(body[i].out, Kind.PAIR), (v, Kind.TILE)])
    return body[i]


def _gated_vjp(prog, a, b, operands, outputs, grads):
    """dp from y's gradient (the activation's derivative on the stored p) plus p's own
    gradient: the down projection's fused backward (kernels/gated_down.py) hands dp
    straight to p and nothing to y."""
    dy, dp_direct = grads
    dp = None
    if dy is not None:
        pair = _gated_parts(prog)
        dp, _ = reference.dgated(pair.op, up(dy), up(outputs[1]), *reference.pair_params(pair))
    if dp_direct is not None:
        dp = dp_direct if dp is None else dp + up(dp_direct)
    if dp is None:
        return None, None, [None] * len(operands)
    # dp_direct alone is coda::dgated's output (opaque to Inductor): r ⊙ dp would be a
    # pass of its own over [M, 2I], wider than a
    return through_scaled_acc(prog, a, b, operands, dp, dy_fusable=dy is not None)


RULE = Rule(shaped(_gated_parts), _gated_vjp, lambda prog: ([1], set()))
