"""TorchTitan-style: each decoder block compiled on its own with backend="coda".

    python examples/per_block_compile.py

The plain-PyTorch Llama in coda_rewrite.models (complex RoPE over a table, GQA through
SDPA, SwiGLU, nn.RMSNorm). Each block is one graph: the norms inside it fuse into their
consumer GEMMs (the first norm of a block has no producing GEMM in the block: the
row-wise program), the gate/up pair becomes one GEMM, and q/k/v one rotating GEMM that
reads the block's table. One training step, then the report. Tiny on CPU; Llama-3-8B-
shaped layers (4 of them) in bf16 on a GPU.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

import coda_rewrite
from coda_rewrite.models import Llama, LlamaArgs

GPU = torch.cuda.is_available()


def main() -> None:
    device = "cuda" if GPU else "cpu"
    args = LlamaArgs(dim=4096, n_layers=4, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                     vocab_size=32768, max_seq_len=2048) if GPU else \
        LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
                  vocab_size=256, max_seq_len=128)
    seq = 2048 if GPU else 32
    torch.manual_seed(0)
    model = Llama(args).to(device=device, dtype=torch.bfloat16 if GPU else torch.float32)
    for i, block in enumerate(model.layers):  # as TorchTitan's apply_compile does
        model.layers[i] = torch.compile(block, backend="coda")

    ids = torch.randint(0, args.vocab_size, (2, seq), device=device)
    t0 = time.perf_counter()
    logits = model(ids)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
    loss.backward()
    print(f"one training step: loss {loss.item():.4f} in {time.perf_counter() - t0:.1f} s "
          "(compiles included)")

    report = coda_rewrite.last_report()
    print(f"{len(report.graphs)} graph(s) (blocks of one class share one), "
          f"{report.count(pattern=None)} rewrites:")
    for g in report.graphs:
        print(" ", g.summary())


if __name__ == "__main__":
    main()
