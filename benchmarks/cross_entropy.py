"""LM head + cross-entropy at 8192 tokens x hidden 4096, vocab 128256 and 32768, bf16:
the rewritten loss (logits GEMM whose epilogue keeps the online log-sum-exp and the
target logit; logits never written; chunked backward) against the bare cuBLAS GEMM(s),
torch.compile and eager of the unfused head, and Liger Kernel's fused linear
cross-entropy when it is importable. Forward alone and forward + backward, with the
peak memory of forward + backward.

    source .gpu/setup.sh && python benchmarks/cross_entropy.py
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from common import bench, env_line

import coda_rewrite
from coda_rewrite.kernels import ops

M, H = 8192, 4096
bf = torch.bfloat16


class Head(nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.lm_head = nn.Linear(H, vocab, bias=False)

    def forward(self, h, labels):
        logits = self.lm_head(h).float()
        return F.cross_entropy(logits, labels)


def peak_gib(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 30


def liger(head):
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except Exception as e:  # not carried to the GPU machine
        print(f"liger unavailable: {type(e).__name__}: {e}")
        return None
    loss = LigerFusedLinearCrossEntropyLoss()
    return lambda h, y: loss(head.lm_head.weight, h, y)


def main():
    print(env_line(), flush=True)
    rows = []
    for vocab in (128256, 32768):
        torch.manual_seed(0)
        head = Head(vocab).cuda().to(bf)
        h = torch.randn(M, H, device="cuda", dtype=bf, requires_grad=True)
        labels = torch.randint(0, vocab, (M,), device="cuda")
        labels[::16] = -100
        variants = {"coda": coda_rewrite.optimize(head), "compile": torch.compile(head),
                    "eager": head}
        lg = liger(head)
        if lg is not None:
            variants["liger"] = lg
        w = head.lm_head.weight
        want = head(h, labels).float()
        for name, fn in variants.items():
            got = fn(h, labels).float()
            err = abs(float(got - want)) / abs(float(want))

            def fwd(fn=fn):
                with torch.no_grad():
                    fn(h, labels)

            def fwd_bwd(fn=fn):
                fn(h, labels).backward()
                h.grad = None
                w.grad = None

            t = {"fwd": bench(fwd), "fwd+bwd": bench(fwd_bwd), "peak": peak_gib(fwd_bwd)}
            rows.append((vocab, name, t, err))
            print(vocab, name, t, f"loss rel diff vs eager {err:.1e}", flush=True)
        hd = h.detach()
        g = torch.randn(M, vocab, device="cuda", dtype=bf)

        def bare_bwd():
            torch.mm(hd, w.t())
            torch.mm(g, w)
            torch.mm(g.t(), hd)

        t = {"fwd": bench(lambda: torch.mm(hd, w.t())), "fwd+bwd": bench(bare_bwd),
             "peak": float("nan")}
        rows.append((vocab, "cuBLAS GEMMs", t, 0.0))
        g = None  # free it before the next vocab
        torch.cuda.empty_cache()
    print("\nruntime:", *ops.runtime_summary()[:8], sep="\n  ")
    print(f"\n{env_line()}")
    print(f"{'vocab':>7s} {'variant':14s} {'fwd ms':>8s} {'fwd+bwd ms':>11s} {'peak GiB':>9s}"
          "  loss rel diff")
    for vocab, name, t, err in rows:
        print(f"{vocab:7d} {name:14s} {t['fwd']:8.3f} {t['fwd+bwd']:11.3f} {t['peak']:9.2f}"
              f"  {err:.1e}")


if __name__ == "__main__":
    main()
