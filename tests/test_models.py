"""The five fused models against the PyTorch reference (GPU tier): output
and every gradient vs a float64 run, next to eager's own error."""
import contextlib
import copy
import gc

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from cupy_fused import reference
from cupy_fused.models import MODELS
from cupy_fused.testing import build_pair, compare, held_bytes, worse_than_eager

pytestmark = pytest.mark.gpu
DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# (problem, ctor args, input shape): the small shapes plus odd ones — batch
# 1/3/257, features not a multiple of 32, 1 group, one channel per group,
# groups wider than the kernel's register slice, non-square conv inputs and
# other kernel sizes.
CASES = [(p, a, s) for p, (_, a, s) in reference.SMALL_PROBLEMS.items()] + [
    (76, (33, 77, (77,)), (1, 33)),
    (76, (100, 200, (200,)), (257, 100)),
    (37, (40, 96, 1, (96,)), (3, 40)),         # one group over all channels
    (37, (40, 40, 40, (40,)), (257, 40)),      # one channel per group
    (37, (24, 600, 1, (600,)), (5, 24)),       # group wider than 256 channels
    (37, (24, 48, 3, (48,)), (1, 24)),
    (37, (40, 128, 2, (128,)), (5, 40)),       # 64 channels per group (problem 37's)
    (88, (50, 70, 7, (70,)), (257, 50)),       # 10 channels per group
    (88, (16, 512, 2, (512,)), (3, 16)),
    (88, (16, 64, 64, (64,)), (9, 16)),
    (88, (20, 135, 3, (135,)), (7, 20)),       # 45 per group: a forward team's tail
    (94, (31, 93, (93,), 3), (257, 31)),       # ctor (in, out, bias_shape, groups)
    (94, (16, 96, (96,), 1), (2, 16)),
    (94, (16, 256, (256,), 2), (3, 16)),       # 128 per group
    (94, (16, 1000, (1000,), 4), (3, 16)),
    (1, (3, 7, 5, (7, 1, 1)), (1, 3, 17, 23)),
    (1, (4, 5, (3, 2), (5, 1, 1)), (3, 4, 9, 31)),
    (1, (2, 3, 1, (3, 1, 1)), (2, 2, 1, 1)),
    # Parameter shapes the reference broadcasts per channel other than its
    # own: one value for every channel, or a leading 1.
    (76, (33, 77, (1,)), (5, 33)),
    (37, (24, 48, 3, (1, 48)), (3, 24)),
    (88, (16, 64, 4, (1,)), (9, 16)),
    (94, (16, 96, (1,), 2), (3, 16)),
    (1, (3, 7, 5, (1, 1, 1)), (1, 3, 17, 23)),
    (1, (3, 7, 3, (1, 7, 1, 1)), (2, 3, 9, 8)),
    # Inputs of other ranks, as nn.Linear (any leading dims, or none) and
    # nn.Conv2d (one image, [C, H, W]) take them.
    (76, (33, 77, (77,)), (2, 5, 33)),
    (76, (33, 77, (77,)), (33,)),
    (1, (3, 7, 5, (7, 1, 1)), (3, 17, 23)),
    (1, (3, 7, 3, (1, 7, 1, 1)), (3, 9, 8)),
    # A bias of more dims than x's: the reference's add gives y its leading 1s.
    (76, (100, 200, (1, 200)), (100,)),
    (76, (100, 200, (1, 1, 200)), (2, 129, 100)),
    (76, (100, 200, (1, 1, 1)), (257, 100)),
    (88, (16, 64, 4, (1, 1, 64)), (9, 16)),    # 88's multiplier, after its GroupNorm
    (1, (3, 7, 3, (1, 1, 7, 1, 1)), (2, 3, 9, 8)),
    (1, (3, 7, 3, (1, 1, 1, 1, 1)), (3, 9, 8)),  # one image: [1, 1, C, OH, OW]
]


