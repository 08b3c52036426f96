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

An op may give the eager path a setup of its own (``eager_setup_context``)
for what only eager autograd allows: :func:`keep_output`, an output kept
for one use by the backward and dropped as soon as the backward takes it,
where a saved tensor would live until the backward has returned.  Such a
kept tensor is no saved tensor, so saved-tensor hooks would not see it:
where hooks are active (``torch.utils.checkpoint``'s non-reentrant mode,
``torch.autograd.graph.save_on_cpu``), the eager path takes the op's
traced setup instead, which saves everything (:func:`keeps_for_one_use`).

A route with no gradient to record that eager calls launch directly, but
that a traced graph must call as an op of its own, is an
:func:`inference_op`.

Both paths are differentiable once: the backward kernels compute first-order
gradients and record no graph.  A backward run with ``create_graph=True``
returns gradients whose node raises, naming the op, if anything
differentiates through them (:func:`first_order_only`).
"""
from __future__ import annotations

import contextlib
import inspect
import sys
import typing
from typing import Callable, Optional, Sequence, Tuple

import torch
from torch.autograd import forward_ad as _forward_ad

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
# Whether TorchDynamo is tracing (torch >= 2.5): torch.compile, or a strict
# torch.export.
_dynamo_compiling = getattr(getattr(torch, "compiler", None), "is_dynamo_compiling", None)


def is_exporting() -> bool:
    """Whether torch.export is tracing: the flag that torch >= 2.5 sets for
    it, read itself (False on a torch without it).  Not
    torch.compiler.is_exporting(): where TorchDynamo traces a call of it,
    torch 2.11 answers True under torch.compile too."""
    return bool(getattr(getattr(torch, "compiler", None), "_is_exporting_flag", False))


def _shape_env(tensors):
    """The ShapeEnv of the first symbolic size among ``tensors``' sizes, or
    None where every size is a plain int."""
    for t in tensors:
        if t is None:
            continue
        for s in t.shape:
            if isinstance(s, torch.SymInt):
                return s.node.shape_env
    return None


_Result = typing.TypeVar("_Result")


def on_example_sizes(rule: Callable[[], _Result], *tensors: Optional[torch.Tensor]) -> _Result:
    """``rule()``, an op's routing rule on the sizes of ``tensors`` (which
    kernel pays at which size).  While torch.export traces them with
    symbolic sizes (its default, non-strict tracing), the rule reads the
    example inputs' sizes and records no guard: an exported program serves
    its whole range of sizes, where a guard would narrow that range to one
    side of the rule's threshold (export then refuses a range that crosses
    one).  The program takes the routes of the example's sizes at every
    size, so only rules on speed belong here, between routes that are each
    correct at any size.  Elsewhere (eager; torch.compile, whose guards
    recompile a graph where a size crosses a threshold; a strict export,
    traced by TorchDynamo, which keeps its guards) it is ``rule()``.  A
    symbolic value in what the rule returns is made a Python one here,
    where no guard is recorded."""
    if not is_exporting() or (_dynamo_compiling is not None and _dynamo_compiling()):
        return rule()
    env = _shape_env(tensors)
    if env is None:
        return rule()
    from torch.utils._pytree import tree_map

    def concrete(v):
        return bool(v) if isinstance(v, torch.SymBool) else int(v) if isinstance(v, torch.SymInt) else v

    with env.suppress_guards():
        return tree_map(concrete, rule())


def assume_constant_result(fn: Callable) -> Callable:
    """A decorator for a function that torch.compile calls when it traces
    (not traced: e.g. one that reads attributes dynamo cannot), taking its
    result as a constant, with no guard.  It marks ``fn`` as
    ``torch.compiler.assume_constant_result`` does, but without importing
    TorchDynamo, which that call does (about a second of every import of
    cupy_fused, in a program that never compiles); a CPU test holds the
    mark to torch's own.  The identity on a torch without it."""
    mark = getattr(getattr(torch, "compiler", None), "assume_constant_result", None)
    if mark is None:
        return fn
    if "torch._dynamo" in sys.modules:
        return mark(fn)
    fn._dynamo_marked_constant = True
    return fn

