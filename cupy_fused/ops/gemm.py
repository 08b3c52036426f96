"""The float32 GEMM engine: one product on TF32 tensor cores at float32
accuracy ("3xTF32") or in one TF32 pass, with a bias and ReLU fused into its
store; which kernel runs a product (the tile dispatch, B split into its TF32
planes beforehand, cuBLAS SGEMM for short sums), which products leave the
tensor cores for cuBLAS altogether (:func:`uses_cublas`), and the autograd op
of a float32 linear layer on it (``dX = dz W`` and ``dW = dz^T x`` on the
same kernel family).  Kernels: ``kernels_cu/gemm_tf32.cu`` (shared parts in
``gemm_tf32.cuh``).  The public op on top is :func:`.linear.linear`.

Precision of float32 products (``precision=`` argument of the ops, or the
process-wide default of :func:`cupy_fused.settings.fp32_matmul_precision`):

* ``"3xtf32"`` (default): each operand split into two TF32 parts, three
  tensor-core products, accumulated in float32 chunks of 16 k-values.  On
  sums of 32 products or more it is about as accurate as cuBLAS SGEMM or
  more (see the accuracy tables in docs/gemm.md).  Shorter sums, where the split's
  own ~2^-22 representation error dominates (up to 8x SGEMM's error at
  one product), run on cuBLAS SGEMM instead, and so do outputs of at most
  16 rows or columns or that fit one 128 x 128 tile, and sums of under 40
  terms, or of 256 and more with at least 32 a tile, into outputs too
  small to fill the GPU, where the kernel's error reached 1.35-4x
  cuBLAS's at some seeds: see :func:`uses_sgemm`.  This applies per
  product: a batch of 20 rows takes SGEMM for the weight gradient (a sum
  over the batch), while the layer's other two products may keep 3xTF32.
* ``"tf32"``: one TF32 product (about 1e-3 relative error), fastest.
* ``"ieee"``: cuBLAS SGEMM (``torch.nn.functional.linear``).  This is also
  the path of float16 / bfloat16 inputs, whose tensor-core GEMMs are
  cuBLAS's own (bias and ReLU on that path: see :mod:`.linear`), except
  the one-launch GroupNorm forward of :mod:`.linear_gn_chain` and, under
  autocast without autograd, the product with a float32 weight
  (:func:`_linear_float32_weight`), both on the 16-bit Hopper engine at the
  end of this module.

The cuBLAS products follow torch's own settings: with
``torch.backends.cuda.matmul.allow_tf32 = True`` they run in TF32.

GPUs below compute capability 8.0 (V100, T4) have no TF32 tensor cores:
there every float32 product runs on cuBLAS SGEMM, whatever the precision
(:func:`has_tf32_tensor_cores`).  On 9.0 (H100, H200) the products that fill
the GPU run on the Hopper GEMM engine (:func:`has_wgmma`), the one the
16-bit products run on, with a 3xTF32 MMA policy; those with many rows of
C split B into its TF32 planes once beforehand (:func:`splits_b`), the
others in the kernel.

Non-finite inputs: NaN and ±inf land where SGEMM puts them under every
precision.  (With ``"3xtf32"`` the kernels redo a NaN sum, which an
infinite operand's correction products can give where SGEMM gives ±inf, as
a plain float32 dot product, from the raw operands, which also mends
operands within TF32 rounding of FLT_MAX.  Under ``"tf32"`` those round
to ±inf: docs/gemm.md.)
"""
from __future__ import annotations

import ctypes
import functools
import sys
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from .. import _bridge, _runtime
from .._amp import HALF_DTYPES
from .._autograd import FusedOp, is_compiling, on_example_sizes, product_operands
from .._validation import cxx_type
from ..settings import get_gemm_wgmma
from ._common import BLOCK, cdiv, elementwise_grid, _ptr_or_null, sm_count
from .bias_relu import bias_relu

# Tensor-core passes of each precision that runs on our kernels ("ieee"
# runs on cuBLAS).
PASSES = {"3xtf32": 3, "tf32": 1}


# ---------------------------------------------------------------- kernels

@dataclass(frozen=True)
class Tile:
    """Block tile of a GEMM kernel: bm x bn outputs, k-tiles of 32, a
    ``stages``-deep pipeline: on ``mma.sync`` (``gemm_tf32``), of raw
    float32 tiles brought by ``cp.async``; ``engine``: the product on the
    Hopper GEMM engine (``gemm_tf32_engine``, ``kernels_cu/gemm.cuh``:
    persistent, 3 warpgroups), each stage holding A's tile, brought by the
    copy engine, and B's TF32 planes, split in the kernel from raw tiles of
    B in a ring of :data:`ENGINE_RAW_SLOTS` of their own or, with
    ``split_b``, by a kernel of their own beforehand
    (``gemm_tf32_split_image``) and copied."""

    bm: int
    bn: int
    stages: int
    engine: bool = False
    split_b: bool = False

    @property
    def threads(self) -> int:
        return 384 if self.engine else 256

    def shared_bytes(self, a_kmajor: bool, b_kmajor: bool, passes: int = 3) -> int:
        if self.engine:  # a stage: A's tile and B's planes, 16 KiB each; the raw B slots
            raw = 0 if self.split_b else ENGINE_RAW_SLOTS
            return _half_shared_bytes(0, self.stages, ENGINE_PLANE_BYTES * (1 + _planes(passes)),
                                      ENGINE_PLANE_BYTES * raw, 2 * raw)
        a = self.bm * 36 if a_kmajor else 32 * (self.bm + 4)
        b = self.bn * 36 if b_kmajor else 32 * (self.bn + 4)
        return self.stages * (a + b) * 4


