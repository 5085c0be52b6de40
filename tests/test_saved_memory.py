"""What the backward keeps (issue #16: "nothing saved beyond eager's"): the bytes autograd
saves in a training forward, counted as benchmarks/saved_memory.py counts them (every
saved tensor through saved_tensors_hooks, once per storage, parameters left out), for a
small bf16 Hugging Face Llama. A decoder layer's share is a 2-layer model's count less a
1-layer model's; the rest is the embedding, the final norm, the LM head and the loss."""

from __future__ import annotations

import os
import sys

import torch

import coda_rewrite

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
import saved_memory  # noqa: E402

TOKENS = 64


def llama(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                      max_position_embeddings=512, tie_word_embeddings=True,
                      attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(torch.bfloat16).train()


def saved(make) -> tuple[int, int]:
    """(bytes per decoder layer, bytes of the rest) that ``make(model)`` saves."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    ids = torch.randint(0, 512, (1, TOKENS), generator=torch.Generator().manual_seed(0))
    got = {}
    for layers in (1, 2):
        torch._dynamo.reset()
        m = make(llama(layers))
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            m(input_ids=ids, labels=ids)  # compiled outside the count
        got[layers] = saved_memory.saved_bytes(lambda: m(input_ids=ids, labels=ids).loss, m)
    return got[2] - got[1], 2 * got[1] - got[2]


def coda(**options):
    return lambda m: torch.compile(m, backend=coda_rewrite.CodaBackend(
        coda_rewrite.Options(fuse_in_training=True, **options)))


def test_no_fused_family_saves_more_than_eager_or_torch_compile():
    """Every family fused in training: through Inductor (backend="coda") per decoder layer
    no more than torch.compile keeps; through optimize() (the rewritten graph run as it
    is: no partitioner recomputes its other ops, as in eager) no more than eager; the rest
    no more than eager either way; without the logits (materialize_logits=False) the LM
    head keeps less than half of what it keeps with them."""
    eager = saved(lambda m: m)
    compiled = saved(torch.compile)
    fused = saved(coda())
    optimized = saved(lambda m: coda_rewrite.optimize(m, fuse_in_training=True))
    no_logits = saved(coda(materialize_logits=False))
    assert compiled[0] <= eager[0]
    for name, (layer, rest), bar in [("backend=coda", fused, compiled[0]),
                                     ("materialize_logits=False", no_logits, compiled[0]),
                                     ("optimize()", optimized, eager[0])]:
        assert layer <= bar, (name, layer, compiled, eager)
        assert rest <= eager[1], (name, rest, eager)
    assert no_logits[1] < fused[1] / 2, (no_logits, fused)
