"""Row-scalar deferral: is it legal to apply a norm's rstd after the consumer GEMM?

The identity, for any per-row scalar r and any GEMM contracting over the feature dim:

    Σ_k (r[i]·H[i, k])·W[k, j]  =  r[i]·Σ_k H[i, k]·W[k, j]            (1)

proved once with sympy over indexed sums of symbolic length (cached). What makes it
apply to a matched graph are the side conditions, each checked on the graph:

  (a) r is per row: the norm's mean of squares runs over the last dim only, keepdim;
  (b) nothing between the norm and the GEMM mixes rows or features: only row selections
      (indexing that keeps the last dim whole; r is indexed the same way), reshapes that
      keep the last dim, contiguous() and casts (a cast rounds before instead of after
      the scale: equal in exact arithmetic, a rounding-level change in floating point);
  (b') the GEMM contracts over that last dim (nn.Linear / x @ Wᵀ: it does);
  (c) no value of the region, nor an alias of one, is updated in place: the fused
      producer reads the residual when the add happens, eager's norm when it runs.

The factor that must *not* move: one that varies along the contracted dim (a per-feature
γ, or r when the GEMM contracts over rows). Here γ stays in the producer's epilogue and
only r moves.
"""

from __future__ import annotations

import functools
import operator

import sympy as sp
import torch
import torch.fx as fx

from ..canonical import canon, meta
from ..capture import describe
from .decision import Decision, Proof, Rejection


@functools.cache
def deferral_identity() -> tuple[str, ...]:
    """Prove (1) symbolically; returns the proof steps. Raises if sympy disagrees."""
    i, j, k, K = sp.symbols("i j k K", integer=True, nonnegative=True)
    r, H, W = sp.IndexedBase("r"), sp.IndexedBase("H"), sp.IndexedBase("W")
    lhs = sp.Sum(r[i] * H[i, k] * W[k, j], (k, 0, K - 1))
    rhs = r[i] * sp.Sum(H[i, k] * W[k, j], (k, 0, K - 1))
    if sp.simplify(lhs - rhs) != 0:
        raise AssertionError("row-scale deferral identity failed to simplify")
    # The same manipulation with a factor on the contracted index must not go through:
    bad = sp.simplify(sp.Sum(r[k] * H[i, k] * W[k, j], (k, 0, K - 1)) - rhs)
    if bad == 0:
        raise AssertionError("sympy proved a false deferral; the checker is unsound")
    return (f"{sp.sstr(lhs)} - {sp.sstr(rhs)} simplifies to 0 (r[i] is constant in k)",
            "with r[k] in place of r[i] the difference does not vanish: "
            "a per-feature factor cannot be deferred this way")


# ---- side condition (b): ops between the norm and its GEMM ----------------------------

_VIEWLIKE = {"view", "reshape", "flatten"}
_IDENTITY = {"contiguous", "clone", "detach"}


def chain_op(node: fx.Node, d: int) -> tuple[str, str]:
    """Classify an op between the norm and the GEMM: ('index' | 'reshape' | 'cast' |
    'identity', '') when it keeps rows intact, else ('reject', why)."""
    c = canon(node)
    name = c.name if c else (node.target if node.op == "call_method" else
                             getattr(node.target, "__name__", str(node.target)))
    src, out = meta(node.args[0]), meta(node)
    if c is not None and c.name == "cast":
        return "cast", ""
    if name in _IDENTITY and len(node.args) == 1:
        return "identity", ""
    if c is not None and c.name == "getitem":
        if index_keeps_last_dim(node.args[1], src.dim()):
            return "index", ""
        return "reject", (f"{describe(node)} indexes the feature dim: the GEMM would "
                          "no longer contract over the normalised features")
    if name in _VIEWLIKE and out is not None and out.dim() >= 1 and out.shape[-1] == d \
            and src.shape[-1] == d:
        return "reshape", ""
    return "reject", (f"{describe(node)} ({name}) sits between the norm and the GEMM: "
                      "r·f(h) = f(r·h) is not established for it")


def index_keeps_last_dim(index, ndim: int) -> bool:
    """True when ``x[index]`` selects along leading dims only and keeps the last dim whole,
    so that the same index applied to r (shape [..., 1]) selects the same rows."""
    idx = index if isinstance(index, tuple) else (index,)
    full = slice(None, None, None)
    if any(i is Ellipsis for i in idx):
        after = idx[idx.index(Ellipsis) + 1:]
        after = [i for i in after if i is not None]
        return not after or (after[-1] == full and isinstance(after[-1], slice))
    consumed = [i for i in idx if i is not None]
    for i in consumed:
        m = meta(i)
        if m is not None and m.dtype.is_floating_point:
            return False
        if m is not None and m.dtype == torch.bool and m.dim() > 1:
            consumed = consumed + [full] * (m.dim() - 1)  # a mask spans several dims
    if len(consumed) < ndim:
        return True
    last = consumed[ndim - 1] if len(consumed) >= ndim else full
    return isinstance(last, slice) and last == full


