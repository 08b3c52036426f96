"""Kernel runtime: the one place that turns a ``kernels_cu/*.cu`` file into a
launchable function.

* Sources live in ``kernels_cu/`` (shipped inside the wheel as
  ``cupy_fused/kernels_cu``).  A ``.cu`` file may include the shared ``.cuh``
  headers of that folder.
* Every template instantiation the library launches is *declared* up front with
  :func:`declare` (pure Python, at import).
* Compiling is lazy and per instantiation: the first launch of an
  instantiation on a device compiles that instantiation alone (its source
  with one NVRTC name expression), so a first call waits for the kernels it
  runs, not for every variant its source declares.
* Compiled kernels are cached in process per (source, instantiation, device,
  extra defines); the launch path's lookup (:meth:`KernelFamily.get`) is one
  dict lookup.  CuPy's on-disk kernel cache (``CUPY_CACHE_DIR``, default
  ``~/.cupy/kernel_cache``) keeps each binary across processes; with a
  CuPy before 14.2, which does not read back modules built from name
  expressions, the run time keeps them itself, in that folder's
  ``cupy_fused/``.  The NVRTC
  options carry a hash of all kernel sources, so editing a header
  invalidates the disk cache too.
* A compile holds a lock of its own (instantiation, device): threads that
  launch different kernels compile them concurrently (NVRTC releases the
  GIL), and threads that launch the same one compile it once.
* Each compile logs an INFO line to the ``"cupy_fused"`` logger when it
  starts and one with its time when it ends (the library adds no handler:
  ``logging.basicConfig(level=logging.INFO)`` shows them).
* On compute capability 9.0 (H100, H200) kernels are compiled for ``sm_90a``,
  which adds Hopper's architecture-specific instructions (``wgmma``) to
  sm_90; kernels test ``__CUDA_ARCH_FEAT_SM90_ALL`` before using them.
* Importing :mod:`cupy_fused` compiles nothing.  :func:`precompile` compiles
  declared instantiations up front, for a device or (NVRTC alone, no GPU)
  for an architecture; :func:`compile_check` compiles every declared
  instantiation for an architecture and fails on any error (the CPU CI tier).
"""
from __future__ import annotations

import collections.abc
import contextlib
import hashlib
import logging
import numbers
import os
import re
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

from ._cupy import require_cupy

log = logging.getLogger("cupy_fused")

# Fixed NVRTC options (the architecture is added per device / per check).
BASE_OPTIONS: Tuple[str, ...] = ("-std=c++17",)
# What CuPy adds to every NVRTC compile of a RawModule (cupy/cuda/compiler.py):
# the run time's own builds (the compile check, its own disk cache) add the
# same, so that they produce the machine code CuPy's route produces.
CUPY_NVRTC_OPTIONS: Tuple[str, ...] = ("-ftz=true", "--device-as-default-execution-space")

# Architectures the compile check covers, those the installed NVRTC
# supports (:func:`check_architectures`; NVRTC 13 dropped sm_70).
CHECK_ARCHS: Tuple[str, ...] = ("sm_70", "sm_75", "sm_80", "sm_90", "sm_90a")


def kernel_dir() -> Path:
    """Folder holding the ``.cu``/``.cuh`` sources.

    ``CUPY_FUSED_KERNEL_DIR`` overrides; otherwise the copy installed inside the
    package (wheel), else the source tree's top-level ``kernels_cu/``.
    """
    override = os.environ.get("CUPY_FUSED_KERNEL_DIR")
    if override:
        if not os.path.isdir(override):
            raise FileNotFoundError(f"CUPY_FUSED_KERNEL_DIR={override!r} is not a folder: it "
                                    "must name the folder holding the .cu / .cuh sources")
        return Path(override)
    here = Path(__file__).resolve().parent
    for candidate in (here / "kernels_cu", here.parent / "kernels_cu"):
        if (candidate / "cf_common.cuh").is_file():
            return candidate
    raise FileNotFoundError(
        "cupy-fused kernel sources not found: looked for kernels_cu/ inside the package "
        f"({here / 'kernels_cu'}) and beside it ({here.parent / 'kernels_cu'}); "
        "set CUPY_FUSED_KERNEL_DIR to the folder holding the .cu files"
    )


def source_files() -> List[str]:
    """Names of every ``.cu`` file in the kernel folder."""
    return [p.name for p in source_paths(kernel_dir()) if p.suffix == ".cu"]


def source_paths(folder) -> List[Path]:
    """The ``.cu`` and ``.cuh`` files of ``folder``, sorted by name: not an
    editor's swap, lock or backup file beside them (``.x.cu.swp``,
    ``.#x.cu``, ``#x.cu#``), nor a ``.cubin``."""
    return sorted(p for p in Path(folder).iterdir()
                  if p.suffix in (".cu", ".cuh") and p.name[0] not in ".#" and p.is_file())


