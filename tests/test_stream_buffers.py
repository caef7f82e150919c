"""Accumulator.add with state_dict clients: each client's buffers are checked against ``like``'s before anything is
folded (issue 42 converts them together, in one float64 row; every refusal still names the buffer), and the folded
buffer sums are the weighted values a buffer-by-buffer conversion gives."""
from __future__ import annotations

import pytest
import torch

import fastagg


def _model() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"l.weight": torch.randn(3, 2, generator=g), "bn.running_mean": torch.randn(3, generator=g),
            "bn.running_var": torch.rand(3, generator=g) + 0.5, "bn.num_batches_tracked": torch.tensor(5),
            "half.running_mean": torch.randn(2, generator=g).half()}


def _client(glob: dict, k: int) -> dict:
    return {n: (t + k if not t.is_floating_point() else t + 0.1 * k) for n, t in glob.items()}


@pytest.mark.parametrize("change, error, match", [
    ("shape", ValueError, r"model\[0\]\['bn.running_mean'\] has shape \(4,\)"),
    ("float counter", TypeError, r"model\[0\]\['bn.num_batches_tracked'\] has dtype torch.float32"),
    ("complex", TypeError, r"model\[0\]\['bn.running_var'\] has dtype torch.complex64"),
    ("base shape", ValueError, r"base\[0\]\['bn.running_var'\] has shape \(2,\)"),
    ("base float counter", TypeError, r"base\[0\]\['bn.num_batches_tracked'\] has dtype"),
])
def test_a_bad_buffer_is_refused_by_name_and_nothing_is_folded(change, error, match):
    glob = _model()
    acc = fastagg.Accumulator(like={n: t.clone() for n, t in glob.items()}, backend="cpu")
    base = {n: t.clone() for n, t in glob.items()}
    c = _client(glob, 1)
    if change == "shape":
        c["bn.running_mean"] = torch.zeros(4)
    elif change == "float counter":
        c["bn.num_batches_tracked"] = torch.tensor(6.0)
    elif change == "complex":
        c["bn.running_var"] = torch.ones(3, dtype=torch.complex64)
    elif change == "base shape":
        base["bn.running_var"] = torch.ones(2)
    else:
        base["bn.num_batches_tracked"] = torch.tensor(5.0)
    with pytest.raises(error, match=match):
        acc.add(c, weight=2.0, base=base)
    assert acc.num_clients == 0
    acc.add(_client(glob, 1), weight=2.0, base={n: t.clone() for n, t in glob.items()})  # a good one still folds
    assert acc.num_clients == 1


def test_folded_buffers_are_the_weighted_values():
    glob = _model()
    like = {n: t.clone() for n, t in glob.items()}
    acc = fastagg.Accumulator(like=like, backend="cpu")
    weights = [1.0, 3.0, 0.5]
    clients = [_client(glob, k) for k in (1, 2, 7)]
    for c, w in zip(clients, weights):
        acc.add(c, weight=w, base=glob)
    sums = dict(zip(acc._buffer_names, acc._buffer_sums))
    for n in ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked", "half.running_mean"):
        want = sum(w * (c[n].to(torch.float64) - glob[n].to(torch.float64)) for c, w in zip(clients, weights))
        assert torch.equal(sums[n], want), n


def test_a_client_without_one_of_the_model_s_buffers_is_named():
    """(The same review: a bare KeyError before.)"""
    g = {"w": torch.zeros(3), "bn.running_mean": torch.zeros(2), "bn.num_batches_tracked": torch.tensor(1)}
    acc = fastagg.Accumulator(like=g)
    with pytest.raises(ValueError, match="delta has no buffer 'bn.num_batches_tracked'"):
        acc.add({"w": torch.ones(3), "bn.running_mean": torch.ones(2)}, weight=1.0, base=g)
    assert acc.num_clients == 0


def _sum_of(acc) -> torch.Tensor:
    return acc._sum.clone() if acc._sum is not None else None


@pytest.mark.parametrize("change", ["copy_ in place", "entry replaced", "set_ to other storage", "resized"])
def test_a_kept_base_is_used_only_while_it_is_the_same_memory(change):
    """Accumulator.add keeps the checked base of the last add (issue 42: every client of a round passes the same
    model). Between two adds the base changes; the second add must fold ``model - base`` with the base as it is
    then, as an accumulator given a fresh copy of that base does."""
    g = {"w": torch.zeros(4), "v": torch.zeros(2, 3)}
    base = {k: v.clone() for k, v in g.items()}
    c1 = {"w": torch.full((4,), 3.0), "v": torch.full((2, 3), 2.0)}
    c2 = {"w": torch.full((4,), 5.0), "v": torch.full((2, 3), 1.0)}
    acc = fastagg.Accumulator(like=g, backend="cpu")
    acc.add(c1, weight=1.0, base=base)
    if change == "copy_ in place":
        base["w"].copy_(torch.arange(4.0))
    elif change == "entry replaced":
        base["v"] = torch.full((2, 3), 0.5)
    elif change == "set_ to other storage":
        base["w"].set_(torch.full((4,), 1.5))
    else:
        base["w"].resize_(5).fill_(0.25)  # (a new storage, another size: refused, as a fresh copy is)
    fresh = {k: v.clone() for k, v in base.items()}
    if change == "resized":
        with pytest.raises(ValueError):
            acc.add(c2, weight=1.0, base=base)
        with pytest.raises(ValueError):
            fastagg.Accumulator(like=g, backend="cpu").add(c2, weight=1.0, base=fresh)
        return
    acc.add(c2, weight=1.0, base=base)
    oracle = fastagg.Accumulator(like=g, backend="cpu")
    oracle.add(c1, weight=1.0, base={k: v.clone() for k, v in g.items()})
    oracle.add(c2, weight=1.0, base=fresh)
    assert torch.equal(_sum_of(acc), _sum_of(oracle))
