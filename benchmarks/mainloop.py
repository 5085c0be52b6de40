"""QuACK's plain GEMM (no epilogue beyond storing D) against cuBLAS at the training step's
GEMM shapes: whether a fused GEMM can come within 3% of cuBLAS (#16's bar) through its
tile config, or whether QuACK's mainloop itself is what is slower.

    source .gpu/setup.sh && python benchmarks/mainloop.py [1b] [8b]

Per shape (M = 8192 tokens, the 1B step's 2 × 4096; N × K of each forward GEMM the
families fuse): cuBLAS (torch.mm on the weight's transpose, as F.linear calls it), then
QuACK's SM90 GEMM on every candidate config (its autotuner's SM90 list without swap-AB,
which pays only where M is the narrow side, plus the 128 × 128 tiles the pass picks for
few rows), each output checked against cuBLAS's. µs of one call replayed from a CUDA
graph (the device time alone, L2 flushed before each replay). The fused programs cost at
least this GEMM: a config list whose best is > 1.03x cuBLAS here says no epilogue or
config choice of the pass can meet the bar at that shape. $CODA_MAINLOOP_SECONDS (default
240) bounds the sweep: what ran by then is reported.
"""

from __future__ import annotations

import os
import sys
import time

import torch

from common import bench_graphed, env_line

bf = torch.bfloat16
ROWS = 8192
SHAPES = {  # (name, N, K) of the forward GEMMs a layer's families fuse
    "1b": [("o_proj (norm producer)", 2048, 2048), ("q/k/v (rope, norm consumer)", 3072, 2048),
           ("gate/up (gated, norm consumer)", 16384, 2048),
           ("down (norm producer)", 2048, 8192), ("LM head (norm consumer, loss)", 128256, 2048)],
    "8b": [("o_proj (norm producer)", 4096, 4096), ("q/k/v", 6144, 4096),
           ("gate/up", 28672, 4096), ("down", 4096, 14336)],
}


def candidates():
    from quack.gemm_config import GemmConfig, _get_sm90_configs
    configs = [c for c in _get_sm90_configs(None, True) if not c.swap_ab]
    # the pass's tiles for few rows (quack_path) that the list lacks
    configs.append(GemmConfig(tile_m=128, tile_n=128, pingpong=True, cluster_m=1, cluster_n=1,
                              swap_ab=False, device_capacity=9, is_dynamic_persistent=False,
                              use_tma_gather=False))
    # the pass's default and the earlier sweeps' best first: a sweep the deadline cuts
    # short has timed these
    first = ("128x192 pp c2x1", "128x128 pp c2x1", "128x256 coop c2x1", "256x128 coop c2x1",
             "256x192 coop c2x1", "128x256 coop c1x2")
    return sorted(configs, key=lambda c: first.index(label(c)) if label(c) in first
                  else len(first))


def label(c) -> str:
    kind = "pp" if c.pingpong else "coop"
    return f"{c.tile_m}x{c.tile_n} {kind} c{c.cluster_m}x{c.cluster_n}"


def main():
    from quack.gemm_interface import gemm_tuned
    print(env_line(), flush=True)
    which = [a for a in sys.argv[1:] if a in SHAPES] or ["1b"]
    deadline = time.time() + float(os.environ.get("CODA_MAINLOOP_SECONDS", "240"))
    configs = candidates()
    rows = []
    for family in which:
        for name, n, k in SHAPES[family]:
            torch.manual_seed(0)
            x = torch.randn(ROWS, k, device="cuda", dtype=bf)
            w = torch.randn(n, k, device="cuda", dtype=bf) / k ** 0.5
            want = torch.mm(x, w.t())
            cublas = bench_graphed(lambda: torch.mm(x, w.t())) * 1e3
            out = torch.empty_like(want)
            timed = {}
            for c in configs:
                if time.time() > deadline:
                    break
                try:
                    gemm_tuned.fn(x, w.t(), out, config=c)
                    torch.cuda.synchronize()
                except Exception as e:  # a config QuACK refuses at this shape
                    print(f"  {family} {name}: {label(c)} refused ({type(e).__name__})",
                          flush=True)
                    continue
                err = float((out.float() - want.float()).norm() / want.float().norm())
                if err > 1e-2:
                    print(f"  {family} {name}: {label(c)} wrong (rel. error {err:.2e})",
                          flush=True)
                    continue
                timed[label(c)] = bench_graphed(
                    lambda c=c: gemm_tuned.fn(x, w.t(), out, config=c)) * 1e3
            if not timed:
                print(f"{family} {name}: no config ran before the deadline", flush=True)
                continue
            best = min(timed, key=timed.get)
            default = timed.get("128x192 pp c2x1")
            print(f"{family} {name:<32} M {ROWS} N {n:6d} K {k:5d}: cuBLAS {cublas:8.1f} µs | "
                  f"QuACK default {default or float('nan'):8.1f} | best {best} "
                  f"{timed[best]:8.1f} ({timed[best] / cublas:.3f}x cuBLAS) | "
                  f"{len(timed)} configs", flush=True)
            ranked = sorted(timed, key=timed.get)[:4]
            print("    next: " + ", ".join(f"{r} {timed[r]:.1f}" for r in ranked[1:]),
                  flush=True)
            rows.append((family, name, cublas, default, best, timed[best]))
    print("\nshape | cuBLAS µs | QuACK default | QuACK best (config) | best / cuBLAS")
    for family, name, cublas, default, best, t in rows:
        print(f"{family} {name} | {cublas:.1f} | {default or float('nan'):.1f} | "
              f"{t:.1f} ({best}) | {t / cublas:.3f}x")


if __name__ == "__main__":
    main()
