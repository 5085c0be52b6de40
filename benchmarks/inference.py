"""Inference figures (#15's bars): the TorchTitan-style 4-layer Llama forward and
Hugging Face decode, each variant timed in alternating rounds.

    source .gpu/setup.sh && python benchmarks/inference.py [forward] [small_m] [decode] [qwen3]
        [gpt_neox]

forward: the plain Llama (dim 2048, 16 / 8 heads, ffn 5632, vocab 32768, complex RoPE,
bf16), no_grad, at 2 x 2048 and 2 x 64 tokens: eager, torch.compile, backend="coda",
optimize(), each also from CUDA graphs (torch.compile's mode="reduce-overhead" for
both compiles; optimize(cudagraphs=True)). Medians over rounds with their spread, and
each variant's speed over torch.compile's (graphed: over its graphs') paired by round.

small_m: where fused GEMMs stop paying (options.min_fused_rows), from CUDA graphs.

decode: a Hugging Face Llama at Llama-3.2-1B widths (4 layers), greedy generate() of
$CODA_DECODE_TOKENS (default 64) tokens after a 32-token prompt over a static KV cache,
batch 1 and 8: eager, generate()'s own compile of the decode step (Hugging Face's recipe:
mode="reduce-overhead") with Inductor and with backend="coda"; tokens/s (median of
$CODA_DECODE_ROUNDS alternating rounds, default 5, with backend="coda" with every GEMM
fused among them, each variant on its own copy of the model), each variant's speed over
torch.compile's paired by round (median and range; torch.compile's own second copy gives
the noise floor of that ratio), how many tokens agree with eager, and what each coda
variant's graphs fused.

qwen3: a Hugging Face Qwen3 at Qwen3-8B widths (QK-norm), 2 layers, the forward at 2 x
2048 and 1 x 256 tokens: eager, torch.compile, backend="coda".

gpt_neox: a Hugging Face GPT-NeoX at Pythia-6.9B widths (LayerNorm, GELU MLP, partial
RoPE, packed q/k/v), 2 layers, the forward at 2 x 2048 and 1 x 1024 tokens: eager,
torch.compile, backend="coda" as it ships (the LayerNorm left: no kept fold) and with
cache_relayouts=True (the LayerNorm + GELU in the up projection's epilogue).
"""

from __future__ import annotations

import copy
import os
import statistics
import sys
import time

import torch

from common import (bench_by_round, bench_rounds, env_line, paired, rewrites_since,
                    write_csv)

import coda_rewrite
from coda_rewrite import CodaBackend, Options
from coda_rewrite.models import Llama, LlamaArgs

bf = torch.bfloat16


def forward() -> list:
    torch.manual_seed(0)
    a = LlamaArgs(dim=2048, n_layers=4, n_heads=16, n_kv_heads=8, ffn_dim=5632,
                  vocab_size=32768, max_seq_len=2048)
    model = Llama(a).cuda().to(bf).eval()
    rows = []
    for batch, seq in ((2, 2048), (2, 64)):
        x = torch.randint(0, a.vocab_size, (batch, seq), device="cuda")
        torch._dynamo.reset()
        variants = {
            "eager": model,
            "torch.compile": torch.compile(model, dynamic=False),
            'backend="coda"': torch.compile(model, backend="coda", dynamic=False),
            "optimize()": coda_rewrite.optimize(model),
            "torch.compile, cudagraphs": torch.compile(model, mode="reduce-overhead",
                                                       dynamic=False),
            'backend="coda", cudagraphs': torch.compile(model, backend="coda", dynamic=False,
                                                        mode="reduce-overhead"),
            "optimize(cudagraphs=True)": coda_rewrite.optimize(model, cudagraphs=True),
        }
        with torch.no_grad():
            want = model(x).float()
            fns = {}
            for name, m in variants.items():
                for _ in range(3):  # compile, record, replay
                    got = m(x)
                err = float((got.float() - want).norm() / want.norm())
                print(f"{batch} x {seq} {name}: rel. error vs eager {err:.2e}", flush=True)
                fns[name] = (lambda m=m: m(x))
            # the host-bound short prompt moves with the host's load: more rounds, and
            # each variant's ratio taken round by round
            by_round = bench_by_round(fns, rounds=3 if seq >= 1024 else 7)
        for name, ts in by_round.items():
            ms = statistics.median(ts)
            base = "torch.compile, cudagraphs" if "cudagraphs" in name else "torch.compile"
            ratio, low, high = paired(by_round, name, base)
            print(f"{batch} x {seq} {name:<30} {ms:7.3f} ms  (spread "
                  f"{(max(ts) - min(ts)) / ms:.1%})  {ratio:5.3f}x {base} by round "
                  f"({low:.3f}-{high:.3f})")
            rows.append((f"{batch}x{seq} {name}", "ms", ms))
    return rows


