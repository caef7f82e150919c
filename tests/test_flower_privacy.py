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
from flwr.serverapp.exception import AggregationError
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


@pytest.mark.parametrize("robust", ["FedMedian", "MultiKrum"])
def test_a_robust_strategy_cannot_be_wrapped(robust):
    """Refused when the wrapper is built, before any round can release a robust estimate noised as a mean."""
    for kind, kw in HAND:
        with pytest.raises(TypeError, match="robust"):
            getattr(fa, kind)(getattr(fa, robust)(min_available_nodes=1), 1.0, num_sampled_clients=3, **kw)


# -- aggregate_train without configure_train (as Flower's own tests call it) ----------------------------------------
# A DP wrapper must never release an unclipped or unnoised aggregate, whichever way the model the clients started
# from is given: current_arrays set by hand on the wrapper, on the strategy it wraps, on both -- or not at all, which
# is refused (there is nothing to clip against). The oracle: each update u_i = w_i - base scaled by
# min(1, C / ||u_i||) over all entries, the num-examples-weighted mean, written out in numpy below; with the noise
# off, Flower's own wrapper around Flower's own strategy on the same replies.
C = 0.5
HAND_SHAPES = {"a": (20, 10), "b": (200,)}  # d = 400: the noise's norm is sigma sqrt(d) = 20 sigma, +- 0.7 sigma
HAND = [("DifferentialPrivacyServerSideFixedClipping", dict(clipping_norm=C)),
        ("DifferentialPrivacyServerSideAdaptiveClipping", dict(initial_clipping_norm=C, clipped_count_stddev=1.0)),
        ("DifferentialPrivacyClientSideFixedClipping", dict(clipping_norm=C)),
        ("DifferentialPrivacyClientSideAdaptiveClipping", dict(initial_clipping_norm=C, clipped_count_stddev=1.0))]
HAND_NORMS = (0.2, 0.6, 3.0)  # one update within C, two beyond it
HAND_WEIGHTS = (5, 7, 9)


def _hand_case(preclip):
    """The base model, three replies (update norms HAND_NORMS; ``preclip``: already clipped to C, as a client's
    fixedclipping_mod sends them) with their ``norm_bit``, and the oracle's clipped weighted mean update."""
    rng = np.random.default_rng(7)
    base = {k: rng.standard_normal(s).astype(np.float32) for k, s in HAND_SHAPES.items()}
    ups = []
    for norm in HAND_NORMS:
        u = {k: rng.standard_normal(s) for k, s in HAND_SHAPES.items()}
        scale = norm / np.sqrt(sum((v ** 2).sum() for v in u.values()))
        ups.append({k: v * scale for k, v in u.items()})
    clipped = [{k: v * min(1.0, C / n) for k, v in u.items()} for u, n in zip(ups, HAND_NORMS)]
    sent = clipped if preclip else ups
    models = [{k: (base[k] + u[k]).astype(np.float32) for k in u} for u in sent]
    p = np.array(HAND_WEIGHTS, dtype=np.float64) / sum(HAND_WEIGHTS)
    mean = {k: sum(pi * c[k] for pi, c in zip(p, clipped)) for k in base}
    bits = [int(n > C) for n in HAND_NORMS]
    return base, models, bits, mean


def _hand_replies(models, bits):
    out = []
    for i, (model, bit) in enumerate(zip(models, bits)):
        msg = Message(content=RecordDict({}), dst_node_id=i + 1, message_type="train")
        out.append(reply(msg, model, HAND_WEIGHTS[i], norm_bit=bit))
    return out


def _hand_set(strategy, base, where):
    """current_arrays set by hand, in the form the object keeps it (Flower's FedOpt: a dict of arrays)."""
    if where in ("wrapper", "both"):
        strategy.current_arrays = rec(base)
    if where in ("inner", "both"):
        inner = strategy.strategy
        inner.current_arrays = dict(base) if isinstance(inner, fl.FedAdam) else rec(base)


