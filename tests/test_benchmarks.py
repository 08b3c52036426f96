"""The benchmark runner's pure-Python parts (CPU tier)."""
import contextlib
import copy
import gc
import importlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_run", REPO / "benchmarks/run.py")
bench_run = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_run)
_kspec = importlib.util.spec_from_file_location("bench_kernels", REPO / "benchmarks/kernels.py")
bench_kernels = importlib.util.module_from_spec(_kspec)
_kspec.loader.exec_module(bench_kernels)
# The harness the scripts share (run.py has put benchmarks/ on sys.path): the
# same module object, so that patching it reaches them.
bench_harness = importlib.import_module("harness")
bench_publish = importlib.import_module("publish")

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
    assert args.dtypes == args.sweep_dtypes == ["fp32", "fp16", "bf16", "amp-bf16", "amp-fp16"]
    assert args.modes == ["forward", "train"] and args.sweep
    assert set(args.impls) == {"eager", "compile", "ours", "ours+compile", "gemm", "ours+graphs",
                               "ours+graphed", "compile+graphs"}
    plain = bench_run.parse_args([])
    assert plain.dtypes == ["fp32"] and not plain.sweep
    assert "ours+graphs" not in plain.impls  # it compiles: asked for, or --full
    assert "ours+graphed" not in plain.impls  # (its graphs: asked for, or --full)
    assert "compile+graphs" not in plain.impls
    assert bench_run.parse_args(["--full", "--impls", "eager", "ours"]).impls == ["eager", "ours"]


def test_benchmark_processes_compile_without_the_aot_autograd_cache():
    """torch 2.11's AOTAutograd cache does not key on autocast's dtype, so a
    graph compiled under one autocast dtype was served under the other
    (harness): importing the harness turns that cache off (a torch without
    it has none to turn off)."""
    if not hasattr(torch._functorch.config, "enable_autograd_cache"):
        pytest.skip("this torch has no AOTAutograd cache")
    assert torch._functorch.config.enable_autograd_cache is False


def test_autocast_modes_are_dtype_choices():
    args = bench_run.parse_args(["--dtypes", "amp-bf16", "amp-fp16", "bf16",
                                 "--sweep-dtypes", "amp-fp16"])
    assert args.dtypes == ["amp-bf16", "amp-fp16", "bf16"] and args.sweep_dtypes == ["amp-fp16"]
    assert bench_run.dtype_label("amp-bf16") == "amp-bf16"
    assert bench_run.dtype_label("bf16") == "bfloat16"
    assert bench_run.model_dtype("amp-fp16") is torch.float32
    assert bench_run.model_dtype("fp16") is torch.float16
    assert bench_run.autocast_dtype("amp-bf16") is torch.bfloat16
    assert bench_run.autocast_dtype("amp-fp16") is torch.float16
    assert bench_run.autocast_dtype("bf16") is None
    # resume: an amp job is done once rows carry its label
    jobs = [("amp-bf16", 76, None), ("bf16", 76, None)]
    rows = [dict(problem=76, dtype="amp-bf16", batch=1024, sweep=False)]
    assert bench_run.pending_jobs(jobs, rows) == [("bf16", 76, None)]
    peaks = {"bf16_tflops": 900.0, "tf32_tflops": 450.0}
    assert bench_run.ceiling(76, "amp-fp16", peaks) == 900.0  # tensor cores in half precision
    with pytest.raises(SystemExit):
        bench_run.parse_args(["--dtypes", "amp-fp32"])


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
    ran = []

    def fake_bench(problem, dtype, modes, impls, iters, warmup, shapes, progress, batch=None,
                   errors=True, peak=None, min_ms=0.0, **kw):
        ran.append((problem, dtype, batch))
        progress()
        return [dict(problem=problem, dtype=bench_run.dtype_label(dtype), mode="forward",
                     impl="ours", batch=batch or 1024, sweep=batch is not None, median_ms=1.0,
                     min_ms=1.0, peak_extra_gib=None, tflops=1.0, ceiling_fraction=0.5,
                     fwd_rel_error=None)]

    monkeypatch.setattr(bench_run, "bench_problem", fake_bench)
    _fake_device(monkeypatch)
    argv = ["--problems", "76", "88", "--dtypes", "fp32", "amp-bf16", "--modes", "forward",
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
    monkeypatch.setattr(bench_run, "ceilings", lambda: {"bf16_tflops": 2.0, "tf32_tflops": 3.0})
    monkeypatch.setattr(bench_run, "gpu_state", lambda: {})
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")


def test_sweep_points_take_fewer_iterations(tmp_path, monkeypatch):
    iters = {}

    def fake_bench(problem, dtype, modes, impls, n, warmup, shapes, progress, batch=None,
                   errors=True, peak=None, min_ms=0.0, **kw):
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
    timed_calls = bench_harness.timed_calls
    assert timed_calls(5.0, 30, 150.0, 300) == 30       # 30 x 5 ms: enough already
    assert timed_calls(0.6, 30, 150.0, 300) == 250      # 0.6 ms steps: 150 ms of them
    assert timed_calls(0.01, 30, 150.0, 300) == 300     # capped
    assert timed_calls(0.6, 30, 0.0, 300) == 30         # min_ms 0: as asked
    assert timed_calls(0.0, 30, 150.0, 300) == 30       # no estimate


def _fake_event_on(clock, ms_per_tick):
    """A stand-in for torch.cuda.Event: recording reads ``clock[0]``, and
    elapsed_time gives the ticks between two records in milliseconds."""
    class FakeEvent:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self):
            self.t = clock[0]

        def elapsed_time(self, other):
            return (other.t - self.t) * ms_per_tick
    return FakeEvent


def test_product_tflops(monkeypatch):
    """harness.product_tflops (CPU tier, timing faked): 2 n^3 FLOP over the
    best time, the product of two n x n matrices of the dtype, TF32 allowed
    to it only when asked, and the flag off again after."""
    seen = []

    def fake_time_ms(fn, iters, warmup):
        c = fn()
        seen.append((c.shape, c.dtype, iters, torch.backends.cuda.matmul.allow_tf32))
        return 3.0, 2.0

    monkeypatch.setattr(bench_harness, "time_ms", fake_time_ms)
    before = torch.backends.cuda.matmul.allow_tf32  # (a flag monkeypatch cannot delete at teardown)
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        assert bench_harness.product_tflops(torch.float32, True, n=4, iters=7, device="cpu") \
            == 2 * 4 ** 3 / 2e9
        assert bench_harness.product_tflops(torch.bfloat16, n=8, device="cpu") == 2 * 8 ** 3 / 2e9
        assert seen == [((4, 4), torch.float32, 7, True), ((8, 8), torch.bfloat16, 10, False)]
        assert not torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def test_time_interleaved_times_each_function_its_own_count(monkeypatch):
    """With fake CUDA events (CPU tier): the calls each function gets, in
    turns, after its warm-up and the three calls of the estimate."""
    clock = [0.0]
    monkeypatch.setattr(torch.cuda, "Event", _fake_event_on(clock, 1.0))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    calls = {"short": 0, "long": 0}

    def step(name, ms):
        def fn():
            calls[name] += 1
            clock[0] += ms
        return fn

    times = bench_harness.time_interleaved(
        {"short": step("short", 0.5), "long": step("long", 20.0)},
        iters=10, warmup=2, rounds=5, min_ms=50.0)
    # warm-up 2 + estimate 3 + one untimed call per round 5 + timed calls
    assert calls == {"short": 2 + 3 + 5 + 100, "long": 2 + 3 + 5 + 10}
    assert times == {"short": (0.5, 0.5), "long": (20.0, 20.0)}


def test_the_benchmarks_share_one_dtype_table():
    assert bench_run.DTYPES is bench_kernels.DTYPES is bench_harness.DTYPES
    assert list(bench_harness.DTYPES) == ["fp32", "fp16", "bf16", "amp-bf16", "amp-fp16"]
    assert bench_run.ALL_DTYPES == tuple(bench_harness.DTYPES)
    assert bench_kernels.parse_args([]).dtypes == list(bench_harness.DTYPES)
    for name, choice in bench_harness.DTYPES.items():
        # autocast modes: float32 model, half compute; the others: one dtype
        assert (choice.autocast is not None) == name.startswith("amp-")
        assert choice.compute == (choice.autocast or choice.model)
        assert (choice.model is torch.float32) or choice.autocast is None


def test_progress_without_tqdm_is_one_line_per_item_on_stderr(monkeypatch, capsys):
    monkeypatch.setattr(bench_harness, "_tqdm", None)
    with bench_harness.Progress(3, "timed runs") as progress:
        progress("76 float32 b1024 forward eager")
        bench_harness.say("  a result line")
        progress("76 float32 b1024 forward ours")
        progress()
    out, err = capsys.readouterr()
    assert out == "  a result line\n"
    lines = err.splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("timed runs [1/3] 0:0") and lines[0].endswith(" forward eager")
    assert lines[1].startswith("timed runs [2/3] ") and lines[2].startswith("timed runs [3/3] ")
    with pytest.raises(ImportError, match="tqdm"):
        bench_harness.Progress(3, bar=True)


def test_progress_bar_with_tqdm_keeps_stdout_clean(capsys):
    pytest.importorskip("tqdm")
    assert bench_harness._tqdm is not None
    with bench_harness.Progress(2, "timed runs") as progress:
        progress("first")
        bench_harness.say("  a result line")
        progress("second")
    out, err = capsys.readouterr()
    assert out == "  a result line\n"
    assert "timed runs" in err and "2/2" in err and "second" in err


