#!/usr/bin/env bash
# Runs the whole GPU check in one call on a CUDA machine without network:
# installs in place, then the test suite (GPU tier included), the
# compute-sanitizer runs, the main job and the benchmarks.  Logs go to $OUT
# (default ./gpu-logs).
#   bash scripts/gpu_check.sh          everything
#   bash scripts/gpu_check.sh tests    the test suite only
#   bash scripts/gpu_check.sh quick    the test suite, then the benchmarks (no sanitizer)
#   bash scripts/gpu_check.sh fast     the test suite without the NVRTC compile check
#                                      and the wheel build (the CPU tier runs both;
#                                      much of the suite's time), then the
#                                      sanitizer runs, no benchmarks
#   bash scripts/gpu_check.sh sanitize the sanitizer runs only
# The suite runs in SHARDS processes at once (default 4), its slow tests
# after them.  Before the sanitizer runs every kernel is compiled for this
# GPU (python -m cupy_fused --precompile), so that they time the kernels,
# not NVRTC.
set -u
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)  # (absolute: relative to where it was called, before the cd below)
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
python -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/env.log" 2>&1 \
  || echo "editable install failed (see env.log); running from the source tree"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # scripts/ and subprocesses see this tree
status=0
nvidia-smi --query-gpu=name,driver_version --format=csv >> "$OUT/env.log" 2>&1
python -m cupy_fused 2>&1 | tee -a "$OUT/env.log" || status=1
mode=${1:-full}
deselect=()
[ "$mode" = "fast" ] && deselect=(-k "not nvrtc_compile_check and not wheel_ships")
if [ "$mode" != "sanitize" ]; then
  # The suite in $SHARDS processes at once (every n-th test each:
  # CUPY_FUSED_TEST_SHARD, tests/conftest.py; the small tests wait on
  # launches and compiles more than on the GPU), then the slow tests
  # (tensors of several GiB) in one process of their own, so that their
  # memory meets no other process's.  pytest's exit code 5: no test to run.
  shards=${SHARDS:-4}
  pids=()
  for ((k = 0; k < shards; k++)); do
    CUPY_FUSED_TEST_SHARD=$k/$shards python -m pytest -q -rs -m "not slow" --maxfail=25 --durations=10 \
      ${deselect[@]+"${deselect[@]}"} tests > "$OUT/pytest-$k.log" 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do
    wait "$pid"; rc=$?
    [ "$rc" -eq 0 ] || [ "$rc" -eq 5 ] || status=1
  done
  python -m pytest -q -rs -m slow --maxfail=25 --durations=10 ${deselect[@]+"${deselect[@]}"} tests \
    > "$OUT/pytest-slow.log" 2>&1
  rc=$?
  [ "$rc" -eq 0 ] || [ "$rc" -eq 5 ] || status=1
  for log in "$OUT"/pytest-*.log; do
    echo "== $log"
    grep -E "^(FAILED|ERROR) " "$log" | head -20
    tail -1 "$log"
  done
fi
if [ "$mode" != "quick" ] && [ "$mode" != "tests" ]; then
  python -m cupy_fused --precompile > "$OUT/precompile.log" 2>&1 || status=1
  # memcheck over all three dtypes in one run; racecheck (slower) over fp32
  # and bf16, one section of sanitize.py a run, each with its own time
  # limit, so that a slow section cannot keep the others unchecked.
  timeout 300 compute-sanitizer --tool memcheck --print-limit 20 python scripts/sanitize.py fp32 fp16 bf16 \
    > "$OUT/sanitizer-memcheck.log" 2>&1 || status=1
  echo "memcheck: $(tail -1 "$OUT/sanitizer-memcheck.log")"
  for section in $(python -c "import runpy; print(*runpy.run_path('scripts/sanitize.py')['SECTIONS'])"); do
    timeout 300 compute-sanitizer --tool racecheck --print-limit 20 python scripts/sanitize.py fp32 bf16 \
      --only "$section" > "$OUT/sanitizer-racecheck-$section.log" 2>&1 || status=1
    echo "racecheck $section: $(tail -1 "$OUT/sanitizer-racecheck-$section.log")"
  done
fi
case "$mode" in tests|fast|sanitize) echo "gpu_check status: $status"; exit $status;; esac
python benchmarks/host_overhead.py --json "$OUT/host_overhead.json" 2>&1 | tee "$OUT/bench.log"
python benchmarks/gemm.py --accuracy --accuracy-sizes 256x256 1024x1024 --json "$OUT/gemm.json" --md "$OUT/gemm.md" 2>&1 | tail -30 | tee -a "$OUT/bench.log"
python benchmarks/run.py --out "$OUT" 2>&1 | tail -25 | tee -a "$OUT/bench.log"
echo "gpu_check status: $status"
exit $status
