"""The float32 tensor-core GEMM engine (``cupy_fused/ops/gemm.py``): accuracy
of the three products against float64 next to cuBLAS SGEMM's, ragged
shapes, unaligned operands, wide dynamic range, determinism, short and empty
sums, non-finite inputs.  Plus the pure-Python parts: tiles, the tile rule,
the declared kernels (CPU tier).  The ``linear`` op on top: test_linear.py."""
import pytest
import torch

from cupy_fused import ops, settings
from cupy_fused.ops import gemm as G
from cupy_fused.testing import (assert_non_finite_where, poison_allocator, rel_error, scaled_gemm_error,
                                worse_than_eager)

gpu = pytest.mark.gpu


# ---------------------------------------------------------------- CPU tier

def test_tiles_fit_in_shared_memory_and_split_evenly():
    for tile in G.TILES.values():
        for a_k, b_k in G.LAYOUTS.values():
            for passes in (1, 3):
                assert tile.shared_bytes(a_k, b_k, passes) <= 227 * 1024  # the H100's opt-in limit
        assert tile.bm % 32 == 0 and tile.bn % 64 == 0
    # the engine: alignment slack + 4 stages of A and two B planes (16 KiB each) + the mbarriers,
    # and B split in the kernel, 2 slots of raw B and their full / empty mbarriers
    split_b = G.TILES["engine128x128_split_b"]
    assert split_b.shared_bytes(False, False) == 1024 + 4 * 3 * 16384 + 2 * 4 * 8 + 16
    assert split_b.shared_bytes(True, True, 1) == 1024 + 4 * 2 * 16384 + 2 * 4 * 8 + 16
    assert G.TILES["engine128x128"].shared_bytes(True, False) == (
        1024 + 4 * 3 * 16384 + 2 * 16384 + 2 * 4 * 8 + 16 + 2 * 2 * 8)
    # what the tile rule sets against a device's limit: 4 stages of A and B,
    # 128 or 64 rows of 32 float32 (+4 of padding) each
    assert G.TILE_SHARED_BYTES["128x128"] == 4 * 2 * 128 * 36 * 4 == 147456
    assert G.TILE_SHARED_BYTES["64x64"] == 4 * 2 * 64 * 36 * 4 == 73728


@pytest.mark.parametrize("wgmma", [False, True])
def test_tile_choice(monkeypatch, wgmma):
    monkeypatch.setattr(G, "sm_count", lambda dev: 132)
    monkeypatch.setattr(G, "has_wgmma", lambda dev: wgmma)
    monkeypatch.setattr(G._runtime, "max_shared_bytes", lambda dev: 227 * 1024)
    assert G.choose_tile(1024, 8192, True, 0) == ("engine128x128" if wgmma else "128x128")
    # many rows of C, B's planes no larger than A: B is split once beforehand (wgmma only)
    assert G.choose_tile(G.SPLIT_B_MIN_ROWS, 2048, True, 0) == (
        "engine128x128_split_b" if wgmma else "128x128")
    assert G.choose_tile(G.SPLIT_B_MIN_ROWS, 4096, True, 0, passes=1) == (
        "engine128x128_split_b" if wgmma else "128x128")
    assert G.choose_tile(G.SPLIT_B_MIN_ROWS, 4096, True, 0) == (  # planes 2 x 4096 rows > A
        "engine128x128" if wgmma else "128x128")
    assert G.choose_tile(G.SPLIT_B_MIN_ROWS - 1, 1024, True, 0) == (
        "engine128x128" if wgmma else "128x128")
    assert G.choose_tile(1024, 8192, False, 0) == "64x64"  # unaligned rows: word loads
    assert G.choose_tile(256, 256, True, 0) == "64x64"  # too few 128x128 tiles to fill the GPU
    # an extent of 2^31 or more: past the copy engine's 32-bit coordinates
    assert G.choose_tile(1024, 8192, True, 0, k=2**31 - 1) == ("engine128x128" if wgmma else "128x128")
    assert G.choose_tile(1024, 8192, True, 0, k=2**31) == "128x128"
    assert G.choose_tile(2**31, 8192, True, 0) == "128x128"
    assert G.available_tiles(0) == (
        ("engine128x128", "engine128x128_split_b") if wgmma else ()) + ("128x128", "64x64")


@pytest.mark.parametrize("limit_kib", [99, 163])
def test_tile_choice_within_the_device_s_shared_memory(monkeypatch, limit_kib):
    """A GPU of compute capability 8.6 or 8.9 lets a block take 99 KiB
    of shared memory, too little for the 128x128 tile (144 KiB): its large
    products take 64x64.  An A100's 163 KiB takes the 128x128 tile."""
    monkeypatch.setattr(G, "sm_count", lambda dev: 84)
    monkeypatch.setattr(G, "has_wgmma", lambda dev: False)
    monkeypatch.setattr(G._runtime, "max_shared_bytes", lambda dev: limit_kib * 1024)
    fits = limit_kib >= 144
    assert G.choose_tile(2048, 2048, True, 0) == ("128x128" if fits else "64x64")
    assert G.choose_tile(2**31, 8192, True, 0) == ("128x128" if fits else "64x64")
    assert G.available_tiles(0) == (("128x128",) if fits else ()) + ("64x64",)


