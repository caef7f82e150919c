"""The Triton backend (GPU kernels; on CPU tensors only under ``TRITON_INTERPRET=1``, for tests).

One module per primitive, each a private ``@triton.jit`` kernel and a launcher that does not validate.
"""
from .apply_update import apply_update
from .round_stats import round_stats

name = "triton"

__all__ = ["round_stats", "apply_update", "name"]
