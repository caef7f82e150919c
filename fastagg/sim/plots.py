"""PNG plots of a run against the round (integer ticks): train loss (log scale), test accuracy when the data set
has a test set, and the server step size eta; one line per algorithm: the mean over seeds with a band of +- one
standard deviation."""
from __future__ import annotations

import math
import os

import numpy as np

from . import outdir


def _curves(rows, algorithm, field):
    seeds = sorted({r["seed"] for r in rows if r["algorithm"] == algorithm})
    per_seed = [[r[field] for r in rows if r["algorithm"] == algorithm and r["seed"] == s] for s in seeds]
    n = min(len(c) for c in per_seed)
    arr = np.array([c[:n] for c in per_seed], dtype=float)
    rounds = [r["round"] for r in rows if r["algorithm"] == algorithm and r["seed"] == seeds[0]][:n]
    return np.array(rounds), arr.mean(0), arr.std(0)


def plot(history, out_dir: str) -> list:
    """Writes ``loss.png``, ``eta.png`` (``accuracy.png`` with a test set, ``epsilon.png`` with --dp, ``time.png`` with
    a virtual clock) into ``out_dir``; returns the
    paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    algorithms = list(dict.fromkeys(r["algorithm"] for r in history.rows))
    fields = [("train_loss", "train loss (reported model)", True)]
    if any(not math.isnan(r["test_acc"]) for r in history.rows):
        fields.append(("test_acc", "test accuracy", False))
    fields.append(("eta", "server step size eta", False))
    eps = [r["epsilon"] for r in history.rows if "epsilon" in r]
    if eps and all(math.isfinite(e) for e in eps):  # --dp with noise: the privacy spent (z = 0: infinite, no plot)
        fields.append(("epsilon", f"epsilon spent (delta fixed; {history.config.dp})", False))
    paths = []
    for field, label, log in fields:
        fig, ax = plt.subplots(figsize=(6, 4))
        for a in algorithms:
            x, mean, std = _curves(history.rows, a, field)
            ax.plot(x, mean, label=a)
            ax.fill_between(x, mean - std, mean + std, alpha=0.2)
        if log:
            ax.set_yscale("log")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("round")
        ax.set_ylabel(label)
        ax.set_title(f"{history.config.dataset}: {label}")
        ax.legend()
        fig.tight_layout()
        name = {"train_loss": "loss.png", "test_acc": "accuracy.png", "eta": "eta.png", "epsilon": "epsilon.png"}[field]
        outdir.write_file(out_dir, name, lambda f: fig.savefig(f, format="png", dpi=120), binary=True)
        plt.close(fig)
        paths.append(os.path.join(out_dir, name))
    if any("virtual_time" in r for r in history.rows):  # --client-time: accuracy (or loss) on the virtual clock
        field = "test_acc" if any(not math.isnan(r["test_acc"]) for r in history.rows) else "train_loss"
        fig, ax = plt.subplots(figsize=(6, 4))
        for a in algorithms:
            _, mean, _ = _curves(history.rows, a, field)
            _, when, _ = _curves(history.rows, a, "virtual_time")
            ax.plot(when, mean, label=a)
        ax.set_xlabel("virtual time")
        ax.set_ylabel("test accuracy" if field == "test_acc" else "train loss")
        ax.set_title(f"{history.config.dataset}: on the virtual clock ({history.config.mode})")
        ax.legend()
        fig.tight_layout()
        outdir.write_file(out_dir, "time.png", lambda f: fig.savefig(f, format="png", dpi=120), binary=True)
        plt.close(fig)
        paths.append(os.path.join(out_dir, "time.png"))
    return paths
