"""One pattern, every spelling: the canonical vocabulary makes each of these match, and
the rewrite computes what eager computes (values and gradients)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import coda_rewrite
from coda_rewrite.numerics import rel_err
from conftest import hf_model, tokens

D, N = 32, 48


def norm_hf(self, x):  # LlamaRMSNorm
    dtype = x.dtype
    h = x.to(torch.float32)
    var = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(var + 1e-6)
    return self.g * h.to(dtype)


def norm_module(self, x):
    return self.rms(x)


def norm_functional(self, x):
    return F.rms_norm(x, (D,), self.g, 1e-6)


def norm_functional_no_eps(self, x):
    return F.rms_norm(x, (D,), self.g)


def norm_gemma(self, x):  # GemmaRMSNorm: scale by (1 + w) in float32
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    return (h * (1.0 + self.g.float())).type_as(x)


def norm_div_sqrt(self, x):
    var = (x * x).mean(dim=-1, keepdim=True)
    return x / torch.sqrt(var + 1e-5) * self.g


def norm_no_weight(self, x):
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6)


def norm_pow(self, x):  # x · (mean(x²) + eps)^(-1/2)
    return self.g * (x * torch.pow(x.pow(2).mean(-1, keepdim=True) + 1e-6, -0.5))


def norm_div_pow_half(self, x):  # x / (mean(x²) + eps) ** 0.5
    return x / ((x ** 2).mean(-1, keepdim=True) + 1e-6) ** 0.5 * self.g


NORMS = [norm_hf, norm_module, norm_functional, norm_functional_no_eps, norm_gemma,
         norm_div_sqrt, norm_no_weight, norm_pow, norm_div_pow_half]


def lin_module(layer, x):
    return layer(x)


def lin_functional(layer, x):
    return F.linear(x, layer.weight, layer.bias)


def lin_matmul_T(layer, x):
    y = x @ layer.weight.T
    return y + layer.bias if layer.bias is not None else y


def lin_matmul_t(layer, x):
    y = torch.matmul(x, layer.weight.t())
    return y if layer.bias is None else y + layer.bias


def lin_addmm(layer, x):  # 2-D input only
    if layer.bias is None:
        return x @ layer.weight.transpose(0, 1)
    return torch.addmm(layer.bias, x, layer.weight.t())


LINEARS = [lin_module, lin_functional, lin_matmul_T, lin_matmul_t]


class Toy(nn.Module):
    """GEMM → residual add → RMSNorm → two GEMMs, in the spelling asked for."""

    def __init__(self, norm, linear, residual_first: bool, bias: bool):
        super().__init__()
        self.norm_fn, self.lin_fn, self.residual_first = norm, linear, residual_first
        self.w0 = nn.Linear(D, D, bias=bias)
        self.w1 = nn.Linear(D, N, bias=bias)
        self.w2 = nn.Linear(D, N, bias=bias)
        self.g = nn.Parameter(torch.rand(D) + 0.5)
        self.rms = nn.RMSNorm(D, eps=1e-6)
        with torch.no_grad():
            self.rms.weight.copy_(self.g)

    def forward(self, x, res):
        y = self.lin_fn(self.w0, x)
        z = res + y if self.residual_first else y + res
        h = self.norm_fn(self, z)
        return self.lin_fn(self.w1, h) * self.lin_fn(self.w2, h), z


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, 5, D, generator=g), torch.randn(3, 5, D, generator=g)


@pytest.mark.parametrize("norm", NORMS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("linear", LINEARS, ids=lambda f: f.__name__)
def test_spelling_matches_and_agrees(norm, linear):
    for residual_first, bias in ((False, False), (True, True)):
        torch._dynamo.reset()
        model = Toy(norm, linear, residual_first, bias)
        ref = copy.deepcopy(model)
        x, res = _inputs()
        fast = coda_rewrite.optimize(model)
        out, z = fast(x, res)
        want, want_z = ref(x, res)
        rec = fast.report.records
        assert [r.status for r in rec] == ["rewritten"], str(fast.report)
        # a biased producer has no kernel (its sum of squares would fold the unloaded
        # bias lanes of a ragged tile): its GEMM stays, the norm takes the row-wise program
        producer = "rmsnorm_rowscale" if bias else "residual_rmsnorm"
        assert rec[0].programs[0].name == producer, str(fast.report)
        assert len(rec[0].programs) == 3  # producer (or row-wise) + two consumers
        assert ("has no kernel" in rec[0].producer) == bias, rec[0].producer
        assert rel_err(out, want) <= 1e-5 and rel_err(z, want_z) <= 1e-6
        (out.sum() + z.sum()).backward()
        (want.sum() + want_z.sum()).backward()
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            if q.grad is not None:
                assert rel_err(p.grad, q.grad) <= 1e-4, (name, residual_first, bias)


@pytest.mark.parametrize("bias", [False, True])
def test_addmm_on_2d_input(bias):
    model = Toy(norm_hf, lin_addmm, False, bias)
    ref = copy.deepcopy(model)
    x, res = (t.reshape(-1, D) for t in _inputs())
    fast = coda_rewrite.optimize(model)
    assert rel_err(fast(x, res)[0], ref(x, res)[0]) <= 1e-5
    assert [r.status for r in fast.report.records] == ["rewritten"]
    assert len(fast.report.records[0].programs) == 3


def test_gemma_offset_lands_in_the_program():
    model = Toy(norm_gemma, lin_module, False, False)
    fast = coda_rewrite.optimize(model, _inputs())
    text = fast.report.records[0].programs[0].pretty()
    assert "gamma + 1.0" in text, text


class ScaledResidual(nn.Module):
    """Phi-3 / Granite: the sublayer's output through a dropout and a scalar multiplier
    before the residual add, then the norm and a GEMM."""

    def __init__(self, p: float, multiplier: float, divide: bool = False):
        super().__init__()
        torch.manual_seed(0)
        # no bias on the producer: a biased one has no kernel and is left unfused
        # (test_legality), and this is about the multiplier between it and the add
        self.w0, self.w1 = nn.Linear(D, D, bias=False), nn.Linear(D, N, bias=False)
        self.drop = nn.Dropout(p)
        self.norm = nn.RMSNorm(D, eps=1e-6)
        self.multiplier, self.divide = multiplier, divide

    def forward(self, x, res):
        y = self.drop(self.w0(x))
        y = y / self.multiplier if self.divide else y * self.multiplier
        z = res + y
        return self.w1(self.norm(z)), z


def _producer_fused(report) -> bool:
    (rec,) = [r for r in report.records if r.pattern == "residual_rmsnorm_gemm"]
    assert rec.status == "rewritten", str(report)
    return "residual_rmsnorm" in [p.name for p in rec.programs]


@pytest.mark.parametrize("p,train,mult,divide", [(0.1, False, 0.5, False),   # eval dropout
                                                 (0.0, True, 0.25, False),   # p = 0
                                                 (0.0, True, 1.0, False),    # dropout alone
                                                 (0.1, False, 4.0, True)])   # y / 4
def test_identity_dropout_and_scalar_multiplier_before_the_residual(p, train, mult, divide):
    """Fused into the producer: z = c·(x·W0ᵀ + b0) + residual; outputs and gradients as
    eager's (the backward scales the GEMM's gradient by c)."""
    model = ScaledResidual(p, mult, divide).train(train)
    ref = copy.deepcopy(model)
    x, res = _inputs()
    x.requires_grad_()
    xr = x.detach().clone().requires_grad_()
    fast = coda_rewrite.optimize(model)
    (out, z), (want, zr) = fast(x, res), ref(xr, res)
    assert rel_err(out, want) <= 1e-5 and rel_err(z, zr) <= 1e-5
    (out.square().sum() + z.sum()).backward()
    (want.square().sum() + zr.sum()).backward()
    assert rel_err(x.grad, xr.grad) <= 1e-4
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        assert rel_err(a.grad, b.grad) <= 1e-4, name
    assert _producer_fused(fast.report)


def test_an_active_dropout_keeps_the_producer_apart():
    """Training with p > 0: the dropout is not the identity; the norm is still fused (as a
    row-wise program), its producer is not, and the results are eager's under one seed."""
    model = ScaledResidual(0.5, 0.5).train()
    ref = copy.deepcopy(model)
    x, res = _inputs()
    fast = coda_rewrite.optimize(model)
    torch.manual_seed(3)
    out, _ = fast(x, res)
    torch.manual_seed(3)
    want, _ = ref(x, res)
    assert rel_err(out, want) <= 1e-5
    assert not _producer_fused(fast.report)


