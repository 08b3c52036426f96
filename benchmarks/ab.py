"""The kernels of this tree against those of another copy of ``kernels_cu/``
(a git revision or a folder), timed in turns in one process, with their
outputs compared bit for bit.

    python benchmarks/ab.py --against HEAD~1                       # every case, bf16
    python benchmarks/ab.py --against HEAD~1 --cases gemm-37 model-37 --dtypes bf16 fp16
    python benchmarks/ab.py --against /tmp/kernels_cu --cases model-1 --modes train
    python benchmarks/ab.py --against HEAD~1 --sustained 2         # also held at the power cap
    python benchmarks/ab.py --against HEAD~1 --cases kernel-gn_swish_mul_swish_88 --control

Each case runs twice per round: once with every kernel compiled from the
other copy ("against"), once with this tree's ("tree").  Everything else,
the Python side included, is this tree's, so the two copies must launch
their kernels alike (the same arguments, threads and shared memory): a
kernel change, not a change of its launch.  While a case runs against the
other copy, every ``KernelFamily`` of the library looks its kernels up in
a cache of their own, compiled from that copy (``kernels_from``).

Times: CUDA events around each call, medians of ``--rounds`` rounds of
``--iters`` calls in turns (``harness.time_interleaved``), so that the
GPU's clock and temperature drift hit both alike.  ``--sustained S``
also runs each case back to back for S seconds and keeps the median of
the last half's batches: the H200 then runs at its power cap, where a
kernel's clock depends on the power it draws.

Cases: ``gemm-37`` and ``gemm-76`` are the 16-bit engine's plain product
at problems 37's and 76's shapes; ``model-P`` is problem P's fused module
(forward and / or training step, as ``benchmarks/run.py`` times them;
``model-1-cl`` on a channels-last input); ``kernel-NAME`` is a
memory-bound op of ``benchmarks/kernels.py`` (forward and / or backward,
as it times them: inputs rotated past the L2, the calls queued behind a
sleep kernel, so that each time is the GPU's).  Dtypes as ``run.py``'s
(the plain products take fp16 and bf16 only).

``--control`` also times a second copy of the other kernels, compiled
apart, as a third side: its ratio to the first says how far two runs of
the same kernels differ in the same process.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from typing import Callable, Dict, List, NamedTuple, Optional

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kernels as bench_kernels  # noqa: E402
from harness import (DTYPES, autocast_dtype, dtype_label, fixed_grad, l2_bytes,  # noqa: E402
                     model_dtype, step_fns, time_interleaved, write_run)


def against_define(folder: str) -> str:
    """The define that keeps a folder's kernels apart from the tree's (and
    from another folder's) in the runtime's in-memory cache, which is keyed
    by source, expression, device and defines; the disk cache tells them
    apart by the sources' hash."""
    return f"CUPY_FUSED_AB_AGAINST={zlib.crc32(os.path.abspath(folder).encode())}"


def kernel_copy(against: str, into: str) -> str:
    """The folder of the kernel sources to compare with: ``against`` itself
    when it is a folder holding ``.cu`` files, else the ``kernels_cu/`` of
    git revision ``against`` of this repository, extracted under ``into``.

    Args:
        against: a folder, or a git revision (``HEAD~1``, a commit).
        into: an empty folder for the extracted copy.

    Returns:
        The folder's path.
    """
    if os.path.isdir(against):
        if not any(name.endswith(".cu") for name in os.listdir(against)):
            raise SystemExit(f"--against {against!r}: a folder without .cu files")
        return os.path.abspath(against)
    archive = subprocess.run(["git", "-C", REPO, "archive", against, "kernels_cu"],
                             capture_output=True)
    if archive.returncode != 0:
        raise SystemExit(f"--against {against!r}: neither a folder nor a git revision with "
                         f"kernels_cu/ ({archive.stderr.decode().strip()})")
    os.makedirs(into, exist_ok=True)
    subprocess.run(["tar", "-x", "-C", into], input=archive.stdout, check=True)
    return os.path.join(into, "kernels_cu")


def parameter_differences(folder: str, tree: Optional[str] = None) -> List[str]:
    """The ``__global__`` kernels whose parameters differ between the
    sources in ``folder`` and the tree's (or ``tree``), or that only one
    declares: the launches, which are the tree's, would pass such a
    kernel of the other copy the wrong arguments.

    Returns:
        Their names, sorted.
    """
    from cupy_fused import _bridge, _runtime

    def declared(where: str) -> Dict[str, str]:
        # (each parameter's type, as _bridge reads it: names and qualifiers dropped)
        return {name: " ".join(" ".join(w for w in p.split()[:-1] if w not in _bridge._QUALIFIERS)
                               for p in params.split(",") if p.strip())
                for name, params in _bridge.declarations_in(where).items()}

    theirs, ours = declared(folder), declared(tree or str(_runtime.kernel_dir()))
    return sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))