def _id(case):
    p, a, s = case
    bias = [v for v in a if isinstance(v, tuple)][-1]  # (a kernel size may come before it)
    own = bias[0] > 1 and all(d == 1 for d in bias[1:])  # the reference's own (C,) or (C, 1, 1)
    tail = "" if own else "-b" + "x".join(map(str, bias))
    return f"p{p}-{'x'.join(map(str, s))}-{'-'.join(str(v) for v in a if not isinstance(v, tuple))}{tail}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_matches_reference(case, dtype, device):
    problem, args, shape = case
    # Problem 1's convolution backward runs cuDNN's deterministic algorithms
    # (bitwise reproducible steps); in float32 with TF32 allowed those are
    # TF32 at some shapes where eager's default pick, nondeterministic, is
    # not.  Its error is measured against eager under the same restriction.
    deterministic = torch.backends.cudnn.deterministic
    torch.backends.cudnn.deterministic = problem == 1
    try:
        errors = compare(problem, args, shape, dtype, device, seed=hash(case) % 1000)
    finally:
        torch.backends.cudnn.deterministic = deterministic
    bad = worse_than_eager(errors, dtype)
    assert not bad, {n: errors[n] for n in bad}


def _gemm_with_bias(model):
    gemm = model.gemm
    gen = torch.Generator().manual_seed(5)
    gemm.bias = torch.nn.Parameter(
        (torch.rand(gemm.out_features, generator=gen) - 0.5).to(gemm.weight))


def _conv_padded(mode):
    def mutate(model):
        old = model.conv
        new = torch.nn.Conv2d(old.in_channels, old.out_channels, old.kernel_size, padding=1,
                              padding_mode=mode).to(old.weight)
        with torch.no_grad():
            new.weight.copy_(old.weight)
            new.bias.copy_(old.bias)
        model.conv = new
    return mutate


def _random_group_norm_weight(model):
    """The GroupNorm's weight random (1.5 +- 0.5), the same in each model."""
    for m in model.modules():
        if isinstance(m, torch.nn.GroupNorm):
            gen = torch.Generator().manual_seed(11)
            with torch.no_grad():
                m.weight.copy_(torch.rand(m.weight.shape, generator=gen) + 1.0)


def _conv_without_bias(model):
    model.conv.bias = None


def _float32_bias(model):
    """``bias`` float32 in a model of any dtype: the reference's add
    promotes, and so does its output."""
    model.bias = torch.nn.Parameter(model.bias.detach().float())


def _weight_norm(name):
    """The submodule's weight parametrized by weight_norm (its class then
    torch's parametrized subclass; the gradients go to original0 / 1)."""
    def mutate(model):
        torch.nn.utils.parametrizations.weight_norm(getattr(model, name))
    return mutate


def _group_norm_eps(eps):
    def mutate(model):
        for m in model.modules():
            if isinstance(m, torch.nn.GroupNorm):
                m.eps = eps
    return mutate


