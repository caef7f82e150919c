"""Flower 1.42's central-DP wrappers and client mods with their names and arguments, fused when they wrap a
fastagg strategy:

* :class:`DifferentialPrivacyServerSideFixedClipping`, :class:`DifferentialPrivacyClientSideFixedClipping`,
  :class:`DifferentialPrivacyServerSideAdaptiveClipping`, :class:`DifferentialPrivacyClientSideAdaptiveClipping`
  subclass Flower's. Around a fastagg strategy (``fastagg.flower.FedAvg``, ``FedAdam``, ``FedExP``...) the
  matching :mod:`fastagg.privacy` mechanism becomes the strategy's optimizer's ``aggregate=``: one fused step reads
  the replies in place (norms, then the clipped mean with the noise written by the stats kernel, then the server
  optimizer) instead of Flower's copies (every reply subtracted, clipped and added back into new arrays, float64
  noise drawn per layer). Around any other strategy they are Flower's own classes, unchanged.
* :func:`fixedclipping_mod`, :func:`adaptiveclipping_mod`: Flower's client mods (same checks, same errors), with
  the clipping done by :func:`fastagg.client.clip_updates` (one read for the norm; an update within the norm is sent
  as it is, with no copy).

Where the fused wrappers differ from Flower's (documented, tested):

* the noise is added to the clipped mean *before* the wrapped optimizer steps (Flower adds it to the optimizer's
  output model). For FedAvg (server learning rate 1) the models are the same; for FedAdam and the like Flower's
  noise is not calibrated to what the optimizer made of the clipped mean;
* adaptive clipping calibrates the noise to the clipping norm the round clipped with; Flower 1.42 calibrates it to
  the norm it has just updated, smaller than the sensitivity whenever the norm shrinks. The norm's trajectory is
  Flower's (its sign, ``direction="flower"``; ``"paper"`` is Andrew et al.'s, which converges to the target
  quantile);
* the noise comes from fastagg's counter-based generator (``seed=``, default from ``secrets``) instead of numpy's
  global generator; ``noise_source=`` takes a secure source of the caller's;
* a client-side round re-clips a reply that arrives longer than the clipping norm (Flower trusts the clients);
* the updates are clipped against the model the wrapped strategy sent. The wrapper's ``current_arrays`` is that
  strategy's (setting it on either sets the one model the round clips against; Flower's server-side wrappers
  keep their own copy). A round with no model at all (no ``configure_train``, no ``current_arrays``) is refused
  with ``AggregationError`` before anything changes, client-side too (Flower's server-side wrappers fail on their
  empty record; its client-side ones aggregate, trusting the clients' clipping). A robust strategy cannot be
  wrapped (``TypeError`` when the wrapper is built);
* the round's ``server_metrics`` hold only what the mechanism released: ``dp-clipping-norm``, ``dp-noise-std`` and,
  adaptive, ``dp-noisy-clipped-fraction`` (the noised fraction that moved the norm) and ``dp-next-clipping-norm``.
  The exact numbers of clipped and of excluded (NaN/Inf) replies are not private (adaptive clipping exists to
  release the clipped count only noised): they are published as ``dp-clipped`` / ``dp-excluded`` only with
  ``publish_exact_counts=True``, a debugging aid that leaks them. The same opt-in governs the wrapped strategy's
  own round metrics (stored and logged at INFO): by default only those computed from the release alone are kept
  (FedExP's ``fedexp-mean-sq-norm``, the squared norm of the noised mean); FedExP's ``fedexp-eta`` and
  ``fedexp-avg-sq-norm`` (the exact mean of the clipped squared norms, ``C^2`` when every update was clipped) are
  withheld. (FedExP's step still uses that unnoised mean through eta: see docs/PRIVACY.md);
* the fused mechanisms divide the clipped sum by the number of replies, as Flower's do (no fastagg accountant is
  attached; Flower's accountant needs exactly ``num_sampled_clients`` replies, where the two denominators agree).
"""
from __future__ import annotations

