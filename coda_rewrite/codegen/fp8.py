"""FP8 (e4m3) for an inference graph's linears: the math, the scales and the programs.

Dynamic row-wise scaling (torchao's float8 "rowwise" recipe) needs each row's amax before
the row is written in FP8: a pass over the bf16 activation before every FP8 GEMM. Where an
RMSNorm feeds the linears (a gated MLP, q/k/v) the scales come instead from bounds that
hold for every input, so no amax is ever taken; every other linear takes the row-wise
recipe with both of its scales in the GEMM's epilogue (row_scales, rowwise_program). The
bounds:

* The GEMMs' input is a normalised row n = z·rsqrt(mean(z²) + eps), and |n_k| ≤ √N
  for every row (N the normalised width; algebra/fp8.py proves it). It is written as
  q = e4m3(n·S_in) with one static S_in = 448/√N, by the graph ops that compute the norm
  (Inductor fuses them into the norm's one kernel). The norm's γ is folded into the
  gate/up weights (W·diag(γ)) before they are quantised.
* Weights: e4m3 per output row, scale = the row's amax / 448, computed from the live
  parameters and kept between calls by their version counters (kernels/versioned.py),
  like the re-laid-out weights of cache_relayouts.
* The gated product act(g)·u, the down projection's input, is bounded per column j by
  Cauchy–Schwarz: |g_ij| ≤ ‖x̂_i‖·‖ŵg_j‖, |u_ij| ≤ ‖x̂_i‖·‖ŵu_j‖, |act(g)| ≤ |g| for
  SiLU and both GELUs, and ‖x̂_i‖ ≤ √N·(1 + 2⁻³) for the quantised normalised row; so
  |act(g)·u| ≤ B_j = N·(1 + 2⁻³)²·‖ŵg_j‖·‖ŵu_j‖. The factor c_j = 448/B_j rides the up
  lane's dequantisation scale (act(g)·(c·u) = c·act(g)·u) and 1/c_j is folded into the
  down projection's column j before its rows are quantised: nothing is scaled at run
  time but in the GEMMs' epilogues.

The linears of a normalised row (q/k/v) stack their weights (linear_weights) and run one
e4m3 GEMM, ``acc·ws[j] (+ b[j])`` (scaled_program). The gate/up GEMM (e4m3 × e4m3,
interleaved rows) runs the program
``act(acc·ws[j])`` and stores the product in bf16; QuACK 0.6.5's SM90 gated store is
16-bit only (its fp8 postact store is SM100/SM120), so one elementwise pass (graph ops:
Inductor fuses the clamp and the cast) turns it into e4m3, saturating: values are within
±448 by the bound, and the GEMMs' own float32 rounding can only be clipped. The down
GEMM (e4m3 × e4m3) runs ``acc·ws[h]``.

Numerics: e4m3 keeps 3 mantissa bits (a relative rounding of 2⁻⁴) over 2⁻⁶..448, with
subnormals to 2⁻⁹. A bound looser than the row's amax moves values down that range, not
off it: only values below 2⁻⁶ of the bound's 448 lose relative precision, and their
absolute error (≤ 2⁻¹⁰ in scaled units) is below the rounding error of the row's larger
values. tests/test_fp8.py and the witness (algebra/fp8.py) compare against float64 and
against torchao's row-wise recipe on the same weights.
"""

from __future__ import annotations

import functools
import math

import torch

from . import layouts
from .program import ACC, EpilogueProgram, Kind, ProgramBuilder

# the programs' family tag: their GEMMs take e4m3 operands (kernels/quack_path.py picks
# FP8 tile configs by it, kernels/aot.py compiles them with e4m3 operands)
FAMILY = "fp8_mlp"
E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
# ‖x̂_i‖ ≤ √N·(1 + MARGIN) for a quantised normalised row: e4m3's relative rounding (2⁻⁴)
# plus its subnormal step below 2⁻⁶ (≤ N·2⁻¹⁰/448 in units of √N, < 2⁻¹⁰ for N ≤ 2¹⁹)
MARGIN = 2.0 ** -3
# the pair ops whose activation satisfies |act(g)| ≤ |g| (act(g) = g·h(g), 0 ≤ h ≤ 1)
BOUNDED_ACTIVATIONS = ("swiglu", "geglu", "geglu_erf")


def input_scale(width: int) -> float:
    """S_in: a normalised row of ``width`` features times S_in stays within ±448."""
    return E4M3_MAX / math.sqrt(width)


