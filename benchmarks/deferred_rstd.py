"""A norm boundary with and without its finaliser kernel (coda_rewrite/deferred_rstd.py):
the producer GEMM (z = x·W0ᵀ + residual, h2 = z ⊙ γ, the sum of squares) and one consumer
GEMM (y = r · h2·W1ᵀ), at the 1B and 8B layer shapes and M rows.

    source .gpu/setup.sh && python benchmarks/deferred_rstd.py [--rows 64,256,...]

Per (shape, M), the pair timed four ways:

    cuBLAS        F.linear, F.linear: the two GEMMs alone, the floor
    compiled      the eager region under torch.compile (F.linear + residual add +
                  RMSNorm ⊙ γ fused by Inductor + F.linear): what the pass leaves where
                  it does not fuse
    finaliser     the fused producer, QuACK's rms_final_reduce for r, the fused consumer
    deferred      the fused producer handing on its partials, the consumer forming r

GPU µs: the pair replayed from a CUDA graph, L2 flushed before each replay (device time
alone), variants in alternating rounds (common.bench_rounds on the graphs' replays),
median and spread. Host µs: the pair's launches with the GPU kept busy ahead
(host_overhead.interleaved), the fused calls in the op's 2-D form as a chain of
optimize()'s calls them. The deferred consumer's output is checked against the
finaliser's (a bf16 rounding apart at most).
"""

from __future__ import annotations

import statistics
import sys

import torch
import torch.nn.functional as F

from common import bench, env_line, write_csv
from host_overhead import interleaved

from coda_rewrite import deferred_rstd
from coda_rewrite.codegen.program import ACC, Kind, ProgramBuilder
from coda_rewrite.kernels import ops

bf = torch.bfloat16
# (producer K = N = dim, consumer N): o_proj → norm → q/k/v
SHAPES = {"1b": (2048, 3072), "8b": (4096, 6144)}
ROWS = (64, 256, 1024, 4096)
EPS = 1e-5


def programs(dim: int):
    """(finaliser producer, deferred producer, consumer reading r, consumer reading the
    partials), as patterns/residual_rmsnorm.py and deferred_rstd.py build them."""
    p = ProgramBuilder("residual_rmsnorm", gemm=True, family="residual_rmsnorm")
    z = p.add(ACC, p.operand("residual", Kind.TILE), name="z")
    h2 = p.mul(z, p.operand("gamma", Kind.PER_FEATURE), name="h2")
    r = p.rsqrt(p.add(p.div(p.row_sum(p.square(z), name="ss"), float(dim)), EPS), name="r")
    p.output(z, Kind.TILE, "bfloat16")
    p.output(h2, Kind.TILE, "bfloat16")
    p.output(r, Kind.PER_ROW, "float32")
    producer = p.build()
    c = ProgramBuilder("rowscale", gemm=True, family="rowscale")
    c.output(c.scaled_acc(True, False), Kind.TILE, "bfloat16")
    consumer = c.build()
    deferred, _, d, eps = deferred_rstd._row_scale(producer)
    reader = deferred_rstd._reading_partials(consumer, ["r"], d, eps)
    return producer.to_text(), deferred.to_text(), consumer.to_text(), reader.to_text()


def pair_fns(shape: str, m: int):
    dim, n1 = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, dim, device="cuda", dtype=bf, generator=g)
    res = torch.randn(m, dim, device="cuda", dtype=bf, generator=g)
    w0 = torch.randn(dim, dim, device="cuda", dtype=bf, generator=g) * dim ** -0.5
    w1 = torch.randn(n1, dim, device="cuda", dtype=bf, generator=g) * dim ** -0.5
    gamma = torch.rand(dim, device="cuda", dtype=bf, generator=g) + 0.5
    prod, defer, cons, reader = programs(dim)

    def finaliser():
        z, h2, r = ops.fused_linear(prod, x, w0, res, gamma)
        return ops.fused_linear(cons, h2, w1, r)[0]

    def deferred():
        z, h2, partials = ops.fused_linear(defer, x, w0, res, gamma)
        return ops.fused_linear(reader, h2, w1, partials)[0]

    def region(x, res):
        z = F.linear(x, w0) + res
        zf = z.float()
        h = (zf * torch.rsqrt(zf.square().mean(-1, keepdim=True) + EPS)).to(bf) * gamma
        return F.linear(h, w1)
    compiled_region = torch.compile(region)

    fns = {"cuBLAS": lambda: F.linear(F.linear(x, w0), w1),
           "compiled": lambda: compiled_region(x, res),
           "finaliser": finaliser, "deferred": deferred}
    with torch.no_grad():
        a, b = finaliser(), deferred()
        diff = (a.float() - b.float()).abs().max().item() / a.float().abs().max().item()
    return fns, diff


def graphed(fn):
    """The replay of a CUDA graph of one call of ``fn`` (warmed up first)."""
    with torch.no_grad():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
    return g.replay


def rounds(fns: dict, n: int = 5) -> dict:
    seen = {k: [] for k in fns}
    names = list(fns)
    for i in range(n):
        for k in (names if i % 2 == 0 else names[::-1]):
            seen[k].append(bench(fns[k], warmup=10, rep=100) * 1e3)
    return {k: (statistics.median(v), (max(v) - min(v)) / statistics.median(v))
            for k, v in seen.items()}


def main():
    rows = ROWS
    if "--rows" in sys.argv:
        rows = tuple(int(r) for r in sys.argv[sys.argv.index("--rows") + 1].split(","))
    print(env_line())
    table, csv = [], []
    for shape in SHAPES:
        for m in rows:
            fns, diff = pair_fns(shape, m)
            gpu = rounds({k: graphed(f) for k, f in fns.items()})
            with torch.no_grad():
                host = interleaved({k: fns[k] for k in ("cuBLAS", "finaliser", "deferred")})
            table.append((shape, m, gpu, host, diff))
            for k, (us, _) in gpu.items():
                csv.append((f"norm pair {shape} M={m} {k}", "gpu us", us))
            for k, us in host.items():
                csv.append((f"norm pair {shape} M={m} {k}", "host us", us))
    print("\n# GPU µs of the pair (CUDA graph replay, median of 5 alternating rounds, spread)")
    print(f"# {'shape':<5} {'M':>5} {'cuBLAS':>14} {'compiled':>14} {'finaliser':>14} "
          f"{'deferred':>14} {'def/fin':>8} {'def/comp':>9}")
    for shape, m, gpu, _, _ in table:
        cells = " ".join(f"{gpu[k][0]:7.1f} ({gpu[k][1]:4.1%})" for k in
                         ("cuBLAS", "compiled", "finaliser", "deferred"))
        print(f"# {shape:<5} {m:>5} {cells} {gpu['deferred'][0] / gpu['finaliser'][0]:8.3f} "
              f"{gpu['deferred'][0] / gpu['compiled'][0]:9.3f}")
    print("\n# host µs of the pair's launches (GPU busy ahead; median of 7 interleaved rounds)")
    print(f"# {'shape':<5} {'M':>5} {'cuBLAS':>8} {'finaliser':>10} {'deferred':>9} "
          f"{'saved':>6}  max |deferred − finaliser| / max |finaliser|")
    for shape, m, _, host, diff in table:
        print(f"# {shape:<5} {m:>5} {host['cuBLAS']:8.1f} {host['finaliser']:10.1f} "
              f"{host['deferred']:9.1f} {host['finaliser'] - host['deferred']:6.1f}  {diff:.1e}")
    print("# csv:", write_csv("deferred_rstd", csv))


if __name__ == "__main__":
    main()
