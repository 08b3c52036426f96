"""Drop-in contract of the fused modules (CPU tier): constructor, parameter
names and seeded initial values identical to the reference."""
import copy

import pytest
import torch

from cupy_fused import models, reference


def test_state_dict_and_seeded_init_match_reference():
    """Same parameter names, shapes and seeded values both ways."""
    for problem, (ref_cls, args, _) in reference.SMALL_PROBLEMS.items():
        torch.manual_seed(123)
        ref = ref_cls(*args)
        torch.manual_seed(123)
        ours = models.MODELS[problem](*args)
        rs, os_ = ref.state_dict(), ours.state_dict()
        assert list(rs) == list(os_)
        for k in rs:
            assert torch.equal(rs[k], os_[k]), (problem, k)
        ref2 = ref_cls(*args)
        ref2.load_state_dict(ours.state_dict())
        ours.load_state_dict(ref.state_dict())
        assert all(p.requires_grad for p in ours.parameters())


# The submodules each fused forward reads but never calls.
BYPASSED = {1: ["conv"], 37: ["matmul", "group_norm"], 76: ["gemm"],
            88: ["gemm", "group_norm"], 94: ["gemm", "groupnorm", "hardtanh", "mish"]}


def _model_and_input(problem):
    _, args, shape = reference.SMALL_PROBLEMS[problem]
    return models.MODELS[problem](*args), torch.rand(shape)


@pytest.mark.parametrize("problem", sorted(BYPASSED))
def test_hooks_on_a_bypassed_submodule_are_refused(problem):
    for name in BYPASSED[problem]:
        for register in ("register_forward_hook", "register_forward_pre_hook",
                         "register_full_backward_hook"):
            model, x = _model_and_input(problem)
            getattr(getattr(model, name), register)(lambda *a: None)
            with pytest.raises(RuntimeError, match=f"{name} has hooks registered"):
                model(x)


@pytest.mark.parametrize("problem", sorted(BYPASSED))
def test_a_replaced_submodule_is_refused(problem):
    for name in BYPASSED[problem]:
        model, x = _model_and_input(problem)
        plain = getattr(model, name)

        class Wrapped(type(plain)):  # e.g. LoRA: a subclass with its own forward
            pass

        wrapped = copy.deepcopy(plain)
        wrapped.__class__ = Wrapped
        setattr(model, name, wrapped)
        with pytest.raises(RuntimeError, match=f"{name} has been replaced by a Wrapped"):
            model(x)


@pytest.mark.parametrize("problem", sorted(BYPASSED))
def test_a_parametrized_submodule_passes_the_check(problem):
    """weight_norm (torch's parametrize) gives a submodule a class derived
    from its own: the fused forward reads the parametrized weight, so the
    check lets it by (the input check speaks next, a CPU tensor here);
    with a hook, or parametrized over a class of the user's, it is still
    refused."""
    from torch.nn.utils.parametrizations import weight_norm

    for name in BYPASSED[problem]:
        if not hasattr(getattr(_model_and_input(problem)[0], name), "weight"):
            continue  # (hardtanh, mish)
        model, x = _model_and_input(problem)
        weight_norm(getattr(model, name))
        with pytest.raises(ValueError, match="x must be on a CUDA device"):
            model(x)
        getattr(model, name).register_forward_hook(lambda *a: None)
        with pytest.raises(RuntimeError, match=f"{name} has hooks registered"):
            model(x)
        model, x = _model_and_input(problem)
        plain = getattr(model, name)

        class Wrapped(type(plain)):
            pass

        plain.__class__ = Wrapped
        weight_norm(plain)
        with pytest.raises(RuntimeError, match=f"{name} has been replaced by a ParametrizedWrapped"):
            model(x)


def test_hardtanh_bounds_other_than_the_chains_are_refused():
    model, x = _model_and_input(94)
    model.hardtanh.max_val = 2.0
    with pytest.raises(ValueError, match=r"hardtanh must clamp to \[-1, 1\]"):
        model(x)


@pytest.mark.parametrize("problem", sorted(BYPASSED))
def test_plain_submodules_pass_the_check(problem):
    """Past the submodule checks, the input check is the one that speaks
    (a CPU tensor here)."""
    model, x = _model_and_input(problem)
    with pytest.raises(ValueError, match="x must be on a CUDA device"):
        model(x)


