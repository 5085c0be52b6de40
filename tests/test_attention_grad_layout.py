"""The attention-backward guard (coda_rewrite/attention_grad_layout.py): every SDPA output
in a graph that may train on CUDA hands its gradient to SDPA's backward as dense
[b, s, h, d], 16-byte aligned, whatever the code after it did; nothing else changes.

The bug it keeps away is in PyTorch's cuDNN attention backward and shows only on the GPU
(tests/gpu: test_attention_grad_layout_*); here the guard is placed on CPU graphs too
(``at_risk`` patched), so that what it does is checked everywhere: which nodes it takes,
that the gradients are eager's, that the re-laid layout reaches the backward op under
eager FX and under Inductor, and that inference graphs are left alone."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import coda_rewrite
from coda_rewrite import attention_grad_layout as guard
from coda_rewrite.backend import CodaBackend
from coda_rewrite.kernels import ops
from coda_rewrite.options import Options


def _bshd(b, h, s, d, **kw):
    return torch.randn(b, s, h, d, **kw).transpose(1, 2)


def test_canonical_grad_leaves_the_common_layout_alone():
    """dense [b, s, h, d] seen as [b, h, s, d] (what o.transpose(1, 2).contiguous()
    gives back), also with size-1 dims whose strides are anything, and non-4-D tensors."""
    assert guard.canonical_grad(_bshd(2, 4, 8, 16)) is None
    one_head = torch.randn(2, 8, 16).unsqueeze(1)  # h = 1: its stride is never used
    assert guard.canonical_grad(one_head) is None
    assert guard.canonical_grad(torch.randn(1, 4, 8, 16).transpose(1, 2).transpose(1, 2)) \
        is not None  # [b, h, s, d] contiguous with b = 1 is still another layout
    assert guard.canonical_grad(torch.randn(8, 16)) is None
    assert guard.canonical_grad(torch.randn(3, 8, 16)) is None


@pytest.mark.parametrize("make", [
    lambda: torch.randn(2, 4, 8, 16),                                   # [b, h, s, d]
    lambda: torch.randn(2, 8, 4, 32)[..., :16].transpose(1, 2),        # padded rows
    lambda: torch.randn(2 * 8 * 4 * 16 + 1)[1:].view(2, 8, 4, 16).transpose(1, 2),  # 4 B off
    lambda: torch.randn(2, 16, 8, 4).permute(0, 3, 2, 1),              # d not unit-stride
], ids=["bhsd", "padded", "misaligned", "strided_d"])
def test_canonical_grad_relays_every_other_layout(make):
    grad = make()
    out = guard.canonical_grad(grad)
    assert out is not None and torch.equal(out, grad)
    b, h, s, d = grad.shape
    assert out.stride() == (s * h * d, d, h * d, 1) and out.data_ptr() % 16 == 0
    assert guard.canonical_grad(out) is None


def _fake(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True):
    with FakeTensorMode(allow_non_fake_inputs=True):
        return torch.empty(shape, device=device, dtype=dtype, requires_grad=requires_grad)


@pytest.mark.parametrize("value,risk", [
    (_fake((2, 4, 8, 16)), True),
    (_fake((2, 4, 8, 16), dtype=torch.float16), True),
    (_fake((2, 4, 8, 16), device="cpu"), False),                  # no cuDNN on the CPU
    (_fake((2, 4, 8, 16), requires_grad=False), False),           # inference
    (_fake((2, 4, 8, 16), dtype=torch.float32), False),           # cuDNN takes 16-bit only
    (_fake((4, 8, 16)), False),                                    # cuDNN takes 4-D only
    (None, True),                                                  # unknown: guarded
])
def test_at_risk(value, risk):
    graph = torch.fx.Graph()
    node = graph.call_function(F.scaled_dot_product_attention, ())
    if value is not None:
        node.meta["example_value"] = value
    assert guard.at_risk(node) is risk


class Attention(nn.Module):
    """q, k, v from one projection, SDPA, the output projection; ``differential``: the
    output's two head halves are combined first (as differential attention does), so
    the gradient SDPA's backward gets is [b, h, s, d] contiguous, not the common layout."""

    def __init__(self, dim=64, heads=4, differential=False):
        super().__init__()
        self.qkv, self.o = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.heads, self.differential = heads, differential

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if self.differential:
            o1, o2 = o.chunk(2, dim=1)
            o = torch.cat([o1 - 0.5 * o2, o2 + o1], dim=1)
        return self.o(o.transpose(1, 2).reshape(b, s, -1))


@pytest.fixture
def everywhere(monkeypatch):
    """The guard placed on CPU graphs too (on the GPU only CUDA 16-bit ones need it)."""
    monkeypatch.setattr(guard, "at_risk", lambda node: True)


def _step(model, x):
    x = x.clone().requires_grad_(True)
    model(x).square().mean().backward()
    return [x.grad] + [p.grad for p in model.parameters()]


@pytest.mark.parametrize("differential", [False, True])
def test_guarded_graph_trains_as_eager(everywhere, differential):
    """The guard in the graph, in the report, and the gradients eager's; the gradient is
    re-laid only where the code after SDPA left it in another layout."""
    torch.manual_seed(0)
    model, x = Attention(differential=differential), torch.randn(2, 16, 64)
    eager = copy.deepcopy(model)
    backend = CodaBackend(Options(inductor=False))
    torch._dynamo.reset()
    before = sum(n for (key, *_), n in ops.runtime_counts().items()
                 if key == "attention_grad_layout")
    got = _step(torch.compile(model, backend=backend), x)
    want = _step(eager, x)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    assert "keep_grad_layout" in backend.report.graphs[0].rewritten_code
    assert "guard: attention backward" in str(backend.report)
    relaid = sum(n for (key, *_), n in ops.runtime_counts().items()
                 if key == "attention_grad_layout") - before
    assert relaid == (1 if differential else 0)


