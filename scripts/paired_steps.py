"""Training steps of eager and ours taken in turns, per problem and dtype:
at the small shapes, the host time of each step (steps alternated one by
one; the GPU work is a few microseconds there), and at the benchmark
shapes, the wall time per step over blocks of 20 (blocks alternated).
Prints medians and quartiles, and eager/ours.

    python scripts/paired_steps.py 76,88,94 fp16,bf16

To compare two versions of the library on one machine, run it once per
version with ``PYTHONPATH=<that version's tree> python -P ...`` (``-P``
keeps the script's own folder off the import path): the eager/ours ratios
then share their conditions within each run."""
import statistics
import sys
import time

import torch

import cupy_fused
from cupy_fused import reference
from cupy_fused.testing import build_pair

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def make_step(model, x):
    params = list(model.parameters())

    def step():
        for p in params:
            p.grad = None
        x.grad = None
        model(x).sum().backward()
    return step


def quartiles(values):
    values = sorted(values)
    n = len(values)
    return values[n // 4], statistics.median(values), values[3 * n // 4]


def alternate(fns, i):
    """The implementations in turns, their order swapped every other time."""
    items = list(fns.items())
    return items if i % 2 else items[::-1]


def main(problems, dtypes):
    print("cupy_fused from", cupy_fused.__file__, flush=True)
    for problem in problems:
        for dname in dtypes:
            dtype = DTYPES[dname]
            for size, table in (("small", reference.SMALL_PROBLEMS), ("real", reference.PROBLEMS)):
                _, args, shape = table[problem]
                ref, ours = build_pair(problem, args, "cuda", dtype)
                x = torch.rand(shape, device="cuda", dtype=dtype, requires_grad=True)
                fns = {"eager": make_step(ref, x), "ours": make_step(ours, x)}
                for fn in fns.values():
                    for _ in range(20):
                        fn()
                torch.cuda.synchronize()
                times = {name: [] for name in fns}
                if size == "small":
                    for i in range(1500):
                        for name, fn in alternate(fns, i):
                            t0 = time.perf_counter()
                            fn()
                            times[name].append((time.perf_counter() - t0) * 1e6)
                        if i % 25 == 0:  # never let the GPU fall far behind
                            torch.cuda.synchronize()
                else:
                    for i in range(40):
                        for name, fn in alternate(fns, i):
                            torch.cuda.synchronize()
                            t0 = time.perf_counter()
                            for _ in range(20):
                                fn()
                            torch.cuda.synchronize()
                            times[name].append((time.perf_counter() - t0) / 20 * 1e6)
                e, o = quartiles(times["eager"]), quartiles(times["ours"])
                print(f"{problem:3d} {dname} {size:5s} us/step  eager {e[1]:7.1f} "
                      f"({e[0]:.1f}-{e[2]:.1f})  ours {o[1]:7.1f} ({o[0]:.1f}-{o[2]:.1f})  "
                      f"eager/ours {e[1] / o[1]:.3f}", flush=True)
                del ref, ours, x, fns
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main([int(p) for p in sys.argv[1].split(",")], sys.argv[2].split(","))
