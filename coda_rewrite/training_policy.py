"""Which fusions run in a training graph: a speed decision, not a legality one.

A fused GEMM pays in training only if its backward does too: the forward saves a read and
a write of an activation, and the backward must not give it back (re-layouts made again,
row statistics recomputed, gradient scatters). Measured on the H200 (Llama-3.2-1B shape,
2 × 4096 tokens, forward + loss + backward; BENCHMARKS.md, issue #16's ablation and the
sixth, ninth and seventeenth sessions): against the attention-inputs rewrite alone
(124.8–127.9 ms/step) the residual + RMSNorm producer adds 4.3 ms and 1.8 GiB (and on top
of the gated MLP's fused backward, the down projection left to it, 10.6 ms: twenty-second
session); RoPE 1.4 ms
and 0.7 GiB, and with its angles read from one table (seventeenth session) still 1.6 ms
of kernel time over the gated MLP's step (Inductor's unfused rotation rides on the q/k
copies attention needs anyway); the LM head + loss (logits written) 0.5 ms and 1.8 GiB,
and since its softmax gradient is one traced pass 2.3 ms less kernel time for the same
memory: left, for the memory (the bf16 logits kept), and 7 rounds paired (twenty-ninth
session) ran it at 1.000x the step without it, 0.961–1.057, the same kernel time; the
gated MLP with its backward in
the down projection's dgrad GEMM (kernels/gated_down.py) 1.2 ms (+0.9%, inside the
2.0–3.2% spread between rounds) and −2.0 GiB, against +2.8 ms and no memory saved with
its backward as graph ops. So the gated MLP is fused in training where its down
projection takes that backward (patterns/gated_mlp.decide refuses the match otherwise),
and the other families' backward rules, correct (tested against eager) but not fused the
CODA way (issue #16), leave them out. The routed experts' grouped GEMMs, with the down
projection's backward in its grouped dgrad epilogue, the routing's gradients as gathers
and no device-side check of the routing per launch, run a mixture-of-experts block's
forward + backward at 1.147x (Qwen3-30B-A3B shape), 1.099x (gpt-oss-20b) and 1.035x
(Mixtral-8x7B) of torch.compile's (with their backward as rules: 0.89x and 0.96x): they
are fused, from their own training threshold of routed rows (patterns/routed_experts).

So each GEMM-fusing family says whether it pays in a training step (``PAYS_IN_TRAINING``
in its pattern module); a match whose GEMMs compute a gradient is left to eager's ops
under Inductor when its family does not, with the reason (code ``training.does_not_pay``).
``options.fuse_in_training`` overrides (True: every family, each checked on the GPU in
training by ``tools/survey.py --gpu``; False: none). The cross-entropy rewrite with
``materialize_logits=False`` is the user's memory request (the logits never written): it
is kept whatever its family says. Graphs without
gradients (inference) and CPU graphs (the reference path: no speed to win or lose) are not
affected. A graph is told by whether its fused GEMMs' outputs require grad where dynamo
traced them, so a forward run with gradients enabled counts as training: inference belongs
under torch.no_grad() or torch.inference_mode() (generate() and serving stacks do so),
where every family fuses by size alone.
"""

from __future__ import annotations

from . import canonical
from .size_policy import gemms_of


def not_paying_in_training(family, match, options) -> str:
    """Why a GEMM-fusing match in a training graph is left unfused ("" where it is not)."""
    if not getattr(family, "FUSES_GEMMS", False):
        return ""
    if options.fuse_in_training is True:
        return ""
    asked = getattr(family, "asked_for_in_training", None)
    if options.fuse_in_training is None and (family.PAYS_IN_TRAINING or
                                             (asked is not None and asked(options))):
        return ""
    if not computes_gradients(match):
        return ""
    if options.fuse_in_training is False:
        return ("a training graph and options.fuse_in_training=False: left to eager's ops "
                "under Inductor")
    return (f"a training graph: the {family.NAME} fusion does not yet pay for itself in a "
            "training step (its backward is not fused; measured on the H200, "
            "training_policy.py): left to eager's ops under Inductor; "
            "options.fuse_in_training=True fuses it anyway")


def computes_gradients(match) -> bool:
    """Whether some GEMM of the match runs on CUDA and its output requires grad where
    dynamo traced it (a training graph; CPU graphs run the reference path and are left
    to the families' own choice)."""
    outs = [canonical.meta(n) for n in gemms_of(match)]
    return any(g is not None and g.device.type == "cuda" and g.requires_grad for g in outs)
