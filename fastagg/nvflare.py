"""fastagg inside NVIDIA FLARE: a ``ModelAggregator`` that streams each client's result into a
:class:`fastagg.Accumulator` as it arrives and ends the round with one fused fastagg server step::

    from fastagg.nvflare import FastaggAggregator
    recipe = FedAvgRecipe(..., aggregator=FastaggAggregator(rule="fedexp", hyper={"eps": 1e-3}))

A round, with FLARE's ``FedAvg`` workflow (any controller that calls ``reset_stats`` / ``accept_model`` /
``aggregate_model`` works the same way):

* the model FLARE sends (its ``BEFORE_TRAIN_TASK`` event, the first of the round) becomes the round's base and
  the starting point of the server optimizer's params (tensors the aggregator owns, in the model's dtypes). It is
  read where it lies, not copied: the momentum family's step reads it where it writes the new params (one pass),
  the other rules copy it in when the round is aggregated. So the arrays sent must not be changed in place during
  the round (FLARE replaces its global model, never writes into it), as the quantized results held until they are
  folded;
* ``accept_model`` folds one result: a ``FULL`` result's update ``params - base`` is formed inside the kernel (never
  stored), a ``DIFF`` result is the update. The weight is ``aggregation_weights[site]`` (default 1) times the
  result's ``NUM_STEPS_CURRENT_ROUND`` (default 1), as FLARE's own FedAvg weighs. Small results are checked, copied
  and held until ``batch_bytes`` (default 16 MiB) of them or 16 are waiting, then folded together in one sweep (the
  running sum read and written once for all of them: a round of small models costs its bytes, not a kernel call
  and its checks per result); a held result found to hold NaN/Inf then is left out with a warning naming the site
  (``accept_model`` returned True for it). A larger result is folded alone as it arrives, as are all with
  ``on_nonfinite="raise"`` or ``dp=``. Memory: the running sum, the base and at most ``batch_bytes`` of held
  copies, whatever the number of clients; results can arrive on several threads at once;
* ``aggregate_model`` takes the rule's step on the sums and returns the new global model as a ``FULL`` FLModel,
  in the form it came in (numpy arrays or torch tensors, same dtypes), plus the weighted average of the numeric
  metrics. The arrays are the params' own storage, handed over (no copy): the aggregator takes fresh storage and
  never writes what it returned again. The FedAvg family's rounds keep no client norms (``client_norms=False``:
  a BLOCKWISE8 fold a third lighter).

Rules (``rule=``, hyper-parameters in ``hyper=``, those of the :mod:`fastagg.server` class of that name):
``fedavg``, ``fedavgm``, ``fedexp``, ``fedexpm``, ``fedadam``, ``fedyogi``, ``fedadagrad``, ``fedams``.
Entries named like torch buffers (``running_mean``, ``running_var``, ``num_batches_tracked``) and integer entries
are averaged, never stepped (fastagg's buffer rule). The optimizer's state (momentum, Adam moments) lives as long
as the aggregator.

Central differential privacy (``dp=``, the server-side mechanisms of :mod:`fastagg.privacy`; FLARE has client
filters but no noise): ``dp={"mechanism": "server-fixed", "noise_multiplier": 1.0, "clipping_norm": 0.5,
"num_sampled_clients": 8}`` (or ``"server-adaptive"`` with ``initial_clipping_norm``, ``target_clipped_quantile``,
``clip_norm_lr``, ``clipped_count_stddev``; optional ``seed``). Each result's update is clipped as it arrives (its
norm read once, then folded with the clip scale as its coefficient), the results are averaged uniformly (the noise
is calibrated to the sensitivity ``C / n`` of that mean, so site weights and NUM_STEPS_CURRENT_ROUND do not apply),
and ``aggregate_model`` releases ``sum / M + N(0, (z C / n)^2)`` in one pass over the sum with the noise written by
the kernel, then the rule steps on the release. The mechanism's state (seed, release count, clipping norm) is in
:meth:`state_dict`.

Compressed results: a result quantized by FLARE's ``ModelQuantizer("blockwise8")`` filter (bitsandbytes'
dynamic 8-bit code, one absmax per 4096 elements of each tensor) needs no ``ModelDequantizer`` on the server: a
``DIFF`` result is folded where it lies (codes, absmax and code book read by the fused kernel,
:class:`fastagg.compress.Codebook8`); a ``FULL`` one (or any with ``dp=`` or a model with buffers) is dequantized
once into the model's dtype and folded as above. Other quantizations (fp16, fp4, nf4) still go through FLARE's
dequantizer filter.

What a bad result gets: NaN/Inf, or one whose weighted update would overflow the running sum, is left out of the
round with a warning (``on_nonfinite="skip"``, the default: a server must survive one broken client) or raises
(``"raise"``); keys, shapes or dtypes other than the model's, a result from another round, or a site that already
sent one this round are left out with a warning naming the site. A round without any folded result, or whose
step would make the model non-finite (a step size of 1e39 with float32 params), keeps the model. Needs NVIDIA FLARE
(fastagg's ``[nvflare]`` extra: ``pip install '.[nvflare]'`` from a checkout; tested with nvflare 2.9.0); ``import fastagg`` never imports it.
"""
from __future__ import annotations

