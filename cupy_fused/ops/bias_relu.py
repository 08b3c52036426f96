"""``bias_relu``: out = relu(z + bias) (+ bias2), per channel — the epilogue of
problem 76 (Linear, +bias, ReLU) and problem 1 (Conv2d with its bias, ReLU,
+bias).  Kernels: ``kernels_cu/bias_relu.cu``.

The forward keeps a 1-bit mask of ``z + bias > 0`` (NaN included, as torch's
ReLU passes the gradient there) for the backward instead of z itself (1/32 of
the activation in float32).

Dtypes follow torch's type promotion: a float16 / bfloat16 z with float32
biases (the output of a GEMM or convolution under ``torch.autocast`` meeting
float32 parameters) gives a float32 result, in one pass.

The kernels read and write 16-byte vectors (8 half / 4 float values of z).
Any tensor takes them: each kernel tests its pointers' alignment itself (a
view such as ``z[1:]`` may start mid-vector) and moves misaligned data one
value at a time, so no host-side check or second kernel is needed.
"""
from __future__ import annotations

import functools
import math
from typing import List, Optional, Sequence, Tuple

import torch

from .. import _bridge, _runtime
from .._amp import HALF_DTYPES, cast, promoted
from .._autograd import FusedOp, launches_directly, needs_grad, refuse_jit
from .._validation import FLOAT_DTYPES, check_tensor, check_vector, cxx_type, dense_layout
from ._common import (BLOCK, _broadcast_or_dense, call_with_cupy_arrays, cdiv, _column_counters,
                      fast_divisor, _ptr_or_null, _one_value_rows, _reduce_partials, _spread,
                      _vector_grads, _whole_sums, row_chunks, sm_count)

# Kernel names of the keys below that are another kernel's instantiation,
# with the template arguments they add: bias_relu_backward_to_nhwc moving two
# values per access (kVec = 2); bias_relu_backward_rows with plain float
# column sums (kPlainSums, a 16-bit gradient: see rows_launch); a ``_tf32``
# name: the same kernel writing a float32 dz rounded to TF32 (kTf32Dz: the
# operand of the convolution's TF32 input gradient, conv_bias_relu.py).
_VARIANTS = {"bias_relu_backward_to_nhwc_x2": ("bias_relu_backward_to_nhwc", "2"),
             "bias_relu_backward_rows_plain": ("bias_relu_backward_rows", "true"),
             "bias_relu_backward_rows_tf32": ("bias_relu_backward_rows", "false, true"),
             "bias_relu_backward_to_nhwc_tf32": ("bias_relu_backward_to_nhwc", "1, true"),
             "bias_relu_backward_to_nhwc_x2_tf32": ("bias_relu_backward_to_nhwc", "2, true")}
# The backwards that write a TF32-rounded dz (_TF32_DZ[kernel]), float32 only.
_TF32_DZ = {k: f"{k}_tf32" for k in ("bias_relu_backward_rows", "bias_relu_backward_to_nhwc",
                                     "bias_relu_backward_to_nhwc_x2")}


def _expr(kernel: str, dtype: torch.dtype, out_dtype: torch.dtype, second_bias: bool) -> str:
    kernel, extra = _VARIANTS.get(kernel, (kernel, ""))
    chain = f"cf::BiasReluChain<{'true' if second_bias else 'false'}>"
    out = "" if out_dtype == dtype and not extra else f", {cxx_type(out_dtype)}"
    return f"cf::{kernel}<{cxx_type(dtype)}, {chain}{out}{f', {extra}' if extra else ''}>"


# (z's dtype, the output's): one dtype, or a half z with float32 biases.
DTYPE_PAIRS = tuple((d, d) for d in FLOAT_DTYPES) + tuple((d, torch.float32) for d in HALF_DTYPES)

# Keyed by (kernel, z's dtype, output dtype, second bias present).
KERNELS = _runtime.KernelFamily("bias_relu.cu", {
    **{(k, d, o, b): _expr(k, d, o, b)
       for k in ("bias_relu_forward", "bias_relu_backward_rows", "bias_relu_backward_slabs",
                 "bias_relu_backward_to_nhwc", "bias_relu_backward_to_nhwc_x2")
       for d, o in DTYPE_PAIRS for b in (False, True)},
    **{("bias_relu_backward_rows_plain", d, o, b): _expr("bias_relu_backward_rows_plain", d, o, b)
       for d, o in DTYPE_PAIRS if o in HALF_DTYPES for b in (False, True)},
    **{(k, torch.float32, torch.float32, b): _expr(k, torch.float32, torch.float32, b)
       for k in _TF32_DZ.values() for b in (False, True)},
})


