"""Usage: python scripts/sanitize.py [fp32 fp16 bf16] [--only SECTION ...]

Small-shape run of every fused op, forward and backward, in all three
dtypes (in float16 / bfloat16 also the eager-rounding GroupNorm kernels and
the five models under autocast): the workload scripts/gpu_check.sh runs
under compute-sanitizer (memcheck, racecheck).  Its sections (SECTIONS)
run in turn, or those named after --only, each printing its time:
gpu_check.sh runs racecheck one section at a time, so that a section slow
under it cannot keep the others from being checked."""
import argparse
import importlib
import sys
import time

import torch

from cupy_fused import _runtime, ops, reference
from cupy_fused.ops import gemm as G
from cupy_fused.testing import compare, poison_allocator, rel_error, worse_than_eager

CB = importlib.import_module("cupy_fused.ops.conv_bias_relu")
# The engine's kernels at the small shapes below, which its routing rule
# sends to cuDNN (_engine_pays: the rule is measured, not checked, here).
CB._engine_pays = lambda *args: True
# Problem 1's convolution (n, C_in, H, W, C_out, KH, KW): ragged widths,
# output channels past one tile, an odd output width; W a multiple of 8 (an
# NCHW x read with no copy: the NCHW band kernel, and where its bands are
# longer than one pixel tile, rows kept from one pixel tile to the next, 3
# tiles of output channels, and with 2 column tiles, within each column
# strip), KW 3 and 5, and KW 9 (wider than the window kernels: the per-tap
# kernel).
CONV_SHAPES = ((2, 64, 9, 10, 40, 3, 3), (1, 8, 5, 140, 136, 5, 3), (3, 16, 11, 14, 24, 2, 2),
               (2, 16, 7, 24, 72, 3, 3), (1, 8, 6, 16, 24, 2, 5), (1, 8, 4, 40, 16, 2, 9),
               (30, 16, 15, 24, 136, 3, 3), (40, 16, 12, 136, 64, 3, 3))


def conv_inputs(shape, dtype):
    """x, weight, conv bias and bias of a CONV_SHAPES entry, random, on the GPU."""
    n, cin, h, w, cout, kh, kw = shape
    x = torch.randn(n, cin, h, w, device="cuda", dtype=dtype)
    wt = torch.randn(cout, cin, kh, kw, device="cuda", dtype=dtype) / (cin * kh * kw) ** 0.5
    cb, b = (torch.randn(cout, device="cuda", dtype=dtype) for _ in range(2))
    return x, wt, cb, b


NAMES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
failed = []


def models(dtypes):
    """Each model, forward and backward, against eager (both gradient modes)."""
    for dtype in dtypes:
        cases = list(reference.SMALL_PROBLEMS.items()) + [
            (37, (None, (8, 600, 1, (600,)), (3, 8))),     # wide-group path
            (88, (None, (8, 40, 40, (40,)), (5, 8))),      # one channel per group
            (76, (None, (8, 77, (77,)), (3, 8))),          # mask tail
            (37, (None, (8, 135, 3, (135,)), (5, 8))),     # 45 per group: a forward team's tail
            (94, (None, (8, 256, (256,), 2), (3, 8))),     # 128 per group
        ]
        for problem, (_, args, shape) in cases:
            for mode in ("random", "sum"):
                errors = compare(problem, args, shape, dtype, "cuda", grad_mode=mode)
                bad = worse_than_eager(errors, dtype)
                print(problem, dtype, mode, "OK" if not bad else f"WORSE {bad}", flush=True)
                failed.extend(bad)


