"""fastagg inside Flower: message-API strategies (``flwr.serverapp.strategy``) whose aggregation streams each
reply into fastagg's fused server step. Switching is an import change::

    from fastagg.flower import FedAdam          # was: from flwr.serverapp.strategy import FedAdam
    strategy = FedAdam(eta=0.1, fraction_train=0.5, on_nonfinite="skip")
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()), num_rounds=10)

Strategies: :class:`FedAvg`, :class:`FedAvgM`, :class:`FedProx`, :class:`FedAdam`, :class:`FedYogi`,
:class:`FedAdagrad` (subclasses of Flower's, same arguments), :class:`FedAMS` (Flower's ``FedOpt`` arguments),
:class:`FedExP`, :class:`FedExPM`, :class:`FedACG` (Flower's ``FedAvg`` arguments plus their own); robust:
:class:`FedMedian`, :class:`FedTrimmedAvg`, :class:`Krum`, :class:`MultiKrum`, :class:`Bulyan` (Flower's) and
:class:`MeaMed` (:mod:`fastagg.flower.robust`); asynchronous: :class:`FedBuff` (FedBuff / FedAsync, no rounds:
:mod:`fastagg.flower.asynchronous`); differential privacy: Flower's four DP wrappers and its two
clipping mods, fused around fastagg strategies (:mod:`fastagg.flower.privacy`); compressed replies: the client mod
:func:`compress_mod` sends updates as int8 / fp8 / QSGD / top-k, which every strategy folds in place
(:mod:`fastagg.flower.compressed`). What a round
does, what a bad reply gets and how buffers are treated: :mod:`fastagg.flower.strategies`.

Needs Flower (fastagg's ``[flower]`` extra: ``pip install '.[flower]'`` from a checkout; tested with flwr 1.42); ``import fastagg`` never imports it.
"""
try:
    import flwr  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised in a process without flwr (tests/test_flower_strategies.py)
    from .._optional import install_hint
    raise ImportError(f"fastagg.flower needs Flower: {install_hint('flower')}") from e

from .asynchronous import AsyncResult, FedBuff
from .compressed import compress_mod, compressed_record, read_compressed
from .privacy import (DifferentialPrivacyClientSideAdaptiveClipping, DifferentialPrivacyClientSideFixedClipping,
                      DifferentialPrivacyServerSideAdaptiveClipping, DifferentialPrivacyServerSideFixedClipping,
                      adaptiveclipping_mod, fixedclipping_mod)
from .records import ReplyError, array_view, record_views, to_array, to_record
from .robust import Bulyan, FedMedian, FedTrimmedAvg, Krum, MeaMed, MultiKrum
from .strategies import (FedACG, FedAdagrad, FedAdam, FedAMS, FedAvg, FedAvgM, FedExP, FedExPM, FedProx, FedYogi,
                         QFedAvg, Result)

__all__ = ["FedAvg", "FedAvgM", "FedProx", "FedAdam", "FedYogi", "FedAdagrad", "FedAMS", "FedExP", "FedExPM",
           "FedACG", "QFedAvg", "FedMedian", "FedTrimmedAvg", "Krum", "MultiKrum", "Bulyan", "MeaMed",
           "DifferentialPrivacyServerSideFixedClipping", "DifferentialPrivacyClientSideFixedClipping",
           "DifferentialPrivacyServerSideAdaptiveClipping", "DifferentialPrivacyClientSideAdaptiveClipping",
           "fixedclipping_mod", "adaptiveclipping_mod", "FedBuff", "AsyncResult", "compress_mod", "compressed_record", "read_compressed", "Result", "ReplyError", "array_view", "record_views", "to_array", "to_record"]
