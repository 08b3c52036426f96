"""How the benchmarks measure: the dtype choices they share, the training
step (its fixed output gradient, the step as timed), CUDA-event timing (in
turns, or queued behind a sleep kernel), host issue time, the L2-rotation
rule, peak memory, the GPU's state, and the progress display of a long run.
Used by ``benchmarks/run.py``, ``scaling.py``, ``kernels.py``, ``gemm.py``,
``host_overhead.py`` and the tuners in ``scripts/``; the library itself
needs none of it.
"""
from __future__ import annotations

import contextlib
import gc
import itertools
import json
import math
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, NamedTuple, Optional, Tuple

import torch
import torch._functorch.config

# torch.compile's AOTAutograd cache in torch 2.11 keys a graph on whether
# autocast is on, not on its dtype (torch 2.13 keys the dtype too): a graph
# compiled under bfloat16 autocast was served again under float16 autocast
# in the same process, after torch._dynamo.reset() (the cache is on disk
# too, so later processes could be served so as well): torch.compile's rows
# of one autocast dtype ran the other's kernels.  No benchmark times
# compiling, so every benchmark process leaves that cache off (a torch
# without that cache has nothing to turn off).
if hasattr(torch._functorch.config, "enable_autograd_cache"):
    torch._functorch.config.enable_autograd_cache = False

try:
    from tqdm import tqdm as _tqdm
except ImportError:  # optional (the ``bench`` extra): plain lines instead
    _tqdm = None


# --- dtype choices -------------------------------------------------------

class Dtype(NamedTuple):
    """One ``--dtypes`` choice.

    Attributes:
        model: dtype of the model's parameters and input (of a kernel's
            per-channel vectors).
        autocast: the forward runs under ``torch.autocast`` to this dtype;
            None outside autocast.
    """

    model: torch.dtype
    autocast: Optional[torch.dtype] = None

    @property
    def compute(self) -> torch.dtype:
        """The dtype the fused ops see their activations in: the autocast
        dtype (what an autocast GEMM hands its epilogue), else the model's."""
        return self.autocast or self.model


# The model and its input in one dtype, or float32 under autocast to a
# half dtype (the autocast modes' labels are their own names).
DTYPES = {
    "fp32": Dtype(torch.float32),
    "fp16": Dtype(torch.float16),
    "bf16": Dtype(torch.bfloat16),
    "amp-bf16": Dtype(torch.float32, torch.bfloat16),
    "amp-fp16": Dtype(torch.float32, torch.float16),
}


def dtype_label(dtype: str) -> str:
    """The ``dtype`` field of result rows for a ``--dtypes`` choice: the
    torch dtype's name ("float32", ...), or the autocast mode's own name
    ("amp-bf16", "amp-fp16").

    Args:
        dtype: a key of :data:`DTYPES`.

    Returns:
        The label.
    """
    choice = DTYPES[dtype]
    if choice.autocast is not None:
        return dtype
    return str(choice.model).replace("torch.", "")


def model_dtype(dtype: str) -> torch.dtype:
    """The dtype of the model's parameters and input for a ``--dtypes``
    choice (float32 in the autocast modes)."""
    return DTYPES[dtype].model


def autocast_dtype(dtype: str) -> Optional[torch.dtype]:
    """The autocast dtype of a ``--dtypes`` choice, None outside autocast."""
    return DTYPES[dtype].autocast


# --- the training step ---------------------------------------------------

def autocast_context(amp, device_type: str = "cuda", cache: bool = True):
    """The context of one forward: autocast to ``amp`` (with its cast cache,
    or without: ``cache``), or none."""
    if amp is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=amp, cache_enabled=cache)


def fixed_grad(model, x: torch.Tensor, amp=None, seed: int = 0,
               device_type: str = "cuda") -> torch.Tensor:
    """The training step's output gradient ``g``: standard normal values of
    the output's shape, drawn in float32 from ``seed`` (the same values for
    every implementation of a problem), in the output's dtype and memory
    format (a channels-last y's gradient channels-last, as the next layer
    of a channels-last network hands it back).

    Args:
        model: the implementation (its uncompiled module: one no-grad
            forward learns the output's shape and dtype).
        x: an input.
        amp: the autocast dtype of the forward, or None.
        seed: seed of the values.
        device_type: the device type of ``torch.autocast``.

    Returns:
        g, on x's device.
    """
    with torch.no_grad(), autocast_context(amp, device_type):
        y = model(x)
    gen = torch.Generator(device=y.device).manual_seed(seed)
    g = torch.randn(y.shape, generator=gen, device=y.device, dtype=torch.float32)
    return torch.empty_like(y).copy_(g)  # (empty_like keeps y's dense layout)


