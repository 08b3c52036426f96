"""Kernel runtime: declarations, lazy per-instantiation compile, locks,
logging, precompile, compile check (CPU tier), lazy import."""
import contextlib
import importlib
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import cupy_fused
from cupy_fused import __main__ as main_job
from cupy_fused import _runtime
from cupy_fused.ops import gemm
from cupy_fused.ops._common import row_chunks, _sm_counts

gn_chain_module = importlib.import_module("cupy_fused.ops.gn_chain")  # the module, not the op

REPO = Path(__file__).resolve().parents[1]


def _run_python(code: str, env=None):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, cwd=str(REPO / "tests"))


def test_every_kernel_file_has_declared_instantiations():
    table = _runtime.declared()
    files = _runtime.source_files()
    assert set(files) == {"scale_add.cu", "bias_relu.cu", "column_reduce.cu", "gn_chain.cu",
                          "gemm.cu", "gemm_tf32.cu", "linear_gn_chain.cu", "conv_bias_relu.cu"}
    for name in files:
        assert table.get(name), f"{name} has no declared instantiation"


@pytest.mark.parametrize("arch", _runtime.CHECK_ARCHS)
def test_nvrtc_compile_check(arch):
    """Every kernel file and every instantiation the library launches compiles
    with NVRTC for the architecture, without a GPU (each as its own program,
    as the run time compiles it)."""
    if arch not in _runtime.check_architectures():
        version = ".".join(map(str, _runtime.nvrtc_version()))
        pytest.skip(f"NVRTC {version} does not compile for {arch}")
    sizes = _runtime.compile_check(arch)
    assert set(sizes) == set(_runtime.source_files())
    assert all(size > 0 for size in sizes.values())


def test_compile_check_reports_the_compiler_log(tmp_path, monkeypatch):
    (tmp_path / "cf_common.cuh").write_text((_runtime.kernel_dir() / "cf_common.cuh").read_text())
    (tmp_path / "broken.cu").write_text(
        '#include "cf_common.cuh"\n'
        'template <typename T> __global__ void k(T* p) { p[0] = undefined_name; }\n')
    monkeypatch.setenv("CUPY_FUSED_KERNEL_DIR", str(tmp_path))
    monkeypatch.setitem(_runtime._declared, "broken.cu", ["k<float>"])
    with pytest.raises(_runtime.CompileError, match="undefined_name"):
        _runtime.compile_check("sm_80", ["broken.cu"])


def test_compile_check_rejects_a_kernel_file_nobody_declares(tmp_path, monkeypatch):
    (tmp_path / "cf_common.cuh").write_text("")
    (tmp_path / "orphan.cu").write_text("__global__ void k() {}\n")
    monkeypatch.setenv("CUPY_FUSED_KERNEL_DIR", str(tmp_path))
    with pytest.raises(_runtime.CompileError, match="orphan.cu: no declared instantiation"):
        _runtime.compile_check("sm_80", ["orphan.cu"])


def test_undeclared_instantiation_is_a_clear_error():
    with pytest.raises(KeyError, match="not a declared instantiation"):
        _runtime.get_function("scale_add.cu", "cf::scale_add<double>", 0)


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
        "    _runtime.get_function('scale_add.cu', 'cf::scale_add<float>', 0)\n"
        "except ImportError as e:\n"
        "    print('ERR', e)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = _run_python(code, env)
    assert proc.returncode == 0, proc.stderr
    assert "ERR" in proc.stdout and "pip install cupy-cuda12x nvidia-cuda-nvrtc-cu12" in proc.stdout
    assert "pip install cupy-cuda13x 'nvidia-cuda-nvrtc==13.*'" in proc.stdout


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
    # The backward's: a float32 group wider than 32 x 8 channels (swept, not
    # held) on the kernel with 4 values per lane, not the 8-value one's bound.
    f32, bf16 = torch.float32, torch.bfloat16
    assert gn_chain_module.backward_team_shape(256, f32, 8) == (32, 8)
    assert gn_chain_module.backward_team_shape(257, f32, 8) == (32, 4)
    assert gn_chain_module.backward_team_shape(4096, f32, 16) == (32, 4)
    assert gn_chain_module.backward_team_shape(4096, bf16, 16) == (32, 8)
    assert gn_chain_module.backward_team_shape(64, f32, 1) == gn_chain_module.team_shape(64)
    # One to four groups, wider than 32 x 4 channels: teams of several
    # warps, as many as the groups leave idle, with no more lanes than the
    # group's channels / 4 rounded up to a power of two, on the kernel with
    # 4 values per lane (swept where wider).
    assert gn_chain_module.backward_team_shape(4096, f32, 1) == (256, 4)
    assert gn_chain_module.backward_team_shape(4096, bf16, 2) == (128, 4)
    assert gn_chain_module.backward_team_shape(4096, bf16, 3) == (64, 4)
    assert gn_chain_module.backward_team_shape(4096, bf16, 5) == (32, 8)
    assert gn_chain_module.backward_team_shape(300, f32, 1) == (128, 4)
    assert gn_chain_module.backward_team_shape(600, bf16, 2) == (128, 4)
    assert gn_chain_module.backward_team_shape(128, f32, 1) == (32, 4)
    block = gn_chain_module.BLOCK
    for groups in range(1, 12):
        for cpg in range(1, 1100, 7):
            for dtype in (f32, bf16):
                team, vals = gn_chain_module.backward_team_shape(cpg, dtype, groups)
                assert team & (team - 1) == 0 and team <= block and vals in (4, 8)
                if team > 32:
                    # teams of whole warps, each lane with more than 2 values, and
                    # no wider than leaves a block a team for each group
                    assert team % 32 == 0 and cpg >= team // 2 * 4 + 1 and vals == 4
                    assert block // team >= groups
    # launch shapes fixing a team of several warps: the backward's alone
    with gn_chain_module.launch_shapes(gn_chain_module.LaunchShapes(team=(64, 4))):
        assert gn_chain_module.backward_team_shape(4096, f32, 16) == (64, 4)
        with pytest.raises(ValueError, match="at most 32 lanes"):
            gn_chain_module.forward_team_shape(4096)
    for bad in ((48, 4), (512, 4), (0, 4), (32, 6), (32.0, 4), (64, 8)):
        with pytest.raises(ValueError, match="team must be"):
            gn_chain_module.LaunchShapes(team=bad)
    assert gn_chain_module.forward_team_shape(4096) == (32, 8)


