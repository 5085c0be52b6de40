"""deferred_rstd.py: a norm producer hands its consumers its raw partials and each
consumer's GEMM forms r; the IR's ROW_PARTIALS kind and rstd_partials op, their
reference, their lowering, and where the pass must not apply."""

from __future__ import annotations

import copy

import pytest
import torch

import coda_rewrite
from coda_rewrite import deferred_rstd, row_chains
from coda_rewrite.codegen import reference
from coda_rewrite.codegen.program import ACC, EpilogueProgram, Kind, ProgramBuilder, parse
from coda_rewrite.codegen.op_table import ProgramError
from coda_rewrite.codegen.quack_source import Unlowerable, generate
from coda_rewrite.kernels import ops
from coda_rewrite.options import Options
from coda_rewrite.pipeline import rewrite_graph

from conftest import build, hf_model, loss_of, plain_llama, tokens

bf = torch.bfloat16


def _producer(d: float = 64.0, eps: float = 1e-6) -> EpilogueProgram:
    """residual_rmsnorm's shape: z = acc + residual, h2 = z·γ, r = rsqrt(Σz²/d + eps)."""
    p = ProgramBuilder("residual_rmsnorm", gemm=True, family="residual_rmsnorm")
    z = p.add(ACC, p.operand("residual", Kind.TILE), name="z")
    h2 = p.mul(z, p.operand("gamma", Kind.PER_FEATURE), name="h2")
    r = p.rsqrt(p.add(p.div(p.row_sum(p.square(z), name="ss"), d), eps), name="r")
    p.output(z, Kind.TILE, "bfloat16")
    p.output(h2, Kind.TILE, "bfloat16")
    p.output(r, Kind.PER_ROW, "float32")
    return p.build()


def _consumer() -> EpilogueProgram:
    p = ProgramBuilder("rowscale", gemm=True, family="rowscale")
    p.output(p.scaled_acc(True, False), Kind.TILE, "bfloat16")
    return p.build()


# ---- the IR --------------------------------------------------------------------------

def test_the_pass_rewrites_programs_into_valid_ir():
    producer, r_index, d, eps = deferred_rstd._row_scale(_producer())
    assert (r_index, d, eps) == (2, 64.0, 1e-6)
    assert [o.kind for o in producer.outputs] == [Kind.TILE, Kind.TILE, Kind.ROW_PARTIALS]
    assert [i.op for i in producer.body] == ["add", "mul", "square", "row_sum"]
    consumer = deferred_rstd._reading_partials(_consumer(), ["r"], d, eps)
    assert consumer.operands[0].kind == Kind.ROW_PARTIALS
    assert consumer.body[0].op == "rstd_partials"
    assert consumer.value_kinds()["r"] == (Kind.PER_ROW, False)  # known before the tile
    assert parse(consumer.to_text()) == consumer


@pytest.mark.parametrize("case", ["partials_in_a_product", "rstd_of_a_per_row_operand",
                                  "operand_d", "zero_d", "partials_output_of_non_sum",
                                  "partials_output_as_bf16"])
def test_the_ir_refuses_misuse_of_row_partials(case):
    p = ProgramBuilder("bad", gemm=True)
    if case == "partials_in_a_product":
        p.output(p.mul(ACC, p.operand("P", Kind.ROW_PARTIALS)), Kind.TILE, "bfloat16")
    elif case == "rstd_of_a_per_row_operand":
        r = p.rstd_partials(p.operand("P", Kind.PER_ROW), 8.0, 1e-6)
        p.output(p.mul(ACC, r), Kind.TILE, "bfloat16")
    elif case in ("operand_d", "zero_d"):
        P = p.operand("P", Kind.ROW_PARTIALS)
        d = p.operand("d", Kind.SCALAR) if case == "operand_d" else 0.0
        p.output(p.mul(ACC, p.rstd_partials(P, d, 1e-6)), Kind.TILE, "bfloat16")
    else:
        v = p.row_max(ACC) if case == "partials_output_of_non_sum" else p.row_sum(ACC)
        p.output(ACC, Kind.TILE, "bfloat16")
        p.output(v, Kind.ROW_PARTIALS,
                 "bfloat16" if case == "partials_output_as_bf16" else "float32")
    with pytest.raises(ProgramError):
        p.build()


