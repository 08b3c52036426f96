"""DLPack/stream bridge (GPU tier); the scale_add op it launches is tested in
test_scale_add.py."""
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from cupy_fused import _bridge, ops

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parents[1]


def test_zero_copy_both_ways(device):
    import cupy

    t = torch.arange(1000, dtype=torch.float32, device=device)
    a = _bridge.to_cupy(t)
    assert a.data.ptr == t.data_ptr()
    a[3] = -5.0
    torch.cuda.synchronize()
    assert t[3].item() == -5.0
    t[4] = -7.0
    torch.cuda.synchronize()
    assert float(a[4]) == -7.0

    b = cupy.arange(10, dtype=cupy.float32)
    u = _bridge.to_torch(b)
    assert u.data_ptr() == b.data.ptr and u.device == device
    u[0] = 42.0
    torch.cuda.synchronize()
    assert float(b[0]) == 42.0


def test_launches_follow_the_current_torch_stream(device):
    """Torch ops and our kernels interleaved on a non-default stream, with no
    synchronisation in between: the result must equal the sequential one."""
    n = 1 << 24
    torch.manual_seed(0)
    x0 = torch.rand(n, device=device)
    expected = x0.clone()
    for _ in range(10):
        expected = (expected * 1.0001 + expected) * 0.5   # our scale_add, then torch
        expected = torch.sqrt(expected + 1.0)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        assert _bridge.current_stream_ptr(device.index) == stream.cuda_stream
        y = x0.clone()
        for _ in range(10):
            y = ops.scale_add(y, y, 1.0001) * 0.5
            y = torch.sqrt(y + 1.0)
    stream.synchronize()
    torch.testing.assert_close(y, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
def test_a_new_threads_first_launch_binds_its_context(device):
    """A thread's first CUDA work an op of ours, on the device that the
    thread's runtime reads as current (a DataParallel replica, a thread
    pool's worker): torch's guard sets no device that already reads as
    current, and its allocator serves the output from its cache, so no
    call had bound the device's context to the thread before our launch.
    The op runs and gives the main thread's result."""
    x = torch.randn(4097, device=device)
    y = torch.randn(4097, device=device)
    want = ops.scale_add(x, y, 3.0)  # the kernel loaded, the allocator's cache warm
    torch.cuda.synchronize(device)
    got = {}

    def work():
        try:
            with torch.cuda.device(device):
                got["y"] = ops.scale_add(x, y, 3.0)
                torch.cuda.current_stream(device).synchronize()
        except Exception as exc:  # noqa: BLE001 - reported by the main thread
            got["error"] = exc

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert "error" not in got, got.get("error")
    assert torch.equal(got["y"], want)


@pytest.mark.multigpu
def test_second_gpu_runs_on_its_own_device_and_stream():
    other = torch.device("cuda", 1)
    torch.cuda.set_device(0)
    x = torch.randn(4097, device=other)
    y = torch.randn(4097, device=other)
    stream = torch.cuda.Stream(other)
    with torch.cuda.stream(stream):
        out = ops.scale_add(x, y, 0.5)
    stream.synchronize()
    assert out.device == other
    torch.testing.assert_close(out, 0.5 * x + y)
    from cupy_fused import GemmAddRelu

    torch.manual_seed(0)
    model = GemmAddRelu(64, 96, (96,)).to(other)
    inp = torch.rand(17, 64, device=other, requires_grad=True)
    out = model(inp)
    out.sum().backward()
    ref = torch.relu(inp @ model.gemm.weight.t() + model.bias)
    torch.testing.assert_close(out, ref)


# (constructor arguments, input shape) of each model at sizes its Hopper
# routes take once the size rules below are lifted (the float32 forward
# product fills the GPU's SMs with 128 x 128 tiles, as the engine needs);
# "1cl": problem 1 from a channels-last x.
SECOND_GPU_CASES = {
    "1": (1, (16, 32, 3, (32, 1, 1)), (2, 16, 20, 24)),
    "1cl": (1, (16, 32, 3, (32, 1, 1)), (2, 16, 20, 24)),
    "37": (37, (256, 1536, 24, (1536,)), (1536, 256)),
    "76": (76, (256, 1536, (1536,)), (1536, 256)),
    "88": (88, (256, 1536, 48, (1536,)), (1536, 256)),
    "94": (94, (256, 1536, (1536,), 48), (1536, 256)),
}


def _on_hopper_routes(monkeypatch):
    """The routes the benchmark shapes take, at the test's small sizes: the
    convolution engine (training, float32 and its weight gradient too),
    linear_gn_chain's one-launch forward, and the float32-weight product
    of autocast inference."""
    import importlib

    conv = importlib.import_module("cupy_fused.ops.conv_bias_relu")
    lgn = importlib.import_module("cupy_fused.ops.linear_gn_chain")
    lin = importlib.import_module("cupy_fused.ops.linear")
    gemm = importlib.import_module("cupy_fused.ops.gemm")
    monkeypatch.setattr(conv, "_engine_pays", lambda *args: True)
    monkeypatch.setattr(conv, "ENGINE_TRAINING_MIN_ELEMENTS", 0)
    monkeypatch.setattr(conv, "ENGINE_FLOAT32_MIN_ELEMENTS", 0)
    monkeypatch.setattr(conv, "WGRAD_COUT_MULTIPLE", 8)
    monkeypatch.setattr(conv, "WGRAD_MIN_ROW_SHARE", 0.0)
    monkeypatch.setattr(lgn, "fusion_pays", lambda *args: True)
    monkeypatch.setattr(lin, "_routes_float32_weight", gemm._uses_float32_weight_engine)


@pytest.mark.multigpu
@pytest.mark.parametrize("mode", ["fp32", "bf16", "amp-bf16"])
@pytest.mark.parametrize("case", list(SECOND_GPU_CASES))
def test_second_gpu_models_as_with_their_own_device_current(case, mode, monkeypatch, launches):
    """One process driving two GPUs: a model on cuda:1 while cuda:0 is
    current gives, on the routes the benchmark shapes take, bit for bit the
    output and gradients it gives with cuda:1 current (a training step, then
    a forward without autograd); every kernel of ours launches on cuda:1,
    nothing is allocated on cuda:0, and cuda:0 stays current."""
    import cupy

    from cupy_fused import models

    problem, args, shape = SECOND_GPU_CASES[case]
    _on_hopper_routes(monkeypatch)
    other = torch.device("cuda", 1)
    dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    amp = torch.bfloat16 if mode.startswith("amp") else None
    gen = torch.Generator().manual_seed(0)
    x0 = torch.rand(shape, generator=gen)

    def run(current):
        torch.cuda.set_device(current)
        torch.manual_seed(0)
        model = models.MODELS[problem](*args).to(other, dtype)
        x = x0.to(other, dtype)
        if case == "1cl":
            x = x.contiguous(memory_format=torch.channels_last)
        x.requires_grad_(True)
        with torch.autocast("cuda", dtype=amp or torch.bfloat16, enabled=amp is not None):
            y = model(x)
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y))
        with torch.no_grad(), torch.autocast("cuda", dtype=amp or torch.bfloat16,
                                             enabled=amp is not None):
            y_inference = model(x)
        torch.cuda.synchronize(other)
        return [y, y_inference, x.grad] + [p.grad for p in model.parameters()]

    current = torch.cuda.current_device()
    try:
        before = torch.cuda.memory_allocated(0)
        got = run(0)
        assert torch.cuda.current_device() == 0 and cupy.cuda.runtime.getDevice() == 0
        assert torch.cuda.memory_allocated(0) == before
        assert launches or (problem == 76 and mode != "fp32")  # (76 in 16 bits: cuBLAS and torch alone)
        assert all(launch.device == 1 for launch in launches), sorted(set(launches))
        ours = sorted({launch.name for launch in launches})
        launches.clear()
        want = run(1)
    finally:
        torch.cuda.set_device(current)
    assert sorted({launch.name for launch in launches}) == ours  # the same kernels both times
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.device == other and torch.equal(a, b), (i, ours)


