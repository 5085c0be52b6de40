"""Mixture-of-experts layers (issue #21): Hugging Face's sparse MoE blocks at the
Qwen3-30B-A3B shape (hidden 2048, 128 experts of 768, top-8), the Mixtral-8x7B shape
(hidden 4096, 8 experts of 14336, top-2) and the gpt-oss-20b shape (hidden 2880, 32
experts of 2880, top-4; [E, K, N] weights, biases, the clamped SwiGLU) and the
OLMoE-1B-7B shape (hidden 2048, 64 experts of 1024, top-8), 8192 tokens,
bf16, forward under no_grad:
eager and torch.compile with the grouped_mm experts implementation (transformers' default
and fastest), backend="coda" (the routed experts as QuACK's grouped GEMMs with their
epilogues); variants timed in alternating rounds, outputs checked against a float32
reference (the same weights, the per-expert loop).

    source .gpu/setup.sh && python benchmarks/moe.py [MODE] [qwen3|mixtral|gpt_oss ...]

MODE: none (the MoE block's forward), layer (a one-layer model's forward: the norm's
row scale deferred into the experts, with and without), batched (transformers' batched_mm
experts at decode sizes, as torch.compile runs them and through backend="coda", which puts
them in the grouped spelling; beside torch.compile's grouped_mm), batched_train (its
forward + backward), train, host (the training step's
host time, its device time from a CUDA graph, and the host's busiest ops), small, sweep,
dgated (the down projection's fused backward per tile config, against the rules).
"""

from __future__ import annotations

import copy
import sys

import torch

from common import bench_rounds, env_line, kernel_top, write_csv

import coda_rewrite
from coda_rewrite.kernels import ops
from coda_rewrite.numerics import rel_err

TOKENS = 8192
# every size fused: what the kernels cost (the size policy leaves the experts unfused below
# FUSED_FROM_ROWS routed rows, where these runs measured them to lose or run even)
FUSED = {"min_fused_rows": 0}
SHAPES = {
    "qwen3": ("qwen3_moe", dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128,
                                num_experts_per_tok=8, norm_topk_prob=True)),
    "mixtral": ("mixtral", dict(hidden_size=4096, intermediate_size=14336,
                                num_local_experts=8, num_experts_per_tok=2)),
    "olmoe": ("olmoe", dict(hidden_size=2048, intermediate_size=1024, num_experts=64,
                            num_experts_per_tok=8)),
    "gpt_oss": ("gpt_oss", dict(hidden_size=2880, intermediate_size=2880,
                                num_local_experts=32, num_experts_per_tok=4,
                                layer_types=["full_attention"])),
}


def hidden_of(name: str) -> int:
    return SHAPES[name][1]["hidden_size"]


def show(prefix: str, timed: dict, base: str, rows=None, unit: str = "ms") -> None:
    """One line per variant: median ms, spread, speed against ``base``; each also a CSV
    row where ``rows`` is given."""
    ref = timed[base][0]
    for k, (ms, spread) in timed.items():
        print(f"{prefix}{k:26s} {ms:8.3f} ms (spread {spread:.1%})  {ref / ms:.3f}x "
              "torch.compile", flush=True)
        if rows is not None:
            rows.append((f"{prefix.split(':')[0]} {k}", unit, ms))


def whole_model(name: str):
    """A one-layer model of the shape (vocab 256): the decoder layer's attention, its
    post-attention norm and the MoE block, bf16, on the GPU."""
    from transformers import AutoConfig, AutoModelForCausalLM
    kind, extra = SHAPES[name]
    cfg = AutoConfig.for_model(kind, vocab_size=256, num_hidden_layers=1,
                               num_attention_heads=16, num_key_value_heads=4, head_dim=128,
                               **extra)
    cfg._experts_implementation = "grouped_mm"
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).eval()
    for p in model.model.layers[0].mlp.parameters():  # weights at the scale of a trained
        torch.nn.init.normal_(p, std=p.shape[-1] ** -0.5)  # layer's outputs
    return model


