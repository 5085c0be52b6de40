"""Reference implementation of epilogue programs in plain torch.

It runs on every device and dtype, and follows the generated kernel's order of
operations: the GEMM accumulates in float32 from the 16-bit operands (float64 when an
input is float64), the whole body runs in that compute dtype on the unrounded
accumulator, and each output is rounded once, when it is stored. So kernel and reference
agree to rounding, and a tolerance measures the rewrite, not the implementation.

It is written in differentiable torch ops on purpose: the op's backward recomputes the
program and differentiates this function (see ops.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .program import ACC, PAIRWISE, ROTARY, EpilogueProgram, Kind

_DTYPES = {
    "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float32": torch.float32, "float64": torch.float64,
}


def dtype_from_name(name: str) -> torch.dtype:
    return _DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def compute_dtype(program: EpilogueProgram, a, b, operands) -> torch.dtype:
    """float64 when the GEMM operands or a tile are float64 (a float64 model), else
    float32. Vectors and scalars do not decide it: a float64 eps stays a scalar."""
    tiles = [t for s, t in zip(program.operands, operands) if s.kind == Kind.TILE]
    return torch.float64 if any(t is not None and t.dtype == torch.float64
                                for t in (a, b, *tiles)) else torch.float32


_UNARY = {
    "neg": torch.neg,
    "square": torch.square,
    "rsqrt": torch.rsqrt,
    "sqrt": torch.sqrt,
    "exp": torch.exp,
    "silu": F.silu,
    "sigmoid": torch.sigmoid,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_erf": F.gelu,
}


def unary(op: str):
    """The torch function of an elementwise op of one argument."""
    return _UNARY[op]


_BINARY = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div}


def eval_body(body, env: dict, cd: torch.dtype) -> None:
    """Run instructions over ``env`` (value name -> tensor), in place."""
    def val(x):
        return env[x] if isinstance(x, str) else x

    for ins in body:
        args = [val(x) for x in ins.args]
        if ins.op in _BINARY:
            out = _BINARY[ins.op](*args)
        elif ins.op == "cast":
            out = args[0].to(_DTYPES[ins.dtype]).to(cd)
        elif ins.op in _UNARY:
            out = _UNARY[ins.op](args[0])
        elif ins.op in PAIRWISE:  # interleaved columns: gate at 2j, up at 2j + 1
            x = args[0]
            out = _UNARY[PAIRWISE[ins.op]](x[:, 0::2]) * x[:, 1::2]
        elif ins.op == "rope_table":
            out = rotate_pairs_by_table(*args)
        elif ins.op in ROTARY:
            out = rotate_pairs(*args)
        elif ins.op == "row_logsumexp":
            out = torch.logsumexp(args[0], dim=1, keepdim=True)
        elif ins.op == "select_column":
            x, idx = args
            idx = idx.long()
            ok = (idx >= 0) & (idx < x.shape[1])
            out = torch.where(ok, x.gather(1, idx.clamp(0, x.shape[1] - 1)),
                              torch.zeros((), dtype=x.dtype, device=x.device))
        elif ins.op == "row_sum":
            out = args[0].sum(dim=1, keepdim=True)
        elif ins.op == "row_max":
            out = args[0].amax(dim=1, keepdim=True)
        else:  # validated programs never get here
            raise AssertionError(f"op {ins.op} not in the IR")
        env[ins.out] = out


def rotate_pairs(x: torch.Tensor, pos: torch.Tensor, freq: torch.Tensor) -> torch.Tensor:
    """``rope``: rotate each adjacent column pair (2j, 2j+1) of x [M, N] by
    θ = pos[i]·f_j turns, f_j = freq[2j] + freq[2j+1] (pos [M, 1], freq [1, N]). The
    angle is formed and reduced mod 1 in float64 (as exact as the kernel's float-float
    angle, at any position below 2^24); cos and sin of the reduced angle are taken in
    x's dtype (float32: the kernel's MUFU accuracy; float64 for float64 models).
    Differentiable in x (the backward of a rotation is the rotation by −θ: pass −freq)."""
    f = freq[..., 0::2].double() + freq[..., 1::2].double()
    theta = (torch.remainder(pos.double() * f, 1.0) * (2 * math.pi)).to(x.dtype)
    c, s = torch.cos(theta), torch.sin(theta)
    x1, x2 = x[:, 0::2], x[:, 1::2]
    return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)


def rotate_pairs_by_table(x: torch.Tensor, cs: torch.Tensor,
                          rot: torch.Tensor | None = None) -> torch.Tensor:
    """``rope_table``: rotate each adjacent column pair of x [M, N] by the angle whose
    (cos, sin) row i of the table [M, head_dim] holds at (2p, 2p+1), p = (j mod
    head_dim) / 2: the table repeats every head_dim columns. With ``rot`` ([1, N], 0 or
    1 per column) only where it is 1: (cos, sin) = (1, 0) elsewhere, exactly."""
    reps = x.shape[1] // cs.shape[1]
    c, s = cs[:, 0::2].to(x.dtype).repeat(1, reps), cs[:, 1::2].to(x.dtype).repeat(1, reps)
    if rot is not None:
        on = rot.reshape(1, -1)[:, 0::2].to(x.dtype)
        c, s = on * c + (1 - on), on * s
    x1, x2 = x[:, 0::2], x[:, 1::2]
    return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)


def problem_size(program: EpilogueProgram, a, b, operands) -> tuple[int, int]:
    """(M, N) of the output tile grid."""
    if program.gemm:
        return a.shape[0], b.shape[0]
    for spec, t in zip(program.operands, operands):
        if spec.kind == Kind.TILE:
            return t.shape[0], t.shape[1]
    raise AssertionError("validated programs without a GEMM have a tile operand")


def run_program(program: EpilogueProgram, a: torch.Tensor | None, b: torch.Tensor | None,
                operands: list[torch.Tensor], acc: torch.Tensor | None = None
                ) -> list[torch.Tensor]:
    """Evaluate ``program``. Shapes: a [M, K], b [N, K]; operands per their kind:
    tile [M, N], per-row [M], per-feature [N], scalar []. Returns tiles [M, N] and per-row
    outputs [M], in each output's storage dtype. ``acc`` replaces the GEMM when given
    (the backward differentiates the epilogue alone)."""
    cd = compute_dtype(program, a, b, operands)
    env: dict[str, torch.Tensor] = {}
    if program.gemm:
        env[ACC] = acc.to(cd) if acc is not None else a.to(cd) @ b.to(cd).t()
    for spec, t in zip(program.operands, operands):
        if t.is_floating_point():  # an index operand stays integer
            t = t.to(cd)
        if spec.kind == Kind.PER_ROW:
            t = t.reshape(-1, 1)
        elif spec.kind == Kind.PER_FEATURE:
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
