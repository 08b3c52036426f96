"""Host time per training step (no synchronisation inside the loop) against
wall time per step, eager and ours, before and after torch.compile has run a
model in the same process, then with Python's cyclic GC off, then a cProfile
of ours:  python scripts/step_host_time.py 76 bf16

"After compile ran" includes the pool of compile workers that
torch.compile starts (unless TORCHINDUCTOR_COMPILE_THREADS=1): it keeps
the CPU busy for tens of seconds after the first compile, which is what
slowed the host there (benchmarks/run.py compiles in-process for that
reason)."""
import gc
import sys
import time

import torch

from cupy_fused import reference
from cupy_fused.testing import build_pair

problem = int(sys.argv[1])
dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[sys.argv[2]]
_, args, shape = reference.PROBLEMS[problem]
ref, ours = build_pair(problem, args, "cuda", dtype)
x = torch.rand(shape, device="cuda", dtype=dtype, requires_grad=True)


def step(model):
    for p in model.parameters():
        p.grad = None
    x.grad = None
    model(x).sum().backward()


def measure(label, steps=40):
    for name, model in (("eager", ref), ("ours", ours)):
        for _ in range(5):
            step(model)
        torch.cuda.synchronize()
        host, wall = [], []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(steps):
                step(model)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            host.append((t1 - t0) / steps * 1e6)
            wall.append((t2 - t0) / steps * 1e6)
        print(f"{label:22s} {name:6s} host issue {min(host):7.1f} us/step   wall {min(wall):7.1f} us/step"
              f"   gc counts {gc.get_count()}", flush=True)


measure("before compile")
compiled = torch.compile(ref)
for _ in range(3):
    step(compiled)
measure("after compile ran")
gc.disable()
measure("after compile, gc off")
gc.enable()
import cProfile  # noqa: E402
import pstats  # noqa: E402

prof = cProfile.Profile()
prof.enable()
for _ in range(40):
    step(ours)
prof.disable()
torch.cuda.synchronize()
pstats.Stats(prof).sort_stats("tottime").print_stats(14)
