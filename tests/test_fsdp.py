"""FSDP2 (``torch.distributed.fsdp.fully_shard``) applied to a fused module as
a whole (GPU tier, world size 1): it trains exactly as the unsharded module.

A fused module is one unit (its forward reads the submodules' parameters
itself), so it is sharded as a whole; FSDP2 gathers its parameters before
the forward and reduces their gradients after the backward.
"""
import copy

import pytest
import torch
import torch.distributed as dist

from cupy_fused import reference
from cupy_fused.testing import build_pair

pytestmark = pytest.mark.gpu

fully_shard = pytest.importorskip("torch.distributed.fsdp").__dict__.get("fully_shard")


@pytest.fixture(scope="module")
def process_group(tmp_path_factory):
    if fully_shard is None:
        pytest.skip("this torch has no torch.distributed.fsdp.fully_shard (FSDP2)")
    if not dist.is_available() or not dist.is_nccl_available():
        pytest.skip("torch.distributed with NCCL is not available")
    store = tmp_path_factory.mktemp("fsdp") / "store"
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1,
                            device_id=torch.device("cuda", torch.cuda.current_device()))
    yield
    dist.destroy_process_group()


def _train(model, xs, g, steps):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    outs = []
    for x in xs[:steps]:
        opt.zero_grad(set_to_none=True)
        y = model(x)
        (y * g).sum().backward()
        opt.step()
        outs.append(y.detach().clone())
    return outs


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("problem", sorted(reference.SMALL_PROBLEMS))
def test_fully_sharded_module_trains_like_the_unsharded_one(problem, dtype, device,
                                                            process_group):
    _, args, shape = reference.SMALL_PROBLEMS[problem]
    _, plain = build_pair(problem, args, device, dtype)
    sharded = copy.deepcopy(plain)
    fully_shard(sharded)
    gen = torch.Generator(device=device).manual_seed(problem)
    xs = [torch.rand(shape, device=device, dtype=dtype, generator=gen) for _ in range(3)]
    with torch.no_grad():
        out_shape = plain(xs[0]).shape
    g = torch.randn(out_shape, device=device, dtype=dtype, generator=gen)
    expected = _train(plain, xs, g, 3)
    got = _train(sharded, xs, g, 3)
    for step, (a, b) in enumerate(zip(expected, got)):
        assert torch.equal(a, b), (step, (a.float() - b.float()).abs().max().item())
    for (name, p), (name2, q) in zip(plain.named_parameters(), sharded.named_parameters()):
        assert name == name2
        assert torch.equal(p.detach(), _full(q.detach())), name
