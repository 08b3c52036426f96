"""torch.export: the models export with a dynamic batch over a wide range,
and the exported programs (run, saved and loaded, differentiated) compute
what the modules compute (GPU tier).  The routing rules on sizes read the
example's while export traces (_autograd.on_example_sizes), so a
range that crosses a rule's threshold exports; that part is tested on the
CPU too."""
import contextlib
import importlib
import io
from types import SimpleNamespace

import pytest
import torch
from torch._dynamo.utils import counters
from torch.export import Dim

from cupy_fused import models, reference
from cupy_fused._autograd import on_example_sizes
from cupy_fused.testing import build_pair, rel_error

CBR = importlib.import_module("cupy_fused.ops.conv_bias_relu")
G = importlib.import_module("cupy_fused.ops.gemm")
LG = importlib.import_module("cupy_fused.ops.linear_gn_chain")

needs_is_exporting = pytest.mark.skipif(not hasattr(torch.compiler, "_is_exporting_flag"),
                                        reason="torch.export's flag: torch >= 2.5")
MAX_BATCH = 2**20
THRESHOLD = 1000


class _Routed(torch.nn.Module):
    """A module with a routing rule on its batch (as the ops' are): doubled
    from THRESHOLD rows on, else plus one."""

    def forward(self, x):
        big = on_example_sizes(lambda: x.shape[0] >= THRESHOLD, x)
        return x * 2 if big else x + 1


@needs_is_exporting
def test_routing_reads_the_example_sizes_while_exporting():
    """A rule whose threshold lies inside the exported range: the program
    takes the example's side at every size, with no guard narrowing the
    range (without on_example_sizes export refuses the range)."""
    for example, times in ((10, False), (2000, True)):
        ep = torch.export.export(_Routed(), (torch.ones(example, 3),), strict=False,
                                 dynamic_shapes=({0: Dim("batch", min=2, max=MAX_BATCH)},))
        for rows in (2, example, 5000):
            got = ep.module()(torch.full((rows, 3), 3.0))
            assert torch.equal(got, torch.full((rows, 3), 6.0 if times else 4.0)), rows
        ops = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
        assert any(("mul" if times else "add") in o for o in ops), ops


@needs_is_exporting
def test_strict_export_keeps_the_guards():
    """A strict export (traced by TorchDynamo, torch.export's default before
    torch 2.7) keeps the rule's guard: the range is refused, as before."""
    with pytest.raises(Exception, match="Constraints violated"):
        torch.export.export(_Routed(), (torch.ones(10, 3),), strict=True,
                            dynamic_shapes=({0: Dim("batch", min=2, max=MAX_BATCH)},))


@needs_is_exporting
def test_symbolic_values_a_rule_returns_come_back_concrete():
    """What a rule returns, nested too, holds no symbolic size after it (one
    would guard where it is read)."""
    seen = []

    class Model(torch.nn.Module):
        def forward(self, x):
            rows, big = on_example_sizes(lambda: (x.shape[0] * 2, [x.shape[0] >= THRESHOLD]), x)
            seen.append((type(rows), type(big[0])))
            return x * 2 if big[0] else x + rows

    torch.export.export(Model(), (torch.ones(10, 3),), strict=False,
                        dynamic_shapes=({0: Dim("batch", min=2, max=MAX_BATCH)},))
    assert seen and set(seen) == {(int, bool)}, seen


def test_size_limits_are_the_engines_bounds():
    """The limits export holds over its range are, at plain sizes, the
    engine's bounds on x's channels as it reads them and the transposing
    copies' grid for x and y."""
    import random

    rng, seen = random.Random(0), set()
    for _ in range(2000):
        n, cin, cout = rng.choice((1, 7, 2**10, 2**21, 2**30)), rng.randint(1, 5000), rng.randint(1, 5000)
        kh, kw = rng.randint(1, 9), rng.randint(1, 9)
        h, w = kh + rng.choice((0, 5, 300, 70000)), kw + rng.choice((0, 3, 127, 4000))
        c = CBR._padded_channels(cin)
        want = (CBR._engine_bounds((n, c, h, w), (cout, c, kh, kw)) and CBR._transposes_shape((n, c, h, w))
                and CBR._transposes_shape((n, cout, h - kh + 1, w - kw + 1)))
        got = all(CBR._size_limits((n, cin, h, w), (cout, cin, kh, kw)))
        assert got == want, (n, cin, h, w, cout, kh, kw)
        seen.add(want)
    assert seen == {True, False}