# On H100/H200 (compute capability 9.0) every GEMM that fills the GPU with
# 128x128 tiles and has 16-byte aligned rows runs on the engine (4 stages
# of A's tile and B's planes, and 2 slots of raw B: 225 KiB of shared
# memory), B split once beforehand where :func:`splits_b` says so (193
# KiB).  Other GPUs: 128x128 on mma.sync (4 stages, 144 KiB) where a block
# may take that much (A100: 163 KiB; not 8.6 or 8.9: 99 KiB).  64x64
# (72 KiB) elsewhere, for smaller GEMMs and for operands not 16-byte
# aligned (word-by-word loads).
# scripts/tune_gemm.py and benchmarks/gemm.py compare the candidates (see
# docs/gemm.md).
TILES = {"engine128x128": Tile(128, 128, 4, engine=True),
         "engine128x128_split_b": Tile(128, 128, 4, engine=True, split_b=True),
         "128x128": Tile(128, 128, 4), "64x64": Tile(64, 64, 4)}
# The engine's tiles of A, of each of B's planes and of raw B: 128 rows x 32
# float32; the raw tiles' slots where B is split in the kernel
# (SplittingLoader's kRaw).
ENGINE_PLANE_BYTES = 128 * 32 * 4
ENGINE_RAW_SLOTS = 2


def _planes(passes: int) -> int:
    """B's TF32 planes for ``passes``: big and small (3), big (1)."""
    return 2 if passes == 3 else 1


# The split of B beforehand reads B once and writes its planes (12 bytes per
# element), where the in-kernel split redoes it for every 128-row tile of C
# on the kernel's critical path; it pays from a few thousand rows on.
SPLIT_B_MIN_ROWS = 4096


def splits_b(m: int, n: int, passes: int) -> bool:
    """Whether an engine product with an [m, n] result splits B beforehand:
    from :data:`SPLIT_B_MIN_ROWS` rows of C on, and only where the planes
    image (``passes == 3 ? 2 : 1`` times B's n x k values) is no larger than
    A (m x k), so that the transient buffer never outgrows an operand the
    caller already holds.  (On problem 76's weight gradient, 8192 x 8192
    from a batch of 1024, the split is faster, but its 64 MiB image, twice
    A, would raise the training step's peak memory above torch.compile's:
    docs/gemm.md.)"""
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
    if t.engine:  # 128x128, 16-byte rows (B's layout: its split's and the redo's)
        return f"cf::gemm_tf32_engine<{t.stages}, {passes}, {a}, {b}, {_cxx_bool(t.split_b)}>"
    return (f"cf::gemm_tf32<{t.bm}, {t.bn}, {t.stages}, {passes}, {a}, {b}, "
            f"{_cxx_bool(vec)}, cf::LinearEpilogue>")


# Keyed by (tile, passes, layout, 16-byte loads).
KERNELS = _runtime.KernelFamily("gemm_tf32.cu", {
    (tile, passes, layout, vec): _expr(TILES[tile], passes, layout, vec)
    for tile in TILES for passes in (1, 3) for layout in LAYOUTS
    for vec in ((True, False) if tile == "64x64" else (True,))
})

# Keyed by (passes, B K-major).
SPLIT_IMAGE_KERNELS = _runtime.KernelFamily("gemm_tf32.cu", {
    (passes, b_kmajor): f"cf::gemm_tf32_split_image<{passes}, {_cxx_bool(b_kmajor)}>"
    for passes in (1, 3) for b_kmajor in (True, False)
})


# Under "3xtf32", products summing fewer k-values than this run on cuBLAS
# SGEMM: on short sums the split's own representation error dominates and
# 3xTF32 is less accurate than SGEMM; from about 32 terms on it is as
# accurate or more (the accuracy table in docs/gemm.md).
SGEMM_BELOW_INNER = 32

# Under "3xtf32", an output of fewer 128 x 128 tiles than the GPU has SMs
# that sums fewer k-values than this runs on cuBLAS SGEMM too: at 32 terms
# the kernel's error there was up to 1.35-1.5x SGEMM's over some seeds, and
# SGEMM took less GPU time; from 40 on at most about 1.2x.  Outputs that fill
# the GPU keep the kernel at 32 terms, as accurate as SGEMM there and
# faster (docs/gemm.md, "Small outputs, long sums").
SHORT_SUM_INNER = 40

# Under "3xtf32", a long sum (k of at least SPLIT_K_INNER, and at least
# SPLIT_K_PER_TILE k-values per 128 x 128 tile of the output) over an
# output of fewer such tiles than the GPU has SMs runs on cuBLAS SGEMM too:
# there cuBLAS splits the sum over several blocks, so that its float32
# chains are short, and the kernel's one chain per tile, which leaves most
# SMs idle, erred up to 2.2x SGEMM's from 256 k-values on and took
# 1.3-2.3x its GPU time.  Below 256, over two tiles or more, the kernel's
# median error was at most SGEMM's from 32 k-values on, and 0.36-0.75x of
# it from 48 (the grids in docs/gemm.md, "Small outputs, long sums").
SPLIT_K_INNER = 256
SPLIT_K_PER_TILE = 32

# Under "3xtf32", an output with at most this many rows or columns runs on
# cuBLAS SGEMM too, whatever k: cuBLAS's kernels for such shapes sum more
# accurately than the kernel's chunked chain (its error 1.1-2x cuBLAS's in
# the median, up to 4x at worst, from k = 32 to 512), at the same time
# (both a launch's few microseconds; docs/gemm.md, "Small outputs, long
# sums").  So does an output that fits one 128 x 128 tile: there the
# kernel's error reached 1.6-2.6x SGEMM's at some seed at every k from 32
# to 192, for a few microseconds of GPU time either way.
SGEMM_AT_MOST_ROWS = 16


