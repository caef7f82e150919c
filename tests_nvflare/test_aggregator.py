"""fastagg.nvflare.FastaggAggregator driven as FLARE's FedAvg workflow drives it (reset_stats, the model sent,
accept_model per result, aggregate_model), against float64 formulas and fastagg's own server optimizers.

Runs in the FLARE environment (`make test-nvflare`): fastagg installed there from the wheel CI built, not editable
(FLARE's job export copies a component's non-site-packages sources into the job). NVIDIA FLARE 2.9.0 and Flower 1.42
install together without a conflict; the environment is separate for the install form, not for a pin.
"""
from __future__ import annotations

import logging
import threading

import numpy as np
import pytest
import torch
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType

from fastagg.nvflare import RULES, FastaggAggregator

SHAPES = {"dense.weight": (4, 3), "dense.bias": (4,)}


def _model(seed: int, dtype=np.float64) -> dict:
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(dtype) for k, s in SHAPES.items()}


def _result(params: dict, site: str, steps=None, kind=ParamsType.FULL, rnd=None, metrics=None) -> FLModel:
    meta = {"client_name": site}
    if steps is not None:
        meta["NUM_STEPS_CURRENT_ROUND"] = steps
    return FLModel(params_type=kind, params=params, meta=meta, current_round=rnd, metrics=metrics)


def _round(agg: FastaggAggregator, sent: dict, results: list, rnd: int = 0) -> FLModel:
    agg.reset_stats()
    agg.set_model(FLModel(params_type=ParamsType.FULL, params=sent, current_round=rnd))
    for r in results:
        agg.accept_model(r)
    return agg.aggregate_model()


def _flat(params: dict) -> np.ndarray:
    return np.concatenate([np.asarray(params[k], dtype=np.float64).reshape(-1) for k in SHAPES])


def test_fedexp_rounds_equal_the_paper_formula():
    """Three FedExP rounds of 3 sites, weights = aggregation weight x NUM_STEPS_CURRENT_ROUND: the returned models
    equal w + eta * mean with eta = max(1, sum p_i ||d_i||^2 / (2 (||mean||^2 + eps))) in float64; metrics are
    the weighted means; the form (numpy float64, FULL) is the one sent."""
    eps = 1e-3
    agg = FastaggAggregator(rule="fedexp", hyper={"eps": eps}, aggregation_weights={"site-2": 3.0})
    w = _model(0)
    for rnd in range(3):
        clients = [{k: v + 0.1 * np.random.default_rng(10 * rnd + i).standard_normal(v.shape) for k, v in w.items()}
                   for i in range(3)]
        steps = [10, 20, 30]
        out = _round(agg, w, [_result(c, f"site-{i + 1}", steps[i], rnd=rnd, metrics={"loss": float(i), "tag": "x"})
                              for i, c in enumerate(clients)], rnd)
        n = np.array([10.0, 20.0 * 3.0, 30.0])
        p = n / n.sum()
        d = np.stack([_flat(c) - _flat(w) for c in clients])
        mean = p @ d
        eta = max(1.0, float(p @ (d * d).sum(1)) / (2 * (mean @ mean + eps)))
        expect = _flat(w) + eta * mean
        assert out.params_type == ParamsType.FULL
        assert all(isinstance(v, np.ndarray) and v.dtype == np.float64 for v in out.params.values())
        np.testing.assert_allclose(_flat(out.params), expect, rtol=1e-12, atol=1e-14)
        assert out.metrics == pytest.approx({"loss": float(p @ np.arange(3.0))})
        w = out.params


