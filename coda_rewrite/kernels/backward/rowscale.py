"""The rowscale family (y = r ⊙ acc + bias): d_acc = r ⊙ dy, and dr[i] = Σ_j dy·acc
equals Σ_k a·(dy·b): a row dot with the GEMM the backward computes anyway."""

from __future__ import annotations

from ...codegen.program import EpilogueProgram, scaled_acc_prefix
from .common import Rule, through_scaled_acc, up

def _is_rowscale(prog: EpilogueProgram) -> bool:
    v, i = scaled_acc_prefix(prog)
    names = [o.name for o in prog.operands]
    return prog.gemm and names[:1] == ["r"] and set(names) <= {"r", "bias"} and \
        i == len(prog.body) == len(names) and [o.value for o in prog.outputs] == [v]


def _rowscale_vjp(prog, a, b, operands, outputs, grads):
    (dy,) = grads
    if dy is None:
        return None, None, [None] * len(operands)
    return through_scaled_acc(prog, a, b, operands, up(dy))


RULE = Rule(_is_rowscale, _rowscale_vjp)