def gemm(dtypes):
    """The float32 GEMM kernel family directly (float32 only)."""
    if torch.float32 in dtypes:
        # The GEMM kernel family directly: every tile kernel this device runs
        # (the wgmma one on compute capability 9.0), every layout, both pass
        # counts, ragged edges, and the word-load variant (an operand whose rows
        # are not 16-byte aligned); each result against float64.  The 16-byte
        # tile kernels need sizes that are multiples of 4 (the library checks
        # that before choosing them).
        from cupy_fused.testing import scaled_gemm_error

        gen = torch.Generator(device="cuda").manual_seed(0)
        for m, k, n in ((4, 4, 4), (68, 44, 132), (200, 40, 260)):
            for layout, (a_kmajor, b_kmajor) in G.LAYOUTS.items():
                a = torch.rand((m, k) if a_kmajor else (k, m), device="cuda", generator=gen)
                b = torch.rand((n, k) if b_kmajor else (k, n), device="cuda", generator=gen)
                a_unaligned = torch.empty(a.numel() + 1, device="cuda")[1:].view_as(a).copy_(a)
                ref = {"forward": lambda a, b: a @ b.t(), "grad_input": lambda a, b: a @ b,
                       "grad_weight": lambda a, b: a.t() @ b}[layout]
                for passes in (1, 3):
                    outs = {"word loads": G._gemm(a_unaligned, b, layout, passes)}
                    for name in G.available_tiles(0):
                        outs[name] = G._gemm_on_tile(
                            a, b, layout, passes, name,
                            out=torch.full((m, n), float("nan"), device="cuda"))
                    for name, out in outs.items():
                        err = scaled_gemm_error(out, a, b, ref)
                        ok = err <= (2.0 ** -20 if passes == 3 else 2e-3)
                        print("gemm", name, layout, (m, k, n), passes, "OK" if ok else f"ERROR {err}",
                              flush=True)
                        failed.extend([] if ok else [f"gemm {name} {layout} {(m, k, n)}"])


def eager_rounding(dtypes):
    """The eager-rounding GroupNorm kernels (16-bit dtypes only)."""
    for dtype in (d for d in dtypes if d != torch.float32):
        # The eager-rounding GroupNorm kernels, forward and
        # backward, on the same group shapes as the models above: wide groups,
        # one channel per group, a ragged count; output against eager's chain in
        # the same dtype (KernelBench's 1e-2 check).
        import torch.nn.functional as F

        gen = torch.Generator(device="cuda").manual_seed(1)
        for rows, channels, groups in ((5, 600, 1), (3, 40, 40), (7, 96, 6)):
            z = (torch.randn(rows, channels, device="cuda", generator=gen) + 1).to(dtype)
            bias, w, b, mw = (torch.randn(channels, device="cuda", generator=gen).to(dtype)
                              for _ in range(4))
            for chain in ops.CHAINS:
                kw = dict(gn_weight=w, gn_bias=b, linear_bias_in_z=True, eager_rounding=True)
                if chain == "gn_swish_mul_swish":
                    kw["mul_weight"] = mw
                    g = F.group_norm(z, groups, w, b)
                    m = g * torch.sigmoid(g) * mw
                    eager = m * torch.sigmoid(m)
                else:
                    kw["extra_bias"] = bias
                    pre = (torch.sigmoid(z) * z + bias if chain == "swish_bias_gn"
                           else F.mish(F.hardtanh(z + bias)))
                    eager = F.group_norm(pre, groups, w, b)
                zz = z.clone().requires_grad_(True)
                out = ops.gn_chain(zz, chain, groups, **kw)
                out.backward(torch.randn_like(out))
                ok = (torch.allclose(out, eager, atol=1e-2, rtol=1e-2)
                      and bool(torch.isfinite(zz.grad).all()))
                print("eager_rounding", chain, dtype, (rows, channels, groups), "OK" if ok else "ERROR",
                      flush=True)
                failed.extend([] if ok else [f"eager_rounding {chain} {dtype} {(rows, channels, groups)}"])


