import pytest
import torch


def _gpu_reason():
    if not torch.cuda.is_available():
        return "no CUDA GPU visible to torch (GPU tier skipped; the CPU tier still runs)"
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() == 0:
            return "CuPy sees no CUDA device"
    except Exception as exc:  # noqa: BLE001
        return f"CuPy cannot use the GPU: {exc}"
    return None


GPU_SKIP_REASON = _gpu_reason()


def pytest_collection_modifyitems(config, items):
    if GPU_SKIP_REASON is None:
        return
    skip = pytest.mark.skip(reason=GPU_SKIP_REASON)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture
def past_device_check(monkeypatch):
    """Lets CPU tensors through the device check, to reach the later checks
    without a GPU (they all raise before anything would launch)."""
    from cupy_fused import _validation

    monkeypatch.setattr(_validation, "DEVICE_TYPES", ("cuda", "cpu"))
