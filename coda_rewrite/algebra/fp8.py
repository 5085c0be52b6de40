"""Legality of the FP8 gated MLP (patterns/fp8_mlp.py): the gated rewrite's own conditions,
the bound's, and a replay that holds FP8 to torchao's row-wise recipe.

What is proved (statements.prove_fp8_gated_mlp): the scales leave the GEMMs exactly, and
no scaled value leaves e4m3's range, from the norm (|n_k| ≤ √N), Cauchy–Schwarz and
|act(g)| ≤ |g|. What that needs of the matched graph, each checked here:

* the gated rewrite's side conditions (gated.side_conditions: one input, gate/up/act read
  only by the product, one dtype, no update in place in between) and the down
  projection as the product's only reader (gated.down_conditions);
* the projections read the RMSNorm's output itself (the pattern matched that), with the
  activation one whose |act(g)| ≤ |g| (SiLU, both GELUs, the clamped SwiGLU: clamps only
  shrink magnitudes);
* no bias on any of the three projections (the bound would need each bias's size);
* nothing updates γ or a weight in place between eager's reads and the fused ops' (the
  quantised input is computed right after the norm's output, where eager reads z).

FP8 is not exact, so the replay is not the bf16 families' 1e-6: on random float64
inputs at small shapes (and one row that puts all its mass on one feature, aligned with
one gate/up weight row: the bound's worst case), the FP8 path's error against float64
must be within 1.5x of torchao's row-wise recipe (dynamic per-row activation scales,
per-row weight scales) on the same values, plus 1% — the numerics policy of README's
"FP8". A replay that cannot run refuses the rewrite.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..canonical import canon, meta
from ..capture import describe
from ..codegen import fp8 as fp8_math
from ..codegen import reference
from ..codegen.program import parse
from ..graph_utils import updated_between
from ..numerics import rel_err
from . import gated, sharding, statements
from .decision import Decision, Proof, Rejection, RejectionKind, Why
from .witness import eval_nodes, guarded, verdict

BOUNDED = (*fp8_math.BOUNDED_ACTIVATIONS, "swiglu_clamp")
# the replay's bar against torchao's row-wise recipe (README, "FP8")
VS_ROWWISE, FLOOR = 1.5, 0.01


def conditions(m) -> tuple[list[str], Why | None]:
    g, down, norm = m.gated, m.down, m.norm
    held, why = gated.side_conditions(g)
    if why is not None:
        return held, why
    more, why = gated.down_conditions(g, down)
    held += more
    if why is not None:
        return held, why
    if g.op not in BOUNDED:
        return held, Why(f"the gate activation of {g.op} has no |act(g)| ≤ |g| bound: its "
                         "product's range is not known before the GEMM (gate and up go on "
                         "as linears of the norm: fp8_linear)", "fp8.activation")
    held.append(f"{g.op}: |act(g)| ≤ |g|")
    if g.gate.bias is not None or g.up.bias is not None or down.bias is not None:
        return held, Why("a projection has a bias: the product's bound would need its size; "
                         "gate and up go on as linears of the norm (fp8_linear), the down "
                         "projection in bf16", "fp8.bias")
    held.append("no bias on gate, up or down")
    projections = (g.gate,) if g.packed else (g.gate, g.up)
    order = {n: i for i, n in enumerate(down.linear.graph.nodes)}
    first = min((n for p in projections for n in p.nodes if n in order), key=order.get)
    read_later = [p.weight for p in projections] + ([norm.weight] if norm.weight is not None
                                                   else [])
    # (the quantised input is computed right after the norm's output: it reads z there)
    moved = updated_between(read_later, first, down.linear)
    if moved is not None:
        return held, Why(f"{describe(moved[0])} updates {describe(moved[1])} in place where "
                         "the FP8 MLP reads it later than eager did", "fp8.in_place")
    held.append("nothing it reads is updated in place between eager's reads and its own")
    return held, None


def decide(m, gate_up, down) -> Decision:
    held, failed = conditions(m)
    if failed:
        return Rejection(failed, m.path)
    proof = statements.prove_fp8_gated_mlp()
    seen = guarded(lambda m: _replay(m, gate_up, down), m)
    if isinstance(seen, Rejection):
        return seen
    return Proof(proof.statement, (*proof.assumptions, *held), proof.steps, seen)


def _norm_inputs(norm, rows: int, gen: torch.Generator):
    """(rand, env, z, eps, γ) of a replay: ``rows`` random float64 rows into the norm, the
    first with its whole mass on feature 3 (|n_3| = √N: the input's bound), the second
    small, eps and γ bound where the graph reads them."""
    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    env: dict = {"__gen__": gen}
    z = rand(rows, norm.dim)
    z[0] = 0
    z[0, 3 % norm.dim] = 5.0
    z[1] *= 1e-2  # mean(z²) ≈ 1e-4: an eps other than the graph's shows here
    env[norm.input] = z
    eps = norm.eps if isinstance(norm.eps, float) else 1e-6
    if not isinstance(norm.eps, float):
        env[norm.eps] = torch.tensor(eps, dtype=torch.float64)
    gamma = rand(norm.dim).abs() + 0.5
    if norm.weight is not None:
        env[norm.weight] = gamma - norm.weight_offset
    return rand, env, z, eps, gamma


# ops whose result is a choice among values (an index, an order): a rounding can flip it
_CHOICES = {torch.topk, torch.argmax, torch.argmin, torch.sort, torch.argsort, torch.max,
            torch.min, torch.multinomial, "topk", "argmax", "argmin", "sort", "argsort",
            "max", "min", torch.ops.aten.topk.default, torch.ops.aten.argmax.default,
            torch.ops.aten.argmin.default, torch.ops.aten.sort.default}
# losses whose logits another family fuses with their GEMM (patterns/cross_entropy.py)
_LOSSES = {F.cross_entropy, F.nll_loss, torch.ops.aten.nll_loss_forward.default}
# ops that multiply what they read by something else: a search for what a linear's output
# feeds stops there (what is past them reads another product, not this linear's values)
_PRODUCTS = {"linear", "matmul", "grouped_mm"}
_OTHER_PRODUCTS = {torch.bmm, torch.einsum, torch.baddbmm, "bmm", "baddbmm",
                   F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention,
                   torch.ops.aten.mm.default, torch.ops.aten.bmm.default,
                   torch.ops.aten.addmm.default}


def _is_product(node) -> bool:
    if node.target in _OTHER_PRODUCTS:
        return True
    c = canon(node)
    return c is not None and c.name in _PRODUCTS


def first_reader(node, targets):
    """The first op among ``targets`` that reads ``node``'s values through any chain of
    ops that does not multiply them by another operand (elementwise maps, softmax, casts,
    views, reductions: however long the spelling), or None. A chain ends at a GEMM or an
    attention: past it, the values are another product's (a linear two GEMMs upstream of
    a router perturbs its choice no more than any bf16 rounding upstream does in eager)."""
    frontier, seen = [node], {node}
    while frontier:
        nxt = []
        for n in frontier:
            for u in n.users:
                if u.target in targets:
                    return u
                if u not in seen and not _is_product(u):
                    seen.add(u)
                    nxt.append(u)
        frontier = nxt
    return None


def choice_refusal(node) -> Why | None:
    """Why a linear whose output a choice reads (first_reader) stays bf16, or None: FP8's
    rounding of a router's logits would change which experts (or tokens) are chosen, not
    only by how much, a discrete change no error bar covers. (max/min with a dim also
    return indices; without one they are a value, counted here too: a cheap refusal, not
    a wrong one.)"""
    choice = first_reader(node, _CHOICES)
    if choice is None:
        return None
    return Why(f"{describe(node)} feeds {describe(choice)}, which chooses among its values "
               "(a router's top-k): an FP8 rounding could change the choice; it runs in bf16",
               "fp8.routing")


def loss_refusal(node) -> Why | None:
    """Why a linear whose output a cross-entropy reads (an LM head) stays bf16, or None:
    the cross-entropy family fuses the head with its loss (in training, no logits written
    at all), the larger win; float8 training recipes commonly leave the output layer in
    high precision too."""
    loss = first_reader(node, _LOSSES)
    if loss is None:
        return None
    return Why(f"{describe(node)} feeds {describe(loss)}: the head stays bf16 for the "
               "cross-entropy family, which fuses it with the loss", "fp8.loss_head")


def linear_refusal(node, x, w, b) -> Why | None:
    """Why the linear ``node`` (canonically ``linear(x, w, b)``) cannot run in FP8 at all,
    or None: both FP8 linear families ask this first (patterns/fp8_linear.py,
    patterns/fp8_rowwise.py)."""
    mw = meta(w) if isinstance(w, fx.Node) else None
    if not isinstance(x, fx.Node) or mw is None or mw.dim() != 2 or (
            b is not None and (not isinstance(b, fx.Node) or meta(b) is None
                               or meta(b).dim() != 1)):
        return Why(f"{describe(node)}'s input or weight is not a graph value (or its weight "
                   "not 2-D, its bias not 1-D)", "fp8.weight")
    if sharding.is_dtensor(w):
        return Why(f"{describe(node)} runs on a sharded weight (tensor parallelism): its FP8 "
                   "weight would be the shard's", "fp8.sharded")
    return choice_refusal(node) or loss_refusal(node)


def rowwise(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """torchao's float8 row-wise recipe for x·wᵀ, emulated: x's rows and w's rows each
    scaled by their own amax to ±448, rounded to e4m3, multiplied, scaled back."""
    qx, sx = fp8_math.quantize_rows(x)
    qw, sw = fp8_math.quantize_rows(w)
    return (qx.double() @ qw.double().T) * sx.double()[:, None] * sw.double()[None, :]


def _replay(m, gate_up, down) -> str | Rejection:
    g, norm = m.gated, m.norm
    gen = torch.Generator().manual_seed(8191)
    # the norm's own width: a fused norm (F.rms_norm) carries its normalized_shape
    k, n, h, rows = norm.dim, 24, 16, 6
    rand, env, z, eps, gamma = _norm_inputs(norm, rows, gen)
    wg, wu, wd = rand(n, k), rand(n, k), rand(h, n)
    wg[0] = wu[0] = 0
    wg[0, 3 % k] = wu[0, 3 % k] = 1.0
    if g.packed:
        env[g.gate.weight] = torch.cat([wu, wg] if g.up_first else [wg, wu])
    else:
        env[g.gate.weight], env[g.up.weight] = wg, wu
    env[m.down.weight] = wd
    # the norm as the model spells it, its output back in float64 (a norm that ends in a
    # cast to the model's dtype, Helium's, would otherwise feed bf16 into the GEMMs)
    eval_nodes([n for n in norm.nodes if n not in env], env)
    env[norm.output] = env[norm.output].double()
    nodes = [*g.gate.nodes, *g.up.nodes, *g.intermediates, g.act, g.mul, *m.down.between,
             m.down.linear]
    eval_nodes(dict.fromkeys(n for n in nodes if n not in env), env)
    ref = env[m.down.linear].reshape(rows, h)

    raw_gamma = env[norm.weight] if norm.weight is not None else None
    w_int, ws_int, w_d, ws_d = fp8_math.mlp_weights(wg, wu, wd, raw_gamma,
                                                       norm.weight_offset, k)
    q = fp8_math.quantize_normalized(z, eps, k)
    (act,) = reference.run_program(gate_up, q, w_int, [ws_int])
    if act.float().abs().max() > fp8_math.E4M3_MAX:
        return Rejection("checker bug: a scaled gated product left e4m3's range (the bound "
                         "does not hold); the rewrite is not applied", m.path,
                         RejectionKind.WITNESS_DISAGREES, "witness.disagrees")
    (out,) = reference.run_program(down, fp8_math.saturate(act), w_d, [ws_d])
    err = rel_err(out, ref)

    hh = env[norm.output].reshape(rows, -1)  # the graph's own norm: its eps, its γ
    y = rowwise(hh, torch.stack([wg, wu], 1).reshape(2 * n, k))
    prod = _pair(g, y)
    base = rel_err(rowwise(prod, wd), ref)
    return verdict(err, f"rows {rows}, N {k} (torchao row-wise: {base:.1e})", m.path,
                   tol=VS_ROWWISE * base + FLOOR)


def _pair(g, y: torch.Tensor) -> torch.Tensor:
    """The pair op on interleaved columns in float64, from the op table's reference."""
    from ..codegen.op_table import OPS
    from ..codegen.program import Instr
    ins = Instr("p", g.op, ("y", *g.params))
    return OPS[g.op].reference([y, *g.params], ins, torch.float64)


