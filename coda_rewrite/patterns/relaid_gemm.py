"""The fused GEMM over re-laid-out weights, shared by the families that re-lay out
(gated_mlp: gate/up interleaved; rope: q/k permuted per head, q/k/v concatenated).

A re-layout is a function of the live parameters: under dynamo the parameters are graph
inputs and an optimizer updates them in place, so it is recomputed on every call: in the
graph (inference), or inside the GEMM op and again in its backward (training: no copy of
the weights saved for the backward), or, with Options.cache_relayouts in an inference
graph, kept inside the GEMM op between calls keyed by the parameters' version counters
(kernels/relayout.py); a kept copy never leaves the op (handed to Inductor as a tensor,
its buffer planning could reuse the memory as scratch).
"""

from __future__ import annotations

import torch.fx as fx

from ..codegen import layouts
from ..graph_utils import cast_for_gemm
from ..kernels import ops, relayout


def relayout_node(graph: fx.Graph, kind: str, layout: tuple, *sources) -> fx.Node:
    """A re-layout (codegen/layouts.py: interleave_rows, interleave_halves, rope_segments)
    as a graph op, recomputed on every call."""
    fn = getattr(layouts, kind)
    return graph.call_function(fn, (layout, *sources) if kind == "rope_segments" else sources)


def relaid_gemm(graph: fx.Graph, cache: bool, text: str, linear: fx.Node, x: fx.Node,
                kind: str, layout: tuple, weights: tuple, r: list, biases: list,
                rest: list, trains: bool = False) -> fx.Node:
    """The fused GEMM over a re-layout of ``weights``, its operands the row scale ``r``,
    the (re-laid) ``biases`` and the ``rest`` (a rotation's float32 angles: not cast to
    the GEMM's dtype). ``cache``: keep the re-layout inside the op between calls;
    ``trains``: make it again in the backward instead of saving a copy of the weights
    (kernels/relayout.py); biases are re-laid in the graph either way (small)."""
    if cache or trains:
        x, *biases = cast_for_gemm(graph, linear, x, *biases)
        fn = relayout.fused_linear_relaid if cache else relayout.fused_linear_recomputed
        return graph.call_function(fn, (
            text, x, kind, relayout.spec_of(layout), list(weights), *r, *biases, *rest))
    w = relayout_node(graph, kind, layout, *weights)
    x, w, *biases = cast_for_gemm(graph, linear, x, w, *biases)
    return graph.call_function(ops.fused_linear, (text, x, w, *r, *biases, *rest))


def weights_line(cached: bool, options) -> str:
    """What the report says about a fused GEMM's re-laid-out weights."""
    if cached:
        return ("re-laid out once, kept inside the GEMM op until a weight changes "
                "(cache_relayouts; version-keyed; weights made under inference_mode have no "
                "version counter and are re-laid out on every call)")
    if options.cache_relayouts:
        return ("re-laid out on every call: this graph computes gradients (cache_relayouts "
                "applies to inference graphs; here the weights change every step)")
    return "re-laid out on every call, from the live parameters"