def test_run_reports_progress_on_stderr_and_results_on_stdout(tmp_path, monkeypatch, capsys):
    """A whole run (timing faked), without tqdm: one stderr line per timed
    implementation; stdout and the files as with no progress at all."""
    def fake_bench(problem, dtype, modes, impls, iters, warmup, shapes, progress, batch=None,
                   **kw):
        rows = []
        for impl in impls:
            rows.append(dict(problem=problem, dtype=bench_run.dtype_label(dtype), mode="forward",
                             impl=impl, batch=1024, sweep=False, median_ms=1.0, min_ms=1.0,
                             peak_extra_gib=None, tflops=1.0, ceiling_fraction=0.5,
                             fwd_rel_error=None))
            bench_run.say(f"  {problem} {impl} timed")
            progress(f"{problem} {impl}")
        return rows

    monkeypatch.setattr(bench_run, "bench_problem", fake_bench)
    monkeypatch.setattr(bench_harness, "_tqdm", None)
    _fake_device(monkeypatch)
    bench_run.main(["--problems", "76", "88", "--modes", "forward", "--impls", "eager", "ours",
                    "--no-plots", "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert [line.split("] ")[0] for line in err.splitlines()] == [
        f"timed runs [{i}/4" for i in range(1, 5)]
    assert err.splitlines()[-1].endswith(" 88 ours")
    assert "timed runs" not in out
    assert out.index("  76 eager timed") < out.index("  88 ours timed") < out.index("| problem |")
    (saved,) = tmp_path.glob("*.json")
    rows = json.loads(saved.read_text())["rows"]
    assert len(rows) == 4
    assert saved.with_suffix(".md").read_text() == bench_run.markdown(rows) + "\n"


def test_scripts_start_from_anywhere_and_show_their_help(tmp_path):
    """``python <script> --help`` outside the repository, with the library on
    PYTHONPATH as scripts/gpu_check.sh sets it: each finds the harness by its
    own path.  (In parallel: each subprocess spends a second importing torch.)"""
    scripts = ["benchmarks/run.py", "benchmarks/kernels.py", "benchmarks/gemm.py",
               "benchmarks/host_overhead.py", "benchmarks/publish.py", "benchmarks/scaling.py",
               "benchmarks/cold_start.py", "scripts/tune_gn.py", "scripts/tune_gemm.py"]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    procs = {script: subprocess.Popen([sys.executable, str(REPO / script), "--help"],
                                      cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True)
             for script in scripts}
    for script, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, (script, err)
        assert out.startswith("usage: "), script


def test_plots_draw_the_speedup_bars_and_the_sweep_grid(tmp_path):
    """benchmarks/plot.py on a small results file: both PNGs, one sweep panel
    per (dtype, problem), a series per (implementation, mode) present."""
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


class _Recorder(torch.nn.Module):
    """A tiny CPU model that records, per forward, whether autocast was on
    and, per backward, the output's gradient and whether autocast was on."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 4)
        self.forwards, self.backwards = [], []

    def forward(self, x):
        self.forwards.append(torch.is_autocast_enabled("cpu"))
        y = self.linear(x)
        if y.requires_grad:
            y.register_hook(lambda g: self.backwards.append(
                (g.clone(), torch.is_autocast_enabled("cpu"))))
        return y


@pytest.mark.parametrize("amp", [None, torch.bfloat16])
def test_training_step_backpropagates_one_fixed_random_gradient(amp):
    """The step runs y.backward(g) with the same g every time (not the
    constant gradient of y.sum()), the forward under autocast, the backward
    outside it."""
    torch.manual_seed(0)
    model = _Recorder()
    inputs = [torch.rand(3, 8), torch.rand(3, 8)]
    train_inputs = [t.clone().requires_grad_(True) for t in inputs]
    g = bench_harness.fixed_grad(model, inputs[0], amp, device_type="cpu")
    assert g.shape == (3, 4) and g.dtype == (amp or torch.float32)
    assert torch.equal(g, bench_harness.fixed_grad(model, inputs[1], amp, device_type="cpu"))
    assert g.float().std() > 0.5  # random, not ones
    model.forwards.clear()
    step, reset = bench_harness.step_fns(model, "train", inputs, train_inputs, g, amp, device_type="cpu")
    for _ in range(3):
        step()
    assert model.forwards == [amp is not None] * 3
    assert len(model.backwards) == 3
    for grad, autocast_on in model.backwards:
        assert torch.equal(grad, g) and not autocast_on
    # each step drops the gradients of the one before: only the last input's is left
    assert [t.grad is not None for t in train_inputs] == [True, False]
    reset()
    assert model.linear.weight.grad is None and all(t.grad is None for t in train_inputs)
    with pytest.raises(ValueError):
        bench_harness.step_fns(model, "train", inputs, train_inputs, None, amp, device_type="cpu")


def test_fixed_gradient_takes_the_outputs_memory_format():
    """A channels-last y gets a channels-last g with the values an NCHW one
    would hold (the same step for every layout but the layout)."""
    conv = torch.nn.Conv2d(3, 5, 3)
    x = torch.rand(2, 3, 9, 7)
    g = bench_harness.fixed_grad(conv, x, device_type="cpu")
    g_cl = bench_harness.fixed_grad(conv, x.contiguous(memory_format=torch.channels_last),
                                    device_type="cpu")
    assert g.is_contiguous() and not g_cl.is_contiguous()
    assert g_cl.is_contiguous(memory_format=torch.channels_last) and torch.equal(g, g_cl)


def test_forward_step_runs_under_no_grad_and_autocast():
    model = _Recorder()
    inputs = [torch.rand(3, 8)]
    step, _ = bench_harness.step_fns(model, "forward", inputs, inputs, amp=torch.bfloat16,
                                     device_type="cpu")
    step()
    assert model.forwards == [True] and model.backwards == []


def test_steps_keep_their_output_for_a_caller_that_asks():
    """keep gets each step's output (detached in training), as ab.py reads
    it."""
    model = _Recorder()
    inputs = [torch.rand(3, 8)]
    train_inputs = [inputs[0].clone().requires_grad_(True)]
    g = bench_harness.fixed_grad(model, inputs[0], device_type="cpu")
    for mode in ("forward", "train"):
        kept = {}
        step, _ = bench_harness.step_fns(model, mode, inputs, train_inputs, g, device_type="cpu",
                                         keep=kept)
        step()
        want = model.linear(inputs[0])
        assert torch.allclose(kept["y"], want) and kept["y"].grad_fn is None


@pytest.mark.gpu
@pytest.mark.parametrize("amp", [None, torch.bfloat16], ids=["float32", "amp_bf16"])
def test_graphed_steps_compute_the_module_s_step(amp, device):
    """ours+graphed's steps (harness.graphed_step_fns: the module's forward
    and backward as CUDA graphs) on rotated inputs: each training step's
    input gradient and parameter gradients bit for bit those of the module
    itself on that input (the step keeps no output to compare); the
    forward's output too."""
    import cupy_fused

    torch.manual_seed(0)
    model = cupy_fused.GemmAddRelu(64, 256, (256,)).to(device)
    graphed = copy.deepcopy(model)
    inputs = [torch.rand(96, 64, device=device) for _ in range(2)]
    train_inputs = [t.clone().requires_grad_(True) for t in inputs]
    g = bench_harness.fixed_grad(model, inputs[0], amp)
    step, _ = bench_harness.graphed_step_fns(graphed, "train", inputs, train_inputs, g, amp)
    for i in (0, 1, 0):
        step()
        for p in model.parameters():
            p.grad = None
        x = inputs[i].clone().requires_grad_(True)
        with bench_harness.autocast_context(amp, cache=False):
            y = model(x)
        y.backward(g)
        assert torch.equal(train_inputs[i].grad, x.grad)
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(graphed.parameters(), model.parameters()))
    forward = copy.deepcopy(model)
    step, _ = bench_harness.graphed_step_fns(forward, "forward", inputs, train_inputs, amp=amp)
    step()
    with torch.no_grad(), bench_harness.autocast_context(amp, cache=False):
        assert torch.equal(forward(inputs[1]), model(inputs[1]))  # (a replay)
    del graphed, forward, step
    gc.collect()  # (this test's graphs, before any later capture)


@pytest.mark.gpu
def test_graphed_steps_capture_after_a_graphed_module_is_dropped(device):
    """The benchmark drops each mode's graphed copy before the next mode's
    captures.  A dropped graphed module is freed only by the collector (it
    and its graphs form a reference cycle), and a graph freed during a
    capture invalidates it: graphed_step_fns collects before it captures.
    The new module runs the collector inside its own capture, so that any
    dead graph left over would be freed there."""
    import cupy_fused

    class CollectsWhileCapturing(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            if torch.cuda.is_current_stream_capturing():
                gc.collect()
            return self.inner(x)

    inputs = [torch.rand(96, 64, device=device)]
    train_inputs = [t.clone().requires_grad_(True) for t in inputs]
    dropped = cupy_fused.GemmAddRelu(64, 256, (256,)).to(device)
    bench_harness.graphed_step_fns(dropped, "forward", inputs, train_inputs)
    del dropped
    model = cupy_fused.GemmAddRelu(64, 256, (256,)).to(device)
    graphed = CollectsWhileCapturing(copy.deepcopy(model))
    step, _ = bench_harness.graphed_step_fns(graphed, "forward", inputs, train_inputs)
    step()
    with torch.no_grad():
        assert torch.equal(graphed(inputs[0]), model(inputs[0]))  # (a replay)
    del graphed, step
    gc.collect()  # (this test's own graphs, before any later capture)


def test_cuda_graph_steps_begin_a_new_generation_each(monkeypatch):
    marks = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    model = _Recorder()
    inputs = [torch.rand(3, 8)]
    train_inputs = [inputs[0].clone().requires_grad_(True)]
    g = bench_harness.fixed_grad(model, inputs[0], device_type="cpu")
    for mode in ("forward", "train"):
        step, _ = bench_harness.step_fns(model, mode, inputs, train_inputs, g, graphs=True,
                                         device_type="cpu")
        step()
        step()
    assert len(marks) == 4
    step, _ = bench_harness.step_fns(model, "train", inputs, train_inputs, g, device_type="cpu")
    step()
    assert len(marks) == 4  # not without graphs


def _fake_cuda_timing(monkeypatch, gpu_ms_per_call, host_ms_per_call):
    """Fake CUDA events and a fake host clock: each call of the returned
    ``work`` advances the GPU by ``gpu_ms_per_call`` and the host by
    ``host_ms_per_call``."""
    clock = {"gpu": 0.0, "host": 0.0}

    class FakeEvent:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self):
            self.t = clock["gpu"]

        def elapsed_time(self, other):
            return other.t - self.t

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: None)
    monkeypatch.setattr(bench_harness, "_sleep_cycles_per_ms", [])

    def work():
        clock["gpu"] += gpu_ms_per_call
        clock["host"] += host_ms_per_call / 1e3

    return work, lambda: clock["host"]


