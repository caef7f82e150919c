"""Layouts: flatten / unflatten round trips, and which entries count."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import fastagg
from fastagg.flat import Layout


def test_flatten_unflatten_round_trip_gives_views():
    parts = [torch.randn(2, 3), torch.randn(4), torch.randn(1, 1, 5)]
    flat, layout = fastagg.flatten(parts)
    assert flat.shape == (15,) and layout.offsets == (0, 6, 10)
    back = layout.unflatten(flat)
    for a, b in zip(parts, back):
        assert torch.equal(a, b)
    back[1][0] = 42.0  # views of flat
    assert flat[6] == 42.0


def test_buffers_never_count_unless_asked():
    """A module's buffers, and a state_dict's entries named like torch's buffers, are buffers (averaged apart,
    never in eta); integers never count; buffers=True makes floating buffers count."""
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    sd = net.state_dict()
    layout = Layout.of(sd)
    assert "1.num_batches_tracked" not in layout.names  # integer: never counts
    assert layout.names == ("0.weight", "0.bias", "1.weight", "1.bias")  # running statistics are buffers
    assert Layout.of(sd, buffer_names=set()).names[-2:] == ("1.running_mean", "1.running_var")  # named by a module
    params_only = Layout.of(net)
    assert params_only.names == ("0.weight", "0.bias", "1.weight", "1.bias")
    with_buffers = Layout.of(net, buffers=True)
    assert with_buffers.names[-2:] == ("1.running_mean", "1.running_var")
    flat, lay = fastagg.flatten(net)
    assert flat.numel() == 3 * 4 + 4 + 4 + 4 and isinstance(lay.unflatten(flat), dict)


def test_numpy_lists_and_layout_signature():
    parts = [np.ones((2, 2), np.float32), np.zeros(3, np.float32)]
    flat, layout = fastagg.flatten(parts)
    assert flat.dtype == torch.float32 and flat.sum() == 4
    other = Layout.of([np.ones((2, 2), np.float32), np.zeros(4, np.float32)])
    assert "entry 1" in layout.first_difference(other)
    assert layout.first_difference(Layout.of(parts)) is None


def test_flatten_rejects_integer_list_entries():
    with pytest.raises(TypeError, match=r"model\[1\] has dtype torch.int64; expected a floating dtype"):
        fastagg.flatten([torch.ones(2), torch.ones(2, dtype=torch.int64)])


def test_module_params_are_updated_in_place():
    net = torch.nn.Linear(3, 2)
    before = [p.detach().clone() for p in net.parameters()]
    deltas = torch.ones(2, 8)
    fastagg.fedavg_step(deltas, lr=1.0, params=net)
    for b, p in zip(before, net.parameters()):
        assert torch.allclose(p.detach(), b + 1)
