"""fastagg._tensor_facts (csrc/tensor_facts.cpp, read through fastagg._facts): the facts it reports equal what torch's
own Python attributes say, for ordinary and hostile tensors; what it cannot vouch for it reports as unknown; it is
used only under the torch it was built for; and every check made from its facts decides exactly as the same check
made attribute by attribute (the Python path every install without the module runs)."""
import os
import re
import subprocess
import sys

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
        "9 dims": torch.randn(*[1] * 9), "parameter": torch.nn.Parameter(torch.randn(2)),
        "subclass": Sub(torch.ones(2)),
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
    for attr, value, said in (("TORCH_VERSION", "2.0.0+cpu", "built for torch 2.0.0+cpu"),
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


# ---- row tables: a round's rows handed to the compiled kernels as one capsule (csrc/row_table.h) -----------------

def _stats_call(rows_arg, base_arg, lens, m, dtype=torch.float32):
    from fastagg.backends import cpu

    d = sum(lens)
    out = dict(mean=torch.zeros(d, dtype=torch.float64 if dtype == torch.float64 else torch.float32),
               sq=torch.zeros(m, dtype=torch.float64), bad=torch.zeros(m, dtype=torch.bool),
               msq=torch.zeros((), dtype=torch.float64))
    w = torch.full((m,), 1.0 / m, dtype=torch.float64)
    cpu.compiled().round_stats(rows_arg, base_arg, list(lens), cpu._dl(w), None, None, 0.0, cpu._dl(out["mean"]),
                               cpu._dl(out["sq"]), cpu._dl(out["bad"]), cpu._dl(out["msq"]), 0.0, 0, 0)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_a_row_table_gives_the_kernel_exactly_what_the_capsules_give(dtype):
    from fastagg.backends import cpu

    torch.manual_seed(3)
    lens, m = [7, 1, 0, 33], 5
    rows = [[torch.randn(n).to(dtype) for _ in range(m)] for n in lens]
    rows[3][2] = torch.randn(3, 11).to(dtype)  # N-D contiguous entries are rows of their element count
    base = [torch.randn(n).to(dtype) for n in lens]
    table, btable = _facts.row_table(rows), _facts.row_table([[b] for b in base])
    assert table is not None and btable is not None
    by_table = _stats_call(table, btable, lens, m, dtype)
    by_capsules = _stats_call([[cpu._dl(r) for r in seg] for seg in rows], [cpu._dl(b) for b in base], lens, m, dtype)
    for k in by_table:
        assert torch.equal(by_table[k], by_capsules[k]), k


def test_a_row_table_keeps_its_tensors_alive():
    import gc

    lens, m = [1000, 3], 4
    rows = [[torch.full((n,), float(i + 1)) for i in range(m)] for n in lens]
    table = _facts.row_table(rows)
    from fastagg.backends import cpu

    want = _stats_call([[cpu._dl(r.clone()) for r in seg] for seg in rows], None, lens, m)
    del rows
    gc.collect()
    _ = [torch.full((1000,), -7.0) for _ in range(50)]  # would reuse freed memory
    got = _stats_call(table, None, lens, m)
    assert all(torch.equal(got[k], want[k]) for k in got)


def test_a_row_table_refuses_what_it_may_not_hold():
    good = torch.ones(3)
    cases = {
        "ragged": [[good, good], [good]], "empty segment list": [], "no clients": [[]],
        "int64": [[torch.ones(3, dtype=torch.int64)]], "mixed dtypes": [[good, good.double()]],
        "non-contiguous": [[torch.ones(3, 2).t()]], "subclass": [[torch.nn.Parameter(torch.ones(3))]],
        "neg view": [[torch._neg_view(torch.ones(3))]], "zero tensor": [[torch._efficientzerotensor(3)]],
        "meta": [[torch.empty(3, device="meta")]], "numpy": [[np.ones(3)]], "not a list inside": [(good,)],
    }
    shrunk = torch.ones(16)
    view = shrunk[8:]
    shrunk.untyped_storage().resize_(16)
    cases["past its storage"] = [[view]]
    for name, arg in cases.items():
        assert _facts.row_table(arg) is None, name
    with pytest.raises(TypeError, match="list of lists"):
        _facts.row_table((([good],)))


def test_the_binding_checks_a_row_table_against_the_segments():
    from fastagg.backends import cpu

    rows = [[torch.ones(4), torch.ones(4)], [torch.ones(2), torch.ones(2)]]
    table = _facts.row_table(rows)
    with pytest.raises(ValueError, match="have 2 segments; expected 3"):
        _stats_call(table, None, [4, 2, 0], 2)
    with pytest.raises(ValueError, match=r"deltas\[0\] entry 1 has 2 elements; expected 3"):
        _stats_call(table, None, [4, 3], 2)
    base = _facts.row_table([[torch.ones(4)], [torch.ones(2)]])
    with pytest.raises(ValueError, match=r"params \(the base of models=\)\[1\] has 2 elements; expected 5"):
        _stats_call(_facts.row_table([[torch.ones(4)], [torch.ones(5)]]), base, [4, 5], 1)
    with pytest.raises(ValueError, match="must be one model"):
        _stats_call(table, table, [4, 2], 2)
    with pytest.raises(TypeError, match=r"params \(the base of models=\) must be float32, got float64"):
        _stats_call(table, _facts.row_table([[torch.ones(4).double()], [torch.ones(2).double()]]), [4, 2], 2)
    # a capsule of another name is not read as a table: a DLPack one is the [M, d] matrix form
    with pytest.raises(ValueError, match=r"must be 2-D \[M, d\]"):
        _stats_call(cpu._dl(torch.ones(6)), None, [4, 2], 2)


# ---- what a reviewer broke (each fails on the code before its fix) ------------------------------------------------

_WRAPPER = '''
import gc, sys, torch
from torch.utils._python_dispatch import TorchDispatchMode
from fastagg import _facts

class W(torch.Tensor):
    @staticmethod
    def __new__(cls, elem):
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, device=elem.device,
                                                   dispatch_sizes_strides_policy="strides", dispatch_layout=True)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return NotImplemented

def wrapper():
    w = W(torch.ones(3))
    w.__class__ = torch.Tensor  # exactly torch.Tensor now, with Python answering its layout and strides
    return w
'''


def _run(code: str, env: dict | None = None) -> subprocess.CompletedProcess:

    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                          env={**os.environ, "FASTAGG_TENSOR_FACTS": "1", **(env or {})})


