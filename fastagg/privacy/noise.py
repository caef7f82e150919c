"""Gaussian noise from a counter-based generator: the noise of flat coordinate ``j`` in round ``r`` is a pure
function of ``(seed, r, j)``.

Definition (every backend; csrc/noise.h)::

    (x0, x1, x2, x3) = Philox4x32-10(counter = (j // 4 as two 32-bit words, r as two 32-bit words), key = seed)
    u1 = x0 2^-32 + 2^-33,  u2 = x1 2^-32                  (float32; x2, x3 give the second pair)
    z  = sqrt(-2 ln u1) cos(2 pi u2)  or  sqrt(-2 ln u1) sin(2 pi u2)       (Box-Muller), lane j mod 4

So a round's noise is reproducible from its seed on every backend and independent of the thread count, the block
partition and the update's layout (per-layer lists, state_dicts and flat buffers get the same noise at the same
flat coordinate). The Philox words are bit-identical across backends (tested against Random123's known answers);
the float32 Box-Muller differs by a few units in the last place between the C++ polynomials, the GPU's
``log``/``sin``/``cos`` and the reference backend's float64 transform (|difference| < 1e-5, tested). The
largest value the transform can give is ``sqrt(2 * 33 ln 2) = 6.76`` (u1 >= 2^-33): the tail beyond is cut, as
every floating-point sampler cuts it somewhere.

**Not a cryptographically secure generator** (nor is numpy's, which Flower uses, or torch's): an adversary who
learns the seed can subtract the noise. Keep the seed secret (the default is drawn from ``secrets``), or supply
noise of your own with ``noise_source=`` (see :class:`NoiseSource`).
"""
from __future__ import annotations

import secrets
from typing import Protocol

import torch

from .._checks import check_int
from ..backends import gaussian, resolve

SEED_BITS = 64
COUNT_QUERY_ROUND = 1 << 63  # rounds with the top bit set key the adaptive clip count's noise, never an update's


class NoiseSource(Protocol):
    """Noise of the caller's (a cryptographically secure source, a hardware generator): called once per release
    with the number of coordinates, the release's round index, the dtype and the device; returns a tensor of that
    many N(0, 1) samples, which fastagg scales by the mechanism's noise std and adds to the estimate in one more
    pass (the fused in-kernel noise is then not used)."""

    def __call__(self, numel: int, round: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor: ...


def check_seed(seed) -> int:
    """A seed as fastagg keys Philox with: an integer in [0, 2^64); None draws one from ``secrets``."""
    if seed is None:
        return secrets.randbits(SEED_BITS)
    return check_int(seed, "seed", maximum=(1 << SEED_BITS) - 1,
                     what="an integer in [0, 2^64) (or None: drawn from the secrets module)")


def check_round(round) -> int:
    return check_int(round, "round", maximum=COUNT_QUERY_ROUND - 1, what="an integer in [0, 2^63)")


def gaussian_noise(numel: int, *, seed: int, round: int = 0, first: int = 0, device="cpu",
                   backend: str = "auto") -> torch.Tensor:
    """``z_j ~ N(0, 1)`` for flat coordinates ``j = first, ..., first + numel - 1`` of round ``round`` (float32), from
    fastagg's counter-based generator (module docstring): the noise the DP mechanisms add, materialized."""
    numel = check_int(numel, "numel")
    first = check_int(first, "first", maximum=(1 << 62) - numel, what="an integer >= 0 (with first + numel < 2^62)")
    seed, round = check_seed(seed), check_round(round)
    out = torch.empty(numel, dtype=torch.float32, device=device)
    resolve(backend, out.device).gaussian_noise(out=out, seed=seed, round=round, first=first)
    return out


def count_noise(seed: int, round: int) -> float:
    """One N(0, 1) sample for the adaptive clipping count of ``round`` (a stream of its own: top bit of the round
    set), from the reference backend (one value)."""
    return float(gaussian(1, seed=seed, round=COUNT_QUERY_ROUND | round)[0])
