"""Compressed client updates, folded where they lie (no dequantized copy per client).

So far: :class:`Int8Blockwise` (int8 codes with one float32 absmax scale per block of ``block`` elements),
made by :func:`quantize_int8` and folded by :meth:`fastagg.Accumulator.add` / ``add_many`` on every backend, so
every :mod:`fastagg.server` optimizer, FedExP and the asynchronous server step on int8 clients, mixed freely with
float ones.
"""
from .int8 import Int8Blockwise, dequantize, quantize_int8

__all__ = ["Int8Blockwise", "quantize_int8", "dequantize"]
