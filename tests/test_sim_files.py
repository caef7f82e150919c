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
    lock = out / outdir.LOCK
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time; "
                               f"fd = os.open({str(lock)!r}, os.O_CREAT | os.O_RDWR); fcntl.flock(fd, fcntl.LOCK_EX); "
                               "os.write(fd, str(os.getpid()).encode()); print('held', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"  # a live run holds the folder
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
    _one_line_error(sim("--resume", "--out", str(b)),
                    "belongs to another run: it was saved with algorithms=['fedavg']")  # the first that differs
    assert (b / "metrics.csv").read_bytes() == before


def test_resume_continues_the_folder_it_is_given_and_refuses_changed_settings(tmp_path):
    first = tmp_path / "first"
    assert sim(*QUICK, "--out", str(first)).returncode == 0
    moved = tmp_path / "moved"
    shutil.move(first, moved)
    history = run(Config(out=str(moved), rounds=3), resume=True)  # config.json still says out=.../first
    assert history.config.out == str(moved) and not first.exists()
    _one_line_error(sim("--resume", "--out", str(moved), "--lr", "0.3"), "would change them: lr")
    # a flag repeating the recorded value is fine (a finished run with nothing left is refused: tests/test_sim_hostile.py)
    assert sim("--resume", "--out", str(moved), "--rounds", "4", "--algorithm", "fedavg").returncode == 0


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


# -- issue 19: files that cannot be used against the files around them --------------------------------------------

@pytest.mark.parametrize("name", ["summary.csv", "loss.png", "checkpoint.pt.tmp", "metrics.csv", "config.json",
                                  "checkpoint.pt", "eta.png"])
def test_a_symlink_planted_in_out_is_never_written_through(tmp_path, name):
    """Someone plants ``out/<name>`` -> a file outside (a victim): the run replaces the link itself, and the victim
    keeps its bytes."""
    out = tmp_path / "run"
    out.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (out / name).symlink_to(victim)
    r = sim(*QUICK, "--out", str(out), "--overwrite")
    assert r.returncode == 0, r.stderr
    assert victim.read_text() == "precious"
    if name != "checkpoint.pt.tmp":
        assert not (out / name).is_symlink()


def test_reproduce_does_not_write_through_a_planted_link(tmp_path):
    from fastagg.sim import outdir as od

    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / "REPRODUCTION.md").symlink_to(victim)
    od.write_file(str(tmp_path), "REPRODUCTION.md", lambda f: f.write("report\n"))
    assert victim.read_text() == "precious" and (tmp_path / "REPRODUCTION.md").read_text() == "report\n"


