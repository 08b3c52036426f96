"""conv_bias_relu: relu(conv2d(x, W) + conv_bias) + bias.  CPU tier: bad
arguments refused before any launch; TF32 rounding.  GPU tier: the engine
route (an implicit-GEMM convolution on Hopper, after a channels-last copy of
an NCHW x; 16-bit, or float32 as TF32) and the cudnn route against a float64 run of the reference, output
poisoned with NaN first; NaN / inf placement; two runs bitwise equal; the
route each call takes."""
import contextlib
import importlib
import math
import re
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from cupy_fused import _autograd as AG, _runtime, ops
from cupy_fused.ops import gemm
from cupy_fused.testing import (assert_non_finite_where, held_bytes, off_the_grid, poison_allocator,
                                rel_error)

CB = importlib.import_module("cupy_fused.ops.conv_bias_relu")  # the module, not the op
_ENGINE_PAYS = CB._engine_pays  # the routing rule, for the tests of it


@pytest.fixture(autouse=True)
def _engine_at_any_size(monkeypatch):
    """The engine's kernels at these tests' small shapes, which the routing
    rule (_engine_pays) sends to cuDNN; its own tests call _ENGINE_PAYS."""
    monkeypatch.setattr(CB, "_engine_pays", lambda *args: True)


def _reference(x, w, cb, b):
    y = F.relu(F.conv2d(x, w) + cb.reshape(-1, 1, 1))
    return y if b is None else y + b.reshape(-1, 1, 1)


def _keep_returned_grads(*tensors):
    """Keeps, as ``t.returned_grad``, the gradient a backward hands each of
    ``tensors``, as the op made it: a hook sees it before AccumulateGrad,
    which copies a gradient whose strides differ from a leaf's into the
    leaf's own layout (so ``.grad``'s layout says nothing of the op's).
    Returns ``tensors``."""
    for t in tensors:
        t.register_hook(lambda g, t=t: setattr(t, "returned_grad", g))
    return tensors


def _nan_filled(t):
    """``t`` filled with NaN where it holds floats (an element a kernel fails
    to write then shows as NaN)."""
    return t.fill_(float("nan")) if t.is_floating_point() else t


def _layout(t):
    """The strides of ``t``'s dimensions of more than one element (the
    others' strides are arbitrary)."""
    return [s for s, n in zip(t.stride(), t.shape) if n > 1]


@pytest.mark.skipif(not hasattr(getattr(torch.backends.cudnn, "conv", None), "fp32_precision"),
                    reason="torch.backends.cudnn.conv.fp32_precision: torch >= 2.9")
def test_tf32_read_from_the_newer_precision_api_under_compile(past_device_check):
    """With cuDNN convolutions' fp32_precision set apart from the RNNs'
    (reading allow_tf32 then raises), the route's TF32 question is answered
    from it, in eager calls and while torch.compile traces (which cannot
    follow the eager form's try / except)."""
    conv = torch.backends.cudnn.conv
    saved = conv.fp32_precision
    x, w, cb = torch.rand(2, 8, 6, 6), torch.rand(8, 8, 3, 3), torch.rand(8)
    try:
        for precision, tf32 in [("ieee", False), ("tf32", True)]:
            conv.fp32_precision = precision
            assert CB._cudnn_tf32() is tf32
            assert (CB.engine_dtypes(x, w, cb, None) is not None) is tf32
            torch._dynamo.reset()
            traced = torch.compile(lambda t: t * 2 if CB._cudnn_tf32() else t * 3,
                                   backend="eager", fullgraph=True)
            assert torch.equal(traced(x), x * (2 if tf32 else 3))
    finally:
        conv.fp32_precision = saved
        torch._dynamo.reset()


def test_bad_arguments_are_refused(past_device_check, monkeypatch):
    x = torch.rand(2, 8, 6, 6)
    w = torch.rand(4, 8, 3, 3)
    cb, b = torch.rand(4), torch.rand(4, 1, 1)
    with pytest.raises(ValueError, match=r"weight must be 4-D \[C_out, C_in, KH, KW\], got shape \(4, 8\)"):
        ops.conv_bias_relu(x, torch.rand(4, 8), cb, b)
    with pytest.raises(TypeError, match=r"weight must be a torch.Tensor \[C_out, C_in, KH, KW\], got list"):
        ops.conv_bias_relu(x, [1.0], cb, b)
    with pytest.raises(ValueError, match=r"weight must have x's 8 input channels"):
        ops.conv_bias_relu(x, torch.rand(4, 5, 3, 3), cb, b)
    with pytest.raises(ValueError, match=r"the kernel \(7 x 3\) must fit"):
        ops.conv_bias_relu(x, torch.rand(4, 8, 7, 3), cb, b)
    with pytest.raises(TypeError, match=r"weight must have the dtype of x"):
        ops.conv_bias_relu(x, w.half(), cb, b)
    with pytest.raises(ValueError, match=r"conv_bias must have C_out = 4 values and bias C_out"):
        ops.conv_bias_relu(x, w, torch.rand(5), b)
    with pytest.raises(TypeError, match=r"conv_bias must be a torch.Tensor"):
        ops.conv_bias_relu(x, w, None, b)
    with pytest.raises(TypeError, match=r"bias must be a torch.Tensor or None, got float"):
        ops.conv_bias_relu(x, w, cb, 1.0)
    with pytest.raises(TypeError, match=r"x must be a torch.Tensor"):
        ops.conv_bias_relu([1.0], w, cb, b)
    # The vectors are checked before the convolution runs, on either route,
    # under their own names.
    with pytest.raises(TypeError, match=r"conv_bias must have dtype float32, float16 or bfloat16"):
        ops.conv_bias_relu(x, w, torch.arange(4), b)
    with pytest.raises(TypeError, match=r"bias must have dtype float32, float16 or bfloat16"):
        ops.conv_bias_relu(x, w, cb, b.double())
    with pytest.raises(ValueError, match=r"conv_bias must hold one value per channel \(4 values"):
        ops.conv_bias_relu(x, w, torch.rand(2, 2), b)
    with pytest.raises(ValueError, match=r"bias must be on a CUDA device, got device meta"):
        ops.conv_bias_relu(x, w, cb, torch.rand(4, device="meta"))
    # No channels out or in (torch's own convolution fails, or returns a
    # wrong shape, deep inside).
    with pytest.raises(ValueError, match=r"weight must have at least one output and one input channel, "
                                         r"got shape \(0, 8, 3, 3\)"):
        ops.conv_bias_relu(x, torch.rand(0, 8, 3, 3), torch.rand(0))
    with pytest.raises(ValueError, match=r"weight must have at least one output and one input channel"):
        ops.conv_bias_relu(torch.rand(2, 0, 6, 6), torch.rand(4, 0, 3, 3), cb, b)
    # Under autocast a weight of any of the three float dtypes is taken (and
    # cast), no other.
    monkeypatch.setattr(CB, "autocast_dtype", lambda: torch.float16)
    for dtype in (torch.int64, torch.bool, torch.float64, torch.complex64):
        with pytest.raises(TypeError, match=r"weight must have dtype float32, float16 or bfloat16"):
            ops.conv_bias_relu(x, w.to(dtype), cb, b)


def test_training_calls_take_the_engine_only_where_its_backward_applies(past_device_check,
                                                                         monkeypatch):
    """With a gradient to record, the engine route takes calls of at least
    ENGINE_TRAINING_MIN_ELEMENTS output values: an NCHW x in 16-bit (or
    under autocast, or float32 with TF32 allowed and at least
    ENGINE_FLOAT32_MIN_ELEMENTS output values) with C_out a multiple of 8,
    a channels-last one with C_out a multiple of 32; smaller calls take
    cuDNN."""
    monkeypatch.setattr(gemm, "has_wgmma", lambda device: True)
    x = torch.rand(2, 8, 6, 7, dtype=torch.bfloat16)
    w = torch.rand(16, 8, 3, 3, dtype=torch.bfloat16)
    cb, b = torch.rand(16, dtype=torch.bfloat16), torch.rand(16, 1, 1, dtype=torch.bfloat16)
    xg = x.clone().requires_grad_(True)
    assert CB.route(x, w, cb, b) == "engine"  # nothing to record: any size
    assert CB.route(xg, w, cb, b) == "cudnn"  # 2 * 16 * 4 * 5 values, below the threshold
    monkeypatch.setattr(CB, "ENGINE_TRAINING_MIN_ELEMENTS", 2 * 16 * 4 * 5)
    assert CB.route(xg, w, cb, b) == "engine"
    assert CB.route(x, w.clone().requires_grad_(True), cb, b) == "engine"
    assert CB.route(xg, w[:12], cb[:12], b[:12]) == "cudnn"  # C_out 12
    cl = xg.contiguous(memory_format=torch.channels_last)
    assert CB.route(cl, w, cb, b) == "cudnn"  # C_out 16: a row's mask bits not whole words
    w32 = torch.rand(32, 8, 3, 3, dtype=torch.bfloat16)
    cb32, b32 = torch.rand(32, dtype=torch.bfloat16), torch.rand(32, dtype=torch.bfloat16)
    assert CB.route(cl, w32, cb32, b32) == "engine"
    f32 = (xg.float(), w.float(), cb.float(), b.float())
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    assert CB.route(*f32) == "cudnn"  # below ENGINE_FLOAT32_MIN_ELEMENTS
    monkeypatch.setattr(CB, "ENGINE_FLOAT32_MIN_ELEMENTS", 2 * 16 * 4 * 5)
    assert CB.route(*f32) == "engine"
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    assert CB.route(*f32) == "cudnn"  # float32 without TF32: cuDNN's full-precision product
    monkeypatch.setattr(CB, "ENGINE_TRAINING_MIN_ELEMENTS", 2 * 16 * 4 * 5 + 1)
    assert CB.route(xg, w, cb, b) == "cudnn"


def test_engine_bounds_keep_the_kernels_32_bit_counts():
    """The engine takes shapes whose coordinates and K stay below 2^31 and
    whose output tiles' k-tiles stay below 2^32 (a block counts its k-tiles
    in an unsigned 32-bit counter), and cuDNN the others."""
    assert CB._engine_bounds((128, 64, 128, 128), (128, 64, 3, 3))  # problem 1
    assert CB._engine_bounds((528, 64, 256, 256), (64, 64, 3, 3))  # x and y past 2^31 elements
    assert not CB._engine_bounds((2**23, 1, 512, 128), (8, 1, 1, 1))  # 2^32 tile rows, a k-tile each
    assert CB._engine_bounds((2**23 - 1, 1, 512, 128), (8, 1, 1, 1))
    assert not CB._engine_bounds((1, 8, 2**31, 8), (8, 8, 1, 1))  # a coordinate of 2^31
    assert not CB._engine_bounds((1, 64, 2, 128), (2**31 + 128, 64, 1, 1))  # C_out past 2^31
    assert not CB._engine_bounds((1, 2**20, 1, 2**11), (8, 2**20, 1, 2**11))  # K = 2^31
    assert CB._engine_bounds((1, 2**20 - 64, 1, 2**11), (8, 2**20 - 64, 1, 2**11))
    # Every bound but the k-tiles' holds: 170460 tile rows x 16 channel tiles
    # x 262144 taps x 2 channel blocks.
    assert not CB._engine_bounds((1, 64, 4735, 4607), (2048, 64, 512, 512))
    assert CB._engine_bounds((1, 64, 4735, 4607), (2048, 64, 2, 2))


def test_deterministic_flag_is_restored_after_errors_and_overlaps():
    """The training route's cuDNN flag: set inside, restored on the way out
    of the outermost entry, also through an exception and across threads."""
    import threading

    before = torch.backends.cudnn.deterministic
    try:
        for start in (False, True):
            torch.backends.cudnn.deterministic = start
            with pytest.raises(ZeroDivisionError):
                with CB._deterministic_cudnn():
                    assert torch.backends.cudnn.deterministic
                    1 / 0
            assert torch.backends.cudnn.deterministic is start
            inner, outer = threading.Event(), threading.Event()

            def other():
                with CB._deterministic_cudnn():
                    inner.set()
                    outer.wait(5)

            with CB._deterministic_cudnn():
                t = threading.Thread(target=other)
                t.start()
                assert inner.wait(5)
            assert torch.backends.cudnn.deterministic  # the thread's entry still open
            outer.set()
            t.join(5)
            assert torch.backends.cudnn.deterministic is start
    finally:
        torch.backends.cudnn.deterministic = before


@pytest.mark.skipif(not hasattr(torch.library, "opcheck") or CB._CUDNN_CONV.op is None,
                    reason="needs torch.library.opcheck and custom ops (torch >= 2.4)")
@pytest.mark.parametrize("layout", ["nchw", "x_channels_last", "w_channels_last", "one_by_one"])
def test_cudnn_conv_custom_ops_match_their_fakes(layout):
    """torch.library.opcheck on the training route's convolution and its
    backward (CPU tensors: the same Python): schema, fake shapes and
    strides (channels-last outputs and gradients included), autograd
    registration, dynamic shapes."""
    gen = torch.Generator().manual_seed(4)
    kh = 1 if layout == "one_by_one" else 3
    x = torch.randn(2, 8, 7, 9, generator=gen)
    w = torch.randn(4, 8, kh, kh, generator=gen)
    if layout == "x_channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    if layout == "w_channels_last":
        w = w.contiguous(memory_format=torch.channels_last)
    x.requires_grad_(True)
    w.requires_grad_(True)
    torch.library.opcheck(CB._CUDNN_CONV.op, (x, w))
    dz = torch.randn(2, 4, 8 - kh, 10 - kh, generator=gen)
    for want in ((True, True), (True, False), (False, True)):
        torch.library.opcheck(CB._CUDNN_CONV.backward_op, (dz, x.detach(), w.detach(), *want))


def test_cudnn_backward_hands_cudnn_an_aligned_x(monkeypatch):
    """The "cudnn" route's backward on a channels-last x off the 16-byte
    grid (CPU tensors: the same Python; the GPU test
    test_cudnn_route_trains_on_a_channels_last_float32_x_off_the_grid shows
    why): cuDNN's backward is handed an aligned channels-last copy, with
    the gradients of x itself."""
    seen = []
    backward = CB._conv_backward
    monkeypatch.setattr(CB, "_conv_backward", lambda dz, x, *args: seen.append(x) or backward(dz, x, *args))
    gen = torch.Generator().manual_seed(5)
    dense = torch.randn(1, 8, 5, 6, generator=gen).contiguous(memory_format=torch.channels_last)
    x = off_the_grid(dense)  # (CPU allocations are 64-byte aligned)
    assert x.data_ptr() % 16 and torch.equal(x, dense) and x.is_contiguous(memory_format=torch.channels_last)
    w = torch.randn(4, 8, 2, 2, generator=gen)
    dz = torch.randn(1, 4, 4, 5, generator=gen)
    dx, dw = CB._cudnn_backward(dz, x, w, True, True)
    (handed,) = seen
    assert handed.data_ptr() % 16 == 0 and torch.equal(handed, x)
    assert handed.is_contiguous(memory_format=torch.channels_last) and not handed.is_contiguous()
    want = torch.ops.aten.convolution_backward(dz, dense, w, None, [1, 1], [0, 0], [1, 1], False,
                                               [0, 0], 1, [True, True, False])
    torch.testing.assert_close((dx, dw), want[:2])


def _kernel_names(monkeypatch, whole=False):
    """A list that records the key of every kernel CB.KERNELS hands out from
    now on (its first element, the kernel's name; the whole key with
    ``whole``)."""
    taken = []
    get = CB.KERNELS.get
    monkeypatch.setattr(CB.KERNELS, "get",
                        lambda key, dev: taken.append(key if whole else key[0]) or get(key, dev))
    return taken


def _engine_device(device):
    if not gemm.has_wgmma(device.index):
        pytest.skip("the engine route needs a compute capability 9.0 GPU")


# (N, C_in, H, W, C_out, KH, KW): kernel sizes 1 to 7, C_out not a multiple
# of 8 and above one 128-channel tile, C_in not a multiple of 64, H != W,
# an output one pixel wide or tall, output rows wider than one 128-column
# tile, batch 1.
ENGINE_SHAPES = [
    (2, 64, 20, 18, 128, 3, 3),
    (1, 8, 9, 7, 5, 1, 1),
    (3, 16, 11, 13, 33, 2, 2),
    (2, 72, 12, 10, 3, 5, 5),
    (1, 24, 7, 9, 200, 7, 7),
    (2, 8, 5, 140, 16, 5, 3),
    (1, 64, 3, 300, 40, 3, 3),
    # More output tiles than SMs: each block walks several, both consumer
    # warpgroups store, the loader starts tile after tile.
    (8, 64, 34, 34, 200, 3, 3),
]


# x as the engine takes it: NCHW, NCHW starting off the 16-byte grid (a view
# at an odd element), channels-last.
INPUTS = ("nchw", "nchw_off_grid", "channels_last")