# What torch.autograd.Function.apply checks and does before its C++ apply
# (see FusedOp.run): whether a torch.func transform is active, and the
# unwrapping of dead functorch wrappers (tensors that escaped a finished
# transform, e.g. the results of torch.func.vjp's vjp_fn).  Private torch
# APIs, looked up, not assumed: where one is missing, FusedOp.run calls
# Function.apply (see _direct_apply).
_functorch = getattr(torch._C, "_functorch", None)
_transforms_active = getattr(torch._C, "_are_functorch_transforms_active", None)
_unwrap_if_dead = getattr(_functorch, "unwrap_if_dead", None)
_is_functional_tensor = getattr(_functorch, "is_functionaltensor", None)
_is_batched = getattr(_functorch, "is_batchedtensor", None)
# The batches of gradients of torch.autograd.grad(..., is_grads_batched=True).
_is_legacy_batched = getattr(_functorch, "is_legacy_batchedtensor", None)
_is_grad_tracking = getattr(_functorch, "is_gradtrackingtensor", None)
_FunctionBase = getattr(torch._C, "_FunctionBase", None)


def launches_directly() -> bool:
    """Whether an op may launch its kernels from Python on the tensors it
    was given: not while torch.compile traces (fake tensors), nor under a
    torch.func transform (functorch's wrappers; functionalize's have no
    memory of their own, data_ptr() 0).  Where not, the op goes through
    :meth:`FusedOp.run`, which records its custom op or refuses."""
    return not is_compiling() and not (_transforms_active is not None and _transforms_active())


def _functionalized(inputs) -> bool:
    """Whether any of ``inputs`` (under an active torch.func transform) is a
    tensor of torch.func.functionalize, whose memory the kernels cannot see
    (only its custom op, which functionalization unwraps, can run on it)."""
    if _is_functional_tensor is None:  # this torch cannot tell: assume the worst
        return True
    return any(isinstance(t, torch.Tensor) and _is_functional_tensor(t) for t in inputs)


def _vmapped(inputs) -> bool:
    """Whether any of ``inputs`` (under an active torch.func transform) is a
    tensor of torch.vmap, a batch of values with no memory laid out as one
    tensor (its data pointer cannot be taken)."""
    return _is_batched is not None and any(isinstance(t, torch.Tensor) and _is_batched(t)
                                           for t in inputs)


def _grad_tracked(inputs) -> bool:
    """Whether any of ``inputs`` (under an active torch.func transform) is a
    tensor that torch.func.grad, vjp or jacrev differentiates through (no
    memory of its own either)."""
    return _is_grad_tracking is not None and any(
        isinstance(t, torch.Tensor) and _is_grad_tracking(t) for t in inputs)


def _direct_apply(function: type) -> Optional[Callable]:
    """The C++ apply of the eager ``torch.autograd.Function`` subclass
    ``function`` (``torch._C._FunctionBase.apply``, what ``Function.apply``
    calls last), for :meth:`FusedOp.run` to call without torch's Python
    wrapper around it; None where this torch lacks something a direct call
    relies on: the check for an active torch.func transform, the unwrapping
    of dead functorch wrappers, or the C++ base class with its ``apply``.
    With None, run() calls ``Function.apply``: the same node and results,
    a little more host time per call.

    The wrapper does one more thing, binding default arguments, only for a
    Function that defines ``setup_context``; FusedOp's Function does not
    (its forward takes ``ctx``)."""
    if _transforms_active is None or _unwrap_if_dead is None or _FunctionBase is None:
        return None
    if not isinstance(function, type) or not issubclass(function, _FunctionBase):
        return None
    if "setup_context" in vars(function):
        return None
    apply = getattr(super(torch.autograd.Function, function), "apply", None)
    return apply if callable(apply) else None