def test_forward_errors_measure_the_compiled_reference_when_asked(monkeypatch):
    """forward_errors (CPU tier): with compiled=True also the reference
    under torch.compile (here a stand-in that runs it with its weight
    doubled, as a baseline that computes something else would), its error
    beside eager's; without, no compile entry."""
    def fake_compile(model):
        wrong = copy.deepcopy(model)
        with torch.no_grad():
            wrong.gemm.weight.mul_(2)
        return wrong

    monkeypatch.setattr(torch, "compile", fake_compile)
    _, args, shape = bench_run.reference.SMALL_PROBLEMS[76]
    errs = bench_run.forward_errors(76, args, shape, "fp32", device="cpu", compiled=True)
    # (ours runs on CUDA only: on the CPU its forward raises and is left out)
    assert set(errs) == {"eager", "compile"} and errs["eager"] < 1e-5 < 0.1 < errs["compile"]
    assert set(bench_run.forward_errors(76, args, shape, "fp32", device="cpu")) == {"eager"}


def test_host_and_gpu_time_per_step(monkeypatch):
    work, clock = _fake_cuda_timing(monkeypatch, gpu_ms_per_call=0.2, host_ms_per_call=0.5)
    host, gpu = bench_run.host_and_gpu_ms(work, steps=10, rounds=3, clock=clock)
    assert host == pytest.approx(0.5) and gpu == pytest.approx(0.2)


def test_bench_problem_on_cpu_in_an_autocast_mode(monkeypatch):
    """bench_problem end to end on the CPU (timers faked): eager runs under
    CPU autocast, ours and the GEMM alone (CUDA only) fail into rows with
    an error, and the rows carry the amp label and the host times."""
    monkeypatch.setattr(bench_run, "l2_bytes", lambda: 50 * MiB)
    monkeypatch.setattr(bench_run, "peak_extra_gib", lambda fn, reset: (reset(), fn(), 0.25)[-1])
    monkeypatch.setattr(bench_run, "host_and_gpu_ms", lambda step, n, r: (step(), 0.5, 0.3)[1:])

    def fake_interleaved(fns, iters, warmup, min_ms=0.0):
        for fn in fns.values():
            fn()
        return {name: (1.0, 0.9) for name in fns}

    monkeypatch.setattr(bench_run, "time_interleaved", fake_interleaved)
    monkeypatch.setattr(torch._dynamo, "reset", lambda: None)
    done = []
    rows = bench_run.bench_problem(94, "amp-bf16", ["forward", "train"], ["eager", "ours", "gemm"],
                                   3, 1, bench_run.reference.SMALL_PROBLEMS,
                                   done.append, peak=1.0, device="cpu")
    by = {(r["mode"], r["impl"]): r for r in rows}
    assert set(by) == {("forward", "eager"), ("forward", "ours"), ("forward", "gemm"),
                       ("train", "eager"), ("train", "ours")}
    assert all(r["dtype"] == "amp-bf16" for r in rows)
    assert sorted(done) == sorted(f"94 amp-bf16 b{rows[0]['batch']} {m} {i}" for m, i in by)
    for mode in ("forward", "train"):
        eager = by[(mode, "eager")]
        assert eager["median_ms"] == 1.0 and eager["host_ms"] == 0.5 and eager["host_bound"]
        assert 0 < eager["fwd_rel_error"] < 0.1  # bfloat16 autocast against float64
        assert by[(mode, "ours")]["median_ms"] is None and by[(mode, "ours")]["error"]
    assert by[("train", "eager")]["peak_extra_gib"] == 0.25
    assert by[("forward", "gemm")]["error"]
    table = bench_run.markdown(rows)
    assert "| 94 | amp-bf16 | train | 1.000 |" in table and "Failed (no times):" in table


def test_bench_problem_channels_last_input(monkeypatch):
    """--channels-last: problem 1's input (4-D) goes in channels-last, and
    its rows' dtype label says so; a 2-D input is left as it is."""
    monkeypatch.setattr(bench_run, "l2_bytes", lambda: 50 * MiB)
    seen = []

    def fake_interleaved(fns, iters, warmup, min_ms=0.0):
        for fn in fns.values():
            fn()
        return {name: (1.0, 0.9) for name in fns}

    real_step = bench_run.step_fns

    def spy_step(model, mode, inputs, *a, **kw):
        seen.append(inputs[0].is_contiguous(memory_format=torch.channels_last) and inputs[0].dim() == 4)
        return real_step(model, mode, inputs, *a, **kw)

    monkeypatch.setattr(bench_run, "time_interleaved", fake_interleaved)
    monkeypatch.setattr(bench_run, "step_fns", spy_step)
    monkeypatch.setattr(torch._dynamo, "reset", lambda: None)
    for problem, want in ((1, "float32 channels-last"), (76, "float32")):
        seen.clear()
        rows = bench_run.bench_problem(problem, "fp32", ["forward"], ["eager"], 3, 1,
                                       bench_run.reference.SMALL_PROBLEMS, lambda *a: None,
                                       errors=False, host_steps=0, device="cpu", channels_last=True)
        assert [r["dtype"] for r in rows] == [want] and rows[0]["median_ms"] == 1.0
        assert seen == [problem == 1]


def _row(dtype, mode, impl, ms, host=None, gpu=None, **extra):
    return dict(problem=76, dtype=dtype, mode=mode, impl=impl, batch=1024, sweep=False,
                median_ms=ms, min_ms=ms, host_ms=host, gpu_ms=gpu,
                host_bound=None if host is None else host > gpu,
                peak_extra_gib=0.1 if mode == "train" else None, tflops=100.0,
                ceiling_fraction=0.5, fwd_rel_error=1e-3, **extra)


def test_markdown_shows_amp_rows_host_times_and_failures():
    rows = [_row("amp-bf16", "train", "eager", 0.62, 0.60, 0.40),
            _row("amp-bf16", "train", "ours", 0.50, 0.55, 0.35),
            _row("amp-bf16", "train", "compile", 0.70, 0.20, 0.65),
            _row("amp-bf16", "train", "ours+graphs", None, error="RuntimeError('capture')"),
            _row("amp-bf16", "train", "ours+graphed", 0.36, 0.30, 0.36),
            _row("amp-bf16", "train", "compile+graphs", 0.40, 0.30, 0.39),
            _row("float32", "forward", "ours", 1.0, 0.1, 0.95)]
    table = bench_run.markdown(rows).splitlines()
    head = table[0]
    assert "ours+graphs ms | ours+graphed ms | compile+graphs ms" in head
    assert "ours host / GPU ms per step" in head
    assert "host-bound" in head
    amp = next(line for line in table if "| amp-bf16 |" in line)
    cells = [c.strip() for c in amp.strip("|").split("|")]
    assert cells[:4] == ["76", "amp-bf16", "train", "0.620"] and cells[7:10] == ["nan", "0.360", "0.400"]
    assert "0.550 / 0.350" in cells and "eager, ours" in cells and "nan" in cells
    assert "ours/compile on GPU time" in head and "1.86x" in cells  # 0.65 / 0.35, not 0.70 / 0.50
    fp32 = next(line for line in table if "| float32 |" in line)
    # not host-bound, and no compile row to set its GPU time against
    assert "0.100 / 0.950" in fp32 and [c.strip() for c in fp32.split("|")[-4:-2]] == ["-", "-"]
    assert table.count("- 76 amp-bf16 train ours+graphs: RuntimeError('capture')") == 1
    assert len(head.split("|")) == len(amp.split("|")) == len(fp32.split("|"))
    # the forward's errors: ours / eager / torch.compile's, "-" where a run had none
    assert cells[-1] == "1.0e-03 / 1.0e-03 / -" and "(ours / eager / compile)" in head
    rows[2]["compile_fwd_rel_error"] = 4e-3
    amp = next(line for line in bench_run.markdown(rows).splitlines() if "| amp-bf16 |" in line)
    assert amp.rstrip(" |").endswith("1.0e-03 / 1.0e-03 / 4.0e-03")
    # rows of earlier runs (no host times, no ours+graphs): the original columns
    old = [{k: v for k, v in _row("float32", "train", i, 1.0).items()
            if k not in ("host_ms", "gpu_ms", "host_bound")} for i in ("eager", "ours")]
    plain = bench_run.markdown(old)
    assert "host" not in plain and "graphs" not in plain


def test_run_count_and_sweep_leave_compiled_impls_out(tmp_path, monkeypatch):
    calls = {}

    def fake_bench(problem, dtype, modes, impls, n, warmup, shapes, progress, batch=None, **kw):
        calls[(dtype, batch)] = list(impls)
        return []

    monkeypatch.setattr(bench_run, "bench_problem", fake_bench)
    _fake_device(monkeypatch)
    bench_run.main(["--problems", "1", "--dtypes", "amp-fp16", "--sweep", "--sweep-dtypes",
                    "amp-bf16", "--impls", "eager", "ours", "ours+graphs", "--no-plots",
                    "--out", str(tmp_path)])
    assert calls[("amp-fp16", None)] == ["eager", "ours", "ours+graphs"]
    assert {tuple(v) for (d, b), v in calls.items() if b is not None} == {("eager", "ours")}
    assert {d for d, b in calls if b is not None} == {"amp-bf16"}


# benchmarks/publish.py: latest.json, the tables between markers, history.jsonl (CPU tier)