def _engine_input(n, cin, h, w, kind, gen, device, dtype):
    """A random x [n, cin, h, w] of ``kind`` (one of INPUTS)."""
    if kind == "nchw_off_grid":
        buf = torch.randn(1 + n * cin * h * w, generator=gen).to(device, dtype)
        return buf[1:].view(n, cin, h, w)
    x = torch.randn(n, cin, h, w, generator=gen).to(device, dtype)
    return x.contiguous(memory_format=torch.channels_last) if kind == "channels_last" else x


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", INPUTS)
@pytest.mark.parametrize("shape", ENGINE_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_engine_against_float64(shape, kind, dtype, device):
    _engine_device(device)
    n, cin, h, w, cout, kh, kw = shape
    layout = CB.CHANNELS_LAST if kind == "channels_last" else CB.NCHW
    if layout == CB.CHANNELS_LAST:
        cout = -(-cout // 8) * 8  # y through the copy engine
    gen = torch.Generator().manual_seed(sum(shape))
    x = _engine_input(n, cin, h, w, kind, gen, device, dtype)
    wt = (torch.randn(cout, cin, kh, kw, generator=gen) / (cin * kh * kw) ** 0.5).to(device, dtype)
    cb = torch.randn(cout, generator=gen).to(device, dtype)
    b = torch.randn(cout, 1, 1, generator=gen).to(device, dtype)
    with torch.no_grad():
        assert CB.route(x, wt, cb, b) == "engine" and CB.engine_layout(x, wt) == layout
        truth = _reference(x.double(), wt.double(), cb.double(), b.double())
        eager = _reference(x, wt, cb, b)
        fmt = torch.channels_last if layout == CB.CHANNELS_LAST else torch.contiguous_format
        out = torch.full(truth.shape, float("nan"), dtype=dtype, device=device).contiguous(memory_format=fmt)
        ours = CB._launch_engine(x, wt, cb, b.reshape(-1), out=out)
        assert ours is out and ours.is_contiguous(memory_format=fmt)
        assert not ours.isnan().any()
        err, eager_err = rel_error(ours, truth), rel_error(eager, truth)
        assert err <= 1.5 * eager_err + torch.finfo(dtype).eps, (err, eager_err)
        again = ops.conv_bias_relu(x, wt, cb, b)
        assert torch.equal(again, ours)  # the public entry, bitwise the same
        assert again.is_contiguous(memory_format=fmt)  # the reference's layout


# (N, C_in, H, W, C_out, KH, KW) with C_in not a multiple of 8 (the engine
# reads it padded with zero channels to the next one): an RGB image's 3, 5,
# 13 (16 with padding), 1 (an x both NCHW and channels-last), kernels 1 x 1
# to 3 x 3, C_out not a multiple of 8 (NCHW only), batch 1, rows wider than
# one 128-column tile.
PADDED_SHAPES = [
    (2, 3, 20, 18, 64, 3, 3),
    (2, 1, 9, 20, 16, 3, 3),
    (1, 5, 9, 140, 16, 2, 3),
    (3, 13, 11, 13, 33, 1, 1),
    (2, 3, 7, 136, 128, 3, 2),
]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["bfloat16", "float16", "float32", "amp_bf16"])
@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("shape", PADDED_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_padded_input_channels_against_float64(shape, fmt, mode, device, monkeypatch):
    """C_in not a multiple of 8, no gradient to record: the engine on x and
    the weight padded with zero channels, within 1.5x eager's error against
    float64 (float32: within float32 rounding of the exact product of the
    TF32-rounded operands, and within 1.5x of that product's error), with
    NaN and +-inf in x landing where the reference puts them, the output
    poisoned with NaN before, in the reference's layout."""
    _engine_device(device)
    _lift_engine_thresholds(monkeypatch)
    n, cin, h, w, cout, kh, kw = shape
    if fmt == torch.channels_last and cout % 8:
        pytest.skip("a channels-last y through the copy engine: C_out a multiple of 8")
    amp = torch.bfloat16 if mode == "amp_bf16" else None
    dtype = torch.float32 if amp else getattr(torch, mode)
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(n, cin, h, w, generator=gen).to(device, dtype).contiguous(memory_format=fmt)
    x[0, cin - 1, 1, 2], x[-1, 0, -1, -1], x[0, 0, 0, 0] = float("nan"), float("inf"), -float("inf")
    wt = (torch.randn(cout, cin, kh, kw, generator=gen) / (cin * kh * kw) ** 0.5).to(device, dtype)
    cb = torch.randn(cout, generator=gen).to(device, dtype)
    b = torch.randn(cout, 1, 1, generator=gen).to(device, dtype)
    with torch.no_grad(), torch.autocast("cuda", dtype=amp or torch.bfloat16, enabled=amp is not None):
        assert CB.route(x, wt, cb, b) == "engine"
        # autocast's reference rounds x and the weight to bfloat16 first
        src = [t.to(amp).double() if amp and t.dim() == 4 else t.double() for t in (x, wt, cb, b)]
        truth = _reference(*src)
        eager = _reference(x, wt, cb, b)
        poison_allocator(device, 2 * truth.numel() * truth.element_size())
        ours = ops.conv_bias_relu(x, wt, cb, b)
    assert ours.dtype == eager.dtype and ours.stride() == eager.stride()  # the reference's layout
    assert_non_finite_where(ours, eager, "y")
    finite = truth.isfinite()
    err = rel_error(ours.double()[finite], truth[finite])
    if dtype == torch.float32 and amp is None:  # (eager may run these in float32: TF32's yardstick)
        tf32 = _reference(CB._tf32(x).double(), CB._tf32(wt).double(), cb.double(), b.double())
        assert rel_error(ours.double()[finite], tf32[finite]) <= 1e-5
        eager = tf32.float()
    eager_err = rel_error(eager.double()[finite], truth[finite])
    assert err <= 1.5 * eager_err + torch.finfo(amp or dtype).eps, (err, eager_err)
    with torch.no_grad(), torch.autocast("cuda", dtype=amp or torch.bfloat16, enabled=amp is not None):
        again = ops.conv_bias_relu(x, wt, cb, b)
    bits = torch.int16 if ours.element_size() == 2 else torch.int32
    assert torch.equal(again.view(bits), ours.view(bits))  # bitwise, run to run


@pytest.mark.gpu
def test_padded_input_channels_route(device, monkeypatch):
    """Where C_in is not a multiple of 8 the engine pads it under the
    conditions of any call, asked of the padded shape (an NCHW or
    channels-last x, the size thresholds, the rule); in training the
    gradients of x and the weight are the padded ones' first C_in channels:
    y and every gradient within 1.5x eager's error against float64, in
    eager's layouts."""
    _engine_device(device)
    gen = torch.Generator().manual_seed(2)
    x, wt, cb = (torch.randn(*shape, generator=gen).to(device, torch.bfloat16)
                 for shape in ((2, 3, 20, 18), (64, 3, 3, 3), (64,)))
    b = None
    assert CB.route(x, wt, cb, b) == "engine"
    assert CB.route(x.contiguous(memory_format=torch.channels_last), wt, cb, b) == "engine"
    assert CB.route(x[:, :, :, 1:], wt, cb, b) == "cudnn"  # neither layout
    wide = torch.randn(64, 3, 3, 5, device=device, dtype=torch.bfloat16)
    assert CB.route(x, wide, cb, b) == "engine"
    f32 = (x.float(), wt.float(), cb.float(), b)
    assert CB.route(*f32) == "cudnn"  # below ENGINE_FLOAT32_MIN_ELEMENTS
    leaf = x.detach().requires_grad_(True)
    assert CB.route(leaf, wt, cb, b) == "cudnn"  # below ENGINE_TRAINING_MIN_ELEMENTS
    _lift_engine_thresholds(monkeypatch)
    assert CB.route(*f32) == "engine" and CB.route(leaf, wt, cb, b) == "engine"
    leaves = [leaf, wt.detach().requires_grad_(True), cb.detach().requires_grad_(True)]
    _keep_returned_grads(*leaves)
    assert CB.route(*leaves, b) == "engine"
    y = ops.conv_bias_relu(*leaves, b)
    g = torch.randn(y.shape, generator=gen).to(device, y.dtype)
    y.backward(g)
    # The padded channels add 0 x 0 to every sum, and their gradients are
    # dropped: the padded call's first C_in channels are the unpadded
    # reference's gradients.
    ref = [t.detach().double().requires_grad_(True) for t in (x, wt, cb)]
    want = _reference(*ref, b)
    want.backward(g.double())
    theirs = _keep_returned_grads(*(t.detach().clone().requires_grad_(True) for t in (x, wt, cb)))
    ey = _reference(*theirs, b)
    ey.backward(g)
    eps = torch.finfo(torch.bfloat16).eps
    got = [y.detach()] + [t.returned_grad for t in leaves]
    eager = [ey.detach()] + [t.returned_grad for t in theirs]
    truth = [want.detach()] + [t.grad for t in ref]
    for name, a, e, t in zip(("y", "x", "weight", "conv_bias"), got, eager, truth):
        assert a.dtype == e.dtype and _layout(a) == _layout(e), (name, a.stride(), e.stride())
        err, eager_err = rel_error(a, t), rel_error(e, t)
        assert err <= 1.5 * eager_err + eps, (name, err, eager_err)
    seen = []
    monkeypatch.setattr(CB, "_engine_pays", lambda *args: seen.append(args) or False)
    assert CB.route(x, wt, cb, b) == "cudnn"  # the rule, asked of the padded shape
    assert seen[-1][:2] == ((2, 8, 20, 18), (64, 8, 3, 3))
    assert CB.route(x[:, :1], wt[:, :1], cb, b) == "cudnn"
    assert seen[-1][:2] == ((2, 8, 20, 18), (64, 8, 3, 3))


# (N, C_in, H, W, C_out, KH, KW) with C_in not a multiple of 8, training
# steps: C_out a multiple of 32 where x is channels-last (the mask's words).
PADDED_TRAINING_SHAPES = [
    (2, 3, 20, 18, 64, 3, 3),
    (2, 1, 9, 20, 32, 3, 3),
    (1, 5, 9, 140, 32, 2, 3),
    (3, 13, 11, 13, 40, 1, 1),
    (2, 3, 12, 136, 128, 5, 5),
]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["bfloat16", "float16", "float32", "amp_bf16"])
@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("shape", PADDED_TRAINING_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_padded_input_channels_training(shape, fmt, mode, device, monkeypatch):
    """A training step with C_in not a multiple of 8 on the engine (x and the
    weight padded with zero channels as autograd ops): the output and every
    gradient within 1.5x eager's error against float64, in the reference's
    dtypes and layouts; two steps bitwise equal."""
    _engine_device(device)
    if fmt == torch.channels_last and shape[4] % 32:
        pytest.skip("a channels-last training forward: C_out a multiple of 32")
    _lift_engine_thresholds(monkeypatch)
    amp = torch.bfloat16 if mode == "amp_bf16" else None
    y, leaves, ey, eager = _engine_training_step_against_float64(
        shape, torch.float32 if amp else getattr(torch, mode), amp, fmt, device)
    # (float32's yardstick is eager on a channels-last x; an x of one
    # channel is both layouts, its y NCHW)
    assert y.dtype == ey.dtype and (shape[1] == 1 or y.is_contiguous(memory_format=fmt))
    for ours, theirs in zip(leaves, eager):
        assert ours.grad.dtype == theirs.grad.dtype and ours.grad.shape == ours.shape
        assert _layout(ours.returned_grad) == _layout(ours), (ours.returned_grad.stride(), ours.stride())


def test_engine_pays_where_measured():
    """The routing rule (_engine_pays) on shapes of its measured grid
    (docs/performance.md, "Where the convolution engine pays")."""
    nchw, cl, bf16, f16, f32 = CB.NCHW, CB.CHANNELS_LAST, torch.bfloat16, torch.float16, torch.float32

    def pays(x, k, cout, layout=nchw, dtype=bf16, training=False, x_dtype=None, y_dtype=None):
        return _ENGINE_PAYS(x, (cout, x[1], k, k), layout, dtype, training, x_dtype, y_dtype)

    problem_1 = (128, 64, 128, 128)
    for layout, dtype, training in ((nchw, bf16, False), (cl, bf16, True), (nchw, f32, True),
                                    (cl, f32, False), (cl, f16, False), (nchw, f16, True)):
        assert pays(problem_1, 3, 128, layout, dtype, training)
        assert dtype == f32 or pays(problem_1, 3, 128, layout, dtype, training, f32)  # autocast
    # an output row's fill of its 128-column tiles: 96 of 128 pays, 95 not,
    # 129 of 256 not, 200 of 256 pays; for the NCHW band kernel's calls (W a
    # multiple of 8) 54 of 128 pays, 46 not
    assert pays((8, 64, 98, 98), 3, 128, cl) and not pays((8, 64, 97, 97), 3, 128, cl)
    assert not pays((8, 64, 131, 131), 3, 128, cl) and pays((8, 64, 202, 202), 3, 128, cl)
    assert pays((8, 64, 56, 56), 3, 128) and not pays((8, 64, 48, 48), 3, 128)
    assert not pays((8, 64, 56, 56), 3, 128, cl) and not pays((8, 64, 56, 56), 3, 128, nchw, f32)
    assert not pays((8, 64, 58, 58), 3, 128) and not pays((8, 64, 56, 56), 1, 128)
    assert not pays((64, 32, 128, 128), 1, 64) and pays((64, 64, 128, 128), 1, 64)  # 1 x 1
    assert pays((64, 32, 128, 128), 1, 128)
    assert not pays(problem_1, 3, 64, nchw, f32) and pays(problem_1, 3, 64, cl, f32)  # per-tap tiles
    assert not pays(problem_1, 7, 64) and pays(problem_1, 5, 64)  # past NCHW_WINDOW_MAX_KW
    assert not pays((128, 64, 128, 130), 3, 64)  # W not a multiple of 8: copied, then per-tap
    assert CB.NCHW_WINDOW_MAX_KW == 5
    assert not pays((64, 256, 128, 128), 1, 128, nchw, f32)  # float32 x's copy
    assert not pays((64, 256, 128, 128), 3, 128, cl, f32) and pays((64, 256, 128, 128), 5, 128, cl, f32)
    assert pays((64, 256, 128, 128), 3, 128, nchw, f32)
    assert not pays((64, 256, 128, 128), 5, 256) and pays((64, 256, 128, 128), 7, 256)  # cuDNN's best
    assert pays((64, 256, 128, 128), 5, 128)
    assert not pays((64, 32, 128, 128), 7, 64, cl) and pays((64, 32, 128, 128), 7, 128, cl)
    assert pays((64, 32, 128, 128), 7, 64, cl, f32)
    assert pays(problem_1, 5, 64, nchw, f32, True) and not pays(problem_1, 5, 64, nchw, bf16, True)
    assert not pays(problem_1, 3, 64, cl, bf16, True) and not pays(problem_1, 1, 128, cl, bf16, True)
    assert pays(problem_1, 5, 64, cl, bf16, True)
    # autocast (a float32 x): NCHW read in place by the band kernel only
    # (at most 64 input channels and 3 kernel rows), else copied for the
    # per-tap kernel; no 256 -> 256 rule; in training, cuDNN for 1 x 1
    # kernels with fewer than 128 output channels only
    assert not pays(problem_1, 5, 64, nchw, bf16, False, f32)
    assert not pays((64, 256, 128, 128), 3, 32, nchw, bf16, False, f32)
    assert pays((64, 256, 128, 128), 3, 128, nchw, bf16, False, f32)
    assert not pays((64, 256, 128, 128), 3, 256) and pays((64, 256, 128, 128), 3, 256, nchw, bf16, False, f32)
    assert pays(problem_1, 3, 64, cl, bf16, True, f32) and not pays(problem_1, 1, 64, cl, bf16, True, f32)
    assert pays(problem_1, 1, 128, cl, f16, True, f32)
    # the band kernel writes a float32 y: for a 16-bit one (16-bit vectors)
    # the float32 x is copied, for the per-tap kernel
    assert pays((8, 64, 56, 56), 3, 128, nchw, bf16, False, f32, f32)
    assert not pays((8, 64, 56, 56), 3, 128, nchw, bf16, False, f32, bf16)
    # float16 and float32 on a channels-last x with at most 8 input
    # channels: cuDNN's kernels below 128 output channels
    assert not pays((64, 8, 128, 128), 5, 32, cl, f16) and pays((64, 8, 128, 128), 5, 32, cl, bf16)
    assert not pays((64, 8, 128, 128), 3, 32, cl, f32) and pays((64, 8, 128, 128), 3, 128, cl, f32)
    assert not pays((64, 8, 128, 128), 3, 32, cl, f16, False, f32)
    assert pays((64, 8, 128, 128), 5, 128, cl, f16) and pays((64, 16, 128, 128), 5, 32, cl, f16)
    assert pays((64, 8, 128, 128), 5, 32, nchw, f16) and pays((64, 8, 128, 128), 1, 128, cl, f16)


# (N, C_in, H, W, C_out, KH, KW) with W a multiple of 8, each the NCHW
# window kernel's: KW 1 to 5, C_in not a multiple of 64, C_out not a
# multiple of 8 (5, 33, 3) and above one 64-channel tile and partial, output
# rows of 1 and of more than 128 columns (3 column tiles), an odd number of
# output rows, problem 1's rows (126 of 128), batch 1, and more tiles than
# SMs.  (engine_layout takes C_in a multiple of 8; others are padded first:
# PADDED_SHAPES.)
# Those with C_in up to 64 and KH up to 3 take the band kernel; the last
# five have bands of several pixel tiles: keeping rows from one to the next
# (KH 2 and 3), across images, with 1 and 3 tiles of output channels, and
# of 2 column tiles (KH 1 and 3: rows kept within each column strip).
NCHW_WINDOW_SHAPES = [
    (2, 64, 20, 16, 128, 3, 3),
    (1, 8, 9, 8, 5, 1, 1),
    (3, 16, 11, 24, 33, 2, 2),
    (2, 72, 12, 16, 3, 5, 5),
    (1, 24, 8, 136, 200, 4, 4),
    (1, 64, 3, 304, 40, 3, 3),
    (2, 64, 7, 128, 128, 3, 3),
    (8, 64, 34, 40, 200, 3, 3),
    (64, 16, 34, 16, 64, 3, 3),
    (40, 8, 21, 8, 72, 2, 1),
    (30, 40, 15, 24, 192, 3, 2),
    (20, 64, 10, 136, 64, 1, 5),
    (40, 16, 12, 136, 64, 3, 3),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", NCHW_WINDOW_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_nchw_window_against_float64(shape, dtype, device, monkeypatch):
    """The NCHW 16-bit forward with no copy of x (conv_bias_relu_nchw_band
    where _band_fits, else conv_bias_relu_nchw_window): every value of a
    NaN-poisoned y written, within 1.5x eager's error against float64, the
    public entry bitwise the same, two runs equal; the band kernel's y
    bitwise the window kernel's; with one block of 64 input channels (the
    same order of k-tiles), bitwise the output of the copy and the per-tap
    kernel."""
    _engine_device(device)
    n, cin, h, w, cout, kh, kw = shape
    _, x, wt, cb, b = _conv_operands(shape, 0, device, dtype)
    b = b.view(-1, 1, 1)
    taken = _kernel_names(monkeypatch)
    with torch.no_grad():
        assert CB.route(x, wt, cb, b) == "engine" and CB._nchw_window_fits(x, wt)
        truth = _reference(x.double(), wt.double(), cb.double(), b.double())
        eager = _reference(x, wt, cb, b)
        out = torch.full(truth.shape, float("nan"), dtype=dtype, device=device)
        ours = CB._launch_engine(x, wt, cb, b.reshape(-1), out=out)
        band = CB._band_fits(cin, cout, kh, kw)
        assert taken == ["nchw_band" if band else "nchw_window"]
        assert ours is out and not ours.isnan().any()
        err, eager_err = rel_error(ours, truth), rel_error(eager, truth)
        assert err <= 1.5 * eager_err + torch.finfo(dtype).eps, (err, eager_err)
        again = ops.conv_bias_relu(x, wt, cb, b)
        assert torch.equal(again, ours) and again.is_contiguous()
        assert torch.equal(ops.conv_bias_relu(x, wt, cb, b), again)
        if band:
            monkeypatch.setattr(CB, "_band_fits", lambda *a: False)
            assert torch.equal(CB._launch_engine(x, wt, cb, b.reshape(-1)), ours)
            assert taken[-1] == "nchw_window"
        if cin <= 64:
            monkeypatch.setattr(CB, "_nchw_window_fits", lambda *a: False)
            assert torch.equal(CB._launch_engine(x, wt, cb, b.reshape(-1)), ours)
            assert taken[-2:] == ["to_nhwc", "conv"]


# (N, C_in, H, W, C_out, KH, KW) with W a multiple of 4, each the band
# kernel's from a float32 x under autocast: bands of several pixel tiles
# that keep rows (KH 2 and 3) and that cross images, 1 to 3 tiles of output
# channels, C_out not a multiple of 8 (NCHW; channels-last rounds it up), 2
# column tiles with KH 1, KW 1 to 5.
AMP_BAND_SHAPES = [
    (2, 64, 20, 16, 128, 3, 3),
    (3, 16, 11, 24, 33, 2, 5),
    (64, 16, 34, 16, 64, 3, 3),
    (40, 8, 21, 12, 72, 2, 1),
    (30, 40, 15, 24, 192, 3, 2),
    (20, 64, 10, 132, 68, 1, 3),
    (1, 8, 9, 12, 5, 1, 1),
]


@pytest.mark.gpu
@pytest.mark.parametrize("amp", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("shape", AMP_BAND_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_amp_band_against_float64(shape, fmt, amp, device, monkeypatch):
    """A float32 x under autocast on the band kernel, NCHW or channels-last
    (x rounded to the autocast dtype as its rows are transposed or
    converted, y float32 in x's layout): every value of a NaN-poisoned y
    written, within 1.5x eager's error against float64; with NaN and +-inf
    in x, bitwise the output of x's cast and the per-tap (NCHW) or window
    (channels-last) kernel, its NaN and infinities where eager's are."""
    _engine_device(device)
    if fmt == torch.channels_last:
        shape = shape[:4] + (-(-shape[4] // 8) * 8,) + shape[5:]  # (C_out: y through the copy engine)
    kw, cl = shape[-1], fmt == torch.channels_last
    _, x, wt, cb, b = _conv_operands(shape, 3, device, torch.float32, fmt)
    taken = _kernel_names(monkeypatch, whole=True)
    truth = _reference(x.double(), wt.double(), cb.double(), b.double().view(-1, 1, 1))
    with torch.no_grad(), torch.autocast("cuda", dtype=amp):
        assert CB.route(x, wt, cb, b) == "engine"
        assert CB._nhwc_band_fits(x, wt) if cl else CB._amp_band_fits(x, wt)
        eager = _reference(x, wt, cb, b.view(-1, 1, 1))
        out = torch.full(truth.shape, float("nan"), device=device).contiguous(memory_format=fmt)
        ours = CB._launch_engine(x, wt, cb, b, out=out)
        assert taken == [("nhwc_band", amp, kw) if cl else ("nchw_band", amp, kw, torch.float32)]
        assert ours is out and not ours.isnan().any()
        err, eager_err = rel_error(ours, truth), rel_error(eager, truth)
        assert err <= 1.5 * eager_err + torch.finfo(amp).eps, (err, eager_err)
        x[0, 0, 0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
        x[-1, -1, -1, -1] = float("inf")
        ours, eager = CB._launch_engine(x, wt, cb, b), _reference(x, wt, cb, b.view(-1, 1, 1))
        assert ours.is_contiguous(memory_format=fmt)
        assert_non_finite_where(ours, eager)
        monkeypatch.setattr(CB, "_nhwc_band_fits" if cl else "_amp_band_fits", lambda *a: False)
        copied = CB._launch_engine(x, wt, cb, b)
        assert [k[0] for k in taken[-1 if cl else -2:]] == (["window"] if cl else ["to_nhwc", "conv"])
    assert torch.equal(ours.nan_to_num(0.5), copied.nan_to_num(0.5))
    assert torch.equal(ours.isnan(), copied.isnan())


# (N, C_in, H, W, C_out, KH, KW) for the TF32 band kernel: one and two
# blocks of 32 input channels, KW 1 to TF32_BAND_MAX_KW, bands of one pixel
# tile and of several (more pixel tiles than SMs), keeping rows from one to
# the next, across images and, with 2 column tiles, across column strips,
# C_out of one to five tiles of 64 (not all multiples of 32: no mask there),
# batch 1.
TF32_BAND_SHAPES = [
    (40, 16, 12, 136, 64, 3, 3),
    (24, 40, 12, 140, 64, 3, 3),
    (2, 64, 20, 300, 128, 3, 3),
    (1, 8, 9, 17, 32, 2, 3),
    (3, 40, 33, 70, 64, 3, 1),
    (2, 32, 12, 140, 192, 1, 2),
    (4, 64, 66, 66, 64, 3, 3),
    (1, 24, 5, 9, 8, 3, 3),
    (5, 64, 9, 60, 320, 3, 3),
    (2, 48, 10, 90, 64, 2, 4),
]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", TF32_BAND_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_tf32_band_against_the_rounded_copy(shape, device, monkeypatch):
    """A channels-last float32 x on the TF32 band kernel (its rows rounded
    to TF32 in shared memory, no copy of x): every value of a NaN-poisoned
    y written; with NaN, +-inf and ties of the TF32 grid in x, y and relu's
    mask bit for bit those of x's rounded copy and the window kernel (the
    same sums in the same order), y's NaN and infinities where eager's are."""
    _engine_device(device)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)  # (PyTorch's default)
    _, x, wt, cb, b = _conv_operands(shape, 5, device, torch.float32, torch.channels_last)
    flat = x.permute(0, 2, 3, 1).view(-1)  # (x's memory, in order)
    flat[::997], flat[5::1331], flat[9::1777] = float("nan"), float("inf"), -float("inf")
    flat[11::513] = 1.0 + 2.0 ** -11  # halfway between two TF32 values: rounded up
    taken = _kernel_names(monkeypatch, whole=True)
    masked = shape[4] % 32 == 0  # (a channels-last mask: whole words of 32 channels)
    with torch.no_grad():
        assert CB._tf32_band_fits(x, wt)
        ys, masks = [], []
        for band in (True, False):
            if not band:
                monkeypatch.setattr(CB, "_tf32_band_fits", lambda *a: False)
            out = torch.full(CB._out_shape(x, wt), float("nan"), device=device)
            out = out.contiguous(memory_format=torch.channels_last)
            mask = CB._mask_words(x, wt, nchw=False) if masked else None
            # (below ENGINE_FLOAT32_MIN_ELEMENTS the route is cuDNN's: the plan given)
            plan = (CB.CHANNELS_LAST, torch.float32, torch.float32, masked)
            ys.append(CB._launch_engine(x, wt, cb, b, out=out, plan=plan, mask=mask))
            masks.append(mask)
        eager = _reference(x, wt, cb, b.view(-1, 1, 1))
    kw = shape[-1]
    assert taken == [("tf32_band", kw, masked), ("round_tf32",),
                     ("window", torch.float32, kw, masked, torch.float32)]
    ours, copied = ys
    assert torch.equal(ours.view(torch.int32), copied.view(torch.int32))
    assert not masked or torch.equal(masks[0], masks[1])
    assert_non_finite_where(ours, eager)  # (so no poisoned value is left)


def test_tf32_rounding():
    """The float32 product's operands rounded to TF32 as the kernels round
    them (to_tf32_keep_nan): to nearest, ties away from zero, NaN and inf
    kept, FLT_MAX up to inf, subnormals alike (as cvt.rna.tf32.f32)."""
    e = 2.0 ** -10  # a TF32 ulp at 1
    cases = [(1.0, 1.0), (1 + e / 2, 1 + e), (-(1 + e / 2), -(1 + e)), (1 + e / 2 - 2.0 ** -20, 1.0),
             (1 + e + e / 4, 1 + e), (2.0 ** -130, 2.0 ** -130), (3 * 2.0 ** -140, 0.0), (-0.0, -0.0),
             (float("inf"), float("inf")), (-float("inf"), -float("inf")),
             (torch.finfo(torch.float32).max, float("inf"))]
    x = torch.tensor([c[0] for c in cases] + [float("nan")])
    r = CB._tf32(x)
    assert r[:-1].tolist() == [c[1] for c in cases] and r[-1].isnan()
    # Every NaN the one NaN to_tf32_keep_nan writes, those with a payload in
    # the low 13 bits alone (which the MMA would read as inf) included.
    nan_bits = [0x7F800001, -0x7FFFFF, 0x7FC00000, -1]  # -0x7fffff: 0xff800001
    nans = torch.tensor(nan_bits, dtype=torch.int32).view(torch.float32)
    assert (CB._tf32(nans).view(torch.int32) == 0x7FFFE000).all()
    assert torch.equal(torch.signbit(r[:-1]), torch.signbit(x[:-1]))
    assert not (r[:-1].view(torch.int32) & 0x1FFF).any()  # the low 13 mantissa bits are zero


@pytest.mark.gpu
@pytest.mark.parametrize("kind", INPUTS)
# (the last shape wider than the window kernel takes: the per-tap kernel)
@pytest.mark.parametrize("shape", ENGINE_SHAPES + [(1, 16, 5, 150, 40, 2, 9)],
                         ids=lambda s: "x".join(map(str, s)))
def test_engine_float32_against_float64(shape, kind, device, monkeypatch):
    """A float32 call on the engine (TF32 operands, float32 sums), output
    poisoned with NaN first: its sums within float32 rounding of the exact
    product of the TF32-rounded operands, and within 1.5x of that product's
    own error against float64 (TF32's precision, which
    torch.backends.cudnn.allow_tf32 grants the reference); two runs equal.
    A channels-last x (read by the TF32 band kernel where it fits, else its
    copy rounded by round_to_tf32 and the window kernel; y channels-last):
    the NCHW route's y on the same values, bit for bit where a stage holds
    every channel (C_in up to 32: the same sums in the same order)."""
    _engine_device(device)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)  # (PyTorch's default)
    n, cin, h, w, cout, kh, kw = shape
    layout = CB.CHANNELS_LAST if kind == "channels_last" else CB.NCHW
    if layout == CB.CHANNELS_LAST:
        cout = -(-cout // 8) * 8  # y through the copy engine
    gen = torch.Generator().manual_seed(sum(shape) + 2)
    x = _engine_input(n, cin, h, w, kind, gen, device, torch.float32)
    wt = (torch.randn(cout, cin, kh, kw, generator=gen) / (cin * kh * kw) ** 0.5).to(device)
    cb = torch.randn(cout, generator=gen).to(device)
    b = torch.randn(cout, generator=gen).to(device)
    with torch.no_grad():
        assert CB.engine_layout(x, wt) == layout
        assert CB.engine_dtypes(x, wt, cb, b) == (torch.float32, torch.float32)
        truth = _reference(x.double(), wt.double(), cb.double(), b.double())
        tf32 = _reference(CB._tf32(x).double(), CB._tf32(wt).double(), cb.double(), b.double())
        fmt = torch.channels_last if layout == CB.CHANNELS_LAST else torch.contiguous_format
        out = torch.full(truth.shape, float("nan"), device=device).contiguous(memory_format=fmt)
        # (below ENGINE_FLOAT32_MIN_ELEMENTS the route is cuDNN's: the plan given)
        plan = (layout, torch.float32, torch.float32, False)
        ours = CB._launch_engine(x, wt, cb, b, out=out, plan=plan)
        assert ours is out and not ours.isnan().any()
        assert rel_error(ours, tf32) <= 1e-5
        assert rel_error(ours, truth) <= 1.5 * rel_error(tf32.float(), truth) + torch.finfo(torch.float32).eps
        assert torch.equal(CB._launch_engine(x, wt, cb, b, plan=plan), ours)
        if layout == CB.CHANNELS_LAST:
            nchw = CB._launch_engine(x.contiguous(), wt, cb, b, plan=(CB.NCHW, *plan[1:]))
            assert torch.equal(ours, nchw) if cin <= 32 else rel_error(ours, nchw) <= 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("offset", [0, 1, 2, 3])
@pytest.mark.parametrize("shape", [ENGINE_SHAPES[1], ENGINE_SHAPES[2], ENGINE_SHAPES[5], ENGINE_SHAPES[7]],
                         ids=lambda s: "x".join(map(str, s)))
def test_engine_float32_out_off_grid(shape, offset, device, monkeypatch):
    """The float32 store writes each row's whole 16-byte chunks by bulk copy
    and the values at its ends one by one, wherever the row starts: into an
    ``out`` starting ``offset`` floats past the 16-byte grid (and rows and
    planes of odd or even length, so that the rows start all over the
    grid), the same values as into an aligned one, and nothing outside
    it."""
    _engine_device(device)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    n, cin, h, w, cout, kh, kw = shape
    gen = torch.Generator().manual_seed(sum(shape) + offset)
    x = _engine_input(n, cin, h, w, "nchw", gen, device, torch.float32)
    wt = (torch.randn(cout, cin, kh, kw, generator=gen) / (cin * kh * kw) ** 0.5).to(device)
    cb = torch.randn(cout, generator=gen).to(device)
    b = torch.randn(cout, generator=gen).to(device)
    plan = (CB.NCHW, torch.float32, torch.float32, False)
    with torch.no_grad():
        aligned = CB._launch_engine(x, wt, cb, b, plan=plan)
        numel = aligned.numel()
        buf = torch.full((numel + 8,), 7.0, device=device)
        assert buf.data_ptr() % 16 == 0
        out = buf[offset:offset + numel].view(aligned.shape)
        out.fill_(float("nan"))
        assert CB._launch_engine(x, wt, cb, b, out=out, plan=plan) is out
        assert torch.equal(out, aligned)
        assert (buf[:offset] == 7.0).all() and (buf[offset + numel:] == 7.0).all()


@pytest.mark.gpu
def test_engine_float32_route(device, monkeypatch):
    """Float32 calls take the engine with TF32 allowed (PyTorch's default)
    and at least ENGINE_FLOAT32_MIN_ELEMENTS output
    values; there the public entry matches eager's error against float64
    and puts NaN and inf where eager does, from an NCHW or a channels-last
    x (the same values as NCHW's, y channels-last), and under autocast.
    Otherwise cuDNN."""
    _engine_device(device)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(2, 16, 130, 1026, generator=gen).to(device)  # 2 x 64 x 128 x 1024 = 2^24 outputs
    wt = (torch.randn(64, 16, 3, 3, generator=gen) / 12).to(device)
    cb, b = torch.randn(64, generator=gen).to(device), torch.randn(64, 1, 1, generator=gen).to(device)
    assert CB.ENGINE_FLOAT32_MIN_ELEMENTS == 2**24
    with torch.no_grad():
        monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
        assert CB.route(x, wt, cb, b) == "cudnn" and CB.engine_dtypes(x, wt, cb, b) is None
        monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)  # (PyTorch's default)
        assert CB.route(x, wt, cb, b) == "engine"
        # One output row fewer: below the size.
        assert CB.route(x[:, :, 1:].contiguous(), wt, cb, b) == "cudnn"
        truth = _reference(x.double(), wt.double(), cb.double(), b.double())
        tf32 = _reference(CB._tf32(x).double(), CB._tf32(wt).double(), cb.double(), b.double())
        ours = ops.conv_bias_relu(x, wt, cb, b)
        assert rel_error(ours, truth) <= 1.5 * rel_error(tf32.float(), truth) + torch.finfo(torch.float32).eps
        del truth, tf32
        # A channels-last x: the same values, rounded in a copy, y channels-last.
        x_cl = x.contiguous(memory_format=torch.channels_last)
        assert CB.route(x_cl, wt, cb, b) == "engine" and CB.engine_layout(x_cl, wt) == CB.CHANNELS_LAST
        y_cl = ops.conv_bias_relu(x_cl, wt, cb, b)
        assert y_cl.is_contiguous(memory_format=torch.channels_last) and torch.equal(y_cl, ours)
        del x_cl, y_cl
        x[0, 3, 40, 500] = float("nan")
        x[1, 7, 2, 9] = float("inf")
        x[1, 9, 100, 1000] = -float("inf")
        for xf in (x, x.contiguous(memory_format=torch.channels_last)):
            for amp in (None, torch.bfloat16):
                with torch.autocast("cuda", dtype=amp or torch.float16, enabled=amp is not None):
                    assert CB.route(xf, wt, cb, b) == "engine"
                    ours, eager = ops.conv_bias_relu(xf, wt, cb, b), _reference(xf, wt, cb, b)
                assert ours.dtype == eager.dtype == torch.float32
                assert_non_finite_where(ours, eager)
                del ours, eager
    assert CB.route(x, wt.detach().requires_grad_(True), cb, b) == "engine"  # the training forward


@pytest.mark.gpu
@pytest.mark.parametrize("amp", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("x_dtype", ["float32", "amp"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("shape", ENGINE_SHAPES[:3] + ENGINE_SHAPES[-1:] + [(1, 16, 5, 150, 40, 2, 9)],
                         ids=lambda s: "x".join(map(str, s)))
def test_engine_under_autocast(shape, fmt, with_bias, x_dtype, amp, device):
    """A float32 model under torch.autocast, x NCHW or channels-last
    (float32, or already in the autocast dtype): the engine computes the
    product in the autocast dtype, returns the reference's dtype and layout
    (float32: the biases are float32) into a NaN-poisoned output, within
    1.5x eager's error under autocast against float64."""
    _engine_device(device)
    n, cin, h, w, cout, kh, kw = shape
    if fmt == torch.channels_last:
        cout = -(-cout // 8) * 8  # y through the copy engine
    gen = torch.Generator().manual_seed(sum(shape) + 1)
    x = torch.randn(n, cin, h, w, generator=gen).to(device, torch.float32 if x_dtype == "float32" else amp)
    x = x.contiguous(memory_format=fmt)
    wt = (torch.randn(cout, cin, kh, kw, generator=gen) / (cin * kh * kw) ** 0.5).to(device)
    cb = torch.randn(cout, generator=gen).to(device)
    b = torch.randn(cout, 1, 1, generator=gen).to(device) if with_bias else None
    truth = _reference(x.double(), wt.double(), cb.double(), None if b is None else b.double())
    with torch.no_grad(), torch.autocast("cuda", dtype=amp):
        assert CB.route(x, wt, cb, b) == "engine"
        eager = _reference(x, wt, cb, b)
        out = torch.full(truth.shape, float("nan"), dtype=eager.dtype, device=device).contiguous(
            memory_format=fmt)
        ours = CB._launch_engine(x, wt, cb, None if b is None else b.reshape(-1), out=out)
        again = ops.conv_bias_relu(x, wt, cb, b)
    assert ours is out and ours.dtype == eager.dtype == torch.float32
    assert again.is_contiguous(memory_format=fmt) and eager.is_contiguous(memory_format=fmt)
    assert not ours.isnan().any() and torch.equal(again, ours)
    err, eager_err = rel_error(ours, truth), rel_error(eager, truth)
    assert err <= 1.5 * eager_err + torch.finfo(amp).eps, (err, eager_err)


@pytest.mark.gpu
@pytest.mark.parametrize("amp", [None, torch.bfloat16], ids=["bf16", "amp_bf16"])
@pytest.mark.parametrize("ow", [130, 3, 134, 6])
def test_engine_nchw_rows_at_every_alignment(ow, amp, device, monkeypatch):
    """The NCHW store into y placed 0 to 3 values off the 8- / 16-byte grid
    (16-bit y, and float32 y under autocast), rows wider than one 128-column
    tile and rows of 3 values: every value of y written and right, nothing
    around y touched.  (W = OW + 2 a multiple of 8, or of 4 for a float32
    x under autocast: x takes the NCHW band kernel, with the NCHW window
    kernel's store.)"""
    _engine_device(device)
    n, cin, h, cout = 2, 8, 4, 9
    gen = torch.Generator().manual_seed(ow)
    model_dtype = torch.float32 if amp else torch.bfloat16
    x = torch.randn(n, cin, h, ow + 2, generator=gen).to(device, model_dtype)
    wt = (torch.randn(cout, cin, 3, 3, generator=gen) / 8).to(device, model_dtype)
    cb, b = (torch.randn(cout, generator=gen).to(device, model_dtype) for _ in range(2))
    truth = _reference(x.double(), wt.double(), cb.double(), b.double())
    numel = truth.numel()
    taken = _kernel_names(monkeypatch)
    for offset in range(4):
        guard = torch.full((numel + 8,), 7.0, device=device, dtype=torch.float32 if amp else torch.bfloat16)
        out = guard[offset:offset + numel].view(truth.shape)
        out.fill_(float("nan"))
        with torch.no_grad(), torch.autocast("cuda", dtype=amp or torch.bfloat16, enabled=amp is not None):
            assert CB.route(x, wt, cb, b) == "engine"
            eager = _reference(x, wt, cb, b)
            CB._launch_engine(x, wt, cb, b, out=out)
        # (x's rows whole 16-byte vectors: W a multiple of 8 in bf16, of 4 in float32)
        assert ("nchw_band" in taken) == ((ow + 2) % (8 if amp is None else 4) == 0)
        assert not out.isnan().any()
        assert (guard[:offset] == 7).all() and (guard[offset + numel:] == 7).all()
        err, eager_err = rel_error(out, truth), rel_error(eager, truth)
        assert err <= 1.5 * eager_err + torch.finfo(torch.bfloat16).eps, (offset, err, eager_err)


@pytest.mark.gpu
def test_engine_without_bias_and_with_an_odd_weight_view(device):
    """bias=None (nothing added after the ReLU), and a weight whose packed
    form is a view of it starting off the 16-byte grid (a 1 x 1 kernel over
    64 channels): both on the engine, both as the reference."""
    _engine_device(device)
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(2, 64, 9, 9, generator=gen).to(device, torch.bfloat16)
    buf = torch.randn(1 + 128 * 64, generator=gen).to(device, torch.bfloat16) / 8
    w = buf[1:].view(128, 64, 1, 1)
    assert w.data_ptr() % 16 != 0
    cb = torch.randn(128, generator=gen).to(device, torch.bfloat16)
    with torch.no_grad():
        assert CB.route(x, w, cb, None) == "engine"
        ours = ops.conv_bias_relu(x, w, cb)
        truth = _reference(x.double(), w.double(), cb.double(), None)
        eager = _reference(x, w, cb, None)
        assert rel_error(ours, truth) <= 1.5 * rel_error(eager, truth) + torch.finfo(torch.bfloat16).eps


@pytest.mark.gpu
@pytest.mark.parametrize("kind", INPUTS)
def test_engine_is_bitwise_reproducible_and_keeps_nan_and_inf(kind, device):
    _engine_device(device)
    gen = torch.Generator().manual_seed(5)
    x = _engine_input(2, 64, 10, 136, kind, gen, device, torch.bfloat16)
    layout = CB.CHANNELS_LAST if kind == "channels_last" else CB.NCHW
    wt = (torch.randn(96, 64, 3, 3, generator=gen) / 24).to(device, torch.bfloat16)
    cb = torch.randn(96, generator=gen).to(device, torch.bfloat16)
    b = torch.randn(96, generator=gen).to(device, torch.bfloat16)
    with torch.no_grad():
        assert CB.engine_layout(x, wt) == layout
        assert torch.equal(ops.conv_bias_relu(x, wt, cb, b), ops.conv_bias_relu(x, wt, cb, b))
        x[0, 3, 4, 50] = float("nan")
        x[1, 7, 2, 9] = float("inf")
        ref = _reference(x.float(), wt.float(), cb.float(), b.float())
        ours = ops.conv_bias_relu(x, wt, cb, b).float()
        assert torch.equal(ours.isnan(), ref.isnan())
        assert torch.equal(ours.isposinf(), ref.isposinf())
        assert torch.equal(ours.isneginf(), ref.isneginf())


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["nchw", "channels_last"])
def test_tf32_input_at_the_float32_range_end_overflows_where_cudnns_does(kind, device, monkeypatch):
    """The float32 engine route (TF32, from ENGINE_FLOAT32_MIN_ELEMENTS
    outputs): FLT_MAX in x (every mantissa bit set, which TF32's rounding
    to nearest takes to inf) gives +-inf exactly where cuDNN's own TF32
    convolution (allow_tf32) gives it; FLT_MAX (1 - 2^-12), which rounds
    down, gives none in either."""
    _engine_device(device)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    gen = torch.Generator().manual_seed(17)
    top = torch.finfo(torch.float32).max
    wt = (torch.rand(128, 64, 3, 3, generator=gen) / 64).to(device)
    cb = torch.rand(128, generator=gen).to(device)
    for big, overflows in [(top, True), (top * (1 - 2**-12), False)]:
        x = torch.rand(8, 64, 130, 130, generator=gen)
        x[0, 3, 40, 40], x[5, 60, 2, 129] = big, big
        x = x.to(device)
        if kind == "channels_last":
            x = x.contiguous(memory_format=torch.channels_last)
        with torch.no_grad():
            assert CB.route(x, wt, cb, None) == "engine"
            ours = ops.conv_bias_relu(x, wt, cb)
            ref = _reference(x, wt, cb, None)
        assert_non_finite_where(ours, ref, big)
        assert bool(torch.isinf(ref).any()) == overflows


@pytest.mark.gpu
def test_routes(device, monkeypatch):
    """The engine takes inputs with no gradient to record: 16-bit NCHW or
    channels-last, or either under autocast; every other call takes cuDNN,
    with gradients, autocast and layouts as the reference."""
    x = torch.randn(2, 16, 9, 9, device=device)
    wt = torch.randn(8, 16, 3, 3, device=device) / 12
    cb, b = torch.randn(8, device=device), torch.randn(8, 1, 1, device=device)
    hopper = gemm.has_wgmma(device.index)
    half = [t.bfloat16() for t in (x, wt, cb, b)]
    assert CB.route(*half) == ("engine" if hopper else "cudnn")
    assert CB.route(x, wt, cb, b) == "cudnn"  # float32
    cl_half = half[0].contiguous(memory_format=torch.channels_last)
    assert CB.route(cl_half, *half[1:]) == ("engine" if hopper else "cudnn")
    assert CB.engine_layout(cl_half, half[1]) == CB.CHANNELS_LAST
    assert CB.engine_layout(half[0], half[1]) == CB.NCHW
    five = (half[0][:, :5].contiguous(), half[1][:, :5].contiguous())
    assert CB.route(*five, *half[2:]) == ("engine" if hopper else "cudnn")  # 5 input channels, padded
    five_leaves = [t.detach().requires_grad_(True) for t in five]
    assert CB.route(*five_leaves, *half[2:]) == "cudnn"  # (not in training: test_padded_input_channels_route)
    assert CB.route(cl_half, half[1][:5], half[2][:5], half[3][:5]) == "cudnn"  # channels-last, C_out = 5
    off_grid = off_the_grid(cl_half)
    assert off_grid.is_contiguous(memory_format=torch.channels_last)
    assert CB.route(off_grid, *half[1:]) == "cudnn"  # channels-last off the 16-byte grid
    leaves = [t.detach().requires_grad_(True) for t in half]
    assert CB.route(*leaves) == "cudnn"
    # The cudnn route's gradients, against the reference's.
    y = ops.conv_bias_relu(*leaves)
    g = torch.randn_like(y)
    y.backward(g)
    ref_leaves = [t.detach().double().requires_grad_(True) for t in half]
    _reference(*ref_leaves).backward(g.double())
    eager_leaves = [t.detach().requires_grad_(True) for t in half]
    _reference(*eager_leaves).backward(g)
    for ours, ref, eager in zip(leaves, ref_leaves, eager_leaves):
        assert (rel_error(ours.grad, ref.grad)
                <= 1.5 * rel_error(eager.grad, ref.grad) + torch.finfo(torch.bfloat16).eps)
    # Channels-last in, channels-last out, as the reference (cuDNN's route too).
    cl_leaf = cl_half.detach().requires_grad_(True)
    cl = ops.conv_bias_relu(cl_leaf, *half[1:])
    assert CB.route(cl_leaf, *half[1:]) == "cudnn" and cl.is_contiguous(memory_format=torch.channels_last)
    # Under autocast: float32 parameters, the reference's float32 result, on
    # the engine for an x without a gradient to record.
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert CB.route(x, wt, cb, b) == ("engine" if hopper else "cudnn")
        assert CB.engine_dtypes(x, wt, cb, b) == (torch.bfloat16, torch.float32)
        assert CB.engine_dtypes(x, wt, *half[2:]) == (torch.bfloat16, torch.bfloat16)
        assert CB.route(cl_half.float(), wt, cb, b) == ("engine" if hopper else "cudnn")  # channels-last
        assert CB.route(x.double(), wt, cb, b) == "cudnn"
        assert CB.engine_dtypes(x, wt, half[2], b) == (torch.bfloat16, torch.float32)
        assert CB.engine_dtypes(x, half[1], *half[2:]) == (torch.bfloat16, torch.bfloat16)
        with torch.no_grad():  # float32 x cast in its copy, 16-bit parameters and y
            y16, ref16 = ops.conv_bias_relu(x, *half[1:]), _reference(x, *half[1:])
        assert y16.dtype == ref16.dtype == torch.bfloat16
        assert torch.allclose(y16.float(), ref16.float(), atol=3e-2, rtol=3e-2)
        assert ops.conv_bias_relu(x, wt, cb, b).dtype == torch.float32
    # float32 outside autocast: a TF32 product, where TF32 is allowed (the
    # engine for large calls only: test_engine_float32_route)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    assert CB.engine_dtypes(x, wt, cb, b) == (torch.float32, torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cudnn_route_keeps_x_memory_format_with_a_channels_last_weight(dtype, device, monkeypatch):
    """An NCHW x and a channels-last weight: y NCHW on the "cudnn" route as
    on the engine's (cuDNN alone writes channels-last there), with eager's
    values and gradients."""
    monkeypatch.setattr(CB, "_engine_pays", lambda *args: False)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 16, 9, 11, generator=gen).to(device, dtype).requires_grad_(True)
    wt = (torch.randn(8, 16, 3, 3, generator=gen) / 12).to(device, dtype)
    wt = wt.contiguous(memory_format=torch.channels_last).requires_grad_(True)
    cb = torch.randn(8, generator=gen).to(device, dtype).requires_grad_(True)
    assert not wt.is_contiguous() and CB.route(x, wt, cb, None) == "cudnn"
    y = ops.conv_bias_relu(x, wt, cb)
    ref = _reference(x, wt, cb, None)
    assert y.is_contiguous() and ref.is_contiguous(memory_format=torch.channels_last)
    g = torch.randn(y.shape, generator=gen).to(device, dtype)
    grads = torch.autograd.grad(y, (x, wt, cb), g)
    ref_grads = torch.autograd.grad(ref, (x, wt, cb), g)
    tol = 1e-3 if dtype == torch.float32 else 2e-2  # (TF32 in either, by cuDNN's choice)
    for a, b in zip((y, *grads), (ref, *ref_grads)):
        assert a.shape == b.shape and rel_error(a, b.double()) < tol


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_cudnn_route_trains_on_a_channels_last_float32_x_off_the_grid(device, monkeypatch, compiled):
    """A channels-last float32 x one value off the 16-byte grid, in
    training, as called and under torch.compile: cuDNN's own backward fails
    on it ("unable to find an engine", or a misaligned address that ends
    the process's CUDA context), so the "cudnn" route's backward hands it
    an aligned copy."""
    monkeypatch.setattr(CB, "_engine_pays", lambda *args: False)
    op = torch.compile(ops.conv_bias_relu, fullgraph=True) if compiled else ops.conv_bias_relu
    gen = torch.Generator().manual_seed(8)
    dense = torch.randn(1, 24, 9, 126, generator=gen).to(device).contiguous(memory_format=torch.channels_last)
    x = off_the_grid(dense).requires_grad_(True)
    assert x.is_contiguous(memory_format=torch.channels_last) and x.data_ptr() % 16
    wt = (torch.randn(48, 24, 2, 3, generator=gen) / 9).to(device).requires_grad_(True)
    cb, b = (torch.randn(48, generator=gen).to(device).requires_grad_(True) for _ in range(2))
    assert CB.route(x, wt, cb, b) == "cudnn"
    y = op(x, wt, cb, b.reshape(48, 1, 1))
    g = torch.randn(y.shape, generator=gen).to(device)
    grads = torch.autograd.grad(y, (x, wt, cb, b), g)
    torch.cuda.synchronize()
    leaves = [t.detach().clone().requires_grad_(True) for t in (dense, wt, cb, b)]
    ref = _reference(*leaves[:3], leaves[3].reshape(48, 1, 1))
    ref_grads = torch.autograd.grad(ref, leaves, g)
    assert y.is_contiguous(memory_format=torch.channels_last)
    for a, r in zip((y, *grads), (ref, *ref_grads)):
        assert rel_error(a, r.double()) < 1e-3  # (TF32 in either, by cuDNN's choice)


def test_traced_calls_plan_the_engine_as_eager_calls(monkeypatch):
    """The plan while torch.compile traces (CPU tensors, a Hopper GPU and
    tracing stood in for): an eager call's, with and without a gradient to
    record, and the engine for a channels-last x off the 16-byte grid too
    (no address is known while tracing; the traced ops copy it when the
    graph runs), which an eager call sends to cuDNN; no plan without
    torch.library's custom ops."""
    monkeypatch.setattr(gemm, "has_wgmma", lambda index: True)
    monkeypatch.setattr(CB, "ENGINE_TRAINING_MIN_ELEMENTS", 0)
    bf16, cl = torch.bfloat16, torch.channels_last
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 16, 20, 136, generator=gen, dtype=bf16).contiguous(memory_format=cl)
    wt, cb, b = (torch.randn(*shape, generator=gen, dtype=bf16) for shape in ((64, 16, 3, 3), (64,), (64,)))
    leaf = wt.clone().requires_grad_(True)
    plans = [CB._engine_plan(t, w, cb, b) for t in (x, x.contiguous()) for w in (wt, leaf)]
    assert [p[3] for p in plans] == [False, True] * 2  # (the training forward where a gradient is recorded)
    assert CB._engine_plan(off_the_grid(x), wt, cb, b) is None  # eager: off the grid
    monkeypatch.setattr(CB, "is_compiling", lambda: True)
    assert [CB._engine_plan(t, w, cb, b) for t in (x, x.contiguous()) for w in (wt, leaf)] == plans
    for w, plan in zip((wt, leaf), plans):
        assert CB._engine_plan(off_the_grid(x), w, cb, b) == plan
    monkeypatch.setattr(CB, "HAS_CUSTOM_OP", False)
    assert CB._engine_plan(x, wt, cb, b) is None
    assert CB._engine_plan(x, leaf, cb, b) is None


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["nchw-bf16", "channels_last-bf16", "nchw-fp32", "channels_last-fp32",
                                  "nchw-amp", "channels_last-amp", "channels_last-bf16-off_the_grid"])
def test_compiled_inference_takes_the_engine(case, device, monkeypatch, launches):
    """torch.compile(fullgraph=True) with no gradient to record: the engine
    (the traced op cupy_fused::conv_bias_relu_engine, no "cudnn" route
    kernel), bit for bit the eager call's y in x's memory format; a
    channels-last x off the 16-byte grid, which no address tells the trace
    of, is copied onto the grid when the graph runs (bit for bit the
    aligned x's y)."""
    dtype, fmt, amp = _engine_case(case, device, monkeypatch)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 16, 20, 136, generator=gen).to(device, dtype).contiguous(memory_format=fmt)
    wt, cb, b = ((torch.randn(*shape, generator=gen) / 4).to(device, dtype)
                 for shape in ((64, 16, 3, 3), (64,), (64, 1, 1)))
    fn = ops.conv_bias_relu
    torch._dynamo.reset()  # (no earlier test's graphs count against the recompile limit)
    compiled = torch.compile(fn, fullgraph=True)
    with torch.no_grad(), amp:
        want = fn(x, wt, cb, b)
        launches.clear()
        got = compiled(off_the_grid(x) if case.endswith("off_the_grid") else x, wt, cb, b)
    names = [launch.name for launch in launches]
    assert any(n.startswith("cf::conv_bias_relu") for n in names), names
    assert not any(n.startswith("cf::bias_relu") for n in names), names
    assert got.stride() == want.stride() and got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["nchw-bf16", "channels_last-bf16", "nchw-fp32", "channels_last-fp32",
                                  "nchw-amp", "channels_last-amp", "channels_last-bf16-off_the_grid",
                                  "nchw-bf16-padded", "channels_last-fp32-off_the_grid"])
def test_compiled_training_takes_the_engine(case, device, monkeypatch, launches):
    """A training step through torch.compile(fullgraph=True): the engine's
    training forward and backward (the traced ops
    cupy_fused::conv_bias_relu_engine_train and its backward, no "cudnn"
    route kernel), y and every gradient bit for bit the eager step's, in
    the eager step's dtypes and strides; with C_in padded to a multiple of 8
    (5 channels), and with a channels-last x off the 16-byte grid, which no
    address tells the trace of (copied onto the grid when the graph runs,
    in the forward and in the backward: bit for bit the aligned x's)."""
    dtype, fmt, amp = _engine_case(case, device, monkeypatch)
    gen = torch.Generator().manual_seed(5)
    cin = 5 if case.endswith("padded") else 16
    x = torch.randn(2, cin, 20, 136, generator=gen).to(device, dtype).contiguous(memory_format=fmt)
    wt, cb, b = ((torch.randn(*shape, generator=gen) / 4).to(device, dtype)
                 for shape in ((64, cin, 3, 3), (64,), (64, 1, 1)))

    def step(fn, x):
        leaves = [t.detach().clone().requires_grad_(True) for t in (wt, cb, b)]
        xg = x.detach().requires_grad_(True)  # (a view keeps its offset: x is a leaf here)
        _keep_returned_grads(xg, *leaves)
        with amp:
            y = fn(xg, *leaves)
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(6)).to(y)
                   .contiguous(memory_format=_memory_format(y)))
        return [y.detach()] + [t.returned_grad for t in [xg] + leaves]

    fn = ops.conv_bias_relu
    want = step(fn, x)
    torch._dynamo.reset()  # (no earlier test's graphs count against the recompile limit)
    compiled = torch.compile(fn, fullgraph=True)
    launches.clear()
    got = step(compiled, off_the_grid(x) if case.endswith("off_the_grid") else x)
    names = [launch.name for launch in launches]
    assert any(n.startswith("cf::conv_bias_relu") for n in names), names
    assert not any(n.startswith("cf::bias_relu_forward") for n in names), names
    for name, g, w in zip(("y", "x", "weight", "conv_bias", "bias"), got, want):
        assert g.dtype == w.dtype and _layout(g) == _layout(w) and torch.equal(g, w), name


def _memory_format(t):
    return torch.channels_last if CB._strictly_channels_last(t) else torch.contiguous_format


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["nchw-bf16", "channels_last-fp32", "nchw-amp"])
def test_dynamic_batch_compiles_the_engine_once(case, device, monkeypatch, launches):
    """torch.compile(fullgraph=True, dynamic=True) of a training step on the
    engine (planned on a symbolic batch size): one graph for batches 2, 3
    and 6, each step bit for bit the eager step's, the engine's forward
    launched in every one."""
    from torch._dynamo.utils import counters

    dtype, fmt, amp = _engine_case(case, device, monkeypatch)
    gen = torch.Generator().manual_seed(9)
    wt, cb, b = ((torch.randn(*shape, generator=gen) / 4).to(device, dtype)
                 for shape in ((64, 16, 3, 3), (64,), (64, 1, 1)))

    def step(fn, x, g):
        leaves = _keep_returned_grads(*(t.detach().clone().requires_grad_(True) for t in (x, wt, cb, b)))
        with amp:
            y = fn(*leaves)
        y.backward(g)
        return [y.detach()] + [t.returned_grad for t in leaves]

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(ops.conv_bias_relu, fullgraph=True, dynamic=True)
    for n in (2, 3, 6):
        x = torch.randn(n, 16, 12, 136, generator=gen).to(device, dtype).contiguous(memory_format=fmt)
        g = torch.randn(n, 64, 10, 134, generator=gen).to(device, dtype).contiguous(memory_format=fmt)
        want = step(ops.conv_bias_relu, x, g)
        launches.clear()
        got = step(compiled, x, g)
        assert any(launch.name.startswith("cf::conv_bias_relu") for launch in launches), (n, launches)
        for name, have, w in zip(("y", "x", "weight", "conv_bias", "bias"), got, want):
            assert _layout(have) == _layout(w) and torch.equal(have, w), (n, name)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def _engine_case(case, device, monkeypatch):
    """(dtype, memory format, autocast context) of a case named
    "<layout>-<mode>[-...]" (layout nchw or channels_last; mode bf16, fp32,
    or amp: float32 tensors under bfloat16 autocast), on the engine at any
    size (skipped off Hopper)."""
    _engine_device(device)
    _lift_engine_thresholds(monkeypatch)
    layout, mode = case.split("-")[:2]
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    return (torch.float32 if mode in ("fp32", "amp") else torch.bfloat16, fmt,
            torch.autocast("cuda", dtype=torch.bfloat16, enabled=mode == "amp"))


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["nchw-bf16", "channels_last-fp32", "nchw-amp"])
def test_reduce_overhead_training_replays_the_engine(case, device, monkeypatch, beside_eager):
    """torch.compile(mode="reduce-overhead") of a training step (CUDA graphs
    over the traced engine ops): every step, each on new x and output
    gradient, gives y and every gradient bit for bit as the eager step on
    the same values; the steps after the graphs are recorded replay them
    (no kernel launched from Python, no graph skipped)."""
    from torch._dynamo.utils import counters

    dtype, fmt, amp = _engine_case(case, device, monkeypatch)
    gen = torch.Generator().manual_seed(8)
    wt, cb, b = ((torch.randn(*shape, generator=gen) / 4).to(device, dtype)
                 for shape in ((64, 16, 3, 3), (64,), (64, 1, 1)))

    def step(fn, seed):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(2, 16, 20, 136, generator=g).to(device, dtype).contiguous(memory_format=fmt)
        leaves = [t.detach().clone().requires_grad_(True) for t in (x, wt, cb, b)]
        with amp:
            y = fn(*leaves)
        y.backward(torch.randn(y.shape, generator=g).to(y).contiguous(memory_format=fmt))
        # (clones: a replay writes its outputs into the graph's own memory)
        return [y.detach().clone()] + [t.grad.clone() for t in leaves]

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(ops.conv_bias_relu, mode="reduce-overhead", fullgraph=True)
    for seed in range(5):  # (warm-up, recording, then replays)
        got, want, from_python = beside_eager(lambda: step(compiled, seed),
                                              lambda: step(ops.conv_bias_relu, seed))
        # (the warm-up and the recording run the kernels from Python: an
        # empty record after them is a replay)
        assert bool(from_python) == (seed < 2), (seed, from_python)
        for name, g, w in zip(("y", "x", "weight", "conv_bias", "bias"), got, want):
            assert torch.equal(g, w), (seed, name)
    assert not counters["inductor"]["cudagraph_skips"]  # (graphs it did run)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["nchw-bf16", "channels_last-bf16", "nchw-fp32", "channels_last-fp32",
                                  "nchw-amp", "channels_last-amp"])
