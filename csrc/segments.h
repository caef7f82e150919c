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