def _sources_hash() -> str:
    digest = hashlib.sha256()
    for path in source_paths(kernel_dir()):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


# The last nvrtc_options, and its stamp: the folder, the extra options and
# each source's name, size and modification time.
_last_options: Tuple[tuple, Tuple[str, ...]] = ((), ())


def nvrtc_options() -> Tuple[str, ...]:
    """NVRTC options without the architecture (same for every source).

    ``CUPY_FUSED_NVRTC_OPTIONS`` appends options (space-separated), e.g.
    ``-lineinfo`` for profiling.  Asked at every compile and load: the
    sources' hash, which the disk caches key on, is made again wherever
    the folder or a source's size or modification time is not what it was,
    so that it is the hash of the sources the compile reads."""
    folder = kernel_dir()
    extra = tuple(os.environ.get("CUPY_FUSED_NVRTC_OPTIONS", "").split())
    stamp = (str(folder), extra) + tuple(
        (path.name, stat.st_size, stat.st_mtime_ns)
        for path in source_paths(folder) for stat in (path.stat(),))
    global _last_options
    if _last_options[0] != stamp:
        _last_options = (stamp, BASE_OPTIONS + (
            f"-I{folder}", f"-DCUPY_FUSED_SOURCES_HASH=0x{_sources_hash()}ULL") + extra)
    return _last_options[1]


def arch_options(device: int) -> Tuple[str, ...]:
    """NVRTC options naming an architecture-specific target for ``device``:
    ``-arch=sm_90a`` on compute capability 9.0, none elsewhere (CuPy then
    adds the plain ``-arch=sm_XY``).  NVRTC given both ``sm_90`` and
    ``sm_90a`` compiles for ``sm_90a``: the compile check and the GPU tests
    (which launch the ``wgmma`` kernels, whose sm_90 body traps) cover that."""
    if device_capability(device) == (9, 0):
        return ("-arch=sm_90a",)
    return ()


_capabilities: Dict[int, Tuple[int, int]] = {}


def device_capability(device: int) -> Tuple[int, int]:
    """(major, minor) compute capability of CUDA device ``device`` (cached)."""
    cap = _capabilities.get(device)
    if cap is None:
        cc = require_cupy().cuda.Device(device).compute_capability  # e.g. "90"
        cap = _capabilities[device] = (int(cc[:-1]), int(cc[-1]))
    return cap


_shared_limits: Dict[int, int] = {}


def max_shared_bytes(device: int) -> int:
    """The dynamic shared memory a block may opt in to on CUDA device
    ``device``, in bytes (cached): 227 KiB on compute capability 9.0, 163
    KiB on 8.0, 99 KiB on 8.6 and 8.9."""
    limit = _shared_limits.get(device)
    if limit is None:
        rt = require_cupy().cuda.runtime
        limit = _shared_limits[device] = rt.deviceGetAttribute(
            rt.cudaDevAttrMaxSharedMemoryPerBlockOptin, device)
    return limit


def device_arch(device: int) -> str:
    """The architecture name of CUDA device ``device`` as NVRTC spells it:
    ``"sm_90a"`` on compute capability 9.0 (see :func:`arch_options`),
    ``"sm_XY"`` elsewhere."""
    major, minor = device_capability(device)
    return f"sm_{major}{minor}" + ("a" if (major, minor) == (9, 0) else "")


# ---------------------------------------------------------------- NVRTC itself

class CompileError(RuntimeError):
    """NVRTC rejected a source; the message holds the compiler log."""


class NvrtcNotFoundError(RuntimeError):
    """CuPy is installed but the NVRTC library it loads is not; the message
    names the package that provides it."""


def cupy_distribution() -> Optional[str]:
    """The installed CuPy distribution (``"cupy-cuda12x"``, ``"cupy-cuda13x"``
    or ``"cupy"`` for a source build), or None when none is installed."""
    from importlib import metadata

    for name in ("cupy-cuda13x", "cupy-cuda12x", "cupy"):
        try:
            metadata.version(name)
            return name
        except metadata.PackageNotFoundError:
            continue
    return None


def nvrtc_install_hint() -> str:
    """What to install to give the installed CuPy its NVRTC library."""
    dist = cupy_distribution()
    if dist == "cupy-cuda12x":
        return "cupy-cuda12x needs CUDA 12's NVRTC: pip install nvidia-cuda-nvrtc-cu12"
    if dist == "cupy-cuda13x":
        return "cupy-cuda13x needs CUDA 13's NVRTC: pip install 'nvidia-cuda-nvrtc==13.*'"
    return ("install the NVRTC library of CuPy's CUDA version: the CUDA toolkit, or "
            "pip install nvidia-cuda-nvrtc-cu12 (CUDA 12) / 'nvidia-cuda-nvrtc==13.*' (CUDA 13)")