# ---- reference and lowering ------------------------------------------------------------

@pytest.mark.parametrize("tiles", [1, 3, 11])
def test_the_reference_forms_r_from_any_number_of_partials(tiles):
    """The consumer reading partials gives exactly the consumer given
    r = rsqrt(Σ_t P / d + eps) (computed the same way), for one merged column or many."""
    torch.manual_seed(0)
    m, k, n = 12, 32, 16
    a, b = torch.randn(m, k, dtype=bf), torch.randn(n, k, dtype=bf)
    partials = torch.rand(m, tiles) * 50
    r = torch.rsqrt(partials.sum(1) / 64.0 + 1e-6)
    deferred = deferred_rstd._reading_partials(_consumer(), ["r"], 64.0, 1e-6)
    got = reference.run_program(deferred, a, b, [partials])[0]
    want = reference.run_program(_consumer(), a, b, [r])[0]
    assert torch.equal(got, want)


def test_the_producer_hands_on_its_sum_of_squares_and_the_chain_gives_the_old_values():
    """Producer then consumer on the reference route: [M, 1] partials, and the
    consumer's result is the one r from the finaliser gives, bit for bit."""
    torch.manual_seed(1)
    m, k, n = 10, 32, 64
    a, w0, w1 = (torch.randn(m, k, dtype=bf), torch.randn(n, k, dtype=bf),
                 torch.randn(24, n, dtype=bf))
    residual, gamma = torch.randn(m, n, dtype=bf), torch.randn(n, dtype=bf)
    producer, *_ = deferred_rstd._row_scale(_producer())
    z, h2, ss = reference.run_program(producer, a, w0, [residual, gamma])
    z0, h20, r0 = reference.run_program(_producer(), a, w0, [residual, gamma])
    assert ss.shape == (m, 1) and ss.dtype == torch.float32
    assert torch.equal(z, z0) and torch.equal(h2, h20)
    deferred = deferred_rstd._reading_partials(_consumer(), ["r"], 64.0, 1e-6)
    got = reference.run_program(deferred, h2, w1, [ss])[0]
    want = reference.run_program(_consumer(), h20, w1, [r0])[0]
    assert torch.equal(got, want)


def test_the_consumer_lowers_to_rstd_of_partials_and_the_producer_to_its_raw_sink():
    consumer = deferred_rstd._reading_partials(_consumer(), ["r"], 64.0, 1e-6)
    ks = generate(consumer)
    assert 'RstdOfPartials("o_r_partials", inv_d=0.015625, eps=1e-06)' in ks.source
    assert "from coda_rewrite.kernels.epi_ops import RstdOfPartials" in ks.source
    assert not ks.row_stage
    producer, *_ = deferred_rstd._row_scale(_producer())
    pks = generate(producer)
    assert not pks.row_stage and pks.norm_stage is None  # no finaliser
    assert "row partials" in pks.contract.render()
    # the producer's kernel is the one it had: only the finaliser went
    assert pks.source == generate(_producer()).source


def test_two_readers_with_different_constants_do_not_lower():
    p = ProgramBuilder("two", gemm=True)
    P = p.operand("P", Kind.ROW_PARTIALS)
    r1, r2 = p.rstd_partials(P, 8.0, 1e-6), p.rstd_partials(P, 8.0, 1e-5)
    p.output(p.mul(p.mul(ACC, r1), r2), Kind.TILE, "bfloat16")
    with pytest.raises(Unlowerable):
        generate(p.build())


def _quack_default_config(device):
    from quack.gemm_config import _default_config_for_cap
    return _default_config_for_cap(9)  # Hopper's: a CPU has no capability to read


