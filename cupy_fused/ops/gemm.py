"""``linear``: ``y = act(x W^T + bias)`` with the GEMM on TF32 tensor cores at
float32 accuracy ("3xTF32"), the bias and activation fused into the GEMM's
store; its backward runs ``dX = dz W`` and ``dW = dz^T x`` on the same kernel
family.  Kernels: ``kernels_cu/gemm_tf32.cu``.

Precision of float32 products (``precision=`` argument, or the process-wide
default of :func:`set_fp32_matmul_precision`):

* ``"3xtf32"`` (default): each operand split into two TF32 parts, three
  tensor-core products, accumulated in float32 chunks of 16 k-values.  On
  sums of 32 products or more it is about as accurate as cuBLAS SGEMM or
  more (see the accuracy table in docs/gemm.md).  Shorter sums, where the split's
  own ~2^-22 representation error would dominate (up to 8x SGEMM's error at
  one product), run on cuBLAS SGEMM instead: see :func:`uses_sgemm`.  This
  applies per product, so a batch of 16 rows takes SGEMM for the weight
  gradient (a sum over the batch) and 3xTF32 for the rest.
* ``"tf32"``: one TF32 product (about 1e-3 relative error), fastest.
* ``"ieee"``: cuBLAS SGEMM (``torch.nn.functional.linear``).  This is also
  the path of float16 / bfloat16 inputs, whose tensor-core GEMMs are
  cuBLAS's own.  On this path bias and ReLU are cuBLAS's too (no kernel of
  ours: see :func:`_run_linear`): cuBLASLt's fused bias + ReLU epilogue
  (``torch._addmm_activation``); in training the backward (torch ops) gates
  the gradient with ReLU's own backward kernel, then
  :func:`_cublas_relu_backward` does the rest.

The cuBLAS products follow torch's own settings: with
``torch.backends.cuda.matmul.allow_tf32 = True`` they run in TF32.

GPUs below compute capability 8.0 (V100, T4) have no TF32 tensor cores:
there every float32 product runs on cuBLAS SGEMM, whatever the precision
(:func:`has_tf32_tensor_cores`).  On 9.0 (H100, H200) the products that fill
the GPU run on the ``wgmma`` kernel (:func:`has_wgmma`); those with many rows
of C split B into its TF32 planes once beforehand (:func:`splits_b`).

Non-finite inputs: with ``"3xtf32"`` an infinite operand gives NaN where
SGEMM gives ±inf (the correction products compute inf * 0); NaN stays NaN.
Use ``"ieee"`` where infinities must survive the product.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F

from .. import _bridge, _runtime
from .._amp import autocast_dtype
from .._autograd import FusedOp, is_compiling, keep_output, needs_grad, take_output
from .._validation import check_like, check_tensor, check_vector
from ._common import BLOCK, call_with_cupy_arrays, cdiv, elementwise_grid, _ptr_or_null, sm_count
from .relu_epilogue import bias_relu

PRECISIONS = ("3xtf32", "tf32", "ieee")
PASSES = {"3xtf32": 3, "tf32": 1}
_default = {"precision": "3xtf32"}


def _check_precision(precision) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(map(repr, PRECISIONS))}, "
                         f"got {precision!r}")
    return precision


def set_fp32_matmul_precision(precision: str) -> None:
    """Process-wide default precision of cupy-fused's float32 GEMMs (used
    where ``precision=None``): ``"3xtf32"`` (default), ``"tf32"`` or
    ``"ieee"``.  Read when a model or op runs (under ``torch.compile``: when
    it is traced)."""
    _default["precision"] = _check_precision(precision)


def get_fp32_matmul_precision() -> str:
    return _default["precision"]


def resolve_precision(precision: Optional[str]) -> str:
    return _default["precision"] if precision is None else _check_precision(precision)


# ---------------------------------------------------------------- kernels

@dataclass(frozen=True)
class Tile:
    """Block tile of a GEMM kernel: bm x bn outputs, k-tiles of 32, a
    ``stages``-deep pipeline of raw float32 tiles; ``wgmma``: the Hopper
    kernel (``gemm_tf32_wgmma``, sm_90a, 3 warpgroups), whose stages also
    hold the B tile split into TF32 planes, plus a word of mbarriers each;
    ``split_b``: B is split into its planes by a kernel of its own before the
    product (``gemm_tf32_split_b``), and the stages hold raw A and the planes."""

    bm: int
    bn: int
    stages: int
    wgmma: bool = False
    split_b: bool = False

    @property
    def threads(self) -> int:
        return 384 if self.wgmma else 256

    def shared_bytes(self, a_kmajor: bool, b_kmajor: bool, passes: int = 3) -> int:
        a = self.bm * 36 if a_kmajor else 32 * (self.bm + 4)
        b = self.bn * 36 if b_kmajor else 32 * (self.bn + 4)
        if not self.wgmma:
            return self.stages * (a + b) * 4
        planes = (2 if passes == 3 else 1) * self.bn * 32
        return 128 + self.stages * (a + (0 if self.split_b else b) + planes) * 4


# On H100/H200 (compute capability 9.0) every GEMM that fills the GPU with
# 128x128 tiles and has 16-byte aligned rows runs on the wgmma kernel (one
# block of 3 warpgroups per SM, 3 stages of raw tiles and B planes: 204 KiB
# of shared memory); where :func:`splits_b` says so, B is split once
# beforehand and the kernel copies its planes (4 stages of raw A and planes,
# 200 KiB).  Elsewhere, 128x128 on mma.sync (4 stages, 147 KiB); 64x64
# for smaller GEMMs and for operands not 16-byte aligned (word-by-word loads).
# Measured with scripts/tune_gemm.py and benchmarks/gemm.py (see docs/gemm.md).
TILES = {"wgmma128x128": Tile(128, 128, 3, wgmma=True),
         "wgmma128x128_split_b": Tile(128, 128, 4, wgmma=True, split_b=True),
         "128x128": Tile(128, 128, 4), "64x64": Tile(64, 64, 4)}

# The split of B beforehand reads B once and writes its planes (12 bytes per
# element), where the in-kernel split redoes it for every 128-row tile of C
# on the kernel's critical path; it pays from a few thousand rows on.
SPLIT_B_MIN_ROWS = 4096


def splits_b(m: int, n: int, passes: int) -> bool:
    """Whether a wgmma product with an [m, n] result splits B beforehand:
    from :data:`SPLIT_B_MIN_ROWS` rows of C on, and only where the planes
    image (``passes == 3 ? 2 : 1`` times B's n x k values) is no larger than
    A (m x k), so that the transient buffer never outgrows an operand the
    caller already holds.  (On problem 76's weight gradient, 8192 x 8192
    from a batch of 1024, the split was faster, 1.24 against 1.57 ms, but
    its 64 MiB image raised the training step's peak memory above
    torch.compile's: docs/gemm.md.)"""
    return m >= SPLIT_B_MIN_ROWS and m >= (2 if passes == 3 else 1) * n

# (A K-major, B K-major) of the three products of a linear layer.
LAYOUTS = {
    "forward": (True, True),        # x [M, K] . W [N, K]^T
    "grad_input": (True, False),    # dz [M, N] . W [N, K]
    "grad_weight": (False, False),  # dz [M, N]^T . x [M, K]
}


def _cxx_bool(b: bool) -> str:
    return "true" if b else "false"


def _expr(t: Tile, passes: int, layout: str, vec: bool) -> str:
    a, b = map(_cxx_bool, LAYOUTS[layout])
    if t.wgmma:  # 128x128 only, 16-byte loads only; B's layout is the split's business
        b = "true" if t.split_b else b
        return (f"cf::gemm_tf32_wgmma<{t.stages}, {passes}, {a}, {b}, cf::LinearEpilogue, "
                f"{_cxx_bool(t.split_b)}>")
    return (f"cf::gemm_tf32<{t.bm}, {t.bn}, {t.stages}, {passes}, {a}, {b}, "
            f"{_cxx_bool(vec)}, cf::LinearEpilogue>")


# Keyed by (tile, passes, layout, 16-byte loads).
KERNELS = _runtime.KernelFamily("gemm_tf32.cu", {
    (tile, passes, layout, vec): _expr(TILES[tile], passes, layout, vec)
    for tile in TILES for passes in (1, 3) for layout in LAYOUTS
    for vec in ((True, False) if tile == "64x64" else (True,))
})

# Keyed by (passes, B K-major).
SPLIT_B_KERNELS = _runtime.KernelFamily("gemm_tf32.cu", {
    (passes, b_kmajor): f"cf::gemm_tf32_split_b<{passes}, {_cxx_bool(b_kmajor)}>"
    for passes in (1, 3) for b_kmajor in (True, False)
})

ACTIVATIONS = {None: 0, "none": 0, "relu": 1}

# Under "3xtf32", products summing fewer k-values than this run on cuBLAS
# SGEMM.  Measured (docs/gemm.md, max scaled error vs float64 at 1024x1024):
# 3xTF32 / SGEMM = 8.3x at k = 1, 1.2-2.4x at k = 8, 0.9-1.4x at k = 32 and
# 0.3-0.6x at k = 128-512.
SGEMM_BELOW_INNER = 32


def has_tf32_tensor_cores(device_index: int) -> bool:
    """Whether the GEMM kernels run on this device: compute capability 8.0
    or newer (TF32 ``mma.sync`` and ``cp.async``).  Below it, float32
    products take cuBLAS SGEMM under every precision setting."""
    return _runtime.device_capability(device_index) >= (8, 0)


_wgmma_setting = {"enabled": os.environ.get("CUPY_FUSED_GEMM_WGMMA", "1") != "0"}


def has_wgmma(device_index: int) -> bool:
    """Whether the GEMMs on this device may use the wgmma kernel: compute
    capability 9.0, unless ``CUPY_FUSED_GEMM_WGMMA=0`` (or
    :func:`set_wgmma_enabled`) turns it off, e.g. to compare with mma.sync."""
    return _wgmma_setting["enabled"] and _runtime.device_capability(device_index) == (9, 0)


def set_wgmma_enabled(enabled: bool) -> None:
    """Process-wide switch of the Hopper wgmma GEMM (default: on)."""
    _wgmma_setting["enabled"] = bool(enabled)


def available_tiles(device_index: int) -> Tuple[str, ...]:
    """The tile kernels that can run on this device (with 16-byte loads)."""
    return tuple(t for t in TILES if not TILES[t].wgmma or has_wgmma(device_index))


def choose_tile(m: int, n: int, vec: bool, device_index: int, passes: int = 3) -> str:
    """The tile kernel of an [m, n] product of ``passes`` (operand rows
    16-byte aligned when ``vec``): see :data:`TILES`."""
    if vec and cdiv(m, 128) * cdiv(n, 128) >= sm_count(device_index):
        if has_wgmma(device_index):
            return "wgmma128x128_split_b" if splits_b(m, n, passes) else "wgmma128x128"
        return "128x128"
    return "64x64"


def _rows_aligned(t: torch.Tensor, contiguous_extent: int) -> bool:
    """Every row of the 2-D contiguous ``t`` starts on 16 bytes."""
    return t.data_ptr() % 16 == 0 and contiguous_extent % 4 == 0


def _inner_size(a: torch.Tensor, layout: str) -> int:
    """K of a product in ``layout`` whose left operand is ``a``."""
    return a.shape[1] if LAYOUTS[layout][0] else a.shape[0]


def _product_shape(a: torch.Tensor, b: torch.Tensor, layout: str) -> Tuple[int, int]:
    """(M, N) of the product of ``a`` and ``b`` in ``layout``."""
    a_kmajor, b_kmajor = LAYOUTS[layout]
    return (a.shape[0] if a_kmajor else a.shape[1]), (b.shape[0] if b_kmajor else b.shape[1])


def uses_sgemm(passes: int, k: int) -> bool:
    """Whether a float32 product of ``passes`` (3 or 1) summing ``k``
    products runs on cuBLAS SGEMM instead of the tensor-core kernel.  An
    empty sum (k = 0) always does: the wgmma kernel's consumers wait for a
    first k-tile that never comes."""
    return k == 0 or (passes == 3 and k < SGEMM_BELOW_INNER)


def _product(a: torch.Tensor, b: torch.Tensor, layout: str, passes: int,
             bias: Optional[torch.Tensor] = None, activation: int = 0) -> torch.Tensor:
    """:func:`_gemm`, or cuBLAS SGEMM plus the epilogue where
    :func:`uses_sgemm` says so (same operands, same result shape)."""
    if not uses_sgemm(passes, _inner_size(a, layout)):
        return _gemm(a, b, layout, passes, bias, activation)
    if layout == "forward":
        out = torch.addmm(bias, a, b.t()) if bias is not None else a @ b.t()
    else:
        if bias is not None:
            raise ValueError("a bias is only fused into the forward product")
        out = a @ b if layout == "grad_input" else a.t() @ b
    return out.relu_() if activation == 1 else out


def _gemm(a: torch.Tensor, b: torch.Tensor, layout: str, passes: int,
          bias: Optional[torch.Tensor] = None, activation: int = 0) -> torch.Tensor:
    """One float32 product on the tensor cores (contiguous 2-D operands).

    layout ``"forward"``: a [M, K], b [N, K] -> a b^T [M, N];
    ``"grad_input"``: a [M, K], b [K, N] -> a b;
    ``"grad_weight"``: a [K, M], b [K, N] -> a^T b.
    ``passes``: 3 (3xTF32) or 1 (TF32).  Epilogue: ``act(. + bias)``, bias
    (N,) or None, activation 0 (none) or 1 (ReLU).
    """
    m, n = _product_shape(a, b, layout)
    out = torch.empty((m, n), dtype=torch.float32, device=a.device)
    if m == 0 or n == 0:
        return out
    if _inner_size(a, layout) == 0:  # an empty sum: no kernel (see uses_sgemm)
        out.zero_()
        if bias is not None:
            out += bias
        return out.relu_() if activation == 1 else out
    vec = _rows_aligned(a, a.shape[1]) and _rows_aligned(b, b.shape[1])
    tile = choose_tile(m, n, vec, a.device.index, passes)
    _launch_gemm(KERNELS.get((tile, passes, layout, vec), a.device.index), TILES[tile], layout,
                 a, b, out, bias, activation, passes)
    return out


def _gemm_on_tile(a: torch.Tensor, b: torch.Tensor, layout: str, passes: int, tile: str,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`_gemm` on the tile kernel ``tile`` (a key of :data:`TILES`, one
    of :func:`available_tiles`) with 16-byte loads, whatever
    :func:`choose_tile` would pick: for tests, sanitizer runs and tuning.
    The operands' rows must be 16-byte aligned.  ``out``: the [M, N] result
    to write (e.g. NaN-poisoned), else a new one."""
    m, n = _product_shape(a, b, layout)
    if not (_rows_aligned(a, a.shape[1]) and _rows_aligned(b, b.shape[1])):
        raise ValueError("_gemm_on_tile needs operands whose rows start on 16 bytes "
                         "(aligned pointers, contiguous extents that are multiples of 4)")
    if _inner_size(a, layout) == 0:
        raise ValueError("_gemm_on_tile needs a non-empty sum (K >= 1)")
    out = torch.empty((m, n), dtype=torch.float32, device=a.device) if out is None else out
    _launch_gemm(KERNELS.get((tile, passes, layout, True), a.device.index), TILES[tile], layout,
                 a, b, out, passes=passes)
    return out


def _launch_gemm(fn, tile: Tile, layout: str, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
                 bias: Optional[torch.Tensor] = None, activation: int = 0, passes: int = 3) -> None:
    """Launches ``fn``, a ``gemm_tf32`` (or ``gemm_tf32_wgmma``)
    instantiation of ``tile``, ``passes`` and ``layout``, writing ``out``
    [M, N] (operands as in :func:`_gemm`)."""
    a_kmajor, b_kmajor = LAYOUTS[layout]
    m, n = out.shape
    k = _inner_size(a, layout)
    dev, ldb = a.device.index, b.shape[1]
    if tile.split_b:  # the kernel then reads the planes image (and ignores ldb)
        b = _split_b(b, n, k, b_kmajor, passes)
    _bridge.launch(fn, (cdiv(m, tile.bm) * cdiv(n, tile.bn), 1, 1), tile.threads, (
        a.data_ptr(), b.data_ptr(), out.data_ptr(), _ptr_or_null(bias),
        activation, m, n, k, a.shape[1], ldb, n), dev,
        shared_mem=tile.shared_bytes(a_kmajor, b_kmajor, passes))


def _split_b(b: torch.Tensor, n: int, k: int, b_kmajor: bool, passes: int) -> torch.Tensor:
    """B's planes image for the ``split_b`` wgmma kernel (layout in
    ``kernels_cu/gemm_tf32.cuh``, ``plane_float_offset``): one float32
    buffer of ``passes == 3 ? 2 : 1`` planes of 128 x 32 values per (128-column
    tile, 32-deep k-tile) of B [k, n] (zero-padded), as the kernel's own
    split would make them."""
    k_tiles = cdiv(k, 32)
    tiles = cdiv(n, 128) * k_tiles
    image = torch.empty((tiles, (2 if passes == 3 else 1) * 128 * 32), dtype=torch.float32,
                        device=b.device)
    items = tiles * 128 * 4
    dev = b.device.index
    _bridge.launch(SPLIT_B_KERNELS.get((passes, b_kmajor), dev), (elementwise_grid(items, dev), 1, 1),
                   BLOCK, (b.data_ptr(), image.data_ptr(), n, k, b.shape[1], k_tiles, items), dev)
    return image


# ---------------------------------------------------------------- autograd op

def _forward(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
             activation: int, passes: int) -> torch.Tensor:
    return _product(x, weight, "forward", passes, bias, activation)


def _forward_fake(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                  activation: int, passes: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


def _linear_backward(dout: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, passes: int,
                     want_x: bool, want_weight: bool,
                     want_bias: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of ``x W^T + bias``.  Returns (dx, dW, dbias); each is empty
    when not wanted."""
    dz = dout.contiguous()  # also materialises a broadcast gradient
    dbias = dz.sum(0) if want_bias else dz.new_empty((0,))
    dx = _product(dz, weight, "grad_input", passes) if want_x else x.new_empty((0,))
    dw = _product(dz, x, "grad_weight", passes) if want_weight else weight.new_empty((0,))
    return dx, dw, dbias


def _backward_fake(dout: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, passes: int,
                   want_x: bool, want_weight: bool,
                   want_bias: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.empty_like(x) if want_x else x.new_empty((0,)),
            torch.empty_like(weight) if want_weight else weight.new_empty((0,)),
            weight.new_empty((weight.shape[0],) if want_bias else (0,)))


def _setup_context(ctx, inputs, output):
    x, weight, bias, activation, passes = inputs
    ctx.save_for_backward(x, weight)
    ctx.activation, ctx.passes, ctx.has_bias = activation, passes, bias is not None


def _backward_formula(ctx, grads, run_backward):
    if ctx.activation != 0:
        # linear() never records a graph through the fused-ReLU store (see there).
        raise RuntimeError("linear_tf32 with a fused activation has no backward")
    x, weight = ctx.saved_tensors
    want = ctx.needs_input_grad
    dx, dw, dbias = run_backward(grads[0], x, weight, ctx.passes, want[0], want[1],
                                 ctx.has_bias and want[2])
    return (dx if want[0] else None, dw if want[1] else None,
            dbias if ctx.has_bias and want[2] else None, None, None)


_LINEAR = FusedOp("linear_tf32", _forward, _forward_fake, _setup_context, _backward_formula,
                  _linear_backward, _backward_fake)


# ---------------------------------------------------------------- cuBLAS bias + ReLU

def _cublas_relu_forward(x: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor) -> torch.Tensor:
    # cuBLASLt's bias + ReLU epilogue: the whole layer in one launch.
    return torch._addmm_activation(bias, x, weight.t())


def _cublas_relu_forward_fake(x: torch.Tensor, weight: torch.Tensor,
                              bias: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


def _cublas_relu_backward(dz: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, want_x: bool,
                          want_weight: bool,
                          want_bias: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of the linear part of ``relu(x W^T + bias)``, given the
    gradient dz already gated by the ReLU.  Returns (dx, dW, dbias); each is
    empty when not wanted."""
    dz = dz.contiguous()
    # The bias gradient first, so that the column sum's scratch is freed
    # before the weight gradient exists (F.linear's backward sums it after the
    # products, on the engine's side: +64 MiB of peak on problem 76 in bf16).
    dbias = dz.sum(0) if want_bias else dz.new_empty((0,))
    # torch.mm, not @: Tensor.__matmul__ is a Python wrapper around
    # torch.matmul, which then picks mm; host work counts here, since at
    # problem 76's shape the half-precision step is as long as its host work.
    dx = torch.mm(dz, weight) if want_x else x.new_empty((0,))
    dw = torch.mm(dz.t(), x) if want_weight else weight.new_empty((0,))
    return dx, dw, dbias


def _cublas_relu_backward_fake(dz: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                               want_x: bool, want_weight: bool,
                               want_bias: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward_fake(dz, x, weight, 0, want_x, want_weight, want_bias)  # (passes: unused)


def _cublas_relu_setup_context(ctx, inputs, output):
    # Traced (the registered custom op): the caller's relu_ gates the gradient.
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight)
    ctx.gates = False


def _cublas_relu_eager_setup_context(ctx, inputs, output):
    # Eager: this node gates the gradient itself, with the output kept for
    # that one use (see _CUBLAS_RELU); the bias is saved to recompute it.
    ctx.save_for_backward(*inputs)
    keep_output(ctx, output)
    ctx.gates = True


def _cublas_relu_backward_formula(ctx, grads, run_backward):
    dz = grads[0]
    if ctx.gates:
        x, weight, bias = ctx.saved_tensors
        y = take_output(ctx)
        if y is None:  # a second backward through a retained graph
            y = _cublas_relu_forward(x, weight, bias)
        # ReLU's own backward kernel (as eager's ReLU node), then y is dropped
        # before the products allocate dW.
        dz = torch.ops.aten.threshold_backward(dz, y, 0)
        del y
    else:
        x, weight = ctx.saved_tensors
    want = ctx.needs_input_grad
    dx, dw, dbias = run_backward(dz, x, weight, want[0], want[1], want[2])
    return (dx if want[0] else None, dw if want[1] else None, dbias if want[2] else None)


# relu(x W^T + bias) in one cuBLASLt launch, and its backward: the ReLU's
# gate, the bias gradient's column sum, dX and dW.  The gate needs the
# output, which must not stay alive through the products (+16 MiB of peak
# on problem 76 in bf16, above torch.compile's).  Eager calls keep it for
# the gate only (keep_output) and drop it before the products.  Traced
# calls, whose graph carries saved tensors only, gate with a native relu_
# that the caller applies to the output (values unchanged: they are >= 0
# already), whose own node then frees the output.  Only _run_linear uses it,
# that way.
_CUBLAS_RELU = FusedOp("linear_relu_cublas", _cublas_relu_forward, _cublas_relu_forward_fake,
                       _cublas_relu_setup_context, _cublas_relu_backward_formula,
                       _cublas_relu_backward, _cublas_relu_backward_fake,
                       eager_setup_context=_cublas_relu_eager_setup_context)


# ---------------------------------------------------------------- autocast

# cuBLAS products of float16 / bfloat16 operands written straight to float32
# (``aten::mm.dtype``: ``torch.mm(a, b, out_dtype=torch.float32)``, CUDA
# only, torch >= 2.8; cuBLAS accumulates in float32 either way, and this
# only skips the rounding to the half dtype).  Without it the product is
# rounded to the operands' dtype, then cast: the same values to that
# rounding, one more kernel.
MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype")
# torch refuses float16 operands with a float32 result when cuBLAS may
# accumulate in float16 (torch.backends.cuda.matmul.allow_fp16_accumulation).
_fp16_accumulation = getattr(torch._C, "_get_cublas_allow_fp16_accumulation", lambda: False)


def _mm_to(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` (2-D, one dtype) with its result in ``dtype``: written
    directly by cuBLAS when ``dtype`` is float32 and the operands float16 /
    bfloat16 on CUDA (:data:`MM_OUT_DTYPE`), else the product in the
    operands' dtype cast to ``dtype``."""
    if dtype == a.dtype:
        return torch.mm(a, b)
    if (MM_OUT_DTYPE and dtype == torch.float32 and a.is_cuda
            and not (a.dtype == torch.float16 and _fp16_accumulation())):
        return torch.mm(a, b, out_dtype=dtype)
    return torch.mm(a, b).to(dtype)


def _autocast_forward(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                      x_d: torch.Tensor, w_d: torch.Tensor,
                      bias_d: Optional[torch.Tensor]) -> torch.Tensor:
    # x, weight, bias: what the gradients go to (their dtypes); the product
    # reads their casts, as nn.Linear's under autocast: the same cuBLAS call.
    if bias_d is None:
        return torch.mm(x_d, w_d.t())
    return torch.addmm(bias_d, x_d, w_d.t())


def _autocast_forward_fake(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                           x_d: torch.Tensor, w_d: torch.Tensor,
                           bias_d: Optional[torch.Tensor]) -> torch.Tensor:
    return x_d.new_empty((x_d.shape[0], w_d.shape[0]))


def _autocast_products(dz: torch.Tensor, x_d: torch.Tensor, take_w_d: Callable[[], torch.Tensor],
                       x_dtype: torch.dtype, weight_dtype: torch.dtype, bias_dtype: torch.dtype,
                       want_x: bool, want_weight: bool, want_bias: bool):
    """(dx, dW, dbias) of ``x_d W_d^T + bias_d`` in x's, W's and the bias's
    own dtypes, each written by its product / sum (:func:`_mm_to`; the column
    sum accumulates in float32), with no cast kernels; None where not wanted.
    ``take_w_d`` returns W_d, which is dropped here after dX and before dW is
    allocated (the eager path holds no other reference to it)."""
    dz = dz.contiguous()  # also materialises a broadcast gradient
    # The bias gradient first (see _cublas_relu_backward).
    dbias = dz.sum(0, dtype=bias_dtype) if want_bias else None
    w_d = take_w_d()
    dx = _mm_to(dz, w_d, x_dtype) if want_x else None
    del w_d
    dw = _mm_to(dz.t(), x_d, weight_dtype) if want_weight else None
    return dx, dw, dbias


def _autocast_linear_backward(dz: torch.Tensor, x_d: torch.Tensor, w_d: torch.Tensor,
                              x_dtype: torch.dtype, weight_dtype: torch.dtype,
                              bias_dtype: torch.dtype, want_x: bool, want_weight: bool,
                              want_bias: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward custom op: :func:`_autocast_products`, each gradient
    empty when not wanted."""
    grads = _autocast_products(dz, x_d, lambda: w_d, x_dtype, weight_dtype, bias_dtype, want_x,
                               want_weight, want_bias)
    return tuple(g if g is not None else dz.new_empty((0,)) for g in grads)


def _autocast_backward_fake(dz: torch.Tensor, x_d: torch.Tensor, w_d: torch.Tensor,
                            x_dtype: torch.dtype, weight_dtype: torch.dtype,
                            bias_dtype: torch.dtype, want_x: bool, want_weight: bool,
                            want_bias: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (x_d.new_empty(x_d.shape if want_x else (0,), dtype=x_dtype),
            w_d.new_empty(w_d.shape if want_weight else (0,), dtype=weight_dtype),
            dz.new_empty((w_d.shape[0],) if want_bias else (0,), dtype=bias_dtype))


def _autocast_setup_context(ctx, inputs, output):
    x, weight, bias, x_d, w_d, _ = inputs
    # The casts, as autocast's own nn.Linear saves them (not x and W).
    ctx.save_for_backward(x_d, w_d)
    ctx.dtypes = (x.dtype, weight.dtype, bias.dtype if bias is not None else output.dtype)
    ctx.has_bias = bias is not None


def _autocast_eager_setup_context(ctx, inputs, output):
    # Eager: the weight's cast is kept for one use (as keep_output keeps an
    # output), so that the backward drops it after dX and before dW, the
    # largest tensor of the step, is allocated: the reference's autograd
    # frees its own cast there too (MmBackward's saved tensors go before the
    # cast back to float32 runs).
    x, weight, bias, x_d, w_d, _ = inputs
    ctx.save_for_backward(x_d)
    ctx.kept_w_d, ctx.weight, ctx.weight_version = w_d, weight, weight._version
    ctx.dtypes = (x.dtype, weight.dtype, bias.dtype if bias is not None else output.dtype)
    ctx.has_bias = bias is not None


def _take_weight_cast(ctx) -> torch.Tensor:
    """The weight's cast kept by the eager setup, which the node then no
    longer holds; recast from the weight for a second backward through a
    retained graph (refused, as autograd refuses, if the weight changed in
    place since the forward)."""
    w_d, ctx.kept_w_d = ctx.kept_w_d, None
    if w_d is not None:
        return w_d
    if ctx.weight._version != ctx.weight_version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: the weight of cupy_fused::linear_autocast is at version "
            f"{ctx.weight._version}; expected version {ctx.weight_version} instead")
    return ctx.weight.detach().to(ctx.saved_tensors[0].dtype)


def _autocast_backward_formula(ctx, grads, run_backward):
    want = ctx.needs_input_grad
    want_bias = ctx.has_bias and want[2]
    if hasattr(ctx, "kept_w_d"):  # eager (see _autocast_eager_setup_context)
        (x_d,) = ctx.saved_tensors
        return _autocast_products(grads[0], x_d, lambda: _take_weight_cast(ctx), *ctx.dtypes,
                                  want[0], want[1], want_bias) + (None, None, None)
    x_d, w_d = ctx.saved_tensors
    dx, dw, dbias = run_backward(grads[0], x_d, w_d, *ctx.dtypes, want[0], want[1], want_bias)
    return (dx if want[0] else None, dw if want[1] else None, dbias if want_bias else None,
            None, None, None)


# nn.Linear under torch.autocast("cuda", dtype=d), without the casts'
# autograd nodes: inputs x, W, bias (any float dtypes; they receive the
# gradients) and their casts to d (no gradient; the product reads them),
# output z in d.  The backward writes dX, dW and dbias in x's, W's and the
# bias's dtypes straight from cuBLAS (_mm_to), where autograd's casts would
# produce them in d and cast them back, one more kernel each (problem 76's
# weight gradient, 8192 x 8192: ~0.13 ms of an H100 per step) and both
# copies alive at once.  It saves the casts, as the reference does.
_LINEAR_AUTOCAST = FusedOp("linear_autocast", _autocast_forward, _autocast_forward_fake,
                           _autocast_setup_context, _autocast_backward_formula,
                           _autocast_linear_backward, _autocast_backward_fake,
                           eager_setup_context=_autocast_eager_setup_context)


def _run_autocast_linear(x2: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                         dtype: torch.dtype, bias_grad: bool = True) -> torch.Tensor:
    """``F.linear(x2, weight, bias)`` under ``torch.autocast("cuda",
    dtype=dtype)``, on operands already checked (x2 [M, K], weight [N, K],
    bias (N,) flat or None; any float dtypes, one device): the product in
    ``dtype`` (bias in cuBLAS's epilogue), gradients in each tensor's own
    dtype (:data:`_LINEAR_AUTOCAST`).  ``bias_grad=False``: the bias is
    added but gets no gradient from this op (a caller computes it)."""
    x_d = x2.detach().to(dtype)  # (.to returns the tensor itself when already in dtype)
    w_d = weight.detach().to(dtype)
    bias_d = bias.detach().to(dtype) if bias is not None else None
    if not bias_grad:
        bias = None
    return _LINEAR_AUTOCAST.run(needs_grad(x2, weight, bias), x2, weight, bias, x_d, w_d, bias_d)


def linear(x, weight, bias=None, activation: Optional[str] = None,
           precision: Optional[str] = None):
    """``act(x @ weight.T + bias)``, like ``torch.nn.functional.linear``
    followed by the activation.

    x: [..., K]; weight: [N, K]; bias: (N,) or None; all one dtype
    (float32, float16 or bfloat16) on one CUDA device (or CuPy arrays).
    activation: None or ``"relu"``.  precision: ``"3xtf32"``, ``"tf32"``,
    ``"ieee"`` or None (the default of :func:`set_fp32_matmul_precision`);
    float16 / bfloat16 always use cuBLAS.  Returns [..., N] in x's dtype.

    Under ``torch.autocast("cuda", dtype=d)``, as ``F.linear`` there: x,
    weight and bias (any float dtypes) are cast to d, the product runs in d
    (cuBLAS; the ReLU after it) and returns d; gradients come back in each
    tensor's own dtype, written so by the backward's products
    (:func:`_run_autocast_linear`).
    """
    if not isinstance(x, torch.Tensor):
        return call_with_cupy_arrays(linear, "x", x, weight, bias, activation, precision)
    check_tensor("x", x)
    if x.dim() == 0:
        raise ValueError("x must have at least 1 dimension (the features), got a scalar")
    check_tensor("weight", weight, ndim=(2,))
    amp = autocast_dtype()
    if amp is not None:
        check_like("weight", weight, x, "x", weight.dtype)  # the device
    else:
        check_like("weight", weight, x, "x")
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"x must have {k} features (weight is [{n}, {k}]) in its last "
                         f"dimension, got shape {tuple(x.shape)}")
    if amp is not None:  # any float dtype (cast to amp by the op)
        bias = check_vector("bias", bias, n, x, "x", dtype=(
            bias.dtype if isinstance(bias, torch.Tensor) and bias.is_floating_point() else amp))
    else:
        bias = check_vector("bias", bias, n, x, "x")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be None or 'relu', got {activation!r}")
    act, precision = ACTIVATIONS[activation], resolve_precision(precision)
    x2 = x if x.dim() == 2 else x.reshape(x.shape[:-1].numel(), k)  # (not -1: k may be 0)
    if amp is not None:
        y = _run_autocast_linear(x2, weight, bias, amp)
        if act:  # relu(F.linear(x, weight, bias)) in amp, as the reference
            y = y.relu_()
    else:  # (2-D x: no reshape, a view is one more autograd node per call)
        y = _run_linear(x2, weight, bias, act, precision)
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], n)


def uses_cublas(dtype: torch.dtype, precision: str, device_index: int) -> bool:
    """Whether a product runs on cuBLAS (see the module docstring): float16 /
    bfloat16, ``"ieee"``, or a GPU without TF32 tensor cores."""
    return (dtype != torch.float32 or precision == "ieee"
            or not has_tf32_tensor_cores(device_index))


def _run_linear(x2: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                activation: int, precision: str) -> torch.Tensor:
    """:func:`linear` on operands it (or a caller applying the same rules)
    has already checked: x2 [M, K], weight [N, K], bias (N,) flat or None,
    activation 0 (none) or 1 (ReLU), precision resolved.  Returns [M, N]."""
    cublas = uses_cublas(x2.dtype, precision, x2.get_device())
    grad = needs_grad(x2, weight, bias)
    if cublas:
        if activation == 0:
            return F.linear(x2, weight, bias)
        # cuBLAS's own epilogue, no kernel of ours (see "What is fused" in
        # docs/design.md): cuBLASLt's bias + ReLU in the GEMM, one launch; backward in
        # torch ops.  A half-precision training step of problem 76 takes less
        # GPU time (~0.6 ms on H100) than the host needs to issue it, so the
        # fewest launches and autograd nodes win.
        if bias is None or x2.numel() == 0 or weight.numel() == 0:
            return F.linear(x2, weight, bias).relu_()  # native autograd
        y = _CUBLAS_RELU.run(grad, x2, weight, bias)
        # Traced, the ReLU's gate is a native node (see _CUBLAS_RELU).
        return y.relu_() if grad and is_compiling() else y
    x2 = x2 if x2.is_contiguous() else x2.contiguous()
    weight = weight if weight.is_contiguous() else weight.contiguous()
    passes = PASSES[precision]
    if activation == 1 and grad:
        # The GEMM, then bias + ReLU in the bias_relu kernel, which keeps a
        # 1-bit mask for the backward.  With ReLU fused into the GEMM's store
        # the backward would need the float32 output instead, alive until
        # both weight and input gradients are done: one more activation of
        # peak training memory (measured on problem 76: 0.344 GiB against
        # 0.313) to save one pass over the output.
        z = _LINEAR.run(grad, x2, weight, None, 0, passes)
        return bias_relu(z, bias if bias is not None else z.new_zeros((weight.shape[0],)))
    return _LINEAR.run(grad, x2, weight, bias, activation, passes)