def has_tf32_tensor_cores(device_index: int) -> bool:
    """Whether the GEMM kernels run on this device: compute capability 8.0
    or newer (TF32 ``mma.sync`` and ``cp.async``).  Below it, float32
    products take cuBLAS SGEMM under every precision setting."""
    return _runtime.device_capability(device_index) >= (8, 0)


def has_wgmma(device_index: int) -> bool:
    """Whether the GEMMs on this device may use the Hopper engine (wgmma):
    compute capability 9.0, unless the setting
    :func:`cupy_fused.settings.gemm_wgmma` (``CUPY_FUSED_GEMM_WGMMA=0``)
    turns it off (the fallback route)."""
    return get_gemm_wgmma() and _runtime.device_capability(device_index) == (9, 0)


def _tile_fits(name: str, device_index: int) -> bool:
    """Whether tile ``name``'s shared memory, in every layout, fits what a
    block of this device may take: the 128x128 ``mma.sync`` tile's 144 KiB
    does not on compute capability 8.6 or 8.9 (99 KiB)."""
    return TILE_SHARED_BYTES[name] <= _runtime.max_shared_bytes(device_index)


def available_tiles(device_index: int) -> Tuple[str, ...]:
    """The tile kernels that can run on this device (with 16-byte loads)."""
    return tuple(t for t in TILES if (not TILES[t].engine or has_wgmma(device_index))
                 and _tile_fits(t, device_index))


def choose_tile(m: int, n: int, vec: bool, device_index: int, passes: int = 3, k: int = 0) -> str:
    """The tile kernel of an [m, n] product of ``passes`` summing ``k``
    products (operand rows 16-byte aligned when ``vec``): see :data:`TILES`.
    The engine's tiles take no extent of 2^31 or more (the copy engine's
    coordinates are 32-bit): such a product takes ``"128x128"``, where it
    fits in shared memory (:func:`_tile_fits`), else ``"64x64"``."""
    if vec and cdiv(m, 128) * cdiv(n, 128) >= sm_count(device_index):
        if has_wgmma(device_index) and max(m, n, k) < 2**31:
            return "engine128x128_split_b" if splits_b(m, n, passes) else "engine128x128"
        if _tile_fits("128x128", device_index):
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


def uses_sgemm(passes: int, k: int, m: Optional[int] = None, n: Optional[int] = None,
               sms: Optional[int] = None) -> bool:
    """Whether a float32 product runs on cuBLAS SGEMM instead of the
    tensor-core kernel.

    Args:
        passes: 3 (``"3xtf32"``) or 1 (``"tf32"``).
        k: the products each output element sums.
        m, n, sms: the output's rows and columns and the GPU's SM count,
            for the rules on the output's size (left out: none applied).

    Returns:
        True for an empty sum (k = 0: no tensor-core kernel is launched
        for one), and under 3 passes for a short sum (k below
        SGEMM_BELOW_INNER), an output of few rows or columns
        (SGEMM_AT_MOST_ROWS) or that fits one 128 x 128 tile, or a short
        sum (SHORT_SUM_INNER) or a long one (SPLIT_K_INNER, at least
        SPLIT_K_PER_TILE a tile) over fewer tiles than SMs.
    """
    if k == 0:
        return True
    if passes != 3:
        return False
    if k < SGEMM_BELOW_INNER:
        return True
    if m is None or n is None or sms is None:
        return False
    tiles = cdiv(m, 128) * cdiv(n, 128)
    if min(m, n) <= SGEMM_AT_MOST_ROWS or tiles == 1:
        return True
    if tiles >= sms:
        return False
    return k < SHORT_SUM_INNER or (k >= SPLIT_K_INNER and tiles * SPLIT_K_PER_TILE <= k)


def _product(a: torch.Tensor, b: torch.Tensor, layout: str, passes: int,
             bias: Optional[torch.Tensor] = None, activation: int = 0) -> torch.Tensor:
    """:func:`_gemm`, or cuBLAS SGEMM plus the epilogue where
    :func:`uses_sgemm` says so (same operands, same result shape)."""
    k = _inner_size(a, layout)
    # (the output's size and the SM count asked only where they can matter)
    if not uses_sgemm(passes, k) and not (passes == 3 and uses_sgemm(
            passes, k, *_product_shape(a, b, layout), sm_count(a.device.index))):
        return _gemm(a, b, layout, passes, bias, activation)
    if layout == "forward":
        if bias is not None and activation == 1:
            # The product, then bias + ReLU in bias_relu, as the training
            # forward computes them (linear.py, _run_linear): addmm's
            # epilogue may run another cuBLAS kernel, and a forward without
            # autograd must give the training forward's bits (a reentrant
            # checkpoint recomputes the one with the other).
            return bias_relu(a @ b.t(), bias)
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
    k = _inner_size(a, layout)
    if k == 0:  # an empty sum: no kernel (see uses_sgemm)
        out.zero_()
        if bias is not None:
            out += bias
        return out.relu_() if activation == 1 else out
    vec = _rows_aligned(a, a.shape[1]) and _rows_aligned(b, b.shape[1])
    tile = choose_tile(m, n, vec, a.device.index, passes, k)
    _launch_gemm(KERNELS.get((tile, passes, layout, vec), a.device.index), TILES[tile], layout,
                 a, b, out, bias, activation, passes)
    return out