def missing_nvrtc_message(exc: BaseException) -> Optional[str]:
    """A one-line message naming the package to install when ``exc`` (or an
    exception it was raised from) says that the NVRTC library could not be
    loaded; None for any other error.

    Args:
        exc: an exception raised by CuPy while compiling or querying NVRTC.

    Returns:
        The message, or None.
    """
    seen = set()
    err: Optional[BaseException] = exc
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        text = str(err).lower()
        # CuPy's loader (cuda-pathfinder's DynamicLibNotFoundError, or an
        # OSError from older CuPy) and NVRTC's own "failed to open
        # libnvrtc-builtins" all name the library file; a compiler log of a
        # broken kernel never does.
        if "libnvrtc" in text or (type(err).__name__ == "DynamicLibNotFoundError"
                                  and "nvrtc" in text):
            return f"NVRTC (CUDA's runtime compiler) was not found: {nvrtc_install_hint()}"
        err = err.__cause__ or err.__context__
    return None


@contextlib.contextmanager
def _naming_missing_nvrtc():
    """Turns a failure to load NVRTC into :class:`NvrtcNotFoundError`."""
    try:
        yield
    except NvrtcNotFoundError:
        raise
    except Exception as exc:
        message = missing_nvrtc_message(exc)
        if message is None:
            raise
        raise NvrtcNotFoundError(message) from exc


def nvrtc_version() -> Tuple[int, int]:
    """(major, minor) of the NVRTC library CuPy loads.

    Returns:
        The version, e.g. ``(12, 9)``.  Raises :class:`NvrtcNotFoundError`
        when the library is missing.
    """
    require_cupy()
    from cupy.cuda import nvrtc

    with _naming_missing_nvrtc():
        major, minor = nvrtc.getVersion()
    return int(major), int(minor)


_ARCH_NAME = re.compile(r"^(?:sm|compute)_(\d+)[af]?$")


def check_architectures() -> List[str]:
    """The architectures of :data:`CHECK_ARCHS` that the installed NVRTC
    compiles for (NVRTC 13 no longer accepts sm_70).

    Returns:
        Architecture names, e.g. ``["sm_70", "sm_75", "sm_80", "sm_90", "sm_90a"]``.
    """
    supported = _supported_arch_numbers()
    return [a for a in CHECK_ARCHS if int(_ARCH_NAME.match(a).group(1)) in supported]


def _supported_arch_numbers() -> Tuple[int, ...]:
    require_cupy()
    from cupy.cuda import nvrtc

    with _naming_missing_nvrtc():
        if hasattr(nvrtc, "getSupportedArchs"):
            return tuple(int(a) for a in nvrtc.getSupportedArchs())
        major, _ = nvrtc.getVersion()
    # Without the query (older CuPy): what the check needs, by release.
    return (75, 80, 90) if major >= 13 else (70, 75, 80, 90)


# What NVRTC builds a cubin for: sm_XY, with "a" (architecture-specific)
# from 9.0 on and "f" (family) from 10.0 on.
_CUBIN_ARCH = re.compile(r"^sm_(\d+)([af]?)$")


def _check_arch(arch: str) -> None:
    match = _CUBIN_ARCH.match(arch) if isinstance(arch, str) else None
    if match is None or (match.group(2) == "a" and int(match.group(1)) < 90) or (
            match.group(2) == "f" and int(match.group(1)) < 100):
        raise ValueError(f"not an architecture NVRTC builds a cubin for: {arch!r} (expected e.g. "
                         "'sm_80' or 'sm_90a'; a device is given as an index or a torch.device)")
    supported = _supported_arch_numbers()
    if int(match.group(1)) not in supported:
        major, minor = nvrtc_version()
        raise ValueError(f"NVRTC {major}.{minor} does not compile for {arch}; it supports "
                         + ", ".join(f"sm_{a}" for a in supported))


def _nvrtc_build(source: str, exprs: Sequence[str], arch: str,
                 options: Optional[Sequence[str]] = None) -> Tuple[bytes, List[str]]:
    """Compiles ``exprs`` (name expressions of ``source``) as one NVRTC
    program for ``arch`` (a real architecture, e.g. ``"sm_90a"``), with NVRTC
    alone (no GPU, no driver), with ``options`` (default
    :func:`nvrtc_options`), CuPy's own (:data:`CUPY_NVRTC_OPTIONS`) and the
    architecture.  Returns the cubin and the lowered (mangled) name of each
    expression; raises :class:`CompileError` with the log."""
    require_cupy()
    from cupy.cuda import nvrtc

    what = f"{source}: {', '.join(exprs)}"
    options = list(nvrtc_options() if options is None else options) + list(CUPY_NVRTC_OPTIONS)
    with _naming_missing_nvrtc():
        # (named by its path: a quoted include is looked up beside the
        # program first, which a bare name puts in the working folder)
        prog = nvrtc.createProgram(_read_source(source), str(kernel_dir() / source), [], [])
        try:
            for expr in exprs:
                nvrtc.addNameExpression(prog, expr)
            try:
                nvrtc.compileProgram(prog, options + [f"--gpu-architecture={arch}"])
            except nvrtc.NVRTCError as exc:
                raise CompileError(
                    f"{what} for {arch} failed: {exc}\n{nvrtc.getProgramLog(prog)}") from None
            lowered = [nvrtc.getLoweredName(prog, expr) for expr in exprs]
            for expr, name in zip(exprs, lowered):
                if not name:
                    raise CompileError(f"{source}: {expr} was not instantiated")
            return nvrtc.getCUBIN(prog), lowered
        finally:
            nvrtc.destroyProgram(prog)


