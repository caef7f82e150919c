"""The simulator as a research tool: every default in --help, per-algorithm settings in one run, the data set's
per-algorithm paper settings, the summary table and summary.csv, TOML configs, npz test
splits and clear messages for labels out of range or a diverging lr, and FedMaSS synchronized as its paper does."""
from __future__ import annotations

import csv
import math

import numpy as np
import pytest
import torch

from fastagg import client
from fastagg.sim import __main__ as cli, algorithms, data as datasets, models
from fastagg.sim.runner import Config, _local_steps, run, run_one, summary

from test_sim_files import QUICK, _one_line_error, sim


def test_help_shows_every_default():
    text = " ".join(cli.parser().format_help().split())
    for action in cli.parser()._actions:
        if not action.option_strings or action.dest == "help" or action.const is True:
            continue
        flag = action.option_strings[-1]
        start = text.index(flag, text.index("options:"))
        following = [text.find(f" {a.option_strings[-1]} ", start + len(flag)) for a in cli.parser()._actions
                     if a.option_strings and a.option_strings[-1] != flag]
        end = min([i for i in following if i > start] + [len(text)])
        assert "default" in text[start:end], f"{flag} does not show its default: {text[start:end]!r}"


def test_algorithm_specs_parse_and_refuse_what_they_cannot_set():
    assert algorithms.parse_spec("fedavg:server_lr=10:local-steps=3") == ("fedavg", {"server_lr": 10.0,
                                                                                     "local_steps": 3})
    assert algorithms.parse_spec("fedexp") == ("fedexp", {})
    for spec, text in [("fedbogus", "unknown algorithm"), ("fedavg:rounds=3", "a setting of the whole run"),
                       ("fedavg:server_lr", "is not key=value"), ("fedavg:server_lr=ten", "is not a number"),
                       ("fedavg:local_steps=2.5", "is not an integer"), ("fedavg:lr=1:lr=2", "given twice")]:
        with pytest.raises(ValueError, match=text):
            algorithms.parse_spec(spec)
    with pytest.raises(ValueError, match="fedavg:lr=-1: lr must be a finite number >= 0"):
        run(Config(dataset="quadratic", algorithms=("fedavg:lr=-1",), rounds=1))
    with pytest.raises(ValueError, match="given twice"):
        run(Config(dataset="quadratic", algorithms=("fedavg", "fedavg"), rounds=1))


def test_per_algorithm_settings_equal_a_run_with_that_setting():
    both = run(Config(dataset="synthetic", algorithms=("fedavg:server_lr=0.5:lr=0.02", "fedavg"), rounds=3))
    alone = run(Config(dataset="synthetic", algorithms=("fedavg",), server_lr=0.5, lr=0.02, rounds=3))
    plain = run(Config(dataset="synthetic", algorithms=("fedavg",), rounds=3))
    assert both.series("fedavg:server_lr=0.5:lr=0.02", "train_loss") == alone.series("fedavg", "train_loss")
    assert both.series("fedavg", "train_loss") == plain.series("fedavg", "train_loss")
    assert both.series("fedavg", "train_loss") != alone.series("fedavg", "train_loss")


def test_fedexp_linreg_runs_fedavg_with_the_papers_server_lr():
    default = run(Config(dataset="fedexp-linreg", algorithms=("fedavg", "fedavg:server_lr=1"), rounds=5))
    ten = run(Config(dataset="fedexp-linreg", algorithms=("fedavg",), server_lr=10.0, rounds=5))
    assert default.series("fedavg", "train_loss") == ten.series("fedavg", "train_loss")
    assert default.series("fedavg", "eta")[1:] == [10.0] * 5
    assert default.series("fedavg:server_lr=1", "eta")[1:] == [1.0] * 5


