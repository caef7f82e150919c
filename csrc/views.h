// What the bindings know about a buffer, read from the buffer itself: every tensor arrives as a DLPack capsule
// (tensor.__dlpack__()), whose DLTensor carries the data address, dtype, shape and strides that the tensor's own
// library filled in. The bindings check every buffer against what the kernel will do with it -- dtype, shape,
// element count, strides, index ranges, overlaps between written and read memory -- and throw (ValueError /
// TypeError in Python) before any kernel touches memory. Nothing here trusts an address or a size the Python
// caller computed.
#pragma once
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "convert.h"

namespace fastagg {
namespace py = pybind11;

// The DLPack ABI (dlpack.h, v0.8; only what is read here).
struct DLDevice { int32_t device_type; int32_t device_id; };
struct DLDataType { uint8_t code; uint8_t bits; uint16_t lanes; };
struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;  // in elements; nullptr: compact row-major
  uint64_t byte_offset;
};
struct DLManagedTensor { DLTensor dl_tensor; void* manager_ctx; void (*deleter)(DLManagedTensor*); };

enum DLCode : uint8_t { kDLInt = 0, kDLUInt = 1, kDLFloat = 2, kDLBfloat = 4, kDLBool = 6 };
constexpr int32_t kDLCPU = 1;

// Element kinds a binding may ask for (the float ones are DType codes).
enum Kind : int { kAnyIndex = -2, kAnyFloat = -1, kF16 = kFloat16, kBF16 = kBFloat16, kF32 = kFloat32, kF64 = kFloat64,
                  kI64 = 10, kI32 = 11, kBool = 12, kI8 = 13 };

[[noreturn]] inline void value_error(const std::string& m) { throw py::value_error("fastagg._C: " + m); }
[[noreturn]] inline void type_error(const std::string& m) { throw py::type_error("fastagg._C: " + m); }

inline const char* kind_name(int k) {
  switch (k) {
    case kF16: return "float16";
    case kBF16: return "bfloat16";
    case kF32: return "float32";
    case kF64: return "float64";
    case kI64: return "int64";
    case kI32: return "int32";
    case kBool: return "uint8 (or bool)";  // one kind for both 8-bit unsigned codes: a uint8 named as bool misled
    case kI8: return "int8";
    case kAnyIndex: return "int64 or int32";
    default: return "a floating dtype";
  }
}

struct View {
  std::string name;
  char* data = nullptr;
  int kind = 0;
  int64_t itemsize = 0;
  std::vector<int64_t> shape, strides;  // strides in elements
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    return n;
  }
  // [lo, hi) bytes spanned by the elements (empty when numel is 0)
  std::pair<uintptr_t, uintptr_t> span() const {
    if (numel() == 0) return {0, 0};
    int64_t lo = 0, hi = 0;
    for (size_t k = 0; k < shape.size(); ++k) {
      const int64_t ext = (shape[k] - 1) * strides[k];
      if (ext > 0) hi += ext; else lo += ext;
    }
    const auto base = reinterpret_cast<uintptr_t>(data);
    return {base + lo * itemsize, base + (hi + 1) * itemsize};
  }
  bool contiguous() const {
    int64_t expect = 1;
    for (int64_t k = static_cast<int64_t>(shape.size()) - 1; k >= 0; --k) {
      if (shape[k] != 1 && strides[k] != expect) return false;
      expect *= shape[k];
    }
    return true;
  }
};

constexpr int kNoKind = -100;

// The Kind of a DLPack dtype, or kNoKind (vector dtypes, unsupported codes): kind_of without the error.
inline int quick_kind(const DLDataType& t) {
  if (t.lanes != 1) return kNoKind;
  if (t.code == kDLFloat && t.bits == 16) return kF16;
  if (t.code == kDLBfloat && t.bits == 16) return kBF16;
  if (t.code == kDLFloat && t.bits == 32) return kF32;
  if (t.code == kDLFloat && t.bits == 64) return kF64;
  if (t.code == kDLInt && t.bits == 64) return kI64;
  if (t.code == kDLInt && t.bits == 32) return kI32;
  if (t.code == kDLInt && t.bits == 8) return kI8;
  if ((t.code == kDLBool || t.code == kDLUInt) && t.bits == 8) return kBool;
  return kNoKind;
}

inline int kind_of(const DLDataType& t, const std::string& name) {
  const int k = quick_kind(t);
  if (k != kNoKind) return k;
  if (t.lanes != 1) type_error(name + " has a vector dtype");
  type_error(name + " has an unsupported dtype (DLPack code " + std::to_string(t.code) + ", " +
             std::to_string(t.bits) + " bits)");
}

