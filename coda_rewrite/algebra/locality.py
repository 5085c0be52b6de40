"""Tile locality and the reduction side conditions of a program, as a Proof.

A program can only be built tile-local (codegen/program.py refuses anything else: an
expression at [i, j] may read the accumulator at [i, j], per-row values at i,
per-feature values at j, tiles at [i, j], and whole-row values only through a declared
reduction, after the merge). This module states what was checked for one program, so
the report shows it next to the rewrite it belongs to.
"""

from __future__ import annotations

from ..codegen.program import REDUCTIONS, EpilogueProgram, Kind
from ..codegen.quack_source import zero_on_padding
from . import statements
from .decision import Proof


def check(program: EpilogueProgram) -> Proof:
    kinds = program.value_kinds()  # raises ProgramError on a non-local program
    tile_values = [n for n, (k, final) in kinds.items() if k == Kind.TILE and not final]
    finals = [n for n, (_, final) in kinds.items() if final]
    steps = [f"tile-local values (read at [i, j] only): {', '.join(tile_values) or '—'}"]
    reductions = [i for i in program.body if i.op in REDUCTIONS]
    zero = zero_on_padding(program)
    for r in reductions:
        kind = REDUCTIONS[r.op]
        proof = statements.prove_reduction_decomposition(kind)
        steps.append(f"{r.out} = {r.op}({r.args[0]}): {proof.statement}")
        if kind == "sum" and program.gemm:
            if zero[r.args[0]]:
                steps.append(f"{r.args[0]} is 0 on a ragged tile's padding (acc and tiles "
                             "are 0 there): the kernel's sum of partials is exact")
            else:
                steps.append(f"{r.args[0]} is not 0 on a ragged tile's padding, which the "
                             "kernel's partial sums would fold in: this program runs on the "
                             "reference path, never as a kernel")
    if finals:
        steps.append(f"whole-row values, after the merge only: {', '.join(finals)}")
    return Proof(f"{program.key} is tile-local",
                 ("each value's kind is inferred from its operands (codegen/program.py)",),
                 tuple(steps))
