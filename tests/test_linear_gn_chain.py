"""``ops.linear_gn_chain``: a linear layer and a GroupNorm op chain, in one
launch on Hopper where the groups fit the GEMM tile (the GroupNorm epilogue
of the wgmma GEMM), else the GEMM and the gn_chain kernel.  The rule and the
validation on the CPU tier; the one-launch kernel itself on ragged shapes and
every group size, and the models through it, on the GPU tier."""
import importlib

import pytest
import torch
import torch.nn.functional as F

from cupy_fused import ops, settings
from cupy_fused.ops import gemm as G
from cupy_fused.testing import compare, poison_allocator, rel_error, worse_than_eager

# The modules (as attributes of cupy_fused.ops, these names are the ops themselves).
GN = importlib.import_module("cupy_fused.ops.gn_chain")
LG = importlib.import_module("cupy_fused.ops.linear_gn_chain")

gpu = pytest.mark.gpu


# ---------------------------------------------------------------- CPU tier

def test_groups_fit_the_tile_when_a_power_of_two_up_to_128_channels():
    for channels, groups, fits in ((4096, 64, True), (8192, 256, True), (40, 40, True),
                                   (256, 2, True), (130, 65, True), (256, 1, False),
                                   (70, 7, False), (96, 2, False), (384, 3, True)):
        assert LG.group_fits_tile(channels, groups) is fits, (channels, groups)


@pytest.fixture
def one_launch_on():
    with settings.gemm_gn_epilogue(True):
        yield


@pytest.fixture
def hopper_rule(monkeypatch, one_launch_on):
    """The size rule as on an H100 (132 SMs, wgmma), on CPU tensors, with
    the one-launch forward switched on."""
    monkeypatch.setattr(G, "sm_count", lambda dev: 132)
    monkeypatch.setattr(G, "has_wgmma", lambda dev: True)


def _shaped(*shape):
    return torch.empty(1, 1).expand(*shape)  # the rule reads shapes and pointers only


def test_one_launch_rule(hopper_rule, monkeypatch):
    x, w = _shaped(1536, 64), _shaped(1536, 64)
    assert LG._fuses_group_norm(x, w, 12, 3)        # 128 channels per group, 144 tiles
    assert LG._fuses_group_norm(x, w, 1536, 1)      # one channel per group, TF32
    assert not LG._fuses_group_norm(x, w, 6, 3)     # 256 channels: wider than the tile
    assert not LG._fuses_group_norm(x, w, 16, 3)    # 96 channels: not a power of two
    assert not LG._fuses_group_norm(_shaped(256, 64), _shaped(1536, 64), 12, 3)  # 24 tiles
    assert not LG._fuses_group_norm(_shaped(1536, 16), _shaped(1536, 16), 12, 3)  # short sums
    assert not LG._fuses_group_norm(_shaped(1536, 66), _shaped(1536, 66), 12, 3)  # unaligned rows
    assert LG._fuses_group_norm(_shaped(32768, 1024), _shaped(4096, 1024), 64, 3)  # problem 37
    assert LG._fuses_group_norm(_shaped(1024, 8192), _shaped(8192, 8192), 256, 3)  # 88, 94
    monkeypatch.setattr(G, "has_wgmma", lambda dev: False)
    assert not LG._fuses_group_norm(x, w, 12, 3)


def test_one_launch_is_off_by_default(monkeypatch):
    """Off unless switched on: two launches are at least as fast on H100 (see
    ops/linear_gn_chain.py)."""
    monkeypatch.setattr(G, "sm_count", lambda dev: 132)
    monkeypatch.setattr(G, "has_wgmma", lambda dev: True)
    assert not settings.get_gemm_gn_epilogue()
    assert not LG._fuses_group_norm(_shaped(32768, 1024), _shaped(4096, 1024), 64, 3)
    with settings.gemm_gn_epilogue(True):
        assert LG._fuses_group_norm(_shaped(32768, 1024), _shaped(4096, 1024), 64, 3)


