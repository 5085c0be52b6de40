"""``coda::gemm_epilogue`` on DTensor operands: each rank runs the op on its local shards,
with no collective and no gathered weight, in the placements codegen/placements.py's
table gives per layout (where a layout applies on a graph is algebra/sharding.py's
decision; it is checked again here, since a call trusts nothing it is handed). Local
gradients that are partial sums are declared so through ``to_local``'s grad_placements,
and DTensor reduces them where their producer needs the complete value.
"""

from __future__ import annotations

from ..codegen import placements as rules
from ..codegen.program import Kind


def is_dtensor(t) -> bool:
    cls = rules.dtensor_cls()
    return cls is not None and isinstance(t, cls)


def _local(t, want, grads):
    """``t``'s local shard in placements ``want`` (a plain tensor is the replicated
    value: its shard is a slice, no collective)."""
    from torch.distributed.tensor import DTensor
    if t is None:
        return None
    if not isinstance(t, DTensor):
        raise TypeError("a fused GEMM on DTensors was given a plain tensor operand")
    if tuple(t.placements) != tuple(want):
        raise ValueError(f"a sharded fused GEMM expected an operand in {want}, got "
                         f"{tuple(t.placements)} (the rewrite checks this: a pass bug)")
    grads = tuple(g if g is not None else p for g, p in zip(grads, want))
    return t.to_local(grad_placements=grads)


def run_sharded(run, program, prog, a, w, operands):
    """``run(program, a, w, operands)`` on local shards; outputs as DTensors."""
    from torch.distributed.tensor import DTensor
    layout = rules.gemm_layout(tuple(a.placements), tuple(w.placements), a.dim())
    if layout is None:
        raise ValueError(f"no local program for a GEMM with input placements {a.placements}"
                         f" and weight placements {w.placements} (a split contraction)")
    if not rules.program_fits(prog.outputs, layout):
        raise ValueError("a program with a per-row output cannot run on column shards")
    mesh = w.device_mesh
    a_l = _local(a, [rules.a_target(lay) for lay in layout],
                 [rules.grad_placement("a", lay) for lay in layout])
    w_l = _local(w, [rules.target(Kind.PER_FEATURE, lay) for lay in layout],
                 [rules.grad_placement("w", lay) for lay in layout])
    ops_l = [_local(t, [rules.target(spec.kind, lay) for lay in layout],
                    [rules.grad_placement(spec.kind, lay) for lay in layout])
             for spec, t in zip(prog.operands, operands)]
    outs = run(program, a_l, w_l, ops_l)
    return [DTensor.from_local(o, mesh, [rules.target(spec.kind, lay) for lay in layout],
                               run_check=False)
            for spec, o in zip(prog.outputs, outs)]
