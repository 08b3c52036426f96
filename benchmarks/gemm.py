"""The float32 GEMM alone: our tensor-core kernel (3xTF32 and TF32) against
cuBLAS SGEMM and cuBLAS TF32, for the three products of a linear layer at the
GEMM problems' shapes — time, TFLOP/s, speedup over SGEMM and relative error
against float64.

    python benchmarks/gemm.py [--shapes 1024x8192x8192 32768x1024x4096] [--json F] [--md F]
    python benchmarks/gemm.py --tiles engine128x128 engine128x128_split_b   # also each tile kernel
    python benchmarks/gemm.py --half     # the float16 / bfloat16 engine (Hopper) against cuBLAS
    python benchmarks/gemm.py --half-layouts [--products grad_weight]   # its three products
    python benchmarks/gemm.py --float32-weight   # autocast's product, float32 W (Hopper)
    python benchmarks/gemm.py --conv-wgrad [--conv-shapes 128x64x128x128-128x3]   # problem 1's dW
    python benchmarks/gemm.py --small-outputs    # 3xTF32 against SGEMM on outputs of few tiles

A shape MxKxN is batch x in_features x out_features: forward y = x W^T with
x [M, K], W [N, K]; grad_input dx = dy W; grad_weight dW = dy^T x.  Error:
max over elements of |C - C64| / (|A| |B|)_ij (the elementwise bound of a
dot product's rounding error, so rows of any magnitude count equally).
"""
from __future__ import annotations

import argparse
import functools
import json
import platform
import sys
from pathlib import Path

import torch

# The library of this tree, and benchmarks/ itself when loaded by path.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from cupy_fused.ops import gemm as G  # noqa: E402
from cupy_fused.testing import rel_error, scaled_gemm_error  # noqa: E402
from harness import product_tflops, time_interleaved  # noqa: E402

DEFAULT_SHAPES = ("1024x8192x8192", "32768x1024x4096")
# NxC_inxHxW-C_outxK: problem 1's convolution, its kernel 5 wide, and one
# with more channels.
DEFAULT_CONV_SHAPES = ("128x64x128x128-128x3", "128x64x128x128-128x5", "32x128x64x64-256x3")

# (result rows, inner size, result columns) of each product of a linear
# layer with batch M, in_features K, out_features N.
PRODUCT_SIZES = {
    "forward": lambda m, k, n: (m, k, n),      # y [M, N] = x W^T
    "grad_input": lambda m, k, n: (m, n, k),   # dx [M, K] = dy W
    "grad_weight": lambda m, k, n: (n, m, k),  # dW [N, K] = dy^T x
}


def _with_tf32(ref, a, b):
    """cuBLAS with TF32 allowed for this call only."""
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        return ref(a, b)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False


def run(shapes, iters: int, tiles=()):
    """Times every product of each shape; ``tiles``: also our 3xTF32 product
    on each of these tile kernels (keys of ``G.TILES``), whatever
    ``G.choose_tile`` picks."""
    device = torch.device("cuda")
    rows = []
    for shape in shapes:
        m, k, n = map(int, shape.split("x"))
        flops = 2.0 * m * n * k
        for layout in G.LAYOUTS:
            a, b, ref = operands(layout, *PRODUCT_SIZES[layout](m, k, n), 0, 0, device)
            impls = {
                "ours 3xtf32": lambda: G._gemm(a, b, layout, 3),
                "ours tf32": lambda: G._gemm(a, b, layout, 1),
                "cublas sgemm": lambda: ref(a, b),
                "cublas tf32": lambda: _with_tf32(ref, a, b),
            }
            for tile in tiles:
                impls[f"ours 3xtf32 on {tile}"] = (
                    lambda tile=tile: G._gemm_on_tile(a, b, layout, 3, tile))
            row = {"shape": shape, "layout": layout}
            row.update(_timed_entries(impls, iters, flops,
                                      lambda c: scaled_gemm_error(c, a, b, ref)))
            row["speedup 3xtf32 vs sgemm"] = (row["cublas sgemm"]["median_ms"]
                                              / row["ours 3xtf32"]["median_ms"])
            row["tile"] = G.choose_tile(*G._product_shape(a, b, layout), True, device.index)
            rows.append(row)
            print(f"{shape} {layout:12s} " + "  ".join(
                f"{nm}: {row[nm]['median_ms']:.3f} ms {row[nm]['tflops']:.0f} TF/s err {row[nm]['error']:.1e}"
                for nm in impls) + f"  x{row['speedup 3xtf32 vs sgemm']:.2f}", flush=True)
    return rows


