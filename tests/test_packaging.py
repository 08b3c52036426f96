"""A wheel built from the repository ships every kernel source, the licence
and the typing marker, under the package's own version, and an installed copy
(outside the source tree) finds and compiles all of them.  Each CUDA extra
brings the NVRTC of its own CUDA major."""
import email.parser
import os
import shutil
import subprocess
import sys
import zipfile

import pytest
from pathlib import Path

import cupy_fused

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    # 77: the SPDX `license` string of pyproject.toml; older setuptools
    # refuses it, and without build isolation the test environment's is used.
    pytest.importorskip("setuptools", minversion="77",
                        reason="the [test] extra installs setuptools>=77 to build the wheel")
    # Built from a copy: setuptools never empties the build/ folder of the
    # source tree, so files left there by an earlier build would be shipped.
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(REPO / name, src / name)
    for name in ("cupy_fused", "kernels_cu"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    dist = tmp_path_factory.mktemp("dist")
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(dist), str(src)], capture_output=True, text=True)
    assert build.returncode == 0, build.stdout + build.stderr
    (path,) = dist.glob("cupy_fused-*.whl")
    return path


def _metadata(wheel):
    with zipfile.ZipFile(wheel) as zf:
        (name,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        return email.parser.Parser().parsestr(zf.read(name).decode()), zf.namelist()


def test_wheel_metadata_version_and_licence(wheel):
    meta, names = _metadata(wheel)
    assert meta["Version"] == cupy_fused.__version__
    assert wheel.name.startswith(f"cupy_fused-{cupy_fused.__version__}-")
    assert meta["License-Expression"] == "MIT"
    assert meta.get_all("License-File") == ["LICENSE"]
    (licence,) = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
    with zipfile.ZipFile(wheel) as zf:
        assert zf.read(licence) == (REPO / "LICENSE").read_bytes()


def test_wheel_ships_typing_marker(wheel):
    _, names = _metadata(wheel)
    assert "cupy_fused/py.typed" in names


def test_wheel_ships_and_compiles_every_kernel(wheel, tmp_path):
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = sorted(p.name for p in (REPO / "kernels_cu").iterdir() if p.suffix in (".cu", ".cuh"))
    assert sources, "no kernel sources in the repository"
    assert any(name.endswith(".cuh") for name in sources)
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


def _extras():
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        tomllib = pytest.importorskip("tomli", reason="reading pyproject.toml needs tomllib (3.11) or tomli")
    requirements = pytest.importorskip("packaging.requirements")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return {extra: [requirements.Requirement(r) for r in reqs]
            for extra, reqs in project["optional-dependencies"].items()}


def _applies(req, python="3.11", system="Linux"):
    env = {"python_version": python, "platform_system": system, "extra": ""}
    return req.marker is None or req.marker.evaluate(env)


@pytest.mark.parametrize("python", ["3.9", "3.11"])
def test_each_cuda_extra_brings_its_own_nvrtc(python):
    extras = _extras()
    nvrtc = {extra: [r for r in extras[extra]
                     if r.name.startswith("nvidia-cuda-nvrtc") and _applies(r, python)]
             for extra in ("cuda12", "cuda13")}
    (cu12,) = nvrtc["cuda12"]
    assert cu12.name == "nvidia-cuda-nvrtc-cu12"
    # For CUDA 13 NVRTC is `nvidia-cuda-nvrtc` 13.x (`nvidia-cuda-nvrtc-cu13`
    # is an empty placeholder); the pin keeps a later major out.
    (cu13,) = nvrtc["cuda13"]
    assert cu13.name == "nvidia-cuda-nvrtc"
    assert cu13.specifier.contains("13.0.48") and cu13.specifier.contains("13.5.37")
    assert not cu13.specifier.contains("12.9.86") and not cu13.specifier.contains("14.0.0")

    cupy = {extra: [r.name for r in extras[extra] if r.name.startswith("cupy") and _applies(r, python)]
            for extra in ("cuda12", "cuda13")}
    assert cupy == {"cuda12": ["cupy-cuda12x"], "cuda13": ["cupy-cuda13x"]}
    # NVRTC comes with the CUDA extra, so a second one in `test` could only
    # clash with it.
    assert not [r for r in extras["test"] if r.name.startswith(("nvidia-", "cupy"))]


def test_cuda_extras_take_a_cupy_that_finds_pip_nvrtc():
    # CuPy 14 finds NVRTC in site-packages; CuPy 13 only asks the dynamic
    # loader, which does not look there.  CuPy 14 needs Python 3.10.
    for extra in ("cuda12", "cuda13"):
        (cupy,) = [r for r in _extras()[extra] if r.name.startswith("cupy") and _applies(r, "3.10")]
        assert not cupy.specifier.contains("13.6.0") and cupy.specifier.contains("14.0.0"), cupy



def test_test_shards_partition_the_suite():
    """CUPY_FUSED_TEST_SHARD=k/n (tests/conftest.py: the shards
    scripts/gpu_check.sh runs at once): the n shards' tests are the
    suite's, each test in one shard; a malformed value is refused."""
    def collected(shard):
        env = dict(os.environ, CUPY_FUSED_TEST_SHARD=shard)
        run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p",
                              "no:cacheprovider", "tests/test_formulas.py"],
                             cwd=REPO, env=env, capture_output=True, text=True)
        return run, [line for line in run.stdout.splitlines() if "::" in line]

    _, whole = collected("")
    parts = [collected(f"{k}/3")[1] for k in range(3)]
    assert len(whole) > 3 and all(parts)
    assert sorted(sum(parts, [])) == sorted(whole)
    run, _ = collected("3/3")
    assert run.returncode != 0 and "CUPY_FUSED_TEST_SHARD must be k/n" in run.stdout + run.stderr


def test_source_distribution_carries_what_its_tests_need(tmp_path):
    """The sdist ships the kernels and, beside the test files, what they
    import and read: conftest.py, the benchmarks, scripts, docs and
    results (without them pytest in an unpacked sdist stopped at missing
    fixtures and files)."""
    pytest.importorskip("setuptools", minversion="77",
                        reason="the [test] extra installs setuptools>=77 to build the sdist")
    import tarfile

    src = tmp_path / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(
        ".git", "__pycache__", "build", "dist", "*.egg-info", "scratch*"))
    build = subprocess.run(
        [sys.executable, "-c", "from setuptools import build_meta; build_meta.build_sdist('dist')"],
        cwd=str(src), capture_output=True, text=True)
    assert build.returncode == 0, build.stdout + build.stderr
    (path,) = (src / "dist").glob("cupy_fused-*.tar.gz")
    with tarfile.open(path) as tf:
        names = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
    wanted = {"tests/conftest.py", "benchmarks/run.py", "benchmarks/harness.py",
              "scripts/gpu_check.sh", "results/latest.json", "docs/design.md",
              "kernels_cu/gemm.cuh", "cupy_fused/__init__.py"}
    wanted |= {f"tests/{p.name}" for p in (REPO / "tests").glob("test_*.py")}
    assert wanted <= names, sorted(wanted - names)
    assert not any("__pycache__" in n for n in names)
