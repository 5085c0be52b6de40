"""RoPE in the q/k/v GEMM's epilogue: match counts on real models, outputs and gradients
against eager, KV caches and decoding with past_key_values, the rope types' frequencies,
the escape analysis (where eager's order is put back), near misses, the layouts, and the
specialised backward against the general one."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import coda_rewrite
from coda_rewrite.codegen.program import Kind
from coda_rewrite.codegen import layouts, op_table, reference
from coda_rewrite.kernels import backward
from coda_rewrite.numerics import low_precision_errors, rel_err
from coda_rewrite.patterns.rope import rope_program, rope_table_program

from conftest import (InOwnDtype, build, codes, decode_matches_eager, grads_match, hf_model,
                      left_as_eager, loss_of, refused_by_gradient_replay,
                      step_matches_eager, tokens)

HF = ("llama", "qwen2", "mistral", "gemma", "phi3")


def eager_and_rewritten(model, *args, patterns=None, **kwargs):
    """(rewritten output, eager output, report) of one no_grad call."""
    with torch.no_grad():
        want = model(*args, **kwargs)
        fast = coda_rewrite.optimize(model, **({} if patterns is None else
                                               {"patterns": patterns}))
        got = fast(*args, **kwargs)
    return got, want, fast.report


def rope_records(report, status="rewritten"):
    return [r for r in report.records if r.pattern == "rope" and r.status == status]


def unpermuted(report):
    return [m for r in rope_records(report) for m in r.materialised]


@pytest.mark.parametrize("family", HF)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_rotation_per_layer_with_v_in_the_same_gemm(family, dtype):
    model = build(family, layers=2).to(dtype).eval()
    report = coda_rewrite.explain(model, tokens(), use_cache=False)
    done = rope_records(report)
    assert len(done) == 2, str(report)
    for r in done:
        assert r.programs[0].name == "rowscale_rope", str(report)  # the input norm's rstd
        assert len(r.consumers) == 3 and "frequency 0" in r.consumers[2], r.consumers
        text = r.decision.render()
        assert "PROVED" in text and "witness replay in float64" in text, text
        assert "q·k invariant at" in text, text
    assert unpermuted(report) == []  # no cache returned: the permutation never shows


@pytest.mark.parametrize("family", HF)
def test_float32_outputs_and_gradients_match_eager(family):
    report = step_matches_eager(family)
    assert len(rope_records(report)) == 2, str(report)


def test_eager_attention_scores_are_invariant_too():
    """attn_implementation="eager": scores are q @ k.transpose(2, 3), a sum over the
    head dim; the permutation stays there too."""
    model = hf_model("llama", layers=2, attn_implementation="eager").eval()
    ids = tokens()
    # the explicit attention stays explicit here (it would become SDPA otherwise)
    everything_else = tuple(p for p in coda_rewrite.Options().patterns
                            if p != "explicit_attention")
    got, want, report = eager_and_rewritten(model, ids, use_cache=False,
                                            patterns=everything_else)
    got, want = got.logits, want.logits
    done = rope_records(report)
    assert len(done) == 2 and unpermuted(report) == [], str(report)
    assert all("q·k invariant at matmul" in r.decision.render() for r in done)
    assert rel_err(got, want) <= 1e-5


@pytest.mark.parametrize("family", ["llama", "qwen2", "phi3"])
def test_returned_key_cache_is_eager_order(family):
    """use_cache=True returns the keys: the rewrite puts eager's order back on that edge
    only (attention still reads the permuted q and k)."""
    model = build(family, layers=2).eval()
    got, want, report = eager_and_rewritten(model, tokens(seq=8), use_cache=True)
    assert len(rope_records(report)) == 2, str(report)
    assert len(unpermuted(report)) == 2, str(report)  # one key cache per layer
    assert all("graph output" in m for m in unpermuted(report))
    assert rel_err(got.logits, want.logits) <= 1e-5
    for layer in range(2):
        for kind in ("keys", "values"):
            a = getattr(got.past_key_values.layers[layer], kind)
            b = getattr(want.past_key_values.layers[layer], kind)
            assert rel_err(a, b) <= 1e-5, (layer, kind, rel_err(a, b))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_decoding_with_past_key_values_matches_eager(family):
    """Prefill, then token-by-token decode with the cache and position offsets. The
    prefill's attention reads the rotated q and k (rewritten; the returned cache gets
    eager's order back); a decode step's attention reads k concatenated with cached
    (eager-order) keys, so no reader would keep the permuted order: left, with its
    reason, rather than fused and copied back."""
    model = build(family, layers=2).eval()
    ids = tokens(seq=12)
    fast = coda_rewrite.optimize(model, dynamic=False)
    with torch.no_grad():
        ref = model(ids[:, :6], use_cache=True)
        out = fast(ids[:, :6], use_cache=True)
        assert rel_err(out.logits, ref.logits) <= 1e-5
        past_ref, past = ref.past_key_values, out.past_key_values
        for t in range(6, 9):
            ref = model(ids[:, t:t + 1], past_key_values=past_ref, use_cache=True)
            out = fast(ids[:, t:t + 1], past_key_values=past, use_cache=True)
            assert rel_err(out.logits, ref.logits) <= 1e-5, t
            past_ref, past = ref.past_key_values, out.past_key_values
        for layer in range(2):
            assert rel_err(past.layers[layer].keys, past_ref.layers[layer].keys) <= 1e-5
    prefill, *decode = fast.report.graphs
    assert len(rope_records(prefill)) == 2, str(fast.report)
    assert decode and all(not rope_records(g) and "rope.no_invariant_reader" in
                          codes(g, "rope") for g in decode), str(fast.report)


def test_generate_with_a_compiled_forward():
    """model.generate() over forward compiled with the backend: the prefill graph's RoPE
    is rewritten, the decode graphs' (the cache as inputs: k concatenated with cached
    keys) left with their reason; the tokens and their logits are eager's."""
    model = hf_model("llama", layers=2).eval()
    ids = tokens(seq=8)
    kw = dict(max_new_tokens=5, do_sample=False, output_logits=True,
              return_dict_in_generate=True)
    with torch.no_grad():
        want = model.generate(ids, **kw)
        backend = coda_rewrite.CodaBackend(coda_rewrite.Options(inductor=False))
        model.forward = torch.compile(model.forward, backend=backend)
        got = model.generate(ids, **kw)
    assert torch.equal(got.sequences, want.sequences)
    assert max(rel_err(a, b) for a, b in zip(got.logits, want.logits)) <= 1e-5
    prefill, *decode = backend.report.graphs
    assert len(rope_records(prefill)) == 2 and decode, str(backend.report)
    assert all("rope.no_invariant_reader" in codes(g, "rope") for g in decode), str(
        backend.report)


@pytest.mark.parametrize("rope_scaling", [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 16},
])
def test_rope_types_give_eager_frequencies(rope_scaling):
    kw = {} if rope_scaling is None else {"rope_scaling": rope_scaling}
    model = hf_model("llama", layers=1, max_position_embeddings=32, **kw).eval()
    ids = tokens(seq=48)  # past the original context: dynamic and llama3 differ there
    got, want, report = eager_and_rewritten(model, ids, use_cache=False)
    got, want = got.logits, want.logits
    assert len(rope_records(report)) == 1, str(report)
    assert rel_err(got, want) <= 1e-5


def test_cos_sin_from_outside_the_graph_are_read_as_a_table():
    """Dynamic NTK rope updates inv_freq data-dependently: dynamo breaks the graph there,
    so the layers receive cos/sin as inputs. The epilogue reads them as a table (their
    halves checked on the device), q and k still permuted, v in the same GEMM under a
    0 rotate flag."""
    model = hf_model("llama", layers=1, max_position_embeddings=32,
                     rope_scaling={"rope_type": "dynamic", "factor": 2.0}).eval()
    ids = tokens(seq=48)
    got, want, report = eager_and_rewritten(model, ids, use_cache=False)
    got, want = got.logits, want.logits
    (r,) = rope_records(report)
    assert r.programs[0].name == "rowscale_rope_table" and len(r.consumers) == 3
    assert "not rotated" in r.consumers[2] and "on" in {o.name for o in r.programs[0].operands}
    text = r.decision.render()
    assert "come from outside this graph" in text and "checked on the device" in text, text
    assert "v joins the GEMM under a 0 rotate flag" in text, text
    assert rel_err(got, want) <= 1e-5


@pytest.mark.parametrize("family", ["llama", "qwen2", "phi3"])
def test_layers_compiled_one_by_one(family):
    """Each decoder layer compiled alone (position_embeddings arrive as inputs): the
    table path, in training; loss and every gradient against eager; v in the rotating
    GEMM under a 0 flag (Phi-3: all of the packed qkv, no remainder)."""
    model = build(family, layers=2).train()
    ref = copy.deepcopy(model)
    for i, layer in enumerate(model.model.layers):
        model.model.layers[i] = coda_rewrite.optimize(layer)
    ids = tokens()
    loss, want = loss_of(model, family, ids), loss_of(ref, family, ids)
    assert abs(loss.item() - want.item()) <= 1e-5 * abs(want.item())
    loss.backward()
    want.backward()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert rel_err(p.grad, q.grad) <= 1e-4, name
    for layer in model.model.layers:
        (r,) = rope_records(layer.report)
        assert r.programs[0].name == "rowscale_rope_table", str(layer.report)
        assert len(r.consumers) == 3 and "gets a GEMM of its own" not in r.decision.render()


def test_a_table_that_is_not_cat_theta_theta_fails_loudly():
    """Tables from outside the graph can break the half-split pairing (cos[f] ≠
    cos[f + h]); eager then is no rotation, and the rewrite refuses at run time."""
    import torch.nn as nn

    class Rot(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k = nn.Linear(32, 32, bias=False), nn.Linear(32, 32, bias=False)

        def forward(self, x, cos, sin):
            b, s, _ = x.shape
            q = self.q(x).view(b, s, 4, 8).transpose(1, 2)
            k = self.k(x).view(b, s, 4, 8).transpose(1, 2)

            def rot(t):
                return torch.cat((-t[..., 4:], t[..., :4]), -1)
            c, sn = cos[:, None], sin[:, None]
            qe, ke = q * c + rot(q) * sn, k * c + rot(k) * sn
            v = x.view(b, s, 4, 8).transpose(1, 2)
            return torch.nn.functional.scaled_dot_product_attention(qe, ke, v)

    m = Rot()
    x = torch.randn(2, 6, 32)
    th = torch.randn(1, 6, 4)
    good = (torch.cat((th, th), -1).cos(), torch.cat((th, th), -1).sin())
    bad = (torch.cat((th, 2 * th), -1).cos(), torch.cat((th, 2 * th), -1).sin())
    fast = coda_rewrite.optimize(m)
    with torch.no_grad():
        assert rel_err(fast(x, *good), m(x, *good)) <= 1e-5
        assert len(rope_records(fast.report)) == 1, str(fast.report)
        with pytest.raises(RuntimeError, match="cos/sin halves differ"):
            fast(x, *bad)


class ChunkSpelling(torch.nn.Module):
    """rotate_half by chunk, heads kept after the sequence (unsqueeze_dim=2), bias on q
    only, the transpose for attention after the rotation."""

    def __init__(self, update_between: bool = False):
        super().__init__()
        self.update_between = update_between  # x updated in place after q's GEMM
        self.q = torch.nn.Linear(32, 32, bias=True)
        self.k, self.v = torch.nn.Linear(32, 16, bias=False), torch.nn.Linear(32, 16, bias=False)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)))

    def forward(self, x):
        x = x * 1.0 if self.update_between else x
        b, s, _ = x.shape
        pos = torch.arange(s, device=x.device)[None]
        th = (self.inv_freq[None, :, None].float() @ pos[:, None, :].float()).transpose(1, 2)
        emb = torch.cat((th, th), dim=-1)
        cos, sin = emb.cos().unsqueeze(2), emb.sin().unsqueeze(2)

        def rotate_half(t):
            t1, t2 = t.chunk(2, dim=-1)
            return torch.cat((-t2, t1), dim=-1)
        q = self.q(x).view(b, s, 4, 8)
        if self.update_between:
            x.add_(1.0)
        k = self.k(x).view(b, s, 2, 8)
        v = self.v(x).view(b, s, 2, 8)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
            enable_gqa=True)
        return o.transpose(1, 2).reshape(b, s, 32)

    def rotated_heads(self, x, cos, sin):
        """q, k rotated by cos/sin [.., 1, s, 8] (halves sliced), and v: heads first."""
        b, s, _ = x.shape

        def rotate_half(t):
            return torch.cat((-t[..., 4:], t[..., :4]), dim=-1)
        q = self.q(x).view(b, s, 4, 8).transpose(1, 2)
        k = self.k(x).view(b, s, 2, 8).transpose(1, 2)
        v = self.v(x).view(b, s, 2, 8).transpose(1, 2)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v


def test_chunk_spelling_heads_after_sequence():
    m = ChunkSpelling().train()
    x = torch.randn(2, 6, 32)
    ref = copy.deepcopy(m)
    fast = coda_rewrite.optimize(m)
    got, want = fast(x), ref(x)
    (r,) = rope_records(fast.report)
    # a training graph: the angles read as one table (angles_as_table)
    assert r.programs[0].name == "rope_table" and len(r.consumers) == 3, str(fast.report)
    assert unpermuted(fast.report) == []  # through the transposes into SDPA: invariant
    assert rel_err(got, want) <= 1e-5
    got.square().sum().backward()
    want.square().sum().backward()
    for (name, p), (_, q) in zip(m.named_parameters(), ref.named_parameters()):
        assert rel_err(p.grad, q.grad) <= 1e-4, name


