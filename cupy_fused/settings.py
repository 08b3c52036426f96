"""cupy-fused's settings, in one place:

* the precision of float32 GEMMs: ``"3xtf32"`` (default), ``"tf32"`` or
  ``"ieee"`` (see :mod:`cupy_fused.ops.gemm`); per call, ops and modules
  also take ``precision=``.  :func:`fp32_matmul_precision`,
  :func:`get_fp32_matmul_precision`, :func:`set_fp32_matmul_precision`.
* the Hopper ``wgmma`` kernels on compute capability 9.0 (the float32 GEMM
  and the 16-bit engine): on by default.  :func:`gemm_wgmma`,
  :func:`get_gemm_wgmma`, :func:`set_gemm_wgmma`.

Each has a getter, a setter and a context manager that sets it for the
duration of a ``with`` block and restores the previous value on exit, also
when the block raises (the context managers also work as decorators)::

    import cupy_fused

    with cupy_fused.fp32_matmul_precision("ieee"):
        y = model(x)

Environment variables, read once when this module is imported (the setters
override them afterwards):

* ``CUPY_FUSED_GEMM_WGMMA=0``: the ``wgmma`` kernels off (``1``, or unset:
  on; ``false`` / ``true`` and ``off`` / ``on`` are read too, anything else
  raises ValueError at import).

Read by the kernel runtime (``cupy_fused/_runtime.py``) when it compiles,
not settable here:

* ``CUPY_FUSED_KERNEL_DIR``: the folder the ``.cu`` sources are read from
  (default: the ``kernels_cu/`` installed with the package).
* ``CUPY_FUSED_NVRTC_OPTIONS``: extra NVRTC options, space-separated (e.g.
  ``-lineinfo``).
* ``CUPY_CACHE_DIR``: CuPy's on-disk cache of compiled kernels (CuPy's own).

**Scope.**  The values are process-wide, not per thread: a setter, or a
``with`` block while it runs, changes them for every thread.  The context
managers restore the value they found, so blocks overlapping in two threads
can restore each other's values, and one thread's value can stay set after
both blocks have ended.  Set them before starting threads, or pass
``precision=`` to each op or module, which needs no shared state.

**When they are read.**  When an op runs; under ``torch.compile``, when it
is traced.  The values live in a module-level dict, which TorchDynamo
guards on: a compiled function called after a change is traced again with
the new value.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import os
from typing import Any, Dict, Optional

PRECISIONS = ("3xtf32", "tf32", "ieee")


def _env_flag(name: str, default: bool) -> bool:
    """An on/off environment variable: 1 / true / on or 0 / false / off (any
    case, spaces around ignored), ``default`` where it is unset or empty;
    anything else raises ValueError naming it (a typo must not pass for a
    value)."""
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if not value:
        return default
    if value in ("1", "true", "on"):
        return True
    if value in ("0", "false", "off"):
        return False
    raise ValueError(f"{name} must be 0 or 1 (or false / true, off / on), got {raw!r}")


# One dict for every value: cheap to read on each op call (ops read the
# precision on every call, the GEMM dispatch the wgmma switch on every
# product), and a global TorchDynamo guards on.
_values: Dict[str, Any] = {
    "fp32_matmul_precision": "3xtf32",
    "gemm_wgmma": _env_flag("CUPY_FUSED_GEMM_WGMMA", True),
}


class _Setting(contextlib.ContextDecorator):
    """``_values[name] = value`` for each ``with`` block (or call of a
    decorated function), then the previous value again, however it ends.
    The same object may be entered again, also inside itself, as torch's
    context managers may (the previous values are a stack)."""

    def __init__(self, name: str, value: object):
        self.name, self.value, self._previous = name, value, []

    def __enter__(self) -> "_Setting":
        self._previous.append(_values[self.name])
        _values[self.name] = self.value
        return self

    def __exit__(self, *exc) -> bool:
        _values[self.name] = self._previous.pop()
        return False

    def __call__(self, func):
        """As a decorator: each call of ``func`` under the setting; for a
        generator function each of its steps (the caller's code between
        them under the caller's setting), for a coroutine function the
        whole coroutine."""
        if inspect.isgeneratorfunction(func):
            @functools.wraps(func)
            def steps(*args, **kwargs):
                gen = func(*args, **kwargs)
                try:
                    with self:
                        request = gen.send(None)
                    while True:
                        try:
                            response = yield request
                        except GeneratorExit:
                            with self:
                                gen.close()
                            raise
                        except BaseException as exc:
                            with self:
                                request = gen.throw(exc)
                        else:
                            with self:
                                request = gen.send(response)
                except StopIteration as stop:
                    return stop.value
            return steps
        if inspect.iscoroutinefunction(func):
            @functools.wraps(func)
            async def whole(*args, **kwargs):
                with self:
                    return await func(*args, **kwargs)
            return whole
        return super().__call__(func)


def check_flag(name: str, value: object) -> bool:
    """A flag argument checked (``bool("False")`` would be True).

    Args:
        name: the argument's name, for the error; value: its value.

    Returns:
        ``value``, if it is True or False; raises TypeError naming ``name``
        otherwise.
    """
    if value is True or value is False:
        return value
    raise TypeError(f"{name} must be True or False, got {value!r}")


# ---------------------------------------------------------------- float32 GEMM precision

def check_precision(precision: object) -> str:
    """A float32 GEMM precision checked.

    Args:
        precision: a name of :data:`PRECISIONS`.

    Returns:
        ``precision``; raises ValueError for anything else.
    """
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(map(repr, PRECISIONS))}, "
                         f"got {precision!r}")
    return precision


def set_fp32_matmul_precision(precision: str) -> None:
    """Sets the process-wide default precision of cupy-fused's float32 GEMMs,
    used where an op or module has ``precision=None``.

    Args:
        precision: ``"3xtf32"`` (default: float32 accuracy on TF32 tensor
            cores), ``"tf32"`` (one TF32 pass, fastest) or ``"ieee"`` (cuBLAS
            SGEMM).

    Returns:
        None.

    Raises:
        ValueError: any other value (the setting is then unchanged).
    """
    _values["fp32_matmul_precision"] = check_precision(precision)


def get_fp32_matmul_precision() -> str:
    """The process-wide default precision of the float32 GEMMs.

    Returns:
        ``"3xtf32"``, ``"tf32"`` or ``"ieee"`` (see
        :func:`set_fp32_matmul_precision`).
    """
    return _values["fp32_matmul_precision"]


def fp32_matmul_precision(precision: str):
    """Context manager: :func:`set_fp32_matmul_precision` for the ``with``
    block, the previous default again on exit (also after an exception).

    Args:
        precision: as for :func:`set_fp32_matmul_precision`; checked before
            anything changes.

    Returns:
        The context manager (also usable as a function decorator).
    """
    return _Setting("fp32_matmul_precision", check_precision(precision))


def resolve_precision(precision: Optional[str]) -> str:
    """The precision an op runs at.  (Called on every op call: one dict
    lookup.)

    Args:
        precision: the op's ``precision=`` argument, or None.

    Returns:
        ``precision`` checked (:func:`check_precision`), or the process-wide
        default (:func:`get_fp32_matmul_precision`) when it is None.
    """
    if precision is None:
        return _values["fp32_matmul_precision"]
    return check_precision(precision)


# ---------------------------------------------------------------- GEMM kernel switches

def set_gemm_wgmma(enabled: bool) -> None:
    """Switches the Hopper ``wgmma`` kernels on or off, process-wide: the
    float32 GEMM's and the 16-bit engine's (its one-launch GroupNorm forward
    and problem 1's convolution).  Off, compute capability 9.0 runs what 8.x
    runs (the ``mma.sync`` float32 GEMM, cuBLAS, cuDNN): the fallback route
    should the Hopper kernels fail on a machine, slower than they are
    (docs/gemm.md).  Default: on, unless ``CUPY_FUSED_GEMM_WGMMA=0``.

    Args:
        enabled: True or False.

    Returns:
        None.

    Raises:
        TypeError: any other value (the setting is then unchanged).
    """
    _values["gemm_wgmma"] = check_flag("enabled", enabled)


def get_gemm_wgmma() -> bool:
    """Whether the ``wgmma`` kernels may run (where the device has them:
    :func:`cupy_fused.ops.gemm.has_wgmma`).

    Returns:
        The process-wide switch of :func:`set_gemm_wgmma`.
    """
    return _values["gemm_wgmma"]


def gemm_wgmma(enabled: bool):
    """Context manager: :func:`set_gemm_wgmma` for the ``with`` block, the
    previous value again on exit (also after an exception).

    Args:
        enabled: as for :func:`set_gemm_wgmma`; checked before anything
            changes.

    Returns:
        The context manager (also usable as a function decorator).
    """
    return _Setting("gemm_wgmma", check_flag("enabled", enabled))