def test_two_runs_never_both_hold_a_folder_even_when_both_find_a_stale_lock(tmp_path):
    """A killed run's lock file is left behind; many claimers race for the folder at once: exactly one holds it
    at any time (the lock is the kernel's, dropped when its process dies)."""
    import threading

    out = tmp_path / "run"
    out.mkdir()
    (out / outdir.LOCK).write_text("999999")  # a stale lock of a process that is gone
    holders, errors, start = [], [], threading.Barrier(8)

    def claimer():
        start.wait()
        try:
            holders.append(outdir.claim(str(out), resume=True, overwrite=False))
        except ValueError as e:
            errors.append(str(e))

    # flock is per open file description: claims from threads of one process exclude each other too
    threads = [threading.Thread(target=claimer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(holders) == 1 and len(errors) == 7, (len(holders), errors)
    assert all("another run" in e for e in errors)
    holders[0].release()
    again = outdir.claim(str(out), resume=True, overwrite=False)  # free again once released
    again.release()


def test_a_lock_path_that_is_a_directory_or_a_link_is_one_line(tmp_path):
    out = tmp_path / "run"
    (out / outdir.LOCK).mkdir(parents=True)
    _one_line_error(sim(*QUICK, "--out", str(out)), "lock file")
    shutil.rmtree(out / outdir.LOCK)
    (out / outdir.LOCK).symlink_to(tmp_path / "elsewhere")
    _one_line_error(sim(*QUICK, "--out", str(out)), "symbolic link")
    assert not (tmp_path / "elsewhere").exists()


def _resumable(tmp_path, algorithm="fedadam"):
    out = tmp_path / "run"
    r = sim("--dataset", "quadratic", "--algorithm", algorithm, "--rounds", "3", "--out", str(out))
    assert r.returncode == 0, r.stderr
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    return out, ckpt


@pytest.mark.parametrize("corrupt, text", [
    (lambda c: c["current"].update(params=torch.zeros(5)), "params are"),
    (lambda c: c["current"].update(params=torch.full((1,), float("nan"))), "NaN"),
    (lambda c: c["current"].update(round=99), "round 99"),
    (lambda c: c["current"]["optimizer"]["state"][0].update(v=-torch.ones(1)), "negative"),
    (lambda c: c["current"]["optimizer"]["state"][0].update(v=torch.ones(3)), "shape"),
    (lambda c: c["current"].update(generator=torch.zeros(3, dtype=torch.uint8)), "cannot be restored"),
    (lambda c: c.update(done=[["fedbogus", 0]]), "finished runs"),
    (lambda c: c.update(rows=[{"round": 1}]), "metric rows"),
    (lambda c: c["current"].update(algorithm="fedexp"), "not one of this run's"),
])
def test_resume_validates_the_checkpoint_before_rewriting_anything(tmp_path, corrupt, text):
    out, ckpt = _resumable(tmp_path)
    ckpt["current"] = {"algorithm": "fedadam", "seed": 0, "round": 2, "params": ckpt["current"]["params"]
                       if ckpt.get("current") else torch.zeros(1),
                       "optimizer": ckpt["current"]["optimizer"] if ckpt.get("current") else None,
                       "clients": None, "generator": torch.Generator().manual_seed(0).get_state(),
                       "train_seconds": 0.0} if ckpt.get("current") is None else ckpt["current"]
    if ckpt["current"]["optimizer"] is None:  # a finished run keeps no run in progress: make one from a round
        from fastagg import server

        opt = server.FedAdam(torch.zeros(1))
        opt.step(torch.ones(2, 1) * 0.1)
        ckpt["current"]["optimizer"] = opt.state_dict()
        ckpt["done"] = []
    corrupt(ckpt)
    torch.save(ckpt, out / "checkpoint.pt")
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    _one_line_error(sim("--resume", "--out", str(out)), text)
    after = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert after == before, "the folder changed before the error"


@pytest.mark.parametrize("flags, text", [
    (["--algorithm", "fedavg,fedavgm", "--server-momentum", "1.5"], "server_momentum"),
    (["--algorithm", "fedavg,fedsps", "--sps-c", "0"], "sps_c"),
    (["--algorithm", "fedavg,fedexp", "--eps-decay", "0"], "eps_decay"),
    (["--algorithm", "fedavg,fedacg", "--lam", "1"], "lam"),
    (["--algorithm", "fedavg,fedexp", "--server-lr", "nan"], "server_lr"),
    (["--algorithm", "fedavg,fedmass", "--mass-eta2", "nan"], "mass_eta2"),
    (["--algorithm", "fedavg,fedsps:gamma_b=-1"], "gamma_b"),
    (["--algorithm", "fedavg,scaffold", "--lr-decay", "0"], "lr_decay"),
    (["--algorithm", "fedavg", "--local-steps", "100000000000"], "local_steps"),
])
def test_every_setting_is_checked_before_anything_runs_or_is_written(tmp_path, flags, text):
    """Bad settings of a later algorithm used to be refused only when it began: after config.json and metrics.csv
    were written and the earlier algorithms had trained to the end."""
    out = tmp_path / "run"
    _one_line_error(sim("--dataset", "quadratic", "--rounds", "2", *flags, "--out", str(out)), text)
    assert not (out / "config.json").exists() and not (out / "metrics.csv").exists()


@pytest.mark.parametrize("settings, text", [
    ({"rounds": "ten"}, "rounds must be int"), ({"lr": [0.1]}, "lr must be float"), ({"seeds": [True]}, "seeds"),
    ({"algorithms": [1]}, "an algorithm must be"), ({"cuda_graph": "yes"}, "cuda_graph must be bool"),
    ({"batch_size": 10**15}, "batch_size must be at most"), ({"eps": {}}, "eps must be"),
])
def test_wrongly_typed_or_pathological_config_values_are_one_line(tmp_path, settings, text):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"dataset": "quadratic", "rounds": 2, **settings}))
    _one_line_error(sim("--config", str(path), "--out", str(tmp_path / "run")), text)
    assert not (tmp_path / "run" / "config.json").exists()


def _npz_with_header(path, shape):
    """An .npz whose 'x' member has a header claiming ``shape`` but only 8 bytes of data."""
    import io
    import zipfile

    head = io.BytesIO()
    np.lib.format.write_array_header_1_0(head, {"descr": "<f8", "fortran_order": False, "shape": shape})
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("x.npy", head.getvalue() + b"\0" * 8)
        buf = io.BytesIO()
        np.save(buf, np.arange(4))
        z.writestr("y.npy", buf.getvalue())


@pytest.mark.parametrize("case, text", [
    ("huge client id", "holds id 1000000000000 but there are only 4 samples"),
    ("huge label", "ask for 1000000000001 classes"),
    ("huge num_classes", "ask for 1000000000000 classes"),
    ("huge header", "claims 8000000000000 bytes"),
    ("plain npy", "single array (.npy)"),
])
def test_hostile_npz_is_refused_in_one_line_without_allocating_for_it(tmp_path, case, text):
    import resource

    path = tmp_path / "data.npz"
    x, y = np.ones((4, 2)), np.arange(4)
    if case == "huge client id":
        np.savez(path, x=x, y=y, client=np.array([0, 1, 2, 10**12]))
    elif case == "huge label":
        np.savez(path, x=x, y=np.array([0, 1, 2, 10**12]))
    elif case == "huge num_classes":
        np.savez(path, x=x, y=y, num_classes=np.array(10**12))
    elif case == "huge header":
        _npz_with_header(path, (10**12,))
    else:
        path = tmp_path / "data.npy"
        np.save(path, x)
    out = subprocess.run([*SIM, "--dataset", f"npz:{path}", "--rounds", "1"], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path,
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30)))
    _one_line_error(out, text)
