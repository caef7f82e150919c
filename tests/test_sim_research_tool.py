"""The simulator as a research tool (issue 21, first part): your own model without editing the library, a
per-round time without the warm-up, "did you mean" for misspelled flags and config keys, readable progress in
CI logs."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from fastagg.sim import Config, History, register_model, run
from fastagg.sim.runner import summary

SIM = [sys.executable, "-m", "fastagg.sim"]
MODELS = textwrap.dedent("""
    import torch

    def net(data):
        return torch.nn.Sequential(torch.nn.Linear(data.num_features, 16), torch.nn.Tanh(),
                                   torch.nn.Linear(16, data.num_classes))

    def conv(data):
        body = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.GroupNorm(2, 4), torch.nn.ReLU(),
                                   torch.nn.Flatten(), torch.nn.Linear(4 * 64, data.num_classes))
        return body, (1, 8, 8)

    def raises(data):
        raise RuntimeError("no GPU here")

    def wrong_logits(data):
        return torch.nn.Linear(data.num_features, 3)

    def with_batchnorm(data):
        return torch.nn.Sequential(torch.nn.Linear(data.num_features, 16), torch.nn.BatchNorm1d(16),
                                   torch.nn.Linear(16, data.num_classes))
""")


def sim(*args, cwd=None):
    return subprocess.run([*SIM, *args], capture_output=True, text=True, cwd=cwd, timeout=300)


@pytest.fixture
def user_dir(tmp_path):
    (tmp_path / "mymodels.py").write_text(MODELS)
    return tmp_path


def test_your_own_model_from_the_command_line_runs_records_and_resumes(user_dir, monkeypatch):
    base = ["--dataset", "digits", "--algorithm", "fedavg", "--model", "mymodels:conv", "--rounds", "6"]
    r = sim(*base, "--out", "whole", cwd=user_dir)
    assert r.returncode == 0, r.stderr
    assert json.loads((user_dir / "whole" / "config.json").read_text())["model"] == "mymodels:conv"
    # the same run stopped after round 3 (as Ctrl-C stops it), then resumed from the command line
    from fastagg.sim import runner

    def stop(algorithm, seed, t, total, loss):
        if t == 3:
            raise KeyboardInterrupt
    monkeypatch.chdir(user_dir)
    monkeypatch.setattr(runner, "_progress", stop)
    h = run(Config(dataset="digits", algorithms=("fedavg",), model="mymodels:conv", rounds=6, out="part"),
            verbose=True)
    assert h.stopped
    r = sim("--resume", "--out", "part", cwd=user_dir)  # the folder alone names the factory: not imported
    assert r.returncode == 2 and "pass --model mymodels:conv beside --resume" in r.stderr, r.stderr
    r = sim("--resume", "--out", "part", "--model", "mymodels:conv", cwd=user_dir)
    assert r.returncode == 0, r.stderr
    losses = [[line.split(",")[3] for line in (user_dir / d / "metrics.csv").read_text().splitlines()[1:]]
              for d in ("whole", "part")]
    assert len(losses[0]) == 7 and losses[0] == losses[1]  # the seeded factory builds the same model each time


def test_register_model_equals_the_module_factory_form(user_dir, monkeypatch):
    monkeypatch.syspath_prepend(str(user_dir))
    import mymodels

    register_model("my-net", mymodels.net)
    a = run(Config(dataset="digits", algorithms=("fedavg",), model="my-net", rounds=3))
    monkeypatch.chdir(user_dir)
    b = run(Config(dataset="digits", algorithms=("fedavg",), model="mymodels:net", rounds=3))
    assert a.series("fedavg", "train_loss") == b.series("fedavg", "train_loss")
    with pytest.raises(ValueError, match="not built in"):
        register_model("mlp", mymodels.net)


@pytest.mark.parametrize("model, text", [
    ("mymodels:with_batchnorm", "layer '1' (BatchNorm1d) keeps running statistics"),
    ("mymodels:nope", "mymodels has no callable 'nope'"),
    ("nomodule:net", "cannot import 'nomodule'"),
    ("mymodels:raises", "the factory raised RuntimeError: no GPU here"),
    ("mymodels:wrong_logits", "it returns (2, 3) for 2 samples; expected (2, 10) logits"),
])
def test_a_model_that_cannot_run_batched_is_one_line(user_dir, model, text):
    r = sim("--dataset", "digits", "--model", model, "--rounds", "1", "--out", "run", cwd=user_dir)
    assert r.returncode == 2 and text in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (user_dir / "run").exists()


def test_the_summary_leaves_the_first_round_out_of_the_time_per_round():
    """The arithmetic of the summary on recorded rows (no clock is read): each seed's first row after round 0 is
    left out, the later rows' seconds are divided by the rounds they cover."""
    from fastagg.sim.runner import _steady_time

    rows = [dict(algorithm="a", seed=0, round=t, train_loss=1.0, train_loss_last=1.0, test_loss=0.0, test_acc=0.0,
                 eta=1.0, seconds=[0.0, 50.0, 1.0, 2.0, 3.0][t], eval_seconds=0.0) for t in range(5)]
    assert _steady_time(rows, [0]) == (6.0, 3)
    assert summary(History(Config(rounds=4), rows, None, {"a": 4}))[0]["seconds_per_round"] == 2.0
    assert _steady_time(rows[:2], [0]) == (50.0, 1)  # one timed row: counted whole


