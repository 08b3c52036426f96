"""The five PyTorch reference modules (KernelBench level 2, problems 1, 37,
76, 88 and 94), exactly as specified, with their benchmark shapes.  Tests and
benchmarks import them from here."""
from __future__ import annotations

import torch
import torch.nn as nn


class Conv2dReLUBiasAdd(nn.Module):
    """Problem 1: ``relu(conv(x)) + bias``."""

    def __init__(self, in_channels, out_channels, kernel_size, bias_shape):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size)
        self.bias = nn.Parameter(torch.randn(bias_shape))

    def forward(self, x):
        x = self.conv(x)
        x = torch.relu(x)
        x = x + self.bias
        return x


class MatmulSwishSumGroupNorm(nn.Module):
    """Problem 37: ``group_norm(swish(matmul(x)) + bias)``."""

    def __init__(self, in_features, out_features, num_groups, bias_shape):
        super().__init__()
        self.matmul = nn.Linear(in_features, out_features)
        self.bias = nn.Parameter(torch.randn(bias_shape))
        self.group_norm = nn.GroupNorm(num_groups, out_features)

    def forward(self, x):
        x = self.matmul(x)
        x = torch.sigmoid(x) * x
        x = x + self.bias
        x = self.group_norm(x)
        return x


class GemmAddReLU(nn.Module):
    """Problem 76: ``relu(gemm(x) + bias)``."""

    def __init__(self, in_features, out_features, bias_shape):
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features, bias=False)
        self.bias = nn.Parameter(torch.randn(bias_shape))

    def forward(self, x):
        x = self.gemm(x)
        x = x + self.bias
        x = torch.relu(x)
        return x


class GemmGroupNormSwishMultiplySwish(nn.Module):
    """Problem 88: ``g = group_norm(gemm(x)); m = swish(g) * w; swish(m)``."""

    def __init__(self, in_features, out_features, num_groups, multiply_weight_shape):
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features)
        self.group_norm = nn.GroupNorm(num_groups, out_features)
        self.multiply_weight = nn.Parameter(torch.randn(multiply_weight_shape))

    def forward(self, x):
        x = self.gemm(x)
        x = self.group_norm(x)
        x = x * torch.sigmoid(x)
        x = x * self.multiply_weight
        x = x * torch.sigmoid(x)
        return x


class GemmBiasAddHardtanhMishGroupNorm(nn.Module):
    """Problem 94: ``groupnorm(mish(hardtanh(gemm(x) + bias)))``."""

    def __init__(self, in_features, out_features, bias_shape, num_groups):
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features)
        self.bias = nn.Parameter(torch.randn(bias_shape))
        self.hardtanh = nn.Hardtanh()
        self.mish = nn.Mish()
        self.groupnorm = nn.GroupNorm(num_groups=num_groups, num_channels=out_features)

    def forward(self, x):
        x = self.gemm(x)
        x = x + self.bias
        x = self.hardtanh(x)
        x = self.mish(x)
        x = self.groupnorm(x)
        return x


# Problem id -> (reference class, ctor args, input shape) at the benchmark shapes.
PROBLEMS = {
    1: (Conv2dReLUBiasAdd, (64, 128, 3, (128, 1, 1)), (128, 64, 128, 128)),
    37: (MatmulSwishSumGroupNorm, (1024, 4096, 64, (4096,)), (32768, 1024)),
    76: (GemmAddReLU, (8192, 8192, (8192,)), (1024, 8192)),
    88: (GemmGroupNormSwishMultiplySwish, (8192, 8192, 256, (8192,)), (1024, 8192)),
    94: (GemmBiasAddHardtanhMishGroupNorm, (8192, 8192, (8192,), 256), (1024, 8192)),
}

# Small shapes with the same structure (for quick checks and the main job).
SMALL_PROBLEMS = {
    1: (Conv2dReLUBiasAdd, (8, 16, 3, (16, 1, 1)), (4, 8, 20, 24)),
    37: (MatmulSwishSumGroupNorm, (64, 256, 8, (256,)), (96, 64)),
    76: (GemmAddReLU, (64, 256, (256,)), (96, 64)),
    88: (GemmGroupNormSwishMultiplySwish, (64, 256, 16, (256,)), (96, 64)),
    94: (GemmBiasAddHardtanhMishGroupNorm, (64, 256, (256,), 16), (96, 64)),
}