@pytest.mark.multigpu
def test_cupy_arrays_of_the_second_gpu_run_on_its_current_stream(launches):
    """CuPy arrays on device 1 while device 0 is CuPy's current device, with
    a stream of its own current there: the ops run on device 1, on CuPy's
    current stream of device 1 (not device 0's, which device 1 cannot run
    kernels on), and return arrays of device 1."""
    import cupy

    with cupy.cuda.Device(1):
        stream = cupy.cuda.Stream(non_blocking=True)
        a, b = (cupy.random.rand(4097, dtype=cupy.float32) for _ in range(2))
        z = cupy.random.randn(33, 16, dtype=cupy.float32)
        bias = cupy.random.randn(16, dtype=cupy.float32)
        cupy.cuda.Device().synchronize()
    try:
        with cupy.cuda.Device(1):
            stream.use()  # device 1's current stream, kept past this block
        with cupy.cuda.Device(0), cupy.cuda.Stream(non_blocking=True):
            out = ops.scale_add(a, b, 0.5)
            r = ops.bias_relu(z, bias)
        stream.synchronize()
    finally:
        with cupy.cuda.Device(1):
            cupy.cuda.Stream.null.use()
    assert out.device.id == 1 and r.device.id == 1
    assert launches and all((s.device, s.stream) == (1, stream.ptr) for s in launches), launches
    with cupy.cuda.Device(1):
        cupy.testing.assert_allclose(out, 0.5 * a + b, rtol=1e-6)
        cupy.testing.assert_allclose(r, cupy.maximum(z + bias, 0), rtol=1e-6)


