"""Models beyond the causal LM: encoders (post-norm BERT, ModernBERT's GeGLU), an
encoder-decoder with cross-attention (BART), and the classification and question-answering
heads people put on decoders. The families were written against decoder LMs; here each
meets what it was not written for (a norm whose output is the next residual, a mask
that is not causal, logits gathered at the last real token, a loss over a handful of
labels), and the rewritten model must compute what eager computes, in training and at
eval, with at least the rewrites these architectures allow."""

from __future__ import annotations

import collections
import copy

import pytest
import torch
import transformers as tf

import coda_rewrite
from coda_rewrite.numerics import rel_err

WIDTHS = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
              pad_token_id=0, num_labels=3, attn_implementation="sdpa",
              # BART's names for the same widths
              d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
              decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
              # ModernBERT: every layer global (its local window is another mask)
              global_attn_every_n_layers=1)


def build(model_type: str, head: str):
    cfg = tf.AutoConfig.for_model(model_type)
    for key, value in WIDTHS.items():
        if hasattr(cfg, key) or key == "attn_implementation":
            setattr(cfg, key, value)
    torch.manual_seed(0)
    return getattr(tf, head)(cfg).float()


def batch(head: str) -> tuple[dict, dict]:
    """Inputs with padding (the second sequence's last four tokens) and the head's
    labels, some of them ignored where the loss allows it."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 250, (2, 16), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 12:] = 0
    inputs = dict(input_ids=ids, attention_mask=mask)
    if "Seq2Seq" in head:
        inputs["decoder_input_ids"] = torch.randint(3, 250, (2, 10), generator=gen)
        labels = dict(labels=torch.randint(3, 250, (2, 10), generator=gen))
    elif "SequenceClassification" in head:
        labels = dict(labels=torch.tensor([0, 2]))
    elif "TokenClassification" in head:
        labels = dict(labels=torch.randint(0, 3, (2, 16), generator=gen))
    elif "QuestionAnswering" in head:
        labels = dict(start_positions=torch.tensor([1, 3]), end_positions=torch.tensor([4, 5]))
    else:  # masked LM: only some positions carry a label
        labels = ids.clone()
        labels[:, ::3] = -100
        labels = dict(labels=labels)
    return inputs, labels


def first_output(out) -> torch.Tensor:
    return out.logits if getattr(out, "logits", None) is not None else out.start_logits


def rewritten(report) -> collections.Counter:
    return collections.Counter(r.pattern for r in report.records if r.status == "rewritten")


# (model type, head, at least these rewrites in training (every family fused), at eval)
CASES = [
    # post-norm: each LayerNorm's output is the next residual (materialised anyway); the
    # MLM head's dense → LayerNorm → decoder, and its loss over the labelled positions
    ("bert", "BertForMaskedLM",
     {"layernorm_gemm": 1, "lm_head_cross_entropy": 1}, {"layernorm_gemm": 1}),
    # pre-norm LayerNorm without bias, GeGLU on a packed Wi, bidirectional attention
    ("modernbert", "ModernBertForMaskedLM",
     {"layernorm_gemm": 2, "gated_mlp": 2, "lm_head_cross_entropy": 1},
     {"layernorm_gemm": 2, "gated_mlp": 2}),
    # cross-attention (q_len ≠ kv_len) beside the decoder's causal self-attention (whose
    # causal mask transformers 5.17 builds, and the attention rewrite drops for
    # is_causal; 5.25 passes none: nothing to rewrite there)
    ("bart", "BartForConditionalGeneration", {}, {"layernorm_gemm": 1}),
    # the score GEMM's logits gathered at each sequence's last real token
    ("llama", "LlamaForSequenceClassification",
     {"residual_rmsnorm_gemm": 5, "gated_mlp": 2, "rope": 2},
     {"residual_rmsnorm_gemm": 5, "gated_mlp": 2, "rope": 2}),
    # a loss over 3 labels (N = 3), every token
    ("qwen3", "Qwen3ForTokenClassification",
     {"residual_rmsnorm_gemm": 4, "gated_mlp": 2, "rope": 2, "lm_head_cross_entropy": 1},
     {"residual_rmsnorm_gemm": 5, "gated_mlp": 2, "rope": 2}),
    # two logits per token, split into start and end
    ("llama", "LlamaForQuestionAnswering",
     {"residual_rmsnorm_gemm": 5, "gated_mlp": 2, "rope": 2},
     {"residual_rmsnorm_gemm": 5, "gated_mlp": 2, "rope": 2}),
]


@pytest.mark.parametrize("model_type,head,in_training,at_eval", CASES,
                         ids=[c[1] for c in CASES])
def test_head_stays_exact(model_type, head, in_training, at_eval):
    """A training step (every family fused, dropout drawn alike) and an eval forward
    against eager: the loss within 1e-5, every gradient within 1e-4 (norm-wise, of the
    largest), the eval outputs within 1e-5, and at least the rewrites listed."""
    if not hasattr(tf, head):
        pytest.skip(f"transformers {tf.__version__} has no {head}")
    model = build(model_type, head).train()
    ref = copy.deepcopy(model)
    inputs, labels = batch(head)
    fast = coda_rewrite.optimize(model, fuse_in_training=True)
    torch.manual_seed(1)
    loss = fast(**inputs, **labels).loss
    torch.manual_seed(1)
    want = ref(**inputs, **labels).loss
    assert abs(loss.item() - want.item()) <= 1e-5 * abs(want.item())
    loss.backward()
    want.backward()
    grads = [(name, p.grad, q.grad) for (name, p), q in
             zip(model.named_parameters(), ref.parameters()) if q.grad is not None]
    scale = max(g.norm().item() for _, _, g in grads)
    for name, got, expected in grads:
        assert got is not None, name
        assert (got - expected).norm().item() <= 1e-4 * scale, name
    counts = rewritten(fast.report)
    assert all(counts[f] >= n for f, n in in_training.items()), (counts, str(fast.report))

    model.eval()
    ref.eval()
    torch._dynamo.reset()
    served = coda_rewrite.optimize(model)
    with torch.no_grad():
        assert rel_err(first_output(served(**inputs)), first_output(ref(**inputs))) <= 1e-5
    counts = rewritten(served.report)
    assert all(counts[f] >= n for f, n in at_eval.items()), (counts, str(served.report))
