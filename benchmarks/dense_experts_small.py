"""The Llama-4-Scout MoE block (benchmarks/dense_experts.py) at decode and short-prompt
sizes: forward under no_grad, eager / torch.compile / backend="coda", each replayed from
a CUDA graph (the host out of the measurement), alternating rounds.

    source .gpu/setup.sh && python benchmarks/dense_experts_small.py [tokens ...]
"""

from __future__ import annotations

import sys

import torch

from common import bench_graphed, env_line
from dense_experts import HIDDEN, block


def main(token_counts):
    print(env_line(), flush=True)
    torch.manual_seed(0)
    moe = block(16)
    for tokens in token_counts:
        torch._dynamo.reset()
        x = torch.randn(1, tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
        variants = {"eager": moe, "torch.compile": torch.compile(moe),
                    "backend=coda": torch.compile(moe, backend="coda")}
        times = {k: [] for k in variants}
        with torch.no_grad():
            for f in variants.values():
                f(x)
            for _ in range(3):
                for k, f in variants.items():
                    times[k].append(bench_graphed(lambda f=f: f(x)))
        base = sorted(times["torch.compile"])[1]
        for k, ts in times.items():
            ms = sorted(ts)[1]
            print(f"scout {tokens} tokens: {k:14s} {ms:8.3f} ms  {base / ms:.2f}x "
                  "torch.compile", flush=True)


if __name__ == "__main__":
    main([int(t) for t in sys.argv[1:]] or [1, 8, 64, 512])
