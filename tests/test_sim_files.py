"""The simulator's files and command line under misuse: a crafted checkpoint, a folder holding another run, two
runs on one folder, a moved folder, a checkpoint from another run, bad npz data, bad flags. Every error is one
line with exit code 2, and nothing is written before it."""
from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from fastagg.sim import outdir
from fastagg.sim.runner import Config, run

SIM = [sys.executable, "-m", "fastagg.sim"]
QUICK = ["--dataset", "quadratic", "--algorithm", "fedavg", "--rounds", "2"]


def sim(*args, cwd=None):
    return subprocess.run([*SIM, *args], capture_output=True, text=True, cwd=cwd, timeout=120)


def _one_line_error(out, text):
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and text in lines[0], out.stderr


@pytest.mark.parametrize("args, text", [
    (["--seeds", "a,b"], "--seeds 'a,b': expected comma-separated integers"),
    (["--config", "missing.json"], "cannot read --config 'missing.json'"),
    (["--device", "cuda"] if not torch.cuda.is_available() else ["--device", "tpu"], "device"),
    (["--dataset", "digits", "--clients", "0"], "clients must be an integer >= 1"),
    (["--model", "bogus"], "unknown model 'bogus'"),
    (["--dataset", "fedexp-linreg", "--model", "softmax"], "needs a classification dataset"),
    (["--out", "/proc/not-here"], "cannot create --out"),
    (["--no-such-flag"], "unrecognized arguments"),
])
def test_cli_errors_are_one_line_and_exit_2(tmp_path, args, text):
    _one_line_error(sim(*QUICK, *args, cwd=tmp_path), text)
    assert not any(tmp_path.iterdir()), "nothing may be written before the error"


def test_config_files_are_checked(tmp_path):
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{not json")
    _one_line_error(sim(*QUICK, "--config", str(bad_json)), "cannot read --config")
    unknown = tmp_path / "unknown.json"
    unknown.write_text(json.dumps({"rounds": 2, "learning_rate": 0.1}))
    _one_line_error(sim(*QUICK, "--config", str(unknown)), "unknown settings learning_rate")
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"dataset": "quadratic", "algorithms": ["fedavg"], "rounds": 3, "seeds": [0]}))
    out = sim("--config", str(good), "--rounds", "2", "--out", str(tmp_path / "run"))
    assert out.returncode == 0, out.stderr
    assert json.loads((tmp_path / "run" / "config.json").read_text())["rounds"] == 2  # the flag wins


def test_a_folder_with_another_runs_results_is_not_overwritten(tmp_path):
    out = tmp_path / "run"
    assert sim(*QUICK, "--out", str(out)).returncode == 0
    before = (out / "metrics.csv").read_bytes()
    _one_line_error(sim(*QUICK, "--rounds", "3", "--out", str(out)), "already holds a run")
    assert (out / "metrics.csv").read_bytes() == before
    assert sim(*QUICK, "--rounds", "3", "--out", str(out), "--overwrite").returncode == 0
    assert (out / "metrics.csv").read_bytes() != before


def test_a_second_concurrent_run_on_one_folder_is_refused(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (out / outdir.LOCK).write_text(str(holder.pid))  # a live run holds the folder
        _one_line_error(sim(*QUICK, "--out", str(out)), f"another run (pid {holder.pid}) is writing")
        assert not (out / "metrics.csv").exists()
    finally:
        holder.kill()
        holder.wait()
    # its lock is stale once it is gone: a new run takes the folder over, and removes the lock when done
    assert sim(*QUICK, "--out", str(out)).returncode == 0
    assert (out / "metrics.csv").exists() and not (out / outdir.LOCK).exists()


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_resume_never_unpickles_code(tmp_path):
    out = tmp_path / "run"
    assert sim(*QUICK, "--out", str(out)).returncode == 0
    ckpt = out / "checkpoint.pt"
    with open(ckpt, "wb") as f:
        pickle.dump({"rows": [], "done": [], "current": _Evil(), "run": {}}, f)
    r = sim("--resume", "--out", str(out), cwd=tmp_path)
    _one_line_error(r, "cannot load")
    assert not (tmp_path / "PWNED").exists()
    ckpt.write_bytes(b"garbage")
    _one_line_error(sim("--resume", "--out", str(out)), "cannot load")


def test_resume_refuses_a_checkpoint_from_another_run(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    assert sim(*QUICK, "--out", str(a)).returncode == 0
    assert sim("--dataset", "quadratic", "--algorithm", "fedexp", "--rounds", "2", "--out", str(b)).returncode == 0
    shutil.copy(a / "checkpoint.pt", b / "checkpoint.pt")
    before = (b / "metrics.csv").read_bytes()
    _one_line_error(sim("--resume", "--out", str(b)), "belongs to another run: its algorithms differ")
    assert (b / "metrics.csv").read_bytes() == before


def test_resume_continues_the_folder_it_is_given_and_refuses_changed_settings(tmp_path):
    first = tmp_path / "first"
    assert sim(*QUICK, "--out", str(first)).returncode == 0
    moved = tmp_path / "moved"
    shutil.move(first, moved)
    history = run(Config(out=str(moved)), resume=True)  # config.json still says out=.../first
    assert history.config.out == str(moved) and not first.exists()
    _one_line_error(sim("--resume", "--out", str(moved), "--lr", "0.3"), "would change them: lr")
    assert sim("--resume", "--out", str(moved), "--rounds", "2").returncode == 0  # the same value: fine


@pytest.mark.parametrize("arrays, text", [
    (dict(x=np.ones((4, 2)), y=np.array([0, 1, 0])), "'y' must be 1-D with one entry per sample (4)"),
    (dict(x=np.array([[np.nan, 1.0]] * 4), y=np.arange(4)), "'x' holds NaN or Inf"),
    (dict(x=np.ones((4, 2)), y=np.array([0, -1, 0, 1])), "negative class labels"),
    (dict(x=np.ones((4, 2)), y=np.arange(4), client=np.array([0, 0, 2, 2])), "client 1 has no sample"),
    (dict(x=np.ones((4, 2)), y=np.arange(4), client=np.array([0.0, 1.0, 0.0, 1.0])), "integer client ids"),
    (dict(x=np.ones((4, 2)), y=np.arange(4), client=np.array([0, -1, 0, 1])), "negative ids"),
    (dict(x=np.ones((4, 2)), y=np.arange(4), client=np.array([0, 1])), "one id per sample"),
    (dict(y=np.arange(4)), "has no array 'x'"),
    (dict(x=np.array(["a"] * 4), y=np.arange(4)), "numeric"),
])
def test_npz_data_is_validated(tmp_path, arrays, text):
    path = tmp_path / "data.npz"
    np.savez(path, **arrays)
    _one_line_error(sim("--dataset", f"npz:{path}", "--rounds", "1", cwd=tmp_path), text)