# ---- the linears of a normalised row (patterns/fp8_linear.py) -----------------------

def stacked_columns(linears, rows_of) -> tuple[list, list[tuple[int, int]]]:
    """The stacked GEMM of a norm's linears: its (weight, bias) pairs, each once (a module
    called twice on the norm's output reads the same ones: its columns are computed once),
    and each linear's column range [lo, hi) of the GEMM's output. ``rows_of(weight)``:
    the weight's output width. Shared by the rewrite and its replay."""
    pairs, starts, columns, start = [], {}, [], 0
    for lin in linears:
        key = (lin.weight, lin.bias)
        if key not in starts:
            starts[key] = start
            pairs.append(key)
            start += int(rows_of(lin.weight))
        lo = starts[key]
        columns.append((lo, lo + int(rows_of(lin.weight))))
    return pairs, columns


def linear_conditions(m) -> tuple[list[str], Why | None]:
    """What the FP8 linears need of the matched graph: weights it can read before the
    first of them, in a graph without gradients, and nothing it reads updated in place
    between eager's reads and its own (it reads every weight at the first linear and the
    norm's input right after the norm)."""
    held = []
    order = {n: i for i, n in enumerate(m.norm.output.graph.nodes)}
    first = min((lin.node for lin in m.linears), key=order.get)
    for lin in m.linears:
        for t in (lin.weight, lin.bias):
            if t is not None and order[t] > order[first] and t.op != "get_attr":
                return held, Why(f"{describe(t)} is computed after {describe(first)}, where "
                                 "the one FP8 GEMM of every linear would read it",
                                 "fp8.weight_order")
    held.append("every weight and bias is a module attribute, a graph input or computed "
                "before the first linear")
    last = max((lin.node for lin in m.linears), key=order.get)
    read = [t for lin in m.linears for t in (lin.weight, lin.bias) if t is not None]
    read += [m.norm.weight] if m.norm.weight is not None else []
    moved = updated_between(read, m.norm.output, last)
    if moved is not None:
        return held, Why(f"{describe(moved[0])} updates {describe(moved[1])} in place where "
                         "the FP8 GEMM reads it at another point than eager", "fp8.in_place")
    held.append("nothing it reads is updated in place between the norm and the last linear")
    return held, None