@contextlib.contextmanager
def kernels_from(folder: Optional[str]):
    """Inside, every kernel the library looks up comes from the sources in
    ``folder``: each ``KernelFamily`` answers from a cache of its own for
    that folder, compiled there on first use (a family made inside, such as
    a lazily built one, too).  Outside, the families' caches are theirs
    again, untouched.  ``folder`` None: the tree's own kernels, through the
    same detour (so that both sides of a comparison pay the same host
    time for it).

    ``gn_chain`` keeps launch plans (its kernel among them) per shape: each
    side gets plans of its own, so that neither launches the other's
    kernels from a plan made on the other side."""
    from cupy_fused import _runtime
    gn_chain = importlib.import_module("cupy_fused.ops.gn_chain")  # (the module)

    real = _runtime.KernelFamily.get
    caches = _AGAINST_CACHES.setdefault(folder, {})
    plans = _PLANS.setdefault(folder, ({}, {}))

    def get(family, key, device):
        if folder is None:
            return real(family, key, device)
        cache = caches.setdefault(family, {})
        try:
            return cache[key, device]
        except KeyError:
            kernel = cache[key, device] = _compile_from(folder, family.source,
                                                        family.expressions[key], device)
            return kernel

    saved_plans = gn_chain._forward_plans, gn_chain._backward_plans
    _runtime.KernelFamily.get = get
    gn_chain._forward_plans, gn_chain._backward_plans = plans
    try:
        yield
    finally:
        _runtime.KernelFamily.get = real
        gn_chain._forward_plans, gn_chain._backward_plans = saved_plans


_AGAINST_CACHES: Dict[Optional[str], Dict[object, dict]] = {}
_PLANS: Dict[Optional[str], tuple] = {}
_COMPILE_LOCK = threading.Lock()  # (the kernel folder is process-wide while one compiles)


def _compile_from(folder: str, source: str, expression: str, device: int):
    from cupy_fused import _runtime

    with _COMPILE_LOCK:
        saved = os.environ.get("CUPY_FUSED_KERNEL_DIR")
        os.environ["CUPY_FUSED_KERNEL_DIR"] = folder  # (read by the compile: -I, sources hash)
        try:
            return _runtime.get_function(source, expression, device, (against_define(folder),))
        finally:
            if saved is None:
                del os.environ["CUPY_FUSED_KERNEL_DIR"]
            else:
                os.environ["CUPY_FUSED_KERNEL_DIR"] = saved


def same_bits(a, b) -> bool:
    """Whether two results (tensors, or nested tuples / lists of them, or
    None) are equal bit for bit, NaN payloads included."""
    if isinstance(a, (tuple, list)) or isinstance(b, (tuple, list)):
        return (isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)) and len(a) == len(b)
                and all(same_bits(x, y) for x, y in zip(a, b)))
    if a is None or b is None:
        return a is None and b is None
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.detach().contiguous().view(bits), b.detach().contiguous().view(bits))


class Case(NamedTuple):
    """One thing to time, in the dtypes and modes it takes: ``make(dtype,
    mode)`` builds its inputs and returns (run, result): run() launches it,
    result() gives what the last run computed (the output, and in training
    the gradients of the input and of every parameter) or computes it
    again on fixed inputs (it runs with the same side's kernels as run()).
    ``queued``: timed with the calls queued (``time_interleaved``)."""

    dtypes: tuple
    modes: tuple
    make: Callable
    queued: bool = False


def _plain_product(m: int, k: int, n: int):
    def make(dtype: str, mode: str):
        gemm = importlib.import_module("cupy_fused.ops.gemm")  # (the module: ops.gemm is the op)
        dt = model_dtype(dtype)
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.rand(m, k, device="cuda", generator=gen).to(dt)
        w = ((torch.rand(n, k, device="cuda", generator=gen) * 2 - 1) / k ** 0.5).to(dt)
        out = {}

        def run():
            out["y"] = gemm._half_linear(x, w)
        return run, lambda: out["y"]
    return make


