"""Data-parallel training of the fused modules across processes.

GPU tier, two GPUs (marked ``multigpu``): two processes, one GPU each, over
NCCL.  For every model, in float32 and with a float32 model under bf16
autocast, three SGD steps of DDP over a global batch split in two land on
the parameters of one process training on the whole batch; two DDP runs
agree bitwise; FSDP2 (``fully_shard`` on the fused module as a whole)
trains as DDP does.

GPU tier, one GPU: the same DDP checks with two processes sharing cuda:0
over gloo (whose all-reduce takes CUDA tensors), so that a one-GPU machine
exercises the multi-process path.

CPU tier: the same harness with the eager reference modules on CPU over
gloo (the fused modules need a GPU), checking the harness itself, and the
pure-Python parts of ``benchmarks/scaling.py``.

The children are started with the "spawn" method (a forked child cannot
use CUDA), import cupy_fused and build their models themselves, and hand
back their parameters as CPU tensors through ``torch.save``.  An exception
in a child fails the test with the child's traceback.
"""
import datetime
import gc
import importlib.util
import json
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cupy_fused import reference

REPO = Path(__file__).resolve().parents[1]
WORLD = 2
STEPS = 3
LR = 0.01
AMP = {"fp32": None, "amp-bf16": torch.bfloat16}
# float32: max |distributed - single| / max |single| per parameter; the two
# runs differ only in the order of the batch reductions.  bf16 autocast:
# ||distributed - single|| / ||single|| (Frobenius) per parameter.  There
# the weight gradients are products rounded to bf16 (over half the batch in
# DDP, over all of it in the single run), and once the parameters differ a
# ReLU or hardtanh input near its kink can switch sides in one run and not
# the other, moving single elements by about the learning rate: the
# reference modules on CPU reach 1.9e-2 by this norm (0.1 by the max).
TOLERANCE = {"fp32": 1e-5, "amp-bf16": 5e-2}
NORM_ERROR = {"fp32": False, "amp-bf16": True}
# A child waiting on a peer that died stops at this timeout instead of
# hanging the suite.
COLLECTIVE_TIMEOUT_S = 300
SPAWN_DEADLINE_S = 900


# --- what each child runs ------------------------------------------------

def _fully_shard():
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        return None
    return fully_shard


def _autocast(amp, device):
    if amp is None:
        return torch.autocast(device.type, enabled=False)
    return torch.autocast(device.type, dtype=amp)


def _build(problem, impl, device):
    from cupy_fused.testing import build_pair

    _, args, _ = reference.SMALL_PROBLEMS[problem]
    ref, ours = build_pair(problem, args, device, torch.float32)
    return ours if impl == "ours" else ref


def _global_batches(problem, impl, device, amp):
    """STEPS global input batches and the output gradient g, the same on
    every rank (drawn on the CPU from the problem's seed)."""
    _, _, shape = reference.SMALL_PROBLEMS[problem]
    assert shape[0] % WORLD == 0, (problem, shape)
    gen = torch.Generator().manual_seed(1000 + problem)
    xs = [torch.rand(shape, generator=gen).to(device) for _ in range(STEPS)]
    with torch.no_grad(), _autocast(amp, device):
        out_shape = _build(problem, impl, device)(xs[0]).shape
    g = torch.randn(out_shape, generator=gen).to(device)
    return xs, g