import logging
import math
import threading
import warnings
from operator import attrgetter, methodcaller
from typing import Any

import numpy as np
import torch

try:
    from nvflare.apis.event_type import EventType
    from nvflare.apis.fl_context import FLContext
    from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
    from nvflare.app_common.aggregators.model_aggregator import ModelAggregator
    from nvflare.app_common.app_constant import AppConstants
    from nvflare.app_common.app_event_type import AppEventType
    from nvflare.app_common.utils.fl_model_utils import FLModelUtils
except ImportError as e:  # pragma: no cover - exercised in a process without nvflare (tests/test_nvflare.py)
    from ._optional import install_hint
    raise ImportError(f"fastagg.nvflare needs NVIDIA FLARE: {install_hint('nvflare')}") from e

from . import client, privacy, server
from .compress.codebook import Codebook8, LayerwiseUpdate, flat_tensor
from .stream import Accumulator

RULES = {"fedavg": server.FedAvg, "fedavgm": server.FedAvgM, "fedexp": server.FedExP, "fedexpm": server.FedExPM,
         "fedadam": server.FedAdam, "fedyogi": server.FedYogi, "fedadagrad": server.FedAdagrad,
         "fedams": server.FedAMS}
# fastagg.robust's rules: each needs all of a round's results, which a streaming aggregator does not keep
NEEDS_ALL_RESULTS = ("median", "trimmed_mean", "meamed", "krum", "multikrum", "bulyan", "geometric_median",
                     "geomed", "norm_bound", "normbound")
_log = logging.getLogger(__name__)
WEIGHT_KEY = "NUM_STEPS_CURRENT_ROUND"  # FLARE's FLMetaKey.NUM_STEPS_CURRENT_ROUND
# float results copied and held to be folded together: at most this many bytes of them
# (FastaggAggregator(batch_bytes=...)). A round of small models (a 1/8-width ResNet-18: 1 MB a result) folds 16
# results in one sweep -- it costs bytes, not a kernel call and its checks per result -- while a larger result,
# whose copy would cost what the shared sweep saves, folds alone as it arrives
BATCH_BYTES = 16 << 20