def _result(path, date, times, device="NVIDIA H100 80GB HBM3"):
    """A results file as run.py writes it: ``times`` maps (problem, dtype)
    to (eager, compile, ours) ms, the forward's at half the training step's."""
    rows = []
    for (problem, dtype), ms in times.items():
        for mode, scale in (("forward", 0.5), ("train", 1.0)):
            for impl, t in zip(("eager", "compile", "ours"), ms):
                rows.append(dict(problem=problem, dtype=dtype, mode=mode, impl=impl, batch=1024,
                                 sweep=False, input_copies=1, median_ms=t * scale,
                                 min_ms=t * scale, host_ms=0.1, gpu_ms=t * scale,
                                 host_bound=False, peak_extra_gib=0.5 if mode == "train" else None,
                                 tflops=100.0, ceiling_fraction=0.5, fwd_rel_error=1e-3))
    meta = dict(device=device, torch="2.x", cuda="13.0", date=date, ceilings={}, invocations=[])
    path.write_text(json.dumps(dict(meta=meta, rows=rows)))
    return path


def _publish_root(tmp_path):
    """A copy of the repository's README.md and docs/performance.md (with
    their markers) and a history with one row, under ``tmp_path``."""
    (tmp_path / "docs").mkdir(parents=True)
    (tmp_path / "results").mkdir()
    (tmp_path / "README.md").write_text((REPO / "README.md").read_text())
    (tmp_path / "docs/performance.md").write_text((REPO / "docs/performance.md").read_text())
    (tmp_path / "results/history.jsonl").write_text('{"date": "2026-11-01", "run": "old"}\n')
    return tmp_path


def _outside(text, name):
    """The text before the start marker and from the end marker on."""
    start, end = text.index(f"<!-- {name}:start"), text.index(f"<!-- {name}:end -->")
    return text[:start], text[end:]


def test_publish_merges_a_partial_run_and_rewrites_only_between_markers(tmp_path):
    root = _publish_root(tmp_path)
    readme0, perf0 = (root / "README.md").read_text(), (root / "docs/performance.md").read_text()
    first = _result(root / "results/GPU-2026-11-24-all.json", "2026-11-24", {
        (76, "amp-bf16"): (3.0, 2.0, 1.0), (88, "amp-bf16"): (4.0, 3.0, 2.0),
        (76, "bfloat16"): (5.0, 4.0, 2.5), (88, "bfloat16"): (6.0, 5.0, 3.0),
        (76, "float16"): (7.0, 6.0, 3.5)})
    second = _result(root / "results/GPU-2026-12-01-bf16.json", "2026-12-01",
                     {(76, "bfloat16"): (9.0, 8.0, 4.0)})
    publish = bench_publish.publish
    assert publish([first], root=str(root), history=False, commit="abc1234")["run"] == "all"
    assert (root / "results/history.jsonl").read_text().count("\n") == 1  # bootstrap: no row
    row = publish([second], root=str(root), commit="abc1234")

    readme, perf = (root / "README.md").read_text(), (root / "docs/performance.md").read_text()
    assert _outside(readme, "headline") == _outside(readme0, "headline")
    assert _outside(perf, "latest-run") == _outside(perf0, "latest-run")
    assert "| 76 | bfloat16 | 4.00 | 2.25x | 2.00x | 2.00x | - | 2.00x |" in readme  # the second's
    assert "| 76 | bfloat16 | 2.50 |" not in readme
    assert "| 88 | bfloat16 | 3.00 | 2.00x | 1.67x | 1.67x | - | 1.67x |" in readme  # the first's
    assert "| 76 | amp-bf16 | 1.00 | 3.00x | 2.00x | 2.00x | - | 2.00x |" in readme
    assert "| 76 | float16 |" not in readme  # not a headline dtype
    assert "| 37 |" not in readme.split("<!-- headline:start")[1].split("headline:end")[0]
    assert "\nH100, 2026-11-24 to 2026-12-01, two runs, implementations timed in turns" in readme
    section = perf.split("<!-- latest-run:start")[1].split("<!-- latest-run:end")[0]
    assert "## Latest run (H100, 2026-11-24 to 2026-12-01)" in section
    assert "### Under autocast, float32 model" in section
    assert "### Model in bf16 and fp16" in section
    assert "| 76 | bfloat16 | train | 9.000 | 8.000 | 4.000 |" in section
    assert "| 76 | bfloat16 | train | 5.000 |" not in section
    assert "| 88 | bfloat16 | train | 6.000 | 5.000 | 3.000 |" in section
    assert "| 76 | float16 | forward | 3.500 | 3.000 | 1.750 |" in section
    # the replaced key where it was: 76 bfloat16 before 88 bfloat16
    assert section.index("| 76 | bfloat16 | forward") < section.index("| 88 | bfloat16 | forward")

    latest = json.loads((root / "results/latest.json").read_text())
    sources = {(r["problem"], r["dtype"]): r["source"] for r in latest["rows"]}
    assert sources[(76, "bfloat16")] == "results/GPU-2026-12-01-bf16.json"
    assert sources[(88, "bfloat16")] == "results/GPU-2026-11-24-all.json"
    assert len(latest["rows"]) == 5 * 2 * 3 and set(latest["sources"]) == set(sources.values())

    history = (root / "results/history.jsonl").read_text().splitlines()
    assert len(history) == 2 and json.loads(history[-1]) == row
    assert row == dict(date="2026-12-01", run="bf16", device="NVIDIA H100 80GB HBM3",
                       commit="abc1234", versions={"torch": "2.x", "cuda": "13.0"},
                       headline={"76 bfloat16 forward ours/compile": 2.0,
                                 "76 bfloat16 train ours/compile": 2.0})
    # redrawing from latest.json alone changes nothing and appends nothing
    assert publish([], root=str(root)) is None
    assert (root / "README.md").read_text() == readme
    assert (root / "docs/performance.md").read_text() == perf
    assert len((root / "results/history.jsonl").read_text().splitlines()) == 2


def test_headline_shows_gpu_time_and_host_bound_sides():
    """A row where the host sets the pace: the wall-time ratio, and beside it
    torch.compile's GPU time over ours and which sides were host-bound."""
    rows = [dict(problem=76, dtype="bfloat16", mode=mode, impl=impl, median_ms=ms, gpu_ms=gpu,
                 host_bound=bound)
            for mode in ("forward", "train")
            for impl, ms, gpu, bound in (("eager", 3.0, 2.0, False), ("compile", 2.0, 1.0, True),
                                         ("ours", 1.0, 0.8, True))]
    assert ("| 76 | bfloat16 | 1.00 | 3.00x | 2.00x | 1.25x | compile, ours | 2.00x |"
            in bench_publish.headline(rows))


def test_history_ratios_pair_the_times_of_one_file():
    """A later file without torch.compile's time (failed, or not run) does
    not pair its ours with an earlier file's compile; a later file with
    both replaces the earlier ratio."""
    def rows(source, times):
        return [dict(problem=76, dtype="bfloat16", mode="train", impl=impl, median_ms=ms,
                     source=source) for impl, ms in times.items()]

    first = rows("a.json", {"compile": 2.0, "ours": 1.0})
    assert bench_publish.history_ratios(first + rows("b.json", {"ours": 0.5})) == {
        "76 bfloat16 train ours/compile": 2.0}
    assert bench_publish.history_ratios(first + rows("b.json", {"compile": 2.0, "ours": 0.5})) == {
        "76 bfloat16 train ours/compile": 4.0}


def test_history_row_takes_the_commit_the_runs_measured(tmp_path):
    root = _publish_root(tmp_path)
    result = _result(root / "results/GPU-2026-12-01-bf16.json", "2026-12-01",
                     {(76, "bfloat16"): (3.0, 2.0, 1.0)})
    data = json.loads(result.read_text())
    data["meta"]["commit"] = "fedcba9+dirty"
    result.write_text(json.dumps(data))
    assert bench_publish.publish([result], root=str(root))["commit"] == "fedcba9+dirty"


def test_a_history_row_of_two_files_of_one_commit_takes_it_and_the_tables_name_it(tmp_path):
    """Two files measured at one commit: the history row records that
    commit (it fell back to the publishing tree's HEAD), latest.json keeps
    each source's commit and the performance page names it; a file of small
    shapes (--quick) is refused, its rows would replace the benchmark
    shapes'."""
    root = _publish_root(tmp_path)
    files = [_result(root / f"results/GPU-2026-12-01-{d}.json", "2026-12-01",
                     {(76, dtype): (3.0, 2.0, 1.0)})
             for d, dtype in (("bf16", "bfloat16"), ("fp16", "float16"))]
    for result in files:
        data = json.loads(result.read_text())
        data["meta"]["commit"] = "abc1234"
        result.write_text(json.dumps(data))
    assert bench_publish.publish(files, root=str(root))["commit"] == "abc1234"
    latest = json.loads((root / "results/latest.json").read_text())
    assert {m["commit"] for m in latest["sources"].values()} == {"abc1234"}
    assert "(2026-12-01, commit abc1234)" in (root / "docs/performance.md").read_text()
    data = json.loads(files[0].read_text())
    data["meta"]["quick"] = True
    files[0].write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"a run of small shapes \(--quick\), not published"):
        bench_publish.publish([files[0]], root=str(root))


def test_a_second_run_of_the_day_gets_a_file_of_its_own(tmp_path):
    stem = str(tmp_path / "GPU-2026-12-01")
    assert bench_run.fresh_stem(stem) == stem
    (tmp_path / "GPU-2026-12-01.json").write_text("{}")
    assert bench_run.fresh_stem(stem) == stem + "-2"
    (tmp_path / "GPU-2026-12-01-2.json").write_text("{}")
    assert bench_run.fresh_stem(stem) == stem + "-3"


def test_resume_refuses_another_gpu_torch_or_tree(tmp_path, monkeypatch):
    """One file's rows are one run's: --resume on another GPU, torch or
    commit stops, naming what differs."""
    _fake_device(monkeypatch)
    saved = tmp_path / "r.json"
    saved.write_text(json.dumps(dict(meta=dict(device="Other GPU", torch=torch.__version__,
                                               commit="abc1234", ceilings={}, invocations=[]),
                                     rows=[])))
    with pytest.raises(SystemExit, match=r"its device \(Other GPU\) differ"):
        bench_run.main(["--problems", "76", "--dtypes", "fp32", "--no-plots", "--commit", "abc1234",
                        "--out", str(tmp_path), "--resume", str(saved)])


