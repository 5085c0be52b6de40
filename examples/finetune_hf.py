"""Fine-tune a Hugging Face Llama with torch.compile(backend="coda").

    python examples/finetune_hf.py

Without a GPU: a tiny config (random weights), a few steps on CPU, under a minute.
With one: a Llama-3.2-1B-shaped model (16 layers, hidden 2048) in bf16, 2 × 2048 tokens.
Prints the loss per step, tokens/s, and what the pass rewrote. (Weights come from the
config: put `from_pretrained(...)` there for a real checkpoint.)
"""

from __future__ import annotations

import time

import torch
import transformers as tf

import coda_rewrite

GPU = torch.cuda.is_available()


def main(steps: int = 4 if not GPU else 20) -> None:
    device = "cuda" if GPU else "cpu"
    if GPU:
        cfg = tf.LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                             num_hidden_layers=16, num_attention_heads=32,
                             num_key_value_heads=8, tie_word_embeddings=True,
                             attn_implementation="sdpa")
        batch, seq, dtype = 2, 2048, torch.bfloat16
    else:
        cfg = tf.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, attn_implementation="sdpa")
        batch, seq, dtype = 2, 64, torch.float32
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg).to(device=device, dtype=dtype).train()
    compiled = torch.compile(model, backend="coda")  # the rewrites, then Inductor
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = torch.randint(0, cfg.vocab_size, (steps, batch, seq), device=device)

    t0 = None
    for step in range(steps):
        if step == 1:  # the first step compiles
            if GPU:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        loss = compiled(data[step], labels=data[step]).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        print(f"step {step}: loss {loss.item():.4f}")
    if GPU:
        torch.cuda.synchronize()
    rate = (steps - 1) * batch * seq / (time.perf_counter() - t0)
    print(f"\n{rate:,.0f} tokens/s over steps 1..{steps - 1} on {device}")

    report = coda_rewrite.last_report()  # compiles through the "coda" name land here
    print(f"\nwhat was rewritten: {report.count(pattern=None)} rewrites in "
          f"{len(report.graphs)} graph(s)")
    for g in report.graphs:
        print(" ", g.summary())


if __name__ == "__main__":
    main()
