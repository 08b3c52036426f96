"""``ops.linear`` (``cupy_fused/ops/linear.py``): validation, the cuBLAS
bias + ReLU node and the autocast op on CPU tensors (CPU tier); forward and
gradients against float64, leading dimensions, torch.compile, the fused
ReLU store and the half-precision route (GPU tier)."""
import contextlib
import importlib
import weakref

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from cupy_fused import _autograd as AG, ops
from cupy_fused.testing import off_the_grid, poison_allocator

# The module (``cupy_fused.ops.linear`` as an attribute is the op itself).
L = importlib.import_module("cupy_fused.ops.linear")

gpu = pytest.mark.gpu


# ---------------------------------------------------------------- CPU tier

def test_linear_validation(past_device_check):
    x, w = torch.rand(4, 8), torch.rand(16, 8)
    with pytest.raises(ValueError, match=r"x must have 8 features \(weight is \[16, 8\]\)"):
        ops.linear(torch.rand(4, 7), w)
    with pytest.raises(ValueError, match="weight must be 2-D"):
        ops.linear(x, torch.rand(16, 8, 1))
    with pytest.raises(TypeError, match="weight must have the dtype of x"):
        ops.linear(x, w.half())
    with pytest.raises(ValueError, match=r"bias must hold one value per channel \(16 values"):
        ops.linear(x, w, torch.rand(15))
    with pytest.raises(ValueError, match="activation must be None or 'relu', got 'gelu'"):
        ops.linear(x, w, activation="gelu")
    with pytest.raises(ValueError, match="precision must be one of"):
        ops.linear(x, w, precision="fast")
    with pytest.raises(ValueError, match="x must have at least 1 dimension"):
        ops.linear(torch.tensor(1.0), w)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cublas_relu_backward_keeps_its_output_for_one_use(dtype, past_device_check):
    """The eager node gates with the output it kept, then drops it; a second
    backward through a retained graph recomputes it (same gradients); an
    output modified in place after the forward is refused, as autograd
    refuses a modified saved tensor."""
    gen = torch.Generator().manual_seed(5)
    x = (torch.rand(7, 33, generator=gen) - 0.5).to(dtype)
    w = torch.randn(19, 33, generator=gen).to(dtype)
    b = torch.randn(19, generator=gen).to(dtype)
    dy = torch.randn(7, 19, generator=gen).to(dtype)
    leaves = [t.clone().requires_grad_(True) for t in (x, w, b)]
    y = ops.linear(*leaves, activation="relu", precision="ieee")
    assert (y == 0).any() and (y > 0).any()
    assert y.grad_fn.kept_output is not None
    y.backward(dy, retain_graph=True)
    assert y.grad_fn.kept_output is None  # dropped by the first backward
    first = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    y.backward(dy)  # recomputes the gate
    for again, once in zip(leaves, first):
        assert torch.equal(again.grad, once)
    ref = [t.clone().requires_grad_(True) for t in (x, w, b)]
    torch.relu(torch.nn.functional.linear(*ref)).backward(dy)
    for ours, theirs in zip(first, ref):
        torch.testing.assert_close(ours, theirs.grad)
    y = ops.linear(*leaves, activation="relu", precision="ieee")
    with torch.no_grad():
        y.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward(dy)
    # The bias is not saved (the reference's nodes do not save it): changed
    # in place before the first backward, the gradients are the reference's
    # under the same change; a second backward, which would recompute the
    # gate from it, is refused.
    for t in leaves + ref:
        t.grad = None
    y = ops.linear(*leaves, activation="relu", precision="ieee")
    y_ref = torch.relu(torch.nn.functional.linear(*ref))
    with torch.no_grad():
        leaves[2].add_(1.0)
        ref[2].add_(1.0)
    y.backward(dy, retain_graph=True)
    y_ref.backward(dy)
    for ours, theirs in zip(leaves, ref):
        torch.testing.assert_close(ours.grad, theirs.grad)
    with pytest.raises(RuntimeError, match="modified by an inplace operation: the bias of "
                                           "cupy_fused::linear_relu_cublas"):
        y.backward(dy)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cublas_relu_route_uses_cublas_epilogues(dtype, past_device_check):
    """float16/bfloat16 and "ieee" (here on CPU tensors, the same torch ops):
    cuBLAS's bias epilogue and torch's ReLU (not cuBLASLt's ReLU epilogue,
    which turns NaN into 0), and a backward from the output that gives
    eager's gradients."""
    gen = torch.Generator().manual_seed(4)
    x = (torch.rand(6, 40, generator=gen) - 0.5).to(dtype)
    w = torch.randn(24, 40, generator=gen).to(dtype)
    b = torch.randn(24, generator=gen).to(dtype)
    with torch.no_grad():
        y = ops.linear(x, w, b, activation="relu", precision="ieee")
    assert torch.equal(y, torch.addmm(b, x, w.t()).relu())
    assert (y == 0).any() and (y > 0).any()
    leaves = [t.clone().requires_grad_(True) for t in (x, w, b)]
    y = ops.linear(*leaves, activation="relu", precision="ieee")
    assert torch.equal(y, torch.addmm(b, x, w.t()).relu())
    dy = torch.randn(y.shape, generator=gen).to(dtype)
    y.backward(dy)
    ref = [t.clone().requires_grad_(True) for t in (x, w, b)]
    torch.relu(torch.nn.functional.linear(*ref)).backward(dy)
    for ours, theirs in zip(leaves, ref):
        torch.testing.assert_close(ours.grad, theirs.grad)
    with torch.no_grad():  # no bias: the GEMM and relu_
        assert torch.equal(ops.linear(x, w, None, activation="relu", precision="ieee"),
                           torch.relu(x @ w.t()))
    # Traced (the registered custom op, then relu_ on its output): the same.
    torch._dynamo.reset()
    compiled = torch.compile(lambda *t: ops.linear(*t, activation="relu", precision="ieee"),
                             backend="aot_eager", fullgraph=True)
    traced = [t.clone().requires_grad_(True) for t in (x, w, b)]
    y2 = compiled(*traced)
    y2.backward(dy)
    assert torch.equal(y2, y)
    for ours, again in zip(leaves, traced):
        assert torch.equal(ours.grad, again.grad)


