"""Graph utilities every rewrite family shares: what a node reads and updates, values
known equal, moving and erasing nodes, building the fused calls' results. Nothing here
knows a family; each family's graph code sits in its own patterns/ module."""

from __future__ import annotations

import dataclasses
import functools
import operator

import torch
import torch.fx as fx

from .canonical import canon, canon_name, meta, under_autocast
from .capture import describe

# A matrix product however spelled (``@``, torch.matmul, a batched bmm).
MATMUL = {operator.matmul, torch.matmul, torch.bmm, "matmul", "bmm"}
CHUNK = {torch.chunk, "chunk"}
SPLIT = {torch.split, "split"}  # torch.split is torch.functional.split


# kernels/ops.fused_linear carries this attribute: analysis code recognises the fused
# GEMMs earlier rewrites made without importing the runtime.
FUSED_LINEAR_MARK = "_coda_fused_linear"


# Every function the rewritten graph calls on the model's [*lead, K] activations that
# flattens them to the op's 2-D form and reshapes its results back (kernels/ops.py,
# kernels/relayout.py) carries this attribute: the index of its first program operand
# (the x it flattens is argument 1; fused_rowwise has none: its first tile operand).
# row_chains.py hands such calls each other their results in the 2-D form.
ROW_CALL_MARK = "_coda_row_call"


def row_call(node) -> int | None:
    """The index of the first program operand of a fused row call, or None."""
    if isinstance(node, fx.Node) and node.op == "call_function":
        return getattr(node.target, ROW_CALL_MARK, None)
    return None


def indexed_results(call: fx.Node) -> list[tuple[int, fx.Node]] | None:
    """(index, getitem node) of every use of ``call``; None if a use is anything else."""
    out = []
    for user in call.users:
        if user.op != "call_function" or user.target is not operator.getitem or \
                not isinstance(user.args[1], int):
            return None
        out.append((user.args[1], user))
    return out


def fused_linear_call(node) -> bool:
    """``node`` calls kernels/ops.fused_linear (program, x, weight, *operands)."""
    return isinstance(node, fx.Node) and node.op == "call_function" and \
        getattr(node.target, FUSED_LINEAR_MARK, False)


class NotPlaceable(ValueError):
    """No place in the graph for a fused call; raised before the graph changes, so the
    pipeline leaves the match as it is and reports why."""


# ---- what a node reads and updates ------------------------------------------------------

_INPLACE_FUNCTIONS = {operator.setitem, operator.iadd, operator.isub, operator.imul,
                      operator.itruediv, operator.ipow, operator.ifloordiv, operator.imod,
                      operator.iand, operator.ior, operator.ixor, operator.ilshift,
                      operator.irshift, operator.imatmul}
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
        if getattr(node.target, "__module__", None) in ("_operator", "operator"):
            return None  # operator.and_ / or_ / not_ are named like in-place ops, and are not
        name = getattr(node.target, "__name__", "")
        if name.endswith("_") and not name.endswith("__") and name != "requires_grad_":
            return node.args[0]
        if "out" in node.kwargs and isinstance(node.kwargs["out"], fx.Node):
            return node.kwargs["out"]
    return None


def in_place_updates(values: set[fx.Node], graph: fx.Graph):
    """(the node, the value it updates) of every update in place, anywhere in ``graph``,
    of memory one of ``values`` may share (a view of it, the tensor it is a view of,
    that tensor's other views), in graph order."""
    watched = memory_sharers(values)
    for node in graph.nodes:
        target = mutated_value(node)
        if target is not None and target in watched:
            yield node, target


def in_place_update_of(values: set[fx.Node], graph: fx.Graph
                       ) -> tuple[fx.Node, fx.Node] | None:
    """The first of ``in_place_updates``; None where nothing updates them."""
    return next(in_place_updates(values, graph), None)


def _copying_index(node: fx.Node) -> bool:
    """``x[index]`` with a tensor of one or more dims in the index: advanced indexing,
    which copies (a gather of rows), not a view. (A 0-d integer tensor indexes like an
    int, into a view: ``x[torch.tensor(1)]`` shares x's memory.)"""
    idx = node.args[1] if len(node.args) > 1 else None
    parts = idx if isinstance(idx, (tuple, list)) else (idx,)
    return any(isinstance(p, fx.Node) and meta(p) is not None and meta(p).dim() >= 1
               for p in parts)


