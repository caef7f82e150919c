"""The FLARE client of test_simulator.py: deterministic local training, w <- w + 0.5 (target_site - w), weighted by
NUM_STEPS_CURRENT_ROUND = 10 x the site's number; saves each global model it receives; site-3 sends a NaN in round
1 when FASTAGG_FLARE_NAN is set."""
import os

import numpy as np

import nvflare.client as flare


def target(pid: int) -> np.ndarray:
    return np.linspace(-1.0, 1.0, 10) + 2.0 * pid * np.eye(10)[pid]


def main() -> None:
    flare.init()
    site = flare.get_site_name()
    pid = int(site.split("-")[-1])
    out = os.environ["FASTAGG_FLARE_OUT"]
    while flare.is_running():
        model = flare.receive()
        w = np.asarray(model.params["numpy_key"], dtype=np.float64)
        np.save(os.path.join(out, f"{site}-round{model.current_round}.npy"), w)
        w_new = w + 0.5 * (target(pid) - w)
        if os.environ.get("FASTAGG_FLARE_NAN") and site == "site-3" and model.current_round == 1:
            w_new[4] = np.nan
        flare.send(flare.FLModel(params={"numpy_key": w_new}, metrics={"loss": float(np.mean((w_new - w) ** 2))},
                                 meta={"NUM_STEPS_CURRENT_ROUND": 10 * pid}))


if __name__ == "__main__":
    main()