def test_every_fused_kernel_is_declared():
    assert set(LG.KERNELS.expressions) == {(c, p) for c in GN.CHAINS for p in (1, 3)}


@pytest.fixture
def past_device_check(monkeypatch):
    from cupy_fused import _validation

    monkeypatch.setattr(_validation, "DEVICE_TYPES", ("cuda", "cpu"))


def test_validation(past_device_check):
    x, w, v = torch.rand(4, 8), torch.rand(16, 8), torch.rand(16)
    with pytest.raises(ValueError, match="chain must be one of"):
        ops.linear_gn_chain(x, w, v, "gn_relu", 4)
    with pytest.raises(ValueError, match=r"x must have 8 features \(weight is \[16, 8\]\)"):
        ops.linear_gn_chain(torch.rand(4, 9), w, v, "swish_bias_gn", 4)
    with pytest.raises(ValueError, match="x must be 2-D"):
        ops.linear_gn_chain(torch.rand(4, 2, 8), w, v, "swish_bias_gn", 4)
    with pytest.raises(TypeError, match="weight must have the dtype of x"):
        ops.linear_gn_chain(x, w.half(), v, "swish_bias_gn", 4)
    with pytest.raises(ValueError, match=r"num_groups \(5\) must divide the number of channels \(16\)"):
        ops.linear_gn_chain(x, w, v, "swish_bias_gn", 5)
    with pytest.raises(ValueError, match="eps must be finite and positive"):
        ops.linear_gn_chain(x, w, v, "swish_bias_gn", 4, eps=float("nan"))
    with pytest.raises(ValueError, match=r"gn_weight must hold one value per channel \(16"):
        ops.linear_gn_chain(x, w, v, "swish_bias_gn", 4, gn_weight=torch.rand(8))
    with pytest.raises(TypeError, match="multiply_weight is required"):
        ops.linear_gn_chain(x, w, v, "gn_swish_mul_swish", 4)
    with pytest.raises(ValueError, match="precision must be one of"):
        ops.linear_gn_chain(x, w, v, "swish_bias_gn", 4, precision="fp32")


@pytest.mark.parametrize("dtype, cublas", [(torch.float32, False), (torch.bfloat16, True)])
def test_where_the_linear_bias_is_added(dtype, cublas, past_device_check, monkeypatch):
    """Our float32 GEMM stores z without the bias and the chain adds it; on
    cuBLAS (fp16/bf16) the bias is in the GEMM's epilogue, before rounding,
    detached, and the chain only produces its gradient."""
    monkeypatch.setattr(G, "has_tf32_tensor_cores", lambda dev: True)
    calls = {}

    def run_linear(x, weight, bias, activation, passes):
        calls["gemm_bias"] = bias
        return F.linear(x, weight, bias)

    def run_gn_chain(z, chain, groups, lin_bias, *rest):
        # (..., bias_in_z, eager_rounding, float_out)
        calls["chain_bias"], calls["bias_in_z"] = lin_bias, rest[-3]
        return z

    monkeypatch.setattr(LG, "_run_linear", run_linear)
    monkeypatch.setattr(LG, "_run_gn_chain", run_gn_chain)
    x, w = torch.rand(4, 8, dtype=dtype), torch.rand(16, 8, dtype=dtype)
    b = torch.rand(16, dtype=dtype, requires_grad=True)
    ops.linear_gn_chain(x, w, b, "swish_bias_gn", 4)
    assert calls["chain_bias"] is b and calls["bias_in_z"] is cublas
    if cublas:
        assert torch.equal(calls["gemm_bias"], b) and not calls["gemm_bias"].requires_grad
    else:
        assert calls["gemm_bias"] is None


