"""Usage: python scripts/sanitize.py [fp32 fp16 bf16]

Small-shape run of every fused op, forward and backward, in all three
dtypes: the workload scripts/gpu_check.sh runs under compute-sanitizer
(memcheck, racecheck)."""
import sys

import torch

from cupy_fused import reference
from cupy_fused.ops import gemm as G
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
if torch.float32 in dtypes:
    # The GEMM kernel family directly: every layout, both pass counts, ragged
    # edges, both tiles (1536 x 1540 fills the GPU with 128 x 128 tiles) and
    # the word-load variant (an operand whose rows are not 16-byte aligned).
    gen = torch.Generator(device="cuda").manual_seed(0)
    for m, k, n in ((1, 1, 1), (67, 45, 130), (1536, 40, 1540)):
        for layout, (a_kmajor, b_kmajor) in G.LAYOUTS.items():
            a = torch.rand((m, k) if a_kmajor else (k, m), device="cuda", generator=gen)
            b = torch.rand((n, k) if b_kmajor else (k, n), device="cuda", generator=gen)
            a_unaligned = torch.empty(a.numel() + 1, device="cuda")[1:].view_as(a).copy_(a)
            for passes in (1, 3):
                ok = torch.equal(G.gemm(a, b, layout, passes), G.gemm(a_unaligned, b, layout, passes))
                print("gemm", layout, (m, k, n), passes, "OK" if ok else "MISMATCH", flush=True)
                failed += [] if ok else [f"gemm {layout} {(m, k, n)}"]
sys.exit(1 if failed else 0)