def _viewlike(u: fx.Node) -> bool:
    """``u`` may return a view of its first argument."""
    return (u.op == "call_method" and u.target in _ALIASING_METHODS) or (
        u.op == "call_function" and (
            (u.target is operator.getitem and not _copying_index(u)) or
            getattr(u.target, "__name__", "") in _ALIASING_METHODS or
            _returns_alias(u.target))) \
        or (u.op == "call_function" and u.target is getattr)


def _returns_alias(target) -> bool:
    """An aten op called directly whose schema (in some overload) returns an alias of an
    input that it does not write: a view. torch 2.14's dynamo records the tensor
    properties that way (w.T as aten.numpy_T(w), k.mT as aten.mT(k)), where it recorded
    getattr before; counting an op as a view is the safe side (more values watched)."""
    return isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)) and \
        _schema_returns_alias(target)


@functools.lru_cache(maxsize=None)
def _schema_returns_alias(op) -> bool:
    overloads = [op] if isinstance(op, torch._ops.OpOverload) else \
        [getattr(op, name) for name in op.overloads()]
    return any(r.alias_info is not None and not r.alias_info.is_write
               for overload in overloads for r in overload._schema.returns)


# Ops whose result never requires grad, whatever the grad mode: a detach, and factories
# shaped like their input
_NEVER_RECORDED = {"detach", "zeros_like", "ones_like", "empty_like", "full_like",
                   "rand_like", "randn_like", "randint_like", "new_zeros", "new_ones",
                   "new_empty", "new_full", "new_tensor"}


def recorded(node: fx.Node) -> bool | None:
    """Whether autograd recorded ``node`` when dynamo traced it, as its traced values tell:
    True where a tensor input requires grad and its floating result does too, False
    where one does and its result does not (the node ran in a torch.no_grad() region
    inside the graph), None where nothing tells (no input requires grad, a result that is
    not a float tensor, an op that never records: a detach, a *_like factory; a view or
    a cast, whose result requires grad under no_grad too). A result of a multi-output op
    (getitem of a fused call an earlier rewrite made) is read against that op's inputs."""
    if node.op not in ("call_function", "call_method", "call_module"):
        return None
    out = meta(node)
    if out is None or not out.is_floating_point():
        return None
    inputs = node.all_input_nodes
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node) and \
            meta(node.args[0]) is None:  # one result of a multi-output op (a fused call)
        inputs = node.args[0].all_input_nodes
    else:
        name = node.target if node.op == "call_method" else \
            getattr(node.target, "__name__", "")
        if name in _NEVER_RECORDED or _viewlike(node) or canon_name(node) == "cast":
            return None  # a view, or a cast that may return its input, requires grad as
            #              its input does in either mode
    if not any(meta(a) is not None and meta(a).requires_grad for a in inputs):
        return None
    return bool(out.requires_grad)


def grad_modes_mixed(nodes) -> tuple[fx.Node, fx.Node] | None:
    """(a node autograd recorded, one it did not) among ``nodes``, or None: a match whose
    nodes straddle a torch.no_grad() region of the graph (Hugging Face's rotary embedding
    is one, a model's own ``with torch.no_grad():`` another). A rewrite computes a match's
    values in one place, so in one grad mode: the gradient would change (seen: a norm
    under no_grad whose row scale, deferred into a GEMM outside it, carried a gradient to
    the residual stream that eager does not)."""
    seen: dict[bool, fx.Node] = {}
    for n in nodes:
        r = recorded(n)
        if r is not None:
            seen.setdefault(r, n)
    return (seen[True], seen[False]) if len(seen) == 2 else None


