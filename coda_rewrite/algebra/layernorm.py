"""Centred row-scale deferral: is it legal to apply a LayerNorm after the GEMM it feeds?

The identity, for per-row scalars μ[i], r[i] and any GEMM contracting over features,

    Σ_k ((z[i,k] − μ[i])·r[i]·γ[k] + β[k])·W[j,k] + b[j]
        = r[i]·(Σ_k z[i,k]·W'[j,k] − μ[i]·s[j]) + b'[j]                          (1)

with W' = W ∘ γ, s_j = Σ_k W'[j,k], b' = β·Wᵀ + b, is proved with sympy over indexed
sums of symbolic length (statements.prove_layernorm_centring, cached), together with
the backward's form of W'’s gradient. The side conditions, checked on the graph:

  (a) the norm runs over the last dim only (the match requires normalized_shape = (K,)),
      so μ and r are one scalar each per row;
  (b) between the norm and each GEMM only what row_scale allows (row selections,
      reshapes keeping the last dim, casts, per-feature factors folded into W', shifts
      distributed into b'), and the GEMM contracts over the normalised features;
  (c) no value of the region, nor an alias of one, is updated in place (the GEMM would
      read z later than the norm did);
  (d) z reaches the GEMM in the dtype it was normalised in: the rewrite's GEMM reads z
      where eager's read LN(z), so a rounding eager applies after centring (a float32 z
      under a bf16 autocast GEMM) would land before it, on a value of the size of the
      mean, not the spread: refused (``layernorm.rounds_z``);
  (e) no DTensor: on sharded features the statistics would be partial sums;
  (f) every reader of LN(z) is an accepted GEMM: otherwise eager's write of LN(z) stays
      and the rewrite only adds work (``layernorm.materialised_anyway``).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..canonical import canon_name, meta
from ..capture import describe
from ..codegen import layouts
from ..codegen.program import parse
from ..layernorm_idiom import exact_upcast
from ..graph_utils import in_place_update_of
from ..numerics import rel_err
from . import row_scale, sharding, statements
from .decision import Decision, Proof, Rejection, RejectionKind, Why, code_of
from .witness import (LEAVES, MATH, _MAX_ELEMS, _eval, _prod, _size, _value, exact, gradient_error,
                      guarded_with_gradients, run_program, verdict)


def has_shift(consumer, norm) -> bool:
    return row_scale.has_shift(consumer, norm)


def replay_chain(chain, norm, z, row_value, like, call):
    """row_scale.replay_chain from the norm's output with z in place of LN(z): (z as the
    GEMM reads it, ``row_value`` (r or μ) following the same row selections, the
    composed per-feature factor, the composed shift)."""
    return row_scale.replay_chain(chain, norm.output, norm.dim, z, row_value, like, call)


def _consumer_condition(c, norm) -> Why | None:
    """Why one consumer GEMM cannot take the centred deferral, or None."""
    kinds = row_scale.chain_kinds(c, norm)
    bad = next((why for kind, why in kinds if kind == "reject"), None)
    if bad is not None:
        return bad
    if any(kind == "detach" for kind, _ in kinds) and \
            (norm.weight is not None or norm.bias is not None):
        return Why(f"a detach between the LayerNorm and {describe(c.linear)}: γ and β, "
                   "folded into the GEMM's weights, would get the gradient the detach "
                   "stops", "layernorm.detach")
    mx = meta(c.chain[-1] if c.chain else norm.output)
    if mx is None or mx.shape[-1] != norm.dim:
        return Why(f"{describe(c.linear)} does not contract over the {norm.dim} normalised "
                   "features", "row_scale.contraction")
    mw = meta(c.weight)
    if mw is None or mw.dim() != 2 or (c.bias is not None and meta(c.bias) is None):
        return Why(f"{describe(c.linear)} has a weight or bias that is not a 2-D/1-D tensor",
                   "layernorm.gemm_operands")
    if any(sharding.is_dtensor(n) for n in (norm.input, c.weight, c.linear)):
        return Why(f"(e) {describe(c.linear)} runs on DTensors: the statistics of sharded "
                   "features would be partial sums (not implemented)", "layernorm.dtensor")
    out, z = meta(c.linear), meta(norm.input)
    if out.dtype != z.dtype or row_scale.narrowing_cast(c, norm) is not None:
        return Why(f"(d) {describe(c.linear)} computes in {out.dtype} from a LayerNorm of a "
                   f"{z.dtype} value: eager rounds after centring, the rewrite would round "
                   "z itself, whose error is of the size of the mean (not the spread)",
                   "layernorm.rounds_z")
    return None


def check(match, graph: fx.Graph, activations: dict | None = None
          ) -> tuple[Decision, dict[fx.Node, Decision]]:
    """The overall decision for a match and one per consumer GEMM (``activations``: the
    ones their programs take, as in decide)."""
    activations = activations or {}
    norm = match.norm
    updated = row_scale.updated_in_place(
        match, graph, "the deferred statistics and the GEMM would read it at other times "
        "than the norm did", "layernorm.in_place")
    if updated is not None:
        return updated, {}
    per_consumer: dict[fx.Node, Decision] = {}
    for c in match.consumers:
        bad = _consumer_condition(c, norm)
        if bad is None and c.linear in activations:
            _, act, between = activations[c.linear]
            if in_place_update_of({act, *between}, graph) is not None:
                bad = Why(f"{describe(act)}, the activation the epilogue would take, is "
                          "updated in place", "layernorm.in_place")
        if bad is not None:
            per_consumer[c.linear] = Rejection(f"(b) {bad}" if code_of(bad).startswith(
                "row_scale") else bad, describe(c.linear), code=code_of(bad))
            continue
        kinds = row_scale.chain_kinds(c, norm)
        via = ", ".join(f"{n.name}: {k}" for n, (k, _) in zip(c.chain, kinds))
        op, node, _ = activations.get(c.linear, (None, None, ()))
        per_consumer[c.linear] = Proof(
            (f"{node.name} = {op}(r ⊙ (z·W'ᵀ − μ ⊙ s) + b'), the GEMM's only reader taken "
             "into the epilogue (no gradient: the pre-activation is never written)")
            if op else f"{c.linear.name} = r ⊙ (z·W'ᵀ − μ ⊙ s) + b'",
            (f"(b) path from the norm: {via or 'direct'}",
             "(b') nn.Linear contracts over the last (normalised) dim"), ())
    refused = [(n, d) for n, d in per_consumer.items() if not d.accepted]
    if refused:
        node, first = refused[0]
        return Rejection(Why(
            f"the GEMM {describe(node)} cannot take the deferred LayerNorm ({first.condition})"
            ": LN(z) would still be written for it, so the rewrite would only add work",
            "layernorm.materialised_anyway"), first.where), per_consumer
    if match.other_readers:
        return Rejection(Why(
            "LN(z) is also read by " + ", ".join(describe(n) for n in match.other_readers)
            + " (not a plain GEMM: another rewrite's fused GEMM, a second branch or a "
            "returned value): it would still be written, and the statistics and the weight "
            "fold would only add work", "layernorm.materialised_anyway"),
            describe(norm.output)), per_consumer
    proof = statements.prove_layernorm_centring()
    return Proof(
        "LN(z)·Wᵀ + b = r ⊙ (z·W'ᵀ − μ ⊙ s) + b',  W' = W∘γ, s = W'·1, b' = β·Wᵀ + b",
        ("(a) the norm runs over the last dim only (normalized_shape = "
         f"({norm.dim},)): μ and r are one scalar each per row",
         "(c) no value of the region or an alias of one is updated in place",
         "(d) z reaches each GEMM in the dtype it was normalised in",
         f"(f) every reader of LN(z) is one of the {len(match.consumers)} GEMMs",
         f"eps = {norm.eps:g} is a constant"),
        proof.steps, proof.witness), per_consumer


def decide(match, programs: dict, activations: dict, graph: fx.Graph
           ) -> tuple[Decision, dict]:
    """(decision, per-consumer decisions). ``activations``: consumer GEMM -> (op, last
    node, nodes before it) of the activation its program applies. Pure: nothing is
    changed."""
    decision, per_consumer = check(match, graph, activations)
    if not decision.accepted:
        return decision, per_consumer
    # rows shrunk to 3 per leading dim for speed; the model's own sizes where a reshape in
    # the region fixes them (and they are small enough to replay)
    lead_full = [_size(s) for s in meta(match.norm.input).shape[:-1]]
    leads = [[min(s, 3) for s in lead_full]]
    if lead_full != leads[0] and _prod(lead_full) * match.norm.dim <= _MAX_ELEMS:
        leads.append(lead_full)
    trains = any(meta(c.linear) is None or meta(c.linear).requires_grad  # unknown: replay
                 for c in match.consumers)
    for lead in leads:
        seen = guarded_with_gradients(
            lambda m, gradients=False: _witness(m, programs, activations, lead, gradients),
            match, trains)
        if not (isinstance(seen, Rejection) and seen.code == "witness.unavailable"):
            break
    if isinstance(seen, Rejection):
        return seen, per_consumer
    return Proof(decision.statement, decision.assumptions, decision.steps, seen), per_consumer


# ---- witness: the matched nodes against the rewrite, in float64 -------------------------

def _witness(match, programs, activations, lead: list[int],
             gradients: bool = False) -> str | Rejection:
    """The norm and each consumer (chain and GEMM) evaluated as captured, against the
    statistics, the folded weights and the program, on random float64 rows whose mean
    is far from 0 (so the correction μ·s matters). A 16-bit graph runs in float64 too,
    exact math on both sides: the norm's own casts (Cohere's float32 statistic and the
    cast back) are replayed as identities, and the casts between the norm and a GEMM that
    check's (d) lets through are identities in the model; what rounding does is (d)'s
    and the numerics tests' to judge, not the witness's. With ``gradients`` (a match whose
    GEMMs train), every input is a leaf and the gradients of both sides to each are
    compared instead (witness.gradient_error): a fold or a statistic that gives a
    gradient eager's graph does not (across a detach) is right in value and wrong there."""
    norm = match.norm
    d = norm.dim
    g = torch.Generator().manual_seed(4321)
    leaves: list[torch.Tensor] = []

    def rand(*shape, base=0.0):
        t = base + torch.randn(*shape, generator=g, dtype=torch.float64)
        if gradients:
            leaves.append(t.requires_grad_())
        return t

    env: dict = {"__gen__": g, MATH: gradients, norm.input: rand(*lead, d, base=3.0)}
    if norm.weight is not None:
        env[norm.weight] = rand(d, base=1.0) * 0.5
    if norm.bias is not None:
        env[norm.bias] = rand(d) * 0.5
    for param in (norm.weight, norm.bias):  # the exact upcasts the model reads them
        todo = [param] if param is not None else []  # through (Cohere's weight.float())
        while todo:
            for u in todo.pop().users:
                if exact_upcast(u) and u not in env:
                    env[u] = env[param]
                    todo.append(u)
    for node in norm.nodes:  # graph order; the norm's own casts as identities (below)
        env[node] = _value(node.args[0], env) if canon_name(node) == "cast" else \
            _eval(node, env)
    r, mu = layouts.layernorm_statistics(env[norm.input], norm.eps)
    names, errs, gots, wants = [], [], [], []
    for c in match.consumers:
        if c.weight not in env:  # a weight two GEMMs share keeps its first value
            env[c.weight] = rand(min(_size(meta(c.weight).shape[0]), 8), d)
        if c.bias is not None and c.bias not in env:
            env[c.bias] = rand(env[c.weight].shape[0])
        for node in c.chain:
            env[node] = _eval(node, env)
        env[c.linear] = _eval(c.linear, env)
        want = env[c.linear]
        if c.linear in activations:  # the program applies the GEMM's one reader too
            want = _eval(activations[c.linear][1], env)

        def like(node, src, x):
            return _eval(node, env, replace=(src, x))

        def call(fn, *args):
            return fn(*(_value(a, env) for a in args))

        zc, rc, scale, shift = replay_chain(c.chain, norm, env[norm.input], r, like, call)
        _, muc, _, _ = replay_chain(c.chain, norm, env[norm.input], mu, like, call)
        w_fold, s, b_fold = layouts.layernorm_weights(
            env[c.weight], env.get(c.bias), env.get(norm.weight), env.get(norm.bias),
            _value(scale, env), _value(shift, env))
        ops = [rc.reshape(-1), muc.reshape(-1), s, *([b_fold] if b_fold is not None else [])]
        prog = parse(exact(programs[c.linear].to_text()))  # float64 outputs: no rounding
        if len(prog.operands) != len(ops):
            raise ValueError(f"{prog.key} reads {len(prog.operands)} operands, the "
                             f"rewrite builds {len(ops)}")
        (got,) = run_program(prog, zc.reshape(-1, d), w_fold, ops, gradients)
        names.append(c.linear.name)
        errs.append(rel_err(got.double().reshape(want.shape), want.double()))
        gots.append(got.reshape(want.shape))
        wants.append(want)
    if gradients:
        leaves += env.get(LEAVES, [])
        return verdict(gradient_error(gots, wants, leaves),
                       f"the gradients to the {len(leaves)} inputs, rows {lead}", match.path,
                       tol=1e-9, gradients=True)
    tol = 1e-9  # exact math in float64 on both sides (the outputs too)
    shown = ", ".join(f"{n} {e:.1e}" for n, e in zip(names, errs))
    if not all(e <= tol for e in errs):  # NaN fails too
        return Rejection(f"checker bug: the float64 witness disagrees ({shown}; tol {tol:g}); "
                         "the rewrite is not applied", match.path,
                         RejectionKind.WITNESS_DISAGREES, "witness.disagrees")
    return f"replay in float64 on rows {lead} (mean ≈ 3σ): rel. error {shown} (tol {tol:g})"