# The kernels move z and dz in 16-byte vectors: values per vector, by dtype.
VECTOR = {d: 16 // d.itemsize for d in FLOAT_DTYPES}

# The forward's lanes take 2 vectors each (kU in bias_relu.cu): elements
# per block of BLOCK threads.  Its grid covers the tensor once (blocks come
# and go as in torch's own elementwise kernels); the kernel's grid-stride
# loop would take a smaller one too.
_FORWARD_BLOCK_ELEMENTS = {d: BLOCK * 2 * v for d, v in VECTOR.items()}
_MAX_GRID = 2**31 - 1

# Blocks per SM the rows backward's registers are capped for, by z's dtype
# (kRowsBlocksPerSm in bias_relu.cu): its grid is that many blocks per SM,
# all resident at once (more, in waves, where its plain-sum variant needs
# more chunks to keep a thread's rows under PLAIN_SUM_ROWS).
ROWS_BLOCKS_PER_SM = {torch.float32: 4, torch.float16: 3, torch.bfloat16: 3}
# The same for its plain-sum variant (a 16-bit z and gradient).
PLAIN_ROWS_BLOCKS_PER_SM = 4


def forward_grid(total: int, dtype: torch.dtype) -> int:
    """Blocks of the forward for ``total`` elements of z (> 0)."""
    return min(cdiv(total, _FORWARD_BLOCK_ELEMENTS[dtype]), _MAX_GRID)


# The most rows a thread of bias_relu_backward_rows sums in plain float
# (kPlainSums, for a float16 / bfloat16 gradient): rows_launch gives no
# thread more, so that the sums' float rounding stays under 2^-15 of the
# sum of the terms' magnitudes, against the 16-bit result's own rounding of
# 2^-11 (float16) or 2^-8 (bfloat16) of its value (cf_common.cuh, FloatSum).
PLAIN_SUM_ROWS = 512


@functools.lru_cache(maxsize=256)
def rows_launch(rows: int, channels: int, vector: int, resident_blocks: int,
                max_rows: Optional[int] = None) -> Tuple[int, int, int, int]:
    """Launch of ``bias_relu_backward_rows`` over [rows, channels] (both
    > 0): (cols, grid_x, chunks, rows_per_chunk).

    A thread owns ``vector`` consecutive channels; a block is ``cols``
    such threads wide (a power of two, at most a warp: the channels of one
    row in a warp's 16-byte accesses) and BLOCK // cols row groups deep,
    which sum their rows together before the block writes one partial per
    chunk.  The chunks (grid y) bring the grid to ``resident_blocks``, what
    the GPU holds at once: fewer would leave it idle, more would add
    partials (written, then read by _reduce_partials) and a second wave;
    ``max_rows``: and at least as many as give no thread more rows than
    that, where the grid's 65535 chunks allow (:func:`plain_sums` says
    whether they did).  Every chunk is non-empty."""
    vectors = cdiv(channels, vector)
    cols = min(32, 1 << (vectors - 1).bit_length())
    grid_x = cdiv(vectors, cols)
    groups = BLOCK // cols
    chunks = max(1, resident_blocks // grid_x)
    if max_rows is not None:
        chunks = max(chunks, cdiv(rows, groups * max_rows))
    chunks = min(chunks, cdiv(rows, groups), 65535)
    rows_per_chunk = cdiv(rows, chunks)
    return cols, grid_x, cdiv(rows, rows_per_chunk), rows_per_chunk


def plain_sums(cols: int, rows_per_chunk: int, out_dtype: torch.dtype) -> bool:
    """Whether bias_relu_backward_rows sums in plain float (its
    ``_plain`` variant) at this launch (:func:`rows_launch`): for a 16-bit
    gradient, where no thread has more than :data:`PLAIN_SUM_ROWS` rows."""
    return out_dtype in HALF_DTYPES and cdiv(rows_per_chunk, BLOCK // cols) <= PLAIN_SUM_ROWS


def rows_kernel(rows: int, channels: int, z_dtype: torch.dtype, grad_dtype: torch.dtype,
                sms: int) -> Tuple[str, Tuple[int, int, int, int]]:
    """The variant of ``bias_relu_backward_rows`` and its launch
    (:func:`rows_launch`) for a [rows, channels] z of ``z_dtype`` (both
    sizes > 0) and a gradient of ``grad_dtype``, on a GPU of ``sms`` SMs:
    the plain-sum variant (``"bias_relu_backward_rows_plain"``, at
    PLAIN_ROWS_BLOCKS_PER_SM) for a 16-bit gradient where its launch keeps
    every thread within PLAIN_SUM_ROWS rows, else the compensated one
    (``"bias_relu_backward_rows"``, at ROWS_BLOCKS_PER_SM)."""
    vector = VECTOR[z_dtype]
    if grad_dtype in HALF_DTYPES:
        launch = rows_launch(rows, channels, vector, sms * PLAIN_ROWS_BLOCKS_PER_SM,
                             PLAIN_SUM_ROWS)
        if plain_sums(launch[0], launch[3], grad_dtype):
            return "bias_relu_backward_rows_plain", launch
    return "bias_relu_backward_rows", rows_launch(rows, channels, vector,
                                                  sms * ROWS_BLOCKS_PER_SM[z_dtype])


def _inner(sizes: List[int], channels_last: bool) -> int:
    """Elements per channel run in memory: 1 for [M, C] and channels-last,
    H*W for NCHW."""
    return 1 if channels_last else math.prod(sizes[2:])


def _is_channels_last(z: torch.Tensor) -> bool:
    return z.dim() == 4 and not z.is_contiguous()


def _divisors(total: int, inner: int, channels: int) -> Tuple[int, int]:
    """The forward's FastDiv of inner and of channels: the kernel's 32-bit
    index path divides by them (total below 2^31, so both are); zeros,
    unused, for the 64-bit path."""
    if total >= 2**31:
        return 0, 0
    return fast_divisor(inner), fast_divisor(channels)


def _forward(z: torch.Tensor, bias: torch.Tensor, bias2: Optional[torch.Tensor],
             save_mask: bool, dz_channels_last: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    # dz_channels_last: the backward's dz layout (_setup_context), unused here.
    out = torch.empty_like(z, dtype=bias.dtype)  # keeps z's memory format
    total = z.numel()
    words = cdiv(total, 32)
    mask = torch.empty((words if save_mask else 0,), dtype=torch.int32, device=z.device)
    if total:
        dev = z.device.index
        bias, bias2 = _spread(bias, z.shape[1]), _spread(bias2, z.shape[1])
        inner = _inner(list(z.shape), _is_channels_last(z))
        fn = KERNELS.get(("bias_relu_forward", z.dtype, bias.dtype, bias2 is not None), dev)
        _bridge.launch(fn, (forward_grid(total, z.dtype), 1, 1), BLOCK, (
            z.data_ptr(), out.data_ptr(), mask.data_ptr() if save_mask else 0, bias.data_ptr(),
            _ptr_or_null(bias2), total, z.shape[1], inner, *_divisors(total, inner, z.shape[1])),
            dev)
    return out, mask


def _forward_fake(z: torch.Tensor, bias: torch.Tensor, bias2: Optional[torch.Tensor],
                  save_mask: bool, dz_channels_last: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    words = cdiv(z.numel(), 32) if save_mask else 0
    return torch.empty_like(z, dtype=bias.dtype), z.new_empty((words,), dtype=torch.int32)


def _empty_like_layout(sizes: List[int], channels_last: bool, dtype: torch.dtype,
                       like: torch.Tensor) -> torch.Tensor:
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    return torch.empty(sizes, dtype=dtype, device=like.device, memory_format=fmt)


def slab_grids(slabs: int, most: int = _MAX_GRID) -> List[Tuple[int, int]]:
    """(first slab, slabs) of each grid of bias_relu_backward_slabs: one
    grid unless there are more slabs than a grid's x dimension holds."""
    return [(first, min(most, slabs - first)) for first in range(0, slabs, most)]


# Blocks per SM of bias_relu_backward_to_nhwc's grid (kToNhwcBlocksPerSm
# in bias_relu.cu, which caps the kernel's registers for them).
_TO_NHWC_BLOCKS_PER_SM = 3


def _backward(dout: torch.Tensor, mask: torch.Tensor, sizes: List[int], channels_last: bool,
              second_bias: bool, z_dtype: torch.dtype,
              dz_channels_last: bool,
              whole: Optional[Sequence[int]] = None,
              tf32_dz: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Returns (dz in ``z_dtype``, per-channel sums [slots, C] in dout's
    dtype: the gradient of bias, then of bias2 when there is one).  dz is
    in z's layout (``channels_last``), or channels-last for an NCHW z with
    ``dz_channels_last``.  ``whole``: the rows (0: bias, 1: bias2) whose
    vector is one value for every channel, which then hold the whole sum in
    column 0 (``_common._whole_sums``); None: none.  ``tf32_dz``: a float32
    dz channels-last (z's layout, or ``dz_channels_last``) and rounded to
    TF32, the operand of the convolution's TF32 input gradient (the sums
    are of dz unrounded).  The formula takes the rows: outputs of a custom
    op must not alias each other."""
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    transpose = dz_channels_last and not channels_last
    dz = _empty_like_layout(sizes, channels_last or transpose, z_dtype, dout)
    channels = sizes[1]
    slots = 2 if second_bias else 1
    dev = dout.device.index
    dy, dense = _broadcast_or_dense(dout, fmt)
    inner = _inner(sizes, channels_last)
    total = dz.numel()
    if total == 0:
        sums = torch.zeros((slots, channels), dtype=dout.dtype, device=dout.device)
    else:
        # Every backward sums into partial[chunk][slot][C] (double), reduced
        # in a fixed order by _reduce_partials.
        if transpose:
            # Two values per access where every pair is aligned: an even
            # H * W (dy's rows) and C (dz's), and both bases on a pair.
            pairs = (inner % 2 == 0 and channels % 2 == 0
                     and dz.data_ptr() % (2 * dz.element_size()) == 0
                     and (not dense or dy.data_ptr() % (2 * dy.element_size()) == 0))
            kernel = "bias_relu_backward_to_nhwc_x2" if pairs else "bias_relu_backward_to_nhwc"
            tiles = sizes[0] * cdiv(inner, 64)
            c_tiles = cdiv(channels, 64)
            chunks, per_chunk = row_chunks(tiles, c_tiles, dev, _TO_NHWC_BLOCKS_PER_SM)
            grid, extra = (c_tiles, chunks, 1), (channels, inner, tiles, per_chunk)
        elif inner == 1:
            rows = total // channels
            kernel, (cols, grid_x, chunks, rows_per_chunk) = rows_kernel(
                rows, channels, z_dtype, dout.dtype, sm_count(dev))
            grid, extra = (grid_x, chunks, 1), (rows, channels, rows_per_chunk, cols)
        else:
            kernel = "bias_relu_backward_slabs"
            chunks = total // (channels * inner)  # one per image
            grid, extra = None, (channels, inner)
        if tf32_dz:
            if kernel not in _TF32_DZ or z_dtype != torch.float32:
                raise ValueError(f"a TF32-rounded dz needs a float32 channels-last dz, got {z_dtype} "
                                 f"({kernel})")
            kernel = _TF32_DZ[kernel]
        partial = torch.empty((chunks, slots, channels), dtype=torch.float64, device=dout.device)
        sums = torch.empty((slots, channels), dtype=dout.dtype, device=dout.device)
        # The rows kernel sums its partials itself where _column_counters
        # gives it counters; else (and for the others) a second launch.
        counters = None
        if inner == 1 and not transpose:
            counters = _column_counters(chunks, grid[0], dout.device)
            extra += (sums.data_ptr(), _ptr_or_null(counters))
        fn = KERNELS.get((kernel, z_dtype, dout.dtype, second_bias), dev)
        args = (dy.data_ptr(), dense, mask.data_ptr(), dz.data_ptr(), partial.data_ptr(), *extra)
        if grid is not None:
            _bridge.launch(fn, grid, BLOCK, args, dev)
        else:  # a block per (image, channel) slab, in grids of fewer than 2^31
            for first, count in slab_grids(chunks * channels):
                _bridge.launch(fn, (count, 1, 1), BLOCK, args + (first,), dev)
        if counters is None:
            _reduce_partials(partial, dout.dtype, out=sums)
        if whole:
            sums = _whole_sums(sums, partial, [(s, s) for s in whole])
    return dz, sums


def _backward_fake(dout: torch.Tensor, mask: torch.Tensor, sizes: List[int], channels_last: bool,
                   second_bias: bool, z_dtype: torch.dtype,
                   dz_channels_last: bool,
                   whole: Optional[Sequence[int]] = None,
                   tf32_dz: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    dz = _empty_like_layout(sizes, channels_last or dz_channels_last, z_dtype, dout)
    return dz, dout.new_empty((2 if second_bias else 1, sizes[1]))


# The backward's rows of sums: bias's gradient, then bias2's.
_GRAD_ROWS = (0, 1)


def _setup_context(ctx, inputs, output):
    z, bias, bias2, _, dz_channels_last = inputs
    ctx.save_for_backward(output[1])
    ctx.lengths = (bias.shape[0], None if bias2 is None else bias2.shape[0])
    ctx.whole = _one_value_rows((bias, bias2), _GRAD_ROWS, z.shape[1])
    ctx.sizes = list(z.shape)
    ctx.channels_last = _is_channels_last(z)
    ctx.dz_channels_last = dz_channels_last and z.dim() == 4 and not ctx.channels_last
    ctx.second_bias = bias2 is not None
    ctx.z_dtype = z.dtype


def _backward_formula(ctx, grads, run_backward):
    (mask,) = ctx.saved_tensors
    dz, sums = run_backward(grads[0], mask, ctx.sizes, ctx.channels_last, ctx.second_bias,
                            ctx.z_dtype, ctx.dz_channels_last, ctx.whole)
    return (dz,) + _vector_grads(sums, ctx.lengths, _GRAD_ROWS) + (None, None)


_BIAS_RELU = FusedOp("bias_relu", _forward, _forward_fake, _setup_context, _backward_formula,
                     _backward, _backward_fake, nondifferentiable=(1,))


def bias_relu(z: torch.Tensor, bias: torch.Tensor, bias2: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``relu(z + bias) + bias2`` in one pass (``bias2`` optional).

    Args:
        z: [M, C] (GEMM output) or [N, C, H, W] (conv output, NCHW or
            channels-last; the result keeps z's layout).  float32, float16
            or bfloat16; a CUDA tensor or a CuPy array.
        bias, bias2: C values each (shape (C,) or (C, 1, 1)), or one value
            for every channel (its gradient then the sum over the
            channels, rounded once); float dtypes, on z's device.

    Returns:
        z's shape and layout, in the dtype torch's type promotion gives
        ``relu(z + bias) + bias2`` (z's dtype when all three share it;
        float32 for a float16 / bfloat16 z with float32 biases, as under
        autocast).  The biases' gradients come back in their own dtypes.

    Raises:
        TypeError, ValueError: an argument of another type, dtype (the
            biases: float32, float16 or bfloat16), device or shape, before
            anything runs.
    """
    if not isinstance(z, torch.Tensor):
        return call_with_cupy_arrays(bias_relu, "z", z, bias, bias2)
    refuse_jit("bias_relu")
    return _bias_relu(z, bias, bias2, False)


def _bias_relu(z: torch.Tensor, bias: torch.Tensor, bias2: Optional[torch.Tensor],
               dz_channels_last: bool) -> torch.Tensor:
    """:func:`bias_relu` on a tensor z; with ``dz_channels_last``, the
    gradient it hands z is channels-last for an NCHW z (the convolution's
    channels-last backward reads it so: conv_bias_relu.py)."""
    check_tensor("z", z, ndim=(2, 4))
    channels = z.shape[1]
    out_dtype = z.dtype
    for name, vector in (("bias", bias), ("bias2", bias2)):
        # (a vector that is no tensor, or None, is check_vector's to name; a
        # 0-dim one changes no float dtype in torch's promotion: cast below)
        if isinstance(vector, torch.Tensor) and vector.dtype != out_dtype and vector.dim():
            out_dtype = promoted(out_dtype, vector.dtype)
            if out_dtype != z.dtype and out_dtype != torch.float32:  # e.g. a float64 vector
                raise TypeError(f"{name} must be float32, float16 or bfloat16, got {vector.dtype}")
    # Both checked, then cast to out_dtype (a cast is a launch).
    bias = check_vector("bias", bias, channels, z, "z", optional=False, dtype=FLOAT_DTYPES, one=True)
    bias2 = check_vector("bias2", bias2, channels, z, "z", dtype=FLOAT_DTYPES, one=True)
    bias, bias2 = cast(bias, out_dtype), cast(bias2, out_dtype)
    z = dense_layout(z)
    grad = needs_grad(z, bias, bias2)
    if grad or not launches_directly():
        return _BIAS_RELU.run(grad, z, bias, bias2, grad, dz_channels_last)[0]
    return _forward(z, bias, bias2, False, False)[0]  # nothing to record: straight to the launch
