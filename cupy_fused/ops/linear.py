"""``linear``: ``y = act(x W^T + bias)``, as ``torch.nn.functional.linear``
followed by the activation, with its backward.  Which engine runs it,
decided once per call (:func:`.gemm.route`):

* float32 at precision ``"3xtf32"`` or ``"tf32"`` on a GPU with TF32 tensor
  cores: the GEMM of :mod:`.gemm`.  Without autograd the bias and ReLU are
  fused into the GEMM's store; in training the GEMM stores z and the
  ``bias_relu`` kernel adds the bias and applies the ReLU, keeping a 1-bit
  mask for the backward (see :func:`_run_linear`).  The backward's
  products run on the same kernels.
* float16 / bfloat16, ``"ieee"``, or a GPU without TF32 tensor cores
  (:func:`.gemm.uses_cublas`): cuBLAS.  Bias and ReLU are then cuBLAS's and
  torch's (no kernel of ours): the bias in cuBLAS's epilogue, then torch's
  in-place ReLU (cuBLASLt's fused ReLU epilogue turns NaN into 0); in
  training, where x and the weight both need gradients, one autograd node
  whose backward (torch ops) gates the gradient with ReLU's own backward
  kernel, then :func:`_cublas_relu_backward` does the rest (traced, or
  under saved-tensor hooks, a native ``relu_`` gates; with a frozen
  operand, F.linear and relu_: see :func:`_run_linear`).
* under ``torch.autocast("cuda", dtype=d)``: cuBLAS in d, gradients in each
  tensor's own dtype (:func:`_run_autocast_linear`).  A forward without
  autograd of few rows and a float32 weight runs on Hopper as
  :func:`.gemm._linear_float32_weight`, which rounds the weight to d inside
  the product instead of casting it first (:func:`.gemm._routes_float32_weight`;
  traced by torch.compile, the custom op ``cupy_fused::linear_float32_weight``).
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F

from .._amp import autocast_dtype, float32_autocast, float32_casts
from .._autograd import (FusedOp, check_unchanged, graph_anchors, inference_op, is_compiling,
                         keep_output, keeps_for_one_use, launches_directly, needs_grad, product_operands,
                         refuse_jit, refuse_transforms, take_output, version_of)
from .._validation import FLOAT_DTYPES, check_like, check_tensor, check_vector
from ..settings import resolve_precision
from ._common import call_with_cupy_arrays
from .bias_relu import bias_relu
from .gemm import (_LINEAR, CUBLAS, _backward_fake, _routes_float32_weight, _run_float32_weight,
                   _uses_float32_weight_engine, route)

ACTIVATIONS = {None: 0, "none": 0, "relu": 1}


def _activation_code(activation) -> int:
    """The kernels' code of ``activation`` (:data:`ACTIVATIONS`); ValueError
    for anything else (an unhashable value too)."""
    if (activation is None or isinstance(activation, str)) and activation in ACTIVATIONS:
        return ACTIVATIONS[activation]
    raise ValueError(f"activation must be None or 'relu', got {activation!r}")


# ---------------------------------------------------------------- cuBLAS bias + ReLU

def _cublas_relu_forward(x: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor) -> torch.Tensor:
    # cuBLAS with the bias in its epilogue, then torch's ReLU in place.  Not
    # cuBLASLt's fused bias + ReLU epilogue (torch._addmm_activation): its
    # max(z, 0) turns a NaN into 0, where torch.relu keeps it.
    x, weight = _cublas_operand(x), _cublas_operand(weight)
    return torch.addmm(bias, x, weight.t()).relu_()


def _cublas_relu_forward_fake(x: torch.Tensor, weight: torch.Tensor,
                              bias: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


def _cublas_relu_backward(dz: torch.Tensor, x: Optional[torch.Tensor],
                          weight: Optional[torch.Tensor], want_x: bool, want_weight: bool,
                          want_bias: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of the linear part of ``relu(x W^T + bias)``, given the
    gradient dz already gated by the ReLU.  x is needed only for dW, the
    weight only for dx (None where not saved: :func:`product_operands`).
    Returns (dx, dW, dbias); each is empty when not wanted."""
    dz = dz.contiguous()
    # The bias gradient first, so that the column sum's scratch is freed
    # before the weight gradient exists (F.linear's backward sums it after the
    # products, on the engine's side, which raises the step's peak memory).
    dbias = dz.sum(0) if want_bias else dz.new_empty((0,))
    # torch.mm, not @: Tensor.__matmul__ is a Python wrapper around
    # torch.matmul, which then picks mm; host work counts here, since at
    # problem 76's shape the half-precision step is as long as its host work.
    dx = torch.mm(dz, _cublas_operand(weight)) if want_x else dz.new_empty((0,))
    dw = torch.mm(dz.t(), _cublas_operand(x)) if want_weight else dz.new_empty((0,))
    return dx, dw, dbias


