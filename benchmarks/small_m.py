"""Small M: each program family's fused GEMM on candidate tile configs beside cuBLAS plus
Inductor's fused epilogue, at M ∈ {1 … 4096} rows and the 1B and 8B layer shapes.

    source .gpu/setup.sh && python benchmarks/small_m.py [1b|8b ...] [--rows 1,8,...] [--static]
                                                         [--picked]

The programs and their operands are captured from a one-layer Llama of each shape with
its LM head and loss (optimize(), every GEMM fused), run at batch 1 and M tokens (at most
32768: the RoPE table's length), so each family is timed on the operands the model gives
it (each reduction width K once: the norm producer of the attention output, K = dim,
and of the down projection, K = ffn_dim). Per (family, K, M):

    cuBLAS      F.linear alone, the floor
    unfused     cuBLAS (F.linear) + the program's reference epilogue on its output
                under torch.compile (dynamic shapes, or per M with --static): an
                upper bound of what the pass leaves where it does not fuse (the
                reference's RoPE and norm are not the models' cheapest spellings, and a
                dynamic-shape kernel not Inductor's best); cuBLAS alone is the lower bound
    <config>    the fused GEMM through its planned launch (QuACK's EpiPlan.run) on each
                candidate config; a config whose output differs from the reference by
                more than the bf16 policy allows is reported and never chosen

Times are GPU medians of one call replayed from a CUDA graph (triton's do_bench, L2
flushed): device time, not the host's (benchmarks/host_overhead.py measures that). The
last table, per family and M: the config the pass picks (kernels/quack_path.config_for)
and its ratios to cuBLAS and to the unfused time, and the fastest candidate: what
size_policy's threshold and the row classes are decided from.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from common import bench_graphed as bench, env_line, write_csv

import coda_rewrite
from coda_rewrite.codegen import reference
from coda_rewrite.codegen.program import Kind, parse
from coda_rewrite.kernels import ops, quack_path
from coda_rewrite.models import Llama, LlamaArgs

bf = torch.bfloat16
SHAPES = {"1b": LlamaArgs(dim=2048, n_layers=1, n_heads=32, n_kv_heads=8, ffn_dim=8192,
                          vocab_size=128256, max_seq_len=32768),
          "8b": LlamaArgs(dim=4096, n_layers=1, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                          vocab_size=128256, max_seq_len=32768)}
ROWS = (1, 8, 16, 64, 256, 1024, 4096)
STATIC = "--static" in sys.argv  # the unfused baseline compiled per M (Inductor's best
# epilogue kernel for that size, at a compile per family and M) instead of once with
# dynamic shapes
PICKED = "--picked" in sys.argv  # only the config the pass picks (no candidate sweep)
# $CODA_SMALL_M_FAMILIES: a comma-separated subset of the program families (rope, gated,
# residual_rmsnorm, cross_entropy, rowscale); unset: every family
FAMILIES = set(filter(None, os.environ.get("CODA_SMALL_M_FAMILIES", "").split(",")))


def candidates() -> dict:
    """Tile configs to sweep; $CODA_SMALL_M_CONFIGS (comma-separated names) picks some."""
    from quack.gemm_config import GemmConfig

    def cfg(m, n, cm=1, cn=1, pingpong=True, split_k=1, tile_k=None):
        return GemmConfig(tile_m=m, tile_n=n, cluster_m=cm, cluster_n=cn, pingpong=pingpong,
                          is_dynamic_persistent=False, split_k=split_k, tile_k=tile_k)
    every = {"default": None, "128x128 c2": cfg(128, 128, 2), "128x64 c1": cfg(128, 64),
             "64x128 c1": cfg(64, 128), "64x256 c1": cfg(64, 256),
             # a wave of the H200's 132 SMs at 256 rows of the 8B q/k/v (N = 6144):
             # 4 x 32 tiles of 64 x 192
             "64x192 c1": cfg(64, 192), "128x192 c1": cfg(128, 192)}
    # split-K (SERIAL: the last split runs the epilogue on the whole sum) where the grid
    # starves: 256 rows of an N = 2048 norm producer are 2 x 32 tiles of 128 x 64
    for tiles, cm in (((128, 64), 1), ((128, 128), 1), ((64, 128), 1), ((128, 128), 2)):
        for split in (2, 3, 4):
            every[f"{tiles[0]}x{tiles[1]} c{cm} s{split}"] = cfg(*tiles, cm, split_k=split)
    # the mainloop's other knobs at small M: 128-deep K steps (half the pipeline's
    # iterations), cooperative warp groups instead of ping-pong, 64 x 64 tiles
    for tiles, cm in (((128, 64), 1), ((128, 128), 1), ((128, 128), 2), ((64, 128), 1)):
        every[f"{tiles[0]}x{tiles[1]} c{cm} k128"] = cfg(*tiles, cm, tile_k=128)
        every[f"{tiles[0]}x{tiles[1]} c{cm} coop"] = cfg(*tiles, cm, pingpong=False)
    every["64x64 c1"] = cfg(64, 64)
    every["128x64 c2"] = cfg(128, 64, 2)
    # thousands of rows at N = 2048 (the 1B norm producers): QuACK's 128 x 192 leaves a
    # third of its last column of tiles empty and a last wave a third full (4096 rows:
    # 352 tiles on 132 SMs); 256 x 128 and 128 x 256 tile N = 2048 exactly
    every["256x128 c2 coop"] = cfg(256, 128, 2, pingpong=False)
    every["128x256 c2 coop"] = cfg(128, 256, 2, pingpong=False)
    every["256x128 c1 coop"] = cfg(256, 128, 1, pingpong=False)
    # the gated pair's GEMM at thousands of rows (its plain mainloop's best on the 8B
    # gate/up, benchmarks/mainloop.py: 192 x 128 ping-pong, a cluster of two along N)
    every["192x128 c1x2"] = cfg(192, 128, 1, 2)
    chosen = list(filter(None, os.environ.get("CODA_SMALL_M_CONFIGS", "").split(",")))
    return {k: every[k] for k in chosen} if chosen else every


class WithLoss(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, tokens, labels):
        return F.cross_entropy(self.model(tokens).flatten(0, 1).float(), labels.flatten())


def capture(fast, vocab: int, rows: int) -> dict:
    """{(family, K): (program, a, b, operands)} of the fused calls at ``rows`` tokens (the
    norm producers: o_proj, K = dim, and down, K = ffn_dim)."""
    seen, original = {}, ops.execute

    def spy(program, a, b, operands):
        key = (parse(program).family, a.shape[-1])
        if parse(program).gemm and key not in seen:
            seen[key] = (program, a.clone(), b.clone(),
                         [t.clone() if isinstance(t, torch.Tensor) else t for t in operands])
        return original(program, a, b, operands)

    x = torch.randint(0, vocab, (1, rows), device="cuda")
    ops.execute = spy
    try:
        with torch.no_grad():
            fast(x, x)
    finally:
        ops.execute = original
    return seen


def worst_error(outs, want, prog=None) -> float:
    """The largest max-abs error of an output over its reference's max; a ROW_PARTIALS
    output (a deferred norm producer's, [M, tiles]) by its row sums (the reference hands
    on one merged column)."""
    err = 0.0
    kinds = [o.kind for o in prog.outputs] if prog is not None else [None] * len(outs)
    for o, w, kind in zip(outs, want, kinds):
        if kind == Kind.ROW_PARTIALS:
            o = o.sum(1, keepdim=True)
        o, w = o.float().reshape(-1), w.float().reshape(-1)
        scale = w.abs().max().clamp_min(1e-6)
        err = max(err, ((o - w).abs().max() / scale).item())
    return err


def sweep(shape: str, rows_list, configs: dict) -> list:
    torch.manual_seed(0)
    model = Llama(SHAPES[shape]).cuda().to(bf).eval()
    torch._dynamo.reset()
    # one optimize() for every M (dynamo makes the rows symbolic after the first
    # recompile; symbolic row counts are fused), one Inductor reference per program
    fast = coda_rewrite.optimize(WithLoss(model), min_fused_rows=0)
    references, rows_out = {}, []
    for rows in rows_list:
        for (family, _), (program, a, b, operands) in capture(fast, model.args.vocab_size,
                                                              rows).items():
            if FAMILIES and family not in FAMILIES:
                continue
            prog = parse(program)
            kernel, why = quack_path.select(prog, program, a, b, operands)
            if kernel is None:
                print(f"{shape} {family} M={rows}: no kernel ({why})", flush=True)
                continue
            key = (program, rows if STATIC else None)
            ref = references.setdefault(key, torch.compile(
                lambda a, b, *o, prog=prog: reference.run_program(
                    prog, a, b, list(o), acc=F.linear(a, b)), dynamic=not STATIC))
            want = ref(a, b, *operands)
            times = {"cuBLAS": bench(lambda: F.linear(a, b)),
                     "unfused": bench(lambda: ref(a, b, *operands))}
            errors = {}
            head = quack_path._table_head_dim(prog, operands)
            for name, cfg in configs.items():
                if cfg is not None and head and cfg.tile_n % head and head % cfg.tile_n:
                    continue  # a table tile holds whole heads or a whole fraction of one
                try:
                    launch = quack_path.prepare(*kernel, a, b, operands,
                                                config=cfg or _default())
                    outs = launch(a, b, operands)
                    torch.cuda.synchronize()
                except Exception as e:  # a config this program's kernel does not take
                    print(f"{shape} {family} M={rows} {name}: {type(e).__name__}: "
                          f"{str(e).splitlines()[0][:100]}", flush=True)
                    continue
                errors[name] = worst_error(outs, [w for w, o in zip(want, prog.outputs)],
                                           prog)
                times[name] = bench(lambda: launch(a, b, operands))
            picked = quack_path.prepare(*kernel, a, b, operands)
            times["picked"] = bench(lambda: picked(a, b, operands))
            errors["picked"] = worst_error(picked(a, b, operands),
                                           [w for w, o in zip(want, prog.outputs)], prog)
            ok = {k: t for k, t in times.items() if k in errors and errors[k] < 2e-2}
            best = min(ok, key=ok.get) if ok else None
            print(f"{shape} {family:<16} M={rows:5d} N={b.shape[0]:6d} K={a.shape[1]:5d} "
                  + " ".join(f"{k} {v * 1e3:7.1f}" for k, v in times.items())
                  + (f" | best {best} {times['unfused'] / times[best]:.2f}x" if best else "")
                  + f" | picked {_name(picked.config)} {times['unfused'] / times['picked']:.2f}x"
                  + (" | bad: " + ", ".join(f"{k} {e:.1e}" for k, e in errors.items()
                                            if e >= 2e-2) if any(
                      e >= 2e-2 for e in errors.values()) else ""), flush=True)
            rows_out.append((shape, f"{family} (K {a.shape[1]})", rows, times, best,
                             _name(picked.config)))
    return rows_out


def _default():
    from quack.gemm_config import default_config
    return default_config(torch.device("cuda"))


def _name(cfg) -> str:
    if cfg is None:
        return "default"
    return f"{cfg.tile_m}x{cfg.tile_n} c{cfg.cluster_m}" + (
        f"n{cfg.cluster_n}" if cfg.cluster_n > 1 else "") + (
        f" s{cfg.split_k}" if cfg.split_k > 1 else "") + (
        f" k{cfg.tile_k}" if cfg.tile_k else "") + ("" if cfg.pingpong else " coop")


def main():
    print(env_line())
    args = [a for a in sys.argv[1:] if a not in ("--static", "--picked")]
    rows = ROWS
    if "--rows" in args:
        i = args.index("--rows")
        rows = tuple(int(r) for r in args[i + 1].split(","))
        del args[i:i + 2]
    configs = {} if PICKED else candidates()
    table = []
    for shape in args or list(SHAPES):
        table += sweep(shape, rows, configs)
    print("\n| shape | family | M | cuBLAS µs | unfused µs (bound) | picked | picked µs | "
          "picked / cuBLAS | picked / unfused | best config | best µs |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    csv = []
    for shape, family, m, t, best, picked in table:
        p = t["picked"]
        print(f"| {shape} | {family} | {m} | {t['cuBLAS'] * 1e3:.1f} | "
              f"{t['unfused'] * 1e3:.1f} | {picked} | {p * 1e3:.1f} | {p / t['cuBLAS']:.2f} | "
              f"{p / t['unfused']:.2f} | {best} | "
              f"{t[best] * 1e3 if best else float('nan'):.1f} |")
        csv += [(f"{shape} {family} M={m} {k}", "ms", v) for k, v in t.items()]
    print("csv:", write_csv("small M per family", csv))


if __name__ == "__main__":
    main()
