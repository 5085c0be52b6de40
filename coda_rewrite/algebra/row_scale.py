"""Row-scalar deferral: is it legal to apply a norm's rstd after the consumer GEMM?

The identity, for any per-row scalar r and any GEMM contracting over the feature dim:

    Σ_k (r[i]·H[i, k])·W[k, j]  =  r[i]·Σ_k H[i, k]·W[k, j]            (1)

proved once with sympy over indexed sums of symbolic length (cached). What makes it
apply to a matched graph are the side conditions, each checked on the graph:

  (a) r is per row: the norm's mean of squares runs over the last dim only, keepdim;
  (b) nothing between the norm and the GEMM mixes rows or features: only row selections
      (indexing that keeps the last dim whole; r is indexed the same way), reshapes that
      keep the last dim, contiguous() and casts (a cast rounds before instead of after
      the scale: equal in exact arithmetic, a rounding-level change in floating point);
  (b') the GEMM contracts over that last dim (nn.Linear / x @ Wᵀ: it does);
  (c) no value of the region, nor an alias of one, is updated in place: the fused
      producer reads the residual when the add happens, eager's norm when it runs;
  (d) no cast in the region rounds to a dtype coarser than the GEMM computes in (r
      would move across that rounding: exact in real arithmetic, not in an fp32 model);
  (e) under tensor parallelism (DTensor), every value r moves through is a complete
      sum on every rank, not split along the features, and the consumer GEMM has a
      local layout (algebra/sharding.py);
  (f) no GEMM reads the unnormalised row in float16 unless eager holds that very row
      in float16: h2 = z ⊙ γ (or z) is as large as the residual stream (times γ), where
      eager's GEMM input r·z·γ is of order γ. A float16 z fits float16 (eager stores
      it); z ⊙ γ need not, nor a float32 stream cast to float16 by autocast (bfloat16
      has float32's range).

The factor that must *not* move: one that varies along the contracted dim (a per-feature
γ, or r when the GEMM contracts over rows). Here γ stays in the producer's epilogue and
only r moves.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..canonical import canon, inactive_dropout, meta
from ..capture import describe
from ..codegen import layouts
from ..graph_utils import in_place_update_of
from ..numerics import rel_err
from . import sharding, statements
from . import witness as witness_mod
from .decision import Decision, Proof, Rejection, RejectionKind, Why, code_of
from .witness import (_MAX_ELEMS, _Unreplayable, _eval, _size, _value, both_arrangements,
                      unavailable)


# ---- side condition (b): ops between the norm and its GEMM ----------------------------

_VIEWLIKE = {"view", "reshape", "flatten"}
_IDENTITY = {"contiguous", "clone"}
_ROW_PERMUTES = {"roll", "flip", "index_select"}


def _name(node: fx.Node) -> str:
    c = canon(node)
    if c is not None:
        return c.name
    return node.target if node.op == "call_method" else getattr(node.target, "__name__",
                                                                str(node.target))


def _per_feature(x, d: int) -> bool:
    """A python number, or a tensor with one value per feature ([d], [1, .., 1, d])."""
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return True
    mx = meta(x)
    return mx is not None and mx.shape[-1] == d and all(s == 1 for s in mx.shape[:-1])


def _dims_avoid_last(dims, ndim: int) -> bool:
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    return bool(dims) and all(isinstance(x, int) and x % ndim != ndim - 1 for x in dims)


def chain_op(node: fx.Node, src: fx.Node, d: int) -> tuple[str, str]:
    """Classify an op between the norm and the GEMM (``src`` is its input on the path):

        index / permute   selects or reorders rows: applied to r the same way
        detach            stops the gradient: applied to r too (eager's GEMM input, r·h,
                          carries none; with only h2 detached, r would pass one to z)
        reshape           keeps the last dim: r follows the leading dims
        cast, identity    h2 only (identity: contiguous, clone, an inactive dropout)
        scale             × a per-feature vector: folded into the GEMM's weights
        shift             + a per-feature vector: distributed as the epilogue's bias b·Wᵀ
        reject            anything else, with why
    """
    name = _name(node)
    ms, out = meta(src), meta(node)
    if ms is None or out is None:
        return "reject", Why(f"{describe(node)} does not produce a tensor",
                             "row_scale.not_a_tensor")
    if sharding.boundary_op(node) is not None:  # DTensor layout ops: side condition (e)
        why = sharding.boundary_keeps_rows(node, src)
        return ("reject", why) if why is not None else ("index", "")
    if name == "cast":
        return "cast", ""
    if name == "detach" and len(node.args) == 1:
        return "detach", ""
    if (name in _IDENTITY and len(node.args) == 1) or inactive_dropout(node):
        return "identity", ""
    if name == "getitem":
        if index_keeps_last_dim(node.args[1], ms.dim()):
            return "index", ""
        return "reject", Why(f"{describe(node)} indexes the feature dim: the GEMM would "
                             "no longer contract over the normalised features",
                             "row_scale.feature_index")
    if name in _ROW_PERMUTES:
        dims = node.args[2] if name == "roll" and len(node.args) > 2 else \
            node.kwargs.get("dims") if name == "roll" else \
            node.args[1] if len(node.args) > 1 else node.kwargs.get("dims", node.kwargs.get("dim"))
        if dims is not None and _dims_avoid_last(dims, ms.dim()):
            return "permute", ""
        return "reject", Why(f"{describe(node)} ({name}) moves values across the feature dim",
                             "row_scale.feature_permute")
    if name in _VIEWLIKE and out.dim() >= 1 and out.shape[-1] == d and ms.shape[-1] == d:
        return "reshape", ""
    if name in ("mul", "add", "sub") and out.shape == ms.shape:
        other = node.args[1] if node.args[0] is src else node.args[0]
        if _per_feature(other, d) and not (name == "sub" and node.args[1] is src):
            return ("scale" if name == "mul" else "shift"), ""
        if name == "mul" and (meta(other) is not None and meta(other).shape[-1] == 1):
            return "reject", Why(f"{describe(node)} multiplies by a per-row value: it would "
                                 "have to be deferred too (not established)",
                                 "row_scale.per_row_factor")
    return "reject", Why(f"{describe(node)} ({name}) sits between the norm and the GEMM: "
                         "r·f(h) = f(r·h) is not established for it", "row_scale.op_between")


def chain_kinds(consumer, norm) -> list[tuple[str, str]]:
    """chain_op for each node between the norm's output and ``consumer``'s GEMM."""
    srcs = (norm.output, *consumer.chain[:-1])
    return [chain_op(n, src, norm.dim) for n, src in zip(consumer.chain, srcs)]


def norm_ndim(norm) -> int:
    return meta(norm.output).dim()


def has_shift(consumer, norm) -> bool:
    """A shift between the norm and the GEMM: distributed as a bias of the GEMM."""
    return any(kind == "shift" for kind, _ in chain_kinds(consumer, norm))


def replay_chain(chain, head: fx.Node, d: int, h2, r, like, call):
    """Apply the ops between the norm output ``head`` and a GEMM to the rewrite's values.

    ``like(node, src, x)`` applies ``node``'s op with ``x`` in place of ``src``;
    ``call(fn, *args)`` applies a function. The graph rewrite passes node-building
    versions, the numeric witness evaluating ones, so both run this one definition.
    Returns (h2, r, scale, shift): the consumer computes r ⊙ (h2·(W ⊙ scale)ᵀ) +
    shift·Wᵀ + its own bias."""
    scale = shift = None
    src = head
    for node in chain:
        kind, why = chain_op(node, src, d)
        if kind == "reject":
            raise ValueError(why)
        if kind in ("index", "permute", "detach"):
            h2, r = like(node, src, h2), like(node, src, r)
            if kind == "detach":  # a factor or shift from before it gets no gradient
                scale, shift = (None if t is None else call(torch.detach, t)
                                for t in (scale, shift))
        elif kind == "reshape":
            h2 = like(node, src, h2)
            r = call(layouts.rows_like, r, h2)
        elif kind in ("cast", "identity"):
            h2 = like(node, src, h2)
        else:
            other = node.args[1] if node.args[0] is src else node.args[0]
            if kind == "scale":
                scale = other if scale is None else call(operator.mul, scale, other)
                if shift is not None:
                    shift = call(operator.mul, shift, other)
            else:
                sign_other = call(operator.neg, other) if _name(node) == "sub" else other
                shift = sign_other if shift is None else call(operator.add, shift, sign_other)
        src = node
    return h2, r, scale, shift




def index_keeps_last_dim(index, ndim: int) -> bool:
    """True when ``x[index]`` selects along leading dims only and keeps the last dim whole,
    so that the same index applied to r (shape [..., 1]) selects the same rows."""
    idx = index if isinstance(index, tuple) else (index,)
    full = slice(None, None, None)
    if any(i is Ellipsis for i in idx):
        after = idx[idx.index(Ellipsis) + 1:]
        after = [i for i in after if i is not None]
        return not after or (after[-1] == full and isinstance(after[-1], slice))
    consumed = [i for i in idx if i is not None]
    for i in consumed:
        m = meta(i)
        if m is not None and m.dtype.is_floating_point:
            return False
        if m is not None and m.dtype == torch.bool and m.dim() > 1:
            consumed = consumed + [full] * (m.dim() - 1)  # a mask spans several dims
    if len(consumed) < ndim:
        return True
    last = consumed[ndim - 1] if len(consumed) >= ndim else full
    return isinstance(last, slice) and last == full


# ---- side condition (d): no rounding the row scale would move across -----------------

def narrowing_cast(consumer, norm) -> fx.Node | None:
    """A cast in the norm or between the norm and ``consumer``'s GEMM to a dtype coarser
    than the GEMM computes in. Eager rounds r·h there; the rewrite would round h and
    apply r after the GEMM, a change of the rounding's size, which the GEMM dtype's
    numerics policy does not cover (an fp32 model must stay within 1e-5 of eager). A
    cast to the GEMM's own dtype (a bf16 model's norm ending in .to(bfloat16)) is the
    rounding the bf16 policy measures, and is allowed."""
    target = meta(consumer.linear)
    if target is None or not target.dtype.is_floating_point:
        return None
    for node in (*norm.nodes, *consumer.chain):
        out = meta(node)
        if _name(node) == "cast" and out is not None and out.dtype.is_floating_point and \
                torch.finfo(out.dtype).eps > torch.finfo(target.dtype).eps:
            return node
    return None


# ---- side condition (c): in-place updates ---------------------------------------------

def updated_in_place(match, graph: fx.Graph, consequence: str, code: str) -> Rejection | None:
    """Side condition (c) of a norm deferred into its consumer GEMMs (RMSNorm here,
    LayerNorm in algebra/layernorm.py): nothing the deferral reads at another time than
    the norm did — its input, its nodes and parameters, each consumer's chain, or a view
    of one — is updated in place anywhere in the graph."""
    norm = match.norm
    params = (getattr(norm, "weight", None), getattr(norm, "bias", None))
    region = {norm.input, norm.output, *norm.nodes, *(p for p in params if p is not None)}
    for c in match.consumers:
        region.update(c.chain)
    updated = in_place_update_of(region, graph)
    if updated is None:
        return None
    node, target = updated
    return Rejection(Why(f"(c) {describe(node)} updates {target.name} in place; "
                         + consequence, code), describe(node))


def float16_range(norm) -> Rejection | None:
    """Side condition (f), for the whole match: a weighted norm whose output is float16
    stores h2 = z ⊙ γ in float16, which overflows where |z·γ| > 65504 though z fits (a
    massive activation: one feature of the residual stream at 2·10⁴ with γ = 4 there
    gave NaN logits, eager's finite; tests/test_reliability.py). Refused, not
    range-checked per call: γ is live and z is data."""
    out = meta(norm.output)
    if getattr(norm, "weight", None) is None or out is None or out.dtype != torch.float16:
        return None
    return Rejection(Why(
        "(f) the norm's output is float16 and h2 = z ⊙ γ, the unnormalised row times the "
        "norm's weight, would be stored in float16 for the GEMM: it can exceed float16's "
        "range (65504) where eager's normalised row cannot; left to eager's norm",
        "row_scale.float16_range"), describe(norm.output))


def float16_gemm(consumer, norm) -> Why | None:
    """Side condition (f), per consumer: a GEMM computing in float16 (autocast over a
    float32 model) would read the unnormalised row cast to float16, z ⊙ γ or a float32
    z, where eager casts the normalised one (a float32 stream at 10⁵ gave NaN logits
    under autocast, eager's finite). Fine where the row is a float16 z eager holds too."""
    gemm, stream = meta(consumer.linear), meta(norm.input)
    if gemm is None or gemm.dtype != torch.float16:
        return None
    if getattr(norm, "weight", None) is None and stream is not None and \
            stream.dtype == torch.float16:
        return None
    return Why(f"(f) {describe(consumer.linear)} computes in float16 (autocast) and would "
               "read the unnormalised row in float16, which can exceed its range (65504) "
               "where eager's normalised row cannot", "row_scale.float16_range")


def check(match, graph: fx.Graph) -> tuple[Decision, dict[fx.Node, Decision]]:
    """The overall decision for a match and one per consumer GEMM."""
    norm = match.norm
    updated = updated_in_place(match, graph, "the deferred rstd would be computed from the "
                               "value before that update", "row_scale.in_place")
    if updated is not None:
        return updated, {}
    too_wide = float16_range(norm)
    if too_wide is not None:
        return too_wide, {}

    per_consumer: dict[fx.Node, Decision] = {}
    for c in match.consumers:
        kinds = chain_kinds(c, norm)
        bad = next((why for kind, why in kinds if kind == "reject"), None)
        mx = meta(c.chain[-1] if c.chain else norm.output)
        if bad is None and (mx is None or mx.shape[-1] != norm.dim):
            bad = Why(f"{describe(c.linear)} does not contract over the {norm.dim} "
                      "normalised features", "row_scale.contraction")
        if bad is None:
            bad = sharding.consumer_condition(c.linear, c.chain[-1] if c.chain else
                                              norm.output, c.weight, c.bias)
        if bad is None and sharding.is_dtensor(c.weight) and \
                {"scale", "shift"} & {k for k, _ in kinds}:
            bad = Why(f"{describe(c.linear)} has a DTensor weight and a per-feature factor "
                      "or shift to fold into it (not done on sharded weights yet)",
                      "dtensor.fold")
        if bad is not None:
            per_consumer[c.linear] = Rejection(f"(b) {bad}", describe(c.linear),
                                               code=code_of(bad))
            continue
        too_wide = float16_gemm(c, norm)
        if too_wide is not None:
            per_consumer[c.linear] = Rejection(too_wide, describe(c.linear))
            continue
        rounding = narrowing_cast(c, norm)
        if rounding is not None:
            per_consumer[c.linear] = Rejection(Why(
                    f"(d) {describe(rounding)} rounds to {meta(rounding).dtype} inside the "
                    f"region of a {meta(c.linear).dtype} GEMM: the row scale would move across "
                    "that rounding (not within the numerics policy)",
                    "row_scale.narrowing_cast"),
                describe(c.linear))
            continue
        via = ", ".join(f"{n.name}: {k}" for n, (k, _) in zip(c.chain, kinds))
        used = {k for k, _ in kinds}
        steps = []
        if "scale" in used:
            steps.append("per-feature factor folded into the weights: "
                         + statements.prove_per_feature_fold().statement)
        if "shift" in used:
            steps.append("bias after the norm distributed: "
                         + statements.prove_bias_distribution().statement)
        if sharding.is_dtensor(c.weight):
            steps.append("(e) on local shards, layout "
                         + "/".join(sharding.gemm_layout(
                             sharding.placements(c.chain[-1] if c.chain else norm.output),
                             sharding.placements(c.weight), norm_ndim(norm)))
                         + ": " + statements.prove_sharded_gemm().statement)
        per_consumer[c.linear] = Proof(
            f"{c.linear.name} = r ⊙ (h2 · W'ᵀ)" + (" + b" if c.bias is not None else "")
            + (" + shift·Wᵀ" if "shift" in used else ""),
            (f"(b) path from the norm: {via or 'direct'}",
             "(b') nn.Linear contracts over the last (normalised) dim"), tuple(steps))
    accepted = [c for c in match.consumers if per_consumer[c.linear].accepted]
    if not accepted:
        return no_consumer_left(next(iter(per_consumer.values()))), per_consumer
    statement = "(diag(r)·H)·Wᵀ = diag(r)·(H·Wᵀ),  r[i] = rsqrt(mean_j z[i, j]² + eps)"
    assumptions = (
        f"(a) the mean of squares runs over the last dim ({norm.dim} features) with "
        f"keepdim, so r is one scalar per row [{norm.spelling}]",
        "(c) no value of the region or an alias of one is updated in place",
        f"eps = {norm.eps:g} is a constant" if isinstance(norm.eps, float) else
        f"eps is the 0-d tensor {norm.eps.name}, one value for every row (read at run time)",
    )
    deferral = statements.prove_row_scale_deferral()
    decomposition = statements.prove_reduction_decomposition("sum")
    return Proof(statement, assumptions, deferral.steps + (
        "rstd's sum of squares is merged from per-tile partials: " + decomposition.statement,
    ), deferral.witness), per_consumer


def no_consumer_left(first: Rejection) -> Rejection:
    """The match's rejection where no consumer GEMM takes r: the first one's reason."""
    return Rejection("no consumer GEMM can take the deferred row scale: " + first.condition,
                     first.where, code=first.code)


# ---- the decision ------------------------------------------------------------------------

def decide(match, programs, graph: fx.Graph):
    """(decision, per-consumer decisions, accepted consumers) for a residual → RMSNorm →
    GEMM match and the programs that would replace it (``programs.norm``,
    ``programs.consumers[linear]``, ``programs.norm_operands``). Pure: nothing is changed."""
    decision, per_consumer = check(match, graph)
    if not decision.accepted:
        return decision, per_consumer, []
    accepted = [c for c in match.consumers if per_consumer[c.linear].accepted]
    seen = witness(match, programs, accepted)
    if isinstance(seen, Rejection):
        return seen, per_consumer, []
    decision = Proof(decision.statement, decision.assumptions, decision.steps, seen)
    return decision, per_consumer, accepted


# ---- witness: the matched nodes against the programs, in float64 -----------------------

def witness(match, programs, consumers) -> str | Rejection:
    lead_full = [_size(s) for s in meta(match.norm.input).shape[:-1]]
    leads = [[min(s, 3) for s in lead_full]]
    if lead_full != leads[0] and witness_mod._prod(lead_full) * match.norm.dim <= _MAX_ELEMS:
        leads.append(lead_full)
    # float64 where the graph has float32; the graph's own dtypes when it casts
    # explicitly (a float64 operand would then meet a bfloat16 one)
    attempts = [(lead, native) for lead in leads for native in (False, True)]
    last_err = ""
    for lead, native in attempts:
        try:
            seen = _witness(match, programs, consumers, lead, native)
        except _Unreplayable as e:
            return unavailable(str(e), match.path)
        except (RuntimeError, IndexError, ValueError, TypeError) as e:  # an op that raises
            last_err = _first_line(e)
            continue
        if isinstance(seen, Rejection) or not _trains(match, consumers):
            return seen
        return _gradient_witness(match, programs, consumers, lead, seen)
    return unavailable(f"the matched nodes raise on the replay's inputs: {last_err}",
                       match.path)


def _first_line(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def _trains(match, consumers) -> bool:
    """Whether autograd records the match's results where dynamo traced them (a result
    without a traced value counts as recorded: the gradient replay then runs)."""
    outs = [c.linear for c in consumers] + ([match.producer.add] if match.producer else [])
    return any(meta(n) is None or meta(n).requires_grad for n in outs)


def _gradient_witness(match, programs, consumers, lead, seen: str) -> str | Rejection:
    """The forward witness ``seen``, and in a training graph the same replay's gradients.

    The forward replay cannot see a rewrite whose values are right and whose gradients
    are not: a detach between the norm and a GEMM that the rewrite applied to h2 but not
    to the deferred r (found by tests/test_legality.py; chain_op's "detach" now covers
    it) gave exact logits and every upstream gradient 12% off. So a match that trains is
    replayed once more with every input a float64 leaf, every cast the identity and the
    programs' outputs unrounded (the dataflow's derivative, not its roundings), and the
    gradients of both sides to every leaf must agree. On a fresh thread: the pass may run
    under the caller's no_grad, inference mode or saved-tensor hooks (isolated.py).
    Fails closed like the forward."""
    try:
        grads = both_arrangements(_witness, match, programs, consumers, lead, False, True)
    except _Unreplayable as e:
        return unavailable(str(e), match.path)
    except (RuntimeError, IndexError, ValueError, TypeError) as e:
        return unavailable(f"the gradient replay raises: {_first_line(e)}", match.path)
    return grads if isinstance(grads, Rejection) else f"{seen}; {grads}"


def _small_first_row(*tensors) -> None:
    """Scale the first row of the norm's inputs by 1e-2 (mean(z²) ≈ 1e-4), where an eps
    other than the graph's changes the norm by more than the replay's tolerance; on rows
    of unit size a wrong eps hides under bf16's (an eps=None norm's once did)."""
    with torch.no_grad():  # a gradient replay's leaves are scaled before any use
        for t in tensors:
            t.view(-1, t.shape[-1])[0] *= 1e-2


def _witness(match, programs, consumers, lead, native: bool,
             gradients: bool = False) -> str | Rejection:
    """The replay on rows ``lead``: in float64 where the graph has float32 (``native``:
    in the graph's dtypes); with ``gradients``, every input a float64 leaf, casts the
    identity, and the gradients compared (_gradient_witness)."""
    norm, prod = match.norm, match.producer
    d = norm.dim
    g = torch.Generator().manual_seed(1234)
    leaves: list[torch.Tensor] = []

    def rand(node, *shape, base=0.0):
        dtype = meta(node).dtype
        if gradients or (not native and dtype == torch.float32):
            dtype = torch.float64
        t = (base + torch.randn(*shape, generator=g, dtype=torch.float64)).to(dtype)
        if gradients:
            leaves.append(t.requires_grad_())
        return t

    env: dict = {"__gen__": g, witness_mod.MATH: gradients}
    ops_in, reference_outs, rewritten_outs, names = [], [], [], []
    if norm.weight is not None:
        env[norm.weight] = rand(norm.weight, d, base=1.0) * 0.5
    if prod is not None:
        # the GEMM's contracted dim is shrunk for speed, except where a node plays two
        # roles (x + W·x: x is the residual; a consumer that reuses W): one node, one shape
        k = _size(meta(prod.x).shape[-1])
        if prod.x is not prod.residual and all(c.weight is not prod.weight for c in consumers):
            k = min(k, 16)
        env[prod.x] = rand(prod.x, *lead, k)
        env[prod.weight] = rand(prod.weight, d, k)
        if prod.bias is not None:
            env[prod.bias] = rand(prod.bias, d)
        env[prod.residual] = rand(prod.residual, *lead, d)
        _small_first_row(env[prod.x], env[prod.residual])
        env[prod.linear] = _eval(prod.linear, env)
        for n in prod.between:  # identity ops and the residual multiplier, as captured
            env[n] = _eval(n, env)
        env[prod.add] = _eval(prod.add, env)
        ops_in = [env[prod.x].reshape(-1, k), env[prod.weight],
                  [*([env[prod.bias]] if prod.bias is not None else []),
                   env[prod.residual].reshape(-1, d)]]
    else:
        env[norm.input] = rand(norm.input, *lead, d)
        _small_first_row(env[norm.input])
        ops_in = [None, None, [env[norm.input].reshape(-1, d)]]
    if isinstance(norm.eps, fx.Node):
        env[norm.eps] = torch.tensor(1e-5, dtype=torch.float64)
        for u in norm.eps.users:  # the idiom may read it through .item()
            if u.op == "call_method" and u.target == "item":
                env[u] = 1e-5
    ops_in[2] += [env[n] for n in programs.norm_operands]
    for n in norm.nodes:
        env[n] = _eval(n, env)

    def program(p):  # unrounded outputs where the gradients are compared
        return witness_mod.exact_program(p) if gradients else p

    outs = witness_mod.run_program(program(programs.norm), *ops_in, gradients)
    if prod is not None:
        z, h2, r = outs
        reference_outs.append(env[prod.add])
        rewritten_outs.append(z.reshape(env[prod.add].shape))
        names.append(prod.add.name)
    else:
        h2, r = outs
    h2 = h2.reshape(*lead, d)
    r = r.reshape(*lead, 1)

    for c in consumers:
        n_out = min(_size(meta(c.weight).shape[0]), 8)
        if c.weight not in env:  # a weight two GEMMs share keeps its first value
            env[c.weight] = rand(c.weight, n_out, d)
        n_out = env[c.weight].shape[0]
        if c.bias is not None and c.bias not in env:
            env[c.bias] = rand(c.bias, n_out)
        for node in c.chain:
            env[node] = _eval(node, env)
        ref = _eval(c.linear, env)
        def like(node, src, x):
            return _eval(node, env, replace=(src, x))

        def call(fn, *args):
            return fn(*(_value(a, env) for a in args))

        hc, rc, scale, shift = replay_chain(c.chain, norm.output, d, h2, r, like, call)
        weight, bias = env[c.weight], env.get(c.bias)
        if scale is not None:
            weight = layouts.fold_scale(env[c.weight], _value(scale, env))
        if shift is not None:
            bias = layouts.distribute_bias(_value(shift, env), env[c.weight], bias)
        ops = [rc.reshape(-1), *([bias] if bias is not None else [])]
        (out,) = witness_mod.run_program(program(programs.consumers[c.linear]),
                                         hc.reshape(-1, d), weight, ops, gradients)
        reference_outs.append(ref)
        rewritten_outs.append(out.reshape(ref.shape))
        names.append(c.linear.name)

    if gradients:
        leaves += env.get(witness_mod.LEAVES, [])
        err = witness_mod.gradient_error(rewritten_outs, reference_outs, leaves)
        what = (f"the gradients to the {len(leaves)} inputs in exact arithmetic, rows "
                f"{lead}")
        return witness_mod.verdict(err, what, match.path, gradients=True)
    low_precision = any(m is not None and m.dtype in (torch.float16, torch.bfloat16)
                        for m in map(meta, [norm.input, norm.output, *norm.nodes,
                                            *(c.linear for c in consumers)]))
    tol = 3e-2 if low_precision else 1e-5 if native else 1e-6
    errs = [rel_err(a, b) for a, b in zip(rewritten_outs, reference_outs)]
    shown = ", ".join(f"{n} {e:.1e}" for n, e in zip(names, errs))
    if not all(e <= tol for e in errs):  # NaN fails too
        return Rejection(f"checker bug: the float64 witness disagrees ({shown}; tol {tol:g}); "
                         "the rewrite is not applied", match.path,
                         RejectionKind.WITNESS_DISAGREES, "witness.disagrees")
    how = "in the graph's dtypes" if native else "in float64"
    return f"replay {how} on rows {lead}: rel. error {shown} (tol {tol:g})"