@pytest.mark.skipif(not hasattr(torch.library, "opcheck"), reason="torch.library.opcheck: torch >= 2.4")
def test_backward_fakes_match_the_real_outputs(past_device_check):
    """torch.compile checks a custom op's real outputs against its fake's
    (inductor asserts their strides): the products' gradients are
    contiguous for a transposed x or weight (the cuBLAS route keeps their
    strides), and an unwanted gradient of the autocast backward is empty in
    its own dtype."""
    gen = torch.Generator().manual_seed(0)
    x, w, dz = (torch.randn(*s, generator=gen) for s in [(6, 20), (12, 20), (6, 12)])
    xt, wt = torch.randn(20, 6, generator=gen).t(), torch.randn(20, 12, generator=gen).t()
    for args in [(dz, xt, w, True, True, True), (dz, x, wt, True, True, True),
                 (dz, xt, wt, True, True, False)]:
        torch.library.opcheck(L._CUBLAS_RELU.backward_op, args, test_utils="test_faketensor")
    bf = [t.bfloat16() for t in (dz, x, w)]
    for want in [(False, True, True), (True, False, False)]:
        torch.library.opcheck(L._LINEAR_AUTOCAST.backward_op,
                              (*bf, torch.float32, torch.float32, torch.float32, *want),
                              test_utils="test_faketensor")
    # An operand the node did not save (its gradient's other factor not
    # wanted): None, the shapes taken from dz and the other operand.
    torch.library.opcheck(L._CUBLAS_RELU.backward_op, (dz, None, w, True, False, True),
                          test_utils="test_faketensor")
    torch.library.opcheck(L._CUBLAS_RELU.backward_op, (dz, x, None, False, True, False),
                          test_utils="test_faketensor")
    for args in [(bf[0], None, bf[2], torch.float32, torch.float32, torch.float32, True, False, True),
                 (bf[0], bf[1], None, torch.float32, torch.float32, torch.float32, False, True, True)]:
        torch.library.opcheck(L._LINEAR_AUTOCAST.backward_op, args, test_utils="test_faketensor")


def _route_setup(route, monkeypatch):
    """(dtype, activation, precision) of ``ops.linear`` calls that take
    ``route`` on CPU tensors (K = 8: the tensor-core route's products are
    SGEMM's there, a torch op)."""
    from cupy_fused.ops import gemm as G

    if route == "tensor-core":
        monkeypatch.setattr(G, "has_tf32_tensor_cores", lambda dev: True)
        return torch.float32, None, "3xtf32"
    if route == "autocast":
        monkeypatch.setattr(L, "autocast_dtype", lambda: torch.bfloat16)
        return torch.float32, None, None
    return torch.bfloat16, "relu" if route == "cublas-relu" else None, None


@pytest.mark.parametrize("frozen", ["weight", "x"])
@pytest.mark.parametrize("route", ["tensor-core", "cublas", "cublas-relu", "autocast"])
def test_products_keep_only_what_their_gradients_read(route, frozen, past_device_check,
                                                      monkeypatch):
    """As F.linear's product saves them: x (or its cast) only for the
    weight's gradient, the weight (or its cast) only for x's.  A frozen
    weight keeps no activation alive until the backward, an input that
    needs no gradient no weight nor cast of it.  The gradients are the
    reference's."""
    dtype, activation, precision = _route_setup(route, monkeypatch)
    gen = torch.Generator().manual_seed(13)
    x, w, b = (torch.randn(*s, generator=gen).to(dtype) for s in [(6, 8), (12, 8), (12,)])
    dy = torch.randn(6, 12, generator=gen).bfloat16()
    leaves = [x.clone(), w.clone(), b.clone().requires_grad_(True)]
    ref = [x.clone(), w.clone(), b.clone().requires_grad_(True)]
    trained = 0 if frozen == "weight" else 1
    for t in (leaves[trained], ref[trained]):
        t.requires_grad_(True)
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = ops.linear(*leaves, activation=activation, precision=precision)
    unread = [(6, 8)] if frozen == "weight" else [(12, 8), (8, 12)]
    assert not set(unread) & set(shapes), shapes
    if route == "autocast":  # (without hooks the weight's cast is kept, not saved: see linear.py)
        kept = ops.linear(*leaves, activation=activation, precision=precision).grad_fn.kept_w_d
        assert (kept is None) == (frozen == "x")
    y.backward(dy.to(y.dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=route == "autocast"):
        want = torch.nn.functional.linear(*ref)
    (want.relu() if activation else want).backward(dy.to(want.dtype))
    # The same products on CPU, bit for bit; under autocast the reference
    # rounds its float32 gradients through bfloat16 (up to 2^-8 of each).
    tol = dict(rtol=2 ** -8, atol=1e-6) if route == "autocast" else dict(rtol=0, atol=0)
    for ours, theirs in zip(leaves, ref):
        assert (ours.grad is None) == (theirs.grad is None)
        if theirs.grad is not None:
            assert ours.grad.dtype == theirs.grad.dtype
            torch.testing.assert_close(ours.grad, theirs.grad, **tol)
    # Traced (the custom ops, their backward given None for what was not
    # saved): eager's gradients, bit for bit.
    torch._dynamo.reset()
    compiled = torch.compile(lambda *t: ops.linear(*t, activation=activation, precision=precision),
                             backend="aot_eager", fullgraph=True)
    traced = [t.detach().clone().requires_grad_(t.requires_grad) for t in leaves]
    compiled(*traced).backward(dy.to(y.dtype))
    for ours, again in zip(leaves, traced):
        assert (ours.grad is None) == (again.grad is None)
        assert ours.grad is None or torch.equal(ours.grad, again.grad)


@pytest.mark.parametrize("dtype, precision, passes", [
    (torch.float32, "3xtf32", 3), (torch.float32, "ieee", 0), (torch.bfloat16, "3xtf32", 0)])
def test_the_route_is_decided_once(dtype, precision, passes, past_device_check, monkeypatch):
    """ops.linear asks once where its product runs (gemm.route) and hands
    that to _run_linear (here on CPU tensors: K = 8 takes SGEMM, a torch op,
    on the tensor-core route too)."""
    from cupy_fused.ops import gemm as G

    assert G.CUBLAS == 0
    monkeypatch.setattr(G, "has_tf32_tensor_cores", lambda dev: True)
    decisions, handed = [], []
    uses_cublas, run_linear = G.uses_cublas, L._run_linear
    monkeypatch.setattr(G, "uses_cublas", lambda *a: decisions.append(a) or uses_cublas(*a))
    monkeypatch.setattr(L, "_run_linear",
                        lambda *a: handed.append(a[-1]) or run_linear(*a))
    x, w = torch.rand(4, 8, dtype=dtype), torch.rand(16, 8, dtype=dtype)
    b = torch.rand(16, dtype=dtype)
    y = ops.linear(x, w, b, precision=precision)
    assert len(decisions) == 1 and handed == [passes]
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w, b))


