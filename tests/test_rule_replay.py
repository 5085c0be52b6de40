"""The gradient replay runs the backward training runs: each fused GEMM's family rule
(kernels/backward), on the match's own program, against autograd through eager's nodes
(algebra/witness.run_program). A rule that is off for one family is found by that
family's witness, wherever the rule's bug shows: the match is refused as the pass's own
bug (witness.gradients_disagree), no program of that family runs, and the training step
is eager's. Autograd through the reference alone, what the replay differentiated
before, checked the rewrite's math and could not see a rule's bug."""

from __future__ import annotations

import copy
import dataclasses

import pytest

import coda_rewrite
from coda_rewrite.kernels import backward
from coda_rewrite.numerics import rel_err

from conftest import hf_model, tokens


def weight_gradient_off(rule):
    """The rule with its weight gradient 1% off (the forward untouched)."""
    def vjp(prog, a, b, operands, outputs, grads):
        grad_a, grad_b, grad_ops = rule.vjp(prog, a, b, operands, outputs, grads)
        return grad_a, None if grad_b is None else grad_b * 1.01, grad_ops
    return dataclasses.replace(rule, vjp=vjp)


def bias_gradient_lost(rule):
    """The rule without its bias gradients: a per-feature operand's comes back None."""
    def vjp(prog, a, b, operands, outputs, grads):
        grad_a, grad_b, grad_ops = rule.vjp(prog, a, b, operands, outputs, grads)
        return grad_a, grad_b, [None if spec.name == "bias" else g
                                for spec, g in zip(prog.operands, grad_ops)]
    return dataclasses.replace(rule, vjp=vjp)


def off_in_one_arrangement(compiled: bool):
    """The rule's weight gradient 1% off only where it runs as a compiled backward
    arranges it (``compiled``; common.traced: fake tensors under AOTAutograd) or only
    where it runs as an eager one does (optimize()'s graphs): the witness replays both."""
    def bug(rule):
        def vjp(prog, a, b, operands, outputs, grads):
            grad_a, grad_b, grad_ops = rule.vjp(prog, a, b, operands, outputs, grads)
            if grad_b is not None and backward.common.traced([a]) == compiled:
                grad_b = grad_b * 1.01
            return grad_a, grad_b, grad_ops
        return dataclasses.replace(rule, vjp=vjp)
    bug.__name__ = "off_as_compiled" if compiled else "off_as_eager"
    return bug


off_as_compiled, off_as_eager = off_in_one_arrangement(True), off_in_one_arrangement(False)


def bug_shows(bug, prog) -> bool:
    """Whether ``bug`` changes ``prog``'s gradients: a program with a GEMM (the rule is
    the backward of the fused GEMM op; a row-wise program runs as graph ops), and for a
    lost bias, one that has a bias."""
    return prog.gemm and (bug is not bias_gradient_lost or
                          any(spec.name == "bias" for spec in prog.operands))


# (the rule's family tag, its bug, the model, the patterns on, the pattern that must
# refuse)
CASES = [
    ("rowscale", weight_gradient_off, "llama", ("residual_rmsnorm_gemm",),
     "residual_rmsnorm_gemm"),
    ("rowscale", bias_gradient_lost, "qwen2", ("residual_rmsnorm_gemm",),
     "residual_rmsnorm_gemm"),  # q/k/v's biases
    ("residual_rmsnorm", weight_gradient_off, "llama", ("residual_rmsnorm_gemm",),
     "residual_rmsnorm_gemm"),
    ("gated", weight_gradient_off, "llama", ("gated_mlp",), "gated_mlp"),
    ("rope", weight_gradient_off, "qwen2", ("rope",), "rope"),
    ("rope", bias_gradient_lost, "qwen2", ("rope",), "rope"),
    ("centred", weight_gradient_off, "cohere", ("layernorm_gemm",), "layernorm_gemm"),
    ("cross_entropy", weight_gradient_off, "llama", ("lm_head_cross_entropy",),
     "lm_head_cross_entropy"),
    ("rowscale", off_as_compiled, "llama", ("residual_rmsnorm_gemm",),
     "residual_rmsnorm_gemm"),
    ("gated", off_as_compiled, "llama", ("gated_mlp",), "gated_mlp"),
    ("rope", off_as_compiled, "qwen2", ("rope",), "rope"),
    ("cross_entropy", off_as_compiled, "llama", ("lm_head_cross_entropy",),
     "lm_head_cross_entropy"),
    ("rowscale", off_as_eager, "llama", ("residual_rmsnorm_gemm",), "residual_rmsnorm_gemm"),
    ("cross_entropy", off_as_eager, "llama", ("lm_head_cross_entropy",),
     "lm_head_cross_entropy"),
]


@pytest.mark.provokes_pass_bug
@pytest.mark.parametrize("tag,bug,family,patterns,pattern", CASES,
                         ids=[f"{c[0]}-{c[1].__name__}" for c in CASES])
def test_a_rule_that_is_off_is_refused_by_the_witness(monkeypatch, tag, bug, family,
                                                       patterns, pattern):
    monkeypatch.setitem(backward.RULES, tag, bug(backward.RULES[tag]))
    backward._rule.cache_clear()  # the rule of each program is looked up once
    try:
        model = hf_model(family, layers=1).train()
        ref = copy.deepcopy(model)
        ids = tokens()
        fast = coda_rewrite.optimize(model, fuse_in_training=True, patterns=patterns)
        loss, want = fast(ids, labels=ids).loss, ref(ids, labels=ids).loss
        loss.backward()
        want.backward()
    finally:
        monkeypatch.undo()
        backward._rule.cache_clear()
    records = [r for r in fast.report.records if r.pattern == pattern]
    assert any(r.code == "witness.gradients_disagree" for r in records), str(fast.report)
    ran = [p.key for r in records if r.status == "rewritten" for p in r.programs
           if p.family == tag and bug_shows(bug, p)]
    assert not ran, ran  # no program whose rule is off was applied
    assert abs(loss.item() - want.item()) <= 1e-6 * abs(want.item())
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            assert rel_err(p.grad, q.grad) <= 1e-5, name


def test_the_rules_as_they_are_pass_the_replay():
    """The same models and patterns with the rules untouched: every match rewritten, and
    its record shows the gradient replay: run both ways where a rule on its path reads the
    arrangement (the row scale's through_scaled_acc, the cross-entropy gradient), once
    where none does (RoPE's and LayerNorm's rules take one path)."""
    both_ways = {"residual_rmsnorm_gemm", "gated_mlp", "lm_head_cross_entropy"}
    for family, patterns in [("llama", ("residual_rmsnorm_gemm", "gated_mlp",
                                        "lm_head_cross_entropy")),
                             ("qwen2", ("rope",)), ("cohere", ("layernorm_gemm",))]:
        model = hf_model(family, layers=1).train()
        ids = tokens()
        fast = coda_rewrite.optimize(model, fuse_in_training=True, patterns=patterns)
        fast(ids, labels=ids).loss.backward()
        done = [r for r in fast.report.records if r.status == "rewritten"]
        assert {r.pattern for r in done} == set(patterns), str(fast.report)
        for r in done:
            line = str(r.decision)
            assert "gradient replay" in line, line
            assert ("as a compiled backward arranges it" in line) == \
                (r.pattern in both_ways), line
            assert ("one replay" in line) == (r.pattern not in both_ways), line
