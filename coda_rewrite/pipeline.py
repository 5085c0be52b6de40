"""The pass over one captured graph: match → decide → rewrite, recording everything.

Five pattern families run in turn: the attention inputs (SDPA calls), the norms, the
gated MLPs (after the norms: a gate/up pair that became two rowscale consumers of a
rewritten norm merges into one GEMM that applies the deferred rstd before the
activation), RoPE (after the attention inputs, whose SDPA calls its escape analysis
reads, and after the norms: q/k/v as rowscale consumers merge into one rotating GEMM),
then the LM head's cross-entropy (whose logits GEMM may be the final norm's rowscale
consumer by then). Norm matches are found once, then decided and applied in graph order.
A rewrite replaces nodes that a later match may name (the residual add one norm's
producer fuses is the residual input of the next), so each match is brought up to date
before its turn: replaced nodes are followed to their replacements, and a producing GEMM
that an earlier rewrite already turned into a fused op is not fused a second time (the
later norm then gets the row-wise program, and the report says why).
"""

from __future__ import annotations

import dataclasses
import time

import torch.fx as fx

from . import algebra, canonical, rewrite
from .algebra import locality
from .capture import describe, model_path
from .options import Options
from .algebra import cross_entropy as ce_algebra
from .algebra import gated as gated_algebra
from .algebra import rope as rope_algebra
from .patterns import NoMatch, attention, cross_entropy, gated_mlp, residual_rmsnorm, rope
from .algebra.decision import RejectionKind
from .report import NOT_MATCHED, REJECTED, REWRITTEN, GraphReport, MatchRecord


def rewrite_graph(gm: fx.GraphModule, options: Options, index: int = 0) -> GraphReport:
    t0 = time.perf_counter()
    records: list[MatchRecord] = []
    texts = _rewrite_one(gm, options, records)
    for name, region in _checkpointed_regions(gm, records):
        sub = _rewrite_one(region, options, records)
        texts = (texts[0] + f"\n# checkpointed region {name}\n" + sub[0],
                 texts[1] + f"\n# checkpointed region {name} (recomputed in the backward)\n"
                 + sub[1])
    return GraphReport(index, records, texts[0], texts[1], time.perf_counter() - t0)


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
                "graph", model_path(node), NOT_MATCHED, reason=(
                    f"the subgraph {node.args[0].target} of the higher-order op {op} is "
                    "not entered: left as captured")))


def _rewrite_one(gm: fx.GraphModule, options: Options, records: list[MatchRecord]):
    """Rewrite one graph in place; returns (canonical text, rewritten code)."""
    graph = gm.graph
    canonical_text = canonical.render(graph)
    raising = canonical.gemm_eager_rejects(graph)
    if raising is not None:  # eager raises here: leave the graph as captured, so it does
        records.append(MatchRecord(
            "graph", model_path(raising), REJECTED, kind=RejectionKind.CONDITION, reason=(
                f"{describe(raising)} multiplies {_dtypes(raising)} with no autocast in "
                "force: eager raises there, so the graph is left exactly as captured")))
        return canonical_text, gm.code
    _attention(graph, options, records)
    _norms(graph, options, records)
    _gated(graph, options, records)
    _rope(graph, options, records)
    _cross_entropy(graph, options, records)
    graph.lint()
    gm.recompile()
    return canonical_text, gm.code


def _dtypes(linear: fx.Node) -> str:
    c = canonical.canon(linear)
    return " by ".join(str(canonical.meta(a).dtype) for a in c.args[:2]
                       if canonical.meta(a) is not None)


def _weights_line(m, options: Options) -> str:
    """What the report says about a fused GEMM's re-laid-out weights."""
    if m.cache_relayouts:
        return ("re-laid out once, kept inside the GEMM op until a weight changes "
                "(cache_relayouts; version-keyed; weights made under inference_mode have no "
                "version counter and are re-laid out on every call)")
    if options.cache_relayouts:
        return ("re-laid out on every call: this graph computes gradients (cache_relayouts "
                "applies to inference graphs; here the weights change every step)")
    return "re-laid out on every call, from the live parameters"


