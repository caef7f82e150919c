"""Flower ``Array`` / ``ArrayRecord`` <-> numpy and torch, without per-client copies.

A Flower ``Array`` carries an ``.npy`` file in ``bytes`` (``stype == "numpy.ndarray"``). ``Array.numpy()`` runs
``np.load`` on it: a full copy of every client's update. :func:`array_view` instead parses the ``.npy`` header
and returns a read-only numpy view into the message's own bytes, after checking that the header, the
``Array``'s declared dtype and shape, and the byte count agree exactly (a reply is untrusted input: a view is
never taken past the end of its buffer). :func:`to_array` writes the ``.npy`` bytes ``np.save`` would write with a
single copy of the data.
"""
from __future__ import annotations

import io
import math
from collections.abc import Mapping

import numpy as np
import torch
from flwr.app import Array, ArrayRecord
from flwr.common.constant import SType

__all__ = ["array_view", "record_views", "to_array", "to_record", "ReplyError"]

_HEADER_LIMIT = 10_000 + 16  # numpy's own max_header_size, plus the magic string and the length field
_KINDS = "fiu"  # float, signed and unsigned integers: what a model holds


class ReplyError(ValueError):
    """A client's reply that cannot be aggregated (wrong form, shape, dtype or bytes)."""


def reply_weight(metrics: Mapping, key: str) -> float:
    """A reply's weight, its ``key`` metric (Flower's ``weighted_by_key``, e.g. ``"num-examples"``): a finite number
    >= 0, else ReplyError saying what is wrong (missing, not a number, NaN/Inf, negative, an int too large for a
    float such as 10**400)."""
    from .._checks import check_number

    if key not in metrics:
        raise ReplyError(f"has no {key!r} metric (its weight)")
    weight = metrics[key]
    try:
        weight = check_number(weight, key) if isinstance(weight, (int, float)) else None
    except (TypeError, ValueError):
        weight = None
    if weight is None:
        raise ReplyError(f"has {key!r} = {metrics[key]!r:.60}; expected a finite number >= 0")
    return float(weight)


_MAGIC = b"\x93NUMPY"


def _header_key(data) -> bytes | None:
    """The bytes numpy's header parser reads from ``data`` (magic, version, length field, header), or None when they
    do not look like a version 1 / 2 ``.npy`` header (then the parser runs and says what is wrong)."""
    try:
        view = memoryview(data).cast("B")
    except (TypeError, ValueError):  # (a non-contiguous memoryview: numpy's parser says what is wrong)
        return None
    if len(view) >= 12 and view[:6] == _MAGIC and view[6] in (1, 2) and view[7] == 0:
        end = (10 + view[8] + 256 * view[9]) if view[6] == 1 else (12 + int.from_bytes(view[8:12], "little"))
        if end <= min(len(view), _HEADER_LIMIT):
            return bytes(view[:end])
    return None


def _parse_header(data) -> tuple[tuple, bool, np.dtype, int]:
    """numpy's own parse of the ``.npy`` header of ``data`` (ReplyError on anything it refuses)."""
    head = io.BytesIO(bytes(memoryview(data)[:_HEADER_LIMIT]))
    try:
        version = np.lib.format.read_magic(head)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(head)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(head)
        else:
            raise ReplyError(f".npy format version {version} is not supported (1.0 and 2.0 are)")
    except ReplyError:
        raise
    except Exception as e:  # numpy raises ValueError/SyntaxError/EOFError on malformed headers
        raise ReplyError(f"its bytes are not a valid .npy header ({type(e).__name__}: {e})") from None
    return tuple(shape), bool(fortran), dtype, head.tell()