def _gemm_on_tile(a: torch.Tensor, b: torch.Tensor, layout: str, passes: int, tile: str,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`_gemm` on the tile kernel ``tile`` (a key of :data:`TILES`, one
    of :func:`available_tiles`) with 16-byte loads, whatever
    :func:`choose_tile` would pick: for tests, sanitizer runs and tuning.
    The operands' rows must be 16-byte aligned, and an engine tile's
    extents below 2^31, as :func:`choose_tile` has them.  ``out``: the
    [M, N] result to write (e.g. NaN-poisoned), else a new one."""
    (m, n), k = _product_shape(a, b, layout), _inner_size(a, layout)
    if TILES[tile].engine and max(m, n, k) >= 2**31:
        raise ValueError(f"_gemm_on_tile: the {tile} tile takes M, N and K below 2^31 (the copy "
                         f"engine's coordinates are 32-bit), got M={m}, N={n}, K={k}")
    if not (_rows_aligned(a, a.shape[1]) and _rows_aligned(b, b.shape[1])):
        raise ValueError("_gemm_on_tile needs operands whose rows start on 16 bytes "
                         "(aligned pointers, contiguous extents that are multiples of 4)")
    if k == 0:
        raise ValueError("_gemm_on_tile needs a non-empty sum (K >= 1)")
    if out is None:
        out = torch.empty((m, n), dtype=torch.float32, device=a.device)
    elif (out.shape != (m, n) or out.dtype != torch.float32 or out.device != a.device
          or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous [{m}, {n}] float32 tensor on a's device")
    _launch_gemm(KERNELS.get((tile, passes, layout, True), a.device.index), TILES[tile], layout,
                 a, b, out, passes=passes)
    return out


def _launch_gemm(fn, tile: Tile, layout: str, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
                 bias: Optional[torch.Tensor] = None, activation: int = 0, passes: int = 3) -> None:
    """Launches ``fn``, a ``gemm_tf32`` (or ``gemm_tf32_engine``)
    instantiation of ``tile``, ``passes`` and ``layout``, writing ``out``
    [M, N] (operands as in :func:`_gemm`)."""
    if tile.engine:
        _launch_engine(fn, tile, layout, a, b, out, bias, activation, passes)
        return
    a_kmajor, b_kmajor = LAYOUTS[layout]
    m, n = out.shape
    k = _inner_size(a, layout)
    dev = a.device.index
    _bridge.launch(fn, (cdiv(m, tile.bm) * cdiv(n, tile.bn), 1, 1), tile.threads, (
        a.data_ptr(), b.data_ptr(), out.data_ptr(), _ptr_or_null(bias),
        activation, m, n, k, a.shape[1], b.shape[1], n), dev,
        shared_mem=tile.shared_bytes(a_kmajor, b_kmajor, passes))


def _split_image(b: torch.Tensor, n: int, k: int, b_kmajor: bool, passes: int) -> torch.Tensor:
    """B's split image for the engine's product (``kernels_cu/gemm_tf32.cuh``,
    ``PlanesLoader``): per (128-column tile, 32-deep k-tile) of B [k, n],
    ``_planes(passes)`` planes of 128 x 32 TF32 parts in the stage's swizzled
    layout (zero-padded)."""
    k_tiles = cdiv(k, 32)
    tiles = cdiv(n, 128) * k_tiles
    image = torch.empty((tiles, _planes(passes) * 128 * 32), dtype=torch.float32, device=b.device)
    items = tiles * 128 * 4
    dev = b.device.index
    _bridge.launch(SPLIT_IMAGE_KERNELS.get((passes, b_kmajor), dev), (elementwise_grid(items, dev), 1, 1),
                   BLOCK, (b.data_ptr(), image.data_ptr(), n, k, b.shape[1], k_tiles, items), dev)
    return image


def _launch_engine(fn, tile: Tile, layout: str, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
                   bias: Optional[torch.Tensor], activation: int, passes: int) -> None:
    """:func:`_launch_gemm` for the engine's tiles: ``fn``
    (``gemm_tf32_engine``) reads A through a tensor map, and B through one
    (split in the kernel) or, with ``split_b``, its image
    (:func:`_split_image`) by contiguous copies; one block per SM at most
    (persistent)."""
    a_kmajor, b_kmajor = LAYOUTS[layout]
    m, n = out.shape
    k = _inner_size(a, layout)
    dev = a.device.index
    # A as it lies in memory: [M, K], boxes of 128 rows x 32 values of k; or
    # its transpose [K, M], boxes of 32 rows of k x 32 values of m.
    # (Row strides from the shapes: a contiguous tensor of one row may have
    # any stride(0).)
    map_a = _encode_tensor_map(a.data_ptr(), (a.shape[1], a.shape[0]), (a.shape[1],), torch.float32,
                               (32, 128 if a_kmajor else 32))
    planes = _split_image(b, n, k, b_kmajor, passes) if tile.split_b else None
    # B as it lies, raw tiles of 128 columns x 32 values of k: [N, K] in
    # swizzled boxes of 32 x 128, or [K, N] in unswizzled ones of 128 x 32.
    map_b = (map_a if tile.split_b else
             _encode_tensor_map(b.data_ptr(), (b.shape[1], b.shape[0]), (b.shape[1],), torch.float32,
                                (32, 128) if b_kmajor else (128, 32), swizzle=b_kmajor))
    tiles = cdiv(m, tile.bm) * cdiv(n, tile.bn)
    _bridge.launch(fn, (min(tiles, sm_count(dev)), 1, 1), tile.threads, (
        map_a, map_b, _ptr_or_null(planes), out.data_ptr(), _ptr_or_null(bias), activation, m, n, k, n,
        a.data_ptr(), a.shape[1], b.data_ptr(), b.shape[1]), dev,
        shared_mem=tile.shared_bytes(a_kmajor, b_kmajor, passes))


# ---------------------------------------------------------------- 16-bit engine (Hopper)
#
# The float16 / bfloat16 forward product x W^T on our own persistent,
# warp-specialised wgmma kernel (kernels_cu/gemm.cuh: TMA loads into a ring
# of 128-byte swizzled stages, 128 x 128 tiles taken in turns by two
# consumer warpgroups, TMA stores), with the bias and ReLU in its store
# (kernels_cu/gemm.cu).  No model routes its plain products here (cuBLAS is
# as fast at their shapes: docs/gemm.md); ops.linear_gn_chain runs the same
# engine with the GroupNorm chain as its store.

HALF_TILE = (128, 128)   # rows x columns of C per tile
HALF_BOX_K = 64          # k-values per tile (one 128-byte swizzle row)
HALF_THREADS = 384
# Pipeline stages (32 KiB each) beside the TMA store's staging (a tile per
# consumer warpgroup, 64 KiB).
HALF_STAGES = 4


# A 16-bit tile of C per consumer warpgroup: the TMA store's staging area
# (kHgStagingBytes in kernels_cu/gemm.cuh).
HALF_STAGING_BYTES = 2 * HALF_TILE[0] * HALF_TILE[1] * 2


def _half_shared_bytes(staging_bytes: int, stages: int = HALF_STAGES,
                       stage_bytes: int = (HALF_TILE[0] + HALF_TILE[1]) * HALF_BOX_K * 2,
                       extra_bytes: int = 0, extra_barriers: int = 0) -> int:
    """Dynamic shared memory of a kernel on the engine with ``stages``
    stages of ``stage_bytes``, ``staging_bytes`` of store staging, and a
    loader's own ``extra_bytes`` and ``extra_barriers`` mbarriers:
    half_gemm_shared_bytes<stages, staging, stage bytes, extra bytes, extra
    barriers>() (kernels_cu/gemm.cuh; 1024 bytes of alignment slack, the
    stages, the staging, the loader's bytes, the stages' and the turns'
    mbarriers, the loader's)."""
    return (1024 + stages * stage_bytes + staging_bytes + extra_bytes + 2 * stages * 8 + 16
            + 8 * extra_barriers)


# Each tile's dynamic shared memory at its largest (any layout, 1 or 3
# passes): what :func:`_tile_fits` sets against the device's limit.
TILE_SHARED_BYTES = {name: max(tile.shared_bytes(a_k, b_k, passes) for a_k, b_k in LAYOUTS.values()
                               for passes in (1, 3))
                     for name, tile in TILES.items()}


# Keyed by (dtype, C stored through TMA).
HALF_KERNELS = _runtime.KernelFamily("gemm.cu", {
    (dtype, tma): f"cf::gemm_wgmma<{cxx_type(dtype)}, {HALF_STAGES}, {_cxx_bool(tma)}>"
    for dtype in HALF_DTYPES for tma in (True, False)
})

# CUtensorMapDataType of each dtype; the driver's enums for no interleave,
# no swizzle and 128-byte swizzle, 256-byte L2 promotion and zero fill.
_TMA_DTYPE = {torch.float16: 6, torch.bfloat16: 9, torch.float32: 7}
_TMA_SWIZZLE_NONE, _TMA_SWIZZLE_128B, _TMA_L2_256B = 0, 3, 3


@functools.lru_cache(maxsize=1)
def _encode_tiled():
    """The driver's ``cuTensorMapEncodeTiled`` (CUDA 12+ drivers), through
    ctypes: CuPy does not wrap it."""
    lib = ctypes.CDLL("nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1")
    fn = lib.cuTensorMapEncodeTiled
    u64p, u32p = ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32)
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p,
                   u32p, u32p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


@functools.lru_cache(maxsize=256)
def _encode_tensor_map(ptr: int, dims: Tuple[int, ...], strides: Tuple[int, ...],
                       dtype: torch.dtype, box: Tuple[int, ...], swizzle: bool = True) -> bytes:
    """A 128-byte TMA descriptor of the float16 / bfloat16 / float32 tensor
    at ``ptr``: ``dims`` innermost first (unit stride), ``strides`` of the
    outer dims in elements, boxes of ``box`` elements (innermost first; 128
    bytes innermost: 128-byte swizzle rows; with ``swizzle`` False, rows of
    any multiple of 16 bytes, laid out as they are); loads read zeros
    outside the tensor, stores skip it."""
    # The descriptor depends only on these values, so equal arguments give an
    # equal, valid descriptor whatever tensor they came from.
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    rank, size = len(dims), dtype.itemsize
    storage = ctypes.create_string_buffer(128 + 64)  # CUtensorMap is 64-byte aligned
    at = -ctypes.addressof(storage) % 64
    status = _encode_tiled()(
        ctypes.addressof(storage) + at, _TMA_DTYPE[dtype], rank, ptr, (u64 * rank)(*dims),
        (u64 * (rank - 1))(*(size * st for st in strides)), (u32 * rank)(*box),
        (u32 * rank)(*([1] * rank)), 0, _TMA_SWIZZLE_128B if swizzle else _TMA_SWIZZLE_NONE, _TMA_L2_256B, 0)
    if status != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed with CUresult {status} for a "
                           f"{dtype} tensor of dims {dims} (innermost first), strides {strides}")
    return ctypes.string_at(ctypes.addressof(storage) + at, 128)


