"""One forward and backward of a model at its benchmark shape, for ncu:

    ncu --kernel-name regex:'gn_chain|bias_relu' --section SpeedOfLight \
        --section Occupancy --section LaunchStats python scripts/profile_epilogues.py 37
"""
import sys

import torch

from cupy_fused import reference
from cupy_fused.testing import build_pair

problem = int(sys.argv[1]) if len(sys.argv) > 1 else 37
_, args, shape = reference.PROBLEMS[problem]
_, ours = build_pair(problem, args, "cuda", torch.float32)
x = torch.rand(shape, device="cuda", requires_grad=True)
for _ in range(2):
    ours(x).sum().backward()
torch.cuda.synchronize()
