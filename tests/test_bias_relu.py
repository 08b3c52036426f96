"""bias_relu's vectorised kernels: launch arithmetic (CPU tier) and the
vectors' edges on the GPU — sizes that are not a multiple of the vector,
one row, NCHW slabs that start mid-vector, channel rows that cross mask
words, views that start mid-vector, small grids — against torch in float64."""
import collections
import importlib
import math
import re
import warnings

import pytest
import torch

from cupy_fused import _runtime, ops
from cupy_fused.ops import _common
from cupy_fused.ops._common import BLOCK
from cupy_fused.testing import assert_non_finite_where, poison_allocator

# The module (``cupy_fused.ops.bias_relu`` as an attribute is the op itself).
BR = importlib.import_module("cupy_fused.ops.bias_relu")

PAIRS = [(torch.float32, torch.float32), (torch.float16, torch.float16),
         (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32),
         (torch.bfloat16, torch.float32)]


def _pair_id(pair):
    z, o = pair
    return str(z).split(".")[1] + ("" if z == o else "-to-float32")


# ---------------------------------------------------------------- CPU tier

def test_slab_grids_cover_every_slab_once_in_grids_a_launch_takes():
    """The NCHW backward's block per (image, channel) slab: N * C may pass
    a grid's 2^31 - 1 blocks (an image of two values, 2^31 channel rows)."""
    assert BR.slab_grids(1) == [(0, 1)]
    assert BR.slab_grids(2**31 - 1) == [(0, 2**31 - 1)]
    assert BR.slab_grids(2**31) == [(0, 2**31 - 1), (2**31 - 1, 1)]
    for slabs, most in ((10, 3), (9, 3), (1, 3), (7, 7)):
        grids = BR.slab_grids(slabs, most)
        assert all(0 < count <= most for _, count in grids)
        assert [s for first, count in grids for s in range(first, first + count)] == list(range(slabs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_forward_grid_covers_the_tensor_once(dtype):
    """Two 16-byte vectors per thread: the grid covers every element, and one
    block fewer would not."""
    per_block = BLOCK * 2 * (16 // dtype.itemsize)
    for total in (1, 7, 8, 31, 32, 33, per_block - 1, per_block, per_block + 1, 1024 * 8192,
                  128 * 128 * 126 * 126, (1 << 31) + 1024):
        blocks = BR.forward_grid(total, dtype)
        assert blocks * per_block >= total > (blocks - 1) * per_block


def test_fast_divisor_divides_every_index_exactly():
    """The forward's FastDiv (multiply-high, add, shift; emulated here in
    32-bit unsigned arithmetic): n // d for every n below 2^31, at the
    divisors' edges and the ends of n's range; refuses what it cannot."""
    def divide(n, packed):
        m, s = packed & 0xFFFFFFFF, packed >> 32
        t = (n * m) >> 32
        assert t + n < 2**32  # no 32-bit overflow
        return (t + n) >> s

    gen = torch.Generator().manual_seed(3)
    divisors = list(range(1, 1100)) + [15876, 2**30 - 1, 2**30, 2**30 + 1, 2**31 - 1]
    divisors += torch.randint(1, 2**31 - 1, (300,), generator=gen).tolist()
    for d in divisors:
        packed = BR.fast_divisor(d)
        ns = [0, 1, d - 1, d, d + 1, 2 * d - 1, 2**31 - 2, 2**31 - 1]
        ns += torch.randint(0, 2**31 - 1, (40,), generator=gen).tolist()
        for n in ns:
            if 0 <= n < 2**31:
                assert divide(n, packed) == n // d, (n, d)
    for bad in (0, -1, 2**31):
        with pytest.raises(ValueError, match="fast divisor"):
            BR.fast_divisor(bad)
    assert BR._divisors(2**31, 7, 3) == (0, 0)  # the 64-bit path divides itself


def test_rows_launch_shapes():
    """Blocks of cols (a power of two, at most a warp) channel vectors by
    BLOCK // cols row groups; the channel vectors cover C once; chunks are
    never empty; the grid stays within what the GPU holds at once unless a
    single chunk already exceeds it."""
    for vector in (4, 8):
        for channels in (1, 3, 4, 5, 8, 9, 77, 96, 100, 128, 255, 256, 257, 8192, 65536):
            for rows in (1, 2, 7, 9, 255, 1024, 32768, 2032128):
                for resident in (1, 396, 528):
                    cols, grid_x, chunks, per = BR.rows_launch(
                        rows, channels, vector, resident)
                    vectors = math.ceil(channels / vector)
                    assert cols & (cols - 1) == 0 and 1 <= cols <= 32 and BLOCK % cols == 0
                    assert cols >= min(32, vectors)
                    assert grid_x == math.ceil(vectors / cols)
                    assert chunks * per >= rows > (chunks - 1) * per
                    assert 1 <= chunks <= 65535
                    assert grid_x * chunks <= max(resident, grid_x)
                    assert chunks <= math.ceil(rows / (BLOCK // cols))


def test_rows_launch_bounds_the_rows_a_thread_sums():
    """With max_rows, chunks enough that no thread of a block (BLOCK // cols
    row groups) has more rows than that, where 65535 chunks allow; plain
    float sums exactly where the bound holds and the gradient is 16-bit."""
    for vector in (4, 8):
        for channels in (5, 128, 8192):
            for rows in (1, 1024, 2032128, 10**9):
                for max_rows in (1, 2, BR.PLAIN_SUM_ROWS):
                    cols, grid_x, chunks, per = BR.rows_launch(rows, channels, vector, 396,
                                                               max_rows)
                    groups = BLOCK // cols
                    assert chunks * per >= rows > (chunks - 1) * per and 1 <= chunks <= 65535
                    fits = math.ceil(per / groups) <= max_rows
                    assert fits or math.ceil(rows / (groups * max_rows)) > 65535
                    assert chunks <= max(math.ceil(396 / grid_x), math.ceil(rows / (groups * max_rows)))
                    if max_rows == BR.PLAIN_SUM_ROWS:
                        for dtype in (torch.float16, torch.bfloat16, torch.float32):
                            assert BR.plain_sums(cols, per, dtype) == (fits and dtype != torch.float32)
    # Problem 1's channels-last backward (2032128 x 128) on 132 SMs keeps its
    # one wave of resident blocks, with plain sums.
    resident = 132 * BR.PLAIN_ROWS_BLOCKS_PER_SM
    cols, _, chunks, per = BR.rows_launch(2032128, 128, 8, resident, BR.PLAIN_SUM_ROWS)
    assert chunks == resident and BR.plain_sums(cols, per, torch.bfloat16)


def test_rows_launch_for_the_benchmark_shapes():
    """Problem 76's [1024, 8192] on an H100 (132 SMs): one wave of resident
    blocks, a few chunks, so that the float64 partials stay small next to
    dy and dz."""
    for dtype in (torch.float32, torch.float16):
        plain = dtype != torch.float32  # (the plain-sum variant's launch)
        resident = 132 * (BR.PLAIN_ROWS_BLOCKS_PER_SM if plain else BR.ROWS_BLOCKS_PER_SM[dtype])
        cols, grid_x, chunks, per = BR.rows_launch(
            1024, 8192, BR.VECTOR[dtype], resident, BR.PLAIN_SUM_ROWS if plain else None)
        assert cols == 32 and grid_x * chunks <= resident
        assert chunks * 8192 * 8 < 1024 * 8192 * dtype.itemsize // 8
        assert BR.plain_sums(cols, per, dtype) == plain


def test_rows_kernel_picks_plain_sums_where_the_bound_holds(monkeypatch):
    """The rows backward's variant: plain sums for a 16-bit gradient at 4
    blocks per SM where no thread gets more than PLAIN_SUM_ROWS rows,
    compensated sums at ROWS_BLOCKS_PER_SM for a float32 gradient (float32
    z, or autocast's 16-bit z with a float32 gradient) and where the grid's
    65535 chunks cannot keep to the bound."""
    cl_rows = 128 * 126 * 126  # problem 1's channels-last z: [N H W, 128]
    for z, grad in [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)]:
        kernel, launch = BR.rows_kernel(cl_rows, 128, z, grad, 132)
        assert kernel == "bias_relu_backward_rows_plain"
        assert launch == BR.rows_launch(cl_rows, 128, 8, 132 * BR.PLAIN_ROWS_BLOCKS_PER_SM,
                                        BR.PLAIN_SUM_ROWS)
    launch_of, asked = BR.rows_launch, []
    monkeypatch.setattr(BR, "rows_launch", lambda *args: asked.append(args) or launch_of(*args))
    for z, grad in [(torch.float32, torch.float32), (torch.bfloat16, torch.float32)]:
        asked.clear()
        kernel, launch = BR.rows_kernel(1024, 8192, z, grad, 132)
        assert kernel == "bias_relu_backward_rows"
        # (a float32 gradient asks for the compensated launch alone)
        assert asked == [(1024, 8192, BR.VECTOR[z], 132 * BR.ROWS_BLOCKS_PER_SM[z])]
        assert launch == launch_of(*asked[0])
    monkeypatch.setattr(BR, "rows_launch", launch_of)
    # 2^31 rows of one channel: at the grid's 65535 chunks a thread sums
    # `least` rows; a bound below that cannot be kept, one at it can.
    cols, _, chunks, per = BR.rows_launch(2**31, 1, 8, 132 * BR.PLAIN_ROWS_BLOCKS_PER_SM, 1)
    least = math.ceil(per / (BLOCK // cols))
    assert chunks == 65535 and least > 1
    monkeypatch.setattr(BR, "PLAIN_SUM_ROWS", least - 1)
    kernel, launch = BR.rows_kernel(2**31, 1, torch.bfloat16, torch.bfloat16, 132)
    assert kernel == "bias_relu_backward_rows"
    assert launch == BR.rows_launch(2**31, 1, 8, 132 * BR.ROWS_BLOCKS_PER_SM[torch.bfloat16])
    monkeypatch.setattr(BR, "PLAIN_SUM_ROWS", least)
    assert BR.rows_kernel(2**31, 1, torch.bfloat16, torch.bfloat16, 132)[0] == \
        "bias_relu_backward_rows_plain"


def test_rows_backward_launches_what_rows_kernel_chose(monkeypatch):
    """The rows backward's launch (on CPU tensors, the launches recorded
    instead of run): the kernel, grid and arguments rows_kernel gives, then,
    over 32 chunks or more, the column reduce over its chunks as a launch of
    its own; below that the kernel's own last blocks reduce, with the
    counters _column_counters gives."""
    from cupy_fused import _bridge

    launched = []
    monkeypatch.setattr(BR, "sm_count", lambda dev: 132)
    monkeypatch.setattr(_common, "sm_count", lambda dev: 132)
    monkeypatch.setattr(BR.KERNELS, "get", lambda key, dev: ("bias_relu",) + key)
    monkeypatch.setattr(_common._REDUCE, "get", lambda key, dev: ("reduce",) + key)
    monkeypatch.setattr(_bridge, "launch", lambda fn, grid, block, args, dev, *rest:
                        launched.append((fn, grid, block, args)))
    # Channels-last, 9600 rows of 128 channels: enough rows for the two
    # variants' launches (4 and 3 blocks per SM) to differ.
    sizes, rows = [2, 128, 80, 60], 9600
    assert BR.rows_kernel(rows, 128, torch.bfloat16, torch.bfloat16, 132)[1] != \
        BR.rows_kernel(rows, 128, torch.bfloat16, torch.float32, 132)[1]
    for grad in (torch.bfloat16, torch.float32):
        launched.clear()
        dy = torch.ones(sizes, dtype=grad).contiguous(memory_format=torch.channels_last)
        mask = torch.zeros(rows * 128 // 32, dtype=torch.int32)
        BR._backward(dy, mask, sizes, True, True, torch.bfloat16, False)
        kernel, (cols, grid_x, chunks, per) = BR.rows_kernel(rows, 128, torch.bfloat16, grad, 132)
        (fn, grid, block, args), reduce = launched
        assert fn == ("bias_relu", kernel, torch.bfloat16, grad, True)
        assert grid == (grid_x, chunks, 1) and block == BLOCK
        assert chunks >= 32 and args[-6:-2] == (rows, 128, per, cols) and args[-1] == 0
        assert reduce[0] == ("reduce", grad, _common.reduce_warps(chunks) > 1)
        assert reduce[3][2:4] == (chunks, 2 * 128)
    # 76's shape: 16 chunks, reduced by the kernel itself.
    counters = torch.zeros(64, dtype=torch.int32)
    monkeypatch.setattr(BR, "_column_counters", lambda chunks, ranges, device: counters)
    launched.clear()
    BR._backward(torch.ones(1024, 8192, dtype=torch.bfloat16), torch.zeros(1024 * 8192 // 32),
                 [1024, 8192], False, False, torch.bfloat16, False)
    kernel, (cols, grid_x, chunks, per) = BR.rows_kernel(1024, 8192, torch.bfloat16,
                                                         torch.bfloat16, 132)
    (fn, grid, block, args), = launched
    assert chunks < 32 and grid == (grid_x, chunks, 1)
    assert args[-6:-2] == (1024, 8192, per, cols) and args[-1] == counters.data_ptr()


def test_launch_constants_match_the_kernel_source():
    """ops/bias_relu.py mirrors two constants of bias_relu.cu: the forward's
    vectors per lane and the rows kernel's blocks per SM."""
    src = (_runtime.kernel_dir() / "bias_relu.cu").read_text()
    forward = src[src.index("bias_relu_forward("):]
    assert re.search(r"constexpr int kU = (\d+);", forward).group(1) == "2"
    assert BR._FORWARD_BLOCK_ELEMENTS[torch.float32] == BLOCK * 2 * 4
    m = re.search(r"kRowsBlocksPerSm = sizeof\(T\) == 4 \? (\d+) : \(kPlainSums \? (\d+) : (\d+)\);",
                  src)
    assert m, "kRowsBlocksPerSm's definition changed: update ROWS_BLOCKS_PER_SM and this test"
    assert BR.ROWS_BLOCKS_PER_SM == {
        torch.float32: int(m.group(1)), torch.float16: int(m.group(3)),
        torch.bfloat16: int(m.group(3))}
    assert BR.PLAIN_ROWS_BLOCKS_PER_SM == int(m.group(2))


# ---------------------------------------------------------------- GPU tier

# (shape, channels-last): tails not a multiple of 4 or 8, one row, C not a
# multiple of the vector (rows cross mask words mid-vector), C below the
# vector, NCHW with H*W below / not a multiple of / a multiple of 8, 1x1
# images, channels-last.
SHAPES = [
    ((1, 1), False), ((1, 7), False), ((3, 5), False), ((5, 77), False), ((1, 8192), False),
    ((37, 96), False), ((257, 100), False), ((33, 128), False), ((2, 4), False),
    ((2, 3, 1, 1), False), ((1, 3, 17, 23), False), ((3, 5, 9, 31), False),
    ((2, 4, 2, 3), False), ((2, 3, 4, 4), False), ((2, 3, 5, 13), False), ((1, 2, 63, 63), False),
    ((2, 8, 13, 11), True), ((2, 5, 3, 3), True), ((1, 16, 2, 2), True),
]


def _shape_id(case):
    shape, cl = case
    return "x".join(map(str, shape)) + ("-cl" if cl else "")


def _poison_allocator(device, nbytes):
    """Leaves NaN in the caching allocator's free blocks of about ``nbytes``
    and larger (:func:`cupy_fused.testing.poison_allocator`), so that outputs
    the op allocates next start as NaN: an element the kernel never writes
    shows."""
    for n in (nbytes, 2 * nbytes, 4 * nbytes):
        poison_allocator(device, n)


def _in_layout(flat, shape, channels_last):
    """``flat`` (memory order) viewed as ``shape``, NCHW or channels-last."""
    if channels_last:
        n, c, h, w = shape
        return flat.view(n, h, w, c).permute(0, 3, 1, 2)
    return flat.view(shape)


def _inputs(shape, channels_last, z_dtype, out_dtype, second, device, *, offset=0,
            bias_offset=0, nonfinite=False, seed=0):
    """z and the biases requiring grad; with ``offset`` / ``bias_offset``,
    views that start that many elements into their storage (mid-vector)."""
    gen = torch.Generator().manual_seed(seed)
    n, c = math.prod(shape), shape[1]
    z = torch.randn(n + offset, generator=gen) * 2
    if nonfinite and n:
        pick = torch.randint(0, n + offset, (max(1, n // 5),), generator=gen)
        special = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0])
        z[pick] = special[torch.randint(0, 5, pick.shape, generator=gen)]
    z = z.to(device, z_dtype).requires_grad_(True)
    z = _in_layout(z[offset:], shape, channels_last)
    biases = []
    for _ in range(2 if second else 1):
        b = torch.randn(c + bias_offset, generator=gen).to(device, out_dtype).requires_grad_(True)
        biases.append(b[bias_offset:])
    return z, biases[0], (biases[1] if second else None)


def _per_channel(v, z):
    return v.view(-1, *[1] * (z.dim() - 2))


def _check(z, b1, b2, *, grad_mode="dense", dy_offset=0, seed=1, dy_nonfinite=False):
    """Output and the gradients of z and both biases against torch's float64
    run of relu(z + b1) + b2.  The mask decisions match exactly (float's
    z + b1 has the sign of the exact sum), so the output is checked bit for
    bit against the same sums in float, and dz bit for bit.  With
    ``dy_nonfinite``, NaN and +-inf in a few values of dy: the gradients'
    NaN and +-inf where float64's are."""
    out_dtype = b1.dtype
    channels_last = z.dim() == 4 and not z.is_contiguous()
    sources = [t for t in (z, b1, b2) if t is not None]
    nbytes = z.numel() * max(4, z.element_size())
    _poison_allocator(z.device, nbytes)
    out = ops.bias_relu(z, b1, b2)
    assert out.dtype == out_dtype and out.shape == z.shape and out.stride() == z.stride()

    ref_leaves = [t.detach().double().requires_grad_(True) for t in sources]
    ref = torch.relu(ref_leaves[0] + _per_channel(ref_leaves[1], z))
    exact = torch.relu(z.detach().float() + _per_channel(b1.detach().float(), z))
    if b2 is not None:
        ref = ref + _per_channel(ref_leaves[2], z)
        exact = exact + _per_channel(b2.detach().float(), z)
    torch.testing.assert_close(out, exact.to(out_dtype), rtol=0, atol=0, equal_nan=True)
    # Against float64: two float roundings, then one to the output dtype.
    size = z.detach().double().abs() + _per_channel(b1.detach().double().abs(), z)
    if b2 is not None:
        size = size + _per_channel(b2.detach().double().abs(), z)
    finite = torch.isfinite(ref)
    err = (out.double() - ref.detach()).abs()
    eps = torch.finfo(out_dtype).eps
    assert (err[finite] <= 2 * eps * size[finite]).all()
    torch.testing.assert_close(out.double()[~finite], ref.detach()[~finite], equal_nan=True)

    if grad_mode == "sum":
        _poison_allocator(z.device, nbytes)
        grads = torch.autograd.grad(out.sum(), sources)
        ref_grads = torch.autograd.grad(ref.sum(), ref_leaves)
        terms = torch.ones_like(ref, dtype=torch.float64)
    else:
        gen = torch.Generator().manual_seed(seed)
        dy = torch.randn(z.numel() + dy_offset, generator=gen)
        if dy_nonfinite and z.numel():
            pick = torch.randint(0, dy.numel(), (8,), generator=gen)
            dy[pick] = torch.tensor([float("nan"), float("inf"), -float("inf")])[pick % 3]
        dy = dy.to(z.device, out_dtype)
        dy = _in_layout(dy[dy_offset:], z.shape, channels_last)
        _poison_allocator(z.device, nbytes)
        grads = torch.autograd.grad(out, sources, dy)
        ref_grads = torch.autograd.grad(ref, ref_leaves, dy.double())
        terms = dy.double()
    assert grads[0].dtype == z.dtype and grads[0].stride() == z.stride()
    # dz = dy or 0 where the mask says: exact in z's dtype.
    torch.testing.assert_close(grads[0], ref_grads[0].to(z.dtype), rtol=0, atol=0, equal_nan=True)
    # Bias gradients: compensated float sums, then float64 partials: at most
    # the rounding of the result to its dtype plus a few float ulps of the
    # terms' magnitude; for a 16-bit gradient, plain float sums of at most
    # PLAIN_SUM_ROWS rows a thread, whose worst case is that many ulps.
    dims = [0] + list(range(2, z.dim()))
    passed = torch.where(ref_grads[0] != 0, terms.abs(), torch.zeros_like(terms))
    scales = [passed.sum(dims), terms.abs().sum(dims)]
    ulps = BR.PLAIN_SUM_ROWS * 2.0**-24 if out_dtype in (torch.float16, torch.bfloat16) else 1e-6
    for got, want, scale in zip(grads[1:], ref_grads[1:], scales):
        assert got.dtype == out_dtype
        assert_non_finite_where(got, want, got, want)
        finite = torch.isfinite(want)
        bound = eps * want.abs() + ulps * scale
        assert ((got.double() - want).abs() <= bound)[finite].all(), (got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("pair", PAIRS, ids=_pair_id)
@pytest.mark.parametrize("case", [((33, 128), False), ((3, 5, 9, 31), False), ((2, 16, 5, 7), True)],
                         ids=_shape_id)
def test_one_value_biases(case, pair, device):
    """Biases of one value for every channel: the output bitwise that of
    the values spread over the channels, and each gradient the whole sum
    (from the float64 partials, rounded once) within the bound _check puts
    on a channel's sum."""
    shape, cl = case
    z, b1, b2 = _inputs(shape, cl, *pair, True, device, seed=sum(shape))
    b1, b2 = (b[:1].detach().clone().requires_grad_(True) for b in (b1, b2))
    out = ops.bias_relu(z, b1, b2)
    spread = ops.bias_relu(z.detach(), *(b.detach().expand(shape[1]).contiguous() for b in (b1, b2)))
    assert torch.equal(out, spread)
    gen = torch.Generator().manual_seed(3)
    dy = torch.randn(shape, generator=gen).to(device, out.dtype).contiguous(memory_format=(
        torch.channels_last if cl else torch.contiguous_format))
    grads = torch.autograd.grad(out, (z, b1, b2), dy)
    leaves = [t.detach().double().requires_grad_(True) for t in (z, b1, b2)]
    ref = torch.relu(leaves[0] + leaves[1]) + leaves[2]
    want = torch.autograd.grad(ref, leaves, dy.double())
    torch.testing.assert_close(grads[0], want[0].to(z.dtype), rtol=0, atol=0)
    terms = dy.double().abs()
    eps = torch.finfo(out.dtype).eps
    for got, w, scale in zip(grads[1:], want[1:], (terms[want[0] != 0].sum(), terms.sum())):
        assert got.shape == (1,) and got.dtype == out.dtype
        assert (got.double() - w).abs() <= eps * w.abs() + 1e-6 * scale, (got, w)


@pytest.mark.gpu
@pytest.mark.parametrize("second", [False, True], ids=["one-bias", "two-biases"])
@pytest.mark.parametrize("pair", PAIRS, ids=_pair_id)
@pytest.mark.parametrize("case", SHAPES, ids=_shape_id)
def test_vector_edges_match_float64(case, pair, second, device):
    shape, cl = case
    _check(*_inputs(shape, cl, *pair, second, device, seed=sum(shape)))


@pytest.mark.gpu
@pytest.mark.parametrize("pair", PAIRS, ids=_pair_id)
@pytest.mark.parametrize("case", [((5, 77), False), ((33, 128), False), ((1, 8192), False),
                                  ((3, 5, 9, 31), False), ((2, 3, 4, 4), False),
                                  ((2, 8, 13, 11), True)], ids=_shape_id)
def test_views_starting_mid_vector(case, pair, device):
    """z, dy and the biases one element past a 16-byte boundary: the kernels
    take the same vectors a value at a time."""
    shape, cl = case
    z, b1, b2 = _inputs(shape, cl, *pair, True, device, offset=1, bias_offset=1)
    assert z.data_ptr() % 16 != 0 and b1.data_ptr() % 16 != 0
    _check(z, b1, b2, dy_offset=1)


@pytest.mark.gpu
@pytest.mark.parametrize("pair", PAIRS, ids=_pair_id)
@pytest.mark.parametrize("case", [((37, 96), False), ((257, 100), False), ((1, 3, 17, 23), False),
                                  ((2, 8, 13, 11), True)], ids=_shape_id)
def test_non_finite_values_and_the_sum_backward(case, pair, device):
    """NaN, +-inf and +-0 in z (NaN passes the gradient, as torch's ReLU
    does); out.sum()'s broadcast gradient reaches the kernels as one value;
    NaN and +-inf in dy reach the biases' gradients as they reach torch's
    (no compensated sum's inf - inf)."""
    shape, cl = case
    z, b1, b2 = _inputs(shape, cl, *pair, True, device, nonfinite=True)
    _check(z, b1, b2)
    _check(z, b1, b2, grad_mode="sum")
    _check(*_inputs(shape, cl, *pair, True, device), dy_nonfinite=True)


@pytest.mark.gpu
@pytest.mark.parametrize("pair", PAIRS, ids=_pair_id)
def test_grids_smaller_than_the_work(pair, device, monkeypatch):
    """One forward block (its grid-stride loop takes every tile), one
    resident block for the rows backward (one chunk of every row), and the
    NCHW backward's slabs in grids of two (each after the first starting
    at its slab offset)."""
    launch, grids = BR.rows_launch, BR.slab_grids
    monkeypatch.setattr(BR, "forward_grid", lambda total, dtype: 1)
    monkeypatch.setattr(BR, "rows_launch", lambda rows, channels, vector, resident, max_rows=None:
                        launch(rows, channels, vector, 1, max_rows))
    monkeypatch.setattr(BR, "slab_grids", lambda slabs: grids(slabs, 2))
    for shape, cl in [((300, 77), False), ((64, 256), False), ((2, 3, 33, 35), False),
                      ((3, 16, 9, 7), True)]:
        _check(*_inputs(shape, cl, *pair, True, device, nonfinite=True))


@pytest.mark.gpu
@pytest.mark.parametrize("pair", [p for p in PAIRS if p[1] != torch.float32], ids=_pair_id)
def test_rows_backward_sums_on_either_side_of_the_plain_sum_bound(pair, device, monkeypatch):
    """A 16-bit gradient's rows backward: plain float sums over many small
    chunks (a bound of 2 rows a thread), and compensated sums where the
    launch cannot keep to the bound (here: made to ignore it), each within
    the reference's error."""
    launch = BR.rows_launch
    monkeypatch.setattr(BR, "PLAIN_SUM_ROWS", 2)
    seen, asked = [], []
    kernels = BR.KERNELS.get

    def get(key, dev):
        seen.append(key[0])
        return kernels(key, dev)

    monkeypatch.setattr(BR.KERNELS, "get", get)
    sms = BR.sm_count(device.index)
    for ignore in (False, True):
        def rows_launch(rows, channels, vector, resident, max_rows=None):
            asked.append((resident, max_rows))
            return launch(rows, channels, vector, 1, None if ignore else max_rows)

        monkeypatch.setattr(BR, "rows_launch", rows_launch)
        seen.clear()
        for shape, cl in [((300, 77), False), ((1000, 64), False), ((3, 16, 19, 17), True)]:
            asked.clear()
            _check(*_inputs(shape, cl, *pair, True, device, nonfinite=True))
            plain_launch = (sms * BR.PLAIN_ROWS_BLOCKS_PER_SM, 2)
            fallback = (sms * BR.ROWS_BLOCKS_PER_SM[pair[0]], None)
            assert asked == ([plain_launch, fallback] if ignore else [plain_launch])
        rows_kernels = {k for k in seen if k.startswith("bias_relu_backward_rows")}
        assert rows_kernels == {"bias_relu_backward_rows" if ignore
                                else "bias_relu_backward_rows_plain"}


@pytest.mark.gpu
@pytest.mark.parametrize("pair", PAIRS, ids=_pair_id)
def test_rows_backward_reduces_in_its_last_blocks_as_the_reduce_launch(pair, device, monkeypatch):
    """Under 32 chunks the rows kernel's last block of each column range
    sums the chunks itself: the same bits as the second launch it replaces
    (_column_counters made to give none), in calls that follow each other
    on one stream and in a call on another stream, every count back at
    zero after each."""
    z_dtype, grad_dtype = pair
    rows, channels = 200, 1288  # column ranges of 256 or 128 channels, the last one partial
    assert BR.rows_kernel(rows, channels, z_dtype, grad_dtype, BR.sm_count(device.index))[1][2] < 32
    gen = torch.Generator(device=device).manual_seed(7)
    z = torch.randn(rows, channels, device=device, generator=gen).to(z_dtype)
    biases = [torch.randn(channels, device=device, generator=gen).to(grad_dtype) for _ in range(2)]
    dy = torch.randn(rows, channels, device=device, generator=gen).to(torch.promote_types(*pair))

    def grads():
        leaves = [t.clone().requires_grad_(True) for t in [z] + biases]
        ops.bias_relu(*leaves).backward(dy)
        return [t.grad for t in leaves]

    counters = _common._column_counters(16, 64, device)
    assert counters is not None and not counters.any()
    fused = [grads(), grads()]
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fused.append(grads())
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    assert not counters.any()
    monkeypatch.setattr(BR, "_column_counters", lambda chunks, ranges, device: None)
    apart = grads()
    for got in fused:
        for a, b in zip(got, apart):
            assert torch.equal(a, b)


@pytest.mark.gpu
def test_counters_are_kept_for_the_most_recent_streams_only(device, monkeypatch):
    """One counters buffer per stream, for the last _MAX_COUNTERS streams
    used: a stream per batch does not keep a buffer for each."""
    monkeypatch.setattr(_common, "_counters", collections.OrderedDict())
    streams = [torch.cuda.Stream(device) for _ in range(3)]
    for s in streams + [torch.cuda.ExternalStream(s.cuda_stream, device=device) for s in streams]:
        with torch.cuda.stream(s):
            first = _common._column_counters(16, 64, device)
            assert _common._column_counters(16, 64, device) is first
    assert len(_common._counters) == 3
    monkeypatch.setattr(_common, "_MAX_COUNTERS", 2)
    kept = {}
    for s in streams:
        with torch.cuda.stream(s):
            kept[s.cuda_stream] = _common._column_counters(16, 64, device)
    with torch.cuda.stream(streams[1]):  # now the most recent but one
        assert _common._column_counters(16, 64, device) is kept[streams[1].cuda_stream]
    with torch.cuda.stream(torch.cuda.Stream(device)):
        _common._column_counters(16, 64, device)
    assert [k[1] for k in _common._counters][:1] == [streams[1].cuda_stream]
    assert len(_common._counters) == 2
    with torch.cuda.stream(streams[1]):  # a buffer grown: the most recently used
        assert _common._column_counters(16, 300, device).numel() >= 300
    assert [k[1] for k in _common._counters][-1] == streams[1].cuda_stream


@pytest.mark.gpu
def test_rows_backward_plain_sums_at_the_bound(device, monkeypatch):
    """Every thread of the plain-sum variant summing exactly PLAIN_SUM_ROWS
    rows (one SM's grid over 2^20 rows of 128 channels, bfloat16): the
    gradients within the bound _check puts on them."""
    monkeypatch.setattr(BR, "sm_count", lambda dev: 1)
    cols, _, chunks, per = BR.rows_launch(2**20, 128, 8, BR.PLAIN_ROWS_BLOCKS_PER_SM,
                                          BR.PLAIN_SUM_ROWS)
    assert math.ceil(per / (BLOCK // cols)) == BR.PLAIN_SUM_ROWS
    assert BR.plain_sums(cols, per, torch.bfloat16)
    _check(*_inputs((2**20, 128), False, torch.bfloat16, torch.bfloat16, True, device))


@pytest.mark.gpu
@pytest.mark.parametrize("pair", PAIRS, ids=_pair_id)
def test_batch_of_zero(pair, device):
    for shape in [(0, 64), (0, 3, 4, 4)]:
        z, b1, b2 = _inputs(shape, False, *pair, True, device)
        out = ops.bias_relu(z, b1, b2)
        dz, db1, db2 = torch.autograd.grad(out.sum(), [z, b1, b2])
        assert out.shape == shape and out.dtype == pair[1] and dz.shape == shape
        assert db1.shape == (shape[1],) and not db1.any() and not db2.any()


@pytest.mark.gpu
def test_zero_size_inputs(device):
    z = torch.empty(0, 64, device=device, requires_grad=True)
    b = torch.randn(64, device=device, requires_grad=True)
    out = ops.bias_relu(z, b)
    out.sum().backward()
    assert out.shape == (0, 64) and b.grad.shape == (64,) and not b.grad.any()


@pytest.mark.gpu
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "mid-vector"])
def test_repeated_runs_are_bitwise_equal(offset, device):
    """Fixed summation order: the same output and gradients bit for bit."""
    for shape, cl in [((257, 100), False), ((64, 8192), False), ((2, 4, 33, 35), False),
                      ((2, 8, 13, 11), True)]:
        z, b1, b2 = _inputs(shape, cl, torch.float16, torch.float16, True, device, offset=offset)
        dy = torch.randn(z.shape, device=device, dtype=torch.float16)
        runs = []
        for _ in range(2):
            out = ops.bias_relu(z, b1, b2)
            runs.append([out, *torch.autograd.grad(out, [z, b1, b2], dy)])
        for a, b in zip(*runs):
            assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("second", [False, True], ids=["one-bias", "two-biases"])
@pytest.mark.parametrize("pair", PAIRS, ids=_pair_id)
@pytest.mark.parametrize("shape", [(1, 3, 5, 7), (2, 70, 9, 15), (3, 64, 8, 8), (2, 130, 1, 67),
                                   (2, 70, 6, 9), (1, 66, 2, 33)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("grad_mode", ["dense", "sum", "dense_misaligned"])
@pytest.mark.parametrize("chunks", ["grid", "one_chunk"])
def test_backward_to_channels_last(shape, pair, second, grad_mode, chunks, device, monkeypatch):
    """An NCHW z whose gradient is asked channels-last (the convolution's
    channels-last backward): dz the same values as the NCHW backward's,
    bitwise, laid out channels-last; the biases' gradients within one
    rounding of their float64 sums; a second run bitwise the same; the
    custom op's fake strides those of the real dz.  Channel and position
    counts off the 64 x 64 tiles, one image, one row, a broadcast upstream
    gradient; the grid as launched, and one block per channel tile taking
    every tile in turn.  Two values per access where H * W and C are even
    and dy starts on a pair (not for a dy one element into its storage)."""
    if chunks == "one_chunk":
        monkeypatch.setattr(BR, "_TO_NHWC_BLOCKS_PER_SM", 0)
    launched = []
    get = BR.KERNELS.get
    monkeypatch.setattr(BR.KERNELS, "get", lambda key, dev: launched.append(key[0]) or get(key, dev))
    z, b1, b2 = _inputs(shape, False, *pair, second, device)
    if grad_mode == "sum":
        dy = torch.ones((), device=device, dtype=pair[1]).expand(shape)
    else:
        offset = 1 if grad_mode == "dense_misaligned" else 0
        dy = torch.randn(math.prod(shape) + offset, device=device, dtype=pair[1])[offset:].view(shape)
    runs = []
    for dz_channels_last in (False, True, True):
        out = BR._bias_relu(z, b1, b2, dz_channels_last)
        runs.append(torch.autograd.grad(out, [z, b1] + ([b2] if second else []), dy))
    plain, cl, again = runs
    pairs = shape[1] % 2 == 0 and shape[2] * shape[3] % 2 == 0 and grad_mode != "dense_misaligned"
    to_nhwc = [k for k in launched if k.startswith("bias_relu_backward_to_nhwc")]
    assert to_nhwc == ["bias_relu_backward_to_nhwc" + ("_x2" if pairs else "")] * 2
    assert plain[0].is_contiguous() and cl[0].is_contiguous(memory_format=torch.channels_last)
    assert not cl[0].is_contiguous() or shape[2] * shape[3] == 1
    assert torch.equal(cl[0], plain[0])
    for a, b in zip(cl, again):
        assert torch.equal(a, b)
    # The biases' gradients: each within one rounding of its float64 sum
    # (of dy where z + bias > 0: the mask's sign, unchanged by rounding).
    passes = z.detach().double() + _per_channel(b1.detach().double(), z) > 0
    d64 = torch.where(passes, dy.double(), 0.0)
    want = [d64.sum((0, 2, 3))] + ([dy.double().sum((0, 2, 3))] if second else [])
    spread = torch.finfo(torch.float32).eps ** 2 * dy.double().abs().sum((0, 2, 3))
    for a, w in zip(cl[1:], want):
        assert ((a.double() - w).abs() <= torch.finfo(a.dtype).eps * w.abs() + spread).all()
    # The custom op's fake against the real backward (dz's strides included).
    mask = BR._forward(z.detach(), b1.detach(), None if b2 is None else b2.detach(), True, True)[1]
    torch.library.opcheck(BR._BIAS_RELU.backward_op,
                          (dy.contiguous(), mask, list(shape), False, second, pair[0], True))


@pytest.mark.gpu
@pytest.mark.parametrize("second", [False, True], ids=["one-bias", "two-biases"])
@pytest.mark.parametrize("layout", ["channels_last", "nchw_to_nhwc", "nchw_to_nhwc_pairs"])
def test_backward_tf32_dz(layout, second, device):
    """``tf32_dz`` (the float32 dz that the convolution's TF32 input
    gradient reads): dz bit for bit the plain backward's rounded to TF32
    (conv_bias_relu's _tf32: NaN kept, infinities kept), laid out the same,
    the biases' sums bit for bit the plain backward's (of dz unrounded);
    from a channels-last z (the rows kernel) and from an NCHW z with dz
    channels-last (one value a lane, and pairs)."""
    CB = importlib.import_module("cupy_fused.ops.conv_bias_relu")
    shape = (2, 40, 7, 9) if layout == "nchw_to_nhwc" else (2, 40, 6, 9)
    channels_last = layout == "channels_last"
    z, b1, b2 = _inputs(shape, channels_last, torch.float32, torch.float32, second, device)
    gen = torch.Generator().manual_seed(3)
    dy = torch.randn(shape, generator=gen).to(device)
    flat = dy.view(-1)
    flat[:3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    flat[3:100] *= 1e-39  # subnormal
    dy = dy.contiguous(memory_format=torch.channels_last) if channels_last else dy
    mask = BR._forward(z.detach(), b1.detach(), None if b2 is None else b2.detach(), True, True)[1]
    runs = [BR._backward(dy, mask, list(shape), channels_last, second, torch.float32, True,
                         tf32_dz=tf32) for tf32 in (False, True)]
    (plain, sums), (rounded, sums_tf32) = runs
    assert rounded.is_contiguous(memory_format=torch.channels_last) and rounded.stride() == plain.stride()
    def bits(t):
        return t.view(torch.int32)

    assert torch.equal(bits(rounded), bits(CB._tf32(plain)))
    assert not torch.equal(bits(rounded), bits(plain))  # (random values: most change)
    assert torch.equal(bits(sums_tf32), bits(sums)) and (sums.isnan().any() or not second)  # (NaN too)
    with pytest.raises(ValueError, match="TF32"):
        BR._backward(dy.to(torch.bfloat16), mask, list(shape), channels_last, second, torch.bfloat16, True,
                     tf32_dz=True)
    with pytest.raises(ValueError, match="TF32"):  # an NCHW dz: no TF32 kernel writes it
        BR._backward(dy.contiguous(), mask, list(shape), False, second, torch.float32, False, tf32_dz=True)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["rows", "nchw", "channels-last"])
def test_backward_past_2_pow_31_elements(layout, device):
    """64-bit indexing in the backwards (rows, NCHW slabs, a channels-last
    4-D z) and their column sums, on 2^31 + 2^20 float16 values: dz exact at
    positions on both sides of element 2^31 and everywhere against torch's
    gate, both biases' gradients against torch's float32 sums of dz and
    dy."""
    shape = {"rows": ((1 << 21) + 1, 1024), "nchw": (2049, 64, 128, 128),
             "channels-last": (2049, 64, 128, 128)}[layout]
    gen = torch.Generator(device=device).manual_seed(31)
    z = torch.randn(shape, device=device, dtype=torch.float16, generator=gen)
    if layout == "channels-last":
        z = z.contiguous(memory_format=torch.channels_last)
    dy = torch.randn(z.shape, device=device, dtype=torch.float16, generator=gen).contiguous(
        memory_format=torch.channels_last if layout == "channels-last" else torch.contiguous_format)
    b1, b2 = (torch.randn(shape[1], device=device, dtype=torch.float16, generator=gen).requires_grad_(True)
              for _ in range(2))
    assert z.numel() > 2**31
    z.requires_grad_(True)
    dz, db1, db2 = torch.autograd.grad(ops.bias_relu(z, b1, b2), [z, b1, b2], dy)
    flat = [0, 1, 2**31 - 1, 2**31, 2**31 + 1, z.numel() - 1]
    # (memory-order positions: as the kernels walk the tensor)
    zm, dym, dzm = (t.detach().permute(0, 2, 3, 1).reshape(-1) if layout == "channels-last"
                    else t.detach().reshape(-1) for t in (z, dy, dz))
    channels = [(p % shape[1]) if layout != "nchw" else (p // (128 * 128)) % shape[1] for p in flat]
    for p, c in zip(flat, channels):
        alive = zm[p].float() + b1.detach()[c].float() > 0
        assert dzm[p].item() == (dym[p].item() if alive else 0.0), (layout, p)
    # Every value, against torch's gate, a slice of the batch at a time.
    b1_at = b1.detach().float().view((1, -1) if layout == "rows" else (1, -1, 1, 1))
    step = (1 << 26) // (z[0].numel())
    for i in range(0, shape[0], step):
        sl = slice(i, i + step)
        want = torch.where(z.detach()[sl].float() + b1_at > 0, dy[sl], torch.zeros_like(dy[sl]))
        assert torch.equal(dz[sl], want), (layout, i)
    dims = (0,) if layout == "rows" else (0, 2, 3)
    for grad, of in ((db1, dz), (db2, dy)):
        want = of.float().sum(dims).half().float()
        torch.testing.assert_close(grad.float(), want, rtol=2e-3, atol=1e-2)


@pytest.mark.gpu
def test_counters_are_not_torchs_to_free(device, monkeypatch):
    """The counters kept across calls come from CuPy's memory pool, zeroed
    on their stream, not from torch's caching allocator, whose CUDA-graph
    pools torch.compile's graph trees reset under whatever they hold."""
    monkeypatch.setattr(_common, "_counters", collections.OrderedDict())
    side = torch.cuda.Stream(device)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    with torch.cuda.stream(side):
        counters = _common._column_counters(16, 64, device)
    assert torch.cuda.memory_allocated(device) == before
    side.synchronize()
    assert counters.device == device and counters.numel() >= 64 and not counters.any()


@pytest.mark.gpu
def test_counters_stream_without_deprecated_cupy_calls(device):
    """The counters' CuPy stream comes through the CUDA stream protocol
    where CuPy has it (CuPy 14 deprecates ``ExternalStream``): no
    DeprecationWarning, for torch's own streams and external ones, and the
    zeros are there once the stream is done."""
    side = torch.cuda.Stream(device)
    for s in (side, torch.cuda.ExternalStream(side.cuda_stream, device=device)):
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)
            counters = _common._zeroed_counters(300, device, s)
        s.synchronize()
        assert counters.numel() == 300 and not counters.any()


@pytest.mark.gpu
def test_reduce_overhead_compile_over_several_shapes(device, beside_eager):
    """torch.compile(mode="reduce-overhead"): CUDA-graph trees warm up,
    record and replay a graph per shape, in private pools they reset.  From
    the third call of a shape on the graph is replayed (no kernel launched
    from Python, no graph skipped), and every call, each on new values
    copied into the same z and output gradient, gives eager's output and
    gradients bit for bit; the rows backward's last-block reduce (under 32
    chunks) included."""
    from torch._dynamo.utils import counters

    gen = torch.Generator(device=device).manual_seed(11)
    bias = torch.randn(1288, device=device, generator=gen, requires_grad=True)

    def step(fn, z, dy):
        bias.grad = None
        z = z.detach().requires_grad_(True)
        y = fn(z, bias)
        y.backward(dy)
        # (clones: a replay writes its outputs into the graph's own memory)
        return y.detach().clone(), z.grad.clone(), bias.grad.clone()

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(lambda z, b: ops.bias_relu(z, b), mode="reduce-overhead")
    # Shapes seen again after others: each one's graph, or a new one recorded
    # for it on the graph of symbolic rows, replayed by its third call.
    seen = set()
    for rows in (200, 300, 200, 416, 300):
        z, dy = (torch.empty(rows, 1288, device=device) for _ in range(2))
        for call in range(4):  # warm-up, recording, then replays
            z.copy_(torch.randn(rows, 1288, device=device, generator=gen))
            dy.copy_(torch.randn(rows, 1288, device=device, generator=gen))
            got, want, from_python = beside_eager(lambda: step(compiled, z, dy),
                                                  lambda: step(ops.bias_relu, z, dy))
            assert call < 2 or not from_python, (rows, call, from_python)
            # (a shape's first warm-up runs the kernels from Python: an
            # empty record later is a replay)
            assert rows in seen or call or from_python, (rows, from_python)
            for name, a, b in zip(("y", "z", "bias"), got, want):
                assert torch.equal(a, b), (rows, call, name)
        seen.add(rows)
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
    torch._dynamo.reset()
