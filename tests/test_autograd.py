"""The autograd glue (cupy_fused._autograd) on its own: CPU tier, with torch
ops standing in for kernels."""
from typing import Tuple

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
