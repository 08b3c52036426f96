"""Property-based tests (hypothesis, GPU tier): every public op against a
float64 run of its torch reference, on random shapes, group counts, dtypes,
layouts and special values.

For the output and the gradient of every input tensor (random upstream
gradient), our error against the float64 run
(:func:`cupy_fused.testing.rel_error`) must be at most 1.5x eager's (the
torch reference in the same dtype, under the same autocast) plus one unit of
rounding (``finfo(dtype).eps``) of the tensor's dtype, or in "amp" mode of
bfloat16, as in tests/test_autocast.py.  Output and gradient dtypes and shapes must be
eager's.

With a NaN or +-inf in one input element (drawn with some probability) the
NaN / +inf / -inf masks of the output and of every gradient must equal
eager's instead, at every precision (the 3xTF32 GEMM included).

Modes: float32, float16, bfloat16, and "amp": float32 inputs (for bias_relu
and gn_chain also a bfloat16 z, as a GEMM's output under autocast) with the
forward under ``torch.autocast("cuda", dtype=torch.bfloat16)``.

Layouts of the activation (z / x, and linear's weight): contiguous, a
transposed-back non-contiguous view, and a view starting one element into a
buffer (misaligned, with NaN on either side, so that a read outside the view
shows); 4-D z also channels-last, plain and misaligned.  Vectors are
optionally misaligned the same way.

One tolerance exception, the gradients through a GroupNorm's input (of z,
x, the weight and the biases before it): that gradient is a cancellation of
terms of size ``rstd * |gamma * dy|``, so the error of any float
computation of it (eager's too) scales with the terms, not with the
result.  The slack there is 16 units of rounding of the terms' magnitude;
over 1 or 2 channels per group, where the exact result is (nearly) zero,
2^-7 of it (a real bug errs by the terms' whole size).  The same holds for
x's gradient in ``linear_gn_chain`` with one input feature: x[i] then only
scales row i of the GroupNorm's input, which the normalisation undoes.

A second one, float32 products: in 3xTF32 (the default) their error is
bounded by the split's representation error, about 2^-21 of the product's
terms, and a float32 sum in another order than eager's errs by about
sqrt(k) roundings of its k terms; where the sum cancels, either can be a
few times eager's error on a handful of outputs.  The output's slack is
then 2^-20, or sqrt(k) 2^-24, of the terms (:func:`_product_slack`), and
so for each product of the backward.  Through the float32 GroupNorm
chains, the slack of every tensor is twice how far it moves when the
float64 truth is run again with the product's output, the GroupNorm's
input and its output moved at random by that much and by a few units of
float32 of their group's largest value (:func:`_shaken`): over values
close together the normalisation magnifies any rounding, eager's as ours.
In float16 / bfloat16 (and "amp") ``linear_gn_chain``'s product is rounded
to 16 bits, by eager and by ours alike, so there the truth is run again with
the product's output moved by its rounding (a unit of the 16-bit type of its
terms, which under autocast also covers the operands' casts).  The GroupNorm
chains' per-channel vectors after the normalisation (its weight and bias,
88's multiplier) get a slack of 16 units of float32 of their gradients'
terms (each a row's ``|g * d out / d v|``): their gradient sums a term per
row, and where those cancel, a few roundings of each term can be more than
eager's lucky error (ours computes the terms in float32 in every mode).

A third, float32 convolutions: TF32 products on tensor cores (ours, and
cuDNN's where it picks them) sum in float32 less exactly than cuDNN's
float32 kernels, by a few units of float32 of the terms, so the slack of
the output and of the input and weight gradients is 2^-20 of their terms.

conv_bias_relu runs as routed, or on the engine wherever its kernels take
the call (its routing rule and size thresholds lifted), in training and in
inference.  Its products multiply values their precision holds (TF32 x,
weight and upstream gradient in float32, bfloat16 x and weight in "amp"),
and the upstream gradient is 0 where the exact pre-activation lies within
a few units of the product's precision of its terms: there, which side of
relu's threshold each implementation lands on is chance, and a gradient
from the other side errs by a large share of the whole at these sizes.
Eager runs on ours' memory formats (cuDNN's algorithms, and so its NaN
placement, depend on them), and y must be in x's memory format.  Special
values go into x and the biases, not the weight (eager's own NaN placement
then depends on the weight's layout), and the weight's gradient is checked
for where it is not finite, not for which of NaN and +-inf (0 x inf in its
sums: eager's differs from IEEE arithmetic's there), and may instead be
where the float64 run has it not finite (float16, bfloat16 and autocast on
the H200: cuDNN's weight gradient put a NaN of x into the other input
channel's entries as well).

Deterministic: derandomized hypothesis without an example database, torch
generators seeded from the drawn case.  hypothesis is required (the [test]
extra).
"""
import contextlib
import dataclasses
import importlib
import math
import os
from typing import Optional, Tuple

import pytest
import torch
import torch.nn.functional as F

# hypothesis is a test dependency (the [test] extra): imported, not skipped
# over, so that a machine without it fails here instead of passing with the
# property tests silently left out.
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from cupy_fused import ops  # noqa: E402
from cupy_fused.testing import off_the_grid, poison_allocator, rel_error  # noqa: E402

pytestmark = pytest.mark.gpu

# The module of ops.conv_bias_relu (which is the op): its routing rule and tf32 rounding.
CONV = importlib.import_module("cupy_fused.ops.conv_bias_relu")

# The `device` fixture is function-scoped but stateless: its reuse across
# examples is safe.
# CUPY_FUSED_PROPERTY_EXAMPLES: examples per test (more for a longer search).
PROPERTY_SETTINGS = settings(
    max_examples=int(os.environ.get("CUPY_FUSED_PROPERTY_EXAMPLES", "12")), deadline=None, derandomize=True,
    database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

AMP = torch.bfloat16
MODES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "amp": None}
FLOAT_MODES = ("fp32", "fp16", "bf16")
CHAINS = sorted(ops.CHAINS)
NAN, INF = float("nan"), float("inf")

# Which of the optional vectors each chain takes (mul_weight: required).
CHAIN_VECTORS = {
    "swish_bias_gn": ("lin_bias", "extra_bias", "gn_weight", "gn_bias"),
    "gn_swish_mul_swish": ("lin_bias", "gn_weight", "gn_bias", "mul_weight"),
    "bias_hardtanh_mish_gn": ("lin_bias", "extra_bias", "gn_weight", "gn_bias"),
}
OPTIONAL_VECTORS = ("lin_bias", "extra_bias", "gn_weight", "gn_bias")
ALL_VECTORS = OPTIONAL_VECTORS + ("mul_weight",)


