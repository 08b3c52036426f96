"""``linear_gn_chain``: a linear layer followed by one of the GroupNorm op
chains of :mod:`.gn_chain` (problems 37, 88 and 94),

    z = x W^T + lin_bias,   y = Post(GroupNorm(Pre(z))),

with its backward.

* Float32 on the tensor-core GEMM (precision ``"3xtf32"`` or ``"tf32"``):
  **two launches** forward, the GEMM without bias, then
  :func:`.gn_chain.gn_chain`, whose Pre adds the linear bias (two autograd
  nodes: z, saved by the second, is freed before the backward's GEMMs run).
  In float32 both places give the same sum, rounded once; in the
  memory-bound chain it is one more per-column value, where in the GEMM's
  store it lengthens the GEMM (docs/gemm.md).
* Float16 / bfloat16 on Hopper, and float32 models under autocast there,
  where :func:`_half_engine_fuses` (groups of 8 to 128 channels, a power
  of two, 32 to 128 under autocast; a short product that fills the GPU many
  times over): **one launch** forward, ``linear_gn_chain_wgmma`` in
  ``kernels_cu/linear_gn_chain.cu``, the GEMM engine of
  ``kernels_cu/gemm.cuh`` with the chain applied in its store, so z never
  makes the round trip through memory.  Its autograd node saves x, W, z and
  the per (row, group) mean and 1/std (``stats``); the backward is the
  ``gn_chain`` backward (dz and every vector's gradient as column sums),
  then dX = dz W and dW = dz^T x on cuBLAS (written in x's and W's own
  dtypes), with z alive until the end (one activation more of peak training
  memory than two launches).  Under autocast the GEMM reads x, W and the
  linear bias cast to the autocast dtype, and the chain runs in float32 with
  a float32 result, as the reference's.  Its
  statistics are summed in another order than the ``gn_chain`` kernel's, so
  the two routes agree to rounding, not bit for bit.
* Float16 / bfloat16 elsewhere (the **named fallback route**: other GPUs,
  shapes where one launch does not pay, ``eager_rounding=True``), precision
  ``"ieee"`` and GPUs without TF32 tensor cores: :func:`.linear.linear`
  (cuBLAS) with the linear bias in its epilogue (added in float32 before z
  is rounded to its dtype), then :func:`.gn_chain.gn_chain`.

Under ``torch.autocast("cuda", dtype=d)``, as the reference: the GEMM in d
(x, the weight and the linear bias cast to d; one launch as above, or
cuBLAS), the chain in float32 (its vectors cast to float32), a float32
result; each gradient in its tensor's own dtype (x's and the weight's
written so by the backward's products: :func:`.linear._run_autocast_linear`
on the two-launch route).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .. import _bridge, _runtime
from .._amp import HALF_DTYPES, autocast_dtype, cast, float32_autocast, float32_casts
from .._autograd import (FusedOp, graph_anchors, is_compiling, needs_grad, product_operands,
                         on_example_sizes, refuse_jit, refuse_tangents, refuse_transforms)
from .._validation import check_eps, check_groups, check_like, check_tensor, cxx_type
from ..settings import check_flag, resolve_precision
from . import gemm
from ._common import call_with_cupy_arrays, cdiv, _ptr_or_null, _spread
from .gn_chain import (CHAINS, _launch_backward as _gn_chain_backward,
                       _launch_forward as _gn_chain_forward, _parameter_grads,
                       _run_gn_chain, _stats_pointers, check_chain, check_chain_vectors,
                       VECTOR_NAMES)
from .linear import _cublas_operand, _mm_to, _run_autocast_linear, _run_linear

# ---------------------------------------------------------------- 16-bit, one launch (Hopper)

# Channels per group the 16-bit one-launch kernel takes: a group inside one
# tile, in whole 16-byte chunks (kernels_cu/linear_gn_chain.cu).
HALF_GROUP_SIZES = (8, 16, 32, 64, 128)
# With a float32 y (autocast), each thread keeps its row's statistics of the
# tile in 4 KiB: at most 4 groups per 128 columns.
HALF_FLOAT_OUT_GROUP_SIZES = (32, 64, 128)
# The chains whose float32 y (autocast) the kernel normalises from Pre's
# first step rounded to z's dtype, as the reference under autocast holds it
# (kSplitPre in kernels_cu/gn_chains.cuh): their y agrees with gn_chain's
# float32 y to that rounding, not to float32's.
_SPLIT_PRE_CHAINS = ("swish_bias_gn",)
# The kernel's shared memory: the engine's, with a staging area of a 16-bit
# tile per consumer warpgroup plus its vector cache and statistics
# (kGnStagingBytes: 2 x 8 KiB beside the tiles).
HALF_SHARED_BYTES = gemm._half_shared_bytes(gemm.HALF_STAGING_BYTES + 2 * 8192)


def _half_threads(cpg: int, float_out: bool) -> int:
    """Threads of the one-launch kernel for groups of ``cpg`` channels: the
    engine's warpgroups, and the store's own for a float32 y below 128
    channels per group (``GroupNormTileStore::kOwnWarpgroup``)."""
    return gemm.HALF_THREADS + (128 if float_out and cpg < gemm.HALF_TILE[1] else 0)


# Keyed by (dtype, float32 output and vectors (autocast), chain, channels per group).
HALF_KERNELS = _runtime.KernelFamily("linear_gn_chain.cu", {
    (dtype, float_out, chain, cpg): (
        f"cf::linear_gn_chain_wgmma<{cxx_type(dtype)}, "
        f"{cxx_type(torch.float32 if float_out else dtype)}, {CHAINS[chain].type()}, {cpg}, "
        f"{gemm.HALF_STAGES}>")
    for dtype in HALF_DTYPES for float_out in (False, True) for chain in CHAINS
    for cpg in (HALF_FLOAT_OUT_GROUP_SIZES if float_out else HALF_GROUP_SIZES)
})


# Where one launch pays against cuBLAS followed by the gn_chain kernel
# (docs/gemm.md): the launch saves the round trip of z through memory,
# while the engine's main loop is slower than cuBLAS's.  So it wins where
# the product is short (K up to 2048) and fills the GPU many times over
# (from 8 tiles per SM).
HALF_FUSE_MAX_K = 2048
HALF_FUSE_MIN_TILES_PER_SM = 8


def fusion_pays(m: int, n: int, k: int, sms: int) -> bool:
    """Whether the one-launch forward of an [m, k] x [n, k]^T product is
    faster than two launches on a GPU with ``sms`` SMs (see
    :data:`HALF_FUSE_MAX_K`)."""
    tiles = cdiv(m, gemm.HALF_TILE[0]) * cdiv(n, gemm.HALF_TILE[1])
    return k <= HALF_FUSE_MAX_K and tiles >= HALF_FUSE_MIN_TILES_PER_SM * sms


def _group_size_fits(n: int, num_groups: int, float_out: bool) -> bool:
    """Whether groups of n / num_groups channels are one of
    :data:`HALF_GROUP_SIZES` (:data:`HALF_FLOAT_OUT_GROUP_SIZES` with a
    float32 output)."""
    sizes = HALF_FLOAT_OUT_GROUP_SIZES if float_out else HALF_GROUP_SIZES
    return n % num_groups == 0 and n // num_groups in sizes


def _shape_fuses(x: torch.Tensor, weight: torch.Tensor, num_groups: int, float_out: bool) -> bool:
    """The rule on shapes alone: :func:`_group_size_fits` and
    :func:`fusion_pays` (what :func:`_half_engine_fuses` adds is the device
    and the operands' dtypes and alignment)."""
    n = weight.shape[0]
    return (_group_size_fits(n, num_groups, float_out)
            and fusion_pays(x.shape[0], n, x.shape[1], gemm.sm_count(x.device.index)))


def _half_engine_supports(x: torch.Tensor, weight: torch.Tensor, num_groups: int,
                          float_out: bool = False) -> bool:
    """Whether the 16-bit one-launch kernel can run this forward: where
    :func:`.gemm._uses_half_engine` accepts the product and
    :func:`_group_size_fits`."""
    return (_group_size_fits(weight.shape[0], num_groups, float_out)
            and gemm._uses_half_engine(x, weight))


def _half_engine_fuses(x: torch.Tensor, weight: torch.Tensor, num_groups: int,
                       float_out: bool = False) -> bool:
    """Whether the float16 / bfloat16 forward of ``x`` through ``weight``
    runs as one launch on the Hopper GEMM engine: where
    :func:`_half_engine_supports` and :func:`fusion_pays`.  Elsewhere the
    op's forward is the named fallback route: cuBLAS (the linear bias in
    its epilogue), then the ``gn_chain`` kernel."""
    return _shape_fuses(x, weight, num_groups, float_out) and gemm._uses_half_engine(x, weight)


def _launch_fused_half(x: torch.Tensor, weight: torch.Tensor, lin_bias: Optional[torch.Tensor],
                       extra_bias: Optional[torch.Tensor], gn_weight: Optional[torch.Tensor],
                       gn_bias: Optional[torch.Tensor], mul_weight: Optional[torch.Tensor],
                       chain: str, num_groups: int, eps: float, save: bool,
                       y: Optional[torch.Tensor] = None, float_out: bool = False):
    """The 16-bit one-launch forward (``linear_gn_chain_wgmma``), whatever
    :func:`fusion_pays` says (tests and sanitizer runs call it directly);
    needs :func:`_half_engine_supports`.  Returns (y, z, stats): y [M, N];
    when ``save``, z [M, N] (x W^T + lin_bias, rounded to x's dtype) and
    the per (row, group) mean and 1/std, stats float32 [2, M, num_groups],
    as :func:`.gn_chain._launch_forward` saves them; else both empty.
    lin_bias in x's dtype; the other vectors and y in x's dtype, or float32
    with ``float_out`` (autocast).  ``y``: the output to write (e.g.
    NaN-poisoned), else a new one."""
    if not _half_engine_supports(x, weight, num_groups, float_out):
        sizes = HALF_FLOAT_OUT_GROUP_SIZES if float_out else HALF_GROUP_SIZES
        raise ValueError("the 16-bit one-launch GEMM + GroupNorm needs a compute capability 9.0 "
                         "GPU, x and weight rows the copy engine can read and "
                         f"{sizes} channels per group")
    # The forward's own path hands checked vectors to _run_one_launch; this
    # entry takes them from tests and scripts as they come.  The kernel
    # reads the vectors' N values as x's dtype (lin_bias) or as y's.
    n, y_dtype = weight.shape[0], torch.float32 if float_out else x.dtype
    for name, v, want in (("lin_bias", lin_bias, x.dtype), ("extra_bias", extra_bias, y_dtype),
                          ("gn_weight", gn_weight, y_dtype), ("gn_bias", gn_bias, y_dtype),
                          ("mul_weight", mul_weight, y_dtype)):
        if v is not None and (v.dim() != 1 or v.shape[0] not in (1, n) or v.dtype != want
                              or v.device != x.device or (v.shape[0] == n and not v.is_contiguous())):
            raise ValueError(f"{name} must be a contiguous [{n}] (or [1]) tensor of {want} on x's device")
    return _run_one_launch(x, weight, lin_bias, extra_bias, gn_weight, gn_bias, mul_weight, chain,
                           num_groups, eps, save, y, float_out)


def _run_one_launch(x, weight, lin_bias, extra_bias, gn_weight, gn_bias, mul_weight, chain,
                    num_groups, eps, save, y, float_out):
    """:func:`_launch_fused_half` on operands already checked."""
    m, k = x.shape
    n = weight.shape[0]
    dev = x.device.index
    y_dtype = torch.float32 if float_out else x.dtype
    # (one value for every channel is spread here)
    lin_bias, extra_bias, gn_weight, gn_bias, mul_weight = (
        _spread(v, n) for v in (lin_bias, extra_bias, gn_weight, gn_bias, mul_weight))
    if y is None:
        y = torch.empty((m, n), dtype=y_dtype, device=x.device)
    elif (y.shape != (m, n) or y.dtype != y_dtype or y.device != x.device or not y.is_contiguous()
          or y.data_ptr() % 16):
        # (float32 rows are stored 16 bytes at a time; 16-bit ones by the copy engine)
        raise ValueError(f"y must be a contiguous, 16-byte aligned [{m}, {n}] tensor of {y_dtype} "
                         f"on x's device")
    z = torch.empty((m, n) if save else (0,), dtype=x.dtype, device=x.device)
    stats = torch.empty((2, m, num_groups) if save else (0,), dtype=torch.float32,
                        device=x.device)
    mean, rstd = _stats_pointers(stats) if save else (0, 0)
    tiles = cdiv(m, gemm.HALF_TILE[0]) * cdiv(n, gemm.HALF_TILE[1])
    map_x = gemm._tensor_map(x, gemm.HALF_TILE[0])
    # A float32 y is stored from registers: its map argument is unused.
    map_y = map_x if float_out else gemm._tensor_map(y, gemm.HALF_TILE[0])
    _bridge.launch(HALF_KERNELS.get((x.dtype, float_out, chain, n // num_groups), dev),
                   (min(tiles, gemm.sm_count(dev)), 1, 1), _half_threads(n // num_groups, float_out), (
                       map_x, gemm._tensor_map(weight, gemm.HALF_TILE[1]),
                       map_y, gemm._tensor_map(z, gemm.HALF_TILE[0]) if save else map_y,
                       y.data_ptr(), mean, rstd, _ptr_or_null(lin_bias),
                       _ptr_or_null(extra_bias), _ptr_or_null(gn_weight), _ptr_or_null(gn_bias),
                       _ptr_or_null(mul_weight), m, n, k, num_groups, eps), dev,
                   shared_mem=HALF_SHARED_BYTES)
    return y, z, stats


def _forward_half(x: torch.Tensor, weight: torch.Tensor, lin_bias: Optional[torch.Tensor],
                  extra_bias: Optional[torch.Tensor], gn_weight: Optional[torch.Tensor],
                  gn_bias: Optional[torch.Tensor], mul_weight: Optional[torch.Tensor], chain: str,
                  num_groups: int, eps: float, save: bool,
                  float_out: bool = False) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The 16-bit forward: one launch where :func:`_half_engine_fuses` (decided
    here, at run time, so that compiled graphs take it too), else cuBLAS
    with the linear bias in its epilogue followed by the ``gn_chain`` kernel;
    the same (y, z, stats) either way.  Arguments as for
    :func:`_launch_fused_half`."""
    if _half_engine_fuses(x, weight, num_groups, float_out):
        return _run_one_launch(x, weight, lin_bias, extra_bias, gn_weight, gn_bias, mul_weight,
                               chain, num_groups, eps, save, None, float_out)
    x, weight = _cublas_operand(x), _cublas_operand(weight)
    z = torch.addmm(lin_bias, x, weight.t()) if lin_bias is not None else torch.mm(x, weight.t())
    y, stats = _gn_chain_forward(z, None, extra_bias, gn_weight, gn_bias, mul_weight, chain,
                                 num_groups, eps, save, True, float_out=float_out)
    return y, (z if save else z.new_empty((0,))), stats


# ---------------------------------------------------------------- autograd op
#
# Inputs: x, weight and the chain's vectors (what the gradients go to, in
# their own dtypes), and x_d, w_d, lin_d: the GEMM's operands and linear
# bias in the 16-bit dtype it runs in (the same tensors for a 16-bit model;
# detached casts under autocast, which the op reads instead, as nn.Linear's
# product under autocast reads its casts).  float_out: y and the vectors
# float32 (autocast).

def _forward(x: torch.Tensor, weight: torch.Tensor, lin_bias: Optional[torch.Tensor],
             extra_bias: Optional[torch.Tensor], gn_weight: Optional[torch.Tensor],
             gn_bias: Optional[torch.Tensor], mul_weight: Optional[torch.Tensor],
             x_d: torch.Tensor, w_d: torch.Tensor, lin_d: Optional[torch.Tensor], chain: str,
             num_groups: int, eps: float, float_out: bool,
             save: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (y, z, stats); z and stats are empty unless ``save``."""
    return _forward_half(x_d, w_d, lin_d, extra_bias, gn_weight, gn_bias, mul_weight, chain,
                         num_groups, eps, save, float_out)


def _forward_fake(x: torch.Tensor, weight: torch.Tensor, lin_bias: Optional[torch.Tensor],
                  extra_bias: Optional[torch.Tensor], gn_weight: Optional[torch.Tensor],
                  gn_bias: Optional[torch.Tensor], mul_weight: Optional[torch.Tensor],
                  x_d: torch.Tensor, w_d: torch.Tensor, lin_d: Optional[torch.Tensor], chain: str,
                  num_groups: int, eps: float, float_out: bool,
                  save: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    m, n = x_d.shape[0], w_d.shape[0]
    return (x_d.new_empty((m, n), dtype=torch.float32 if float_out else x_d.dtype),
            x_d.new_empty((m, n) if save else (0,)),
            x_d.new_empty((2, m, num_groups) if save else (0,), dtype=torch.float32))


def _backward(dout: torch.Tensor, x_d: Optional[torch.Tensor], w_d: Optional[torch.Tensor],
              z: torch.Tensor, stats: torch.Tensor, lin_bias: Optional[torch.Tensor],
              extra_bias: Optional[torch.Tensor], gn_weight: Optional[torch.Tensor],
              gn_bias: Optional[torch.Tensor], mul_weight: Optional[torch.Tensor], chain: str,
              num_groups: int, x_dtype: torch.dtype, weight_dtype: torch.dtype, want_x: bool,
              want_weight: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (dx, dW, per-column sums [Chain.grad_rows, N]); dx and dW in
    x's and W's own dtypes, written by cuBLAS (no cast kernels), empty (z's
    dtype) when not wanted.  x_d is read only for dW, w_d only for dx (None
    where not saved: :func:`.._autograd.product_operands`)."""
    dz, sums = _gn_chain_backward(dout, z, stats, lin_bias, extra_bias, gn_weight, gn_bias,
                                  mul_weight, chain, num_groups, True)
    dx = _mm_to(dz, _cublas_operand(w_d), x_dtype) if want_x else z.new_empty((0,))
    dw = _mm_to(dz.t(), _cublas_operand(x_d), weight_dtype) if want_weight else z.new_empty((0,))
    return dx, dw, sums


def _backward_fake(dout: torch.Tensor, x_d: Optional[torch.Tensor], w_d: Optional[torch.Tensor],
                   z: torch.Tensor, stats: torch.Tensor, lin_bias: Optional[torch.Tensor],
                   extra_bias: Optional[torch.Tensor], gn_weight: Optional[torch.Tensor],
                   gn_bias: Optional[torch.Tensor], mul_weight: Optional[torch.Tensor], chain: str,
                   num_groups: int, x_dtype: torch.dtype, weight_dtype: torch.dtype, want_x: bool,
                   want_weight: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    m, n = dout.shape
    return (z.new_empty((m, w_d.shape[1]), dtype=x_dtype) if want_x else z.new_empty((0,)),
            z.new_empty((n, x_d.shape[1]), dtype=weight_dtype) if want_weight else z.new_empty((0,)),
            dout.new_empty((CHAINS[chain].grad_rows, n)))


def _setup_context(ctx, inputs, output):
    (x, weight, lin_bias, extra_bias, gn_weight, gn_bias, mul_weight, x_d, w_d, _, chain, groups,
     _, _, _) = inputs
    # (x's and W's casts each where a gradient reads it: product_operands)
    x_d, w_d = product_operands(ctx, x_d, w_d)
    ctx.save_for_backward(x_d, w_d, output[1], output[2], lin_bias, extra_bias, gn_weight,
                          gn_bias, mul_weight)
    # Every gradient is a function of x and W (through z, saved as an output
    # without history): they anchor a refused double backward where the
    # node saved neither them nor anything carrying their history.
    ctx.graph_anchors = graph_anchors((x, x_d), (weight, w_d))
    ctx.chain, ctx.num_groups, ctx.dtypes = chain, groups, (x.dtype, weight.dtype)


def _backward_formula(ctx, grads, run_backward):
    x_d, w_d, z, stats, lin_bias, extra_bias, gn_weight, gn_bias, mul_weight = ctx.saved_tensors
    want = ctx.needs_input_grad
    dx, dw, sums = run_backward(grads[0], x_d, w_d, z, stats, lin_bias, extra_bias,
                                gn_weight, gn_bias, mul_weight, ctx.chain, ctx.num_groups,
                                *ctx.dtypes, want[0], want[1])
    return ((dx if want[0] else None, dw if want[1] else None)
            + _parameter_grads(ctx.chain, sums, lin_bias, extra_bias, gn_weight, gn_bias,
                               mul_weight)
            + (None,) * 8)


_LINEAR_GN = FusedOp("linear_gn_chain", _forward, _forward_fake, _setup_context,
                     _backward_formula, _backward, _backward_fake, nondifferentiable=(1, 2))


def _takes_one_launch(x: torch.Tensor, weight: torch.Tensor, num_groups: int,
                      compute: torch.dtype, float_out: bool) -> bool:
    """Whether :func:`linear_gn_chain` records the one-launch op, whose GEMM
    runs in ``compute`` (float16 / bfloat16) on a compute capability 9.0
    GPU: where :func:`_half_engine_fuses` says so for a 16-bit x; while
    tracing (where a tensor's alignment is unknown), or under autocast
    (before the operands are cast), where the group size and
    :func:`fusion_pays` say so.  The op itself falls back to two launches at
    run time if its operands turn out unaligned.  While torch.export traces,
    the rules read the example's sizes (:func:`on_example_sizes`: either
    route is the same product, at any size)."""
    if x.dtype == compute and not is_compiling():  # (never while exporting: export traces)
        return _half_engine_fuses(x, weight, num_groups, float_out)
    return on_example_sizes(lambda: bool(_shape_fuses(x, weight, num_groups, float_out)), x)


def linear_gn_chain(x: torch.Tensor, weight: torch.Tensor, lin_bias: Optional[torch.Tensor],
                    chain: str, num_groups: int, *, extra_bias=None, gn_weight=None,
                    gn_bias=None, mul_weight=None, eps: float = 1e-5,
                    precision: Optional[str] = None, eager_rounding: bool = False) -> torch.Tensor:
    """``gn_chain(x @ weight.T + lin_bias)``: the GroupNorm op chain
    ``chain`` after a linear layer, differentiable in x, weight and every
    vector (where it runs: see the module docstring).  The vectors
    (lin_bias, extra_bias, gn_weight, gn_bias, mul_weight) have x's dtype
    (any float dtype under ``torch.autocast``) and device.

    Args:
        x: [M, K], float32, float16 or bfloat16 on a CUDA device (or a CuPy
            array, with CuPy arrays for the other tensors: the result is then
            one too).
        weight: [N, K], x's dtype and device.
        lin_bias: the linear layer's bias, (N,), or None.
        chain: a key of :data:`.gn_chain.CHAINS`: ``"swish_bias_gn"``
            (problem 37), ``"gn_swish_mul_swish"`` (88) or
            ``"bias_hardtanh_mish_gn"`` (94).
        num_groups: GroupNorm groups; divides N.
        extra_bias: the chain's second bias, (N,) (37 and 94), or None.
        gn_weight, gn_bias: GroupNorm's affine vectors, (N,) each, or None
            (weight 1, bias 0).
        mul_weight: the multiplier of ``"gn_swish_mul_swish"``, (N,);
            required by that chain.
        eps: GroupNorm's epsilon, finite and non-negative.
        precision: as for :func:`.linear.linear`.
        eager_rounding: as for :func:`.gn_chain.gn_chain` (float16 /
            bfloat16 only; the linear bias is then in cuBLAS's epilogue, as
            in eager).

    Returns:
        [M, N] in x's dtype.  Under ``torch.autocast`` (where x and weight
        may have any float dtype): float32, as the reference's (see the
        module docstring; under autocast to float32 every tensor is cast to
        float32 first, as the reference's linear and group_norm cast theirs).

    Raises:
        TypeError, ValueError: an argument of another type, dtype, device or
            shape, an unknown chain, groups that do not divide N, before
            anything runs.
    """
    if not isinstance(x, torch.Tensor):
        return call_with_cupy_arrays(
            linear_gn_chain, "x", x, weight, lin_bias, chain, num_groups, extra_bias=extra_bias,
            gn_weight=gn_weight, gn_bias=gn_bias, mul_weight=mul_weight, eps=eps,
            precision=precision, eager_rounding=eager_rounding)
    refuse_jit("linear_gn_chain")
    return _linear_gn_chain(x, weight, lin_bias, chain, num_groups, extra_bias, gn_weight,
                            gn_bias, mul_weight, eps, precision, eager_rounding, VECTOR_NAMES)


def _linear_gn_chain(x: torch.Tensor, weight: torch.Tensor, lin_bias, chain: str,
                     num_groups: int, extra_bias, gn_weight, gn_bias, mul_weight, eps: float,
                     precision: Optional[str], eager_rounding: bool,
                     names: Tuple[str, ...]) -> torch.Tensor:
    """:func:`linear_gn_chain` on torch tensors, its errors naming the five
    vectors (lin_bias, extra_bias, gn_weight, gn_bias, mul_weight) as
    ``names`` (the fused modules': their parameters' names)."""
    check_chain(chain)
    check_tensor("x", x, ndim=(2,))
    check_tensor("weight", weight, ndim=(2,))
    amp = autocast_dtype()
    # Under autocast to float32: every tensor float32 once checked (the
    # reference's linear and group_norm cast theirs; its adds promote).
    up = amp is None and float32_autocast()
    if amp is not None or up:  # x and weight in any float dtypes, cast by the GEMM's op or below
        check_like("weight", weight, x, "x", weight.dtype)  # the device
    else:
        check_like("weight", weight, x, "x")
    n, k = weight.shape
    if x.shape[1] != k:
        raise ValueError(f"x must have {k} features (weight is [{n}, {k}]), got shape "
                         f"{tuple(x.shape)}")
    num_groups = check_groups(num_groups, n)
    eps = check_eps(eps)
    eager_rounding = check_flag("eager_rounding", eager_rounding)
    precision = resolve_precision(precision)
    # (last: under autocast, to any dtype, the vectors cast to float32 once all are checked)
    lin_bias, extra_bias, gn_weight, gn_bias, mul_weight = check_chain_vectors(
        chain, n, x, "x", lin_bias, extra_bias, gn_weight, gn_bias, mul_weight,
        amp is not None or up, names)
    # Every tensor, before the GEMM (the two-launch routes' GEMM asks about x
    # and the weight only).
    refuse_tangents(x, weight, lin_bias, extra_bias, gn_weight, gn_bias, mul_weight)
    refuse_transforms("linear_gn_chain", x, weight, lin_bias, extra_bias, gn_weight, gn_bias, mul_weight)
    if up:
        x, weight = float32_casts(x, weight)
    hopper = not eager_rounding and gemm.has_wgmma(x.device.index)
    if amp is not None:
        if hopper and _takes_one_launch(x, weight, num_groups, amp, True):
            # One launch: the GEMM reads x, W and the linear bias cast to amp
            # (detached casts: the op writes x's and W's gradients in their
            # own dtypes), the chain runs in float32 and produces the linear
            # bias's gradient.
            x_d = x.detach().to(amp).contiguous()
            w_d = weight.detach().to(amp).contiguous()
            lin_d = lin_bias.detach().to(amp) if lin_bias is not None else None
            grad = needs_grad(x, weight, lin_bias, extra_bias, gn_weight, gn_bias, mul_weight)
            return _LINEAR_GN.run(grad, x, weight, lin_bias, extra_bias, gn_weight, gn_bias,
                                  mul_weight, x_d, w_d, lin_d, chain, num_groups, eps, True,
                                  grad)[0]
        # The GEMM in amp on cuBLAS with the linear bias (detached, cast to
        # amp) in its epilogue, x's and W's gradients written in their own
        # dtypes by the backward's products (no cast kernels); the chain in
        # float32 produces the linear bias's gradient.
        z = _run_autocast_linear(x, weight, lin_bias, amp, bias_grad=False)
        return _run_gn_chain(z, chain, num_groups, lin_bias, extra_bias, gn_weight, gn_bias,
                             mul_weight, eps, True, eager_rounding, True)
    # Where the GEMM runs, decided once and handed to _run_linear.
    passes = gemm.route(x.dtype, precision, x.device.index)
    cublas = passes == gemm.CUBLAS
    if x.dtype != torch.float32 and hopper:
        x = x if x.is_contiguous() else x.contiguous()
        weight = weight if weight.is_contiguous() else weight.contiguous()
        if _takes_one_launch(x, weight, num_groups, x.dtype, False):
            # The GEMM reads the operands themselves.
            grad = needs_grad(x, weight, lin_bias, extra_bias, gn_weight, gn_bias, mul_weight)
            return _LINEAR_GN.run(grad, x, weight, lin_bias, extra_bias, gn_weight, gn_bias,
                                  mul_weight, x, weight, lin_bias, chain, num_groups, eps, False,
                                  grad)[0]
    # Everything was validated above, once: the unchecked entry points follow.
    if cublas:
        # The bias in cuBLAS's epilogue, added in float32 before z is rounded
        # to its dtype (as eager does; adding it to a rounded fp16/bf16 z
        # costs accuracy), detached: its gradient is a column sum of the
        # chain's backward.
        z = _run_linear(x, weight,
                        cast(lin_bias.detach(), x.dtype) if lin_bias is not None else None,
                        0, passes)
    else:  # the chain adds it (see the module docstring)
        z = _run_linear(x, weight, None, 0, passes)
    return _run_gn_chain(z, chain, num_groups, lin_bias, extra_bias, gn_weight, gn_bias,
                         mul_weight, eps, cublas, eager_rounding, amp is not None)
