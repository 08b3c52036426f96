"""The float32 tensor-core GEMM (``ops.linear`` / ``ops.gemm``): accuracy of
the three products against float64 next to cuBLAS SGEMM's, ragged shapes,
unaligned operands, wide dynamic range, determinism, autograd, compile.
Plus the pure-Python parts (CPU tier)."""
import pytest
import torch

import cupy_fused
from cupy_fused import ops
from cupy_fused.ops import gemm as G
from cupy_fused.testing import poison_allocator, scaled_gemm_error

gpu = pytest.mark.gpu


# ---------------------------------------------------------------- CPU tier

def test_precision_setting_is_validated_and_restored():
    assert cupy_fused.get_fp32_matmul_precision() == "3xtf32"
    with pytest.raises(ValueError, match="precision must be one of '3xtf32', 'tf32', 'ieee'"):
        cupy_fused.set_fp32_matmul_precision("fp32")
    cupy_fused.set_fp32_matmul_precision("tf32")
    try:
        assert G.resolve_precision(None) == "tf32"
        assert G.resolve_precision("ieee") == "ieee"
    finally:
        cupy_fused.set_fp32_matmul_precision("3xtf32")
    with pytest.raises(ValueError, match="precision must be one of"):
        cupy_fused.GemmAddRelu(8, 16, (16,), precision="TF32")


def test_tiles_fit_in_shared_memory_and_split_evenly():
    for tile in G.TILES.values():
        for a_k, b_k in G.LAYOUTS.values():
            for passes in (1, 3):
                assert tile.shared_bytes(a_k, b_k, passes) <= 227 * 1024  # H100 / A100 opt-in limit
        assert tile.bm % 32 == 0 and tile.bn % 64 == 0
    # the wgmma kernel: mbarriers + 3 stages of raw A, raw B and two B planes
    assert G.TILES["wgmma128x128"].shared_bytes(True, True) == 128 + 3 * (2 * 128 * 36 + 2 * 128 * 32) * 4
    # split B: mbarriers + 4 stages of raw A and two B planes
    assert G.TILES["wgmma128x128_split_b"].shared_bytes(True, False) == 128 + 4 * (128 * 36 + 2 * 128 * 32) * 4


@pytest.mark.parametrize("wgmma", [False, True])
def test_tile_choice(monkeypatch, wgmma):
    monkeypatch.setattr(G, "sm_count", lambda dev: 132)
    monkeypatch.setattr(G, "has_wgmma", lambda dev: wgmma)
    assert G.choose_tile(1024, 8192, True, 0) == ("wgmma128x128" if wgmma else "128x128")
    # many rows of C, B's planes no larger than A: B is split once beforehand (wgmma only)
    assert G.choose_tile(G.SPLIT_B_MIN_ROWS, 2048, True, 0) == (
        "wgmma128x128_split_b" if wgmma else "128x128")
    assert G.choose_tile(G.SPLIT_B_MIN_ROWS, 4096, True, 0, passes=1) == (
        "wgmma128x128_split_b" if wgmma else "128x128")
    assert G.choose_tile(G.SPLIT_B_MIN_ROWS, 4096, True, 0) == (  # planes 2 x 4096 rows > A
        "wgmma128x128" if wgmma else "128x128")
    assert G.choose_tile(G.SPLIT_B_MIN_ROWS - 1, 1024, True, 0) == (
        "wgmma128x128" if wgmma else "128x128")
    assert G.choose_tile(1024, 8192, False, 0) == "64x64"  # unaligned rows: word loads
    assert G.choose_tile(256, 256, True, 0) == "64x64"  # too few 128x128 tiles to fill the GPU
    assert G.available_tiles(0) == (
        ("wgmma128x128", "wgmma128x128_split_b") if wgmma else ()) + ("128x128", "64x64")


def test_gemm_on_tile_refuses_rows_the_16_byte_loads_cannot_take():
    a, b = torch.rand(8, 6), torch.rand(8, 6)  # contiguous extent 6: rows not 16-byte aligned
    with pytest.raises(ValueError, match="rows start on 16 bytes"):
        G._gemm_on_tile(a, b, "forward", 3, "64x64")
    with pytest.raises(ValueError, match=r"non-empty sum \(K >= 1\)"):
        G._gemm_on_tile(torch.rand(8, 0), torch.rand(8, 0), "forward", 1, "wgmma128x128")


