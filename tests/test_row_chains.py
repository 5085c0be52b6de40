"""row_chains.py: fused calls hand each other their 2-D results in graphs that run as
Python; the values, their shapes and what reads or updates them are as before."""

from __future__ import annotations

import copy
import operator

import pytest
import torch
import torch.fx as fx

import coda_rewrite
from coda_rewrite import row_chains
from coda_rewrite.codegen import layouts
from coda_rewrite.codegen.program import ACC, Kind, ProgramBuilder
from coda_rewrite.kernels import ops
from coda_rewrite.options import Options
from coda_rewrite.pipeline import rewrite_graph

from conftest import hf_model, plain_llama, tokens

bf = torch.bfloat16


def _norm_program() -> str:
    """rmsnorm_rowscale's shape: h2 = x·γ (tile), r (per row); no GEMM."""
    p = ProgramBuilder("norm", gemm=False)
    x, gamma = p.operand("x", Kind.TILE), p.operand("gamma", Kind.PER_FEATURE)
    h2 = p.mul(x, gamma, name="h2")
    r = p.rsqrt(p.add(p.div(p.row_sum(p.square(x), name="ss"), 8.0), 1e-6), name="r")
    p.output(h2, Kind.TILE, "bfloat16")
    p.output(r, Kind.PER_ROW, "float32")
    return p.build().to_text()


def _rowscale_program() -> str:
    """y = acc·r (tile), and r itself again as a per-row output."""
    p = ProgramBuilder("rowscale", gemm=True)
    r = p.operand("r", Kind.PER_ROW)
    p.output(p.mul(ACC, r, name="y"), Kind.TILE, "bfloat16")
    return p.build().to_text()


def _residual_program() -> str:
    """z = acc + residual (a tile operand), one output."""
    p = ProgramBuilder("residual", gemm=True)
    res = p.operand("residual", Kind.TILE)
    p.output(p.add(ACC, res, name="z"), Kind.TILE, "bfloat16")
    return p.build().to_text()


def _chain_graph(between=None) -> fx.GraphModule:
    """x → norm (h2, r) → [between(h2)] → rowscale GEMM (h2, r) → residual GEMM (its
    result, residual x) → output: three fused calls, each reading the one before."""
    g = fx.Graph()
    x, gamma, w1, w2 = (g.placeholder(n) for n in ("x", "gamma", "w1", "w2"))
    norm = g.call_function(ops.fused_rowwise, (_norm_program(), x, gamma))
    h2 = g.call_function(operator.getitem, (norm, 0))
    r = g.call_function(operator.getitem, (norm, 1))
    if between is not None:
        between(g, h2)
    lin = g.call_function(ops.fused_linear, (_rowscale_program(), h2, w1, r))
    y = g.call_function(operator.getitem, (lin, 0))
    res = g.call_function(ops.fused_linear, (_residual_program(), y, w2, x))
    z = g.call_function(operator.getitem, (res, 0))
    g.output((z, h2, r))
    return fx.GraphModule(torch.nn.Module(), g)


def _inputs(lead=(2, 3)):
    return (torch.randn(*lead, 8, dtype=bf), torch.randn(8, dtype=bf),
            torch.randn(8, 8, dtype=bf), torch.randn(8, 8, dtype=bf))


def _run_both(gm: fx.GraphModule, args):
    """(outputs without the pass, outputs with it, how many inputs it fed)."""
    chained = copy.deepcopy(gm)
    fed = row_chains.chain(chained.graph)
    chained.graph.lint()
    chained.recompile()
    with torch.no_grad():
        return gm(*args), chained(*args), fed, chained


def _reshapes(gm) -> int:
    return sum(n.target in (layouts.as_rows, layouts.as_row_vector, layouts.from_rows)
               for n in gm.graph.nodes)


@pytest.mark.parametrize("lead", [(2, 3), (6,), (1, 2, 3)])
def test_chained_calls_give_the_same_values_shapes_and_strides(lead):
    gm = _chain_graph()
    want, got, fed, chained = _run_both(gm, _inputs(lead))
    assert fed == 3  # h2 and r into the GEMM, its result into the next one
    for w, g in zip(want, got):
        assert g.shape == w.shape and g.stride() == w.stride() and g.dtype == w.dtype
        assert torch.equal(g, w)
    # the reshapes in: the chain's input and the last call's residual (x again, read by
    # a call in the op's form); out: the graph's three outputs
    targets = [n.target for n in chained.graph.nodes]
    assert targets.count(layouts.as_rows) == 2 and targets.count(layouts.from_rows) == 3


