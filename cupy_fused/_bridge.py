"""The DLPack / stream bridge: the one place where torch tensors meet CuPy
and kernels are launched.

* :func:`launch` runs a compiled kernel on the *current torch stream of the
  tensor's device*, with that device current.  Arguments are raw device
  pointers (``tensor.data_ptr()``), 64-bit integers and doubles, packed into
  one parameter buffer handed to ``cuLaunchKernel`` (through CuPy's driver
  bindings).  No DLPack capsule, no CuPy array and no CuPy stream object is
  made per call: that is what keeps the per-call host cost near a torch
  elementwise op (see ``benchmarks/host_overhead.py``).
* :func:`to_cupy` / :func:`to_torch` convert zero-copy through DLPack (same
  memory, writes visible both ways) for the CuPy-array entry points.
"""
from __future__ import annotations

import ctypes
import struct
import sys
import threading
from typing import Dict, Sequence, Tuple

import torch

from ._cupy import require_cupy

# cuLaunchKernel's `extra` protocol (cuda.h): the parameters as one buffer.
_CU_LAUNCH_PARAM_END = 0
_CU_LAUNCH_PARAM_BUFFER_POINTER = 1
_CU_LAUNCH_PARAM_BUFFER_SIZE = 2
MAX_PARAM_BYTES = 4096  # CUDA's limit on kernel parameters

_local = threading.local()
_formats: Dict[Tuple[type, ...], struct.Struct] = {}


class _ParamBuffer:
    """Per-thread parameter buffer.  cuLaunchKernel copies the parameters
    before it returns, so one buffer is reused by every launch."""

    def __init__(self):
        self.data = ctypes.create_string_buffer(MAX_PARAM_BYTES)
        self.size = ctypes.c_size_t(0)
        self.extra = (ctypes.c_void_p * 5)(
            _CU_LAUNCH_PARAM_BUFFER_POINTER, ctypes.addressof(self.data),
            _CU_LAUNCH_PARAM_BUFFER_SIZE, ctypes.addressof(self.size), _CU_LAUNCH_PARAM_END)
        self.extra_ptr = ctypes.addressof(self.extra)


def _param_format(args: tuple) -> struct.Struct:
    """Every kernel parameter is 8 bytes: a pointer or ``long long`` (Python
    int) or a ``double`` (Python float), so the C layout is the packed one."""
    key = tuple(map(type, args))
    fmt = _formats.get(key)
    if fmt is None:
        codes = []
        for t in key:
            if t is float:
                codes.append("d")
            elif t is int or t is bool:
                codes.append("q")
            else:
                raise TypeError(f"kernel arguments must be int or float, got {t.__name__}")
        fmt = _formats[key] = struct.Struct("<" + "".join(codes))
    return fmt


def current_stream_ptr(device_index: int) -> int:
    """Raw handle of torch's current stream on ``device_index``."""
    return _raw_stream(device_index)


try:
    _raw_stream = torch._C._cuda_getCurrentRawStream
except AttributeError:  # pragma: no cover - very old torch
    def _raw_stream(device_index: int) -> int:
        return torch.cuda.current_stream(device_index).cuda_stream


def launch(kernel, grid: Sequence[int], block: Sequence[int], args: tuple, device_index: int,
           shared_mem: int = 0) -> None:
    """Launches ``kernel`` (a :class:`cupy_fused._runtime.Kernel`) on torch's
    current stream of ``device_index``.  ``args``: ints (pointers, 64-bit
    integers) and floats (doubles), matching the kernel's parameters.  The
    CUDA device is switched only when it is not already current."""
    cupy = require_cupy()
    buf = getattr(_local, "buffer", None)
    if buf is None:
        buf = _local.buffer = _ParamBuffer()
    fmt = _param_format(args)
    fmt.pack_into(buf.data, 0, *args)
    buf.size.value = fmt.size
    gx, gy, gz = (tuple(grid) + (1, 1))[:3]
    bx, by, bz = (tuple(block) + (1, 1))[:3]
    runtime = cupy.cuda.runtime
    if runtime.getDevice() == device_index:
        cupy.cuda.driver.launchKernel(kernel.ptr, gx, gy, gz, bx, by, bz, shared_mem,
                                      _raw_stream(device_index), 0, buf.extra_ptr)
    else:
        with cupy.cuda.Device(device_index):
            cupy.cuda.driver.launchKernel(kernel.ptr, gx, gy, gz, bx, by, bz, shared_mem,
                                          _raw_stream(device_index), 0, buf.extra_ptr)


def to_cupy(tensor: torch.Tensor):
    """Zero-copy CuPy view of a CUDA tensor (shares memory)."""
    return require_cupy().from_dlpack(tensor)


def to_torch(array) -> torch.Tensor:
    """Zero-copy torch view of a CuPy array (shares memory)."""
    return torch.from_dlpack(array)


def is_cupy_array(obj) -> bool:
    cupy = sys.modules.get("cupy")  # nothing is a CuPy array before CuPy is imported
    return cupy is not None and isinstance(obj, cupy.ndarray)
