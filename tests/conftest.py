import os
from typing import NamedTuple

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


def _multigpu_reason():
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return None if count >= 2 else f"needs two GPUs, {count} visible (run on a two-GPU machine)"


# Tests marked "gpu" skip without a usable GPU, those marked "multigpu" with
# fewer than two.
SKIP_REASONS = {"gpu": GPU_SKIP_REASON, "multigpu": _multigpu_reason()}


def shard_spec(spec):
    """(k, n) of ``CUPY_FUSED_TEST_SHARD=k/n`` (this process runs every
    n-th collected test from the k-th: scripts/gpu_check.sh runs n such
    processes at once), or None for an empty value."""
    if not spec:
        return None
    k, _, n = spec.partition("/")
    if not (k.isdigit() and n.isdigit() and int(k) < int(n)):
        raise pytest.UsageError(f"CUPY_FUSED_TEST_SHARD must be k/n with 0 <= k < n, got {spec!r}")
    return int(k), int(n)


def pytest_collection_modifyitems(config, items):
    shard = shard_spec(os.environ.get("CUPY_FUSED_TEST_SHARD", ""))
    if shard is not None:
        k, n = shard
        config.hook.pytest_deselected(items=[t for i, t in enumerate(items) if i % n != k])
        items[:] = [t for i, t in enumerate(items) if i % n == k]
    skips = {mark: pytest.mark.skip(reason=reason) for mark, reason in SKIP_REASONS.items() if reason}
    for item in items:
        for mark, skip in skips.items():
            if mark in item.keywords:
                item.add_marker(skip)
                break


@pytest.fixture
def device():
    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture
def past_device_check(monkeypatch):
    """Lets CPU tensors through the device check, to reach the later checks
    without a GPU (they all raise before anything would launch)."""
    from cupy_fused import _validation

    monkeypatch.setattr(_validation, "DEVICE_TYPES", ("cuda", "cpu"))


class Launch(NamedTuple):
    name: str    # the kernel's name expression
    device: int  # the device index it was launched on
    stream: int  # the handle of torch's current stream of that device at the launch


@pytest.fixture
def launches(monkeypatch):
    """Every kernel launched through the bridge from here to the test's
    end, in order, as :class:`Launch` entries (the launches themselves go
    ahead); ``launches.clear()`` starts the record afresh."""
    from cupy_fused import _bridge

    seen = []
    launch = _bridge.launch

    def record(fn, grid, block, args, dev, *rest, **kw):
        seen.append(Launch(fn.name, dev, torch.cuda.current_stream(dev).cuda_stream))
        return launch(fn, grid, block, args, dev, *rest, **kw)

    monkeypatch.setattr(_bridge, "launch", record)
    return seen


@pytest.fixture
def beside_eager(launches):
    """A function ``run(compiled, eager)`` for CUDA-graph steps
    (``torch.compile(mode="reduce-overhead")``): one call of each, in that
    order, on the same values, returning (compiled's result, eager's
    result, the names of the kernels the compiled call launched from
    Python: none once it replays its graph).  The eager call must launch
    something, so that an empty record means a replay, not a record that
    sees nothing."""

    def run(compiled, eager):
        torch.compiler.cudagraph_mark_step_begin()
        launches.clear()
        got = compiled()
        from_python = [launch.name for launch in launches]
        launches.clear()
        want = eager()
        assert launches
        return got, want, from_python

    return run