def block(name: str):
    return whole_model(name).model.layers[0].mlp


def reference(moe):
    """float32 copy running the per-expert loop (transformers' "eager" experts)."""
    ref = copy.deepcopy(moe).float()
    ref.experts.config = copy.deepcopy(ref.experts.config)
    ref.experts.config._experts_implementation = "eager"
    return ref


def sweep(names, configs):
    """backend=coda's forward per grouped tile config (tile_m, tile_n, cluster_m), each
    timed right after torch.compile's (the route table holds one config's plans at a
    time): what GROUPED_TILES is chosen from."""
    from common import bench
    from coda_rewrite.kernels import grouped
    print(env_line(), flush=True)
    for name in names:
        torch.manual_seed(0)
        moe = block(name)
        x = torch.randn(1, TOKENS, hidden_of(name), device="cuda", dtype=torch.bfloat16)
        base = torch.compile(moe)
        coda = torch.compile(moe, backend="coda", options=FUSED)
        with torch.no_grad():
            base(x)
            for cfg in configs:
                grouped.GROUPED_TILES = cfg
                ops.forget_routes()
                try:
                    coda(x)  # plans this config's launches
                except Exception as e:
                    print(f"{name}: {cfg}: {type(e).__name__}: {str(e)[:150]}", flush=True)
                    continue
                t_base, t_coda = bench(lambda: base(x)), bench(lambda: coda(x))
                print(f"{name}: tiles {cfg}: coda {t_coda:.3f} ms, torch.compile "
                      f"{t_base:.3f} ms: {t_base / t_coda:.3f}x", flush=True)


def train(names):
    """Forward + backward of the block (the input and every parameter needing a gradient;
    loss Σ out·r): torch.compile grouped_mm against backend="coda" (the experts fused,
    their backward through kernels/grouped.py's rules), alternating rounds; gradients
    checked against the float32 loop."""
    print(env_line(), flush=True)
    rows = []
    for name in names:
        torch.manual_seed(0)
        moe = block(name)
        hidden = hidden_of(name)
        x = torch.randn(1, TOKENS, hidden, device="cuda", dtype=torch.bfloat16)
        r = torch.randn(1, TOKENS, hidden, device="cuda")
        ref = reference(moe)
        torch._dynamo.reset()
        # the routed experts are left to eager's ops in training by default (its policy,
        # patterns/routed_experts.PAYS_IN_TRAINING): fused here on request
        variants = {"torch.compile grouped_mm": torch.compile(moe),
                    "backend=coda": torch.compile(moe, backend="coda"),
                    "backend=coda fused": torch.compile(
                        moe, backend="coda", options={"fuse_in_training": True, **FUSED})}

        def step(f, x=x):
            # as a training loop after optimizer.zero_grad() (set_to_none, PyTorch's
            # default): the gradients are assigned, not added into the last step's
            moe.zero_grad(set_to_none=True)
            xi = x.detach().requires_grad_()
            o = f(xi)
            o = o[0] if isinstance(o, tuple) else o
            (o.float() * r).sum().backward()
            return xi.grad

        xr = x.float().requires_grad_()
        o = ref(xr)
        ((o[0] if isinstance(o, tuple) else o) * r).sum().backward()
        for k, f in variants.items():
            moe.zero_grad(set_to_none=True)
            gx = step(f)
            gw = moe.experts.down_proj.grad
            print(f"{name}: {k}: grad x rel. error {rel_err(gx.float(), xr.grad):.2e}, "
                  f"grad down_proj {rel_err(gw.float(), ref.experts.down_proj.grad):.2e}",
                  flush=True)
        ops.reset_runtime()
        step(variants["backend=coda fused"])
        print(f"{name}: runtime {ops.runtime_summary()}", flush=True)
        timed = bench_rounds({k: (lambda f=f: step(f)) for k, f in variants.items()},
                             rounds=5)
        show(f"{name}: train ", timed, "torch.compile grouped_mm", rows, "ms fwd+bwd")
        for k in ("torch.compile grouped_mm", "backend=coda fused"):
            print(f"{name}: kernels of {k} fwd+bwd:\n" +
                  kernel_top(lambda f=variants[k]: step(f), 24), flush=True)
    write_csv("moe layer forward + backward (8192 tokens)", rows)


