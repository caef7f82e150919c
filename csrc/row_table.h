// A round's client rows as one table: what fastagg._tensor_facts.row_table (csrc/tensor_facts.cpp, built against
// torch) hands the kernels' bindings (csrc/bindings.cpp, rows_of) in place of one DLPack capsule a row -- a
// ResNet-18 round of 16 clients has ~2,000 rows, whose capsules cost ~0.4 ms to make and free, more than the
// 1/8-width model's whole pass. Plain C layout, no torch and no pybind11: both modules include it.
//
// Only tensor_facts.cpp makes these, in a PyCapsule named FASTAGG_ROW_TABLE_CAPSULE (a name Python code cannot give
// a capsule without ctypes, as with DLPack's "dltensor"); the capsule owns the arrays and a reference to every
// tensor. Each row was checked there to be a plain contiguous CPU tensor of one floating dtype whose bytes lie
// inside its storage. A table is a snapshot, private and single-use: fastagg/backends/cpu.py makes it as the last
// argument of a binding call, after everything that could run user code, so nothing can change the rows between
// that check and the read. (The references keep the tensors, not their bytes: a table kept while a row is
// resized, set_ to other memory or its storage resized points at freed memory, as a kept DLPack capsule does.)
// The binding still checks the table's own consistency (magic, sizes, each row's element count against the
// segment's, no null address with elements).
#pragma once

#include <cstdint>

#define FASTAGG_ROW_TABLE_CAPSULE "fastagg.row_table.v1"

namespace fastagg {

constexpr uint64_t kRowTableMagic = 0x66617374616767ULL;  // "fastagg"

struct RowTableC {
  uint64_t magic;            // kRowTableMagic
  int64_t segments, clients; // rows[s * clients + i]: client i's part of segment s
  uint8_t dl_code;           // the rows' dtype as DLPack's (code, bits): kDLFloat 2 / kDLBfloat 4
  uint8_t dl_bits;
  char* const* data;         // segments * clients addresses
  const int64_t* numel;      // segments * clients element counts
};

}  // namespace fastagg