def _update_norm(arrays, base):
    return float(np.sqrt(sum(((arrays[k].astype(np.float64) - base[k]) ** 2).sum() for k in base)))


@pytest.mark.parametrize("where", ["wrapper", "inner", "both"])
@pytest.mark.parametrize("inner", ["FedAvg", "FedAdam"])
@pytest.mark.parametrize("kind,kw", HAND)
def test_hand_set_model_without_configure_train_is_clipped_as_flowers_wrapper_does(kind, kw, inner, where):
    """Noise off: the model released is Flower's wrapper's on the same replies (client-side: replies the clients
    clipped, as Flower's wrapper trusts them to be), clipped against the model set by hand."""
    base, models, bits, mean = _hand_case(preclip=kind.startswith("DifferentialPrivacyClientSide"))
    ours = getattr(fa, kind)(getattr(fa, inner)(backend="cpu"), 0.0, num_sampled_clients=3, **kw)
    theirs = getattr(fl, kind)(getattr(fl, inner)(), 0.0, num_sampled_clients=3, **kw)
    _hand_set(ours, base, where)
    _hand_set(theirs, base, "both")
    got, _ = ours.aggregate_train(1, _hand_replies(models, bits))
    want, _ = theirs.aggregate_train(1, _hand_replies(models, bits))
    got, want = arrays_of(got), arrays_of(want)
    for k in base:
        np.testing.assert_allclose(got[k], want[k].astype(np.float32), rtol=1e-5, atol=1e-6, err_msg=k)
    if inner == "FedAvg":  # the oracle written out: the clipped weighted mean, whose update's norm is <= C
        for k in base:
            np.testing.assert_allclose(got[k], base[k] + mean[k], rtol=1e-5, atol=1e-6, err_msg=k)
        assert 0.1 < _update_norm(got, base) <= C * (1 + 1e-6)  # unclipped: ~1.0
    assert ours.strategy.server_metrics[1]["dp-clipping-norm"] == C


@pytest.mark.parametrize("where", ["wrapper", "inner", "both"])
@pytest.mark.parametrize("kind,kw", HAND)
def test_hand_set_model_without_configure_train_is_clipped_and_noised(kind, kw, where):
    """Noise on (z = 1), replies unclipped (a client-side round re-clips them): the update released is the
    oracle's clipped mean plus Gaussian noise of std sigma = z_eff C / n per coordinate, n = num_sampled_clients
    (z_eff = z for fixed clipping, Flower's compute_adaptive_noise_params's for adaptive): its distance from the
    clipped mean is sigma * chi_d, within sigma (sqrt(d) -+ 5), and the update's norm is at most C plus that."""
    from flwr.supercore.differential_privacy import compute_adaptive_noise_params

    base, models, bits, mean = _hand_case(preclip=False)
    ours = getattr(fa, kind)(fa.FedAvg(backend="cpu"), 1.0, num_sampled_clients=3, seed=5, **kw)
    _hand_set(ours, base, where)
    got, _ = ours.aggregate_train(1, _hand_replies(models, bits))
    got = arrays_of(got)
    z = 1.0 if "Fixed" in kind else compute_adaptive_noise_params(1.0, 3, 1.0)[1]
    sigma = z * C / 3
    assert ours.strategy.server_metrics[1]["dp-noise-std"] == pytest.approx(sigma, rel=1e-9)
    d = sum(int(np.prod(s)) for s in HAND_SHAPES.values())
    noise = float(np.sqrt(sum(((got[k] - base[k] - mean[k]) ** 2).sum() for k in base)))
    assert np.sqrt(d) - 5 < noise / sigma < np.sqrt(d) + 5, noise / sigma
    assert _update_norm(got, base) <= C + noise * (1 + 1e-6)


