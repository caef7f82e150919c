"""The Triton backend (GPU kernels; on CPU tensors only under ``TRITON_INTERPRET=1``, for tests).

One module per primitive, each a private ``@triton.jit`` kernel and a launcher that does not validate.
"""
from .adam_apply import adam_apply
from .local_step import local_step
from .momentum_apply import momentum_apply
from .noise import gaussian_noise
from .quantize import quantize_fp8_rows, quantize_int8_rows
from .quantized import blockwise_fold, compressed_scan, sparse_fold
from .robust import coord_select, gram
from .round_stats import round_stats

name = "triton"

__all__ = ["round_stats", "coord_select", "gram", "momentum_apply", "adam_apply", "local_step", "gaussian_noise",
           "blockwise_fold", "sparse_fold", "compressed_scan", "quantize_int8_rows", "quantize_fp8_rows", "name"]