def grad_mode_changed_along(nodes, graph: fx.Graph) -> tuple[fx.Node, fx.Node] | None:
    """(a node autograd recorded, a node of ``nodes`` downstream of it that runs in
    another grad mode), or None. The grad mode of each node is read from the graph's
    ``_set_grad_enabled`` calls (dynamo traces a ``with torch.no_grad():`` block into
    them), starting from the mode the pass runs in. A rewrite computes a match in one
    place: where a value the match replaces was computed under no_grad from a tensor that
    requires grad, and a node the match names reads it in grad mode (the loss after a
    no_grad LM head, the place the fused call goes), the fused call would record what
    eager did not. grad_modes_mixed sees only nodes whose own traced values tell; this
    sees the readers that do not (a loss whose input needs no gradient)."""
    mode, modes = torch.is_grad_enabled(), {}
    for n in graph.nodes:
        if n.op == "call_function" and n.target is torch._C._set_grad_enabled and \
                n.args and isinstance(n.args[0], bool):
            mode = n.args[0]
        modes[n] = mode
    if len(set(modes.values())) < 2:  # one mode throughout (most graphs): nothing to walk
        return None
    named = {n for n in nodes if n.op in ("call_function", "call_method", "call_module")}
    for e in named:
        if recorded(e) is None:
            continue
        todo, seen = [e], {e}
        while todo:
            for u in todo.pop().users:
                if u in seen:
                    continue
                seen.add(u)
                if u in named and modes.get(u, modes[e]) != modes[e]:
                    return e, u
                todo.append(u)
    return None


def gradient_read(value: fx.Node) -> bool:
    """Whether a gradient can reach ``value``: some path from it to the graph's output
    runs through results that require grad (a result that is not a tensor, or an update
    in place, is assumed to pass one). False where every path ends in a detach or in a
    result that needs no gradient: eager's autograd then never gives the GEMM that made
    ``value`` a gradient through it (its weight's .grad stays None)."""
    todo, seen = [value], {value}
    while todo:
        node = todo.pop()
        for u in node.users:
            if u.op == "output" or mutated_value(u) is not None:
                return True
            m = meta(u)
            if (m is not None and not m.requires_grad) or u in seen:
                continue
            seen.add(u)
            todo.append(u)
    return False


def aliases(values: set[fx.Node]) -> set[fx.Node]:
    """``values`` and every view that may share memory with them."""
    seen, todo = set(values), list(values)
    while todo:
        n = todo.pop()
        for u in n.users:
            if _viewlike(u) and u.args and u.args[0] is n and u not in seen:
                seen.add(u)
                todo.append(u)
    return seen


def memory_sharers(values: set[fx.Node]) -> set[fx.Node]:
    """Every value that may share memory with one of ``values``: the tensors they are
    views of (up to the first that is not a view), and every view of those. What a read
    moved later than eager's must watch: an update in place of the base of a view
    changes the view too (``aliases`` alone looks at views of the values only)."""
    roots = set()
    for v in values:
        while isinstance(v.args[0] if v.args else None, fx.Node) and _viewlike(v):
            base = v.args[0]
            if meta(base) is None and not _viewlike(base):
                break  # an element of a tuple a non-view op returned (sort's values)
            v = base
        roots.add(v)
    return aliases(roots | set(values))


def updated_between(values, first: fx.Node, last: fx.Node
                    ) -> tuple[fx.Node, fx.Node] | None:
    """(node, value) of the first update in place, strictly between ``first`` and
    ``last`` (in either graph order), of memory one of ``values`` shares (memory_sharers):
    where a fused op reads ``values`` at another point of that span than eager did, such
    an update is read by one and not the other."""
    values = {v for v in values if isinstance(v, fx.Node)}
    if not values:
        return None
    watched = memory_sharers(values)
    ends, inside = {first, last}, False
    for node in first.graph.nodes:
        if node in ends:
            if inside or first is last:
                return None
            inside = True
            continue
        target = mutated_value(node) if inside else None
        if target is not None and target in watched:
            return node, target
    return None


def same_value(a, b, depth: int = 4) -> bool:
    """Two graph values known to be equal: the same node, or the same pure call on
    arguments that are (the norm rewrite casts each consumer's input separately under
    autocast; the plain Llama rebuilds view_as_complex(table) for q and for k)."""
    if a is b:
        return True
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
        return not isinstance(a, fx.Node) and not isinstance(b, fx.Node) and a == b
    if depth == 0 or a.op != b.op or a.op not in ("call_function", "call_method") \
            or a.target != b.target or a.is_impure() or len(a.args) != len(b.args) \
            or a.kwargs != b.kwargs:
        return False
    return all(same_value(x, y, depth - 1) for x, y in zip(a.args, b.args))


