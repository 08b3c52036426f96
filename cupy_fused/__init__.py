"""cupy-fused: fused CUDA kernels for PyTorch models, compiled at run time by
NVRTC through CuPy — no nvcc, no C++ build.

Importing the package needs neither CuPy nor a GPU and compiles nothing;
the first kernel launch compiles (and caches) what it uses;
:func:`precompile` compiles ahead of time.
"""
from . import ops
from ._runtime import precompile
from . import settings
from .settings import (fp32_matmul_precision, get_fp32_matmul_precision,
                       set_fp32_matmul_precision)
from .models import (
    ConvReluBiasAdd,
    GemmAddRelu,
    GemmBiasAddHardtanhMishGroupNorm,
    GemmGroupNormSwishMultiplySwish,
    MatmulSwishSumGroupNorm,
)

from ._version import __version__

__all__ = [
    "ConvReluBiasAdd",
    "GemmAddRelu",
    "GemmBiasAddHardtanhMishGroupNorm",
    "GemmGroupNormSwishMultiplySwish",
    "MatmulSwishSumGroupNorm",
    "fp32_matmul_precision",
    "get_fp32_matmul_precision",
    "ops",
    "precompile",
    "set_fp32_matmul_precision",
    "settings",
    "__version__",
]