@pytest.mark.parametrize("rule", sorted(RULES))
def test_every_rule_equals_its_fastagg_server_optimizer(rule):
    """Each rule over 3 rounds of torch float32 state_dicts of a model with BatchNorm (FULL results): params equal
    the fastagg.server optimizer stepping the same updates, buffers are the weighted mean, tensors come back."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    hyper = {"fedexp": {"eps": 1e-3}, "fedexpm": {"eps": 1e-3}, "fedavgm": {"momentum": 0.9},
             "fedadam": {"lr": 0.1}, "fedyogi": {"lr": 0.1}, "fedadagrad": {"lr": 0.1}, "fedams": {"lr": 0.1},
             "fedavg": {"lr": 0.5}}[rule]
    agg = FastaggAggregator(rule=rule, hyper=hyper)
    ref_state = {k: v.clone() for k, v in net.state_dict().items()}
    ref = RULES[rule](ref_state, **hyper)
    sent = {k: v.clone() for k, v in net.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    for rnd in range(3):
        clients = []
        for i in range(3):
            c = {k: (v + 0.1 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v + i + 1)
                 for k, v in sent.items()}
            clients.append(c)
        steps = [1.0, 2.0, 5.0]
        out = _round(agg, sent, [_result(c, f"site-{i}", steps[i]) for i, c in enumerate(clients)], rnd)
        ref.step(clients, weights=torch.tensor(steps, dtype=torch.float64), base=sent)
        for k, v in ref_state.items():
            got = out.params[k]
            assert isinstance(got, torch.Tensor) and got.dtype == v.dtype, k
            torch.testing.assert_close(got, v, rtol=1e-6, atol=1e-7, msg=f"{rule} round {rnd} {k}")
        mean_rm = sum(s * c["1.running_mean"] for s, c in zip(steps, clients)) / sum(steps)
        torch.testing.assert_close(out.params["1.running_mean"], mean_rm, rtol=1e-6, atol=1e-7)
        sent = out.params


def test_diff_results_equal_full_results():
    """A DIFF result (the update itself) gives the same round as the FULL model it came from."""
    w = _model(1)
    clients = [_model(2 + i) for i in range(3)]
    full = _round(FastaggAggregator(rule="fedadam", hyper={"lr": 0.1}), w,
                  [_result(c, f"s{i}") for i, c in enumerate(clients)])
    diff = _round(FastaggAggregator(rule="fedadam", hyper={"lr": 0.1}), w,
                  [_result({k: c[k] - w[k] for k in c}, f"s{i}", kind=ParamsType.DIFF) for i, c in enumerate(clients)])
    np.testing.assert_allclose(_flat(diff.params), _flat(full.params), rtol=1e-12, atol=1e-14)


def test_bad_results_are_left_out_and_the_round_is_the_good_ones(caplog):
    """NaN, a missing entry, an extra entry, a wrong shape, a non-numeric entry, a repeated site and a result from
    another round are each left out with a warning naming the site; the round equals
    the round of the good results alone, and the bad results' arrays are not written."""
    w = _model(3)
    good = [_result(_model(4), "good-1"), _result(_model(5), "good-2", 3)]
    nan = _model(6)
    nan["dense.bias"][1] = np.nan
    missing = {"dense.weight": _model(7)["dense.weight"]}
    extra = {**_model(8), "other": np.zeros(2)}
    shape = {**_model(9), "dense.bias": np.zeros(5)}
    text = {**_model(10), "dense.bias": np.array(["a", "b", "c", "d"])}
    bad = [_result(nan, "nan"), _result(missing, "missing"), _result(extra, "extra"), _result(shape, "shape"),
           _result(text, "text"), _result(_model(11), "good-1"), _result(_model(12), "late", rnd=7)]
    snapshot = [{k: np.array(v, copy=True) for k, v in r.params.items()} for r in bad]
    with caplog.at_level(logging.WARNING):
        out = _round(FastaggAggregator(rule="fedexp", hyper={"eps": 1e-3}), w, good[:1] + bad + good[1:])
    ref = _round(FastaggAggregator(rule="fedexp", hyper={"eps": 1e-3}), w, good)
    np.testing.assert_array_equal(_flat(out.params), _flat(ref.params))
    for site in ("nan", "missing", "extra", "shape", "text", "good-1", "late"):
        assert any(site in r.getMessage() and "left out" in r.getMessage() for r in caplog.records), site
    for r, before in zip(bad, snapshot):
        for k, v in before.items():
            np.testing.assert_array_equal(r.params[k], v)


