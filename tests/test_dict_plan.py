"""The layout plans of state_dict rows (``flat.dict_plan``, issue 42): built once per layout and looked up after,
so a kept plan must never stand in for another layout. Each case runs a round whose layout was planned before
beside one planned fresh (the plans cleared), and the results and errors must be the same."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import fastagg
from fastagg import flat
from fastagg.rows import client_rows, param_rows


def _model(counter_dtype=torch.int64, var_shape=(3,)) -> dict:
    return {"conv.weight": torch.arange(6.0).reshape(3, 2), "bn.running_mean": torch.zeros(3),
            "bn.running_var": torch.ones(var_shape), "bn.num_batches_tracked": torch.tensor(4, dtype=counter_dtype),
            "fc.weight": torch.ones(2, 3), "fc.bias": torch.zeros(2)}


def _clients(model: dict, m: int = 3) -> list:
    return [{k: (v + 0.5 * (i + 1) if v.is_floating_point() else v + i + 1) for k, v in model.items()}
            for i in range(m)]


def _round(model: dict, clients: list) -> dict:
    params = {k: v.clone() for k, v in model.items()}
    fastagg.fedavg_step(models=clients, weights=[1.0 + i for i in range(len(clients))], params=params)
    return params


def _fresh(fn):
    flat._DICT_PLANS.clear()
    return fn()


def test_a_kept_plan_gives_what_a_fresh_one_gives():
    model = _model()
    first = _round(model, _clients(model))
    again = _round(model, _clients(model))  # (the plan kept from the first round)
    fresh = _fresh(lambda: _round(model, _clients(model)))
    for k in model:
        assert torch.equal(first[k], fresh[k]) and torch.equal(again[k], fresh[k]), k
    assert len(flat._DICT_PLANS) >= 1


def test_a_floating_counter_is_refused_after_a_round_that_planned_the_layout():
    model = _model()
    _round(model, _clients(model))
    bad = _clients(model)
    bad[1]["bn.num_batches_tracked"] = torch.tensor(5.5)
    params = {k: v.clone() for k, v in model.items()}
    with pytest.raises(Exception, match="num_batches_tracked") as kept:
        fastagg.fedavg_step(models=bad, params=params)
    assert all(torch.equal(params[k], model[k]) for k in model)  # nothing written
    with pytest.raises(Exception, match="num_batches_tracked") as fresh:
        _fresh(lambda: fastagg.fedavg_step(models=bad, params={k: v.clone() for k, v in model.items()}))
    assert str(kept.value) == str(fresh.value)


def test_another_model_with_the_same_keys_gets_its_own_plan():
    """Same keys and client shapes; the model's counter is floating in one, its running_var of another shape in the
    other: the plan of the first layout must not be used for the second (its checks differ)."""
    model = _model()
    _round(model, _clients(model))
    other = _model(counter_dtype=torch.float32)  # a floating "counter": a statistic like any other
    got = _round(other, _clients(other))
    want = _fresh(lambda: _round(other, _clients(other)))
    assert all(torch.equal(got[k], want[k]) for k in other)
    floats = _clients(other)  # their counters are floating too: refused by a model whose counter is an integer
    with pytest.raises(Exception, match="num_batches_tracked"):
        _round(model, floats)
    _round(model, _clients(model))  # (this layout planned again)
    wide = _model(var_shape=(1, 3))  # the model's running_var of another shape than the clients'
    with pytest.raises(ValueError, match="running_var") as kept:
        fastagg.fedavg_step(models=_clients(model), params={k: v.clone() for k, v in wide.items()})
    with pytest.raises(ValueError, match="running_var") as fresh:
        _fresh(lambda: fastagg.fedavg_step(models=_clients(model), params={k: v.clone() for k, v in wide.items()}))
    assert str(kept.value) == str(fresh.value)


def test_numpy_then_torch_clients_of_one_layout_keep_their_own_form():
    model = _model()
    p = param_rows({k: v.clone() for k, v in model.items()})
    as_numpy = [{k: v.numpy() for k, v in c.items()} for c in _clients(model)]
    assert client_rows(as_numpy, name="models", params=p).form.numpy
    assert not client_rows(_clients(model), name="models", params=p).form.numpy
    assert client_rows(as_numpy, name="models", params=p).form.numpy


def test_the_plans_kept_are_bounded():
    flat._DICT_PLANS.clear()
    for n in range(flat._DICT_PLANS_KEPT + 10):
        model = {f"w{n}": torch.zeros(2), "b": torch.zeros(1)}
        _round(model, _clients(model, 2))
        assert len(flat._DICT_PLANS) <= flat._DICT_PLANS_KEPT
    assert np.isfinite(_round(model, _clients(model, 2))["b"].numpy()).all()