def test_phi3_dropout_in_eval_no_longer_blocks_the_producer():
    from conftest import hf_model, tokens
    model = hf_model("phi3", resid_pdrop=0.1).eval()
    report = coda_rewrite.explain(model, tokens(), use_cache=False)
    producers = [r for r in report.records if r.pattern == "residual_rmsnorm_gemm"
                 and "residual_rmsnorm" in [p.name for p in r.programs]]
    assert len(producers) == 4, str(report)   # 2 layers x (attention, MLP) outputs


class MultiplierLookAlikes(nn.Module):
    """What is not a scalar residual multiplier: a learned 0-d tensor factor, and a
    scaled value something else reads too (returned)."""

    def __init__(self, kind: str):
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        # no bias on the producer: a biased one has no kernel and is left unfused
        # (test_legality), and this is about the multiplier between it and the add
        self.w0, self.w1 = nn.Linear(D, D, bias=False), nn.Linear(D, N, bias=False)
        self.norm = nn.RMSNorm(D, eps=1e-6)
        self.alpha = nn.Parameter(torch.tensor(0.5))

    def forward(self, x, res):
        y = self.w0(x)
        y = y * self.alpha if self.kind == "tensor" else y * 0.5
        z = res + y
        out = self.w1(self.norm(z))
        return (out, y) if self.kind == "second_reader" else (out, z)


