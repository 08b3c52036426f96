"""KernelBench level 2, problem 37_Matmul_Swish_Sum_GroupNorm: cupy-fused solution.

Solution format of the KernelBench evaluator: ``ModelNew`` (same constructor
and parameters as the problem's ``Model``), ``get_inputs`` and
``get_init_inputs`` at the benchmark shapes.  ``Model`` is the reference.

``eager_rounding=True``: the evaluator compares float16 / bfloat16 outputs
with eager's in the same dtype (atol = rtol = 1e-2), so the op chain rounds
its intermediates where eager does; without it ours is closer to the exact
result but up to a few bf16 units from eager's (no effect in float32).
"""
import torch

from cupy_fused import MatmulSwishSumGroupNorm as _Fused
from cupy_fused.reference import MatmulSwishSumGroupNorm as Model  # noqa: F401  (the problem's reference)

batch_size = 32768
in_features = 1024
out_features = 4096
num_groups = 64
bias_shape = (out_features,)


class ModelNew(_Fused):
    def __init__(self, in_features, out_features, num_groups, bias_shape):
        super().__init__(in_features, out_features, num_groups, bias_shape, eager_rounding=True)


def get_inputs():
    return [torch.rand(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features, num_groups, bias_shape]
