"""The five drop-in fused modules.  Each has the reference's constructor
arguments (same order), parameter names and initialisation order, so
``state_dict`` loads both ways and ``torch.manual_seed`` gives the same
initial values.  The GEMM models take one keyword-only extra, ``precision``:
the float32 GEMM (``"3xtf32"``, ``"tf32"``, ``"ieee"``; None = the process default of
:func:`cupy_fused.settings.fp32_matmul_precision`).

* GEMM problems (37, 76, 88, 94): float32 GEMMs run on our tensor-core
  kernel, float16/bfloat16 and ``"ieee"`` on cuBLAS.  76 is
  :func:`cupy_fused.ops.linear` with ``activation="relu"`` (where the bias
  and ReLU run on each route: see :mod:`cupy_fused.ops.linear`), or
  :func:`cupy_fused.ops.linear` then :func:`cupy_fused.ops.bias_relu`
  (under autocast, and for a bias of one value or of another dtype);
  37, 88 and 94 are :func:`cupy_fused.ops.linear_gn_chain`: the GEMM, then
  one fused kernel for the linear bias and the GroupNorm chain; in float16 /
  bfloat16 (and under autocast) on Hopper, one launch where that pays
  (problem 37's shape; see that op).  The
  backward is one fused kernel (the chain rule, the GroupNorm backward and
  every vector's gradient as column sums), then the two GEMMs.
* Problem 1: ``ops.conv_bias_relu``.  On Hopper in float16 / bfloat16
  (and under autocast), in float32 with TF32 allowed from 2^24 output
  values, and in training steps from 2^24 output values: one implicit-GEMM
  convolution with relu and both biases in its store (in training also
  relu's mask, the backward's input gradient on the same engine);
  elsewhere cuDNN's convolution (``F.conv2d`` without bias), then relu +
  both biases as one fused kernel.

The GroupNorm models (37, 88, 94) take a second one, ``eager_rounding``
(default False): in float16 / bfloat16, round the op chain's intermediates
(and, on torch before 2.13, the GroupNorm's statistics) to the dtype where
eager PyTorch does, which matches eager's output to about
one unit in the last place (what a comparison against half-precision eager
with a tight tolerance, as KernelBench's, needs); by default the chain runs
in float32 and rounds once, closer to the exact result.

The bias and multiplier parameters (``bias_shape``,
``multiply_weight_shape``) may have any shape that the reference broadcasts
against its output one value per channel: the reference's own (C,) or
(C, 1, 1), a leading 1, or a single value.  Leading 1s past the output's
own dims give the output as many, as the reference's broadcast does (76's
and 88's parameters, problem 1's bias; 37's and 94's bias, which the
reference adds before its GroupNorm, is refused so shaped).  Other shapes
broadcast along another dim there (a (C,) bias of problem 1 along the
image's width): the forward refuses them with a ValueError.  A submodule
may have other options than the reference's (a convolution's padding or
stride, its bias or problem 76's GEMM bias dropped or added): the forward
computes what the reference computes with them, on the fused route where
it covers them.

Under ``torch.autocast("cuda", dtype=d)`` each module computes what its
reference computes there: the GEMM or convolution in d (inputs and weights
cast to d; float32 gradients reach float32 parameters), the GroupNorm chains
in float32, and a float32 result (the reference's adds with a float32
parameter promote, and autocast runs ``group_norm`` in float32).  Under
autocast to float32 that is every step in float32, whatever the model's and
the input's dtypes.  Outside autocast the input must have the parameters'
dtype, as in the reference.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.nn.utils import parametrize

from . import _validation, ops
from ._amp import autocast_dtype, autocast_enabled, float32_autocast, float32_casts
from ._autograd import jit_message, refuse_jit, refuse_tangents, refuse_transforms
from ._validation import (FLOAT_DTYPES, check_groups, check_int, check_like, check_tensor,
                          check_vector)
from .ops.linear import _linear_prechecked
from .ops.linear_gn_chain import _linear_gn_chain
from .settings import check_flag, check_precision


def _check_input(x, weight: torch.Tensor, ndim: int, features: int, what: str,
                 module: nn.Module) -> torch.Tensor:
    """x: a CUDA float tensor of ``ndim`` dimensions with ``features`` in
    dimension 1, in the parameters' dtype (any under autocast) and on their
    device.  Under torch.vmap or torch.func's gradient transforms, refused
    naming ``module``'s class (a vmapped x has one dim less: the rank's
    error would not say why); so is torch.jit.trace."""
    refuse_jit(type(module).__name__)
    # First, on the common path too: torch.func's wrappers pass for CUDA
    # tensors of the right rank below (one call outside the transforms).
    # The weight too: a transform over the parameters (torch.func's
    # functional_call) wraps them and not x.
    refuse_transforms(type(module).__name__, x, weight)
    # The common case in one expression: this runs on every forward, and a
    # half-precision step of problem 76 is as long as its host work.
    if (type(x) is torch.Tensor and x.is_cuda and x.dtype == weight.dtype
            and x.dtype in FLOAT_DTYPES and x.layout is torch.strided and not x.is_nested
            and x.dim() == ndim and x.shape[1] == features
            and weight.is_cuda and x.get_device() == weight.get_device()
            and (type(weight) is nn.Parameter or type(weight) is torch.Tensor)):
        return x
    _validation.check_plain("the model's weight", weight)
    if weight.dtype not in FLOAT_DTYPES:  # (before x's dtype is set against it, or refused)
        raise TypeError(f"the model's parameters must be float32, float16 or bfloat16, got "
                        f"{weight.dtype} (a model cast with .double() is not supported)")
    check_tensor("x", x, ndim=(ndim,))
    if weight.device.type not in _validation.DEVICE_TYPES:
        raise ValueError(f"the model's parameters must be on a CUDA device, got {weight.device}; "
                         f"move the model there (model.cuda() or model.to(device))")
    if x.dtype != weight.dtype and not autocast_enabled():
        check_like("x", x, weight, "the model's parameters")
    if x.device != weight.device:
        raise ValueError(f"x must be on the model's device ({weight.device}), got {x.device}")
    if x.shape[1] != features:
        raise ValueError(f"x must have {features} {what}, got shape {tuple(x.shape)}")
    return x


def _check_kernel_size(kernel_size) -> None:
    """nn.Conv2d's kernel_size: an int, or a pair of ints, each at least 1
    (nn.Conv2d fails on others deep inside, naming no argument, or takes 0)."""
    expected = "an int or a pair of ints"
    sizes = _check_ints("kernel_size", kernel_size, 1, expected)
    if len(sizes) != (2 if isinstance(kernel_size, (tuple, list, torch.Size)) else 1):
        raise ValueError(f"kernel_size must be {expected}, got {kernel_size!r}")


def _check_shape(name: str, shape) -> None:
    """A parameter's shape given to a constructor (torch.randn's size): an
    int or a sequence of ints, each at least 0."""
    _check_ints(name, shape, 0, "an int or a tuple of ints")


def _check_ints(name: str, value, least: int, expected: str) -> tuple:
    """An int, or a tuple, list or torch.Size of ints, each at least
    ``least``, as a tuple."""
    ints = tuple(value) if isinstance(value, (tuple, list, torch.Size)) else (value,)
    for i in ints:
        check_int(name, i, least, expected=expected)
    return ints


def _check_sizes(least: int, **sizes) -> None:
    # A constructor's sizes, each an int of at least ``least``, refused
    # under its own name (nn.Linear, nn.Conv2d and nn.GroupNorm fail on
    # others deep inside, or take them).  A linear layer's may be 0 (an
    # empty sum, or an empty output); a convolution needs a channel in and
    # out (ops.conv_bias_relu).
    for name, value in sizes.items():
        check_int(name, value, least)


def _plain(sub: nn.Module, cls: type, owner: nn.Module, name: str) -> nn.Module:
    """``sub`` (the submodule ``owner.<name>``), checked to be what the fused
    forward stands in for: a plain ``cls`` with no hooks.  The fused forward
    reads its parameters and never calls it, so a hook on it would not fire
    and a replacement (LoRA, quantisation, a custom layer) would be silently
    ignored: refused instead.  A parametrized ``cls`` (weight_norm, ...) is
    plain: its parameters read as the parametrization makes them.  (Runs on
    every forward: one type check and four empty-dict tests on the common
    path.)"""
    kind = type(sub)
    if ((kind is cls or _parametrized(sub, kind, cls)) and not sub._forward_hooks
            and not sub._forward_pre_hooks and not sub._backward_hooks
            and not sub._backward_pre_hooks):
        return sub
    what = (f"has been replaced by a {kind.__name__}" if kind is not cls
            and not _parametrized(sub, kind, cls) else "has hooks registered")
    raise RuntimeError(
        f"{type(owner).__name__}.{name} {what}: the cupy_fused module is one fused unit that "
        f"reads {name}'s parameters and never calls its forward, so that would be ignored.  "
        f"Keep {name} a plain torch.nn.{cls.__name__} without hooks (hook or wrap the fused "
        "module as a whole), or use the reference module (cupy_fused.reference).")


def _parametrized(sub: nn.Module, kind: type, cls: type) -> bool:
    """Whether ``sub`` is a plain ``cls`` with parametrized tensors
    (``torch.nn.utils.parametrize``: weight_norm, spectral_norm, ...), whose
    class torch derives from ``cls`` without a forward of its own: reading
    the parameter computes it, as the fused forward does."""
    return (kind.__bases__ == (cls,) and kind.forward is cls.forward
            and parametrize.is_parametrized(sub))


def _per_channel(param: torch.Tensor, channels: int, out_ndim: int, what: str,
                 channel_dim: int = 1) -> torch.Tensor:
    """``param`` (the parameter named ``what``, e.g. ``bias``) as the ops
    take it, where the reference's broadcast of it against its output
    (``out_ndim`` dims, channels in ``channel_dim``: 1, or the last of a
    linear layer's [*, C]) adds or multiplies one value per channel: a
    shape such as (C,) for a [M, C] output or (C, 1, 1) for [N, C, H, W], as
    C values; one value for every channel, as shape (1,) (the op spreads
    it, and gives it the whole sum of its gradients, rounded once), or 0-dim
    as given (see below).  Any
    other shape broadcasts along another dim (a (C,) bias of problem 1
    along the image's width) and is refused."""
    # The reference's own shapes, (C,) and (C, 1, 1), cheaply: this runs on
    # every forward.  A 0-dim param as it is: torch's promotion lets it
    # change no float dtype, and the ops apply that rule to 0-dim vectors.
    if (param.dim() == out_ndim - channel_dim and param.shape[0] == channels
            and param.numel() == channels) or param.dim() == 0:
        return param
    shape = tuple(param.shape)
    padded = (1,) * (out_ndim - len(shape)) + shape
    if (len(shape) <= out_ndim and padded[channel_dim] in (1, channels)
            and all(s == 1 for i, s in enumerate(padded) if i != channel_dim)):
        return param.reshape(1) if padded[channel_dim] != channels else param.reshape(channels)
    dims = ("[..., C, H, W]" if out_ndim >= 4 and channel_dim == out_ndim - 3
            else "[M, C]" if (out_ndim, channel_dim) == (2, 1) else "[*, C]")
    if len(shape) > out_ndim:  # (37's and 94's: the modules that take leading 1s ask for them)
        raise ValueError(
            f"{what} has shape {shape}, of more dims than the reference's {dims} output there: "
            f"its broadcast would add leading dims before the GroupNorm, which would then take "
            f"another dim for the channels; the fused module takes one value per channel (C = "
            f"{channels}): shape {(channels,) + (1,) * (out_ndim - 1 - channel_dim)} or a single "
            "value")
    raise ValueError(
        f"{what} has shape {shape}, which the reference broadcasts against its {dims} output "
        f"other than per channel; the fused module takes one value per channel (C = "
        f"{channels}): shape {(channels,) + (1,) * (out_ndim - 1 - channel_dim)} or a single "
        "value")


def _leading_ones(y: torch.Tensor, count: int) -> torch.Tensor:
    """y behind ``count`` leading 1s (a view): the shape the reference's
    broadcast against a parameter of more dims than its output gives."""
    return y if count <= 0 else y.view((1,) * count + tuple(y.shape))


def _gemm_precision(precision):
    """The ``precision`` ctor argument: None (process default, read at each
    call) or one of ``ops.PRECISIONS``."""
    return None if precision is None else check_precision(precision)


def _fields(**values) -> str:
    """``extra_repr`` text: ``name=value`` for each value, in the
    constructor's order (a submodule's size reads None if the submodule was
    replaced by one without it: the forward refuses that anyway)."""
    return ", ".join(f"{name}={value!r}" for name, value in values.items())


def _autocast_conv_bias(conv_bias: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Problem 1's float32 conv bias under autocast, cast to the autocast
    dtype d (an autograd cast) where y would otherwise be float32 against
    the reference's d: where bias is in d, or 0-dim (torch's promotion lets
    it change no float dtype).  The reference's convolution casts its bias
    to d, so that only bias's dtype promotes y's; the ops add conv_bias
    after the convolution and promote over both."""
    amp = autocast_dtype()
    if (amp is not None and conv_bias.dtype == torch.float32
            and (bias.dtype == amp or bias.dim() == 0)):
        return conv_bias.to(amp)
    return conv_bias


class _FusedModule(nn.Module):
    """What the fused modules share: their refusal of TorchScript."""

    def __prepare_scriptable__(self):
        # (torch.jit.script calls it first; left alone, scripting fails on
        # the forward's Python, naming a type it cannot read)
        raise RuntimeError(jit_message(type(self).__name__))


class ConvReluBiasAdd(_FusedModule):
    """Problem 1: ``relu(conv(x)) + bias`` (the reference's
    ``Conv2dReLUBiasAdd``).

    Args:
        in_channels, out_channels, kernel_size: ``nn.Conv2d``'s.
        bias_shape: shape of ``bias``, e.g. (out_channels, 1, 1).
    """

    def __init__(self, in_channels, out_channels, kernel_size, bias_shape):
        super().__init__()
        _check_sizes(1, in_channels=in_channels, out_channels=out_channels)
        _check_kernel_size(kernel_size)
        _check_shape("bias_shape", bias_shape)
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size)
        self.bias = nn.Parameter(torch.randn(bias_shape))

    def forward(self, x):
        """Args:
            x: [N, in_channels, H, W] (NCHW or channels-last), or one image
                [in_channels, H, W] (as ``nn.Conv2d`` takes it), in the
                parameters' dtype (under autocast any of float32, float16
                and bfloat16), on their CUDA device.

        Returns:
            y [N, out_channels, OH, OW] (the convolution's output size: H -
            KH + 1, W - KW + 1 for nn.Conv2d's defaults), or [out_channels,
            OH, OW] for one image (unless ``bias`` has 4 dims or more,
            whose broadcast keeps the batch dim, as the reference's), behind
            the leading 1s of a ``bias`` of more than 4 dims; in x's memory
            format, and x's dtype (the autocast dtype under autocast)
            promoted with ``bias``'s unless ``bias`` is 0-dim, as the
            reference's.
        """
        if isinstance(x, torch.Tensor) and x.dim() != 4:
            refuse_transforms(type(self).__name__, x)  # (a vmapped x has one dim less)
            check_tensor("x", x, ndim=(3, 4))  # (3-D: one image, as nn.Conv2d takes it)
            in_channels = _plain(self.conv, nn.Conv2d, self, "conv").in_channels
            if x.shape[0] != in_channels:  # (named on x as given, not on its batch of one)
                raise ValueError(f"x must have {in_channels} input channels (dim 0 of one image "
                                 f"[C, H, W]), got shape {tuple(x.shape)}")
            y = self.forward(x.unsqueeze(0))
            return y if self.bias.dim() >= 4 else y.squeeze(0)
        conv = _plain(self.conv, nn.Conv2d, self, "conv")
        weight = conv.weight
        _check_input(x, weight, 4, conv.in_channels, "input channels (dim 1)", self)
        param = self.bias  # (a Module.__getattr__ call: read once)
        # A bias of more dims than 4 (leading 1s) gives the reference's
        # output as many: y [N, C, OH, OW] behind them.
        out_ndim = max(4, param.dim())
        bias = _per_channel(param, weight.shape[0], out_ndim, "bias", channel_dim=out_ndim - 3)
        return _leading_ones(self._forward_4d(x, conv, weight, bias), out_ndim - 4)

    def _forward_4d(self, x: torch.Tensor, conv: nn.Conv2d, weight: torch.Tensor,
                    bias: torch.Tensor) -> torch.Tensor:
        """forward of a checked 4-D x, with ``bias`` as :func:`_per_channel`
        gives it."""
        conv_bias = conv.bias
        if conv_bias is not None and autocast_enabled():
            conv_bias = _autocast_conv_bias(conv_bias, bias)
        if (conv.stride == (1, 1) and conv.padding == (0, 0) and conv.dilation == (1, 1)
                and conv.groups == 1 and conv_bias is not None):  # (no padding: its mode is moot)
            return ops.conv_bias_relu(x, weight, conv_bias, bias)
        # Another convolution (stride, padding and its mode, ...: Conv2d's
        # own forward without its bias), then relu(z + conv bias) + bias,
        # whose vectors are checked first (bias_relu would check them after
        # the convolution has run).
        autocast_dtype()  # (refuses an autocast dtype that no op here computes in, first)
        if conv_bias is not None:
            check_vector("conv.bias", conv_bias, weight.shape[0], x, "x", dtype=FLOAT_DTYPES)
        check_like("bias", bias, x, "x", FLOAT_DTYPES)
        # Forward-mode AD and torch.func over any of them, before cuDNN runs.
        refuse_tangents(x, weight, conv_bias, bias)
        refuse_transforms(type(self).__name__, x, weight, conv_bias, bias)
        z = conv._conv_forward(x, weight, None)
        # Under autocast z is in the autocast dtype and the biases float32:
        # bias_relu promotes, as the reference's add does.  Without a conv
        # bias, zeros in z's dtype (the reference's convolution adds none).
        conv_bias = conv_bias if conv_bias is not None else z.new_zeros(weight.shape[0])
        return ops.bias_relu(z, conv_bias, bias)

    def extra_repr(self) -> str:
        conv = self.conv
        return _fields(in_channels=getattr(conv, "in_channels", None),
                       out_channels=getattr(conv, "out_channels", None),
                       kernel_size=getattr(conv, "kernel_size", None),
                       bias_shape=tuple(self.bias.shape))


class MatmulSwishSumGroupNorm(_FusedModule):
    """Problem 37: ``group_norm(swish(matmul(x)) + bias)``.

    Args:
        in_features, out_features: the linear layer's sizes.
        num_groups: the GroupNorm's groups; divides out_features.
        bias_shape: shape of ``bias``, e.g. (out_features,).
        precision: the float32 GEMM's (see the module docstring).
        eager_rounding: round as eager PyTorch does in half precision (see
            the module docstring).
    """

    def __init__(self, in_features, out_features, num_groups, bias_shape, *, precision=None,
                 eager_rounding=False):
        super().__init__()
        _check_sizes(0, in_features=in_features, out_features=out_features)
        check_groups(num_groups, out_features)
        self.precision = _gemm_precision(precision)
        self.eager_rounding = check_flag("eager_rounding", eager_rounding)
        self.matmul = nn.Linear(in_features, out_features)
        _check_shape("bias_shape", bias_shape)
        self.bias = nn.Parameter(torch.randn(bias_shape))
        self.group_norm = nn.GroupNorm(num_groups, out_features)

    def forward(self, x):
        """Args:
            x: [M, in_features], in the parameters' dtype (under autocast
                any of float32, float16 and bfloat16), on their CUDA device.

        Returns:
            y [M, out_features], in x's dtype; float32 under autocast, as the
            reference's.
        """
        # (each submodule attribute is a Module.__getattr__ call: read once)
        linear = _plain(self.matmul, nn.Linear, self, "matmul")
        gn = _plain(self.group_norm, nn.GroupNorm, self, "group_norm")
        weight = linear.weight
        _check_input(x, weight, 2, weight.shape[1], "features", self)
        return _linear_gn_chain(x, weight, linear.bias, "swish_bias_gn", gn.num_groups,
                                _per_channel(self.bias, weight.shape[0], 2, "bias"), gn.weight,
                                gn.bias, None, gn.eps, self.precision, self.eager_rounding,
                                ("matmul.bias", "bias", "group_norm.weight", "group_norm.bias",
                                 "mul_weight"))

    def extra_repr(self) -> str:
        return _fields(in_features=getattr(self.matmul, "in_features", None),
                       out_features=getattr(self.matmul, "out_features", None),
                       num_groups=getattr(self.group_norm, "num_groups", None),
                       bias_shape=tuple(self.bias.shape), precision=self.precision,
                       eager_rounding=self.eager_rounding)


class GemmAddRelu(_FusedModule):
    """Problem 76: ``relu(gemm(x) + bias)`` (the reference's ``GemmAddReLU``).

    Args:
        in_features, out_features: the linear layer's sizes (no bias of
            its own).
        bias_shape: shape of ``bias``, e.g. (out_features,).
        precision: the float32 GEMM's (see the module docstring).
    """

    def __init__(self, in_features, out_features, bias_shape, *, precision=None):
        super().__init__()
        _check_sizes(0, in_features=in_features, out_features=out_features)
        self.precision = _gemm_precision(precision)
        self.gemm = nn.Linear(in_features, out_features, bias=False)
        _check_shape("bias_shape", bias_shape)
        self.bias = nn.Parameter(torch.randn(bias_shape))

    def forward(self, x):
        """Args:
            x: [*, in_features] (as ``nn.Linear`` takes it: [M, in_features],
                or any leading dims, or none), in the parameters' dtype
                (under autocast any of float32, float16 and bfloat16), on
                their CUDA device.

        Returns:
            y [*, out_features] (x's leading dims, behind the leading 1s of
            a ``bias`` of more dims), in x's dtype (the autocast dtype under
            autocast) promoted with ``bias``'s unless ``bias`` is 0-dim, as
            the reference's: float32 under autocast for a float32 model.
        """
        linear = _plain(self.gemm, nn.Linear, self, "gemm")
        weight = linear.weight
        if isinstance(x, torch.Tensor) and (x.dim() != 2 or self.bias.dim() > 2):
            return self._rows(x, linear, weight)
        _check_input(x, weight, 2, weight.shape[1], "features", self)
        param = self.bias
        return self._forward_2d(x, linear, weight, _per_channel(param, weight.shape[0], 2, "bias"))

    def _forward_2d(self, x: torch.Tensor, linear: nn.Linear, weight: torch.Tensor,
                    bias: torch.Tensor) -> torch.Tensor:
        """forward of a checked 2-D x, with ``bias`` as :func:`_per_channel`
        gives it."""
        gemm_bias = linear.bias
        refuse_tangents(x, weight, gemm_bias, bias)  # (before the GEMM, which asks about x and W)
        amp = autocast_dtype()
        if amp is None and float32_autocast():
            # Autocast to float32: every tensor float32, as the reference's
            # linear casts its own and its add promotes; the biases checked
            # first (any float dtype each), as a cast is a launch.
            if gemm_bias is not None:
                check_vector("gemm.bias", gemm_bias, weight.shape[0], x, "x", optional=False,
                             dtype=FLOAT_DTYPES)
            check_vector("bias", bias, weight.shape[0], x, "x", optional=False, dtype=FLOAT_DTYPES,
                         one=True)
            x, weight, gemm_bias, bias = float32_casts(x, weight, gemm_bias, bias)
        # ops.linear's internal entry point: x and the weight are checked
        # above, and ops.linear would check them again on every call (see
        # _linear_prechecked).
        if (amp is not None or gemm_bias is not None or bias.numel() != weight.shape[0]
                or bias.dtype != x.dtype):
            # The GEMM, then bias + ReLU in one pass (ops.bias_relu): under
            # autocast, the GEMM in the autocast dtype (gradients written in
            # x's and the weight's own dtypes by the backward's products)
            # and the add in float32 (the reference's add with the float32
            # bias promotes); a gemm given a bias, the reference's two adds
            # as it rounds them (the two biases summed into one vector
            # first would be rounded to x's dtype and move ReLU's mask where
            # the sum is near 0); a one-value bias, whose gradient
            # bias_relu sums whole; a bias of another float dtype than x's
            # (a float32 bias in a half-precision model), whose add
            # bias_relu promotes as the reference's does.
            # Both biases are checked here, before the GEMM runs: bias_relu,
            # which takes a bias of any of the three float dtypes (promoting),
            # runs after it; under autocast the product casts gemm.bias.
            gemm_bias = gemm_bias if gemm_bias is None else check_vector(
                "gemm.bias", gemm_bias, weight.shape[0], x, "x", optional=False,
                dtype=None if amp is None else FLOAT_DTYPES)
            check_like("bias", bias, x, "x", FLOAT_DTYPES)
            return ops.bias_relu(_linear_prechecked(x, weight, gemm_bias, None, self.precision), bias)
        bias = check_vector("bias", bias, weight.shape[0], x, "x", optional=False)
        return _linear_prechecked(x, weight, bias, "relu", self.precision)

    def _rows(self, x: torch.Tensor, linear: nn.Linear, weight: torch.Tensor) -> torch.Tensor:
        """forward of an x that is not 2-D, or of a bias of more dims than
        2: x's rows [M, in_features] (a view where x's layout allows), then
        y with the shape the reference's add broadcasts to: x's leading
        dims (as ``nn.Linear`` gives them), behind any leading 1s of the
        bias's."""
        refuse_transforms(type(self).__name__, x)  # (a vmapped x has one dim less)
        check_tensor("x", x)
        if x.dim() == 0 or x.shape[-1] != weight.shape[1]:
            raise ValueError(f"x must have {weight.shape[1]} features in its last dim, got "
                             f"shape {tuple(x.shape)}")
        lead = x.shape[:-1]
        rows = x.reshape(lead.numel(), x.shape[-1])
        _check_input(rows, weight, 2, weight.shape[1], "features", self)
        param = self.bias
        out_ndim = max(x.dim(), param.dim())
        bias = _per_channel(param, weight.shape[0], out_ndim, "bias", channel_dim=out_ndim - 1)
        y = self._forward_2d(rows, linear, weight, bias)
        return _leading_ones(y.reshape(*lead, y.shape[-1]), out_ndim - x.dim())

    def extra_repr(self) -> str:
        return _fields(in_features=getattr(self.gemm, "in_features", None),
                       out_features=getattr(self.gemm, "out_features", None),
                       bias_shape=tuple(self.bias.shape), precision=self.precision)