@pytest.mark.parametrize("kind", ["tensor", "second_reader"])
def test_multiplier_look_alikes_keep_the_producer_apart(kind):
    """Neither is folded into the producer; values and gradients stay eager's (the norm
    itself is still fused as a row-wise program)."""
    model = MultiplierLookAlikes(kind)
    ref = copy.deepcopy(model)
    x, res = _inputs()
    fast = coda_rewrite.optimize(model)
    (out, extra), (want, extra_r) = fast(x, res), ref(x, res)
    assert rel_err(out, want) <= 1e-5 and rel_err(extra, extra_r) <= 1e-5
    (out.square().sum() + extra.sum()).backward()
    (want.square().sum() + extra_r.sum()).backward()
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        assert (a.grad is None) == (b.grad is None), name  # alpha is unused in one kind
        if b.grad is not None:
            assert rel_err(a.grad, b.grad) <= 1e-4, name
    assert not _producer_fused(fast.report)


class LoraLinear(nn.Module):
    """A linear with a low-rank adapter, spelled as peft's lora.Linear: the frozen base
    layer, then result + lora_B(lora_A(dropout(x))) · scaling, the input in the adapter's
    dtype and the sum back in the result's (peft keeps each adapter in ModuleDicts keyed
    by its name)."""

    def __init__(self, base: nn.Linear, rank: int = 4, alpha: float = 8.0):
        super().__init__()
        self.base_layer = base.requires_grad_(False)
        self.lora_A = nn.ModuleDict({"default": nn.Linear(base.in_features, rank, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(rank, base.out_features,
                                                          bias=False)})
        self.lora_dropout = nn.ModuleDict({"default": nn.Identity()})
        self.scaling = {"default": alpha / rank}
        nn.init.normal_(self.lora_B["default"].weight, std=0.05)  # peft starts it at 0

    def forward(self, x):
        result = self.base_layer(x)
        dtype = result.dtype
        lora_a, lora_b = self.lora_A["default"], self.lora_B["default"]
        x = x.to(lora_a.weight.dtype)
        result = result + lora_b(lora_a(self.lora_dropout["default"](x))) * \
            self.scaling["default"]
        return result.to(dtype)


class Forwarding(nn.Module):
    """A wrapper that forwards attribute reads to the model it wraps, as peft's PeftModel
    and LoraModel do (a __getattr__ of its own: dynamo names the wrapped modules through
    ``__dict__['_modules']``)."""

    def __init__(self, inner: nn.Module, name: str):
        super().__init__()
        self.inner_name = name
        self.add_module(name, inner)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__(self.inner_name), name)

    def forward(self, *args, **kwargs):
        return getattr(self, self.inner_name)(*args, **kwargs)


