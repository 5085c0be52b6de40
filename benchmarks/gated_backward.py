"""The gated MLP's backward at the down projection, at the Llama-3.2-1B and Llama-3-8B
MLP shapes (8192 tokens): the dgrad GEMM dh = dout·W_d with dSwiGLU in its epilogue
(coda::dgated: dp and the recomputed h) against what eager and torch.compile run (cuBLAS
dh, then dSwiGLU as one Inductor kernel reading dh, g, u, with h saved from the
forward) and cuBLAS's dh alone; each output checked against a float64 reference.

    source .gpu/setup.sh && python benchmarks/gated_backward.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from common import bench_rounds, env_line, write_csv

from quack.gemm_config import GemmConfig

from coda_rewrite.kernels import dgated, ops
from coda_rewrite.numerics import rel_err

SHAPES = {"1b": (8192, 2048, 8192), "8b": (8192, 4096, 14336)}  # tokens, hidden, inter
# GemmConfig fields: candidates beside the size policy's pick (QuACK's default: 128 x 192,
# pingpong, cluster 2; pingpong tiles are at most 208 wide)
CONFIGS = [dict(tile_m=128, tile_n=128, cluster_m=2),
           dict(tile_m=128, tile_n=192, cluster_m=1),
           dict(tile_m=256, tile_n=128, cluster_m=2, pingpong=False),
           dict(tile_m=128, tile_n=256, cluster_m=2, pingpong=False),
           dict(tile_m=256, tile_n=192, cluster_m=2, pingpong=False)]


def unfused_backward(dout, w, g, u):
    """What torch.compile runs for the same gradients: dh from cuBLAS, then one fused
    elementwise kernel (h is saved by the forward: not recomputed here)."""
    dh = dout @ w

    @torch.compile
    def dswiglu(dh, g, u):
        gf, uf, dhf = g.float(), u.float(), dh.float()
        s = torch.sigmoid(gf)
        return (dhf * uf * s * (1 + gf * (1 - s))).to(g.dtype), (dhf * gf * s).to(g.dtype)

    return dh, dswiglu


def main():
    print(env_line(), flush=True)
    rows = []
    for shape, (m, hidden, inter) in SHAPES.items():
        torch.manual_seed(0)
        dout = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(hidden, inter, device="cuda", dtype=torch.bfloat16) / hidden ** 0.5
        p = torch.randn(m, 2 * inter, device="cuda", dtype=torch.bfloat16)
        g, u = p[:, 0::2].contiguous(), p[:, 1::2].contiguous()
        _, dswiglu = unfused_backward(dout, w, g, u)

        def fused():
            return torch.ops.coda.dgated("swiglu", dout, w, p)

        def unfused():
            return dswiglu(dout @ w, g, u)

        def cublas():
            return dout @ w

        dp, h = fused()
        dh64 = dout.double() @ w.double()
        g64, u64 = g.double(), u.double()
        s = torch.sigmoid(g64)
        want_dg, want_du = dh64 * u64 * s * (1 + g64 * (1 - s)), dh64 * F.silu(g64)
        err = max(rel_err(dp[:, 0::2].double(), want_dg), rel_err(dp[:, 1::2].double(), want_du),
                  rel_err(h.double(), F.silu(g64) * u64))
        base_dg, base_du = unfused()
        base = max(rel_err(base_dg.double(), want_dg), rel_err(base_du.double(), want_du))
        kernel = [k for k in ops.runtime_counts() if k[0] == "dgated_swiglu" and k[1] == "kernel"]
        variants = {"dgated (fused)": fused, "cuBLAS + Inductor dSwiGLU": unfused,
                    "cuBLAS dh alone": cublas}
        for fields in CONFIGS:  # other tile configs of the same kernel
            name = "dgated " + " ".join(f"{k}={v}" for k, v in fields.items())
            try:
                launch = dgated.Launch(dgated.load("swiglu"), dout, w, p,
                                       config=GemmConfig(is_dynamic_persistent=False, **fields))
                launch(dout, w, p)
            except Exception as e:  # a config QuACK refuses for this problem
                print(f"{name}: refused ({type(e).__name__}: {str(e)[:80]})", flush=True)
                continue
            variants[name] = lambda launch=launch: launch(dout, w, p)
        times = bench_rounds(variants)
        for variant, (ms, spread) in times.items():
            rows.append((f"{shape} {variant}", "ms", ms))
            print(f"{shape} M={m} H={hidden} I={inter}: {variant:28s} {ms:7.3f} ms "
                  f"(spread {spread:.1%})", flush=True)
        print(f"{shape}: errors vs float64: fused {err:.2e}, unfused {base:.2e}; kernel ran: "
              f"{bool(kernel)}", flush=True)
    write_csv("gated backward at the down projection", rows)


if __name__ == "__main__":
    main()
