"""The report: what was matched, what was rewritten, why, and what the graph became.

explain() returns it, the backend collects it, and ``dump_dir=`` / ``CODA_DUMP_DIR``
writes it to disk, one folder per captured graph:

    graph_000/report.txt      matches, decisions, programs, runtime counters
    graph_000/canonical.txt   the captured graph in the canonical vocabulary
    graph_000/rewritten.py    the rewritten graph as Python
    graph_000/programs.txt    every epilogue program as math, and its JSON text
    graph_000/kernels.txt     each program's generated QuACK source and layout contract

(under torch.distributed each rank writes its own: graph_000_rank1/...)
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

from .algebra.decision import Decision, RejectionKind
from .codegen.program import EpilogueProgram
from .kernels.ops import runtime_summary
from .kernels.quack_path import row_class_lines
from .size_policy import threshold_lines

REWRITTEN, REJECTED, NOT_MATCHED = "rewritten", "rejected", "not matched"


@dataclasses.dataclass
class MatchRecord:
    pattern: str
    path: str
    status: str
    reason: str = ""                     # one line: why rejected / not matched
    decision: Decision | None = None
    producer: str = ""                   # the producing GEMM, or why there is none
    consumers: list[str] = dataclasses.field(default_factory=list)
    # (consumer, its decision, whether it reads the norm through ops in between)
    consumer_decisions: list[tuple[str, Decision, bool]] = dataclasses.field(
        default_factory=list)
    materialised: list[str] = dataclasses.field(default_factory=list)
    programs: list[EpilogueProgram] = dataclasses.field(default_factory=list)
    program_checks: list[Decision] = dataclasses.field(default_factory=list)
    notes: list[tuple[str, Decision]] = dataclasses.field(default_factory=list)
    weights: str = ""                    # how the fused GEMM's weights are re-laid out
    biases: str = ""                     # where the fused GEMM adds a bias it reads
    backward: str = ""                   # where the match's backward runs, if fused
    routing: str = ""                    # routed experts: how the routing's values are
                                         # trusted (proved in bounds, or checked per launch)
    kind: RejectionKind | None = None    # why it was left as is, as a type (None: rewritten
                                         # or not matched)
    code: str = ""                       # the failed condition's stable code (algebra/
                                         # decision.Why), for rejected and not matched

    def reject(self, kind: RejectionKind, reason: str, code: str = "") -> None:
        self.status, self.kind, self.reason = REJECTED, kind, reason
        self.code = code or getattr(reason, "code", "")

    def render(self, i: int) -> str:
        head = f"[{i}] {self.pattern} at {self.path or '<top level>'}: {self.status.upper()}"
        lines = [head]
        if self.reason:
            lines.append(f"    why: {self.reason}")
        if self.producer:
            lines.append(f"    producer: {self.producer}")
        if self.consumers:
            lines.append("    consumers: " + ", ".join(self.consumers))
        for name, d, through_ops in self.consumer_decisions:
            if not d.accepted:
                lines.append(f"    consumer {name} left as is:")
                lines.append(d.render("      "))
            elif through_ops:  # reads the norm through ops: say which, and their steps
                lines.append(f"    consumer {name}: {d.assumptions[0]}")
                lines += [f"      step {s}" for s in d.steps]
        if self.weights:
            lines.append(f"    weights: {self.weights}")
        if self.biases:
            lines.append(f"    biases: {self.biases}")
        if self.backward:
            lines.append(f"    backward: {self.backward}")
        if self.routing:
            lines.append(f"    routing: {self.routing}")
        if self.materialised:
            lines.append("    materialised (still read outside the rewrite): "
                         + ", ".join(self.materialised))
        if self.decision is not None:
            lines.append(self.decision.render("    "))
        for label, d in self.notes:
            lines.append(f"    {label}:")
            lines.append(d.render("      "))
        if self.programs:
            lines.append("    programs: " + ", ".join(p.key for p in self.programs))
        for check in self.program_checks:
            lines.append(check.render("    "))
        return "\n".join(lines)


@dataclasses.dataclass
class GraphReport:
    index: int
    records: list[MatchRecord]
    canonical: str
    rewritten_code: str
    seconds: float
    # under torch.distributed, the process that captured the graph: each rank rewrites
    # its own graphs (their shapes and placements may differ), and reports them
    rank: int | None = None
    world_size: int | None = None
    # options.min_fused_rows as this graph was rewritten with (None: each family's own)
    min_fused_rows: int | None = None
    # what the pass did to the graph that is not a rewrite (a guard against a PyTorch
    # bug: attention_grad_layout.py), one line each
    guards: list[str] = dataclasses.field(default_factory=list)
    # what the pass did for host time alone (row_chains.py, deferred_rstd.py), one line each
    host_path: list[str] = dataclasses.field(default_factory=list)
    # programs the graph runs that no rewrite's record holds: the host steps' rewrites of
    # them (deferred_rstd.py), shown and dumped with the rest
    host_programs: list[EpilogueProgram] = dataclasses.field(default_factory=list)

    @property
    def where(self) -> str:
        return "" if self.rank is None else f" (rank {self.rank} of {self.world_size})"

    @property
    def rewritten(self) -> list[MatchRecord]:
        return [r for r in self.records if r.status == REWRITTEN]

    @property
    def programs(self) -> dict[str, EpilogueProgram]:
        return {p.key: p for p in [pr for r in self.records for pr in r.programs] +
                self.host_programs}

    def summary(self) -> str:
        by_pattern: dict[str, list[int]] = {}
        for r in self.records:
            c = by_pattern.setdefault(r.pattern, [0, 0])
            c[0] += r.status == REWRITTEN
            c[1] += 1
        parts = ", ".join(f"{p} {done}/{n} rewritten" for p, (done, n) in by_pattern.items())
        return (f"graph {self.index}{self.where}: {parts or 'no candidates'} "
                f"({self.seconds * 1e3:.0f} ms)")

    def render(self, with_code: bool = True) -> str:
        out = [self.summary()]
        if not any(r.pattern in ("residual_rmsnorm_gemm", "layernorm_gemm", "graph")
                   for r in self.records):
            out.append("    nothing matched: no RMSNorm (mean of squares over the last dim, "
                       "rsqrt, scale) or LayerNorm with a GEMM reading its output was found "
                       "in this graph")
        out += [r.render(i) for i, r in enumerate(self.records)]
        out += [f"guard: {line}" for line in self.guards]
        out += [f"host path: {line}" for line in self.host_path]
        if self.programs:
            out.append("\nepilogue programs:")
            out += [p.pretty() for p in self.programs.values()]
            out.append("\nlayout contracts (generated kernel sources: the dump's kernels.txt):")
            out += [kernel_text(p).split("\n\n")[0] for p in self.programs.values()]
            if any(p.gemm for p in self.programs.values()):
                out.append("\nfused GEMMs by problem size (size_policy.py: fewer static rows "
                           "stay unfused, on CUDA):")
                out += ["  " + line for line in threshold_lines(self.min_fused_rows)]
                out.append("GEMM tile configs by problem size (kernels/quack_path.py):")
                out += ["  " + line for line in row_class_lines()]
        if with_code:
            out.append("\nrewritten graph:")
            out.append(readable_code(self.rewritten_code, self.programs.values()))
        return "\n".join(out)

    def dump(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "report.txt").write_text(self.render(with_code=False) + "\n\nruntime:\n"
                                           + "\n".join(runtime_summary()) + "\n")
        (folder / "canonical.txt").write_text(self.canonical)
        (folder / "rewritten.py").write_text(
            readable_code(self.rewritten_code, self.programs.values()))
        (folder / "programs.txt").write_text("\n\n".join(
            f"{p.pretty()}\n{p.to_text()}" for p in self.programs.values()))
        (folder / "kernels.txt").write_text("\n\n".join(
            kernel_text(p) for p in self.programs.values()))


def kernel_text(program: EpilogueProgram) -> str:
    """The generated QuACK source and layout contract of a program, or why there is none."""
    from .codegen.quack_source import Unlowerable, generate
    try:
        ks = generate(program)
    except Unlowerable as e:
        return f"# {program.key}: no kernel ({e}); runs on the reference path"
    stage = ", ".join(f"{i.out} = {i.op}(...)" for i in ks.row_stage) or "none"
    if ks.norm_stage is not None:
        stage += " (one kernel: QuACK's rms_final_reduce over the per-tile partials)"
    return (f"# {program.key} -> module {ks.module_name}\n{ks.contract.render()}\n"
            f"  row stage (after the kernel, on the GPU): {stage}\n\n{ks.source}")


def readable_code(code: str, programs) -> str:
    """Replace the JSON program texts in graph code by their short keys."""
    for p in programs:
        code = code.replace(repr(p.to_text()), f"P['{p.key}']")
    return re.sub(r"\n\s*\n", "\n", code).strip() + "\n"


class Report:
    """All graphs one optimize()/explain()/backend captured."""

    def __init__(self):
        self.graphs: list[GraphReport] = []
        self.uncaptured_calls = 0  # optimize() calls that ran no rewritten graph (warned)
        self.graph_breaks: list[str] = []  # dynamo's reasons, where optimize() saw a break
        # what optimize()/explain() saw in the module tree itself, before any graph (a
        # module whose selected implementation no family rewrites), each with its code
        self.notes: list[str] = []

    def add(self, g: GraphReport, dump_dir: str | None) -> None:
        self.graphs.append(g)
        if dump_dir:
            rank = "" if g.rank is None else f"_rank{g.rank}"  # ranks may share a folder
            g.dump(Path(dump_dir) / f"graph_{g.index:03d}{rank}")

    @property
    def records(self) -> list[MatchRecord]:
        return [r for g in self.graphs for r in g.records]

    def count(self, status: str = REWRITTEN, pattern: str | None = "residual_rmsnorm_gemm"
              ) -> int:
        """Records with this status (default: norms rewritten); pattern=None: all."""
        return sum(1 for r in self.records
                   if r.status == status and (pattern is None or r.pattern == pattern))

    def __str__(self) -> str:
        uncaptured = (f"\n{self.uncaptured_calls} call(s) ran without any rewritten graph "
                      "(dynamo did not compile them: the model ran as eager)"
                      if self.uncaptured_calls else "")
        uncaptured += "".join(f"\ngraph break (the code around it runs as eager): {b}"
                              for b in self.graph_breaks)
        uncaptured += "".join(f"\nnote: {n}" for n in self.notes)
        if not self.graphs:
            return "coda_rewrite: no graph was captured" + uncaptured
        done = self.count(pattern=None)
        head = (f"coda_rewrite report: {len(self.graphs)} graph(s), "
                f"{done} rewrite(s) applied, "
                f"{len(self.records) - done} candidate(s) left as is") + uncaptured
        body = "\n\n".join(g.render() for g in self.graphs)
        runtime = runtime_summary()
        tail = ("\nruntime (coda::gemm_epilogue calls so far):\n  " + "\n  ".join(runtime)
                if runtime else "")
        return f"{head}\n\n{body}{tail}"

    __repr__ = __str__


def dump_dir_from_env(explicit: str | None) -> str | None:
    return explicit or os.environ.get("CODA_DUMP_DIR") or None