@pytest.mark.parametrize("fuse_in_training", [None, True])
def test_lora_adapters_on_every_projection(fuse_in_training):
    """Adapter fine-tuning on every projection of an HF Llama (the base frozen, the
    adapters trained; the LM head plain), wrapped as peft wraps it: the loss and every
    adapter gradient eager's, no gradient for a frozen weight, the eval logits eager's;
    and the report says what the adapters change, at the paths peft's model names. Each
    norm is still deferred into the GEMMs that read it (the base layers and lora_A
    alike); RoPE and the gated MLP are near misses with their reason (a GEMM's output
    plus the adapter's term), not silent non-matches."""
    torch.manual_seed(0)
    llama = hf_model("llama", layers=2).requires_grad_(False)
    for module in list(llama.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and name != "lm_head":
                setattr(module, name, LoraLinear(child))
    model = Forwarding(Forwarding(llama, "model"), "base_model").train()
    ref = copy.deepcopy(model)
    ids = tokens()
    fast = coda_rewrite.optimize(model, fuse_in_training=fuse_in_training)
    loss, want = fast(ids, labels=ids).loss, ref(ids, labels=ids).loss
    assert abs(loss.item() - want.item()) <= 1e-5 * abs(want.item())
    loss.backward()
    want.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None) == (not p.requires_grad), name
        if q.grad is not None:
            assert rel_err(p.grad, q.grad) <= 1e-4, name
    with torch.no_grad():
        assert rel_err(fast.eval()(ids).logits, ref.eval()(ids).logits) <= 1e-5
    outcomes = {}
    for r in fast.report.records:
        outcomes.setdefault(r.pattern, set()).add((r.status, r.code or None))
    norms = {r.path for r in fast.report.records if r.pattern == "residual_rmsnorm_gemm"}
    assert norms == {name for name, m in model.named_modules()
                     if type(m).__name__ == "LlamaRMSNorm"}, norms
    assert "base_model.model.model.layers.0.mlp.gate_proj)" in str(fast.report)
    assert "__dict__" not in str(fast.report) and "dict." not in str(fast.report)
    assert outcomes["residual_rmsnorm_gemm"] == {("rewritten", None)}, str(fast.report)
    assert outcomes["gated_mlp"] == {("not matched", "gated.gemm_plus_term")}, \
        str(fast.report)
    assert outcomes["rope"] == {("not matched", "rope.not_gemm_columns")}, str(fast.report)


