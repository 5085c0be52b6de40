"""A fused gated MLP's down projection, its backward fused the CODA way (the activation's
backward in the dgrad GEMM's epilogue).

    GatedDown.apply(op, y [M, I], p [M, 2I], w_down [H, I], bias [H]?) -> out [M, H]

Forward: out = y·w_downᵀ (+ bias), the same cuBLAS GEMM eager runs. y = act(g) ⊙ u is the
fused gated GEMM's output and p its stored pre-activation [g0, u0, g1, u1, ...], from the
same call (patterns/gated_mlp.py passes both; algebra/gated.decide_down checks that the
product has no other reader). The op keeps p and w_down for the backward, not y.

Backward: one GEMM, dh = dout·w_down, whose epilogue reads p and writes dp and the
recomputed h (coda::dgated, kernels/dgated.py); then w_down's gradient doutᵀ·h and the
bias's Σ dout. The gradient goes to p (the gated GEMM's backward reads dp as it is:
kernels/backward/gated.py) and none to y, since out depends on y only as act(p). Against
eager's backward this saves writing dh and reading it back, and the forward keeps no h
(M × I values per layer: what eager's down projection saves for its weight gradient).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import dgated, ops
from .backward.common import up, weight_grad_wanted, wgrad

# importing kernels/dgated defines coda::dgated, the op the backward below calls
_BACKWARD_OP = dgated.__name__


class GatedDown(torch.autograd.Function):
    """out = F.linear(y, w_down, bias), its backward through coda::dgated.

    An autograd.Function, not a custom op: the forward is the plain GEMM eager runs,
    which AOTAutograd and Inductor trace as they trace F.linear (no opaque op, no Python
    at run time: a custom op with an autograd formula cost 200 µs of host time per call
    in a compiled training step on the H200's host, 3.2 ms per 1B step), and the
    backward is traced into the backward graph with coda::dgated opaque in it."""

    @staticmethod
    def forward(op: str, y, p, w, bias):
        # the rewrite cast the operands as eager's autocast would have
        # (graph_utils.cast_for_gemm)
        with torch.autocast(device_type=y.device.type, enabled=False):
            return F.linear(y, w, bias)

    @staticmethod
    def setup_context(ctx, inputs, output):
        op, y, p, w, bias = inputs
        ctx.op, ctx.has_bias = op, bias is not None
        ctx.save_for_backward(p, w)

    @staticmethod
    def backward(ctx, dout):
        ops.refuse_second_derivative("the gated MLP's down projection")
        p, w = ctx.saved_tensors
        _, _, want_p, want_w, want_bias = ctx.needs_input_grad
        dout = dout.contiguous()
        dp, h = torch.ops.coda.dgated(ctx.op, dout, w, p)
        with weight_grad_wanted(want_w):  # a frozen weight: no wgrad GEMM
            grad_w = wgrad(dout, h)
        grad_bias = dout.sum(0, dtype=up(dout).dtype).to(dout.dtype) \
            if ctx.has_bias and want_bias else None
        return None, None, dp if want_p else None, grad_w, grad_bias


def gated_down_linear(op: str, y: torch.Tensor, p: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(y, weight, bias)`` for the rewritten graph, y and p of any leading
    shape (flattened to the op's 2-D contract and back)."""
    lead = y.shape[:-1]
    out = ops.record(GatedDown, op, y.reshape(-1, y.shape[-1]),
                     p.reshape(-1, p.shape[-1]), weight, bias)
    return out.reshape(*lead, weight.shape[0])
