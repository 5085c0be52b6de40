"""Fused calls hand each other their results in the op's 2-D form.

Every fused call the rewritten graph makes (kernels/ops.fused_linear, its re-layout
twins in kernels/relayout.py, fused_rowwise) takes the model's [*lead, K] activations,
flattens them to the op's [M, K] contract and gives its results back as [*lead, N]
(per-row ones as [*lead, 1]). Where one fused call reads another's result (a Llama
layer: the norm producer's z, h2 and r go to the gated GEMM and the next producer) that
is a reshape back and a reshape out again per value: a tensor object each, 1-3 µs of
host time, paid on every call of a graph that runs as Python (optimize()'s; under
Inductor a view costs nothing and this pass is not run).

A fused call given a 2-D input already gives its results in the 2-D form (ops._linear:
lead (M,)). So this pass feeds a chain's first call its input as [M, K] (layouts.as_rows)
and every later call its producer's 2-D result; a value also read by anything else gets
its model shape back once, for those readers (layouts.from_rows), exactly as the call
gave it before. A tile or per-row operand no fused call produced (the residual stream
coming from the embedding) is flattened in the graph rather than inside the call: the
same reshape, and the call then comes wholly in the op's form, which ops.fused_linear
sends straight to its launch (its fast path).

Each value is the same elements in the same order (both reshapes are C order, and the
reshape back of a reshape is the reshape), in the same storage, so what reads or
updates it in place sees what it saw; a value something updates in place (itself or a
view of it) is left out all the same (_updated_in_place), and so is a call a user reads
other than by index (no result to swap).

A chain joins a result to a slot of its own kind only: a tile (or pair) result to the x or
a tile operand of the next call, a per-row result to a per-row operand, a norm's row
partials (deferred_rstd.py) to a row-partials operand.
"""

from __future__ import annotations

import torch.fx as fx

from .codegen import layouts
from .codegen.program import Kind, parse
from .graph_utils import indexed_results, memory_sharers, mutated_value, row_call

REPORT_LINE = "fused calls fed another's 2-D result, no reshape between them"


def _slot_kind(kind: Kind) -> str:
    """What a value of this kind fills: "per_row", "row_partials" (a norm's partials,
    deferred_rstd.py), or "tile" (tiles and pairs)."""
    return kind.value if kind in (Kind.PER_ROW, Kind.ROW_PARTIALS) else "tile"


def _slots(call: fx.Node, first: int):
    """(argument index, what it takes: _slot_kind) of every slot a chained value may
    fill: x (argument 1; fused_rowwise has none) and the program's tile, per-row and
    row-partials operands."""
    prog = parse(call.args[0])
    if first > 1:
        yield 1, "tile"
    for i, spec in enumerate(prog.operands):
        if spec.kind in (Kind.TILE, Kind.PER_ROW, Kind.ROW_PARTIALS) and \
                first + i < len(call.args):
            yield first + i, _slot_kind(spec.kind)


def _x(call: fx.Node, first: int) -> int:
    """The argument whose leading dims are the call's lead: x, or fused_rowwise's first
    tile operand."""
    if first > 1:
        return 1
    prog = parse(call.args[0])
    return first + next(i for i, s in enumerate(prog.operands) if s.kind == Kind.TILE)


def chain(graph: fx.Graph) -> int:
    """Feed fused calls each other's 2-D results; returns how many inputs now come
    without a reshape."""
    # a from_rows node -> (the 2-D value, its kind, the chain's lead node)
    flat: dict[fx.Node, tuple[fx.Node, str, fx.Node]] = {}
    fed = 0
    for call in list(graph.nodes):
        first = row_call(call)
        results = indexed_results(call) if first is not None else None
        if not results:
            continue
        prog = parse(call.args[0])
        x_at = _x(call, first)
        x = call.args[x_at]
        chained = x in flat and flat[x][1] == "tile"
        if not chained and not _worth_it(prog, results):
            continue
        args = list(call.args)
        with graph.inserting_before(call):
            lead = flat[x][2] if chained else graph.call_function(layouts.lead_of, (x,))
            for at, kind in _slots(call, first):
                got = flat.get(args[at])
                if got is not None and got[1] == kind:
                    args[at] = got[0]
                    fed += 1
                elif isinstance(args[at], fx.Node):  # the call's own reshape, made here:
                    # the call then comes in the op's form, its launch's fast path
                    args[at] = graph.call_function(
                        layouts.as_row_vector if kind == "per_row" else layouts.as_rows,
                        (args[at],))
        call.args = tuple(args)
        for index, item in results:
            kind = _slot_kind(prog.outputs[index].kind)
            with graph.inserting_after(item):
                back = graph.call_function(layouts.from_rows, (item, lead, kind == "per_row"))
            item.replace_all_uses_with(back, delete_user_cb=lambda user: user is not back)
            if not _updated_in_place(back):
                flat[back] = (item, kind, lead)
    _drop_unread(graph)
    return fed


def _updated_in_place(value: fx.Node) -> bool:
    """Whether anything updates ``value``, or memory it shares (a view of it), in place:
    such a value stays out of the chain (a reshape back that copied would not pass the
    update on to the calls reading the 2-D result; a metadata update, unsqueeze_, would
    change the lead the next call sees)."""
    shared = memory_sharers({value})
    return any(mutated_value(u) in shared for n in shared for u in n.users)


def _worth_it(prog, results) -> bool:
    """Whether a call whose x comes in the model's shape should give 2-D results: a
    result goes on to a fused call's slot of its kind (else the reshape out and the
    reshapes back are the ones the call makes itself)."""
    for index, item in results:
        kind = _slot_kind(prog.outputs[index].kind)
        for user in item.users:
            first = row_call(user)
            if first is not None and any(user.args[at] is item and takes == kind
                                         for at, takes in _slots(user, first)):
                return True
    return False


def _drop_unread(graph: fx.Graph) -> None:
    """Reshapes back (and leads) no reader is left for."""
    for node in reversed(list(graph.nodes)):
        if node.op == "call_function" and node.target in (layouts.from_rows, layouts.lead_of,
                                                          layouts.as_rows,
                                                          layouts.as_row_vector) \
                and not node.users:
            graph.erase_node(node)
