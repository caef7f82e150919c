"""The binding's row parse (csrc/bindings.cpp rows_of, views.h quick_row): a list of row capsules and the base
segments are read without a named View per row; any row the quick reader does not accept goes through the named
checks. These pin that every check still runs on every row and base segment, wherever it sits in the list, with
the message (and the row's name) the named checks give, and that the overlap check names the first overlapping
read in the order it always did: rows s-major, then the base segments, then the other reads.

The compiled module is called directly with capsules (as fastagg.backends.cpu does), so nothing above the binding
can catch a bad argument first. FASTAGG_BINDING_MODULE=/path/to/other.so runs the same cases on another build.
"""
from __future__ import annotations

import importlib.util
import os
import re

import pytest
import torch

from fastagg.backends import cpu

L, M = 4, 3
LENS = [5, 1, 7, 3]


def _module():
    path = os.environ.get("FASTAGG_BINDING_MODULE")
    if not path:
        return cpu.compiled()
    name = os.path.basename(path).split(".")[0]
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _setup(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    rows = [[torch.randn(n, generator=g, dtype=dtype) for _ in range(M)] for n in LENS]
    base = [torch.randn(n, generator=g, dtype=dtype) for n in LENS]
    d = sum(LENS)
    c = torch.float64 if dtype == torch.float64 else torch.float32
    out = dict(weights=torch.full((M,), 1.0 / M, dtype=torch.float64), mean_init=None,
               mean=torch.empty(d, dtype=c), sq=torch.empty(M, dtype=torch.float64),
               bad=torch.empty(M, dtype=torch.bool), msq=torch.empty((), dtype=torch.float64))
    return rows, base, out


def _call(rows, base, o, lens=LENS, raw_rows=None, raw_base=None):
    dl = cpu._dl
    caps = raw_rows if raw_rows is not None else [[dl(t) for t in seg] for seg in rows]
    bcaps = raw_base if raw_base is not None else (None if base is None else [dl(t) for t in base])
    _module().round_stats(caps, bcaps, list(lens), dl(o["weights"]), dl(o["mean_init"]), None, 0.0, dl(o["mean"]),
                          dl(o["sq"]), dl(o["bad"]), dl(o["msq"]), 0.0, 0, 0)


def _oracle(rows, base, o):
    x = torch.stack([torch.cat([rows[s][i].reshape(-1) for s in range(L)]) for i in range(M)]).double()
    if base is not None:
        x = x - torch.cat(base).double()
    return (o["weights"][:, None] * x).sum(0), (x * x).sum(1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("with_base", [False, True])
def test_good_rows_fold(dtype, with_base):
    rows, base, o = _setup(dtype)
    b = base if with_base else None
    _call(rows, b, o)
    mean, sq = _oracle(rows, b, o)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype in (torch.float32, torch.float64) else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(o["mean"].double(), mean, **tol)
    torch.testing.assert_close(o["sq"], sq, **tol)


# (where, how the row is replaced, error type, exact message after "fastagg._C: ")
ROW_CASES = [
    ((0, 0), lambda t: t.double(), None, None),  # the first row sets the dtype: then the second one is wrong
    ((2, 1), lambda t: t.double(), TypeError, "deltas[1] entry 2 must be float32, got float64"),
    ((3, 2), lambda t: t.to(torch.int32), TypeError, "deltas[2] entry 3 must be float32, got int32"),
    ((1, 2), lambda t: torch.zeros(2), ValueError, "deltas[2] entry 1 has 2 elements; expected 1"),
    ((2, 0), lambda t: torch.zeros(7, 2)[:, 0], ValueError, "deltas[0] entry 2 must be contiguous"),
    ((2, 2), lambda t: t.view(7, 1), None, None),  # [7, 1]: contiguous
    ((3, 1), lambda t: t.view(1, 3, 1), None, None),
    ((0, 1), lambda t: t.view(5, 1).t(), None, None),  # [1, 5] with strides (1, 1): contiguous
    ((2, 1), lambda t: torch.zeros(14)[::2], ValueError, "deltas[1] entry 2 must be contiguous"),
]


@pytest.mark.parametrize("where,make,exc,msg", ROW_CASES)
def test_each_row_checked_with_its_name(where, make, exc, msg):
    rows, base, o = _setup()
    s, i = where
    rows[s][i] = make(rows[s][i])
    if where == (0, 0):  # float64 first row: every other (float32) row is then the wrong dtype, the next one named
        with pytest.raises(TypeError, match=re.escape("fastagg._C: deltas[1] entry 0 must be float64, got float32")):
            _call(rows, base, o)
        return
    if exc is None:
        _call(rows, base, o)
        mean, _ = _oracle(rows, base, o)
        torch.testing.assert_close(o["mean"].double(), mean, rtol=1e-5, atol=1e-6)
        return
    with pytest.raises(exc, match="^" + re.escape("fastagg._C: " + msg) + "$"):
        _call(rows, base, o)


def test_row_capsule_checks_named():
    rows, base, o = _setup()
    dl = cpu._dl
    caps = [[dl(t) for t in seg] for seg in rows]
    caps[1][2] = "not a capsule"
    with pytest.raises(TypeError, match=re.escape("deltas[2] entry 1 must be passed as tensor.__dlpack__()")):
        _call(rows, base, o, raw_rows=caps)
    caps = [[dl(t) for t in seg] for seg in rows]
    caps[3][1] = dl(torch.zeros(1, 1, 1, 1, 1, 1, 1, 1, 3))  # 9 dimensions
    with pytest.raises(ValueError, match=re.escape("deltas[1] entry 3 has an unsupported number of dimensions")):
        _call(rows, base, o, raw_rows=caps)
    caps = [[dl(t) for t in seg] for seg in rows]
    caps[2][0] = dl(torch.zeros(7, dtype=torch.complex64))
    with pytest.raises(TypeError, match=re.escape("deltas[0] entry 2 has an unsupported dtype")):
        _call(rows, base, o, raw_rows=caps)
    caps = [[dl(t) for t in seg] for seg in rows]
    used = dl(torch.zeros(7))
    torch.utils.dlpack.from_dlpack(used)  # consumed: renamed "used_dltensor"
    caps[2][2] = used
    with pytest.raises(TypeError, match=re.escape("deltas[2] entry 2 must be passed as tensor.__dlpack__()")):
        _call(rows, base, o, raw_rows=caps)


def test_segment_lists_checked():
    rows, base, o = _setup()
    dl = cpu._dl
    caps = [[dl(t) for t in seg] for seg in rows]
    caps[2] = caps[2][:2]
    with pytest.raises(ValueError, match=re.escape("segment 2 has a different number of clients")):
        _call(rows, base, o, raw_rows=caps)

    class Liar(list):  # claims more rows than it holds: never read past its end
        def __len__(self):
            return M

    caps = [[dl(t) for t in seg] for seg in rows]
    caps[1] = Liar(caps[1][:1])
    with pytest.raises((IndexError, ValueError, TypeError)):
        _call(rows, base, o, raw_rows=caps)
    caps = [[dl(t) for t in seg] for seg in rows]
    caps[3] = tuple(caps[3])  # a tuple of rows is read as before (converted to a list)
    _call(rows, base, o, raw_rows=caps)
    mean, _ = _oracle(rows, base, o)
    torch.testing.assert_close(o["mean"].double(), mean, rtol=1e-5, atol=1e-6)


BASE_CASES = [
    (2, lambda t: t.double(), TypeError, "params (the base of models=)[2] must be float32, got float64"),
    (0, lambda t: t.double(), TypeError, "params (the base of models=)[0] must be float32, got float64"),
    (1, lambda t: torch.zeros(1, 1), ValueError, "params (the base of models=)[1] must be a contiguous 1-D tensor"),
    (2, lambda t: torch.zeros(14)[::2], ValueError, "params (the base of models=)[2] must be a contiguous 1-D tensor"),
    (3, lambda t: torch.zeros(4), ValueError, "params (the base of models=)[3] has the wrong length"),
]


@pytest.mark.parametrize("k,make,exc,msg", BASE_CASES)
def test_each_base_segment_checked_with_its_name(k, make, exc, msg):
    rows, base, o = _setup()
    base[k] = make(base[k])
    with pytest.raises(exc, match="^" + re.escape("fastagg._C: " + msg) + "$"):
        _call(rows, base, o)


def test_base_list_checked():
    rows, base, o = _setup()
    with pytest.raises(ValueError, match=re.escape("params have a different number of segments")):
        _call(rows, base[:3], o)
    with pytest.raises(ValueError, match=re.escape("params (the base of models=) is empty")):
        _call(rows, [], o)
    with pytest.raises(TypeError, match=re.escape("params (the base of models=) must be a list of tensors")):
        _call(rows, None, o, raw_base=tuple(cpu._dl(t) for t in base))
    # a wrong dtype is found before a wrong count, as segment_views found it
    bad = base[:3]
    bad[1] = bad[1].double()
    with pytest.raises(TypeError, match=re.escape("params (the base of models=)[1] must be float32")):
        _call(rows, bad, o)


@pytest.mark.parametrize("s,i", [(0, 0), (2, 1), (3, 2)])
def test_overlap_names_the_row(s, i):
    rows, base, o = _setup()
    d = sum(LENS)
    pool = torch.zeros(d + 16)
    rows[s][i] = pool[3: 3 + LENS[s]]  # a row inside mean_out
    o["mean"] = pool[:d]
    with pytest.raises(ValueError, match="^" + re.escape(f"fastagg._C: mean_out overlaps deltas[{i}] entry {s} in the "
                                                         "same call") + "$"):
        _call(rows, base, o)


def test_overlap_names_the_first_read_in_order():
    rows, base, o = _setup()
    d = sum(LENS)
    pool = torch.zeros(d + 16)
    base[1] = pool[20:21]
    rows[3][2] = pool[10:13]  # rows come before the base segments
    o["mean"] = pool[:d]
    with pytest.raises(ValueError, match=re.escape("mean_out overlaps deltas[2] entry 3 in the same call")):
        _call(rows, base, o)
    rows, base, o = _setup()
    base[1] = pool[2:3]
    o["mean"] = pool[:d]
    with pytest.raises(ValueError, match="^" + re.escape("fastagg._C: mean_out overlaps params (the base of models=)[1] "
                                                         "in the same call") + "$"):
        _call(rows, base, o)
    rows, base, o = _setup()
    w = torch.zeros(M + 8, dtype=torch.float64)
    o["weights"] = w[:M]
    o["sq"] = w[2: 2 + M]
    with pytest.raises(ValueError, match="^" + re.escape("fastagg._C: sq_norms_out overlaps weights in the same call")
                       + "$"):
        _call(rows, base, o)
    rows, base, o = _setup()
    o["sq"] = torch.zeros(M + 8, dtype=torch.float64)[:M]
    o["msq"] = o["sq"][1:2].view(())
    with pytest.raises(ValueError, match="^" + re.escape("fastagg._C: sq_norms_out overlaps mean_sq_out, also written "
                                                         "in the same call") + "$"):
        _call(rows, base, o)


def test_empty_rows_never_overlap():
    lens = [5, 0, 3]
    g = torch.Generator().manual_seed(2)
    rows = [[torch.randn(n, generator=g) for _ in range(M)] for n in lens]
    pool = torch.zeros(16)
    rows[1][1] = pool[2:2]  # no elements: no span
    base = [torch.randn(n, generator=g) for n in lens]
    _, _, o = _setup()
    o["mean"] = pool[:8]
    _call(rows, base, o, lens=lens)
    x = torch.stack([torch.cat([rows[s][i] for s in range(3)]) for i in range(M)]) - torch.cat(base)
    torch.testing.assert_close(o["mean"], x.mean(0), rtol=1e-5, atol=1e-6)


def test_read_rows_may_alias_each_other():
    rows, base, o = _setup()
    rows[2][1] = rows[2][0]  # the same row twice: reads only
    base[0] = rows[0][2]
    _call(rows, base, o)
    mean, _ = _oracle(rows, base, o)
    torch.testing.assert_close(o["mean"].double(), mean, rtol=1e-5, atol=1e-6)