def _model(problem: int, channels_last: bool = False):
    def make(dtype: str, mode: str):
        from cupy_fused import reference
        from cupy_fused.testing import build_pair
        _, args, shape = reference.PROBLEMS[problem]
        _, ours = build_pair(problem, args, "cuda", model_dtype(dtype))
        amp = autocast_dtype(dtype)
        gen = torch.Generator(device="cuda").manual_seed(1)
        x = torch.rand(shape, device="cuda", generator=gen, dtype=model_dtype(dtype))
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        xt = x.clone().requires_grad_(True)
        params = list(ours.parameters())
        grad = fixed_grad(ours, x, amp) if mode == "train" else None
        out = {}
        # the step benchmarks/run.py times, keeping what it computed
        run, _ = step_fns(ours, mode, [x], [xt], grad, amp, keep=out)

        def result():
            if mode == "forward":
                return out["y"]
            return (out["y"], xt.grad) + tuple(p.grad for p in params)
        return run, result
    return make


def _kernel(name: str):
    """``benchmarks/kernels.py``'s op ``name`` (a key of its CASES): its
    forward (grad off) or its backward (kernel and column reduce) on inputs
    rotated past the L2, as kernels.py times them; the result is that of
    the first input (output, or z's and every vector's gradients)."""
    def make(dtype: str, mode: str):
        case = bench_kernels.CASES[name]
        z, vectors, randn = bench_kernels.case_inputs(case, dtype)
        with torch.no_grad():
            y_dtype = bench_kernels._call(case, z, vectors).dtype
        _, copies = bench_kernels.traffic(case, mode, z.dtype, y_dtype, l2_bytes())
        if mode == "forward":
            run = bench_kernels._forward_fn(case, z, vectors, copies, randn)

            def result():
                with torch.no_grad():
                    return bench_kernels._call(case, z, vectors)
            return run, result
        params = [v.detach().requires_grad_(True) for v in vectors.values()]
        zg = z.detach().requires_grad_(True)
        y = bench_kernels._call(case, zg, dict(zip(vectors, params)))
        g = randn(y.shape, y.dtype)
        run = bench_kernels._backward_fn(case, z, vectors, copies, randn)
        return run, lambda: torch.autograd.grad(y, [zg, *params], g, retain_graph=True)
    return make


HALF = ("fp16", "bf16")
ALL = tuple(DTYPES)
CASES: Dict[str, Case] = {
    "gemm-37": Case(HALF, ("forward",), _plain_product(32768, 1024, 4096)),
    "gemm-76": Case(HALF, ("forward",), _plain_product(1024, 8192, 8192)),
    "model-37": Case(ALL, ("forward", "train"), _model(37)),
    "model-76": Case(ALL, ("forward", "train"), _model(76)),
    "model-88": Case(ALL, ("forward", "train"), _model(88)),
    "model-94": Case(ALL, ("forward", "train"), _model(94)),
    "model-1": Case(ALL, ("forward", "train"), _model(1)),
    "model-1-cl": Case(ALL, ("forward", "train"), _model(1, channels_last=True)),
    **{f"kernel-{name}": Case(ALL, ("forward", "backward"), _kernel(name), queued=True)
       for name in bench_kernels.CASES},
}


MODES = ("forward", "train", "backward")


def jobs(cases: List[str], dtypes: List[str], modes: List[str]) -> List[tuple]:
    """(case, dtype, mode) of every asked combination a case takes."""
    return [(c, d, m) for c in cases for d in dtypes for m in modes
            if d in CASES[c].dtypes and m in CASES[c].modes]


