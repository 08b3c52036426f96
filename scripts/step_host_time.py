"""Host issue time, GPU time and wall time per training step, eager and
ours, before and after torch.compile has run a model in the same process,
then with the objects alive then frozen out of the cyclic GC (gc.freeze),
then with the GC off, then a cProfile of ours (main thread only: the
backward runs on autograd's device thread):
python scripts/step_host_time.py 76 bf16 [small]

With ``small``, the problem's small shapes (reference.SMALL_PROBLEMS): the
GPU work is then a few microseconds, so the wall time is the host's time
per step.

"After compile ran" includes the pool of compile workers that
torch.compile starts (unless TORCHINDUCTOR_COMPILE_THREADS=1): it keeps
the CPU busy for tens of seconds after the first compile, which is what
slowed the host there (benchmarks/run.py compiles in-process for that
reason)."""
import gc
import statistics
import sys
import time

import torch

from cupy_fused import reference
from cupy_fused.testing import build_pair

problem = int(sys.argv[1])
dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[sys.argv[2]]
table = reference.SMALL_PROBLEMS if sys.argv[3:] == ["small"] else reference.PROBLEMS
_, args, shape = table[problem]
ref, ours = build_pair(problem, args, "cuda", dtype)
x = torch.rand(shape, device="cuda", dtype=dtype, requires_grad=True)


def step(model):
    for p in model.parameters():
        p.grad = None
    x.grad = None
    model(x).sum().backward()


def measure(label, steps=30):
    """Per step, median of 5 rounds: the host's issue time (no
    synchronisation in the loop), the GPU's time with the host far ahead
    (a sleep kernel first holds the GPU while the host queues the steps),
    and the wall time of the loop.  The step is host-bound where the wall
    time is above the GPU time."""
    for name, model in (("eager", ref), ("ours", ours)):
        for _ in range(5):
            step(model)
        torch.cuda.synchronize()
        host, wall, gpu = [], [], []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(steps):
                step(model)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            host.append((t1 - t0) / steps * 1e6)
            wall.append((t2 - t0) / steps * 1e6)
            torch.cuda._sleep(int(60e6))  # ~30 ms at the H100's clock
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(steps):
                step(model)
            end.record()
            torch.cuda.synchronize()
            gpu.append(start.elapsed_time(end) / steps * 1e3)
        med = statistics.median
        print(f"{label:22s} {name:6s} host issue {med(host):7.1f}   GPU {med(gpu):7.1f}   "
              f"wall {med(wall):7.1f} us/step   gc counts {gc.get_count()}", flush=True)


measure("before compile")
compiled = torch.compile(ref)
for _ in range(3):
    step(compiled)
measure("after compile ran")
gc.freeze()
measure("after compile, gc.freeze")
gc.unfreeze()
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
