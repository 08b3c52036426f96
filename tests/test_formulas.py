"""(CPU tier) The derivative formulas the kernels implement, written out in
float64 exactly as kernels_cu/cf_common.cuh and gn_chain.cuh compute them, and
checked against torch.autograd on the reference expressions; and the rounding
points of the chains' eager-rounding variant against half-precision eager."""
import re

import pytest
import torch
import torch.nn.functional as F



@pytest.fixture(autouse=True)
def float64_by_default():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def sigmoid(x):
    return 1.0 / (1.0 + torch.exp(-x))


def swish_grad(x):  # cf::swish_and_grad's derivative
    s = sigmoid(x)
    return s + x * s * (1.0 - s)


def mish_grad(x):  # cf::mish_and_grad_unit's derivative
    t = torch.tanh(torch.log1p(torch.exp(x)))
    return t + x * (1.0 - t * t) * sigmoid(x)


def hardtanh_grad(x):  # 94's gate in pre_with_grad (1 at a NaN, as CUDA's hardtanh_backward)
    return (x.abs() >= 1.0).logical_not().to(x.dtype)


def autograd_derivative(fn, x):
    x = x.clone().requires_grad_(True)
    fn(x).backward(torch.ones_like(x))
    return x.grad


EDGES = torch.tensor([-30.0, -20.0, -1.0, -0.5, 0.0, 0.5, 1.0, 20.0, 30.0], dtype=torch.float64)


@pytest.mark.parametrize("name,formula,fn", [
    ("swish", swish_grad, lambda x: x * torch.sigmoid(x)),
    ("mish", mish_grad, F.mish),
    ("hardtanh", hardtanh_grad, F.hardtanh),
])
def test_activation_derivatives(name, formula, fn):
    x = torch.cat([torch.randn(1000) * 4, EDGES])
    torch.testing.assert_close(formula(x), autograd_derivative(fn, x), rtol=1e-12, atol=1e-12)


# ---- the GroupNorm epilogue backward, as gn_chain_backward computes it ----

def gn_backward_formula(z, dy, chain, groups, p):
    rows, channels = z.shape
    cpg = channels // groups
    lin = p["lin_bias"]
    if chain == "swish_bias_gn":
        u = z + lin
        v, pre_grad = u * sigmoid(u) + p["extra_bias"], swish_grad(u)
    elif chain == "gn_swish_mul_swish":
        v, pre_grad = z + lin, torch.ones_like(z)
    else:
        u = z + lin + p["extra_bias"]
        h = u.clamp(-1.0, 1.0)
        v, pre_grad = h * torch.tanh(torch.log1p(torch.exp(h))), hardtanh_grad(u) * mish_grad(h)
    vg = v.view(rows, groups, cpg)
    mean = vg.mean(-1, keepdim=True)
    rstd = 1.0 / torch.sqrt(((vg - mean) ** 2).mean(-1, keepdim=True) + 1e-5)
    xhat = ((vg - mean) * rstd).view(rows, channels)
    w, b = p["gn_weight"], p["gn_bias"]
    yh = xhat * w + b
    mul_grad = torch.zeros_like(z)
    if chain == "gn_swish_mul_swish":  # ChainGNSwishMulSwish::post_backward
        mw = p["mul_weight"]
        a = yh * sigmoid(yh)
        dm = dy * swish_grad(a * mw)
        mul_grad = dm * a
        dyhat = dm * mw * swish_grad(yh)
    else:
        dyhat = dy
    dxh = (dyhat * w).view(rows, groups, cpg)
    xg = xhat.view(rows, groups, cpg)
    s1 = dxh.mean(-1, keepdim=True)
    s2 = (dxh * xg).mean(-1, keepdim=True)
    dv = (rstd * (dxh - s1 - xg * s2)).view(rows, channels)
    dz = dv * pre_grad
    grads = {"z": dz, "lin_bias": dz.sum(0), "gn_weight": (dyhat * xhat).sum(0),
             "gn_bias": dyhat.sum(0)}
    if chain == "swish_bias_gn":
        grads["extra_bias"] = dv.sum(0)
    if chain == "bias_hardtanh_mish_gn":
        grads["extra_bias"] = dz.sum(0)
    if chain == "gn_swish_mul_swish":
        grads["mul_weight"] = mul_grad.sum(0)
    return grads