def step_fns(model, mode: str, inputs, train_inputs, grad=None, amp=None, graphs: bool = False,
             device_type: str = "cuda", keep: Optional[dict] = None, amp_cache: bool = True):
    """(step, reset) of one timed iteration: a forward under ``no_grad``, or
    forward and ``y.backward(grad)`` after dropping earlier gradients.

    Args:
        model: the implementation.
        mode: "forward" or "train".
        inputs, train_inputs: the inputs to rotate over, of a forward and
            of a training step (those require grad where the step is to
            compute the input's gradient too).
        grad: the output gradient of a training step (:func:`fixed_grad`).
        amp: autocast dtype of the forward, or None.
        graphs: the model is compiled with mode="reduce-overhead": each
            step starts a new CUDA-graph generation
            (``torch.compiler.cudagraph_mark_step_begin``), since the
            previous step's outputs are no longer used.
        device_type: the device type of ``torch.autocast``.
        keep: a dict that each step leaves its output in (detached, as
            ``keep["y"]``), for a caller that checks what the steps compute
            (``benchmarks/ab.py``); None keeps nothing, so that a timed
            step holds no earlier output.
        amp_cache: autocast's cast cache on (its default) or off (what
            ``torch.cuda.make_graphed_callables`` asks for).

    Returns:
        (step, reset), functions of no arguments.
    """
    rotation = itertools.cycle(inputs if mode == "forward" else train_inputs)
    begin = torch.compiler.cudagraph_mark_step_begin if graphs else None

    def reset():
        for p in model.parameters() if hasattr(model, "parameters") else []:
            p.grad = None
        for t in train_inputs:
            t.grad = None

    if mode == "forward":
        def step():
            if begin is not None:
                begin()
            with torch.no_grad(), autocast_context(amp, device_type, amp_cache):
                y = model(next(rotation))
            if keep is not None:
                keep["y"] = y
    else:
        if grad is None:
            raise ValueError("a training step needs its output gradient (fixed_grad)")

        def step():
            reset()
            if begin is not None:
                begin()
            with autocast_context(amp, device_type, amp_cache):
                y = model(next(rotation))
            y.backward(grad)  # outside autocast, as training code runs it
            if keep is not None:
                keep["y"] = y.detach()
    return step, reset


def collect_dead_graphs() -> None:
    """Runs the garbage collector, so that no dead CUDA graph is left to be
    freed during the next capture.  ``make_graphed_callables`` ties the
    module and its graphs in a reference cycle; a dropped graphed module is
    freed only by the collector, and a graph freed while another capture is
    under way invalidates that capture.  ``torch.cuda.graph`` no longer
    collects before a capture (unless ``torch.compiler.config.
    force_cudagraph_gc``), so a caller that drops graphed modules collects."""
    gc.collect()


def graphed_step_fns(model, mode: str, inputs, train_inputs, grad=None, amp=None,
                     device_type: str = "cuda"):
    """(step, reset) of :func:`step_fns` with the model's forward and
    backward captured as CUDA graphs by
    ``torch.cuda.make_graphed_callables(model, (sample,))``, which replaces
    ``model.forward`` (pass a copy of a model timed otherwise too): each
    step copies its input into the graphs' own and replays them, so that
    the host issues a few replays instead of every kernel.  The sample is an
    input's copy of its own (requiring grad in a training step); under
    autocast its cast cache is off, at the capture and in every step, as
    make_graphed_callables asks.

    Args:
        model, mode, inputs, train_inputs, grad, amp, device_type: as
            :func:`step_fns`'s (a CUDA model and inputs).

    Returns:
        (step, reset), functions of no arguments.
    """
    pool = inputs if mode == "forward" else train_inputs
    sample = pool[0].detach().clone().requires_grad_(mode == "train")
    collect_dead_graphs()
    with autocast_context(amp, device_type, cache=False):
        torch.cuda.make_graphed_callables(model, (sample,))
    return step_fns(model, mode, inputs, train_inputs, grad, amp, device_type=device_type, amp_cache=False)