def _tensor_positions(forward: Callable) -> Tuple[int, ...]:
    """Positions of ``forward``'s parameters annotated ``torch.Tensor`` or
    ``Optional[torch.Tensor]``."""
    hints = typing.get_type_hints(forward)
    names = forward.__code__.co_varnames[:forward.__code__.co_argcount]
    return tuple(i for i, name in enumerate(names)
                 if hints.get(name) in (torch.Tensor, Optional[torch.Tensor]))


def needs_grad(*tensors: Optional[torch.Tensor]) -> bool:
    """True when autograd will record a graph for these inputs.  Raises
    RuntimeError under torch.func.functionalize where it would record one
    that the op cannot see (:func:`_refuse_hidden_grad`), and for an input
    with a forward-mode tangent (:func:`refuse_tangents`)."""
    if _forward_ad._current_level >= 0:  # (checked here too: this runs on every op call)
        refuse_tangents(*tensors)
    if torch.is_grad_enabled():
        for t in tensors:  # a loop, not any(<generator>): no generator per call
            if t is not None and t.requires_grad:
                return True
        if _transforms_active is not None and _transforms_active():
            _refuse_hidden_grad(tensors)
    return False


def refuse_tangents(*tensors: Optional[torch.Tensor]) -> None:
    """Forward-mode AD: the ops define no forward derivative, so a tangent
    of an input would be dropped, the output's silently zero.  Refused,
    before anything runs (every op asks, through :func:`needs_grad` or
    itself).  Outside a dual level, one comparison."""
    if _forward_ad._current_level < 0:  # no dual level (forward_ad, torch.func.jvp) open
        return
    for t in tensors:
        if t is not None and _forward_ad.unpack_dual(t).tangent is not None:
            raise RuntimeError("cupy_fused ops do not support forward-mode AD (torch.autograd."
                               "forward_ad, torch.func.jvp): an input has a tangent, which the op "
                               "would drop")


def _vmap_error(name: str) -> RuntimeError:
    return RuntimeError(f"{NAMESPACE}::{name} does not support torch.vmap: its kernels take whole "
                        "tensors (call it on the batch as one tensor, or per sample)")


def _grad_transform_error(name: str) -> RuntimeError:
    return RuntimeError(f"{NAMESPACE}::{name} does not support torch.func's gradient transforms "
                        "(torch.func.grad, vjp, jacrev, hessian): use torch.autograd.grad or "
                        "Tensor.backward")


_tracing_state = getattr(torch._C, "_get_tracing_state", None)


def refuse_jit(name: str) -> None:
    """torch.jit.trace, refused naming ``name`` (an op, or a module) before
    anything runs: the kernels are launched from Python, which a TorchScript
    graph does not record (sizes turn into tensors under its tracer, and the
    launch planning fails on them, naming nothing).  One call."""
    if _tracing_state is not None and _tracing_state() is not None:
        raise RuntimeError(jit_message(name))


def jit_message(name: str) -> str:
    return (f"{name} cannot be compiled to TorchScript (torch.jit.trace, torch.jit.script): "
            "its kernels are launched from Python, which a TorchScript graph does not record; "
            "use torch.compile, or torch.export for a graph")


def refuse_transforms(name: str, *tensors: Optional[torch.Tensor]) -> None:
    """torch.vmap and torch.func's gradient transforms, refused naming
    ``name`` (an op, or a module) before anything runs, as
    :meth:`FusedOp.run` refuses them: for the ops whose routes reach a
    tensor's memory (its alignment) before a FusedOp runs, or run torch's
    products (cuBLAS, cuDNN) before one, and for the modules' checks of
    x's rank (a vmapped x has one dim less).  Outside torch.func's
    transforms, one call.  Not while torch.compile traces, where
    :meth:`FusedOp.run` records its custom op without asking either (and
    torch 2.4's TorchDynamo cannot trace the query: a graph break)."""
    if is_compiling():
        return
    if _transforms_active is not None and _transforms_active():
        if _vmapped(tensors):
            raise _vmap_error(name)
        if _grad_tracked(tensors):
            raise _grad_transform_error(name)


