"""The LayerNorm idiom, however it is spelled, recognised on the canonical view.

    y = (x − mean(x)) / sqrt(var(x) + eps) ⊙ γ + β      (over the last dim, biased var)

``nn.LayerNorm`` / ``F.layer_norm`` (one call), and the decomposed spellings: Cohere's
``(x − m)·rsqrt(mean((x − m)²) + eps)`` in float32 with the weight after it, and the
hand-written ``(x − x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, keepdim=True,
unbiased=False) + eps) * w + b``. A computation that looks like it but is not (the
statistic over another dim, an unbiased variance, a mean that is not x's) is a near miss
with the reason, for the report.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx
import torch.nn.functional as F

from .algebra.decision import Why
from .canonical import canon, canon_name, constant, meta
from .capture import describe
from .graph_utils import arg
from .rmsnorm_idiom import _is_last_dim, _strip_casts

_LAYER_NORMS = (F.layer_norm, torch.layer_norm)
_VARS = (torch.var, "var")


@dataclasses.dataclass(frozen=True)
class LayerNorm:
    """LN(input) over the last dim, ``output`` its last node."""
    output: fx.Node
    input: fx.Node            # z, before any upcast
    weight: fx.Node | None    # γ (a [dim] tensor: the parameter, or a cast of it)
    bias: fx.Node | None      # β
    eps: float
    dim: int
    nodes: tuple[fx.Node, ...]  # every node of the idiom, in graph order, input excluded
    spelling: str               # "layer_norm" | "decomposed"


@dataclasses.dataclass(frozen=True)
class NearMiss:
    node: fx.Node
    reason: Why


def _affine_param(t, d: int) -> bool:
    mt = meta(t)
    return t is None or (mt is not None and tuple(mt.shape) == (d,))


def _call(node: fx.Node) -> LayerNorm | NearMiss:
    z = arg(node, 0, "input")
    shape = arg(node, 1, "normalized_shape")
    weight, bias = arg(node, 2, "weight"), arg(node, 3, "bias")
    eps = constant(arg(node, 4, "eps", 1e-5))
    mz = meta(z)
    if mz is None or meta(node) is None:
        return NearMiss(node, Why(f"{describe(node)}: its input is not a tensor the graph "
                                  "traced", "layernorm.not_a_tensor"))
    shape = tuple(shape) if isinstance(shape, (list, tuple)) else (shape,)
    if len(shape) != 1 or shape[0] != mz.shape[-1]:
        return NearMiss(node, Why(f"{describe(node)} normalises over the last {len(shape)} "
                                  f"dims {shape}: its statistic is not one per row of a "
                                  "GEMM's input", "layernorm.not_last_dim"))
    if eps is None:
        return NearMiss(node, Why(f"{describe(node)} has an eps known only at run time",
                                  "layernorm.runtime_eps"))
    d = int(mz.shape[-1])
    if not (_affine_param(weight, d) and _affine_param(bias, d)):
        return NearMiss(node, Why(f"{describe(node)}'s affine parameters are not [{d}] "
                                  "tensors", "layernorm.affine_shape"))
    return LayerNorm(node, z, weight, bias, float(eps), d, (node,), "layer_norm")


# ---- the decomposed spelling ---------------------------------------------------------------

def _mean_of(node) -> tuple[fx.Node, bool] | None:
    """(x, over the last dim with keepdim) for mean(x, dims, keepdim); None otherwise."""
    c = canon(node) if isinstance(node, fx.Node) else None
    if c is None or c.name != "mean":
        return None
    x, dims, keepdim = c.args
    mx = meta(x)
    return (x, mx is not None and keepdim and _is_last_dim(dims, mx.dim()))


def _centred(node) -> tuple[fx.Node, fx.Node] | None:
    """(x, m) for x − m, m = mean(x) over the last dim with keepdim."""
    c = canon(node) if isinstance(node, fx.Node) else None
    if c is None or c.name != "sub" or not isinstance(c.args[1], fx.Node):
        return None
    x, m = c.args
    mean = _mean_of(m)
    return (x, m) if mean is not None and mean[0] is x and mean[1] else None


def _variance(node) -> tuple[fx.Node, list[fx.Node]] | Why | None:
    """(x, nodes) where ``node`` is the biased variance of x over the last dim:
    mean((x − mean(x))²) or x.var(-1, keepdim=True, unbiased=False / correction=0)."""
    if not isinstance(node, fx.Node):
        return None
    if node.op in ("call_function", "call_method") and node.target in _VARS:
        x = node.args[0]
        dims = arg(node, 1, "dim")
        mx = meta(x) if isinstance(x, fx.Node) else None
        dims = (dims,) if isinstance(dims, int) else tuple(dims or ())
        if mx is None or not node.kwargs.get("keepdim", False) or \
                not _is_last_dim(dims, mx.dim()):
            return Why(f"{describe(node)}: a variance not over the last dim with keepdim",
                       "layernorm.not_last_dim")
        correction = node.kwargs.get("correction", None)
        unbiased = node.kwargs.get("unbiased", None)
        if not (correction == 0 or unbiased is False):
            return Why(f"{describe(node)}: an unbiased variance (LayerNorm's is biased)",
                       "layernorm.unbiased_variance")
        return x, [node]
    mean = _mean_of(node)
    if mean is None:
        return None
    sq, last = mean
    csq = canon(sq) if isinstance(sq, fx.Node) else None
    if csq is None or csq.name != "square":
        return None
    centred = _centred(csq.args[0])
    if centred is None:
        return None
    if not last:
        return Why(f"{describe(node)}: a variance not over the last dim with keepdim",
                   "layernorm.not_last_dim")
    return centred[0], [centred[1], csq.args[0], sq, node]


def _decomposed(rs: fx.Node) -> LayerNorm | NearMiss | None:
    """Anchored at rsqrt(var + eps) (or a sqrt that divides)."""
    c = canon(rs)
    cd = canon(c.args[0]) if isinstance(c.args[0], fx.Node) else None
    if cd is None or cd.name != "add":
        return None
    var, eps = cd.args
    if constant(var) is not None:
        var, eps = eps, var
    found = _variance(var)
    if found is None:
        return None
    if isinstance(found, Why):
        return NearMiss(rs, found)
    xf, var_nodes = found
    if constant(eps) is None:
        return NearMiss(rs, Why("a LayerNorm whose eps is known only at run time",
                                "layernorm.runtime_eps"))
    # the normalised value: (x − m)·rsqrt(...) or (x − m) / sqrt(...), m = mean(x)
    y = centred = None
    for u in rs.users:
        cu = canon(u)
        if cu is None or cu.name not in ("mul", "div"):
            continue
        other = cu.args[1] if cu.args[0] is rs else cu.args[0]
        got = _centred(other)
        if got is None or got[0] is not xf:
            continue
        if (c.name == "rsqrt" and cu.name == "mul") or \
                (c.name == "sqrt" and cu.name == "div" and cu.args == (other, rs)):
            y, centred = u, other
    if y is None:
        return NearMiss(rs, Why("a variance's rsqrt that does not scale x − mean(x): not a "
                                "LayerNorm", "layernorm.not_centred"))
    x = _strip_casts(xf)
    mx = meta(x)
    dim = mx.shape[-1] if mx is not None else None
    if not isinstance(dim, int):
        return NearMiss(rs, Why("feature dim is symbolic", "layernorm.symbolic_dim"))
    casts = []
    n = xf
    while n is not x:
        casts.append(n)
        n = n.args[0]
    nodes = [*casts, *var_nodes, c.args[0], rs, _centred(centred)[1], centred, y]
    out, weight, bias = _affine_forward(y, dim, nodes)
    order = {n: i for i, n in enumerate(rs.graph.nodes)}
    nodes = sorted(set(nodes), key=order.__getitem__)
    return LayerNorm(out, x, weight, bias, float(constant(eps)), dim, tuple(nodes),
                     "decomposed")


def _vector(t, d: int) -> bool:
    """A tensor of one value per feature ([d], [1, .., 1, d])."""
    mt = meta(t)
    return mt is not None and mt.dim() >= 1 and mt.shape[-1] == d and \
        all(s == 1 for s in mt.shape[:-1]) and mt.is_floating_point()


def exact_upcast(node) -> bool:
    """A cast to a float type at least as wide of the same kind (bf16 → float32): the
    same values."""
    if canon_name(node) != "cast" or not isinstance(node.args[0], fx.Node):
        return False
    src, out = meta(node.args[0]), meta(node)
    if src is None or out is None or not src.is_floating_point() or \
            not out.is_floating_point():
        return False
    return out.dtype == src.dtype or (torch.finfo(out.dtype).bits > torch.finfo(src.dtype).bits
                                      and torch.finfo(out.dtype).eps <= torch.finfo(src.dtype).eps)


def _through_upcasts(node: fx.Node) -> fx.Node:
    """The parameter under exact upcasts (Cohere's ``self.weight.to(torch.float32)``):
    the same values, and a tensor that lives between calls, so a fold kept on it is
    found again (the upcast is a new tensor every call)."""
    while exact_upcast(node):
        node = node.args[0]
    return node


def _affine_forward(y: fx.Node, dim: int, nodes: list[fx.Node]):
    """Walk the casts, the per-feature scale and the per-feature shift after the
    normalised value (scale before shift: y·γ + β). γ and β are the values the model
    multiplies and adds (a cast of the parameter, 1 + w: graph values of their own)."""
    weight = bias = None
    while True:
        users = list(y.users)
        nxt = users[0] if len(users) == 1 else None
        c = canon(nxt) if nxt is not None else None
        if c is None:
            return y, weight, bias
        if c.name in ("mul", "add"):
            other = c.args[1] if c.args[0] is y else c.args[0]
            taken = weight if c.name == "mul" else bias
            if taken is not None or bias is not None or not isinstance(other, fx.Node) \
                    or not _vector(other, dim):
                return y, weight, bias
            other = _through_upcasts(other)
            if c.name == "mul":
                weight = other
            else:
                bias = other
        elif c.name != "cast":
            return y, weight, bias
        y = nxt
        nodes.append(y)


def find_layer_norms(graph: fx.Graph) -> list[LayerNorm | NearMiss]:
    """Every LayerNorm in the graph, in graph order, plus LayerNorm-like near misses."""
    found: list[LayerNorm | NearMiss] = []
    for node in graph.nodes:
        if node.op == "call_function" and node.target in _LAYER_NORMS:
            found.append(_call(node))
            continue
        name = canon_name(node)
        if name == "rsqrt" or (name == "sqrt" and any(canon_name(u) == "div"
                                                      for u in node.users)):
            got = _decomposed(node)
            if got is not None:
                found.append(got)
    return found
