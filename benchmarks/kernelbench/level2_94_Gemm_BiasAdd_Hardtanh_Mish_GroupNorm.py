"""KernelBench level 2, problem 94_Gemm_BiasAdd_Hardtanh_Mish_GroupNorm: cupy-fused solution.

Solution format of the KernelBench evaluator: ``ModelNew`` (same constructor
and parameters as the problem's ``Model``), ``get_inputs`` and
``get_init_inputs`` at the benchmark shapes.  ``Model`` is the reference.

``eager_rounding=True``: the evaluator compares float16 / bfloat16 outputs
with eager's in the same dtype (atol = rtol = 1e-2), so the op chain rounds
its intermediates where eager does; without it ours is closer to the exact
result but up to a few bf16 units from eager's (no effect in float32).
"""
import torch

from cupy_fused import GemmBiasAddHardtanhMishGroupNorm as _Fused
from cupy_fused.reference import GemmBiasAddHardtanhMishGroupNorm as Model  # noqa: F401  (the problem's reference)

batch_size = 1024
in_features = 8192
out_features = 8192
bias_shape = (out_features,)
num_groups = 256


class ModelNew(_Fused):
    def __init__(self, in_features, out_features, bias_shape, num_groups):
        super().__init__(in_features, out_features, bias_shape, num_groups, eager_rounding=True)


def get_inputs():
    return [torch.rand(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features, bias_shape, num_groups]