def _refuse_hidden_grad(tensors) -> None:
    """torch.func.functionalize's tensors say they require no gradient while
    the tensors they wrap do, and autograd records the op all the same: an
    op would take its inference route (a fused activation with no backward,
    no saved statistics) under a node that expects its training one.
    Refused, before anything runs."""
    for t in tensors:
        if (isinstance(t, torch.Tensor) and _is_functional_tensor is not None
                and _is_functional_tensor(t) and torch._from_functional_tensor(t).requires_grad):
            raise RuntimeError(
                "cupy_fused ops record no gradient under torch.func.functionalize (its tensors "
                "hide requires_grad from them): call it under torch.no_grad(), or use "
                "torch.compile, which functionalizes the graph itself")


# torch >= 2.8 tells whether saved-tensor hooks are active; an older one
# cannot, and is taken to have none.
_top_saved_tensor_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def keeps_for_one_use() -> bool:
    """Whether an op's eager node may keep a tensor for one use
    (:func:`keep_output`, or an op's own attribute) instead of saving it:
    not while torch.compile traces (a graph carries saved tensors only),
    nor where saved-tensor hooks are active (``torch.utils.checkpoint``'s
    non-reentrant mode drops saved tensors until the backward recomputes
    them, ``torch.autograd.graph.save_on_cpu`` moves them to the host: a
    kept tensor would stay where it is, defeating either).  Where not, the
    node saves what it would keep (the op's traced setup), and a caller
    that gates with a native node does so as when traced."""
    if is_compiling():
        return False
    return _top_saved_tensor_hooks is None or _top_saved_tensor_hooks(False) is None


def keep_output(ctx, output: torch.Tensor) -> None:
    """Keeps ``output`` (an output of the op being recorded) for one use by
    its backward, :func:`take_output`.  Eager path only (a ctx attribute,
    which a traced graph would not carry).

    Kept as a detached alias, not the output itself: the output holds this
    node as its ``grad_fn``, so keeping it would make a reference cycle.  The
    alias shares the output's version counter, which :func:`take_output`
    checks, as autograd checks its saved tensors.  Not being a saved tensor,
    it would bypass saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``,
    e.g. offloading to the CPU), so where they are active it is not used
    (:func:`keeps_for_one_use`; on a torch that cannot tell, it is, and
    stays where the output is)."""
    ctx.kept_output = output.detach()
    ctx.kept_version = output._version


def take_output(ctx) -> Optional[torch.Tensor]:
    """The output kept by :func:`keep_output`, which the node then no longer
    holds (so its memory is freed as soon as the caller drops it too); None
    when nothing was kept or a first backward through a retained graph
    (``retain_graph=True``) took it: the formula then recomputes what it
    needs.  Raises, as autograd does, when the output was modified in place
    after the forward."""
    kept = getattr(ctx, "kept_output", None)
    if kept is None:
        return None
    ctx.kept_output = None
    check_unchanged(kept, ctx.kept_version, "the output of a cupy_fused op")
    return kept


def product_operands(ctx, x: torch.Tensor, weight: torch.Tensor, x_at: int = 0,
                     weight_at: int = 1) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """What the backward of a product ``x W^T`` needs of its operands, as
    autograd's own ``mm`` saves them: x (or its cast) only where W's
    gradient is wanted (dW = dz^T x), W (or its cast) only where x's is
    (dX = dz W); None for the other.  With a frozen weight no activation
    stays alive for the backward; with an input that needs no gradient
    (a first layer) no weight, nor a cast of it.

    Args:
        ctx: the node's context, in a setup (``ctx.needs_input_grad`` is
            set there, eager and traced).
        x, weight: what the backward's products read.
        x_at, weight_at: the positions among the op's inputs of the
            tensors whose gradients these are.

    Returns:
        (x or None, weight or None).
    """
    want = ctx.needs_input_grad
    return (x if want[weight_at] else None, weight if want[x_at] else None)