def _nvrtc_compile(source: str, exprs: Sequence[str], arch: str) -> int:
    """:func:`_nvrtc_build` with the library's options; returns the cubin's
    size in bytes (the compile check)."""
    return len(_nvrtc_build(source, exprs, arch)[0])


# ---------------------------------------------------------------- declarations

_declared: Dict[str, List[str]] = {}


def declare(source: str, name_expressions: Iterable[str]) -> None:
    """Declares template instantiations of ``source`` that the library launches."""
    names = _declared.setdefault(source, [])
    for expr in name_expressions:
        if expr not in names:
            names.append(expr)


def declared() -> Dict[str, List[str]]:
    """Every declared instantiation, by source file (imports all ops first)."""
    from . import ops  # noqa: F401  (ops declare their kernels at import)

    return {k: list(v) for k, v in _declared.items()}


# ---------------------------------------------------------------- compile + cache

class Kernel:
    """A launchable kernel: its CUfunction handle (``ptr``), the CuPy object
    that owns it (``raw``, a ``cupy.RawKernel``; keeps the module loaded) and
    its parameter layout (``params``, set by the first launch, with
    ``wide_params``: whether a parameter is wider than 8 bytes), on CUDA
    device ``device``."""

    __slots__ = ("name", "ptr", "raw", "params", "wide_params", "shared_limit", "device")

    def __init__(self, name: str, ptr: int, raw: object, device: int):
        self.name, self.ptr, self.raw, self.params = name, ptr, raw, None
        self.wide_params = False
        self.shared_limit = 48 * 1024  # dynamic shared memory allowed without opting in
        self.device = device

    def allow_shared(self, nbytes: int) -> None:
        """Lets launches use ``nbytes`` of dynamic shared memory (above 48 KiB a
        kernel must opt in, once per function).  The attribute belongs to the
        function's own device context, so that device is made current."""
        if nbytes > self.shared_limit:
            if nbytes > max_shared_bytes(self.device):  # the callers size their kernels to fit
                raise RuntimeError(f"kernel {self.name} needs {nbytes} bytes of shared memory, "
                                   f"more than device {self.device} allows a block "
                                   f"({max_shared_bytes(self.device)})")
            with _device(self.device):
                self.raw.max_dynamic_shared_size_bytes = nbytes
            self.shared_limit = nbytes

    def __repr__(self) -> str:
        return f"Kernel({self.name!r})"


# (source, name expression, device, extra defines) -> Kernel, and the lock
# that the first caller holds while compiling it.
_Key = Tuple[str, str, int, Tuple[str, ...]]
_functions: Dict[_Key, Kernel] = {}
_locks: Dict[_Key, threading.Lock] = {}
_locks_guard = threading.Lock()  # held only to create an entry of _locks


def _lock_of(key: _Key) -> threading.Lock:
    lock = _locks.get(key)
    if lock is None:
        with _locks_guard:
            lock = _locks.setdefault(key, threading.Lock())
    return lock


def _read_source(source: str) -> str:
    path = kernel_dir() / source
    if not path.is_file():
        raise FileNotFoundError(f"kernel source {source!r} not found in {kernel_dir()}")
    return path.read_text(encoding="utf-8")  # (whatever the locale's encoding)


def _cupy_caches_templates(cupy) -> bool:
    """Whether CuPy's disk cache gives back the modules built from name
    expressions, as it does from CuPy 14.2 on, which stores their lowered
    names beside the cubin.  CuPy 13 and 14.0 write them but never read
    them back (14.1 only where the driver can list a module's functions):
    every process would compile every kernel again."""
    match = re.match(r"(\d+)\.(\d+)", str(getattr(cupy, "__version__", "")))
    return match is not None and (int(match.group(1)), int(match.group(2))) >= (14, 2)


def _env_true(name: str) -> bool:
    """A CuPy switch read as CuPy reads it: on where its value is an integer
    equal to 1, off where it is unset, empty or anything else."""
    try:
        return int(os.environ.get(name, "") or 0) == 1
    except ValueError:
        return False


