"""KernelBench level 2, problem 1_Conv2D_ReLU_BiasAdd: cupy-fused solution.

Solution format of the KernelBench evaluator: ``ModelNew`` (same constructor
and parameters as the problem's ``Model``), ``get_inputs`` and
``get_init_inputs`` at the benchmark shapes.  ``Model`` is the reference.
"""
import torch

from cupy_fused import ConvReluBiasAdd as _Fused
from cupy_fused.reference import Conv2dReLUBiasAdd as Model  # noqa: F401  (the problem's reference)

batch_size = 128
in_channels = 64
out_channels = 128
height = width = 128
kernel_size = 3
bias_shape = (out_channels, 1, 1)


class ModelNew(_Fused):
    def __init__(self, in_channels, out_channels, kernel_size, bias_shape):
        super().__init__(in_channels, out_channels, kernel_size, bias_shape)


def get_inputs():
    return [torch.rand(batch_size, in_channels, height, width)]


def get_init_inputs():
    return [in_channels, out_channels, kernel_size, bias_shape]
