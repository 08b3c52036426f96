"""Double backward (create_graph=True through our backward, e.g. a gradient
penalty) is refused with an error naming the op, never computed wrong: the
backward kernels give first-order gradients with no history.  So is
forward-mode AD, which would drop the input's tangent (GPU tier; the
mechanisms' CPU tests are in test_autograd.py)."""
import importlib

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from cupy_fused import models, reference
from cupy_fused.testing import build_pair

pytestmark = pytest.mark.gpu
DTYPES = [torch.float32, torch.bfloat16]
PROBLEMS = sorted(models.MODELS)
LG = importlib.import_module("cupy_fused.ops.linear_gn_chain")  # the module, not the op
REFUSED = r"cupy_fused::\w+ does not support double backward"


def _model_and_input(problem, dtype, device):
    _, args, shape = reference.SMALL_PROBLEMS[problem]
    _, ours = build_pair(problem, args, device, dtype)
    x = torch.rand(shape, device=device, dtype=dtype, requires_grad=True)
    return ours, x


def _first_order(model, x, dy, create_graph):
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    y = model(x)
    y.backward(dy, create_graph=create_graph)
    grads = [x.grad] + [p.grad for p in model.parameters()]
    assert all(g is not None for g in grads)
    model.zero_grad(set_to_none=True)  # (create_graph: a reference cycle through .grad)
    return [y.detach()] + [g.detach() for g in grads]


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("problem", PROBLEMS)
def test_first_order_training_unchanged_by_create_graph(problem, dtype, device):
    """loss.backward(create_graph=True) with no second derivative taken
    works and gives the gradients of a plain backward."""
    model, x = _model_and_input(problem, dtype, device)
    with torch.no_grad():
        dy = torch.randn_like(model(x))
    expected = _first_order(model, x, dy, create_graph=False)
    got = _first_order(model, x, dy, create_graph=True)
    for i, (a, b) in enumerate(zip(expected, got)):  # the same kernels on the same values
        assert b.dtype == a.dtype and torch.equal(b, a), i


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("problem", PROBLEMS)
def test_gradient_penalty_is_refused(problem, dtype, device):
    model, x = _model_and_input(problem, dtype, device)
    y = model(x)
    (g,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
    # Without the refusal g either has no history (the penalty then adds
    # nothing to any gradient) or only the history of torch ops around our
    # op (the penalty's gradients then miss our op's second-order terms).
    assert g.requires_grad
    with pytest.raises(RuntimeError, match=REFUSED):
        (y.sum() + g.square().sum()).backward()

    # With a constant incoming gradient the second-order terms come from the
    # weights our backward reads: a penalty differentiated with respect to
    # the parameters only reaches the refusal too (not "not used in the
    # graph", nor None with allow_unused).  (Problem 1: the convolution's
    # backward, an op of ours too.)
    model.zero_grad(set_to_none=True)
    y = model(x)
    (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match=REFUSED):
        torch.autograd.grad(g.square().sum(), list(model.parameters()), allow_unused=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("problem", PROBLEMS)
def test_gradient_penalty_is_refused_when_compiled(problem, dtype, device):
    """Compiled, the region's backward is AOTAutograd's, which refuses double
    backward itself: "torch.compile with aot_autograd does not currently
    support double backward", or, where its backward donates buffers, that
    it "requires create_graph=False"."""
    model, x = _model_and_input(problem, dtype, device)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    with pytest.raises(RuntimeError, match="double backward|requires create_graph=False"):
        y = compiled(x)
        (g,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
        (y.sum() + g.square().sum()).backward()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("problem", PROBLEMS)
def test_forward_mode_ad_is_refused(problem, dtype, device, launches):
    """A dual input (torch.autograd.forward_ad): a RuntimeError before
    anything runs, where the output's tangent would otherwise be dropped."""
    import torch.autograd.forward_ad as fwAD

    model, x = _model_and_input(problem, dtype, device)
    launches.clear()
    with fwAD.dual_level():
        dual = fwAD.make_dual(x.detach(), torch.ones_like(x))
        with pytest.raises(RuntimeError, match="do not support forward-mode AD"):
            model(dual)
    assert not launches


def _freeze_linear_weight(model):
    next(m for m in model.modules() if isinstance(m, torch.nn.Linear)).weight.requires_grad_(False)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
@pytest.mark.parametrize("case", ["frozen-weight", "autocast", "checkpoint"])
@pytest.mark.parametrize("problem", PROBLEMS)
def test_gradient_penalty_is_refused_in_other_settings(problem, case, device, monkeypatch):
    """test_gradient_penalty_is_refused's penalty from a constant incoming
    gradient, where a node saves less: the linear layer's weight frozen in
    bfloat16 (x is then not saved; 37, 88 and 94, whose gradients are
    functions of x through the chain), under autocast (the products save
    casts with no history) and under torch.utils.checkpoint's non-reentrant
    mode (saved-tensor hooks); 37, 88 and 94 on their one-launch op where
    the GPU has it.  Refused, with respect to x and the parameters; a
    create_graph backward gives the plain backward's gradients."""
    if case == "frozen-weight" and problem in (1, 76):
        pytest.skip("x's gradient is piecewise linear in x there (relu), as in the reference")
    monkeypatch.setattr(LG, "fusion_pays", lambda *shape: True)
    dtype = torch.bfloat16 if case == "frozen-weight" else torch.float32
    model, x = _model_and_input(problem, dtype, device)
    if case == "frozen-weight":
        _freeze_linear_weight(model)

    def forward(xx):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=case == "autocast"):
            if case == "checkpoint":
                return checkpoint(model, xx, use_reentrant=False)
            return model(xx)

    xx = x.detach().clone().requires_grad_(True)
    (g,) = torch.autograd.grad(forward(xx).sum(), xx, create_graph=True)
    trained = [p for p in model.parameters() if p.requires_grad]
    with pytest.raises(RuntimeError, match=REFUSED):
        torch.autograd.grad(g.square().sum(), [xx] + trained, allow_unused=True)
    with torch.no_grad():
        dy = torch.randn_like(forward(x).float())
    results = []
    for create_graph in (False, True):
        model.zero_grad(set_to_none=True)
        xx = x.detach().clone().requires_grad_(True)
        y = forward(xx)
        y.backward(dy.to(y.dtype), create_graph=create_graph)
        results.append([xx.grad.detach()] + [p.grad.detach() for p in trained])
        model.zero_grad(set_to_none=True)
    for i, (a, b) in enumerate(zip(*results)):  # the same kernels on the same values
        assert b.dtype == a.dtype and torch.equal(b, a), i