def _cublas_relu_backward_fake(dz: torch.Tensor, x: Optional[torch.Tensor],
                               weight: Optional[torch.Tensor], want_x: bool, want_weight: bool,
                               want_bias: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward_fake(dz, x, weight, 0, want_x, want_weight, want_bias)  # (passes: unused)


def _cublas_relu_setup_context(ctx, inputs, output):
    # Traced (the registered custom op), or eager under saved-tensor hooks:
    # the caller's relu_ gates the gradient.
    x, weight, _ = inputs
    ctx.save_for_backward(*product_operands(ctx, x, weight))
    ctx.gates = False


def _cublas_relu_eager_setup_context(ctx, inputs, output):
    # Eager: this node gates the gradient itself, with the output kept for
    # that one use (see _CUBLAS_RELU).  The bias is kept, not saved, to
    # recompute the output for a second backward through a retained graph
    # (refused there, as autograd refuses, if it changed in place): the
    # reference's nodes do not save it, so changing it in place before the
    # first backward is no error.  That recomputation reads x and the
    # weight: eager calls take this node only where both need gradients,
    # and it saves both (_run_linear).
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.bias, ctx.bias_version = bias, version_of(bias)
    keep_output(ctx, output)
    ctx.gates = True


def _cublas_relu_backward_formula(ctx, grads, run_backward):
    dz = grads[0]
    x, weight = ctx.saved_tensors
    if ctx.gates:
        y = take_output(ctx)
        if y is None:  # a second backward through a retained graph
            check_unchanged(ctx.bias, ctx.bias_version, "the bias of cupy_fused::linear_relu_cublas")
            y = _cublas_relu_forward(x, weight, ctx.bias)
        # ReLU's own backward kernel (as eager's ReLU node), then y is dropped
        # before the products allocate dW.
        dz = torch.ops.aten.threshold_backward(dz, y, 0)
        del y
    want = ctx.needs_input_grad
    dx, dw, dbias = run_backward(dz, x, weight, want[0], want[1], want[2])
    return (dx if want[0] else None, dw if want[1] else None, dbias if want[2] else None)


# relu(x W^T + bias) as one autograd node, and its backward: the ReLU's
# gate, the bias gradient's column sum, dX and dW.  The gate needs the
# output, which must not stay alive through the products (it would raise
# the step's peak memory above torch.compile's).  Eager calls keep it for
# the gate only (keep_output) and drop it before the products.  Traced
# calls, whose graph carries saved tensors only, and eager calls under
# saved-tensor hooks (keeps_for_one_use), gate with a native relu_ that the
# caller applies to the output (values unchanged: they are >= 0 already),
# whose own node then frees the output.  Only _run_linear uses it, that
# way.
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
    return _cublas_linear(x_d, w_d, bias_d)


def _cublas_linear(x_d: torch.Tensor, w_d: torch.Tensor, bias_d: Optional[torch.Tensor]) -> torch.Tensor:
    # x_d w_d^T + bias_d by cuBLAS, on operands on the 16-byte grid.
    x_d, w_d = _cublas_operand(x_d), _cublas_operand(w_d)
    if bias_d is None:
        return torch.mm(x_d, w_d.t())
    return torch.addmm(bias_d, x_d, w_d.t())


def _autocast_forward_fake(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                           x_d: torch.Tensor, w_d: torch.Tensor,
                           bias_d: Optional[torch.Tensor]) -> torch.Tensor:
    return x_d.new_empty((x_d.shape[0], w_d.shape[0]))


def _autocast_products(dz: torch.Tensor, x_d: Optional[torch.Tensor],
                       take_w_d: Callable[[], torch.Tensor],
                       x_dtype: torch.dtype, weight_dtype: torch.dtype, bias_dtype: torch.dtype,
                       want_x: bool, want_weight: bool, want_bias: bool):
    """(dx, dW, dbias) of ``x_d W_d^T + bias_d`` in x's, W's and the bias's
    own dtypes, each written by its product / sum (:func:`_mm_to`; the column
    sum accumulates in float32), with no cast kernels; None where not wanted.
    ``x_d`` is read only for dW (None where not saved); ``take_w_d`` returns
    W_d, asked for only where dX is wanted, and dropped here after dX and
    before dW is allocated (the eager path holds no other reference to
    it)."""
    dz = dz.contiguous()  # also materialises a broadcast gradient
    # The bias gradient first (see _cublas_relu_backward).
    dbias = dz.sum(0, dtype=bias_dtype) if want_bias else None
    dx = None
    if want_x:  # (W_d is read by dX alone)
        w_d = _cublas_operand(take_w_d())
        dx = _mm_to(dz, w_d, x_dtype)
        del w_d
    dw = _mm_to(dz.t(), _cublas_operand(x_d), weight_dtype) if want_weight else None
    return dx, dw, dbias


def _autocast_linear_backward(dz: torch.Tensor, x_d: Optional[torch.Tensor],
                              w_d: Optional[torch.Tensor], x_dtype: torch.dtype,
                              weight_dtype: torch.dtype, bias_dtype: torch.dtype, want_x: bool,
                              want_weight: bool,
                              want_bias: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward custom op: :func:`_autocast_products`, each gradient
    empty when not wanted."""
    grads = _autocast_products(dz, x_d, lambda: w_d, x_dtype, weight_dtype, bias_dtype, want_x,
                               want_weight, want_bias)
    # (an unwanted one empty in its dtype, as the fake gives it)
    return tuple(g if g is not None else dz.new_empty((0,), dtype=d)
                 for g, d in zip(grads, (x_dtype, weight_dtype, bias_dtype)))


def _autocast_backward_fake(dz: torch.Tensor, x_d: Optional[torch.Tensor],
                            w_d: Optional[torch.Tensor], x_dtype: torch.dtype,
                            weight_dtype: torch.dtype, bias_dtype: torch.dtype, want_x: bool,
                            want_weight: bool,
                            want_bias: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    m, n = dz.shape
    return (dz.new_empty((m, w_d.shape[1]) if want_x else (0,), dtype=x_dtype),
            dz.new_empty((n, x_d.shape[1]) if want_weight else (0,), dtype=weight_dtype),
            dz.new_empty((n,) if want_bias else (0,), dtype=bias_dtype))


def _autocast_setup_context(ctx, inputs, output):
    x, weight, bias, x_d, w_d, _ = inputs
    # The casts, as autocast's own nn.Linear saves them (not x and W), each
    # where a gradient reads it.
    x_d, w_d = product_operands(ctx, x_d, w_d)
    ctx.save_for_backward(x_d, w_d)
    _anchor_operands(ctx, x, weight, x_d, w_d)
    ctx.dtypes = (x.dtype, weight.dtype, bias.dtype if bias is not None else output.dtype)
    ctx.has_bias = bias is not None


def _autocast_eager_setup_context(ctx, inputs, output):
    # Eager: the weight's cast is kept for one use (as keep_output keeps an
    # output), so that the backward drops it after dX and before dW, the
    # largest tensor of the step, is allocated: the reference's autograd
    # frees its own cast there too (MmBackward's saved tensors go before the
    # cast back to float32 runs).  Each kept or saved only where a gradient
    # reads it (see product_operands): x's cast for dW, the weight's for dX.
    x, weight, bias, x_d, w_d, _ = inputs
    x_d, w_d = product_operands(ctx, x_d, w_d)
    ctx.save_for_backward(x_d)
    _anchor_operands(ctx, x, weight, x_d, None)  # (w_d kept, not saved)
    ctx.kept_w_d, ctx.weight, ctx.weight_version = w_d, None, None
    if w_d is not None:
        ctx.weight, ctx.weight_version = weight, version_of(weight)
        ctx.kept_w_d_version = version_of(w_d)  # the weight's own where it has the dtype (no cast)
    ctx.amp = output.dtype  # (the product's dtype: what a recast of the weight takes)
    ctx.dtypes = (x.dtype, weight.dtype, bias.dtype if bias is not None else output.dtype)
    ctx.has_bias = bias is not None


def _anchor_operands(ctx, x, weight, x_saved, w_saved) -> None:
    """dX is a function of the weight, dW of x, through casts that carry
    no history (detached): x and the weight anchor a refused double
    backward where their gradients' other factor is wanted
    (:func:`graph_anchors`)."""
    want = ctx.needs_input_grad
    ctx.graph_anchors = graph_anchors((weight if want[0] else None, w_saved),
                                      (x if want[1] else None, x_saved))


def _take_weight_cast(ctx) -> torch.Tensor:
    """The weight's cast kept by the eager setup, which the node then no
    longer holds; recast from the weight for a second backward through a
    retained graph.  Refused, as autograd refuses a saved tensor changed in
    place, where the weight changed in place since the forward and the
    product read it: in the second backward, and in the first where the
    weight had autocast's dtype, so that the "cast" is the weight itself."""
    w_d, ctx.kept_w_d = ctx.kept_w_d, None
    if w_d is not None:
        check_unchanged(w_d, ctx.kept_w_d_version, "the weight of cupy_fused::linear_autocast")
        return w_d
    check_unchanged(ctx.weight, ctx.weight_version, "the weight of cupy_fused::linear_autocast")
    return ctx.weight.detach().to(ctx.amp)


def _autocast_backward_formula(ctx, grads, run_backward):
    want = ctx.needs_input_grad
    want_bias = ctx.has_bias and want[2]
    if hasattr(ctx, "kept_w_d"):  # eager (see _autocast_eager_setup_context)
        (x_d,) = ctx.saved_tensors
        if not want[0]:
            ctx.kept_w_d = None  # not read (no dX): dropped before dW is allocated
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
# produce them in d and cast them back: one more kernel each (on problem
# 76, a pass over the 8192 x 8192 weight gradient every step) and both
# copies alive at once.  It saves the casts, as the reference does.  Traced,
# a 16-bit F.linear is this op too, its operands their own casts
# (_run_linear).
_LINEAR_AUTOCAST = FusedOp("linear_autocast", _autocast_forward, _autocast_forward_fake,
                           _autocast_setup_context, _autocast_backward_formula,
                           _autocast_linear_backward, _autocast_backward_fake,
                           eager_setup_context=_autocast_eager_setup_context)


# The float32-weight product of an autocast forward without autograd, as
# a custom op: what a graph traced by torch.compile calls (eager calls
# launch it directly).  Planned while tracing, where no address is known,
# so the operands are checked here, as an eager call's are: a 16-bit x off
# the 16-byte grid copied onto it (_run_autocast_linear), a float32 weight
# off the copy engine's grid read by cuBLAS as its cast.
def _float32_weight_forward(x_d: torch.Tensor, weight: torch.Tensor,
                            bias_d: Optional[torch.Tensor]) -> torch.Tensor:
    x_d = _cublas_operand(x_d)
    if _uses_float32_weight_engine(x_d, weight):
        return _run_float32_weight(x_d, weight, bias_d)
    return _cublas_linear(x_d, weight.to(x_d.dtype), bias_d)


def _float32_weight_fake(x_d: torch.Tensor, weight: torch.Tensor,
                         bias_d: Optional[torch.Tensor]) -> torch.Tensor:
    return x_d.new_empty((x_d.shape[0], weight.shape[0]))


_FLOAT32_WEIGHT = inference_op("linear_float32_weight", _float32_weight_forward, _float32_weight_fake)


def _cublas_operand(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy of it on the 16-byte grid where it is a float16 /
    bfloat16 tensor off it.  Given such an operand, cuBLAS picks kernels
    that may sum in the 16-bit type, as torch allows by default
    (``torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction``),
    with nearly twice the error of its kernels for aligned operands
    (docs/design.md).  Called where cuBLAS is handed the operands: in the
    custom ops' implementations (:data:`_CUBLAS_RELU`,
    :data:`_LINEAR_AUTOCAST`, :data:`_FLOAT32_WEIGHT`, and
    linear_gn_chain's), which compiled graphs
    run on real tensors too, and beside the eager calls of ``F.linear``.
    Not while tracing, where no address is known."""
    if t.dtype == torch.float32 or is_compiling() or t.data_ptr() % 16 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _run_autocast_linear(x2: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                         dtype: torch.dtype, bias_grad: bool = True) -> torch.Tensor:
    """``F.linear(x2, weight, bias)`` under ``torch.autocast("cuda",
    dtype=dtype)``, on operands already checked (x2 [M, K], weight [N, K],
    bias (N,) flat or None; any float dtypes, one device): the product in
    ``dtype`` (bias in cuBLAS's epilogue), gradients in each tensor's own
    dtype (:data:`_LINEAR_AUTOCAST`).  ``bias_grad=False``: the bias is
    added but gets no gradient from this op (a caller computes it).

    Without autograd, a float32 weight and few rows: the product reads the
    weight itself and rounds it in the tensor cores' operand registers
    (:func:`.gemm._routes_float32_weight`; traced, :data:`_FLOAT32_WEIGHT`):
    the same values as its cast, without the cast's pass over the
    weight."""
    # (.to returns the tensor itself when already in dtype; aligned here, as
    # the float32-weight route takes aligned operands only)
    x_d = _cublas_operand(x2.detach().to(dtype))
    bias_d = bias.detach().to(dtype) if bias is not None else None
    if not bias_grad:
        bias = None
    grad = needs_grad(x2, weight, bias)
    if not grad:
        # The float32-weight product: traced as its op, or launched here.
        # (Picked before the route is asked: outside tracing it reads the
        # operands' addresses, which torch.func's wrappers do not have.)
        product = (_FLOAT32_WEIGHT if is_compiling()
                   else _run_float32_weight if launches_directly() else None)
        if product is not None and _routes_float32_weight(x_d, weight):
            return product(x_d, weight, bias_d)  # (operands checked by the route, or by the op)
    w_d = weight.detach().to(dtype)
    return _LINEAR_AUTOCAST.run(grad, x2, weight, bias, x_d, w_d, bias_d)


def linear(x, weight, bias=None, activation: Optional[str] = None,
           precision: Optional[str] = None):
    """``act(x @ weight.T + bias)``, like ``torch.nn.functional.linear``
    followed by the activation; differentiable in x, weight and bias (where
    it runs: see the module docstring).

    Args:
        x: [..., K], at least 1-D; float32, float16 or bfloat16 on a CUDA
            device.  A CuPy array instead (then weight and bias are CuPy
            arrays too) gives a CuPy result.
        weight: [N, K], x's dtype and device.
        bias: N values (shape (N,), or one with N elements along one
            dimension, such as (N, 1)), x's dtype and device, or None.
        activation: None or ``"relu"``.
        precision: of float32 products: ``"3xtf32"``, ``"tf32"``, ``"ieee"``,
            or None for the process default
            (:func:`cupy_fused.settings.fp32_matmul_precision`).  float16 /
            bfloat16 always run on cuBLAS.

    Returns:
        [..., N] in x's dtype.

    Under ``torch.autocast("cuda", dtype=d)``, as ``F.linear`` there: x,
    weight and bias may each be float32, float16 or bfloat16.  For d
    float16 or bfloat16 they are cast to d, the product runs in d (cuBLAS,
    or without autograd on Hopper our engine reading a float32 weight
    itself: :func:`.gemm._routes_float32_weight`; the ReLU after it) and
    the result is in d; the gradients come back in each tensor's own dtype,
    written so by the backward's products (:func:`_run_autocast_linear`).
    For d float32 the half-precision ones are cast to float32 (autograd
    casts) and the product is float32's, as outside autocast.

    Raises:
        TypeError, ValueError: an argument of another type, dtype, device or
            shape, before anything runs.
    """
    if not isinstance(x, torch.Tensor):
        return call_with_cupy_arrays(linear, "x", x, weight, bias, activation, precision)
    refuse_jit("linear")
    check_tensor("x", x)
    if x.dim() == 0:
        raise ValueError("x must have at least 1 dimension (the features), got a scalar")
    check_tensor("weight", weight, ndim=(2,))
    amp = autocast_dtype()
    up = amp is None and float32_autocast()  # half tensors cast up, after the checks
    # Under autocast, x, weight and bias may each be any of the three (cast to
    # amp by the op, or up to float32), as autocast's F.linear takes them.
    any_float = FLOAT_DTYPES if amp is not None or up else None
    check_like("weight", weight, x, "x", any_float)
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"x must have {k} features (weight is [{n}, {k}]) in its last "
                         f"dimension, got shape {tuple(x.shape)}")
    bias = check_vector("bias", bias, n, x, "x", dtype=any_float)
    act = _activation_code(activation)
    precision = resolve_precision(precision)
    if up:  # (checked: a cast is a launch)
        x, weight, bias = float32_casts(x, weight, bias)
    # (2-D x: no reshape, a view is one more autograd node per call)
    x2 = x if x.dim() == 2 else x.reshape(x.shape[:-1].numel(), k)  # (not -1: k may be 0)
    y = _linear_2d(x2, weight, bias, act, precision, amp)
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], n)


def _linear_prechecked(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                       activation: Optional[str] = None,
                       precision: Optional[str] = None) -> torch.Tensor:
    """Internal entry point: :func:`linear` for a caller that has already
    made linear's checks of the tensors, with the same result and autograd.

    For the fused modules (``cupy_fused.models``), whose forward checks its
    input and parameters anyway: linear would check the same tensors again
    on every call, and a half-precision training step of problem 76 takes
    as long as the host needs to issue it.

    Args:
        x: [M, K], 2-D.
        weight: [N, K], x's dtype and device (under ``torch.autocast``: any
            float dtype, x's device).
        bias: (N,) flat and contiguous, x's dtype and device, or None.
        activation: None or ``"relu"`` (checked here).
        precision: as for :func:`linear` (checked here).

    Returns:
        [M, N], as :func:`linear` returns it.
    """
    return _linear_2d(x, weight, bias, _activation_code(activation), resolve_precision(precision),
                      autocast_dtype())


def _linear_2d(x2: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
               activation: int, precision: str, amp: Optional[torch.dtype]) -> torch.Tensor:
    """The product of checked 2-D operands, under autocast to ``amp`` (the
    autocast dtype) or not; ``precision`` resolved."""
    # Refused here, naming the public op: the cuBLAS routes read the
    # operands' addresses before any FusedOp would refuse it.
    refuse_transforms("linear", x2, weight, bias)
    if amp is not None:
        y = _run_autocast_linear(x2, weight, bias, amp)
        # relu(F.linear(x, weight, bias)) in amp, as the reference
        return y.relu_() if activation else y
    return _run_linear(x2, weight, bias, activation, route(x2.dtype, precision, x2.get_device()))


def _run_linear(x2: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                activation: int, passes: int) -> torch.Tensor:
    """:func:`linear` on operands it (or a caller applying the same rules)
    has already checked: x2 [M, K], weight [N, K], bias (N,) flat or None,
    activation 0 (none) or 1 (ReLU), ``passes`` the route the caller
    decided with :func:`.gemm.route` (:data:`.gemm.CUBLAS`, or the
    tensor-core passes).  Returns [M, N]."""
    grad = needs_grad(x2, weight, bias)
    if passes == CUBLAS:
        keeps = grad and keeps_for_one_use()
        if (activation == 1 and bias is not None and x2.numel() and weight.numel()
                and (not keeps or (x2.requires_grad and weight.requires_grad))):
            # cuBLAS with its bias epilogue and torch's ReLU, no kernel of
            # ours (see "What is fused" in docs/design.md), as one autograd
            # node; backward in torch ops.  A half-precision training step of
            # problem 76 takes less GPU time than the host needs to issue it,
            # so the fewest autograd nodes win.  Where the node keeps its
            # output (keeps_for_one_use), only where x and the weight both
            # need gradients: its second backward through a retained graph
            # recomputes the output from both, so it saves both, where
            # F.linear saves x only for the weight's gradient and the weight
            # only for x's (a frozen weight: no activation kept).  Elsewhere
            # F.linear and relu_ below, the reference's own nodes.
            y = _CUBLAS_RELU.run(grad, x2, weight, bias)
            # Traced, or under saved-tensor hooks, the ReLU's gate is a
            # native node (see _CUBLAS_RELU).
            return y.relu_() if grad and not keeps else y
        if x2.dtype != torch.float32 and is_compiling():
            # Traced, where no address is known: F.linear's product and
            # gradients in the custom op whose implementation checks the
            # operands at run time (_cublas_operand); the operands are their
            # own "casts" (see _LINEAR_AUTOCAST).
            y = _LINEAR_AUTOCAST.run(grad, x2, weight, bias, x2, weight, bias)
        else:
            y = F.linear(_cublas_operand(x2), _cublas_operand(weight), bias)
        return y.relu_() if activation else y  # (the ReLU: native autograd)
    x2 = x2 if x2.is_contiguous() else x2.contiguous()
    weight = weight if weight.is_contiguous() else weight.contiguous()
    if activation == 1 and grad:
        # The GEMM, then bias + ReLU in the bias_relu kernel, which keeps a
        # 1-bit mask for the backward.  With ReLU fused into the GEMM's store
        # the backward would need the float32 output instead, alive until
        # both weight and input gradients are done: one more activation of
        # peak training memory to save one pass over the output.
        z = _LINEAR.run(grad, x2, weight, None, 0, passes)
        return bias_relu(z, bias if bias is not None else z.new_zeros((weight.shape[0],)))
    return _LINEAR.run(grad, x2, weight, bias, activation, passes)