def test_engine_under_cuda_graph_capture(case, device, monkeypatch):
    """A forward with no gradient to record and a training step, each
    captured once in a CUDA graph (torch.cuda.graph) on the engine, then
    replayed on new values of x and of the output gradient: y and every
    gradient bit for bit what the same calls give uncaptured on those
    values."""
    dtype, fmt, amp = _engine_case(case, device, monkeypatch)
    gen = torch.Generator().manual_seed(7)

    def draw(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device, dtype)

    wt, cb, b = draw(64, 16, 3, 3, scale=0.25), draw(64), draw(64, 1, 1)
    params = [t.requires_grad_(True) for t in (wt, cb, b)]
    xs = [draw(2, 16, 20, 136).contiguous(memory_format=fmt) for _ in range(2)]
    # (y's dtype: the model's, float32 under autocast)
    dys = [torch.randn(2, 64, 18, 134, generator=gen).to(device, dtype).contiguous(memory_format=fmt)
           for _ in range(2)]
    static_x = xs[0].clone().requires_grad_(True)
    static_dy = dys[0].clone()

    def forward():
        with torch.no_grad(), amp:
            return ops.conv_bias_relu(static_x, *params)

    def step():
        for t in [static_x] + params:
            t.grad = None
        with amp:
            y = ops.conv_bias_relu(static_x, *params)
        y.backward(static_dy)
        return [y.detach()] + [t.grad for t in [static_x] + params]

    assert CB.route(static_x, *params) == "engine"
    side = torch.cuda.Stream(device)  # (warm-up off the capture's stream, as torch asks)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            forward(), step()
    torch.cuda.current_stream(device).wait_stream(side)
    graphs = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(graphs[0]):
        static_y = forward()
    for t in [static_x] + params:
        t.grad = None
    with torch.cuda.graph(graphs[1]):
        static_step = step()
    with torch.no_grad():
        static_x.copy_(xs[1])
        static_dy.copy_(dys[1])
    graphs[0].replay()
    graphs[1].replay()
    torch.cuda.synchronize(device)
    want_y, want_step = forward(), step()
    assert torch.equal(static_y, want_y)
    for name, got, want in zip(("y", "x", "weight", "conv_bias", "bias"), static_step, want_step):
        assert torch.equal(got, want), name


