"""fastagg._tensor_facts (csrc/tensor_facts.cpp, read through fastagg._facts): the facts it reports equal what torch's
own Python attributes say, for ordinary and hostile tensors; what it cannot vouch for it reports as unknown; it is
used only under the torch it was built for; and every check made from its facts decides exactly as the same check
made attribute by attribute (the Python path every install without the module runs)."""
import re

import numpy as np
import pytest
import torch

import fastagg
from fastagg import _facts, rows
from fastagg.flat import memory_spans


@pytest.fixture(autouse=True)
def compiled(monkeypatch):
    """The compiled module in use for these tests, also under FASTAGG_TENSOR_FACTS=0 (which turns it off elsewhere)."""
    monkeypatch.setattr(_facts, "_MODULE", _facts._compiled)
    monkeypatch.delenv("FASTAGG_TENSOR_FACTS", raising=False)
    return _facts._compiled


def test_the_compiled_module_is_built_and_used_in_this_install():
    """`make` installs without build isolation, so the module is built against this torch: if it is not used here,
    an install step regressed (every check would silently run the slower Python path)."""
    assert _facts._compiled is not None, _facts._IMPORT_ERROR
    assert _facts._load() == (_facts._compiled, None)
    assert "in C (fastagg._tensor_facts" in fastagg.env_report()


class Sub(torch.Tensor):
    pass


def _zoo() -> dict:
    x = torch.randn(3, 4)
    cplx = torch.randn(3, dtype=torch.complex64)
    shrunk = torch.randn(16)
    view = shrunk[4:]
    shrunk.untyped_storage().resize_(8)  # 2 floats left: `view` now reaches past its storage's end
    freed = torch.randn(4)
    freed.untyped_storage().resize_(0)
    with torch.inference_mode():
        inference = torch.randn(3)
    cow = torch._lazy_clone(torch.randn(5))
    return {
        "float32": x, "transposed": x.t(), "row with offset": x[1], "column": x[:, 2], "0-d": torch.tensor(2.5),
        "empty": torch.empty(0, 3), "requires grad": torch.randn(2, requires_grad=True), "int64": torch.arange(4),
        "bool": torch.ones(3, dtype=torch.bool), "bfloat16": torch.randn(4, dtype=torch.bfloat16),
        "float16": torch.randn(4, dtype=torch.float16), "float64": torch.randn(2, dtype=torch.float64),
        "conj view": cplx.conj(), "neg view": cplx.conj().imag, "expanded": torch.randn(1, 3).expand(4, 3),
        "channels_last": torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
        "8 dims": torch.randn(*[2] * 8), "meta": torch.empty(3, 2, device="meta"), "inference": inference,
        "zero tensor": torch._efficientzerotensor(3), "past its storage": view, "storage freed": freed,
        "lazy clone": cow, "uint8": torch.zeros(5, dtype=torch.uint8),
        # what the module must not vouch for (OK = 0)
        "9 dims": torch.randn(*[1] * 9), "parameter": torch.nn.Parameter(torch.randn(2)), "subclass": Sub(torch.ones(2)),
        "sparse": torch.randn(3).to_sparse(), "numpy": np.zeros(3), "None": None, "int": 3,
        "csr": torch.eye(3).to_sparse_csr(), "list": [torch.ones(2)],
    }