class BroadcastAngles(ChunkSpelling):
    """transformers 5.25's angles: ``position_ids[..., None].float() * inv_freq`` (a
    broadcast product, no matmul); ``freqs``: "batch" gives each sequence its own
    frequencies (no outer product: read as a table)."""

    def __init__(self, freqs: str = "shared"):
        super().__init__()
        self.freqs = freqs

    def forward(self, x, pos):
        b, s, _ = x.shape
        inv = self.inv_freq.to(device=x.device, dtype=torch.float)
        if self.freqs == "batch":
            inv = inv * torch.arange(1, b + 1, dtype=torch.float)[:, None, None]
        th = pos[..., None].float() * inv
        emb = torch.cat((th, th), dim=-1)
        q, k, v = self.rotated_heads(x, emb.cos().unsqueeze(1), emb.sin().unsqueeze(1))
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                             enable_gqa=True)
        return o.transpose(1, 2).reshape(b, s, 32)


@pytest.mark.parametrize("freqs", ["shared", "batch"])
@pytest.mark.parametrize("per_sequence", [False, True])
def test_angles_as_a_broadcast_product(freqs, per_sequence):
    """θ = pos[..., None] · inv_freq is the outer product whose angles the rewrite forms
    itself (per-sequence positions included; in this training graph as one table made
    from pos and inv_freq); frequencies that vary with the sequence are not one, and the
    rotation reads the model's cos/sin as a table. Training step against eager."""
    m = BroadcastAngles(freqs).train()
    x = torch.randn(2, 6, 32)
    pos = torch.stack((torch.arange(6), torch.arange(6) * 3 + 5)) if per_sequence \
        else torch.arange(6)[None]
    ref = copy.deepcopy(m)
    fast = coda_rewrite.optimize(m)
    got, want = fast(x, pos), ref(x, pos)
    (r,) = rope_records(fast.report)
    assert r.programs[0].name == "rope_table", str(fast.report)
    assert ("made once" in r.backward) == (freqs == "shared"), str(fast.report)
    assert rel_err(got, want) <= 1e-5
    got.square().sum().backward()
    want.square().sum().backward()
    for (name, p), (_, q) in zip(m.named_parameters(), ref.named_parameters()):
        assert rel_err(p.grad, q.grad) <= 1e-4, name


def test_a_rotated_value_updated_in_place_is_left_alone():
    class Scaled(ChunkSpelling):
        def forward(self, x):
            b, s, _ = x.shape
            pos = torch.arange(s)[None]
            th = (self.inv_freq[None, :, None].float() @ pos[:, None, :].float()).transpose(1, 2)
            emb = torch.cat((th, th), dim=-1)
            q, k, v = self.rotated_heads(x, emb.cos()[:, None], emb.sin()[:, None])
            q.mul_(0.5)
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    m = Scaled().eval()
    x = torch.randn(2, 6, 32)
    with torch.no_grad():
        fast = coda_rewrite.optimize(m)
        assert rel_err(fast(x), m(x)) <= 1e-5
    (r,) = [r for r in fast.report.records if r.pattern == "rope"]
    assert r.status != "rewritten" and r.code == "rope.permuted_in_place", str(fast.report)


def test_per_sequence_positions():
    """position_ids that differ per sequence (left padding, packed documents): each GEMM
    row gets its own sequence's position."""
    model = hf_model("qwen2", layers=2).eval()
    ids = tokens(seq=10)
    pos = torch.stack((torch.arange(10), torch.arange(10) * 3 + 5))
    got, want, report = eager_and_rewritten(model, ids, position_ids=pos, use_cache=False)
    assert len(rope_records(report)) == 2, str(report)
    assert rel_err(got.logits, want.logits) <= 1e-5


def test_yarn_attention_scaling_keeps_v_in_the_gemm():
    model = hf_model("llama", layers=1, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}).eval()
    ids = tokens(seq=24)
    got, want, report = eager_and_rewritten(model, ids, use_cache=False)
    got, want = got.logits, want.logits
    (r,) = rope_records(report)
    assert "scaled by" in r.decision.render()
    assert len(r.consumers) == 3  # the scale is per column: 1 on v's
    assert rel_err(got, want) <= 1e-5


def test_dynamic_shapes_run_time_scaling():
    """Under dynamic=True dynamo lifts the rotary module's attention_scaling to a graph
    input (a run-time scalar): it becomes the per-column scale, v still joins."""
    model = hf_model("llama", layers=2).eval()
    backend = coda_rewrite.CodaBackend(coda_rewrite.Options(inductor=False))
    compiled = torch.compile(model, backend=backend, dynamic=True)
    with torch.no_grad():
        for seq in (12, 20):
            ids = tokens(seq=seq)
            assert rel_err(compiled(ids, use_cache=False).logits,
                           model(ids, use_cache=False).logits) <= 1e-5
    done = [r for g in backend.report.graphs for r in rope_records(g)]
    assert len(done) == 2 * len(backend.report.graphs), str(backend.report)
    assert all("run-time scalar" in r.decision.render() and len(r.consumers) == 3
               for r in done)


def test_partial_rotary_phi():
    model = hf_model("phi3", layers=2, partial_rotary_factor=0.5).eval()
    got, want, report = eager_and_rewritten(model, tokens(), use_cache=True)
    assert len(rope_records(report)) == 2, str(report)
    assert rel_err(got.logits, want.logits) <= 1e-5
    assert rel_err(got.past_key_values.layers[1].keys, want.past_key_values.layers[1].keys) \
        <= 1e-5


def test_bfloat16_no_worse_than_eager():
    reports = []

    def rewrite(model):
        fast = coda_rewrite.optimize(model)
        reports.append(fast)
        return fast
    res = low_precision_errors(lambda seed: build("llama", layers=2, seed=seed),
                               (tokens(seq=32),), rewrite, seeds=(0, 1, 2))
    assert all(len(rope_records(f.report)) == 2 for f in reports)
    assert res["ok"], res


def test_q_read_before_rotation_is_left_alone():
    """A model that also returns the unrotated q: the fused GEMM would not write it."""
    import torch.nn as nn

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v = (nn.Linear(32, 32, bias=False) for _ in range(3))
            inv = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
            self.register_buffer("inv_freq", inv)

        def forward(self, x, pos):
            b, s, _ = x.shape
            q = self.q(x).view(b, s, 4, 8).transpose(1, 2)
            k = self.k(x).view(b, s, 4, 8).transpose(1, 2)
            v = self.v(x).view(b, s, 4, 8).transpose(1, 2)
            th = (self.inv_freq[None, :, None].expand(b, -1, 1)
                  @ pos[:, None, :].float()).transpose(1, 2)
            emb = torch.cat((th, th), -1)
            cos, sin = emb.cos()[:, None], emb.sin()[:, None]

            def rot(t):
                return torch.cat((-t[..., 4:], t[..., :4]), -1)
            qe, ke = q * cos + rot(q) * sin, k * cos + rot(k) * sin
            o = torch.nn.functional.scaled_dot_product_attention(qe, ke, v, is_causal=True)
            return o, q

    m = Attn()
    x, pos = torch.randn(2, 6, 32), torch.arange(6)[None].expand(2, 6)
    report = coda_rewrite.explain(m, x, pos)
    rej = [r for r in report.records if r.pattern == "rope"]
    assert rej and rej[0].status != "rewritten", str(report)
    assert rej[0].code == "rope.unrotated_read", rej[0].reason
    with torch.no_grad():
        fast = coda_rewrite.optimize(m)
        for a, b in zip(fast(x, pos), m(x, pos)):
            assert rel_err(a, b) <= 1e-6


@pytest.mark.parametrize("layers", [1, 3])
def test_complex_form_rotates_in_the_epilogue_from_the_table(layers):
    """The plain Llama (TorchTitan's view_as_complex over a precomputed table): q and k
    in one GEMM reading (cos, sin) rows of the model's table, no permutation, v in the
    same GEMM under a 0 rotate flag."""
    report = step_matches_eager("plain", layers=layers)
    done = rope_records(report)
    assert len(done) == layers, str(report)
    for r in done:
        assert r.programs[0].name == "rowscale_rope_table" and len(r.consumers) == 3, r.consumers
        assert "no permutation" in r.decision.render() and "witness replay" in \
            r.decision.render(), r.decision.render()
    assert unpermuted(report) == []


def hf_tables(inv_freq, x, head_axis: int):
    """Hugging Face's cos/sin of cat(θ, θ) at x's positions ([1, S, d], in inv_freq's
    dtype), unsqueezed at the head axis: 1 where the heads come before the sequence."""
    pos = torch.arange(x.shape[1], device=x.device)[None]
    th = (inv_freq[None, :, None] @ pos[:, None, :].to(inv_freq.dtype)).transpose(1, 2)
    emb = torch.cat((th, th), dim=-1)
    return emb.cos().unsqueeze(head_axis), emb.sin().unsqueeze(head_axis)


def rotate_half(t):
    h = t.shape[-1] // 2
    return torch.cat((-t[..., h:], t[..., :h]), dim=-1)


class PackedProjection(torch.nn.Module):
    """A packed q/k/v projection of 32 features into ``width`` columns, and the inverse
    frequencies of 8-wide heads (in ``dtype``): the base of the hand-written look-alikes."""

    def __init__(self, width: int, dtype=torch.float32):
        super().__init__()
        self.qkv = torch.nn.Linear(32, width, bias=False)
        self.register_buffer("inv_freq",
                             1.0 / (10000 ** (torch.arange(0, 8, 2, dtype=dtype) / 8)))


class PackedWideRotation(PackedProjection):
    """Packed q/k/v whose rotation runs in float64 (a float64 angle table): v stays
    float32, so it cannot share the fused GEMM's float64 output."""

    def __init__(self):
        super().__init__(64, torch.float64)

    def forward(self, x):
        b, s, _ = x.shape
        cos, sin = hf_tables(self.inv_freq, x, 1)
        qkv = self.qkv(x)
        q = qkv[..., :32].view(b, s, 4, 8).transpose(1, 2)
        k = qkv[..., 32:48].view(b, s, 2, 8).transpose(1, 2)
        v = qkv[..., 48:].view(b, s, 2, 8).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        # q and k stay float64 (a cast back to float32 here would be the rotation's
        # output dtype, and v could join)
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v.double(), is_causal=True, enable_gqa=True).float()


def test_packed_columns_that_cannot_join_get_their_own_gemm():
    """A packed projection's slice the fused GEMM cannot write (v in another dtype than
    the rotated q and k) is computed by a GEMM over its rows of the live weight; outputs
    and the weight's gradient (from both GEMMs) match eager."""
    m = PackedWideRotation().train()
    ref = copy.deepcopy(m)
    fast = coda_rewrite.optimize(m)
    x = torch.randn(2, 6, 32)
    got, want = fast(x), ref(x)
    assert rel_err(got, want) <= 1e-6
    got.square().sum().backward()
    want.square().sum().backward()
    assert rel_err(m.qkv.weight.grad, ref.qkv.weight.grad) <= 1e-6
    (r,) = rope_records(fast.report)
    assert len(r.consumers) == 2 and "gets a GEMM of its own" in r.decision.render(), str(r)


def test_late_pure_inputs_move_up_and_others_refuse():
    """The fused GEMM must precede every reader of its outputs: pure values it reads that
    are computed later (TorchTitan's table made complex inside q's rotation, after v's
    reshape) move up with what they are computed from; anything else refuses before the
    graph changes."""
    import torch.fx as fx
    import torch.nn as nn

    from coda_rewrite.graph_utils import NotPlaceable, hoist_before

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, t):
            early = x.relu()            # reads the output: the fused call must come first
            table = t.float().cos()     # read by the fused call, computed after
            late = self.lin(t)          # a module call: not known to be pure
            bumped = t.mul(2).add_(1)   # an in-place update: order matters
            return early + table + late + bumped

    gm = fx.symbolic_trace(M())
    nodes = {n.name: n for n in gm.graph.nodes}
    hoist_before(nodes["relu"], [nodes["cos"]])
    names = [n.name for n in gm.graph.nodes]
    assert names.index("float_1") < names.index("cos") < names.index("relu"), names
    gm.graph.lint()
    for late in ("lin", "add_"):
        with pytest.raises(NotPlaceable, match="cannot move up"):
            hoist_before(nodes["relu"], [nodes[late]])
        assert [n.name for n in gm.graph.nodes] == names  # untouched


# ---- layouts, frequencies, kernel-level math ----------------------------------------

def _interleaved_rows(n_heads, head_dim, rotary_dim):
    """The per-head row order, spelled out: [x0, x_h, x1, x_h+1, ..., pass-through]."""
    h = rotary_dim // 2
    head = [i for f in range(h) for i in (f, f + h)] + list(range(rotary_dim, head_dim))
    return torch.tensor([k * head_dim + i for k in range(n_heads) for i in head])


@pytest.mark.parametrize("head_dim,rotary_dim", [(8, 8), (8, 4), (6, 6)])
def test_interleave_and_unpermute_are_inverse(head_dim, rotary_dim):
    w = torch.randn(3 * head_dim, 5)
    inter = layouts.rope_segments(((0, 3 * head_dim, 3, head_dim, rotary_dim),), w)
    assert torch.equal(inter, w[_interleaved_rows(3, head_dim, rotary_dim)])
    back = layouts.rope_unpermute(inter.T.unflatten(-1, (3, head_dim)), head_dim, rotary_dim)
    assert torch.equal(back.flatten(-2).T, w)


def test_segments_are_written_in_place_with_their_gradient():
    """rope_segments writes each permuted segment straight into the fused weight (one
    pass): the rows of each source in the spelled-out order, and the gradient back."""
    lay = ((0, 48, 3, 16, 8), (0, 32, 2, 16, 16), (0, 32, 0, 0, 0))
    ws = [torch.randn(n, 5, requires_grad=True) for n in (48, 32, 32)]
    got = layouts.rope_segments(lay, *ws)
    want = torch.cat((ws[0][_interleaved_rows(3, 16, 8)], ws[1][_interleaved_rows(2, 16, 16)],
                      ws[2]))
    assert torch.equal(got, want)
    g = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad(got, ws, g), torch.autograd.grad(want, ws, g)):
        assert torch.equal(a, b)
    bias = layouts.rope_segments(lay, torch.ones(48), None, torch.ones(32))  # k has no bias
    assert not bias[48:80].any() and bias[:48].all() and bias[80:].all()