def test_internal_entry_point_checks_activation_and_precision():
    x, w = torch.rand(4, 8), torch.rand(16, 8)
    with pytest.raises(ValueError, match="activation must be None or 'relu', got 'gelu'"):
        L._linear_prechecked(x, w, None, "gelu")
    with pytest.raises(ValueError, match="precision must be one of"):
        L._linear_prechecked(x, w, None, "relu", "fp32")


def test_cublas_operand_copies_half_operands_off_the_grid_only():
    """What cuBLAS is handed (test_half_operands_off_the_grid_multiply_as_aligned_ones
    on the GPU): a float16 / bfloat16 view off the 16-byte grid becomes an
    aligned copy of it; an aligned one, and float32 anywhere, as they are."""
    for dtype in (torch.float16, torch.bfloat16):
        aligned = torch.randn(4, 8).to(dtype)  # (CPU allocations are 64-byte aligned)
        off = off_the_grid(aligned)
        assert off.data_ptr() % 16 and aligned.data_ptr() % 16 == 0
        copy = L._cublas_operand(off)
        assert copy.data_ptr() % 16 == 0 and copy.is_contiguous() and torch.equal(copy, off)
        assert L._cublas_operand(aligned) is aligned
    f32 = off_the_grid(torch.randn(8))
    assert f32.data_ptr() % 16 and L._cublas_operand(f32) is f32


@pytest.mark.parametrize("amp", [None, torch.bfloat16], ids=["bf16", "amp-bf16"])
@pytest.mark.parametrize("act, with_bias", [(None, False), (None, True), ("relu", False),
                                            ("relu", True)], ids=["none", "bias", "relu", "bias-relu"])
