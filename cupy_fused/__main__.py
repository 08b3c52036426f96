"""``python -m cupy_fused``: environment report, then a smoke kernel against
torch and the five models against the reference; without a GPU, the NVRTC
compile check of every kernel instead."""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time


def _line(key: str, value) -> None:
    print(f"  {key:<22} {value}")


def _cupy_distribution() -> str:
    from importlib import metadata

    for name in ("cupy-cuda13x", "cupy-cuda12x", "cupy"):
        try:
            metadata.version(name)
            return name
        except metadata.PackageNotFoundError:
            continue
    return "unknown distribution"


def _report_cupy():
    from ._cupy import cupy_available, INSTALL_HINT

    if not cupy_available():
        _line("CuPy", "NOT INSTALLED")
        print(INSTALL_HINT)
        return None
    import cupy
    from cupy.cuda import nvrtc

    _line("CuPy", f"{cupy.__version__} ({_cupy_distribution()})")
    try:
        major, minor = nvrtc.getVersion()
        _line("NVRTC", f"{major}.{minor}")
    except Exception as exc:  # noqa: BLE001 - report, don't crash
        _line("NVRTC", f"unavailable ({exc})")
    _line("kernel cache", os.environ.get("CUPY_CACHE_DIR", os.path.expanduser("~/.cupy/kernel_cache")))
    return cupy


def _smoke(device: int) -> bool:
    import torch
    from .ops import scale_add

    ok = True
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x = torch.rand(1000, 37, device=f"cuda:{device}", dtype=dtype)
        y = torch.rand_like(x)
        t0 = time.perf_counter()
        out = scale_add(x, y, 0.5)
        torch.cuda.synchronize(device)
        ms = (time.perf_counter() - t0) * 1e3
        want = (0.5 * x.float() + y.float()).to(dtype)
        err = (out.float() - want.float()).abs().max().item()
        # One rounding of the dtype: the kernel may fuse the multiply-add.
        good = err <= torch.finfo(dtype).eps * want.float().abs().max().item()
        ok &= good
        print(f"  scale_add {str(dtype):<15} max |ours - torch| = {err:.3g}  "
              f"{'OK' if good else 'MISMATCH'}  (first call incl. compile {ms:.0f} ms)")
    return ok


def _models(device: int) -> bool:
    from .testing import model_table

    rows, ok = model_table(f"cuda:{device}")
    for row in rows:
        print("  " + row)
    return ok


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cupy_fused", description=__doc__)
    parser.add_argument("--no-models", action="store_true", help="skip the five-model check")
    args = parser.parse_args(argv)

    import torch

    from . import __version__, _runtime

    print(f"cupy-fused {__version__}")
    _line("python", platform.python_version())
    _line("torch", f"{torch.__version__} (CUDA {torch.version.cuda})")
    cupy = _report_cupy()
    _line("kernel sources", _runtime.kernel_dir())
    if cupy is None:
        return 1
    gpu = torch.cuda.is_available()
    try:
        n_cupy = cupy.cuda.runtime.getDeviceCount() if gpu else 0
    except Exception:  # noqa: BLE001
        n_cupy = 0
    if not gpu or n_cupy == 0:
        print("\nNo CUDA GPU is visible: running the NVRTC compile check of every kernel instead.")
        ok = True
        for arch in ("sm_75", "sm_80", "sm_90", "sm_90a"):
            t0 = time.perf_counter()
            try:
                sizes = _runtime.compile_check(arch)
            except _runtime.CompileError as exc:
                print(f"  {arch}: FAILED\n{exc}")
                ok = False
                continue
            n = sum(len(v) for v in _runtime.declared().values())
            print(f"  {arch}: {len(sizes)} sources, {n} instantiations compiled "
                  f"in {time.perf_counter() - t0:.1f} s")
        return 0 if ok else 1
    dev = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(dev)
    _line("GPU", f"{props.name} (sm_{props.major}{props.minor}, {props.multi_processor_count} SMs, "
                 f"{props.total_memory / 2**30:.0f} GiB)")
    rt = cupy.cuda.runtime
    drv = rt.driverGetVersion()
    run = rt.runtimeGetVersion()
    _line("CUDA driver / runtime", f"{drv // 1000}.{drv % 1000 // 10} / {run // 1000}.{run % 1000 // 10}")
    print("\nSmoke kernel against torch:")
    ok = _smoke(dev)
    if not args.no_models:
        print("\nThe five models against the PyTorch reference (float64 ground truth):")
        ok &= _models(dev)
    print("\nOK" if ok else "\nFAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