def test_gemm_on_tile_refuses_rows_the_16_byte_loads_cannot_take():
    a, b = torch.rand(8, 6), torch.rand(8, 6)  # contiguous extent 6: rows not 16-byte aligned
    with pytest.raises(ValueError, match="rows start on 16 bytes"):
        G._gemm_on_tile(a, b, "forward", 3, "64x64")
    with pytest.raises(ValueError, match=r"non-empty sum \(K >= 1\)"):
        G._gemm_on_tile(torch.rand(8, 0), torch.rand(8, 0), "forward", 1, "engine128x128")
    # The engine's tiles take extents below 2^31, as choose_tile gives them
    # (stride-0 views: no memory); the mma.sync tiles take any (on to the
    # check of out, which comes after).
    small, tall, wide = torch.rand(1, 4), torch.rand(1, 4).expand(2**31, 4), torch.rand(1, 1).expand(1, 2**31)
    for tile in ("engine128x128", "engine128x128_split_b"):
        for a, b in ((small, tall), (tall, small), (wide, wide)):  # N, M, K of 2^31
            with pytest.raises(ValueError, match=r"takes M, N and K below 2\^31"):
                G._gemm_on_tile(a, b, "forward", 1, tile)
    with pytest.raises(ValueError, match=r"out must be a contiguous \[1, 2147483648\]"):
        G._gemm_on_tile(small, tall, "forward", 1, "128x128", out=torch.empty(1, 1))


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
    with settings.gemm_wgmma(False):
        assert not G.has_wgmma(0)
    assert G.has_wgmma(0)


def test_short_sums_take_sgemm_under_3xtf32_only():
    assert G.uses_sgemm(3, 0) and G.uses_sgemm(3, G.SGEMM_BELOW_INNER - 1)
    assert not G.uses_sgemm(3, G.SGEMM_BELOW_INNER) and not G.uses_sgemm(1, 1)
    assert G.uses_sgemm(1, 0)  # an empty sum never reaches a tile kernel
    a = torch.empty(5, 7)
    assert G._inner_size(a, "forward") == G._inner_size(a, "grad_input") == 7
    assert G._inner_size(a, "grad_weight") == 5


def test_small_outputs_take_sgemm_under_3xtf32_only():
    """Fewer 128 x 128 tiles than SMs and at least SPLIT_K_PER_TILE k-values
    a tile, from SPLIT_K_INNER on (the kernel erred up to 2.2x cuBLAS's
    there), or below SHORT_SUM_INNER; an output of at most
    SGEMM_AT_MOST_ROWS rows or columns, or that fits one tile, whatever k
    (docs/gemm.md, "Small outputs, long sums").  Outputs that fill the GPU
    keep the kernel (problem 37's weight gradient: 4096 x 1024 over 32768
    rows)."""
    assert G.uses_sgemm(3, 1024, 64, 256, 132) and G.uses_sgemm(3, 1024, 1024, 256, 132)
    assert G.uses_sgemm(3, 4096, 1024, 1024, 132)  # 64 tiles: 2048 <= 4096
    assert not G.uses_sgemm(3, 1024, 1024, 1024, 132)  # 64 tiles: 2048 > 1024
    assert G.uses_sgemm(3, 256, 33, 40, 132) and G.uses_sgemm(3, 512, 256, 256, 132)
    assert G.uses_sgemm(3, 256, 64, 1024, 132)  # 8 tiles: 256 <= 256
    assert not G.uses_sgemm(3, 256, 512, 512, 132)  # 16 tiles: 512 > 256
    assert not G.uses_sgemm(3, 255, 33, 140, 132)  # below SPLIT_K_INNER
    assert not G.uses_sgemm(3, 4096, 64, 256, 2)  # 2 tiles fill a GPU of 2 SMs
    assert G.uses_sgemm(3, 64, 16, 256, 132) and G.uses_sgemm(3, 64, 256, 1, 132)  # few rows / cols
    assert not G.uses_sgemm(3, 64, 17, 256, 132) and not G.uses_sgemm(1, 64, 1, 256, 132)
    # one 128 x 128 tile, whatever k; two tiles keep the kernel
    assert G.uses_sgemm(3, 64, 33, 40, 132) and G.uses_sgemm(3, 255, 128, 128, 132)
    assert not G.uses_sgemm(3, 64, 129, 128, 132) and not G.uses_sgemm(3, 64, 128, 129, 132)
    assert not G.uses_sgemm(1, 64, 33, 40, 132) and not G.uses_sgemm(3, 64)
    # sums below SHORT_SUM_INNER over fewer tiles than SMs; outputs that fill the GPU keep the kernel
    assert G.uses_sgemm(3, 32, 200, 300, 132) and G.uses_sgemm(3, G.SHORT_SUM_INNER - 1, 1024, 1024, 132)
    assert not G.uses_sgemm(3, G.SHORT_SUM_INNER, 200, 300, 132)
    assert not G.uses_sgemm(3, 32, 4096, 4096, 132) and not G.uses_sgemm(3, 32, 200, 300, 6)
    assert not G.uses_sgemm(3, 32768, 4096, 1024, 132)  # 256 tiles: fills the GPU
    assert not G.uses_sgemm(1, 4096, 64, 256, 132)  # one TF32 pass keeps the kernel
    assert not G.uses_sgemm(3, 4096)  # no output size given: the short-sum rule alone


