"""Backward of ``coda::gemm_epilogue``: no GEMM is recomputed, and every GEMM runs on
the 16-bit operands (tensor cores, float32 accumulation), as eager's backward does.

For out = f(acc, θ) with acc = a·bᵀ, the backward is two GEMMs around the epilogue's
vector-Jacobian product:  d_acc = (∂f/∂acc)ᵀ·d_out,  grad_a = d_acc·b,
grad_b = d_accᵀ·a.  Where the VJP needs the accumulator itself it is read back from
what the forward kept, never recomputed:

* ``rowscale`` (y = r ⊙ acc + bias): d_acc = r ⊙ dy, and the one term that needs acc,
  dr[i] = Σ_j dy[i, j]·acc[i, j], equals Σ_k a[i, k]·(dy·b)[i, k]: a row dot with the
  GEMM the backward computes anyway (G = dy·b, grad_a = r ⊙ G). The backward keeps the
  GEMM + epilogue shape (the CODA paper's Theorem 1).
* ``residual_rmsnorm`` / ``rmsnorm_rowscale``: everything depends on z = acc + residual,
  which the forward stores (the residual stream); r is stored too.
  dz_total = dz + dh2 ⊙ γ' − dr ⊙ r³ ⊙ z / d.

* ``gated`` (p = r ⊙ acc + bias; y = act(p[:, 0::2]) ⊙ p[:, 1::2]): the forward
  stores p (what eager keeps as the gate and up outputs) next to y; dp comes from the
  activation's derivative on p, and the rest is the rowscale rule with dy := dp.

* ``rope`` (y = r ⊙ acc + bias; out = R(θ)·y per column pair): dy = R(−θ)·dout, an
  elementwise rotation back, then the rowscale rule.

* ``lse_target`` (y = r ⊙ acc + bias; loss = lse(y) − y[t]; lse): dy = softmax(y)·(dloss
  + dlse) − onehot(t)·dloss (+ dlogits). When the forward did not write the logits, one
  GEMM recomputes them and its epilogue forms r·softmax(y)·dsm (softmax_grad_program:
  a generated kernel on Hopper); from stored logits it is formed by chunks of rows.
  Either way it lands once, in the GEMM dtype, the one-hot term is an index update of
  M elements, and no float32 [rows, vocab] tensor exists; then the two GEMMs.

Each specialised rule states the program shape it applies to and checks it
(``matches``); any other program takes the general rule: the accumulator recomputed as
one 16-bit GEMM and the epilogue differentiated by autograd on the reference.
"""

from __future__ import annotations

import functools

import torch

from ..codegen.program import ACC, EpilogueProgram, Kind, scaled_acc_prefix
from . import reference


def _up(t: torch.Tensor) -> torch.Tensor:
    """The compute dtype of the forward: float32, or float64 for a float64 model."""
    return t.to(torch.float64 if t.dtype == torch.float64 else torch.float32)


class OtherShape(Exception):
    """A program is not of the shape a specialised rule's parser reads."""


def _expect(condition: bool) -> None:
    """A shape parser's check: a plain ``if``, never an ``assert`` (``python -O`` strips
    those, and a rule would then be taken for a program it does not fit)."""
    if not condition:
        raise OtherShape


def _shaped(parts):
    """A predicate from a program-shape parser: ``parts(prog)`` raises OtherShape on
    another shape (each rule parses its program once, and the parse is its test)."""
    def matches(prog: EpilogueProgram) -> bool:
        try:
            parts(prog)
            return True
        except (OtherShape, ValueError, KeyError, IndexError):  # unpacking a short body
            return False
    return matches


def _gemm_grads(d_acc: torch.Tensor, a, b):
    """grad_a = d_acc·b, grad_b = d_accᵀ·a, in the operands' dtype."""
    d = d_acc.to(a.dtype)
    return d @ b, d.t() @ a


# ---- rowscale -------------------------------------------------------------------------

def _is_rowscale(prog: EpilogueProgram) -> bool:
    v, i = scaled_acc_prefix(prog)
    names = [o.name for o in prog.operands]
    return prog.gemm and names[:1] == ["r"] and set(names) <= {"r", "bias"} and \
        i == len(prog.body) == len(names) and [o.value for o in prog.outputs] == [v]