UNKNOWN = {"9 dims", "parameter", "subclass", "sparse", "numpy", "None", "int", "csr", "list"}


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_facts_equal_what_torch_says_and_the_unsure_ones_are_unknown():
    zoo = _zoo()
    f = _facts.facts(list(zoo.values()))
    assert f.shape == (len(zoo), _facts.NCOLUMNS)
    for row, (name, t) in zip(f, zoo.items()):
        if name in UNKNOWN:
            assert row[_facts.OK] == 0 and not row.any(), name
            continue
        assert row[_facts.OK] == 1, name
        assert row[_facts.DTYPE] == _facts.dtype_code(t.dtype), name
        dev = row[_facts.DEVICE]
        assert (dev >> 16 == _facts.META) == (t.device.type == "meta"), name
        assert (dev & 0xFFFF) == ((t.device.index if t.device.index is not None else -1) & 0xFFFF), name
        flags = row[_facts.FLAGS]
        st = t.untyped_storage()
        try:
            st_ptr = st.data_ptr()
        except RuntimeError:  # (torch refuses it where there is no memory: reported as address 0)
            assert t.device.type == "meta" or t._is_zerotensor(), name
            st_ptr = 0
        inside = t.data_ptr() != 0 and st_ptr <= t.data_ptr() and t.data_ptr() + t.nbytes <= st_ptr + st.nbytes()
        expect = {_facts.MEMORY_OK: t.numel() == 0 or inside,
                  _facts.CONTIGUOUS: t.is_contiguous(), _facts.REQUIRES_GRAD: t.requires_grad,
                  _facts.NEG: t.is_neg(), _facts.CONJ: t.is_conj(), _facts.ZERO_TENSOR: t._is_zerotensor(),
                  _facts.FLOATING: t.is_floating_point(), _facts.COMPLEX: t.is_complex()}
        for bit, want in expect.items():
            assert bool(flags & bit) == want, (name, bit)
        assert list(row[_facts.NDIM:_facts.NUMEL]) == [t.dim(), *t.shape, *[0] * (8 - t.dim())], name
        assert row[_facts.NUMEL] == t.numel() and row[_facts.NBYTES] == t.numel() * t.element_size(), name
        assert row[_facts.DATA] == t.data_ptr(), name
        assert row[_facts.STORAGE_DATA] == st_ptr and row[_facts.STORAGE_NBYTES] == st.nbytes(), name


def test_facts_take_lists_and_tuples_only():
    t = torch.ones(2)
    assert np.array_equal(_facts.facts((t, t)), _facts.facts([t, t]))
    assert _facts.facts([]).shape == (0, _facts.NCOLUMNS)
    for bad in (t, (x for x in [t]), {"a": t}, None):
        with pytest.raises(TypeError, match="list or tuple"):
            _facts._compiled.facts(bad)


def test_a_module_built_for_another_torch_is_not_used():
    mod = _facts._compiled
    for attr, value, said in (("TORCH_VERSION", "2.0.0+cpu", f"built for torch 2.0.0+cpu"),
                              ("TORCH_GIT_VERSION", "0" * 40, "(000000000000), this is torch"),  # a nightly
                              ("COLUMNS", mod.COLUMNS[:-1], "columns differ")):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(mod, attr, value)
            module, why = _facts._load()
        assert module is None and said in why, (attr, why)
        assert "rebuild" in why
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FASTAGG_TENSOR_FACTS", "0")
        assert _facts._load() == (None, "turned off (FASTAGG_TENSOR_FACTS=0)")
    assert _facts._load() == (mod, None)


@pytest.fixture(params=["facts", "attributes"])
def mode(request, monkeypatch):
    """Each check run both ways: from the compiled module's facts, and attribute by attribute (no module)."""
    if request.param == "attributes":
        monkeypatch.setattr(_facts, "_MODULE", None)
    return request.param


def test_memory_spans_from_facts_equal_the_attribute_path():
    zoo = {k: v for k, v in _zoo().items() if k not in UNKNOWN}
    for name, t in zoo.items():
        got = memory_spans([t])
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(_facts, "_MODULE", None)
            want = memory_spans([t])
        assert (got is None) == (want is None), name
        if got is not None:
            assert [a.tolist() for a in got] == [a.tolist() for a in want], name
    for name in ("past its storage", "zero tensor", "storage freed", "meta"):
        assert memory_spans([zoo[name]]) is None, name


def _model():
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(),
                               torch.nn.Linear(4 * 6 * 6, 5))


def _clients(model, m=4):
    out = []
    for i in range(m):
        sd = {k: v.clone() for k, v in model.state_dict().items()}
        for k, v in sd.items():
            if v.is_floating_point():
                v.add_(0.01 * (i + 1))
            else:
                v.add_(i + 1)
        out.append(sd)
    return out


