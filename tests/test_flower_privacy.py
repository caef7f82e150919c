"""fastagg.flower's DP wrappers and client mods next to Flower 1.42's own on the same reply Messages: with the noise
off (z = 0) the models are equal round after round and adaptive clipping follows the same clip-norm trajectory;
with it on, the same clipping decisions and noise of the stated std; Flower's accountant spends the same epsilon;
the mods clip as Flower's do."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.clientapp.mod import adaptiveclipping_mod as fl_adaptive_mod
from flwr.clientapp.mod import fixedclipping_mod as fl_fixed_mod
from flwr.serverapp import strategy as fl
from flwr.supercore.privacy_accounting import NeighboringRelation, PrivacyConfig, SamplingMethod
from flwr.supercore.privacy_accounting.rdp_accountant import RdpAccountant

from fastagg import flower as fa
from fastagg.testing import assert_close
from test_flower_strategies import Grid, arrays_of, initial, rec, reply

SHAPES = {"conv.weight": (40, 30), "fc.weight": (50, 40), "fc.bias": (50,)}
NODES = 6


def _client(rnd, scale=0.005):
    """Nodes move by node-specific amounts (some beyond the clipping norm); equal example counts."""

    def client(msg):
        node = msg.metadata.dst_node_id
        sent = arrays_of(msg.content["arrays"])
        rng = np.random.default_rng(100 * rnd + node)
        model = {k: (v + scale * node * rng.standard_normal(v.shape)).astype(v.dtype) for k, v in sent.items()}
        return reply(msg, model, 10)
    return client


def _round(strategy, rnd, arrays, client, replies=None):
    msgs = sorted(strategy.configure_train(rnd, arrays, ConfigRecord(), Grid(range(1, NODES + 1))),
                  key=lambda m: m.metadata.dst_node_id)
    if replies is None:
        replies = [client(m) for m in msgs]
    else:  # the very replies the other strategy got, re-addressed
        replies = [Message(content=r.content, reply_to=m) for r, m in zip(replies, msgs)]
    pristine = [Message(content=copy.deepcopy(r.content), reply_to=m) for r, m in zip(replies, msgs)]
    return msgs, pristine, strategy.aggregate_train(rnd, replies)  # (Flower's wrapper clips the replies in place)


def _pair(kind, z, exact=False, **kw):
    fl_cls = getattr(fl, kind)
    fa_cls = getattr(fa, kind)
    return (fl_cls(fl.FedAvg(min_available_nodes=1), z, **kw),
            fa_cls(fa.FedAvg(min_available_nodes=1, backend="cpu"), z, seed=11, publish_exact_counts=exact, **kw))


FIXED = dict(clipping_norm=0.6, num_sampled_clients=NODES)
ADAPTIVE = dict(num_sampled_clients=NODES, initial_clipping_norm=0.3, target_clipped_quantile=0.5, clip_norm_lr=0.2)


@pytest.mark.parametrize("kind,kw", [("DifferentialPrivacyServerSideFixedClipping", FIXED),
                                     ("DifferentialPrivacyServerSideAdaptiveClipping", ADAPTIVE)])
def test_server_side_without_noise_equals_flower_round_after_round(kind, kw):
    theirs, ours = _pair(kind, 0.0, exact=True, **kw)
    a_fa = a_fl = rec(initial(shapes=SHAPES))
    for rnd in range(1, 5):
        _, replies, (a_fa, m_fa) = _round(ours, rnd, a_fa, _client(rnd))
        _, _, (a_fl, m_fl) = _round(theirs, rnd, a_fl, None, replies)
        got, want = arrays_of(a_fa), arrays_of(a_fl)
        for k in got:
            assert_close(torch.from_numpy(got[k]), torch.from_numpy(want[k]).double(), rtol=1e-5, atol=1e-6,
                         name=f"{kind} {k} round {rnd}")
        assert ours.clipping_norm == pytest.approx(theirs.clipping_norm, rel=1e-12)  # the trajectory
        assert dict(m_fa) == pytest.approx(dict(m_fl))
        sm = ours.strategy.server_metrics[rnd]
        if rnd == 1:  # some replies clipped, some not: the decisions are exercised
            assert 0 < sm["dp-clipped"] < NODES


def _client_side_round(strategy, rnd, arrays, mod):
    """configure_train -> each node's ClientApp behind ``mod`` -> aggregate_train."""
    msgs = sorted(strategy.configure_train(rnd, arrays, ConfigRecord(), Grid(range(1, NODES + 1))),
                  key=lambda m: m.metadata.dst_node_id)
    app = _client(rnd)
    replies = [mod(m, None, lambda msg, ctxt: app(msg)) for m in msgs]  # (the mods pass the context through)
    return replies, strategy.aggregate_train(rnd, replies)