def test_float32_weight_route(monkeypatch):
    """Autocast inference's rule (pure logic, on CPU tensors): on a wgmma GPU
    of 132 SMs, x of CONVERT_MIN_ROWS to CONVERT_MAX_ROWS rows in at least
    66 tiles of 128 x 256 takes the float32-weight product; a row more or
    fewer, a tile fewer, a 16-bit weight, W's rows not a multiple of 8 or
    unaligned rows of x do not; without wgmma nothing does."""
    monkeypatch.setattr(G, "has_wgmma", lambda dev: True)
    monkeypatch.setattr(G, "sm_count", lambda dev: 132)
    limit, k = G.CONVERT_MAX_ROWS, 64
    x = torch.empty(limit, k, dtype=torch.bfloat16)
    enough = torch.empty(128 * 17, k)        # 17 x 4 tiles: 2 x 68 >= 132
    too_few = torch.empty(128 * 16, k)       # 16 x 4 tiles: 2 x 64 < 132
    assert G._routes_float32_weight(x, enough)
    assert not G._routes_float32_weight(torch.empty(limit + 1, k, dtype=torch.bfloat16), enough)
    assert not G._routes_float32_weight(x, too_few)
    assert not G._routes_float32_weight(x, enough.to(torch.bfloat16))
    assert not G._routes_float32_weight(x, torch.empty(128 * 17 - 4, k))
    assert not G._routes_float32_weight(torch.empty(limit, k + 1, dtype=torch.bfloat16)[:, :k], enough)
    fewest = G.CONVERT_MIN_ROWS  # 2 tiles of x's rows: 33 of W's make 66
    assert G._routes_float32_weight(torch.empty(fewest, k, dtype=torch.bfloat16), torch.empty(128 * 33, k))
    assert not G._routes_float32_weight(torch.empty(fewest - 1, k, dtype=torch.bfloat16),
                                        torch.empty(128 * 33, k))
    monkeypatch.setattr(G, "has_wgmma", lambda dev: False)
    assert not G._routes_float32_weight(x, enough)


def test_every_kernel_variant_is_declared():
    # one instantiation per key
    assert len(set(G.KERNELS.expressions.values())) == len(G.KERNELS.expressions)
    assert len(set(G.SPLIT_IMAGE_KERNELS.expressions.values())) == 4  # passes x B's layout
    for layout in G.LAYOUTS:
        for passes in (1, 3):
            assert ("64x64", passes, layout, False) in G.KERNELS.expressions


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
    """A product that fills the GPU with 128x128 tiles runs on the engine on
    compute capability 9.0 (and on mma.sync when wgmma is off), both at
    least as accurate as SGEMM there."""
    idx = device.index
    if not G.has_wgmma(idx):
        pytest.skip("wgmma needs compute capability 9.0 (H100/H200)")
    m, k, n = 1536, 2048, 1540  # long sums: where the chunked accumulation beats SGEMM
    assert G.choose_tile(m, n, True, idx) == "engine128x128"
    gen = torch.Generator(device=device).manual_seed(7)
    for layout in G.LAYOUTS:
        a, b, ref = _operands(layout, m, k, n, device, gen)
        ours = G._gemm(a, b, layout, 3)
        assert torch.equal(ours, _run_tile("engine128x128", a, b, layout, 3))
        # B split beforehand: the same split, the same products, the same bits
        assert torch.equal(ours, _run_tile("engine128x128_split_b", a, b, layout, 3))
        assert torch.equal(G._gemm(a, b, layout, 1), _run_tile("engine128x128_split_b", a, b, layout, 1))
        with settings.gemm_wgmma(False):
            mma_sync = G._gemm(a, b, layout, 3)
        assert torch.equal(mma_sync, _run_tile("128x128", a, b, layout, 3))
        e_sgemm = scaled_gemm_error(ref(a, b), a, b, ref)
        for out in (ours, mma_sync):
            assert scaled_gemm_error(out, a, b, ref) <= e_sgemm, layout


