"""Plain float64 torch implementations of the server rules, written straight from docs/ALGORITHMS.md sections 1-5,
independently of fastagg's kernels: the oracle the optimizer tests compare against."""
from __future__ import annotations

import torch


def weighted_mean(deltas, weights):
    p = torch.full((deltas.shape[0],), 1.0 / deltas.shape[0], dtype=torch.float64) if weights is None else \
        torch.as_tensor(weights, dtype=torch.float64) / float(sum(weights))
    return p, p @ deltas


def fedexp_eta(p, deltas, mean, eps, halve=True):
    avg = float(p @ deltas.square().sum(1))
    den = float(mean.square().sum()) + eps
    return 1.0 if den == 0 else max(1.0, avg / ((2 if halve else 1) * den))


class Oracle:
    def __init__(self, w0, **h):
        self.w = w0.double().clone()
        self.h = h
        self.t = 0  # rounds done
        self.eval = self.w.clone()

    def broadcast(self):
        return self.w


class FedAvg(Oracle):
    def step(self, d, n):
        _, mean = weighted_mean(d, n)
        self.w = self.w + self.h.get("lr", 1.0) * mean


class FedAvgM(Oracle):
    def step(self, d, n):
        _, mean = weighted_mean(d, n)
        pg = -mean
        mu, lr = self.h.get("momentum", 0.0), self.h.get("lr", 1.0)
        self.v = pg if self.t == 0 else mu * self.v + pg
        direction = pg + mu * self.v if self.h.get("nesterov") else self.v
        self.w = self.w - lr * direction
        self.t += 1


class FedExP(Oracle):
    def step(self, d, n):
        p, mean = weighted_mean(d, n)
        eps = self.h["eps"] * (d.shape[0] if self.h.get("eps_mode") == "official" else 1)
        eps *= self.h.get("eps_decay", 1.0) ** (self.t + 1)
        self.eta = fedexp_eta(p, d, mean, eps, halve=not self.h.get("exact_projection", False))
        old = self.w
        self.w = self.w + self.eta * mean
        self.eval = (old + self.w) / 2
        self.t += 1


class FedExPM(Oracle):
    def step(self, d, n):
        p, mean = weighted_mean(d, n)
        beta, eps = self.h.get("beta", 0.9), self.h["eps"]
        if self.t == 0:
            self.v, self.a, self.ms = torch.zeros_like(mean), 0.0, []
        self.v = mean + beta * self.v
        m_t = float(p @ d.square().sum(1))
        self.ms.append(m_t)
        self.a = m_t + (beta / 2) * self.a
        den = float(self.v.square().sum()) + eps
        self.eta = 1.0 if den == 0 else self.a / (2 * den)
        old = self.w
        self.w = self.w + self.eta * self.v
        self.eval = (old + self.w) / 2
        self.t += 1


class ScaffoldExP(Oracle):
    def step(self, d, n, dc):
        if self.t == 0:
            self.c = torch.zeros_like(self.w)
        p, mean = weighted_mean(d, n)
        self.eta = self.h["lr"] if "lr" in self.h else fedexp_eta(p, d, mean, self.h["eps"])
        old = self.w
        self.w = self.w + self.eta * mean
        self.eval = (old + self.w) / 2
        self.c = self.c + (d.shape[0] / self.h["num_clients"]) * dc.mean(0)
        self.t += 1


class FedACG(Oracle):
    def broadcast(self):
        m = getattr(self, "m", torch.zeros_like(self.w))
        return self.w + self.h.get("lam", 0.85) * m

    def step(self, d, n):
        if self.t == 0:
            self.m = torch.zeros_like(self.w)
        _, mean = weighted_mean(d, n)
        self.m = self.h.get("lam", 0.85) * self.m + mean
        self.w = self.w + self.m
        self.t += 1


class _Adam(Oracle):
    def step(self, d, n):
        _, g = weighted_mean(d, n)
        b1, b2 = self.h.get("betas", (0.9, 0.99))
        tau, lr = self.h.get("tau", 0.0), self.h["lr"]
        if self.t == 0:
            self.m, self.v, self.vhat = torch.zeros_like(g), torch.zeros_like(g), torch.zeros_like(g)
        kind = self.kind
        self.m = g if kind == "adagrad" else b1 * self.m + (1 - b1) * g
        if kind in ("adam", "ams"):
            self.v = b2 * self.v + (1 - b2) * g * g
        elif kind == "yogi":
            self.v = self.v - (1 - b2) * g * g * torch.sign(self.v - g * g)
        else:
            self.v = self.v + g * g
        den = self.v
        if kind == "ams":
            self.vhat = torch.maximum(torch.maximum(self.vhat, self.v), torch.tensor(self.h.get("vhat_floor", 1e-8)))
            den = self.vhat
        eff = lr
        bc = self.h.get("bias_correction", "flower" if kind == "adam" else None)
        if bc is not None:
            k = self.t + (2 if bc == "flower" else 1)
            eff = lr * (1 - b2 ** k) ** 0.5 / (1 - b1 ** k)
        self.w = self.w + eff * self.m / (den.sqrt() + tau)
        self.t += 1


class FedAdam(_Adam):
    kind = "adam"


class FedYogi(_Adam):
    kind = "yogi"


class FedAdagrad(_Adam):
    kind = "adagrad"


class FedAMS(_Adam):
    kind = "ams"
