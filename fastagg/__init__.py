"""fastagg: fused GPU (Triton) and CPU (C++) kernels for federated-learning aggregation.

Sign convention everywhere: ``delta_i = client model - global model``; the server adds its step.
"""
from .env import env_report
from .feed import FeedReport, HostFeeder
from .flat import Layout, flatten
from .ops import RoundResult, fedavg_step, fedexp_step, fedexp_step_from_sums
from .stream import Accumulator

__version__ = "0.1.0"

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
