"""Whole-model figures: a Llama-3-8B-shaped decoder layer forward (batch 2 x 4096) and
the Llama-3.2-1B-shaped training step (hidden 2048, 16 layers, 32/8 heads, intermediate
8192, vocab 128256, tied embeddings, bf16, batch 2 x 4096, forward + backward + loss),
each under eager, torch.compile, optimize() and backend="coda": ms, tokens/s, peak
memory, and the kernel-time split of the training step.

    source .gpu/setup.sh && python benchmarks/layer_and_step.py [layer|step|both] [variants]

(variants: a comma-separated subset of the step's, e.g. ``backend="coda",Liger 0.8.5``,
or ``ablation``: the families added one at a time; the step's variants run in
alternating rounds; CODA_STEP_SHAPE=4x8192 for CODA's own benchmark shape;
CODA_STEP_ACCUMULATE=1 adds each step's gradients to the kept .grad instead of zeroing it;
CODA_BENCH_TOP=N also prints each variant's top N kernels, at least 15)
"""

from __future__ import annotations

import collections
import os
import sys
import time

import torch

from common import bench, env_line, kernel_split, kernel_top, rewrites_since, write_csv

import coda_rewrite
from coda_rewrite.kernels import ops
from coda_rewrite.models import Block, LlamaArgs, rope_table

bf = torch.bfloat16