def array_view(array: Array, where: str = "array") -> np.ndarray:
    """A read-only numpy view of ``array``'s data (no copy), after checking it.

    Raises :class:`ReplyError` naming ``where`` when the serialization type is not numpy's, the header is malformed,
    its dtype is not a number type or disagrees with ``array.dtype``, its shape disagrees with ``array.shape``, or
    the data is shorter or longer than the header says. Fortran-ordered or byte-swapped data (which ``np.save``
    writes for such arrays) are converted: the one case that copies.
    """
    if not isinstance(array, Array):
        raise ReplyError(f"{where} is a {type(array).__name__}; expected a flwr.app.Array")
    if array.stype != SType.NUMPY:
        raise ReplyError(f"{where} is serialized as {array.stype!r}; expected {SType.NUMPY!r}")
    data = array.data
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ReplyError(f"{where} holds {type(data).__name__} data; expected bytes")
    header = _header_key(data)
    key = (header, array.dtype, tuple(array.shape))
    if header is not None and not (type(array.dtype) is str and all(type(n) is int for n in key[2])):
        header = None  # (declarations of other types: checked, and refused, by _plan, never kept)
    plan = _PLANS.get(key) if header is not None else None
    if plan is None:
        plan = _plan(data, array, where)
        if header is not None and plan[3] == len(header):
            if len(_PLANS) >= _PLANS_LIMIT:
                _PLANS.clear()
            _PLANS[key] = plan
    shape, fortran, dtype, offset, count = plan
    nbytes = len(memoryview(data).cast("B")) - offset
    if nbytes != count * dtype.itemsize:
        raise ReplyError(f"{where} holds {nbytes} data bytes; its header says {count} x {dtype.itemsize}")
    view = np.frombuffer(data, dtype=dtype, count=count, offset=offset)
    if fortran:
        view = view.reshape(shape[::-1]).transpose()
    else:
        view = view.reshape(shape)
    if not dtype.isnative or fortran:
        view = view.astype(dtype.newbyteorder("="), order="C")
        view.flags.writeable = False
    return view


# (header bytes, declared dtype, declared shape) -> _plan's result: numpy's header parser (ast.literal_eval, ~40 us)
# and the checks against the Array's declarations run once per distinct key; a ResNet-18 round of 16 replies reads
# ~2,000 arrays with ~60 distinct keys. Equal keys give what checking them gave: the parser reads only the header bytes.
_PLANS: dict = {}
_PLANS_LIMIT = 4096


def _plan(data, array: Array, where: str) -> tuple:
    """(shape, fortran_order, dtype, data offset, element count) of a checked ``.npy`` header (ReplyError naming
    ``where`` when the header, its dtype or its shape is refused)."""
    shape, fortran, dtype, offset = _parse_header(data)
    if dtype.hasobject or dtype.names is not None or dtype.kind not in _KINDS or dtype.subdtype is not None:
        raise ReplyError(f"{where} has dtype {dtype}; expected a float or integer type")
    try:
        declared = np.dtype(array.dtype)
    except (TypeError, ValueError):
        raise ReplyError(f"{where} declares dtype {array.dtype!r}, which is not a numpy dtype") from None
    if declared != dtype or shape != tuple(array.shape):
        raise ReplyError(f"{where} declares dtype {array.dtype} shape {tuple(array.shape)} but its data holds dtype "
                         f"{dtype} shape {shape}")
    if any((not isinstance(n, int)) or n < 0 for n in shape):
        raise ReplyError(f"{where} has shape {shape}")
    count = math.prod(shape)  # Python ints: a hostile (2**62, 4) must not wrap to a small int64 count
    return shape, fortran, dtype, offset, count


def record_views(record: ArrayRecord, where: str = "ArrayRecord") -> dict:
    """``{key: array_view(record[key])}`` in the record's order."""
    if not isinstance(record, ArrayRecord):
        raise ReplyError(f"{where} is a {type(record).__name__}; expected a flwr.app.ArrayRecord")
    return {k: array_view(a, f"{where}[{k!r}]") for k, a in record.items()}


def to_array(x) -> Array:
    """A Flower ``Array`` of a torch tensor or numpy array: the bytes ``np.save`` writes, made with one copy."""
    if isinstance(x, torch.Tensor):
        if x.dtype == torch.bfloat16:
            raise TypeError("bfloat16 has no numpy dtype, so Flower cannot carry it: convert the model to float32")
        x = x.detach().cpu().numpy()
    arr = np.asarray(x)
    if not arr.flags.c_contiguous:
        arr = arr.copy(order="C")
    head = io.BytesIO()
    header = np.lib.format.header_data_from_array_1_0(arr)
    try:
        np.lib.format.write_array_header_1_0(head, header)
    except ValueError:  # a header over 64 KiB (only for huge ranks)
        head = io.BytesIO()
        np.lib.format.write_array_header_2_0(head, header)
    data = b"".join((head.getvalue(), arr.reshape(-1).view(np.uint8)))
    return Array(dtype=str(arr.dtype), shape=tuple(arr.shape), stype=SType.NUMPY, data=data)


def to_record(named: Mapping) -> ArrayRecord:
    """An ``ArrayRecord`` of ``{key: tensor or array}``, in that order."""
    return ArrayRecord({k: to_array(v) for k, v in named.items()})