def _norms(graph: fx.Graph, options: Options, records: list[MatchRecord]) -> None:
    """GEMM → residual → RMSNorm → GEMM(s): the row-scale deferral."""
    replaced: dict[fx.Node, fx.Node] = {}
    enabled = residual_rmsnorm.NAME in options.patterns
    for m in residual_rmsnorm.find(graph):
        if isinstance(m, NoMatch):
            records.append(MatchRecord(m.pattern, m.path, NOT_MATCHED, reason=m.reason))
            continue
        m = _refresh(m, replaced)
        residual_rmsnorm.build_programs(m, lambda c: algebra.row_scale.has_shift(c, m.norm))
        record = MatchRecord(
            m.pattern, m.path, REJECTED,
            producer=describe(m.producer.linear) if m.producer else m.producer_note,
            consumers=[describe(c.linear) for c in m.consumers],
        )
        records.append(record)
        if not enabled:
            record.reject(RejectionKind.DISABLED, "pattern disabled by options.patterns")
            continue
        try:
            decision, per_consumer, accepted = algebra.decide_row_scale(m, graph)
        except Exception as e:  # a checker bug must cost a rewrite, never the compile
            record.reject(RejectionKind.INTERNAL_ERROR,
                          f"internal error while deciding ({type(e).__name__}: {e}); left as is")
            continue
        record.decision = decision
        record.consumer_decisions = [(describe(n), d) for n, d in per_consumer.items()]
        if not accepted:
            record.reject(decision.kind if not decision.accepted else RejectionKind.CONDITION,
                          decision.condition if not decision.accepted else "")
            continue
        alive, replacements = rewrite.apply(graph, m, accepted)
        replaced.update(replacements)
        record.status = REWRITTEN
        record.materialised = [describe(n) for n in alive]
        record.programs = [m.norm_program, *(m.consumer_programs[c.linear] for c in accepted)]
        record.program_checks = [locality.check(p) for p in dict.fromkeys(record.programs)]


def _gated(graph: fx.Graph, options: Options, records: list[MatchRecord]) -> None:
    """act(x·W_gᵀ)·(x·W_uᵀ) → one GEMM over interleaved weights, pairwise epilogue."""
    def annotate(record, m, done):
        record.consumers = [describe(m.gate.out)] if m.packed else \
            [describe(m.gate.out), describe(m.up.out)]
        if done and m.gate.r is not None:
            record.producer = f"rows scaled by the deferred rstd {describe(m.gate.r)}"
        if done:
            record.weights = _weights_line(m, options)

    _one_program_pattern(graph, options, records, gated_mlp, gated_algebra.decide,
                         rewrite.apply_gated, annotate)


def _rope(graph: fx.Graph, options: Options, records: list[MatchRecord]) -> None:
    """q/k projections → RoPE (+ v): one GEMM over per-head interleaved weights that
    rotates in its epilogue; eager's order back wherever the permutation would show."""
    def annotate(record, m, done):
        record.consumers = [describe(r.out) for r in m.rotated] + \
            [f"{describe(s.column_node)} (" + ("frequency 0" if m.angle_source == "angles"
                                               else "not rotated") + ")" for s in m.passthrough]
        if m.proj.r is not None:
            record.producer = f"rows scaled by the deferred rstd {describe(m.proj.r)}"
        if done:
            record.weights = _weights_line(m, options)
        if done and m.region is not None and m.region.unpermute:
            record.materialised = [
                f"{v.name} in eager order for {'the graph output' if c.op == 'output' else c.name}"
                for c, v in m.region.unpermute]

    _one_program_pattern(graph, options, records, rope, rope_algebra.decide,
                         rewrite.apply_rope, annotate)