def operands(layout: str, p: int, inner: int, q: int, spread: int, seed: int, device):
    """(a, b, reference) of one layout with a [p, q] result and ``inner``
    summed products; with ``spread`` > 0, a's rows and columns and b's outer
    index are scaled by random powers of two in 2^[-spread, spread]."""
    g = torch.Generator(device=device).manual_seed(seed)
    f64 = dict(device=device, dtype=torch.float64)
    a = torch.rand(p, inner, generator=g, **f64) * 2 - 1  # logical [outer, inner]
    b = torch.rand(q, inner, generator=g, **f64) * 2 - 1
    if spread:
        scale = lambda *s: torch.exp2(torch.randint(-spread, spread + 1, s, device=device,  # noqa: E731
                                                    generator=g).double())
        a, b = a * scale(p, 1) * scale(1, inner), b * scale(q, 1)
    a, b = a.float(), b.float()
    if layout == "forward":      # a [M, K], b [N, K]
        return a, b, lambda a, b: a @ b.t()
    if layout == "grad_input":   # a [M, K], b [K, N]
        return a, b.t().contiguous(), lambda a, b: a @ b
    return a.t().contiguous(), b.t().contiguous(), lambda a, b: a.t() @ b  # a [K, M], b [K, N]


def accuracy_sweep(ks=(1, 8, 32, 128, 512, 2048, 8192, 32768), sizes=((256, 256),)):
    """Scaled error of 3xTF32, TF32 and SGEMM against float64 as the inner
    size grows, for the three layouts, on uniform [-1, 1) data and on data
    scaled by 2^[-20, 20] (see :func:`operands`)."""
    device = torch.device("cuda")
    out = []
    for p, q in sizes:
        for layout in G.LAYOUTS:
            for spread in (0, 20):
                for k in ks:
                    a, b, ref = operands(layout, p, k, q, spread, k, device)
                    row = {"size": f"{p}x{q}", "layout": layout, "k": k, "spread": spread,
                           "3xtf32": scaled_gemm_error(G._gemm(a, b, layout, 3), a, b, ref),
                           "sgemm": scaled_gemm_error(ref(a, b), a, b, ref),
                           "tf32": scaled_gemm_error(G._gemm(a, b, layout, 1), a, b, ref)}
                    out.append(row)
                    print(f"accuracy {p}x{q} {layout:11s} k={k:6d} spread=2^{spread:<2d} "
                          f"3xtf32 {row['3xtf32']:.2e} sgemm {row['sgemm']:.2e} "
                          f"tf32 {row['tf32']:.2e}", flush=True)
    return out


# Outputs of one tile to 64 (1024 x 1024), and 4096 x 4096 (1024 tiles: what
# the short-sum rule costs where the kernel fills the GPU).
DEFAULT_SMALL_SIZES = ("33x40", "64x64", "100x100", "128x128", "33x200", "64x256", "200x300",
                       "256x256", "64x1024", "1024x256", "512x512", "1024x1024", "4096x4096")
DEFAULT_SMALL_KS = (32, 40, 48, 64, 96, 128, 192, 256, 512, 1024)