@pytest.mark.parametrize("inner", ["FedAvg", "FedAdam"])
@pytest.mark.parametrize("kind,kw", HAND)
def test_without_any_model_the_round_is_refused_and_nothing_changes(kind, kw, inner):
    """No configure_train and no current_arrays: nothing to clip against, so nothing is released (fastagg's FedAvg
    alone would aggregate the replies' models; Flower's server-side wrappers fail on their empty record). Nothing
    changed: no model, no release counted, no metrics, the clipping norm as it was, the replies intact."""
    base, models, bits, _ = _hand_case(preclip=False)
    ours = getattr(fa, kind)(getattr(fa, inner)(backend="cpu"), 1.0, num_sampled_clients=3, seed=5, **kw)
    replies = _hand_replies(models, bits)
    with pytest.raises(AggregationError, match="no model to clip the replies' updates against"):
        ours.aggregate_train(1, replies)
    assert ours.strategy.global_model is None and ours.mechanism.rounds == 0
    assert ours.strategy.server_metrics == {} and ours.clipping_norm == C
    for r, m in zip(replies, models):
        for k in m:
            np.testing.assert_array_equal(r.content["arrays"][k].numpy(), m[k])
    # a model set afterwards: the round runs, clipped
    ours.current_arrays = rec(base)
    got, _ = ours.aggregate_train(1, replies)
    assert got is not None and ours.mechanism.rounds == 1


def test_a_model_forgotten_and_set_again_is_still_clipped():
    """current_arrays = None on the strategy drops its optimizer; set again, the next round still goes through the
    mechanism (installed at every round, not only by configure_train)."""
    base, models, bits, mean = _hand_case(preclip=False)
    ours = fa.DifferentialPrivacyServerSideFixedClipping(fa.FedAvg(backend="cpu"), 0.0, C, 3)
    ours.current_arrays = rec(base)
    ours.aggregate_train(1, _hand_replies(models, bits))
    ours.strategy.current_arrays = None
    ours.strategy.current_arrays = rec(base)
    got = arrays_of(ours.aggregate_train(2, _hand_replies(models, bits))[0])
    for k in base:
        np.testing.assert_allclose(got[k], base[k] + mean[k], rtol=1e-5, atol=1e-6, err_msg=k)


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


@pytest.mark.parametrize("kind,kw", [("DifferentialPrivacyServerSideFixedClipping", FIXED),
                                     ("DifferentialPrivacyServerSideAdaptiveClipping",
                                      {**ADAPTIVE, "clipped_count_stddev": 1.0})])
def test_the_wrapped_strategys_own_metrics_are_withheld_unless_asked(kind, kw, caplog):
    """Around FedExP: ``fedexp-avg-sq-norm`` is the exact mean of the clipped squared norms (C^2 when every update
    was clipped) and ``fedexp-eta`` a function of it: neither is released, so neither is stored nor logged unless
    ``publish_exact_counts=True``; ``fedexp-mean-sq-norm`` (||noised mean||^2) is the release's."""
    start = rec(initial(shapes=SHAPES))
    got = {}
    for exact in (False, True):
        wrapper = getattr(fa, kind)(fa.FedExP(min_available_nodes=1, backend="cpu"), 1.0, seed=3,
                                    publish_exact_counts=exact, **kw)
        caplog.clear()
        with caplog.at_level("INFO"):
            _round(wrapper, 1, start, _client(1, scale=0.05))
        got[exact] = (dict(wrapper.strategy.server_metrics[1]), caplog.text)
    (quiet, quiet_log), (loud, loud_log) = got[False], got[True]
    assert "fedexp-avg-sq-norm" not in quiet and "fedexp-eta" not in quiet and "fedexp-mean-sq-norm" in quiet
    assert "fedexp-avg-sq-norm" not in quiet_log and "fedexp-eta" not in quiet_log
    c = kw.get("clipping_norm", kw.get("initial_clipping_norm"))
    assert loud["fedexp-avg-sq-norm"] == pytest.approx(c ** 2)  # (scale 0.05: every update clipped; what leaks)
    assert "fedexp-eta" in loud and "fedexp-avg-sq-norm" in loud_log
    assert quiet["fedexp-mean-sq-norm"] == pytest.approx(loud["fedexp-mean-sq-norm"])  # (same seed, same release)