def test_misspelled_flags_and_config_keys_get_a_suggestion(tmp_path):
    r = sim("--dataset", "quadratic", "--lrr", "0.1")
    assert r.returncode == 2 and "--lrr (did you mean --lr" in r.stderr
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"rounds": 2, "seed": [0]}))
    r = sim("--config", str(cfg))
    assert r.returncode == 2 and "seed (did you mean seeds?)" in r.stderr


def test_progress_in_a_log_is_whole_lines():
    r = sim("--dataset", "quadratic", "--algorithm", "fedavg", "--rounds", "100")
    assert r.returncode == 0 and "\r" not in r.stderr and "\r" not in r.stdout
    lines = [line for line in r.stderr.splitlines() if "round" in line]
    assert 40 <= len(lines) <= 60 and lines[-1].startswith("fedavg seed 0: round 100/100")


def test_a_finished_run_is_extended_by_resume_with_more_rounds(tmp_path):
    """4 rounds, then --resume --rounds 8: every (algorithm, seed) continues from its final state (kept once, at
    its finish) and the metrics equal an 8-round run's exactly; fewer rounds are refused."""
    common = ["--dataset", "digits", "--algorithm", "fedavg,fedexp", "--seeds", "0,1"]
    assert sim(*common, "--rounds", "4", "--out", str(tmp_path / "ext")).returncode == 0
    r = sim("--resume", "--out", str(tmp_path / "ext"), "--rounds", "8")
    assert r.returncode == 0, r.stderr
    assert sim(*common, "--rounds", "8", "--out", str(tmp_path / "direct")).returncode == 0

    def losses(folder):
        import csv

        with open(tmp_path / folder / "metrics.csv") as f:
            return {(row["algorithm"], row["seed"], row["round"]): row["train_loss"] for row in csv.DictReader(f)}
    assert losses("ext") == losses("direct") and len(losses("ext")) == 2 * 2 * 9
    assert json.loads((tmp_path / "ext" / "config.json").read_text())["rounds"] == 8
    shorter = sim("--resume", "--out", str(tmp_path / "ext"), "--rounds", "3")
    assert shorter.returncode == 2 and "cannot shorten" in shorter.stderr
    other = sim("--resume", "--out", str(tmp_path / "ext"), "--lr", "0.5")
    assert other.returncode == 2 and "would change them: lr" in other.stderr


def test_an_extension_refuses_a_tampered_final_state(tmp_path):
    out = tmp_path / "ext"
    run(Config(dataset="digits", algorithms=("fedavg",), rounds=3, out=str(out)))
    state = torch.load(out / "final-0-0.pt", weights_only=True)
    state["params"] = torch.zeros(3)
    torch.save(state, out / "final-0-0.pt")
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    with pytest.raises(ValueError, match="params are"):
        run(Config(out=str(out), rounds=5), resume=True)
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before, "checked before any write"


def test_yaml_and_toml_configs_with_per_algorithm_sections(tmp_path):
    (tmp_path / "runs.yaml").write_text("dataset: quadratic\nalgorithms: [fedavg, fedexp]\nrounds: 3\n"
                                        "fedavg:\n  server_lr: 2\n  lr: 0.05\n")
    (tmp_path / "runs.toml").write_text('dataset = "quadratic"\nalgorithms = ["fedavg", "fedexp"]\nrounds = 3\n'
                                        "[fedavg]\nserver_lr = 2\nlr = 0.05\n")
    for name in ("runs.yaml", "runs.toml"):
        r = sim("--config", str(tmp_path / name), "--out", str(tmp_path / name.replace(".", "-")))
        assert r.returncode == 0, r.stderr
        saved = json.loads((tmp_path / name.replace(".", "-") / "config.json").read_text())
        assert saved["algorithms"] == ["fedavg:server_lr=2:lr=0.05", "fedexp"]
    direct = run(Config(dataset="quadratic", algorithms=("fedavg:server_lr=2:lr=0.05",), rounds=3))
    from_yaml = (tmp_path / "runs-yaml" / "metrics.csv").read_text().splitlines()
    assert [f"{v!r}" for v in direct.series("fedavg:server_lr=2:lr=0.05", "train_loss")] == \
        [line.split(",")[3] for line in from_yaml[1:] if line.startswith("fedavg")]


