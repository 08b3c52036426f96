"""``ops.linear_gn_chain``: a linear layer and a GroupNorm op chain; in
float16 / bfloat16 on Hopper in one launch where that pays (the GroupNorm
chain in the store of the GEMM engine), else the GEMM and the gn_chain kernel
(the fallback route).  The rule and the validation on the CPU tier; the
one-launch kernel itself on ragged shapes and every group size, and the
models through it, on the GPU tier."""
import importlib
import re

import pytest
import torch
import torch.nn.functional as F

from cupy_fused import ops
from cupy_fused.ops import gemm as G
from cupy_fused.testing import compare, off_the_grid, poison_allocator, rel_error, worse_than_eager

# The modules (as attributes of cupy_fused.ops, these names are the ops themselves).
GN = importlib.import_module("cupy_fused.ops.gn_chain")
LG = importlib.import_module("cupy_fused.ops.linear_gn_chain")

gpu = pytest.mark.gpu


# ---------------------------------------------------------------- CPU tier

def test_one_launch_pays_for_short_products_that_fill_the_gpu():
    """The measured rule (docs/gemm.md): K up to 2048 and 8 tiles per SM."""
    assert LG.fusion_pays(32768, 4096, 1024, 132)       # problem 37
    assert LG.fusion_pays(8192, 4096, 1024, 132)
    assert LG.fusion_pays(4096, 8192, 2048, 132)
    assert not LG.fusion_pays(1024, 8192, 8192, 132)    # problems 88 and 94
    assert not LG.fusion_pays(1024, 8192, 1024, 132)    # 4 tiles per SM
    assert not LG.fusion_pays(32768, 4096, 4096, 132)   # K past 2048


def _on_cpu_as_hopper(monkeypatch):
    monkeypatch.setattr(G, "has_wgmma", lambda dev: True)
    monkeypatch.setattr(G, "sm_count", lambda dev: 132)


def test_what_the_one_launch_kernel_supports(monkeypatch):
    _on_cpu_as_hopper(monkeypatch)
    x, w = torch.rand(96, 64, dtype=torch.bfloat16), torch.rand(256, 64, dtype=torch.bfloat16)
    for groups, ok in ((32, True), (16, True), (4, True), (2, True), (64, False), (3, False),
                       (256, False)):
        assert LG._half_engine_supports(x, w, groups) is ok, groups  # 8 to 128 channels, 2^k
    assert not LG._half_engine_supports(x.float(), w.float(), 8)      # float32
    assert not LG._half_engine_supports(x, w.half(), 8)               # mixed dtypes
    unaligned = torch.rand(96 * 65, dtype=torch.bfloat16)[: 96 * 65].view(96, 65)[:, :64]
    assert not LG._half_engine_supports(unaligned, w, 8)               # rows TMA cannot read
    monkeypatch.setattr(G, "has_wgmma", lambda dev: False)
    assert not LG._half_engine_supports(x, w, 8)


def test_split_pre_chains_match_the_kernel_source():
    """_SPLIT_PRE_CHAINS names exactly the chains whose struct in
    gn_chains.cuh sets kSplitPre."""
    from cupy_fused import _runtime

    src = (_runtime.kernel_dir() / "gn_chains.cuh").read_text()
    for name, chain in GN.CHAINS.items():
        struct = chain.cxx.split("::")[-1]
        body = src[src.index(f"struct {struct} "):]
        body = body[:body.index("\n};\n")]
        split = re.search(r"kSplitPre = (true|false);", body).group(1) == "true"
        assert split == (name in LG._SPLIT_PRE_CHAINS), name


def test_every_one_launch_kernel_is_declared():
    assert set(LG.HALF_KERNELS.expressions) == {
        (d, f, c, cpg) for d in (torch.float16, torch.bfloat16) for f in (False, True)
        for c in GN.CHAINS
        for cpg in (LG.HALF_FLOAT_OUT_GROUP_SIZES if f else LG.HALF_GROUP_SIZES)}