def _rowscale_vjp(prog, a, b, operands, outputs, grads):
    (dy,) = grads
    if dy is None:
        return None, None, [None] * len(operands)
    return _through_scaled_acc(prog, a, b, operands, _up(dy))


# ---- residual + RMSNorm ---------------------------------------------------------------

def _residual_rmsnorm_parts(prog):
    """z = acc (+ bias) + residual  |  z = x;  [s = gamma + c];  h2 = z * s or h2 = z;
    ss = row_sum(square(z)); r = rsqrt(ss / d + eps) -> outputs (z,) h2, r."""
    body = list(prog.body)
    kinds = {o.name: o.kind for o in prog.operands}
    names = [o.name for o in prog.operands]
    i = 0
    if prog.gemm:
        if body[i].args == (ACC, "bias"):
            _expect(body[i].op == "add" and kinds["bias"] == Kind.PER_FEATURE)
            i += 1
        _expect(body[i].op == "add" and body[i].args[1] == "residual")
        z = body[i].out
        i += 1
    else:
        _expect(names[0] == "x" and kinds["x"] == Kind.TILE)
        z = "x"
    offset = 0.0
    h2 = z
    if "gamma" in kinds:
        if body[i].op == "add" and body[i].args[0] == "gamma":
            offset = float(body[i].args[1])
            i += 1
        _expect(body[i].op == "mul" and body[i].args[0] == z)
        h2 = body[i].out
        i += 1
    sq, ss, mean, den, r = body[i:i + 5]
    _expect((sq.op, sq.args) == ("square", (z,)))
    _expect((ss.op, ss.args) == ("row_sum", (sq.out,)))
    _expect(mean.op == "div" and mean.args[0] == ss.out and not isinstance(mean.args[1], str))
    _expect(den.op == "add" and den.args[0] == mean.out)
    _expect((r.op, r.args) == ("rsqrt", (den.out,)))
    _expect(len(body) == i + 5)
    outs = [o.value for o in prog.outputs]
    _expect(outs == ([z] if prog.gemm else []) + [h2, r.out])
    return dict(z=z, offset=offset, d=float(mean.args[1]), has_gamma="gamma" in kinds)


def _residual_rmsnorm_vjp(prog, a, b, operands, outputs, grads):
    parts = _residual_rmsnorm_parts(prog)
    by_name = dict(zip((o.name for o in prog.operands), operands))
    if prog.gemm:
        dz, dh2, dr = grads
        z, _, r = outputs
    else:
        dh2, dr = grads
        dz = None
        z = by_name["x"]
        r = outputs[1]
    zf, rf = _up(z), _up(r)[:, None]
    total = torch.zeros_like(zf) if dz is None else _up(dz).clone()
    grad_gamma = None
    if dh2 is not None:
        if parts["has_gamma"]:
            scale = _up(by_name["gamma"]) + parts["offset"]
            total += _up(dh2) * scale
            grad_gamma = (_up(dh2) * zf).sum(0).to(by_name["gamma"].dtype)
        else:
            total += _up(dh2)
    grad_eps = None
    if dr is not None:
        drf = _up(dr)[:, None]
        total += drf * (-(rf ** 3) / parts["d"]) * zf
        grad_eps = (drf * (-0.5) * rf ** 3).sum()
    grads_by_name = {"gamma": grad_gamma}
    if prog.gemm:
        grads_by_name["residual"] = total.to(by_name["residual"].dtype)  # a dtype stand-in
        if "bias" in by_name:
            grads_by_name["bias"] = total.sum(0).to(by_name["bias"].dtype)
        grad_a, grad_b = _gemm_grads(total, a, b)
    else:
        grads_by_name["x"] = total.to(z.dtype)
        grad_a = grad_b = None
    if "eps" in by_name and grad_eps is not None:
        grads_by_name["eps"] = grad_eps.to(by_name["eps"].dtype).reshape(by_name["eps"].shape)
    return grad_a, grad_b, [grads_by_name.get(o.name) for o in prog.operands]


def _residual_rmsnorm_saves(prog):
    """Outputs kept for the backward (z, r), and operands it only needs the dtype of."""
    return ([0, 2] if prog.gemm else [1]), {"residual"}


# ---- gated pairs ----------------------------------------------------------------------

