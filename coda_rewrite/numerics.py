"""The numerics policy (DESIGN.md), as functions the demo, tests and benchmarks share.

Errors are norm-wise over whole tensors, ‖out − ref‖ / ‖ref‖. For 16-bit models the rule
is "no worse than eager": the rewritten model's error against a float64 copy is at most
1.25x eager's own error against it, median over seeds. FP8 (``options.fp8``) cannot meet
that; its bar is torchao's float8 row-wise recipe, emulated here on the model's own
linears (README, "Numerics policy for FP8"): no worse than 1.5x the recipe's error.
"""

from __future__ import annotations

import copy
import statistics
from typing import Callable

import torch
import torch.nn as nn

BF16_RATIO_LIMIT = 1.25
FP8_RATIO_LIMIT = 1.5


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ over the whole tensor, in float64 (NaN stays NaN)."""
    out, ref = out.detach().double(), ref.detach().double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-300))


def logits_of(output) -> torch.Tensor:
    """Hugging Face outputs carry .logits; plain models return the tensor."""
    return output.logits if hasattr(output, "logits") else output


def low_precision_errors(make_model: Callable[[int], nn.Module], inputs: dict | tuple,
                         rewrite: Callable[[nn.Module], nn.Module],
                         dtype=torch.bfloat16, seeds=(0, 1, 2, 3, 4),
                         device="cpu", reference_dtype=torch.float64) -> dict:
    """Eager's and the rewritten model's errors of the logits against a float64 copy (or
    ``reference_dtype``), per seed.

    ``make_model(seed)`` builds the float32 model; the float64 reference and the
    ``dtype`` copy are made from it, so all three share weights. ``reference_dtype``:
    float32 for a model some of whose ops have no float64 kernel (torch._grouped_mm),
    still 2¹⁶ times finer than bf16's rounding."""
    eager_errs, new_errs = [], []
    for seed in seeds:
        base = make_model(seed).eval()
        ref_model = copy.deepcopy(base).to(device=device, dtype=reference_dtype)
        low = copy.deepcopy(base).to(device=device, dtype=dtype)
        with torch.no_grad():
            ref = logits_of(_call(ref_model, inputs))
            eager = logits_of(_call(low, inputs))
            new = logits_of(_call(rewrite(low), inputs))
        eager_errs.append(rel_err(eager, ref))
        new_errs.append(rel_err(new, ref))
    ratio = statistics.median(new_errs) / statistics.median(eager_errs)
    return {"eager": eager_errs, "rewritten": new_errs, "ratio": ratio,
            "ok": ratio <= BF16_RATIO_LIMIT}


def _call(model, inputs):
    return model(**inputs) if isinstance(inputs, dict) else model(*inputs)


class RowwiseRecipe(torch.autograd.Function):
    """torchao's float8 row-wise recipe for one linear, emulated in float64 (the FP8 bar):
    each of its three GEMMs (forward, dgrad, wgrad) on e4m3 operands scaled along the
    dims that GEMM keeps, the result rounded to the input's dtype."""

    @staticmethod
    def forward(ctx, x, w, b):
        from .algebra.fp8 import rowwise
        ctx.save_for_backward(x, w)
        ctx.biased = b is not None
        y = rowwise(x.reshape(-1, x.shape[-1]).double(), w.double())
        y = y + (0 if b is None else b.double())
        return y.reshape(*x.shape[:-1], -1).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        from .algebra.fp8 import rowwise
        x, w = ctx.saved_tensors
        d, x2 = dy.reshape(-1, dy.shape[-1]).double(), x.reshape(-1, x.shape[-1]).double()
        dx = rowwise(d, w.double().T).reshape(x.shape).to(x.dtype)
        dw = rowwise(d.T, x2.T).to(w.dtype)
        return dx, dw, d.sum(0).to(w.dtype) if ctx.biased else None


def rowwise_recipe(model: nn.Module, chosen: Callable[[str, nn.Linear], bool]) -> nn.Module:
    """A copy of ``model`` whose ``nn.Linear`` modules that ``chosen(name, linear)`` picks
    run torchao's row-wise recipe (``RowwiseRecipe``), forward and backward."""
    emulated = copy.deepcopy(model)
    for name, lin in emulated.named_modules():
        if isinstance(lin, nn.Linear) and chosen(name, lin):
            lin.forward = lambda x, lin=lin: RowwiseRecipe.apply(x, lin.weight, lin.bias)
    return emulated