class _Limits(torch.nn.Module):
    """Doubles x where the engine's limits hold over the exported range for a
    call on x with a weight of 2^20 channels out and 8 x 8 taps (1,023
    images of 8 x 8 x 8 at most), else adds one."""

    def forward(self, x):
        shapes = SimpleNamespace(shape=x.shape), SimpleNamespace(shape=(2**20, 8, 8, 8))
        return x * 2 if CBR._limits_hold_over_the_range(*shapes) else x + 1


@needs_is_exporting
def test_engine_limits_must_hold_over_the_exported_range():
    """The engine's limits are asked of the whole range, with no guard: a
    batch Dim whose max keeps within them keeps the engine's side, one
    past them (or without a max) takes the other, and both export."""
    for hi, within in ((1000, True), (1023, True), (1024, False), (None, False)):
        dim = Dim("batch", min=2, max=hi) if hi else Dim("batch", min=2)
        ep = torch.export.export(_Limits(), (torch.ones(4, 8, 8, 8),), strict=False,
                                 dynamic_shapes=({0: dim},))
        got = ep.module()(torch.full((3, 8, 8, 8), 3.0))
        assert torch.equal(got, torch.full((3, 8, 8, 8), 6.0 if within else 4.0)), hi


class _Ruled(torch.nn.Module):
    """Doubles x where ``rule(x)`` holds, else adds one."""

    def __init__(self, rule):
        super().__init__()
        self.rule = rule

    def forward(self, x):
        return x * 2 if self.rule(x) else x + 1


@needs_is_exporting
def test_linear_routing_rules_read_the_example_sizes_while_exporting(monkeypatch):
    """linear_gn_chain's one-launch rule (from 67,584 rows of a 256-channel
    layer on 132 SMs) and the autocast float32-weight product's rows (512 to
    1024) record the example's side for a batch range that crosses them
    (the device's answers stubbed: a Hopper GPU of 132 SMs)."""
    monkeypatch.setattr(G, "sm_count", lambda index: 132)
    monkeypatch.setattr(G, "has_wgmma", lambda index: True)
    w16, w32 = torch.zeros(256, 64, dtype=torch.bfloat16), torch.zeros(8192, 64)
    rules = {"one launch": (lambda x: LG._takes_one_launch(x, w16, 8, torch.bfloat16, False), 528 * 128),
             "float32 weight": (lambda x: G._routes_float32_weight(x, w32), 768)}
    for name, (rule, rows) in rules.items():
        for example, taken in ((96, False), (rows, True)):
            ep = torch.export.export(_Ruled(rule), (torch.ones(example, 64, dtype=torch.bfloat16),),
                                     strict=False, dynamic_shapes=({0: Dim("batch", min=2, max=MAX_BATCH)},))
            got = ep.module()(torch.full((5, 64), 3.0, dtype=torch.bfloat16))
            assert torch.equal(got, torch.full((5, 64), 6.0 if taken else 4.0, dtype=torch.bfloat16)), (
                name, example)


def test_exported_float32_plans_keep_cudnn(monkeypatch):
    """While exporting, a float32 convolution is planned on cuDNN even where
    an eager call of its size takes the engine: TF32 is the exported
    program's caller's setting (meta tensors: the plan's rules on the CPU)."""
    x = torch.empty((140, 16, 12, 100), device="meta")
    weight = torch.empty((128, 16, 3, 3), device="meta")
    vec = torch.empty((128,), device="meta")
    if not CBR._cudnn_tf32():
        pytest.skip("cuDNN or its TF32 is off in this process")
    assert CBR._plan(x, weight, vec, vec, x.shape, padded=False) == (CBR.NCHW, torch.float32,
                                                                     torch.float32, False)
    monkeypatch.setattr(CBR, "is_exporting", lambda: True)
    assert CBR._plan(x, weight, vec, vec, x.shape, padded=False) is None


def test_routing_context_changes_nothing_outside_export():
    """Eager: the rule as it is.  torch.compile(dynamic=True): the rule
    still guards, so a batch across the threshold recompiles into its own
    route."""
    assert torch.equal(_Routed()(torch.full((5, 2), 3.0)), torch.full((5, 2), 4.0))
    assert torch.equal(_Routed()(torch.full((1500, 2), 3.0)), torch.full((1500, 2), 6.0))
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(_Routed(), fullgraph=True, dynamic=True, backend="eager")
    for rows in (5, 9, 1500, 1700):
        x = torch.full((rows, 2), 3.0)
        assert torch.equal(compiled(x), x * 2 if rows >= THRESHOLD else x + 1), rows
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])


# ---------------------------------------------------------------- GPU tier

MODES = {"fp32": (torch.float32, None), "bf16": (torch.bfloat16, None),
         "amp-bf16": (torch.float32, torch.bfloat16)}


def _ctx(amp):
    return torch.autocast("cuda", dtype=amp) if amp else contextlib.nullcontext()