def test_python_code_behind_a_tensor_cannot_free_the_list_being_read():
    """A tensor whose layout Python answers, read under a dispatch mode that empties the list being read: the
    facts came from borrowed items, freed under the loop (a segfault before). Now such a tensor is 'not known'
    before any call on it, and the items are held."""
    out = _run(_WRAPPER + '''
L = [wrapper()] + [torch.ones(4) for _ in range(2000)]
L2 = [[wrapper(), torch.ones(3)]]
class Clear(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if L:
            L.clear(); gc.collect(); junk = [bytearray(b"\\xff" * 64) for _ in range(20000)]
        return torch.strided
with Clear():
    f = _facts.facts(L)
    assert f[0, _facts.OK] == 0 and f[1:, _facts.OK].all(), f[:2]
    assert _facts.row_table(L2) is None
print("survived")
''')
    assert out.returncode == 0 and "survived" in out.stdout, (out.returncode, out.stderr[-2000:])


def test_no_python_error_is_left_set_by_a_tensor_torch_cannot_describe():
    """A wrapper tensor under a forwarding dispatch mode: torch's error inside the facts call left the Python error
    set, and the step raised SystemError; now the step raises what the Python checks raise."""
    out = _run(_WRAPPER + '''
import fastagg
class Forward(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))
seen = []
module = _facts._MODULE
for on in (True, False):
    _facts._MODULE = module if on else None
    clients = [{"a": torch.ones(4), "b": torch.ones(2)}, {"a": wrapper(), "b": torch.ones(2)}]
    with Forward():
        try:
            fastagg.fedavg_step(models=clients, params={"a": torch.zeros(4), "b": torch.zeros(2)})
            seen.append("ok")
        except BaseException as e:
            seen.append(type(e).__name__)
print(seen)
assert "SystemError" not in seen and seen[0] == seen[1], seen
''')
    assert out.returncode == 0, (out.stdout, out.stderr[-2000:])