def saturate(x: torch.Tensor) -> torch.Tensor:
    """e4m3 with the kernel's rounding (round to nearest even, saturating at ±448: the
    PTX conversion's .satfinite; torch's plain cast would turn |x| > 448 into NaN)."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def quantize_normalized(z: torch.Tensor, eps, width: int) -> torch.Tensor:
    """e4m3(n·S_in), n = z·rsqrt(mean(z², last dim) + eps) in float32: the RMSNorm's
    normalised row without its γ (folded into the weights), in the GEMM's FP8 input."""
    zf = z.float()
    n = zf * torch.rsqrt(zf.pow(2).mean(-1, keepdim=True) + eps)
    return saturate(n * input_scale(width))


def _scale_of(amax: torch.Tensor) -> torch.Tensor:
    """amax/448, 1 for a zero row (its values are exactly 0), and never below float32's
    smallest normal: amax/448 of a row of subnormals would round to 0 and x/0 is not a
    number (such a row quantises to zeros, within its own absolute size of eager's)."""
    s = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    return s.clamp_min(torch.finfo(torch.float32).tiny)


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, float32 dequantisation scale per row): w[j] ≈ q[j]·s[j], with
    s[j] = amax_j/448 (_scale_of)."""
    wf = w.float()
    s = _scale_of(wf.abs().amax(dim=-1))
    return saturate(wf / s[:, None]), s


def dequantize(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return q.float() * s[:, None]


def activation_bounds(qg, sg, qu, su, width: int) -> torch.Tensor:
    """B_j ≥ |act(g_ij)·u_ij| for every normalised input row (the module docstring)."""
    ng = dequantize(qg, sg).norm(dim=-1)
    nu = dequantize(qu, su).norm(dim=-1)
    return width * (1 + MARGIN) ** 2 * ng * nu


def mlp_weights(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                gamma: torch.Tensor | None, gamma_offset: float, width: int):
    """(W_int e4m3 [2I, N], ws_int float32 [2I], W_down e4m3 [H, I], ws_down float32 [H])
    from the live parameters: γ folded, rows quantised, the activation bound's factor on
    the up lane's scale and its inverse on the down projection's columns."""
    with torch.no_grad():
        scale = None if gamma is None else gamma.float() + gamma_offset
        wg, wu = gate.float(), up.float()
        if scale is not None:
            wg, wu = wg * scale, wu * scale
        qg, sg = quantize_rows(wg)
        qu, su = quantize_rows(wu)
        bound = activation_bounds(qg, sg, qu, su, width)
        c = torch.where(bound > 0, E4M3_MAX / bound, torch.ones_like(bound))
        s_in = input_scale(width)
        w_int = layouts.interleave_rows(qg.view(torch.uint8), qu.view(torch.uint8)).view(E4M3)
        ws_int = layouts.interleave_rows(sg / s_in, su * c / s_in)
        qd, sd = quantize_rows(down.float() / c)
        return w_int.contiguous(), ws_int.contiguous(), qd, sd


def linear_weights(weights: list[torch.Tensor], biases: list[torch.Tensor | None],
                   gamma: torch.Tensor | None, gamma_offset: float, width: int):
    """(W e4m3 [ΣN_i, N], ws float32 [ΣN_i], b float32 [ΣN_i] or None) for linears that
    read one normalised row (q/k/v, a packed qkv, an LM head): their rows stacked, γ
    folded, rows quantised; ws = s_j/S_in dequantises the GEMM of e4m3(n·S_in); a linear
    without a bias beside biased ones adds zeros."""
    with torch.no_grad():
        w = torch.cat([t.float() for t in weights])
        if gamma is not None:
            w = w * (gamma.float() + gamma_offset)
        q, s = quantize_rows(w)
        b = None
        if any(t is not None for t in biases):
            b = torch.cat([torch.zeros(t.shape[0], device=t.device) if bias is None
                           else bias.float() for t, bias in zip(weights, biases)])
        return q, (s / input_scale(width)).contiguous(), b


def row_scales(x: torch.Tensor) -> torch.Tensor:
    """Dynamic per-row dequantisation scales of an activation no bound covers (torchao's
    row-wise recipe): amax over the last dim / 448 (_scale_of); float32 [*, 1]."""
    return _scale_of(x.float().abs().amax(dim=-1, keepdim=True))


def quantize_by(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """e4m3(x / scale) per row: within ±448 by the scale's definition (row_scales)."""
    return saturate(x.float() / scales)