def test_row_chunks_are_never_empty(monkeypatch):
    monkeypatch.setitem(_sm_counts, 99, 132)
    for rows in (1, 2, 7, 255, 1024, 32768, 1 << 24):
        for blocks in (1, 3, 32, 1000):
            chunks, per = row_chunks(rows, blocks, 99)
            assert chunks * per >= rows and (chunks - 1) * per < rows
            assert 1 <= chunks <= 65535


# ---------------------------------------------------------------- lazy compile, locks, logging
# A stand-in for CuPy records the programs the run time would hand to NVRTC:
# the real get_function / KernelFamily code runs, without a GPU.

class _FakeCupy:
    def __init__(self, compile_hook=None):
        self.programs = []  # (name expressions, options) of each RawModule compiled
        fake = self

        class RawModule:
            def __init__(self, code=None, options=(), name_expressions=(), path=None):
                self.names = tuple(name_expressions)
                if path is None:
                    fake.programs.append((self.names, tuple(options)))
                else:  # a cubin file: its kernels go by their lowered names
                    fake.loaded.append(path)
                    self.names = tuple(fake.lowered.get(path, ()))

            def get_function(self, name):
                assert name in self.names
                if compile_hook is not None:
                    compile_hook(self.names)
                return SimpleNamespace(kernel=SimpleNamespace(ptr=id(self)), name=name)

        self.__version__ = "14.2.0"
        self.loaded = []  # cubin paths loaded
        self.lowered = {}  # cubin path -> the lowered names it holds
        self.RawModule = RawModule


@pytest.fixture
def fake_cupy(monkeypatch):
    """Installs a fresh run-time state (caches, locks, declarations) and a
    fake CuPy; device 0 is a compute capability 9.0 GPU, device 1 an 8.0."""
    monkeypatch.setattr(_runtime, "_functions", {})
    monkeypatch.setattr(_runtime, "_locks", {})
    monkeypatch.setattr(_runtime, "_declared", {})
    monkeypatch.setattr(_runtime, "_families", [])
    monkeypatch.setattr(_runtime, "_capabilities", {0: (9, 0), 1: (8, 0)})
    monkeypatch.setattr(_runtime, "_read_source", lambda source: "// " + source)
    monkeypatch.setattr(_runtime, "_device", lambda device: contextlib.nullcontext())

    def install(compile_hook=None):
        fake = _FakeCupy(compile_hook)
        monkeypatch.setattr(_runtime, "require_cupy", lambda: fake)
        return fake

    return install


def _gemm_family():
    return _runtime.KernelFamily("gemm_tf32.cu", gemm.KERNELS.expressions)


def test_first_get_compiles_only_that_instantiation(fake_cupy):
    fake = fake_cupy()
    family = _gemm_family()
    assert len(family.expressions) > 1
    key = ("64x64", 3, "forward", True)
    kernel = family.get(key, 0)
    assert [names for names, _ in fake.programs] == [(family.expressions[key],)]
    assert "-arch=sm_90a" in fake.programs[0][1]
    assert kernel.name == family.expressions[key] and kernel.device == 0
    assert family.get(key, 0) is kernel and len(fake.programs) == 1  # cached
    assert family.get(key, 1) is not kernel  # another device: its own build
    assert len(fake.programs) == 2 and "-arch=sm_90a" not in fake.programs[1][1]
    assert _runtime.compiled_modules() == 2


def test_threads_compile_different_kernels_concurrently(fake_cupy):
    """Each compile waits at a barrier until the other one has started too:
    one lock for all compiles would hold the second thread back, and the
    barrier would break."""
    barrier = threading.Barrier(2, timeout=10)
    fake = fake_cupy(lambda names: barrier.wait())
    family = _gemm_family()
    keys = [("64x64", 3, "forward", True), ("64x64", 3, "grad_input", True)]
    errors = []

    def launch(key):
        try:
            family.get(key, 0)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=launch, args=(k,)) for k in keys]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sorted(names for names, _ in fake.programs) == sorted(
        (family.expressions[k],) for k in keys)


