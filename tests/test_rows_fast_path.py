"""The hot path of ``rows.client_rows`` for lists of tensor state_dicts (issue 42) against the general path it
shortcuts: on every input, benign or hostile, the same ClientRows (the same views, segments, layout and buffers) or
the same exception with the same message. The general path is forced by disabling the shortcut."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from fastagg import rows as rows_mod
from fastagg.rows import client_rows, param_rows


def _model(rng: random.Random) -> dict:
    sd = {}
    for k in range(rng.randrange(1, 6)):
        c = rng.randrange(1, 4)
        sd[f"l{k}.weight"] = torch.randn(c, rng.randrange(1, 3))
        if rng.random() < 0.6:
            sd[f"l{k}.bias"] = torch.randn(c)
        if rng.random() < 0.5:
            sd[f"bn{k}.running_mean"] = torch.randn(c)
            sd[f"bn{k}.running_var"] = torch.rand(c)
            sd[f"bn{k}.num_batches_tracked"] = torch.tensor(3)
    return sd


def _hostile(rng: random.Random, clients: list) -> str:
    """One change a careless or hostile client makes; returns what it was."""
    i = rng.randrange(len(clients))
    c = clients[i]
    keys = list(c)
    k = rng.choice(keys)
    v = c[k] if isinstance(c[k], torch.Tensor) else torch.from_numpy(np.array(c[k]))  # (a copy, for the changes)
    kind = rng.choice(["shape", "dtype", "missing", "extra", "order", "numpy", "strided", "grad", "list", "int",
                       "complex_buffer", "float_counter", "meta", "int_param", "none", "buffer_shape"])
    if kind == "shape" and v.dim() >= 1:
        c[k] = torch.randn(*v.shape, 2)
    elif kind == "dtype" and v.is_floating_point():
        c[k] = v.to(rng.choice([torch.float64, torch.float16, torch.bfloat16]))
    elif kind == "missing" and len(keys) > 1:
        del c[k]
    elif kind == "extra":
        c["zz.extra"] = torch.randn(2)
    elif kind == "order" and len(keys) > 1:
        items = list(c.items())
        rng.shuffle(items)
        clients[i] = dict(items)
    elif kind == "numpy":
        c[k] = v.numpy() if isinstance(v, torch.Tensor) else torch.from_numpy(v.copy())
    elif kind == "strided" and v.dim() == 2 and v.shape[0] > 1:
        c[k] = torch.randn(v.shape[1], v.shape[0]).t()
    elif kind == "grad" and v.is_floating_point():
        c[k] = v.clone().requires_grad_(True)
    elif kind == "list":
        clients[i] = list(c.values())
    elif kind == "int":
        c[k] = 3
    elif kind == "complex_buffer" and "running" in k:
        c[k] = torch.randn(v.shape, dtype=torch.complex64)
    elif kind == "float_counter" and k.endswith("num_batches_tracked"):
        c[k] = torch.tensor(3.5)
    elif kind == "meta":
        c[k] = torch.empty(v.shape, device="meta", dtype=v.dtype)
    elif kind == "int_param" and v.is_floating_point():
        c[k] = v.to(torch.int32)
    elif kind == "none":
        clients[i] = None
    elif kind == "buffer_shape" and "running" in k:
        c[k] = torch.randn(v.numel() + 1)
    else:
        return "none"
    return kind


def _readonly(a: np.ndarray) -> np.ndarray:
    out = np.frombuffer(a.tobytes(), dtype=a.dtype).reshape(a.shape)
    assert not out.flags.writeable
    return out


def _outcome(fn):
    try:
        return ("ok", fn())
    except Exception as e:  # noqa: BLE001 -- the outcome compared is the exception itself
        return ("raised", type(e), str(e))


def _same_rows(a, b) -> None:
    assert a.num_clients == b.num_clients and a.dtype == b.dtype and a.device == b.device
    assert a.segments == b.segments and a.form == b.form and a.matrix is None and b.matrix is None
    assert len(a.rows) == len(b.rows)
    for sa, sb in zip(a.rows, b.rows):
        for x, y in zip(sa, sb):
            assert x.data_ptr() == y.data_ptr() and x.shape == y.shape and x.stride() == y.stride()
            assert x.dim() == 1 and not x.requires_grad
    assert (a.buffers is None) == (b.buffers is None)
    if a.buffers is not None:
        assert a.buffers.names == b.buffers.names
        for va, vb in zip(a.buffers.values, b.buffers.values):
            assert [t.data_ptr() for t in va] == [u.data_ptr() for u in vb]


@pytest.mark.parametrize("seed", range(300))
def test_shortcut_matches_the_general_path(seed, monkeypatch):
    rng = random.Random(seed)
    glob = _model(rng)
    m = rng.randrange(1, 5)
    clients = [{k: (v + 1 if not v.is_floating_point() else v + torch.randn(v.shape)) for k, v in glob.items()}
               for _ in range(m)]
    if rng.random() < 0.35:  # replies as Flower / FLARE hand them over: numpy arrays, read-only views of bytes
        clients = [{k: _readonly(v.numpy()) if rng.random() < 0.5 else v.numpy() for k, v in c.items()}
                   for c in clients]
    kind = _hostile(rng, clients) if rng.random() < 0.8 else "none"
    with_params = rng.random() < 0.5
    p = param_rows({k: v.clone() for k, v in glob.items()}) if with_params else None
    fast = _outcome(lambda: client_rows(clients, name="models", params=p))
    monkeypatch.setattr(rows_mod, "_tensor_dicts", lambda *a, **k: None)
    slow = _outcome(lambda: client_rows(clients, name="models", params=p))
    assert fast[0] == slow[0], (kind, fast, slow)
    if fast[0] == "ok":
        _same_rows(fast[1], slow[1])
    else:
        assert fast[1:] == slow[1:], kind


def test_shortcut_is_taken_for_plain_state_dicts(monkeypatch):
    """The benign case really takes the shortcut (else this file would test the general path against itself)."""
    glob = {"a.weight": torch.randn(3, 2), "bn.running_mean": torch.zeros(3), "bn.num_batches_tracked": torch.tensor(1)}
    clients = [{k: v.clone() for k, v in glob.items()} for _ in range(3)]
    calls = []
    real = rows_mod._tensor_dicts
    monkeypatch.setattr(rows_mod, "_tensor_dicts", lambda *a, **k: calls.append(1) or real(*a, **k))
    r = client_rows(clients, name="models", params=param_rows({k: v.clone() for k, v in glob.items()}))
    assert calls and real(clients, "models", ("a.weight",), {"bn.running_mean", "bn.num_batches_tracked"}, None,
                          None) is not None
    assert r.rows[0][2].data_ptr() == clients[2]["a.weight"].data_ptr()
    assert np.array_equal(r.buffers.values[0][1].numpy(), clients[1]["bn.running_mean"].numpy())


@pytest.mark.parametrize("change", ["complex running_var", "float counter", "meta running_mean", "meta weight",
                                    "strided weight", "buffer longer", "weight needs grad", "every weight on meta"])
@pytest.mark.parametrize("with_params", [False, True])
def test_each_buffer_and_entry_check_matches(change, with_params, monkeypatch):
    glob = {"a.weight": torch.randn(3, 2), "bn.running_mean": torch.zeros(3), "bn.running_var": torch.ones(3),
            "bn.num_batches_tracked": torch.tensor(1)}
    clients = [{k: v.clone() for k, v in glob.items()} for _ in range(3)]
    c = clients[1]
    if change == "complex running_var":
        c["bn.running_var"] = torch.ones(3, dtype=torch.complex64)
    elif change == "float counter":
        c["bn.num_batches_tracked"] = torch.tensor(2.5)
    elif change == "meta running_mean":
        c["bn.running_mean"] = torch.empty(3, device="meta")
    elif change == "meta weight":
        c["a.weight"] = torch.empty(3, 2, device="meta")
    elif change == "strided weight":
        c["a.weight"] = torch.randn(2, 3).t()
    elif change == "every weight on meta":
        for cl in clients:
            cl["a.weight"] = torch.empty(3, 2, device="meta")
    elif change == "buffer longer":
        c["bn.running_mean"] = torch.zeros(4)
    else:
        c["a.weight"] = torch.randn(3, 2, requires_grad=True)
    p = param_rows({k: v.clone() for k, v in glob.items()}) if with_params else None
    fast = _outcome(lambda: client_rows(clients, name="models", params=p))
    monkeypatch.setattr(rows_mod, "_tensor_dicts", lambda *a, **k: None)
    slow = _outcome(lambda: client_rows(clients, name="models", params=p))
    assert fast[0] == slow[0], (fast, slow)
    if fast[0] == "ok":
        _same_rows(fast[1], slow[1])
    else:
        assert fast[1:] == slow[1:]