def _own_disk_cache(cupy, arch: str) -> bool:
    """Whether kernels for ``arch`` go through the run time's own disk
    cache: where CuPy's does not give them back, unless CuPy is told to
    keep its builds in memory (``CUPY_CACHE_IN_MEMORY``) or to compile with
    debug information (``CUPY_CUDA_COMPILE_WITH_DEBUG``: its options, which
    this cache's builds would not have), or the installed NVRTC cannot
    target ``arch`` (CuPy then compiles PTX for the driver)."""
    if (_cupy_caches_templates(cupy) or _env_true("CUPY_CACHE_IN_MEMORY")
            or _env_true("CUPY_CUDA_COMPILE_WITH_DEBUG")):
        return False
    return int(_ARCH_NAME.match(arch).group(1)) in _supported_arch_numbers()


def _cache_dir() -> Path:
    """The run time's own disk cache (before CuPy 14.2): ``cupy_fused/`` in
    CuPy's cache folder (``CUPY_CACHE_DIR``, default
    ``~/.cupy/kernel_cache``)."""
    base = os.environ.get("CUPY_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cupy",
                                                             "kernel_cache")
    return Path(base) / "cupy_fused"


def _write_atomically(path: Path, data: bytes) -> None:
    """Writes ``data`` to ``path`` so that no reader sees part of it (a
    temporary file in the same folder, then renamed over ``path``)."""
    tmp = tempfile.NamedTemporaryFile(dir=path.parent, delete=False)
    try:
        with tmp:
            tmp.write(data)
        os.replace(tmp.name, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp.name)
        raise


_nvrtc_build_id: Optional[str] = None


def nvrtc_build_id() -> str:
    """The installed NVRTC's build, as the header of the PTX it writes for an
    empty program names it (``"Compiler Build ID: CL-..."`` and ``"Cuda
    compilation tools, release 13.0, V13.0.88"``): finer than
    :func:`nvrtc_version`, so that a patch release of NVRTC builds its own
    entries of the run time's disk cache.  Compiled once per process."""
    global _nvrtc_build_id
    if _nvrtc_build_id is None:
        require_cupy()
        from cupy.cuda import nvrtc

        with _naming_missing_nvrtc():
            prog = nvrtc.createProgram("", "empty.cu", [], [])
            try:
                nvrtc.compileProgram(prog, [f"--gpu-architecture=compute_{min(_supported_arch_numbers())}"])
                header = nvrtc.getPTX(prog).decode(errors="replace")
            finally:
                nvrtc.destroyProgram(prog)
        _nvrtc_build_id = " ".join(line[2:].strip() for line in header.splitlines()
                                   if line.startswith("//") and line[2:].strip())
    return _nvrtc_build_id


def _cached_cubin(source: str, name_expression: str, arch: str,
                  options: Sequence[str]) -> Tuple[Path, str]:
    """The cubin of one instantiation for ``arch`` in the run time's disk
    cache, compiled (:func:`_nvrtc_build`) and stored there if missing.

    The entry's key covers the CuPy version, NVRTC's build
    (:func:`nvrtc_build_id`), the architecture, the options (which carry a
    hash of every kernel source), the source and the name expression.  An
    entry is two files, ``<key>.name`` (the
    lowered name and the cubin's SHA-256) written before ``<key>.cubin``,
    each atomically; an entry whose cubin does not match its digest (a
    disk fault, a file cut short) is built again.

    Returns:
        (the cubin's path, the kernel's lowered name).  Raises ``OSError``
        when the cache folder cannot be written.
    """
    cupy = require_cupy()
    parts = ("cubin-1", str(cupy.__version__), nvrtc_build_id(), arch, *options, source,
             _read_source(source), name_expression)
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()
    folder = _cache_dir()
    cubin, name = folder / f"{key}.cubin", folder / f"{key}.name"
    with contextlib.suppress(OSError, ValueError):
        lowered, digest = name.read_text().split("\n")
        if lowered and hashlib.sha256(cubin.read_bytes()).hexdigest() == digest:
            return cubin, lowered
    data, (lowered,) = _nvrtc_build(source, (name_expression,), arch, options)
    folder.mkdir(parents=True, exist_ok=True)
    _write_atomically(name, f"{lowered}\n{hashlib.sha256(data).hexdigest()}".encode())
    _write_atomically(cubin, data)
    return cubin, lowered


def _device(index: int):
    """A block with ``index`` the current CUDA device, by torch's guard: on
    exit it sets the previous device again only where the process has made
    that device's context, where CuPy's would make one (a compile thread,
    or a rank of a one-process-per-GPU job, whose current device had been
    left at 0, would put a context of its own on GPU 0)."""
    import torch

    return torch.cuda.device(index)


