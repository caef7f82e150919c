// A flat parameter vector seen as L segments (one per layer, or one for a flat buffer).
// Work is split into fixed-size column blocks inside segments; the split depends only on
// the segment lengths, never on the thread count, which makes every reduction's order fixed.
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace fastagg {

struct Block {
  int64_t seg;    // segment index
  int64_t start;  // first column inside the segment
  int64_t len;    // columns in this block
};

inline std::vector<Block> make_blocks(int64_t num_segments, const int64_t* seg_len, int64_t block) {
  std::vector<Block> blocks;
  for (int64_t s = 0; s < num_segments; ++s)
    for (int64_t start = 0; start < seg_len[s]; start += block)
      blocks.push_back({s, start, std::min(block, seg_len[s] - start)});
  return blocks;
}

// Visits blocks [b0, b1) of a row of `end` elements cut into `block`-element blocks (only the row's last block may be
// shorter) as S interleaved streams: the range is split into S equal runs and group r holds the r-th block of each
// run, so a sweep keeps S far-apart sequential reads in flight. One stream per core leaves the memory system idle
// on this kind of VM (measured, bench/RESULTS.md: a one-stream read of 40 MB runs at ~60% of the bandwidth that
// four streams reach). group(starts) gets S full blocks' first elements in increasing order; single(start, stop)
// gets each block left over (the remainder runs and a group holding the short last block).
template <int S, typename Group, typename Single>
inline void for_block_groups(int64_t b0, int64_t b1, int64_t block, int64_t end, Group&& group, Single&& single) {
  const int64_t per = (b1 - b0) / S;
  int64_t starts[S];
  for (int64_t r = 0; r < per; ++r) {
    for (int k = 0; k < S; ++k) starts[k] = (b0 + k * per + r) * block;
    if (starts[S - 1] + block <= end) {
      group(starts);
    } else {
      for (int k = 0; k < S; ++k) single(starts[k], std::min(end, starts[k] + block));
    }
  }
  for (int64_t b = b0 + S * per; b < b1; ++b) single(b * block, std::min(end, (b + 1) * block));
}

template <typename T> inline T* as_ptr(uint64_t address) { return reinterpret_cast<T*>(address); }

// Threads for a pass touching `bytes` of memory: one per bytes_per_thread(), at most the OpenMP maximum; below two
// units the calling thread runs the pass alone and no team is formed. Results never depend on it: blocks and their
// summation order are fixed by the sizes alone.
//
// Why a team is costly for small work: the modules share the process's one libgomp (torch's bundled copy: it is
// loaded first, under the same soname), whose threads spin after a region (OMP_WAIT_POLICY unset: GOMP_SPINCOUNT
// 300000) and whose master spins at the closing barrier. On a loaded machine the worker whose core another process
// holds is found at the barrier only when it is scheduled again, a scheduler quantum later. Measured on the 2-core
// VM with other CPU-bound processes beside it (bench/bench_threads.py): a 1000 x 1000 float32 client step took
// 24-50 ms with 2 threads against 0.18-0.2 ms with one, and the idle process burnt 7.5 ms of CPU in the 200 ms
// after it. The wait policy is read once, when torch loads libgomp, so it cannot be made passive for our regions
// without changing the user's torch; small work therefore forms no team at all. The unit, 16 MB, is about 2 ms of
// a DRAM-bound pass on one core here (0.2 ms when the data sits in L3: the client step above touches 20 MB by
// call_bytes): below it a second thread saved at most 0.07 ms of a call when the machine was idle (0.124 against
// 0.197 ms for the client step), against the quantum it can cost when it is not. Passes of 32 MB and more still
// get their team (a FedExP round of 16 x 10^7 touches 640 MB). FASTAGG_CPU_BYTES_PER_THREAD sets the unit
// (fastagg/backends/cpu.py; the tests make it small to run teams on tiny inputs).
constexpr int64_t kBytesPerThread = int64_t(16) << 20;
inline int64_t& bytes_per_thread() {
  static int64_t unit = kBytesPerThread;  // set once at import (set_bytes_per_thread), before any kernel runs
  return unit;
}

inline int threads_for(int64_t bytes) {
#ifdef _OPENMP
  const int64_t want = std::max<int64_t>(1, bytes / bytes_per_thread());
  return static_cast<int>(std::min<int64_t>(want, omp_get_max_threads()));
#else
  (void)bytes;
  return 1;
#endif
}

// Runs f(block, col0) over every block of the segments in parallel (static schedule); col0 is the block's first
// column in the flat vector. `bytes_per_element`: the memory the pass touches per column (threads_for).
template <typename F>
void parallel_blocks(int64_t num_segments, const int64_t* seg_len, const int64_t* seg_off, int64_t block,
                     int64_t bytes_per_element, F&& f) {
  const std::vector<Block> blocks = make_blocks(num_segments, seg_len, block);
  const int64_t nb = static_cast<int64_t>(blocks.size());
  int64_t numel = 0;
  for (int64_t s = 0; s < num_segments; ++s) numel += seg_len[s];
#pragma omp parallel for schedule(static) num_threads(threads_for(numel * bytes_per_element))
  for (int64_t b = 0; b < nb; ++b) f(blocks[b], seg_off[blocks[b].seg] + blocks[b].start);
}

}  // namespace fastagg
