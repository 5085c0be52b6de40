"""What each variant keeps for the backward, per decoder layer: the Llama-3.2-1B layer
shape (hidden 2048, 32 / 8 heads of 64, intermediate 8192, vocab 128256) at a reduced
token count, bf16, on any device (it counts bytes, it times nothing; the count is
linear in the tokens, so it is scaled to the 1B step's 2 × 4096).

Every tensor autograd saves goes through ``torch.autograd.graph.saved_tensors_hooks``
(eager's ops, AOTAutograd's compiled functions and the fused op's autograd alike); the
bytes are counted once per storage (views share it), split into the decoder layers and
the LM head + loss (a model of 2 layers against one of 1 layer: the difference is one
layer), and into what grows with the tokens and what does not (two token counts: a
re-laid-out weight copy kept for the backward is the part that does not). Variants:
eager, torch.compile, backend="coda", optimize(), each with the default options and, for
coda, materialize_logits=False.

    python benchmarks/saved_memory.py [tokens per sequence, default 256] [variants]
    python benchmarks/saved_memory.py --breakdown [tokens] [variants]

``--breakdown``: what the saved bytes are, for a one-layer model (its layer and the LM
head + loss), grouped by each saved tensor's trailing dim and dtype (2048: hidden states,
norm inputs and outputs; 512 / 2048 + 2 × 512: k, v / q, k, v; 8192 / 16384: the MLP's
activations / gate and up; 128256: logits; 1: per-row statistics), scaled to 2 × 4096
tokens.
"""

from __future__ import annotations

import sys

import torch

import coda_rewrite


def model(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=layers,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                      max_position_embeddings=8192, rope_theta=500000.0,
                      tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(torch.bfloat16)


def saved_bytes(fn, module, kinds: dict | None = None) -> int:
    """Bytes of the distinct storages autograd saves while ``fn()`` runs forward, the
    module's parameters (and views of them) left out: they live anyway. ``kinds``, if
    given, gets each storage's (trailing dim, dtype) -> bytes."""
    storages: dict[int, int] = {}
    kind_of: dict[int, tuple] = {}
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}

    def pack(t):
        try:
            s = t.untyped_storage()
            if s.data_ptr() in params:
                return t
            storages[s.data_ptr()] = max(storages.get(s.data_ptr(), 0), s.nbytes())
            kind_of.setdefault(s.data_ptr(), (t.shape[-1] if t.dim() else 0,
                                              str(t.dtype).replace("torch.", "")))
        except (RuntimeError, NotImplementedError):  # a tensor without storage
            pass
        return t

    from torch.nn.attention import SDPBackend, sdpa_kernel
    # flash attention everywhere (the CPU has one too): it keeps the output and the
    # row log-sum-exp, linear in the tokens as on the GPU, not the probabilities
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        out = fn()
    del out
    if kinds is not None:
        for ptr, n in storages.items():
            kinds[kind_of[ptr]] = kinds.get(kind_of[ptr], 0) + n
    return sum(storages.values())


VARIANTS = {
    "eager": lambda m: m,
    "torch.compile": lambda m: torch.compile(m),
    'backend="coda"': lambda m: torch.compile(m, backend="coda"),
    "optimize()": lambda m: coda_rewrite.optimize(m),
    'backend="coda", materialize_logits=False': lambda m: torch.compile(
        m, backend=coda_rewrite.CodaBackend(coda_rewrite.Options(materialize_logits=False))),
    # the GPU's training default spelled out (on the CPU every family fuses in training:
    # the training policy is a GPU speed decision): the attention rewrite and the gated
    # MLP, its down projection's backward in the dgrad GEMM's epilogue or as graph ops
    "coda GPU training default": lambda m: torch.compile(m, backend=coda_rewrite.CodaBackend(
        coda_rewrite.Options(patterns=("attention_inputs", "gated_mlp"),
                             fuse_in_training=True))),
    "coda GPU training default, graph-op backward": lambda m: torch.compile(
        m, backend=coda_rewrite.CodaBackend(coda_rewrite.Options(
            patterns=("attention_inputs", "gated_mlp"), fuse_in_training=True,
            backward_epilogues=False))),
}


def main(seq: int, only: list[str]) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    tokens = (seq, 2 * seq)
    print(f"torch {torch.__version__}; what autograd keeps for the backward (MiB), counted "
          f"at 1 × {tokens[0]} and 1 × {tokens[1]} tokens: the part that grows with the "
          "tokens scaled to 2 × 4096, the part that does not (weight copies) apart\n")
    print("| variant | per layer, activations | per layer, fixed | LM head + loss + "
          "embedding, activations | fixed |")
    print("|---|---|---|---|---|")
    for name, make in VARIANTS.items():
        if only and name not in only:
            continue
        got = {}
        for n in tokens:
            ids = torch.randint(0, 128256, (1, n))
            for layers in (1, 2):
                torch._dynamo.reset()
                m = make(model(layers).train())
                with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                    m(input_ids=ids, labels=ids)  # compile outside the count
                got[n, layers] = saved_bytes(lambda: m(input_ids=ids, labels=ids).loss, m)
        cells = []
        for part in ("layer", "rest"):
            at = {n: got[n, 2] - got[n, 1] if part == "layer" else 2 * got[n, 1] - got[n, 2]
                  for n in tokens}
            per_token = (at[tokens[1]] - at[tokens[0]]) / (tokens[1] - tokens[0])
            fixed = at[tokens[0]] - per_token * tokens[0]
            cells += [per_token * 2 * 4096 / 2**20, fixed / 2**20]
        print(f"| {name} | " + " | ".join(f"{c:.0f}" for c in cells) + " |", flush=True)


def breakdown(seq: int, only: list[str]) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    scale = 2 * 4096 / seq / 2**20
    rows = {}
    for name, make in VARIANTS.items():
        if only and name not in only:
            continue
        torch._dynamo.reset()
        m = make(model(1).train())
        ids = torch.randint(0, 128256, (1, seq))
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            m(input_ids=ids, labels=ids)  # compile outside the count
        kinds: dict = {}
        saved_bytes(lambda: m(input_ids=ids, labels=ids).loss, m, kinds)
        rows[name] = kinds
    keys = sorted({k for kinds in rows.values() for k in kinds})
    print(f"torch {torch.__version__}; saved for the backward by a 1-layer model at 1 × "
          f"{seq} tokens, scaled to 2 × 4096 (MiB), by the saved tensor's trailing dim\n")
    print("| trailing dim, dtype | " + " | ".join(rows) + " |")
    print("|---|" + "---|" * len(rows))
    for k in keys:
        print(f"| {k[0]}, {k[1]} | " + " | ".join(
            f"{rows[n].get(k, 0) * scale:.0f}" for n in rows) + " |")
    print("| total | " + " | ".join(f"{sum(r.values()) * scale:.0f}" for r in rows.values())
          + " |")


if __name__ == "__main__":
    args = sys.argv[1:]
    run = breakdown if args[:1] == ["--breakdown"] else main
    args = args[1:] if run is breakdown else args
    # variants by name, separated by ";" (or "," where no name has one)
    names = args[1].split(";" if ";" in args[1] else ",") if len(args) > 1 else []
    run(int(args[0]) if args else 256, names)