def decide_linears(m, program) -> Decision:
    held, failed = linear_conditions(m)
    if failed:
        return Rejection(failed, m.path)
    proof = statements.prove_fp8_normalized_linears()
    seen = guarded(lambda m: _replay_linears(m, program), m)
    if isinstance(seen, Rejection):
        return seen
    return Proof(proof.statement, (*proof.assumptions, *held), proof.steps, seen)


def _replay_linears(m, program) -> str:
    norm = m.norm
    gen = torch.Generator().manual_seed(8209)
    # 32 rows: FP8's error on a few values is a noisy draw, and the bar is a ratio of two
    k, rows = norm.dim, 32
    rand, env, z, eps, gamma = _norm_inputs(norm, rows, gen)
    # one value per weight (and bias) node: two linears may read the same one (a module
    # called twice on the norm's output), and their columns are then the same
    for i, lin in enumerate(m.linears):
        if lin.weight not in env:
            env[lin.weight] = rand(7 + 3 * i, k)
        if lin.bias is not None and lin.bias not in env:
            env[lin.bias] = rand(env[lin.weight].shape[0])
    pairs, columns = stacked_columns(m.linears, lambda w: env[w].shape[0])
    weights = [env[w] for w, _ in pairs]
    biases = [None if b is None else env[b] for _, b in pairs]
    eval_nodes([n for n in norm.nodes if n not in env], env)
    env[norm.output] = env[norm.output].double()
    nodes = [n for lin in m.linears for n in lin.nodes]
    eval_nodes(dict.fromkeys(n for n in nodes if n not in env), env)
    ref = torch.cat([env[lin.node].reshape(rows, -1) for lin in m.linears], dim=-1)

    w8, ws, b = fp8_math.linear_weights(weights, biases, gamma if norm.weight is not None
                                        else None, 0.0, k)
    q = fp8_math.quantize_normalized(z, eps, k)
    (out,) = reference.run_program(program, q, w8, [ws] if b is None else [ws, b])
    # each linear's output its column range of the one GEMM's, as apply slices it
    out = torch.cat([out[:, lo:hi] for lo, hi in columns], dim=-1)
    err = rel_err(out, ref)

    hh = env[norm.output].reshape(rows, -1)  # the graph's own norm: its eps, its γ
    base = rowwise(hh, torch.cat([env[lin.weight] for lin in m.linears]))
    base = base + torch.cat([torch.zeros(env[lin.weight].shape[0], dtype=base.dtype)
                             if lin.bias is None else env[lin.bias] for lin in m.linears])
    base = rel_err(base, ref)
    return verdict(err, f"rows {rows}, N {k}, {len(m.linears)} linear(s) (torchao row-wise: "
                   f"{base:.1e})", m.path, tol=VS_ROWWISE * base + FLOOR)