def test_segments_without_autograd_move_rows_as_words():
    """Outside autograd the re-layout copies rows as 8-byte words (a strided copy moves
    one element per step); same bytes, and the element path wherever rows are not whole
    aligned words or a gradient is wanted."""
    lay = ((0, 48, 3, 16, 8), (0, 32, 2, 16, 16), (0, 32, 0, 0, 0))
    for k, dtype in ((8, torch.bfloat16), (12, torch.float32), (5, torch.bfloat16)):
        ws = [torch.randn(n, k).to(dtype) for n in (48, 32, 32)]
        want = torch.cat((ws[0][_interleaved_rows(3, 16, 8)], ws[1][_interleaved_rows(2, 16, 16)],
                          ws[2]))
        with torch.no_grad():
            assert torch.equal(layouts.rope_segments(lay, *ws), want)
            out, _ = layouts._as_row_words(torch.empty(4, k, dtype=dtype), ws)
        assert (out.dtype == torch.int64) == (k * dtype.itemsize % 8 == 0)
    w = torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True)
    out, _ = layouts._as_row_words(torch.empty(4, 8, dtype=torch.bfloat16), [w])
    assert out.dtype == torch.bfloat16  # autograd sees the element copy


def test_frequencies_kept_until_the_buffer_changes(monkeypatch):
    """Run eagerly, the per-column frequencies are computed once per inv_freq buffer (not a
    dozen launches per call) and again when the buffer changes in place."""
    computed = []
    inner = layouts.rope_frequencies
    monkeypatch.setattr(layouts, "rope_frequencies",
                        lambda *a: computed.append(1) or inner(*a))
    model = build("llama", layers=2).eval()
    fast = coda_rewrite.optimize(model)
    ids = tokens()
    with torch.no_grad():
        fast(ids, use_cache=False)  # capture, rewrite (the witness replays), first call
        computed.clear()
        fast(ids, use_cache=False)
        assert computed == []
        model.model.rotary_emb.inv_freq.mul_(0.5)
        got, want = fast(ids, use_cache=False).logits, model(ids, use_cache=False).logits
    assert len(computed) == 1
    assert rel_err(got, want) <= 1e-5


def test_frequencies_are_float_float_turns():
    inv = 1.0 / (500000.0 ** (torch.arange(0, 128, 2).float() / 128))
    f = layouts.rope_frequencies(inv, ((0, 256, 2, 128, 128), (256, 384, 0, 0, 0)))
    assert f.dtype == torch.float32 and f.shape == (384,)
    turns = f[0:128:2].double() + f[1:128:2].double()
    assert torch.allclose(turns, inv.double() / (2 * math.pi), rtol=1e-14, atol=0)
    assert torch.equal(f[:128], f[128:256]) and not f[256:].any()


def test_reference_rotation_at_large_positions():
    """The kernel forms the angle in float-float turns; the reference in float64: both
    stay accurate where a float32 angle (eager's) loses whole radians."""
    x = torch.randn(4, 8, dtype=torch.float64)
    inv = torch.tensor([1.0, 0.5, 0.1, 0.01])
    pos = torch.tensor([0.0, 1.0, 2.0 ** 20, 2.0 ** 24 - 1]).reshape(-1, 1)
    freq = layouts.rope_frequencies(inv, ((0, 8, 1, 8, 8),)).reshape(1, -1)
    got = op_table.rotate_pairs(x, pos, freq)

    def rotate(th):
        th = th.double()
        return torch.stack((x[:, 0::2] * th.cos() - x[:, 1::2] * th.sin(),
                            x[:, 0::2] * th.sin() + x[:, 1::2] * th.cos()), -1).flatten(-2)
    want = rotate(pos.double() * inv.double().reshape(1, -1))
    assert rel_err(got, want) <= 1e-8  # float64 angles of ~1e7 radians: ~1e-9 apart
    assert (rotate(pos.float() * inv.reshape(1, -1)) - want).abs().max() > 1e-2


def test_angle_table_rows_at_large_positions_and_partial_rotary():
    """rope_angle_table_rows: row i holds (cos, sin) of pos[i]·inv_freq[p] at (2p, 2p+1),
    the angle reduced in float64 (accurate where a float32 angle loses whole radians),
    and (1, 0) on the features a partial rotary passes through."""
    inv = torch.tensor([1.0, 0.5, 0.1, 0.01])
    pos = torch.tensor([0.0, 1.0, 2.0 ** 20, 2.0 ** 24 - 1])
    table = layouts.rope_angle_table_rows(pos, inv, 12, rotary_offset=2)
    assert table.dtype == torch.float32 and table.shape == (4, 12)
    theta = pos.double().reshape(-1, 1) * inv.double()
    assert torch.allclose(table[:, 2:10:2].double(), theta.cos(), atol=1e-7, rtol=0)
    assert torch.allclose(table[:, 3:10:2].double(), theta.sin(), atol=1e-7, rtol=0)
    ident = torch.tensor([1.0, 0.0]).repeat(4, 1)
    assert torch.equal(table[:, :2], ident) and torch.equal(table[:, 10:12], ident)
    # the same rotation as the per-column angles the epilogue forms in inference graphs
    x = torch.randn(4, 24, dtype=torch.float64)
    freq = layouts.rope_frequencies(inv, ((0, 24, 2, 12, 8, 2, 0),)).reshape(1, -1)
    assert rel_err(op_table.rotate_pairs_by_table(x, table.double()),
                   op_table.rotate_pairs(x, pos.reshape(-1, 1), freq)) <= 1e-7


def test_training_graphs_read_the_angles_as_one_table():
    """A training graph reads the angles pos ⊗ inv_freq as one (cos, sin) table, made once
    for all its layers, which the backward's inverse rotation reads too: no angle is
    recomputed per column in either direction. An inference graph forms them in the
    epilogue (rope); an attention scaling (YaRN) keeps them there in training too.
    Training steps against eager."""
    report = step_matches_eager("llama", layers=3)
    done = rope_records(report)
    assert len(done) == 3 and all(r.programs[0].name.endswith("rope_table") for r in done), \
        str(report)
    assert all("made once" in r.backward for r in done)
    code = "".join(g.rewritten_code for g in report.graphs)
    assert code.count("rope_angle_table_rows(") == 1, code  # one table, three layers
    _, _, inference = eager_and_rewritten(hf_model("llama", layers=2).eval(), tokens())
    assert [r.programs[0].name[-5:] for r in rope_records(inference)] == ["_rope"] * 2
    yarn = hf_model("llama", layers=1, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16})
    (scaled,) = rope_records(step_matches_eager("llama", model=yarn))
    assert scaled.programs[0].name.endswith("_rope") and not scaled.backward


@pytest.mark.provokes_pass_bug
def test_the_witness_checks_the_training_table(monkeypatch):
    """A table off by one position is caught by the float64 witness: the rotation is
    left to eager's ops (the step still matches eager), never fused wrong."""
    made = layouts.rope_angle_table_rows
    monkeypatch.setattr(layouts, "rope_angle_table_rows",
                        lambda pos, *a, **k: made(pos + 1, *a, **k))
    report = step_matches_eager("llama")
    refused = [r for r in report.records if r.pattern == "rope" and r.status != "rewritten"]
    assert not rope_records(report) and len(refused) == 2, str(report)
    assert all("witness disagrees" in r.reason for r in refused), [r.reason for r in refused]


@pytest.mark.parametrize("form,has_r,has_bias,scale", [
    (form, *case) for form in ("angles", "table")
    for case in [(False, False, 1.0), (True, False, 1.0), (True, True, 1.0)]
] + [("angles", False, True, 1.3)])  # (a table carries its own scale)
def test_rope_backward_rule_matches_autograd(form, has_r, has_bias, scale):
    torch.manual_seed(0)
    prog = rope_program(has_r, has_bias, scale != 1.0, torch.float64) if form == "angles" else \
        rope_table_program(has_r, has_bias, torch.float64)
    assert backward._rule(prog) is not None
    a, b = torch.randn(6, 5, dtype=torch.float64), torch.randn(16, 5, dtype=torch.float64)
    operands = ([torch.rand(6, dtype=torch.float64) + 0.5] if has_r else []) + \
        ([torch.randn(16, dtype=torch.float64)] if has_bias else [])
    if form == "angles":
        lay = ((0, 8, 1, 8, 8), (8, 16, 0, 0, 0))
        colscale = [layouts.rope_column_scale(scale, lay, a).double()] if scale != 1.0 else []
        angle = colscale + [torch.arange(6).float() * 3,
                 layouts.rope_frequencies(torch.rand(4) + 0.1, lay)]
    else:
        th = torch.randn(6, 4, dtype=torch.float64)
        angle = [torch.stack((th.cos(), th.sin()), -1).flatten(1)]  # [M, head_dim 8]
    operands += angle
    dout = torch.randn(6, 16, dtype=torch.float64)
    outs = reference.run_program(prog, a, b, operands)
    got = backward.vjp(prog, a, b, operands, outs, [dout])
    want = backward._general_vjp(prog, a, b, operands, outs, [dout])
    n = len(angle)  # (positions, frequencies, tables and scales get no gradient)
    for g, w in zip([got[0], got[1], *got[2][:-n]], [want[0], want[1], *want[2][:-n]]):
        assert rel_err(g, w) <= 1e-12
    assert [o.kind for o in prog.outputs] == [Kind.TILE]


def test_table_rotation_matches_complex_product():
    th = torch.randn(2, 5, 4, dtype=torch.float64)          # [B, S, hd/2]
    table = torch.polar(torch.ones_like(th[0]), th[0])       # the model's [S, hd/2]
    x = torch.randn(2, 5, 3 * 8, dtype=torch.float64)        # 3 heads of 8
    rows = layouts.rope_table_rows(table, x)
    assert rows.shape == (10, 8) and rows.dtype == torch.float32
    got = op_table.rotate_pairs_by_table(x.reshape(10, 24), rows.double())
    xc = torch.view_as_complex(x.reshape(2, 5, 3, 4, 2))
    want = torch.view_as_real(xc * table[None, :, None]).flatten(-3)
    assert rel_err(got.reshape(2, 5, 24), want) <= 1e-6  # the table rows are float32


# ---- interleaved pairs: x[..., 0::2] / x[..., 1::2] (GLM, Cohere, Helium, GPT-J, Ernie) ----

INTERLEAVED = ("glm", "helium", "cohere", "gptj", "ernie4_5")


@pytest.mark.parametrize("family", INTERLEAVED)
def test_interleaved_pairs_rotate_in_the_epilogue_without_a_permutation(family):
    """Adjacent pairs are the epilogue's own layout: q/k/v in one GEMM whose epilogue
    reads the model's tables, no weight permutation, the pairing checked on the device;
    the training step's loss and every gradient against eager."""
    report = step_matches_eager(family)
    done = rope_records(report)
    assert len(done) == 2, str(report)
    for r in done:
        assert r.programs[0].name.endswith("rope_table"), r.programs[0].name
        assert any("not rotated" in c for c in r.consumers), r.consumers  # v joins
        text = r.decision.render()
        assert "rotate_pairs(x)" in text and "no permutation" in text, text
        assert "checked on the device" in text, text
    assert unpermuted(report) == []


def test_interleaved_bfloat16_no_worse_than_eager():
    reports = []

    def rewrite(model):
        fast = coda_rewrite.optimize(model)
        reports.append(fast)
        return fast
    res = low_precision_errors(lambda seed: build("glm", layers=2, seed=seed),
                               (tokens(seq=32),), rewrite, seeds=(0, 1, 2))
    assert all(len(rope_records(f.report)) == 2 for f in reports)
    assert res["ok"], res


class PairRotation(torch.nn.Module):
    """A hand-written interleaved rotation and its look-alikes: ``variant`` "ok" is
    GLM's rotate_half; the others compute something else that looks the same."""

    def __init__(self, variant: str = "ok"):
        super().__init__()
        self.variant = variant
        self.q, self.k, self.v = (torch.nn.Linear(32, 32, bias=False) for _ in range(3))

    def rotate_pairs(self, t):
        even, odd = t[..., 0::2], t[..., 1::2]
        if self.variant == "sign_on_even":    # (x[2p+1], −x[2p]): R(−θ), not R(θ)
            return torch.stack((odd, -even), dim=-1).flatten(-2)
        if self.variant == "pairs_not_swapped":  # (−x[2p], x[2p+1]): no rotation
            return torch.stack((-even, odd), dim=-1).flatten(-2)
        if self.variant == "stacked_as_halves":  # stack on dim -2: the half-split layout
            return torch.stack((-odd, even), dim=-2).flatten(-2)
        return torch.stack((-odd, even), dim=-1).flatten(-2)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, 4, 8).transpose(1, 2) for p in (self.q, self.k, self.v))
        c, sn = cos[:, None], sin[:, None]
        qe = q * c + self.rotate_pairs(q) * sn
        ke = k * c + self.rotate_pairs(k) * sn
        return torch.nn.functional.scaled_dot_product_attention(qe, ke, v, is_causal=True)


def _pair_tables(seq: int, spread: bool = False):
    th = torch.randn(1, seq, 4, generator=torch.Generator().manual_seed(3)) * 3
    th = th.repeat_interleave(2, -1)
    if spread:  # the two features of a pair at different angles: not a rotation
        th = th + torch.arange(8.0) * 0.1
    return th.cos(), th.sin()


def test_interleaved_look_alikes_are_left_and_computed_as_eager():
    x = torch.randn(2, 6, 32)
    tables = _pair_tables(6)
    for variant in ("ok", "sign_on_even", "pairs_not_swapped", "stacked_as_halves"):
        torch._dynamo.reset()
        m = PairRotation(variant)
        fast = coda_rewrite.optimize(m)
        with torch.no_grad():
            assert rel_err(fast(x, *tables), m(x, *tables)) <= 1e-5, variant
        assert len(rope_records(fast.report)) == (variant == "ok"), (variant, str(fast.report))