def test_a_value_updated_in_place_between_calls_stays_out_of_the_chain():
    """A metadata change in place (unsqueeze_) on the value the next call reads: the call
    must see the changed tensor (its outputs get the new lead), as without the pass."""
    def unsqueeze(g, h2):
        g.call_method("unsqueeze_", (h2, 0))
    gm = _chain_graph(unsqueeze)
    want, got, fed, chained = _run_both(gm, _inputs())
    assert fed == 2  # r and the GEMM's result; not h2
    for w, g in zip(want, got):
        assert g.shape == w.shape and torch.equal(g, w)
    assert want[0].shape == (1, 2, 3, 8)


def test_a_value_updated_through_a_view_stays_out_of_the_chain():
    """mul_ on a view of the norm's output: the update reaches every reader, and the
    value is not chained (graph_utils.memory_sharers, as the families' checks use)."""
    def scale_a_column(g, h2):
        g.call_method("mul_", (g.call_function(operator.getitem,
                                               (h2, (Ellipsis, slice(0, 1)))), 2.0))
    want, got, fed, _ = _run_both(_chain_graph(scale_a_column), _inputs())
    assert fed == 2  # r and the GEMM's result; not h2
    for w, g in zip(want, got):
        assert torch.equal(g, w)


def test_a_value_updated_in_place_keeps_the_update_for_every_reader():
    """mul_ on the norm's output before the GEMM reads it: one storage, as before."""
    def scale(g, h2):
        g.call_method("mul_", (h2, 2.0))
    want, got, fed, _ = _run_both(_chain_graph(scale), _inputs())
    assert fed == 2
    for w, g in zip(want, got):
        assert torch.equal(g, w)


def test_a_per_row_result_never_fills_a_tile_slot():
    """The norm's r (per row) as the residual GEMM's tile operand: a shape eager
    broadcasts, the op's per-row [M] cannot stand in for: not chained."""
    g = fx.Graph()
    x, gamma, w = (g.placeholder(n) for n in ("x", "gamma", "w"))
    norm = g.call_function(ops.fused_rowwise, (_norm_program(), x, gamma))
    h2 = g.call_function(operator.getitem, (norm, 0))
    r = g.call_function(operator.getitem, (norm, 1))
    wide = g.call_method("expand", (r, 2, 3, 8))
    res = g.call_function(ops.fused_linear, (_residual_program(), h2, w, wide))
    g.output((g.call_function(operator.getitem, (res, 0)), r))
    gm = fx.GraphModule(torch.nn.Module(), g)
    x, gamma, w, _ = _inputs()
    want, got, fed, chained = _run_both(gm, (x, gamma, w))
    assert fed == 1  # h2 only
    for a, b in zip(want, got):
        assert a.shape == b.shape and torch.equal(a, b)


def test_a_call_read_other_than_by_index_is_left_alone():
    g = fx.Graph()
    x, gamma = g.placeholder("x"), g.placeholder("gamma")
    norm = g.call_function(ops.fused_rowwise, (_norm_program(), x, gamma))
    g.output((norm,))
    gm = fx.GraphModule(torch.nn.Module(), g)
    x, gamma, _, _ = _inputs()
    want, got, fed, chained = _run_both(gm, (x, gamma))
    assert fed == 0 and _reshapes(chained) == 0
    assert all(torch.equal(a, b) for a, b in zip(want[0], got[0]))


def _captured(model, *args):
    seen = []

    def backend(gm, example_inputs):
        seen.append((gm, list(example_inputs)))
        return gm.forward
    torch.compile(model, backend=backend)(*args)
    return seen


@pytest.mark.parametrize("which", ["plain", "hf"])
def test_a_rewritten_llama_gives_the_same_logits_chained_or_not(which, monkeypatch):
    """The pipeline runs the pass on graphs not handed to Inductor; the logits are the
    unchained graph's, bit for bit (the same reference ops on the same values), and
    the report says how many inputs came without a reshape."""
    if which == "plain":
        model, ids = plain_llama(), tokens(2, 16)
    else:
        model, ids = hf_model("llama"), tokens(2, 16)
    model = model.to(bf).eval()
    (gm, example), = _captured(model, ids)
    opts = Options(min_fused_rows=0, inductor=False)
    chained, plain = copy.deepcopy(gm), copy.deepcopy(gm)
    report = rewrite_graph(chained, opts)
    monkeypatch.setattr(row_chains, "chain", lambda graph: 0)
    unchained = rewrite_graph(plain, opts)
    assert report.host_path and report.host_path[0].startswith(row_chains.REPORT_LINE)
    assert not any(line.startswith(row_chains.REPORT_LINE) for line in unchained.host_path)
    with torch.no_grad():
        for a, b in zip(plain(*example), chained(*example)):
            if isinstance(a, torch.Tensor):
                assert a.shape == b.shape and torch.equal(a, b)
    fed = int(report.host_path[0].rsplit(": ", 1)[1].split()[0])
    assert fed >= 3  # a layer's norm producer: z, h2, r to the next GEMMs


