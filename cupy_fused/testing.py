"""Checking the fused models against the PyTorch reference: shared by the
test suite, ``python -m cupy_fused`` and the benchmarks (with the GEMM
error measure they share).  The benchmarks' timing is outside the
package, in ``benchmarks/harness.py``.

Ground truth is a float64 run of the reference (inputs and parameters
upcast from the same values).  Errors are reported as
``max |value - truth| / max |truth|`` per tensor, for ours and for the eager
reference in the same dtype, side by side.
"""
from __future__ import annotations

import contextlib
import copy
import gc
from typing import Callable, Dict, Optional, Tuple

import torch

from . import models, reference
from ._validation import check_int, check_same_shape


def build_pair(problem: int, ctor_args: tuple, device, dtype: torch.dtype, seed: int = 0):
    """The reference module and ours for one problem, built from the same
    seed (so with the same parameter values).

    Args:
        problem: a KernelBench level-2 problem id (1, 37, 76, 88, 94).
        ctor_args: the modules' constructor arguments.
        device, dtype: where and in which dtype both are put.
        seed: the torch seed each is built under.

    Returns:
        (reference module, fused module).
    """
    if (isinstance(problem, bool) or problem not in reference.PROBLEMS  # (True == 1)
            or problem not in models.MODELS):
        raise ValueError(f"problem must be one of {sorted(reference.PROBLEMS)}, got {problem!r}")
    ref_cls = reference.PROBLEMS[problem][0]
    torch.manual_seed(seed)
    ref = ref_cls(*ctor_args)
    torch.manual_seed(seed)
    ours = models.MODELS[problem](*ctor_args)
    return ref.to(device=device, dtype=dtype), ours.to(device=device, dtype=dtype)


