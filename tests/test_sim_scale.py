"""The simulator at scale and as a user meets it: evaluation in bounded chunks on a fixed sample of the clients'
data, checkpoints that cost O(state) (metrics are appended, the checkpoint counts them), a summary that never
averages an unfinished seed with finished ones, and the command-line traps a newcomer hit."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from fastagg.sim import data as datasets, models, outdir
from fastagg.sim.runner import METRIC_FIELDS, Config, History, format_summary, run, summary

SIM = [sys.executable, "-m", "fastagg.sim"]


def sim(*args, cwd=None):
    return subprocess.run([*SIM, *args], capture_output=True, text=True, cwd=cwd, timeout=300)


# -- evaluation ------------------------------------------------------------------------------------------------------

def test_the_evaluation_sample_is_fixed_uniform_and_bounded():
    d = datasets.load("synthetic")
    full_x, _ = d.samples()
    assert len(full_x) == d.num_samples == 22349  # the default limit keeps every paper data set whole
    a, b = d.with_eval_limit(1000), d.with_eval_limit(1000)
    xa, ya = a.samples()
    assert xa.shape == (1000, d.num_features) and torch.equal(xa, b.samples()[0]) and torch.equal(ya, b.samples()[1])
    rows = {tuple(r.tolist()): i for i, r in enumerate(full_x)}
    where = [rows[tuple(r.tolist())] for r in xa]  # real samples, never padding, in the clients' order
    assert where == sorted(where) and where[-1] > 0.9 * len(full_x), "spread over all clients, not the first ones"
    assert d.with_eval_limit(30_000).samples()[0].shape == full_x.shape


@pytest.mark.parametrize("model_name", ["softmax", "mlp", "cnn"])
def test_chunked_evaluation_equals_one_pass(model_name):
    d = datasets.load("digits").to("cpu", torch.float64)
    model = models.make(model_name, d)
    w = model.init(torch.float64, "cpu") if hasattr(model, "init") else 0.01 * torch.randn(model.dim, dtype=torch.float64)
    x, y = d.samples()
    one = model._metrics(w, x, y)
    chunked = models.chunked_metrics(model._metrics, w, x, y, 100)  # 15 chunks, the last one short
    assert torch.allclose(one[0], chunked[0], rtol=1e-12) and torch.allclose(one[1], chunked[1], rtol=1e-12)


def test_cifar_synthetic_evaluates_a_sample_in_chunks_and_training_dominates(tmp_path):
    """The README's cifar-synthetic command on the CPU: it was killed at round 0 (23 GB: one forward pass over
    50,000 images). Now round 0 evaluates 2,000 training images and the test set, 256 at a time."""
    r = sim("--dataset", "cifar-synthetic", "--algorithm", "fedavg", "--rounds", "1", "--clients", "200",
            "--out", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr
    rows = (tmp_path / "run" / "metrics.csv").read_text().splitlines()
    assert len(rows) == 3
    cfg = json.loads((tmp_path / "run" / "config.json").read_text())
    assert cfg["eval_samples"] == 2000 and cfg["eval_every"] == 1
    last = dict(zip(METRIC_FIELDS, rows[-1].split(",")))
    print(f"cifar-synthetic, 200 clients: round {float(last['seconds']):.2f} s, evaluation "
          f"{float(last['eval_seconds']):.2f} s")


# -- checkpoints cost O(state) ---------------------------------------------------------------------------------------

def test_the_checkpoint_holds_the_state_not_the_metrics(tmp_path):
    sizes = {}
    for rounds in (20, 400):
        out = tmp_path / f"r{rounds}"
        run(Config(dataset="quadratic", algorithms=("fedavg",), rounds=rounds, out=str(out)))
        ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
        assert "rows" not in ckpt and ckpt["rows_written"] == rounds + 1
        sizes[rounds] = (out / "checkpoint.pt").stat().st_size
        assert len((out / "metrics.csv").read_text().splitlines()) == rounds + 2
    assert abs(sizes[400] - sizes[20]) < 64, sizes  # the same state whatever the rounds so far


def _interrupted(tmp_path, rounds_done=5, rounds=12, seeds=(0,)):
    """A run stopped after ``rounds_done`` rounds of seed 0 (as Ctrl-C leaves it): its folder."""
    out = tmp_path / "run"
    cfg = Config(dataset="digits", algorithms=("fedavg",), rounds=rounds, seeds=seeds, out=str(out))
    from fastagg.sim import runner

    real = runner._progress
    calls = []

    def stop(algorithm, seed, t, total, loss):
        calls.append(t)
        if t == rounds_done:
            raise KeyboardInterrupt

    runner._progress = stop
    try:
        h = run(cfg, verbose=True)
    finally:
        runner._progress = real
    return out, cfg, h


def test_resume_reads_the_metrics_back_and_equals_an_uninterrupted_run(tmp_path):
    out, cfg, h = _interrupted(tmp_path)
    assert h.stopped and "interrupted" in h.stopped
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    assert ckpt["rows_written"] == 6 and ckpt["current"]["round"] == 5
    resumed = run(Config(out=str(out)), resume=True)
    whole = run(Config(dataset="digits", algorithms=("fedavg",), rounds=12, seeds=(0,)))
    assert [r["round"] for r in resumed.rows] == list(range(13))
    for a, b in zip(resumed.rows, whole.rows):
        assert a["train_loss"] == b["train_loss"] and a["test_acc"] == b["test_acc"]
    assert len((out / "metrics.csv").read_text().splitlines()) == 14


def test_resume_refuses_metrics_shorter_than_the_checkpoint_recorded(tmp_path):
    out, _, _ = _interrupted(tmp_path)
    lines = (out / "metrics.csv").read_text().splitlines()
    (out / "metrics.csv").write_text("\n".join(lines[:3]) + "\n")
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    r = sim("--resume", "--out", str(out))
    assert r.returncode == 2 and "holds 2 metric rows; the checkpoint recorded 6" in r.stderr, r.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before


def test_a_checkpoint_of_the_first_format_still_resumes(tmp_path):
    out, cfg, _ = _interrupted(tmp_path)
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    rows = outdir.read_metrics(str(out), ckpt.pop("rows_written"), METRIC_FIELDS)
    ckpt["rows"] = rows  # fastagg 0.1's checkpoints carried every metric row
    torch.save(ckpt, out / "checkpoint.pt")
    resumed = run(Config(out=str(out)), resume=True)
    assert [r["round"] for r in resumed.rows] == list(range(13))
    assert "rows" not in torch.load(out / "checkpoint.pt", weights_only=True)


def test_an_interrupted_seed_is_reported_unfinished_never_averaged(tmp_path):
    out, cfg, h = _interrupted(tmp_path, rounds_done=4, rounds=6, seeds=(0, 1))
    table = summary(h)
    assert [(r["status"], r["rounds"], r["seeds"]) for r in table] == [("unfinished (seed 0)", 4, 1)]
    text = format_summary(table)
    assert "unfinished (seed 0)" in text
    # a finished seed and an unfinished one: two rows, the finished row over its own seed only
    rows = [dict(algorithm="fedavg", seed=s, round=t, train_loss=1.0 / (1 + t) + s, train_loss_last=0.0,
                 test_loss=0.0, test_acc=0.5, eta=1.0, seconds=0.1, eval_seconds=0.01)
            for s, last in ((0, 6), (1, 3)) for t in range(last + 1)]
    table = summary(History(Config(rounds=6), rows, "interrupted", {"fedavg": 6}))
    assert [(r["status"], r["seeds"], r["rounds"]) for r in table] == [("finished", 1, 6),
                                                                      ("unfinished (seed 1)", 1, 3)]
    assert table[0]["train_loss_mean"] == pytest.approx(1 / 7)


# -- command-line traps ----------------------------------------------------------------------------------------------

def test_an_out_from_the_config_file_takes_overwrite(tmp_path):
    cfg = tmp_path / "runs.toml"
    cfg.write_text(f'dataset = "quadratic"\nrounds = 2\nout = "{tmp_path / "run"}"\n')
    assert sim("--config", str(cfg)).returncode == 0
    again = sim("--config", str(cfg))
    assert again.returncode == 2 and "pass --overwrite" in again.stderr
    r = sim("--config", str(cfg), "--overwrite")
    assert r.returncode == 0, r.stderr


def test_help_shows_the_data_sets_defaults_and_cites_files_that_exist():
    import pathlib
    import re

    text = sim("--help").stdout + subprocess.run([sys.executable, "-m", "fastagg.sim.reproduce", "--help"],
                                                 capture_output=True, text=True, timeout=60).stdout
    assert "cifar-synthetic  pfl-cnn" in text and "fedexp-linreg    linear" in text
    root = pathlib.Path(__file__).resolve().parent.parent
    for cited in set(re.findall(r"[\w/]+\.md", text)):
        assert (root / cited).exists() or cited == "REPRODUCTION.md", cited
    assert "REPRODUCTION_REVIEW" not in text


@pytest.mark.parametrize("spec, text", [
    ("fedavg:lrr=3", "unknown setting 'lrr' (did you mean lr?)"),
    ("fedavg:rounds=3", "'rounds' is a setting of the whole run, not of one algorithm (pass --rounds)"),
])
def test_a_mistyped_per_algorithm_setting_says_what_it_is(spec, text):
    r = sim("--dataset", "quadratic", "--algorithm", spec, "--rounds", "1")
    assert r.returncode == 2 and text in r.stderr, r.stderr


def test_reproduce_writes_to_the_folder_given_and_never_replaces_a_report(tmp_path):
    from fastagg.sim import reproduce

    (tmp_path / "REPRODUCTION.md").write_text("the tracked report")
    with pytest.raises(SystemExit) as e:
        reproduce.main(["--quick", "--claims", "5", "--out", str(tmp_path)])
    assert e.value.code == 2 and (tmp_path / "REPRODUCTION.md").read_text() == "the tracked report"


@pytest.mark.parametrize("blocked, args, text", [
    ("matplotlib", ["--dataset", "quadratic", "--rounds", "1", "--out", "OUT"], "needs matplotlib"),
    ("sklearn", ["--dataset", "digits", "--rounds", "1"], "needs scikit-learn"),
])
def test_a_missing_optional_dependency_is_one_line_naming_the_extra_before_any_work(tmp_path, blocked, args, text):
    args = [str(tmp_path / "out") if a == "OUT" else a for a in args]
    code = (f"import sys; sys.modules[{blocked!r}] = None\n"  # as if it were not installed
            "from fastagg.sim.__main__ import main\n"
            f"sys.exit(main({args!r}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and text in lines[0] and "'.[sim]'" in lines[0], r.stderr
    assert "fastagg[" not in r.stderr  # fastagg is not on an index: that hint would install nothing of ours
    assert not (tmp_path / "out").exists()