import warnings
from collections.abc import Iterable
from logging import INFO

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.clientapp.mod import centraldp_mods as _fl_mods
from flwr.serverapp import Grid
from flwr.serverapp.exception import AggregationError
from flwr.serverapp.strategy import DifferentialPrivacyClientSideAdaptiveClipping as _FlCSA
from flwr.serverapp.strategy import DifferentialPrivacyClientSideFixedClipping as _FlCSF
from flwr.serverapp.strategy import DifferentialPrivacyServerSideAdaptiveClipping as _FlSSA
from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping as _FlSSF
from flwr.serverapp.strategy import FedAvg as _FlFedAvg
from flwr.serverapp.strategy.dp_fixed_clipping import validate_replies
from flwr.supercore import log
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM, KEY_NORM_BIT

from .. import privacy
from ..client import update_norms
from .records import record_views, to_record
from .strategies import _Fastagg

__all__ = ["DifferentialPrivacyServerSideFixedClipping", "DifferentialPrivacyClientSideFixedClipping",
           "DifferentialPrivacyServerSideAdaptiveClipping", "DifferentialPrivacyClientSideAdaptiveClipping",
           "fixedclipping_mod", "adaptiveclipping_mod"]


class _Fused:
    """The fused round, mixed in before one of Flower's DP wrappers."""

    def _fused(self) -> bool:
        return isinstance(self.__dict__.get("strategy"), _Fastagg)

    def _make_mechanism(self, cls, *args, seed, noise_source, publish_exact_counts: bool = False, **kw) -> None:
        if not isinstance(publish_exact_counts, bool):
            raise TypeError(f"publish_exact_counts must be True or False, got {publish_exact_counts!r}")
        if self._fused():
            self._check_mean_based(self.strategy._optimizer(torch.zeros(1)).aggregate)
        self.publish_exact_counts = publish_exact_counts
        self.mechanism = cls(*args, seed=seed, noise_source=noise_source, weighted=True, **kw) if self._fused() \
            else None

    def _check_mean_based(self, aggregate) -> None:
        if aggregate is not None and aggregate is not self.__dict__.get("mechanism"):
            raise TypeError(f"{type(self).__name__} wraps {type(self.strategy).__name__}, whose aggregation is a "
                            f"robust rule ({aggregate!r}): DP's noise is calibrated to the clipped *mean*; wrap a "
                            "mean-based strategy (FedAvg, FedAdam, FedExP, ...)")

    # Flower's server-side wrappers keep the model sent as ``current_arrays`` and clip the replies against it.
    # Fused, the replies are clipped inside the wrapped strategy's step against the model *it* sent: the wrapper's
    # current_arrays is the strategy's, so that a model set by hand on either is the one the updates are clipped
    # against (never a base the mechanism does not see).
    @property
    def current_arrays(self):
        """Flower's ``current_arrays`` (the model the replies' updates are clipped against). Around a fastagg
        strategy it is that strategy's global model (an ``ArrayRecord``; empty before any model is known) and
        setting it sets the strategy's ``current_arrays``; around a Flower strategy, Flower's attribute."""
        if not self._fused():
            try:
                return self.__dict__["_flower_current_arrays"]
            except KeyError:
                raise AttributeError("current_arrays") from None
        model = self.strategy.global_model
        return ArrayRecord() if model is None else to_record(model)

    @current_arrays.setter
    def current_arrays(self, value) -> None:
        if not self._fused() or "mechanism" not in self.__dict__:  # (Flower's __init__: its empty record)
            self.__dict__["_flower_current_arrays"] = value
            return
        if not self.__dict__.get("_configuring"):  # (Flower's configure_train: the strategy's own takes arrays)
            self.strategy.current_arrays = value

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        self.__dict__["_configuring"] = True  # (the wrapped strategy's configure_train takes the model itself)
        try:
            messages = super().configure_train(server_round, arrays, config, grid)  # (Flower's wrapper's)
        finally:
            self.__dict__["_configuring"] = False
        if self._fused():
            self._install()
        return messages

    def _install(self) -> None:
        """Make the mechanism the wrapped strategy's aggregation (its optimizer exists once it knows a model)."""
        opt = self.strategy.optimizer
        if opt.aggregate is self.mechanism:
            return
        self._check_mean_based(opt.aggregate)
        opt.aggregate = self.mechanism

    def _check_model(self, server_round: int) -> None:
        """Before anything changes: the replies' updates can be clipped only against the model the clients
        started from. Without one (no configure_train, no current_arrays set on the wrapper or the strategy) the
        round is refused: FedAvg alone would aggregate the replies' models unclipped."""
        if self.strategy.global_model is None:
            raise AggregationError(f"round {server_round}: {type(self).__name__} has no model to clip the replies' "
                                   "updates against (call configure_train, or set current_arrays on the wrapper "
                                   "or on the strategy it wraps); nothing is released")

    # the wrapped strategy's round metrics that are functions of the release alone (FedExP's ||est||^2); the
    # others (FedExP's eta and mean of the clipped squared norms: C^2 when every update was clipped) are not
    RELEASED_STRATEGY_METRICS = frozenset({"fedexp-mean-sq-norm"})

    def _released_metrics(self, metrics: dict) -> dict:
        """The wrapped strategy's round metrics, less those not private unless ``publish_exact_counts=True``."""
        if self.publish_exact_counts:
            return metrics
        return {k: v for k, v in metrics.items() if k in self.RELEASED_STRATEGY_METRICS}

    def _fused_aggregate(self, server_round: int, replies: list):
        """The wrapped strategy's fused step with the mechanism as its aggregation; the DP metrics of the round go
        into the strategy's ``server_metrics``."""
        self._check_model(server_round)
        self._install()  # every round: a model set by hand (or forgotten and set again) brings a new optimizer
        self.mechanism.clipping_norm = self.clipping_norm
        releases = self.mechanism.rounds
        inner = self.strategy  # its own round metrics (logged at INFO, stored): only the released ones
        own_metrics = type(inner)._round_metrics
        inner.__dict__["_round_metrics"] = lambda stats: self._released_metrics(own_metrics(inner, stats))
        try:
            with warnings.catch_warnings():  # (validate_replies has logged Flower's own warning about the count)
                warnings.filterwarnings("ignore", message=".*num_sampled_clients.*", category=RuntimeWarning)
                arrays, metrics = inner.aggregate_train(server_round, replies)
        finally:
            del inner.__dict__["_round_metrics"]
        if arrays is not None and self.mechanism.rounds != releases + 1:  # (cannot happen: the last line of defence)
            raise AggregationError(f"round {server_round}: the wrapped strategy stepped without the DP mechanism; "
                                   "its model is not released")
        res = self.mechanism.last
        if res is not None and res.round == self.mechanism.rounds - 1:
            self.clipping_norm = self.mechanism.clipping_norm
            own = {"dp-clipping-norm": res.clipping_norm, "dp-noise-std": res.noise_std}
            if res.next_clipping_norm is not None:
                own["dp-next-clipping-norm"] = res.next_clipping_norm
                own["dp-noisy-clipped-fraction"] = res.noisy_clipped_fraction
            if self.publish_exact_counts:  # (not private: the user asked for them)
                own.update({"dp-clipped": int(res.clipped.sum()), "dp-excluded": int(res.excluded.sum())})
            prev = self.strategy.server_metrics.get(server_round)
            self.strategy.server_metrics[server_round] = MetricRecord({**(dict(prev) if prev else {}), **own})
            log(INFO, "aggregate_train: central DP noise with %.4g stdev added to the clipped mean (fused)",
                res.noise_std)
        return arrays, metrics


