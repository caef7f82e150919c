"""A client-side compression named by a short spec, as the simulator's ``--compress`` and the Flower mod take it:

    none | fp32        the float32 update (4 bytes an element)
    bf16 | fp16        the update rounded to 16 bits (2 bytes an element; the server reads them as they are)
    int8[:block=256][,stochastic]
    fp8[:block=256]
    qsgd[:s=16][,bucket=N]
    topk[:0.01][,ef=1]     (error feedback on by default for the sparse kinds)
    randk[:0.01][,ef=1]
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .._checks import did_you_mean
from .fp8 import quantize_fp8_rows
from .int8 import quantize_int8_rows
from .qsgd import quantize_qsgd_rows
from .sparse import sparsify_rows

KINDS = ("none", "fp32", "bf16", "fp16", "int8", "fp8", "qsgd", "topk", "randk")
_FLOATS = {"none": torch.float32, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclasses.dataclass(frozen=True)
class Compression:
    """What each client sends (module docstring). ``compress_rows`` turns an ``[M, d]`` batch of updates into what
    the server folds; ``error_feedback``: the client keeps ``x + e - x~`` for its next update
    (:func:`fastagg.client.compress_updates`)."""

    kind: str = "none"
    block: int = 256
    levels: int = 16
    bucket: int | None = None
    fraction: float = 0.01
    stochastic: bool = False
    error_feedback: bool = False

    @property
    def lossy(self) -> bool:
        return self.kind not in ("none", "fp32")

    def compress_rows(self, rows: torch.Tensor, *, seed: int = 0, round: int = 0, clients: list | None = None):
        """The rows compressed: a list of compressed updates, or (float kinds) an ``[M, d]`` tensor."""
        if self.kind in _FLOATS:
            return rows.to(_FLOATS[self.kind])
        if self.kind == "int8":
            return quantize_int8_rows(rows, self.block, stochastic=self.stochastic, seed=seed, round=round,
                                      clients=clients)
        if self.kind == "fp8":
            return quantize_fp8_rows(rows, self.block)
        if self.kind == "qsgd":
            return quantize_qsgd_rows(rows, self.levels, bucket=self.bucket, seed=seed, round=round, clients=clients)
        return sparsify_rows(rows, kind=self.kind, fraction=self.fraction, seed=seed, round=round, clients=clients)

    def __str__(self) -> str:
        if self.kind in _FLOATS:
            return self.kind
        opts = {"int8": [f"block={self.block}"] + (["stochastic"] if self.stochastic else []),
                "fp8": [f"block={self.block}"],
                "qsgd": [f"s={self.levels}"] + ([f"bucket={self.bucket}"] if self.bucket else [])}.get(
                    self.kind, [f"{self.fraction:g}", f"ef={int(self.error_feedback)}"])
        return f"{self.kind}:{','.join(opts)}"


def sent_bytes(sent: Any) -> int:
    """Bytes on the wire of what :meth:`Compression.compress_rows` returned."""
    if isinstance(sent, torch.Tensor):
        return sent.numel() * sent.element_size()
    return sum(u.nbytes for u in sent)


def parse(spec: Any) -> Compression:
    """A :class:`Compression` from its spec (module docstring); a clear error naming what is wrong."""
    if isinstance(spec, Compression):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"a compression spec is a string such as 'int8:block=256', got {spec!r}")
    kind, _, rest = spec.strip().partition(":")
    kind = kind.strip().lower()
    if kind not in KINDS:
        raise ValueError(f"unknown compression {kind!r}{did_you_mean(kind, KINDS)}; choose one of {', '.join(KINDS)}")
    items = [p.strip() for p in rest.split(",") if p.strip()] if rest else []
    kw: dict = {"error_feedback": kind in ("topk", "randk")}
    allowed = {"int8": {"block", "stochastic"}, "fp8": {"block"}, "qsgd": {"s", "bucket"},
               "topk": {"fraction", "ef"}, "randk": {"fraction", "ef"}}.get(kind, set())
    for n, item in enumerate(items):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq:
            if key == "stochastic" and kind == "int8":
                kw["stochastic"] = True
                continue
            if n == 0 and kind in ("topk", "randk"):
                key, value = "fraction", item
            else:
                raise ValueError(f"{spec!r}: {item!r} is not a setting of {kind} (settings: "
                                 f"{', '.join(sorted(allowed)) or 'none'})")
        if key not in allowed:
            raise ValueError(f"{spec!r}: {key!r} is not a setting of {kind} (settings: "
                             f"{', '.join(sorted(allowed)) or 'none'})")
        try:
            if key == "fraction":
                kw["fraction"] = float(value)
                if not 0 < kw["fraction"] <= 1:
                    raise ValueError
            elif key == "ef":
                if value.strip() not in ("0", "1"):
                    raise ValueError
                kw["error_feedback"] = value.strip() == "1"
            elif key == "stochastic":
                if value.strip() not in ("0", "1"):
                    raise ValueError
                kw["stochastic"] = value.strip() == "1"
            else:
                v = int(value)
                if v < 1 or (key == "s" and v > 127):
                    raise ValueError
                kw[{"s": "levels"}.get(key, key)] = v
        except ValueError:
            what = {"fraction": "a number in (0, 1]", "ef": "0 or 1", "stochastic": "0 or 1",
                    "s": "an integer in [1, 127]"}.get(key, "an integer >= 1")
            raise ValueError(f"{spec!r}: {key} must be {what}, got {value.strip()!r}") from None
    return Compression(kind=kind, **kw)