def test_summary_table_and_csv_match_the_metrics(tmp_path):
    out = tmp_path / "run"
    res = sim("--dataset", "digits", "--algorithm", "fedavg,fedexp", "--rounds", "4", "--seeds", "0,1",
              "--target", "1.5", "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert "rounds to loss <= 1.5" in res.stdout and "test accuracy" in res.stdout
    rows = list(csv.DictReader(open(out / "metrics.csv")))
    table = list(csv.DictReader(open(out / "summary.csv")))
    assert [r["algorithm"] for r in table] == ["fedavg", "fedexp"]
    for t in table:
        mine = [r for r in rows if r["algorithm"] == t["algorithm"]]
        finals = [float([r for r in mine if r["seed"] == s][-1]["train_loss"]) for s in ("0", "1")]
        accs = [float([r for r in mine if r["seed"] == s][-1]["test_acc"]) for s in ("0", "1")]
        assert float(t["train_loss_mean"]) == pytest.approx(np.mean(finals), rel=1e-12)
        assert float(t["train_loss_std"]) == pytest.approx(np.std(finals), rel=1e-9, abs=1e-15)
        assert float(t["test_acc_mean"]) == pytest.approx(np.mean(accs), rel=1e-12)
        reached = [next((int(r["round"]) for r in mine if r["seed"] == s and float(r["train_loss"]) <= 1.5), None)
                   for s in ("0", "1")]
        reached = [r for r in reached if r is not None]
        assert int(t["seeds_reaching_target"]) == len(reached)
        if reached:
            assert float(t["rounds_to_target_mean"]) == pytest.approx(np.mean(reached))
    for png in ("loss.png", "accuracy.png", "eta.png"):
        assert (out / png).stat().st_size > 1000


def test_summary_without_target_or_test_set():
    h = run(Config(dataset="quadratic", algorithms=("fedavg",), rounds=2))
    (row,) = summary(h)
    assert row["seeds_reaching_target"] == "" and math.isnan(row["rounds_to_target_mean"])
    assert math.isnan(row["test_acc_mean"]) and row["rounds"] == 2


def test_toml_config_is_read_and_unknown_keys_refused(tmp_path):
    good = tmp_path / "run.toml"
    good.write_text('dataset = "quadratic"\nalgorithms = ["fedavg:server_lr=0.5", "fedexp"]\nrounds = 2\n'
                    'seeds = [0, 1]\n')
    res = sim("--config", str(good), "--out", str(tmp_path / "out"))
    assert res.returncode == 0, res.stderr
    table = list(csv.DictReader(open(tmp_path / "out" / "summary.csv")))
    assert [r["algorithm"] for r in table] == ["fedavg:server_lr=0.5", "fedexp"] and table[0]["seeds"] == "2"
    bad = tmp_path / "bad.toml"
    bad.write_text('rounds = 2\nlearning_rate = 0.1\n')
    _one_line_error(sim(*QUICK, "--config", str(bad)), "unknown settings learning_rate")
    broken = tmp_path / "broken.toml"
    broken.write_text('rounds = = 2\n')
    _one_line_error(sim(*QUICK, "--config", str(broken)), "cannot read --config")


def test_npz_test_split_is_evaluated_and_bad_labels_are_named(tmp_path):
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(120, 4)), rng.integers(0, 3, 120)
    np.savez(tmp_path / "ok.npz", x=x, y=y, x_test=x[:40], y_test=y[:40])
    h = run(Config(dataset=f"npz:{tmp_path / 'ok.npz'}", algorithms=("fedavg",), rounds=2))
    acc = h.series("fedavg", "test_acc")
    assert all(0 <= a <= 1 for a in acc)
    d = datasets.load(f"npz:{tmp_path / 'ok.npz'}")
    model = models.make("softmax", d)
    w = torch.zeros(model.dim, dtype=torch.float64)
    _, acc0 = model.test_metrics(w, d.test_x, d.test_y)
    assert h.series("fedavg", "test_acc")[0] == pytest.approx(float(acc0))
    for arrays, text in [
        (dict(x=x, y=y, x_test=x[:5], y_test=np.r_[y[:4], 9], num_classes=np.int64(3)),
         "'y_test' holds class label 9, out of range for num_classes = 3"),
        (dict(x=x, y=np.r_[y[:-1], 5], num_classes=np.int64(3)), "'y' holds class label 5, out of range"),
        (dict(x=x, y=y, x_test=x[:5]), "only one of 'x_test' and 'y_test'"),
        (dict(x=x, y=y, x_test=x[:5, :2], y_test=y[:5]), "'x_test' has 2 features per sample, 'x' 4"),
        (dict(x=x, y=y, x_test=x[:5], y_test=y[:5].astype(float)), "'y_test' has dtype float64 but 'y' int64"),
        (dict(x=x, y=y, num_classes=np.array([3, 4])), "'num_classes' must be one integer"),
    ]:
        np.savez(tmp_path / "bad.npz", **arrays)
        with pytest.raises(ValueError, match=text):
            datasets.load(f"npz:{tmp_path / 'bad.npz'}")