# ---- a linear of row-wise scaled rows (patterns/fp8_rowwise.py) ---------------------

def decide_rowwise(m, program, trains: bool = False) -> Decision:
    """Nothing moves: the quantisation and the GEMM run where eager's linear ran, on what
    it read. The replay holds the kernel's math to the recipe it implements, and in a
    training graph the backward's two FP8 GEMMs to the same recipe's."""
    proof = statements.prove_fp8_rowwise_linear()
    seen = guarded(lambda m: _replay_rowwise(m, program, trains), m)
    if isinstance(seen, Rejection):
        return seen
    return Proof(proof.statement, (*proof.assumptions,
                                   "the quantisation and the GEMM run where eager's linear "
                                   "ran, on the values it read"), proof.steps, seen)


def _replay_rowwise(m, program, trains: bool) -> str | Rejection:
    gen = torch.Generator().manual_seed(8219)
    k, n, rows = m.in_features, 24, 32
    x = torch.randn(rows, k, generator=gen, dtype=torch.float64)
    x[0] = 0           # a zero row: scale 1, exact zeros
    x[1, 0] = 1e4      # an outlier: its row's own scale
    w = torch.randn(n, k, generator=gen, dtype=torch.float64)
    b = torch.randn(n, generator=gen, dtype=torch.float64) if m.bias is not None else None
    env = {"__gen__": gen, m.x: x, m.weight: w}
    if b is not None:
        env[m.bias] = b
    eval_nodes([m.node], env)
    ref = env[m.node].reshape(rows, n)
    r = fp8_math.row_scales(x)
    w8, ws, bb = fp8_math.rowwise_weights(w, b)
    (out,) = reference.run_program(program, fp8_math.quantize_by(x, r), w8,
                                   [r.reshape(-1), ws] + ([] if bb is None else [bb]))
    base = rowwise(x, w) + (0 if b is None else b)
    err, base = rel_err(out, ref), rel_err(base, ref)
    seen = verdict(err, f"rows {rows}, K {k} (torchao row-wise: {base:.1e})", m.path,
                   tol=VS_ROWWISE * base + FLOOR)
    if not trains or isinstance(seen, Rejection):
        return seen
    return _replay_rowwise_grads(m, x, w, gen, seen)


def _replay_rowwise_grads(m, x, w, gen, seen: str) -> str | Rejection:
    """The backward (codegen/fp8.rowwise_grads, as the op's backward runs it) against the
    exact gradients, each GEMM held to the recipe emulated: dy's rows with W's columns,
    dy's columns with x's columns."""
    dy = torch.randn(x.shape[0], w.shape[0], generator=gen, dtype=torch.float64)
    dy[2] = 0           # a token with no gradient
    dy[:, 1] *= 1e3     # an output feature with large gradients: its column's own scale
    dx, dw = fp8_math.rowwise_grads(dy, x, w, True, True, _reference_gemm)
    lines = [seen]
    for what, got, exact, recipe in (("dx", dx, dy @ w, rowwise(dy, w.T)),
                                     ("dW", dw, dy.T @ x, rowwise(dy.T, x.T))):
        err, base = rel_err(got, exact), rel_err(recipe, exact)
        said = verdict(err, f"{what} (torchao row-wise: {base:.1e})", m.path,
                       tol=VS_ROWWISE * base + FLOOR)
        if isinstance(said, Rejection):
            return said
        lines.append(said)
    return "; ".join(lines)


def _reference_gemm(text, a, b, operands):
    return reference.run_program(parse(text), a, b, operands)
