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

from common import bench, bench_graphed, env_line

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
    shapes = []
    for family in which:
        for name, n, k in SHAPES[family]:
            torch.manual_seed(0)
            x = torch.randn(ROWS, k, device="cuda", dtype=bf)
            w = torch.randn(n, k, device="cuda", dtype=bf) / k ** 0.5
            shapes.append(dict(family=family, name=name, n=n, k=k, x=x, w=w,
                               want=torch.mm(x, w.t()), timed={},
                               cublas=bench_graphed(lambda x=x, w=w: torch.mm(x, w.t())) * 1e3))
    # configs outermost, in the order candidates() puts them: each compile costs seconds,
    # so a sweep the deadline cuts short has timed the same configs at every shape
    for c in candidates():
        if time.time() > deadline:
            print(f"deadline: configs from {label(c)} on not timed", flush=True)
            break
        for s in shapes:
            x, w, want = s["x"], s["w"], s["want"]
            out = torch.empty_like(want)
            try:
                gemm_tuned.fn(x, w.t(), out, config=c)
                torch.cuda.synchronize()
            except Exception as e:  # a config QuACK refuses at this shape
                print(f"  {s['name']}: {label(c)} refused ({type(e).__name__})", flush=True)
                continue
            err = float((out.float() - want.float()).norm() / want.float().norm())
            if err > 1e-2:
                print(f"  {s['name']}: {label(c)} wrong (rel. error {err:.2e})", flush=True)
                continue
            call = lambda c=c, x=x, w=w, out=out: gemm_tuned.fn(x, w.t(), out, config=c)
            try:
                s["timed"][label(c)] = bench_graphed(call) * 1e3
            except Exception as e:  # not capturable: a plain loop (host time may show)
                print(f"  {s['name']}: {label(c)} not graphed ({type(e).__name__}: {e})",
                      flush=True)
                s["timed"][label(c)] = bench(call) * 1e3
            print(f"  {s['name']}: {label(c)} {s['timed'][label(c)]:.1f} µs "
                  f"(cuBLAS {s['cublas']:.1f})", flush=True)
    print("\nshape | M N K | cuBLAS µs | QuACK default | QuACK best (config) | best / cuBLAS"
          " | configs timed")
    for s in shapes:
        timed, cublas = s["timed"], s["cublas"]
        if not timed:
            print(f"{s['family']} {s['name']} | no config ran", flush=True)
            continue
        best = min(timed, key=timed.get)
        default = timed.get("128x192 pp c2x1", float("nan"))
        print(f"{s['family']} {s['name']} | {ROWS} {s['n']} {s['k']} | {cublas:.1f} | "
              f"{default:.1f} | {timed[best]:.1f} ({best}) | {timed[best] / cublas:.3f}x | "
              f"{len(timed)}")


if __name__ == "__main__":
    main()
