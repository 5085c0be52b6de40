"""Kernel readiness on a cold and a warm start: run twice in fresh processes with the
same QUACK_CACHE_DIR; the second should load every kernel from QuACK's disk cache.

    source .gpu/setup.sh && python benchmarks/warm_start.py && python benchmarks/warm_start.py
"""

from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import coda_rewrite  # noqa: E402
from coda_rewrite.kernels import quack_path  # noqa: E402
from coda_rewrite.models import Llama, LlamaArgs  # noqa: E402


def main():
    torch.manual_seed(0)
    model = Llama(LlamaArgs(dim=1024, n_layers=2, n_heads=8, n_kv_heads=2, ffn_dim=2048,
                            vocab_size=4096)).cuda().to(torch.bfloat16).eval()
    ids = torch.randint(0, 4096, (2, 512), device="cuda")
    t0 = time.perf_counter()
    with torch.no_grad():
        coda_rewrite.optimize(model)(ids)
    torch.cuda.synchronize()
    total = time.perf_counter() - t0
    per = ", ".join(f"{k} {s:.2f} s" for k, s in quack_path.COMPILES)
    print(f"first call {total:.1f} s; kernels: {per}")


if __name__ == "__main__":
    main()