def small_m() -> list:
    """Where the fused GEMMs stop paying: the 4-layer forward from CUDA graphs (kernel
    time only) at 2 x {64 .. 512} tokens ($CODA_SMALL_M_SEQS), every GEMM fused
    (min_fused_rows=0) against torch.compile; the default threshold's beside them."""
    torch.manual_seed(0)
    a = LlamaArgs(dim=2048, n_layers=4, n_heads=16, n_kv_heads=8, ffn_dim=5632,
                  vocab_size=32768, max_seq_len=2048)
    model = Llama(a).cuda().to(bf).eval()
    rows = []
    seqs = [int(s) for s in os.environ.get("CODA_SMALL_M_SEQS", "64,128,256,512").split(",")]
    for seq in seqs:
        x = torch.randint(0, a.vocab_size, (2, seq), device="cuda")
        torch._dynamo.reset()
        variants = {
            "torch.compile": torch.compile(model, mode="reduce-overhead", dynamic=False),
            "coda, all fused": torch.compile(model, dynamic=False, backend=CodaBackend(
                Options(min_fused_rows=0, cudagraphs=True))),
            "coda, default": torch.compile(model, backend="coda", mode="reduce-overhead",
                                           dynamic=False)}
        if os.environ.get("CODA_SMALL_M_ABLATION"):  # what each family costs or saves
            every = Options().patterns
            unknown = {"gated_mlp", "rope", "residual_rmsnorm_gemm"} - set(every)
            if unknown:  # a misspelt family would silently stay in every variant
                raise ValueError(f"no such pattern(s) to leave out: {sorted(unknown)}")
            for left in (("gated_mlp",), ("gated_mlp", "rope"),
                         ("gated_mlp", "rope", "residual_rmsnorm_gemm")):
                variants["coda, all fused but " + " + ".join(left)] = torch.compile(
                    model, dynamic=False, backend=CodaBackend(Options(
                        min_fused_rows=0, cudagraphs=True,
                        patterns=tuple(p for p in every if p not in left))))
        with torch.no_grad():
            for m in variants.values():
                for _ in range(3):
                    m(x)
            timed = bench_rounds({k: (lambda m=m: m(x)) for k, m in variants.items()})
        base = timed["torch.compile"][0]
        for name, (ms, spread) in timed.items():
            print(f"small M: {2 * seq:5d} rows {name:<40} {ms:7.3f} ms (spread {spread:.1%})"
                  f"  {base / ms:5.2f}x torch.compile (graphed)", flush=True)
            rows.append((f"{2 * seq} rows {name}", "ms", ms))
    return rows