def _compile_and_load(source: str, name_expression: str, device: int,
                      defines: Tuple[str, ...]) -> Kernel:
    """Builds one instantiation for ``device`` through ``cupy.RawModule``
    (whose disk cache answers when an earlier process compiled it).  With
    a CuPy whose cache does not (:func:`_own_disk_cache`), NVRTC builds a
    cubin into the run time's own cache (:func:`_cached_cubin`), which
    ``cupy.RawModule`` loads."""
    cupy = require_cupy()
    arch = device_arch(device)
    define_options = tuple(f"-D{d}" for d in defines)
    what = f"{source}: {name_expression}" + "".join(f" -D{d}" for d in defines)
    log.info("compiling %s for %s (first use; cached afterwards)", what, arch)
    start = time.perf_counter()
    with _naming_missing_nvrtc(), _device(device):
        cached = None
        if _own_disk_cache(cupy, arch):
            try:
                cached = _cached_cubin(source, name_expression, arch, nvrtc_options() + define_options)
            except OSError as exc:
                log.warning("kernel cache %s not writable (%s): %s is compiled for this process only",
                            _cache_dir(), exc, what)
        if cached is None:
            module = cupy.RawModule(code=_read_source(source),
                                    options=nvrtc_options() + arch_options(device) + define_options,
                                    name_expressions=(name_expression,))
            raw = module.get_function(name_expression)  # NVRTC (or the disk cache) runs here
        else:
            raw = cupy.RawModule(path=str(cached[0])).get_function(cached[1])
        kernel = Kernel(name_expression, raw.kernel.ptr, raw, device)
    log.info("compiled %s for %s in %.2f s", what, arch, time.perf_counter() - start)
    return kernel


def get_function(source: str, name_expression: str, device: int,
                 defines: Tuple[str, ...] = ()) -> Kernel:
    """Returns the :class:`Kernel` of one instantiation on ``device``,
    compiling that instantiation (alone) on its first use there.

    Args:
        source: the ``.cu`` file's name in the kernel folder.
        name_expression: a declared instantiation of it (:func:`declare`).
        device: CUDA device index.
        defines: extra preprocessor definitions (``"NAME=VALUE"``) for a
            separate build, e.g. one that keeps kernels compiled from
            another folder of sources apart in the in-memory cache
            (``benchmarks/ab.py``); the library itself passes none.

    Returns:
        The kernel.  Raises ``KeyError`` for an undeclared instantiation,
        :class:`NvrtcNotFoundError` when NVRTC is missing.
    """
    key = (source, name_expression, device, defines)
    fn = _functions.get(key)
    if fn is not None:
        return fn
    if name_expression not in _declared.get(source, ()):
        raise KeyError(
            f"{name_expression!r} is not a declared instantiation of {source}; "
            "declare it with cupy_fused._runtime.declare()"
        )
    with _lock_of(key):
        fn = _functions.get(key)
        if fn is None:
            fn = _functions[key] = _compile_and_load(source, name_expression, device, defines)
    return fn


_families: List["KernelFamily"] = []


class KernelFamily:
    """The instantiations of one kernel source that an op launches, looked up
    by a key of the op's choosing (e.g. the dtype).  Declares them at
    construction (import time; nothing is compiled) and caches the launchable
    :class:`Kernel` per (key, device) for the launch path."""

    def __init__(self, source: str, expressions: Dict[object, str]):
        self.source = source
        self.expressions = dict(expressions)
        declare(source, self.expressions.values())
        self._kernels: Dict[Tuple[object, int], Kernel] = {}
        _families.append(self)

    def get(self, key, device: int) -> Kernel:
        try:  # runs on every launch: one dict lookup once compiled
            return self._kernels[key, device]
        except KeyError:
            kernel = self._kernels[key, device] = get_function(self.source, self.expressions[key],
                                                               device)
            return kernel


def compiled_modules() -> int:
    """Number of modules compiled (or loaded from disk cache) in this
    process: one per instantiation and device."""
    return len(_functions)


# ---------------------------------------------------------------- many at once

