"""Dense experts run on their routed rows (patterns/dense_experts.py): Llama 4's MoE block
(transformers' Llama4TextMoe: a sigmoid router over the top-k, every token through every
expert by torch.bmm, a shared expert) at the Llama-4-Scout shape (hidden 5120, 16
experts of 8192, top-1; 8192 tokens) and the Maverick shape (128 experts of 8192, top-1;
2048 tokens: the dense layer's intermediates grow with the experts), bf16: eager,
torch.compile and backend="coda", forward under no_grad and forward + backward (loss
Σ out·r), variants in alternating rounds; outputs against a float32 copy of the dense
block (Scout only: Maverick's float32 copy would not fit beside the rest); peak memory.

    source .gpu/setup.sh && python benchmarks/dense_experts.py [scout] [maverick]
"""

from __future__ import annotations

import copy
import sys

import torch

from common import bench_rounds, env_line, kernel_top, write_csv

from coda_rewrite.numerics import rel_err

SHAPES = {"scout": (16, 8192), "maverick": (128, 2048)}   # experts, tokens
HIDDEN, INTER = 5120, 8192


def block(experts: int):
    from transformers import AutoConfig
    from transformers.models.llama4.modeling_llama4 import Llama4TextMoe
    cfg = AutoConfig.for_model("llama4_text", hidden_size=HIDDEN, intermediate_size=INTER,
                               num_local_experts=experts, num_experts_per_tok=1)
    with torch.device("cuda"):
        moe = Llama4TextMoe(cfg).to(torch.bfloat16)
    for p in moe.parameters():  # the scale of a trained layer's outputs
        torch.nn.init.normal_(p, std=p.shape[-2 if p.dim() == 3 else -1] ** -0.5)
    return moe


def peak(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2 ** 30


def main(names):
    print(env_line(), flush=True)
    rows = []
    for name in names:
        experts, tokens = SHAPES[name]
        torch.manual_seed(0)
        moe = block(experts)
        x = torch.randn(1, tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
        r = torch.randn(tokens, HIDDEN, device="cuda")
        torch._dynamo.reset()
        variants = {"eager": moe, "torch.compile": torch.compile(moe),
                    "backend=coda": torch.compile(moe, backend="coda")}
        with torch.no_grad():
            outs = {k: f(x)[0] for k, f in variants.items()}
            if name == "scout":
                want = copy.deepcopy(moe).float()(x.float())[0]
                for k, o in outs.items():
                    print(f"{name}: {k}: rel. error vs float32 dense {rel_err(o, want):.2e}",
                          flush=True)
                del want
            else:
                print(f"{name}: coda vs eager (bf16) "
                      f"{rel_err(outs['backend=coda'], outs['eager']):.2e}", flush=True)
            del outs
            timed = bench_rounds({k: (lambda f=f: f(x)) for k, f in variants.items()},
                                 rounds=5)
            for k in variants:
                print(f"{name}: forward {k:16s} {timed[k][0]:9.3f} ms (spread "
                      f"{timed[k][1]:.1%})  {timed['torch.compile'][0] / timed[k][0]:.2f}x "
                      f"torch.compile, peak {peak(lambda f=variants[k]: f(x)):.1f} GiB",
                      flush=True)
                rows.append((f"{name} forward {k}", "ms", timed[k][0]))
            print(f"{name}: kernels of backend=coda forward:\n" +
                  kernel_top(lambda: variants["backend=coda"](x), 10), flush=True)

        def step(f):
            xi = x.detach().requires_grad_()
            (f(xi)[0].float() * r).sum().backward()
            return xi.grad

        grads = {}
        for k, f in variants.items():
            moe.zero_grad(set_to_none=True)
            grads[k] = (step(f), moe.experts.gate_up_proj.grad[:4].clone())  # 4 experts' worth
        for k in variants:
            print(f"{name}: {k}: grad x vs eager {rel_err(grads[k][0], grads['eager'][0]):.2e}"
                  f", grad gate_up_proj {rel_err(grads[k][1], grads['eager'][1]):.2e}",
                  flush=True)
        del grads
        timed = bench_rounds({k: (lambda f=f: step(f)) for k, f in variants.items()}, rounds=5)
        for k in variants:
            print(f"{name}: fwd+bwd {k:16s} {timed[k][0]:9.3f} ms (spread {timed[k][1]:.1%})"
                  f"  {timed['torch.compile'][0] / timed[k][0]:.2f}x torch.compile, peak "
                  f"{peak(lambda f=variants[k]: step(f)):.1f} GiB", flush=True)
            rows.append((f"{name} fwd+bwd {k}", "ms", timed[k][0]))
        variants = moe = None  # noqa: F841 (freed before the next shape)
        torch.cuda.empty_cache()
    write_csv("Llama 4 MoE block: dense experts on their routed rows", rows)


if __name__ == "__main__":
    main(sys.argv[1:] or list(SHAPES))