def test_interleaved_tables_whose_pairs_differ_fail_loudly():
    m = PairRotation()
    x = torch.randn(2, 6, 32)
    fast = coda_rewrite.optimize(m)
    with torch.no_grad():
        assert rel_err(fast(x, *_pair_tables(6)), m(x, *_pair_tables(6))) <= 1e-5
        with pytest.raises(RuntimeError, match="differ within a pair"):
            fast(x, *_pair_tables(6, spread=True))


def test_pair_table_rows_take_each_pairs_values_and_pass_the_rest():
    cos, sin = _pair_tables(5)
    rows = layouts.rope_pair_table_rows(cos[..., :4], sin[..., :4], torch.empty(3, 5, 1), 8, 4)
    assert rows.shape == (15, 8)
    want = torch.stack((cos[0, :, 0:4:2], sin[0, :, 0:4:2]), -1).flatten(-2)
    assert torch.equal(rows[:5, :4], want) and torch.equal(rows[5:10, :4], want)
    assert torch.equal(rows[:, 4:], torch.tensor([1.0, 0.0, 1.0, 0.0]).expand(15, 4))


# ---- the rotation written out over the halves (gpt-oss) ------------------------------------

def test_gpt_oss_written_out_rotation_is_the_half_split_one():
    """gpt-oss: x1, x2 = chunk(x, 2); cat((x1·cos − x2·sin, x2·cos + x1·sin)) with cos/sin
    of θ itself (half width, YaRN-scaled): the half-split form, angles recomputed in the
    epilogue; the training step against eager."""
    report = step_matches_eager("gpt_oss")
    done = rope_records(report)
    assert len(done) == 2, str(report)
    for r in done:
        assert r.programs[0].name == "rowscale_rope", r.programs[0].name
        text = r.decision.render()
        assert "cos/sin of θ (the rotation written out" in text and "scaled by" in text, text


class WrittenRotation(torch.nn.Module):
    """gpt-oss's spelling with cos/sin given (a table: a layer compiled alone) and its
    look-alikes."""

    def __init__(self, variant: str = "ok"):
        super().__init__()
        self.variant = variant
        self.q, self.k, self.v = (torch.nn.Linear(32, 32, bias=False) for _ in range(3))

    def rotate(self, t, cos, sin):
        if self.variant == "pairs":  # DeepSeek-V3's spelling
            a, b = t[..., 0::2], t[..., 1::2]
        elif self.variant == "mixed":  # a parity and a half: no rotation at all
            a, b = t[..., 0::2], t[..., t.shape[-1] // 2:]
        else:
            a, b = torch.chunk(t, 2, dim=-1)
        if self.variant == "sign":          # R(−θ)
            return torch.cat((a * cos + b * sin, b * cos - a * sin), dim=-1)
        if self.variant == "halves_swapped":  # the halves' roles exchanged: R(−θ) again,
            return torch.cat((b * cos - a * sin, a * cos + b * sin), dim=-1)  # reordered
        if self.variant == "sin_cos_mixed":  # sin where cos belongs in one half
            return torch.cat((a * cos - b * sin, b * sin + a * sin), dim=-1)
        return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, 4, 8).transpose(1, 2) for p in (self.q, self.k, self.v))
        c, sn = cos[:, None], sin[:, None]
        return torch.nn.functional.scaled_dot_product_attention(
            self.rotate(q, c, sn), self.rotate(k, c, sn), v, is_causal=True)


def test_written_rotation_from_tables_and_look_alikes():
    x = torch.randn(2, 6, 32)
    th = torch.randn(1, 6, 4, generator=torch.Generator().manual_seed(1)) * 3
    tables = (th.cos(), th.sin())
    for variant in ("ok", "pairs", "sign", "halves_swapped", "sin_cos_mixed", "mixed"):
        torch._dynamo.reset()
        m = WrittenRotation(variant).train()
        ref = copy.deepcopy(m)
        fast = coda_rewrite.optimize(m)
        got, want = fast(x, *tables), ref(x, *tables)
        assert rel_err(got, want) <= 1e-5, variant
        got.square().sum().backward()
        want.square().sum().backward()
        grads_match(m, ref)
        done = rope_records(fast.report)
        assert len(done) == (variant in ("ok", "pairs")), (variant, str(fast.report))
        if done:
            assert done[0].programs[0].name == "rope_table"
            assert "one angle per rotation pair" in done[0].decision.render()


# ---- q, k, v packed per head in one projection (GPT-NeoX) -----------------------------------

def test_gpt_neox_per_head_packed_qkv():
    """GPT-NeoX: query_key_value(x).view(b, s, h, 3d).transpose(1, 2).chunk(3, -1): each
    head's [q_h, k_h, v_h] side by side. q, k and v are gathered per head into one fused
    GEMM (partial rotary, biases), v joins under a 0 rotate flag (the training graph reads
    the angles as one table); the training step against eager."""
    report = step_matches_eager("gpt_neox")
    done = rope_records(report)
    assert len(done) == 2, str(report)
    for r in done:
        assert r.programs[0].name == "rope_table"
        assert len(r.consumers) == 3 and "not rotated" in r.consumers[2], r.consumers
        assert "3 segments" in r.decision.render()


def test_gpt_neox_decoding_with_a_cache_gets_eager_order_back():
    """The returned key cache is in eager's feature order (the permuted region's edge)."""
    model = build("gpt_neox", layers=2).eval()
    fast = coda_rewrite.optimize(copy.deepcopy(model))
    decode_matches_eager(model, fast, tokens(seq=8))
    assert len(rope_records(fast.report)) >= 2, str(fast.report)


def test_member_rows_of_a_per_head_packed_weight():
    """rope_segments' member layout: member i of each head's group, in head order; the
    rotated member permuted per head like a plain segment."""
    h, g, d, k = 3, 3, 4, 5
    w = torch.arange(h * g * d * k, dtype=torch.float32).reshape(h * g * d, k)
    v_rows = torch.cat([w[j * g * d + 2 * d:j * g * d + 3 * d] for j in range(h)])
    got = layouts.rope_segments(((2 * h * d, 3 * h * d, 0, 0, 0, h, g, 2, 3, d),), w)
    assert torch.equal(got, v_rows)
    q_rows = torch.cat([w[j * g * d:j * g * d + d] for j in range(h)])
    plain = layouts.rope_segments(((0, h * d, h, d, d),), q_rows)
    member = layouts.rope_segments(((0, h * d, h, d, d, h, g, 0, 1, d),), w)
    assert torch.equal(member, plain)


class ChunkOverHeads(PackedProjection):
    """A look-alike: the packed projection chunked over the heads dim, not within each
    head (q = the first third of the heads' full groups): not a per-head member."""

    def __init__(self):
        super().__init__(96)

    def forward(self, x):
        b, s, _ = x.shape
        cos, sin = hf_tables(self.inv_freq, x, 1)
        heads = self.qkv(x).view(b, s, 12, 8).transpose(1, 2)
        q, k, v = heads.chunk(3, dim=1)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def exact_rope_rewrites(m) -> list:
    """The RoPE rewrites optimize() makes on module ``m`` (input [2, 6, 32]), after
    checking its output against eager's."""
    x = torch.randn(2, 6, 32)
    fast = coda_rewrite.optimize(m)
    with torch.no_grad():
        assert rel_err(fast(x), m(x)) <= 1e-6
    return rope_records(fast.report)


def test_chunk_over_heads_is_not_a_per_head_member():
    assert not exact_rope_rewrites(ChunkOverHeads())


@pytest.mark.parametrize("layout", ["multi_query", "per_head", "grouped"])
def test_falcon_heads_indexed_out_of_the_packed_projection(layout):
    """Falcon's three head layouts of its packed query_key_value: multi-query
    (view(b, s, h + 2, d): q = [..., :-2, :], k = [..., [-2], :], v = [..., [-1], :]),
    per head (view(b, s, h, 3, d)[..., i, :]) — both rewritten, the heads gathered into
    one fused GEMM — and the grouped "new decoder architecture" (k broadcast to every q
    head before the rotation): left, exact. The training step against eager."""
    overrides = {"multi_query": dict(multi_query=True),
                 "per_head": dict(multi_query=False, num_kv_heads=4),
                 "grouped": dict(new_decoder_architecture=True, num_kv_heads=2)}[layout]
    report = step_matches_eager("falcon", model=hf_model("falcon", layers=2, **overrides))
    done = rope_records(report)
    assert len(done) == 2, str(report)
    for r in done:
        assert any("not rotated" in c for c in r.consumers), r.consumers  # v joins


def witness_refuses(model, skip: tuple = (), **call) -> None:
    """optimize(model) computes eager's logits, and every RoPE match (but those left with
    a code in ``skip``) is refused by the float64 replay: a pass bug provoked on purpose
    is caught by the witness, not let through."""
    ids = tokens()
    fast = coda_rewrite.optimize(copy.deepcopy(model))
    with torch.no_grad():
        assert rel_err(fast(ids, **call).logits, model(ids, **call).logits) <= 1e-5
    refused = [r for r in fast.report.records if r.pattern == "rope" and r.code not in skip]
    assert refused and not rope_records(fast.report), str(fast.report)
    assert all("witness disagrees" in r.reason for r in refused), [r.reason for r in refused]


@pytest.mark.provokes_pass_bug
@pytest.mark.parametrize("family,split_name,call", [
    ("gpt_neox", "_member_split", {}), ("codegen", "_block_split", {"use_cache": False})])
def test_the_witness_checks_a_gather_against_the_models_own_split(family, split_name, call,
                                                                   monkeypatch):
    """The witness takes eager's q, k, v through the model's own split nodes, not
    through the pattern's reading of them: a misread member of GPT-NeoX's per-head
    [q, k, v] or of CodeGen's blocks (each item read as the next one) is refused by the
    float64 replay, and the model computes what eager computes."""
    from coda_rewrite.patterns import rope as rope_pattern
    split = getattr(rope_pattern, split_name)

    def misread(heads, unsq):
        found = split(heads, unsq)
        if found is None:
            return None
        *rest, (groups, g, i0, i1, d) = found
        return (*rest, (groups, g, (i0 + 1) % g, (i0 + 1) % g + 1, d))
    monkeypatch.setattr(rope_pattern, split_name, misread)
    witness_refuses(build(family, layers=1).eval(), **call)


def test_falcon_grouped_decoding_with_past_key_values_matches_eager():
    """Falcon's grouped layout (k and v broadcast to every query head of their group
    before the rotation): prefill and token-by-token decode with the cache; the cached
    keys (the broadcast heads, rotated) are eager's."""
    model = hf_model("falcon", layers=2, new_decoder_architecture=True, num_kv_heads=2).eval()
    ids = tokens(seq=12)
    fast = coda_rewrite.optimize(model, dynamic=False)
    with torch.no_grad():
        ref, out = model(ids[:, :6], use_cache=True), fast(ids[:, :6], use_cache=True)
        assert rel_err(out.logits, ref.logits) <= 1e-5
        for t in range(6, 9):
            ref = model(ids[:, t:t + 1], past_key_values=ref.past_key_values, use_cache=True)
            out = fast(ids[:, t:t + 1], past_key_values=out.past_key_values, use_cache=True)
            assert rel_err(out.logits, ref.logits) <= 1e-5, t
        for layer in range(2):
            assert rel_err(out.past_key_values.layers[layer].keys,
                           ref.past_key_values.layers[layer].keys) <= 1e-5
    assert rope_records(fast.report), str(fast.report)


class GroupedBroadcastHeads(PackedProjection):
    """Falcon's grouped layout written out: view(b, s, G, g + 2, d), q = [..., :-2, :],
    k and v = [..., [-2], :] / [..., [-1], :] broadcast to the g query heads, flattened.
    ``per_head_tables``: a look-alike whose cos/sin differ per head (θ + h), so rotating
    the one key head before the broadcast is not what the model computes."""

    def __init__(self, per_head_tables: bool):
        super().__init__(2 * 4 * 8)  # G = 2 groups of g = 2 query heads, d = 8
        self.per_head = per_head_tables

    def forward(self, x):
        b, s, _ = x.shape
        qkv = self.qkv(x).view(b, s, 2, 4, 8)
        q = qkv[:, :, :, :-2]
        k = torch.broadcast_to(qkv[:, :, :, [-2]], q.shape)
        v = torch.broadcast_to(qkv[:, :, :, [-1]], q.shape)
        q, k, v = [t.flatten(2, 3).transpose(1, 2) for t in (q, k, v)]
        cos, sin = hf_tables(self.inv_freq, x, 1)               # [1, 1, s, 8]
        if self.per_head:  # cos(θ + h), sin(θ + h) for head h
            h = torch.arange(4, device=x.device).view(1, 4, 1, 1).float()
            cos, sin = cos * h.cos() - sin * h.sin(), sin * h.cos() + cos * h.sin()
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize("per_head_tables", [False, True])
def test_grouped_broadcast_heads_and_a_per_head_table_look_alike(per_head_tables):
    """The written-out grouped layout is rewritten (q, the one k head per group rotated
    before its broadcast, v joined) and exact; with tables that differ per head the
    rotation no longer commutes with the broadcast: left, exact."""
    done = exact_rope_rewrites(GroupedBroadcastHeads(per_head_tables))
    assert len(done) == (0 if per_head_tables else 1), done


def test_codegen_blocks_rotate_in_the_epilogue():
    """CodeGen's model-parallel split (q, v, k of L features within each of 4 blocks of
    the packed projection, heads by two reshapes, GPT-J's partial interleaved rotation):
    each member gathered per block into the fused GEMM, v joining unrotated; the
    training step's loss and every gradient against eager, then prefill and decode with
    the cache."""
    report = step_matches_eager("codegen")
    done = rope_records(report)
    assert len(done) == 2, str(report)
    for r in done:
        assert any("not rotated" in c for c in r.consumers), r.consumers  # v joins
    model = build("codegen", layers=2).eval()
    decode_matches_eager(model, coda_rewrite.optimize(model, dynamic=False), tokens(seq=8))


