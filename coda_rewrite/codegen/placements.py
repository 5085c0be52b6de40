"""Placements of a fused GEMM's operands under tensor parallelism: the sharding rule of
``coda::gemm_epilogue``, as pure data (algebra/sharding.py decides where it applies on a
graph; kernels/sharding.py runs the op on the local shards).

Per mesh dim, for y = program(a·Wᵀ, operands), operands flattened to [rows, features]:

    layout       a          W          per-row     per-feature   tile        outputs
    columns      Replicate  Shard(0)   Replicate   Shard(0)      Shard(1)    Shard(1)
    rows         Shard(0)   Replicate  Shard(0)    Replicate     Shard(0)    Shard(0)
    replicated   Replicate  Replicate  Replicate   Replicate     Replicate   Replicate

Each is exact (algebra/statements.py: prove_sharded_gemm): a rank's block of the output
is the full product restricted to its columns or rows. A K-split GEMM (W Shard(1),
RowwiseParallel) has no layout: its output is a partial sum. A program with a per-row
output (a reduction over the columns) has no columns layout.

Gradients. An operand replicated over a mesh dim whose layout splits what it is
broadcast against (a and r under columns: every rank's columns contribute to their
gradient; W and per-feature operands under rows) has a *partial* local gradient
(``grad_placement``): DTensor sums it over the ranks where its producer needs the
complete value, as its own matmul rule does for ColwiseParallel's input.
"""

from __future__ import annotations

import functools

from .program import Kind


@functools.cache  # asked on every fused call (kernels/ops.py): import once
def dtensor_cls():
    """torch.distributed.tensor.DTensor, or None in a torch built without distributed."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return None
    return DTensor


def gemm_layout(a_pl, w_pl, a_ndim: int) -> list[str] | None:
    """Per mesh dim, the layout a sharded GEMM y = a·Wᵀ runs in ("columns", "rows",
    "replicated"; see the module docstring), or None where it has none (a K-split GEMM's
    output is a partial sum). ``None`` placements: a plain tensor (replicated)."""
    n = len(a_pl or w_pl)
    a_pl = a_pl or (None,) * n
    w_pl = w_pl or (None,) * n
    out = []
    for pa, pw in zip(a_pl, w_pl):
        a_rep = pa is None or pa.is_replicate()
        w_rep = pw is None or pw.is_replicate()
        if a_rep and w_rep:
            out.append("replicated")
        elif a_rep and pw.is_shard() and pw.dim == 0:
            out.append("columns")
        elif w_rep and pa.is_shard() and pa.dim % a_ndim != a_ndim - 1:
            out.append("rows")
        else:
            return None
    return out


def a_target(layout: str):
    """a is a row-major tile contracted whole: split by rows or not at all."""
    return target(Kind.TILE if layout == "rows" else Kind.PER_ROW, layout)


def program_fits(program_outputs, layout: list[str]) -> bool:
    """A program with a per-row output (a reduction over columns) needs whole rows."""
    return "columns" not in layout or all(o.kind != Kind.PER_ROW for o in program_outputs)


def target(kind: Kind, layout: str):
    """The placement of an operand or output of ``kind`` in ``layout`` (the table)."""
    from torch.distributed.tensor import Replicate, Shard
    if layout == "replicated" or kind == Kind.SCALAR:
        return Replicate()
    if layout == "columns":
        return {Kind.PER_ROW: Replicate(), Kind.PER_FEATURE: Shard(0),
                Kind.TILE: Shard(1), Kind.PAIR: Shard(1)}[kind]
    return {Kind.PER_ROW: Shard(0), Kind.PER_FEATURE: Replicate(),
            Kind.TILE: Shard(0), Kind.PAIR: Shard(0)}[kind]


def grad_placement(kind: str, layout: str):
    """The placement of the local gradient of an operand of ``kind``: Partial where the
    layout splits the dimension it is broadcast against."""
    from torch.distributed.tensor import Partial
    partial = (layout == "columns" and kind in ("a", Kind.PER_ROW, Kind.SCALAR)) or \
        (layout == "rows" and kind in ("w", Kind.PER_FEATURE, Kind.SCALAR))
    return Partial() if partial else None
