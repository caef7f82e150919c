// pybind11 bindings: every argument is a plain integer (an address or a count), so the module
// works on torch CPU tensors and numpy arrays alike and builds without torch. The GIL is released
// while a kernel runs.
#include <pybind11/pybind11.h>

#include "kernels.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace py = pybind11;
using fastagg::ApplyArgs;
using fastagg::StatsArgs;

template <typename T> static T ptr(uintptr_t address) { return reinterpret_cast<T>(address); }

PYBIND11_MODULE(_C, m) {
  m.doc() = "fastagg compiled CPU kernels (OpenMP). Use fastagg.ops, not this module.";

  m.def(
      "round_stats",
      [](int64_t num_clients, int64_t num_segments, int dtype, uintptr_t row_ptrs, uintptr_t base_ptrs,
         uintptr_t seg_len, uintptr_t seg_off, uintptr_t weights, uintptr_t mean_init, uintptr_t mean_out, uintptr_t sq_norms_out,
         uintptr_t nonfinite_out, uintptr_t mean_sq_out) {
        StatsArgs a{num_clients,
                    num_segments,
                    dtype,
                    ptr<const uint64_t*>(row_ptrs),
                    ptr<const uint64_t*>(base_ptrs),
                    ptr<const int64_t*>(seg_len),
                    ptr<const int64_t*>(seg_off),
                    ptr<const double*>(weights),
                    ptr<const void*>(mean_init),
                    ptr<void*>(mean_out),
                    ptr<double*>(sq_norms_out),
                    ptr<uint8_t*>(nonfinite_out),
                    ptr<double*>(mean_sq_out)};
        fastagg::round_stats(a);
      },
      py::call_guard<py::gil_scoped_release>());

  m.def(
      "apply_update",
      [](int64_t num_segments, int param_dtype, int mean_dtype, uintptr_t param_ptrs, uintptr_t eval_ptrs,
         uintptr_t seg_len, uintptr_t seg_off, uintptr_t mean, uintptr_t eta, uintptr_t finite, double eval_scale) {
        ApplyArgs a{num_segments,
                    param_dtype,
                    mean_dtype,
                    ptr<const uint64_t*>(param_ptrs),
                    ptr<const uint64_t*>(eval_ptrs),
                    ptr<const int64_t*>(seg_len),
                    ptr<const int64_t*>(seg_off),
                    ptr<const void*>(mean),
                    ptr<const double*>(eta),
                    ptr<const uint8_t*>(finite),
                    eval_scale};
        fastagg::apply_update(a);
      },
      py::call_guard<py::gil_scoped_release>());

  m.def("num_threads", []() {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
  });
  m.attr("openmp") =
#ifdef _OPENMP
      true;
#else
      false;
#endif
}
