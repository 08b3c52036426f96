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
from typing import Callable, Dict, Optional, Tuple

import torch

from . import models, reference


def build_pair(problem: int, ctor_args: tuple, device, dtype: torch.dtype, seed: int = 0):
    """(reference module, fused module) built from the same seed, in ``dtype``."""
    ref_cls = {p: c for p, (c, _, _) in reference.PROBLEMS.items()}[problem]
    torch.manual_seed(seed)
    ref = ref_cls(*ctor_args)
    torch.manual_seed(seed)
    ours = models.MODELS[problem](*ctor_args)
    return ref.to(device=device, dtype=dtype), ours.to(device=device, dtype=dtype)


def poison_allocator(device, nbytes: int) -> None:
    """Fills the caching allocator's free blocks with NaN so that outputs
    allocated with ``torch.empty`` start as NaN: an element a kernel fails to
    write then shows up as NaN in the comparison."""
    blocks = [torch.full((nbytes // 4 + 1,), float("nan"), device=device) for _ in range(4)]
    del blocks


def rel_error(value: torch.Tensor, truth: torch.Tensor) -> float:
    truth = truth.double()
    scale = truth.abs().max().item()
    err = (value.double() - truth).abs().max().item()
    if err != err:  # NaN: an unwritten or broken element
        return float("inf")
    return err / scale if scale > 0 else err


def scaled_gemm_error(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, ref_fn) -> float:
    """max |C - C64| / (|A| |B|) over elements: each element of the product
    ``c = ref_fn(a, b)`` against its own rounding bound, so rows and columns
    of any magnitude count equally.  Unwritten (NaN) elements fail."""
    truth = ref_fn(a.double(), b.double())
    bound = ref_fn(a.double().abs(), b.double().abs()).clamp_min(1e-300)
    err = (c.double() - truth).abs() / bound
    if torch.isnan(err).any():
        raise AssertionError("unwritten (NaN) output elements")
    return err.max().item()


def _run(model, x, dy, grad_mode: str, autocast: Optional[torch.dtype] = None):
    x = x.detach().requires_grad_(True)
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


def non_finite_masks(model, x: torch.Tensor, g: torch.Tensor,
                     autocast: Optional[torch.dtype] = None) -> Dict[str, tuple]:
    """The NaN, +inf and -inf masks of ``model``'s output on ``x`` and of the
    gradients of x and of every parameter after ``y.backward(g)`` (the
    forward under ``torch.autocast("cuda", dtype=autocast)`` when given),
    by name: what a check that non-finite values land where the reference
    puts them compares."""
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
            mutate: Optional[Callable[[torch.nn.Module], None]] = None) -> Dict[str, Tuple[float, float]]:
    """Runs ours, eager (both in ``dtype``) and the float64 reference on one
    fresh random input.  Returns ``{tensor name: (our error, eager error)}``
    for the output and the gradient of the input and of every parameter.
    grad_mode: "random" (a random upstream gradient) or "sum" (``out.sum()``).
    layout of the input: "contiguous", "channels_last" (4-D) or "strided"
    (a non-contiguous view with the same values).
    autocast: run both forwards under ``torch.autocast("cuda", dtype=...)``
    (the backward outside it, as in training); raises when our output or a
    gradient has another dtype than eager's.
    mutate: called on the reference and on ours after they are built (a
    change of a submodule, say), so as to leave the two alike.
    """
    ref, ours = build_pair(problem, ctor_args, device, dtype, seed)
    if mutate is not None:
        mutate(ref)
        mutate(ours)
    gen = torch.Generator(device="cpu").manual_seed(seed + 1)
    x = torch.rand(input_shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)
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
    truth_out, truth_grads = _run(ref64, x64, dy.double(), grad_mode)
    eager_out, eager_grads = _run(ref, x, dy, grad_mode, autocast)
    poison_allocator(device, 4 * max(truth_out.numel(), x.numel()))
    our_out, our_grads = _run(ours, x, dy, grad_mode, autocast)
    if our_out.dtype != eager_out.dtype:
        raise AssertionError(f"output dtype {our_out.dtype}, eager's {eager_out.dtype}")
    for name, g in our_grads.items():
        if g is not None and eager_grads.get(name) is not None and g.dtype != eager_grads[name].dtype:
            raise AssertionError(f"{name} dtype {g.dtype}, eager's {eager_grads[name].dtype}")
    result = {"out": (rel_error(our_out, truth_out), rel_error(eager_out, truth_out))}
    for name, truth in truth_grads.items():
        mine, theirs = our_grads.get(name), eager_grads.get(name)
        if mine is None or theirs is None:
            raise AssertionError(f"{name}: gradient missing (ours: {mine is not None}, "
                                 f"eager: {theirs is not None})")
        result[name] = (rel_error(mine, truth), rel_error(theirs, truth))
    return result


def worse_than_eager(errors: Dict[str, Tuple[float, float]], dtype: torch.dtype, factor: float = 1.5):
    """Names whose error exceeds ``factor`` x eager's (plus one unit of
    rounding of ``dtype``, so exact agreement on an exactly-computed value
    does not fail on a last-bit difference)."""
    ulp = torch.finfo(dtype).eps
    return [n for n, (mine, theirs) in errors.items() if not mine <= factor * theirs + ulp]


def model_table(device, dtype: torch.dtype = torch.float32, repeats: int = 20) -> Tuple[list, bool]:
    """Rows of the ``python -m cupy_fused`` table at the small shapes."""
    rows = [f"{'problem':<8}{'max err ours':>14}{'max err eager':>15}{'fwd ours ms':>13}"
            f"{'fwd eager ms':>14}  status"]
    ok = True
    for problem, (_, args, shape) in reference.SMALL_PROBLEMS.items():
        errors = compare(problem, args, shape, dtype, device)
        mine = max(e[0] for e in errors.values())
        theirs = max(e[1] for e in errors.values())
        bad = worse_than_eager(errors, dtype)
        ok &= not bad
        ref, ours = build_pair(problem, args, device, dtype)
        x = torch.rand(shape, device=device, dtype=dtype)
        times = []
        for model in (ours, ref):
            with torch.no_grad():
                model(x)
                torch.cuda.synchronize(device)
                start, end = torch.cuda.Event(True), torch.cuda.Event(True)
                start.record()
                for _ in range(repeats):
                    model(x)
                end.record()
                end.synchronize()
            times.append(start.elapsed_time(end) / repeats)
        rows.append(f"{problem:<8}{mine:>14.2e}{theirs:>15.2e}{times[0]:>13.3f}{times[1]:>14.3f}  "
                    f"{'OK' if not bad else 'WORSE: ' + ', '.join(bad)}")
    return rows, ok
