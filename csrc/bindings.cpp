// pybind11 bindings: every argument is a plain integer (an address or a count), so the module
// works on torch CPU tensors and numpy arrays alike and builds without torch. The GIL is released
// while a kernel runs.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <vector>

#include "kernels.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace py = pybind11;
using fastagg::AdamArgs;
using fastagg::LocalArgs;
using fastagg::MomentumArgs;
using fastagg::PerRow;
using fastagg::StatsArgs;

template <typename T> static T ptr(uintptr_t address) { return reinterpret_cast<T>(address); }

// Addresses of num_rows rows: base + stride * (index ? index[r] : r); empty when base is 0 (no such table).
static std::vector<uint64_t> row_addresses(int64_t num_rows, uintptr_t base, int64_t stride, uintptr_t index) {
  std::vector<uint64_t> out;
  if (!base) return out;
  out.resize(num_rows);
  const int64_t* idx = ptr<const int64_t*>(index);
  for (int64_t r = 0; r < num_rows; ++r) out[r] = base + static_cast<uint64_t>(stride * (idx ? idx[r] : r));
  return out;
}

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

  // Row tables arrive as (address, row stride in bytes, address of an int64 index or 0): row i is at
  // address + stride * (index ? index[i] : i). Per-row scalars as (address of float64 [M] or 0, value).
  m.def(
      "local_step",
      [](int64_t num_rows, int64_t numel, int dtype, uintptr_t x, int64_t x_stride, uintptr_t x_index, uintptr_t g,
         int64_t g_stride, uintptr_t g_index, uintptr_t anchor, int64_t anchor_stride, uintptr_t anchor_index,
         uintptr_t control, uintptr_t ci, int64_t ci_stride, uintptr_t ci_index, uintptr_t buf, int64_t buf_stride,
         uintptr_t buf_index, uintptr_t lr, double lr_value, uintptr_t loss, double loss_value, uintptr_t l_star,
         double l_star_value, uintptr_t sps_c, double sps_c_value, uintptr_t cap, double cap_value, uintptr_t first,
         double prox, double clip_norm, double weight_decay, double momentum, double eta2, double tiny, int rule,
         int mode, uintptr_t step_out) {
        const auto xs = row_addresses(num_rows, x, x_stride, x_index);
        const auto gs = row_addresses(num_rows, g, g_stride, g_index);
        const auto as = row_addresses(num_rows, anchor, anchor_stride, anchor_index);
        const auto cis = row_addresses(num_rows, ci, ci_stride, ci_index);
        const auto bs = row_addresses(num_rows, buf, buf_stride, buf_index);
        LocalArgs a{};
        a.num_rows = num_rows;
        a.numel = numel;
        a.dtype = dtype;
        a.x_ptrs = xs.data();
        a.g_ptrs = gs.data();
        a.anchor_ptrs = anchor ? as.data() : nullptr;
        a.control = ptr<const void*>(control);
        a.ci_ptrs = ci ? cis.data() : nullptr;
        a.buf_ptrs = buf ? bs.data() : nullptr;
        a.lr = PerRow{ptr<const double*>(lr), lr_value};
        a.loss = PerRow{ptr<const double*>(loss), loss_value};
        a.l_star = PerRow{ptr<const double*>(l_star), l_star_value};
        a.sps_c = PerRow{ptr<const double*>(sps_c), sps_c_value};
        a.cap = PerRow{ptr<const double*>(cap), cap_value};
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