class GemmGroupNormSwishMultiplySwish(_FusedModule):
    """Problem 88: ``g = group_norm(gemm(x)); m = swish(g) * multiply_weight;
    swish(m)``.

    Args:
        in_features, out_features: the linear layer's sizes.
        num_groups: the GroupNorm's groups; divides out_features.
        multiply_weight_shape: shape of ``multiply_weight``, e.g.
            (out_features,).
        precision, eager_rounding: as for :class:`MatmulSwishSumGroupNorm`.
    """

    def __init__(self, in_features, out_features, num_groups, multiply_weight_shape, *,
                 precision=None, eager_rounding=False):
        super().__init__()
        _check_sizes(0, in_features=in_features, out_features=out_features)
        check_groups(num_groups, out_features)
        self.precision = _gemm_precision(precision)
        self.eager_rounding = check_flag("eager_rounding", eager_rounding)
        self.gemm = nn.Linear(in_features, out_features)
        self.group_norm = nn.GroupNorm(num_groups, out_features)
        _check_shape("multiply_weight_shape", multiply_weight_shape)
        self.multiply_weight = nn.Parameter(torch.randn(multiply_weight_shape))

    def forward(self, x):
        """Args:
            x: [M, in_features], in the parameters' dtype (under autocast
                any of float32, float16 and bfloat16), on their CUDA device.

        Returns:
            y [M, out_features] (behind the leading 1s of a
            ``multiply_weight`` of more dims), in x's dtype; float32 under
            autocast, as the reference's.
        """
        linear = _plain(self.gemm, nn.Linear, self, "gemm")
        gn = _plain(self.group_norm, nn.GroupNorm, self, "group_norm")
        weight = linear.weight
        _check_input(x, weight, 2, weight.shape[1], "features", self)
        # A multiply_weight of more dims than 2 (leading 1s; the multiply
        # comes after the GroupNorm) gives the reference's output as many.
        mul = self.multiply_weight
        out_ndim = max(2, mul.dim())
        y = _linear_gn_chain(x, weight, linear.bias, "gn_swish_mul_swish", gn.num_groups, None,
                             gn.weight, gn.bias,
                             _per_channel(mul, weight.shape[0], out_ndim, "multiply_weight",
                                          channel_dim=out_ndim - 1),
                             gn.eps, self.precision, self.eager_rounding,
                             ("gemm.bias", "extra_bias", "group_norm.weight", "group_norm.bias",
                              "multiply_weight"))
        return _leading_ones(y, out_ndim - 2)

    def extra_repr(self) -> str:
        return _fields(in_features=getattr(self.gemm, "in_features", None),
                       out_features=getattr(self.gemm, "out_features", None),
                       num_groups=getattr(self.group_norm, "num_groups", None),
                       multiply_weight_shape=tuple(self.multiply_weight.shape),
                       precision=self.precision, eager_rounding=self.eager_rounding)


