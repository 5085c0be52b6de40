"""Which rewrite families apply to which Hugging Face causal-LM architecture: the
coverage table in README.md, generated against the installed transformers.

    python tools/coverage.py [model_type ...] > coverage.md
    python tools/coverage.py --experts batched_mm [model_type ...]

Each decoder-only causal LM of transformers' auto mapping is built from a tiny config
(2 layers, hidden 64, 4 heads / 2 key-value heads, vocabulary 256, random weights,
float32, CPU), then explain() captures one training-shaped forward with labels (so the
loss is in the graph). A cell says how many candidates of the family were rewritten, and
for those left the most common reason code (algebra/decision.Why). Architectures that
cannot be built from such a config, or whose forward raises on CPU, are listed with the
error; encoder-decoder, encoder-only and recurrent/state-space models are skipped.

``--experts IMPL``: every architecture whose experts take transformers' experts
interface, with that experts implementation selected: the experts' records and the
logits of optimize() against eager's (float32, under no_grad).
"""

from __future__ import annotations

import collections
import sys
import traceback

import torch

# Not decoder-only transformer LLMs: encoders, seq2seq decoders, speech/vision-language
# stacks, recurrent and state-space models (their causal-LM heads exist for other uses).
SKIP = {
    "bart", "bert", "bert-generation", "big_bird", "bigbird_pegasus", "blenderbot",
    "blenderbot-small", "camembert", "data2vec-text", "electra", "ernie", "marian", "mbart",
    "megatron-bert", "mvp", "pegasus", "plbart", "prophetnet", "rembert", "roberta",
    "roberta-prelayernorm", "roc_bert", "roformer", "trocr", "whisper", "xlm", "xlm-roberta",
    "xlm-roberta-xl", "xmod", "xlnet", "reformer", "musicgen", "musicgen_melody", "moshi",
    "mamba", "mamba2", "falcon_mamba", "rwkv", "xlstm", "recurrent_gemma", "fuyu", "git",
    "got_ocr2", "mllama", "emu3", "phi4_multimodal", "cpmant", "ctrl", "openai-gpt",
    "gpt-sw3", "blt", "modernbert-decoder",
}
FAMILIES = ("attention_inputs", "residual_rmsnorm_gemm", "gated_mlp", "routed_experts",
            "rope", "lm_head_cross_entropy", "layernorm_gemm")
SHORT = {"attention_inputs": "attention", "residual_rmsnorm_gemm": "norm → GEMM",
         "gated_mlp": "gated MLP", "routed_experts": "experts (routed or dense)", "rope": "RoPE",
         "lm_head_cross_entropy": "LM head + loss",
         "layernorm_gemm": "LayerNorm → GEMM"}

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=256, head_dim=16,
            max_position_embeddings=128, moe_intermediate_size=32, num_experts=4,
            num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
            shared_expert_intermediate_size=64, first_k_dense_replace=1,
            pad_token_id=0, bos_token_id=1, eos_token_id=2, attn_implementation="sdpa",
            # GPT-2-style names
            n_embd=64, n_layer=2, n_head=4, n_inner=128, n_positions=128,
            # MLA (DeepSeek): small ranks
            q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=16, n_group=2, topk_group=1)


# Wider than TINY, for the GPU (tools/survey.py --gpu): heads of 64 and widths that are
# multiples of 128, so the generated kernels' layout contracts hold and they run, where
# TINY's 16-wide heads send most fused GEMMs to their reference
GPU_WIDTHS = dict(hidden_size=256, intermediate_size=512, head_dim=64, vocab_size=512,
                  moe_intermediate_size=128, shared_expert_intermediate_size=256,
                  n_embd=256, n_inner=512, q_lora_rank=64, kv_lora_rank=64,
                  qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64,
                  # names transformers 5.25's configs add (Ergo's dense first layer and
                  # shared experts, Inkling2's sliding-window heads and its LM head's
                  # unpadded vocabulary): left at their full sizes, the model is past
                  # build()'s size guard at these widths
                  first_dense_intermediate_size=512, shared_intermediate_size=256,
                  swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=64,
                  unpadded_vocab_size=512)


