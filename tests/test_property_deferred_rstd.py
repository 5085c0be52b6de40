"""deferred_rstd.py under hypothesis: random graphs of norm producers and the fused calls
reading their r (row-scaled GEMMs with and without a bias, gated ones, one reading two
row scales), with r also read by other ops, updated in place (itself or through a view)
or returned. A producer is deferred exactly when only fused calls read its r as a
per-row operand, and every output keeps its shape and bits."""

from __future__ import annotations

import copy
import operator

import torch
import torch.fx as fx
from hypothesis import given, settings, strategies as st

from coda_rewrite import deferred_rstd
from coda_rewrite.codegen.program import Kind, ProgramBuilder
from coda_rewrite.kernels import ops

from test_deferred_rstd import _producer

bf = torch.bfloat16
WIDTH = 16
LEADS = [(6,), (2, 3), (1, 4)]


def _consumer(kind: str) -> str:
    p = ProgramBuilder(kind, gemm=True, family="rowscale")
    if kind == "rowscale":
        p.output(p.scaled_acc(True, False), Kind.TILE, "bfloat16")
    elif kind == "rowscale_bias":
        p.output(p.scaled_acc(True, True), Kind.TILE, "bfloat16")
    elif kind == "gated":
        p.output(p.swiglu(p.scaled_acc(True, False)), Kind.PAIR, "bfloat16")
    else:  # two row scales: y = acc · r · r2
        y = p.mul(p.scaled_acc(True, False), p.operand("r2", Kind.PER_ROW))
        p.output(y, Kind.TILE, "bfloat16")
    return p.build().to_text()


PICK = st.one_of(st.just(-1), st.integers(0, 99))
STEP = st.one_of(
    st.tuples(st.just("producer"), PICK, PICK),
    st.tuples(st.sampled_from(["rowscale", "rowscale_bias", "gated"]), PICK, PICK),
    st.tuples(st.just("two_scales"), PICK, PICK, PICK),
    st.tuples(st.sampled_from(["return", "mul_", "view_mul_", "read"]), PICK),
)


def _build(steps):
    """(graph module, weights it takes, how many producers only fused calls read)."""
    g = fx.Graph()
    x, gamma, bias = g.placeholder("x"), g.placeholder("gamma"), g.placeholder("bias")
    tiles, rs, outs, weights = [x], [], [], []
    readers: dict[fx.Node, list[bool]] = {}  # r -> is each reader a fused call's slot

    def weight(rows=WIDTH):
        weights.append((g.placeholder(f"w{len(weights)}"), rows))
        return weights[-1][0]

    for step in steps:
        kind = step[0]
        if kind == "producer":
            call = g.call_function(ops.fused_linear, (
                _producer(float(WIDTH)).to_text(), tiles[step[1] % len(tiles)], weight(),
                tiles[step[2] % len(tiles)], gamma))
            z, h2, r = (g.call_function(operator.getitem, (call, i)) for i in range(3))
            tiles += [z, h2]
            rs.append(r)
            readers[r] = []
        elif not rs:
            continue
        elif kind in ("rowscale", "rowscale_bias", "gated"):
            r = rs[step[2] % len(rs)]
            args = (tiles[step[1] % len(tiles)], weight(2 * WIDTH if kind == "gated"
                                                        else WIDTH), r)
            if kind == "rowscale_bias":
                args += (bias,)
            call = g.call_function(ops.fused_linear, (_consumer(kind),) + args)
            out = g.call_function(operator.getitem, (call, 0))
            (tiles if kind != "gated" else outs).append(out)
            readers[r].append(True)
        elif kind == "two_scales":
            r, r2 = rs[step[2] % len(rs)], rs[step[3] % len(rs)]
            call = g.call_function(ops.fused_linear, (
                _consumer("two"), tiles[step[1] % len(tiles)], weight(), r, r2))
            tiles.append(g.call_function(operator.getitem, (call, 0)))
            readers[r].append(True)
            readers[r2].append(True)
        else:
            r = rs[step[1] % len(rs)]
            readers[r].append(False)
            if kind == "return":
                outs.append(r)
            elif kind == "read":
                outs.append(g.call_function(operator.mul, (r, 2.0)))
            else:
                v = r if kind == "mul_" else g.call_function(
                    operator.getitem, (r, (Ellipsis, slice(0, 1))))
                g.call_method("mul_", (v, 2.0))
    g.output(tuple(tiles[1:] + outs))
    gm = fx.GraphModule(torch.nn.Module(), g)
    deferrable = sum(bool(rd) and all(rd) for rd in readers.values())
    return gm, [rows for _, rows in weights], deferrable


def _traced(gm, args) -> None:
    """Record each node's value as dynamo's example_value, as a captured graph has."""
    class Recorder(fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            n.meta["example_value"] = out
            return out
    with torch.no_grad():
        Recorder(gm).run(*args)


@settings(max_examples=60, deadline=None)
@given(steps=st.lists(STEP, min_size=2, max_size=9), lead=st.sampled_from(LEADS),
       seed=st.integers(0, 2**16))
def test_deferred_graphs_give_every_output_unchanged(steps, lead, seed):
    gm, weight_rows, deferrable = _build(steps)
    g = torch.Generator()

    def inputs():
        g.manual_seed(seed)
        return [torch.randn(*lead, WIDTH, generator=g).to(bf),
                torch.randn(WIDTH, generator=g).to(bf),
                torch.randn(WIDTH, generator=g).to(bf),
                *[torch.randn(rows, WIDTH, generator=g).to(bf) for rows in weight_rows]]
    _traced(gm, inputs())
    deferred = copy.deepcopy(gm)
    assert deferred_rstd.defer(deferred.graph) == deferrable
    deferred.graph.lint()
    deferred.recompile()
    with torch.no_grad():
        want, got = gm(*inputs()), deferred(*inputs())
    assert len(got) == len(want)
    for w, c in zip(want, got):
        assert c.shape == w.shape and c.dtype == w.dtype and torch.equal(c, w)