def _train(model, xs, g, amp, device, scale=1.0):
    """STEPS SGD steps on the loss ``scale * (y * g).sum()``."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for x in xs:
        opt.zero_grad(set_to_none=True)
        with _autocast(amp, device):
            y = model(x)
        loss = (y * g).sum()  # float32 under autocast too (g is float32)
        if scale != 1.0:
            loss = loss * scale
        loss.backward()
        opt.step()


def _cpu_params(module):
    """Full parameters as CPU tensors (an FSDP2 parameter is a DTensor
    shard: ``full_tensor`` all-gathers it, so every rank must call this)."""
    out = {}
    for name, p in module.named_parameters():
        p = p.detach()
        if hasattr(p, "full_tensor"):
            p = p.full_tensor()
        out[name] = p.cpu().clone()
    return out


def _case(problem, dtype, spec, rank, device):
    amp = AMP[dtype]
    impl = spec["impl"]
    xs, g = _global_batches(problem, impl, device, amp)
    local = [x.chunk(WORLD)[rank].contiguous() for x in xs]
    local_g = g.chunk(WORLD)[rank].contiguous()
    result = {}
    if rank == 0:
        # DDP averages the ranks' gradients: the single run's loss carries
        # the matching 1 / world size.
        single = _build(problem, impl, device)
        _train(single, xs, g, amp, device, scale=1.0 / WORLD)
        result["single"] = _cpu_params(single)
    dist.barrier()
    device_ids = [device.index] if device.type == "cuda" else None
    for run in ("ddp", "ddp_again"):
        ddp = torch.nn.parallel.DistributedDataParallel(_build(problem, impl, device),
                                                        device_ids=device_ids)
        _train(ddp, local, local_g, amp, device)
        result[run] = _cpu_params(ddp.module)
    if spec["fsdp"]:
        fully_shard = _fully_shard()
        if fully_shard is not None:
            sharded = _build(problem, impl, device)
            fully_shard(sharded)
            _train(sharded, local, local_g, amp, device)
            result["fsdp"] = _cpu_params(sharded)
    return result


def _worker(rank, spec):
    """One process of a test: trains every case of ``spec`` and, on rank
    0, saves ``{(problem, dtype): {run: {name: CPU tensor}}}``."""
    if spec["device"] == "cuda":
        index = rank if spec["gpu_per_rank"] else 0
        torch.cuda.set_device(index)
        device = torch.device("cuda", index)
        # The single run and DDP see different batch sizes: keep cuDNN and
        # cuBLAS from picking TF32 or a non-deterministic algorithm for one
        # of them, so that float32 stays float32 and reruns are bitwise.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    else:
        device = torch.device("cpu")
    extra = {"device_id": device} if spec["backend"] == "nccl" else {}
    dist.init_process_group(spec["backend"], init_method=f"file://{spec['store']}", rank=rank,
                            world_size=WORLD,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S), **extra)
    try:
        results = {}
        for problem in spec["problems"]:
            for dtype in spec["dtypes"]:
                results[(problem, dtype)] = _case(problem, dtype, spec, rank, device)
        if rank == 0:
            torch.save(results, spec["out"])
        # DDP's reducer sits in reference cycles: collect it while its
        # process group is alive, not at interpreter exit after the group is
        # destroyed (where a gloo or NCCL thread still attached to it can
        # end the process with std::terminate).
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()


# --- the parent side -----------------------------------------------------

def _spawn(tmp_path, **spec):
    """Runs ``_worker`` in WORLD spawned processes; returns rank 0's results.
    A child's exception is raised here (``ProcessRaisedException``, with
    the child's traceback); a run past the deadline is stopped and fails."""
    spec = dict(spec, store=str(tmp_path / "store"), out=str(tmp_path / "results.pt"))
    context = mp.start_processes(_worker, args=(spec,), nprocs=WORLD, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + SPAWN_DEADLINE_S
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.terminate()
            pytest.fail(f"the {WORLD} processes did not finish in {SPAWN_DEADLINE_S} s")
    return torch.load(spec["out"])


def _rel_error(value, truth, norm=False):
    if norm:
        scale = truth.double().norm().item()
        err = (value.double() - truth.double()).norm().item()
        return err / scale if scale > 0 else err
    scale = truth.double().abs().max().item()
    err = (value.double() - truth.double()).abs().max().item()
    if err != err:
        return float("inf")
    return err / scale if scale > 0 else err


def _check_close(got, expected, tol, norm, what):
    assert list(got) == list(expected), what
    errors = {name: _rel_error(got[name], expected[name], norm) for name in expected}
    bad = {name: e for name, e in errors.items() if not e <= tol}
    assert not bad, f"{what}: relative errors above {tol}: {bad}"


def _check_equal(got, expected, what):
    assert list(got) == list(expected), what
    for name in expected:
        assert torch.equal(got[name], expected[name]), (
            f"{what}: {name} differs by {(got[name] - expected[name]).abs().max().item()}")


def _check_case(results, problem, dtype, fsdp):
    runs = results[(problem, dtype)]
    tol, norm = TOLERANCE[dtype], NORM_ERROR[dtype]
    _check_close(runs["ddp"], runs["single"], tol, norm, "DDP vs one process")
    _check_equal(runs["ddp_again"], runs["ddp"], "DDP rerun")
    if fsdp:
        if "fsdp" not in runs:
            pytest.skip("this torch has no torch.distributed.fsdp.fully_shard (FSDP2)")
        _check_close(runs["fsdp"], runs["ddp"], tol, norm, "FSDP2 vs DDP")


CASES = [(p, d) for p in sorted(reference.SMALL_PROBLEMS) for d in AMP]
CASE_IDS = [f"{p}-{d}" for p, d in CASES]


def _needs_gpus(count, backend):
    if not torch.cuda.is_available() or torch.cuda.device_count() < count:
        pytest.skip(f"needs {count} GPU{'s' if count > 1 else ''} "
                    f"({torch.cuda.device_count() if torch.cuda.is_available() else 0} visible)")
    if not dist.is_available():
        pytest.skip("this torch has no torch.distributed")
    if backend == "nccl" and not dist.is_nccl_available():
        pytest.skip("torch.distributed has no NCCL")
    if backend == "gloo" and not dist.is_gloo_available():
        pytest.skip("torch.distributed has no gloo")


@pytest.fixture(scope="module")
def two_gpu_results(tmp_path_factory):
    _needs_gpus(2, "nccl")
    return _spawn(tmp_path_factory.mktemp("nccl"), backend="nccl", device="cuda",
                  gpu_per_rank=True, impl="ours", fsdp=True,
                  problems=sorted(reference.SMALL_PROBLEMS), dtypes=list(AMP))


@pytest.fixture(scope="module")
def shared_gpu_results(tmp_path_factory):
    _needs_gpus(1, "gloo")
    return _spawn(tmp_path_factory.mktemp("gloo"), backend="gloo", device="cuda",
                  gpu_per_rank=False, impl="ours", fsdp=False,
                  problems=sorted(reference.SMALL_PROBLEMS), dtypes=list(AMP))


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.parametrize("problem,dtype", CASES, ids=CASE_IDS)
def test_two_gpus_ddp_and_fsdp_train_as_one_process(problem, dtype, two_gpu_results):
    _check_case(two_gpu_results, problem, dtype, fsdp=True)


@pytest.mark.gpu
@pytest.mark.parametrize("problem,dtype", CASES, ids=CASE_IDS)
def test_two_processes_on_one_gpu_ddp_trains_as_one_process(problem, dtype, shared_gpu_results):
    _check_case(shared_gpu_results, problem, dtype, fsdp=False)


def test_harness_on_cpu_with_the_reference_modules(tmp_path):
    """The spawn / DDP / comparison machinery above, with the eager
    reference of one GEMM problem on CPU over gloo."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    results = _spawn(tmp_path, backend="gloo", device="cpu", gpu_per_rank=False,
                     impl="reference", fsdp=False, problems=[76], dtypes=["fp32"])
    _check_case(results, 76, "fp32", fsdp=False)
    # The check is not vacuous: training moved the parameters.
    initial = _cpu_params(_build(76, "reference", torch.device("cpu")))
    moved = results[(76, "fp32")]["ddp"]
    assert initial and all(not torch.equal(moved[n], initial[n]) for n in initial)


# --- benchmarks/scaling.py (CPU tier) ------------------------------------

def _scaling():
    spec = importlib.util.spec_from_file_location("bench_scaling", REPO / "benchmarks/scaling.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_scaling_arguments_and_world_sizes():
    scaling = _scaling()
    args = scaling.parse_args([])
    assert args.dtypes == ["fp32", "amp-bf16"]
    assert args.impls == ["eager", "compile", "ours"]
    assert args.problems == sorted(reference.PROBLEMS)
    assert scaling.world_sizes(1) == [1]
    assert scaling.world_sizes(2) == [1, 2]
    assert scaling.world_sizes(6) == [1, 2, 4, 6]
    assert scaling.world_sizes(8) == [1, 2, 4, 8]
    with pytest.raises(SystemExit):
        scaling.parse_args(["--dtypes", "fp64"])


def test_scaling_refuses_fewer_than_two_gpus_unless_asked_for_one():
    scaling = _scaling()
    with pytest.raises(SystemExit, match="at least 2"):
        scaling.gpu_count(scaling.parse_args([]), visible=1)
    with pytest.raises(SystemExit, match="no CUDA GPU"):
        scaling.gpu_count(scaling.parse_args(["--gpus", "1"]), visible=0)
    with pytest.raises(SystemExit, match="visible"):
        scaling.gpu_count(scaling.parse_args(["--gpus", "4"]), visible=2)
    assert scaling.gpu_count(scaling.parse_args(["--gpus", "1"]), visible=1) == 1
    assert scaling.gpu_count(scaling.parse_args([]), visible=4) == 4
    assert scaling.gpu_count(scaling.parse_args(["--gpus", "2"]), visible=8) == 2


def test_scaling_table_efficiency_and_all_reduce_volume():
    scaling = _scaling()
    rows = [dict(problem=76, dtype="fp32", impl=impl, gpus=n, median_ms=ms, min_ms=ms,
                 param_bytes=4 * (8192 * 8192 + 8192))
            for impl, times in (("eager", {1: 10.0, 2: 12.5}), ("ours", {1: 8.0, 2: 8.0}))
            for n, ms in times.items()]
    summary = scaling.summarize(rows)
    by_impl = {s["impl"]: s for s in summary}
    assert by_impl["eager"]["efficiency"] == pytest.approx(0.8)
    assert by_impl["ours"]["efficiency"] == pytest.approx(1.0)
    assert by_impl["ours"]["gpus"] == 2
    # A ring all-reduce sends and receives 2 (n - 1) / n of the buffer per GPU.
    assert scaling.ring_bytes_per_gpu(1000, 1) == 0
    assert scaling.ring_bytes_per_gpu(1000, 2) == 1000
    assert scaling.ring_bytes_per_gpu(1000, 8) == 1750
    text = scaling.table(rows)
    lines = text.splitlines()
    assert "1 GPU ms" in lines[0] and "2 GPUs ms" in lines[0] and "efficiency" in lines[0]
    assert any("eager" in line and "10.000" in line and "12.500" in line and "0.80" in line
               for line in lines)
    assert any("ours" in line and "1.00" in line for line in lines)
    assert "268.5" in text  # all-reduce MB per step of problem 76's parameters
    # A missing measurement (a failed world size) shows as "-".
    partial = scaling.table(rows[:3])
    assert any("ours" in line and " - " in line for line in partial.splitlines())


def _scaling_result(scaling):
    rows = [dict(problem=76, dtype="float32", impl=impl, gpus=n, median_ms=ms, min_ms=ms,
                 host_ms=1.0 if impl == "eager" else 6.0, gpu_ms=ms,
                 param_bytes=4 * (8192 * 8192 + 8192))
            for impl, times in (("eager", {1: 10.0, 2: 12.5}), ("compile", {1: 8.0, 2: 9.0}),
                                ("ours", {1: 5.0, 2: 5.0}))
            for n, ms in times.items()]
    link = dict(gpus=2, bytes=256 << 20, median_ms=1.0,
                busbw_gbps=scaling.ring_bytes_per_gpu(256 << 20, 2) / 1e6)  # 1 ms
    meta = dict(device="GPU", gpus=2, torch="t", cuda="c", nccl="n", date="2026-01-01",
                argv=["--publish"], iters=30, warmup=5, quick=False)
    return dict(meta=meta, rows=rows, allreduce=[None, link])


def test_scaling_paper_estimates():
    scaling = _scaling()
    result = _scaling_result(scaling)
    ours = [s for s in scaling.summarize(result["rows"], result["allreduce"])
            if s["impl"] == "ours"][0]
    nbytes = 4 * (8192 * 8192 + 8192)
    bw = result["allreduce"][1]["busbw_gbps"]
    # All-reduce at 2 GPUs: nbytes over the ring's bus bandwidth.
    assert ours["allreduce_ms"] == pytest.approx(nbytes / bw / 1e6)
    # 8 GPUs: the ring sends 1.75x the bytes of 2 GPUs'; the extra 0.75 of
    # the 2-GPU all-reduce time lands on the step.
    assert ours["efficiency_at_8"] == pytest.approx(5.0 / (5.0 + 0.75 * ours["allreduce_ms"]))
    extra = 2 * 15 / 16 * nbytes / scaling.NETWORK_GBPS / 1e6 - ours["allreduce_ms"]
    assert ours["efficiency_2_hosts"] == pytest.approx(5.0 / (5.0 + extra))
    # A step that gets faster on more GPUs is not credited with a negative cost.
    assert scaling.paper_efficiency(1.0, 1.0, 4, 1000, 1e3, 2) == 1.0


def test_scaling_publishes_its_section(tmp_path):
    scaling = _scaling()
    result = _scaling_result(scaling)
    (tmp_path / "docs").mkdir()
    (tmp_path / "results").mkdir()
    doc = tmp_path / "docs" / "performance.md"
    doc.write_text("before\n<!-- scaling:start (x) -->\nold\n<!-- scaling:end -->\nafter\n")
    scaling.publish(result, root=str(tmp_path))
    text = doc.read_text()
    assert text.startswith("before\n<!-- scaling:start (x) -->\n## Scaling over GPUs (GPU x2")
    assert "old" not in text and text.endswith("<!-- scaling:end -->\nafter\n")
    assert ("| 76 | ours | 5.000 | 5.000 | 6.00 / 5.00 (host-bound) | 1.00 | 2.00x → 2.50x | "
            "1.60x → 1.80x | 268.5 |") in text
    assert "| 76 | eager | 10.000 | 12.500 | 1.00 / 12.50 | 0.80 |" in text
    assert json.loads((tmp_path / "results" / "scaling.json").read_text())["rows"] == result["rows"]
    # A missing count shows as "-".
    partial = dict(result, rows=result["rows"][:5])
    assert ("| 76 | ours | 5.000 | - | - | - | 2.00x → - | 1.60x → - |"
            in scaling.markdown(partial))


def test_scaling_baseline_takes_the_slowest_gpu():
    scaling = _scaling()
    row = dict(problem=76, dtype="float32", impl="ours", gpus=1, param_bytes=8)
    parts = [[dict(row, median_ms=3.0, min_ms=2.9, host_ms=1.0, gpu_ms=2.5)],
             [dict(row, median_ms=3.2, min_ms=2.8, host_ms=0.9, gpu_ms=2.6)]]
    merged = scaling.merge_replicas(parts)
    assert merged == [dict(row, median_ms=3.2, min_ms=2.9, host_ms=1.0, gpu_ms=2.6,
                           per_gpu_ms=[3.0, 3.2])]


def _meet(rank, barrier, out_dir):
    barrier.wait()
    (Path(out_dir) / f"met.{rank}").write_text("")


def test_scaling_replica_barrier_reaches_spawned_processes(tmp_path):
    """The one-GPU replicas' barrier passes to processes started as
    run_world starts them, and releases them together."""
    scaling = _scaling()
    mp.start_processes(_meet, args=(scaling.replica_barrier(2), str(tmp_path)), nprocs=2,
                       start_method="spawn")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["met.0", "met.1"]


def _readme_ddp_example() -> str:
    text = (REPO / "README.md").read_text()
    section = text.split("## Multi-GPU", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_readme_ddp_example_is_found():
    code = _readme_ddp_example()
    assert "DistributedDataParallel" in code and "backward()" in code
    compile(code, "README.md", "exec")


@pytest.mark.gpu
@pytest.mark.multigpu
def test_readme_ddp_example_runs_under_torchrun(tmp_path):
    """The README's multi-GPU example, as written, under ``torchrun
    --nproc-per-node 2``."""
    import subprocess
    import sys

    _needs_gpus(2, "nccl")
    script = tmp_path / "train.py"
    script.write_text(_readme_ddp_example() + "\ndist.destroy_process_group()\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))  # this tree's cupy_fused
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", "2", str(script)],
                         capture_output=True, text=True, timeout=SPAWN_DEADLINE_S, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
