"""Lower the gated MLP's backward epilogue to the source of a QuACK ``gemm_epilogue``
module: the CODA recipe's dSwiGLU / dGeGLU in the down projection's dgrad GEMM.

The backward of ``out = (act(g) ⊙ u)·W_dᵀ`` starts with the dgrad GEMM
dh = dout·W_d ([M, I], acc[i, j]); eager writes dh, reads it back beside g and u in an
elementwise pass that writes dg and du, and keeps h = act(g) ⊙ u from the forward for
W_d's gradient. Here the GEMM's epilogue reads the gated forward's stored pre-activation
p = [g0, u0, g1, u1, ...] as its C operand (twice GEMM-N wide, two 16-bit lanes per
32-bit element: QuACK's mode="packed_cd_b16x2") and writes

    D        = pack(dh·u·act'(g), dh·act(g))    dp, interleaved like p: the gate/up
                                                GEMM's backward reads it as it is
    postact  = act(g)·u                          h, recomputed: W_d's gradient operand

so dh is never written and h is never saved (codegen/reference.dgated is the same math
in torch). The lane math is QuACK's (quack.activation: dswiglu and dgeglu; the exact
GELU's from dgelu_erf), in float32 from the 16-bit p and the float32 accumulator, each
output rounded once when stored.
"""

from __future__ import annotations

import dataclasses
import hashlib

from .op_table import OPS, PAIRWISE_CLASS

GENERATOR_VERSION = "2"

# pairwise op -> (the QuACK function, the epilogue body): dh is the activation's output
# gradient (acc, or acc·score for routed experts); g, u the pair's lanes of C; the body
# binds dg, du and h = pair(g, u). ``{params}``: the op's literal parameters.
_BODIES = {
    "swiglu": ("dswiglu", ["dg, du, h = dswiglu(g, u, dh)"]),
    "geglu": ("dgeglu", ["dg, du, h = dgeglu(g, u, dh)"]),
    # dgelu_erf(x, d) = (d·gelu'(x), gelu(x)): with d = dh·u it is dg
    "geglu_erf": ("dgelu_erf", ["dg, act_g = dgelu_erf(g, dh * u)",
                                "du = dh * act_g",
                                "h = act_g * u"]),
    # gpt-oss's clamped SwiGLU: QuACK's derivative clamps like the forward (min(g, l),
    # clamp(u, -l, l)) and zeroes each lane's gradient where its clamp saturates, boundary
    # included, as torch.clamp's backward does
    "swiglu_oai": ("dswiglu_oai", ["dg, du, h = dswiglu_oai(g, u, dh, alpha={0!r}, "
                                   "limit={1!r})"]),
}


@dataclasses.dataclass(frozen=True)
class DgatedSource:
    op: str
    module_name: str
    source: str


def supported(op: str) -> bool:
    return op in _BODIES


def generate(op: str, params: tuple[float, ...] = (), routed: bool = False) -> DgatedSource:
    """The backward epilogue of ``op`` (``params``: its literal parameters). ``routed``:
    the routed experts' down projection, whose forward scaled each routed row s by the
    router's combine weight w[s] (kernels/grouped_dgated.py): the epilogue loads w as a
    per-row vector and writes

        D       = dp at dh = acc·w          (w folded: the gate/up GEMM's backward reads
                                             dp as it is)
        postact = h·w                       (the down weight's gradient is doutᵀ·(h·w))
        dscore  = Σ_j h[s, j]·acc[s, j]     (w's gradient, one float32 per routed row:
                                             QuACK's ColVecReduce, per-tile partials
                                             summed across N tiles)"""
    if OPS.get(op) is None or OPS[op].klass != PAIRWISE_CLASS or op not in _BODIES:
        raise ValueError(f"no backward epilogue for the pairwise op {op!r}")
    fn, body = _BODIES[op]
    body = [line.format(*params) for line in body]
    if routed:
        decorator = ['@gemm_epilogue(outputs=("postact",), ops={"score": ColVecLoad("score")},',
                     '               reduces={"dscore": ColVecReduce("dscore", scaled=True)},',
                     '               mode="packed_cd_b16x2")',
                     "def epilogue(acc, c, score):",
                     "    dh = acc * score"]
        ret = '    return {"D": pack(dg, du), "postact": h * score, "dscore": (h, acc)}'
        doc = ["acc[s, j] = sum_k dout[s, k] * w_down[e(s)][k, j]   (routed row s of expert "
               "e(s): variable-length groups)",
               "score: the combine weight w [S]; dh = acc * w",
               "c: the stored pre-activation p [S, 2I], gate/up interleaved (packed C)",
               "store D: dp [S, 2I] interleaved; postact: h * w [S, I]; "
               "dscore: sum_j h * acc [S]"]
        imports = ["from quack.epilogue.ops import ColVecLoad, ColVecReduce"]
    else:
        decorator = ['@gemm_epilogue(outputs=("postact",), mode="packed_cd_b16x2")',
                     "def epilogue(acc, c):",
                     "    dh = acc"]
        ret = '    return {"D": pack(dg, du), "postact": h}'
        doc = ["acc[i, j] = sum_k dout[i, k] * w_down[k, j]   (dh; dout [M, H], w_down [H, I])",
               "c: the stored pre-activation p [M, 2I], gate/up interleaved (packed C)",
               "store D: dp [M, 2I] interleaved; store postact: h = act(g) * u [M, I]"]
        imports = []
    what = "routed experts' " if routed else ""
    source = "\n".join([
        f'"""Generated by coda_rewrite (dgated generator v{GENERATOR_VERSION}): the {op} '
        "backward epilogue",
        f"of the {what}down projection's dgrad GEMM. Do not edit; coda_rewrite rewrites it.",
        "",
        *doc,
        '"""',
        "",
        f"from quack.activation import {fn}",
        "from quack.epilogue.frontend import gemm_epilogue",
        "from quack.epilogue.math import pack, unpack",
        *imports,
        "",
        "",
        *decorator,
        "    g, u = unpack(c)",
        *("    " + line for line in body),
        ret,
        "",
    ])
    digest = hashlib.sha256(source.encode()).hexdigest()[:12]
    kind = "dgated_routed" if routed else "dgated"
    return DgatedSource(op, f"coda_{kind}_{op}_{digest}", source)
