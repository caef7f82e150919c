"""fastagg.flower.array_view keeps what it learned from a ``.npy`` header by the header's exact bytes and the Array's
declared dtype and shape (issue 42: numpy's parser cost ~40 us an array, 80 ms a ResNet-18 round). What it keeps
must never let a reply through that the full checks refuse: a declaration that disagrees, data of the wrong length,
a header one byte off, and the same bytes again after a refusal."""
from __future__ import annotations

import io

import numpy as np
import pytest
from flwr.app import Array

from fastagg import flower as fa
from fastagg.flower import records


def _npy(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    return buf.getvalue()


def _array(data: bytes, dtype: str, shape) -> Array:
    return Array(dtype=dtype, shape=tuple(shape), stype="numpy.ndarray", data=data)


@pytest.fixture(autouse=True)
def _fresh():
    records._PLANS.clear()
    yield
    records._PLANS.clear()


def test_a_kept_header_still_checks_each_reply():
    good = np.arange(12, dtype=np.float32).reshape(3, 4)
    data = _npy(good)
    assert np.array_equal(fa.array_view(_array(data, "<f4", (3, 4))), good)
    assert len(records._PLANS) == 1
    # the same header bytes, another declaration: refused as before
    with pytest.raises(fa.ReplyError, match="declares dtype"):
        fa.array_view(_array(data, "<f8", (3, 4)))
    with pytest.raises(fa.ReplyError, match="declares dtype"):
        fa.array_view(_array(data, "<f4", (4, 3)))
    # the same header, data one element short or long
    with pytest.raises(fa.ReplyError, match="data bytes"):
        fa.array_view(_array(data[:-4], "<f4", (3, 4)))
    with pytest.raises(fa.ReplyError, match="data bytes"):
        fa.array_view(_array(data + b"\0\0\0\0", "<f4", (3, 4)))
    # other values under the same header: the view is of these bytes
    other = -good
    assert np.array_equal(fa.array_view(_array(_npy(other), "<f4", (3, 4))), other)
    assert len(records._PLANS) == 1


def test_a_header_one_byte_off_is_parsed_and_refused():
    data = bytearray(_npy(np.zeros((3, 4), dtype=np.float32)))
    fa.array_view(_array(bytes(data), "<f4", (3, 4)))
    at = bytes(data).index(b"(3, 4)") + 1
    data[at] = ord("9")  # shape (9, 4): the header itself now disagrees with the declaration and the byte count
    with pytest.raises(fa.ReplyError):
        fa.array_view(_array(bytes(data), "<f4", (3, 4)))
    with pytest.raises(fa.ReplyError, match="data bytes"):
        fa.array_view(_array(bytes(data), "<f4", (9, 4)))
    garbage = bytearray(_npy(np.zeros(4, dtype=np.float32)))
    garbage[12:20] = b"@@@@@@@@"
    for _ in range(2):  # a refused header is never kept: refused again
        with pytest.raises(fa.ReplyError, match="not a valid .npy header"):
            fa.array_view(_array(bytes(garbage), "<f4", (4,)))


def test_refused_dtypes_and_odd_declarations_are_never_kept():
    data = _npy(np.array([1 + 2j], dtype=np.complex64))
    for _ in range(2):
        with pytest.raises(fa.ReplyError, match="expected a float or integer type"):
            fa.array_view(_array(data, "<c8", (1,)))
    assert not records._PLANS
    odd = _array(_npy(np.zeros(2, dtype=np.float32)), "<f4", (2,))
    object.__setattr__(odd, "shape", (2.0,))  # (Flower's constructor refuses it; a tampered Array need not)
    assert fa.array_view(odd).shape == (2,)  # 2.0 == 2: accepted as before, but never kept
    assert not records._PLANS


def test_byte_swapped_and_fortran_arrays_still_convert():
    a = np.arange(6, dtype=">f4").reshape(2, 3)
    for _ in range(2):
        v = fa.array_view(_array(_npy(a), ">f4", (2, 3)))
        assert v.dtype.isnative and np.array_equal(v, a.astype("<f4")) and not v.flags.writeable
    f = np.asfortranarray(np.arange(6, dtype=np.float32).reshape(2, 3))
    for _ in range(2):
        v = fa.array_view(_array(_npy(f), "<f4", (2, 3)))
        assert np.array_equal(v, f)
