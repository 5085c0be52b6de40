"""Options of optimize(), explain() and the "coda" backend."""

from __future__ import annotations

import dataclasses
import os

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
    patterns: tuple[str, ...] = ("explicit_attention", "attention_inputs", "dense_experts",
                                 "batched_experts", "fp8_mlp", "fp8_linear", "fp8_rowwise",
                                 "residual_rmsnorm_gemm", "gated_mlp",
                                 "routed_experts", "scatter_back", "rope",
                                 "lm_head_cross_entropy", "layernorm_gemm")
    # Logits are written where something besides the loss reads them (a model output),
    # with eager's values, and in training for the backward (as eager keeps them): the
    # softmax gradient is then one pass over them. False: never written; readers get an
    # empty tensor and the backward recomputes them in a GEMM (saves tokens x vocab x 2
    # bytes, costs one GEMM of the LM head's size).
    materialize_logits: bool = True
    # Keep re-laid-out weights (interleaved gate/up, permuted q/k/v; a LayerNorm's folded
    # weights W∘γ, their row sums and β·Wᵀ + b) between calls, keyed
    # by the parameters' version counters, inside the GEMM op that reads them
    # (kernels/relayout.py), instead of recomputing them on every call. Inference graphs
    # only (a training graph's weights change every step). For serving: saves a read +
    # write of those weights per call, costs one more copy of them in memory; writes
    # through ``param.data`` go unseen.
    cache_relayouts: bool = False
    # Replay the rewritten graphs from CUDA graphs (Inductor's cudagraph trees: recorded
    # per input shape after a warm-up call, re-recorded for a new shape; inputs copied
    # into static buffers, outputs valid until the next replay of that graph). For
    # serving and decode, where the host launching ~20 kernels per layer is the
    # bottleneck. With inductor=False (optimize()'s default) the graph goes through
    # AOTAutograd without Inductor, then the same cudagraph trees. CPU tensors: no-op.
    cudagraphs: bool = False
    # torch.compile's mode, for Inductor ("reduce-overhead" = cudagraphs; "max-autotune",
    # "max-autotune-no-cudagraphs"): Inductor's own settings for that mode apply to the
    # rewritten graph. torch.compile(m, backend="coda", mode=...) sets it.
    mode: str | None = None
    # CUDA GEMMs with fewer rows (tokens) than this are left to cuBLAS, their epilogue as
    # graph ops (Inductor fuses them). None (the default): each family's measured
    # threshold (size_policy.py: at decode and short-prompt sizes a fused GEMM can lose to
    # cuBLAS + a fused elementwise kernel, at a size that depends on the family; measured
    # on the H200, BENCHMARKS.md "small M"); a number: that threshold for every family;
    # 0: always fuse. A dynamic row count is fused (its size is not known when the
    # rewrite is decided); on CPU (the reference path: no speed to win or lose) every size
    # is. Default: $CODA_MIN_FUSED_ROWS, else None.
    min_fused_rows: int | None = dataclasses.field(default_factory=lambda: _rows_from_env(
        os.environ.get("CODA_MIN_FUSED_ROWS")))

    # Fuse in training graphs (those whose fused GEMMs compute a gradient). None (the
    # default): each family where it pays for itself in a training step, measured on the
    # H200 (training_policy.py; the cross-entropy rewrite also when materialize_logits is
    # False); True: every family; False: none. Default: $CODA_FUSE_IN_TRAINING ("1" / "0"),
    # else None.
    fuse_in_training: bool | None = dataclasses.field(default_factory=lambda: _flag_from_env(
        os.environ.get("CODA_FUSE_IN_TRAINING")))
    # In a training graph, fuse a family's backward elementwise work into the epilogue of
    # a GEMM the backward computes anyway, where the family has one: a fused gated MLP's
    # dSwiGLU/dGeGLU in its down projection's dgrad GEMM (kernels/gated_down.py; h is then
    # recomputed there, not saved). False: that work runs as graph ops (Inductor fuses
    # them), as the plain backward rules do; for ablations. (The training policy fuses
    # the gated MLP only with its backward epilogue: with False it is left in training
    # graphs unless fuse_in_training=True.)
    backward_epilogues: bool = True
    # FP8 (e4m3) for the linears of inference graphs: the gated MLP after an RMSNorm and the
    # other linears that read an RMSNorm's output (q/k/v) scaled by the norm's bounds, every
    # other linear by row-wise dynamic scales (patterns/fp8_mlp.py, fp8_linear.py,
    # fp8_rowwise.py; codegen/fp8.py, kernels/fp8.py): weights e4m3 per output row
    # (kept between calls by their version counters: one more copy, half the bf16 size).
    # Numerics: README, "FP8". Training graphs and linears whose widths an e4m3 GEMM does
    # not take run the bf16 rewrites; the report says why.
    fp8: bool = False

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
        if opts.mode not in _MODES:
            raise ValueError(f"unknown torch.compile mode {opts.mode!r} for the coda "
                             f"backend; known: {sorted(m for m in _MODES if m)}")
        if opts.mode in _GRAPHED_MODES:  # Inductor's own meaning
            opts = dataclasses.replace(opts, cudagraphs=True)
        return dataclasses.replace(opts, dump_dir=dump_dir_from_env(opts.dump_dir))

    @property
    def graphed(self) -> bool:
        """Whether the compiled graphs replay from CUDA graphs (the host time of a call
        is not paid per step: the size policy weighs kernel time alone there)."""
        return self.cudagraphs or self.mode in _GRAPHED_MODES

    def inductor_config(self) -> dict:
        """Inductor settings for this compile: the mode's, and cudagraphs if asked."""
        import torch._inductor
        config = dict(torch._inductor.list_mode_options(self.mode)) if self.mode else {}
        if self.cudagraphs:
            config["triton.cudagraphs"] = True
        return config


_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
_GRAPHED_MODES = ("reduce-overhead", "max-autotune")  # the modes that record CUDA graphs


def _rows_from_env(value: str | None) -> int | None:
    """$CODA_MIN_FUSED_ROWS: unset or empty for each family's threshold, else a count."""
    if value is None or not value.strip():
        return None
    return int(value)


def _flag_from_env(value: str | None) -> bool | None:
    """$CODA_FUSE_IN_TRAINING: unset or empty for the measured policy, "1" or "0"."""
    if value is None or not value.strip():
        return None
    if value.strip() not in ("0", "1"):
        raise ValueError(f"CODA_FUSE_IN_TRAINING={value!r}: expected 1, 0 or unset")
    return value.strip() == "1"