def test_float32_adapters_on_a_bf16_model_are_named():
    """peft's default keeps the adapters in float32 over a bf16 model: the adapter's sum
    is cast back to bf16 before the activation, and the gated MLP's near miss is still
    named through that cast (not left silent as a product of values no GEMM made)."""
    torch.manual_seed(0)
    llama = hf_model("llama", layers=1).to(torch.bfloat16).requires_grad_(False)
    for module in list(llama.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and name != "lm_head":
                setattr(module, name, LoraLinear(child).to(torch.float32).requires_grad_(False))
                getattr(module, name).base_layer.to(torch.bfloat16)
    report = coda_rewrite.explain(llama, tokens())
    gated = [r for r in report.records if r.pattern == "gated_mlp"]
    assert [(r.status, r.code) for r in gated] == [("not matched", "gated.gemm_plus_term")], \
        str(report)


@pytest.mark.parametrize("source, path", [
    ("L['self'].__dict__['_modules']['base_model'].__dict__['_modules']['model'].model."
     "layers.0.mlp", "base_model.model.model.layers.0.mlp"),
    ("L['self'].model.layers[3].mlp", "model.layers.3.mlp"),
    ("L['self'].model.layers._modules['3'].mlp", "model.layers.3.mlp")])
def test_module_paths_as_the_model_names_them(source, path):
    """Dynamo's module sources, through a forwarding wrapper's dict or not, read as the
    dotted names named_modules() gives."""
    from coda_rewrite.capture import _clean
    assert _clean(source) == path


@pytest.mark.parametrize("name, path", [
    ("L_self_dict_modules_base_model_dict_modules_model_modules_model_modules_layers_modules_"
     "0_modules_input_layernorm_parameters_weight_",
     "base_model.model.model.layers.0.input_layernorm.weight"),
    ("L_self_modules_model_modules_layer_dict_modules_a_parameters_weight_",
     "model.layer_dict.a.weight")])
def test_parameter_paths_as_the_model_names_them(name, path):
    """A parameter input's path: through a forwarding wrapper's dict, and a module whose own
    name ends in _dict (not taken for one)."""
    from coda_rewrite.capture import placeholder_path
    node = torch.fx.Graph().placeholder(name)
    assert placeholder_path(node) == path


def test_tensor_properties_recorded_as_aten_ops_are_transposes_and_views():
    """torch 2.14's dynamo records ``w.T`` as aten.numpy_T(w) and ``k.mT`` as aten.mT(k)
    (through 2.13: getattr(w, "T")), so a hand-made graph in that form: x @ aten.numpy_T(w)
    is linear(x, w) for a 2-D w (the packet and its overload alike) and not for a 3-D one
    (.T reverses every dim), nor for w.mH (a conjugate transpose, not read as one); the
    property is a view of w, so an update in place of w is an update of what the GEMM
    reads; an aten op that returns a fresh tensor is no view."""
    import operator

    import torch.fx as fx

    from coda_rewrite import canonical, graph_utils

    def graph(w_shape, prop):
        g = fx.Graph()
        x, w = g.placeholder("x"), g.placeholder("w")
        wt = g.call_function(prop, (w,))
        y = g.call_function(operator.matmul, (x, wt))
        upd = g.call_method("mul_", (w, 2.0))
        g.output((y, upd))
        w_value = torch.empty(*w_shape)
        x_value = torch.empty(4, w_shape[-1])
        wt_value = prop(w_value)  # the property's own value: its shape and strides
        values = {x: x_value, w: w_value, wt: wt_value, y: x_value @ wt_value}
        for node, value in values.items():
            node.meta["example_value"] = value
        return g, x, w, wt, y, upd

    aten = torch.ops.aten
    for prop in (aten.numpy_T, aten.numpy_T.default, aten.mT, aten.mT.default):
        g, x, w, wt, y, upd = graph((16, 8), prop)
        assert canonical.transpose_property(wt) == (w, "mT" if "mT" in str(prop) else "T")
        assert canonical.canon(y) == canonical.COp("linear", (x, w, None)), prop
        assert wt in graph_utils.aliases({w})
        assert graph_utils.in_place_update_of({wt}, g) == (upd, w)
    g, x, w, wt, y, upd = graph((2, 8, 8), aten.numpy_T)             # 3-D: not a transpose
    assert canonical.canon(y).name == "matmul"
    g, x, w, wt, y, upd = graph((16, 8), aten.mH)                     # conjugate: not taken
    assert canonical.transpose_property(wt) is None and canonical.canon(y).name == "matmul"
    assert wt in graph_utils.aliases({w})                             # a view all the same
    g = fx.Graph()
    w = g.placeholder("w")
    fresh = g.call_function(aten.mul.Tensor, (w, w))                  # a new tensor
    assert fresh not in graph_utils.aliases({w})


def test_a_transpose_whose_dims_the_graph_computes_is_not_read_as_one():
    """canonical.transposed_2d reads a transpose's dims only where they are constants:
    w.transpose(d, 1) with d a value of the graph (a placeholder here) is no transpose it
    can prove, and the matcher says so instead of failing on the node; constant dims,
    negative ones and permute's tuple form are still transposes."""
    import torch.fx as fx

    from coda_rewrite import canonical

    g = fx.Graph()
    w, d = g.placeholder("w"), g.placeholder("d")
    w.meta["example_value"] = torch.empty(16, 8)
    computed = g.call_method("transpose", (w, d, 1))
    computed_fn = g.call_function(torch.transpose, (w, 0, d))
    permuted = g.call_method("permute", (w, (d, 0)))
    assert canonical.transposed_2d(computed) is None
    assert canonical.transposed_2d(computed_fn) is None
    assert canonical.transposed_2d(permuted) is None
    for node in (g.call_method("transpose", (w, -1, 0)), g.call_method("permute", (w, (1, 0))),
                 g.call_method("permute", (w, 1, 0)), g.call_function(torch.transpose, (w, 1, 0)),
                 g.call_method("t", (w,)), g.call_function(torch.t, (w,))):
        assert canonical.transposed_2d(node) is w, node
    assert canonical.transposed_2d(g.call_method("permute", (w, (0, 1)))) is None