def poison_allocator(device, nbytes: int) -> None:
    """Fills the caching allocator's free blocks with NaN so that outputs
    allocated with ``torch.empty`` start as NaN: an element a kernel fails to
    write then shows up as NaN in the comparison.

    Args:
        device: the CUDA device whose allocator is poisoned.
        nbytes: the bytes of each of the four NaN blocks (allocated, then
            freed): at least the outputs', so that outputs are carved from
            them.

    Returns:
        None.
    """
    nbytes = check_int("nbytes", nbytes, 0)  # (NumPy's ints too)
    if torch.device(device).type == "cuda":
        # Cached free blocks of other sizes go back to the driver first: the
        # allocator serves a request from the best-fitting free block, which
        # would otherwise often be one of those, never poisoned.
        torch.cuda.empty_cache()
    # Every byte 0xFF: NaN read as float32, float16, bfloat16 and float64
    # alike (a float32 NaN's bytes, read as 16-bit values, alternate 0 and
    # NaN).  Exactly nbytes (rounded up to 4), so that an output of that size
    # fits a poisoned block as well as any.
    blocks = [torch.full((-(-nbytes // 4),), -1, dtype=torch.int32, device=device)
              for _ in range(4)]
    del blocks


def held_bytes(forward: Callable[[], object], device) -> int:
    """Bytes of device memory that ``forward()`` leaves allocated while its
    result (and so the autograd graph it records) is alive.

    Args:
        forward: a call that returns what a forward returns; it should make
            its input itself where that input's memory must not count
            beside what the graph keeps of it.
        device: the CUDA device measured.

    Returns:
        ``torch.cuda.memory_allocated`` after the call less before it, of
        the second of two calls (the first allocates what persists:
        workspaces, counters), each after collecting garbage (an earlier
        test's reference cycles, freed inside the window, would count
        against it).
    """
    for _ in range(2):
        gc.collect()
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        result = forward()
        torch.cuda.synchronize(device)
        held = torch.cuda.memory_allocated(device) - before
        del result
    return held


def off_the_grid(t: torch.Tensor, fill: float = float("nan")) -> torch.Tensor:
    """``t``'s values in ``t``'s strides, one element into a buffer: off the
    16-byte grid, as a view into a larger tensor is.

    Args:
        t: a dense tensor (contiguous, channels-last, or any strides that
            cover its elements once), any dtype and device.
        fill: the value of the buffer's elements just before and just after
            the view (NaN: a read outside the view shows).

    Returns:
        A view of ``t``'s shape, strides, dtype and device, equal to ``t``,
        whose start is one element past a fresh allocation's.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"t must be a torch.Tensor, got {type(t).__name__}")
    buf = torch.full((t.numel() + 2,), fill, dtype=t.dtype, device=t.device)
    return buf[1:-1].as_strided(t.shape, t.stride()).copy_(t)


def rel_error(value: torch.Tensor, truth: torch.Tensor) -> float:
    """The error of ``value`` against ``truth``, relative to truth's largest
    magnitude.

    Args:
        value: a tensor of any float dtype; truth: one of its shape
            (float64, say).

    Returns:
        ``max |value - truth| / max |truth|`` over truth's finite elements
        (the absolute error where those are all zeros; 0 for empty
        tensors), an infinity of truth matched by the same infinity adding
        no error; inf where either holds a NaN (an unwritten or broken
        element) or where only one holds an infinity.

    Raises:
        TypeError, ValueError: unless both are tensors of one shape (a
            broadcast would measure another tensor).
    """
    _check_same_shape("value", value, "truth", truth)
    if value.numel() == 0:
        return 0.0
    truth = truth.double()
    value = value.double()
    finite = truth.isfinite()
    scale = truth[finite].abs().max().item() if finite.any() else 0.0
    # (inf - inf is NaN: equal infinities set apart; a lone one gives inf)
    err = torch.where(value == truth, 0.0, (value - truth).abs()).max().item()
    if err != err:  # NaN: an unwritten or broken element
        return float("inf")
    return err / scale if scale > 0 else err


def _check_same_shape(name: str, value, other_name: str, other) -> None:
    """Both tensors (of any dtypes and devices), ``value`` of ``other``'s
    shape (:func:`cupy_fused._validation.check_same_shape`)."""
    for n, t in ((name, value), (other_name, other)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{n} must be a torch.Tensor, got {type(t).__name__}")
    check_same_shape(name, value, other, other_name)


def scaled_gemm_error(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, ref_fn) -> float:
    """The error of a product against float64, each element against its own
    rounding bound, so that rows and columns of any magnitude count equally.

    Args:
        c: the product ``ref_fn(a, b)`` to check.
        a, b: its operands.
        ref_fn: the product, e.g. ``lambda a, b: a @ b.t()``.

    Returns:
        ``max |C - C64| / (|A| |B|)`` over the elements (C64 and the bound
        ``|A| |B|`` from ref_fn in float64).  Raises AssertionError where C
        holds a NaN (an unwritten element).

    Raises:
        TypeError, ValueError: unless c is a tensor of ref_fn(a, b)'s shape.
    """
    truth = ref_fn(a.double(), b.double())
    _check_same_shape("c", c, "ref_fn(a, b)", truth)
    bound = ref_fn(a.double().abs(), b.double().abs()).clamp_min(1e-300)
    err = (c.double() - truth).abs() / bound
    if torch.isnan(err).any():
        raise AssertionError("unwritten (NaN) output elements")
    return err.max().item()


def _run(model, x, dy, grad_mode: str, autocast: Optional[torch.dtype] = None,
         input_grad: bool = True):
    x = x.detach().requires_grad_(input_grad)
    for p in model.parameters():
        p.grad = None
    with torch.autocast("cuda", dtype=autocast) if autocast else contextlib.nullcontext():
        out = model(x)
    if grad_mode == "sum":
        out.sum().backward()
    else:
        out.backward(dy.to(out.dtype))
    grads = {"x.grad": x.grad}
    grads.update({f"{n}.grad": p.grad for n, p in model.named_parameters()})
    return out.detach(), grads


def assert_non_finite_where(got: torch.Tensor, want: torch.Tensor, *what) -> None:
    """Asserts that ``got`` holds NaN, +inf and -inf exactly where ``want``
    does.

    Args:
        got, want: tensors of one shape and device, any dtypes.
        what: named in the AssertionError of a failure, with the kind of
            value and both counts.

    Returns:
        None.
    """
    _check_same_shape("got", got, "want", want)
    for test in (torch.isnan, torch.isposinf, torch.isneginf):
        a, b = test(got), test(want)
        assert torch.equal(a, b), (*what, test.__name__, int(a.sum()), int(b.sum()))


def non_finite_masks(model, x: torch.Tensor, g: torch.Tensor,
                     autocast: Optional[torch.dtype] = None) -> Dict[str, tuple]:
    """The non-finite values of a model's output and gradients: what a check
    that NaN and ±inf land where the reference puts them compares.

    Args:
        model: the module to run (its parameters' gradients are reset).
        x: its input; g: the upstream gradient of its output.
        autocast: the dtype of ``torch.autocast("cuda")`` for the forward,
            or None.

    Returns:
        ``{name: (isnan, isposinf, isneginf)}`` for "out", "x.grad" and each
        parameter's ``"<name>.grad"``, after ``y.backward(g)``.
    """
    x = x.detach().clone().requires_grad_(True)
    for p in model.parameters():
        p.grad = None
    with torch.autocast("cuda", dtype=autocast) if autocast else contextlib.nullcontext():
        y = model(x)
    y.backward(g.to(y.dtype))
    tensors = {"out": y.detach(), "x.grad": x.grad}
    tensors.update({f"{n}.grad": p.grad for n, p in model.named_parameters()})
    return {n: (t.isnan(), t.isposinf(), t.isneginf()) for n, t in tensors.items()}


def compare(problem: int, ctor_args: tuple, input_shape: tuple, dtype: torch.dtype, device,
            seed: int = 0, grad_mode: str = "random",
            layout: str = "contiguous",
            autocast: Optional[torch.dtype] = None,
            mutate: Optional[Callable[[torch.nn.Module], None]] = None,
            input_dtype: Optional[torch.dtype] = None,
            input_grad: bool = True) -> Dict[str, Tuple[float, float]]:
    """Runs ours, eager (both in ``dtype``) and the float64 reference on one
    fresh random input, ours after the allocator's free memory is filled
    with NaN (:func:`poison_allocator`).

    Args:
        problem, ctor_args, seed: as :func:`build_pair`.
        input_shape: the input's shape; dtype, device: the models' and the
            input's.
        grad_mode: "random" (a random upstream gradient) or "sum"
            (``out.sum()``).
        layout: the input's: "contiguous", "channels_last" (4-D) or
            "strided" (a non-contiguous view with the same values).
        autocast: run both forwards under ``torch.autocast("cuda",
            dtype=...)`` (the backward outside it, as in training).
        mutate: called on the reference and on ours after they are built (a
            change of a submodule, or a parameter frozen, say), so as to
            leave the two alike.
        input_dtype: the input's dtype where it differs from the models'
            (under autocast, say).
        input_grad: whether the input requires a gradient.

    Returns:
        ``{tensor name: (our error, eager error)}`` (:func:`rel_error`
        against float64) for the output and the gradient of the input and
        of every parameter that gets one (the float64 run's: not a frozen
        parameter).  Raises AssertionError when our output has another
        dtype or shape than eager's, when a gradient is missing, or where
        ours gives a gradient that the float64 run does not.  (A leaf's
        gradient always has the leaf's dtype and shape: autograd casts what
        a backward returns, so the dtypes a backward writes are the ops'
        own tests' to check.)
    """
    if grad_mode not in ("random", "sum"):
        raise ValueError(f"grad_mode must be 'random' or 'sum', got {grad_mode!r}")
    ref, ours = build_pair(problem, ctor_args, device, dtype, seed)
    if mutate is not None:
        mutate(ref)
        mutate(ours)
    gen = torch.Generator(device="cpu").manual_seed(seed + 1)
    x = torch.rand(input_shape, generator=gen, dtype=torch.float32).to(device=device,
                                                                        dtype=input_dtype or dtype)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    elif layout == "strided":
        dims = list(reversed(range(x.dim())))
        x = x.permute(*dims).contiguous().permute(*dims)
        assert not x.is_contiguous() or x.dim() < 2 or min(x.shape) == 1
    elif layout != "contiguous":
        raise ValueError(f"layout must be contiguous, channels_last or strided, got {layout!r}")
    ref64 = copy.deepcopy(ref).double()
    x64 = x.double()  # keeps the layout
    with torch.no_grad():
        out_shape = ref64(x64).shape
    dy = torch.randn(out_shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)
    truth_out, truth_grads = _run(ref64, x64, dy.double(), grad_mode, input_grad=input_grad)
    eager_out, eager_grads = _run(ref, x, dy, grad_mode, autocast, input_grad)
    # (blocks the size of the largest tensor ours writes: the output, x's
    # gradient or a weight's)
    poison_allocator(device, 4 * max(truth_out.numel(), x.numel(),
                                     *(p.numel() for p in ours.parameters())))
    our_out, our_grads = _run(ours, x, dy, grad_mode, autocast, input_grad)
    if our_out.dtype != eager_out.dtype or our_out.shape != eager_out.shape:
        raise AssertionError(f"output {our_out.dtype} {tuple(our_out.shape)}, eager's "
                             f"{eager_out.dtype} {tuple(eager_out.shape)}")
    result = {"out": (rel_error(our_out, truth_out), rel_error(eager_out, truth_out))}
    for name, truth in truth_grads.items():
        mine, theirs = our_grads.get(name), eager_grads.get(name)
        if truth is None:  # (frozen)
            if mine is not None:
                raise AssertionError(f"{name}: a gradient, where the reference gives none")
            continue
        if mine is None or theirs is None:
            raise AssertionError(f"{name}: gradient missing (ours: {mine is not None}, "
                                 f"eager: {theirs is not None})")
        result[name] = (rel_error(mine, truth), rel_error(theirs, truth))
    return result


def worse_than_eager(errors: Dict[str, Tuple[float, float]], dtype: torch.dtype, factor: float = 1.5):
    """The tensors on which ours is worse than eager.

    Args:
        errors: :func:`compare`'s result.
        dtype: the dtype of the run, whose rounding unit is allowed on top
            (so that exact agreement on an exactly computed value does not
            fail on a last-bit difference).
        factor: how much worse than eager's error ours may be.

    Returns:
        The names whose error exceeds ``factor`` x eager's plus that unit.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    ulp = torch.finfo(dtype).eps
    return [n for n, (mine, theirs) in errors.items() if not mine <= factor * theirs + ulp]


def model_table(device, dtype: torch.dtype = torch.float32) -> Tuple[list, bool]:
    """The ``python -m cupy_fused`` table: each model at its small shape
    (``reference.SMALL_PROBLEMS``) against the reference.

    Args:
        device: a CUDA device; dtype: the models' dtype.

    Returns:
        (the table's text rows: the largest error of ours and of eager over
        the output and the gradients, and whether ours is within 1.5x
        eager's error (:func:`worse_than_eager`); whether every model is).
    """
    rows = [f"{'problem':<8}{'max err ours':>14}{'max err eager':>15}  status"]
    ok = True
    for problem, (_, args, shape) in reference.SMALL_PROBLEMS.items():
        errors = compare(problem, args, shape, dtype, device)
        mine = max(e[0] for e in errors.values())
        theirs = max(e[1] for e in errors.values())
        bad = worse_than_eager(errors, dtype)
        ok &= not bad
        rows.append(f"{problem:<8}{mine:>14.2e}{theirs:>15.2e}  "
                    f"{'OK' if not bad else 'WORSE: ' + ', '.join(bad)}")
    return rows, ok