def non_finite_gradient(dtypes):
    """The GroupNorm chains' backward with NaN and +-inf in the upstream
    gradient: the exact walks (gn_chain.cuh) of the vectorised, in-register
    and wide-group kernels, which no finite run reaches."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    for dtype in dtypes:
        for rows, channels, groups in ((9, 256, 4), (7, 60, 6), (5, 600, 1)):
            z = torch.randn(rows, channels, device="cuda", generator=gen).to(dtype)
            bias, w, b, mw = (torch.randn(channels, device="cuda", generator=gen).to(dtype)
                              for _ in range(4))
            for chain in ops.CHAINS:
                kw = {"gn_weight": w, "gn_bias": b, "linear_bias_in_z": True}
                if chain == "gn_swish_mul_swish":
                    kw["mul_weight"] = mw
                else:
                    kw["extra_bias"] = bias
                zz = z.clone().requires_grad_(True)
                out = ops.gn_chain(zz, chain, groups, **kw)
                g = torch.randn(out.shape, device="cuda", generator=gen).to(out.dtype)
                g[1, 3], g[2, 5], g[4, 7] = float("nan"), float("inf"), -float("inf")
                out.backward(g)
                # rows 1, 2 and 4 of the input gradient: NaN or +-inf in the
                # groups of those channels; every other row finite
                bad = ~torch.isfinite(zz.grad)
                hit = torch.zeros(rows, dtype=torch.bool, device="cuda")
                hit[[1, 2, 4]] = True
                ok = bool(bad[hit].any(dim=1).all()) and not bad[~hit].any()
                what = f"non_finite_gradient {chain} {dtype} {(rows, channels, groups)}"
                print(what, "OK" if ok else "ERROR", flush=True)
                failed.extend([] if ok else [what])


def half_engine(dtypes):
    """The Hopper 16-bit GEMM engine directly (16-bit dtypes only)."""
    if G.has_wgmma(0):
        # The Hopper 16-bit GEMM engine directly: the plain product (TMA store,
        # and the register store of a C whose rows TMA cannot address), the
        # product with a float32 weight, and the
        # one-launch GEMM + GroupNorm chains (every chain, groups of 8 to 128
        # channels, ragged rows and columns, saving the backward's tensors or
        # not), into NaN-poisoned outputs, against cuBLAS and the two-launch route.
        from cupy_fused.ops.gn_chain import CHAINS, _launch_forward

        LG = importlib.import_module("cupy_fused.ops.linear_gn_chain")
        for dtype in (d for d in dtypes if d != torch.float32):
            for m, k, n in ((3, 64, 136), (130, 72, 260), (257, 200, 250)):
                x = torch.randn(m, k, device="cuda", dtype=dtype)
                w = torch.randn(n, k, device="cuda", dtype=dtype) / k ** 0.5
                bias = torch.randn(n, device="cuda", dtype=dtype)
                y = G._half_linear(x, w, bias, 1, out=torch.full((m, n), float("nan"), device="cuda",
                                                                 dtype=dtype))
                ok = torch.allclose(y.float(), torch.addmm(bias, x, w.t()).relu().float(),
                                    atol=3e-2, rtol=3e-2)
                print("half gemm", dtype, (m, k, n), "OK" if ok else "ERROR", flush=True)
                failed.extend([] if ok else [f"half gemm {dtype} {(m, k, n)}"])
                # The product with a float32 weight rounded in the kernel (its
                # tile 128 rows of W x 256 of x: ragged here on both sides).
                w32 = torch.randn(n - n % 8, k, device="cuda") / k ** 0.5
                poison_allocator("cuda", 2 * m * n)  # (its output is allocated inside)
                y = G._linear_float32_weight(x, w32, bias[:n - n % 8])
                ok = torch.allclose(y.float(), torch.addmm(bias[:n - n % 8], x, w32.to(dtype).t()).float(),
                                    atol=3e-2, rtol=3e-2)
                print("float32-weight gemm", dtype, (m, k, n - n % 8), "OK" if ok else "ERROR", flush=True)
                failed.extend([] if ok else [f"float32-weight gemm {dtype} {(m, k, n - n % 8)}"])
            for m, k, n, groups in ((3, 64, 136, 17), (130, 64, 256, 2), (129, 72, 384, 12),
                                    (66, 64, 256, 4)):
                x = torch.randn(m, k, device="cuda", dtype=dtype)
                w = torch.randn(n, k, device="cuda", dtype=dtype) / k ** 0.5
                vecs = [torch.rand(n, device="cuda", dtype=dtype) + 0.5 for _ in range(5)]
                for chain in CHAINS:
                    for save in (True, False):
                        y, z, stats = LG._launch_fused_half(
                            x, w, *vecs, chain, groups, 1e-5, save,
                            y=torch.full((m, n), float("nan"), device="cuda", dtype=dtype))
                        want = _launch_forward(torch.addmm(vecs[0], x, w.t()), vecs[0], *vecs[1:],
                                               chain, groups, 1e-5, False, True)[0]
                        ok = torch.allclose(y.float(), want.float(), atol=5e-2, rtol=5e-2)
                        print("linear_gn_chain", chain, dtype, (m, k, n, groups), save,
                              "OK" if ok else "ERROR", flush=True)
                        failed.extend([] if ok else [f"linear_gn_chain {chain} {dtype} {(m, k, n)}"])
                    if n // groups not in LG.HALF_FLOAT_OUT_GROUP_SIZES:
                        continue
                    # float32 output and vectors (autocast), from the same z
                    vf = [vecs[0]] + [v.float() for v in vecs[1:]]
                    y32, z, _ = LG._launch_fused_half(x, w, *vf, chain, groups, 1e-5, True,
                                                      y=torch.full((m, n), float("nan"), device="cuda"),
                                                      float_out=True)
                    want = _launch_forward(z, None, *vf[1:], chain, groups, 1e-5, False, True,
                                           float_out=True)[0]
                    # (a split Pre's y is normalised from its first step
                    # rounded to the 16-bit dtype)
                    tol = 5e-2 if chain in LG._SPLIT_PRE_CHAINS else 1e-4
                    ok = torch.allclose(y32, want, atol=tol, rtol=tol)
                    # The same on one block, which walks every tile: each staging
                    # area is handed to the store's warpgroup and back again.
                    sm_count, G.sm_count = G.sm_count, lambda dev: 1
                    try:
                        y1, _, _ = LG._launch_fused_half(x, w, *vf, chain, groups, 1e-5, True, float_out=True)
                    finally:
                        G.sm_count = sm_count
                    ok = ok and torch.equal(y1, y32)
                    print("linear_gn_chain float32 out", chain, dtype, (m, k, n, groups),
                          "OK" if ok else "ERROR", flush=True)
                    failed.extend([] if ok else [f"linear_gn_chain float32 out {chain} {dtype} {(m, k, n)}"])


def conv(dtypes):
    """Problem 1's convolution, inference, on the engine (Hopper)."""
    if not G.has_wgmma(0):
        return
    # Problem 1's implicit-GEMM convolution (conv_bias_relu), inference: an
    # NCHW input (read as it is where W is a multiple of 8, else through its
    # channels-last copy; y NCHW through the staging rows) and a
    # channels-last one (y through the copy engine; float32: x's rows
    # rounded to TF32 in shared memory by the TF32 band kernel where C_in is
    # at most 64 and KH 3, else x's copy rounded to TF32 first).
    for dtype in dtypes:
        for shape in CONV_SHAPES:
            x, wt, cb, b = conv_inputs(shape, dtype)
            want = (torch.relu(torch.nn.functional.conv2d(x.float(), wt.float(), cb.float()))
                    + b.float().view(-1, 1, 1))
            for fmt in (torch.contiguous_format, torch.channels_last):
                xf = x.contiguous(memory_format=fmt)
                out = torch.full(want.shape, float("nan"), device="cuda", dtype=dtype)
                layout = CB.CHANNELS_LAST if fmt == torch.channels_last else CB.NCHW
                with torch.no_grad():  # (float32 below ENGINE_FLOAT32_MIN_ELEMENTS: the plan given)
                    y = CB._launch_engine(xf, wt, cb, b, out=out.contiguous(memory_format=fmt),
                                          plan=(layout, dtype, dtype, False))
                ok = torch.allclose(y.float(), want, atol=5e-2, rtol=5e-2)
                print("conv_bias_relu", dtype, fmt, shape, "OK" if ok else "ERROR", flush=True)
                failed.extend([] if ok else [f"conv_bias_relu {dtype} {fmt} {shape}"])
            if dtype == torch.float32:
                continue
            # Under autocast: float32 x and parameters, float32 y in x's layout.
            for fmt in (torch.contiguous_format, torch.channels_last):
                with torch.no_grad(), torch.autocast("cuda", dtype=dtype):
                    out = torch.full(want.shape, float("nan"), device="cuda").contiguous(memory_format=fmt)
                    y = CB._launch_engine(x.float().contiguous(memory_format=fmt), wt.float(), cb.float(),
                                          b.float(), out=out)
                ok = torch.allclose(y, want, atol=5e-2, rtol=5e-2)
                print("conv_bias_relu autocast", dtype, fmt, shape, "OK" if ok else "ERROR", flush=True)
                failed.extend([] if ok else [f"conv_bias_relu autocast {dtype} {fmt} {shape}"])
    # C_in not a multiple of 8: x and the weight padded with zero channels,
    # NCHW and channels-last (float32: TF32, its size threshold lifted).
    torch.backends.cudnn.allow_tf32 = True  # (PyTorch's default)
    for dtype in dtypes:
        x, wt, cb, b = conv_inputs((2, 3, 9, 140, 16, 3, 3), dtype)
        want = (torch.relu(torch.nn.functional.conv2d(x.float(), wt.float(), cb.float()))
                + b.float().view(-1, 1, 1))
        for fmt in (torch.contiguous_format, torch.channels_last):
            xf = x.contiguous(memory_format=fmt)
            keep, CB.ENGINE_FLOAT32_MIN_ELEMENTS = CB.ENGINE_FLOAT32_MIN_ELEMENTS, 0
            try:
                with torch.no_grad():
                    ok = CB.route(xf, wt, cb, b) == "engine"
                    y = ops.conv_bias_relu(xf, wt, cb, b)
            finally:
                CB.ENGINE_FLOAT32_MIN_ELEMENTS = keep
            ok = ok and torch.allclose(y.float(), want, atol=5e-2, rtol=5e-2)
            print("conv_bias_relu padded channels", dtype, fmt, "OK" if ok else "ERROR", flush=True)
            failed.extend([] if ok else [f"conv_bias_relu padded channels {dtype} {fmt}"])


