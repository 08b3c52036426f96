"""Bandwidth of our memory-bound kernels alone, at the benchmark shapes:
``ops.bias_relu`` (problems 76 and 1) and ``ops.gn_chain`` (the chains of
37, 88 and 94), forward and backward, against copies timed in the same
run.

    python benchmarks/kernels.py                          # every kernel, dtype, direction
    python benchmarks/kernels.py --kernels gn --dtypes bf16 amp-bf16 --quick
    python benchmarks/kernels.py --json k.json --md k.md

Each kernel's rate is the minimum traffic it must move
(:func:`moved_bytes`) over its median time, set against two copies, each
as (bytes read + bytes written) / median time of ``dst.copy_(src)`` on
float32:

* the copy ceiling: 1 GiB copied, once per run;
* a copy of the same bytes: read + write as many bytes as the kernel moves
  (:func:`same_size_copy_gbps`), timed as the kernel is timed (same calls,
  sources rotated by the same rule), once per size in a run.

Two yardsticks, because at the sizes of problems 76, 88 and 94 a copy's
own rate depends on its size: each call pays a fixed cost (launch, ramp-up
to full bandwidth, drain) that a larger copy spreads over more bytes.  The
1 GiB copy says how far a kernel is from the memory's rate; the same-size
copy how far it is from what one call of its size can reach.  A row below
80% of the same-size copy is flagged.

Directions: ``forward`` is the op with grad off (nothing saved for the
backward).  ``backward`` is ``torch.autograd.grad(y, [z, *vectors], g,
retain_graph=True)`` on a graph recorded once: our backward kernel and the
small column reduce of the vectors' gradients, nothing else.

Dtypes: fp32, fp16, bf16 (z, the vectors and y in one dtype), and the
autocast combinations amp-bf16 / amp-fp16: z in bfloat16 / float16, the
vectors in float32, as autocast hands the op over (the GroupNorm and the
output then in float32).  Where the op refuses mixed dtypes (TypeError),
the row says so and the run goes on.

Times: CUDA events around each call, median over ``--iters`` calls after
``--warmup``, the calls queued behind a sleep kernel so that the events
time the GPU's work, not the host's issue of it (``harness.time_queued``).
Where a kernel's input is smaller than the L2 cache, calls rotate over
copies of it (together at least twice the L2), so that no call finds its
input in L2 from the one before; the same-size copy rotates its sources so.

``--baseline`` names an earlier run's JSON on the same GPU model: the
rows slower than that run's same row by more than the machine's
run-to-run spread are listed at the end (each time over its own run's
copy of the same bytes), so that a kernel change that slows a dtype or a
direction it was not timed in shows.

    git show d306678:results/NVIDIA_H200-2026-12-02-kernels-gate.json > /tmp/gate.json
    python benchmarks/kernels.py --baseline /tmp/gate.json
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import os
import sys
from typing import NamedTuple, Optional, Tuple

import torch

# The library of this tree, and benchmarks/ itself when loaded by path (the tests).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import DTYPES, l2_bytes, rotation_count, time_queued, write_run  # noqa: E402

# Rows below this fraction of a copy of the same bytes are flagged.
LOW_FRACTION = 0.8

# The same-size copy's source sizes: a multiple of this many bytes.
COPY_GRAIN = 16

# Rows whose time against the copy of their bytes grew by more than this
# factor over a baseline run's are listed (--baseline): past the ~5% that
# two runs of the same kernels differ by on one machine.
SLOWER_THAN_BASELINE = 1.05


class Case(NamedTuple):
    """One kernel at one problem's shape.

    Attributes:
        op: "bias_relu" or "gn_chain".
        problem: the problem whose epilogue it is.
        shape: z's shape.
        vectors: the per-channel vectors, by keyword (bias_relu: "bias",
            "bias2"; gn_chain: its keywords), each with its shape.
        chain: the GroupNorm chain (gn_chain only).
        groups: GroupNorm groups (gn_chain only).
        channels_last: z (and y, dy) 4-D in channels-last memory format.
    """

    op: str
    problem: int
    shape: Tuple[int, ...]
    vectors: Tuple[Tuple[str, Tuple[int, ...]], ...]
    chain: Optional[str] = None
    groups: int = 0
    channels_last: bool = False


def _vectors(names, channels: int) -> tuple:
    return tuple((n, (channels,)) for n in names)


# Name -> case (the names --kernels filters on).
CASES = {
    "bias_relu_76": Case("bias_relu", 76, (1024, 8192), _vectors(["bias"], 8192)),
    # Problem 1: the conv's own bias (C,) and the model's (C, 1, 1), NCHW.
    "bias_relu_1": Case("bias_relu", 1, (128, 128, 126, 126),
                        (("bias", (128,)), ("bias2", (128, 1, 1)))),
    # The same on a channels-last z, as a channels-last input's convolution
    # gives it (the training step's backward: the rows kernel).
    "bias_relu_1_cl": Case("bias_relu", 1, (128, 128, 126, 126),
                           (("bias", (128,)), ("bias2", (128, 1, 1))), channels_last=True),
    "swish_bias_gn_37": Case("gn_chain", 37, (32768, 4096), _vectors(
        ["lin_bias", "extra_bias", "gn_weight", "gn_bias"], 4096), "swish_bias_gn", 64),
    "gn_swish_mul_swish_88": Case("gn_chain", 88, (1024, 8192), _vectors(
        ["lin_bias", "gn_weight", "gn_bias", "mul_weight"], 8192), "gn_swish_mul_swish", 256),
    "bias_hardtanh_mish_gn_94": Case("gn_chain", 94, (1024, 8192), _vectors(
        ["lin_bias", "extra_bias", "gn_weight", "gn_bias"], 8192), "bias_hardtanh_mish_gn", 256),
}

DIRECTIONS = ("forward", "backward")


def mask_bytes(numel: int) -> int:
    """bias_relu's saved mask: one bit per element."""
    return -(-numel // 8)


def moved_bytes(op: str, direction: str, numel: int, z_dtype: torch.dtype,
                y_dtype: torch.dtype, *, row_groups: int = 0, saves: bool = False) -> int:
    """The least traffic of one call of a kernel, in bytes.

    Forward: read z, write y, and, when it ``saves`` for a backward,
    bias_relu's mask (1 bit per element) or gn_chain's statistics (a
    float32 mean and 1/std per (row, group): 8 bytes each).  Backward: read
    what the forward saved (bias_relu: the mask; gn_chain: z and the
    statistics), read dy (y's
    dtype), write dz (z's dtype).  The per-channel vectors and their
    gradients are a few KiB: left out.

    Args:
        op: "bias_relu" or "gn_chain".
        direction: "forward" or "backward".
        numel: elements of z (and of y).
        z_dtype, y_dtype: dtypes of z (and dz) and of y (and dy).
        row_groups: rows x groups of the GroupNorm (gn_chain).
        saves: the forward saves for the backward (grad on).

    Returns:
        Bytes.
    """
    if op not in ("bias_relu", "gn_chain"):
        raise ValueError(f"op must be bias_relu or gn_chain, got {op!r}")
    z_size, y_size = z_dtype.itemsize, y_dtype.itemsize
    if direction == "forward":
        saved = 0
        if saves:
            saved = mask_bytes(numel) if op == "bias_relu" else 8 * row_groups
        return numel * (z_size + y_size) + saved
    if direction == "backward":
        # (the GroupNorm's: z and the forward's float32 mean and 1/std)
        saved = mask_bytes(numel) if op == "bias_relu" else numel * z_size + 8 * row_groups
        return saved + numel * y_size + numel * z_size
    raise ValueError(f"direction must be forward or backward, got {direction!r}")


def _call(case: Case, z: torch.Tensor, vectors: dict) -> torch.Tensor:
    from cupy_fused import ops

    if case.op == "bias_relu":  # a half z with float32 vectors promotes
        return ops.bias_relu(z, vectors["bias"], vectors.get("bias2"))
    if any(v.dtype != z.dtype for v in vectors.values()):
        # The GroupNorm takes float32 vectors with a half z under autocast only.
        with torch.autocast("cuda", dtype=z.dtype):
            return ops.gn_chain(z, case.chain, case.groups, **vectors)
    return ops.gn_chain(z, case.chain, case.groups, **vectors)


def copy_ceiling_gbps(iters: int, warmup: int) -> float:
    """Device copy bandwidth in GB/s (read + write) of ``dst.copy_(src)``
    on 1 GiB of float32, from the median time: the copy of
    :func:`same_size_copy_gbps` at that size (one source, past the L2)."""
    return same_size_copy_gbps(2 * 2**30, iters, warmup, l2_bytes())[1]


def copy_read_bytes(moved: int) -> int:
    """Bytes the same-size copy reads (and writes) for a kernel that moves
    ``moved`` bytes: half of them, rounded to the nearest multiple of
    :data:`COPY_GRAIN` (halves up), at least one grain.  Its read + write
    traffic then differs from ``moved`` by less than one grain.

    Args:
        moved: the kernel's traffic in bytes (:func:`moved_bytes`).

    Returns:
        Bytes of the copy's float32 source.
    """
    return max(COPY_GRAIN, (moved + COPY_GRAIN) // (2 * COPY_GRAIN) * COPY_GRAIN)


def is_low(row: dict) -> bool:
    """Whether a row is below :data:`LOW_FRACTION` of the copy of its bytes.

    Args:
        row: a timed row of :func:`bench_case` (``same_size_fraction``).

    Returns:
        True to flag it.
    """
    return row["same_size_fraction"] < LOW_FRACTION


# (source bytes, iters, warmup, l2, device) -> (median ms, GB/s): rows of one
# size share one copy's timing within a run.
_same_size_copies: dict = {}


def same_size_copy_gbps(moved: int, iters: int, warmup: int, l2: int,
                        device: str = "cuda") -> Tuple[float, float]:
    """Median time and rate of a copy that moves as many bytes as a kernel,
    timed as :func:`bench_case` times the kernel.

    ``dst.copy_(src)`` of float32 buffers of :func:`copy_read_bytes`
    bytes, ``harness.time_queued`` with the same ``iters`` and ``warmup``.
    Where the source is smaller than the L2 cache, calls rotate over
    ``harness.rotation_count(source bytes, l2)`` sources (the kernels' rule
    on their inputs), so that none is in L2 from the call before; they
    write one destination, as each kernel call writes the output block the
    caching allocator hands back from the call before.  The result is kept
    per size: a later call for the same bytes returns it untimed.

    Args:
        moved: the kernel's traffic in bytes (:func:`moved_bytes`).
        iters, warmup: of ``harness.time_queued``.
        l2: the L2 cache's bytes.
        device: where the buffers live.

    Returns:
        (median ms, GB/s as (bytes read + bytes written) / median time).
    """
    read = copy_read_bytes(moved)
    key = (read, iters, warmup, l2, device)
    if key not in _same_size_copies:
        numel = read // 4
        srcs = [torch.empty(numel, device=device, dtype=torch.float32)
                for _ in range(rotation_count(read, l2))]
        dst = torch.empty(numel, device=device, dtype=torch.float32)
        rotation = itertools.cycle(srcs)
        med, _ = time_queued(lambda: dst.copy_(next(rotation)), iters, warmup)
        _same_size_copies[key] = (med, 2 * read / med / 1e6)
        del srcs, dst, rotation  # (the cycle holds the sources too)
        torch.cuda.empty_cache()
    return _same_size_copies[key]


def _forward_fn(case: Case, z: torch.Tensor, vectors: dict, copies: int, randn):
    """The op with grad off, rotating over ``copies`` inputs (z and new
    ones from ``randn``)."""
    rotation = itertools.cycle([z] + [randn(z.shape, z.dtype) for _ in range(copies - 1)])

    def fn():
        with torch.no_grad():
            _call(case, next(rotation), vectors)

    return fn


def _backward_fn(case: Case, z: torch.Tensor, vectors: dict, copies: int, randn):
    """The backward of the op (its kernel and the vectors' column reduce)
    on ``copies`` graphs recorded once, in turns: each with its own z
    (requiring grad, with the vectors) and output gradient from ``randn``."""
    params = [v.detach().requires_grad_(True) for v in vectors.values()]
    graphs = []
    for i in range(copies):
        zc = (z if i == 0 else randn(z.shape, z.dtype)).detach().requires_grad_(True)
        y = _call(case, zc, dict(zip(vectors, params)))
        graphs.append((y, [zc, *params], randn(y.shape, y.dtype)))
    rotation = itertools.cycle(graphs)

    def fn():
        y, inputs, g = next(rotation)
        torch.autograd.grad(y, inputs, g, retain_graph=True)

    return fn


def case_inputs(case: Case, dtype: str):
    """z and the per-channel vectors of ``case`` in ``dtype`` (a key of
    ``harness.DTYPES``: z in its compute dtype, the vectors in its model
    dtype), random from a fixed seed, and the ``randn(shape, dtype)`` that
    made them, for further tensors of z's layout (y, dy, more inputs)."""
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(shape, dt):  # z, y and dy in the case's layout; the vectors as they are
        t = torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32).to(dt)
        if case.channels_last and len(shape) == 4:
            return t.contiguous(memory_format=torch.channels_last)
        return t

    z = randn(case.shape, DTYPES[dtype].compute)
    vectors = {k: randn(shape, DTYPES[dtype].model) for k, shape in case.vectors}
    return z, vectors, randn


def traffic(case: Case, direction: str, z_dtype: torch.dtype, y_dtype: torch.dtype,
            l2: int) -> Tuple[int, int]:
    """(bytes one call moves, :func:`moved_bytes`; copies of its inputs to
    rotate over, so that each call reads them from memory, not from an L2
    of ``l2`` bytes)."""
    numel = math.prod(case.shape)
    moved = moved_bytes(case.op, direction, numel, z_dtype, y_dtype,
                        row_groups=case.shape[0] * case.groups)
    read = moved - numel * (y_dtype if direction == "forward" else z_dtype).itemsize
    return moved, rotation_count(read, l2)


def bench_case(name: str, case: Case, dtype: str, directions, iters: int, warmup: int,
               ceiling: float) -> list:
    """Times one kernel in one dtype.

    Args:
        name: the case's name (a key of :data:`CASES`).
        case: the case.
        dtype: a key of ``harness.DTYPES``: z in its compute dtype (the
            autocast dtype in the autocast modes), the vectors in its model
            dtype (float32 parameters under autocast).
        directions: "forward" and/or "backward".
        iters, warmup: of ``harness.time_queued``.
        ceiling: the copy ceiling (1 GiB) in GB/s.

    Returns:
        One row (a dict) per direction: the kernel's times and rate, its
        fraction of the ceiling (``ceiling_fraction``), the same-size
        copy's time and rate (``copy_same_ms``, ``copy_same_gbps``,
        :func:`same_size_copy_gbps`), the kernel's fraction of that
        (``same_size_fraction``) and ``low`` (:func:`is_low`).  A dtype
        the op refuses (TypeError) or a call that fails gets rows with
        ``status`` "unsupported" / "error" and the message, and no times.
    """
    z_dtype, v_dtype = DTYPES[dtype].compute, DTYPES[dtype].model
    base = dict(kernel=name, op=case.op, problem=case.problem, chain=case.chain,
                shape=list(case.shape), channels_last=case.channels_last,
                dtype=dtype, z_dtype=str(z_dtype).replace("torch.", ""),
                vector_dtype=str(v_dtype).replace("torch.", ""))
    z, vectors, randn = case_inputs(case, dtype)
    try:
        with torch.no_grad():
            y_dtype = _call(case, z, vectors).dtype
    except TypeError as exc:  # mixed dtypes not (yet) taken
        print(f"  {name} {dtype}: unsupported: {exc}", flush=True)
        return [dict(base, direction=d, status="unsupported", message=str(exc)) for d in directions]
    except Exception as exc:  # noqa: BLE001 -- one case, not the run
        print(f"  {name} {dtype}: failed: {exc!r}", flush=True)
        return [dict(base, direction=d, status="error", message=repr(exc)) for d in directions]
    base["y_dtype"] = str(y_dtype).replace("torch.", "")
    l2 = l2_bytes()
    rows = []
    for direction in directions:
        moved, copies = traffic(case, direction, z_dtype, y_dtype, l2)
        try:
            make = _forward_fn if direction == "forward" else _backward_fn
            med, best = time_queued(make(case, z, vectors, copies, randn), iters, warmup)
            copy_ms, copy_gbps = same_size_copy_gbps(moved, iters, warmup, l2)
        except Exception as exc:  # noqa: BLE001
            print(f"  {name} {dtype} {direction}: failed: {exc!r}", flush=True)
            rows.append(dict(base, direction=direction, status="error", message=repr(exc)))
            continue
        gbps = moved / med / 1e6
        row = dict(base, direction=direction, status="ok", median_ms=med, min_ms=best,
                   bytes=moved, gbps=gbps, ceiling_fraction=gbps / ceiling,
                   copy_same_ms=copy_ms, copy_same_gbps=copy_gbps,
                   same_size_fraction=gbps / copy_gbps, input_copies=copies)
        rows.append(dict(row, low=is_low(row)))
    del z, vectors
    torch.cuda.empty_cache()
    return rows


def row_key(row: dict) -> tuple:
    """What identifies a row across runs: (kernel, shape, dtype, direction)."""
    return row["kernel"], tuple(row["shape"]), row["dtype"], row["direction"]


def read_baseline(path: str, device: str) -> Optional[list]:
    """The rows of an earlier run's JSON to compare with, or None (saying
    why) where that run was on another GPU, whose rates are not this one's.

    Args:
        path: the run's JSON (``--json`` of this script).
        device: this run's GPU name (``torch.cuda.get_device_name()``).

    Returns:
        Its ``rows``, or None.
    """
    with open(path) as f:
        run = json.load(f)
    theirs = run.get("meta", {}).get("device")
    if theirs != device:
        print(f"--baseline {path} ran on {theirs}, this run on {device}: not compared")
        return None
    return run["rows"]


def slower_than_baseline(rows, baseline_rows, limit: float = SLOWER_THAN_BASELINE) -> list:
    """The rows slower than the same row of an earlier run.

    A row's slowdown is the baseline's fraction of the same-size copy over
    this run's: its time over the baseline's, each set against the copy of
    its bytes timed in its own run, so that a machine's or a clock's
    difference between the two runs cancels.

    Args:
        rows: this run's rows (:func:`bench_case`).
        baseline_rows: an earlier run's rows (its JSON's ``rows``).
        limit: the slowdown past which a row is listed.

    Returns:
        ``[(row, slowdown)]`` in this run's order, for the timed rows whose
        baseline row was timed too and whose slowdown exceeds ``limit``.
    """
    before = {row_key(r): r for r in baseline_rows if r.get("status") == "ok"}
    out = []
    for r in rows:
        old = before.get(row_key(r))
        if r.get("status") != "ok" or old is None:
            continue
        slowdown = old["same_size_fraction"] / r["same_size_fraction"]
        if slowdown > limit:
            out.append((r, slowdown))
    return out


def _percent(fraction: float) -> int:
    """A fraction as the whole percent below it (79.6 % reads 79 %: rounded,
    a row flagged below 80 % would read 80 %)."""
    return math.floor(100 * fraction + 1e-9)  # (0.57 * 100 is 56.99...)


def _flag(row: dict) -> str:
    return f"below {100 * LOW_FRACTION:.0f}%" if row.get("low") else ""


def text_table(rows, name: str) -> str:
    """The rows of one kernel as a plain-text table: "% 1GiB" is of the
    copy ceiling, "copy ms" the same-size copy's time and "% same" of its
    rate (which the flag is against)."""
    lines = [f"{name}  ({rows[0]['op']}{', ' + rows[0]['chain'] if rows[0]['chain'] else ''}, "
             f"problem {rows[0]['problem']}{', channels-last' if rows[0].get('channels_last') else ''})",
             f"  {'shape':<22}{'dtype':<10}{'direction':<10}{'ms':>9}{'GB/s':>9}{'% 1GiB':>8}"
             f"{'copy ms':>9}{'% same':>8}"]
    for r in rows:
        shape = "x".join(str(s) for s in r["shape"])
        if r["status"] != "ok":
            lines.append(f"  {shape:<22}{r['dtype']:<10}{r['direction']:<10}  "
                         f"{r['status']}: {r['message']}")
            continue
        lines.append(f"  {shape:<22}{r['dtype']:<10}{r['direction']:<10}{r['median_ms']:9.3f}"
                     f"{r['gbps']:9.0f}{100 * r['ceiling_fraction']:7.0f}%"
                     f"{r['copy_same_ms']:9.3f}{_percent(r['same_size_fraction']):7d}%  {_flag(r)}")
    return "\n".join(lines)


def markdown(rows, meta: dict) -> str:
    """The Markdown page: the copy ceiling and what the columns are set
    against, then one table per kernel.

    Args:
        rows: rows of :func:`bench_case`.
        meta: the run's metadata (``device``, ``copy_gbps``).

    Returns:
        The Markdown text.
    """
    out = [f"Copy ceiling ({meta.get('device', '?')}): {meta['copy_gbps']:.0f} GB/s "
           f"(read + write, 1 GiB float32 copy, median).  \"% of same-size copy\": of a "
           f"float32 copy that moves the row's bytes, timed as the kernel is (its time in "
           f"\"copy of same bytes ms\"); rows below {100 * LOW_FRACTION:.0f}% of it are "
           f"flagged.", ""]
    for name in dict.fromkeys(r["kernel"] for r in rows):
        mine = [r for r in rows if r["kernel"] == name]
        first = mine[0]
        what = first["op"] + (f" `{first['chain']}`" if first["chain"] else "") + (
            " on a channels-last z" if first.get("channels_last") else "")
        out += [f"### {name}: {what}, problem {first['problem']}", "",
                "| shape | dtype (z / vectors / y) | direction | ms | MB moved | GB/s | "
                "% of 1 GiB copy | copy of same bytes ms | % of same-size copy | |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        for r in mine:
            shape = " x ".join(str(s) for s in r["shape"])
            dts = f"{r['dtype']} ({r['z_dtype']} / {r['vector_dtype']} / {r.get('y_dtype', '-')})"
            if r["status"] != "ok":
                out.append(f"| {shape} | {dts} | {r['direction']} | - | - | - | - | - | - | "
                           f"{r['status']}: {r['message']} |")
                continue
            out.append(f"| {shape} | {dts} | {r['direction']} | {r['median_ms']:.3f} | "
                       f"{r['bytes'] / 1e6:.0f} | {r['gbps']:.0f} | "
                       f"{100 * r['ceiling_fraction']:.0f}% | {r['copy_same_ms']:.3f} | "
                       f"{_percent(r['same_size_fraction'])}% | {_flag(r)} |")
        out.append("")
    return "\n".join(out)


def select_cases(filters) -> dict:
    """The cases whose name contains one of ``filters`` (all for None).

    Args:
        filters: substrings of case names, e.g. ["bias_relu", "gn_swish"].

    Returns:
        ``{name: case}`` in :data:`CASES` order.

    Raises:
        SystemExit: a filter that matches no case.
    """
    if not filters:
        return dict(CASES)
    for f in filters:
        if not any(f in name for name in CASES):
            raise SystemExit(f"--kernels {f!r} matches none of {', '.join(CASES)}")
    return {name: case for name, case in CASES.items() if any(f in name for f in filters)}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", nargs="+", default=None, metavar="NAME",
                        help="kernels whose name contains one of these: " + ", ".join(CASES))
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--directions", nargs="+", default=list(DIRECTIONS), choices=DIRECTIONS)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="fewer iterations (10 after 3)")
    parser.add_argument("--json", metavar="PATH", default=None, help="write the rows as JSON")
    parser.add_argument("--md", metavar="PATH", default=None, help="write a Markdown page")
    parser.add_argument("--baseline", metavar="JSON", default=None,
                        help="an earlier run's JSON: list the rows slower than its own")
    args = parser.parse_args(argv)
    if args.quick:
        args.iters, args.warmup = 10, 3
    return args


def main(argv=None):
    args = parse_args(argv)
    cases = select_cases(args.kernels)
    import cupy_fused  # noqa: F401  (after --help: the kernels need a GPU)

    baseline = None
    if args.baseline:  # (read before the run: a wrong path fails at once)
        baseline = read_baseline(args.baseline, torch.cuda.get_device_name())

    ceiling = copy_ceiling_gbps(args.iters, args.warmup)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                cuda=torch.version.cuda, date=str(datetime.date.today()),
                argv=sys.argv[1:] if argv is None else list(argv), iters=args.iters,
                warmup=args.warmup, l2_bytes=l2_bytes(), copy_gbps=ceiling,
                baseline=args.baseline)
    print(f"copy ceiling (1 GiB): {ceiling:.0f} GB/s", flush=True)
    rows = []
    for name, case in cases.items():
        mine = []
        for dtype in args.dtypes:
            mine += bench_case(name, case, dtype, args.directions, args.iters, args.warmup,
                               ceiling)
        print(text_table(mine, name), flush=True)
        rows += mine
    write_run(args.json, args.md, meta, rows, markdown)
    if baseline is not None:
        slower = slower_than_baseline(rows, baseline)
        print(f"rows slower than {args.baseline} by more than "
              f"{100 * (SLOWER_THAN_BASELINE - 1):.0f}%: {len(slower) or 'none'}")
        for r, slowdown in slower:
            print(f"  {r['kernel']} {r['dtype']} {r['direction']}: {slowdown:.3f}x "
                  f"({r['median_ms']:.4f} ms, {100 * r['same_size_fraction']:.0f}% of the "
                  f"same-size copy)")


if __name__ == "__main__":
    main()