def decode() -> list:
    import transformers as tf
    cfg = tf.LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=8,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg).cuda().to(bf).eval()
    every_gemm = CodaBackend(Options(min_fused_rows=0, cudagraphs=True))
    # generate() with a static cache compiles the decode step itself (its compile_config:
    # mode="reduce-overhead", i.e. CUDA graphs); the prefill runs eager in every variant
    variants = {
        "eager": {"disable_compile": True},
        "torch.compile, reduce-overhead": {"compile_config": tf.CompileConfig()},
        # the same compile on a copy of its own: the ratio's noise floor (A/A)
        "torch.compile, reduce-overhead, again": {"compile_config": tf.CompileConfig()},
        'backend="coda", reduce-overhead': {"compile_config": tf.CompileConfig(
            backend="coda")},
        'backend="coda", every GEMM fused': {"compile_config": tf.CompileConfig(
            backend=every_gemm, mode="default")},
    }
    # One copy of the model per variant. generate() keeps one compiled decode step per
    # model and wraps a new torch.compile whenever the compile config differs from the
    # last call's (PreTrainedModel.get_compiled_call), so variants alternating on one
    # model re-wrapped theirs every round: the every-GEMM-fused variant ran 23-36 tokens/s
    # alternated and 571-640 alone (2026-12-01), and the others' spreads were 15-56%
    # (2026-12-04). With a model each, every variant keeps its compiled step.
    models = {name: model if i == 0 else copy.deepcopy(model)
              for i, name in enumerate(variants)}
    rows = []
    rounds = int(os.environ.get("CODA_DECODE_ROUNDS", "5"))
    tokens = int(os.environ.get("CODA_DECODE_TOKENS", "64"))
    for batch in (1, 8):
        prompt = torch.randint(0, cfg.vocab_size, (batch, 32), device="cuda")
        kw = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                  cache_implementation="static", attention_mask=torch.ones_like(prompt),
                  pad_token_id=0)
        torch._dynamo.reset()
        outs, seen = {}, {name: [] for name in variants}

        def run(name):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = models[name].generate(prompt, **kw, **variants[name])
            torch.cuda.synchronize()
            return out, time.perf_counter() - t0
        with torch.no_grad():
            for name in variants:  # compile + record each variant once
                for _ in range(2):
                    outs[name] = run(name)[0]
                if "coda" in name:  # what its graphs (prefill runs eager) fused, and why not
                    print(f"decode batch {batch} {name}: {rewrites_since([every_gemm])}",
                          flush=True)
            # variants in alternating rounds (the order reversed every other round): a
            # drift of the clocks or the host's load lands on every variant alike
            names = list(variants)
            for i in range(rounds):
                for name in (names if i % 2 == 0 else names[::-1]):
                    seen[name].append(run(name)[1])
        want = outs["eager"]
        base = seen["torch.compile, reduce-overhead"]
        for name, ts in seen.items():
            agree = (outs[name][:, 32:] == want[:, 32:]).float().mean().item()
            med = statistics.median(ts)
            tps = batch * tokens / med
            # the same round's torch.compile time over this variant's: paired, so a slow
            # round slows both sides of its ratio
            ratios = sorted(b / t for b, t in zip(base, ts))
            print(f"decode batch {batch} {name:<34} {tps:8.1f} tokens/s "
                  f"(spread {(max(ts) - min(ts)) / med:.1%} over {len(ts)} alternating "
                  f"rounds), {statistics.median(ratios):.3f}x torch.compile by round "
                  f"({ratios[0]:.3f}-{ratios[-1]:.3f}), {agree:.0%} tokens as eager",
                  flush=True)
            rows.append((f"decode b{batch} {name}", "tokens/s", tps))
    return rows


