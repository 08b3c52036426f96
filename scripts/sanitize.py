"""Usage: python scripts/sanitize.py [fp32 fp16 bf16]

Small-shape run of every fused op, forward and backward, in all three
dtypes: the workload scripts/gpu_check.sh runs under compute-sanitizer
(memcheck, racecheck)."""
import sys

import torch

from cupy_fused import reference
from cupy_fused.testing import compare, worse_than_eager

NAMES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
dtypes = [NAMES[a] for a in sys.argv[1:]] or list(NAMES.values())
failed = []
for dtype in dtypes:
    cases = list(reference.SMALL_PROBLEMS.items()) + [
        (37, (None, (8, 600, 1, (600,)), (3, 8))),     # wide-group path
        (88, (None, (8, 40, 40, (40,)), (5, 8))),      # one channel per group
        (76, (None, (8, 77, (77,)), (3, 8))),          # mask tail
    ]
    for problem, (_, args, shape) in cases:
        for mode in ("random", "sum"):
            errors = compare(problem, args, shape, dtype, "cuda", grad_mode=mode)
            bad = worse_than_eager(errors, dtype)
            print(problem, dtype, mode, "OK" if not bad else f"WORSE {bad}", flush=True)
            failed += bad
sys.exit(1 if failed else 0)