def sustained_ms(fn, seconds: float, batch: int = 40) -> float:
    """Milliseconds per call of ``fn`` run back to back for ``seconds``:
    the median over the last half of batches of ``batch`` calls."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    per_call = []
    end = time.time() + seconds
    while time.time() < end or len(per_call) < 4:
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(batch):
            fn()
        stop.record()
        stop.synchronize()
        per_call.append(start.elapsed_time(stop) / batch)
    return statistics.median(per_call[len(per_call) // 2:])


def run_jobs(todo: List[tuple], folder: str, iters: int, rounds: int,
             sustained: float = 0.0, control: Optional[str] = None) -> List[dict]:
    """Times each job against the other copy and with the tree's kernels.

    Args:
        todo: (case, dtype, mode) triples (:func:`jobs`).
        folder: the other copy's kernel sources (:func:`kernel_copy`).
        iters, rounds: calls of each, and rounds they are split into.
        sustained: seconds of back-to-back calls of each (0: none).
        control: a second copy of ``folder``'s sources, timed as a third
            side (None: none).

    Returns:
        One row per job: its times (ms), tree / against, and whether both
        computed the same bits; with ``control``, its time and control /
        against.
    """
    folders = {"against": folder, "tree": None}
    if control is not None:
        folders["control"] = control
    fns, results, queued = {}, {}, set()
    for case, dtype, mode in todo:
        run, result = CASES[case].make(dtype, mode)
        for side, where in folders.items():
            def call(run=run, where=where):
                with kernels_from(where):
                    return run()
            key = (case, dtype, mode, side)
            fns[key] = call
            call()
            with kernels_from(where):
                results[key] = result()
            if CASES[case].queued:
                queued.add(key)
    times = {}
    for is_queued in (False, True):  # each kind of timing in one run of turns
        group = {" ".join(k): f for k, f in fns.items() if (k in queued) == is_queued}
        if group:
            times.update(time_interleaved(group, iters, warmup=3, rounds=rounds,
                                          queued=is_queued))
    rows = []
    for case, dtype, mode in todo:
        key = (case, dtype, mode)
        t_against, t_tree = times[" ".join(key + ("against",))][0], times[" ".join(key + ("tree",))][0]
        row = dict(case=case, dtype=dtype_label(dtype), mode=mode, against_ms=t_against,
                   tree_ms=t_tree, ratio=t_tree / t_against,
                   same_bits=same_bits(results[key + ("against",)], results[key + ("tree",)]))
        if control is not None:
            row["control_ms"] = t_control = times[" ".join(key + ("control",))][0]
            row["control_ratio"] = t_control / t_against
        if sustained > 0:
            row["against_sustained_ms"] = sustained_ms(fns[key + ("against",)], sustained)
            row["tree_sustained_ms"] = sustained_ms(fns[key + ("tree",)], sustained)
        rows.append(row)
    return rows


def markdown(rows: List[dict], against: str) -> str:
    """The rows as a Markdown table (times in ms; ratio: tree / against)."""
    held = any("tree_sustained_ms" in r for r in rows)
    control = any("control_ratio" in r for r in rows)
    head = ["case", "dtype", "mode", f"against ({against}) ms", "tree ms", "tree / against",
            "same bits"] + (["control / against"] if control else []) + (
                ["held: against / tree ms"] if held else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["case"], r["dtype"], r["mode"], f"{r['against_ms']:.4f}", f"{r['tree_ms']:.4f}",
                 f"{r['ratio']:.3f}", "yes" if r["same_bits"] else "NO"]
        if control:
            cells.append(f"{r['control_ratio']:.3f}" if "control_ratio" in r else "-")
        if held:
            cells.append(f"{r['against_sustained_ms']:.4f} / {r['tree_sustained_ms']:.4f}"
                         if "tree_sustained_ms" in r else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", required=True, metavar="REV_OR_DIR",
                        help="a git revision of this repository, or a folder of kernel sources")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--dtypes", nargs="+", default=["bf16"], choices=list(DTYPES))
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES),
                        help="forward and train for the products and models, forward and "
                             "backward for the kernels")
    parser.add_argument("--iters", type=int, default=140, help="calls of each, over all rounds")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--sustained", type=float, default=0.0, metavar="SECONDS",
                        help="also time each back to back for this long (power cap)")
    parser.add_argument("--control", action="store_true",
                        help="also time a second copy of the other kernels, compiled apart")
    parser.add_argument("--json", metavar="PATH", default=None, help="write the rows as JSON")
    args = parser.parse_args(argv)
    if not jobs(args.cases, args.dtypes, args.modes):
        parser.error("no case takes these dtypes and modes")
    return args


def main(argv=None):
    args = parse_args(argv)
    import cupy_fused  # noqa: F401  (after --help: the kernels need a GPU)

    todo = jobs(args.cases, args.dtypes, args.modes)
    with tempfile.TemporaryDirectory() as tmp:
        folder = kernel_copy(args.against, tmp)
        changed = parameter_differences(folder)
        if changed:
            print(f"warning: parameters differ from {args.against}'s (launching them from there "
                  f"would pass wrong arguments): {', '.join(changed)}", file=sys.stderr)
        control = None
        if args.control:  # the same sources in a folder of their own: compiled apart
            control = shutil.copytree(folder, os.path.join(tmp, "control", "kernels_cu"))
        rows = run_jobs(todo, folder, args.iters, args.rounds, args.sustained, control)
    print(markdown(rows, args.against), flush=True)
    if args.json:
        meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                    date=str(datetime.date.today()), against=args.against,
                    argv=sys.argv[1:] if argv is None else list(argv))
        write_run(args.json, None, meta, rows)


if __name__ == "__main__":
    main()
