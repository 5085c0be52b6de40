"""Real models end to end: match counts, outputs, losses, gradients, optimizer steps,
dynamic shapes, autocast, in float32 and bfloat16 (errors norm-wise, DESIGN.md)."""

from __future__ import annotations

import copy

import pytest
import torch

import coda_rewrite
from coda_rewrite.numerics import logits_of, low_precision_errors, rel_err

from conftest import grads_match, HF_FAMILIES, build, hf_model, loss_of, tokens

FAMILIES = HF_FAMILIES + ("plain",)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layers", [2, 3])
def test_every_norm_is_rewritten(family, layers):
    model = build(family, layers=layers).eval()
    report = coda_rewrite.explain(model, tokens())
    assert report.count() == 2 * layers + 1, str(report)
    kinds = [r.programs[0].name for r in report.records
             if r.status == "rewritten" and r.pattern == "residual_rmsnorm_gemm"]
    assert kinds.count("rmsnorm_rowscale") == 1, kinds  # the first input norm: no GEMM before
    assert kinds.count("residual_rmsnorm") == 2 * layers, kinds


@pytest.mark.parametrize("family", FAMILIES)
def test_float32_logits_loss_and_gradients_match_eager(family, inductor):
    model = build(family, layers=2).train()
    ref_model = copy.deepcopy(model)
    ids = tokens()
    fast = coda_rewrite.optimize(model, inductor=inductor)

    loss = loss_of(fast, family, ids)
    ref_loss = loss_of(ref_model, family, ids)
    assert fast.report.count() == 5, str(fast.report)
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
    loss.backward()
    ref_loss.backward()
    grads_match(model, ref_model)
    with torch.no_grad():
        assert rel_err(logits_of(fast(ids)), logits_of(ref_model(ids))) <= 1e-5


@pytest.mark.parametrize("family", FAMILIES + ("gemma", "phi3"))
def test_bfloat16_no_worse_than_eager(family):
    ids = tokens(seq=64)  # 2 x 64 x 256 logits: >= 1e4 elements
    res = low_precision_errors(lambda seed: build(family, layers=2, seed=seed), (ids,),
                               coda_rewrite.optimize, dtype=torch.bfloat16)
    assert res["ok"], res
    # the loss, bounded absolutely
    model = build(family, layers=2).to(torch.bfloat16)
    with torch.no_grad():
        a = loss_of(model, family, ids).float()
        b = loss_of(coda_rewrite.optimize(model), family, ids).float()
    assert abs(a - b) <= 1e-2


