"""The autograd glue (cupy_fused._autograd) on its own: CPU tier, with torch
ops standing in for kernels."""
from typing import Tuple

import pytest
import torch

from cupy_fused._autograd import FusedOp


def _forward(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    return x * 3, x.sum(1)


def _forward_fake(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), x.new_empty((x.shape[0],))


received = []


def _setup_context(ctx, inputs, output):
    pass


def _formula(ctx, grads, run_backward):
    received.append(grads)
    return (grads[0] * 3,)


_TWO_OUTPUTS = FusedOp("test_autograd_two_outputs", _forward, _forward_fake, _setup_context,
                       _formula, nondifferentiable=(1,))


def test_nondifferentiable_outputs_get_no_materialised_gradient():
    """The eager node hands the formula None for an output that carries no
    gradient, not a tensor of zeros allocated and filled per backward."""
    x = torch.rand(5, 4, requires_grad=True)
    out, row_sums = _TWO_OUTPUTS.run(True, x)
    assert not row_sums.requires_grad
    received.clear()
    out.sum().backward()
    (grads,) = received
    assert grads[1] is None and grads[0].shape == (5, 4)
    assert torch.equal(x.grad, torch.full((5, 4), 3.0))


def _scale_forward(x: torch.Tensor, scale: float) -> torch.Tensor:
    return x * scale


def _scale_fake(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.empty_like(x)


def _scale_setup_context(ctx, inputs, output):
    ctx.scale = inputs[1]


def _scale_formula(ctx, grads, run_backward):
    return grads[0] * ctx.scale, None


_SCALE = FusedOp("test_autograd_scale", _scale_forward, _scale_fake, _scale_setup_context,
                 _scale_formula)


def test_direct_apply_records_the_same_node():
    """run() skips torch's Python Function.apply wrapper: the node and the
    gradients are those of Function.apply."""
    assert _SCALE._tensor_args == (0,)
    x = torch.rand(3, 4, dtype=torch.float64, requires_grad=True)
    y = _SCALE.run(True, x, 2.5)
    z = _SCALE._function.apply(x, 2.5)
    assert type(y.grad_fn) is type(z.grad_fn)
    assert torch.equal(y, z)
    (gy,) = torch.autograd.grad(y.sum(), x)
    (gz,) = torch.autograd.grad(z.sum(), x)
    assert torch.equal(gy, gz) and torch.equal(gy, torch.full_like(x, 2.5))


def test_torch_func_transforms_and_their_dead_wrappers():
    """Under a torch.func transform run() goes through Function.apply, which
    refuses the eager Function (it defines no setup_context staticmethod)
    rather than letting the transform see an opaque op; a tensor that
    escaped a finished transform (a dead wrapper) is unwrapped before the
    forward sees it, as Function.apply would."""
    x = torch.rand(5, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.grad(lambda t: _SCALE.run(True, t, 3.0).sum())(x)

    leaked = []

    def f(t):
        leaked.append(t)
        return t.sin().sum()

    torch.func.grad(f)(x)
    (dead,) = leaked
    assert torch._C._functorch.is_functorch_wrapped_tensor(dead)
    y = _SCALE.run(True, dead, 2.0)
    expected = _SCALE._function.apply(dead, 2.0)
    assert not torch._C._functorch.is_functorch_wrapped_tensor(y)
    assert torch.equal(y, 2.0 * x)
    # Unwrapped, the dead wrapper is x, which requires no gradient: no node.
    assert y.requires_grad == expected.requires_grad == False  # noqa: E712