@pytest.mark.parametrize("which", ["x", "weight"])
def test_every_product_reads_half_operands_on_the_grid(which, act, with_bias, amp,
                                                        past_device_check, monkeypatch):
    """Each product of a training step (forward, and dX and dW) reads float16 /
    bfloat16 operands on the 16-byte grid when x or the weight is off it
    (CPU tensors: the same Python and torch calls the GPU runs; aten's mm and
    addmm watched by a dispatch mode, in the backward too)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Products(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.offsets = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
                self.offsets += [t.data_ptr() % 16 for t in args
                                 if isinstance(t, torch.Tensor) and t.dtype != torch.float32]
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(L, "autocast_dtype", lambda: amp)
    gen = torch.Generator().manual_seed(3)
    x, w = (torch.randn(shape, generator=gen).bfloat16() for shape in ((7, 14), (138, 14)))
    b = torch.randn(138, generator=gen).bfloat16() if with_bias else None
    x, w = (off_the_grid(t) if which == name else t for name, t in (("x", x), ("weight", w)))
    x, w = x.requires_grad_(True), w.requires_grad_(True)
    products = Products()
    with products:
        y = ops.linear(x, w, b, activation=act)
        y.backward(torch.randn(y.shape, generator=gen).to(y.dtype))
    assert len(products.offsets) >= 6 and not any(products.offsets), products.offsets


# ---------------------------------------------------------------- GPU tier

def _eager_linear(x, w, bias, act):
    y = torch.nn.functional.linear(x, w, bias)
    return torch.relu(y) if act == "relu" else y


@gpu
@pytest.mark.parametrize("precision", ["3xtf32", "ieee"])
@pytest.mark.parametrize("act", [None, "relu"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_linear_forward_and_gradients_against_float64(precision, act, with_bias, device):
    torch.manual_seed(3)
    m, k, n = 133, 255, 190
    # Under 3xtf32 all three products on the kernel (ops.gemm.uses_sgemm).
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    assert not any(ops.gemm.uses_sgemm(3, *s, sms) for s in ((k, m, n), (n, m, k), (m, n, k)))
    leaves64 = [torch.rand(m, k, device=device, dtype=torch.float64) * 2 - 1,
                torch.randn(n, k, device=device, dtype=torch.float64) / 16,
                torch.randn(n, device=device, dtype=torch.float64) if with_bias else None]
    dy = torch.randn(m, n, device=device, dtype=torch.float64)

    def run(fn, dtype):
        leaves = [t.detach().to(dtype).requires_grad_(True) if t is not None else None
                  for t in leaves64]
        y = fn(*leaves)
        y.backward(dy.to(dtype))
        return [y] + [t.grad for t in leaves if t is not None]

    truth = run(lambda x, w, b: _eager_linear(x, w, b, act), torch.float64)
    eager = run(lambda x, w, b: _eager_linear(x, w, b, act), torch.float32)
    poison_allocator(device, 4 * m * n)
    ours = run(lambda x, w, b: ops.linear(x, w, b, activation=act, precision=precision),
               torch.float32)
    for name, o, e, t in zip(["y", "x.grad", "w.grad", "b.grad"], ours, eager, truth):
        err_o = ((o.double() - t).abs().max() / t.abs().max()).item()
        err_e = ((e.double() - t).abs().max() / t.abs().max()).item()
        assert err_o <= 1.5 * err_e + 1e-7, (name, err_o, err_e)


@gpu
def test_linear_keeps_leading_dimensions_and_compiles(device):
    x = torch.rand(2, 3, 40, device=device, requires_grad=True)
    w = torch.randn(24, 40, device=device, requires_grad=True)
    b = torch.randn(24, device=device, requires_grad=True)
    y = ops.linear(x, w, b, activation="relu")
    assert y.shape == (2, 3, 24)
    dy = torch.randn_like(y)
    y.backward(dy)
    grads = [x.grad, w.grad, b.grad]
    x.grad = w.grad = b.grad = None
    torch._dynamo.reset()
    fn = torch.compile(lambda x, w, b: ops.linear(x, w, b, activation="relu"), fullgraph=True)
    y2 = fn(x, w, b)
    y2.backward(dy)
    torch.testing.assert_close(y2, y, rtol=0, atol=0)
    for g1, g2 in zip(grads, [x.grad, w.grad, b.grad]):
        torch.testing.assert_close(g1, g2, rtol=0, atol=0)


@gpu
@pytest.mark.parametrize("in_features", [96, 20, 300])
@pytest.mark.parametrize("with_bias", [True, False])
def test_fused_relu_store_matches_the_training_path(with_bias, in_features, device):
    """Without autograd, bias + ReLU run in the GEMM's store; with it, in the
    bias_relu kernel (1-bit mask for the backward): the same float32 sums.
    So on the SGEMM routes (a short sum, 20; a long one over few tiles,
    300: ops.gemm.uses_sgemm): cuBLAS's product, then bias_relu."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    assert ops.gemm.uses_sgemm(3, in_features, 70, 130, sms) == (in_features != 96)
    gen = torch.Generator(device=device).manual_seed(5)
    x = torch.rand(70, in_features, device=device, generator=gen) - 0.5
    w = torch.randn(130, in_features, device=device, generator=gen)
    b = torch.randn(130, device=device, generator=gen) if with_bias else None
    with torch.no_grad():
        fused = ops.linear(x, w, b, activation="relu")
    y = ops.linear(x.requires_grad_(True), w, b, activation="relu")
    assert y.grad_fn is not None and torch.equal(fused, y)
    assert (y == 0).any() and (y > 0).any()
    if in_features == 300 and with_bias:  # the test bites: addmm's bits are not these
        assert not torch.equal(torch.addmm(b, x.detach(), w.t()).relu(), y)


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_takes_the_cublas_path(dtype, device):
    x = torch.rand(9, 32, device=device, dtype=dtype)
    w = torch.randn(16, 32, device=device, dtype=dtype)
    b = torch.randn(16, device=device, dtype=dtype)
    truth = torch.relu(torch.nn.functional.linear(x.double(), w.double(), b.double()))
    eager_err = (torch.relu(torch.nn.functional.linear(x, w) + b).double() - truth).abs().max()
    with torch.no_grad():
        y = ops.linear(x, w, b, activation="relu")
    assert torch.equal(y, torch.addmm(b, x, w.t()).relu())
    assert (y.double() - truth).abs().max() <= eager_err  # the bias is added before rounding
    y = ops.linear(x.requires_grad_(True), w, b, activation="relu")
    assert y.grad_fn is not None and torch.equal(y.detach(), torch.addmm(b, x, w.t()).relu())


@gpu
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("act, with_bias", [(None, False), ("relu", True), ("relu", False)],
                         ids=["none", "bias-relu", "relu"])
