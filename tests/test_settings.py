"""cupy_fused.settings (CPU tier): validation, getters and setters, context
managers that restore on exit (also after an exception), the environment
read at import, and the precision read at trace time under torch.compile."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import cupy_fused
from cupy_fused import ops, settings

SWITCHES = [  # (context manager, getter, setter)
    (settings.gemm_wgmma, settings.get_gemm_wgmma, settings.set_gemm_wgmma),
]


def test_precision_setting_is_validated_and_restored():
    assert cupy_fused.get_fp32_matmul_precision() == "3xtf32"
    with pytest.raises(ValueError, match="precision must be one of '3xtf32', 'tf32', 'ieee'"):
        cupy_fused.set_fp32_matmul_precision("fp32")
    cupy_fused.set_fp32_matmul_precision("tf32")
    try:
        assert settings.resolve_precision(None) == "tf32"
        assert settings.resolve_precision("ieee") == "ieee"
    finally:
        cupy_fused.set_fp32_matmul_precision("3xtf32")
    with pytest.raises(ValueError, match="precision must be one of"):
        cupy_fused.GemmAddRelu(8, 16, (16,), precision="TF32")


def test_one_home_for_the_precision_functions():
    """The package and cupy_fused.ops re-export the settings' own functions."""
    for name in ("get_fp32_matmul_precision", "set_fp32_matmul_precision"):
        assert getattr(cupy_fused, name) is getattr(ops, name) is getattr(settings, name)
    assert cupy_fused.fp32_matmul_precision is settings.fp32_matmul_precision
    assert ops.PRECISIONS is settings.PRECISIONS


def test_precision_context_manager_restores_on_exit_and_after_an_exception():
    assert settings.get_fp32_matmul_precision() == "3xtf32"
    with cupy_fused.fp32_matmul_precision("ieee"):
        assert settings.resolve_precision(None) == "ieee"
        with cupy_fused.fp32_matmul_precision("tf32"):  # nested: back to "ieee" after
            assert settings.get_fp32_matmul_precision() == "tf32"
        assert settings.get_fp32_matmul_precision() == "ieee"
    assert settings.get_fp32_matmul_precision() == "3xtf32"
    with pytest.raises(KeyError):
        with cupy_fused.fp32_matmul_precision("tf32"):
            raise KeyError("inside the block")
    assert settings.get_fp32_matmul_precision() == "3xtf32"
    # An invalid value raises before anything changes.
    with pytest.raises(ValueError, match="precision must be one of"):
        with cupy_fused.fp32_matmul_precision("fp16"):
            pass  # pragma: no cover
    assert settings.get_fp32_matmul_precision() == "3xtf32"


def test_precision_context_manager_as_a_decorator():
    @cupy_fused.fp32_matmul_precision("tf32")
    def read():
        return settings.resolve_precision(None)

    assert read() == "tf32" and read() == "tf32"
    assert settings.get_fp32_matmul_precision() == "3xtf32"


def test_the_decorator_covers_generators_and_coroutines():
    """A decorated generator runs each of its steps under the setting, and
    its caller's code between them under the caller's (as torch's
    decorators); a decorated coroutine runs whole under it.  Both ran with
    the default before."""
    import asyncio

    get = settings.get_fp32_matmul_precision
    default = get()

    @cupy_fused.fp32_matmul_precision("ieee")
    def steps():
        sent = yield get()
        assert sent == "sent"
        try:
            yield get()
        except KeyError:
            yield "caught " + get()
        return "done"

    gen = steps()
    assert next(gen) == "ieee" and get() == default
    assert gen.send("sent") == "ieee" and get() == default
    assert gen.throw(KeyError("k")) == "caught ieee" and get() == default
    with pytest.raises(StopIteration) as stop:
        next(gen)
    assert stop.value.value == "done" and get() == default
    gen = steps()
    next(gen)
    gen.close()
    assert get() == default

    @cupy_fused.fp32_matmul_precision("ieee")
    async def whole():
        await asyncio.sleep(0)
        return get()

    assert asyncio.run(whole()) == "ieee" and get() == default


@pytest.mark.parametrize("manager, get, set_", SWITCHES, ids=lambda f: f.__name__)
def test_switches_set_get_and_restore(manager, get, set_):
    before = get()
    with manager(not before):
        assert get() is (not before)
    assert get() is before
    with pytest.raises(RuntimeError):
        with manager(not before):
            raise RuntimeError("inside the block")
    assert get() is before
    set_(not before)
    try:
        assert get() is (not before)
    finally:
        set_(before)
    assert get() is before