def test_publish_without_markers_writes_nothing(tmp_path):
    root = _publish_root(tmp_path)
    (root / "README.md").write_text("# cupy-fused\n\nno markers\n")
    result = _result(root / "results/GPU-2026-11-24.json", "2026-11-24",
                     {(76, "float32"): (2.0, 2.0, 1.0)})
    with pytest.raises(ValueError, match="headline"):
        bench_publish.publish([result], root=str(root), commit=None)
    assert not (root / "results/latest.json").exists()
    assert (root / "docs/performance.md").read_text() == (REPO / "docs/performance.md").read_text()
    assert (root / "results/history.jsonl").read_text().count("\n") == 1


def test_device_names_and_run_labels():
    assert bench_publish.short_device("NVIDIA H100 80GB HBM3") == "H100"
    assert bench_publish.short_device("NVIDIA A100-SXM4-80GB") == "A100"
    assert bench_publish.short_device("NVIDIA GeForce RTX 4090") == "RTX 4090"
    rows = [dict(dtype="bfloat16"), dict(dtype="amp-fp16"), dict(dtype="bfloat16")]
    assert bench_publish.run_label("results/X-2026-11-24-autocast.json", rows) == "autocast"
    assert bench_publish.run_label("results/X-2026-11-24.json", rows) == "bf16+amp-fp16"


def test_the_published_tables_are_what_latest_json_draws():
    """README.md and docs/performance.md hold the tables publish.py draws from
    results/latest.json (tables edited by hand fail here)."""
    readme, perf = (REPO / "README.md").read_text(), (REPO / "docs/performance.md").read_text()
    latest = json.loads((REPO / "results/latest.json").read_text())
    assert bench_publish.replace_between(
        perf, "latest-run", lambda old: bench_publish.performance_section(latest)) == perf
    assert bench_publish.replace_between(
        readme, "headline", lambda old: bench_publish.readme_section(old, latest)) == readme


def test_a_finished_run_in_results_publishes_unless_quick_or_asked_not_to(tmp_path, monkeypatch):
    def fake_bench(problem, dtype, modes, impls, iters, warmup, shapes, progress, batch=None,
                   **kw):
        return [dict(problem=problem, dtype=bench_run.dtype_label(dtype), mode=mode, impl=impl,
                     batch=1024, sweep=False, median_ms=ms, min_ms=ms, peak_extra_gib=None,
                     tflops=1.0, ceiling_fraction=0.5, fwd_rel_error=None)
                for mode in modes for impl, ms in (("eager", 2.0), ("compile", 1.5), ("ours", 1.0))]

    monkeypatch.setattr(bench_run, "bench_problem", fake_bench)
    _fake_device(monkeypatch)
    root = _publish_root(tmp_path / "repo")
    monkeypatch.setattr(bench_run, "REPO", str(root))
    history = root / "results/history.jsonl"
    argv = ["--problems", "76", "--dtypes", "bf16", "--no-plots"]
    for extra in (["--quick"], ["--no-publish"], ["--out", str(tmp_path / "elsewhere")]):
        bench_run.main(argv + ["--out", str(root / "results")] + extra)
        assert len(history.read_text().splitlines()) == 1, extra
        assert not (root / "results/latest.json").exists()
    bench_run.main(argv + ["--out", str(root / "results")])
    assert len(history.read_text().splitlines()) == 2
    assert json.loads(history.read_text().splitlines()[-1])["headline"] == {
        "76 bfloat16 forward ours/compile": 1.5, "76 bfloat16 train ours/compile": 1.5}
    assert "| 76 | bfloat16 | 1.00 | 2.00x | 1.50x | - | - | 1.50x |" in (root / "README.md").read_text()


# benchmarks/kernels.py: byte accounting and selection (CPU tier)

N76 = 1024 * 8192


def test_kernel_bytes_forward_reads_z_and_writes_y():
    mb = bench_kernels.moved_bytes
    f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
    assert mb("bias_relu", "forward", N76, f32, f32) == N76 * 8
    assert mb("bias_relu", "forward", N76, bf16, bf16) == N76 * 4
    # with grad on, the 1-bit mask / the float32 mean and 1/std per (row, group)
    assert mb("bias_relu", "forward", N76, f32, f32, saves=True) == N76 * 8 + N76 // 8
    assert mb("gn_chain", "forward", N76, f16, f16, row_groups=1024 * 256) == N76 * 4
    assert (mb("gn_chain", "forward", N76, f16, f16, row_groups=1024 * 256, saves=True)
            == N76 * 4 + 8 * 1024 * 256)
    # autocast: half-precision z, float32 y
    assert mb("gn_chain", "forward", N76, bf16, f32, row_groups=1024 * 256) == N76 * 6


def test_kernel_bytes_backward_reads_the_saved_tensor_and_dy_and_writes_dz():
    mb = bench_kernels.moved_bytes
    f32, bf16 = torch.float32, torch.bfloat16
    assert mb("bias_relu", "backward", N76, f32, f32) == N76 // 8 + N76 * 8
    assert mb("bias_relu", "backward", N76, bf16, bf16) == N76 // 8 + N76 * 4
    n1 = 128 * 128 * 126 * 126  # problem 1's conv output
    assert mb("bias_relu", "backward", n1, f32, f32) == n1 // 8 + n1 * 8
    # (and the GroupNorm's saved float32 mean and 1/std, 8 bytes a (row, group))
    assert mb("gn_chain", "backward", N76, f32, f32, row_groups=1) == N76 * 12 + 8
    assert mb("gn_chain", "backward", N76, bf16, bf16, row_groups=1024 * 256) == N76 * 6 + 8 * 1024 * 256
    assert mb("gn_chain", "backward", N76, bf16, bf16) == N76 * 6
    assert mb("gn_chain", "backward", N76, bf16, f32) == N76 * (2 + 4 + 2)  # z, dy, dz
    assert bench_kernels.mask_bytes(33) == 5 and bench_kernels.mask_bytes(32) == 4
    with pytest.raises(ValueError):
        mb("gn_chain", "sideways", N76, f32, f32)
    with pytest.raises(ValueError):
        mb("relu", "forward", N76, f32, f32)


def test_kernel_cases_and_their_filter():
    cases = bench_kernels.CASES
    assert cases["bias_relu_1"].shape == (128, 128, 126, 126)
    assert [n for n, _ in cases["bias_relu_1"].vectors] == ["bias", "bias2"]
    gn = {n: c for n, c in cases.items() if c.op == "gn_chain"}
    assert {c.chain: (c.shape, c.groups) for c in gn.values()} == {
        "swish_bias_gn": ((32768, 4096), 64), "gn_swish_mul_swish": ((1024, 8192), 256),
        "bias_hardtanh_mish_gn": ((1024, 8192), 256)}
    assert [n for n, _ in cases["gn_swish_mul_swish_88"].vectors] == [
        "lin_bias", "gn_weight", "gn_bias", "mul_weight"]
    assert cases["bias_relu_1_cl"].channels_last and not cases["bias_relu_1"].channels_last
    assert cases["bias_relu_1_cl"][:4] == cases["bias_relu_1"][:4]
    assert list(bench_kernels.select_cases(["bias_relu"])) == [
        "bias_relu_76", "bias_relu_1", "bias_relu_1_cl"]
    assert len(bench_kernels.select_cases(["gn"])) == 3
    assert bench_kernels.select_cases(None) == cases
    with pytest.raises(SystemExit):
        bench_kernels.select_cases(["nope"])
    amp = bench_kernels.DTYPES["amp-bf16"]  # z as autocast hands it over, float32 vectors
    assert (amp.compute, amp.model) == (torch.bfloat16, torch.float32)
    assert (bench_kernels.DTYPES["fp16"].compute, bench_kernels.DTYPES["fp16"].model) == (
        torch.float16, torch.float16)
    args = bench_kernels.parse_args(["--quick", "--kernels", "gn", "--dtypes", "amp-fp16"])
    assert (args.iters, args.warmup, args.dtypes) == (10, 3, ["amp-fp16"])


def test_kernel_timing_queues_the_calls_behind_a_sleep(monkeypatch):
    """With fake events and a host slower than the GPU, the times are the
    GPU's (the host's issue time sizes the sleep, and is not timed)."""
    work, clock = _fake_cuda_timing(monkeypatch, gpu_ms_per_call=0.02, host_ms_per_call=0.08)
    slept = []
    monkeypatch.setattr(bench_harness, "hold_gpu_ms", slept.append)
    med, best = bench_harness.time_queued(work, iters=50, warmup=2, clock=clock)
    assert med == pytest.approx(0.02) and best == pytest.approx(0.02)
    assert slept == [pytest.approx(1.5 * 0.08 * 50 + 1.0)]


def test_kernel_traffic_is_the_least_bytes_and_the_copies_of_what_is_read():
    """A case's bytes a call moves (moved_bytes) and its input copies: the
    rotation rule over what the call reads (everything moved but the one
    tensor it writes)."""
    case = bench_kernels.CASES["gn_swish_mul_swish_88"]
    numel = 1024 * 8192
    for direction, written in (("forward", torch.float32), ("backward", torch.bfloat16)):
        moved, copies = bench_kernels.traffic(case, direction, torch.bfloat16, torch.float32, MiB)
        assert moved == bench_kernels.moved_bytes("gn_chain", direction, numel, torch.bfloat16,
                                                  torch.float32, row_groups=1024 * 256)
        assert copies == bench_kernels.rotation_count(moved - numel * written.itemsize, MiB)


