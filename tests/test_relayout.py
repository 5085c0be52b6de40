"""Options(cache_relayouts=True): re-laid-out weights kept between calls, keyed by the
parameters' version counters. Same numbers as recomputing, recomputed after every
in-place update (optimizer steps, no_grad writes), never a stale hit from another
tensor, and the same through Inductor."""

from __future__ import annotations

import copy

import pytest
import torch

import coda_rewrite
from coda_rewrite.kernels import ops, relayout
from coda_rewrite.numerics import rel_err

from conftest import build, grads_match, hf_model, loss_of, tokens


@pytest.mark.parametrize("family", ["llama", "phi3", "plain"])
def test_training_steps_recompute_and_match_eager(family):
    model = build(family, layers=2).train()
    ref = copy.deepcopy(model)
    fast = coda_rewrite.optimize(model, cache_relayouts=True)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref)]
    ids = tokens()
    for _ in range(2):
        relayout.STATS.clear()
        loss, want = loss_of(fast, family, ids), loss_of(ref, family, ids)
        assert abs(loss.item() - want.item()) <= 1e-5 * abs(want.item())
        loss.backward()
        want.backward()
        grads_match(model, ref)
        assert relayout.STATS["miss"] >= 2 and relayout.STATS["hit"] == 0  # new weights
        for o in opts:
            o.step()
            o.zero_grad()


def test_inference_hits_until_a_weight_changes():
    model = hf_model("qwen2", layers=2).eval()  # biases: four re-layouts per layer
    fast = coda_rewrite.optimize(model, cache_relayouts=True)
    ids = tokens()
    with torch.no_grad():
        fast(ids)
        relayout.STATS.clear()
        assert rel_err(fast(ids).logits, model(ids).logits) <= 1e-5
        assert relayout.STATS == {"hit": 6}  # gate/up, q/k/v weights and biases, x2
        model.model.layers[1].self_attn.k_proj.bias.add_(1.0)  # bumps its version
        relayout.STATS.clear()
        assert rel_err(fast(ids).logits, model(ids).logits) <= 1e-5
        assert relayout.STATS == {"hit": 5, "miss": 1}


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


@pytest.mark.inductor
def test_not_kept_under_inductor():
    """Inductor may reuse a custom op's output buffer as scratch once its last reader ran:
    a kept re-layout handed to it could be written over. Under Inductor the option is
    reported and not used; the re-layouts are graph ops again (one copy kernel each)."""
    model = hf_model("llama", layers=1).eval()
    backend = coda_rewrite.CodaBackend(coda_rewrite.Options(cache_relayouts=True))
    compiled = torch.compile(model, backend=backend)
    ids = tokens()
    with torch.no_grad(), pytest.warns(UserWarning, match="not used under Inductor"):
        relayout.STATS.clear()
        assert rel_err(compiled(ids).logits, model(ids).logits) <= 1e-5
    assert "cache_relayouts is not used under Inductor" in str(backend.report)
    assert backend.report.count(pattern="rope") == 1
    assert "coda.relayout" not in backend.report.graphs[0].rewritten_code
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.mul_(0.5)
        assert rel_err(compiled(ids).logits, model(ids).logits) <= 1e-5
    assert not relayout.STATS


@pytest.mark.inductor
def test_training_through_inductor_with_the_option_set():
    model = hf_model("llama", layers=1).train()
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend=coda_rewrite.CodaBackend(
        coda_rewrite.Options(cache_relayouts=True)))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref)]
    ids = tokens()
    for _ in range(2):
        relayout.STATS.clear()
        loss, want = compiled(ids, labels=ids).loss, ref(ids, labels=ids).loss
        assert abs(loss.item() - want.item()) <= 1e-5 * abs(want.item())
        loss.backward()
        want.backward()
        grads_match(model, ref)
        assert not relayout.STATS  # not kept under Inductor: recomputed by construction
        for o in opts:
            o.step()
            o.zero_grad()


def test_op_with_a_missing_source_and_its_gradient():
    """A bias that only some segments have (zeros there), through the op, with autograd
    (a None in the op's tensor list would hide every gradient: it is left out)."""
    lay = ((0, 16, 2, 8, 8), (0, 8, 1, 8, 8), (0, 8, 0, 0, 0))
    bq, bv = torch.randn(16, requires_grad=True), torch.randn(8, requires_grad=True)
    spec = relayout.spec_of(lay, (bq, None, bv))
    got = torch.ops.coda.relayout("rope_segments", spec, [bq, bv])
    want = ops.rope_segments(lay, bq, None, bv)
    assert torch.equal(got, want)
    g = torch.randn_like(got)
    a = torch.autograd.grad(got, (bq, bv), g)
    b = torch.autograd.grad(want, (bq, bv), g)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    relayout.STATS.clear()
    torch.ops.coda.relayout("rope_segments", spec, [bq, bv])
    assert relayout.STATS == {"hit": 1}


def test_bias_on_q_only_trains_through_the_cache():
    """q has a bias, k and v do not: the cached fused bias still passes its gradient."""
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
