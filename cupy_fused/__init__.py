"""cupy-fused: fused CUDA kernels for PyTorch models, compiled at run time by
NVRTC through CuPy — no nvcc, no C++ build.

Importing the package needs neither CuPy nor a GPU and compiles nothing;
the first kernel launch compiles (and caches) what it uses.
"""
from . import ops
from .ops import get_fp32_matmul_precision, set_fp32_matmul_precision
from .models import (
    ConvReluBiasAdd,
    GemmAddRelu,
    GemmBiasAddHardtanhMishGroupNorm,
    GemmGroupNormSwishMultiplySwish,
    MatmulSwishSumGroupNorm,
)

__version__ = "0.1.0"

__all__ = [
    "ConvReluBiasAdd",
    "GemmAddRelu",
    "GemmBiasAddHardtanhMishGroupNorm",
    "GemmGroupNormSwishMultiplySwish",
    "MatmulSwishSumGroupNorm",
    "get_fp32_matmul_precision",
    "ops",
    "set_fp32_matmul_precision",
]
