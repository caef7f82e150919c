"""Byzantine-robust Flower strategies: Flower 1.42's ``FedMedian``, ``FedTrimmedAvg``, ``Krum``, ``MultiKrum`` and
``Bulyan`` with their arguments, names and defaults, aggregating with :mod:`fastagg.robust` over the replies read
in place (plus ``MeaMed``, which Flower has not). Each round is one :class:`fastagg.server.FedAvg` step whose
``aggregate=`` rule forms the estimate of the updates ``model_i - sent``:

* the coordinate-wise rules give Flower's values (its median averages the two middle values of an even count;
  its trimmed mean cuts ``int(beta * M)`` at each end);
* the Krum family scores clients by squared distances of their *updates* from the M x M Gram matrix in float64
  (Flower's form ``||x||^2 + ||y||^2 - 2 x.y`` over full float32 models loses those distances when updates are
  small against the weights), with Flower's neighbour count ``max(1, M - f - 2)``; Bulyan selects as Flower does
  (one Multi-Krum scoring) and skips a round with fewer than ``4f + 3`` replies, as Flower does;
* a reply holding NaN or Inf (or a negative ``running_var``) is left out and logged (an attack, not an
  accident) and counts as one of ``num_malicious_nodes``, whatever ``on_nonfinite`` says; a compressed reply
  alike when it holds NaN/Inf (values, scales, buffers), an invalid code, a scale <= 0 or a negative
  ``running_var``. BatchNorm statistics follow the coordinate-wise rules (the median of each element for
  FedMedian, as Flower's), and under the Krum family each element's median over the replies left in -- **not
  Flower's**: Flower averages the selected replies' statistics, so a reply chosen for its weights brings any
  statistics it likes (a negative variance) into the model; an integer counter advances by the rule's advance and
  stays an integer. A reply of 0 examples is never Krum's choice (Flower's average of it is 0/0, NaN). A round
  with compressed replies averages the buffers of every reply not left out instead (weighted as the rule weighs):
  a finite hostile statistic is not filtered there.

``beta``, ``num_malicious_nodes`` and ``num_nodes_to_select`` changed between rounds apply from the next round, as
Flower's strategies read them every round.

Train metrics are aggregated over the replies that entered the estimate (Flower: the selected ones for the Krum
family, every valid one for median and trimmed mean -- the same sets when no reply is non-finite).
"""
from __future__ import annotations

from logging import WARNING

import torch
from flwr.serverapp.strategy import Bulyan as _FlBulyan
from flwr.serverapp.strategy import FedAvg as _FlFedAvg
from flwr.serverapp.strategy import FedMedian as _FlFedMedian
from flwr.serverapp.strategy import FedTrimmedAvg as _FlFedTrimmedAvg
from flwr.serverapp.strategy import Krum as _FlKrum
from flwr.serverapp.strategy import MultiKrum as _FlMultiKrum
from flwr.supercore import log

from .. import robust, server
from .strategies import _COMMON, _Fastagg, _flower_subclass

__all__ = ["FedMedian", "FedTrimmedAvg", "Krum", "MultiKrum", "Bulyan", "MeaMed"]


class _Robust(_Fastagg):
    """A round whose rule cannot run (too few replies for its bound) keeps the model, logged, as Flower's Bulyan
    does, instead of failing the run."""

    def _rule(self) -> robust._Rule:
        raise NotImplementedError

    def _round_metrics(self, stats) -> dict:
        """Server metrics of a robust round: how many replies entered the estimate, were left out as non-finite,
        were clipped (NormBound)."""
        r = stats.robust
        return {"robust-selected": int(r.selected.sum()), "robust-excluded": int(r.excluded.sum()),
                "robust-clipped": int(r.clipped)}

    def _sync_hyperparameters(self) -> None:
        """Flower's robust strategies read ``beta``, ``num_malicious_nodes`` and ``num_nodes_to_select`` in every
        round: the rule is rebuilt from the strategy's attributes (checked as the constructor checks them) when
        they changed since the last round. The rules keep no state between rounds."""
        super()._sync_hyperparameters()
        rule = self._optimizer(torch.zeros(1)).aggregate
        if repr(rule) != repr(self.optimizer.aggregate):
            self.optimizer.aggregate = rule

    def _step(self, server_round: int, usable: list) -> tuple:
        try:
            return super()._step(server_round, usable)
        except robust.TooFewClients as e:
            log(WARNING, "aggregate_train: round %d keeps the model: %s", server_round, e)
            return None, usable