def graph_anchors(*pairs: Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]
                  ) -> Tuple[torch.Tensor, ...]:
    """What a node keeps as ``ctx.graph_anchors`` (see
    :func:`_formula_with_graph`): for each (input, what the node saved of
    it), the input's autograd history where the gradients depend on the
    input but the node saved nothing of it that carries that history (a
    detached cast, a copy, or nothing: :func:`product_operands`), so that
    a double backward through the gradients is still refused.

    Without its memory: a leaf input is kept itself (its AccumulateGrad
    node holds it anyway), any other one as an empty slice of it cloned
    (no storage, no kernel; its nodes keep shapes only).  Nothing while
    torch.compile traces (the compiled region's backward is AOTAutograd's,
    whose own handling of double backward applies: test_double_backward),
    and nothing for an input that needs no gradient."""
    if is_compiling():
        return ()
    kept = []
    for t, saved in pairs:
        if t is None or not t.requires_grad or saved is t:
            continue
        if t.grad_fn is None:
            kept.append(t)
        else:
            # Recorded by autograd, which a node's forward (grad mode off)
            # and a custom op's setup (its autograd keys excluded) are not.
            with torch.enable_grad(), _autograd_keys_included():
                kept.append(t.narrow(0, 0, 0).clone())
    return tuple(kept)


_exclude_key_guard = getattr(torch._C, "_SetExcludeDispatchKeyGuard", None)
_key_excluded = getattr(torch._C, "_dispatch_tls_is_dispatch_key_excluded", None)
_dispatch_keys = getattr(torch._C, "DispatchKey", None)


def _autograd_keys_included():
    """A context in which autograd records ops also inside a custom op's
    setup_context, which torch runs with the autograd dispatch keys
    excluded; elsewhere (an eager node's forward) one that does nothing.
    Private guards, looked up: where missing, a context that does nothing,
    and an anchor made in such a setup carries no history."""
    if _exclude_key_guard is None or _dispatch_keys is None or (
            _key_excluded is not None and not _key_excluded(_dispatch_keys.AutogradFunctionality)):
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    for key in ("AutogradFunctionality", "ADInplaceOrView"):
        if hasattr(_dispatch_keys, key):
            stack.enter_context(_exclude_key_guard(getattr(_dispatch_keys, key), False))
    return stack


def version_of(t: Optional[torch.Tensor]) -> Optional[int]:
    """``t``'s version counter, for :func:`check_unchanged` to tell whether
    it was changed in place (as autograd checks its saved tensors); None
    for None or an inference tensor (``torch.inference_mode``), which has no
    counter and cannot be changed in place outside inference mode."""
    if t is None or t.is_inference():
        return None
    return t._version


def check_unchanged(t: Optional[torch.Tensor], version: Optional[int], what: str) -> None:
    """Raises, as autograd does for a saved tensor, where ``t`` (kept by a
    node, not saved: :func:`version_of` at the forward) changed in place."""
    if version is not None and t._version != version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: {what} is at version {t._version}; expected version "
            f"{version} instead")


def double_backward_message(name: str) -> str:
    return (f"{NAMESPACE}::{name} does not support double backward (create_graph=True through "
            "its backward, e.g. a gradient penalty): cupy-fused's backward kernels compute "
            "first-order gradients only and record no graph, so a second derivative through "
            "them would be wrong.  Use the PyTorch reference module (cupy_fused.reference) or "
            "torch ops for the part that is differentiated twice, or detach the gradient "
            "that goes through this op.")