class GemmBiasAddHardtanhMishGroupNorm(_FusedModule):
    """Problem 94: ``groupnorm(mish(hardtanh(gemm(x) + bias)))``.

    Args:
        in_features, out_features: the linear layer's sizes.
        bias_shape: shape of ``bias``, e.g. (out_features,).
        num_groups: the GroupNorm's groups; divides out_features.
        precision, eager_rounding: as for :class:`MatmulSwishSumGroupNorm`.
    """

    def __init__(self, in_features, out_features, bias_shape, num_groups, *, precision=None,
                 eager_rounding=False):
        super().__init__()
        _check_sizes(0, in_features=in_features, out_features=out_features)
        check_groups(num_groups, out_features)
        self.precision = _gemm_precision(precision)
        self.eager_rounding = check_flag("eager_rounding", eager_rounding)
        self.gemm = nn.Linear(in_features, out_features)
        _check_shape("bias_shape", bias_shape)
        self.bias = nn.Parameter(torch.randn(bias_shape))
        self.hardtanh = nn.Hardtanh()
        self.mish = nn.Mish()
        self.groupnorm = nn.GroupNorm(num_groups=num_groups, num_channels=out_features)

    def forward(self, x):
        """Args:
            x: [M, in_features], in the parameters' dtype (under autocast
                any of float32, float16 and bfloat16), on their CUDA device.

        Returns:
            y [M, out_features], in x's dtype; float32 under autocast, as the
            reference's.
        """
        linear = _plain(self.gemm, nn.Linear, self, "gemm")
        gn = _plain(self.groupnorm, nn.GroupNorm, self, "groupnorm")
        hardtanh = _plain(self.hardtanh, nn.Hardtanh, self, "hardtanh")
        _plain(self.mish, nn.Mish, self, "mish")
        if hardtanh.min_val != -1.0 or hardtanh.max_val != 1.0:
            raise ValueError(f"hardtanh must clamp to [-1, 1] (the fused chain's bounds), got "
                             f"[{hardtanh.min_val}, {hardtanh.max_val}]")
        weight = linear.weight
        _check_input(x, weight, 2, weight.shape[1], "features", self)
        return _linear_gn_chain(x, weight, linear.bias, "bias_hardtanh_mish_gn", gn.num_groups,
                                _per_channel(self.bias, weight.shape[0], 2, "bias"), gn.weight,
                                gn.bias, None, gn.eps, self.precision, self.eager_rounding,
                                ("gemm.bias", "bias", "groupnorm.weight", "groupnorm.bias",
                                 "mul_weight"))

    def extra_repr(self) -> str:
        return _fields(in_features=getattr(self.gemm, "in_features", None),
                       out_features=getattr(self.gemm, "out_features", None),
                       bias_shape=tuple(self.bias.shape),
                       num_groups=getattr(self.groupnorm, "num_groups", None),
                       precision=self.precision, eager_rounding=self.eager_rounding)


# Problem id -> fused module class (same ctor as cupy_fused.reference.PROBLEMS).
MODELS = {
    1: ConvReluBiasAdd,
    37: MatmulSwishSumGroupNorm,
    76: GemmAddRelu,
    88: GemmGroupNormSwishMultiplySwish,
    94: GemmBiasAddHardtanhMishGroupNorm,
}
