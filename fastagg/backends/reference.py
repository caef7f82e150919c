"""The reference backend: plain torch, written to be read, float64-capable. It is the oracle that every
other backend and every benchmark is checked against (run it on float64 copies for the fp64 truth).

Each primitive has the same keyword-only signature in every backend; the callers validate before calling
(fastagg/inputs.py, fastagg/passes.py).
"""
from __future__ import annotations

import torch

from ..rows import ClientRows, ParamRows, unkept_mean
from ..rowtable import per_row_tensor

name = "reference"
ADAM_RULES = ("adam", "yogi", "adagrad", "ams")


def _finite_in(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Elementwise: ``values`` stays finite once stored as ``dtype``."""
    return torch.isfinite(values.to(dtype))


# -- counter-based Gaussian noise (the definition: csrc/noise.h) ---------------------------------------------------
_PHILOX_M = (0xD2511F53, 0xCD9E8D57)  # round multipliers
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)  # key schedule increments
_U32 = 0xFFFFFFFF


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of ``a * b`` for uint32 values held in int64 (16-bit halves: no int64 overflow)."""
    t = a * (b & 0xFFFF)
    u = a * (b >> 16) + (t >> 16)
    return u >> 16, ((u & 0xFFFF) << 16) | (t & 0xFFFF)


def philox4x32_10(counter: tuple, key: tuple) -> tuple:
    """Philox4x32-10 (Salmon et al., SC'11) of int64 tensors holding uint32 words: ``counter`` 4 tensors (or
    ints), ``key`` 2 ints. Returns the 4 output words."""
    c0, c1, c2, c3 = (torch.as_tensor(c, dtype=torch.int64) for c in counter)
    k0, k1 = int(key[0]) & _U32, int(key[1]) & _U32
    for _ in range(10):
        hi0, lo0 = _mulhilo(_PHILOX_M[0], c0)
        hi1, lo1 = _mulhilo(_PHILOX_M[1], c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + _PHILOX_W[0]) & _U32, (k1 + _PHILOX_W[1]) & _U32
    return c0, c1, c2, c3


def gaussian(n: int, *, seed: int, round: int, first: int = 0, device="cpu") -> torch.Tensor:
    """The N(0, 1) noise of flat coordinates ``first .. first + n - 1`` (float32): Philox4x32-10 words of counter
    ``(j // 4, round)`` and key ``seed``, then Box-Muller in float64 on the float32 uniforms
    ``u1 = x0 2^-32 + 2^-33``, ``u2 = x1 2^-32`` (and x2, x3): the exact transform the other backends
    approximate in float32."""
    b0, b1 = first // 4, (first + n + 3) // 4
    blocks = torch.arange(b0, b1, dtype=torch.int64, device=device)
    zero = torch.zeros_like(blocks)
    words = philox4x32_10((blocks & _U32, blocks >> 32, zero + (round & _U32), zero + (round >> 32)),
                          (seed & _U32, seed >> 32))
    out = []
    for a, b in ((words[0], words[1]), (words[2], words[3])):
        u1 = a.to(torch.float32) * 2.0 ** -32 + 2.0 ** -33  # float32 arithmetic, as every backend rounds it
        u2 = b.to(torch.float32) * 2.0 ** -32
        r = torch.sqrt(-2.0 * torch.log(u1.double()))
        theta = 2.0 * torch.pi * u2.double()
        out += [r * torch.cos(theta), r * torch.sin(theta)]
    z = torch.stack(out, dim=1).reshape(-1).to(torch.float32)
    return z[first - 4 * b0: first - 4 * b0 + n]


def gaussian_noise(*, out: torch.Tensor, seed: int, round: int, first: int = 0) -> None:
    out.copy_(gaussian(out.numel(), seed=seed, round=round, first=first, device=out.device).view_as(out))


@torch.no_grad()
def blockwise_fold(*, codes: list, scales: list, block: int, table: torch.Tensor | None, e4m3: bool = False,
                   coef: torch.Tensor, init: torch.Tensor | None, out: torch.Tensor, sq_out: torch.Tensor | None,
                   bad_out: torch.Tensor, msq_out: torch.Tensor) -> None:
    """csrc/quantized.h in float64: each client dequantized, then summed (the oracle's order of operations). e4m3
    codes are read through their table (``e4m3`` only says which decoder a compiled backend may use)."""
    d = out.numel()
    acc = torch.zeros(d, dtype=torch.float64, device=out.device) if init is None else init.to(torch.float64, copy=True)
    for i, (q, s) in enumerate(zip(codes, scales)):
        v = q.to(torch.float64) if table is None else table.to(torch.float64)[q.long()]
        # each element's scale gathered by j // block: never the scales repeated block times (a hostile block far
        # beyond d would allocate that many)
        x = s.to(torch.float64)[torch.arange(d, device=s.device) // block] * v
        acc += coef[i] * x
        if sq_out is not None:  # (None: the norms are not wanted)
            sq_out[i] = (x * x).sum()
        bad_out[i] = bool((q == -128).any()) if table is None else bool(v.isnan().any())
    out.copy_(acc)
    msq_out.copy_((out.to(torch.float64) ** 2).sum())


@torch.no_grad()
def sparse_fold(*, indices: list, values: list, coef: torch.Tensor, init: torch.Tensor | None, out: torch.Tensor,
                sq_out: torch.Tensor, msq_out: torch.Tensor | None = None) -> None:
    """csrc/quantized.h in float64: ``out = init + sum_i scatter(idx_i, coef_i * val_i)`` client by client (init
    None: zeros), rounded once to out's dtype."""
    d = out.numel()
    acc = torch.zeros(d, dtype=torch.float64, device=out.device) if init is None else init.to(torch.float64, copy=True)
    for i, (ix, v) in enumerate(zip(indices, values)):
        x = v.to(torch.float64)
        acc[ix.long()] += coef[i] * x
        sq_out[i] = (x * x).sum()
    out.copy_(acc)
    if msq_out is not None:
        msq_out.copy_((out.to(torch.float64) ** 2).sum())


def round_stats(*, rows: ClientRows, weights: torch.Tensor, mean_init: torch.Tensor | None,
                aux: torch.Tensor | None, aux_coef: float, mean_out: torch.Tensor | None, sq_norms_out: torch.Tensor,
                nonfinite_out: torch.Tensor, mean_sq_out: torch.Tensor, noise=None) -> None:
    """One read of the client rows (converted to the mean's dtype on load)::

        mean         = init + sum_i w_i (x_i - base)      (init: a running sum; base: full client models)
                       [+ sigma z_j as it is written, z = gaussian(seed, round) when noise = (sigma, seed, round)]
        sq_norms[i]  = ||x_i - base||^2                   (squares and sums in float64)
        nonfinite[i] = x_i - base holds NaN or Inf
        mean_sq      = ||mean + aux_coef * aux||^2        (float64; aux optional: FedExP-M's ||mean + beta v||^2)
    ``mean_out`` None: the mean is not kept (computed in the rows' compute dtype for ``mean_sq``).
    """
    if mean_out is None:  # (a scratch: no store-free variant of this pass yet)
        mean_out = unkept_mean(rows, mean_init, noise)
    cdt = mean_out.dtype
    sq = torch.zeros(rows.num_clients, dtype=torch.float64, device=mean_out.device)
    bad = torch.zeros(rows.num_clients, dtype=torch.bool, device=mean_out.device)
    for s, (off, n) in enumerate(zip(rows.segments.offs, rows.segments.lens)):
        x = torch.stack([r.to(cdt) for r in rows.rows[s]])  # [M, n]
        if rows.base is not None:
            x = x - rows.base[s].to(cdt)
        seg_mean = weights.to(cdt) @ x
        if mean_init is not None:
            seg_mean = mean_init[off : off + n] + seg_mean
        mean_out[off : off + n] = seg_mean
        sq += x.double().square().sum(dim=1)
        bad |= ~torch.isfinite(x).all(dim=1)
    if noise is not None and noise[0] > 0:
        sigma, seed, rnd = noise
        z = gaussian(mean_out.numel(), seed=seed, round=rnd, device=mean_out.device)
        mean_out += torch.tensor(sigma, dtype=cdt) * z.to(cdt)
    u = mean_out if aux is None else mean_out + aux_coef * aux
    mean_sq_out.copy_(u.double().square().sum())
    sq_norms_out.copy_(sq)
    nonfinite_out.copy_(bad)


SELECT_BLOCK = 1 << 14  # columns per block of the robust passes: M x SELECT_BLOCK values at a time


def column_blocks(rows: ClientRows):
    """(flat offset, [M, n] block of every client's update), SELECT_BLOCK columns at a time: in the rows' dtype
    (order statistics are exact in it), float64 when formed against ``base``."""
    for s, (off, n) in enumerate(zip(rows.segments.offs, rows.segments.lens)):
        for c0 in range(0, n, SELECT_BLOCK):
            c1 = min(n, c0 + SELECT_BLOCK)
            if rows.base is None:
                yield off + c0, torch.stack([r[c0:c1] for r in rows.rows[s]])
            else:
                b = rows.base[s][c0:c1].to(torch.float64)
                yield off + c0, torch.stack([r[c0:c1].to(torch.float64) - b for r in rows.rows[s]])


def select_sorted(s: torch.Tensor, rule: str, first: int, count: int) -> torch.Tensor:
    """float64 [n] from ``s`` [n, M], each row sorted: ``"window"``, the mean of positions ``[first, first +
    count)``; ``"nearest"``, the mean of the ``count`` values nearest the row's median (``(s[(M-1)/2]`` or the mean
    of the two middle values). Those are a window ``[lo, lo + count)``: dropping the farther end ``f = M - count``
    times, a tie dropping the upper end, leaves ``lo = #{t < f : med - s[t] > s[M - f + t] - med}``."""
    s = s.to(torch.float64)
    m = s.shape[1]
    if rule == "window":
        return s[:, first:first + count].sum(dim=1) / count
    med = s[:, (m - 1) // 2] if m % 2 else 0.5 * (s[:, m // 2 - 1] + s[:, m // 2])
    f = m - count
    lo = ((med[:, None] - s[:, :f]) > (s[:, m - f:] - med[:, None])).sum(dim=1)
    pos = torch.arange(m, device=s.device)[None, :]
    take = (pos >= lo[:, None]) & (pos < lo[:, None] + count)
    return torch.where(take, s, torch.zeros((), dtype=s.dtype, device=s.device)).sum(dim=1) / count


@torch.no_grad()
def coord_select(*, rows: ClientRows, rule: str, first: int, count: int, out: torch.Tensor,
                 sq_norms_out: torch.Tensor, nonfinite_out: torch.Tensor) -> None:
    """The coordinate-select pass: ``out[j] = select_sorted(sorted values of coordinate j over the clients)``, and
    each client's ``||x_i - base||^2`` (float64) and whether it holds NaN or Inf, from the same blocks."""
    sq = torch.zeros(rows.num_clients, dtype=torch.float64, device=out.device)
    bad = torch.zeros(rows.num_clients, dtype=torch.bool, device=out.device)
    for off, x in column_blocks(rows):
        sq += x.to(torch.float64).square().sum(dim=1)
        bad |= ~torch.isfinite(x).all(dim=1)
        out[off:off + x.shape[1]] = select_sorted(torch.sort(x.T, dim=1).values, rule, first, count).to(out.dtype)
    sq_norms_out.copy_(sq)
    nonfinite_out.copy_(bad)


@torch.no_grad()
def gram(*, rows: ClientRows, gram_out: torch.Tensor, nonfinite_out: torch.Tensor) -> None:
    """``G[i, j] = <x_i - base, x_j - base>`` (float64, block sums) into ``gram_out`` [M * M], and each client's
    non-finite mark, in one pass."""
    m = rows.num_clients
    g = torch.zeros(m, m, dtype=torch.float64, device=gram_out.device)
    bad = torch.zeros(m, dtype=torch.bool, device=gram_out.device)
    for _, x in column_blocks(rows):
        bad |= ~torch.isfinite(x).all(dim=1)
        x = x.to(torch.float64)
        g += x @ x.T
    upper = g.triu()  # exactly symmetric (a GEMM's two triangles may differ in the last bit)
    gram_out.copy_((upper + upper.triu(1).T).reshape(-1))
    nonfinite_out.copy_(bad)


@torch.no_grad()
def momentum_apply(*, params: ParamRows, mean: torch.Tensor, lr: torch.Tensor, finite: torch.Tensor,
                   buf: torch.Tensor | None, momentum: float, nesterov: bool, extra_out: ParamRows | None,
                   extra_coef: torch.Tensor | None, extra_coef_skip: torch.Tensor | None,
                   overflow_out: torch.Tensor, start: list | None = None,
                   mean_scale: torch.Tensor | None = None) -> None:
    """The momentum family's apply pass::

        u = momentum * buf + mean        (u = mean without buf)
        step = mean + momentum * u if nesterov else u
        w <- w + lr * step;  buf <- u;  extra = w_new + extra_coef * u
    Not finite: w and buf unchanged; extra = w + extra_coef_skip * buf (w without buf), or left untouched when
    extra_coef_skip is None. An element whose new w, buf or extra would not be finite in its storage dtype keeps
    every old value and is counted in ``overflow_out``. ``start`` (segments like the params'): w's old values are
    read there and the params only written, as if they had held ``start`` before the pass. ``mean_scale`` (0-d
    float64): ``mean`` is a sum, and the mean ``0 + mean_scale * sum`` in its dtype (what the stats pass writes for
    one row of weight ``mean_scale``).
    """
    cdt = mean.dtype
    ok = bool(finite)
    for s, (off, n) in enumerate(zip(params.segments.offs, params.segments.lens)):
        w = params.parts[s]
        if start is not None:
            w.copy_(start[s])
        b = None if buf is None else buf[off : off + n]
        if not ok:
            if extra_out is not None and extra_coef_skip is not None:
                e = w.to(cdt) if b is None else w.to(cdt) + extra_coef_skip.to(cdt) * b
                e_ok = _finite_in(e, extra_out.dtype)
                old_finite = torch.isfinite(w) & (torch.isfinite(b) if b is not None else True)
                overflow_out += (~e_ok & old_finite).sum().to(overflow_out.dtype)
                extra_out.parts[s].copy_(torch.where(e_ok, e, w.to(cdt)))
            continue
        m = mean[off : off + n]
        if mean_scale is not None:  # (0 + scale * sum: the one-row stats pass's mean, bit for bit)
            m = mean_scale.to(cdt) * m + 0.0
        u = m if b is None else momentum * b + m
        step = m + momentum * u if nesterov else u
        w_new = w.to(cdt) + lr.to(cdt) * step
        good = _finite_in(w_new, w.dtype) & torch.isfinite(u)
        if extra_out is not None:
            e = w_new + extra_coef.to(cdt) * u
            good &= _finite_in(e, extra_out.dtype)
        # a kept element keeps every old value; it is counted unless its old values were not finite already
        old_finite = torch.isfinite(w) & (torch.isfinite(b) if b is not None else True)
        if extra_out is not None:
            extra_out.parts[s].copy_(torch.where(good, e, w.to(cdt)))
        overflow_out += (~good & old_finite).sum().to(overflow_out.dtype)
        w.copy_(torch.where(good, w_new, w.to(cdt)))
        if b is not None:
            b.copy_(torch.where(good, u, b))


@torch.no_grad()
def adam_apply(*, params: ParamRows, mean: torch.Tensor, finite: torch.Tensor, m: torch.Tensor | None,
               v: torch.Tensor, vhat: torch.Tensor | None, rule: str, lr: torch.Tensor, beta1: float, beta2: float,
               tau: float, ams_eps: float, overflow_out: torch.Tensor) -> None:
    """The Adam family's apply pass (nothing when not finite)::

        m <- b1 m + (1 - b1) mean                   (adagrad: m = mean, no buffer)
        v <- b2 v + (1 - b2) mean^2                 (adam, ams)
        v <- v - (1 - b2) mean^2 sign(v - mean^2)   (yogi)
        v <- v + mean^2                             (adagrad)
        vhat <- max(vhat, v, ams_eps)               (ams: the denominator uses vhat)
        w <- w + lr * m / (sqrt(v or vhat) + tau)
    An element whose new w or state would not be finite keeps every old value and is counted in ``overflow_out``.
    """
    if not bool(finite):
        return
    cdt = mean.dtype
    g2 = mean * mean
    m_new = mean if rule == "adagrad" else beta1 * m + (1 - beta1) * mean
    if rule in ("adam", "ams"):
        v_new = beta2 * v + (1 - beta2) * g2
    elif rule == "yogi":
        v_new = v - (1 - beta2) * g2 * torch.sign(v - g2)
    else:
        v_new = v + g2
    denom_sq = v_new
    if rule == "ams":
        denom_sq = torch.maximum(torch.maximum(vhat, v_new), torch.full_like(v_new, ams_eps))
    step = lr.to(cdt) * m_new / (denom_sq.sqrt() + tau)
    good = torch.isfinite(m_new) & torch.isfinite(v_new) & torch.isfinite(denom_sq)
    old_finite = torch.isfinite(v) & (torch.isfinite(m) if m is not None and rule != "adagrad" else True) & \
        (torch.isfinite(vhat) if rule == "ams" else True)
    w_new = []
    for s, (off, n) in enumerate(zip(params.segments.offs, params.segments.lens)):
        wn = params.parts[s].to(cdt) + step[off : off + n]
        good[off : off + n] &= _finite_in(wn, params.dtype)
        old_finite[off : off + n] &= torch.isfinite(params.parts[s])
        w_new.append(wn)
    good &= torch.isfinite(v_new)
    overflow_out += (~good & old_finite).sum().to(overflow_out.dtype)  # already Inf/NaN: the caller's
    if rule == "ams":
        vhat.copy_(torch.where(good, denom_sq, vhat))
    if m is not None and rule != "adagrad":
        m.copy_(torch.where(good, m_new, m))
    v.copy_(torch.where(good, v_new, v))
    for s, (off, n) in enumerate(zip(params.segments.offs, params.segments.lens)):
        params.parts[s].copy_(torch.where(good[off : off + n], w_new[s], params.parts[s].to(cdt)))


MODES = ("none", "heavy", "nesterov", "mass")


@torch.no_grad()
def local_step(*, x, g, anchor, control, ci, buf, lr, loss, l_star, sps_c, cap, first, prox: float, clip_norm: float,
               weight_decay: float, momentum: float, eta2: float, tiny: float, rule: str, mode: str,
               step_out: torch.Tensor) -> None:
    """Batched local step over M rows (x, g, anchor, ci, buf are RowTables; control a d-vector or None; lr, loss,
    l_star, sps_c, cap numbers for every row or float64 [M] tensors)::

        dir = g + prox (x - anchor) + (c - c_i);   s = ||dir||^2 per row
        scale = min(1, clip_norm / sqrt(s));       s2 = s scale^2
        step = lr_i (rule "fixed")  or  min((f_i - l*_i) / (c_i s2), cap_i) (rule "sps")
        rows with a non-finite s / loss / step, f <= l*, or s2 <= tiny take no step (step 0, nothing written)
        d = scale dir + weight_decay x, then
          none: x -= step d;  heavy: b = mu b + d, x -= step b;  nesterov: b = mu b + d, x -= step (d + mu b)
          mass: w = x - step d, x = w + mu (w - b) + eta2 d, b = w   (b taken as x where first[i] != 0)
    """
    m = x.num_rows
    lr, loss, l_star, sps_c, cap = (per_row_tensor(v, m, x.base.device) for v in (lr, loss, l_star, sps_c, cap))
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    X = x.gather(cdt)
    direction = g.gather(cdt)
    if anchor is not None:
        direction = direction + prox * (X - anchor.gather(cdt))
    if control is not None:
        direction = direction + (control.to(cdt)[None, :] - ci.gather(cdt))
    s = direction.double().square().sum(dim=1)
    scale = torch.ones_like(s)
    if clip_norm > 0:
        scale = torch.where(s > clip_norm ** 2, clip_norm / s.sqrt(), scale)
    s2 = s * scale * scale
    finite = torch.isfinite(s)
    if rule == "fixed":
        step = torch.where(finite, lr, torch.zeros_like(lr))
    else:
        ok = finite & torch.isfinite(loss) & (loss > l_star) & (s2 > tiny)
        raw = torch.minimum((loss - l_star) / (sps_c * torch.where(ok, s2, torch.ones_like(s2))), cap)
        step = torch.where(ok, raw, torch.zeros_like(raw))
    step = torch.where(torch.isfinite(step) & torch.isfinite(step.to(cdt)) & (step > 0), step, torch.zeros_like(step))
    step_out.copy_(step)
    active = step > 0
    d = scale.to(cdt)[:, None] * direction + weight_decay * X
    st = step.to(cdt)[:, None]
    # an element whose new x or state would not be finite keeps its old values (already Inf/NaN: stays as it was)
    if mode == "none":
        new_x = X - st * d
        good = torch.isfinite(new_x.to(x.dtype))
    elif mode in ("heavy", "nesterov"):
        b_old = buf.gather(cdt)
        b = momentum * b_old + d
        new_x = X - st * (d + momentum * b if mode == "nesterov" else b)
        good = torch.isfinite(new_x.to(x.dtype)) & torch.isfinite(b)
        buf.scatter(torch.where(good, b, b_old), active)
    else:
        b_old = buf.gather(cdt)
        w = X - st * d
        prev = b_old if first is None else torch.where(first[:, None] != 0, X, b_old)
        new_x = w + momentum * (w - prev) + eta2 * d
        good = torch.isfinite(new_x.to(x.dtype)) & torch.isfinite(w)
        buf.scatter(torch.where(good, w, b_old), active)
    x.scatter(torch.where(good, new_x, X), active)
