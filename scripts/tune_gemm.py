"""Times the forward 3xTF32 GEMM for candidate block tiles at the problem
shapes (the numbers behind ``cupy_fused.ops.gemm.TILES``):

    python scripts/tune_gemm.py [--tiles 128x128x3 64x128x4 ...] [--shapes MxKxN ...]

A tile is BMxBNxSTAGES (mma.sync) or engine128x128xSTAGES (the Hopper
engine, B split in the kernel; its block tile is fixed at 128x128).  Candidates are declared as
extra instantiations of gemm_tf32.cu, so the first run compiles them all.
"""
import argparse
import sys
from pathlib import Path

import torch

from cupy_fused import _runtime
from cupy_fused.ops import gemm as G

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from harness import time_ms  # noqa: E402  (benchmarks/harness.py)

CANDIDATES = ["engine128x128x4", "engine128x128x3", "128x128x3", "128x128x4", "64x128x3", "64x128x4",
              "128x64x3", "128x64x4", "64x64x4"]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tiles", nargs="+", default=CANDIDATES)
    p.add_argument("--shapes", nargs="+", default=["1024x8192x8192", "32768x1024x4096"])
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args()
    tiles = {t: G.Tile(*map(int, t.replace("engine", "").split("x")), engine=t.startswith("engine"))
             for t in args.tiles}
    # Candidates this GPU cannot run: the engine's off Hopper, and tiles
    # whose shared memory is more than a block may take here.
    limit = _runtime.max_shared_bytes(0)
    for name, tile in list(tiles.items()):
        need = tile.shared_bytes(*G.LAYOUTS["forward"], args.passes)
        why = (f"{need} bytes of shared memory, this GPU allows {limit} a block" if need > limit
               else "the engine's tiles need wgmma" if tile.engine and not G.has_wgmma(0) else None)
        if why:
            print(f"{name}: skipped ({why})", flush=True)
            del tiles[name]
    family = _runtime.KernelFamily("gemm_tf32.cu", {
        name: G._expr(tile, args.passes, "forward", True) for name, tile in tiles.items()})
    for shape in args.shapes:
        m, k, n = map(int, shape.split("x"))
        x, w = torch.rand(m, k, device="cuda"), torch.rand(n, k, device="cuda")
        out = torch.empty(m, n, device="cuda")
        ref = G._gemm(x, w, "forward", args.passes)
        for name, tile in tiles.items():
            fn = family.get(name, 0)
            med, _ = time_ms(lambda: G._launch_gemm(fn, tile, "forward", x, w, out,
                                                    passes=args.passes), args.iters, 1)
            same = torch.equal(out, ref)
            print(f"{shape} {name:10s} {med:.3f} ms {2 * m * n * k / med / 1e9:.0f} TFLOP/s"
                  f"{'' if same else '  (result differs from the default tile: summation order)'}",
                  flush=True)

if __name__ == "__main__":
    main()