def _counting_route(monkeypatch):
    """Records every decision of where a product runs (gemm.uses_cublas,
    which gemm.route asks)."""
    decisions = []
    uses_cublas = G.uses_cublas

    def counted(*args):
        decisions.append(args)
        return uses_cublas(*args)

    monkeypatch.setattr(G, "uses_cublas", counted)
    return decisions


@pytest.mark.parametrize("dtype, passes", [(torch.float32, 3), (torch.bfloat16, G.CUBLAS)])
def test_the_route_is_decided_once(dtype, passes, past_device_check, monkeypatch):
    """linear_gn_chain decides where its GEMM runs once and hands that down
    to the linear op's runner (here on CPU tensors: K = 8 takes SGEMM, a
    torch op, on the tensor-core route too; the chain is stubbed)."""
    monkeypatch.setattr(G, "has_tf32_tensor_cores", lambda dev: True)
    decisions = _counting_route(monkeypatch)
    handed = []
    run_linear = LG._run_linear

    def recorded(x, weight, bias, activation, passes):
        handed.append(passes)
        return run_linear(x, weight, bias, activation, passes)

    monkeypatch.setattr(LG, "_run_linear", recorded)
    monkeypatch.setattr(LG, "_run_gn_chain", lambda z, *rest: z)
    x, w = torch.rand(4, 8, dtype=dtype), torch.rand(16, 8, dtype=dtype)
    z = ops.linear_gn_chain(x, w, torch.rand(16, dtype=dtype), "swish_bias_gn", 4)
    assert len(decisions) == 1 and handed == [passes]
    assert z.shape == (4, 16)


# ---------------------------------------------------------------- GPU tier

def chain_on_z(z, chain, groups, extra_bias, gn_weight, gn_bias, mul_weight, eps=1e-5):
    """The op chain after the linear layer, in PyTorch (any dtype)."""
    if chain == "swish_bias_gn":
        return F.group_norm(F.silu(z) + extra_bias, groups, gn_weight, gn_bias, eps)
    if chain == "gn_swish_mul_swish":
        return F.silu(F.silu(F.group_norm(z, groups, gn_weight, gn_bias, eps)) * mul_weight)
    return F.group_norm(F.mish(F.hardtanh(z + extra_bias)), groups, gn_weight, gn_bias, eps)


def _operands(m, k, n, device, seed):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.rand(m, k, generator=gen)
    w = (torch.rand(n, k, generator=gen) * 2 - 1) / k ** 0.5
    vecs = [torch.randn(n, generator=gen) for _ in range(5)]
    return [t.to(device) for t in [x, w] + vecs]


# (M, K, N, groups): ragged M and N (N % 4 != 0 takes the word stores), every
# power-of-two group size from 1 to 128 channels.
# K >= 64: shorter sums are where 3xTF32's error reaches SGEMM's (see ops.gemm).
FUSED_SHAPES = [(1, 64, 128, 1), (3, 68, 132, 33), (257, 72, 130, 65), (130, 64, 200, 200),
                (200, 100, 384, 12), (64, 128, 136, 17), (129, 132, 1024, 16), (66, 256, 256, 16)]


