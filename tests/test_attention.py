"""Attention inputs (issue: materialised causal masks and repeat_kv back to SDPA's fast
path): the capture artefact is really in the graph, the rewrite is applied exactly where
proved, and outputs, gradients and decode steps match eager."""

from __future__ import annotations

import copy

import pytest
import torch

import coda_rewrite
from coda_rewrite.numerics import rel_err
from coda_rewrite.patterns import attention

from conftest import decode_matches_eager, hf_model, tokens

CASES = [("llama", {}), ("qwen2", {}), ("mistral", {}), ("mistral", {"sliding_window": 8}),
         ("mistral", {"sliding_window": 64})]


def _sdpa_calls(model, *args, **kwargs):
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    with torch.no_grad():
        torch.compile(model, backend=capture)(*args, **kwargs)
    return [n for g in graphs for n in g.graph.nodes
            if n.op == "call_function" and n.target in attention._SDPA]


@pytest.mark.parametrize("family,kw", CASES, ids=lambda c: str(c))
def test_capture_really_materialises_the_mask(family, kw):
    calls = _sdpa_calls(hf_model(family, **kw).eval(), tokens())
    assert len(calls) == 2
    for n in calls:
        args = attention._sdpa_args(n)
        assert isinstance(args.get("attn_mask"), torch.fx.Node) and not args.get("is_causal")
        assert attention.repeat_kv_base(args["key"]) is not None


def _attention_records(report):
    return [r for r in report.records if r.pattern == attention.NAME]


@pytest.mark.parametrize("family,kw", CASES, ids=lambda c: str(c))
@pytest.mark.parametrize("padding", [False, True])
def test_outputs_and_gradients_match_eager(family, kw, padding):
    model = hf_model(family, **kw).train()
    ref = copy.deepcopy(model)
    ids = tokens()
    call = {}
    if padding:
        mask = torch.ones_like(ids)
        mask[0, :4] = 0
        call["attention_mask"] = mask
    fast = coda_rewrite.optimize(model)
    out = fast(ids, labels=ids, **call)
    want = ref(ids, labels=ids, **call)
    assert rel_err(out.logits, want.logits) <= 1e-5
    out.loss.backward()
    want.loss.backward()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert rel_err(p.grad, q.grad) <= 1e-4, name
    recs = _attention_records(fast.report)
    assert len(recs) == 2 and all(r.status == "rewritten" for r in recs)  # GQA everywhere
    kept = [{d.code for _, d in r.notes if not d.accepted} for r in recs]
    proved_causal = not padding and kw.get("sliding_window", 10 ** 9) >= ids.shape[1]
    assert kept.count(set()) == (2 if proved_causal else 0), kept
    if padding:
        assert all(k == {"mask.padding"} for k in kept), kept
    elif not proved_causal:
        assert all(k == {"mask.window"} for k in kept), kept


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_decode_steps_with_a_cache(family):
    model = hf_model(family).eval()
    fast = coda_rewrite.optimize(model)
    decode_matches_eager(model, fast, tokens())
    kept = {d.code for r in _attention_records(fast.report) for _, d in r.notes
            if not d.accepted}
    assert "mask.cache_offset" in kept, kept


def test_backend_and_dynamic_shapes():
    model = hf_model("llama").eval()
    backend = coda_rewrite.CodaBackend(coda_rewrite.Options(inductor=False))
    compiled = torch.compile(model, backend=backend, dynamic=True)
    with torch.no_grad():
        for seq in (12, 20):
            ids = tokens(seq=seq)
            assert rel_err(compiled(ids).logits, model(ids).logits) <= 1e-5
    recs = _attention_records(backend.report)
    assert len(backend.report.graphs) == 1
    assert len(recs) == 2 and all(r.status == "rewritten" and not r.reason for r in recs)


def test_disabled_pattern_leaves_attention_alone():
    model = hf_model("llama").eval()
    fast = coda_rewrite.optimize(model, patterns=("residual_rmsnorm_gemm",))
    with torch.no_grad():
        fast(tokens())
    recs = _attention_records(fast.report)
    assert recs and all(r.status == "rejected" and r.code == "disabled" for r in recs)


def test_torchtitan_style_repeat_then_transpose():
    """The plain Llama repeats k/v on [b, s, h, d] and transposes after: still repeat_kv;
    it already asks SDPA for is_causal, so only the heads change."""
    from conftest import plain_llama

    model = plain_llama().train()
    ref = copy.deepcopy(model)
    ids = tokens()
    fast = coda_rewrite.optimize(model)
    out, want = fast(ids), ref(ids)
    assert rel_err(out, want) <= 1e-5
    out.float().pow(2).mean().backward()
    want.float().pow(2).mean().backward()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert rel_err(p.grad, q.grad) <= 1e-4, name
    recs = _attention_records(fast.report)
    assert len(recs) == 2 and all(r.status == "rewritten" for r in recs)
    assert all(r.notes[0][1].accepted and len(r.notes) == 1 for r in recs)
