"""Problem 76's training step three ways besides eager and ours, to see what
a path without a Python autograd node would gain and cost: the step built
from native ops only (``relu(linear(x) + b)``, ``addmm(b, x, W^T).relu_()``)
and a trivial step (``(2 * x).sum().backward()``, the floor of any step:
the autograd engine's round trip and the harness).  Per variant: the
host's issue time (no synchronisation in the loop), the GPU time with the
host queued ahead (a sleep kernel holds the GPU while the host issues the
steps), the wall time, at the benchmark shape the peak memory above
parameters and inputs, and the caching allocator's cudaMalloc/cudaFree
calls during the timed steps (a cudaFree waits for the GPU, so a step
that makes them is not paced by the host alone).  The variants take turns
over 7 rounds; medians.

    python scripts/native_variants.py fp16,bf16 [small]
"""
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from cupy_fused import reference
from cupy_fused.testing import build_pair

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def variants(ref, ours):
    weight, bias = ref.gemm.weight, ref.bias
    return {
        "eager (reference)": ref,
        "ours": ours,
        "native relu(linear(x) + b)": lambda x: torch.relu(F.linear(x, weight) + bias),
        "native addmm(b, x, W^T).relu_()": lambda x: torch.addmm(bias, x, weight.t()).relu_(),
        "trivial (2 * x)": lambda x: x * 2.0,
    }


def _device_mallocs() -> int:
    """cudaMalloc + cudaFree calls of torch's caching allocator so far."""
    stats = torch.cuda.memory_stats()
    return stats.get("num_device_alloc", 0) + stats.get("num_device_free", 0)


def measure(dtype, table, label, steps=30, rounds=7):
    _, args, shape = table[76]
    ref, ours = build_pair(76, args, "cuda", dtype)
    x = torch.rand(shape, device="cuda", dtype=dtype, requires_grad=True)
    params = list(ref.parameters()) + list(ours.parameters())

    def make_step(f):
        def step():
            for p in params:
                p.grad = None
            x.grad = None
            f(x).sum().backward()
        return step

    fns = {name: make_step(f) for name, f in variants(ref, ours).items()}
    for fn in fns.values():
        for _ in range(5):
            fn()
    torch.cuda.synchronize()
    res = {name: {"host": [], "wall": [], "gpu": [], "mallocs": 0} for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            torch.cuda.synchronize()
            mallocs = _device_mallocs()
            t0 = time.perf_counter()
            for _ in range(steps):
                fn()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            res[name]["host"].append((t1 - t0) / steps * 1e6)
            res[name]["wall"].append((t2 - t0) / steps * 1e6)
            res[name]["mallocs"] += _device_mallocs() - mallocs
            torch.cuda._sleep(int(60e6))  # ~30 ms at the H100's clock
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(steps):
                fn()
            end.record()
            torch.cuda.synchronize()
            res[name]["gpu"].append(start.elapsed_time(end) / steps * 1e3)
    med = statistics.median
    for name, r in res.items():
        peak = ""
        if label == "real":
            for p in params:
                p.grad = None
            x.grad = None
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            fns[name]()
            torch.cuda.synchronize()
            peak = f"  peak {(torch.cuda.max_memory_allocated() - base) / 2**20:6.1f} MiB"
        print(f"76 {str(dtype)[6:]:8s} {label:5s} {name:32s} host {med(r['host']):7.1f}  "
              f"GPU {med(r['gpu']):7.1f}  wall {med(r['wall']):7.1f} us/step{peak}  "
              f"cudaMalloc/cudaFree in the timed steps: {r['mallocs']}", flush=True)


if __name__ == "__main__":
    tables = [("small", reference.SMALL_PROBLEMS)] if sys.argv[2:] == ["small"] else [
        ("small", reference.SMALL_PROBLEMS), ("real", reference.PROBLEMS)]
    for dname in sys.argv[1].split(","):
        for label, table in tables:
            measure(DTYPES[dname], table, label)