def _export(model, x, amp, min_batch=1):
    with _ctx(amp):
        return torch.export.export(model, (x,), strict=False,
                                   dynamic_shapes=({0: Dim("batch", min=min_batch, max=MAX_BATCH)},))


def _targets(ep):
    return {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}


def _step(model, x, dy, amp):
    """{name: tensor}: the output, x's gradient and each parameter's."""
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    with _ctx(amp):
        out = model(x)
    out.backward(dy)
    return {"out": out.detach(), "x.grad": x.grad,
            **{f"{n}.grad": p.grad for n, p in model.named_parameters() if p.requires_grad}}


def _same_step(model, program, x, dy, amp):
    """The program's training step against the module's: every tensor bitwise
    equal."""
    want, have = _step(model, x, dy, amp), _step(program, x, dy, amp)
    assert sorted(want) == sorted(have), (sorted(want), sorted(have))
    for name, w in want.items():
        assert have[name] is not None and torch.equal(have[name], w), name


def _tolerance(dtype, amp):
    return 1e-5 if dtype == torch.float32 and amp is None else 8e-3


@pytest.mark.gpu
@needs_is_exporting
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("problem", sorted(models.MODELS))
def test_exported_model_serves_every_batch(problem, mode, device):
    """Exported at the small shapes with a batch from 1 to 2^20: the program
    runs at other batches as the module does, its output and every
    gradient at the example's batch bitwise the module's, and a saved and
    loaded copy gives the same output."""
    dtype, amp = MODES[mode]
    _, args, shape = reference.SMALL_PROBLEMS[problem]
    _, ours = build_pair(problem, args, device, dtype)
    example = torch.rand(shape, device=device, dtype=dtype)
    ep = _export(ours, example, amp)
    program = ep.module()
    assert any(t.startswith("cupy_fused.") for t in _targets(ep)), _targets(ep)
    for batch in (shape[0], 1, 2 * shape[0] + 1):
        x = torch.rand((batch,) + tuple(shape[1:]), device=device, dtype=dtype)
        with torch.no_grad(), _ctx(amp):
            want, have = ours(x), program(x)
        assert have.dtype == want.dtype and have.shape == want.shape, batch
        if batch == shape[0]:
            assert torch.equal(have, want), batch
        assert rel_error(have, want) <= _tolerance(dtype, amp), (batch, rel_error(have, want))
    with torch.no_grad(), _ctx(amp):
        dy = torch.randn_like(ours(example))
    _same_step(ours, program, example, dy, amp)
    buffer = io.BytesIO()
    torch.export.save(ep, buffer)
    buffer.seek(0)
    with torch.no_grad(), _ctx(amp):
        assert torch.equal(torch.export.load(buffer).module()(example), ours(example))


def _conv_model(device, dtype, grad):
    """Problem 1's module at a shape whose output rows fill the engine's
    tiles (98 of 128 pixels) with 128 output channels: the engine's from
    2^24 output values in float32, and in training."""
    model = models.MODELS[1](16, 128, 3, (128, 1, 1)).to(device=device, dtype=dtype)
    for p in model.parameters():
        p.requires_grad_(grad)
    return model


def _conv_x(batch, device, dtype):
    return torch.rand(batch, 16, 12, 100, device=device, dtype=dtype)  # 125,440 outputs an image


def _reference_step(model, x, dy, dtype):
    """{name: tensor} of problem 1's step computed by PyTorch in ``dtype``
    on the module's parameters (as :func:`_step` names them)."""
    conv = model.conv
    leaves = {n: p.detach().to(dtype).requires_grad_(True)
              for n, p in (("x", x), ("conv.weight", conv.weight), ("conv.bias", conv.bias),
                           ("bias", model.bias))}
    out = (torch.nn.functional.conv2d(leaves["x"], leaves["conv.weight"], leaves["conv.bias"]).relu()
           + leaves["bias"])
    out.backward(dy.to(dtype))
    return {"out": out.detach(), **{f"{n}.grad": t.grad for n, t in leaves.items()}}


def _route_of(model, x):
    conv = model.conv
    return CBR.route(x, conv.weight, conv.bias, model.bias.view(-1))