# --- CUDA-event timing ---------------------------------------------------

def time_ms(fn, iters: int, warmup: int) -> Tuple[float, float]:
    """(median, min) milliseconds of ``fn`` over ``iters`` calls after
    ``warmup``, from CUDA events around each call on the current stream."""
    return time_interleaved({"fn": fn}, iters, warmup, rounds=1)["fn"]


def product_tflops(dtype: torch.dtype, tf32: bool = False, n: int = 8192, iters: int = 10,
                   device: str = "cuda") -> float:
    """TFLOP/s of torch's (cuBLAS's) ``dtype`` product of two random n x n
    matrices, from its best of ``iters`` calls (:func:`time_ms`), with
    TF32 allowed to it or not (``tf32``; the flag is off again after): a
    ceiling a kernel's rate is judged against, measured in the same run."""
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
        _, best = time_ms(lambda: a @ b, iters, 3)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False
    return 2 * n ** 3 / best / 1e9


def timed_calls(estimate_ms: float, iters: int, min_ms: float, most: int) -> int:
    """How many calls to time of a function that takes ``estimate_ms`` per
    call: ``iters``, or more, up to ``most``, so that together they take
    ``min_ms``."""
    if min_ms <= 0 or not estimate_ms > 0:
        return iters
    return max(iters, min(most, math.ceil(min_ms / estimate_ms)))