def test_gemm_kernels_need_compute_capability_8_0(monkeypatch):
    """Below 8.0 (V100, T4: no TF32 tensor cores, no cp.async) the float32
    products take cuBLAS SGEMM; the kernel file still compiles there (its
    bodies trap), see the compile check for sm_75."""
    from cupy_fused import _runtime

    for cap, expected in (((7, 0), False), ((7, 5), False), ((8, 0), True), ((8, 6), True),
                          ((9, 0), True), ((12, 0), True)):
        monkeypatch.setattr(_runtime, "device_capability", lambda dev, cap=cap: cap)
        assert G.has_tf32_tensor_cores(0) is expected


def test_wgmma_needs_compute_capability_9_0_and_can_be_switched_off(monkeypatch):
    from cupy_fused import _runtime

    for cap, expected in (((9, 0), True), ((8, 0), False), ((10, 0), False), ((12, 0), False)):
        monkeypatch.setattr(_runtime, "device_capability", lambda dev, cap=cap: cap)
        assert G.has_wgmma(0) is expected
        assert _runtime.arch_options(0) == (("-arch=sm_90a",) if expected else ())
    monkeypatch.setattr(_runtime, "device_capability", lambda dev: (9, 0))
    G.set_wgmma_enabled(False)
    try:
        assert not G.has_wgmma(0)
    finally:
        G.set_wgmma_enabled(True)
    assert G.has_wgmma(0)


def test_short_sums_take_sgemm_under_3xtf32_only():
    assert G.uses_sgemm(3, 0) and G.uses_sgemm(3, G.SGEMM_BELOW_INNER - 1)
    assert not G.uses_sgemm(3, G.SGEMM_BELOW_INNER) and not G.uses_sgemm(1, 1)
    assert G.uses_sgemm(1, 0)  # an empty sum never reaches a tile kernel
    a = torch.empty(5, 7)
    assert G._inner_size(a, "forward") == G._inner_size(a, "grad_input") == 7
    assert G._inner_size(a, "grad_weight") == 5


def test_every_kernel_variant_is_declared():
    # one instantiation per key, except that the split-B kernel reads B's
    # planes whatever B's layout (the split kernel takes the layout)
    unsplit = {key: e for key, e in G.KERNELS.expressions.items() if not G.TILES[key[0]].split_b}
    assert len(set(unsplit.values())) == len(unsplit)
    split = {e for key, e in G.KERNELS.expressions.items() if G.TILES[key[0]].split_b}
    assert len(split) == 2 * 2 and not split & set(unsplit.values())  # passes x A's layout
    assert len(set(G.SPLIT_B_KERNELS.expressions.values())) == 4  # passes x B's layout
    for layout in G.LAYOUTS:
        for passes in (1, 3):
            assert ("64x64", passes, layout, False) in G.KERNELS.expressions


@pytest.fixture
def past_device_check(monkeypatch):
    from cupy_fused import _validation

    monkeypatch.setattr(_validation, "DEVICE_TYPES", ("cuda", "cpu"))