# What print(model) shows on each module's first line: the constructor's
# sizes and shapes, then the precision and eager_rounding settings.
REPRS = {
    1: "in_channels=8, out_channels=16, kernel_size=(3, 3), bias_shape=(16, 1, 1)",
    37: "in_features=64, out_features=256, num_groups=8, bias_shape=(256,), precision=None, "
        "eager_rounding=False",
    76: "in_features=64, out_features=256, bias_shape=(256,), precision=None",
    88: "in_features=64, out_features=256, num_groups=16, multiply_weight_shape=(256,), "
        "precision=None, eager_rounding=False",
    94: "in_features=64, out_features=256, bias_shape=(256,), num_groups=16, precision=None, "
        "eager_rounding=False",
}


@pytest.mark.parametrize("problem", sorted(REPRS))
def test_print_shows_the_sizes_and_settings(problem):
    model, _ = _model_and_input(problem)
    assert model.extra_repr() == REPRS[problem]
    assert str(model).splitlines()[1].strip() == REPRS[problem]
    if problem != 1:
        _, args, _ = reference.SMALL_PROBLEMS[problem]
        kwargs = {"precision": "tf32"}
        if problem != 76:
            kwargs["eager_rounding"] = True
        text = repr(models.MODELS[problem](*args, **kwargs))
        assert "precision='tf32'" in text
        assert ("eager_rounding=True" in text) is (problem != 76)
        model.precision = "ieee"  # read when printed, as when run
        assert "precision='ieee'" in repr(model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gemm_add_relu_is_ops_linear(dtype, past_device_check):
    """Problem 76's module through ops.linear's internal entry point gives
    what the public op gives: output, gradients, one autograd node (here
    on CPU tensors at precision "ieee", the cuBLAS route's torch ops)."""
    from cupy_fused import ops

    torch.manual_seed(2)
    model = models.GemmAddRelu(24, 40, (40,), precision="ieee").to(dtype)
    x = torch.rand(7, 24, dtype=dtype) - 0.5
    dy = torch.randn(7, 40).to(dtype)
    leaves = [x.clone().requires_grad_(True)]
    y = model(leaves[0])
    y.backward(dy)
    ref = [t.detach().clone().requires_grad_(True)
           for t in (x, model.gemm.weight, model.bias)]
    y_ref = ops.linear(*ref, activation="relu", precision="ieee")
    y_ref.backward(dy)
    assert torch.equal(y, y_ref) and type(y.grad_fn) is type(y_ref.grad_fn)
    for ours, theirs in zip((leaves[0], model.gemm.weight, model.bias), ref):
        assert torch.equal(ours.grad, theirs.grad)


@pytest.mark.parametrize("problem, args, shape", [
    (1, (3, 6, 3, (6,)), (2, 3, 8, 8)),        # (C,): the reference adds it along the width
    (1, (3, 6, 3, (1, 1, 6, 1)), (2, 3, 8, 8)),  # along the height
    (76, (8, 16, (16, 1)), (16, 8)),           # along the batch
    (37, (8, 16, 4, (2, 8)), (4, 8)),
    (88, (8, 16, 4, (16, 1)), (16, 8)),
    (94, (8, 16, (16, 16), 4), (16, 8)),
])
def test_parameters_broadcast_other_than_per_channel_are_refused(problem, args, shape,
                                                                past_device_check):
    """The reference broadcasts these against its output along another dim
    than the channels; the fused kernels take one value per channel, so the
    module refuses them, before anything runs, rather than compute another
    function."""
    model = models.MODELS[problem](*args)
    with pytest.raises(ValueError, match="other than per channel"):
        model(torch.rand(shape))


@pytest.mark.parametrize("problem, args", [(37, (8, 16, 4, (1, 1, 16))), (94, (8, 16, (1, 1, 16), 4))])
def test_leading_ones_before_a_group_norm_are_refused(problem, args, past_device_check):
    """A bias of more dims than [M, C] gives the reference's output leading
    dims before its GroupNorm, which then takes another dim for the
    channels: refused, saying so (88's multiplier and problem 1's bias,
    after the GroupNorm or with none, take leading 1s: test_models.py)."""
    model = models.MODELS[problem](*args)
    with pytest.raises(ValueError, match=r"bias has shape \(1, 1, 16\), of more dims than the "
                                         r"reference's \[M, C\] output there"):
        model(torch.rand(5, 8))


def test_a_float64_model_is_refused_naming_its_parameters(past_device_check):
    """model.double(): the parameters' dtype is named, whatever x's (float32
    x was refused for not being float64, float64 x for being it)."""
    model = models.GemmAddRelu(8, 16, (16,)).double()
    for dtype in (torch.float32, torch.float64):
        with pytest.raises(TypeError, match="the model's parameters must be float32, float16 or "
                                            "bfloat16, got torch.float64"):
            model(torch.rand(4, 8, dtype=dtype))


@pytest.mark.parametrize("problem, path", [
    (37, "matmul.bias"), (37, "bias"), (37, "group_norm.weight"), (37, "group_norm.bias"),
    (88, "gemm.bias"), (88, "group_norm.weight"), (88, "multiply_weight"),
    (94, "gemm.bias"), (94, "bias"), (94, "groupnorm.weight"), (94, "groupnorm.bias")])
def test_group_norm_modules_name_their_parameters_in_errors(problem, path, past_device_check):
    """A parameter of another dtype than x's is refused naming the module's
    parameter, not the op's argument it is passed as (lin_bias, extra_bias,
    gn_weight, ...)."""
    from cupy_fused import reference

    _, args, shape = reference.SMALL_PROBLEMS[problem]
    model = models.MODELS[problem](*args)
    *owner, attr = path.split(".")
    module = getattr(model, owner[0]) if owner else model
    setattr(module, attr, torch.nn.Parameter(getattr(module, attr).detach().double()))
    with pytest.raises(TypeError, match=rf"^{path.replace('.', '[.]')} must have the dtype of x "):
        model(torch.rand(shape))


def test_compiled_autograd_over_an_eager_forward(past_device_check):
    """Compiled autograd (as FSDP2-style training turns on) traces the eager
    graph's backward: each node's formula, which reads what the eager
    forward kept on its ctx, runs as it is (a graph break) and gives eager's
    gradients.  Problem 76 in bfloat16 (cuBLAS and torch ops here): its
    traced version check of the kept output said it had changed in place."""
    ca = pytest.importorskip("torch._dynamo.compiled_autograd")
    enable = getattr(ca, "_enable", None) or getattr(ca, "enable", None)
    if enable is None:
        pytest.skip("this torch has no compiled autograd")
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = models.GemmAddRelu(64, 256, (256,)).bfloat16()
    x = torch.randn(96, 64, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(96, 256, dtype=torch.bfloat16)
    leaves = (x, *model.parameters())
    (model(x) * g).sum().backward()
    want = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    y = model(x)
    with enable(torch.compile(backend="aot_eager")):
        (y * g).sum().backward()
    for got, ref in zip((t.grad for t in leaves), want):
        torch.testing.assert_close(got, ref, rtol=0, atol=0)
    torch._dynamo.reset()


@pytest.mark.parametrize("problem", sorted(reference.SMALL_PROBLEMS))
def test_torchscript_is_refused_naming_the_module(problem, past_device_check):
    """torch.jit.trace and torch.jit.script: the kernels launch from
    Python, which TorchScript does not record; refused naming the module
    (tracing failed inside the launch planning, scripting on a type name)."""
    import warnings

    _, args, shape = reference.SMALL_PROBLEMS[problem]
    model = models.MODELS[problem](*args)
    name = type(model).__name__
    with pytest.raises(RuntimeError, match=f"{name} cannot be compiled to TorchScript"):
        torch.jit.script(model)
    with warnings.catch_warnings(), pytest.raises(
            RuntimeError, match=f"{name} cannot be compiled to TorchScript.*torch.compile"):
        warnings.simplefilter("ignore")
        torch.jit.trace(model, torch.rand(shape), check_trace=False)


def test_torchscript_tracing_of_the_ops_is_refused_naming_them(past_device_check):
    import warnings

    from cupy_fused import ops

    z, b = torch.rand(4, 8), torch.rand(8)
    calls = {
        "scale_add": lambda z: ops.scale_add(z, z),
        "bias_relu": lambda z: ops.bias_relu(z, b),
        "gn_chain": lambda z: ops.gn_chain(z, "swish_bias_gn", 2),
        "linear": lambda z: ops.linear(z, torch.rand(8, 8)),
        "linear_gn_chain": lambda z: ops.linear_gn_chain(z, torch.rand(8, 8), None, "swish_bias_gn", 2),
        "conv_bias_relu": lambda z: ops.conv_bias_relu(z.view(1, 2, 4, 4), torch.rand(3, 2, 2, 2),
                                                       torch.rand(3)),
    }
    for name, call in calls.items():
        with warnings.catch_warnings(), pytest.raises(RuntimeError, match=f"{name} cannot be compiled"):
            warnings.simplefilter("ignore")
            torch.jit.trace(call, (z,), check_trace=False)
