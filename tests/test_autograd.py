"""The autograd glue (cupy_fused._autograd) on its own: CPU tier, with torch
ops standing in for kernels."""
from typing import Tuple

import pytest
import torch

from cupy_fused._autograd import FusedOp, check_unchanged, needs_grad, version_of


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
    """Under torch.func's gradient transforms run() refuses the op, naming
    it (Function.apply would refuse the eager Function, which defines no
    setup_context staticmethod, naming none), rather than letting the
    transform see an opaque op; a tensor that escaped a finished transform
    (a dead wrapper) is unwrapped before the forward sees it, as
    Function.apply would."""
    x = torch.rand(5, dtype=torch.float64)
    message = r"cupy_fused::test_autograd_scale does not support torch.func's gradient transforms"
    with pytest.raises(RuntimeError, match=message):
        torch.func.grad(lambda t: _SCALE.run(True, t, 3.0).sum())(x)
    with pytest.raises(RuntimeError, match=message):
        torch.func.vjp(lambda t: _SCALE.run(True, t, 3.0), x)

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


def test_direct_apply_needs_every_feature_it_relies_on(monkeypatch):
    """The C++ apply is used only where this torch has the transform check,
    the dead-wrapper unwrapping and the C++ base class; each one missing,
    run() falls back to Function.apply."""
    from cupy_fused import _autograd

    function = _SCALE._function
    assert _autograd._direct_apply(function) is not None  # this torch has them all
    assert _SCALE._c_apply is not None
    for name in ("_transforms_active", "_unwrap_if_dead", "_FunctionBase"):
        with monkeypatch.context() as m:
            m.setattr(_autograd, name, None)
            assert _autograd._direct_apply(function) is None, name

    class WithSetupContext(torch.autograd.Function):  # Function.apply binds its defaults
        @staticmethod
        def forward(x):
            return x

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

    assert _autograd._direct_apply(WithSetupContext) is None


@pytest.mark.parametrize("path", ["direct", "Function.apply"])
def test_run_gives_the_same_results_with_or_without_the_direct_apply(path, monkeypatch):
    """Both branches of run(): the C++ apply (where this torch allows it)
    and the fallback through Function.apply give the same node, output and
    gradient, unwrap a dead functorch wrapper, and refuse a torch.func
    transform."""
    if path == "Function.apply":
        monkeypatch.setattr(_SCALE, "_c_apply", None)
        calls = []
        apply = _SCALE._function.apply
        monkeypatch.setattr(_SCALE._function, "apply",
                            lambda *a: calls.append(1) or apply(*a))
    x = torch.rand(3, 4, dtype=torch.float64, requires_grad=True)
    y = _SCALE.run(True, x, 2.5)
    assert type(y.grad_fn) is _SCALE._function._backward_cls
    assert torch.equal(y, 2.5 * x.detach())
    (gy,) = torch.autograd.grad(y.sum(), x)
    assert torch.equal(gy, torch.full_like(x, 2.5))
    if path == "Function.apply":
        assert calls == [1]

    leaked = []
    torch.func.grad(lambda t: leaked.append(t) or t.sin().sum())(x.detach())
    (dead,) = leaked
    y = _SCALE.run(True, dead, 2.0)
    assert not torch._C._functorch.is_functorch_wrapped_tensor(y)
    assert torch.equal(y, 2.0 * x.detach())
    with pytest.raises(RuntimeError, match="does not support torch.func's gradient transforms"):
        torch.func.grad(lambda t: _SCALE.run(True, t, 3.0).sum())(x.detach())


def test_functionalize_hands_the_forward_real_tensors():
    """Under torch.func.functionalize a tensor has no memory of its own
    (data_ptr() 0, a null pointer to a kernel): run() records the custom op,
    whose functionalization hands the forward the real tensors, with or
    without a gradient to record."""
    seen = []

    def forward(x: torch.Tensor, scale: float) -> torch.Tensor:
        seen.append((torch._C._functorch.is_functionaltensor(x), x.data_ptr()))
        return x * scale

    op = FusedOp("test_autograd_functionalize", forward, _scale_fake, _scale_setup_context,
                 _scale_formula)
    x = torch.rand(3, 4, dtype=torch.float64)
    y = torch.func.functionalize(lambda t: op.run(False, t, 2.0))(x)
    assert torch.equal(y, 2.0 * x)
    xg = x.clone().requires_grad_(True)
    y = torch.func.functionalize(lambda t: op.run(True, t, 2.0))(xg)
    assert torch.equal(y.detach(), 2.0 * x)
    y.sum().backward()
    assert torch.equal(xg.grad, torch.full_like(x, 2.0))
    assert len(seen) == 2 and all(not functional and ptr != 0 for functional, ptr in seen)
    # Outside the transform the forward still gets the caller's tensors.
    seen.clear()
    op.run(False, x, 2.0)
    assert seen == [(False, x.data_ptr())]