_SHRINK = '''
import sys, numpy as np, torch, fastagg
n, m = 2_000_000, 3
clients = [{"a.weight": torch.full((n,), float(i))} for i in range(m)]
victim = clients[m - 1]["a.weight"]
class Weights:  # read by the step after the per-entry checks
    def __array__(self, dtype=None, copy=None):
        victim.untyped_storage().resize_(40_000)  # 10,000 floats left of 2,000,000
        return np.ones(m)
try:
    if sys.argv[1] == "server":
        fastagg.server.FedAvg({"a.weight": torch.zeros(n)}).step(clients, Weights(), base={"a.weight": torch.zeros(n)})
    else:
        fastagg.fedavg_step(models=clients, params={"a.weight": torch.zeros(n)}, weights=Weights())
    print("not refused")
except ValueError as e:
    print("refused:", e)
'''


@pytest.mark.parametrize("facts_on", ["1", "0"])
@pytest.mark.parametrize("api", ["functional", "server"])
def test_a_client_storage_shrunk_after_the_checks_is_not_read(api, facts_on):
    """User code run after the per-entry checks (a weights object's __array__) shrinks a client's storage: the
    kernel read past it (a segfault, both paths). The rows' memory is checked again just before the kernel."""
    out = subprocess.run([sys.executable, "-c", _SHRINK, api], capture_output=True, text=True, timeout=240,
                         env={**os.environ, "FASTAGG_TENSOR_FACTS": facts_on})
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert re.search(r"refused: client 2's entry 0 needs 8000000 bytes of storage but its storage holds 40000 .*"
                     r"changed after the round's checks", out.stdout), out.stdout


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("where", ["params", "client"])
def test_sparse_and_nested_entries_are_refused_by_name(mode, where):
    g = {"a": torch.ones(3, 3), "b": torch.ones(2)}
    odd = {"sparse_csr": torch.eye(3).to_sparse_csr(), "sparse_coo": torch.eye(3).to_sparse(),
           "nested": torch.nested.nested_tensor([torch.ones(3), torch.ones(3)])}
    for kind, t in odd.items():
        if where == "params" and kind == "nested":
            continue
        clients = [{"a": torch.eye(3) * (i + 1), "b": torch.ones(2)} for i in range(3)]
        params = {k: v.clone() for k, v in g.items()}
        if where == "params":
            params["a"] = t
            want = r"params\['a'\] is a " + ("torch." + kind if kind != "nested" else "nested")
        else:
            clients[2]["a"] = t
            want = r"models\[2\]\['a'\] is a " + ("torch." + kind if kind != "nested" else "nested")
        with pytest.raises(ValueError, match=want):
            fastagg.fedavg_step(models=clients, params=params)


def test_a_non_contiguous_entry_is_named_by_its_key(mode):
    g = {"a": torch.ones(3, 3), "b": torch.ones(2)}
    clients = [{"a": torch.eye(3), "b": torch.ones(2)} for _ in range(3)]
    clients[2]["a"] = torch.ones(3, 4)[:, :3]
    with pytest.raises(ValueError, match=r"models\[2\]\['a'\] is not contiguous"):
        fastagg.fedavg_step(models=clients, params={k: v.clone() for k, v in g.items()})


@pytest.mark.parametrize("value, used", [("off", False), ("False", False), ("no", False), ("0", False),
                                         ("1", True), ("yes", True), ("", True)])
def test_the_switch_reads_the_usual_spellings(value, used):
    out = _run("from fastagg import _facts; print(_facts.available(), _facts.WHY_NOT)",
               {"FASTAGG_TENSOR_FACTS": value})
    assert out.returncode == 0 and out.stdout.startswith(str(used)), (out.stdout, out.stderr[-500:])


def test_a_misspelt_switch_is_an_error_at_import():
    out = _run("import fastagg", {"FASTAGG_TENSOR_FACTS": "maybe"})
    assert out.returncode != 0 and "FASTAGG_TENSOR_FACTS must be 0 or 1" in out.stderr