# A submodule of the reference's class with other options than the
# reference's own: the fused forward must compute what the reference does.
VARIANTS = {
    "gemm-with-bias": (76, _gemm_with_bias),
    "conv-reflect-padding": (1, _conv_padded("reflect")),
    "conv-zero-padding": (1, _conv_padded("zeros")),
    "conv-without-bias": (1, _conv_without_bias),
    "float32-bias-76": (76, _float32_bias),
    "float32-bias-1": (1, _float32_bias),
    "weight-norm-1": (1, _weight_norm("conv")),
    "weight-norm-37": (37, _weight_norm("matmul")),
    "weight-norm-76": (76, _weight_norm("gemm")),
    "weight-norm-88": (88, _weight_norm("gemm")),
    "weight-norm-94": (94, _weight_norm("gemm")),
    "gn-eps-0-37": (37, _group_norm_eps(0.0)),
    "gn-eps-0-88": (88, _group_norm_eps(0.0)),
    "gn-eps-0-94": (94, _group_norm_eps(0.0)),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_submodule_options_match_reference(variant, dtype, device):
    problem, mutate = VARIANTS[variant]
    _, args, shape = reference.SMALL_PROBLEMS[problem]
    errors = compare(problem, args, shape, dtype, device, seed=7, mutate=mutate)
    bad = worse_than_eager(errors, dtype)
    assert not bad, {n: errors[n] for n in bad}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("problem", sorted(reference.SMALL_PROBLEMS))
def test_sum_backward_uses_the_broadcast_gradient(problem, dtype, device):
    """``y.sum().backward()`` (one upstream value, broadcast).  Where the
    GroupNorm is the last step (37, 94), its weight is made random first:
    with the initial ones every gradient before it is exactly zero, and
    the errors would compare rounding noise."""
    _, args, shape = reference.SMALL_PROBLEMS[problem]
    errors = compare(problem, args, shape, dtype, device, grad_mode="sum",
                     mutate=_random_group_norm_weight)
    bad = worse_than_eager(errors, dtype)
    assert not bad, {n: errors[n] for n in bad}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_channels_last_conv_keeps_its_layout(dtype, device):
    errors = compare(1, (8, 16, 3, (16, 1, 1)), (2, 8, 13, 11), dtype, device,
                     layout="channels_last")
    assert not worse_than_eager(errors, dtype)
    ref, ours = build_pair(1, (8, 16, 3, (16, 1, 1)), device, dtype)
    x = torch.rand(2, 8, 13, 11, device=device, dtype=dtype).contiguous(memory_format=torch.channels_last)
    assert ours(x).stride() == ref(x).stride()
    x = x.contiguous()
    assert ours(x).stride() == ref(x).stride()


@pytest.mark.slow
@pytest.mark.parametrize("problem", sorted(reference.PROBLEMS))
def test_benchmark_shapes(problem, device):
    """fp32 at the benchmark shapes: error vs float64 next to eager's, and the
    original task's allclose(ours, eager, 1e-5, 1e-5) for the GEMM problems."""
    _, args, shape = reference.PROBLEMS[problem]
    errors = compare(problem, args, shape, torch.float32, device)
    bad = worse_than_eager(errors, torch.float32)
    assert not bad, {n: errors[n] for n in bad}
    if problem != 1:
        ref, ours = build_pair(problem, args, device, torch.float32)
        x = torch.rand(shape, device=device)
        with torch.no_grad():
            y_ours, y_eager = ours(x), ref(x)
            mismatch = ~torch.isclose(y_ours, y_eager, atol=1e-5, rtol=1e-5)
            if mismatch.any():
                # The check compares two float32 results.  Where it fails, the
                # float64 run must show the error is eager's (cuBLAS SGEMM's
                # sums are the less accurate here), on a handful of elements.
                y64 = copy.deepcopy(ref).double()(x.double())
                ours_err = (y_ours.double() - y64)[mismatch].abs()
                eager_err = (y_eager.double() - y64)[mismatch].abs()
                assert mismatch.sum().item() <= 1e-5 * y64.numel(), mismatch.sum().item()
                assert (ours_err < eager_err).all(), (ours_err.max().item(), eager_err.max().item())


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("problem", sorted(reference.PROBLEMS))
def test_ieee_precision_meets_allclose_1e5_against_eager(problem, seed, device):
    """The original task's assertion, allclose(ours, eager_fp32, atol=rtol=1e-5)
    at the benchmark shapes: met with precision="ieee" (cuBLAS SGEMM, as
    eager: the default 3xTF32 GEMM is closer to float64 than eager's SGEMM,
    and eager's own error then trips the check on a few elements)."""
    _, args, shape = reference.PROBLEMS[problem]
    ref, ours = build_pair(problem, args, device, torch.float32)
    if problem != 1:  # the convolution is cuDNN's for both
        ours.precision = "ieee"
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.rand(shape, generator=gen).to(device)
    with torch.no_grad():
        y_ours, y_eager = ours(x), ref(x)
    torch.testing.assert_close(y_ours, y_eager, atol=1e-5, rtol=1e-5)


def _train_step(model, x, dy):
    for p in model.parameters():
        p.grad = None
    x = x.detach().clone().requires_grad_(True)
    out = model(x)
    out.backward(dy)
    return [out.detach(), x.grad] + [p.grad for p in model.parameters()]


@pytest.mark.parametrize("problem", sorted(reference.SMALL_PROBLEMS))
def test_bitwise_reproducible(problem, device):
    _, args, shape = reference.PROBLEMS[problem] if problem != 1 else reference.SMALL_PROBLEMS[1]
    _, ours = build_pair(problem, args, device, torch.float32)
    x = torch.rand(shape, device=device)
    dy = torch.randn_like(ours(x))
    first = _train_step(ours, x, dy)
    second = _train_step(ours, x, dy)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("problem", sorted(reference.SMALL_PROBLEMS))
def test_gradients_accumulate_in_memory_of_their_own(problem, dtype, device):
    """A second backward adds to every parameter's gradient, and no two
    gradients share memory (94's two biases get the same sum: two rows, so
    accumulating into one leaves the other alone)."""
    _, args, shape = reference.SMALL_PROBLEMS[problem]
    _, ours = build_pair(problem, args, device, dtype)
    x = torch.rand(shape, device=device, dtype=dtype)
    dy = torch.randn_like(ours(x))
    ours(x).backward(dy)
    params = list(ours.parameters())
    once = [p.grad.clone() for p in params]
    spans = sorted((p.grad.data_ptr(), p.grad.data_ptr() + p.grad.numel() * p.grad.element_size())
                   for p in params)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:])), spans
    ours(x).backward(dy)
    for p, g in zip(params, once):
        assert torch.equal(p.grad, 2 * g)


