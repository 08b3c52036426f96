"""Autocast, in one place: what ``torch.autocast("cuda", dtype=d)`` asks of
an op, read once per call.

The reference modules under autocast run ``nn.Linear`` and ``nn.Conv2d`` in
d (inputs and weights cast to d; the casts' backward returns float32
gradients to float32 parameters), ``group_norm`` in float32, and an add with
a float32 tensor promotes to float32.  The ops follow the same rules: each
asks :func:`autocast_dtype` and casts with :func:`cast`, an autograd op, so
that gradients come back in each tensor's own dtype.

``torch.autocast("cuda", dtype=torch.float32)`` runs those products in
float32 (float16 and bfloat16 operands cast up) and ``group_norm`` in
float32 as before: the entry points, once every argument is checked,
cast their half-precision tensors up (:func:`float32_casts`) and go on as
outside autocast, where every tensor is then float32; the GroupNorm
chains ask :func:`autocast_enabled`.  Other autocast dtypes are refused.
Under ``torch.compile`` both are traced (dynamo folds the autocast state
into the graph), so the custom ops themselves only ever see operands
already cast.
"""
from __future__ import annotations

from typing import Optional

import torch

HALF_DTYPES = (torch.float16, torch.bfloat16)

# Whether any device's autocast is on: one cheap call on the common path
# (the ops run this on every call).
_any_enabled = getattr(torch._C, "_is_any_autocast_enabled", None)
# torch >= 2.4 takes the device type; older versions have the CUDA-only forms.
_HAS_DEVICE_API = hasattr(torch, "get_autocast_dtype")


def _cuda_autocast() -> Optional[torch.dtype]:
    """CUDA autocast's dtype, or None outside ``torch.autocast("cuda")``."""
    if _any_enabled is not None and not _any_enabled():  # (the common case: one call)
        return None
    if _HAS_DEVICE_API:
        if not torch.is_autocast_enabled("cuda"):
            return None
        return torch.get_autocast_dtype("cuda")
    if not torch.is_autocast_enabled():  # pragma: no cover - torch < 2.4
        return None
    return torch.get_autocast_gpu_dtype()  # pragma: no cover


def autocast_enabled() -> bool:
    """Whether ``torch.autocast("cuda")`` is on, to any dtype (it runs
    ``group_norm`` in float32 whatever its dtype)."""
    return _cuda_autocast() is not None


def float32_autocast() -> bool:
    """Whether ``torch.autocast("cuda", dtype=torch.float32)`` is on (see
    :func:`float32_casts`)."""
    return _cuda_autocast() == torch.float32


def autocast_dtype() -> Optional[torch.dtype]:
    """The half-precision dtype CUDA autocast runs matrix products in
    (float16 or bfloat16); None outside ``torch.autocast("cuda")`` and
    under autocast to float32 (see :func:`float32_casts`).

    Raises:
        TypeError: autocast to another dtype (float64, ...), which no op
            here computes in.
    """
    dtype = _cuda_autocast()
    if dtype is None or dtype in HALF_DTYPES:
        return dtype
    if dtype == torch.float32:
        return None
    raise TypeError(f"cupy_fused's ops run under torch.autocast to float16, bfloat16 or float32, "
                    f"got autocast to {dtype}")


def float32_casts(*tensors):
    """Under ``torch.autocast("cuda", dtype=torch.float32)``: ``tensors``
    with each float16 / bfloat16 tensor cast to float32 (autograd casts, as
    autocast's, so that gradients come back in each tensor's own dtype);
    others, and every tensor outside that autocast, as given.  The entry
    points check every argument first (a cast is a launch).  Returns a
    tuple."""
    if not float32_autocast():
        return tensors
    return tuple(t.to(torch.float32) if isinstance(t, torch.Tensor) and t.dtype in HALF_DTYPES
                 else t for t in tensors)


# The dtypes autocast casts (it leaves float64 alone), and so cast().
_CASTABLE = (torch.float32, torch.float16, torch.bfloat16)


def cast(t: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """``t`` in ``dtype`` where it is float32, float16 or bfloat16 (others,
    float64 among them, as autocast leaves them, and None and non-tensors,
    pass through, for the validation that follows to name them)."""
    if isinstance(t, torch.Tensor) and t.dtype != dtype and t.dtype in _CASTABLE:
        return t.to(dtype)
    return t


def promoted(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """The dtype of ``a_tensor + b_tensor`` (torch's type promotion)."""
    return a if a == b else torch.promote_types(a, b)
