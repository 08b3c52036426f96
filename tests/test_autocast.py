"""Mixed precision (GPU tier): under ``torch.autocast`` and with a half
model, every module and functional op computes what the reference computes
there: output dtype, gradient dtypes, error against a float64 run no worse
than 1.5x eager's, non-finite values where the reference puts them,
GradScaler's skipped step, and torch.compile."""
import contextlib
import copy
import importlib

import pytest
import torch
import torch.nn.functional as F

from cupy_fused import ops, reference
from cupy_fused.testing import (assert_non_finite_where, build_pair, compare, non_finite_masks, rel_error,
                                worse_than_eager)

pytestmark = pytest.mark.gpu
AMP = [torch.bfloat16, torch.float16]
PROBLEMS = sorted(reference.SMALL_PROBLEMS)


def _autocast(dtype):
    return torch.autocast("cuda", dtype=dtype)


@pytest.mark.parametrize("amp", AMP, ids=str)
@pytest.mark.parametrize("problem", PROBLEMS)
def test_models_under_autocast(problem, amp, device):
    """Float32 model and input, forward under autocast: output and gradient
    dtypes equal eager's (compare() raises otherwise), errors within 1.5x."""
    _, args, shape = reference.SMALL_PROBLEMS[problem]
    errors = compare(problem, args, shape, torch.float32, device, autocast=amp)
    bad = worse_than_eager(errors, amp)
    assert not bad, {n: errors[n] for n in bad}


@pytest.mark.parametrize("problem", PROBLEMS)
def test_output_dtype_under_autocast_is_the_references(problem, device):
    _, args, shape = reference.SMALL_PROBLEMS[problem]
    ref, ours = build_pair(problem, args, device, torch.float32)
    x = torch.rand(shape, device=device)
    with _autocast(torch.bfloat16), torch.no_grad():
        y_ref, y_ours = ref(x), ours(x)
    assert y_ours.dtype == y_ref.dtype == torch.float32


@pytest.mark.parametrize("variant", ["engine", "stride-2", "no-conv-bias"])
def test_problem_1_bias_in_the_autocast_dtype(variant, device):
    """A float32 problem 1 whose ``bias`` is bfloat16, under bfloat16
    autocast: the reference's convolution casts its own bias, so y is
    bfloat16; ours too, on the engine's route and on another convolution's
    (a stride of 2; no conv bias), every gradient in its parameter's dtype
    and, as y, within 1.5x eager's error against a float64 run."""
    _, args, shape = reference.SMALL_PROBLEMS[1]
    ref, ours = build_pair(1, args, device, torch.float32)
    for m in (ref, ours):
        m.bias = torch.nn.Parameter(m.bias.detach().bfloat16())
        if variant == "stride-2":
            m.conv.stride = (2, 2)
        if variant == "no-conv-bias":
            m.conv.bias = None
    ref64 = copy.deepcopy(ref).double()
    x = torch.rand(shape, device=device)
    g = torch.randn(ref(x).shape, device=device)
    outs = {}
    for name, model, xin in [("ours", ours, x), ("eager", ref, x), ("truth", ref64, x.double())]:
        xin = xin.clone().requires_grad_(True)
        with _autocast(torch.bfloat16) if name != "truth" else contextlib.nullcontext():
            y = model(xin)
        y.backward(g.to(y.dtype))
        outs[name] = [("y", y.detach()), ("x", xin.grad)] + [(n, p.grad) for n, p in
                                                           model.named_parameters()]
    assert outs["ours"][0][1].dtype == outs["eager"][0][1].dtype == torch.bfloat16
    for (n, a), (_, e), (_, t) in zip(outs["ours"], outs["eager"], outs["truth"]):
        assert a.dtype == e.dtype, n
        assert rel_error(a, t) <= 1.5 * rel_error(e, t) + 1e-6, (n, rel_error(a, t), rel_error(e, t))


@pytest.mark.parametrize("amp", AMP, ids=str)
@pytest.mark.parametrize("problem", PROBLEMS)
def test_half_model_under_autocast(problem, amp, device):
    """A model already in the autocast dtype, fed a float32 input: output
    and gradient dtypes equal eager's, errors within 1.5x eager's."""
    _, args, shape = reference.SMALL_PROBLEMS[problem]
    errors = compare(problem, args, shape, amp, device, autocast=amp, input_dtype=torch.float32)
    bad = worse_than_eager(errors, amp)
    assert not bad, {n: errors[n] for n in bad}