class _FixedBase(_Fused):
    """Flower's fixed-clipping constructor, with the accounting check widened to fastagg's FedAvg (whose
    aggregate_train is its own fused one, releasing the same uniform mean as Flower's FedAvg)."""

    _mechanism_cls: type

    def __init__(self, strategy, noise_multiplier: float, clipping_norm: float, num_sampled_clients: int, *,
                 accountant=None, seed: int | None = None, noise_source=None, publish_exact_counts: bool = False):
        if accountant is not None and isinstance(strategy, _Fastagg):
            # Flower accounts only for its own FedAvg, because it adds the noise after the strategy's step; fused,
            # the noise enters before the optimizer, whose step is then post-processing: any fastagg mean-based
            # strategy is accounted (its aggregation is checked at the first round). Flower's remaining checks
            # (the accountant's sampling mode, equal weights) run on a stand-in, then the strategy is put back.
            self._init_flower(_FlFedAvg(), noise_multiplier, clipping_norm, num_sampled_clients, accountant)
            self.strategy = strategy
        else:
            self._init_flower(strategy, noise_multiplier, clipping_norm, num_sampled_clients, accountant)
        self._make_mechanism(self._mechanism_cls, self.noise_multiplier, self.clipping_norm, self.num_sampled_clients,
                             seed=seed, noise_source=noise_source, publish_exact_counts=publish_exact_counts)

    def _init_flower(self, strategy, noise_multiplier, clipping_norm, num_sampled_clients, accountant) -> None:
        super().__init__(strategy, noise_multiplier, clipping_norm, num_sampled_clients, accountant=accountant)


    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        if not self._fused():
            return super().aggregate_train(server_round, replies)
        self._check_model(server_round)
        replies_list = list(replies)
        event = self._pop_pending_event(server_round)
        if not validate_replies(replies_list, self.num_sampled_clients, strict=self.accountant is not None):
            return None, None
        self._validate_uniform_weights(replies_list)
        arrays, metrics = self._fused_aggregate(server_round, replies_list)
        if arrays:
            self._compose_release(event)
        return arrays, metrics


