"""Times the GroupNorm epilogue forward and backward (float32, CUDA events)
at problem 37's benchmark size, the same with 128-channel groups, and 88's,
for each (team, values per lane) shape and each pair of launch bounds (the
minimum resident blocks per SM, CF_GN_FORWARD_MIN_BLOCKS /
CF_GN_BACKWARD_MIN_BLOCKS in gn_chain.cuh, which cap the registers per
thread; ptxas -v shows what spills under each).  The shipped shapes are
gn_chain.forward_team_shape and team_shape.

    python scripts/tune_gn.py [--bounds 8,4 6,3 4,2]
"""
import argparse
import importlib
import sys
from pathlib import Path

import torch

from cupy_fused import _runtime

gn = importlib.import_module("cupy_fused.ops.gn_chain")  # the module, not the op

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from harness import time_interleaved  # noqa: E402  (benchmarks/harness.py)

SHAPES = ((32768, 4096, 64, "swish_bias_gn"), (32768, 4096, 32, "swish_bias_gn"),
          (1024, 8192, 256, "gn_swish_mul_swish"))


class _BoundsFamily:
    """gn_chain.KERNELS built with other launch bounds."""

    def __init__(self, shipped: _runtime.KernelFamily, forward_blocks: int, backward_blocks: int):
        # (gn.KERNELS is this object while it is timed: keep the shipped one's names.)
        self.source, self.expressions = shipped.source, shipped.expressions
        self.defines = (f"CF_GN_FORWARD_MIN_BLOCKS={forward_blocks}",
                        f"CF_GN_BACKWARD_MIN_BLOCKS={backward_blocks}")

    def get(self, key, device):
        return _runtime.get_function(self.source, self.expressions[key], device, self.defines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bounds", nargs="+", default=["8,4", "6,3", "4,2"],
                        help="forward,backward minimum blocks per SM")
    args = parser.parse_args(argv)
    bounds = [tuple(map(int, b.split(","))) for b in args.bounds]
    shipped_kernels, shipped_shapes = gn.KERNELS, (gn.team_shape, gn.forward_team_shape)
    try:
        for rows, channels, groups, chain in SHAPES:
            cpg = channels // groups
            z = torch.randn(rows, channels, device="cuda")
            v = [torch.randn(channels, device="cuda") for _ in range(5)]
            dy = torch.randn_like(z)
            gb = z.numel() * 4 * 2 / 1e9
            for team, vals in ((32, 4), (16, 4), (8, 8), (16, 8), (32, 8), (4, 8)):
                if team * vals < cpg or team > 32:
                    continue
                gn.team_shape = gn.forward_team_shape = lambda c, t=team, k=vals: (t, k)
                runs = {}
                for fwd_blocks, bwd_blocks in bounds:
                    family = _BoundsFamily(shipped_kernels, fwd_blocks, bwd_blocks)

                    def fwd(family=family):
                        gn.KERNELS = family
                        gn.clear_launch_plans()
                        return gn._launch_forward(z, v[0], v[1], v[2], v[3], v[4], chain, groups,
                                                  1e-5, True, False)

                    _, stats = fwd()

                    def bwd(family=family, stats=stats):
                        gn.KERNELS = family
                        gn.clear_launch_plans()
                        return gn._launch_backward(dy, z, stats, v[0], v[1], v[2], v[3],
                                                   v[4], chain, groups, False)

                    runs[(fwd_blocks, bwd_blocks, "forward")] = fwd
                    runs[(fwd_blocks, bwd_blocks, "backward")] = bwd
                times = time_interleaved(runs, 20, 2)
                for (fwd_blocks, bwd_blocks, kind), (ms, _) in times.items():
                    traffic = gb if kind == "forward" else 1.5 * gb
                    print(f"{chain:<20} cpg {cpg:>4} team {team:>2} vals {vals} bounds "
                          f"{fwd_blocks},{bwd_blocks}: {kind:<8} {ms:.3f} ms "
                          f"({traffic / ms:.2f} TB/s)", flush=True)
    finally:
        gn.KERNELS, (gn.team_shape, gn.forward_team_shape) = shipped_kernels, shipped_shapes


if __name__ == "__main__":
    main()