// A capsule from tensor.__dlpack__(), read without consuming it (its owner frees it). `want` is a Kind.
inline View view_of(py::handle capsule, const std::string& name, int want) {
  if (!PyCapsule_IsValid(capsule.ptr(), "dltensor"))
    type_error(name + " must be passed as tensor.__dlpack__() (an unused DLPack capsule)");
  auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule.ptr(), "dltensor"));
  const DLTensor& t = m->dl_tensor;
  if (t.device.device_type != kDLCPU) value_error(name + " is not in CPU memory");
  if (t.ndim < 0 || t.ndim > 8) value_error(name + " has an unsupported number of dimensions");
  View v;
  v.name = name;
  v.kind = kind_of(t.dtype, name);
  v.itemsize = t.dtype.bits / 8;
  v.data = static_cast<char*>(t.data) + t.byte_offset;
  v.shape.assign(t.shape, t.shape + t.ndim);
  if (t.strides) {
    v.strides.assign(t.strides, t.strides + t.ndim);
  } else {
    v.strides.resize(t.ndim);
    int64_t s = 1;
    for (int k = t.ndim - 1; k >= 0; --k) { v.strides[k] = s; s *= v.shape[k]; }
  }
  for (int64_t s : v.shape)
    if (s < 0) value_error(name + " has a negative dimension");
  if (want == kAnyFloat) {
    if (v.kind > kF64) type_error(name + " must have a floating dtype, got " + kind_name(v.kind));
  } else if (want == kAnyIndex) {
    if (v.kind != kI64 && v.kind != kI32) type_error(name + " must be int64 or int32, got " + kind_name(v.kind));
  } else if (v.kind != want) {
    type_error(name + " must be " + kind_name(want) + ", got " + kind_name(v.kind));
  }
  if (v.numel() > 0 && v.data == nullptr) value_error(name + " has no data");
  return v;
}

inline View optional_view(py::handle obj, const std::string& name, int want) {
  return obj.is_none() ? View{} : view_of(obj, name, want);
}

// A contiguous buffer of exactly `numel` elements of kind `want`.
inline View flat_view(py::handle capsule, const std::string& name, int want, int64_t numel) {
  View v = view_of(capsule, name, want);
  if (v.numel() != numel)
    value_error(name + " has " + std::to_string(v.numel()) + " elements; expected " + std::to_string(numel));
  if (!v.contiguous()) value_error(name + " must be contiguous");
  return v;
}

// [lo, hi) bytes; empty when lo == hi.
using Span = std::pair<uintptr_t, uintptr_t>;

// A contiguous row read straight from its capsule, without a View: no name, no shape / stride vectors, nothing
// allocated. quick_row accepts a capsule only when view_of(capsule, name, want) would accept it and the caller's
// checks would pass too: element count `numel` (< 0: any), contiguous, and 1-D when `one_d`. Anything else returns
// false, and the caller then runs the named checks (view_of and its own), which raise the message they always
// raised; so the fast path only skips work, never a check. `want` is a float Kind or kAnyFloat.
struct QuickRow {
  char* data;
  int kind;
  int64_t numel, itemsize;
  Span span() const {
    if (numel == 0) return {0, 0};
    const auto base = reinterpret_cast<uintptr_t>(data);
    return {base, base + numel * itemsize};  // View::span() of a contiguous view: (numel - 1 + 1) items
  }
};

inline bool quick_row(PyObject* capsule, int want, int64_t numel, bool one_d, QuickRow& out) {
  if (!PyCapsule_IsValid(capsule, "dltensor")) return false;
  const DLTensor& t = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"))->dl_tensor;
  if (t.device.device_type != kDLCPU || t.ndim < 0 || t.ndim > 8 || (one_d && t.ndim != 1)) return false;
  const int kind = quick_kind(t.dtype);
  if (kind == kNoKind || (want == kAnyFloat ? kind > kF64 : kind != want)) return false;
  int64_t n = 1;
  for (int k = 0; k < t.ndim; ++k) {
    if (t.shape[k] < 0) return false;
    n *= t.shape[k];
  }
  if (numel >= 0 && n != numel) return false;
  if (t.strides) {  // View::contiguous() on the capsule's strides
    int64_t expect = 1;
    for (int k = t.ndim - 1; k >= 0; --k) {
      if (t.shape[k] != 1 && t.strides[k] != expect) return false;
      expect *= t.shape[k];
    }
  }
  char* data = static_cast<char*>(t.data) + t.byte_offset;
  if (n > 0 && data == nullptr) return false;
  out = {data, kind, n, t.dtype.bits / 8};
  return true;
}

// Raises when a written span overlaps any other span (written or read); empty spans are ignored. The writes are
// Views; the reads are spans whose names are made only for the error message (read_name(j)). Pairs are tried in
// the order check_overlaps always tried them: each write against the later writes, then against every read in
// order, so the first overlap found (the one the message names) is the same.
template <typename ReadName>
void check_overlaps_spans(const std::vector<const View*>& writes, const std::vector<Span>& reads, ReadName read_name) {
  std::vector<Span> ws(writes.size());
  for (size_t i = 0; i < writes.size(); ++i) ws[i] = writes[i]->span();
  auto meet = [](const Span& a, const Span& b) {
    return b.first != b.second && std::max(a.first, b.first) < std::min(a.second, b.second);
  };
  for (size_t i = 0; i < ws.size(); ++i) {
    const Span a = ws[i];
    if (a.first == a.second) continue;
    for (size_t j = i + 1; j < ws.size(); ++j)
      if (meet(a, ws[j])) value_error(writes[i]->name + " overlaps " + writes[j]->name + ", also written in the same call");
    for (size_t j = 0; j < reads.size(); ++j)
      if (meet(a, reads[j])) value_error(writes[i]->name + " overlaps " + read_name(j) + " in the same call");
  }
}

// Raises when a written span overlaps any other span (written or read). Empty views are ignored.
inline void check_overlaps(const std::vector<const View*>& writes, const std::vector<const View*>& reads) {
  std::vector<Span> rs(reads.size());
  for (size_t j = 0; j < reads.size(); ++j) rs[j] = reads[j]->span();
  check_overlaps_spans(writes, rs, [&](size_t j) { return reads[j]->name; });
}

}  // namespace fastagg
