"""The numerics of a LayerNorm deferred into the GEMM that reads it (issue #20, part 2),
before the rewrite exists: is the algebra safe in bf16 when the activations' mean is
large against their spread?

    LN(z)·Wᵀ + b = r ⊙ (z·W'ᵀ − μ·s) + b',   W' = W ∘ γ,  s_j = Σ_k W'[j, k],
                                              b' = W·β + b,  r = rsqrt(var + eps)

z·W'ᵀ and μ·s are both of the size of the mean and cancel to the size of the spread:
with z = μ + δ, z·W'ᵀ − μ·s = δ·W'ᵀ exactly if s is the sum of the very weights the GEMM
multiplies (W' rounded to bf16, s summed in float32 from those values), since each
product of two bf16 values is exact in float32; what is left is the float32
accumulation, ~2^-24 of the mean's part. A naive variance E[z²] − μ² cancels the same
way in the statistic itself (a Chan/Welford merge, or two passes, does not).

Per ratio mean / std of the rows (z rounded to bf16, as the residual stream is), the
relative error of the bf16 output against float64 (LN of the same bf16 z, the same bf16
weights): eager (F.layer_norm in bf16, then F.linear), the deferred form with a
two-pass statistic, and the deferred form with the naive one. CPU, no GPU needed (the
GEMM emulated as float32 products of the bf16 values, float32 accumulation).

    python benchmarks/layernorm_numerics.py [M K N]
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

bf = torch.bfloat16


def rel(a, b):
    return float((a.double() - b).norm() / b.norm())


def run(m: int, k: int, n: int, ratio: float, seed: int = 0, eps: float = 1e-5):
    g = torch.Generator().manual_seed(seed)
    sigma = 1.0 + torch.rand(m, 1, generator=g, dtype=torch.float64)
    mean = ratio * sigma * torch.sign(torch.randn(m, 1, generator=g, dtype=torch.float64))
    z = (mean + sigma * torch.randn(m, k, generator=g, dtype=torch.float64)).to(bf)
    gamma = (1 + 0.2 * torch.randn(k, generator=g, dtype=torch.float64)).to(bf)
    beta = (0.1 * torch.randn(k, generator=g, dtype=torch.float64)).to(bf)
    w = (torch.randn(n, k, generator=g, dtype=torch.float64) / k ** 0.5).to(bf)
    b = (0.1 * torch.randn(n, generator=g, dtype=torch.float64)).to(bf)
    z64 = z.double()
    ref = F.linear(F.layer_norm(z64, (k,), gamma.double(), beta.double(), eps),
                   w.double(), b.double())
    eager = F.linear(F.layer_norm(z, (k,), gamma, beta, eps), w, b)
    w_fold = (w.float() * gamma.float()).to(bf)          # W' in the GEMM's dtype
    s = w_fold.float().sum(-1)                          # from the values it multiplies
    b_fold = w.float() @ beta.float() + b.float()
    acc = z.float() @ w_fold.float().t()                # exact products, f32 accumulation
    zf = z.float()
    mu = zf.mean(-1, keepdim=True)
    two_pass = (zf - mu).square().mean(-1, keepdim=True)
    naive = (zf.square().mean(-1, keepdim=True) - mu.square()).clamp_min(0)
    out = {}
    for name, var in (("deferred, two-pass statistic", two_pass),
                      ("deferred, naive E[z²] − μ²", naive)):
        r = torch.rsqrt(var + eps)
        out[name] = (r * (acc - mu * s) + b_fold).to(bf)
    return {"eager": rel(eager, ref), **{k_: rel(v, ref) for k_, v in out.items()}}


def main():
    m, k, n = (int(a) for a in sys.argv[1:4]) if len(sys.argv) >= 4 else (256, 2048, 512)
    print(f"M {m}, K {k}, N {n}; relative error of the bf16 output against float64 "
          "(median of 3 seeds)")
    print("| mean / std | eager | deferred, two-pass statistic | deferred, naive E[z²] − μ² |")
    print("|---|---|---|---|")
    for ratio in (0.0, 1.0, 10.0, 100.0, 1000.0):
        runs = [run(m, k, n, ratio, seed) for seed in range(3)]
        med = {key: sorted(r[key] for r in runs)[1] for key in runs[0]}
        print(f"| {ratio:g} | " + " | ".join(f"{v:.2e}" for v in med.values()) + " |")


if __name__ == "__main__":
    main()
