"""One launch of each float32 GEMM variant at a problem shape, for ncu and
for reading the kernels' SASS:

    ncu --kernel-name regex:gemm_tf32 --set full python scripts/profile_gemm.py 1024 8192 8192
    python scripts/profile_gemm.py --sass   # instruction mix of every compiled variant

Shape: M K N (batch, in_features, out_features); the forward product.
"""
import argparse
import collections
import re
import subprocess
import tempfile

import torch

from cupy_fused.ops import gemm as G


def sass_summary(arch: str = "sm_90a") -> None:
    """Compiles gemm_tf32.cu with NVRTC to PTX (every declared variant),
    assembles it with the toolkit's ptxas and counts the SASS opcodes of
    interest with cuobjdump (HGMMA / HMMA: wgmma / mma.sync tensor-core MMAs;
    LDL/STL: local-memory spills).  (cuobjdump may not read a cubin from a
    newer NVRTC than its own toolkit; the PTX route uses one toolkit.)"""
    from cupy.cuda import nvrtc

    from cupy_fused import _runtime

    source = "gemm_tf32.cu"
    prog = nvrtc.createProgram((_runtime.kernel_dir() / source).read_text(), source, [], [])
    exprs = _runtime.declared()[source]
    for expr in exprs:
        nvrtc.addNameExpression(prog, expr)
    virtual = arch.replace("sm_", "compute_")
    nvrtc.compileProgram(prog, list(_runtime.nvrtc_options()) + [f"--gpu-architecture={virtual}"])
    readable = {nvrtc.getLoweredName(prog, e): e for e in exprs}
    ptx = nvrtc.getPTX(prog)
    with tempfile.TemporaryDirectory() as tmp:
        ptx_path, cubin_path = f"{tmp}/k.ptx", f"{tmp}/k.cubin"
        with open(ptx_path, "wb" if isinstance(ptx, bytes) else "w") as f:
            f.write(ptx)
        subprocess.run(["ptxas", f"-arch={arch}", ptx_path, "-o", cubin_path], check=True)
        done = subprocess.run(["cuobjdump", "-sass", cubin_path], capture_output=True, text=True)
        sass = done.stdout
        if not sass:
            raise RuntimeError(f"cuobjdump printed no SASS: {done.stderr.strip()}")
    keys = ["HGMMA", "HMMA", "LDS", "LDGSTS", "STS", "FADD", "BAR", "LDL", "STL"]
    for name, body in re.findall(r"Function : (\S+)\n(.*?)(?=Function :|\Z)", sass, re.S):
        ops = collections.Counter(re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", body))
        print(readable.get(name, name)[:80], {k: ops.get(k, 0) for k in keys}, "total", sum(ops.values()))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("shape", nargs="*", type=int, default=[1024, 8192, 8192])
    p.add_argument("--sass", action="store_true")
    p.add_argument("--passes", type=int, nargs="+", default=[3, 1])
    args = p.parse_args()
    if args.sass:
        sass_summary()
        return
    m, k, n = args.shape
    x = torch.rand(m, k, device="cuda")
    w = torch.rand(n, k, device="cuda")
    for passes in args.passes:
        G._gemm(x, w, "forward", passes)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
