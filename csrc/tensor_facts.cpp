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

void fill(PyObject* obj, int64_t* row) {
  std::memset(row, 0, sizeof(int64_t) * NCOLUMNS);
  if (Py_TYPE(obj) != reinterpret_cast<PyTypeObject*>(THPVariableClass)) return;  // subclasses, numpy, None...
  try {
    const at::Tensor& t = THPVariable_Unpack(obj);
    if (!t.defined() || t.layout() != c10::kStrided) return;
    c10::TensorImpl* impl = t.unsafeGetTensorImpl();
    if (impl->has_symbolic_sizes_strides() || !impl->has_storage()) return;
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
    std::memset(row, 0, sizeof(int64_t) * NCOLUMNS);
  }
}

// facts(tensors: list | tuple) -> bytes: len(tensors) rows of NCOLUMNS native int64s.
PyObject* facts(PyObject*, PyObject* arg) {
  if (!PyList_Check(arg) && !PyTuple_Check(arg)) {
    PyErr_Format(PyExc_TypeError, "facts() takes a list or tuple of tensors, got %s", Py_TYPE(arg)->tp_name);
    return nullptr;
  }
  PyObject* seq = PySequence_Fast(arg, "facts() takes a list or tuple");  // a new reference to the same object
  if (seq == nullptr) return nullptr;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  PyObject* out = PyBytes_FromStringAndSize(nullptr, n * static_cast<Py_ssize_t>(NCOLUMNS * sizeof(int64_t)));
  if (out == nullptr) {
    Py_DECREF(seq);
    return nullptr;
  }
  auto* rows = reinterpret_cast<int64_t*>(PyBytes_AS_STRING(out));
  PyObject** items = PySequence_Fast_ITEMS(seq);  // the sequence cannot change under us: nothing here runs Python
  for (Py_ssize_t i = 0; i < n; ++i) fill(items[i], rows + i * NCOLUMNS);
  Py_DECREF(seq);
  return out;
}

PyMethodDef methods[] = {
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