# ---------------------------------------------------------------- strategies

ROWS = st.integers(0, 70)
FEATURES = st.integers(1, 80)
# Channel counts: any, and multiples of 8 (the vectorised kernels' widths).
CHANNELS = st.one_of(st.integers(1, 80), st.integers(1, 10).map(lambda v: 8 * v))
GROUPS = st.integers(1, 6)
PER_GROUP = st.one_of(st.integers(1, 70), st.integers(1, 8).map(lambda v: 8 * v))
SCALE = st.floats(-1.0, 1.0).map(lambda e: 10.0 ** e)  # [0.1, 10], log-uniform
SEED = st.integers(0, 2**31 - 1)
EPS = st.sampled_from([1e-5, 1e-3, 0.1])
LAYOUTS = st.sampled_from(["contiguous", "transposed", "offset"])
LAYOUTS_4D = st.sampled_from(["contiguous", "channels_last", "transposed", "offset",
                              "channels_last_offset"])
PRECISIONS = st.sampled_from([None, "3xtf32", "ieee"])
# Three in eight cases get a non-finite input element.
SPECIAL_VALUE = st.sampled_from([None] * 5 + [NAN, INF, -INF])


def _scales(n):
    return st.tuples(*[SCALE] * n)


@st.composite
def _special(draw, targets):
    """None, or (input name, raw flat index, value): the value goes into that
    input at ``raw % numel`` (:func:`_place_special`)."""
    value = draw(SPECIAL_VALUE)
    if value is None:
        return None
    return draw(st.sampled_from(targets)), draw(st.integers(0, 2**20)), value


@dataclasses.dataclass(frozen=True)
class LinearCase:
    lead: Tuple[int, ...]  # x's dimensions before the features
    in_features: int
    out_features: int
    bias: bool
    activation: Optional[str]
    precision: Optional[str]  # float32 only
    x_layout: str
    w_layout: str
    vec_offset: bool
    scales: Tuple[float, float, float]  # x, weight, bias
    seed: int
    special: Optional[tuple] = None


@st.composite
def linear_cases(draw):
    rows = draw(ROWS)
    return LinearCase(
        lead=draw(st.sampled_from([(rows,), (rows,), (2, rows), (3, rows)])),
        in_features=draw(FEATURES), out_features=draw(FEATURES), bias=draw(st.booleans()),
        activation=draw(st.sampled_from([None, "relu"])), precision=draw(PRECISIONS),
        x_layout=draw(LAYOUTS), w_layout=draw(LAYOUTS), vec_offset=draw(st.booleans()),
        scales=draw(_scales(3)), seed=draw(SEED),
        special=draw(_special(["x", "x", "weight", "bias"])))


@dataclasses.dataclass(frozen=True)
class BiasReluCase:
    shape: Tuple[int, ...]  # [M, C] or [N, C, H, W]
    layout: str
    bias2: bool
    bias_shape: str  # "flat": (C,); "c11": (C, 1, 1)
    vec_offset: bool
    half_z: bool  # amp mode: z in bfloat16 (float32 biases)
    scales: Tuple[float, float, float]  # z, bias, bias2
    seed: int
    special: Optional[tuple] = None


@st.composite
def bias_relu_cases(draw):
    if draw(st.booleans()):
        shape, layout = (draw(ROWS), draw(CHANNELS)), draw(LAYOUTS)
    else:
        shape = (draw(st.integers(0, 3)), draw(st.integers(1, 24)), draw(st.integers(1, 9)),
                 draw(st.integers(1, 9)))
        layout = draw(LAYOUTS_4D)
    return BiasReluCase(
        shape=shape, layout=layout, bias2=draw(st.booleans()),
        bias_shape=draw(st.sampled_from(["flat", "c11"])), vec_offset=draw(st.booleans()),
        half_z=draw(st.booleans()), scales=draw(_scales(3)), seed=draw(SEED),
        special=draw(_special(["z", "z", "bias", "bias2"])))


@dataclasses.dataclass(frozen=True)
class ConvCase:
    n: int
    in_channels: int
    out_channels: int
    out_hw: Tuple[int, int]  # the output's height and width
    kernel: Tuple[int, int]
    bias: str  # "c11": (C_out, 1, 1); "flat": (C_out,); "one": one value; "none"
    x_layout: str
    w_layout: str
    train: bool  # False: an inference call (no tensor requires grad)
    engine: bool  # the engine wherever its kernels take the call (_lift_conv_rule)
    scales: Tuple[float, float, float, float]  # x, weight (per sqrt(fan-in)), conv_bias, bias
    seed: int
    special: Optional[tuple] = None


# Kernel sides: mostly up to 3, at times up to 7.
KERNEL_SIDE = st.one_of(st.integers(1, 3), st.integers(1, 7))


@st.composite
def conv_cases(draw):
    return ConvCase(
        n=draw(st.sampled_from([0, 1, 1, 2, 3])),
        # Any C_in (not a multiple of 8: the padded route) and C_out, and the
        # multiples of 8 and 32 the engine's layouts and training ask for.
        in_channels=draw(st.one_of(st.integers(1, 24), st.integers(1, 10).map(lambda v: 8 * v))),
        out_channels=draw(st.one_of(st.integers(1, 24), st.integers(1, 12).map(lambda v: 8 * v),
                                    st.sampled_from([32, 64, 128]))),
        # Rows within one 128-pixel tile, and across two; at times more
        # tiles than a GPU has SMs (a block then takes tile after tile).
        out_hw=(draw(st.one_of(st.integers(1, 10), st.integers(1, 10), st.integers(40, 64))),
                draw(st.one_of(st.integers(1, 24), st.integers(120, 140)))),
        kernel=(draw(KERNEL_SIDE), draw(KERNEL_SIDE)),
        bias=draw(st.sampled_from(["c11", "flat", "one", "none"])),
        x_layout=draw(LAYOUTS_4D), w_layout=draw(st.sampled_from(["contiguous", "channels_last"])),
        train=draw(st.booleans()), engine=draw(st.sampled_from([False, True, True])),
        scales=draw(_scales(4)),
        # Not the weight: eager's own NaN in x's gradient from a NaN weight
        # moves with the weight's memory format (cuDNN's algorithms: one NaN
        # from a contiguous weight, two from the same values channels-last,
        # float16 and bfloat16 on the H200), not with correctness.
        seed=draw(SEED), special=draw(_special(["x", "x", "conv_bias", "bias"])))


