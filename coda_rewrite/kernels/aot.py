"""Compile generated kernels ahead of time, without a GPU.

CuTeDSL compiles for sm_90a on a machine with no GPU when told the arch
(``CUTE_DSL_ARCH=sm_90a``, ``QUACK_ARCH=90``, ``CUDA_VISIBLE_DEVICES=``, set before
cutlass is imported) and when QuACK's one driver query, the number of co-resident
clusters for its persistent scheduler, gets a stand-in. ``plan()`` then traces,
compiles and caches the kernel without launching it. CI uses this to compile every
kernel the test models produce and to check the PTX for Hopper's wgmma and TMA;
on a GPU machine it warms the disk cache before a run.

    python -m coda_rewrite.kernels.aot PROGRAMS.json [--keep-ptx DIR]

PROGRAMS.json is a list of program texts (and ``{"dgated": op}`` entries: the gated
backward's dgrad kernels, kernels/dgated.py; ``{"grouped": text}``: a routed experts'
grouped GEMM, kernels/grouped.py, with ``"interleaved"`` and ``"n_major"`` for gpt-oss's
layout; ``{"grouped_dgated": op, "params": [...]}``: the routed experts' backward dgrad
kernel, kernels/grouped_dgated.py). Prints one JSON line per kernel, with the tile
configs it was compiled for (one per row class of the size policy that differs).
"""

from __future__ import annotations

import json
import os
import sys
import time

H100_SMS = 132  # the stand-in for the driver's co-resident cluster count


def _prepare_env(keep_ptx: str | None) -> None:
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    os.environ.setdefault("QUACK_ARCH", "90")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if keep_ptx:
        os.makedirs(keep_ptx, exist_ok=True)  # CuTeDSL does not create it
        os.environ["CUTE_DSL_KEEP"] = "ptx"
        os.environ["CUTE_DSL_DUMP_DIR"] = keep_ptx


def _install_driver_stand_in() -> None:
    """QuACK asks the driver once (co-resident clusters) and checks that a scalar
    operand's pointer is a CUDA tensor; neither can be answered without a GPU, and
    neither changes the generated code."""
    import quack.gemm_runtime.host as host
    from quack.epilogue.ops import Scalar

    host.get_max_active_clusters = lambda cluster_size: H100_SMS // cluster_size
    Scalar._validate_pointer_value = lambda self, value: None


