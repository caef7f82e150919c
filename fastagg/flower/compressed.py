"""Compressed replies in Flower: a client mod that sends the update compressed, and the wire form fastagg's
strategies read in place.

:func:`compress_mod` (a Flower client mod: ``ClientApp(mods=[compress_mod("int8:block=256")])``) turns a train
reply's ``ArrayRecord`` (the trained model) into the update against the model received, compressed
(:mod:`fastagg.compress`: int8, fp8, qsgd, topk, randk), in one ``ArrayRecord``:

    "fastagg.compressed"  int64 [4]: format version 1, kind (1 int8 / QSGD, 2 fp8 e4m3, 3 sparse), d, block (0)
    "codes", "scales"     kinds 1, 2: int8 (fp8: its bytes as uint8) [d] and float32 [ceil(d / block)]
    "indices", "values"   kind 3: int32 or int64 [k] and float32 [k]
    buffer entries        the model's buffers (BatchNorm statistics, integer counters) as they are, by name

The update covers the model's parameters: its floating entries not named like torch buffers, in the record's
order (:func:`fastagg.flat.split_entries`). Stochastic rounding and random-k are keyed by (``seed``, the train
config's ``server-round``, the node id); error feedback keeps the node's residual in its ``Context.state``.

:func:`read_compressed` parses such a record from untrusted bytes (each entry through
:func:`fastagg.flower.records.array_view`, then the format's own checks) into the compressed update (tensors viewing
the message's bytes: no copy) and its buffers.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from flwr.app import ArrayRecord, Error, Message, MessageType

from .._checks import check_int
from ..compress import Fp8Blockwise, Int8Blockwise, SparseUpdate
from ..compress.spec import parse
from ..flat import as_tensor, split_entries
from .records import ReplyError, record_views, to_array

__all__ = ["compress_mod", "read_compressed", "is_compressed_record", "compressed_record", "MARKER"]

MARKER = "fastagg.compressed"
VERSION = 1
_KINDS = {Int8Blockwise: 1, Fp8Blockwise: 2, SparseUpdate: 3}
_RESIDUAL = "fastagg.residual"
ERROR_CODE = 1000  # the Error code of a reply the mod could not compress (Flower's own codes are below 1000)


def is_compressed_record(record: ArrayRecord) -> bool:
    return isinstance(record, ArrayRecord) and MARKER in record


def compressed_record(update, buffers: Mapping | None = None) -> ArrayRecord:
    """The wire form (module docstring) of one compressed update and the model's buffers."""
    kind = _KINDS.get(type(update))
    if kind is None:
        raise TypeError(f"compressed_record takes an Int8Blockwise, Fp8Blockwise or SparseUpdate, got "
                        f"{type(update).__name__}")
    head = np.array([VERSION, kind, update.numel, getattr(update, "block", 0)], dtype=np.int64)
    if kind == 3:
        body = {"indices": update.indices, "values": update.values}
    else:
        codes = update.codes.view(torch.uint8) if kind == 2 else update.codes
        body = {"codes": codes, "scales": update.scales}
    record = {MARKER: head, **body, **dict(buffers or {})}
    return ArrayRecord({k: to_array(v) for k, v in record.items()})


