"""Input validation, in one place.  Every check raises before anything is
launched, with a message that names the argument and what was expected.

Contiguity policy: inputs that are not contiguous are *copied* to a
contiguous tensor (``Tensor.contiguous()``; for 4-D activations channels-last
is kept as is), never rejected.  The copy is the only extra cost.
"""
from __future__ import annotations

import math
import numbers
from typing import Optional, Sequence, Tuple, Union

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Devices the kernels run on.  (The CPU test tier widens this to exercise
# the checks that come after the device check, without a GPU.)
DEVICE_TYPES = ("cuda",)

# C++ type of each supported dtype inside kernels_cu/ (see cf_common.cuh).
CXX_TYPE = {torch.float32: "float", torch.float16: "cf::half", torch.bfloat16: "cf::bfloat16"}


def cxx_type(dtype: torch.dtype) -> str:
    return CXX_TYPE[dtype]


_STRIDED = torch.strided
# The tensor types the common paths pass without a second look; others go
# to the checks in full (check_plain).
_TENSOR, _PARAMETER = torch.Tensor, torch.nn.Parameter

try:
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass as _is_wrapper
except ImportError:  # pragma: no cover - torch without it: nothing to tell
    def _is_wrapper(value) -> bool:
        return False


def check_plain(name: str, value: torch.Tensor) -> None:
    """Refuses a tensor subclass that wraps others (a DTensor, say): it
    passes for a strided CUDA tensor of its shape, but has no memory of its
    own (its data pointer is 0), so a kernel would read and write address 0
    and leave the CUDA context unusable."""
    if type(value) is not _TENSOR and type(value) is not _PARAMETER and _is_wrapper(value):
        kind = type(value).__name__
        raise TypeError(
            f"{name} is a {kind}, a tensor subclass that wraps others and has no memory of its "
            f"own for the kernels to read; pass a plain tensor"
            + (" (a DTensor's .to_local() or .full_tensor())" if kind == "DTensor" else ""))


def _check_dense(name: str, value: torch.Tensor) -> None:
    # The kernels read a tensor's memory through its strides: a sparse or
    # nested tensor has no such memory (torch's own errors for them come
    # from deep inside, naming no argument).
    if value.is_nested:
        raise TypeError(f"{name} must be a dense tensor, got a nested tensor")
    if value.layout is not _STRIDED:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {value.layout}")
    check_plain(name, value)


def check_tensor(name: str, value, *, ndim: Optional[Sequence[int]] = None) -> torch.Tensor:
    """A dense CUDA float tensor (float32, float16 or bfloat16)."""
    # One expression for the common case (this runs on every call of every op).
    if ((type(value) is _TENSOR or type(value) is _PARAMETER) and value.is_cuda
            and value.dtype in FLOAT_DTYPES and value.layout is _STRIDED and not value.is_nested
            and (ndim is None or value.dim() in ndim)):
        return value
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    _check_dense(name, value)
    if value.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must have dtype float32, float16 or bfloat16, got {value.dtype}")
    if not value.is_cuda and value.device.type not in DEVICE_TYPES:
        raise ValueError(
            f"{name} must be on a CUDA device, got device {value.device}; cupy-fused kernels "
            "run on the GPU only"
        )
    if ndim is not None and value.dim() not in ndim:
        want = " or ".join(str(n) for n in ndim)
        raise ValueError(f"{name} must be {want}-D, got shape {tuple(value.shape)}")
    return value


def check_like(name: str, value, like: torch.Tensor, like_name: str,
               dtype: Union[None, torch.dtype, Tuple[torch.dtype, ...]] = None) -> torch.Tensor:
    """Same dtype and device as ``like`` (itself already checked), dense.
    ``dtype``: that dtype instead of like's, or a tuple of dtypes, any of
    them (:data:`FLOAT_DTYPES` where each is taken: e.g. a tensor that
    autocast casts)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    _check_dense(name, value)
    if isinstance(dtype, tuple):
        if value.dtype not in dtype:
            names = [str(d).replace("torch.", "") for d in dtype]
            raise TypeError(f"{name} must have dtype {', '.join(names[:-1])} or {names[-1]}, "
                            f"got {value.dtype}")
    elif dtype is not None:
        if value.dtype != dtype:
            raise TypeError(f"{name} must have dtype {dtype}, got {value.dtype}")
    elif value.dtype != like.dtype:
        raise TypeError(f"{name} must have the dtype of {like_name} ({like.dtype}), got {value.dtype}")
    if value.device != like.device:
        raise ValueError(f"{name} must be on {like_name}'s device ({like.device}), got {value.device}")
    return value


def check_vector(name: str, value, length: int, like: torch.Tensor, like_name: str,
                 optional: bool = True,
                 dtype: Union[None, torch.dtype, Tuple[torch.dtype, ...]] = None,
                 one: bool = False) -> Optional[torch.Tensor]:
    """A per-channel vector of ``length`` elements (any shape with that many
    elements, e.g. ``(C,)`` or ``(C, 1, 1)``) with ``like``'s dtype (or
    ``dtype``, as :func:`check_like` takes it) and device; returned flat and
    contiguous.  ``one``: a single
    value for every channel is taken too, returned as shape (1,) (the op
    spreads it over the channels, and its gradient is the whole sum,
    rounded once: see :func:`.ops._common._spread`)."""
    if value is None:
        if optional:
            return None
        raise TypeError(f"{name} is required, got None")
    check_like(name, value, like, like_name, dtype)
    if value.dim() == 1 and value.shape[0] == length:  # the common case, cheaply
        return value if value.is_contiguous() else value.contiguous()
    if one and value.numel() == 1:
        return value.reshape(1)
    if value.numel() != length or sum(1 for s in value.shape if s != 1) > 1:
        also = " or one value for every channel" if one else ""
        raise ValueError(
            f"{name} must hold one value per channel ({length} values, shape ({length},) or "
            f"({length}, 1, 1)){also}, got shape {tuple(value.shape)}"
        )
    return value.reshape(length).contiguous()


# Channels per row the GroupNorm kernels take: they index within a row in
# 32 bits (a row may be preceded by any number of others).
MAX_CHANNELS = 2**30


# Under torch.compile(dynamic=True) a module's float attribute (a
# GroupNorm's eps) reaches the checks as a SymFloat, and where Python runs
# on symbolic values (torch.export's non-strict tracing) ints and floats may
# be SymInt / SymFloat: the checks accept them and compare only (dynamo
# cannot trace math.isfinite on a SymFloat: "torch.* op returned
# non-Tensor").  Python ints and floats get the same checks and errors.
# NumPy's scalars (np.int64, np.float32) count as ints and floats, as torch's
# modules take them; bool does not.
_INT_TYPES = (numbers.Integral, torch.SymInt)
_REAL_TYPES = (numbers.Real, torch.SymInt, torch.SymFloat)
_INF = math.inf


def check_int(name: str, value, least: int, *, expected: str = "an int") -> int:
    """An int (a NumPy integer too, not a bool) of at least ``least``.

    Args:
        name: the argument's name, for the errors.
        value: the argument.
        least: the smallest value taken.
        expected: what the TypeError says was expected.

    Returns:
        ``value`` as an int.  Raises TypeError for another type, ValueError
        for a smaller value.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be {expected}, got {type(value).__name__}")
    if value < least:
        raise ValueError(f"{name} must be at least {least}, got {value}")
    return int(value)


