"""More Hugging Face architectures than the pattern was written against: whatever each
one's blocks look like (MoE, QK-norm, LayerNorm, parallel blocks, sandwich norms), the
rewritten model computes what eager computes, and the rewrite count is what the
architecture allows."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

import coda_rewrite
from coda_rewrite.numerics import rel_err

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
              pad_token_id=0)

# (config, model, extra config, at least this many norms rewritten, RoPE rewrites)
ARCHS = [
    ("Phi3Config", "Phi3ForCausalLM", {}, 5, 2),                # packed qkv / gate_up
    ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}, 5, 2),  # q/k norms over heads
    ("GraniteConfig", "GraniteForCausalLM", {}, 5, 2),          # residual multiplier
    ("MixtralConfig", "MixtralForCausalLM",
     {"num_local_experts": 4, "num_experts_per_tok": 2}, 3, 2),  # MoE MLP: routed GEMMs
    ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 16}, 1, 2),  # sandwich norms,
                                                                        # QK-norm
    ("CohereConfig", "CohereForCausalLM", {}, 0, 2),            # LayerNorm, parallel block,
                                                                # RoPE on interleaved pairs
    ("Starcoder2Config", "Starcoder2ForCausalLM", {}, 0, 2),    # LayerNorm with bias
    ("Exaone4Config", "Exaone4ForCausalLM", {}, 1, 2),       # QK-norm, sandwich norms
    ("StableLmConfig", "StableLmForCausalLM", {"partial_rotary_factor": 0.25}, 0, 2),
    ("PhiConfig", "PhiForCausalLM", {"partial_rotary_factor": 0.5}, 0, 2),
    ("GPTNeoXConfig", "GPTNeoXForCausalLM", {"rotary_pct": 0.25}, 0, 2),  # q/k/v per head
    ("Olmo2Config", "Olmo2ForCausalLM", {}, 0, 0),              # a norm over the whole q
]


@pytest.mark.parametrize("cfg,cls,extra,min_norms,ropes", ARCHS, ids=[a[1] for a in ARCHS])
def test_architecture_stays_exact(cfg, cls, extra, min_norms, ropes):
    if not hasattr(tf, cls):
        pytest.skip(f"transformers {tf.__version__} has no {cls}")
    torch.manual_seed(0)
    model = getattr(tf, cls)(getattr(tf, cfg)(**{**COMMON, **extra})).eval()
    ids = torch.randint(1, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    fast = coda_rewrite.optimize(model)
    with torch.no_grad():
        assert rel_err(fast(ids).logits, model(ids).logits) <= 1e-5
    report = fast.report
    assert report.count() >= min_norms, str(report)
    assert report.count(pattern="rope") == ropes, str(report)
    assert all(r.reason for r in report.records if r.status != "rewritten"), str(report)


def test_norms_no_gemm_reads_say_what_they_are():
    """Post-sublayer ("sandwich") norms (Gemma 2, OLMo 2) and norms over a projection's
    output (OLMo 2's QK-norm) are not fused yet; the report says which they are, with
    their own codes, and the rest of each model is rewritten."""
    import collections

    import coda_rewrite
    from conftest import hf_model, tokens
    for family, want in (("gemma2", {"row_scale.post_sublayer": 4}),
                         ("olmo2", {"row_scale.post_sublayer": 4,
                                    "row_scale.over_projection": 4})):
        report = coda_rewrite.explain(hf_model(family).eval(), tokens(), use_cache=False)
        left = collections.Counter(r.code for r in report.records
                                   if r.pattern == "residual_rmsnorm_gemm"
                                   and r.status != "rewritten")
        assert left == want, (family, left)


def step_matches_eager(fast, model, ref, ids):
    """One training step of ``fast`` (over ``model``) against eager's on ``ref``: the
    loss within 1e-5, every gradient within 1e-4, none gained or lost."""
    loss, want = fast(ids, labels=ids).loss, ref(ids, labels=ids).loss
    assert abs(loss.item() - want.item()) <= 1e-5 * abs(want.item())
    loss.backward()
    want.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            assert rel_err(p.grad, q.grad) <= 1e-4, name


MLA = dict(q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
           v_head_dim=16, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
           n_group=2, topk_group=1, first_k_dense_replace=1, moe_intermediate_size=32)


@pytest.mark.parametrize("cfg,cls,ropes,rope_code", [
    ("DeepseekV2Config", "DeepseekV2ForCausalLM", 2, "rope.latent_shared_key"),
    ("DeepseekV3Config", "DeepseekV3ForCausalLM", 2, "rope.latent_shared_key")])
def test_multi_head_latent_attention_training_step_stays_exact(cfg, cls, ropes, rope_code):
    """DeepSeek's multi-head latent attention (low-rank q and kv with their own norms, the
    rotary part of each head split off after the rest, k's from the compressed kv): the
    norms, MLPs, attention and loss are rewritten around it, and the query's rotation
    (V2: by a complex table, V3: pairs read interleaved; tests/test_rope.py has the
    details); the key's shared rotary part is left with its reason. Loss within 1e-5,
    every gradient within 1e-4 of eager."""
    import copy
    torch.manual_seed(0)
    model = getattr(tf, cls)(getattr(tf, cfg)(**{**COMMON, **MLA})).train()
    ref = copy.deepcopy(model)
    ids = torch.randint(1, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    fast = coda_rewrite.optimize(model)
    step_matches_eager(fast, model, ref, ids)
    report = fast.report
    assert report.count() >= 5 and report.count(pattern=None) >= 10, str(report)
    assert report.count(pattern="rope") == ropes, str(report)
    left = [r for r in report.records if r.pattern == "rope" and r.status != "rewritten"]
    assert left and all(r.code == rope_code for r in left), [r.code for r in left]


# (config, model, extra config, the families every release checked rewrites): blocks the
# families were not written against, in a training step with every family fused
TRAINING = [
    ("Olmo3Config", "Olmo3ForCausalLM", {}, {"gated_mlp", "residual_rmsnorm_gemm"}),
    ("Glm4Config", "Glm4ForCausalLM", {}, {"rope", "residual_rmsnorm_gemm"}),  # sandwich
    ("SmolLM3Config", "SmolLM3ForCausalLM", {}, {"rope", "gated_mlp"}),  # NoPE layers
    ("NemotronConfig", "NemotronForCausalLM", {}, {"layernorm_gemm"}),  # (1 + w), relu²
    ("Cohere2Config", "Cohere2ForCausalLM", {}, {"rope", "gated_mlp"}),  # parallel block
    ("ArceeConfig", "ArceeForCausalLM", {}, {"residual_rmsnorm_gemm"}),  # relu², no gate
    ("ApertusConfig", "ApertusForCausalLM", {}, {"residual_rmsnorm_gemm"}),  # xIELU
    ("BitNetConfig", "BitNetForCausalLM", {}, {"residual_rmsnorm_gemm"}),
    ("SeedOssConfig", "SeedOssForCausalLM",  # attention / residual dropout off
     {"attention_dropout": 0.0, "residual_dropout": 0.0}, {"rope", "gated_mlp"}),
    ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",  # shared expert beside the routed ones
     {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
      "shared_expert_intermediate_size": 32}, {"routed_experts", "gated_mlp"}),
    ("PhimoeConfig", "PhimoeForCausalLM",  # sparsemixer routing, jitter off
     {"num_local_experts": 4, "num_experts_per_tok": 2, "router_jitter_noise": 0.0,
      "input_jitter_noise": 0.0}, {"routed_experts", "rope"}),
    ("Lfm2Config", "Lfm2ForCausalLM", {}, {"gated_mlp", "rope"}),  # conv layers between
]


@pytest.mark.parametrize("cfg,cls,extra,families", TRAINING, ids=[a[1] for a in TRAINING])
def test_architecture_training_step_stays_exact(cfg, cls, extra, families):
    """A float32 training step through optimize(fuse_in_training=True): the loss within
    1e-5 and every gradient within 1e-4 of eager's, no parameter's gradient gained or
    lost, and the families the block allows rewritten (not a silent no-op)."""
    import copy
    if not hasattr(tf, cls):
        pytest.skip(f"transformers {tf.__version__} has no {cls}")
    torch.manual_seed(0)
    model = getattr(tf, cls)(getattr(tf, cfg)(**{**COMMON, "bos_token_id": 1,
                                                 "eos_token_id": 2, **extra})).train()
    with torch.no_grad():  # non-trivial norm weights, so a dropped or misplaced γ shows
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.uniform_(0.5, 1.5)
    ref = copy.deepcopy(model)
    ids = torch.randint(3, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    fast = coda_rewrite.optimize(model, fuse_in_training=True)
    step_matches_eager(fast, model, ref, ids)
    done = {r.pattern for r in fast.report.records if r.status == "rewritten"}
    assert families | {"lm_head_cross_entropy"} <= done, \
        str(fast.report)