def compile_program(text: str, m: int = 256, k: int = 256, n: int = 256,
                    dtype: str = "bfloat16") -> dict:
    """Trace and compile one program's kernel for the configured arch (no launch)."""
    import torch

    from ..codegen.program import Kind, parse
    from .quack_path import FP8_FAMILY, Planned, configs_of, load
    from ..codegen.reference import dtype_from_name

    ks, module = load(text)
    prog = parse(text)
    dt = dtype_from_name(dtype)
    # the FP8 MLP's GEMMs take e4m3 operands (codegen/fp8.py), the rest the model's dtype
    gemm_dt = torch.float8_e4m3fn if prog.family == FP8_FAMILY else dt
    a = torch.randn(m, k).to(gemm_dt)
    b = torch.randn(n, k).to(gemm_dt)
    by_name = {}
    for spec in prog.operands:
        shape = {Kind.TILE: (m, n), Kind.PER_ROW: (m,), Kind.PER_FEATURE: (n,),
                 Kind.SCALAR: (), Kind.COS_SIN: (m, 128),  # head_dim 128
                 Kind.ROW_PARTIALS: (m, 3)}[spec.kind]
        by_name[spec.name] = torch.randn(shape, dtype=torch.float32 if spec.kind in (
            Kind.PER_ROW, Kind.SCALAR, Kind.ROW_PARTIALS) or
            spec.name in prog.rotation_operands else dt)
        if spec.kind == Kind.SCALAR:  # passed by pointer, as the runtime does
            by_name[spec.name] = by_name[spec.name].reshape(1)
        if spec.name in prog.index_operands:
            by_name[spec.name] = torch.randint(0, n, (m,), dtype=torch.int64)
    c, kwargs = None, {}
    params = module.epilogue.fn.__code__.co_varnames
    for bnd in ks.contract.operands:
        if bnd.param == "c":
            c = by_name[bnd.name]
        elif bnd.param in params or bnd.name in prog.index_operands:
            kwargs[bnd.param] = by_name[bnd.name]
    kwargs.update(ks.constants)
    out_dtype = {o.value: dtype_from_name(o.dtype) for o in prog.outputs}
    width = {o.value: n // 2 if o.kind == Kind.PAIR else n for o in prog.outputs}
    out = {name: torch.empty(m, width[value], dtype=out_dtype[value])
           for value, name in ks.contract.tile_outputs}
    t0 = time.perf_counter()
    # every tile config the size policy can give this program (a config is a kernel; the
    # problem size is not: the small tensors above plan each of them)
    configs = configs_of(prog)
    for cfg in configs:
        Planned(module.epilogue, a, b.t(), c, out, kwargs, cfg)
    return {"program": prog.key, "module": ks.module_name,
            "configs": [_config_row(c) for c in configs],
            "seconds": round(time.perf_counter() - t0, 2)}


def compile_dgated(op: str, m: int = 256, hidden: int = 256, inter: int = 256) -> dict:
    """Trace and compile the gated backward's dgrad kernel (kernels/dgated.py) for every
    tile config the size policy can give it."""
    import torch

    from .dgated import LARGE_M_TILES, load
    from .quack_path import ROW_CLASSES, Planned, tile_config

    module = load(op)
    dout = torch.randn(m, hidden, dtype=torch.bfloat16)
    w = torch.randn(hidden, inter, dtype=torch.bfloat16)
    p = torch.randn(m, 2 * inter, dtype=torch.bfloat16)
    out = {"D": torch.empty(m, 2 * inter, dtype=torch.bfloat16),
           "postact": torch.empty(m, inter, dtype=torch.bfloat16)}
    configs = list(dict.fromkeys(tile_config(*t) for t in
                                 [t for _, _, t in ROW_CLASSES] + [LARGE_M_TILES]))
    t0 = time.perf_counter()
    for cfg in configs:
        Planned(module.epilogue, dout, w, p, out, {}, cfg)
    return {"program": f"dgated_{op}", "module": module.__name__,
            "configs": [_config_row(c) for c in configs],
            "seconds": round(time.perf_counter() - t0, 2)}


def compile_grouped_dgated(op: str, params=(), routed: bool = True, rows: int = 128,
                           hidden: int = 256, inter: int = 256, experts: int = 4) -> dict:
    """Trace and compile the routed experts' backward dgrad kernel (kernels/
    grouped_dgated.py: variable-length groups, the combine weight per row, its gradient
    as a per-row reduction) at the config it launches with, w_down I-contiguous."""
    import torch

    from .grouped_dgated import Launch, load

    module = load(op, tuple(params), routed)
    dout = torch.randn(rows, hidden, dtype=torch.bfloat16)
    w = torch.randn(experts, hidden, inter, dtype=torch.bfloat16)
    p = torch.randn(rows, 2 * inter, dtype=torch.bfloat16)
    offsets = torch.tensor([rows // 4, rows // 4, rows // 2, rows - 3], dtype=torch.int32)
    score = torch.rand(rows) if routed else None
    t0 = time.perf_counter()
    c = Launch(module, dout, w, offsets, p, score).config
    return {"program": f"dgated_routed_{op}" if routed else f"dgated_{op}_grouped",
            "module": module.__name__, "configs": [[c.tile_m, c.tile_n, c.cluster_m]],
            "seconds": round(time.perf_counter() - t0, 2)}


def compile_grouped(text: str, tokens: int = 64, k: int = 256, n: int = 256,
                    experts: int = 4, interleaved: bool = False, n_major: bool = False
                    ) -> dict:
    """Trace and compile a grouped program (kernels/grouped.py: QuACK's variable-length
    GEMM; a gather of the rows for the gated program, the [gate; up] halves read
    interleaved, or pairs stored interleaved; weights K- or N-contiguous) at the config
    it launches with."""
    import torch

    from ..codegen.program import Kind, parse
    from .grouped import GroupedLaunch
    from .quack_path import load

    ks, module = load(text)
    prog = parse(text)
    pair = any(o.kind == Kind.PAIR for o in prog.outputs)
    rows = 2 * tokens
    a = torch.randn(tokens if pair else rows, k, dtype=torch.bfloat16)
    b = torch.randn(experts, n, k, dtype=torch.bfloat16)
    if n_major:  # [E, K, N] storage read through its transpose
        b = torch.randn(experts, k, n, dtype=torch.bfloat16).transpose(1, 2)
    offsets = torch.tensor([rows // 4, rows // 4, rows // 2, rows - 3], dtype=torch.int32)
    index = torch.randint(0, tokens, (rows,), dtype=torch.int32) if pair else None
    operands = [torch.rand(experts, n, dtype=torch.bfloat16) if o.kind == Kind.PER_FEATURE
                else torch.rand(rows) for o in prog.operands]
    t0 = time.perf_counter()
    launch = GroupedLaunch(ks, module, a, b, offsets, index, operands, interleaved)
    c = launch.config
    return {"program": prog.key, "module": ks.module_name,
            "configs": [[c.tile_m, c.tile_n, c.cluster_m]],
            "seconds": round(time.perf_counter() - t0, 2)}


def _config_row(cfg) -> list[int] | None:
    """A config as the AOT report lists it: [tile_m, tile_n, cluster_m(, split_k)]."""
    if cfg is None:
        return None
    return [cfg.tile_m, cfg.tile_n, cfg.cluster_m] + ([cfg.split_k] if cfg.split_k > 1
                                                      else [])


def main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m coda_rewrite.kernels.aot")
    p.add_argument("programs")
    p.add_argument("--keep-ptx", default=None)
    a = p.parse_args(argv)
    _prepare_env(a.keep_ptx)
    _install_driver_stand_in()
    with open(a.programs) as f:
        texts = json.load(f)
    for text in texts:  # a program text, {"dgated": op} (a gated backward kernel),
        #                  {"grouped": text} (a routed experts' grouped GEMM) or
        #                  {"grouped_dgated": op} (the routed experts' backward kernel)
        if isinstance(text, dict) and "grouped" in text:
            got = compile_grouped(text["grouped"], interleaved=text.get("interleaved", False),
                                  n_major=text.get("n_major", False))
        elif isinstance(text, dict) and "grouped_dgated" in text:
            got = compile_grouped_dgated(text["grouped_dgated"], text.get("params", ()),
                                         text.get("routed", True))
        elif isinstance(text, dict):
            got = compile_dgated(text["dgated"])
        else:
            got = compile_program(text)
        print(json.dumps(got), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