@gpu
@pytest.mark.parametrize("layout", list(G.LAYOUTS))
def test_engine_blocks_that_walk_many_tiles(layout, device, monkeypatch):
    """The engine's persistent blocks on grids of 1, 2 and 5 (so that each
    walks several of the 9 tiles), with 7 k-tiles a tile (a multiple of
    neither the 4 stages nor B's 2 raw slots, so the rings' phases wrap
    within and across tiles): the same bits as on a full grid, from both
    loaders (B split in the kernel, or beforehand), 3 passes and 1."""
    if not G.has_wgmma(device.index):
        pytest.skip("the engine needs compute capability 9.0")
    m, k, n = 300, 200, 260
    gen = torch.Generator(device=device).manual_seed(13)
    a, b, ref = _operands(layout, m, k, n, device, gen, spread=20)
    tiles = ("engine128x128", "engine128x128_split_b")
    for passes in (3, 1):
        full = {name: _run_tile(name, a, b, layout, passes) for name in tiles}
        assert torch.equal(full[tiles[0]], full[tiles[1]])
        bound = max(2.0 ** -20, scaled_gemm_error(ref(a, b), a, b, ref)) if passes == 3 else 2e-3
        assert scaled_gemm_error(full[tiles[0]], a, b, ref) <= bound
        for blocks in (1, 2, 5):
            monkeypatch.setattr(G, "sm_count", lambda device_index, blocks=blocks: blocks)
            for name in tiles:
                assert torch.equal(_run_tile(name, a, b, layout, passes), full[name]), (name, blocks)
        monkeypatch.undo()


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
    """in_features 20: the forward product (sums of 20 terms) and the input
    gradient (a 64 x 20 output: one tile) are cuBLAS's; the weight gradient
    (a sum over 64 rows, of a 140 x 20 output: two tiles) is the kernel's."""
    gen = torch.Generator(device=device).manual_seed(4)
    x = torch.rand(64, 20, device=device, generator=gen).requires_grad_(True)
    w = torch.randn(140, 20, device=device, generator=gen).requires_grad_(True)
    b = torch.randn(140, device=device, generator=gen).requires_grad_(True)
    y = ops.linear(x, w, b, activation="relu")
    assert torch.equal(y, torch.relu(x @ w.t() + b))  # the GEMM, then bias_relu
    dy = torch.randn(64, 140, device=device, generator=gen)
    y.backward(dy)
    dz = torch.where(y > 0, dy, 0.0)
    assert torch.equal(x.grad, dz @ w.detach())
    assert torch.equal(w.grad, G._gemm(dz, x.detach(), "grad_weight", 3))
    assert not torch.equal(w.grad, dz.t() @ x.detach())  # tells the two paths apart


@gpu
def test_long_sums_over_small_outputs_run_on_sgemm(device):
    """2048 rows of 64 features into 24: the weight gradient (a sum of 2048
    terms over one tile) is cuBLAS's, the forward (64 terms over 16 tiles)
    the kernel's; forwards of 1024 features over a 64 x 256 output and of
    256 or 64 over 33 x 40 (one tile, where the kernel erred up to 2.2x
    SGEMM's) and of 32 over 200 x 300 (6 tiles) are cuBLAS's."""
    gen = torch.Generator(device=device).manual_seed(6)
    x = torch.rand(2048, 64, device=device, generator=gen).requires_grad_(True)
    w = (torch.randn(24, 64, device=device, generator=gen) / 8).requires_grad_(True)
    y = ops.linear(x, w)
    assert torch.equal(y, G._gemm(x.detach(), w.detach(), "forward", 3))
    dy = torch.randn(2048, 24, device=device, generator=gen)
    y.backward(dy)
    assert torch.equal(w.grad, dy.t() @ x.detach())
    assert not torch.equal(w.grad, G._gemm(dy, x.detach(), "grad_weight", 3))
    x2 = torch.rand(64, 1024, device=device, generator=gen)
    w2 = torch.randn(256, 1024, device=device, generator=gen) / 32
    assert torch.equal(ops.linear(x2, w2), x2 @ w2.t())
    assert not torch.equal(G._gemm(x2, w2, "forward", 3), x2 @ w2.t())
    x3 = torch.rand(33, 256, device=device, generator=gen)
    w3 = torch.randn(40, 256, device=device, generator=gen) / 16
    assert torch.equal(ops.linear(x3, w3), x3 @ w3.t())
    assert not torch.equal(G._gemm(x3, w3, "forward", 3), x3 @ w3.t())  # the test bites
    x4, w4 = x3[:, :64].contiguous(), w3[:, :64].contiguous()
    assert torch.equal(ops.linear(x4, w4), x4 @ w4.t())
    assert not torch.equal(G._gemm(x4, w4, "forward", 3), x4 @ w4.t())
    x5 = torch.rand(200, 32, device=device, generator=gen)
    w5 = torch.randn(300, 32, device=device, generator=gen) / 4
    assert torch.equal(ops.linear(x5, w5), x5 @ w5.t())
    assert not torch.equal(G._gemm(x5, w5, "forward", 3), x5 @ w5.t())


