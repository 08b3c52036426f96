"""``python -m cupy_fused``: environment report, then a smoke kernel against
torch and the five models against the reference; without a GPU, the NVRTC
compile check of every kernel instead.

  python -m cupy_fused                     report, then the checks
  python -m cupy_fused --precompile        report, then compile every kernel for this GPU
                                           (CuPy's disk cache keeps them for later processes)
  python -m cupy_fused --no-compile-check  without a GPU: the report only
  python -m cupy_fused --arch sm_90a       check that the kernels compile for these
                                           architectures (without a GPU: these only; with
                                           one: first, then the checks above)
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time


def _line(key: str, value) -> None:
    print(f"  {key:<22} {value}")


def _report_cupy():
    """Prints CuPy's and NVRTC's versions; returns (cupy module or None,
    whether NVRTC loads)."""
    from . import _runtime
    from ._cupy import INSTALL_HINT, CupyNotInstalledError, require_cupy

    try:
        cupy = require_cupy()
    except CupyNotInstalledError:
        _line("CuPy", "NOT INSTALLED")
        print(INSTALL_HINT)
        return None, False
    except (ImportError, OSError) as exc:  # installed, but its import failed: the message says why
        _line("CuPy", f"import failed ({exc})")
        return None, False

    _line("CuPy", f"{cupy.__version__} ({_runtime.cupy_distribution() or 'unknown distribution'})")
    nvrtc_ok = True
    try:
        major, minor = _runtime.nvrtc_version()
        _line("NVRTC", f"{major}.{minor}")
    except _runtime.NvrtcNotFoundError as exc:
        _line("NVRTC", "NOT FOUND")
        print(exc)
        nvrtc_ok = False
    except Exception as exc:  # noqa: BLE001 - report, don't crash
        _line("NVRTC", f"unavailable ({exc})")
        nvrtc_ok = False
    _line("kernel cache", os.environ.get("CUPY_CACHE_DIR", os.path.expanduser("~/.cupy/kernel_cache")))
    return cupy, nvrtc_ok


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


def _compile_check(archs, gpu: bool = False) -> bool:
    """The compile check for ``archs`` (None: the default architectures),
    announced as asked for beside a GPU (``gpu``) or as the check a machine
    without one runs."""
    from . import _runtime

    archs = archs or _runtime.check_architectures()
    for arch in archs:
        try:
            _runtime._check_arch(arch)
        except ValueError as exc:
            print(exc)
            return False
    count = sum(len(v) for v in _runtime.declared().values())
    major, minor = _runtime.nvrtc_version()
    lead = "Compile check (--arch)" if gpu else "No CUDA GPU is visible: compile check"
    print(f"\n{lead} of {count} instantiations for "
          f"{', '.join(archs)} with NVRTC {major}.{minor} (this takes a few minutes).")
    ok = True
    for arch in archs:
        t0 = time.perf_counter()
        try:
            sizes = _runtime.compile_check(arch, progress=True)
        except _runtime.CompileError as exc:
            print(f"  {arch}: FAILED\n{exc}")
            ok = False
            continue
        print(f"  {arch}: {len(sizes)} sources, {count} instantiations compiled "
              f"in {time.perf_counter() - t0:.1f} s")
    return ok


def _precompile(device: int) -> bool:
    from . import _runtime

    arch = _runtime.device_arch(device)
    print(f"\nCompiling every kernel instantiation for {arch} (GPU {device}); CuPy's disk "
          "cache keeps them for later processes:")
    t0 = time.perf_counter()
    try:
        done = _runtime.precompile(device=device, progress=True)
    except _runtime.CompileError as exc:
        print(f"  FAILED\n{exc}")
        return False
    print(f"  {len(done)} instantiations ready in {time.perf_counter() - t0:.1f} s")
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cupy_fused", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-models", action="store_true", help="skip the five-model check")
    parser.add_argument("--precompile", action="store_true",
                        help="compile every kernel instantiation for the current GPU, then exit "
                             "(without a GPU: the compile check, then exit 1: nothing is "
                             "cached)")
    parser.add_argument("--no-compile-check", action="store_true",
                        help="without a GPU, print the report only (with one, no compile check "
                             "runs unless --arch asks for it)")
    parser.add_argument("--arch", nargs="+", metavar="ARCH",
                        help="check that every kernel compiles for these architectures (without "
                             "a GPU the default is sm_75, sm_80, sm_90, sm_90a, and sm_70 where "
                             "NVRTC supports it; with one, first, then the GPU's own checks)")
    args = parser.parse_args(argv)
    if hasattr(sys.stdout, "reconfigure"):  # each line as it comes, also into a pipe (CI logs)
        sys.stdout.reconfigure(line_buffering=True)

    import torch

    from . import __version__, _runtime

    print(f"cupy-fused {__version__}")
    _line("python", platform.python_version())
    _line("torch", f"{torch.__version__} (CUDA {torch.version.cuda})")
    cupy, nvrtc_ok = _report_cupy()
    try:
        _line("kernel sources", _runtime.kernel_dir())
    except FileNotFoundError as exc:
        _line("kernel sources", "NOT FOUND")
        print(exc)
        return 1
    if cupy is None or not nvrtc_ok:
        return 1
    try:
        return _checks(args, cupy, torch)
    except _runtime.NvrtcNotFoundError as exc:
        print(exc)
        return 1


def _cupy_devices(cupy) -> tuple:
    """(the GPUs CuPy sees, why none where none: its error, or that it
    counts none)."""
    try:
        n_cupy = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - reported (no driver: no GPU)
        return 0, f"{type(exc).__name__}: {exc}"
    return n_cupy, "it counts no device"


def _checks(args, cupy, torch) -> int:
    gpu = torch.cuda.is_available()
    n_cupy, reason = _cupy_devices(cupy)
    if gpu:
        # torch sees a GPU: CuPy must too (a CuPy for another CUDA major than
        # the driver's, say), or nothing of ours can run on it.
        if n_cupy == 0:
            print(f"\ntorch sees {torch.cuda.device_count()} CUDA GPU(s), CuPy none ({reason}). "
                  "Install the CuPy of torch's CUDA major (cupy-cuda12x for CUDA 12, "
                  "cupy-cuda13x for 13) and a driver that supports it.")
            return 1
        # Architectures asked for by name (e.g. the ones a build ships for,
        # beside this GPU's): checked first, as without a GPU.
        if args.arch and not _compile_check(args.arch, gpu=True):
            return 1
    else:
        if torch.version.cuda is None and n_cupy:
            # A CPU build of torch on a machine with a GPU: nothing of ours
            # can run there, though the compile check would pass.
            print(f"\nCuPy sees {n_cupy} CUDA GPU(s), but this torch is a CPU build "
                  f"({torch.__version__}): install a CUDA build of torch.")
            return 1
        if args.no_compile_check:
            print("\nNo CUDA GPU is visible (compile check skipped: --no-compile-check).")
        ok = args.no_compile_check or _compile_check(args.arch)
        if args.precompile:
            print("Nothing was cached: precompiling loads each kernel on the GPU it is for, "
                  "and no GPU is visible.")
            return 1
        return 0 if ok else 1
    dev = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(dev)
    _line("GPU", f"{props.name} (sm_{props.major}{props.minor}, {props.multi_processor_count} SMs, "
                 f"{props.total_memory / 2**30:.0f} GiB)")
    rt = cupy.cuda.runtime
    drv = rt.driverGetVersion()
    run = rt.runtimeGetVersion()
    _line("CUDA driver / runtime", f"{drv // 1000}.{drv % 1000 // 10} / {run // 1000}.{run % 1000 // 10}")
    if args.precompile:
        return 0 if _precompile(dev) else 1
    print("\nSmoke kernel against torch:")
    ok = _smoke(dev)
    if not args.no_models:
        print("\nThe five models against the PyTorch reference (float64 ground truth):")
        ok &= _models(dev)
    print("\nOK" if ok else "\nFAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
