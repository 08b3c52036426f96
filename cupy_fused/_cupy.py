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


class CupyNotInstalledError(ImportError):
    """No ``cupy`` module to import (its message: :data:`INSTALL_HINT`)."""


def require_cupy():
    """Returns the ``cupy`` module, importing it on first use.  Raises
    :class:`CupyNotInstalledError` where there is none, ImportError naming
    CuPy's own error where one is installed but does not import (a CUDA
    library it cannot load, a missing dependency), OSError where it cannot
    make its cache folder."""
    global _cupy
    if _cupy is None:
        try:
            _cupy = importlib.import_module("cupy")
        except ImportError as exc:
            if isinstance(exc, ModuleNotFoundError) and exc.name == "cupy":
                raise CupyNotInstalledError(INSTALL_HINT) from exc
            raise ImportError(
                f"CuPy is installed but importing it failed: {exc}.  Check that the installed "
                "CuPy is the one of torch's CUDA major (cupy-cuda12x for CUDA 12, cupy-cuda13x "
                "for 13) and that only one of them is installed") from exc
        except OSError as exc:
            # CuPy makes its kernel cache's folder when it is imported.
            raise type(exc)(
                f"importing CuPy failed: {exc}.  CuPy creates its kernel cache folder "
                "(CUPY_CACHE_DIR, default ~/.cupy/kernel_cache) when it is imported: where "
                "that folder cannot be made or written, set CUPY_CACHE_DIR to a writable "
                "folder before CuPy is imported") from exc
    return _cupy
