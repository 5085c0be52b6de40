"""The grouped GEMM of a dense experts layer's routed form (patterns/dense_experts.py,
coda_rewrite/routing.py): torch._grouped_mm where a traced graph takes it, else the
same product over coda::grouped_mm with its two backward GEMMs."""

from __future__ import annotations

import torch

from ..canonical import GROUPED_MM_MARK
from . import grouped, ops


def expert_gemm(a: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor
                ) -> torch.Tensor:
    """Rows [offsets[e-1], offsets[e]) of ``a`` [S, K] times ``weight[e]`` [K, N] (the
    stacked experts' own [E, K, N] layout). torch._grouped_mm where it takes the operands
    in a traced graph (bfloat16, 16-byte rows: Inductor lowers it as it would the
    model's own); elsewhere (float16, float32, float64, odd widths: its meta function
    takes bfloat16 only) the same product through coda::grouped_mm, whose backward is
    ExpertGemm's."""
    if a.dtype == torch.bfloat16 and weight.dtype == a.dtype and \
            all(n * 2 % 16 == 0 for n in (a.shape[1], weight.shape[-1])):
        return torch._grouped_mm(a, weight, offs=offsets)
    return ExpertGemm.apply(a, weight, offsets)


setattr(expert_gemm, GROUPED_MM_MARK, True)  # a grouped_mm to the families after its emitter


class ExpertGemm(torch.autograd.Function):
    """The grouped GEMM with its two backward GEMMs, over formula-less coda::grouped_mm
    (torch._grouped_mm on CUDA 16-bit operands, the reference's loop elsewhere)."""

    @staticmethod
    def forward(a, weight, offsets):
        return grouped.live_rows(torch.ops.coda.grouped_mm(a, weight, offsets, False),
                                 offsets)

    @staticmethod
    def setup_context(ctx, inputs, output):
        a, weight, offsets = inputs
        ctx.save_for_backward(a, weight, offsets)

    @staticmethod
    def backward(ctx, grad):
        ops.refuse_second_derivative("the routed form of the dense experts' GEMM")
        a, weight, offsets = ctx.saved_tensors
        grad = grad.to(a.dtype).contiguous()
        da = dw = None
        if ctx.needs_input_grad[0]:
            da = grouped.live_rows(torch.ops.coda.grouped_mm(
                grad, weight.mT, offsets, False), offsets)
        if ctx.needs_input_grad[1]:
            dw = torch.ops.coda.grouped_mm(a, grad, offsets, True)
        return da, dw, None