class FastaggAggregator(ModelAggregator):
    """NVIDIA FLARE aggregator: FedAvg, FedExP or an Adam-family server step over clients streamed into a
    :class:`fastagg.Accumulator` (O(model) memory). See the module docstring for what a round does.

    ``rule``: one of :data:`RULES`; ``hyper``: keyword arguments of its :mod:`fastagg.server` class (e.g.
    ``{"eps": 1e-3}`` for FedExP, ``{"lr": 0.01, "betas": [0.9, 0.99]}`` for FedAdam); ``aggregation_weights``:
    a weight per site name (default 1); ``device``: where the sums and the model live (``"cuda"`` for large
    models); ``backend``: fastagg's backend; ``on_nonfinite``: ``"skip"`` or ``"raise"``; ``batch_bytes``: how many
    bytes of float results may wait to be folded together (0: each alone, as it arrives).
    """

    def __init__(self, rule: str = "fedavg", hyper: dict | None = None, aggregation_weights: dict | None = None,
                 device: str = "cpu", backend: str = "auto", on_nonfinite: str = "skip", dp: dict | None = None,
                 batch_bytes: int = BATCH_BYTES):
        super().__init__()
        if not isinstance(batch_bytes, int) or isinstance(batch_bytes, bool) or batch_bytes < 0:
            raise ValueError(f"batch_bytes must be an int >= 0 (0: fold every result alone); got {batch_bytes!r}")
        if rule in NEEDS_ALL_RESULTS:
            raise ValueError(f"rule {rule!r} is a robust rule: it needs every site's result of a round at once "
                             "(medians, Krum's distances), and this aggregator streams each result into running "
                             "sums (O(model) memory, results not kept). Robust rules run where every reply is held: "
                             "fastagg.flower's FedMedian/FedTrimmedAvg/Krum/MultiKrum/Bulyan, fastagg.robust."
                             f"aggregate, or a server optimizer's aggregate=. Streaming rules: {', '.join(RULES)}")
        if rule not in RULES:
            raise ValueError(f"rule must be one of {', '.join(RULES)}; got {rule!r}")
        if on_nonfinite not in ("skip", "raise"):
            raise ValueError(f"on_nonfinite must be 'skip' or 'raise'; got {on_nonfinite!r}")
        if hyper is not None and not isinstance(hyper, dict):
            raise TypeError(f"hyper must be a dict of the rule's keyword arguments; got {type(hyper).__name__}")
        if aggregation_weights is not None and not isinstance(aggregation_weights, dict):
            raise TypeError(f"aggregation_weights must be a dict of site name -> weight; got "
                            f"{type(aggregation_weights).__name__}")
        hyper = dict(hyper or {})
        if "betas" in hyper:  # a job config carries lists
            hyper["betas"] = tuple(hyper["betas"])
        for site, w in (aggregation_weights or {}).items():
            if not isinstance(w, (int, float)) or isinstance(w, bool) or not math.isfinite(w) or w < 0:
                raise ValueError(f"aggregation_weights[{site!r}] must be a finite number >= 0; got {w!r}")
        RULES[rule](torch.zeros(1), **hyper)  # refuse unknown or invalid hyper-parameters now, not in round 1
        self._mechanism = _dp_mechanism(dp)
        # attribute names = constructor argument names: FLARE's job export reads them back
        self.rule, self.hyper, self.aggregation_weights = rule, hyper, dict(aggregation_weights or {})
        self.device, self.backend, self.on_nonfinite = device, backend, on_nonfinite
        self.dp = None if dp is None else dict(dp)
        self.batch_bytes = batch_bytes
        self._clipped: list = []  # dp: whether each folded result was clipped
        self._lock = threading.RLock()
        self._books = _Books()  # BLOCKWISE8 code books, converted and checked once
        self._opt: server.ServerOptimizer | None = None
        self._restored: dict | None = None  # a state_dict loaded before the first round
        self._params: dict | None = None   # the optimizer's params: torch tensors, the model's names and dtypes
        self._numpy: bool = True           # the form to return (what FLARE sent)
        self._acc: Accumulator | None = None        # the round's, while a round is open
        self._round_acc: Accumulator | None = None  # the one reused round after round
        self._base: dict | None = None     # the model sent this round (the clients' starting point)
        self._round: Any = None
        self._sites: set = set()
        self._metrics: dict = {}  # metric name -> [sum of weight * value, sum of weight] over the results reporting it
        self._pending: list = []  # BLOCKWISE8 results checked and waiting to be folded together (PENDING_MAX)
        self._held: list = []     # copies of float results checked and waiting to be folded together (batch_bytes)
        self._held_bytes, self._held_weight = 0, 0.0

    # -- FLARE events: the model sent this round -------------------------------------------------------------
    def handle_event(self, event_type: str, fl_ctx: FLContext):
        super().handle_event(event_type, fl_ctx)
        if event_type == AppEventType.BEFORE_TRAIN_TASK:
            with self._lock:
                if self._base is None:
                    shareable = fl_ctx.get_prop(AppConstants.TRAIN_SHAREABLE)
                    self.set_model(FLModelUtils.from_shareable(shareable))
        elif event_type == EventType.END_RUN:
            with self._lock:
                self._acc = self._base = None
                self._held, self._held_bytes, self._held_weight = [], 0, 0.0

    def set_model(self, model: FLModel) -> None:
        """The model this round's clients start from (called on FLARE's ``BEFORE_TRAIN_TASK``; call it yourself
        when driving the aggregator from another controller)."""
        if not model.params:
            raise ValueError("the global model has no params: give the recipe a model (initial params)")
        with self._lock:
            base = {k: _to_tensor(v, k, self.device) for k, v in model.params.items()}
            self._numpy = not any(isinstance(v, torch.Tensor) for v in model.params.values())
            if self._params is None or _layout(self._params) != _layout(base):
                params = {k: v.clone() for k, v in base.items()}
                opt = RULES[self.rule](params, backend=self.backend, on_nonfinite=self.on_nonfinite, **self.hyper)
                if self._restored:
                    restored, self._restored = self._restored, None  # a state that does not fit fails this once
                    opt.load_state_dict(restored)
                # one accumulator for every round (reset each round): its sum and spare are allocated once
                # the FedAvg family steps on the sum alone: the folds skip the clients' norms (client_norms)
                acc = Accumulator(like=params, backend=self.backend, client_norms=type(opt).needs_client_norms)
                self._params, self._opt, self._restored, self._round_acc = params, opt, None, acc
            else:  # the params are set from base by the step itself (ServerOptimizer._step_from): no copy here
                self._round_acc.reset()
            self._base, self._round = base, model.current_round
            self._acc = self._round_acc
            self._sites, self._metrics = set(), {}
            self._clipped, self._pending, self._held, self._held_bytes, self._held_weight = [], [], [], 0, 0.0

    # -- ModelAggregator ---------------------------------------------------------------------------------------
    def reset_stats(self):
        with self._lock:
            self._base, self._acc, self._pending = None, None, []
            self._held, self._held_bytes, self._held_weight = [], 0, 0.0
            self._sites, self._metrics = set(), {}

    def accept_model(self, model: FLModel) -> bool:
        """Fold one client's result into the round (see the module docstring). Returns whether it was folded, or
        held to be folded with others (a held result found to hold NaN/Inf then is left out with a warning)."""
        meta = model.meta or {}
        site = meta.get("client_name") or "unknown site"
        with self._lock:  # Accumulator.add folds under its own lock anyway; this one also orders the checks
            if self._acc is None:
                return self._refuse(site, "arrived before the round's model was sent")
            if model.current_round is not None and self._round is not None and model.current_round != self._round:
                return self._refuse(site, f"is from round {model.current_round}, not {self._round}")
            if site in self._sites:
                return self._refuse(site, "already sent a result this round")
            try:
                parts = _blockwise8_parts(model.params, meta, self._base, self._books)
                parts, nan_books = parts if parts is not None else (None, None)
                folds_in_place = parts is not None and model.params_type == ParamsType.DIFF and \
                    self._mechanism is None and not self._acc._buffer_names
                if parts is not None and not folds_in_place:  # FULL, buffers or dp: one dequantized copy
                    params = {k: p.dequantize(torch.float64).reshape(self._base[k].shape).to(self._base[k].dtype)
                              for k, p in parts.items()}
                else:
                    params = parts if folds_in_place else _client_params(model.params, self._base)
            except (TypeError, ValueError) as e:
                return self._refuse(site, str(e))
            admin, steps = float(self.aggregation_weights.get(site, 1.0)), _num_steps(meta)
            weight = admin * steps
            if not math.isfinite(weight) or not math.isfinite(self._acc.total_weight + self._held_weight + weight):
                return self._refuse(site, f"has weight {admin:g} x {steps:g} steps, which would overflow the round's "
                                    "total weight")
            base = None if model.params_type == ParamsType.DIFF else self._base  # FULL (FLARE's default)
            coef, clipped = weight, False
            if self._mechanism is not None:  # dp: the update's norm (one read), then folded clipped, uniformly
                norm = float(client.update_norms([params], base if base is not None else
                                                 {k: torch.zeros_like(v) for k, v in self._base.items()},
                                                 backend=self.backend)[0])
                coef = privacy.mechanisms.clip_scale(norm, self._mechanism.clipping_norm)
                if coef != coef:
                    if self.on_nonfinite == "raise":
                        raise ValueError(f"the result of {site} contains NaN or Inf")
                    return self._refuse(site, "contains NaN or Inf")
                clipped = coef < 1
            if folds_in_place:  # FLARE's BLOCKWISE8 update read where it lies (fastagg.compress.Codebook8)
                update = LayerwiseUpdate(tuple(params.values()))
                problem = _blockwise8_problem(update, nan_books)
                if problem is not None:
                    if self.on_nonfinite == "raise":
                        raise ValueError(f"the result of {site} {problem}")
                    return self._refuse(site, problem)
                self._pending.append((update, coef, site))
                if len(self._pending) >= PENDING_MAX:
                    self._fold_pending()
                folded = True
            elif self.on_nonfinite == "skip" and self._mechanism is None and \
                    sum(map(_NBYTES, params.values())) <= self.batch_bytes - self._held_bytes:
                # a copy: the caller may reuse or change its arrays once accept_model returns, and a view would
                # keep a whole receive buffer alive
                held = dict(zip(params, _copies(list(params.values()))))
                self._held.append((held, coef, base is not None, site, model.metrics, weight))
                self._held_bytes += sum(map(_NBYTES, held.values()))
                self._held_weight += weight
                self._sites.add(site)
                if len(self._held) >= PENDING_MAX:
                    self._fold_held()
                return True
            else:
                self._fold_held()  # (the results held before this one first: the fold order is the arrival order)
                folded = self._acc.add(params, coef, base=base, on_nonfinite=self.on_nonfinite, client_id=site)
            if not folded:
                return self._refuse(site, "contains NaN or Inf (or would overflow the running sum)")
            self._clipped.append(clipped)
            self._sites.add(site)
            self._add_metrics(model.metrics, weight)
            return True

    def _add_metrics(self, metrics: dict | None, weight: float) -> None:
        for k, v in (metrics or {}).items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                acc = self._metrics.setdefault(k, [0.0, 0.0])  # (a site that does not report k does not
                acc[0] += weight * float(v)                       # count toward k's average: FLARE's helper)
                acc[1] += weight

    def _fold_held(self) -> None:
        """Fold the held float results (checked when accepted) in one sweep of the stats kernel for each run of
        them with the same base (FULL results: the model sent; DIFF: none): the running sum, and for FULL results
        the model, read and written once for all of them instead of once each -- what makes a round of small
        results cost bytes rather than calls, and a large one's sum traffic a fraction. A result left out then
        (NaN/Inf, or a sum that would overflow) is named in a warning, as at once; its metrics never count."""
        held, self._held, self._held_bytes, self._held_weight = self._held, [], 0, 0.0
        start = 0
        while start < len(held):
            end = start
            while end < len(held) and held[end][2] == held[start][2]:
                end += 1
            run = held[start:end]
            base = self._base if run[0][2] else None
            try:
                folded = self._acc.add_many([h[0] for h in run], [h[1] for h in run], base=base,
                                            client_ids=[h[3] for h in run], on_nonfinite="skip")
            except (TypeError, ValueError):  # (what the Accumulator alone refuses: found result by result)
                folded = []
                for h in run:
                    try:
                        folded.append(self._acc.add(h[0], h[1], base=base, client_id=h[3], on_nonfinite="skip"))
                    except (TypeError, ValueError) as e:
                        self._refuse(h[3], str(e))
                        folded.append(None)
            for h, ok in zip(run, folded):
                if ok:
                    self._clipped.append(False)
                    self._add_metrics(h[4], h[5])
                else:
                    if ok is not None:
                        self._refuse(h[3], "contains NaN or Inf (or would overflow the running sum); accepted, then "
                                     "left out when folded")
                    self._sites.discard(h[3])
            start = end

    def aggregate_model(self) -> FLModel:
        """The rule's step on the round's sums; the new global model (FULL) and the weighted mean metrics."""
        with self._lock:
            if self._base is None:
                raise RuntimeError("aggregate_model() before any model was sent this round")
            self._fold_pending()
            self._fold_held()
            acc, metrics = self._acc, None
            if acc.num_clients == 0 or acc.total_weight == 0:
                self.warning("fastagg: no client result was folded this round; the global model is unchanged")
                self._opt._assign(self._base)
            else:
                if self._mechanism is not None:  # the private release (noise in the kernel), stepped on as one update
                    res = privacy.mechanisms.release_from_sum(acc.weighted_sum, self._clipped, self._mechanism,
                                                              self._opt._backend)
                    self.info(f"fastagg dp: {acc.num_clients} results, {sum(self._clipped)} clipped to "
                              f"{res.clipping_norm:.4g}, noise std {res.noise_std:.4g}")
                    stats = self._opt._step_from(self._base, [self._opt.layout.unflatten(res.estimate)])
                else:  # "skip": a step that would put Inf/NaN in the model keeps it
                    stats = self._opt._step_from(self._base, acc)  # (params = base + step, one pass)
                if bool(stats.finite):
                    self.info(f"fastagg {self.rule}: {acc.num_clients} clients, step size {float(stats.eta):.4g}")
                else:
                    self.warning(f"fastagg {self.rule}: the step over {acc.num_clients} clients would make the "
                                 "model non-finite; the global model is unchanged")
                metrics = {k: total / w for k, (total, w) in self._metrics.items() if w > 0} or None
            out = self._hand_over()
            self._base, self._acc = None, None
            return FLModel(params_type=ParamsType.FULL, params=out, metrics=metrics)

    def _hand_over(self) -> dict:
        """The new model in the form FLARE sent, without a copy: each parameter's storage is given away (a numpy
        view of it; a copy from a GPU) and the parameter takes fresh storage, first written by the next round's
        step (which reads that round's model where it writes them). So the model handed out is never written
        again here and a round costs no model-sized copy."""
        out = {}
        for k, p in self._params.items():
            t = p.data
            p.data = torch.empty_like(t)
            out[k] = t.cpu().numpy() if self._numpy else t
        self._opt._follow()  # the optimizer's views move to the fresh storage now, not at its next step
        return out

    def state_dict(self) -> dict:
        """The server optimizer's state (momentum, moments, round counter), for a checkpoint; ``{}`` before the
        first round. With ``dp=``, the mechanism's state too (seed, release count, clipping norm)."""
        with self._lock:
            state = dict(self._restored or {}) if self._opt is None else self._opt.state_dict()
            if self._mechanism is not None:
                state = {**state, "fastagg_dp": self._mechanism.state_dict()}
            return state

    def load_state_dict(self, state: dict) -> None:
        """Resume the server optimizer from :meth:`state_dict` (e.g. after a server restart): loaded now if the
        first round has begun, else when it begins (the optimizer is built from the first model sent). A state of
        another rule is refused here; one of another model size when the first round begins, which then raises
        once and starts from a fresh state (it never fails every later round)."""
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict from FastaggAggregator.state_dict(), got {type(state).__name__}")
        state = dict(state)
        dp_state = state.pop("fastagg_dp", None)
        if (dp_state is None) != (self._mechanism is None):
            raise ValueError("the state is of an aggregator " + ("with" if dp_state is not None else "without") +
                             " dp=; this one is " + ("without" if self._mechanism is None else "with") + " it")
        if dp_state is not None:
            self._mechanism.load_state_dict(dp_state)
        rule_cls = RULES[self.rule].__name__
        meta = state.get("fastagg")  # torch's checkpoint shape keeps the class there; fastagg's format 1 at the top
        of = meta.get("optimizer") if isinstance(meta, dict) else state.get("optimizer")
        if state and of != rule_cls:  # caught now, not at the first round (which it would fail)
            raise ValueError(f"the state is of {of!r}; this aggregator's rule {self.rule!r} keeps {rule_cls}'s")
        with self._lock:
            if self._opt is not None:
                self._opt.load_state_dict(state)
            else:
                self._restored = dict(state)

    def _fold_pending(self) -> None:
        """Fold the waiting BLOCKWISE8 results in one sweep per layer (the running sum read and written once for all
        of them, not once each). They were checked when accepted; sums that would overflow are retried one result
        at a time, and a result that still overflows is left out with a warning."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        updates, coefs, sites = zip(*pending)
        folded = self._acc.add_many(list(updates), list(coefs), client_ids=list(sites), on_nonfinite="skip")
        if all(folded):
            return
        for u, c, site in pending:
            if not self._acc.add(u, c, client_id=site, on_nonfinite="skip"):
                self._refuse(site, "would overflow the running sum (accepted, then left out when folded)")
                self._sites.discard(site)

    def _refuse(self, site: str, why: str) -> bool:
        self.warning(f"fastagg: the result of {site} {why}; left out of the round")
        return False

    def warning(self, message: str):  # outside a FLARE run (no fl_ctx): the component's logger alone
        super().warning(message) if self.fl_ctx is not None else _log.warning(message)

    def info(self, message: str):
        super().info(message) if self.fl_ctx is not None else _log.info(message)


DP_MECHANISMS = {"server-fixed": privacy.ServerSideFixedClipping, "server-adaptive": privacy.ServerSideAdaptiveClipping}


def _dp_mechanism(dp: dict | None):
    """``dp=``'s mechanism (a dict, as a FLARE job config carries it), checked now."""
    if dp is None:
        return None
    if not isinstance(dp, dict):
        raise TypeError(f"dp must be a dict (mechanism, noise_multiplier, ...), got {type(dp).__name__}")
    kw = dict(dp)
    kind = kw.pop("mechanism", None)
    if kind not in DP_MECHANISMS:
        raise ValueError(f"dp['mechanism'] must be one of {', '.join(DP_MECHANISMS)} (client-side clipping needs "
                         f"the sites to clip: not in FLARE), got {kind!r}")
    try:
        return DP_MECHANISMS[kind](**kw)
    except TypeError as e:
        raise TypeError(f"dp: {e}") from None


