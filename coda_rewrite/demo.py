"""The demo: a small built-in Llama with random weights, rewritten, checked and explained.

Prints the match report and the numerics check on whatever device is present.
"""

from __future__ import annotations

import time

import torch

from . import explain, optimize
from .models import Llama, LlamaArgs
from .numerics import BF16_RATIO_LIMIT, low_precision_errors, rel_err


def run(device: str | None = None, layers: int = 2, seq: int = 64) -> int:
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    args = LlamaArgs(n_layers=layers)
    t0 = time.perf_counter()

    def make(seed: int) -> Llama:
        torch.manual_seed(seed)
        return Llama(args).to(device)

    model = make(0).eval()
    tokens = torch.randint(0, args.vocab_size, (2, seq), device=device)
    print(f"coda_rewrite demo: plain-PyTorch Llama, {layers} layers, hidden {args.dim}, "
          f"{args.n_heads}/{args.n_kv_heads} heads, tokens {tuple(tokens.shape)}, on {device}\n")

    report = explain(model, tokens)
    for g in report.graphs:
        print(g.render(with_code=False))
    n = report.count()
    print(f"\nrewritten norms: {n} (expected 2L + 1 = {2 * layers + 1})")

    ok = n == 2 * layers + 1
    with torch.no_grad():
        fast = optimize(model)
        err = rel_err(fast(tokens), model(tokens))
    print(f"\nnumerics, float32: logits vs eager, rel. error {err:.2e} (limit 1e-5)")
    ok &= err <= 1e-5

    res = low_precision_errors(make, (tokens,), optimize, dtype=torch.bfloat16,
                               seeds=(0, 1, 2), device=device)
    print("numerics, bfloat16 vs a float64 copy (median over 3 seeds): "
          f"eager {sorted(res['eager'])[1]:.2e}, rewritten {sorted(res['rewritten'])[1]:.2e}, "
          f"ratio {res['ratio']:.3f} (limit {BF16_RATIO_LIMIT})")
    ok &= res["ok"]
    print(f"\n{'OK' if ok else 'FAILED'} in {time.perf_counter() - t0:.1f} s")
    return 0 if ok else 1