def test_16bit_models_record_one_op_where_one_launch_pays(monkeypatch, past_device_check):
    """On Hopper, a 16-bit forward whose product passes the rule is one op
    (run here on CPU tensors with its forward stubbed); one that does not
    takes the two-launch route."""
    _on_cpu_as_hopper(monkeypatch)
    seen = []

    def forward_half(x, weight, *rest):
        seen.append(x.shape)
        m, n = x.shape[0], weight.shape[0]
        return x.new_zeros((m, n)), x.new_empty((0,)), x.new_empty((0,))

    monkeypatch.setattr(LG, "_forward_half", forward_half)
    monkeypatch.setattr(LG, "_run_gn_chain", lambda z, *rest: z)
    w, b = torch.rand(256, 64, dtype=torch.bfloat16), torch.rand(256, dtype=torch.bfloat16)
    monkeypatch.setattr(LG, "fusion_pays", lambda *shape: True)
    y = ops.linear_gn_chain(torch.rand(96, 64, dtype=torch.bfloat16), w, b, "swish_bias_gn", 8)
    assert seen == [(96, 64)] and y.shape == (96, 256)
    monkeypatch.setattr(LG, "fusion_pays", lambda *shape: False)
    ops.linear_gn_chain(torch.rand(96, 64, dtype=torch.bfloat16), w, b, "swish_bias_gn", 8)
    assert seen == [(96, 64)]  # the two-launch route
    monkeypatch.setattr(LG, "fusion_pays", lambda *shape: True)
    ops.linear_gn_chain(torch.rand(96, 64, dtype=torch.bfloat16), w, b, "swish_bias_gn", 8,
                        eager_rounding=True)
    assert seen == [(96, 64)]  # eager rounding: the two-launch route


def test_the_one_launch_entry_checks_a_given_y(past_device_check):
    """The internal entry tests and sanitizer runs hand a NaN-poisoned y to:
    a y of another shape, dtype or layout, or off the 16-byte grid, is
    refused before the launch."""
    x, w = torch.rand(8, 16, dtype=torch.bfloat16), torch.rand(32, 16, dtype=torch.bfloat16)
    for y, float_out in ((torch.empty(8, 31, dtype=torch.bfloat16), False),
                         (torch.empty(8, 32), False),
                         (torch.empty(8, 32, dtype=torch.bfloat16), True),
                         (torch.empty(32, 8).t(), True),
                         (torch.empty(8 * 32 + 1)[1:].view(8, 32), True)):
        with pytest.raises(ValueError, match=r"y must be a contiguous, 16-byte aligned \[8, 32\]"):
            LG._run_one_launch(x, w, None, None, None, None, None, "swish_bias_gn", 4, 1e-5, False,
                               y, float_out)