def _gated_parts(prog: EpilogueProgram):
    """[y = acc * r] [y_b = y + bias] act = pairop(y) -> outputs act (pair), y (tile)."""
    from ..codegen.program import PAIRWISE
    v, i = scaled_acc_prefix(prog)
    body = prog.body
    _expect(len(body) == i + 1 and body[i].op in PAIRWISE and body[i].args == (v,))
    _expect({o.name for o in prog.operands} <= {"r", "bias"} and prog.gemm)
    outs = [(o.value, o.kind) for o in prog.outputs]
    _expect(outs == [(body[i].out, Kind.PAIR), (v, Kind.TILE)])
    return PAIRWISE[body[i].op]


def _gated_vjp(prog, a, b, operands, outputs, grads):
    dy = grads[0]
    if dy is None:
        return None, None, [None] * len(operands)
    act = reference.unary(_gated_parts(prog))
    with torch.enable_grad():
        p = _up(outputs[1]).detach().requires_grad_(True)
        y = act(p[:, 0::2]) * p[:, 1::2]
        (dp,) = torch.autograd.grad(y, p, _up(dy))
    return _through_scaled_acc(prog, a, b, operands, dp)


def _through_scaled_acc(prog, a, b, operands, dy):
    """Gradients of y = r ⊙ acc (+ bias) given dy (float32/64): the rowscale rule
    (no acc needed: dr is a row dot with the GEMM dy·b the backward computes anyway).
    Operands other than r and bias get no gradient."""
    by_name = dict(zip((o.name for o in prog.operands), operands))
    grads_by_name = {}
    if "bias" in by_name:
        grads_by_name["bias"] = dy.sum(0).to(by_name["bias"].dtype)
    if "r" in by_name:
        r = _up(by_name["r"])[:, None]
        g = _up(dy.to(b.dtype) @ b)                        # G = dy·b
        grad_a = (g * r).to(a.dtype)
        grad_b = (dy * r).to(a.dtype).t() @ a
        grads_by_name["r"] = (g * _up(a)).sum(-1).to(by_name["r"].dtype)
    else:
        grad_a, grad_b = _gemm_grads(dy, a, b)
    return grad_a, grad_b, [grads_by_name.get(o.name) for o in prog.operands]


# ---- rotation (RoPE) ------------------------------------------------------------------

def _rope_parts(prog: EpilogueProgram) -> tuple[str | None, tuple[str, ...]]:
    """[y = acc * r] [y_b = y + bias] [y_s = y_b * colscale] out = rope(y, pos, freq) or
    rope_table(y, cs [, on]) -> out: (the column scale's name, the angle's operands)."""
    v, i = scaled_acc_prefix(prog)
    body = prog.body
    _expect(prog.gemm and body[-1].op in ("rope", "rope_table"))
    scale = None
    if len(body) == i + 2:  # the rope type's attention scaling per column
        _expect(body[i].op == "mul" and body[i].args == (v, "colscale"))
        v, scale = body[i].out, "colscale"
    _expect(len(body) in (i + 1, i + 2) and body[-1].args[0] == v)
    angle = body[-1].args[1:]
    _expect({o.name for o in prog.operands} <= {"r", "bias", "colscale", *angle})
    _expect([(o.value, o.kind) for o in prog.outputs] == [(body[-1].out, Kind.TILE)])
    return scale, angle


def _rope_vjp(prog, a, b, operands, outputs, grads):
    """A rotation is orthogonal: dy = R(θ)ᵀ·dout = R(−θ)·dout, one elementwise pass
    (−freq negates both float-float parts, so the angle exactly; a table's sin column
    negated). Positions, frequencies and tables get no gradient (the pattern only
    rewrites ones that need none)."""
    (dout,) = grads
    if dout is None:
        return None, None, [None] * len(operands)
    scale, angle = _rope_parts(prog)
    by_name = dict(zip((o.name for o in prog.operands), operands))
    if prog.body[-1].op == "rope_table":
        cs = _up(by_name[angle[0]]).clone()
        cs[:, 1::2] = -cs[:, 1::2]
        flags = [by_name[name] for name in angle[1:]]  # rope_table's rotate-or-not column flag
        dy = reference.rotate_pairs_by_table(_up(dout), cs, *flags)
    else:
        pos, freq = angle
        dy = reference.rotate_pairs(_up(dout), by_name[pos].reshape(-1, 1),
                                    -by_name[freq].reshape(1, -1))
    if scale is not None:
        dy = dy * _up(by_name[scale]).reshape(1, -1)
    return _through_scaled_acc(prog, a, b, operands, dy)