@pytest.mark.gpu
def test_model_takes_the_engine_in_inference(device):
    """Problem 1's module in bfloat16 under no_grad: the engine route, within
    the reference's error; with grad on, the cudnn route."""
    from cupy_fused import models

    _engine_device(device)
    torch.manual_seed(0)
    ours = models.ConvReluBiasAdd(64, 128, 3, (128, 1, 1)).to(device, torch.bfloat16)
    x = torch.randn(2, 64, 20, 20, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        conv = ours.conv
        assert CB.route(x, conv.weight, conv.bias, ours.bias) == "engine"
        y = ours(x)
        want = _reference(x.double(), conv.weight.double(), conv.bias.double(), ours.bias.double())
        eager = _reference(x, conv.weight, conv.bias, ours.bias)
        assert rel_error(y, want) <= 1.5 * rel_error(eager, want) + torch.finfo(torch.bfloat16).eps


def _training_step(x, wt, cb, b, g):
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, wt, cb, b)]
    y = ops.conv_bias_relu(*leaves)
    y.backward(g)
    return [y.detach()] + [t.grad for t in leaves]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["float32", "bfloat16", "amp_bf16", "channels_last"])
def test_training_step_is_bitwise_reproducible(mode, device):
    """The "cudnn" route's training step with torch.backends.cudnn.benchmark
    on and deterministic off: output and every gradient bitwise equal over
    repeated steps, and the flags left as they were.  (At this float32 shape
    the algorithm cuDNN's benchmark picks for conv2d's weight gradient sums
    in a varying order.)"""
    gen = torch.Generator().manual_seed(3)
    dtype = torch.bfloat16 if mode in ("bfloat16", "channels_last") else torch.float32
    x = torch.randn(16, 32, 16, 16, generator=gen).to(device, dtype)
    if mode == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    wt = (torch.randn(32, 32, 3, 3, generator=gen) / 17).to(device, dtype)
    cb, b = (torch.randn(32, generator=gen).to(device, dtype) for _ in range(2))
    b = b.reshape(32, 1, 1)
    g = torch.randn(16, 32, 14, 14, generator=gen).to(device, torch.float32 if mode == "amp_bf16" else dtype)
    flags = torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = True, False
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=mode == "amp_bf16"):
            assert CB.route(x.requires_grad_(True), wt, cb, b) == "cudnn"
            first = _training_step(x, wt, cb, b, g)
            for _ in range(5):
                for a, again in zip(first, _training_step(x, wt, cb, b, g)):
                    assert torch.equal(a, again)
        assert torch.backends.cudnn.benchmark and not torch.backends.cudnn.deterministic
    finally:
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = flags
    assert first[0].dtype == (torch.float32 if mode == "amp_bf16" else dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(1, 3, 5, 7), (2, 33, 9, 130), (3, 70, 4, 64), (2, 8, 1, 1),
                                   (2, 72, 3, 136), (1, 64, 2, 128), (3, 8, 2, 8)],
                         ids=lambda s: "x".join(map(str, s)))
def test_transposing_copies_are_exact(shape, dtype, device, monkeypatch):
    """NCHW -> channels-last -> NCHW copies (odd channel counts and widths,
    several 64 x 64 tiles each way, a 1 x 1 image; the last three shapes
    take the vector kernels in 16 bits, with partial tiles both ways):
    torch's own copies, bitwise.  A float32 x copied to a 16-bit
    channels-last one is its cast."""
    launched = _kernel_names(monkeypatch, whole=True)
    x = torch.randn(shape, device=device).to(dtype)
    cl = CB._transposed(x)
    assert cl.is_contiguous(memory_format=torch.channels_last) and cl.dtype == dtype
    assert torch.equal(cl, x) and cl.data_ptr() != x.data_ptr()
    back = CB._transposed(cl) if not cl.is_contiguous() else cl.contiguous()
    assert back.is_contiguous() and torch.equal(back, x)
    if dtype != torch.float32:
        x32 = torch.randn(shape, device=device) * 1e3
        cast = CB._transposed(x32, dtype)
        assert cast.is_contiguous(memory_format=torch.channels_last) and torch.equal(cast, x32.to(dtype))
    vec = dtype != torch.float32 and shape[1] % 8 == 0 and shape[3] % 8 == 0
    expected = [("to_nhwc", dtype, dtype)]
    if not cl.is_contiguous():  # (a 1 x 1 image's channels-last copy is contiguous too)
        expected.append(("to_nchw", dtype))
    if dtype != torch.float32:
        expected.append(("to_nhwc", torch.float32, dtype))
    assert launched == [k + ("vec",) if vec else k for k in expected]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_transposing_copies_off_the_vector_grid(dtype, device):
    """16-bit tensors whose start is off the 16-byte grid, NCHW and
    channels-last, take the copy of one value a lane, and are copied
    exactly."""
    shape = (2, 16, 3, 8)
    x = torch.randn(math.prod(shape) + 1, device=device).to(dtype)[1:].view(shape)
    cl = CB._transposed(x)
    assert not CB._vector_transposes(x, cl) and torch.equal(cl, x)
    n, c, h, w = shape
    cl_off = torch.empty(math.prod(shape) + 1, device=device, dtype=dtype)[1:].view(n, h, w, c)
    cl_off = cl_off.permute(0, 3, 1, 2).copy_(x)
    assert cl_off.is_contiguous(memory_format=torch.channels_last) and cl_off.data_ptr() % 16
    back = CB._transposed(cl_off)
    assert not CB._vector_transposes(cl_off, back) and back.is_contiguous() and torch.equal(back, x)


@pytest.mark.parametrize("shape, dtype, vec", [((2, 64, 3, 128), torch.bfloat16, True),
                                               ((2, 64, 3, 128), torch.float32, False),
                                               ((2, 60, 3, 128), torch.float16, False),
                                               ((2, 64, 3, 124), torch.float16, False)],
                         ids=["bf16", "fp32", "c60", "w124"])
def test_which_copies_take_vectors(shape, dtype, vec):
    """The vector copies take 16-bit outputs with C and W multiples of 8,
    both tensors on the 16-byte grid (CPU tier: the rule alone)."""
    x = torch.empty(shape, dtype=dtype)
    cl = torch.empty(shape, dtype=dtype, memory_format=torch.channels_last)
    assert CB._vector_transposes(x, cl) == vec and CB._vector_transposes(cl, x) == vec
    if vec:  # from float32 to a 16-bit copy (autocast's cast in the copy) too
        assert CB._vector_transposes(torch.empty(shape), cl)
        off = off_the_grid(x)
        assert not CB._vector_transposes(off, cl)


def _conv_operands(shape, seed, device, dtype, memory_format=torch.contiguous_format):
    """(the generator, for more draws; x in ``memory_format``, weight,
    conv_bias and bias (flat)) for ``shape`` (n, C_in, H, W, C_out, KH, KW),
    random from ``seed`` and the shape, in ``dtype`` on ``device``."""
    n, cin, h, w, cout, kh, kw = shape
    gen = torch.Generator().manual_seed(sum(shape) + seed)
    x = torch.randn(n, cin, h, w, generator=gen).to(device, dtype).contiguous(memory_format=memory_format)
    wt = (torch.randn(cout, cin, kh, kw, generator=gen) / (cin * kh * kw) ** 0.5).to(device, dtype)
    cb, b = (torch.randn(cout, generator=gen).to(device, dtype) for _ in range(2))
    return gen, x, wt, cb, b


def _mask_bits(mask):
    """relu's mask words unpacked: bit i of word i // 32 as element i."""
    shifts = torch.arange(32, device=mask.device, dtype=torch.int32)
    return ((mask.view(-1, 1) >> shifts) & 1).flatten()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["float32", "bfloat16", "float16", "amp_bf16",
                                  "bfloat16_weight_channels_last"])
@pytest.mark.parametrize("shape", [(2, 8, 9, 70, 16, 3, 3), (1, 40, 12, 10, 72, 5, 2),
                                   (2, 72, 6, 131, 8, 1, 3)],
                         ids=lambda s: "x".join(map(str, s)))
def test_channels_last_backward(shape, mode, device, monkeypatch):
    """The training route's backward of an NCHW input on a compute
    capability 9.0 GPU (here at small sizes too): dz written channels-last
    by bias_relu's backward, x copied so, cuDNN's channels-last backward
    (the input and weight gradients of 16-bit dtypes on the engine,
    conv_dgrad_wgmma and conv_wgrad_wgmma),
    the input gradient copied back to NCHW.  Every gradient within 1.5x the
    error against float64 of
    eager on a channels-last x (cuDNN's same layout, its algorithms held to
    the deterministic ones, as ours: in float32 with TF32 allowed, a TF32
    input gradient at these sizes where NCHW's is not), in NCHW as the
    reference's.  A channels-last weight makes z, and so dz, channels-last
    already."""
    _engine_device(device)
    monkeypatch.setattr(CB, "CL_BACKWARD_MIN_ELEMENTS", 0)
    _lift_wgrad_rule(monkeypatch)
    copies, dgrads, wgrads = [], [], []
    transposed, dgrad, wgrad = CB._transposed, CB._launch_dgrad, CB._launch_wgrad
    monkeypatch.setattr(CB, "_transposed", lambda *a, **k: copies.append(a[0].shape) or transposed(*a, **k))
    monkeypatch.setattr(CB, "_launch_dgrad", lambda dz, wt, *a: dgrads.append(dz.dtype) or dgrad(dz, wt, *a))
    monkeypatch.setattr(CB, "_launch_wgrad", lambda dz, *a: wgrads.append(dz.dtype) or wgrad(dz, *a))
    n, cin, h, w, cout, kh, kw = shape
    dtype = torch.float32 if mode in ("float32", "amp_bf16") else getattr(torch, mode.split("_")[0])
    amp = mode == "amp_bf16"
    gen, x, wt, cb, b = _conv_operands(shape, 0, device, dtype)
    if mode.endswith("weight_channels_last"):
        wt = wt.contiguous(memory_format=torch.channels_last)
    b = b.reshape(cout, 1, 1)
    g = torch.randn(n, cout, h - kh + 1, w - kw + 1, generator=gen).to(device, dtype)
    dz = g.to(torch.bfloat16 if amp else dtype)
    assert CB._channels_last_backward(dz, x.to(dz.dtype))
    leaves = _keep_returned_grads(*(t.detach().clone().requires_grad_(True) for t in (x, wt, cb, b)))
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
        assert CB.route(*leaves) == "cudnn"
        y = ops.conv_bias_relu(*leaves)
    y.backward(g)
    assert len(copies) == 2  # x channels-last, dx back (dz comes channels-last from bias_relu)
    assert dgrads == ([] if mode == "float32" else [dz.dtype])  # the input gradient ours in 16 bits
    assert wgrads == dgrads  # and the weight gradient
    assert leaves[0].returned_grad.is_contiguous()
    ref = [t.detach().double().requires_grad_(True) for t in (x, wt, cb, b)]
    _reference(*ref).backward(g.double())
    eager = [t.detach().clone().requires_grad_(True)
             for t in (x.contiguous(memory_format=torch.channels_last), wt, cb, b)]
    with CB._deterministic_cudnn(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
        _reference(*eager).backward(g.contiguous(memory_format=torch.channels_last))
    eps = torch.finfo(torch.bfloat16 if amp else dtype).eps
    for name, ours, want, theirs in zip(("x", "weight", "conv_bias", "bias"), leaves, ref, eager):
        err, eager_err = rel_error(ours.grad, want.grad), rel_error(theirs.grad, want.grad)
        assert ours.grad.dtype == theirs.grad.dtype
        assert err <= 1.5 * eager_err + eps, (name, err, eager_err)


# (N, C_in, H, W, C_out, KH, KW) of the engine's training forward: output
# rows at every start in their 4-value chunk and mask word (OW odd, OW of
# 125 to 129 and past one 128-column tile), C_out over one 128-channel tile.
TRAINING_SHAPES = [(2, 8, 9, 70, 16, 3, 3), (1, 16, 5, 127, 8, 1, 3), (2, 8, 4, 131, 136, 2, 3),
                   (1, 64, 6, 130, 24, 3, 3), (3, 8, 3, 5, 8, 1, 1),
                   (2, 8, 4, 132, 136, 2, 3)]  # OW 130: NCHW rows starting 2 values off the 4-value grid


def _engine_training_step_against_float64(shape, dtype, amp, memory_format, device):
    """Two training steps on the engine (its size thresholds lifted by the
    caller, TF32 allowed for float32) from random inputs of ``shape`` (n,
    C_in, H, W, C_out, KH, KW) in ``dtype``, x in ``memory_format``, the
    forward under autocast to ``amp`` (or None): the steps bitwise equal,
    the output and every gradient within 1.5x eager's error against
    float64.  Returns (y, our leaves, eager's y, eager's leaves), the leaves
    with their gradients as the ops returned them (``returned_grad``)."""
    n, cin, h, w, cout, kh, kw = shape
    gen, x, wt, cb, b = _conv_operands(shape, 0, device, dtype, memory_format)
    b = b.reshape(cout, 1, 1)
    g = torch.randn(n, cout, h - kh + 1, w - kw + 1, generator=gen).to(device, dtype)

    def step():
        leaves = _keep_returned_grads(*(t.detach().clone().requires_grad_(True) for t in (x, wt, cb, b)))
        with torch.autocast("cuda", dtype=amp or torch.bfloat16, enabled=amp is not None):
            assert CB.route(*leaves) == "engine"
            y = ops.conv_bias_relu(*leaves)
        y.backward(g)
        return y, leaves

    y, leaves = step()
    again, leaves2 = step()
    assert torch.equal(y, again) and all(torch.equal(a.grad, c.grad) for a, c in zip(leaves, leaves2))
    # Under autocast the float64 reference runs on autocast's casts of x and
    # the weight (what the convolution computes there), in float32 on their
    # TF32 roundings (what torch.backends.cudnn.allow_tf32 grants the
    # reference's convolution).  From the unrounded inputs, the few values
    # that the inputs' rounding carries across 0 flip relu's mask, in ours or
    # in eager's by chance, each flip a gradient error of about
    # 1/sqrt(y.numel()): at these sizes the comparison would be a coin toss.
    if amp:
        src = (x.to(amp), wt.to(amp))
    elif dtype == torch.float32:
        src = (CB._tf32(x), CB._tf32(wt))
    else:
        src = (x, wt)
    ref = [t.detach().double().requires_grad_(True) for t in (*src, cb, b)]
    want = _reference(*ref)
    want.backward(g.double())
    def eager_step(x):
        leaves = _keep_returned_grads(*(t.detach().clone().requires_grad_(True) for t in (x, wt, cb, b)))
        with torch.autocast("cuda", dtype=amp or torch.bfloat16, enabled=amp is not None):
            y = F.relu(F.conv2d(leaves[0], leaves[1], leaves[2])) + leaves[3]
        y.backward(g)
        return y, leaves

    ey, eager = eager_step(x)
    # In float32 (and under autocast, from float32 operands) the yardstick is
    # eager on a channels-last x, its algorithms held to the deterministic
    # ones (as test_channels_last_backward's): our backward's cuDNN calls,
    # TF32 at sizes where eager's NCHW ones are not.
    if dtype == torch.float32:
        with CB._deterministic_cudnn():
            ey, eager = eager_step(x.contiguous(memory_format=torch.channels_last))
    eps = torch.finfo(amp or dtype).eps
    assert rel_error(y, want) <= 1.5 * rel_error(ey, want) + eps
    # A float32 step's input and weight gradients hold at least a TF32
    # product's error: that of float64 on g rounded to TF32 as well (dz
    # rounded, as the TF32 input gradient reads it and cuDNN's TF32 weight
    # gradient rounds it).  At these sizes, far below the engine's
    # thresholds, cuDNN may run the weight gradient in float32 on the
    # unrounded dz.  (The biases' sums add dz unrounded.)
    floor = [0.0] * 4
    if dtype == torch.float32 and not amp:
        tf32 = [t.detach().double().requires_grad_(True) for t in (*src, cb, b)]
        _reference(*tf32).backward(CB._tf32(g).double())
        floor[:2] = [rel_error(t.grad, r.grad) for t, r in zip(tf32[:2], ref[:2])]
    for name, ours, r, theirs, f in zip(("x", "weight", "conv_bias", "bias"), leaves, ref, eager, floor):
        err, eager_err = rel_error(ours.grad, r.grad), rel_error(theirs.grad, r.grad)
        assert err <= 1.5 * max(eager_err, f) + eps, (name, err, eager_err, f)
    return y, leaves, ey, eager


def _lift_engine_thresholds(monkeypatch):
    # The engine's training forward at small sizes, float32 (TF32) included,
    # and its 16-bit weight gradient wherever the kernel takes it.
    monkeypatch.setattr(CB, "ENGINE_TRAINING_MIN_ELEMENTS", 0)
    monkeypatch.setattr(CB, "ENGINE_FLOAT32_MIN_ELEMENTS", 0)
    _lift_wgrad_rule(monkeypatch)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)  # (PyTorch's default)


