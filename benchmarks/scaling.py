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
included, runs under DDP over NCCL.  The one-GPU baseline runs on every
GPU at once, as independent processes, and takes the slowest GPU's time:
then it shares the host and the machine's power as the larger runs do, and
one GPU's clock is not mistaken for the cost of communication.

Reported per problem, dtype and implementation: the median step time over
CUDA-event-timed steps (the slowest rank's median), the efficiency
``t(1 GPU) / t(N GPUs)``, and the all-reduce volume per step (the bytes of
the parameters' gradients) with the traffic per GPU of a ring all-reduce
over 8 GPUs, ``2 (n - 1) / n`` of it, for an estimate of larger or
multi-host runs at a link's bandwidth.

The run also times an NCCL all-reduce of a 256 MiB buffer on every GPU
count above one and reports its bus bandwidth (a ring's bytes per GPU over
the time).  With it, each row gets an estimate on paper for 8 GPUs of one
host (the same bus bandwidth) and for 2 hosts of 8 GPUs whose all-reduce is
bounded by a 50 GB/s network link per GPU (an assumed 400 Gb/s NIC each):
the step time of the largest measured count plus the all-reduce time the
larger ring adds, as if none of it hid behind the backward.  A rough
estimate: it counts bandwidth alone (not the latency of a longer ring, nor
the host load of more processes), at the bus bandwidth measured on fewer
GPUs.

Run: ``python benchmarks/scaling.py [--gpus N] [--out scaling.json]``;
``--publish`` also writes ``results/scaling.json`` and the scaling section
of docs/performance.md.
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
from harness import (DTYPES, autocast_dtype, dtype_label, fixed_grad, host_and_gpu_ms,  # noqa: E402
                     l2_bytes, model_dtype, rotation_count, step_fns, time_ms)

IMPLS = ("eager", "compile", "ours")
DEFAULT_DTYPES = ("fp32", "amp-bf16")
ESTIMATE_GPUS = 8
# The paper estimate across hosts: 2 hosts of ESTIMATE_GPUS, one network
# link of this many GB/s per GPU (400 Gb/s), which bounds the ring.
ESTIMATE_HOSTS = 2
NETWORK_GBPS = 50.0
ALLREDUCE_BYTES = 256 << 20
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    parser.add_argument("--publish", action="store_true",
                        help="write results/scaling.json and the scaling section of "
                             "docs/performance.md")
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

def _bench_case(problem, dtype, impl, args, rank, device, replicas=None):
    """(median ms, min ms, host ms, GPU ms, parameter bytes) of this rank's
    DDP step (host: its issue time; GPU: its time queued behind a sleep, as
    in run.py).  ``replicas``: the barrier of the one-GPU runs that go on
    at once (:func:`replica_barrier`), or None."""
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
    g = fixed_grad(base, x0, amp, seed=rank)
    step, _ = step_fns(model, "train", xs, xs, g, amp)

    # Every rank makes the same number of calls (each one all-reduces).
    # The warm-up (where torch.compile compiles) comes before the barriers,
    # so that no process times its steps while another one compiles beside
    # it on the host.
    for _ in range(args["warmup"]):
        step()
    torch.cuda.synchronize()
    dist.barrier()
    if replicas is not None:
        replicas.wait()
    median, low = time_ms(step, args["iters"], 1)
    host, gpu = host_and_gpu_ms(step)
    return median, low, host, gpu, param_bytes


def _allreduce(world, device):
    """The bus bandwidth of an NCCL all-reduce of ALLREDUCE_BYTES on this
    GPU count: ``dict(gpus, bytes, median_ms, busbw_gbps)``."""
    buf = torch.ones(ALLREDUCE_BYTES // 4, device=device)
    median, _ = time_ms(lambda: dist.all_reduce(buf), 20, 5)
    times = torch.tensor([median], device=device, dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    median = times.item()
    return dict(gpus=world, bytes=ALLREDUCE_BYTES, median_ms=median,
                busbw_gbps=ring_bytes_per_gpu(ALLREDUCE_BYTES, world) / median / 1e6)


def _worker(rank, world, args, out_dir, replicas=None):
    """Process ``rank`` of a DDP group of ``world`` on GPU ``rank``; with
    ``world`` 1, one of several independent one-GPU groups running at once,
    one per GPU, kept in step case by case by ``replicas``."""
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    torch.backends.cuda.matmul.allow_tf32 = False  # PyTorch's default for fp32 matmuls
    solo = world == 1
    dist.init_process_group("nccl", init_method=f"file://{args['store']}.{rank if solo else 0}",
                            rank=0 if solo else rank, world_size=world, device_id=device,
                            timeout=datetime.timedelta(minutes=10))
    speaker = rank == 0
    try:
        link = _allreduce(world, device) if world > 1 else None
        if link is not None and speaker:
            print(f"{world} GPUs all-reduce {link['bytes'] >> 20} MiB: {link['median_ms']:.3f} ms, "
                  f"bus bandwidth {link['busbw_gbps']:.0f} GB/s", flush=True)
        rows = []
        for dtype in args["dtypes"]:
            for problem in args["problems"]:
                for impl in args["impls"]:
                    *measured, nbytes = _bench_case(problem, dtype, impl, args, rank, device,
                                                    replicas)
                    torch.cuda.empty_cache()  # the case's models and inputs are gone
                    # The step of the slowest rank sets the pace of them all.
                    times = torch.tensor(measured, device=device, dtype=torch.float64)
                    gpu = times[3:].clone()
                    dist.all_reduce(times, op=dist.ReduceOp.MAX)
                    # The GPU time behind a sleep: the rank whose sleep ends
                    # first waits in the first all-reduce for the other, so
                    # the one that never waits (the least) is the step's own.
                    dist.all_reduce(gpu, op=dist.ReduceOp.MIN)
                    median, low, host = times[:3].tolist()
                    gpu = gpu.item()
                    if impl == "compile":
                        torch._dynamo.reset()
                    rows.append(dict(problem=problem, dtype=dtype_label(dtype), impl=impl,
                                     gpus=world, median_ms=median, min_ms=low, host_ms=host,
                                     gpu_ms=gpu, param_bytes=nbytes))
                    if speaker:
                        print(f"{world} GPU(s) {problem:>3} {dtype:<9}{impl:<8}{median:9.3f} ms "
                              f"(host {host:.3f}, GPU {gpu:.3f})" + (" GPU 0" if solo else ""),
                              flush=True)
        if solo or speaker:
            with open(os.path.join(out_dir, f"rows.{rank}.json"), "w") as f:
                json.dump(dict(rows=rows, allreduce=link), f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def merge_replicas(parts: list) -> list:
    """The rows of independent one-GPU runs on several GPUs as one row per
    case: the slowest GPU's median and min (as the slowest rank of a DDP
    group sets its pace), with every GPU's median in ``per_gpu_ms``."""
    out = []
    for rows in zip(*parts):
        row = dict(rows[0], **{key: max(r[key] for r in rows)
                               for key in ("median_ms", "min_ms", "host_ms", "gpu_ms")})
        row["per_gpu_ms"] = [r["median_ms"] for r in rows]
        out.append(row)
    return out


def replica_barrier(procs: int):
    """A barrier for ``procs`` spawned processes: the one-GPU runs are
    process groups of one, which ``dist.barrier`` cannot keep in step.  Its
    timeout (as the process groups' own) ends a wait on a process that
    died."""
    return mp.get_context("spawn").Barrier(procs, timeout=600)


def run_world(world: int, args: argparse.Namespace, gpus: int) -> dict:
    """``dict(rows, allreduce)`` of one GPU count (``allreduce`` is None for
    one GPU), from ``world`` spawned processes.  The one-GPU baseline runs
    on each of ``gpus`` GPUs at once, independently, so that it shares the
    host and the machine's power as the ``gpus``-GPU run does."""
    procs = gpus if world == 1 else world
    replicas = replica_barrier(procs) if world == 1 else None
    with tempfile.TemporaryDirectory() as tmp:
        spec = dict(vars(args), store=os.path.join(tmp, "store"))
        mp.start_processes(_worker, args=(world, spec, tmp, replicas), nprocs=procs,
                           start_method="spawn")
        if world > 1:
            with open(os.path.join(tmp, "rows.0.json")) as f:
                return json.load(f)
        parts = []
        for rank in range(procs):
            with open(os.path.join(tmp, f"rows.{rank}.json")) as f:
                parts.append(json.load(f)["rows"])
        return dict(rows=merge_replicas(parts), allreduce=None)


# --- results -------------------------------------------------------------

def allreduce_ms(nbytes: int, gpus: int, busbw_gbps: float) -> float:
    """Milliseconds of a ring all-reduce of ``nbytes`` over ``gpus`` GPUs at
    a bus bandwidth of ``busbw_gbps`` GB/s."""
    return ring_bytes_per_gpu(nbytes, gpus) / busbw_gbps / 1e6


def paper_efficiency(one_ms: float, n_ms: float, n: int, nbytes: int, busbw_gbps: float,
                     gpus: int, link_gbps: float = None) -> float:
    """Estimated weak-scaling efficiency on ``gpus`` GPUs from a measured
    step on ``n``: the step grows by the all-reduce time the larger ring
    adds (at ``link_gbps`` where a slower link bounds it, else at the
    measured ``busbw_gbps``), none of it hidden behind the backward."""
    extra = (allreduce_ms(nbytes, gpus, link_gbps or busbw_gbps)
             - allreduce_ms(nbytes, n, busbw_gbps))
    return one_ms / (n_ms + max(0.0, extra))


def summarize(rows: list, allreduce=None) -> list:
    """Per problem, dtype and implementation: the largest GPU count's step
    time against one GPU's (``efficiency``), with the all-reduce volume;
    given the measured all-reduces (``allreduce``: the ``_allreduce``
    dicts), also the paper estimates ``efficiency_at_8`` (one host) and
    ``efficiency_2_hosts`` (ESTIMATE_HOSTS hosts over NETWORK_GBPS links)."""
    links = {a["gpus"]: a for a in allreduce or () if a}
    groups = {}
    for r in rows:
        groups.setdefault((r["problem"], r["dtype"], r["impl"]), {})[r["gpus"]] = r
    out = []
    for (problem, dtype, impl), by_n in groups.items():
        n = max(by_n)
        one = by_n.get(1)
        eff = (one["median_ms"] / by_n[n]["median_ms"]
               if one is not None and n > 1 and by_n[n]["median_ms"] > 0 else None)
        nbytes = by_n[n]["param_bytes"]
        row = dict(problem=problem, dtype=dtype, impl=impl, gpus=n, efficiency=eff,
                   allreduce_bytes=nbytes,
                   ring_bytes_per_gpu_at_8=ring_bytes_per_gpu(nbytes, ESTIMATE_GPUS))
        if eff is not None and n in links:
            bw = links[n]["busbw_gbps"]
            row["allreduce_ms"] = allreduce_ms(nbytes, n, bw)
            row["efficiency_at_8"] = paper_efficiency(one["median_ms"], by_n[n]["median_ms"], n,
                                                      nbytes, bw, ESTIMATE_GPUS)
            row["efficiency_2_hosts"] = paper_efficiency(
                one["median_ms"], by_n[n]["median_ms"], n, nbytes, bw,
                ESTIMATE_GPUS * ESTIMATE_HOSTS, NETWORK_GBPS)
        out.append(row)
    return out


def _gpus(n: int) -> str:
    return f"{n} GPU" + ("s" if n > 1 else "")


def table(rows: list) -> str:
    """Plain-text table: one line per problem, dtype and implementation, a
    step-time column per GPU count ("-" where it is missing)."""
    sizes = sorted({r["gpus"] for r in rows})
    ms = {(r["problem"], r["dtype"], r["impl"], r["gpus"]): r["median_ms"] for r in rows}
    head = f"{'problem':<8}{'dtype':<10}{'impl':<9}"
    head += "".join(f"{_gpus(n) + ' ms':>12}" for n in sizes)
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


def markdown(result: dict) -> str:
    """The scaling section of docs/performance.md from a results dict
    (``meta``, ``rows``, ``allreduce``): per dtype, a table of step times
    per GPU count, the efficiency, ours against eager and torch.compile at
    each count, the all-reduce volume and time, and the paper estimates."""
    meta, rows = result["meta"], result["rows"]
    links = [a for a in result.get("allreduce") or () if a]
    sizes = sorted({r["gpus"] for r in rows})
    n = sizes[-1]
    ms = {(r["problem"], r["dtype"], r["impl"], r["gpus"]): r["median_ms"] for r in rows}
    summary = {(s["problem"], s["dtype"], s["impl"]): s for s in summarize(rows, links)}
    host_gpu = {(r["problem"], r["dtype"], r["impl"]):
                f"{r['host_ms']:.2f} / {r['gpu_ms']:.2f}" + (" (host-bound)"
                                                              if r["host_ms"] > r["gpu_ms"] else "")
                for r in rows if r["gpus"] == n and "host_ms" in r}
    out = [f"## Scaling over GPUs ({meta['device']} x{meta['gpus']}, {meta['date']})", "",
           f"`python benchmarks/scaling.py {' '.join(meta['argv'])}` (torch {meta['torch']}, "
           f"CUDA {meta['cuda']}, NCCL {meta['nccl']}): weak scaling of the DDP training step, "
           "each GPU with the benchmark batch, median of "
           f"{meta['iters']} steps after {meta['warmup']}, the slowest rank's (1 GPU: the "
           f"slowest of {meta['gpus']} independent one-GPU runs at once).  Efficiency is "
           f"the 1-GPU step time over the {_gpus(n)} one.  \"vs eager\" / \"vs compile\" is "
           "their step time over ours at the same count.  Host / GPU: the host's issue time "
           "and the GPU's time per step (as in run.py); a row whose host time is the longer "
           "is host-bound."]
    for a in links:
        out.append(f"An NCCL all-reduce of {a['bytes'] >> 20} MiB on {_gpus(a['gpus'])}: "
                   f"{a['median_ms']:.3f} ms, bus bandwidth {a['busbw_gbps']:.0f} GB/s.")
    out += ["", f"Paper estimates: \"{ESTIMATE_GPUS} GPUs\" adds the time a ring over "
            f"{ESTIMATE_GPUS} GPUs at the measured bus bandwidth takes beyond the measured "
            f"{n}-GPU all-reduce; \"{ESTIMATE_HOSTS}x{ESTIMATE_GPUS}\" a ring over "
            f"{ESTIMATE_HOSTS * ESTIMATE_GPUS} GPUs of {ESTIMATE_HOSTS} hosts bounded by a "
            f"{NETWORK_GBPS:.0f} GB/s network link per GPU (assumed, not measured).  Both count "
            "that time as exposed, none of it hidden behind the backward, and bandwidth "
            "alone (not a longer ring's latency, nor the host load of more processes): "
            "rough estimates."]
    for dtype in dict.fromkeys(r["dtype"] for r in rows):
        out += ["", f"### {dtype}", ""]
        head = ["problem", "impl"] + [f"{_gpus(k)} ms" for k in sizes]
        head += [f"host / GPU ms, {_gpus(n)}", "efficiency"]
        counts = " → ".join(str(k) for k in sizes)
        head += [f"vs eager ({counts} GPUs)", f"vs compile ({counts} GPUs)"]
        head += ["gradients MB", f"all-reduce ms, {_gpus(n)}",
                 f"est. efficiency, {ESTIMATE_GPUS} GPUs",
                 f"est. efficiency, {ESTIMATE_HOSTS}x{ESTIMATE_GPUS}"]
        out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for problem in sorted({r["problem"] for r in rows if r["dtype"] == dtype}):
            for impl in IMPLS:
                s = summary.get((problem, dtype, impl))
                if s is None:
                    continue

                def cell(value, fmt):
                    return "-" if value is None else format(value, fmt)

                def ratio(base, k):
                    a, b = ms.get((problem, dtype, base, k)), ms.get((problem, dtype, impl, k))
                    return "-" if a is None or b is None else f"{a / b:.2f}x"

                cells = [str(problem), impl]
                cells += [cell(ms.get((problem, dtype, impl, k)), ".3f") for k in sizes]
                cells.append(host_gpu.get((problem, dtype, impl), "-"))
                cells.append(cell(s["efficiency"], ".2f"))
                cells += [" → ".join(ratio(base, k) for k in sizes) for base in ("eager", "compile")]
                cells += [f"{s['allreduce_bytes'] / 1e6:.1f}", cell(s.get("allreduce_ms"), ".3f"),
                          cell(s.get("efficiency_at_8"), ".2f"),
                          cell(s.get("efficiency_2_hosts"), ".2f")]
                out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def publish(result: dict, root: str = REPO) -> None:
    """Writes ``result`` to ``<root>/results/scaling.json`` and its
    :func:`markdown` between the ``scaling`` markers of
    ``<root>/docs/performance.md``."""
    from publish import _write, replace_between

    doc = os.path.join(root, "docs", "performance.md")
    with open(doc) as f:
        text = replace_between(f.read(), "scaling", lambda _old: markdown(result))
    _write(os.path.join(root, "results", "scaling.json"), json.dumps(result, indent=1) + "\n")
    _write(doc, text)


def main(argv=None):
    args = parse_args(argv)
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    n = gpu_count(args, visible)
    if not dist.is_available() or not dist.is_nccl_available():
        raise SystemExit("scaling.py: torch.distributed with NCCL is not available")
    if args.quick:
        args.iters, args.warmup = min(args.iters, 10), min(args.warmup, 3)
    meta = dict(device=torch.cuda.get_device_name(0), gpus=n, torch=torch.__version__,
                cuda=torch.version.cuda, nccl=".".join(map(str, torch.cuda.nccl.version())),
                date=str(datetime.date.today()), argv=sys.argv[1:] if argv is None else argv,
                iters=args.iters, warmup=args.warmup, quick=args.quick)
    result = dict(meta=meta, rows=[], allreduce=[])
    for world in world_sizes(n):
        part = run_world(world, args, n)
        result["rows"] += part["rows"]
        result["allreduce"].append(part["allreduce"])
        result["summary"] = summarize(result["rows"], result["allreduce"])
        if args.out:  # after every GPU count, so that a later failure keeps the earlier ones
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    print(table(result["rows"]))
    print(markdown(result))
    if args.out:
        print(f"wrote {args.out}")
    if args.publish:
        publish(result)
        print("wrote results/scaling.json and the scaling section of docs/performance.md")


if __name__ == "__main__":
    main()
