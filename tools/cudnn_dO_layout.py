"""Does this PyTorch's cuDNN attention backward still reuse a cached graph for another dO
layout? (The bug coda_rewrite/attention_grad_layout.py guards against.)

    python tools/cudnn_dO_layout.py        # on a CUDA GPU with cuDNN attention (Hopper)

Plain PyTorch, no coda_rewrite: for each pair of dO layouts, two backward calls of causal
SDPA on the cuDNN backend with the same q, k, v ([b, s, h, d] views, a sequence length of
the pair's own so that it starts from an empty cache entry), each call's dq, dk, dv
against the math backend's. An affected PyTorch (2.11, measured 2026-12-04) gets the
second call of every pair wrong (about 1.4 relative error, or NaN); a fixed one keys the
cache on dO's strides as well, and every line reads about 3e-3.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

B, H, D = 2, 4, 64


def _grad_out(layout: str, s: int, g: torch.Generator) -> torch.Tensor:
    d_o = torch.randn(B, H, s, D, device="cuda", dtype=torch.bfloat16, generator=g)
    if layout == "[b, s, h, d]":  # what o.transpose(1, 2).contiguous() gives back
        return d_o.transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "padded":  # rows of a wider buffer
        wide = torch.zeros(B, s, H, 2 * D, device="cuda", dtype=torch.bfloat16)
        return wide[..., :D].transpose(1, 2).copy_(d_o)
    return d_o  # [b, h, s, d] contiguous


def grads(layout: str, s: int, backend: SDPBackend) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(s)
    q, k, v = (torch.randn(B, s, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
               .transpose(1, 2).requires_grad_(True) for _ in range(3))
    d_o = _grad_out(layout, s, g)
    with sdpa_kernel(backend):
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(d_o)
    return [t.grad for t in (q, k, v)]


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("cudnn_dO_layout.py: needs a CUDA GPU (cuDNN attention)")
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, "
          f"{torch.cuda.get_device_name()}")
    pairs = [("[b, s, h, d]", "[b, h, s, d]"), ("[b, h, s, d]", "[b, s, h, d]"),
             ("[b, s, h, d]", "padded"), ("padded", "[b, s, h, d]")]
    for i, pair in enumerate(pairs):
        s = 128 * (i + 1)
        for call, layout in enumerate(pair):
            cudnn = grads(layout, s, SDPBackend.CUDNN_ATTENTION)
            math = grads(layout, s, SDPBackend.MATH)
            errs = [((a.float() - b.float()).norm() / b.float().norm()).item()
                    for a, b in zip(cudnn, math)]
            print(f"s={s} call {call + 1}, dO {layout:<13} dq, dk, dv error: "
                  + " ".join(f"{e:.1e}" for e in errs))


if __name__ == "__main__":
    main()
