"""DLPack/stream bridge (GPU tier); the scale_add op it launches is tested in
test_scale_add.py."""
import os
import subprocess
import sys
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


def test_second_gpu_runs_on_its_own_device_and_stream():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (run on a two-GPU machine)")
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


def test_cupy_arrays_in_cupy_arrays_out(device):
    import cupy

    a = cupy.random.rand(300, 5, dtype=cupy.float32)
    b = cupy.random.rand(300, 5, dtype=cupy.float32)
    out = ops.scale_add(a, b, 2.0)
    assert isinstance(out, cupy.ndarray)
    cupy.testing.assert_allclose(out, 2.0 * a + b, rtol=1e-6)
    z = cupy.random.randn(33, 16, dtype=cupy.float32)
    bias = cupy.random.randn(16, dtype=cupy.float32)
    r = ops.bias_relu(z, bias)
    assert isinstance(r, cupy.ndarray)
    cupy.testing.assert_allclose(r, cupy.maximum(z + bias, 0), rtol=1e-6)
    with cupy.cuda.Stream(non_blocking=True):
        r2 = ops.group_norm_swish_multiply_swish(z, None, None, None, bias, 4)
        assert isinstance(r2, cupy.ndarray) and r2.shape == z.shape
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
