"""Small habits users bring (the rough edges a newcomer met): submodules reachable from ``import fastagg`` without
making the import heavier, ``client_ids`` as a list or numpy array like weights, one non-finite flag per client
whatever the input, readable reprs, shape errors that give the number."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

import fastagg
from fastagg import client


def test_submodules_are_reachable_lazily():
    code = ("import sys, fastagg\n"
            "heavy = [m for m in ('fastagg.server', 'fastagg.distributed', 'fastagg.client', 'flwr', 'fastagg.sim')"
            " if m in sys.modules]\n"
            "assert not heavy, heavy\n"
            "assert fastagg.server.FedAdam and fastagg.distributed.shard and fastagg.client.sps_step\n"
            "assert {'server', 'client', 'distributed'} <= set(dir(fastagg))\n"
            "try:\n    fastagg.no_such_thing\nexcept AttributeError as e:\n    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "no attribute 'no_such_thing'" in r.stdout, r.stderr


@pytest.mark.parametrize("ids", [[0, 2, 4], (0, 2, 4), np.array([0, 2, 4]), np.array([0, 2, 4], dtype=np.int32),
                                 torch.tensor([0, 2, 4])])
def test_client_ids_as_a_list_or_numpy_array(ids):
    x, g = torch.randn(3, 10), torch.randn(3, 10)
    state = client.ClientState(5, 10)
    x_ref, state_ref = x.clone(), client.ClientState(5, 10)
    client.local_step(params=x, grads=g, lr=0.1, momentum=0.9, state=state, client_ids=ids)
    client.local_step(params=x_ref, grads=g, lr=0.1, momentum=0.9, state=state_ref, client_ids=torch.tensor([0, 2, 4]))
    assert torch.equal(x, x_ref) and torch.equal(state.vector("momentum"), state_ref.vector("momentum"))


@pytest.mark.parametrize("ids", [[0, 1.5, 2], [True, 0, 1], np.array([0.0, 1, 2]), np.array([True, False, True]),
                                 [0, 1, 10**30], "abc"])
def test_client_ids_that_are_not_integers_are_refused(ids):
    x = torch.randn(3, 10)
    before = x.clone()
    with pytest.raises(TypeError, match="client_ids"):
        client.local_step(params=x, grads=torch.randn(3, 10), lr=0.1, momentum=0.9, state=client.ClientState(5, 10),
                          client_ids=ids)
    assert torch.equal(x, before)


def test_a_shape_error_gives_the_number_of_clients():
    x = torch.randn(3, 10)
    with pytest.raises(ValueError, match=r"expected \(5, 10\): a row per client"):
        client.local_step(params=x, grads=torch.randn(3, 10), lr=0.1, control=(torch.zeros(10), torch.zeros(3, 10)),
                          state=client.ClientState(5, 10), client_ids=[0, 1, 2])


def test_a_step_on_an_accumulator_flags_every_client():
    w = torch.zeros(10)
    acc = fastagg.Accumulator(like=w)
    for i in range(3):
        acc.add(torch.randn(10), weight=2, client_id=i)
    stats = fastagg.server.FedAvg(w).step(acc)
    assert stats.nonfinite.shape == (3,) and not stats.nonfinite.any()
    assert stats.nonfinite.shape == fastagg.server.FedAvg(torch.zeros(10)).step(torch.randn(3, 10)).nonfinite.shape


def test_reprs_say_what_they_hold():
    acc = fastagg.Accumulator(like=torch.zeros(10))
    acc.add(torch.ones(10), weight=2.5, client_id="a")
    assert repr(acc) == ("Accumulator(numel=10, dtype=torch.float32, device=cpu, clients=1, total_weight=2.5, "
                         "backend='cpu')")
    state = client.ClientState(4, 10)
    state.vector("momentum")
    assert repr(state) == ("ClientState(num_clients=4, dim=10, dtype=torch.float32, device=cpu, "
                           "vectors=['momentum'], scalars=[])")


def test_an_optimizer_does_not_keep_its_process_group_alive(tmp_path):
    """torch's registry keeps a group until destroy_process_group; an optimizer holding it past that made the
    group die during interpreter shutdown and gloo abort at exit (the README's two-rank block, 1 run in 4-10). The
    optimizer holds it weakly: after destroy_process_group the group is gone and a step says why."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = ("import gc, weakref, torch, torch.distributed as dist, fastagg\n"
            f"dist.init_process_group('gloo', init_method='tcp://127.0.0.1:{port}', rank=0, world_size=1)\n"
            "opt = fastagg.server.FedAvg(torch.zeros(8), group=dist.group.WORLD)\n"
            "opt.step(torch.ones(2, 8))\n"
            "probe = weakref.ref(opt.group)\n"
            "dist.destroy_process_group(); gc.collect()\n"
            "assert probe() is None, 'the optimizer kept the destroyed group alive'\n"
            "try:\n    opt.step(torch.ones(2, 8))\nexcept RuntimeError as e:\n    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "group was destroyed" in r.stdout, r.stderr[-2000:]