def test_kernel_tables_show_both_yardsticks_and_unsupported_and_low_rows():
    base = dict(kernel="gn_swish_mul_swish_88", op="gn_chain", problem=88,
                chain="gn_swish_mul_swish", shape=[1024, 8192])
    ok = dict(base, status="ok", bytes=N76 * 4, min_ms=0.02)
    rows = [dict(ok, dtype="bf16", z_dtype="bfloat16", vector_dtype="bfloat16",
                 y_dtype="bfloat16", direction="forward", median_ms=0.02, gbps=1677.7, ceiling_fraction=0.56,
                 copy_same_ms=0.016, copy_same_gbps=2097.2, same_size_fraction=0.8, low=False),
            dict(ok, dtype="fp16", z_dtype="float16", vector_dtype="float16",
                 y_dtype="float16", direction="backward", median_ms=0.033, gbps=1525.2, ceiling_fraction=0.51,
                 copy_same_ms=0.019, copy_same_gbps=2649.0, same_size_fraction=0.576, low=True),
            dict(base, dtype="amp-bf16", z_dtype="bfloat16", vector_dtype="float32",
                 direction="backward", status="unsupported", message="z and vectors differ")]
    md = bench_kernels.markdown(rows, dict(device="GPU", copy_gbps=3000.0))
    assert "3000 GB/s" in md and "### gn_swish_mul_swish_88" in md
    assert "below 80% of it are flagged" in md.splitlines()[0]
    header = ("| shape | dtype (z / vectors / y) | direction | ms | MB moved | GB/s | "
              "% of 1 GiB copy | copy of same bytes ms | % of same-size copy | |")
    assert header in md
    assert "| 1024 x 8192 | bf16 (bfloat16 / bfloat16 / bfloat16) | forward | 0.020 | 34 | " \
           "1678 | 56% | 0.016 | 80% |  |" in md
    assert "| 1024 x 8192 | fp16 (float16 / float16 / float16) | backward | 0.033 | 34 | " \
           "1525 | 51% | 0.019 | 57% | below 80% |" in md
    assert "| amp-bf16 (bfloat16 / float32 / -) | backward | - | - | - | - | - | - | " \
           "unsupported: z and vectors differ |" in md
    table = [line for line in md.splitlines() if line.startswith("|")]
    assert {line.count("|") for line in table} == {header.count("|")}  # one width
    text = bench_kernels.text_table(rows, "gn_swish_mul_swish_88").splitlines()
    assert "% 1GiB" in text[1] and "% same" in text[1]
    assert text[2].split()[-3:] == ["56%", "0.016", "80%"]
    assert text[3].split()[-5:] == ["51%", "0.019", "57%", "below", "80%"]
    assert "unsupported" in text[4]
    # A flagged row never reads as 80 %: the whole percent below it (0.576
    # reads 57 %, 0.796 79 %; 0.57, 56.99... in floats, 57 %).
    near = dict(rows[1], same_size_fraction=0.796)
    assert "| 79% | below 80% |" in bench_kernels.markdown([near], dict(device="GPU", copy_gbps=3000.0))
    assert bench_kernels._percent(0.57) == 57 and bench_kernels._percent(0.8) == 80


def test_kernel_rows_are_flagged_against_the_copy_of_their_bytes():
    """The flag reads the same-size fraction, not the 1 GiB one."""
    assert bench_kernels.is_low(dict(ceiling_fraction=0.9, same_size_fraction=0.79))
    assert not bench_kernels.is_low(dict(ceiling_fraction=0.6, same_size_fraction=0.8))
    assert not bench_kernels.is_low(dict(ceiling_fraction=0.7, same_size_fraction=0.95))


def test_kernel_rows_slower_than_a_baseline_run_are_listed():
    """--baseline: a row is listed where its time against its own run's
    same-size copy grew past SLOWER_THAN_BASELINE; a faster machine (every
    copy faster too) moves nothing, and rows missing or untimed in either
    run are skipped."""
    def row(kernel, dtype, direction, fraction, status="ok", shape=(1024, 8192)):
        return dict(kernel=kernel, dtype=dtype, direction=direction, status=status,
                    shape=list(shape), same_size_fraction=fraction, median_ms=0.1,
                    copy_same_ms=0.1 * fraction)

    base = [row("k37", "fp32", "backward", 0.95), row("k37", "fp32", "forward", 0.90),
            row("k94", "amp-bf16", "forward", 0.87), row("k94", "bf16", "forward", 0.5, "error")]
    now = [row("k37", "fp32", "backward", 0.79), row("k37", "fp32", "forward", 0.87),
           row("k94", "amp-bf16", "forward", 0.87), row("k94", "bf16", "forward", 0.6),
           row("k88", "fp16", "backward", 0.5), row("k37", "bf16", "backward", 0.9, "unsupported"),
           row("k37", "fp32", "backward", 0.5, shape=(512, 8192))]  # (another shape: no baseline)
    slower = bench_kernels.slower_than_baseline(now, base)
    assert [(bench_kernels.row_key(r), round(x, 3)) for r, x in slower] == \
        [(("k37", (1024, 8192), "fp32", "backward"), round(0.95 / 0.79, 3))]
    assert bench_kernels.slower_than_baseline(now, base, limit=1.03)[1][0] is now[1]  # 0.90 / 0.87
    assert bench_kernels.slower_than_baseline(base, base) == []
    assert bench_kernels.parse_args(["--baseline", "old.json"]).baseline == "old.json"
    assert bench_kernels.SLOWER_THAN_BASELINE == 1.05


def test_a_baseline_run_on_another_gpu_is_not_compared(tmp_path, capsys):
    path = tmp_path / "run.json"
    path.write_text(json.dumps(dict(meta=dict(device="NVIDIA H100"), rows=[dict(kernel="k")])))
    assert bench_kernels.read_baseline(str(path), "NVIDIA H100") == [dict(kernel="k")]
    assert bench_kernels.read_baseline(str(path), "NVIDIA H200") is None
    assert "ran on NVIDIA H100, this run on NVIDIA H200: not compared" in capsys.readouterr().out


