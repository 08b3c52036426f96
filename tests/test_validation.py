"""Bad input raises a clear Python error naming the argument, before any
launch (CPU tier: validation runs before anything touches the GPU)."""
import contextlib
import importlib
import math
import warnings

import pytest
import torch

import cupy_fused
from cupy_fused import ops

C = 16


def test_cpu_tensor_is_rejected_with_the_argument_name():
    x = torch.rand(4, C)
    with pytest.raises(ValueError, match=r"z must be on a CUDA device, got device cpu"):
        ops.bias_relu(x, torch.rand(C))


def test_wrong_dtype_is_a_type_error():
    with pytest.raises(TypeError, match=r"x must have dtype float32, float16 or bfloat16, got torch.float64"):
        ops.scale_add(torch.rand(3, dtype=torch.float64), torch.rand(3, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"z must be a torch.Tensor"):
        ops.bias_relu([1.0, 2.0], torch.rand(2))


def test_scale_add_checks_each_argument(past_device_check):
    x = torch.rand(3)
    with pytest.raises(ValueError, match=r"y must have the shape of x \(3,\), got \(4,\)"):
        ops.scale_add(x, torch.rand(4))
    with pytest.raises(TypeError, match=r"y must have the dtype of x \(torch.float32\), got torch.float16"):
        ops.scale_add(x, torch.rand(3, dtype=torch.float16))
    with pytest.raises(TypeError, match=r"y must be a torch.Tensor, got list"):
        ops.scale_add(x, [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match=r"alpha must be finite, got nan"):
        ops.scale_add(x, torch.rand(3), float("nan"))
    with pytest.raises(TypeError, match=r"alpha must be a float, got str"):
        ops.scale_add(x, torch.rand(3), "2")


def test_model_rejects_cpu_input():
    model = cupy_fused.GemmAddRelu(8, C, (C,))
    with pytest.raises(ValueError, match="x must be on a CUDA device"):
        model(torch.rand(2, 8))


def test_model_rejects_wrong_shapes(past_device_check):
    model = cupy_fused.GemmAddRelu(8, C, (C,))
    with pytest.raises(ValueError, match=r"x must have 8 features, got shape \(2, 9\)"):
        model(torch.rand(2, 9))
    with pytest.raises(ValueError, match=r"x must have 8 features in its last dim, got shape "
                                         r"\(2, 3, 9\)"):
        model(torch.rand(2, 3, 9))  # (any leading dims, as nn.Linear)
    with pytest.raises(TypeError, match="x must have the dtype of the model's parameters"):
        model(torch.rand(2, 8, dtype=torch.float16))
    with pytest.raises(TypeError, match="x must have dtype float32, float16 or bfloat16"):
        model(torch.rand(2, 3, 8, dtype=torch.float64))
    conv = cupy_fused.ConvReluBiasAdd(3, C, 3, (C, 1, 1))
    for shape in [(3, 5), (1, 1, 3, 5, 5)]:
        with pytest.raises(ValueError, match="x must be 3 or 4-D"):
            conv(torch.rand(shape))


def _gn_args(**over):
    z = torch.rand(4, C)
    args = dict(z=z, chain="swish_bias_gn", num_groups=4)
    args.update(over)
    return args


@pytest.mark.parametrize("groups,exc,msg", [
    (5, ValueError, r"num_groups \(5\) must divide the number of channels \(16\)"),
    (0, ValueError, "num_groups must be positive"),
    (2.0, TypeError, "num_groups must be an int"),
])
def test_groups_must_divide_channels(groups, exc, msg, past_device_check):
    with pytest.raises(exc, match=msg):
        ops.gn_chain(torch.rand(4, C), "swish_bias_gn", groups)


def test_group_norm_rows_under_2_to_the_30_channels():
    """The GroupNorm kernels index within a row in 32 bits."""
    from cupy_fused._validation import check_groups

    assert check_groups(2, 2**30 - 2) == 2
    with pytest.raises(ValueError, match=r"fewer than 2\^30 channels per row, got 1073741824"):
        check_groups(1, 2**30)


@pytest.mark.parametrize("eps,exc", [(math.nan, ValueError), (math.inf, ValueError),
                                     (-math.inf, ValueError), (-1e-5, ValueError),
                                     ("1e-5", TypeError), (True, TypeError)])
def test_eps_must_be_finite_and_non_negative(eps, exc):
    from cupy_fused._validation import check_eps

    with pytest.raises(exc, match="eps must"):
        check_eps(eps)


def test_numpy_scalars_count_as_ints_and_floats():
    """As torch's modules take them (nn.GroupNorm(np.int64(8), ...)); bools,
    NumPy's included, do not."""
    import numpy as np

    from cupy_fused._validation import check_eps, check_finite_scalar, check_groups

    groups = check_groups(np.int64(4), 16)
    assert groups == 4 and type(groups) is int
    assert check_eps(np.float32(1e-5)) == pytest.approx(1e-5) and type(check_eps(np.float32(1e-5))) is float
    assert check_finite_scalar("alpha", np.float64(2.0)) == 2.0
    for bad in (True, np.bool_(True)):
        with pytest.raises(TypeError, match="num_groups must be an int"):
            check_groups(bad, 16)
        with pytest.raises(TypeError, match="eps must be a float"):
            check_eps(bad)
    with pytest.raises(TypeError, match="num_groups must be an int"):
        check_groups(np.float32(4.0), 16)


def test_unhashable_or_huge_arguments_get_the_usual_errors(past_device_check):
    from cupy_fused._validation import check_eps, check_finite_scalar

    with pytest.raises(ValueError, match="activation must be None or 'relu', got \\['relu'\\]"):
        ops.linear(torch.rand(4, 8), torch.rand(16, 8), activation=["relu"])
    with pytest.raises(ValueError, match="chain must be one of"):
        ops.gn_chain(torch.rand(4, C), ["swish_bias_gn"], 4)
    with pytest.raises(ValueError, match="alpha must be finite, got inf"):
        check_finite_scalar("alpha", 10**400)
    with pytest.raises(ValueError, match="eps must be finite and non-negative, got inf"):
        check_eps(10**400)
    with pytest.raises(ValueError, match="eps must be finite and non-negative, got -1e-05"):
        check_eps(-1e-5)
    assert check_eps(0) == 0.0 and check_eps(0.0) == 0.0  # GroupNorm takes eps=0


def test_non_finite_alpha_is_rejected():
    from cupy_fused._validation import check_finite_scalar

    with pytest.raises(ValueError, match="alpha must be finite, got nan"):
        check_finite_scalar("alpha", float("nan"))
    with pytest.raises(ValueError, match="alpha must be finite, got -inf"):
        check_finite_scalar("alpha", -math.inf)
    with pytest.raises(TypeError, match="alpha must be a float, got bool"):
        check_finite_scalar("alpha", True)
    assert check_finite_scalar("alpha", 2) == 2.0 and type(check_finite_scalar("alpha", 2)) is float


def test_scale_add_alpha_must_be_a_float32(past_device_check):
    """The kernel takes alpha as a float32: past float32's range it would be
    an infinity there (x * inf, and 0 * inf = NaN), so it is refused."""
    from cupy_fused._validation import FLOAT32_MAX, check_finite_scalar

    x = torch.rand(4)
    for alpha in (1e39, -1e39, 3.5e38, 10**39):
        with pytest.raises(ValueError, match="alpha must be at most 3.40282e\\+38 in magnitude"):
            ops.scale_add(x, x, alpha)
    assert check_finite_scalar("alpha", FLOAT32_MAX, FLOAT32_MAX) == FLOAT32_MAX
    assert check_finite_scalar("alpha", -FLOAT32_MAX, FLOAT32_MAX) == -FLOAT32_MAX
    assert check_finite_scalar("alpha", 1e39) == 1e39  # no bound asked


def test_scalar_checks_take_symbolic_values():
    """Where Python runs on symbolic values (torch.export's non-strict
    tracing), a SymInt num_groups and a SymFloat eps pass, the SymFloat kept
    symbolic (float() would specialise it)."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    from cupy_fused._validation import check_eps, check_finite_scalar, check_groups

    env = ShapeEnv()

    def symbol(name, value):
        return env.create_symbol(value, ConstantSource(name), dynamic_dim=DimDynamic.DYNAMIC)

    eps = env.create_symfloatnode(symbol("eps", 1e-5), hint=1e-5, source=ConstantSource("eps"))
    groups = env.create_symintnode(symbol("groups", 4), hint=4)
    assert check_eps(eps) is eps and check_finite_scalar("alpha", eps) is eps
    assert check_groups(groups, C) is groups


def test_scalar_checks_trace_under_dynamic_compile():
    """Under torch.compile(dynamic=True) a module's float attribute (a
    GroupNorm's eps) reaches the checks as a SymFloat: they trace with no
    graph break (math.isfinite would not) and no recompile per batch size."""
    from torch._dynamo.utils import counters

    from cupy_fused._validation import check_eps, check_finite_scalar, check_groups

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.group_norm = torch.nn.GroupNorm(4, C)
            self.alpha = 0.5

        def forward(self, x):
            gn = self.group_norm
            groups = check_groups(gn.num_groups, x.shape[1])
            eps = check_eps(gn.eps)
            alpha = check_finite_scalar("alpha", self.alpha)
            return x * eps * alpha + groups

    model = Model()
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend="eager")
    for batch in (5, 9, 17):
        x = torch.rand(batch, C)
        torch.testing.assert_close(compiled(x), model(x))
    assert counters["stats"]["unique_graphs"] == 1


def test_vector_length_and_dtype_are_checked(past_device_check):
    from cupy_fused._validation import check_vector

    z = torch.rand(4, C)
    with pytest.raises(ValueError, match=r"bias must hold one value per channel \(16 values"):
        check_vector("bias", torch.rand(C + 1), C, z, "z")
    with pytest.raises(ValueError, match="bias must hold one value per channel"):
        check_vector("bias", torch.rand(2, C // 2), C, z, "z")
    with pytest.raises(TypeError, match=r"bias must have the dtype of z \(torch.float32\)"):
        check_vector("bias", torch.rand(C, dtype=torch.float16), C, z, "z")
    assert check_vector("bias", torch.rand(C, 1, 1), C, z, "z").shape == (C,)
    with pytest.raises(TypeError, match="multiply_weight is required"):
        check_vector("multiply_weight", None, C, z, "z", optional=False)
    # one value for every channel: only where the op takes it (one=True)
    with pytest.raises(ValueError, match=r"bias must hold one value per channel \(16 values, shape"):
        check_vector("bias", torch.rand(1), C, z, "z")
    assert check_vector("bias", torch.rand(1, 1, 1), C, z, "z", one=True).shape == (1,)
    with pytest.raises(ValueError, match="or one value for every channel, got shape"):
        check_vector("bias", torch.rand(2), C, z, "z", one=True)


def test_one_value_vectors_where_the_ops_take_them(past_device_check):
    """The chain's vectors but the linear bias, bias_relu's biases and
    conv_bias_relu's second bias may be one value for every channel (their
    gradient the whole sum); the linear bias (a GEMM epilogue's) and the
    convolution's own bias may not."""
    GN = importlib.import_module("cupy_fused.ops.gn_chain")
    z = torch.rand(4, C)
    one = torch.rand(1)
    vectors = GN.check_chain_vectors("gn_swish_mul_swish", C, z, "z", None, None, one, one, one)
    assert [None if v is None else tuple(v.shape) for v in vectors] == [None, None, (1,), (1,), (1,)]
    with pytest.raises(ValueError, match="lin_bias must hold one value per channel"):
        GN.check_chain_vectors("swish_bias_gn", C, z, "z", one, one, None, None, None)
    # A 0-dim float32 vector in a float16 chain promotes nothing (torch's
    # rule): cast to z's dtype; one of (1,) keeps the refusal of a mixed dtype.
    half = z.half()
    scalar = torch.rand((), requires_grad=True)
    vectors = GN.check_chain_vectors("swish_bias_gn", C, half, "z", None, scalar, None, None, None)
    assert vectors[1].dtype == torch.float16 and vectors[1].shape == (1,)
    vectors[1].float().sum().backward()
    assert scalar.grad.dtype == torch.float32
    with pytest.raises(TypeError, match=r"extra_bias must have the dtype of z \(torch.float16\)"):
        GN.check_chain_vectors("swish_bias_gn", C, half, "z", None, one, None, None, None)
    x = torch.rand(2, 3, 6, 6)
    with pytest.raises(ValueError, match="conv_bias must have C_out = 4 values"):
        ops.conv_bias_relu(x, torch.rand(4, 3, 3, 3), one, torch.rand(4))
    with pytest.raises(ValueError, match="bias C_out values or one, got"):
        ops.conv_bias_relu(x, torch.rand(4, 3, 3, 3), torch.rand(4), torch.rand(2))


def test_sparse_and_nested_tensors_are_refused(past_device_check):
    """The kernels read a tensor's strided memory: a sparse or nested
    tensor is refused with a TypeError naming the argument, by every kind
    of check (an op's first tensor, a second one of its shape, a
    per-channel vector, a weight)."""
    x, b = torch.rand(4, C), torch.rand(C)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the strided nested layout and sparse CSR are prototype / beta)
        nested = torch.nested.nested_tensor([torch.rand(2, C), torch.rand(3, C)])
        csr = x.to_sparse_csr()
    jagged = torch.nested.nested_tensor([torch.rand(2, C), torch.rand(3, C)], layout=torch.jagged)
    dense = r"must be a dense \(strided\) tensor, got layout "
    cases = [
        (lambda: ops.scale_add(x.to_sparse(), x), "x " + dense + "torch.sparse_coo"),
        (lambda: ops.scale_add(x, x.to_sparse()), "y " + dense + "torch.sparse_coo"),
        (lambda: ops.scale_add(csr, csr), "x " + dense + "torch.sparse_csr"),
        (lambda: ops.scale_add(x, nested), "y must be a dense tensor, got a nested tensor"),
        (lambda: ops.bias_relu(nested, b), "z must be a dense tensor, got a nested tensor"),
        (lambda: ops.bias_relu(jagged, b), "z must be a dense tensor, got a nested tensor"),
        (lambda: ops.bias_relu(x, b.to_sparse()), "bias " + dense + "torch.sparse_coo"),
        (lambda: ops.gn_chain(x.to_sparse(), "swish_bias_gn", 4), "z " + dense + "torch.sparse_coo"),
        (lambda: ops.linear(x, torch.rand(C, C).to_sparse()), "weight " + dense + "torch.sparse_coo"),
        (lambda: ops.conv_bias_relu(torch.rand(2, 8, 6, 6), torch.rand(4, 8, 3, 3).to_sparse(), b[:4]),
         "weight " + dense + "torch.sparse_coo"),
    ]
    for call, message in cases:
        with pytest.raises(TypeError, match=message):
            call()
    # The checks' common paths (CUDA tensors): a sparse or nested tensor
    # that says it is on the GPU.
    class OnGpu(torch.Tensor):
        is_cuda = property(lambda self: True)

    from cupy_fused import _validation as V

    dense_x = torch.Tensor._make_subclass(OnGpu, x)
    for t in (torch.Tensor._make_subclass(OnGpu, t) for t in (x.to_sparse(), csr, nested)):
        for call in (lambda: V.check_tensor("x", t), lambda: V.check_pair("x", t, "y", x),
                     lambda: V.check_pair("x", dense_x, "y", t), lambda: V.check_same("y", t, dense_x, "x")):
            with pytest.raises(TypeError, match=r"must be a dense"):
                call()


def test_tensors_that_wrap_others_are_refused(past_device_check):
    """A tensor subclass that wraps others (a DTensor, torch's TwoTensor)
    passes for a strided tensor of its shape and device, but its data
    pointer is 0: refused by every kind of check, naming the argument,
    before anything is launched (a kernel would write to address 0)."""
    two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")
    x, b = torch.rand(4, C), torch.rand(C)
    two = two_tensor.TwoTensor(x, x.clone())
    wrapped = r"is a TwoTensor, a tensor subclass that wraps others"
    cases = [
        (lambda: ops.scale_add(two, x), "x " + wrapped),
        (lambda: ops.scale_add(x, two), "y " + wrapped),
        (lambda: ops.bias_relu(two, b), "z " + wrapped),
        (lambda: ops.bias_relu(x, two_tensor.TwoTensor(b, b)), "bias " + wrapped),
        (lambda: ops.linear(x, two_tensor.TwoTensor(torch.rand(C, C), torch.rand(C, C))),
         "weight " + wrapped),
    ]
    model = cupy_fused.GemmAddRelu(C, 8, (8,))
    cases.append((lambda: model(two), "x " + wrapped))
    other = cupy_fused.GemmAddRelu(C, 8, (8,))
    weight = torch.rand(8, C)
    other.gemm.weight = torch.nn.Parameter(two_tensor.TwoTensor(weight, weight.clone()))
    cases.append((lambda: other(x), "the model's weight " + wrapped))
    for call, message in cases:
        with pytest.raises(TypeError, match=message):
            call()


def test_a_dtensor_is_refused(past_device_check):
    """As a DTensor (a one-process mesh on the CPU), naming its local form."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    from torch.distributed.tensor import Replicate, distribute_tensor, init_device_mesh
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        x = distribute_tensor(torch.rand(4, C), init_device_mesh("cpu", (1,)), [Replicate()])
        with pytest.raises(TypeError, match=r"x is a DTensor, .*\.to_local\(\) or \.full_tensor"):
            ops.scale_add(x, x)
    finally:
        dist.destroy_process_group()


def test_gn_model_rejects_groups_at_construction():
    with pytest.raises(ValueError, match=r"num_groups \(4\) must divide the number of channels \(10\)"):
        cupy_fused.MatmulSwishSumGroupNorm(8, 10, 4, (10,))


def test_models_check_their_sizes_at_construction():
    """Sizes and groups of another kind are refused as the model is built,
    under their own names (torch's layers raise a ZeroDivisionError or a
    negative-dimension error for some, and take others)."""
    M = cupy_fused
    cases = [
        (lambda: M.MatmulSwishSumGroupNorm(8, 16, 0, (16,)), ValueError, "num_groups must be positive, got"),
        (lambda: M.MatmulSwishSumGroupNorm(8, 16, 2.0, (16,)), TypeError, "num_groups must be an int"),
        (lambda: M.GemmGroupNormSwishMultiplySwish(8, 16, 3, (16,)), ValueError,
         r"num_groups \(3\) must divide the number of channels \(16\)"),
        (lambda: M.GemmBiasAddHardtanhMishGroupNorm(8, 16, (16,), -2), ValueError, "num_groups must be"),
        (lambda: M.GemmAddRelu(-1, 16, (16,)), ValueError, "in_features must be at least 0, got -1"),
        (lambda: M.GemmAddRelu(8.0, 16, (16,)), TypeError, "in_features must be an int, got float"),
        (lambda: M.MatmulSwishSumGroupNorm(8, -16, 4, (16,)), ValueError, "out_features must be at least 0"),
        (lambda: M.ConvReluBiasAdd(3, True, 3, (1, 1, 1)), TypeError, "out_channels must be an int, got"),
        (lambda: M.ConvReluBiasAdd(0, 4, 3, (4, 1, 1)), ValueError, "in_channels must be at least 1, got 0"),
        (lambda: M.ConvReluBiasAdd(3, 4, 0, (4, 1, 1)), ValueError, "kernel_size must be at least 1, got 0"),
        (lambda: M.ConvReluBiasAdd(3, 4, (3, -1), (4, 1, 1)), ValueError, "kernel_size must be at least 1"),
        (lambda: M.ConvReluBiasAdd(3, 4, "3", (4, 1, 1)), TypeError,
         "kernel_size must be an int or a pair of ints, got str"),
        (lambda: M.ConvReluBiasAdd(3, 4, (3, 3, 3), (4, 1, 1)), ValueError,
         r"kernel_size must be an int or a pair of ints, got \(3, 3, 3\)"),
        (lambda: M.ConvReluBiasAdd(3, 4, (3,), (4, 1, 1)), ValueError,  # (nn.Conv2d: a 3-D weight)
         r"kernel_size must be an int or a pair of ints, got \(3,\)"),
        (lambda: M.ConvReluBiasAdd(3, 4, 3, (4, -1, 1)), ValueError, "bias_shape must be at least 0, got -1"),
        (lambda: M.GemmAddRelu(8, 16, (16.0,)), TypeError, "bias_shape must be an int or a tuple of ints"),
        (lambda: M.MatmulSwishSumGroupNorm(8, 16, 4, None), TypeError, "bias_shape must be an int or"),
        (lambda: M.GemmGroupNormSwishMultiplySwish(8, 16, 4, (-16,)), ValueError,
         "multiply_weight_shape must be at least 0, got -16"),
        (lambda: M.GemmBiasAddHardtanhMishGroupNorm(8, 16, [16, "1"], 4), TypeError,
         "bias_shape must be an int or a tuple of ints, got str"),
    ]
    for make, exc, message in cases:
        with pytest.raises(exc, match=message):
            make()
    # What torch's layers take, these take too: an empty sum, no features out.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch's init of an empty weight: "a no-op")
        assert M.GemmAddRelu(0, 16, (16,)).gemm.weight.shape == (16, 0)
        assert M.MatmulSwishSumGroupNorm(8, 0, 4, (0,)).matmul.weight.shape == (0, 8)


def test_models_check_inputs_and_parameters_before_anything_runs(past_device_check):
    """The models' common-path check takes only dense tensors; a model left
    on the CPU is named as the thing to move; under autocast (which casts
    float32, float16 and bfloat16 alike) 76's weight and biases of another
    dtype are refused before its product runs."""
    from cupy_fused import _validation as V

    class OnGpu(torch.Tensor):
        is_cuda = property(lambda self: True)

    model = cupy_fused.GemmAddRelu(8, C, (C,))
    sparse = torch.Tensor._make_subclass(OnGpu, torch.rand(2, 8).to_sparse())
    with pytest.raises(TypeError, match=r"x must be a dense \(strided\) tensor"):
        model(sparse)
    with pytest.raises(ValueError, match=r"the model's parameters must be on a CUDA device, got cpu; "
                                         r"move the model there"):
        with pytest.MonkeyPatch.context() as m:
            m.setattr(V, "DEVICE_TYPES", ("cuda",))
            model(torch.Tensor._make_subclass(OnGpu, torch.rand(2, 8, dtype=torch.float16)))

    M = importlib.import_module("cupy_fused.models")
    launched = []
    with pytest.MonkeyPatch.context() as m:
        m.setattr(M, "autocast_dtype", lambda: torch.bfloat16)
        m.setattr(M, "autocast_enabled", lambda: True)
        m.setattr(M, "_linear_prechecked", lambda *a: launched.append(a))
        x = torch.rand(2, 8)
        for name, dtype, message in [
                ("gemm.weight", torch.float64, "the model's parameters must be float32, float16 or "
                                               "bfloat16, got torch.float64"),
                ("gemm.bias", torch.float64, "gemm.bias must have dtype float32, float16 or bfloat16"),
                ("bias", torch.float64, "bias must have dtype float32, float16 or bfloat16")]:
            model = cupy_fused.GemmAddRelu(8, C, (C,))
            if name == "gemm.bias":
                model.gemm.bias = torch.nn.Parameter(torch.rand(C))
            module, attr = (model.gemm, name[5:]) if name.startswith("gemm.") else (model, name)
            setattr(module, attr, torch.nn.Parameter(getattr(module, attr).detach().to(dtype)))
            with pytest.raises(TypeError, match=message):
                model(x)
        model = cupy_fused.GemmAddRelu(8, C, (C,))
        model.gemm.bias = torch.nn.Parameter(torch.rand(C + 1))
        with pytest.raises(ValueError, match="gemm.bias must hold one value per channel"):
            model(x)
    # Outside autocast, where the product is followed by bias_relu (a gemm
    # given a bias of its own, or a one-value bias): the bias too.
    with pytest.MonkeyPatch.context() as m:
        m.setattr(M, "_linear_prechecked", lambda *a: launched.append(a))
        for gemm_bias, bias in [(torch.rand(C), torch.rand(C, dtype=torch.float64)),
                                (None, torch.rand(1, dtype=torch.float64))]:
            model = cupy_fused.GemmAddRelu(8, C, (C,))
            model.gemm.bias = None if gemm_bias is None else torch.nn.Parameter(gemm_bias)
            model.bias = torch.nn.Parameter(bias)
            with pytest.raises(TypeError, match="bias must have dtype float32, float16 or bfloat16"):
                model(torch.rand(2, 8))
    assert launched == []
    # Problem 1's other convolutions (here a stride of 2): Conv2d's own
    # forward, then bias_relu, whose vectors are checked before the former.
    conv = cupy_fused.ConvReluBiasAdd(3, 4, 3, (4, 1, 1))
    conv.conv.stride = (2, 2)
    conv.bias = torch.nn.Parameter(conv.bias.detach().double())
    with pytest.MonkeyPatch.context() as m:
        m.setattr(conv.conv, "_conv_forward", lambda *a: launched.append(a))
        with pytest.raises(TypeError, match="bias must have dtype float32, float16 or bfloat16"):
            conv(torch.rand(2, 3, 8, 8))
        conv.bias = torch.nn.Parameter(conv.bias.detach().float())
        conv.conv.bias = torch.nn.Parameter(torch.rand(5))
        with pytest.raises(ValueError, match="conv.bias must hold one value per channel"):
            conv(torch.rand(2, 3, 8, 8))
    assert launched == []


def test_unknown_chain_is_rejected():
    with pytest.raises(ValueError, match="chain must be one of"):
        ops.gn_chain(torch.rand(4, C), "relu", 4)


def test_dense_layout_policy():
    from cupy_fused._validation import dense_layout

    t = torch.rand(4, 6).t()
    assert dense_layout(t).is_contiguous()
    cl = torch.rand(2, 3, 4, 5).contiguous(memory_format=torch.channels_last)
    assert dense_layout(cl) is cl
    c = torch.rand(2, 3)
    assert dense_layout(c) is c


@pytest.mark.parametrize("op", ["scale_add", "bias_relu", "gn_chain", "linear", "linear-bf16",
                                "linear_gn_chain", "conv_bias_relu"])
def test_ops_under_vmap_are_refused_before_any_launch(op, past_device_check, monkeypatch):
    """torch.vmap's tensors have no memory laid out as one tensor: each op
    refuses them, naming itself, before anything would launch (the launch
    is stubbed to fail the test), also on the routes that run cuBLAS or
    cuDNN (a 16-bit linear) and before a route is chosen."""
    from cupy_fused import _bridge

    monkeypatch.setattr(_bridge, "launch", lambda *args, **kw: pytest.fail("launched"))
    a, b, w = torch.rand(3, 4, 16), torch.rand(16), torch.rand(8, 16)
    cw, cb = torch.rand(4, 4, 2, 2), torch.rand(4)
    call = {"scale_add": lambda t: ops.scale_add(t, t, 2.0),
            "bias_relu": lambda t: ops.bias_relu(t, b),
            "gn_chain": lambda t: ops.gn_chain(t, "swish_bias_gn", 4),
            "linear": lambda t: ops.linear(t, w),
            "linear-bf16": lambda t: ops.linear(t, w.bfloat16()),
            "linear_gn_chain": lambda t: ops.linear_gn_chain(t, w, None, "swish_bias_gn", 2),
            "conv_bias_relu": lambda t: ops.conv_bias_relu(t, cw, cb),
            }[op]
    if op == "linear-bf16":
        a = a.bfloat16()
    elif op == "conv_bias_relu":
        a = torch.rand(3, 2, 4, 5, 5)
    name = op.split("-")[0]
    with pytest.raises(RuntimeError, match=f"cupy_fused::{name} does not support torch.vmap"):
        torch.vmap(call)(a)


@pytest.mark.parametrize("op", ["scale_add", "bias_relu", "gn_chain", "linear", "linear-bf16",
                                "linear_gn_chain", "conv_bias_relu"])
def test_ops_under_torch_func_gradient_transforms_are_refused_before_any_launch(
        op, past_device_check, monkeypatch):
    """torch.func.grad, vjp and jacrev: each op refuses them naming itself,
    before anything would launch, also on the routes that run cuBLAS or
    cuDNN (a 16-bit linear, whose alignment check would take the wrapper's
    data pointer: torch's error, naming no op)."""
    from cupy_fused import _bridge

    monkeypatch.setattr(_bridge, "launch", lambda *args, **kw: pytest.fail("launched"))
    b, w, cw, cb = torch.rand(16), torch.rand(8, 16), torch.rand(4, 4, 2, 2), torch.rand(4)
    a = torch.rand(4, 4, 5, 5) if op == "conv_bias_relu" else torch.rand(4, 16)
    if op == "linear-bf16":
        a, w = a.bfloat16(), w.bfloat16()
    call = {"scale_add": lambda t: ops.scale_add(t, t, 2.0),
            "bias_relu": lambda t: ops.bias_relu(t, b),
            "gn_chain": lambda t: ops.gn_chain(t, "swish_bias_gn", 4),
            "linear": lambda t: ops.linear(t, w),
            "linear-bf16": lambda t: ops.linear(t, w),
            "linear_gn_chain": lambda t: ops.linear_gn_chain(t, w, None, "swish_bias_gn", 2),
            "conv_bias_relu": lambda t: ops.conv_bias_relu(t, cw, cb),
            }[op]
    message = f"cupy_fused::{op.split('-')[0]} does not support torch.func's gradient transforms"
    for transform in (lambda: torch.func.grad(lambda t: call(t).float().sum())(a),
                      lambda: torch.func.vjp(call, a),
                      lambda: torch.func.jacrev(lambda t: call(t).sum())(a)):
        with pytest.raises(RuntimeError, match=message):
            transform()


@pytest.mark.parametrize("problem", [1, 37, 76, 88, 94])
def test_models_under_torch_func_transforms_are_refused_naming_them(problem, past_device_check,
                                                                   monkeypatch):
    """torch.vmap over a batch of inputs hands a module x with one dim less,
    and torch.func.grad an x with no memory of its own: refused with a
    RuntimeError naming the module (not the rank check's error), before
    anything would launch."""
    from cupy_fused import _bridge, reference

    monkeypatch.setattr(_bridge, "launch", lambda *args, **kw: pytest.fail("launched"))
    _, args, shape = reference.SMALL_PROBLEMS[problem]
    model = cupy_fused.models.MODELS[problem](*args)
    name = type(model).__name__
    x = torch.rand((3,) + tuple(shape))
    with pytest.raises(RuntimeError, match=f"cupy_fused::{name} does not support torch.vmap"):
        torch.vmap(model)(x)
    with pytest.raises(RuntimeError, match=f"cupy_fused::{name} does not support torch.func's "
                                           f"gradient transforms"):
        torch.func.grad(lambda t: model(t).sum())(x[0])


def test_problem_1_refuses_forward_ad_and_transforms_before_cudnn_runs(past_device_check, monkeypatch):
    """A convolution the engine does not take (padding 1) runs cuDNN first,
    then bias_relu: forward-mode AD, and torch.func over the parameters
    (functional_call, which wraps them and not x), are refused before the
    convolution, the latter naming the module."""
    import torch.autograd.forward_ad as fwAD

    model = cupy_fused.ConvReluBiasAdd(3, 4, 3, (4, 1, 1))
    model.conv.padding = (1, 1)
    monkeypatch.setattr(model.conv, "_conv_forward", lambda *a: pytest.fail("the convolution ran"))
    x = torch.rand(2, 3, 8, 8)
    with fwAD.dual_level():
        with pytest.raises(RuntimeError, match="forward-mode AD"):
            model(fwAD.make_dual(x, torch.rand_like(x)))
    params = dict(model.named_parameters())
    with pytest.raises(RuntimeError, match="cupy_fused::ConvReluBiasAdd does not support torch.func's "
                                           "gradient transforms"):
        torch.func.grad(lambda p: torch.func.functional_call(model, p, (x,)).sum())(params)


@pytest.mark.parametrize("op", ["scale_add", "bias_relu", "gn_chain"])
def test_ops_under_functionalize_launch_on_real_memory(op, past_device_check, monkeypatch):
    """torch.func.functionalize's tensors have no memory of their own
    (data_ptr() 0): an op that launched its kernel straight from Python on
    them would hand it null pointers.  The ops go through their custom ops
    there, which hand the forward the real tensors: the launch's tensor
    pointers are the inputs' own (the launch is stubbed)."""
    from cupy_fused import _bridge, _runtime
    from cupy_fused.ops import _common

    class Launched(Exception):
        pass

    def launch(fn, grid, block, args, dev, shared_mem=0):
        raise Launched(args)

    monkeypatch.setattr(_bridge, "launch", launch)
    monkeypatch.setattr(_runtime.KernelFamily, "get", lambda self, key, dev: key)
    monkeypatch.setattr(_common, "sm_count", lambda dev: 132)
    a, b = torch.rand(4, 16), torch.rand(16)
    call = {"scale_add": lambda t: ops.scale_add(t, t, 2.0),
            "bias_relu": lambda t: ops.bias_relu(t, b),
            "gn_chain": lambda t: ops.gn_chain(t, "swish_bias_gn", 4)}[op]
    for fn in (call, torch.func.functionalize(call)):
        with pytest.raises(Launched) as caught:
            fn(a)
        assert caught.value.args[0][0] == a.data_ptr(), "the launch did not get the input's memory"
    # An input that requires grad: functionalize's wrapper says it does
    # not, and autograd records the op all the same.  scale_add's forward
    # is the same either way (its backward is torch's); the others would
    # take their inference route under a training node: refused first.
    leaf = a.clone().requires_grad_(True)
    if op == "scale_add":
        with pytest.raises(Launched):
            torch.func.functionalize(call)(leaf)
    else:
        with pytest.raises(RuntimeError, match="record no gradient under torch.func.functionalize"):
            torch.func.functionalize(call)(leaf)
        with torch.no_grad():
            with pytest.raises(Launched):
                torch.func.functionalize(call)(leaf)


def test_a_second_tensor_is_compared_by_device_not_by_index(past_device_check):
    """The common-path checks compare a second tensor's device index with
    the first's: a tensor of another device type with the same index (here
    a meta tensor beside one that says it is on the GPU, both index -1)
    must not pass for one on the same GPU."""
    class OnGpu(torch.Tensor):
        is_cuda = property(lambda self: True)

    x = torch.Tensor._make_subclass(OnGpu, torch.rand(4, C))
    meta = torch.empty(4, C, device="meta")
    assert x.get_device() == meta.get_device()
    with pytest.raises(ValueError, match="y must be on"):
        ops.scale_add(x, meta)
    from cupy_fused._validation import check_same

    with pytest.raises(ValueError, match="y must be on"):
        check_same("y", meta, x, "x")


def test_a_tangent_on_any_vector_is_refused_before_the_product(past_device_check, monkeypatch):
    """Forward-mode AD with the tangent on a vector that only the step after
    the product reads (linear_gn_chain's GroupNorm weight, GemmAddRelu's
    bias): refused before the product runs (its launches stubbed to fail)."""
    import torch.autograd.forward_ad as fwAD

    from cupy_fused import _bridge

    M = importlib.import_module("cupy_fused.models")
    monkeypatch.setattr(_bridge, "launch", lambda *args, **kw: pytest.fail("launched"))
    monkeypatch.setattr(M, "_linear_prechecked", lambda *a: pytest.fail("the product ran"))
    x, w = torch.rand(4, 8), torch.rand(C, 8)
    model = cupy_fused.GemmAddRelu(8, C, (C,))
    with fwAD.dual_level():
        gn_weight = fwAD.make_dual(torch.rand(C), torch.ones(C))
        with pytest.raises(RuntimeError, match="do not support forward-mode AD"):
            ops.linear_gn_chain(x, w, None, "swish_bias_gn", 4, gn_weight=gn_weight)
        with pytest.raises(RuntimeError, match="do not support forward-mode AD"):
            torch.func.functional_call(model, {"bias": fwAD.make_dual(torch.rand(C), torch.ones(C))},
                                       (x,))


@contextlib.contextmanager
def _cuda_autocast(dtype):
    """CUDA autocast's state set to ``dtype`` (torch keeps it per thread, on a
    machine without a GPU too; torch.autocast itself turns off there)."""
    prev = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", dtype)
    try:
        yield
    finally:
        torch.set_autocast_enabled("cuda", prev[0])
        torch.set_autocast_dtype("cuda", prev[1])


def test_autocast_to_float32_casts_half_tensors_up():
    """Under autocast to float32 the entry points cast float16 / bfloat16
    tensors to float32 (autograd casts) and run as outside autocast; other
    tensors pass as given, for validation to name them."""
    from cupy_fused import _amp

    half = torch.rand(3, dtype=torch.bfloat16, requires_grad=True)
    others = (torch.rand(3), torch.rand(3, dtype=torch.float64), torch.arange(3), None, 2.0)
    assert _amp.float32_casts(half, *others)[0] is half  # outside autocast
    for dtype, amp in [(torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
                       (torch.float32, None)]:
        with _cuda_autocast(dtype):
            assert _amp.autocast_enabled() and _amp.autocast_dtype() == amp
    with _cuda_autocast(torch.bfloat16):
        assert _amp.float32_casts(half)[0] is half
    with _cuda_autocast(torch.float32):
        up, *rest = _amp.float32_casts(half, *others)
    assert up.dtype == torch.float32 and all(a is b for a, b in zip(rest, others))
    up.sum().backward()
    assert half.grad.dtype == torch.bfloat16 and half.grad.eq(1).all()
    assert not _amp.autocast_enabled() and _amp.autocast_dtype() is None


def test_autocast_to_another_dtype_is_refused_before_anything_runs(past_device_check, launches):
    from cupy_fused import _amp

    x, w = torch.rand(4, 8), torch.rand(6, 8)
    message = "float16, bfloat16 or float32, got autocast to torch.float64"
    with _cuda_autocast(torch.float64):
        with pytest.raises(TypeError, match=message):
            _amp.autocast_dtype()
        with pytest.raises(TypeError, match=message):
            ops.linear(x, w)
        with pytest.raises(TypeError, match=message):
            ops.linear_gn_chain(x, w, None, "swish_bias_gn", 2)
        with pytest.raises(TypeError, match=message):
            ops.conv_bias_relu(torch.rand(1, 2, 4, 4), torch.rand(3, 2, 2, 2), torch.rand(3))
        with pytest.raises(TypeError, match=message):
            cupy_fused.GemmAddRelu(8, 6, (6,))(x)
        # Problem 1 with another convolution (torch's, then bias_relu):
        # refused before torch's convolution runs.
        conv = cupy_fused.ConvReluBiasAdd(2, 3, 2, (3, 1, 1))
        conv.conv.padding = (1, 1)
        with pytest.MonkeyPatch.context() as m:
            m.setattr(conv.conv, "_conv_forward", lambda *a: pytest.fail("convolved"))
            with pytest.raises(TypeError, match=message):
                conv(torch.rand(1, 2, 4, 4))
    assert launches == []


def test_float64_vectors_under_autocast_are_refused_before_anything_runs(past_device_check,
                                                                         launches):
    """Autocast casts float32, float16 and bfloat16 tensors and leaves
    float64 alone (the reference then promotes to float64, or fails): the
    GroupNorm chains refuse a float64 vector under autocast, naming it,
    before anything runs, as problem 76 does."""
    from cupy_fused import _amp

    assert _amp.cast(torch.rand(2, dtype=torch.float64), torch.float32).dtype == torch.float64
    x, w, z = torch.rand(4, 8), torch.rand(C, 8), torch.rand(4, C)
    f64 = torch.rand(C, dtype=torch.float64)
    message = "must have dtype float32, float16 or bfloat16, got torch.float64"
    with _cuda_autocast(torch.bfloat16):
        with pytest.raises(TypeError, match="mul_weight " + message):
            ops.gn_chain(z, "gn_swish_mul_swish", 4, mul_weight=f64)
        with pytest.raises(TypeError, match="lin_bias " + message):
            ops.linear_gn_chain(x, w, f64, "swish_bias_gn", 4)
        for model, name in [(cupy_fused.GemmGroupNormSwishMultiplySwish(8, C, 4, (C,)),
                             "multiply_weight"),
                            (cupy_fused.MatmulSwishSumGroupNorm(8, C, 4, (C,)), "bias"),
                            (cupy_fused.GemmBiasAddHardtanhMishGroupNorm(8, C, (C,), 4), "bias")]:
            setattr(model, name, torch.nn.Parameter(getattr(model, name).detach().double()))
            with pytest.raises(TypeError, match=message):
                model(x)
    assert launches == []


def test_inputs_of_other_ranks_reach_the_ops_as_the_reference_takes_them(past_device_check,
                                                                        monkeypatch):
    """Problem 76 takes nn.Linear's [*, in_features] (its rows go to the
    product as [M, in_features], y comes back with x's leading dims) and
    problem 1 nn.Conv2d's one image [C, H, W] (as a batch of one; y without
    the batch dim unless bias is 4-D, as the reference's broadcast)."""
    M = importlib.import_module("cupy_fused.models")
    seen = []

    def product(x, weight, *rest):
        seen.append(tuple(x.shape))
        return torch.zeros(x.shape[0], weight.shape[0])

    monkeypatch.setattr(M, "_linear_prechecked", product)
    model = cupy_fused.GemmAddRelu(8, C, (C,))
    for shape, out in [((2, 3, 8), (2, 3, C)), ((8,), (C,)), ((0, 5, 8), (0, 5, C)),
                       ((2, 1, 1, 8), (2, 1, 1, C))]:
        assert model(torch.rand(shape)).shape == out
    assert seen == [(6, 8), (1, 8), (0, 8), (2, 8)]
    for shape in [(2, 3, 7), (), (7,)]:
        with pytest.raises(ValueError, match=r"x must have 8 features in its last dim"):
            model(torch.rand(shape))

    monkeypatch.setattr(M.ops, "conv_bias_relu",
                        lambda x, w, cb, b: seen.append(tuple(x.shape)) or torch.zeros(
                            x.shape[0], w.shape[0], x.shape[2] - 1, x.shape[3] - 1))
    for bias_shape, out in [((4, 1, 1), (4, 5, 6)), ((1, 4, 1, 1), (1, 4, 5, 6))]:
        conv = cupy_fused.ConvReluBiasAdd(3, 4, 2, bias_shape)
        assert conv(torch.rand(3, 6, 7)).shape == out
    assert seen[-2:] == [(1, 3, 6, 7)] * 2


def test_problem_1_conv_bias_under_autocast_takes_the_autocast_dtype(past_device_check,
                                                                     monkeypatch):
    """Under autocast the reference's convolution casts its bias to the
    autocast dtype, so only ``bias`` promotes y: where bias has that dtype
    and the conv bias is float32, the op gets the conv bias cast (an
    autograd cast: its gradient comes back in float32); without a conv bias
    (another convolution's route), zeros in z's dtype."""
    M = importlib.import_module("cupy_fused.models")
    seen = []
    monkeypatch.setattr(M.ops, "conv_bias_relu", lambda x, w, cb, b: seen.append(cb))
    monkeypatch.setattr(M.ops, "bias_relu", lambda z, cb, b: seen.append(cb))
    conv = cupy_fused.ConvReluBiasAdd(3, 4, 2, (4, 1, 1))
    x = torch.rand(1, 3, 6, 7)
    with _cuda_autocast(torch.bfloat16):
        conv(x)  # every tensor float32: as given
        assert seen[-1] is conv.conv.bias
        conv.bias = torch.nn.Parameter(conv.bias.detach().bfloat16())
        conv(x)
        assert seen[-1].dtype == torch.bfloat16 and seen[-1].grad_fn is not None
        conv.conv.bias = None
        with pytest.MonkeyPatch.context() as m:
            m.setattr(conv.conv, "_conv_forward", lambda *a: torch.zeros(1, 4, 5, 6,
                                                                          dtype=torch.bfloat16))
            conv(x)
        assert seen[-1].dtype == torch.bfloat16 and not seen[-1].any()
    with _cuda_autocast(torch.bfloat16):  # the conv bias's gradient in its own dtype
        cb = torch.rand(4, requires_grad=True)
        M._autocast_conv_bias(cb, torch.rand(4, dtype=torch.bfloat16)).sum().backward()
        # a 0-dim float32 bias promotes nothing: y in bfloat16, as the reference's
        assert M._autocast_conv_bias(cb, torch.rand(())).dtype == torch.bfloat16
        assert M._autocast_conv_bias(cb, torch.rand(1)) is cb  # (a float32 y, as the reference's)
    assert cb.grad.dtype == torch.float32


def test_models_under_float32_autocast_run_in_float32(past_device_check):
    """A bfloat16 problem 76 fed a float32 input under autocast to float32:
    its product gets float32 operands, as the reference's linear."""
    M = importlib.import_module("cupy_fused.models")
    model = cupy_fused.GemmAddRelu(8, C, (C,)).to(torch.bfloat16)
    seen = []
    with pytest.MonkeyPatch.context() as m, _cuda_autocast(torch.float32):
        m.setattr(M, "_linear_prechecked", lambda *a: seen.append(a) or a[0].new_zeros(2, C))
        assert model(torch.rand(2, 8)).dtype == torch.float32
    x, weight, bias = seen[0][:3]
    assert x.dtype == weight.dtype == bias.dtype == torch.float32
    assert weight.grad_fn is not None and bias.grad_fn is not None  # autograd casts
    with pytest.raises(TypeError, match=r"x must have the dtype of the model.s parameters"):
        model(torch.rand(2, 8))  # outside autocast: the parameters' dtype


def test_bias_relu_names_the_vector_it_refuses(past_device_check):
    """A float64 vector is named on its own; a missing or non-tensor bias
    beside a float64 bias2 is named too (no AttributeError on its dtype)."""
    z, f32, f64 = torch.rand(4, C), torch.rand(C), torch.rand(C, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"^bias2 must be float32, float16 or bfloat16, got torch.float64$"):
        ops.bias_relu(z, f32, f64)
    with pytest.raises(TypeError, match=r"^bias must be float32, float16 or bfloat16, got torch.float64$"):
        ops.bias_relu(z, f64, f32)
    for bias in (None, [1.0] * C):
        with pytest.raises(TypeError, match=r"^bias2 must be float32, float16 or bfloat16, "
                                            r"got torch.float64$"):
            ops.bias_relu(z, bias, f64)
    with pytest.raises(TypeError, match=r"^bias is required, got None$"):
        ops.bias_relu(z, None, f32)
    with pytest.raises(TypeError, match=r"^bias must be a torch.Tensor, got list"):
        ops.bias_relu(z, [1.0] * C, f32)


def test_one_image_is_checked_as_given(past_device_check):
    model = cupy_fused.ConvReluBiasAdd(3, 8, 3, (8, 1, 1))
    with pytest.raises(ValueError, match=r"x must have 3 input channels \(dim 0 of one image "
                                         r"\[C, H, W\]\), got shape \(2, 4, 5\)"):
        model(torch.rand(2, 4, 5))


def test_testing_helpers_refuse_what_they_cannot_measure():
    """cupy_fused.testing's errors: no broadcast between shapes (it would
    measure another tensor), tensors only, 0 for empty ones; unknown
    problems and gradient modes are named."""
    from cupy_fused import testing

    with pytest.raises(ValueError, match=r"value must have the shape of truth \(1, 3\), got \(3, 1\)"):
        testing.rel_error(torch.zeros(3, 1), torch.ones(1, 3))
    with pytest.raises(TypeError, match=r"value must be a torch.Tensor, got list"):
        testing.rel_error([1.0, 2.0], torch.ones(2))
    assert testing.rel_error(torch.empty(0, 3), torch.empty(0, 3)) == 0.0
    assert testing.rel_error(torch.tensor([1.0, 3.0]), torch.tensor([1.0, 2.0])) == 0.5
    a, b = torch.rand(3, 2), torch.rand(4, 2)
    with pytest.raises(ValueError, match=r"c must have the shape of ref_fn\(a, b\) \(3, 4\), "
                                         r"got \(1,\)"):
        testing.scaled_gemm_error(torch.zeros(1), a, b, lambda p, q: p @ q.t())
    with pytest.raises(ValueError, match=r"got must have the shape of want \(3,\), got \(2,\)"):
        testing.assert_non_finite_where(torch.zeros(2), torch.zeros(3))
    with pytest.raises(ValueError, match=r"problem must be one of \[1, 37, 76, 88, 94\], got 2"):
        testing.build_pair(2, (), "cpu", torch.float32)
    with pytest.raises(ValueError, match=r"problem must be one of \[1, 37, 76, 88, 94\], got True"):
        testing.build_pair(True, (), "cpu", torch.float32)
    with pytest.raises(ValueError, match=r"grad_mode must be 'random' or 'sum', got 'bogus'"):
        testing.compare(76, (8, 16, (16,)), (4, 8), torch.float32, "cpu", grad_mode="bogus")
    with pytest.raises(ValueError, match=r"nbytes must be at least 0, got -8"):
        testing.poison_allocator("cpu", -8)
    with pytest.raises(TypeError, match=r"nbytes must be an int, got float"):
        testing.poison_allocator("cpu", 8.0)
    import numpy as np

    testing.poison_allocator("cpu", np.int64(8))  # NumPy's ints count as ints
    # Its blocks are NaN read as any float dtype (a float32 NaN's bytes read
    # as 16-bit values alternate 0 and NaN).
    blocks = []
    real_full = torch.full
    with pytest.MonkeyPatch.context() as m:
        m.setattr(testing.torch, "full", lambda *a, **k: blocks.append(real_full(*a, **k)) or blocks[-1])
        testing.poison_allocator("cpu", 64)
    assert len(blocks) == 4
    for block in blocks:
        for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            assert block[:16].view(dtype).isnan().all(), dtype
    with pytest.raises(TypeError, match=r"t must be a torch.Tensor, got list"):
        testing.off_the_grid([1.0, 2.0])
    with pytest.raises(TypeError, match=r"dtype must be a floating-point torch.dtype, got torch.int32"):
        testing.worse_than_eager({"out": (1.0, 1.0)}, torch.int32)
    assert testing.worse_than_eager({"out": (2.0, 1.0), "x.grad": (1.0, 1.0)}, torch.float32) == ["out"]


def test_the_testing_helpers_flag_what_the_gpu_tests_rely_on_them_for(past_device_check,
                                                                      monkeypatch):
    """The yardsticks of the GPU tier, on the CPU: compare() measures every
    gradient, so an 'ours' whose weight gradient is 10% off (its forward
    the reference's) is flagged on that gradient alone; rel_error and
    scaled_gemm_error flag a NaN (an unwritten element); off_the_grid's
    neighbours hold its fill."""
    from cupy_fused import models, reference, testing

    class WrongWeightGrad(reference.PROBLEMS[76][0]):
        def forward(self, x):
            y = super().forward(x)
            w = self.gemm.weight
            extra = torch.nn.functional.linear(x, w) - torch.nn.functional.linear(x, w.detach())
            return y + 0.1 * extra * (y > 0)  # (the value of y; the weight's gradient 1.1x)

    monkeypatch.setitem(models.MODELS, 76, WrongWeightGrad)
    _, args, shape = reference.SMALL_PROBLEMS[76]
    errors = testing.compare(76, args, shape, torch.float32, "cpu")
    assert {"out", "x.grad", "gemm.weight.grad", "bias.grad"} <= set(errors), sorted(errors)
    assert testing.worse_than_eager(errors, torch.float32) == ["gemm.weight.grad"], errors

    value = torch.rand(5, dtype=torch.float64)
    assert testing.rel_error(value, value) == 0.0
    assert testing.rel_error(torch.tensor([float("nan"), 1.0]), torch.ones(2)) == float("inf")
    # Infinities: the same one where truth has it adds no error, and does not
    # scale the others; any other value there is an infinite error.
    inf = float("inf")
    truth = torch.tensor([inf, -inf, 2.0, 4.0], dtype=torch.float64)
    assert testing.rel_error(torch.tensor([inf, -inf, 3.0, 4.0]), truth) == 0.25
    for wrong in ([-inf, -inf, 2.0, 4.0], [1e30, -inf, 2.0, 4.0], [inf, -inf, inf, 4.0],
                  [inf, float("nan"), 2.0, 4.0]):
        assert testing.rel_error(torch.tensor(wrong), truth) == inf, wrong
    assert testing.rel_error(torch.tensor([inf, 1.0]), torch.tensor([inf, 0.0])) == 1.0
    a, b = torch.rand(4, 3), torch.rand(5, 3)
    c = a @ b.t()
    assert testing.scaled_gemm_error(c, a, b, lambda p, q: p @ q.t()) < 1e-6
    c[1, 2] = float("nan")
    with pytest.raises(AssertionError, match="unwritten"):
        testing.scaled_gemm_error(c, a, b, lambda p, q: p @ q.t())
    t = torch.rand(3, 4)
    view = testing.off_the_grid(t, fill=-7.0)
    assert torch.equal(view, t) and view.stride() == t.stride()
    base = view.as_strided((t.numel() + 2,), (1,), view.storage_offset() - 1)
    assert base[0] == -7.0 and base[-1] == -7.0


@pytest.mark.parametrize("autocast_to", [None, torch.float32, torch.bfloat16])
def test_autocast_casts_come_after_every_check(autocast_to, past_device_check, monkeypatch):
    """Under autocast (to float32: half tensors cast up; to a half dtype:
    the GroupNorm's vectors cast to float32), and outside it in bias_relu's
    type promotion and for a 0-dim GroupNorm vector, a bad argument is
    refused before any tensor is cast: a cast is a launch."""
    from cupy_fused import _amp

    monkeypatch.setattr(_amp, "_cuda_autocast", lambda: autocast_to)
    casts = []
    to = torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: casts.append(a) or to(self, *a, **k))
    bf = torch.bfloat16

    def rand(*shape):
        return torch.rand(*shape, dtype=bf)

    x, w, v = rand(4, 8), rand(C, 8), rand(C)
    cases = [(ValueError, "activation", lambda: ops.linear(x, w, v, activation="gelu")),
             (ValueError, "bias must hold one value per channel", lambda: ops.linear(x, w, rand(C + 1))),
             (ValueError, "gn_weight must hold one value per channel",
              lambda: ops.linear_gn_chain(x, w, v, "swish_bias_gn", 4, extra_bias=v,
                                          gn_weight=rand(C + 1), gn_bias=v)),
             (ValueError, "precision", lambda: ops.linear_gn_chain(
                 x, w, v, "swish_bias_gn", 4, extra_bias=v, gn_weight=v, gn_bias=v, precision="fp8")),
             (ValueError, "gn_bias must hold one value per channel",
              lambda: ops.gn_chain(rand(4, C), "swish_bias_gn", 4, lin_bias=v, extra_bias=v,
                                   gn_weight=v, gn_bias=rand(C + 1))),
             (TypeError, "eager_rounding", lambda: ops.gn_chain(
                 rand(4, C), "swish_bias_gn", 4, lin_bias=v, extra_bias=v, gn_weight=v, gn_bias=v,
                 eager_rounding="yes")),
             (ValueError, "conv_bias must have C_out", lambda: ops.conv_bias_relu(
                 rand(2, 3, 6, 6), rand(C, 3, 3, 3), rand(C + 1), v))]
    # (a 0-dim float32 gn_weight: cast to z's bfloat16 outside autocast)
    cases.append((ValueError, "gn_bias must hold one value per channel",
                  lambda: ops.gn_chain(rand(4, C), "swish_bias_gn", 4, lin_bias=v, extra_bias=v,
                                       gn_weight=torch.tensor(1.0), gn_bias=rand(C + 1))))
    # (bias_relu: a float32 bias2 promotes y, so bias is cast to float32)
    cases.append((ValueError, "bias2 must hold one value per channel",
                  lambda: ops.bias_relu(rand(4, C), v, torch.rand(C + 1))))
    model = cupy_fused.GemmAddRelu(8, C, (C,)).to(bf)
    model.gemm.bias = torch.nn.Parameter(rand(C + 1))
    cases.append((ValueError, "gemm.bias must hold one value per channel", lambda: model(x)))
    casts.clear()  # (the model's .to)
    for error, message, call in cases:
        with pytest.raises(error, match=message):
            call()
        assert casts == [], (message, casts)