def test_raise_mode_raises_on_nan_and_changes_nothing():
    agg = FastaggAggregator(rule="fedavg", on_nonfinite="raise")
    w = _model(14)
    agg.set_model(FLModel(params_type=ParamsType.FULL, params=w))
    agg.accept_model(_result(_model(15), "a"))
    nan = _model(16)
    nan["dense.weight"][0, 0] = np.inf
    with pytest.raises(ValueError, match="NaN or Inf"):
        agg.accept_model(_result(nan, "b"))
    out = agg.aggregate_model()
    np.testing.assert_allclose(_flat(out.params), _flat(_model(15)), rtol=1e-12)  # FedAvg of the one good client


def test_a_step_that_would_make_the_model_non_finite_keeps_it(caplog):
    """FedAvg with lr = 1e39 on a float32 model: the step would overflow, so the model comes back unchanged with a
    warning (on_nonfinite="skip"); the aggregator keeps working the next round."""
    w = _model(60, np.float32)
    agg = FastaggAggregator(rule="fedavg", hyper={"lr": 1e39})
    with caplog.at_level(logging.WARNING):
        out = _round(agg, w, [_result(_model(61, np.float32), "a")])
    np.testing.assert_array_equal(_flat(out.params), _flat(w))
    assert any("non-finite" in r.getMessage() for r in caplog.records)
    assert all(np.isfinite(v).all() for v in out.params.values())


def test_a_round_without_results_keeps_the_model_and_late_results_are_refused(caplog):
    w = _model(17)
    agg = FastaggAggregator(rule="fedadam")
    with caplog.at_level(logging.WARNING):
        out = _round(agg, w, [])
        assert not agg.accept_model(_result(_model(18), "after"))  # the round has ended
    np.testing.assert_array_equal(_flat(out.params), _flat(w))
    assert any("no client result" in r.getMessage() for r in caplog.records)
    assert any("before the round's model" in r.getMessage() for r in caplog.records)


