"""Attention inputs (issue: materialised causal masks and repeat_kv back to SDPA's fast
path): the capture artefact is really in the graph, the rewrite is applied exactly where
proved, and outputs, gradients and decode steps match eager."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from packaging.version import Version

import coda_rewrite
from coda_rewrite.numerics import rel_err
from coda_rewrite import canonical
from coda_rewrite.patterns import attention

from conftest import (decode_matches_eager, grads_match, hf_model, module_step_matches_eager,
                      tokens)

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
            if n.op == "call_function" and n.target in canonical.SDPA]


@pytest.mark.parametrize("family,kw", CASES, ids=lambda c: str(c))
def test_capture_really_materialises_the_mask(family, kw):
    """What transformers hands SDPA under capture: a materialised mask and repeat_kv
    (the pinned 5.17, always), or, from a newer release where it already can (5.25 with a
    cache), no mask with is_causal and enable_gqa — what the rewrite would make of the
    first. Nothing in between."""
    calls = _sdpa_calls(hf_model(family, **kw).eval(), tokens())
    assert len(calls) == 2
    for n in calls:
        args = attention._sdpa_args(n)
        if args.get("attn_mask") is None and _NEWER:
            assert args.get("is_causal") and args.get("enable_gqa"), args
            continue
        assert isinstance(args.get("attn_mask"), torch.fx.Node) and not args.get("is_causal")
        assert attention.repeat_kv_base(args["key"]) is not None


def _attention_records(report):
    return [r for r in report.records if r.pattern == attention.NAME]


# transformers after the pinned 5.17.0 (seen with 5.25.0) calls SDPA with no mask and
# enable_gqa where it can; under the pinned release every call still has the mask
_NEWER = Version(transformers.__version__) > Version("5.17.0")


def _nothing_left(r) -> bool:
    """transformers already called SDPA with no mask and enable_gqa: the record says so,
    and that is all it says. Accepted only from a release newer than the pinned one."""
    return _NEWER and r.status == "rejected" and \
        {d.code for _, d in r.notes if not d.accepted} == {"attention.gqa_already"}


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
    kept = [{d.code for _, d in r.notes if not d.accepted} for r in recs]
    proved_causal = not padding and kw.get("sliding_window", 10 ** 9) >= ids.shape[1]
    # a mask that stays a tensor keeps the key/value repeat too (enable_gqa with a mask
    # would send SDPA to its math kernel): nothing changes there
    if proved_causal and all(_nothing_left(r) for r in recs):
        assert len(recs) == 2
        return
    assert len(recs) == 2 and all(r.status == ("rewritten" if proved_causal else "rejected")
                                  for r in recs), kept
    if proved_causal:
        assert kept == [set(), set()], kept
    else:
        mask_code = "mask.padding" if padding else "mask.window"
        assert all(k == {mask_code, "attention.gqa_with_mask"} for k in kept), kept


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_decode_steps_with_a_cache(family):
    model = hf_model(family).eval()
    fast = coda_rewrite.optimize(model)
    decode_matches_eager(model, fast, tokens())
    recs = _attention_records(fast.report)
    kept = {d.code for r in recs for _, d in r.notes if not d.accepted}
    assert "mask.cache_offset" in kept or all(_nothing_left(r) for r in recs), kept


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
    assert len(recs) == 2 and (all(r.status == "rewritten" and not r.reason for r in recs) or
                               all(_nothing_left(r) for r in recs)), str(backend.report)


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


# ---- additive float masks (the reference Llama's spelling) --------------------------------

class RefAttention(torch.nn.Module):
    """The original reference Llama's attention: k/v repeated on [b, s, h, d] before the
    transpose, an additive float mask built by ``mask_kind``, SDPA with that mask."""

    def __init__(self, mask_kind: str, dtype=torch.float32, repeat: str = "expand"):
        super().__init__()
        self.mask_kind, self.repeat = mask_kind, repeat
        self.wq = torch.nn.Linear(32, 32, bias=False, dtype=dtype)
        self.wk = torch.nn.Linear(32, 16, bias=False, dtype=dtype)
        self.wv = torch.nn.Linear(32, 16, bias=False, dtype=dtype)

    def mask(self, n, x):
        kind = self.mask_kind
        if kind == "triu, hstack":  # llama/model.py, start_pos 0
            mask = torch.triu(torch.full((n, n), float("-inf"), device=x.device), diagonal=1)
            return torch.hstack([torch.zeros((n, 0), device=x.device), mask]).type_as(x)
        if kind == "masked_fill":
            i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
            return torch.zeros(n, n, dtype=x.dtype).masked_fill(j > i, float("-inf"))
        if kind == "finfo.min":  # as Hugging Face fills its float masks
            return torch.full((n, n), torch.finfo(x.dtype).min, dtype=x.dtype).triu(1)
        if kind == "sum of two":
            return torch.full((n, n), float("-inf")).triu(1) + torch.zeros(n, n)
        # look-alikes that are not causal masks
        if kind == "diagonal masked too":
            return torch.full((n, n), float("-inf")).triu(0)
        if kind == "-1e4":
            return torch.full((n, n), -1e4).triu(1)
        if kind == "float64":
            return torch.full((n, n), float("-inf"), dtype=torch.float64).triu(1)
        raise ValueError(kind)

    def repeated(self, t, b, n):
        """[b, n, 2, 8] -> [b, n, 4, 8]: kv head g for query heads 2g, 2g + 1 (GQA), or
        tiled (``Tensor.repeat``: query head h reads kv head h % 2, not GQA)."""
        if self.repeat == "expand":  # llama/model.py
            return t[:, :, :, None, :].expand(b, n, 2, 2, 8).reshape(b, n, 4, 8)
        if self.repeat == "unsqueeze":  # TorchTitan
            return torch.unsqueeze(t, dim=3).expand(b, n, 2, 2, 8).reshape(b, n, 4, 8)
        if self.repeat == "repeat_interleave":
            return t.repeat_interleave(2, dim=2)
        if self.repeat == "expand before the heads":  # also tiles: h % 2
            return t[:, :, None, :, :].expand(b, n, 2, 2, 8).reshape(b, n, 4, 8)
        if self.repeat == "flatten":  # torchtune's, here before the transpose
            return t.unsqueeze(3).expand(b, n, 2, 2, 8).flatten(2, 3)
        if self.repeat == "flatten before the heads":  # tiles: h % 2
            return t.unsqueeze(2).expand(b, n, 2, 2, 8).flatten(2, 3)
        return t.repeat(1, 1, 2, 1)

    def forward(self, x):
        b, n, _ = x.shape
        q = self.wq(x).view(b, n, 4, 8).transpose(1, 2)
        k = self.wk(x).view(b, n, 2, 8)
        v = self.wv(x).view(b, n, 2, 8)
        if self.repeat == "flatten after the transpose":  # torchtune's [b, h, s, d] repeat
            k, v = (t.transpose(1, 2).unsqueeze(2).expand(b, 2, 2, n, 8).flatten(1, 2)
                    for t in (k, v))
        else:
            k, v = (self.repeated(t, b, n).transpose(1, 2) for t in (k, v))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v,
                                                               attn_mask=self.mask(n, x))
        return out.transpose(1, 2).reshape(b, n, 32)


@pytest.mark.parametrize("kind", ["triu, hstack", "masked_fill", "finfo.min", "sum of two"])
def test_additive_causal_masks_become_is_causal(kind):
    torch.manual_seed(0)
    report = module_step_matches_eager(RefAttention(kind), torch.randn(2, 6, 32))
    (rec,) = _attention_records(report)
    assert rec.status == "rewritten" and all(d.accepted for _, d in rec.notes), str(report)
    assert "additive mask" in str(report)  # the proof says why the values are safe
    code = report.graphs[0].rewritten_code
    assert "attn_mask = None" in code and "is_causal = True" in code and \
        "enable_gqa = True" in code, code


@pytest.mark.parametrize("kind,code", [
    ("diagonal masked too", "mask.not_causal"),
    ("-1e4", "mask.fill_value"),            # exp(-1e4 + s) is not 0 for every score
])
def test_additive_look_alikes_keep_their_mask(kind, code):
    torch.manual_seed(0)
    model = RefAttention(kind)
    x = torch.randn(2, 6, 32)
    fast = coda_rewrite.optimize(copy.deepcopy(model))
    with torch.no_grad():
        assert torch.equal(fast(x), model(x)) or rel_err(fast(x), model(x)) <= 1e-6
    (rec,) = _attention_records(fast.report)
    kept = {d.code for _, d in rec.notes if not d.accepted}
    assert kept == {code, "attention.gqa_with_mask"}, str(fast.report)


def test_a_mask_eager_sdpa_rejects_is_kept_so_it_still_raises():
    model = RefAttention("float64")
    x = torch.randn(2, 6, 32)
    with pytest.raises(RuntimeError, match="attn_mask dtype"):
        model(x)
    fast = coda_rewrite.optimize(model)
    with pytest.raises(RuntimeError, match="attn_mask dtype"):
        fast(x)


def test_a_mask_with_a_cache_offset_is_never_is_causal():
    """Decoding with a cache, the reference Llama prepends zeros for the cached keys: the
    mask is aligned bottom-right, is_causal top-left. Kept, with the reason."""
    class Offset(RefAttention):
        def forward(self, x):
            b, n, _ = x.shape
            q = self.wq(x).view(b, n, 4, 8).transpose(1, 2)
            kv = torch.cat([torch.zeros(b, 4, 3, 8), q], 2)  # 3 cached positions
            mask = torch.hstack([torch.zeros((n, 3)),
                                 torch.full((n, n), float("-inf")).triu(1)])
            return torch.nn.functional.scaled_dot_product_attention(q, kv, kv, attn_mask=mask)

    model = Offset("triu, hstack")
    x = torch.randn(2, 5, 32)
    fast = coda_rewrite.optimize(copy.deepcopy(model))
    with torch.no_grad():
        assert rel_err(fast(x), model(x)) <= 1e-6
    (rec,) = _attention_records(fast.report)
    assert dict(rec.notes)["mask"].code == "mask.cache_offset", str(fast.report)


@pytest.mark.parametrize("repeat", ["expand", "unsqueeze", "repeat_interleave", "tile",
                                    "expand before the heads", "flatten",
                                    "flatten after the transpose", "flatten before the heads"])
def test_repeat_spellings_before_the_transpose(repeat):
    """Every repeat that gives query head h kv head h // n_rep becomes enable_gqa=True;
    Tensor.repeat tiles the heads (h % n_kv) and is left as it is."""
    torch.manual_seed(0)
    model = RefAttention("masked_fill", repeat=repeat)
    x = torch.randn(2, 6, 32)
    fast = coda_rewrite.optimize(copy.deepcopy(model))
    with torch.no_grad():
        assert rel_err(fast(x), model(x)) <= 1e-5
    (rec,) = _attention_records(fast.report)
    gqa = dict(rec.notes)["grouped-query heads"]
    tiles = repeat in ("tile", "expand before the heads", "flatten before the heads")
    assert gqa.accepted == (not tiles), str(fast.report)
    if tiles:
        assert gqa.code == "attention.not_repeat_kv"


def test_packed_sequence_ids_from_positions_are_proved_constant():
    """Without a cache (use_cache=False, as in training with gradient checkpointing)
    transformers compares packed-sequence ids computed from the positions (diff, ne,
    cumsum of an arange): all equal, so the mask is causal. Outputs and gradients as
    eager's; position_ids passed in (real packing) keep the mask."""
    model = hf_model("llama").train()
    ref = copy.deepcopy(model)
    ids = tokens()
    fast = coda_rewrite.optimize(model)
    out = fast(ids, labels=ids, use_cache=False)
    want = ref(ids, labels=ids, use_cache=False)
    assert rel_err(out.logits, want.logits) <= 1e-5
    out.loss.backward()
    want.loss.backward()
    grads_match(model, ref)
    recs = _attention_records(fast.report)
    assert len(recs) == 2 and all(r.status == "rewritten" for r in recs), str(fast.report)
    assert all(d.accepted for r in recs for _, d in r.notes)

    torch._dynamo.reset()
    packed = torch.cat([torch.arange(8), torch.arange(8)]).expand(2, -1)  # two per row
    model2 = hf_model("llama").eval()
    fast2 = coda_rewrite.optimize(copy.deepcopy(model2))
    with torch.no_grad():
        got = fast2(ids, position_ids=packed, use_cache=False).logits
        want2 = model2(ids, position_ids=packed, use_cache=False).logits
    assert rel_err(got, want2) <= 1e-5
    codes = {d.code for r in _attention_records(fast2.report) for _, d in r.notes
             if not d.accepted}
    assert "mask.padding" in codes, str(fast2.report)
