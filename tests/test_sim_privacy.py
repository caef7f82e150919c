"""The simulator's --dp: every mechanism runs in any algorithm's server step, epsilon is reported after every round
(metrics, summary, plot) from dp-accounting, the clients clip their own updates in the client-side modes, a run
resumed from its checkpoint continues the same noise stream and account, and bad specs fail before any work."""
from __future__ import annotations

import csv
import math

import dp_accounting  # noqa: F401  (a test requirement, pinned in [test]: a missing one fails here)
import pytest
import torch

from fastagg import privacy
from fastagg.sim import Config, run
from fastagg.sim import privacy as sim_privacy

BASE = dict(dataset="digits", rounds=4, participation=0.5, batch_size=16)


@pytest.mark.parametrize("spec", ["server-fixed:clip=1.0,z=0.8", "server-adaptive:clip=0.5,z=0.8,quantile=0.5",
                                  "client-fixed:clip=1.0,z=0.8", "client-adaptive:clip=0.5,z=0.8"])
def test_every_mechanism_runs_and_reports_a_growing_epsilon(spec):
    h = run(Config(**BASE, algorithms=("fedavg", "fedadam"), dp=spec))
    for alg in ("fedavg", "fedadam"):
        eps = [r["epsilon"] for r in h.rows if r["algorithm"] == alg]
        assert eps[0] == 0.0 and all(b > a for a, b in zip(eps, eps[1:])), eps
        assert all(math.isfinite(r["train_loss"]) for r in h.rows)
    # the accountant's figure for 4 sampled-without-replacement releases, as dp-accounting computes it
    from fastagg.sim import data as datasets

    n = datasets.load("digits").num_clients
    acc = privacy.PrivacyAccountant(0.8, sampling="without-replacement", population_size=n,
                                    num_sampled=max(1, round(0.5 * n)))
    acc.step(4)
    assert h.rows[-1]["epsilon"] == pytest.approx(acc.epsilon())


def test_no_noise_server_fixed_with_a_large_clip_is_the_plain_run():
    plain = run(Config(**BASE, algorithms=("fedavg",)))
    dp = run(Config(**BASE, algorithms=("fedavg",), dp="server-fixed:clip=1e9,z=0", weighting="uniform"))
    uniform = run(Config(**BASE, algorithms=("fedavg",), weighting="uniform"))
    torch.testing.assert_close(torch.tensor([r["train_loss"] for r in dp.rows]),
                               torch.tensor([r["train_loss"] for r in uniform.rows]), rtol=1e-5, atol=1e-6)
    assert plain.rows[0]["train_loss"] == dp.rows[0]["train_loss"]
    assert all(r["epsilon"] == math.inf for r in dp.rows)  # z = 0: no privacy


def test_client_side_clipping_happens_on_the_clients(monkeypatch):
    from fastagg import client

    seen = []
    real = client.clip_updates

    def spy(models, base, max_norm, **kw):
        norms, clipped = real(models, base, max_norm, **kw)
        seen.append(((models - base).double().norm(dim=1).max().item(), max_norm))
        return norms, clipped

    monkeypatch.setattr(client, "clip_updates", spy)
    run(Config(**BASE, algorithms=("fedavg",), dp="client-fixed:clip=0.05,z=0.5"))
    assert len(seen) == 4 and all(top <= c * (1 + 1e-5) for top, c in seen)


def test_resume_continues_the_noise_stream_and_the_account(tmp_path):
    spec = "server-adaptive:clip=0.3,z=0.8"
    whole = run(Config(**BASE, algorithms=("fedavg",), dp=spec))
    out = str(tmp_path / "run")
    run(Config(**{**BASE, "rounds": 2}, algorithms=("fedavg",), dp=spec, out=out))
    resumed = run(Config(**BASE, algorithms=("fedavg",), dp=spec, out=out), resume=True)
    assert [r["train_loss"] for r in resumed.rows] == [r["train_loss"] for r in whole.rows]
    assert [r["epsilon"] for r in resumed.rows] == pytest.approx([r["epsilon"] for r in whole.rows])
    with open(tmp_path / "run" / "metrics.csv") as f:
        assert next(csv.reader(f))[-1] == "epsilon"
    assert (tmp_path / "run" / "epsilon.png").exists()


@pytest.mark.parametrize("spec,match", [
    ("laplace:clip=1", "kind"), ("server-fixed:clip=-1,z=1", "clipping_norm"),
    ("server-fixed:clip=1,z=nan", "noise_multiplier"), ("server-fixed:clip", "key=value"),
    ("server-fixed:clip=1,z=1,quantile=0.5", "adaptive"), ("server-fixed:clip=x,z=1", "float"),
    ("server-adaptive:clip=1,z=1,quantile=2", "quantile"), ("client-fixed:clip=1,z=1,delta=2", "delta"),
])
def test_bad_specs_fail_before_any_work(spec, match):
    with pytest.raises(ValueError, match=match):
        run(Config(**BASE, algorithms=("fedavg",), dp=spec))


def test_dp_with_a_robust_rule_is_refused():
    with pytest.raises(ValueError, match="robust"):
        run(Config(**BASE, algorithms=("fedavg:aggregate=median",), dp="server-fixed:clip=1,z=1"))


def test_spec_parsing():
    s = sim_privacy.parse("client-adaptive:clip=0.2,z=1.5,quantile=0.7,lr=0.1,count_std=3,delta=1e-6,seed=9")
    assert (s.kind, s.clip, s.z, s.quantile, s.lr, s.count_std, s.delta, s.seed) == \
        ("client-adaptive", 0.2, 1.5, 0.7, 0.1, 3.0, 1e-6, 9)
    assert s.client_side


def test_the_privacy_tradeoff_experiment_writes_its_table_and_plot(tmp_path, monkeypatch):
    from fastagg.sim import privacy_tradeoff as pt

    monkeypatch.setattr(pt, "Z", (0.0, 1.0))
    assert pt.main(["--out", str(tmp_path), "--rounds", "2", "--seeds", "0"]) == 0
    text = (tmp_path / "PRIVACY.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert [r.split("|")[1].strip() for r in rows[1:]] == ["no DP", "z = 0", "z = 1"]
    assert "inf (no noise)" in rows[2] and float(rows[3].split("|")[2]) > 0
    assert (tmp_path / "accuracy_vs_epsilon.png").stat().st_size > 1000
