"""The DLPack / stream bridge: the one place where torch tensors meet CuPy
and kernels are launched.

* :func:`launch` runs a compiled kernel on the *current torch stream of the
  tensor's device*, with that device current.  Arguments are raw device
  pointers (``tensor.data_ptr()``), 64-bit integers, doubles and TMA
  descriptors (128 ``bytes``, for ``TensorMap`` parameters), packed into
  one parameter buffer by the layout of the kernel's declared signature
  (:func:`kernel_signature`: a wrong count or type is a ``TypeError``
  before the launch) and handed to ``cuLaunchKernel`` (through CuPy's driver
  bindings).  No DLPack capsule, no CuPy array and no CuPy stream object is
  made per call: that is what keeps the per-call host cost near a torch
  elementwise op (see ``benchmarks/host_overhead.py``).
* :func:`to_cupy` / :func:`to_torch` convert zero-copy through DLPack (same
  memory, writes visible both ways) for the CuPy-array entry points.
"""
from __future__ import annotations

import ctypes
import functools
import re
import struct
import sys
import threading
from typing import Dict, Tuple

import torch

from ._cupy import require_cupy

MAX_PARAM_BYTES = 4096  # CUDA's limit on kernel parameters

_local = threading.local()


class _ParamBuffer:
    """Per-thread parameter buffer.  cuLaunchKernel copies the parameters
    before it returns, so one buffer is reused by every launch.  ``data``
    holds the packed values; ``params_ptr`` is the address of the ``void*[]``
    array of cuLaunchKernel's ``kernelParams``, pointing at each 8-byte slot
    of ``data`` (fixed once: that fits every signature of 8-byte
    parameters).  A signature with a wider parameter (a ``TensorMap``) gets
    its own pointer array, made once per thread (:meth:`pointers_for`)."""

    def __init__(self):
        self.data = ctypes.create_string_buffer(MAX_PARAM_BYTES)
        base = ctypes.addressof(self.data)
        self.pointers = (ctypes.c_void_p * (MAX_PARAM_BYTES // 8))(
            *(base + 8 * i for i in range(MAX_PARAM_BYTES // 8)))
        self.params_ptr = ctypes.addressof(self.pointers)
        self._irregular: Dict[str, tuple] = {}

    def pointers_for(self, layout: struct.Struct) -> int:
        """Address of a ``kernelParams`` array for ``layout``, one of the
        :data:`_IRREGULAR` layouts: a pointer at each parameter's offset."""
        entry = self._irregular.get(layout.format)
        if entry is None:
            base = ctypes.addressof(self.data)
            offsets = _IRREGULAR[layout.format]
            array = (ctypes.c_void_p * len(offsets))(*(base + o for o in offsets))
            entry = self._irregular[layout.format] = (array, ctypes.addressof(array))
        return entry[1]


_GLOBAL = re.compile(
    r"__global__\s+void\s+(?:__launch_bounds__\s*\((?:[^()]|\([^()]*\))*\)\s*)?"
    r"(\w+)\s*\(([^)]*)\)")
_QUALIFIERS = {"const", "__restrict__", "volatile", "__grid_constant__"}
_signatures: Dict[str, struct.Struct] = {}
TENSOR_MAP_BYTES = 128  # a TensorMap (CUDA's CUtensorMap), passed by value
# Formats of the layouts with a parameter wider than 8 bytes -> the byte
# offset of every parameter (kernelParams points at each).
_IRREGULAR: Dict[str, Tuple[int, ...]] = {}


def _parameter_code(kernel: str, parameter: str) -> str:
    """struct code of one declared parameter: a pointer or ``i64`` (``q``), a
    ``double`` (``d``), or a ``TensorMap`` (128 bytes, ``128s``)."""
    if "*" in parameter:
        return "q"
    words = [w for w in parameter.split() if w not in _QUALIFIERS]
    ctype = " ".join(words[:-1])
    if ctype in ("i64", "long long", "int64_t", "long long int"):
        return "q"
    if ctype == "double":
        return "d"
    if ctype in ("TensorMap", "cf::TensorMap"):
        return f"{TENSOR_MAP_BYTES}s"
    raise TypeError(f"kernel {kernel}: parameter {parameter.strip()!r} is not a pointer, i64, "
                    "double or TensorMap")


def _layout(codes) -> struct.Struct:
    """The packed layout of parameters with struct codes ``codes``; a layout
    with a parameter wider than 8 bytes records its offsets in
    :data:`_IRREGULAR`.  (Packed without padding: cuLaunchKernel copies each
    parameter from its own pointer, so only the kernel's own layout needs
    the alignment.)"""
    layout = struct.Struct("<" + "".join(codes))
    if any(c != "q" and c != "d" for c in codes):
        offsets, at = [], 0
        for c in codes:
            offsets.append(at)
            at += struct.calcsize("<" + c)
        _IRREGULAR[layout.format] = tuple(offsets)
    return layout


def kernel_signature(kernel: str) -> struct.Struct:
    """The packed parameter layout of the ``__global__`` function ``kernel``
    (its plain name, or a name expression such as ``cf::scale_add<float>``),
    read from its declaration in the kernel sources.  Cached per name."""
    base = kernel.split("<", 1)[0].rsplit("::", 1)[-1].strip()
    layout = _signatures.get(base)
    if layout is None:
        declarations = _declarations()
        if base not in declarations:
            from ._runtime import kernel_dir

            raise TypeError(f"kernel {kernel}: no __global__ declaration of {base!r} in "
                            f"{kernel_dir()}")
        params = [p for p in declarations[base].split(",") if p.strip()]
        layout = _layout([_parameter_code(base, p) for p in params])
        _signatures[base] = layout
    return layout


def declarations_in(folder) -> Dict[str, str]:
    """Parameter list of every ``__global__`` function of the ``.cu`` /
    ``.cuh`` sources in ``folder`` (a path), by name."""
    found: Dict[str, str] = {}
    from ._runtime import source_paths

    for path in source_paths(folder):
        for match in _GLOBAL.finditer(path.read_text(encoding="utf-8")):
            found.setdefault(match.group(1), match.group(2))
    return found


@functools.lru_cache(maxsize=1)
def _declarations() -> Dict[str, str]:
    """:func:`declarations_in` the kernel sources, read once."""
    from ._runtime import kernel_dir

    return declarations_in(kernel_dir())


def _param_struct(kernel, args: tuple) -> struct.Struct:
    """Parameter layout of ``kernel`` from its declared signature, cached on
    the kernel with whether it is one of the :data:`_IRREGULAR` layouts (so
    that a launch tests a flag, not the layout's format string)."""
    layout = kernel_signature(kernel.name)
    kernel.wide_params = layout.format in _IRREGULAR
    kernel.params = layout
    return layout


def _packing_error(kernel, args: tuple, exc: Exception) -> TypeError:
    """A clear error for arguments that do not fit the kernel's signature."""
    layout = kernel_signature(kernel.name)
    codes = re.findall(r"\d*[a-z]", layout.format.lstrip("<"))
    if len(args) != len(codes):
        return TypeError(f"kernel {kernel.name}: {len(args)} arguments for its {len(codes)} "
                         "parameters")
    for i, (code, value) in enumerate(zip(codes, args)):
        if code == "q":
            ok, expected = type(value) in (int, bool), "an int (pointer or i64)"
        elif code == "d":
            ok, expected = type(value) in (int, float), "a float (double)"
        else:
            ok = type(value) is bytes and len(value) == TENSOR_MAP_BYTES
            expected = f"{TENSOR_MAP_BYTES} bytes (a TensorMap)"
        if not ok:
            return TypeError(f"kernel {kernel.name}: argument {i} must be {expected}, got "
                             f"{type(value).__name__}")
    return TypeError(f"kernel {kernel.name}: arguments do not fit its parameters ({exc})")


def current_stream_ptr(device_index: int) -> int:
    """Raw handle of torch's current stream on ``device_index``."""
    return _raw_stream(device_index)


try:
    _raw_stream = torch._C._cuda_getCurrentRawStream
except AttributeError:  # pragma: no cover - very old torch
    def _raw_stream(device_index: int) -> int:
        return torch.cuda.current_stream(device_index).cuda_stream


def launch(kernel, grid: Tuple[int, int, int], block: int, args: tuple, device_index: int,
           shared_mem: int = 0) -> None:
    """Launches ``kernel`` (a :class:`cupy_fused._runtime.Kernel`) on torch's
    current stream of ``device_index``.  ``grid``: (x, y, z) blocks; ``block``:
    threads per block (1-D).  ``args``: ints (pointers, 64-bit integers),
    floats (doubles) and 128-byte ``bytes`` (TMA descriptors, for
    ``TensorMap`` parameters), matching the kernel's parameters.  ``shared_mem``: bytes
    of dynamic shared memory (above 48 KiB the kernel is opted in on first
    use).  The CUDA device is switched only when it is not already current
    (by torch's guard, which sets no device back whose context the process
    has not made: CuPy's would make one).
    (This runs on every launch, so it is written for few Python operations.)"""
    try:
        buf = _local.buffer
    except AttributeError:  # this thread's first launch (binds a context: first)
        buf = _first_launch_of_thread()
    if shared_mem and shared_mem > kernel.shared_limit:  # (cuFuncSetAttribute takes the context)
        kernel.allow_shared(shared_mem)
    layout = kernel.params or _param_struct(kernel, args)
    try:
        layout.pack_into(buf.data, 0, *args)
    except struct.error as exc:  # before any launch: a wrong count or type
        raise _packing_error(kernel, args, exc) from None
    if kernel.wide_params:
        # struct pads or cuts a bytes value to its field: check the lengths.
        if any(type(a) is bytes and len(a) != TENSOR_MAP_BYTES for a in args):
            raise _packing_error(kernel, args, struct.error("a TensorMap is 128 bytes"))
        params = buf.pointers_for(layout)
    else:
        params = buf.params_ptr
    if _get_device() == device_index:
        _launch_kernel(kernel.ptr, grid[0], grid[1], grid[2], block, 1, 1, shared_mem,
                       _raw_stream(device_index), params, 0)
    else:
        with torch.cuda.device(device_index):
            _launch_kernel(kernel.ptr, grid[0], grid[1], grid[2], block, 1, 1, shared_mem,
                           _raw_stream(device_index), params, 0)


def _first_launch_of_thread() -> "_ParamBuffer":
    """The calling thread's parameter buffer, made on its first launch, which
    also binds the current device's CUDA context to the thread where none is
    bound.  The runtime device of a new thread reads 0 without a context
    bound to it, and torch's device guards do not set a device that already
    reads as current, so a thread's first work on device 0 (a DataParallel
    replica, a thread pool's worker) can reach cuLaunchKernel, which takes
    the thread's context, with none (CUDA_ERROR_INVALID_CONTEXT).
    cudaFree(NULL) binds it, as the runtime's own calls do."""
    cupy = require_cupy()
    if cupy.cuda.driver.ctxGetCurrent() == 0:
        cupy.cuda.runtime.free(0)
    buf = _local.buffer = _ParamBuffer()
    return buf


def _bind_driver() -> int:
    """Binds ``_get_device`` and ``_launch_kernel`` to CuPy's cudaGetDevice and
    cuLaunchKernel on the first launch (importing cupy_fused does not import
    CuPy), and returns the current device as ``_get_device`` does."""
    global _get_device, _launch_kernel
    cupy = require_cupy()
    _launch_kernel = cupy.cuda.driver.launchKernel
    _get_device = cupy.cuda.runtime.getDevice
    return _get_device()


# launch() calls _get_device() before _launch_kernel, so the first call binds both.
_get_device = _bind_driver
_launch_kernel = None


def to_cupy(tensor: torch.Tensor):
    """Zero-copy CuPy view of a CUDA tensor (shares memory)."""
    return require_cupy().from_dlpack(tensor)


def to_torch(array) -> torch.Tensor:
    """Zero-copy torch view of a CuPy array (shares memory)."""
    return torch.from_dlpack(array)


def is_cupy_array(obj) -> bool:
    cupy = sys.modules.get("cupy")  # nothing is a CuPy array before CuPy is imported
    return cupy is not None and isinstance(obj, cupy.ndarray)
