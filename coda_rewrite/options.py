"""Options of optimize(), explain() and the "coda" backend."""

from __future__ import annotations

import dataclasses

from .report import dump_dir_from_env


@dataclasses.dataclass(frozen=True)
class Options:
    # Hand the rewritten graph to Inductor (the backend's default). optimize() runs the
    # rewritten graph as is unless asked.
    inductor: bool = True
    # Write the report, canonical graph, rewritten graph and programs here
    # (default: $CODA_DUMP_DIR, else nowhere).
    dump_dir: str | None = None
    # Patterns to apply; the others are still matched and reported as disabled.
    patterns: tuple[str, ...] = ("explicit_attention", "attention_inputs",
                                 "residual_rmsnorm_gemm", "gated_mlp", "rope",
                                 "lm_head_cross_entropy")
    # Logits that something besides the loss reads (a model output) are still written,
    # with eager's values; False: never written, and those readers get an empty tensor
    # (training loops that read only the loss save tokens x vocab x 2 bytes).
    materialize_logits: bool = True
    # Keep re-laid-out weights (interleaved gate/up, permuted q/k/v) between calls, keyed
    # by the parameters' version counters, inside the GEMM op that reads them
    # (kernels/relayout.py), instead of recomputing them on every call. Inference graphs
    # only (a training graph's weights change every step). For serving: saves a read +
    # write of those weights per call, costs one more copy of them in memory; writes
    # through ``param.data`` go unseen.
    cache_relayouts: bool = False

    @classmethod
    def make(cls, options: dict | None = None, **kw) -> "Options":
        merged = {**(options or {}), **kw}
        unknown = set(merged) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise TypeError(f"unknown coda_rewrite option(s): {sorted(unknown)}; "
                            f"known: {[f.name for f in dataclasses.fields(cls)]}")
        if "patterns" in merged:
            merged["patterns"] = tuple(merged["patterns"])
        opts = cls(**merged)
        return dataclasses.replace(opts, dump_dir=dump_dir_from_env(opts.dump_dir))