def small_outputs_run(sizes=DEFAULT_SMALL_SIZES, ks=DEFAULT_SMALL_KS, seeds: int = 8,
                      iters: int = 20):
    """The forward product of outputs of few 128 x 128 tiles: the 3xTF32
    kernel (``G._gemm``, whatever ``G.uses_sgemm`` routes) against cuBLAS
    SGEMM (TF32 off), on the models' own data (x uniform in [0, 1), W
    uniform in +-1/sqrt(k)).  Error: max |C - C64| / max |C64| per seed;
    each row gives the median and largest ratio kernel / SGEMM over
    ``seeds`` seeds, the two timed in turns on the first seed's operands
    (GPU time: each round's calls queued behind a sleep kernel, as
    ``time_interleaved(queued=True)`` does), and whether ``G.uses_sgemm``
    sends the product to SGEMM."""
    if seeds < 1:
        raise ValueError(f"small_outputs_run: seeds must be at least 1, got {seeds}")
    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    rows = []
    for size in sizes:
        m, n = map(int, size.split("x"))
        for k in ks:
            ratios, ops = [], None
            for seed in range(seeds):
                g = torch.Generator(device=device).manual_seed(seed * 7919 + m * 31 + n * 17 + k)
                x = torch.rand(m, k, device=device, generator=g)
                w = (torch.rand(n, k, device=device, generator=g) * 2 - 1) / k ** 0.5
                c64 = x.double() @ w.double().t()
                ratios.append(rel_error(G._gemm(x, w, "forward", 3), c64)
                              / max(rel_error(x @ w.t(), c64), 1e-300))
                ops = ops or (x, w)
            x, w = ops
            times = time_interleaved({"kernel": lambda: G._gemm(x, w, "forward", 3),
                                      "sgemm": lambda: x @ w.t()}, iters, warmup=3, queued=True)
            ratios.sort()
            row = {"size": size, "k": k, "tiles": G.cdiv(m, 128) * G.cdiv(n, 128),
                   "error ratio median": ratios[len(ratios) // 2], "error ratio max": ratios[-1],
                   "kernel ms": times["kernel"][0], "sgemm ms": times["sgemm"][0],
                   "routed to sgemm": G.uses_sgemm(3, k, m, n, sms)}
            rows.append(row)
            print(f"small {size:>9s} k={k:5d} tiles={row['tiles']:3d} error kernel/SGEMM median "
                  f"{row['error ratio median']:.2f} max {row['error ratio max']:.2f}  time "
                  f"{row['kernel ms'] / row['sgemm ms']:.2f}  routed to SGEMM: "
                  f"{row['routed to sgemm']}", flush=True)
    return rows


def small_outputs_markdown(rows) -> str:
    """The table of :func:`small_outputs_run`, then the largest error ratios
    of the rows the rule leaves on the kernel (what its users get)."""
    lines = ["| m x n | k | tiles | error kernel / SGEMM (median, max) | GPU time kernel / SGEMM "
             "| route |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['size']} | {r['k']} | {r['tiles']} | {r['error ratio median']:.2f}, "
                     f"{r['error ratio max']:.2f} | {r['kernel ms'] / r['sgemm ms']:.2f} | "
                     f"{'SGEMM' if r['routed to sgemm'] else 'kernel'} |")
    kept = [r for r in rows if not r["routed to sgemm"]]
    if kept:
        worst = max(kept, key=lambda r: r["error ratio max"])
        lines += ["", f"On the kernel's route ({len(kept)} of {len(rows)} rows): error ratio "
                      f"median at most {max(r['error ratio median'] for r in kept):.2f}, max at most "
                      f"{worst['error ratio max']:.2f} ({worst['size']}, k = {worst['k']})."]
    return "\n".join(lines) + "\n"


def write_outputs(json_path, md_path, title: str, meta: dict, payload: dict, md: str) -> None:
    """A run's results: ``{"meta": meta, **payload}`` as JSON at
    ``json_path`` and ``md`` under a line naming ``title``, the device and
    torch (from ``meta``) at ``md_path`` (each skipped where None), and
    ``md`` printed."""
    if json_path:
        Path(json_path).write_text(json.dumps({"meta": meta, **payload}, indent=1))
    if md_path:
        Path(md_path).write_text(f"{title} on {meta['device']}, torch {meta['torch']}\n\n" + md)
    print(md)


def _timed_entries(impls, iters: int, flops: float, error) -> dict:
    """Times ``impls`` (name -> a call returning its product) in turns, not
    one after another (see ``time_interleaved``), and gives each name's row
    entry: median and best ms, TFLOP/s for ``flops`` per call, and
    ``error(product)`` of one more call's product."""
    times = time_interleaved(impls, iters, warmup=3)
    entries = {}
    for name, fn in impls.items():
        med, best = times[name]
        entries[name] = {"median_ms": med, "min_ms": best, "tflops": flops / med / 1e9,
                         "error": error(fn())}
    return entries


def _product_rows(shapes, iters: int, impls_of):
    """Rows of timed forward products x W^T, per shape and 16-bit dtype: x
    [M, K] in the dtype, W [N, K] float32 (random, seeded by the shape);
    ``impls_of(x, w, w_d)`` (w_d: W cast to the dtype) gives the
    implementations to time in turns, each of which returns x w_d^T.  Each
    implementation's row entry: median and best ms, TFLOP/s, error against
    float64 of that product (as the module docstring says)."""
    rows = []
    for shape, (m, k, n), flops, dtype, g in _half_cases(shapes):
        x = torch.randn(m, k, device=g.device, generator=g).to(dtype)
        w = torch.randn(n, k, device=g.device, generator=g) / k ** 0.5
        w_d = w.to(dtype)
        row = {"shape": shape, "dtype": str(dtype).replace("torch.", "")}
        row.update(_timed_entries(impls_of(x, w, w_d), iters, flops,
                                  lambda c: scaled_gemm_error(c, x, w_d, lambda a, b: a @ b.t())))
        rows.append(row)
    return rows


def _half_cases(shapes):
    """(shape, (M, K, N), FLOP of one product, dtype, a CUDA generator
    seeded by the shape) for each shape MxKxN and 16-bit dtype."""
    for shape in shapes:
        m, k, n = map(int, shape.split("x"))
        for dtype in (torch.float16, torch.bfloat16):
            yield (shape, (m, k, n), 2.0 * m * n * k, dtype,
                   torch.Generator(device="cuda").manual_seed(m + k + n))


def half_run(shapes, iters: int):
    """The forward product x W^T in float16 and bfloat16: our Hopper engine
    (``G._half_linear``, kernels_cu/gemm.cuh) against cuBLAS (``torch.mm``),
    timed in turns."""
    def impls_of(x, w, w_d):
        return {"ours": lambda: G._half_linear(x, w_d), "cublas": lambda: torch.mm(x, w_d.t())}

    rows = _product_rows(shapes, iters, impls_of)
    for row in rows:
        row["ours vs cublas"] = row["cublas"]["median_ms"] / row["ours"]["median_ms"]
        print(f"{row['shape']} {row['dtype']:9s} ours {row['ours']['median_ms']:.3f} ms "
              f"{row['ours']['tflops']:.0f} TF/s  cuBLAS {row['cublas']['median_ms']:.3f} ms "
              f"{row['cublas']['tflops']:.0f} TF/s  x{row['ours vs cublas']:.3f}", flush=True)
    return rows


def _sampled_error(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rows: int = 256) -> float:
    """scaled_gemm_error of ``c = a @ b`` over ``rows`` evenly spaced rows
    (float64 products of the full size would take longer than the timing)."""
    idx = torch.linspace(0, a.shape[0] - 1, min(rows, a.shape[0]), device=a.device).long()
    return scaled_gemm_error(c[idx], a[idx], b, torch.mm)


def half_layouts_run(shapes, iters: int, products=tuple(PRODUCT_SIZES)):
    """The products of a 16-bit linear layer of each shape (batch x in x out
    = M x K x N): forward x W^T, grad_input dZ W, grad_weight dZ^T x, on our
    Hopper engine in the layouts they come in (``G._half_matmul``) against
    cuBLAS (``torch.mm`` on the same views), timed in turns."""
    rows = []
    for shape, (m, k, n), flops, dtype, g in _half_cases(shapes):
        x = torch.randn(m, k, device=g.device, generator=g).to(dtype)
        w = (torch.randn(n, k, device=g.device, generator=g) / k ** 0.5).to(dtype)
        dz = torch.randn(m, n, device=g.device, generator=g).to(dtype)
        operands = {"forward": (x, w.t()), "grad_input": (dz, w), "grad_weight": (dz.t(), x)}
        for product in products:
            a, b = operands[product]
            impls = {"ours": lambda a=a, b=b: G._half_matmul(a, b),
                     "cublas": lambda a=a, b=b: torch.mm(a, b)}
            row = {"shape": shape, "dtype": str(dtype).replace("torch.", ""), "layout": product}
            row.update(_timed_entries(impls, iters, flops,
                                      lambda c, a=a, b=b: _sampled_error(c, a, b)))
            row["ours vs cublas"] = row["cublas"]["median_ms"] / row["ours"]["median_ms"]
            print(f"{shape} {row['dtype']:9s} {product:11s} ours {row['ours']['median_ms']:.3f} ms"
                  f"  cuBLAS {row['cublas']['median_ms']:.3f} ms  x{row['ours vs cublas']:.3f}",
                  flush=True)
            rows.append(row)
    return rows


def float32_weight_run(shapes, iters: int):
    """The forward product of a linear layer under autocast, x_d W^T with a
    float32 W: our kernel that rounds W in registers
    (``G._linear_float32_weight``) against what autocast runs, W's cast then
    cuBLAS, and against cuBLAS alone on a cast made beforehand (the floor),
    timed in turns."""
    def impls_of(x, w, w_d):
        return {"cast + cublas": lambda: torch.mm(x, w.to(w_d.dtype).t()),
                "ours": lambda: G._linear_float32_weight(x, w),
                "cublas on a cast": lambda: torch.mm(x, w_d.t())}

    rows = _product_rows(shapes, iters, impls_of)
    for row in rows:
        base = row["cast + cublas"]["median_ms"]
        print(f"{row['shape']} {row['dtype']:9s} " + "  ".join(
            f"{name} {row[name]['median_ms']:.3f} ms (x{base / row[name]['median_ms']:.3f})"
            for name in ("cast + cublas", "ours", "cublas on a cast")), flush=True)
    return rows


def conv_wgrad_run(shapes, iters: int):
    """The weight gradient of problem 1's convolution (stride 1, no padding)
    in float16 and bfloat16, dz and x channels-last: our Hopper engine
    (``conv_wgrad_wgmma`` through ``_launch_wgrad``) against cuDNN's
    deterministic channels-last weight gradient (the training route's
    fallback), timed in turns, each row's TFLOP/s also as a share of
    cuBLAS's product at 8192^3 in its dtype (``ceiling``:
    ``harness.product_tflops``, this run's); error: relative
    (Frobenius) against float64."""
    import importlib
    conv = importlib.import_module("cupy_fused.ops.conv_bias_relu")
    peaks = {dtype: product_tflops(dtype) for dtype in (torch.float16, torch.bfloat16)}
    rows = []
    for shape in shapes:
        (n, cin, h, w), (cout, k) = (tuple(map(int, part.split("x"))) for part in shape.split("-"))
        flops = 2.0 * n * cout * cin * k * k * (h - k + 1) * (w - k + 1)
        for dtype in (torch.float16, torch.bfloat16):
            g = torch.Generator(device="cuda").manual_seed(n + cin + h + w + cout + k)
            cl = torch.channels_last
            x = torch.randn(n, cin, h, w, device="cuda", generator=g).to(dtype).contiguous(memory_format=cl)
            dz = torch.randn(n, cout, h - k + 1, w - k + 1, device="cuda", generator=g).to(dtype)
            dz = dz.contiguous(memory_format=cl)
            weight = torch.empty(cout, cin, k, k, device="cuda", dtype=dtype)
            want = torch.nn.grad.conv2d_weight(x.double(), weight.shape, dz.double())
            impls = {"ours": lambda: conv._launch_wgrad(dz, x, k, k),
                     "cudnn": lambda: conv._conv_backward(dz, x, weight, False, True)[1]}
            row = {"shape": shape, "dtype": str(dtype).replace("torch.", ""), "ceiling": peaks[dtype]}
            row.update(_timed_entries(impls, iters, flops,
                                      lambda c: float((c.double() - want).norm() / want.norm())))
            row["ours vs cudnn"] = row["cudnn"]["median_ms"] / row["ours"]["median_ms"]
            print(f"{shape} {row['dtype']:9s} ours {row['ours']['median_ms']:.3f} ms "
                  f"{row['ours']['tflops']:.0f} TF/s  cuDNN {row['cudnn']['median_ms']:.3f} ms "
                  f"{row['cudnn']['tflops']:.0f} TF/s  x{row['ours vs cudnn']:.3f}", flush=True)
            rows.append(row)
    return rows


def conv_wgrad_markdown(rows) -> str:
    lines = ["| shape (NxC_inxHxW-C_outxK) | dtype | ours ms | TFLOP/s (of ceiling) | cuDNN ms | TFLOP/s | "
             "ours vs cuDNN | error ours | error cuDNN |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        o, c = r["ours"], r["cudnn"]
        lines.append(f"| {r['shape']} | {r['dtype']} | {o['median_ms']:.3f} | {o['tflops']:.0f} "
                     f"({o['tflops'] / r['ceiling']:.0%}) | {c['median_ms']:.3f} | {c['tflops']:.0f} | "
                     f"{r['ours vs cudnn']:.3f}x | {o['error']:.1e} | {c['error']:.1e} |")
    ceilings = ", ".join(dict.fromkeys(f"{r['dtype']} {r['ceiling']:.0f}" for r in rows))
    return "\n".join(lines) + f"\n\nCeiling: cuBLAS's product at 8192^3 in this run, TFLOP/s: {ceilings}.\n"


def float32_weight_markdown(rows) -> str:
    names = ("cast + cublas", "ours", "cublas on a cast")
    lines = ["| shape (MxKxN) | dtype | " + " | ".join(f"{n} ms" for n in names)
             + " | ours vs cast + cuBLAS | error ours | error cuBLAS |",
             "|---|---|" + "---|" * len(names) + "---|---|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['dtype']} | " + " | ".join(
            f"{r[n]['median_ms']:.3f}" for n in names)
            + f" | {r['cast + cublas']['median_ms'] / r['ours']['median_ms']:.3f}x"
            f" | {r['ours']['error']:.1e} | {r['cublas on a cast']['error']:.1e} |")
    return "\n".join(lines) + "\n"


def half_markdown(rows) -> str:
    lines = ["| shape (MxKxN) | dtype | ours ms | TFLOP/s | cuBLAS ms | TFLOP/s | ours vs cuBLAS | "
             "error ours | error cuBLAS |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        o, c = r["ours"], r["cublas"]
        shape = f"{r['shape']} {r['layout']}" if "layout" in r else r["shape"]
        lines.append(f"| {shape} | {r['dtype']} | {o['median_ms']:.3f} | {o['tflops']:.0f} | "
                     f"{c['median_ms']:.3f} | {c['tflops']:.0f} | {r['ours vs cublas']:.3f}x | "
                     f"{o['error']:.1e} | {c['error']:.1e} |")
    return "\n".join(lines) + "\n"


def markdown(rows) -> str:
    lines = ["| shape (MxKxN) | product | ours 3xTF32 ms | TFLOP/s | cuBLAS SGEMM ms | TFLOP/s | "
             "speedup | ours TF32 ms | cuBLAS TF32 ms | error 3xTF32 | error SGEMM | error TF32 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        o, s, t, ct = r["ours 3xtf32"], r["cublas sgemm"], r["ours tf32"], r["cublas tf32"]
        lines.append(f"| {r['shape']} | {r['layout']} | {o['median_ms']:.3f} | {o['tflops']:.0f} | "
                     f"{s['median_ms']:.3f} | {s['tflops']:.0f} | {r['speedup 3xtf32 vs sgemm']:.2f}x | "
                     f"{t['median_ms']:.3f} | {ct['median_ms']:.3f} | {o['error']:.1e} | "
                     f"{s['error']:.1e} | {t['error']:.1e} |")
    tiles = [k[len("ours 3xtf32 on "):] for k in (rows[0] if rows else {}) if k.startswith("ours 3xtf32 on ")]
    if tiles:
        lines += ["", "| shape (MxKxN) | product | tile picked | " + " | ".join(
            f"{t} ms" for t in tiles) + " |", "|---|---|---|" + "---|" * len(tiles)]
        for r in rows:
            lines.append(f"| {r['shape']} | {r['layout']} | {r['tile']} | " + " | ".join(
                f"{r['ours 3xtf32 on ' + t]['median_ms']:.3f}" for t in tiles) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--tiles", nargs="*", default=[],
                   help="also time our 3xTF32 product on each of these tile kernels")
    p.add_argument("--json")
    p.add_argument("--md")
    p.add_argument("--accuracy", action="store_true",
                   help="also sweep the inner size for the error table")
    p.add_argument("--accuracy-sizes", nargs="+", default=["256x256"],
                   help="result sizes PxQ of the accuracy sweep")
    p.add_argument("--no-timing", action="store_true", help="only the accuracy sweep")
    p.add_argument("--half", action="store_true",
                   help="the float16 / bfloat16 forward on our Hopper engine against cuBLAS "
                        "(instead of the float32 products)")
    p.add_argument("--half-layouts", action="store_true",
                   help="the three products of a 16-bit linear layer (x W^T, dZ W, dZ^T x) on "
                        "our Hopper engine against cuBLAS")
    p.add_argument("--products", nargs="+", choices=list(PRODUCT_SIZES),
                   default=list(PRODUCT_SIZES), help="with --half-layouts: these products only")
    p.add_argument("--float32-weight", action="store_true",
                   help="the autocast forward x_d W^T with a float32 W: our converting kernel "
                        "against W's cast then cuBLAS (Hopper)")
    p.add_argument("--conv-wgrad", action="store_true",
                   help="problem 1's 16-bit weight gradient on our Hopper engine against cuDNN's")
    p.add_argument("--conv-shapes", nargs="+", default=list(DEFAULT_CONV_SHAPES),
                   help="with --conv-wgrad: convolutions NxC_inxHxW-C_outxK")
    p.add_argument("--small-outputs", action="store_true",
                   help="the error and time of the 3xTF32 kernel against SGEMM over outputs of "
                        "few tiles (the routing rule's data)")
    p.add_argument("--seeds", type=int, default=8, help="with --small-outputs: seeds a row")
    p.add_argument("--small-sizes", nargs="+", default=list(DEFAULT_SMALL_SIZES),
                   help="with --small-outputs: outputs MxN")
    p.add_argument("--small-ks", nargs="+", type=int, default=list(DEFAULT_SMALL_KS),
                   help="with --small-outputs: inner sizes")
    args = p.parse_args(argv)
    if args.small_outputs:
        rows = small_outputs_run(args.small_sizes, args.small_ks, seeds=args.seeds, iters=args.iters)
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                "seeds": args.seeds, "iters": args.iters,
                "sms": torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count,
                "SPLIT_K_INNER": G.SPLIT_K_INNER, "SPLIT_K_PER_TILE": G.SPLIT_K_PER_TILE,
                "SGEMM_AT_MOST_ROWS": G.SGEMM_AT_MOST_ROWS, "SGEMM_BELOW_INNER": G.SGEMM_BELOW_INNER,
                "SHORT_SUM_INNER": G.SHORT_SUM_INNER}
        write_outputs(args.json, args.md, "Small outputs", meta, {"small_outputs": rows},
                      small_outputs_markdown(rows))
        return
    if args.half or args.float32_weight or args.half_layouts or args.conv_wgrad:
        if args.conv_wgrad:
            key, markdown_ = "conv_wgrad", conv_wgrad_markdown
            run_ = functools.partial(conv_wgrad_run, args.conv_shapes)
        elif args.float32_weight:
            key, run_, markdown_ = "float32_weight", float32_weight_run, float32_weight_markdown
        elif args.half_layouts:
            key, markdown_ = "half_layouts", half_markdown
            run_ = functools.partial(half_layouts_run, products=args.products)
        else:
            key, run_, markdown_ = "half", half_run, half_markdown
        rows = run_(args.iters) if args.conv_wgrad else run_(args.shapes, args.iters)
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
        write_outputs(args.json, args.md, "16-bit GEMM", meta, {key: rows}, markdown_(rows))
        return
    if args.tiles and not args.no_timing:
        runnable = G.available_tiles(torch.cuda.current_device())
        if set(args.tiles) - set(runnable):
            p.error(f"--tiles: {sorted(set(args.tiles) - set(runnable))} cannot run on this GPU "
                    f"(it runs {', '.join(runnable)})")
    rows = [] if args.no_timing else run(args.shapes, args.iters, args.tiles)
    sizes = [tuple(map(int, s.split("x"))) for s in args.accuracy_sizes]
    accuracy = accuracy_sweep(sizes=sizes) if args.accuracy else []
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "python": platform.python_version(), "tiles": {k: vars(v) for k, v in G.TILES.items()}}
    md = markdown(rows)
    if accuracy:
        md += ("\n| result | product | k | data | error 3xTF32 | error SGEMM | error TF32 |\n"
               "|---|---|---|---|---|---|---|\n" +
               "".join(f"| {r['size']} | {r['layout']} | {r['k']} | "
                       f"{'x 2^±20' if r['spread'] else 'uniform'} | "
                       f"{r['3xtf32']:.1e} | {r['sgemm']:.1e} | {r['tf32']:.1e} |\n" for r in accuracy))
    write_outputs(args.json, args.md, "GEMM", meta, {"rows": rows, "accuracy": accuracy}, md)


if __name__ == "__main__":
    main()
