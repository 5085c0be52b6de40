"""The pass over one captured graph: for each rewrite family in the registry's order
(patterns/registry.py), find → decide → apply, recording every candidate.

The protocol each family implements is patterns/family.py. Everything shared lives here:
the match records (the report), options.patterns, the speed policies (size_policy.py,
training_policy.py: where a fusion does not pay, it is left, with the reason), a checker
that raises (it costs the rewrite, never the compile, and is recorded as the pass's own
bug; a graph surgery that raises after changing the graph undoes every rewrite of that
graph), the nodes rewrites replace (a later match may name them: Context.current),
graphs eager rejects, and activation-checkpointed regions (rewritten inside). After the
families, one change that is not a rewrite: SDPA outputs in graphs that may train on CUDA
hand their gradient to SDPA's backward in one layout (attention_grad_layout.py: a PyTorch
bug gives wrong gradients otherwise); in graphs that compute no gradient, a norm
producer hands its consumers its raw partials (deferred_rstd.py: no finaliser kernel;
in a graph AOTAutograd will trace, only where the producer's sizes are static); and in
graphs that run as Python (not handed to Inductor), fused calls hand each other their
results in the op's 2-D form (row_chains.py). Both are host time, no change of value.
"""

from __future__ import annotations

import copy
import dataclasses
import time

import torch.fx as fx

from . import (attention_grad_layout, canonical, deferred_rstd, row_chains, size_policy,
               training_policy)
from .algebra import locality, sharding
from .algebra.decision import RejectionKind
from .capture import describe, model_path
from .codegen.program import parse
from .graph_utils import NotPlaceable, grad_mode_changed_along, grad_modes_mixed, row_call
from .options import Options
from .patterns.family import Context, NoMatch
from .patterns.registry import FAMILIES
from .report import NOT_MATCHED, REJECTED, REWRITTEN, GraphReport, MatchRecord

def rewrite_graph(gm: fx.GraphModule, options: Options, index: int = 0) -> GraphReport:
    t0 = time.perf_counter()
    records: list[MatchRecord] = []
    texts = _rewrite_one(gm, options, records)
    for name, region in _checkpointed_regions(gm, records):
        sub = _rewrite_one(region, options, records)
        texts = (texts[0] + f"\n# checkpointed region {name}\n" + sub[0],
                 texts[1] + f"\n# checkpointed region {name} (recomputed in the backward)\n"
                 + sub[1], texts[2] + sub[2], texts[3] + sub[3], texts[4] + sub[4])
    guards = [f"{attention_grad_layout.REPORT_LINE}: {texts[2]} SDPA call(s)"] \
        if texts[2] else []
    host_path = [f"{row_chains.REPORT_LINE}: {texts[3]} input(s)"] if texts[3] else []
    if texts[4]:
        host_path.append(f"{deferred_rstd.REPORT_LINE}: {texts[4]} norm(s)")
    return GraphReport(index, records, texts[0], texts[1], time.perf_counter() - t0,
                       *_rank(), min_fused_rows=options.min_fused_rows, guards=guards,
                       host_path=host_path, host_programs=_unrecorded_programs(gm, records))


def _unrecorded_programs(gm: fx.GraphModule, records: list[MatchRecord]):
    """The programs the graph's fused calls run that no record holds (what a host step
    rewrote them into), so the report and the dump show every program that runs."""
    recorded = {p.to_text() for r in records for p in r.programs}
    texts = {n.args[0] for m in gm.modules() if isinstance(m, fx.GraphModule)
             for n in m.graph.nodes if row_call(n) is not None}
    return [parse(t) for t in sorted(texts - recorded)]


def _rank() -> tuple[int | None, int | None]:
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return None, None


# Dynamo captures activation checkpointing (torch.utils.checkpoint, Hugging Face's
# gradient_checkpointing_enable()) as this higher-order op over a subgraph module; the
# subgraph runs in the forward and again, recomputed, in the backward. Rewriting inside it
# rewrites both. Other higher-order ops' subgraphs are reported, not entered.
_CHECKPOINT_OP = "tag_activation_checkpoint"


