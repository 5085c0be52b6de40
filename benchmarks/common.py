"""Shared by the benchmark scripts (run on the H200 through the device tool, never in
CI): the environment line every figure is recorded with, timing, the kernel-time split."""

from __future__ import annotations

import collections
import datetime
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def env_line() -> str:
    import importlib.metadata as md

    def v(name):
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return "-"
    try:
        import quack
        qv = quack.__version__
    except Exception:
        qv = "-"
    return (f"{datetime.date.today()} | {torch.cuda.get_device_name(0)} | torch {torch.__version__}"
            f" | transformers {v('transformers')} | quack {qv}"
            f" | cutlass-dsl {v('nvidia-cutlass-dsl')}")


def write_csv(figure: str, rows: list[tuple[str, str, float]]) -> str:
    """Append (figure, variant, metric, value) rows, dated and with the GPU and versions,
    to benchmarks/results/<date>.csv (or $CODA_BENCH_CSV): what plot.py draws."""
    import csv

    path = os.environ.get("CODA_BENCH_CSV") or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "results", f"{datetime.date.today()}.csv")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    new = not os.path.exists(path)
    with open(path, "a", newline="") as f:
        w = csv.writer(f)
        if new:
            w.writerow(["date", "environment", "figure", "variant", "metric", "value"])
        for variant, metric, value in rows:
            w.writerow([datetime.date.today(), env_line(), figure, variant, metric,
                        f"{value:.4f}"])
    return path


def bench(fn, warmup=25, rep=200) -> float:
    """Median ms over repeats (triton's do_bench: CUDA events, L2 flushed)."""
    from triton.testing import do_bench
    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def bench_graphed(fn, warmup=10, rep=100) -> float:
    """GPU ms of one call of ``fn``, replayed from a CUDA graph (L2 flushed before each
    replay): the device time alone, where a plain loop would also count the host's
    launch time whenever it exceeds the flush's (calls of a few µs at small M)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return bench(g.replay, warmup=warmup, rep=rep)


def bench_rounds(fns: dict, rounds: int = 3) -> dict:
    """{name: (median ms, spread)} of variants timed in alternating rounds (the order
    reversed every other round), so that a drift of the card's clocks during the run
    lands on every variant alike; spread is (max − min) / median over the rounds: a
    difference between variants smaller than it is noise."""
    import statistics
    out = {}
    for k, ts in bench_by_round(fns, rounds).items():
        med = statistics.median(ts)
        out[k] = (med, (max(ts) - min(ts)) / med)
    return out


def bench_by_round(fns: dict, rounds: int = 3) -> dict:
    """{name: [ms of each round]} of variants timed in alternating rounds (bench_rounds):
    round i of every variant ran side by side, so a ratio of two variants taken round by
    round (paired) cancels what moved the host or the card between rounds."""
    seen = {k: [] for k in fns}
    names = list(fns)
    for i in range(rounds):
        for k in (names if i % 2 == 0 else names[::-1]):
            seen[k].append(bench(fns[k], warmup=10, rep=100))
    return seen


def paired(times: dict, name: str, base: str) -> tuple[float, float, float]:
    """``name``'s speed over ``base``'s, round by round (bench_by_round): the median and
    the range of the per-round ratios."""
    import statistics
    ratios = [b / t for t, b in zip(times[name], times[base])]
    return statistics.median(ratios), min(ratios), max(ratios)


def classify(name: str) -> str:
    n = name.lower()
    if "nccl" in n:  # NCCL's collectives (the two-GPU step: all-gathers, reduce-scatters)
        return "collective"
    if any(k in n for k in ("flash", "fmha", "attention", "sdpa", "cudnn")):
        return "attention"
    if any(k in n for k in ("gemm", "nvjet", "xmma", "cutlass", "wgmma", "matmul", "sm90_",
                            "cublas")):
        return "gemm"
    return "other"


def kernel_split(fn) -> str:
    """GPU kernel time of one call of ``fn``, split into GEMM / attention / other (and
    the collectives, where there are any: a collective's kernel time includes its wait
    for the other rank, so it is an upper bound on the communication)."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        fn()
        torch.cuda.synchronize()
    tot = collections.Counter()
    for e in p.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            tot[classify(e.name)] += e.device_time_total
    s = sum(tot.values())
    kinds = ("gemm", "attention", "other") + (("collective",) if tot["collective"] else ())
    return " | ".join(f"{k} {tot[k] / 1e3:.1f} ms" for k in kinds) \
        + f" | total {s / 1e3:.1f} ms"


def kernel_top(fn, n: int = 15) -> str:
    """The ``n`` GPU kernels that take the most time in one call of ``fn`` (name, calls,
    ms): where two variants' splits differ, this says which kernels."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        fn()
        torch.cuda.synchronize()
    time_by, calls = collections.Counter(), collections.Counter()
    for e in p.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            time_by[e.name] += e.device_time_total
            calls[e.name] += 1
    top = time_by.most_common(n)
    rest = time_by.most_common()[n:]
    # what the list leaves out, from the same profiled call (the split above is another
    # call: two profiled steps differ by the GPU's own run-to-run spread)
    tail = (f"    {sum(t for _, t in rest) / 1e3:8.2f} ms  {sum(calls[k] for k, _ in rest):5d}x"
            f"  the {len(rest)} other kernels (all: {sum(time_by.values()) / 1e3:.2f} ms)")
    return "\n".join([f"    {t / 1e3:8.2f} ms  {calls[k]:5d}x  {k[:110]}" for k, t in top]
                     + [tail])


def rewrites_since(backends=()) -> str:
    """The reports' records since the last call (the "coda" backend's session report and
    those of ``backends``, CodaBackend objects), by pattern and outcome (rewritten, or the
    code it was left with): which families a variant fused, and why the others not."""
    from coda_rewrite.backend import SESSION_REPORT
    from coda_rewrite.report import REWRITTEN
    seen = collections.Counter()
    for report in [SESSION_REPORT] + [b.report for b in backends]:
        seen.update((r.pattern, "rewritten" if r.status == REWRITTEN else r.code or r.status)
                    for r in report.records)
        report.graphs.clear()
    return ", ".join(f"{p} {s} x{n}" for (p, s), n in sorted(seen.items())) or "no graph"
