"""fastagg.flower in Flower's in-process Simulation Runtime (Ray): the example app (examples/flower) with a torch
CNN with BatchNorm, 3 rounds, 3 clients. fastagg's FedAdam and Flower's FedAdam end on the same parameters; their
BatchNorm buffers differ by design (Flower Adam-steps running statistics and turns the model into float64;
fastagg averages buffers and keeps every dtype)."""
from __future__ import annotations

from pathlib import Path

import flwr  # noqa: F401  (test requirements, flwr[simulation] brings ray: a missing one fails here)
import numpy as np
import ray  # noqa: F401

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "flower"
BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


def _simulate(strategy: str, compress: str = "") -> dict:
    from flwr.serverapp import ServerApp
    from flwr.simulation import run_simulation

    from fastagg_example import server_app
    from fastagg_example.client_app import app as client_app

    app = ServerApp()

    @app.main()
    def main(grid, context):
        # every round waits for all 3 nodes: with fewer connected, Flower samples only those, and the two runs
        # would average different clients
        server_app.run(grid, {"strategy": strategy, "model": "cnn", "num-server-rounds": 3, "fraction-evaluate": 0.0,
                              "min-nodes": 3, "compress": compress})

    run_simulation(server_app=app, client_app=client_app, num_supernodes=3,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"num_cpus": 2, "include_dashboard": False}})
    return dict(server_app.LAST_SUMMARY)


def test_fastagg_fedadam_and_flowers_fedadam_end_on_the_same_model(monkeypatch):
    monkeypatch.setenv("FLWR_TELEMETRY_ENABLED", "0")
    monkeypatch.setenv("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    monkeypatch.syspath_prepend(str(EXAMPLE))
    ours = _simulate("fedadam")
    theirs = _simulate("flower-fedadam")
    assert ours["strategy"] == "fedadam" and theirs["strategy"] == "flower-fedadam" and ours["rounds"] == 3
    assert set(ours["train"]) == {"1", "2", "3"} and set(theirs["train"]) == {"1", "2", "3"}
    params = [k for k in ours["final"] if not k.endswith(BUFFERS)]
    assert params and set(ours["final"]) == set(theirs["final"])
    for k in params:
        np.testing.assert_allclose(np.array(ours["final"][k]), np.array(theirs["final"][k]), rtol=1e-4, atol=1e-5,
                                   err_msg=k)
        assert ours["final_dtypes"][k] == "float32" and theirs["final_dtypes"][k] == "float64"
    assert ours["final_dtypes"]["1.num_batches_tracked"] == "int64"
    # fastagg's running variance is an average of the clients' (positive), Flower Adam-steps it
    assert np.all(np.array(ours["final"]["1.running_var"]) > 0)
    for rnd in ("1", "2", "3"):
        assert abs(ours["train"][rnd]["train-loss"] - theirs["train"][rnd]["train-loss"]) < 1e-4


def test_int8_compressed_replies_fold_in_place_and_track_the_full_precision_run(monkeypatch):
    """The ClientApp's mod sends int8 updates (the server asks for them in the train config); fastagg's FedAdam
    folds them: three rounds whose losses follow the uncompressed run's to int8's precision, not equal to it."""
    monkeypatch.setenv("FLWR_TELEMETRY_ENABLED", "0")
    monkeypatch.setenv("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    monkeypatch.syspath_prepend(str(EXAMPLE))
    full = _simulate("fedadam")
    int8 = _simulate("fedadam", compress="int8:block=64")
    assert set(int8["train"]) == {"1", "2", "3"}
    params = [k for k in full["final"] if not k.endswith(BUFFERS)]
    differ = 0
    for k in params:
        a, b = np.array(int8["final"][k]), np.array(full["final"][k])
        np.testing.assert_allclose(a, b, atol=0.02, err_msg=k)
        differ += int(not np.array_equal(a, b))
    assert differ, "the compressed run equals the full one: were the replies compressed?"
    assert int8["final_dtypes"]["1.num_batches_tracked"] == "int64"