def test_the_one_launch_entry_checks_the_vectors(past_device_check, monkeypatch):
    """The kernel reads the linear bias as x's dtype and the other vectors as
    y's (float32 under autocast): a vector of another dtype, length or
    layout is refused before the launch (one value for every channel is
    taken) by the entry tests and scripts call; the forward's own path
    hands the kernel vectors it has checked already."""
    monkeypatch.setattr(LG, "_half_engine_supports", lambda *args: True)
    x, w = torch.rand(8, 16, dtype=torch.bfloat16), torch.rand(32, 16, dtype=torch.bfloat16)
    half, single = torch.rand(32, dtype=torch.bfloat16), torch.rand(32)
    cases = (("lin_bias", 0, single, False), ("lin_bias", 0, single, True),
             ("gn_weight", 2, single, False), ("gn_weight", 2, half, True),
             ("gn_bias", 3, torch.rand(31), True), ("extra_bias", 1, torch.rand(64)[::2], True),
             ("mul_weight", 4, half.float(), False))
    for name, slot, v, float_out in cases:
        vectors = [None] * 5
        vectors[slot] = v
        with pytest.raises(ValueError, match=f"{name} must be a contiguous \\[32\\] \\(or \\[1\\]\\) tensor"):
            LG._launch_fused_half(x, w, *vectors, "swish_bias_gn", 4, 1e-5, False, None, float_out)


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
    with pytest.raises(ValueError, match="eps must be finite and non-negative"):
        ops.linear_gn_chain(x, w, v, "swish_bias_gn", 4, eps=float("nan"))
    with pytest.raises(ValueError, match=r"gn_weight must hold one value per channel \(16"):
        ops.linear_gn_chain(x, w, v, "swish_bias_gn", 4, gn_weight=torch.rand(8))
    with pytest.raises(TypeError, match="mul_weight is required"):
        ops.linear_gn_chain(x, w, v, "gn_swish_mul_swish", 4)
    # A vector the chain has no place for is refused, not ignored.
    with pytest.raises(ValueError, match="extra_bias must be None for chain 'gn_swish_mul_swish'"):
        ops.linear_gn_chain(x, w, v, "gn_swish_mul_swish", 4, mul_weight=v, extra_bias=v)
    for chain in ("swish_bias_gn", "bias_hardtanh_mish_gn"):
        with pytest.raises(ValueError, match=f"mul_weight must be None for chain '{chain}'"):
            ops.linear_gn_chain(x, w, v, chain, 4, extra_bias=v, mul_weight=v)
        with pytest.raises(ValueError, match="mul_weight must be None"):
            ops.gn_chain(torch.rand(4, 16), chain, 4, mul_weight=v)
    # The per-problem forms' errors name their own arguments.
    z = torch.rand(4, 16)
    with pytest.raises(ValueError, match=r"^bias must hold one value per channel"):
        ops.swish_bias_group_norm(z, None, torch.rand(8), None, None, 4)
    with pytest.raises(ValueError, match=r"^linear_bias must hold one value per channel"):
        ops.bias_hardtanh_mish_group_norm(z, torch.rand(8), v, None, None, 4)
    with pytest.raises(TypeError, match=r"^multiply_weight is required"):
        ops.group_norm_swish_multiply_swish(z, None, None, None, None, 4)
    with pytest.raises(ValueError, match="precision must be one of"):
        ops.linear_gn_chain(x, w, v, "swish_bias_gn", 4, precision="fp32")


@pytest.mark.parametrize("dtype, cublas", [(torch.float32, False), (torch.bfloat16, True)])
def test_where_the_linear_bias_is_added(dtype, cublas, past_device_check, monkeypatch):
    """Our float32 GEMM stores z without the bias and the chain adds it; on
    cuBLAS (fp16/bf16, the two-launch route) the bias is in the GEMM's
    epilogue, before rounding, detached, and the chain only produces its
    gradient."""
    monkeypatch.setattr(G, "has_tf32_tensor_cores", lambda dev: True)
    monkeypatch.setattr(G, "has_wgmma", lambda dev: False)
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
    monkeypatch.setattr(G, "has_wgmma", lambda dev: False)
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


# (M, K, N, groups): ragged M (the TMA store clips rows), N not a multiple of
# the 128-column tile, every power-of-two group size from 8 to 128 channels,
# K not a multiple of the 64-deep k-tile.
FUSED_SHAPES = [(1, 64, 128, 1), (3, 72, 136, 17), (257, 64, 200, 25), (130, 200, 384, 12),
                (64, 128, 256, 16), (96, 64, 256, 4), (129, 64, 1024, 8), (66, 256, 256, 2)]
HALF = [torch.bfloat16, torch.float16]