def qwen3() -> list:
    """Hugging Face Qwen3 at Qwen3-8B widths (hidden 4096, 32 / 8 heads of 128 with
    QK-norm, ffn 12288, vocab 151936), 2 layers, bf16, no_grad forward (logits) at
    2 x 2048 and 1 x 256 tokens: eager, torch.compile, backend="coda", alternating rounds."""
    import transformers as tf
    cfg = tf.Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                         num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=128, max_position_embeddings=4096,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    model = tf.Qwen3ForCausalLM(cfg).cuda().to(bf).eval()
    rows = []
    for b, s in ((2, 2048), (1, 256)):
        torch._dynamo.reset()
        ids = torch.randint(0, cfg.vocab_size, (b, s), device="cuda")
        compiled = torch.compile(model)
        backend = torch.compile(model, backend="coda")
        with torch.no_grad():
            want = model(ids, use_cache=False).logits.float()
            for f in (compiled, backend):
                got = f(ids, use_cache=False).logits.float()
                print(f"qwen3 {b}x{s}: rel. err vs eager "
                      f"{float((got - want).norm() / want.norm()):.1e}", flush=True)
            report = coda_rewrite.last_report()
            fused = [p.name for r in report.records if r.status == "rewritten"
                     for p in r.programs]
            print(f"qwen3 {b}x{s}: fused programs {sorted(set(fused))}", flush=True)
            t = bench_rounds({"eager": lambda: model(ids, use_cache=False),
                              "torch.compile": lambda: compiled(ids, use_cache=False),
                              'backend="coda"': lambda: backend(ids, use_cache=False)})
        for name, (ms, spread) in t.items():
            print(f"qwen3 {b}x{s} {name:<16} {ms:8.3f} ms (spread {spread:.1%})", flush=True)
            rows.append((f"qwen3 {b}x{s} {name}", "ms", ms))
    return rows


def gpt_neox() -> list:
    """Hugging Face GPT-NeoX at Pythia-6.9B widths (hidden 4096, 32 heads, ffn 16384,
    vocab 50432, rotary_pct 0.25), 2 layers, bf16, no_grad forward (logits), alternating
    rounds."""
    import transformers as tf
    cfg = tf.GPTNeoXConfig(vocab_size=50432, hidden_size=4096, intermediate_size=16384,
                           num_hidden_layers=2, num_attention_heads=32, rotary_pct=0.25,
                           max_position_embeddings=4096, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = tf.GPTNeoXForCausalLM(cfg).cuda().to(bf).eval()
    rows = []
    for b, s in ((2, 2048), (1, 1024)):
        torch._dynamo.reset()
        ids = torch.randint(0, cfg.vocab_size, (b, s), device="cuda")
        compiled = torch.compile(model)
        plain, caching = CodaBackend(), CodaBackend(Options(cache_relayouts=True))
        backend, kept = torch.compile(model, backend=plain), torch.compile(model, backend=caching)
        with torch.no_grad():
            want = model(ids, use_cache=False).logits.float()
            for name, f, report in (("default", backend, plain.report),
                                    ("cache_relayouts", kept, caching.report)):
                got = f(ids, use_cache=False).logits.float()
                fused = sorted({p.name for r in report.records if r.status == "rewritten"
                                for p in r.programs})
                left = sorted({r.code for r in report.records if r.pattern == "layernorm_gemm"
                               and r.status != "rewritten"})
                print(f"gpt_neox {b}x{s} {name}: rel. err vs eager "
                      f"{float((got - want).norm() / want.norm()):.1e}; fused {fused}; "
                      f"LayerNorms left: {left}", flush=True)
            compiled(ids, use_cache=False)
            t = bench_rounds({"eager": lambda: model(ids, use_cache=False),
                              "torch.compile": lambda: compiled(ids, use_cache=False),
                              'backend="coda"': lambda: backend(ids, use_cache=False),
                              "coda, cache_relayouts": lambda: kept(ids, use_cache=False)})
        for name, (ms, spread) in t.items():
            print(f"gpt_neox {b}x{s} {name:<22} {ms:8.3f} ms (spread {spread:.1%})",
                  flush=True)
            rows.append((f"gpt_neox {b}x{s} {name}", "ms", ms))
    return rows


def main():
    print(env_line())
    what = sys.argv[1:] or ["forward", "small_m", "decode"]
    rows = [row for part in (forward, small_m, decode, qwen3, gpt_neox) if part.__name__ in what
            for row in part()]
    print("csv:", write_csv("inference", rows))


if __name__ == "__main__":
    main()
