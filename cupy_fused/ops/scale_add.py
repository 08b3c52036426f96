"""``scale_add``: out = alpha * x + y.  The smallest fused op, used to check
an installation (``python -m cupy_fused``), the runtime and the bridge, and
the op whose per-call host cost ``benchmarks/host_overhead.py`` times."""
from __future__ import annotations

import torch
from torch.autograd import forward_ad as _forward_ad

from .. import _bridge, _runtime
from .._autograd import FusedOp, launches_directly, refuse_jit, refuse_tangents
from .._validation import FLOAT32_MAX, FLOAT_DTYPES, check_finite_scalar, check_pair, cxx_type
from ._common import BLOCK, call_with_cupy_arrays, elementwise_grid

KERNELS = _runtime.KernelFamily("scale_add.cu", {d: f"cf::scale_add<{cxx_type(d)}>" for d in FLOAT_DTYPES})


# (One tensor, not a one-tensor tuple: torch.compile would specialise its
# sizes, compiling again for every shape even with dynamic=True.)
def _forward(x: torch.Tensor, y: torch.Tensor, alpha: float) -> torch.Tensor:
    out = torch.empty_like(x)  # x is contiguous, so out is too
    n = x.numel()
    if n:
        dev = x.get_device()
        _bridge.launch(KERNELS.get(x.dtype, dev), (elementwise_grid(n, dev), 1, 1), BLOCK,
                       (x.data_ptr(), y.data_ptr(), out.data_ptr(), alpha, n), dev)
    return out


def _forward_fake(x: torch.Tensor, y: torch.Tensor, alpha: float) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    ctx.alpha = inputs[2]


def _backward_formula(ctx, grads, run_backward):
    (dout,) = grads
    return dout * ctx.alpha, dout, None


_SCALE_ADD = FusedOp("scale_add", _forward, _forward_fake, _setup_context, _backward_formula)


def scale_add(x: torch.Tensor, y: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """``alpha * x + y`` elementwise in one kernel (arithmetic in float32),
    differentiable in x and y.

    Args:
        x: any shape, float32, float16 or bfloat16 on a CUDA device; or a
            CuPy array (y one too: the result is then a CuPy array).
        y: x's shape, dtype and device.
        alpha: a finite real number, at most float32's largest value
            (about 3.4e38) in magnitude: the kernel takes it as a float32.

    Returns:
        A new contiguous tensor of x's shape and dtype.

    Raises:
        TypeError, ValueError: an argument of another type, dtype, device or
            shape, or an alpha that is not finite or past float32's
            range, before anything runs.
    """
    if not isinstance(x, torch.Tensor):
        return call_with_cupy_arrays(scale_add, "x", x, y, alpha)
    refuse_jit("scale_add")
    check_pair("x", x, "y", y)
    alpha = check_finite_scalar("alpha", alpha, FLOAT32_MAX)
    x = x if x.is_contiguous() else x.contiguous()
    y = y if y.is_contiguous() else y.contiguous()
    if _forward_ad._current_level >= 0:  # a dual level open (forward-mode AD)
        refuse_tangents(x, y)
    # (Not needs_grad: under torch.func.functionalize scale_add's forward is
    # the same with or without a gradient, its backward torch's.)
    grad = torch.is_grad_enabled() and (x.requires_grad or y.requires_grad)
    if grad or not launches_directly():
        return _SCALE_ADD.run(grad, x, y, alpha)
    return _forward(x, y, alpha)  # nothing to record: straight to the launch
