"""Benchmark the five models: ours against the eager reference and
torch.compile, forward (no_grad) and training step, time and peak extra
memory.  Writes JSON and a Markdown table.

    python benchmarks/run.py                       # all problems, fp32
    python benchmarks/run.py --dtypes fp32 bf16 --problems 76 88 --quick
    python benchmarks/run.py --dtypes amp-bf16 amp-fp16   # float32 models under autocast
    python benchmarks/run.py --full                # every dtype, mode and size: the full page
    python benchmarks/run.py --full --time-limit 9 # start no job after 9 minutes, then
    python benchmarks/run.py --full --resume results/<device>-<date>.json   # go on

Writes ``<out>/<device>-<date>.json`` (after every problem, dtype and
size, so that a stopped run keeps what it measured), the Markdown table
beside it and the PNG plots of ``benchmarks/plot.py`` (unless
``--no-plots``).  A finished run in the repository's ``results/`` (the
default ``--out``, from the repository root) is then published by
``benchmarks/publish.py``: its rows replace theirs in
``results/latest.json``, the tables of docs/performance.md and README.md
are redrawn from that, and a row is appended to ``results/history.jsonl``
(not with ``--quick`` or ``--no-publish``; a run stopped by
``--time-limit`` publishes when ``--resume`` finishes it).

Dtypes: ``fp32``, ``fp16``, ``bf16`` cast the model and its input to that
dtype.  ``amp-bf16`` and ``amp-fp16`` keep both in float32 and run the
forward of every implementation inside ``torch.autocast("cuda", dtype=...)``
(the training step's backward outside it, as training code does); their
rows' ``dtype`` is the mode's name.

Training step: forward, then the backward of ``(y * g).sum()`` for a fixed
random ``g`` of the output's shape and dtype (drawn once per problem and
dtype from one seed: the same values for every implementation), run as
``y.backward(g)``.  ``y.sum()`` would be a poor stand-in: its gradient is
one value broadcast everywhere, which a backward can read as a scalar, and
through a GroupNorm with unit weights (37 and 94 end in one) the input's
gradient of a sum is zero.

Times: CUDA events around each iteration after warm-up, median and min;
the implementations of one problem, dtype and mode are timed in turns
(rounds of a few iterations each), so that whatever drifts over a run (GPU
clock and temperature, host load) treats them alike.  Each is timed for at
least ``--min-ms`` of its steps (150 ms; short steps get up to 10x
``--iters``): a step of well under a millisecond is as long as the host
takes to issue it, and 30 of them are too few to average the host's pace.
When an input is smaller than the L2 cache, iterations rotate over several
copies of it (together at least twice the L2), so that no iteration finds
its input in L2 from the one before; the weights stay as they are (a model
reads the same parameters every call).  Peak extra memory: max allocated
during one training step minus what was allocated before it (parameters and
inputs), in GiB.

Host-bound steps: the event time of a step is the GPU's time only when the
host issues the step faster than the GPU runs it; otherwise the GPU waits
between kernels and the event time is the host's.  So each step is also
timed twice more (``harness.host_and_gpu_ms``): the host's issue time (the
wall time of issuing ``--host-steps`` steps without synchronising) and the
GPU's time with the host far ahead (the same steps queued behind a sleep
kernel).  A row is ``host_bound`` where the first is the longer.

``ours+graphs`` is ``torch.compile(ours, mode="reduce-overhead")``: CUDA
graphs over our modules, which take the host's per-kernel work out of the
step (``--impls`` or ``--full``; not in the default list, it compiles).
``ours+graphed`` is a copy of our module under
``torch.cuda.make_graphed_callables`` (its forward and backward captured as
two CUDA graphs, replayed each step: ``harness.graphed_step_fns``;
``--impls`` or ``--full``).  ``compile+graphs`` is the reference under
``torch.compile(mode="reduce-overhead")``: torch.compile's own CUDA graphs,
what graphs over our modules are set against.

torch.compile compiles in this process (``TORCHINDUCTOR_COMPILE_THREADS=1``
unless set otherwise): with a pool of compile workers, the pool's
processes keep busy for tens of seconds after the first compile, and every
implementation timed meanwhile shares the CPU with them, which slows the
host-bound steps (docs/performance.md, Method); in-process compiling only
makes compiling slower.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import sys
import time

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # see above; before torch

import torch

# The library of this tree, and benchmarks/ itself when loaded by path (the tests).
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import publish  # noqa: E402
from cupy_fused import reference  # noqa: E402
from cupy_fused.testing import build_pair  # noqa: E402
from harness import (DTYPES, Progress, autocast_context, autocast_dtype, collect_dead_graphs,  # noqa: E402
                     dtype_label, fixed_grad, gpu_state, graphed_step_fns, host_and_gpu_ms, l2_bytes,
                     model_dtype, peak_extra_gib, product_tflops, rotation_count, say, step_fns,
                     time_interleaved, time_ms)
from publish import markdown  # noqa: E402 -- the table beside the JSON

ALL_DTYPES = tuple(DTYPES)
IMPLS = ("eager", "compile", "ours", "ours+compile")
# "gemm": the GEMM (or conv) alone, as our modules call it, forward only:
# ours minus this is the cost of the fused epilogue.  "ours+graphs": ours
# under torch.compile(mode="reduce-overhead") (CUDA graphs); "ours+graphed":
# a copy of ours under torch.cuda.make_graphed_callables (CUDA graphs);
# "compile+graphs": the reference under torch.compile(mode="reduce-overhead").
GRAPH_IMPLS = ("ours+graphs", "ours+graphed", "compile+graphs")
EXTRA_IMPLS = ("gemm",) + GRAPH_IMPLS
# Implementations that compile (one compile per size in a sweep: left out of
# the sweep unless --sweep-compile).
COMPILED = ("compile", "ours+compile", "ours+graphs", "compile+graphs")
# Implementations compiled with mode="reduce-overhead" (CUDA graphs).
REDUCE_OVERHEAD = ("ours+graphs", "compile+graphs")
# Batch sizes of the size sweep (1: a point dominated by per-call host cost).
SWEEP_GEMM = (1, 64, 256, 1024, 4096, 16384, 32768)
SWEEP_CONV = (1, 8, 32, 64, 128)


def model_flops(problem: int, args: tuple, shape: tuple) -> float:
    """Forward FLOPs of the GEMM / convolution (the epilogue is negligible)."""
    if problem == 1:
        n, cin, h, w = shape
        cout, k = args[1], args[2]
        return 2.0 * n * cout * (h - k + 1) * (w - k + 1) * cin * k * k
    m, k = shape
    return 2.0 * m * args[1] * k


def ceilings(iters: int = 10) -> dict:
    """Measured in this run: SGEMM, TF32 and bf16 matmul TFLOP/s at 8192^3,
    and device copy bandwidth (GB/s, read + write) of a 1 GiB copy."""
    out = {name: product_tflops(dtype, tf32, iters=iters)
           for name, dtype, tf32 in (("sgemm_tflops", torch.float32, False),
                                     ("tf32_tflops", torch.float32, True),
                                     ("bf16_tflops", torch.bfloat16, False))}
    src = torch.empty(2 ** 28, device="cuda")
    dst = torch.empty_like(src)
    _, best = time_ms(lambda: dst.copy_(src), iters, 3)
    out["copy_gbps"] = 2 * src.numel() * 4 / best / 1e6
    torch.cuda.empty_cache()
    return out


def ceiling(problem: int, dtype: str, peaks: dict) -> float:
    """The rate our implementation of ``problem`` can reach at most: bf16 /
    fp16 tensor cores (autocast included); in fp32, TF32 for the convolution
    (cuDNN runs TF32 by default) and a third of TF32 for the GEMM problems,
    whose float32 products are three TF32 tensor-core products (3xTF32)."""
    if dtype != "fp32":
        return peaks["bf16_tflops"]
    return peaks["tf32_tflops"] / (1 if problem == 1 else 3)


def forward_errors(problem, args, shape, dtype: str, device="cuda", channels_last=False,
                   compiled=False) -> dict:
    """Max relative error of the forward output vs float64: ours, eager and,
    with ``compiled``, torch.compile's (the reference compiled), so that a
    compiled baseline that does not compute what eager does shows.

    Args:
        problem, args, shape: the problem, its constructor arguments and
            input shape.
        dtype: a ``--dtypes`` choice; in the autocast modes the float32
            models run under autocast against the same float64 reference.
        device: where to run.
        channels_last: a 4-D input in channels-last memory format.
        compiled: also measure ``torch.compile`` of the reference.

    Returns:
        ``{"ours": error, "eager": error}`` (and ``"compile"``); an
        implementation whose forward raised is left out (its message is
        printed).
    """
    import copy

    ref, ours = build_pair(problem, args, device, model_dtype(dtype))
    x = _input(shape, dtype, device, channels_last)
    errs = {}
    impls = [("ours", ours), ("eager", ref)]
    if compiled:
        impls.append(("compile", torch.compile(copy.deepcopy(ref))))
    with torch.no_grad():
        truth = copy.deepcopy(ref).double()(x.double())
        scale = truth.abs().max().item()
        for name, m in impls:
            try:
                with autocast_context(autocast_dtype(dtype), x.device.type):
                    y = m(x)
            except Exception as exc:  # noqa: BLE001 -- reported, the timing decides
                say(f"  {problem} {dtype} {name}: forward failed: {exc!r}")
                continue
            errs[name] = (y.double() - truth).abs().max().item() / scale
    del truth
    if x.is_cuda:
        torch.cuda.empty_cache()
    return errs


def _gemm_only(model):
    import torch.nn.functional as F

    if hasattr(model, "conv"):
        conv = model.conv
        return lambda x: F.conv2d(x, conv.weight, None, conv.stride, conv.padding)
    linear = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
    # ops.linear without bias or activation: our GEMM in float32 (at the
    # default precision), cuBLAS in float16 / bfloat16.
    from cupy_fused import ops

    def gemm(x):
        weight = linear.weight
        if torch.is_autocast_enabled(x.device.type):
            # Operands in the autocast dtype, as autocast gives F.linear its
            # (the weight's cast included: autocast casts it every forward).
            amp = torch.get_autocast_dtype(x.device.type)
            x, weight = x.to(amp), weight.to(amp)
        return ops.linear(x, weight)

    return gemm


def _input(shape, dtype: str, device, channels_last: bool) -> torch.Tensor:
    """A random model input; a 4-D one in channels-last memory format if
    ``channels_last``."""
    x = torch.rand(shape, device=device, dtype=model_dtype(dtype))
    return x.contiguous(memory_format=torch.channels_last) if channels_last and x.dim() == 4 else x


def bench_problem(problem, dtype, modes, impls, iters, warmup, shapes, progress, batch=None,
                  errors=True, peak=None, min_ms=0.0, host_steps=10, host_rounds=3,
                  device="cuda", channels_last=False):
    """Times the implementations ``impls`` of ``problem`` in one dtype.

    Args:
        problem: the problem id.
        dtype: a ``--dtypes`` choice (a key of ``harness.DTYPES``).
        modes: "forward" and/or "train".
        impls: implementations (:data:`IMPLS` and :data:`EXTRA_IMPLS`).
        iters, warmup, min_ms: as ``harness.time_interleaved``.
        shapes: the problem table (``reference.PROBLEMS`` or ``SMALL_PROBLEMS``).
        progress: called after each timed implementation, with its name
            ("76 float32 b1024 train ours").
        batch: the batch size of a sweep point, None at the problem's shape.
        errors: measure the forward's error against float64.
        peak: the TFLOP/s ceiling, for ``ceiling_fraction``.
        host_steps, host_rounds: of ``harness.host_and_gpu_ms`` (0 steps: skip).
        device: where to run (the timing needs CUDA; tests pass "cpu" with
            fake CUDA timers).
        channels_last: a 4-D input (problem 1) in channels-last memory
            format; its rows' dtype label then ends in " channels-last".

    Returns:
        One row (a dict) per mode and implementation; an implementation
        whose first step raised gets a row with ``error`` and no times.
    """
    _, args, shape = shapes[problem]
    if batch is not None:
        shape = (batch,) + tuple(shape[1:])
    label, amp = dtype_label(dtype), autocast_dtype(dtype)
    channels_last = channels_last and len(shape) == 4
    if channels_last:
        label += " channels-last"
    flops = model_flops(problem, args, shape)
    errs = forward_errors(problem, args, shape, dtype, device, channels_last,
                          compiled=any(i.startswith("compile") for i in impls)) if errors else {}
    ref, ours = build_pair(problem, args, device, model_dtype(dtype))
    x = _input(shape, dtype, device, channels_last)
    copies = rotation_count(x.numel() * x.element_size(), l2_bytes())
    inputs = [x] + [torch.rand_like(x) for _ in range(copies - 1)]
    train_inputs = [t.clone().requires_grad_(True) for t in inputs]
    models, bases = {}, {}
    for impl in (i for i in impls if i in IMPLS + GRAPH_IMPLS):
        bases[impl] = base = ref if impl in ("eager", "compile", "compile+graphs") else ours
        if impl in REDUCE_OVERHEAD:
            models[impl] = torch.compile(base, mode="reduce-overhead")
        elif impl == "ours+graphed":
            models[impl] = base  # (a copy of it per mode, captured below)
        else:
            models[impl] = torch.compile(base) if impl.endswith("compile") else base
    if "gemm" in impls:
        models["gemm"] = bases["gemm"] = _gemm_only(ours)
    rows = []

    def row(mode, impl, **fields):
        return dict(problem=problem, dtype=label, mode=mode, impl=impl, batch=shape[0],
                    sweep=batch is not None, input_copies=copies, **fields)

    grads = {}  # output dtype -> g: one set of values for every implementation
    for mode in modes:
        steps, resets = {}, {}
        collect_dead_graphs()  # the last mode's graphed copy, before this mode's captures
        for impl, model in models.items():
            if impl == "gemm" and mode != "forward":
                continue
            try:
                g = None
                if mode == "train":
                    probe = fixed_grad(bases[impl], x, amp, device_type=x.device.type)
                    g = grads.setdefault(probe.dtype, probe)
                if impl == "ours+graphed":
                    step, reset = graphed_step_fns(copy.deepcopy(model), mode, inputs, train_inputs, g, amp,
                                                   device_type=x.device.type)
                else:
                    step, reset = step_fns(model, mode, inputs, train_inputs, g, amp,
                                           graphs=impl in REDUCE_OVERHEAD, device_type=x.device.type)
                step()  # the first call compiles, and fails here if it fails
            except Exception as exc:  # noqa: BLE001 -- one implementation, not the run
                say(f"  {problem:>3} {label:<9} b{shape[0]:<6} {mode:<8} {impl:<13} "
                    f"failed: {exc!r}")
                rows.append(row(mode, impl, median_ms=None, min_ms=None, error=repr(exc)))
                progress(f"{problem} {label} b{shape[0]} {mode} {impl}")
                continue
            steps[impl], resets[impl] = step, reset
        # All implementations in turns (see time_interleaved), not one after another.
        times = time_interleaved(steps, iters, warmup, min_ms=min_ms) if steps else {}
        for impl, step in steps.items():
            med, best = times[impl]
            mem = peak_extra_gib(step, resets[impl]) if mode == "train" else None
            host = gpu = None
            if host_steps > 0:
                host, gpu = host_and_gpu_ms(step, host_steps, host_rounds)
            work = flops * (3 if mode == "train" else 1)
            tflops = work / med / 1e9
            rows.append(row(mode, impl, median_ms=med, min_ms=best,
                            host_ms=host, gpu_ms=gpu,
                            host_bound=None if host is None else host > gpu,
                            peak_extra_gib=mem, tflops=tflops,
                            ceiling_fraction=tflops / peak if peak else None,
                            fwd_rel_error=errs.get("ours" if impl.startswith("ours") else "eager")
                            if impl != "gemm" else None,
                            **({"compile_fwd_rel_error": errs.get("compile")}
                               if impl.startswith("compile") else {})))
            progress(f"{problem} {label} b{shape[0]} {mode} {impl}")
            host_text = "" if host is None else (
                f"  host {host:7.3f} GPU {gpu:7.3f} ms" + ("  host-bound" if host > gpu else ""))
            say(f"  {problem:>3} {label:<9} b{shape[0]:<6} {mode:<8} {impl:<13} "
                f"median {med:8.3f} ms  min {best:8.3f} ms  {tflops:6.1f} TFLOP/s" + host_text
                + (f"  peak extra {mem:6.3f} GiB" if mem is not None else ""))
    models.clear()
    bases.clear()
    torch._dynamo.reset()
    if x.is_cuda:
        torch.cuda.empty_cache()
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", type=int, nargs="+", default=sorted(reference.PROBLEMS))
    parser.add_argument("--dtypes", nargs="+", default=["fp32"], choices=list(ALL_DTYPES),
                        help="fp32/fp16/bf16: model and input in that dtype; amp-bf16/amp-fp16: "
                             "float32 model and input, forward under torch.autocast")
    parser.add_argument("--modes", nargs="+", default=["forward", "train"], choices=["forward", "train"])
    parser.add_argument("--impls", nargs="+", default=None, choices=list(IMPLS + EXTRA_IMPLS),
                        help="default: %s (--full: all of them)" % " ".join(IMPLS + ("gemm",)))
    parser.add_argument("--channels-last", action="store_true",
                        help="4-D inputs (problem 1) in channels-last memory format; their rows' "
                             "dtype reads e.g. 'bfloat16 channels-last'")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--min-ms", type=float, default=150.0,
                        help="time each implementation for at least this many ms of its steps: "
                             "short steps get more iterations, up to 10x --iters "
                             "(benchmarks/harness.py: time_interleaved)")
    parser.add_argument("--host-steps", type=int, default=10,
                        help="steps per round of the host issue / GPU time of each row "
                             "(host_and_gpu_ms); 0 skips it")
    parser.add_argument("--host-rounds", type=int, default=3,
                        help="rounds of the host issue / GPU time (the median is kept)")
    parser.add_argument("--sweep-iters", type=int, default=10,
                        help="iterations per point of the size sweep (a curve needs fewer)")
    parser.add_argument("--quick", action="store_true", help="small shapes, few iterations")
    parser.add_argument("--sweep", action="store_true",
                        help="also time each problem over a range of batch sizes (eager and ours)")
    parser.add_argument("--sweep-dtypes", nargs="+", default=["fp32"], choices=list(ALL_DTYPES))
    parser.add_argument("--sweep-compile", action="store_true",
                        help="include the compiled implementations in the sweep (one compile "
                             "per size)")
    parser.add_argument("--full", action="store_true",
                        help="every dtype (autocast modes included), both modes, every "
                             "implementation (the graphs' ones included), and the size "
                             "sweep in every dtype: the whole benchmark page in one command")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument("--no-publish", action="store_true",
                        help="do not publish the finished run (benchmarks/publish.py: "
                             "results/latest.json and history.jsonl, the tables of "
                             "docs/performance.md and README.md)")
    parser.add_argument("--commit", default=None,
                        help="the commit of the tree measured, for the run's meta (default: git "
                             "rev-parse --short HEAD, +dirty for a modified tree; needed where "
                             "the tree is a copy without git)")
    parser.add_argument("--resume", metavar="JSON", default=None,
                        help="add to the results file of an earlier run of the same command, "
                             "skipping the jobs it holds")
    parser.add_argument("--time-limit", type=float, metavar="MINUTES", default=None,
                        help="start no new job after this many minutes (one job at least; the "
                             "results so far are written and --resume goes on)")
    parser.add_argument("--out", default="results")
    args = parser.parse_args(argv)
    if args.impls is None:
        args.impls = list(IMPLS + EXTRA_IMPLS) if args.full else list(IMPLS + ("gemm",))
    if args.full:
        args.dtypes = args.sweep_dtypes = list(ALL_DTYPES)
        args.modes = ["forward", "train"]
        args.sweep = True
    return args


def job_key(dtype: str, problem: int, batch) -> tuple:
    """Identity of one job (``dtype`` a ``--dtypes`` choice; batch None at
    the benchmark shape), as :func:`row_key` gives it for its result rows."""
    return (problem, dtype_label(dtype), batch)


def row_key(row: dict) -> tuple:
    return (row["problem"], row["dtype"], row["batch"] if row["sweep"] else None)


def pending_jobs(jobs, rows) -> list:
    """The jobs without result rows (each job's rows are saved together,
    once it is complete)."""
    done = {row_key(r) for r in rows}
    return [j for j in jobs if job_key(*j) not in done]


def run_count(jobs, modes, impls, sweep_impls) -> int:
    """Timed runs of ``jobs``: one per mode and implementation ("gemm" is
    timed in the forward mode only)."""
    return sum(1 for _, _, batch in jobs for mode in modes
               for impl in (impls if batch is None else sweep_impls)
               if impl != "gemm" or mode == "forward")


def fresh_stem(stem: str) -> str:
    """``stem``, or ``stem-2``, ``stem-3``, ... where a run's file of that
    name is there already (an earlier run of the same day, which a new run
    would overwrite)."""
    candidate, n = stem, 1
    while os.path.exists(candidate + ".json"):
        n += 1
        candidate = f"{stem}-{n}"
    return candidate


def _write_json(path: str, data: dict) -> None:
    # (atomic: a run stopped mid-write keeps the previous file)
    publish._write(path, json.dumps(data, indent=1))


def _publish(path: str, args) -> None:
    """Publishes a finished run (``benchmarks/publish.py``), unless it ran
    small shapes (``--quick``) or ``--no-publish``, or wrote outside the
    repository's ``results/`` (a run into another folder, such as the logs
    of a GPU check, leaves the published tables alone)."""
    if args.quick or args.no_publish:
        return
    results = os.path.join(REPO, "results")
    if os.path.realpath(os.path.dirname(os.path.abspath(path))) != os.path.realpath(results):
        print(f"not published (not in {results}): python benchmarks/publish.py {path}")
        return
    publish.publish([path], root=REPO)
    print("published: results/latest.json, results/history.jsonl, docs/performance.md, "
          "README.md")


def main(argv=None):
    args = parse_args(argv)
    shapes = reference.SMALL_PROBLEMS if args.quick else reference.PROBLEMS
    if args.quick:
        args.iters, args.warmup = 10, 3
    torch.backends.cuda.matmul.allow_tf32 = False  # PyTorch's default for fp32 matmuls
    jobs = [(d, p, None) for d in args.dtypes for p in args.problems]
    sweep_impls = (args.impls if args.sweep_compile
                   else [i for i in args.impls if i not in COMPILED])
    if args.sweep:
        jobs += [(d, p, b) for d in args.sweep_dtypes for p in args.problems
                 for b in (SWEEP_CONV if p == 1 else SWEEP_GEMM)]
    invocation = dict(argv=sys.argv[1:] if argv is None else list(argv),
                      started=datetime.datetime.now().isoformat(timespec="seconds"),
                      gpu_state_before=gpu_state())
    if args.resume:
        with open(args.resume) as f:
            saved = json.load(f)
        meta, rows = saved["meta"], saved["rows"]
        here = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                    commit=args.commit or publish.tree_commit())
        differ = [k for k, v in here.items() if meta.get(k) != v]
        if differ:  # (one file's rows are one run's: the same GPU, torch and tree)
            raise SystemExit(f"--resume {args.resume}: its {', '.join(differ)} "
                             f"({', '.join(str(meta.get(k)) for k in differ)}) differ from "
                             f"this one's ({', '.join(str(here[k]) for k in differ)})")
        stem = args.resume[:-5] if args.resume.endswith(".json") else args.resume
        peaks = meta["ceilings"]  # ratios to one set of ceilings across the resumed runs
        jobs = pending_jobs(jobs, rows)
        print(f"resuming {args.resume}: {len(rows)} rows there, {len(jobs)} jobs left")
    else:
        os.makedirs(args.out, exist_ok=True)
        name = torch.cuda.get_device_name().replace(" ", "_")
        stem = fresh_stem(os.path.join(args.out, f"{name}-{datetime.date.today()}"))
        peaks = ceilings()
        meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                    cuda=torch.version.cuda, date=str(datetime.date.today()), ceilings=peaks,
                    commit=args.commit or publish.tree_commit(), quick=bool(args.quick),
                    invocations=[])
        rows = []
    meta["invocations"].append(invocation)
    print("ceilings: " + ", ".join(f"{k} {v:.1f}" for k, v in peaks.items()))
    runs = run_count(jobs, args.modes, args.impls, sweep_impls)
    start = time.monotonic()
    left = list(jobs)
    with Progress(runs, "timed runs") as progress:
        while left:
            dtype, problem, batch = left.pop(0)
            impls = args.impls if batch is None else sweep_impls
            peak = ceiling(problem, dtype, peaks)
            iters = args.iters if batch is None else min(args.iters, args.sweep_iters)
            rows += bench_problem(problem, dtype, args.modes, impls, iters, args.warmup,
                                  shapes, progress, batch=batch, errors=batch is None, peak=peak,
                                  min_ms=0.0 if args.quick else args.min_ms,
                                  host_steps=args.host_steps, host_rounds=args.host_rounds,
                                  channels_last=args.channels_last)
            _write_json(stem + ".json", dict(meta=meta, rows=rows))  # after every job
            if args.time_limit is not None and time.monotonic() - start > 60 * args.time_limit:
                break  # (each invocation completes one job at least)
    invocation["gpu_state_after"] = gpu_state()
    _write_json(stem + ".json", dict(meta=meta, rows=rows))
    table = markdown([r for r in rows if not r["sweep"]])
    print(table)
    with open(stem + ".md", "w") as f:
        f.write(table + "\n")
    print(stem + ".json")
    if left:
        print(f"stopped after --time-limit {args.time_limit} min with {len(left)} of "
              f"{len(jobs)} jobs left; the same command with --resume {stem}.json goes on")
    else:
        _publish(stem + ".json", args)
    if not args.no_plots:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("matplotlib is not installed: no plots (python benchmarks/plot.py "
                  f"{stem}.json makes them later)")
        else:
            import plot  # benchmarks/ is on sys.path (above)

            plot.main(stem + ".json")


if __name__ == "__main__":
    main()
