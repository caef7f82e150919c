// pybind11 bindings: every argument is a plain integer (an address or a count), so the module
// works on torch CPU tensors and numpy arrays alike and builds without torch. The GIL is released
// while a kernel runs.
#include <pybind11/pybind11.h>

#include "kernels.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace py = pybind11;
using fastagg::AdamArgs;
using fastagg::LocalArgs;
using fastagg::MomentumArgs;
using fastagg::StatsArgs;

template <typename T> static T ptr(uintptr_t address) { return reinterpret_cast<T>(address); }

#ifndef FASTAGG_MODULE
#define FASTAGG_MODULE _C
#endif

PYBIND11_MODULE(FASTAGG_MODULE, m) {
  m.doc() = "fastagg compiled CPU kernels (OpenMP). Use fastagg.ops, not this module.";

  m.def(
      "round_stats",
      [](int64_t num_clients, int64_t num_segments, int dtype, uintptr_t row_ptrs, uintptr_t base_ptrs,
         uintptr_t seg_len, uintptr_t seg_off, uintptr_t weights, uintptr_t mean_init, uintptr_t aux,
         double aux_coef, uintptr_t mean_out, uintptr_t sq_norms_out, uintptr_t nonfinite_out,
         uintptr_t mean_sq_out) {
        StatsArgs a{};
        a.num_clients = num_clients;
        a.num_segments = num_segments;
        a.dtype = dtype;
        a.row_ptrs = ptr<const uint64_t*>(row_ptrs);
        a.base_ptrs = ptr<const uint64_t*>(base_ptrs);
        a.seg_len = ptr<const int64_t*>(seg_len);
        a.seg_off = ptr<const int64_t*>(seg_off);
        a.weights = ptr<const double*>(weights);
        a.mean_init = ptr<const void*>(mean_init);
        a.aux = ptr<const void*>(aux);
        a.aux_coef = aux_coef;
        a.mean_out = ptr<void*>(mean_out);
        a.sq_norms_out = ptr<double*>(sq_norms_out);
        a.nonfinite_out = ptr<uint8_t*>(nonfinite_out);
        a.mean_sq_out = ptr<double*>(mean_sq_out);
        fastagg::round_stats(a);
      },
      py::call_guard<py::gil_scoped_release>());

  m.def(
      "momentum_apply",
      [](int64_t num_segments, int param_dtype, int compute_dtype, uintptr_t param_ptrs, uintptr_t extra_ptrs,
         uintptr_t seg_len, uintptr_t seg_off, uintptr_t mean, uintptr_t buf, uintptr_t lr, uintptr_t extra_coef,
         uintptr_t extra_coef_skip, uintptr_t finite, double momentum, bool nesterov) {
        MomentumArgs a{};
        a.num_segments = num_segments;
        a.param_dtype = param_dtype;
        a.compute_dtype = compute_dtype;
        a.param_ptrs = ptr<const uint64_t*>(param_ptrs);
        a.extra_ptrs = ptr<const uint64_t*>(extra_ptrs);
        a.seg_len = ptr<const int64_t*>(seg_len);
        a.seg_off = ptr<const int64_t*>(seg_off);
        a.mean = ptr<const void*>(mean);
        a.buf = ptr<void*>(buf);
        a.lr = ptr<const double*>(lr);
        a.extra_coef = ptr<const double*>(extra_coef);
        a.extra_coef_skip = ptr<const double*>(extra_coef_skip);
        a.finite = ptr<const uint8_t*>(finite);
        a.momentum = momentum;
        a.nesterov = nesterov;
        fastagg::momentum_apply(a);
      },
      py::call_guard<py::gil_scoped_release>());

  m.def(
      "adam_apply",
      [](int64_t num_segments, int param_dtype, int compute_dtype, uintptr_t param_ptrs, uintptr_t seg_len,
         uintptr_t seg_off, uintptr_t mean, uintptr_t m_buf, uintptr_t v_buf, uintptr_t vhat_buf, uintptr_t lr,
         uintptr_t finite, int rule, double beta1, double beta2, double tau, double ams_eps) {
        AdamArgs a{};
        a.num_segments = num_segments;
        a.param_dtype = param_dtype;
        a.compute_dtype = compute_dtype;
        a.param_ptrs = ptr<const uint64_t*>(param_ptrs);
        a.seg_len = ptr<const int64_t*>(seg_len);
        a.seg_off = ptr<const int64_t*>(seg_off);
        a.mean = ptr<const void*>(mean);
        a.m = ptr<void*>(m_buf);
        a.v = ptr<void*>(v_buf);
        a.vhat = ptr<void*>(vhat_buf);
        a.lr = ptr<const double*>(lr);
        a.finite = ptr<const uint8_t*>(finite);
        a.rule = rule;
        a.beta1 = beta1;
        a.beta2 = beta2;
        a.tau = tau;
        a.ams_eps = ams_eps;
        fastagg::adam_apply(a);
      },
      py::call_guard<py::gil_scoped_release>());

  m.def(
      "local_step",
      [](int64_t num_rows, int64_t numel, int dtype, uintptr_t x_ptrs, uintptr_t g_ptrs, uintptr_t anchor_ptrs,
         uintptr_t control, uintptr_t ci_ptrs, uintptr_t buf_ptrs, uintptr_t lr, uintptr_t loss, uintptr_t l_star,
         uintptr_t sps_c, uintptr_t cap, uintptr_t first, double prox, double clip_norm, double weight_decay, double momentum,
         double eta2, double tiny, int rule, int mode, uintptr_t step_out, uintptr_t sq_out) {
        LocalArgs a{};
        a.num_rows = num_rows;
        a.numel = numel;
        a.dtype = dtype;
        a.x_ptrs = ptr<const uint64_t*>(x_ptrs);
        a.g_ptrs = ptr<const uint64_t*>(g_ptrs);
        a.anchor_ptrs = ptr<const uint64_t*>(anchor_ptrs);
        a.control = ptr<const void*>(control);
        a.ci_ptrs = ptr<const uint64_t*>(ci_ptrs);
        a.buf_ptrs = ptr<const uint64_t*>(buf_ptrs);
        a.lr = ptr<const double*>(lr);
        a.loss = ptr<const double*>(loss);
        a.l_star = ptr<const double*>(l_star);
        a.sps_c = ptr<const double*>(sps_c);
        a.cap = ptr<const double*>(cap);
        a.first = ptr<const double*>(first);
        a.prox = prox;
        a.clip_norm = clip_norm;
        a.weight_decay = weight_decay;
        a.momentum = momentum;
        a.eta2 = eta2;
        a.tiny = tiny;
        a.rule = rule;
        a.mode = mode;
        a.step_out = ptr<double*>(step_out);
        a.sq_out = ptr<double*>(sq_out);
        fastagg::local_step(a);
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
