"""Workers for tests/test_distributed.py: each runs in one of two spawned processes (gloo,
CPU) and returns what its test asserts on. Kept in a module of their own so that the
spawned processes import them without importing pytest's test module."""

from __future__ import annotations

import collections
import copy
import os
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import build, loss_of, tokens


def run_on_two_ranks(worker, *args):
    """``worker(rank, *args)`` in two gloo processes; returns the ranks' results."""
    with socket.socket() as s:  # a free port, so parallel test workers do not collide
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_entry, args=(port, out, worker, args), nprocs=2,
                           start_method="spawn")
        return [torch.load(os.path.join(out, f"{r}.pt"), weights_only=False)
                for r in range(2)]


def _entry(rank, port, out, worker, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        result = worker(rank, *args)
    finally:
        dist.destroy_process_group()
    torch.save(result, os.path.join(out, f"{rank}.pt"))
    # The result is on disk: leave without the interpreter's teardown. A background C++
    # thread still joinable there (gloo's, or a compile worker's) makes std::terminate
    # abort the process now and then ("terminate called without an active exception",
    # SIGABRT: about one run in three of this file on a loaded 2-core machine, before
    # and after this session's changes alike), failing a test whose work succeeded.
    os._exit(0)


def _backend(inductor: bool = False):
    import coda_rewrite
    return coda_rewrite.CodaBackend(coda_rewrite.Options(inductor=inductor))


def _records(backend):
    """(rank, pattern, status, code, the producer's code) per record: plain data."""
    from coda_rewrite.algebra.decision import code_of
    bugs = [r for r in backend.report.records if r.kind is not None and r.kind.is_bug]
    assert not bugs, [r.reason for r in bugs]  # as conftest's _no_pass_bugs, per rank
    return [(g.rank, r.pattern, r.status, r.code, code_of(getattr(r, "producer", "")))
            for g in backend.report.graphs for r in g.records]


def _max_grad_err(model, ref, full=lambda t: t):
    from coda_rewrite.numerics import rel_err
    return max(rel_err(full(p.grad), full(q.grad))
               for p, q in zip(model.parameters(), ref.parameters()))


def _sizes(family: str) -> dict:
    """Big enough that DDP's 1 MB buckets split the graph (two or more buckets)."""
    return {"dim": 128} if family == "plain" else {"hidden": 128}


# ---- DDP -----------------------------------------------------------------------------

def ddp(rank, family: str, mode: str):
    import torch._dynamo
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch._dynamo.config.optimize_ddp = mode
    model = build(family, layers=2, **_sizes(family)).train()
    ref = copy.deepcopy(model)
    backend = _backend()
    fast = torch.compile(DDP(model, bucket_cap_mb=1), backend=backend)
    slow = DDP(ref, bucket_cap_mb=1)
    ids = tokens(seed=rank)  # each rank its own batch: the all-reduce averages them
    loss, ref_loss = loss_of(fast, family, ids), loss_of(slow, family, ids)
    loss.backward()
    ref_loss.backward()
    return {"loss": loss.item(), "ref_loss": ref_loss.item(),
            "grad_err": _max_grad_err(model, ref), "graphs": len(backend.report.graphs),
            "records": _records(backend)}


def single_process_records(family: str):
    """The rewrites of one process, no wrapping: what DDP's must equal."""
    model = build(family, layers=2, **_sizes(family)).train()
    backend = _backend()
    loss_of(torch.compile(model, backend=backend), family, tokens())
    return [(r.pattern, r.status) for r in backend.report.records]


# ---- FSDP2, TorchTitan's order --------------------------------------------------------

def fsdp2(rank, family: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (2,))
    model = build(family, layers=2).train()
    ref = copy.deepcopy(model)
    backend = _backend()
    seen = []

    def spy(gm, example_inputs):  # the weights each compiled block's graph reads
        seen.append(collections.Counter(tuple(t.shape) for t in example_inputs if isinstance(
            t, torch.Tensor) and t.dim() == 2 and t.is_floating_point()))
        return backend(gm, example_inputs)

    def blocks(m):
        return m.layers if family == "plain" else m.model.layers

    # a block's matrices, whole (a shard would halve dim 0: the multiset would differ,
    # even where one weight's shard has another's shape)
    whole = collections.Counter(tuple(p.shape) for p in blocks(model)[0].parameters()
                                if p.dim() == 2)

    for block in blocks(model):
        block.compile(backend=spy)
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for block in blocks(ref):
        fully_shard(block, mesh=mesh)
    fully_shard(ref, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    losses, errs = [], []
    for step in range(2):
        ids = tokens(seed=10 * step + rank)
        loss, ref_loss = loss_of(model, family, ids), loss_of(ref, family, ids)
        loss.backward()
        ref_loss.backward()
        losses.append((loss.item(), ref_loss.item()))
        errs.append(_max_grad_err(model, ref, lambda g: g.full_tensor()))
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    return {"losses": losses, "grad_errs": errs, "records": _records(backend),
            "weights_whole": bool(seen) and all(c == whole for c in seen)}


# ---- tensor (+ sequence) parallel ------------------------------------------------------

def _parallelize(model, mesh, sequence_parallel: bool):
    """TorchTitan's plan for the plain Llama: q/k/v and w1/w3 column-parallel, wo and w2
    row-parallel; with sequence parallelism the norms and the residual stream are split
    by sequence, gathered before each block's GEMMs."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel,
                                                   parallelize_module)
    stream = Shard(1) if sequence_parallel else Replicate()
    if sequence_parallel:
        parallelize_module(model, mesh, {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())})
    for block in model.layers:
        plan = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=stream),
                "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=stream)}
        if sequence_parallel:
            plan.update({
                "attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
                "attention": PrepareModuleInput(input_layouts=(Shard(1), None),
                                                desired_input_layouts=(Replicate(), None)),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                                   desired_input_layouts=(Replicate(),))})
        parallelize_module(block, mesh, plan)
    return model


class _Redistributions:
    """Every layout change DTensor makes (explicit or implicit), as (from, to, global
    shape): an all-gather of a weight would show here as Shard → Replicate on a weight's
    shape."""

    def __init__(self):
        import torch.distributed.tensor._dispatch as dispatch
        import torch.distributed.tensor._redistribute as redistribute
        self.seen = collections.Counter()
        self.modules = [m for m in (redistribute, dispatch)
                        if hasattr(m, "redistribute_local_tensor")]
        self.original = redistribute.redistribute_local_tensor

    def __enter__(self):
        def spy(local, current, target, *a, **kw):
            self.seen[(str(current.placements), str(target.placements),
                       tuple(current.shape))] += 1
            return self.original(local, current, target, *a, **kw)
        for m in self.modules:
            m.redistribute_local_tensor = spy
        return self

    def __exit__(self, *exc):
        for m in self.modules:
            m.redistribute_local_tensor = self.original


def tensor_parallel(rank, sequence_parallel: bool, inductor: bool):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    mesh = init_device_mesh("cpu", (2,))
    model = build("plain", layers=2).train()
    single = copy.deepcopy(model)          # one process, eager: the reference
    eager_tp = _parallelize(copy.deepcopy(model), mesh, sequence_parallel)
    model = _parallelize(model, mesh, sequence_parallel)
    backend = _backend(inductor)
    fast = torch.compile(model, backend=backend)
    ids = tokens()                          # the same batch on both ranks
    loss_of(fast, "plain", ids)             # compile outside the counted call
    for p in model.parameters():
        p.grad = None
    with _Redistributions() as coda_moves:
        loss = loss_of(fast, "plain", ids)
        loss.backward()
    with _Redistributions() as eager_moves:
        loss_of(eager_tp, "plain", ids).backward()
    ref_loss = loss_of(single, "plain", ids)
    ref_loss.backward()

    def full(g):
        return g.full_tensor() if isinstance(g, DTensor) else g
    weight_shapes = {tuple(p.shape) for p in single.parameters() if p.dim() == 2}
    return {"loss": loss.item(), "ref_loss": ref_loss.item(),
            "grad_err": _max_grad_err(model, single, full), "records": _records(backend),
            "coda_moves": coda_moves.seen, "eager_moves": eager_moves.seen,
            "weight_shapes": weight_shapes}


# ---- functional collectives written by hand ------------------------------------------

class _HandParallelBlock(torch.nn.Module):
    """A Megatron-style block written with functional collectives (no DTensor): a
    row-split projection, its all-reduce, the residual add and a norm feeding a GEMM."""

    def __init__(self, dim: int = 64):
        super().__init__()
        torch.manual_seed(0)
        self.down = torch.nn.Linear(dim, dim, bias=False)   # each rank: half of K
        self.norm = torch.nn.RMSNorm(dim)
        self.up = torch.nn.Linear(dim, 2 * dim, bias=False)

    def forward(self, x_half, residual):
        import torch.distributed._functional_collectives as funcol
        partial = self.down(x_half)
        z = residual + funcol.all_reduce(partial, "sum", dist.group.WORLD)
        return self.up(self.norm(z))


def functional_collectives(rank):
    block = _HandParallelBlock()
    ref = copy.deepcopy(block)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(2, 8, 64, generator=g)
    residual = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(7))
    backend = _backend()
    out = torch.compile(block, backend=backend)(x, residual)
    want = ref(x, residual)
    from coda_rewrite.numerics import rel_err
    return {"err": rel_err(out, want), "records": _records(backend)}


def norm_into_row_parallel(rank):
    """A norm whose GEMM is row-parallel (RowwiseParallel splits the normalised
    features over the ranks): refused, the result is eager's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.norm = torch.nn.RMSNorm(64)
            self.proj = torch.nn.Linear(64, 32, bias=False)

        def forward(self, x):
            return self.proj(self.norm(x))

    mesh = init_device_mesh("cpu", (2,))
    block = Block()
    ref = copy.deepcopy(block)
    parallelize_module(block, mesh, {"proj": RowwiseParallel(input_layouts=Replicate())})
    x = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(3))
    backend = _backend()
    out = torch.compile(block, backend=backend)(x)
    from coda_rewrite.numerics import rel_err
    return {"err": rel_err(out, ref(x)), "records": _records(backend)}


def biased_column_parallel(rank):
    """A norm feeding two column-parallel GEMMs with biases (Qwen2's q/k/v), forward and
    backward against the same wrapping in eager: the bias is a per-feature operand,
    sharded like the weight's rows."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.norm = torch.nn.RMSNorm(32)
            with torch.no_grad():
                self.norm.weight.uniform_(0.5, 1.5)
            self.q, self.k = torch.nn.Linear(32, 16), torch.nn.Linear(32, 8)

        def forward(self, x):
            h = self.norm(x)
            return self.q(h).sum(-1, keepdim=True) * self.k(h).mean(-1, keepdim=True)

    mesh = init_device_mesh("cpu", (2,))
    block = Block()
    ref = copy.deepcopy(block)  # the same wrapping in eager: each rank sums its columns
    for m in (block, ref):
        parallelize_module(m, mesh, {"q": ColwiseParallel(), "k": ColwiseParallel()})
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(3))
    xr = x.clone().requires_grad_()
    x.requires_grad_()
    backend = _backend()
    out = torch.compile(block, backend=backend)(x)
    want = ref(xr)
    out.square().sum().backward()
    want.square().sum().backward()
    from coda_rewrite.numerics import rel_err

    def full(g):
        return g.full_tensor() if isinstance(g, DTensor) else g
    return {"err": rel_err(out, want), "x_grad": rel_err(x.grad, xr.grad),
            "grad_err": _max_grad_err(block, ref, full), "records": _records(backend)}