# ---- log-sum-exp and target logit (cross-entropy) --------------------------------------

# rows per chunk: about 512 MiB of float32 [rows, vocab] work at a time
_CE_CHUNK_BYTES = 1 << 29


def _lse_parts(prog: EpilogueProgram) -> bool:
    """Whether the cross-entropy program also stores the logits."""
    y, i = scaled_acc_prefix(prog)
    lse, tl, loss = prog.body[i:]
    _expect((lse.op, lse.args) == ("row_logsumexp", (y,)))
    _expect((tl.op, tl.args) == ("select_column", (y, "target")))
    _expect((loss.op, loss.args) == ("sub", (lse.out, tl.out)))
    outs = [(o.value, o.kind) for o in prog.outputs]
    tail = [(loss.out, Kind.PER_ROW), (lse.out, Kind.PER_ROW)]
    _expect(outs in (tail, [(y, Kind.TILE), *tail]) and prog.gemm)
    return len(outs) == 3


@functools.lru_cache(maxsize=64)
def softmax_grad_program(has_r: bool, has_bias: bool, dtype: str) -> EpilogueProgram:
    """The softmax part of the cross-entropy gradient, formed in the epilogue of the GEMM
    that recomputes the logits: d_acc = exp(y − lse)·dsm (·r), y = acc (·r) (+ b). It is
    stored once, in the GEMM dtype; no float32 [rows, vocab] tensor exists. (Cached: the
    backward asks on every call.)"""
    from ..codegen.program import ProgramBuilder
    p = ProgramBuilder("ce_softmax_grad", gemm=True)
    y = p.scaled_acc(has_r, has_bias)
    lse, dsm = p.operand("lse", Kind.PER_ROW), p.operand("dsm", Kind.PER_ROW)
    d = p.mul(p.exp(p.sub(y, lse)), dsm, name="d")
    if has_r:
        d = p.mul(d, "r", name="d_r")
    p.output(d, Kind.TILE, dtype)
    return p.build()