def test_codegen_split_read_beyond_its_blocks_is_left():
    """A look-alike of CodeGen's split whose blocks are q, k, v of unequal widths (a
    list of split sizes): not a per-block member; left, exact."""
    class UnequalBlocks(PackedProjection):
        def __init__(self):
            super().__init__(2 * (16 + 8 + 8))

        def forward(self, x):
            b, s, _ = x.shape
            blocks = self.qkv(x).reshape(b, s, 2, -1)
            q, k, v = torch.split(blocks, [16, 8, 8], dim=-1)
            q = q.reshape(b, s, 2, 2, 8).reshape(b, s, 4, 8)
            k = k.reshape(b, s, 2, 1, 8).reshape(b, s, 2, 8)
            v = v.reshape(b, s, 2, 1, 8).reshape(b, s, 2, 8)
            cos, sin = hf_tables(self.inv_freq, x, 2)
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
            return torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                enable_gqa=True)
    assert not exact_rope_rewrites(UnequalBlocks())


@pytest.mark.parametrize("family,overrides", [
    ("falcon", dict(new_decoder_architecture=True, num_kv_heads=2)), ("codegen", {})],
    ids=["falcon_grouped", "codegen"])
def test_packed_layouts_bfloat16_no_worse_than_eager(family, overrides):
    """bf16 logits against float64: the grouped (broadcast) and block-split layouts
    rewritten are no worse than eager (the numerics policy)."""
    reports = []

    def rewrite(model):
        fast = coda_rewrite.optimize(model)
        reports.append(fast)
        return fast
    res = low_precision_errors(
        lambda seed: hf_model(family, layers=2, seed=seed, **overrides),
        (tokens(seq=32),), rewrite, seeds=(0, 1, 2))
    assert all(len(rope_records(f.report)) == 2 for f in reports)
    assert res["ok"], res


class TransposedBlocks(PackedProjection):
    """CodeGen's model-parallel split with the heads transposed before a half-split
    rotation (the form other code bases write): 2 blocks of [q, v, k]."""

    def __init__(self):
        super().__init__(3 * 32)

    def forward(self, x):
        b, s, _ = x.shape
        q, v, k = torch.split(self.qkv(x).reshape(b, s, 2, -1), 16, dim=-1)
        q, k, v = [t.reshape(b, s, 2, 2, 8).reshape(b, s, 4, 8).transpose(1, 2)
                   for t in (q, k, v)]
        cos, sin = hf_tables(self.inv_freq, x, 1)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_model_parallel_blocks_with_heads_transposed_first():
    done = exact_rope_rewrites(TransposedBlocks())
    assert len(done) == 1 and any("frequency 0" in c for c in done[0].consumers), done


class NewPackedSpellings(PackedProjection):
    """transformers 5.25's packed q/k/v spellings, written out (4 query heads of 8, heads
    after the sequence until attention): Falcon's multi-query ``view(b, s, -1, d).split(
    [4, 1, 1], dim=-2)``, per head ``.unflatten(-2, (4, 3)).unbind(-2)``, grouped (two kv
    groups) as a view of that view indexed per group, CodeGen's block items reshaped to
    heads at once; and look-alikes the matcher must not read as those: the same split of
    the heads after a transpose (not a view of the projection), an unbind over another
    dim (q, k, v as runs of heads)."""

    WIDTH = {"split": 48, "unbind": 96, "grouped": 64, "blocks": 96, "split_transposed": 48,
             "unbind_runs": 72}

    def __init__(self, layout):
        super().__init__(self.WIDTH[layout])
        self.layout = layout

    def forward(self, x):
        b, s, _ = x.shape
        y = self.qkv(x)
        fused = y.view(b, s, -1, 8) if self.layout != "blocks" else None
        if self.layout == "split":
            q, k, v = fused.split([4, 1, 1], dim=-2)
        elif self.layout == "split_transposed":  # heads first, split, heads after again
            q, k, v = (t.transpose(1, 2) for t in fused.transpose(1, 2).split([4, 1, 1], 1))
        elif self.layout == "unbind":
            q, k, v = fused.unflatten(-2, (4, 3)).unbind(-2)
        elif self.layout == "unbind_runs":  # [q0 q1 q2, k0 k1 k2, v0 v1 v2]: runs of three
            q, k, v = fused.unflatten(-2, (3, 3)).unbind(-3)  # heads, not each head's members
        elif self.layout == "grouped":  # 2 groups of [q, q, k, v]
            grouped = fused.view(b, s, 2, -1, 8)
            q = grouped[..., :-2, :].flatten(-3, -2)
            k, v = grouped[..., -2, :], grouped[..., -1, :]
        else:  # 2 blocks of [q, v, k], 16 features each
            q, v, k = y.view(b, s, -1, 48).split(16, dim=-1)
            q, k, v = (t.reshape(b, s, -1, 8) for t in (q, k, v))
        cos, sin = hf_tables(self.inv_freq, x, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
            enable_gqa=True)


@pytest.mark.parametrize("layout", list(NewPackedSpellings.WIDTH))
def test_transformers_5_25_packed_spellings_and_look_alikes(layout):
    """Each head selection is one fused GEMM with v joining it, training step against
    eager; the look-alikes are exact and left by the matcher itself (not matched, never
    a selection the witness had to catch)."""
    from conftest import module_step_matches_eager
    torch.manual_seed(0)
    report = module_step_matches_eager(NewPackedSpellings(layout).train(),
                                       torch.randn(2, 6, 32))
    done = rope_records(report)
    if layout in ("split_transposed", "unbind_runs"):
        left = [r for r in report.records if r.pattern == "rope"]
        assert not done and left, str(report)
        assert not any("witness" in r.reason for r in left), str(report)
        return
    assert len(done) == 1 and len(done[0].consumers) == 3, str(report)
    assert "not rotated" in done[0].consumers[2], done[0].consumers


def test_member_split_replay_refuses_a_node_it_does_not_know():
    """The witness replays a packed member's split through the model's own nodes; a node
    it has no replay for (here a permute) makes the witness unable to run, which refuses
    the rewrite (guarded), instead of being read as an index."""
    import types

    import torch.fx as fx

    from coda_rewrite.algebra import rope as rope_algebra
    g = fx.Graph()
    view = g.call_method("view", (g.placeholder("p"), 1, 4, 2, 8))
    permuted = g.call_method("permute", (view, 0, 2, 1, 3))
    member = types.SimpleNamespace(split=(permuted, view))
    with pytest.raises(rope_algebra._Unreplayable, match="permute"):
        rope_algebra._through_model_split(member, torch.randn(1, 4, 16), 4)


# ---- multi-head latent attention: a rotated suffix, a key assembled from a shared part -----

MLA = [("deepseek_v3", {}), ("deepseek_v3", {"rope_interleave": False}), ("minicpm3", {}),
       ("deepseek_v2", {})]


@pytest.mark.parametrize("family,overrides", MLA, ids=["v3", "v3_halves", "minicpm3", "v2"])
def test_latent_attention_query_rotation_fused_key_takes_its_order(family, overrides):
    """DeepSeek-V3 (pairs read interleaved, written as halves), DeepSeek-V3 with
    rope_interleave off, MiniCPM3 (rotate_half) and DeepSeek-V2 (a complex table,
    polar(1, θ), its angles recomputed): q's rotated suffix in the q_b_proj GEMM's
    epilogue, the head's cat((q_pass, q_rot)) the GEMM's own output; the key's shared
    rotated part (left as graph ops) takes the query's pair order where the key buffer is
    written (V2's pairs are in eager's order already: nothing to do), so no copy of the
    query is made. The training step against eager (loss 1e-5, every gradient 1e-4)."""
    report = step_matches_eager(family, model=hf_model(family, layers=2, **overrides))
    done = rope_records(report)
    assert len(done) == 2, str(report)
    assert unpermuted(report) == []
    if family != "deepseek_v2":
        assert all("key's rotated part" in r.decision.render() for r in done)
    else:
        # the graph's angles, read as one table made from them (a training graph)
        assert all(r.programs[0].name == "rowscale_rope_table" and "made once" in r.backward
                   for r in done)
    left = [r.code for r in report.records if r.pattern == "rope" and r.status != "rewritten"]
    assert left == ["rope.latent_shared_key"] * 2, left


def test_latent_attention_decoding_with_a_cache_matches_eager():
    """The compressed cache holds eager's k_rot (the query's order is put on the key
    after the cache update): prefill and three greedy steps against eager."""
    model = hf_model("deepseek_v3", layers=2).eval()
    fast = coda_rewrite.optimize(copy.deepcopy(model))
    decode_matches_eager(model, fast, tokens())
    assert len(rope_records(fast.report)) >= 2, str(fast.report)  # each graph's layers
    assert unpermuted(fast.report) == []


class LatentAttention(torch.nn.Module):
    """Hand-written multi-head latent attention (4 heads of 8 + 8 features for q·k, 16
    for v; k's rotated part one shared 8-wide head) and its look-alikes:
    ``"buffer"``: the key written into new_empty by two copy_ (Hugging Face's spelling);
    ``"cat"``: the key concatenated (older releases); ``"key_read"``: the key also
    read outside the attention; ``"rot_first"``: the query put back as cat((q_rot,
    q_pass)); ``"indexer"``: a second rotated query from the same input with other heads
    (DeepSeek-V3.2's indexer: 2 heads of 16 + 8), scored against itself."""

    def __init__(self, variant: str):
        super().__init__()
        self.variant = variant
        self.q_proj = torch.nn.Linear(32, 4 * 16, bias=False)
        self.kv_a = torch.nn.Linear(32, 16 + 8, bias=False)
        self.kv_b = torch.nn.Linear(16, 4 * (8 + 16), bias=False)
        self.q_index = torch.nn.Linear(32, 2 * 24, bias=False)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 8, 2) / 8)))

    def forward(self, x):
        b, s, _ = x.shape
        cos, sin = hf_tables(self.inv_freq, x, 1)
        scale = 1.0
        if self.variant == "indexer":
            qi = self.q_index(x).view(b, s, 2, 24).transpose(1, 2)
            qi_pass, qi_rot = torch.split(qi, [16, 8], dim=-1)
            qi = torch.cat((qi_pass, qi_rot * cos + rotate_half(qi_rot) * sin), dim=-1)
            scale = (qi @ qi.transpose(-1, -2)).mean()
        q = self.q_proj(x).view(b, s, 4, 16).transpose(1, 2)
        q_pass, q_rot = torch.split(q, [8, 8], dim=-1)
        kv, k_rot = torch.split(self.kv_a(x), [16, 8], dim=-1)
        k_rot = k_rot.view(b, 1, s, 8)
        q_rot = q_rot * cos + rotate_half(q_rot) * sin
        k_rot = k_rot * cos + rotate_half(k_rot) * sin
        kv = self.kv_b(kv).view(b, s, 4, 24).transpose(1, 2)
        k_nope, v = torch.split(kv, [8, 16], dim=-1)
        k_rot = k_rot.expand(-1, 4, -1, -1)
        if self.variant == "rot_first":
            query = torch.cat((q_rot, q_pass), dim=-1)
        else:
            query = torch.cat((q_pass, q_rot), dim=-1)
        if self.variant == "cat":
            key = torch.cat((k_nope, k_rot), dim=-1)
        else:
            key = kv.new_empty(b, 4, s, 16)
            key[..., :8].copy_(k_nope)
            key[..., 8:].copy_(k_rot)
        out = torch.nn.functional.scaled_dot_product_attention(query, key, v, is_causal=True)
        return out + key if self.variant == "key_read" else out * scale


@pytest.mark.parametrize("variant", ["buffer", "cat", "key_read", "rot_first", "indexer"])
def test_latent_attention_spellings_and_look_alikes(variant):
    """Both key spellings keep the query's order without a copy; a key also read
    elsewhere gets nothing permuted, so the query is put back in eager's order on the
    attention's edge, which gains nothing (left: rope.no_invariant_reader); a query
    whose rotated part comes first is not the suffix layout (left, with its reason); a
    second rotated query over the same input with other heads is a GEMM of its own (one
    permutation per GEMM), neither taking the other in as v. Outputs and gradients
    against eager."""
    from conftest import module_step_matches_eager
    torch.manual_seed(0)
    report = module_step_matches_eager(LatentAttention(variant), torch.randn(2, 6, 32))
    done = rope_records(report)
    left = {"rot_first": "rope.suffix_concat", "key_read": "rope.no_invariant_reader"}
    if variant in left:
        assert not done and left[variant] in codes(report, "rope"), str(report)
        return
    assert len(done) == (2 if variant == "indexer" else 1), str(report)
    assert not unpermuted(report), unpermuted(report)


@pytest.mark.provokes_pass_bug
def test_the_witness_checks_the_keys_order_against_the_querys(monkeypatch):
    """The float64 replay also takes q·k of the fused query against a key in
    rope_permute's order: a key permutation that does not match the query's (here none
    at all) is refused, and the model computes what eager computes."""
    monkeypatch.setattr(layouts, "rope_permute", lambda t: t.contiguous())
    witness_refuses(hf_model("deepseek_v3", layers=1).eval(), skip=("rope.latent_shared_key",))


def test_table_head_widths_the_kernel_can_tile():
    """A cos/sin table wraps every head_dim columns: the kernel's 64- and 128-wide table
    tiles take heads of 64, 128, 256 ..., not DeepSeek's 192-wide q·k heads (such a
    table rotation is left on the GPU: tests/gpu, rope.table_head_width)."""
    from coda_rewrite.kernels.quack_path import table_head_fits
    assert [h for h in (16, 32, 64, 96, 128, 192, 256, 384) if table_head_fits(h)] == \
        [64, 128, 256, 384]


