"""Differential privacy fused into the server step: clipping, Gaussian noise generated inside the stats kernel,
adaptive clipping and an accountant.

* mechanisms (:mod:`.mechanisms`): :class:`ServerSideFixedClipping`, :class:`ServerSideAdaptiveClipping`,
  :class:`ClientSideFixedClipping`, :class:`ClientSideAdaptiveClipping`, each a ``fastagg.server`` optimizer's
  ``aggregate=`` (``FedAdam(model, aggregate=ServerSideFixedClipping(1.0, 0.5, 16))``) or run alone with
  :func:`release`;
* the noise (:mod:`.noise`): fastagg's counter-based generator (Philox4x32-10, keyed by seed, round and
  coordinate; not cryptographically secure, see ``noise_source=``) and :func:`gaussian_noise` to materialize it;
* the accounting (:mod:`.accountant`): :class:`PrivacyAccountant` over Google's ``dp-accounting``
  (fastagg's ``[dp]`` extra: ``pip install '.[dp]'`` from a checkout).
"""
from __future__ import annotations

from typing import Any

from ..backends import resolve
from ..compress.fold import densified
from ..rows import attach_base, client_rows
from .accountant import PrivacyAccountant
from .mechanisms import (MECHANISMS, ClientSideAdaptiveClipping, ClientSideFixedClipping, DPResult,
                         ServerSideAdaptiveClipping, ServerSideFixedClipping, adaptive_noise_params, dp_round)
from .noise import NoiseSource, gaussian_noise

__all__ = ["ServerSideFixedClipping", "ServerSideAdaptiveClipping", "ClientSideFixedClipping",
           "ClientSideAdaptiveClipping", "DPResult", "PrivacyAccountant", "NoiseSource", "gaussian_noise",
           "adaptive_noise_params", "release", "MECHANISMS"]


def release(deltas: Any, mechanism, *, weights: Any = None, base: Any = None, backend: str = "auto") -> DPResult:
    """One private release of the clients' mean update by ``mechanism`` (any form :func:`fastagg.fedexp_step`
    accepts, compressed updates included: dequantized rows, one that no quantizer writes left out as a non-finite
    client; with ``base`` the clients' full models, the updates formed against it inside the passes). Returns a
    :class:`DPResult`; the inputs are never written. Advances the mechanism (release count, clipping norm)."""
    deltas = densified(deltas, base)
    rows = client_rows(deltas, name="models" if base is not None else "deltas")
    if base is not None:
        rows, _ = attach_base(rows, base)
    return dp_round(rows, weights, mechanism, resolve(backend, rows.device))
