"""Canonicalisation: one op vocabulary for the many spellings of the same math.

Dynamo graphs keep the user's spelling: ``torch._C._nn.linear`` for nn.Linear, ``x @ w.T``,
``hidden.pow(2).mean(-1, keepdim=True)``, ``torch.rms_norm``, ``.to(torch.float32)``,
``.float()``, ``weight * x`` or ``x * weight``. Matchers are written once, against
``canon(node)``, which names what a node computes in a small vocabulary:

    linear(x, w, b)      nn.Linear, F.linear, x @ w.T / w.t() / w.transpose(0, 1), addmm
    add/sub/mul/div(a, b), neg(a), square(a) (pow(a, 2), a * a), rsqrt(a), sqrt(a)
    mean(a, dims, keepdim)
    cast(a, dtype)       .to(dtype), .float(), .half(), .bfloat16(), .type_as(t), .type(dtype)
    rms_norm(x, shape, w, eps)   torch.rms_norm, F.rms_norm
    getitem(a, index), contiguous(a)

The view is read-only: canonicalisation never edits the graph, so whatever is not
rewritten later stays exactly the user's code, bit for bit. Composite idioms (the
decomposed RMSNorm of Hugging Face models) are recognised on top of this view by
``find_rms_norms``.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
import torch.fx as fx


@dataclasses.dataclass(frozen=True)
class COp:
    name: str
    args: tuple[Any, ...]


def meta(node: Any) -> torch.Tensor | None:
    """The fake tensor a node produced while dynamo traced it (None for non-tensors)."""
    if not isinstance(node, fx.Node):
        return None
    v = node.meta.get("example_value", node.meta.get("val"))
    return v if isinstance(v, torch.Tensor) else None


_LINEAR = {torch._C._nn.linear, torch.nn.functional.linear}
_BINARY = {
    operator.add: "add", torch.add: "add", "add": "add",
    operator.sub: "sub", torch.sub: "sub", "sub": "sub",
    operator.mul: "mul", torch.mul: "mul", "mul": "mul",
    operator.truediv: "div", torch.div: "div", "div": "div",
}
_UNARY = {
    operator.neg: "neg", torch.neg: "neg", "neg": "neg",
    torch.rsqrt: "rsqrt", "rsqrt": "rsqrt",
    torch.sqrt: "sqrt", "sqrt": "sqrt",
    torch.square: "square", "square": "square",
    "contiguous": "contiguous",
}
_CAST_METHODS = {"to", "float", "half", "bfloat16", "double", "type_as", "type"}
_TRANSPOSE_METHODS = {"t", "transpose", "permute"}
_RMS_NORM = {torch.rms_norm, torch.nn.functional.rms_norm}
_MATMUL = {operator.matmul, torch.matmul, "matmul"}


def _key(node: fx.Node):
    if node.op == "call_function":
        return node.target
    if node.op == "call_method":
        return node.target
    return None


def _transposed_2d(node: Any) -> fx.Node | None:
    """``w`` if ``node`` is w.T / w.t() / w.transpose(0, 1) / w.permute(1, 0) of a 2-D w."""
    if not isinstance(node, fx.Node):
        return None
    src = node.args[0] if node.args else None
    if meta(src) is None or meta(src).dim() != 2:
        return None
    if node.op == "call_function" and node.target is getattr and node.args[1] in ("T", "mT"):
        return src
    if node.op == "call_method" and node.target in _TRANSPOSE_METHODS:
        rest = [a % 2 if isinstance(a, int) else a for a in node.args[1:]]
        if len(rest) == 1 and isinstance(rest[0], (tuple, list)):  # permute((1, 0))
            rest = [a % 2 for a in rest[0]]
        if node.target == "t" or (node.target == "transpose" and sorted(rest) == [0, 1]) \
                or (node.target == "permute" and rest == [1, 0]):
            return src
    if node.op == "call_function" and node.target in (torch.t, torch.transpose):
        rest = [a % 2 for a in node.args[1:]]
        if node.target is torch.t or rest in ([0, 1], [1, 0]):
            return src
    return None


def _bias_add(y: Any, b: Any) -> COp | None:
    """linear(x, w, b) for ``(x @ w.T) + b``: a bias-less GEMM read only here, plus a
    vector with one value per output feature."""
    if not isinstance(y, fx.Node) or not isinstance(b, fx.Node) or len(y.users) != 1:
        return None
    c = canon(y)
    mb, my = meta(b), meta(y)
    if c is None or c.name != "linear" or c.args[2] is not None or mb is None or my is None:
        return None
    if mb.dim() == 1 and mb.shape[0] == my.shape[-1] and mb.dtype == my.dtype:
        return COp("linear", (c.args[0], c.args[1], b))
    return None


def canon(node: fx.Node) -> COp | None:
    """What ``node`` computes, in the canonical vocabulary (None: not in it)."""
    key = _key(node)
    if key is None:
        return None
    args, kw = node.args, node.kwargs
    if key in _LINEAR:
        x, w = args[0], args[1] if len(args) > 1 else kw.get("weight")
        b = args[2] if len(args) > 2 else kw.get("bias")
        return COp("linear", (x, w, b))
    if key in _MATMUL and len(args) == 2:
        w = _transposed_2d(args[1])
        if w is not None and meta(args[0]) is not None and meta(args[0]).dim() >= 1:
            return COp("linear", (args[0], w, None))
        return COp("matmul", tuple(args))
    if key is torch.addmm and len(args) == 3 and not kw:
        w = _transposed_2d(args[2])
        if w is not None:
            return COp("linear", (args[1], w, args[0]))
    if key in _BINARY and len(args) == 2 and not kw:
        name = _BINARY[key]
        a, b = args
        if name == "mul" and a is b:
            return COp("square", (a,))
        if name == "add":
            biased = _bias_add(a, b) or _bias_add(b, a)
            if biased:
                return biased
        return COp(name, (a, b))
    if key in (torch.pow, operator.pow, "pow") and len(args) == 2 and args[1] == 2:
        return COp("square", (args[0],))
    if key in _UNARY and len(args) == 1 and not kw:
        return COp(_UNARY[key], (args[0],))
    if key in (torch.mean, "mean"):
        dims = args[1] if len(args) > 1 else kw.get("dim")
        keepdim = args[2] if len(args) > 2 else kw.get("keepdim", False)
        if dims is None or kw.get("dtype") is not None:
            return None
        dims = (dims,) if isinstance(dims, int) else tuple(dims)
        return COp("mean", (args[0], dims, bool(keepdim)))
    if node.op == "call_method" and key in _CAST_METHODS:
        src, out = meta(args[0]), meta(node)
        if src is not None and out is not None and src.shape == out.shape \
                and src.device == out.device:
            return COp("cast", (args[0], out.dtype))
        return None
    if key in _RMS_NORM:
        x = args[0]
        shape = args[1] if len(args) > 1 else kw.get("normalized_shape")
        w = args[2] if len(args) > 2 else kw.get("weight")
        eps = args[3] if len(args) > 3 else kw.get("eps")
        return COp("rms_norm", (x, tuple(shape), w, eps))
    if key is operator.getitem and isinstance(args[0], fx.Node) and meta(args[0]) is not None:
        return COp("getitem", (args[0], args[1]))
    return None


def canon_name(node: Any) -> str | None:
    c = canon(node) if isinstance(node, fx.Node) else None
    return c.name if c else None


# ---- the RMSNorm idiom ----------------------------------------------------------------

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


def _const(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def runtime_scalar(node: Any) -> fx.Node | None:
    """The 0-d tensor behind a scalar that is only known at run time: a 0-d tensor node
    itself, or the tensor whose ``.item()`` it is (dynamo turns a module's float
    attribute into one under dynamic=True)."""
    if not isinstance(node, fx.Node):
        return None
    m = meta(node)
    if m is not None:
        return node if m.numel() == 1 and m.dim() == 0 and m.is_floating_point() else None
    if node.op == "call_method" and node.target == "item":
        return runtime_scalar(node.args[0])
    return None


def _eps(eps: Any) -> float | fx.Node | None:
    c = _const(eps)
    return c if c is not None else runtime_scalar(eps)


def _strip_casts(node: Any) -> Any:
    while isinstance(node, fx.Node) and canon_name(node) == "cast":
        node = node.args[0]
    return node


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
        if _const(a) is not None:
            a, b = b, a
        if _const(b) is not None:
            inner = _scale_vector(a, dim, path)
            if inner is not None:
                path.extend([node, *reversed(seen)])
                return inner[0], inner[1] + _const(b)
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
    if _const(ms) is not None or (isinstance(eps, fx.Node) and canon_name(eps) == "mean"):
        ms, eps = eps, ms
    cm = canon(ms) if isinstance(ms, fx.Node) else None
    if cm is None or cm.name != "mean":
        return None
    sq, dims, keepdim = cm.args
    csq = canon(sq) if isinstance(sq, fx.Node) else None
    if csq is None or csq.name != "square":
        return None
    xf = csq.args[0]
    x = _strip_casts(xf)
    mx = meta(x)
    if mx is None or mx.dim() == 0:
        return None
    if not _is_last_dim(dims, mx.dim()):
        return NearMiss(rs, f"mean of squares over dims {list(dims)}, not the last "
                            f"(feature) dim of a {mx.dim()}-d tensor: not a row norm")
    if not keepdim:
        return NearMiss(rs, "mean of squares without keepdim: not the RMSNorm broadcast")
    if _eps(eps) is None:
        return NearMiss(rs, f"eps is {getattr(eps, 'name', eps)!r}, neither a constant nor "
                            "a 0-d tensor: the deferred rstd needs one eps for every row")
    dim = mx.shape[-1]
    if not isinstance(dim, int):
        return NearMiss(rs, "feature dim is symbolic")
    # the normalised value: xf * rsqrt(...) or xf / sqrt(...)
    y = None
    for u in rs.users:
        cu = canon(u)
        if cu is None:
            continue
        if c.name == "rsqrt" and cu.name == "mul" and set(cu.args) == {xf, rs}:
            y = u
        if c.name == "sqrt" and cu.name == "div" and cu.args == (xf, rs):
            y = u
    if y is None:
        return NearMiss(rs, "rsqrt(mean(x²) + eps) is not multiplied back onto x")
    nodes = [n for n in (xf,) if n is not x] + [sq, ms, den, rs, y]
    out, weight, offset = _extend_forward(y, dim, nodes)
    return RmsNorm(x, out, weight, offset, _eps(eps), dim, tuple(nodes), "decomposed")


def _recognise_fused(node: fx.Node) -> RmsNorm | NearMiss | None:
    x, shape, w, eps = canon(node).args
    mx = meta(x)
    if mx is None:
        return None
    if len(shape) != 1:
        return NearMiss(node, f"rms_norm over the trailing {len(shape)} dims, not one "
                              "feature dim")
    if w is not None and not isinstance(w, fx.Node):
        return NearMiss(node, "weight is not a tensor of the graph")
    if eps is None:
        eps = torch.finfo(mx.dtype).eps
    if _eps(eps) is None:
        return NearMiss(node, f"eps is {getattr(eps, 'name', eps)!r}, neither a constant "
                              "nor a 0-d tensor")
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


def render(graph: fx.Graph) -> str:
    """The graph in the canonical vocabulary, one node a line, with model paths."""
    from .capture import model_path

    def fmt(a):
        if isinstance(a, fx.Node):
            return "%" + a.name
        if isinstance(a, (tuple, list)):
            return "(" + ", ".join(fmt(x) for x in a) + ")"
        return repr(a)

    lines = []
    for n in graph.nodes:
        c = canon(n)
        if c is not None:
            rhs = f"{c.name}({', '.join(fmt(a) for a in c.args)})"
        elif n.op in ("call_function", "call_method"):
            t = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", n.target)
            rhs = f"[{t}]({', '.join(fmt(a) for a in n.args)})"
        else:
            rhs = f"{n.op} {n.target}" if n.op != "output" else f"return {fmt(n.args[0])}"
        m = meta(n)
        ty = f"  : {str(m.dtype).removeprefix('torch.')}{list(m.shape)}" if m is not None else ""
        path = model_path(n)
        lines.append(f"%{n.name} = {rhs}{ty}" + (f"    # {path}" if path else ""))
    return "\n".join(lines) + "\n"


# ---- autocast and graphs eager rejects --------------------------------------------------

_AUTOCAST_ENTER = "_enter_autocast"
_AUTOCAST_EXIT = "_exit_autocast"


def _ambient_autocast() -> bool:
    """Autocast entered outside the captured code: dynamo guards on it and the graph is
    rewritten under it (the backend runs in the caller's autocast state)."""
    return any(torch.is_autocast_enabled(d) for d in ("cpu", "cuda"))


def under_autocast(node: fx.Node) -> bool:
    """Whether eager runs ``node`` under autocast: entered around the compiled call, or
    inside the graph (dynamo records ``with torch.autocast(...)`` as enter/exit calls)."""
    if _ambient_autocast():
        return True
    depth = 0
    for n in node.graph.nodes:
        if n is node:
            return depth > 0
        name = getattr(n.target, "__name__", "") if n.op == "call_function" else ""
        depth += (name == _AUTOCAST_ENTER) - (name == _AUTOCAST_EXIT)
    return False


def gemm_eager_rejects(graph: fx.Graph) -> fx.Node | None:
    """A GEMM whose input and weight differ in dtype with no autocast in force: eager
    raises there (fake tensors let it through at capture). A graph holding one raises in
    eager whatever else it does, so the pass leaves it as captured: it must still raise."""
    for node in graph.nodes:
        c = canon(node) if node.op in ("call_function", "call_method") else None
        if c is None or c.name != "linear":
            continue
        dtypes = {m.dtype for m in map(meta, c.args) if m is not None}
        if len(dtypes) > 1 and not under_autocast(node):
            return node
    return None
