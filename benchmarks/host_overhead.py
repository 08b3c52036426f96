"""Per-call host cost of one fused elementwise op on a tiny tensor, against
torch's own elementwise op.

Each variant is called N times back to back on a 1024-element float32
tensor; the GPU work is a few microseconds, so the loop is bound by the host
and (wall time / N) is the host cost per call.  The variants take turns over
several rounds and each reports its best round.  Variants:

* torch           ``torch.add(y, x, alpha=a)`` — one torch elementwise op
* ours (eager)    ``cupy_fused.ops.scale_add`` — the path users call
* ours (custom op) ``torch.ops.cupy_fused.scale_add`` — the torch.library op
* naive DLPack    two ``cupy.from_dlpack`` + a fresh ``ExternalStream`` per call
* ours, no_grad / requires_grad — with autograd recording

The ratio of ours to torch is also measured in pairs (``harness.paired_ratios``):
many short rounds, each timing torch and ours back to back (in alternating
order), one ratio per round, reported as the median and quartiles over the
rounds.  Best-of-rounds times drift between runs of the same code on one
machine (docs/performance.md, Method); a ratio of two times taken within a
few milliseconds of each other is what the host's drift leaves alone.

Usage: python benchmarks/host_overhead.py [--calls 20000] [--pairs 101] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

# The library of this tree, and benchmarks/ itself when loaded by path.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import paired_ratios, per_call_us  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--pairs", type=int, default=101,
                        help="rounds of the paired ratio measurement (0: skip it)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    import cupy

    from cupy_fused import ops
    from cupy_fused.ops.scale_add import KERNELS

    x = torch.rand(1024, device="cuda")
    y = torch.rand(1024, device="cuda")
    xg = x.clone().requires_grad_(True)
    fn = KERNELS.get(torch.float32, 0).raw

    def naive():
        a = cupy.from_dlpack(x)
        b = cupy.from_dlpack(y)
        out = torch.empty_like(x)
        o = cupy.from_dlpack(out)
        stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
        fn((4,), (256,), (a, b, o, 0.5, a.size), stream=stream)
        return out

    variants = {
        "torch.add (one torch elementwise op)": lambda: torch.add(y, x, alpha=0.5),
        "cupy_fused.ops.scale_add (eager)": lambda: ops.scale_add(x, y, 0.5),
        "torch.ops.cupy_fused.scale_add (custom op)": lambda: torch.ops.cupy_fused.scale_add(x, y, 0.5),
        "naive DLPack launch": naive,
        "torch.add, input requires grad": lambda: torch.add(y, xg, alpha=0.5),
        "cupy_fused.ops.scale_add, input requires grad": lambda: ops.scale_add(xg, y, 0.5),
    }
    # Pieces of the eager path, to see where the time goes.
    from cupy_fused import _bridge
    from cupy_fused._autograd import is_compiling
    from cupy_fused._validation import check_finite_scalar, check_pair
    from cupy_fused.ops.scale_add import _forward

    kernel = KERNELS.get(torch.float32, 0)
    ops.scale_add(x, y, 0.5)  # first launch: fixes the kernel's parameter layout
    # The direct launches below read their own parameter buffer, packed once
    # with live pointers (out = x), as is and as one buffer through
    # cuLaunchKernel's `extra` (BUFFER_POINTER, buffer, BUFFER_SIZE, &size, END).
    import ctypes

    ptrs = (x.data_ptr(), y.data_ptr(), x.data_ptr(), 0.5, 1024)
    own = _bridge._ParamBuffer()
    kernel.params.pack_into(own.data, 0, *ptrs)
    buffer_size = ctypes.c_size_t(kernel.params.size)
    extra = (ctypes.c_void_p * 5)(1, ctypes.addressof(own.data), 2, ctypes.addressof(buffer_size), 0)
    extra_ptr = ctypes.addressof(extra)
    stream = torch.cuda.current_stream().cuda_stream
    variants.update({
        "  piece: torch.empty_like": lambda: torch.empty_like(x),
        "  piece: torch x.neg_() (a torch op, no allocation)": lambda: x.neg_(),
        "  piece: _bridge.launch (packed args)": lambda: _bridge.launch(kernel, (4, 1, 1), 256, ptrs, 0),
        "  piece: forward (alloc + launch)": lambda: _forward(x, y, 0.5),
        "  piece: cuLaunchKernel via CuPy driver": lambda: cupy.cuda.driver.launchKernel(
            kernel.ptr, 4, 1, 1, 256, 1, 1, 0, stream, own.params_ptr, 0),
        "  piece: current raw stream": lambda: _bridge.current_stream_ptr(0),
        "  piece: validation (x, y, alpha)": lambda: (
            check_pair("x", x, "y", y), check_finite_scalar("alpha", 0.5)),
        "  piece: torch.compiler.is_compiling": is_compiling,
        "  piece: cuLaunchKernel, parameters as one buffer (extra)": lambda: cupy.cuda.driver.launchKernel(
            kernel.ptr, 4, 1, 1, 256, 1, 1, 0, stream, 0, extra_ptr),
        "  piece: CuPy-array check (isinstance)": lambda: isinstance(x, torch.Tensor),
        "  piece: cupy getDevice": cupy.cuda.runtime.getDevice,
        "  piece: parameter packing": lambda: kernel.params.pack_into(own.data, 0, *ptrs),
    })
    results = per_call_us(variants, args.calls)
    base = results["torch.add (one torch elementwise op)"]
    base_grad = results["torch.add, input requires grad"]
    print(f"host cost per call, tiny tensor ({torch.cuda.get_device_name()}, torch "
          f"{torch.__version__}, CuPy {cupy.__version__})")
    for name, us in results.items():
        ref = base_grad if "grad" in name else base
        print(f"  {name:<48} {us:7.2f} us   {us / ref:5.2f}x torch")
    paired = {}
    if args.pairs:
        pairs = {
            "scale_add / torch.add": (variants["torch.add (one torch elementwise op)"],
                                      variants["cupy_fused.ops.scale_add (eager)"]),
            "scale_add / torch.add, input requires grad": (
                variants["torch.add, input requires grad"],
                variants["cupy_fused.ops.scale_add, input requires grad"]),
        }
        print(f"paired rounds ({args.pairs} rounds of 2000 calls each, back to back):")
        for name, (base_fn, ours_fn) in pairs.items():
            p = paired[name] = paired_ratios(base_fn, ours_fn, rounds=args.pairs)
            print(f"  {name:<48} median {p['median_ratio']:.3f}x (quartiles {p['q1']:.3f}-"
                  f"{p['q3']:.3f}); median us/call {p['base_us']:.2f} torch, {p['other_us']:.2f} ours")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "us_per_call": results,
                       "paired": paired}, f, indent=1)


if __name__ == "__main__":
    main()