def _lse_target_vjp(prog, a, b, operands, outputs, grads):
    from . import ops
    with_logits = _lse_parts(prog)
    d_logits = grads[0] if with_logits else None
    d_loss, d_lse = grads[-2], grads[-1]
    by_name = dict(zip((o.name for o in prog.operands), operands))
    m, n = a.shape[0], b.shape[0]
    if d_loss is None and d_lse is None and d_logits is None:
        return None, None, [None] * len(operands)
    lse = _up(outputs[-1]).reshape(m)
    zero = torch.zeros((), dtype=lse.dtype, device=lse.device)
    d_loss = _up(d_loss).reshape(m) if d_loss is not None else zero.expand(m)
    dsm = d_loss + (_up(d_lse).reshape(m) if d_lse is not None else zero)
    target = by_name["target"].reshape(m).long()
    valid = (target >= 0) & (target < n)
    r = _up(by_name["r"]).reshape(m) if "r" in by_name else None
    bias = by_name.get("bias")
    # d_acc = (softmax(y)·dsm − onehot(t)·dloss + dlogits) (·r), in the GEMM dtype
    if with_logits:  # the forward wrote y: no GEMM recompute, the softmax chunk by chunk
        d_acc = torch.empty(m, n, dtype=a.dtype, device=a.device)
        rows = max(1, _CE_CHUNK_BYTES // (4 * n))
        for s in range(0, m, rows):
            e = min(m, s + rows)
            d = torch.exp(_up(outputs[0][s:e]) - lse[s:e, None]).mul_(dsm[s:e, None])
            if d_logits is not None:
                d += _up(d_logits[s:e])
            if r is not None:
                d *= r[s:e, None]
            d_acc[s:e] = d
    else:  # recompute the logits in a GEMM whose epilogue forms the softmax gradient
        bwd = softmax_grad_program(r is not None, bias is not None,
                                   reference.dtype_name(a.dtype))
        ops_in = ([by_name["r"].reshape(m)] if r is not None else []) + \
            ([bias] if bias is not None else []) + [lse, dsm]
        (d_acc,) = ops.gemm_epilogue(bwd.to_text(), a, b, ops_in)
    # the one-hot term: M updates, shapes static (an ignored row adds 0 at column 0)
    onehot = torch.where(valid, d_loss * (r if r is not None else 1.0), zero)
    rows_idx = torch.arange(m, device=a.device)
    d_acc.index_put_((rows_idx, target.clamp(0, n - 1)), (-onehot).to(d_acc.dtype),
                     accumulate=True)
    grad_a = d_acc @ b                                   # G = d_acc·b
    grad_b = d_acc.t() @ a
    grads_by_name = {}
    if r is not None:  # dy/dr = acc: Σ_j dy·acc = Σ_k a·(dy·b) = Σ_k a·G / r
        grads_by_name["r"] = ((_up(grad_a) * _up(a)).sum(-1) / r).to(
            by_name["r"].dtype).reshape(by_name["r"].shape)
    if bias is not None:  # Σ_i dy = Σ_i d_acc / r, by chunks of rows
        gb = torch.zeros(n, dtype=lse.dtype, device=a.device)
        rows = max(1, _CE_CHUNK_BYTES // (4 * n))
        for s in range(0, m, rows):
            e = min(m, s + rows)
            d = _up(d_acc[s:e])
            gb += (d / r[s:e, None] if r is not None else d).sum(0)
        grads_by_name["bias"] = gb.to(bias.dtype)
    return grad_a, grad_b, [grads_by_name.get(o.name) for o in prog.operands]


def _lse_target_saves(prog):
    """The logits (when written) and lse."""
    return ([0, 2] if _lse_parts(prog) else [1]), set()


# (applies to, rule, what the forward must keep: (output indices, operands not needed))
SPECIALISED = [
    (_is_rowscale, _rowscale_vjp, lambda prog: ([], set())),
    (_shaped(_residual_rmsnorm_parts), _residual_rmsnorm_vjp, _residual_rmsnorm_saves),
    (_shaped(_gated_parts), _gated_vjp, lambda prog: ([1], set())),
    (_shaped(_rope_parts), _rope_vjp, lambda prog: ([], set())),
    (_shaped(_lse_parts), _lse_target_vjp, _lse_target_saves),
]


@functools.lru_cache(maxsize=1024)
def _rule(prog: EpilogueProgram):
    """The specialised (rule, keep) for a program, or None (the general rule). Cached:
    the forward asks on every call."""
    for matches, rule, keep in SPECIALISED:
        if matches(prog):
            return rule, keep(prog)
    return None


def saves(prog: EpilogueProgram) -> tuple[list[int], set[str]]:
    """(outputs the backward reads, operand names it needs only the dtype of)."""
    found = _rule(prog)
    return found[1] if found is not None else ([], set())


# ---- any other program ----------------------------------------------------------------

def _general_vjp(prog, a, b, operands, outputs, grads):
    """Recompute acc as one 16-bit GEMM; autograd through the reference epilogue."""
    acc = (a @ b.t()) if prog.gemm else None
    leaves = [t for t in (acc, *operands) if t is not None and t.is_floating_point()]
    with torch.enable_grad():
        detached = {id(t): t.detach().requires_grad_(True) for t in leaves}

        def d(t):
            return None if t is None else detached.get(id(t), t)

        outs = reference.run_program(prog, a, b, [d(t) for t in operands], acc=d(acc))
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        wrt = list(detached.values())
        got = torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs],
                                  allow_unused=True) if pairs else [None] * len(wrt)
    by_id = dict(zip(detached.keys(), got))
    grad_a = grad_b = None
    if prog.gemm and by_id.get(id(acc)) is not None:
        grad_a, grad_b = _gemm_grads(by_id[id(acc)], a, b)
    return grad_a, grad_b, [by_id.get(id(t)) for t in operands]


def vjp(prog: EpilogueProgram, a, b, operands, outputs, grads):
    """(grad_a, grad_b, [grad per operand]) for ``prog``."""
    device = (a if a is not None else operands[0]).device
    with torch.autocast(device_type=device.type, enabled=False):
        found = _rule(prog)
        if found is not None:
            return found[0](prog, a, b, operands, outputs, grads)
        return _general_vjp(prog, a, b, operands, outputs, grads)
