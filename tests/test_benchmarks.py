"""The benchmark runner's pure-Python parts (CPU tier)."""
import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_run", REPO / "benchmarks/run.py")
bench_run = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_run)

MiB = 2**20


def test_inputs_that_fit_in_l2_rotate_over_copies_twice_its_size():
    l2 = 50 * MiB
    assert bench_run.rotation_count(128 * MiB, l2) == 1  # problem 37's x: never cached
    assert bench_run.rotation_count(50 * MiB, l2) == 1
    assert bench_run.rotation_count(32 * MiB, l2) == 4   # 76/88/94's x: 4 x 32 >= 2 x 50
    assert bench_run.rotation_count(25 * MiB, l2) == 4
    assert bench_run.rotation_count(4096, l2) == 16      # capped
    assert bench_run.rotation_count(0, l2) == 1


def test_full_runs_every_dtype_mode_and_sweep():
    args = bench_run.parse_args(["--full"])
    assert args.dtypes == args.sweep_dtypes == ["fp32", "fp16", "bf16"]
    assert args.modes == ["forward", "train"] and args.sweep
    assert set(args.impls) == {"eager", "compile", "ours", "ours+compile", "gemm"}
    plain = bench_run.parse_args([])
    assert plain.dtypes == ["fp32"] and not plain.sweep
