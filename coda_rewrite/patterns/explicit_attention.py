"""Explicit softmax attention → SDPA.

Models written by hand (the reference Llama's non-flash path, Hugging Face's "eager"
attention) compute attention as

    scores = (q @ kᵀ) · s  [+ mask]         one [b, h, s_q, s_k] tensor per call
    p = softmax(scores, dim=-1 [, dtype=float32]) [.type_as(q)]  [dropout, p = 0]
    out = p @ v

which writes and reads an s_q × s_k score tensor per head (in float32 when the softmax
upcasts). ``F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=s)`` is the
same function by definition, and runs as a fused kernel. The match becomes that call;
the attention-inputs family, which runs next, then turns a causal mask into
``is_causal=True`` and a repeated key/value into ``enable_gqa=True``.

Left as is, with the reason: the weights read elsewhere (returned as attentions), an
active dropout, a scale that is a tensor (SDPA takes a number), a softmax over another
dim, mixed dtypes, scores that are not (q·kᵀ)·s [+ mask] (a soft-cap, a masked_fill).
kᵀ may be spelled transpose / swapaxes / swapdims of the last two dims, ``mT`` or
``permute(0, 1, 3, 2)``. Legality and the float64 witness: algebra/explicit_attention.py.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx
import torch.nn.functional as F

from .. import patterns
from ..algebra import explicit_attention as algebra
from ..algebra.decision import Why
from ..canonical import canon, meta, transpose_property
from ..capture import describe, model_path
from ..graph_utils import MATMUL, arg, calls, copy_meta, erase_if_dead
from .family import Context, Decided

NAME = "explicit_attention"

_SOFTMAX = {F.softmax, torch.softmax, torch.Tensor.softmax, "softmax"}
_DROPOUT = {F.dropout, torch.dropout, "dropout"}
# the spellings of a two-dim transpose, with the names of their two dim arguments
_TRANSPOSE = {"transpose": ("dim0", "dim1"), torch.transpose: ("dim0", "dim1"),
              "swapdims": ("dim0", "dim1"), torch.swapdims: ("dim0", "dim1"),
              "swapaxes": ("axis0", "axis1"), torch.swapaxes: ("axis0", "axis1")}


@dataclasses.dataclass(frozen=True)
class Match:
    out: fx.Node                    # p @ v
    q: fx.Node
    k: fx.Node                      # [b, h, s_k, d]: the transpose's input
    v: fx.Node
    scale: float                    # scores = (q @ kᵀ) · scale
    mask: fx.Node | None            # added to the scores
    softmax: fx.Node
    nodes: tuple[fx.Node, ...]      # scores → out, in graph order (erased once dead)

    pattern = NAME

    @property
    def path(self) -> str:
        return model_path(self.out)


class NoMatch(patterns.NoMatch):
    pattern = NAME


def _kt(node) -> fx.Node | None:
    """k when ``node`` is kᵀ over the last two dims of a 4-d k: ``transpose`` /
    ``swapaxes`` / ``swapdims`` of dims 2 and 3, ``k.mT``, or ``permute(0, 1, 3, 2)`` (the
    last three found missing by tests/test_property_explicit_attention.py)."""
    if not isinstance(node, fx.Node) or meta(node) is None or meta(node).dim() != 4:
        return None
    prop = transpose_property(node)
    if prop is not None:
        return node.args[0] if prop[1] == "mT" else None
    if node.op == "call_method" and node.target == "permute":
        order = node.args[1] if len(node.args) == 2 else \
            node.args[1:] if len(node.args) > 2 else node.kwargs.get("dims", ())
        ok = isinstance(order, (list, tuple)) and len(order) == 4 and \
            all(isinstance(d, int) for d in order) and \
            [d % 4 for d in order] == [0, 1, 3, 2]
        return node.args[0] if ok else None
    if not calls(node, _TRANSPOSE):
        return None
    first, second = _TRANSPOSE[node.target]
    dims = [arg(node, 1, first), arg(node, 2, second)]
    if not all(isinstance(d, int) for d in dims):
        return None
    return node.args[0] if sorted(d % 4 for d in dims) == [2, 3] else None


def _number(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def find(graph: fx.Graph) -> list[Match | NoMatch]:
    out = []
    for node in graph.nodes:
        if calls(node, MATMUL) and len(node.args) == 2 and meta(node) is not None \
                and meta(node).dim() == 4:
            found = _match(node)
            if found is not None:
                out.append(found)
    return out


def _match(out: fx.Node) -> Match | NoMatch | None:
    p, v = out.args
    nodes = [out]
    # back from the weights: a cast back to q's dtype, an identity dropout
    while isinstance(p, fx.Node) and (calls(p, _DROPOUT) or (canon(p) is not None
                                                            and canon(p).name == "cast")):
        if calls(p, _DROPOUT):
            rate = arg(p, 1, "p", 0.5)
            active = arg(p, 2, "training", True)
            if rate != 0 and active is not False:
                return NoMatch(out, Why(f"{describe(p)} is an active dropout on the "
                                        "attention weights", "explicit_attention.dropout"))
        nodes.append(p)
        p = p.args[0]
    if not calls(p, _SOFTMAX):
        return None
    softmax = p
    nodes.append(softmax)
    dim = arg(softmax, 1, "dim")
    if not isinstance(dim, int) or dim % 4 != 3:
        return NoMatch(out, Why(f"{describe(softmax)} is not over the keys (the last dim)",
                                "explicit_attention.softmax_dim"))
    s = softmax.args[0]
    while isinstance(s, fx.Node) and canon(s) is not None and canon(s).name == "cast":
        nodes.append(s)  # an upcast for the softmax (the reference Llama's .float())
        s = s.args[0]
    mask = None
    c = canon(s) if isinstance(s, fx.Node) else None
    if c is not None and c.name == "add":
        a, b = c.args
        scores_side = [x for x in (a, b) if _scores(x) is not None]
        if len(scores_side) != 1:
            return _unrecognised(out, s)
        mask = b if scores_side[0] is a else a
        if not isinstance(mask, fx.Node) or meta(mask) is None:
            # a number added to the scores (the softmax's shift invariance would drop it,
            # up to rounding): not a mask SDPA takes (found by the explicit-attention
            # adversary: it reached the checker as a mask and raised there)
            return NoMatch(out, Why(f"{mask!r} is added to the scores, not a mask tensor",
                                    "explicit_attention.scores"))
        nodes.append(s)
        s = scores_side[0]
    found = _scores(s)
    if found is None:
        return _unrecognised(out, s)
    q, k, scale, score_nodes = found
    if isinstance(scale, str):
        return NoMatch(out, Why(scale, "explicit_attention.scale_tensor"))
    nodes += score_nodes
    order = {n: i for i, n in enumerate(out.graph.nodes)}
    return Match(out, q, k, v, scale, mask, softmax,
                 tuple(sorted(set(nodes), key=order.__getitem__)))


def _unrecognised(out: fx.Node, s) -> NoMatch:
    """softmax(·, keys) @ v whose scores are not (q·kᵀ)·s [+ mask]: said in the report
    (a soft-cap, a masked_fill, a bias applied otherwise), not passed over in silence."""
    what = describe(s) if isinstance(s, fx.Node) else repr(s)
    return NoMatch(out, Why(f"the softmax's input {what} is not (q·kᵀ)·s [+ mask] (a "
                            "soft-cap, a masked_fill or a bias applied otherwise)",
                            "explicit_attention.scores"))


def _scores(s):
    """(q, k, scale, nodes) for s = (q @ kᵀ) [· c | / c], None when s is not scores;
    where the factor is not a number, (None, None, why, None)."""
    scale, nodes = 1.0, []
    c = canon(s) if isinstance(s, fx.Node) else None
    if c is not None and c.name in ("mul", "div"):
        a, b = c.args
        mm = a if calls(a, MATMUL) else b if c.name == "mul" and calls(b, MATMUL) else None
        if mm is None:
            return None
        factor = b if mm is a else a
        f = _number(factor)
        if f is None:
            return None, None, (f"the scores' scale {describe(factor)} is a tensor (SDPA "
                                "takes a number)"), None
        scale = f if c.name == "mul" else 1.0 / f
        nodes.append(s)
        s = mm
    if not calls(s, MATMUL) or len(s.args) != 2:
        return None
    q, kt = s.args
    k = _kt(kt)
    if k is None or meta(q) is None or meta(q).dim() != 4:
        return None
    return q, k, scale, nodes + [s, kt]


def describe_match(m: Match) -> dict:
    return {"consumers": [describe(m.out)]}


def decide(m: Match, context: Context) -> Decided:
    return Decided.by(algebra.decide(m), m)


def apply(graph: fx.Graph, m: Match, context: Context) -> dict:
    """out = SDPA(q, k, v, attn_mask=mask, scale=s): the scores never exist."""
    with graph.inserting_before(m.out):
        sdpa = graph.call_function(F.scaled_dot_product_attention, (m.q, m.k, m.v), {
            "attn_mask": m.mask, "dropout_p": 0.0, "is_causal": False, "scale": m.scale})
    copy_meta(sdpa, m.out)
    sdpa.meta.update({k: v for k, v in m.out.meta.items() if k not in sdpa.meta})
    m.out.replace_all_uses_with(sdpa)
    erase_if_dead(graph, list(reversed(m.nodes)))
    return {}

