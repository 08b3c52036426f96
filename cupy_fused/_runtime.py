"""Kernel runtime: the one place that turns a ``kernels_cu/*.cu`` file into a
launchable function.

* Sources live in ``kernels_cu/`` (shipped inside the wheel as
  ``cupy_fused/kernels_cu``).  A ``.cu`` file may include the shared ``.cuh``
  headers of that folder.
* Every template instantiation the library launches is *declared* up front with
  :func:`declare` (pure Python, at import).  A source is compiled once per
  device with all its declared instantiations as NVRTC name expressions.
* Compiled modules are cached in process per (source, options, device); CuPy's
  on-disk kernel cache (``CUPY_CACHE_DIR``, default ``~/.cupy/kernel_cache``)
  keeps the binaries across processes.  The NVRTC options carry a hash of all
  kernel sources, so editing a header invalidates the disk cache too.
* On compute capability 9.0 (H100, H200) sources are compiled for ``sm_90a``,
  which adds Hopper's architecture-specific instructions (``wgmma``) to
  sm_90; kernels test ``__CUDA_ARCH_FEAT_SM90_ALL`` before using them.
* Importing :mod:`cupy_fused` compiles nothing; the first launch compiles.
* :func:`compile_check` compiles every declared instantiation with NVRTC alone,
  for a given architecture, without a GPU or driver (the CPU CI tier).
"""
from __future__ import annotations

import hashlib
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

from ._cupy import require_cupy

# Fixed NVRTC options (the architecture is added per device / per check).
BASE_OPTIONS: Tuple[str, ...] = ("-std=c++17",)


def kernel_dir() -> Path:
    """Folder holding the ``.cu``/``.cuh`` sources.

    ``CUPY_FUSED_KERNEL_DIR`` overrides; otherwise the copy installed inside the
    package (wheel), else the source tree's top-level ``kernels_cu/``.
    """
    override = os.environ.get("CUPY_FUSED_KERNEL_DIR")
    if override:
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
    return sorted(p.name for p in kernel_dir().glob("*.cu"))


