"""The scale_add op (kernels_cu/scale_add.cu) against torch (GPU tier); its
validation is in test_validation.py, its property tests in
test_properties.py."""
import pytest
import torch

from cupy_fused import ops
from cupy_fused.testing import poison_allocator

pytestmark = pytest.mark.gpu
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_torch(device, dtype):
    x = torch.randn(1001, 37, device=device, dtype=dtype)
    y = torch.randn_like(x)
    poison_allocator(device, x.numel() * 4)
    out = ops.scale_add(x, y, 0.75)
    truth = 0.75 * x.double() + y.double()
    mine = (out.double() - truth).abs().max().item()
    theirs = ((0.75 * x + y).double() - truth).abs().max().item()
    assert not torch.isnan(out).any()
    assert mine <= theirs + torch.finfo(dtype).eps * truth.abs().max().item()


def test_empty_and_noncontiguous(device):
    e = torch.empty(0, 3, device=device)
    assert ops.scale_add(e, e).shape == (0, 3)
    x = torch.randn(64, 48, device=device).t()
    y = torch.randn(48, 64, device=device)
    torch.testing.assert_close(ops.scale_add(x, y, 2.0), 2.0 * x + y, rtol=1e-6, atol=1e-6)


def test_autograd(device):
    x = torch.randn(5, 7, device=device, requires_grad=True)
    y = torch.randn(5, 7, device=device, requires_grad=True)
    g = torch.randn(5, 7, device=device)
    ops.scale_add(x, y, -3.0).backward(g)
    torch.testing.assert_close(x.grad, -3.0 * g)
    torch.testing.assert_close(y.grad, g)