@pytest.mark.parametrize("kind,kw,mods", [
    ("DifferentialPrivacyClientSideFixedClipping", FIXED, (fl_fixed_mod, fa.fixedclipping_mod)),
    ("DifferentialPrivacyClientSideAdaptiveClipping", ADAPTIVE, (fl_adaptive_mod, fa.adaptiveclipping_mod))])
def test_client_side_without_noise_equals_flower_with_either_mod(kind, kw, mods):
    theirs, ours = _pair(kind, 0.0, **kw)
    a_fa = a_fl = rec(initial(shapes=SHAPES))
    for rnd in range(1, 5):
        r_fa, (a_fa, _) = _client_side_round(ours, rnd, a_fa, mods[1])
        r_fl, (a_fl, _) = _client_side_round(theirs, rnd, a_fl, mods[0])
        for x, y in zip(r_fa, r_fl):  # the mods clipped alike
            assert dict(x.content.metric_records["metrics"]) == dict(y.content.metric_records["metrics"])
            for k, v in arrays_of(x.content["arrays"]).items():
                np.testing.assert_allclose(v, arrays_of(y.content["arrays"])[k], rtol=1e-5, atol=1e-6)
        got, want = arrays_of(a_fa), arrays_of(a_fl)
        for k in got:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6)
        assert ours.clipping_norm == pytest.approx(theirs.clipping_norm, rel=1e-12)


def test_with_noise_same_clipping_and_noise_of_the_stated_std():
    z, c = 1.0, 0.6
    theirs, ours = _pair("DifferentialPrivacyServerSideFixedClipping", z, exact=True, **FIXED)
    quiet = fa.DifferentialPrivacyServerSideFixedClipping(fa.FedAvg(min_available_nodes=1, backend="cpu"), 0.0,
                                                          publish_exact_counts=True, **FIXED)
    start = rec(initial(shapes=SHAPES))
    _, replies, (a_fa, _) = _round(ours, 1, start, _client(1))
    _, _, (a_q, _) = _round(quiet, 1, start, None, replies)
    np.random.seed(0)
    _, _, (a_fl, _) = _round(theirs, 1, start, None, replies)
    assert ours.strategy.server_metrics[1]["dp-clipped"] == quiet.strategy.server_metrics[1]["dp-clipped"]
    sigma = z * c / NODES
    ours_noise = np.concatenate([(arrays_of(a_fa)[k] - arrays_of(a_q)[k]).ravel() for k in SHAPES]) / sigma
    flower_noise = np.concatenate([(arrays_of(a_fl)[k] - arrays_of(a_q)[k]).ravel() for k in SHAPES]) / sigma
    n = ours_noise.size  # 3250 coordinates
    for noise in (ours_noise, flower_noise):
        assert abs(noise.mean()) < 5 / np.sqrt(n)
        assert abs(noise.std() - 1) < 5 * np.sqrt(0.5 / n)
    assert ours.strategy.server_metrics[1]["dp-noise-std"] == pytest.approx(sigma)


@pytest.mark.parametrize("kind,kw", [("DifferentialPrivacyServerSideFixedClipping", FIXED),
                                     ("DifferentialPrivacyServerSideAdaptiveClipping",
                                      {**ADAPTIVE, "clipped_count_stddev": 1.0})])
def test_server_metrics_publish_only_released_values_unless_asked(kind, kw):
    """The exact clipped / excluded counts are not private: by default the metrics hold only what the mechanism
    released (the norm, the noise std and, adaptive, the noised fraction that moved the norm)."""
    _, ours = _pair(kind, 1.0, **kw)
    _, exact = _pair(kind, 1.0, exact=True, **kw)
    start = rec(initial(shapes=SHAPES))
    _, replies, _ = _round(ours, 1, start, _client(1))
    _round(exact, 1, start, None, replies)
    sm, sx = dict(ours.strategy.server_metrics[1]), dict(exact.strategy.server_metrics[1])
    released = {"dp-clipping-norm", "dp-noise-std"}
    if "Adaptive" in kind:
        released |= {"dp-next-clipping-norm", "dp-noisy-clipped-fraction"}
        res = ours.mechanism.last
        assert sm["dp-noisy-clipped-fraction"] == pytest.approx(res.noisy_clipped_fraction)
        assert sm["dp-noisy-clipped-fraction"] != int(res.clipped.sum()) / NODES  # noised (seed 11), not exact
    assert set(sm) & {"dp-clipped", "dp-excluded"} == set() and released <= set(sm)
    assert 0 < sx["dp-clipped"] < NODES and sx["dp-excluded"] == 0  # asked for: the exact counts
    with pytest.raises(TypeError, match="publish_exact_counts"):
        getattr(fa, kind)(fa.FedAvg(), 1.0, publish_exact_counts="yes", **kw)


