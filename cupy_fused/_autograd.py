"""Autograd glue, in one place: turns a fused op's forward/backward kernels
into something PyTorch can differentiate, compile and capture.

Each :class:`FusedOp` exists twice, sharing the same Python functions:

* as ``torch.library`` custom ops ``cupy_fused::<name>`` and
  ``cupy_fused::<name>_backward`` (torch >= 2.4: ``custom_op`` +
  ``register_fake`` + ``register_autograd``), so ``torch.compile(fullgraph=True)``
  traces through it with no graph break;
* as a plain ``torch.autograd.Function`` for eager calls (and the only path on
  torch < 2.4).  The dispatcher machinery of a custom op costs several
  microseconds per call; eager mode does not need it, so eager calls skip it.

Both paths launch the same kernels on the current torch stream with outputs
allocated by torch, so CUDA-graph capture works on either.  When no input
needs a gradient (or under ``torch.no_grad()``) the forward runs directly and
saves nothing.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

NAMESPACE = "cupy_fused"
HAS_CUSTOM_OP = hasattr(torch.library, "custom_op") and hasattr(torch.library, "register_autograd")


def _compiler_is_compiling() -> Callable[[], bool]:
    compiler = getattr(torch, "compiler", None)
    if compiler is not None and hasattr(compiler, "is_compiling"):
        return compiler.is_compiling
    try:  # pragma: no cover - torch < 2.3
        from torch._dynamo import is_compiling

        return is_compiling
    except ImportError:  # pragma: no cover
        return lambda: False


is_compiling = _compiler_is_compiling()


def needs_grad(*tensors: Optional[torch.Tensor]) -> bool:
    """True when autograd will record a graph for these inputs."""
    if torch.is_grad_enabled():
        for t in tensors:  # a loop, not any(<generator>): half the host time
            if t is not None and t.requires_grad:
                return True
    return False


class FusedOp:
    """One fused operation with a custom backward.

    Args:
        name: op name (``cupy_fused::<name>``).
        forward: ``forward(*inputs) -> tuple[Tensor, ...]``, fully type-annotated
            (the custom-op schema is inferred from the annotations).
        forward_fake: same signature, returns empty tensors of the right
            shapes/dtypes (for tracing).
        setup_context: ``setup_context(ctx, inputs, output)`` saves what the
            backward needs.
        backward_formula: ``backward_formula(ctx, grad_outputs, run_backward)``
            returns one gradient (or None) per input; ``run_backward`` is the
            backward kernel (``backward`` below, or its custom op).
        backward / backward_fake: the backward kernel launcher and its fake,
            annotated like ``forward``.  May be None when the formula uses
            torch ops only.
        nondifferentiable: indices of outputs that carry no gradient (saved
            statistics, masks).
    """

    def __init__(self, name: str, forward: Callable, forward_fake: Callable,
                 setup_context: Callable, backward_formula: Callable,
                 backward: Optional[Callable] = None, backward_fake: Optional[Callable] = None,
                 nondifferentiable: Sequence[int] = ()):
        self.name = name
        self.forward = forward
        self.backward = backward
        self._formula = backward_formula
        self._setup_context = setup_context
        self._nondiff = tuple(nondifferentiable)
        self.op = None
        self.backward_op = None
        if HAS_CUSTOM_OP:
            self.op = torch.library.custom_op(f"{NAMESPACE}::{name}", forward, mutates_args=())
            self.op.register_fake(forward_fake)
            run = None
            if backward is not None:
                self.backward_op = torch.library.custom_op(
                    f"{NAMESPACE}::{name}_backward", backward, mutates_args=())
                self.backward_op.register_fake(backward_fake)
                run = self.backward_op
            self.op.register_autograd(
                lambda ctx, *grads: backward_formula(ctx, grads, run),
                setup_context=setup_context,
            )
        self._function = self._make_function()

    def _make_function(self):
        op = self

        class Function(torch.autograd.Function):
            @staticmethod
            def forward(ctx, *inputs):
                outputs = op.forward(*inputs)
                op._setup_context(ctx, inputs, outputs)
                if op._nondiff:
                    ctx.mark_non_differentiable(*(outputs[i] for i in op._nondiff))
                return outputs

            @staticmethod
            def backward(ctx, *grads):
                return tuple(op._formula(ctx, grads, op.backward))

        Function.__name__ = Function.__qualname__ = f"{self.name}_function"
        return Function

    def run(self, requires_grad: bool, *inputs):
        """Runs the op on ``inputs``.  ``requires_grad``: whether autograd
        must record it (callers compute it with :func:`needs_grad`).  (A
        plain method with positional arguments: calling the instance with a
        keyword costs twice as much host time, on every op call.)

        The elementwise ops, whose whole cost on a small tensor is host time,
        call ``forward`` themselves when there is no graph to record and
        nothing is tracing (``not requires_grad and not is_compiling()``),
        which is what this method would do one Python call later."""
        if self.op is not None and is_compiling():
            return self.op(*inputs)
        if requires_grad:
            return self._function.apply(*inputs)
        return self.forward(*inputs)