def peak_mib(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2 ** 20


def layer_8b():
    """(block, x, freqs): the Llama-3-8B-shaped decoder layer (bf16, seed 0) on 2 x 4096
    tokens, as every layer figure measures it (here and benchmarks/fp8.py)."""
    a = LlamaArgs(dim=4096, n_heads=32, n_kv_heads=8, ffn_dim=14336, max_seq_len=4096)
    torch.manual_seed(0)
    block = Block(a).cuda().to(bf)
    x = torch.randn(2, 4096, 4096, device="cuda", dtype=bf)
    return block, x, rope_table(128, 4096, 10000.0).cuda()


def layer():
    block, x, freqs = layer_8b()
    variants = {"eager": block, "torch.compile": torch.compile(block),
                "optimize()": coda_rewrite.optimize(block),
                'backend="coda"': torch.compile(block, backend="coda"),
                # serving: re-laid-out weights kept inside the GEMM op between calls
                'backend="coda", kept re-layouts': torch.compile(
                    block, backend=coda_rewrite.CodaBackend(
                        coda_rewrite.Options(cache_relayouts=True)))}
    rows = []
    with torch.no_grad():
        want = block(x, freqs)
        for name, m in variants.items():
            t0 = time.time()
            got = m(x, freqs)
            torch.cuda.synchronize()
            first = time.time() - t0
            err = float((got.float() - want.float()).norm() / want.float().norm())
            ms = bench(lambda: m(x, freqs))
            split = kernel_split(lambda: m(x, freqs))
            rows.append((name, ms, err, first, split))
            print(f"layer {name}: {ms:.3f} ms (first call {first:.1f} s, rel diff {err:.2e})"
                  f" | {split}", flush=True)
    return rows


def liger(model):
    from liger_kernel.transformers import apply_liger_kernel_to_llama
    apply_liger_kernel_to_llama(rope=True, swiglu=True, rms_norm=True, cross_entropy=False,
                                fused_linear_cross_entropy=True, model=model)
    return model


# The training-step ablation (issue #16): the families added one at a time on top of the
# attention rewrite, each fused in training (fuse_in_training=True: training_policy.py
# leaves them by default, which is the "backend=\"coda\"" variant)
ABLATION = (("coda +attention", ("attention_inputs",)),
            ("coda +norm", ("attention_inputs", "residual_rmsnorm_gemm")),
            ("coda +gated", ("attention_inputs", "residual_rmsnorm_gemm", "gated_mlp")),
            ("coda +rope", ("attention_inputs", "residual_rmsnorm_gemm", "gated_mlp",
                            "rope")),
            ("coda +ce", ("attention_inputs", "residual_rmsnorm_gemm", "gated_mlp", "rope",
                          "lm_head_cross_entropy")))


def step():
    """The 1B training step: every requested variant compiled and warmed up first, then
    timed in alternating rounds (the order reversed every other round; $CODA_STEP_ROUNDS
    rounds of $CODA_STEP_STEPS steps, default 3 × 3): median ms/step with the spread
    between rounds and, for each variant, the first variant's speed over its own paired
    by round (median and range); then each variant's peak memory, kernel split and what it fused.
    Each step starts from no .grad ($CODA_STEP_ACCUMULATE=1: adds to the kept one).
    Shape: $CODA_STEP_SHAPE, batch x tokens (default 2x4096; CODA's own benchmark shape is
    4x8192). Liger patches the model's modules, so it runs after the rounds, alone."""
    import statistics

    from transformers import LlamaConfig, LlamaForCausalLM
    batch, seq = (int(v) for v in os.environ.get("CODA_STEP_SHAPE", "2x4096").split("x"))
    cfg = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                      max_position_embeddings=max(8192, seq), rope_theta=500000.0,
                      tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).cuda().to(bf)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device="cuda")

    def run(m):
        out = m(input_ids=ids, labels=ids)
        out.loss.backward()
        return out.loss.detach()

    variants = {
        "eager": lambda: model, "torch.compile": lambda: torch.compile(model),
        "optimize()": lambda: coda_rewrite.optimize(model),
        'backend="coda"': lambda: torch.compile(model, backend="coda"),
        # a loop that reads only the loss: the logits are never written
        'coda-no-logits': lambda: torch.compile(model, backend=coda_backend(
            materialize_logits=False)),
        # every family fused in training (the training policy off)
        "coda-every-family": lambda: torch.compile(model, backend=coda_backend(
            fuse_in_training=True)),
        "coda-attention-ce": lambda: torch.compile(model, backend=coda_backend(
            patterns=("attention_inputs", "lm_head_cross_entropy"), fuse_in_training=True)),
        # + the gated MLP, its down projection's backward in the dgrad GEMM's epilogue
        # (kernels/gated_down.py), or as graph ops (the plain backward rule)
        "coda-attention-ce-gated": lambda: torch.compile(model, backend=coda_backend(
            patterns=("attention_inputs", "lm_head_cross_entropy", "gated_mlp"),
            fuse_in_training=True)),
        "coda-attention-ce-gated-graph-bwd": lambda: torch.compile(model, backend=coda_backend(
            patterns=("attention_inputs", "lm_head_cross_entropy", "gated_mlp"),
            fuse_in_training=True, backward_epilogues=False)),
        # what one more family adds to that step, or the LM head taken out (BENCHMARKS.md,
        # seventeenth session: by kernel with CODA_BENCH_TOP=40)
        "coda-attention-ce-gated-rope": lambda: torch.compile(model, backend=coda_backend(
            patterns=("attention_inputs", "lm_head_cross_entropy", "gated_mlp", "rope"),
            fuse_in_training=True)),
        "coda-attention-ce-gated-norm": lambda: torch.compile(model, backend=coda_backend(
            patterns=("attention_inputs", "lm_head_cross_entropy", "gated_mlp",
                      "residual_rmsnorm_gemm"), fuse_in_training=True)),
        "coda-attention-gated": lambda: torch.compile(model, backend=coda_backend(
            patterns=("attention_inputs", "gated_mlp"), fuse_in_training=True)),
        **{name: (lambda pats=pats: torch.compile(model, backend=coda_backend(
            patterns=pats, fuse_in_training=True))) for name, pats in ABLATION},
        # FP8 (options.fp8): every linear but the LM head row-wise e4m3, forward and
        # backward; beside it torchao's float8 row-wise training recipe on the same linears
        # (a copy of the model: its parameters are 2.4 GiB more in every variant's peak)
        "coda fp8": lambda: torch.compile(model, backend=coda_backend(fp8=True)),
        "torchao float8 rowwise": lambda: torchao_float8(model),
        # what users pick today (its wheel carried to the GPU, on PYTHONPATH); it patches
        # transformers' Llama modules, so it runs after the others
        "Liger 0.8.5": lambda: liger(model),
    }
    asked = sys.argv[2] if len(sys.argv) > 2 else "torch.compile,backend=\"coda\""
    names = [n for n, _ in ABLATION] if asked == "ablation" else asked.split(",")
    names = [n for n in names if n != "Liger 0.8.5"] + \
        (["Liger 0.8.5"] if "Liger 0.8.5" in names else [])
    # every variant stays compiled for the alternating rounds: dynamo keeps an entry per
    # backend for the model's forward, more than its default limit of 8
    for knob in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 64)
    rounds = int(os.environ.get("CODA_STEP_ROUNDS", "3"))
    per_round = int(os.environ.get("CODA_STEP_STEPS", "3"))
    compiled, first, losses, fused = {}, {}, {}, {}
    times = collections.defaultdict(list)

    # a step starts from no .grad (zero_grad(set_to_none=True), as TorchTitan's and the
    # HF Trainer's loops do without accumulation), or, with CODA_STEP_ACCUMULATE=1, adds
    # to the round's kept .grad (gradient accumulation: every step after the first runs
    # AccumulateGrad's add)
    accumulate = os.environ.get("CODA_STEP_ACCUMULATE") == "1"

    def one_step(m):
        loss = run(m)
        if not accumulate:
            m.zero_grad(set_to_none=True)
        return loss

    def timed(name):
        m = compiled[name]
        torch.cuda.synchronize()
        t0 = time.time()
        for _ in range(per_round):
            one_step(m)
        torch.cuda.synchronize()
        m.zero_grad(set_to_none=True)
        times[name].append((time.time() - t0) / per_round * 1e3)

    def prepare(name):
        if name == "Liger 0.8.5":
            torch._dynamo.reset()
        compiled[name] = variants[name]()
        t0 = time.time()
        losses[name] = float(run(compiled[name]))
        torch.cuda.synchronize()
        first[name] = time.time() - t0
        run(compiled[name])
        compiled[name].zero_grad(set_to_none=True)
        fused[name] = what_was_rewritten()

    alternating = [n for n in names if n != "Liger 0.8.5"]
    for name in alternating:
        prepare(name)
    for i in range(rounds):
        for name in (alternating if i % 2 == 0 else alternating[::-1]):
            timed(name)
    rows = []

    def report(name):
        m = compiled[name]
        mem = peak_mib(lambda: one_step(m))
        split = kernel_split(lambda: one_step(m))
        if os.environ.get("CODA_BENCH_TOP"):  # the kernels behind the split, per variant
            top = max(15, int(os.environ["CODA_BENCH_TOP"]))
            print(f"step {name}: top kernels\n{kernel_top(lambda: one_step(m), top)}",
                  flush=True)
        m.zero_grad(set_to_none=True)
        ts = times[name]
        ms = statistics.median(ts)
        spread = (max(ts) - min(ts)) / ms
        rows.append((name, ms, mem, losses[name], first[name], split, spread))
        # the first variant's time over this one's in the same round: paired, so a round
        # the host or the clocks slowed moves both sides of its ratio (the spread between
        # rounds is a range, which grows with the rounds: it cannot tell a 1.5% saving)
        base = times[alternating[0]]
        ratios = sorted(b / t for b, t in zip(base, ts))
        paired = (f"{statistics.median(ratios):.3f}x {alternating[0]} by round "
                  f"({ratios[0]:.3f}-{ratios[-1]:.3f})" if len(ts) == len(base) else "")
        print(f"step {name}: {ms:.1f} ms (spread {spread:.1%} over {len(ts)} rounds"
              f"{', ' + paired if paired else ''}), peak {mem:.0f} MiB, loss "
              f"{losses[name]:.4f}, first call {first[name]:.0f} s | {split} | "
              f"{fused[name]}", flush=True)
    for name in alternating:
        report(name)
    if "Liger 0.8.5" in names:  # alone, after the others: it patches the model
        prepare("Liger 0.8.5")
        for _ in range(rounds):
            timed("Liger 0.8.5")
        report("Liger 0.8.5")
    return rows, f"{batch} x {seq}"