def _k_tile(dtype: torch.dtype) -> int:
    """The k-values of one of the Hopper engine's k-tiles of ``dtype``: a
    128-byte swizzle row (64 16-bit values, 32 float32 ones read as TF32;
    hg_bk in kernels_cu/gemm.cuh)."""
    return 128 // dtype.itemsize


def _tensor_map(t: torch.Tensor, box_rows: int) -> bytes:
    """The TMA descriptor (128 bytes, for a ``TensorMap`` kernel parameter)
    of the 2-D float16 / bfloat16 / float32 tensor ``t`` [rows, cols] with
    unit column stride: boxes of ``box_rows`` rows x 128 bytes (64 16-bit
    values, 32 float32 ones), 128-byte swizzle; loads read zeros outside
    the tensor, stores skip it.  ``t`` must satisfy :func:`_tma_compatible`."""
    return _encode_tensor_map(t.data_ptr(), (t.shape[1], t.shape[0]), (t.stride(0),), t.dtype,
                              (_k_tile(t.dtype), box_rows))


def _tma_compatible(t: torch.Tensor, address: bool = True) -> bool:
    """Whether the copy engine can read the 2-D ``t``: unit column stride, a
    row stride that is a multiple of 16 bytes, a 16-byte aligned start
    (unless ``address`` is False: while torch.compile traces, where no
    address is known) and fewer than 2^31 rows and columns (the
    coordinates are 32-bit)."""
    return (t.dim() == 2 and t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0
            and (not address or t.data_ptr() % 16 == 0) and t.shape[0] < 2**31 and t.shape[1] < 2**31)