def test_linear_validation(past_device_check):
    x, w = torch.rand(4, 8), torch.rand(16, 8)
    with pytest.raises(ValueError, match=r"x must have 8 features \(weight is \[16, 8\]\)"):
        ops.linear(torch.rand(4, 7), w)
    with pytest.raises(ValueError, match="weight must be 2-D"):
        ops.linear(x, torch.rand(16, 8, 1))
    with pytest.raises(TypeError, match="weight must have the dtype of x"):
        ops.linear(x, w.half())
    with pytest.raises(ValueError, match=r"bias must hold one value per channel \(16 values"):
        ops.linear(x, w, torch.rand(15))
    with pytest.raises(ValueError, match="activation must be None or 'relu', got 'gelu'"):
        ops.linear(x, w, activation="gelu")
    with pytest.raises(ValueError, match="precision must be one of"):
        ops.linear(x, w, precision="fast")
    with pytest.raises(ValueError, match="x must have at least 1 dimension"):
        ops.linear(torch.tensor(1.0), w)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cublas_relu_backward_keeps_its_output_for_one_use(dtype, past_device_check):
    """The eager node gates with the output it kept, then drops it; a second
    backward through a retained graph recomputes it (same gradients); an
    output modified in place after the forward is refused, as autograd
    refuses a modified saved tensor."""
    gen = torch.Generator().manual_seed(5)
    x = (torch.rand(7, 33, generator=gen) - 0.5).to(dtype)
    w = torch.randn(19, 33, generator=gen).to(dtype)
    b = torch.randn(19, generator=gen).to(dtype)
    dy = torch.randn(7, 19, generator=gen).to(dtype)
    leaves = [t.clone().requires_grad_(True) for t in (x, w, b)]
    y = ops.linear(*leaves, activation="relu", precision="ieee")
    assert (y == 0).any() and (y > 0).any()
    assert y.grad_fn.kept_output is not None
    y.backward(dy, retain_graph=True)
    assert y.grad_fn.kept_output is None  # dropped by the first backward
    first = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    y.backward(dy)  # recomputes the gate
    for again, once in zip(leaves, first):
        assert torch.equal(again.grad, once)
    ref = [t.clone().requires_grad_(True) for t in (x, w, b)]
    torch.relu(torch.nn.functional.linear(*ref)).backward(dy)
    for ours, theirs in zip(first, ref):
        torch.testing.assert_close(ours, theirs.grad)
    y = ops.linear(*leaves, activation="relu", precision="ieee")
    with torch.no_grad():
        y.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward(dy)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cublas_relu_route_uses_cublas_epilogues(dtype, past_device_check):
    """float16/bfloat16 and "ieee" (here on CPU tensors, the same torch ops):
    cuBLASLt's bias + ReLU epilogue (_addmm_activation), and a backward from
    the output that gives eager's gradients."""
    gen = torch.Generator().manual_seed(4)
    x = (torch.rand(6, 40, generator=gen) - 0.5).to(dtype)
    w = torch.randn(24, 40, generator=gen).to(dtype)
    b = torch.randn(24, generator=gen).to(dtype)
    with torch.no_grad():
        y = ops.linear(x, w, b, activation="relu", precision="ieee")
    assert torch.equal(y, torch._addmm_activation(b, x, w.t()))
    assert (y == 0).any() and (y > 0).any()
    leaves = [t.clone().requires_grad_(True) for t in (x, w, b)]
    y = ops.linear(*leaves, activation="relu", precision="ieee")
    assert torch.equal(y, torch._addmm_activation(b, x, w.t()))
    dy = torch.randn(y.shape, generator=gen).to(dtype)
    y.backward(dy)
    ref = [t.clone().requires_grad_(True) for t in (x, w, b)]
    torch.relu(torch.nn.functional.linear(*ref)).backward(dy)
    for ours, theirs in zip(leaves, ref):
        torch.testing.assert_close(ours.grad, theirs.grad)
    with torch.no_grad():  # no bias: the GEMM and relu_
        assert torch.equal(ops.linear(x, w, None, activation="relu", precision="ieee"),
                           torch.relu(x @ w.t()))
    # Traced (the registered custom op, then relu_ on its output): the same.
    torch._dynamo.reset()
    compiled = torch.compile(lambda *t: ops.linear(*t, activation="relu", precision="ieee"),
                             backend="aot_eager", fullgraph=True)
    traced = [t.clone().requires_grad_(True) for t in (x, w, b)]
    y2 = compiled(*traced)
    y2.backward(dy)
    assert torch.equal(y2, y)
    for ours, again in zip(leaves, traced):
        assert torch.equal(ours.grad, again.grad)


# ---------------------------------------------------------------- GPU tier

def _operands(layout, m, k, n, device, gen, spread=0):
    """Random operands of one product; ``spread`` > 0 scales the rows of the
    left and the columns of the right operand by powers of two in
    [2^-spread, 2^spread]."""
    rand = lambda *s: torch.rand(*s, device=device, generator=gen, dtype=torch.float64) * 2 - 1  # noqa: E731

    def scales(count):
        return torch.exp2(torch.randint(-spread, spread + 1, (count,), device=device,
                                        generator=gen).double())

    if layout == "forward":  # x [m, k], W [n, k] -> x W^T
        a, b = rand(m, k), rand(n, k)
        if spread:
            a, b = a * scales(m)[:, None], b * scales(n)[:, None]
        return a.float(), b.float(), lambda a, b: a @ b.t()
    if layout == "grad_input":  # dz [m, n'], W [n', k]; here (m, k, n) = rows, inner, cols
        a, b = rand(m, k), rand(k, n)
        if spread:
            a, b = a * scales(m)[:, None], b * scales(n)[None, :]
        return a.float(), b.float(), lambda a, b: a @ b
    a, b = rand(k, m), rand(k, n)  # grad_weight: a^T b
    if spread:
        a, b = a * scales(m)[None, :], b * scales(n)[None, :]
    return a.float(), b.float(), lambda a, b: a.t() @ b