def _robust_subclass(name: str, flower_cls: type, rule, doc: str) -> type:
    cls = _flower_subclass(name, flower_cls, lambda self, p: server.FedAvg(p, aggregate=rule(self), **self._opt_kw()),
                           doc)
    return type(name, (_Robust, cls), {"__doc__": cls.__doc__, "__module__": __name__, "_rule": rule})


FedMedian = _robust_subclass(
    "FedMedian", _FlFedMedian, lambda self: robust.Median(even="mean"),
    "FedMedian: the coordinate-wise median of the replies (Flower's ``FedMedian``; an even count averages the two "
    "middle values)." + _COMMON.format(flower="FedMedian"))

FedTrimmedAvg = _robust_subclass(
    "FedTrimmedAvg", _FlFedTrimmedAvg, lambda self: robust.TrimmedMean(self.beta),
    "FedTrimmedAvg: the coordinate-wise mean after cutting ``int(beta * M)`` values at each end (Flower's "
    "``FedTrimmedAvg``, default ``beta=0.2``)." + _COMMON.format(flower="FedTrimmedAvg"))

MultiKrum = _robust_subclass(
    "MultiKrum", _FlMultiKrum,
    lambda self: robust.MultiKrum(self.num_malicious_nodes, self.num_nodes_to_select, strict=False),
    "MultiKrum: the examples-weighted average of the ``num_nodes_to_select`` replies of lowest Krum score "
    "(Flower's ``MultiKrum``; distances of the updates in float64)." + _COMMON.format(flower="MultiKrum"))

Krum = _robust_subclass(
    "Krum", _FlKrum, lambda self: robust.MultiKrum(self.num_malicious_nodes, 1, strict=False),
    "Krum: the reply of lowest Krum score (Flower's ``Krum``; distances of the updates in float64)."
    + _COMMON.format(flower="Krum"))


def _bulyan_rule(self) -> robust.Bulyan:
    if self.selection_rule is not _DEFAULT_SELECTION:
        raise ValueError("fastagg's Bulyan selects with Multi-Krum scores over the M x M Gram matrix; a custom "
                         "selection_rule is Flower's own code path (use flwr.serverapp.strategy.Bulyan for it)")
    return robust.Bulyan(self.num_malicious_nodes, selection="multikrum")


_DEFAULT_SELECTION = _FlBulyan().selection_rule
Bulyan = _robust_subclass(
    "Bulyan", _FlBulyan, _bulyan_rule,
    "Bulyan: ``theta = M - 2f`` replies selected by Multi-Krum, then per coordinate the mean of the "
    "``theta - 2f`` values nearest their median (Flower's ``Bulyan``, its default selection; "
    ":class:`fastagg.robust.Bulyan` has the paper's iterated Krum)." + _COMMON.format(flower="Bulyan"))


class MeaMed(_Robust, _FlFedAvg):
    """MeaMed (Xie et al., 2018): per coordinate, the mean of the ``M - num_malicious_nodes`` values nearest the
    median. Flower has no MeaMed: the arguments are Flower's ``FedAvg``'s plus ``num_malicious_nodes``."""

    def __init__(self, *args, num_malicious_nodes: int = 0, backend: str = "auto", on_nonfinite: str = "raise",
                 buffers: str = "average", **kwargs):
        self.num_malicious_nodes = num_malicious_nodes
        _FlFedAvg.__init__(self, *args, **kwargs)
        self._init_fastagg(backend, on_nonfinite, buffers)

    def _optimizer(self, p):
        return server.FedAvg(p, aggregate=robust.MeaMed(self.num_malicious_nodes), **self._opt_kw())
