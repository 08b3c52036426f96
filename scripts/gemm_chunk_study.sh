#!/usr/bin/env bash
# Compares the 3xTF32 kernel's accumulation chunk lengths (CF_GEMM_CHUNK_K):
# time at the problems' shapes, the error sweep over the inner size and the
# models' error table of the main job, one chunk length at a time.  Logs to
# $OUT (default ./gpu-logs).  Usage: bash scripts/gemm_chunk_study.sh [chunks...]
set -u
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
chunks=${*:-8 16 32 64 128}
for chunk in $chunks; do
  export CUPY_FUSED_NVRTC_OPTIONS="-DCF_GEMM_CHUNK_K=$chunk"
  echo "== chunk $chunk"
  python benchmarks/gemm.py --iters 10 --accuracy --accuracy-sizes 1024x1024 \
    --json "$OUT/gemm-chunk$chunk.json" --md "$OUT/gemm-chunk$chunk.md" > "$OUT/gemm-chunk$chunk.log" 2>&1
  grep -E "^(1024|32768)x" "$OUT/gemm-chunk$chunk.log" | sed 's/cublas tf32.*x/x/'
  python -m cupy_fused > "$OUT/main-chunk$chunk.log" 2>&1
  tail -22 "$OUT/main-chunk$chunk.log"
done
