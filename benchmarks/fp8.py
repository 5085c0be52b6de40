"""FP8 (options.fp8) on the H200: the Llama-3-8B-shaped decoder layer forward (the
TorchTitan-style Block of coda_rewrite.models, batch 2 x 4096, bf16, no_grad), side by
side in alternating rounds: torch.compile, backend="coda" bf16 and fp8 (both with kept
re-layouts: serving; fp8 also with its families added one at a time: the MLP, then q/k/v,
then the row-wise rest), torchao's float8 row-wise inference recipe (dynamic per-row
activation scales, per-row weights) on the MLP's three projections and on every
projection, each under torch.compile. Numerics: each variant's relative difference from
the block in float64 (1 x 512 tokens) beside eager bf16's. Kernel lists show where the
MLP's time goes (no amax pass in coda fp8).

    source .gpu/setup.sh && PYTHONPATH=/tmp/torchao python benchmarks/fp8.py

($CODA_FP8_VARIANTS: a comma-separated subset of the variants.)
"""

from __future__ import annotations

import copy
import os
import sys

import torch

from common import bench_rounds, env_line, kernel_split, kernel_top, write_csv
from layer_and_step import layer_8b

import coda_rewrite
from coda_rewrite.kernels import ops

MLP = ("feed_forward.w1", "feed_forward.w2", "feed_forward.w3")


def torchao_rowwise(block, only_mlp: bool):
    from torchao.quantization import (Float8DynamicActivationFloat8WeightConfig, PerRow,
                                      quantize_)
    q = copy.deepcopy(block)

    def pick(module, fqn):
        return isinstance(module, torch.nn.Linear) and (not only_mlp or fqn in MLP)
    quantize_(q, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()),
              filter_fn=pick)
    return torch.compile(q)


def coda(block, **options):
    backend = coda_rewrite.CodaBackend(coda_rewrite.Options(cache_relayouts=True, **options))
    return torch.compile(copy.deepcopy(block), backend=backend)


def main():
    print(env_line(), flush=True)
    block, x, freqs = layer_8b()
    every = coda_rewrite.Options().patterns
    variants = {"eager": block, "torch.compile": torch.compile(block),
                "coda bf16": coda(block), "coda fp8": coda(block, fp8=True),
                # the ablation: each FP8 family added to the ones before it
                "coda fp8 (MLP)": coda(block, fp8=True, patterns=tuple(
                    p for p in every if p not in ("fp8_linear", "fp8_rowwise"))),
                "coda fp8 (MLP, q/k/v)": coda(block, fp8=True, patterns=tuple(
                    p for p in every if p != "fp8_rowwise"))}
    for only_mlp, name in ((True, "torchao rowwise (MLP)"), (False, "torchao rowwise (all)")):
        try:
            variants[name] = torchao_rowwise(block, only_mlp)
        except Exception as e:  # not installed, or not for this torch
            print(f"{name}: unavailable ({type(e).__name__}: {e})", flush=True)

    keep = os.environ.get("CODA_FP8_VARIANTS")  # a comma-separated subset
    if keep:
        variants = {k: v for k, v in variants.items() if k in keep.split(",")}
    # numerics: 1 x 512 tokens against the block in float64
    xs, fs = x[:1, :512].contiguous(), freqs[:512]
    with torch.no_grad():
        ref = copy.deepcopy(block).double()(xs.double(), fs)
        errs = {}
        for name, m in list(variants.items()):
            try:
                got = m(xs, fs)
                errs[name] = float((got.double() - ref).norm() / ref.norm())
            except Exception as e:
                print(f"{name}: failed ({type(e).__name__}: {str(e)[:300]})", flush=True)
                del variants[name]
        for line in ops.runtime_summary():
            if "fp8" in line:
                print("  " + line)
        fns = {n: (lambda m=m: m(x, freqs)) for n, m in variants.items()}
        for f in fns.values():
            f()
        timed = bench_rounds(fns, rounds=3)
        rows = []
        for name in variants:
            ms, spread = timed[name]
            print(f"layer {name}: {ms:.3f} ms ({spread:.1%}) | rel. diff vs float64 "
                  f"{errs[name]:.2e} | {kernel_split(fns[name])}", flush=True)
            rows += [(name, "ms", ms), (name, "rel_err_f64", errs[name])]
        for name in ("coda fp8", "torchao rowwise (all)", "coda bf16"):
            if name in fns:
                print(f"kernels of {name}:\n{kernel_top(fns[name], 12)}", flush=True)
        print("summary (ms, x of coda bf16): " + ", ".join(
            f"{n} {timed[n][0]:.3f} ({timed['coda bf16'][0] / timed[n][0]:.2f}x)"
            for n in variants), flush=True)
    print(write_csv("fp8_layer", rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