@pytest.mark.parametrize("amp", [None, torch.bfloat16], ids=["bf16", "amp-bf16"])
@pytest.mark.parametrize("which", ["x", "weight"])
def test_half_operands_off_the_grid_multiply_as_aligned_ones(which, amp, act, with_bias, compiled,
                                                             device):
    """A bfloat16 operand off the 16-byte grid: cuBLAS would pick kernels
    that may sum in bfloat16 (torch's default allows it), with nearly twice
    the error; the op hands it an aligned copy, so the output and the
    gradients are those of aligned operands, bit for bit.  Compiled too: a
    graph traced for the operand off the grid (where no address is known
    while tracing) runs the copy in the custom ops' implementations."""
    gen = torch.Generator().manual_seed(3)
    x, w = (torch.randn(shape, generator=gen).to(device, torch.bfloat16)
            for shape in ((7, 14), (138, 14)))
    b = torch.randn(138, generator=gen).to(device, torch.bfloat16)
    g = torch.randn(7, 138, generator=gen).to(device)

    def run(x, w):
        op = ops.linear
        if compiled:
            # A graph of its own for each run, traced for its operands.
            torch._dynamo.reset()
            op = torch.compile(ops.linear, fullgraph=True)
        x, w = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
        with torch.autocast("cuda", dtype=amp, enabled=amp is not None):
            # (ReLU with a bias: our cuBLAS node; without one, torch's ReLU)
            y = op(x, w, b if with_bias else None, activation=act)
        y.backward(g.to(y.dtype))
        return y, x.grad, w.grad

    x_off, w_off = (off_the_grid(t) if which == name else t for name, t in (("x", x), ("weight", w)))
    assert (x_off if which == "x" else w_off).data_ptr() % 16
    off = run(x_off, w_off)
    for a, o in zip(run(x, w), off):
        assert torch.equal(a, o)


# ---------------------------------------------------------------- autocast op (CPU tier)
#
# ``ops.linear`` under autocast (here with autocast_dtype patched, on CPU
# tensors: the same torch ops; the float32-output GEMM, aten::mm.dtype, has
# a CUDA kernel only, so _mm_to takes its fallback here, the product in the
# autocast dtype then cast, which is what autograd's casts give).

def _graph_nodes(t):
    """Names of every autograd node reachable from ``t``."""
    seen, stack, names = set(), [t.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        stack.extend(n for n, _ in node.next_functions)
    return names


def test_mm_to_writes_the_requested_dtype():
    assert L.MM_OUT_DTYPE == hasattr(torch.ops.aten.mm, "dtype")
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(5, 7, generator=gen).bfloat16()
    b = torch.randn(7, 3, generator=gen).bfloat16()
    assert torch.equal(L._mm_to(a, b, torch.bfloat16), a @ b)
    out = L._mm_to(a, b, torch.float32)  # CPU: the fallback
    assert out.dtype == torch.float32 and torch.equal(out, (a @ b).float())
    assert torch.equal(L._mm_to(a, b, torch.float64), (a @ b).double())
    if L.MM_OUT_DTYPE:  # the call _mm_to makes on CUDA, as the installed torch's schema has it
        meta = torch.mm(a.to("meta"), b.to("meta"), out_dtype=torch.float32)
        assert meta.dtype == torch.float32 and meta.shape == (5, 3)


@pytest.mark.parametrize("x_dims", [2, 3])
@pytest.mark.parametrize("activation", [None, "relu"])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("amp", [torch.bfloat16, torch.float16], ids=str)
def test_linear_under_autocast_is_one_node_with_float32_gradients(
        amp, with_bias, activation, x_dims, past_device_check, monkeypatch):
    """Float32 x, W, bias under autocast: the output is F.linear's on the
    casts (the same addmm / mm), the gradients float32 from one node whose
    next functions are the leaves (no cast nodes), x's and W's equal to
    autograd's casts' (bitwise here: the fallback computes what they do),
    the bias's summed in float32; the node saves the casts."""
    monkeypatch.setattr(L, "autocast_dtype", lambda: amp)
    gen = torch.Generator().manual_seed(6)
    shape = (7, 33) if x_dims == 2 else (2, 4, 33)
    x = torch.rand(shape, generator=gen) - 0.5
    w, b = torch.randn(19, 33, generator=gen), torch.randn(19, generator=gen)
    dy = torch.randn(shape[:-1] + (19,), generator=gen).to(amp)
    leaves = [t.clone().requires_grad_(True) for t in (x, w, b)][:3 if with_bias else 2]
    y = ops.linear(*leaves, activation=activation)
    ref = [t.clone().requires_grad_(True) for t in (x, w, b)][:3 if with_bias else 2]
    y_ref = torch.nn.functional.linear(*[t.to(amp) for t in ref])
    y_ref = torch.relu(y_ref) if activation else y_ref
    assert y.dtype == amp and torch.equal(y, y_ref)
    assert "ToCopyBackward0" not in _graph_nodes(y)
    if activation is None and x_dims == 2:  # x's cast saved, W's kept for one use
        assert [t.dtype for t in y.grad_fn.saved_tensors] == [amp]
    y.backward(dy)
    y_ref.backward(dy)
    for ours, theirs in zip(leaves, ref):
        assert ours.grad.dtype == torch.float32
    assert torch.equal(leaves[0].grad, ref[0].grad) and torch.equal(leaves[1].grad, ref[1].grad)
    if with_bias:
        exact = dy.double().reshape(-1, 19) * (y > 0).reshape(-1, 19) if activation else \
            dy.double().reshape(-1, 19)
        torch.testing.assert_close(leaves[2].grad, exact.sum(0).float())


@pytest.mark.skipif(getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None) is None,
                    reason="telling whether saved-tensor hooks are active: torch >= 2.8")