class DifferentialPrivacyServerSideFixedClipping(_FixedBase, _FlSSF):
    """Flower's ``DifferentialPrivacyServerSideFixedClipping`` (same arguments; ``seed`` and ``noise_source``
    added), fused around a fastagg strategy: each reply's update ``model_i - sent`` clipped to
    ``clipping_norm`` inside the passes, averaged as the strategy averages, ``N(0, (z C / n)^2)`` added per
    coordinate as the mean is written (n = ``num_sampled_clients``), then the strategy's optimizer steps."""

    _mechanism_cls = privacy.ServerSideFixedClipping


class DifferentialPrivacyClientSideFixedClipping(_FixedBase, _FlCSF):
    """Flower's ``DifferentialPrivacyClientSideFixedClipping`` (the clients clip with :func:`fixedclipping_mod`,
    which receives ``clipping_norm`` in the train config), fused around a fastagg strategy: the server step reads
    the replies once and adds ``N(0, (z C / n)^2)`` as the mean is written, what FedAvg costs."""

    _mechanism_cls = privacy.ClientSideFixedClipping


class _AdaptiveBase(_Fused):
    _mechanism_cls: type

    def __init__(self, strategy, noise_multiplier: float, num_sampled_clients: int, initial_clipping_norm: float = 0.1,
                 target_clipped_quantile: float = 0.5, clip_norm_lr: float = 0.2,
                 clipped_count_stddev: float | None = None, *, seed: int | None = None, noise_source=None,
                 direction: str = "flower", publish_exact_counts: bool = False):
        super().__init__(strategy, noise_multiplier, num_sampled_clients, initial_clipping_norm,
                         target_clipped_quantile, clip_norm_lr, clipped_count_stddev)
        # (Flower replaced noise_multiplier by the update's; the mechanism derives it from the one given)
        self._make_mechanism(self._mechanism_cls, noise_multiplier, num_sampled_clients, initial_clipping_norm,
                             target_clipped_quantile, clip_norm_lr, clipped_count_stddev, seed=seed,
                             noise_source=noise_source, direction=direction,
                             publish_exact_counts=publish_exact_counts)


    def _check_replies(self, replies: list) -> None:
        """What a wrapper refuses before anything changes (client-side: replies without a norm bit)."""

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        if not self._fused():
            return super().aggregate_train(server_round, replies)
        self._check_model(server_round)
        replies_list = list(replies)
        if not validate_replies(replies_list, self.num_sampled_clients):
            return None, None
        self._check_replies(replies_list)
        return self._fused_aggregate(server_round, replies_list)


class DifferentialPrivacyServerSideAdaptiveClipping(_AdaptiveBase, _FlSSA):
    """Flower's ``DifferentialPrivacyServerSideAdaptiveClipping`` (same arguments; ``seed``, ``noise_source`` and
    ``direction`` added), fused around a fastagg strategy: clipped to the current norm inside the passes, noise
    ``N(0, (z_u C / n)^2)`` written with the mean (``z_u``: :func:`fastagg.privacy.adaptive_noise_params`), the
    norm moved by the noised clipped count."""

    _mechanism_cls = privacy.ServerSideAdaptiveClipping