@gpu
def test_zero_inner_dimension_gives_bias(device):
    x, w = torch.rand(5, 0, device=device), torch.rand(7, 0, device=device)
    bias = torch.randn(7, device=device)
    torch.testing.assert_close(ops.linear(x, w, bias, activation="relu"),
                               torch.relu(bias).expand(5, 7), rtol=0, atol=0)
    # Sizes that would take the engine with a non-empty sum: every
    # precision, and the GEMM entry point itself.
    x, w = torch.rand(2048, 0, device=device), torch.rand(2048, 0, device=device)
    bias = torch.randn(2048, device=device)
    for precision in ("3xtf32", "tf32"):
        torch.testing.assert_close(ops.linear(x, w, bias, precision=precision),
                                   bias.expand(2048, 2048), rtol=0, atol=0)
    for layout, (a, b) in {"forward": (x, w), "grad_input": (x, w.t().contiguous()),
                           "grad_weight": (x.t().contiguous(), w.t().contiguous())}.items():
        assert torch.equal(G._gemm(a, b, layout, 1), torch.zeros(2048, 2048, device=device)), layout


def _physical(layout, a_log, b_log):
    """The operands of ``layout`` whose product is ``a_log`` [M, K] times
    ``b_log`` [K, N] (see :data:`cupy_fused.ops.gemm.LAYOUTS`)."""
    a = a_log if G.LAYOUTS[layout][0] else a_log.t()
    b = b_log.t() if G.LAYOUTS[layout][1] else b_log
    return a.contiguous(), b.contiguous()


# The routes of the non-finite tests: each tile kernel, and the word-load
# kernel, which takes operands whose rows are off the 16-byte grid.
ROUTES = list(G.TILES) + ["word_loads"]


def _route_shape(route, device):
    """(m, k, n) of a non-finite test on ``route``, which is skipped where it
    does not run: rows off the 16-byte grid for the word loads."""
    if route != "word_loads" and route not in G.available_tiles(device.index):
        pytest.skip(f"{route} does not run on this device")
    return (200, 72, 264) if route != "word_loads" else (201, 71, 263)


def _product_on_route(route, layout, a_log, b_log, passes, device):
    """a_log @ b_log on ``route``, the operands in ``layout``."""
    a, b = _physical(layout, a_log.to(device), b_log.to(device))
    if route == "word_loads":
        assert not G._rows_aligned(a, a.shape[1])
        return G._gemm(a, b, layout, passes)
    return _run_tile(route, a, b, layout, passes)


@gpu
@pytest.mark.parametrize("passes", [3, 1])
@pytest.mark.parametrize("layout", list(G.LAYOUTS))
@pytest.mark.parametrize("route", ROUTES)
def test_non_finite_operands_land_where_sgemm_puts_them(route, layout, passes, device):
    """NaN, +inf and -inf in both operands: the product's NaN / +inf / -inf
    masks equal float64's (SGEMM's) on every kernel, layout and pass count.
    Half of each operand's values are exact in TF32, so 3xTF32's correction
    products meet an infinite big part with a zero small part (inf * 0), and
    the rest with small parts of either sign; finite outputs stay as
    accurate as without the non-finite values."""
    m, k, n = _route_shape(route, device)
    gen = torch.Generator(device="cpu").manual_seed(7)

    def values(*shape):  # half exact in TF32 (quarters), half not
        v = torch.rand(*shape, generator=gen) * 2 - 1
        return torch.where(torch.rand(*shape, generator=gen) < 0.5, torch.round(v * 4) / 4 + 0.25, v)

    a_log, b_log = values(m, k), values(k, n)
    inf, nan = float("inf"), float("nan")
    a_log[1, 3], a_log[2, 5], a_log[3, 7] = inf, nan, -inf
    a_log[4, 2], a_log[4, 9] = inf, -inf        # a NaN row (inf - inf)
    a_log[6, 70] = nan                          # NaN at the end of a row
    b_log[9, 4], b_log[11, 6], b_log[0, 100] = inf, -inf, nan
    b_log[:, 8] = 0.0                           # a zero column meets row 1's inf: NaN

    got = _product_on_route(route, layout, a_log, b_log, passes, device)
    want = a_log.double() @ b_log.double()
    assert_non_finite_where(got.cpu(), want)
    assert int(torch.isinf(want).sum()) > 500 and int(torch.isnan(want).sum()) > 500  # the test bites
    finite = torch.isfinite(want)
    clean = _product_on_route(route, layout, torch.nan_to_num(a_log, 0, 0, 0),
                              torch.nan_to_num(b_log, 0, 0, 0), passes, device)
    torch.testing.assert_close(got.cpu()[finite], clean.cpu()[finite], rtol=0, atol=0)


