"""LM head + cross-entropy at 8192 tokens, bf16: the 1B head (hidden 2048, vocab 128256)
and the 8B head (hidden 4096, vocab 128256 and 32768). The rewritten loss two ways:
"coda" writes the logits for the backward, as training does (the epilogue keeps the
online log-sum-exp of the rounded logits and the target logit; the backward is one pass
of QuACK's cross-entropy backward over the stored logits with the forward's lse), and
"coda logits-free" never writes them (materialize_logits=False: the backward recomputes
them in a GEMM whose epilogue forms the softmax gradient). Beside them the bare cuBLAS
GEMM(s), torch.compile and eager of the unfused head, and Liger Kernel's fused linear
cross-entropy when it is importable. Forward alone and forward + backward, the peak
memory of forward + backward, and the loss against eager's.

    source .gpu/setup.sh && python benchmarks/cross_entropy.py
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from common import bench, env_line

import coda_rewrite
from coda_rewrite.kernels import ops

M = 8192
SHAPES = ((2048, 128256), (4096, 128256), (4096, 32768))  # (hidden, vocab)
bf = torch.bfloat16


class Head(nn.Module):
    def __init__(self, hidden, vocab):
        super().__init__()
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

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
    for hidden, vocab in SHAPES:
        torch.manual_seed(0)
        head = Head(hidden, vocab).cuda().to(bf)
        h = torch.randn(M, hidden, device="cuda", dtype=bf, requires_grad=True)
        labels = torch.randint(0, vocab, (M,), device="cuda")
        labels[::16] = -100
        # fused in training too (the training policy leaves this family by default)
        variants = {"coda": coda_rewrite.optimize(head, fuse_in_training=True),
                    "coda logits-free": coda_rewrite.optimize(head,
                                                              materialize_logits=False),
                    "compile": torch.compile(head), "eager": head}
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
            rows.append((hidden, vocab, name, t, err))
            print(hidden, vocab, name, t, f"loss rel diff vs eager {err:.1e}", flush=True)
        hd = h.detach()
        g = torch.randn(M, vocab, device="cuda", dtype=bf)

        def bare_bwd():
            torch.mm(hd, w.t())
            torch.mm(g, w)
            torch.mm(g.t(), hd)

        t = {"fwd": bench(lambda: torch.mm(hd, w.t())), "fwd+bwd": bench(bare_bwd),
             "peak": float("nan")}
        rows.append((hidden, vocab, "cuBLAS GEMMs", t, 0.0))
        g = None  # free it before the next vocab
        torch.cuda.empty_cache()
    print("\nruntime:", *ops.runtime_summary()[:8], sep="\n  ")
    print(f"\n{env_line()}")
    print(f"{'hidden':>6s} {'vocab':>7s} {'variant':17s} {'fwd ms':>8s} {'fwd+bwd ms':>11s} "
          f"{'peak GiB':>9s}  loss rel diff")
    for hidden, vocab, name, t, err in rows:
        print(f"{hidden:6d} {vocab:7d} {name:17s} {t['fwd']:8.3f} {t['fwd+bwd']:11.3f} "
              f"{t['peak']:9.2f}  {err:.1e}")


if __name__ == "__main__":
    main()