@pytest.mark.multigpu
@pytest.mark.parametrize("case", ["1", "1cl", "37", "88", "94"])
def test_second_gpu_compiled_models_as_eager(case, monkeypatch, launches):
    """torch.compile(fullgraph=True) of a model on cuda:1 while cuda:0 is
    current (a bfloat16 training step on its Hopper routes): the output and
    every gradient bit for bit the eager model's, every kernel on cuda:1."""
    from cupy_fused import models

    problem, args, shape = SECOND_GPU_CASES[case]
    _on_hopper_routes(monkeypatch)
    other = torch.device("cuda", 1)
    torch.cuda.set_device(0)
    torch.manual_seed(0)
    model = models.MODELS[problem](*args).to(other, torch.bfloat16)
    x = torch.rand(shape, generator=torch.Generator().manual_seed(0)).to(other, torch.bfloat16)
    fmt = torch.channels_last if case == "1cl" else torch.contiguous_format
    x = x.contiguous(memory_format=fmt)

    def step(fn):
        model.zero_grad(set_to_none=True)
        leaf = x.clone().requires_grad_(True)
        y = fn(leaf)
        # (the output gradient in y's memory format, x's: a compiled graph
        # hands its backward one in the layout it traced)
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y)
                   .contiguous(memory_format=fmt))
        return [y, leaf.grad] + [p.grad for p in model.parameters()]

    eager = step(model)
    torch._dynamo.reset()
    compiled = step(torch.compile(model, fullgraph=True))
    assert {launch.device for launch in launches} == {1} and torch.cuda.current_device() == 0
    for i, (a, b) in enumerate(zip(eager, compiled)):
        assert b.device == other and torch.equal(a, b), i