# ---- side condition (c): in-place updates ---------------------------------------------

_INPLACE_FUNCTIONS = {operator.setitem, operator.iadd, operator.isub, operator.imul,
                      operator.itruediv, operator.ipow}
_ALIASING_METHODS = {"view", "reshape", "transpose", "permute", "expand", "unsqueeze",
                     "squeeze", "t", "narrow", "select", "as_strided", "flatten",
                     "unflatten", "split", "chunk", "contiguous", "to", "detach",
                     "view_as", "expand_as", "type_as", "float", "half", "bfloat16"}


def mutated_value(node: fx.Node) -> fx.Node | None:
    """The value ``node`` updates in place, if it does."""
    if not node.args or not isinstance(node.args[0], fx.Node):
        return None
    if node.op == "call_method" and node.target.endswith("_") \
            and not node.target.endswith("__") and node.target != "requires_grad_":
        return node.args[0]
    if node.op == "call_function":
        if node.target in _INPLACE_FUNCTIONS:
            return node.args[0]
        name = getattr(node.target, "__name__", "")
        if name.endswith("_") and not name.endswith("__") and name != "requires_grad_":
            return node.args[0]
        if "out" in node.kwargs and isinstance(node.kwargs["out"], fx.Node):
            return node.kwargs["out"]
    return None


def aliases(values: set[fx.Node]) -> set[fx.Node]:
    """``values`` and every view that may share memory with them."""
    seen, todo = set(values), list(values)
    while todo:
        n = todo.pop()
        for u in n.users:
            viewlike = (u.op == "call_method" and u.target in _ALIASING_METHODS) or (
                u.op == "call_function" and (u.target is operator.getitem or
                                             getattr(u.target, "__name__", "") in _ALIASING_METHODS)) \
                or (u.op == "call_function" and u.target is getattr)
            if viewlike and u.args and u.args[0] is n and u not in seen:
                seen.add(u)
                todo.append(u)
    return seen


def check(match, graph: fx.Graph) -> tuple[Decision, dict[fx.Node, Decision]]:
    """The overall decision for a match and one per consumer GEMM."""
    norm = match.norm
    region = {norm.input, norm.output, *norm.nodes}
    if norm.weight is not None:
        region.add(norm.weight)
    for c in match.consumers:
        region.update(c.chain)
    watched = aliases(region)
    for node in graph.nodes:
        target = mutated_value(node)
        if target is not None and target in watched:
            return Rejection(
                f"(c) {describe(node)} updates {target.name} in place; the deferred rstd "
                "would be computed from the value before that update", describe(node)), {}

    per_consumer: dict[fx.Node, Decision] = {}
    for c in match.consumers:
        kinds = [chain_op(n, norm.dim) for n in c.chain]
        bad = next((why for kind, why in kinds if kind == "reject"), None)
        mx = meta(c.chain[-1] if c.chain else norm.output)
        if bad is None and (mx is None or mx.shape[-1] != norm.dim):
            bad = f"{describe(c.linear)} does not contract over the {norm.dim} normalised features"
        if bad is not None:
            per_consumer[c.linear] = Rejection(f"(b) {bad}", describe(c.linear))
            continue
        via = ", ".join(f"{n.name}: {k}" for n, (k, _) in zip(c.chain, kinds))
        per_consumer[c.linear] = Proof(
            f"{c.linear.name} = r ⊙ (h2 · Wᵀ)" + (" + b" if c.bias is not None else ""),
            (f"(b) path from the norm: {via or 'direct'}",
             "(b') nn.Linear contracts over the last (normalised) dim"), ())
    accepted = [c for c in match.consumers if per_consumer[c.linear].accepted]
    if not accepted:
        first = next(iter(per_consumer.values()))
        return Rejection("no consumer GEMM can take the deferred row scale: "
                         + first.condition, first.where), per_consumer
    statement = "(diag(r)·H)·Wᵀ = diag(r)·(H·Wᵀ),  r[i] = rsqrt(mean_j z[i, j]² + eps)"
    assumptions = (
        f"(a) the mean of squares runs over the last dim ({norm.dim} features) with "
        f"keepdim, so r is one scalar per row [{norm.spelling}]",
        "(c) no value of the region or an alias of one is updated in place",
        f"eps = {norm.eps:g} is a constant" if isinstance(norm.eps, float) else
        f"eps is the 0-d tensor {norm.eps.name}, one value for every row (read at run time)",
    )
    return Proof(statement, assumptions, deferral_identity()), per_consumer
