"""The row-wise e4m3 GEMMs of an FP8 training step, one by one, on the H200: every linear
of a Llama-3.2-1B-shaped layer (q, k/v, o, gate/up, down) at 2 x 4096 tokens, each in its
three GEMMs (torchao's "rowwise" recipe, codegen/fp8.rowwise_grads):

    forward   y  = x·Wᵀ      M = tokens,    N = out,  K = in
    dgrad     dx = dy·W      M = tokens,    N = in,   K = out
    wgrad     dW = dyᵀ·x     M = out,       N = in,   K = tokens

the program ``fp8_rowwise`` (acc·r[i]·ws[j]) under the config the size policy picks and
under candidates (split-K where the grid is under a wave of the 132 SMs: the wgrad of a
k/v projection is 4 x 16 tiles of 128 x 128 over K = 8192), beside cuBLAS's row-scaled
FP8 GEMM (torch._scaled_mm, fast accumulation: torchao's) and the bf16 GEMM at the same
shape. Device time of one call replayed from a CUDA graph; every output checked against
cuBLAS's.

    source .gpu/setup.sh && python benchmarks/fp8_gemms.py

($CODA_FP8_GEMM_CONFIGS: a comma-separated subset of the candidates.)
"""

from __future__ import annotations

import os

import torch

from common import bench_graphed as bench, env_line, write_csv

from coda_rewrite.codegen import fp8
from coda_rewrite.kernels import quack_path

bf = torch.bfloat16
TOKENS = 8192
LINEARS = {"q/o": (2048, 2048), "k/v": (2048, 512), "gate/up": (2048, 8192),
           "down": (8192, 2048)}  # (in, out)


def gemms():
    """(linear, which, M, N, K) of the step's e4m3 GEMMs."""
    for name, (inp, out) in LINEARS.items():
        yield name, "forward", TOKENS, out, inp
        yield name, "dgrad", TOKENS, inp, out
        yield name, "wgrad", out, inp, TOKENS


def candidates() -> dict:
    cfg = quack_path.tile_config
    every = {"128x128 c2": cfg(128, 128, 2, fp8_fast_accum=True),
             "128x192 c2": cfg(128, 192, 2, fp8_fast_accum=True),
             "128x128 c1": cfg(128, 128, 1, fp8_fast_accum=True)}
    for tiles in ((128, 128, 2), (128, 192, 2), (128, 128, 1)):
        for split in (2, 3, 4):
            every[f"{tiles[0]}x{tiles[1]} c{tiles[2]} s{split}"] = cfg(
                *tiles, split_k=split, fp8_fast_accum=True)
    chosen = list(filter(None, os.environ.get("CODA_FP8_GEMM_CONFIGS", "").split(",")))
    return {k: every[k] for k in chosen} if chosen else every


def operands(m: int, n: int, k: int):
    a, r = fp8.quantize_rows(torch.randn(m, k, device="cuda", dtype=bf))
    b, ws = fp8.quantize_rows(torch.randn(n, k, device="cuda", dtype=bf))
    return a, b, r, ws


def main():
    print(env_line())
    torch.manual_seed(0)
    text = fp8.rowwise_program(bf).to_text()
    configs = candidates()
    ks, module = quack_path.load(text)
    table, csv = [], []
    for linear, which, m, n, k in gemms():
        a, b, r, ws = operands(m, n, k)
        ops_ = [r, ws]
        want = torch._scaled_mm(a, b.t(), scale_a=r[:, None], scale_b=ws[None, :],
                                out_dtype=bf, use_fast_accum=True)
        a16, b16 = (a.float() * r[:, None]).to(bf), (b.float() * ws[:, None]).to(bf)
        times = {"cuBLAS FP8": bench(lambda: torch._scaled_mm(
                     a, b.t(), scale_a=r[:, None], scale_b=ws[None, :], out_dtype=bf,
                     use_fast_accum=True)),
                 "cuBLAS bf16": bench(lambda: torch.nn.functional.linear(a16, b16))}
        picked = quack_path.prepare(ks, module, a, b, ops_)
        runs = {"picked": picked}
        for name, cfg in configs.items():
            try:
                launch = quack_path.prepare(ks, module, a, b, ops_, config=cfg)
                launch(a, b, ops_)
                torch.cuda.synchronize()
            except Exception as e:  # a config this kernel does not take
                print(f"{linear} {which} {name}: {type(e).__name__}: "
                      f"{str(e).splitlines()[0][:100]}", flush=True)
                continue
            runs[name] = launch
        bad = []
        for name, launch in runs.items():
            (got,) = launch(a, b, ops_)
            err = ((got.float() - want.float()).abs().max()
                   / want.float().abs().max()).item()
            if err > 1e-2:
                bad.append(f"{name} {err:.1e}")
                continue
            times[name] = bench(lambda launch=launch: launch(a, b, ops_))
        ours = {kk: v for kk, v in times.items() if not kk.startswith("cuBLAS")}
        best = min(ours, key=ours.get) if ours else "picked"
        print(f"{linear:<8} {which:<8} M={m:5d} N={n:5d} K={k:5d} "
              + " ".join(f"{kk} {v * 1e3:.1f}" for kk, v in times.items())
              + (f" | bad: {', '.join(bad)}" if bad else ""), flush=True)
        table.append((linear, which, m, n, k, times, best,
                      quack_path.config_name(picked.config)))
        csv += [(f"{linear} {which} {kk}", "ms", v) for kk, v in times.items()]
    print("\n| linear | GEMM | M × N × K | cuBLAS FP8 µs | bf16 µs | picked | picked µs | "
          "best | best µs |")
    print("|---|---|---|---|---|---|---|---|---|")
    for linear, which, m, n, k, t, best, picked in table:
        print(f"| {linear} | {which} | {m} × {n} × {k} | {t['cuBLAS FP8'] * 1e3:.1f} | "
              f"{t['cuBLAS bf16'] * 1e3:.1f} | {picked} | "
              f"{t.get('picked', float('nan')) * 1e3:.1f} | {best} | "
              f"{t.get(best, float('nan')) * 1e3:.1f} |")
    print("csv:", write_csv("fp8 step GEMMs", csv))


if __name__ == "__main__":
    main()