def through_casts(node):
    """(the value under any casts, whether one of them changed the dtype)."""
    changed = False
    while isinstance(node, fx.Node) and canon(node) is not None and canon(node).name == "cast":
        src = node.args[0]
        if meta(src) is None or meta(src).dtype != meta(node).dtype:
            changed = True
        node = src
    return node, changed


def chunk_half(node: fx.Node) -> tuple[fx.Node, int] | None:
    """(the split node, index) for half ``index`` (0 or 1) of a value's last dim cut in
    two equal halves (splits_in_halves): ``t.chunk(2, dim=-1)[index]``, or
    ``t.split(n, dim=-1)[index]`` / ``t.split([n, n], dim=-1)[index]`` where the last dim
    is 2n (Phi-3's gate_up read by chunk, others' by split: the same two halves)."""
    if node.op != "call_function" or node.target is not operator.getitem:
        return None
    ch, idx = node.args
    if not isinstance(ch, fx.Node) or idx not in (0, 1) or isinstance(idx, bool):
        return None
    return (ch, idx) if splits_in_halves(ch) else None


def splits_in_halves(ch) -> bool:
    """Whether ``ch`` cuts its input's last dim in two equal halves: ``chunk(2, -1)``, or
    ``split(n, -1)`` / ``split([n, n], -1)`` of a 2n-wide value (a static width: a
    symbolic one is not read as halves)."""
    if not isinstance(ch, fx.Node) or not ch.args or not isinstance(ch.args[0], fx.Node):
        return False
    src = meta(ch.args[0])
    if src is None or src.dim() == 0:
        return False
    if ch.target in CHUNK:
        halves, dim = arg(ch, 1, "chunks") == 2, arg(ch, 2, "dim", 0)
    elif ch.target in SPLIT:
        sizes = arg(ch, 1, "split_size_or_sections", arg(ch, 1, "split_size"))
        dim, width = arg(ch, 2, "dim", 0), src.shape[-1]
        if not isinstance(width, int):
            halves = False
        elif isinstance(sizes, (list, tuple)):
            halves = len(sizes) == 2 and sizes[0] == sizes[1] and 2 * sizes[0] == width
        else:
            halves = isinstance(sizes, int) and 2 * sizes == width
    else:
        return False
    return halves and dim in (-1, src.dim() - 1)


def calls(node, targets) -> bool:
    """Whether ``node`` calls one of ``targets`` (functions or method names)."""
    return isinstance(node, fx.Node) and node.op in ("call_function", "call_method") \
        and node.target in targets


def swaps_heads(node) -> bool:
    """Whether ``node`` swaps dims 1 and 2 of a 4-d value, and nothing else: the heads'
    ``transpose(1, 2)`` ([b, s, h, d] <-> [b, h, s, d]), or ``permute(0, 2, 1, 3)`` (what
    einops' ``rearrange(t, 'b n (h d) -> b h n d')`` traces to)."""
    x = node.args[0] if isinstance(node, fx.Node) and node.args else None
    if not isinstance(x, fx.Node) or meta(x) is None or meta(x).dim() != 4:
        return False
    if calls(node, {"transpose", torch.transpose}):
        dims = (arg(node, 1, "dim0"), arg(node, 2, "dim1"))
        return all(isinstance(d, int) for d in dims) and sorted(d % 4 for d in dims) == [1, 2]
    if calls(node, {"permute", torch.permute}):
        dims = node.args[1:]
        dims = list(dims[0]) if len(dims) == 1 and isinstance(dims[0], (list, tuple)) \
            else list(dims)
        dims = node.kwargs.get("dims", dims)
        return len(dims) == 4 and all(isinstance(d, int) for d in dims) and \
            [d % 4 for d in dims] == [0, 2, 1, 3]
    return False


def arg(node: fx.Node, i: int, name: str, default=None):
    """A call's argument by position ``i`` or keyword ``name``."""
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def sort_permutation(node) -> bool:
    """Whether ``node`` is the indices of a sort of a 1-D tensor (``sort(v)[1]``, torch's
    or the method, or ``argsort(v)``): a permutation of v's positions, whatever v holds."""
    if not isinstance(node, fx.Node):
        return False
    if node.target is operator.getitem and node.args[1] == 1:
        src = node.args[0]
        ok = isinstance(src, fx.Node) and src.target in (torch.sort, "sort")
    else:
        src, ok = node, node.target in (torch.argsort, "argsort")
    if not ok or arg(src, 1, "dim", -1) not in (0, -1):
        return False
    v = src.args[0]
    return isinstance(v, fx.Node) and meta(v) is not None and meta(v).dim() == 1