@pytest.mark.parametrize("problem", sorted(reference.SMALL_PROBLEMS))
def test_non_contiguous_input(problem, device):
    _, args, shape = reference.SMALL_PROBLEMS[problem]
    errors = compare(problem, args, shape, torch.float32, device, layout="strided")
    bad = worse_than_eager(errors, torch.float32)
    assert not bad, {n: errors[n] for n in bad}


@pytest.mark.parametrize("problem", sorted(reference.SMALL_PROBLEMS))
def test_saves_less_than_eager_and_nothing_without_grad(problem, device):
    _, args, shape = reference.SMALL_PROBLEMS[problem]
    ref, ours = build_pair(problem, args, device, torch.float32)
    x = torch.rand(shape, device=device, requires_grad=True)

    def saved_bytes(model):
        seen = {}

        def pack(t):
            seen[(t.data_ptr(), t.dtype, tuple(t.shape))] = t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(x)
        return sum(seen.values())

    assert saved_bytes(ours) < saved_bytes(ref)
    with torch.no_grad():
        ours(x)  # compile and warm up
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated(device)
        out = ours(x)
        torch.cuda.synchronize()
        extra = torch.cuda.memory_allocated(device) - before
    assert extra <= out.numel() * out.element_size() + 512, extra


def _held_by_graph(model, shape, device, dtype, x_grad: bool, amp) -> int:
    """Bytes that one forward leaves held, its output included, beyond its
    input's leaf: x is a product of that leaf, as a layer's input in a
    network, which only the graph can keep."""
    leaf = torch.rand(shape, device=device, dtype=dtype).requires_grad_(x_grad)

    def forward():
        with torch.autocast("cuda", dtype=amp) if amp else contextlib.nullcontext():
            return model(leaf * 1.0)

    return held_bytes(forward, device)


def _freeze_linear_weight(model):
    next(m for m in model.modules() if isinstance(m, torch.nn.Linear)).weight.requires_grad_(False)