@gpu
@pytest.mark.parametrize("layout", list(G.LAYOUTS))
@pytest.mark.parametrize("route", ROUTES)
def test_operands_at_the_float32_range_end_stay_finite(route, layout, device):
    """Operands within TF32 rounding of FLT_MAX (to_tf32 rounds their big
    part up to inf, so the 3xTF32 sum is NaN): the redo gives SGEMM's finite
    product, on every kernel (the split-B one reads B itself, not its
    planes)."""
    m, k, n = _route_shape(route, device)
    gen = torch.Generator(device="cpu").manual_seed(11)
    a_log, b_log = torch.rand(m, k, generator=gen) - 0.5, torch.rand(k, n, generator=gen) - 0.5
    big = torch.tensor(3.4028e38)
    assert torch.isfinite(big) and big.view(torch.int32) >= 0x7f7ff000
    a_log[3, 5], b_log[7, 9] = big, -big
    a_log[3, 7] = 2.0 ** -10  # (row 3 meets column 9 through both values, and stays finite)
    got = _product_on_route(route, layout, a_log, b_log, 3, device)
    want = a_log.double() @ b_log.double()
    finite = torch.isfinite(want) & (want.abs() < 3e38)
    assert finite[3].sum() > 100 and finite[:, 9].sum() > 100
    assert torch.isfinite(got.cpu()[finite]).all()
    torch.testing.assert_close(got.cpu().double()[finite], want[finite], rtol=1e-5, atol=1e-3)


@gpu
@pytest.mark.parametrize("layout", list(G.LAYOUTS))
@pytest.mark.parametrize("route", ROUTES)
def test_tf32_operands_at_the_float32_range_end_overflow_where_cublas_tf32_does(
        route, layout, device, monkeypatch):
    """One TF32 pass: FLT_MAX (every mantissa bit set, which TF32's rounding
    to nearest takes to inf) in each operand gives +-inf exactly where
    cuBLAS's own TF32 product (allow_tf32) gives it; FLT_MAX (1 - 2^-12),
    which rounds down, gives none in either."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", True)
    m, k, n = _route_shape(route, device)
    gen = torch.Generator(device="cpu").manual_seed(13)
    top = torch.finfo(torch.float32).max
    for big, overflows in [(top, True), (top * (1 - 2**-12), False)]:
        a_log, b_log = torch.rand(m, k, generator=gen), torch.rand(k, n, generator=gen) / 64
        a_log[3, 5], a_log[8, 1], b_log[7, 9] = big, -big, big
        a_log[3, 7] = 0.0  # (row 3 meets column 9 through one of them only: finite in exact sums)
        got = _product_on_route(route, layout, a_log, b_log, 1, device)
        want = a_log.to(device) @ b_log.to(device)
        assert_non_finite_where(got, want, big)
        assert bool(torch.isinf(want).any()) == overflows


# ---------------------------------------------------------------- 16-bit engine (Hopper)

HALF = [torch.float16, torch.bfloat16]
# (M, K, N): ragged M (the TMA store clips rows), K not a multiple of the
# 64-deep k-tile, N not a multiple of the 128-column tile, N % 8 != 0 (rows
# TMA cannot store: the register store), one row, a K of one 16-byte row.
HALF_SHAPES = [(1, 8, 8), (129, 72, 257), (1000, 1024, 300), (257, 200, 1032), (37, 64, 4100),
               (128, 64, 128)]


def _half_operands(m, k, n, dtype, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed + m + k + n)
    x = torch.randn(m, k, generator=g).to(device=device, dtype=dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(device=device, dtype=dtype)
    b = torch.randn(n, generator=g).to(device=device, dtype=dtype)
    return x, w, b


def _needs_half_engine(x, w):
    """Skips below compute capability 9.0; there, the engine must take x W^T
    (every shape here is one it supports)."""
    if not G.has_wgmma(x.device.index):
        pytest.skip("the 16-bit engine needs compute capability 9.0")
    assert G._uses_half_engine(x, w)


@gpu
@pytest.mark.parametrize("activation", [0, 1])
@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("shape", HALF_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_half_engine_against_float64(shape, dtype, activation, device):
    """act(x W^T + bias) into NaN: error against float64 no worse than
    cuBLAS's (1.5x, plus a unit of rounding), with and without the bias."""
    m, k, n = shape
    x, w, b = _half_operands(m, k, n, dtype, device)
    _needs_half_engine(x, w)
    for bias in (b, None):
        truth = x.double() @ w.double().t() + (bias.double() if bias is not None else 0)
        cublas = torch.addmm(bias, x, w.t()) if bias is not None else torch.mm(x, w.t())
        if activation:
            truth, cublas = truth.relu(), cublas.relu()
        poison_allocator(device, 2 * m * n)
        ours = G._half_linear(x, w, bias, activation,
                              out=torch.full((m, n), float("nan"), device=device, dtype=dtype))
        errors = {"out": (rel_error(ours, truth), rel_error(cublas, truth))}
        assert not worse_than_eager(errors, dtype), errors


