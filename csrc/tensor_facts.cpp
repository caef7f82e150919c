// fastagg._tensor_facts: what the per-entry checks of a round need to know about many tensors, read from their
// TensorImpls in one C call (~2 ns a tensor) instead of ~10 Python attribute calls (~2 us a tensor; a ResNet-18
// round of 16 clients hands over ~2,000 tensors).
//
// This is the one module built against torch's headers (fastagg._C / _C_avx2 read DLPack capsules and need none),
// so it is tied to the torch it was built with: setup.py stamps torch.__version__ and torch.version.git_version into
// it, and fastagg/tensor_facts.py uses it only when they match the torch that is running (otherwise, and when it
// was not built at all -- a wheel built in an isolated environment without torch -- the checks run in Python,
// slower, the same). It never changes a tensor or keeps a reference, and reads nothing but TensorImpl / StorageImpl
// metadata; anything it is not sure about (not exactly torch.Tensor, not strided, symbolic sizes, no storage, more
// than 8 dimensions, an error) is reported as "not known" (column OK = 0) for Python to look at.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <vector>

#include "row_table.h"

#ifndef FASTAGG_TORCH_VERSION
#error "FASTAGG_TORCH_VERSION (torch.__version__ at build time) must be defined by setup.py"
#endif
#ifndef FASTAGG_TORCH_GIT_VERSION
#error "FASTAGG_TORCH_GIT_VERSION (torch.version.git_version at build time) must be defined by setup.py"
#endif

