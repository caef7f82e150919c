"""Synthetic non-IID tasks, deterministic per partition, so runs are comparable across strategies and engines.

``cnn``: 8x8 single-channel images of 3 classes (class templates plus noise), each partition 95% one
class; a Conv + BatchNorm + Linear network trained by full-batch gradient descent (torch).
``linear``: least squares with a partition-specific optimum (numpy only; FedExP's step exceeds 1 there).
"""
from __future__ import annotations

import numpy as np

DEFAULTS = {"strategy": "fedexp", "model": "cnn", "num-server-rounds": 3, "local-steps": 5, "lr": 0.1,
            "fraction-evaluate": 1.0, "min-nodes": 2, "eps": 1e-3, "on-nonfinite": "skip", "buffers": "average", "out-file": "",
            "compress": ""}
DIM = 10


def cfg(config, key):
    """A run-config value (run_simulation passes an empty run config, so every key has a default)."""
    return config[key] if key in config else DEFAULTS[key]


def image_data(partition: int, n: int = 64):
    rng = np.random.default_rng(100 + partition)
    templates = np.random.default_rng(7).standard_normal((3, 1, 8, 8)).astype(np.float32)
    p = np.full(3, 0.025)  # strongly non-IID: 95% of a partition is one class, so the clients' updates disagree
    p[partition % 3] = 0.95  # and FedExP extrapolates (eta 1.5-1.9 in 5 rounds of 4 clients; at 70%, eta = 1)
    y = rng.choice(3, size=n, p=p)
    x = templates[y] + 0.8 * rng.standard_normal((n, 1, 8, 8)).astype(np.float32)
    return x, y.astype(np.int64)


def linear_data(partition: int, n: int = 64):
    rng = np.random.default_rng(1000 + partition)
    w_true = np.linspace(-1.0, 1.0, DIM).astype(np.float32)
    w_true[partition % DIM] += 2.0 * (-1) ** partition
    x = rng.standard_normal((n, DIM)).astype(np.float32)
    return x, (x @ w_true + 0.01 * rng.standard_normal(n)).astype(np.float32)


def initial_linear() -> dict:
    return {"w": np.zeros(DIM, np.float32), "b": np.zeros(1, np.float32)}


def linear_loss(m: dict, x, y) -> float:
    r = x @ m["w"] + m["b"] - y
    return float(np.mean(r * r))


def linear_train(m: dict, x, y, steps: int, lr: float, mu: float = 0.0) -> dict:
    """Full-batch gradient descent on the mean squared error (+ (mu/2) ||theta - theta_sent||^2)."""
    w, b = m["w"].astype(np.float32).copy(), m["b"].astype(np.float32).copy()
    w0, b0 = w.copy(), b.copy()
    for _ in range(steps):
        r = x @ w + b - y
        gw = (2.0 / len(y)) * (x.T @ r) + mu * (w - w0)
        gb = 2.0 * np.mean(r, keepdims=True) + mu * (b - b0)
        w, b = (w - lr * gw).astype(np.float32), (b - lr * gb).astype(np.float32)
    return {"w": w, "b": b}


def make_cnn():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                               torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 3))


def cnn_train(net, x, y, steps: int, lr: float, mu: float = 0.0) -> float:
    import torch

    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    anchor = [p.detach().clone() for p in net.parameters()]
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    net.train()
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(xt), yt)
        if mu:
            loss = loss + 0.5 * mu * sum(((p - a) ** 2).sum() for p, a in zip(net.parameters(), anchor))
        loss.backward()
        opt.step()
    return float(loss.detach())


def cnn_eval(net, x, y) -> tuple[float, float]:
    import torch

    net.eval()
    with torch.no_grad():
        out = net(torch.from_numpy(x))
        return float(torch.nn.functional.cross_entropy(out, torch.from_numpy(y))), \
            float((out.argmax(1).numpy() == y).mean())
