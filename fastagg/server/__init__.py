"""Stateful server optimizers, shaped like torch optimizers, built on the fused two-pass round.

Every ``step`` runs one stats pass over the client updates (or takes an :class:`~fastagg.Accumulator`'s sums),
computes the rule's scalars on the device, and runs one apply pass that reads the mean, the rule's state and the
params once and writes state and params once; the apply pass does nothing when a client was non-finite, and the
scalar state (round counter, FedExP-M's numerator) is updated on the device only when the round was applied.

Sign convention: ``delta_i = client model - the model the server broadcast``; the server adds its step.
Names follow torch (``lr``, ``momentum``, ``nesterov``, ``betas``), defaults follow Flower 1.42's message-API
strategies, so switching from Flower with the same settings gives the same numbers.

One file per rule family, each with its formula, defaults and update side by side: :mod:`.fedavg` (FedAvg,
FedAvgM), :mod:`.fedexp` (FedExP, FedExP-M), :mod:`.scaffold` (SCAFFOLD, SCAFFOLD-ExP), :mod:`.fedacg` (FedACG),
:mod:`.adaptive` (FedAdam, FedYogi, FedAdagrad, FedAMS), :mod:`.qfedavg` (q-FedAvg); :mod:`.base` holds what they
share. A new rule is one file here plus one line below (docs/ARCHITECTURE.md, "Adding a server rule").
"""
from ..checkpoint import FORMAT_VERSION, flat_checkpoint, torch_checkpoint
from .adaptive import BIAS_CORRECTIONS, FedAdagrad, FedAdam, FedAMS, FedYogi
from .base import BUFFER_POLICIES, ServerOptimizer, StepStats
from .fedacg import FedACG
from .fedavg import FedAvg, FedAvgM
from .fedexp import FedExP, FedExPM
from .qfedavg import QFedAvg
from .scaffold import Scaffold, ScaffoldExP
from .torch_compat import GroupRef as _GroupRef  # (the name pickles made before the package split refer to)
from .torch_compat import ParamState

__all__ = ["ServerOptimizer", "FedAvg", "FedAvgM", "FedExP", "FedExPM", "Scaffold", "ScaffoldExP", "FedACG", "FedAdam",
           "FedYogi", "FedAdagrad", "FedAMS", "QFedAvg", "StepStats"]