def conv_training(dtypes):
    """Problem 1's training routes (Hopper)."""
    # The conv training route's channels-last backward (its size threshold
    # lifted; float32 with TF32 allowed too), taken on a compute capability 9.0
    # GPU only: the transposing copies both ways around cuDNN (two of them a
    # step: dz comes channels-last from bias_relu's backward), against the
    # same step through cuDNN's NCHW backward.
    if _runtime.device_capability(0) == (9, 0):
        BR = importlib.import_module("cupy_fused.ops.bias_relu")
        copies = []
        transposed, blocks_per_sm = CB._transposed, BR._TO_NHWC_BLOCKS_PER_SM
        CB._transposed = lambda *a, **k: copies.append(1) or transposed(*a, **k)
        BR._TO_NHWC_BLOCKS_PER_SM = 0  # one block per channel tile, looping over every tile
        try:
            for dtype in dtypes:
                for shape in CONV_SHAPES:
                    x, wt, cb, b = conv_inputs(shape, dtype)
                    n, _, h, w, cout, kh, kw = shape
                    g = torch.randn(n, cout, h - kh + 1, w - kw + 1, device="cuda", dtype=dtype)
                    grads, took = [], True
                    for lift in (True, False):
                        copies.clear()
                        keep = CB.CL_BACKWARD_MIN_ELEMENTS
                        CB.CL_BACKWARD_MIN_ELEMENTS = 0 if lift else 2**62
                        try:
                            leaves = [t.detach().clone().requires_grad_(True) for t in (x, wt, cb, b)]
                            ops.conv_bias_relu(*leaves).backward(g)
                        finally:
                            CB.CL_BACKWARD_MIN_ELEMENTS = keep
                        grads.append([t.grad.float() for t in leaves])
                        took &= len(copies) == (2 if lift else 0)
                    ok = took and all((a - r).abs().max() <= 1e-2 * r.abs().max() for a, r in zip(*grads))
                    print("conv_bias_relu channels-last backward", dtype, shape, "OK" if ok else "ERROR",
                          flush=True)
                    failed.extend([] if ok else [f"conv_bias_relu channels-last backward {dtype} {shape}"])
        finally:
            CB._transposed, BR._TO_NHWC_BLOCKS_PER_SM = transposed, blocks_per_sm
        # The engine's training forward (its size thresholds lifted; float32 as
        # TF32): y and relu's mask from the store, then the channels-last
        # backward on x's copy; each step against float64 (float32: on the
        # TF32-rounded x and weight), beside the same step on the cudnn route.
        # (The last shapes from a channels-last x: C_out a multiple of 32; and
        # C_in of 3, padded with zero channels, from both layouts.)
        torch.backends.cudnn.allow_tf32 = True  # (PyTorch's default)
        for dtype in dtypes:
            for shape, fmt in ([(shape, torch.contiguous_format) for shape in CONV_SHAPES]
                               + [((2, 8, 9, 70, 32, 3, 3), torch.channels_last),
                                  ((2, 3, 9, 70, 32, 3, 3), torch.contiguous_format),
                                  ((2, 3, 9, 70, 32, 3, 3), torch.channels_last)]):
                x, wt, cb, b = conv_inputs(shape, dtype)
                x = x.contiguous(memory_format=fmt)
                n, _, h, w, cout, kh, kw = shape
                if cout % 8:
                    continue  # the cudnn route's (the channels-last backward needs C_out % 8 == 0)
                g = torch.randn(n, cout, h - kh + 1, w - kw + 1, device="cuda", dtype=dtype)
                src = (CB._tf32(x), CB._tf32(wt)) if dtype == torch.float32 else (x, wt)
                ref = [t.detach().double().requires_grad_(True) for t in (*src, cb, b)]
                want = torch.relu(torch.nn.functional.conv2d(*ref[:3])) + ref[3].reshape(-1, 1, 1)
                want.backward(g.double())
                want = [want] + [t.grad for t in ref]
                steps = []
                for threshold in (0, 2**62):
                    keep = (CB.ENGINE_TRAINING_MIN_ELEMENTS, CB.ENGINE_FLOAT32_MIN_ELEMENTS,
                            CB.CL_BACKWARD_MIN_ELEMENTS)
                    CB.ENGINE_TRAINING_MIN_ELEMENTS = CB.ENGINE_FLOAT32_MIN_ELEMENTS = threshold
                    # (float32: the cudnn route's backward through the same
                    # channels-last cuDNN calls, TF32 where its NCHW ones are not)
                    CB.CL_BACKWARD_MIN_ELEMENTS = 0 if dtype == torch.float32 else keep[2]
                    try:
                        leaves = [t.detach().clone().requires_grad_(True) for t in (x, wt, cb, b)]
                        route = CB.route(*leaves)
                        y = ops.conv_bias_relu(*leaves)
                        y.backward(g)
                    finally:
                        (CB.ENGINE_TRAINING_MIN_ELEMENTS, CB.ENGINE_FLOAT32_MIN_ELEMENTS,
                         CB.CL_BACKWARD_MIN_ELEMENTS) = keep
                    got = [y] + [t.grad for t in leaves]
                    steps.append((route, [rel_error(a, r) for a, r in zip(got, want)]))
                (r0, ours), (r1, theirs) = steps
                # Each against float64: the cudnn route rounds the convolution
                # before conv_bias is added (as eager does), so relu's mask
                # differs from float64's where the sum is near 0; the engine
                # rounds once.  A float32 step's input and weight gradients hold
                # at least a TF32 product's error (float64 on g rounded to TF32
                # too: dz as the TF32 input gradient reads it), which cuDNN's
                # float32 weight gradient at these sizes need not show.
                floor = [0.0] * 5
                if dtype == torch.float32:
                    tf32 = [t.detach().double().requires_grad_(True) for t in (*src, cb, b)]
                    y64 = torch.relu(torch.nn.functional.conv2d(*tf32[:3])) + tf32[3].reshape(-1, 1, 1)
                    y64.backward(CB._tf32(g).double())
                    floor[1:3] = [rel_error(t.grad, r) for t, r in zip(tf32[:2], want[1:3])]
                ok = (r0, r1) == ("engine", "cudnn") and all(
                    a <= 1.5 * max(r, f) + torch.finfo(dtype).eps for a, r, f in zip(ours, theirs, floor))
                print("conv_bias_relu engine training", dtype, fmt, shape, "OK" if ok else "ERROR",
                      flush=True)
                failed.extend([] if ok else [f"conv_bias_relu engine training {dtype} {fmt} {shape}"])
        # Under autocast from a channels-last float32 x (the window kernel's
        # float32 y, the input gradient's float32 dx from its kernel): the
        # engine's step beside the cudnn route's.
        for amp in (d for d in dtypes if d != torch.float32):
            shape = (2, 8, 9, 70, 32, 3, 3)
            x, wt, cb, b = conv_inputs(shape, torch.float32)
            x = x.contiguous(memory_format=torch.channels_last)
            n, _, h, w, cout, kh, kw = shape
            g = torch.randn(n, cout, h - kh + 1, w - kw + 1, device="cuda").contiguous(
                memory_format=torch.channels_last)
            # float64 on autocast's casts of x and the weight
            ref = [t.detach().double().requires_grad_(True) for t in (x.to(amp), wt.to(amp), cb, b)]
            want = torch.relu(torch.nn.functional.conv2d(*ref[:3])) + ref[3].reshape(-1, 1, 1)
            want.backward(g.double())
            want = [want] + [t.grad for t in ref]
            steps = []
            for threshold in (0, 2**62):
                keep = CB.ENGINE_TRAINING_MIN_ELEMENTS
                CB.ENGINE_TRAINING_MIN_ELEMENTS = threshold
                try:
                    leaves = [t.detach().clone().requires_grad_(True) for t in (x, wt, cb, b)]
                    with torch.autocast("cuda", dtype=amp):
                        route = CB.route(*leaves)
                        y = ops.conv_bias_relu(*leaves)
                    y.backward(g)
                finally:
                    CB.ENGINE_TRAINING_MIN_ELEMENTS = keep
                steps.append((route, [(t.dtype, rel_error(t, r)) for t, r in
                                      zip([y] + [t.grad for t in leaves], want)]))
            (r0, ours), (r1, theirs) = steps
            ok = (r0, r1) == ("engine", "cudnn") and all(
                a[0] == r[0] and a[1] <= 1.5 * r[1] + torch.finfo(amp).eps for a, r in zip(ours, theirs))
            print("conv_bias_relu engine training autocast", amp, shape, "OK" if ok else "ERROR", flush=True)
            failed.extend([] if ok else [f"conv_bias_relu engine training autocast {amp} {shape}"])