def sole_user(node: fx.Node) -> fx.Node | None:
    """The one node that reads ``node``; None where none or several do."""
    users = list(node.users)
    return users[0] if len(users) == 1 else None


# ---- building and placing nodes --------------------------------------------------------

def copy_meta(new: fx.Node, old: fx.Node) -> None:
    for key in ("nn_module_stack", "source_fn_stack", "stack_trace"):
        if key in old.meta:
            new.meta[key] = old.meta[key]


def cast_for_gemm(graph: fx.Graph, linear: fx.Node, *tensors):
    """Where eager's GEMM ran under autocast in another dtype than its inputs, cast the
    operands as autocast would have: the fused op computes in its operands' dtype.
    Without autocast nothing is cast (a graph whose GEMM would mix dtypes raises in
    eager, and the pipeline leaves it as captured: canonical.gemm_eager_rejects)."""
    if not under_autocast(linear):
        return list(tensors)
    target = meta(linear).dtype
    out = []
    for t in tensors:
        m = meta(t)
        if isinstance(t, fx.Node) and (m is None or m.dtype != target):
            t = graph.call_method("to", (t, target))  # a no-op where it already is
        out.append(t)
    return out


def results(graph: fx.Graph, call: fx.Node, n: int, like: fx.Node) -> list[fx.Node]:
    outs = []
    for i in range(n):
        g = graph.call_function(operator.getitem, (call, i))
        copy_meta(g, like)
        outs.append(g)
    return outs


def same_meta(new: fx.Node, like: fx.Node) -> None:
    """``new`` holds a tensor of ``like``'s shape and dtype (h2 = z·γ has the normalised
    value's): later matchers read shapes and dtypes from the meta."""
    if meta(like) is not None:
        new.meta["example_value"] = meta(like)


def graph_replay(graph: fx.Graph):
    """``like`` / ``call`` for replay_chain that build graph nodes."""
    def like(node, src, x):
        return graph.node_copy(node, lambda n: x if n is src else n)

    def call(fn, *args):
        return graph.call_function(fn, args)

    return like, call


def shared_call(graph: fx.Graph, fn, args, anchor: fx.Node, same=None) -> fx.Node:
    """``fn(*args)``, reusing an equivalent call earlier in the graph (``same(node)``;
    default: the same arguments): the per-column frequencies and each row's position are
    the same for every layer of one graph."""
    same = same or (lambda n: n.args == tuple(args))
    for n in graph.nodes:
        if n is anchor:
            break
        if n.op == "call_function" and n.target is fn and same(n):
            return n
    with graph.inserting_before(anchor):
        return graph.call_function(fn, tuple(args))


def erase_if_dead(graph: fx.Graph, nodes) -> None:
    """Erase the given nodes once nothing reads them, then whatever only they read
    (the transpose under ``x @ w.T``, the upcast before a norm), never a graph input,
    an impure node or one that updates a value in place."""
    todo = list(nodes)
    while todo:
        n = todo.pop()
        if getattr(n, "_erased", False) or n.users or \
                n.op in ("placeholder", "output", "get_attr") or n.is_impure() or \
                mutated_value(n) is not None:
            continue
        inputs = list(n.all_input_nodes)
        graph.erase_node(n)
        todo.extend(inputs)


def grad_modes(graph: fx.Graph) -> dict[fx.Node, bool | None]:
    """The grad mode each node runs in, as the graph itself sets it (dynamo records a
    ``torch.no_grad()`` block inside the captured code as torch._C._set_grad_enabled
    calls, the last of them putting back the mode it was traced in: the caller's): the
    argument of the last such call before the node; before any, the caller's mode (the
    last call's argument; None in a graph that sets none)."""
    toggles = [n for n in graph.nodes
               if n.op == "call_function" and n.target is torch._C._set_grad_enabled]
    mode = bool(toggles[-1].args[0]) if toggles else None
    out = {}
    for n in graph.nodes:
        out[n] = mode
        if n in toggles:
            mode = bool(n.args[0])
    return out


