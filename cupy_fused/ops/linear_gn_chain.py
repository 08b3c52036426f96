"""``linear_gn_chain``: a linear layer followed by one of the GroupNorm op
chains of :mod:`.gn_chain` (problems 37, 88 and 94),

    z = x W^T + lin_bias,   y = Post(GroupNorm(Pre(z))),

with its backward.  Float32 on the tensor-core GEMM (precision ``"3xtf32"``
or ``"tf32"``):

* by default **two launches** forward: the GEMM without bias, then
  :func:`.gn_chain.gn_chain`, whose Pre adds the linear bias (two autograd
  nodes: z, saved by the second, is freed before the backward's GEMMs run).
  In float32 both places give the same sum, rounded once; in the
  memory-bound chain it is one more per-column value, where in the GEMM's
  store it lengthens the GEMM (docs/gemm.md);
* opt-in, **one launch** (``gemm_tf32_wgmma_gn`` in
  ``kernels_cu/linear_gn_chain.cu``): the GroupNorm chain applied to the Hopper
  GEMM's accumulators before its only store, where each group lies inside
  one 128-column tile (:func:`_fuses_group_norm`).  It is correct and
  tested but no faster on H100 (docs/gemm.md, "GroupNorm in the GEMM's
  store"): with one block per SM nothing overlaps the chain's latency with
  the tensor cores.  Turn it on with
  :func:`cupy_fused.settings.gemm_gn_epilogue` (or
  ``CUPY_FUSED_GEMM_GN_EPILOGUE=1``).  Its autograd node saves x, W, z and
  the per (row, group) mean and 1/std (``stats``); the backward is the
  ``gn_chain`` backward (dz and every vector's gradient as column sums),
  then dX = dz W and dW = dz^T x, with z alive until the end (one activation
  more of peak training memory than two launches).  Its group statistics
  are summed in another order than the ``gn_chain`` kernel's, so the two
  forwards agree to rounding, not bit for bit.  Under ``torch.compile`` the
  operands' alignment is unknown at trace time, so compiled code always
  takes two launches.

Float16 / bfloat16, precision ``"ieee"`` and GPUs without TF32 tensor cores
take :func:`.linear.linear` (cuBLAS) with the linear bias in its epilogue
(added in float32 before z is rounded to its dtype), then
:func:`.gn_chain.gn_chain`.

Under ``torch.autocast("cuda", dtype=d)``, as the reference: the GEMM in d
(x, the weight and the linear bias cast to d, cuBLAS), the chain in float32
(its vectors cast to float32), a float32 result; each gradient in its
tensor's own dtype (x's and the weight's written so by the backward's
products: :func:`.linear._run_autocast_linear`).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .. import _bridge, _runtime
from .._amp import autocast_dtype, cast
from .._autograd import FusedOp, is_compiling, needs_grad
from .._validation import check_eps, check_groups, check_like, check_tensor
from ..settings import get_gemm_gn_epilogue, resolve_precision
from . import gemm
from ._common import call_with_cupy_arrays, cdiv, _ptr_or_null
from .gn_chain import (CHAINS, _launch_backward as _gn_chain_backward, _parameter_grads,
                       _run_gn_chain, _stats_pointers, check_chain, check_chain_vectors)
from .linear import _run_autocast_linear, _run_linear

WGMMA_TILE = gemm.TILES["wgmma128x128"]

# Keyed by (chain, passes).  Forward layout only: x [M, K], W [N, K].
KERNELS = _runtime.KernelFamily("linear_gn_chain.cu", {
    (chain, passes): (f"cf::gemm_tf32_wgmma_gn<{WGMMA_TILE.stages}, {passes}, "
                      f"{CHAINS[chain].type()}>")
    for chain in CHAINS for passes in (1, 3)
})


def group_fits_tile(channels: int, num_groups: int) -> bool:
    """Whether every group lies inside one 128-column tile: channels per
    group a power of two <= 128."""
    cpg = channels // num_groups
    return cpg <= WGMMA_TILE.bn and cpg & (cpg - 1) == 0


def _fuses_group_norm(x: torch.Tensor, weight: torch.Tensor, num_groups: int, passes: int) -> bool:
    """Whether the forward of ``x`` [M, K] (contiguous float32) through
    ``weight`` [N, K] is one launch: when switched on
    (:func:`cupy_fused.settings.gemm_gn_epilogue`), where the wgmma GEMM
    is the kernel :func:`.gemm.choose_tile` picks, K is not below
    :data:`.gemm.SGEMM_BELOW_INNER` and :func:`group_fits_tile`."""
    if not get_gemm_gn_epilogue() or is_compiling():
        return False
    m, k = x.shape
    n = weight.shape[0]
    aligned = gemm._rows_aligned(x, k) and gemm._rows_aligned(weight, k)
    return (m > 0 and group_fits_tile(n, num_groups) and not gemm.uses_sgemm(passes, k)
            and gemm.TILES[gemm.choose_tile(m, n, aligned, x.device.index, passes)].wgmma)


def _launch_fused(x: torch.Tensor, weight: torch.Tensor, lin_bias: Optional[torch.Tensor],
                  extra_bias: Optional[torch.Tensor], gn_weight: Optional[torch.Tensor],
                  gn_bias: Optional[torch.Tensor], mul_weight: Optional[torch.Tensor], chain: str,
                  num_groups: int, eps: float, passes: int, save: bool,
                  y: Optional[torch.Tensor] = None):
    """The one-launch forward on the wgmma kernel, whatever the size rule
    says (tests and sanitizer runs call it directly; it needs a compute
    capability 9.0 device, :func:`group_fits_tile` and 16-byte aligned rows).
    Returns (y, z, stats): z and the per (row, group) mean and 1/std, stats
    [2, M, num_groups] as :func:`.gn_chain._launch_forward` saves them, are
    empty unless ``save``.
    ``y``: the [M, N] output to write (e.g. NaN-poisoned), else a new one."""
    m, k = x.shape
    n = weight.shape[0]
    dev = x.device.index
    if not gemm.has_wgmma(dev):
        raise ValueError("the one-launch GEMM + GroupNorm needs the wgmma GEMM (compute "
                         "capability 9.0)")
    if n == 0 or n % num_groups or not group_fits_tile(n, num_groups):
        raise ValueError(f"the one-launch GEMM + GroupNorm needs channels per group a power "
                         f"of two <= 128, got {n} channels in {num_groups} groups")
    if k == 0 or not (gemm._rows_aligned(x, k) and gemm._rows_aligned(weight, k)):
        raise ValueError("the one-launch GEMM + GroupNorm needs K >= 1 and x and weight rows "
                         "on 16 bytes")
    if CHAINS[chain].mul_weight is not None and mul_weight is None:
        raise TypeError("multiply_weight is required by this chain, got None")
    if y is None:
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    elif y.shape != (m, n) or y.dtype != x.dtype or not y.is_contiguous():
        raise ValueError(f"y must be a contiguous [{m}, {n}] tensor of x's dtype")
    z = torch.empty((m, n) if save else (0,), dtype=x.dtype, device=x.device)
    stats = torch.empty((2, m, num_groups) if save else (0,), dtype=torch.float32,
                        device=x.device)
    if m:
        mean, rstd = _stats_pointers(stats) if save else (0, 0)
        _bridge.launch(KERNELS.get((chain, passes), dev),
                       (cdiv(m, WGMMA_TILE.bm) * cdiv(n, WGMMA_TILE.bn), 1, 1), WGMMA_TILE.threads, (
                           x.data_ptr(), weight.data_ptr(), y.data_ptr(),
                           _ptr_or_null(z) if save else 0, mean, rstd, _ptr_or_null(lin_bias),
                           _ptr_or_null(extra_bias), _ptr_or_null(gn_weight), _ptr_or_null(gn_bias),
                           _ptr_or_null(mul_weight),
                           m, n, k, k, k, num_groups, eps), dev,
                       shared_mem=WGMMA_TILE.shared_bytes(True, True, passes))
    return y, z, stats


# ---------------------------------------------------------------- autograd op

def _forward(x: torch.Tensor, weight: torch.Tensor, lin_bias: Optional[torch.Tensor],
             extra_bias: Optional[torch.Tensor], gn_weight: Optional[torch.Tensor],
             gn_bias: Optional[torch.Tensor], mul_weight: Optional[torch.Tensor], chain: str,
             num_groups: int, eps: float, passes: int,
             save: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (y, z, stats); z and stats are empty unless ``save``."""
    return _launch_fused(x, weight, lin_bias, extra_bias, gn_weight, gn_bias, mul_weight, chain,
                         num_groups, eps, passes, save)