# Each op with its tensor arguments (positional ones by name) and which one
# to move to cuda:1: (op, positional names, tensors by name, the moved one).
def _mixed_device_calls():
    g = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.rand(shape, generator=g)  # noqa: E731
    z, x, w = r(33, 64), r(33, 16), r(64, 16)
    vectors = {"gn_weight": r(64), "gn_bias": r(64), "extra_bias": r(64)}
    conv = {"x": r(2, 8, 9, 10), "weight": r(16, 8, 3, 3), "conv_bias": r(16), "bias": r(16, 1, 1)}
    linear = {"x": x, "weight": w, "bias": r(64)}
    gn = lambda z, **k: ops.gn_chain(z, "swish_bias_gn", 4, **k)  # noqa: E731
    lgn = lambda x, weight, lin_bias, **k: ops.linear_gn_chain(  # noqa: E731
        x, weight, lin_bias, "gn_swish_mul_swish", 4, **k)
    return [
        (ops.scale_add, ("x", "y"), {"x": z, "y": r(33, 64)}, "y"),
        (ops.bias_relu, ("z", "bias"), {"z": z, "bias": r(64)}, "bias"),
        (gn, ("z",), {"z": z, **vectors}, "gn_bias"),
        (ops.linear, ("x", "weight", "bias"), linear, "weight"),
        (ops.linear, ("x", "weight", "bias"), linear, "bias"),
        (lgn, ("x", "weight", "lin_bias"),
         {"x": x, "weight": w, "lin_bias": r(64), "gn_weight": r(64), "mul_weight": r(64)}, "mul_weight"),
        (ops.conv_bias_relu, ("x", "weight", "conv_bias", "bias"), conv, "weight"),
        (ops.conv_bias_relu, ("x", "weight", "conv_bias", "bias"), conv, "bias"),
    ]


@pytest.mark.multigpu
@pytest.mark.parametrize("amp", [False, True], ids=["plain", "autocast"])
def test_an_argument_on_the_other_gpu_is_refused_before_any_launch(amp, monkeypatch):
    """Every op with one tensor on cuda:1 and the rest on cuda:0 (eagerly
    and under autocast) raises a ValueError naming that argument, and
    launches nothing."""
    monkeypatch.setattr(_bridge, "launch", lambda *args, **kw: pytest.fail("launched"))
    for op, positional, tensors, moved in _mixed_device_calls():
        placed = {n: t.to("cuda:1" if n == moved else "cuda:0") for n, t in tensors.items()}
        args = [placed.pop(n) for n in positional]
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            with pytest.raises(ValueError, match=rf"^{moved} must be on .*cuda:0.*got cuda:1"):
                op(*args, **placed)


def _queue_work(cupy) -> None:
    """Keeps CuPy's current stream busy for a while (products of 4096 x 4096
    matrices), so that a launch not ordered after the work queued next on
    that stream reads its inputs before they are written."""
    m = cupy.full((4096, 4096), 1e-3, dtype=cupy.float32)
    for _ in range(8):
        m = m @ m


