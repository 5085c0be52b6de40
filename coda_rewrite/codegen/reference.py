"""Reference implementation of epilogue programs in plain torch.

It runs on every device and dtype, and follows the generated kernel's order of
operations: the GEMM accumulates in float32 from the 16-bit operands (in float64 from
float32 or float64 ones, which no kernel takes: compute_dtype), the whole body runs in
that compute dtype on the unrounded accumulator, and each output is rounded once, when
it is stored. So kernel and reference
agree to rounding, and a tolerance measures the rewrite, not the implementation.

It is written in differentiable torch ops on purpose: the op's backward recomputes the
program and differentiates this function (see ops.py).
"""

from __future__ import annotations

import torch

from .op_table import OPS, STORAGE_DTYPES, pair_value
from .program import ACC, EpilogueProgram, Kind

_DTYPES = STORAGE_DTYPES


# GEMM operand dtypes the kernels accumulate in float32 (e4m3: codegen/fp8.py; products of
# two e4m3 values are exact in float32)
LOW_PRECISION = (torch.bfloat16, torch.float16, torch.float8_e4m3fn)


def dtype_from_name(name: str) -> torch.dtype:
    return _DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """What a value of ``dtype`` is computed in: float32 from 16-bit (the kernel's
    accumulator), float64 from float32 or float64 (no kernel takes float32 operands, and
    a value multiplied by a mean or cancelled against another, a LayerNorm's, needs more
    than float32's 2^-24 of it: compute_dtype says when)."""
    return torch.float32 if dtype in LOW_PRECISION else torch.float64


def compute_dtype(program: EpilogueProgram, a, b, operands) -> torch.dtype:
    """float32 for 16-bit GEMM operands (the kernel's accumulator), float64 otherwise: a
    float64 model, and a float32 one too. No kernel takes float32 operands, so this is
    what a float32 model runs, and an epilogue that cancels two large terms (a LayerNorm
    deferred: z·W'ᵀ − μ·s, each of the mean's size) would lose ~2^-24·|μ|/σ of the output
    to a float32 accumulation, past the float32 rule (1e-5 of eager) from |μ| ≈ 30σ at
    K = 1024 (measured on the CPU). Without a GEMM, the tiles decide (float64 only for a
    float64 tile). Vectors and scalars do not decide it: a float64 eps stays a scalar."""
    tiles = [t for s, t in zip(program.operands, operands) if s.kind == Kind.TILE]
    gemm = [t for t in (a, b) if t is not None]
    if any(t.dtype not in LOW_PRECISION for t in gemm) or \
            any(t is not None and t.dtype == torch.float64 for t in tiles):
        return torch.float64
    return torch.float32


def unary(op: str):
    """The torch function of an elementwise op of one argument (an activation)."""
    ref = OPS[op].reference
    return lambda x: ref([x], None, x.dtype)


def eval_body(body, env: dict, cd: torch.dtype) -> None:
    """Run instructions over ``env`` (value name -> tensor), in place: each op's
    reference semantics from the op table."""
    for ins in body:
        args = [env[x] if isinstance(x, str) else x for x in ins.args]
        env[ins.out] = OPS[ins.op].reference(args, ins, cd)


def problem_size(program: EpilogueProgram, a, b, operands) -> tuple[int, int]:
    """(M, N) of the output tile grid."""
    if program.gemm:
        return a.shape[0], b.shape[0]
    for spec, t in zip(program.operands, operands):
        if spec.kind == Kind.TILE:
            return t.shape[0], t.shape[1]
    raise AssertionError("validated programs without a GEMM have a tile operand")