def test_a_traced_producer_gets_the_width_of_quacks_partials(monkeypatch):
    """A traced graph's fake gives the partials the width the launch will: one column off
    CUDA (the reference's merged sum); on CUDA the partials QuACK's own sink rule
    allocates for the config the launch takes (the row class's, or QuACK's default),
    one column past READER_FOLDS_PARTIALS (the launch sums them)."""
    from coda_rewrite.kernels import quack_path
    producer, *_ = deferred_rstd._row_scale(_producer())
    a, b = torch.empty(4, 8, dtype=bf), torch.empty(64, 8, dtype=bf)
    outs = ops._fake(producer.to_text(), a, b, [torch.empty(4, 64, dtype=bf),
                                                 torch.empty(64, dtype=bf)])
    assert [tuple(o.shape) for o in outs] == [(4, 64), (4, 64), (4, 1)]
    monkeypatch.setattr(quack_path, "_default_config", _quack_default_config)
    monkeypatch.setattr(quack_path, "_kernels_run_on", lambda device: True)
    _, module = quack_path.load(producer.to_text())
    (sink,) = module.epilogue.sinks.values()
    cuda, cap, widths = torch.device("cuda"), quack_path.READER_FOLDS_PARTIALS, set()
    for m in (1, 64, 65, 256, 1024, 4096, 8192, 65536):
        for n in (64, 200, 2048, 4096, 8192, 16384):
            cfg = quack_path.config_for(producer, m, n) or _quack_default_config(cuda)
            quacks = sink.sink_alloc_shape((m,), n, cfg.tile_m, cfg.tile_n)
            assert quacks[0] == m
            want = quacks[-1] if quacks[-1] <= cap else 1
            assert quack_path.partial_columns(producer, m, n, cuda) == want, (m, n, cfg)
            widths.add(want)
    assert 1 in widths and len(widths) > 3  # folded, single-tile and several widths
    # the pass's producer is the program the norm producers' large class names
    assert not quack_path.config_for(producer, 8192, 2048).pingpong


def test_where_no_launch_can_serve_the_call_the_partials_are_one_column(monkeypatch):
    """A CUDA device the kernels cannot run on (no QuACK, another arch) runs the
    reference: one merged column, and no QuACK import to trace it."""
    from coda_rewrite.kernels import quack_path
    producer, *_ = deferred_rstd._row_scale(_producer())
    monkeypatch.setattr(quack_path, "_arch_violation", lambda index: None)
    monkeypatch.setattr(quack_path, "_default_config", _quack_default_config)
    cuda = torch.device("cuda", 0)
    # 2048 columns of the norm producers' 256-wide tiles from 4096 rows
    assert quack_path.partial_columns(producer, 4096, 2048, cuda) == 8
    monkeypatch.setattr(quack_path, "quack_available", lambda: "quack-kernels unavailable")
    assert quack_path.partial_columns(producer, 4096, 2048, cuda) == 1
    monkeypatch.undo()
    monkeypatch.setattr(quack_path, "_arch_violation", lambda index: "sm_80: not validated")
    assert quack_path.partial_columns(producer, 4096, 2048, cuda) == 1