@dataclasses.dataclass(frozen=True)
class GNCase:
    rows: int
    groups: int
    per_group: int
    vectors: Tuple[str, ...]  # the optional vectors present (mul_weight always is)
    eps: float
    layout: str
    vec_offset: bool
    half_z: bool  # amp mode: z in bfloat16 (float32 vectors)
    scales: Tuple[float, ...]  # z, then ALL_VECTORS
    seed: int
    special: Optional[tuple] = None


@st.composite
def gn_cases(draw):
    return GNCase(
        rows=draw(ROWS), groups=draw(GROUPS), per_group=draw(PER_GROUP),
        vectors=tuple(sorted(draw(st.sets(st.sampled_from(OPTIONAL_VECTORS))))),
        eps=draw(EPS), layout=draw(LAYOUTS), vec_offset=draw(st.booleans()),
        half_z=draw(st.booleans()), scales=draw(_scales(1 + len(ALL_VECTORS))), seed=draw(SEED),
        # Not gn_weight: an infinite GroupNorm weight meets inf - inf in the
        # GroupNorm backward, whose NaN / inf pattern depends on how the
        # formula is arranged (eager's is uncentered), not on correctness.
        special=draw(_special(["z", "z", "lin_bias", "extra_bias", "gn_bias", "mul_weight"])))


@dataclasses.dataclass(frozen=True)
class LinearGNCase:
    rows: int
    in_features: int
    groups: int
    per_group: int
    vectors: Tuple[str, ...]
    eps: float
    precision: Optional[str]
    x_layout: str
    w_layout: str
    vec_offset: bool
    scales: Tuple[float, ...]  # x, weight, then ALL_VECTORS
    seed: int
    special: Optional[tuple] = None


@st.composite
def linear_gn_cases(draw):
    return LinearGNCase(
        rows=draw(ROWS), in_features=draw(FEATURES), groups=draw(GROUPS),
        per_group=draw(PER_GROUP),
        vectors=tuple(sorted(draw(st.sets(st.sampled_from(OPTIONAL_VECTORS))))),
        eps=draw(EPS), precision=draw(PRECISIONS), x_layout=draw(LAYOUTS),
        w_layout=draw(LAYOUTS), vec_offset=draw(st.booleans()),
        scales=draw(_scales(2 + len(ALL_VECTORS))), seed=draw(SEED),
        special=draw(_special(["x", "x", "weight", "lin_bias", "extra_bias", "gn_bias",
                               "mul_weight"])))


@dataclasses.dataclass(frozen=True)
class ScaleAddCase:
    shape: Tuple[int, ...]
    alpha: float
    x_layout: str
    y_layout: str
    scales: Tuple[float, float]
    seed: int
    special: Optional[tuple] = None


@st.composite
def scale_add_cases(draw):
    shape = draw(st.one_of(st.lists(st.integers(0, 12), min_size=1, max_size=4).map(tuple),
                           st.integers(0, 5000).map(lambda n: (n,))))
    # Not below 1e-3 in magnitude: alpha * x rounds alpha to float (as eager
    # does), and a subnormal alpha rounds to 0 (0 * inf = NaN where the
    # exact product is inf).
    alpha = draw(st.one_of(st.just(0.0), st.floats(1e-3, 10.0), st.floats(-10.0, -1e-3)))
    return ScaleAddCase(
        shape=shape, alpha=alpha,
        x_layout=draw(LAYOUTS), y_layout=draw(LAYOUTS), scales=draw(_scales(2)),
        seed=draw(SEED), special=draw(_special(["x", "y"])))


# ---------------------------------------------------------------- inputs

def _randn(gen, shape, scale=1.0):
    return torch.randn(shape, generator=gen) * scale


def _place_special(values, special, main):
    """Puts ``special`` (see :func:`_special`) into ``values`` (float32 CPU
    tensors by name); an input this case lacks, or an empty one, takes
    ``main`` instead.  Returns the value placed, or None."""
    if special is None:
        return None
    name, raw, value = special
    if name not in values or values[name].numel() == 0:
        name = main
    if values[name].numel() == 0:
        return None
    values[name].view(-1)[raw % values[name].numel()] = value
    return value


def _in_layout(t, layout):
    """A tensor holding the values of ``t`` (contiguous) in ``layout``."""
    if layout == "contiguous":
        return t.clone()
    if layout == "channels_last":
        return t.clone(memory_format=torch.channels_last)
    if layout == "transposed":  # non-contiguous (unless all but one dimension are 1)
        dims = list(reversed(range(t.dim())))
        return t.permute(dims).contiguous().permute(dims)
    # One element into a buffer, NaN on either side, in the strides of a new
    # tensor of the layout (a fresh contiguous one, or one of NHWC permuted
    # back, whose strides over dimensions of 1 are these too).
    if layout == "offset":
        return off_the_grid(t.clone(memory_format=torch.contiguous_format))
    if layout == "channels_last_offset":
        nhwc = t.permute(0, 2, 3, 1).clone(memory_format=torch.contiguous_format)
        return off_the_grid(nhwc.permute(0, 3, 1, 2))
    raise ValueError(layout)


def _autocast(amp):
    return torch.autocast("cuda", dtype=amp) if amp is not None else contextlib.nullcontext()


def _run(fn, leaves, amp, g):
    """fn's output and the gradient of every leaf, for the upstream gradient
    g; with g None, the output alone (an inference call: no leaf requires
    grad)."""
    with _autocast(amp):
        y = fn(**leaves)
    result = {"out": y.detach()}
    if g is not None:
        y.backward(g.to(y.dtype))
        result.update({f"{name}.grad": t.grad for name, t in leaves.items()})
    return result


# Eager's layouts for ours' with ``eager_layouts``: the same memory format,
# on the 16-byte grid (cuDNN's backward of a float32 channels-last input off
# it fails, eager's as ours did before conv_bias_relu made such an x a copy).
_ALIGNED = {"offset": "contiguous", "channels_last_offset": "channels_last"}