def build(model_type: str, widths: dict | None = None, seed: int = 0):
    """``model_type``'s tiny config (TINY, ``widths`` over it), float32, train mode, its
    weights drawn from ``seed``."""
    import transformers as tf
    cfg = tf.AutoConfig.for_model(model_type)
    tiny = {**TINY, **(widths or {})}
    if hasattr(cfg, "qk_rope_head_dim"):  # multi-head latent attention: its own dims
        # the rotary tables are head_dim wide: the config derives it from the rope part
        # (and qk_head_dim from both parts) once, at construction
        tiny["head_dim"] = tiny["qk_rope_head_dim"]
        tiny["qk_head_dim"] = tiny["qk_rope_head_dim"] + tiny["qk_nope_head_dim"]
        tiny["num_key_value_heads"] = tiny["num_attention_heads"]  # k and v per head
    if getattr(cfg, "rotary_dim", None):  # GPT-J / CodeGen: rotate part of each head
        tiny["rotary_dim"] = 8
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    for c in {id(cfg): cfg, id(text): text}.values():  # a composite config: its text part
        for key, value in tiny.items():
            if hasattr(c, key) or key == "attn_implementation":
                try:
                    setattr(c, key, value)
                except Exception:  # a read-only property of that config
                    pass
        if isinstance(getattr(c, "layer_types", None), list):
            c.layer_types = c.layer_types[:getattr(c, "num_hidden_layers", 2)]
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg)
    size = sum(p.numel() for p in model.parameters())
    if size > 20_000_000:
        raise ValueError(f"config not shrunk ({size / 1e6:.0f} M parameters)")
    return model.float().train()


def cell(records) -> str:
    if not records:
        return "·"
    done = sum(r.status == "rewritten" for r in records)
    left = collections.Counter(r.code or "?" for r in records if r.status != "rewritten")
    text = f"{done}/{len(records)}"
    if left:
        text += " (" + left.most_common(1)[0][0] + ")"
    return text


def survey(model_type: str) -> str:
    import coda_rewrite
    torch._dynamo.reset()
    try:
        model = build(model_type)
    except Exception as e:
        return f"| {model_type} | not built: {type(e).__name__} |" + " |" * (len(FAMILIES) - 1)
    ids = torch.randint(3, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    try:
        with torch.no_grad():
            model(ids, labels=ids, use_cache=False)
    except Exception as e:  # the tiny config itself does not run: not the pass's doing
        first = traceback.format_exception_only(type(e), e)[-1].strip()[:60]
        return f"| {model_type} | tiny config fails in eager: {first} |" + \
            " |" * (len(FAMILIES) - 1)
    try:
        report = coda_rewrite.explain(model, ids, labels=ids, use_cache=False)
    except Exception as e:
        first = traceback.format_exception_only(type(e), e)[-1].strip()[:60]
        who = "THE PASS FAILED" if isinstance(e, torch._dynamo.exc.BackendCompilerFailed) \
            else "dynamo cannot capture it"
        return f"| {model_type} | {who}: {first} |" + " |" * (len(FAMILIES) - 1)
    by = collections.defaultdict(list)
    for r in report.records:  # dense experts (Llama 4) count in the experts' column
        by["routed_experts" if r.pattern == "dense_experts" else r.pattern].append(r)
    return f"| {model_type} | " + " | ".join(cell(by[f]) for f in FAMILIES) + " |"


def experts_row(model_type: str, impl: str) -> str | None:
    """One row of the ``--experts`` table; None where the model has no experts module."""
    import copy

    import coda_rewrite
    from coda_rewrite.numerics import rel_err
    torch._dynamo.reset()
    try:
        model = build(model_type).eval()
    except Exception:
        return None
    if not any(hasattr(m, "has_gate") for m in model.modules()):
        return None
    model.set_experts_implementation(impl)
    ids = torch.randint(3, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    try:
        with torch.no_grad():
            want = model(ids, use_cache=False).logits
    except Exception as e:
        return f"| {model_type} | tiny config fails in eager: {str(e)[:60]} | | |"
    with torch.no_grad():
        fast = coda_rewrite.optimize(copy.deepcopy(model))
        got = fast(ids, use_cache=False).logits
    by = collections.defaultdict(list)
    for r in fast.report.records:
        by[r.pattern].append(r)
    return (f"| {model_type} | {cell(by['batched_experts'])} | {cell(by['routed_experts'])} "
            f"| {rel_err(got, want):.1e} |")


def main(argv: list[str]) -> None:
    import transformers as tf
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    impl = None
    if argv[:1] == ["--experts"]:
        impl, argv = argv[1], argv[2:]
    types = argv or sorted(t for t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if t not in SKIP)
    if impl is not None:
        print(f"transformers {tf.__version__}, torch {torch.__version__}; experts "
              f"implementation {impl!r}\n")
        print("| architecture | batched_experts | routed_experts | logits vs eager |")
        print("|---|---|---|---|")
        for t in types:
            row = experts_row(t, impl)
            if row is not None:
                print(row, flush=True)
        return
    print(f"transformers {tf.__version__}, torch {torch.__version__}; cells: rewritten / "
          "candidates (the most common reason code of those left); · no candidate\n")
    print("| architecture | " + " | ".join(SHORT[f] for f in FAMILIES) + " |")
    print("|---" * (len(FAMILIES) + 1) + "|")
    for t in types:
        print(survey(t), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