def test_two_rotated_queries_over_one_input_each_get_their_gemm():
    """HY-V4 (its tiny coverage config): the attention's latent query and its indexer's
    query both rotate projections of the same normalised input, with other head layouts:
    each is a fused GEMM of its own (not one group: one permutation per GEMM), and
    neither takes the other's projection in as v. Eval logits against eager."""
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(__file__), "..", "tools", "coverage.py")
    spec = importlib.util.spec_from_file_location("coverage_tool", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    try:
        model = tool.build("hy_v4").eval()
    except (ValueError, KeyError) as e:  # not in this transformers release
        pytest.skip(f"hy_v4: {e}")
    ids = tokens()
    fast = coda_rewrite.optimize(copy.deepcopy(model))
    with torch.no_grad():  # no cache: the attention's key is assembled in the graph
        assert rel_err(fast(ids, use_cache=False).logits,
                       model(ids, use_cache=False).logits) <= 1e-5
    assert len(rope_records(fast.report)) == 2, str(fast.report)  # the latent queries
    found = codes(fast.report, "rope")  # the indexers' queries: their scores read an
    assert "rope.call_read" not in found and "rope.no_invariant_reader" in found, found
    # unrotated key, so eager's order would be copied back: left


class ScaledQuery(torch.nn.Module):
    """q rotated, then scaled before the attention (Ministral 3's per-position
    ``q · s[:, None, :, None]``) and its look-alikes: a per-feature scale (the
    permutation would show), and q as a divisor."""

    def __init__(self, scale: str):
        super().__init__()
        self.scale = scale
        self.q, self.k, self.v = (torch.nn.Linear(32, 32, bias=False) for _ in range(3))
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 8, 2) / 8)))
        self.register_buffer("per_feature", torch.linspace(0.5, 1.5, 8))

    def forward(self, x):
        b, s, _ = x.shape
        cos, sin = hf_tables(self.inv_freq, x, 1)
        q, k, v = (p(x).view(b, s, 4, 8).transpose(1, 2) for p in (self.q, self.k, self.v))
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        if self.scale == "per_position":
            q = q * (1 + torch.arange(s, device=x.device).float() / s)[None, None, :, None]
        elif self.scale == "per_feature":
            q = q * self.per_feature
        else:  # "divisor"
            q = 1.0 / (q * q + 1.0) * q
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize("scale", ["per_position", "per_feature", "divisor"])
def test_a_scale_the_same_for_every_feature_keeps_the_permutation(scale):
    """q · c with c the same for every feature of a head keeps the permuted order inside
    the region (rewritten, no copy back); a per-feature scale or any other op on q would
    show the permutation: q gets eager's order back there, so no attention keeps the
    order and the rotation is left (rope.no_invariant_reader). Against eager."""
    from conftest import module_step_matches_eager
    torch.manual_seed(0)
    report = module_step_matches_eager(ScaledQuery(scale), torch.randn(2, 6, 32))
    if scale == "per_position":
        assert len(rope_records(report)) == 1 and not unpermuted(report), str(report)
    else:
        assert not rope_records(report) and \
            "rope.no_invariant_reader" in codes(report, "rope"), str(report)


class ComplexInGraph(torch.nn.Module):
    """The complex rotation (TorchTitan's spelling) with its table computed in the graph:
    ``polar(ones_like(θ), θ)`` (DeepSeek-V2's freqs_cis), times an attention scaling, or
    a look-alike whose factors are not unit-modulus (``polar(2·ones, θ)``: a rotation
    and a scaling by 2, still what the model multiplies by)."""

    def __init__(self, variant: str):
        super().__init__()
        self.variant = variant
        self.q, self.k, self.v = (torch.nn.Linear(32, 32, bias=False) for _ in range(3))
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 8, 2) / 8)))

    def forward(self, x):
        b, s, _ = x.shape
        pos = torch.arange(s, device=x.device)[None].float()
        th = (self.inv_freq[None, :, None] @ pos[:, None, :]).transpose(1, 2)
        modulus = torch.ones_like(th) * 2 if self.variant == "not_unit" else torch.ones_like(th)
        table = torch.polar(modulus, th)
        if self.variant == "scaled":
            table = table * 0.75
        table = table[:, None]  # [1, 1, S, 4]: broadcast over the heads

        def rot(t):
            c = torch.view_as_complex(t.float().reshape(*t.shape[:-1], -1, 2))
            return torch.view_as_real(c * table).flatten(3).type_as(t)
        q, k, v = (p(x).view(b, s, 4, 8).transpose(1, 2) for p in (self.q, self.k, self.v))
        return torch.nn.functional.scaled_dot_product_attention(rot(q), rot(k), v,
                                                                is_causal=True)


@pytest.mark.parametrize("variant", ["unit", "scaled", "not_unit"])
def test_a_complex_table_made_in_the_graph_has_its_angles_recomputed(variant):
    """polar(1, θ) (· s) in the graph: the angles are recomputed in the epilogue (the
    rope program, s a per-column scale; in this training graph unscaled angles are read
    as one table made from them, rope_table); a table that is not polar(ones_like(θ), θ)
    is read as it is (rope_table). Outputs and gradients against eager."""
    from conftest import module_step_matches_eager
    torch.manual_seed(0)
    report = module_step_matches_eager(ComplexInGraph(variant), torch.randn(2, 6, 32))
    (done,) = rope_records(report)
    assert done.programs[0].name == ("rope" if variant == "scaled" else "rope_table"), \
        str(report)
    assert ("made once" in done.backward) == (variant == "unit"), str(report)


@pytest.mark.provokes_pass_bug
def test_the_witness_computes_a_complex_table_with_the_models_own_nodes(monkeypatch):
    """The replay builds the table the rotation reads from the model's own nodes (polar,
    its scale, moves and views) on its angles, not from the pattern's reading of them: a
    misread scale is refused, and the module computes what eager computes."""
    import dataclasses as dc

    from coda_rewrite.patterns import rope as rope_pattern
    read = rope_pattern._polar_angle

    def misread(table):
        angle = read(table)
        return None if angle is None else dc.replace(angle, scale=0.5)
    monkeypatch.setattr(rope_pattern, "_polar_angle", misread)
    torch.manual_seed(0)
    m = ComplexInGraph("unit")
    x = torch.randn(2, 6, 32)
    fast = coda_rewrite.optimize(copy.deepcopy(m))
    with torch.no_grad():
        assert rel_err(fast(x), m(x)) <= 1e-6
    refused = rope_records(fast.report, status="rejected")
    assert refused and not rope_records(fast.report), str(fast.report)
    assert all("witness disagrees" in r.reason for r in refused), [r.reason for r in refused]


@pytest.mark.provokes_pass_bug
def test_the_witness_computes_cos_sin_with_the_models_own_nodes(monkeypatch):
    """Likewise for the half-split form: the replay runs the model's rotary nodes (cat(θ,
    θ), cos/sin, the rope type's scaling, casts) on its angles, so a misread angle or
    scale is refused rather than checked against itself."""
    import dataclasses as dc

    from coda_rewrite.patterns import rope as rope_pattern
    read = rope_pattern.angle_of

    def misread(cos_t, sin_t, half_width=False):
        angle = read(cos_t, sin_t, half_width)
        return dc.replace(angle, scale=0.5) if isinstance(angle, rope_pattern.Angle) else angle
    monkeypatch.setattr(rope_pattern, "angle_of", misread)
    witness_refuses(hf_model("llama", layers=1).eval())


class NoGradAngles(torch.nn.Module):
    """The angles computed under torch.no_grad() (bookkeeping a model does without
    gradients, as Hugging Face's cache code does): the fused GEMM, placed after the last
    value it reads, must not land inside that block."""

    def __init__(self, late: bool):
        super().__init__()
        self.late = late
        self.q, self.k, self.v = (torch.nn.Linear(32, 32, bias=False) for _ in range(3))
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 8, 2) / 8)))

    def forward(self, x):
        b, s, _ = x.shape
        with torch.no_grad():
            pos = torch.arange(s, device=x.device)[None].float()
            th = (self.inv_freq[None, :, None] @ pos[:, None, :]).transpose(1, 2)
            if self.late:  # more of the block after the last value the GEMM reads
                th = th + 0.0
        q, k, v = (p(x).view(b, s, 4, 8).transpose(1, 2) for p in (self.q, self.k, self.v))
        emb = torch.cat((th, th), -1)
        cos, sin = emb.cos()[:, None], emb.sin()[:, None]
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize("late", [False, True])
def test_fused_gemm_is_not_placed_in_a_no_grad_block(late):
    """Found by the architecture survey (Exaone 4): the GEMM inside the model's no_grad
    block computed no gradient for q, k, v (the loss right, the weights' gradients None)."""
    from conftest import module_step_matches_eager
    torch.manual_seed(0)
    report = module_step_matches_eager(NoGradAngles(late).train(), torch.randn(2, 6, 32))
    assert len(rope_records(report)) == 1, str(report)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_kept_values_from_inference_mode_do_not_reach_a_training_step(family):
    """RoPE's frequencies and a QK-norm's weights are kept between calls; kept under
    torch.inference_mode() they are inference tensors, which autograd cannot save: an
    evaluation there followed by a training step failed in the backward."""
    extra = {"head_dim": 16} if family == "qwen3" else {}
    model = hf_model(family, **extra).eval()
    ref = copy.deepcopy(model)
    ids = tokens()
    fast = coda_rewrite.optimize(model)
    with torch.inference_mode():
        fast(ids)
    model.train(), ref.train()
    loss, want = fast(ids, labels=ids).loss, ref(ids, labels=ids).loss
    loss.backward()
    want.backward()
    assert abs(loss.item() - want.item()) <= 1e-5 * abs(want.item())
    grads_match(model, ref)


def test_input_updated_between_the_projections_is_refused():
    """q's GEMM, then x updated in place, then k's and v's: they read different x, which
    one fused GEMM reading x at one point cannot."""
    left_as_eager(ChunkSpelling(update_between=True), (torch.randn(2, 6, 32),), "rope",
                  "rope.in_place")


def test_a_second_derivative_through_a_fused_gemm_raises():
    """A gradient penalty (backward with create_graph=True) through the rotating q/k/v
    GEMM: its backward rules read saved outputs of a formula-less op, so the second
    derivative came back 0.68 off eager's, silently; now it raises, and the first
    derivative is unchanged."""
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.for_model("llama", vocab_size=128, hidden_size=64, intermediate_size=96,
                               num_hidden_layers=1, num_attention_heads=4,
                               num_key_value_heads=2, max_position_embeddings=64)
    cfg._attn_implementation = "eager"  # SDPA's CPU kernel has no double backward itself
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).double().train()
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 128, (2, 8))
    fast = coda_rewrite.optimize(model, patterns=("rope",), fuse_in_training=True)
    x = model.get_input_embeddings()(ids).detach().requires_grad_()
    with pytest.raises(RuntimeError, match="create_graph=True"):
        torch.autograd.grad(fast(inputs_embeds=x, labels=ids).loss, x, create_graph=True)
    assert [r.status for r in fast.report.records if r.pattern == "rope"] == ["rewritten"]
    got = torch.autograd.grad(fast(inputs_embeds=x, labels=ids).loss, x)[0]
    want = torch.autograd.grad(ref(inputs_embeds=x, labels=ids).loss, x)[0]
    assert rel_err(got, want) <= 1e-6  # the epilogue's angles are float-float float32


