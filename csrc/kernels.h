// The primitives the compiled module exports. Pointers arrive as integers from Python
// (torch CPU tensors or numpy arrays); no torch headers are needed to build.
#pragma once
#include <cstdint>

namespace fastagg {

struct StatsArgs {
  int64_t num_clients;        // M
  int64_t num_segments;       // L
  int dtype;                  // DType code of every row (and base)
  const uint64_t* row_ptrs;   // [L * M]: address of client i's segment s at [s * M + i]
  const uint64_t* base_ptrs;  // [L] or nullptr: rows are full models, deltas are row - base
  const int64_t* seg_len;     // [L]
  const int64_t* seg_off;     // [L]: offset of each segment in the flat mean
  const double* weights;      // [M]: coefficient of each row in the mean
  const void* mean_init;      // [d] in the compute type, or nullptr: mean_out = mean_init + sum_i ...
  void* mean_out;             // [d] in the compute type
  double* sq_norms_out;       // [M]
  uint8_t* nonfinite_out;     // [M]
  double* mean_sq_out;        // [1]
};

struct ApplyArgs {
  int64_t num_segments;
  int param_dtype;
  int mean_dtype;             // kFloat32 or kFloat64
  const uint64_t* param_ptrs; // [L]
  const uint64_t* eval_ptrs;  // [L] or nullptr
  const int64_t* seg_len;
  const int64_t* seg_off;
  const void* mean;
  const double* eta;
  const uint8_t* finite;
  double eval_scale;
};

void round_stats(const StatsArgs& args);
void apply_update(const ApplyArgs& args);

}  // namespace fastagg
