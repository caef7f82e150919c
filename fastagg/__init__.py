"""fastagg: fused GPU (Triton) and CPU (C++) kernels for federated-learning aggregation.

Sign convention everywhere: ``delta_i = client model - global model``; the server adds its step.
"""
from .env import env_report
from .feed import FeedReport, HostFeeder
from .flat import Layout, flatten
from .ops import RoundResult, fedavg_step, fedexp_step, fedexp_step_from_sums
from .stream import Accumulator
from ._version import __version__


# Submodules reachable as attributes (``fastagg.server.FedAdam``) without importing them with the package: the
# server optimizers, client steps and torch.distributed support load on first use, so ``import fastagg`` stays
# light, and the optional integrations (flower, nvflare) import their framework only when asked for.
_SUBMODULES = ("asynchronous", "client", "distributed", "flower", "nvflare", "privacy", "robust", "server", "sim",
               "testing")


def __getattr__(name: str):
    if name in _SUBMODULES:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")  # sets the attribute: later lookups skip this
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_SUBMODULES))

__all__ = [
    "Accumulator",
    "FeedReport",
    "HostFeeder",
    "Layout",
    "RoundResult",
    "env_report",
    "fedavg_step",
    "fedexp_step",
    "fedexp_step_from_sums",
    "flatten",
]