def quantize_columns(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows of tᵀ, contiguous: [K, M] e4m3 and a float32 scale per column of t
    (its amax over the rows / 448). The backward's operands: a GEMM that reduces over t's
    rows reads them K-major (the e4m3 contract), so they are transposed as they are
    quantised (under Inductor, one pass)."""
    q, s = quantize_rows(t.reshape(-1, t.shape[-1]).t())
    return q.contiguous(), s.contiguous()


def rowwise_grads(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, want_x: bool,
                  want_w: bool, gemm, columns=None):
    """(dx, dW) of y = x·Wᵀ by torchao's float8 row-wise training recipe (its "rowwise":
    e4m3 for all three GEMMs, each operand scaled along the dim the GEMM keeps):

        dx = dy·W      dy's rows scaled by their amax, W's columns by theirs
        dW = dyᵀ·x     dy's columns and x's columns (both reduced over the tokens)

    each an e4m3 GEMM with both scales in its epilogue (rowwise_program, the forward's
    program), run by ``gemm(program_text, a, b, operands) -> [out]``, the transposed
    operands by ``columns`` (quantize_columns's math; kernels/fp8.py passes an op that keeps
    it out of the passes Inductor fuses around it). dx in x's dtype, dW in W's; None where
    not wanted. (torchao also rounds its scales to powers of two; these are amax/448
    exactly, as in the forward.)"""
    columns = columns or quantize_columns
    dy2 = dy.reshape(-1, dy.shape[-1])
    dx = dw = None
    if want_x:
        r = row_scales(dy2)
        qwt, sw = columns(w)
        (dx,) = gemm(_rowwise_text(x.dtype), quantize_by(dy2, r), qwt, [r.reshape(-1), sw])
        dx = dx.reshape(*dy.shape[:-1], w.shape[1])
    if want_w:
        qdyt, sdy = columns(dy2)
        qxt, sx = columns(x)
        (dw,) = gemm(_rowwise_text(w.dtype), qdyt, qxt, [sdy, sx])
    return dx, dw


@functools.lru_cache(maxsize=None)
def _rowwise_text(dtype: torch.dtype) -> str:
    return rowwise_program(dtype).to_text()


def rowwise_weights(weight: torch.Tensor, bias: torch.Tensor | None):
    """(W e4m3 [N, K], ws float32 [N], b float32 [N] or None) of a row-wise linear."""
    with torch.no_grad():
        q, s = quantize_rows(weight)
        return q, s.contiguous(), None if bias is None else bias.float()


# ---- the programs ----------------------------------------------------------------------

def gate_up_program(op: str, params: tuple[float, ...] = ()) -> EpilogueProgram:
    """act(acc·ws[j]) over the interleaved e4m3 gate/up GEMM, stored in bf16."""
    p = ProgramBuilder(f"fp8_{op}", gemm=True, family=FAMILY)
    y = p.mul(ACC, p.operand("ws", Kind.PER_FEATURE), name="y")
    p.output(p.emit(op, y, *params, name="act"), Kind.PAIR, "bfloat16")
    return p.build()


def scaled_program(dtype: torch.dtype, bias: bool = False) -> EpilogueProgram:
    """acc·ws[j] (+ b[j]) over an e4m3 GEMM, stored in the model's dtype: the down
    projection, the linears of a normalised row."""
    p = ProgramBuilder("fp8_scaled_bias" if bias else "fp8_scaled", gemm=True, family=FAMILY)
    y = p.mul(ACC, p.operand("ws", Kind.PER_FEATURE), name="y")
    if bias:
        y = p.add(y, p.operand("b", Kind.PER_FEATURE), name="yb")
    p.output(y, Kind.TILE, str(dtype).removeprefix("torch."))
    return p.build()


def rowwise_program(dtype: torch.dtype, bias: bool = False) -> EpilogueProgram:
    """acc·r[i]·ws[j] (+ b[j]) over an e4m3 GEMM whose rows were scaled by their own amax:
    torchao's row-wise recipe with both scales in the epilogue."""
    p = ProgramBuilder("fp8_rowwise_bias" if bias else "fp8_rowwise", gemm=True,
                       family=FAMILY)
    y = p.mul(ACC, p.operand("r", Kind.PER_ROW), name="y_r")
    y = p.mul(y, p.operand("ws", Kind.PER_FEATURE), name="y")
    if bias:
        y = p.add(y, p.operand("b", Kind.PER_FEATURE), name="yb")
    p.output(y, Kind.TILE, str(dtype).removeprefix("torch."))
    return p.build()


def down_program(dtype: torch.dtype) -> EpilogueProgram:
    """acc·ws[h] over the e4m3 down GEMM, stored in the model's dtype."""
    return scaled_program(dtype)