def _lift_wgrad_rule(monkeypatch):
    monkeypatch.setattr(CB, "WGRAD_COUT_MULTIPLE", 8)
    monkeypatch.setattr(CB, "WGRAD_MIN_ROW_SHARE", 0.0)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["bfloat16", "float16", "float32", "amp_bf16", "amp_fp16"])
@pytest.mark.parametrize("shape", TRAINING_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_engine_training_forward(shape, mode, device, monkeypatch):
    """A training step on the engine (here at small sizes too): y and relu's
    mask from its store, bias_relu's backward writing dz channels-last,
    the input gradient on the engine (16-bit: conv_dgrad_wgmma) and cuDNN's
    channels-last weight gradient on the forward's copy of x (float32:
    rounded to TF32; cuDNN's input gradient too).  Output and every
    gradient within 1.5x eager's error against float64, in the reference's
    dtypes and layouts; two steps bitwise equal."""
    _engine_device(device)
    _lift_engine_thresholds(monkeypatch)
    amp = {"amp_bf16": torch.bfloat16, "amp_fp16": torch.float16}.get(mode)
    y, leaves, ey, eager = _engine_training_step_against_float64(
        shape, torch.float32 if amp else getattr(torch, mode), amp, torch.contiguous_format, device)
    assert y.dtype == ey.dtype and y.is_contiguous()
    for ours, theirs in zip(leaves, eager):
        # (in each leaf's layout, as eager's convolution returns them; eager
        # itself ran on a channels-last x in float32)
        assert ours.grad.dtype == theirs.grad.dtype
        assert _layout(ours.returned_grad) == _layout(ours), (ours.returned_grad.stride(), ours.stride())


# (n, C_in, OH, OW, C_out, KH, KW) of dz [n, C_out, OH, OW]: kernels 1 to 7
# (7 x 7: dx's rows start 6 rows and columns before dz's), H and W odd (a
# tile's second row past the image), W over one 128-column tile, C_in over
# one 64-channel tile and not a multiple of 64, C_out not a multiple of the
# 64-channel k-block, batch 1, a 1 x 1 dz.
DGRAD_SHAPES = [(2, 64, 7, 70, 128, 3, 3), (1, 8, 5, 127, 8, 1, 1), (3, 72, 4, 131, 24, 2, 2),
                (1, 16, 9, 9, 136, 5, 5), (2, 200, 3, 126, 40, 7, 7), (1, 8, 1, 1, 8, 3, 5),
                (2, 64, 6, 122, 64, 7, 3), (4, 72, 18, 130, 40, 2, 6),
                # More tiles than SMs (352): both consumer warpgroups, tile after tile.
                (8, 128, 40, 120, 16, 4, 4)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", DGRAD_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_dgrad_against_float64(shape, dtype, device, monkeypatch):
    """The engine's input gradient (conv_dgrad_wgmma) against float64 on
    fresh random operands, into memory filled with NaN first: within 1.5x
    the error of torch's own (cuDNN's) input gradient in the same dtype
    (float32: ours on dz rounded to TF32, as bias_relu's backward rounds it,
    and the yardstick the float64 product of dz's and the weight's TF32
    roundings, the best a TF32 product gives), every element written,
    channels-last, bitwise reproducible; a 16-bit product's float32 dx
    (autocast's) is its dx bit for bit; a NaN or an infinity in dz reaches
    dx where it reaches float64's."""
    _engine_device(device)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)  # (PyTorch's default)
    n, cin, oh, ow, cout, kh, kw = shape
    gen = torch.Generator().manual_seed(sum(shape))
    cl = torch.channels_last
    dz = torch.randn(n, cout, oh, ow, generator=gen).to(device, dtype).contiguous(memory_format=cl)
    wt = (torch.randn(cout, cin, kh, kw, generator=gen) / (cout * kh * kw) ** 0.5).to(device, dtype)
    x_shape = (n, cin, oh + kh - 1, ow + kw - 1)
    want = torch.nn.grad.conv2d_input(x_shape, wt.double(), dz.double())
    tf32 = dtype == torch.float32
    if tf32:
        dz = CB._tf32(dz).contiguous(memory_format=cl)
        theirs = torch.nn.grad.conv2d_input(x_shape, CB._tf32(wt).double(), dz.double()).float()
    else:
        theirs = torch.nn.grad.conv2d_input(x_shape, wt, dz)
    assert CB._dgrad_on_engine(dz, wt, tf32_dz=True) and CB._dgrad_on_engine(dz, wt) != tf32
    poison_allocator(device, 2 * math.prod(x_shape) * 4)
    dx = CB._launch_dgrad(dz, wt)
    assert dx.shape == x_shape and dx.dtype == dtype and dx.is_contiguous(memory_format=cl)
    assert rel_error(dx, want) <= 1.5 * rel_error(theirs, want) + torch.finfo(dtype).eps
    assert torch.equal(dx, CB._launch_dgrad(dz, wt))
    if not tf32:
        poison_allocator(device, 2 * math.prod(x_shape) * 4)
        dx32 = CB._launch_dgrad(dz, wt, torch.float32)
        assert dx32.dtype == torch.float32 and dx32.is_contiguous(memory_format=cl)
        assert torch.equal(dx32, dx.float())
    # Non-finite dz: a NaN, +inf and -inf at three places.
    bad = dz.clone()
    flat = bad.permute(0, 2, 3, 1).reshape(-1)  # (a view of bad's memory)
    for i, v in zip((0, flat.numel() // 2, flat.numel() - 1), (float("nan"), float("inf"), float("-inf"))):
        flat[i] = v
    want = torch.nn.grad.conv2d_input(x_shape, wt.double(), bad.double())
    for got in (CB._launch_dgrad(bad, wt),) + (() if tf32 else (CB._launch_dgrad(bad, wt, torch.float32),)):
        assert_non_finite_where(got, want)


# (n, C_in, OH, OW, C_out, KH, KW) of dz [n, C_out, OH, OW] and x [n, C_in,
# OH + KH - 1, OW + KW - 1]: kernels 1 to 7 wide and tall, OW under, at and
# past one 64-column k-tile and ragged, C_in and C_out over one tile and not
# multiples of 64, counts of 64-channel column blocks that leave blocks
# past the last in a tile, batch 1, a 1 x 1 output; problem 1's shape at a
# quarter of its batch (a run per SM, hundreds of k-tiles a run); more
# output tiles than SMs (180 of 128 x 256: blocks on a second tile); tiles
# of 1, 2, 3 and 4 blocks of 64 input channels.
WGRAD_SHAPES = [(2, 64, 7, 70, 128, 3, 3), (1, 8, 5, 127, 8, 1, 1), (3, 72, 4, 131, 24, 2, 2),
                (1, 16, 9, 9, 136, 5, 5), (2, 200, 3, 126, 40, 7, 7), (1, 8, 1, 1, 8, 3, 5),
                (2, 64, 6, 64, 64, 7, 3), (4, 72, 18, 130, 40, 2, 6), (32, 64, 126, 126, 128, 3, 3),
                (1, 1024, 2, 3, 640, 3, 3), (2, 128, 5, 70, 64, 1, 1)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", WGRAD_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_wgrad_against_float64(shape, dtype, device):
    """The engine's weight gradient (conv_wgrad_wgmma, conv_wgrad_reduce)
    against float64 on fresh random operands, every buffer it allocates
    filled with NaN first: within 1.5x the error of torch's own (cuDNN's) weight gradient
    in the same dtype, every element written, bitwise reproducible; a NaN
    or an infinity in x or dz reaches dw where it reaches float64's, the
    values of x past the last output column included (which no tap of the
    last columns reads)."""
    _engine_device(device)
    n, cin, oh, ow, cout, kh, kw = shape
    gen = torch.Generator().manual_seed(sum(shape))
    cl = torch.channels_last
    dz = torch.randn(n, cout, oh, ow, generator=gen).to(device, dtype).contiguous(memory_format=cl)
    x = torch.randn(n, cin, oh + kh - 1, ow + kw - 1, generator=gen).to(device, dtype)
    x = x.contiguous(memory_format=cl)
    w_shape = (cout, cin, kh, kw)
    want = torch.nn.grad.conv2d_weight(x.double(), w_shape, dz.double())
    theirs = torch.nn.grad.conv2d_weight(x, w_shape, dz)
    assert CB._wgrad_fits(dz, x, torch.empty(w_shape, dtype=dtype))
    # Every float tensor the launch allocates (its partials, then dw) starts
    # as NaN: the allocator's poisoned blocks could go to the partials first.
    empty, made = torch.empty, []
    with pytest.MonkeyPatch.context() as m:
        m.setattr(torch, "empty", lambda *a, **k: made.append(_nan_filled(empty(*a, **k))) or made[-1])
        dw = CB._launch_wgrad(dz, x, kh, kw)
    assert dw.data_ptr() in [t.data_ptr() for t in made] and len(made) >= 2  # (dw, the partials)
    assert dw.shape == w_shape and dw.dtype == dtype and dw.is_contiguous()
    assert rel_error(dw, want) <= 1.5 * rel_error(theirs, want) + torch.finfo(dtype).eps
    assert torch.equal(dw, CB._launch_wgrad(dz, x, kh, kw))
    # Non-finite values: in dz at three places, in x at the last column of
    # a row (read by the widest tap alone) and at the first.
    bad_dz, bad_x = dz.clone(), x.clone()
    flat = bad_dz.permute(0, 2, 3, 1).reshape(-1)  # (a view of bad_dz's memory)
    for i, v in zip((0, flat.numel() // 2, flat.numel() - 1), (float("nan"), float("inf"), float("-inf"))):
        flat[i] = v
    bad_x[0, 0, 0, -1] = float("inf")
    bad_x[-1, -1, -1, 0] = float("-inf")
    for xs, dzs in ((x, bad_dz), (bad_x, dz)):
        want = torch.nn.grad.conv2d_weight(xs.double(), w_shape, dzs.double())
        got = CB._launch_wgrad(dzs, xs, kh, kw)
        assert_non_finite_where(got, want)


def test_window_launches_fit_their_kernels():
    """Each instantiation of the window kernels (conv_bias_relu_window and
    conv_dgrad_wgmma, KW 1 to WINDOW_MAX_KW) gets two stages or more within
    the opt-in shared memory, the window (kConvWindow in the kernels, WINDOW
    here) holds the taps of a row of 128 columns, and the key table names
    them all."""
    text = (_runtime.kernel_dir() / "conv_bias_relu.cu").read_text()
    assert int(re.search(r"constexpr int kConvWindow = (\d+);", text).group(1)) == CB.WINDOW
    # The stage as the kernel sizes it (ConvWindowMma), and the opt-in limit gemm.cuh asserts.
    assert "kTileABytes = kKw * 64 * 128, kTileBBytes = 2 * kConvWindowBytes;" in text
    assert CB._window_stage_bytes(3) == 3 * 64 * 128 + 2 * CB.WINDOW * 128
    limit = re.search(r"\(\) <=\s*(\d+),", (_runtime.kernel_dir() / "gemm.cuh").read_text()).group(1)
    assert int(limit) == CB._OPT_IN_SHARED_BYTES
    for kw in range(1, CB.WINDOW_MAX_KW + 1):
        assert CB._window_stages(kw) >= 2 and CB._window_shared_bytes(kw) <= CB._OPT_IN_SHARED_BYTES
        assert CB._window_stages(kw) == 4 or CB._window_shared_bytes(kw) + CB._window_stage_bytes(kw) + 16 \
            > CB._OPT_IN_SHARED_BYTES  # as many stages as fit
        assert 128 + kw - 1 <= CB.WINDOW
        for dtype in (torch.float16, torch.bfloat16):
            assert f", {kw}, {CB._window_stages(kw)}>" in CB.KERNELS.expressions[("dgrad", dtype, kw)]
            for mask in (False, True):
                expr = CB.KERNELS.expressions[("window", dtype, kw, mask)]
                assert f", {kw}, {CB._window_stages(kw)}, " in expr
    # The weight gradient's (WgradMma: two boxes of dz, tb of x, 8 KiB each): at least 4 stages.
    assert "kTileABytes = 2 * kMnBoxBytes, kTileBBytes = kTb * kMnBoxBytes;" in text
    assert int(re.search(r"constexpr int kWgradMaxKw = (\d+);", text).group(1)) == CB.WGRAD_MAX_KW
    for tb in range(1, 5):
        assert CB._wgrad_stage_bytes(tb) == (2 + tb) * 64 * 128
        assert CB._wgrad_stages(tb) >= 4
        assert gemm._half_shared_bytes(0, CB._wgrad_stages(tb), CB._wgrad_stage_bytes(tb)) \
            <= CB._OPT_IN_SHARED_BYTES
        for dtype in (torch.float16, torch.bfloat16):
            assert CB.KERNELS.expressions[("wgrad", dtype, tb)].endswith(f", {tb}, {CB._wgrad_stages(tb)}>")


def test_nchw_window_launches_fit_their_kernel():
    """Each NCHW window kernel (KW 1 to NCHW_WINDOW_MAX_KW) gets two raw
    rows or more in flight (kRaw >= 2, which its loader asserts), and each
    band kernel (KW 1 to BAND_MAX_KW; 16-bit x, or float32 under autocast,
    NCHW or channels-last, beside its store's staging) two stages or more
    beside BAND_RAWS raw slots and BAND_WINDOWS windows, as many (up to 4)
    as the opt-in
    shared memory holds; the raw row, the window and the staging are sized
    as the kernel sizes them; no wider kernel fits."""
    text = (_runtime.kernel_dir() / "conv_bias_relu.cu").read_text()
    assert "constexpr int kConvRawBytes = 64 * kConvWindow * 2;" in text
    assert CB._RAW_BYTES == 64 * CB.WINDOW * 2
    # (the band kernel's windows are sized as raw rows: _band_shared_bytes)
    assert "constexpr int kConvWindowBytes = kConvWindow * 128;" in text and CB.WINDOW * 128 == CB._RAW_BYTES
    assert CB.BAND_RAWS >= 2  # (the band loader's static_assert)
    staging = re.search(r"constexpr int kWindowNchwStagingBytes = 2 \* (\d+) \* 1024;", text).group(1)
    assert CB._NCHW_WINDOW_STAGING_BYTES == 2 * int(staging) * 1024
    # 64 staging rows of kConvStageRow (136) values, and the last chunk's reads past the last row.
    assert CB._NCHW_WINDOW_STAGING_BYTES // 2 >= 64 * 136 * 2 + 16
    # (key, key's tail, widest kernel, count of its raw rows or stages, shared bytes, expression's end)
    f32, cl_staging = torch.float32, gemm.CONVERT_STAGING_BYTES
    kernels = (("nchw_window", (), CB.NCHW_WINDOW_MAX_KW, CB._nchw_window_raws, CB._nchw_window_shared_bytes,
                lambda kw, k: f", {kw}, {CB.NCHW_WINDOW_STAGES}, {k}>"),
               ("nchw_band", (), CB.BAND_MAX_KW, CB._band_stages, CB._band_shared_bytes,
                lambda kw, k: f", {kw}, {k}, {CB.BAND_RAWS}, {CB.BAND_WINDOWS}>"),
               ("nchw_band", (f32,), CB.BAND_MAX_KW, CB._band_stages, CB._band_shared_bytes,
                lambda kw, k: f", {kw}, {k}, {CB.BAND_RAWS}, {CB.BAND_WINDOWS}, float, float>"),
               ("nhwc_band", (), CB.BAND_MAX_KW, lambda kw: CB._band_stages(kw, cl_staging),
                lambda kw, k: CB._band_shared_bytes(kw, k, cl_staging),
                lambda kw, k: f", {kw}, {k}, {CB.BAND_RAWS}, {CB.BAND_WINDOWS}>"))
    for key, tail, max_kw, count, shared, end in kernels:
        for kw in range(1, max_kw + 1):
            k = count(kw)
            assert 2 <= k <= 4 and shared(kw, k) <= CB._OPT_IN_SHARED_BYTES
            assert k == 4 or shared(kw, k + 1) > CB._OPT_IN_SHARED_BYTES
            for dtype in (torch.float16, torch.bfloat16):
                assert CB.KERNELS.expressions[(key, dtype, kw) + tail].endswith(end(kw, k))
        assert count(max_kw + 1) < 2
    assert CB.BAND_MAX_KW <= CB.NCHW_WINDOW_MAX_KW
    # (a raw slot of the band kernel: a row of 64 16-bit channels, or half a
    # row of float32 ones under autocast)
    assert "static_assert(kRawBytes == kConvRawBytes" in text


def test_nchw_window_takes_what_its_kernel_runs():
    """_nchw_window_fits on CPU tensors: a contiguous 16-bit x with W a
    multiple of 8, 16-byte aligned, any C_in and C_out, KW up to
    NCHW_WINDOW_MAX_KW; nothing else."""
    def x(n=2, c=3, h=5, w=16, dtype=torch.bfloat16):
        return torch.empty(n, c, h, w, dtype=dtype)

    def wt(cout=5, cin=3, kh=3, kw=3, dtype=torch.bfloat16):
        return torch.empty(cout, cin, kh, kw, dtype=dtype)

    assert CB._nchw_window_fits(x(), wt())
    assert CB._nchw_window_fits(x(dtype=torch.float16, w=8),
                                wt(dtype=torch.float16, kw=CB.NCHW_WINDOW_MAX_KW))
    off_grid = torch.empty(1 + 2 * 3 * 5 * 16, dtype=torch.bfloat16)[1:].view(2, 3, 5, 16)
    for refused in ((x(dtype=torch.float32), wt()), (x(w=12), wt()), (off_grid, wt()),
                    (x().contiguous(memory_format=torch.channels_last), wt()),
                    (x(), wt(kw=CB.NCHW_WINDOW_MAX_KW + 1))):
        assert not CB._nchw_window_fits(*refused)


def test_nchw_window_launch(monkeypatch):
    """_launch_engine on an NCHW 16-bit x with no mask (CPU tensors,
    launches recorded): with C_in up to 64 and KH up to 3 the band kernel of
    its KW, a block per pixel tile up to the SM count, its stages' shared
    memory, the scalars in its order; with KH 4 (or C_in past 64) the NCHW
    window kernel; both with no copy of x, x's map as dims (W, H, C_in, N)
    with boxes of one row of WINDOW columns x 64 channels, unswizzled; the
    packed weight; y NCHW.  With a mask (training) or KW past the kernels',
    the copy and the per-tap kernel."""
    maps, packed, launched = _record_window_launches(monkeypatch)
    bf16 = torch.bfloat16
    x = torch.randn(2, 5, 9, 136, dtype=bf16)
    cb, b = torch.randn(33, dtype=bf16), torch.randn(33, dtype=bf16)
    for kh in (3, 4):
        maps.clear(), packed.clear(), launched.clear()
        wt = torch.randn(33, 5, kh, 4, dtype=bf16)
        y = CB._launch_engine(x, wt, cb, b, plan=(CB.NCHW, bf16, bf16, False))
        oh = 10 - kh
        assert y.shape == (2, 33, oh, 133) and y.is_contiguous()
        (fn, grid, block, args, shared), = launched
        assert block == gemm.HALF_THREADS
        assert maps == [(x.data_ptr(), (136, 9, 5, 2), (136, 9 * 136, 5 * 9 * 136), bf16,
                         (CB.WINDOW, 1, 64, 1), {"swizzle": False})]
        (a, rows), = packed
        assert rows == 64 and torch.equal(a, CB._packed_weight(wt, bf16)[0]) and a.shape == (33, kh * 4 * 64)
        scalars = (("map", 0), ("packed", 64), y.data_ptr(), cb.data_ptr(), b.data_ptr(), 2, 33, oh, 133, kh)
        pixel_tiles = 2 * ((oh + 1) // 2) * 2  # images x row pairs x column tiles
        if kh == 3:
            assert fn == ("nchw_band", bf16, 4) and grid == (pixel_tiles, 1, 1)
            assert shared == CB._band_shared_bytes(4, CB._band_stages(4)) and args == scalars
        else:
            # (one tile of C_out: as many tiles as pixel tiles)
            assert fn == ("nchw_window", bf16, 4) and grid == (pixel_tiles, 1, 1)
            assert shared == CB._nchw_window_shared_bytes(4, CB._nchw_window_raws(4))
            assert args == scalars + (1,)  # (and one block of input channels)
    # Under autocast: a float32 x (its map of float32) to a float32 y, the
    # weight packed in the autocast dtype.
    maps.clear(), packed.clear(), launched.clear()
    xf, cbf, bf = x.float(), cb.float(), b.float()
    wt = torch.randn(33, 5, 3, 3)
    y = CB._launch_engine(xf, wt, cbf, bf, plan=(CB.NCHW, bf16, torch.float32, False))
    assert y.dtype == torch.float32 and y.shape == (2, 33, 7, 134)
    (fn, grid, block, args, shared), = launched
    assert fn == ("nchw_band", bf16, 3, torch.float32) and grid == (16, 1, 1)
    assert shared == CB._band_shared_bytes(3, CB._band_stages(3))
    # (boxes of half a row: 32 float32 channels)
    assert maps == [(xf.data_ptr(), (136, 9, 5, 2), (136, 9 * 136, 5 * 9 * 136), torch.float32,
                     (CB.WINDOW, 1, 32, 1), {"swizzle": False})]
    assert torch.equal(packed[0][0], CB._packed_weight(wt, bf16)[0])
    assert args[2:] == (y.data_ptr(), cbf.data_ptr(), bf.data_ptr(), 2, 33, 7, 134, 3)
    # At most a block per SM where the pixel tiles outnumber the SMs.
    launched.clear()
    CB._launch_engine(torch.randn(200, 5, 9, 136, dtype=bf16), torch.randn(33, 5, 3, 4, dtype=bf16), cb, b,
                      plan=(CB.NCHW, bf16, bf16, False))
    assert launched[0][0][0] == "nchw_band" and launched[0][1] == (132, 1, 1)
    # More than 64 input channels: the NCHW window kernel.
    launched.clear()
    CB._launch_engine(torch.randn(2, 72, 9, 136, dtype=bf16), torch.randn(33, 72, 3, 4, dtype=bf16), cb, b,
                      plan=(CB.NCHW, bf16, bf16, False))
    assert launched[0][0] == ("nchw_window", bf16, 4) and launched[0][3][-1] == 2  # (two channel blocks)
    for wide, mask in ((False, torch.zeros(2 * 33 * 7 * 133 // 32 + 1, dtype=torch.int32)), (True, None)):
        launched.clear()
        weight = torch.randn(33, 5, 3, CB.NCHW_WINDOW_MAX_KW + 1 if wide else 4, dtype=bf16)
        CB._launch_engine(x, weight, cb, b, plan=(CB.NCHW, bf16, bf16, mask is not None), mask=mask)
        assert [launch[0][0] for launch in launched] == ["to_nhwc", "conv"]


def test_nhwc_band_fits():
    """_nhwc_band_fits on CPU tensors (a channels-last x that engine_layout
    takes): float32, C_in up to 64, KH up to 3, KW up to BAND_MAX_KW."""
    def x(c=8, dtype=torch.float32):
        return torch.empty(2, c, 5, 13, dtype=dtype).contiguous(memory_format=torch.channels_last)

    assert CB._nhwc_band_fits(x(), torch.empty(8, 8, 3, CB.BAND_MAX_KW))
    for refused in ((x(dtype=torch.bfloat16), torch.empty(8, 8, 3, 3)), (x(c=72), torch.empty(8, 72, 3, 3)),
                    (x(), torch.empty(8, 8, 4, 3)), (x(), torch.empty(8, 8, 3, CB.BAND_MAX_KW + 1))):
        assert not CB._nhwc_band_fits(*refused)


def test_amp_band_fits():
    """_amp_band_fits on CPU tensors: a contiguous float32 x with W a
    multiple of 4, 16-byte aligned, C_in up to 64, KH up to 3 and KW up to
    BAND_MAX_KW; nothing else."""
    def x(n=2, c=8, h=5, w=12, dtype=torch.float32):
        return torch.empty(n, c, h, w, dtype=dtype)

    def wt(cout=5, cin=8, kh=3, kw=3):
        return torch.empty(cout, cin, kh, kw)

    assert CB._amp_band_fits(x(), wt()) and CB._amp_band_fits(x(c=64, w=4), wt(cin=64, kh=1, kw=1))
    assert CB._amp_band_fits(x(), wt(kw=CB.BAND_MAX_KW))
    off_grid = torch.empty(1 + 2 * 8 * 5 * 12)[1:].view(2, 8, 5, 12)
    for refused in ((x(dtype=torch.bfloat16), wt()), (x(w=10), wt()), (off_grid, wt()),
                    (x().contiguous(memory_format=torch.channels_last), wt()),
                    (x(c=72), wt(cin=72)), (x(), wt(kh=4)), (x(w=16), wt(kw=CB.BAND_MAX_KW + 1))):
        assert not CB._amp_band_fits(*refused)


def test_nhwc_band_launch(monkeypatch):
    """_launch_engine on a channels-last float32 x under autocast's plan
    (CPU tensors, launches recorded): the channels-last band kernel of its
    KW, a block per pixel tile up to the SM count, its stages beside the
    window kernel's staging; x's map as dims (C_in, W, H, N) with boxes of
    32 channels x WINDOW columns, unswizzled; the weight packed in the
    autocast dtype; y's map as the window kernel's float32 y; the scalars in
    the kernel's order.  With KH 4, x's cast and the window kernel."""
    maps, packed, launched = _record_window_launches(monkeypatch)
    bf16, f32, cl = torch.bfloat16, torch.float32, torch.channels_last
    x = torch.randn(2, 8, 9, 136).contiguous(memory_format=cl)
    wt = torch.randn(40, 8, 3, 5)
    cb, b = torch.randn(40), torch.randn(40)
    y = CB._launch_engine(x, wt, cb, b, plan=(CB.CHANNELS_LAST, bf16, f32, False))
    assert y.dtype == f32 and y.shape == (2, 40, 7, 132) and y.is_contiguous(memory_format=cl)
    (fn, grid, block, args, shared), = launched
    stages = CB._band_stages(5, gemm.CONVERT_STAGING_BYTES)
    assert fn == ("nhwc_band", bf16, 5) and grid == (2 * 4 * 2, 1, 1) and block == gemm.HALF_THREADS
    assert shared == CB._band_shared_bytes(5, stages, gemm.CONVERT_STAGING_BYTES)
    assert CB.KERNELS.expressions[fn].endswith(f", 5, {stages}, {CB.BAND_RAWS}, {CB.BAND_WINDOWS}>")
    assert maps[0] == (x.data_ptr(), (8, 136, 9, 2), (8, 136 * 8, 9 * 136 * 8), f32, (32, CB.WINDOW, 1, 1),
                       {"swizzle": False})
    assert maps[1][0] == y.data_ptr() and maps[1][3] == f32 and maps[1][4] == (32, 64, 1, 1)
    assert torch.equal(packed[0][0], CB._packed_weight(wt, bf16)[0])
    assert args == (("map", 0), ("packed", 64), ("map", 1), cb.data_ptr(), b.data_ptr(), 2, 40, 7, 132, 3)
    launched.clear()
    CB._launch_engine(x, torch.randn(40, 8, 4, 5), cb, b, plan=(CB.CHANNELS_LAST, bf16, f32, False))
    assert [launch[0][0] for launch in launched] == ["window"]
    launched.clear()  # at most a block per SM where the pixel tiles outnumber the SMs
    CB._launch_engine(torch.randn(100, 8, 9, 136).contiguous(memory_format=cl), wt, cb, b,
                      plan=(CB.CHANNELS_LAST, bf16, f32, False))
    assert launched[0][0][0] == "nhwc_band" and launched[0][1] == (132, 1, 1)


def test_tf32_band_fits():
    """_tf32_band_fits on CPU tensors (a channels-last x that engine_layout
    takes): float32, C_in up to 64, KH up to 3, KW up to TF32_BAND_MAX_KW,
    C_out within _band_fits's bound; nothing else."""
    def x(c=8, dtype=torch.float32):
        return torch.empty(2, c, 5, 13, dtype=dtype).contiguous(memory_format=torch.channels_last)

    assert CB.TF32_BAND_MAX_KW >= 3  # (problem 1's kernel)
    assert CB._tf32_band_fits(x(), torch.empty(8, 8, 3, CB.TF32_BAND_MAX_KW))
    assert CB._tf32_band_fits(x(c=64), torch.empty(8, 64, 1, 1))
    for refused in ((x(dtype=torch.bfloat16), torch.empty(8, 8, 3, 3)), (x(c=72), torch.empty(8, 72, 3, 3)),
                    (x(), torch.empty(8, 8, 4, 3)), (x(), torch.empty(8, 8, 3, CB.TF32_BAND_MAX_KW + 1)),
                    (x(), torch.empty(64 * 2**18, 8, 1, 1, device="meta"))):
        assert not CB._tf32_band_fits(*refused)


def test_tf32_band_launch(monkeypatch):
    """_launch_engine on a channels-last float32 x the TF32 band kernel takes
    (CPU tensors, launches recorded): that kernel alone, no rounded copy,
    for its KW and mask, a block per pixel tile up to the SM count, its
    stages beside its staging (which fits the opt-in shared memory); x's map
    as the window kernel's (boxes of 32 channels x WINDOW columns), the
    weight packed as the TF32 window kernel's (Cpad a multiple of 32), y's
    map with boxes of 32 channels x TF32_BAND_STORE_COLUMNS; the scalars in
    the kernel's order.  In training, relu's mask from the same kernel, and
    nothing kept but x itself."""
    maps, packed, launched = _record_window_launches(monkeypatch)
    f32, cl = torch.float32, torch.channels_last
    x = torch.randn(2, 40, 9, 140).contiguous(memory_format=cl)
    wt = torch.randn(64, 40, 3, 3)
    cb, b = torch.randn(64), torch.randn(64)
    y = CB._launch_engine(x, wt, cb, b, plan=(CB.CHANNELS_LAST, f32, f32, False))
    assert y.shape == (2, 64, 7, 138) and y.dtype == f32 and y.is_contiguous(memory_format=cl)
    (fn, grid, block, args, shared), = launched
    stages = CB._tf32_band_stages(3)
    assert fn == ("tf32_band", 3, False) and grid == (2 * 4 * 2, 1, 1) and block == gemm.HALF_THREADS
    assert stages == 3 and shared == CB._tf32_band_shared_bytes(3, stages) <= CB._OPT_IN_SHARED_BYTES
    assert CB.KERNELS.expressions[fn] == (f"cf::conv_bias_relu_tf32_band<3, {stages}, {CB.BAND_WINDOWS}, "
                                          "false>")
    assert [m[1:] for m in maps] == [
        ((40, 140, 9, 2), (40, 140 * 40, 9 * 140 * 40), f32, (32, CB.WINDOW, 1, 1)),
        ((64, 138, 7, 2), (64, 138 * 64, 7 * 138 * 64), f32, (32, CB.TF32_BAND_STORE_COLUMNS, 1, 1))]
    assert maps[0][0] == x.data_ptr() and maps[1][0] == y.data_ptr()
    (a, rows), = packed
    assert rows == 64 and torch.equal(a, CB._packed_weight(wt, f32)[0]) and a.shape == (64, 3 * 3 * 64)
    assert args == (("map", 0), ("packed", 64), ("map", 1), 0, cb.data_ptr(), b.data_ptr(), 2, 64, 7, 138, 3,
                    2)  # c_blocks: 64 / 32
    launched.clear()
    y, mask, xc = CB._train_forward(x, wt, cb, b, f32, f32)
    assert xc.numel() == 0 and [entry[0] for entry in launched] == [("tf32_band", 3, True)]
    assert launched[0][3][3] == mask.data_ptr()
    launched.clear()  # at most a block per SM where the pixel tiles outnumber the SMs
    CB._launch_engine(torch.randn(100, 40, 9, 140).contiguous(memory_format=cl), wt, cb, b,
                      plan=(CB.CHANNELS_LAST, f32, f32, False))
    assert launched[0][0] == ("tf32_band", 3, False) and launched[0][1] == (132, 1, 1)


def test_band_fits():
    """The band kernel takes one block of 64 input channels, a pixel tile's
    KH + 1 rows within BAND_WINDOWS, KW up to BAND_MAX_KW, and output
    channels whose window barriers' count (4 arrives per tile of 64) stays
    below an mbarrier's 2^20; nothing else."""
    assert CB._band_fits(64, 128, CB.BAND_WINDOWS - 1, CB.BAND_MAX_KW) and CB._band_fits(8, 5, 1, 1)
    assert CB._band_fits(8, 64 * (2**18 - 1), 3, 3)
    assert not CB._band_fits(8, 64 * 2**18, 3, 3)
    assert not CB._band_fits(72, 128, 3, 3)
    assert not CB._band_fits(64, 128, CB.BAND_WINDOWS, 3)
    assert not CB._band_fits(64, 128, 3, CB.BAND_MAX_KW + 1)


def test_dgrad_takes_what_its_kernel_runs(monkeypatch):
    """_dgrad_on_engine on CPU tensors (a Hopper GPU assumed): a 16-bit
    channels-last dz, or a float32 one its caller rounded to TF32 while
    TF32 is allowed, with C_in and C_out multiples of 8 and KW up to
    WINDOW_MAX_KW, and nothing else."""
    monkeypatch.setattr(gemm, "has_wgmma", lambda index: True)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    cl = torch.channels_last

    def dz(n=2, c=16, h=5, w=6, dtype=torch.bfloat16, fmt=cl):
        return torch.empty(n, c, h, w, dtype=dtype).contiguous(memory_format=fmt)

    def wt(cout=16, cin=8, kh=3, kw=3, dtype=torch.bfloat16):
        return torch.empty(cout, cin, kh, kw, dtype=dtype)

    assert CB._dgrad_on_engine(dz(), wt())
    assert CB._dgrad_on_engine(dz(dtype=torch.float16), wt(dtype=torch.float16, kw=CB.WINDOW_MAX_KW))
    assert CB._dgrad_on_engine(dz(h=1, w=1), wt())  # a 1 x 1 dz: both layouts at once
    for refused in ((dz(dtype=torch.float32), wt()), (dz(fmt=torch.contiguous_format), wt()),
                    (dz(c=12), wt(cout=12)), (dz(), wt(cin=12)), (dz(), wt(kw=CB.WINDOW_MAX_KW + 1)),
                    (dz(n=0), wt())):
        assert not CB._dgrad_on_engine(*refused)
    f32 = torch.float32
    assert CB._dgrad_on_engine(dz(dtype=f32), wt(dtype=f32), tf32_dz=True)
    assert CB._dgrad_on_engine(dz(dtype=f32, c=40), wt(dtype=f32, cout=40, cin=24), tf32_dz=True)
    for refused in ((dz(dtype=f32, fmt=torch.contiguous_format), wt(dtype=f32)),
                    (dz(dtype=f32, c=12), wt(dtype=f32, cout=12)),
                    (dz(dtype=f32), wt(dtype=f32, kw=CB.WINDOW_MAX_KW + 1))):
        assert not CB._dgrad_on_engine(*refused, tf32_dz=True)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # the reference's dgrad in float32
    assert not CB._dgrad_on_engine(dz(dtype=f32), wt(dtype=f32), tf32_dz=True)
    assert CB._dgrad_on_engine(dz(), wt(), tf32_dz=True)  # (16-bit: the flag plays no part)
    monkeypatch.setattr(gemm, "has_wgmma", lambda index: False)
    assert not CB._dgrad_on_engine(dz(), wt())


def _record_window_launches(monkeypatch):
    """Stubs for the window kernels' launches on CPU tensors: returns the
    lists the tensor maps (ptr, dims, strides, dtype, box), the packed
    weights (tensor, box rows) and the launches (kernel key, grid, block,
    args, shared memory) are recorded into, instead of made."""
    from cupy_fused import _bridge

    maps, packed, launched = [], [], []
    monkeypatch.setattr(CB, "sm_count", lambda dev: 132)
    monkeypatch.setattr(CB.KERNELS, "get", lambda key, dev: key)
    monkeypatch.setattr(gemm, "_encode_tensor_map",
                        lambda *a, **k: maps.append(a + ((k,) if k else ())) or ("map", len(maps) - 1))
    monkeypatch.setattr(gemm, "_tensor_map", lambda t, rows: packed.append((t, rows)) or ("packed", rows))
    monkeypatch.setattr(_bridge, "launch", lambda fn, grid, block, args, dev, shared_mem=0:
                        launched.append((fn, grid, block, args, shared_mem)))
    return maps, packed, launched


@pytest.mark.parametrize("with_mask", [False, True], ids=["inference", "training"])
def test_window_forward_launch(with_mask, monkeypatch):
    """_launch_engine on a channels-last 16-bit x (CPU tensors, launches
    recorded): the window kernel of its KW and mask, at most a block per
    SM, its stages' shared memory; x's map with boxes of WINDOW columns,
    y's [N, OH, OW, C_out] with rows of 128; the weight packed as
    [C_out, KH * KW * Cpad]; the scalars in the kernel's order.  A kernel
    wider than WINDOW_MAX_KW takes the per-tap kernel."""
    maps, packed, launched = _record_window_launches(monkeypatch)
    bf16, cl = torch.bfloat16, torch.channels_last
    x = torch.randn(2, 72, 9, 140, dtype=bf16).contiguous(memory_format=cl)
    wt = torch.randn(64, 72, 3, 5, dtype=bf16)
    cb, b = torch.randn(64, dtype=bf16), torch.randn(64, dtype=bf16)
    mask = torch.empty(2 * 64 * 7 * 136 // 32, dtype=torch.int32) if with_mask else None
    y = CB._launch_engine(x, wt, cb, b, plan=(CB.CHANNELS_LAST, bf16, bf16, with_mask), mask=mask)
    assert y.shape == (2, 64, 7, 136) and y.is_contiguous(memory_format=cl)
    (fn, grid, block, args, shared), = launched
    assert fn == ("window", bf16, 5, with_mask) and block == gemm.HALF_THREADS
    assert grid == (1 * 2 * 4 * 2, 1, 1) and shared == CB._window_shared_bytes(5)
    assert maps == [
        (x.data_ptr(), (72, 140, 9, 2), (72, 140 * 72, 9 * 140 * 72), bf16, (64, CB.WINDOW, 1, 1)),
        (y.data_ptr(), (64, 136, 7, 2), (64, 136 * 64, 7 * 136 * 64), bf16, (64, 128, 1, 1))]
    (a, rows), = packed
    assert rows == 64 and torch.equal(a, CB._packed_weight(wt, bf16)[0]) and a.shape == (64, 3 * 5 * 128)
    assert args[:3] == (("map", 0), ("packed", 64), ("map", 1))
    assert args[3:] == (mask.data_ptr() if with_mask else 0, cb.data_ptr(), b.data_ptr(), 2, 64, 7, 136, 3, 2)
    # Wider than the window takes: the engine's per-tap kernel.
    launched.clear()
    wide = torch.randn(64, 72, 3, CB.WINDOW_MAX_KW + 1, dtype=bf16)
    CB._launch_engine(x, wide, cb, b, plan=(CB.CHANNELS_LAST, bf16, bf16, False))
    assert launched[0][0][0] == "conv"


def test_channels_last_autocast_launch(monkeypatch):
    """_launch_engine on a channels-last float32 x under autocast to
    bfloat16 with float32 biases (CPU tensors, launches recorded): x's cast
    to bfloat16 read by the window kernel with a float32 y (its
    instantiation with Out = float), y float32 channels-last through boxes
    of 32 channels x 64 pixels; in training, relu's mask from the same
    kernel, and the cast is what the forward keeps for the backward.  A
    kernel wider than the window takes: the per-tap kernel with the float32
    channels-last store, boxes of 32 channels x 128 pixels."""
    maps, packed, launched = _record_window_launches(monkeypatch)
    bf16, f32, cl = torch.bfloat16, torch.float32, torch.channels_last
    x = torch.randn(2, 72, 9, 140).contiguous(memory_format=cl)
    wt = torch.randn(64, 72, 3, 5)
    cb, b = torch.randn(64), torch.randn(64)
    y = CB._launch_engine(x, wt, cb, b, plan=(CB.CHANNELS_LAST, bf16, f32, False))
    assert y.shape == (2, 64, 7, 136) and y.dtype == f32 and y.is_contiguous(memory_format=cl)
    (fn, grid, block, args, shared), = launched
    assert fn == ("window", bf16, 5, False, f32) and shared == CB._window_shared_bytes(5)
    assert grid == (1 * 2 * 4 * 2, 1, 1) and block == gemm.HALF_THREADS
    assert [m[1:] for m in maps] == [
        ((72, 140, 9, 2), (72, 140 * 72, 9 * 140 * 72), bf16, (64, CB.WINDOW, 1, 1)),
        ((64, 136, 7, 2), (64, 136 * 64, 7 * 136 * 64), f32, (32, 64, 1, 1))]
    assert maps[0][0] != x.data_ptr() and maps[1][0] == y.data_ptr()  # the cast, then y
    (a, rows), = packed
    assert rows == 64 and torch.equal(a, CB._packed_weight(wt, bf16)[0])
    assert args[3:] == (0, cb.data_ptr(), b.data_ptr(), 2, 64, 7, 136, 3, 2)
    # Training: the cast kept for the backward, relu's mask filled by the store.
    launched.clear()
    y, mask, xc = CB._train_forward(x, wt, cb, b, bf16, f32)
    assert xc.dtype == bf16 and xc.is_contiguous(memory_format=cl) and torch.equal(xc, x.to(bf16))
    (fn, _, _, args, _), = launched
    assert fn == ("window", bf16, 5, True, f32) and args[3] == mask.data_ptr()
    # Wider than the window takes: the per-tap kernel, y through NhwcStoreF32.
    maps.clear()
    packed.clear()
    launched.clear()
    wide = torch.randn(64, 72, 3, CB.WINDOW_MAX_KW + 1)
    y = CB._launch_engine(x, wide, cb, b, plan=(CB.CHANNELS_LAST, bf16, f32, False))
    (fn, grid, block, args, shared), = launched
    assert fn == ("conv", bf16, CB.CHANNELS_LAST, f32, False) and shared == CB.SHARED_BYTES[CB.CHANNELS_LAST]
    ow = 140 - CB.WINDOW_MAX_KW
    assert [m[1:] for m in maps] == [
        ((72, 140, 9, 2), (72, 140 * 72, 9 * 140 * 72), bf16, (64, 128, 1, 1)),
        ((64, ow, 14), (64, ow * 64), f32, (32, 128, 1))]


def test_channels_last_float32_launch(monkeypatch):
    """_launch_engine on a channels-last float32 x (CPU tensors, launches
    recorded): x's copy rounded to TF32 (round_to_tf32, 4 vectors of 4
    values a thread), then the window kernel's TF32 form on that copy
    (windows of 32 channels, A packed with Cpad a multiple of 32), y
    through boxes of 32 channels x 64 pixels; in training, relu's mask from
    the same kernel, and nothing kept but x itself (the backward's cuDNN
    reads x).  A kernel wider than the window takes: the per-tap kernel
    with the float32 channels-last store."""
    maps, packed, launched = _record_window_launches(monkeypatch)
    f32, cl = torch.float32, torch.channels_last
    x = torch.randn(2, 72, 9, 140).contiguous(memory_format=cl)
    wt = torch.randn(64, 72, 3, 5)
    cb, b = torch.randn(64), torch.randn(64)
    y = CB._launch_engine(x, wt, cb, b, plan=(CB.CHANNELS_LAST, f32, f32, False))
    assert y.shape == (2, 64, 7, 136) and y.dtype == f32 and y.is_contiguous(memory_format=cl)
    (rfn, rgrid, rblock, rargs, _), (fn, grid, block, args, shared) = launched
    vecs = x.numel() // 4
    assert rfn == ("round_tf32",) and rgrid == (-(-vecs // (4 * 256)), 1, 1) and rblock == 256
    assert rargs[0] == x.data_ptr() and rargs[1] != x.data_ptr() and rargs[2] == vecs
    assert fn == ("window", f32, 5, False, f32) and shared == CB._window_shared_bytes(5)
    assert grid == (1 * 2 * 4 * 2, 1, 1) and block == gemm.HALF_THREADS
    assert [m[1:] for m in maps] == [
        ((72, 140, 9, 2), (72, 140 * 72, 9 * 140 * 72), f32, (32, CB.WINDOW, 1, 1)),
        ((64, 136, 7, 2), (64, 136 * 64, 7 * 136 * 64), f32, (32, 64, 1, 1))]
    assert maps[0][0] == rargs[1] and maps[1][0] == y.data_ptr()  # the rounded copy, then y
    (a, rows), = packed
    assert rows == 64 and torch.equal(a, CB._packed_weight(wt, f32)[0]) and a.shape == (64, 3 * 5 * 96)
    assert args[3:] == (0, cb.data_ptr(), b.data_ptr(), 2, 64, 7, 136, 3, 3)  # c_blocks: 96 / 32
    launched.clear()
    y, mask, xc = CB._train_forward(x, wt, cb, b, f32, f32)
    assert xc.numel() == 0
    assert [entry[0] for entry in launched] == [("round_tf32",), ("window", f32, 5, True, f32)]
    assert launched[1][3][3] == mask.data_ptr()
    # Wider than the window takes: the per-tap kernel, y through NhwcStoreF32.
    maps.clear()
    packed.clear()
    launched.clear()
    wide = torch.randn(64, 72, 3, CB.WINDOW_MAX_KW + 1)
    y = CB._launch_engine(x, wide, cb, b, plan=(CB.CHANNELS_LAST, f32, f32, False))
    assert [entry[0] for entry in launched] == [("round_tf32",), ("conv", f32, CB.CHANNELS_LAST, f32, False)]
    assert launched[1][4] == CB.SHARED_BYTES[CB.CHANNELS_LAST]
    ow = 140 - CB.WINDOW_MAX_KW
    assert [m[1:] for m in maps] == [
        ((72, 140, 9, 2), (72, 140 * 72, 9 * 140 * 72), f32, (32, 128, 1, 1)),
        ((64, ow, 14), (64, ow * 64), f32, (32, 128, 1))]


@pytest.mark.parametrize("dtype, dx_dtype", [(torch.float16, None), (torch.float16, torch.float32),
                                             (torch.float32, torch.float32)], ids=str)
def test_dgrad_launch(dtype, dx_dtype, monkeypatch):
    """_launch_dgrad on CPU tensors (launches recorded): the kernel of its
    dtype and KW (keyed with float32 last for a float32 dx: autocast's from
    a 16-bit dz, or TF32's), dz's map with boxes of a k-tile's channels (64
    16-bit, 32 float32) x WINDOW columns, dx [N, H, W, C_in] channels-last
    with boxes of 64 channels x 128 columns (float32: 32 x 64), and A = the
    weight with its taps flipped and its channels swapped (float32: rounded
    to TF32), [C_in, KH * KW * Cpad] with Wf[ci, (kh KW + kw) Cpad + co] =
    W[co, ci, KH-1-kh, KW-1-kw], C_out padded with zeros to a k-tile; a
    dx_dtype other than dz's or float32 refused."""
    maps, packed, launched = _record_window_launches(monkeypatch)
    dz = torch.randn(2, 24, 7, 136, dtype=dtype).contiguous(memory_format=torch.channels_last)
    wt = torch.randn(24, 72, 3, 5, dtype=dtype)
    dx = CB._launch_dgrad(dz, wt, dx_dtype)
    out = dx_dtype or dtype
    assert dx.dtype == out and dx.shape == (2, 72, 9, 140)
    assert dx.is_contiguous(memory_format=torch.channels_last)
    (fn, grid, block, args, shared), = launched
    assert fn == ("dgrad", dtype, 5) + ((dx_dtype,) if dx_dtype else ())
    assert grid == (2 * 2 * 5 * 2, 1, 1) and shared == CB._window_shared_bytes(5)
    box_k = 32 if dtype == torch.float32 else 64
    assert maps == [
        (dz.data_ptr(), (24, 136, 7, 2), (24, 136 * 24, 7 * 136 * 24), dtype, (box_k, CB.WINDOW, 1, 1)),
        (dx.data_ptr(), (72, 140, 9, 2), (72, 140 * 72, 9 * 140 * 72), out,
         (32, 64, 1, 1) if out == torch.float32 else (64, 128, 1, 1))]
    assert args == (("map", 0), ("packed", 64), ("map", 1), 2, 72, 9, 140, 3, 1)
    (a, rows), = packed
    assert rows == 64 and a.shape == (72, 3 * 5 * box_k) and a.dtype == dtype
    a = a.reshape(72, 3, 5, box_k)
    want = CB._tf32(wt) if dtype == torch.float32 else wt
    for co, ci, kh, kw in ((0, 0, 0, 0), (23, 71, 2, 4), (5, 40, 1, 3), (17, 3, 2, 0)):
        assert a[ci, kh, kw, co] == want[co, ci, 2 - kh, 4 - kw]
    assert not a[:, :, :, 24:].any()
    with pytest.raises(ValueError, match="dx_dtype"):
        CB._launch_dgrad(dz, wt, torch.bfloat16 if dtype == torch.float16 else torch.float16)


def test_wgrad_launch(monkeypatch):
    """_launch_wgrad on CPU tensors (launches recorded): the kernel of its
    dtype and blocks a tile (_wgrad_blocks), at most a block per SM, its
    stages' shared memory; dz's map [N, OH, OW, C_out] with boxes of 64
    channels x 64 columns, and one map of x per tap kw, from x's column kw
    on (its pointer kw C_in values on), OW columns wide, the unused taps'
    parameters the first map again; the float32 partials as the runs and
    tiles need them; then the reduction, a thread per column of the
    partials' rows of C_out, into dw [C_out, C_in, KH, KW] of dz's dtype."""
    maps, _, launched = _record_window_launches(monkeypatch)
    n, cin, oh, ow, cout, kh, kw = 2, 72, 7, 130, 24, 3, 5
    dz = torch.randn(n, cout, oh, ow, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
    x = torch.randn(n, cin, oh + kh - 1, ow + kw - 1,
                    dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
    dw = CB._launch_wgrad(dz, x, kh, kw)
    assert dw.shape == (cout, cin, kh, kw) and dw.dtype == torch.bfloat16 and dw.is_contiguous()
    (fn, grid, block, args, shared), (rfn, rgrid, rblock, rargs, rshared) = launched
    cols = kh * kw * 2  # two blocks of 64 input channels a tap
    tb = CB._wgrad_blocks(cols)
    col_tiles = -(-cols // tb)
    runs, per_run = CB._wgrad_runs(col_tiles, n * oh * 3, 132)
    assert fn == ("wgrad", torch.bfloat16, tb) and block == 384
    assert grid == (min(col_tiles * runs, 132), 1, 1)
    assert shared == gemm._half_shared_bytes(0, CB._wgrad_stages(tb), CB._wgrad_stage_bytes(tb))
    h, w = oh + kh - 1, ow + kw - 1
    assert maps[0] == (dz.data_ptr(), (cout, ow, oh, n), (cout, ow * cout, oh * ow * cout), torch.bfloat16,
                       (64, 64, 1, 1))
    assert maps[1:] == [(x.data_ptr() + 2 * j * cin, (cin, ow, h, n), (cin, w * cin, h * w * cin),
                         torch.bfloat16, (64, 64, 1, 1)) for j in range(kw)]
    assert args[:8] == (("map", 0), *[("map", j) for j in range(1, kw + 1)], ("map", 1), ("map", 1))
    assert args[9:] == (cout, cols, kw, 2, oh, 3, runs, per_run)
    npad = 64 * tb * col_tiles
    assert rfn == ("wgrad_reduce", torch.bfloat16) and rblock == CB.BLOCK and rshared == 0
    assert rgrid == (-(-cout * npad // CB.BLOCK), 1, 1)
    assert rargs[0] == args[8] and rargs[1:] == (dw.data_ptr(), runs, 128, npad, cout, cin, kh, kw, 2)


def test_wgrad_tiles():
    """The weight gradient's tiles: _wgrad_blocks takes the fewest boxes a
    k-tile over all tiles, then the fewest blocks past the last;
    _wgrad_runs fills the SMs once with runs of at least WGRAD_MIN_RUN
    k-tiles (where there are that many), none empty, every k-tile in one."""
    assert [CB._wgrad_blocks(c) for c in (1, 2, 3, 4, 5, 9, 25, 196)] == [1, 2, 3, 4, 3, 3, 4, 4]
    for cols in range(1, 40):
        tb = CB._wgrad_blocks(cols)
        boxes = -(-cols // tb) * (2 + tb)
        assert all(boxes <= -(-cols // other) * (2 + other) for other in range(1, 5))
    for out_tiles, k_tiles, sms in ((3, 32256, 132), (1, 1, 132), (5, 40, 132), (200, 10**6, 132),
                                    (7, 17, 16), (2, 10**5, 1)):
        runs, per_run = CB._wgrad_runs(out_tiles, k_tiles, sms)
        assert runs >= 1 and runs * per_run >= k_tiles > (runs - 1) * per_run
        assert runs * out_tiles <= max(sms, out_tiles)
        assert per_run >= min(k_tiles, CB.WGRAD_MIN_RUN)
    assert CB._wgrad_runs(3, 32256, 132) == (44, 734)


def test_wgrad_takes_what_its_kernel_runs(monkeypatch):
    """_wgrad_fits on CPU tensors (a Hopper GPU assumed): dz and x of one
    16-bit dtype, channels-last and 16-byte aligned, x the convolution's
    input for dz's size and the weight's, C_in and C_out multiples of 8, KW
    up to WGRAD_MAX_KW, nothing empty; nothing else.  _wgrad_on_engine:
    that, where _wgrad_pays (C_out a multiple of 128, output rows filling
    85% of their 64-column k-tiles)."""
    monkeypatch.setattr(gemm, "has_wgmma", lambda index: True)
    cl = torch.channels_last

    def case(n=2, cin=8, cout=16, oh=5, ow=6, kh=3, kw=3, dtype=torch.bfloat16, x_dtype=None, fmt=cl,
             x_fmt=cl, x_w=None, offset=0):
        dz = torch.empty(n, cout, oh, ow, dtype=dtype).contiguous(memory_format=fmt)
        h, w = oh + kh - 1, x_w or ow + kw - 1
        base = torch.empty(n * cin * h * w + 8, dtype=x_dtype or dtype)[offset:offset + n * cin * h * w]
        x = base.view(n, h, w, cin).permute(0, 3, 1, 2)
        if x_fmt != cl:
            x = x.contiguous()
        return dz, x, torch.empty(cout, cin, kh, kw, dtype=dtype)

    assert CB._wgrad_fits(*case())
    assert CB._wgrad_fits(*case(dtype=torch.float16, kw=CB.WGRAD_MAX_KW, kh=1))
    assert CB._wgrad_fits(*case(oh=1, ow=1))
    for refused in (case(dtype=torch.float32), case(x_dtype=torch.float16), case(fmt=torch.contiguous_format),
                    case(x_fmt=torch.contiguous_format), case(cout=12), case(cin=12),
                    case(kw=CB.WGRAD_MAX_KW + 1), case(n=0), case(x_w=9), case(offset=1)):
        assert not CB._wgrad_fits(*refused)
    assert not CB._wgrad_on_engine(*case())  # (16 channels, rows of 6 columns)
    assert CB._wgrad_on_engine(*case(cout=128, ow=126, oh=1))
    for pays, cout, ow in ((True, 256, 56), (True, 128, 64), (True, 384, 120), (False, 64, 126),
                           (False, 136, 126), (False, 128, 96), (False, 128, 7), (False, 128, 48),
                           (True, 128, 55), (False, 128, 54), (True, 128, 109), (False, 128, 108)):
        assert CB._wgrad_pays(cout, ow) == pays, (cout, ow)
        assert CB._wgrad_on_engine(*case(cout=cout, ow=ow, oh=1)) == pays
    # 32-bit counts: a block's k-tiles (out tiles x k-tiles), the images past the last.
    meta = dict(device="meta", dtype=torch.bfloat16)
    dz = torch.empty(150264, 10240, 16, 1, **meta).contiguous(memory_format=cl)
    x = torch.empty(150264, 8, 16 + 6143, 3, **meta).contiguous(memory_format=cl)
    assert not CB._wgrad_fits(dz, x, torch.empty(10240, 8, 6144, 3, **meta))
    dz = torch.empty(2**30, 8, 1, 1, **meta).contiguous(memory_format=cl)  # one tile, 2^30 k-tiles
    x = torch.empty(2**30, 8, 1, 1, **meta).contiguous(memory_format=cl)
    assert not CB._wgrad_fits(dz, x, torch.empty(8, 8, 1, 1, **meta))  # (1 + 1) 2^30: at the bound
    assert CB._wgrad_fits(dz[1:], x[1:], torch.empty(8, 8, 1, 1, **meta))
    monkeypatch.setattr(gemm, "has_wgmma", lambda index: False)
    assert not CB._wgrad_fits(*case())


@pytest.mark.gpu
def test_dgrad_route(device, monkeypatch):
    """The engine's training backward takes conv_dgrad_wgmma for its input
    gradient where _dgrad_on_engine holds and conv_wgrad_wgmma for its
    weight gradient where _wgrad_on_engine holds (16-bit: cuDNN for a
    float32 weight gradient), cuDNN for both elsewhere."""
    _engine_device(device)
    _lift_engine_thresholds(monkeypatch)
    calls = []
    real_dgrad, real_wgrad, real_conv = CB._launch_dgrad, CB._launch_wgrad, CB._conv_backward
    monkeypatch.setattr(CB, "_launch_dgrad",
                        lambda dz, wt, *a: calls.append(("ours", dz.dtype, *a)) or real_dgrad(dz, wt, *a))
    monkeypatch.setattr(CB, "_launch_wgrad",
                        lambda dz, x, *a: calls.append(("wgrad", dz.dtype, x.dtype)) or real_wgrad(dz, x, *a))
    monkeypatch.setattr(CB, "_conv_backward",
                        lambda dz, x, wt, want_x, want_w: calls.append(("cudnn", want_x, want_w))
                        or real_conv(dz, x, wt, want_x, want_w))
    both = [("cudnn", True, True)]

    def ours(dz_dtype, dx_dtype):  # (the weight gradient first: x's copy is freed before dx is made)
        w = ("cudnn", False, True) if dz_dtype == torch.float32 else ("wgrad", dz_dtype, dz_dtype)
        return [w, ("ours", dz_dtype, dx_dtype)]

    bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32
    # (x's dtype, channels-last x, KW, autocast, TF32 allowed in the backward, the calls)
    for dtype, channels_last, kw, amp, tf32, expect in (
            (bf16, True, 3, None, True, ours(bf16, bf16)), (f16, False, 3, None, True, ours(f16, f16)),
            (f32, False, 3, None, True, ours(f32, f32)), (f32, True, 3, None, True, ours(f32, f32)),
            # TF32 turned off after the forward: cuDNN's float32 backward
            (f32, True, 3, None, False, both),
            # Under autocast: a channels-last x's dx float32 from the
            # kernel, an NCHW one's in the product's dtype (cast after its copy back)
            (f32, True, 3, bf16, True, ours(bf16, f32)), (f32, False, 3, f16, True, ours(f16, f16)),
            (bf16, True, CB.WINDOW_MAX_KW + 1, None, True, both)):
        calls.clear()
        gen, x, wt, cb, g = _small_training_operands(channels_last, 5, device, dtype)
        if kw != 3:
            wt = torch.randn(32, 8, 3, kw, generator=gen).to(device, dtype) / 8
            g = g[..., :x.shape[3] - kw + 1].contiguous(memory_format=torch.channels_last)
        leaves = [t.detach().clone().requires_grad_(True) for t in (x, wt, cb)]
        with torch.autocast("cuda", dtype=amp or bf16, enabled=amp is not None):
            assert CB.route(*leaves, None) == "engine"
            y = ops.conv_bias_relu(*leaves)
        torch.backends.cudnn.allow_tf32 = tf32  # (restored by monkeypatch)
        y.backward(g)
        torch.backends.cudnn.allow_tf32 = True
        assert calls == expect, (dtype, channels_last, kw, amp, tf32, calls)
        assert leaves[0].grad.dtype == dtype
    # Without a weight gradient, no cuDNN call at all.
    calls.clear()
    _, x, wt, cb, g = _small_training_operands(False, 6, device)
    xl = x.detach().clone().requires_grad_(True)
    ops.conv_bias_relu(xl, wt, cb.detach().clone().requires_grad_(True)).backward(g)
    assert calls == [("ours", torch.bfloat16, torch.bfloat16)]


def _small_training_operands(channels_last, seed, device, dtype=torch.bfloat16):
    """(the generator, seeded, for more draws; x [2, 8, 9, 70] NCHW or
    channels-last, weight [32, 8, 3, 3], conv_bias [32], g [2, 32, 7, 68]
    in x's layout), in ``dtype`` on ``device``."""
    gen = torch.Generator().manual_seed(seed)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.randn(2, 8, 9, 70, generator=gen).to(device, dtype).contiguous(memory_format=fmt)
    wt = (torch.randn(32, 8, 3, 3, generator=gen) / 72 ** 0.5).to(device, dtype)
    cb = torch.randn(32, generator=gen).to(device, dtype)
    g = torch.randn(2, 32, 7, 68, generator=gen).to(device, dtype).contiguous(memory_format=fmt)
    return gen, x, wt, cb, g


@pytest.mark.gpu
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
def test_engine_training_one_value_bias(channels_last, device, monkeypatch):
    """A bias of one value for every channel on the engine's training
    route: y bitwise that of the value spread over the channels, and its
    gradient the whole sum of the spread one's gradient (whose channels
    are each rounded once, as the whole sum is)."""
    _engine_device(device)
    monkeypatch.setattr(CB, "ENGINE_TRAINING_MIN_ELEMENTS", 0)
    gen, x, wt, cb, g = _small_training_operands(channels_last, 4, device)
    one = torch.randn(1, generator=gen).to(device, torch.bfloat16)
    results = []
    for b in (one, one.expand(32).contiguous()):
        leaves = [t.detach().clone().requires_grad_(True) for t in (x, wt, cb, b)]
        assert CB.route(*leaves) == "engine"
        y = ops.conv_bias_relu(*leaves)
        y.backward(g)
        results.append((y, leaves[3].grad))
    (y1, g1), (yc, gc) = results
    assert torch.equal(y1, yc) and g1.shape == (1,)
    whole = gc.double().sum()
    bound = torch.finfo(torch.bfloat16).eps * (whole.abs() + gc.double().abs().sum())
    assert (g1.double() - whole).abs() <= bound


@pytest.mark.gpu
@pytest.mark.parametrize("channels_last, dtype, amp",
                         [(False, torch.bfloat16, False), (True, torch.bfloat16, False),
                          (False, torch.float32, False), (True, torch.float32, False),
                          (False, torch.float32, True), (True, torch.float32, True)],
                         ids=["nchw-bf16", "channels_last-bf16", "nchw-float32", "channels_last-float32",
                              "nchw-amp", "channels_last-amp"])
def test_engine_training_frees_the_mask_before_the_products(channels_last, dtype, amp, device,
                                                            monkeypatch):
    """The eager node keeps relu's mask for one use: freed once dz exists,
    before the weight gradient (cuDNN's or ours) runs; and a leaf x's
    channels-last copy or cast (an NCHW x's, an autocast's) for one use:
    freed once the weight gradient has read it, before our input gradient
    makes dx (the rest of
    that bookkeeping: test_engine_training_node_keeps_a_leaf_copy_for_one_use).
    A second backward through a retained graph makes both again, with the
    same gradients, and refuses a bias changed in place since the forward;
    biases made in inference mode (no version counter) train as the
    reference's do."""
    _engine_device(device)
    _lift_engine_thresholds(monkeypatch)  # small sizes, float32 (TF32) too
    gen, x, wt, cb, g = _small_training_operands(channels_last, 6, device, dtype)
    b = torch.randn(32, generator=gen).to(device, dtype)

    def forward(cb=cb, b=b):
        leaves = [t.detach().clone().requires_grad_(True) for t in (x, wt, cb, b)]
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            assert CB.route(*leaves) == "engine"
            return ops.conv_bias_relu(*leaves), leaves

    y, leaves = forward()
    mask = weakref.ref(y.grad_fn.kept_mask)
    # A copy of x where the forward made one (NCHW, or a cast), x itself otherwise.
    copy = not channels_last or amp
    assert hasattr(y.grad_fn, "kept_xc") == copy
    xc = weakref.ref(y.grad_fn.kept_xc) if copy else (lambda: None)
    alive_at_products, alive_at_dgrad = [], []
    conv_backward, dgrad, wgrad = CB._conv_backward, CB._launch_dgrad, CB._launch_wgrad

    def watched(product):
        def run(*args):
            alive_at_products.append(mask() is not None)
            return product(*args)
        return run

    def watched_dgrad(*args):
        alive_at_dgrad.append(xc() is not None)
        return dgrad(*args)

    monkeypatch.setattr(CB, "_conv_backward", watched(conv_backward))
    monkeypatch.setattr(CB, "_launch_wgrad", watched(wgrad))
    monkeypatch.setattr(CB, "_launch_dgrad", watched_dgrad)
    y.backward(g, retain_graph=True)
    assert alive_at_products == [False] and y.grad_fn.kept_mask is None
    assert alive_at_dgrad == [False] and getattr(y.grad_fn, "kept_xc", None) is None
    first = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    y.backward(g)  # recomputes the mask and the copy
    assert all(torch.equal(t.grad, f) for t, f in zip(leaves, first))
    assert (y == b.view(1, -1, 1, 1)).any() and (y != b.view(1, -1, 1, 1)).any()  # both sides of relu
    for name, i in (("conv_bias", 2), ("bias", 3)):
        y, leaves = forward()
        y.backward(g, retain_graph=True)
        with torch.no_grad():
            leaves[i].add_(1.0)  # a recomputed mask would not be y's
        with pytest.raises(RuntimeError, match=f"modified by an inplace operation: {name} of"):
            y.backward(g)
    with torch.inference_mode():
        cb_inf, b_inf = cb.clone(), b.clone()
    x_leaf, w_leaf = (t.detach().clone().requires_grad_(True) for t in (x, wt))
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
        y = ops.conv_bias_relu(x_leaf, w_leaf, cb_inf, b_inf)
    y.backward(g)
    assert torch.equal(x_leaf.grad, first[0]) and torch.equal(w_leaf.grad, first[1])


def _cpu_engine_node(monkeypatch):
    """The engine's training node on CPU tensors, its kernels replaced by
    torch ops (a forward whose relu passes everything where conv_bias is
    large, and a backward that ignores the mask): the node's bookkeeping
    alone.  Returns (the copies of x made so far, a list that the input
    gradient appends to whether ``kept[0]()``, a weak reference to a kept
    copy, is alive when it runs, kept)."""
    monkeypatch.setattr(gemm, "has_wgmma", lambda index: True)
    monkeypatch.setattr(CB, "ENGINE_TRAINING_MIN_ELEMENTS", 0)
    monkeypatch.setattr(CB, "ENGINE_FLOAT32_MIN_ELEMENTS", 0)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    copies, alive, kept = [0], [], [lambda: None]
    cl = torch.channels_last

    def transposed(t, dtype=None, tf32=False):
        if t.is_contiguous():  # (an NCHW x's copy for the product)
            copies[0] += 1
            return t.to(dtype or t.dtype).contiguous(memory_format=cl)
        return t.contiguous()

    def launch_engine(x, weight, conv_bias, bias, out=None, plan=None, mask=None, xc=None):
        src = x if xc is None else xc
        y = F.relu(F.conv2d(src.float(), weight.float(), conv_bias.float())) + bias.float().reshape(-1, 1, 1)
        fmt = cl if plan[0] == CB.CHANNELS_LAST else torch.contiguous_format
        return y.to(plan[2]).contiguous(memory_format=fmt)

    def bias_relu_backward(dy, mask, sizes, channels_last, second_bias, dtype, nchw, whole, tf32_dz=False):
        return dy.to(dtype).contiguous(memory_format=cl), torch.stack([dy.sum((0, 2, 3))] * 2)

    def dgrad(dz, weight, dx_dtype=None):
        alive.append(kept[0]() is not None)
        n, _, oh, ow = dz.shape
        cin, kh, kw = weight.shape[1:]
        dx = torch.nn.grad.conv2d_input((n, cin, oh + kh - 1, ow + kw - 1), weight, dz)
        return dx.to(dx_dtype or dz.dtype).contiguous(memory_format=cl)

    monkeypatch.setattr(CB, "_transposed", transposed)
    monkeypatch.setattr(CB, "_launch_engine", launch_engine)
    monkeypatch.setattr(CB, "_bias_relu_backward", bias_relu_backward)
    monkeypatch.setattr(CB, "_launch_dgrad", dgrad)
    monkeypatch.setattr(CB, "_dgrad_on_engine", lambda dz, weight, tf32_dz=False: True)
    return copies, alive, kept


def test_engine_training_node_keeps_a_leaf_copy_for_one_use(past_device_check, monkeypatch):
    """The engine's training node (on CPU, its kernels replaced: the
    bookkeeping alone).  Where x is a leaf that requires grad, x's
    channels-last copy is kept for one use: gone when the input gradient
    runs (at once without a weight gradient), made again, once, for a
    second backward through a retained graph, with the same gradients, and
    refused there if x changed in place; x anchors a refused double
    backward.  An intermediate x's copy is saved, and x itself not kept
    alive; an x with no gradient, and a channels-last x the product reads
    as it is, keep nothing for one use."""
    copies, alive, kept = _cpu_engine_node(monkeypatch)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 8, 6, 7, generator=gen)
    wt = torch.randn(32, 8, 3, 3, generator=gen) / 8  # (C_out 32: a channels-last x trains on the engine)
    cb, b = torch.full((32,), 100.0), torch.randn(32, generator=gen)  # (relu passes everything)
    g = torch.randn(2, 32, 4, 5, generator=gen)

    def forward(x=x, weight_grad=True, x_grad=True):
        leaves = [t.clone().requires_grad_(True) for t in (x, wt, cb, b)]
        leaves[0].requires_grad_(x_grad)
        leaves[1].requires_grad_(weight_grad)
        assert CB.route(*leaves) == "engine"
        return ops.conv_bias_relu(*leaves), leaves

    ref = [t.clone().requires_grad_(True) for t in (x, wt, cb, b)]
    (F.relu(F.conv2d(ref[0], ref[1], ref[2])) + ref[3].reshape(-1, 1, 1)).backward(g)
    y, leaves = forward()
    assert copies[0] == 1 and not any(hasattr(y.grad_fn, a) for a in ("saved_x", "saved_xc"))
    kept[0] = weakref.ref(y.grad_fn.kept_xc)
    y.backward(g, retain_graph=True)
    assert alive == [False] and y.grad_fn.kept_xc is None
    first = [t.grad.clone() for t in leaves]
    assert all(torch.allclose(a, r.grad, rtol=1e-4, atol=1e-4) for a, r in zip(first, ref))
    for t in leaves:
        t.grad = None
    y.backward(g)  # the copy made again, once (for the mask and the weight gradient)
    assert copies[0] == 2 and all(torch.equal(t.grad, f) for t, f in zip(leaves, first))
    y, leaves = forward()
    y.backward(g, retain_graph=True)
    with torch.no_grad():
        leaves[0].add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation: x of"):
        y.backward(g)
    # No weight gradient: the kept copy dropped before anything runs.
    y, leaves = forward(weight_grad=False)
    kept[0] = weakref.ref(y.grad_fn.kept_xc)
    alive.clear()
    y.backward(g)
    assert alive == [False] and torch.equal(leaves[0].grad, first[0])
    # A penalty on the weight's gradient, with respect to x alone: refused.
    y, leaves = forward()
    (gw,) = torch.autograd.grad((y * g).sum(), leaves[1], create_graph=True)
    with pytest.raises(RuntimeError, match=r"cupy_fused::\w+ does not support double backward"):
        torch.autograd.grad(gw.square().sum(), leaves[0], allow_unused=True)
    # An intermediate x: its copy saved, x not kept alive; two backwards, the gradients summed.
    _, leaves = forward()
    xi = leaves[0] * 1.0
    held = weakref.ref(xi)
    y = ops.conv_bias_relu(xi, *leaves[1:])
    del xi
    assert held() is None and not hasattr(y.grad_fn, "kept_xc")
    y.backward(g, retain_graph=True)
    y.backward(g)
    assert all(torch.equal(t.grad, 2 * f) for t, f in zip(leaves, first))
    # x with no gradient, and a channels-last x read as it is: nothing kept for one use.
    for y, _ in (forward(x_grad=False), forward(x.contiguous(memory_format=torch.channels_last))):
        assert not hasattr(y.grad_fn, "kept_xc")
        y.backward(g)


@pytest.mark.gpu
@pytest.mark.skipif(AG._top_saved_tensor_hooks is None,
                    reason="telling whether saved-tensor hooks are active: torch >= 2.8")
@pytest.mark.parametrize("channels_last, dtype, amp",
                         [(False, torch.bfloat16, False), (True, torch.bfloat16, False),
                          (False, torch.float32, False), (False, torch.float32, True)],
                         ids=["nchw-bf16", "channels_last-bf16", "nchw-float32", "nchw-amp"])
def test_engine_training_under_activation_checkpointing(channels_last, dtype, amp, device,
                                                        monkeypatch):
    """torch.utils.checkpoint's non-reentrant mode over the engine's
    training route: the gradients without it, bit for bit, and the forward
    leaves no more held than the reference's under the same checkpoint
    (relu's mask and x's copy are saved tensors there, which the
    checkpoint drops until the backward recomputes them)."""
    _engine_device(device)
    _lift_engine_thresholds(monkeypatch)
    gen, x, wt, cb, g = _small_training_operands(channels_last, 7, device, dtype)
    b = torch.randn(32, generator=gen).to(device, dtype)

    def ours(*t):
        return ops.conv_bias_relu(*t)

    def theirs(xx, w, c, bb):
        return F.relu(F.conv2d(xx, w, c)) + bb.reshape(-1, 1, 1)

    grads = []
    for wrapped in (False, True):
        leaves = [t.detach().clone().requires_grad_(True) for t in (x, wt, cb, b)]
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            assert CB.route(*leaves) == "engine"
            y = checkpoint(ours, *leaves, use_reentrant=False) if wrapped else ours(*leaves)
        y.backward(g.to(y.dtype))
        grads.append([y.detach()] + [t.grad for t in leaves])
    assert all(torch.equal(a, c) for a, c in zip(*grads))
    held = []
    for fn in (theirs, ours):
        leaves = [t.detach().clone().requires_grad_(True) for t in (x, wt, cb, b)]

        def forward(fn=fn, leaves=leaves):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
                return checkpoint(fn, leaves[0] * 1.0, *leaves[1:], use_reentrant=False)

        held.append(held_bytes(forward, device))
    assert held[1] <= held[0], held


@pytest.mark.skipif(AG._top_saved_tensor_hooks is None,
                    reason="telling whether saved-tensor hooks are active: torch >= 2.8")
def test_engine_training_node_under_saved_tensor_hooks(past_device_check, monkeypatch):
    """Where saved-tensor hooks are active (torch.utils.checkpoint's
    non-reentrant mode, torch.autograd.graph.save_on_cpu), the engine's
    training node keeps nothing for one use, which the hooks would not
    see: relu's mask and x's copy are saved tensors.  The gradients are
    those without hooks, bit for bit (on CPU, its kernels replaced)."""
    _cpu_engine_node(monkeypatch)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(2, 8, 6, 7, generator=gen)
    wt = torch.randn(32, 8, 3, 3, generator=gen) / 8
    cb, b = torch.full((32,), 100.0), torch.randn(32, generator=gen)
    g = torch.randn(2, 32, 4, 5, generator=gen)
    grads = []
    for mode in ("plain", "hooks", "checkpoint"):
        leaves = [t.clone().requires_grad_(True) for t in (x, wt, cb, b)]
        packed = []

        def pack(t):
            packed.append(tuple(t.shape))
            return t

        if mode == "checkpoint":
            y = checkpoint(ops.conv_bias_relu, *leaves, use_reentrant=False)
        else:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if mode == "hooks" \
                    else contextlib.nullcontext():
                y = ops.conv_bias_relu(*leaves)
        kept = [a for a in ("kept_mask", "kept_xc") if getattr(y.grad_fn, a, None) is not None]
        assert kept == ([] if mode != "plain" else ["kept_mask", "kept_xc"])
        if mode == "hooks":  # x's copy (x's shape), the weight and the mask (a word per 32 values)
            assert sorted(packed) == sorted([tuple(x.shape), tuple(wt.shape), (2 * 32 * 4 * 5 // 32,)])
        y.backward(g)
        grads.append([t.grad for t in leaves])
    for other in grads[1:]:
        assert all(torch.equal(a, c) for a, c in zip(grads[0], other))


@pytest.mark.parametrize("hooks", ["none", "save_on_cpu", "unknown"])
def test_engine_training_node_anchors_an_intermediate_x(hooks, past_device_check, monkeypatch):
    """An intermediate x, whose copy (no history) the node saves: a penalty
    on the weight's gradient differentiated with respect to x is refused
    (x anchors it), with saved-tensor hooks too.  On a torch that cannot
    tell whether hooks are active ("unknown": the eager setup then keeps
    the mask for one use), the node unpacks its saved tensors once, as
    torch.utils.checkpoint's non-reentrant mode requires (on CPU, its
    kernels replaced)."""
    _cpu_engine_node(monkeypatch)
    if hooks == "unknown":
        monkeypatch.setattr(AG, "_top_saved_tensor_hooks", None)
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(2, 8, 6, 7, generator=gen)
    wt = torch.randn(32, 8, 3, 3, generator=gen) / 8
    cb, b = torch.full((32,), 100.0), torch.randn(32, generator=gen)
    g = torch.randn(2, 32, 4, 5, generator=gen)
    leaves = [t.clone().requires_grad_(True) for t in (x, wt, cb, b)]
    with torch.autograd.graph.save_on_cpu() if hooks == "save_on_cpu" else contextlib.nullcontext():
        y = ops.conv_bias_relu(leaves[0] * 1.0, *leaves[1:])
    (gw,) = torch.autograd.grad((y * g).sum(), leaves[1], create_graph=True)
    with pytest.raises(RuntimeError, match=r"cupy_fused::\w+ does not support double backward"):
        torch.autograd.grad(gw.square().sum(), leaves[0], allow_unused=True)
    grads = []
    for wrapped in (False, True):
        leaves = [t.clone().requires_grad_(True) for t in (x, wt, cb, b)]

        def step(xx, *rest):
            return ops.conv_bias_relu(xx * 1.0, *rest)

        y = checkpoint(step, *leaves, use_reentrant=False) if wrapped else step(*leaves)
        y.backward(g)
        grads.append([t.grad for t in leaves])
    assert all(torch.equal(a, c) for a, c in zip(*grads))


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
@pytest.mark.parametrize("channels_last, dtype", [(False, torch.bfloat16), (True, torch.bfloat16),
                                                  (False, torch.float32), (True, torch.float32)],
                         ids=["nchw-bf16", "channels_last-bf16", "nchw-float32", "channels_last-float32"])
def test_engine_training_refuses_double_backward(channels_last, dtype, device, monkeypatch):
    """The engine's training node (its own eager node, which keeps relu's
    mask) under create_graph=True: a first-order backward gives the plain
    backward's gradients bit for bit; a gradient penalty through it, with
    respect to x or to the parameters only, is refused by name, never
    computed without the op's second-order terms."""
    _engine_device(device)
    _lift_engine_thresholds(monkeypatch)
    gen, x, wt, cb, g = _small_training_operands(channels_last, 8, device, dtype)
    b = torch.randn(32, generator=gen).to(device, dtype)

    def leaves():
        out = [t.detach().clone().requires_grad_(True) for t in (x, wt, cb, b)]
        assert CB.route(*out) == "engine"
        return out

    def grads(create_graph):
        ts = leaves()
        ops.conv_bias_relu(*ts).backward(g, create_graph=create_graph)
        return [t.grad.detach() for t in ts]

    assert all(torch.equal(a, c) for a, c in zip(grads(False), grads(True)))
    refused = r"cupy_fused::\w+ does not support double backward"
    ts = leaves()
    y = ops.conv_bias_relu(*ts)
    (gx,) = torch.autograd.grad((y * g).sum(), ts[0], create_graph=True)
    assert gx.requires_grad
    with pytest.raises(RuntimeError, match=refused):
        (y.float().sum() + gx.float().square().sum()).backward()
    ts = leaves()
    (gx,) = torch.autograd.grad(ops.conv_bias_relu(*ts).sum(), ts[0], create_graph=True)
    with pytest.raises(RuntimeError, match=refused):
        torch.autograd.grad(gx.float().square().sum(), ts[1:], allow_unused=True)
    # A penalty on the weight's gradient with respect to x alone (x not a
    # saved tensor where the node keeps its copy for one use).
    ts = leaves()
    (gw,) = torch.autograd.grad(ops.conv_bias_relu(*ts).sum(), ts[1], create_graph=True)
    with pytest.raises(RuntimeError, match=refused):
        torch.autograd.grad(gw.float().square().sum(), ts[0], allow_unused=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_engine_training_mask_keeps_nan_and_inf(dtype, device, monkeypatch):
    """relu's mask from the store: a NaN or an infinity in x reaches y, and
    the gradients of x and of the biases, where the reference's do
    (bias_relu's mask passes the gradient at a NaN, as torch's relu backward
    does).  (The weight's gradient sums x's infinities times zeros of dz:
    where its NaN lands depends on cuDNN's algorithm.)"""
    _engine_device(device)
    _lift_engine_thresholds(monkeypatch)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(2, 8, 6, 133, generator=gen)
    x[0, 3, 2, 7], x[1, 0, 4, 130], x[1, 5, 0, 0] = float("nan"), float("inf"), -float("inf")
    wt = torch.randn(16, 8, 3, 3, generator=gen) / 8
    cb, b = torch.randn(16, generator=gen), torch.randn(16, 1, 1, generator=gen)
    g = torch.randn(2, 16, 4, 131, generator=gen)
    args = [t.to(device, dtype) for t in (x, wt, cb, b)]
    leaves = [t.clone().requires_grad_(True) for t in args]
    assert CB.route(*leaves) == "engine"
    y = ops.conv_bias_relu(*leaves)
    y.backward(g.to(device, dtype))
    ref = [t.clone().requires_grad_(True) for t in args]
    ry = F.relu(F.conv2d(ref[0], ref[1], ref[2])) + ref[3]
    ry.backward(g.to(device, dtype))
    pairs = [(y, ry)] + [(leaves[i].grad, ref[i].grad) for i in (0, 2, 3)]
    assert y.isnan().any() and y.isposinf().any()
    for ours, theirs in pairs:
        assert torch.equal(ours.isnan(), theirs.isnan())
        assert torch.equal(ours.isposinf(), theirs.isposinf())
        assert torch.equal(ours.isneginf(), theirs.isneginf())


@pytest.mark.gpu
@pytest.mark.parametrize("shape", TRAINING_SHAPES + [(1, 8, 3, 200, 8, 3, 70), (2, 8, 3, 97, 200, 1, 1)],
                         ids=lambda s: "x".join(map(str, s)))
def test_engine_float32_training_mask(shape, device, monkeypatch):
    """The float32 store's relu mask (bits gathered from the registers by
    ballots, a row's words stored or OR-ed into a zeroed mask) against the
    sign of the exact product of the TF32-rounded operands plus conv_bias:
    every bit equal where that sum is not within float32 rounding of 0, no
    bit past y's last element; y against the same product.  The same
    launch into a NaN-poisoned y and a fresh mask: the same bits."""
    _engine_device(device)
    _lift_engine_thresholds(monkeypatch)
    n, cin, h, w, cout, kh, kw = shape
    gen = torch.Generator().manual_seed(sum(shape) + 5)
    x = torch.randn(n, cin, h, w, generator=gen).to(device)
    wt = (torch.randn(cout, cin, kh, kw, generator=gen) / (cin * kh * kw) ** 0.5).to(device)
    cb, b = torch.randn(cout, generator=gen).to(device), torch.randn(cout, generator=gen).to(device)
    y, mask, xc = CB._train_forward(x, wt, cb, b, torch.float32, torch.float32)
    assert torch.equal(xc, CB._tf32(x)) and xc.is_contiguous(memory_format=torch.channels_last)
    z = F.conv2d(CB._tf32(x).double(), CB._tf32(wt).double(), cb.double())
    assert rel_error(y, F.relu(z) + b.double().view(-1, 1, 1)) <= 1e-5
    bits = _mask_bits(mask)
    assert not bits[z.numel():].any()
    clear = z.abs().flatten() > 1e-5 * (z.abs().max() + 1)
    assert torch.equal(bits[:z.numel()][clear].bool(), (z.flatten() > 0)[clear])
    out, again = torch.full_like(y, float("nan")), torch.zeros_like(mask)
    CB._launch_engine(x, wt, cb, b, out=out, plan=(CB.NCHW, torch.float32, torch.float32, True), mask=again,
                      xc=xc)
    assert torch.equal(out, y) and torch.equal(again, mask)


def test_channels_last_mask_needs_whole_words():
    """The engine's channels-last store writes relu's mask in whole words
    of 32 channels, into memory not zeroed first: another C_out is refused
    before anything launches (the route never sends one there)."""
    x = torch.randn(1, 8, 5, 5, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
    w = torch.randn(40, 8, 3, 3, dtype=torch.bfloat16)
    cb = torch.randn(40, dtype=torch.bfloat16)
    mask = torch.empty(math.ceil(40 * 9 / 32), dtype=torch.int32)
    with pytest.raises(ValueError, match="multiple of 32, got 40"):
        CB._launch_engine(x, w, cb, None, plan=(CB.CHANNELS_LAST, torch.bfloat16, torch.bfloat16, True),
                          mask=mask)


# test_engine_channels_last_mask's modes: x's dtype, the product's, y's.
_CL_MASK_MODES = {"bfloat16": (torch.bfloat16,) * 3, "float16": (torch.float16,) * 3,
                  "float32": (torch.float32,) * 3,
                  "amp_bf16": (torch.float32, torch.bfloat16, torch.float32),
                  "amp_fp16": (torch.float32, torch.float16, torch.float32)}


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(_CL_MASK_MODES))
@pytest.mark.parametrize("shape", [(2, 8, 9, 70, 32, 3, 3), (1, 16, 5, 131, 64, 1, 3),
                                   (2, 8, 4, 257, 160, 2, 3), (3, 64, 6, 130, 96, 3, 2),
                                   (1, 72, 5, 140, 64, 5, 7), (2, 16, 4, 20, 32, 1, 1),
                                   (2, 8, 9, 70, 32, 2, 6), (1, 16, 4, 140, 32, 2, 8),
                                   (4, 16, 40, 140, 128, 3, 4)],  # 304 tiles, more than SMs
                         ids=lambda s: "x".join(map(str, s)))
def test_engine_channels_last_mask(shape, mode, device):
    """The channels-last training forward's mask (bit i of word i / 32 for
    y's element i in memory order) is not zeroed first (_mask_words): its
    store writes every word (NhwcStore and NhwcStoreF32, the per-tap
    kernel's, for kernels wider than the window; the window kernel's, in
    16-bit, in float32, and under autocast).  Its memory filled with
    ones beforehand (the allocator's block of a freed all-ones tensor), it
    holds the bits of a launch into a zeroed mask, and y is the same.
    Every bit is set where relu's input in float64 (conv2d + conv_bias, on
    the operands rounded to the product's dtype) is positive and clear
    where it is negative, except within rounding of zero."""
    _engine_device(device)
    n, cin, h, w, cout, kh, kw = shape
    x_dtype, dtype, out_dtype = _CL_MASK_MODES[mode]
    _, x, wt, cb, b = _conv_operands(shape, 11, device, x_dtype, torch.channels_last)
    words = math.ceil(n * cout * (h - kh + 1) * (w - kw + 1) / 32)
    ones = torch.full((words,), -1, dtype=torch.int32, device=device)
    poisoned = ones.data_ptr()
    del ones
    y, mask, _ = CB._train_forward(x, wt, cb, b, dtype, out_dtype)
    assert mask.data_ptr() == poisoned  # the test's premise: the ones' memory
    again, out = torch.zeros_like(mask), torch.full_like(y, float("nan"))
    CB._launch_engine(x, wt, cb, b, out=out, plan=(CB.CHANNELS_LAST, dtype, out_dtype, True), mask=again)
    assert torch.equal(mask, again) and torch.equal(out, y)
    xr, wr = (CB._tf32(t) if dtype == torch.float32 else t.to(dtype) for t in (x, wt))
    z = F.conv2d(xr.double(), wr.double(), cb.double()).permute(0, 2, 3, 1).reshape(-1)  # y's memory order
    bits = _mask_bits(mask)[:z.numel()]
    clear = z.abs() > 1e-2  # (well away from zero at these sizes' rounding)
    assert torch.equal(bits[clear].bool(), z[clear] > 0)
    assert clear.float().mean() > 0.9


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["bfloat16", "float16", "float32", "amp_bf16", "amp_fp16"])
@pytest.mark.parametrize("shape", [(2, 8, 9, 70, 32, 3, 3), (1, 16, 5, 131, 64, 1, 3),
                                   (2, 8, 4, 257, 160, 2, 3)],
                         ids=lambda s: "x".join(map(str, s)))
def test_engine_training_forward_channels_last(shape, mode, device, monkeypatch):
    """The same step from a channels-last x: in 16-bit the window kernel's
    forward with the mask from its registers (every word's halves),
    bias_relu's channels-last backward, conv_dgrad_wgmma and cuDNN's
    weight gradient on x itself; in float32 the window kernel's TF32 form on
    x's copy rounded to TF32, y float32, and cuDNN's deterministic backward
    on x itself; under autocast the window kernel on x's cast, y float32,
    the 16-bit backward on that cast.  Gradients in x's and the weight's layouts and
    dtypes, within 1.5x eager's error; two steps bitwise equal."""
    _engine_device(device)
    _lift_engine_thresholds(monkeypatch)
    amp = {"amp_bf16": torch.bfloat16, "amp_fp16": torch.float16}.get(mode)
    y, leaves, ey, eager = _engine_training_step_against_float64(
        shape, torch.float32 if amp else getattr(torch, mode), amp, torch.channels_last, device)
    assert y.dtype == ey.dtype
    for ours, theirs in zip(leaves, eager):
        assert ours.grad.dtype == theirs.grad.dtype
    assert y.is_contiguous(memory_format=torch.channels_last)
    assert leaves[0].returned_grad.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels-last"])
def test_training_step_past_2_pow_31_elements(channels_last, device):
    """64-bit indexing through a float16 training step on the engine with x
    and y past 2^31 elements (528 x 64 x 256 x 256, a 3 x 3 kernel): an
    NCHW x's transposing copies, relu's mask and the channels-last dz, or a
    channels-last x's window kernel, mask and rows backward; the input
    gradient on the engine.  y and dx on images on both sides of element
    2^31 (of x: image 512; of y: 520) against float64, within eager's error
    bound on those images; the second bias's gradient against torch's
    float32 sum of dy."""
    _engine_device(device)
    n, c, hw = 528, 64, 256
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    gen = torch.Generator(device=device).manual_seed(3)
    x = torch.randn(n, c, hw, hw, device=device, dtype=torch.float16, generator=gen)
    x = x.contiguous(memory_format=fmt)
    w = (torch.randn(c, c, 3, 3, device=device, generator=gen) / 24).half()
    cb, b = (torch.randn(c, device=device, dtype=torch.float16, generator=gen) for _ in range(2))
    dy = torch.randn(n, c, hw - 2, hw - 2, device=device, dtype=torch.float16, generator=gen)
    dy = dy.contiguous(memory_format=fmt)
    assert x.numel() > 2**31 and dy.numel() > 2**31
    leaves = [t.requires_grad_(True) for t in (x, w, cb, b)]
    assert CB.route(*leaves) == "engine"
    y = ops.conv_bias_relu(*leaves)
    images = [0, 511, 512, 519, 520, n - 1]
    y_images = y.detach()[images]
    dx, db = torch.autograd.grad(y, [x, b], dy)
    del y

    def step(*tensors):  # the reference's y and dx on those images
        leaves = [t.detach().clone().requires_grad_(True) for t in tensors[:4]]
        out = _reference(*leaves)
        return out.detach(), torch.autograd.grad(out, [leaves[0]], tensors[4].to(out.dtype))[0]

    on_images = (x.detach()[images], w, cb, b, dy[images])
    truth = step(*(t.double() for t in on_images))
    eager = step(*on_images)
    ulp = torch.finfo(torch.float16).eps
    for name, ours, theirs, want in zip(["y", "dx"], (y_images, dx[images]), eager, truth):
        assert rel_error(ours, want) <= 1.5 * rel_error(theirs, want) + ulp, (
            name, rel_error(ours, want), rel_error(theirs, want))
    want = dy.float().sum((0, 2, 3)).half().float()
    torch.testing.assert_close(db.float(), want, rtol=2e-3, atol=1e-2)