def time_interleaved(fns: Dict[str, Callable[[], object]], iters: int, warmup: int,
                     rounds: int = 5, min_ms: float = 0.0, queued: bool = False,
                     clock=time.perf_counter) -> Dict[str, Tuple[float, float]]:
    """(median, min) milliseconds of each of ``fns`` over ``iters`` calls, as
    :func:`time_ms`, but taken in turns: ``rounds`` rounds, each running a
    share of every function's iterations (after one untimed call, so that
    none inherits the caches of the one before).  Whatever drifts over a run
    (the GPU's clock and temperature, load on the host) then hits all of
    them alike instead of favouring whichever runs first.

    ``min_ms``: a function whose ``iters`` calls would take less than this
    (timed over three calls after the warm-up) gets more calls, up to
    ``10 * iters`` (:func:`timed_calls`).  A step of well under a
    millisecond is as long as the host takes to issue it, and the host's
    pace varies, so such steps need more calls for a stable ratio
    (docs/performance.md, Method).

    ``queued``: each round's timed calls of a function are queued behind a
    sleep kernel that outlasts their issue, as :func:`time_queued` queues
    them, so that each event pair times the GPU's work alone (kernels of
    a few microseconds, whose calls the host issues more slowly than the
    GPU runs them); ``clock`` times their issue."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    calls = {name: iters for name in fns}
    issue_ms = {name: _issue_ms(fn, clock) for name, fn in fns.items()} if queued else {}
    if min_ms > 0:
        for name, fn in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(3):
                fn()
            end.record()
            torch.cuda.synchronize()
            calls[name] = timed_calls(start.elapsed_time(end) / 3, iters, min_ms, 10 * iters)
    rounds = max(1, min(rounds, min(calls.values())))
    times: Dict[str, list] = {name: [] for name in fns}
    for r in range(rounds):
        for name, fn in fns.items():
            n = calls[name]
            share = n // rounds + (1 if r < n % rounds else 0)
            fn()
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(share)]
            if queued:
                hold_gpu_ms(1.5 * issue_ms[name] * share + 1.0)
            for start, end in events:
                start.record()
                fn()
                end.record()
            torch.cuda.synchronize()
            times[name] += [s.elapsed_time(e) for s, e in events]
    return {name: (statistics.median(t), min(t)) for name, t in times.items()}


_sleep_cycles_per_ms = []


def hold_gpu_ms(ms: float) -> None:
    """Holds the current stream for about ``ms`` with a sleep kernel, so
    that the host can queue work behind it (torch.cuda._sleep spins for a
    count of clock cycles: their rate is measured once per process).

    Args:
        ms: milliseconds.
    """
    if not _sleep_cycles_per_ms:
        cycles = 10**7
        torch.cuda._sleep(cycles)  # warm-up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        torch.cuda.synchronize()
        _sleep_cycles_per_ms.append(cycles / max(start.elapsed_time(end), 1e-3))
    torch.cuda._sleep(int(ms * _sleep_cycles_per_ms[0]))


def _issue_ms(fn, clock) -> float:
    """The host's time to issue one call of ``fn`` (ms, ``clock`` in
    seconds), over three calls after the warm-up (a first call may compile
    its kernel), the GPU idle before and after: what sizes the sleep that
    queued calls wait behind."""
    torch.cuda.synchronize()
    t0 = clock()
    for _ in range(3):
        fn()
    per_call_ms = (clock() - t0) * 1e3 / 3
    torch.cuda.synchronize()
    return per_call_ms


def time_queued(fn, iters: int, warmup: int, clock=time.perf_counter) -> Tuple[float, float]:
    """(median, min) milliseconds of ``fn`` from CUDA events around each of
    ``iters`` calls, as :func:`time_ms`, but with the calls queued behind a
    sleep kernel that outlasts their issue: each event pair then times the
    GPU's work alone.  (A kernel of a few microseconds takes less time than
    the host needs to issue its call, the autograd engine's work included;
    timed as issued, its events would time the host.)

    Args:
        fn: the call to time.
        iters: timed calls.
        warmup: untimed calls first.
        clock: wall clock in seconds.

    Returns:
        (median ms, min ms).
    """
    for _ in range(warmup):
        fn()
    per_call_ms = _issue_ms(fn, clock)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(iters)]
    hold_gpu_ms(1.5 * per_call_ms * iters + 1.0)
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    times = [start.elapsed_time(end) for start, end in events]
    return statistics.median(times), min(times)


def host_and_gpu_ms(step, steps: int = 10, rounds: int = 3, clock=time.perf_counter):
    """Host issue time and GPU time of one call of ``step``, in ms.

    Host: the wall time of issuing ``steps`` calls, the GPU idle at the
    start and no synchronisation in the loop, per call.  GPU: CUDA events
    around the same calls queued behind a sleep kernel that outlasts their
    issue, per call: the GPU's own time, without the gaps where it waits
    for the host (which the per-call event time of a host-bound step
    includes).  ``steps`` is kept small so that the queued launches stay
    within the driver's launch queue (the host would block on a full one).

    Args:
        step: the function to time (a training step or a forward).
        steps: calls per round.
        rounds: rounds; each time is the median over them.
        clock: wall clock in seconds.

    Returns:
        (host ms, GPU ms) per call.
    """
    host, gpu = [], []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = clock()
        for _ in range(steps):
            step()
        issue_ms = (clock() - t0) * 1e3
        torch.cuda.synchronize()
        host.append(issue_ms / steps)
        # Sleep for the issue time and half again (plus a margin): the GPU
        # starts the first step only once the host has queued the last.
        hold_gpu_ms(1.5 * issue_ms + 1.0)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            step()
        end.record()
        torch.cuda.synchronize()
        gpu.append(start.elapsed_time(end) / steps)
    return statistics.median(host), statistics.median(gpu)


# --- host time of tiny calls ---------------------------------------------

def per_call_us(variants: dict, calls: int, rounds: int = 11) -> dict:
    """Host microseconds per call of each variant: the variants take turns
    (round robin, so machine noise hits them alike) and each keeps its best
    round."""
    for fn in variants.values():
        for _ in range(200):
            fn()
    torch.cuda.synchronize()
    best = {name: float("inf") for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            best[name] = min(best[name], (t1 - t0) / calls * 1e6)
    return best


def paired_ratios(base, other, calls: int = 2000, rounds: int = 101) -> dict:
    """Host time per call of ``other`` over ``base``, one ratio per round of
    ``calls`` calls of each, timed back to back (``base`` first in even
    rounds, ``other`` first in odd ones).  Returns the median ratio, its
    quartiles, and the median microseconds per call of each."""
    for _ in range(200):
        base()
        other()
    torch.cuda.synchronize()

    def timed(fn):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        return (t1 - t0) / calls * 1e6

    ratios, base_us, other_us = [], [], []
    for r in range(rounds):
        if r % 2 == 0:
            b = timed(base)
            o = timed(other)
        else:
            o = timed(other)
            b = timed(base)
        ratios.append(o / b)
        base_us.append(b)
        other_us.append(o)
    q = statistics.quantiles(ratios, n=4)
    return {"median_ratio": statistics.median(ratios), "q1": q[0], "q3": q[2],
            "base_us": statistics.median(base_us), "other_us": statistics.median(other_us),
            "rounds": rounds, "calls": calls}


# --- inputs, memory, device state ----------------------------------------

def rotation_count(input_bytes: int, l2_bytes: int, most: int = 16) -> int:
    """Copies of an input to rotate over: 1 when it does not fit in L2, else
    enough that together they hold at least twice the L2 (at most ``most``)."""
    if input_bytes <= 0 or input_bytes >= l2_bytes:
        return 1
    return min(most, -(-2 * l2_bytes // input_bytes))


def l2_bytes() -> int:
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return int(getattr(props, "L2_cache_size", 50 * 2**20))


def peak_extra_gib(fn, reset) -> float:
    """Peak memory allocated during one call of ``fn`` above what was
    allocated before it, in GiB (``reset`` drops what earlier calls left,
    such as gradients, before the baseline is taken)."""
    reset()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def gpu_state() -> dict:
    """The GPU's SM clock (MHz), power draw (W), temperature (C) and active
    clock-limit reasons from ``nvidia-smi``, or {} where it is missing: taken
    at the start and end of a run, for the record."""
    fields = ("clocks.sm", "power.draw", "temperature.gpu", "clocks_throttle_reasons.active")
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=" + ",".join(fields),
                              "--format=csv,noheader,nounits", "-i", str(torch.cuda.current_device())],
                             capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {}
    values = [v.strip() for v in out.splitlines()[0].split(",")] if out else []
    return dict(zip(fields, values)) if len(values) == len(fields) else {}


def write_run(json_path: Optional[str], md_path: Optional[str], meta: dict, rows: list,
              markdown: Optional[Callable[[list, dict], str]] = None) -> None:
    """Writes a script's run: ``{"meta": meta, "rows": rows}`` as JSON to
    ``json_path`` and ``markdown(rows, meta)`` to ``md_path`` (each where
    given), printing each path written."""
    if json_path:
        with open(json_path, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
        print(json_path)
    if md_path and markdown is not None:
        with open(md_path, "w") as f:
            f.write(markdown(rows, meta) + "\n")
        print(md_path)


# --- progress ------------------------------------------------------------

def say(text: str) -> None:
    """Prints a line of results to stdout without breaking a progress bar
    drawn on stderr (on a terminal both share the screen)."""
    if _tqdm is not None:
        _tqdm.write(text, file=sys.stdout)
        sys.stdout.flush()
    else:
        print(text, flush=True)


class Progress:
    """Progress over ``total`` items, on stderr so that stdout and the
    files a run writes are the same with or without it: a tqdm bar where
    tqdm is installed, else one line per finished item.  Call it once per
    finished item (with a short name for it); close it (or use it as a
    context manager) before printing the results.

    Args:
        total: items expected.
        desc: what the items are, shown before the count.
        bar: True / False to force or refuse the tqdm bar; None: the bar
            where tqdm is installed.
    """

    def __init__(self, total: int, desc: str = "", bar: Optional[bool] = None):
        self.total, self.desc, self.done = total, desc, 0
        self._start = time.monotonic()
        if bar and _tqdm is None:
            raise ImportError("the progress bar needs tqdm (pip install tqdm)")
        self._bar = (_tqdm(total=total, desc=desc or None, file=sys.stderr, unit="run",
                           dynamic_ncols=True)
                     if (_tqdm is not None if bar is None else bar) else None)

    def __call__(self, item: str = "") -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.set_postfix_str(item, refresh=False)
            self._bar.update()
            return
        elapsed = int(time.monotonic() - self._start)
        width = len(str(self.total))
        head = f"{self.desc} " if self.desc else ""
        line = (f"{head}[{self.done:>{width}}/{self.total}] "
                f"{elapsed // 60}:{elapsed % 60:02d} {item}")
        print(line.rstrip(), file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