# ---------------------------------------------------------------- double backward
# Torch ops stand in for the kernels; the backward's results are detached, as
# a kernel's are (they record no graph).

def _mul_forward(x: torch.Tensor, w: torch.Tensor, eps: float) -> Tuple[torch.Tensor, torch.Tensor]:
    return x * w + eps, x.sum(1)


def _mul_fake(x: torch.Tensor, w: torch.Tensor, eps: float) -> Tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), x.new_empty((x.shape[0],))


def _mul_backward(dout: torch.Tensor, x: torch.Tensor,
                  w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    return (dout * w).detach(), (dout * x).sum(0).detach()


def _mul_backward_fake(dout: torch.Tensor, x: torch.Tensor,
                       w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(w)


def _mul_setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1])


def _mul_formula(ctx, grads, run_backward):
    x, w = ctx.saved_tensors
    dx, dw = run_backward(grads[0], x, w)
    return dx, dw, None


_MUL = FusedOp("test_autograd_mul", _mul_forward, _mul_fake, _mul_setup_context, _mul_formula,
               _mul_backward, _mul_backward_fake, nondifferentiable=(1,))

REFUSED = r"cupy_fused::test_autograd_mul does not support double backward"
PATHS = {
    "eager": lambda x, w: _MUL.run(True, x, w, 0.5)[0],       # the autograd.Function
    "custom_op": lambda x, w: _MUL.op(x, w, 0.5)[0],          # torch.library, called directly
}


def _leaves():
    gen = torch.Generator().manual_seed(0)
    return (torch.rand(5, 4, generator=gen, dtype=torch.float64).requires_grad_(True),
            torch.rand(4, generator=gen, dtype=torch.float64).requires_grad_(True))


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("create_graph", [False, True])
def test_first_order_backward_with_or_without_create_graph(path, create_graph):
    """create_graph=True with no second derivative taken works, and gives
    the first-order gradients unchanged."""
    x, w = _leaves()
    y = PATHS[path](x, w)
    dy = torch.rand_like(y)
    y.backward(dy, create_graph=create_graph)
    assert torch.equal(x.grad, dy * w.detach())
    assert torch.equal(w.grad, (dy * x.detach()).sum(0))
    assert x.grad.requires_grad == w.grad.requires_grad == create_graph
    x.grad = w.grad = None  # (create_graph: a reference cycle through .grad)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_gradient_penalty_is_refused(path):
    x, w = _leaves()
    y = PATHS[path](x, w)
    (g,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
    assert g.requires_grad
    assert torch.equal(g.detach(), 2 * y.detach() * w.detach())
    with pytest.raises(RuntimeError, match=REFUSED):
        (y.sum() + g.square().sum()).backward()


@pytest.mark.parametrize("path", sorted(PATHS))
def test_refused_when_only_a_saved_input_carries_the_second_order_term(path):
    """The gradient of y.sum() (a constant incoming gradient) with respect
    to x is w: once_differentiable would leave it without history, and a
    penalty on it would silently lose its gradient with respect to w."""
    x, w = _leaves()
    y = PATHS[path](x, w)
    (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    assert g.requires_grad
    with pytest.raises(RuntimeError, match=REFUSED):
        (y.sum() + g.square().sum()).backward()
    with pytest.raises(RuntimeError, match=REFUSED):
        torch.autograd.grad(g.sum(), w)


def test_double_backward_is_refused_under_compile():
    """Compiled (AOTAutograd, as inductor uses), the region's backward
    refuses double backward itself, with torch's message; first-order
    training is unchanged."""
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, w: _MUL.run(True, x, w, 0.5)[0], fullgraph=True,
                             backend="aot_eager")
    x, w = _leaves()
    y = compiled(x, w)
    y.backward(torch.ones_like(y))
    assert torch.equal(x.grad, w.detach().expand(5, 4))
    assert torch.equal(w.grad, x.detach().sum(0))
    x, w = _leaves()
    y = compiled(x, w)
    (g,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        (y.sum() + g.square().sum()).backward()


def test_dynamic_shapes_compile_once():
    """torch.compile(dynamic=True): the validation helpers trace with a
    GroupNorm's eps (a SymFloat there) and num_groups, and the custom op's
    batch dimension stays symbolic: one graph for every batch size."""
    from torch._dynamo.utils import counters

    from cupy_fused._validation import check_eps, check_groups

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.rand(4, dtype=torch.float64))
            self.group_norm = torch.nn.GroupNorm(2, 4)

        def forward(self, x):
            gn = self.group_norm
            groups = check_groups(gn.num_groups, self.w.shape[0])
            eps = check_eps(gn.eps)
            return _MUL.run(True, x, self.w, eps)[0] * groups

    model = Model()
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend="aot_eager")
    for batch in (5, 9, 17):
        x = torch.rand(batch, 4, dtype=torch.float64, requires_grad=True)
        y = compiled(x)
        torch.testing.assert_close(y, model(x))
        y.sum().backward()
        torch.testing.assert_close(x.grad, 2 * model.w.detach().expand(batch, 4))
    assert counters["stats"]["unique_graphs"] == 1


