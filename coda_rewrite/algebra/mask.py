"""What is this attention mask? An abstract interpretation of the nodes that build it.

Under tracing, Hugging Face models build the causal mask as a tensor from position
comparisons (``kv_idx <= q_idx``, optionally ``& kv_idx > q_idx - window`` and
``& padding[b, kv_idx]``) and pass it to SDPA. Each node is evaluated symbolically:
``torch.arange(n)`` becomes an index symbol with range [0, n) placed on one dim,
arithmetic and comparisons become sympy expressions (a strict comparison of integers read
as the non-strict one it equals), tril / triu of a boolean grid of ones or of a float
grid cut by k ≤ q + d / k ≥ q + d, ``&``/``|``/``~`` become logic, a
gather from a graph input becomes an opaque function of its indices (a padding mask
whose values are unknown at compile time), and shape-only ops move the symbols between
dims. The result is the mask as a formula in the query index q and key index k.

``prove_causal`` then decides whether that formula equals upper-left causal masking
(k ≤ q, which SDPA's ``is_causal=True`` computes) on the whole [0, n)² domain, for
q_len == kv_len: the formula must be a conjunction of linear comparisons, one of them
k ≤ q and every other one true on the causal triangle, which for a linear inequality
holds iff it holds at the triangle's three vertices. Anything else (an opaque padding
term, a cache offset, a window shorter than the sequence) leaves the mask in place.
"""

from __future__ import annotations

import dataclasses
import operator

import sympy as sp
import torch
import torch.fx as fx

from ..canonical import meta
from ..capture import describe
from .decision import Proof, Rejection


class NotAMask(Exception):
    """The mask is not one the prover models; ``code`` says which way."""

    def __init__(self, message: str, code: str = "mask.not_positional"):
        super().__init__(message)
        self.code = code


@dataclasses.dataclass(frozen=True)
class Sym:
    """A tensor as a formula: ``expr`` in index symbols, ``dims[d]`` the symbol that
    varies along dim d (None: constant along it, size 1 or broadcast). ``additive``: a
    float mask added to the scores, 0 where ``expr`` (the allowed positions) holds and
    −inf or the dtype's finfo.min elsewhere (so ``expr`` means what a boolean mask's
    True means: attend)."""
    expr: object
    dims: tuple
    additive: bool = False


_COMPARE = {operator.le: sp.Le, operator.lt: sp.Lt, operator.ge: sp.Ge, operator.gt: sp.Gt,
            torch.le: sp.Le, torch.lt: sp.Lt, torch.ge: sp.Ge, torch.gt: sp.Gt,
            "le": sp.Le, "lt": sp.Lt, "ge": sp.Ge, "gt": sp.Gt,
            operator.eq: sp.Eq, operator.ne: sp.Ne, torch.eq: sp.Eq, torch.ne: sp.Ne,
            "eq": sp.Eq, "ne": sp.Ne}
_ARITH = {operator.add: operator.add, operator.sub: operator.sub, operator.mul: operator.mul,
          torch.add: operator.add, torch.sub: operator.sub, "add": operator.add,
          "sub": operator.sub}
_LOGIC = {operator.and_: sp.And, operator.or_: sp.Or, torch.logical_and: sp.And,
          torch.logical_or: sp.Or, torch.bitwise_and: sp.And, torch.bitwise_or: sp.Or,
          "__and__": sp.And, "__or__": sp.Or, "logical_and": sp.And, "logical_or": sp.Or}
_NOT = {operator.invert, torch.logical_not, torch.bitwise_not, "logical_not"}
_SHAPE_ONLY = {"to", "bool", "expand", "expand_as", "contiguous", "clone", "type_as", "float",
               "half", "bfloat16"}


def _size(s):
    if isinstance(s, torch.SymInt):
        return sp.Symbol(str(s), integer=True, positive=True)
    return int(s)


