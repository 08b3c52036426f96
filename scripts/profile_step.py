"""Kernel-level profile (torch.profiler) of one training step of a model at
its benchmark shape, ours and eager:  python scripts/profile_step.py 76 bf16"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from cupy_fused import reference
from cupy_fused.testing import build_pair

problem = int(sys.argv[1])
dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[sys.argv[2]]
_, args, shape = reference.PROBLEMS[problem]
ref, ours = build_pair(problem, args, "cuda", dtype)
x = torch.rand(shape, device="cuda", dtype=dtype, requires_grad=True)
for name, model in (("ours", ours), ("eager", ref)):
    for _ in range(3):
        model(x).sum().backward()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            model(x).sum().backward()
        torch.cuda.synchronize()
    print(f"== {name}")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=70))
