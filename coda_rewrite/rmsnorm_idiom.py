"""The RMSNorm idiom, however it is spelled, recognised on the canonical view.

    y = (x / sqrt(mean(x², last dim) + eps)) ⊙ scale(w)

Hugging Face's decomposed ``LlamaRMSNorm`` (and Qwen2, Mistral), Gemma's ``(1 + w)``,
``x / sqrt(...)``, ``torch.nn.RMSNorm`` and ``F.rms_norm``; T5's, which squares
``x.to(float32)`` and multiplies the uncast x back (_same_value); a run-time eps
(dynamo's ``dynamic=True``). A computation that looks like it but is not (no keepdim, another dim)
is a NearMiss with the reason, for the report.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx as fx

from .algebra.decision import Why
from .canonical import canon, canon_name, constant, default_rms_eps, meta, runtime_scalar


@dataclasses.dataclass(frozen=True)
class RmsNorm:
    """y = (x / sqrt(mean(x², last dim) + eps)) ⊙ scale(w), however it was spelled."""
    input: fx.Node            # x, before any upcast
    output: fx.Node           # y, the last node of the idiom
    weight: fx.Node | None    # the 1-D tensor the scale is computed from
    weight_offset: float      # scale = weight + offset (Gemma: 1.0; Llama: 0.0)
    eps: float | fx.Node      # a constant, or a 0-d tensor read at run time
    dim: int                  # the normalised (last) dim's size
    nodes: tuple[fx.Node, ...]  # every node of the idiom, input excluded
    spelling: str             # "decomposed" | "rms_norm"


@dataclasses.dataclass(frozen=True)
class NearMiss:
    """An RMS-like computation that is not the idiom, and why (for the report)."""
    node: fx.Node
    reason: str


def _eps(eps: Any) -> float | fx.Node | None:
    c = constant(eps)
    return c if c is not None else runtime_scalar(eps)


def _strip_casts(node: Any) -> Any:
    while isinstance(node, fx.Node) and canon_name(node) == "cast":
        node = node.args[0]
    return node


# Casts that keep every value: a float widened to a type that holds all of its values
_EXACT_WIDENING = {
    (torch.float16, torch.float32), (torch.bfloat16, torch.float32),
    (torch.float16, torch.float64), (torch.bfloat16, torch.float64),
    (torch.float32, torch.float64)}


def _exact_casts(node: Any, x: fx.Node) -> bool:
    """Every cast from x to ``node`` keeps every value (the same dtype, or a widening)."""
    while node is not x:
        if not isinstance(node, fx.Node) or canon_name(node) != "cast":
            return False
        src, dst = meta(node.args[0]), meta(node)
        if src is None or dst is None or (
                src.dtype != dst.dtype and (src.dtype, dst.dtype) not in _EXACT_WIDENING):
            return False
        node = node.args[0]
    return True


def _same_value(xm: Any, xf: fx.Node, x: fx.Node, rs: fx.Node, y: fx.Node) -> bool:
    """Whether ``y = xm · rs`` (or xm / rs) is the value xf · rs would be: xm is xf, or
    both reach x through casts that keep every value, and y comes out in the dtype xf ·
    rs would. T5's RMSNorm (and CPM-Ant's, IDEFICS', Kosmos-2.5's) squares
    ``x.to(float32)`` but multiplies the uncast x back: a bf16 x times a float32 rsqrt
    is promoted to float32, exactly the float32 x the mean squared."""
    if xm is xf:
        return True
    mx, mf, mr, my = meta(xm), meta(xf), meta(rs), meta(y)
    if _strip_casts(xm) is not x or None in (mx, mf, mr, my) or \
            not (_exact_casts(xm, x) and _exact_casts(xf, x)):
        return False
    return my.dtype == torch.promote_types(mf.dtype, mr.dtype)


def _casts_between(node: Any, x: fx.Node, skip: Any) -> list[fx.Node]:
    """The casts from x to ``node`` (x first), none if ``node`` is ``skip``."""
    path: list[fx.Node] = []
    while node is not skip and node is not x and isinstance(node, fx.Node):
        path.append(node)
        node = node.args[0]
    return path[::-1]


def _is_last_dim(dims: tuple[int, ...], ndim: int) -> bool:
    return len(dims) == 1 and dims[0] % ndim == ndim - 1


def _scale_vector(node: Any, dim: int, path: list[fx.Node]) -> tuple[fx.Node, float] | None:
    """(w, offset) if ``node`` is a per-feature vector w + offset (casts allowed); the
    nodes between ``node`` and w are appended to ``path``, outermost last."""
    seen: list[fx.Node] = []
    while isinstance(node, fx.Node) and canon_name(node) == "cast":
        seen.append(node)
        node = node.args[0]
    c = canon(node) if isinstance(node, fx.Node) else None
    if c is not None and c.name == "add":
        a, b = c.args
        if constant(a) is not None:
            a, b = b, a
        if constant(b) is not None:
            inner = _scale_vector(a, dim, path)
            if inner is not None:
                path.extend([node, *reversed(seen)])
                return inner[0], inner[1] + constant(b)
        return None
    m = meta(node)
    if m is not None and m.dim() == 1 and m.shape[0] == dim and m.is_floating_point():
        path.extend(reversed(seen))
        return node, 0.0
    return None


def _single_user(node: fx.Node) -> fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _extend_forward(y: fx.Node, dim: int, nodes: list[fx.Node]):
    """Walk the casts and the one per-feature scale after the normalised value."""
    weight, offset = None, 0.0
    while True:
        nxt = _single_user(y)
        c = canon(nxt) if nxt is not None else None
        if c is None:
            return y, weight, offset
        if c.name == "cast":
            y = nxt
        elif c.name == "mul" and weight is None:
            other = c.args[1] if c.args[0] is y else c.args[0]
            path: list[fx.Node] = []
            sv = _scale_vector(other, dim, path)
            if sv is None:
                return y, weight, offset
            weight, offset = sv
            nodes.extend(path)  # the scale's own casts / offset, evaluated before use
            y = nxt
        else:
            return y, weight, offset
        nodes.append(y)


def _recognise_decomposed(rs: fx.Node) -> RmsNorm | NearMiss | None:
    """Anchored at an rsqrt (or a sqrt used as a divisor)."""
    c = canon(rs)
    den = c.args[0]
    cd = canon(den) if isinstance(den, fx.Node) else None
    if cd is None or cd.name != "add":
        return None
    ms, eps = cd.args
    if constant(ms) is not None or (isinstance(eps, fx.Node) and canon_name(eps) == "mean"):
        ms, eps = eps, ms
    cm = canon(ms) if isinstance(ms, fx.Node) else None
    if cm is None or cm.name != "mean":
        return None
    sq, dims, keepdim = cm.args
    csq = canon(sq) if isinstance(sq, fx.Node) else None
    if csq is None or csq.name != "square":
        return None
    xf = csq.args[0]
    cx = canon(xf) if isinstance(xf, fx.Node) else None
    if cx is not None and cx.name == "sub" and canon_name(cx.args[1]) == "mean":
        return None  # the variance of a LayerNorm (layernorm_idiom.py), not a mean square
    x = _strip_casts(xf)
    mx = meta(x)
    if mx is None or mx.dim() == 0:
        return None
    if not _is_last_dim(dims, mx.dim()):
        return NearMiss(rs, Why(f"mean of squares over dims {list(dims)}, not the last "
                                f"(feature) dim of a {mx.dim()}-d tensor: not a row norm",
                                "rmsnorm.not_last_dim"))
    if not keepdim:
        return NearMiss(rs, Why("mean of squares without keepdim: not the RMSNorm broadcast",
                                "rmsnorm.no_keepdim"))
    if _eps(eps) is None:
        return NearMiss(rs, Why(f"eps is {getattr(eps, 'name', eps)!r}, neither a constant nor "
                                "a 0-d tensor: the deferred rstd needs one eps for every row",
                                "rmsnorm.eps"))
    dim = mx.shape[-1]
    if not isinstance(dim, int):
        return NearMiss(rs, Why("feature dim is symbolic", "rmsnorm.symbolic_dim"))
    # the normalised value: xf * rsqrt(...) or xf / sqrt(...), where the xf multiplied
    # back may be another node of the same value (_same_value: T5's spelling)
    y = xm = None
    for u in rs.users:
        cu = canon(u)
        if cu is None:
            continue
        if c.name == "rsqrt" and cu.name == "mul" and rs in cu.args and len(cu.args) == 2:
            other = cu.args[1] if cu.args[0] is rs else cu.args[0]
            if _same_value(other, xf, x, rs, u):
                y, xm = u, other
        if c.name == "sqrt" and cu.name == "div" and cu.args[1] is rs and \
                _same_value(cu.args[0], xf, x, rs, u):
            y, xm = u, cu.args[0]
    if y is None:
        return NearMiss(rs, Why("rsqrt(mean(x²) + eps) is not multiplied back onto x",
                                "rmsnorm.not_multiplied_back"))
    nodes = [n for n in (xf,) if n is not x] + _casts_between(xm, x, skip=xf) + \
        [sq, ms, den, rs, y]
    out, weight, offset = _extend_forward(y, dim, nodes)
    return RmsNorm(x, out, weight, offset, _eps(eps), dim, tuple(nodes), "decomposed")


def _recognise_fused(node: fx.Node) -> RmsNorm | NearMiss | None:
    x, shape, w, eps = canon(node).args
    mx = meta(x)
    if mx is None:
        return None
    if len(shape) != 1:
        return NearMiss(node, Why(f"rms_norm over the trailing {len(shape)} dims, not one "
                                  "feature dim", "rmsnorm.not_last_dim"))
    if w is not None and not isinstance(w, fx.Node):
        return NearMiss(node, Why("weight is not a tensor of the graph", "rmsnorm.weight"))
    if eps is None:
        eps = default_rms_eps(mx.dtype)
    if _eps(eps) is None:
        return NearMiss(node, Why(f"eps is {getattr(eps, 'name', eps)!r}, neither a constant "
                                  "nor a 0-d tensor", "rmsnorm.eps"))
    nodes = [node]
    out, weight2, offset = _extend_forward(node, shape[0], nodes)
    if w is not None and weight2 is not None:
        # rms_norm(x, w) * v: two scales. Rare; keep it simple and correct.
        out, nodes = node, [node]
        weight2, offset = None, 0.0
    return RmsNorm(x, out, w if w is not None else weight2,
                   offset if w is None else 0.0, _eps(eps), shape[0], tuple(nodes),
                   "rms_norm")


def find_rms_norms(graph: fx.Graph) -> list[RmsNorm | NearMiss]:
    """Every RMSNorm in the graph, in graph order, plus RMS-like near misses."""
    found: list[RmsNorm | NearMiss] = []
    for node in graph.nodes:
        name = canon_name(node)
        if name == "rsqrt" or (name == "sqrt" and any(canon_name(u) == "div"
                                                      for u in node.users)):
            r = _recognise_decomposed(node)
        elif name == "rms_norm":
            r = _recognise_fused(node)
        else:
            continue
        if r is not None:
            found.append(r)
    return found