def autocast(dtypes):
    """The five models under autocast (16-bit dtypes only)."""
    for amp in (d for d in dtypes if d != torch.float32):
        # Autocast: the mixed-dtype kernels (gn_chain's float32 output, bias_relu's half z
        # with float32 biases) through the five models, float32 model and input.
        for problem, (_, args, shape) in reference.SMALL_PROBLEMS.items():
            errors = compare(problem, args, shape, torch.float32, "cuda", autocast=amp)
            bad = worse_than_eager(errors, amp)
            print("autocast", problem, amp, "OK" if not bad else f"WORSE {bad}", flush=True)
            failed.extend(bad)


SECTIONS = {"models": models, "gemm": gemm, "eager_rounding": eager_rounding,
            "non_finite_gradient": non_finite_gradient, "half_engine": half_engine,
            "conv": conv, "conv_training": conv_training, "autocast": autocast}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dtypes", nargs="*", metavar="DTYPE",
                        help="of " + ", ".join(NAMES) + " (default: all three)")
    parser.add_argument("--only", nargs="+", choices=list(SECTIONS), default=list(SECTIONS),
                        metavar="SECTION", help="the sections to run, of: " + ", ".join(SECTIONS))
    args = parser.parse_args()
    unknown = [a for a in args.dtypes if a not in NAMES]
    if unknown:
        parser.error(f"unknown dtype {unknown[0]!r}: choose from " + ", ".join(NAMES))
    dtypes = [NAMES[a] for a in args.dtypes] or list(NAMES.values())
    for section in args.only:
        start = time.perf_counter()
        SECTIONS[section](dtypes)
        print(f"section {section}: {time.perf_counter() - start:.1f} s", flush=True)
    sys.exit(1 if failed else 0)
