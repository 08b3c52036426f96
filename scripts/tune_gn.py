"""Times the scalar GroupNorm kernels, forward and backward (CUDA events,
in turns), at problem 37's benchmark size, the same with 128-channel
groups, 256-, 512- and 4096-channel groups (the last, one group a row),
and 88's, for each (team, values per lane) shape and each pair of launch
bounds (the minimum resident blocks per SM of the scalar forward and
backward, which cap the registers per thread; ptxas -v shows what spills
under each).  Teams of more than 32 lanes (whole warps sharing a group:
the backward's, where the groups leave a block's warps idle) time the
backward only.  The candidates run as gn_chain.LaunchShapes under
gn_chain.launch_shapes; the shipped shapes are gn_chain.SHIPPED_SHAPES
with team_shape, forward_team_shape and backward_team_shape's rules.

``--few-groups`` instead times the backward at shapes of fewer groups than
a block has warps (FEW_GROUPS), with backward_team_shape's teams against
teams of at most 32 lanes (the rule before teams spanned warps), and a
copy of z as the bandwidth ceiling of the same run.

    python scripts/tune_gn.py [--bounds 8,4 6,3 4,2] [--dtype bfloat16] [--shipped-teams]
                              [--cpg 512 4096]
    python scripts/tune_gn.py --few-groups [--dtype bfloat16]
"""
import argparse
import dataclasses
import importlib
import sys
from pathlib import Path

import torch

gn = importlib.import_module("cupy_fused.ops.gn_chain")  # the module, not the op

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from harness import time_interleaved  # noqa: E402  (benchmarks/harness.py)

SHAPES = ((32768, 4096, 64, "swish_bias_gn"), (32768, 4096, 32, "swish_bias_gn"),
          (16384, 4096, 16, "bias_hardtanh_mish_gn"), (1024, 8192, 256, "gn_swish_mul_swish"),
          # groups wider than a team's registers hold (32 x 8 values): two
          # sweeps per row, the second reading z again
          (8192, 8192, 16, "bias_hardtanh_mish_gn"), (8192, 4096, 1, "swish_bias_gn"))

# (rows, channels, groups): one to four groups a row, swept or held in
# registers, channels per group off the float32 vector (250) or past it
# by one (129); a batch too small to fill the GPU (64 rows).
FEW_GROUPS = ((8192, 4096, 1), (8192, 4096, 2), (8192, 4096, 4), (4096, 8192, 2),
              (8192, 2048, 1), (16384, 1200, 3), (32768, 300, 1), (32768, 250, 1),
              (65536, 129, 1), (64, 4096, 1))


def _offset(rows: int, channels: int, dtype: torch.dtype) -> torch.Tensor:
    """A random [rows, channels] z off the 16-byte grid: the scalar kernels,
    whose shapes these are (aligned float32 groups of some of these widths
    take the vectorised kernels)."""
    return torch.randn(rows * channels + 1, device="cuda", dtype=dtype)[1:].view(rows, channels)


