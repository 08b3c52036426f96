"""Benchmark the five models: ours against the eager reference and
torch.compile, forward (no_grad) and training step (forward + backward of
``out.sum()``), time and peak extra memory.  Writes JSON and a Markdown
table.

    python benchmarks/run.py                       # all problems, fp32
    python benchmarks/run.py --dtypes fp32 bf16 --problems 76 88 --quick

Times: CUDA events around each iteration after warm-up, median and min.
Peak extra memory: max allocated during one training step minus what was
allocated before it (parameters and inputs), in GiB.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cupy_fused import reference  # noqa: E402
from cupy_fused.testing import build_pair  # noqa: E402

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
IMPLS = ("eager", "compile", "ours", "ours+compile")
# "gemm": the GEMM (or conv) alone, as our modules call it, forward only:
# ours minus this is the cost of the fused epilogue.
EXTRA_IMPLS = ("gemm",)


def time_ms(fn, iters: int, warmup: int):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(iters)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) for s, e in events]
    return statistics.median(times), min(times)


def peak_extra_gib(fn, reset) -> float:
    reset()  # drop the gradients of earlier steps before taking the baseline
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def _gemm_only(model):
    import torch.nn.functional as F

    if hasattr(model, "conv"):
        conv = model.conv
        return lambda x: F.conv2d(x, conv.weight, None, conv.stride, conv.padding)
    linear = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
    return lambda x: F.linear(x, linear.weight)


def bench_problem(problem, dtype, modes, impls, iters, warmup, shapes):
    _, args, shape = shapes[problem]
    ref, ours = build_pair(problem, args, "cuda", dtype)
    x = torch.rand(shape, device="cuda", dtype=dtype)
    xg = x.clone().requires_grad_(True)
    models = {}
    for impl in (i for i in impls if i in IMPLS):
        base = ref if impl in ("eager", "compile") else ours
        models[impl] = torch.compile(base) if impl.endswith("compile") else base
    if "gemm" in impls:
        models["gemm"] = _gemm_only(ours)
    rows = []
    for mode in modes:
        for impl, model in models.items():
            if impl == "gemm" and mode != "forward":
                continue

            def reset():
                for p in model.parameters() if hasattr(model, "parameters") else []:
                    p.grad = None
                xg.grad = None

            if mode == "forward":
                def step():
                    with torch.no_grad():
                        model(x)
            else:
                def step():
                    reset()
                    model(xg).sum().backward()
            med, best = time_ms(step, iters, warmup)
            mem = peak_extra_gib(step, reset) if mode == "train" else None
            rows.append(dict(problem=problem, dtype=str(dtype).replace("torch.", ""), mode=mode,
                             impl=impl, median_ms=med, min_ms=best, peak_extra_gib=mem))
            print(f"  {problem:>3} {rows[-1]['dtype']:<9} {mode:<8} {impl:<13} "
                  f"median {med:8.3f} ms  min {best:8.3f} ms"
                  + (f"  peak extra {mem:6.3f} GiB" if mem is not None else ""), flush=True)
    models.clear()
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    return rows


def markdown(rows) -> str:
    key = lambda r: (r["problem"], r["dtype"], r["mode"])  # noqa: E731
    groups = {}
    for r in rows:
        groups.setdefault(key(r), {})[r["impl"]] = r
    lines = ["| problem | dtype | mode | eager ms | compile ms | ours ms | ours+compile ms | "
             "GEMM/conv alone ms | ours/eager speedup | ours/compile speedup | "
             "peak extra GiB (eager / compile / ours) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (p, d, m), g in groups.items():
        get = lambda i, f="median_ms": g[i][f] if i in g and g[i][f] is not None else float("nan")  # noqa: E731
        mem = " / ".join(f"{get(i, 'peak_extra_gib'):.3f}" for i in ("eager", "compile", "ours"))
        lines.append(f"| {p} | {d} | {m} | {get('eager'):.3f} | {get('compile'):.3f} | "
                     f"{get('ours'):.3f} | {get('ours+compile'):.3f} | {get('gemm'):.3f} | "
                     f"{get('eager') / get('ours'):.2f}x | "
                     f"{get('compile') / get('ours'):.2f}x | {mem if m == 'train' else '-'} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", type=int, nargs="+", default=sorted(reference.PROBLEMS))
    parser.add_argument("--dtypes", nargs="+", default=["fp32"], choices=list(DTYPES))
    parser.add_argument("--modes", nargs="+", default=["forward", "train"], choices=["forward", "train"])
    parser.add_argument("--impls", nargs="+", default=list(IMPLS + EXTRA_IMPLS),
                        choices=list(IMPLS + EXTRA_IMPLS))
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="small shapes, few iterations")
    parser.add_argument("--out", default="results")
    args = parser.parse_args(argv)
    shapes = reference.SMALL_PROBLEMS if args.quick else reference.PROBLEMS
    if args.quick:
        args.iters, args.warmup = 10, 3
    torch.backends.cuda.matmul.allow_tf32 = False  # PyTorch's default for fp32 matmuls
    rows = []
    for dtype in args.dtypes:
        for problem in args.problems:
            rows += bench_problem(problem, DTYPES[dtype], args.modes, args.impls, args.iters,
                                  args.warmup, shapes)
    table = markdown(rows)
    print(table)
    os.makedirs(args.out, exist_ok=True)
    name = torch.cuda.get_device_name().replace(" ", "_")
    stem = os.path.join(args.out, f"{name}-{datetime.date.today()}")
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                cuda=torch.version.cuda, date=str(datetime.date.today()), argv=sys.argv[1:])
    with open(stem + ".json", "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(table + "\n")


if __name__ == "__main__":
    main()