@gpu
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=str)
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_half_engine_non_finite_lands_where_cublas_puts_it(value, dtype, device):
    """A non-finite element of x (and one of W): NaN / +inf / -inf of the
    product, and through the ReLU (NaN kept), where cuBLAS and torch put them."""
    x, w, b = _half_operands(200, 72, 264, dtype, device)
    _needs_half_engine(x, w)
    x[17, 5] = value
    w[100, 3] = value
    for activation in (0, 1):
        want = torch.addmm(b, x, w.t())
        want = want.relu() if activation else want
        got = G._half_linear(x, w, b, activation)
        assert_non_finite_where(got, want, activation)


# The engine's operand layouts (_half_matmul): a [M, K] contiguous (K-major)
# or a transposed view (M-major); b [K, N] a transposed view (K-major) or
# contiguous (N-major): x W^T is "kk", dZ W "kn", dZ^T x "mn".  (M, K, N)
# ragged against the 128 x 128 x 64 tiles, multiples of 8 (every dimension
# is some layout's contiguous one, whose rows the copy engine reads in
# 16-byte units).
LAYOUTS = {"kk": (False, False), "kn": (False, True), "mn": (True, True), "mk": (True, False)}
LAYOUT_SHAPES = [(8, 8, 8), (200, 72, 136), (1000, 520, 264), (136, 1032, 1000)]


def _layout_operands(m, k, n, layout, dtype, device):
    g = torch.Generator(device="cpu").manual_seed(m + 3 * k + 7 * n)
    a = torch.randn(m, k, generator=g).to(device=device, dtype=dtype)
    b = (torch.randn(k, n, generator=g) / k ** 0.5).to(device=device, dtype=dtype)
    a_mn, b_mn = LAYOUTS[layout]
    a_op = a.t().contiguous().t() if a_mn else a  # M-major: the transpose of a contiguous [K, M]
    b_op = b if b_mn else b.t().contiguous().t()  # K-major: the transpose of a contiguous [N, K]
    return a_op, b_op


@gpu
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("shape", LAYOUT_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_half_engine_layouts_against_float64(shape, dtype, layout, device):
    """a @ b in each operand layout, into NaN: error against float64 no
    worse than cuBLAS's on the same views (1.5x, plus a unit of rounding);
    two runs bitwise equal."""
    m, k, n = shape
    if not G.has_wgmma(device.index):
        pytest.skip("the 16-bit engine needs compute capability 9.0")
    a, b = _layout_operands(m, k, n, layout, dtype, device)
    assert (a.stride(0) == 1) == LAYOUTS[layout][0] and (b.stride(1) == 1) == LAYOUTS[layout][1]
    truth = a.double() @ b.double()
    poison_allocator(device, 2 * m * n)
    ours = G._half_matmul(a, b, out=torch.full((m, n), float("nan"), device=device, dtype=dtype))
    errors = {"out": (rel_error(ours, truth), rel_error(a @ b, truth))}
    assert not worse_than_eager(errors, dtype), errors
    assert torch.equal(ours, G._half_matmul(a, b))


@gpu
def test_half_matmul_refuses_what_it_cannot_read(device):
    if not G.has_wgmma(device.index):
        pytest.skip("the 16-bit engine needs compute capability 9.0")
    a, b = _layout_operands(64, 64, 64, "kn", torch.bfloat16, device)
    for bad_a, bad_b in ((a.float(), b.float()), (a, b.half()), (a[:, 1:], b[1:]),
                         (a, b[:56]), (a[:0], b)):
        with pytest.raises(ValueError, match="_half_matmul needs"):
            G._half_matmul(bad_a, bad_b)
    with pytest.raises(ValueError, match="out must be a contiguous"):
        G._half_matmul(a, b, out=torch.empty(64, 65, device=device, dtype=torch.bfloat16))


@gpu
def test_half_engine_is_bitwise_reproducible_and_refuses_what_it_cannot_run(device):
    x, w, b = _half_operands(1000, 1024, 1032, torch.bfloat16, device)
    _needs_half_engine(x, w)
    assert torch.equal(G._half_linear(x, w, b, 1), G._half_linear(x, w, b, 1))
    with pytest.raises(ValueError, match="half_linear needs"):
        G._half_linear(x.float(), w.float())
    with pytest.raises(ValueError, match="half_linear needs"):
        G._half_linear(x.view(-1)[1:1 + 999 * 1024].view(999, 1024), w)  # starts off 16 bytes
    with pytest.raises(ValueError, match="out must be a contiguous"):
        G._half_linear(x, w, out=torch.empty(1000, 1031, device=device, dtype=torch.bfloat16))


# ---------------------------------------------------------------- float32 weight (autocast)

# (M, K, N): ragged against the 128 x 256 tiles of z^T, one row, a K of one
# 16-byte row of x, K not a multiple of the 64-value k-tile, a single tile,
# N of one 8-row group.
F32W_SHAPES = [(1, 8, 8), (300, 72, 264), (257, 1000, 136), (1000, 1024, 1032), (64, 64, 64),
               (513, 200, 8)]


def _needs_float32_weight_engine(x_d, w):
    if not G.has_wgmma(x_d.device.index):
        pytest.skip("the float32-weight product needs compute capability 9.0")
    assert G._uses_float32_weight_engine(x_d, w)


@gpu
@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("shape", F32W_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_float32_weight_product_is_the_cast_weights_product(shape, dtype, device):
    """x_d W^T (+ bias) with W float32 rounded in the kernel: within cuBLAS's
    error on ``W.to(dtype)`` against float64 of that product, every element
    written (NaN-poisoned memory)."""
    m, k, n = shape
    x, _, b = _half_operands(m, k, n, dtype, device)
    g = torch.Generator(device="cpu").manual_seed(m * k + n)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(device)
    _needs_float32_weight_engine(x, w)
    w_d = w.to(dtype)
    for bias in (b, None):
        truth = x.double() @ w_d.double().t() + (bias.double() if bias is not None else 0)
        cublas = torch.addmm(bias, x, w_d.t()) if bias is not None else torch.mm(x, w_d.t())
        poison_allocator(device, 2 * m * n)
        z = G._linear_float32_weight(x, w, bias)
        assert z.dtype == dtype and z.shape == (m, n)
        errors = {"out": (rel_error(z, truth), rel_error(cublas, truth))}
        assert not worse_than_eager(errors, dtype), errors


@gpu
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), 1e38], ids=str)
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_float32_weight_non_finite_lands_where_the_cast_puts_it(value, dtype, device):
    """A non-finite element of W and of x, or a large one (1e38: inf in
    float16, a sum past float32's range in bfloat16): NaN / +inf / -inf
    where cuBLAS on the cast weight puts them."""
    x, _, _ = _half_operands(300, 72, 264, dtype, device)
    w = torch.randn(264, 72, device=device) / 8
    _needs_float32_weight_engine(x, w)
    w[100, 3] = value
    w[7, 70] = -value
    if value == 1e38:  # 4 x 1e38 overflows float32's sums: +inf at (17, 100) in bfloat16 too
        x[17, 3] = 4.0
    else:
        x[17, 5] = value
    want = torch.mm(x, w.to(dtype).t())
    assert not torch.isfinite(want).all()  # (the case has a non-finite output to place)
    got = G._linear_float32_weight(x, w)
    assert_non_finite_where(got, want)


