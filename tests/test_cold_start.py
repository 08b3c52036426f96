"""benchmarks/cold_start.py: argument parsing, the driver and the table,
with fake measuring processes (CPU tier)."""
import importlib.util
import json
import logging
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_cold_start",
                                               REPO / "benchmarks/cold_start.py")
cold_start = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cold_start)


def test_defaults_cover_the_five_models_in_four_dtypes():
    args = cold_start.parse_args([])
    assert args.problems == [1, 37, 76, 88, 94]
    assert args.dtypes == ["fp32", "bf16", "fp16", "amp-bf16"]
    assert args.out is None and args.target_s == 8.0 and args.child is None
    args = cold_start.parse_args(["--problems", "37", "--dtypes", "amp-fp16", "--out", "x.json",
                                  "--target-s", "4"])
    assert (args.problems, args.dtypes, args.out, args.target_s) == ([37], ["amp-fp16"],
                                                                     "x.json", 4.0)
    with pytest.raises(SystemExit):
        cold_start.parse_args(["--problems", "38"])
    with pytest.raises(SystemExit):
        cold_start.parse_args(["--dtypes", "fp64"])


def test_the_result_line_is_found_among_other_output():
    out = "a warning\n" + cold_start.RESULT_PREFIX + json.dumps({"step_s": 1.5}) + "\n"
    assert cold_start.parse_child_output(0, out, "") == {"step_s": 1.5}
    failed = cold_start.parse_child_output(1, "", "Traceback ...\nRuntimeError: boom\n")
    assert failed == {"error": "exit status 1: Traceback ... | RuntimeError: boom"}


def test_the_kernel_log_reads_the_runtimes_compile_lines():
    handler = cold_start._KernelLog()
    logger = logging.getLogger("cupy_fused")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        logger.info("compiling %s for %s (first use; cached afterwards)", "a.cu: k<float>",
                    "sm_90a")
        logger.info("compiled %s for %s in %.2f s", "a.cu: k<float>", "sm_90a", 1.25)
        logger.info("compiled %s for %s in %.2f s", "b.cu: j<float>", "sm_90a", 0.5)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    assert handler.kernels == ["a.cu: k<float> (sm_90a)", "b.cu: j<float> (sm_90a)"]
    assert handler.seconds == pytest.approx(1.75)


def _result(problem, dtype, step_s, kernels):
    return dict(problem=problem, dtype=dtype, import_s=1.0, build_s=0.5, step_s=step_s,
                second_step_ms=0.8, kernels=kernels, kernel_s=step_s * 0.9 if kernels else 0.0,
                kernel_names=["k"] * kernels, modules=kernels, device="Fake GPU", arch="sm_90a",
                torch="2.13", cupy="14", nvrtc="13.0", cupy_fused="0.1.0", python="3.11")


def test_each_job_runs_cold_then_warm_in_a_fresh_cache(tmp_path, capsys):
    calls = []

    def child(problem, dtype, cache_dir, timeout_s):
        cold = not any(c[2] == cache_dir for c in calls)
        if cold:
            assert os.listdir(cache_dir) == []  # a new, empty cache
        calls.append((problem, dtype, cache_dir))
        (Path(cache_dir) / "kernel.cubin").write_bytes(b"x")
        if dtype == "fp16":
            return dict(error="exit status 1: RuntimeError: boom")
        return _result(problem, dtype, 9.5 if cold and problem == 37 else 0.4, 6)

    out = tmp_path / "cold.json"
    args = cold_start.parse_args(["--problems", "37", "76", "--dtypes", "fp32", "fp16",
                                  "--out", str(out)])
    rows = cold_start.run(args, child)
    # cold then warm on one cache per job; a failed cold process has no warm one
    assert [(p, d) for p, d, _ in calls] == [(37, "fp32"), (37, "fp32"), (37, "fp16"),
                                             (76, "fp32"), (76, "fp32"), (76, "fp16")]
    dirs = [c for _, _, c in calls]
    assert dirs[0] == dirs[1] and len(set(dirs)) == 4
    assert not any(os.path.exists(d) for d in dirs)  # removed afterwards
    data = json.loads(out.read_text())
    assert data["meta"]["device"] == "Fake GPU" and data["meta"]["target_s"] == 8.0
    assert data["rows"] == rows and len(rows) == 4
    first = rows[0]
    assert first["cold_step_s"] == 9.5 and first["warm_step_s"] == 0.4 and first["over_target"]
    assert rows[1]["error"] == "cold: exit status 1: RuntimeError: boom"
    assert rows[2]["over_target"] is False
    text = cold_start.table(rows, 8.0)
    lines = text.splitlines()
    assert lines[0].split()[:4] == ["problem", "dtype", "cold", "step"]
    assert lines[2].split()[:4] == ["37", "fp32", "9.50", "0.40"]
    assert lines[2].endswith("over the 8 s target")
    assert "cold: exit status 1: RuntimeError: boom" in lines[3] and " - " in lines[3]
    assert lines[-1] == "slowest cold first step: 9.50 s (problem 37, fp32); target 8 s"
    printed = capsys.readouterr().out
    assert printed.count("over the 8 s target") == 1  # each row printed as it comes


def test_a_machine_without_a_gpu_stops_after_the_first_process(tmp_path):
    calls = []

    def child(problem, dtype, cache_dir, timeout_s):
        calls.append(problem)
        return dict(error="no CUDA GPU is visible", fatal=True)

    rows = cold_start.run(cold_start.parse_args([]), child)
    assert calls == [1] and rows == [dict(problem=1, dtype="fp32",
                                          error="cold: no CUDA GPU is visible")]