def _runs(reference, ours, values, dtypes, layouts, amp, out_shape, out_dtype, gen, device,
          truth_reference=None, grad=True, g=None, eager_layouts=False):
    """Runs the float64 truth, eager (``reference`` in the inputs' dtypes,
    contiguous, or with ``eager_layouts`` in ours' memory formats, on the
    16-byte grid: _ALIGNED) and ours (inputs in their layouts) on the same
    values and upstream gradient (``g``, float32 on the CPU, or drawn from
    ``gen``); with ``grad`` False, the outputs alone.  Returns (truth,
    eager, ours, our leaves)."""
    g = (torch.randn(out_shape, generator=gen) if g is None else g).to(device=device, dtype=out_dtype)
    cast = {k: v.to(device=device, dtype=dtypes[k]) for k, v in values.items()}
    truth = _run(truth_reference or reference,
                 {k: t.double().requires_grad_(grad) for k, t in cast.items()}, None,
                 g.double() if grad else None)
    def eager_leaf(name, t):
        layout = layouts.get(name, "contiguous")
        return _in_layout(t, _ALIGNED.get(layout, layout)).detach() if eager_layouts else t.clone()

    eager = _run(reference, {k: eager_leaf(k, t).requires_grad_(grad) for k, t in cast.items()}, amp,
                 g if grad else None)
    assert eager["out"].dtype == out_dtype, (eager["out"].dtype, out_dtype)
    leaves = {k: _in_layout(t, layouts.get(k, "contiguous")).detach().requires_grad_(grad)
              for k, t in cast.items()}
    poison_allocator(device, 4 * max([1] + [t.numel() for t in cast.values()]
                                     + [math.prod(out_shape)]))
    return truth, eager, _run(ours, leaves, amp, g if grad else None), leaves


def _first_difference(a, b):
    idx = (a != b).nonzero()
    return tuple(idx[0].tolist()) if len(idx) else None


def _check(truth, eager, ours, special, floors=None, amp=None, where_only=()):
    """Dtypes and shapes as eager's; then, with a special input value, the
    non-finite masks as eager's (for the names in ``where_only``, where
    values are not finite, not which of NaN, +inf and -inf, as eager's or
    as the float64 truth's), else the error
    bound (see the module docstring; ``floors``: name -> (magnitude of
    cancelling terms, the fraction of it allowed as error); ``amp``:
    the autocast dtype, whose rounding unit is then the slack: a float32
    gradient of a bfloat16 product carries bfloat16's error, and on a
    handful of elements eager's roundings may cancel by chance)."""
    problems = []
    for name, theirs in eager.items():
        mine = ours.get(name)
        assert theirs is not None and mine is not None, (
            f"{name}: missing (ours: {mine is not None}, eager: {theirs is not None})")
        assert mine.dtype == theirs.dtype, f"{name}: dtype {mine.dtype}, eager's {theirs.dtype}"
        assert mine.shape == theirs.shape, f"{name}: shape {tuple(mine.shape)}, eager's " \
                                           f"{tuple(theirs.shape)}"
        if special:
            kinds = ((("nan", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf))
                     if name not in where_only else (("non-finite", lambda t: ~torch.isfinite(t)),))
            for kind, mask in kinds:
                a, b = mask(mine), mask(theirs)
                if not torch.equal(a, b) and not (name in where_only
                                                  and torch.equal(a, mask(truth[name]))):
                    problems.append(f"{name} {kind}: ours {a.sum().item()}, eager "
                                    f"{b.sum().item()}, first difference at "
                                    f"{_first_difference(a, b)}")
            continue
        t = truth[name]
        if t.numel() == 0:
            continue
        err_ours, err_eager = rel_error(mine, t), rel_error(theirs, t)
        slack = torch.finfo(mine.dtype if amp is None else amp).eps
        floor, factor = (floors or {}).get(name, (0.0, 0.0))
        if floor:
            scale = t.abs().max().item()
            slack = max(slack, factor * floor / (scale if scale > 0 else 1.0))
        if not err_ours <= 1.5 * err_eager + slack:
            problems.append(f"{name}: error {err_ours:.3e}, eager's {err_eager:.3e}, "
                            f"slack {slack:.3e}")
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------- references

def _per_channel(v, z):
    return v.reshape(-1, *[1] * (z.dim() - 2))


