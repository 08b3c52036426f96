"""Kernel runtime: declarations, compile check (CPU tier), lazy import."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cupy_fused import _runtime
from cupy_fused.ops import gn_epilogue as gn_chain_module
from cupy_fused.ops._common import row_chunks, _sm_counts

REPO = Path(__file__).resolve().parents[1]


def _run_python(code: str, env=None):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, cwd=str(REPO / "tests"))


def test_every_kernel_file_has_declared_instantiations():
    table = _runtime.declared()
    files = _runtime.source_files()
    assert set(files) == {"smoke.cu", "bias_relu.cu", "column_reduce.cu", "gn_chain.cu",
                          "gn_chain_eager.cu", "gn_chain_amp.cu", "gn_chain_vec.cu", "gemm_tf32.cu", "gemm_tf32_gn.cu"}
    for name in files:
        assert table.get(name), f"{name} has no declared instantiation"


@pytest.mark.parametrize("arch", ["sm_75", "sm_80", "sm_90", "sm_90a"])
def test_nvrtc_compile_check(arch):
    """Every kernel file and every instantiation the library launches compiles
    with NVRTC for the architecture, without a GPU."""
    sizes = _runtime.compile_check(arch)
    assert set(sizes) == set(_runtime.source_files())
    assert all(size > 0 for size in sizes.values())


def test_compile_check_reports_the_compiler_log(tmp_path, monkeypatch):
    (tmp_path / "cf_common.cuh").write_text((_runtime.kernel_dir() / "cf_common.cuh").read_text())
    (tmp_path / "broken.cu").write_text(
        '#include "cf_common.cuh"\ntemplate <typename T> __global__ void k(T* p) { p[0] = undefined_name; }\n')
    monkeypatch.setenv("CUPY_FUSED_KERNEL_DIR", str(tmp_path))
    monkeypatch.setattr(_runtime, "_options_cache", None)
    monkeypatch.setitem(_runtime._declared, "broken.cu", ["k<float>"])
    with pytest.raises(_runtime.CompileError, match="undefined_name"):
        _runtime.compile_check("sm_80", ["broken.cu"])


def test_compile_check_rejects_a_kernel_file_nobody_declares(tmp_path, monkeypatch):
    (tmp_path / "cf_common.cuh").write_text("")
    (tmp_path / "orphan.cu").write_text("__global__ void k() {}\n")
    monkeypatch.setenv("CUPY_FUSED_KERNEL_DIR", str(tmp_path))
    monkeypatch.setattr(_runtime, "_options_cache", None)
    with pytest.raises(_runtime.CompileError, match="orphan.cu: no declared instantiation"):
        _runtime.compile_check("sm_80", ["orphan.cu"])


def test_undeclared_instantiation_is_a_clear_error():
    with pytest.raises(KeyError, match="not a declared instantiation"):
        _runtime.get_function("smoke.cu", "cf::scale_add<double>", 0)


def test_options_carry_a_hash_of_the_sources():
    opts = _runtime.nvrtc_options()
    assert "-std=c++17" in opts
    assert any(o.startswith("-I") and o.endswith("kernels_cu") for o in opts)
    assert any(o.startswith("-DCUPY_FUSED_SOURCES_HASH=0x") for o in opts)


def test_import_compiles_nothing_and_needs_no_cupy():
    code = (
        "import sys; sys.modules['cupy'] = None\n"
        "import cupy_fused, torch\n"
        "from cupy_fused import _runtime\n"
        "assert _runtime.compiled_modules() == 0\n"
        "m = cupy_fused.GemmAddRelu(4, 8, (8,))\n"
        "try:\n"
        "    _runtime.get_function('smoke.cu', 'cf::scale_add<float>', 0)\n"
        "except ImportError as e:\n"
        "    print('ERR', e)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = _run_python(code, env)
    assert proc.returncode == 0, proc.stderr
    assert "ERR" in proc.stdout and "cupy-fused[cuda12]" in proc.stdout and "[cuda13]" in proc.stdout


def test_team_shape_covers_every_group_width():
    assert gn_chain_module.team_shape(1) == (1, 4)
    assert gn_chain_module.team_shape(3) == (1, 4)
    assert gn_chain_module.team_shape(5) == (2, 4)
    assert gn_chain_module.team_shape(32) == (8, 4)
    assert gn_chain_module.team_shape(64) == (16, 4)
    assert gn_chain_module.team_shape(128) == (32, 4)
    assert gn_chain_module.team_shape(129) == (32, 8)
    assert gn_chain_module.team_shape(4096) == (32, 8)
    for cpg in range(1, 600):
        team, vals = gn_chain_module.team_shape(cpg)
        assert team & (team - 1) == 0 and team <= 32 and vals in gn_chain_module.VALS_PER_LANE
        fteam, fvals = gn_chain_module.forward_team_shape(cpg)
        assert fteam & (fteam - 1) == 0 and fteam <= 32 and fvals in gn_chain_module.VALS_PER_LANE
        # the forward holds as many values per team (or more: one slice)
        assert fteam * fvals >= min(team * vals, cpg)
    # the forward's own shape: half the lanes, 8 values, for teams of 16 and 32 x 4
    assert gn_chain_module.forward_team_shape(64) == (8, 8)
    assert gn_chain_module.forward_team_shape(128) == (16, 8)
    assert gn_chain_module.forward_team_shape(33) == (8, 8)
    assert gn_chain_module.forward_team_shape(32) == (8, 4)
    assert gn_chain_module.forward_team_shape(4096) == (32, 8)


def test_row_chunks_are_never_empty(monkeypatch):
    monkeypatch.setitem(_sm_counts, 99, 132)
    for rows in (1, 2, 7, 255, 1024, 32768, 1 << 24):
        for blocks in (1, 3, 32, 1000):
            chunks, per = row_chunks(rows, blocks, 99)
            assert chunks * per >= rows and (chunks - 1) * per < rows
            assert 1 <= chunks <= 65535
