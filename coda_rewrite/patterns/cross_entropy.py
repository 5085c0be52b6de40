"""LM head → cross-entropy: the loss from the GEMM epilogue, logits only when used.

Training code computes logits = h·W_lmᵀ ([tokens, vocab], the largest activation of
the model), upcasts them to float32, and hands them to F.cross_entropy, which reads them
again for the log-sum-exp and the target logit; the backward materialises softmax − one-hot
at the same size. The rewrite keeps, per row and GEMM tile, an online (max, sum-exp)
state and picks the row's target logit while the tile is on chip:

    epilogue:  y = r[i]·acc[i, :] (+ b)            (r: the final norm's deferred rstd)
               lse[i] = log Σ_j exp(y[i, j])        (online, merged across tiles)
               tl[i]  = y[i, t_i]  (0 where t_i is out of range, e.g. ignore_index)
               loss[i] = lse[i] − tl[i]
               y                                    (stored only if something reads the
                                                     logits; see materialize_logits)
    graph:     rows with t_i = ignore_index contribute 0; mean divides by their count,
               exactly as PyTorch does (0/0 = NaN when every row is ignored)

Logits mapped elementwise before the loss (Cohere's logit_scale, Granite's
logits_scaling, Gemma 2's soft-capping c·tanh(y / c), a temperature) keep the rewrite:
the map is part of the epilogue, z = g(y), and the loss, lse and the written logits are
those of z (what the model returns); g is a chain of multiplications and divisions by
constants with at most one tanh, so its derivative g'(y) is known from z alone (the
backward needs no y: for z = c₂·tanh(y / c₁), g' = (c₂ / c₁)·(1 − (z / c₂)²)).

Spellings: F.cross_entropy / nn.CrossEntropyLoss on flattened logits; an upcast
(``logits.float()``) in between; the causal shift on the logits (``logits[..., :-1, :]``
against ``labels[..., 1:]``, a row selection: the skipped rows get ignore_index) or on the
labels (Hugging Face's ForCausalLMLoss pads them); reductions mean, sum and none (HF's
``num_items_in_batch`` divides a sum afterwards, which stays a graph op). Not in the
epilogue, left as is with the reason: class weights, label smoothing, probabilities as
targets, anything between the GEMM and the loss that is not a view, cast, row slice or
such a map (a tensor-valued or run-time scale, a second tanh, another function).
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from .. import patterns
from ..algebra import cross_entropy as ce_algebra
from ..algebra.decision import Rejection, Why
from ..canonical import canon, meta
from ..capture import describe, model_path
from ..codegen import layouts
from ..codegen.program import EpilogueProgram, Kind, ProgramBuilder
from ..codegen.reference import dtype_name
from ..graph_utils import cast_for_gemm, copy_meta, erase_if_dead, results
from ..kernels import ops
from .family import Context, Decided, no_kernel
from .gated_mlp import Projection, projection_of

NAME = "lm_head_cross_entropy"
# its rewrites replace GEMMs by fused ones, where they pay (size_policy.py)
FUSES_GEMMS = True
# ... from this many rows (size_policy.py; benchmarks/small_m.py --static and
# inference.py small_m on the H200, BENCHMARKS.md sixth session):
# the LM head (+ loss): 1.07–1.11x at 16 rows, 0.94–0.98x from 64 (no weight
# re-layout)
FUSED_FROM_ROWS = 64
# ... and in a training step (training_policy.py; on top of the
# attention rewrite: +0.5 ms and +1.8 GiB per 1B step with the logits written, sixth
# session; since the softmax gradient is one traced pass, 2.3 ms less kernel time than
# leaving it, seventeenth session, for the same memory: left for the memory; with the
# backward's lse pass gone, thirty-sixth session, 1.008x the step without it, paired by
# round (0.969–1.015), the same peak: still inside the spread)
PAYS_IN_TRAINING = False


def asked_for_in_training(options) -> bool:
    """materialize_logits=False is the user's request for the logits-free loss (memory):
    kept in training whatever PAYS_IN_TRAINING says."""
    return not options.materialize_logits

_CE = {F.cross_entropy, torch.nn.functional.cross_entropy}
_VIEWS = {"view", "reshape", "flatten", torch.reshape, torch.flatten}
_CE_PARAMS = ("input", "target", "weight", "size_average", "ignore_index", "reduce",
              "reduction", "label_smoothing")


@dataclasses.dataclass(frozen=True)
class Match:
    ce: fx.Node
    proj: Projection               # the logits GEMM
    chain: tuple[fx.Node, ...]     # GEMM output → loss input: views, casts, a row slice
    row_slice: tuple[int, int | None, int | None] | None  # (dim, start, stop) on the lead dims
    target: fx.Node
    ignore_index: int
    reduction: str
    logits_readers: list[fx.Node]  # readers of the logits (``logits``) outside the chain
    logits_map: tuple = ()         # z = g(y) in order: ("mul" | "div", c) or ("tanh", None)
    logits: fx.Node | None = None  # the value the readers read: the map's last node, or
                                   # the GEMM output when there is no map

    pattern = NAME

    @property
    def path(self) -> str:
        return model_path(self.ce) or model_path(self.proj.out)


class NoMatch(patterns.NoMatch):
    pattern = NAME


def _ce_args(node: fx.Node) -> dict:
    args = dict(zip(_CE_PARAMS, node.args))
    args.update(node.kwargs)
    return args


def find(graph: fx.Graph) -> list[Match | NoMatch]:
    out = []
    for node in graph.nodes:
        if node.op == "call_function" and node.target in _CE:
            out.append(_match(node))
    return out


def _match(ce: fx.Node) -> Match | NoMatch:
    a = _ce_args(ce)
    for name, default in (("weight", None), ("size_average", None), ("reduce", None)):
        if a.get(name, default) is not None:
            return NoMatch(ce, Why(f"cross_entropy with {name}= (class weights or legacy "
                                   "reduction flags) is not in the epilogue",
                                   "cross_entropy.class_weights"))
    if a.get("label_smoothing", 0.0) not in (0, 0.0):
        return NoMatch(ce, Why("label smoothing is not in the epilogue",
                               "cross_entropy.label_smoothing"))
    reduction = a.get("reduction", "mean")
    ignore_index = a.get("ignore_index", -100)
    x, target = a.get("input"), a.get("target")
    if not isinstance(x, fx.Node) or not isinstance(target, fx.Node) or \
            not isinstance(ignore_index, int) or reduction not in ("mean", "sum", "none"):
        return NoMatch(ce, Why("cross_entropy arguments not understood",
                               "cross_entropy.arguments"))
    mx, mt = meta(x), meta(target)
    if mx is None or mt is None or mx.dim() != 2 or mt.dim() != 1 or mt.is_floating_point():
        return NoMatch(ce, Why(
                "cross_entropy on other than [N, V] logits and [N] class indices "
                "(probabilities as targets, or unflattened logits)", "cross_entropy.shapes"))
    chain, node, row_slice, logits_map, mapped = [], x, None, [], None
    while True:
        proj = projection_of(node)
        if proj is not None:
            break
        step = _chain_step(node)
        if isinstance(step, str):
            return NoMatch(ce, step)
        if step[1] is not None:
            if row_slice is not None:
                return NoMatch(ce, Why("two row selections between the logits and the loss",
                                       "cross_entropy.two_row_selections"))
            row_slice = step[1]
        if step[2] is not None:
            if step[2][1] != 1.0:  # y · 1 and y / 1 (Granite's default scaling): nothing
                logits_map.insert(0, step[2])
            mapped = mapped or node  # the map's last node: the logits the model returns
        chain.append(node)
        node = step[0]
    if sum(op == "tanh" for op, _ in logits_map) > 1:
        return NoMatch(ce, Why("two tanh between the logits GEMM and the loss: the backward "
                               "could not recover the first one's output from the logits",
                               "cross_entropy.two_tanh"))
    if proj.local:
        return NoMatch(ce, Why("the logits are a rank's shard of a vocabulary-parallel LM "
                               "head: the log-sum-exp needs whole rows", "cross_entropy.sharded"))
    vocab = meta(proj.out).shape[-1]
    if mx.shape[-1] != vocab:
        return NoMatch(ce, "the loss's class dim is not the GEMM's output features")
    logits = mapped if mapped is not None else proj.out
    if mapped is not None and any(u not in chain for u in proj.out.users):
        return NoMatch(ce, Why("the logits are read both before and after the map in front "
                               "of the loss; the epilogue writes one of them",
                               "cross_entropy.read_before_map"))
    at = chain.index(mapped) if mapped is not None else None
    readers = [u for u in logits.users if u not in chain and (at is None or u is not (
        chain[at - 1] if at > 0 else ce))]
    return Match(ce, proj, tuple(reversed(chain)), row_slice, target, ignore_index,
                 reduction, readers, tuple(logits_map), logits)


def _map_step(node: fx.Node):
    """(input, ("mul" | "div", c) or ("tanh", None)) for an elementwise map of the logits
    by a constant the epilogue can apply, a Why for a map it cannot, None otherwise."""
    c = canon(node)
    if node.op in ("call_function", "call_method") and node.target in (torch.tanh, "tanh"):
        return node.args[0], ("tanh", None)
    if c is None or c.name not in ("mul", "div"):
        return None
    a, b = c.args
    pairs = ((a, b), (b, a)) if c.name == "mul" else ((a, b),)
    for t, k in pairs:
        if isinstance(t, fx.Node) and isinstance(k, (int, float)) and \
                not isinstance(k, bool) and k != 0 and k == k and abs(k) != float("inf"):
            return t, (c.name, float(k))
    return Why(f"{c.name} of the logits by something other than a nonzero constant (a "
               "tensor, or a value known only at run time) before the loss",
               "cross_entropy.map_operand")


def _chain_step(node: fx.Node):
    """(input, row slice or None, map step or None) for a node the epilogue can look
    through, else why not."""
    mapped = _map_step(node)
    if isinstance(mapped, str):
        return mapped
    if mapped is not None:
        return mapped[0], None, mapped[1]
    c = canon(node)
    if c is not None and c.name == "cast":
        src, dst = meta(node.args[0]), meta(node)
        if src is None or not dst.is_floating_point() or \
                torch.finfo(dst.dtype).bits < torch.finfo(src.dtype).bits:
            return Why(f"a downcast of the logits ({describe_dtype(node)}) before the loss",
                       "cross_entropy.downcast")
        return node.args[0], None, None
    if c is not None and c.name == "contiguous":
        return node.args[0], None, None
    if node.op in ("call_method", "call_function") and node.target in _VIEWS:
        src = node.args[0]
        if meta(src) is not None and meta(node) is not None and \
                meta(src).shape[-1] == meta(node).shape[-1]:
            return src, None, None
        return Why("a reshape that mixes the class dim with the rows", "cross_entropy.reshape")
    if node.op == "call_function" and node.target is operator.getitem:
        rows = _row_slice(node)
        if rows is not None:
            return node.args[0], rows, None
        return Why("an index of the logits other than a slice of rows", "cross_entropy.index")
    if node.op == "placeholder":
        return Why(f"the logits {describe(node)} are an input of this graph: the GEMM that "
                   "makes them ran in another one (a graph break between the LM head and "
                   "the loss, e.g. a warning logged there)", "cross_entropy.logits_from_outside")
    what = canon(node).name if canon(node) is not None else str(node.target)
    return Why(f"{what} between the logits GEMM and the loss is not in the epilogue (a map "
               "it applies is a product or quotient by a constant, or tanh)",
               "cross_entropy.op_before_loss")


def describe_dtype(node):
    return f"{meta(node.args[0]).dtype} -> {meta(node).dtype}"


def _row_slice(node: fx.Node):
    """(dim, start, stop) for x[..., a:b, :] / x[:, a:b] / x[a:b] selecting along one lead
    dim of a GEMM output [*lead, V] (step 1); None otherwise."""
    src, idx = node.args
    ms = meta(src)
    if ms is None:
        return None
    idx = idx if isinstance(idx, tuple) else (idx,)
    if idx and idx[0] is Ellipsis:
        idx = (slice(None),) * (ms.dim() - len(idx) + 1) + idx[1:]
    full = [i for i, s in enumerate(idx) if s != slice(None)]
    if len(idx) > ms.dim() or len(full) != 1 or full[0] >= ms.dim() - 1:
        return None
    s = idx[full[0]]
    if not isinstance(s, slice) or s.step not in (None, 1) or \
            not all(v is None or isinstance(v, int) for v in (s.start, s.stop)):
        return None
    return full[0] - ms.dim(), s.start, s.stop  # dim counted from the end (V is -1)


def apply_logits_map(p: ProgramBuilder, y: str, logits_map: tuple) -> list[str]:
    """The values of the map's steps in order (``Match.logits_map``): z = g(y) is the
    last, or y itself without a map."""
    values = [y]
    for k, (op, c) in enumerate(logits_map):
        v = values[-1]
        values.append(p.tanh(v, name=f"z{k}") if op == "tanh" else
                      p.emit(op, v, c, name=f"z{k}"))
    return values[1:] or values


def ce_program(has_r: bool, has_bias: bool, logits_dtype: torch.dtype | None,
               stat_dtype: str = "float32", logits_map: tuple = (),
               rounding: torch.dtype | None = None) -> EpilogueProgram:
    """y = acc (· r) (+ b); z = g(y) (a map before the loss, if any), rounded to
    ``rounding`` (16-bit: the dtype eager's logits are in); lse, target logit, loss = lse −
    tl of z; [z if materialised]. The per-row values are stored in ``stat_dtype`` (float64
    for a float64 model).

    Why round: eager's loss reads its logits as stored, so its log-sum-exp is of the
    rounded logits, and the softmax it differentiates sums to one over them. Formed of
    the float32 accumulator instead, the forward's lse would not serve the backward
    (softmax(stored z) with it is off by exp(δ_j), δ_j the rounding of z_j, which is the
    target entry's whole value where the softmax saturates), and the backward would pay a
    pass over the [rows, vocab] logits for an lse of its own. Rounded here, the forward's
    lse and loss are eager's, and the backward's one pass reads the stored logits with
    it (kernels/backward/cross_entropy.py)."""
    name = ("rowscale_" if has_r else "") + ("mapped_" if logits_map else "") + "lse_target"
    p = ProgramBuilder(name, gemm=True, family="cross_entropy")
    y = apply_logits_map(p, p.scaled_acc(has_r, has_bias), logits_map)[-1]
    if rounding in (torch.bfloat16, torch.float16):
        y = p.cast(y, dtype=dtype_name(rounding), name="z_stored")
    target = p.operand("target", Kind.PER_ROW)
    lse = p.row_logsumexp(y, name="lse")
    tl = p.select_column(y, target, name="tl")
    loss = p.sub(lse, tl, name="loss")
    if logits_dtype is not None:
        p.output(y, Kind.TILE, dtype_name(logits_dtype))
    p.output(loss, Kind.PER_ROW, stat_dtype)
    p.output(lse, Kind.PER_ROW, stat_dtype)
    return p.build()


@dataclasses.dataclass(frozen=True)
class Plan:
    match: Match
    program: EpilogueProgram
    materialise: bool              # write the logits (read besides the loss, or training)


def plan_for(m: Match, options) -> Plan:
    # written where read, and in training for the backward (eager keeps them too: a
    # recomputing GEMM would cost as much as the forward's)
    trains = bool(meta(m.ce).requires_grad)
    materialise = options.materialize_logits and (bool(m.logits_readers) or trains)
    dtype = meta(m.proj.out).dtype
    program = ce_program(m.proj.r is not None, m.proj.bias is not None,
                         meta(m.logits).dtype if materialise else None,
                         "float64" if dtype == torch.float64 else "float32", m.logits_map,
                         rounding=meta(m.logits).dtype)
    return Plan(m, program, materialise)


# ---- the family's protocol (patterns/family.py) ------------------------------------------

def describe_match(m: Match) -> dict:
    return {"producer": describe(m.proj.out)}


def decide(m: Match, context: Context) -> Decided:
    plan = plan_for(m, context.options)
    why = None if m.proj.local else no_kernel(m.proj.out, "cross_entropy.no_kernel",
                                              (m.proj.weight,), program=plan.program)
    if why is not None:  # e.g. GPT-2's vocabulary of 50257, a float32 LM head
        return Decided.refuse(Rejection(why, describe(m.proj.out)))
    decision = ce_algebra.decide(m, plan.program, plan.materialise)
    if not decision.accepted:
        return Decided.refuse(decision)
    return Decided(decision, plan)


def apply(graph: fx.Graph, plan: Plan, context: Context) -> dict:
    """Replace logits GEMM → cross_entropy by the fused GEMM's per-row losses and the
    reduction."""
    m, program = plan.match, plan.program
    p = m.proj
    vocab = int(meta(p.out).shape[-1])
    dim, start, stop = m.row_slice if m.row_slice is not None else (None, None, None)
    with graph.inserting_before(m.ce):
        x, w, *b = cast_for_gemm(graph, p.out, p.x, p.weight,
                                 *([p.bias] if p.bias is not None else []))
        t = graph.call_function(layouts.row_targets, (m.target, x, vocab, dim, start, stop,
                                                  m.ignore_index))
        r = [p.r] if p.r is not None else []
        call = graph.call_function(ops.fused_linear, (program.to_text(), x, w, *r, *b, t))
        copy_meta(call, m.ce)
        outs = results(graph, call, len(program.outputs), m.ce)
        loss = graph.call_function(layouts.cross_entropy_from_rows, (
            outs[-2], t, m.ignore_index, m.reduction, x, dim, start, stop, meta(m.ce).dtype))
        copy_meta(loss, m.ce)
        if not plan.materialise and m.logits_readers:
            empty = graph.call_function(layouts.unmaterialised_logits, (x,))
    loss.meta.update({k: v for k, v in m.ce.meta.items() if k not in loss.meta})
    m.ce.replace_all_uses_with(loss)
    for reader in m.logits_readers:
        reader.replace_input_with(m.logits, outs[0] if plan.materialise else empty)
    erase_if_dead(graph, [m.ce, *m.chain, *p.nodes])
    return {"programs": [program],
            "materialised": [describe(p.out)] if plan.materialise else []}