BLOCKWISE8_BLOCK = 4096  # bitsandbytes' quantize_blockwise default, which FLARE's ModelQuantizer uses
# BLOCKWISE8 results kept (by reference: FLARE already holds them) until this many are folded in one sweep: k
# results folded together cost k + 2 model-sized passes over memory instead of 3k (a quarter of the fp32 bytes each)
PENDING_MAX = 16


def _blockwise8_problem(update: LayerwiseUpdate, nan_books: list) -> str | None:
    """Why a BLOCKWISE8 result cannot be folded (checked when accepted, before it waits): a NaN/Inf or non-positive
    absmax, a code book with NaN entries some code points at (``nan_books``: per part, whether its book holds NaN).
    Its layout was checked as it was built (:func:`_blockwise8_parts`: every entry's shape against the model's)."""
    from .compress.fold import nonfinite_scales

    try:
        if nonfinite_scales([update], ["absmax"]):
            return "contains NaN or Inf"
        for k, (part, nan) in enumerate(zip(update.parts, nan_books)):
            if nan and part.holds_invalid_code():
                return f"layer {k} {part.INVALID_CODES}"
    except (TypeError, ValueError) as e:
        return str(e)
    return None


class _Books:
    """The distinct code books of BLOCKWISE8 results, each one tensor (a private copy) on the model's device with
    whether it holds NaN: FLARE sends a copy of bitsandbytes' map per tensor and site (160 per round of 16 sites and
    10 tensors), converted and checked once here instead of per copy. At most ``MAX`` kept; others are used as
    sent."""

    MAX = 64

    def __init__(self):
        self._known: dict = {}

    def get(self, code: Any, device: torch.device) -> tuple:
        """``(book tensor, holds NaN)`` for a ``code`` entry of a quant_state."""
        key = None
        if isinstance(code, np.ndarray) and code.dtype == np.float32 and code.shape == (256,):
            key = (str(device), code.tobytes())
            hit = self._known.get(key)
            if hit is not None:
                return hit
        # (np.array copies: a book kept here is ours, whatever the sender does with its array later)
        t = code.detach() if isinstance(code, torch.Tensor) else torch.as_tensor(np.array(code))
        t = t.to(device).contiguous()
        hit = (t, bool(torch.isnan(t).any()) if t.is_floating_point() else False)
        if key is not None and len(self._known) < self.MAX:
            self._known[key] = hit
        return hit


