"""The simulator on several processes: ``torchrun --nproc-per-node R -m fastagg.sim ...`` splits each round's
clients over the ranks and gives the metrics of one process (gloo on 127.0.0.1, free ports, bounded time)."""
from __future__ import annotations

import csv
import os
import subprocess
import sys

import pytest
from fastagg.testing import free_port

ARGS = ["--dataset", "synthetic", "--algorithm", "fedavg,fedexp,fedadam", "--rounds", "4", "--seeds", "0,1"]



def sim(world: int, *args, timeout: int = 240):
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    if world == 1:
        cmd = [sys.executable, "-m", "fastagg.sim", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(world),
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "fastagg.sim", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)


def _rows(path):
    return list(csv.DictReader(open(path)))


@pytest.mark.parametrize("dtype, rtol", [("float64", 1e-12), ("float32", 1e-5)])
def test_two_and_four_ranks_give_the_metrics_of_one_process(dtype, rtol, tmp_path):
    runs = {}
    for world in (1, 2, 4):
        out = tmp_path / f"w{world}"
        res = sim(world, *ARGS, "--dtype", dtype, "--out", str(out))
        assert res.returncode == 0, res.stderr[-3000:]
        runs[world] = _rows(out / "metrics.csv")
        assert not any(p.name.startswith("rank") for p in out.iterdir())
    for world in (2, 4):
        assert len(runs[world]) == len(runs[1]) == 3 * 2 * 5
        for a, b in zip(runs[1], runs[world]):
            assert (a["algorithm"], a["seed"], a["round"]) == (b["algorithm"], b["seed"], b["round"])
            for field in ("train_loss", "train_loss_last", "eta"):
                if a[field] != "nan":
                    assert float(b[field]) == pytest.approx(float(a[field]), rel=rtol), (world, field, a, b)


def test_client_state_follows_the_client_across_ranks(tmp_path):
    """Momentum, DecSPS step sizes and SCAFFOLD's control variates live with the client: after each round the
    ranks share the state of the clients they trained, so with partial participation (a client trained by rank 1
    this round may be rank 0's next) 2 ranks give one process's metrics (float64)."""
    args = ["--dataset", "synthetic", "--algorithm", "fedmass,nesterov-fedavg,feddecsps,scaffold", "--rounds", "5",
            "--participation", "0.3", "--dtype", "float64"]
    runs = {}
    for world in (1, 2):
        res = sim(world, *args, "--out", str(tmp_path / f"w{world}"))
        assert res.returncode == 0, res.stderr[-3000:]
        runs[world] = _rows(tmp_path / f"w{world}" / "metrics.csv")
    for a, b in zip(runs[1], runs[2]):
        assert (a["algorithm"], a["round"]) == (b["algorithm"], b["round"])
        assert float(b["train_loss"]) == pytest.approx(float(a["train_loss"]), rel=1e-11), (a, b)


def test_a_failing_rank_0_ends_every_rank_promptly(tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "metrics.csv").write_text("x\n")
    res = sim(2, *ARGS, "--out", str(tmp_path / "taken"), timeout=120)  # rank 0 refuses the folder
    assert res.returncode != 0 and "already holds a run" in res.stderr


@pytest.mark.parametrize("batch", ["0", "8"])
def test_two_ranks_with_one_sampled_client_give_one_process_metrics(batch, tmp_path):
    """A round that samples one client on two ranks: rank 1 trains nobody and joins the step with a zero share (it
    used to be refused: '2 ranks need at least 2 clients a round'); with minibatches it still makes the round's
    draws, so the ranks' generators stay in step."""
    args = ["--dataset", "synthetic", "--algorithm", "fedavg,fedexp,scaffold", "--rounds", "3", "--clients", "10",
            "--participation", "0.1", "--dtype", "float64", "--batch-size", batch]
    runs = {}
    for world in (1, 2):
        res = sim(world, *args, "--out", str(tmp_path / f"w{world}"))
        assert res.returncode == 0, res.stderr[-3000:]
        runs[world] = _rows(tmp_path / f"w{world}" / "metrics.csv")
    assert len(runs[1]) == len(runs[2]) == 3 * 4
    for a, b in zip(runs[1], runs[2]):
        assert (a["algorithm"], a["round"]) == (b["algorithm"], b["round"])
        assert float(b["train_loss"]) == pytest.approx(float(a["train_loss"]), rel=1e-11), (a, b)