@gpu
@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("chain", list(GN.CHAINS))
@pytest.mark.parametrize("shape", FUSED_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_one_launch_kernel_against_float64(chain, shape, dtype, device, monkeypatch):
    """The 16-bit one-launch kernel, launched directly (the rule takes it
    only for products that fill the GPU): y into NaN, error vs float64 no
    worse than eager's in the same dtype; z, mean and 1/std as the backward
    needs them; the same y without saving; the same bits twice, and (float32
    y) on a grid of one or two blocks, each walking many tiles; a float32 y
    as gn_chain's from the same z, or (_SPLIT_PRE_CHAINS) no worse against
    float64 than eager's under autocast."""
    m, k, n, groups = shape
    if not G.has_wgmma(device.index):
        pytest.skip("the one-launch kernel needs the Hopper GEMM engine (compute capability 9.0)")
    x, w, *vecs = [t.to(dtype) for t in _operands(m, k, n, device, m + k + n + groups)]
    assert LG._half_engine_supports(x, w, groups)  # every shape here is one it takes
    eps = 1e-5
    z64 = F.linear(x.double(), w.double(), vecs[0].double())
    truth = chain_on_z(z64, chain, groups, *[t.double() for t in vecs[1:]], eps)
    eager = chain_on_z(F.linear(x, w, vecs[0]), chain, groups, *vecs[1:], eps)
    poison_allocator(device, 4 * m * n)
    y, z, stats = LG._launch_fused_half(x, w, *vecs, chain, groups, eps, True,
                                        y=torch.full((m, n), float("nan"), device=device,
                                                     dtype=dtype))
    err, eager_err = rel_error(y, truth), rel_error(eager, truth)
    assert err <= 1.5 * eager_err + torch.finfo(dtype).eps, (err, eager_err)
    # z as cuBLAS gives it, to a unit of rounding (another summation order)
    torch.testing.assert_close(z, torch.addmm(vecs[0], x, w.t()), rtol=torch.finfo(dtype).eps,
                               atol=torch.finfo(dtype).eps)
    # mean and 1/std of Pre(z) per (row, group), as gn_chain's forward saves them
    _, stats_ref = GN._launch_forward(z, None, *vecs[1:], chain, groups, eps, True, True)
    assert stats.shape == stats_ref.shape == (2, m, groups)
    torch.testing.assert_close(stats[0], stats_ref[0], rtol=1e-5, atol=1e-6)  # mean
    torch.testing.assert_close(stats[1], stats_ref[1], rtol=1e-4, atol=0)  # 1/std
    y_again, z_none, stats_none = LG._launch_fused_half(x, w, *vecs, chain, groups, eps, False)
    assert z_none.numel() == 0 and stats_none.numel() == 0
    assert torch.equal(y, y_again)
    if m > 0 and n // groups in LG.HALF_FLOAT_OUT_GROUP_SIZES:
        # float32 y and vectors (autocast): the chain in float32 from the same z
        vf = [vecs[0]] + [t.float() for t in vecs[1:]]
        y32, z32, stats32 = LG._launch_fused_half(
            x, w, *vf, chain, groups, eps, True, float_out=True,
            y=torch.full((m, n), float("nan"), device=device))
        assert torch.equal(z32, z) and torch.equal(stats32, stats)
        y32_again, _, _ = LG._launch_fused_half(x, w, *vf, chain, groups, eps, True, float_out=True)
        assert torch.equal(y32, y32_again)
        for blocks in (1, 2):  # every staging area handed to the store's warpgroup again and again
            monkeypatch.setattr(G, "sm_count", lambda dev, blocks=blocks: blocks)
            y_few, z_few, stats_few = LG._launch_fused_half(x, w, *vf, chain, groups, eps, True,
                                                            float_out=True)
            assert torch.equal(y_few, y32), blocks
            assert torch.equal(z_few, z) and torch.equal(stats_few, stats), blocks
        monkeypatch.undo()
        if chain in LG._SPLIT_PRE_CHAINS:
            # y from Pre's swish rounded to z's dtype (gn_chains.cuh,
            # kSplitPre), as the reference under autocast holds it: no
            # worse against float64 than eager's float32 y from the same z
            truth32 = chain_on_z(z.double(), chain, groups, *[t.double() for t in vf[1:]], eps)
            with torch.autocast(device.type, dtype=dtype):
                eager32 = chain_on_z(z, chain, groups, *vf[1:], eps)
            assert eager32.dtype == torch.float32
            err32, eager_err32 = rel_error(y32, truth32), rel_error(eager32, truth32)
            assert err32 <= 1.5 * eager_err32, (err32, eager_err32)
        else:
            want, _ = GN._launch_forward(z, None, *vf[1:], chain, groups, eps, True, True,
                                         float_out=True)
            torch.testing.assert_close(y32, want, rtol=1e-4, atol=1e-4)


@pytest.fixture
def one_launch_everywhere(monkeypatch):
    """The rule says yes at every size (the test shapes are small), and the
    kernel's launches are counted, by chain."""
    launches = []
    launch = LG._run_one_launch

    def counted(*args, **kwargs):
        launches.append(args[7])  # the chain
        return launch(*args, **kwargs)

    monkeypatch.setattr(LG, "fusion_pays", lambda *shape: True)
    monkeypatch.setattr(LG, "_run_one_launch", counted)
    return launches


MODEL_CASES = [
    (37, (64, 256, 2, (256,)), (130, 64)),      # 128 channels per group, ragged batch
    (88, (72, 264, 33, (264,)), (96, 72)),      # 8, ragged features and K
    (94, (64, 256, (256,), 8), (1, 64)),        # 32, one row
]


# (model dtype, autocast dtype or None)
MODES = {"bf16": (torch.bfloat16, None), "fp16": (torch.float16, None),
         "amp-bf16": (torch.float32, torch.bfloat16), "amp-fp16": (torch.float32, torch.float16)}
CHAIN_OF = {37: "swish_bias_gn", 88: "gn_swish_mul_swish", 94: "bias_hardtanh_mish_gn"}


def _expect_one_launch(problem, args, amp, monkeypatch):
    """Whether the model's forward must take one launch (its group size is
    one the kernel takes: fewer with a float32 output, under autocast); if
    so, both two-launch forwards (the gn_chain op's, and the one inside the
    one-launch op) are made to fail."""
    groups = args[3] if problem == 94 else args[2]
    sizes = LG.HALF_FLOAT_OUT_GROUP_SIZES if amp else LG.HALF_GROUP_SIZES
    if args[1] // groups not in sizes:
        return False

    def not_called(*args, **kwargs):
        raise AssertionError("the two-launch path ran")

    # The gn_chain op holds its own reference to its forward.
    monkeypatch.setattr(GN._GN_CHAIN, "forward", not_called)
    monkeypatch.setattr(LG, "_gn_chain_forward", not_called)
    return True


def _check_launches(launches, problem, one_launch):
    if one_launch:
        assert launches and set(launches) == {CHAIN_OF[problem]}
    else:
        assert launches == []


@gpu
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("problem,args,shape", MODEL_CASES)
def test_models_take_one_launch_and_match_the_reference(problem, args, shape, mode, device,
                                                        monkeypatch, one_launch_everywhere):
    """Where the rule says so, the 16-bit models' forward, and the float32
    models' under autocast, is the one-launch kernel (no two-launch forward
    runs), and their output (in the reference's dtype) and every gradient
    are no worse than eager's against float64."""
    if not G.has_wgmma(device.index):
        pytest.skip("the one-launch kernel needs the Hopper GEMM engine (compute capability 9.0)")
    dtype, amp = MODES[mode]
    one_launch = _expect_one_launch(problem, args, amp, monkeypatch)
    # Through a GroupNorm with unit weights as the last op (37, 94), the
    # input's gradient of y.sum() is zero: its relative error would compare
    # rounding noise with rounding noise.
    for grad_mode in ("random",) if problem in (37, 94) else ("random", "sum"):
        errors = compare(problem, args, shape, dtype, device, seed=problem, grad_mode=grad_mode,
                         autocast=amp)
        bad = worse_than_eager(errors, amp or dtype)
        assert not bad, {name: errors[name] for name in bad}
    _check_launches(one_launch_everywhere, problem, one_launch)


@gpu
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=str)
@pytest.mark.parametrize("mode", ["bf16", "amp-bf16"])
@pytest.mark.parametrize("problem,args,shape", MODEL_CASES)
def test_one_launch_non_finite_input_lands_where_the_references_does(
        problem, args, shape, mode, value, device, monkeypatch, one_launch_everywhere):
    """One non-finite input element through the one-launch route: the NaN /
    +inf / -inf masks of the output and of every gradient equal eager's."""
    if not G.has_wgmma(device.index):
        pytest.skip("the one-launch kernel needs the Hopper GEMM engine (compute capability 9.0)")
    from cupy_fused.testing import build_pair, non_finite_masks

    dtype, amp = MODES[mode]
    ref, ours = build_pair(problem, args, device, dtype)
    gen = torch.Generator(device="cpu").manual_seed(problem)
    x = torch.rand(shape, generator=gen).to(device=device, dtype=dtype)
    x.view(-1)[x.numel() // 3] = value
    g = torch.randn(shape[0], args[1], generator=gen).to(device=device, dtype=torch.float32 if amp
                                                         else dtype)
    want = non_finite_masks(ref, x, g, amp)
    one_launch = _expect_one_launch(problem, args, amp, monkeypatch)
    got = non_finite_masks(ours, x, g, amp)
    _check_launches(one_launch_everywhere, problem, one_launch)
    for name, masks in want.items():
        for kind, a, b in zip(("nan", "+inf", "-inf"), masks, got[name]):
            assert torch.equal(a, b), (name, kind, a.sum().item(), b.sum().item())


@gpu
def test_one_launch_training_step_is_bitwise_reproducible(device, one_launch_everywhere):
    if not G.has_wgmma(device.index):
        pytest.skip("the one-launch kernel needs the Hopper GEMM engine (compute capability 9.0)")
    from cupy_fused.testing import build_pair

    problem, args, shape = MODEL_CASES[0]
    _, ours = build_pair(problem, args, device, torch.bfloat16)
    x = torch.randn(shape, device=device, dtype=torch.bfloat16)
    g = torch.randn(shape[0], args[1], device=device, dtype=torch.bfloat16)
    runs = []
    for _ in range(2):
        ours.zero_grad(set_to_none=True)
        xx = x.clone().requires_grad_(True)
        y = ours(xx)
        y.backward(g)
        runs.append([y.detach(), xx.grad] + [p.grad for p in ours.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@gpu
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_weight_off_the_grid_multiplies_as_an_aligned_one(compiled, device):
    """A bfloat16 weight off the 16-byte grid (tests/test_linear.py's
    test_half_operands_off_the_grid_multiply_as_aligned_ones): the output
    and the gradients are those of the aligned weight, bit for bit, as
    called and in a graph traced for the weight off the grid."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 14, generator=gen).to(device, torch.bfloat16)
    w = torch.randn(138, 14, generator=gen).to(device, torch.bfloat16)
    g = torch.randn(7, 138, generator=gen).to(device, torch.bfloat16)
    runs = []
    for weight in (off_the_grid(w), w):
        op = ops.linear_gn_chain
        if compiled:
            torch._dynamo.reset()  # (see test_linear.py's test)
            op = torch.compile(ops.linear_gn_chain, fullgraph=True)
        xx, ww = x.clone().requires_grad_(True), weight.detach().requires_grad_(True)
        y = op(xx, ww, None, "bias_hardtanh_mish_gn", 3)
        y.backward(g)
        runs.append((y, xx.grad, ww.grad))
    for a, b in zip(*runs):
        assert torch.equal(a, b)