def _forward_fake(x: torch.Tensor, weight: torch.Tensor, lin_bias: Optional[torch.Tensor],
                  extra_bias: Optional[torch.Tensor], gn_weight: Optional[torch.Tensor],
                  gn_bias: Optional[torch.Tensor], mul_weight: Optional[torch.Tensor], chain: str,
                  num_groups: int, eps: float, passes: int,
                  save: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    m, n = x.shape[0], weight.shape[0]
    return (x.new_empty((m, n)), x.new_empty((m, n) if save else (0,)),
            x.new_empty((2, m, num_groups) if save else (0,)))


def _backward(dout: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, z: torch.Tensor,
              stats: torch.Tensor, lin_bias: Optional[torch.Tensor],
              extra_bias: Optional[torch.Tensor], gn_weight: Optional[torch.Tensor],
              gn_bias: Optional[torch.Tensor], mul_weight: Optional[torch.Tensor], chain: str,
              num_groups: int, passes: int, want_x: bool,
              want_weight: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (dx, dW, per-column sums [Chain.grad_rows, N]); dx / dW empty
    when not wanted."""
    dz, sums = _gn_chain_backward(dout, z, stats, lin_bias, extra_bias, gn_weight, gn_bias,
                                  mul_weight, chain, num_groups, True)
    dx, dw, _ = gemm._linear_backward(dz, x, weight, passes, want_x, want_weight, False)
    return dx, dw, sums


def _backward_fake(dout: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, z: torch.Tensor,
                   stats: torch.Tensor, lin_bias: Optional[torch.Tensor],
                   extra_bias: Optional[torch.Tensor], gn_weight: Optional[torch.Tensor],
                   gn_bias: Optional[torch.Tensor], mul_weight: Optional[torch.Tensor], chain: str,
                   num_groups: int, passes: int, want_x: bool,
                   want_weight: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.empty_like(x) if want_x else x.new_empty((0,)),
            torch.empty_like(weight) if want_weight else weight.new_empty((0,)),
            z.new_empty((CHAINS[chain].grad_rows, weight.shape[0])))


def _setup_context(ctx, inputs, output):
    x, weight, lin_bias, extra_bias, gn_weight, gn_bias, mul_weight, chain, groups, _, passes, _ = inputs
    ctx.save_for_backward(x, weight, output[1], output[2], lin_bias, extra_bias, gn_weight,
                          gn_bias, mul_weight)
    ctx.chain, ctx.num_groups, ctx.passes = chain, groups, passes


def _backward_formula(ctx, grads, run_backward):
    x, weight, z, stats, lin_bias, extra_bias, gn_weight, gn_bias, mul_weight = ctx.saved_tensors
    want = ctx.needs_input_grad
    dx, dw, sums = run_backward(grads[0], x, weight, z, stats, lin_bias, extra_bias,
                                gn_weight, gn_bias, mul_weight, ctx.chain, ctx.num_groups,
                                ctx.passes, want[0], want[1])
    return ((dx if want[0] else None, dw if want[1] else None)
            + _parameter_grads(ctx.chain, sums, lin_bias, extra_bias, gn_weight, gn_bias,
                               mul_weight)
            + (None, None, None, None, None))


_LINEAR_GN = FusedOp("linear_gn_chain", _forward, _forward_fake, _setup_context,
                     _backward_formula, _backward, _backward_fake, nondifferentiable=(1, 2))


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
        eps: GroupNorm's epsilon, finite and positive.
        precision: as for :func:`.linear.linear`.
        eager_rounding: as for :func:`.gn_chain.gn_chain` (float16 /
            bfloat16 only; the linear bias is then in cuBLAS's epilogue, as
            in eager).

    Returns:
        [M, N] in x's dtype.  Under ``torch.autocast`` (where x and weight
        may have any float dtype): float32, as the reference's (see the
        module docstring).

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
    check_chain(chain)
    check_tensor("x", x, ndim=(2,))
    check_tensor("weight", weight, ndim=(2,))
    amp = autocast_dtype()
    if amp is not None:  # x and weight in any float dtypes, cast to amp by the GEMM's op
        check_like("weight", weight, x, "x", weight.dtype)  # the device
    else:
        check_like("weight", weight, x, "x")
    n, k = weight.shape
    if x.shape[1] != k:
        raise ValueError(f"x must have {k} features (weight is [{n}, {k}]), got shape "
                         f"{tuple(x.shape)}")
    num_groups = check_groups(num_groups, n)
    eps = check_eps(eps)
    lin_bias, extra_bias, gn_weight, gn_bias, mul_weight = check_chain_vectors(
        chain, n, x, "x", lin_bias, extra_bias, gn_weight, gn_bias, mul_weight, amp is not None)
    precision = resolve_precision(precision)
    if amp is not None:
        # The GEMM in amp on cuBLAS with the linear bias (detached, cast to
        # amp) in its epilogue, x's and W's gradients written in their own
        # dtypes by the backward's products (no cast kernels); the chain in
        # float32 produces the linear bias's gradient.
        z = _run_autocast_linear(x, weight, lin_bias, amp, bias_grad=False)
        return _run_gn_chain(z, chain, num_groups, lin_bias, extra_bias, gn_weight, gn_bias,
                             mul_weight, eps, True, bool(eager_rounding), True)
    # Where the GEMM runs, decided once and handed to _run_linear.
    passes = gemm.route(x.dtype, precision, x.device.index)
    cublas = passes == gemm.CUBLAS
    if not cublas:
        x = x if x.is_contiguous() else x.contiguous()
        weight = weight if weight.is_contiguous() else weight.contiguous()
        if _fuses_group_norm(x, weight, num_groups, passes):
            grad = needs_grad(x, weight, lin_bias, extra_bias, gn_weight, gn_bias, mul_weight)
            return _LINEAR_GN.run(grad, x, weight, lin_bias, extra_bias, gn_weight, gn_bias,
                                  mul_weight, chain, num_groups, eps, passes, grad)[0]
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
                         mul_weight, eps, cublas, bool(eager_rounding), amp is not None)