def test_cupy_arrays_in_cupy_arrays_out(device, launches):
    """CuPy arrays in, CuPy arrays out, every launch on CuPy's current
    stream: its null stream (CuPy's default), then a stream of its own."""
    import cupy

    _queue_work(cupy)
    a = cupy.random.rand(300, 5, dtype=cupy.float32)
    b = cupy.random.rand(300, 5, dtype=cupy.float32)
    out = ops.scale_add(a, b, 2.0)
    assert isinstance(out, cupy.ndarray)
    cupy.testing.assert_allclose(out, 2.0 * a + b, rtol=1e-6)
    _queue_work(cupy)
    z = cupy.random.randn(33, 16, dtype=cupy.float32)
    bias = cupy.random.randn(16, dtype=cupy.float32)
    r = ops.bias_relu(z, bias)
    assert isinstance(r, cupy.ndarray)
    cupy.testing.assert_allclose(r, cupy.maximum(z + bias, 0), rtol=1e-6)
    assert launches and all(s.stream == 0 for s in launches), launches
    launches.clear()
    with cupy.cuda.Stream(non_blocking=True) as stream:
        _queue_work(cupy)
        z2 = cupy.random.randn(33, 16, dtype=cupy.float32)
        r2 = ops.group_norm_swish_multiply_swish(z2, None, None, None, bias, 4)
        assert isinstance(r2, cupy.ndarray) and r2.shape == z.shape
    assert launches and all(s.stream == stream.ptr for s in launches), launches
    stream.synchronize()
    cupy.testing.assert_array_equal(  # again on the null stream, z2 written by now
        r2, ops.group_norm_swish_multiply_swish(z2, None, None, None, bias, 4))
    x = cupy.random.rand(2, 3, 6, 5, dtype=cupy.float32)
    w = cupy.random.randn(4, 3, 3, 2, dtype=cupy.float32)
    cb, b = cupy.random.randn(4, dtype=cupy.float32), cupy.random.randn(4, 1, 1, dtype=cupy.float32)
    r3 = ops.conv_bias_relu(x, w, cb, b)
    assert isinstance(r3, cupy.ndarray) and r3.shape == (2, 4, 4, 4)
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):  # (flags() defaults to off)
        ref = torch.relu(torch.nn.functional.conv2d(torch.as_tensor(x), torch.as_tensor(w))
                         + torch.as_tensor(cb).reshape(-1, 1, 1)) + torch.as_tensor(b)
        r3 = ops.conv_bias_relu(x, w, cb, b)
    cupy.testing.assert_allclose(r3, cupy.asarray(ref), rtol=1e-5, atol=1e-5)


def test_cupy_arrays_and_torch_tensors_in_one_call_are_refused(device, launches):
    """A call that mixes CuPy arrays and torch tensors: a TypeError naming
    the first tensor, before any launch (the tensor would be read on CuPy's
    stream, unordered with the torch stream that wrote it)."""
    import cupy

    x = cupy.ones((4, 8), dtype=cupy.float32)
    t = torch.ones(4, 8, device=device)
    with pytest.raises(TypeError, match="^y must be a CuPy array"):
        ops.scale_add(x, t, 2.0)
    with pytest.raises(TypeError, match="^bias must be a CuPy array"):
        ops.bias_relu(x, bias=torch.ones(8, device=device))
    # The named GroupNorm chains name their own arguments.
    with pytest.raises(TypeError, match="^bias must be a CuPy array"):
        ops.swish_bias_group_norm(x, None, torch.ones(8, device=device), None, None, 2)
    with pytest.raises(TypeError, match="^multiply_weight must be a CuPy array"):
        ops.group_norm_swish_multiply_swish(x, None, None, None, torch.ones(8, device=device), 2)
    # A tensor for a number: the op's own error, as on the torch path.
    with pytest.raises(TypeError, match="^alpha must be a float, got Tensor"):
        ops.scale_add(x, x, torch.tensor(2.0, device=device))
    with pytest.raises(TypeError, match="^eps must be"):
        ops.gn_chain(x, "swish_bias_gn", 2, eps=torch.tensor(1e-5))
    assert not launches


def test_cupy_arrays_with_negative_strides(device):
    """CuPy arrays with negative strides (torch has none): copied, the
    results those of the contiguous arrays."""
    import cupy

    a = cupy.random.rand(6, 40, dtype=cupy.float32)
    b = cupy.random.rand(6, 40, dtype=cupy.float32)
    out = ops.scale_add(a[::-1], b[:, ::-1], 2.0)
    cupy.testing.assert_array_equal(out, ops.scale_add(a[::-1].copy(), b[:, ::-1].copy(), 2.0))
    cupy.testing.assert_allclose(out, 2.0 * a[::-1] + b[:, ::-1], rtol=1e-6)
    bias = cupy.random.randn(40, dtype=cupy.float32)
    cupy.testing.assert_allclose(ops.bias_relu(a[::-1], bias[::-1]),
                                 cupy.maximum(a[::-1] + bias[::-1], 0), rtol=1e-6)