def few_groups(dtype: torch.dtype) -> None:
    chain = "swish_bias_gn"
    for rows, channels, groups in FEW_GROUPS:
        cpg = channels // groups
        z, dy = _offset(rows, channels, dtype), _offset(rows, channels, dtype)
        v = [torch.randn(channels, device="cuda", dtype=dtype) for _ in range(5)]
        _, stats = gn._launch_forward(z, v[0], v[1], v[2], v[3], v[4], chain, groups, 1e-5, True,
                                      False)
        team, vals = gn.team_shape(cpg)
        if dtype == torch.float32 and cpg > team * vals:
            vals = gn.VALS_PER_LANE[0]  # (backward_team_shape's swept float32 groups)
        warp = dataclasses.replace(gn.SHIPPED_SHAPES, team=(team, vals))

        def bwd(shapes):
            def run():
                with gn.launch_shapes(shapes):
                    return gn._launch_backward(dy, z, stats, v[0], v[1], v[2], v[3], v[4], chain,
                                               groups, False)
            return run

        copy = torch.empty_like(z)
        times = time_interleaved({"warp": bwd(warp), "shipped": bwd(gn.SHIPPED_SHAPES),
                                  "copy": lambda: copy.copy_(z)}, 20, 2)
        size = z.numel() * z.element_size() / 1e9
        ceiling = 2 * size / times["copy"][0]
        shipped = gn.backward_team_shape(cpg, dtype, groups)
        print(f"{str(dtype)[6:]} {rows}x{channels}, {groups} groups: teams {team}x{vals} "
              f"{times['warp'][0]:.3f} ms, shipped {shipped[0]}x{shipped[1]} "
              f"{times['shipped'][0]:.3f} ms ({times['shipped'][0] / times['warp'][0]:.2f}x the "
              f"time; {3 * size / times['shipped'][0]:.2f} TB/s, copy {ceiling:.2f} TB/s)",
              flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bounds", nargs="+", default=["8,4", "6,3", "4,2"],
                        help="forward,backward minimum blocks per SM")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"),
                        help="z's dtype (the vectors and the output in it too)")
    parser.add_argument("--cpg", nargs="+", type=int,
                        help="only the shapes with these channels per group")
    parser.add_argument("--shipped-teams", action="store_true",
                        help="only the (team, values per lane) the shipped rule picks, the "
                             "backward's and the forward's")
    parser.add_argument("--few-groups", action="store_true",
                        help="the backward at FEW_GROUPS, teams spanning warps against not")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    if args.few_groups:
        few_groups(dtype)
        return
    bounds = [tuple(map(int, b.split(","))) for b in args.bounds]
    for rows, channels, groups, chain in SHAPES:
        cpg = channels // groups
        if args.cpg and cpg not in args.cpg:
            continue
        z = _offset(rows, channels, dtype)
        v = [torch.randn(channels, device="cuda", dtype=dtype) for _ in range(5)]
        dy = _offset(rows, channels, dtype)
        gb = z.numel() * z.element_size() * 2 / 1e9
        # the statistics every backward below reads: the shipped forward's
        _, stats = gn._launch_forward(z, v[0], v[1], v[2], v[3], v[4], chain, groups, 1e-5, True,
                                      False)
        teams = ((32, 4), (16, 4), (8, 8), (16, 8), (32, 8), (4, 8), (64, 4), (128, 4),
                 (256, 4), (256, 8))
        if args.shipped_teams:
            teams = sorted({gn.team_shape(cpg), gn.forward_team_shape(cpg),
                            gn.backward_team_shape(cpg, dtype, groups)})
        for team, vals in teams:
            if ((team > 32 and team > gn.BLOCK // gn._next_pow2(groups))  # (no group to share)
                    or (team * vals < cpg and not args.shipped_teams)):
                continue  # (the shipped shape of a wider group runs in sweeps: timed too)
            runs = {}
            for fwd_blocks, bwd_blocks in bounds:
                shapes = dataclasses.replace(gn.SHIPPED_SHAPES, team=(team, vals),
                                             forward_min_blocks=fwd_blocks,
                                             backward_min_blocks=bwd_blocks,
                                             backward_min_blocks_float_wide=bwd_blocks)

                def fwd(shapes=shapes):
                    with gn.launch_shapes(shapes):
                        return gn._launch_forward(z, v[0], v[1], v[2], v[3], v[4], chain, groups,
                                                  1e-5, True, False)

                def bwd(shapes=shapes, stats=stats):
                    with gn.launch_shapes(shapes):
                        return gn._launch_backward(dy, z, stats, v[0], v[1], v[2], v[3], v[4],
                                                   chain, groups, False)

                if team <= 32:  # (the forward's teams are within a warp)
                    runs[(fwd_blocks, bwd_blocks, "forward")] = fwd
                runs[(fwd_blocks, bwd_blocks, "backward")] = bwd
            times = time_interleaved(runs, 20, 2)
            for (fwd_blocks, bwd_blocks, kind), (ms, _) in times.items():
                traffic = gb if kind == "forward" else 1.5 * gb
                print(f"{args.dtype} {chain:<21} cpg {cpg:>4} team {team:>2} vals {vals} bounds "
                      f"{fwd_blocks},{bwd_blocks}: {kind:<8} {ms:.3f} ms "
                      f"({traffic / ms:.2f} TB/s)", flush=True)


if __name__ == "__main__":
    main()
