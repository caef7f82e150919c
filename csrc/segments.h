// A flat parameter vector seen as L segments (one per layer, or one for a flat buffer).
// Work is split into fixed-size column blocks inside segments; the split depends only on
// the segment lengths, never on the thread count, which makes every reduction's order fixed.
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

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

// Runs f(block, col0) over every block of the segments in parallel (static schedule); col0 is the block's first
// column in the flat vector.
template <typename F>
void parallel_blocks(int64_t num_segments, const int64_t* seg_len, const int64_t* seg_off, int64_t block, F&& f) {
  const std::vector<Block> blocks = make_blocks(num_segments, seg_len, block);
  const int64_t nb = static_cast<int64_t>(blocks.size());
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < nb; ++b) f(blocks[b], seg_off[blocks[b].seg] + blocks[b].start);
}

}  // namespace fastagg
