"""The Accumulator's fold of compressed updates (:mod:`fastagg.compress`), read where they lie: ``sum += sum_i w_i
scale x~_i``, ``sq_sum += sum_i w_i scale^2 ||x~_i||^2``, committed in one assignment of a new round."""
from __future__ import annotations

import math

import torch

from ..compress.fold import check_batch, fold, nonfinite_scales


def add_compressed(acc, updates: list, weights: list, ids: list, on_nonfinite: str, scale: float, *,
                   names: list) -> list:
    """Fold compressed updates (fastagg.compress) in one sweep per format that reads them where they lie
    (csrc/quantized.h): ``sum += sum_i w_i scale x~_i``, ``sq_sum += sum_i w_i scale^2 ||x~_i||^2``. A
    malformed update (wrong size, block, an invalid code, a scale <= 0, sparse indices out of range or not
    strictly increasing) raises naming it, nothing folded; one with a NaN/Inf scale or value raises too, or
    (``"skip"``) is left out (False) while the others are folded; sums that would overflow raise, or
    (``"skip"``) fold none of this call."""
    scans: dict = {}  # the sparse updates' C++ scan, shared by the two checks
    check_batch(updates, names, numel=acc._numel, device=acc.device, where="the accumulator's `like`",
                scans=scans)
    if acc._buffer_names:
        raise ValueError(f"a compressed update carries no buffers; the accumulator's `like` has "
                         f"{', '.join(acc._buffer_names)} (accumulate the parameters alone)")
    folded = [True] * len(updates)
    try:
        skipped = nonfinite_scales(updates, names, scans)
        if skipped and on_nonfinite == "raise":
            raise ValueError(f"{', '.join(names[j] for j in skipped)} has a NaN or Inf scale or value, or codes "
                             "standing for values beyond float32")
        for j in skipped:
            folded[j] = False
        live = [j for j in range(len(updates)) if folded[j]]
        if not live:
            return folded
        with acc._lock:
            r = acc._round
            for j in live:
                if ids[j] is not None and r.has_id(ids[j]):
                    raise ValueError(f"client {ids[j]!r} was already folded into this round")
            total = r.total_weight + sum(weights[j] for j in live)
            if not math.isfinite(total):
                if on_nonfinite == "skip":
                    return [False] * len(updates)
                raise ValueError(f"the weights would overflow the round's total weight {r.total_weight:g}")
            # the fold's coefficients and the norms' (w_i scale^2), one host-to-device copy for both
            coef, sq_coef = torch.tensor([[weights[j] * scale for j in live],
                                          [weights[j] * scale * scale for j in live]], dtype=torch.float64,
                                         device=acc.device)
            spare = acc._spare()
            sq, msq = fold([updates[j] for j in live], [names[j] for j in live], coef, acc._backend,
                           init=None if r.zero else r.sum, out=spare, norms=acc._client_norms)
            if sq is None:  # not kept (client_norms=False): the sum alone must stay finite
                sq = torch.full((len(live),), math.nan, dtype=torch.float64, device=acc.device)
                sq_new, fits = r.weighted_sq, torch.isfinite(msq)
            else:
                sq_new = r.weighted_sq + (sq_coef * sq).sum()
                fits = torch.isfinite(msq) & torch.isfinite(sq_new) & (sq <= acc._largest_sq).all()
            if not bool(fits):
                if on_nonfinite == "skip":
                    return [False] * len(updates)
                raise ValueError("the update(s) would overflow the running sums")
            acc._round = r.extended([(norm, ids[j], None) for norm, j in zip((sq * (scale * scale)).unbind(), live)],
                                    sum=spare, scratch=r.sum, weighted_sq=sq_new, total_weight=total)
    except ValueError as e:
        raise ValueError(f"{e}; the accumulator is unchanged") from None
    return folded
