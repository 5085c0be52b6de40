"""Canonicalisation: one op vocabulary for the many spellings of the same math.

Dynamo graphs keep the user's spelling: ``torch._C._nn.linear`` for nn.Linear, ``x @ w.T``,
``hidden.pow(2).mean(-1, keepdim=True)``, ``torch.rms_norm``, ``.to(torch.float32)``,
``.float()``, ``weight * x`` or ``x * weight``. Matchers are written once, against
``canon(node)``, which names what a node computes in a small vocabulary:

    linear(x, w, b)      nn.Linear, F.linear, x @ w.T / w.t() / w.transpose(0, 1), addmm
    add/sub/mul/div(a, b), neg(a), square(a) (pow(a, 2), a * a), rsqrt(a) (pow(a, -0.5)),
    sqrt(a) (pow(a, 0.5))
    mean(a, dims, keepdim)
    cast(a, dtype)       .to(dtype), .float(), .half(), .bfloat16(), .type_as(t), .type(dtype)
    rms_norm(x, shape, w, eps)   torch.rms_norm, F.rms_norm
    getitem(a, index), contiguous(a)
    clamp(a, lo, hi)     torch.clamp / clip, x.clamp(min=, max=) (a bound None where absent)
    sigmoid(a)           torch.sigmoid, F.sigmoid, x.sigmoid()

The view is read-only: canonicalisation never edits the graph, so whatever is not
rewritten later stays exactly the user's code, bit for bit. Composite idioms (the
decomposed RMSNorm of Hugging Face models: rmsnorm_idiom.py) are recognised on top of
this view.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
import torch.fx as fx
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .codegen.placements import dtensor_cls


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


def foreign_subclass(node: Any) -> str | None:
    """The class of a tensor subclass the pass does not model, where ``node``'s value or a
    tensor it reads is one (a quantized weight such as torchao's or bitsandbytes', a
    NestedTensor, a wrapper of two tensors), else None. What an op computes on such a
    tensor is the subclass's own ``__torch_dispatch__`` (F.linear on an int8 weight
    dequantizes, say), so no rewrite may read the op as the canonical one: its re-layouts
    and kernels would run on the wrapper, raising where eager runs or reading storage that
    is not the values. DTensor is modelled (algebra/sharding.py); dynamo's fake tensors are
    not wrappers."""
    if not isinstance(node, fx.Node):
        return None
    for n in (node, *node.all_input_nodes):
        v = meta(n)
        if v is not None and is_traceable_wrapper_subclass(v) and not _is_dtensor(v):
            return type(v).__name__
    return None


def foreign_gemm(node: fx.Node) -> str | None:
    """The subclass, where ``node`` is a GEMM or an SDPA call over a tensor subclass the
    pass does not model (foreign_subclass): the calls whose rewrites it leaves, each
    recorded with the reason (pipeline.py)."""
    key = _key(node)
    if key in _LINEAR or key in _MATMUL or key is torch.addmm or key in SDPA or \
            key in _GROUPED_MM:
        return foreign_subclass(node)
    return None


def _is_dtensor(v: torch.Tensor) -> bool:
    cls = dtensor_cls()
    return cls is not None and isinstance(v, cls)


_LINEAR = {torch._C._nn.linear, torch.nn.functional.linear}
# SDPA as dynamo records it (the attention family, RoPE's escape analysis and the
# attention-backward guard all look for these)
SDPA = {torch._C._nn.scaled_dot_product_attention,
        torch.nn.functional.scaled_dot_product_attention}
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
    torch.sigmoid: "sigmoid", torch.nn.functional.sigmoid: "sigmoid", "sigmoid": "sigmoid",
    "contiguous": "contiguous",
}
_CLAMP = {torch.clamp, torch.clip, "clamp", "clip"}
_CAST_METHODS = {"to", "float", "half", "bfloat16", "double", "type_as", "type"}
_TRANSPOSE_METHODS = {"t", "transpose", "permute"}
_RMS_NORM = {torch.rms_norm, torch.nn.functional.rms_norm}
_MATMUL = {operator.matmul, torch.matmul, "matmul"}
_GROUPED_MM = {torch._grouped_mm, getattr(torch.nn.functional, "grouped_mm", torch._grouped_mm),
               torch.ops.aten._grouped_mm.default}
# transformers' custom op for what torch._grouped_mm does not take under torch.compile
# (a float32 model): the same product, its rows past offs[-1] zero
_GROUPED_MM_OPS = ("transformers::grouped_mm_fallback",)
# kernels/expert_gemm.expert_gemm(a, weight, offsets) carries this attribute: the grouped
# GEMM the project's own rewrites emit (the routed form of dense or batched experts), a
# grouped_mm to the families after them, recognised without importing the runtime
GROUPED_MM_MARK = "_coda_grouped_mm"


def _grouped_mm(node: fx.Node) -> COp | None:
    """grouped_mm(a [S, K], b [E, K, N], offs [E]) with no bias and no out_dtype."""
    key, args, kw = node.target, node.args, node.kwargs
    name = getattr(key, "_qualified_op_name", None) or getattr(
        getattr(key, "_schema", None), "name", None)
    marked = getattr(key, GROUPED_MM_MARK, False)
    if key not in _GROUPED_MM and name not in _GROUPED_MM_OPS and not marked:
        return None
    names = ("mat_a", "mat_b", "offs", "bias", "out_dtype")
    if name in _GROUPED_MM_OPS:
        names = ("input", "weight", "offs")
    elif marked:
        names = ("a", "weight", "offsets")
    bound = dict(zip(names, args)) | dict(kw)
    if bound.get("bias") is not None or bound.get("out_dtype") is not None or \
            bound.get(names[2]) is None or len(bound) > len(names):
        return None
    return COp("grouped_mm", tuple(bound[n] for n in names[:3]))


def _key(node: fx.Node):
    if node.op == "call_function":
        return node.target
    if node.op == "call_method":
        return node.target
    return None


def qualified_op_name(target: Any) -> str:
    """``aten::numpy_T`` for torch.ops.aten.numpy_T (the packet or one of its
    overloads): the namespace-qualified name of a torch op a graph calls directly, ""
    for anything else."""
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name
    return ""


def aten_name(target: Any) -> str | None:
    """``numpy_T`` for torch.ops.aten.numpy_T: the name of an aten op a graph calls
    directly, None for anything else."""
    ns, _, name = qualified_op_name(target).partition("::")
    return name if ns == "aten" else None


# The transposing tensor properties, as dynamo records them: getattr(w, "T") through
# torch 2.13; torch 2.14 records the property's aten op instead (w.T → aten.numpy_T(w),
# k.mT → aten.mT(k)).
_TRANSPOSE_PROPERTIES = {"T": "T", "mT": "mT", "numpy_T": "T"}


def transpose_property(node: Any) -> tuple[fx.Node, str] | None:
    """(x, "T" or "mT") where ``node`` is the property x.T or x.mT, however dynamo
    recorded it; None otherwise."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or not node.args or \
            not isinstance(node.args[0], fx.Node):
        return None
    if node.target is getattr and len(node.args) == 2:
        name = node.args[1] if node.args[1] in ("T", "mT") else None
    else:
        name = aten_name(node.target) if len(node.args) == 1 and not node.kwargs else None
    return (node.args[0], _TRANSPOSE_PROPERTIES[name]) \
        if name in _TRANSPOSE_PROPERTIES else None