def _sources_hash() -> str:
    digest = hashlib.sha256()
    for path in sorted(kernel_dir().glob("*.cu*")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


_options_cache: Optional[Tuple[str, ...]] = None


def nvrtc_options() -> Tuple[str, ...]:
    """NVRTC options without the architecture (same for every source).

    ``CUPY_FUSED_NVRTC_OPTIONS`` appends options (space-separated), e.g.
    ``-lineinfo`` for profiling or ``-D`` tuning macros of a kernel file."""
    global _options_cache
    if _options_cache is None:
        _options_cache = BASE_OPTIONS + (
            f"-I{kernel_dir()}",
            f"-DCUPY_FUSED_SOURCES_HASH=0x{_sources_hash()}ULL",
        ) + tuple(os.environ.get("CUPY_FUSED_NVRTC_OPTIONS", "").split())
    return _options_cache


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

@dataclass(frozen=True)
class _ModuleKey:
    source: str
    options: Tuple[str, ...]
    device: int


class Kernel:
    """A launchable kernel: its CUfunction handle (``ptr``), the CuPy object
    that owns it (``raw``, a ``cupy.RawKernel``; keeps the module loaded) and
    its parameter layout (``params``, set by the first launch), on CUDA device
    ``device``."""

    __slots__ = ("name", "ptr", "raw", "params", "shared_limit", "device")

    def __init__(self, name: str, ptr: int, raw: object, device: int):
        self.name, self.ptr, self.raw, self.params = name, ptr, raw, None
        self.shared_limit = 48 * 1024  # dynamic shared memory allowed without opting in
        self.device = device

    def allow_shared(self, nbytes: int) -> None:
        """Lets launches use ``nbytes`` of dynamic shared memory (above 48 KiB a
        kernel must opt in, once per function).  The attribute belongs to the
        function's own device context, so that device is made current."""
        if nbytes > self.shared_limit:
            with require_cupy().cuda.Device(self.device):
                self.raw.max_dynamic_shared_size_bytes = nbytes
            self.shared_limit = nbytes

    def __repr__(self) -> str:
        return f"Kernel({self.name!r})"


_modules: Dict[_ModuleKey, object] = {}
_functions: Dict[Tuple[str, str, int, Tuple[str, ...]], object] = {}
_lock = threading.Lock()


def _read_source(source: str) -> str:
    path = kernel_dir() / source
    if not path.is_file():
        raise FileNotFoundError(f"kernel source {source!r} not found in {kernel_dir()}")
    return path.read_text()


def get_function(source: str, name_expression: str, device: int,
                 defines: Tuple[str, ...] = ()) -> Kernel:
    """Returns the :class:`Kernel` of one instantiation on ``device``.

    Compiles ``source`` (all its declared instantiations at once) on first use
    for that device.  Raises ``KeyError`` for an undeclared instantiation.
    ``defines``: extra preprocessor definitions (``"NAME=VALUE"``) for a
    separate build of the source, e.g. the tuning knobs a kernel file reads
    (``scripts/tune_gn.py``); the library itself passes none.
    """
    key = (source, name_expression, device, defines)
    fn = _functions.get(key)
    if fn is not None:
        return fn
    with _lock:
        fn = _functions.get(key)
        if fn is not None:
            return fn
        names = _declared.get(source, [])
        if name_expression not in names:
            raise KeyError(
                f"{name_expression!r} is not a declared instantiation of {source}; "
                "declare it with cupy_fused._runtime.declare()"
            )
        cupy = require_cupy()
        mkey = _ModuleKey(source, nvrtc_options() + arch_options(device)
                          + tuple(f"-D{d}" for d in defines), device)
        with cupy.cuda.Device(device):
            module = _modules.get(mkey)
            if module is None:
                module = cupy.RawModule(
                    code=_read_source(source),
                    options=mkey.options,
                    name_expressions=tuple(names),
                )
                _modules[mkey] = module
            raw = module.get_function(name_expression)
            fn = Kernel(name_expression, raw.kernel.ptr, raw, device)
        _functions[key] = fn
        return fn


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

    def get(self, key, device: int) -> Kernel:
        try:  # runs on every launch: one dict lookup once compiled
            return self._kernels[key, device]
        except KeyError:
            kernel = self._kernels[key, device] = get_function(self.source, self.expressions[key],
                                                               device)
            return kernel


def compiled_modules() -> int:
    """Number of modules compiled (or loaded from disk cache) in this process."""
    return len(_modules)


# ---------------------------------------------------------------- compile check

class CompileError(RuntimeError):
    """NVRTC rejected a source; the message holds the compiler log."""


def compile_check(arch: str, sources: Optional[Iterable[str]] = None) -> Dict[str, int]:
    """Compiles every declared instantiation for ``arch`` (e.g. ``"sm_90"``,
    or ``"sm_90a"`` for the Hopper-only kernel bodies) with NVRTC only (no
    GPU, no driver needed).

    Returns ``{source: cubin size in bytes}``.  Raises :class:`CompileError`
    with the NVRTC log when a source fails, or when a ``.cu`` file has no
    declared instantiation (every kernel must be covered).
    """
    require_cupy()
    from cupy.cuda import nvrtc

    table = declared()
    names = list(sources) if sources is not None else source_files()
    sizes: Dict[str, int] = {}
    for source in names:
        exprs = table.get(source)
        if not exprs:
            raise CompileError(f"{source}: no declared instantiation, so nothing would test it")
        prog = nvrtc.createProgram(_read_source(source), source, [], [])
        try:
            for expr in exprs:
                nvrtc.addNameExpression(prog, expr)
            options = list(nvrtc_options()) + [f"--gpu-architecture={arch}"]
            try:
                nvrtc.compileProgram(prog, options)
            except nvrtc.NVRTCError as exc:
                raise CompileError(
                    f"{source} for {arch} failed: {exc}\n{nvrtc.getProgramLog(prog)}"
                ) from None
            for expr in exprs:
                if not nvrtc.getLoweredName(prog, expr):
                    raise CompileError(f"{source}: {expr} was not instantiated")
            sizes[source] = len(nvrtc.getCUBIN(prog))
        finally:
            nvrtc.destroyProgram(prog)
    return sizes