SHAPES = [(1, 1, 1), (3, 5, 7), (17, 33, 9), (129, 67, 200), (257, 1029, 130), (64, 128, 64),
          (300, 4096, 520), (1024, 1024, 2048), (4100, 300, 516)]


@gpu
@pytest.mark.parametrize("layout", list(G.LAYOUTS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("spread", [0, 20])
def test_3xtf32_at_least_as_accurate_as_sgemm(layout, shape, spread, device):
    m, k, n = shape
    gen = torch.Generator(device=device).manual_seed(m * 7 + k * 3 + n)
    a, b, ref = _operands(layout, m, k, n, device, gen, spread)
    poison_allocator(device, 4 * m * n)
    ours = G._gemm(a, b, layout, 3)
    sgemm = ref(a, b)
    e_ours, e_sgemm = scaled_gemm_error(ours, a, b, ref), scaled_gemm_error(sgemm, a, b, ref)
    if k >= 256 and m * n >= 2**20:
        # Outputs this large run on cuBLAS kernels without split-k, whose
        # float32 sums are as long as k: the chunked 3xTF32 accumulation wins.
        assert e_ours <= e_sgemm, (e_ours, e_sgemm)
    else:
        # Short sums: SGEMM's error is near one rounding (2^-24 = 6e-8) while
        # 3xTF32 keeps ~22 bits of each operand (the split's own error, up to
        # 2^-22 per operand, and the dropped small*small term).  Small outputs
        # with long sums: cuBLAS splits k and its error drops to ~4e-8, ours
        # measured up to 2x that.  Both stay within a few float32 roundings.
        assert e_ours <= 2.0 ** -20, (e_ours, e_sgemm)
    tf32 = G._gemm(a, b, layout, 1)
    assert scaled_gemm_error(tf32, a, b, ref) < 2e-3


def _run_tile(name, a, b, layout, passes):
    """One product on tile kernel ``name``, into a NaN-poisoned output."""
    m, n = G._product_shape(a, b, layout)
    return G._gemm_on_tile(a, b, layout, passes, name,
                           out=torch.full((m, n), float("nan"), device=a.device))


@gpu
@pytest.mark.parametrize("layout", list(G.LAYOUTS))
@pytest.mark.parametrize("shape", [(4, 40, 4), (132, 36, 252), (260, 1028, 132), (128, 64, 128),
                                   (700, 2080, 300)], ids=lambda s: "x".join(map(str, s)))
def test_every_tile_kernel_on_ragged_shapes(layout, shape, device):
    """Each 16-byte-load tile kernel directly (the size rule picks 128x128
    tiles only for products that fill the GPU), on sizes that are multiples
    of 4 (the 16-byte loads need that) but not of the tiles: every element
    written, 3xTF32 and TF32 errors as for the default choice, the same bits
    on a second run."""
    m, k, n = shape
    gen = torch.Generator(device=device).manual_seed(m + 5 * k + 11 * n)
    for spread in (0, 20):
        a, b, ref = _operands(layout, m, k, n, device, gen, spread)
        sgemm_error = scaled_gemm_error(ref(a, b), a, b, ref)
        for name in G.available_tiles(device.index):
            ours = _run_tile(name, a, b, layout, 3)
            assert not ours.isnan().any(), name
            err = scaled_gemm_error(ours, a, b, ref)
            assert err <= max(2.0 ** -20, sgemm_error), (name, spread, err, sgemm_error)
            assert torch.equal(ours, _run_tile(name, a, b, layout, 3)), name
            tf32 = _run_tile(name, a, b, layout, 1)
            assert not tf32.isnan().any() and scaled_gemm_error(tf32, a, b, ref) < 2e-3, name


@gpu
def test_gemm_takes_the_wgmma_kernel_on_hopper(device, monkeypatch):
    """A product that fills the GPU with 128x128 tiles runs on the wgmma
    kernel on compute capability 9.0 (and on mma.sync when it is off), both
    at least as accurate as SGEMM there."""
    idx = device.index
    if not G.has_wgmma(idx):
        pytest.skip("wgmma needs compute capability 9.0 (H100/H200)")
    m, k, n = 1536, 2048, 1540  # long sums: where the chunked accumulation beats SGEMM
    assert G.choose_tile(m, n, True, idx) == "wgmma128x128"
    gen = torch.Generator(device=device).manual_seed(7)
    for layout in G.LAYOUTS:
        a, b, ref = _operands(layout, m, k, n, device, gen)
        ours = G._gemm(a, b, layout, 3)
        assert torch.equal(ours, _run_tile("wgmma128x128", a, b, layout, 3))
        # B split beforehand: the same split, the same products, the same bits
        assert torch.equal(ours, _run_tile("wgmma128x128_split_b", a, b, layout, 3))
        assert torch.equal(G._gemm(a, b, layout, 1),
                           _run_tile("wgmma128x128_split_b", a, b, layout, 1))
        G.set_wgmma_enabled(False)
        try:
            mma_sync = G._gemm(a, b, layout, 3)
        finally:
            G.set_wgmma_enabled(True)
        assert torch.equal(mma_sync, _run_tile("128x128", a, b, layout, 3))
        e_sgemm = scaled_gemm_error(ref(a, b), a, b, ref)
        for out in (ours, mma_sync):
            assert scaled_gemm_error(out, a, b, ref) <= e_sgemm, layout


@gpu
@pytest.mark.parametrize("layout", list(G.LAYOUTS))
def test_unaligned_operands_take_the_word_load_kernel(layout, device):
    """An operand whose rows do not start on 16 bytes (an offset view) takes
    the word-by-word loads and gives the same sums as the 16-byte loads."""
    m, k, n = 72, 48, 64
    gen = torch.Generator(device=device).manual_seed(1)
    a, b, ref = _operands(layout, m, k, n, device, gen)
    a_off = torch.empty(a.numel() + 1, device=device)[1:].view_as(a).copy_(a)
    assert a_off.data_ptr() % 16 != 0
    out = G._gemm(a_off, b, layout, 3)
    assert torch.equal(out, G._gemm(a, b, layout, 3))  # same sums, only the loads differ
    assert scaled_gemm_error(out, a, b, ref) <= 2.0 ** -20


@gpu
@pytest.mark.parametrize("layout", list(G.LAYOUTS))
def test_bitwise_reproducible(layout, device):
    gen = torch.Generator(device=device).manual_seed(2)
    a, b, _ = _operands(layout, 300, 777, 260, device, gen)
    assert torch.equal(G._gemm(a, b, layout, 3), G._gemm(a, b, layout, 3))


@gpu
def test_short_sums_run_on_sgemm_per_product(device):
    """in_features 8: the forward and input-gradient products (sums of 8 and
    24 terms) are cuBLAS's; the weight gradient (a sum over 40 rows) is the
    kernel's."""
    gen = torch.Generator(device=device).manual_seed(4)
    x = torch.rand(40, 8, device=device, generator=gen).requires_grad_(True)
    w = torch.randn(24, 8, device=device, generator=gen).requires_grad_(True)
    b = torch.randn(24, device=device, generator=gen).requires_grad_(True)
    y = ops.linear(x, w, b, activation="relu")
    assert torch.equal(y, torch.relu(x @ w.t() + b))  # the GEMM, then bias_relu
    dy = torch.randn(40, 24, device=device, generator=gen)
    y.backward(dy)
    dz = torch.where(y > 0, dy, 0.0)
    assert torch.equal(x.grad, dz @ w.detach())
    assert torch.equal(w.grad, G._gemm(dz, x.detach(), "grad_weight", 3))
    assert not torch.equal(w.grad, dz.t() @ x.detach())  # tells the two paths apart


@gpu
def test_zero_inner_dimension_gives_bias(device):
    x, w, bias = torch.rand(5, 0, device=device), torch.rand(7, 0, device=device), torch.randn(7, device=device)
    torch.testing.assert_close(ops.linear(x, w, bias, activation="relu"),
                               torch.relu(bias).expand(5, 7), rtol=0, atol=0)
    # Sizes that would take the wgmma kernel, whose consumers would wait for
    # a first k-tile forever: every precision, and the GEMM entry point itself.
    x, w, bias = torch.rand(2048, 0, device=device), torch.rand(2048, 0, device=device), torch.randn(2048, device=device)
    for precision in ("3xtf32", "tf32"):
        torch.testing.assert_close(ops.linear(x, w, bias, precision=precision),
                                   bias.expand(2048, 2048), rtol=0, atol=0)
    for layout, (a, b) in {"forward": (x, w), "grad_input": (x, w.t().contiguous()),
                           "grad_weight": (x.t().contiguous(), w.t().contiguous())}.items():
        assert torch.equal(G._gemm(a, b, layout, 1), torch.zeros(2048, 2048, device=device)), layout


@gpu
def test_non_finite_inputs_stay_non_finite(device):
    x, w = torch.rand(4, 64, device=device), torch.rand(8, 64, device=device)
    x[1, 3], x[2, 5] = float("inf"), float("nan")
    y = ops.linear(x, w)
    assert not torch.isfinite(y[1]).any() and torch.isnan(y[2]).all()
    torch.testing.assert_close(y[[0, 3]], x[[0, 3]] @ w.t(), rtol=1e-5, atol=1e-5)
    assert torch.isinf(ops.linear(x, w, precision="ieee")[1]).all()


def _eager_linear(x, w, bias, act):
    y = torch.nn.functional.linear(x, w, bias)
    return torch.relu(y) if act == "relu" else y


@gpu
@pytest.mark.parametrize("precision", ["3xtf32", "ieee"])
@pytest.mark.parametrize("act", [None, "relu"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_linear_forward_and_gradients_against_float64(precision, act, with_bias, device):
    torch.manual_seed(3)
    m, k, n = 133, 257, 190
    leaves64 = [torch.rand(m, k, device=device, dtype=torch.float64) * 2 - 1,
                torch.randn(n, k, device=device, dtype=torch.float64) / 16,
                torch.randn(n, device=device, dtype=torch.float64) if with_bias else None]
    dy = torch.randn(m, n, device=device, dtype=torch.float64)

    def run(fn, dtype):
        leaves = [t.detach().to(dtype).requires_grad_(True) if t is not None else None
                  for t in leaves64]
        y = fn(*leaves)
        y.backward(dy.to(dtype))
        return [y] + [t.grad for t in leaves if t is not None]

    truth = run(lambda x, w, b: _eager_linear(x, w, b, act), torch.float64)
    eager = run(lambda x, w, b: _eager_linear(x, w, b, act), torch.float32)
    poison_allocator(device, 4 * m * n)
    ours = run(lambda x, w, b: ops.linear(x, w, b, activation=act, precision=precision),
               torch.float32)
    for name, o, e, t in zip(["y", "x.grad", "w.grad", "b.grad"], ours, eager, truth):
        err_o = ((o.double() - t).abs().max() / t.abs().max()).item()
        err_e = ((e.double() - t).abs().max() / t.abs().max()).item()
        assert err_o <= 1.5 * err_e + 1e-7, (name, err_o, err_e)


@gpu
def test_linear_keeps_leading_dimensions_and_compiles(device):
    x = torch.rand(2, 3, 40, device=device, requires_grad=True)
    w = torch.randn(24, 40, device=device, requires_grad=True)
    b = torch.randn(24, device=device, requires_grad=True)
    y = ops.linear(x, w, b, activation="relu")
    assert y.shape == (2, 3, 24)
    dy = torch.randn_like(y)
    y.backward(dy)
    grads = [x.grad, w.grad, b.grad]
    x.grad = w.grad = b.grad = None
    torch._dynamo.reset()
    fn = torch.compile(lambda x, w, b: ops.linear(x, w, b, activation="relu"), fullgraph=True)
    y2 = fn(x, w, b)
    y2.backward(dy)
    torch.testing.assert_close(y2, y, rtol=0, atol=0)
    for g1, g2 in zip(grads, [x.grad, w.grad, b.grad]):
        torch.testing.assert_close(g1, g2, rtol=0, atol=0)


@gpu
@pytest.mark.parametrize("with_bias", [True, False])
def test_fused_relu_store_matches_the_training_path(with_bias, device):
    """Without autograd, bias + ReLU run in the GEMM's store; with it, in the
    bias_relu kernel (1-bit mask for the backward): the same float32 sums."""
    gen = torch.Generator(device=device).manual_seed(5)
    x = torch.rand(70, 96, device=device, generator=gen) - 0.5
    w = torch.randn(130, 96, device=device, generator=gen)
    b = torch.randn(130, device=device, generator=gen) if with_bias else None
    with torch.no_grad():
        fused = ops.linear(x, w, b, activation="relu")
    y = ops.linear(x.requires_grad_(True), w, b, activation="relu")
    assert y.grad_fn is not None and torch.equal(fused, y)
    assert (y == 0).any() and (y > 0).any()


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_takes_the_cublas_path(dtype, device):
    x = torch.rand(9, 32, device=device, dtype=dtype)
    w = torch.randn(16, 32, device=device, dtype=dtype)
    b = torch.randn(16, device=device, dtype=dtype)
    truth = torch.relu(torch.nn.functional.linear(x.double(), w.double(), b.double()))
    eager_err = (torch.relu(torch.nn.functional.linear(x, w) + b).double() - truth).abs().max()
    with torch.no_grad():
        y = ops.linear(x, w, b, activation="relu")
    assert torch.equal(y, torch._addmm_activation(b, x, w.t()))
    assert (y.double() - truth).abs().max() <= eager_err  # the bias is added before rounding
    y = ops.linear(x.requires_grad_(True), w, b, activation="relu")
    assert y.grad_fn is not None and torch.equal(y.detach(), torch._addmm_activation(b, x, w.t()))


# ---------------------------------------------------------------- autocast op (CPU tier)
#
# ``ops.linear`` under autocast (here with autocast_dtype patched, on CPU
# tensors: the same torch ops; the float32-output GEMM, aten::mm.dtype, has
# a CUDA kernel only, so _mm_to takes its fallback here, the product in the
# autocast dtype then cast, which is what autograd's casts give).

def _graph_nodes(t):
    """Names of every autograd node reachable from ``t``."""
    seen, stack, names = set(), [t.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        stack.extend(n for n, _ in node.next_functions)
    return names


def test_mm_to_writes_the_requested_dtype():
    assert G.MM_OUT_DTYPE == hasattr(torch.ops.aten.mm, "dtype")
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(5, 7, generator=gen).bfloat16()
    b = torch.randn(7, 3, generator=gen).bfloat16()
    assert torch.equal(G._mm_to(a, b, torch.bfloat16), a @ b)
    out = G._mm_to(a, b, torch.float32)  # CPU: the fallback
    assert out.dtype == torch.float32 and torch.equal(out, (a @ b).float())
    assert torch.equal(G._mm_to(a, b, torch.float64), (a @ b).double())
    if G.MM_OUT_DTYPE:  # the call _mm_to makes on CUDA, as the installed torch's schema has it
        meta = torch.mm(a.to("meta"), b.to("meta"), out_dtype=torch.float32)
        assert meta.dtype == torch.float32 and meta.shape == (5, 3)


@pytest.mark.parametrize("x_dims", [2, 3])
@pytest.mark.parametrize("activation", [None, "relu"])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("amp", [torch.bfloat16, torch.float16], ids=str)
def test_linear_under_autocast_is_one_node_with_float32_gradients(
        amp, with_bias, activation, x_dims, past_device_check, monkeypatch):
    """Float32 x, W, bias under autocast: the output is F.linear's on the
    casts (the same addmm / mm), the gradients float32 from one node whose
    next functions are the leaves (no cast nodes), x's and W's equal to
    autograd's casts' (bitwise here: the fallback computes what they do),
    the bias's summed in float32; the node saves the casts."""
    monkeypatch.setattr(G, "autocast_dtype", lambda: amp)
    gen = torch.Generator().manual_seed(6)
    shape = (7, 33) if x_dims == 2 else (2, 4, 33)
    x = torch.rand(shape, generator=gen) - 0.5
    w, b = torch.randn(19, 33, generator=gen), torch.randn(19, generator=gen)
    dy = torch.randn(shape[:-1] + (19,), generator=gen).to(amp)
    leaves = [t.clone().requires_grad_(True) for t in (x, w, b)][:3 if with_bias else 2]
    y = ops.linear(*leaves, activation=activation)
    ref = [t.clone().requires_grad_(True) for t in (x, w, b)][:3 if with_bias else 2]
    y_ref = torch.nn.functional.linear(*[t.to(amp) for t in ref])
    y_ref = torch.relu(y_ref) if activation else y_ref
    assert y.dtype == amp and torch.equal(y, y_ref)
    assert "ToCopyBackward0" not in _graph_nodes(y)
    if activation is None and x_dims == 2:  # x's cast saved, W's kept for one use
        assert [t.dtype for t in y.grad_fn.saved_tensors] == [amp]
    y.backward(dy)
    y_ref.backward(dy)
    for ours, theirs in zip(leaves, ref):
        assert ours.grad.dtype == torch.float32
    assert torch.equal(leaves[0].grad, ref[0].grad) and torch.equal(leaves[1].grad, ref[1].grad)
    if with_bias:
        exact = dy.double().reshape(-1, 19) * (y > 0).reshape(-1, 19) if activation else \
            dy.double().reshape(-1, 19)
        torch.testing.assert_close(leaves[2].grad, exact.sum(0).float())


def test_linear_under_autocast_keeps_half_operands_and_their_dtypes(past_device_check,
                                                                   monkeypatch):
    """A bfloat16 input meeting float32 parameters: x's gradient in bfloat16,
    W's in float32; a bfloat16 operand is saved itself, not copied."""
    monkeypatch.setattr(G, "autocast_dtype", lambda: torch.bfloat16)
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(6, 16, generator=gen).bfloat16().requires_grad_(True)
    w = torch.randn(8, 16, generator=gen).requires_grad_(True)
    y = ops.linear(x, w)
    (saved_x,) = y.grad_fn.saved_tensors
    assert saved_x.data_ptr() == x.data_ptr()
    y.backward(torch.ones_like(y))
    assert x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    torch.testing.assert_close(w.grad, (torch.ones(6, 8).bfloat16().t() @ x.detach()).float())
    with pytest.raises(TypeError, match="bias must have dtype torch.bfloat16, got torch.int64"):
        ops.linear(x, w, torch.ones(8, dtype=torch.int64))


def test_autocast_linear_retained_graph_recasts_the_weight(past_device_check, monkeypatch):
    """The weight's cast is dropped by the first backward (before dW is
    allocated); a second backward through a retained graph recasts it, and
    refuses if the weight changed in place meanwhile."""
    monkeypatch.setattr(G, "autocast_dtype", lambda: torch.bfloat16)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(5, 12, generator=gen).requires_grad_(True)
    w = torch.randn(4, 12, generator=gen).requires_grad_(True)
    y = ops.linear(x, w)
    g = torch.randn(5, 4, generator=gen).bfloat16()
    y.backward(g, retain_graph=True)
    first = (x.grad.clone(), w.grad.clone())
    y.backward(g, retain_graph=True)
    assert torch.equal(x.grad, 2 * first[0]) and torch.equal(w.grad, 2 * first[1])
    with torch.no_grad():
        w.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward(g)


def test_autocast_linear_without_bias_gradient(past_device_check):
    """bias_grad=False (linear_gn_chain's GEMM): the bias is in the product,
    its gradient left to the caller."""
    gen = torch.Generator().manual_seed(9)
    x, w = torch.randn(5, 12, generator=gen), torch.randn(4, 12, generator=gen)
    b = torch.randn(4, generator=gen).requires_grad_(True)
    x.requires_grad_(True)
    z = G._run_autocast_linear(x, w, b, torch.bfloat16, bias_grad=False)
    assert torch.equal(z, torch.addmm(b.detach().bfloat16(), x.detach().bfloat16(),
                                      w.bfloat16().t()))
    z.sum().backward()
    assert b.grad is None and x.grad.dtype == torch.float32 and w.grad is None


def test_autocast_linear_traces_under_compile(past_device_check, monkeypatch):
    """fullgraph torch.compile (the registered custom ops): eager's output
    and gradients, bit for bit."""
    monkeypatch.setattr(G, "autocast_dtype", lambda: torch.bfloat16)
    gen = torch.Generator().manual_seed(10)
    x, w, b = torch.randn(9, 24, generator=gen), torch.randn(16, 24, generator=gen), \
        torch.randn(16, generator=gen)
    dy = torch.randn(9, 16, generator=gen).bfloat16()
    eager = [t.clone().requires_grad_(True) for t in (x, w, b)]
    y = ops.linear(*eager)
    y.backward(dy)
    torch._dynamo.reset()
    compiled = torch.compile(lambda *t: ops.linear(*t), backend="aot_eager", fullgraph=True)
    traced = [t.clone().requires_grad_(True) for t in (x, w, b)]
    y2 = compiled(*traced)
    y2.backward(dy)
    assert torch.equal(y2, y)
    for a, c in zip(eager, traced):
        assert c.grad.dtype == torch.float32 and torch.equal(a.grad, c.grad)