def first_order_only(name: str, result, depends_on: Sequence[Optional[torch.Tensor]]):
    """The gradients ``result`` (a backward formula's tuple, Nones allowed)
    of a backward run with grad mode on (``create_graph=True``), made aliases
    whose node raises :func:`double_backward_message` when differentiated.

    ``depends_on``: what the gradients are functions of (the incoming
    gradients, the saved tensors).  The node takes them as inputs, although
    its outputs alias ``result`` only, so that it lies on every path from the
    gradients to what they depend on: ``torch.autograd.grad(penalty, weight)``
    then reaches it and raises, where ``once_differentiable`` (whose node
    hangs from the incoming gradients only, and only when they require grad)
    gives "not used in the graph", or with ``allow_unused=True`` a silent
    None.  Nothing among them requiring grad, the gradients are constants
    and get no node, as torch's own would."""
    single = not isinstance(result, tuple)
    grads = (result,) if single else result
    inputs = list(grads) + [t for t in depends_on if t is not None and t.requires_grad]
    marked = torch._C._functions.DelayedError(double_backward_message(name), len(inputs))(
        *inputs)
    if not isinstance(marked, tuple):  # (one input: one tensor)
        marked = (marked,)
    return marked[0] if single else tuple(marked[:len(grads)])


class _SavedOnce:
    """A node's ctx whose saved tensors are unpacked once, for the formula
    and :func:`_formula_with_graph` both: torch.utils.checkpoint's
    non-reentrant mode lets each saved tensor be unpacked once per
    backward.  Every other attribute is the ctx's own, read and set."""

    def __init__(self, ctx):
        object.__setattr__(self, "_ctx", ctx)
        object.__setattr__(self, "saved_tensors", ctx.saved_tensors)

    def __getattr__(self, name):
        return getattr(self._ctx, name)

    def __setattr__(self, name, value):
        setattr(self._ctx, name, value)


def _backward_body(name: str, formula: Callable, ctx, grads, run_backward):
    """The eager node's backward: ``formula`` on ``grads``, refusing a
    double backward with grad mode on (``create_graph=True``).  On a batch
    of gradients (torch.autograd.grad's ``is_grads_batched``), where a
    kernel reads the gradient's memory, which a batch does not have, the
    error says so, naming the op (torch's names neither)."""
    grad = grads[0]  # (the formulas read the first output's gradient only)
    if grad is not None and ((_is_legacy_batched is not None and _is_legacy_batched(grad))
                             or (_is_batched is not None and _is_batched(grad))):
        try:
            return _run_formula(name, formula, ctx, grads, run_backward)
        except RuntimeError as error:
            if "doesn't have storage" not in str(error):
                raise
            raise RuntimeError(
                f"cupy_fused::{name} cannot take a batch of gradients in one backward "
                "(torch.autograd.grad(..., is_grads_batched=True), torch.autograd.functional."
                "jacobian / hessian with vectorize=True, or torch.vmap over a gradient): its "
                "kernels read each gradient's memory; compute them one at a time "
                "(vectorize=False)") from error
    return _run_formula(name, formula, ctx, grads, run_backward)


def _run_formula(name: str, formula: Callable, ctx, grads, run_backward):
    if torch.is_grad_enabled():  # create_graph=True
        return _formula_with_graph(name, formula, ctx, grads, run_backward)
    return formula(ctx, grads, run_backward)


def _eager_backward(*args):
    """:func:`_backward_body` with TorchDynamo off (while it traces, a graph
    break): made on first use, as ``torch._dynamo.disable`` imports
    TorchDynamo, which importing this package does not."""
    global _eager_backward
    import torch._dynamo
    _eager_backward = torch._dynamo.disable(_backward_body)
    return _eager_backward(*args)