def reference_forward(z, chain, groups, p):
    if chain == "swish_bias_gn":
        u = z + p["lin_bias"]
        v = torch.sigmoid(u) * u + p["extra_bias"]
        return F.group_norm(v, groups, p["gn_weight"], p["gn_bias"], 1e-5)
    if chain == "gn_swish_mul_swish":
        g = F.group_norm(z + p["lin_bias"], groups, p["gn_weight"], p["gn_bias"], 1e-5)
        m = g * torch.sigmoid(g) * p["mul_weight"]
        return m * torch.sigmoid(m)
    u = F.hardtanh(z + p["lin_bias"] + p["extra_bias"])
    return F.group_norm(F.mish(u), groups, p["gn_weight"], p["gn_bias"], 1e-5)


@pytest.mark.parametrize("chain", ["swish_bias_gn", "gn_swish_mul_swish", "bias_hardtanh_mish_gn"])
@pytest.mark.parametrize("channels,groups", [(24, 4), (24, 1), (24, 24), (35, 5)])
def test_group_norm_chain_backward(chain, channels, groups):
    torch.manual_seed(channels * groups)
    rows = 7
    z = torch.randn(rows, channels) * 2
    if chain == "bias_hardtanh_mish_gn":
        z[0, :3] = torch.tensor([1.0, -1.0, 0.0])  # hardtanh's edges, with zero biases below
    params = {k: torch.randn(channels) for k in
              ("lin_bias", "extra_bias", "gn_weight", "gn_bias", "mul_weight")}
    if chain == "bias_hardtanh_mish_gn":
        params["lin_bias"][:3] = 0.0
        params["extra_bias"][:3] = 0.0
    dy = torch.randn(rows, channels)
    leaves = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    zz = z.clone().requires_grad_(True)
    reference_forward(zz, chain, groups, leaves).backward(dy)
    mine = gn_backward_formula(z, dy, chain, groups, params)
    torch.testing.assert_close(mine["z"], zz.grad, rtol=1e-9, atol=1e-9)
    for name, grad in mine.items():
        if name != "z":
            torch.testing.assert_close(grad, leaves[name].grad, rtol=1e-9, atol=1e-9,
                                       msg=f"{chain}: {name}")


# ---- kEagerRounding (gn_chains.cuh): where the chains round to bf16 / fp16 ----