def transposed_2d(node: Any) -> fx.Node | None:
    """``w`` if ``node`` is w.T / w.mT / w.t() / w.transpose(0, 1) / w.permute(1, 0) of a
    2-D w."""
    if not isinstance(node, fx.Node):
        return None
    src = node.args[0] if node.args else None
    if meta(src) is None or meta(src).dim() != 2:
        return None
    if transpose_property(node) is not None:
        return src
    dims = node.args[1:]
    if len(dims) == 1 and isinstance(dims[0], (tuple, list)):  # permute((1, 0))
        dims = dims[0]
    if not all(isinstance(d, int) for d in dims):  # a dim the graph computes: not read
        return None
    rest = [d % 2 for d in dims]
    if node.op == "call_method" and node.target in _TRANSPOSE_METHODS:
        if node.target == "t" or (node.target == "transpose" and sorted(rest) == [0, 1]) \
                or (node.target == "permute" and rest == [1, 0]):
            return src
    if node.op == "call_function" and node.target in (torch.t, torch.transpose):
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
    if key is None or foreign_subclass(node) is not None:
        return None
    args, kw = node.args, node.kwargs
    if key in _LINEAR:
        x, w = args[0], args[1] if len(args) > 1 else kw.get("weight")
        b = args[2] if len(args) > 2 else kw.get("bias")
        return COp("linear", (x, w, b))
    grouped = _grouped_mm(node) if node.op == "call_function" else None
    if grouped is not None:
        return grouped
    if key in _MATMUL and len(args) == 2:
        w = transposed_2d(args[1])
        if w is not None and meta(args[0]) is not None and meta(args[0]).dim() >= 1:
            return COp("linear", (args[0], w, None))
        return COp("matmul", tuple(args))
    if key is torch.addmm and len(args) == 3 and not kw:
        w = transposed_2d(args[2])
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
    if key in (torch.pow, operator.pow, "pow") and len(args) == 2 and not kw and \
            isinstance(args[1], (int, float)) and not isinstance(args[1], bool):
        # x², and the norm spelled x · (mean(x²) + eps)^(-1/2) (or divided by ^(1/2))
        named = {2: "square", -0.5: "rsqrt", 0.5: "sqrt"}.get(args[1])
        return COp(named, (args[0],)) if named else None
    if key in _UNARY and len(args) == 1 and not kw:
        return COp(_UNARY[key], (args[0],))
    if key in _CLAMP and 1 <= len(args) <= 3 and set(kw) <= {"min", "max"}:
        lo = args[1] if len(args) > 1 else kw.get("min")
        hi = args[2] if len(args) > 2 else kw.get("max")
        if all(b is None or constant(b) is not None for b in (lo, hi)) and \
                (lo, hi) != (None, None):
            return COp("clamp", (args[0], constant(lo), constant(hi)))
        return None
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