def _formula_with_graph(name: str, formula: Callable, ctx, grads, run_backward):
    """``formula`` run by a backward with grad mode on (``create_graph=True``):
    its results refuse to be differentiated (:func:`first_order_only`), as
    functions of the incoming gradients, the saved tensors and
    ``ctx.graph_anchors`` (inputs a node keeps other than as saved tensors,
    if it sets them: :func:`graph_anchors`)."""
    ctx = _SavedOnce(ctx)
    with torch.no_grad():  # a graph of the formula's torch ops would be cut anyway
        result = formula(ctx, grads, run_backward)
    return first_order_only(name, result,
                            grads + tuple(ctx.saved_tensors) + tuple(getattr(ctx, "graph_anchors", ())))


def inference_op(name: str, forward: Callable, forward_fake: Callable) -> Optional[Callable]:
    """A forward with no backward as the custom op ``cupy_fused::<name>``:
    what a graph traced by torch.compile calls for a route that eager calls
    without a gradient to record launch directly (``forward`` itself).

    Args:
        name: op name (``cupy_fused::<name>``).
        forward, forward_fake: as :class:`FusedOp`'s.  While tracing no
            address is known, so a route planned there is checked by
            ``forward`` when the graph runs (an operand off the copy
            engine's 16-byte grid copied or sent elsewhere).

    Returns:
        The op, or None on a torch without custom ops (< 2.4): a traced
        call then takes another route.  Only for calls with no gradient to
        record: the op has no autograd formula.
    """
    return _custom_op(name, forward, forward_fake) if HAS_CUSTOM_OP else None


def _custom_op(name: str, fn: Callable, fake: Callable):
    """``fn`` (annotated: the schema is inferred) as the custom op
    ``cupy_fused::<name>``, with ``fake`` for tracing; nothing it mutates."""
    # torch 2.4 infers the schema from the raw annotations, which
    # `from __future__ import annotations` leaves as strings: resolved here.
    hints = typing.get_type_hints(fn)
    sig = inspect.signature(fn)
    fn.__signature__ = sig.replace(
        parameters=[p.replace(annotation=hints.get(p.name, p.annotation))
                    for p in sig.parameters.values()],
        return_annotation=hints.get("return", sig.return_annotation))
    op = torch.library.custom_op(f"{NAMESPACE}::{name}", fn, mutates_args=())
    op.register_fake(fake)
    return op


