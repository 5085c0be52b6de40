"""Rewrite: replace a proved match by calls of the fused ops.

The graph keeps every value it had before: the residual stream comes out of the fused
producer and replaces the residual add; each accepted consumer GEMM is replaced by a
row-scaled GEMM; the original norm nodes are left where they were and removed only if
nothing reads them any more. So a normalised tensor that is also returned, or read by
something that is not a GEMM, is still computed exactly as eager computes it
(materialised), and every other reader of the region is untouched.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .algebra.row_scale import mutated_value, replay_chain
from .canonical import meta, under_autocast
from .capture import describe
from .kernels import ops, relayout
from .patterns import residual_rmsnorm


def _copy_meta(new: fx.Node, old: fx.Node) -> None:
    for key in ("nn_module_stack", "source_fn_stack", "stack_trace"):
        if key in old.meta:
            new.meta[key] = old.meta[key]


def _cast_for_gemm(graph: fx.Graph, linear: fx.Node, *tensors):
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


def _results(graph: fx.Graph, call: fx.Node, n: int, like: fx.Node) -> list[fx.Node]:
    outs = []
    for i in range(n):
        g = graph.call_function(operator.getitem, (call, i))
        _copy_meta(g, like)
        outs.append(g)
    return outs


def _same_meta(new: fx.Node, like: fx.Node) -> None:
    """``new`` holds a tensor of ``like``'s shape and dtype (h2 = z·γ has the normalised
    value's): later matchers read shapes and dtypes from the meta."""
    if meta(like) is not None:
        new.meta["example_value"] = meta(like)


def _graph_replay(graph: fx.Graph):
    """``like`` / ``call`` for replay_chain that build graph nodes."""
    def like(node, src, x):
        return graph.node_copy(node, lambda n: x if n is src else n)

    def call(fn, *args):
        return graph.call_function(fn, args)

    return like, call


def erase_if_dead(graph: fx.Graph, nodes) -> None:
    """Erase the given nodes once nothing reads them, then whatever only they read
    (the transpose under ``x @ w.T``, the upcast before a norm), never a graph input,
    an impure node or one that updates a value in place."""
    todo = list(nodes)
    while todo:
        n = todo.pop()
        if getattr(n, "_erased", False) or n.users or n.op in ("placeholder", "output", "get_attr") \
                or n.is_impure() or mutated_value(n) is not None:
            continue
        inputs = list(n.all_input_nodes)
        graph.erase_node(n)
        todo.extend(inputs)


def apply(graph: fx.Graph, match, accepted_consumers):
    """Rewrite one match in place. Returns the original norm's nodes that are still
    alive (materialised for readers that are not rewritten) and {replaced: replacement}."""
    replacements: dict[fx.Node, fx.Node] = {}
    norm, prod = match.norm, match.producer
    text = match.norm_program.to_text()
    gamma = residual_rmsnorm.norm_operands(norm)
    if prod is not None:
        with graph.inserting_before(prod.add):
            x, w, *b = _cast_for_gemm(graph, prod.linear, prod.x, prod.weight,
                                      *([prod.bias] if prod.bias is not None else []))
            call = graph.call_function(ops.fused_linear, (text, x, w, *b, prod.residual, *gamma))
            _copy_meta(call, prod.linear)
            z, h2, r = _results(graph, call, 3, norm.output)
            _same_meta(h2, norm.output)
        prod.add.replace_all_uses_with(z)
        replacements[prod.add] = z
        z.meta.update({k: v for k, v in prod.add.meta.items() if k not in z.meta})
    else:
        with graph.inserting_before(norm.output.next):
            call = graph.call_function(ops.fused_rowwise, (text, norm.input, *gamma))
            _copy_meta(call, norm.output)
            h2, r = _results(graph, call, 2, norm.output)
            _same_meta(h2, norm.output)

    for c in accepted_consumers:
        program = match.consumer_programs[c.linear].to_text()
        with graph.inserting_before(c.linear):
            h2c, rc, scale, shift = replay_chain(c.chain, norm.output, norm.dim, h2, r,
                                                 *_graph_replay(graph))
            weight, bias = c.weight, c.bias
            if scale is not None:  # a per-feature factor, folded into the live weights
                weight = graph.call_function(ops.fold_scale, (c.weight, scale))
            if shift is not None:  # a bias after the norm, distributed: shift·Wᵀ (+ b)
                bias = graph.call_function(ops.distribute_bias, (shift, c.weight, c.bias))
            x, w, *b = _cast_for_gemm(graph, c.linear, h2c, weight,
                                      *([bias] if bias is not None else []))
            call = graph.call_function(ops.fused_linear, (program, x, w, rc, *b))
            _copy_meta(call, c.linear)
            (out,) = _results(graph, call, 1, c.linear)
        out.meta.update({k: v for k, v in c.linear.meta.items() if k not in out.meta})
        c.linear.replace_all_uses_with(out)
        replacements[c.linear] = out
        graph.erase_node(c.linear)
        erase_if_dead(graph, c.chain)

    dead_candidates = [*norm.nodes]
    if prod is not None:
        dead_candidates += [prod.add, prod.linear]
    erase_if_dead(graph, dead_candidates)
    alive = {n for n in graph.nodes}
    return [n for n in norm.nodes if n in alive], replacements