@gpu
def test_float32_weight_is_bitwise_reproducible_and_refuses_what_it_cannot_run(device):
    x, _, b = _half_operands(1000, 1024, 1032, torch.bfloat16, device)
    w = torch.randn(1032, 1024, device=device)
    _needs_float32_weight_engine(x, w)
    assert torch.equal(G._linear_float32_weight(x, w, b), G._linear_float32_weight(x, w, b))
    for bad_x, bad_w in ((x.float(), w), (x, w.to(torch.bfloat16)), (x, w[:1030]),
                         (x.view(-1)[1:1 + 999 * 1024].view(999, 1024), w)):
        assert not G._uses_float32_weight_engine(bad_x, bad_w)
        with pytest.raises(ValueError, match="_linear_float32_weight needs"):
            G._linear_float32_weight(bad_x, bad_w)


@gpu
@pytest.mark.slow
@pytest.mark.parametrize("n", [32776, 32777], ids=["rows-16-byte", "rows-ragged"])
def test_products_past_2_pow_31_elements(n, device):
    """64-bit addressing in the stores: an output of 65536 x n values (past
    2^31), written whole (into NaN), its rows on both sides of element 2^31
    against float64: float32 through ops.linear (the engine's tiles on
    compute capability 9.0, bias + ReLU in the store) and, on 9.0, the 16-bit
    engine (TMA store for rows of whole 16 bytes, stores from registers
    for the others) against cuBLAS's error."""
    m, k = 65536, 32
    gen = torch.Generator(device="cpu").manual_seed(n)
    x, w, b = (t.to(device) for t in (torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen),
                                      torch.randn(n, generator=gen)))
    edge = 2**31 // n  # the row holding element 2^31
    rows = torch.tensor([0, 1, edge - 1, edge, edge + 1, m - 1], device=device)
    want = torch.relu(x[rows].double() @ w.double().t() + b.double())
    poison_allocator(device, 4 * m * n)
    y = ops.linear(x, w, b, "relu", precision="3xtf32")
    assert not y.isnan().any()
    assert rel_error(y[rows], want) <= 1e-5
    del y
    if not G.has_wgmma(device.index):
        return
    for dtype in HALF:
        xh, wh, bh = x.to(dtype), w.to(dtype), b.to(dtype)
        assert G._uses_half_engine(xh, wh)
        want = torch.relu(xh[rows].double() @ wh.double().t() + bh.double())
        theirs = torch.relu(xh[rows] @ wh.t() + bh)
        poison_allocator(device, 2 * m * n)
        y = G._half_linear(xh, wh, bh, 1)
        assert not y.isnan().any()
        assert rel_error(y[rows], want) <= 1.5 * rel_error(theirs, want) + torch.finfo(dtype).eps
        del y