class DifferentialPrivacyClientSideAdaptiveClipping(_AdaptiveBase, _FlCSA):
    """Flower's ``DifferentialPrivacyClientSideAdaptiveClipping`` (the clients clip with
    :func:`adaptiveclipping_mod` and report ``norm_bit``), fused around a fastagg strategy: one read of the replies
    with the noise written in, the norm moved by the noised count of the reported bits."""

    _mechanism_cls = privacy.ClientSideAdaptiveClipping

    def _check_replies(self, replies: list) -> None:
        for msg in replies:  # Flower's check, before anything changes
            for _, mrec in msg.content.metric_records.items():
                if KEY_NORM_BIT not in mrec:
                    raise AggregationError(f"KEY_NORM_BIT ('{KEY_NORM_BIT}') not found in MetricRecord or metrics "
                                           "for reply.")


# -- client mods -------------------------------------------------------------------------------------------------
def _clip_reply(msg: Message, ctxt, call_next, mod_name: str):
    """Flower's mod checks, then (reply, norm_bit) with the reply's update clipped by fastagg; a reply needing no
    clipping is returned as it is. Errors come back as Flower's error messages."""
    if len(msg.content.array_records) != 1:
        return _fl_mods._handle_multi_record_err(mod_name, msg, ArrayRecord), None
    if len(msg.content.config_records) != 1:
        return _fl_mods._handle_multi_record_err(mod_name, msg, ConfigRecord), None
    config = next(iter(msg.content.config_records.values()))
    if KEY_CLIPPING_NORM not in set(config.keys()):
        return _fl_mods._handle_no_key_err(mod_name, msg), None
    sent = next(iter(msg.content.array_records.values()))
    clipping_norm = float(config[KEY_CLIPPING_NORM])
    out = call_next(msg, ctxt)
    if out.has_error():
        return out, None
    if len(out.content.array_records) != 1:
        return _fl_mods._handle_multi_record_err(mod_name, out, ArrayRecord), None
    key, record = next(iter(out.content.array_records.items()))
    if list(sent.keys()) != list(record.keys()):
        return _fl_mods._handle_array_key_mismatch_err(mod_name, out), None
    base = record_views(sent, "the ArrayRecord sent")
    model = record_views(record, f"ArrayRecord {key!r}")
    norm = float(update_norms([model], base, backend="cpu")[0])
    clipped = not norm <= clipping_norm  # (a NaN norm: Flower's scaling factor min(1, C / NaN) is NaN too)
    if clipped:
        s = clipping_norm / norm
        out.content.array_records[key] = to_record(
            {k: torch.lerp(torch.from_numpy(np.array(base[k])), torch.from_numpy(np.array(v)), s)
             for k, v in model.items()})
    log(INFO, "%s: parameters are clipped by value: %.4f.", mod_name, clipping_norm)
    return out, clipped


def fixedclipping_mod(msg: Message, ctxt, call_next) -> Message:
    """Flower's ``fixedclipping_mod`` (client side of :class:`DifferentialPrivacyClientSideFixedClipping`): the
    reply's update against the model received is clipped to the ``clipping_norm`` of the train config, by
    :func:`fastagg.client.clip_updates`."""
    out, _ = _clip_reply(msg, ctxt, call_next, "fixedclipping_mod")
    return out


def adaptiveclipping_mod(msg: Message, ctxt, call_next) -> Message:
    """Flower's ``adaptiveclipping_mod``: :func:`fixedclipping_mod` plus the ``norm_bit`` metric (1: the update
    was clipped) that :class:`DifferentialPrivacyClientSideAdaptiveClipping` counts."""
    out, bit = _clip_reply(msg, ctxt, call_next, "adaptiveclipping_mod")
    if bit is None:
        return out
    if len(out.content.metric_records) != 1:
        return _fl_mods._handle_multi_record_err("adaptiveclipping_mod", out, MetricRecord)
    key = list(out.content.metric_records.keys())[0]
    out.content.metric_records[key][KEY_NORM_BIT] = int(bit)
    return out