def _hostile(name: str, clients: list) -> list:
    """Client 2's state_dict with one entry made hostile."""
    c = dict(clients[2])
    w, rm, nbt = "0.weight", "1.running_mean", "1.num_batches_tracked"
    if name == "dtype":
        c[w] = c[w].double()
    elif name == "shape (same numel)":
        c[w] = c[w].reshape(3, 4, 3, 3)
    elif name == "transposed":
        c["3.weight"] = c["3.weight"].t().contiguous().t()
    elif name == "requires grad":
        c[w] = c[w].clone().requires_grad_()
    elif name == "neg view":
        c[w] = torch._neg_view(c[w])
    elif name == "meta":
        c[w] = torch.empty_like(c[w], device="meta")
    elif name == "complex buffer":
        c[rm] = c[rm].to(torch.complex64)
    elif name == "floating counter":
        c[nbt] = c[nbt].double()
    elif name == "buffer shape":
        c[rm] = torch.zeros(5)
    elif name == "zero tensor":
        c[w] = torch._efficientzerotensor(c[w].shape)
    elif name == "past its storage":
        big = torch.randn(c[w].numel() * 2)
        c[w] = big[c[w].numel():].view(c[w].shape)
        big.untyped_storage().resize_(big.numel())  # half its bytes: the view reaches past the end
    elif name == "parameter":
        c[w] = torch.nn.Parameter(c[w].clone(), requires_grad=False)
    elif name == "non-contiguous buffer":
        c[rm] = torch.randn(8)[::2]
    elif name == "nan":
        c[w] = c[w].clone()
        c[w][0, 0, 0, 0] = float("nan")
    else:
        raise AssertionError(name)
    return clients[:2] + [c] + clients[3:]


HOSTILE = ["dtype", "shape (same numel)", "transposed", "requires grad", "neg view", "meta", "complex buffer",
           "floating counter", "buffer shape", "zero tensor", "past its storage", "parameter",
           "non-contiguous buffer", "nan"]


def _outcome(fn):
    try:
        out = fn()
    except Exception as e:  # noqa: BLE001 -- the outcome compared across the two paths is the error itself
        return type(e).__name__, re.sub(r"0x[0-9a-f]+", "0x?", str(e))
    return "ok", out


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_entry_gets_the_same_answer_from_facts_and_from_attributes(name):
    torch.manual_seed(0)
    model = _model()
    clients = _hostile(name, _clients(model))
    names = tuple(k for k, v in model.state_dict().items() if v.is_floating_point() and "running" not in k)

    def fast():
        return rows._tensor_dicts(clients, "models", names, None, None, None)

    def step():
        m = {k: v.clone() for k, v in model.state_dict().items()}
        res = fastagg.fedavg_step(models=clients, params=m)
        return [t.tolist() for t in m.values()], res.sq_norms.tolist()

    by_facts, by_step = fast(), _outcome(step)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_facts, "_MODULE", None)
        by_attrs, by_step_attrs = fast(), _outcome(step)
    assert (by_facts is None) == (by_attrs is None), name
    if by_facts is not None:
        assert [a.tolist() for a in by_facts.rows.spans] == [a.tolist() for a in by_attrs.rows.spans]
    assert by_step == by_step_attrs, name
    accepted = ("requires grad", "parameter", "non-contiguous buffer")  # (detached / copied by the general path)
    assert (by_step[0] == "ok") == (name in accepted), by_step
    if name not in accepted + ("nan", "floating counter"):  # (found in the pass / against the model's counters)
        assert by_facts is None, f"{name}: the fast path let a hostile entry through"


def test_clean_state_dicts_take_the_fast_path_with_identical_rows(mode):
    torch.manual_seed(1)
    model = _model()
    clients = _clients(model, 5)
    names = tuple(k for k, v in model.state_dict().items() if v.is_floating_point() and "running" not in k)
    got = rows._tensor_dicts(clients, "models", names, None, None, None)
    assert got is not None and got.num_clients == 5
    for k, col in enumerate(got.rows):
        assert all(r.data_ptr() == clients[i][names[k]].data_ptr() for i, r in enumerate(col))
    lo, hi = got.rows.spans
    want = [(c[n].data_ptr(), c[n].data_ptr() + c[n].nbytes) for n in names for c in clients]
    assert list(zip(lo.tolist(), hi.tolist())) == want


def test_an_entry_of_more_than_8_dimensions_takes_the_attribute_checks_with_the_same_result(mode):
    """The facts hold 8 sizes: a layout with a 9-dimensional entry is checked attribute by attribute, either way."""
    torch.manual_seed(2)
    glob = {"w": torch.randn(*[2] * 9), "b": torch.randn(3)}
    clients = [{k: v + 0.1 * i for k, v in glob.items()} for i in range(3)]
    params = {k: v.clone() for k, v in glob.items()}
    fastagg.fedavg_step(models=clients, params=params)
    for k, v in glob.items():
        assert torch.allclose(params[k], v + 0.1, atol=1e-6), k
    clients[1]["w"] = clients[1]["w"].reshape(*[2] * 8, 2, 1)
    with pytest.raises(ValueError, match=r"models\[1\]\['w'\] has shape"):
        fastagg.fedavg_step(models=clients, params={k: v.clone() for k, v in glob.items()})