@gpu
@pytest.mark.parametrize("chain", list(GN.CHAINS))
@pytest.mark.parametrize("shape", FUSED_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_one_launch_kernel_against_float64(chain, shape, device):
    """The GroupNorm epilogue of the wgmma GEMM, launched directly (the size
    rule takes it only for products that fill the GPU): y into NaN, error
    vs float64 no worse than eager float32's; z, mean and 1/std as the
    backward needs them; the same y without saving; the same bits twice."""
    if not G.has_wgmma(device.index):
        pytest.skip("the one-launch GEMM + GroupNorm needs the wgmma GEMM (compute capability 9.0)")
    m, k, n, groups = shape
    x, w, lin_bias, extra_bias, gn_weight, gn_bias, mul_weight = _operands(m, k, n, device,
                                                                         m + k + n + groups)
    vecs = (lin_bias, extra_bias, gn_weight, gn_bias, mul_weight)
    eps = 1e-5
    f64 = [t.double() for t in vecs[1:]]
    z64 = F.linear(x.double(), w.double(), lin_bias.double())
    truth = chain_on_z(z64, chain, groups, *f64, eps)
    eager_err = rel_error(chain_on_z(F.linear(x, w, lin_bias), chain, groups, *vecs[1:], eps), truth)
    for passes in (3, 1):
        poison_allocator(device, 4 * m * n)
        y, z, stats = LG._launch_fused(x, w, *vecs, chain, groups, eps, passes, True,
                                       y=torch.full((m, n), float("nan"), device=device))
        if passes == 3:
            err = rel_error(y, truth)
            assert err <= 1.5 * eager_err + torch.finfo(torch.float32).eps, (err, eager_err)
        else:
            # TF32 products (~1e-3): the epilogue against float64 from the
            # kernel's own z, next to eager float32 from the same z.
            from_z = chain_on_z(z.double(), chain, groups, *f64, eps)
            err = rel_error(y, from_z)
            eager_from_z = rel_error(chain_on_z(z, chain, groups, *vecs[1:], eps), from_z)
            assert err <= 1.5 * eager_from_z + torch.finfo(torch.float32).eps, (err, eager_from_z)
        assert rel_error(z, z64) < (2.0 ** -20 if passes == 3 else 2e-3)
        # mean and 1/std of Pre(z) per (row, group), as gn_chain's forward saves them
        _, stats_ref = GN._launch_forward(z, None, extra_bias, gn_weight, gn_bias,
                                          mul_weight, chain, groups, eps, True, True)
        assert stats.shape == stats_ref.shape == (2, m, groups)
        torch.testing.assert_close(stats[0], stats_ref[0], rtol=1e-5, atol=1e-6)  # mean
        torch.testing.assert_close(stats[1], stats_ref[1], rtol=1e-4, atol=0)  # 1/std
        y_again, z_none, stats_none = LG._launch_fused(x, w, *vecs, chain, groups, eps, passes,
                                                       False)
        assert z_none.numel() == 0 and stats_none.numel() == 0
        assert torch.equal(y, y_again)


@gpu
@pytest.mark.parametrize("problem,args,shape", [
    (37, (64, 1536, 12, (1536,)), (1536, 64)),      # 128 channels per group
    (88, (64, 1536, 48, (1536,)), (1541, 64)),      # 32, ragged batch
    (94, (68, 1540, (1540,), 385), (1600, 68)),     # 4, ragged features
])
def test_models_take_one_launch_and_match_the_reference(problem, args, shape, device, monkeypatch,
                                                        one_launch_on):
    """With the one-launch forward on, at sizes that fill the GPU the
    models' forward is that kernel (the gn_chain forward is never called),
    and their output and every gradient are no worse than eager's against
    float64."""
    if not G.has_wgmma(device.index):
        pytest.skip("the one-launch GEMM + GroupNorm needs the wgmma GEMM (compute capability 9.0)")

    def not_called(*args, **kwargs):
        raise AssertionError("the two-launch path ran")

    launches = []
    launch_fused = LG._launch_fused

    def counted(*args, **kwargs):
        launches.append(args[7])  # the chain
        return launch_fused(*args, **kwargs)

    # The gn_chain op holds its own reference to its forward.
    monkeypatch.setattr(GN._GN_CHAIN, "forward", not_called)
    monkeypatch.setattr(LG, "_launch_fused", counted)
    errors = compare(problem, args, shape, torch.float32, device, seed=problem)
    bad = worse_than_eager(errors, torch.float32)
    assert not bad, {name: errors[name] for name in bad}
    assert launches == [{37: "swish_bias_gn", 88: "gn_swish_mul_swish",
                         94: "bias_hardtanh_mish_gn"}[problem]]