def test_cupy_per_thread_default_stream_is_refused(device, launches):
    """CuPy's per-thread default stream as its current stream: a ValueError
    naming it, before any launch (torch can neither run on it nor hand a
    tensor to CuPy on it)."""
    import cupy

    a = cupy.ones(8, dtype=cupy.float32)
    with cupy.cuda.Stream.ptds:
        assert cupy.cuda.get_current_stream().ptr == 2
        with pytest.raises(ValueError, match="per-thread default stream"):
            ops.scale_add(a, a, 2.0)
    assert not launches


def test_cupy_stream_capture_is_refused(device, launches):
    """CuPy's current stream capturing a CUDA graph: a ValueError before any
    launch (torch's allocator, which the ops allocate from, does not know
    that capture, and would hand the call's buffers out again while the
    graph replays); the capture itself goes on."""
    import cupy

    a = cupy.ones(8, dtype=cupy.float32)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        try:
            with pytest.raises(ValueError, match="capturing a CUDA graph"):
                ops.scale_add(a, a, 2.0)
        finally:
            graph = stream.end_capture()
    assert graph is not None and not launches


def _clean_env():
    paths = [p for p in os.environ.get("PATH", "").split(os.pathsep)
             if p and not os.path.exists(os.path.join(p, "nvcc"))]
    env = dict(os.environ, PATH=os.pathsep.join(paths))
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_fresh_process_without_nvcc_compiles_and_runs(tmp_path):
    env = _clean_env()
    env["CUPY_CACHE_DIR"] = str(tmp_path / "cache")  # nothing cached: a real compile
    code = (
        "import shutil, torch\n"
        "assert shutil.which('nvcc') is None, shutil.which('nvcc')\n"
        "import cupy_fused\n"
        "from cupy_fused import _runtime, ops\n"
        "assert _runtime.compiled_modules() == 0\n"
        "x = torch.rand(1000, device='cuda'); y = torch.rand(1000, device='cuda')\n"
        "out = ops.scale_add(x, y, 3.0)\n"
        "torch.testing.assert_close(out, 3 * x + y)\n"
        "assert _runtime.compiled_modules() == 1\n"
        "print('OK')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK" in proc.stdout
    assert any((tmp_path / "cache").rglob("*")), "CuPy's disk cache was not written"


def test_main_job_runs(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "cupy_fused"], env=_clean_env(),
                          capture_output=True, text=True, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for word in ("GPU", "CUDA driver / runtime", "NVRTC", "kernel cache", "scale_add", "OK"):
        assert word in proc.stdout


@pytest.mark.multigpu
def test_a_rank_on_gpu_1_leaves_gpu_0_without_a_context():
    """A process of one rank on cuda:1 (torchrun's one process per GPU)
    that precompiles and runs ops there makes no CUDA context on GPU 0:
    the compile threads' device guard (their runtime device read 0) and
    the ops' do not set back a device whose context the process has not
    made, where each such context costs the other rank's GPU about half a
    GiB."""
    code = (
        "import torch, cupy_fused\n"
        "torch.cuda.set_device(1)\n"
        "cupy_fused.precompile('scale_add.cu', device=1, progress=False)\n"
        "x = torch.randn(4097, device='cuda:1', requires_grad=True)\n"
        "z = torch.randn(200, 1288, device='cuda:1', requires_grad=True)\n"
        "b = torch.randn(1288, device='cuda:1', requires_grad=True)\n"
        "cupy_fused.ops.scale_add(x, x, 2.0).sum().backward()\n"
        "cupy_fused.ops.bias_relu(z, b).backward(torch.randn_like(z))\n"
        "torch.cuda.synchronize(1)\n"
        "print(torch._C._cuda_hasPrimaryContext(0), torch._C._cuda_hasPrimaryContext(1))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=600, env=_clean_env())
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True"]
