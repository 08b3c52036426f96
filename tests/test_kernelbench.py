"""The KernelBench-format solution files load unchanged and pass the
evaluator's checks (GPU tier, benchmark shapes)."""
import importlib.util
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("kb_check", REPO / "benchmarks/kernelbench/check.py")
kb_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kb_check)


def test_one_solution_file_per_problem():
    """(CPU tier) every problem has a solution file defining the interface."""
    names = [p.name for p in kb_check.solution_files()]
    assert [n.split("_")[1] for n in names] == ["1", "37", "76", "88", "94"]
    for path in kb_check.solution_files():
        module = kb_check.load(path)
        for attr in ("Model", "ModelNew", "get_inputs", "get_init_inputs"):
            assert hasattr(module, attr), (path.name, attr)
        torch.manual_seed(0)
        ref = module.Model(*module.get_init_inputs())
        torch.manual_seed(0)
        new = module.ModelNew(*module.get_init_inputs())
        assert list(ref.state_dict()) == list(new.state_dict())


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("path", kb_check.solution_files(), ids=kb_check.problem_id)
def test_solution_passes_the_evaluator_check(path, dtype):
    """KernelBench's correctness flow (seed 42, its per-trial seeds, five
    trials, atol = rtol = 1e-4 / 1e-2).  In half precision the GroupNorm
    solutions round like eager (eager_rounding=True, see their docstrings)."""
    result = kb_check.check(path, dtype, trials=5)
    assert result.ok, (result.passed, result.max_diff, result.error)


def test_trial_seeds_follow_the_evaluator():
    """(CPU tier) the per-trial seeds are drawn as the evaluator draws them:
    torch.manual_seed(42), then one randint(0, 2**32 - 1) per trial."""
    torch.manual_seed(42)
    expected = [torch.randint(0, 2**32 - 1, (1,)).item() for _ in range(5)]
    torch.manual_seed(0)  # whatever the generator held before
    assert kb_check.trial_seeds(42, 5) == expected
    assert len(set(expected)) == 5