def _group_norm(a, groups, weight, bias, eps):
    """torch's GroupNorm (torch.group_norm: F.group_norm refuses a single
    value per group over the batch), with three detours that keep its
    values: a bias without a weight gets a weight of ones (the backward of
    the bias-only form fails on CPU, "tensor does not have a device"), and
    an empty batch runs the formula in elementwise ops (group_norm's
    backward fails there too, in float32 under autocast as group_norm);
    nothing guarantees CUDA does better."""
    if weight is None and bias is not None:
        weight = torch.ones_like(bias)
    if weight is not None and weight.dim() == 2:  # per element (_vector_terms)
        n = _group_norm(a, groups, None, None, eps)
        return n * weight if bias is None else n * weight + bias
    if a.shape[0]:
        return torch.group_norm(a, groups, weight, bias, eps, torch.backends.cudnn.enabled)
    if a.dtype != torch.float64 and torch.is_autocast_enabled(a.device.type):
        a, weight, bias = (t if t is None else t.float() for t in (a, weight, bias))  # fp32 list
    g = a.view(0, groups, a.shape[1] // groups)
    d = g - g.mean(2, keepdim=True)
    y = d * ((d * d).mean(2, keepdim=True) + eps).rsqrt()
    y = y.view(a.shape)
    y = y if weight is None else y * weight
    return y if bias is None else y + bias


def _chain_reference(chain, groups, eps, z, lin_bias=None, extra_bias=None, gn_weight=None,
                     gn_bias=None, mul_weight=None, record=None, shake=None):
    """The chain in torch ops (tests/test_gn_chain.py's _reference, absent
    vectors skipped).  ``record``: a dict receiving the GroupNorm's input
    ``a`` and output ``n`` (its gradient retained); ``shake``: see
    :func:`_shaken`, applied to ``a`` and ``n``."""
    a = z if lin_bias is None else z + lin_bias
    if chain == "swish_bias_gn":
        a = F.silu(a)
        a = a if extra_bias is None else a + extra_bias
    elif chain == "bias_hardtanh_mish_gn":
        a = F.mish(F.hardtanh(a if extra_bias is None else a + extra_bias))
    if shake is not None:
        a = shake(a, groups)
    n = _group_norm(a, groups, gn_weight, gn_bias, eps)
    if shake is not None:
        n = shake(n, groups)
    out = F.silu(F.silu(n) * mul_weight) if chain == "gn_swish_mul_swish" else n
    if record is not None:
        n.retain_grad()
        record.update(a=a, n=n, gn_weight=gn_weight)
    return out


def _gn_terms(record, groups, eps):
    """[rows, C]: rstd * |gamma * dn| per element, float64, from the truth
    run's GroupNorm (``record``: see :func:`_chain_reference`): the size of
    the terms that cancel in the gradient of its input."""
    a, n, gn_weight = record["a"].detach(), record["n"], record["gn_weight"]
    rows, channels = a.shape
    rstd = (a.view(rows, groups, -1).var(2, unbiased=False) + eps).rsqrt()
    gamma = gn_weight.detach() if gn_weight is not None else 1.0
    return rstd.repeat_interleave(channels // groups, 1) * (n.grad * gamma).abs()


def _cancellation_factor(per_group, dtype):
    """The error allowed on a gradient through the GroupNorm's input, as a
    fraction of the cancelling terms' size (see the module docstring): 2^-7
    over 1 or 2 channels per group, whose exact gradient is (nearly) zero;
    else 16 units of rounding, a few roundings of each term (a wrong formula
    errs by the terms' whole size)."""
    return 2**-7 if per_group <= 2 else 16 * torch.finfo(dtype).eps


# The chains' vectors applied after the GroupNorm, element by element.
AFTER_NORM = ("gn_weight", "gn_bias", "mul_weight")


def _vector_terms(reference, values, dtypes, g, device):
    """For each of the chain's vectors in :data:`AFTER_NORM` (as
    ``"<name>.grad"``): the largest column sum of its gradient's terms,
    ``|g * d out / d v|`` over the rows, float64, from ``reference`` run on
    the vectors spread over the rows (one leaf per element).  Each value of
    such a vector acts on its own column alone, so those leaves' gradients
    are the terms, and the vector's gradient is their column sums."""
    leaves = {k: v.to(device=device, dtype=dtypes[k]).double() for k, v in values.items()}
    rows = g.shape[0]
    spread = {k: leaves[k].expand(rows, -1).clone().requires_grad_(True)
              for k in AFTER_NORM if k in leaves}
    if not spread:
        return {}
    out = reference(**{**leaves, **spread})
    grads = torch.autograd.grad(out, list(spread.values()), g.to(device=device).double())
    return {f"{k}.grad": t.abs().sum(0).max().item() for k, t in zip(spread, grads)}


# Their slack (see the module docstring): units of float32 of the terms.
VECTOR_TERM_UNITS = 16


# How far _shaken moves a value, in units of float32 (eps) of its group's
# largest magnitude (the float32 chains' pre-activations err by up to about
# 5 units of their value, a GroupNorm's mean by about one of its group's
# largest).
SHAKE_UNITS = 4


def _shaken(reference, values, dtypes, g, out_dtype, device, seed):
    """The float64 truth, run again with the intermediate values that
    ``reference`` hands to its ``shake`` argument moved by random amounts:
    ``shake(t, groups)`` moves each value of ``t`` (rows x channels) by up
    to SHAKE_UNITS units of float32 of the largest magnitude in its row's
    group, ``shake(t, amount=m)`` by up to ``m`` (a tensor like t).  The
    moves are constants, so the backward is the exact one of the moved
    forward.  The result (as :func:`_run`'s, for the upstream gradient
    ``g`` as :func:`_runs` takes it) against the truth shows how far a
    float32 computation's roundings of those values take each output and
    gradient: where the problem is ill-conditioned (a GroupNorm over values
    close together, a product that cancels), farther than their own
    rounding unit, for eager and ours alike."""
    gen = torch.Generator().manual_seed(seed)

    def shake(t, groups=1, amount=None):
        if amount is None:
            rows = t.shape[0]
            peak = t.detach().abs().reshape(rows, groups, -1).amax(2, keepdim=True)
            amount = (SHAKE_UNITS * torch.finfo(torch.float32).eps * peak).expand(
                rows, groups, t.shape[1] // groups).reshape(t.shape)
        r = torch.rand(t.shape, generator=gen, dtype=torch.float64).to(t.device)
        return t + amount * (2 * r - 1)

    leaves = {k: v.to(device=device, dtype=dtypes[k]).double().requires_grad_(True)
              for k, v in values.items()}
    return _run(lambda **t: reference(shake=shake, **t), leaves, None,
                g.to(device=device, dtype=out_dtype).double())


def _with_sensitivity(floors, truth, shaken):
    """``floors`` (see :func:`_check`) with each tensor's error allowed at
    least twice the distance of ``shaken`` (:func:`_shaken`) from ``truth``
    (the moves are random: twice the distance covers roundings that add up
    less kindly)."""
    floors = dict(floors or {})
    for name, t in truth.items():
        if t is None:  # (an unused leaf: _check refuses it)
            continue
        move = 2 * (shaken[name] - t).abs().max().item() if t.numel() else 0.0
        magnitude, factor = floors.get(name, (0.0, 0.0))
        floors[name] = (max(magnitude * factor, move), 1.0)
    return floors


def _product_slack(mode, precision, k):
    """The error allowed on a float32 product, as a fraction of its terms'
    magnitude (sum |a_i b_i|), carried through the ops after it; None in
    the half-precision modes (their rounding unit is the slack).  3xTF32
    (the default precision, sums of ops.gemm.SGEMM_BELOW_INNER terms or
    more: see ops.gemm.uses_sgemm) errs by the split's representation error, about
    2^-21 of the terms (the documented precision), so 2^-20.  Float32 sums
    (cuBLAS SGEMM, in another order than eager's where the layouts or the
    epilogue differ) err by about sqrt(k) roundings of the terms (a random
    walk of k roundings of 2^-24).  Where the sum cancels, either can be a
    few times eager's error on a handful of outputs."""
    if mode != "fp32":
        return None
    if precision in (None, "3xtf32") and k >= ops.gemm.SGEMM_BELOW_INNER:
        return 2**-20
    return math.sqrt(max(k, 1)) * 2**-24


def _chain_inputs(chain, present):
    return [v for v in CHAIN_VECTORS[chain] if v in present or v == "mul_weight"]


# ---------------------------------------------------------------- linear

@pytest.mark.parametrize("mode", list(MODES))
@PROPERTY_SETTINGS
@given(case=linear_cases())
@example(case=LinearCase((0,), 40, 24, True, "relu", None, "contiguous", "contiguous", False,
                         (1.0, 1.0, 1.0), 0))
@example(case=LinearCase((1,), 40, 33, True, "relu", None, "offset", "transposed", True,
                         (1.0, 0.2, 1.0), 1))
def test_linear(mode, case, device):
    dtype, amp = MODES[mode], (None if MODES[mode] else AMP)
    gen = torch.Generator().manual_seed(case.seed)
    n, k = case.out_features, case.in_features
    values = {"x": _randn(gen, case.lead + (k,), case.scales[0]),
              "weight": _randn(gen, (n, k), case.scales[1])}
    if case.bias:
        values["bias"] = _randn(gen, (n,), case.scales[2])
    special = _place_special(values, case.special, "x")
    precision = case.precision
    act = case.activation

    def reference(x, weight, bias=None):
        y = F.linear(x, weight, bias)
        return F.relu(y) if act == "relu" else y

    def ours(x, weight, bias=None):
        return ops.linear(x, weight, bias, activation=act, precision=precision)

    layouts = {"x": case.x_layout, "weight": case.w_layout,
               "bias": "offset" if case.vec_offset else "contiguous"}
    g = torch.randn(case.lead + (n,), generator=gen)  # (as _runs would draw it)
    truth, eager, mine, _ = _runs(
        reference, ours, values, {name: dtype or torch.float32 for name in values}, layouts, amp,
        case.lead + (n,), dtype or AMP, gen, device, g=g)
    floors = None
    if mode == "fp32" and values["x"].numel():
        # Each product's terms: the output's (k of them), x.grad's (n),
        # weight.grad's (one a row).
        x64, w64 = values["x"].reshape(-1, k).double().abs(), values["weight"].double().abs()
        g64 = g.reshape(-1, n).double().abs()
        rows = x64.shape[0]
        floors = {"out": ((x64 @ w64.t()).max().item(), _product_slack(mode, precision, k)),
                  "x.grad": ((g64 @ w64).max().item(), _product_slack(mode, precision, n)),
                  "weight.grad": ((g64.t() @ x64).max().item(), _product_slack(mode, precision, rows))}
    _check(truth, eager, mine, special is not None, floors, amp=amp)


# ---------------------------------------------------------------- bias_relu

@pytest.mark.parametrize("mode", list(MODES))
@PROPERTY_SETTINGS
@given(case=bias_relu_cases())
@example(case=BiasReluCase((0, 64), "contiguous", True, "flat", False, False,
                           (1.0, 1.0, 1.0), 0))
@example(case=BiasReluCase((1, 5, 3, 7), "channels_last_offset", True, "c11", True, True,
                           (1.0, 1.0, 1.0), 1))
def test_bias_relu(mode, case, device):
    dtype, amp = MODES[mode], (None if MODES[mode] else AMP)
    gen = torch.Generator().manual_seed(case.seed)
    channels = case.shape[1]
    vec_shape = (channels,) if case.bias_shape == "flat" else (channels, 1, 1)
    values = {"z": _randn(gen, case.shape, case.scales[0]),
              "bias": _randn(gen, vec_shape, case.scales[1])}
    if case.bias2:
        values["bias2"] = _randn(gen, vec_shape, case.scales[2])
    special = _place_special(values, case.special, "z")
    dtypes = {name: dtype or torch.float32 for name in values}
    if amp is not None and case.half_z:
        dtypes["z"] = AMP

    def reference(z, bias, bias2=None):
        y = torch.relu(z + _per_channel(bias, z))
        return y if bias2 is None else y + _per_channel(bias2, z)

    def ours(z, bias, bias2=None):
        return ops.bias_relu(z, bias, bias2)

    vec_layout = "offset" if case.vec_offset else "contiguous"
    layouts = {"z": case.layout, "bias": vec_layout, "bias2": vec_layout}
    truth, eager, mine, leaves = _runs(reference, ours, values, dtypes, layouts, amp, case.shape,
                                       dtype or torch.float32, gen, device)
    _check(truth, eager, mine, special is not None, amp=amp)
    z, out = leaves["z"], mine["out"]
    if case.layout != "transposed" and z.numel():  # the result keeps z's (dense) layout
        assert [s for s, n in zip(out.stride(), out.shape) if n > 1] == \
            [s for s, n in zip(z.stride(), z.shape) if n > 1], (out.stride(), z.stride())


# ---------------------------------------------------------------- gn_chain

@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("chain", CHAINS)
@PROPERTY_SETTINGS
@given(case=gn_cases())
@example(case=GNCase(0, 4, 8, OPTIONAL_VECTORS, 1e-5, "contiguous", False, False,
                     (1.0,) * 6, 0))
@example(case=GNCase(1, 3, 5, OPTIONAL_VECTORS, 1e-5, "offset", True, True, (1.0,) * 6, 1))
# One channel a group, 88's multiplier's gradient a cancelling sum of 54 rows (float32)
@example(case=GNCase(54, 3, 1, ("extra_bias", "gn_bias", "lin_bias"), 1e-5, "contiguous", False,
                     False, (1.0,) * 5 + (3.3164540855862685,), 0))
def test_gn_chain(chain, mode, case, device):
    dtype, amp = MODES[mode], (None if MODES[mode] else AMP)
    gen = torch.Generator().manual_seed(case.seed)
    channels = case.groups * case.per_group
    values = {"z": _randn(gen, (case.rows, channels), case.scales[0])}
    for name, scale in zip(ALL_VECTORS, case.scales[1:]):
        vector = _randn(gen, (channels,), scale)  # drawn always: the same values whatever is used
        if name in _chain_inputs(chain, case.vectors):
            values[name] = vector
    special = _place_special(values, case.special, "z")
    dtypes = {name: dtype or torch.float32 for name in values}
    if amp is not None and case.half_z:
        dtypes["z"] = AMP
    groups, eps = case.groups, case.eps

    def reference(z, record=None, shake=None, **vectors):
        return _chain_reference(chain, groups, eps, z, record=record, shake=shake, **vectors)

    def ours(z, **vectors):
        return ops.gn_chain(z, chain, groups, eps=eps, **vectors)

    record = {}
    vec_layout = "offset" if case.vec_offset else "contiguous"
    layouts = {"z": case.layout, **{name: vec_layout for name in ALL_VECTORS}}
    g = torch.randn((case.rows, channels), generator=gen)  # (as _runs would draw it)
    truth, eager, mine, _ = _runs(
        reference, ours, values, dtypes, layouts, amp, (case.rows, channels),
        dtype or torch.float32, gen, device,
        truth_reference=lambda **t: reference(record=record, **t), g=g)
    floors = None
    if case.rows:
        terms = _gn_terms(record, groups, eps)
        column = terms.sum(0).max().item()
        factor = _cancellation_factor(case.per_group, amp or dtype)
        floors = {"z.grad": (terms.max().item(), factor), "lin_bias.grad": (column, factor),
                  "extra_bias.grad": (column, factor)}
        unit = VECTOR_TERM_UNITS * torch.finfo(torch.float32).eps
        floors.update({name: (size, unit) for name, size in _vector_terms(
            reference, values, dtypes, g, device).items()})
        if mode == "fp32" and special is None:
            floors = _with_sensitivity(floors, truth, _shaken(
                reference, values, dtypes, g, torch.float32, device, case.seed))
    _check(truth, eager, mine, special is not None, floors, amp=amp)


# ---------------------------------------------------------------- linear_gn_chain

@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("chain", CHAINS)
@PROPERTY_SETTINGS
@given(case=linear_gn_cases())
@example(case=LinearGNCase(0, 40, 4, 8, OPTIONAL_VECTORS, 1e-5, None, "contiguous", "contiguous",
                           False, (1.0, 0.2) + (1.0,) * 5, 0))
@example(case=LinearGNCase(1, 40, 2, 16, OPTIONAL_VECTORS, 1e-5, None, "offset", "transposed",
                           True, (1.0, 0.2) + (1.0,) * 5, 1))
# The GroupNorm weight's gradient through 16-bit z's rounding (float16, 88)
@example(case=LinearGNCase(69, 54, 2, 3, ("extra_bias", "gn_bias", "gn_weight", "lin_bias"), 1e-5,
                           None, "contiguous", "contiguous", False,
                           (10.0, 10.0**0.5, 10.0**0.3203125, 1.0, 10.0**0.75, 1.0, 10.0), 9517))
def test_linear_gn_chain(chain, mode, case, device):
    dtype, amp = MODES[mode], (None if MODES[mode] else AMP)
    gen = torch.Generator().manual_seed(case.seed)
    channels, k = case.groups * case.per_group, case.in_features
    values = {"x": _randn(gen, (case.rows, k), case.scales[0]),
              "weight": _randn(gen, (channels, k), case.scales[1])}
    for name, scale in zip(ALL_VECTORS, case.scales[2:]):
        vector = _randn(gen, (channels,), scale)
        if name in _chain_inputs(chain, case.vectors):
            values[name] = vector
    special = _place_special(values, case.special, "x")
    precision = case.precision
    groups, eps = case.groups, case.eps

    # The product's error, as a fraction of its terms: float32's
    # (_product_slack), or its rounding to 16 bits (under autocast with the
    # operands' casts: a unit of the 16-bit type in all).
    product = _product_slack(mode, precision, k) or torch.finfo(dtype or AMP).eps

    def reference(x, weight, lin_bias=None, record=None, shake=None, **vectors):
        # nn.Linear: the bias in the GEMM (in the autocast dtype under autocast)
        z = F.linear(x, weight, lin_bias)
        if shake is not None:
            z = shake(z, amount=product * (x.detach().abs() @ weight.detach().abs().t()))
        return _chain_reference(chain, groups, eps, z, record=record, shake=shake, **vectors)

    def ours(x, weight, lin_bias=None, **vectors):
        return ops.linear_gn_chain(x, weight, lin_bias, chain, groups, eps=eps,
                                   precision=precision, **vectors)

    record = {}
    vec_layout = "offset" if case.vec_offset else "contiguous"
    layouts = {"x": case.x_layout, "weight": case.w_layout,
               **{name: vec_layout for name in ALL_VECTORS}}
    dtypes = {name: dtype or torch.float32 for name in values}
    g = torch.randn((case.rows, channels), generator=gen)  # (as _runs would draw it)
    truth, eager, mine, _ = _runs(
        reference, ours, values, dtypes, layouts, amp, (case.rows, channels),
        dtype or torch.float32, gen, device,
        truth_reference=lambda **t: reference(record=record, **t), g=g)
    floors = {}
    if case.rows:
        terms = _gn_terms(record, groups, eps)
        x64, w64 = (values[n].to(device=device, dtype=dtype or torch.float32).double()
                    for n in ("x", "weight"))
        factor = _cancellation_factor(case.per_group, amp or dtype)
        column = terms.sum(0).max().item()
        # One feature: x[i] scales row i of z, which the GroupNorm undoes.
        floors = {"x.grad": ((terms @ w64.abs()).max().item(),
                             2**-7 if k == 1 else factor),
                  "weight.grad": ((terms.t() @ x64.abs()).max().item(), factor),
                  "lin_bias.grad": (column, factor), "extra_bias.grad": (column, factor)}
        unit = VECTOR_TERM_UNITS * torch.finfo(torch.float32).eps
        floors.update({name: (size, unit) for name, size in _vector_terms(
            reference, values, dtypes, g, device).items()})
        if special is None:  # (z's error, and the chain's, carried; g as the truth takes it)
            floors = _with_sensitivity(floors, truth, _shaken(
                reference, values, dtypes, g, dtype or torch.float32, device, case.seed))
    _check(truth, eager, mine, special is not None, floors, amp=amp)


# ---------------------------------------------------------------- conv_bias_relu

def _lift_conv_rule(mp):
    """The engine wherever its kernels take a call, as the kernel tests of
    tests/test_conv_bias_relu.py run it: the routing rule (_engine_pays) and
    the size thresholds of training, float32 and the weight gradient lifted
    (``mp``: a pytest MonkeyPatch)."""
    mp.setattr(CONV, "_engine_pays", lambda *args: True)
    mp.setattr(CONV, "ENGINE_TRAINING_MIN_ELEMENTS", 0)
    mp.setattr(CONV, "ENGINE_FLOAT32_MIN_ELEMENTS", 0)
    mp.setattr(CONV, "WGRAD_COUT_MULTIPLE", 8)
    mp.setattr(CONV, "WGRAD_MIN_ROW_SHARE", 0.0)


@pytest.mark.parametrize("mode", list(MODES))
@PROPERTY_SETTINGS
@given(case=conv_cases())
@example(case=ConvCase(0, 8, 8, (3, 5), (1, 1), "flat", "contiguous", "contiguous", True, False,
                       (1.0,) * 4, 0))
@example(case=ConvCase(2, 5, 32, (6, 130), (3, 3), "c11", "channels_last", "contiguous", True,
                       True, (1.0,) * 4, 1))
@example(case=ConvCase(1, 16, 24, (4, 126), (2, 3), "one", "contiguous", "channels_last", False,
                       True, (1.0,) * 4, 2))
# A NaN in x: cuDNN's 16-bit weight gradient puts NaN in the other input channel too
@example(case=ConvCase(1, 2, 32, (1, 1), (3, 3), "c11", "contiguous", "contiguous", True, True,
                       (1.0,) * 4, 0, ("x", 1, float("nan"))))
def test_conv_bias_relu(mode, case, device):
    """conv_bias_relu on either route, training or inference (see the
    module docstring): in fp32 the TF32 engine's and cuDNN's float32
    kernels multiply the same numbers, in amp the casts are exact."""
    dtype, amp = MODES[mode], (None if MODES[mode] else AMP)
    gen = torch.Generator().manual_seed(case.seed)
    n, cin, cout = case.n, case.in_channels, case.out_channels
    (oh, ow), (kh, kw) = case.out_hw, case.kernel
    values = {"x": _randn(gen, (n, cin, oh + kh - 1, ow + kw - 1), case.scales[0]),
              "weight": _randn(gen, (cout, cin, kh, kw), case.scales[1] / math.sqrt(cin * kh * kw)),
              "conv_bias": _randn(gen, (cout,), case.scales[2])}
    bias_shape = {"c11": (cout, 1, 1), "flat": (cout,), "one": (1,)}.get(case.bias)
    if bias_shape is not None:
        values["bias"] = _randn(gen, bias_shape, case.scales[3])
    for name in ("x", "weight"):
        if mode == "fp32":
            values[name] = CONV._tf32(values[name])
        elif amp is not None:
            values[name] = values[name].to(amp).float()
    special = _place_special(values, case.special, "x")

    def reference(x, weight, conv_bias, bias=None):  # (conv_bias after the convolution, as documented)
        y = F.relu(F.conv2d(x, weight) + conv_bias.reshape(-1, 1, 1))
        return y if bias is None else y + bias.reshape(-1, 1, 1)

    def ours(x, weight, conv_bias, bias=None):
        return ops.conv_bias_relu(x, weight, conv_bias, bias)

    out_dtype = dtype or torch.float32  # (under autocast: the float32 conv_bias's promotion)
    g = torch.randn((n, cout, oh, ow), generator=gen)
    if mode == "fp32":
        g = CONV._tf32(g)
    if special is None and n:  # g is 0 where relu's side is chance (module docstring)
        x64, w64, cb64 = (values[k].to(device).double() for k in ("x", "weight", "conv_bias"))
        terms = F.conv2d(x64.abs(), w64.abs(), cb64.abs())
        unit = {"fp32": 2**-17, "fp16": 2**-8}.get(mode, 2**-6)
        g[(F.conv2d(x64, w64, cb64).abs() <= unit * terms).cpu()] = 0.0
    with pytest.MonkeyPatch.context() as mp:
        if case.engine:
            _lift_conv_rule(mp)
        truth, eager, mine, leaves = _runs(
            reference, ours, values, {name: dtype or torch.float32 for name in values},
            {"x": case.x_layout, "weight": case.w_layout}, amp, g.shape, out_dtype, gen, device,
            grad=case.train, g=g, eager_layouts=True)
        bias = leaves.get("bias")
        with _autocast(amp):  # (hypothesis's statistics: how often each route ran)
            event("route: " + CONV.route(leaves["x"], leaves["weight"], leaves["conv_bias"],
                                         None if bias is None else bias.reshape(-1)))
    floors = None
    if mode == "fp32" and n:  # tensor cores' float32 sums (module docstring)
        x64, w64, g64 = (t.to(device).double().abs() for t in (values["x"], values["weight"], g))
        floors = {"out": (F.conv2d(x64, w64).max().item(), 2**-20),
                  "x.grad": (F.conv_transpose2d(g64, w64).max().item(), 2**-20),
                  "weight.grad": (torch.nn.grad.conv2d_weight(x64, w64.shape, g64).max().item(),
                                  2**-20)}
    # The weight's gradient where an inf of x meets relu's zero gradient
    # (0 x inf in its sum): NaN in IEEE arithmetic and in ours, +-inf in
    # eager's for some of those channels (float16 on the H200, eager's NaN
    # and +-inf the same for NCHW and channels-last x, deterministic or not):
    # there, where values are not finite.
    _check(truth, eager, mine, special is not None, floors, amp=amp, where_only=("weight.grad",))
    x, out = leaves["x"], mine["out"]
    if out.numel():  # y in x's memory format: channels-last where x is only that, else NCHW
        fmt = (torch.channels_last if x.is_contiguous(memory_format=torch.channels_last)
               and not x.is_contiguous() else torch.contiguous_format)
        assert out.is_contiguous(memory_format=fmt), (fmt, out.stride(), x.stride())


# ---------------------------------------------------------------- scale_add

@pytest.mark.parametrize("mode", FLOAT_MODES)
@PROPERTY_SETTINGS
@given(case=scale_add_cases())
@example(case=ScaleAddCase((0, 7), 2.5, "contiguous", "offset", (1.0, 1.0), 0))
@example(case=ScaleAddCase((1, 33), -0.75, "offset", "transposed", (1.0, 1.0), 1))
def test_scale_add(mode, case, device):
    dtype = MODES[mode]
    gen = torch.Generator().manual_seed(case.seed)
    values = {"x": _randn(gen, case.shape, case.scales[0]),
              "y": _randn(gen, case.shape, case.scales[1])}
    special = _place_special(values, case.special, "x")
    alpha = case.alpha

    def reference(x, y):
        return alpha * x + y

    def ours(x, y):
        return ops.scale_add(x, y, alpha)

    truth, eager, mine, _ = _runs(
        reference, ours, values, {"x": dtype, "y": dtype}, {"x": case.x_layout, "y": case.y_layout},
        None, case.shape, dtype, gen, device)
    _check(truth, eager, mine, special is not None)