def _grad_scaler_step(model, x, g, scale):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.zero_grad(set_to_none=True)
    scaler = torch.amp.GradScaler("cuda", init_scale=scale)
    before = [p.detach().clone() for p in model.parameters()]
    with _autocast(torch.float16):
        y = model(x)
    scaler.scale((y.float() * g).sum()).backward()
    scaler.step(opt)
    scaler.update()
    unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    return unchanged, scaler.get_scale()


@pytest.mark.parametrize("problem", PROBLEMS)
def test_grad_scaler_skips_an_overflowing_step_as_the_reference(problem, device):
    _, args, shape = reference.SMALL_PROBLEMS[problem]
    ref, ours = build_pair(problem, args, device, torch.float32)
    x = torch.rand(shape, device=device)
    with torch.no_grad(), _autocast(torch.float16):
        g = torch.randn_like(ref(x).float())
    # 2^40 makes the float16 gradients overflow; 1.0 does not.
    for scale, skipped in ((2.0**40, True), (1.0, False)):
        got = [_grad_scaler_step(m, x, g, scale) for m in (ref, ours)]
        assert got[0] == got[1] == (skipped, scale * (0.5 if skipped else 1.0)), got


MODES = {"fp32": (torch.float32, None), "bf16": (torch.bfloat16, None),
         "amp-bf16": (torch.float32, torch.bfloat16)}


