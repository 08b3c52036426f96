"""The DLPack / stream bridge: the one place where torch tensors meet CuPy.

* :func:`launch` runs a compiled kernel on the *current torch stream of the
  tensor's device*, with that device current.  Kernel arguments are raw device
  pointers (``tensor.data_ptr()``) and scalars, so a launch needs no DLPack
  round trip at all: that is what keeps the per-call host cost close to a
  torch elementwise op.
* :func:`to_cupy` / :func:`to_torch` convert zero-copy through DLPack (same
  memory, writes visible both ways) for the CuPy-array entry points.
"""
from __future__ import annotations

from typing import Dict, Sequence, Tuple

import torch

from ._cupy import require_cupy

_streams: Dict[Tuple[int, int], object] = {}


def _raw_stream(device_index: int) -> int:
    getter = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if getter is not None:
        return getter(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream  # pragma: no cover


def current_stream(device_index: int):
    """CuPy view (``cupy.cuda.ExternalStream``) of torch's current stream on
    ``device_index``; one cached object per (device, stream)."""
    ptr = _raw_stream(device_index)
    key = (device_index, ptr)
    stream = _streams.get(key)
    if stream is None:
        cupy = require_cupy()
        stream = cupy.cuda.ExternalStream(ptr, device_index)
        _streams[key] = stream
    return stream


def launch(function, grid: Sequence[int], block: Sequence[int], args: tuple, device_index: int,
           shared_mem: int = 0) -> None:
    """Launches ``function`` on torch's current stream of ``device_index``.

    ``args``: ``int`` (pointers, 64-bit integers) and ``float`` (double).
    The CUDA device is switched only when it is not already current.
    """
    cupy = require_cupy()
    stream = current_stream(device_index)
    if cupy.cuda.runtime.getDevice() == device_index:
        function(tuple(grid), tuple(block), args, shared_mem=shared_mem, stream=stream)
    else:
        with cupy.cuda.Device(device_index):
            function(tuple(grid), tuple(block), args, shared_mem=shared_mem, stream=stream)


def to_cupy(tensor: torch.Tensor):
    """Zero-copy CuPy view of a CUDA tensor (shares memory)."""
    return require_cupy().from_dlpack(tensor)


def to_torch(array) -> torch.Tensor:
    """Zero-copy torch view of a CuPy array (shares memory)."""
    return torch.from_dlpack(array)


def is_cupy_array(obj) -> bool:
    module = type(obj).__module__
    return module.startswith("cupy") and hasattr(obj, "__dlpack__")