def test_regression_targets_and_features_that_make_the_lr_diverge_get_a_clear_message(tmp_path):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(200, 5)) * 30
    np.savez(tmp_path / "big.npz", x=x, y=x @ rng.normal(size=5))
    _one_line_error(sim("--dataset", f"npz:{tmp_path / 'big.npz'}", "--rounds", "2"),
                    "local lr 0.05 diverges")
    with pytest.raises(ValueError, match=r"Pass --lr below"):
        run(Config(dataset=f"npz:{tmp_path / 'big.npz'}", algorithms=("fedavg",), rounds=2, batch_size=0))
    # the same data scaled down runs, and the regression test split gives a finite test loss
    xs = x / 30
    np.savez(tmp_path / "ok.npz", x=xs, y=xs @ rng.normal(size=5), x_test=xs[:20], y_test=xs[:20] @ np.ones(5))
    h = run(Config(dataset=f"npz:{tmp_path / 'ok.npz'}", algorithms=("fedavg",), rounds=3))
    assert all(math.isfinite(v) for v in h.series("fedavg", "test_loss"))
    # the limit is where a step stops expanding the error: just below it a run is allowed, just above refused
    d = datasets.load(f"npz:{tmp_path / 'ok.npz'}")
    limit = models.make("linear", d).max_stable_lr(0)
    run(Config(dataset=f"npz:{tmp_path / 'ok.npz'}", algorithms=("fedavg",), rounds=1, batch_size=0,
               lr=0.99 * limit))
    with pytest.raises(ValueError, match="diverges"):
        run(Config(dataset=f"npz:{tmp_path / 'ok.npz'}", algorithms=("fedavg",), rounds=1, batch_size=0,
                   lr=1.01 * limit))


def _paper_fedmass(data, model, rounds, steps, lr, gam, eta2):
    """Paper 004's FedMaSS, written from its equations (App. G) for full participation and full batches: every
    client keeps w_k and u_k; at the last step of a round w_{t+1} = sum_k p_k (u_k - eta1 g_k) for every k."""
    n = data.num_clients
    p = data.counts.double() / data.counts.sum()
    w0 = torch.zeros(model.dim, dtype=torch.float64)
    w, u = w0.expand(n, -1).clone(), w0.expand(n, -1).clone()
    mask = (torch.arange(data.x.shape[1])[None, :] < data.counts[:, None]).double()
    for _ in range(rounds):
        for k in range(steps):
            _, g = model.loss_grad(u, data.x, data.y, mask)
            w_next = u - lr * g
            if k == steps - 1:
                w_next = (p[:, None] * w_next).sum(0).expand(n, -1).clone()
            u = w_next + gam * (w_next - w) + eta2 * g
            w = w_next
    return w[0]


def test_fedmass_averages_w_as_its_paper_does():
    data = datasets.synthetic(num_clients=4)
    cfg = Config(dataset="synthetic", algorithms=("fedmass",), model="softmax", participation=1.0, batch_size=0,
                 local_steps=3, lr=0.05, rounds=4, mass_gam=0.3, mass_eta2=0.05, dtype="float64").resolved(data)
    d = data.to("cpu", torch.float64)
    snaps = []
    run_one(cfg, data, "fedmass", 0, on_round=snaps.append)
    expected = _paper_fedmass(d, models.make("softmax", d), 4, 3, 0.05, 0.3, 0.05)
    torch.testing.assert_close(snaps[-1]["params"], expected, rtol=1e-12, atol=1e-14)
    # averaging u instead is a different trajectory (the earlier reading), and with eta2 = 0 it is Nesterov FedAvg
    snaps_u = []
    run_one(Config(**{**cfg.__dict__, "mass_average": "u"}), data, "fedmass", 0, on_round=snaps_u.append)
    assert (snaps_u[-1]["params"] - expected).abs().max() > 1e-4
    nest, mass_u = [], []
    base = {**cfg.__dict__, "mass_eta2": 0.0, "nesterov_momentum": 0.3, "mass_average": "u"}
    run_one(Config(**base), data, "nesterov-fedavg", 0, on_round=nest.append)
    run_one(Config(**base), data, "fedmass", 0, on_round=mass_u.append)
    torch.testing.assert_close(nest[-1]["params"], mass_u[-1]["params"], rtol=0, atol=0)