def check_groups(num_groups, channels: int) -> int:
    if type(num_groups) is not int:  # (the common case first: this runs on every call)
        if isinstance(num_groups, bool) or not isinstance(num_groups, _INT_TYPES):
            raise TypeError(f"num_groups must be an int, got {type(num_groups).__name__}")
        if not isinstance(num_groups, torch.SymInt):
            num_groups = int(num_groups)  # a NumPy integer
    if num_groups <= 0:
        raise ValueError(f"num_groups must be positive, got {num_groups}")
    if channels >= MAX_CHANNELS:
        raise ValueError(f"the GroupNorm takes fewer than 2^30 channels per row, got {channels}")
    if channels % num_groups != 0:
        raise ValueError(
            f"num_groups ({num_groups}) must divide the number of channels ({channels})"
        )
    return num_groups


def _as_float(value):
    # float() of a SymFloat would specialise it (a guard on its exact value).
    # An int past float's range (10**400) is an infinity here, which the
    # callers refuse as such, rather than an OverflowError.
    if isinstance(value, torch.SymFloat):
        return value
    try:
        return float(value)
    except OverflowError:
        return _INF if value > 0 else -_INF


def check_eps(eps) -> float:
    if type(eps) is not float:  # (the common case first: this runs on every call)
        if isinstance(eps, bool) or not isinstance(eps, _REAL_TYPES):
            raise TypeError(f"eps must be a float, got {type(eps).__name__}")
        eps = _as_float(eps)
    if not 0.0 <= eps < _INF:  # False for NaN too (0: as GroupNorm takes it)
        raise ValueError(f"eps must be finite and non-negative, got {eps}")
    return eps


