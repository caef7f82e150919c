"""fastagg.nvflare.FastaggAggregator inside NVIDIA FLARE's own simulator (`nvflare simulator`, 2-3 client sites,
3 rounds, NumpyFedAvgRecipe with the aggregator): each round's global model, as the clients received it, and the one
the server saved equal the rule's step replayed in float64 from the model of the round before and the
deterministic local training. FLARE's NumPy persistor keeps the model in float32 (so does the aggregator: the
model's dtype), hence float32 tolerances."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from flare_client import target  # noqa: E402

ROUNDS = 3
LIMIT_S = 180


def _simulate(tmp_path, aggregator, sites: int, nan: bool = False) -> str:
    """Exports the job, runs `nvflare simulator` in a session of its own (killed whole past LIMIT_S); returns its
    log."""
    import shutil

    from nvflare.app_common.np.recipes.fedavg import NumpyFedAvgRecipe

    shutil.copy(os.path.join(HERE, "flare_client.py"), tmp_path / "flare_client.py")
    cwd = os.getcwd()
    os.chdir(tmp_path)  # the recipe finds train_script relative to the working directory
    try:
        recipe = NumpyFedAvgRecipe(name="fastagg_job", model=np.zeros(10).tolist(), min_clients=sites,
                                   num_rounds=ROUNDS, train_script="flare_client.py", aggregator=aggregator)
        recipe.export(str(tmp_path / "jobs"))
    finally:
        os.chdir(cwd)
    (tmp_path / "out").mkdir()
    env = {**os.environ, "FASTAGG_FLARE_OUT": str(tmp_path / "out")}
    if nan:
        env["FASTAGG_FLARE_NAN"] = "1"
    cli = os.path.join(os.path.dirname(sys.executable), "nvflare")
    # FLARE's simulator listens on every interface (tcp://0:port) at ports it picked a moment before: run it in a
    # network namespace of its own with only loopback up (nothing outside can reach it, no port it can race for)
    isolated = ["unshare", "-n", "--", "sh", "-c", 'ip link set lo up && exec "$0" "$@"']
    probe = subprocess.run(isolated + ["true"], capture_output=True, text=True, timeout=30)
    assert probe.returncode == 0, f"needs `unshare -n` and `ip` (a private network namespace): {probe.stderr}"
    proc = subprocess.Popen(isolated + [cli, "simulator", str(tmp_path / "jobs" / "fastagg_job"), "-w",
                                        str(tmp_path / "ws"), "-n", str(sites), "-t", str(sites)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    timed_out = False
    try:
        log, _ = proc.communicate(timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        try:  # the simulator and whatever it started
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if timed_out:
        log, _ = proc.communicate()
    proc.wait()
    assert not timed_out, f"nvflare simulator ran past {LIMIT_S} s; its log ends:\n{log[-4000:]}"
    assert proc.returncode == 0, log[-3000:]
    return log


def _received(tmp_path, sites: int) -> list:
    """The global model of each round, as every site received it (all sites must agree)."""
    out = []
    for r in range(ROUNDS):
        got = [np.load(tmp_path / "out" / f"site-{s}-round{r}.npy") for s in range(1, sites + 1)]
        for g in got[1:]:
            np.testing.assert_array_equal(g, got[0])
        out.append(got[0])
    return out


def test_fedexp_in_the_flare_simulator_with_a_nan_client(tmp_path):
    """3 sites, FedExP (eps 1e-3); site-3 sends NaN in round 1: that round is the other two sites' (a warning in
    the server log), the others all three; every round's model is w + eta * mean with the paper's eta."""
    from fastagg.nvflare import FastaggAggregator

    eps = 1e-3
    log = _simulate(tmp_path, FastaggAggregator(rule="fedexp", hyper={"eps": eps}), 3, nan=True)
    assert "site-3 contains NaN or Inf" in log and "left out of the round" in log
    got = _received(tmp_path, 3)
    saved = np.load(tmp_path / "ws" / "server" / "simulate_job" / "models" / "server.npy")
    np.testing.assert_array_equal(got[0], np.zeros(10))
    etas = []
    for r, after in enumerate(got[1:] + [saved]):
        w = got[r]
        pids = [1, 2] if r == 1 else [1, 2, 3]
        n = np.array([10.0 * p for p in pids])
        p = n / n.sum()
        d = np.stack([0.5 * (target(i) - w) for i in pids])
        mean = p @ d
        eta = max(1.0, float(p @ (d * d).sum(1)) / (2 * (mean @ mean + eps)))
        etas.append(eta)
        np.testing.assert_allclose(after, w + eta * mean, rtol=2e-6, atol=1e-6, err_msg=f"after round {r}")
    assert max(etas) > 1.1  # the extrapolation did happen


def test_fedadam_in_the_flare_simulator(tmp_path):
    """2 sites, FedAdam: every round's model equals fastagg.server.FedAdam stepping the same updates in float64."""
    from fastagg import server
    from fastagg.nvflare import FastaggAggregator

    hyper = {"lr": 0.1, "betas": [0.9, 0.99], "tau": 1e-3}
    _simulate(tmp_path, FastaggAggregator(rule="fedadam", hyper=hyper), 2)
    got = _received(tmp_path, 2)
    saved = np.load(tmp_path / "ws" / "server" / "simulate_job" / "models" / "server.npy")
    w = torch.zeros(10, dtype=torch.float64)
    ref = server.FedAdam(w, lr=0.1, betas=(0.9, 0.99), tau=1e-3)
    for r, after in enumerate(got[1:] + [saved]):
        w.copy_(torch.from_numpy(got[r]))
        d = torch.stack([0.5 * (torch.from_numpy(target(i)) - w) for i in (1, 2)])
        ref.step(d, weights=torch.tensor([10.0, 20.0], dtype=torch.float64))
        np.testing.assert_allclose(after, w.numpy(), rtol=2e-6, atol=1e-6, err_msg=f"after round {r}")