def test_fedmass_w_sync_keeps_a_skipped_clients_state_stale_and_a_new_client_starts_at_the_model():
    data = datasets.synthetic(num_clients=3).to("cpu", torch.float64)
    cfg = Config(dataset="synthetic", algorithms=("fedmass",), model="softmax", batch_size=0, local_steps=2,
                 lr=0.05, mass_gam=0.3, dtype="float64").resolved(data)
    model = models.make("softmax", data)
    alg = algorithms.resolve("fedmass", cfg)
    state = client.ClientState(3, model.dim, dtype=torch.float64)
    wbar = torch.zeros(model.dim, dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    w_first = _local_steps(alg, cfg, model, data, torch.tensor([0, 1]), wbar, state, 0.05, gen)
    untouched = state.vector("mass")[2].clone(), state.vector("momentum")[2].clone()
    assert float(state.scalar("mass_started")[2]) == 0 and untouched[0].abs().max() == 0
    offset0 = state.vector("momentum")[0].clone()
    assert offset0.abs().max() > 0 and torch.equal(state.vector("mass")[:2], w_first)
    wbar = w_first.mean(0)
    _local_steps(alg, cfg, model, data, torch.tensor([1, 2]), wbar, state, 0.05, gen)
    assert torch.equal(state.vector("momentum")[0], offset0)  # client 0 skipped: its offset is stale, kept


def test_eval_every_keeps_the_trajectory():
    """Evaluating every 3rd round (and the last) leaves the training trajectory exactly as evaluating every round."""
    every = run(Config(dataset="synthetic", algorithms=("fedexp",), rounds=7))
    sparse = run(Config(dataset="synthetic", algorithms=("fedexp",), rounds=7, eval_every=3))
    assert [r["round"] for r in sparse.rows] == [0, 3, 6, 7]
    by_round = {r["round"]: r for r in every.rows}
    for r in sparse.rows:
        assert r["train_loss"] == by_round[r["round"]]["train_loss"]
    with pytest.raises(ValueError, match="eval_every must be an integer >= 1"):
        run(Config(dataset="synthetic", algorithms=("fedexp",), rounds=2, eval_every=0))


def test_small_cnn_takes_three_channel_images():
    d = datasets.cifar_synthetic(num_clients=60, per_client=4, test_size=10)
    model = models.make("cnn", d)
    assert model.input_shape == (3, 32, 32) and model.dim == 3 * 8 * 9 + 8 + 8 * 16 * 16 * 10 + 10
    with pytest.raises(ValueError, match="square images of 1 or 3 channels"):
        models.make("cnn", datasets.synthetic(num_clients=3))


def test_cuda_graphs_are_used_only_on_cuda_for_stateless_client_rules():
    """--no-cuda-graph turns the graphed local step off; on the CPU, or for a client rule with per-client state,
    steps run eagerly whatever the setting (the graphed path itself is checked on a GPU: test_on_device.py)."""
    from fastagg.sim.runner import step_graphs_for

    a = cli.parser().parse_args(["--no-cuda-graph"])
    assert cli._config(a, ["--no-cuda-graph"])[0].cuda_graph is False
    assert cli._config(cli.parser().parse_args([]), [])[0].cuda_graph is True
    cfg = Config(algorithms=("fedavg",))
    for name, device in [("fedavg", "cpu"), ("nesterov-fedavg", "cuda"), ("fedmass", "cuda")]:
        alg = algorithms.resolve(name, cfg)
        assert step_graphs_for(alg, cfg, None, torch.device(device)) is None
    assert step_graphs_for(algorithms.resolve("fedavg", cfg), Config(cuda_graph=False), None,
                           torch.device("cuda")) is None