def host_ops(fn, n: int = 20) -> str:
    """The ``n`` ops with the most self CPU time in one call of ``fn``."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as p:
        fn()
    return p.key_averages().table(sort_by="self_cpu_time_total", row_limit=n,
                                  max_name_column_width=60)


def host(names):
    """The training step of ``train``'s variants: wall ms (alternating rounds), host µs
    per step (the GPU kept busy), device ms per step (replayed from a CUDA graph), and
    the coda step's busiest host ops: whether a step is host-bound, and where."""
    from common import bench_graphed
    from host_overhead import host_us
    print(env_line(), flush=True)
    for name in names:
        torch.manual_seed(0)
        moe = block(name)
        x = torch.randn(1, TOKENS, hidden_of(name), device="cuda", dtype=torch.bfloat16)
        r = torch.randn(1, TOKENS, hidden_of(name), device="cuda")
        torch._dynamo.reset()
        variants = {"torch.compile grouped_mm": torch.compile(moe),
                    "backend=coda fused": torch.compile(
                        moe, backend="coda", options={"fuse_in_training": True, **FUSED})}

        def step(f, x=x):
            moe.zero_grad(set_to_none=True)
            o = f(x.detach().requires_grad_())
            o = o[0] if isinstance(o, tuple) else o
            (o.float() * r).sum().backward()

        for f in variants.values():
            step(f)
        timed = bench_rounds({k: (lambda f=f: step(f)) for k, f in variants.items()},
                             rounds=5)
        show(f"{name}: train ", timed, "torch.compile grouped_mm")
        for k, f in variants.items():
            cpu = host_us(lambda f=f: step(f), calls=3)
            try:
                dev = f"{bench_graphed(lambda f=f: step(f)):.3f} ms"
            except Exception as e:  # a step that cannot be captured says why
                dev = f"not capturable ({type(e).__name__}: {str(e)[:120]})"
            print(f"{name}: {k}: host {cpu:.0f} us per step; device {dev}", flush=True)
        print(f"{name}: host ops of backend=coda fused:\n" +
              host_ops(lambda: step(variants["backend=coda fused"])), flush=True)


