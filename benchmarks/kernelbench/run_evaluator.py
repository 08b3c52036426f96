"""Runs KernelBench's own evaluator on the solution files of this folder.

    python benchmarks/kernelbench/run_evaluator.py --kernelbench PATH [--trials 5]
        [--dtypes fp32 fp16 bf16] [--problems 37 88]

PATH is a checkout of ScalingIntelligence/KernelBench (not shipped here).
For each solution file and dtype this calls its
``kernelbench.eval.eval_kernel_against_ref`` with the problem's own source
(``KernelBench/level2/<name>.py``) as the reference, the solution file's
source as the custom model, seed 42 and ``--trials`` correctness trials,
without timing.

The evaluator's package imports modules it needs only for generating
kernels with language models or for timing reports (``openai``,
``litellm``, ``dotenv``, ``tqdm``, and ``pydantic`` / ``requests``).  Where one is not
installed (an offline GPU machine), an empty stand-in module takes its
place; ``pydantic.BaseModel`` becomes a plain attribute holder.  None of
them takes part in the correctness check.
"""
from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from check import DTYPES, problem_id, solution_files  # noqa: E402


class _AttributeHolder:
    """Stand-in for ``pydantic.BaseModel``: class defaults, then keywords."""

    def __init__(self, **kwargs):
        for cls in reversed(type(self).__mro__):
            for key, value in vars(cls).items():
                if not key.startswith("_") and not callable(value):
                    setattr(self, key, value.copy() if isinstance(value, dict) else value)
        for key, value in kwargs.items():
            setattr(self, key, value)


def _stand_ins() -> list:
    """Installs empty modules for the evaluator's unused, missing imports."""
    installed = []
    for name in ("openai", "litellm", "dotenv", "pydantic", "requests", "tqdm"):
        try:
            __import__(name)
            continue
        except ImportError:
            pass
        module = types.ModuleType(name)
        module.OpenAI = object
        module.completion = None
        module.load_dotenv = lambda *a, **k: None
        module.BaseModel = _AttributeHolder
        module.tqdm = lambda iterable=None, *a, **k: iterable
        sys.modules[name] = module
        installed.append(name)
    return installed


def _problem_source(kernelbench: Path, solution: Path) -> Path:
    name = solution.name[len("level2_"):]
    return kernelbench / "KernelBench" / "level2" / name


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernelbench", type=Path, required=True,
                        help="a checkout of ScalingIntelligence/KernelBench")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--problems", nargs="+", default=None)
    args = parser.parse_args(argv)
    stand_ins = _stand_ins()
    sys.path.insert(0, str(args.kernelbench / "src"))
    from kernelbench.eval import eval_kernel_against_ref

    if stand_ins:
        print(f"stand-in modules for unused imports: {', '.join(stand_ins)}")
    files = [p for p in solution_files() if args.problems is None or problem_id(p) in args.problems]
    ok = True
    print(f"{'solution':<50}{'dtype':<7}{'compiled':>9}{'correct':>9}  trials")
    for path in files:
        reference = _problem_source(args.kernelbench, path).read_text()
        custom = path.read_text()
        for name in args.dtypes:
            result = eval_kernel_against_ref(
                reference, custom, seed_num=42, num_correct_trials=args.trials,
                measure_performance=False, precision=DTYPES[name], backend="cuda",
                device=torch.cuda.current_device())
            correct = bool(result and result.correctness)
            ok &= correct
            meta = result.metadata if result else {}
            trials = meta.get("correctness_trials", "")
            detail = meta.get("max_difference") or meta.get("runtime_error") or ""
            print(f"{path.name:<50}{name:<7}{str(bool(result and result.compiled)):>9}"
                  f"{str(correct):>9}  {trials} {detail}", flush=True)
    print("all passed" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
