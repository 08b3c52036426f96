"""The column sums' second stage (``ops._common._reduce_partials``,
``kernels_cu/column_reduce.cu``) on its own: every backward's parameter
gradients go through it (test_bias_relu and test_gn_chain check them there)."""
import pytest
import torch

from cupy_fused.ops import _common

CHUNKS = [1, 7, 8, 9, 63, 64, 65, 128, 256, 528, 1000]


def _partial(chunks, slots, channels, device, integral):
    g = torch.Generator(device=device).manual_seed(chunks * 1009 + slots * 31 + channels)
    if integral:  # exact in double whatever the order: the sum itself is checked
        return torch.randint(-2**20, 2**20, (chunks, slots, channels), generator=g,
                             device=device).double()
    # Magnitudes over six decades, sums within float16's range.
    return torch.randn((chunks, slots, channels), generator=g, device=device,
                       dtype=torch.float64) * 10.0 ** torch.randint(
                           -6, 1, (chunks, slots, channels), generator=g, device=device)


def _reduce(partial, dtype, **kw):
    """_reduce_partials, its output's memory first filled with NaN: the
    caching allocator hands the freed block to the op's torch.empty."""
    chunks, slots, channels = partial.shape
    rows = slots + 1 if kw.get("duplicate_first_row") else slots
    poison = torch.full((rows, channels), float("nan"), dtype=dtype, device=partial.device)
    del poison
    return _common._reduce_partials(partial, dtype, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("chunks", CHUNKS)
@pytest.mark.parametrize("slots, channels", [(1, 1), (1, 31), (2, 33), (2, 128), (3, 8192)])
def test_sums_every_chunk_of_every_column(device, chunks, slots, channels):
    partial = _partial(chunks, slots, channels, device, integral=True)
    got = _reduce(partial, torch.float32)
    # Integers below 2^31: their double sum is exact in every order, and
    # rounds to float as the reference's does.
    assert torch.equal(got, partial.sum(0).float())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("chunks", [9, 528])
def test_double_sums_rounded_to_the_dtype_and_repeatable(device, dtype, chunks):
    partial = _partial(chunks, 2, 200, device, integral=False)
    first = _reduce(partial, dtype)
    assert first.dtype == dtype and first.shape == (2, 200)
    want = partial.sum(0)
    # The double sum differs from torch's only in its order (relative 1e-14
    # of the terms' magnitudes); rounded (through float) to the dtype it is
    # the dtype's rounding of the exact sum or a neighbour of it.  A float
    # accumulation, or a chunk left out, lands further off.
    scale = partial.abs().sum(0)
    info = torch.finfo(dtype)
    assert ((first.double() - want).abs()
            <= want.abs() * info.eps + info.smallest_normal + 1e-12 * scale).all()
    for _ in range(3):
        assert torch.equal(_common._reduce_partials(partial, dtype), first)


@pytest.mark.gpu
def test_duplicated_first_row(device):
    partial = _partial(65, 2, 40, device, integral=True)
    got = _reduce(partial, torch.float32, duplicate_first_row=True)
    assert got.shape == (3, 40)
    want = partial.sum(0).float()
    assert torch.equal(got[:2], want) and torch.equal(got[2], want[0])


@pytest.mark.gpu
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_partials_reach_their_column(device, value):
    partial = _partial(100, 1, 64, device, integral=True)
    partial[57, 0, 5] = value
    got = _reduce(partial, torch.float32)
    want = partial.sum(0).float()
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got[~got.isnan()],
                                                                   want[~want.isnan()])


def test_reduce_warps():
    """A column's warps: a power of two, at most REDUCE_MAX_WARPS, each
    with at least REDUCE_WARP_CHUNKS chunks where there are several, and
    as many as that allows."""
    assert [_common.reduce_warps(c) for c in (1, 16, 31, 32, 64, 128, 528, 10**6)] == \
        [1, 1, 1, 2, 4, 8, 32, 32]
    for chunks in range(1, 2000):
        w = _common.reduce_warps(chunks)
        assert w & (w - 1) == 0 and 1 <= w <= _common.REDUCE_MAX_WARPS
        assert w == 1 or chunks // w >= _common.REDUCE_WARP_CHUNKS
        assert w == _common.REDUCE_MAX_WARPS or chunks // (2 * w) < _common.REDUCE_WARP_CHUNKS
