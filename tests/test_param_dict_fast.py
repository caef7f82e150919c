"""The global model as a state_dict of plain tensors (the functional API's ``params=``, parsed every call) takes a
whole-dict path (flat.param_dict_entries): it must give exactly the general path's rows, and on anything it does not
accept, leave the general path to accept it or name the entry at fault."""
from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

import fastagg
from fastagg import flat, rows


def _general(monkeypatch, params, **kw):
    with monkeypatch.context() as mp:
        mp.setattr(rows, "param_dict_entries", lambda *a, **k: None)
        return rows.param_rows(params, **kw)


def _same(a, b):
    assert a.form == b.form and a.dtype == b.dtype and a.device == b.device and a.segments == b.segments
    assert [(t.data_ptr(), t.shape, t.requires_grad) for t in a.parts] == \
        [(t.data_ptr(), t.shape, t.requires_grad) for t in b.parts]
    assert [(n, t.data_ptr(), t.shape, t.dtype) for n, t in a.buffers] == \
        [(n, t.data_ptr(), t.shape, t.dtype) for n, t in b.buffers]


def _models():
    bn = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(),
                             torch.nn.Linear(4, 2))
    yield "bn", bn.state_dict()
    yield "plain dict", {"w": torch.randn(3, 4), "b": torch.randn(4), "empty": torch.zeros(0, 5)}
    yield "float64 + int buffer", OrderedDict(w=torch.randn(5, dtype=torch.float64), steps=torch.tensor(3))
    yield "one 0-d entry", {"s": torch.tensor(2.0)}
    yield "bfloat16", {"a": torch.randn(7).bfloat16(), "b": torch.randn(2, 2).bfloat16()}


@pytest.mark.parametrize("buffers_count", [False, True])
@pytest.mark.parametrize("case", [n for n, _ in _models()])
def test_the_whole_dict_path_gives_the_general_paths_rows(monkeypatch, case, buffers_count):
    params = dict(_models())[case]
    taken = []
    real = flat.param_dict_entries
    monkeypatch.setattr(rows, "param_dict_entries", lambda *a, **k: taken.append(real(*a, **k)) or taken[-1])
    fast = rows.param_rows(params, buffers_count=buffers_count)
    assert taken[-1] is not None  # (the path under test was the one taken)
    _same(fast, _general(monkeypatch, params, buffers_count=buffers_count))
    _same(rows.param_rows(params, buffers_count=buffers_count), fast)  # the planned layout, looked up


def test_parameters_that_require_grad_are_read_detached():
    model = torch.nn.Linear(3, 2)
    params = {n: p for n, p in model.named_parameters()}  # requires_grad leaves, as a user may pass them
    got = rows.param_rows(params)
    assert not any(t.requires_grad for t in got.parts)
    assert [t.data_ptr() for t in got.parts] == [p.data_ptr() for p in params.values()]


def _hostile():
    base = torch.randn(10)
    yield "overlapping views", {"a": base[:6], "b": base[4:]}, "overlaps"
    shrunk = torch.randn(100)
    view = shrunk[10:20]
    shrunk.untyped_storage().resize_(8)
    yield "storage shrunk under it", {"a": torch.randn(3), "b": view}, "resized under it"
    yield "negated view", {"a": torch._neg_view(torch.randn(3))}, "negated"
    yield "efficient zero", {"a": torch.randn(2), "z": torch._efficientzerotensor(3)}, "zero tensor"
    yield "not contiguous", {"a": torch.randn(4, 3).t()}, "not contiguous"
    yield "two dtypes", {"a": torch.randn(3), "b": torch.randn(3, dtype=torch.float64)}, "dtype"
    yield "meta", {"a": torch.randn(3), "b": torch.empty(3, device="meta")}, "meta"
    yield "integers only", {"n": torch.tensor([1, 2])}, "no floating"
    yield "int8 parameters", {"a": torch.randn(3).half(), "q": torch.ones(2, dtype=torch.int8)}, None


@pytest.mark.parametrize("case", [n for n, _, _ in _hostile()])
def test_what_the_whole_dict_path_refuses_the_general_path_names(monkeypatch, case):
    params, match = next((p, m) for n, p, m in _hostile() if n == case)
    before = {k: v.clone() for k, v in params.items() if v.device.type != "meta" and not v._is_zerotensor()
              and case != "storage shrunk under it"}
    if match is None:  # accepted by the general path (an int8 entry is a buffer): same rows both ways
        _same(rows.param_rows(params), _general(monkeypatch, params))
        return
    for call in (lambda: rows.param_rows(params), lambda: _general(monkeypatch, params)):
        with pytest.raises((ValueError, TypeError), match=match) as err:
            call()
        assert "params" in str(err.value) or match == "no floating"
    for k, v in before.items():
        assert torch.equal(params[k].resolve_neg(), v.resolve_neg())


def test_tied_entries_take_the_general_path_and_are_one_entry():
    w = torch.randn(4, 3)
    params = {"emb": w, "head": w, "b": torch.randn(3)}
    got = rows.param_rows(params)
    assert got.form.aliases == (("head", "emb"),) and len(got.parts) == 2


def test_fedavg_step_on_state_dicts_is_the_mean_written_in_place():
    """End to end through the functional API (the caller the path is for): the oracle is the weighted mean."""
    g = torch.Generator().manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    params = {k: v.clone() for k, v in model.state_dict().items()}
    start = {k: v.clone() for k, v in params.items()}
    clients = [{k: (v + torch.randn(v.shape, generator=g) if v.is_floating_point() else v + 1)
                for k, v in params.items()} for _ in range(3)]
    for _ in range(2):  # the second call looks the plan up
        for k in params:
            params[k].copy_(start[k])
        fastagg.fedavg_step(models=clients, params=params)
        for k in ("0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean"):
            want = torch.stack([c[k].double() for c in clients]).mean(0)
            torch.testing.assert_close(params[k].double(), want, rtol=1e-6, atol=1e-6)


def test_keys_equal_but_of_another_type_get_their_own_layout():
    """``1 == True`` and they hash alike: a layout planned for ``{1: ...}`` must not answer for ``{True: ...}`` (the
    result's dicts would come back keyed by the first call's ``1``; a reviewer's find)."""
    for keys in ((1, 2), (True, 2)):
        clients = [{keys[0]: torch.randn(3), keys[1]: torch.randn(2)} for _ in range(2)]
        params = {keys[0]: torch.zeros(3), keys[1]: torch.zeros(2)}
        got = fastagg.fedexp_step(models=clients, params=params, eps=1e-3).eval_params
        assert [type(k) for k in got] == [type(k) for k in keys]
