"""Times the GroupNorm epilogue forward and backward for each (team, values
per lane) shape at problem 37's and 88's benchmark sizes (CUDA events)."""
import torch

from cupy_fused.ops import gn_epilogue as gn


def bench(fn, iters=20):
    fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    s.record()
    for _ in range(iters):
        fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / iters


for rows, channels, groups, chain in ((32768, 4096, 64, "swish_bias_gn"),
                                      (1024, 8192, 256, "gn_swish_mul_swish")):
    cpg = channels // groups
    z = torch.randn(rows, channels, device="cuda")
    v = [torch.randn(channels, device="cuda") for _ in range(5)]
    dy = torch.randn_like(z)
    gb = z.numel() * 4 * 2 / 1e9
    original = gn.team_shape
    for team, vals in ((32, 4), (16, 4), (8, 8), (32, 8), (4, 8)):
        if team * vals < cpg or team > 32:
            continue
        gn.team_shape = lambda c, t=team, k=vals: (t, k)
        fwd = lambda: gn.launch_forward(z, v[0], v[1], v[2], v[3], v[4], chain, groups, 1e-5, True, False)
        ms = bench(fwd)
        out, mean, rstd = fwd()
        bwd = lambda: gn.launch_backward(dy, z, mean, rstd, v[0], v[1], v[2], v[3], v[4], chain, groups,
                                         False)
        ms_b = bench(bwd)
        print(f"{chain:<20} cpg {cpg:>4} team {team:>2} vals {vals}: forward {ms:.3f} ms "
              f"({gb / ms:.2f} TB/s)  backward {ms_b:.3f} ms ({1.5 * gb / ms_b:.2f} TB/s)")
    gn.team_shape = original