def test_same_size_copy_reads_half_the_bytes_on_a_16_byte_grid():
    read = bench_kernels.copy_read_bytes
    assert read(N76 * 4) == N76 * 2  # problem 88's 16-bit forward
    assert read(N76 // 8 + N76 * 4) == (N76 // 8 + N76 * 4) // 2  # 76's backward, with its mask
    assert read(1000) == 496 and read(1008) == 512  # nearest multiple; a half rounds up
    assert read(0) == read(1) == 16  # at least one grain
    for moved in range(1, 4000, 7):
        assert read(moved) % 16 == 0 and read(moved) % 4 == 0
        assert moved <= 16 or abs(2 * read(moved) - moved) <= 16


def test_same_size_copy_rotates_its_sources_and_is_timed_once_per_size(monkeypatch):
    """On the CPU, time_queued faked: float32 sources of the rule's size,
    rotated as the kernels' inputs are, one destination, the rate from the
    copy's own bytes, and one timing per size and settings."""
    monkeypatch.setattr(bench_kernels, "_same_size_copies", {})
    timings, copies = [], []

    def fake_time_queued(fn, iters, warmup):
        timings.append((iters, warmup))
        for _ in range(warmup + iters):
            fn()
        return 0.02, 0.01

    real_copy = torch.Tensor.copy_

    def copy_(dst, src, *args, **kw):
        copies.append((dst.data_ptr(), src.data_ptr(), src.numel(), src.dtype, dst.dtype))
        return real_copy(dst, src, *args, **kw)

    monkeypatch.setattr(bench_kernels, "time_queued", fake_time_queued)
    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    l2 = MiB
    ms, gbps = bench_kernels.same_size_copy_gbps(MiB, 6, 2, l2, device="cpu")
    assert (ms, gbps) == (0.02, pytest.approx(MiB / 0.02 / 1e6))
    assert timings == [(6, 2)] and len(copies) == 8
    assert {c[2:] for c in copies} == {(MiB // 8, torch.float32, torch.float32)}
    assert len({c[0] for c in copies}) == 1  # one destination
    sources = [c[1] for c in copies]
    assert len(set(sources)) == bench_kernels.rotation_count(MiB // 2, l2) == 4
    assert sources[:4] == sources[4:]  # in turns
    # the same size (after rounding) again: no new timing
    assert bench_kernels.same_size_copy_gbps(MiB + 1, 6, 2, l2, device="cpu") == (ms, gbps)
    assert timings == [(6, 2)]
    # larger than the L2: one source; other settings time again
    copies.clear()
    bench_kernels.same_size_copy_gbps(4 * MiB, 6, 2, l2, device="cpu")
    assert len({c[1] for c in copies}) == 1 and copies[0][2] == MiB // 2
    bench_kernels.same_size_copy_gbps(MiB, 3, 1, l2, device="cpu")
    assert timings == [(6, 2), (6, 2), (3, 1)]


def test_kernel_backward_reruns_only_the_recorded_graphs_in_turns(monkeypatch):
    """_backward_fn (an op written in torch ops on the CPU in place of ours):
    one graph per copy, each called in turn, gradients of z and every vector."""
    case = bench_kernels.CASES["bias_relu_76"]
    calls = []
    monkeypatch.setattr(bench_kernels, "_call",
                        lambda c, z, v: (calls.append(1), torch.relu(z + v["bias"]))[1])

    def randn(shape, dt):
        return torch.randn(shape).to(dt)

    z = randn((4, 8), torch.bfloat16)
    vectors = {"bias": randn((8,), torch.float32)}  # the autocast combination
    grads = []
    real_grad = torch.autograd.grad

    def grad(y, inputs, g, retain_graph):
        assert retain_graph and g.shape == y.shape and g.dtype == y.dtype == torch.float32
        out = real_grad(y, inputs, g, retain_graph=retain_graph)
        grads.append((id(y), [t.dtype for t in out]))
        return out

    monkeypatch.setattr(torch.autograd, "grad", grad)
    fn = bench_kernels._backward_fn(case, z, vectors, 2, randn)
    assert len(calls) == 2  # the forwards, once per copy
    for _ in range(4):
        fn()
    assert len(calls) == 2  # timed calls run no forward
    ids = [i for i, _ in grads]
    assert ids[0] == ids[2] != ids[1] == ids[3]
    assert grads[0][1] == [torch.bfloat16, torch.float32]
    fwd = bench_kernels._forward_fn(case, z, vectors, 3, randn)
    fwd()
    assert len(calls) == 3


def test_gemm_timed_entries(monkeypatch):
    """benchmarks/gemm.py's row entries: each implementation's median and
    best times from one timing in turns, its TFLOP/s, and the error of its
    product."""
    spec = importlib.util.spec_from_file_location("bench_gemm", REPO / "benchmarks/gemm.py")
    bench_gemm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_gemm)
    timed = []

    def fake_interleaved(impls, iters, warmup):
        timed.append((sorted(impls), iters, warmup))
        return {"a": (2.0, 1.5), "b": (4.0, 3.0)}

    monkeypatch.setattr(bench_gemm, "time_interleaved", fake_interleaved)
    impls = {"a": lambda: torch.tensor([1.0]), "b": lambda: torch.tensor([3.0])}
    entries = bench_gemm._timed_entries(impls, 7, 4e9, lambda c: float(c.sum()) / 10)
    assert timed == [(["a", "b"], 7, 3)]
    assert entries == {"a": {"median_ms": 2.0, "min_ms": 1.5, "tflops": 2.0, "error": 0.1},
                       "b": {"median_ms": 4.0, "min_ms": 3.0, "tflops": 1.0, "error": 0.3}}


def test_gemm_conv_wgrad_markdown():
    """benchmarks/gemm.py --conv-wgrad's table: one line per shape and dtype,
    ours and cuDNN's times and rates (ours also as a share of the run's
    ceiling), the ratio and both errors, then the ceilings; its default
    shapes name a convolution as NxC_inxHxW-C_outxK."""
    spec = importlib.util.spec_from_file_location("bench_gemm", REPO / "benchmarks/gemm.py")
    bench_gemm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_gemm)
    row = {"shape": "128x64x128x128-128x3", "dtype": "bfloat16", "ours vs cudnn": 1.25, "ceiling": 800.0,
           "ours": {"median_ms": 0.4, "tflops": 700.4, "error": 1.66e-3},
           "cudnn": {"median_ms": 0.5, "tflops": 600.0, "error": 1.67e-3}}
    lines = bench_gemm.conv_wgrad_markdown([row, dict(row, shape="x")]).splitlines()
    assert len(lines) == 6 and lines[0].count("|") == lines[2].count("|") == 10
    assert lines[2] == ("| 128x64x128x128-128x3 | bfloat16 | 0.400 | 700 (88%) | 0.500 | 600 | 1.250x | "
                        "1.7e-03 | 1.7e-03 |")
    assert lines[5] == "Ceiling: cuBLAS's product at 8192^3 in this run, TFLOP/s: bfloat16 800."
    for shape in bench_gemm.DEFAULT_CONV_SHAPES:
        image, kernel = shape.split("-")
        assert len(image.split("x")) == 4 and len(kernel.split("x")) == 2


def test_gemm_small_outputs_markdown_and_seeds():
    """benchmarks/gemm.py --small-outputs's table: one line per output and
    k, the kernel's error ratio to SGEMM (median, max), their GPU-time ratio
    and the route; a run of no seed is refused before any GPU work."""
    spec = importlib.util.spec_from_file_location("bench_gemm", REPO / "benchmarks/gemm.py")
    bench_gemm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_gemm)
    row = {"size": "33x40", "k": 256, "tiles": 1, "error ratio median": 1.316,
           "error ratio max": 2.174, "kernel ms": 0.0046, "sgemm ms": 0.005, "routed to sgemm": True}
    kept = dict(row, k=32, **{"routed to sgemm": False, "error ratio median": 1.1,
                              "error ratio max": 1.5})
    lines = bench_gemm.small_outputs_markdown([row, kept, dict(kept, k=64, **{
        "error ratio median": 0.9, "error ratio max": 1.2})]).splitlines()
    assert len(lines) == 7 and lines[0].count("|") == lines[2].count("|") == 7
    assert lines[2] == "| 33x40 | 256 | 1 | 1.32, 2.17 | 0.92 | SGEMM |"
    assert lines[3].endswith("| kernel |") and lines[5] == ""
    # the summary: the kernel's rows only (the SGEMM row's 1.32 and 2.17 left out)
    assert lines[6] == ("On the kernel's route (2 of 3 rows): error ratio median at most 1.10, "
                        "max at most 1.50 (33x40, k = 32).")
    assert len(bench_gemm.small_outputs_markdown([row]).splitlines()) == 3  # no kernel row
    with pytest.raises(ValueError, match="seeds must be at least 1"):
        bench_gemm.small_outputs_run(seeds=0)


def test_gemm_modes_write_their_results_alike(tmp_path, capsys):
    """benchmarks/gemm.py's modes write their JSON ({"meta": ..., rows by
    key}) and Markdown (a line naming the run, the device and torch) through
    one function, and print the Markdown."""
    spec = importlib.util.spec_from_file_location("bench_gemm", REPO / "benchmarks/gemm.py")
    bench_gemm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_gemm)
    meta = {"device": "NVIDIA H200", "torch": "2.11.0"}
    j, m = tmp_path / "r.json", tmp_path / "r.md"
    bench_gemm.write_outputs(str(j), str(m), "Small outputs", meta, {"small_outputs": [{"k": 32}]},
                             "| table |\n")
    assert json.loads(j.read_text()) == {"meta": meta, "small_outputs": [{"k": 32}]}
    assert m.read_text() == "Small outputs on NVIDIA H200, torch 2.11.0\n\n| table |\n"
    assert capsys.readouterr().out == "| table |\n\n"
    bench_gemm.write_outputs(None, None, "GEMM", meta, {"rows": []}, "md")  # nothing written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "r.md"]