def _checkpointed_regions(gm: fx.GraphModule, records: list[MatchRecord]):
    """(name, subgraph module) of every checkpointed region ``gm`` calls."""
    for node in gm.graph.nodes:
        if node.op != "call_function" or not node.args or \
                not isinstance(node.args[0], fx.Node) or node.args[0].op != "get_attr":
            continue
        sub = getattr(gm, node.args[0].target, None)
        if not isinstance(sub, fx.GraphModule):
            continue
        op = getattr(node.target, "__name__", str(node.target))
        if op == _CHECKPOINT_OP:
            yield node.args[0].target, sub
        else:
            records.append(MatchRecord(
                "graph", model_path(node), NOT_MATCHED, code="graph.subgraph_not_entered",
                reason=(
                    f"the subgraph {node.args[0].target} of the higher-order op {op} is "
                    "not entered: left as captured")))


def _rewrite_one(gm: fx.GraphModule, options: Options, records: list[MatchRecord]):
    """Rewrite one graph in place; returns (canonical text, rewritten code, SDPA calls
    whose output gradient is re-laid: attention_grad_layout.py, fused-call inputs that
    come without a reshape: row_chains.py)."""
    graph = gm.graph
    canonical_text = canonical.render(graph)
    raising = canonical.gemm_eager_rejects(graph)
    if raising is not None:  # eager raises here: leave the graph as captured, so it does
        records.append(MatchRecord(
            "graph", model_path(raising), REJECTED, kind=RejectionKind.CONDITION,
            code="graph.eager_raises", reason=(
                f"{describe(raising)} multiplies {_dtypes(raising)} with no autocast in "
                "force: eager raises there, so the graph is left exactly as captured")))
        return canonical_text, gm.code, 0, 0, 0
    pristine = copy.deepcopy(graph)  # nodes copied, their meta shared: cheap
    first = len(records)
    try:
        context = Context(options)
        for family in FAMILIES:
            _run(family, graph, context, records)
        _sharded_gemms_left(graph, records)
        _foreign_subclasses_left(graph, records)
        graph.lint()
    except Exception as e:  # a bug of the pass after the graph changed: undo, and say so
        gm.graph = pristine
        _undone(records[first:], e)
        records.append(MatchRecord(
            "graph", "", REJECTED, kind=RejectionKind.INTERNAL_ERROR, code="internal_error",
            reason=(f"graph surgery raised ({type(e).__name__}: {e}); every rewrite of this "
                    "graph is undone: it runs exactly as captured")))
    # not a rewrite: a PyTorch bug kept away from every graph that may train on CUDA,
    # rewritten or not (attention_grad_layout.py)
    guarded = attention_grad_layout.guard(gm.graph)
    # AOTAutograd traces Inductor's graphs and cudagraphs=True's: norms are deferred
    # there only where their sizes are static (the partials' width is then known)
    traced = options.inductor or options.cudagraphs
    deferred = _host_step(gm, records, lambda g: deferred_rstd.defer(g, traced),
                          "deferred_rstd", ("handing norm partials to the consumers' GEMMs "
                                            "raised", "each norm keeps its finaliser kernel"))
    fed = 0
    if not options.inductor:  # a graph run as Python: calls hand each other 2-D results
        fed = _host_step(gm, records, row_chains.chain, "row_chains", (
            "handing fused calls 2-D results raised", "each call reshapes its own inputs "
            "and results"))
    gm.recompile()
    return canonical_text, gm.code, guarded, fed, deferred


def _host_step(gm: fx.GraphModule, records: list[MatchRecord], step, name: str,
               what: tuple[str, str]) -> int:
    """A host-time step over a graph that runs as Python (deferred_rstd.defer,
    row_chains.chain): not a rewrite, no value changes. If it raises, the graph goes back
    to what it was before the step, and the report says so."""
    before = copy.deepcopy(gm.graph)
    try:
        count = step(gm.graph)
        gm.graph.lint()
        return count
    except Exception as e:
        gm.graph = before
        records.append(MatchRecord(
            "graph", "", REJECTED, kind=RejectionKind.INTERNAL_ERROR,
            code=f"internal_error.{name}", reason=(
                f"{what[0]} ({type(e).__name__}: {e}); the rewrites stand, {what[1]}")))
        return 0