@pytest.mark.parametrize("route", ["cublas-relu", "autocast"])
def test_nodes_keep_nothing_beside_saved_tensor_hooks(route, past_device_check, monkeypatch):
    """Where saved-tensor hooks are active (torch.utils.checkpoint's
    non-reentrant mode, torch.autograd.graph.save_on_cpu), no node keeps a
    tensor for one use, which the hooks would not see: the cuBLAS bias +
    ReLU node saves x and the weight and gates with a native relu_ (which
    saves the output), the autocast product saves the weight's cast.  The
    gradients are those without hooks, bit for bit, and under checkpoint
    too."""
    dtype, activation, precision = _route_setup(route, monkeypatch)
    gen = torch.Generator().manual_seed(14)
    x, w, b = (torch.randn(*s, generator=gen).to(dtype) for s in [(6, 8), (12, 8), (12,)])
    dy = torch.randn(6, 12, generator=gen).bfloat16()
    grads = []
    for mode in ("plain", "hooks", "checkpoint"):
        leaves = [t.clone().requires_grad_(True) for t in (x, w, b)]
        packed = []

        def pack(t):
            packed.append(tuple(t.shape))
            return t

        def run(*t):
            return ops.linear(*t, activation=activation, precision=precision)

        if mode == "checkpoint":
            y = checkpoint(run, *leaves, use_reentrant=False)
        else:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if mode == "hooks" \
                    else contextlib.nullcontext():
                y = run(*leaves)
        nodes = [y.grad_fn] + [f for f, _ in y.grad_fn.next_functions if f is not None]
        kept = [a for n in nodes for a in ("kept_output", "kept_w_d")
                if isinstance(getattr(n, a, None), torch.Tensor)]
        assert kept == ([] if mode != "plain" else
                        ["kept_output" if route == "cublas-relu" else "kept_w_d"])
        if mode == "hooks":  # x (or its cast), the weight (or its cast); relu's output
            assert sorted(packed) == sorted([(6, 8), (12, 8)] + [(6, 12)] * (route == "cublas-relu"))
        y.backward(dy.to(y.dtype))
        grads.append([t.grad for t in leaves])
    for other in grads[1:]:
        assert all(torch.equal(a, c) for a, c in zip(grads[0], other))


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
@pytest.mark.parametrize("hooks", [False, True], ids=["plain", "checkpoint"])
@pytest.mark.parametrize("route", ["tensor-core", "cublas-relu", "autocast"])
def test_double_backward_refused_and_create_graph_under_checkpoint(route, hooks, past_device_check,
                                                                   monkeypatch):
    """A penalty on x's gradient (from a constant incoming gradient: dX =
    dz W), differentiated with respect to the weight, is refused, also
    where the node saved only the weight's cast, which has no history (the
    weight anchors it).  A create_graph backward under
    torch.utils.checkpoint's non-reentrant mode gives the first-order
    gradients (each saved tensor unpacked once)."""
    dtype, activation, precision = _route_setup(route, monkeypatch)
    gen = torch.Generator().manual_seed(15)
    x, w, b = (torch.randn(*s, generator=gen).to(dtype) for s in [(6, 8), (12, 8), (12,)])
    dy = torch.randn(6, 12, generator=gen).bfloat16()

    def run(*t):
        y = ops.linear(*t, activation=activation, precision=precision)
        return y * 1.0 if hooks else y  # (checkpoint: an output of its own)

    def forward(leaves):
        if hooks:
            return checkpoint(run, *leaves, use_reentrant=False)
        return run(*leaves)

    leaves = [t.clone().requires_grad_(True) for t in (x, w, b)]
    (gx,) = torch.autograd.grad(forward(leaves).sum(), leaves[0], create_graph=True)
    with pytest.raises(RuntimeError, match=r"cupy_fused::\w+ does not support double backward"):
        torch.autograd.grad(gx.square().sum(), leaves[1], allow_unused=True)
    first = []
    for create_graph in (False, True):
        leaves = [t.clone().requires_grad_(True) for t in (x, w, b)]
        y = forward(leaves)
        y.backward(dy.to(y.dtype), create_graph=create_graph)
        first.append([t.grad.detach() for t in leaves])
        for t in leaves:
            t.grad = None  # (create_graph: a reference cycle through .grad)
    assert all(torch.equal(a, c) for a, c in zip(*first))


@pytest.mark.skipif(not AG.HAS_CUSTOM_OP, reason="torch.library.custom_op: torch >= 2.4")
def test_custom_op_called_directly_anchors_inputs_without_their_memory(past_device_check):
    """The autocast product's registered custom op called directly (torch
    runs its setup with autograd's dispatch keys excluded), on inputs that
    are not leaves: a penalty on the weight's gradient, differentiated with
    respect to what x came from, is refused (x anchors it: the node saves
    only x's detached cast), and the anchor keeps none of x's storage."""
    gen = torch.Generator().manual_seed(16)
    a = torch.randn(6, 8, generator=gen).requires_grad_(True)
    w0 = torch.randn(12, 8, generator=gen).requires_grad_(True)
    x, w = a * 1.0, w0 * 1.0
    storage = weakref.ref(x.untyped_storage())
    y = torch.ops.cupy_fused.linear_autocast(x, w, None, x.detach().bfloat16(),
                                             w.detach().bfloat16(), None)
    del x
    assert storage() is None
    (gw,) = torch.autograd.grad(y.float().sum(), w0, create_graph=True)
    with pytest.raises(RuntimeError, match=r"cupy_fused::\w+ does not support double backward"):
        torch.autograd.grad(gw.square().sum(), a, allow_unused=True)


def test_linear_under_autocast_keeps_half_operands_and_their_dtypes(past_device_check,
                                                                   monkeypatch):
    """A bfloat16 input meeting float32 parameters: x's gradient in bfloat16,
    W's in float32; a bfloat16 operand is saved itself, not copied."""
    monkeypatch.setattr(L, "autocast_dtype", lambda: torch.bfloat16)
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(6, 16, generator=gen).bfloat16().requires_grad_(True)
    w = torch.randn(8, 16, generator=gen).requires_grad_(True)
    y = ops.linear(x, w)
    (saved_x,) = y.grad_fn.saved_tensors
    assert saved_x.data_ptr() == x.data_ptr()
    y.backward(torch.ones_like(y))
    assert x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    torch.testing.assert_close(w.grad, (torch.ones(6, 8).bfloat16().t() @ x.detach()).float())
    # Autocast's F.linear takes a bias of any of the three, and no other.
    for dtype in (torch.int64, torch.float64):
        with pytest.raises(TypeError, match=f"bias must have dtype float32, float16 or bfloat16, "
                                            f"got {dtype}"):
            ops.linear(x, w, torch.ones(8, dtype=dtype))