@pytest.mark.parametrize("mode", ["fp32", "bf16", "amp-bf16"])
@pytest.mark.parametrize("problem", [37, 76, 88, 94])
def test_frozen_parts_keep_nothing_for_gradients_not_wanted(problem, mode, device):
    """As F.linear's product: with the linear layer's weight frozen the graph
    keeps neither x nor its cast, with an input that needs no gradient (a
    first layer) no cast of the weight; either way it holds no more than the
    reference's graph (but for 76's 1-bit ReLU mask, where the reference's
    ReLU keeps the output), and the gradients are within 1.5x eager's
    error."""
    dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    amp = torch.bfloat16 if mode == "amp-bf16" else None
    _, args, shape = reference.SMALL_PROBLEMS[problem]
    ref, ours = build_pair(problem, args, device, dtype)
    x_bytes = shape[0] * shape[1] * (2 if amp else torch.finfo(dtype).bits // 8)  # x, or its cast
    w_bytes = args[0] * args[1] * 2  # the weight's cast
    mask = -(-shape[0] * args[1] // 8 // 512) * 512 if problem == 76 else 0
    trained = _held_by_graph(ours, shape, device, dtype, True, amp)
    first_layer = _held_by_graph(ours, shape, device, dtype, False, amp)
    assert first_layer <= trained - (w_bytes if amp else 0), (first_layer, trained)
    assert first_layer <= _held_by_graph(ref, shape, device, dtype, False, amp) + mask
    for model in (ref, ours):
        _freeze_linear_weight(model)
    frozen = _held_by_graph(ours, shape, device, dtype, True, amp)
    assert frozen <= trained - x_bytes, (frozen, trained)
    assert frozen <= _held_by_graph(ref, shape, device, dtype, True, amp) + mask
    for input_grad in (True, False):
        errors = compare(problem, args, shape, dtype, device, autocast=amp,
                         mutate=_freeze_linear_weight, input_grad=input_grad)
        assert ("x.grad" in errors) == input_grad
        bad = worse_than_eager(errors, amp or dtype)
        assert not bad, {n: errors[n] for n in bad}


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("mode", ["fp32", "bf16", "amp-bf16"])
@pytest.mark.parametrize("problem", sorted(reference.SMALL_PROBLEMS))
def test_activation_checkpointing(problem, mode, reentrant, device):
    """torch.utils.checkpoint over the module: the output and gradients
    without it, bit for bit.  Non-reentrant (saved-tensor hooks drop what
    the graph saves until the backward recomputes it), the forward leaves
    no more held than the reference's under the same checkpoint: nothing
    of the module's kept beside its input and output."""
    if not reentrant and getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None) is None:
        pytest.skip("telling whether saved-tensor hooks are active: torch >= 2.8")
    dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    amp = torch.bfloat16 if mode == "amp-bf16" else None
    _, args, shape = reference.SMALL_PROBLEMS[problem]
    ref, ours = build_pair(problem, args, device, dtype)
    x = torch.rand(shape, device=device, dtype=dtype)
    results = []
    for wrapped in (False, True):
        for p in ours.parameters():
            p.grad = None
        xg = x.clone().requires_grad_(True)
        with torch.autocast("cuda", dtype=amp) if amp else contextlib.nullcontext():
            y = checkpoint(ours, xg, use_reentrant=reentrant) if wrapped else ours(xg)
        dy = torch.randn(y.shape, device=device, generator=torch.Generator(device).manual_seed(3))
        y.backward(dy.to(y.dtype))
        results.append([y.detach(), xg.grad] + [p.grad for p in ours.parameters()])
    for plain, checkpointed in zip(*results):
        assert torch.equal(plain, checkpointed)
    if not reentrant:
        held = [_held_by_graph(lambda t, m=m: checkpoint(m, t, use_reentrant=False), shape, device,
                               dtype, True, amp) for m in (ref, ours)]
        assert held[1] <= held[0], held


@pytest.mark.parametrize("frozen", ["weight", "x"])
@pytest.mark.parametrize("mode", ["fp32", "bf16", "amp-bf16"])
@pytest.mark.parametrize("problem", [76, 88])
def test_frozen_parts_under_compile(problem, mode, frozen, device):
    """torch.compile(fullgraph=True) with the linear weight frozen, or an
    input that needs no gradient (the custom ops' backwards then get None
    for the operand not saved): eager's output and gradients."""
    dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    amp = torch.bfloat16 if mode == "amp-bf16" else None
    _, args, shape = reference.SMALL_PROBLEMS[problem]
    _, ours = build_pair(problem, args, device, dtype)
    if frozen == "weight":
        _freeze_linear_weight(ours)
    x = torch.rand(shape, device=device, dtype=dtype)
    dy = torch.randn(shape[0], args[1], device=device)
    torch._dynamo.reset()
    results = []
    for model in (ours, torch.compile(ours, fullgraph=True)):
        for p in ours.parameters():
            p.grad = None
        xg = x.clone().requires_grad_(frozen == "weight")
        with torch.autocast("cuda", dtype=amp) if amp else contextlib.nullcontext():
            y = model(xg)
        y.backward(dy.to(y.dtype))
        results.append([y.detach(), xg.grad] + [p.grad for p in ours.parameters()])
    for eager, compiled in zip(*results):
        assert (eager is None) == (compiled is None)
        if eager is not None:
            torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("problem", sorted(reference.SMALL_PROBLEMS))
def test_autocast_half_input_meets_float32_parameters(problem, device):
    """Under autocast a bfloat16 input meets float32 parameters: the result
    and every gradient have the reference's dtype (float32: its adds with a
    float32 parameter promote, its GroupNorm runs in float32), each within
    1.5x eager's error."""
    _, args, shape = reference.SMALL_PROBLEMS[problem]
    errors = compare(problem, args, shape, torch.float32, device, autocast=torch.bfloat16,
                     input_dtype=torch.bfloat16)  # (dtypes: compare asserts eager's)
    bad = worse_than_eager(errors, torch.bfloat16)
    assert not bad, {n: errors[n] for n in bad}


@pytest.mark.parametrize("problem", sorted(reference.SMALL_PROBLEMS) + ["76-3d", "1-unbatched"])
def test_torch_compile_fullgraph(problem, device):
    # (the other input ranks: 76's [*, in_features], problem 1's one image)
    other_rank = {"76-3d": lambda s: (2, 3, s[-1]), "1-unbatched": lambda s: s[1:]}
    reshape = other_rank.get(problem, lambda s: s)
    problem = int(str(problem).split("-")[0])
    _, args, shape = reference.SMALL_PROBLEMS[problem]
    shape = reshape(shape)
    _, ours = build_pair(problem, args, device, torch.float32)
    x = torch.rand(shape, device=device)
    dy = torch.randn_like(ours(x))
    expected = _train_step(ours, x, dy)
    torch._dynamo.reset()
    compiled = torch.compile(ours, fullgraph=True)
    got = _train_step(compiled, x, dy)
    for a, b in zip(expected, got):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("problem", sorted(reference.SMALL_PROBLEMS))
def test_cuda_graph_capture_and_replay(problem, device):
    _, args, shape = reference.SMALL_PROBLEMS[problem]
    _, ours = build_pair(problem, args, device, torch.float32)
    static_x = torch.rand(shape, device=device, requires_grad=True)
    static_dy = torch.randn_like(ours(static_x))
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            ours.zero_grad(set_to_none=True)
            static_x.grad = None
            ours(static_x).backward(static_dy)
    torch.cuda.current_stream(device).wait_stream(side)
    ours.zero_grad(set_to_none=True)
    static_x.grad = None
    graph = torch.cuda.CUDAGraph()
    gc.collect()  # no dead graph of an earlier test may be freed during this capture
    with torch.cuda.graph(graph):
        static_out = ours(static_x)
        static_out.backward(static_dy)
    new_x = torch.rand(shape, device=device)
    with torch.no_grad():
        static_x.copy_(new_x)
    graph.replay()
    torch.cuda.synchronize()
    # What the replay wrote, copied before the eager step below writes the
    # parameters' .grad anew (read after it, they would be its own).
    got = [t.clone() for t in [static_out, static_x.grad] + [p.grad for p in ours.parameters()]]
    expected = _train_step(ours, new_x, static_dy)
    for a, b in zip(expected, got):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", ["float32", "bfloat16", "amp_bf16"])
@pytest.mark.parametrize("problem", sorted(reference.SMALL_PROBLEMS))
def test_make_graphed_callables(problem, mode, device):
    """A module under ``torch.cuda.make_graphed_callables`` (its forward
    and backward captured as CUDA graphs: the host issues two replays a
    step instead of every kernel; under autocast with autocast's cast cache
    off, as make_graphed_callables asks): each replay, on a new input and
    output gradient, gives bit for bit the output and every gradient of the
    same module run without graphs."""
    _, args, shape = reference.SMALL_PROBLEMS[problem]
    amp = torch.bfloat16 if mode == "amp_bf16" else None
    dtype = torch.float32 if amp else getattr(torch, mode)
    _, ours = build_pair(problem, args, device, dtype)
    graphed = copy.deepcopy(ours)

    def forward_context():
        return torch.autocast("cuda", dtype=amp, cache_enabled=False) if amp else contextlib.nullcontext()

    def step(model, x, dy):
        for p in model.parameters():
            p.grad = None
        x = x.detach().clone().requires_grad_(True)
        with forward_context():
            out = model(x)
        out.backward(dy)
        return [out.detach(), x.grad] + [p.grad for p in model.parameters()]

    # make_graphed_callables ties the module and its graphs in a reference
    # cycle, which only the collector frees; a graph freed during another
    # capture invalidates that capture.  So: none left from earlier tests
    # before this capture, and this test's own freed when it ends.
    gc.collect()
    try:
        with forward_context():
            torch.cuda.make_graphed_callables(graphed, (torch.rand(shape, device=device, dtype=dtype,
                                                                   requires_grad=True),))
        for seed in range(2):
            gen = torch.Generator(device=device).manual_seed(seed)
            x = torch.rand(shape, device=device, dtype=dtype, generator=gen)
            with torch.no_grad(), forward_context():
                y = ours(x)
            dy = torch.randn(y.shape, device=device, generator=gen).to(y.dtype)
            expected, got = step(ours, x, dy), step(graphed, x, dy)
            assert len(got) == len(expected) and all(g is not None for g in got)
            for a, b in zip(expected, got):
                assert torch.equal(a, b)
    finally:
        del graphed
        gc.collect()


@pytest.mark.slow
def test_more_than_2_pow_31_elements(device):
    """int64 indexing: bias_relu and the GroupNorm epilogue on 2^31 + 1024
    half-precision elements (sampled rows checked against torch)."""
    from cupy_fused import ops

    rows, channels = (1 << 21) + 1, 1024
    z = torch.randn(rows, channels, device=device, dtype=torch.float16)
    bias = torch.randn(channels, device=device, dtype=torch.float16)
    pick = torch.tensor([0, 1, rows // 2, rows - 2, rows - 1], device=device)
    with torch.no_grad():
        out = ops.bias_relu(z, bias)
        torch.testing.assert_close(out[pick], torch.relu(z[pick] + bias))
        del out
        w = torch.randn(channels, device=device, dtype=torch.float16)
        out = ops.group_norm_swish_multiply_swish(z, bias, None, None, w, 8)
        zp = (z[pick] + bias).float()
        g = torch.nn.functional.group_norm(zp, 8, eps=1e-5)
        m = torch.nn.functional.silu(g) * w.float()
        torch.testing.assert_close(out[pick].float(), torch.nn.functional.silu(m), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("problem", sorted(reference.SMALL_PROBLEMS))
def test_torch_func_transforms_are_refused_naming_the_module(problem, device):
    """torch.func's wrappers of CUDA tensors pass the modules' quick check
    of x (the CPU tier's test takes the slow one): the refusal still comes
    first and names the module, not an op inside it."""
    _, args, shape = reference.SMALL_PROBLEMS[problem]
    model = MODELS[problem](*args).to(device)
    name = type(model).__name__
    x = torch.rand((3,) + tuple(shape), device=device)
    with pytest.raises(RuntimeError, match=f"cupy_fused::{name} does not support torch.vmap"):
        torch.vmap(model)(x)
    with pytest.raises(RuntimeError, match=f"cupy_fused::{name} does not support torch.func's "
                                           "gradient transforms"):
        torch.func.grad(lambda t: model(t).sum())(x[0])