_AFTER_CHECKS = {  # user code run after the round's checks changes a buffer the kernel then reads or writes
    "matrix rows": (
        "X = torch.ones(3, n)\nclass W:\n    def __array__(self, dtype=None, copy=None):\n"
        "        X.untyped_storage().resize_(4_000_000); return np.ones(3)\n"
        "fastagg.fedavg_step(X, weights=W(), params=torch.zeros(n))",
        r"argument 0 of the call needs 24000000 bytes of storage but its storage holds 4000000"),
    "mean_out": (
        "buf = torch.zeros(n)\nclass W:\n    def __array__(self, dtype=None, copy=None):\n"
        "        buf.untyped_storage().resize_(4_000_000); return np.ones(3)\n"
        "fastagg.fedavg_step([torch.ones(n)] * 3, mean_out=buf, weights=W())",
        r"argument 1 of the call needs 8000000 bytes of storage but its storage holds 4000000"),
    "the model's params": (
        "model = {'a': torch.zeros(n)}\nopt = fastagg.server.FedAvg(model)\nclass W:\n"
        "    def __array__(self, dtype=None, copy=None):\n"
        "        model['a'].untyped_storage().resize_(1000); return np.ones(3)\n"
        "opt.step([{'a': torch.ones(n)}] * 3, W(), base={'a': torch.zeros(n)})",
        r"needs 8000000 bytes of storage but its storage holds 1000"),
    "a hyperparameter's __float__": (
        "clients = [{'a': torch.full((n,), float(i))} for i in range(3)]\n"
        "opt = fastagg.server.FedExPM({'a': torch.zeros(n)}, eps=1e-3)\nopt.step(clients)\n"
        "class Coef:\n    def __float__(self):\n        clients[2]['a'].set_(torch.empty(0)); return -0.9\n"
        "class F(float):\n    def __rmul__(self, other):\n        return Coef()\n"
        "opt.param_groups[0]['beta'] = F(0.9)\nopt.step(clients)",
        r"deltas\[2\] entry 0 has 0 elements; expected 2000000"),
}


@pytest.mark.parametrize("facts_on", ["1", "0"])
@pytest.mark.parametrize("case", list(_AFTER_CHECKS))
def test_no_buffer_changed_after_the_checks_reaches_a_kernel(case, facts_on):
    """A reviewer's segfaults and heap corruption (both check paths): the [M, d] matrix, a mean_out, the model's
    params shrunk by a weights object's __array__ after the checks; a hyperparameter whose __float__ ran after the
    row table was built and freed a client's bytes. Now scalars are converted first, every buffer a binding gets
    is checked after its capsule is made, and the rows come last."""
    code, want = _AFTER_CHECKS[case]
    out = _run("import numpy as np, torch, fastagg\nn = 2_000_000\ntry:\n" +
               "".join(f"    {line}\n" for line in code.splitlines()) +
               "    print('not refused')\nexcept ValueError as e:\n    print('refused:', e)\n",
               {"FASTAGG_TENSOR_FACTS": facts_on})
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert out.stdout.startswith("refused:") and re.search(want, out.stdout), out.stdout


def test_segment_lengths_that_add_up_past_int64_are_refused():
    from fastagg.backends import cpu

    x, w = torch.empty(2, 0), torch.full((2,), 0.5, dtype=torch.float64)
    outs = [torch.zeros(0), torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.bool),
            torch.zeros((), dtype=torch.float64)]
    with pytest.raises(ValueError, match="lengths add up past int64"):
        cpu.compiled().round_stats(cpu._dl(x), None, [2**62] * 4, cpu._dl(w), None, None, 0.0,
                                   *map(cpu._dl, outs), 0.0, 0, 0)


def test_in_storage_says_true_only_for_plain_contiguous_tensors_inside_their_storage():
    zoo = _zoo()
    fine = {"float32", "row with offset", "0-d", "empty", "requires grad", "int64", "bool", "bfloat16", "float16",
            "float64", "8 dims", "inference", "lazy clone", "uint8", "conj view", "None"}
    for name, t in zoo.items():
        assert _facts.in_storage([t]) is (name in fine), name
        assert _facts.in_storage([None, t, None]) is (name in fine), name
    assert _facts.in_storage([]) is True and _facts.in_storage((None,)) is True
    with pytest.raises(TypeError, match="list or tuple"):
        _facts.in_storage(torch.ones(2))