def _engine_reads(x: torch.Tensor, weight: torch.Tensor, addresses: bool = True) -> bool:
    """Whether the Hopper engine can take ``x W^T`` whatever the dtypes: a
    compute capability 9.0 GPU (and the ``gemm_wgmma`` setting on), x and W
    that :func:`_tma_compatible` accepts (their ``addresses`` asked or
    not), and a non-empty product."""
    return (_tma_compatible(x, addresses) and _tma_compatible(weight, addresses)
            and x.shape[0] > 0 and weight.shape[0] > 0 and x.shape[1] > 0
            and has_wgmma(x.device.index))


def _uses_half_engine(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the float16 / bfloat16 product ``x W^T`` runs on the Hopper
    engine: x and W of one 16-bit dtype that :func:`_engine_reads` accepts.
    Elsewhere the product stays on cuBLAS (the named fallback)."""
    return x.dtype in HALF_DTYPES and weight.dtype == x.dtype and _engine_reads(x, weight)


def _half_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                activation: int = 0, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``act(x W^T + bias)`` on the Hopper engine, rounded once to x's dtype.

    Args:
        x: [M, K] float16 / bfloat16; weight: [N, K], same dtype (both
            accepted by :func:`_uses_half_engine`).
        bias: [N] of the same dtype, contiguous, or None.
        activation: 0 (none) or 1 (ReLU, NaN kept).
        out: the contiguous [M, N] result to write (e.g. NaN-poisoned),
            else a new one.

    Returns:
        [M, N] tensor of x's dtype.
    """
    if not _uses_half_engine(x, weight):
        raise ValueError("_half_linear needs a compute capability 9.0 GPU and float16 / bfloat16 "
                         "x [M, K] and weight [N, K] of one dtype whose rows the copy engine can "
                         "read (_tma_compatible)")
    return _launch_matmul(x, weight.t(), False, False, bias, activation, out)


# The other two products of a linear layer on the engine: dZ W (B N-major)
# and dZ^T x (A M-major too), read through tensor maps of the operands as
# they lie in memory (MN-major boxes of 64 x 64: TiledLoader in
# kernels_cu/gemm.cuh).  Measured against cuBLAS, not routed: the backward's
# products stay on cuBLAS (docs/gemm.md).  Keyed by (dtype, C stored
# through TMA, A M-major, B N-major), the MN-major combinations only.
LAYOUT_KERNELS = _runtime.KernelFamily("gemm.cu", {
    (dtype, tma, a_mn, b_mn): (f"cf::gemm_wgmma<{cxx_type(dtype)}, {HALF_STAGES}, {_cxx_bool(tma)}, "
                               f"{_cxx_bool(a_mn)}, {_cxx_bool(b_mn)}>")
    for dtype in HALF_DTYPES for tma in (True, False)
    for a_mn, b_mn in ((False, True), (True, False), (True, True))
})


def _operand_layout(t: torch.Tensor, mn_major_when_contiguous: bool) -> Optional[bool]:
    """Whether the 2-D ``t`` [rows, cols] is read MN-major (True) or K-major
    (False) by :func:`_half_matmul`, or None where the copy engine cannot
    read it: a contiguous ``t`` is MN-major for B ([K, N]) and K-major for
    A ([M, K]); a transposed view of a contiguous tensor the other way."""
    if t.dim() != 2 or t.data_ptr() % 16 or t.shape[0] >= 2**31 or t.shape[1] >= 2**31:
        return None
    if t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0:
        return mn_major_when_contiguous
    if t.stride(0) == 1 and (t.stride(1) * t.element_size()) % 16 == 0:
        return not mn_major_when_contiguous
    return None


def _operand_map(t: torch.Tensor, mn_major: bool) -> bytes:
    """The tensor map of an operand of :func:`_half_matmul` (see
    :func:`_operand_layout`): K-major, boxes of 128 rows x 64 values of k;
    MN-major, boxes of 64 rows of k x 64 values of m or n."""
    base = t if t.stride(1) == 1 else t.t()  # the layout in memory: [outer, inner]
    if mn_major:
        return _encode_tensor_map(base.data_ptr(), (base.shape[1], base.shape[0]),
                                  (base.stride(0),), t.dtype, (HALF_BOX_K, HALF_BOX_K))
    return _tensor_map(base, HALF_TILE[0])


def _half_matmul(a: torch.Tensor, b: torch.Tensor,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``a @ b`` on the Hopper engine, float16 / bfloat16 with float32
    accumulation, rounded once: the three products of a linear layer in the
    layouts they come in (x W^T: b = W.t(); dZ W: b = W; dZ^T x: a = dZ.t(),
    b = x).

    Args:
        a: [M, K], contiguous or the transpose of a contiguous tensor.
        b: [K, N] of a's dtype, contiguous or the transpose of a contiguous
            tensor.  Rows of 16-byte multiples, 16-byte aligned starts.
        out: the contiguous [M, N] result to write, else a new one.

    Returns:
        [M, N] tensor of a's dtype.
    """
    a_mn, b_mn = _operand_layout(a, False), _operand_layout(b, True)
    if (a.dtype not in HALF_DTYPES or b.dtype != a.dtype or a_mn is None or b_mn is None
            or a.shape[1] != b.shape[0] or 0 in a.shape
            or b.shape[1] == 0 or not has_wgmma(a.device.index)):
        raise ValueError("_half_matmul needs a compute capability 9.0 GPU and float16 / bfloat16 "
                         "a [M, K] and b [K, N] of one dtype, not empty, each contiguous or the "
                         "transpose of a contiguous tensor, with 16-byte rows and starts")
    return _launch_matmul(a, b, a_mn, b_mn, None, 0, out)


def _launch_matmul(a: torch.Tensor, b: torch.Tensor, a_mn: bool, b_mn: bool,
                   bias: Optional[torch.Tensor], activation: int,
                   out: Optional[torch.Tensor]) -> torch.Tensor:
    """The launch of :func:`_half_linear` and :func:`_half_matmul`, their
    operands checked: act(a @ b + bias) into ``out`` (or a new tensor)."""
    m, k = a.shape
    n = b.shape[1]
    if out is None:
        out = torch.empty((m, n), dtype=a.dtype, device=a.device)
    elif out.shape != (m, n) or out.dtype != a.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{m}, {n}] tensor of the operands' dtype")
    dev = a.device.index
    map_a, map_b = _operand_map(a, a_mn), _operand_map(b, b_mn)
    tma = _tma_compatible(out)
    map_c = _tensor_map(out, HALF_TILE[0]) if tma else map_a  # (unused without the TMA store)
    family, key = ((HALF_KERNELS, (a.dtype, tma)) if not (a_mn or b_mn)
                   else (LAYOUT_KERNELS, (a.dtype, tma, a_mn, b_mn)))
    tiles = cdiv(m, HALF_TILE[0]) * cdiv(n, HALF_TILE[1])
    _bridge.launch(family.get(key, dev), (min(tiles, sm_count(dev)), 1, 1), HALF_THREADS,
                   (map_a, map_b, map_c, out.data_ptr(), _ptr_or_null(bias), activation, m, n, k,
                    n), dev, shared_mem=_half_shared_bytes(HALF_STAGING_BYTES if tma else 0))
    return out


# ---------------------------------------------------------------- float32 weight (autocast)
#
# x W^T with x of a 16-bit dtype and W float32, W rounded to x's dtype in
# registers as the MMAs take it (F32ConvertMma in kernels_cu/gemm.cuh): a
# linear layer's product under autocast without the cast of its weight, a
# pass over the weight of its own (read 4 bytes, write 2 per value) before
# every forward.  The kernel computes z^T = W x^T in tiles of 128 rows of W
# x 256 of x (both consumer warpgroups on one tile) and writes z through a
# transposing store.  Its main loop is slower than cuBLAS's on the cast
# weight (docs/gemm.md), so it wins where the cast it saves is large
# against the product: a forward without autograd (inference) of few rows
# (:func:`_routes_float32_weight`).
# Training keeps the cast, which the backward reads again (docs/gemm.md).

CONVERT_TILE = (128, 256)  # rows of W x rows of x per tile (kCvBM, kCvBN)
CONVERT_STAGES = 3         # of 64 KiB, beside 32 KiB of staging
CONVERT_STAGE_BYTES = CONVERT_TILE[0] * 64 * 4 + CONVERT_TILE[1] * 64 * 2
# kCtStagingBytes: half of a warpgroup's 64 x 256 part of z, per warpgroup
CONVERT_STAGING_BYTES = 2 * (CONVERT_TILE[1] // 2) * (CONVERT_TILE[0] // 2) * 2
# Where the product runs here rather than as W's cast then cuBLAS: rows of
# x in the range where it wins, in at least half as many tiles as the GPU
# has SMs (docs/gemm.md, "A float32 weight rounded in the engine").
CONVERT_MIN_ROWS, CONVERT_MAX_ROWS = 512, 1024

CONVERT_KERNELS = _runtime.KernelFamily("gemm.cu", {
    dtype: f"cf::gemm_wgmma_f32_weight<{cxx_type(dtype)}, {CONVERT_STAGES}>"
    for dtype in HALF_DTYPES
})


def _uses_float32_weight_engine(x_d: torch.Tensor, weight: torch.Tensor, addresses: bool = True) -> bool:
    """Whether :func:`_linear_float32_weight` can take ``x_d W^T``: x_d
    float16 / bfloat16 and W float32 that :func:`_engine_reads` accepts
    (their ``addresses`` asked or not), of one inner size, and a number of
    W's rows whose 16-bit output rows the copy engine writes (a multiple of
    8).  Whether it should is the caller's rule
    (:func:`_routes_float32_weight`); elsewhere the caller casts W and runs
    cuBLAS (the named fallback)."""
    return (x_d.dtype in HALF_DTYPES and weight.dtype == torch.float32
            and _engine_reads(x_d, weight, addresses) and x_d.shape[1] == weight.shape[1]
            and weight.shape[0] % 8 == 0)


def _routes_float32_weight(x_d: torch.Tensor, weight: torch.Tensor) -> bool:
    """The route of an autocast forward without autograd: whether ``x_d
    W^T`` (x_d the input's cast, W float32) runs on
    :func:`_linear_float32_weight` (:data:`CONVERT_MIN_ROWS` to
    :data:`CONVERT_MAX_ROWS` rows, at least half as many tiles as the GPU
    has SMs, and
    :func:`_uses_float32_weight_engine`) rather than as W's cast then
    cuBLAS.  While torch.compile traces, the addresses are not asked (none
    is known): the traced op checks them when the graph runs.  While
    torch.export traces, the rule reads the example's sizes
    (:func:`on_example_sizes`: both routes compute the same values, at any
    size)."""
    m, n = x_d.shape[0], weight.shape[0]
    return on_example_sizes(lambda: bool(
        CONVERT_MIN_ROWS <= m <= CONVERT_MAX_ROWS
        and _uses_float32_weight_engine(x_d, weight, addresses=not is_compiling())
        and 2 * cdiv(n, CONVERT_TILE[0]) * cdiv(m, CONVERT_TILE[1]) >= sm_count(x_d.device.index)), x_d)


def _linear_float32_weight(x_d: torch.Tensor, weight: torch.Tensor,
                           bias_d: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x_d W^T + bias_d`` with W float32, rounded to x_d's dtype on the
    way into the tensor cores: what ``F.linear`` computes under autocast
    from ``W.to(x_d.dtype)``, without that cast.  No autograd.

    Args:
        x_d: [M, K] float16 / bfloat16; weight: [N, K] float32 (both
            accepted by :func:`_uses_float32_weight_engine`).
        bias_d: [N] of x_d's dtype, contiguous, or None.

    Returns:
        z [M, N] of x_d's dtype.
    """
    if not _uses_float32_weight_engine(x_d, weight):
        raise ValueError("_linear_float32_weight needs a compute capability 9.0 GPU, a float16 / "
                         "bfloat16 x [M, K] and a float32 weight [N, K] (N a multiple of 8) whose "
                         "rows the copy engine can read (_tma_compatible)")
    return _run_float32_weight(x_d, weight, bias_d)


def _run_float32_weight(x_d: torch.Tensor, weight: torch.Tensor,
                        bias_d: Optional[torch.Tensor]) -> torch.Tensor:
    """:func:`_linear_float32_weight` on operands already checked (by it,
    or by :func:`_routes_float32_weight` on the autocast route)."""
    m, k = x_d.shape
    n = weight.shape[0]
    z = torch.empty((m, n), dtype=x_d.dtype, device=x_d.device)
    dev = x_d.device.index
    tiles = cdiv(n, CONVERT_TILE[0]) * cdiv(m, CONVERT_TILE[1])
    _bridge.launch(CONVERT_KERNELS.get(x_d.dtype, dev), (min(tiles, sm_count(dev)), 1, 1),
                   HALF_THREADS, (_tensor_map(weight, CONVERT_TILE[0]),
                                  _tensor_map(x_d, CONVERT_TILE[1]), _tensor_map(z, 128),
                                  _ptr_or_null(bias_d), m, n, k), dev,
                   shared_mem=_half_shared_bytes(CONVERT_STAGING_BYTES, CONVERT_STAGES,
                                                 CONVERT_STAGE_BYTES))
    return z


# ---------------------------------------------------------------- autograd op

def _forward(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
             activation: int, passes: int) -> torch.Tensor:
    return _product(x, weight, "forward", passes, bias, activation)


def _forward_fake(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                  activation: int, passes: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


def _linear_backward(dout: torch.Tensor, x: Optional[torch.Tensor],
                     weight: Optional[torch.Tensor], passes: int, want_x: bool, want_weight: bool,
                     want_bias: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of ``x W^T + bias``, dout [M, N] of x's dtype.  x is read
    (and needed) only for dW, the weight only for dx (None where the node
    did not save it: :func:`.._autograd.product_operands`).  Returns (dx,
    dW, dbias); each is empty when not wanted."""
    dz = dout.contiguous()  # also materialises a broadcast gradient
    dbias = dz.sum(0) if want_bias else dz.new_empty((0,))
    dx = _product(dz, weight, "grad_input", passes) if want_x else dz.new_empty((0,))
    dw = _product(dz, x, "grad_weight", passes) if want_weight else dz.new_empty((0,))
    return dx, dw, dbias


def _backward_fake(dout: torch.Tensor, x: Optional[torch.Tensor], weight: Optional[torch.Tensor],
                   passes: int, want_x: bool, want_weight: bool,
                   want_bias: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # (Contiguous, as the products write them, whatever x's and the
    # weight's strides: inductor checks the real outputs' strides against
    # these.)
    m, n = dout.shape
    return (dout.new_empty((m, weight.shape[1]) if want_x else (0,)),
            dout.new_empty((n, x.shape[1]) if want_weight else (0,)),
            dout.new_empty((n,) if want_bias else (0,)))


def _setup_context(ctx, inputs, output):
    x, weight, bias, activation, passes = inputs
    ctx.save_for_backward(*product_operands(ctx, x, weight))
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


def uses_cublas(dtype: torch.dtype, precision: str, device_index: int) -> bool:
    """Whether a product runs on cuBLAS (see the module docstring): float16 /
    bfloat16, ``"ieee"``, or a GPU without TF32 tensor cores."""
    return (dtype != torch.float32 or precision == "ieee"
            or not has_tf32_tensor_cores(device_index))


# What :func:`route` returns for a product that runs on cuBLAS.
CUBLAS = 0


def route(dtype: torch.dtype, precision: str, device_index: int) -> int:
    """Where a linear layer's products of ``dtype`` operands at
    ``precision`` (resolved) run on this device: :data:`CUBLAS` where
    :func:`uses_cublas` says so, else the passes of our tensor-core kernels
    (3 for ``"3xtf32"``, 1 for ``"tf32"``).  An op decides this once per
    call and hands the result down."""
    return CUBLAS if uses_cublas(dtype, precision, device_index) else PASSES[precision]