def _bench_ab():
    spec = importlib.util.spec_from_file_location("bench_ab", REPO / "benchmarks/ab.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ab_takes_a_folder_or_a_git_revisions_kernels(tmp_path):
    if not (REPO / ".git").exists():
        pytest.skip("a git revision needs the repository's history (not in a source distribution)")
    ab = _bench_ab()
    copy = ab.kernel_copy("HEAD", str(tmp_path / "new"))
    assert copy == str(tmp_path / "new" / "kernels_cu")
    assert (tmp_path / "new" / "kernels_cu" / "gemm.cuh").is_file()
    assert ab.kernel_copy(copy, str(tmp_path / "unused")) == copy  # a folder as it is
    (tmp_path / "empty").mkdir()
    for bad in (str(tmp_path / "empty"), "no-such-revision-of-this-repo"):
        with pytest.raises(SystemExit, match="--against"):
            ab.kernel_copy(bad, str(tmp_path / "x"))


def test_ab_names_the_kernels_whose_parameters_differ(tmp_path):
    ab = _bench_ab()
    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir()
    new.mkdir()
    (old / "a.cu").write_text("__global__ void __launch_bounds__(256) same(const float* __restrict__ x, "
                              "i64 n) {}\n__global__ void grew(float* y) {}\n"
                              "__global__ void gone(double d) {}\n")
    (new / "a.cu").write_text("__global__ void same(const float* x, i64 count) {}\n"
                              "__global__ void grew(float* y, i64 n) {}\n__global__ void added() {}\n")
    assert ab.parameter_differences(str(old), str(new)) == ["added", "gone", "grew"]
    assert ab.parameter_differences(str(REPO / "kernels_cu"), str(REPO / "kernels_cu")) == []


def test_ab_kernels_from_answers_every_family_from_the_other_copy(monkeypatch):
    """Inside kernels_from, a family's lookup compiles (once) from the other
    folder with the define that keeps those kernels apart; outside, the
    family's own cache and lookup are back, untouched."""
    from cupy_fused import _runtime
    ab = _bench_ab()
    family = importlib.import_module("cupy_fused.ops.scale_add").KERNELS
    compiled = []

    def fake_get_function(source, expression, device, defines=()):
        compiled.append((source, expression, device, defines, os.environ["CUPY_FUSED_KERNEL_DIR"]))
        return f"kernel of {expression} from {os.environ['CUPY_FUSED_KERNEL_DIR']}"

    monkeypatch.setattr(_runtime, "get_function", fake_get_function)
    monkeypatch.delenv("CUPY_FUSED_KERNEL_DIR", raising=False)
    real_get, own = _runtime.KernelFamily.get, dict(family._kernels)
    with ab.kernels_from("/other/kernels_cu"):
        first = family.get(torch.float16, 0)
        assert family.get(torch.float16, 0) is first
    assert first == "kernel of cf::scale_add<cf::half> from /other/kernels_cu"
    assert compiled == [("scale_add.cu", "cf::scale_add<cf::half>", 0,
                         (ab.against_define("/other/kernels_cu"),), "/other/kernels_cu")]
    assert ab.against_define("/other/kernels_cu") != ab.against_define("/another/kernels_cu")
    assert _runtime.KernelFamily.get is real_get and family._kernels == own
    assert "CUPY_FUSED_KERNEL_DIR" not in os.environ
    with pytest.raises(RuntimeError):  # an error inside still gives the lookup back
        with ab.kernels_from("/other/kernels_cu"):
            raise RuntimeError
    assert _runtime.KernelFamily.get is real_get
    monkeypatch.setattr(_runtime.KernelFamily, "get", lambda fam, key, dev: ("own", key))
    with ab.kernels_from(None):  # the tree's side: its own lookups, through the same detour
        assert family.get(torch.float16, 0) == ("own", torch.float16)
    assert len(compiled) == 1
    # gn_chain's launch plans hold kernels: each side keeps its own.
    gn_chain = importlib.import_module("cupy_fused.ops.gn_chain")
    tree_plans = gn_chain._forward_plans
    with ab.kernels_from("/other/kernels_cu"):
        gn_chain._forward_plans["shape"] = "a plan with the other copy's kernel"
    assert "shape" not in gn_chain._forward_plans and gn_chain._forward_plans is tree_plans
    with ab.kernels_from("/other/kernels_cu"):
        assert gn_chain._forward_plans == {"shape": "a plan with the other copy's kernel"}
    with ab.kernels_from(None):
        assert "shape" not in gn_chain._forward_plans


def test_ab_same_bits_tells_apart_what_equality_does_not():
    ab = _bench_ab()
    nan = torch.tensor([float("nan"), 1.0])
    assert ab.same_bits(nan, nan.clone())  # equal bits, though NaN != NaN
    assert not ab.same_bits(torch.tensor([0.0]), torch.tensor([-0.0]))  # == though not the same bits
    assert not ab.same_bits(torch.tensor([1.0]), torch.tensor([1.0], dtype=torch.float64))
    a = torch.ones(2, dtype=torch.bfloat16)
    assert ab.same_bits((a, None, [a]), (a.clone(), None, [a.clone()]))
    assert not ab.same_bits((a, None), (a, a))
    assert not ab.same_bits((a,), (a, a))


def _kernels_from_recording(inside):
    """A stand-in for ab.kernels_from: ``inside`` holds the folders of the
    contexts entered and not yet left."""
    @contextlib.contextmanager
    def fake_kernels_from(folder):
        inside.append(folder)
        try:
            yield
        finally:
            inside.pop()
    return fake_kernels_from


def test_ab_times_queued_cases_apart_and_a_control_copy(monkeypatch):
    """Cases timed queued (the kernels) and the others in timings of their
    own; with a control folder, a third side per job and its ratio to the
    other copy's; every side's result is computed inside that side's
    kernels_from."""
    ab = _bench_ab()
    inside = []
    fake_kernels_from = _kernels_from_recording(inside)

    def make(dtype, mode):
        return (lambda: None), (lambda: torch.tensor([float(len(inside))]))

    timed = []

    def fake_interleaved(fns, iters, warmup, rounds, queued=False):
        timed.append((sorted(fns), queued))
        ms = {"against": 2.0, "tree": 1.0, "control": 2.2}
        return {name: (ms[name.rsplit(" ", 1)[1]], 0.5) for name in fns}

    monkeypatch.setattr(ab, "kernels_from", fake_kernels_from)
    monkeypatch.setattr(ab, "time_interleaved", fake_interleaved)
    monkeypatch.setitem(ab.CASES, "plain", ab.Case(("bf16",), ("forward",), make))
    monkeypatch.setitem(ab.CASES, "small", ab.Case(("bf16",), ("backward",), make, queued=True))
    rows = ab.run_jobs([("plain", "bf16", "forward"), ("small", "bf16", "backward")], "/k", 10, 5,
                       control="/c")
    assert timed == [(["plain bf16 forward against", "plain bf16 forward control",
                       "plain bf16 forward tree"], False),
                     (["small bf16 backward against", "small bf16 backward control",
                       "small bf16 backward tree"], True)]
    assert [(r["ratio"], round(r["control_ratio"], 3), r["same_bits"]) for r in rows] == [
        (0.5, 1.1, True), (0.5, 1.1, True)]
    assert "| control / against |" in ab.markdown(rows, "HEAD").splitlines()[0] + " |"
    assert "kernel-gn_swish_mul_swish_88" in ab.CASES
    assert ab.CASES["kernel-bias_relu_76"].queued and ab.CASES["kernel-bias_relu_76"].modes == (
        "forward", "backward")


def test_time_interleaved_queues_each_rounds_calls_behind_a_hold(monkeypatch):
    """queued=True (CPU tier, fake events and clock): before each round's
    timed calls of a function, one hold that outlasts their issue (1.5 x
    the issue time per call x the calls, plus 1 ms)."""
    clock = [0.0]
    holds = []
    monkeypatch.setattr(torch.cuda, "Event", _fake_event_on(clock, 1e3))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(bench_harness, "hold_gpu_ms", holds.append)

    def fn():  # 2 ms of issue a call
        clock[0] += 0.002

    times = bench_harness.time_interleaved({"k": fn}, iters=10, warmup=1, rounds=2, queued=True,
                                           clock=lambda: clock[0])
    assert [round(h, 6) for h in holds] == [1.5 * 2.0 * 5 + 1.0] * 2
    assert times["k"] == pytest.approx((2.0, 2.0))


def test_ab_jobs_and_arguments():
    ab = _bench_ab()
    assert ab.jobs(["gemm-37", "model-37"], ["fp32", "bf16"], ["forward", "train"]) == [
        ("gemm-37", "bf16", "forward"), ("model-37", "fp32", "forward"), ("model-37", "fp32", "train"),
        ("model-37", "bf16", "forward"), ("model-37", "bf16", "train")]
    args = ab.parse_args(["--against", "HEAD~1"])
    assert args.cases == list(ab.CASES) and args.dtypes == ["bf16"] and args.sustained == 0
    assert args.modes == ["forward", "train", "backward"] and not args.control
    assert ab.jobs(["kernel-bias_relu_76", "model-76"], ["bf16"], ["train", "backward"]) == [
        ("kernel-bias_relu_76", "bf16", "backward"), ("model-76", "bf16", "train")]
    assert ab.parse_args(["--against", "HEAD~1", "--control"]).control
    with pytest.raises(SystemExit):  # the plain products take 16-bit dtypes only
        ab.parse_args(["--against", "HEAD~1", "--cases", "gemm-37", "--dtypes", "fp32"])
    with pytest.raises(SystemExit):
        ab.parse_args([])  # --against is required


def test_ab_runs_both_sides_in_turns_and_reports_the_ratio(monkeypatch):
    """Each job's two sides are timed in one interleaved timing; the other
    copy's side runs inside kernels_from, the tree's outside; the row
    carries tree / against and whether the two computed the same bits."""
    ab = _bench_ab()
    inside = []
    fake_kernels_from = _kernels_from_recording(inside)

    def against():
        return bool(inside) and inside[-1] is not None

    def make(dtype, mode):
        out = {}

        def run():
            out["y"] = torch.tensor([2.0 if against() else 1.0]) if mode == "train" else torch.ones(1)
        return run, lambda: out["y"]

    timed = []

    def fake_interleaved(fns, iters, warmup, rounds, queued=False):
        timed.append((sorted(fns), iters, rounds, queued))
        for fn in fns.values():
            fn()
        return {name: (3.0 if name.endswith("against") else 2.4, 1.0) for name in fns}

    monkeypatch.setattr(ab, "kernels_from", fake_kernels_from)
    monkeypatch.setattr(ab, "time_interleaved", fake_interleaved)
    monkeypatch.setitem(ab.CASES, "fake", ab.Case(("bf16",), ("forward", "train"), make))
    rows = ab.run_jobs([("fake", "bf16", "forward"), ("fake", "bf16", "train")], "/k", 70, 7)
    assert timed == [(["fake bf16 forward against", "fake bf16 forward tree",
                       "fake bf16 train against", "fake bf16 train tree"], 70, 7, False)]
    assert [(r["mode"], r["against_ms"], r["tree_ms"], round(r["ratio"], 3), r["same_bits"])
            for r in rows] == [("forward", 3.0, 2.4, 0.8, True), ("train", 3.0, 2.4, 0.8, False)]
    assert rows[0]["dtype"] == "bfloat16" and inside == []
    table = ab.markdown(rows, "HEAD~1")
    assert "| fake | bfloat16 | train | 3.0000 | 2.4000 | 0.800 | NO |" in table
    assert "held" not in table


def test_conv_routes_grid_summary_and_files(tmp_path):
    """benchmarks/conv_routes.py without a GPU: its grid (kernels narrower
    than the image only), the losses' summary, and the files of a run."""
    spec = importlib.util.spec_from_file_location("bench_conv_routes", REPO / "benchmarks/conv_routes.py")
    routes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(routes)
    forward = list(routes.grid(["forward"], ["bf16"], False))
    images, kernels, channels = len(routes.IMAGES), len(routes.KERNELS), len(routes.CHANNELS_IN)
    assert len(forward) == images * kernels * channels * len(routes.CHANNELS_OUT) * len(routes.LAYOUTS)
    assert {case[4] for case in routes.grid(["forward"], ["fp32"], True)} == set(routes.ODD_CHANNELS_IN)
    train = list(routes.grid(["train"], ["bf16", "fp32"], False))
    assert {(case[4], case[5]) for case in train} == set(routes.TRAIN_CHANNELS)
    odd_train = routes.grid(["train"], ["bf16"], True)
    assert {(case[4], case[5]) for case in odd_train} == set(routes.ODD_TRAIN_CHANNELS)
    assert all(case[8] == "train" and case[3] < min(case[1], case[2]) for case in train)
    assert routes.parse_args([]).dtypes == ["bf16", "fp32"]  # fp16 and autocast on request
    assert routes.DTYPES["amp-fp16"] == (torch.float32, torch.float16)

    def row(engine, cudnn, pick):
        best = min(engine, cudnn)
        return dict(batch=1, height=8, width=8, kernel=3, cin=8, cout=32, dtype="bf16", layout="nchw",
                    mode="forward", engine_ms=engine, cudnn_ms=cudnn, ratio=cudnn / engine, pick=pick,
                    loss=(engine if pick == "engine" else cudnn) / best, engine_loss=engine / best,
                    cudnn_loss=cudnn / best)

    rows = [row(1.0, 4.0, "engine"), row(2.0, 1.0, "engine")]
    s = routes.summary(rows)["forward"]
    assert s["cases"] == 2 and s["rule_worst"] == 2.0 and abs(s["rule_geomean"] - 2 ** 0.5) < 1e-12
    assert s["engine_geomean"] == s["rule_geomean"] and s["cudnn_worst"] == 4.0
    meta = dict(argv=[], device="GPU", date="today", torch="t", summary=routes.summary(rows))
    bench_harness.write_run(str(tmp_path / "r.json"), str(tmp_path / "r.md"), meta, rows, routes.markdown)
    assert json.loads((tmp_path / "r.json").read_text())["rows"] == rows
    text = (tmp_path / "r.md").read_text()
    assert "| forward | 2 | 1.414 / 2.00 | 1.414 / 2.00 | 2.000 / 4.00 |" in text
    assert "| 1x8x8 | 3 | 8 -> 32 | bf16 | nchw | forward | 2.000 | 1.000 | 0.50 | engine | 2.00 |" in text