def _relayout(graph: fx.Graph, kind: str, layout: tuple, *sources) -> fx.Node:
    """A re-layout (kernels/ops.py) as a graph op, recomputed on every call."""
    fn = getattr(ops, kind)
    return graph.call_function(fn, (layout, *sources) if kind == "rope_segments" else sources)


def _relaid_gemm(graph: fx.Graph, m, text: str, linear: fx.Node, x: fx.Node, kind: str,
                 layout: tuple, weights: tuple, r: list, biases: list, rest: list) -> fx.Node:
    """The fused GEMM over a re-layout of ``weights``, its operands the row scale ``r``,
    the (re-laid) ``biases`` and the ``rest`` (a rotation's float32 angles: not cast to
    the GEMM's dtype). The re-layout is recomputed in the graph, or kept inside the op
    between calls (kernels/relayout.py; m.cache_relayouts); biases are re-laid in the
    graph either way (small)."""
    if m.cache_relayouts:
        x, *biases = _cast_for_gemm(graph, linear, x, *biases)
        return graph.call_function(relayout.fused_linear_relaid, (
            text, x, kind, relayout.spec_of(layout), list(weights), *r, *biases, *rest))
    w = _relayout(graph, kind, layout, *weights)
    x, w, *biases = _cast_for_gemm(graph, linear, x, w, *biases)
    return graph.call_function(ops.fused_linear, (text, x, w, *r, *biases, *rest))


def apply_gated(graph: fx.Graph, m) -> fx.Node:
    """Replace act(gate)·up by one GEMM over the interleaved weights (see
    patterns/gated_mlp.py); returns the fused call."""
    g, u = m.gate, m.up
    text = m.program.to_text()
    with graph.inserting_before(m.mul):
        if m.packed:
            kind, weights, biases = "interleave_halves", (g.weight,), (g.bias,)
        else:
            kind, weights, biases = "interleave_rows", (g.weight, u.weight), (g.bias, u.bias)
        b = [_relayout(graph, kind, (), *biases)] if any(t is not None for t in biases) else []
        r = [g.r] if g.r is not None else []
        call = _relaid_gemm(graph, m, text, g.out, g.x, kind, (), weights, r, b, [])
        _copy_meta(call, m.mul)
        out = _results(graph, call, 1, m.mul)[0]
    out.meta.update({k: v for k, v in m.mul.meta.items() if k not in out.meta})
    m.mul.replace_all_uses_with(out)
    erase_if_dead(graph, [m.mul, m.act, *m.intermediates, *g.nodes, *u.nodes])
    return call


