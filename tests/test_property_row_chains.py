"""row_chains.py under hypothesis: random chains of fused calls (a norm without a GEMM,
row-scaled and residual GEMMs) on random leading shapes, values read between them by
graph ops, updated in place (values, through a view, and metadata) or returned: the chained graph gives
every output with the same shape, strides and bits as the unchained one."""

from __future__ import annotations

import copy
import operator

import torch
import torch.fx as fx
from hypothesis import given, settings, strategies as st

from coda_rewrite import row_chains
from coda_rewrite.kernels import ops

from test_row_chains import _norm_program, _residual_program, _rowscale_program

bf = torch.bfloat16
WIDTH = 8
LEADS = [(6,), (2, 3), (3, 2), (1, 2, 3), (2, 1, 3)]

# which value a step reads: the newest (-1) half the time, so that calls read the call
# before them, as a layer's do; else any made so far
PICK = st.one_of(st.just(-1), st.integers(0, 99))
# one step: a fused call, or a graph op on a value made so far
STEP = st.one_of(
    st.tuples(st.just("norm"), PICK),
    st.tuples(st.just("rowscale"), PICK, PICK),
    st.tuples(st.just("residual"), PICK, PICK),
    st.tuples(st.sampled_from(["mul_", "unsqueeze_", "view_mul_", "add", "read"]), PICK),
)


def _build(steps) -> tuple[fx.GraphModule, int]:
    """The graph the steps spell; returns it and how many weights it takes."""
    g = fx.Graph()
    x, gamma = g.placeholder("x"), g.placeholder("gamma")
    tiles, rows, extra, weights = [x], [], [], []

    def weight():
        weights.append(g.placeholder(f"w{len(weights)}"))
        return weights[-1]

    for step in steps:
        kind = step[0]
        if kind == "norm":
            call = g.call_function(ops.fused_rowwise,
                                   (_norm_program(), tiles[step[1] % len(tiles)], gamma))
            tiles.append(g.call_function(operator.getitem, (call, 0)))
            rows.append(g.call_function(operator.getitem, (call, 1)))
        elif kind == "rowscale" and rows:
            call = g.call_function(ops.fused_linear, (
                _rowscale_program(), tiles[step[1] % len(tiles)], weight(),
                rows[step[2] % len(rows)]))
            tiles.append(g.call_function(operator.getitem, (call, 0)))
        elif kind == "residual":
            call = g.call_function(ops.fused_linear, (
                _residual_program(), tiles[step[1] % len(tiles)], weight(),
                tiles[step[2] % len(tiles)]))
            tiles.append(g.call_function(operator.getitem, (call, 0)))
        elif kind in ("mul_", "unsqueeze_", "view_mul_"):
            pool = rows + tiles  # the newest tile last
            v = pool[step[1] % len(pool)]
            if kind == "view_mul_":  # through a view: the first column
                v = g.call_function(operator.getitem, (v, (Ellipsis, slice(0, 1))))
            g.call_method("unsqueeze_" if kind == "unsqueeze_" else "mul_",
                          (v, 0) if kind == "unsqueeze_" else (v, 2.0))
        elif kind == "add":
            extra.append(g.call_function(operator.add, (tiles[step[1] % len(tiles)], 1.0)))
        elif kind == "read":
            extra.append(g.call_method("sum", (tiles[step[1] % len(tiles)],)))
    g.output(tuple(tiles[1:] + rows + extra))
    return fx.GraphModule(torch.nn.Module(), g), len(weights)


@settings(max_examples=80, deadline=None)
@given(steps=st.lists(STEP, min_size=2, max_size=8), lead=st.sampled_from(LEADS),
       seed=st.integers(0, 2**16))
def test_chained_graphs_give_every_output_unchanged(steps, lead, seed):
    gm, n_weights = _build(steps)
    chained = copy.deepcopy(gm)
    row_chains.chain(chained.graph)
    chained.graph.lint()
    chained.recompile()
    g = torch.Generator().manual_seed(seed)

    def inputs():
        g.manual_seed(seed)
        return [torch.randn(*lead, WIDTH, generator=g).to(bf),
                torch.randn(WIDTH, generator=g).to(bf),
                *[torch.randn(WIDTH, WIDTH, generator=g).to(bf) for _ in range(n_weights)]]
    with torch.no_grad():
        try:
            want = gm(*inputs())
        except RuntimeError as e:  # a shape the steps made that no call takes: the same
            try:                   # error chained (unsqueeze_ then a residual of another
                chained(*inputs())  # lead is one)
            except RuntimeError as again:
                assert type(again) is type(e)
                return
            raise AssertionError(f"the unchained graph raised ({e}), the chained did not")
        got = chained(*inputs())
    assert len(got) == len(want)
    for w, c in zip(want, got):
        assert c.shape == w.shape and c.stride() == w.stride() and c.dtype == w.dtype
        assert torch.equal(c, w)
