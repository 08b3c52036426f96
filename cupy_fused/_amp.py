"""Autocast, in one place: what ``torch.autocast("cuda", dtype=d)`` asks of
an op, read once per call.

The reference modules under autocast run ``nn.Linear`` and ``nn.Conv2d`` in
d (inputs and weights cast to d; the casts' backward returns float32
gradients to float32 parameters), ``group_norm`` in float32, and an add with
a float32 tensor promotes to float32.  The ops follow the same rules: each
asks :func:`autocast_dtype` and casts with :func:`cast`, an autograd op, so
that gradients come back in each tensor's own dtype.  Under
``torch.compile`` both are traced (dynamo folds the autocast state into the
graph), so the custom ops themselves only ever see operands already cast.
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


def autocast_dtype() -> Optional[torch.dtype]:
    """The dtype CUDA autocast runs matrix products in (float16 or
    bfloat16), or None outside ``torch.autocast("cuda")``."""
    if _any_enabled is not None and not _any_enabled():
        return None
    if _HAS_DEVICE_API:
        if not torch.is_autocast_enabled("cuda"):
            return None
        dtype = torch.get_autocast_dtype("cuda")
    else:  # pragma: no cover - torch < 2.4
        if not torch.is_autocast_enabled():
            return None
        dtype = torch.get_autocast_gpu_dtype()
    return dtype if dtype in HALF_DTYPES else None


def cast(t: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """``t`` in ``dtype`` (None and non-tensors pass through, for the
    validation that follows to name them)."""
    if isinstance(t, torch.Tensor) and t.dtype != dtype and t.is_floating_point():
        return t.to(dtype)
    return t


def promoted(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """The dtype of ``a_tensor + b_tensor`` (torch's type promotion)."""
    return a if a == b else torch.promote_types(a, b)
