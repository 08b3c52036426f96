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


def test_resume_runs_only_the_jobs_without_rows():
    jobs = [("fp32", 76, None), ("bf16", 76, None), ("fp32", 76, 64), ("fp32", 1, 8)]
    rows = [dict(problem=76, dtype="float32", batch=1024, sweep=False),
            dict(problem=76, dtype="float32", batch=64, sweep=True)]
    assert bench_run.pending_jobs(jobs, rows) == [("bf16", 76, None), ("fp32", 1, 8)]
    assert bench_run.pending_jobs(jobs, []) == jobs
    args = bench_run.parse_args(["--full", "--resume", "r.json", "--time-limit", "9"])
    assert args.resume == "r.json" and args.time_limit == 9.0


def test_run_count_times_the_gemm_alone_in_the_forward_mode_only():
    jobs = [("fp32", 76, None), ("fp32", 76, 64)]
    impls, sweep_impls = ["eager", "compile", "ours", "gemm"], ["eager", "ours", "gemm"]
    # benchmark shape: 4 forward + 3 train; sweep point: 3 forward + 2 train
    assert bench_run.run_count(jobs, ["forward", "train"], impls, sweep_impls) == 12


def test_a_time_limited_run_saves_each_job_and_resume_finishes_it(tmp_path, monkeypatch, capsys):
    import json

    ran = []

    def fake_bench(problem, dtype, modes, impls, iters, warmup, shapes, progress, batch=None,
                   errors=True, peak=None, min_ms=0.0):
        ran.append((problem, dtype, batch))
        progress()
        return [dict(problem=problem, dtype=str(dtype).replace("torch.", ""), mode="forward",
                     impl="ours", batch=batch or 1024, sweep=batch is not None, median_ms=1.0,
                     min_ms=1.0, peak_extra_gib=None, tflops=1.0, ceiling_fraction=0.5,
                     fwd_rel_error=None)]

    monkeypatch.setattr(bench_run, "bench_problem", fake_bench)
    _fake_device(monkeypatch)
    argv = ["--problems", "76", "88", "--dtypes", "fp32", "bf16", "--modes", "forward",
            "--no-plots", "--out", str(tmp_path)]
    bench_run.main(argv + ["--time-limit", "0"])  # one job, then stop
    assert len(ran) == 1
    (saved,) = tmp_path.glob("*.json")
    assert len(json.load(open(saved))["rows"]) == 1
    assert "--resume" in capsys.readouterr().out
    bench_run.main(argv + ["--resume", str(saved)])
    assert len(ran) == 4 and len(set(ran)) == 4
    data = json.load(open(saved))
    assert len(data["rows"]) == 4 and len(data["meta"]["invocations"]) == 2
    assert (tmp_path / saved.name.replace(".json", ".md")).exists()


def _fake_device(monkeypatch):
    import torch

    monkeypatch.setattr(bench_run, "ceilings", lambda: {"bf16_tflops": 2.0, "tf32_tflops": 3.0})
    monkeypatch.setattr(bench_run, "gpu_state", lambda: {})
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")


def test_sweep_points_take_fewer_iterations(tmp_path, monkeypatch):
    iters = {}

    def fake_bench(problem, dtype, modes, impls, n, warmup, shapes, progress, batch=None,
                   errors=True, peak=None, min_ms=0.0):
        iters[batch] = n
        least[batch] = min_ms
        return []

    least = {}
    monkeypatch.setattr(bench_run, "bench_problem", fake_bench)
    _fake_device(monkeypatch)
    bench_run.main(["--problems", "76", "--modes", "forward", "--sweep", "--iters", "30",
                    "--sweep-iters", "7", "--no-plots", "--out", str(tmp_path)])
    assert iters.pop(None) == 30 and set(iters) == set(bench_run.SWEEP_GEMM)
    assert set(iters.values()) == {7}
    assert set(least.values()) == {150.0}  # the default --min-ms, sweep points included
    bench_run.main(["--problems", "76", "--modes", "forward", "--quick", "--no-plots",
                    "--out", str(tmp_path)])
    assert least[None] == 0.0  # --quick: a fixed count of iterations