@pytest.mark.parametrize("where", ["input", "upstream-gradient"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=str)
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("problem", PROBLEMS)
def test_non_finite_value_lands_where_the_references_does(problem, mode, value, where, device):
    """One non-finite element of the input x, or of the upstream gradient g:
    the NaN / +inf / -inf masks of the output and of every gradient equal
    the reference's."""
    dtype, amp = MODES[mode]
    _, args, shape = reference.SMALL_PROBLEMS[problem]
    ref, ours = build_pair(problem, args, device, dtype)
    gen = torch.Generator(device="cpu").manual_seed(problem)
    x = torch.rand(shape, generator=gen).to(device=device, dtype=dtype)
    if where == "input":
        x.view(-1)[x.numel() // 3] = value
    with torch.no_grad(), (_autocast(amp) if amp else torch.autocast("cuda", enabled=False)):
        g = torch.randn(ref(x).shape, generator=gen).to(device)
    if where == "upstream-gradient":
        g.view(-1)[g.numel() // 3] = value
    want = non_finite_masks(ref, x, g, amp)
    got = non_finite_masks(ours, x, g, amp)
    for name, masks in want.items():
        for kind, a, b in zip(("nan", "+inf", "-inf"), masks, got[name]):
            assert torch.equal(a, b), (name, kind, a.sum().item(), b.sum().item())


@pytest.mark.parametrize("value", [float("inf"), float("-inf")], ids=str)
@pytest.mark.parametrize("problem", [76, 94])
def test_ieee_precision_keeps_infinities(problem, value, device):
    """precision="ieee" (cuBLAS SGEMM) keeps infinities too."""
    _, args, shape = reference.SMALL_PROBLEMS[problem]
    ref, ours = build_pair(problem, args, device, torch.float32)
    ours.precision = "ieee"
    x = torch.rand(shape, device=device)
    x.view(-1)[x.numel() // 3] = value
    g = torch.randn(ref(x).shape, device=device)
    want, got = non_finite_masks(ref, x, g, None), non_finite_masks(ours, x, g, None)
    for name, masks in want.items():
        assert all(torch.equal(a, b) for a, b in zip(masks, got[name])), name


@pytest.mark.parametrize("model_dtype, amp", [(torch.float32, torch.bfloat16),
                                               (torch.bfloat16, torch.float32)], ids=str)
@pytest.mark.parametrize("problem", PROBLEMS)
def test_compiled_under_autocast(problem, model_dtype, amp, device):
    """torch.compile(fullgraph=True) of a module under autocast (also to
    float32, a bfloat16 model): the output, x's gradient and every
    parameter's gradient bit for bit those of the same module run eagerly
    under the same autocast, in the same dtypes: the compiled graph runs the
    same custom ops on the same routes and values, and adds only casts
    around them, which round as eager's do."""
    _, args, shape = reference.SMALL_PROBLEMS[problem]
    _, ours = build_pair(problem, args, device, model_dtype)
    twin = copy.deepcopy(ours)
    torch._dynamo.reset()  # (no earlier test's graphs count against the recompile limit)
    compiled = torch.compile(twin, fullgraph=True)
    gen = torch.Generator().manual_seed(problem)
    x = torch.rand(shape, generator=gen).to(device)
    g = None
    results = []
    for module, fn in ((ours, ours), (twin, compiled)):
        xi = x.clone().requires_grad_(True)
        with _autocast(amp):
            y = fn(xi)
        if g is None:  # (not ones: GroupNorm's dx would vanish)
            g = torch.randn(y.shape, generator=gen).to(device, y.dtype)
        y.backward(g)
        results.append([("y", y.detach()), ("x", xi.grad)]
                       + [(name, p.grad) for name, p in module.named_parameters()])
    eager, got = results
    assert eager[0][1].dtype == torch.float32 and eager[1][1].dtype == torch.float32
    assert [name for name, _ in got] == [name for name, _ in eager]
    for (name, a), (_, b) in zip(eager, got):
        assert a is not None and b is not None, name
        assert b.dtype == a.dtype and torch.equal(a, b), (name, rel_error(b, a))
    assert all(p.grad.dtype == model_dtype for p in twin.parameters())


@pytest.mark.parametrize("value", [None, float("nan"), float("inf"), float("-inf")], ids=str)
@pytest.mark.parametrize("amp", AMP, ids=str)
@pytest.mark.parametrize("problem", PROBLEMS)
def test_forward_without_autograd_under_autocast(problem, amp, value, device):
    """Inference under autocast (no autograd): the reference's output dtype,
    error within 1.5x of eager's against float64, and a non-finite input
    element landing where the reference puts it.  (At these small shapes
    the products take the weight's cast and cuBLAS; the float32-weight
    route's own test is the next one.)"""
    _, args, shape = reference.SMALL_PROBLEMS[problem]
    ref, ours = build_pair(problem, args, device, torch.float32)
    gen = torch.Generator(device="cpu").manual_seed(problem + 1)
    x = torch.rand(shape, generator=gen).to(device)
    if value is not None:
        x.view(-1)[x.numel() // 3] = value
    with torch.no_grad():
        truth = copy.deepcopy(ref).double()(x.double())
        with _autocast(amp):
            want, got = ref(x), ours(x)
    assert got.dtype == want.dtype
    if value is None:
        errors = {"out": (rel_error(got, truth), rel_error(want, truth))}
        assert not worse_than_eager(errors, amp), errors
    assert_non_finite_where(got, want)


@pytest.mark.parametrize("amp", AMP, ids=str)
def test_autocast_inference_reads_the_float32_weight_up_to_its_row_limit(amp, device, monkeypatch):
    """The route of an autocast product without autograd: on Hopper,
    CONVERT_MAX_ROWS rows of x in enough tiles take
    gemm._linear_float32_weight (its launch, _run_float32_weight, after the
    route's check of the operands); more rows, too few tiles, the same product
    recorded by autograd, or another GPU take the weight's cast and cuBLAS.
    Each gives F.linear's result within its error."""
    from cupy_fused.ops import gemm

    linear_module = importlib.import_module("cupy_fused.ops.linear")  # (ops.linear: the function)

    calls = []
    real = linear_module._run_float32_weight
    monkeypatch.setattr(linear_module, "_run_float32_weight",
                        lambda *a: calls.append(a[0].shape[0]) or real(*a))
    limit, sms = gemm.CONVERT_MAX_ROWS, gemm.sm_count(device.index)
    hopper = gemm.has_wgmma(device.index)
    # A weight of just enough 128-row tiles, with x of 4 256-row tiles; then
    # one tile fewer.
    n_enough = 128 * -(-sms // 8)
    for rows, n, grad, taken in ((limit, n_enough, False, hopper), (limit + 1, n_enough, False, False),
                                 (limit, n_enough - 128, False, False), (limit, n_enough, True, False)):
        calls.clear()
        w, b = _rand(n, 64, seed=1) * 0.2, _rand(n, seed=2)
        x = _rand(rows, 64, seed=rows).requires_grad_(grad)
        with torch.set_grad_enabled(grad), _autocast(amp):
            got, want = ops.linear(x, w, b, "relu"), F.relu(F.linear(x, w, b))
        assert calls == ([rows] if taken else []), (rows, n, grad)
        assert got.dtype == want.dtype == amp
        truth = F.relu(F.linear(x.double(), w.double(), b.double()))
        errors = {"out": (rel_error(got, truth), rel_error(want, truth))}
        assert not worse_than_eager(errors, amp), (rows, errors)


# ---------------------------------------------------------------- functional ops

def _op_errors(our_fn, ref_fn, inputs, amp):
    """Runs our op and the torch reference under autocast ``amp`` and the
    reference in float64; returns {name: (our error, eager error)} over the
    output and the gradient of every input, checking dtypes match eager's."""
    def run(fn, tensors, ctx):
        leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
        with ctx:
            y = fn(*leaves)
        g = torch.randn(y.shape, generator=torch.Generator().manual_seed(7)).to(y.device, y.dtype)
        y.backward(g)
        return y.detach(), [t.grad for t in leaves]

    truth = run(ref_fn, [t.double() for t in inputs], torch.autocast("cuda", enabled=False))
    eager = run(ref_fn, inputs, _autocast(amp))
    ours = run(our_fn, inputs, _autocast(amp))
    assert ours[0].dtype == eager[0].dtype
    assert [g.dtype for g in ours[1]] == [g.dtype for g in eager[1]]
    errors = {"out": (rel_error(ours[0], truth[0]), rel_error(eager[0], truth[0]))}
    for i, (a, b, t) in enumerate(zip(ours[1], eager[1], truth[1])):
        errors[f"grad{i}"] = (rel_error(a, t), rel_error(b, t))
    return errors


def _rand(*shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to("cuda", dtype)


@pytest.mark.parametrize("amp", AMP, ids=str)
def test_linear_under_autocast(amp, device):
    x, w, b = _rand(33, 40), _rand(24, 40, seed=1) * 0.2, _rand(24, seed=2)
    errors = _op_errors(lambda x, w, b: ops.linear(x, w, b, "relu"),
                        lambda x, w, b: F.relu(F.linear(x, w, b)), [x, w, b], amp)
    assert not worse_than_eager(errors, amp), errors


@pytest.mark.parametrize("z_dtype", AMP + [torch.float32], ids=str)
@pytest.mark.parametrize("amp", AMP, ids=str)
def test_bias_relu_promotes_under_autocast(z_dtype, amp, device):
    z, b1, b2 = _rand(2, 6, 5, 7, dtype=z_dtype), _rand(6, 1, 1, seed=1), _rand(6, 1, 1, seed=2)
    errors = _op_errors(ops.bias_relu, lambda z, b1, b2: torch.relu(z + b1) + b2, [z, b1, b2], amp)
    assert not worse_than_eager(errors, amp), errors


@pytest.mark.parametrize("amp", AMP, ids=str)
def test_a_0_dim_bias_changes_no_float_dtype(amp, device):
    """torch's promotion lets a 0-dim tensor change no dimensioned tensor's
    float dtype (a float16 z plus a 0-dim float32 bias is float16): so do
    bias_relu and conv_bias_relu, and problems 76 and 1 built with
    ``bias_shape=()``, as float32 models under autocast and as half models
    with a float32 bias (problem 1's other convolutions too), and 37, 88 and
    94 as half models with a float32 0-dim bias or multiply_weight; dtypes
    as eager's, errors within 1.5x."""
    scalar = _rand(1, seed=1).reshape(())  # float32
    z, b2 = _rand(2, 6, 5, 7, dtype=amp), _rand(6, 1, 1, seed=2, dtype=amp)
    errors = _op_errors(ops.bias_relu, lambda z, b, b2: torch.relu(z + b) + b2, [z, scalar, b2], amp)
    assert not worse_than_eager(errors, amp), errors
    x, w, cb = _rand(2, 3, 9, 8, dtype=amp), _rand(6, 3, 3, 3, seed=3, dtype=amp), _rand(6, seed=4)
    errors = _op_errors(ops.conv_bias_relu, lambda x, w, cb, b: torch.relu(F.conv2d(x, w, cb)) + b,
                        [x, w, cb.to(amp), scalar], amp)
    assert not worse_than_eager(errors, amp), errors

    def float32_scalar_bias(model):
        model.bias = torch.nn.Parameter(model.bias.detach().float())

    def strided(model):  # problem 1's other convolutions: cuDNN, then bias_relu
        model.conv.stride = (2, 2)

    for problem, shape_of, mutate in ((76, None, None), (1, None, None), (1, None, strided),
                                      (76, lambda s: (2,) + s, None)):  # (76's rows of a 3-D x)
        _, args, shape = reference.SMALL_PROBLEMS[problem]
        args, shape = args[:-1] + ((),), shape if shape_of is None else shape_of(shape)
        errors = compare(problem, args, shape, torch.float32, device, autocast=amp, mutate=mutate)
        assert not worse_than_eager(errors, amp), (problem, errors)
        errors = compare(problem, args, shape, amp, device,
                         mutate=lambda m: (float32_scalar_bias(m), mutate and mutate(m)))
        assert not worse_than_eager(errors, amp), (problem, errors)

    def float32_scalar(model):  # (the GroupNorm problems' one parameter of a settable shape)
        name = "multiply_weight" if hasattr(model, "multiply_weight") else "bias"
        setattr(model, name, torch.nn.Parameter(getattr(model, name).detach().float()))

    for problem, where in ((37, 3), (88, 3), (94, 2)):  # half models: the chain in their dtype
        _, args, shape = reference.SMALL_PROBLEMS[problem]
        args = args[:where] + ((),) + args[where + 1:]
        errors = compare(problem, args, shape, amp, device, mutate=float32_scalar)
        assert not worse_than_eager(errors, amp), (problem, errors)


def _gn_reference(chain, groups):
    def ref(z, lin_bias, extra_or_mul, gn_weight, gn_bias):
        z = z if lin_bias is None else z + lin_bias
        if chain == "swish_bias_gn":
            return F.group_norm(F.silu(z) + extra_or_mul, groups, gn_weight, gn_bias)
        if chain == "gn_swish_mul_swish":
            return F.silu(F.silu(F.group_norm(z, groups, gn_weight, gn_bias)) * extra_or_mul)
        return F.group_norm(F.mish(F.hardtanh(z + extra_or_mul)), groups, gn_weight, gn_bias)
    return ref


def _gn_ours(chain, groups):
    def ours(z, lin_bias, extra_or_mul, gn_weight, gn_bias):
        kw = ({"mul_weight": extra_or_mul} if chain == "gn_swish_mul_swish"
              else {"extra_bias": extra_or_mul})
        return ops.gn_chain(z, chain, groups, lin_bias=lin_bias, gn_weight=gn_weight,
                            gn_bias=gn_bias, **kw)
    return ours


@pytest.mark.parametrize("z_dtype", AMP + [torch.float32], ids=str)
@pytest.mark.parametrize("chain", sorted(ops.CHAINS))
def test_gn_chain_runs_in_float32_under_autocast(chain, z_dtype, device):
    """As autocast runs group_norm: float32 result from a half z and float32
    vectors, z's gradient in z's dtype."""
    groups = 4
    inputs = [_rand(9, 32, dtype=z_dtype)] + [_rand(32, seed=s) for s in range(1, 5)]
    errors = _op_errors(_gn_ours(chain, groups), _gn_reference(chain, groups), inputs,
                        torch.bfloat16)
    assert not worse_than_eager(errors, torch.bfloat16), errors


@pytest.mark.parametrize("amp", AMP, ids=str)
@pytest.mark.parametrize("chain", sorted(ops.CHAINS))
def test_linear_gn_chain_under_autocast(chain, amp, device):
    groups = 4
    inputs = [_rand(9, 24), _rand(32, 24, seed=9) * 0.2] + [_rand(32, seed=s) for s in range(1, 5)]
    ref_chain = _gn_reference(chain, groups)

    def ref(x, w, lin_bias, v, gw, gb):  # nn.Linear: the bias in the GEMM, in the autocast dtype
        return ref_chain(F.linear(x, w, lin_bias), None, v, gw, gb)

    def ours(x, w, lin_bias, v, gw, gb):
        kw = {"mul_weight": v} if chain == "gn_swish_mul_swish" else {"extra_bias": v}
        return ops.linear_gn_chain(x, w, lin_bias, chain, groups, gn_weight=gw, gn_bias=gb, **kw)

    errors = _op_errors(ours, ref, inputs, amp)
    assert not worse_than_eager(errors, amp), errors


# ---------------------------------------------------------------- autocast to float32
#
# torch.autocast("cuda", dtype=torch.float32) runs linear and conv2d in
# float32 (float16 and bfloat16 operands cast up) and group_norm in float32:
# a half model, or a half input, gives float32 results there.

@pytest.mark.parametrize("model_dtype", AMP, ids=str)
@pytest.mark.parametrize("problem", PROBLEMS)
def test_half_model_under_float32_autocast(problem, model_dtype, device):
    """A half model and input: output and gradient dtypes equal eager's
    (compare() raises otherwise), errors within 1.5x eager's."""
    _, args, shape = reference.SMALL_PROBLEMS[problem]
    errors = compare(problem, args, shape, model_dtype, device, autocast=torch.float32)
    bad = worse_than_eager(errors, torch.float32)
    assert not bad, {n: errors[n] for n in bad}


@pytest.mark.parametrize("problem", PROBLEMS)
def test_float32_model_with_a_half_input_under_float32_autocast(problem, device):
    _, args, shape = reference.SMALL_PROBLEMS[problem]
    errors = compare(problem, args, shape, torch.float32, device, autocast=torch.float32,
                     input_dtype=torch.bfloat16)
    bad = worse_than_eager(errors, torch.float32)
    assert not bad, {n: errors[n] for n in bad}


@pytest.mark.parametrize("op", ["linear", "gn_chain", "linear_gn_chain", "conv_bias_relu"])
def test_ops_under_float32_autocast(op, device):
    """Each op on bfloat16 tensors under autocast to float32: the
    reference's float32 result, gradients in bfloat16, errors within 1.5x."""
    bf = torch.bfloat16
    if op == "linear":
        inputs = [_rand(33, 40, dtype=bf), _rand(24, 40, dtype=bf, seed=1), _rand(24, dtype=bf, seed=2)]
        ours, ref = (lambda x, w, b: ops.linear(x, w, b, "relu"),
                     lambda x, w, b: F.relu(F.linear(x, w, b)))
    elif op == "gn_chain":
        inputs = [_rand(9, 32, dtype=bf)] + [_rand(32, dtype=bf, seed=s) for s in range(1, 5)]
        ours, ref = _gn_ours("swish_bias_gn", 4), _gn_reference("swish_bias_gn", 4)
    elif op == "linear_gn_chain":
        inputs = ([_rand(9, 24, dtype=bf), _rand(32, 24, dtype=bf, seed=9)]
                  + [_rand(32, dtype=bf, seed=s) for s in range(1, 5)])

        def ours(x, w, lin_bias, v, gw, gb):
            return ops.linear_gn_chain(x, w, lin_bias, "bias_hardtanh_mish_gn", 4, extra_bias=v,
                                       gn_weight=gw, gn_bias=gb)

        def ref(x, w, lin_bias, v, gw, gb):
            return _gn_reference("bias_hardtanh_mish_gn", 4)(F.linear(x, w, lin_bias), None, v, gw, gb)
    else:
        inputs = [_rand(2, 5, 9, 8, dtype=bf), _rand(6, 5, 3, 3, dtype=bf, seed=1),
                  _rand(6, dtype=bf, seed=2), _rand(6, 1, 1, dtype=bf, seed=3)]
        ours, ref = ops.conv_bias_relu, lambda x, w, cb, b: F.relu(F.conv2d(x, w, cb)) + b
    errors = _op_errors(ours, ref, inputs, torch.float32)  # (asserts the dtypes equal eager's)
    assert not worse_than_eager(errors, torch.float32), errors


def test_autocast_to_another_dtype_is_refused(device):
    x, w = _rand(4, 8), _rand(6, 8, seed=1)
    with _autocast(torch.float64):
        with pytest.raises(TypeError, match="float16, bfloat16 or float32, got autocast to torch.float64"):
            ops.linear(x, w)


# ---------------------------------------------------------------- the autocast linear op
#
# ops.linear / linear_gn_chain / GemmAddRelu under autocast run one node
# (cupy_fused::linear_autocast) whose backward writes x's and W's gradients
# in their own dtypes straight from cuBLAS (aten::mm.dtype, float32 output
# from float16 / bfloat16 operands), where autograd's casts would round them
# to the autocast dtype and cast them back.

@pytest.mark.parametrize("amp", AMP, ids=str)
def test_mm_to_writes_float32_from_cublas(amp, device):
    from cupy_fused.ops.linear import MM_OUT_DTYPE, _mm_to

    assert MM_OUT_DTYPE, "this torch has no aten::mm.dtype: the backward casts (fallback)"
    a, b = _rand(130, 300, dtype=amp), _rand(300, 70, dtype=amp, seed=1)
    out = _mm_to(a, b, torch.float32)
    assert out.dtype == torch.float32
    assert torch.equal(out, torch.ops.aten.mm.dtype(a, b, torch.float32))
    truth = a.double() @ b.double()
    assert rel_error(out, truth) <= rel_error((a @ b).float(), truth)  # no rounding to amp


def _no_cast_nodes(y):
    seen, stack = set(), [y.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        assert type(node).__name__ != "ToCopyBackward0", "a cast node in the backward graph"
        stack.extend(n for n, _ in node.next_functions)


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("amp", AMP, ids=str)
def test_autocast_linear_is_f_linears_product_with_own_dtype_gradients(amp, with_bias, device):
    """Float32 x, W, bias: F.linear's output under autocast bit for bit
    (the same cuBLAS call on the same casts); gradients float32 with no cast
    node, errors within 1.5x eager's against float64."""
    x, w, b = _rand(256, 512), _rand(128, 512, seed=1) * 0.05, _rand(128, seed=2)
    inputs = [x, w, b] if with_bias else [x, w]
    with _autocast(amp), torch.no_grad():
        assert torch.equal(ops.linear(*inputs), F.linear(*inputs))
    leaves = [t.clone().requires_grad_(True) for t in inputs]
    with _autocast(amp):
        y = ops.linear(*leaves)
    assert y.dtype == amp
    _no_cast_nodes(y)
    y.backward(torch.ones_like(y))
    assert all(t.grad.dtype == torch.float32 for t in leaves)
    errors = _op_errors(lambda *t: ops.linear(*t), F.linear, inputs, amp)
    assert not worse_than_eager(errors, amp), errors


@pytest.mark.parametrize("amp", AMP, ids=str)
def test_autocast_linear_compiles(amp, device):
    x, w, b = _rand(64, 96), _rand(48, 96, seed=1) * 0.2, _rand(48, seed=2)
    g = _rand(64, 48, dtype=amp, seed=3)
    results = []
    torch._dynamo.reset()
    compiled = torch.compile(lambda *t: ops.linear(*t), fullgraph=True)
    for fn in (lambda *t: ops.linear(*t), compiled):
        leaves = [t.clone().requires_grad_(True) for t in (x, w, b)]
        with _autocast(amp):
            y = fn(*leaves)
        y.backward(g)
        results.append((y.detach(), [t.grad for t in leaves]))
    (y0, g0), (y1, g1) = results
    assert y1.dtype == y0.dtype == amp and torch.equal(y1, y0)
    for a, c in zip(g0, g1):
        assert c.dtype == a.dtype == torch.float32 and torch.equal(a, c)


@pytest.mark.parametrize("problem", [p for p in PROBLEMS if p != 1])
def test_gemm_models_under_autocast_have_no_cast_nodes(problem, device):
    """Float32 models: the GEMM's node takes x and W themselves (their
    casts are its own business), the chains' vectors are float32 already."""
    _, args, shape = reference.SMALL_PROBLEMS[problem]
    _, ours = build_pair(problem, args, device, torch.float32)
    x = torch.rand(shape, device=device, requires_grad=True)
    with _autocast(torch.bfloat16):
        y = ours(x)
    _no_cast_nodes(y)
    y.backward(torch.ones_like(y))
    assert x.grad.dtype == torch.float32
    assert all(p.grad.dtype == torch.float32 for p in ours.parameters())


def test_problem_76_training_peak_under_autocast_is_at_most_the_references(device):
    """The backward writes float32 gradients once, where the reference holds
    each in bfloat16 and float32 at once."""
    ref, ours = build_pair(76, (1024, 2048, (2048,)), device, torch.float32)
    x = torch.rand(512, 1024, device=device)
    g = torch.randn(512, 2048, device=device)
    peaks = []
    for model in (ref, ours):
        for step in range(2):  # the first allocates what persists (cuBLAS workspaces)
            for p in model.parameters():
                p.grad = None
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            with _autocast(torch.bfloat16):
                y = model(x)
            y.backward(g)
            del y
            torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated(device) - base)
    assert peaks[1] <= peaks[0], peaks
