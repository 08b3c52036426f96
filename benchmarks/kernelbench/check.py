"""A small loader that mimics KernelBench's evaluation flow on the solution
files of this folder: for each file and dtype, over several seeded trials,
seed and build the reference ``Model`` and ``ModelNew`` from
``get_init_inputs()``, cast both and the inputs to the dtype, and compare the
outputs with the evaluator's tolerances (1e-4 in fp32, 1e-2 in fp16/bf16).

    python benchmarks/kernelbench/check.py [--trials 5] [--dtypes fp32 fp16 bf16]
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def solution_files():
    return sorted(HERE.glob("level2_*.py"), key=lambda p: int(p.name.split("_")[1]))


def load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check(path: Path, dtype: torch.dtype, trials: int, device="cuda"):
    """Returns (passed trials, max abs difference seen)."""
    module = load(path)
    tol = TOLERANCE[dtype]
    passed, worst = 0, 0.0
    for trial in range(trials):
        seed = 42 + trial
        init = module.get_init_inputs()
        torch.manual_seed(seed)
        ref = module.Model(*init).to(device=device, dtype=dtype)
        torch.manual_seed(seed)
        new = module.ModelNew(*init).to(device=device, dtype=dtype)
        same_params = all(torch.equal(a, b) for a, b in zip(ref.state_dict().values(),
                                                               new.state_dict().values()))
        torch.manual_seed(seed)
        inputs = [t.to(device=device, dtype=dtype) for t in module.get_inputs()]
        with torch.no_grad():
            expected = ref(*inputs)
            got = new(*inputs)
        worst = max(worst, (got.float() - expected.float()).abs().max().item())
        if (same_params and got.shape == expected.shape
                and torch.allclose(got, expected, atol=tol, rtol=tol)):
            passed += 1
        del ref, new, inputs, expected, got
        torch.cuda.empty_cache()
    return passed, worst


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    args = parser.parse_args(argv)
    ok = True
    print(f"{'solution':<50}{'dtype':<7}{'passed':>8}{'max |diff|':>12}")
    for path in solution_files():
        for name in args.dtypes:
            passed, worst = check(path, DTYPES[name], args.trials)
            ok &= passed == args.trials
            print(f"{path.name:<50}{name:<7}{passed:>4}/{args.trials:<3}{worst:>12.2e}", flush=True)
    print("all passed" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
