"""``conv_bias_relu``: ``relu(conv2d(x, weight) + conv_bias) + bias``, problem
1's forward (stride 1, no padding, dilation 1, one group).

Route, decided once per call (:func:`route`):

* ``"engine"``: an implicit GEMM on the Hopper engine
  (``kernels_cu/conv_bias_relu.cu``): the input's tiles gathered by the copy
  engine from x channels-last (an NCHW x is first copied so, by a
  transposing kernel of its own), the biases and ReLU applied to the float32
  accumulators, y written once in x's memory format.  On a compute
  capability 9.0 GPU with no gradient to record (eager, or traced by
  torch.compile as the custom op ``cupy_fused::conv_bias_relu_engine``),
  x in one of the layouts
  of :func:`engine_layout`, and the dtypes of :func:`engine_dtypes`: every
  tensor float16 or every tensor bfloat16, or under ``torch.autocast``
  (the product then in the autocast dtype, as the reference's; a
  channels-last x cast to it first), or every tensor float32 while
  ``torch.backends.cudnn.allow_tf32`` is on (PyTorch's default, under which
  the reference's convolution runs in TF32 too) and at least
  :data:`ENGINE_FLOAT32_MIN_ELEMENTS` output values: the operands rounded
  to TF32 (an NCHW x in its channels-last copy, a channels-last one in a
  copy of its own: ``round_to_tf32``), float32 accumulation and output.
  Of those, the shapes where the engine measured faster than cuDNN
  (:func:`_engine_pays`: not narrow images, nor few channels through
  tiles of many); a C_in that is not a multiple of 8 on x and the weight
  padded with zero channels (:func:`_padded_plan`: the same conditions,
  asked of the padded shape).
  A channels-last x in (or cast to) a 16-bit product's dtype, y in that
  dtype or in float32 (autocast), or a float32 one (its copy rounded to
  TF32, a TF32 product), with a kernel up to :data:`WINDOW_MAX_KW` wide
  takes the window kernel
  (``conv_bias_relu_window``: tiles of 64 output channels x 256 pixels,
  each stage a window of x for all the taps of a kernel row;
  :func:`_window_fits`).  An NCHW 16-bit x with no gradient to
  record, W a multiple of 8 and a kernel up to :data:`NCHW_WINDOW_MAX_KW`
  wide takes the same kernel's NCHW form, with no copy of x
  (``conv_bias_relu_nchw_window``: x's rows transposed into the windows in
  shared memory; :func:`_nchw_window_fits`), and with at most 64 input
  channels and 3 kernel rows its band form (``conv_bias_relu_nchw_band``:
  each block on consecutive pixel tiles down a strip of 128 output
  columns, each transposed row kept for every tile of output channels and
  the next pixel tile; :func:`_band_fits`),
  which under autocast also takes a float32 x (W a multiple of 4), rounded
  to the autocast dtype as its rows are transposed, and writes the float32
  y (:func:`_amp_band_fits`); a channels-last float32 x under autocast
  takes the band kernel's channels-last form (``conv_bias_relu_nhwc_band``:
  x's rows converted as they lie; :func:`_nhwc_band_fits`) in place of its
  cast and the window kernel, and a channels-last float32 x (TF32) its
  TF32 form (``conv_bias_relu_tf32_band``: x's rows rounded to TF32 in
  shared memory, once each; :func:`_tf32_band_fits`) in place of its
  rounded copy and the window kernel.
  With a gradient to record (at least
  :data:`ENGINE_TRAINING_MIN_ELEMENTS` output values;
  :func:`_trains_on_engine`), the same forward also writes
  relu's mask, and keeps an NCHW x's channels-last copy (a float32 one
  rounded to TF32, as the product read it), or a channels-last float32 x's
  cast under autocast; the backward is
  :func:`.bias_relu.bias_relu`'s (dz written channels-last), the input
  gradient on the engine where :func:`_dgrad_on_engine` takes it
  (``conv_dgrad_wgmma``: the window kernel's structure on dz and the
  flipped weight; 16-bit, or float32 with dz rounded to TF32 by that
  backward; a channels-last x's gradient written float32 under autocast),
  and the weight gradient, first, on x channels-last: on the engine where
  :func:`_wgrad_on_engine` takes it (``conv_wgrad_wgmma``: 16-bit, dz^T
  times x seen from each tap, the output pixels split into runs whose
  float32 sums ``conv_wgrad_reduce`` adds in a fixed order), else
  cuDNN's deterministic channels-last convolution backward (which also
  gives the input gradient elsewhere; as the ``"cudnn"`` route's backward
  runs on Hopper: :func:`_channels_last_backward`), the input gradient in
  x's layout.  The
  eager node keeps relu's mask for one use, freed once dz exists, and, for
  a leaf x that requires grad, x's copy or cast for one use, freed before
  dx is made.  Traced by torch.compile, the training forward and its
  backward are the custom ops ``cupy_fused::conv_bias_relu_engine_train``
  and ``cupy_fused::conv_bias_relu_engine_train_backward`` (the graph saves
  the mask and the copy).
* ``"cudnn"`` (the named fallback): ``torch.nn.functional.conv2d`` (cuDNN),
  then :func:`.bias_relu.bias_relu`: differentiable, every dtype and
  layout, autocast's promotions.  Smaller training steps take it,
  float32 ones with TF32 off, and those whose C_out is not a multiple of 32
  (channels-last x) or 8 (NCHW x), and every shape where it measured
  faster than the engine.  Its convolution is one autograd
  node of its own whose backward runs deterministic algorithms (cuDNN's,
  or the engine's for the input and weight gradients, as below) whatever
  ``torch.backends.cudnn.deterministic`` says, so that a training
  step is bitwise reproducible (with ``torch.backends.cudnn.benchmark`` on,
  the fastest weight-gradient algorithm at some shapes sums in a varying
  order).  On Hopper, a large NCHW backward runs channels-last
  (:func:`_channels_last_backward`): cuDNN's native layout there, reached
  through our transposing copies, with the input gradient on the engine
  where :func:`_dgrad_on_engine` takes it and the weight gradient where
  :func:`_wgrad_on_engine` does.  y is in x's memory format here too (a
  channels-last weight read as a contiguous copy where x is NCHW), and a
  channels-last x off the 16-byte grid is copied onto it in training
  (cuDNN's float32 backward fails on such an x).
"""
from __future__ import annotations

import contextlib
import math
import threading
from typing import Callable, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from .. import _bridge, _runtime
from .._amp import HALF_DTYPES, autocast_dtype, cast, float32_autocast, float32_casts, promoted
from .._autograd import (HAS_CUSTOM_OP, FusedOp, assume_constant_result, check_unchanged, graph_anchors,
                         inference_op, is_compiling, is_exporting, needs_grad, on_example_sizes,
                         refuse_jit, refuse_tangents, refuse_transforms, version_of)
from .._validation import FLOAT_DTYPES, check_like, check_tensor, check_vector, cxx_type
from . import gemm
from ._common import (BLOCK, _one_value_rows, _ptr_or_null, _spread, _vector_grads, call_with_cupy_arrays,
                      cdiv, sm_count)
from .bias_relu import _backward as _bias_relu_backward, _bias_relu

# The engine's layouts: x NCHW, copied to channels-last first, y NCHW; x and
# y channels-last (kNhwcOut in conv_bias_relu.cu).
NCHW, CHANNELS_LAST = "nchw", "channels_last"

