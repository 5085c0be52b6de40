"""Granite / Phi-3's producer side at Llama-3-8B shapes (8192 tokens): o_proj → dropout
(eval) → × multiplier → residual add → RMSNorm → q, k, v, against the same region
without the multiplier, each under eager, torch.compile and backend="coda" (the
multiplier fused into the producer's epilogue), in alternating rounds.

    source .gpu/setup.sh && python benchmarks/scaled_residual.py
"""

from __future__ import annotations

import torch
import torch.nn as nn

from common import bench_rounds, env_line, write_csv
from regions import H, KV, M, Q, Region, bf


class ScaledRegion(Region):
    def __init__(self, multiplier: float | None):
        super().__init__(H, [Q, KV, KV])
        self.drop = nn.Dropout(0.1)
        self.multiplier = multiplier

    def forward(self, x, residual):
        y = self.drop(self.producer(x))
        if self.multiplier is not None:
            y = y * self.multiplier
        z = residual + y
        h = z.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
        h = self.weight * h.to(z.dtype)
        return z, [c(h) for c in self.consumers]


def main():
    print(env_line())
    x = torch.randn(M, H, device="cuda", dtype=bf)
    res = torch.randn(M, H, device="cuda", dtype=bf)
    rows = []
    for label, mult in (("multiplier 0.22", 0.22), ("no multiplier", None)):
        torch.manual_seed(0)
        region = ScaledRegion(mult).cuda().to(bf).eval()
        torch._dynamo.reset()
        variants = {"eager": region, "torch.compile": torch.compile(region),
                    'backend="coda"': torch.compile(region, backend="coda")}
        with torch.no_grad():
            want = region(x, res)[1][0].float()
            for name, m in variants.items():
                got = m(x, res)[1][0].float()
                print(f"{label} {name}: rel. error {float((got - want).norm() / want.norm()):.2e}")
            timed = bench_rounds({k: (lambda m=m: m(x, res)) for k, m in variants.items()})
        base = timed["torch.compile"][0]
        for name, (ms, spread) in timed.items():
            print(f"{label:<16} {name:<16} {ms:7.3f} ms (spread {spread:.1%})  "
                  f"{base / ms:5.2f}x torch.compile", flush=True)
            rows.append((f"{label} {name}", "ms", ms))
    print("csv:", write_csv("scaled residual region (8B shapes)", rows))


if __name__ == "__main__":
    main()