@pytest.mark.parametrize("family", ["llama", "plain", "gemma", "phi3", "qwen2"])
def test_two_optimizer_steps_match_eager(family):
    """Every pattern on: the re-laid-out weights (gated MLPs, permuted q/k/v) are rebuilt
    from the live parameters after each step, the loss comes from the LM head's epilogue
    (HF models), and state_dict() stays the original module's."""
    model = build(family, layers=2).train()
    ref_model = copy.deepcopy(model)
    keys = list(model.state_dict())
    fast = coda_rewrite.optimize(model)
    # SGD: the update is linear in the gradient, so the comparison measures the rewrite
    # (Adam's g / sqrt(v) amplifies rounding-level differences of near-zero gradients)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1, momentum=0.9)
    for step in range(2):
        ids = tokens(seed=step)
        for m, o in ((fast, opt), (ref_model, ref_opt)):
            o.zero_grad()
            loss_of(m, family, ids).backward()
            o.step()
    # the optimizer updated the shared parameters in place; the next forward reads them
    for (name, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
        assert rel_err(p, q) <= 1e-5, name
    with torch.no_grad():
        assert rel_err(logits_of(fast(tokens(seed=9))), logits_of(ref_model(tokens(seed=9)))) <= 1e-5
    graphs = len(fast.report.graphs)  # the training graph, and the no_grad one above
    assert fast.report.count(pattern="gated_mlp") == 2 * graphs, str(fast.report)
    assert fast.report.count(pattern="rope") == 2 * graphs, str(fast.report)
    # the loss is in the training graph only (the no_grad call has no labels)
    assert fast.report.count(pattern="lm_head_cross_entropy") == int(family != "plain")
    assert list(model.state_dict()) == keys
    for k, v in model.state_dict().items():
        assert v.shape == ref_model.state_dict()[k].shape, k


def test_parameters_are_read_live():
    model = build("llama", layers=2).eval()
    fast = coda_rewrite.optimize(model)
    ids = tokens()
    with torch.no_grad():
        before = logits_of(fast(ids)).clone()
        model.model.norm.weight.mul_(2.0)
        model.model.layers[0].post_attention_layernorm.weight.add_(0.25)
        after = logits_of(fast(ids))
        assert rel_err(after, logits_of(model(ids))) <= 1e-5
        assert rel_err(after, before) > 1e-2
    assert model.state_dict().keys() == copy.deepcopy(model).state_dict().keys()


@pytest.mark.parametrize("family", FAMILIES)
def test_optimize_and_backend_agree(family):
    model = build(family, layers=2).eval()
    ids = tokens()
    backend = coda_rewrite.CodaBackend(coda_rewrite.Options(inductor=False))
    with torch.no_grad():
        a = logits_of(coda_rewrite.optimize(model)(ids))
        b = logits_of(torch.compile(model, backend=backend)(ids))
    assert backend.report.count() == 5
    assert torch.equal(a, b)


@pytest.mark.parametrize("family", ["llama", "plain"])
def test_dynamic_shapes_one_compile(family):
    model = build(family, layers=2).eval()
    backend = coda_rewrite.CodaBackend(coda_rewrite.Options(inductor=False))
    compiled = torch.compile(model, backend=backend, dynamic=True)
    with torch.no_grad():
        for seq in (12, 20):
            ids = tokens(seq=seq)
            assert rel_err(logits_of(compiled(ids)), logits_of(model(ids))) <= 1e-5
    assert len(backend.report.graphs) == 1
    assert backend.report.count() == 5


@pytest.mark.parametrize("family", ["llama", "plain"])
def test_autocast_bfloat16_on_float32_model(family):
    ids = tokens(seq=64)
    model = build(family, layers=2).eval()
    ref = copy.deepcopy(model).double()
    fast = coda_rewrite.optimize(model)
    with torch.no_grad():
        want = logits_of(ref(ids))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            eager = logits_of(model(ids))
            new = logits_of(fast(ids))
    assert fast.report.count() == 5, str(fast.report)
    assert new.dtype == eager.dtype
    assert rel_err(new, want) <= 1.25 * rel_err(eager, want), (rel_err(new, want),
                                                               rel_err(eager, want))


def test_tied_embeddings_and_logits_to_keep():
    model = hf_model("llama", layers=2, tie_word_embeddings=True).eval()
    ids = tokens()
    fast = coda_rewrite.optimize(model)
    with torch.no_grad():
        got = fast(ids, logits_to_keep=4).logits
        want = model(ids, logits_to_keep=4).logits
    assert got.shape == want.shape == (2, 4, 256)
    assert rel_err(got, want) <= 1e-5
    lm_head = [r for r in fast.report.records if r.path == "model.norm"]
    assert lm_head and lm_head[0].status == "rewritten", str(fast.report)


def test_optimized_module_looks_like_the_original():
    model = build("llama", layers=2).eval()
    fast = coda_rewrite.optimize(model)
    assert fast.config is model.config                  # attributes fall through
    assert fast.module is model
    assert {n for n, _ in fast.named_parameters()} == \
        {f"module.{n}" for n, _ in model.named_parameters()}
    fast.train()
    assert model.training                               # train()/eval() are shared
    with torch.no_grad():
        out = fast.generate(tokens(seq=4), max_new_tokens=3, do_sample=False)
    assert out.shape == (2, 7)
