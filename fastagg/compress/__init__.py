"""Compressed client updates, folded where they lie (no dequantized copy per client).

Formats (each module states its layout, scale rule, rounding and what is exact):

- :class:`Int8Blockwise` (:mod:`.int8`): int8 codes, one float32 absmax scale per block; :func:`quantize_int8`,
  deterministic or stochastic rounding. :func:`quantize_qsgd` (:mod:`.qsgd`, Alistarh et al.) writes it too.
- :class:`Fp8Blockwise` (:mod:`.fp8`): fp8 e4m3 codes, one float32 scale per block (rowwise: block = row length).
- :class:`SparseUpdate` (:mod:`.sparse`): top-k / random-k indices and values, folded by scatter-add.
- :class:`Codebook8` (:mod:`.codebook`): uint8 codes through a 256-entry code book, one absmax per block:
  bitsandbytes' blockwise form, NVIDIA FLARE's ``BLOCKWISE8``; :class:`LayerwiseUpdate`: one part per layer.

Every :mod:`fastagg.server` optimizer, :func:`fastagg.fedexp_step` / :func:`fastagg.fedavg_step`, the
:class:`fastagg.Accumulator` and the asynchronous server take them (a list may mix formats, and float tensors or
numpy arrays of the model's flat size: clients that sent float32 or bf16 in the same round); the robust rules and
DP mechanisms read them dequantized, one row each. Batched quantizers for M clients at once (``*_rows``) and
:func:`fastagg.client.compress_updates` (with error feedback) serve the clients; :func:`parse` reads a spec such
as ``"int8:block=256"``.
"""
from .blockwise import Blockwise
from .codebook import Codebook8, LayerwiseUpdate, from_bitsandbytes
from .fp8 import Fp8Blockwise, quantize_fp8, quantize_fp8_rows
from .int8 import Int8Blockwise, dequantize, quantize_int8, quantize_int8_rows
from .qsgd import quantize_qsgd, quantize_qsgd_rows
from .sparse import SparseUpdate, sparsify_randk, sparsify_rows, sparsify_topk

__all__ = ["Blockwise", "Codebook8", "LayerwiseUpdate", "from_bitsandbytes", "Int8Blockwise", "Fp8Blockwise", "SparseUpdate", "quantize_int8", "quantize_int8_rows",
           "quantize_fp8", "quantize_fp8_rows", "quantize_qsgd", "quantize_qsgd_rows", "sparsify_topk",
           "sparsify_randk", "sparsify_rows", "dequantize"]
