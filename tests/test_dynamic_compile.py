"""torch.compile(model, fullgraph=True, dynamic=True): one compile serves
every batch size (GPU tier; the validation helpers' part is tested on the
CPU in test_validation.py and test_autograd.py)."""
import pytest
import torch
from torch._dynamo.utils import counters

from cupy_fused import models, ops, reference
from cupy_fused.testing import build_pair, rel_error

pytestmark = pytest.mark.gpu
BATCHES = (5, 9, 17)


def _train_step(model, x, dy):
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    out = model(x)
    out.backward(dy)
    named = [("out", out.detach()), ("x.grad", x.grad)]
    return named + [(f"{n}.grad", p.grad) for n, p in model.named_parameters()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("problem", sorted(models.MODELS))
def test_dynamic_batch_compiles_once(problem, dtype, device):
    _, args, shape = reference.SMALL_PROBLEMS[problem]
    _, ours = build_pair(problem, args, device, dtype)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(ours, fullgraph=True, dynamic=True)
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    for batch in BATCHES:
        x = torch.rand((batch,) + tuple(shape[1:]), device=device, dtype=dtype)
        with torch.no_grad():
            dy = torch.randn_like(ours(x))
        expected = _train_step(ours, x, dy)
        got = _train_step(compiled, x, dy)
        for (name, want), (_, have) in zip(expected, got):
            assert have is not None and have.shape == want.shape, (batch, name)
            assert rel_error(have, want) <= tol, (batch, name, rel_error(have, want))
    # One dynamo graph for all batch sizes: no recompile after the first
    # (dynamic) compile.
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def test_scale_add_dynamic_compiles_once(device):
    """scale_add's op returns one tensor, not a one-tensor tuple, whose
    sizes torch.compile would specialise (a compile per shape)."""
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(lambda x, y: ops.scale_add(x, y, 2.0), fullgraph=True, dynamic=True)
    for batch in BATCHES:
        x = torch.randn(batch, 4, device=device, requires_grad=True)
        y = torch.randn(batch, 4, device=device)
        out = compiled(x, y)
        out.backward(torch.ones_like(out))
        torch.testing.assert_close(out, 2.0 * x.detach() + y)
        assert torch.equal(x.grad, torch.full_like(x, 2.0))
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