def test_threads_launching_the_same_kernel_compile_it_once(fake_cupy):
    fake = fake_cupy(lambda names: time.sleep(0.2))
    family = _gemm_family()
    key = ("64x64", 3, "forward", True)
    got = []
    threads = [threading.Thread(target=lambda: got.append(family.get(key, 0))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(fake.programs) == 1
    assert len(got) == 4 and all(k is got[0] for k in got)


def test_a_compile_logs_when_it_starts_and_ends(fake_cupy, caplog):
    fake_cupy()
    family = _gemm_family()
    key = ("64x64", 3, "forward", True)
    caplog.set_level(logging.INFO, logger="cupy_fused")
    family.get(key, 0)
    expr = family.expressions[key]
    records = [r for r in caplog.records if r.name == "cupy_fused"]
    assert [r.levelno for r in records] == [logging.INFO, logging.INFO]
    assert records[0].getMessage() == (
        f"compiling gemm_tf32.cu: {expr} for sm_90a (first use; cached afterwards)")
    assert records[1].getMessage().startswith(f"compiled gemm_tf32.cu: {expr} for sm_90a in ")
    assert records[1].getMessage().endswith(" s")
    caplog.clear()
    family.get(key, 0)
    assert not caplog.records  # cached: nothing to say


def test_precompile_on_a_device_builds_each_instantiation_as_a_first_launch_would(fake_cupy):
    fake = fake_cupy()
    family = _gemm_family()
    done = cupy_fused.precompile([family], device=1, progress=False, workers=3)
    exprs = list(dict.fromkeys(family.expressions.values()))  # (keys may share one)
    assert list(done) == [("gemm_tf32.cu", e) for e in exprs]
    assert sorted(names for names, _ in fake.programs) == sorted((e,) for e in exprs)
    key = ("64x64", 3, "forward", True)
    family.get(key, 1)  # the launch path finds it built
    assert len(fake.programs) == len(exprs)


def test_before_cupy_14_2_kernels_load_from_the_run_times_own_disk_cache(fake_cupy, monkeypatch):
    """CuPy before 14.2 does not read back a module built from name
    expressions: the run time builds the cubin into its own cache and has
    CuPy load it, for architectures the installed NVRTC targets; others,
    CuPy 14.2 on, CUPY_CACHE_IN_MEMORY and CUPY_CUDA_COMPILE_WITH_DEBUG go
    through CuPy."""
    fake = fake_cupy()
    fake.__version__ = "14.1.1"
    monkeypatch.setattr(_runtime, "_supported_arch_numbers", lambda: (80, 90))
    monkeypatch.delenv("CUPY_CACHE_IN_MEMORY", raising=False)
    monkeypatch.delenv("CUPY_CUDA_COMPILE_WITH_DEBUG", raising=False)
    built = []

    def cached_cubin(source, expr, arch, options):
        built.append((source, expr, arch, tuple(options)))
        path = f"/cache/{len(built)}.cubin"
        fake.lowered[path] = (f"_Z_lowered_{len(built)}",)
        return Path(path), f"_Z_lowered_{len(built)}"

    monkeypatch.setattr(_runtime, "_cached_cubin", cached_cubin)
    family = _gemm_family()
    key = ("64x64", 3, "forward", True)
    kernel = family.get(key, 0)
    assert not fake.programs and fake.loaded == ["/cache/1.cubin"]
    assert kernel.name == family.expressions[key]
    source, expr, arch, options = built[0]
    assert (source, expr, arch) == ("gemm_tf32.cu", family.expressions[key], "sm_90a")
    assert options == _runtime.nvrtc_options()  # the architecture is the build's own argument
    family.get(key, 1)  # compute capability 8.0: sm_80
    assert built[1][2] == "sm_80" and len(fake.loaded) == 2
    # extra defines make a build of their own
    _runtime.declare("gemm_tf32.cu", [expr])
    _runtime.get_function("gemm_tf32.cu", expr, 0, ("CF_TUNE=2",))
    assert built[2][3] == _runtime.nvrtc_options() + ("-DCF_TUNE=2",)
    monkeypatch.setattr(_runtime, "_supported_arch_numbers", lambda: (90,))
    family.get(("64x64", 3, "grad_input", True), 1)  # sm_80 unsupported: CuPy compiles it
    assert len(built) == 3 and len(fake.programs) == 1
    monkeypatch.setenv("CUPY_CACHE_IN_MEMORY", "1")
    family.get(("64x64", 3, "grad_input", True), 0)
    assert len(built) == 3 and len(fake.programs) == 2
    monkeypatch.delenv("CUPY_CACHE_IN_MEMORY")
    # CuPy's debug build (its own options, which the own cache's builds lack)
    monkeypatch.setenv("CUPY_CUDA_COMPILE_WITH_DEBUG", "1")
    family.get(("64x64", 3, "forward", False), 0)
    assert len(built) == 3 and len(fake.programs) == 3
    monkeypatch.delenv("CUPY_CUDA_COMPILE_WITH_DEBUG")
    fake.__version__ = "14.2.0"  # CuPy caches them itself
    family.get(("64x64", 3, "grad_weight", True), 0)
    assert len(built) == 3 and len(fake.programs) == 4


def test_an_unwritable_own_cache_falls_back_to_cupys_route(fake_cupy, monkeypatch, caplog):
    fake = fake_cupy()
    fake.__version__ = "13.6.0"
    monkeypatch.setattr(_runtime, "_supported_arch_numbers", lambda: (80, 90))

    def unwritable(*args):
        raise PermissionError("read-only")

    monkeypatch.setattr(_runtime, "_cached_cubin", unwritable)
    caplog.set_level(logging.WARNING, logger="cupy_fused")
    family = _gemm_family()
    family.get(("64x64", 3, "forward", True), 0)
    assert len(fake.programs) == 1 and not fake.loaded
    assert any("not writable" in r.getMessage() for r in caplog.records)


def test_own_disk_cache_builds_once_and_keys_on_the_options(tmp_path, monkeypatch):
    """A cubin and its lowered name land in CUPY_CACHE_DIR/cupy_fused; a
    second process (here: a second call) reads them without compiling; other
    options make another entry."""
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path))
    expr = _runtime.declared()["scale_add.cu"][0]
    builds = []
    real_build = _runtime._nvrtc_build
    monkeypatch.setattr(_runtime, "_nvrtc_build", lambda *a: builds.append(a) or real_build(*a))
    path, name = _runtime._cached_cubin("scale_add.cu", expr, "sm_80", _runtime.nvrtc_options())
    assert path.parent == tmp_path / "cupy_fused" and path.read_bytes()[:4] == b"\x7fELF"
    assert name.startswith("_Z") and path.with_suffix(".name").read_text().split("\n")[0] == name
    assert name.encode() + b"\0" in path.read_bytes()  # the kernel's symbol, as get_function looks it up
    again = _runtime._cached_cubin("scale_add.cu", expr, "sm_80", _runtime.nvrtc_options())
    assert again == (path, name) and len(builds) == 1
    other = _runtime._cached_cubin("scale_add.cu", expr, "sm_80",
                                   _runtime.nvrtc_options() + ("-DCF_UNUSED=1",))
    assert other[0] != path and len(builds) == 2
    assert sorted(p.name for p in (tmp_path / "cupy_fused").iterdir()) == sorted(
        [path.name, path.with_suffix(".name").name, other[0].name,
         other[0].with_suffix(".name").name])  # no temporary files left
    build_id = _runtime.nvrtc_build_id()
    assert "Cuda compilation tools" in build_id
    monkeypatch.setattr(_runtime, "_nvrtc_build_id", "another NVRTC build")  # a patch release
    assert _runtime._cached_cubin("scale_add.cu", expr, "sm_80", _runtime.nvrtc_options())[0] != path
    monkeypatch.setattr(_runtime, "_nvrtc_build_id", build_id)
    builds.clear()
    good = path.read_bytes()
    path.write_bytes(good[: len(good) // 2])  # a cubin cut short: built again
    assert _runtime._cached_cubin("scale_add.cu", expr, "sm_80", _runtime.nvrtc_options()) == (
        path, name)
    rebuilt = path.read_bytes()
    # (whole again; not compared byte for byte: NVRTC 12.1 names a file's
    # internal symbols with a hash that differs from compile to compile)
    assert len(builds) == 1 and rebuilt[:4] == b"\x7fELF" and len(rebuilt) == len(good)
    assert name.encode() + b"\0" in rebuilt


def test_own_builds_compile_what_cupys_route_compiles(monkeypatch):
    """The run time's own NVRTC builds add the options CuPy adds to every
    compile: flushed subnormals (-ftz) among them, so the same code."""
    from cupy.cuda import compiler

    source = Path(compiler.__file__).read_text()
    for option in _runtime.CUPY_NVRTC_OPTIONS:
        assert f"'{option}'" in source, option
    expr = _runtime.declared()["scale_add.cu"][0]
    cubin, _ = _runtime._nvrtc_build("scale_add.cu", (expr,), "sm_80")
    monkeypatch.setattr(_runtime, "CUPY_NVRTC_OPTIONS", ())
    plain, _ = _runtime._nvrtc_build("scale_add.cu", (expr,), "sm_80")
    assert cubin != plain  # the options reach NVRTC, and they change the code


@pytest.mark.gpu
def test_kernels_from_the_own_disk_cache_compute_what_cupys_build_does(tmp_path, monkeypatch):
    """The route before CuPy 14.2 on this GPU: kernels built into the run
    time's own cache, loaded by CuPy, launched by an op: the same bits as
    the kernels CuPy builds, subnormal inputs included."""
    x = torch.randn(1001, 37, device="cuda")
    y = torch.randn_like(x)
    x[0], y[0] = 3e-39, -1e-39  # subnormal: kernels built without -ftz would not flush them
    hopper = gemm.has_wgmma(x.device.index)  # also an sm_90a kernel: the 16-bit engine's product
    a, b = (torch.randn(300, 136, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    runs = [lambda: cupy_fused.ops.scale_add(x, y, 0.75)] + ([lambda: gemm._half_linear(a, b)]
                                                             if hopper else [])
    want = [run() for run in runs]
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_runtime, "_functions", {})
    for family in _runtime._families:
        monkeypatch.setattr(family, "_kernels", {})
    monkeypatch.setattr(_runtime, "_cupy_caches_templates", lambda cupy: False)
    got = [run() for run in runs]
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert len(list((tmp_path / "cupy_fused").glob("*.cubin"))) == len(runs)


def test_compile_check_compiles_each_instantiation_as_its_own_program(monkeypatch):
    programs = []

    def fake_compile(source, exprs, arch):
        programs.append((source, tuple(exprs), arch))
        return 100

    monkeypatch.setattr(_runtime, "_nvrtc_compile", fake_compile)
    sizes = _runtime.compile_check("sm_80", ["scale_add.cu", "column_reduce.cu"])
    table = _runtime.declared()
    assert sorted(programs) == sorted(
        (s, (e,), "sm_80") for s in ("scale_add.cu", "column_reduce.cu") for e in table[s])
    assert sizes == {"scale_add.cu": 100 * len(table["scale_add.cu"]),
                     "column_reduce.cu": 100 * len(table["column_reduce.cu"])}
    # One file name alone is that file (not its characters, each "no declared instantiation").
    one = _runtime.compile_check("sm_80", "scale_add.cu")
    assert one == {"scale_add.cu": 100 * len(table["scale_add.cu"])}


def test_compile_jobs_run_in_parallel_and_report_every_failure():
    barrier = threading.Barrier(2, timeout=10)

    def build(source, expr):
        barrier.wait()  # both jobs in flight at once, or this breaks
        if expr == "bad":
            raise _runtime.CompileError(f"{source}: {expr} failed: log")
        return 1

    with pytest.raises(_runtime.CompileError, match=r"1 of 2 instantiations failed:\n\na.cu: bad"):
        _runtime._run_jobs([("a.cu", "good"), ("a.cu", "bad")], build, "sm_80", False, 2)


# ---------------------------------------------------------------- precompile without a GPU

def test_precompile_for_an_architecture_needs_no_gpu(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # the plain progress lines
    done = cupy_fused.precompile(["scale_add.cu", "column_reduce.cu"], device="sm_80",
                                 dtypes=[torch.float32])
    assert set(done) == {("scale_add.cu", "cf::scale_add<float>"),
                         ("column_reduce.cu", "cf::reduce_column_partials<float, false>"),
                         ("column_reduce.cu", "cf::reduce_column_partials<float, true>")}
    err = capsys.readouterr().err
    assert "precompile sm_80 [1/3]" in err and "precompile sm_80 [3/3]" in err


def test_precompile_selection():
    every = _runtime._selection(None, None)
    assert len(every) == sum(len(v) for v in _runtime.declared().values())
    # the float32 GEMMs' keys name no dtype: kept under any dtype filter
    assert (len(_runtime._selection([gemm.KERNELS], [torch.float16]))
            == len(set(gemm.KERNELS.expressions.values())))
    # bias_relu: (kernel, z dtype, output dtype, second bias); float16 z
    # takes a float16 or (autocast) float32 output: 5 kernels x 2 x 2, and
    # the rows kernel's plain-sum variant for the float16 output x 2
    half = _runtime._selection("bias_relu.cu", [torch.float16])
    assert len(half) == 22 and all("cf::half" in e for _, e in half)
    with pytest.raises(ValueError, match="no declared kernel source 'nope.cu'"):
        _runtime._selection(["nope.cu"], None)
    for arch in ("hopper", "compute_90", "sm_80a", "sm_90f", "cuda:0"):
        with pytest.raises(ValueError, match="not an architecture NVRTC builds a cubin for"):
            cupy_fused.precompile("scale_add.cu", device=arch, progress=False)
    # One dtype alone is a list of one; anything else is refused, not read as
    # "nothing to compile".
    assert _runtime._selection("scale_add.cu", torch.float16) == [("scale_add.cu", "cf::scale_add<cf::half>")]
    for dtypes in ([torch.float64], ["float16"], [], "float16"):
        with pytest.raises(ValueError, match="dtypes must be torch.float32, torch.float16 or"):
            cupy_fused.precompile("scale_add.cu", device="sm_80", dtypes=dtypes, progress=False)
    for device in (1.5, -1, True, torch.device("cpu")):
        with pytest.raises(ValueError, match="device must be a CUDA device"):
            cupy_fused.precompile("scale_add.cu", device=device, progress=False)
    # families, progress and workers of another kind, refused before anything compiles
    for families in (5, b"scale_add.cu"):
        with pytest.raises(TypeError, match="families must be a .cu file name, a KernelFamily, an iterable"):
            cupy_fused.precompile(families, device="sm_80", progress=False)
    # (any iterable of names: a generator, a dict's keys)
    one = _runtime._selection("scale_add.cu", None)
    assert _runtime._selection((f for f in ["scale_add.cu"]), None) == one
    assert len(_runtime._selection(_runtime.declared().keys(), None)) == len(every)
    with pytest.raises(TypeError, match="progress must be True or False, got 'no'"):
        cupy_fused.precompile("scale_add.cu", device="sm_80", progress="no")
    for workers in (0, -1, "2", 2.0, True):
        message = ("workers must be at least 1" if isinstance(workers, int) and not isinstance(workers, bool)
                   else "workers must be an int or None")
        exc = ValueError if message.endswith("1") else TypeError
        with pytest.raises(exc, match=message):
            cupy_fused.precompile("scale_add.cu", device="sm_80", progress=False, workers=workers)
        with pytest.raises(exc, match=message):
            _runtime.compile_check("sm_80", ["scale_add.cu"], workers=workers)


def test_check_architectures_follow_what_nvrtc_supports(monkeypatch):
    from cupy.cuda import nvrtc

    monkeypatch.setattr(nvrtc, "getSupportedArchs", lambda: (75, 80, 86, 89, 90, 100, 120),
                        raising=False)
    assert _runtime.check_architectures() == ["sm_75", "sm_80", "sm_90", "sm_90a"]
    monkeypatch.setattr(nvrtc, "getSupportedArchs", lambda: (50, 70, 72, 75, 80, 90))
    assert _runtime.check_architectures() == ["sm_70", "sm_75", "sm_80", "sm_90", "sm_90a"]
    monkeypatch.delattr(nvrtc, "getSupportedArchs")
    monkeypatch.setattr(nvrtc, "getVersion", lambda: (13, 0))
    assert _runtime.check_architectures() == ["sm_75", "sm_80", "sm_90", "sm_90a"]
    monkeypatch.setattr(nvrtc, "getVersion", lambda: (12, 9))
    assert _runtime.check_architectures()[0] == "sm_70"


# ---------------------------------------------------------------- NVRTC missing

class DynamicLibNotFoundError(RuntimeError):
    """Named as cuda-pathfinder's error, which CuPy raises when it cannot
    find libnvrtc."""


def _nvrtc_missing(*args, **kwargs):
    raise DynamicLibNotFoundError('Failure finding "libnvrtc.so": no such file')


def test_missing_nvrtc_names_the_package(monkeypatch):
    from cupy.cuda import nvrtc

    monkeypatch.setattr(_runtime, "cupy_distribution", lambda: "cupy-cuda12x")
    monkeypatch.setattr(nvrtc, "createProgram", _nvrtc_missing)
    with pytest.raises(_runtime.NvrtcNotFoundError, match="pip install nvidia-cuda-nvrtc-cu12"):
        _runtime.compile_check("sm_80", ["scale_add.cu"])
    monkeypatch.setattr(_runtime, "cupy_distribution", lambda: "cupy-cuda13x")
    with pytest.raises(_runtime.NvrtcNotFoundError, match=r"nvidia-cuda-nvrtc==13\.\*"):
        cupy_fused.precompile("scale_add.cu", device="sm_80", progress=False)
    # A broken kernel's compiler log is not a missing library.
    assert _runtime.missing_nvrtc_message(_runtime.CompileError(
        "broken.cu: k<float> for sm_80 failed: NVRTC_ERROR_COMPILATION (6)\n"
        'broken.cu(2): error: cannot open source file "nope.cuh"')) is None


def test_missing_nvrtc_on_a_first_launch(fake_cupy, monkeypatch):
    fake_cupy(lambda names: _nvrtc_missing())
    monkeypatch.setattr(_runtime, "cupy_distribution", lambda: "cupy-cuda12x")
    family = _gemm_family()
    with pytest.raises(_runtime.NvrtcNotFoundError, match="nvidia-cuda-nvrtc-cu12"):
        family.get(("64x64", 3, "forward", True), 0)


def test_main_job_says_which_package_brings_nvrtc(monkeypatch, capsys):
    from cupy.cuda import nvrtc

    monkeypatch.setattr(_runtime, "cupy_distribution", lambda: "cupy-cuda12x")
    monkeypatch.setattr(nvrtc, "getVersion", _nvrtc_missing)
    assert main_job.main([]) == 1
    out = capsys.readouterr()
    lines = [line for line in out.out.splitlines() if "nvidia-cuda-nvrtc-cu12" in line]
    assert lines == ["NVRTC (CUDA's runtime compiler) was not found: cupy-cuda12x needs "
                     "CUDA 12's NVRTC: pip install nvidia-cuda-nvrtc-cu12"]
    assert "Traceback" not in out.out + out.err


# ---------------------------------------------------------------- the main job without a GPU

def test_main_job_announces_the_compile_check_then_runs_it(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    count = sum(len(v) for v in _runtime.declared().values())
    checked = []

    def fake_check(arch, progress=False):
        if not checked:  # the announcement is out before the first (slow) compile starts
            assert "No CUDA GPU is visible: compile check of" in capsys.readouterr().out
        checked.append((arch, progress))
        if arch == "sm_90a":
            raise _runtime.CompileError("gemm_tf32.cu: ... failed")
        return {s: 1 for s in _runtime.source_files()}

    monkeypatch.setattr(_runtime, "compile_check", fake_check)
    assert main_job.main(["--arch", "sm_80", "sm_90a"]) == 1
    assert checked == [("sm_80", True), ("sm_90a", True)]
    monkeypatch.setattr(_runtime, "compile_check", lambda arch, progress=False: {})
    assert main_job.main(["--arch", "sm_80"]) == 0
    out = capsys.readouterr().out
    assert f"compile check of {count} instantiations for sm_80" in out
    assert "this takes a few minutes" in out


def test_precompile_on_a_device_that_is_not_there_is_named():
    """An explicit device index that no GPU answers to (none here, or 99 on
    a machine with GPUs): a RuntimeError naming it and the way to compile
    without it, not CuPy's runtime error."""
    with pytest.raises(RuntimeError, match=r"CUDA device 99 is not visible \(.*\); to check that "
                                           r"the kernels compile without it, pass an architecture"):
        cupy_fused.precompile(["scale_add.cu"], device=99)


def test_main_job_precompile_without_a_gpu_says_nothing_was_cached(monkeypatch, capsys):
    """--precompile without a GPU runs the compile check, then fails: a
    build step meant to fill the cache must not pass having cached
    nothing."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(_runtime, "compile_check", lambda arch, progress=False: {})
    assert main_job.main(["--precompile", "--arch", "sm_80"]) == 1
    assert "Nothing was cached" in capsys.readouterr().out


def test_main_job_names_cupys_error_where_torch_sees_a_gpu(monkeypatch, capsys):
    """torch sees a GPU, CuPy cannot use it (a CuPy for another CUDA major,
    an old driver): the job says so, with CuPy's error, and fails, instead
    of reporting no GPU and running the compile check."""
    cupy = pytest.importorskip("cupy")

    def refuse():
        raise RuntimeError("cudaErrorInsufficientDriver: CUDA driver version is insufficient")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceCount", refuse)
    monkeypatch.setattr(_runtime, "compile_check", lambda *a, **k: pytest.fail("compile check ran"))
    assert main_job.main([]) == 1
    out = capsys.readouterr().out
    assert "torch sees 1 CUDA GPU(s), CuPy none (RuntimeError: cudaErrorInsufficientDriver" in out


def test_cupy_that_cannot_make_its_cache_folder_is_named(monkeypatch):
    """CuPy makes its kernel cache folder when it is imported: where it
    cannot (no home folder, a read-only one), the error says to set
    CUPY_CACHE_DIR."""
    from cupy_fused import _cupy

    def unwritable(name):
        raise PermissionError(13, "Permission denied", "/nonexistent")

    monkeypatch.setattr(_cupy, "_cupy", None)
    monkeypatch.setattr(_cupy, "_failed", None)
    monkeypatch.setattr(_cupy.importlib, "import_module", unwritable)
    with pytest.raises(PermissionError, match="set CUPY_CACHE_DIR to a writable folder"):
        _cupy.require_cupy()
    # CuPy's modules are left half-imported: a second import in the process
    # would fail on them, naming none of this, so the error stays, and says
    # to restart (a later call does not import again).
    monkeypatch.setattr(_cupy.importlib, "import_module", lambda name: pytest.fail("imported"))
    with pytest.raises(PermissionError, match="set CUPY_CACHE_DIR.*restart Python after the fix"):
        _cupy.require_cupy()


def test_the_report_names_a_cupy_import_or_nvrtc_failure_without_a_traceback(monkeypatch, capsys):
    """python -m cupy_fused is the tool for a broken setup: CuPy that cannot
    make its cache folder, and an NVRTC that fails to load with a message
    not naming libnvrtc (a Windows DLL), are reported as such and the job
    fails (exit 1), not with a traceback."""
    from cupy_fused import _cupy

    def unwritable():
        raise PermissionError("importing CuPy failed: ... set CUPY_CACHE_DIR to a writable folder")

    with monkeypatch.context() as m:
        m.setattr(_cupy, "require_cupy", unwritable)
        assert main_job.main(["--no-compile-check"]) == 1
    out = capsys.readouterr().out
    assert "CuPy                   import failed (importing CuPy failed" in out, out

    def no_dll():
        raise ImportError("DLL load failed while importing nvrtc: the module could not be found")

    monkeypatch.setattr(_runtime, "nvrtc_version", no_dll)
    assert main_job.main(["--no-compile-check"]) == 1
    out = capsys.readouterr().out
    assert "NVRTC                  unavailable (DLL load failed" in out, out


def test_a_cupy_that_is_installed_but_does_not_import_is_not_called_missing(monkeypatch, capsys):
    """CuPy installed for another CUDA than the machine's (a library it
    cannot load): the error and the report say its import failed, with
    CuPy's own message, not that it is missing (which a cupy module absent
    still says)."""
    from cupy_fused import _cupy

    def broken(name):
        raise ImportError("libcudart.so.12: cannot open shared object file: No such file or directory")

    monkeypatch.setattr(_cupy, "_cupy", None)
    monkeypatch.setattr(_cupy, "_failed", None)
    monkeypatch.setattr(_cupy.importlib, "import_module", broken)
    with pytest.raises(ImportError, match=r"^CuPy is installed but importing it failed: "
                                          r"libcudart\.so\.12: cannot open"):
        _cupy.require_cupy()
    assert main_job.main(["--no-compile-check"]) == 1
    out = capsys.readouterr().out
    assert "CuPy                   import failed (CuPy is installed" in out and "NOT INSTALLED" not in out

    def missing(name):
        raise ModuleNotFoundError("No module named 'cupy'", name="cupy")

    monkeypatch.setattr(_cupy, "_failed", None)
    monkeypatch.setattr(_cupy.importlib, "import_module", missing)
    with pytest.raises(_cupy.CupyNotInstalledError, match="cupy-fused needs CuPy"):
        _cupy.require_cupy()


def test_a_kernel_folder_that_is_not_there_is_named(monkeypatch, tmp_path, capsys):
    missing = str(tmp_path / "nowhere")
    monkeypatch.setenv("CUPY_FUSED_KERNEL_DIR", missing)
    with pytest.raises(FileNotFoundError, match=f"CUPY_FUSED_KERNEL_DIR='{missing}' is not a folder"):
        _runtime.kernel_dir()
    assert main_job.main(["--no-compile-check"]) == 1
    out = capsys.readouterr().out
    assert "NOT FOUND" in out and "is not a folder" in out


def test_main_job_report_only(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env["CUDA_VISIBLE_DEVICES"] = ""  # the report only, also on a machine with a GPU
    proc = subprocess.run([sys.executable, "-m", "cupy_fused", "--no-compile-check"], env=env,
                          capture_output=True, text=True, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "NVRTC" in proc.stdout and "compile check skipped" in proc.stdout


def test_launch_shapes_are_data_in_the_kernel_names():
    """The gn_chain kernels' launch bounds are template parameters chosen by
    gn_chain.LaunchShapes; launch_shapes swaps them for a block (tuning)
    and restores the shipped ones, also after an error."""
    import dataclasses

    shipped = gn_chain_module.SHIPPED_SHAPES
    exprs = gn_chain_module._family(torch.float32, False, False).expressions
    fwd = exprs[("forward", torch.float32, "swish_bias_gn", 4)]
    assert fwd.endswith(f", float, {shipped.forward_min_blocks}>"), fwd
    tuned = dataclasses.replace(shipped, forward_min_blocks=6, team=(16, 8))
    with pytest.raises(RuntimeError, match="inside"):
        with gn_chain_module.launch_shapes(tuned):
            exprs = gn_chain_module._family(torch.float32, False, False).expressions
            assert exprs[("forward", torch.float32, "swish_bias_gn", 4)].endswith(", float, 6>")
            assert gn_chain_module.team_shape(64) == (16, 8)
            assert gn_chain_module.forward_team_shape(64) == (16, 8)
            raise RuntimeError("inside")
    assert gn_chain_module._family(torch.float32, False, False).expressions[
        ("forward", torch.float32, "swish_bias_gn", 4)] == fwd
    assert gn_chain_module.team_shape(64) == (16, 4)
    half = gn_chain_module._family(torch.bfloat16, False, False, True).expressions
    assert half[("backward_vec", torch.bfloat16, "swish_bias_gn", 8)].endswith(
        f", {shipped.backward_vec_min_blocks_half}>")
    # The scalar backward's bounds: float32 with 8 values per lane its own
    # (it spills most at the others'), the rest backward_min_blocks.
    exprs = gn_chain_module._family(torch.float32, False, False).expressions
    assert exprs[("backward", torch.float32, "swish_bias_gn", 8)].endswith(
        f", 8, float, {shipped.backward_min_blocks_float_wide}>")
    assert exprs[("backward", torch.float32, "swish_bias_gn", 4)].endswith(
        f", 4, float, {shipped.backward_min_blocks}>")
    half = gn_chain_module._family(torch.bfloat16, False, False).expressions
    assert half[("backward", torch.bfloat16, "swish_bias_gn", 8)].endswith(
        f", 8, cf::bfloat16, {shipped.backward_min_blocks}>")
    assert shipped.backward_min_blocks_float_wide != shipped.backward_min_blocks
    with pytest.raises(TypeError, match="LaunchShapes"):
        with gn_chain_module.launch_shapes({"forward_min_blocks": 6}):
            pass


def test_shared_memory_past_the_device_s_limit_is_refused(monkeypatch):
    """A kernel asked to take more dynamic shared memory than a block of its
    device may: a RuntimeError naming the kernel and the limit, not the
    driver's error at the launch (the callers size their kernels to fit)."""
    monkeypatch.setattr(_runtime, "max_shared_bytes", lambda device: 99 * 1024)

    class Raw:
        max_dynamic_shared_size_bytes = 0

    kernel = _runtime.Kernel("cf::probe", 0, Raw(), 0)
    with pytest.raises(RuntimeError, match=r"cf::probe needs 147456 bytes .*\(101376\)"):
        kernel.allow_shared(147456)
    assert kernel.shared_limit == 48 * 1024 and Raw.max_dynamic_shared_size_bytes == 0


def test_sources_are_read_as_utf_8_whatever_the_locale():
    """The kernel sources hold UTF-8 (in comments): read under a C locale
    without Python's UTF-8 mode, as on a machine whose locale is not UTF-8,
    the declarations and a source still read."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LC_", "LANG", "PYTHONUTF8"))}
    env.update(LC_ALL="C", PYTHONUTF8="0", PYTHONCOERCECLOCALE="0", PYTHONPATH=str(REPO))
    code = ("from cupy_fused import _bridge, _runtime; "
            "print(len(_bridge.declarations_in(_runtime.kernel_dir())) > 0, "
            "'\\u2014' in _runtime._read_source('bias_relu.cu'))")
    result = _run_python(code, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "True"]


def test_nvrtc_options_follow_the_sources_they_compile(tmp_path, monkeypatch):
    """The options (the folder's -I, the sources' hash that the disk caches
    key on) are made for each compile: a folder set, or a header changed,
    after a first compile gives the next its own."""
    first = _runtime.nvrtc_options()
    (tmp_path / "cf_common.cuh").write_text("// another header\n")
    monkeypatch.setenv("CUPY_FUSED_KERNEL_DIR", str(tmp_path))
    second = _runtime.nvrtc_options()
    assert f"-I{tmp_path}" in second and f"-I{tmp_path}" not in first
    hash_of = lambda options: next(o for o in options if "SOURCES_HASH" in o)  # noqa: E731
    assert hash_of(second) != hash_of(first)
    (tmp_path / "cf_common.cuh").write_text("// the header changed\n")
    assert hash_of(_runtime.nvrtc_options()) != hash_of(second)


@pytest.mark.parametrize("value, on", [("1", True), (" 1", True), ("0", False), ("", False),
                                       ("2", False), ("true", False)])
def test_cupy_switches_are_read_as_cupy_reads_them(value, on, monkeypatch):
    """CUPY_CACHE_IN_MEMORY: on where CuPy reads it on (an integer equal to
    1), so that the run time's own disk cache is skipped exactly where
    CuPy keeps its builds in memory."""
    monkeypatch.setenv("CUPY_CACHE_IN_MEMORY", value)
    assert _runtime._env_true("CUPY_CACHE_IN_MEMORY") is on


def test_stray_files_beside_the_kernels_are_not_sources(tmp_path, monkeypatch):
    """An editor's swap, lock and backup files (a binary ``.x.cu.swp``, a
    dangling ``.#x.cu`` link, an older ``#x.cu#`` whose kernel takes other
    parameters) and a ``.cubin`` beside the sources change neither the
    kernels' parameter layouts, nor the sources' hash, nor the options."""
    import shutil

    from cupy_fused import _bridge

    clean, messy = tmp_path / "clean", tmp_path / "messy"
    shutil.copytree(_runtime.kernel_dir(), clean)
    shutil.copytree(_runtime.kernel_dir(), messy)
    (messy / ".scale_add.cu.swp").write_bytes(b"\xff\xfe\x00binary")
    (messy / ".#scale_add.cu").symlink_to(messy / "no-such-file")
    older = (clean / "scale_add.cu").read_text().replace("double alpha", "i64 alpha")
    assert older != (clean / "scale_add.cu").read_text()
    (messy / "#scale_add.cu#").write_text(older)
    (messy / "scale_add.cubin").write_bytes(b"\x7fELF")
    seen = {}
    for folder in (clean, messy):
        monkeypatch.setenv("CUPY_FUSED_KERNEL_DIR", str(folder))
        monkeypatch.setattr(_bridge, "_signatures", {})
        _bridge._declarations.cache_clear()
        _runtime.nvrtc_options()  # (reads every source's size and time: no stray file)
        seen[folder.name] = (_bridge.kernel_signature("cf::scale_add<float>").format,
                             _runtime._sources_hash(), _runtime.source_files())
    _bridge._declarations.cache_clear()
    assert seen["clean"] == seen["messy"]


def test_a_header_in_the_working_folder_is_not_compiled_in(tmp_path, monkeypatch):
    """A header of the kernels' name in the working folder (a user's own
    cf_common.cuh) is not what the kernels include: the program is named by
    its path, and the .cu files include the headers with <>.  (Its cubin
    would go to the own disk cache under the key of the real sources.)"""
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path / "cache"))
    expr = _runtime.declared()["scale_add.cu"][0]
    shadow = tmp_path / "project"
    shadow.mkdir()
    real = (_runtime.kernel_dir() / "cf_common.cuh").read_text()
    (shadow / "cf_common.cuh").write_text(real + "\n__device__ int cf_shadow_marker = 1;\n")
    monkeypatch.chdir(shadow)
    cubin, _ = _runtime._cached_cubin("scale_add.cu", expr, "sm_80", _runtime.nvrtc_options())
    assert b"cf_shadow_marker" not in cubin.read_bytes()
    for path in _runtime.source_paths(_runtime.kernel_dir()):
        if path.suffix == ".cu":
            assert '#include "' not in path.read_text(), path.name


def test_the_compile_check_and_precompile_name_a_missing_kernel_source_at_once(tmp_path,
                                                                               monkeypatch):
    """A kernel folder lacking a declared source (a broken install, a
    CUPY_FUSED_KERNEL_DIR of one's own) fails the compile check, which
    walked the folder's files and passed; a missing folder is named once by
    precompile, not by each of its compiles."""
    for name in ("cf_common.cuh", "scale_add.cu"):
        (tmp_path / name).write_text((_runtime.kernel_dir() / name).read_text())
    monkeypatch.setenv("CUPY_FUSED_KERNEL_DIR", str(tmp_path))
    with pytest.raises(_runtime.CompileError, match=r"declared kernel sources missing from .*gemm\.cu"):
        _runtime.compile_check("sm_80")
    monkeypatch.setenv("CUPY_FUSED_KERNEL_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        cupy_fused.precompile(device="sm_80", progress=False)


def test_the_report_without_a_usable_gpu(monkeypatch, capsys):
    """--precompile without a GPU fails with --no-compile-check too (nothing
    was cached); a CPU build of torch where CuPy sees a GPU is named, and
    fails, where it said no GPU was visible."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main_job.main(["--precompile", "--no-compile-check"]) == 1
    assert "Nothing was cached" in capsys.readouterr().out
    cupy = pytest.importorskip("cupy")
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceCount", lambda: 1)
    monkeypatch.setattr(_runtime, "compile_check", lambda *a, **k: pytest.fail("compile check ran"))
    assert main_job.main(["--arch", "sm_80"]) == 1
    out = capsys.readouterr().out
    assert "CuPy sees 1 CUDA GPU(s), but this torch is a CPU build" in out, out


def test_main_job_checks_the_named_architectures_beside_a_gpu(monkeypatch, capsys):
    """--arch on a machine with a GPU runs the compile check of those
    architectures first (it was ignored), announced as asked for; a
    failure there fails the job before the GPU's own checks."""
    cupy = pytest.importorskip("cupy")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceCount", lambda: 1)
    checked = []

    def fake_check(arch, progress=False):
        checked.append(arch)
        raise _runtime.CompileError("gemm.cu: ... failed")

    monkeypatch.setattr(_runtime, "compile_check", fake_check)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: pytest.fail("went on past the failure"))
    assert main_job.main(["--arch", "sm_80"]) == 1
    assert checked == ["sm_80"]
    out = capsys.readouterr().out
    assert "Compile check (--arch) of" in out and "No CUDA GPU is visible" not in out, out