def dgated(names, configs=((128, 128, 2), (128, 192, 2), (128, 96, 2), (64, 192, 2),
                           (64, 128, 2), (192, 128, 1))):
    """The down projection's backward alone at the layer's routed rows (8192 tokens ×
    top-k, the routing of a random router): the rules' grouped dgrad (torch._grouped_mm)
    + one compiled elementwise pass (dp, h·w, the combine weight's gradient), against
    coda::grouped_dgated (the same in the dgrad's epilogue) per tile config."""
    from common import bench
    from coda_rewrite.kernels import grouped_dgated
    print(env_line(), flush=True)
    for name in names:
        torch.manual_seed(0)
        moe = block(name)
        e, top_k = moe.experts.num_experts, SHAPES[name][1]["num_experts_per_tok"]
        hidden = hidden_of(name)
        w_d = moe.experts.down_proj.detach()
        if w_d.shape[1] != hidden:  # gpt-oss's [E, I, H]: the forward reads its transpose
            w_d = w_d.mT
        inter, rows = w_d.shape[2], TOKENS * top_k
        ids = torch.sort(torch.randint(0, e, (rows,), device="cuda")).values
        offsets = torch.cumsum(torch.bincount(ids, minlength=e), 0).to(torch.int32)
        do = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
        p = torch.randn(rows, 2 * inter, device="cuda", dtype=torch.bfloat16)
        score = torch.rand(rows, device="cuda")
        op, params = ("swiglu_oai", (1.702, 7.0)) if name == "gpt_oss" else ("swiglu", ())

        def rules():  # the pair's derivative written out (Inductor fuses it into one
            g = torch._grouped_mm(do, w_d, offs=offsets)  # pass), W_d[e] as (k, n)
            gate, up = p[:, 0::2].float(), p[:, 1::2].float()
            alpha, limit = params or (1.0, float("inf"))
            gc, uc = gate.clamp(max=limit), up.clamp(-limit, limit)
            s = torch.sigmoid(alpha * gc)
            h = gc * s * (uc + 1) if params else gc * s * uc
            dh = g.float() * score[:, None]
            dg = dh * (uc + (1 if params else 0)) * (s + alpha * gc * s * (1 - s))
            du = dh * gc * s
            dg, du = torch.where(gate <= limit, dg, 0), torch.where(up.abs() <= limit, du, 0)
            dp = torch.stack((dg, du), -1).reshape(p.shape).bfloat16()
            return dp, (h * score[:, None]).bfloat16(), (h * g.float()).sum(-1)

        compiled = torch.compile(rules)
        t_rules = bench(compiled)
        t_gemm = bench(lambda: torch._grouped_mm(do, w_d, offs=offsets))
        print(f"{name}: S={rows} H={hidden} I={inter}: grouped_mm {t_gemm:.3f} ms, + the "
              f"compiled epilogue pass {t_rules:.3f} ms", flush=True)
        module = grouped_dgated.load(op, params, True)
        for tiles in configs:
            try:
                launch = grouped_dgated.Launch(module, do, w_d, offsets, p, score, tiles)
                t = bench(lambda: launch(do, w_d, offsets, p, score))
            except Exception as err:
                print(f"{name}: tiles {tiles}: {type(err).__name__}: {str(err)[:120]}",
                      flush=True)
                continue
            print(f"{name}: tiles {tiles}: grouped_dgated {t:.3f} ms: {t_rules / t:.3f}x "
                  "the rules", flush=True)


def small(names, token_counts=(8, 64, 512, 2048)):
    """The forward at decode and short-prompt sizes, each variant replayed from a CUDA
    graph (the device time: at these sizes a plain loop would time the host), alternating
    rounds: where the grouped kernels stop paying."""
    from common import bench_graphed
    print(env_line(), flush=True)
    for name in names:
        torch.manual_seed(0)
        moe = block(name)
        for tokens in token_counts:
            x = torch.randn(1, tokens, hidden_of(name), device="cuda", dtype=torch.bfloat16)
            torch._dynamo.reset()
            fns = {"torch.compile": torch.compile(moe), "coda": torch.compile(
                moe, backend="coda", options=FUSED)}
            with torch.no_grad():
                for f in fns.values():
                    f(x)
                times = {k: [] for k in fns}
                for i in range(3):
                    for k in (list(fns) if i % 2 == 0 else list(fns)[::-1]):
                        times[k].append(bench_graphed(lambda f=fns[k]: f(x)))
            med = {k: sorted(v)[1] for k, v in times.items()}
            print(f"{name}: {tokens} tokens: torch.compile {med['torch.compile']:.3f} ms, "
                  f"coda {med['coda']:.3f} ms: {med['torch.compile'] / med['coda']:.3f}x",
                  flush=True)


def with_implementation(moe, impl: str):
    """A copy of the block whose experts run transformers' ``impl``."""
    out = copy.deepcopy(moe)
    out.experts.config._experts_implementation = impl
    return out


