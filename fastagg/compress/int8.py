"""int8 blockwise absmax (the layout: :mod:`.blockwise`).

Block ``b`` stores one float32 scale ``s_b = max_{j in b} |x_j| / 127`` (``1.0`` for an all-zero block; a subnormal
scale that rounded down, to 0 for the tiniest blocks, one float32 step up: every scale is finite and > 0) and the
int8 codes

    q_j = round(x_j / s_b)  in [-127, 127]      (round half to even; -128 is never written and is refused)

or, with ``stochastic=True``, ``q_j = floor(x_j / s_b + u_j)`` with ``u_j`` in [0, 1) from Philox4x32-10 keyed by
``(seed, round, client)`` (:func:`.blockwise.uniforms`): unbiased (``E[s_b q_j] = x_j``), and the same codes for
the same keys on any machine. The update it stands for is ``x~_j = s_b * q_j``. Exact: ``|x_j - x~_j| <= s_b / 2``
(deterministic), ``< s_b`` (stochastic); an all-zero block and the block's absmax elements are exact. Bytes:
d + 4 * ceil(d / block), against 4d for float32 (block 256: 3.94x smaller). A NaN or Inf in the update, or a block
whose scale times 127 lies beyond float32 (values from float64 rows beyond float32's range), raises: the server
would refuse such codes.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch


from .blockwise import (MAX_BLOCK, Blockwise, as_rows, check_block, check_keys, check_representable,
                        float32_scales, quantizer, raise_nonfinite, tiles, uniforms)

__all__ = ["Int8Blockwise", "quantize_int8", "quantize_int8_rows", "dequantize", "MAX_BLOCK"]


@dataclasses.dataclass(frozen=True)
class Int8Blockwise(Blockwise):
    """One client's update in int8 blockwise form (module docstring): ``codes`` int8 ``[d]``, ``scales`` float32
    ``[ceil(d / block)]``. QSGD's updates (:func:`fastagg.compress.quantize_qsgd`) take this form too."""

    CODE_DTYPE = torch.int8
    FORMAT = "int8"
    INVALID_CODES = "holds the code -128 (int8 blockwise codes lie in [-127, 127])"


def quantize_int8(update: Any, block: int = 256, *, stochastic: bool = False, seed: int = 0, round: int = 0,
                  client: int = 0) -> Int8Blockwise:
    """``update`` (a flat tensor, a list of tensors, a state_dict or a module's parameters: flattened as
    :func:`fastagg.flat.flatten` orders them) in int8 blockwise absmax form (module docstring): round half to
    even, or with ``stochastic=True`` unbiased stochastic rounding keyed by ``(seed, round, client)`` (integers in
    [0, 2^64), [0, 2^32), [0, 2^32)). A NaN or Inf in the update raises (it has no int8 code)."""
    if isinstance(update, torch.Tensor) and update.dim() == 2:
        raise ValueError("quantize_int8 takes one update; quantize_int8_rows takes an [M, d] batch")
    return quantize_int8_rows(as_rows(update, finite=False), block, stochastic=stochastic, seed=seed, round=round,
                              clients=[client])[0]


def quantize_int8_rows(rows: torch.Tensor, block: int = 256, *, stochastic: bool = False, seed: int = 0,
                       round: int = 0, clients: list | None = None, backend: str = "auto") -> list:
    """Each row of an ``[M, d]`` batch of updates quantized as :func:`quantize_int8` (row ``i`` keyed by
    ``clients[i]``, default ``i``), in one pass: fused in C++ for CPU float32/float64 rows (csrc/quantized.h) and in
    Triton for CUDA rows (fastagg/backends/triton/quantize.py), the same codes and scales bit for bit; the torch ops
    of the definition elsewhere (``backend="reference"``)."""
    block = check_block(block)
    x = as_rows(rows, "the updates", finite=False)
    m, d = x.shape
    clients = list(range(m)) if clients is None else list(clients)
    seed, round, clients = check_keys(seed, round, clients)
    if len(clients) != m:
        raise ValueError(f"{m} rows but {len(clients)} client ids")
    kernel = quantizer(backend, x, "quantize_int8_rows")
    if kernel is not None:
        x = x.contiguous()
        codes = torch.empty(m, d, dtype=torch.int8, device=x.device)
        scales = torch.empty(m, -(-d // block), dtype=torch.float32, device=x.device)
        if kernel(x=x, block=block, stochastic=stochastic, seed=seed, round=round, clients=clients,
                  codes_out=codes, scales_out=scales):
            raise_nonfinite("the updates")
        check_representable(scales, 127.0, "the updates")
        return [Int8Blockwise(codes[i], scales[i], block) for i in range(m)]
    as_rows(x, "the updates")
    return _torch_rows(x, block, stochastic, seed, round, clients)


def _torch_rows(x: torch.Tensor, block: int, stochastic: bool, seed: int, round: int, clients: list) -> list:
    """The definition in torch ops (any device): float64 tiles, absmax, the float32 scale, then the codes."""
    m, d = x.shape
    t = tiles(x, block)
    scales = float32_scales(t.abs().amax(dim=2), 127.0)
    check_representable(scales, 127.0, "the updates")
    # codes from the float32 scale actually stored, so that s_b * q_j is the closest value the format can write
    scaled = t / scales.to(torch.float64)[:, :, None]
    if stochastic:
        u = uniforms((m, t[0].numel()), seed=seed, round=round, clients=clients, device=x.device).view_as(t)
        q = torch.floor(scaled + u).clamp_(-127, 127)
    else:
        q = torch.round(scaled).clamp_(-127, 127)
    codes = q.reshape(m, -1)[:, :d].to(torch.int8)
    return [Int8Blockwise(codes[i].contiguous(), scales[i].contiguous(), block) for i in range(m)]


def dequantize(u: Any, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The dense update a compressed one stands for, as a flat ``dtype`` tensor (float64 by default: the oracle every
    fold is tested against): ``s_b * v(q_j)`` for blockwise formats, the values at their indices (zero elsewhere)
    for sparse ones."""
    if not hasattr(u, "dequantize"):
        raise TypeError(f"dequantize takes a compressed update (fastagg.compress), got {type(u).__name__}")
    return u.dequantize(dtype)