@pytest.mark.parametrize("text, error", [
    ("algorithms: [fedavg]\nfedavg:\n  lrr: 1\n", "section 'fedavg': unknown setting 'lrr' (did you mean lr?)"),
    ("algorithms: [fedavg]\nfedexp:\n  eps: 1\n", "section 'fedexp' is not an entry of algorithms"),
    ("algorithms: [fedavg]\nfedavg:\n  lr: [1, 2]\n", "section 'fedavg': lr must be a number or a word"),
    ("- just\n- a list\n", "must hold a mapping of settings"),
    ("rounds: [2\n", "cannot read --config"),
])
def test_bad_yaml_configs_are_one_line(tmp_path, text, error):
    (tmp_path / "c.yaml").write_text(text)
    r = sim("--config", str(tmp_path / "c.yaml"))
    assert r.returncode == 2 and error in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_yaml_config_without_pyyaml_names_the_extra(tmp_path):
    (tmp_path / "c.yaml").write_text("rounds: 2\n")
    code = ("import sys; sys.modules['yaml'] = None\nfrom fastagg.sim.__main__ import main\n"
            f"sys.exit(main(['--config', {str(tmp_path / 'c.yaml')!r}]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "a YAML --config needs yaml" in r.stderr and "'.[sim]'" in r.stderr, r.stderr


def test_an_extension_never_reads_through_a_planted_link(tmp_path):
    out = tmp_path / "ext"
    run(Config(dataset="quadratic", algorithms=("fedavg",), rounds=3, out=str(out)))
    (out / "final-0-0.pt").unlink()
    (out / "final-0-0.pt").symlink_to("/dev/zero")
    r = sim("--resume", "--out", str(out), "--rounds", "5")
    assert r.returncode == 2 and "a symbolic link" in r.stderr, r.stderr


@pytest.mark.parametrize("scope, model_varies, split_varies", [("all", True, True), ("model", True, False),
                                                               ("sampling", False, False)])
def test_seed_scope_says_what_a_seed_varies(scope, model_varies, split_varies):
    """--seeds gives "mean +- std over seeds" its usual meaning by default (scope "all": a seed draws the clients
    sampled, the minibatches, the initial model and the data split); "model" keeps the split, "sampling" keeps both
    (fastagg's behaviour before, and what a run saved then resumes with)."""
    from fastagg.sim import data as datasets
    from fastagg.sim import models
    from fastagg.sim.runner import seeded_data

    cfg = Config(dataset="digits", model="mlp", algorithms=("fedavg",), rounds=1, seeds=(0, 1), seed_scope=scope)
    base = datasets.load("digits")
    cfg = cfg.resolved(base)
    other = seeded_data(cfg, base, 1)
    assert (not torch.equal(other.x, base.x) or not torch.equal(other.counts, base.counts)) == split_varies
    assert seeded_data(cfg, base, 0) is base
    h = run(cfg)
    first = {r["seed"]: r["train_loss"] for r in h.rows if r["round"] == 0}
    assert (first[0] != first[1]) == (model_varies or split_varies), first
    w0 = models.make("mlp", base, seed=0).init(torch.float64, "cpu")
    assert not torch.equal(w0, models.make("mlp", base, seed=1).init(torch.float64, "cpu"))


def test_seed_scope_is_recorded_and_a_run_saved_before_it_resumes_as_it_ran(tmp_path):
    out = tmp_path / "run"
    r = subprocess.run([*SIM, "--dataset", "synthetic", "--algorithm", "fedavg", "--rounds", "2", "--seeds", "0,1",
                        "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    saved = json.loads((out / "config.json").read_text())
    assert saved["seed_scope"] == "all"
    from fastagg.sim.runner import saved_config

    del saved["seed_scope"]  # a run folder written before the setting existed
    (out / "config.json").write_text(json.dumps(saved))
    assert saved_config(str(out))["seed_scope"] == "sampling"
    from fastagg.sim import data as datasets

    with pytest.raises(ValueError, match="seed_scope must be one of"):
        Config(dataset="synthetic", algorithms=("fedavg",), seed_scope="everything").resolved(
            datasets.load("synthetic")).check()
    assert "--seed-scope" in subprocess.run([*SIM, "--help"], capture_output=True, text=True).stdout