def test_a_dynamic_row_count_has_no_traced_partials():
    """With a symbolic row count the width is unknown: the fake refuses (the pass does
    not defer such a graph's norms: test_traced_graphs_defer_only_static_sizes)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import (DimDynamic, ShapeEnv,
                                                       StatelessSymbolicContext)
    producer, *_ = deferred_rstd._row_scale(_producer())
    mode = FakeTensorMode(shape_env=ShapeEnv())
    dynamic = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC])
    a = mode.from_tensor(torch.empty(4, 8, dtype=bf), symbolic_context=dynamic)
    residual = mode.from_tensor(torch.empty(4, 64, dtype=bf), symbolic_context=dynamic)
    b, gamma = mode.from_tensor(torch.empty(64, 8, dtype=bf)), mode.from_tensor(
        torch.empty(64, dtype=bf))
    with mode, pytest.raises(NotImplementedError, match="dynamic row count"):
        ops._fake(producer.to_text(), a, b, [residual, gamma])


def test_the_reference_on_cuda_pads_its_merged_column_to_the_launchs_width(monkeypatch):
    """Where a CUDA call falls back to the reference (a contract the kernel cannot take),
    its partials keep the traced width: the merged sum, then zeros (every reader's sum is
    the same value)."""
    from coda_rewrite.kernels import quack_path
    producer, *_ = deferred_rstd._row_scale(_producer())
    monkeypatch.setattr(quack_path, "partial_columns", lambda prog, m, n, device: 5)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(6, 8, generator=g).to(bf), torch.randn(64, 8, generator=g).to(bf)
    operands = [torch.randn(6, 64, generator=g).to(bf), torch.randn(64, generator=g).to(bf)]
    merged = reference.run_program(producer, a, b, operands)
    padded = ops._partials_as_launched(producer, merged, a, b, operands,
                                       torch.device("cuda"))
    assert all(torch.equal(x, y) for x, y in zip(padded[:2], merged[:2]))
    assert padded[2].shape == (6, 5) and torch.equal(padded[2][:, :1], merged[2])
    assert not padded[2][:, 1:].any()
    assert torch.equal(op_table_rstd(padded[2]), op_table_rstd(merged[2]))
    same = ops._partials_as_launched(producer, merged, a, b, operands, torch.device("cpu"))
    assert same is merged


@pytest.mark.parametrize("sourced", [True, False], ids=["from_its_buffer", "merged"])
def test_a_launch_refuses_at_plan_time_a_width_other_than_the_traced_one(sourced,
                                                                         monkeypatch):
    """Launch._check_partials_width, fail-closed: a launch whose partials come from its
    sink buffer hands on as many as QuACK planned (or their sum past the readers' fold
    limit); one whose outputs go through a per-row stage gives the merged column. Either
    way, a width other than the one partial_columns promised the traced graph raises
    before any call (built without a GPU: a Launch's fields, no plan)."""
    from coda_rewrite.kernels import quack_path
    producer, *_ = deferred_rstd._row_scale(_producer())
    launch = object.__new__(quack_path.Launch)
    launch.ks, launch.m, launch.n, launch.device = generate(producer), 64, 2048, \
        torch.device("cuda")
    launch.sinks = [(r, None) for r in launch.ks.contract.reductions]
    launch.out_dtypes = {o.value: reference.dtype_from_name(o.dtype) for o in producer.outputs}
    (sink,) = {r.sink for r, _ in launch.sinks}
    launch.planned = type("Planned", (), {})()
    launch.planned.scratch = {sink: (torch.Size([64, 11]), torch.float32)}
    launch.results = launch._result_sources() if sourced else None
    assert (launch.results is not None) == sourced
    promised = {True: 11, False: 1}[sourced]
    monkeypatch.setattr(quack_path, "partial_columns", lambda prog, m, n, device: promised)
    launch._check_partials_width()
    for other in (promised + 1, 1 if sourced else 11):
        monkeypatch.setattr(quack_path, "partial_columns", lambda prog, m, n, device: other)
        with pytest.raises(RuntimeError, match=f"partial_columns says {other}"):
            launch._check_partials_width()
    launch.planned.scratch = {sink: (torch.Size([64, 40]), torch.float32)}  # summed past 32
    monkeypatch.setattr(quack_path, "partial_columns", lambda prog, m, n, device: 1)
    launch._check_partials_width()


def op_table_rstd(partials):
    from coda_rewrite.codegen.op_table import rstd_of_partials
    return rstd_of_partials(partials, 64.0, 1e-6)


def test_the_contract_checks_row_partials_operands():
    from coda_rewrite.kernels.quack_path import contract_violation
    consumer = deferred_rstd._reading_partials(_consumer(), ["r"], 64.0, 1e-6)
    a, b = torch.empty(16, 64, dtype=bf), torch.empty(32, 64, dtype=bf)
    assert contract_violation(consumer, a, b, [torch.empty(16, 3)]) is None
    for bad in (torch.empty(16, 3, dtype=bf), torch.empty(16), torch.empty(8, 3),
                torch.empty(3, 16).t()):
        assert "row partials" in contract_violation(consumer, a, b, [bad])


# ---- the pass in the pipeline -----------------------------------------------------------

def _captured(model, *args):
    seen = []

    def backend(gm, example_inputs):
        seen.append((gm, list(example_inputs)))
        return gm.forward
    with torch.no_grad():
        torch.compile(model, backend=backend)(*args)
    return seen


def _deferred(report) -> int:
    lines = [ln for ln in report.host_path if ln.startswith(deferred_rstd.REPORT_LINE)]
    return int(lines[0].rsplit(": ", 1)[1].split()[0]) if lines else 0


def _both(model, ids, monkeypatch, options=None):
    """(report, report without the pass, outputs with it, outputs without, the rewritten
    graph module), the same captured graph rewritten twice."""
    (gm, example), = _captured(model, ids)
    opts = options or Options(min_fused_rows=0, inductor=False)
    with_pass, without = copy.deepcopy(gm), copy.deepcopy(gm)
    report = rewrite_graph(with_pass, opts)
    with monkeypatch.context() as mp:
        mp.setattr(deferred_rstd, "defer", lambda graph, traced=False: 0)
        plain = rewrite_graph(without, opts)
    with torch.no_grad():
        return report, plain, with_pass(*example), without(*example), with_pass


def _programs(gm) -> list[EpilogueProgram]:
    from coda_rewrite.graph_utils import ROW_CALL_MARK
    return [parse(n.args[0]) for n in gm.graph.nodes
            if n.op == "call_function" and getattr(n.target, ROW_CALL_MARK, None)]


@pytest.mark.parametrize("which", ["plain", "llama", "qwen2", "mistral"])
def test_inference_graphs_defer_every_layer_and_give_the_same_values(which, monkeypatch):
    """Each norm whose producer is a GEMM and whose r only fused GEMMs read (per layer
    the post-attention norm, and the next layer's input norm) is deferred; the outputs
    are the graph's without the pass, bit for bit (reference route on the CPU)."""
    model = (plain_llama() if which == "plain" else hf_model(which)).to(bf).eval()
    report, plain, got, want, gm = _both(model, tokens(2, 16), monkeypatch)
    assert _deferred(report) >= 3 and _deferred(plain) == 0
    for g, w in zip(got, want):
        if isinstance(g, torch.Tensor):
            assert g.shape == w.shape and torch.equal(g, w)
    programs = _programs(gm)
    readers = [p for p in programs if any(i.op == "rstd_partials" for i in p.body)]
    handing = [p for p in programs if any(o.kind == Kind.ROW_PARTIALS for o in p.outputs)]
    assert len(handing) == _deferred(report) and len(readers) >= len(handing)


def test_a_training_graph_keeps_the_finaliser(monkeypatch):
    """With gradients the families' backward rules read r: no deferral, and the step's
    loss and gradients are those without the pass."""
    model = build("plain").to(bf)
    ids = tokens(2, 16)
    fast = coda_rewrite.optimize(model, fuse_in_training=True)
    loss_of(fast, "plain", ids).backward()
    assert all(_deferred(g) == 0 for g in fast.report.graphs)
    assert any(g.rewritten for g in fast.report.graphs)


def test_a_norm_whose_rstd_is_also_returned_keeps_its_finaliser(monkeypatch):
    """A reader of r that is not a fused GEMM (here the graph's output) keeps that
    producer's finaliser: all or nothing per producer; the others are still deferred."""
    import operator

    from coda_rewrite.graph_utils import ROW_CALL_MARK
    model = plain_llama().to(bf).eval()
    (gm, example), = _captured(model, tokens(2, 16))
    monkeypatch.setattr(deferred_rstd, "defer", lambda graph, traced=False: 0)
    monkeypatch.setattr(row_chains, "chain", lambda graph: 0)
    rewrite_graph(gm, Options(min_fused_rows=0, inductor=False))
    monkeypatch.undo()
    producers = [n for n in gm.graph.nodes if getattr(n.target, ROW_CALL_MARK, 0) >= 2
                 and deferred_rstd._row_scale(parse(n.args[0])) is not None]
    assert len(producers) >= 2
    leaked, text = producers[0], producers[0].args[0]
    r_index = deferred_rstd._row_scale(parse(text))[1]
    r_item = next(u for u in leaked.users if u.args[1] == r_index)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    out.args = (tuple(out.args[0]) + (r_item,),)
    assert deferred_rstd.defer(gm.graph) == len(producers) - 1
    gm.graph.lint()
    gm.recompile()
    assert leaked.args[0] == text  # kept its r and its finaliser
    assert all(u.target is operator.getitem for u in leaked.users)
    with torch.no_grad():
        r = gm(*example)[-1]
    assert r.dtype == torch.float32 and r.shape[-1] == 1


def test_a_qk_norm_consumer_keeps_the_finaliser(monkeypatch):
    """Qwen3's q/k/v GEMM folds its per-head norm in an accumulator prepass that reads r:
    no partials there (not lowerable), so that producer keeps its finaliser; the values
    are the same either way."""
    model = hf_model("qwen3").to(bf).eval()
    report, plain, got, want, gm = _both(model, tokens(2, 16), monkeypatch)
    for g, w in zip(got, want):
        if isinstance(g, torch.Tensor):
            assert torch.equal(g, w)
    qk = [p for p in _programs(gm) if any(i.op == "head_rstd" for i in p.body)]
    assert qk and all(o.kind != Kind.ROW_PARTIALS for p in qk for o in p.operands)


def test_float32_models_keep_the_finaliser(monkeypatch):
    model = plain_llama().eval()
    report, *_ = _both(model, tokens(2, 16), monkeypatch)
    assert report.rewritten and _deferred(report) == 0


@pytest.mark.parametrize("traced", ["inductor", "cudagraphs"])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_traced_graphs_defer_only_static_sizes(traced, dynamic):
    """Inductor's graphs and optimize(cudagraphs=True)'s, which AOTAutograd traces: the
    norms are deferred where every size is static (the partials' width is known at
    trace time), not where the row count is symbolic."""
    model = plain_llama().to(bf).eval()
    seen = []

    def backend(gm, example_inputs):
        seen.append(gm)
        return gm.forward
    with torch.no_grad():
        torch.compile(model, backend=backend, dynamic=dynamic)(tokens(2, 16))
    (gm,) = seen
    opts = Options(min_fused_rows=0, inductor=traced == "inductor",
                   cudagraphs=traced == "cudagraphs")
    report = rewrite_graph(gm, opts)
    assert report.rewritten
    if dynamic:
        assert _deferred(report) == 0 and "rstd_partials" not in gm.code
    else:
        assert _deferred(report) >= 3
        assert any("rstd_partials" in p for p in map(str, gm.graph.nodes)) or \
            "rstd_partials" in gm.code


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_the_backend_defers_and_gives_the_values_without_the_pass(dynamic, monkeypatch):
    """backend="coda" under no_grad (AOTAutograd traces the deferred programs, Inductor
    calls them): the logits are the backend's without the pass, bit for bit, and the
    report says how many norms were deferred (none with a symbolic row count)."""
    model = hf_model("llama").to(bf).eval()
    ids = tokens(2, 16)

    def run():  # the logits and this compile's graph reports (the session's are kept)
        torch._dynamo.reset()
        before = len(coda_rewrite.last_report().graphs)
        compiled = torch.compile(copy.deepcopy(model), backend="coda", dynamic=dynamic,
                                 options={"min_fused_rows": 0})
        with torch.no_grad():
            return compiled(ids).logits, coda_rewrite.last_report().graphs[before:]
    got, graphs = run()
    with monkeypatch.context() as mp:
        mp.setattr(deferred_rstd, "defer", lambda graph, traced=False: 0)
        want, plain = run()
    assert torch.equal(got, want)
    assert graphs and plain and sum(map(_deferred, plain)) == 0
    deferred = sum(map(_deferred, graphs))
    assert deferred == 0 if dynamic else deferred >= 3, [g.host_path for g in graphs]


@pytest.mark.provokes_pass_bug
def test_a_raising_pass_leaves_the_graph_as_it_was_and_says_so(monkeypatch):
    model = plain_llama().to(bf).eval()
    (gm, example), = _captured(model, tokens(2, 16))
    real = deferred_rstd.defer

    def half_then_raise(graph, traced=False):
        real(graph, traced)
        raise RuntimeError("provoked")
    kept = copy.deepcopy(gm)
    monkeypatch.setattr(deferred_rstd, "defer", lambda graph, traced=False: 0)
    rewrite_graph(kept, Options(min_fused_rows=0, inductor=False))
    monkeypatch.setattr(deferred_rstd, "defer", half_then_raise)
    report = rewrite_graph(gm, Options(min_fused_rows=0, inductor=False))
    assert report.rewritten and _deferred(report) == 0 and "rstd_partials" not in gm.code
    assert any(r.code == "internal_error.deferred_rstd" for r in report.records)
    with torch.no_grad():
        assert torch.equal(gm(*example)[0], kept(*example)[0])


def test_optimize_under_no_grad_matches_eager_and_says_what_it_did():
    model = hf_model("llama").to(bf).eval()
    ids = tokens(2, 16)
    fast = coda_rewrite.optimize(model)
    with torch.no_grad():
        got, want = fast(ids).logits, model(ids).logits
        ref = copy.deepcopy(model).double()(ids).logits
    assert (got.double() - ref).abs().max() <= 1.25 * (want.double() - ref).abs().max() + 1e-6
    deferred = [g for g in fast.report.graphs if _deferred(g)]
    assert deferred and f"host path: {deferred_rstd.REPORT_LINE}" in deferred[0].render()
    # the report shows the programs that run, the host step's rewrites of them included:
    # their math, their kernels, and the code names them by key (no raw program text)
    text = deferred[0].render()
    assert "rstd_partials(r_partials" in text and "row_partials" in text
    assert "RstdOfPartials" in "".join(report_kernels(deferred[0]))
    assert '{"body"' not in text


def test_many_partials_are_summed_by_the_producer_launch():
    """Past READER_FOLDS_PARTIALS the producer's launch hands on one column (the same row
    sums), at or below it the kernel's partials as they are."""
    from coda_rewrite.kernels import quack_path
    launch = quack_path.Launch.__new__(quack_path.Launch)
    launch.m = 6
    cap = quack_path.READER_FOLDS_PARTIALS
    few, many = torch.rand(6 * cap), torch.rand(6 * (cap + 1))
    assert launch._partials(few).shape == (6, cap)
    summed = launch._partials(many)
    assert summed.shape == (6, 1)
    assert torch.equal(summed, many.view(6, -1).sum(1, keepdim=True))


def test_a_call_on_tensor_parallel_shards_is_left(monkeypatch):
    """A DTensor among a call's inputs, the weights a re-layout call takes as a list
    included, keeps its producer's finaliser (a partials operand has no placement rule)."""
    import torch.fx as fx
    g = fx.Graph()
    x, w0, w1 = (g.placeholder(n) for n in ("x", "w0", "w1"))
    relaid = g.call_function(torch.add, ("program", x, "kind", "spec", [w0, w1]))
    plain = g.call_function(torch.add, ("program", x, w0))
    monkeypatch.setattr(deferred_rstd, "meta", lambda node: "shard" if node is w1 else None)
    monkeypatch.setattr(deferred_rstd.sharding, "is_dtensor", lambda m: m == "shard")
    assert deferred_rstd._sharded(relaid) and not deferred_rstd._sharded(plain)


def report_kernels(graph_report) -> list[str]:
    from coda_rewrite.report import kernel_text
    return [kernel_text(p) for p in graph_report.programs.values()]


def test_r_passed_inside_a_list_argument_keeps_the_finaliser():
    """A reader that takes r other than as a per-row program operand, here inside a list
    argument of a fused call, is not a consumer the pass can rewrite: all or nothing."""
    import operator

    import torch.fx as fx
    g = fx.Graph()
    x, w, res, gamma = (g.placeholder(n) for n in ("x", "w", "res", "gamma"))
    call = g.call_function(ops.fused_linear, (_producer().to_text(), x, w, res, gamma))
    r = g.call_function(operator.getitem, (call, 2))
    h2 = g.call_function(operator.getitem, (call, 1))
    # a row call (first operand at 5) whose r rides in the list, not in an operand slot
    from coda_rewrite.kernels.relayout import fused_linear_relaid
    user = g.call_function(fused_linear_relaid, (_consumer().to_text(), h2, "kind", "spec",
                                                 [w, r], r))
    user2 = g.call_function(ops.fused_linear, (_consumer().to_text(), h2, w, r))
    assert deferred_rstd._consumers([user], {r}, 64.0, 1e-6) is None
    assert deferred_rstd._consumers([user2], {r}, 64.0, 1e-6) is not None