def default_workers() -> int:
    """Compiles :func:`precompile` and :func:`compile_check` run at once: the
    CPUs this process may use, at most 16 (which bounds the memory that the
    NVRTC compiles in flight hold together)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(16, cpus))


class _Progress:
    """Progress on stderr: tqdm's bar when tqdm is installed, else one line
    per finished item."""

    def __init__(self, total: int, desc: str, enabled: bool):
        self.total, self.desc, self.done, self.enabled = total, desc, 0, enabled
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                self.bar = tqdm(total=total, desc=desc, unit="kernel", file=sys.stderr)

    def update(self, label: str, seconds: float) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
        elif self.enabled:
            print(f"  {self.desc} [{self.done}/{self.total}] {label} ({seconds:.1f} s)",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


_Job = Tuple[str, str]  # (source, name expression)


def _check_run_options(progress, workers) -> None:
    """:func:`precompile`'s and :func:`compile_check`'s ``progress`` (a
    bool) and ``workers`` (None or an int of at least 1), before anything
    compiles."""
    from ._validation import check_int
    from .settings import check_flag

    check_flag("progress", progress)
    if workers is not None:
        check_int("workers", workers, 1, expected="an int or None")


def _run_jobs(jobs: Sequence[_Job], build: Callable[[str, str], object], desc: str,
              progress: bool, workers: Optional[int]) -> Dict[_Job, Tuple[object, float]]:
    """Runs ``build(source, expr)`` for every job on a thread pool (NVRTC
    releases the GIL, so compiles run in parallel).  Returns
    ``{job: (result, seconds)}``; raises one :class:`CompileError` listing
    every failure once all have run, or :class:`NvrtcNotFoundError` at once."""

    def timed(job: _Job):
        start = time.perf_counter()
        value = build(*job)
        return value, time.perf_counter() - start

    bar = _Progress(len(jobs), desc, progress)
    results: Dict[_Job, Tuple[object, float]] = {}
    failures: List[str] = []
    pool = ThreadPoolExecutor(max_workers=workers or default_workers(),
                              thread_name_prefix="cupy_fused-compile")
    try:
        futures = {pool.submit(timed, job): job for job in jobs}
        for future in as_completed(futures):
            job = futures[future]
            try:
                results[job] = future.result()
            except (CompileError, KeyError) as exc:
                failures.append(str(exc))
            except NvrtcNotFoundError:
                raise
            except Exception as exc:  # noqa: BLE001 - e.g. CuPy's CompileException: listed
                failures.append(f"{job[0]}: {job[1]} failed: {type(exc).__name__}: {exc}")
            bar.update(f"{job[0]}: {job[1]}", results.get(job, (None, 0.0))[1])
    finally:
        # On an error (or Ctrl-C) drop what has not started; running compiles finish.
        pool.shutdown(wait=True, cancel_futures=True)
        bar.close()
    if failures:
        raise CompileError(f"{len(failures)} of {len(jobs)} instantiations failed:\n\n"
                           + "\n\n".join(failures))
    return {job: results[job] for job in jobs}


def _key_dtypes(key) -> set:
    import torch

    parts = key if isinstance(key, tuple) else (key,)
    return {p for p in parts if isinstance(p, torch.dtype)}


def _selection(families, dtypes) -> List[_Job]:
    """The (source, name expression) pairs :func:`precompile` builds."""
    table = declared()
    if families is None:
        chosen = list(table.items())
    else:
        if isinstance(families, (str, KernelFamily)):
            families = [families]
        elif isinstance(families, bytes) or not isinstance(families, collections.abc.Iterable):
            raise TypeError(f"families must be a .cu file name, a KernelFamily, an iterable of them, "
                            f"or None, got {type(families).__name__}")
        chosen = []
        for family in families:
            if isinstance(family, KernelFamily):
                chosen.append((family.source, list(family.expressions.values())))
            elif family in table:
                chosen.append((family, table[family]))
            else:
                raise ValueError(f"no declared kernel source {family!r}; declared: "
                                 + ", ".join(sorted(table)))

    def keep(source: str, expr: str) -> bool:  # (every kernel, unless dtypes narrows it below)
        return True

    if dtypes is not None:
        import torch

        from ._validation import FLOAT_DTYPES

        dtypes = [dtypes] if isinstance(dtypes, torch.dtype) else dtypes
        wanted = set(dtypes) if isinstance(dtypes, (list, tuple, set, frozenset)) else None
        if not wanted or not wanted <= set(FLOAT_DTYPES):
            raise ValueError("dtypes must be torch.float32, torch.float16 or torch.bfloat16, or a "
                             f"list of them, got {dtypes!r}")
        keys: Dict[_Job, list] = {}
        for fam in _families:
            for key, expr in fam.expressions.items():
                keys.setdefault((fam.source, expr), []).append(key)

        def keep(source: str, expr: str) -> bool:
            found = keys.get((source, expr))
            if not found:  # declared outside a family: nothing to filter by
                return True
            return any(not _key_dtypes(k) or _key_dtypes(k) & wanted for k in found)

    jobs: Dict[_Job, None] = {}  # ordered, without repeats
    for source, exprs in chosen:
        for expr in exprs:
            if keep(source, expr):
                jobs[source, expr] = None
    return list(jobs)


def precompile(families=None, device: Union[int, str, None] = None, dtypes=None,
               progress: bool = True, workers: Optional[int] = None) -> Dict[_Job, float]:
    """Compiles declared kernel instantiations up front, so that first
    launches find them ready, e.g. at the start of a training job, or once
    per machine (``python -m cupy_fused --precompile``) to fill CuPy's disk
    cache for later processes.  Compiles run on a thread pool.

    Args:
        families: which kernels: ``.cu`` file names (``"gemm_tf32.cu"``) or
            :class:`KernelFamily` objects (e.g. ``cupy_fused.ops.gemm.KERNELS``),
            one or a list; None for every declared instantiation.
        device: a CUDA device (index or ``torch.device``), or None for the
            current device: each instantiation is compiled and loaded there
            as its first launch would, so the launch path then finds it in
            memory and later processes in CuPy's disk cache.  Or an
            architecture name (``"sm_90a"``): NVRTC alone, no GPU needed;
            this checks that they compile and caches nothing.
        dtypes: a torch dtype (float32, float16, bfloat16) or a list of
            them: only instantiations whose family key names one of them, or
            names no dtype (the float32 GEMMs' keys do not); None for all.
        progress: show progress on stderr (a tqdm bar if tqdm is installed,
            else one line per instantiation).
        workers: compiles in flight at once; None for
            :func:`default_workers`.

    Returns:
        ``{(source, name expression): seconds}`` for each instantiation
        covered (near 0 for one already compiled in this process).  Raises
        :class:`CompileError` listing every failure, once all have run;
        :class:`NvrtcNotFoundError` when NVRTC is missing; TypeError or
        ValueError for a device, families, dtypes, progress or workers of
        another kind, before anything compiles.
    """
    if not (device is None or isinstance(device, str)
            or (isinstance(device, numbers.Integral) and not isinstance(device, bool) and device >= 0)
            or getattr(device, "type", None) == "cuda"):
        raise ValueError(f"device must be a CUDA device (an index >= 0 or a torch.device of type "
                         f"'cuda'), an architecture name such as 'sm_90a', or None; got {device!r}")
    _check_run_options(progress, workers)
    jobs = _selection(families, dtypes)
    kernel_dir()  # (a missing folder named once, not by every job)
    if isinstance(device, str):
        arch = device
        _check_arch(arch)

        def build(source: str, expr: str):
            return _nvrtc_compile(source, (expr,), arch)
    else:
        if not isinstance(device, numbers.Integral) and device is not None:  # a torch.device
            device = device.index
        if device is None:
            cupy = require_cupy()
            try:
                device = cupy.cuda.runtime.getDevice()
            except cupy.cuda.runtime.CUDARuntimeError as exc:
                raise RuntimeError(
                    "no CUDA GPU is visible; to check that the kernels compile without one, "
                    "pass an architecture, e.g. precompile(device='sm_90a')") from exc
        index = int(device)
        try:
            arch = device_arch(index)
        except require_cupy().cuda.runtime.CUDARuntimeError as exc:
            raise RuntimeError(
                f"CUDA device {index} is not visible ({exc}); to check that the kernels "
                "compile without it, pass an architecture, e.g. precompile(device='sm_90a')"
            ) from exc

        def build(source: str, expr: str):
            return get_function(source, expr, index)
    results = _run_jobs(jobs, build, f"precompile {arch}", progress, workers)
    return {job: seconds for job, (_, seconds) in results.items()}


def compile_check(arch: str, sources: Optional[Iterable[str]] = None, *,
                  progress: bool = False, workers: Optional[int] = None) -> Dict[str, int]:
    """Compiles every declared instantiation for ``arch`` with NVRTC alone (no
    GPU, no driver needed), each as its own program, as the run time
    compiles them.

    Args:
        arch: e.g. ``"sm_90"``, or ``"sm_90a"`` for the Hopper-only kernel
            bodies.
        sources: ``.cu`` file names (or one); None for every file in the kernel
            folder, which must hold every declared source.
        progress: show progress on stderr (see :func:`precompile`).
        workers: compiles in flight at once; None for :func:`default_workers`.

    Returns:
        ``{source: total cubin size in bytes}``.  Raises :class:`CompileError`
        with the NVRTC logs when any instantiation fails (after trying all),
        when a ``.cu`` file has no declared instantiation (every kernel
        must be covered) or a declared source is not in the folder;
        ``ValueError`` for an architecture NVRTC does not know, TypeError or
        ValueError for progress or workers of another kind.
    """
    _check_arch(arch)
    _check_run_options(progress, workers)
    table = declared()
    if isinstance(sources, str):  # one file name, not its characters
        sources = [sources]
    if sources is None:
        names = source_files()
        missing = sorted(set(table) - set(names))
        if missing:  # (a broken install, or a kernel folder of one's own lacking files)
            raise CompileError(f"declared kernel sources missing from {kernel_dir()}: "
                               f"{', '.join(missing)}")
    else:
        names = list(sources)
    jobs: List[_Job] = []
    for source in names:
        exprs = table.get(source)
        if not exprs:
            raise CompileError(f"{source}: no declared instantiation, so nothing would test it")
        jobs.extend((source, expr) for expr in exprs)

    def build(source: str, expr: str) -> int:
        return _nvrtc_compile(source, (expr,), arch)

    results = _run_jobs(jobs, build, arch, progress, workers)
    sizes = dict.fromkeys(names, 0)
    for (source, _), (size, _) in results.items():
        sizes[source] += size
    return sizes
