"""The two-GPU training step (issue #22): the Llama-3.2-1B-shaped model of the one-GPU
step (benchmarks/layer_and_step.py: hidden 2048, 16 layers, 32/8 heads, intermediate
8192, vocab 128256, bf16, 2 x 4096 tokens per GPU, forward + loss + backward) wrapped two
ways over two GPUs (NCCL), each under eager, torch.compile and backend="coda":

    fsdp2   FSDP2, TorchTitan's order: each decoder layer compiled (block.compile), then
            fully_shard per layer and at the root; each rank its own batch
    tp      tensor + sequence parallel (torch.distributed.tensor.parallel): q/k/v and
            gate/up column-parallel, o_proj and down_proj row-parallel with their output
            scattered over the sequence, the norms and the residual stream split by
            sequence, the embedding row-parallel and the LM head column-parallel (its
            logits gathered whole); the same batch on both ranks; the whole model compiled

    source .gpu/setup.sh && python benchmarks/distributed_step.py [fsdp2|tp|both]
    python benchmarks/distributed_step.py both --cpu    # gloo, a tiny config: the dry run

The word embedding and the LM head are untied here (the one-GPU step ties them): the
tensor-parallel plan shards the embedding by rows and the head by columns, which would
make two parameters of one. Every variant and the reference share that model.

Per wrapping, first the numerics at a small batch (2 x 128 tokens per rank): the loss and
every gathered gradient against a float64 copy of the model on one device, run on what
the wrapping computes (the mean over both ranks' batches for FSDP2, the shared batch for
tensor parallelism); each variant's error beside eager's. Then the variants, compiled
and warmed up, are timed in alternating rounds ($CODA_STEP_ROUNDS rounds of
$CODA_STEP_STEPS steps, default 3 x 3; the order reversed every other round): median
ms/step with the spread and the speed over torch.compile paired by round, tokens/s
over both GPUs, the peak memory of each GPU, and rank 0's kernel split with the
collectives' time apart. Rank 0 prints; every figure is recorded with the date, GPUs and
versions (common.env_line).
"""

from __future__ import annotations

import copy
import os
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common import env_line, kernel_split, write_csv

import coda_rewrite

WORLD = 2
VARIANTS = ("eager", "torch.compile", 'backend="coda"')


def config(cpu: bool):
    from transformers import LlamaConfig
    if cpu:  # the dry run: every code path, nothing worth timing
        return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                           max_position_embeddings=256, tie_word_embeddings=False,
                           attn_implementation="sdpa")
    return LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                       max_position_embeddings=8192, rope_theta=500000.0,
                       tie_word_embeddings=False, attn_implementation="sdpa")


# ---- the two wrappings ----------------------------------------------------------------

def fsdp2(model, mesh, compiler):
    """TorchTitan's order: each layer compiled, then sharded; the root last."""
    from torch.distributed.fsdp import fully_shard
    for layer in model.model.layers:
        if compiler is not None:
            layer.compile(backend=compiler)
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def tensor_parallel(model, mesh, compiler):
    """Tensor + sequence parallelism on Hugging Face's Llama modules (TorchTitan's plan,
    its names translated). The residual stream stays a DTensor sharded by sequence
    (use_local_output=False where a module hands it on), so Hugging Face's shape
    arithmetic (the causal mask, the positions) sees the whole sequence."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel,
                                                   parallelize_module)
    parallelize_module(model, mesh, {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(),
                                              output_layouts=Shard(1),
                                              use_local_output=False),
        "model.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())})
    for layer in model.model.layers:
        parallelize_module(layer, mesh, {
            "input_layernorm": SequenceParallel(),
            "post_attention_layernorm": SequenceParallel(),
            "self_attn": PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": Shard(1)},
                desired_input_kwarg_layouts={"hidden_states": Replicate()}),
            "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1),
                                                use_local_output=False),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),),
                                      desired_input_layouts=(Replicate(),)),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1),
                                             use_local_output=False)})
    return model if compiler is None else torch.compile(model, backend=compiler)


WRAPPINGS = {"fsdp2": fsdp2, "tp": tensor_parallel}


def compiler_of(variant: str):
    """What each variant compiles with (None: eager), a fresh backend per model so its
    report holds that model's graphs alone."""
    if variant == "eager":
        return None
    if variant == "torch.compile":
        return "inductor"
    return coda_rewrite.CodaBackend(coda_rewrite.Options())


# ---- one rank -------------------------------------------------------------------------

