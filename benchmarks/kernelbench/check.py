"""KernelBench's correctness flow on the solution files of this folder.

For each solution file and dtype this follows ``eval_kernel_against_ref`` of
ScalingIntelligence/KernelBench (``src/kernelbench/eval.py``) and its
``run_and_check_correctness`` step by step:

* ``set_seed(42)`` (torch and the current CUDA device), then
  ``get_init_inputs()``; tensors among them are cast to the dtype and moved
  to the GPU;
* under ``torch.no_grad()``: ``set_seed(42)``, ``Model(*init)``;
  ``set_seed(42)``, ``ModelNew(*init)``; both ``.to(device, dtype)``;
* the trial seeds: ``torch.manual_seed(42)``, then one
  ``torch.randint(0, 2**32 - 1, (1,))`` per trial;
* per trial, under ``torch.no_grad()``: ``set_seed(trial seed)``,
  ``get_inputs()`` cast with ``.to(dtype)`` then moved; the reference's
  output, then ``ModelNew``'s, each followed by a device synchronisation;
  a shape mismatch fails the file, else ``torch.allclose`` with
  atol = rtol = 1e-4 in float32 and 1e-2 in float16 / bfloat16.

A file passes when every trial passes.  ``Model`` is the reference the
solution file imports (the problem's own module, see ``cupy_fused.reference``).

    python benchmarks/kernelbench/check.py [--trials 5] [--dtypes fp32 fp16 bf16]
        [--problems 37 88]
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import List

import torch

HERE = Path(__file__).resolve().parent
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}
SEED = 42


def solution_files():
    return sorted(HERE.glob("level2_*.py"), key=lambda p: int(p.name.split("_")[1]))


def problem_id(path: Path) -> str:
    return path.name.split("_")[1]


def load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def set_seed(seed: int) -> None:
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)  # the current device only, as the evaluator


def trial_seeds(seed: int, trials: int) -> List[int]:
    """The evaluator's per-trial seeds, drawn from ``seed``."""
    torch.manual_seed(seed)
    return [torch.randint(0, 2**32 - 1, (1,)).item() for _ in range(trials)]


def _process(value, device, dtype):
    """The evaluator's input handling: tensors cast, then moved."""
    if not isinstance(value, torch.Tensor):
        return value
    return value.to(dtype=dtype).to(device=device)


class Result:
    """Trials passed, the max |difference| of each failed trial, and the
    error of a shape mismatch."""

    def __init__(self, trials: int):
        self.passed = 0
        self.trials = trials
        self.max_diff: List[float] = []
        self.error = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.passed == self.trials


def check(path: Path, dtype: torch.dtype, trials: int = 5, device="cuda") -> Result:
    """Runs the evaluator's flow on one solution file in one dtype.

    Args:
        path: a ``level2_*.py`` solution file (``Model``, ``ModelNew``,
            ``get_inputs``, ``get_init_inputs``).
        dtype: torch.float32, torch.float16 or torch.bfloat16.
        trials: correctness trials (the evaluator's ``num_correct_trials``).
        device: the CUDA device.

    Returns:
        A :class:`Result`: trials passed, the max |difference| of each failed
        trial, and the error of a shape mismatch.
    """
    module = load(path)
    tol = TOLERANCE[dtype]
    result = Result(trials=trials)
    set_seed(SEED)
    init = [_process(v, device, dtype) for v in module.get_init_inputs()]
    with torch.no_grad():
        set_seed(SEED)
        ref = module.Model(*init)
        set_seed(SEED)
        new = module.ModelNew(*init)
        ref = ref.to(device=device, dtype=dtype)
        new = new.to(device=device, dtype=dtype)
        torch.cuda.synchronize(device)
    with torch.no_grad():
        for seed in trial_seeds(SEED, trials):
            set_seed(seed)
            inputs = [_process(v, device, dtype) for v in module.get_inputs()]
            expected = ref(*inputs)
            torch.cuda.synchronize(device)
            got = new(*inputs)
            torch.cuda.synchronize(device)
            if got.shape != expected.shape:
                result.error = f"output shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
                return result
            if torch.allclose(expected, got, atol=tol, rtol=tol):
                result.passed += 1
            else:
                result.max_diff.append((expected - got).abs().max().item())
            del inputs, expected, got
    del ref, new
    torch.cuda.empty_cache()
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--problems", nargs="+", default=None,
                        help="problem numbers (default: every solution file)")
    args = parser.parse_args(argv)
    files = [p for p in solution_files() if args.problems is None or problem_id(p) in args.problems]
    ok = True
    print(f"{'solution':<50}{'dtype':<7}{'passed':>8}  max |diff| of failed trials")
    for path in files:
        for name in args.dtypes:
            r = check(path, DTYPES[name], args.trials)
            ok &= r.ok
            detail = r.error or ", ".join(f"{d:.3g}" for d in r.max_diff)
            print(f"{path.name:<50}{name:<7}{r.passed:>4}/{r.trials:<3}  {detail}", flush=True)
    print("all passed" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
