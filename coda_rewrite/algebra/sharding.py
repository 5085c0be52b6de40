"""Tensor parallelism: where a deferred row scale may cross a DTensor boundary, and which
sharded GEMMs may carry a program.

Under DTensor (``parallelize_module``: ColwiseParallel / RowwiseParallel /
SequenceParallel) the graph dynamo captures holds the layout changes as ops:
``from_local`` (a local tensor declared a DTensor), ``redistribute`` (a collective:
all-gather, reduce-scatter, all-reduce) and ``to_local``. Each value is a *global*
tensor, split or replicated over the ranks as its placements say, or a *partial sum*
(Partial: each rank holds a summand) until a reduce.

Side condition (e) of the row-scale deferral (algebra/row_scale.py): every value the
rewrite moves a row scale through is a complete sum on every rank (no Partial placement)
and is not split along the normalised features. Then on each rank

    the norm's statistic     ss[i] = Σ_j z[i, j]²   is computed from whole rows, and
    each boundary op         is the identity on the global value (from_local of a
                             replicated tensor, an all-gather of row shards, to_local of a
                             replicated DTensor), so r follows rows through it as through
                             any row selection (σ(i)).

A producer GEMM whose output is a partial sum (RowwiseParallel's o_proj / down
projection before its all-reduce or reduce-scatter) cannot carry the norm:
ss(z₁ + z₂) ≠ ss(z₁) + ss(z₂) (``prove_sharded_gemm`` refutes it); the norm is fused
after the reduce instead, as a row-wise program whose row scale the consumers take.

The sharded consumer GEMM y = r ⊙ (H·Wᵀ) runs on local shards in one of three layouts
per mesh dim (codegen/placements.py: ``gemm_layout``), proved in
``statements.prove_sharded_gemm``:

    columns     W Shard(0) (ColwiseParallel), H replicated: rank p computes the columns
                J_p from W's rows J_p; r and per-row operands replicated, per-feature
                operands and tile operands split like the columns
    rows        H Shard(0) (sequence-split rows), W replicated: rank p computes rows I_p
    replicated  both replicated

A program with a per-row output (a reduction over the columns) does not run in the
columns layout: each rank would hold a partial row statistic.
"""

from __future__ import annotations

import torch.fx as fx

from ..canonical import meta, qualified_op_name
from ..capture import describe
from ..codegen.placements import dtensor_cls, gemm_layout
from .decision import Why

_BOUNDARY_METHODS = {"redistribute", "to_local"}


def placements(node) -> tuple | None:
    """The placements of a node's DTensor value, or None for a plain tensor."""
    cls = dtensor_cls()
    m = meta(node)
    if cls is None or not isinstance(m, cls):
        return None
    return tuple(m.placements)


def is_dtensor(node) -> bool:
    return placements(node) is not None


def boundary_op(node: fx.Node) -> str | None:
    """"from_local", "redistribute" or "to_local" for a DTensor layout op, else None."""
    if node.op == "call_method" and node.target in _BOUNDARY_METHODS:
        return node.target
    if node.op == "call_function" and getattr(node.target, "__name__", "") == "from_local" \
            and "distributed" in getattr(node.target, "__module__", ""):
        return "from_local"
    return None


def collective_op(node: fx.Node) -> str | None:
    """The name of a functional collective (``torch.ops._c10d_functional.all_reduce``,
    its ``wait_tensor``: what funcol calls and DTensor lowers to), else None."""
    if node.op != "call_function":
        return None
    ns, _, name = qualified_op_name(node.target).partition("::")
    if ns in ("_c10d_functional", "c10d_functional", "_c10d_functional_autograd"):
        return name
    return None


def _partial(pl) -> bool:
    return any(p.is_partial() for p in pl)


def _splits_dim(pl, dim: int, ndim: int) -> bool:
    return any(p.is_shard() and p.dim % ndim == dim % ndim for p in pl)


def boundary_keeps_rows(node: fx.Node, src: fx.Node) -> Why | None:
    """None when the layout op ``node`` (reading ``src``) is the identity on complete,
    feature-whole global values, so a row scale passes it as it passes a row selection;
    else why not (side condition (e))."""
    m = meta(node)
    ndim = m.dim() if m is not None else 0
    for pl in (placements(src) or (), placements(node) or ()):
        if _partial(pl):
            return Why(f"(e) {describe(node)} carries a partial sum (DTensor Partial "
                       "placement): the row statistic needs the complete sum on every rank",
                       "dtensor.partial_sum")
        if ndim and _splits_dim(pl, ndim - 1, ndim):
            return Why(f"(e) {describe(node)} splits the normalised features over the "
                       "ranks: each rank would see part of every row", "dtensor.feature_sharded")
    if boundary_op(node) == "to_local" and any(p.is_shard() for p in placements(src) or ()):
        return Why(f"(e) {describe(node)} takes the local shard of a row-split DTensor "
                   "(a graph of per-rank rows: not the global value)", "dtensor.local_shard")
    return None


def consumer_condition(consumer_linear: fx.Node, a: fx.Node, weight: fx.Node,
                       bias: fx.Node | None) -> Why | None:
    """Side condition (e) for a consumer GEMM that takes the row scale: a layout exists,
    and every operand is a DTensor where the GEMM's are (DTensor refuses to mix)."""
    a_pl, w_pl = placements(a), placements(weight)
    if a_pl is None and w_pl is None:
        return None
    if (a_pl is None) != (w_pl is None) or (bias is not None and not is_dtensor(bias)):
        return Why(f"(e) {describe(consumer_linear)} mixes DTensor and plain operands",
                   "dtensor.mixed")
    layout = gemm_layout(a_pl, w_pl, meta(a).dim())
    if layout is None:
        return Why(f"(e) {describe(consumer_linear)}: input placement {a_pl}, weight "
                   f"placement {w_pl}: a split contraction (its output is a partial sum) "
                   "has no local program", "dtensor.layout")
    w = meta(weight)
    mesh = w.device_mesh
    for d, kind in enumerate(layout):
        if kind == "columns" and w.shape[0] % mesh.size(d):
            return Why(f"(e) {describe(consumer_linear)}: {w.shape[0]} output features do "
                       f"not split evenly over {mesh.size(d)} ranks", "dtensor.uneven")
    return None
