"""A norm producer hands its consumers the raw partials of its sum of squares, and each
consumer's GEMM forms the row scale itself: no finaliser kernel between the GEMMs.

The residual + RMSNorm rewrite (patterns/residual_rmsnorm.py) leaves, per norm, a
producer GEMM whose epilogue writes z, h2 = z ⊙ γ and the per-tile partial sums of z²,
then a finaliser, r = rsqrt(Σ_t P[:, t] / d + eps) (QuACK's rms_final_reduce, a second
kernel launch), and consumer GEMMs that read r as a per-row operand. On the H200 the
finaliser is the norm producer's whole host cost over F.linear (+22 µs a call: the rstd
kernel's launch, its buffer) and, at a few hundred rows, a few µs of GPU time between two
GEMMs (BENCHMARKS.md, sixth, sixteenth and twenty-fifth sessions).

This pass, after the families, rewrites the programs (not the math):

    producer   ss = row_sum(z²);  r = rsqrt(ss / d + eps)  →  ss handed on unmerged
               (output kind ROW_PARTIALS: the kernel's [M, T] partials as it left them)
    consumer   operand r (per row)  →  operand r_partials (ROW_PARTIALS) and, first in its
               body, r = rstd_partials(r_partials, d, eps) (codegen/program.py), which
               the kernel forms per CTA before its epilogue (kernels/epi_ops.py)

Each consumer computes the same r from the same partials (Σ_t in tile order, float32,
the fast-math rsqrt, as rms_final_reduce does; on the reference route the producer
hands on one merged column, [M, 1], and the consumer's sum of one term is that value),
so every value of the graph is what it was: the norm rewrite's proof (a row-sum merge in
any order; algebra/row_scale.py) covers both, and the tests compare the two graphs.

Where it applies, all or nothing per producer: a GEMM program whose only per-row output
is exactly that r (float32, from a 16-bit model), read only by fused calls as a per-row
program operand, whose rewritten programs lower to kernels (a QK-norm's accumulator
prepass cannot read r from partials: such a consumer keeps the finaliser); in a graph
that computes no gradient (the families' backward rules read r as an operand), with no
tensor-parallel shards (a partials operand has no placement rule). How many partials a
row gets is the launch's tile config, chosen by row class from the sizes alone
(quack_path.partial_columns), so in graphs AOTAutograd traces (Inductor's,
cudagraphs=True's) a producer is deferred where every size it takes is static: its
traced call (ops._fake) then has the partials' width, each launch checks that QuACK
planned as many, and a CUDA call that falls back to the reference pads its one merged
column to that width with zeros. A symbolic row count keeps the finaliser. Where a
producer's tiles leave more than quack_path.READER_FOLDS_PARTIALS per row, its launch
sums them to one column first (the consumers' fold costs GPU time that grows with their
number).

Measured on the H200 (BENCHMARKS.md, twenty-sixth session; benchmarks/deferred_rstd.py):
a producer and one consumer at the 1B and 8B widths, 64–4096 rows, 0.93–1.01x the
finaliser's GPU time, and 7–20 µs less host time a pair (but +12 µs where the producer's
launch sums the partials). Under Inductor (H100, thirty-seventh session): a 4-layer
Llama's forward with every GEMM fused 5–29% faster ungraphed and 0.6–1.7% graphed at
64–512 tokens, neutral at 2 × 2048; the norm producer's call +13.8 µs of host time over
F.linear's, from +21.0 with the finaliser.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .canonical import meta
from .codegen.program import EpilogueProgram, Instr, Kind, Operand, Output, parse
from .codegen.quack_source import Unlowerable, generate
from .graph_utils import indexed_results, row_call
from .kernels import sharding

REPORT_LINE = ("norm row scales formed in their consumers' GEMMs from the producer's "
               "partials, no finaliser kernel")

_SIXTEEN_BIT = ("bfloat16", "float16")


def defer(graph: fx.Graph, traced: bool = False) -> int:
    """Rewrite every eligible producer and its consumers; returns how many producers.
    ``traced``: AOTAutograd will trace the graph (Inductor's, cudagraphs=True's), so a
    producer whose sizes are not all static (a dynamic row count) keeps its finaliser."""
    if not _computes_no_gradient(graph):
        return 0
    done = 0
    for call in list(graph.nodes):
        first = row_call(call)
        if first is None or first < 2:  # fused_rowwise: no GEMM, its finaliser is torch ops
            continue
        if traced and not _static_sizes(call):
            continue
        found = _row_scale(parse(call.args[0]))
        if found is None:
            continue
        producer, r_index, d, eps = found
        items = indexed_results(call)
        if items is None or _sharded(call):
            continue
        readers = [u for idx, item in items if idx == r_index for u in item.users]
        r_items = {item for idx, item in items if idx == r_index}
        consumers = _consumers(readers, r_items, d, eps)
        if not readers or consumers is None:
            continue
        call.args = (producer.to_text(),) + call.args[1:]
        for user, text in consumers.items():
            user.args = (text,) + user.args[1:]
        done += 1
    return done


def _computes_no_gradient(graph: fx.Graph) -> bool:
    """No value the graph computes required grad where dynamo traced it (inference: under
    no_grad, or nothing requires grad), and at least one was traced (an untraced graph
    fails closed). Parameters coming in may require grad; what they make may not."""
    traced = [m for n in graph.nodes if n.op in ("call_function", "call_method",
                                                  "call_module")
              for m in [meta(n)] if isinstance(m, torch.Tensor)]
    return bool(traced) and not any(m.requires_grad for m in traced)


def _static_sizes(call: fx.Node) -> bool:
    """Every tensor the call takes has plain-int sizes where dynamo traced it: the width
    of its partials (the launch's tiles along N, by row class: quack_path.partial_columns)
    is then known when AOTAutograd traces it (kernels/ops._fake). A value whose traced
    meta is missing or not a tensor counts as not static (the finaliser stays)."""
    found = []
    fx.node.map_arg(call.args[1:], lambda n: found.append(meta(n)) or n)
    return bool(found) and all(isinstance(m, torch.Tensor) and
                               all(type(s) is int for s in m.shape) for m in found)


def _sharded(call: fx.Node) -> bool:
    """Whether an input of the call is a DTensor shard (tensor parallelism), the weights a
    re-layout call takes as a list included."""
    found = []
    fx.node.map_arg(call.args[1:], lambda n: found.append(sharding.is_dtensor(meta(n))) or n)
    return any(found)


def _row_scale(prog: EpilogueProgram):
    """(the producer's program handing on ss unmerged, index of its r output, d, eps)
    where ``prog`` is a GEMM program whose only per-row output r is exactly
    rsqrt(row_sum(x) / d + eps), float32, beside 16-bit tiles; else None."""
    if not prog.gemm or any(o.kind not in (Kind.TILE, Kind.PER_ROW) for o in prog.outputs):
        return None
    per_row = [i for i, o in enumerate(prog.outputs) if o.kind == Kind.PER_ROW]
    tiles = [o for o in prog.outputs if o.kind == Kind.TILE]
    if len(per_row) != 1 or not tiles or any(o.dtype not in _SIXTEEN_BIT for o in tiles):
        return None
    r_index = per_row[0]
    r_out = prog.outputs[r_index]
    defs = {i.out: i for i in prog.body}
    rsqrt = defs.get(r_out.value)
    add = defs.get(rsqrt.args[0]) if rsqrt is not None and rsqrt.op == "rsqrt" else None
    if r_out.dtype != "float32" or add is None or add.op != "add":
        return None
    literal = [a for a in add.args if not isinstance(a, str)]
    div = [defs.get(a) for a in add.args if isinstance(a, str)]
    if len(literal) != 1 or len(div) != 1 or div[0] is None or div[0].op != "div":
        return None
    div = div[0]
    ss, d = div.args
    if not isinstance(ss, str) or isinstance(d, str) or ss not in defs or \
            defs[ss].op != "row_sum":
        return None
    chain = {rsqrt.out, add.out, div.out}
    reads = [a for i in prog.body if i.out not in chain for a in i.args] + \
        [o.value for o in prog.outputs]
    if any(v in reads for v in (add.out, div.out, ss)) or reads.count(rsqrt.out) != 1:
        return None  # the row stage's values are read elsewhere: not only the norm's r
    body = tuple(i for i in prog.body if i.out not in chain)
    outputs = tuple(Output(ss, Kind.ROW_PARTIALS, "float32") if k == r_index else o
                    for k, o in enumerate(prog.outputs))
    producer = EpilogueProgram(prog.name, prog.gemm, prog.operands, body, outputs,
                               prog.family)
    try:
        generate(producer)
    except Unlowerable:
        return None
    return producer, r_index, float(d), float(literal[0])


def _consumers(readers, r_items, d: float, eps: float) -> dict | None:
    """{consumer call: its rewritten program text} where every reader of r is a fused
    call taking it as per-row program operands only, each program rewritten and
    lowerable; None where one is not."""
    out = {}
    for user in readers:
        if user in out:
            continue
        first = row_call(user)
        if first is None:
            return None
        prog = parse(user.args[0])
        slots = user.args[first:]
        names = [spec.name for spec, a in zip(prog.operands, slots) if a in r_items]
        at = []  # every place r is passed, inside a list argument too
        fx.node.map_arg(user.args, lambda n: at.append(n) if n in r_items else None)
        if not names or len(at) != len(names) or any(
                spec.kind != Kind.PER_ROW for spec, a in zip(prog.operands, slots)
                if a in r_items) or _sharded(user):
            return None
        rewritten = _reading_partials(prog, names, d, eps)
        if rewritten is None:
            return None
        out[user] = rewritten.to_text()
    return out


def _reading_partials(prog: EpilogueProgram, names, d: float, eps: float):
    """``prog`` with each per-row operand in ``names`` taken as row partials and its
    value formed first in the body; None where the names clash or it does not lower."""
    taken = {o.name for o in prog.operands} | {i.out for i in prog.body}
    partials = {n: f"{n}_partials" for n in names}
    if any(p in taken for p in partials.values()):
        return None
    operands = tuple(Operand(partials[o.name], Kind.ROW_PARTIALS) if o.name in partials
                     else o for o in prog.operands)
    body = tuple(Instr(n, "rstd_partials", (partials[n], d, eps)) for n in names) + prog.body
    try:
        rewritten = EpilogueProgram(prog.name, prog.gemm, operands, body, prog.outputs,
                                    prog.family)
        if prog.gemm:
            generate(rewritten)
    except (Unlowerable, ValueError):
        return None
    return rewritten