def read_compressed(record: ArrayRecord, where: str = "ArrayRecord") -> tuple:
    """``(update, buffers)`` of a compressed reply: the update as its format's class (tensors viewing the bytes),
    the buffer entries as read-only numpy views. Raises :class:`ReplyError` naming what is wrong."""
    views = record_views(record, where)
    head = views.pop(MARKER)
    if head.dtype != np.int64 or head.shape != (4,):
        raise ReplyError(f"{where}[{MARKER!r}] must be int64 [4] (version, kind, d, block), got {head.dtype} "
                         f"{head.shape}")
    version, kind, d, block = (int(v) for v in head)
    if version != VERSION:
        raise ReplyError(f"{where} is compressed in format version {version}; this fastagg reads {VERSION}")
    fields = {1: ("codes", "scales"), 2: ("codes", "scales"), 3: ("indices", "values")}.get(kind)
    if fields is None:
        raise ReplyError(f"{where} has compression kind {kind}; known: 1 (int8), 2 (fp8), 3 (sparse)")
    missing = [f for f in fields if f not in views]
    if missing:
        raise ReplyError(f"{where} is compressed (kind {kind}) but lacks {missing}")
    a, b = (as_tensor(views.pop(f)) for f in fields)
    try:
        if kind == 1:
            update = Int8Blockwise(a, b, block)
        elif kind == 2:
            if a.dtype != torch.uint8:
                raise TypeError(f"codes must be uint8 (fp8 e4m3 bytes), got {a.dtype}")
            update = Fp8Blockwise(a.view(torch.float8_e4m3fn), b, block)
        else:
            update = SparseUpdate(a, b, d)
    except (TypeError, ValueError) as e:
        raise ReplyError(f"{where}: {e}") from None
    if update.numel != d:
        raise ReplyError(f"{where} says d = {d} but holds {update.numel} codes")
    return update, views


def _error(msg: Message, reason: str) -> Message:
    return Message(Error(code=ERROR_CODE, reason=f"compress_mod: {reason}"), reply_to=msg)


def compress_mod(spec: str = "int8:block=256", *, seed: int = 0):
    """A Flower client mod sending each train reply's update compressed as ``spec`` says (module docstring;
    e.g. ``"int8:block=256"``, ``"fp8"``, ``"qsgd:s=16"``, ``"topk:0.01"`` with error feedback). A reply the mod
    cannot compress (not one ArrayRecord, other keys than the model received, NaN/Inf) comes back as a Flower
    error reply saying why."""
    comp = parse(spec)
    if comp.kind in ("bf16", "fp16"):
        raise ValueError(f"compress_mod sends the update compressed; {comp.kind} would round the whole model (and "
                         "numpy has no bf16): use int8, fp8, qsgd, topk or randk")
    seed = check_int(seed, "seed", maximum=2 ** 64 - 1, what="an integer in [0, 2^64)")

    def mod(msg: Message, context, call_next) -> Message:
        if msg.metadata.message_type != MessageType.TRAIN or not comp.lossy:
            return call_next(msg, context)
        if len(msg.content.array_records) != 1:
            return _error(msg, f"the train message has {len(msg.content.array_records)} ArrayRecords; expected one")
        received = next(iter(msg.content.array_records.values()))
        configs = list(msg.content.config_records.values())
        server_round = int(configs[0].get("server-round", 0)) if configs else 0
        out = call_next(msg, context)
        if out.has_error():
            return out
        if len(out.content.array_records) != 1:
            return _error(msg, f"the reply has {len(out.content.array_records)} ArrayRecords; expected one")
        key, trained = next(iter(out.content.array_records.items()))
        if list(trained.keys()) != list(received.keys()):
            return _error(msg, "the reply's ArrayRecord has other keys than the one received")
        try:
            sent_model, model = record_views(received, "the model received"), record_views(trained, "the reply")
            params, buffers = split_entries(model, where="the reply")
            base = dict(split_entries(sent_model, where="the model received")[0])
            delta = torch.cat([as_tensor(v).reshape(-1).to(torch.float32) -
                               as_tensor(base[k]).reshape(-1).to(torch.float32) for k, v in params])
            node = int(msg.metadata.dst_node_id) % 2 ** 32
            if comp.error_feedback:
                stored = context.state.array_records.get(_RESIDUAL)
                if stored is not None and stored["residual"].shape == tuple(delta.shape):
                    delta = delta + torch.from_numpy(stored["residual"].numpy())
            update = comp.compress_rows(delta[None], seed=seed, round=server_round % 2 ** 32, clients=[node])[0]
            if comp.error_feedback:
                kept = delta.double() - update.dequantize(torch.float64)
                context.state.array_records[_RESIDUAL] = ArrayRecord({"residual": to_array(kept.float())})
            out.content.array_records[key] = compressed_record(update, dict(buffers))
        except (TypeError, ValueError) as e:
            return _error(msg, str(e))
        return out

    mod.__name__ = mod.__qualname__ = f"compress_mod({str(comp)!r})"
    return mod
