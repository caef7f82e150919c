"""The robust passes of every backend (``coord_select``, ``gram``) against oracles written on stacked float64
copies with numpy: every sorted-position window and MeaMed's nearest-values window (ties included), client
counts around the sorting network's powers of two and past its limit, every input dtype, several segments, full
models against a base, the norms and non-finite marks of the same read, and hostile arguments to the C++
bindings (refused, nothing written)."""
from __future__ import annotations


import numpy as np
import pytest
import torch

from fastagg import robust
from fastagg.backends import resolve
from fastagg.rows import attach_base, client_rows
from fastagg.testing import cpu_backends, outputs_with_threads

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _rows(x, *, layers=False, base=None):
    if layers:
        split = [x.shape[1] // 3, x.shape[1] - x.shape[1] // 3]
        data = [list(r.split(split)) for r in x]
    else:
        data = x
    rows = client_rows(data, name="deltas")
    if base is not None:
        rows, _ = attach_base(rows, list(base.split(split)) if layers else base)
    return rows


def _nearest_oracle(col: np.ndarray, count: int) -> float:
    """The definition: drop the sorted values' farther end (from the median) until ``count`` are left; a tie
    drops the upper end."""
    s = np.sort(col)
    m = len(s)
    med = s[(m - 1) // 2] if m % 2 else 0.5 * (s[m // 2 - 1] + s[m // 2])
    lo, hi = 0, m - 1
    while hi - lo + 1 > count:
        if med - s[lo] > s[hi] - med:
            lo += 1
        else:
            hi -= 1
    return float(s[lo:hi + 1].mean())


def _oracle(x64: np.ndarray, rule: str, first: int, count: int) -> np.ndarray:
    if rule == "window":
        return np.sort(x64, axis=0)[first:first + count].mean(axis=0)
    return np.array([_nearest_oracle(x64[:, j], count) for j in range(x64.shape[1])])


def _select(rows, backend, rule, first, count, out_dtype=torch.float32):
    be = resolve(backend, rows.device)
    out = torch.full((rows.numel,), 7.0, dtype=out_dtype)
    sq = torch.empty(rows.num_clients, dtype=torch.float64)
    bad = torch.zeros(rows.num_clients, dtype=torch.bool)
    be.coord_select(rows=rows, rule=rule, first=first, count=count, out=out, sq_norms_out=sq, nonfinite_out=bad)
    return out, sq, bad


CLIENTS = [1, 2, 3, 4, 5, 7, 8, 15, 16, 17, 31, 33, 100]
INTERPRETED_CLIENTS = [1, 2, 3, 5, 17]  # the Triton interpreter: a reduced set (each program costs ms)


@pytest.mark.parametrize("backend, m", [(b, m) for b in cpu_backends()
                                        for m in (INTERPRETED_CLIENTS if b == "triton" else CLIENTS)])
def test_coord_select_windows_and_nearest_equal_the_float64_oracle(backend, m):
    d = 21 if backend == "triton" else 203  # a ragged last tile of 16 lanes
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, d, generator=g)
    x64 = x.double().numpy()
    cases = [("window", (m - 1) // 2, 1), ("window", 0, m), ("window", m - 1, 1), ("nearest", 0, m),
             ("nearest", 0, max(1, m - 2)), ("nearest", 0, 1)]
    if m >= 2:
        cases += [("window", m // 2 - 1, 2), ("window", m // 4, m - 2 * (m // 4))]
    for rule, first, count in cases:
        out, sq, bad = _select(_rows(x), backend, rule, first, count)
        want = _oracle(x64, rule, first, count)
        np.testing.assert_allclose(out.double().numpy(), want, rtol=1e-6, atol=1e-7, err_msg=f"{rule} {first} {count}")
        np.testing.assert_allclose(sq.numpy(), (x64 ** 2).sum(axis=1), rtol=1e-12)
        assert not bad.any()


@pytest.mark.parametrize("backend", cpu_backends())
def test_coord_select_nearest_breaks_ties_by_dropping_the_upper_end(backend):
    """Integer values: many values equally far from the median; the kept window is the definition's."""
    g = torch.Generator().manual_seed(3)
    for m in ((4, 9) if backend == "triton" else (4, 6, 9, 12)):
        x = torch.randint(-2, 3, (m, 64), generator=g).double()
        for count in range(1, m + 1):
            out, _, _ = _select(_rows(x), backend, "nearest", 0, count, torch.float64)
            np.testing.assert_allclose(out.numpy(), _oracle(x.numpy(), "nearest", 0, count), rtol=0, atol=1e-15,
                                       err_msg=f"M={m} count={count}")


@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_coord_select_dtypes_layers_and_base(backend, dtype):
    """Order statistics are exact in every input dtype (upcast), means in float64; full models against a base
    are formed in float64; several segments; a float64 result from float32 rows."""
    m, d = 9, 40
    g = torch.Generator().manual_seed(1)
    x = torch.randn(m, d, generator=g).to(dtype)
    base = torch.linspace(-2, 2, d).to(dtype)
    for layers in (False, True):
        for with_base in (False, True):
            rows = _rows(x + base if with_base else x, layers=layers, base=base if with_base else None)
            upd = (x + base).double() - base.double() if with_base else x.double()
            for out_dtype in ((torch.float64,) if backend == "triton" else (torch.float32, torch.float64)):
                for rule, first, count in [("window", 2, 5), ("nearest", 0, 6)] + [("window", 4, 1)] * (backend != "triton"):
                    out, sq, _ = _select(rows, backend, rule, first, count, out_dtype)
                    want = _oracle(upd.numpy(), rule, first, count)
                    tol = 1e-6 if out_dtype == torch.float32 else 1e-13
                    np.testing.assert_allclose(out.double().numpy(), want, rtol=tol, atol=tol)
                    np.testing.assert_allclose(sq.numpy(), (upd.numpy() ** 2).sum(axis=1), rtol=1e-12)


@pytest.mark.parametrize("backend", cpu_backends())
def test_coord_select_and_gram_mark_nonfinite_clients_from_the_same_read(backend):
    x = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    x[1, 7] = float("nan")
    x[4, 49] = float("inf")
    x[2, 3] = 1e30  # finite, large: its float64 square is finite
    _, sq, bad = _select(_rows(x), backend, "window", 2, 2)
    assert bad.tolist() == [False, True, False, False, True, False]
    assert np.isfinite(sq[[0, 2, 3, 5]].numpy()).all()
    g, bad = robust.gram(_rows(x), backend)
    assert bad.tolist() == [False, True, False, False, True, False]
    keep = [0, 2, 3, 5]
    x64 = x.double()[keep]
    np.testing.assert_allclose(g[keep][:, keep].numpy(), (x64 @ x64.T).numpy(), rtol=1e-12)


@pytest.mark.parametrize("backend", cpu_backends())
@pytest.mark.parametrize("m", [1, 2, 3, 5, 16, 17, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gram_equals_the_float64_oracle(backend, m, dtype):
    """16-bit rows take the Triton kernel's by-hand products (no float64 tl.dot from 16-bit loads)."""
    d = 70 if backend == "triton" else 1301
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, d, generator=g).to(dtype)
    base = (torch.randn(d, generator=g) * 100).to(dtype)  # full models far from zero: products of the updates
    for layers in (False, True):
        for with_base in (False, True):
            rows = _rows(x + base if with_base else x, layers=layers, base=base if with_base else None)
            upd = ((x + base).double() - base.double() if with_base else x.double()).numpy()
            gram, bad = robust.gram(rows, backend)
            np.testing.assert_allclose(gram.numpy(), upd @ upd.T, rtol=1e-12, atol=1e-9)
            assert torch.equal(gram, gram.T) and not bad.any()


def test_cpu_coord_select_past_the_sorting_network():
    """More than 1024 clients: each lane sorted by std::sort."""
    x = torch.randn(1030, 37, generator=torch.Generator().manual_seed(5))
    out, _, _ = _select(_rows(x), "cpu", "window", 514, 2)
    np.testing.assert_allclose(out.double().numpy(), _oracle(x.double().numpy(), "window", 514, 2), rtol=1e-6)
    out, _, _ = _select(_rows(x), "cpu", "nearest", 0, 1000)
    np.testing.assert_allclose(out.double().numpy(), _oracle(x.double().numpy(), "nearest", 0, 1000), rtol=1e-6)


def test_cpu_select_past_the_network_with_nan_and_inf_clients():
    """std::sort needs a strict weak order, which NaN breaks (and may then read outside the range): the pass marks
    the clients and a robust rule leaves them out; the estimate is the finite clients'."""
    x = torch.randn(1030, 37, generator=torch.Generator().manual_seed(6))
    x[[3, 500], 5] = float("nan")
    x[7, :] = float("nan")
    x[9, 2] = float("-inf")
    _, _, bad = _select(_rows(x), "cpu", "window", 514, 2)
    assert sorted(bad.nonzero().flatten().tolist()) == [3, 7, 9, 500]
    res = robust.aggregate(x, robust.Median(), backend="cpu")
    keep = [i for i in range(1030) if i not in (3, 7, 9, 500)]
    want = np.median(x[keep].double().numpy(), axis=0)
    np.testing.assert_allclose(res.estimate.double().numpy(), want, rtol=1e-6)
    assert res.excluded.nonzero().flatten().tolist() == [3, 7, 9, 500]


def test_cpu_robust_passes_are_bit_identical_for_any_thread_count(tmp_path):
    script = (
        "import torch, sys\n"
        "from fastagg import robust\n"
        "x = torch.randn(13, 300_001, generator=torch.Generator().manual_seed(0))\n"
        "r = robust.aggregate(x, robust.Median(), backend='cpu')\n"
        "k = robust.aggregate(x, robust.GeometricMedian(), backend='cpu')\n"
        "torch.save({'med': r.estimate, 'sq': r.sq_norms, 'geo': k.estimate, 'd': k.distances}, sys.argv[1])\n"
    )
    outs = [outputs_with_threads(script, t, tmp_path / f"t{t}.pt") for t in (1, 2)]
    for k in outs[0]:
        assert torch.equal(outs[0][k], outs[1][k]), k


def _capsules(x):
    return x.__dlpack__()


def test_cpu_bindings_refuse_hostile_arguments_and_write_nothing():
    from fastagg.backends import cpu

    C = cpu.compiled()
    x = torch.randn(5, 40)
    out = torch.full((40,), 3.0)
    sq = torch.full((5,), 3.0, dtype=torch.float64)
    bad = torch.zeros(5, dtype=torch.uint8)
    gram = torch.full((25,), 3.0, dtype=torch.float64)

    def select(rule=0, first=2, count=1, rows=None, out_=None, lens=(40,), sq_=None):
        C.coord_select(_capsules(x if rows is None else rows), None, list(lens), rule, first, count,
                       _capsules(out if out_ is None else out_), _capsules(sq if sq_ is None else sq_), _capsules(bad))

    for kwargs, words in [
        (dict(first=4, count=2), "sorted positions"), (dict(first=-1), "sorted positions"),
        (dict(count=0), "sorted positions"), (dict(rule=1, count=6), "count"), (dict(rule=7), "unknown rule"),
        (dict(out_=torch.empty(39)), "out has 39 elements"), (dict(out_=torch.empty(40, dtype=torch.float16)),
                                                               "float32 or float64"),
        (dict(lens=(41,)), "columns"), (dict(rows=x.T.contiguous().T), "unit stride"),
        (dict(out_=x[0]), "overlaps"), (dict(sq_=torch.empty(4, dtype=torch.float64)), "sq_norms_out"),
        (dict(rows=torch.empty(0, 40)), "no client"),
    ]:
        with pytest.raises((ValueError, TypeError), match=words):
            select(**kwargs)
    with pytest.raises(ValueError, match="gram_out has 24 elements"):
        C.gram(_capsules(x), None, [40], _capsules(torch.empty(24, dtype=torch.float64)), _capsules(bad))
    with pytest.raises(ValueError, match="overlaps"):
        C.gram(_capsules(x), None, [40], _capsules(x.view(-1)[:50].view(torch.float64)), _capsules(bad))
    with pytest.raises(ValueError, match="overlaps"):
        C.gram(_capsules(x), None, [40], _capsules(gram), _capsules(x[0, :5].view(torch.uint8)[:5]))
    assert torch.all(out == 3.0) and torch.all(sq == 3.0) and torch.all(gram == 3.0) and not bad.any()


def test_cpu_every_sorting_network_sorts():
    """Each client count has its own network (unrolled up to 32, built at run time past it): every order statistic
    of every M up to 70 against numpy's sort, including ties and signed zeros."""
    g = torch.Generator().manual_seed(11)
    for m in range(1, 71):
        x = torch.randint(-3, 4, (m, 35), generator=g).float() * 0.5
        x[0, :3] = torch.tensor([-0.0, 0.0, -0.0])
        s = np.sort(x.double().numpy(), axis=0)
        for k in range(m):
            out, _, _ = _select(_rows(x), "cpu", "window", k, 1)
            np.testing.assert_array_equal(out.double().numpy(), s[k], err_msg=f"M={m} position {k}")


NETWORK_CLIENTS = [2, 3, 15, 16, 17, 33, 100, 128, 129, 256]  # around the network's powers of two, up to the limit


def _windows(m: int) -> list[tuple[str, int, int]]:
    """Every rule's positions at M: medians, trimmed means down to one value, the ends, MeaMed's windows."""
    ks = sorted({0, 1, m // 5, (m - 1) // 2} - {k for k in range(m) if m - 2 * k < 1})
    cases = [("window", k, m - 2 * k) for k in ks] + [("window", 0, 1), ("window", m - 1, 1),
                                                     ("window", (m - 1) // 2, 1 + (m % 2 == 0))]
    return cases + [("nearest", 0, c) for c in sorted({m, max(1, m - max(1, m // 8)), 1})]


@pytest.mark.skipif("triton" not in cpu_backends(), reason="the Triton pass runs on CPU tensors only interpreted")
@pytest.mark.parametrize("m", NETWORK_CLIENTS)
def test_triton_select_network_every_client_count_ties_zeros_and_infinities(m):
    """The Triton pass's min / max network (``_bitonic_rows``; tl.sort past 128) at client counts around its powers
    of two: values on nine levels (ties everywhere, duplicates at every trim boundary), signed zeros, +-inf in the
    data (and +inf with -inf in one column: a NaN mean, as the oracle's). Window means of halves are exact in
    float64, so every rule's output equals the oracle's bit for bit; a wrong stage of the network, a wrong run
    direction or a padded client read as data changes some column."""
    g = torch.Generator().manual_seed(m)
    d = 37
    x = torch.randint(-4, 5, (m, d), generator=g).double() * 0.5
    x[0, :4] = torch.tensor([-0.0, 0.0, -0.0, 0.0])
    x[m - 1, 4] = float("inf")
    x[m // 2, 5] = float("-inf")
    x[0, 6], x[m - 1, 6] = float("inf"), float("-inf")
    windows = _windows(m) if m <= 128 else _windows(m)[2:4] + _windows(m)[-1:]  # tl.sort past 128: slow interpreted
    for rule, first, count in windows:
        out, sq, bad = _select(_rows(x.float()), "triton", rule, first, count, torch.float64)
        np.testing.assert_array_equal(out.numpy(), _oracle(x.numpy(), rule, first, count),
                                      err_msg=f"M={m} {rule} {first} {count}")
        np.testing.assert_allclose(sq.numpy(), (x.numpy() ** 2).sum(axis=1), rtol=1e-15)
        assert bad.tolist() == [i in (0, m // 2, m - 1) for i in range(m)]


@pytest.mark.skipif("triton" not in cpu_backends(), reason="the Triton pass runs on CPU tensors only interpreted")
@pytest.mark.parametrize("m", [17, 100])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=str)
def test_triton_select_network_wide_and_16_bit_rows(m, dtype):
    """float64 rows (a float64 tile) and bfloat16 rows (widened to float32) through the network, with and without
    a base, against the oracle on the same values; and the previous ``tl.sort`` pass (``TL_SORT``, kept for the
    card's benchmark) equal to it."""
    from fastagg.backends.triton import robust as trobust

    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 29, generator=g).to(dtype)
    base = torch.linspace(-2, 2, 29).to(dtype)
    for with_base in (False, True):
        rows = _rows(x + base if with_base else x, base=base if with_base else None)
        upd = ((x + base).double() - base.double() if with_base else x.double()).numpy()
        for rule, first, count in _windows(m):
            want = _oracle(upd, rule, first, count)
            out, sq, bad = _select(rows, "triton", rule, first, count, torch.float64)
            np.testing.assert_allclose(out.numpy(), want, rtol=1e-13, atol=1e-15, err_msg=f"{rule} {first} {count}")
            np.testing.assert_allclose(sq.numpy(), (upd ** 2).sum(axis=1), rtol=1e-12)
            assert not bad.any()
        old = torch.empty(29, dtype=torch.float64)  # tl.sort is slow interpreted: one window
        trobust.coord_select(rows=rows, rule="nearest", first=0, count=m - 2, out=old, sq_norms_out=sq.clone(),
                             nonfinite_out=bad.clone(), _config=dict(TL_SORT=True))
        np.testing.assert_allclose(old.numpy(), _oracle(upd, "nearest", 0, m - 2), rtol=1e-13, atol=1e-15)


@pytest.mark.skipif("triton" not in cpu_backends(), reason="the Triton pass runs on CPU tensors only interpreted")
@pytest.mark.parametrize("m", [5, 17, 100])
def test_triton_select_network_sorts_nan_as_infinity(m):
    """A NaN sorts last, as +inf (min and max of a NaN would not be a permutation): its client is marked and its
    column's estimate is the oracle's with +inf in its place (windows short of the last position: the oracle's
    own value, NaN sorting last there too); the other columns and clients are untouched, squared norms NaN."""
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 23, generator=g)
    x[1, 3] = x[m - 1, 3] = x[m // 2, 9] = float("nan")
    as_inf = torch.nan_to_num(x.double(), nan=float("inf")).numpy()
    for rule, first, count in _windows(m):
        out, sq, bad = _select(_rows(x), "triton", rule, first, count, torch.float64)
        np.testing.assert_allclose(out.numpy(), _oracle(as_inf, rule, first, count), rtol=1e-13,
                                   err_msg=f"{rule} {first} {count}")
        if rule == "window" and first + count <= m - 2:
            np.testing.assert_allclose(out.numpy(), _oracle(x.double().numpy(), rule, first, count), rtol=1e-13)
        assert bad.tolist() == [i in (1, m // 2, m - 1) for i in range(m)]
        nan = [1, m // 2, m - 1]
        assert np.isnan(sq.numpy()[nan]).all() and np.isfinite(np.delete(sq.numpy(), nan)).all()
