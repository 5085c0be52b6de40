"""Serving: optimize() a Hugging Face Llama and generate() with it.

    python examples/serve_generate.py

Every forward generate() makes (the prefill and each decode step, over a static KV
cache) runs the rewritten graphs; the tokens are eager's. Tiny on CPU; a Llama-3.2-1B
shape in bf16 on a GPU. For CUDA-graph decode, let generate() compile the decode step
with the backend: ``compile_config=transformers.CompileConfig(backend="coda")`` (README,
"Inference"; benchmarks/inference.py measures it).
"""

from __future__ import annotations

import time

import torch
import transformers as tf

import coda_rewrite

GPU = torch.cuda.is_available()


def main(new_tokens: int = 8 if not GPU else 64) -> None:
    device = "cuda" if GPU else "cpu"
    cfg = tf.LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         attn_implementation="sdpa") if GPU else \
        tf.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       attn_implementation="sdpa")
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg).to(device=device,
                                        dtype=torch.bfloat16 if GPU else torch.float32).eval()
    prompt = torch.randint(0, cfg.vocab_size, (1, 32), device=device)
    kw = dict(max_new_tokens=new_tokens, do_sample=False, cache_implementation="static",
              attention_mask=torch.ones_like(prompt), pad_token_id=0)

    fast = coda_rewrite.optimize(model)
    with torch.no_grad():
        fast.generate(prompt, **kw)  # compiles the prefill and decode graphs
        t0 = time.perf_counter()
        ours = fast.generate(prompt, **kw)
        dt = time.perf_counter() - t0
        want = model.generate(prompt, **kw)
    same = torch.equal(ours, want)
    agree = (ours[0, prompt.shape[1]:] == want[0, prompt.shape[1]:]).float().mean().item()
    print(f"generated {new_tokens} tokens in {dt * 1e3:.0f} ms ({new_tokens / dt:.1f} "
          f"tokens/s) on {device}; same tokens as eager: {same} ({agree:.0%} agree)")
    print(f"{len(fast.report.graphs)} graph(s), {fast.report.count(pattern=None)} rewrites; "
          f"calls that ran unrewritten: {fast.report.uncaptured_calls}")
    # float32 (CPU): the same tokens. bf16 with random weights: near-tied logits may pick
    # another token once the roundings differ (the numerics policy bounds the error
    # against float64, not eager's own roundings), and the sequences part from there.
    if not GPU and not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
