"""Functional ops on their own (GPU tier)."""
import pytest
import torch

from cupy_fused import ops

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("chain", sorted(ops.CHAINS))
def test_linear_bias_inside_the_kernel_or_already_in_z(chain, device):
    """Both ways of handling the linear bias give the same output and the same
    gradients (z's gradient is the same since dz/d(z + b) = dz/dz)."""
    torch.manual_seed(0)
    rows, channels, groups = 37, 96, 6
    z = torch.randn(rows, channels, device=device, dtype=torch.float64).float()
    vecs = {k: torch.randn(channels, device=device) for k in
            ("lin_bias", "extra_bias", "gn_weight", "gn_bias", "mul_weight")}
    if ops.CHAINS[chain].mul_weight is None:
        vecs["mul_weight"] = None
    if ops.CHAINS[chain].extra_bias is None:
        vecs["extra_bias"] = None
    dy = torch.randn(rows, channels, device=device)

    def run(in_z):
        leaves = {k: v.clone().requires_grad_(True) for k, v in vecs.items() if v is not None}
        zz = z.clone().requires_grad_(True)
        z_in = zz + leaves["lin_bias"].detach() if in_z else zz
        out = ops.gn_chain(z_in, chain, groups, linear_bias_in_z=in_z, **{
            k: leaves.get(k) for k in vecs})
        out.backward(dy)
        return [out, zz.grad] + [leaves[k].grad for k in sorted(leaves)]

    for a, b in zip(run(False), run(True)):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5)


def test_zero_size_inputs(device):
    z = torch.empty(0, 64, device=device, requires_grad=True)
    b = torch.randn(64, device=device, requires_grad=True)
    out = ops.bias_relu(z, b)
    out.sum().backward()
    assert out.shape == (0, 64) and b.grad.shape == (64,) and not b.grad.any()
    w = torch.randn(64, device=device, requires_grad=True)
    out = ops.group_norm_swish_multiply_swish(z, b, None, None, w, 8)
    out.sum().backward()
    assert out.shape == (0, 64) and not w.grad.any()
