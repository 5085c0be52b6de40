"""The numerics policy (DESIGN.md), as functions the demo, tests and benchmarks share.

Errors are norm-wise over whole tensors, ‖out − ref‖ / ‖ref‖. For 16-bit models the rule
is "no worse than eager": the rewritten model's error against a float64 copy is at most
1.25x eager's own error against it, median over seeds.
"""

from __future__ import annotations

import copy
import statistics
from typing import Callable

import torch
import torch.nn as nn

BF16_RATIO_LIMIT = 1.25


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
                         device="cpu") -> dict:
    """Eager-vs-float64 and rewritten-vs-float64 errors of the logits, per seed.

    ``make_model(seed)`` builds the float32 model; the float64 reference and the
    ``dtype`` copy are made from it, so all three share weights."""
    eager_errs, new_errs = [], []
    for seed in seeds:
        base = make_model(seed).eval()
        ref_model = copy.deepcopy(base).to(device=device, dtype=torch.float64)
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
