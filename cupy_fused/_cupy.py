"""Lazy access to CuPy.

``import cupy_fused`` works without CuPy (for introspection, documentation and
the pure-Python parts); the first thing that needs a kernel calls
:func:`require_cupy`, which names the extra to install when CuPy is missing.
"""
from __future__ import annotations

import importlib

INSTALL_HINT = (
    "cupy-fused needs CuPy to compile and launch its kernels. Install the CuPy and "
    "NVRTC of torch's CUDA major (python -c 'import torch; print(torch.version.cuda)'), "
    "as the extras [cuda12] / [cuda13] of this package do: pip install cupy-cuda12x "
    "nvidia-cuda-nvrtc-cu12 (CUDA 12) or pip install cupy-cuda13x 'nvidia-cuda-nvrtc==13.*' "
    "(CUDA 13). Never install both cupy-cuda12x and cupy-cuda13x: they provide the same "
    "`cupy` module."
)

_cupy = None


def require_cupy():
    """Returns the ``cupy`` module, importing it on first use."""
    global _cupy
    if _cupy is None:
        try:
            _cupy = importlib.import_module("cupy")
        except ImportError as exc:  # pragma: no cover - exercised in a subprocess test
            raise ImportError(INSTALL_HINT) from exc
        except OSError as exc:
            # CuPy makes its kernel cache's folder when it is imported.
            raise type(exc)(
                f"importing CuPy failed: {exc}.  CuPy creates its kernel cache folder "
                "(CUPY_CACHE_DIR, default ~/.cupy/kernel_cache) when it is imported: where "
                "that folder cannot be made or written, set CUPY_CACHE_DIR to a writable "
                "folder before CuPy is imported") from exc
    return _cupy


def cupy_available() -> bool:
    try:
        require_cupy()
    except ImportError:
        return False
    return True
