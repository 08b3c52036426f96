"""``bias_relu``: out = relu(z + bias) (+ bias2), per channel — the epilogue of
problem 76 (Linear, +bias, ReLU) and problem 1 (Conv2d with its bias, ReLU,
+bias).  Kernels: ``kernels_cu/bias_relu.cu``.

The forward keeps a 1-bit mask of ``z + bias > 0`` for the backward instead of
z itself (1/32 of the activation in float32).
"""
from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch

from .. import _bridge, _runtime
from .._autograd import FusedOp, is_compiling, needs_grad
from .._validation import FLOAT_DTYPES, check_tensor, check_vector, cxx_type, dense_layout
from ._common import (BLOCK, broadcast_or_dense, call_with_cupy_arrays, cdiv, elementwise_grid,
                      ptr_or_null, reduce_partials, row_chunks)

def _expr(kernel: str, dtype: torch.dtype, second_bias: bool) -> str:
    chain = f"cf::BiasReluChain<{'true' if second_bias else 'false'}>"
    return f"cf::{kernel}<{cxx_type(dtype)}, {chain}>"


# Keyed by (kernel, dtype, second bias present).
KERNELS = _runtime.KernelFamily("bias_relu.cu", {
    (k, d, b): _expr(k, d, b)
    for k in ("bias_relu_forward", "bias_relu_backward_rows", "bias_relu_backward_slabs")
    for d in FLOAT_DTYPES for b in (False, True)
})


def _inner(sizes: List[int], channels_last: bool) -> int:
    """Elements per channel run in memory: 1 for [M, C] and channels-last,
    H*W for NCHW."""
    return 1 if channels_last else math.prod(sizes[2:])


def _is_channels_last(z: torch.Tensor) -> bool:
    return z.dim() == 4 and not z.is_contiguous()


def _forward(z: torch.Tensor, bias: torch.Tensor, bias2: Optional[torch.Tensor],
             save_mask: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty_like(z)  # keeps z's memory format
    total = z.numel()
    words = cdiv(total, 32)
    mask = torch.empty((words if save_mask else 0,), dtype=torch.int32, device=z.device)
    if total:
        dev = z.device.index
        inner = _inner(list(z.shape), _is_channels_last(z))
        fn = KERNELS.get(("bias_relu_forward", z.dtype, bias2 is not None), dev)
        _bridge.launch(fn, (elementwise_grid(words * 32, dev), 1, 1), BLOCK, (
            z.data_ptr(), out.data_ptr(), mask.data_ptr() if save_mask else 0, bias.data_ptr(),
            ptr_or_null(bias2), total, z.shape[1], inner), dev)
    return out, mask


def _forward_fake(z: torch.Tensor, bias: torch.Tensor, bias2: Optional[torch.Tensor],
                  save_mask: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    words = cdiv(z.numel(), 32) if save_mask else 0
    return torch.empty_like(z), z.new_empty((words,), dtype=torch.int32)


def _empty_like_layout(sizes: List[int], channels_last: bool, like: torch.Tensor) -> torch.Tensor:
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    return torch.empty(sizes, dtype=like.dtype, device=like.device, memory_format=fmt)


def _backward(dout: torch.Tensor, mask: torch.Tensor, sizes: List[int], channels_last: bool,
              second_bias: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """Returns (dz, per-channel sums [slots, C]: the gradient of bias, then
    of bias2 when there is one).  The formula takes the rows: outputs of a
    custom op must not alias each other."""
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    dz = _empty_like_layout(sizes, channels_last, dout)
    channels = sizes[1]
    slots = 2 if second_bias else 1
    dev = dout.device.index
    dy, dense = broadcast_or_dense(dout, fmt)
    inner = _inner(sizes, channels_last)
    total = dz.numel()
    if total == 0:
        sums = torch.zeros((slots, channels), dtype=dout.dtype, device=dout.device)
    elif inner == 1:
        rows = total // channels
        grid_x = cdiv(channels, BLOCK)
        chunks, rows_per_chunk = row_chunks(rows, grid_x, dev)
        partial = torch.empty((chunks, slots, channels), dtype=torch.float64, device=dout.device)
        fn = KERNELS.get(("bias_relu_backward_rows", dout.dtype, second_bias), dev)
        _bridge.launch(fn, (grid_x, chunks, 1), BLOCK, (
            dy.data_ptr(), dense, mask.data_ptr(), dz.data_ptr(), partial.data_ptr(), rows,
            channels, rows_per_chunk), dev)
        sums = reduce_partials(partial, dout.dtype)
    else:
        batch = total // (channels * inner)
        partial = torch.empty((batch, slots, channels), dtype=torch.float64, device=dout.device)
        fn = KERNELS.get(("bias_relu_backward_slabs", dout.dtype, second_bias), dev)
        _bridge.launch(fn, (batch * channels, 1, 1), BLOCK, (
            dy.data_ptr(), dense, mask.data_ptr(), dz.data_ptr(), partial.data_ptr(), channels,
            inner), dev)
        sums = reduce_partials(partial, dout.dtype)
    return dz, sums


def _backward_fake(dout: torch.Tensor, mask: torch.Tensor, sizes: List[int], channels_last: bool,
                   second_bias: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    dz = _empty_like_layout(sizes, channels_last, dout)
    return dz, dout.new_empty((2 if second_bias else 1, sizes[1]))


def _setup_context(ctx, inputs, output):
    z, _, bias2, _ = inputs
    ctx.save_for_backward(output[1])
    ctx.sizes = list(z.shape)
    ctx.channels_last = _is_channels_last(z)
    ctx.second_bias = bias2 is not None


def _backward_formula(ctx, grads, run_backward):
    (mask,) = ctx.saved_tensors
    dz, sums = run_backward(grads[0], mask, ctx.sizes, ctx.channels_last, ctx.second_bias)
    if ctx.second_bias:
        dbias, dbias2 = sums.unbind(0)  # rows of one tensor, no copy
        return dz, dbias, dbias2, None
    return dz, sums[0], None, None


_BIAS_RELU = FusedOp("bias_relu", _forward, _forward_fake, _setup_context, _backward_formula,
                     _backward, _backward_fake, nondifferentiable=(1,))


def bias_relu(z: torch.Tensor, bias: torch.Tensor, bias2: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``relu(z + bias) + bias2`` in one pass (``bias2`` optional).

    z: [M, C] (GEMM output) or [N, C, H, W] (conv output, NCHW or
    channels-last; the result keeps z's layout).  bias, bias2: C values each
    (shape (C,) or (C, 1, 1)).  float32/float16/bfloat16, all one dtype; CUDA
    tensors or CuPy arrays.
    """
    if not isinstance(z, torch.Tensor):
        return call_with_cupy_arrays(bias_relu, "z", z, bias, bias2)
    check_tensor("z", z, ndim=(2, 4))
    channels = z.shape[1]
    bias = check_vector("bias", bias, channels, z, "z", optional=False)
    bias2 = check_vector("bias2", bias2, channels, z, "z")
    z = dense_layout(z)
    grad = needs_grad(z, bias, bias2)
    if grad or is_compiling():
        return _BIAS_RELU.run(grad, z, bias, bias2, grad)[0]
    return _forward(z, bias, bias2, False)[0]  # nothing to record: straight to the launch
