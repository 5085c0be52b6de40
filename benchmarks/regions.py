"""Each matched region at Llama-3-8B shapes (8192 tokens, hidden 4096, intermediate
14336, 32 q / 8 kv heads, vocab 128256): the producing GEMM + residual + RMSNorm + every
consumer GEMM, as the pass rewrites it (optimize(): generated kernels), against the same
bare cuBLAS GEMMs, torch.compile of the unfused region and eager.

    source .gpu/setup.sh && python benchmarks/regions.py
"""

from __future__ import annotations

import torch
import torch.nn as nn

from common import bench, env_line

import coda_rewrite
from coda_rewrite.kernels import ops

M, H, FFN, Q, KV, V = 8192, 4096, 14336, 4096, 1024, 128256
bf = torch.bfloat16


class Region(nn.Module):
    """producer GEMM -> residual add -> Hugging Face-style RMSNorm -> consumer GEMMs."""

    def __init__(self, k0, consumers):
        super().__init__()
        self.producer = nn.Linear(k0, H, bias=False)
        self.weight = nn.Parameter(torch.rand(H) + 0.5)
        self.consumers = nn.ModuleList(nn.Linear(H, n, bias=False) for n in consumers)

    def forward(self, x, residual):
        z = residual + self.producer(x)
        h = z.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
        h = self.weight * h.to(z.dtype)
        return z, [c(h) for c in self.consumers]


REGIONS = {
    "o_proj -> post-attn norm -> gate, up": (H, [FFN, FFN]),
    "down -> input norm -> q, k, v": (FFN, [Q, KV, KV]),
    "down -> final norm -> lm_head": (FFN, [V]),
}


def main():
    print(env_line(), flush=True)
    rows = []
    for name, (k0, consumers) in REGIONS.items():
        torch.manual_seed(0)
        region = Region(k0, consumers).cuda().to(bf)
        x = torch.randn(M, k0, device="cuda", dtype=bf)
        res = torch.randn(M, H, device="cuda", dtype=bf)
        with torch.no_grad():
            fused = coda_rewrite.optimize(region)
            compiled = torch.compile(region)
            z, outs = region(x, res)
            zf, outs_f = fused(x, res)
            assert fused.report.count() == 1, str(fused.report)
            errs = [float((a.float() - b.float()).norm() / b.float().norm())
                    for a, b in zip([z, *outs], [zf, *outs_f])]
            h = torch.randn(M, H, device="cuda", dtype=bf)
            ws = [c.weight for c in region.consumers]
            w0 = region.producer.weight

            def bare():
                torch.mm(x, w0.t())
                for w in ws:
                    torch.mm(h, w.t())

            t = {"fused": bench(lambda: fused(x, res)), "bare": bench(bare),
                 "compile": bench(lambda: compiled(x, res)),
                 "eager": bench(lambda: region(x, res))}
        rows.append((name, t, max(errs)))
        print(name, t, "max rel diff vs eager", max(errs), flush=True)
        torch.cuda.empty_cache()
    print("\nruntime:", *ops.runtime_summary(), sep="\n  ")
    print(f"\n{env_line()}")
    print(f"{'region (8192 tokens, Llama-3-8B)':40s} {'fused':>8s} {'cuBLAS':>8s} {'compile':>8s} "
          f"{'eager':>8s}  fused/cuBLAS  fused/compile")
    ratios = []
    for name, t, _ in rows:
        ratios.append(t["fused"] / t["bare"])
        print(f"{name:40s} {t['fused']:8.3f} {t['bare']:8.3f} {t['compile']:8.3f} "
              f"{t['eager']:8.3f}  {t['fused'] / t['bare']:10.3f}x  {t['fused'] / t['compile']:10.3f}x")
    g = 1.0
    for r in ratios:
        g *= r
    print(f"geometric mean fused/cuBLAS: {g ** (1 / len(ratios)):.3f}x")


if __name__ == "__main__":
    main()