def batched(names, token_counts=(1, 8, 64)):
    """transformers' batched_mm experts (one GEMV per (token, expert) pair on a copy of
    the expert's weights) at decode sizes: torch.compile of it, backend="coda" of it (the
    grouped spelling; the fused routed GEMMs where the size policy takes them), and
    torch.compile of grouped_mm; each replayed from a CUDA graph, alternating rounds;
    outputs against a float32 per-expert loop."""
    from common import bench_graphed
    print(env_line(), flush=True)
    for name in names:
        torch.manual_seed(0)
        moe = block(name)
        ref = reference(moe)
        per_pair = with_implementation(moe, "batched_mm")
        for tokens in token_counts:
            x = torch.randn(1, tokens, hidden_of(name), device="cuda", dtype=torch.bfloat16)
            torch._dynamo.reset()
            fns = {"batched_mm: torch.compile": torch.compile(per_pair),
                   "batched_mm: coda": torch.compile(per_pair, backend="coda"),
                   "grouped_mm: torch.compile": torch.compile(moe)}
            with torch.no_grad():
                want = ref(x.float())
                want = want[0] if isinstance(want, tuple) else want
                for k, f in fns.items():
                    before = len(coda_rewrite.last_report().records)
                    o = f(x)
                    o = o[0] if isinstance(o, tuple) else o
                    done = [f"{r.pattern} {r.status} {r.code or ''}".strip() for r in
                            coda_rewrite.last_report().records[before:]
                            if r.pattern.endswith("experts")]
                    print(f"{name}: {tokens} tokens: {k}: rel. error vs float32 loop "
                          f"{rel_err(o.float(), want):.2e} {done}", flush=True)
                times = {k: [] for k in fns}
                for i in range(3):
                    for k in (list(fns) if i % 2 == 0 else list(fns)[::-1]):
                        times[k].append(bench_graphed(lambda f=fns[k]: f(x)))
            med = {k: sorted(v)[1] for k, v in times.items()}
            base = med["batched_mm: torch.compile"]
            print(f"{name}: {tokens} tokens: " + ", ".join(
                f"{k} {v:.3f} ms ({base / v:.2f}x)" for k, v in med.items()), flush=True)
        del per_pair, moe, ref
        torch.cuda.empty_cache()


def batched_train(names, tokens: int = 64):
    """Forward + backward of the block with batched_mm experts (torch.compile of it,
    backend="coda" of it: the grouped spelling) beside torch.compile's grouped_mm, at a
    short batch (the per-pair weight copies and their gradient scatters grow with the
    tokens: 64 tokens of Mixtral's shape already copy 45 GB), alternating rounds."""
    print(env_line(), flush=True)
    for name in names:
        torch.manual_seed(0)
        moe = block(name).train()
        per_pair = with_implementation(moe, "batched_mm")
        x = torch.randn(1, tokens, hidden_of(name), device="cuda", dtype=torch.bfloat16,
                        requires_grad=True)
        torch._dynamo.reset()
        fns = {"batched_mm: torch.compile": torch.compile(per_pair),
               "batched_mm: coda": torch.compile(per_pair, backend="coda"),
               "grouped_mm: torch.compile": torch.compile(moe)}

        def step(f):
            o = f(x)
            (o[0] if isinstance(o, tuple) else o).float().square().mean().backward()
        for f in fns.values():
            step(f)
        timed = bench_rounds({k: (lambda f=f: step(f)) for k, f in fns.items()}, rounds=3)
        show(f"{name} train {tokens} tokens: ", timed, "batched_mm: torch.compile")
        del per_pair, moe, fns
        torch.cuda.empty_cache()