@pytest.mark.parametrize("manager, get, set_", SWITCHES, ids=lambda f: f.__name__)
def test_switches_take_only_a_bool(manager, get, set_):
    """bool("0") and bool("off") are True: a string is refused, not read."""
    before = get()
    for value in ("0", "off", 0, None):
        with pytest.raises(TypeError, match=r"enabled must be True or False, got"):
            set_(value)
        with pytest.raises(TypeError, match=r"enabled must be True or False"):
            manager(value)
    assert get() is before


def test_precision_and_flags_take_only_their_types(past_device_check):
    import numpy as np

    with pytest.raises(ValueError, match="precision must be one of"):
        cupy_fused.set_fp32_matmul_precision(np.array(["ieee"]))
    assert cupy_fused.get_fp32_matmul_precision() == "3xtf32"
    with pytest.raises(TypeError, match="eager_rounding must be True or False, got 'False'"):
        cupy_fused.MatmulSwishSumGroupNorm(8, 16, 4, (16,), eager_rounding="False")
    z = torch.rand(4, 16)
    with pytest.raises(TypeError, match="eager_rounding must be True or False, got 1"):
        ops.gn_chain(z, "swish_bias_gn", 4, eager_rounding=1)
    with pytest.raises(TypeError, match="linear_bias_in_z must be True or False"):
        ops.gn_chain(z, "swish_bias_gn", 4, linear_bias_in_z="yes")
    with pytest.raises(TypeError, match="eager_rounding must be True or False"):
        ops.linear_gn_chain(torch.rand(4, 8), torch.rand(16, 8), None, "swish_bias_gn", 4,
                            eager_rounding="False")


def _run_python(code: str, **env):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, **env}, cwd=str(Path(__file__).resolve().parent))


@pytest.mark.parametrize("name, value, getter, expected", [
    ("CUPY_FUSED_GEMM_WGMMA", "0", "get_gemm_wgmma", False),
    ("CUPY_FUSED_GEMM_WGMMA", "1", "get_gemm_wgmma", True),
    ("CUPY_FUSED_GEMM_WGMMA", " Off ", "get_gemm_wgmma", False),
    ("CUPY_FUSED_GEMM_WGMMA", "false", "get_gemm_wgmma", False),
    ("CUPY_FUSED_GEMM_WGMMA", "", "get_gemm_wgmma", True),
])
def test_environment_is_read_at_import(name, value, getter, expected):
    result = _run_python(f"from cupy_fused import settings; print(settings.{getter}())",
                         **{name: value})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(expected)


def test_an_environment_value_that_is_not_a_flag_is_refused_at_import():
    result = _run_python("import cupy_fused.settings", CUPY_FUSED_GEMM_WGMMA="no")
    assert result.returncode != 0
    assert "CUPY_FUSED_GEMM_WGMMA must be 0 or 1 (or false / true, off / on), got 'no'" in result.stderr


def test_a_context_manager_object_may_be_entered_again():
    """As torch's context managers may: one object entered twice in turn,
    and inside itself, each exit giving back the value before its entry."""
    ieee = cupy_fused.fp32_matmul_precision("ieee")
    for _ in range(2):
        with ieee:
            assert settings.get_fp32_matmul_precision() == "ieee"
        assert settings.get_fp32_matmul_precision() == "3xtf32"
    with ieee:
        with cupy_fused.fp32_matmul_precision("tf32"):
            with ieee:
                assert settings.get_fp32_matmul_precision() == "ieee"
            assert settings.get_fp32_matmul_precision() == "tf32"
        assert settings.get_fp32_matmul_precision() == "ieee"
    assert settings.get_fp32_matmul_precision() == "3xtf32"


def test_precision_is_read_at_trace_time_and_a_change_retraces():
    """Under torch.compile the default precision is read when the op is
    traced, and TorchDynamo guards on it: calling the compiled function
    after a change traces it again with the new value."""
    scale = {"3xtf32": 3.0, "tf32": 1.0, "ieee": 0.5}

    def fn(x):
        return x * scale[settings.resolve_precision(None)]

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="eager", fullgraph=True)
    x = torch.ones(3)
    assert torch.equal(compiled(x), x * 3.0)
    with cupy_fused.fp32_matmul_precision("ieee"):
        assert torch.equal(compiled(x), x * 0.5)
    assert torch.equal(compiled(x), x * 3.0)
