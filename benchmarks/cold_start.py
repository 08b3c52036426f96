"""Cold start: the first training step of each model in a fresh process, with
an empty kernel cache, then again with the cache that process left.

For each problem and dtype, two fresh Python processes share a new, empty
``CUPY_CACHE_DIR``.  Each imports cupy_fused, builds the model at its small
shape (``cupy_fused.reference.SMALL_PROBLEMS``) on the GPU, then times one
training step: forward, backward of ``(y * g).sum()`` (the input requires
grad too, as for a layer inside a network, so every backward kernel runs),
``torch.cuda.synchronize()``.  The import and the build are timed apart.
The first process ("cold") compiles every kernel the step launches; the
second ("warm") loads them from CuPy's disk cache.  Each also times a
second step, which launches what is already loaded.

The kernel columns come from the ``"cupy_fused"`` logger: how many kernels
the process built (compiled, or loaded from the disk cache) and the seconds
that took.  The step's time also holds what torch does on its first use of
cuBLAS / cuDNN, the same in both processes.

    python benchmarks/cold_start.py [--problems 37 76] [--dtypes fp32 amp-bf16]
                                    [--out cold_start.json] [--target-s 8]
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]
PROBLEMS = (1, 37, 76, 88, 94)
# --dtypes choice -> (dtype of the model and its input, autocast dtype or None)
DTYPES = {
    "fp32": ("float32", None),
    "bf16": ("bfloat16", None),
    "fp16": ("float16", None),
    "amp-bf16": ("float32", "bfloat16"),
    "amp-fp16": ("float32", "float16"),
}
DEFAULT_DTYPES = ("fp32", "bf16", "fp16", "amp-bf16")
RESULT_PREFIX = "COLD_START_RESULT "


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", type=int, nargs="+", default=list(PROBLEMS),
                        choices=PROBLEMS)
    parser.add_argument("--dtypes", nargs="+", default=list(DEFAULT_DTYPES), choices=list(DTYPES),
                        help="fp32/bf16/fp16: model and input in that dtype; amp-bf16/amp-fp16: "
                             "float32 model and input, forward under torch.autocast")
    parser.add_argument("--out", help="write the rows and the environment here (JSON)")
    parser.add_argument("--target-s", type=float, default=8.0,
                        help="flag cold first steps longer than this (seconds)")
    parser.add_argument("--timeout-s", type=float, default=600.0,
                        help="give up on a process after this long")
    # Internal: the measuring process itself.
    parser.add_argument("--child", nargs=2, metavar=("PROBLEM", "DTYPE"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# ---------------------------------------------------------------- the measuring process

class _KernelLog(logging.Handler):
    """Counts the kernels built and sums their seconds, from the run time's
    "compiled <what> for <arch> in <seconds> s" lines."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.kernels: List[str] = []
        self.seconds = 0.0

    def emit(self, record: logging.LogRecord) -> None:
        if (isinstance(record.msg, str) and record.msg.startswith("compiled ")
                and isinstance(record.args, tuple) and len(record.args) == 3):
            what, arch, seconds = record.args
            self.kernels.append(f"{what} ({arch})")
            self.seconds += float(seconds)


def measure(problem: int, dtype: str) -> Dict[str, object]:
    """Runs in a fresh process: import, build, two training steps."""
    start = time.perf_counter()
    import torch

    import cupy_fused
    from cupy_fused import _runtime, models, reference

    import_s = time.perf_counter() - start
    kernel_log = _KernelLog()
    logger = logging.getLogger("cupy_fused")
    logger.addHandler(kernel_log)
    logger.setLevel(logging.INFO)
    if not torch.cuda.is_available():
        return dict(error="no CUDA GPU is visible", fatal=True)

    model_dtype, amp = (getattr(torch, name) if name else None for name in DTYPES[dtype])
    ref_cls, args, shape = reference.SMALL_PROBLEMS[problem]
    with torch.device("meta"):  # the output's shape, without running anything
        out_shape = ref_cls(*args)(torch.empty(shape)).shape
    # Under autocast the models return float32 (as their references do).
    out_dtype = model_dtype if amp is None else torch.float32

    start = time.perf_counter()
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    model = models.MODELS[problem](*args).to(device=device, dtype=model_dtype)
    x = torch.randn(shape, device=device, dtype=model_dtype, requires_grad=True)
    g = torch.randn(out_shape, device=device, dtype=out_dtype)
    torch.cuda.synchronize()
    build_s = time.perf_counter() - start

    def step() -> float:
        model.zero_grad(set_to_none=True)
        x.grad = None
        torch.cuda.synchronize()
        begin = time.perf_counter()
        with torch.autocast("cuda", dtype=amp) if amp is not None else contextlib.nullcontext():
            loss = (model(x) * g).sum()
        loss.backward()
        torch.cuda.synchronize()
        return time.perf_counter() - begin

    step_s = step()
    first_kernels, first_kernel_s = list(kernel_log.kernels), kernel_log.seconds
    second_step_s = step()
    logger.removeHandler(kernel_log)
    import cupy

    return dict(
        problem=problem, dtype=dtype, import_s=import_s, build_s=build_s, step_s=step_s,
        second_step_ms=second_step_s * 1e3, kernels=len(first_kernels), kernel_s=first_kernel_s,
        kernel_names=first_kernels, modules=_runtime.compiled_modules(),
        device=torch.cuda.get_device_name(device), arch=_runtime.device_arch(device.index),
        torch=torch.__version__, cupy=cupy.__version__,
        nvrtc=".".join(map(str, _runtime.nvrtc_version())), cupy_fused=cupy_fused.__version__,
        python=platform.python_version())


