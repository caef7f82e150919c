"""fastagg._aliasing.check_writes finds an overlap by one sweep over sorted spans (a state_dict step compares ~100
written entries with ~2000 read ones: the pairwise walk was most of a small model's step). It must refuse exactly
the calls the pairwise definition refuses, naming the same first pair."""
from __future__ import annotations

import random

import pytest
import torch

from fastagg._aliasing import Rows, check_writes


def _pairwise(writes, reads):
    """The definition, written independently: the first written tensor (in order) that shares a byte with a later
    written one or with any read one; the message names both (None: no overlap). Self-overlap is not drawn here."""
    def byte_span(t):
        lo = sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if s < 0)
        hi = sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if s > 0)
        return t.data_ptr() + lo * t.element_size(), t.data_ptr() + (hi + 1) * t.element_size()

    everything = writes + reads
    for k, (name, t) in enumerate(writes):
        a0, a1 = byte_span(t)
        for j, (other, u) in enumerate(everything):
            if j == k or j < k or t.device != u.device:
                continue
            b0, b1 = byte_span(u)
            if max(a0, b0) < min(a1, b1):
                return f"{name} overlaps {other}, which {'is also written' if j < len(writes) else 'is read'}"
    return None


def _agrees(expected, writes, reads) -> None:
    """check_writes(writes, reads) passes when ``expected`` is None, else raises a message starting with it."""
    if expected is None:
        check_writes(writes, reads)
    else:
        with pytest.raises(ValueError) as e:
            check_writes(writes, reads)
        assert str(e.value).startswith(expected), (str(e.value), expected)


def _views(rng, pool, count):
    out = []
    for i in range(count):
        buf = rng.choice(pool)
        n = buf.numel()
        start = rng.randrange(n)
        length = rng.randrange(1, min(n - start, 40) + 1)
        step = rng.choice([1, 1, 1, 2, 3])
        out.append((f"t{i}", buf[start:start + length:step]))
    return out


@pytest.mark.parametrize("seed", range(400))
def test_the_sweep_refuses_exactly_what_the_pairwise_definition_refuses(seed):
    rng = random.Random(seed)
    pool = [torch.zeros(200), torch.zeros(120), torch.zeros(50, dtype=torch.float64)]
    writes = [(f"w{k}", t) for k, (_, t) in enumerate(_views(rng, pool, rng.randrange(1, 6)))]
    reads = [(f"r{k}", t) for k, (_, t) in enumerate(_views(rng, pool, rng.randrange(0, 12)))]
    expected = _pairwise(writes, reads)
    _agrees(expected, writes, reads)


def test_many_entries_in_separate_buffers_pass_and_one_shared_one_is_named():
    """A ResNet-shaped call: 122 written entries, 16 clients x 122 read ones, all separate; then one client entry
    that is a view of a written one."""
    writes = [(f"params entry {k}", torch.zeros(3 + k % 7)) for k in range(122)]
    reads = [(f"client {i}'s entry {k}", torch.zeros(3 + k % 7)) for i in range(16) for k in range(122)]
    check_writes(writes, reads)
    reads[16 * 122 - 5] = ("client 15's entry 117", writes[40][1][1:])
    with pytest.raises(ValueError, match="params entry 40 overlaps client 15's entry 117, which is read"):
        check_writes(writes, reads)


@pytest.mark.parametrize("seed", range(200))
def test_reads_named_on_demand_refuse_exactly_what_the_pairs_refuse(seed):
    """A round's client rows travel as ``Rows`` (1-D unit-stride tensors named only for an error); its spans come
    from a shortcut (pointer + numel * element size). Same verdict and message as the (name, tensor) pairs, with
    strided reads (the general span) drawn too."""
    rng = random.Random(1000 + seed)
    pool = [torch.zeros(200), torch.zeros(120), torch.zeros(50, dtype=torch.float64), torch.zeros(0)]
    writes = [(f"w{k}", t) for k, (_, t) in enumerate(_views(rng, pool[:3], rng.randrange(1, 6)))]
    reads = [t for _, t in _views(rng, pool[:3], rng.randrange(0, 12))]
    if rng.random() < 0.3:
        reads.append(pool[3])  # an empty row spans nothing
    expected = _pairwise(writes, [(f"r{j}", t) for j, t in enumerate(reads)])
    rows = Rows(reads, lambda j: f"r{j}")
    _agrees(expected, writes, rows)


def test_equal_starts_and_touching_ends():
    """Spans that only touch do not overlap; a written and a read span starting at the same byte do, in either
    order of the sort; two reads starting together do not."""
    buf = torch.zeros(100)
    check_writes([("w", buf[10:20])], Rows([buf[20:30], buf[0:10], buf[30:30]], lambda j: f"r{j}"))
    check_writes([("w", buf[50:60])], Rows([buf[0:10], buf[0:10]], lambda j: f"r{j}"))
    for reads in ([buf[10:12], buf[10:11]], [buf[10:11], buf[10:12]]):
        with pytest.raises(ValueError, match="w overlaps r1, which is read"):
            check_writes([("w", buf[10:11])], Rows([buf[40:41]] + reads[1:], lambda j: f"r{j}"))


@pytest.mark.parametrize("seed", range(200))
def test_contiguous_reads_take_the_array_path_and_refuse_exactly_the_same(seed):
    """Contiguous reads of one dtype and device (a real round's rows) take ``Rows.arrays``; overlaps drawn at every
    position of a read's span, its last element included, with writes on the same buffers."""
    rng = random.Random(5000 + seed)
    pool = [torch.zeros(200), torch.zeros(120)]
    def contiguous(count):
        out = []
        for _ in range(count):
            buf = rng.choice(pool)
            start = rng.randrange(buf.numel())
            out.append(buf[start:start + rng.randrange(0, min(buf.numel() - start, 30) + 1)])
        return out
    writes = [(f"w{k}", t) for k, t in enumerate(contiguous(rng.randrange(1, 4)))]
    reads = contiguous(rng.randrange(1, 10))
    assert Rows(reads, str).arrays() is not None
    expected = _pairwise(writes, [(f"r{j}", t) for j, t in enumerate(reads)])
    _agrees(expected, writes, Rows(reads, lambda j: f"r{j}"))
