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
# The error of a CuPy import that failed part of the way (its modules left
# half-initialised: a second import in the process fails on them, naming
# none of this), raised again by later calls.
_failed = None

_RESTART = ("  CuPy cannot be imported again in this process after a failed import: "
            "restart Python after the fix")


class CupyNotInstalledError(ImportError):
    """No ``cupy`` module to import (its message: :data:`INSTALL_HINT`)."""


def require_cupy():
    """Returns the ``cupy`` module, importing it on first use.  Raises
    :class:`CupyNotInstalledError` where there is none, ImportError naming
    CuPy's own error where one is installed but does not import (a CUDA
    library it cannot load, a missing dependency), OSError where it cannot
    make its cache folder; after either of the last two, the same error on
    every later call (CuPy cannot be imported again in the process)."""
    global _cupy, _failed
    if _cupy is None:
        if _failed is not None:
            raise type(_failed)(str(_failed)) from _failed.__cause__
        try:
            _cupy = importlib.import_module("cupy")
        except ImportError as exc:
            if isinstance(exc, ModuleNotFoundError) and exc.name == "cupy":
                raise CupyNotInstalledError(INSTALL_HINT) from exc
            _failed = ImportError(
                f"CuPy is installed but importing it failed: {exc}.  Check that the installed "
                "CuPy is the one of torch's CUDA major (cupy-cuda12x for CUDA 12, cupy-cuda13x "
                "for 13) and that only one of them is installed." + _RESTART)
            raise _failed from exc
        except OSError as exc:
            # CuPy makes its kernel cache's folder when it is imported.
            _failed = type(exc)(
                f"importing CuPy failed: {exc}.  CuPy creates its kernel cache folder "
                "(CUPY_CACHE_DIR, default ~/.cupy/kernel_cache) when it is imported: where "
                "that folder cannot be made or written, set CUPY_CACHE_DIR to a writable "
                "folder before CuPy is imported." + _RESTART)
            raise _failed from exc
    return _cupy
