"""Weak scaling of the DDP training step over 1 to N GPUs of one host.

Each GPU gets the problem's benchmark batch (``cupy_fused.reference.PROBLEMS``),
so the global batch grows with the GPU count and an ideal step takes as long
on N GPUs as on one.  A step is a forward (under ``torch.autocast`` in the
amp modes), ``y.backward(g)`` with a fixed output gradient, and DDP's
all-reduce of the gradients, which the backward waits for; there is no
optimizer step (the same on every GPU count).  Implementations: ``eager``
(the PyTorch reference), ``compile`` (``torch.compile`` of the DDP-wrapped
reference, so that its graph is split at the gradient buckets), ``ours``
(``cupy_fused.models.MODELS``).  Every GPU count, the one-GPU baseline
included, runs under DDP over NCCL.

Reported per problem, dtype and implementation: the median step time over
CUDA-event-timed steps (the slowest rank's median), the efficiency
``t(1 GPU) / t(N GPUs)``, and the all-reduce volume per step (the bytes of
the parameters' gradients) with the traffic per GPU of a ring all-reduce
over 8 GPUs, ``2 (n - 1) / n`` of it, for an estimate of larger or
multi-host runs at a link's bandwidth.

Run: ``python benchmarks/scaling.py [--gpus N] [--out scaling.json]``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile

# As in run.py: a pool of compile workers would share the CPU with the timed steps.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

# The library of this tree, and benchmarks/ itself when loaded by path (the tests).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cupy_fused import reference  # noqa: E402
from harness import (DTYPES, autocast_dtype, dtype_label, l2_bytes, model_dtype,  # noqa: E402
                     rotation_count, time_ms)

IMPLS = ("eager", "compile", "ours")
DEFAULT_DTYPES = ("fp32", "amp-bf16")
ESTIMATE_GPUS = 8


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", type=int, nargs="+", default=sorted(reference.PROBLEMS),
                        choices=sorted(reference.PROBLEMS))
    parser.add_argument("--dtypes", nargs="+", default=list(DEFAULT_DTYPES), choices=list(DTYPES))
    parser.add_argument("--impls", nargs="+", default=list(IMPLS), choices=list(IMPLS))
    parser.add_argument("--gpus", type=int, default=None,
                        help="largest GPU count (default: every visible GPU; 1 times the "
                             "one-GPU baseline alone)")
    parser.add_argument("--iters", type=int, default=30, help="timed steps")
    parser.add_argument("--warmup", type=int, default=5,
                        help="untimed steps first (the first one compiles)")
    parser.add_argument("--quick", action="store_true",
                        help="small shapes (cupy_fused.reference.SMALL_PROBLEMS), few steps")
    parser.add_argument("--out", default=None, metavar="JSON", help="write the results here")
    return parser.parse_args(argv)


def gpu_count(args: argparse.Namespace, visible: int) -> int:
    """The largest GPU count to run, or SystemExit with the reason."""
    if visible < 1:
        raise SystemExit("scaling.py: no CUDA GPU visible")
    if args.gpus is None:
        if visible < 2:
            raise SystemExit(f"scaling.py: {visible} GPU visible; weak scaling needs at least 2 "
                             "(--gpus 1 times the one-GPU baseline alone)")
        return visible
    if args.gpus < 1:
        raise SystemExit("scaling.py: --gpus must be at least 1")
    if args.gpus > visible:
        raise SystemExit(f"scaling.py: --gpus {args.gpus}, but {visible} GPU(s) visible")
    return args.gpus


def world_sizes(n: int) -> list:
    """1, 2, 4, ... below n, and n."""
    sizes, k = [], 1
    while k < n:
        sizes.append(k)
        k *= 2
    return sizes + [n]


def ring_bytes_per_gpu(nbytes: int, n: int) -> int:
    """Bytes each GPU sends (and receives) in a ring all-reduce of
    ``nbytes`` over ``n`` GPUs."""
    return 2 * (n - 1) * nbytes // n


# --- one process of one GPU count ----------------------------------------

def _bench_case(problem, dtype, impl, args, rank, device):
    """(median ms, min ms, parameter bytes) of this rank's DDP step."""
    from cupy_fused.testing import build_pair

    shapes = reference.SMALL_PROBLEMS if args["quick"] else reference.PROBLEMS
    _, ctor_args, shape = shapes[problem]
    amp = autocast_dtype(dtype)
    ref, ours = build_pair(problem, ctor_args, device, model_dtype(dtype))
    base = ours if impl == "ours" else ref
    del ref, ours
    param_bytes = sum(p.numel() * p.element_size() for p in base.parameters() if p.requires_grad)
    model = torch.nn.parallel.DistributedDataParallel(base, device_ids=[device.index])
    if impl == "compile":
        model = torch.compile(model)
    # Each rank its own data; inputs that fit in L2 rotate over copies, as in run.py.
    gen = torch.Generator(device=device).manual_seed(1000 * problem + rank)
    x0 = torch.rand(shape, generator=gen, device=device, dtype=model_dtype(dtype))
    count = rotation_count(x0.numel() * x0.element_size(), l2_bytes())
    xs = [x0] + [torch.rand_like(x0) for _ in range(count - 1)]
    with torch.no_grad(), torch.autocast("cuda", dtype=amp, enabled=amp is not None):
        y = base(x0)
    g = torch.randn(y.shape, generator=gen, device=device, dtype=torch.float32).to(y.dtype)
    del y
    state = {"i": 0}

    def step():
        for p in base.parameters():
            p.grad = None
        x = xs[state["i"] % len(xs)]
        state["i"] += 1
        with torch.autocast("cuda", dtype=amp, enabled=amp is not None):
            out = model(x)
        out.backward(g)  # outside autocast, as training code runs it

    # Every rank makes the same number of calls (each one all-reduces).
    dist.barrier()
    median, low = time_ms(step, args["iters"], args["warmup"])
    del model, base, xs, g
    torch.cuda.empty_cache()
    return median, low, param_bytes