# ---------------------------------------------------------------- the driver

def parse_child_output(returncode: int, stdout: str, stderr: str) -> Dict[str, object]:
    """The result a measuring process printed, or an error row with the end
    of its output."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    tail = (stderr.strip() or stdout.strip()).splitlines()[-5:]
    return dict(error=f"exit status {returncode}: " + " | ".join(tail))


def run_child(problem: int, dtype: str, cache_dir: str, timeout_s: float) -> Dict[str, object]:
    """Measures in a fresh process whose CuPy kernel cache is ``cache_dir``."""
    env = dict(os.environ, CUPY_CACHE_DIR=cache_dir,
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    env.pop("CUPY_CACHE_IN_MEMORY", None)  # the disk cache is what the warm process measures
    try:
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child",
                               str(problem), dtype], env=env, capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return dict(error=f"timed out after {timeout_s:.0f} s")
    return parse_child_output(proc.returncode, proc.stdout, proc.stderr)


def job_row(problem: int, dtype: str, cold: dict, warm: Optional[dict], target_s: float) -> dict:
    """One table / JSON row from the cold and warm processes' results."""
    row = dict(problem=problem, dtype=dtype)
    errors = [f"{name}: {r['error']}" for name, r in (("cold", cold), ("warm", warm))
              if r is not None and "error" in r]
    if errors:
        row["error"] = "; ".join(errors)
    for name, r in (("cold", cold), ("warm", warm)):
        if r is None or "error" in r:
            continue
        for field in ("step_s", "second_step_ms", "kernels", "kernel_s", "import_s", "build_s"):
            row[f"{name}_{field}"] = r[field]
        row[f"{name}_kernel_names"] = r["kernel_names"]
    if "cold_step_s" in row:
        row["over_target"] = row["cold_step_s"] > target_s
    return row


def _cell(row: dict, key: str, width: int, fmt: str) -> str:
    value = row.get(key)
    return "-".rjust(width) if value is None else format(value, f">{width}{fmt}")


HEADER = (f"{'problem':>7} {'dtype':<9} {'cold step s':>11} {'warm step s':>11} "
          f"{'2nd step ms':>11} {'kernels':>7} {'compile s':>9} {'load s':>7}  note")


def format_row(row: dict, target_s: float) -> str:
    """One line of :func:`table`."""
    note = row.get("error", "")
    if row.get("over_target"):
        note = f"over the {target_s:g} s target"
    cells = [_cell(row, "cold_step_s", 11, ".2f"), _cell(row, "warm_step_s", 11, ".2f"),
             _cell(row, "cold_second_step_ms", 11, ".1f"), _cell(row, "cold_kernels", 7, "d"),
             _cell(row, "cold_kernel_s", 9, ".2f"), _cell(row, "warm_kernel_s", 7, ".2f")]
    return f"{row['problem']:>7} {row['dtype']:<9} {' '.join(cells)}  {note}".rstrip()


def table(rows: List[dict], target_s: float) -> str:
    """The rows as a fixed-width text table, with the slowest cold step."""
    lines = [HEADER, "-" * len(HEADER)] + [format_row(r, target_s) for r in rows]
    timed = [r for r in rows if "cold_step_s" in r]
    if timed:
        worst = max(timed, key=lambda r: r["cold_step_s"])
        lines.append(f"slowest cold first step: {worst['cold_step_s']:.2f} s "
                     f"(problem {worst['problem']}, {worst['dtype']}); target {target_s:g} s")
    return "\n".join(lines)


def _environment(results: List[dict]) -> dict:
    for r in results:
        if "error" not in r:
            return {k: r[k] for k in ("device", "arch", "torch", "cupy", "nvrtc", "cupy_fused",
                                      "python")}
    return {}


def run(args: argparse.Namespace,
        child: Callable[[int, str, str, float], Dict[str, object]] = run_child) -> List[dict]:
    """Measures every (problem, dtype) of ``args``, printing each row as it
    comes and rewriting ``args.out`` after each."""
    rows: List[dict] = []
    results: List[dict] = []
    meta = dict(argv=sys.argv[1:], date=datetime.datetime.now().isoformat(timespec="seconds"),
                target_s=args.target_s)
    for problem in args.problems:
        for dtype in args.dtypes:
            cache_dir = tempfile.mkdtemp(prefix="cupy_fused_cold_")
            try:
                cold = child(problem, dtype, cache_dir, args.timeout_s)
                warm = None if "error" in cold else child(problem, dtype, cache_dir,
                                                          args.timeout_s)
            finally:
                shutil.rmtree(cache_dir, ignore_errors=True)
            results += [r for r in (cold, warm) if r is not None]
            rows.append(job_row(problem, dtype, cold, warm, args.target_s))
            print(format_row(rows[-1], args.target_s), flush=True)
            if args.out:
                meta.update(_environment(results))
                Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")
            if cold.get("fatal"):
                return rows
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        problem, dtype = int(args.child[0]), args.child[1]
        print(RESULT_PREFIX + json.dumps(measure(problem, dtype)), flush=True)
        return 0
    print(f"Cold start: {len(args.problems)} problems x {len(args.dtypes)} dtypes, two fresh "
          "processes each (empty kernel cache, then warm)", flush=True)
    print(HEADER, flush=True)
    rows = run(args)
    print()
    print(table(rows, args.target_s))
    if args.out:
        print(f"wrote {args.out}")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