class FusedOp:
    """One fused operation with a custom backward.

    Args:
        name: op name (``cupy_fused::<name>``).
        forward: ``forward(*inputs) -> tuple[Tensor, ...]`` (or ``-> Tensor``
            for one output: torch.compile specialises the sizes of a
            one-tensor tuple), fully type-annotated (the custom-op schema is
            inferred from the annotations).
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
        eager_setup_context: replaces ``setup_context`` on the eager path
            where :func:`keeps_for_one_use` (see the module docstring); the
            formula must then handle both.
    """

    def __init__(self, name: str, forward: Callable, forward_fake: Callable,
                 setup_context: Callable, backward_formula: Callable,
                 backward: Optional[Callable] = None, backward_fake: Optional[Callable] = None,
                 nondifferentiable: Sequence[int] = (),
                 eager_setup_context: Optional[Callable] = None):
        self.name = name
        self.forward = forward
        self.backward = backward
        self._formula = backward_formula
        self._setup_context = setup_context
        self._eager_setup_context = eager_setup_context or setup_context
        self._nondiff = tuple(nondifferentiable)
        self.op = None
        self.backward_op = None
        if HAS_CUSTOM_OP:
            self.op = _custom_op(name, forward, forward_fake)
            run = None
            if backward is not None:
                self.backward_op = run = _custom_op(f"{name}_backward", backward, backward_fake)
            # Left alone, a double backward through the custom op (called
            # directly, outside torch.compile) fails where the formula calls
            # the backward op, with torch's "no autograd formula was
            # registered ... Please use register_autograd", which names the
            # backward op and suggests the wrong fix.  Refused here as on the
            # eager path.  AOTAutograd traces the formula with grad mode off
            # (unchanged), and a compiled region's backward refuses double
            # backward itself.
            def formula(ctx, *grads):
                if torch.is_grad_enabled():
                    return _formula_with_graph(name, backward_formula, ctx, grads, run)
                return backward_formula(ctx, grads, run)

            self.op.register_autograd(formula, setup_context=setup_context)
        self._function = self._make_function()
        # The eager Function's C++ apply, called without torch's Python
        # wrapper around it (Function.apply) where that wrapper would only
        # unwrap dead functorch wrappers among the tensor inputs: run() does
        # that itself, and refuses torch.func's gradient transforms (under
        # which the wrapper fails on a Function without setup_context,
        # naming no op) before either is called.  The wrapper's generic
        # handling (a classmethod call, the setup_context test, a generator
        # over every argument into a new tuple) is a large part of a small
        # op's host time, paid on every training step's forward.  None where
        # this torch lacks what that needs (_direct_apply): run() then calls
        # Function.apply.
        self._tensor_args = _tensor_positions(forward)
        self._c_apply = _direct_apply(self._function)

    def _make_function(self):
        op, nondiff, formula, run_backward = self, self._nondiff, self._formula, self.backward
        setup_differs = self._eager_setup_context is not self._setup_context
        name = self.name

        class Function(torch.autograd.Function):
            @staticmethod
            def forward(ctx, *inputs):
                outputs = op.forward(*inputs)
                if setup_differs and not keeps_for_one_use():
                    op._setup_context(ctx, inputs, outputs)  # (saves all: see keeps_for_one_use)
                else:
                    op._eager_setup_context(ctx, inputs, outputs)
                if nondiff:
                    ctx.mark_non_differentiable(*[outputs[i] for i in nondiff])
                    # The formulas read the first output's gradient only; the
                    # others would be materialised as zero tensors, an
                    # allocation and a fill each per backward.
                    ctx.set_materialize_grads(False)
                return outputs

            @staticmethod
            def backward(ctx, *grads):
                if is_compiling():
                    # Compiled autograd traces the eager graph's backward:
                    # this node's formula reads what the eager forward kept
                    # on ctx and launches kernels, so it runs as it is (a
                    # graph break), as outside.
                    return _eager_backward(name, formula, ctx, grads, run_backward)
                return _backward_body(name, formula, ctx, grads, run_backward)

        Function.__name__ = Function.__qualname__ = f"{self.name}_function"
        return Function

    def run(self, requires_grad: bool, *inputs):
        """Runs the op on ``inputs``.  ``requires_grad``: whether autograd
        must record it (callers compute it with :func:`needs_grad`).  (A
        plain method with positional arguments: calling the instance, or
        with a keyword, adds host time on every op call.)

        The elementwise ops, whose whole cost on a small tensor is host time,
        call ``forward`` themselves when there is no graph to record and
        nothing is tracing (``not requires_grad and not is_compiling()``),
        which is what this method would do one Python call later."""
        if self.op is not None and is_compiling():
            return self.op(*inputs)
        # (one query of the transforms per call: this runs on every op call)
        transforms = _transforms_active is not None and _transforms_active()
        if transforms and _functionalized(inputs):
            if self.op is None:
                raise RuntimeError(f"{self.name} cannot run under torch.func.functionalize with "
                                   f"torch {torch.__version__}: it needs torch.library.custom_op "
                                   f"(torch >= 2.4)")
            return self.op(*inputs)
        if transforms and _vmapped(inputs):
            raise _vmap_error(self.name)
        if transforms and requires_grad:  # (Function.apply would fail there, naming no op)
            raise _grad_transform_error(self.name)
        if not requires_grad:
            return self.forward(*inputs)
        if self._c_apply is None:
            return self._function.apply(*inputs)
        args = list(inputs)
        for i in self._tensor_args:
            if args[i] is not None:
                args[i] = _unwrap_if_dead(args[i])
        return self._c_apply(*args)