def apply_cross_entropy(graph: fx.Graph, m) -> None:
    """Replace logits GEMM → cross_entropy by the fused GEMM's per-row losses and the
    reduction (see patterns/cross_entropy.py)."""
    p = m.proj
    text = m.program.to_text()
    vocab = int(meta(p.out).shape[-1])
    dim, start, stop = m.row_slice if m.row_slice is not None else (None, None, None)
    with graph.inserting_before(m.ce):
        x, w, *b = _cast_for_gemm(graph, p.out, p.x, p.weight,
                                  *([p.bias] if p.bias is not None else []))
        t = graph.call_function(ops.row_targets, (m.target, x, vocab, dim, start, stop,
                                                  m.ignore_index))
        r = [p.r] if p.r is not None else []
        call = graph.call_function(ops.fused_linear, (text, x, w, *r, *b, t))
        _copy_meta(call, m.ce)
        outs = _results(graph, call, len(m.program.outputs), m.ce)
        loss = graph.call_function(ops.cross_entropy_from_rows, (
            outs[-2], t, m.ignore_index, m.reduction, x, dim, start, stop, meta(m.ce).dtype))
        _copy_meta(loss, m.ce)
        if not m.materialise and m.logits_readers:
            empty = graph.call_function(ops.unmaterialised_logits, (x,))
    loss.meta.update({k: v for k, v in m.ce.meta.items() if k not in loss.meta})
    m.ce.replace_all_uses_with(loss)
    for reader in m.logits_readers:
        reader.replace_input_with(p.out, outs[0] if m.materialise else empty)
    erase_if_dead(graph, [m.ce, *m.chain, *p.nodes])


def _shared_call(graph: fx.Graph, fn, args, anchor: fx.Node, same=None) -> fx.Node:
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


def _same_rows(pos: fx.Node, x: fx.Node):
    """A rope_positions call on the same positions for GEMM rows of the same shape (x is
    read for its leading shape only)."""
    def same(n):
        mx, other = meta(x), meta(n.args[1])
        return n.args[0] is pos and mx is not None and other is not None \
            and mx.shape[:-1] == other.shape[:-1]
    return same


def apply_rope(graph: fx.Graph, m) -> fx.Node:
    """Replace q/k projections + rotation (and v's projection) by one GEMM with a
    rotating epilogue (see patterns/rope.py); eager's feature order is put back on the
    edges the escape analysis named (algebra/rope.py). Returns the fused call."""
    from .algebra import rope as rope_algebra
    from .patterns import rope as rope_pattern

    lay = rope_algebra.layout(m)
    # the fused GEMM goes right after the last value it reads, which must precede every
    # reader of what it replaces: values computed later (TorchTitan's table, made complex
    # inside the rotation of q, after v's reshape) are moved up if they are pure
    p = m.proj
    reads = [p.x, p.r, *(s.proj.weight for s in m.segments), *(s.proj.bias for s in m.segments),
             *((m.table,) if m.form == "pairs" else (m.angle.cos, m.angle.sin)
               if m.angle_source == "table" else (m.angle.inv_freq, m.angle.pos))]
    # the head split (view, transpose) is rebuilt on the fused GEMM's output: its other
    # arguments (sizes, symbolic under dynamic shapes) must be defined before it too
    reads += [a for r in m.rotated for node in r.split for a in node.all_input_nodes
              if a is not node.args[0]]
    reads = [n for n in reads if isinstance(n, fx.Node)]
    readers = [u for r in m.rotated for u in r.out.users] + \
        [u for s in m.passthrough for u in s.column_node.users]
    if readers:
        order = {n: i for i, n in enumerate(graph.nodes)}
        hoist_before(min(readers, key=order.__getitem__), reads)
    order = {n: i for i, n in enumerate(graph.nodes)}
    anchor = max(reads, key=order.__getitem__).next
    if m.angle_source == "angles":
        freq = _shared_call(graph, ops.rope_frequencies, (m.angle.inv_freq, lay), anchor)
    with graph.inserting_before(anchor):
        b = [_relayout(graph, "rope_segments", lay, *(s.proj.bias for s in m.segments))] \
            if rope_pattern.has_bias(m) else []
        x = p.x  # read for its leading shape only
        if m.angle_source == "angles":
            angle = [_shared_call(graph, ops.rope_positions, (m.angle.pos, x), anchor,
                                  _same_rows(m.angle.pos, x)), freq]
            if rope_pattern.scaled(m):  # a per-column float32 scale before the rotation
                angle.insert(0, graph.call_function(ops.rope_column_scale,
                                                    (m.angle.scale, lay, x)))
        else:
            if m.form == "half":
                rot = m.rotated[0]
                angle = [graph.call_function(ops.rope_half_table_rows, (
                    m.angle.cos, m.angle.sin, x, rot.head_dim, rot.rotary_dim))]
            else:
                angle = [graph.call_function(ops.rope_table_rows, (m.table, x))]
            if m.passthrough:
                spans = rope_algebra.rotated_spans(m)
                angle.append(_shared_call(graph, ops.rope_rotated_columns, (spans, x), anchor,
                                          lambda n: n.args[0] == spans))
        r = [p.r] if p.r is not None else []
        weights = tuple(s.proj.weight for s in m.segments)
        call = _relaid_gemm(graph, m, m.program.to_text(), p.out, p.x, "rope_segments", lay,
                            weights, r, b, angle)
        _copy_meta(call, m.rotated[0].out)
        y = _results(graph, call, 1, m.rotated[0].out)[0]
        at, new_outs = 0, []
        for s in m.segments:
            n = s.columns[1] - s.columns[0]
            piece = graph.call_function(operator.getitem, (y, (Ellipsis, slice(at, at + n))))
            _same_meta(piece, s.column_node)
            at += n
            if isinstance(s, rope_pattern.Rotated):
                v = piece
                for node in reversed(s.split):  # view, then transpose, onto the piece
                    src = node.args[0]
                    v = graph.node_copy(node, lambda a, src=src, v=v: v if a is src else a)
                    _same_meta(v, node)
                new_outs.append(v)
                s.out.replace_all_uses_with(v)
            else:
                s.column_node.replace_all_uses_with(piece)
    for s in m.remainders:  # what else a packed projection held: its own GEMM
        with graph.inserting_before(s.column_node):
            s.column_node.replace_all_uses_with(_column_gemm(graph, s))
    region = rope_algebra.permuted_region(new_outs) if m.form == "half" else \
        rope_algebra.Region(set(), [], [])
    rot = m.rotated[0]
    for consumer, value in region.unpermute:
        with graph.inserting_before(consumer):
            back = graph.call_function(ops.rope_unpermute, (value, rot.head_dim, rot.rotary_dim))
        _same_meta(back, value)
        consumer.replace_input_with(value, back)
    m.region = region
    erase_if_dead(graph, [n for r in m.rotated for n in (r.out, *r.nodes, *r.split)]
                  + [n for s in (*m.segments, *m.remainders)
                     for n in (s.column_node, *s.proj.nodes)])
    return call