def run_program(program: EpilogueProgram, a: torch.Tensor | None, b: torch.Tensor | None,
                operands: list[torch.Tensor], acc: torch.Tensor | None = None,
                features_per_row: bool = False) -> list[torch.Tensor]:
    """Evaluate ``program``. Shapes: a [M, K], b [N, K]; operands per their kind:
    tile [M, N], per-row [M], per-feature [N] ([M, N] with ``features_per_row``: a
    grouped GEMM's per-expert vector, taken per row), scalar []. Returns tiles [M, N] and
    per-row outputs [M], in each output's storage dtype. ``acc`` replaces the GEMM when
    given (the backward differentiates the epilogue alone)."""
    cd = compute_dtype(program, a, b, operands)
    env: dict[str, torch.Tensor] = {}
    if program.gemm:
        env[ACC] = acc.to(cd) if acc is not None else a.to(cd) @ b.to(cd).t()
    for spec, t in zip(program.operands, operands):
        if t.is_floating_point():  # an index operand stays integer
            t = t.to(cd)
        if spec.kind == Kind.PER_ROW:
            t = t.reshape(-1, 1)
        elif spec.kind == Kind.PER_FEATURE and not features_per_row:
            t = t.reshape(1, -1)
        env[spec.name] = t

    eval_body(program.body, env, cd)

    m, n = problem_size(program, a, b, operands)
    results = []
    for o in program.outputs:
        v = env[o.value]
        if not isinstance(v, torch.Tensor):
            v = torch.tensor(v, dtype=cd, device=_device(a, operands))
        shape = {Kind.TILE: (m, n), Kind.PAIR: (m, n // 2)}.get(o.kind, (m, 1))
        v = v.expand(shape).to(_DTYPES[o.dtype])
        results.append(v.reshape(m) if o.kind == Kind.PER_ROW else v)
    return results


def _device(a, operands):
    return a.device if a is not None else operands[0].device


def dgated(op: str, dh: torch.Tensor, p: torch.Tensor,
           *params) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated activation's backward epilogue (the kernel: codegen/dgated_source.py).

    From dh [M, I], the down projection's dgrad accumulator in the compute dtype, and the
    stored pre-activation p [M, 2I] with gate and up interleaved ([g0, u0, g1, u1, ...]):

        dp[:, 2j] = dh·∂h/∂g      dp[:, 2j+1] = dh·∂h/∂u      h = pair(g, u)

    (for act(g)·u: dh·u·act'(g) and dh·act(g)), dp interleaved like p, both outputs
    rounded once to p's dtype. The derivatives are autograd's of the op table's own pair
    function (one definition of each; ``params``: its literal parameters), in dh's dtype."""
    cd = dh.dtype
    with torch.enable_grad():
        g, u = (p[:, k::2].to(cd).detach().requires_grad_(True) for k in (0, 1))
        h = pair_value(OPS[op], g, u, *params)
        dg, du = torch.autograd.grad(h, (g, u), dh)
    dp = torch.stack([dg, du], dim=-1).reshape(p.shape)
    return dp.to(p.dtype), h.detach().to(p.dtype)


def pair_params(ins) -> tuple[float, ...]:
    """A pairwise instruction's literal parameters (gpt-oss's alpha and limit)."""
    return tuple(ins.args[1:])


# ---- grouped GEMMs (routed experts: kernels/grouped.py) --------------------------------

def grouped_mm(a: torch.Tensor, b_kn: torch.Tensor, offsets: torch.Tensor,
               dtype: torch.dtype | None = None) -> torch.Tensor:
    """torch._grouped_mm's product in any dtype (its kernels take 16-bit and float32
    only; the witness replays it in float64): rows [offsets[e-1], offsets[e]) of ``a``
    [S, K] times ``b_kn[e]`` [K, N]; rows past offsets[-1] are zero (torch's kernel
    leaves them unwritten: eager never reads them). ``dtype``: what to compute in
    (default a's). One host read of the offsets: this is the reference, not a kernel."""
    dtype = dtype or a.dtype
    out = a.new_zeros(a.shape[0], b_kn.shape[-1], dtype=dtype)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        end = min(int(end), a.shape[0])
        if end > start:
            out[start:end] = a[start:end].to(dtype) @ b_kn[e].to(dtype)
        start = max(start, end)
    return out


def expert_pairs_interleaved(w: torch.Tensor) -> torch.Tensor:
    """Per expert [g0, u0, g1, u1, ...] from the concatenated [gate; up] rows of
    ``w`` [E, 2I, K]: what QuACK's concat_layout reads in place, written out."""
    half = w.shape[-2] // 2
    return w.unflatten(-2, (2, half)).transpose(-3, -2).flatten(-3, -2)


def expert_of_rows(offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """Each grouped-GEMM row's expert: the e with offsets[e-1] <= s < offsets[e]; E for
    the rows past offsets[-1] (no expert). On the device, without a host read."""
    s = torch.arange(rows, device=offsets.device, dtype=offsets.dtype)
    return torch.searchsorted(offsets, s, right=True)


def run_grouped(program: EpilogueProgram, a: torch.Tensor, b: torch.Tensor,
                offsets: torch.Tensor, index: torch.Tensor | None,
                operands: list[torch.Tensor], interleaved: bool = False
                ) -> list[torch.Tensor]:
    """Evaluate ``program`` over a grouped GEMM (kernels/grouped.py's contract): row s of
    the problem is ``a[index[s]]`` (``a[s]`` without an index) times expert e's weight
    ``b[e]`` [N, K] for the e with offsets[e-1] <= s < offsets[e]; a program with pair
    outputs reads each expert's rows as [gate; up] halves, or as adjacent (gate, up)
    rows with ``interleaved``; a per-feature operand [E, N] gives each expert its row
    (in the weight's row order). Rows past offsets[-1] get the epilogue of a zero
    accumulator (and the last expert's vectors)."""
    rows = a if index is None else a[index.long()]
    halves = any(o.kind == Kind.PAIR for o in program.outputs) and not interleaved
    per_expert = [o.kind == Kind.PER_FEATURE for o in program.operands]
    if halves:
        b = expert_pairs_interleaved(b)
        operands = [expert_pairs_interleaved(t[:, :, None])[:, :, 0] if f else t
                    for f, t in zip(per_expert, operands)]
    cd = compute_dtype(program, rows, b, operands)
    acc = grouped_mm(rows, b.transpose(-2, -1), offsets, cd)
    if not any(per_expert):
        return run_program(program, rows, b[0], operands, acc=acc)
    e = expert_of_rows(offsets, rows.shape[0]).clamp(max=b.shape[0] - 1)
    operands = [t[e] if f else t for f, t in zip(per_expert, operands)]
    return run_program(program, rows, b[0], operands, acc=acc, features_per_row=True)