def test_inference_graph_is_not_guarded():
    """Under no_grad nothing requires grad: the graph has no guard and the report no line
    (the decode host path pays nothing), on any device."""
    model = Attention()
    backend = CodaBackend(Options(inductor=False))
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=backend)(torch.randn(2, 16, 64))
    assert "keep_grad_layout" not in backend.report.graphs[0].rewritten_code
    assert backend.report.graphs[0].guards == []


def test_cpu_training_graph_is_not_guarded():
    """On the CPU SDPA has no cuDNN backward: left alone (at_risk unpatched)."""
    backend = CodaBackend(Options(inductor=False))
    torch._dynamo.reset()
    torch.compile(Attention(), backend=backend)(torch.randn(2, 16, 64)).sum().backward()
    assert backend.report.graphs[0].guards == []


def test_relaid_layout_reaches_the_backward_op_under_inductor(everywhere, monkeypatch):
    """Under Inductor the hook is traced into the backward graph: the SDPA backward op's
    grad_out (its fake value, which Inductor's SDPA stride constraint keeps) is dense
    [b, s, h, d]; without the guard the same graph hands it [b, h, s, d]."""
    from torch._inductor import config
    from torch._inductor.custom_graph_pass import CustomGraphPass

    seen = []

    class Spy(CustomGraphPass):
        def uuid(self):
            return "attention-grad-layout-spy"

        def __call__(self, graph):
            seen.extend(tuple(n.args[0].meta["val"].stride()) for n in graph.nodes
                        if "scaled_dot_product" in str(n.target) and "backward" in str(n.target))

    x = torch.randn(2, 16, 64)
    s, h, d = 16, 4, 16
    # config.patch, not monkeypatch: undoing a monkeypatched Inductor setting deletes it
    # (ConfigModule.__delattr__ hides it), and every later compile in the process fails
    with config.patch(post_grad_custom_post_pass=Spy(), fx_graph_cache=False):
        for guarded, want in ((True, (s * h * d, d, h * d, 1)),
                              (False, (h * s * d, s * d, d, 1))):
            if not guarded:
                monkeypatch.setattr(guard, "at_risk", lambda node: False)
            seen.clear()
            torch._dynamo.reset()
            model = torch.compile(Attention(differential=True),
                                  backend=CodaBackend(Options(inductor=True)))
            model(x).sum().backward()
            assert seen == [want], (guarded, seen)


def test_optimize_places_the_guard(everywhere):
    """optimize() (the eager-FX path users call) goes through the same pipeline."""
    torch._dynamo.reset()
    fast = coda_rewrite.optimize(Attention(differential=True))
    fast(torch.randn(2, 16, 64)).sum().backward()
    assert any(g.guards for g in fast.report.graphs)


class TwoReaders(nn.Module):
    """The SDPA output read twice (a residual-style second reader) and returned as is."""

    def forward(self, q, k, v):
        o = F.scaled_dot_product_attention(q, k, v)
        return o, o.transpose(1, 2).flatten(2) * 2


def test_every_reader_and_the_graph_output_get_the_guarded_value(everywhere):
    """Each user of the SDPA node (a second reader, the graph's output) reads the guarded
    value, and the gradients of both paths reach q, k, v as eager's."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 8, 16, requires_grad=True) for _ in range(3))
    backend = CodaBackend(Options(inductor=False))
    torch._dynamo.reset()
    o, flat = torch.compile(TwoReaders(), backend=backend)(q, k, v)
    (o.sum() + flat.square().sum()).backward()
    got = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    o, flat = TwoReaders()(q, k, v)
    (o.sum() + flat.square().sum()).backward()
    for g, t in zip(got, (q, k, v)):
        torch.testing.assert_close(g, t.grad, rtol=1e-5, atol=1e-6)
    graph = backend.report.graphs[0]
    code = graph.rewritten_code
    assert code.count("_keep_grad_layout(") == 1 and graph.guards, code
    assert "= keep_grad_layout.transpose(1, 2)" in code and \
        "return (keep_grad_layout, " in code, code


class EverySpelling(nn.Module):
    """SDPA as F.scaled_dot_product_attention, torch._C._nn's and the aten op a graph may
    call itself, and an attention written out (matmul, softmax: no SDPA backward, left)."""

    def forward(self, q, k, v):
        a = F.scaled_dot_product_attention(q, k, v)
        b = torch._C._nn.scaled_dot_product_attention(q, k, v)
        c = torch.ops.aten.scaled_dot_product_attention.default(q, k, v)
        d = torch.softmax(q @ k.transpose(-1, -2) * 0.25, dim=-1) @ v
        return a + b + c + d


def test_every_sdpa_spelling_is_guarded_and_nothing_else(everywhere):
    gm = torch.fx.symbolic_trace(EverySpelling())
    assert guard.guard(gm.graph) == 3
    gm.recompile()
    assert gm.code.count("keep_grad_layout(") == 3
    q, k, v = (torch.randn(2, 4, 8, 16, requires_grad=True) for _ in range(3))
    torch.testing.assert_close(gm(q, k, v), EverySpelling()(q, k, v))