def _undone(records: list[MatchRecord], error: Exception) -> None:
    for r in records:
        if r.status == REWRITTEN:
            r.reject(RejectionKind.INTERNAL_ERROR, f"undone: a later rewrite of this graph "
                     f"failed ({type(error).__name__}); see the graph's record", "internal_error")


def _sharded_gemms_left(graph: fx.Graph, records: list[MatchRecord]) -> None:
    """Tensor parallelism: a record for each GEMM on a DTensor weight that no rewrite
    took, saying why (the families' own matchers stop at DTensor layout ops silently)."""
    for node in graph.nodes:
        c = canonical.canon(node)
        if c is None or c.name != "linear" or not sharding.is_dtensor(c.args[1]):
            continue
        if any(p.is_partial() for p in sharding.placements(node) or ()):
            code, why = "dtensor.row_parallel", (
                "a row-parallel GEMM (split contraction): its output is a partial sum until "
                "DTensor reduces it, so no epilogue runs in it; the norm after the reduce "
                "is fused as a row-wise program")
        else:
            code, why = "dtensor.no_sharding_rule", (
                "a GEMM on a sharded weight that no rewrite took: on DTensors only the "
                "norm's row scale is fused so far (gated, RoPE and cross-entropy epilogues "
                "on sharded weights are not implemented); left as DTensor computes it")
        records.append(MatchRecord("tensor_parallel", model_path(node), NOT_MATCHED,
                                   code=code, reason=f"{describe(node)}: {why}"))


def _foreign_subclasses_left(graph: fx.Graph, records: list[MatchRecord]) -> None:
    """A record for each GEMM or SDPA call on a tensor subclass the pass does not model
    (canonical.foreign_subclass: a quantized weight, say): no family reads it as its
    canonical op, so it is left as the subclass computes it, and the report says so."""
    for node in graph.nodes:
        cls = canonical.foreign_gemm(node)
        if cls is not None:
            records.append(MatchRecord(
                "graph", model_path(node), NOT_MATCHED, code="graph.tensor_subclass",
                reason=(f"{describe(node)} reads a {cls}, a tensor subclass whose ops "
                        "are its own (its __torch_dispatch__ decides what they compute): no "
                        "rewrite takes it; left as the subclass computes it")))


def _dtypes(linear: fx.Node) -> str:
    c = canonical.canon(linear)
    return " by ".join(str(canonical.meta(a).dtype) for a in c.args[:2]
                       if canonical.meta(a) is not None)


def _internal_error(e: Exception) -> str:
    return f"internal error while deciding ({type(e).__name__}: {e}); left as is"