def _cross_entropy(graph: fx.Graph, options: Options, records: list[MatchRecord]) -> None:
    """logits GEMM → cross_entropy: per-row losses from the epilogue, logits when used."""
    def annotate(record, m, done):
        record.producer = describe(m.proj.out)
        if done and m.materialise:
            record.materialised = [describe(m.proj.out)]

    _one_program_pattern(graph, options, records, cross_entropy, ce_algebra.decide,
                         rewrite.apply_cross_entropy, annotate)


def _one_program_pattern(graph, options, records, pattern, decide, apply, annotate) -> None:
    """find → build the program → decide → apply, for a pattern whose match becomes
    one fused op with one program. ``annotate(record, match, rewritten)`` adds what the
    report says about the match."""
    enabled = pattern.NAME in options.patterns
    for m in pattern.find(graph):
        if isinstance(m, NoMatch):
            records.append(MatchRecord(m.pattern, m.path, NOT_MATCHED, reason=m.reason))
            continue
        record = MatchRecord(m.pattern, m.path, REJECTED)
        records.append(record)
        annotate(record, m, False)
        if not enabled:
            record.reject(RejectionKind.DISABLED, "pattern disabled by options.patterns")
            continue
        try:
            pattern.build_program(m, options)
            decision = decide(m)
        except Exception as e:  # a checker bug must cost a rewrite, never the compile
            record.reject(RejectionKind.INTERNAL_ERROR,
                          f"internal error while deciding ({type(e).__name__}: {e}); left as is")
            continue
        record.decision = decision
        if not decision.accepted:
            record.reject(decision.kind, decision.condition)
            continue
        try:
            apply(graph, m)
        except rewrite.NotPlaceable as e:  # raised before the graph changes
            record.reject(RejectionKind.NOT_PLACEABLE, f"not applied: {e}")
            continue
        record.status = REWRITTEN
        record.programs = [m.program]
        record.program_checks = [locality.check(m.program)]
        annotate(record, m, True)


def _attention(graph: fx.Graph, options: Options, records: list[MatchRecord]) -> None:
    """SDPA calls: repeat_kv back to enable_gqa, a proved causal mask back to is_causal."""
    enabled = attention.NAME in options.patterns
    try:
        matches = attention.find(graph)
    except Exception as e:  # a checker bug must cost a rewrite, never the compile
        records.append(MatchRecord(attention.NAME, "", REJECTED, reason=(
            f"internal error while deciding ({type(e).__name__}: {e}); left as is"),
            kind=RejectionKind.INTERNAL_ERROR))
        return
    for m in matches:
        notes = [("grouped-query heads", m.gqa)]
        if m.causal is not None:
            notes.append(("mask", m.causal))
        record = MatchRecord(m.pattern, m.path, REJECTED, notes=notes)
        records.append(record)
        if not m.changes:
            record.reject(RejectionKind.CONDITION,
                          "; ".join(d.condition for _, d in notes if not d.accepted))
            continue
        if not enabled:
            record.reject(RejectionKind.DISABLED, "pattern disabled by options.patterns")
            continue
        attention.apply(graph, m)
        rewrite.erase_if_dead(graph, [m.k, m.v] + ([m.mask] if m.mask is not None else []))
        record.status = REWRITTEN
        record.reason = "; ".join(f"{label} kept: {d.condition}" for label, d in notes
                                  if not d.accepted)


def _refresh(m, replaced):
    """Bring a match found before earlier rewrites up to date."""
    def cur(n):
        while n in replaced:
            n = replaced[n]
        return n

    norm = dataclasses.replace(m.norm, input=cur(m.norm.input))
    producer, note = m.producer, m.producer_note
    if producer is not None and (producer.linear in replaced or producer.add in replaced):
        producer, note = None, (f"the producing GEMM {producer.linear.name} already carries "
                                "another rewrite's epilogue")
    if producer is not None:
        producer = dataclasses.replace(producer, residual=cur(producer.residual),
                                       x=cur(producer.x))
    return dataclasses.replace(m, norm=norm, producer=producer, producer_note=note)
