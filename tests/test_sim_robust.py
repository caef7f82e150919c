"""The simulator's Byzantine clients (fastagg.sim.attacks) and robust algorithms: each attack as its paper
writes it, the attackers drawn once per seed without disturbing the run's own draws, and the defence working on
digits (FedAvg broken by 20% sign-flipping clients, the robust rules not)."""
from __future__ import annotations

import math

import pytest
import torch

from fastagg.sim import Config, run
from fastagg.sim import attacks
from fastagg.sim import data as datasets


def _deltas(m=10, d=30, seed=0):
    return torch.randn(m, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_each_model_poisoning_attack_is_its_formula():
    x = _deltas()
    bad = torch.zeros(10, dtype=torch.bool)
    bad[[2, 7]] = True
    honest = x[~bad]
    g = torch.Generator().manual_seed(0)
    out = attacks.attack_updates("sign-flip", x, bad, None, g)
    assert torch.equal(out[bad], -x[bad]) and torch.equal(out[~bad], x[~bad])
    assert torch.equal(attacks.attack_updates("scale", x, bad, 3.0, g)[bad], 3.0 * x[bad])
    ipm = attacks.attack_updates("ipm", x, bad, 0.5, g)
    torch.testing.assert_close(ipm[bad], (-0.5 * honest.mean(0)).expand(2, -1))
    alie = attacks.attack_updates("alie", x, bad, None, g)
    s = math.floor(10 / 2 + 1) - 2
    z = torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor((10 - s) / 10, dtype=torch.float64))
    torch.testing.assert_close(alie[bad], (honest.mean(0) - z * honest.std(0, unbiased=False)).expand(2, -1))
    gauss = attacks.attack_updates("gaussian", x, bad, 10.0, g)
    rms = honest.square().mean().sqrt()
    assert 5 * rms < gauss[bad].std() < 15 * rms and torch.equal(gauss[~bad], x[~bad])
    assert attacks.attack_updates("label-flip", x, bad, None, g) is x
    assert attacks.attack_updates("sign-flip", x, torch.zeros(10, dtype=torch.bool), None, g) is x


def test_attackers_are_drawn_once_per_seed_and_label_flip_poisons_only_their_training_labels():
    a, b = attacks.malicious_clients(20, 0.2, 0), attacks.malicious_clients(20, 0.2, 0)
    assert torch.equal(a, b) and int(a.sum()) == 4
    assert not torch.equal(a, attacks.malicious_clients(20, 0.2, 1))
    d = datasets.load("digits")
    mask = attacks.malicious_clients(d.num_clients, 0.2, 0)
    p = attacks.label_flipped(d, mask)
    assert torch.equal(p.y[mask], d.num_classes - 1 - d.y[mask]) and torch.equal(p.y[~mask], d.y[~mask])
    assert p.x is d.x and torch.equal(p.test_y, d.test_y)


def test_an_identity_attack_leaves_the_run_exactly_as_without_attackers():
    """The attack's draws use a generator of their own: 'scale' by 1 is the honest update, and the whole run
    (sampling, minibatches, metrics) is the run without attackers, bit for bit."""
    base = dict(dataset="digits", algorithms=("fedavg",), rounds=4, participation=0.5, batch_size=16)
    plain = run(Config(**base))
    same = run(Config(**base, attack="scale", malicious=0.2, attack_scale=1.0))
    assert [r["train_loss"] for r in plain.rows] == [r["train_loss"] for r in same.rows]


def test_robust_rules_defend_digits_against_sign_flipping_clients():
    """20% of the clients send -4 x their update: FedAvg's model is ruined, median, Krum, Bulyan-free rules and a
    robust FedAdam learn (test accuracy after 20 rounds, printed)."""
    h = run(Config(dataset="digits", algorithms=("fedavg", "fedmedian", "krum", "fedtrimmedavg", "geomed",
                                                 "fedadam:aggregate=median"),
                   rounds=20, attack="sign-flip", malicious=0.2, attack_scale=4.0))
    acc = {a: h.series(a, "test_acc")[-1] for a in h.config.algorithms}
    print("test accuracy under sign-flip x4, 20% malicious:", {k: round(v, 3) for k, v in acc.items()})
    assert acc["fedavg"] < 0.3
    for name in ("fedmedian", "krum", "fedtrimmedavg", "geomed", "fedadam:aggregate=median"):
        assert acc[name] > acc["fedavg"] + 0.25, (name, acc)


def test_every_robust_algorithm_learns_on_digits_without_attackers():
    from fastagg.sim.algorithms import ROBUST

    h = run(Config(dataset="digits", algorithms=tuple(ROBUST), rounds=10, participation=0.5))
    for name in ROBUST:
        losses = h.series(name, "train_loss")
        assert losses[-1] < 0.8 * losses[0], (name, losses)
        assert h.series(name, "test_acc")[-1] > 0.4, name


@pytest.mark.parametrize("settings, text", [
    (dict(attack="sign-flip"), "needs a malicious fraction"),
    (dict(attack="sign-flop", malicious=0.2), r"did you mean sign-flip\?"),
    (dict(malicious=1.0, attack="scale"), "malicious must be a fraction"),
    (dict(algorithms=("krum:f=9",)), r"M > 2 num_malicious \+ 2 = 20; 5 clients left"),
    (dict(algorithms=("fedmedian:aggregate=krum",)), "contradicts"),
    (dict(algorithms=("fedavg:aggregate=mediam",)), r"did you mean median\?"),
    (dict(algorithms=("fedtrimmedavg:beta=0.5",)), r"beta must be in \[0, 0.5\)"),
])
def test_bad_attack_and_rule_settings_are_refused_before_any_work(settings, text):
    cfg = Config(**{**dict(dataset="digits", algorithms=("fedavg",), rounds=2), **settings})
    d = datasets.load("digits")
    with pytest.raises(ValueError, match=text):
        cfg = cfg.resolved(d)
        cfg.check(d)


def test_the_robustness_experiment_writes_its_table_and_plot(tmp_path):
    from fastagg.sim import robustness

    results = robustness.experiment(str(tmp_path), rounds=2, seeds=(0, 1), attacks=("none", "ipm"),
                                    rules=("fedavg", "fedmedian"))
    lines = robustness.table(results, rules=("fedavg", "fedmedian"))
    assert lines[0] == "| attack | fedavg | fedmedian |" and len(lines) == 4
    assert lines[3].startswith("| ipm | ") and lines[3].count("+-") == 2
    robustness.plot(results, str(tmp_path / "accuracy.png"), rules=("fedavg", "fedmedian"))
    assert (tmp_path / "accuracy.png").stat().st_size > 1000
    assert (tmp_path / "ipm" / "metrics.csv").exists()