def test_autocast_linear_retained_graph_recasts_the_weight(past_device_check, monkeypatch):
    """The weight's cast is dropped by the first backward (before dW is
    allocated); a second backward through a retained graph recasts it, and
    refuses if the weight changed in place meanwhile; an inference-mode
    weight, which has no version counter, passes."""
    monkeypatch.setattr(L, "autocast_dtype", lambda: torch.bfloat16)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(5, 12, generator=gen).requires_grad_(True)
    w = torch.randn(4, 12, generator=gen).requires_grad_(True)
    y = ops.linear(x, w)
    g = torch.randn(5, 4, generator=gen).bfloat16()
    y.backward(g, retain_graph=True)
    first = (x.grad.clone(), w.grad.clone())
    y.backward(g, retain_graph=True)
    assert torch.equal(x.grad, 2 * first[0]) and torch.equal(w.grad, 2 * first[1])
    with torch.no_grad():
        w.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward(g)
    # A weight made in inference mode has no version counter to check: it
    # trains as the reference's does (x's gradient as with w's values).
    with torch.inference_mode():
        frozen = w.detach().clone()
    x.grad = None
    y = ops.linear(x, frozen)
    y.backward(g, retain_graph=True)
    y.backward(g)
    want = (g.float() @ frozen.bfloat16().float()).to(x.dtype)
    torch.testing.assert_close(x.grad, 2 * want, rtol=2e-2, atol=2e-2)


def test_autocast_linear_refuses_a_weight_of_its_dtype_changed_in_place(past_device_check,
                                                                         monkeypatch):
    """A weight already in autocast's dtype is read as it is (its "cast" is
    the weight itself): changed in place between the forward and the first
    backward, the backward is refused where dX reads it, as autograd refuses
    F.linear's saved weight.  A float32 weight changed in place is not: the
    product read its cast, which did not change (the reference's backward
    reads its cast too)."""
    monkeypatch.setattr(L, "autocast_dtype", lambda: torch.bfloat16)
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(5, 12, generator=gen).bfloat16().requires_grad_(True)
    for dtype in (torch.bfloat16, torch.float32):
        w = torch.randn(4, 12, generator=gen).to(dtype).requires_grad_(True)
        w_then = w.detach().clone()
        y = ops.linear(x, w)
        with torch.no_grad():
            w.mul_(10)
        if dtype == torch.bfloat16:
            with pytest.raises(RuntimeError, match="modified by an inplace operation: the weight"):
                y.sum().backward()
            # An x that needs no gradient: no dX, the weight not read, as
            # F.linear then saves no weight.
            y = ops.linear(x.detach(), w)
            with torch.no_grad():
                w.mul_(10)
            y.sum().backward()
            torch.testing.assert_close(w.grad.float(), torch.ones(4, 5) @ x.detach().float(),
                                       rtol=1e-2, atol=1e-2)
        else:
            x.grad = None
            y.sum().backward()
            want = torch.ones(5, 4) @ w_then.bfloat16().float()
            torch.testing.assert_close(x.grad.float(), want, rtol=1e-2, atol=1e-2)


def test_autocast_linear_without_bias_gradient(past_device_check):
    """bias_grad=False (linear_gn_chain's GEMM): the bias is in the product,
    its gradient left to the caller."""
    gen = torch.Generator().manual_seed(9)
    x, w = torch.randn(5, 12, generator=gen), torch.randn(4, 12, generator=gen)
    b = torch.randn(4, generator=gen).requires_grad_(True)
    x.requires_grad_(True)
    z = L._run_autocast_linear(x, w, b, torch.bfloat16, bias_grad=False)
    assert torch.equal(z, torch.addmm(b.detach().bfloat16(), x.detach().bfloat16(),
                                      w.bfloat16().t()))
    z.sum().backward()
    assert b.grad is None and x.grad.dtype == torch.float32 and w.grad is None


def test_autocast_linear_traces_under_compile(past_device_check, monkeypatch):
    """fullgraph torch.compile (the registered custom ops): eager's output
    and gradients, bit for bit."""
    monkeypatch.setattr(L, "autocast_dtype", lambda: torch.bfloat16)
    gen = torch.Generator().manual_seed(10)
    x, w, b = torch.randn(9, 24, generator=gen), torch.randn(16, 24, generator=gen), \
        torch.randn(16, generator=gen)
    dy = torch.randn(9, 16, generator=gen).bfloat16()
    eager = [t.clone().requires_grad_(True) for t in (x, w, b)]
    y = ops.linear(*eager)
    y.backward(dy)
    torch._dynamo.reset()
    compiled = torch.compile(lambda *t: ops.linear(*t), backend="aot_eager", fullgraph=True)
    traced = [t.clone().requires_grad_(True) for t in (x, w, b)]
    y2 = compiled(*traced)
    y2.backward(dy)
    assert torch.equal(y2, y)
    for a, c in zip(eager, traced):
        assert c.grad.dtype == torch.float32 and torch.equal(a.grad, c.grad)


# ---------------------------------------------------------------- the float32-weight product traced

def _float32_weight_device(device):
    from cupy_fused.ops import gemm as G

    if not G.has_wgmma(device.index) or G.sm_count(device.index) > 132:
        pytest.skip("the float32-weight route at these shapes needs a Hopper GPU of at most 132 SMs")