def _eager_rounding_recipe(chain, z, groups, bias, gn_weight, gn_bias, mul_weight, dtype):
    """The forward of a chain with kEagerRounding, transcribed from
    gn_chains.cuh: float32 arithmetic, rounded to ``dtype`` at the marked
    points (R), the GroupNorm in float32 as gn_chain_forward computes it."""
    f32 = lambda t: t.to(torch.float32)  # noqa: E731
    R = lambda t: t.to(dtype).to(torch.float32)  # noqa: E731

    def group_norm(v):
        rows, channels = v.shape
        g = v.view(rows, groups, channels // groups)
        mean = g.mean(-1, keepdim=True)
        var = ((g - mean) ** 2).mean(-1, keepdim=True)
        xhat = ((g - mean) / torch.sqrt(var + 1e-5)).view(rows, channels)
        return xhat * f32(gn_weight) + f32(gn_bias)

    z = f32(z)
    if chain == "swish_bias_gn":  # pre: R(R(z * R(sigmoid z)) + bias)
        return group_norm(R(R(z * R(torch.sigmoid(z))) + f32(bias))).to(dtype)
    if chain == "gn_swish_mul_swish":  # post: g = R(y^); a = R(g R(sig g)); m = R(a w)
        g = R(group_norm(z))
        m = R(R(g * R(torch.sigmoid(g))) * f32(mul_weight))
        return (m * R(torch.sigmoid(m))).to(dtype)
    return group_norm(R(F.mish(F.hardtanh(R(z + f32(bias)))))).to(dtype)  # pre: R(mish(R(z + b)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("chain", ["swish_bias_gn", "gn_swish_mul_swish", "bias_hardtanh_mish_gn"])
def test_eager_rounding_points_reproduce_half_precision_eager(chain, dtype):
    """The rounding points of kEagerRounding are eager's: the transcription
    matches the reference chain run in ``dtype`` by PyTorch (on the CPU
    here) but for a unit in the last place on rare elements."""
    gen = torch.Generator().manual_seed(0)
    rows, channels, groups = 257, 512, 16
    z = (torch.randn(rows, channels, generator=gen) * 2 + 1).to(dtype)
    vecs = [torch.randn(channels, generator=gen).to(dtype) for _ in range(4)]
    bias, gn_weight, gn_bias, mul_weight = vecs
    if chain == "swish_bias_gn":
        eager = F.group_norm(torch.sigmoid(z) * z + bias, groups, gn_weight, gn_bias)
    elif chain == "gn_swish_mul_swish":
        g = F.group_norm(z, groups, gn_weight, gn_bias)
        m = g * torch.sigmoid(g) * mul_weight
        eager = m * torch.sigmoid(m)
    else:
        eager = F.group_norm(F.mish(F.hardtanh(z + bias)), groups, gn_weight, gn_bias)
    ours = _eager_rounding_recipe(chain, z, groups, *vecs, dtype)
    diff = (ours.double() - eager.double()).abs()
    assert (diff > 0).double().mean().item() < 1e-3
    torch.testing.assert_close(ours, eager, atol=1e-2, rtol=1e-2)


def _unit_rounding_thresholds():
    """kUnitRoundingThreshold<T> as gn_chains.cuh defines it, by dtype."""
    from cupy_fused import _runtime

    src = (_runtime.kernel_dir() / "gn_chains.cuh").read_text()
    found = dict(re.findall(r"constexpr float kUnitRoundingThreshold<(\w+)> = ([^;]+);", src))
    assert {"bfloat16", "half"} <= found.keys(), found
    value = lambda literal: float(literal.strip().rstrip("fF"))  # noqa: E731  (a decimal literal)
    return {torch.bfloat16: value(found["bfloat16"]), torch.float16: value(found["half"])}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_unit_rounding_threshold_is_where_rounding_reaches_one(dtype):
    """94's hardtanh gate compares the unrounded float32 sum with
    kUnitRoundingThreshold<T> in place of rounding it to T and comparing
    with 1: the two agree on every float32 near +-1, and at NaN, +-inf and
    past T's range."""
    threshold = torch.tensor(_unit_rounding_thresholds()[dtype], dtype=torch.float32)
    lo, hi = (torch.tensor([0.99, 1.01], dtype=torch.float32).view(torch.int32)).tolist()
    near_one = torch.arange(lo, hi + 1, dtype=torch.int32).view(torch.float32)
    special = torch.tensor([0.0, 0.5, 2.0, 65504.0, 65520.0, 3.4e38, float("inf"), float("nan")],
                           dtype=torch.float32)
    s = torch.cat([near_one, -near_one, special, -special])
    rounded = s.to(dtype).to(torch.float32).abs() >= 1
    assert torch.equal(s.abs() >= threshold, rounded)
    assert rounded.any() and not rounded.all()


# ---- a non-finite upstream gradient: where NaN and +-inf land ----
# The kernels' backward with the rare paths a NaN or +-inf in dy calls for
# (the GroupNorm's input gradient in torch's uncentred form for a group whose
# sums are not finite, and the gamma terms for a non-finite dy; the swish
# derivatives as autograd decomposes x * sigmoid(x)), written out in torch
# float32, against autograd on the reference chains: the same NaN / +-inf
# masks in every gradient.  (float32 here: the masks, not the values.)

R, C, G = 6, 16, 4
D = C // G
sig = torch.sigmoid


def gn_hybrid(v, dyh, gam):
    """The GroupNorm backward with the rare path: dv, the gamma terms, x^."""
    vg = v.view(R, G, D)
    mu = vg.mean(-1, keepdim=True)
    rs = 1 / torch.sqrt(((vg - mu) ** 2).mean(-1, keepdim=True) + 1e-5)
    xh = (vg - mu) * rs
    dxh = (dyh * gam).view(R, G, D)
    s1 = dxh.mean(-1, keepdim=True)
    s2 = (dxh * xh).mean(-1, keepdim=True)
    centred = rs * (dxh - s1 - xh * s2)
    sdv = (dxh * vg).sum(-1, keepdim=True)
    sd = s1 * D
    c2 = (sd * mu - sdv) * rs * rs * rs / D
    c3 = -c2 * mu - sd * rs / D
    torch_dx = rs * dxh + c2 * vg + c3
    rare = ~(torch.isfinite(s1) & torch.isfinite(s2))
    dv = torch.where(rare, torch_dx, centred).view(R, C)
    dyg = dyh.view(R, G, D)
    gterm = torch.where(torch.isfinite(dyg), dyg * xh, (dyg * vg - dyg * mu) * rs).view(R, C)
    return dv, gterm, xh.view(R, C)


def ours(chain, z, lin, ext, gam, bet, mul, dy):
    if chain == 37:
        zb = z + lin
        s0 = sig(zb)
        v = zb * s0 + ext
        grad = s0 + zb * s0 * (1 - s0)
        dv, gterm, _ = gn_hybrid(v, dy, gam)
        dz = torch.where(torch.isfinite(dv), dv * grad, dv * s0 + ((dv * zb) * (1 - s0)) * s0)
        return {"z": dz, "lin": dz.sum(0), "ext": dv.sum(0), "gam": gterm.sum(0), "bet": dy.sum(0)}
    if chain == 88:
        v = z + lin
        vg = v.view(R, G, D)
        mu = vg.mean(-1, keepdim=True)
        rs = 1 / torch.sqrt(((vg - mu) ** 2).mean(-1, keepdim=True) + 1e-5)
        yh = ((vg - mu) * rs).view(R, C) * gam + bet
        a = yh * sig(yh)
        m = a * mul
        # fused (finite dy)
        da_f = sig(yh) + yh * sig(yh) * (1 - sig(yh))
        dmm = sig(m) + m * sig(m) * (1 - sig(m))
        dm_f = dy * dmm
        # decomposed (non-finite dy)
        dm_d = dy * sig(m) + ((dy * m) * (1 - sig(m))) * sig(m)
        fin = torch.isfinite(dy)
        dm = torch.where(fin, dm_f, dm_d)
        mulg = dm * a
        da = dm * mul
        dyh = torch.where(fin, dm_f * mul * da_f,
                          da * sig(yh) + ((da * yh) * (1 - sig(yh))) * sig(yh))
        dv, gterm, _ = gn_hybrid(v, dyh, gam)
        return {"z": dv, "lin": dv.sum(0), "gam": gterm.sum(0), "bet": dyh.sum(0), "mul": mulg.sum(0)}
    u = z + lin + ext
    h = u.clamp(-1, 1)
    t = torch.tanh(F.softplus(h))
    mg = t + h * sig(h) * (1 - t * t)
    hg = ((u > -1) & (u < 1)).float()
    grad = hg * mg
    v = h * t
    dv, gterm, _ = gn_hybrid(v, dy, gam)
    dz = torch.where(grad == 0, torch.zeros_like(dv), dv * grad)
    return {"z": dz, "lin": dz.sum(0), "ext": dz.sum(0), "gam": gterm.sum(0), "bet": dy.sum(0)}


def reference_chain(chain, z, lin, ext, gam, bet, mul, dy):
    named = dict(z=z, lin=lin, ext=ext, gam=gam, bet=bet, mul=mul)
    leaves = {k: t.clone().requires_grad_(True) for k, t in named.items()}
    L = leaves
    x = L["z"] + L["lin"]
    if chain == 37:
        x = torch.sigmoid(x) * x
        x = x + L["ext"]
        y = F.group_norm(x, G, L["gam"], L["bet"])
    elif chain == 88:
        x = F.group_norm(x, G, L["gam"], L["bet"])
        x = x * torch.sigmoid(x)
        x = x * L["mul"]
        y = x * torch.sigmoid(x)
    else:
        x = x + L["ext"]
        x = F.hardtanh(x)
        x = F.mish(x)
        y = F.group_norm(x, G, L["gam"], L["bet"])
    y.backward(dy)
    return {k: t.grad for k, t in L.items() if t.grad is not None}


@pytest.mark.parametrize("kind", ["inf", "-inf", "nan"])
@pytest.mark.parametrize("chain", [37, 88, 94])
def test_non_finite_upstream_gradient_masks(chain, kind):
    gen = torch.Generator().manual_seed(chain)
    value = {"inf": float("inf"), "-inf": -float("inf"), "nan": float("nan")}[kind]
    for _ in range(100):
        z = torch.randn(R, C, generator=gen, dtype=torch.float32) * 2
        lin, ext, gam, bet, mul = (torch.randn(C, generator=gen, dtype=torch.float32)
                                   for _ in range(5))
        dy = torch.randn(R, C, generator=gen, dtype=torch.float32)
        dy.view(-1)[torch.randint(0, R * C, (1,), generator=gen)] = value
        want = reference_chain(chain, z, lin, ext, gam, bet, mul, dy)
        got = ours(chain, z, lin, ext, gam, bet, mul, dy)
        for name, g in got.items():
            for where in (torch.isnan, torch.isposinf, torch.isneginf):
                assert torch.equal(where(g), where(want[name])), (chain, kind, name, where.__name__)