def test_results_from_many_threads_equal_one_thread():
    """12 results accepted from 4 threads at once: the same round as accepting them in order (float64; the sums
    are added in another order)."""
    w = _model(19)
    results = [_result(_model(20 + i), f"site-{i}", i + 1) for i in range(12)]
    one = _round(FastaggAggregator(rule="fedexp", hyper={"eps": 1e-3}), w, results)
    agg = FastaggAggregator(rule="fedexp", hyper={"eps": 1e-3})
    agg.reset_stats()
    agg.set_model(FLModel(params_type=ParamsType.FULL, params=w))
    threads = [threading.Thread(target=lambda part=results[t::4]: [agg.accept_model(r) for r in part])
               for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    many = agg.aggregate_model()
    np.testing.assert_allclose(_flat(many.params), _flat(one.params), rtol=1e-12, atol=1e-14)


def test_float32_numpy_models_stay_float32_and_the_returned_arrays_are_the_callers():
    """A float32 numpy model comes back float32; the returned arrays are copies (a later round does not change
    what FLARE already holds)."""
    w = _model(40, np.float32)
    agg = FastaggAggregator(rule="fedavgm", hyper={"momentum": 0.9})
    out1 = _round(agg, w, [_result(_model(41, np.float32), "a")])
    kept = {k: v.copy() for k, v in out1.params.items()}
    _round(agg, out1.params, [_result(_model(42, np.float32), "a")], 1)
    assert all(v.dtype == np.float32 for v in out1.params.values())
    for k in kept:
        np.testing.assert_array_equal(out1.params[k], kept[k])


@pytest.mark.parametrize("as_numpy", [True, False])
def test_the_new_model_is_handed_over_and_never_written_again(as_numpy):
    """aggregate_model gives its parameters' storage away (no copy) and takes fresh storage: what FLARE holds from
    a round is never written by the next rounds, whether they start from it or from another model, in numpy or
    torch form; the rounds themselves equal a FedAvgM optimizer stepped on the same results."""
    form = (lambda p: p) if as_numpy else (lambda p: {k: torch.from_numpy(v) for k, v in p.items()})
    agg = FastaggAggregator(rule="fedavgm", hyper={"momentum": 0.9})
    ref_w = {k: torch.from_numpy(v.copy()) for k, v in _model(50, np.float32).items()}
    ref = RULES["fedavgm"](ref_w, momentum=0.9)
    outs, kept, sent = [], [], form(_model(50, np.float32))
    for rnd in range(4):
        update = _model(60 + rnd, np.float32)
        out = _round(agg, sent, [_result(form(update), "a", kind=ParamsType.DIFF)], rnd)
        ref.step([{k: torch.from_numpy(v) for k, v in update.items()}])
        for k in SHAPES:
            np.testing.assert_array_equal(np.asarray(out.params[k]), ref_w[k].numpy())
            assert isinstance(out.params[k], np.ndarray if as_numpy else torch.Tensor)
        outs.append(out.params)
        kept.append({k: np.asarray(v).copy() for k, v in out.params.items()})
        # rounds 1 and 3 start from the model just returned (FLARE's flow); 2 from a copy (a persistor's reload)
        sent = out.params if rnd != 1 else form({k: np.asarray(v).copy() for k, v in out.params.items()})
    for params, want in zip(outs, kept):
        for k in SHAPES:
            np.testing.assert_array_equal(np.asarray(params[k]), want[k])
    ptrs = [np.asarray(p[k]).__array_interface__["data"][0] for p in outs for k in SHAPES]
    assert len(set(ptrs)) == len(ptrs)  # no two rounds' models share memory


@pytest.mark.parametrize("rule", sorted(RULES))
def test_the_round_keeps_client_norms_only_for_rules_that_read_them(rule):
    """The FedAvg family steps on the sum alone: its rounds skip the clients' squared norms (a third of a
    BLOCKWISE8 fold); FedExP's family keeps them."""
    agg = FastaggAggregator(rule=rule, hyper={"eps": 1e-3} if "fedexp" in rule else None)
    _round(agg, _model(70), [_result(_model(71), "a"), _result(_model(72), "b")])
    assert agg._round_acc.client_norms == ("fedexp" in rule)


@pytest.mark.parametrize("kw, error", [
    (dict(rule="fedsgd"), "rule must be one of"),
    (dict(rule="krum"), "needs every site's result of a round at once"),
    (dict(rule="median"), "fastagg.flower's FedMedian"),
    (dict(rule="fedexp"), "needs eps"),
    (dict(rule="fedadam", hyper={"lr": -1.0}), "lr"),
    (dict(rule="fedadam", hyper={"learning_rate": 0.1}), "learning_rate"),
    (dict(on_nonfinite="ignore"), "on_nonfinite"),
    (dict(aggregation_weights={"a": -1.0}), "aggregation_weights"),
    (dict(aggregation_weights={"a": float("nan")}), "aggregation_weights"),
    (dict(aggregation_weights=[("a", 1.0)]), "aggregation_weights must be a dict"),
    (dict(hyper=[1]), "hyper must be a dict"),
])
def test_bad_construction_is_refused_at_once(kw, error):
    with pytest.raises((TypeError, ValueError), match=error):
        FastaggAggregator(**kw)


def test_the_job_export_carries_the_aggregators_arguments(tmp_path):
    """FLARE's job API reads a component's constructor arguments back from its attributes: the exported server
    config's FedAvg workflow names fastagg.nvflare.FastaggAggregator with the rule, hyper-parameters and weights given."""
    import json

    from nvflare.app_common.np.recipes.fedavg import NumpyFedAvgRecipe

    agg = FastaggAggregator(rule="fedadam", hyper={"lr": 0.05, "betas": [0.9, 0.99]},
                            aggregation_weights={"site-1": 2.0})
    recipe = NumpyFedAvgRecipe(name="fastagg_export", model=np.zeros(4).tolist(), min_clients=2, num_rounds=1,
                               train_script=__file__, aggregator=agg)
    recipe.export(str(tmp_path))
    configs = list(tmp_path.rglob("config_fed_server.json"))
    assert len(configs) == 1
    workflow = json.loads(configs[0].read_text())["workflows"][0]
    mine = workflow["args"]["aggregator"]
    assert mine["path"] == "fastagg.nvflare.FastaggAggregator"
    assert mine["args"] == {"rule": "fedadam", "hyper": {"lr": 0.05, "betas": [0.9, 0.99]},
                               "aggregation_weights": {"site-1": 2.0}}


def test_a_restarted_aggregator_resumes_the_optimizer_state():
    """FedAdam for 2 rounds, its state_dict saved (through torch.save) and loaded into a new aggregator before its
    first round: round 3 equals the uninterrupted aggregator's, bit for bit. A state of another size is refused."""
    import io

    w = _model(50)
    rounds = [[_result(_model(51 + 3 * r + i), f"s{i}", i + 1) for i in range(3)] for r in range(3)]
    agg = FastaggAggregator(rule="fedadam", hyper={"lr": 0.1})
    for r in range(2):
        w = _round(agg, w, rounds[r], r).params
    buf = io.BytesIO()
    torch.save(agg.state_dict(), buf)
    restarted = FastaggAggregator(rule="fedadam", hyper={"lr": 0.1})
    restarted.load_state_dict(torch.load(io.BytesIO(buf.getvalue())))
    a = _round(agg, w, rounds[2], 2).params
    b = _round(restarted, w, rounds[2], 2).params
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    wrong = FastaggAggregator(rule="fedadam", hyper={"lr": 0.1})
    wrong.load_state_dict(agg.state_dict())
    with pytest.raises((ValueError, TypeError)):
        wrong.set_model(FLModel(params_type=ParamsType.FULL, params={"other": np.zeros(5)}))


@pytest.mark.parametrize("steps, admin", [(1e308, 2.0), (10**400, 1.0), (3e307, 10.0)],
                         ids=["1e308 steps x 2", "10**400 steps", "3e307 steps x 10"])
def test_a_site_with_a_weight_that_overflows_is_left_out_and_the_rounds_go_on(steps, admin, caplog):
    """A site reports a huge NUM_STEPS_CURRENT_ROUND (or its admin weight overflows with it): that site is left out
    with a warning, round after round; the honest sites' rounds equal rounds without it."""
    w = _model(60)
    honest = [_result(_model(61 + i), f"s{i}", i + 1) for i in range(2)]
    greedy = _result(_model(70), "greedy")
    greedy.meta["NUM_STEPS_CURRENT_ROUND"] = steps
    agg = FastaggAggregator(rule="fedavg", aggregation_weights={"greedy": admin})
    ref = FastaggAggregator(rule="fedavg")
    with caplog.at_level(logging.WARNING):
        for r in range(2):
            out = _round(agg, w, honest + [greedy], r)
            want = _round(ref, w, honest, r)
            np.testing.assert_array_equal(_flat(out.params), _flat(want.params))
    assert any("greedy" in rec.getMessage() and "left out" in rec.getMessage() for rec in caplog.records)


def test_a_restored_state_of_another_rule_is_refused_at_load_and_never_wedges_the_rounds():
    w = _model(80)
    adam = FastaggAggregator(rule="fedadam", hyper={"lr": 0.1})
    _round(adam, w, [_result(_model(81), "s0")], 0)
    yogi = FastaggAggregator(rule="fedyogi", hyper={"lr": 0.1})
    with pytest.raises(ValueError, match="FedAdam"):
        yogi.load_state_dict(adam.state_dict())
    out = _round(yogi, w, [_result(_model(82), "s0")], 0)  # the rounds go on
    assert out.params is not None
    other_size = FastaggAggregator(rule="fedadam", hyper={"lr": 0.1})
    other_size.load_state_dict(adam.state_dict())
    small = {"dense.weight": np.zeros((2, 2), np.float32)}
    with pytest.raises((ValueError, TypeError)):
        other_size.set_model(FLModel(params_type=ParamsType.FULL, params=small))
    other_size.set_model(FLModel(params_type=ParamsType.FULL, params=small))  # raised once; fresh from then on
    assert other_size.accept_model(_result({"dense.weight": np.ones((2, 2), np.float32)}, "s0"))
    assert other_size.aggregate_model().params is not None


# -- central differential privacy (dp=) ---------------------------------------------------------------------------
DP_SHAPES = {"dense.weight": (40, 30), "dense.bias": (40,)}


def _dp_round(agg, sent, updates, rnd=0):
    agg.reset_stats()
    agg.set_model(FLModel(params_type=ParamsType.FULL, params=sent, current_round=rnd))
    for i, u in enumerate(updates):
        agg.accept_model(_result({k: sent[k] + u[k] for k in sent}, f"site-{i}", steps=3 + i, rnd=rnd))
    return agg.aggregate_model()


def _dp_inputs(m=5, scale=0.02):
    rng = np.random.default_rng(7)
    sent = {k: rng.standard_normal(s).astype(np.float32) for k, s in DP_SHAPES.items()}
    updates = [{k: (scale * (i + 1) * rng.standard_normal(s)).astype(np.float32) for k, s in DP_SHAPES.items()}
               for i in range(m)]
    return sent, updates


def _clipped_mean(updates, c):
    flat = [np.concatenate([u[k].astype(np.float64).ravel() for k in DP_SHAPES]) for u in updates]
    return np.mean([f * min(1.0, c / np.linalg.norm(f)) for f in flat], axis=0)


def test_dp_server_fixed_clipping_is_the_uniform_clipped_mean_plus_the_generators_noise():
    from fastagg.backends import reference

    sent, updates = _dp_inputs()
    c, z, n = 1.5, 1.5, 5
    agg = FastaggAggregator(rule="fedavg", dp={"mechanism": "server-fixed", "noise_multiplier": z,
                                                "clipping_norm": c, "num_sampled_clients": n, "seed": 42})
    out = _dp_round(agg, sent, updates)
    got = _flat(out.params) - _flat(sent)
    want = _clipped_mean(updates, c)  # uniform: the sites' NUM_STEPS_CURRENT_ROUND do not weigh under DP
    noise = reference.gaussian(want.size, seed=42, round=0).double().numpy()
    np.testing.assert_allclose(got, want + z * c / n * noise, atol=2e-6)
    quiet = FastaggAggregator(rule="fedavg", dp={"mechanism": "server-fixed", "noise_multiplier": 0.0,
                                                  "clipping_norm": c, "num_sampled_clients": n})
    np.testing.assert_allclose(_flat(_dp_round(quiet, sent, updates).params) - _flat(sent), want, atol=1e-6)
    assert 0 < sum(agg._clipped) < 5


def test_dp_adaptive_clipping_moves_the_norm_and_the_state_travels():
    sent, updates = _dp_inputs()
    dp = {"mechanism": "server-adaptive", "noise_multiplier": 0.0, "num_sampled_clients": 5,
          "initial_clipping_norm": 0.05, "seed": 1}
    agg = FastaggAggregator(rule="fedadam", hyper={"lr": 0.01}, dp=dp)
    norms = []
    for rnd in range(3):
        _dp_round(agg, sent, updates, rnd)
        norms.append(agg._mechanism.clipping_norm)
    assert norms[0] > 0.05 and norms[1] > norms[0]  # every update clipped: the norm grows towards the median
    again = FastaggAggregator(rule="fedadam", hyper={"lr": 0.01}, dp=dp)
    again.load_state_dict(agg.state_dict())
    assert again._mechanism.clipping_norm == norms[-1] and again._mechanism.rounds == 3
    with pytest.raises(ValueError, match="with dp="):
        FastaggAggregator(rule="fedadam", hyper={"lr": 0.01}).load_state_dict(agg.state_dict())


@pytest.mark.parametrize("dp,error", [({"mechanism": "client-fixed"}, ValueError), ({"mechanism": "server-fixed",
                                       "noise_multiplier": -1, "clipping_norm": 1, "num_sampled_clients": 2}, ValueError),
                                      ({"mechanism": "server-fixed", "clip": 1}, TypeError), ("dp", TypeError)])
def test_dp_bad_configs_are_refused_at_once(dp, error):
    with pytest.raises(error):
        FastaggAggregator(dp=dp)


def test_dp_a_nan_site_is_left_out_and_the_release_stays_finite(caplog):
    sent, updates = _dp_inputs()
    updates[2]["dense.bias"][3] = np.nan
    agg = FastaggAggregator(rule="fedavg", dp={"mechanism": "server-fixed", "noise_multiplier": 0.0,
                                                "clipping_norm": 0.7, "num_sampled_clients": 4})
    with caplog.at_level(logging.WARNING):
        out = _dp_round(agg, sent, updates)
    assert "site-2" in caplog.text
    good = [u for i, u in enumerate(updates) if i != 2]
    np.testing.assert_allclose(_flat(out.params) - _flat(sent), _clipped_mean(good, 0.7), atol=1e-6)


def test_a_metric_is_averaged_over_the_sites_that_report_it():
    """As FLARE's WeightedAggregationHelper (a weight per key): a site that does not report a metric, or reports
    it as a string, a bool or NaN, does not pull that metric's average toward zero."""
    agg = FastaggAggregator(rule="fedavg")
    out = _round(agg, _model(80), [_result(_model(81), "a", steps=2, metrics={"acc": 0.9, "loss": 1.0}),
                                   _result(_model(82), "b", steps=1, metrics={"acc": "high", "loss": 4.0}),
                                   _result(_model(83), "c", steps=1, metrics={"acc": float("nan")}),
                                   _result(_model(84), "d", steps=1)])
    assert out.metrics == pytest.approx({"acc": 0.9, "loss": (2 * 1.0 + 4.0) / 3})
    assert _round(agg, _model(80), [_result(_model(81), "a")]).metrics is None


@pytest.mark.parametrize("as_numpy", [True, False])
def test_a_batchnorm_model_keeps_its_counters_shape_and_every_result_is_folded(as_numpy, caplog):
    """A ResNet-shaped result (BatchNorm statistics and a 0-d ``num_batches_tracked``) as FLARE sends it: numpy
    arrays were made 1-D by np.ascontiguousarray, so the model's counter had shape (1,), every result's () was
    refused and no round ever folded anything (the model never changed). Oracle: FedAvg of the weights, the
    statistics averaged, the counter advanced by the mean advance."""
    model = {"conv.weight": np.arange(6.0, dtype=np.float32).reshape(2, 3), "bn.running_mean": np.zeros(2, np.float32),
             "bn.running_var": np.ones(2, np.float32), "bn.num_batches_tracked": np.array(10, np.int64)}
    agg = FastaggAggregator(rule="fedavg")
    for rnd in range(3):
        results = []
        for i in range(2):
            sent = {k: (v + (i + 1) if v.dtype.kind == "f" else v + 4) for k, v in model.items()}
            if not as_numpy:
                sent = {k: torch.from_numpy(np.array(v)) for k, v in sent.items()}
            results.append(_result(sent, f"site-{i}", rnd=rnd))
        with caplog.at_level(logging.WARNING):
            out = _round(agg, model, results, rnd=rnd).params
        assert "left out" not in caplog.text and "no client result" not in caplog.text, caplog.text
        got = {k: np.asarray(v) for k, v in out.items()}
        assert got["bn.num_batches_tracked"].shape == () and int(got["bn.num_batches_tracked"]) == 10 + 4 * (rnd + 1)
        for k in ("conv.weight", "bn.running_mean", "bn.running_var"):
            np.testing.assert_allclose(got[k], model[k] + 1.5, rtol=0, atol=1e-6, err_msg=k)
            assert got[k].dtype == np.float32 and got[k].shape == model[k].shape
        model = {k: np.array(v) for k, v in got.items()}


def test_held_results_fold_together_as_they_would_one_by_one(caplog):
    """Results are held (up to batch_bytes) and folded in one sweep: the round equals folding each as it arrives
    (batch_bytes=0), a NaN result held with the others is left out when folded -- named in a warning, its metric
    not counted -- and a result larger than batch_bytes folds alone at once."""
    w = _model(70)
    results = [_result(_model(71 + i), f"site-{i}", i + 1, metrics={"loss": float(i)}) for i in range(6)]
    nan = _model(80)
    nan["dense.weight"][1, 2] = np.nan
    bad = _result(nan, "nan-site", 2, metrics={"loss": 1000.0})
    alone = FastaggAggregator(rule="fedexp", hyper={"eps": 1e-3}, batch_bytes=0)
    one = _round(alone, w, results)
    held = FastaggAggregator(rule="fedexp", hyper={"eps": 1e-3})
    held.reset_stats()
    held.set_model(FLModel(params_type=ParamsType.FULL, params=w))
    with caplog.at_level(logging.WARNING):
        for r in results[:3] + [bad] + results[3:]:
            assert held.accept_model(r)  # (held: checked, folded later)
        assert len(held._held) == 7
        out = held.aggregate_model()
    np.testing.assert_allclose(_flat(out.params), _flat(one.params), rtol=1e-12, atol=1e-14)
    assert out.metrics["loss"] == pytest.approx(one.metrics["loss"], rel=1e-12)
    assert any("nan-site" in r.getMessage() and "left out" in r.getMessage() for r in caplog.records)
    small = FastaggAggregator(rule="fedavg", batch_bytes=_flat(w).nbytes - 1)  # every result is larger
    small.reset_stats()
    small.set_model(FLModel(params_type=ParamsType.FULL, params=w))
    small.accept_model(results[0])
    assert small._held == [] and small._acc.num_clients == 1


def test_raise_mode_and_dp_never_hold_results():
    for kw in ({"on_nonfinite": "raise"}, {"dp": {"mechanism": "server-fixed", "noise_multiplier": 0.5,
                                                  "clipping_norm": 1.0, "num_sampled_clients": 2}}):
        agg = FastaggAggregator(rule="fedavg", **kw)
        agg.reset_stats()
        agg.set_model(FLModel(params_type=ParamsType.FULL, params=_model(90)))
        agg.accept_model(_result(_model(91), "a"))
        assert agg._held == [] and agg._acc.num_clients == 1, kw


@pytest.mark.parametrize("bad", [-1, 1.5, True, "64MB"])
def test_a_bad_batch_bytes_is_refused(bad):
    with pytest.raises(ValueError, match="batch_bytes"):
        FastaggAggregator(batch_bytes=bad)


def test_held_results_are_copies_and_a_restarted_round_drops_them(caplog):
    """The review of the held results: a caller that reuses one receive buffer for every site got the last site's
    values for all (views were held), and set_model (a round restarted by the operator's controller) kept the held
    results of the round before, which then won over the new round's ("already folded")."""
    w = {"b": np.zeros(4)}
    agg = FastaggAggregator(rule="fedavg")
    agg.reset_stats()
    agg.set_model(FLModel(params_type=ParamsType.FULL, params=w, current_round=0))
    buf = np.empty(4)
    for i, v in enumerate([1.0, 2.0, 3.0]):
        buf[:] = v
        assert agg.accept_model(_result({"b": buf}, f"s{i}", rnd=0))
    buf[:] = -1e6  # the caller's buffer changes after the last accept
    np.testing.assert_allclose(agg.aggregate_model().params["b"], 2.0, rtol=1e-12)
    agg.reset_stats()
    agg.set_model(FLModel(params_type=ParamsType.FULL, params=w, current_round=1))
    for s in ("a", "b"):
        assert agg.accept_model(_result({"b": np.full(4, 100.0)}, s, rnd=1))
    agg.set_model(FLModel(params_type=ParamsType.FULL, params=w, current_round=1))  # restarted
    for s in ("a", "b"):
        assert agg.accept_model(_result({"b": np.full(4, 1.0)}, s, rnd=1))
    np.testing.assert_allclose(agg.aggregate_model().params["b"], 1.0, rtol=1e-12)


def test_held_weights_count_toward_the_overflow_check(caplog):
    agg = FastaggAggregator(rule="fedavg", aggregation_weights={"a": 1e308, "b": 1e308})
    agg.reset_stats()
    agg.set_model(FLModel(params_type=ParamsType.FULL, params={"b": np.zeros(4)}, current_round=0))
    with caplog.at_level(logging.WARNING):
        # (tiny values: a weight of 1e308 times them, and their squares, stay finite)
        assert agg.accept_model(_result({"b": np.full(4, 1e-300)}, "a", rnd=0))
        assert not agg.accept_model(_result({"b": np.full(4, 3e-300)}, "b", rnd=0))  # would overflow the total
    assert "overflow" in caplog.text and "b" in caplog.text
    np.testing.assert_allclose(agg.aggregate_model().params["b"], 1e-300, rtol=1e-12)
