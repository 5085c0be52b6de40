"""The log-sum-exp and target-logit family (cross-entropy): dz = softmax(z)·(dloss +
dlse) − onehot(t)·dloss (+ dlogits), and dy = dz·g'(y) where a map z = g(y) stands before
the loss (a soft-cap, a scale; g' is read off z: map_slope), else z = y. z is the
logits as stored: the forward rounded them before its log-sum-exp
(patterns/cross_entropy.ce_program), so its lse normalises the softmax eager
differentiates and the backward reads it, with no pass over the logits of its own.

From stored logits (training, by default) the common case is one pass of QuACK's
cross-entropy backward kernel, (softmax(z) − onehot(t))·dloss per row, a map's g'
applied after it; other cases (a gradient arriving at the logits or lse, CPU) form it by
chunks of rows. When the forward did not write the logits (materialize_logits=False), one
GEMM recomputes them and its epilogue forms softmax(z)·dsm·g' (softmax_grad_program).
Either way dy lands once, in the GEMM dtype, and no float32 [rows, vocab] tensor exists;
then the two GEMMs, the row scale r (a norm deferred into the LM head) applied on their
narrow side: d_acc·b = (dy·b)·r and d_accᵀ·a = dyᵀ·(r·a). dy is eager's own logits
gradient then, inside float16's range wherever eager's is; r·dy (r = 1/rms, about 50 at
initialisation) is not under a loss scale of 2¹⁶."""

from __future__ import annotations

import functools

import torch

from ...codegen.program import EpilogueProgram, Kind, scaled_acc_prefix
from ...codegen import layouts, reference
from .common import Rule, expect, shaped, traced, up, wgrad

_CE_CHUNK_BYTES = 1 << 29
_NO_INDEX = -(2 ** 31)  # QuACK's ignore_index: a value no target takes


def _lse_parts(prog: EpilogueProgram) -> tuple[bool, tuple, str | None]:
    """(whether the cross-entropy program also stores the logits, the map z = g(y)
    before the loss as ((op, constant), ...): patterns/cross_entropy.Match.logits_map,
    the 16-bit dtype its lse and target logit read z rounded to, None for none)."""
    z, i = scaled_acc_prefix(prog)
    logits_map = []
    while prog.body[i].op in ("mul", "div", "tanh") and prog.body[i].args[0] == z:
        ins = prog.body[i]
        expect(ins.args[1:] == () if ins.op == "tanh" else
               len(ins.args) == 2 and isinstance(ins.args[1], float))
        logits_map.append((ins.op, ins.args[1] if ins.op != "tanh" else None))
        z, i = ins.out, i + 1
    expect(sum(op == "tanh" for op, _ in logits_map) <= 1)
    rounded = None
    if prog.body[i].op == "cast" and prog.body[i].args == (z,):
        rounded, z, i = prog.body[i].dtype, prog.body[i].out, i + 1
        expect(rounded in ("bfloat16", "float16"))
    lse, tl, loss = prog.body[i:]
    expect((lse.op, lse.args) == ("row_logsumexp", (z,)))
    expect((tl.op, tl.args) == ("select_column", (z, "target")))
    expect((loss.op, loss.args) == ("sub", (lse.out, tl.out)))
    outs = [(o.value, o.kind) for o in prog.outputs]
    tail = [(loss.out, Kind.PER_ROW), (lse.out, Kind.PER_ROW)]
    expect(outs in (tail, [(z, Kind.TILE), *tail]) and prog.gemm)
    # stored 16-bit logits are read with the forward's lse: it must be of them
    expect(len(outs) == 2 or prog.outputs[0].dtype == rounded or
           prog.outputs[0].dtype in ("float32", "float64"))
    return len(outs) == 3, tuple(logits_map), rounded


def map_slope(logits_map: tuple, z: torch.Tensor) -> torch.Tensor | float:
    """g'(y) from z = g(y) alone (statements.prove_logits_map_derivative): the map's
    steps walked back from z; a scaling contributes its constant, the tanh 1 − t² with
    t = tanh's output, z divided by the scalings after it. 1.0 without a map."""
    slope, t = 1.0, z
    for op, c in reversed(logits_map):
        if op == "tanh":
            slope = slope * (1 - t * t)
            t = None  # at most one tanh: nothing before it needs its input
        else:
            k = c if op == "mul" else 1 / c
            slope = slope * k
            t = t / k if t is not None else None
    return slope