def _worker(rank, world, args, out_path):
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    torch.backends.cuda.matmul.allow_tf32 = False  # PyTorch's default for fp32 matmuls
    dist.init_process_group("nccl", init_method=f"file://{args['store']}", rank=rank,
                            world_size=world, device_id=device,
                            timeout=datetime.timedelta(minutes=10))
    try:
        rows = []
        for dtype in args["dtypes"]:
            for problem in args["problems"]:
                for impl in args["impls"]:
                    median, low, nbytes = _bench_case(problem, dtype, impl, args, rank, device)
                    # The step of the slowest rank sets the pace of them all.
                    times = torch.tensor([median, low], device=device, dtype=torch.float64)
                    dist.all_reduce(times, op=dist.ReduceOp.MAX)
                    if impl == "compile":
                        torch._dynamo.reset()
                    rows.append(dict(problem=problem, dtype=dtype_label(dtype), impl=impl,
                                     gpus=world, median_ms=times[0].item(),
                                     min_ms=times[1].item(), param_bytes=nbytes))
                    if rank == 0:
                        print(f"{world} GPU(s) {problem:>3} {dtype:<9}{impl:<8}"
                              f"{rows[-1]['median_ms']:9.3f} ms", flush=True)
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(rows, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_world(world: int, args: argparse.Namespace) -> list:
    """The rows of one GPU count, from ``world`` spawned processes."""
    with tempfile.TemporaryDirectory() as tmp:
        spec = dict(vars(args), store=os.path.join(tmp, "store"))
        out_path = os.path.join(tmp, "rows.json")
        mp.start_processes(_worker, args=(world, spec, out_path), nprocs=world,
                           start_method="spawn")
        with open(out_path) as f:
            return json.load(f)


# --- results -------------------------------------------------------------

def summarize(rows: list) -> list:
    """Per problem, dtype and implementation: the largest GPU count's step
    time against one GPU's (``efficiency``), with the all-reduce volume."""
    groups = {}
    for r in rows:
        groups.setdefault((r["problem"], r["dtype"], r["impl"]), {})[r["gpus"]] = r
    out = []
    for (problem, dtype, impl), by_n in groups.items():
        n = max(by_n)
        one = by_n.get(1)
        eff = (one["median_ms"] / by_n[n]["median_ms"]
               if one is not None and by_n[n]["median_ms"] > 0 else None)
        nbytes = by_n[n]["param_bytes"]
        out.append(dict(problem=problem, dtype=dtype, impl=impl, gpus=n, efficiency=eff,
                        allreduce_bytes=nbytes,
                        ring_bytes_per_gpu_at_8=ring_bytes_per_gpu(nbytes, ESTIMATE_GPUS)))
    return out


def table(rows: list) -> str:
    """Plain-text table: one line per problem, dtype and implementation, a
    step-time column per GPU count ("-" where it is missing)."""
    sizes = sorted({r["gpus"] for r in rows})
    ms = {(r["problem"], r["dtype"], r["impl"], r["gpus"]): r["median_ms"] for r in rows}
    head = f"{'problem':<8}{'dtype':<10}{'impl':<9}"
    head += "".join(f"{f'{n} GPU' + ('s' if n > 1 else '') + ' ms':>12}" for n in sizes)
    head += f"{'efficiency':>12}{'all-reduce MB':>15}{'ring MB/GPU @8':>16}"
    lines = [head]
    for s in summarize(rows):
        key = (s["problem"], s["dtype"], s["impl"])
        cells = "".join(f"{ms[key + (n,)]:>12.3f}" if key + (n,) in ms else f"{'-':>12}"
                        for n in sizes)
        eff = f"{s['efficiency']:.2f}" if s["efficiency"] is not None else "-"
        lines.append(f"{s['problem']:<8}{s['dtype']:<10}{s['impl']:<9}{cells}{eff:>12}"
                     f"{s['allreduce_bytes'] / 1e6:>15.1f}"
                     f"{s['ring_bytes_per_gpu_at_8'] / 1e6:>16.1f}")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    n = gpu_count(args, visible)
    if not dist.is_available() or not dist.is_nccl_available():
        raise SystemExit("scaling.py: torch.distributed with NCCL is not available")
    if args.quick:
        args.iters, args.warmup = min(args.iters, 10), min(args.warmup, 3)
    rows = []
    for world in world_sizes(n):
        rows += run_world(world, args)
    print(table(rows))
    if args.out:
        meta = dict(device=torch.cuda.get_device_name(0), gpus=n, torch=torch.__version__,
                    cuda=torch.version.cuda, nccl=".".join(map(str, torch.cuda.nccl.version())),
                    date=str(datetime.date.today()), argv=sys.argv[1:] if argv is None else argv,
                    iters=args.iters, warmup=args.warmup, quick=args.quick)
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows, summary=summarize(rows)), f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