class MaskInterpreter:
    def __init__(self):
        self.cache: dict[fx.Node, Sym] = {}
        self.ranges: dict[sp.Symbol, object] = {}
        self._n = 0

    def _index_symbol(self, n) -> sp.Symbol:
        self._n += 1
        s = sp.Symbol(f"x{self._n}", integer=True, nonnegative=True)
        self.ranges[s] = n
        return s

    def _broadcast(self, *syms: Sym) -> tuple[list[Sym], tuple]:
        """``syms`` as operands of one broadcasting op (dims aligned from the right), and
        the result's dims: one index symbol per dim. A symbol stands for the index along
        the dim it sits on: two symbols on one dim are the same index (two aranges of one
        length read along the same dim), and one symbol on two dims is two independent
        indices (one arange read along both, ``i[:, None] - i[None, :]``: q and k, not
        one; read as one, ``i[None, :] <= i[:, None]`` was ``x <= x``, true everywhere,
        and a sliding window's ``q - k < w`` was ``0 < w``). Later operands are renamed
        to agree with earlier ones."""
        width = max(len(a.dims) for a in syms)
        on_dim: dict[int, sp.Symbol] = {}     # aligned dim -> its symbol
        placed: dict[sp.Symbol, int] = {}     # symbol -> the aligned dim it indexes
        out = []
        for a in syms:
            dims, renamed = list(a.dims), {}
            for i, s in enumerate(dims):
                at = i - len(dims) + width
                if s is None:
                    continue
                if at in on_dim and on_dim[at] != s:
                    if self.ranges[on_dim[at]] != self.ranges[s]:
                        raise NotAMask("two index ranges on one dim")
                    renamed[s] = on_dim[at]
                elif placed.get(s, at) != at:
                    renamed[s] = self._index_symbol(self.ranges[s])
                dims[i] = renamed.get(s, s)
                on_dim.setdefault(at, dims[i])
                placed.setdefault(dims[i], at)
            out.append(Sym(a.expr.subs(renamed, simultaneous=True), tuple(dims), a.additive)
                       if renamed else a)
        return out, tuple(on_dim.get(d) for d in range(width))

    def _int(self, a):
        """An int, or the symbol of a size dynamo made dynamic (a SymInt node)."""
        if isinstance(a, fx.Node):
            v = a.meta.get("example_value", a.meta.get("val"))
            if isinstance(v, (int, torch.SymInt)):
                return _size(v)
            raise NotAMask(f"{describe(a)} is not a size")
        return _size(a)

    def value(self, a) -> Sym:
        if isinstance(a, fx.Node):
            v = a.meta.get("example_value", a.meta.get("val"))
            if isinstance(v, (int, torch.SymInt)):  # a size, not a tensor
                return Sym(_size(v), ())
            if a not in self.cache:
                self.cache[a] = self._eval(a)
            return self.cache[a]
        if isinstance(a, bool):
            return Sym(sp.true if a else sp.false, ())
        if isinstance(a, (int, torch.SymInt)):
            return Sym(_size(a), ())
        raise NotAMask(f"constant {a!r}")

    def _grid(self, n: fx.Node, allowed) -> Sym:
        """A constant additive mask over ``n``'s shape (it varies along no dim yet)."""
        m = meta(n)
        if m is None or not m.is_floating_point():
            raise NotAMask(f"{describe(n)} is not a float mask")
        return Sym(allowed, (None,) * m.dim(), additive=True)

    def _placed(self, src: fx.Node, a: Sym) -> Sym:
        """``a`` with index symbols on its last two dims where it is constant along them
        (triu/tril of a constant grid start to vary there)."""
        m = meta(src)
        if m is None or m.dim() < 2 or len(a.dims) < 2:
            raise NotAMask(f"{describe(src)} is not a [q, k] grid")
        dims = list(a.dims)
        for d in (-2, -1):
            if dims[d] is None:
                dims[d] = self._index_symbol(_size(m.shape[d]))
        return Sym(a.expr, tuple(dims), a.additive)

    def _fill(self, n: fx.Node, value) -> bool:
        """True for a masking fill (−inf, or ≤ the float dtype's finfo.min: exp of it
        underflows to exactly 0), False for 0; anything else is not a mask value."""
        if isinstance(value, bool):
            return not value
        if not isinstance(value, (int, float)):
            raise NotAMask(f"{describe(n)} fills a value not known at compile time")
        dtype = meta(n).dtype if meta(n) is not None and meta(n).is_floating_point() \
            else torch.float32
        if value == 0:
            return False
        if value == float("-inf") or value <= torch.finfo(dtype).min:
            return True
        raise NotAMask(f"{describe(n)} fills {value!r}: an additive mask holds only 0 and "
                       "−inf (or the dtype's finfo.min)", "mask.fill_value")

    def _constant(self, x):
        """A number: a Python one, or a 0-d tensor of one built in the graph
        (``torch.tensor(number)``; ``torch.zeros(())``, as transformers 5.25 writes it)."""
        if isinstance(x, fx.Node) and x.op == "call_function" and x.target is torch.tensor \
                and x.args and isinstance(x.args[0], (int, float)):
            return x.args[0]
        if isinstance(x, fx.Node) and x.op == "call_function" and \
                x.target in (torch.zeros, torch.ones) and len(x.args) == 1 and \
                x.args[0] in ((), []) and meta(x) is not None and meta(x).dim() == 0:
            return 0 if x.target is torch.zeros else 1
        if isinstance(x, (int, float)) and not isinstance(x, bool):
            return x
        raise NotAMask(f"{describe(x) if isinstance(x, fx.Node) else x!r} is not a constant")

    def _additive(self, n: fx.Node) -> Sym | None:
        """The float-mask constructors: full / zeros, triu / tril, masked_fill, a cat with
        an empty block, and sums of masks (as the reference Llama builds its mask)."""
        t, args, kw = n.target, n.args, n.kwargs
        name = t if isinstance(t, str) else getattr(t, "__name__", "")
        if n.op == "call_function" and t in (torch.full, torch.full_like):
            return self._grid(n, sp.Not(self._fill(n, args[1] if len(args) > 1
                                                   else kw.get("fill_value"))))
        if n.op == "call_function" and t in (torch.zeros, torch.zeros_like) or \
                n.op == "call_method" and t == "new_zeros" and kw.get("dtype") != torch.bool:
            return self._grid(n, sp.true)
        if (n.op == "call_function" and t in (torch.ones, torch.ones_like) or
                n.op == "call_method" and t == "new_ones") and \
                meta(n) is not None and meta(n).dtype == torch.bool:
            # a boolean grid of True: attend everywhere (what tril / triu then cut)
            return Sym(sp.true, (None,) * meta(n).dim(), additive=False)
        if name in ("triu", "tril"):
            a = self._placed(args[0], self.value(args[0]))
            d = args[1] if len(args) > 1 else kw.get("diagonal", 0)
            q, k, d = a.dims[-2], a.dims[-1], self._int(d)
            # triu keeps k ≥ q + d, tril k ≤ q + d (integer positions: the complement of
            # one is written as the other, so k ≤ q reads as k ≤ q)
            kept, zeroed = (sp.Ge(k, q + d), sp.Le(k, q + d - 1)) if name == "triu" else \
                (sp.Le(k, q + d), sp.Ge(k, q + d + 1))
            # what triu/tril zero: allowed in an additive mask, not attended in a bool one
            expr = sp.Or(a.expr, zeroed) if a.additive else sp.And(a.expr, kept)
            return Sym(expr, a.dims, a.additive)
        if n.op == "call_function" and t is torch.where and len(args) == 3:
            # Hugging Face's float masks: where(attend, 0, finfo.min)
            c = self.value(args[0])
            if c.additive:
                raise NotAMask(f"{describe(n)} selects on a float mask, not a boolean one")
            a, b = (self._constant(x) for x in args[1:])
            if a == 0 and self._fill(n, b):
                return Sym(c.expr, c.dims, additive=True)
            if b == 0 and self._fill(n, a):
                return Sym(sp.Not(c.expr), c.dims, additive=True)
            raise NotAMask(f"{describe(n)} selects between {a!r} and {b!r}, not 0 and a "
                           "masking value", "mask.fill_value")
        if name == "masked_fill":
            (a, c), dims = self._broadcast(self.value(args[0]), self.value(args[1]))
            masking = self._fill(n, args[2] if len(args) > 2 else kw.get("value"))
            expr = sp.And(a.expr, sp.Not(c.expr)) if masking else sp.Or(a.expr, c.expr)
            return Sym(expr, dims, a.additive)
        if n.op == "call_function" and t in (torch.hstack, torch.cat, torch.concat):
            parts = args[0]
            dim = (args[1] if len(args) > 1 else kw.get("dim", 0)) if t is not torch.hstack \
                else 1
            m = meta(n)
            last = m is not None and dim in (-1, m.dim() - 1)
            empty = [p for p in parts if meta(p) is not None and meta(p).shape[-1] == 0]
            if last and len(parts) - len(empty) == 1:
                (rest,) = [p for p in parts if p not in empty]
                return self.value(rest)  # a cache offset of 0: the mask itself
            raise NotAMask(f"{describe(n)} joins mask blocks along the keys (a cache offset: "
                           "the mask is aligned bottom-right)", "mask.cache_offset")
        return None

    def _eval(self, n: fx.Node) -> Sym:
        t, args, kw = n.target, n.args, n.kwargs
        if n.op in ("call_function", "call_method"):
            found = self._additive(n)
            if found is not None:
                return found
        if n.op == "call_function" and t is torch.arange:
            ints = [a for a in args if not isinstance(a, torch.dtype)]
            start, end = (0, ints[0]) if len(ints) == 1 else (ints[0], ints[1])
            if len(ints) > 2 and self._int(ints[2]) != 1:
                raise NotAMask("arange with a step")
            length = self._int(end) - self._int(start)
            x = self._index_symbol(length)
            return Sym(x + self._int(start), (x,))
        key = t if n.op in ("call_function", "call_method") else None
        if key in ("new_ones", "new_zeros") and kw.get("dtype") == torch.bool:
            m = meta(n)  # a constant start for and-/or-combining masks
            return Sym(sp.true if key == "new_ones" else sp.false,
                       (None,) * (m.dim() if m is not None else 0))
        if key in _COMPARE and len(args) == 2:
            (a, b), dims = self._broadcast(self.value(args[0]), self.value(args[1]))
            return Sym(_COMPARE[key](a.expr, b.expr), dims)
        if key in _ARITH and len(args) == 2 and not kw:
            (a, b), dims = self._broadcast(self.value(args[0]), self.value(args[1]))
            if a.additive or b.additive:  # −inf + x = −inf: a sum allows where both do
                if not (a.additive and b.additive) or _ARITH[key] is not operator.add:
                    raise NotAMask(f"{describe(n)} mixes an additive mask with numbers")
                return Sym(sp.And(a.expr, b.expr), dims, True)
            return Sym(_ARITH[key](a.expr, b.expr), dims)
        if key in _LOGIC and len(args) == 2:
            (a, b), dims = self._broadcast(self.value(args[0]), self.value(args[1]))
            return Sym(_LOGIC[key](a.expr, b.expr), dims)
        if key in _NOT and len(args) == 1:
            a = self.value(args[0])
            return Sym(sp.Not(a.expr), a.dims)
        if n.op == "call_method" and t in _SHAPE_ONLY or key in (torch.Tensor.to,):
            a = self.value(args[0])
            out = meta(n)
            if t in ("to", "type_as") and out is not None and out.dtype != torch.bool \
                    and meta(args[0]).dtype == torch.bool:
                raise NotAMask("a boolean mask turned into numbers")
            if a.additive and out is not None and not out.is_floating_point():
                raise NotAMask("an additive mask turned into integers")
            # a float cast keeps 0 at 0 and −inf / finfo.min masking (it rounds to
            # −inf or to the new dtype's finfo.min)
            nd = out.dim() if out is not None else len(a.dims)
            return Sym(a.expr, (None,) * (nd - len(a.dims)) + a.dims, a.additive)
        if key in ("unsqueeze", torch.unsqueeze) and len(args) == 2 and not kw:
            a, out = self.value(args[0]), meta(n)
            if out is None or len(a.dims) != out.dim() - 1:
                raise NotAMask(f"{describe(n)} unsqueezes a value of another rank")
            d = args[1] % out.dim()
            return Sym(a.expr, a.dims[:d] + (None,) + a.dims[d:], a.additive)
        if key is operator.getitem:
            return self._getitem(n)
        raise NotAMask(f"{describe(n)} is not a position comparison")

    def _getitem(self, n: fx.Node) -> Sym:
        src, idx = n.args
        idx = idx if isinstance(idx, tuple) else (idx,)
        if all(i is None or i == slice(None) for i in idx):  # placing dims
            a = self.value(src)
            dims = list(a.dims)
            out, pos = [], 0
            for i in idx:
                if i is None:
                    out.append(None)
                else:
                    out.append(dims[pos])
                    pos += 1
            out += dims[pos:]
            return Sym(a.expr, tuple(out), a.additive)
        if all(isinstance(i, fx.Node) for i in idx) and isinstance(src, fx.Node):
            vals, dims = self._broadcast(*(self.value(i) for i in idx))
            gathered = self._gathered(src, idx, vals)
            if gathered is not None:
                # a gather from a value this interpretation models (transformers 5.25's
                # positions, arange(S)[None].expand(B, S), read at [b, kv] and [b, q]),
                # every index in bounds: the value's formula at the index expressions
                return Sym(gathered, dims)
            same = _uniform_constant(src)
            if same is not None:
                # a gather from a tensor computed from constants alone, every element
                # equal (transformers' packed-sequence ids from arange positions)
                return Sym(sp.Integer(same), (None,) * len(dims))
            # a gather from a tensor whose values are not known at compile time: a
            # boolean one (a padding mask) as a truth value, any other (positions given
            # as an input: real packing) as an integer
            f = sp.Function(f"input_{src.name}", integer=True)
            read = f(*(v.expr for v in vals))
            boolean = meta(src) is not None and meta(src).dtype == torch.bool
            return Sym(sp.Eq(read, 1) if boolean else read, dims)
        raise NotAMask(f"{describe(n)} indexes in a way the mask prover does not model")

    def _gathered(self, src: fx.Node, idx: tuple, vals: list[Sym]):
        """``src[vals]`` as a formula, where ``src`` is itself a formula in index symbols
        (one index per dim, none additive) and every index provably stays in [0, size)
        along the dim it reads (a negative index would wrap around in eager, and an index
        past the end raises there): the formula with each dim's symbol replaced by its
        index expression. None where that does not hold (the gather stays opaque)."""
        if any(meta(i) is None or meta(i).dtype not in _INDEX_DTYPES for i in idx):
            return None  # a boolean index selects elements: another operation entirely
        try:
            a = self.value(src)
        except NotAMask:
            return None
        if a.additive or any(v.additive for v in vals) or len(vals) != len(a.dims):
            return None
        subs = {}
        for dim, v in zip(a.dims, vals):
            if dim is None:  # constant along this dim: any in-bounds index reads the same
                continue
            if not self._within(v.expr, self.ranges[dim]):
                return None
            subs[dim] = v.expr
        return a.expr.subs(subs, simultaneous=True)

    def _within(self, expr, size) -> bool:
        """Whether a linear integer expression in index symbols lies in [0, size) for every
        value of its symbols (each in [0, its range)); False where that is not provable."""
        expr = sp.expand(sp.sympify(expr))
        symbols = expr.free_symbols
        if not symbols <= set(self.ranges) or \
                (symbols and sp.Poly(expr, *symbols).total_degree() > 1):
            return False
        low = high = expr.subs({x: 0 for x in symbols})
        for x in symbols:
            c = expr.coeff(x)
            if not c.is_number:
                return False
            span = c * (self.ranges[x] - 1)
            low, high = (low + span, high) if c < 0 else (low, high + span)
        return _provably_nonnegative(low) and _provably_nonnegative(size - 1 - high)


