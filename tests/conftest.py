"""Shared fixtures: small Hugging Face models from configs (random weights, no
downloads), the plain-PyTorch Llama, and a clean dynamo state per test."""

from __future__ import annotations

import json
import os
import random
import sys
import zlib

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the tests' models are small: every GEMM is fused on the GPU too (the size threshold,
# options.min_fused_rows, is a speed decision, tested on its own)
os.environ.setdefault("CODA_MIN_FUSED_ROWS", "0")
# ... and every family in training graphs, whose backward rules the tests check (whether a
# family pays in a training step, options.fuse_in_training, is tested on its own)
os.environ.setdefault("CODA_FUSE_IN_TRAINING", "1")
if ROOT not in sys.path:  # the GPU image runs the tests from the source tree
    sys.path.insert(0, ROOT)


def pytest_addoption(parser):
    parser.addoption("--inductor", action="store_true", default=False,
                     help="hand every rewritten graph to Inductor (slow on CPU); by "
                          "default only the tests marked `inductor` do")


@pytest.fixture
def inductor(request) -> bool:
    return request.config.getoption("--inductor")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    # Each test compiles new model instances of the same classes; without a reset the
    # recompile limit would silently send later tests to eager.
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def _seeded(request):
    # Each test draws from its own seed (its node id's CRC): without it, a test that draws
    # without seeding gets whatever state the tests before it on the same xdist worker
    # left, which depends on the scheduling (an exact bf16 tie between two router logits
    # failed one CI run that way); with it, a failure replays from the test alone.
    seed = zlib.crc32(request.node.nodeid.encode())
    random.seed(seed)
    torch.manual_seed(seed)


def pytest_configure(config):
    config.addinivalue_line("markers", "provokes_pass_bug: the test provokes a witness "
                            "disagreement or checker error on purpose (the guard below lets "
                            "it through)")


@pytest.fixture(autouse=True)
def _no_pass_bugs(request, monkeypatch):
    """Every graph any test rewrites: a witness disagreement or an internal error in the
    checker is a bug of the pass, never an outcome to show users, so the test fails on it
    (wherever it occurs, whatever the test itself asserts); a match left as is without a
    condition code fails it too. With CODA_SNAPSHOT=PATH, the
    match records go to PATH.<pid> (a refactoring's "no behaviour change" check)."""
    import coda_rewrite.backend as backend

    found, uncoded = [], []
    real = backend.rewrite_graph

    snapshot = os.environ.get("CODA_SNAPSHOT")

    def spy(gm, options, index=0):
        report = real(gm, options, index)
        found.extend(r for r in report.records if r.kind is not None and r.kind.is_bug)
        uncoded.extend(r for r in report.records if r.status != "rewritten" and not r.code)
        if snapshot:  # the match records of every graph the suite rewrites, one per line
            with open(f"{snapshot}.{os.getpid()}", "a") as f:
                for r in report.records:
                    f.write(json.dumps([request.node.nodeid, index, r.pattern, r.path,
                                        r.status, r.kind.name if r.kind else None,
                                        [p.key for p in r.programs]]) + "\n")
        return report

    monkeypatch.setattr(backend, "rewrite_graph", spy)
    yield found
    if not request.node.get_closest_marker("provokes_pass_bug"):
        assert not found, "the pass reported its own bug:\n" + "\n".join(
            f"{r.pattern} at {r.path}: {r.kind.name}: {r.reason}" for r in found)
    # every match left as is says why as a code too (what programs and tests read)
    assert not uncoded, "left as is without a code:\n" + "\n".join(
        f"{r.pattern} at {r.path}: {r.reason}" for r in uncoded)


# ---- models ---------------------------------------------------------------------------

HF_FAMILIES = ("llama", "qwen2", "mistral")