def _accountant():
    return RdpAccountant(PrivacyConfig(target_delta=1e-5, population_size=100,
                                       neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
                                       sampling_method=SamplingMethod.NO_AMPLIFICATION))


def test_flowers_accountant_spends_the_same_epsilon_and_fused_adam_is_accounted():
    theirs = fl.DifferentialPrivacyServerSideFixedClipping(fl.FedAvg(min_available_nodes=1), 1.2, 0.6, NODES,
                                                           accountant=_accountant())
    ours = fa.DifferentialPrivacyServerSideFixedClipping(fa.FedAvg(min_available_nodes=1, backend="cpu"), 1.2, 0.6,
                                                         NODES, accountant=_accountant())
    a_fa = a_fl = rec(initial(shapes=SHAPES))
    for rnd in range(1, 4):
        _, replies, (a_fa, _) = _round(ours, rnd, a_fa, _client(rnd))
        _, _, (a_fl, _) = _round(theirs, rnd, a_fl, None, replies)
    assert ours.privacy_spent().epsilon == pytest.approx(theirs.privacy_spent().epsilon)
    assert ours.privacy_spent().num_releases == 3
    # Flower refuses its FedAdam (the noise would come after Adam's step); fused, the noise comes before it
    with pytest.raises(ValueError, match="FedAvg"):
        fl.DifferentialPrivacyServerSideFixedClipping(fl.FedAdam(), 1.2, 0.6, NODES, accountant=_accountant())
    adam = fa.DifferentialPrivacyServerSideFixedClipping(fa.FedAdam(min_available_nodes=1, backend="cpu"), 1.2, 0.6,
                                                         NODES, accountant=_accountant())
    _round(adam, 1, rec(initial(shapes=SHAPES)), _client(1))
    assert adam.privacy_spent().num_releases == 1


def test_around_a_flower_strategy_it_is_flowers_wrapper():
    theirs = fl.DifferentialPrivacyServerSideFixedClipping(fl.FedAvg(min_available_nodes=1), 0.0, 0.6, NODES)
    ours = fa.DifferentialPrivacyServerSideFixedClipping(fl.FedAvg(min_available_nodes=1), 0.0, 0.6, NODES)
    assert ours.mechanism is None
    start = rec(initial(shapes=SHAPES))
    _, replies, (a_fa, _) = _round(ours, 1, start, _client(1))
    _, _, (a_fl, _) = _round(theirs, 1, start, None, replies)
    for k, v in arrays_of(a_fa).items():
        np.testing.assert_array_equal(v, arrays_of(a_fl)[k])


def test_a_robust_strategy_cannot_be_wrapped():
    dp = fa.DifferentialPrivacyServerSideFixedClipping(fa.FedMedian(min_available_nodes=1), 1.0, 0.6, NODES)
    with pytest.raises(TypeError, match="robust"):
        _round(dp, 1, rec(initial(shapes=SHAPES)), _client(1))


def test_flowers_argument_checks_are_kept():
    for bad in (dict(noise_multiplier=-1.0), dict(clipping_norm=0.0), dict(num_sampled_clients=0)):
        args = {**dict(noise_multiplier=1.0, clipping_norm=0.5, num_sampled_clients=4), **bad}
        with pytest.raises(ValueError):
            fa.DifferentialPrivacyServerSideFixedClipping(fa.FedAvg(), args["noise_multiplier"],
                                                          args["clipping_norm"], args["num_sampled_clients"])
    with pytest.raises(ValueError, match="quantile"):
        fa.DifferentialPrivacyServerSideAdaptiveClipping(fa.FedAvg(), 0.0, 4, target_clipped_quantile=2.0)


def test_mods_return_flowers_errors():
    msg = Message(content=RecordDict({"arrays": rec(initial(shapes=SHAPES)), "config": ConfigRecord({})}),
                  dst_node_id=1, message_type="train")
    out = fa.fixedclipping_mod(msg, None, lambda m, c: None)
    assert out.has_error() and "clipping_norm" in out.error.reason