def _blockwise8_parts(params: Any, meta: dict, base: dict, books: _Books) -> tuple | None:
    """A result quantized by FLARE's ``ModelQuantizer("blockwise8")`` (``quantized_flag`` in its meta, no
    ``ModelDequantizer`` on the server) as ``({name: Codebook8}, [book holds NaN, ...])`` in the model's order, each
    entry checked against the model (shape, block count, code book); None for a result that is not quantized. Other
    quantizations raise, saying to dequantize them with FLARE's filter."""
    if not meta.get("quantized_flag"):
        return None
    algorithm = meta.get("processed_algorithm")
    if algorithm != "blockwise8":
        raise ValueError(f"is quantized as {algorithm!r}; fastagg folds FLARE's blockwise8 results as they are: "
                         "add FLARE's ModelDequantizer to the server's filters for other quantizations")
    state = meta.get("quant_state")
    if not isinstance(params, dict) or not isinstance(state, dict):
        raise ValueError("is quantized but carries no params dict and quant_state dict")
    if set(params) != set(base):
        missing, extra = sorted(set(base) - set(params)), sorted(set(params) - set(base))
        raise ValueError(f"params differ from the model's entries (missing {missing[:3]}, extra {extra[:3]})")
    out, nan_books = {}, []
    for k, ref in base.items():
        st = state.get(k)
        if not st:
            raise ValueError(f"entry {k!r} was not quantized (FLARE quantizes float32/16 entries only): the result "
                             "cannot be folded as blockwise8; dequantize it with FLARE's ModelDequantizer")
        shape = tuple(params[k].shape) if isinstance(params[k], torch.Tensor) else np.shape(params[k])
        if shape != tuple(ref.shape):
            raise ValueError(f"entry {k!r} has shape {shape}, the model {tuple(ref.shape)}")
        dev = ref.device
        try:
            codes, absmax = (t if t.device == dev else t.to(dev)
                             for t in (flat_tensor(params[k]), flat_tensor(st["absmax"])))
            book, nan = books.get(st["code"], dev)
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            raise ValueError(f"entry {k!r} has a malformed quant_state ({e!r:.80})") from None
        try:
            out[k] = Codebook8(codes, absmax, BLOCKWISE8_BLOCK, code=book)
        except (TypeError, ValueError) as e:
            raise ValueError(f"entry {k!r}: {e}") from None
        nan_books.append(nan)
    return out, nan_books


