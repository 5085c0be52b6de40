"""Host time per fused call: what the CPU spends to launch each program family's fused
GEMM (the GEMM, its finaliser, everything the rewrite inserts for the match), beside
F.linear at the same shape, at M = 64 where the host, not the GPU, bounds a forward.

    source .gpu/setup.sh && python benchmarks/host_overhead.py [profile]

The GPU is kept busy ahead of the timed loop (torch.cuda._sleep), so a call never waits
for the launch queue and the figure is the host's own work. Per program (captured from
a Llama-3-8B-shaped layer through optimize(), so the operands are the real ones):

    graph call      what a graph optimize() runs calls under no_grad: fused_linear on the
                    model's [batch, tokens, K] activations (flatten, launch, outputs back
                    to the model's shapes): a match whose input and results no other
                    fused call hands it or reads
    chained         fused_linear on the op's 2-D form: a call that reads another fused
                    call's result and hands its own on (row_chains.py), what most of a
                    Llama layer's matches cost
    direct          the same without fused_linear's checks (kernels/ops.execute: the
                    route by tensor metadata, then the prepared launch)
    launch          the prepared launch alone (quack_path.Launch: allocations, QuACK's
                    planned GEMM launch, the finaliser)
    op, nograd      torch.ops.coda.gemm_epilogue_nograd (no autograd formula), through
                    the dispatcher: what an inference graph under Inductor called before
                    the fortieth session; on optimize()'s program, and then on each
                    program only Inductor's graph calls (inductor_programs: none where its
                    graph defers the norms as optimize()'s do)
    kernel          the op's kernel function called directly, inside the check of the
                    profiler's state: what Inductor's code calls now
                    (kernels/inductor_calls.py)
    op              torch.ops.coda.gemm_epilogue (with its autograd formula), no_grad
    graph, grad     a graph call whose input and weight require grad, in grad mode
                    (ops.FusedGemm records the node; an Inductor training graph calls the
                    formula-less op: "op, nograd")
    chained, grad   the same in the op's 2-D form: what optimize()'s training forward
                    calls inside a chain (row_chains.py; the re-laid q/k/v and gate/up
                    GEMMs make their re-layout in the call, kernels/relayout.py, which this
                    does not time)
    F.linear        cuBLAS at the same (M, N, K); "F.linear, grad" with inputs that
                    require grad, in grad mode

then, for the serving recipe (optimize(cache_relayouts=True)), each program over a kept
re-layout (gate/up, q/k/v: kernels/relayout.py) as its graph calls it (a current kept
re-layout goes straight to fused_linear), beside its full path (the kept weight looked up
inside the op's kernel: every such call before the forty-first session) and F.linear;
and per whole layer (1 x 64 tokens, no_grad): host µs per forward under eager,
torch.compile, optimize() (also with cache_relayouts=True, the serving recipe: no weight
re-layout per call) and backend="coda"; then backend="coda"'s compiled graph called
alone, as Inductor's code calls the ops now and through the dispatcher as before the
fortieth session (coda_graph_pair).
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import sys
import time

import torch

from common import env_line, write_csv

import coda_rewrite
from coda_rewrite.codegen.program import Kind, parse
from coda_rewrite.kernels import ops, quack_path, relayout
from coda_rewrite.models import Llama, LlamaArgs

bf = torch.bfloat16
CALLS = 100


def host_us(fn, calls: int = CALLS, repeats: int = 5) -> float:
    """Median over repeats of the host µs per call, the GPU busy all along."""
    return interleaved({"": fn}, calls, repeats)[""]


def interleaved(fns: dict, calls: int = CALLS, rounds: int = 7) -> dict:
    """Host µs per call of each variant: the median over rounds, every round running each
    variant's calls once (the order turned every round), the GPU busy all along. A host
    that slows down for a while slows every variant of that round alike, so differences
    between variants (a fused call over F.linear) hold where the absolute figures
    move."""
    for fn in fns.values():
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    seen = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            fn = fns[name]
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU work queued ahead of the loop
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            seen[name].append((time.perf_counter() - t0) / calls * 1e6)
            torch.cuda.synchronize()  # the launch queue empty again: it never fills
    return {name: statistics.median(v) for name, v in seen.items()}


def captured(model, x, owner, name: str) -> dict:
    """program -> the other arguments (tensors cloned) of its first call of
    ``owner.name`` while the rewritten model runs once under no_grad: ops.execute's
    (a, b, operands) for every fused GEMM, relayout.gemm_relaid's (a, kind, spec,
    sources, operands) for those over a kept re-layout (a class's first call takes the
    op's full path); ops._decide_and_run's, the same as ops.execute's, for a class's
    first call from Inductor's code."""
    seen, original = {}, getattr(owner, name)

    def spy(program, *args):
        seen.setdefault(program, torch.utils._pytree.tree_map(
            lambda t: t.clone() if isinstance(t, torch.Tensor) else t, args))
        return original(program, *args)

    setattr(owner, name, spy)
    try:
        with torch.no_grad():
            model(x)
    finally:
        setattr(owner, name, original)
    return seen


def per_program(calls) -> list[tuple[str, str, float]]:
    rows = []
    print(f"{'program':<34} {'family':<18} {'M,N,K':<16} {'graph':>7} {'chained':>7} "
          f"{'direct':>7} {'launch':>7} {'nograd':>7} {'kernel':>7} {'op':>7} {'grad':>7} "
          f"{'ch,grad':>7} {'F.linear':>9} {'lin,grad':>8}  µs/call")
    # what Inductor's code calls (kernels/inductor_calls.py: the op's kernel inside a
    # check of the profiler's state), installed by the backend's compile before this
    from torch._inductor.select_algorithm import extern_kernels
    kernel_fn = getattr(extern_kernels, "coda_gemm_epilogue_nograd", ops._execute_nograd)
    for program, (a, b, operands) in calls.items():
        prog = parse(program)
        if not prog.gemm:
            continue
        a_g, b_g = a.detach().requires_grad_(), b.detach().requires_grad_()
        x = a.reshape(1, *a.shape)  # the model's [batch, tokens, K]
        lifted = [t.reshape(1, *t.shape) if spec.kind == Kind.TILE else
                  t.reshape(1, -1, 1) if spec.kind == Kind.PER_ROW else t
                  for spec, t in zip(prog.operands, operands)]
        with torch.no_grad():
            ops.execute(program, a, b, operands)
            route = ops._routes[(program, quack_path.metadata_key(a, b, operands))]
            fns = {
                "graph": lambda: ops.fused_linear(program, x, b, *lifted),
                "chained": lambda: ops.fused_linear(program, a, b, *operands),
                "direct": lambda: ops.execute(program, a, b, operands),
                "nograd": lambda: ops.gemm_epilogue_nograd(program, a, b, operands),
                "kernel": lambda: kernel_fn(program, a, b, operands),
                "op": lambda: torch.ops.coda.gemm_epilogue(program, a, b, operands),
                "linear": lambda: torch.nn.functional.linear(x, b)}
            if isinstance(route, quack_path.Launch):
                fns["launch"] = lambda: route(a, b, operands)
            t = interleaved(fns)
        graph, chained, direct, nograd, op, linear = (
            t[k] for k in ("graph", "chained", "direct", "nograd", "op", "linear"))
        launch, kernel = t.get("launch", float("nan")), t["kernel"]
        x_g = a_g.reshape(1, *a.shape)
        try:  # an inference-only program (no saved pre-activation) has no backward
            g = interleaved({"grad": lambda: ops.fused_linear(program, x_g, b_g, *lifted),
                             "chained": lambda: ops.fused_linear(program, a_g, b_g, *operands),
                             "linear": lambda: torch.nn.functional.linear(x_g, b_g)})
            grad, chained_grad, linear_grad = g["grad"], g["chained"], g["linear"]
        except Exception:
            grad = chained_grad = linear_grad = float("nan")
        shape = f"{a.shape[0]},{b.shape[0]},{a.shape[1]}"
        print(f"{prog.key:<34} {prog.family:<18} {shape:<16} {graph:7.1f} {chained:7.1f} "
              f"{direct:7.1f} {launch:7.1f} {nograd:7.1f} {kernel:7.1f} {op:7.1f} {grad:7.1f} "
              f"{chained_grad:7.1f} {linear:9.1f} {linear_grad:8.1f}")
        for variant, us in (("graph call", graph), ("chained", chained), ("direct", direct),
                            ("launch", launch),
                            ("op, nograd", nograd), ("kernel", kernel), ("op", op),
                            ("graph, grad", grad), ("chained, grad", chained_grad),
                            ("F.linear", linear), ("F.linear, grad", linear_grad)):
            rows.append((f"{prog.family} {variant}", "host us/call", us))
        if isinstance(route, quack_path.Launch) and route.norm is not None:
            rows += launch_parts(route, a, b, operands)
    return rows


def per_relaid_program(calls) -> list[tuple[str, str, float]]:
    """The serving recipe's calls over kept re-layouts (gate/up, q/k/v): the graph's call
    (a current kept re-layout goes straight to fused_linear: versioned.peek), the full
    path (the op's kernel, the kept weight looked up inside it) and F.linear on the kept
    weight."""
    rows = []
    for program, (a, kind, spec, sources, operands) in calls.items():
        prog = parse(program)
        b = relayout.kept(kind, spec, sources, a.dtype)
        with torch.no_grad():
            t = interleaved({
                "kept": lambda: relayout.fused_linear_relaid(program, a, kind, spec,
                                                             sources, *operands),
                "full": lambda: ops._linear(
                    lambda text, a2, _, flat: relayout.gemm_relaid(
                        text, a2, kind, spec, sources, flat), program, a, None, operands),
                "linear": lambda: torch.nn.functional.linear(a.reshape(1, *a.shape), b)})
        print(f"{prog.key:<34} {prog.family:<18} kept re-layout ({kind}): graph call "
              f"{t['kept']:.1f}, through the op's kernel {t['full']:.1f}, "
              f"F.linear {t['linear']:.1f} µs")
        rows += [(f"{prog.family} kept re-layout: {name}", "host us/call", us)
                 for name, us in (("graph call", t["kept"]),
                                  ("through the op's kernel", t["full"]),
                                  ("F.linear", t["linear"]))]
    return rows


def inductor_programs(calls, traced) -> list[tuple[str, str, float]]:
    """The programs an Inductor graph (backend="coda") calls that optimize()'s graphs do
    not: a norm producer computing its rstd with a finaliser kernel, where the traced
    graph keeps it (deferred_rstd.py: a dynamic row count; before the thirty-seventh
    session every traced graph did). The "op, nograd" above is what Inductor's graph
    pays where its programs are optimize()'s."""
    rows = []
    for program, (a, b, operands) in traced.items():
        prog = parse(program)
        if not prog.gemm or program in calls:
            continue
        with torch.no_grad():
            t = interleaved({
                "nograd": lambda: ops.gemm_epilogue_nograd(program, a, b, operands),
                "linear": lambda: torch.nn.functional.linear(a.reshape(1, *a.shape), b)})
        print(f"{prog.key:<34} {prog.family:<18} as an Inductor graph calls it: op, nograd "
              f"{t['nograd']:.1f} µs, F.linear {t['linear']:.1f}")
        rows += [(f"{prog.family} op, nograd (Inductor's program)", "host us/call",
                  t["nograd"]), (f"{prog.family} F.linear (beside it)", "host us/call",
                                 t["linear"])]
    return rows


@contextlib.contextmanager
def ops_through_the_dispatcher():
    """Graphs Inductor compiles inside call the coda ops as torch.ops calls, as before the
    fortieth session (kernels/inductor_calls.py's lowerings set aside), with Inductor's
    caches off: their keys do not include a lowering, so a graph compiled the other
    way would come back from them."""
    from torch._inductor import lowering
    from coda_rewrite.kernels import inductor_calls
    saved = {op: lowering.lowerings.pop(op) for op in inductor_calls._KERNELS
             if op in lowering.lowerings}
    try:
        with torch._inductor.config.patch(force_disable_caches=True):
            yield
    finally:
        lowering.lowerings.update(saved)


def launch_parts(route, a, b, operands) -> list[tuple[str, str, float]]:
    """Where a norm producer's launch spends its host time: the allocations (outputs,
    partials, rstd), QuACK's planned GEMM launch on buffers made once, the rstd kernel."""
    buffers = dict(zip(route.buffer_names, (torch.empty(*shape, device=a.device, dtype=dtype)
                                            for shape, dtype in route.buffer_specs)))
    values = {**route._operands(operands), **buffers}
    sink, rows, scale, eps = route.norm
    rstd = torch.empty(route.m, device=a.device, dtype=torch.float32)
    partials = buffers[sink] if rows is None else buffers[sink].view(rows)
    with torch.no_grad():
        parts = {
            "torch.empty (one buffer)": host_us(
                lambda: torch.empty(route.m, device=a.device, dtype=torch.float32)),
            "QuACK planned launch": host_us(lambda: quack_path.run_gemm_epi_plan(
                route.planned.gemm, a, b.t(), buffers.get("D"), route._c(operands), values)),
            "rstd kernel (compiled, direct)": host_us(
                lambda: route.row_rstd(partials, rstd, scale, eps)),
        }
    for name, us in parts.items():
        print(f"    norm producer, {name:<32} {us:7.1f} µs")
    return [(f"residual_rmsnorm part: {name}", "host us/call", us) for name, us in parts.items()]


def per_layer(model, x) -> list[tuple[str, str, float]]:
    fused = {"min_fused_rows": 0}  # M = 64 is below the default: fuse to measure it
    variants = {"eager": model, "torch.compile": torch.compile(model),
                "optimize()": coda_rewrite.optimize(model, **fused),
                "optimize(), kept": coda_rewrite.optimize(model, cache_relayouts=True,
                                                          **fused),
                'backend="coda"': torch.compile(model, backend="coda", options=fused)}
    rows = []
    with torch.no_grad():
        calls = {name: (lambda m=m: m(x)) for name, m in variants.items()}
        calls.update(coda_graph_pair(model, x, fused))
        t = interleaved(calls, calls=20)
    for name, us in t.items():
        print(f"layer forward, 1 x {x.shape[1]} tokens, {name:<26} {us:8.1f} µs host")
        rows.append((f"layer {name}", "host us/forward", us))
    return rows


def coda_graph_pair(model, x, options: dict) -> dict:
    """backend="coda"'s compile of the model's one dynamo graph, twice: Inductor's code as
    it is, and with the ops called through the dispatcher (ops_through_the_dispatcher).
    Dynamo shares one compiled graph between compiles of the same forward (its guards do
    not tell two backends' calls of one module apart here), so the pair is compiled
    from the graph dynamo hands a backend and called without dynamo's frame: each
    figure is the compiled graph's own host time, not comparable with the rows above."""
    grabbed = []

    def grab(gm, example_inputs):
        grabbed.append((copy.deepcopy(gm), list(example_inputs)))
        return gm.forward
    torch._dynamo.reset()
    torch.compile(model, backend=grab)(x)
    torch._dynamo.reset()
    gm, inputs = grabbed[0]

    def compiled(dispatched: bool):
        with ops_through_the_dispatcher() if dispatched else \
                torch._inductor.config.patch(force_disable_caches=True):
            fn = coda_rewrite.backend.coda_backend(copy.deepcopy(gm), inputs, options)
            call = lambda: fn(*inputs)  # noqa: E731
            call()
        return call
    return {'coda graph': compiled(False), 'coda graph, torch.ops': compiled(True)}


def profile(model, x, top: int = 25) -> None:
    """cProfile of optimize()'s forward: where its host time goes."""
    import cProfile
    import pstats
    fast = coda_rewrite.optimize(model, min_fused_rows=0)
    with torch.no_grad():
        for _ in range(3):
            fast(x)
        torch.cuda.synchronize()
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(50):
            fast(x)
        pr.disable()
    torch.cuda.synchronize()
    pstats.Stats(pr).sort_stats("tottime").print_stats(top)


def main():
    print(env_line())
    torch.manual_seed(0)
    a = LlamaArgs(dim=4096, n_layers=1, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                  vocab_size=32768, max_seq_len=4096)
    model = Llama(a).cuda().to(bf).eval()
    x = torch.randint(0, a.vocab_size, (1, 64), device="cuda")
    if "profile" in sys.argv[1:]:
        return profile(model, x)
    calls = captured(coda_rewrite.optimize(model, min_fused_rows=0), x, ops, "execute")
    # Inductor's code calls the op's kernel, which goes to _decide_and_run on a class's
    # first call (not through ops.execute)
    traced = captured(torch.compile(model, backend="coda", options={"min_fused_rows": 0}),
                      x, ops, "_decide_and_run")
    relaid = captured(coda_rewrite.optimize(model, min_fused_rows=0, cache_relayouts=True),
                      x, relayout, "gemm_relaid")
    # the compiles above leave Inductor's compile-worker processes behind; stopped here so
    # that nothing else runs on the host while its time is measured (the thirty-eighth
    # session's table had its first program ~35% high in every column, cause not
    # isolated; the per-layer compiles below start them again)
    import torch._inductor.async_compile as async_compile
    getattr(async_compile, "shutdown_compile_workers", lambda: None)()
    rows = per_program(calls) + per_relaid_program(relaid) + \
        inductor_programs(calls, traced) + per_layer(model, x)
    print("csv:", write_csv("host overhead (M = 64, 8B layer)", rows))


if __name__ == "__main__":
    main()
