"""Functional API: every fused op, callable on torch tensors (with autograd)
or on CuPy arrays (returns CuPy arrays, zero-copy).  Importing this package
declares each op's kernel instantiations; it compiles nothing."""
from .bias_relu import bias_relu
from .conv_bias_relu import conv_bias_relu
from ..settings import PRECISIONS, get_fp32_matmul_precision, set_fp32_matmul_precision
from .gn_chain import (
    CHAINS,
    bias_hardtanh_mish_group_norm,
    gn_chain,
    group_norm_swish_multiply_swish,
    swish_bias_group_norm,
)
from .linear import linear
from .linear_gn_chain import linear_gn_chain
from .scale_add import scale_add

__all__ = [
    "CHAINS",
    "PRECISIONS",
    "bias_hardtanh_mish_group_norm",
    "bias_relu",
    "conv_bias_relu",
    "get_fp32_matmul_precision",
    "gn_chain",
    "group_norm_swish_multiply_swish",
    "linear",
    "linear_gn_chain",
    "scale_add",
    "set_fp32_matmul_precision",
    "swish_bias_group_norm",
]