def _batch(cfg, wrapping: str, rank: int, tokens: tuple[int, int], device, step: int = 0):
    """Each rank its own batch under FSDP2 (data parallel); one shared batch under tensor
    parallelism."""
    seed = 1000 * step + (rank if wrapping == "fsdp2" else 0)
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, tokens, generator=gen).to(device)


def _full(t):
    from torch.distributed.tensor import DTensor
    return t.full_tensor() if isinstance(t, DTensor) else t


def numerics(rank, wrapping: str, cfg, base, device, dtype, tokens) -> dict:
    """Each variant's loss and gathered gradients at a small batch against a float64 copy
    on this device: {variant: (loss error, largest gradient error)}, errors relative
    (a gradient's to its own norm)."""
    from coda_rewrite.numerics import rel_err
    batches = [_batch(cfg, wrapping, r, tokens, device) for r in range(WORLD)]
    if wrapping == "tp":
        batches = batches[:1]
    exact = copy.deepcopy(base).to(device=device, dtype=torch.float64)
    # what the wrapping computes: the mean of the ranks' losses (FSDP2's gradient
    # reduce-scatter averages), or the one shared batch's loss; written out, since
    # Hugging Face's loss upcasts the logits to float32 (float64's would be rounded)
    want = sum(causal_lm_loss(exact(input_ids=ids).logits, ids) for ids in batches) / \
        len(batches)
    want.backward()
    truth = {n: p.grad for n, p in exact.named_parameters()}
    mesh = _mesh(device)
    out = {}
    for variant in VARIANTS:
        torch._dynamo.reset()
        model = WRAPPINGS[wrapping](copy.deepcopy(base).to(device=device, dtype=dtype), mesh,
                                    compiler_of(variant))
        ids = batches[rank if wrapping == "fsdp2" else 0]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        mean_loss = loss.detach().clone()
        if wrapping == "fsdp2":
            dist.all_reduce(mean_loss)
            mean_loss /= WORLD
        grad = max(rel_err(_full(p.grad).double(), truth[n]) for n, p in
                   _unwrapped(model).named_parameters())
        out[variant] = (abs(mean_loss.double().item() - want.item()) / abs(want.item()), grad)
    return out


def causal_lm_loss(logits, ids):
    """Hugging Face's causal-LM loss (token t predicts t + 1, the mean over tokens) in the
    logits' own dtype."""
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1),
                                             ids[:, 1:].flatten())


def _unwrapped(model):
    return getattr(model, "_orig_mod", model)


def _mesh(device):
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh(device.type, (WORLD,))


def timings(rank, wrapping: str, cfg, base, device, dtype, tokens, rounds: int,
            per_round: int) -> dict:
    """Every variant compiled and warmed up, then timed in alternating rounds; rank 0's
    kernel split per variant, each rank's peak memory."""
    mesh = _mesh(device)
    models, losses = {}, {}

    def run(model, step=0):
        ids = _batch(cfg, wrapping, rank, tokens, device, step)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        return out.loss.detach()

    fused = {}
    for variant in VARIANTS:
        compiler = compiler_of(variant)
        models[variant] = WRAPPINGS[wrapping](
            copy.deepcopy(base).to(device=device, dtype=dtype), mesh, compiler)
        losses[variant] = float(run(models[variant]))   # compile
        run(models[variant])
        _unwrapped(models[variant]).zero_grad(set_to_none=True)
        if isinstance(compiler, coda_rewrite.CodaBackend):
            fused[variant] = what_was_rewritten(compiler.report)
    times = {v: [] for v in VARIANTS}
    for i in range(rounds):
        for variant in (VARIANTS if i % 2 == 0 else VARIANTS[::-1]):
            model = models[variant]
            _sync(device)
            dist.barrier()
            t0 = time.perf_counter()
            for s in range(per_round):
                run(model, s + 1)
            _sync(device)
            times[variant].append((time.perf_counter() - t0) / per_round * 1e3)
            _unwrapped(model).zero_grad(set_to_none=True)
    result = {"times": times, "losses": losses, "peak": {}, "split": {}, "fused": fused}
    for variant, model in models.items():
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            run(model)
            torch.cuda.synchronize()
            result["peak"][variant] = torch.cuda.max_memory_allocated() / 2 ** 30
            result["split"][variant] = kernel_split(lambda m=model: run(m))
        _unwrapped(model).zero_grad(set_to_none=True)
    return result


