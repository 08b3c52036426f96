"""A wheel built from the repository ships every kernel source, and an
installed copy (outside the source tree) finds and compiles all of them."""
import os
import subprocess
import sys
import zipfile

import pytest
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_wheel_ships_and_compiles_every_kernel(tmp_path):
    pytest.importorskip("setuptools", reason="the [test] extra installs setuptools to build the wheel")
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "dist"), str(REPO)], capture_output=True, text=True)
    assert build.returncode == 0, build.stdout + build.stderr
    (wheel,) = (tmp_path / "dist").glob("cupy_fused-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = sorted(p.name for p in (REPO / "kernels_cu").iterdir() if p.suffix in (".cu", ".cuh"))
    assert sources, "no kernel sources in the repository"
    for name in sources:
        assert f"cupy_fused/kernels_cu/{name}" in names, f"{name} missing from the wheel"

    site = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
        capture_output=True, text=True)
    assert install.returncode == 0, install.stdout + install.stderr
    code = (
        "import cupy_fused, sys\n"
        "from cupy_fused import _runtime\n"
        f"assert str(_runtime.kernel_dir()).startswith({str(site)!r}), _runtime.kernel_dir()\n"
        "sizes = _runtime.compile_check('sm_90')\n"
        "assert set(sizes) == set(_runtime.source_files()), sizes\n"
        "print('compiled', sorted(sizes))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(site))
    env.pop("CUPY_FUSED_KERNEL_DIR", None)
    run = subprocess.run([sys.executable, "-c", code], env=env, cwd=str(tmp_path),
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    for name in sources:
        if name.endswith(".cu"):
            assert name in run.stdout
