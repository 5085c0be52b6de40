"""Does every causal LM compute what eager computes through optimize()? The adversarial
check behind the coverage table: the same tiny configs (tools/coverage.py), a training
forward + backward and an eval forward, each against eager.

    python tools/survey.py [model_type ...]
    python tools/survey.py --bf16 [model_type ...]

One line per architecture:

    train   loss relative to eager's; the largest gradient difference, relative to the
            model's largest gradient norm (a gradient that is zero in exact arithmetic,
            a key bias under softmax attention, say, is noise either way)
    eval    logits relative to eager's, and dynamo's own capture
            (torch.compile(backend="eager")) beside it: where both differ from eager
            alike, the graph dynamo captured computes something else, not the pass

Dropout is drawn alike (the same seed before each forward). A line is flagged DIFFERS
where training is off by more than 1e-5 (loss) / 1e-4 (gradients) or the eval logits by
more than 1e-5, and PASS-ONLY where dynamo's capture agrees with eager and the pass does
not: the one a bug report belongs to.

``--bf16``: the numerics policy instead — the eval logits in bf16 through optimize()
against float64, no worse than eager's bf16 logits (median over three seeds, within
numerics.BF16_RATIO_LIMIT); flagged WORSE THAN EAGER where not.
"""

from __future__ import annotations

import copy
import os
import sys

import torch


def _coverage_tool():
    """This folder's coverage.py (the tiny configs), by path: the name is also a PyPI
    package's."""
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "coverage.py")
    spec = importlib.util.spec_from_file_location("coda_coverage_tool", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


coverage = _coverage_tool()


def check(model_type: str) -> str:
    import coda_rewrite
    from coda_rewrite.numerics import rel_err

    torch._dynamo.reset()
    try:
        model = coverage.build(model_type)
        ids = torch.randint(3, 256, (2, 16), generator=torch.Generator().manual_seed(0))
        ref = copy.deepcopy(model)
        torch.manual_seed(1)
        want = ref(ids, labels=ids, use_cache=False).loss
    except Exception as e:  # the tiny config itself does not run: not the pass's doing
        return f"{model_type}: skipped (eager: {type(e).__name__})"
    fast = coda_rewrite.optimize(model)
    torch.manual_seed(1)
    loss = fast(ids, labels=ids, use_cache=False).loss
    loss.backward()
    want.backward()
    pairs = [(n, p.grad, q.grad) for (n, p), q in zip(model.named_parameters(),
                                                     ref.parameters()) if q.grad is not None]
    scale = max(g.norm().item() for _, _, g in pairs)
    grad, where = max(((a - b).norm().item() / scale if a is not None else float("inf"), n)
                      for n, a, b in pairs)
    loss_err = abs(loss.item() - want.item()) / abs(want.item())
    rewrites = fast.report.count(pattern=None)

    plain = copy.deepcopy(ref).eval()
    torch._dynamo.reset()
    with torch.no_grad():
        logits = plain(ids, use_cache=False).logits
        ours = rel_err(coda_rewrite.optimize(copy.deepcopy(plain))(ids, use_cache=False)
                       .logits, logits)
        torch._dynamo.reset()
        dynamo = rel_err(torch.compile(copy.deepcopy(plain), backend="eager")(
            ids, use_cache=False).logits, logits)
    bad = loss_err > 1e-5 or grad > 1e-4 or ours > 1e-5
    flag = ("PASS-ONLY" if dynamo <= 1e-5 else "DIFFERS") if bad else "ok"
    return (f"{model_type}: {flag} | {rewrites} rewrites | train: loss {loss_err:.1e}, "
            f"gradients {grad:.1e} ({where}) | eval logits {ours:.1e}, dynamo's capture "
            f"{dynamo:.1e}")


def check_bf16(model_type: str) -> str:
    """The numerics policy: bf16 logits through optimize() against float64, no worse than
    eager's (median over three seeds, numerics.BF16_RATIO_LIMIT)."""
    import coda_rewrite
    from coda_rewrite import numerics

    try:
        coverage.build(model_type)
    except Exception as e:
        return f"{model_type}: skipped ({type(e).__name__})"
    ids = torch.randint(3, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    counts = []

    def rewrite(model):
        torch._dynamo.reset()
        fast = coda_rewrite.optimize(model)
        counts.append(fast)
        return fast

    def build(seed):
        torch.manual_seed(seed)
        return coverage.build(model_type)
    try:
        res = numerics.low_precision_errors(build, {"input_ids": ids, "use_cache": False},
                                            rewrite, seeds=(0, 1, 2))
    except Exception as e:  # eager itself fails in bf16 or float64 on the CPU
        return f"{model_type}: skipped in bf16 ({type(e).__name__})"
    rewrites = counts[-1].report.count(pattern=None) if counts else 0
    flag = "ok" if res["ok"] else "WORSE THAN EAGER"
    return (f"{model_type}: bf16 {flag} | {rewrites} rewrites | rewritten / eager error "
            f"against float64: {res['ratio']:.2f} (eager {res['eager'][0]:.1e})")


def main(argv: list[str]) -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    run = check_bf16 if argv[:1] == ["--bf16"] else check
    argv = argv[1:] if run is check_bf16 else argv
    types = argv or sorted(t for t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
                           if t not in coverage.SKIP)
    for t in types:
        try:
            print(run(t), flush=True)
        except Exception as e:  # the pass raised: the worst outcome, say it loudly
            print(f"{t}: PASS RAISED {type(e).__name__}: {str(e).splitlines()[0][:120]}",
                  flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