def test_a_kept_tensor_changed_in_place_is_refused_as_autograd_refuses():
    """version_of / check_unchanged, the check of the tensors a node keeps
    without saving them: a change in place raises autograd's message; None
    and inference tensors (no version counter; no change in place outside
    inference mode) have no version and pass."""
    t = torch.ones(3)
    version = version_of(t)
    check_unchanged(t, version, "t")
    t.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation: t is at version"):
        check_unchanged(t, version, "t")
    with torch.inference_mode():
        frozen = torch.ones(3)
    assert version_of(frozen) is None and version_of(None) is None
    check_unchanged(frozen, None, "frozen")
    with pytest.raises(RuntimeError):
        frozen.add_(1)  # (torch refuses it outside inference mode)


def test_forward_mode_tangents_are_refused():
    """needs_grad, which every op asks before it launches: an input with a
    forward-mode tangent is refused (the ops would drop it); inside a dual
    level, inputs without one pass."""
    import torch.autograd.forward_ad as fwAD

    x, y = torch.rand(3), torch.rand(3, requires_grad=True)
    with fwAD.dual_level():
        assert needs_grad(x, None, y) and not needs_grad(x)
        dual = fwAD.make_dual(x, torch.ones(3))
        with pytest.raises(RuntimeError, match="do not support forward-mode AD"):
            needs_grad(y, dual)
        with torch.no_grad(), pytest.raises(RuntimeError, match="do not support forward-mode AD"):
            needs_grad(dual)
    assert not needs_grad(x)


def test_vmap_is_refused_naming_the_op():
    """Under torch.vmap the ops would take a batched tensor's data pointer,
    which it does not have: run() refuses it first, naming the op, with or
    without a gradient to record."""
    x = torch.rand(4, 5, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=f"{_SCALE.name} does not support torch.vmap"):
        torch.vmap(lambda t: _SCALE.run(False, t, 3.0))(x)
    with pytest.raises(RuntimeError, match=f"{_SCALE.name} does not support torch.vmap"):
        torch.vmap(lambda t: _SCALE.run(True, t, 3.0))(x.requires_grad_(True))


def _reads_memory_formula(ctx, grads, run_backward):
    grads[0].data_ptr()  # (as a kernel's launch takes it)
    return grads[0] * ctx.scale, None


_READS_MEMORY = FusedOp("test_autograd_reads_memory", _scale_forward, _scale_fake,
                        _scale_setup_context, _reads_memory_formula)


def test_a_batch_of_gradients_is_refused_naming_the_op_where_a_kernel_reads_it():
    """torch.autograd.grad(..., is_grads_batched=True) hands each backward
    a batch of gradients with no memory of its own: where the formula reads
    it (a kernel's launch), the error names the op and the way out; a
    formula of torch ops takes the batch."""
    x = torch.rand(4, 5, requires_grad=True)
    batch = torch.rand(3, 4, 5)
    with pytest.raises(RuntimeError, match=f"cupy_fused::{_READS_MEMORY.name} cannot take a "
                                           r"batch of gradients.*vectorize=False"):
        torch.autograd.grad(_READS_MEMORY.run(True, x, 2.0), x, batch, is_grads_batched=True)
    (grad,) = torch.autograd.grad(_SCALE.run(True, x, 2.0), x, batch, is_grads_batched=True)
    assert torch.equal(grad, batch * 2.0)
    (grad,) = torch.autograd.grad(_READS_MEMORY.run(True, x, 2.0), x, batch[0])
    assert torch.equal(grad, batch[0] * 2.0)


def test_importing_the_package_leaves_dynamo_unimported():
    """``import cupy_fused`` does not import TorchDynamo (about a second of
    import time): the constant-result mark of problem 1's precision read
    is set without it, as torch.compiler's decorator sets it."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import importlib, sys, torch, cupy_fused\n"
            "C = importlib.import_module('cupy_fused.ops.conv_bias_relu')\n"
            "print('torch._dynamo' in sys.modules, C._conv_fp32_precision_apart._dynamo_marked_constant)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=str(Path(__file__).resolve().parents[1]))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True"]

    def f():
        return 0

    torch.compiler.assume_constant_result(f)
    assert vars(f) == {"_dynamo_marked_constant": True}  # the mark torch's decorator sets