def test_graphs_for_inductor_are_not_chained():
    model, ids = plain_llama().to(bf).eval(), tokens(2, 16)
    (gm, _), = _captured(model, ids)
    report = rewrite_graph(gm, Options(min_fused_rows=0, inductor=True))
    assert not report.host_path and _reshapes(gm) == 0


@pytest.mark.provokes_pass_bug
def test_a_raising_chain_leaves_the_rewrites_and_says_so(monkeypatch):
    model, ids = plain_llama().to(bf).eval(), tokens(2, 16)
    (gm, example), = _captured(model, ids)
    real = row_chains.chain

    def half_then_raise(graph):
        real(graph)
        raise RuntimeError("provoked")
    unchained = copy.deepcopy(gm)
    monkeypatch.setattr(row_chains, "chain", lambda graph: 0)
    rewrite_graph(unchained, Options(min_fused_rows=0, inductor=False))
    monkeypatch.setattr(row_chains, "chain", half_then_raise)
    report = rewrite_graph(gm, Options(min_fused_rows=0, inductor=False))
    assert report.rewritten and _reshapes(gm) == 0
    assert not any(line.startswith(row_chains.REPORT_LINE) for line in report.host_path)
    assert any(r.code == "internal_error.row_chains" for r in report.records)
    with torch.no_grad():  # the rewritten graph as the families made it, bit for bit
        assert torch.equal(gm(*example)[0], unchained(*example)[0])


def test_optimize_through_the_chain_matches_eager():
    model, ids = plain_llama().to(bf).eval(), tokens(2, 16)
    fast = coda_rewrite.optimize(model)
    with torch.no_grad():
        got, want = fast(ids), model(ids)
    ref = model.double()(ids)
    assert (got.double() - ref).abs().max() <= 1.25 * (want.double() - ref).abs().max() + 1e-6


def test_operands_no_fused_call_made_are_flattened_in_the_graph():
    """A per-row operand from outside the chain ([*lead, 1], the model's shape) goes in
    through as_row_vector, so the call comes wholly in the op's form; same values."""
    g = fx.Graph()
    x, gamma, w1, r_in = (g.placeholder(n) for n in ("x", "gamma", "w1", "r_in"))
    norm = g.call_function(ops.fused_rowwise, (_norm_program(), x, gamma))
    h2 = g.call_function(operator.getitem, (norm, 0))
    lin = g.call_function(ops.fused_linear, (_rowscale_program(), h2, w1, r_in))
    g.output((g.call_function(operator.getitem, (lin, 0)),))
    gm = fx.GraphModule(torch.nn.Module(), g)
    x, gamma, w1, _ = _inputs()
    want, got, fed, chained = _run_both(gm, (x, gamma, w1, torch.rand(2, 3, 1)))
    assert fed == 1 and torch.equal(want[0], got[0]) and want[0].shape == got[0].shape
    assert sum(n.target is layouts.as_row_vector for n in chained.graph.nodes) == 1


@pytest.mark.parametrize("family", ["plain", "llama"])
def test_a_training_step_gives_the_same_gradients_chained_or_not(family, monkeypatch):
    """optimize() with gradients (every family fused in training): the loss and every
    parameter's gradient through the chained graph are the unchained graph's, bit for
    bit (autograd reshapes the gradients back as the calls did)."""
    from conftest import build, loss_of
    model = build(family).to(bf)
    ids = tokens(2, 16)

    def step(m):
        fast = coda_rewrite.optimize(m)
        loss = loss_of(fast, family, ids)
        loss.backward()
        return loss, {n: p.grad for n, p in m.named_parameters()}, fast.report
    twin = copy.deepcopy(model)
    loss, grads, report = step(model)
    torch._dynamo.reset()
    monkeypatch.setattr(row_chains, "chain", lambda graph: 0)
    loss2, grads2, report2 = step(twin)
    assert any(g.host_path for g in report.graphs) and not any(g.host_path for g in report2.graphs)
    assert torch.equal(loss, loss2)
    for name, g in grads.items():
        assert g is not None and torch.equal(g, grads2[name]), name
