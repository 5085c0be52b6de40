"""The rewrite families, in the order the pipeline runs them on each captured graph.

    explicit_attention softmax((q·kᵀ)·s + mask)·v written out → one SDPA call: first, so
                       that the next family sees the call it makes
    attention          SDPA's inputs as eager passes them (is_causal, enable_gqa), before
                       RoPE, whose escape analysis reads the SDPA calls it leaves
    dense_experts      a mixture-of-experts layer that runs every expert on every token
                       (Llama 4's bmm experts) → its routed rows only: before the
                       norms, so that they see the gather that replaces the copies
    batched_experts    per-(token, expert) GEMVs on copied expert weights (transformers'
                       batched_mm) → its grouped spelling: before the norms and the
                       routed experts, which then see Hugging Face's grouped experts
    fp8_mlp            only with options.fp8: RMSNorm → gated MLP → down projection as
                       two e4m3 GEMMs, before the bf16 families that would otherwise
                       take the norm's consumers and the gated pair
    fp8_linear         only with options.fp8: the other linears of an RMSNorm's output
                       (q/k/v, the LM head) as one e4m3 GEMM, after the FP8 MLP took its
                       norms' gated pairs
    fp8_rowwise        only with options.fp8: every other linear, row-wise dynamic
                       scales (torchao's recipe) in an e4m3 GEMM's epilogue; before the
                       bf16 families, which would take the GEMMs it runs
    residual_rmsnorm   GEMM → residual → RMSNorm → GEMM(s): the row-scale deferral
    gated_mlp          after the norms: a gate/up pair that became two rowscale consumers
                       of a rewritten norm merges into one GEMM that applies the deferred
                       rstd before the activation
    routed_experts     a mixture-of-experts layer's grouped expert GEMMs: the gather as
                       the GEMM's row read, act(gate)·up and the combine weight in their
                       epilogues
    scatter_back       the experts' rows back in token order as gathers added per token,
                       differentiated as a gather: after routed_experts, whatever
                       produced the rows
    rope               after the norms too (q/k/v as rowscale consumers merge into one
                       rotating GEMM)
    cross_entropy      the logits GEMM may be the final norm's rowscale consumer
    layernorm          last: a LayerNorm deferred into the plain GEMMs that read it, where
                       every reader is one (the families before it pay more, and a GEMM
                       they fused is no longer one it can take)

A family is a module implementing patterns/family.Family; adding one is its modules
(patterns/<family>.py, algebra/<family>.py) and a line here.
"""

from __future__ import annotations

from . import (attention, batched_experts, cross_entropy, dense_experts, explicit_attention,
               fp8_linear, fp8_mlp, fp8_rowwise, gated_mlp, layernorm, residual_rmsnorm,
               rope, routed_experts, scatter_back)

FAMILIES = (explicit_attention, attention, dense_experts, batched_experts, fp8_mlp,
            fp8_linear, fp8_rowwise, residual_rmsnorm, gated_mlp, routed_experts,
            scatter_back, rope, cross_entropy, layernorm)