namespace {

// One row of int64 a tensor; the column order is the module's COLUMNS tuple (fastagg/tensor_facts.py names them).
enum Column : int {
  OK = 0,         // 1: a plain strided tensor with storage whose facts below are filled in; 0: look at it in Python
  DTYPE,          // c10::ScalarType
  DEVICE,         // DeviceType << 16 | (index & 0xffff)
  FLAGS,          // the bits below
  NDIM,           // 0..8
  SIZE0,          // sizes, 0 past NDIM
  NUMEL = SIZE0 + 8,
  DATA,           // data_ptr(): the first element's address (as Python's Tensor.data_ptr(), which it equals)
  NBYTES,         // numel * element size
  STORAGE_DATA,   // the storage's first byte
  STORAGE_NBYTES, // the storage's size in bytes
  NCOLUMNS
};

enum Flag : int64_t {
  CONTIGUOUS = 1,
  REQUIRES_GRAD = 2,
  NEG = 4,          // a lazily negated view (is_neg)
  CONJ = 8,         // a lazily conjugated view (is_conj)
  ZERO_TENSOR = 16, // an efficient zero tensor (no memory)
  FLOATING = 32,
  COMPLEX = 64,
  MEMORY_OK = 128,  // no elements, or a nonzero address with [data, data + nbytes) inside the storage's bytes
};

constexpr int kMaxDims = 8;

// A TensorImpl none of whose metadata is answered by Python: no Python dispatch key (a wrapper subclass whose
// layout, sizes or strides come from Python code, which could run anything -- even free the list being read) and
// no symbolic sizes. Checked before any other call on it; anything else is "not known". (C++ policies -- nested,
// mkldnn -- run no Python; what they refuse throws, which reads as "not known" too.)
bool plain_impl(const c10::TensorImpl* impl) {
  const c10::DispatchKeySet keys = impl->key_set();
  return !keys.has(c10::DispatchKey::Python) && !keys.has(c10::DispatchKey::PythonTLSSnapshot) &&
         !impl->has_symbolic_sizes_strides();
}

void fill(PyObject* obj, int64_t* row) {
  std::memset(row, 0, sizeof(int64_t) * NCOLUMNS);
  if (Py_TYPE(obj) != reinterpret_cast<PyTypeObject*>(THPVariableClass)) return;  // subclasses, numpy, None...
  try {
    const at::Tensor& t = THPVariable_Unpack(obj);
    if (!t.defined() || !plain_impl(t.unsafeGetTensorImpl())) return;
    c10::TensorImpl* impl = t.unsafeGetTensorImpl();
    if (t.layout() != c10::kStrided || !impl->has_storage()) return;
    const int64_t ndim = t.dim();
    if (ndim > kMaxDims) return;
    const auto st = t.scalar_type();
    int64_t flags = 0;
    if (t.is_contiguous()) flags |= CONTIGUOUS;
    if (t.requires_grad()) flags |= REQUIRES_GRAD;
    if (t.is_neg()) flags |= NEG;
    if (t.is_conj()) flags |= CONJ;
    if (t._is_zerotensor()) flags |= ZERO_TENSOR;
    if (c10::isFloatingType(st)) flags |= FLOATING;
    if (c10::isComplexType(st)) flags |= COMPLEX;
    int64_t vals[NCOLUMNS] = {0};
    vals[DTYPE] = static_cast<int64_t>(st);
    const c10::Device dev = t.device();
    vals[DEVICE] = (static_cast<int64_t>(dev.type()) << 16) | (static_cast<int64_t>(dev.index()) & 0xffff);
    vals[FLAGS] = flags;
    vals[NDIM] = ndim;
    const auto sizes = t.sizes();
    for (int64_t d = 0; d < ndim; ++d) vals[SIZE0 + d] = sizes[d];
    vals[NUMEL] = t.numel();
    vals[NBYTES] = static_cast<int64_t>(t.nbytes());
    // data_ptr() before the storage's address: like Python's Tensor.data_ptr() it materializes a copy-on-write
    // storage in place, and the storage's address read after it is the one the tensor then points into
    vals[DATA] = static_cast<int64_t>(reinterpret_cast<uintptr_t>(t.data_ptr()));
    const c10::Storage& storage = t.storage();
    vals[STORAGE_DATA] = static_cast<int64_t>(reinterpret_cast<uintptr_t>(storage.data()));
    vals[STORAGE_NBYTES] = static_cast<int64_t>(storage.nbytes());
    // the span check in unsigned arithmetic that cannot wrap: data >= start, then nbytes <= size - (data - start)
    const uint64_t data = static_cast<uint64_t>(vals[DATA]), start = static_cast<uint64_t>(vals[STORAGE_DATA]);
    const uint64_t size = static_cast<uint64_t>(vals[STORAGE_NBYTES]), nbytes = static_cast<uint64_t>(vals[NBYTES]);
    if (vals[NUMEL] == 0 || (data != 0 && data >= start && data - start <= size && nbytes <= size - (data - start)))
      vals[FLAGS] |= MEMORY_OK;
    vals[OK] = 1;
    std::memcpy(row, vals, sizeof(vals));
  } catch (const std::exception&) {  // c10::Error and the like: "not known", the Python checks say what is wrong
    PyErr_Clear();  // (a torch error raised from Python code leaves the Python error set too)
    std::memset(row, 0, sizeof(int64_t) * NCOLUMNS);
  }
}

// facts(tensors: list | tuple) -> bytes: len(tensors) rows of NCOLUMNS native int64s.
PyObject* facts(PyObject*, PyObject* arg) {
  if (!PyList_Check(arg) && !PyTuple_Check(arg)) {
    PyErr_Format(PyExc_TypeError, "facts() takes a list or tuple of tensors, got %s", Py_TYPE(arg)->tp_name);
    return nullptr;
  }
  // a tuple of new references to the items: nothing that happens to the caller's list can free one under us
  PyObject* seq = PySequence_Tuple(arg);
  if (seq == nullptr) return nullptr;
  const Py_ssize_t n = PyTuple_GET_SIZE(seq);
  PyObject* out = PyBytes_FromStringAndSize(nullptr, n * static_cast<Py_ssize_t>(NCOLUMNS * sizeof(int64_t)));
  if (out == nullptr) {
    Py_DECREF(seq);
    return nullptr;
  }
  auto* rows = reinterpret_cast<int64_t*>(PyBytes_AS_STRING(out));
  for (Py_ssize_t i = 0; i < n; ++i) fill(PyTuple_GET_ITEM(seq, i), rows + i * NCOLUMNS);
  Py_DECREF(seq);
  return out;
}

// in_storage(tensors: list | tuple) -> bool: every item is None or a plain contiguous tensor (facts known) with
// memory, all of whose bytes lie inside its storage (MEMORY_OK, no efficient zero tensor). False: look closer in
// Python (fastagg/backends/cpu.py names the one at fault). The last check before a binding call, in one C call.
PyObject* in_storage(PyObject*, PyObject* arg) {
  if (!PyList_Check(arg) && !PyTuple_Check(arg)) {
    PyErr_Format(PyExc_TypeError, "in_storage() takes a list or tuple of tensors, got %s", Py_TYPE(arg)->tp_name);
    return nullptr;
  }
  PyObject* seq = PySequence_Tuple(arg);  // new references: see facts()
  if (seq == nullptr) return nullptr;
  bool ok = true;
  int64_t row[NCOLUMNS];
  const int64_t need = CONTIGUOUS | MEMORY_OK;
  for (Py_ssize_t i = 0; ok && i < PyTuple_GET_SIZE(seq); ++i) {
    PyObject* item = PyTuple_GET_ITEM(seq, i);
    if (item == Py_None) continue;
    fill(item, row);
    ok = row[OK] == 1 && (row[FLAGS] & need) == need && !(row[FLAGS] & ZERO_TENSOR);
  }
  Py_DECREF(seq);
  return PyBool_FromLong(ok);
}

// ---- row_table: a round's rows as one table for the kernels' bindings (csrc/row_table.h) -----------------------

struct OwnedTable {
  fastagg::RowTableC c{};
  std::vector<char*> data;
  std::vector<int64_t> numel;
  std::vector<at::Tensor> keep;  // a reference to every row's tensor: its storage lives as long as the table
};

void free_table(PyObject* capsule) { delete static_cast<OwnedTable*>(PyCapsule_GetContext(capsule)); }

// (DLPack code, bits) of a dtype a table may hold, or {0, 0}
std::pair<uint8_t, uint8_t> dl_float(c10::ScalarType st) {
  switch (st) {
    case c10::ScalarType::Half: return {2, 16};
    case c10::ScalarType::BFloat16: return {4, 16};
    case c10::ScalarType::Float: return {2, 32};
    case c10::ScalarType::Double: return {2, 64};
    default: return {0, 0};
  }
}

// A row the table may hold: a plain contiguous CPU tensor of a floating dtype, with memory (no efficient zero
// tensor, no lazy negation), its bytes inside its storage. Anything else: the caller returns None and Python hands
// the binding DLPack capsules, checked there one by one as before.
bool table_row(PyObject* obj, OwnedTable& t, c10::ScalarType& st) {
  if (Py_TYPE(obj) != reinterpret_cast<PyTypeObject*>(THPVariableClass)) return false;
  try {
    const at::Tensor& x = THPVariable_Unpack(obj);
    if (!x.defined() || !plain_impl(x.unsafeGetTensorImpl())) return false;
    c10::TensorImpl* impl = x.unsafeGetTensorImpl();
    if (x.layout() != c10::kStrided || !x.device().is_cpu() || !impl->has_storage()) return false;
    if (st == c10::ScalarType::Undefined) {
      st = x.scalar_type();
      if (dl_float(st).first == 0) return false;
    } else if (x.scalar_type() != st) {
      return false;
    }
    if (!x.is_contiguous() || x.is_neg() || x.is_conj() || x._is_zerotensor()) return false;
    const int64_t n = x.numel();
    char* data = static_cast<char*>(x.data_ptr());
    const c10::Storage& storage = x.storage();
    const uint64_t d = reinterpret_cast<uintptr_t>(data), start = reinterpret_cast<uintptr_t>(storage.data());
    const uint64_t size = storage.nbytes(), nbytes = x.nbytes();
    if (n != 0 && !(d != 0 && d >= start && d - start <= size && nbytes <= size - (d - start))) return false;
    t.data.push_back(data);
    t.numel.push_back(n);
    t.keep.push_back(x);
    return true;
  } catch (const std::exception&) {
    PyErr_Clear();
    return false;
  }
}

// row_table(rows: list of L lists of M tensors) -> a capsule (FASTAGG_ROW_TABLE_CAPSULE), or None where a row is not
// one a table may hold or the lists are ragged / empty.
PyObject* row_table(PyObject*, PyObject* arg) {
  if (!PyList_Check(arg)) {
    PyErr_Format(PyExc_TypeError, "row_table() takes a list of lists of tensors, got %s", Py_TYPE(arg)->tp_name);
    return nullptr;
  }
  // copies holding new references (the outer list, then each segment's): nothing that happens to the caller's
  // lists can free an item under us (no Python runs here, but the copies do not rely on that)
  PyObject* outer = PySequence_Tuple(arg);
  if (outer == nullptr) return nullptr;
  const Py_ssize_t L = PyTuple_GET_SIZE(outer);
  auto t = std::make_unique<OwnedTable>();
  c10::ScalarType st = c10::ScalarType::Undefined;
  Py_ssize_t M = -1;
  bool ok = L > 0;
  for (Py_ssize_t s = 0; ok && s < L; ++s) {
    PyObject* item = PyTuple_GET_ITEM(outer, s);
    PyObject* seg = PyList_Check(item) ? PySequence_Tuple(item) : nullptr;
    if (seg == nullptr) {
      ok = false;
      break;
    }
    if (M < 0) {
      M = PyTuple_GET_SIZE(seg);
      t->data.reserve(L * M);
      t->numel.reserve(L * M);
      t->keep.reserve(L * M);
    }
    ok = M > 0 && PyTuple_GET_SIZE(seg) == M;
    for (Py_ssize_t i = 0; ok && i < M; ++i) ok = table_row(PyTuple_GET_ITEM(seg, i), *t, st);
    Py_DECREF(seg);
  }
  Py_DECREF(outer);
  if (PyErr_Occurred()) return nullptr;  // (a failed copy: out of memory)
  if (!ok) Py_RETURN_NONE;
  const auto dl = dl_float(st);
  t->c = {fastagg::kRowTableMagic, static_cast<int64_t>(L), static_cast<int64_t>(M), dl.first, dl.second,
          t->data.data(), t->numel.data()};
  PyObject* capsule = PyCapsule_New(&t->c, FASTAGG_ROW_TABLE_CAPSULE, free_table);
  if (capsule == nullptr) return nullptr;
  if (PyCapsule_SetContext(capsule, t.get()) != 0) {  // (the destructor then deletes nothing; t frees itself)
    Py_DECREF(capsule);
    return nullptr;
  }
  t.release();  // owned by the capsule now
  return capsule;
}

PyMethodDef methods[] = {
    {"in_storage", in_storage, METH_O,
     "in_storage(tensors) -> bool: every one (None skipped) plain, contiguous, with its bytes inside its storage."},
    {"row_table", row_table, METH_O,
     "row_table(rows) -> a row table capsule for the kernels' bindings (csrc/row_table.h), or None."},
    {"facts", facts, METH_O,
     "facts(tensors) -> bytes: one row of native int64s a tensor, the columns named by COLUMNS."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_tensor_facts", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__tensor_facts() {
  static_assert(NCOLUMNS == 18, "keep COLUMNS below in step with the Column enum");
  PyObject* m = PyModule_Create(&module);
  if (m == nullptr) return nullptr;
  PyObject* columns = Py_BuildValue("(ssssssssssssssssss)", "ok", "dtype", "device", "flags", "ndim", "size0",
                                    "size1", "size2", "size3", "size4", "size5", "size6", "size7", "numel", "data",
                                    "nbytes", "storage_data", "storage_nbytes");
  PyObject* flags = Py_BuildValue("{sLsLsLsLsLsLsLsL}", "contiguous", (long long)CONTIGUOUS, "requires_grad",
                                  (long long)REQUIRES_GRAD, "neg", (long long)NEG, "conj", (long long)CONJ,
                                  "zero_tensor", (long long)ZERO_TENSOR, "floating", (long long)FLOATING, "complex",
                                  (long long)COMPLEX, "memory_ok", (long long)MEMORY_OK);
  // PyModule_AddObjectRef never steals: ours are released on every path
  const bool failed = columns == nullptr || flags == nullptr || PyModule_AddObjectRef(m, "COLUMNS", columns) < 0 ||
                      PyModule_AddObjectRef(m, "FLAGS", flags) < 0 ||
                      PyModule_AddIntConstant(m, "MAX_DIMS", kMaxDims) < 0 ||
                      PyModule_AddIntConstant(m, "META", static_cast<long>(c10::DeviceType::Meta)) < 0 ||
                      PyModule_AddStringConstant(m, "TORCH_VERSION", FASTAGG_TORCH_VERSION) < 0 ||
                      PyModule_AddStringConstant(m, "TORCH_GIT_VERSION", FASTAGG_TORCH_GIT_VERSION) < 0;
  Py_XDECREF(columns);
  Py_XDECREF(flags);
  if (failed) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