def _run(family, graph: fx.Graph, context: Context, records: list[MatchRecord]) -> None:
    """One family over the graph: every candidate gets a record, rewritten or not, with
    the reason and its kind."""
    opt_in = getattr(family, "OPT_IN", None)
    if opt_in is not None and not getattr(context.options, opt_in):
        return  # a mode the user did not ask for (options.fp8): not even matched
    enabled = family.NAME in context.options.patterns
    try:
        found = list(family.find(graph))
    except Exception as e:  # a checker bug must cost a rewrite, never the compile
        records.append(MatchRecord(family.NAME, "", REJECTED, reason=_internal_error(e),
                                   kind=RejectionKind.INTERNAL_ERROR, code="internal_error"))
        return
    for m in found:
        if isinstance(m, NoMatch):
            records.append(MatchRecord(m.pattern, m.path, NOT_MATCHED, reason=m.reason,
                                       code=m.code))
            continue
        record = MatchRecord(family.NAME, m.path, REJECTED, **family.describe_match(m))
        records.append(record)
        if not enabled:
            record.reject(RejectionKind.DISABLED, "pattern disabled by options.patterns",
                          "disabled")
            continue
        if _stale(m) and not getattr(family, "FOLLOWS_REPLACED", False):
            m = _found_again(family, graph, m)
            if m is None:
                record.reject(RejectionKind.CONDITION, "an earlier rewrite of this family "
                              "replaced nodes this match names, and the graph as it is now "
                              "has it no more", "stale")
                continue
            _show(record, family.describe_match(m))
        named = list(_nodes_named(m))
        mixed = grad_modes_mixed(named) or grad_mode_changed_along(named, graph)
        if mixed is not None:
            record.reject(RejectionKind.CONDITION, (
                f"{describe(mixed[0])} and {describe(mixed[1])} run in different grad modes "
                "(a torch.no_grad() region inside the graph): the rewrite would compute "
                "both in one grad mode, and the gradient would change"), "grad_mode.mixed")
            continue
        small = size_policy.too_few_rows(family, m, context.options.min_fused_rows,
                                         context.options.graphed)
        if small:
            record.reject(RejectionKind.CONDITION, small, "shape.small_m")
            continue
        unpaid = training_policy.not_paying_in_training(family, m, context.options)
        if unpaid:
            record.reject(RejectionKind.CONDITION, unpaid, "training.does_not_pay")
            continue
        try:
            decided = family.decide(m, context)
        except Exception as e:  # a checker bug must cost a rewrite, never the compile
            record.reject(RejectionKind.INTERNAL_ERROR, _internal_error(e), "internal_error")
            continue
        record.decision = decided.decision
        _show(record, decided.report)
        if decided.plan is None:
            record.reject(decided.rejection.kind, decided.rejection.condition,
                          decided.rejection.code)
            continue
        try:
            shown = family.apply(graph, decided.plan, context)
        except NotPlaceable as e:  # raised before the graph changes
            record.reject(RejectionKind.NOT_PLACEABLE, f"not applied: {e}", "not_placeable")
            continue
        except Exception as e:  # the graph may be half changed: _rewrite_one undoes it all
            record.reject(RejectionKind.INTERNAL_ERROR, f"internal error while applying "
                          f"({type(e).__name__}: {e})", "internal_error")
            raise
        record.status = REWRITTEN
        _show(record, shown)
        record.program_checks = [locality.check(p) for p in dict.fromkeys(record.programs)]


def _nodes_named(obj, seen: set[int] | None = None):
    """The graph nodes a match names: its fields, and theirs (a norm, a linear, the
    containers and mappings holding them), however deep. Nothing is skipped by depth: a
    node missed here is an erased node a stale match would be decided on."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, fx.Node):
        yield obj
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _nodes_named(getattr(obj, f.name), seen)
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _nodes_named(key, seen)
            yield from _nodes_named(value, seen)
    elif isinstance(obj, (tuple, list, frozenset, set)):
        for x in obj:
            yield from _nodes_named(x, seen)


def _stale(m) -> bool:
    """Whether an earlier rewrite of the same family erased a node ``m`` names: found
    before that rewrite (a chain B(A(x)) where A's rewrite replaced the value B reads, or
    MLA's q_a_proj → q_a_layernorm → q_b_proj), the match describes a graph that is gone."""
    return any(getattr(n, "_erased", False) for n in _nodes_named(m))


def _found_again(family, graph: fx.Graph, m):
    """``m`` found again in the graph as it is now: the family's match at the same model
    path that shares the most live nodes with it, or None. Deciding and applying the stale match
    would read erased nodes (seen: the witness refused such chains; an apply could wire a
    value that no longer exists)."""
    live = {n for n in _nodes_named(m) if not getattr(n, "_erased", False)}
    best, shared = None, 0
    for again in family.find(graph):
        if isinstance(again, NoMatch) or again.path != m.path or _stale(again):
            continue
        # the most nodes in common: a module called twice has two matches at one path
        common = len(live & set(_nodes_named(again)))
        if common > shared:
            best, shared = again, common
    return best


def _show(record: MatchRecord, fields: dict) -> None:
    for name, value in fields.items():
        setattr(record, name, value)