@functools.lru_cache(maxsize=64)
def softmax_grad_program(has_r: bool, has_bias: bool, dtype: str,
                         logits_map: tuple = (), rounded: str | None = None) -> EpilogueProgram:
    """The softmax part of the cross-entropy gradient, formed in the epilogue of the GEMM
    that recomputes the logits: dy = exp(z − lse)·dsm·g'(y), z = g(y) (rounded as the
    forward rounded it before its lse: ``rounded``), y = acc (·r) (+ b). It is stored
    once, in the GEMM dtype; no float32 [rows, vocab] tensor exists. The row scale stays
    out of it (the module docstring says why). (Cached: the backward asks on every
    call.)"""
    from ...codegen.program import ProgramBuilder
    from ...patterns.cross_entropy import apply_logits_map
    p = ProgramBuilder("ce_softmax_grad" if not logits_map else "ce_mapped_softmax_grad",
                       gemm=True)
    steps = apply_logits_map(p, p.scaled_acc(has_r, has_bias), logits_map)
    z = p.cast(steps[-1], dtype=rounded, name="z_stored") if rounded else steps[-1]
    lse, dsm = p.operand("lse", Kind.PER_ROW), p.operand("dsm", Kind.PER_ROW)
    d = p.mul(p.exp(p.sub(z, lse)), dsm, name="d")
    if logits_map:  # g'(y): the scalings' product, and 1 − t² at the tanh's output t
        scale = 1.0
        for (op, c), value in zip(logits_map, steps):
            if op == "tanh":
                d = p.mul(d, p.sub(1.0, p.square(value)), name="d_tanh")
            scale *= 1.0 if op == "tanh" else c if op == "mul" else 1 / c
        if scale != 1.0:
            d = p.mul(d, scale, name="d_map")
    p.output(d, Kind.TILE, dtype)
    return p.build()