# float32's largest finite value: a scalar that a kernel takes as a float
# must not round to an infinity there.
FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def check_finite_scalar(name: str, value, largest: float = _INF) -> float:
    """A real number (a Python or NumPy scalar, not a bool), as a float:
    finite, and with ``largest`` (e.g. :data:`FLOAT32_MAX` for a kernel's
    float argument) at most that in magnitude."""
    if type(value) is float and -largest <= value <= largest and -_INF < value < _INF:
        return value
    if isinstance(value, bool) or not isinstance(value, _REAL_TYPES):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    value = _as_float(value)
    if not -_INF < value < _INF:  # False for NaN too
        raise ValueError(f"{name} must be finite, got {value}")
    if not -largest <= value <= largest:
        raise ValueError(f"{name} must be at most {largest:g} in magnitude (it is taken as a "
                         f"float32), got {value:g}")
    return value


def check_same(name: str, value, like: torch.Tensor, like_name: str) -> torch.Tensor:
    """Same dtype, device and shape as ``like`` (itself already checked),
    dense.  One comparison of each on the common path: this runs on every
    call."""
    if ((type(value) is _TENSOR or type(value) is _PARAMETER) and value.dtype == like.dtype
            and value.layout is _STRIDED and not value.is_nested and value.is_cuda
            and value.get_device() == like.get_device() and value.shape == like.shape):
        return value
    check_like(name, value, like, like_name)
    check_same_shape(name, value, like, like_name)
    return value


def check_pair(name: str, value, other_name: str, other) -> None:
    """``value`` a CUDA float tensor (as :func:`check_tensor`) and ``other``
    one of the same dtype, device and shape (as :func:`check_same`).  Both
    in one call and one expression on the common path: the elementwise ops
    run it on every call, where each Python call is a measurable share of
    the op's host time."""
    if ((type(value) is _TENSOR or type(value) is _PARAMETER) and value.is_cuda
            and value.dtype in FLOAT_DTYPES
            and (type(other) is _TENSOR or type(other) is _PARAMETER) and other.dtype == value.dtype
            and value.layout is _STRIDED and other.layout is _STRIDED
            and not (value.is_nested or other.is_nested)
            and other.shape == value.shape and other.is_cuda
            and other.get_device() == value.get_device()):
        return
    check_tensor(name, value)
    check_same(other_name, other, value, name)


def check_same_shape(name: str, value: torch.Tensor, like: torch.Tensor, like_name: str) -> None:
    if value.shape != like.shape:
        raise ValueError(
            f"{name} must have the shape of {like_name} {tuple(like.shape)}, got {tuple(value.shape)}"
        )


def dense_layout(t: torch.Tensor) -> torch.Tensor:
    """Contiguous in the standard or (4-D) channels-last order; copies otherwise."""
    if t.is_contiguous():
        return t
    if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last):
        return t
    return t.contiguous()
