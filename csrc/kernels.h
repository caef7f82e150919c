// The primitives the compiled module exports. The bindings (bindings.cpp) fill these from buffers they have
// checked themselves; no torch headers are needed to build.
#pragma once
#include <cstdint>

namespace fastagg {

struct StatsArgs {
  int64_t num_clients;        // M
  int64_t num_segments;       // L
  int dtype;                  // DType code of every row (and base)
  int compute_dtype;          // of mean_out, mean_init and aux: kFloat32 or kFloat64 (rows are converted on load)
  const uint64_t* row_ptrs;   // [L * M]: address of client i's segment s at [s * M + i]
  const uint64_t* base_ptrs;  // [L] or nullptr: rows are full models, deltas are row - base
  const int64_t* seg_len;     // [L]
  const int64_t* seg_off;     // [L]: offset of each segment in the flat mean
  const double* weights;      // [M]: coefficient of each row in the mean
  const void* mean_init;      // [d] in the compute type, or nullptr: mean_out = mean_init + sum_i ...
  const void* aux;            // [d] in the compute type, or nullptr: mean_sq = ||mean + aux_coef * aux||^2
  double aux_coef;
  void* mean_out;             // [d] in the compute type, or nullptr: the mean is not written
  double* sq_norms_out;       // [M]
  uint8_t* nonfinite_out;     // [M]
  double* mean_sq_out;        // [1]
  double noise_sigma;         // > 0: mean[j] += noise_sigma * N_j(noise_seed, noise_round) as it is written (noise.h)
  uint64_t noise_seed;
  uint64_t noise_round;
};

struct MomentumArgs {
  int64_t num_segments;
  int param_dtype;
  int compute_dtype;          // of mean and buf: kFloat32 or kFloat64
  const uint64_t* param_ptrs; // [L]
  const uint64_t* extra_ptrs; // [L] (params' dtype) or nullptr
  const uint64_t* start_ptrs; // [L] (params' dtype) or nullptr: w's old values are read here, not from w (which
                              // is then only written: w ends as if it had held start before the pass)
  const int64_t* seg_len;
  const int64_t* seg_off;     // offsets into the flat mean and buf
  const void* mean;
  const double* mean_scale;   // nullptr, or the mean is 0 + mean_scale * mean[j] in the compute type (an
                              // Accumulator's sum read as round_stats would write its one-row mean)
  void* buf;                  // momentum buffer or nullptr
  const double* lr;           // device scalars
  const double* extra_coef;
  const double* extra_coef_skip;  // nullptr: extra is left untouched when the round is not finite
  const uint8_t* finite;
  double momentum;
  bool nesterov;
  int32_t* overflow;          // += elements whose new value would not be finite (they keep their old values)
};

enum AdamRule : int { kAdam = 0, kYogi = 1, kAdagrad = 2, kAms = 3 };

struct AdamArgs {
  int64_t num_segments;
  int param_dtype;
  int compute_dtype;
  const uint64_t* param_ptrs;
  const int64_t* seg_len;
  const int64_t* seg_off;
  const void* mean;
  void* m;                    // nullptr for Adagrad
  void* v;
  void* vhat;                 // AMS only
  const double* lr;           // bias correction folded in
  const uint8_t* finite;
  int rule;
  double beta1, beta2, tau, ams_eps;
  int32_t* overflow;          // as MomentumArgs::overflow
};

enum LocalRule : int { kRuleFixed = 0, kRuleSps = 1 };
enum LocalMode : int { kModeNone = 0, kModeHeavy = 1, kModeNesterov = 2, kModeMass = 3 };

// A per-row scalar: values[i], or one value for every row when values is nullptr.
struct PerRow {
  const double* values;
  double value;
  double operator[](int64_t i) const { return values ? values[i] : value; }
};

struct LocalArgs {
  int64_t num_rows;             // M
  int64_t numel;                // d
  int dtype;                    // params, grads and anchor rows
  const uint64_t* x_ptrs;       // [M] params rows (written)
  const uint64_t* g_ptrs;       // [M]
  const uint64_t* anchor_ptrs;  // [M] or nullptr (prox term)
  const void* control;          // [d] server c in the compute type, or nullptr
  const uint64_t* ci_ptrs;      // [M] client c_i rows (compute type), with control
  const uint64_t* buf_ptrs;     // [M] momentum / MaSS rows (compute type), or nullptr
  PerRow lr;                    // rule FIXED
  PerRow loss, l_star, sps_c, cap;  // rule SPS
  const double* first;          // [M] (mode MASS): nonzero where b starts as x (w_0 = u_0), or nullptr
  double prox, clip_norm, weight_decay, momentum, eta2, tiny;
  int rule, mode;
  double* step_out;             // [M]: the step taken (0: none)
};

enum SelectRule : int { kSelectWindow = 0, kSelectNearest = 1 };

// Coordinate-select pass (robust.cpp): for each coordinate j, its M values sorted, then
//   kSelectWindow:  out[j] = mean of the sorted values at positions [first, first + count)
//   kSelectNearest: out[j] = mean of the `count` values nearest the coordinate's median
// and, from the same read, each row's squared norm and whether it holds NaN or Inf.
struct SelectArgs {
  int64_t num_clients;        // M
  int64_t num_segments;       // L
  int dtype;                  // of every row (and base)
  int out_dtype;              // kFloat32 or kFloat64
  const uint64_t* row_ptrs;   // [L * M], as StatsArgs
  const uint64_t* base_ptrs;  // [L] or nullptr
  const int64_t* seg_len;
  const int64_t* seg_off;
  int rule;
  int64_t first, count;
  void* out;                  // [d]
  double* sq_norms_out;       // [M]
  uint8_t* nonfinite_out;     // [M]
};

// Gram pass (robust.cpp): G[i, j] = <x_i - base, x_j - base> in float64 (products of the upcast values, float64
// sums), one read; a row holding NaN or Inf is marked (its row and column of G are then not meaningful).
struct GramArgs {
  int64_t num_clients;
  int64_t num_segments;
  int dtype;
  const uint64_t* row_ptrs;
  const uint64_t* base_ptrs;
  const int64_t* seg_len;
  double* gram_out;           // [M * M]
  uint8_t* nonfinite_out;     // [M]
};

void round_stats(const StatsArgs& args);
void coord_select(const SelectArgs& args);
void gram(const GramArgs& args);
void local_step(const LocalArgs& args);
void momentum_apply(const MomentumArgs& args);
void adam_apply(const AdamArgs& args);

}  // namespace fastagg