def _float32_weight_case(device, dtype=torch.float32):
    # 512 rows of x (2 tiles) and 33 tiles of W's rows: 66 tiles, at least
    # half of 132 SMs (test_gemm.py's test_float32_weight_route).
    gen = torch.Generator().manual_seed(11)
    return (torch.randn(512, 64, generator=gen).to(device, dtype),
            (torch.randn(128 * 33, 64, generator=gen) / 8).to(device),
            torch.randn(128 * 33, generator=gen).to(device))


@pytest.mark.parametrize("case", ["aligned", "half_x_off_the_grid", "weight_off_the_grid"])
def test_float32_weight_product_traces_under_compile(case, past_device_check, monkeypatch):
    """Autocast inference of few rows under torch.compile (fullgraph,
    aot_eager; CPU tensors, a 132-SM Hopper GPU stood in for and the kernel
    by a product that records its operands): the traced graph runs the
    float32-weight product, planned with no address known, as the op
    cupy_fused::linear_float32_weight, on operands on the 16-byte grid (a
    bfloat16 x off it copied, as the eager call copies it), giving the eager
    call's result; a float32 weight off the grid takes its cast and cuBLAS
    there, as in the eager call.  (Before, a traced call cast the weight
    and ran cuBLAS whatever its operands.)"""
    from cupy_fused.ops import gemm as G

    monkeypatch.setattr(L, "autocast_dtype", lambda: torch.bfloat16)
    monkeypatch.setattr(G, "has_wgmma", lambda dev: True)
    monkeypatch.setattr(G, "sm_count", lambda dev: 132)
    ran = []

    def product(x_d, weight, bias_d):
        ran.append(x_d.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0)
        return torch.addmm(bias_d, x_d, weight.to(x_d.dtype).t())

    monkeypatch.setattr(L, "_run_float32_weight", product)
    x, w, b = _float32_weight_case("cpu", torch.bfloat16 if case == "half_x_off_the_grid" else torch.float32)
    x, w = (off_the_grid(x) if case == "half_x_off_the_grid" else x,
            off_the_grid(w) if case == "weight_off_the_grid" else w)
    with torch.no_grad():
        want = ops.linear(x, w, b)
        torch._dynamo.reset()
        got = torch.compile(lambda *t: ops.linear(*t), backend="aot_eager", fullgraph=True)(x, w, b)
    assert ran == ([] if case == "weight_off_the_grid" else [True, True])
    assert got.dtype == want.dtype == torch.bfloat16 and torch.equal(got, want)


@gpu
@pytest.mark.parametrize("case", ["aligned", "half_x_off_the_grid"])
def test_compiled_float32_weight_product(case, device, launches):
    """Autocast inference of few rows compiled (fullgraph) on Hopper: the
    float32-weight kernel (no cast of W, no cuBLAS), bit for bit the eager
    call's result, a bfloat16 x off the 16-byte grid included.  (Inductor
    copies graph inputs off its own alignment before the graph runs, so a
    weight off the grid reaches the op aligned here: the op's own fallback
    is test_float32_weight_product_traces_under_compile's.)"""
    _float32_weight_device(device)
    x, w, b = _float32_weight_case(device, torch.bfloat16 if case == "half_x_off_the_grid" else torch.float32)
    x = off_the_grid(x) if case == "half_x_off_the_grid" else x
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        want = ops.linear(x, w, b)
        torch._dynamo.reset()
        compiled = torch.compile(ops.linear, fullgraph=True)
        launches.clear()
        got = compiled(x, w, b)
    assert any("f32_weight" in launch.name for launch in launches), launches
    assert got.dtype == want.dtype == torch.bfloat16 and torch.equal(got, want)


@gpu
def test_compiled_float32_weight_product_with_dynamic_rows(device, launches):
    """The float32-weight product traced with a symbolic number of rows
    (torch.compile(dynamic=True)): one graph for 512, 640 and 1024 rows,
    each taking the float32-weight kernel, bit for bit the eager result."""
    from torch._dynamo.utils import counters

    _float32_weight_device(device)
    _, w, b = _float32_weight_case(device)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(ops.linear, fullgraph=True, dynamic=True)
    for rows in (512, 640, 1024):
        x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows)).to(device)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            want = ops.linear(x, w, b)
            launches.clear()
            got = compiled(x, w, b)
        assert any("f32_weight" in launch.name for launch in launches), (rows, launches)
        assert torch.equal(got, want), rows
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


@pytest.mark.gpu
def test_compiled_half_linear_on_a_transposed_input(device):
    """Inductor asserts the strides of the backward op's gradients against
    its fake's: on the cuBLAS route a transposed x or weight keeps its
    strides into the backward, whose products are contiguous all the
    same."""
    gen = torch.Generator().manual_seed(3)
    xt = torch.randn(40, 7, generator=gen).to(device, torch.bfloat16).t()
    wt = torch.randn(40, 24, generator=gen).to(device, torch.bfloat16).t()
    b = torch.randn(24, generator=gen).to(device, torch.bfloat16)
    dy = torch.randn(7, 24, generator=gen).to(device, torch.bfloat16)

    def step(fn):
        leaves = [t.detach().clone().requires_grad_(True) for t in (xt, wt, b)]
        y = fn(*leaves)
        y.backward(dy)
        return [y.detach()] + [t.grad for t in leaves]

    torch._dynamo.reset()
    eager = step(lambda *t: ops.linear(*t, activation="relu"))
    compiled = step(torch.compile(lambda *t: ops.linear(*t, activation="relu"), fullgraph=True))
    for a, c in zip(eager, compiled):
        assert torch.equal(a, c)