def inactive_dropout(node: Any) -> bool:
    """F.dropout(x, p, training=False), or with p = 0, not in place: the identity."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or \
            node.target is not torch.nn.functional.dropout:
        return False
    p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
    training = node.args[2] if len(node.args) > 2 else node.kwargs.get("training", True)
    inplace = node.args[3] if len(node.args) > 3 else node.kwargs.get("inplace", False)
    return not inplace and (training is False or p == 0)


def canon_name(node: Any) -> str | None:
    c = canon(node) if isinstance(node, fx.Node) else None
    return c.name if c else None


def constant(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def pair_clamp_limit(gate_clamp: Any, up_clamp: Any) -> float | None:
    """l where ``gate_clamp`` is clamp(g, max=l) (above only) and ``up_clamp`` is
    clamp(u, -l, l), l > 0: the clamps of gpt-oss's and DeepSeek-V4's SwiGLUs; None
    otherwise."""
    cg = canon(gate_clamp) if isinstance(gate_clamp, fx.Node) else None
    cu = canon(up_clamp) if isinstance(up_clamp, fx.Node) else None
    if cg is None or cu is None or cg.name != "clamp" or cu.name != "clamp":
        return None
    (_, glo, limit), (_, ulo, uhi) = cg.args, cu.args
    if glo is not None or limit is None or limit <= 0 or (ulo, uhi) != (-limit, limit):
        return None
    return float(limit)


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


def default_rms_eps(dtype: torch.dtype) -> float:
    """The eps F.rms_norm / nn.RMSNorm take for eps=None: ATen's, the epsilon of the type
    it computes in (float32 for bf16 and fp16 inputs), not of the input's dtype (2⁻⁷ for
    bf16); a float64 replay of such a norm must use the model's, not float64's."""
    return torch.finfo(torch.promote_types(dtype, torch.float32)).eps