def _provably_nonnegative(e) -> bool:
    """sympy decides e ≥ 0 from its symbols' assumptions (sizes: positive integers)."""
    return (sp.simplify(e) >= 0) is sp.true


_CONSTANT_NODES = 32


def _uniform_constant(node: fx.Node) -> int | None:
    """The one value of every element of ``node``, where it is computed from constants
    alone (no graph input, static shapes, at most a few pure ops: evaluated here on CPU,
    as the compiled graph will, since dynamo specialised it on these shapes) and all its
    elements are equal integers; else None. Transformers 5 computes packed-sequence ids
    this way from arange positions when no position_ids are passed (diff, ne, cumsum):
    all zero, so the mask term comparing them is true everywhere."""
    order, stack, seen = [], [node], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op not in ("call_function", "call_method") or n.is_impure() or \
                _unreproducible(n) or len(seen) > _CONSTANT_NODES:
            return None
        m = n.meta.get("example_value", n.meta.get("val"))
        if not isinstance(m, torch.Tensor) or m.numel() > 1 << 16 or \
                any(not isinstance(d, int) for d in m.shape):
            return None
        order.append(n)
        stack.extend(a for a in n.all_input_nodes)
    env: dict = {}

    def arg(a):
        return env[a] if isinstance(a, fx.Node) else a
    try:
        for n in sorted(order, key=lambda n: _position(n)):
            args = fx.node.map_arg(n.args, arg)
            kwargs = {k: ("cpu" if k == "device" else v)
                      for k, v in fx.node.map_arg(n.kwargs, arg).items()}
            env[n] = getattr(args[0], n.target)(*args[1:], **kwargs) \
                if n.op == "call_method" else n.target(*args, **kwargs)
    except Exception:  # an op that needs what is not here: not a constant after all
        return None
    value = env[node]
    if not isinstance(value, torch.Tensor) or value.dtype.is_floating_point or \
            value.numel() == 0 or not bool((value == value.flatten()[0]).all()):
        return None
    return int(value.flatten()[0])


_INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8)  # uint8 indexes as a mask
_UNINITIALISED = {"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided"}


def _unreproducible(n: fx.Node) -> bool:
    """An op whose values this evaluation would not reproduce at run time: random ones
    (fx already calls them impure; their seeded tags checked too), an uninitialised
    allocation, an in-place update."""
    name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
    if name in _UNINITIALISED or name.endswith("_"):
        return True
    tags = getattr(n.target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags


def _position(n: fx.Node) -> int:
    i = 0
    for i, m in enumerate(n.graph.nodes):
        if m is n:
            break
    return i


def prove_causal(mask: fx.Node, q_len, kv_len) -> Proof | Rejection:
    """Is ``mask`` exactly SDPA's upper-left causal mask for these lengths?"""
    interp = MaskInterpreter()
    try:
        m = interp.value(mask)
    except NotAMask as e:
        return Rejection(f"the attention mask is not a pure position comparison: {e}",
                         describe(mask), code=e.code)
    except (TypeError, ValueError, AttributeError) as e:  # sympy refusing a construct
        return Rejection(f"the mask prover could not model this mask ({e})", describe(mask),
                         code="mask.unmodelled")
    if len(m.dims) < 2 or m.dims[-1] is None or m.dims[-2] is None:
        return Rejection("the mask does not vary along both query and key positions",
                         describe(mask), code="mask.not_2d")
    qs, ks = m.dims[-2], m.dims[-1]
    if qs == ks:  # one index on both dims (_broadcast keeps them apart): nothing to prove
        return Rejection("the mask's query and key positions are one index",
                         describe(mask), code="mask.unmodelled")
    # a batch or head index the formula does not read leaves every batch's mask equal
    if any(d is not None and d in m.expr.free_symbols for d in m.dims[:-2]):
        return Rejection("the mask depends on the batch or head (a padding mask): kept",
                         describe(mask), code="mask.padding")
    if m.expr.atoms(sp.core.function.AppliedUndef):
        return Rejection("the mask reads a tensor whose values are not known at compile "
                         "time (a padding mask): kept", describe(mask), code="mask.padding")
    if _size(q_len) != _size(kv_len) or interp.ranges[qs] != interp.ranges[ks]:
        return Rejection(f"q_len {q_len} ≠ kv_len {kv_len} (decoding with a cache): "
                         "is_causal would align the mask top-left, the cache needs "
                         "bottom-right", describe(mask), code="mask.cache_offset")
    n = interp.ranges[qs]
    terms = sp.And.make_args(m.expr)
    causal = [t for t in terms if _equivalent(_nonstrict(t), sp.Le(ks, qs))]
    if not causal:
        return Rejection(f"the mask {sp.sstr(m.expr)} has no k ≤ q term: not causal",
                         describe(mask), code="mask.not_causal")
    vertices = [{qs: 0, ks: 0}, {qs: n - 1, ks: 0}, {qs: n - 1, ks: n - 1}]
    steps = [f"mask[q, k] = {sp.sstr(m.expr)} with q, k ∈ [0, {n})"]
    for t in terms:
        if t in causal:
            continue
        if not isinstance(t, sp.core.relational.Relational) or not _linear(t, qs, ks):
            return Rejection(f"mask term {sp.sstr(t)} is not a linear position comparison",
                             describe(mask), code="mask.nonlinear_term")
        at = [sp.simplify(t.subs(v)) for v in vertices]
        if not all(x is sp.true for x in at):
            return Rejection(f"mask term {sp.sstr(t)} cuts into the causal triangle "
                             f"(at its vertices: {at}): a sliding window shorter than the "
                             "sequence, kept", describe(mask), code="mask.window")
        steps.append(f"{sp.sstr(t)} holds at the causal triangle's vertices (0,0), "
                     f"({n}-1,0), ({n}-1,{n}-1), so on all of it (a linear inequality)")
    given = ["the mask is built from position comparisons only (no padding input)",
             "it is the same for every batch and head (broadcast)",
             f"q_len = kv_len = {n} (no cache offset)"]
    if m.additive:
        given.append("an additive mask: 0 where attended, −inf or finfo.min elsewhere; "
                     "exp of the latter is exactly 0 and no row is all masked (the "
                     "diagonal is kept), so softmax(s + mask) = softmax over k ≤ q")
    return Proof("mask[q, k] ⟺ k ≤ q on [0, n)², n = q_len = kv_len: SDPA's is_causal",
                 tuple(given), tuple(steps))


def _nonstrict(t):
    """An integer comparison a < b as a ≤ b − 1 (a > b as a ≥ b + 1): the same set of
    index pairs (a − b is an integer), and the form the causal term is compared in, so
    that ``k < q + 1`` is recognised as ``k ≤ q`` (found by tests/test_property_mask.py).
    A comparison sympy cannot prove integral is left as it is."""
    if isinstance(t, sp.StrictLessThan) and (t.lhs - t.rhs).is_integer:
        return sp.Le(t.lhs, t.rhs - 1)
    if isinstance(t, sp.StrictGreaterThan) and (t.lhs - t.rhs).is_integer:
        return sp.Ge(t.lhs, t.rhs + 1)
    return t


def _equivalent(a, b) -> bool:
    return sp.simplify(sp.Equivalent(a, b)) is sp.true


def _linear(t, qs, ks) -> bool:
    d = t.lhs - t.rhs
    return all(sp.diff(d, s, 2) == 0 for s in (qs, ks)) and sp.diff(d, qs, ks) == 0
