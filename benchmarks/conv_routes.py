"""Where ``conv_bias_relu``'s engine route pays: the engine against the
``"cudnn"`` route over a grid of shapes, and what the routing rule
(``conv_bias_relu._engine_pays``, and ``_padded_plan`` where C_in is not
a multiple of 8) picks from each pair.

    python benchmarks/conv_routes.py                       # the whole grid
    python benchmarks/conv_routes.py --modes forward --dtypes bf16 --quick
    python benchmarks/conv_routes.py --json r.json --md r.md

Each case (image batch x height x width, kernel size, C_in, C_out, dtype,
x's layout, mode) is timed on both routes in turns (CUDA events,
``harness.time_interleaved``), each forced for the case: the engine with
the rule lifted (the route's other conditions still apply; a case they
keep off the engine is skipped), cuDNN with the engine's plan withheld.
Modes: ``forward`` under ``no_grad``; ``train``, the forward and
``y.backward(g)`` with x and every parameter requiring grad.  Dtypes:
``bf16``, ``fp16`` and ``fp32`` (TF32 allowed, PyTorch's default for
convolutions) tensors, and ``amp-bf16`` / ``amp-fp16``: float32 tensors,
each call under autocast to that dtype.  The whole grid takes ``bf16`` and
``fp32``; the others check that the 16-bit rules hold there too.

For each case: both times, their ratio (cuDNN / engine: above 1 the engine
is faster), the rule's pick and its loss (the pick's time over the faster
one's).  The summary gives the geometric mean and the worst of those
losses, for the rule and for always taking either route.  A case with a
C_in that is not a multiple of 8 (``--odd-channels``: C_in of 3 and 13,
and in training 3 -> 64, 3 -> 128 and 13 -> 128 channels) times the
engine on channels padded with zeros, the only way it reads them.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import itertools
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import autocast_context, gpu_state, time_interleaved, write_run  # noqa: E402

# (batch, height, width) of x: small to large images, and problem 1's.
IMAGES = [(256, 32, 32), (64, 56, 56), (128, 64, 64), (64, 128, 128), (16, 224, 224), (4, 512, 512)]
KERNELS = [1, 3, 5, 7]
CHANNELS_IN = [8, 64, 256]
ODD_CHANNELS_IN = [3, 13]
CHANNELS_OUT = [32, 128, 256]
# label -> (the tensors' dtype, autocast's dtype or None)
DTYPES = {"bf16": (torch.bfloat16, None), "fp16": (torch.float16, None), "fp32": (torch.float32, None),
          "amp-bf16": (torch.float32, torch.bfloat16), "amp-fp16": (torch.float32, torch.float16)}
DEFAULT_DTYPES = ["bf16", "fp32"]
LAYOUTS = ("nchw", "channels_last")
MODES = ("forward", "train")
# The training grid: fewer cases (each step is a few forwards long).
TRAIN_KERNELS = [1, 3, 5]
TRAIN_CHANNELS = [(64, 64), (64, 128)]
ODD_TRAIN_CHANNELS = [(3, 64), (3, 128), (13, 128)]


def _module():
    return importlib.import_module("cupy_fused.ops.conv_bias_relu")


@contextlib.contextmanager
def forced(route: str):
    """Every call inside on ``route``: "engine" (the rule lifted), "cudnn"
    (no engine plan), or "rule" (as shipped)."""
    cb = _module()
    saved = cb._engine_pays, cb._engine_plan
    if route == "engine":
        cb._engine_pays = lambda *args: True
    elif route == "cudnn":
        cb._engine_plan = lambda *args: None
    try:
        yield
    finally:
        cb._engine_pays, cb._engine_plan = saved


def operands(n, h, w, k, cin, cout, dtype, layout, seed=0):
    """Random x [n, cin, h, w] in ``layout``, weight [cout, cin, k, k],
    conv_bias (cout) and bias (cout, 1, 1), in ``dtype`` on the GPU."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, cin, h, w, device="cuda", dtype=dtype, generator=gen)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    weight = torch.randn(cout, cin, k, k, device="cuda", dtype=dtype, generator=gen) / math.sqrt(cin * k * k)
    conv_bias = torch.randn(cout, device="cuda", dtype=dtype, generator=gen)
    bias = torch.randn(cout, 1, 1, device="cuda", dtype=dtype, generator=gen)
    return x, weight, conv_bias, bias


def bench_case(n, h, w, k, cin, cout, dtype, layout, mode, iters, warmup, rounds):
    """One case on both routes; a dict, or None where the engine does not
    take the case even with the rule lifted."""
    cb = _module()
    tensor_dtype, amp = DTYPES[dtype]
    x, weight, conv_bias, bias = operands(n, h, w, k, cin, cout, tensor_dtype, layout)
    train = mode == "train"
    if train:
        x, weight, conv_bias, bias = (t.requires_grad_(True) for t in (x, weight, conv_bias, bias))
    args = (x, weight, conv_bias, bias)
    with autocast_context(amp):
        with forced("engine"):
            if cb.route(*args) != "engine":
                return None
        pick = cb.route(*args)
        with torch.no_grad():
            g = torch.randn_like(cb.conv_bias_relu(*(t.detach() for t in args))) if train else None

    def step_on(route):
        def step():
            with forced(route), autocast_context(amp):
                if train:
                    for t in args:
                        t.grad = None
                    cb.conv_bias_relu(*args).backward(g)
                else:
                    with torch.no_grad():
                        cb.conv_bias_relu(*args)
        return step

    fns = {route: step_on(route) for route in ("engine", "cudnn")}
    times = time_interleaved(fns, iters, warmup, rounds=rounds)
    engine, cudnn = times["engine"][0], times["cudnn"][0]
    chosen = engine if pick == "engine" else cudnn
    return dict(batch=n, height=h, width=w, kernel=k, cin=cin, cout=cout, dtype=dtype, layout=layout,
                mode=mode, engine_ms=engine, cudnn_ms=cudnn, ratio=cudnn / engine, pick=pick,
                loss=chosen / min(engine, cudnn), engine_loss=engine / min(engine, cudnn),
                cudnn_loss=cudnn / min(engine, cudnn))