class _DetachedMember(torch.nn.Module):
    """q/k/v -> rotation -> SDPA, with one member read through a detach."""

    def __init__(self, where: str, dim: int = 64, heads: int = 4, kv: int = 2):
        super().__init__()
        from coda_rewrite.models import rope_table
        self.where, self.heads, self.kv = where, heads, kv
        self.norm = torch.nn.RMSNorm(dim)
        self.wq = torch.nn.Linear(dim, dim, bias=False)
        self.wk, self.wv = (torch.nn.Linear(dim, dim // heads * kv, bias=False)
                            for _ in range(2))
        self.wo = torch.nn.Linear(dim, dim, bias=False)
        self.register_buffer("freqs", rope_table(dim // heads, 64, 10000.0),
                             persistent=False)

    def forward(self, x):
        from coda_rewrite.models import apply_rope
        b, s, _ = x.shape
        h = self.norm(x)
        q, k, v = self.wq(h), self.wk(h), self.wv(h)
        q = q.detach() if self.where == "q" else q
        v = v.detach() if self.where == "v" else v
        q, k, v = (t.view(b, s, -1, q.shape[-1] // self.heads) for t in (q, k, v))
        q, k = apply_rope(q, self.freqs[:s]), apply_rope(k, self.freqs[:s])
        q = q.detach() if self.where == "q_rotated" else q
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
            enable_gqa=True)
        return x + self.wo(o.transpose(1, 2).reshape(b, s, -1))


@pytest.mark.parametrize("where", ["q", "v", "q_rotated", "none"])
def test_a_member_read_through_a_detach_keeps_its_own_gemm_in_training(where):
    """One fused q/k/v weight gives every member's weight a gradient: a member eager
    never differentiates (read through a detach) would get zeros where eager leaves
    .grad None, which AdamW's weight decay and moments then treat as a step. Such a
    member keeps its own GEMM (a rotated one its rotation, with the reason); the others
    are fused, and every gradient is eager's, None where eager's is."""
    torch.manual_seed(0)
    model = _DetachedMember(where)
    ref = copy.deepcopy(model)
    x = torch.randn(2, 16, 64)
    fast = coda_rewrite.optimize(model, fuse_in_training=True, min_fused_rows=0)
    cot = torch.randn(2, 16, 64)
    (fast(x) * cot).sum().backward()
    (ref(x) * cot).sum().backward()
    assert len(rope_records(fast.report)) == 1, str(fast.report)
    left = {"q_rotated": {"rope.member_not_differentiated"}}.get(where, set())
    assert codes(fast.report, "rope") == left
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        assert q.grad is None or rel_err(p.grad, q.grad) <= 1e-5, name


@pytest.mark.provokes_pass_bug
def test_the_gradient_replay_refuses_a_fold_that_loses_a_gradient(monkeypatch):
    """RoPE's witness replays the gradients where the match trains: a re-layout that
    detached the biases it packs (the forward exact, the q/k/v biases without a gradient
    through the fused GEMM) is refused as the pass's own bug, and the step is eager's."""
    real = layouts.rope_segments

    def detaching_biases(lay, *tensors):
        return real(lay, *(t.detach() if t is not None and t.dim() == 1 else t
                           for t in tensors))

    monkeypatch.setattr(layouts, "rope_segments", detaching_biases)
    refused_by_gradient_replay("qwen2", "rope")


def spelling_step(module, look_alike: bool):
    """A training step of ``module`` on [2, 6, 32] against eager (outputs and every
    gradient: conftest.module_step_matches_eager), then the verdict a spelling test
    wants: a look-alike is left by the matcher itself (no rotation rewritten, none refused
    by the witness); a spelling is one fused GEMM whose consumers are q, k and v. The
    report, and the rewrite (None for a look-alike)."""
    from conftest import module_step_matches_eager
    torch.manual_seed(0)
    report = module_step_matches_eager(module.train(), torch.randn(2, 6, 32))
    done = rope_records(report)
    if look_alike:
        assert not done, str(report)
        assert not any("witness" in r.reason for r in report.records if r.pattern == "rope")
        return report, None
    assert len(done) == 1 and len(done[0].consumers) == 3, str(report)
    return report, done[0]


def litgpt_apply_rope(x, cos, sin, view=True):
    """litgpt's apply_rope: halves rotated, tables of fewer dims viewed to x's (a
    [1, seq, r] table becomes [1, 1, seq, r]; ``view=False``: broadcast as they are),
    the result cast back to x's dtype."""
    half = x.size(-1) // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    dims_diff = x.dim() - cos.dim()
    if dims_diff > 0 and view:
        shape = cos.shape[0:1] + (1,) * dims_diff + cos.shape[1:]
        cos, sin = cos.view(*shape), sin.view(*shape)
    return ((x * cos) + (rotated * sin)).to(dtype=x.dtype)


class LitGPTAttention(torch.nn.Module):
    """litgpt's attention (4 query heads of 8 in 2 groups): q, k, v cut from the packed
    projection by ``split`` of their sizes along the last dim, each head split and
    transposed, the rotation on the first ``rope_n_elem`` features concatenated back with
    the rest (empty for a full rotary), tables from a cache of [seq, r] rows. Layouts:
    "litgpt" (a [1, seq, r] table, viewed), "partial" (half the head rotated), "table_2d"
    ([seq, r] broadcast as it is), "chunk" (q, k, v = chunk(3, -1), no groups), "offset"
    (k, q, v = split(...): q the middle columns); and look-alikes: "one_position" (every
    token rotated by position 0's row, [1, 1, 1, r]), "second_reader" (the rotated part
    also read by the output)."""

    def __init__(self, layout):
        super().__init__()
        self.layout = layout
        self.groups = 4 if layout == "chunk" else 2
        self.qkv = torch.nn.Linear(32, (4 + 2 * self.groups) * 8, bias=False)
        self.n_elem = 4 if layout == "partial" else 8
        theta = 1.0 / (10000 ** (torch.arange(0, self.n_elem, 2).float() / self.n_elem))
        angles = torch.outer(torch.arange(16).float(), theta).repeat(1, 2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x):
        b, t, _ = x.shape
        qkv = self.qkv(x)
        if self.layout == "chunk":
            q, k, v = qkv.chunk(3, dim=-1)
        elif self.layout == "offset":  # q the middle piece
            k, q, v = qkv.split((8 * self.groups, 32, 8 * self.groups), dim=-1)
        else:
            q, k, v = qkv.split((32, 8 * self.groups, 8 * self.groups), dim=-1)
        q = q.view(b, t, 4, 8).transpose(1, 2)
        k = k.view(b, t, self.groups, 8).transpose(1, 2)
        v = v.view(b, t, self.groups, 8).transpose(1, 2)
        cos, sin = self.cos[:t], self.sin[:t]
        if self.layout == "one_position":
            cos, sin = self.cos[:1].view(1, 1, 1, -1), self.sin[:1].view(1, 1, 1, -1)
        elif self.layout != "table_2d":
            cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
        n, view = self.n_elem, self.layout != "table_2d"
        q_roped = litgpt_apply_rope(q[..., :n], cos, sin, view)
        k_roped = litgpt_apply_rope(k[..., :n], cos, sin, view)
        q = torch.cat((q_roped, q[..., n:]), dim=-1)
        k = torch.cat((k_roped, k[..., n:]), dim=-1)
        k = k.repeat_interleave(4 // self.groups, dim=1)
        v = v.repeat_interleave(4 // self.groups, dim=1)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(b, t, 32)
        return y + q_roped.sum() if self.layout == "second_reader" else y


@pytest.mark.parametrize("layout", ["litgpt", "partial", "table_2d", "chunk", "offset",
                                    "one_position", "second_reader"])
def test_litgpt_spelling_and_look_alikes(layout):
    """litgpt's spelling is one fused GEMM per attention with v joining it, a training
    step against eager; each look-alike is left (exact either way)."""
    look_alike = layout in ("one_position", "second_reader")
    report, done = spelling_step(LitGPTAttention(layout), look_alike)
    if look_alike:  # with its record
        assert [r for r in report.records if r.pattern == "rope"], str(report)
    else:
        assert any("not rotated" in c for c in done.consumers), str(report)


class TorchtuneAttention(torch.nn.Module):
    """torchtune's attention (4 query heads of 8, 2 kv heads): RotaryPositionalEmbeddings
    on [b, s, h, d] before the heads' transpose, written out over each adjacent pair
    (``xshaped = x.float().reshape(*x.shape[:-1], -1, 2)``, a [seq, d/2, 2] cache of
    (cos, sin) viewed to ``[-1, s, 1, d/2, 2]``, ``stack([x0·c − x1·s, x1·c + x0·s],
    -1).flatten(3).type_as(x)``), k and v repeated by expand + flatten. Layouts:
    "torchtune"; "after_transpose" (the rotation on [b, h, s, d]); look-alikes that are no
    rotation: "sign" (x1·c − x0·s on the second element), "swapped" (x0·c + x1·s on it),
    "same_element" (x0 on both products of the first), "per_head" (a cache with a table
    per head)."""

    def __init__(self, layout):
        super().__init__()
        self.layout = layout
        self.q_proj = torch.nn.Linear(32, 32, bias=False)
        self.k_proj = torch.nn.Linear(32, 16, bias=False)
        self.v_proj = torch.nn.Linear(32, 16, bias=False)
        theta = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
        angles = torch.einsum("i, j -> ij", torch.arange(16).float(), theta)
        cache = torch.stack([angles.cos(), angles.sin()], dim=-1)       # [16, 4, 2]
        if layout == "per_head":  # [16, heads, 4, 2]
            cache = cache[:, None] * torch.tensor([1.0, 0.5, 0.8, 0.9])[:, None, None]
        self.register_buffer("cache", cache, persistent=False)

    def rope(self, x, seq_axis):
        s = x.size(seq_axis)
        xshaped = x.float().reshape(*x.shape[:-1], -1, 2)
        cache = self.cache[:s]
        if self.layout == "per_head":  # q's heads read the four tables, k's the first two
            cache = cache[:, :x.size(2)].reshape(-1, s, x.size(2), 4, 2)
        elif seq_axis == 1:
            cache = cache.view(-1, s, 1, 4, 2)
        else:
            cache = cache.view(-1, 1, s, 4, 2)
        # each element and table read where it is used, as torchtune writes it
        first = xshaped[..., 0] * cache[..., 0] - \
            xshaped[..., 0 if self.layout == "same_element" else 1] * cache[..., 1]
        if self.layout == "sign":
            second = xshaped[..., 1] * cache[..., 0] - xshaped[..., 0] * cache[..., 1]
        elif self.layout == "swapped":
            second = xshaped[..., 0] * cache[..., 0] + xshaped[..., 1] * cache[..., 1]
        else:
            second = xshaped[..., 1] * cache[..., 0] + xshaped[..., 0] * cache[..., 1]
        return torch.stack([first, second], -1).flatten(3).type_as(x)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, 4, 8)
        k = self.k_proj(x).view(b, s, 2, 8)
        v = self.v_proj(x).view(b, s, 2, 8).transpose(1, 2)
        if self.layout == "after_transpose":
            q, k = self.rope(q.transpose(1, 2), 2), self.rope(k.transpose(1, 2), 2)
        else:
            q, k = self.rope(q, 1).transpose(1, 2), self.rope(k, 1).transpose(1, 2)
        k = k.unsqueeze(2).expand(b, 2, 2, s, 8).flatten(1, 2)
        v = v.unsqueeze(2).expand(b, 2, 2, s, 8).flatten(1, 2)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y.transpose(1, 2).reshape(b, s, 32)


@pytest.mark.parametrize("layout", ["torchtune", "after_transpose", "sign", "swapped",
                                    "same_element", "per_head"])
def test_torchtune_spelling_and_look_alikes(layout):
    """torchtune's rotation of adjacent pairs is one fused GEMM with v joining it (its
    half-width cache read as the epilogue's table rows), a training step against eager,
    and its repeat_kv goes to SDPA's enable_gqa; the look-alikes are left (exact)."""
    look_alike = layout in ("sign", "swapped", "same_element", "per_head")
    report, done = spelling_step(TorchtuneAttention(layout), look_alike)
    if not look_alike:
        assert "x0, x1 = x[2p], x[2p+1]" in done.decision.statement, str(report)
        assert report.count(pattern="attention_inputs") == 1, str(report)


class OlmoRotateHalf(torch.nn.Module):
    """OLMo's rotate_half, ``x.view(B, nh, T, 2, hs // 2).unbind(dim=-2)`` into its
    halves, on [b, h, s, d] heads with [1, 1, s, d] tables; the look-alike "pairs" unbinds
    x's adjacent pairs instead (``view(B, nh, T, hs // 2, 2).unbind(-1)``: even and odd
    features, which no rotation's layout reads with a half-split table)."""

    def __init__(self, spelling):
        super().__init__()
        self.spelling = spelling
        self.q, self.k, self.v = (torch.nn.Linear(32, 32, bias=False) for _ in range(3))
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)))

    def rotate_half(self, x):
        b, nh, t, hs = x.size()
        if self.spelling == "pairs":
            x1, x2 = x.view(b, nh, t, hs // 2, 2).unbind(dim=-1)
        else:
            x1, x2 = x.view(b, nh, t, 2, hs // 2).unbind(dim=-2)
        return torch.cat((-x2, x1), dim=-1)

    def forward(self, x):
        b, s, _ = x.shape
        freqs = torch.einsum("i , j -> i j", torch.arange(s, dtype=torch.float,
                                                        device=self.inv_freq.device),
                             self.inv_freq)
        positions = torch.cat((freqs, freqs), dim=-1)
        sin, cos = positions.sin()[None, None, :, :], positions.cos()[None, None, :, :]
        q, k, v = (p(x).view(b, s, 4, 8).transpose(1, 2) for p in (self.q, self.k, self.v))
        q = ((q * cos) + (self.rotate_half(q) * sin)).to(q.dtype)
        k = ((k * cos) + (self.rotate_half(k) * sin)).to(k.dtype)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y.transpose(1, 2).reshape(b, s, 32)


@pytest.mark.parametrize("spelling", ["halves", "pairs"])
def test_olmo_rotate_half_and_a_look_alike(spelling):
    """OLMo's unbind of the halves is rotate_half: one fused GEMM with v, a training step
    against eager; unbinding the adjacent pairs instead is no rotate_half and is left by
    the matcher (exact)."""
    spelling_step(OlmoRotateHalf(spelling), look_alike=spelling == "pairs")


class MistralReferenceAttention(torch.nn.Module):
    """Mistral's reference attention (mistral-inference): q/k rotated as complex pairs by
    ``freqs_cis[:, None, :]`` ([seq, 1, d/2], broadcast over batch and heads as it is),
    k and v repeated by ``torch.repeat_interleave(x, repeats=2, dim=2)`` before the
    transpose; the look-alike "per_head" rotates each head by a table of its own
    ([seq, heads, d/2])."""

    def __init__(self, layout):
        super().__init__()
        self.layout = layout
        self.wq = torch.nn.Linear(32, 32, bias=False)
        self.wk = torch.nn.Linear(32, 16, bias=False)
        self.wv = torch.nn.Linear(32, 16, bias=False)
        freqs = 1.0 / (10000 ** (torch.arange(0, 8, 2)[:4].float() / 8))
        angles = torch.outer(torch.arange(16), freqs).float()
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles),
                             persistent=False)

    def rotate(self, x, freqs_cis):
        x_ = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        if self.layout == "per_head":  # heads h read the table at 1 + h/4 times the angle
            scale = (1 + torch.arange(x.shape[2]) / 4)[None, :, None]
            table = torch.polar(torch.ones_like(freqs_cis.real[:, None]),
                                freqs_cis.angle()[:, None] * scale)
        else:
            table = freqs_cis[:, None, :]
        return torch.view_as_real(x_ * table).flatten(3).type_as(x)

    def forward(self, x):
        b, s, _ = x.shape
        xq, xk = self.wq(x).view(b, s, 4, 8), self.wk(x).view(b, s, 2, 8)
        xv = self.wv(x).view(b, s, 2, 8)
        freqs_cis = self.freqs_cis[:s]
        xq, xk = self.rotate(xq, freqs_cis), self.rotate(xk, freqs_cis)
        xk = torch.repeat_interleave(xk, repeats=2, dim=2)
        xv = torch.repeat_interleave(xv, repeats=2, dim=2)
        y = torch.nn.functional.scaled_dot_product_attention(
            xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2), is_causal=True)
        return y.transpose(1, 2).reshape(b, s, 32)