def _to_tensor(v: Any, name: str, device: str) -> torch.Tensor:
    if isinstance(v, torch.Tensor):
        t = v.detach()
    else:
        a = np.asarray(v)
        if a.dtype.kind not in "fiu":
            raise TypeError(f"model entry {name!r} has dtype {a.dtype}; a numeric array is expected")
        # (np.ascontiguousarray makes a 0-d array 1-D: a BatchNorm counter must keep its shape (), or every
        # result's counter is refused as the wrong shape and the round folds nothing)
        t = torch.from_numpy(np.ascontiguousarray(a).reshape(a.shape)) if a.flags.writeable else torch.tensor(a)
    return t.to(device)


def _copies(ts: list) -> list:
    """Copies of the tensors ``ts`` (a result held to be folded later; a clone each: measured 3x as fast as one
    ``cat`` per dtype and views of it at 122 entries)."""
    return [t.clone() for t in ts]


def _entry_tensor(v: Any) -> torch.Tensor:
    return v.detach() if isinstance(v, torch.Tensor) else torch.as_tensor(np.asarray(v))


_SHAPE, _DTYPE, _DEVICE, _NBYTES = attrgetter("shape"), attrgetter("dtype"), attrgetter("device"), attrgetter("nbytes")
_CONTIGUOUS = methodcaller("is_contiguous")