def grid(modes, dtypes, odd):
    """The cases: (n, h, w, k, cin, cout, dtype, layout, mode)."""
    for mode in modes:
        if mode == "forward":
            kernels, channels = KERNELS, list(itertools.product(ODD_CHANNELS_IN if odd else CHANNELS_IN,
                                                                CHANNELS_OUT))
        else:
            kernels, channels = TRAIN_KERNELS, ODD_TRAIN_CHANNELS if odd else TRAIN_CHANNELS
        for (n, h, w), k, (cin, cout), dtype, layout in itertools.product(IMAGES, kernels, channels,
                                                                          dtypes, LAYOUTS):
            if k < min(h, w):
                yield n, h, w, k, cin, cout, dtype, layout, mode


def summary(rows) -> dict:
    """Per mode: cases, and the geometric mean and worst of the losses of
    the rule, of the engine everywhere and of cuDNN everywhere."""
    out = {}
    for mode in sorted({r["mode"] for r in rows}):
        mine = [r for r in rows if r["mode"] == mode]
        out[mode] = dict(cases=len(mine))
        for name, key in (("rule", "loss"), ("engine", "engine_loss"), ("cudnn", "cudnn_loss")):
            out[mode][name + "_geomean"] = math.exp(sum(math.log(r[key]) for r in mine) / len(mine))
            out[mode][name + "_worst"] = max(r[key] for r in mine)
    return out


def markdown(rows, meta) -> str:
    head = ("| images | kernel | C_in -> C_out | dtype | layout | mode | engine ms | cuDNN ms "
            "| cuDNN / engine | rule picks | loss |")
    lines = [f"`python benchmarks/conv_routes.py {' '.join(meta['argv'])}` on the {meta['device']} "
             f"({meta['date']}, torch {meta['torch']}).", ""]
    lines += ["Loss: a route's time over the faster route's, geometric mean / worst over the cases.", "",
              "| mode | cases | the rule | the engine everywhere | cuDNN everywhere |",
              "|---|---|---|---|---|"]
    for mode, s in meta["summary"].items():
        losses = (f"{s[name + '_geomean']:.3f} / {s[name + '_worst']:.2f}"
                  for name in ("rule", "engine", "cudnn"))
        lines.append(f"| {mode} | {s['cases']} | " + " | ".join(losses) + " |")
    lines += ["", head, "|" + "---|" * 11]
    for r in rows:
        lines.append(f"| {r['batch']}x{r['height']}x{r['width']} | {r['kernel']} | {r['cin']} -> {r['cout']} "
                     f"| {r['dtype']} | {r['layout']} | {r['mode']} | {r['engine_ms']:.3f} "
                     f"| {r['cudnn_ms']:.3f} | {r['ratio']:.2f} | {r['pick']} | {r['loss']:.2f} |")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--dtypes", nargs="+", default=DEFAULT_DTYPES, choices=list(DTYPES))
    parser.add_argument("--odd-channels", action="store_true",
                        help=f"C_in of {ODD_CHANNELS_IN} (padded by the engine) in place of {CHANNELS_IN}")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="fewer calls (4 after 1, 3 rounds)")
    parser.add_argument("--json", metavar="PATH", default=None, help="write the rows as JSON")
    parser.add_argument("--md", metavar="PATH", default=None, help="write a Markdown page")
    args = parser.parse_args(argv)
    if args.quick:
        args.iters, args.warmup, args.rounds = 4, 1, 3
    return args


def main(argv=None):
    args = parse_args(argv)
    torch.backends.cudnn.allow_tf32 = True  # (PyTorch's default for convolutions)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda,
                date=str(datetime.date.today()), argv=sys.argv[1:] if argv is None else list(argv),
                gpu_before=gpu_state())
    rows = []
    for case in grid(args.modes, args.dtypes, args.odd_channels):
        row = bench_case(*case, args.iters, args.warmup, args.rounds)
        if row is not None:
            rows.append(row)
            print(f"{row['batch']}x{row['height']}x{row['width']} k{row['kernel']} "
                  f"{row['cin']}->{row['cout']} {row['dtype']} {row['layout']} {row['mode']}: "
                  f"engine {row['engine_ms']:.3f} "
                  f"cudnn {row['cudnn_ms']:.3f} ({row['ratio']:.2f}) rule: {row['pick']}, "
                  f"loss {row['loss']:.2f}", flush=True)
    meta.update(gpu_after=gpu_state(), summary=summary(rows))
    for mode, s in meta["summary"].items():
        print(f"{mode}: {s['cases']} cases; loss (geomean, worst) of the rule {s['rule_geomean']:.3f}, "
              f"{s['rule_worst']:.2f}; of the engine everywhere {s['engine_geomean']:.3f}, "
              f"{s['engine_worst']:.2f}; of cuDNN everywhere {s['cudnn_geomean']:.3f}, "
              f"{s['cudnn_worst']:.2f}", flush=True)
    write_run(args.json, args.md, meta, rows, markdown)


if __name__ == "__main__":
    main()