def torchao_float8(model):
    """torchao's float8 training, its "rowwise" recipe (e4m3 for the three GEMMs, scales
    per row / column), on every linear but the LM head, compiled (a copy: torchao swaps
    the modules)."""
    import copy

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    converted = convert_to_float8_training(
        copy.deepcopy(model), config=Float8LinearConfig.from_recipe_name("rowwise"),
        module_filter_fn=lambda module, fqn: fqn != "lm_head")
    return torch.compile(converted)


def what_was_rewritten() -> str:
    """Which families a variant fused (common.rewrites_since over the "coda" backend's
    session report and every CodaBackend's)."""
    return rewrites_since(BACKENDS)


BACKENDS: list = []


def coda_backend(**options):
    BACKENDS.append(coda_rewrite.CodaBackend(coda_rewrite.Options(**options)))
    return BACKENDS[-1]


def main():
    which = sys.argv[1] if len(sys.argv) > 1 else "both"
    print(env_line(), flush=True)
    lrows = layer() if which in ("layer", "both") else []
    srows, shape = step() if which in ("step", "both") else ([], "")
    print("\nruntime:", *ops.runtime_summary()[:12], sep="\n  ")
    print(f"\n{env_line()}")
    if lrows:
        print("Llama-3-8B decoder layer forward, bf16, 2 x 4096 tokens")
        for name, ms, err, first, split in lrows:
            print(f"  {name:16s} {ms:8.3f} ms  {8192 / ms * 1e3:10.0f} tok/s  rel diff {err:.1e}"
                  f"  | {split}")
    if srows:
        print(f"Llama-3.2-1B training step, bf16, {shape} tokens (fwd + bwd + loss)")
        batch, seq = (int(v) for v in shape.split(" x "))
        for name, ms, mem, loss, first, split, spread in srows:
            print(f"  {name:18s} {ms:7.1f} ms ({spread:5.1%})  {batch * seq / ms * 1e3:8.0f} tok/s  "
                  f"peak {mem / 1024:5.1f} GiB  loss {loss:.4f}  | {split}")
    if lrows:
        write_csv("Llama-3-8B layer forward, 2 x 4096", [(r[0], "ms", r[1]) for r in lrows])
    if srows:
        write_csv(f"Llama-3.2-1B training step, {shape}",
                  [(r[0], "ms", r[1]) for r in srows] +
                  [(r[0], "peak GiB", r[2] / 1024) for r in srows])


if __name__ == "__main__":
    main()
