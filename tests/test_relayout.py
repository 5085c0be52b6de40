"""Options(cache_relayouts=True): in inference graphs the re-laid-out weights are kept
inside the GEMM op between calls, keyed by the parameters' version counters. Same
numbers as recomputing, recomputed after every in-place update (no_grad writes,
load_state_dict), never a stale hit from another tensor, the same through Inductor (where
the kept tensor never leaves the op); training graphs recompute and say so."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings, strategies as st

import coda_rewrite
from coda_rewrite.kernels import ops, relayout
from coda_rewrite.numerics import rel_err
from coda_rewrite.codegen import layouts

from conftest import build, grads_match, hf_model, loss_of, tokens


def weights_lines(report) -> list[str]:
    return [r.weights for g in report.graphs for r in g.records if r.weights]


def rewritten(model, via: str):
    """The model through optimize() or the backend, with cache_relayouts=True; the
    report to read."""
    if via == "optimize":
        fast = coda_rewrite.optimize(model, cache_relayouts=True)
        return fast, fast.report
    backend = coda_rewrite.CodaBackend(coda_rewrite.Options(cache_relayouts=True))
    return torch.compile(model, backend=backend), backend.report


@pytest.mark.parametrize("family,via", [("llama", "optimize"), ("phi3", "optimize"),
                                        ("plain", "optimize"),
                                        pytest.param("llama", "backend",
                                                     marks=pytest.mark.inductor)])
def test_training_graphs_recompute_and_match_eager(family, via):
    model = build(family, layers=2).train()
    ref = copy.deepcopy(model)
    fast, report = rewritten(model, via)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref)]
    ids = tokens()
    for _ in range(2):
        relayout.STATS.clear()
        loss, want = loss_of(fast, family, ids), loss_of(ref, family, ids)
        assert abs(loss.item() - want.item()) <= 1e-5 * abs(want.item())
        loss.backward()
        want.backward()
        grads_match(model, ref)
        assert not relayout.STATS  # graph ops: the weights change every step
        for o in opts:
            o.step()
            o.zero_grad()
    lines = weights_lines(report)
    assert len(lines) == 4 and all("computes gradients" in w for w in lines), lines


@pytest.mark.parametrize("via", ["optimize", pytest.param("backend",
                                                           marks=pytest.mark.inductor)])
def test_inference_hits_until_a_weight_changes(via):
    """Through the backend the kept tensor never leaves the op (handed out as an op's
    output, Inductor's buffer planning could reuse its memory as scratch): the graph
    Inductor gets calls the GEMM on the source weights, and no re-layout of its own."""
    model = hf_model("qwen2", layers=2).eval()  # biases: re-laid in the graph (small)
    fast, report = rewritten(model, via)
    ids = tokens()
    with torch.no_grad():
        fast(ids)
        relayout.STATS.clear()
        assert rel_err(fast(ids).logits, model(ids).logits) <= 1e-5
        assert relayout.STATS == {"hit": 4}  # gate/up and q/k/v weights, x2 layers
        model.model.layers[1].self_attn.k_proj.weight.mul_(0.5)  # bumps its version
        model.model.layers[0].self_attn.q_proj.bias.add_(1.0)   # never kept: always live
        relayout.STATS.clear()
        assert rel_err(fast(ids).logits, model(ids).logits) <= 1e-5
        assert relayout.STATS == {"hit": 3, "miss": 1}
        model.load_state_dict(hf_model("qwen2", layers=2, seed=1).state_dict())
        relayout.STATS.clear()
        assert rel_err(fast(ids).logits, model(ids).logits) <= 1e-5
        assert relayout.STATS == {"miss": 4}
    lines = weights_lines(report)
    assert len(lines) == 4 and all("kept inside the GEMM op" in w for w in lines), lines
    code = report.graphs[0].rewritten_code
    assert code.count("relayout_fused_linear_relaid(") == 4, code
    # no weight re-laid in the graph: only q/k/v's biases (small), one per layer
    assert "layouts_interleave_rows(" not in code and code.count("layouts_rope_segments(") == 2, code


def test_no_stale_hit_from_a_new_model_of_the_same_shapes():
    ids = tokens()
    outs = []
    for seed in range(2):
        model = hf_model("llama", layers=1, seed=seed).eval()
        fast = coda_rewrite.optimize(model, cache_relayouts=True)
        with torch.no_grad():
            outs.append((fast(ids).logits, model(ids).logits))
        del model, fast
    for got, want in outs:
        assert rel_err(got, want) <= 1e-5


def test_a_model_made_under_inference_mode():
    """Inference tensors have no version counter (and inference mode may update them in
    place unseen): nothing is kept for them, the frequencies memo included; the numbers
    are eager's."""
    with torch.inference_mode():
        model = hf_model("llama", layers=1).eval()
        ids = tokens()
        want = model(ids).logits
        fast = coda_rewrite.optimize(model, cache_relayouts=True)
        fast(ids)
        relayout.STATS.clear()
        got = fast(ids).logits
    assert rel_err(got, want) <= 1e-5
    assert relayout.STATS == {"not kept": 2}


def test_the_op_is_the_gemm_on_the_kept_weights():
    """coda::gemm_relaid = coda::gemm_epilogue on the re-layout, in the GEMM's dtype
    (float32 weights under a bfloat16 GEMM: the cast is kept too); it has no gradient
    formula, and the rewrite calls it only where none is needed."""
    from coda_rewrite.patterns.rope import rope_program

    lay = ((0, 16, 2, 8, 8), (0, 8, 1, 8, 8), (0, 8, 0, 0, 0))
    ws = [torch.randn(n, 12) for n in (16, 8, 8)]
    a = torch.randn(5, 12, dtype=torch.bfloat16)
    prog = rope_program(False, False, False, torch.bfloat16)
    pos, freq = torch.arange(5.0), layouts.rope_frequencies(torch.rand(4), lay)
    spec = relayout.spec_of(lay)
    relayout.STATS.clear()
    got = torch.ops.coda.gemm_relaid(prog.to_text(), a, "rope_segments", spec, ws, [pos, freq])
    want = ops.gemm_epilogue(prog.to_text(), a, layouts.rope_segments(lay, *ws).bfloat16(),
                             [pos, freq])
    assert torch.equal(got[0], want[0])
    torch.ops.coda.gemm_relaid(prog.to_text(), a, "rope_segments", spec, ws, [pos, freq])
    assert relayout.STATS == {"miss": 1, "hit": 1}
    w = ws[0].requires_grad_()
    with pytest.raises(RuntimeError, match="[Aa]utograd"):
        out = torch.ops.coda.gemm_relaid(prog.to_text(), a, "rope_segments", spec,
                                         [w, *ws[1:]], [pos, freq])
        out[0].sum().backward()


def test_the_graph_calls_the_ops_kernel_as_a_function_where_it_may(monkeypatch):
    """fused_linear_relaid with real tensors and no gradient to record calls the op's
    kernel directly (the op boundary is host time a decode step pays); a traced call
    (fake tensors) goes through the op, whose fake gives the shapes."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from coda_rewrite.patterns.rope import rope_program

    lay = ((0, 16, 2, 8, 8), (0, 8, 1, 8, 8), (0, 8, 0, 0, 0))
    ws = [torch.randn(n, 12).requires_grad_() for n in (16, 8, 8)]
    x = torch.randn(1, 5, 12, dtype=torch.bfloat16)
    prog = rope_program(False, False, False, torch.bfloat16).to_text()
    pos, freq = torch.arange(5.0), layouts.rope_frequencies(torch.rand(4), lay)
    spec = relayout.spec_of(lay)
    direct = []
    real = relayout.gemm_relaid
    monkeypatch.setattr(relayout, "gemm_relaid",
                        lambda *args: direct.append(1) or real(*args))
    with torch.no_grad():
        got = relayout.fused_linear_relaid(prog, x, "rope_segments", spec, ws, pos, freq)
        want = torch.ops.coda.gemm_relaid(prog, x[0], "rope_segments", spec, ws, [pos, freq])
    assert direct == [1] and torch.equal(got[0][0], want[0])
    direct.clear()
    with FakeTensorMode(allow_non_fake_inputs=True) as mode, torch.no_grad():
        fake = relayout.fused_linear_relaid(prog, mode.from_tensor(x), "rope_segments", spec,
                                            [mode.from_tensor(w) for w in ws],
                                            mode.from_tensor(pos), mode.from_tensor(freq))
    assert not direct and fake[0].shape == got[0].shape


def test_a_current_kept_re_layout_goes_straight_to_the_fused_gemm(monkeypatch):
    """Under no_grad, a call whose kept re-layout is current (versioned.peek: each
    source's version, pointer and metadata as when it was made) is ops.fused_linear on
    it, skipping the op's argument handling (host time every decode step pays). An
    in-place update, a swapped ``.data``, another source tensor, or grad mode take the
    full call, which makes the re-layout again (or refuses a gradient)."""
    from coda_rewrite.patterns.rope import rope_program

    lay = ((0, 16, 2, 8, 8), (0, 8, 1, 8, 8), (0, 8, 0, 0, 0))
    ws = [torch.randn(n, 12) for n in (16, 8, 8)]
    x = torch.randn(1, 5, 12, dtype=torch.bfloat16)
    prog = rope_program(False, False, False, torch.bfloat16).to_text()
    pos, freq = torch.arange(5.0), layouts.rope_frequencies(torch.rand(4), lay)
    spec = relayout.spec_of(lay)
    full, straight = [], []
    real_full, real_linear = relayout.gemm_relaid, ops.fused_linear
    monkeypatch.setattr(relayout, "gemm_relaid",
                        lambda *args: full.append(1) or real_full(*args))
    monkeypatch.setattr(ops, "fused_linear",
                        lambda *args: straight.append(args[2]) or real_linear(*args))

    def call(sources):
        return relayout.fused_linear_relaid(prog, x, "rope_segments", spec, sources,
                                            pos, freq)[0]

    def eager(sources):
        b = layouts.rope_segments(lay, *sources).bfloat16()
        return ops.gemm_epilogue(prog, x[0], b, [pos, freq])[0].unsqueeze(0)

    with torch.no_grad():
        assert torch.equal(call(ws), eager(ws)) and (len(full), len(straight)) == (1, 0)
        assert torch.equal(call(ws), eager(ws)) and (len(full), len(straight)) == (1, 1)
        assert straight[0] is getattr(ws[0], relayout._ATTR)[1]  # the kept tensor itself
        ws[1].mul_(0.5)  # bumps its version
        assert torch.equal(call(ws), eager(ws)) and (len(full), len(straight)) == (2, 1)
        ws[2].data = ws[2].data.clone() + 1  # same version, another pointer
        assert torch.equal(call(ws), eager(ws)) and (len(full), len(straight)) == (3, 1)
        other = [w.clone() - 1 for w in ws]  # other tensors, their own (empty) slot
        assert torch.equal(call(other), eager(other)) and (len(full), len(straight)) == (4, 1)
        assert torch.equal(call(ws), eager(ws)) and (len(full), len(straight)) == (4, 2)
    call(ws)  # grad mode: the op's full call, though nothing requires grad
    assert (len(full), len(straight)) == (5, 2)
    ws[0].requires_grad_()
    with pytest.raises(RuntimeError, match="[Aa]utograd"):
        call(ws)
    assert len(straight) == 2


def test_bias_on_q_only_trains_with_the_option_set():
    """q has a bias, k and v do not: the fused bias (zeros for k and v) passes its
    gradient to q's."""
    from test_rope import ChunkSpelling

    m = ChunkSpelling().train()
    ref = copy.deepcopy(m)
    fast = coda_rewrite.optimize(m, cache_relayouts=True)
    x = torch.randn(2, 6, 32)
    got, want = fast(x), ref(x)
    assert rel_err(got, want) <= 1e-5
    got.square().sum().backward()
    want.square().sum().backward()
    for (name, p), (_, q) in zip(m.named_parameters(), ref.named_parameters()):
        assert p.grad is not None and rel_err(p.grad, q.grad) <= 1e-4, name


@pytest.mark.parametrize("via", ["optimize", "backend"])
def test_training_keeps_no_copy_of_the_relaid_weights(via):
    """In training the fused GEMM over interleaved gate/up and permuted q/k/v takes the
    source weights and makes the re-layout in its forward and again in its backward:
    autograd keeps no [2·ffn, hidden] or [q + k + v, hidden] copy (one per layer, alive
    until the backward, otherwise); the gradients still match eager's."""
    model = hf_model("llama", layers=1).train()
    ref = copy.deepcopy(model)
    fast = coda_rewrite.optimize(model) if via == "optimize" else \
        torch.compile(model, backend="coda")
    cfg = model.config
    hd = cfg.hidden_size // cfg.num_attention_heads
    relaid = {(2 * cfg.intermediate_size, cfg.hidden_size),
              ((cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * hd, cfg.hidden_size)}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = []

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved.append(tuple(t.shape))
        return t

    ids = tokens()
    loss_of(fast, "llama", ids)  # compile outside the count
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_of(fast, "llama", ids)
    assert not relaid & set(saved), sorted(relaid & set(saved))
    loss.backward()
    loss_of(ref, "llama", ids).backward()
    grads_match(model, ref)


@pytest.mark.parametrize("family,via", [("llama", "optimize"), ("phi3", "optimize"),
                                        pytest.param("llama", "backend",
                                                     marks=pytest.mark.inductor)])
def test_source_gradients_arrive_in_the_parameters_layout(family, via):
    """The re-layout's backward hands AccumulateGrad each source's gradient with the
    parameter's strides (interleave_rows' de-interleave is every other row of one
    [2I, K] gradient: as views, each accumulation step would copy or add it with a
    strided kernel); over two accumulated steps the gradients match eager's."""
    model = build(family, layers=1).train()
    ref = copy.deepcopy(model)
    fast, report = rewritten(model, via)
    strided = []
    for name, p in model.named_parameters():
        p.register_hook(lambda g, name=name, p=p: strided.append(name)
                        if g.stride() != p.stride() else None)
    for _ in range(2):  # the second step adds to the kept .grad
        ids = tokens()
        loss_of(fast, family, ids).backward()
        loss_of(ref, family, ids).backward()
    assert not strided, strided
    grads_match(model, ref)
    assert any(r.pattern == "gated_mlp" and r.status == "rewritten"
               for g in report.graphs for r in g.records)


class _RMSNorm(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class _ViewedGatedMLP(torch.nn.Module):
    """A pre-norm SwiGLU block whose gate and up weights reach F.linear as views: two
    chunks of one packed parameter (``w13.chunk(2)``, as fused-QKV-style code keeps
    them), every other row of one (``w[0::2]``, a non-dense view), the gate stored
    transposed (``wg_t.t()``, a [K, I] parameter), or one weight read twice (tied: its
    gradient is the sum of both sources')."""

    def __init__(self, spelling, dim=32, inter=64):
        super().__init__()
        self.spelling, self.norm = spelling, _RMSNorm(dim)
        if spelling in ("packed chunks", "strided rows"):
            self.w13 = torch.nn.Parameter(torch.randn(2 * inter, dim) / dim ** 0.5)
        else:
            self.wu = torch.nn.Parameter(torch.randn(inter, dim) / dim ** 0.5)
        if spelling == "transposed gate":
            self.wg_t = torch.nn.Parameter(torch.randn(dim, inter) / dim ** 0.5)
        self.w2 = torch.nn.Parameter(torch.randn(dim, inter) / inter ** 0.5)

    def forward(self, x):
        h = self.norm(x)
        gate, up = {"packed chunks": lambda: self.w13.chunk(2),
                    "strided rows": lambda: (self.w13[0::2], self.w13[1::2]),
                    "transposed gate": lambda: (self.wg_t.t(), self.wu),
                    "one weight twice": lambda: (self.wu, self.wu)}[self.spelling]()
        lin = torch.nn.functional.linear
        return x + lin(torch.nn.functional.silu(lin(h, gate)) * lin(h, up), self.w2)


@pytest.mark.parametrize("via", ["optimize", pytest.param("backend",
                                                          marks=pytest.mark.inductor)])
@pytest.mark.parametrize("spelling", ["packed chunks", "strided rows", "transposed gate",
                                      "one weight twice"])
def test_viewed_sources_hand_their_parameters_its_layout(spelling, via):
    """Look-alikes of the llama case: the re-laid sources are views of the parameters.
    Each gradient reaches its parameter with the parameter's strides (a transposed gate
    got every other column of the de-interleave, strides (1, 2K), before the source's
    own strides were kept) and matches eager's over two accumulated steps."""
    model = _ViewedGatedMLP(spelling).train()
    ref = copy.deepcopy(model)
    fast, report = rewritten(model, via)
    strided = []
    for name, p in model.named_parameters():
        p.register_hook(lambda g, name=name, p=p: strided.append((name, g.stride()))
                        if g.stride() != p.stride() else None)
    for _ in range(2):
        x = torch.randn(4, 8, 32)
        fast(x).square().mean().backward()
        ref(x).square().mean().backward()
    assert not strided, strided
    grads_match(model, ref)
    assert any(r.pattern == "gated_mlp" and r.status == "rewritten"
               for g in report.graphs for r in g.records)


def test_the_training_op_has_its_gradient_only_through_its_function():
    """coda::gemm_relaid_recomputed has no autograd formula: called where a gradient can
    be recorded it refuses (never a silently missing gradient), the fake too (at trace
    time); through RelaidRecomputed the sources get the re-layout's gradient."""
    from coda_rewrite.patterns.gated_mlp import gated_program
    from torch._subclasses.fake_tensor import FakeTensorMode
    text = gated_program("swiglu", False, False, torch.float32, keep_preact=True).to_text()
    a = torch.randn(5, 12)
    wg, wu = (torch.randn(8, 12, requires_grad=True) for _ in range(2))
    with pytest.raises(RuntimeError, match="no autograd formula"):
        torch.ops.coda.gemm_relaid_recomputed(text, a, "interleave_rows", "", [wg, wu], [])
    with FakeTensorMode(), pytest.raises(RuntimeError, match="no autograd formula"):
        fa, fg, fu = torch.empty(5, 12), torch.empty(8, 12).requires_grad_(), \
            torch.empty(8, 12).requires_grad_()
        torch.ops.coda.gemm_relaid_recomputed(text, fa, "interleave_rows", "", [fg, fu], [])
    y, _ = relayout.RelaidRecomputed.apply(text, a, "interleave_rows", "", 2, wg, wu)
    got = torch.autograd.grad(y.sum(), [wg, wu])
    want = torch.autograd.grad((torch.nn.functional.silu(a @ wg.T) * (a @ wu.T)).sum(),
                               [wg, wu])
    for g, w in zip(got, want):
        assert rel_err(g, w) <= 1e-5


_SOURCE_CHANGES = st.sampled_from(["call", "in place", "new storage", "other tensors",
                                   "float32 view", "grad mode"])


@settings(max_examples=40, deadline=None)
@given(steps=st.lists(st.tuples(_SOURCE_CHANGES, st.integers(0, 2)), min_size=1,
                      max_size=12))
def test_kept_re_layouts_never_serve_a_stale_weight(steps):
    """Random sequences of calls and source changes (an in-place update of one source,
    a new storage under one source, a call on other tensors, a call in another dtype, a
    call in grad mode): every call of fused_linear_relaid gives the re-layout of the
    sources as they are now, bit for bit, whichever path served it (the kept tensor
    straight to fused_linear, or the op's full call)."""
    from coda_rewrite.patterns.rope import rope_program

    lay = ((0, 16, 2, 8, 8), (0, 8, 1, 8, 8), (0, 8, 0, 0, 0))
    spec = relayout.spec_of(lay)
    gen = torch.Generator().manual_seed(len(steps))
    ws = [torch.randn(n, 12, generator=gen) for n in (16, 8, 8)]
    pos = torch.arange(5.0)
    freq = layouts.rope_frequencies(torch.rand(4, generator=gen), lay)

    def check(sources, dtype):
        x = torch.randn(1, 5, 12, generator=gen).to(dtype)
        prog = rope_program(False, False, False, dtype).to_text()
        got = relayout.fused_linear_relaid(prog, x, "rope_segments", spec, sources,
                                           pos, freq)[0]
        b = layouts.rope_segments(lay, *sources).to(dtype)
        want = ops.gemm_epilogue(prog, x[0], b, [pos, freq])[0].unsqueeze(0)
        assert torch.equal(got, want)

    for what, i in steps:
        with torch.no_grad():
            if what == "in place":
                ws[i].mul_(-0.5)
            elif what == "new storage":
                ws[i].data = ws[i].data.clone() + 1
            if what == "other tensors":
                check([w.clone() * 2 for w in ws], torch.bfloat16)
            elif what == "float32 view":
                check(ws, torch.float32)
            elif what != "grad mode":
                check(ws, torch.bfloat16)
        if what == "grad mode":  # nothing requires grad: the op's full call
            check(ws, torch.bfloat16)