def test_resume_under_torchrun_continues_a_killed_run_as_one_process_would(tmp_path):
    """--resume on 2 ranks: rank 0 reads the run folder and sends the checkpoint to rank 1 (it used to be refused:
    '--resume runs on one process'); the resumed run's rows equal an uninterrupted one-process run's. The run is
    cut short by giving it fewer rounds first, then extended by --resume --rounds."""
    args = ["--dataset", "synthetic", "--algorithm", "fedavg,fedexp", "--dtype", "float64", "--seeds", "0,1"]
    whole = sim(1, *args, "--rounds", "4", "--out", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr[-3000:]
    first = sim(2, *args, "--rounds", "2", "--out", str(tmp_path / "cut"))
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = sim(2, "--resume", "--rounds", "4", "--out", str(tmp_path / "cut"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = _rows(tmp_path / "whole" / "metrics.csv"), _rows(tmp_path / "cut" / "metrics.csv")
    key = lambda r: (r["algorithm"], r["seed"], int(r["round"]))  # noqa: E731
    a, b = sorted(a, key=key), sorted(b, key=key)
    assert [key(r) for r in a] == [key(r) for r in b] and len(a) == 2 * 2 * 5
    for x, y in zip(a, b):
        assert float(y["train_loss"]) == pytest.approx(float(x["train_loss"]), rel=1e-11), (x, y)


def test_resume_under_torchrun_with_a_broken_folder_fails_on_every_rank_promptly(tmp_path):
    res = sim(2, "--resume", "--out", str(tmp_path / "nothing"), timeout=120)
    assert res.returncode != 0 and "nothing to resume" in res.stderr


def test_a_run_stopped_mid_seed_resumes_under_torchrun(tmp_path, monkeypatch):
    """A run interrupted in the middle of its second (algorithm, seed) (Ctrl-C after round 2: the checkpoint holds
    that run's state) resumes on 2 ranks to an uninterrupted run's metrics."""
    from fastagg.sim import Config, run
    from fastagg.sim import runner

    base = dict(dataset="synthetic", algorithms=("fedavg", "fedexp"), rounds=4, seeds=(0,), dtype="float64")
    straight = run(Config(**base))
    calls = {"n": 0}
    real = runner.run_one

    def interrupting(*args, **kw):
        calls["n"] += 1
        if calls["n"] == 2:
            orig = kw["on_round"]

            def on_round(snap):
                orig(snap)
                if snap["round"] == 2:
                    raise KeyboardInterrupt
            kw["on_round"] = on_round
        return real(*args, **kw)

    monkeypatch.setattr(runner, "run_one", interrupting)
    out = tmp_path / "run"
    assert "interrupted" in run(Config(**base, out=str(out))).stopped
    res = sim(2, "--resume", "--out", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    got = {(r["algorithm"], int(r["round"])): float(r["train_loss"]) for r in _rows(out / "metrics.csv")}
    want = {(r["algorithm"], r["round"]): r["train_loss"] for r in straight.rows}
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-11), k


def test_the_cli_tears_its_process_group_down_before_exit(tmp_path):
    """A gloo group left to die at interpreter shutdown aborts a rank now and then ('terminate called without an
    active exception', exit -6 after a finished run, seen once in CI): the CLI destroys the group it joined, after
    a finished run and after an error, so no rank exits with it alive."""
    script = tmp_path / "main.py"
    script.write_text("import os, sys, torch.distributed as dist\n"
                      "from fastagg.sim.__main__ import main\n"
                      "rc = main(sys.argv[2:])\n"
                      "with open(os.path.join(sys.argv[1], 'rank' + os.environ['RANK']), 'w') as f:\n"
                      "    f.write(f'{dist.is_initialized()} {rc}')\n")
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    for k, (args, rc) in enumerate([(["--dataset", "synthetic", "--algorithm", "fedavg", "--rounds", "2"], "0"),
                                    (["--resume", "--out", str(tmp_path / "nothing")], "2")]):
        seen = tmp_path / f"seen{k}"
        seen.mkdir()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script), str(seen), *args]
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
        got = {p.name: p.read_text() for p in seen.iterdir()}
        assert got == {"rank0": f"False {rc}", "rank1": f"False {rc}"}, (got, res.stderr[-2000:])
