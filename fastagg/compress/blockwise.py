"""What every blockwise format shares: one client's update ``x`` (the flat vector of d elements, in the order
:func:`fastagg.flat.flatten` gives the model's entries) cut into blocks of ``block`` consecutive elements (the last
one may be shorter), each stored as one float32 scale ``s_b > 0`` and one byte per element, a code ``q_j``, which
stands for

    x~_j = s_b * v(q_j)

where ``v`` is the format's code value (int8: the code itself; fp8 e4m3: the float8 number it encodes). Every fold
reads ``x~``: sums and squared norms are those of the dequantized update, exact against the float64 oracle
:meth:`Blockwise.dequantize`. The formats, their scale rules and rounding: :mod:`.int8`, :mod:`.fp8`, :mod:`.qsgd`.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import torch

from .._checks import check_int
from ..backends import philox4x32_10, resolve
from ..flat import flatten

MAX_BLOCK = (1 << 31) - 1
FLOAT32_MAX = float(torch.finfo(torch.float32).max)
FLOAT32_TINY = float(torch.finfo(torch.float32).tiny)  # the smallest normal float32: scales below it are subnormal
# |v| from here up rounds to Inf in float32 (round to nearest even: FLOAT32_MAX + half its last step)
FLOAT32_OVERFLOW = 2.0 ** 128 - 2.0 ** 103


@dataclasses.dataclass(frozen=True)
class Blockwise:
    """``codes`` ``[d]`` (one byte each, of the format's dtype), ``scales`` float32 ``[ceil(d / block)]``, ``block``
    elements per scale. Built checked: dtypes, shapes, device, block (values are checked by the folds)."""

    codes: torch.Tensor
    scales: torch.Tensor
    block: int

    CODE_DTYPE: ClassVar[torch.dtype]
    FORMAT: ClassVar[str]
    INVALID_CODES: ClassVar[str]  # what the fold reports when a client holds a code outside the format

    def __post_init__(self):
        check_blockwise(self, "the update")
        object.__setattr__(self, "block", int(self.block))  # (a numpy integer kept as a Python int)

    @property
    def numel(self) -> int:
        return self.codes.numel()

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def nbytes(self) -> int:
        """Bytes on the wire: the codes and the scales."""
        return self.codes.numel() + 4 * self.scales.numel()

    def table(self) -> torch.Tensor | None:
        """The 256 code values (float32, NaN for invalid codes) indexed by the code's byte; None when the code is its
        own value (int8)."""
        return None

    def code_bytes(self) -> torch.Tensor:
        """The codes as the fold kernels read them (int8 as they are; table formats as uint8)."""
        return self.codes

    def holds_invalid_code(self) -> bool:
        """Whether a code lies outside the format (int8: -128; table formats: a code whose value is NaN)."""
        t = self.table()
        if t is None:
            return bool((self.codes == -128).any())
        nan = torch.isnan(t)
        if not bool(nan.any()):  # (most code books: one reduction, no index list)
            return False
        invalid = nan.nonzero().flatten()  # the bytes whose value is NaN
        return bool(torch.isin(self.codes.view(torch.uint8), invalid.to(self.device, torch.uint8)).any())

    def dequantize(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """``x~_j = s_b * v(q_j)`` as a flat ``dtype`` tensor (float64 by default: the oracle every fold is tested
        against)."""
        check_blockwise(self, "the update")
        t = self.table()
        v = self.codes.to(torch.float64) if t is None else \
            t.to(self.device, torch.float64)[self.codes.view(torch.uint8).long()]
        return (block_scales(self.scales, self.block, self.numel) * v).to(dtype)


def check_blockwise(u: Any, name: str) -> None:
    """Shapes, dtypes, device and block of a :class:`Blockwise` update."""
    check_int(u.block, f"{name}: block", minimum=1, maximum=MAX_BLOCK)
    for field, t, dtype in (("codes", u.codes, u.CODE_DTYPE), ("scales", u.scales, torch.float32)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: {field} must be a torch tensor, got {type(t).__name__}")
        if t.dtype != dtype or t.dim() != 1:
            raise TypeError(f"{name}: {field} must be a 1-D {dtype} tensor, got {t.dtype} of shape {tuple(t.shape)}")
    if u.scales.device != u.codes.device:
        raise ValueError(f"{name}: codes are on {u.codes.device} but scales on {u.scales.device}")
    blocks = math.ceil(u.codes.numel() / u.block)
    if u.scales.numel() != blocks:
        raise ValueError(f"{name}: {u.codes.numel()} codes in blocks of {u.block} need {blocks} scales, got "
                         f"{u.scales.numel()}")


def block_scales(scales: torch.Tensor, block: int, numel: int) -> torch.Tensor:
    """Each element's scale, float64 ``[numel]``: gathered by ``j // block``, never ``scales`` repeated ``block``
    times (a hostile block of 2^31 - 1 over a 10-element update would ask for 16 GiB)."""
    at = torch.arange(numel, dtype=torch.int64, device=scales.device) // block
    return scales.to(torch.float64)[at]


def float32_scales(absmax: torch.Tensor, top: float) -> torch.Tensor:
    """The float32 scales ``absmax / top`` of float64 absmaxes (``1`` for an all-zero block); a subnormal scale that
    rounded down (to 0 for the smallest blocks) is taken one float32 step up, so that every scale is > 0 and
    ``|x_j| / s_b <= top`` (the C++ and Triton quantizers' rule, bit for bit)."""
    s = torch.where(absmax > 0, absmax / top, torch.ones_like(absmax)).to(torch.float32)
    low = (s < FLOAT32_TINY) & (s.to(torch.float64) * top < absmax)
    return torch.where(low, torch.nextafter(s, torch.full_like(s, float("inf"))), s)


def check_representable(scales: torch.Tensor, top: float, what: str) -> None:
    """Raises naming the first block (``scales`` ``[M, blocks]``) whose scale times the format's largest code value
    ``top`` is beyond float32: its codes would stand for values the server refuses (and a scale of Inf)."""
    big = scales.to(torch.float64) * top >= FLOAT32_OVERFLOW
    if bool(big.any()):
        i, b = (int(v) for v in big.nonzero()[0])
        where = f"block {b}" if scales.shape[0] == 1 else f"row {i}, block {b}"
        raise ValueError(f"{what}: {where} holds values beyond float32's range (its scale {float(scales[i, b])!r} "
                         f"x {top:g} exceeds {FLOAT32_MAX:.6g}); it has no compressed form")


def check_block(block: Any) -> int:
    return check_int(block, "block", minimum=1, maximum=MAX_BLOCK)


def check_keys(seed: Any, round: Any, clients: list) -> tuple[int, int, list]:
    """The stochastic rounding's keys as Python ints: seed in [0, 2^64), round and every client id in [0, 2^32)."""
    seed = check_int(seed, "seed", maximum=2 ** 64 - 1, what="an integer in [0, 2^64)")
    round = check_int(round, "round", maximum=2 ** 32 - 1, what="an integer in [0, 2^32)")
    return seed, round, [check_int(c, "client", maximum=2 ** 32 - 1, what="an integer in [0, 2^32)") for c in clients]


def as_rows(update: Any, what: str = "the update", *, finite: bool = True) -> torch.Tensor:
    """One update (a flat tensor, a list of tensors, a state_dict or a module's parameters) as a ``[1, d]`` row, or
    an ``[M, d]`` tensor of M updates as it is; detached, floating point, and checked finite unless ``finite`` is
    False (a fused quantizer that checks as it reads)."""
    if isinstance(update, torch.Tensor) and update.dim() in (1, 2):
        x = update if update.dim() == 2 else update[None]
    else:
        x = flatten(update)[0][None]
    x = x.detach()
    if not x.is_floating_point():
        raise TypeError(f"{what} must be floating point, got {x.dtype}")
    if finite and not bool(torch.isfinite(x).all()):
        raise_nonfinite(what)
    return x


def quantizer(backend: str, x: torch.Tensor, name: str):
    """The fused quantizer ``name`` of the backend for ``x``'s device (C++ for CPU float32/float64 rows, Triton for
    CUDA rows), or None for the torch ops of the definition (``backend="reference"``, other dtypes or devices, or
    with "auto" a backend whose kernels cannot load)."""
    try:
        module = resolve(backend, x.device)
    except (ImportError, RuntimeError, ValueError):
        if backend != "auto":
            raise
        return None
    if module.name == "cpu" and x.dtype not in (torch.float32, torch.float64):
        return None
    return getattr(module, name, None)


def raise_nonfinite(what: str) -> None:
    raise ValueError(f"{what} holds NaN or Inf: it has no compressed form")


def tiles(rows: torch.Tensor, block: int) -> torch.Tensor:
    """``[M, d]`` rows as float64 ``[M, ceil(d / block), width]`` tiles, the last one padded with zeros; ``width``
    is ``block``, or ``d`` when one block holds the whole row (a block far beyond d allocates no padding: the
    zeros change no absmax or norm)."""
    m, d = rows.shape
    blocks = math.ceil(d / block)
    width = d if blocks == 1 else block
    padded = torch.zeros(m, blocks * width, dtype=torch.float64, device=rows.device)
    padded[:, :d] = rows.to(torch.float64)
    return padded.view(m, blocks, width)


def uniforms(shape: tuple, *, seed: int, round: int, clients: list, device) -> torch.Tensor:
    """``u[i, j]`` in [0, 1), float64, ``shape = (M, n)``: the ``(j mod 4)``-th 32-bit word of Philox4x32-10 with
    counter ``(j // 4 low, high 32 bits, round, clients[i])`` and key ``seed`` (two 32-bit words), times 2^-32: the
    same numbers for the same keys on any machine."""
    m, n = shape
    groups = torch.arange((n + 3) // 4, dtype=torch.int64, device=device)[None].expand(m, -1)
    client = torch.tensor(clients, dtype=torch.int64, device=device)[:, None].expand_as(groups)
    words = philox4x32_10((groups & 0xFFFFFFFF, groups >> 32, torch.full_like(groups, round), client),
                          (seed & 0xFFFFFFFF, seed >> 32))
    return torch.stack(words, dim=2).reshape(m, -1)[:, :n].to(torch.float64) * 2.0 ** -32