def layer(names):
    """The one-layer model's forward (attention, the post-attention norm, the MoE block),
    8192 tokens, under no_grad: torch.compile against backend="coda" with every family
    and without the norm's (the ablation of its row scale deferred through the routing
    into the experts' grouped GEMM), alternating rounds."""
    print(env_line(), flush=True)
    every = ("explicit_attention", "attention_inputs", "residual_rmsnorm_gemm", "gated_mlp",
             "routed_experts", "scatter_back", "rope", "lm_head_cross_entropy",
             "layernorm_gemm")
    for name in names:
        torch.manual_seed(0)
        model = whole_model(name)
        ids = torch.randint(0, 256, (1, TOKENS), device="cuda")
        torch._dynamo.reset()
        variants = {"torch.compile": torch.compile(model),
                    "coda": torch.compile(model, backend="coda"),
                    "coda, no norm deferral": torch.compile(model, backend="coda", options={
                        "patterns": tuple(p for p in every if p != "residual_rmsnorm_gemm")})}
        with torch.no_grad():
            want = model(ids).logits.float()
            for k, f in variants.items():
                ops.reset_runtime()
                got = f(ids).logits.float()
                print(f"{name}: {k}: rel. error vs eager {rel_err(got, want):.2e}; "
                      f"{ops.runtime_summary()[:3]}", flush=True)
            timed = bench_rounds({k: (lambda f=f: f(ids)) for k, f in variants.items()},
                                 rounds=5)
        show(f"{name}: layer ", timed, "torch.compile")


def main(names):
    print(env_line(), flush=True)
    rows = []
    for name in names:
        torch.manual_seed(0)
        moe = block(name)
        x = torch.randn(1, TOKENS, hidden_of(name), device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            want = reference(moe)(x.float())
            want = want[0] if isinstance(want, tuple) else want
        torch._dynamo.reset()
        variants = {
            "eager grouped_mm": moe,
            "torch.compile grouped_mm": torch.compile(moe),
            "backend=coda": torch.compile(moe, backend="coda", options=FUSED),
        }
        outs = {}
        with torch.no_grad():
            for k, f in variants.items():
                o = f(x)
                outs[k] = o[0] if isinstance(o, tuple) else o
            ops.reset_runtime()
            variants["backend=coda"](x)
            print(f"{name}: runtime {ops.runtime_summary()}", flush=True)
            for k, o in outs.items():
                print(f"{name}: {k}: rel. error vs float32 loop {rel_err(o.float(), want):.2e}",
                      flush=True)
            timed = bench_rounds({k: (lambda f=f: f(x)) for k, f in variants.items()}, rounds=5)
            show(f"{name}: ", timed, "torch.compile grouped_mm", rows)
            for k in ("torch.compile grouped_mm", "backend=coda"):
                print(f"{name}: kernels of {k}:\n" + kernel_top(lambda: variants[k](x), 10),
                      flush=True)
    write_csv("moe layer forward (8192 tokens)", rows)


if __name__ == "__main__":
    if sys.argv[1:2] == ["batched_train"]:
        batched_train(sys.argv[2:] or ["qwen3", "gpt_oss"])
    elif sys.argv[1:2] == ["batched"]:
        batched(sys.argv[2:] or ["qwen3", "gpt_oss", "mixtral"])
    elif sys.argv[1:2] == ["small"]:  # small [shape ...] [token count ...]
        args = sys.argv[2:]
        counts = tuple(int(a) for a in args if a.isdigit()) or (8, 64, 512, 2048)
        small([a for a in args if not a.isdigit()] or ["qwen3"], counts)
    elif sys.argv[1:2] == ["layer"]:
        layer(sys.argv[2:] or list(SHAPES))
    elif sys.argv[1:2] == ["dgated"]:
        dgated(sys.argv[2:] or list(SHAPES))
    elif sys.argv[1:2] == ["host"]:
        host(sys.argv[2:] or ["qwen3"])
    elif sys.argv[1:2] == ["train"]:
        train(sys.argv[2:] or list(SHAPES))
    elif sys.argv[1:2] == ["sweep"]:
        sweep(sys.argv[2:] or ["qwen3"], [(128, 192, 2), (128, 192, 1), (128, 128, 2),
                                          (128, 208, 1), (128, 128, 1)])
    else:
        main(sys.argv[1:] or list(SHAPES))