class NotPlaceable(ValueError):
    """No place in the graph for a fused call; raised before the graph changes, so the
    pipeline leaves the match as it is and reports why."""


def hoist_before(first: fx.Node, needed: list[fx.Node]) -> None:
    """Move the ``needed`` values that are computed at or after ``first``, with what they
    are computed from, to just before it (graph order kept among them). Only pure nodes
    move; anything else raises NotPlaceable before the graph is touched."""
    order = {n: i for i, n in enumerate(first.graph.nodes)}
    late, stack = set(), [n for n in needed if order[n] >= order[first]]
    while stack:
        n = stack.pop()
        if n in late:
            continue
        if n is first or n.op not in ("call_function", "call_method", "get_attr") or \
                n.is_impure() or mutated_value(n) is not None:
            raise NotPlaceable(f"the fused GEMM reads {describe(n)}, which is computed after "
                             f"{describe(first)} reads its outputs and cannot move up")
        late.add(n)
        stack += [a for a in n.all_input_nodes if order[a] >= order[first]]
    for n in sorted(late, key=order.__getitem__):
        first.prepend(n)


def _column_gemm(graph: fx.Graph, s) -> fx.Node:
    """Columns [lo, hi) of a projection as a GEMM of their own: the weight's (and bias's)
    rows sliced from the live parameters; a rewritten norm consumer keeps its program."""
    lo, hi = s.columns
    p = s.proj
    w = graph.call_function(operator.getitem, (p.weight, slice(lo, hi)))
    b = [graph.call_function(operator.getitem, (p.bias, slice(lo, hi)))] \
        if p.bias is not None else []
    call = next((n for n in p.nodes if n.target is ops.fused_linear), None)
    if call is None:
        out = graph.call_function(torch._C._nn.linear, (p.x, w, *(b or [None])))
    else:
        x, _, r, *_ = call.args[1:]
        new = graph.call_function(ops.fused_linear, (call.args[0], x, w, r, *b))
        _copy_meta(new, call)
        out = graph.call_function(operator.getitem, (new, 0))
    _same_meta(out, s.column_node)
    return out
