"""A real Flower deployment on loopback: flower-superlink and two flower-supernode processes (insecure, free ports;
with Flower's default runtime dependency installation, and with it off), the example app (examples/flower) run with `flwr run` and
fastagg's FedExP strategy. Asserts on the result file the ServerApp writes: `flwr run` exits 0 even when the app
failed. Every process is started in its own session and its whole group is killed in `finally`."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import flwr  # noqa: F401  (a test requirement: a missing one fails here)
import pytest
from fastagg.testing import free_port, processes_with_env, stop_processes_with_env

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "flower"
BIN = Path(sys.executable).parent
TIMEOUT = 240  # seconds for `flwr run`; the run itself takes ~30 s here



def _wait_port(port: int, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"flower-superlink exited with {proc.returncode} before listening")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"flower-superlink not listening on 127.0.0.1:{port} after {timeout} s")


def _spawn(args, log: Path, env) -> subprocess.Popen:
    return subprocess.Popen([str(a) for a in args], stdout=log.open("w"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)  # its own process group: superexec and clientapp children too


def _kill_group(p: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        try:
            p.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue


@pytest.fixture(params=["flower-defaults", "preinstalled"])
def federation(request, tmp_path):
    """flower-defaults: Flower's runtime dependency installation on (its default), so each app process runs
    ``uv sync`` on the example's dependencies (needs PyPI, as ``make test``'s install does); preinstalled: off."""
    home = tmp_path / "flwr"
    home.mkdir()
    port = free_port()
    (home / "config.toml").write_text(f'[superlink]\ndefault = "ci"\n\n[superlink.ci]\n'
                                      f'address = "127.0.0.1:{port}"\ninsecure = true\n')
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",  # flower-superexec, flwr-*
               FLWR_HOME=str(home), FLWR_TELEMETRY_ENABLED="0", FLWR_DISABLE_UPDATE_CHECK="1")
    flags = []
    if request.param == "preinstalled":
        env["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] = "1"
        flags = ["--disable-runtime-dependency-installation"]
    else:
        env.pop("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", None)
    procs = [_spawn([BIN / "flower-superlink", "--insecure", "--host", "127.0.0.1", "--port", port, *flags],
                    tmp_path / "superlink.log", env)]
    try:
        _wait_port(port, procs[0])
        for i in range(2):
            procs.append(_spawn([BIN / "flower-supernode", "--insecure", "--superlink", f"127.0.0.1:{port}",
                                 "--port", free_port(), "--node-config", f"partition-id={i} num-partitions=2"],
                                tmp_path / f"supernode{i}.log", env))
        yield env, tmp_path
    finally:
        for p in reversed(procs):
            _kill_group(p)
        # what the SuperLink and SuperNodes started (flower-superexec, app processes) may have left their groups:
        # every process of this federation carries its private FLWR_HOME
        stop_processes_with_env("FLWR_HOME", str(home))
    assert not processes_with_env("FLWR_HOME", str(home)), "processes of the federation outlived the test"


def _flwr_run(federation, run_config: str) -> dict:
    """``flwr run`` of the example app on the federation; the result file its ServerApp wrote (``flwr run`` exits 0
    even when the app failed, so the file is what is checked)."""
    env, tmp = federation
    out = tmp / "result.json"
    cp = subprocess.run([str(BIN / "flwr"), "run", str(EXAMPLE), "ci", "--stream", "--run-config",
                         f"{run_config} out-file='{out}'"], env=env, capture_output=True, text=True, timeout=TIMEOUT)
    logs = cp.stdout[-3000:] + cp.stderr[-3000:]
    assert cp.returncode == 0, logs
    assert out.exists(), "the ServerApp wrote no result file:\n" + logs
    return json.loads(out.read_text())


def test_fedexp_strategy_in_a_flower_deployment(federation):
    res = _flwr_run(federation, "strategy='fedexp' model='linear' num-server-rounds=3 fraction-evaluate=0.0")
    assert res["strategy"] == "fedexp" and res["rounds"] == 3
    etas = [res["server"][str(r)]["fedexp-eta"] for r in (1, 2, 3)]
    assert all(e >= 1.0 for e in etas) and max(etas) > 1.0, etas  # FedExP's own step ran (non-IID clients)
    for r in (1, 2, 3):
        assert res["server"][str(r)]["fedexp-mean-sq-norm"] > 0
        assert "fedexp-eta" not in res["train"][str(r)]
    assert res["train"]["3"]["train-loss"] < res["train"]["1"]["train-loss"]
    assert res["final_dtypes"] == {"w": "float32", "b": "float32"}


@pytest.mark.parametrize("federation", ["preinstalled"], indirect=True)
def test_fedbuff_in_a_flower_deployment(federation):
    """fastagg's asynchronous FedBuff as the ServerApp of a real deployment: replies pulled as they come, a step
    every 2, the replying node sent the newest model."""
    res = _flwr_run(federation, "strategy='fedbuff' model='linear' num-server-rounds=4")
    assert res["strategy"] == "fedbuff" and res["rounds"] == 4 and not res["left_out"]
    assert sum(res["updates_per_node"].values()) == 8 and len(res["updates_per_node"]) == 2
    assert sorted(res["train"]) == ["1", "2", "3", "4"]
    assert res["final_dtypes"] == {"w": "float32", "b": "float32"}


def test_make_flower_example_runs_flwr_run_in_a_local_simulation_and_fedexp_extrapolates(tmp_path):
    """`make flower-example`'s script: `flwr run` into Flower's managed local SuperLink (simulation mode, Flower's
    default runtime dependency installation) with the CNN task; FedExP's eta, a server metric, exceeds 1 (the
    strongly non-IID clients disagree); the detached SuperLink Flower started is stopped at the end."""
    out = tmp_path / "summary.json"
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    cp = subprocess.run([sys.executable, str(EXAMPLE / "run_local.py"), "--strategy", "fedexp", "--model", "cnn",
                         "--rounds", "3", "--clients", "4", "--out", str(out)], env=env, capture_output=True,
                        text=True, timeout=TIMEOUT)
    logs = cp.stdout[-3000:] + cp.stderr[-3000:]
    assert cp.returncode == 0 and out.exists(), logs
    res = json.loads(out.read_text())
    etas = [res["server"][r]["fedexp-eta"] for r in ("1", "2", "3")]
    assert min(etas) >= 1.0 and max(etas) > 1.2, etas
    assert all("fedexp-eta" not in res["train"][r] for r in ("1", "2", "3"))
    assert "round 3: train" in cp.stdout and "server {\"fedexp-eta\"" in cp.stdout
    left = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            argv = (proc / "cmdline").read_bytes()
            env = (proc / "environ").read_bytes()
        except OSError:
            continue
        # the SuperLink (its argv names its home) and whatever it started (flower-superexec: its environment does)
        if (b"flower-superlink" in argv and b"flwr-home-" in argv) or b"/flwr-home-" in env:
            left.append(f"{proc.name}: {argv[:80]!r}")
    assert not left, f"the local run left processes running: {left}"