# The bias table of each consumer warpgroup (kConvBiasBytes): 64 channel
# pairs of 4 float32.
_BIAS_BYTES = gemm.HALF_TILE[1] // 2 * 16
# The key of a float32 product's NCHW store in SHARED_BYTES.
NCHW_FLOAT32 = "nchw_float32"
# The stores' staging per consumer warpgroup: NCHW rows, a channel-major tile
# of 128 + 8 values a row (kConvNchwStagingBytes); channels-last, the TMA
# store's tile (kConvNhwcStagingBytes); a float32 product's NCHW rows
# (NchwStoreF32), 64 channels of 4 + 128 float32 values a row and their
# mask bits (kConvF32StagingBytes).  (A float32 channels-last tile,
# NhwcStoreF32, takes the 16-bit one's bytes in two passes.)
SHARED_BYTES = {
    NCHW: gemm._half_shared_bytes(2 * (gemm.HALF_TILE[1] * (gemm.HALF_TILE[0] + 8) * 2 + _BIAS_BYTES)),
    CHANNELS_LAST: gemm._half_shared_bytes(gemm.HALF_STAGING_BYTES + 2 * _BIAS_BYTES),
    NCHW_FLOAT32: gemm._half_shared_bytes(2 * (64 * (gemm.HALF_TILE[0] + 4) * 4 + _BIAS_BYTES
                                               + 64 * gemm.HALF_TILE[0] // 8)),
}

# The window kernels (conv_bias_relu_window, the channels-last forward, and
# conv_dgrad_wgmma, the input gradient): tiles of 64 output channels x 256
# pixels; a stage holds A's tiles of every tap kw (64 x 64 values each) and
# two windows of the input (WINDOW columns x 64 channels each), beside half
# of a warpgroup's tile per consumer warpgroup for the transposing store
# (kCtStagingBytes).  Kernel widths 1 to WINDOW_MAX_KW, each its own
# instantiation, with as many stages (at most 4) as shared memory holds.
WINDOW_TILE = (64, 256)
WINDOW = 136
WINDOW_MAX_KW = 7
_OPT_IN_SHARED_BYTES = 232448  # a block's dynamic shared memory on Hopper (gemm.cuh's static_assert)


def _window_stage_bytes(kw: int) -> int:
    return kw * WINDOW_TILE[0] * gemm.HALF_BOX_K * 2 + 2 * WINDOW * gemm.HALF_BOX_K * 2


def _window_stages(kw: int) -> int:
    return max(stages for stages in range(1, 5)
               if gemm._half_shared_bytes(gemm.CONVERT_STAGING_BYTES, stages, _window_stage_bytes(kw))
               <= _OPT_IN_SHARED_BYTES)


def _window_shared_bytes(kw: int) -> int:
    return gemm._half_shared_bytes(gemm.CONVERT_STAGING_BYTES, _window_stages(kw), _window_stage_bytes(kw))


# The NCHW window kernel (conv_bias_relu_nchw_window): the window kernels'
# tiles, stages and MMAs, from an NCHW 16-bit x with no copy of it: each
# window's input row comes as it lies, 64 channels x WINDOW columns
# (_RAW_BYTES, kConvRawBytes), into a ring of raw rows that the producer
# warpgroup's other warps transpose into the stage.  NCHW_WINDOW_STAGES
# stages and as many raw rows (2 to 4) as shared memory then holds, beside
# the NCHW store's staging (kWindowNchwStagingBytes): kernel widths 1 to
# NCHW_WINDOW_MAX_KW.
NCHW_WINDOW_STAGES = 2
_RAW_BYTES = 64 * WINDOW * 2
_NCHW_WINDOW_STAGING_BYTES = 2 * 18 * 1024


def _most_that_fit(shared_bytes: Callable[[int], int]) -> int:
    """The most of 2 to 4 (stages, or raw rows) whose ``shared_bytes`` fit a
    block's opt-in shared memory; 0 (no kernel) where 2 do not."""
    return max([count for count in range(2, 5) if shared_bytes(count) <= _OPT_IN_SHARED_BYTES], default=0)


def _nchw_window_shared_bytes(kw: int, raws: int) -> int:
    # (the loader's extras: the raw rows and their 2 raws mbarriers)
    return gemm._half_shared_bytes(_NCHW_WINDOW_STAGING_BYTES, NCHW_WINDOW_STAGES, _window_stage_bytes(kw),
                                   raws * _RAW_BYTES, 2 * raws)


def _nchw_window_raws(kw: int) -> int:
    """The raw rows in flight of the NCHW window kernel of width ``kw``: the
    most (up to 4) that fit; fewer than 2 (wider kernels) is no kernel."""
    return _most_that_fit(lambda raws: _nchw_window_shared_bytes(kw, raws))


NCHW_WINDOW_MAX_KW = max(kw for kw in range(1, WINDOW_MAX_KW + 1) if _nchw_window_raws(kw) >= 2)

# The NCHW band kernel (conv_bias_relu_nchw_band): the NCHW window kernel
# for x of at most 64 channels, each block on a band of consecutive pixel
# tiles with all their tiles of output channels in turn, the windows in a
# ring of BAND_WINDOWS of their own (so that a pixel tile's KH + 1 input
# rows, at most BAND_WINDOWS, are transposed once for all its tiles, and
# the next pixel tile keeps KH - 1 of them), stages of A alone (as many,
# 2 to 4, as shared memory holds), BAND_RAWS raw slots of a row of x's
# 16-bit dtype, or under autocast of half a row of float32 (rounded to the
# autocast dtype as they are transposed; y float32).  Its channels-last
# form (conv_bias_relu_nhwc_band) takes a channels-last float32 x under
# autocast the same way (its rows converted, not transposed), y written as
# the window kernel writes it (the staging of _launch_windows).
BAND_WINDOWS = 4
BAND_RAWS = 2


def _band_stage_bytes(kw: int) -> int:
    return kw * WINDOW_TILE[0] * gemm.HALF_BOX_K * 2


def _band_shared_bytes(kw: int, stages: int, staging: int = _NCHW_WINDOW_STAGING_BYTES) -> int:
    # (the loader's extras: raw slots and windows, an mbarrier pair a raw
    # slot and one a window; the store's staging: the NCHW one, or
    # channels-last gemm.CONVERT_STAGING_BYTES)
    return gemm._half_shared_bytes(staging, stages, _band_stage_bytes(kw),
                                   (BAND_RAWS + BAND_WINDOWS) * _RAW_BYTES, 2 * BAND_RAWS + BAND_WINDOWS)


def _band_stages(kw: int, staging: int = _NCHW_WINDOW_STAGING_BYTES) -> int:
    """The band kernel's stages at kernel width ``kw`` beside ``staging``
    bytes of the store's: the most (up to 4) that fit; fewer than 2 (wider
    kernels) is no kernel."""
    return _most_that_fit(lambda stages: _band_shared_bytes(kw, stages, staging))


BAND_MAX_KW = max(kw for kw in range(1, WINDOW_MAX_KW + 1) if _band_stages(kw) >= 2)

# The band kernel of a channels-last float32 x read as TF32
# (conv_bias_relu_tf32_band): the same bands, stages of A alone, and
# BAND_WINDOWS slots of an input row's two windows of 32 float32 channels,
# which the copy engine fills and the helpers round to TF32 in place (no
# raw slots, no rounded copy of x), beside the window kernels' float32
# staging in passes of 32 columns (half the window kernels'), so that three
# stages fit at KW 3: an empty and a full mbarrier a slot.
TF32_BAND_STAGING_BYTES = gemm.CONVERT_STAGING_BYTES // 2
TF32_BAND_STORE_COLUMNS = 32


def _tf32_band_shared_bytes(kw: int, stages: int) -> int:
    return gemm._half_shared_bytes(TF32_BAND_STAGING_BYTES, stages, _band_stage_bytes(kw),
                                   2 * BAND_WINDOWS * _RAW_BYTES, 2 * BAND_WINDOWS)


def _tf32_band_stages(kw: int) -> int:
    """The TF32 band kernel's stages at kernel width ``kw``: the most (up to
    4) that fit; fewer than 2 (wider kernels) is no kernel."""
    return _most_that_fit(lambda stages: _tf32_band_shared_bytes(kw, stages))


TF32_BAND_MAX_KW = max(kw for kw in range(1, WINDOW_MAX_KW + 1) if _tf32_band_stages(kw) >= 2)


def _window_tiles(n: int, cout: int, oh: int, ow: int) -> int:
    """A window kernel's tiles for an output [n, cout, oh, ow]."""
    return cdiv(cout, WINDOW_TILE[0]) * _pixel_tiles(n, oh, ow)


def _pixel_tiles(n: int, oh: int, ow: int) -> int:
    """The window and band kernels' pixel tiles (two output rows of 128
    columns) of an output of n images of oh x ow."""
    return n * cdiv(oh, 2) * cdiv(ow, 128)


def _window_fits(n: int, cin: int, h: int, w: int, cout: int, kh: int, kw: int,
                 box_k: int = gemm.HALF_BOX_K) -> bool:
    """Whether a window kernel takes a convolution's sizes (its input [n,
    cin, h, w] channels-last, its output's cout channels, a kh x kw kernel;
    the output at most (h + kh) x (w + kw), as a padded one is; a stage's
    box_k channels: 64 16-bit, 32 float32): channels multiples of 8 (rows of
    whole 16 bytes for the copy engine), kw at most :data:`WINDOW_MAX_KW`,
    every coordinate within 32 bits, and the tiles times their stages too
    (the NCHW windows' helper warps count a block's stages in an int)."""
    return (cin % 8 == 0 and cout % 8 == 0 and kw <= WINDOW_MAX_KW
            and _window_bounds(n, cin, h + kh, w + kw, cout, kh, kw, box_k))


def _window_bounds(n: int, cin: int, oh: int, ow: int, cout: int, kh: int, kw: int,
                   box_k: int = gemm.HALF_BOX_K) -> bool:
    """A window kernel's 32-bit bounds, for n images of cin input channels
    and outputs of at most oh x ow pixels and cout channels, a kh x kw
    kernel (kw >= 1), box_k channels a stage: the coordinates, A's k-tile
    index (stages * kw of box_k values) and the tiles times their stages."""
    stages = kh * cdiv(cin, box_k)
    return (kw >= 1 and _window_tiles(n, cout, oh, ow) * stages < 2**31
            and max(n, oh, ow, cin, cout) < 2**31 and stages * kw < 2**31 // box_k)


# The weight gradient on the engine (conv_wgrad_wgmma, then
# conv_wgrad_reduce): kernels up to WGRAD_MAX_KW wide (a tensor map
# parameter per tap); each output tile of 128 x 64 tb (tb blocks of 64
# input channels of a tap, 1 to 4: WgradMma) sums runs of at least
# WGRAD_MIN_RUN k-tiles (64 output columns of one row each), with as many
# stages (at most 6) as shared memory holds.
WGRAD_MAX_KW = 7
WGRAD_MIN_RUN = 16
# Where it runs in place of cuDNN's (_wgrad_pays), by benchmarks/gemm.py
# --conv-wgrad on the H200 (docs/gemm.md; bfloat16): 64 output channels
# took 1.8x cuDNN's time (tiles half empty), output rows 7, 14 or 98
# columns wide 13.6x, 3.7x and 1.3x (64-column k-tiles a ninth to three
# quarters full).
WGRAD_COUT_MULTIPLE = 128
WGRAD_MIN_ROW_SHARE = 0.85


def _wgrad_stage_bytes(tb: int) -> int:
    return (2 + tb) * 64 * gemm.HALF_BOX_K * 2


def _wgrad_stages(tb: int) -> int:
    return max(stages for stages in range(1, 7)
               if gemm._half_shared_bytes(0, stages, _wgrad_stage_bytes(tb)) <= _OPT_IN_SHARED_BYTES)


# Keyed by ("conv", product dtype, layout, y's dtype, mask): the convolution
# and its chain (y float32 from a float32 product, NCHW, or under autocast;
# with the mask of relu for a training step's backward);
# ("to_nhwc", x's dtype, copy's dtype): an NCHW tensor's channels-last copy
# (the engine's x; the training route's dz and x, float32 too);
# ("to_nhwc_tf32", float32): the same rounded to TF32 (the engine's float32
# x); ("round_tf32",): a channels-last float32 x's copy rounded to TF32
# (:func:`_rounded_tf32`); ("to_nchw", dtype): a channels-last tensor's
# NCHW copy (the training route's input gradient); ("dgrad", dtype, KW):
# the input gradient of the convolution, channels-last
# (:func:`_launch_dgrad`), and with a last element float32 a float32 dx
# (under autocast; dtype float32: dz rounded to TF32, a TF32 product);
# ("window", dtype, KW, mask): the channels-last
# 16-bit forward (:func:`_launch_window`), and with a last element float32
# its float32 y (under autocast; dtype float32: x rounded to TF32);
# ("nchw_window", dtype, KW): the NCHW 16-bit forward with no copy of x
# (:func:`_launch_nchw_window`), and ("nchw_band", dtype, KW) its band
# form, with a last element float32 from a float32 x to a float32 y (under
# autocast); ("nhwc_band", dtype, KW): the channels-last band kernel (a
# float32 x and y under autocast: :func:`_launch_nhwc_band`);
# ("tf32_band", KW, mask): the channels-last float32 forward on a float32 x
# read as TF32, with relu's mask where ``mask`` (:func:`_launch_tf32_band`);
# ("wgrad", dtype, tb) and
# ("wgrad_reduce", dtype): the 16-bit weight gradient, tiles of tb blocks
# of 64 columns (:func:`_launch_wgrad`).  A key
# with a last element "vec": the same copy in vectors (16-bit copies that
# :func:`_vector_transposes` accepts).
KERNELS = _runtime.KernelFamily("conv_bias_relu.cu", {
    **{("conv", d, layout, out, mask): f"cf::conv_bias_relu_wgmma<{cxx_type(d)}, {gemm.HALF_STAGES}, "
                                       f"{'true' if layout == CHANNELS_LAST else 'false'}, {cxx_type(out)}, "
                                       f"{'true' if mask else 'false'}>"
       for d in HALF_DTYPES
       for layout in (NCHW, CHANNELS_LAST) for out in (d, torch.float32) for mask in (False, True)},
    **{("conv", torch.float32, layout, torch.float32, mask):
       f"cf::conv_bias_relu_wgmma<float, {gemm.HALF_STAGES}, "
       f"{'true' if layout == CHANNELS_LAST else 'false'}, float, {'true' if mask else 'false'}>"
       for layout in (NCHW, CHANNELS_LAST) for mask in (False, True)},
    ("to_nhwc_tf32", torch.float32): "cf::nchw_to_nhwc<float, float, true>",
    ("round_tf32",): "cf::round_to_tf32",
    **{("to_nhwc", src, d): f"cf::nchw_to_nhwc<{cxx_type(src)}, {cxx_type(d)}>"
       for d in FLOAT_DTYPES for src in dict.fromkeys((d, torch.float32))},
    **{("to_nhwc", src, d, "vec"): f"cf::nchw_to_nhwc<{cxx_type(src)}, {cxx_type(d)}, false, true>"
       for d in HALF_DTYPES for src in (d, torch.float32)},
    **{("dgrad", d, kw): f"cf::conv_dgrad_wgmma<{cxx_type(d)}, {kw}, {_window_stages(kw)}>"
       for d in HALF_DTYPES for kw in range(1, WINDOW_MAX_KW + 1)},
    **{("dgrad", d, kw, torch.float32):
       f"cf::conv_dgrad_wgmma<{cxx_type(d)}, {kw}, {_window_stages(kw)}, float>"
       for d in (*HALF_DTYPES, torch.float32) for kw in range(1, WINDOW_MAX_KW + 1)},
    **{("window", d, kw, mask): f"cf::conv_bias_relu_window<{cxx_type(d)}, {kw}, {_window_stages(kw)}, "
                                f"{'true' if mask else 'false'}>"
       for d in HALF_DTYPES for kw in range(1, WINDOW_MAX_KW + 1) for mask in (False, True)},
    **{("window", d, kw, mask, torch.float32):
       f"cf::conv_bias_relu_window<{cxx_type(d)}, {kw}, {_window_stages(kw)}, {'true' if mask else 'false'}, "
       f"float>"
       for d in (*HALF_DTYPES, torch.float32) for kw in range(1, WINDOW_MAX_KW + 1)
       for mask in (False, True)},
    **{("nchw_window", d, kw): f"cf::conv_bias_relu_nchw_window<{cxx_type(d)}, {kw}, {NCHW_WINDOW_STAGES}, "
                               f"{_nchw_window_raws(kw)}>"
       for d in HALF_DTYPES for kw in range(1, NCHW_WINDOW_MAX_KW + 1)},
    **{("nchw_band", d, kw): f"cf::conv_bias_relu_nchw_band<{cxx_type(d)}, {kw}, {_band_stages(kw)}, "
                             f"{BAND_RAWS}, {BAND_WINDOWS}>"
       for d in HALF_DTYPES for kw in range(1, BAND_MAX_KW + 1)},
    **{("nchw_band", d, kw, torch.float32):
       f"cf::conv_bias_relu_nchw_band<{cxx_type(d)}, {kw}, {_band_stages(kw)}, {BAND_RAWS}, "
       f"{BAND_WINDOWS}, float, float>"
       for d in HALF_DTYPES for kw in range(1, BAND_MAX_KW + 1)},
    **{("nhwc_band", d, kw): f"cf::conv_bias_relu_nhwc_band<{cxx_type(d)}, {kw}, "
                             f"{_band_stages(kw, gemm.CONVERT_STAGING_BYTES)}, {BAND_RAWS}, {BAND_WINDOWS}>"
       for d in HALF_DTYPES for kw in range(1, BAND_MAX_KW + 1)},
    **{("tf32_band", kw, mask): f"cf::conv_bias_relu_tf32_band<{kw}, {_tf32_band_stages(kw)}, "
                                f"{BAND_WINDOWS}, {'true' if mask else 'false'}>"
       for kw in range(1, TF32_BAND_MAX_KW + 1) for mask in (False, True)},
    **{("wgrad", d, tb): f"cf::conv_wgrad_wgmma<{cxx_type(d)}, {tb}, {_wgrad_stages(tb)}>"
       for d in HALF_DTYPES for tb in range(1, 5)},
    **{("wgrad_reduce", d): f"cf::conv_wgrad_reduce<{cxx_type(d)}>" for d in HALF_DTYPES},
    **{("to_nchw", d): f"cf::nhwc_to_nchw<{cxx_type(d)}>" for d in FLOAT_DTYPES},
    **{("to_nchw", d, "vec"): f"cf::nhwc_to_nchw<{cxx_type(d)}, true>" for d in HALF_DTYPES}})

ROUTES = ("engine", "cudnn")


def engine_layout(x: torch.Tensor, weight: torch.Tensor) -> Optional[str]:
    """How the engine reads x and writes y.

    Args:
        x: [N, C_in, H, W]; weight: [C_out, C_in, KH, KW].

    Returns:
        :data:`NCHW` for a contiguous x with C_in a multiple of 8 (the
        copy's channels-last rows, a multiple of 16 bytes for the copy
        engine); :data:`CHANNELS_LAST` for a channels-last x with C_in and
        C_out multiples of 8 and a 16-byte aligned start; None where the
        engine cannot read x (then the ``"cudnn"`` route).
    """
    if x.shape[1] % 8:
        return None
    return _layout(x, x.shape, weight.shape[0], padded=False)


def _layout(x: torch.Tensor, x_shape: Sequence[int], cout: int, padded: bool) -> Optional[str]:
    """:func:`engine_layout` of x read as ``x_shape`` (C_in a multiple of 8),
    with C_out output channels: x itself, or with ``padded`` its copy padded
    with zero channels (:func:`_padded_plan`: a new tensor, so 16-byte
    aligned)."""
    if x.is_contiguous():
        return NCHW if _transposes_shape(x_shape) else None
    if (x.is_contiguous(memory_format=torch.channels_last) and cout % 8 == 0
            and (padded or is_compiling() or x.data_ptr() % 16 == 0)):
        # (While tracing no address is known: the traced ops copy an x off
        # the grid when the graph runs, _on_the_grid.)
        return CHANNELS_LAST
    return None


def engine_dtypes(x: torch.Tensor, weight: torch.Tensor, conv_bias: torch.Tensor,
                  bias: Optional[torch.Tensor]) -> Optional[Tuple[torch.dtype, torch.dtype]]:
    """The engine's dtypes for these arguments.

    Args:
        x, weight, conv_bias, bias: :func:`conv_bias_relu`'s (bias may be
            None).

    Returns:
        (product dtype, y's dtype), or None where their dtypes keep the
        engine off.  Outside autocast: every tensor float16, or every
        tensor bfloat16 (both x's dtype), or every tensor float32 with TF32
        allowed to cuDNN (:func:`_cudnn_tf32`: a TF32 product, as the
        reference's).  Under ``torch.autocast`` to d, every tensor float32
        or d: the product in d, and y in d, or in float32 where a bias is
        float32 (torch's promotion, as :func:`.bias_relu.bias_relu`; the
        chain is then computed as ``nn.Conv2d`` with its bias computes it
        under autocast: ``relu(conv + conv_bias)`` rounded to d, then +
        bias in float32.  The ``"cudnn"`` route rounds the convolution
        before adding conv_bias).
    """
    vectors = (conv_bias.dtype,) if bias is None else (conv_bias.dtype, bias.dtype)
    amp = autocast_dtype()
    if amp is None:
        if x.dtype in HALF_DTYPES and weight.dtype == x.dtype and all(v == x.dtype for v in vectors):
            return x.dtype, x.dtype
        if (x.dtype == torch.float32 and weight.dtype == x.dtype
                and all(v == x.dtype for v in vectors) and _cudnn_tf32()):
            return x.dtype, x.dtype
        return None
    allowed = (torch.float32, amp)
    if (amp in HALF_DTYPES and x.dtype in allowed and weight.dtype in allowed
            and all(v in allowed for v in vectors)):
        return amp, (torch.float32 if torch.float32 in vectors else amp)
    return None


def route(x: torch.Tensor, weight: torch.Tensor, conv_bias: torch.Tensor,
          bias: Optional[torch.Tensor]) -> str:
    """Which route a call with these (validated) arguments takes:
    ``"engine"`` or ``"cudnn"`` (see the module's docstring).

    Args:
        x: [N, C_in, H, W]; weight: [C_out, C_in, KH, KW]; conv_bias,
            bias: C_out values each (bias may be None).

    Returns:
        A name in :data:`ROUTES`.
    """
    return "engine" if _engine_plan(x, weight, conv_bias, bias) else "cudnn"


# An engine call's (layout, product dtype, y's dtype, training: with the
# mask and x's copy kept for a backward).
_Plan = Tuple[str, torch.dtype, torch.dtype, bool]

# The engine's training forward takes calls of this many output values and
# more: the size from which the channels-last backward it leads to pays
# (CL_BACKWARD_MIN_ELEMENTS, below).
ENGINE_TRAINING_MIN_ELEMENTS = 2**24

# A float32 call (TF32 allowed) takes the engine from this many output
# values.  TF32 is the precision torch.backends.cudnn.allow_tf32 grants the
# reference, and cuDNN's kernel for it at the benchmark shape runs in TF32
# (its error against float64 the same as the engine's, from an NCHW or a
# channels-last x), but cuDNN runs some small NCHW convolutions (and some
# 1 x 1 ones) in full float32, whose error the engine's TF32 would not
# match: those, and every smaller call, keep cuDNN (the same threshold for
# a channels-last x).
ENGINE_FLOAT32_MIN_ELEMENTS = 2**24


def _nchw_rows_whole(x: torch.Tensor) -> bool:
    """Whether the copy engine can bring x [N, C, H, W]'s rows as they lie
    (the NCHW window and band kernels' raw rows): x contiguous, its rows
    whole 16-byte vectors (:func:`_rows_whole`) and x 16-byte aligned (the
    copy engine's strides and base)."""
    return x.is_contiguous() and _rows_whole(x.shape[3], x.dtype) and x.data_ptr() % 16 == 0


def _rows_whole(w: int, dtype: torch.dtype) -> bool:
    """Whether rows of ``w`` values of ``dtype`` are whole 16-byte vectors
    (W a multiple of 8 in 16 bits, of 4 in float32)."""
    return w * dtype.itemsize % 16 == 0


def _nchw_window_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the NCHW window kernel takes x [N, C_in, H, W] (16-bit,
    contiguous) and the weight [C_out, C_in, KH, KW]: x's rows as they lie
    (:func:`_nchw_rows_whole`), KW at most :data:`NCHW_WINDOW_MAX_KW`, and
    the bounds of :func:`_window_bounds` (the kernel takes any C_in and
    C_out: the copy engine reads x's channels as an outer dimension, zeros
    past C_in; :func:`engine_layout` sends it C_in multiples of 8 only)."""
    n, cin, h, w = x.shape
    cout, _, kh, kw = weight.shape
    return (x.dtype in HALF_DTYPES and _nchw_rows_whole(x) and kw <= NCHW_WINDOW_MAX_KW
            and _window_bounds(n, cin, h, w, cout, kh, kw))


def _amp_band_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the band kernel takes x [N, C_in, H, W] (float32, contiguous)
    under autocast, with the weight [C_out, C_in, KH, KW]: x's rows as they
    lie (:func:`_nchw_rows_whole`) and :func:`_nhwc_band_fits`'s sizes."""
    return _nchw_rows_whole(x) and _nhwc_band_fits(x, weight)


def _nhwc_band_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the channels-last band kernel takes x [N, C_in, H, W]
    (float32, channels-last as :func:`engine_layout` takes it) under
    autocast, with the weight [C_out, C_in, KH, KW]: :func:`_band_fits` and
    the bounds of :func:`_window_bounds`."""
    n, cin, h, w = x.shape
    cout, _, kh, kw = weight.shape
    return (x.dtype == torch.float32 and _band_fits(cin, cout, kh, kw)
            and _window_bounds(n, cin, h, w, cout, kh, kw))


def _tf32_band_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the TF32 band kernel takes x [N, C_in, H, W] (float32,
    channels-last as :func:`engine_layout` takes it) with the weight [C_out,
    C_in, KH, KW]: :func:`_band_fits`, KW at most :data:`TF32_BAND_MAX_KW`,
    and the bounds of :func:`_window_bounds` for stages of 32 channels."""
    n, cin, h, w = x.shape
    cout, _, kh, kw = weight.shape
    return (x.dtype == torch.float32 and kw <= TF32_BAND_MAX_KW and _band_fits(cin, cout, kh, kw)
            and _window_bounds(n, cin, h, w, cout, kh, kw, gemm._k_tile(torch.float32)))


def _band_fits(cin: int, cout: int, kh: int, kw: int) -> bool:
    """Whether the band kernel takes a convolution that a window kernel
    takes (C_in input channels, C_out output channels, a KH x KW kernel):
    one block of 64 input channels, a pixel tile's KH + 1 input rows in its
    :data:`BAND_WINDOWS` windows, and each window's barrier a count (an
    arrive by 4 warps of every tile of 64 output channels) an mbarrier
    holds (below 2^20)."""
    return (cin <= gemm.HALF_BOX_K and kh + 1 <= BAND_WINDOWS and kw <= BAND_MAX_KW
            and 4 * cdiv(cout, WINDOW_TILE[0]) < 2**20)


def _out_shape(x: torch.Tensor, weight: torch.Tensor) -> Tuple[int, int, int, int]:
    """y's shape (N, C_out, OH, OW) for x [N, C_in, H, W] and the weight
    [C_out, C_in, KH, KW] (stride 1, no padding)."""
    n, _, h, w = x.shape
    cout, _, kh, kw = weight.shape
    return n, cout, h - kh + 1, w - kw + 1


def _engine_bound_conditions(x_shape: Sequence, weight_shape: Sequence) -> Tuple:
    """:func:`_engine_bounds` as conditions, each to hold (on symbolic sizes,
    left unevaluated: no guard)."""
    n, cin, h, w = x_shape
    cout, _, kh, kw = weight_shape
    box_m, box_n = gemm.HALF_TILE
    return (n < 2**31, cin < 2**31, cout < 2**31, h < 2**31, w < 2**31,
            kh * kw * cdiv(cin, 64) * 64 < 2**31,
            n * h * cdiv(w, box_m) * cdiv(cout, box_n) * kh * kw * cdiv(cin, 32) < 2**32)


def _engine_bounds(x_shape: Sequence[int], weight_shape: Sequence[int]) -> bool:
    """Whether the engine's 32-bit counts hold for x [N, C_in, H, W] and the
    weight [C_out, C_in, KH, KW]: the copy engine's coordinates (C_out's
    too); K; and the k-tiles of all output tiles (tiles of 128 pixels of a
    row, n * oh * cdiv(ow, 128) rows of them, fewer than x's, by 128 output
    channels; k-tiles of at most 32 input channels, float32's), which a
    block counts in an unsigned 32-bit counter (a bound on the tiles' count
    too)."""
    return all(_engine_bound_conditions(x_shape, weight_shape))


def _size_limits(x_shape: Sequence, weight_shape: Sequence) -> Tuple:
    """The engine's limits on the sizes of a call (not rules on speed), as
    conditions each to hold (symbolic ones left unevaluated, no guard):
    :func:`_engine_bounds` on x's channels as the engine reads them
    (:func:`_padded_channels`) and the transposing copies' grid
    (:func:`_transposes_shape`) for x and y."""
    n, cin, h, w = x_shape
    cout, _, kh, kw = weight_shape
    c = _padded_channels(cin)  # (C_in itself where it is a multiple of 8)
    return (_engine_bound_conditions((n, c, h, w), (cout, c, kh, kw))
            + _transpose_conditions((n, c, h, w)) + _transpose_conditions((n, cout, h - kh + 1, w - kw + 1)))


def _limits_hold_over_the_range(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """While torch.export traces: whether :func:`_size_limits` hold at every
    size of the traced range (without a guard: where they cannot be shown
    to, the call keeps cuDNN, correct at any size)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return all(statically_known_true(c) for c in _size_limits(x.shape, weight.shape))


def _engine_plan(x: torch.Tensor, weight: torch.Tensor, conv_bias: torch.Tensor,
                 bias: Optional[torch.Tensor]) -> Optional[_Plan]:
    """How the engine runs a call (:func:`engine_layout`,
    :func:`engine_dtypes`), or None where the call takes the ``"cudnn"``
    route: the one decision behind :func:`route` and the launch.  While
    torch.compile traces (where this torch has custom ops), the plan an
    eager call would get, for the traced ops :data:`_ENGINE_INFERENCE` and
    :data:`_ENGINE_TRAIN`'s, with one difference: no address is known
    there, so a channels-last x is planned as if on the 16-byte grid (the
    ops copy one off it when the graph runs, :func:`_on_the_grid`).  Where
    C_in is not a multiple of 8, the plan of the call on channels padded
    with zeros (:func:`_padded_plan`: the caller pads).  While torch.export
    traces, the rules on speed read the example's sizes
    (:func:`on_example_sizes`); the engine is planned only where its limits
    on sizes hold over the whole traced range
    (:func:`_limits_hold_over_the_range`: a batch Dim with a max); an empty
    call's route is guarded as ever; and a float32 call keeps cuDNN:
    whether the reference may run in TF32 is the exported program's
    caller's setting, read when it runs."""
    if not (x.numel() > 0 and weight.shape[0] > 0):
        return None

    def plan() -> Optional[_Plan]:
        if not (_engine_bounds(x.shape, weight.shape) and (HAS_CUSTOM_OP or not is_compiling())
                and gemm.has_wgmma(x.device.index)):
            return None
        if x.shape[1] % 8:
            return _padded_plan(x, weight, conv_bias, bias)
        return _plan(x, weight, conv_bias, bias, x.shape, padded=False)

    planned = on_example_sizes(plan, x)
    if planned is not None and is_exporting() and not _limits_hold_over_the_range(x, weight):
        return None
    return planned


def _plan(x: torch.Tensor, weight: torch.Tensor, conv_bias: torch.Tensor, bias: Optional[torch.Tensor],
          x_shape: Sequence[int], padded: bool) -> Optional[_Plan]:
    """:func:`_engine_plan` of a call whose x the engine reads as
    ``x_shape`` (C_in a multiple of 8): x itself, or with ``padded`` its
    copy padded with zero channels."""
    cout, _, kh, kw = weight.shape
    training = needs_grad(x, weight, conv_bias, bias)
    if training and not _trains_on_engine(x, weight):
        return None
    layout, dtypes = _layout(x, x_shape, cout, padded), engine_dtypes(x, weight, conv_bias, bias)
    if layout is None or dtypes is None:
        return None
    if dtypes[0] == torch.float32 and (
            is_exporting() or math.prod(_out_shape(x, weight)) < ENGINE_FLOAT32_MIN_ELEMENTS):
        return None
    if not _engine_pays(x_shape, (cout, x_shape[1], kh, kw), layout, dtypes[0], training, x.dtype,
                        dtypes[1]):
        return None
    return (layout, *dtypes, training)


def _padded_channels(cin: int) -> int:
    """C_in rounded up to a multiple of 8: the channels the engine reads
    where C_in is not one (rows of whole 16 bytes for the copy engine)."""
    return cdiv(cin, 8) * 8


def _padded_plan(x: torch.Tensor, weight: torch.Tensor, conv_bias: torch.Tensor,
                 bias: Optional[torch.Tensor]) -> Optional[_Plan]:
    """The engine's plan for a call whose C_in is not a multiple of 8, run on
    x and the weight with zero channels appended up to
    :func:`_padded_channels` (:func:`_pad_input_channels`: new tensors, so
    16-byte aligned, in x's memory format), or None (the ``"cudnn"``
    route): the plan of the padded call, every condition and
    :func:`_engine_pays` asked of the padded shape (the pad's own pass is
    in the times the rule was drawn from: docs/performance.md, "Where the
    convolution engine pays").  In training the pad is an autograd op: the
    gradients of x and the weight are those of the padded tensors' first
    C_in channels."""
    n, cin, h, w = x.shape
    x_shape = (n, _padded_channels(cin), h, w)
    if not _engine_bounds(x_shape, (weight.shape[0], x_shape[1], *weight.shape[2:])):
        return None
    return _plan(x, weight, conv_bias, bias, x_shape, padded=True)


def _pad_input_channels(x: torch.Tensor, weight: torch.Tensor,
                        layout: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """x [N, C_in, H, W] and the weight [C_out, C_in, KH, KW] with zero
    channels appended up to :func:`_padded_channels` (C_in), x dense in
    ``layout`` (the plan's: an x of one channel is both, its padded copy
    one only): the product is the same, each padded channel adding 0 x 0."""
    pad = (0, 0, 0, 0, 0, _padded_channels(x.shape[1]) - x.shape[1])
    fmt = torch.channels_last if layout == CHANNELS_LAST else torch.contiguous_format
    return F.pad(x, pad).contiguous(memory_format=fmt), F.pad(weight, pad)


# ---------------------------------------------------------------- where the engine pays

# The engine's tiles of pixels: 128 output columns of one output row (the
# per-tap kernel's boxes; two rows of them for the window kernels).
PIXEL_TILE = gemm.HALF_TILE[0]


def _engine_pays(x_shape: Sequence[int], weight_shape: Sequence[int], layout: str, dtype: torch.dtype,
                 training: bool, x_dtype: Optional[torch.dtype] = None,
                 y_dtype: Optional[torch.dtype] = None) -> bool:
    """Whether the engine route measured faster than the ``"cudnn"`` route
    for a call of this shape (x [N, C_in, H, W] with C_in a multiple of 8,
    the weight [C_out, C_in, KH, KW]), in ``layout`` with the product in
    ``dtype``, with or without a gradient to record, x of ``x_dtype``
    (default ``dtype``; float32 with a 16-bit product under autocast), y of
    ``y_dtype`` (default: float32 under autocast, else ``dtype``).  The
    rules are the boundaries of the grid of ``benchmarks/conv_routes.py``
    (H200; docs/performance.md, "Where the convolution engine pays"): the
    engine loses where its tiles are mostly waste, or where cuDNN has a
    kernel close to the tensor cores' rate.  cuDNN, where

    * an output row fills under 3/4 of its tiles of :data:`PIXEL_TILE`
      columns (images narrower than about 100 pixels), or under 2/5 for
      the NCHW band kernel's calls (an NCHW x read in place, at most 64
      input and at least 128 output channels, 2 or 3 kernel rows), which
      cuDNN's NCHW kernels do not match;
    * a 1 x 1 kernel has fewer than 64 input and 128 output channels (one
      k-tile of 64 channels a tap, mostly zeros);
    * the per-tap kernel (an NCHW x not read in place: in float32, in
      training, past :data:`NCHW_WINDOW_MAX_KW`, with W not a multiple of 8
      in 16 bits, or under autocast outside the band kernel), whose tiles
      are 128 channels wide, has fewer than 128 output channels, but for a
      float32 training step (cuDNN's float32 gradients of those are slower
      still);
    * float32 meets more than 64 input channels with a 1 x 1 kernel, or
      with a channels-last x and a kernel of at most 3 x 3: x's rounded
      copy costs more than the product gains;
    * at least 256 input and output channels meet 9 to 25 taps, but under
      autocast (where cuDNN's route casts x first);
    * a 16-bit product on a channels-last x has 49 taps or more, fewer than
      64 input and 128 output channels;
    * a float16 or float32 product on a channels-last x, with no gradient
      to record, has at most 8 input and fewer than 128 output channels and
      more than one tap (cuDNN's float16 and float32 kernels there are
      fast; its bfloat16 ones are not);
    * a training step has a 1 x 1 kernel, or fewer than 128 output channels
      and at most 9 taps; under autocast, a 1 x 1 kernel with fewer than
      128 output channels.
    """
    _, cin, _, w = x_shape
    cout, _, kh, kw = weight_shape
    taps, ow = kh * kw, w - kw + 1
    span = cdiv(ow, PIXEL_TILE) * PIXEL_TILE
    x_dtype = x_dtype or dtype
    amp = x_dtype == torch.float32 and dtype != torch.float32
    # An NCHW x is read in place where its rows are whole 16-byte vectors
    # (_nchw_rows_whole): a 16-bit one by the window and band kernels, a
    # float32 one under autocast by the band kernel only, which writes a
    # float32 y; else through a channels-last copy, by the per-tap kernel.
    in_place = (layout == NCHW and not training and _rows_whole(w, x_dtype)
                and ((_band_fits(cin, cout, kh, kw) and y_dtype in (None, torch.float32)) if amp
                     else dtype != torch.float32))
    band = in_place and cin <= 64 and cout >= 128 and 1 < kh <= 3 and kw <= BAND_MAX_KW
    if (5 * ow < 2 * span) if band else (4 * ow < 3 * span):
        return False
    if taps == 1 and cin < 64 and cout < 128:
        return False
    per_tap = layout == NCHW and not (in_place and kw <= NCHW_WINDOW_MAX_KW)
    if per_tap and cout < 128 and not (training and dtype == torch.float32):
        return False
    small = kh <= 3 and kw <= 3
    if dtype == torch.float32 and cin > 64 and (taps == 1 or (layout == CHANNELS_LAST and small)):
        return False
    if cin >= 256 and cout >= 256 and 9 <= taps <= 25 and not amp:
        return False
    if dtype != torch.float32 and layout == CHANNELS_LAST and taps >= 49 and cin < 64 and cout < 128:
        return False
    if (dtype != torch.bfloat16 and layout == CHANNELS_LAST and not training and cin <= 8 and cout < 128
            and taps > 1):
        return False
    if training and amp:
        return not (taps == 1 and cout < 128)
    return not (training and (taps == 1 or (cout < 128 and taps <= 9)))


def _trains_on_engine(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a call with a gradient to record may take the engine's
    training forward (its layout and dtypes checked by the caller): at least
    :data:`ENGINE_TRAINING_MIN_ELEMENTS` output values, and an NCHW x with
    C_out a multiple of 8 and y within the transposing copies' grid (the
    backward's channels-last dz and cuDNN's channels-last backward), or a
    channels-last x with C_out a multiple of 32 (a tile row's mask bits are
    whole words)."""
    dz_shape = _out_shape(x, weight)
    if math.prod(dz_shape) < ENGINE_TRAINING_MIN_ELEMENTS:
        return False
    cout = dz_shape[1]
    if x.is_contiguous():
        return cout % 8 == 0 and _transposes_shape(dz_shape)
    return cout % 32 == 0


def _transposes(t: torch.Tensor) -> bool:
    """Whether the transposing copies take the 4-D tensor ``t`` (their
    grid's limits)."""
    return _transposes_shape(t.shape)


def _transpose_conditions(shape) -> Tuple:
    """:func:`_transposes_shape` as conditions, each to hold (on symbolic
    sizes, left unevaluated: no guard)."""
    n, c, h, w = shape
    return (n * h * cdiv(w, 64) < 2**31, cdiv(c, 64) <= 65535)


def _transposes_shape(shape) -> bool:
    """Whether the transposing copies' grid takes a tensor of ``shape``."""
    return all(_transpose_conditions(shape))


def _vector_transposes(t: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether the copy of ``t`` [N, C, H, W] into ``out`` takes the vector
    kernels (``transpose_tile_vec``): a 16-bit out (from a 16-bit t, or
    from float32 to channels-last), C and W multiples of 8 (whole 16-byte
    vectors along both layouts' rows), both tensors 16-byte aligned.
    Elsewhere the copy moves one value a lane."""
    c, w = t.shape[1], t.shape[3]
    return (out.dtype in HALF_DTYPES and c % 8 == 0 and w % 8 == 0
            and t.data_ptr() % 16 == 0 and out.data_ptr() % 16 == 0)


def _transposed(t: torch.Tensor, dtype: Optional[torch.dtype] = None, tf32: bool = False) -> torch.Tensor:
    """A copy of ``t`` [N, C, H, W] in the other memory format: channels-last
    (in ``dtype``, default t's; with ``tf32``, a float32 t's values rounded
    to TF32) from a contiguous t, contiguous from a channels-last one (t's
    dtype).  :func:`_transposes` t."""
    n, c, h, w = t.shape
    dev = t.device.index
    if t.is_contiguous():
        out = torch.empty((n, h, w, c), dtype=dtype or t.dtype, device=t.device).permute(0, 3, 1, 2)
        key = ("to_nhwc_tf32", t.dtype) if tf32 else ("to_nhwc", t.dtype, out.dtype)
    else:
        out = torch.empty((n, c, h, w), dtype=t.dtype, device=t.device)
        key = ("to_nchw", t.dtype)
    fn = KERNELS.get(key + ("vec",) if _vector_transposes(t, out) else key, dev)
    if t.numel():
        _bridge.launch(fn, (n * h * cdiv(w, 64), cdiv(c, 64), 1), BLOCK,
                       (t.data_ptr(), out.data_ptr(), c, h, w), dev)
    return out


def _cudnn_tf32() -> bool:
    """Whether cuDNN may run the reference's float32 convolution in TF32:
    cuDNN on and ``torch.backends.cudnn.allow_tf32`` (PyTorch's default),
    or, where a program set the newer
    ``torch.backends.cudnn.conv.fp32_precision`` apart from the RNNs'
    (reading allow_tf32 then raises), that set to ``"tf32"``."""
    if not torch.backends.cudnn.enabled:
        return False
    apart = _conv_fp32_precision_apart()
    if apart:
        return apart == "tf32"
    return bool(torch.backends.cudnn.allow_tf32)


@assume_constant_result
def _conv_fp32_precision_apart() -> str:
    """cuDNN convolutions' ``fp32_precision`` where it differs from the
    RNNs' (``"none"`` resolved through its parents, cuDNN's and torch's),
    else "" (or on a torch without it).  torch.compile cannot trace these
    attributes: it takes the value read when it traces, without a guard
    (a program that changes it after compiling recompiles by hand,
    ``torch._dynamo.reset()``); allow_tf32, read otherwise, is guarded."""
    cudnn = torch.backends.cudnn
    precision = getattr(getattr(cudnn, "conv", None), "fp32_precision", None)
    if precision is None or precision == getattr(getattr(cudnn, "rnn", None), "fp32_precision", None):
        return ""
    for parent in (cudnn, torch.backends):
        if precision != "none":
            break
        precision = getattr(parent, "fp32_precision", "none")
    return precision


# A NaN as the kernels' to_tf32_keep_nan writes it (0x7fffe000).
_TF32_NAN = 0x7FFFE000


def _tf32(t: torch.Tensor) -> torch.Tensor:
    """The float32 ``t`` rounded to TF32 (the low 13 bits of the mantissa
    zero), to nearest with ties away from zero, bit for bit as the kernels'
    to_tf32_keep_nan (``kernels_cu/cf_common.cuh``): every NaN becomes the
    one NaN 0x7fffe000 (a NaN whose payload lies in the low bits alone would
    otherwise reach the MMA as an infinity)."""
    bits = t.contiguous().view(torch.int32)
    rounded = (bits + 0x1000) & -0x2000
    return torch.where(torch.isnan(t), torch.full_like(bits, _TF32_NAN), rounded).view(torch.float32)


def _rounded_tf32(x: torch.Tensor) -> torch.Tensor:
    """A copy of the channels-last float32 ``x`` (16-byte aligned, C a
    multiple of 4) rounded to TF32 as :func:`_tf32` rounds (the kernel
    ``round_to_tf32``), channels-last: the engine's A operand."""
    out = torch.empty_like(x, memory_format=torch.channels_last)
    vecs = x.numel() // 4
    if vecs:
        per_block = BLOCK * 4  # (kRoundVecs vectors a thread)
        _bridge.launch(KERNELS.get(("round_tf32",), x.device.index), (cdiv(vecs, per_block), 1, 1), BLOCK,
                       (x.data_ptr(), out.data_ptr(), vecs), x.device.index)
    return out


def _packed_weight(weight: torch.Tensor, dtype: torch.dtype) -> Tuple[torch.Tensor, int]:
    """The weight [C_out, C_in, KH, KW] as the GEMM's B [C_out, KH * KW *
    Cpad] of ``dtype`` (float32 rounded to TF32): k in (kh, kw, c) order, c
    padded with zeros to Cpad, a multiple of :func:`.gemm._k_tile` (one k-tile per
    (kh, kw) and block of channels); and Cpad / k-tile, the kernels'
    ``c_blocks``."""
    weight = _tf32(weight) if dtype == torch.float32 else weight.to(dtype)
    cout, cin, kh, kw = weight.shape
    box_k = gemm._k_tile(dtype)
    cpad = cdiv(cin, box_k) * box_k
    packed = weight.permute(0, 2, 3, 1)
    packed = F.pad(packed, (0, cpad - cin)) if cpad != cin else packed.contiguous()
    packed = packed.reshape(cout, kh * kw * cpad)
    # A channels-last weight viewed at an odd offset is that view itself.
    return (packed if gemm._tma_compatible(packed) else packed.clone()), cpad // box_k


def _launch_engine(x: torch.Tensor, weight: torch.Tensor, conv_bias: torch.Tensor,
                   bias: Optional[torch.Tensor], out: Optional[torch.Tensor] = None,
                   plan: Optional[_Plan] = None, mask: Optional[torch.Tensor] = None,
                   xc: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The engine route on arguments :func:`route` sends there (a non-empty
    result).  ``out``: the result to write (e.g. NaN-poisoned), in x's
    memory format, else a new one; ``plan``: the call's
    :func:`_engine_plan`, if the caller has it; ``mask``: words, one bit
    per value of y in its memory order, that the store fills with relu's
    mask (:func:`_mask_words`: zeroed for an NCHW y; a channels-last y:
    C_out a multiple of 32); ``xc``: an
    NCHW x's channels-last copy in the product's dtype (a float32 one
    rounded to TF32), or a channels-last x's cast to it under autocast, if
    the caller has made it (a channels-last float32 x's rounded copy is
    made here, and freed after the launch)."""
    n, cin, h, w = x.shape
    cout, _, kh, kw = weight.shape
    oh, ow = _out_shape(x, weight)[2:]
    layout, dtype, out_dtype, _ = plan or _engine_plan(x, weight, conv_bias, bias)
    if mask is not None and layout == CHANNELS_LAST and cout % 32:
        # That store writes whole words of 32 channels into a mask it does
        # not zero (_mask_words): any other C_out would leave words unset.
        raise ValueError(f"relu's mask of a channels-last y needs C_out a multiple of 32, "
                         f"got {cout}")
    bias = _spread(bias, cout)
    fmt = torch.channels_last if layout == CHANNELS_LAST else torch.contiguous_format
    if out is None:
        out = torch.empty((n, cout, oh, ow), dtype=out_dtype, device=x.device, memory_format=fmt)
    elif (out.shape != (n, cout, oh, ow) or out.dtype != out_dtype or out.device != x.device
          or not out.is_contiguous(memory_format=fmt)
          or (layout == CHANNELS_LAST and out.data_ptr() % 16)):
        raise ValueError(f"out must be a [{n}, {cout}, {oh}, {ow}] tensor of {out_dtype} on x's "
                         f"device, contiguous in x's memory format (16-byte aligned if "
                         f"channels-last)")
    conv_bias = conv_bias.to(out_dtype)
    bias = None if bias is None else bias.to(out_dtype)
    dev = x.device.index
    box_k, box_m = gemm._k_tile(dtype), gemm.HALF_TILE[0]
    if (layout == NCHW and mask is None and xc is None
            and (x.dtype == dtype == out_dtype and _nchw_window_fits(x, weight)
                 or x.dtype == out_dtype == torch.float32 != dtype and _amp_band_fits(x, weight))):
        _launch_nchw_window(x, weight, conv_bias, bias, out, dtype)
        return out
    if (layout == CHANNELS_LAST and mask is None and xc is None
            and x.dtype == out_dtype == torch.float32 != dtype and _nhwc_band_fits(x, weight)):
        _launch_nhwc_band(x, weight, conv_bias, bias, out, dtype)
        return out
    if (layout == CHANNELS_LAST and xc is None and x.dtype == dtype == torch.float32
            and _tf32_band_fits(x, weight)):
        _launch_tf32_band(x, weight, conv_bias, bias, out, mask)
        return out
    # An NCHW x: its channels-last copy, in the product's dtype (float32
    # rounded to TF32); a channels-last one: rounded to TF32 (float32), or
    # its cast under autocast.
    if xc is None:
        if layout == NCHW:
            xc = _transposed(x, dtype, tf32=dtype == torch.float32)
        else:
            xc = _rounded_tf32(x) if dtype == torch.float32 else cast(x, dtype)
    if layout == CHANNELS_LAST and _window_fits(n, cin, h, w, cout, kh, kw, box_k):
        _launch_window(xc, weight, conv_bias, bias, out, mask)
        return out
    map_x = _nhwc_map(xc, box_m)
    # y channels-last as [N * OH, OW, C_out]: boxes of a k-tile's channels of
    # y's dtype (64 16-bit, 32 float32: autocast's) x 128 columns.
    map_y = (gemm._encode_tensor_map(out.data_ptr(), (cout, ow, n * oh), (cout, ow * cout), out_dtype,
                                     (gemm._k_tile(out_dtype), box_m, 1))
             if layout == CHANNELS_LAST else map_x)  # (unused by the NCHW stores)
    packed, c_blocks = _packed_weight(weight, dtype)
    tiles = n * oh * cdiv(ow, box_m) * cdiv(cout, gemm.HALF_TILE[1])
    _bridge.launch(KERNELS.get(("conv", dtype, layout, out_dtype, mask is not None), dev),
                   (min(tiles, sm_count(dev)), 1, 1), gemm.HALF_THREADS,
                   (map_x, gemm._tensor_map(packed, gemm.HALF_TILE[1]), map_y, out.data_ptr(),
                    _ptr_or_null(mask), conv_bias.data_ptr(), _ptr_or_null(bias), n, cout, oh, ow, kw,
                    c_blocks, kh * kw * c_blocks), dev,
                   shared_mem=SHARED_BYTES[NCHW_FLOAT32 if layout == NCHW and dtype == torch.float32
                                           else layout])
    # xc, packed and cast biases go back to the allocator here: it hands
    # their memory to later work of this stream only, which runs after the
    # launch.
    return out


def _nhwc_map(t: torch.Tensor, box_cols: int) -> bytes:
    """The tensor map of a channels-last t [N, C, H, W] of the engine's
    dtypes, dims (C, W, H, N): boxes of a k-tile's channels (64 16-bit
    values, 32 float32 ones) x ``box_cols`` columns of one row."""
    n, c, h, w = t.shape
    return gemm._encode_tensor_map(t.data_ptr(), (c, w, h, n), (c, w * c, h * w * c), t.dtype,
                                   (gemm._k_tile(t.dtype), box_cols, 1, 1))


def _launch_windows(key: tuple, inp: torch.Tensor, a: torch.Tensor, out: torch.Tensor,
                    scalars: tuple) -> None:
    # A window kernel, KERNELS[key] (key[2]: its KW): the input's windows of
    # WINDOW columns, A [out's channels, KH * KW * Cpad] (_packed_weight's
    # order), the output's boxes (a 16-bit out: 64 channels x 128 columns;
    # float32: 32 x 64, the 16 KiB of a warpgroup's staging); inp 16-bit or
    # float32 rounded to TF32, inp and out channels-last and 16-byte
    # aligned.  At most a block per SM (persistent).
    n, c, h, w = out.shape
    dev = inp.device.index
    _bridge.launch(KERNELS.get(key, dev), (min(_window_tiles(n, c, h, w), sm_count(dev)), 1, 1),
                   gemm.HALF_THREADS,
                   (_nhwc_map(inp, WINDOW), gemm._tensor_map(a, WINDOW_TILE[0]),
                    _nhwc_map(out, 64 if out.dtype == torch.float32 else 128), *scalars), dev,
                   shared_mem=_window_shared_bytes(key[2]))
    # (a goes back to the allocator after this: later work of this stream only.)


def _launch_window(x: torch.Tensor, weight: torch.Tensor, conv_bias: torch.Tensor,
                   bias: Optional[torch.Tensor], out: torch.Tensor, mask: Optional[torch.Tensor]) -> None:
    # The channels-last forward on the window kernel (conv_bias_relu_window),
    # for _launch_engine: x [N, C_in, H, W] channels-last, 16-bit or float32
    # rounded to TF32, the weight (cast, or rounded to TF32) of x's dtype,
    # out and the biases (cast) of x's dtype or of float32 (autocast), out
    # channels-last and 16-byte aligned, mask (C_out a multiple of 32) or
    # None; the sizes _window_fits takes.
    cout, _, kh, kw = weight.shape
    n, _, oh, ow = out.shape
    packed, c_blocks = _packed_weight(weight, x.dtype)
    key = ("window", x.dtype, kw, mask is not None) + ((torch.float32,) if out.dtype == torch.float32 else ())
    _launch_windows(key, x, packed, out,
                    (_ptr_or_null(mask), conv_bias.data_ptr(), _ptr_or_null(bias), n, cout, oh, ow, kh,
                     c_blocks))


def _launch_nchw_window(x: torch.Tensor, weight: torch.Tensor, conv_bias: torch.Tensor,
                        bias: Optional[torch.Tensor], out: torch.Tensor, dtype: torch.dtype) -> None:
    # The NCHW 16-bit forward with no copy of x (conv_bias_relu_nchw_band
    # where _band_fits, else conv_bias_relu_nchw_window), for
    # _launch_engine: x [N, C_in, H, W] as _nchw_window_fits takes it, the
    # biases (cast) of x's dtype, the product in x's dtype (``dtype``), out
    # NCHW; or under autocast x float32 as _amp_band_fits takes it, the
    # product in the autocast dtype, the biases and out float32 (the band
    # kernel).
    n, cin, h, w = x.shape
    cout, _, kh, kw = weight.shape
    oh, ow = out.shape[2:]
    packed, c_blocks = _packed_weight(weight, dtype)
    # x as dims (W, H, C, N): boxes of one row of WINDOW columns x 64 channels
    # (float32: 32, half a row).
    map_x = gemm._encode_tensor_map(x.data_ptr(), (w, h, cin, n), (w, h * w, cin * h * w), x.dtype,
                                    (WINDOW, 1, gemm.HALF_BOX_K * 2 // x.element_size(), 1), swizzle=False)
    dev = x.device.index
    if _band_fits(cin, cout, kh, kw):
        key = ("nchw_band", dtype, kw) + ((torch.float32,) if x.dtype == torch.float32 else ())
        _launch_band(key, map_x, packed, out.data_ptr(), conv_bias, bias, out.shape, kh)
        return
    raws = _nchw_window_raws(kw)
    _bridge.launch(KERNELS.get(("nchw_window", x.dtype, kw), dev),
                   (min(_window_tiles(n, cout, oh, ow), sm_count(dev)), 1, 1), gemm.HALF_THREADS,
                   (map_x, gemm._tensor_map(packed, WINDOW_TILE[0]), out.data_ptr(), conv_bias.data_ptr(),
                    _ptr_or_null(bias), n, cout, oh, ow, kh, c_blocks), dev,
                   shared_mem=_nchw_window_shared_bytes(kw, raws))
    # (packed goes back to the allocator after this: later work of this stream only.)


def _launch_nhwc_band(x: torch.Tensor, weight: torch.Tensor, conv_bias: torch.Tensor,
                      bias: Optional[torch.Tensor], out: torch.Tensor, dtype: torch.dtype) -> None:
    # The channels-last forward under autocast with no cast of x
    # (conv_bias_relu_nhwc_band), for _launch_engine: x [N, C_in, H, W]
    # float32 as _nhwc_band_fits takes it, the product in ``dtype``, the
    # biases and out float32, out channels-last and 16-byte aligned.
    n, cin, h, w = x.shape
    kh, kw = weight.shape[2:]
    packed, _ = _packed_weight(weight, dtype)
    # x as dims (C, W, H, N): boxes of 32 float32 channels (half a row) x WINDOW columns.
    map_x = gemm._encode_tensor_map(x.data_ptr(), (cin, w, h, n), (cin, w * cin, h * w * cin), x.dtype,
                                    (32, WINDOW, 1, 1), swizzle=False)
    _launch_band(("nhwc_band", dtype, kw), map_x, packed, _nhwc_map(out, 64), conv_bias, bias, out.shape, kh,
                 gemm.CONVERT_STAGING_BYTES)
    # (packed goes back to the allocator after this: later work of this stream only.)


def _launch_tf32_band(x: torch.Tensor, weight: torch.Tensor, conv_bias: torch.Tensor,
                      bias: Optional[torch.Tensor], out: torch.Tensor, mask: Optional[torch.Tensor]) -> None:
    # The channels-last float32 forward with no rounded copy of x
    # (conv_bias_relu_tf32_band), for _launch_engine: x [N, C_in, H, W]
    # float32 as _tf32_band_fits takes it, the biases float32, out
    # channels-last and 16-byte aligned, mask (C_out a multiple of 32) or None.
    cout, _, kh, kw = weight.shape
    n, _, oh, ow = out.shape
    packed, c_blocks = _packed_weight(weight, torch.float32)
    dev = x.device.index
    _bridge.launch(KERNELS.get(("tf32_band", kw, mask is not None), dev), _band_grid(out.shape, dev),
                   gemm.HALF_THREADS,
                   (_nhwc_map(x, WINDOW), gemm._tensor_map(packed, WINDOW_TILE[0]),
                    _nhwc_map(out, TF32_BAND_STORE_COLUMNS), _ptr_or_null(mask), conv_bias.data_ptr(),
                    _ptr_or_null(bias), n, cout, oh, ow, kh, c_blocks),
                   dev, shared_mem=_tf32_band_shared_bytes(kw, _tf32_band_stages(kw)))
    # (packed goes back to the allocator after this: later work of this stream only.)


def _band_grid(out_shape: Sequence[int], dev: int) -> Tuple[int, int, int]:
    # A band kernel's grid for an output [N, C_out, OH, OW]: a block per
    # pixel tile (two output rows of 128 columns) up to the SM count.
    n, _, oh, ow = out_shape
    return (min(_pixel_tiles(n, oh, ow), sm_count(dev)), 1, 1)


def _launch_band(key: tuple, map_x: bytes, packed: torch.Tensor, y, conv_bias: torch.Tensor,
                 bias: Optional[torch.Tensor], out_shape: Sequence[int], kh: int,
                 staging: int = _NCHW_WINDOW_STAGING_BYTES) -> None:
    # A band kernel, KERNELS[key] (key[2]: its KW), on x's map, the packed
    # weight, y (its pointer, or its tensor map) and the biases, for an
    # output [N, C_out, OH, OW] and KH kernel rows: a block per pixel tile
    # up to the SM count, its stages beside `staging` bytes of the store's.
    n, cout, oh, ow = out_shape
    dev, kw = conv_bias.device.index, key[2]
    _bridge.launch(KERNELS.get(key, dev), _band_grid(out_shape, dev), gemm.HALF_THREADS,
                   (map_x, gemm._tensor_map(packed, WINDOW_TILE[0]), y, conv_bias.data_ptr(),
                    _ptr_or_null(bias), n, cout, oh, ow, kh), dev,
                   shared_mem=_band_shared_bytes(kw, _band_stages(kw, staging), staging))


# ---------------------------------------------------------------- the input gradient

def _dgrad_on_engine(dz: torch.Tensor, weight: torch.Tensor, tf32_dz: bool = False) -> bool:
    """Whether :func:`_launch_dgrad` computes the input gradient for this dz
    [N, C_out, OH, OW] (the convolution's output gradient) and weight
    [C_out, C_in, KH, KW], in place of cuDNN: a compute capability 9.0 GPU;
    dz float16 / bfloat16, or float32 where the caller rounded it to TF32
    (``tf32_dz``) and TF32 is allowed to cuDNN (:func:`_cudnn_tf32`: the
    reference's input gradient a TF32 product too); dz channels-last,
    16-byte aligned, not empty; the sizes :func:`_window_fits` takes (dz as
    the input, dx's C_in channels as the output)."""
    n, cout, oh, ow = dz.shape
    cin, kh, kw = weight.shape[1:]
    return ((dz.dtype in HALF_DTYPES or (dz.dtype == torch.float32 and tf32_dz and _cudnn_tf32()))
            and dz.numel() > 0
            and dz.is_contiguous(memory_format=torch.channels_last) and dz.data_ptr() % 16 == 0
            and _window_fits(n, cout, oh, ow, cin, kh, kw, gemm._k_tile(dz.dtype))
            and gemm.has_wgmma(dz.device.index))


def _launch_dgrad(dz: torch.Tensor, weight: torch.Tensor, dx_dtype: Optional[torch.dtype] = None
                  ) -> torch.Tensor:
    """The input gradient of the convolution (stride 1, no padding) on the
    engine (``conv_dgrad_wgmma``: the convolution of dz with the weight's
    taps flipped and its channels swapped, padded by KH - 1 and KW - 1, one
    rounding of float32 sums to dz's dtype; deterministic).

    Args:
        dz: [N, C_out, OH, OW], float16 or bfloat16, or float32 rounded to
            TF32 (a TF32 product), channels-last, as :func:`_dgrad_on_engine`
            accepts.
        weight: [C_out, C_in, KH, KW], cast to dz's dtype (float32: rounded
            to TF32 here).
        dx_dtype: dz's dtype (None), or float32 (under autocast: the
            rounded sums as autocast's cast hands them to a float32 x).

    Returns:
        dx [N, C_in, OH + KH - 1, OW + KW - 1] of ``dx_dtype``, channels-last.
    """
    n, cout, oh, ow = dz.shape
    cin, kh, kw = weight.shape[1:]
    h, w = oh + kh - 1, ow + kw - 1
    dx_dtype = dx_dtype or dz.dtype
    if dx_dtype not in (dz.dtype, torch.float32):
        raise ValueError(f"dx_dtype must be dz's dtype or float32, got {dx_dtype}")
    dx = torch.empty((n, h, w, cin), dtype=dx_dtype, device=dz.device).permute(0, 3, 1, 2)
    # Wf [C_in, C_out, KH, KW], Wf[ci, co, kh, kw] = W[co, ci, KH-1-kh, KW-1-kw],
    # as the GEMM's A [C_in, KH * KW * Cpad] (_packed_weight's (kh, kw, co) order).
    packed, c_blocks = _packed_weight(weight.transpose(0, 1).flip(2, 3), dz.dtype)
    key = ("dgrad", dz.dtype, kw) + ((torch.float32,) if dx_dtype == torch.float32 else ())
    _launch_windows(key, dz, packed, dx, (n, cin, h, w, kh, c_blocks))
    return dx


def _wgrad_fits(dz: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`_launch_wgrad` can compute the weight gradient for
    this dz [N, C_out, OH, OW] and x [N, C_in, H, W] (stride 1, no padding,
    the weight [C_out, C_in, KH, KW]): a compute capability 9.0 GPU; dz and
    x of one 16-bit dtype, channels-last, 16-byte aligned, not empty;
    channels multiples of 8 (rows of whole 16 bytes, and each tap's view of
    x 16-byte aligned), KW at most :data:`WGRAD_MAX_KW`, coordinates and
    k-tile counts within 32 bits (a block's k-tiles, counted in 32 bits by
    the engine, at most every tile's k-tiles and one run more; with them
    the images the last run's tail steps past, fewer than N again)."""
    n, cout, oh, ow = dz.shape
    cin, h, w = x.shape[1:]
    kh, kw = weight.shape[2:]
    g = _wgrad_geometry(n, cin, oh, ow, cout, kh, kw)
    return (dz.dtype in HALF_DTYPES and x.dtype == dz.dtype and dz.numel() > 0 and x.numel() > 0
            and cin % 8 == 0 and cout % 8 == 0 and kw <= WGRAD_MAX_KW
            and (h, w) == (oh + kh - 1, ow + kw - 1)
            and all(t.is_contiguous(memory_format=torch.channels_last) and t.data_ptr() % 16 == 0
                    for t in (dz, x))
            and max(n, h, w, cin, cout) < 2**31 and (g.tiles_m * g.col_tiles + 1) * g.k_tiles < 2**31
            and gemm.has_wgmma(dz.device.index))


def _wgrad_pays(cout: int, ow: int) -> bool:
    """Whether the weight gradient of a convolution with ``cout`` output
    channels and output rows ``ow`` wide is one where ours measured no
    slower than cuDNN's deterministic one (H200, bf16 and fp16, ``python
    benchmarks/gemm.py --conv-wgrad``): C_out a multiple of
    :data:`WGRAD_COUT_MULTIPLE` (whole 128-channel tiles) and output rows
    filling at least :data:`WGRAD_MIN_ROW_SHARE` of their 64-column
    k-tiles."""
    return cout % WGRAD_COUT_MULTIPLE == 0 and ow >= WGRAD_MIN_ROW_SHARE * 64 * cdiv(ow, 64)


def _wgrad_on_engine(dz: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the weight gradient of dz and x (as :func:`_wgrad_fits`
    takes them) runs on the engine, in place of cuDNN: where the kernel
    fits (:func:`_wgrad_fits`) and pays (:func:`_wgrad_pays`)."""
    return _wgrad_pays(dz.shape[1], dz.shape[3]) and _wgrad_fits(dz, x, weight)


class _WgradGeometry(NamedTuple):
    """A weight gradient's tiling (:func:`_wgrad_geometry`)."""
    c_blocks: int   # blocks of 64 input channels
    cols: int       # (tap, block) columns of 64: KH KW c_blocks
    tb: int         # blocks a tile (_wgrad_blocks)
    col_tiles: int  # tiles across the columns
    tiles_m: int    # tiles of 128 output channels
    col_blocks: int  # 64-column k-tiles an output row
    k_tiles: int    # k-tiles in all: N OH col_blocks


def _wgrad_geometry(n: int, cin: int, oh: int, ow: int, cout: int, kh: int, kw: int) -> _WgradGeometry:
    """The tiling of the weight gradient of a convolution whose output is
    [n, cout, oh, ow] and input has cin channels, a kh x kw kernel, as
    :func:`_launch_wgrad` launches it and :func:`_wgrad_fits` bounds it."""
    box = gemm.HALF_BOX_K
    c_blocks = cdiv(cin, box)
    cols = kh * kw * c_blocks
    tb = _wgrad_blocks(cols)
    col_blocks = cdiv(ow, box)
    return _WgradGeometry(c_blocks, cols, tb, cdiv(cols, tb), cdiv(cout, 128), col_blocks,
                          n * oh * col_blocks)


def _wgrad_blocks(cols: int) -> int:
    """The blocks of 64 columns (input channels of a tap) of a weight
    gradient's output tile, 1 to 4, for ``cols`` such blocks in all: the
    fewest boxes a k-tile over all tiles (each tile's two of dz and its tb
    of x; a block past the last costs a box whose sums are dropped), then
    the fewest blocks past the last."""
    return min(range(1, 5), key=lambda tb: (cdiv(cols, tb) * (2 + tb), cdiv(cols, tb) * tb - cols))


def _wgrad_runs(out_tiles: int, k_tiles: int, sms: int) -> Tuple[int, int]:
    """(runs, k-tiles a run) of the weight gradient's k-tiles: enough runs
    that the output tiles' runs fill the SMs once (each run an engine tile),
    none shorter than WGRAD_MIN_RUN k-tiles where there are that many, and
    no empty run."""
    runs = max(1, min(sms // out_tiles, k_tiles // WGRAD_MIN_RUN))
    per_run = cdiv(k_tiles, runs)
    return cdiv(k_tiles, per_run), per_run


def _launch_wgrad(dz: torch.Tensor, x: torch.Tensor, kh: int, kw: int) -> torch.Tensor:
    """The weight gradient of the convolution (stride 1, no padding) on the
    engine (``conv_wgrad_wgmma``: for each tap, dz^T times x seen from that
    tap, the output pixels as k, in runs whose float32 sums
    ``conv_wgrad_reduce`` adds in a fixed order and rounds once to dz's
    dtype; deterministic).

    Args:
        dz: [N, C_out, OH, OW], float16 or bfloat16, channels-last, as
            :func:`_wgrad_fits` accepts.
        x: [N, C_in, OH + kh - 1, OW + kw - 1] of dz's dtype, channels-last.
        kh, kw: the kernel's height and width.

    Returns:
        dw [C_out, C_in, kh, kw] of dz's dtype, contiguous.
    """
    n, cout, oh, ow = dz.shape
    cin, h, w = x.shape[1:]
    dev, box = dz.device.index, gemm.HALF_BOX_K
    c_blocks, cols, tb, col_tiles, tiles_m, col_blocks, k_tiles = _wgrad_geometry(n, cin, oh, ow, cout,
                                                                                  kh, kw)
    sms = sm_count(dev)
    runs, per_run = _wgrad_runs(tiles_m * col_tiles, k_tiles, sms)
    mpad, npad = 128 * tiles_m, box * tb * col_tiles
    partials = torch.empty((runs * mpad, npad), dtype=torch.float32, device=dz.device)
    size = dz.element_size()
    map_dz = gemm._encode_tensor_map(dz.data_ptr(), (cout, ow, oh, n), (cout, ow * cout, oh * ow * cout),
                                     dz.dtype, (box, box, 1, 1))
    # x from column j on, OW columns wide: its boxes clip where dz's do.
    taps = [gemm._encode_tensor_map(x.data_ptr() + j * cin * size, (cin, ow, h, n),
                                    (cin, w * cin, h * w * cin), x.dtype, (box, box, 1, 1))
            for j in range(kw)]
    taps += [taps[0]] * (WGRAD_MAX_KW - kw)
    scalars = (cout, cols, kw, c_blocks, oh, col_blocks, runs, per_run)
    _bridge.launch(KERNELS.get(("wgrad", dz.dtype, tb), dev), (min(tiles_m * col_tiles * runs, sms), 1, 1),
                   gemm.HALF_THREADS, (map_dz, *taps, partials.data_ptr(), *scalars), dev,
                   shared_mem=gemm._half_shared_bytes(0, _wgrad_stages(tb), _wgrad_stage_bytes(tb)))
    dw = torch.empty((cout, cin, kh, kw), dtype=dz.dtype, device=dz.device)
    _bridge.launch(KERNELS.get(("wgrad_reduce", dz.dtype), dev), (cdiv(cout * npad, BLOCK), 1, 1), BLOCK,
                   (partials.data_ptr(), dw.data_ptr(), runs, mpad, npad, cout, cin, kh, kw, c_blocks), dev)
    # (partials go back to the allocator after this: later work of this stream only.)
    return dw


def _input_and_weight_grads(dz: torch.Tensor, weight: torch.Tensor, want_x: bool, want_weight: bool,
                            engine: bool, cudnn_x: Callable[[], torch.Tensor], tf32_dz: bool = False,
                            dx_dtype: Optional[torch.dtype] = None
                            ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(dx, dw) of the convolution (stride 1, no padding), None where not
    wanted: dx from :func:`_launch_dgrad` (of ``dx_dtype``, default dz's)
    where ``engine`` and :func:`_dgrad_on_engine` allow (``tf32_dz``: a
    float32 dz rounded to TF32), dw from :func:`_launch_wgrad` where
    ``engine`` and :func:`_wgrad_on_engine` allow, cuDNN's deterministic
    backward for any other dw and dx (of dz's dtype); dw and cuDNN's
    products on ``cudnn_x()`` (x, or what stands for it: called only when
    one of them runs, before our dx is made, and not held after); each in
    the layout its producer picks for dz and x."""
    ours = want_x and engine and _dgrad_on_engine(dz, weight, tf32_dz)
    dx = dw = None
    if want_weight or (want_x and not ours):
        # (first: what cudnn_x() returns is dropped before dx is allocated)
        x = cudnn_x()
        ours_w = want_weight and engine and _wgrad_on_engine(dz, x, weight)
        if ours_w:
            dw = _launch_wgrad(dz, x, *weight.shape[2:])
        if (want_weight and not ours_w) or (want_x and not ours):
            dx, dw_cudnn = _conv_backward(dz, x, weight, want_x and not ours, want_weight and not ours_w)
            dw = dw if ours_w else dw_cudnn
        del x
    if ours:
        dx = _launch_dgrad(dz, weight, dx_dtype)
    return dx, dw


# ---------------------------------------------------------------- the engine's training forward

def _train_forward(x: torch.Tensor, weight: torch.Tensor, conv_bias: torch.Tensor,
                   bias: Optional[torch.Tensor], dtype: torch.dtype,
                   out_dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # (y, relu's mask, x's channels-last copy in the product's dtype: an
    # NCHW x's, or a channels-last float32 x's cast under autocast; empty
    # for another channels-last x, which the backward reads itself)
    # (a fresh y: its first element on the 4-element grid the NCHW mask needs)
    nchw = x.is_contiguous()
    mask = _mask_words(x, weight, nchw=nchw)
    xc = _training_copy(x, dtype, nchw)
    plan = (NCHW if nchw else CHANNELS_LAST, dtype, out_dtype, True)
    y = _launch_engine(x if xc is not None else _on_the_grid(x), weight, conv_bias, bias, plan=plan,
                       mask=mask, xc=xc)
    return y, mask, x.new_empty((0,), dtype=dtype) if xc is None else xc


def _training_copy(x: torch.Tensor, dtype: torch.dtype, nchw: bool) -> Optional[torch.Tensor]:
    """The copy of x that the training forward reads and keeps for the
    backward, x channels-last in the product's ``dtype``: an NCHW x's
    (``nchw``; float32 rounded to TF32), a channels-last x's cast; None for
    a channels-last x already in ``dtype`` (read as it is)."""
    if nchw:
        return _transposed(x, dtype, tf32=dtype == torch.float32)
    return x.to(dtype) if x.dtype != dtype else None


def _mask_words(x: torch.Tensor, weight: torch.Tensor, nchw: bool) -> torch.Tensor:
    """int32 words for relu's mask, a bit per value of y: zeroed for an
    NCHW y (``nchw``), whose store ORs the words that rows of y share
    (``NchwStore``); not for a channels-last one, whose store writes every
    word whole (``NhwcStore``, C_out a multiple of 32)."""
    words = cdiv(math.prod(_out_shape(x, weight)), 32)
    make = torch.zeros if nchw else torch.empty
    return make((words,), dtype=torch.int32, device=x.device)


def _train_forward_fake(x: torch.Tensor, weight: torch.Tensor, conv_bias: torch.Tensor,
                        bias: Optional[torch.Tensor], dtype: torch.dtype,
                        out_dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, cin, h, w = x.shape
    shape = _out_shape(x, weight)
    mask = torch.empty((cdiv(math.prod(shape), 32),), dtype=torch.int32, device=x.device)
    if x.is_contiguous():
        return (torch.empty(shape, dtype=out_dtype, device=x.device), mask,
                torch.empty((n, h, w, cin), dtype=dtype, device=x.device).permute(0, 3, 1, 2))
    return (torch.empty(shape, dtype=out_dtype, device=x.device, memory_format=torch.channels_last),
            mask, torch.empty_like(x, dtype=dtype) if x.dtype != dtype else x.new_empty((0,), dtype=dtype))


def _train_setup_context(ctx, inputs, output):
    x, weight, conv_bias, bias, _, _ = inputs
    _, mask, xc = output
    # x channels-last in the product's dtype: its copy, or x itself; x
    # anchors a refused double backward where the copy (no history) is saved
    saved = xc if xc.numel() else x
    ctx.save_for_backward(saved, weight, mask)
    ctx.graph_anchors = graph_anchors((x, saved))
    _train_fields(ctx, x, weight, conv_bias, bias)


def _train_eager_setup_context(ctx, inputs, output):
    # Eager: relu's mask is kept for one use, not saved, so that the backward
    # drops it as soon as dz exists, before the products allocate (a
    # saved tensor lives until the backward returns: above the reference's
    # peak).  The biases, with their versions, recompute it for a second
    # backward through a retained graph (not saved tensors: the reference's
    # backward reads neither, so changing one in place before the first
    # backward is no error there).  x's channels-last copy (an NCHW x's, or
    # autocast's cast) is kept for one use too where x is a leaf that
    # requires grad (which autograd's AccumulateGrad node holds anyway, and
    # the node then keeps too): dropped once the weight gradient has
    # read it, before our input gradient allocates dx, and made again from x
    # for a second backward (x also anchors a refused double backward, as a
    # saved x would).  Elsewhere (an intermediate x, which the node would
    # otherwise keep alive beside its copy; an x with no gradient, for which
    # no dx is made) the copy is saved, as is x where there is no copy (x
    # itself the backward's operand); x then anchors a refused double
    # backward where the copy is saved (graph_anchors).
    x, weight, conv_bias, bias, dtype, out_dtype = inputs
    _, mask, xc = output
    ctx.kept_mask = mask
    saved = None  # (what the node saves of x)
    if xc.numel() and x.requires_grad and x.grad_fn is None:
        ctx.save_for_backward(weight)
        ctx.kept_xc, ctx.source_x, ctx.source_version = xc, x, version_of(x)
    else:
        saved = xc if xc.numel() else x
        ctx.save_for_backward(saved, weight)
    ctx.graph_anchors = graph_anchors((x, saved))
    ctx.biases = (conv_bias, bias)
    ctx.bias_versions = tuple(version_of(b) for b in ctx.biases)
    ctx.plan = (NCHW if x.is_contiguous() else CHANNELS_LAST, dtype, out_dtype, True)
    _train_fields(ctx, x, weight, conv_bias, bias)


def _train_fields(ctx, x, weight, conv_bias, bias):
    ctx.dtypes = (x.dtype, conv_bias.dtype, None if bias is None else bias.dtype)
    ctx.nchw = x.is_contiguous()  # y's layout, and so the mask's order
    # (bias_relu's rows of sums: conv_bias's gradient, then bias's)
    ctx.lengths = (conv_bias.shape[0], None if bias is None else bias.shape[0])
    ctx.whole = _one_value_rows((conv_bias, bias), (0, 1), weight.shape[0])


def _take_xc(ctx, saved: Tuple[torch.Tensor, ...]) -> torch.Tensor:
    """x channels-last in the product's dtype for the eager node's backward:
    the saved copy, or x itself (``saved``: the node's saved tensors, which
    its backward unpacks once, as torch.utils.checkpoint's non-reentrant
    mode allows); or the copy of a leaf x kept for one use
    (which the node then no longer holds), made again from x, as the
    forward made it, for a second backward through a retained graph
    (refused, as autograd refuses, if x changed in place since the
    forward; kept by :func:`_take_mask`, which makes it first, for the
    weight gradient's one use)."""
    if not hasattr(ctx, "source_x"):
        return saved[0]
    xc, ctx.kept_xc = ctx.kept_xc, None
    if xc is not None:
        return xc
    check_unchanged(ctx.source_x, ctx.source_version, "x of cupy_fused::conv_bias_relu_engine_train")
    return _training_copy(ctx.source_x, ctx.plan[1], ctx.nchw)  # (kept only where it is a copy)


def _take_mask(ctx, saved: Tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The mask kept by the eager setup, which the node then no longer
    holds; for a second backward through a retained graph, recomputed by
    the forward's kernel (the same bits; y is computed again and dropped),
    refused, as autograd refuses, if a bias changed in place since the
    forward."""
    mask, ctx.kept_mask = ctx.kept_mask, None
    if mask is not None:
        return mask
    xc = _take_xc(ctx, saved)
    weight = saved[-1]
    conv_bias, bias = ctx.biases
    for name, b, version in zip(("conv_bias", "bias"), ctx.biases, ctx.bias_versions):
        check_unchanged(b, version, f"{name} of cupy_fused::conv_bias_relu_engine_train")
    mask = _mask_words(xc, weight, ctx.nchw)
    _launch_engine(xc, weight, conv_bias, bias, plan=ctx.plan, mask=mask,
                   xc=xc if ctx.nchw else None)
    if hasattr(ctx, "source_x") and ctx.needs_input_grad[1]:
        ctx.kept_xc = xc  # (made again: for the weight gradient, next)
    return mask


def _train_backward_formula(ctx, grads, run_backward):
    x_dtype, cb_dtype, b_dtype = ctx.dtypes
    want = ctx.needs_input_grad
    flags = (b_dtype is not None, x_dtype, want[0], want[1], ctx.nchw, ctx.whole)
    if hasattr(ctx, "kept_mask"):  # eager (see _train_eager_setup_context)
        if not want[1] and hasattr(ctx, "source_x"):
            ctx.kept_xc = None  # no weight gradient reads a kept copy (_take_xc makes it where needed)
        saved = ctx.saved_tensors  # (unpacked once: see _take_xc)
        dx, dw, sums = _train_steps(grads[0], lambda: _take_xc(ctx, saved), ctx.plan[1], saved[-1],
                                    lambda: _take_mask(ctx, saved), *flags)
    else:
        xc, weight, mask = ctx.saved_tensors
        dx, dw, sums = run_backward(grads[0], xc, weight, mask, *flags)
    dcb, db = _vector_grads(sums, ctx.lengths, (0, 1))
    dcb = dcb.to(cb_dtype) if want[2] else None
    db = db.to(b_dtype) if db is not None and want[3] else None
    return (dx if want[0] else None, dw if want[1] else None, dcb, db, None, None)


def _train_backward(dy: torch.Tensor, xc: torch.Tensor, weight: torch.Tensor, mask: torch.Tensor,
                    second_bias: bool, x_dtype: torch.dtype, want_x: bool, want_weight: bool,
                    nchw: bool, whole: Sequence[int]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # (xc: x itself where the forward made no copy, which a traced graph may
    # hand over off the grid)
    return _train_steps(dy, lambda: _on_the_grid(xc), xc.dtype, weight, lambda: mask, second_bias,
                        x_dtype, want_x, want_weight, nchw, whole)


def _train_steps(dy: torch.Tensor, take_xc: Callable[[], torch.Tensor], dtype: torch.dtype,
                 weight: torch.Tensor, take_mask: Callable[[], torch.Tensor], second_bias: bool,
                 x_dtype: torch.dtype, want_x: bool, want_weight: bool, nchw: bool,
                 whole: Sequence[int]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # dz (channels-last, the product's dtype: float32 rounded to TF32 while
    # TF32 is allowed) and the biases' sums from bias_relu's backward (the
    # mask from take_mask(), in y's memory order: NCHW for an NCHW x,
    # channels-last for a channels-last one; the eager node's is held by
    # that call alone, so it is freed before the products), then the input
    # gradient on the engine (a channels-last one in x's dtype: float32
    # under autocast, with no cast after it) and the weight gradient (ours
    # where _wgrad_on_engine holds, else cuDNN's channels-last one, which
    # also gives the input gradient elsewhere) on take_xc()'s x
    # channels-last in the product's dtype ``dtype`` (an NCHW x's copy, a
    # cast, or x itself), first, so that the eager node's copy is freed
    # before dx is made.
    tf32 = dtype == torch.float32 and _cudnn_tf32()
    dz, sums = _bias_relu_backward(dy, take_mask(), list(dy.shape), not nchw, second_bias,
                                   dtype, nchw, whole, tf32_dz=tf32)
    dx, dw = _input_and_weight_grads(dz, weight.to(dtype), want_x, want_weight, True, take_xc,
                                     tf32_dz=tf32, dx_dtype=dtype if nchw else x_dtype)
    del dz
    if want_x:  # in x's layout
        if nchw:
            dx = _transposed(dx) if _strictly_channels_last(dx) else dx.contiguous()
        else:
            dx = dx.contiguous(memory_format=torch.channels_last)
        dx = dx.to(x_dtype)
    return (dx if want_x else dy.new_empty((0,), dtype=dtype),
            _strided_like(dw.to(weight.dtype), weight) if want_weight else weight.new_empty((0,)),
            sums)


def _train_backward_fake(dy: torch.Tensor, xc: torch.Tensor, weight: torch.Tensor, mask: torch.Tensor,
                         second_bias: bool, x_dtype: torch.dtype, want_x: bool, want_weight: bool,
                         nchw: bool, whole: Sequence[int]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, cin, h, w = xc.shape
    fmt = torch.contiguous_format if nchw else torch.channels_last
    return (torch.empty((n, cin, h, w), dtype=x_dtype, device=xc.device, memory_format=fmt)
            if want_x else xc.new_empty((0,)),
            torch.empty_like(weight) if want_weight else weight.new_empty((0,)),
            dy.new_empty((2 if second_bias else 1, dy.shape[1])))


# The engine's forward of a training step: y, and relu's mask and x's
# channels-last copy kept for the backward (outputs that carry no gradient).
_ENGINE_TRAIN = FusedOp("conv_bias_relu_engine_train", _train_forward, _train_forward_fake,
                        _train_setup_context, _train_backward_formula, _train_backward,
                        _train_backward_fake, nondifferentiable=(1, 2),
                        eager_setup_context=_train_eager_setup_context)


def _on_the_grid(x: torch.Tensor) -> torch.Tensor:
    """x itself, or, for a channels-last x off the 16-byte grid, its copy
    (new tensors are aligned): what the copy engine and cuDNN's float32
    backward can read.  Eager calls of the engine never meet such an x
    (:func:`_layout` sends them to cuDNN); a graph traced by torch.compile,
    planned where no address is known, may, and its ops copy x when the
    graph runs."""
    if _strictly_channels_last(x) and x.data_ptr() % 16:
        return x.clone(memory_format=torch.channels_last)
    return x


# The engine's forward without a gradient to record, as a custom op: what a
# graph traced by torch.compile calls (eager calls launch it directly).
def _engine_inference(x: torch.Tensor, weight: torch.Tensor, conv_bias: torch.Tensor,
                      bias: Optional[torch.Tensor], layout: str, dtype: torch.dtype,
                      out_dtype: torch.dtype) -> torch.Tensor:
    # x in the layout the plan was made for (a program exported by
    # torch.export does not check its input's strides; no copy where x is).
    fmt = torch.channels_last if layout == CHANNELS_LAST else torch.contiguous_format
    x = x.contiguous(memory_format=fmt)
    return _launch_engine(_on_the_grid(x), weight, conv_bias, bias, plan=(layout, dtype, out_dtype, False))


def _engine_inference_fake(x: torch.Tensor, weight: torch.Tensor, conv_bias: torch.Tensor,
                           bias: Optional[torch.Tensor], layout: str, dtype: torch.dtype,
                           out_dtype: torch.dtype) -> torch.Tensor:
    fmt = torch.channels_last if layout == CHANNELS_LAST else torch.contiguous_format
    return torch.empty(_out_shape(x, weight), dtype=out_dtype, device=x.device, memory_format=fmt)


_ENGINE_INFERENCE = inference_op("conv_bias_relu_engine", _engine_inference, _engine_inference_fake)


# ---------------------------------------------------------------- the "cudnn" route

# _deterministic_cudnn's entries now open, and the flag's value before the
# first: autograd runs the backwards of different devices in threads of
# their own, which may overlap.
_DETERMINISTIC_LOCK = threading.Lock()
_deterministic_depth = 0
_flag_before = False


@contextlib.contextmanager
def _deterministic_cudnn():
    """cuDNN restricted to its deterministic algorithms (in benchmark mode
    too: torch's algorithm search then skips the others).  A process-wide
    flag: set on the first entry of overlapping ones (other threads'), and
    given back its value on the last exit."""
    global _deterministic_depth, _flag_before
    with _DETERMINISTIC_LOCK:
        if _deterministic_depth == 0:
            _flag_before = torch.backends.cudnn.deterministic
            torch.backends.cudnn.deterministic = True
        _deterministic_depth += 1
    try:
        yield
    finally:
        with _DETERMINISTIC_LOCK:
            _deterministic_depth -= 1
            if _deterministic_depth == 0:
                torch.backends.cudnn.deterministic = _flag_before


def _strictly_channels_last(t: torch.Tensor) -> bool:
    # Channels-last and not also contiguous (as a 1 x 1 image is both).
    return t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous()


def _conv_format(x: torch.Tensor, weight: torch.Tensor) -> torch.memory_format:
    # cuDNN's choice for conv2d's output: channels-last when x or the weight
    # is (strictly) channels-last.
    if _strictly_channels_last(x) or _strictly_channels_last(weight):
        return torch.channels_last
    return torch.contiguous_format


# One tensor, not a tuple of one: torch.compile specialises the sizes of a
# custom op's one-tensor tuple, so each batch size would compile again.
def _cudnn_forward(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # The format is cuDNN's already (.contiguous a no-op but for an x that
    # is not dense), stated so that the fake's holds.
    with _deterministic_cudnn():
        z = F.conv2d(x, weight)
    return z.contiguous(memory_format=_conv_format(x, weight))


def _cudnn_forward_fake(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.empty(_out_shape(x, weight), dtype=x.dtype, device=x.device,
                       memory_format=_conv_format(x, weight))


def _strided_like(grad: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    # A gradient in its tensor's layout, as the fake below states it.  cuDNN
    # gives that already where x and the weight share a layout; not the
    # channels-last backward's weight gradient for an NCHW weight (a copy of
    # that small tensor).
    return grad if grad.stride() == t.stride() else torch.empty_like(t).copy_(grad)


# The channels-last backward's smallest dz, in elements: below it the
# transposing copies cost more than they save (docs/design.md).
CL_BACKWARD_MIN_ELEMENTS = 2**24


def _channels_last_backward(dz: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether the backward of an NCHW convolution runs channels-last: on a
    compute capability 9.0 GPU, in float16 / bfloat16, or float32 with
    ``torch.backends.cudnn.allow_tf32``, with C_in and C_out multiples of 8
    and at least :data:`CL_BACKWARD_MIN_ELEMENTS` values of dz (NCHW, or
    channels-last already: :func:`conv_bias_relu` asks bias_relu's backward
    for it so, with this test on the convolution's output).  cuDNN's
    NCHW backward works channels-last inside, slower than its channels-last
    one at such sizes (docs/design.md); our transposing copies of dz and x,
    and of dx back, cost less than the difference."""
    return (dz.numel() >= CL_BACKWARD_MIN_ELEMENTS and x.shape[1] % 8 == 0 and dz.shape[1] % 8 == 0
            and x.is_cuda and x.is_contiguous()
            and (dz.is_contiguous() or dz.is_contiguous(memory_format=torch.channels_last))
            and (x.dtype != torch.float32 or _cudnn_tf32())
            and _transposes(x) and _transposes(dz)
            and _runtime.device_capability(x.device.index) == (9, 0))


def _conv_backward(dz: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, want_x: bool,
                   want_weight: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """(dx, dw) of the convolution (stride 1, no padding) by cuDNN's
    deterministic algorithms, in the layout cuDNN picks for dz and x."""
    with _deterministic_cudnn():
        dx, dw, _ = torch.ops.aten.convolution_backward(
            dz, x, weight, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1, [want_x, want_weight, False])
    return dx, dw


def _cudnn_backward(dz: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, want_x: bool,
                    want_weight: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    channels_last = _channels_last_backward(dz, x)
    # cuDNN's backward of a channels-last x off the 16-byte grid can fail
    # (float32: "unable to find an engine", or a misaligned address that
    # ends the process's CUDA context): an aligned copy, here, where x is
    # real in eager runs and compiled graphs alike.
    dz_in, x_in = dz, lambda: _on_the_grid(x)  # noqa: E731
    if channels_last:
        # (dz comes channels-last from bias_relu's backward, see
        # conv_bias_relu(), unless something between them changed it.)
        dz_in = _transposed(dz) if dz.is_contiguous() else dz
        # (A dx of cuDNN's needs x's shape and layout only.)
        x_in = lambda: (_transposed(x) if want_weight  # noqa: E731
                        else torch.empty_like(x, memory_format=torch.channels_last))
    # The input and weight gradients on the engine at the channels-last
    # route's sizes, where they take them.
    dx, dw = _input_and_weight_grads(dz_in, weight, want_x, want_weight, channels_last, x_in)
    del dz_in
    if channels_last and want_x and _strictly_channels_last(dx):
        dx = _transposed(dx)
    return (_strided_like(dx, x) if want_x else x.new_empty((0,)),
            _strided_like(dw, weight) if want_weight else weight.new_empty((0,)))


def _cudnn_backward_fake(dz: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, want_x: bool,
                         want_weight: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty_like(x) if want_x else x.new_empty((0,)),
            torch.empty_like(weight) if want_weight else weight.new_empty((0,)))


def _cudnn_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _cudnn_backward_formula(ctx, grads, run_backward):
    x, weight = ctx.saved_tensors
    want = ctx.needs_input_grad
    dx, dw = run_backward(grads[0], x, weight, want[0], want[1])
    return dx if want[0] else None, dw if want[1] else None


# The "cudnn" route's convolution: torch's conv2d forward, and a backward
# whose algorithms are cuDNN's deterministic ones.  A custom op under
# torch.compile, so that the flag is set where the backward runs, not where
# it is traced.  (The flag is process-wide: a convolution that another
# thread launches during this backward also runs deterministically.)
_CUDNN_CONV = FusedOp("conv_bias_relu_cudnn_conv", _cudnn_forward, _cudnn_forward_fake,
                      _cudnn_setup_context, _cudnn_backward_formula, _cudnn_backward,
                      _cudnn_backward_fake)


def conv_bias_relu(x: torch.Tensor, weight: torch.Tensor, conv_bias: torch.Tensor,
                   bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``relu(conv2d(x, weight) + conv_bias) + bias``, convolution with
    stride 1, no padding, dilation 1 and one group (``nn.Conv2d``'s
    defaults).

    Args:
        x: [N, C_in, H, W], float32, float16 or bfloat16, on a CUDA device
            (NCHW or channels-last), or a CuPy array, with CuPy arrays for
            the other tensors: the result is then one too.
        weight: [C_out, C_in, KH, KW] with KH <= H, KW <= W and C_out,
            C_in >= 1, of x's dtype (under ``torch.autocast``, any of the
            three), on x's device.
        conv_bias: the convolution's bias, C_out values.
        bias: the bias added after the ReLU, C_out values (e.g. shape
            (C_out, 1, 1)), or one value for every channel (its gradient
            then the sum over the channels, rounded once), or None.

    Returns:
        [N, C_out, H - KH + 1, W - KW + 1] in x's memory format, in the dtype
        torch's type promotion gives (as :func:`.bias_relu.bias_relu`);
        differentiable in every tensor, on either route (:func:`route`).

    Raises:
        TypeError, ValueError: an argument of another type, dtype, device or
            shape, before anything runs.
    """
    if not isinstance(x, torch.Tensor):
        return call_with_cupy_arrays(conv_bias_relu, "x", x, weight, conv_bias, bias)
    refuse_jit("conv_bias_relu")
    check_tensor("x", x, ndim=(4,))
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a torch.Tensor [C_out, C_in, KH, KW], got "
                        f"{type(weight).__name__}")
    check_tensor("weight", weight)  # (a float dtype: x's, or any of them under autocast)
    if weight.dim() != 4:
        raise ValueError(f"weight must be 4-D [C_out, C_in, KH, KW], got shape {tuple(weight.shape)}")
    amp = autocast_dtype()
    # Under autocast to float32: every tensor float32 once checked (the
    # reference's conv2d casts its own; its add promotes).
    up = amp is None and float32_autocast()
    check_like("weight", weight, x, "x", dtype=FLOAT_DTYPES if amp or up else None)
    cout, cin, kh, kw = weight.shape
    if cin != x.shape[1]:
        raise ValueError(f"weight must have x's {x.shape[1]} input channels in dim 1, got "
                         f"shape {tuple(weight.shape)}")
    if not (cout and cin):
        raise ValueError(f"weight must have at least one output and one input channel, got "
                         f"shape {tuple(weight.shape)}")
    if not (1 <= kh <= x.shape[2] and 1 <= kw <= x.shape[3]):
        raise ValueError(f"the kernel ({kh} x {kw}) must fit x's {x.shape[2]} x {x.shape[3]} "
                         f"image")
    if not isinstance(conv_bias, torch.Tensor):
        raise TypeError(f"conv_bias must be a torch.Tensor, got {type(conv_bias).__name__}")
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
    if conv_bias.numel() != cout or (bias is not None and bias.numel() not in (cout, 1)):
        raise ValueError(f"conv_bias must have C_out = {cout} values and bias C_out values or "
                         f"one, got {tuple(conv_bias.shape)} and "
                         f"{None if bias is None else tuple(bias.shape)}")
    # Float vectors on x's device, one value per channel, on either route
    # (their dtypes may differ from x's: torch's promotion, or the engine's
    # rules in engine_dtypes); flat from here on.
    conv_bias = check_vector("conv_bias", check_tensor("conv_bias", conv_bias), cout, x, "x",
                             optional=False, dtype=conv_bias.dtype)
    # A 0-dim bias changes no float dtype in torch's promotion: in the dtype
    # y has without it (an autograd cast, once every tensor is checked).
    flat_bias = bias is not None and bias.dim() == 0
    if bias is not None:
        bias = check_vector("bias", check_tensor("bias", bias), cout, x, "x", dtype=bias.dtype,
                            one=True)
    refuse_transforms("conv_bias_relu", x, weight, conv_bias, bias)  # (the routes read alignments)
    if up:
        x, weight, conv_bias, bias = float32_casts(x, weight, conv_bias, bias)
    if flat_bias:
        base = amp if amp is not None else x.dtype
        bias = cast(bias, promoted(base, conv_bias.dtype))
    plan = _engine_plan(x, weight, conv_bias, bias)
    if plan and cin % 8:  # on channels padded with zeros (_padded_plan)
        x, weight = _pad_input_channels(x, weight, plan[0])
    if plan:  # the "engine" route (its dtypes checked by engine_dtypes)
        if plan[3]:  # with a gradient to record
            return _ENGINE_TRAIN.run(True, x, weight, conv_bias, bias, plan[1], plan[2])[0]
        if is_compiling():
            return _ENGINE_INFERENCE(x, weight, conv_bias, bias, *plan[:3])
        return _launch_engine(x, weight, conv_bias, bias, plan=plan)
    if amp is not None:  # autocast's casts for conv2d, recorded as autograd ops
        x, weight = cast(x, amp), cast(weight, amp)
    if not (weight.is_contiguous() or _strictly_channels_last(x)):
        # y in x's memory format, as the engine writes it: cuDNN writes a
        # channels-last z for a channels-last weight whatever x's layout.
        weight = weight.contiguous()
    refuse_tangents(conv_bias, bias)  # (bias_relu, after the convolution, asks as well)
    grad = needs_grad(x, weight)
    z = _CUDNN_CONV.run(grad, x, weight)
    # dz straight to channels-last where the convolution's backward runs so
    # (z has dz's shape, dtype and layout).  Decided here, at the forward:
    # should the backward then take cuDNN's NCHW route after all (a flag
    # changed in between), that route reads the channels-last dz as it is.
    dz_channels_last = on_example_sizes(
        lambda: bool(grad and z.is_contiguous() and _channels_last_backward(z, x)), x)
    return _bias_relu(z, conv_bias, bias, dz_channels_last)