def _client_params(params: Any, base: dict) -> dict:
    """A result's params as tensors named and shaped like the model sent (numpy arrays are viewed, not copied)."""
    if not isinstance(params, dict):
        raise ValueError(f"params are a {type(params).__name__}, not a dict")
    if set(params) != set(base):
        missing, extra = sorted(set(base) - set(params)), sorted(set(params) - set(base))
        raise ValueError(f"params differ from the model's entries (missing {missing[:3]}, extra {extra[:3]})")
    vals = list(map(params.__getitem__, base))
    ts = None
    if all(type(v) is np.ndarray for v in vals):  # FLARE's results: numpy arrays, viewed (4x as fast as as_tensor)
        try:
            with warnings.catch_warnings():  # torch warns on read-only arrays; fastagg never writes to them
                warnings.simplefilter("ignore", UserWarning)
                ts = list(map(torch.from_numpy, vals))
        except (TypeError, ValueError, RuntimeError):
            ts = None  # (a byte-swapped or object array: converted one by one below)
    if ts is None:
        ts = list(map(_entry_tensor, vals))
    refs = list(base.values())
    if (list(map(_SHAPE, ts)) == list(map(_SHAPE, refs)) and list(map(_DTYPE, ts)) == list(map(_DTYPE, refs))
            and set(map(_DEVICE, ts)) == set(map(_DEVICE, refs)) and all(map(_CONTIGUOUS, ts))):
        return dict(zip(base, ts))  # (the common case, checked a list at a time: no conversion to make)
    out = {}
    for (k, ref), t in zip(base.items(), ts):
        if tuple(t.shape) != tuple(ref.shape):
            raise ValueError(f"entry {k!r} has shape {tuple(t.shape)}, the model {tuple(ref.shape)}")
        if t.dtype != ref.dtype:
            if not (t.is_floating_point() and ref.is_floating_point()):
                raise ValueError(f"entry {k!r} has dtype {t.dtype}, the model {ref.dtype}")
            t = t.to(ref.dtype)
        out[k] = t.to(ref.device).contiguous()
    return out


def _num_steps(meta: dict) -> float:
    """FLARE's weight rule: NUM_STEPS_CURRENT_ROUND when it is a finite number > 0, else 1; an integer too large for
    a float (10**400) is infinite here, so the site is left out rather than weighted 1."""
    v = meta.get(WEIGHT_KEY)
    if v is None or isinstance(v, bool):
        return 1.0
    try:
        w = float(v)
    except OverflowError:
        return math.inf
    except (TypeError, ValueError):
        return 1.0
    return w if math.isfinite(w) and w > 0 else 1.0


def _layout(params: dict) -> list:
    return [(k, tuple(v.shape), v.dtype) for k, v in params.items()]