def test_short_steps_get_more_timed_calls_up_to_ten_times():
    from cupy_fused.testing import timed_calls

    assert timed_calls(5.0, 30, 150.0, 300) == 30       # 30 x 5 ms: enough already
    assert timed_calls(0.6, 30, 150.0, 300) == 250      # 0.6 ms steps: 150 ms of them
    assert timed_calls(0.01, 30, 150.0, 300) == 300     # capped
    assert timed_calls(0.6, 30, 0.0, 300) == 30         # min_ms 0: as asked
    assert timed_calls(0.0, 30, 150.0, 300) == 30       # no estimate


def test_time_interleaved_times_each_function_its_own_count(monkeypatch):
    """With fake CUDA events (CPU tier): the calls each function gets, in
    turns, after its warm-up and the three calls of the estimate."""
    import torch

    from cupy_fused import testing

    clock = [0.0]

    class FakeEvent:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self):
            self.t = clock[0]

        def elapsed_time(self, other):
            return other.t - self.t

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    calls = {"short": 0, "long": 0}

    def step(name, ms):
        def fn():
            calls[name] += 1
            clock[0] += ms
        return fn

    times = testing.time_interleaved({"short": step("short", 0.5), "long": step("long", 20.0)},
                                     iters=10, warmup=2, rounds=5, min_ms=50.0)
    # warm-up 2 + estimate 3 + one untimed call per round 5 + timed calls
    assert calls == {"short": 2 + 3 + 5 + 100, "long": 2 + 3 + 5 + 10}
    assert times == {"short": (0.5, 0.5), "long": (20.0, 20.0)}


def test_plots_draw_the_speedup_bars_and_the_sweep_grid(tmp_path):
    """benchmarks/plot.py on a small results file: both PNGs, one sweep panel
    per (dtype, problem), a series per (implementation, mode) present."""
    import json

    import matplotlib

    matplotlib.use("Agg")
    spec = importlib.util.spec_from_file_location("bench_plot", REPO / "benchmarks/plot.py")
    plot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot)
    rows = []
    for dtype in ("float32", "bfloat16"):
        for problem in (37, 76):
            for mode in ("forward", "train"):
                for impl, ms in (("eager", 2.0), ("compile", 1.5), ("ours", 1.0)):
                    rows.append(dict(problem=problem, dtype=dtype, mode=mode, impl=impl,
                                     batch=1024, sweep=False, median_ms=ms))
                for batch in (1, 64, 1024):
                    for impl in ("eager", "ours") + (("gemm",) if mode == "forward" else ()):
                        rows.append(dict(problem=problem, dtype=dtype, mode=mode, impl=impl,
                                         batch=batch, sweep=True, median_ms=0.1 * batch))
    path = tmp_path / "run.json"
    path.write_text(json.dumps(dict(meta=dict(device="GPU", torch="2.x", date="today"),
                                    rows=rows)))
    drawn = []
    real_savefig = plot.plt.Figure.savefig

    def savefig(fig, out, **kw):
        drawn.append((Path(out).name, fig))
        return real_savefig(fig, out, **kw)

    plot.plt.Figure.savefig = savefig
    try:
        plot.main(str(path))
    finally:
        plot.plt.Figure.savefig = real_savefig
    assert [name for name, _ in drawn] == ["run.speedup.png", "run.sweep.png"]
    assert all((tmp_path / name).stat().st_size > 0 for name, _ in drawn)
    sweep_axes = drawn[1][1].axes
    assert len(sweep_axes) == 4  # 2 dtypes x 2 problems
    assert sorted(line.get_label() for line in sweep_axes[0].get_lines()) == [
        "eager, forward", "eager, train", "gemm, forward", "ours, forward", "ours, train"]
