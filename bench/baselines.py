"""What users run today, written as fairly as we can, for the benchmarks to race against.

Each returns (mean, sq_norms, eta) for FedExP with uniform or given weights p (a float64 numpy/torch vector).
"""
from __future__ import annotations

from functools import reduce

import numpy as np
import torch


def fedexp_eta(avg_sq: float, mean_sq: float, eps: float) -> float:
    return max(1.0, avg_sq / (2 * (mean_sq + eps))) if mean_sq + eps > 0 else 1.0


def torch_gemv(x: torch.Tensor, p: torch.Tensor, eps: float, out: torch.Tensor | None = None):
    """Two BLAS-backed passes: mean = p @ X (GEMV), norms = vector_norm over rows."""
    mean = torch.mv(x.t(), p, out=out)
    sq = torch.linalg.vector_norm(x, dim=1).square()
    return mean, sq, fedexp_eta(float(p.double() @ sq.double()), float(mean.double().square().sum()), eps)


def torch_chunked(x: torch.Tensor, p: torch.Tensor, eps: float, out: torch.Tensor | None = None,
                  chunk: int = 1 << 15):
    """One pass through the cache: column chunks small enough that the second read of a chunk hits L2."""
    m, d = x.shape
    mean = torch.empty(d, dtype=x.dtype) if out is None else out
    sq = torch.zeros(m, dtype=torch.float64)
    for c0 in range(0, d, chunk):
        xc = x[:, c0:c0 + chunk]
        torch.mv(xc.t(), p, out=mean[c0:c0 + chunk])
        sq += torch.linalg.vector_norm(xc, dim=1).double().square()
    return mean, sq, fedexp_eta(float(p.double() @ sq), float(mean.double().square().sum()), eps)


def flower_numpy(layers_per_client: list, num_examples: list, eps: float):
    """Flower's ``aggregate`` (per-layer numpy: weight every layer, reduce with np.add, divide) plus the per-layer
    squared norms a FedExP strategy on Flower computes per client."""
    total = sum(num_examples)
    weighted = [[layer * n for layer in layers] for layers, n in zip(layers_per_client, num_examples)]
    mean = [reduce(np.add, layer_updates) / total for layer_updates in zip(*weighted)]
    sq = np.array([sum(float(np.sum(layer ** 2)) for layer in layers) for layers in layers_per_client])
    p = np.asarray(num_examples, dtype=np.float64) / total
    mean_sq = sum(float(np.sum(layer ** 2)) for layer in mean)
    return mean, sq, fedexp_eta(float(p @ sq), mean_sq, eps)