def what_was_rewritten(report) -> dict:
    """{(pattern, "rewritten" or the code it was left with): count} over the graphs of
    every block (FSDP2 compiles each layer apart)."""
    import collections
    return dict(collections.Counter(
        (r.pattern, "rewritten" if r.status == "rewritten" else r.code or r.status)
        for r in report.records))


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def worker(rank, wrappings: list[str], cpu: bool) -> dict:
    device = torch.device("cpu") if cpu else torch.device("cuda", rank)
    if not cpu:
        torch.cuda.set_device(device)
    dtype = torch.float32 if cpu else torch.bfloat16
    cfg = config(cpu)
    torch.manual_seed(0)
    base = _llama(cfg)
    small = (2, 16) if cpu else (2, 128)
    tokens = (2, 16) if cpu else (2, 4096)
    rounds = 1 if cpu else int(os.environ.get("CODA_STEP_ROUNDS", "3"))
    per_round = 1 if cpu else int(os.environ.get("CODA_STEP_STEPS", "3"))
    for knob in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 64)
    out = {}
    for wrapping in wrappings:
        out[wrapping] = {
            "numerics": numerics(rank, wrapping, cfg, base, device, dtype, small),
            **timings(rank, wrapping, cfg, base, device, dtype, tokens, rounds, per_round),
            "tokens": tokens[0] * tokens[1] * (WORLD if wrapping == "fsdp2" else 1)}
    return out


def _llama(cfg):
    from transformers import LlamaForCausalLM
    return LlamaForCausalLM(cfg).train()


# ---- two processes --------------------------------------------------------------------

def run_on_two_ranks(wrappings: list[str], cpu: bool) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_entry, args=(port, out, wrappings, cpu), nprocs=WORLD,
                           start_method="spawn")
        return [torch.load(os.path.join(out, f"{r}.pt"), weights_only=False)
                for r in range(WORLD)]


def _entry(rank, port, out, wrappings, cpu):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if cpu:
        torch.set_num_threads(1)
    dist.init_process_group("gloo" if cpu else "nccl", rank=rank, world_size=WORLD,
                            device_id=None if cpu else torch.device("cuda", rank))
    try:
        result = worker(rank, wrappings, cpu)
    finally:
        dist.destroy_process_group()
    torch.save(result, os.path.join(out, f"{rank}.pt"))
    os._exit(0)  # tests/_distributed.py says why: no interpreter teardown after the result


def table(results: list[dict], wrapping: str) -> list[str]:
    """Rank 0's times (both ranks wait on each other's collectives every step), each
    GPU's peak, the numerics of rank 0 (every rank gathers the same gradients)."""
    r0 = results[0][wrapping]
    lines = [f"{wrapping}: {r0['tokens']} tokens per step over {WORLD} ranks"]
    base = r0["times"]["torch.compile"]
    for variant in VARIANTS:
        ts = r0["times"][variant]
        ms = statistics.median(ts)
        ratios = sorted(b / t for b, t in zip(base, ts))
        loss_err, grad_err = r0["numerics"][variant]
        peaks = " / ".join(f"{res[wrapping]['peak'].get(variant, float('nan')):.1f}"
                           for res in results)
        lines.append(
            f"  {variant:16s} {ms:8.1f} ms ({(max(ts) - min(ts)) / ms:5.1%})  "
            f"{r0['tokens'] / ms * 1e3:9.0f} tok/s  {statistics.median(ratios):.3f}x "
            f"torch.compile ({ratios[0]:.3f}-{ratios[-1]:.3f})  peak GiB {peaks}  "
            f"vs float64: loss {loss_err:.1e}, gradients {grad_err:.1e}  "
            f"| {r0['split'].get(variant, '')}")
    for variant, seen in r0["fused"].items():
        lines.append(f"  {variant} on rank 0: " + ", ".join(
            f"{p} {s} x{n}" for (p, s), n in sorted(seen.items())))
    return lines


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    cpu = "--cpu" in sys.argv
    which = args[0] if args else "both"
    wrappings = list(WRAPPINGS) if which == "both" else [which]
    if not cpu:
        print(env_line(), f"| {torch.cuda.device_count()} GPUs", flush=True)
    results = run_on_two_ranks(wrappings, cpu)
    for wrapping in wrappings:
        print("\n".join(table(results, wrapping)), flush=True)
        if not cpu:
            r0 = results[0][wrapping]
            write_csv(f"Llama-3.2-1B training step, {wrapping} over {WORLD} GPUs",
                      [(v, "ms", statistics.median(r0["times"][v])) for v in VARIANTS] +
                      [(v, "peak GiB", max(r[wrapping]["peak"][v] for r in results))
                       for v in VARIANTS])
    return results


if __name__ == "__main__":
    main()