def anchor_in_mode_of(anchor: fx.Node, limit: fx.Node | None, like: fx.Node) -> fx.Node:
    """The first node from ``anchor`` on, up to ``limit`` (inclusive; None: the graph's
    end), that runs in ``like``'s grad mode: a node inserted before it is computed as
    ``like`` was. A fused op placed inside a ``no_grad`` block the model opened for
    something else (Hugging Face's cache bookkeeping) would compute no gradient: silent
    wrong gradients. NotPlaceable where no such node is in reach."""
    modes = grad_modes(anchor.graph)
    node = anchor
    while True:
        if modes[node] == modes[like]:
            return node
        if node is limit or node.op == "output":
            raise NotPlaceable(f"no place after the values it reads runs in the grad mode "
                               f"{describe(like)} is computed in (a no_grad block in "
                               "between)")
        node = node.next


def _reads_grad(node: fx.Node) -> bool:
    """Whether moving ``node`` into another grad mode could change its result: an input
    requires grad (or its metadata is unknown)."""
    for a in node.all_input_nodes:
        m = meta(a)
        if m is None or getattr(m, "requires_grad", False):
            return True
    return False


def hoist_before(first: fx.Node, needed: list[fx.Node]) -> None:
    """Move the ``needed`` values that are computed at or after ``first``, with what they
    are computed from, to just before it (graph order kept among them). Only pure nodes
    move; anything else raises NotPlaceable before the graph is touched."""
    order = {n: i for i, n in enumerate(first.graph.nodes)}
    modes = grad_modes(first.graph)
    late, stack = set(), [n for n in needed if order[n] >= order[first]]
    while stack:
        n = stack.pop()
        if n in late:
            continue
        if n is first or n.op not in ("call_function", "call_method", "get_attr") or \
                n.is_impure() or mutated_value(n) is not None or \
                (modes[n] != modes[first] and _reads_grad(n)):
            raise NotPlaceable(f"the fused GEMM reads {describe(n)}, which is computed after "
                             f"{describe(first)} reads its outputs and cannot move up")
        late.add(n)
        stack += [a for a in n.all_input_nodes if order[a] >= order[first]]
    for n in sorted(late, key=order.__getitem__):
        first.prepend(n)


def graph_nodes_of(obj, seen=None) -> list[fx.Node]:
    """The graph nodes a match holds, in its dataclass fields at any depth."""
    seen = set() if seen is None else seen
    if isinstance(obj, fx.Node):
        return [obj]
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        items = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    elif isinstance(obj, (list, tuple, set, frozenset)):
        items = list(obj)
    elif isinstance(obj, dict):
        items = [*obj.keys(), *obj.values()]
    else:
        return []
    return [n for item in items for n in graph_nodes_of(item, seen)]


class TracedEmitter:
    """Graph nodes whose fake values are computed as they are made (later families read
    shapes and dtypes from them), under the grad mode of what they replace; inserted
    where the graph's insertion point is."""

    def __init__(self, graph: fx.Graph, like: fx.Node):
        self.graph, self.like = graph, like
        # the mode dynamo traced the graph's values in (not the tracing context's: the
        # backend runs inside another)
        self.mode = meta(like).fake_mode
        self.grad = bool(meta(like).requires_grad)

    def _traced(self, node: fx.Node) -> fx.Node:
        copy_meta(node, self.like)

        def value(n):
            return n.meta.get("example_value", n.meta.get("val"))
        args = fx.node.map_arg(node.args, value)
        kwargs = fx.node.map_arg(node.kwargs, value)
        with self.mode, torch.set_grad_enabled(self.grad):
            if node.op == "call_method":
                out = getattr(args[0], node.target)(*args[1:], **kwargs)
            else:
                out = node.target(*args, **kwargs)
        node.meta["example_value"] = out
        return node

    def call(self, fn, *args, **kwargs) -> fx.Node:
        return self._traced(self.graph.call_function(fn, args, kwargs))

    def method(self, name: str, *args, **kwargs) -> fx.Node:
        return self._traced(self.graph.call_method(name, args, kwargs))

    def copy(self, node: fx.Node, copies: dict) -> fx.Node:
        return self._traced(self.graph.node_copy(node, lambda n: copies.get(n, n)))