@pytest.mark.parametrize("layout", ["mistral", "per_head"])
def test_mistral_reference_spelling_and_a_look_alike(layout):
    """Mistral's reference: q, k and v one fused GEMM rotating by the complex table
    broadcast as it is, and its repeat_kv, torch.repeat_interleave, SDPA's enable_gqa; a
    table per head is no table broadcast over the heads and is left (exact)."""
    report, _ = spelling_step(MistralReferenceAttention(layout), layout == "per_head")
    assert report.count(pattern="attention_inputs") == 1, str(report)


def test_flex_attention_keeps_the_permuted_order():
    """transformers' attn_implementation="flex_attention": flex_attention reads q and k
    only through q·kᵀ (its score and mask functions see scores and positions, not
    features), so the rotation is fused and q and k reach it permuted, no copy back;
    the eval logits are eager's (flex_attention has no backward on the CPU)."""
    model = build("llama", layers=2, attn_implementation="flex_attention").eval()
    fast = coda_rewrite.optimize(copy.deepcopy(model))
    ids = tokens()
    with torch.no_grad():  # no cache returned: flex_attention is q's and k's only reader
        got, want = fast(ids, use_cache=False).logits, model(ids, use_cache=False).logits
    assert rel_err(got, want) <= 1e-5
    done = rope_records(fast.report)
    assert len(done) == 2 and not unpermuted(fast.report), str(fast.report)


@pytest.mark.parametrize("make", [
    lambda: LitGPTAttention("litgpt"), lambda: LitGPTAttention("partial"),
    lambda: LitGPTAttention("table_2d"), lambda: TorchtuneAttention("torchtune"),
    lambda: OlmoRotateHalf("halves"), lambda: MistralReferenceAttention("mistral"),
    lambda: XTransformersAttention("xtransformers")],
    ids=["litgpt", "litgpt_partial", "litgpt_table_2d", "torchtune", "olmo", "mistral",
         "x_transformers"])
def test_real_spellings_under_dynamic_shapes(make):
    """Each spelling above through torch.compile(backend="coda", dynamic=True) at three
    sequence lengths (one graph, symbolic seq): outputs and input gradients eager's, and
    the rotation rewritten."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = make().train()
    ref = copy.deepcopy(model)
    before = len(coda_rewrite.last_report().records)  # this process's compiles so far
    fast = torch.compile(model, backend="coda", dynamic=True)
    for s in (5, 7, 11):
        x = torch.randn(2, s, 32, requires_grad=True)
        xr = x.detach().clone().requires_grad_()
        out, want = fast(x), ref(xr)
        assert rel_err(out, want) <= 1e-5
        out.square().sum().backward()
        want.square().sum().backward()
        assert rel_err(x.grad, xr.grad) <= 1e-4
    records = coda_rewrite.last_report().records[before:]
    assert any(r.pattern == "rope" and r.status == "rewritten" for r in records), records


@pytest.mark.parametrize("make", [
    lambda: LitGPTAttention("litgpt"), lambda: LitGPTAttention("partial"),
    lambda: TorchtuneAttention("torchtune"), lambda: OlmoRotateHalf("halves"),
    lambda: XTransformersAttention("xtransformers")],
    ids=["litgpt", "litgpt_partial", "torchtune", "olmo", "x_transformers"])
def test_real_spellings_in_bf16_no_worse_than_eager(make):
    """The numerics policy on each spelling in bfloat16 (tables, caches and projections
    alike): the output against float64, no worse than eager's bf16 output (median of
    five seeds, numerics.BF16_RATIO_LIMIT), the rotation rewritten. (Mistral's complex
    freqs_cis does not survive Module.to(bfloat16), which keeps its real part only, in
    eager too.)"""
    def build(seed):
        torch.manual_seed(seed)
        return InOwnDtype(make())

    rewritten = []

    def rewrite(model):
        torch._dynamo.reset()
        rewritten.append(coda_rewrite.optimize(model))
        return rewritten[-1]
    res = low_precision_errors(build, (torch.randn(2, 6, 32),), rewrite)
    assert res["ok"], res
    assert all(len(rope_records(f.report)) == 1 for f in rewritten), str(rewritten[0].report)


class PermutedHeads(torch.nn.Module):
    """Heads split by ``view(b, n, h, d).permute(0, 2, 1, 3)`` (what einops' ``rearrange(t,
    'b n (h d) -> b h n d')`` traces to), HF's rotate_half on [b, h, n, d]; "einops" calls
    rearrange itself; "packed" permutes GPT-NeoX's per-head packed q/k/v before its
    chunk; the look-alike "batch_last" permutes (2, 0, 1, 3): heads first, the batch
    where the heads were, which no head split is."""

    def __init__(self, layout):
        super().__init__()
        self.layout = layout
        self.to_q, self.to_k, self.to_v = (torch.nn.Linear(32, 32, bias=False)
                                           for _ in range(3))
        self.to_qkv = torch.nn.Linear(32, 96, bias=False)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)))

    def heads(self, t):
        b, n, _ = t.shape
        if self.layout == "einops":
            from einops import rearrange
            return rearrange(t, "b n (h d) -> b h n d", h=4)
        order = (2, 0, 1, 3) if self.layout == "batch_last" else (0, 2, 1, 3)
        return t.view(b, n, 4, 8).permute(*order)

    def forward(self, x):
        b, n, _ = x.shape
        freqs = torch.einsum("i , j -> i j", torch.arange(n, device=x.device).float(),
                             self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[None, None], emb.sin()[None, None]
        if self.layout == "packed":  # GPT-NeoX's [q_h, k_h, v_h] per head, permuted
            q, k, v = self.to_qkv(x).view(b, n, 4, 24).permute(0, 2, 1, 3).chunk(3, dim=-1)
        else:
            q, k, v = (self.heads(p(x)) for p in (self.to_q, self.to_k, self.to_v))
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y.transpose(-3, -2).reshape(b, n, 32) if self.layout != "batch_last" else \
            y.permute(1, 2, 0, 3).reshape(b, n, 32)


@pytest.mark.parametrize("layout", ["permute", "einops", "packed", "batch_last"])
def test_heads_permuted_like_einops(layout):
    """A head split by permute(0, 2, 1, 3) (einops) is the heads' transpose: one fused GEMM
    with v, a training step against eager; a permute that moves the batch is no head split
    and is left by the matcher (exact)."""
    if layout == "einops":
        pytest.importorskip("einops")
    spelling_step(PermutedHeads(layout), look_alike=layout == "batch_last")


class XTransformersAttention(torch.nn.Module):
    """x-transformers' attention (lucidrains; 4 query heads of 8, 2 kv heads): heads split
    by ``rearrange(t, 'b n (h d) -> b h n d')``; its RotaryEmbedding's angles
    ``einsum('b i , j -> b i j', pos, inv_freq) / interpolation_factor`` (1), each pair's
    angle repeated by ``stack((f, f), -1)`` + ``rearrange('... d r -> ... (d r)')``; its
    apply_rotary_pos_emb on the first ``rot`` features (``rotary_emb_dim``: half the head
    by default), ``(t·cos(f)·scale) + (rotate_half(t)·sin(f)·scale)`` with scale 1 (no
    xpos); rotate_half as ``rearrange(x, '... (d r) -> ... d r', r=2)``, ``unbind(-1)``,
    ``stack((-x2, x1), -1)``, rearranged back; k and v repeated by ``repeat(t, 'b kvh n
    d -> b (r kvh) n d')``: tiled, query head h reading kv head h mod kvh (no repeat_kv,
    which SDPA's enable_gqa reads as h // r). Layouts: "xtransformers" (the einops calls
    as the views they trace to), "einops" (einops itself), "full" (every feature
    rotated); look-alikes: "scaled" (scale 2 on both products: a rotation times 2, not
    matched as one), "uneven" (scale 1 on the cos product, 2 on the sin one), "negated"
    (``stack((x2, -x1))``: the rotation by −θ), "unit_read" (the cos product times its
    unit scale also read by the output: the fused GEMM never writes it)."""

    def __init__(self, layout):
        super().__init__()
        self.layout = layout
        self.rot = 8 if layout == "full" else 4
        self.to_q = torch.nn.Linear(32, 32, bias=False)
        self.to_k = torch.nn.Linear(32, 16, bias=False)
        self.to_v = torch.nn.Linear(32, 16, bias=False)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, self.rot, 2).float() / self.rot))
        self.register_buffer("inv_freq", inv_freq)

    def rearrange(self, t, pattern, **sizes):
        if self.layout == "einops":
            from einops import rearrange
            return rearrange(t, pattern, **sizes)
        if pattern == "b n (h d) -> b h n d":
            return t.view(*t.shape[:2], sizes["h"], -1).permute(0, 2, 1, 3)
        if pattern == "... (d r) -> ... d r":
            return t.reshape(*t.shape[:-1], -1, 2)
        assert pattern == "... d r -> ... (d r)"
        return t.reshape(*t.shape[:-2], -1)

    def rotate_half(self, x):
        x1, x2 = self.rearrange(x, "... (d r) -> ... d r", r=2).unbind(dim=-1)
        x = torch.stack((x2, -x1) if self.layout == "negated" else (-x2, x1), dim=-1)
        return self.rearrange(x, "... d r -> ... (d r)")

    def frequencies(self, n):
        pos = torch.arange(n, device=self.inv_freq.device)[None]
        freqs = torch.einsum("b i , j -> b i j", pos.type_as(self.inv_freq),
                             self.inv_freq) / 1.0
        return self.rearrange(torch.stack((freqs, freqs), dim=-1), "... d r -> ... (d r)")

    def apply_rotary(self, t, freqs):
        scale = 2.0 if self.layout == "scaled" else 1.0
        sin_scale = 2.0 if self.layout in ("scaled", "uneven") else 1.0
        freqs = freqs[:, -t.shape[-2]:, :][:, None]  # rearrange 'b n d -> b 1 n d'
        t, t_unrotated = t[..., :self.rot], t[..., self.rot:]
        cos_product = t * freqs.cos() * scale
        if self.layout == "unit_read":  # (a stored attribute escapes the graph)
            self.cos_product = cos_product
        t = cos_product + (self.rotate_half(t) * freqs.sin() * sin_scale)
        return torch.cat((t, t_unrotated), dim=-1).type(t.dtype)

    def forward(self, x):
        b, n, _ = x.shape
        q = self.rearrange(self.to_q(x), "b n (h d) -> b h n d", h=4)
        k = self.rearrange(self.to_k(x), "b n (h d) -> b h n d", h=2)
        v = self.rearrange(self.to_v(x), "b n (h d) -> b h n d", h=2)
        freqs = self.frequencies(n)
        q, k = self.apply_rotary(q, freqs), self.apply_rotary(k, freqs)
        # repeat(t, 'b kvh n d -> b (r kvh) n d', r=2): the kv heads tiled
        k, v = (t[:, None].expand(b, 2, 2, n, 8).reshape(b, 4, n, 8) for t in (k, v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.permute(0, 2, 1, 3).reshape(b, n, 32)
        return y + self.cos_product.sum() if self.layout == "unit_read" else y


@pytest.mark.parametrize("layout", ["xtransformers", "einops", "full", "scaled", "uneven",
                                    "negated", "unit_read"])
def test_x_transformers_spelling_and_look_alikes(layout):
    """x-transformers' rotation (the adjacent pairs unbound from a view, stacked and
    merged back by a reshape, both products times a unit scale) is one fused GEMM with v
    joining it, a training step against eager; its tiled kv heads are no repeat_kv, so
    the attention rewrite leaves them (enable_gqa would pair the heads otherwise); the
    look-alikes are left by the matcher (exact)."""
    if layout == "einops":
        pytest.importorskip("einops")
    look_alike = layout in ("scaled", "uneven", "negated", "unit_read")
    report, _ = spelling_step(XTransformersAttention(layout), look_alike)
    assert report.count(pattern="attention_inputs") == 0, str(report)


def test_the_rotations_column_flags_are_made_once_where_the_graph_runs_as_python():
    """layouts.rope_rotated_columns, a constant of the match: an optimize()d graph (run as
    Python) gets the same tensor on every call, made outside inference mode so that a
    later call autograd records can read it; a traced graph gets the fills as its own
    ops, nothing cached."""
    from torch.fx.experimental.proxy_tensor import make_fx
    spans = ((64, True), (32, True), (32, False))
    like = torch.zeros(2, 3)
    with torch.inference_mode():
        first = layouts.rope_rotated_columns(spans, like)
    assert not first.is_inference()
    assert layouts.rope_rotated_columns(spans, like) is first
    assert first.dtype == torch.float32 and first.tolist() == [1.0] * 96 + [0.0] * 32
    other = ((16, True), (8, False))
    gm = make_fx(lambda t: layouts.rope_rotated_columns(other, t), tracing_mode="fake")(like)
    assert sum(n.target == torch.ops.aten.full.default for n in gm.graph.nodes) == 2
    assert not any(key[1] == (other,) for key in layouts._CONSTANTS)
    assert gm(like).tolist() == [1.0] * 16 + [0.0] * 8
    # the QK-norm's keep flags and a partial rotary's identity pair are such constants too
    # (the pair was a host-to-device copy per call: a wait on the GPU's queue)
    layout = ((0, 64, 2, 32, 32, 0, 0), (64, 96, 0, 0, 0, 0, 0))
    keep = layouts.rope_norm_keep(layout, (0.0, None), like)
    assert layouts.rope_norm_keep(layout, (0.0, None), like) is keep
    assert keep.tolist() == [0.0] * 64 + [1.0] * 32
    pairs = torch.rand(3, 4, dtype=torch.float64)
    rows = layouts._head_rows(pairs, 8, 2)
    assert torch.equal(rows[:, 2:6], pairs) and rows[:, :2].tolist() == [[1.0, 0.0]] * 3
    assert layouts._head_rows(pairs, 8, 2).dtype == torch.float64