def hf_model(family: str, *, layers: int = 2, hidden: int = 64, seed: int = 0,
             dtype=torch.float32, **overrides):
    """A small Hugging Face causal LM with grouped-query attention and random weights."""
    import transformers as tf

    common = dict(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=128, attn_implementation="sdpa")
    cfg_cls, model_cls = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "gemma": (tf.GemmaConfig, tf.GemmaForCausalLM),
        "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM),
        "olmo2": (tf.Olmo2Config, tf.Olmo2ForCausalLM),
        # QK-norm: an RMSNorm over each head of q and k before the rotation (Gemma 3's
        # after the heads' transpose, with (1 + w) and sandwich norms)
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM),
        "hunyuan": (tf.HunYuanDenseV1Config, tf.HunYuanDenseV1ForCausalLM),  # after RoPE
        "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM),
        # interleaved-pair RoPE (x[..., 0::2] / x[..., 1::2]); GLM's is partial, Cohere's
        # casts q to float32 around it and has LayerNorm, GPT-J has rotary_dim < head_dim
        "glm": (tf.GlmConfig, tf.GlmForCausalLM),
        "helium": (tf.HeliumConfig, tf.HeliumForCausalLM),
        "cohere": (tf.CohereConfig, tf.CohereForCausalLM),
        "gptj": (tf.GPTJConfig, tf.GPTJForCausalLM),
        "ernie4_5": (tf.Ernie4_5Config, tf.Ernie4_5ForCausalLM),  # casts on both products
        # RoPE written out over chunk halves with half-width cos/sin; attention sinks, MoE
        "gpt_oss": (tf.GptOssConfig, tf.GptOssForCausalLM),
        # q, k, v packed per head in one projection ([q_h, k_h, v_h]), partial rotary
        "gpt_neox": (tf.GPTNeoXConfig, tf.GPTNeoXForCausalLM),
        # Falcon: heads indexed out of a view of the packed projection (three layouts)
        "falcon": (tf.FalconConfig, tf.FalconForCausalLM),
        # CodeGen: q, v, k split within 4 model-parallel blocks of the packed projection
        "codegen": (tf.CodeGenConfig, tf.CodeGenForCausalLM),
        # multi-head latent attention: low-rank q and kv, the rotated part a suffix of
        # each q head, k's one shared head; DeepSeek-V3 reads its pairs interleaved
        # (rope_interleave), MiniCPM3 rotates halves, DeepSeek-V2 by a complex table
        "deepseek_v3": (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM),
        "minicpm3": (tf.MiniCPM3Config, tf.MiniCPM3ForCausalLM),
        "deepseek_v2": (tf.DeepseekV2Config, tf.DeepseekV2ForCausalLM),  # complex form
    }[family]
    if family in ("deepseek_v3", "minicpm3", "deepseek_v2"):
        common.update(q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
                      qk_nope_head_dim=8, v_head_dim=16, num_key_value_heads=4,
                      n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
                      first_k_dense_replace=1, moe_intermediate_size=32)
    if family == "gpt_oss":
        common.update(num_local_experts=4, num_experts_per_tok=2, attn_implementation="eager",
                      layer_types=["full_attention"] * layers)
    if family in ("gptj", "codegen"):  # GPT-2-style names, no grouped-query attention
        common = dict(vocab_size=256, n_embd=hidden, n_layer=layers, n_head=4,
                      n_positions=128, rotary_dim=hidden // 8, attn_implementation="eager",
                      bos_token_id=1, eos_token_id=2)  # its attention: eager's only
    if family in ("phi3", "glm", "helium", "cohere", "gpt_oss", "gpt_neox", "falcon",
                  "ernie4_5", "deepseek_v3", "minicpm3", "deepseek_v2"):
        # their default special token ids lie outside the small vocabulary
        common.update(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family in ("gemma", "gemma2", "glm", "helium", "gpt_oss", "ernie4_5"):  # head_dim
        common["head_dim"] = hidden // 4
    cfg = cfg_cls(**{**common, **overrides})
    torch.manual_seed(seed)
    try:
        model = model_cls(cfg)
    except ValueError as e:  # a release that dropped SDPA for it (Gemma 2 after 5.17.0)
        if "does not support an attention implementation" not in str(e) or \
                cfg._attn_implementation != "sdpa":
            raise
        cfg = cfg_cls(**{**common, **overrides, "attn_implementation": "eager"})
        torch.manual_seed(seed)
        model = model_cls(cfg)
    with torch.no_grad():  # non-trivial norm weights, so a dropped or misplaced γ shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(-0.5, 0.5) if family.startswith("gemma") else p.uniform_(0.5, 1.5)
    return model.to(dtype)


def plain_llama(*, layers: int = 2, dim: int = 64, seed: int = 0, **kw):
    from coda_rewrite.models import Llama, LlamaArgs

    torch.manual_seed(seed)
    return Llama(LlamaArgs(dim=dim, n_layers=layers, n_heads=4, n_kv_heads=2,
                           vocab_size=256, ffn_dim=2 * dim, max_seq_len=128, **kw))


def tokens(batch: int = 2, seq: int = 16, vocab: int = 256, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g)


class InOwnDtype(torch.nn.Module):
    """``inner`` with its input cast to the model's dtype, as a model's embedding gives
    it (a spelling module fed float32 inputs, compared in bf16 and float64 alike)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x.to(next(self.inner.parameters()).dtype))


def build(family: str, **kw):
    """An HF family's model, or the plain Llama for ``"plain"``."""
    return plain_llama(**kw) if family == "plain" else hf_model(family, **kw)


def loss_of(model, family: str, ids):
    """The training loss: HF's own (labels=), or a hand-written causal-LM loss."""
    if family == "plain":
        out = model(ids)
        return torch.nn.functional.cross_entropy(out[:, :-1].flatten(0, 1).float(),
                                                 ids[:, 1:].flatten())
    return model(ids, labels=ids).loss


def grads_match(model, ref, tol: float = 1e-4) -> None:
    """Every parameter has a gradient, within ``tol`` (norm-wise) of the reference's."""
    from coda_rewrite.numerics import rel_err
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert p.grad is not None, name
        assert rel_err(p.grad, q.grad) <= tol, (name, rel_err(p.grad, q.grad))


def refused_by_gradient_replay(family: str, pattern: str) -> None:
    """One training step of a one-layer ``family`` through optimize(fuse_in_training=True):
    the ``pattern`` match refused as witness.gradients_disagree (a test that put a
    gradient bug in, forward exact), and every gradient eager's."""
    import copy

    import coda_rewrite
    model = hf_model(family, layers=1).train()
    ref = copy.deepcopy(model)
    ids = tokens()
    fast = coda_rewrite.optimize(model, fuse_in_training=True)
    fast(ids, labels=ids).loss.backward()
    ref(ids, labels=ids).loss.backward()
    (rec,) = [r for r in fast.report.records if r.pattern == pattern]
    assert rec.status != "rewritten" and rec.code == "witness.gradients_disagree", str(rec)
    grads_match(model, ref, tol=1e-5)


def step_matches_eager(family: str, layers: int = 2, model=None, **options):
    """One training forward + backward of ``family`` (``model``: this one, built with
    config overrides, instead of build(family)) through optimize(**options) against
    eager: the loss within 1e-5, every gradient within 1e-4. Returns the report."""
    import copy

    import coda_rewrite
    model = (model if model is not None else build(family, layers=layers)).train()
    ref_model = copy.deepcopy(model)
    ids = tokens()
    fast = coda_rewrite.optimize(model, **options)
    loss, ref_loss = loss_of(fast, family, ids), loss_of(ref_model, family, ids)
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
    loss.backward()
    ref_loss.backward()
    grads_match(model, ref_model)
    return fast.report


def decode_matches_eager(model, fast, ids, steps: int = 3, tol: float = 1e-5) -> None:
    """A prefill and ``steps`` greedy decode steps with past_key_values through ``fast``
    and through eager ``model``: the logits agree at every step."""
    from coda_rewrite.numerics import rel_err
    with torch.no_grad():
        want, got = model(ids, use_cache=True), fast(ids, use_cache=True)
        for _ in range(steps):
            nxt = want.logits[:, -1:].argmax(-1)
            want = model(nxt, past_key_values=want.past_key_values, use_cache=True)
            got = fast(nxt, past_key_values=got.past_key_values, use_cache=True)
            assert rel_err(got.logits, want.logits) <= tol


def codes(report, pattern: str | None = None) -> set[str]:
    """The condition codes (algebra/decision.Why) of the matches left as is, and of the
    consumers a norm's match refused: what tests assert on, not the report's wording."""
    recs = [r for r in report.records if pattern is None or r.pattern == pattern]
    return {r.code for r in recs if r.status != "rewritten"} | {
        d.code for r in recs for _, d, _ in r.consumer_decisions if not d.accepted}


def left_as_eager(model, inputs: tuple, pattern: str, code: str) -> None:
    """A look-alike the rewrite must refuse: optimize() leaves the match with ``code`` and
    every output is eager's, bit for bit (nothing of the match was replaced)."""
    import copy

    import coda_rewrite
    ref = copy.deepcopy(model)
    with torch.no_grad():
        fast = coda_rewrite.optimize(model)
        got, want = fast(*inputs), ref(*inputs)
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert codes(fast.report, pattern) == {code}, str(fast.report)


def adversary_records(report, pattern: str, must_rewrite: bool, note) -> bool:
    """What an adversary (tests/test_property_*.py) checks of the report: each match of
    ``pattern`` left as is carries a reason code, and a spelling the rewrite must take
    was taken; ``note`` (hypothesis' event) records the outcome. True if rewritten."""
    records = [r for r in report.records if r.pattern == pattern]
    done = any(r.status == "rewritten" for r in records)
    note(f"rewritten: {done}")
    assert all(r.code for r in records if r.status != "rewritten"), str(report)
    if must_rewrite:
        assert done, str(report)
    return done


def adversary_outputs_match(got, want, truth, low: bool, case) -> None:
    """An adversary's output oracle: each output of the rewritten model against eager's
    (same shape and dtype); in bf16 no worse than eager against the float64 copy's
    ``truth`` (one draw: 1.5x, not the median's), in float32 within 1e-5 of eager."""
    from coda_rewrite.numerics import rel_err
    for o, w, t in zip(got, want, truth):
        assert o.shape == w.shape and o.dtype == w.dtype
        if low:
            assert rel_err(o, t) <= 1.5 * rel_err(w, t), (case, rel_err(o, t), rel_err(w, t))
        else:
            assert rel_err(o, w) <= 1e-5, (case, rel_err(o, w))


def outputs_step_matches_eager(model, x, what=None, out_tol: float = 1e-5,
                               grad_tol: float = 1e-4):
    """optimize(model) against a deep copy of it, eager, for a module returning a tuple of
    tensors (or one): every output, then every parameter's gradient under a squared-sum
    loss over them (None where eager's is None: a parameter the module does not use).
    ``what`` goes into the failure messages. Returns the report."""
    import copy

    import coda_rewrite
    from coda_rewrite.numerics import rel_err
    ref = copy.deepcopy(model)
    fast = coda_rewrite.optimize(model)
    got, want = fast(x), ref(x)
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    for a, b in zip(got, want):
        assert rel_err(a, b) <= out_tol, what
    sum(t.square().sum() for t in got).backward()
    sum(t.square().sum() for t in want).backward()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        if q.grad is None:
            assert p.grad is None, (name, what)
            continue
        assert rel_err(p.grad, q.grad) <= grad_tol, (name, what)
    return fast.report


def module_step_matches_eager(model, x, out_tol: float = 1e-5, grad_tol: float = 1e-4):
    """optimize(model) against a copy of it, eager: the output, the input's gradient and
    every parameter's (None where eager's is None) under a squared-sum loss. Returns the
    report."""
    import copy

    import coda_rewrite
    from coda_rewrite.numerics import rel_err
    ref = copy.deepcopy(model)
    x = x.detach().clone().requires_grad_()
    xr = x.detach().clone().requires_grad_()
    fast = coda_rewrite.optimize(model)
    out, want = fast(x), ref(xr)
    assert rel_err(out, want) <= out_tol
    out.square().sum().backward()
    want.square().sum().backward()
    assert rel_err(x.grad, xr.grad) <= grad_tol
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            assert rel_err(p.grad, q.grad) <= grad_tol, name
    return fast.report