def _lse_target_vjp(prog, a, b, operands, outputs, grads):
    from .. import ops
    with_logits, logits_map, rounded = _lse_parts(prog)
    d_logits = grads[0] if with_logits else None
    d_loss, d_lse = grads[-2], grads[-1]
    by_name = dict(zip((o.name for o in prog.operands), operands))
    m, n = a.shape[0], b.shape[0]
    if d_loss is None and d_lse is None and d_logits is None:
        return None, None, [None] * len(operands)
    # the log-sum-exp of the logits as stored (the forward rounded them before it:
    # patterns/cross_entropy.ce_program), so softmax(stored z) with it sums to one
    lse = up(outputs[-1]).reshape(m)
    target_z = lse - up(outputs[-2]).reshape(m) if logits_map else None  # z[t] = lse − loss
    zero = torch.zeros((), dtype=lse.dtype, device=lse.device)
    d_loss = up(d_loss).reshape(m) if d_loss is not None else zero.expand(m)
    dsm = d_loss + (up(d_lse).reshape(m) if d_lse is not None else zero)
    target = by_name["target"].reshape(m).long()
    valid = (target >= 0) & (target < n)
    r = up(by_name["r"]).reshape(m) if "r" in by_name else None
    bias = by_name.get("bias")
    # dy = (softmax(z)·dsm − onehot(t)·dloss + dlogits)·g'(y), in the GEMM dtype
    # traced: fake or functional tensors (torch.compiler.is_compiling() is False while
    # AOTAutograd traces a backward under torch 2.11), or the witness replaying that path
    if with_logits and d_logits is not None and not logits_map and traced([d_logits]):
        dy = traced_softmax_grad(outputs[0], lse, target, d_loss, dsm, d_logits)
        return _gemms_and_operand_grads(prog, a, b, dy, by_name, r, bias, lse)
    if with_logits and _one_pass_violation(outputs[0], d_lse) is None:
        # the common training case: softmax(z) − onehot(t), times dloss per row, one
        # pass over the stored logits (QuACK's cross-entropy backward kernel); a gradient
        # at the returned logits (AOTAutograd passes one for every differentiable output:
        # zeros, when the loop reads only the loss) and a map's derivative g'(z) after it
        dy = torch.empty_like(outputs[0])
        quack_softmax_grad(outputs[0], target, d_loss.contiguous(), lse.contiguous(), dy)
        finish_one_pass(dy, outputs[0], d_logits, logits_map)
        _counted(prog, dy)
        return _gemms_and_operand_grads(prog, a, b, dy, by_name, r, bias, lse)
    if with_logits:  # the forward wrote z: no GEMM recompute, the softmax chunk by chunk
        dy = torch.empty(m, n, dtype=a.dtype, device=a.device)
        rows = max(1, _CE_CHUNK_BYTES // (4 * n))
        for s in range(0, m, rows):
            e = min(m, s + rows)
            z = up(outputs[0][s:e])
            d = torch.exp(z - lse[s:e, None]).mul_(dsm[s:e, None])
            if d_logits is not None:
                d += up(d_logits[s:e])
            if logits_map:
                d *= map_slope(logits_map, z)
            dy[s:e] = d
    else:  # recompute the logits in a GEMM whose epilogue forms the softmax gradient
        bwd = softmax_grad_program(r is not None, bias is not None,
                                   reference.dtype_name(a.dtype), logits_map, rounded)
        ops_in = ([by_name["r"].reshape(m)] if r is not None else []) + \
            ([bias] if bias is not None else []) + [lse, dsm]
        (dy,) = ops.gemm_epilogue(bwd.to_text(), a, b, ops_in)
    _write_target_entries(dy, outputs, with_logits, d_logits, logits_map, lse, target_z,
                          target, valid, d_loss, dsm)
    return _gemms_and_operand_grads(prog, a, b, dy, by_name, r, bias, lse)


def _write_target_entries(dy, outputs, with_logits, d_logits, logits_map, lse, target_z,
                          target, valid, d_loss, dsm) -> None:
    """Each row's entry at its target column, formed whole in float32 and rounded once,
    as eager rounds its float32 logits gradient once: (p_t·dsm (+ dlogits_t))·g'(z_t) −
    dloss·g'(z_t), p_t = exp(z_t − lse), written over what dy holds there (M entries,
    shapes static; an ignored row keeps its entry). Adding −dloss to the entry already
    rounded to the GEMM dtype rounded it twice: the target entries, dy's largest, then
    carried about twice eager's error (found under bf16 autocast on Hugging Face's loss:
    the LM head's gradients 1.4–2x eager's error against float64, 2026-12-06).

    z_t: the stored logit where the forward wrote them (the softmax above read those),
    else lse − loss: the logit rounded as the forward's lse read it, as the recomputing
    GEMM's are."""
    m, n = dy.shape
    rows_idx = torch.arange(m, device=dy.device)
    col = target.clamp(0, n - 1)
    if with_logits:
        z_t = up(outputs[0][rows_idx, col])
    else:
        z_t = lse - up(outputs[-2]).reshape(m)
    val = torch.exp(z_t - lse) * dsm
    if with_logits and d_logits is not None:
        val = val + up(d_logits[rows_idx, col])
    onehot = d_loss
    if logits_map:  # the target's own z for the one-hot's g' (lse − loss: no gather)
        val = val * map_slope(logits_map, z_t)
        onehot = onehot * map_slope(logits_map, target_z)
    dy[rows_idx, col] = torch.where(valid, val - onehot, up(dy[rows_idx, col])).to(dy.dtype)


def traced_softmax_grad(z, lse, target, d_loss, dsm, d_logits) -> torch.Tensor:
    """dy = softmax(z)·dsm − onehot(t)·dloss + dlogits from the stored logits z, as one
    expression for a traced backward (AOTAutograd): Inductor makes it one pass that reads
    z and dlogits and writes dy, no float32 [rows, vocab] tensor in memory.

    Why not QuACK's one-pass kernel here: a compiled forward that returns the logits (a
    Hugging Face model does) gets a gradient for them in its backward, zeros when the
    loop reads only the loss (an autograd.Function's missing gradients are materialised),
    and adding it after the kernel is a second pass over dy: on the H200 at 8192 ×
    128256 the kernel took 1.07 ms and the pass adding dlogits 1.8 ms (BENCHMARKS.md,
    seventeenth session). One fused pass reads one tensor of that size fewer."""
    d = torch.exp(up(z) - lse[:, None]) * dsm[:, None]
    columns = torch.arange(z.shape[1], device=z.device)
    hit = columns[None, :] == target[:, None]  # an ignored target matches no column
    d = d - torch.where(hit, d_loss[:, None], torch.zeros((), dtype=d.dtype, device=d.device))
    d = d + up(d_logits)
    return d.to(z.dtype)


def quack_softmax_grad(z, target, scale, lse, out) -> None:
    """out := (softmax(z) − onehot(target))·scale per row: QuACK's cross-entropy backward
    kernel. A target out of range (ignored) matches no column: that row's softmax·scale
    stays, as the op's own loss row lse − 0 says; no index is "ignored" by QuACK. Through
    the registered op, not QuACK's eager shortcut: AOTAutograd traces the backward with
    fake tensors outside dynamo, where the shortcut would run the kernel's body."""
    import quack.cross_entropy  # noqa: F401  (registers quack::cross_entropy_bwd_out)
    torch.ops.quack.cross_entropy_bwd_out(z, target, scale, lse, out, None, _NO_INDEX)


def finish_one_pass(dy, z, d_logits, logits_map) -> None:
    """dy := (dy + dlogits)·g'(z) in place, by chunks of rows (one fused pass under
    Inductor), given dy = (softmax(z) − onehot(t))·dloss from the one-pass kernel;
    nothing to do without a gradient at the logits and without a map."""
    if d_logits is None and not logits_map:
        return
    m, n = dy.shape
    rows = max(1, _CE_CHUNK_BYTES // (4 * n))
    for s in range(0, m, rows):
        e = min(m, s + rows)
        d = up(dy[s:e])
        if d_logits is not None:
            d = d + up(d_logits[s:e])
        if logits_map:
            d = d * map_slope(logits_map, up(z[s:e]))
        dy[s:e] = d


def _one_pass_violation(logits, d_lse) -> str | None:
    """Why QuACK's one-pass kernel cannot form dy from these stored logits (None: it
    can). It computes (softmax(z) − onehot(t))·s per row: no gradient arriving at lse (one
    at the logits and a map's derivative are applied after it: finish_one_pass)."""
    from .. import quack_path
    if d_lse is not None:
        return "a gradient at lse"
    if logits.dtype not in (torch.bfloat16, torch.float16) or not logits.is_contiguous():
        return "logits not 16-bit and contiguous"
    return quack_path.device_violation(logits) or quack_path.quack_available()


def _counted(prog, dy) -> None:
    """Runtime accounting of the one-pass backward kernel (not while tracing: fake or
    functional tensors)."""
    if layouts.real([dy]):
        from .. import ops
        ops._count(prog, "backward kernel", "QuACK cross_entropy_bwd from stored logits")


def _gemms_and_operand_grads(prog, a, b, dy, by_name, r, bias, lse):
    """Given dy at y = r ⊙ acc (+ bias): grad_a = (dy·b)·r, grad_b = dyᵀ·(r·a), and the
    row scale's and the bias's gradients (no r: grad_a = dy·b, grad_b = dyᵀ·a)."""
    m, n = a.shape[0], b.shape[0]
    grads_by_name = {}
    if r is None:
        grad_a, grad_b = dy @ b, wgrad(dy, a)
    else:
        g = dy @ b                                       # G = dy·b, [M, K]
        grad_a = (up(g) * r[:, None]).to(a.dtype)
        grad_b = wgrad(dy, a, r[:, None])
        # dy/dr = acc: Σ_j dy·acc = Σ_k a·(dy·b), a row dot on the narrow side
        grads_by_name["r"] = (up(g) * up(a)).sum(-1).to(
            by_name["r"].dtype).reshape(by_name["r"].shape)
    if bias is not None:  # Σ_i dy, by chunks of rows (float32 sums of a 16-bit dy)
        gb = torch.zeros(n, dtype=lse.dtype, device=a.device)
        rows = max(1, _CE_CHUNK_BYTES // (4 * n))
        for s in range(0, m, rows):
            gb += up(dy[s:min(m, s + rows)]).sum(0)
        grads_by_name["bias"] = gb.to(bias.dtype)
    return grad_a, grad_b, [grads_by_name.get(o.name) for o in prog.operands]


def _lse_target_saves(prog):
    """The logits (when written), the loss (the target's z = lse − loss: with a map, and
    where the backward recomputes the logits, for the target entry, M floats) and lse."""
    with_logits, logits_map, _ = _lse_parts(prog)
    keep = [0, 2] if with_logits else [0, 1]
    if logits_map:
        keep = sorted({*keep, len(prog.outputs) - 2})
    return keep, set()


# (applies to, rule, what the forward must keep: (output indices, operands not needed))


RULE = Rule(shaped(_lse_parts), _lse_target_vjp, _lse_target_saves)