@pytest.mark.gpu
@needs_is_exporting
@pytest.mark.parametrize("min_batch", [1, 140])
def test_exported_float32_convolution_keeps_cudnn(min_batch, device):
    """Whether float32 may run in TF32 is the exported program's caller's
    setting (torch.backends.cudnn.allow_tf32), read as it runs: an exported
    program keeps cuDNN for float32 convolutions, even over a range where
    the module itself takes the TF32 engine (from 134 images here)."""
    model = _conv_model(device, torch.float32, grad=False)
    big, small = _conv_x(140, device, torch.float32), _conv_x(3, device, torch.float32)
    assert (_route_of(model, big), _route_of(model, small)) == ("engine", "cudnn")
    ep = _export(model, big, None, min_batch=min_batch)
    assert "cupy_fused.conv_bias_relu_engine.default" not in _targets(ep), _targets(ep)
    with torch.no_grad():
        for x in (big, small) if min_batch == 1 else (big,):
            have, want = ep.module()(x), model(x)
            # (cuDNN's TF32 against the engine's TF32; cuDNN's own bits)
            assert rel_error(have, want) <= 2e-3 if x is big else torch.equal(have, want)
        allowed, torch.backends.cudnn.allow_tf32 = torch.backends.cudnn.allow_tf32, False
        try:
            want = torch.nn.functional.conv2d(big.double(), model.conv.weight.double(),
                                              model.conv.bias.double()).relu() + model.bias.double()
            assert rel_error(ep.module()(big), want) <= 1e-5  # float32, as the caller asked
        finally:
            torch.backends.cudnn.allow_tf32 = allowed


@pytest.mark.gpu
@needs_is_exporting
def test_exported_routes_serve_sizes_across_their_thresholds(device):
    """Rules on speed alone record the example's route for every size:
    problem 1's training engine (from 2^24 output values) run at one image,
    37's one-launch op run at a few rows (where the op itself runs two
    launches), 76's float32-weight product under autocast (512 to 1024
    rows) run outside those rows; each within the module's error bounds."""
    model = _conv_model(device, torch.bfloat16, grad=True)
    big = _conv_x(140, device, torch.bfloat16)
    assert _route_of(model, big) == "engine"
    ep = _export(model, big, None)
    assert any("conv_bias_relu_engine_train" in t for t in _targets(ep)), _targets(ep)
    x = big
    with torch.no_grad():
        dy = torch.randn_like(model(x))
    _same_step(model, ep.module(), x, dy, None)
    # At one image the module takes cuDNN, the program the engine: each
    # within 1.5x eager PyTorch's error against float64.
    x = _conv_x(1, device, torch.bfloat16)
    dy = torch.randn_like(model(x)).detach()
    have = _step(ep.module(), x, dy, None)
    truth, eager = (_reference_step(model, x, dy, dtype) for dtype in (torch.float64, torch.bfloat16))
    for name, t in truth.items():
        assert rel_error(have[name], t) <= 1.5 * rel_error(eager[name], t) + 2.0**-7, name

    _, args, shape = reference.SMALL_PROBLEMS[37]
    _, ours = build_pair(37, args, device, torch.bfloat16)
    rows = 528 * 128  # 1,056 tiles of 128 x 128: 8 a SM on 132 SMs
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if not LG.fusion_pays(rows, args[1], args[0], sms):
        pytest.skip("this GPU's one-launch rule does not take 37's small layer at 67,584 rows")
    ep = _export(ours, torch.rand(rows, shape[1], device=device, dtype=torch.bfloat16), None)
    assert "cupy_fused.linear_gn_chain.default" in _targets(ep), _targets(ep)
    x = torch.rand(5, shape[1], device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        assert rel_error(ep.module()(x), ours(x)) <= 8e-3

    ours = models.MODELS[76](64, 8192, (8192,)).to(device)  # (its float32 weight: 2 MiB)
    for p in ours.parameters():
        p.requires_grad_(False)
    ep = _export(ours, torch.rand(768, 64, device=device), torch.bfloat16)
    assert "cupy_fused.linear_float32_weight.default" in _targets(ep), _targets(ep)
    for batch in (3, 768, 3000):
        x = torch.rand(batch, 64, device=device)
        with torch.no_grad(), _ctx(torch.bfloat16):
            assert rel_error(ep.module()(x), ours(x)) <= 8e-3, batch


@pytest.mark.gpu
@needs_is_exporting
def test_exported_engine_inference_takes_either_layout(device):
    """An exported program does not check its input's strides: the engine's
    inference op, planned for an NCHW x, reads a channels-last one in the
    plan's layout (the same bits as from its NCHW copy)."""
    model = _conv_model(device, torch.bfloat16, grad=False)
    x = _conv_x(140, device, torch.bfloat16)
    assert _route_of(model, x) == "engine"
    ep = _export(model, x, None)
    assert "cupy_fused.conv_bias_relu_engine.default" in _targets(ep), _targets(ep)
    with torch.no_grad():
        want = ep.module()(x)
        assert torch.equal(want, model(x))
        assert torch.equal(ep.module()(x.contiguous(memory_format=torch.channels_last)), want)
