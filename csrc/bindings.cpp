// pybind11 bindings. Every buffer arrives as a DLPack capsule (tensor.__dlpack__(), see views.h) and is checked
// here against what the kernel will read and write -- dtype, element count, strides, index ranges, overlaps --
// before the GIL is released and the kernel runs. A bad argument is a ValueError or TypeError naming it; no
// kernel runs then. The module builds without torch headers and takes numpy-backed tensors as well.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "noise.h"
#include "quantized.h"
#include "row_table.h"
#include "segments.h"
#include "views.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace py = pybind11;
using namespace fastagg;

namespace {

std::string str(int64_t v) { return std::to_string(v); }

uint64_t address(const View& v, int64_t element) {
  return reinterpret_cast<uint64_t>(v.data) + static_cast<uint64_t>(element * v.itemsize);
}

// A per-layer list of 1-D contiguous tensors of one floating dtype: the views, and the segment lengths.
std::vector<View> segment_views(py::handle list, const std::string& name, int want) {
  if (!py::isinstance<py::list>(list)) type_error(name + " must be a list of tensors");
  std::vector<View> out;
  for (py::handle item : list.cast<py::list>()) {
    View v = view_of(item, name + "[" + str(out.size()) + "]", out.empty() ? want : out[0].kind);
    if (v.shape.size() != 1 || !v.contiguous()) value_error(v.name + " must be a contiguous 1-D tensor");
    out.push_back(std::move(v));
  }
  if (out.empty()) value_error(name + " is empty");
  return out;
}

std::vector<const View*> pointers(const std::vector<View>& views) {
  std::vector<const View*> out;
  for (const View& v : views) out.push_back(&v);
  return out;
}

int compute_kind(int kind) { return kind == kF64 ? kF64 : kF32; }

// ---- round_stats --------------------------------------------------------------------------------------------

// The client rows of a pass: L lists of M row segments, or one [M, d] matrix (unit stride along d), and the
// optional base segments (full models). Every address the kernel will read comes from a capsule checked here.
// A list's rows (~1,000 a ResNet-18 round of 16) and the base segments are read by quick_row (views.h): no View, no
// name, nothing allocated per row; a row it does not accept goes through the named checks (view_of and the count
// and contiguity checks), which raise as they always did. Their spans are kept for the overlap check (reads and
// read_name: the order and the names the Views had).
struct RowsArg {
  std::vector<View> views;            // the [M, d] matrix (one view); empty for a list of rows
  std::vector<Span> row_spans;        // [s * M + i] for a list of rows, then the base's [s]
  std::vector<uint64_t> ptrs, base_ptrs;  // [s * M + i], [s]
  std::vector<int64_t> seg_off;
  int64_t M = 0, d = 0;
  int T = 0;
  std::string base_name(int64_t s) const { return "params (the base of models=)[" + str(s) + "]"; }
  // The read spans in the order the Views had (rows, then base), and their names.
  std::vector<Span> reads() const {
    std::vector<Span> out;
    out.reserve(views.size() + row_spans.size());
    for (const View& v : views) out.push_back(v.span());
    out.insert(out.end(), row_spans.begin(), row_spans.end());
    return out;
  }
  std::string read_name(size_t j) const {
    if (j < views.size()) return views[j].name;
    j -= views.size();
    const int64_t rows = views.empty() ? static_cast<int64_t>(ptrs.size()) : 0;
    if (static_cast<int64_t>(j) < rows) return "deltas[" + str(j % M) + "] entry " + str(j / M);
    return base_name(static_cast<int64_t>(j) - rows);
  }
};

// check_overlaps with the rows' (and base's) spans and any other reads.
void check_row_overlaps(const std::vector<const View*>& writes, const RowsArg& r, const std::vector<const View*>& more) {
  std::vector<Span> reads = r.reads();
  const size_t n = reads.size();
  for (const View* v : more) reads.push_back(v->span());
  check_overlaps_spans(writes, reads, [&](size_t j) { return j < n ? r.read_name(j) : more[j - n]->name; });
}

// A row table capsule's table (csrc/row_table.h), its own consistency checked: the magic, `segments` tables of
// `clients` > 0 rows each.
const fastagg::RowTableC& row_table_of(py::handle capsule, const std::string& name, int64_t segments) {
  const auto* tab = static_cast<const fastagg::RowTableC*>(PyCapsule_GetPointer(capsule.ptr(),
                                                                                 FASTAGG_ROW_TABLE_CAPSULE));
  if (tab == nullptr) throw py::error_already_set();
  if (tab->magic != fastagg::kRowTableMagic || tab->data == nullptr || tab->numel == nullptr)
    type_error(name + " is not a row table made by fastagg._tensor_facts");
  if (tab->segments != segments) value_error(name + " have " + str(tab->segments) + " segments; expected " +
                                             str(segments));
  if (tab->clients <= 0) value_error(name + " hold no client");
  return *tab;
}

// The table's dtype as a Kind: a floating one, and `want` unless that is kAnyFloat.
int table_kind(const fastagg::RowTableC& tab, const std::string& name, int want) {
  const int kind = quick_kind(DLDataType{tab.dl_code, tab.dl_bits, 1});
  if (kind == kNoKind || kind > kF64 || (want != kAnyFloat && kind != want))
    type_error(name + " has an unsupported dtype (DLPack code " + str(tab.dl_code) + ", " + str(tab.dl_bits) +
               " bits)");
  return kind;
}

// Row j of a table as a QuickRow, holding exactly `numel` elements (and an address when it holds any).
template <typename Name>
QuickRow table_row(const fastagg::RowTableC& tab, int64_t j, int64_t numel, int kind, Name name) {
  const int64_t n = tab.numel[j];
  if (n != numel) value_error(name() + " has " + str(n) + " elements; expected " + str(numel));
  if (n > 0 && tab.data[j] == nullptr) value_error(name() + " has no memory");
  return {tab.data[j], kind, n, tab.dl_bits / 8};
}

RowsArg rows_of(py::handle rows, py::handle base, const std::vector<int64_t>& seg_lens, const std::string& pass) {
  RowsArg r;
  const int64_t L = static_cast<int64_t>(seg_lens.size());
  if (L == 0) value_error(pass + " needs at least one segment");
  r.seg_off.resize(L);
  for (int64_t s = 0; s < L; ++s) {
    if (seg_lens[s] < 0) value_error("segment " + str(s) + " has a negative length");
    if (seg_lens[s] > std::numeric_limits<int64_t>::max() - r.d)
      value_error("the segments' lengths add up past int64 (segment " + str(s) + ")");
    r.seg_off[s] = r.d;
    r.d += seg_lens[s];
  }
  if (PyCapsule_IsValid(rows.ptr(), FASTAGG_ROW_TABLE_CAPSULE)) {  // the same rows as one table (row_table.h)
    const fastagg::RowTableC& tab = row_table_of(rows, "deltas", L);
    r.M = tab.clients;
    r.T = table_kind(tab, "deltas", kAnyFloat);
    r.ptrs.resize(L * r.M);
    r.row_spans.resize(L * r.M);
    for (int64_t s = 0; s < L; ++s)
      for (int64_t i = 0; i < r.M; ++i) {
        const QuickRow q = table_row(tab, s * r.M + i, seg_lens[s], r.T, [&] {
          return "deltas[" + str(i) + "] entry " + str(s); });
        r.ptrs[s * r.M + i] = reinterpret_cast<uint64_t>(q.data);
        r.row_spans[s * r.M + i] = q.span();
      }
  } else if (py::isinstance<py::list>(rows)) {  // L lists of M row segments
    auto segs = rows.cast<py::list>();
    if (static_cast<int64_t>(segs.size()) != L) value_error("deltas have " + str(segs.size()) + " segments; "
                                                            "expected " + str(L));
    r.M = static_cast<int64_t>(py::len(segs[0]));
    r.ptrs.resize(L * r.M);
    r.row_spans.resize(L * r.M);
    bool first = true;
    for (int64_t s = 0; s < L; ++s) {
      if (static_cast<int64_t>(py::len(segs[s])) != r.M) value_error("segment " + str(s) + " has a different "
                                                                     "number of clients");
      auto seg = segs[s].cast<py::list>();
      // the list's own length bounds every read of it (py::len above may come from a __len__)
      const bool sized = static_cast<int64_t>(PyList_GET_SIZE(seg.ptr())) == r.M;
      for (int64_t i = 0; i < r.M; ++i) {
        QuickRow q;
        if (sized && quick_row(PyList_GET_ITEM(seg.ptr(), i), first ? kAnyFloat : r.T, seg_lens[s], false, q)) {
          if (first) r.T = q.kind;
          r.ptrs[s * r.M + i] = reinterpret_cast<uint64_t>(q.data);
          r.row_spans[s * r.M + i] = q.span();
        } else {  // the named checks: they raise what is wrong
          const std::string name = "deltas[" + str(i) + "] entry " + str(s);
          View v = view_of(seg[i], name, first ? kAnyFloat : r.T);
          if (first) r.T = v.kind;
          if (v.numel() != seg_lens[s]) value_error(name + " has " + str(v.numel()) + " elements; expected " +
                                                    str(seg_lens[s]));
          if (!v.contiguous()) value_error(name + " must be contiguous");
          r.ptrs[s * r.M + i] = address(v, 0);
          r.row_spans[s * r.M + i] = v.span();
        }
        first = false;
      }
    }
  } else {
    View m = view_of(rows, "deltas", kAnyFloat);
    r.T = m.kind;
    if (m.shape.size() != 2) value_error("deltas must be 2-D [M, d]");
    r.M = m.shape[0];
    if (m.shape[1] != r.d) value_error("deltas have " + str(m.shape[1]) + " columns; expected " + str(r.d));
    if (r.d > 1 && m.strides[1] != 1) value_error("deltas must have unit stride along the parameters");
    r.ptrs.resize(L * r.M);
    for (int64_t s = 0; s < L; ++s)
      for (int64_t i = 0; i < r.M; ++i) r.ptrs[s * r.M + i] = address(m, i * m.strides[0] + r.seg_off[s]);
    r.views.push_back(std::move(m));
  }
  if (r.M == 0) value_error("deltas hold no client");
  if (!base.is_none() && PyCapsule_IsValid(base.ptr(), FASTAGG_ROW_TABLE_CAPSULE)) {  // one client's table
    const fastagg::RowTableC& tab = row_table_of(base, "params (the base of models=)", L);
    if (tab.clients != 1) value_error("params (the base of models=) must be one model, got a table of " +
                                      str(tab.clients));
    const int kind = table_kind(tab, "params (the base of models=)", kAnyFloat);
    if (kind != r.T) type_error("params (the base of models=) must be " + std::string(kind_name(r.T)) + ", got " +
                                kind_name(kind));
    for (int64_t s = 0; s < L; ++s) {
      const QuickRow q = table_row(tab, s, seg_lens[s], r.T, [&] { return r.base_name(s); });
      r.base_ptrs.push_back(reinterpret_cast<uint64_t>(q.data));
      r.row_spans.push_back(q.span());
    }
  } else if (!base.is_none()) {
    // segment_views(base, "params (the base of models=)", r.T) and the count and length checks after it, with the
    // same quick_row shortcut as the rows: each segment 1-D, contiguous, of the rows' dtype.
    const std::string bname = "params (the base of models=)";
    if (!py::isinstance<py::list>(base)) type_error(bname + " must be a list of tensors");
    auto items = base.cast<py::list>();
    const int64_t n = static_cast<int64_t>(PyList_GET_SIZE(items.ptr()));
    std::vector<int64_t> numel(n);
    for (int64_t k = 0; k < n; ++k) {
      QuickRow q;
      if (quick_row(PyList_GET_ITEM(items.ptr(), k), r.T, -1, true, q)) {
        r.base_ptrs.push_back(reinterpret_cast<uint64_t>(q.data));
        r.row_spans.push_back(q.span());
        numel[k] = q.numel;
      } else {
        View v = view_of(items[k], r.base_name(k), r.T);
        if (v.shape.size() != 1 || !v.contiguous()) value_error(v.name + " must be a contiguous 1-D tensor");
        r.base_ptrs.push_back(address(v, 0));
        r.row_spans.push_back(v.span());
        numel[k] = v.numel();
      }
    }
    if (n == 0) value_error(bname + " is empty");
    if (n != L) value_error("params have a different number of segments");
    for (int64_t s = 0; s < L; ++s)
      if (numel[s] != seg_lens[s]) value_error(r.base_name(s) + " has the wrong length");
  }
  return r;
}

void checked_round_stats(py::handle rows, py::handle base, const std::vector<int64_t>& seg_lens, py::handle weights,
                 py::handle mean_init, py::handle aux, double aux_coef, py::handle mean_out, py::handle sq_norms_out,
                 py::handle nonfinite_out, py::handle mean_sq_out, double noise_sigma, uint64_t noise_seed,
                 uint64_t noise_round) {
  if (!(noise_sigma >= 0) || !std::isfinite(noise_sigma))
    value_error("round_stats: noise_sigma must be a finite number >= 0, got " + std::to_string(noise_sigma));
  const RowsArg r = rows_of(rows, base, seg_lens, "round_stats");
  const int64_t L = static_cast<int64_t>(seg_lens.size()), M = r.M, d = r.d;
  View w = flat_view(weights, "weights", kF64, M);
  // mean_out None: the mean is not written (only ||mean||^2 and the clients' stats), in the rows' compute type
  View mean;
  int C = compute_kind(r.T);
  if (!mean_out.is_none()) {
    mean = view_of(mean_out, "mean_out", kAnyFloat);
    if (mean.kind != kF32 && mean.kind != kF64) type_error("mean_out must be float32 or float64");
    C = mean.kind;
    mean = flat_view(mean_out, "mean_out", C, d);
  } else if (noise_sigma > 0) {
    value_error("round_stats: noise needs a mean_out to be written into");
  }
  View init = mean_init.is_none() ? View{} : flat_view(mean_init, "mean_init", C, d);
  View ax = aux.is_none() ? View{} : flat_view(aux, "aux", C, d);
  View sq = flat_view(sq_norms_out, "sq_norms_out", kF64, M);
  View bad = flat_view(nonfinite_out, "nonfinite_out", kBool, M);
  View msq = flat_view(mean_sq_out, "mean_sq_out", kF64, 1);
  check_row_overlaps({&mean, &sq, &bad, &msq}, r, {&w, &init, &ax});

  StatsArgs a{};
  a.num_clients = M;
  a.num_segments = L;
  a.dtype = r.T;
  a.compute_dtype = C;
  a.row_ptrs = r.ptrs.data();
  a.base_ptrs = r.base_ptrs.empty() ? nullptr : r.base_ptrs.data();
  a.seg_len = seg_lens.data();
  a.seg_off = r.seg_off.data();
  a.weights = reinterpret_cast<const double*>(w.data);
  a.mean_init = init.data;
  a.aux = ax.data;
  a.aux_coef = aux_coef;
  a.mean_out = mean.data;
  a.sq_norms_out = reinterpret_cast<double*>(sq.data);
  a.nonfinite_out = reinterpret_cast<uint8_t*>(bad.data);
  a.mean_sq_out = reinterpret_cast<double*>(msq.data);
  a.noise_sigma = noise_sigma;
  a.noise_seed = noise_seed;
  a.noise_round = noise_round;
  py::gil_scoped_release release;
  fastagg::round_stats(a);
}

// ---- Gaussian noise (noise.h) --------------------------------------------------------------------------------

void checked_gaussian_noise(py::handle out, uint64_t seed, uint64_t round, int64_t first) {
  View o = view_of(out, "out", kAnyFloat);
  if (o.kind != kF32) type_error("gaussian_noise: out must be float32");
  o = flat_view(out, "out", kF32, o.numel());
  if (first < 0) value_error("gaussian_noise: first must be >= 0, got " + str(first));
  float* data = reinterpret_cast<float*>(o.data);
  const int64_t n = o.numel();
  py::gil_scoped_release release;
  constexpr int64_t kChunk = 1 << 16;  // chunks fixed by size: the same values for any thread count
  const int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static) num_threads(threads_for(n * 16))  // ~3 ns an element: weigh it as 16 bytes
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t lo = c * kChunk, len = std::min(kChunk, n - lo);
    fastagg::gaussian_fill(seed, round, first + lo, len, data + lo);
  }
}

std::vector<uint32_t> checked_philox(const std::vector<uint32_t>& counter, const std::vector<uint32_t>& key) {
  if (counter.size() != 4 || key.size() != 2) value_error("philox4x32_10: counter must have 4 words and key 2");
  std::vector<uint32_t> out(4);
  fastagg::philox4x32_10(counter.data(), key.data(), out.data());
  return out;
}

// ---- compressed clients (quantized.h) ------------------------------------------------------------------------

// Blockwise clients: int8 codes (table None) or one-byte codes read through `table` (256 float32 entries), or
// decoded as fp8 e4m3 (e4m3 true: the table is then not read).
void checked_blockwise_fold(py::handle codes, py::handle scales, int64_t block, py::handle table, bool e4m3,
                            py::handle coef,
                            py::handle init, py::handle out, py::handle sq_out, py::handle bad_out,
                            py::handle msq_out) {
  const std::string pass = "blockwise_fold: ";
  if (!py::isinstance<py::list>(codes) || !py::isinstance<py::list>(scales))
    type_error(pass + "codes and scales must be lists of tensors");
  const py::list cl = codes.cast<py::list>(), sl = scales.cast<py::list>();
  const int64_t M = static_cast<int64_t>(cl.size());
  if (M == 0) value_error(pass + "no clients");
  if (static_cast<int64_t>(sl.size()) != M)
    value_error(pass + str(M) + " codes but " + str(static_cast<int64_t>(sl.size())) + " scales");
  if (block < 1) value_error(pass + "block must be >= 1, got " + str(block));
  View o = view_of(out, "out", kAnyFloat);
  if (o.kind != kF32 && o.kind != kF64) type_error(pass + "out must be float32 or float64");
  const int64_t d = o.numel();
  o = flat_view(out, "out", o.kind, d);
  const int64_t nblocks = d == 0 ? 0 : (d - 1) / block + 1;
  const bool tabled = !table.is_none();
  View tv = tabled ? flat_view(table, "table", kF32, 256) : View{};
  std::vector<View> cv, sv;
  for (int64_t i = 0; i < M; ++i) {
    // one-byte codes read through a table travel as uint8 (the byte kind bool shares)
    cv.push_back(flat_view(cl[i], "codes[" + str(i) + "]", tabled ? kBool : kI8, d));
    sv.push_back(flat_view(sl[i], "scales[" + str(i) + "]", kF32, nblocks));
    const float* s = reinterpret_cast<const float*>(sv.back().data);
    for (int64_t b = 0; b < nblocks; ++b)
      if (!(std::isfinite(s[b]) && s[b] > 0.0f))
        value_error(pass + "client " + str(i) + ": scale of block " + str(b) + " is " + std::to_string(s[b]) +
                    " (scales must be finite and > 0)");
  }
  View c = flat_view(coef, "coef", kF64, M);
  const double* cf = reinterpret_cast<const double*>(c.data);
  for (int64_t i = 0; i < M; ++i)
    if (!std::isfinite(cf[i])) value_error(pass + "coef[" + str(i) + "] is not finite");
  View in = init.is_none() ? View{} : flat_view(init, "init", o.kind, d);
  // sq_out None: the clients' squared norms are not wanted (skipped where the kernel can)
  View sq = sq_out.is_none() ? View{} : flat_view(sq_out, "sq_out", kF64, M);
  View bad = flat_view(bad_out, "bad_out", kBool, M), msq = flat_view(msq_out, "msq_out", kF64, 1);
  std::vector<const View*> reads = pointers(cv);
  for (const View& v : sv) reads.push_back(&v);
  reads.push_back(&c);
  if (tabled) reads.push_back(&tv);
  // init may be out itself (an in-place fold: each element is read before it is written)
  if (!init.is_none() && in.data != o.data) reads.push_back(&in);
  std::vector<const View*> writes = {&o, &bad, &msq};
  if (!sq_out.is_none()) writes.push_back(&sq);
  check_overlaps(writes, reads);
  std::vector<const void*> cp;
  std::vector<const float*> sp;
  for (int64_t i = 0; i < M; ++i) {
    cp.push_back(cv[i].data);
    sp.push_back(reinterpret_cast<const float*>(sv[i].data));
  }
  const float* tp = tabled ? reinterpret_cast<const float*>(tv.data) : nullptr;
  py::gil_scoped_release release;
  auto* sqp = sq_out.is_none() ? nullptr : reinterpret_cast<double*>(sq.data);
  auto* badp = reinterpret_cast<uint8_t*>(bad.data);
  auto* msqp = reinterpret_cast<double*>(msq.data);
  auto run = [&](auto* typed_out) {
    using T = std::remove_pointer_t<decltype(typed_out)>;
    const T* ip = init.is_none() ? nullptr : reinterpret_cast<const T*>(in.data);
    if (tabled && e4m3)
      e4m3_blockwise_fold<T>(reinterpret_cast<const uint8_t* const*>(cp.data()), sp.data(), M, d, block, cf, ip,
                             typed_out, sqp, badp, msqp);
    else if (tabled)
      table_blockwise_fold<T>(reinterpret_cast<const uint8_t* const*>(cp.data()), tp, sp.data(), M, d, block, cf,
                              ip, typed_out, sqp, badp, msqp);
    else
      int8_blockwise_fold<T>(reinterpret_cast<const int8_t* const*>(cp.data()), sp.data(), M, d, block, cf, ip,
                             typed_out, sqp, badp, msqp);
  };
  if (o.kind == kF32)
    run(reinterpret_cast<float*>(o.data));
  else
    run(reinterpret_cast<double*>(o.data));
}

namespace {
// The first entry t of a client's indices with at[t] <= at[t - 1], or -1 when they strictly increase: a
// branch-free pass (it vectorizes), then a walk only when it found one.
template <typename I>
int64_t first_not_rising(const I* at, int64_t k) {
  int rising = 1;
  for (int64_t j = 1; j < k; ++j) rising &= at[j] > at[j - 1];
  if (rising) return -1;
  for (int64_t j = 1; j < k; ++j)
    if (at[j] <= at[j - 1]) return j;
  return -1;
}

bool all_finite(const float* v, int64_t k) {
  int finite = 1;
  for (int64_t j = 0; j < k; ++j) finite &= (v[j] - v[j]) == 0.0f;  // false for NaN and +-Inf
  return finite != 0;
}

int64_t first_not_rising(const View& ix, int64_t k) {
  return ix.kind == kI64 ? first_not_rising(reinterpret_cast<const int64_t*>(ix.data), k)
                         : first_not_rising(reinterpret_cast<const int32_t*>(ix.data), k);
}

int64_t index_at(const View& ix, int64_t j) {
  return ix.kind == kI64 ? reinterpret_cast<const int64_t*>(ix.data)[j]
                         : static_cast<int64_t>(reinterpret_cast<const int32_t*>(ix.data)[j]);
}

// True when a client's entries are well formed: indices strictly increasing (so all lie in [0, d) when the first and
// the last do) and values finite. The entry-by-entry walk that names the first bad entry runs only for a client
// found wanting.
bool sparse_entries_fine(const View& ix, const float* v, int64_t k, int64_t d) {
  if (k == 0) return true;
  return first_not_rising(ix, k) < 0 && all_finite(v, k) && index_at(ix, 0) >= 0 && index_at(ix, k - 1) < d;
}

// Per client: views of its indices (int64 or int32, one dtype for all) and float32 values of the same length.
void sparse_views(const std::string& pass, py::handle indices, py::handle values, std::vector<View>& iv,
                  std::vector<View>& vv, std::vector<int64_t>& ks) {
  if (!py::isinstance<py::list>(indices) || !py::isinstance<py::list>(values))
    type_error(pass + "indices and values must be lists of tensors");
  const py::list il = indices.cast<py::list>(), vl = values.cast<py::list>();
  const int64_t M = static_cast<int64_t>(il.size());
  if (M == 0) value_error(pass + "no clients");
  if (static_cast<int64_t>(vl.size()) != M)
    value_error(pass + str(M) + " index tensors but " + str(static_cast<int64_t>(vl.size())) + " value tensors");
  for (int64_t i = 0; i < M; ++i) {
    View ix = view_of(il[i], "indices[" + str(i) + "]", kAnyIndex);
    const int64_t k = ix.numel();
    ix = flat_view(il[i], "indices[" + str(i) + "]", ix.kind, k);
    if (!iv.empty() && ix.kind != iv.front().kind) type_error(pass + "the clients' indices must share one dtype");
    iv.push_back(ix);
    vv.push_back(flat_view(vl[i], "values[" + str(i) + "]", kF32, k));
    ks.push_back(k);
  }
}

void name_bad_sparse_entry(const View& ix, const float* v, int64_t k, int64_t d, const std::string& who) {
  int64_t prev = -1;
  for (int64_t j = 0; j < k; ++j) {
    const int64_t at = index_at(ix, j);
    if (at < 0 || at >= d) value_error(who + "index " + str(at) + " (entry " + str(j) + ") is outside [0, " + str(d) + ")");
    if (at <= prev)
      value_error(who + "indices must be strictly increasing; entry " + str(j) + " is " + str(at) + " after " +
                  str(prev));
    if (!std::isfinite(v[j])) value_error(who + "value " + str(j) + " is not finite");
    prev = at;
  }
  value_error(who + "malformed entries");  // (not reached: the walk names what the fast check found)
}
}  // namespace

// What Python's checks need of blockwise clients' scales (float32), in one parallel pass: per client, whether every
// scale is finite and the first block whose scale is <= 0 (-1: none).
py::list checked_scale_scan(py::handle scales) {
  if (!py::isinstance<py::list>(scales)) type_error("scale_scan: scales must be a list of tensors");
  const py::list sl = scales.cast<py::list>();
  const int64_t M = static_cast<int64_t>(sl.size());
  std::vector<View> sv;
  int64_t total = 0;
  for (int64_t i = 0; i < M; ++i) {
    View v = view_of(sl[i], "scales[" + str(i) + "]", kF32);
    sv.push_back(flat_view(sl[i], "scales[" + str(i) + "]", kF32, v.numel()));
    total += v.numel();
  }
  std::vector<uint8_t> finite(static_cast<size_t>(M));
  std::vector<int64_t> first(static_cast<size_t>(M));
  {
    py::gil_scoped_release release;
#pragma omp parallel for schedule(dynamic) num_threads(threads_for(total * 8))
    for (int64_t i = 0; i < M; ++i) {
      const auto* p = reinterpret_cast<const float*>(sv[i].data);
      const int64_t n = sv[i].numel();
      int ok = 1, positive = 1;
      for (int64_t b = 0; b < n; ++b) {
        ok &= (p[b] - p[b]) == 0.0f;  // false for NaN and +-Inf
        positive &= p[b] > 0.0f;
      }
      finite[i] = ok != 0;
      first[i] = -1;
      if (!positive)
        for (int64_t b = 0; b < n; ++b)
          if (p[b] <= 0.0f) {
            first[i] = b;
            break;
          }
    }
  }
  py::list out;
  for (int64_t i = 0; i < M; ++i) out.append(py::make_tuple(finite[i] != 0, first[i]));
  return out;
}

// What Python's checks need of sparse clients, in one parallel pass: per client, the first entry whose index does
// not exceed the one before (-1: strictly increasing) and whether every value is finite.
py::list checked_sparse_scan(py::handle indices, py::handle values) {
  std::vector<View> iv, vv;
  std::vector<int64_t> ks;
  sparse_views("sparse_scan: ", indices, values, iv, vv, ks);
  const int64_t M = static_cast<int64_t>(ks.size());
  std::vector<int64_t> first(static_cast<size_t>(M));
  std::vector<uint8_t> finite(static_cast<size_t>(M));
  {
    py::gil_scoped_release release;
    int64_t total = 0;
    for (int64_t k : ks) total += k;
#pragma omp parallel for schedule(dynamic) num_threads(threads_for(total * 8))
    for (int64_t i = 0; i < M; ++i) {
      first[i] = first_not_rising(iv[i], ks[i]);
      finite[i] = all_finite(reinterpret_cast<const float*>(vv[i].data), ks[i]);
    }
  }
  py::list out;
  for (int64_t i = 0; i < M; ++i) out.append(py::make_tuple(first[i], finite[i] != 0));
  return out;
}

// Sparse clients folded into out: out = init + the scattered clients (init None: zeros; init may be out itself).
// Every index is checked here (in [0, d), strictly increasing per client) and every value finite, before anything
// is written.
void checked_sparse_fold(py::handle indices, py::handle values, py::handle coef, py::handle init, py::handle out,
                         py::handle sq_out, py::handle msq_out) {
  const std::string pass = "sparse_fold: ";
  std::vector<View> iv, vv;
  std::vector<int64_t> ks;
  sparse_views(pass, indices, values, iv, vv, ks);
  const int64_t M = static_cast<int64_t>(ks.size());
  View o = view_of(out, "out", kAnyFloat);
  if (o.kind != kF32 && o.kind != kF64) type_error(pass + "out must be float32 or float64");
  const int64_t d = o.numel();
  o = flat_view(out, "out", o.kind, d);
  std::vector<uint8_t> fine(static_cast<size_t>(M), 1);
  {
    py::gil_scoped_release release;
    int64_t total = 0;
    for (int64_t k : ks) total += k;
#pragma omp parallel for schedule(dynamic) num_threads(threads_for(total * 8))
    for (int64_t i = 0; i < M; ++i)
      fine[i] = sparse_entries_fine(iv[i], reinterpret_cast<const float*>(vv[i].data), ks[i], d);
  }
  for (int64_t i = 0; i < M; ++i)
    if (!fine[i])
      name_bad_sparse_entry(iv[i], reinterpret_cast<const float*>(vv[i].data), ks[i], d,
                            pass + "client " + str(i) + ": ");
  View c = flat_view(coef, "coef", kF64, M);
  const double* cf = reinterpret_cast<const double*>(c.data);
  for (int64_t i = 0; i < M; ++i)
    if (!std::isfinite(cf[i])) value_error(pass + "coef[" + str(i) + "] is not finite");
  View in = init.is_none() ? View{} : flat_view(init, "init", o.kind, d);
  View sq = flat_view(sq_out, "sq_out", kF64, M);
  View msq = msq_out.is_none() ? View{} : flat_view(msq_out, "msq_out", kF64, 1);
  std::vector<const View*> reads = pointers(iv);
  for (const View& v : vv) reads.push_back(&v);
  reads.push_back(&c);
  // init may be out itself (an in-place fold); any other overlap with what is written is refused
  if (!init.is_none() && in.data != o.data) reads.push_back(&in);
  check_overlaps({&o, &sq, &msq}, reads);
  std::vector<const void*> ip;
  std::vector<const float*> vp;
  for (int64_t i = 0; i < M; ++i) {
    ip.push_back(iv[i].data);
    vp.push_back(reinterpret_cast<const float*>(vv[i].data));
  }
  const bool wide = iv.front().kind == kI64;
  auto* sqp = reinterpret_cast<double*>(sq.data);
  auto* msqp = msq_out.is_none() ? nullptr : reinterpret_cast<double*>(msq.data);
  py::gil_scoped_release release;
  auto run = [&](auto* typed_out) {
    using T = std::remove_pointer_t<decltype(typed_out)>;
    const T* start = init.is_none() ? nullptr : reinterpret_cast<const T*>(in.data);
    if (wide)
      sparse_fold<T, int64_t>(reinterpret_cast<const int64_t* const*>(ip.data()), vp.data(), ks.data(), M, cf,
                              start, typed_out, d, sqp, msqp);
    else
      sparse_fold<T, int32_t>(reinterpret_cast<const int32_t* const*>(ip.data()), vp.data(), ks.data(), M, cf,
                              start, typed_out, d, sqp, msqp);
  };
  if (o.kind == kF32)
    run(reinterpret_cast<float*>(o.data));
  else
    run(reinterpret_cast<double*>(o.data));
}

namespace {
// What a row quantizer is handed, checked: x [M, d] float32/float64 contiguous, block >= 1, codes [M * d] bytes (an
// int8 view), scales [M * ceil(d / block)] float32, the outputs not overlapping x or each other.
struct QuantizeViews {
  View x, codes, scales;
  int64_t M, d;
};

QuantizeViews quantize_views(const std::string& pass, py::handle x, int64_t block, py::handle codes_out,
                             py::handle scales_out) {
  View xv = view_of(x, "x", kAnyFloat);
  if (xv.kind != kF32 && xv.kind != kF64) type_error(pass + "x must be float32 or float64");
  if (xv.shape.size() != 2) value_error(pass + "x must be 2-D [M, d]");
  if (!xv.contiguous()) value_error(pass + "x must be contiguous");
  const int64_t M = xv.shape[0], d = xv.shape[1];
  if (block < 1) value_error(pass + "block must be >= 1, got " + str(block));
  const int64_t nb = d == 0 ? 0 : (d - 1) / block + 1;
  View cv = flat_view(codes_out, "codes_out", kI8, M * d), sv = flat_view(scales_out, "scales_out", kF32, M * nb);
  check_overlaps({&cv, &sv}, {&xv});
  return {xv, cv, sv, M, d};
}
}  // namespace

// Rows quantized to int8 blockwise (quantized.h), one client id per row.
int64_t checked_quantize_int8_rows(py::handle x, int64_t block, bool stochastic, uint64_t seed, uint64_t round,
                                   const std::vector<uint64_t>& clients, py::handle codes_out, py::handle scales_out) {
  const std::string pass = "quantize_int8_rows: ";
  const QuantizeViews q = quantize_views(pass, x, block, codes_out, scales_out);
  if (static_cast<int64_t>(clients.size()) != q.M)
    value_error(pass + str(q.M) + " rows but " + str(static_cast<int64_t>(clients.size())) + " client ids");
  if (round >= (uint64_t(1) << 32)) value_error(pass + "round must be below 2^32");
  std::vector<uint32_t> ids;
  for (uint64_t c : clients) {
    if (c >= (uint64_t(1) << 32)) value_error(pass + "client ids must be below 2^32");
    ids.push_back(static_cast<uint32_t>(c));
  }
  py::gil_scoped_release release;
  auto* codes = reinterpret_cast<int8_t*>(q.codes.data);
  auto* scales = reinterpret_cast<float*>(q.scales.data);
  const auto r = static_cast<uint32_t>(round);
  if (q.x.kind == kF32)
    return quantize_int8_rows<float>(reinterpret_cast<const float*>(q.x.data), q.M, q.d, block, stochastic, seed, r,
                                     ids.data(), codes, scales);
  return quantize_int8_rows<double>(reinterpret_cast<const double*>(q.x.data), q.M, q.d, block, stochastic, seed, r,
                                    ids.data(), codes, scales);
}

// Rows quantized to fp8 e4m3 blockwise (quantized.h).
int64_t checked_quantize_fp8_rows(py::handle x, int64_t block, py::handle codes_out, py::handle scales_out) {
  const QuantizeViews q = quantize_views("quantize_fp8_rows: ", x, block, codes_out, scales_out);
  py::gil_scoped_release release;
  auto* codes = reinterpret_cast<uint8_t*>(q.codes.data);
  auto* scales = reinterpret_cast<float*>(q.scales.data);
  if (q.x.kind == kF32)
    return quantize_fp8_rows<float>(reinterpret_cast<const float*>(q.x.data), q.M, q.d, block, codes, scales);
  return quantize_fp8_rows<double>(reinterpret_cast<const double*>(q.x.data), q.M, q.d, block, codes, scales);
}

// ---- robust passes ------------------------------------------------------------------------------------------

void checked_coord_select(py::handle rows, py::handle base, const std::vector<int64_t>& seg_lens, int rule,
                          int64_t first, int64_t count, py::handle out, py::handle sq_norms_out,
                          py::handle nonfinite_out) {
  const RowsArg r = rows_of(rows, base, seg_lens, "coord_select");
  if (rule == kSelectWindow) {
    // compared without forming first + count, which wraps in int64 for hostile values (undefined behaviour)
    if (count < 1 || count > r.M || first < 0 || first > r.M - count)
      value_error("coord_select: sorted positions from " + str(first) + " (count " + str(count) +
                  ") are not inside [0, " + str(r.M) + ")");
  } else if (rule == kSelectNearest) {
    if (count < 1 || count > r.M) value_error("coord_select: count " + str(count) + " is not in [1, " + str(r.M) + "]");
  } else {
    value_error("coord_select: unknown rule " + str(rule));
  }
  View o = view_of(out, "out", kAnyFloat);
  if (o.kind != kF32 && o.kind != kF64) type_error("out must be float32 or float64");
  o = flat_view(out, "out", o.kind, r.d);
  View sq = flat_view(sq_norms_out, "sq_norms_out", kF64, r.M);
  View bad = flat_view(nonfinite_out, "nonfinite_out", kBool, r.M);
  check_row_overlaps({&o, &sq, &bad}, r, {});
  SelectArgs a{};
  a.num_clients = r.M;
  a.num_segments = static_cast<int64_t>(seg_lens.size());
  a.dtype = r.T;
  a.out_dtype = o.kind;
  a.row_ptrs = r.ptrs.data();
  a.base_ptrs = r.base_ptrs.empty() ? nullptr : r.base_ptrs.data();
  a.seg_len = seg_lens.data();
  a.seg_off = r.seg_off.data();
  a.rule = rule;
  a.first = first;
  a.count = count;
  a.out = o.data;
  a.sq_norms_out = reinterpret_cast<double*>(sq.data);
  a.nonfinite_out = reinterpret_cast<uint8_t*>(bad.data);
  py::gil_scoped_release release;
  fastagg::coord_select(a);
}

void checked_gram(py::handle rows, py::handle base, const std::vector<int64_t>& seg_lens, py::handle gram_out,
                  py::handle nonfinite_out) {
  const RowsArg r = rows_of(rows, base, seg_lens, "gram");
  View g = flat_view(gram_out, "gram_out", kF64, r.M * r.M);
  View bad = flat_view(nonfinite_out, "nonfinite_out", kBool, r.M);
  check_row_overlaps({&g, &bad}, r, {});
  GramArgs a{};
  a.num_clients = r.M;
  a.num_segments = static_cast<int64_t>(seg_lens.size());
  a.dtype = r.T;
  a.row_ptrs = r.ptrs.data();
  a.base_ptrs = r.base_ptrs.empty() ? nullptr : r.base_ptrs.data();
  a.seg_len = seg_lens.data();
  a.gram_out = reinterpret_cast<double*>(g.data);
  a.nonfinite_out = reinterpret_cast<uint8_t*>(bad.data);
  py::gil_scoped_release release;
  fastagg::gram(a);
}

// ---- apply passes -------------------------------------------------------------------------------------------

struct Params {
  std::vector<View> views;
  std::vector<uint64_t> ptrs;
  std::vector<int64_t> lens, offs;
  int64_t numel = 0;
  int kind = 0;
};

Params params_of(py::handle list, const std::string& name, int want) {
  Params p;
  p.views = segment_views(list, name, want);
  p.kind = p.views[0].kind;
  for (const View& v : p.views) {
    p.ptrs.push_back(address(v, 0));
    p.offs.push_back(p.numel);
    p.lens.push_back(v.numel());
    p.numel += v.numel();
  }
  return p;
}

// The extra output (eval model / broadcast point): the params' dtype and segment lengths.
Params like_params_of(py::handle list, const Params& p, const std::string& name) {
  Params e = params_of(list, name, p.kind);
  if (e.lens != p.lens) value_error(name + "'s segments differ from the params'");
  return e;
}

void checked_momentum_apply(py::handle params, py::handle extra, py::handle mean, py::handle buf, py::handle lr,
                    py::handle extra_coef, py::handle extra_coef_skip, py::handle finite, double momentum,
                    bool nesterov, py::handle overflow, py::handle start, py::handle mean_scale) {
  Params p = params_of(params, "params", kAnyFloat);
  const int C = compute_kind(p.kind);
  Params e, st;
  if (!extra.is_none()) e = like_params_of(extra, p, "extra_out");
  if (!start.is_none()) st = like_params_of(start, p, "start");
  View m = flat_view(mean, "mean", C, p.numel);
  View b = buf.is_none() ? View{} : flat_view(buf, "momentum buffer", C, p.numel);
  View lr_v = flat_view(lr, "lr", kF64, 1);
  View coef = extra.is_none() ? View{} : flat_view(extra_coef, "extra_coef", kF64, 1);
  View coef_skip = extra_coef_skip.is_none() ? View{} : flat_view(extra_coef_skip, "extra_coef_skip", kF64, 1);
  View fin = flat_view(finite, "finite", kBool, 1);
  View over = flat_view(overflow, "overflow_out", kI32, 1);
  View scale = mean_scale.is_none() ? View{} : flat_view(mean_scale, "mean_scale", kF64, 1);
  std::vector<const View*> writes = pointers(p.views);
  for (const View& v : e.views) writes.push_back(&v);
  writes.push_back(&b);
  writes.push_back(&over);
  std::vector<const View*> reads{&m, &lr_v, &coef, &coef_skip, &fin, &scale};
  for (const View& v : st.views) reads.push_back(&v);
  check_overlaps(writes, reads);

  MomentumArgs a{};
  a.num_segments = static_cast<int64_t>(p.views.size());
  a.param_dtype = p.kind;
  a.compute_dtype = C;
  a.param_ptrs = p.ptrs.data();
  a.extra_ptrs = e.views.empty() ? nullptr : e.ptrs.data();
  a.start_ptrs = start.is_none() ? nullptr : st.ptrs.data();
  a.seg_len = p.lens.data();
  a.seg_off = p.offs.data();
  a.mean = m.data;
  a.mean_scale = reinterpret_cast<const double*>(scale.data);
  a.buf = b.data;
  a.lr = reinterpret_cast<const double*>(lr_v.data);
  a.extra_coef = reinterpret_cast<const double*>(coef.data);
  a.extra_coef_skip = reinterpret_cast<const double*>(coef_skip.data);
  a.finite = reinterpret_cast<const uint8_t*>(fin.data);
  a.momentum = momentum;
  a.nesterov = nesterov;
  a.overflow = reinterpret_cast<int32_t*>(over.data);
  py::gil_scoped_release release;
  fastagg::momentum_apply(a);
}

void checked_adam_apply(py::handle params, py::handle mean, py::handle m_buf, py::handle v_buf, py::handle vhat_buf,
                py::handle lr, py::handle finite, int rule, double beta1, double beta2, double tau, double ams_eps,
                py::handle overflow) {
  if (rule < kAdam || rule > kAms) value_error("adam_apply: unknown rule " + str(rule));
  Params p = params_of(params, "params", kAnyFloat);
  const int C = compute_kind(p.kind);
  View g = flat_view(mean, "mean", C, p.numel);
  if (m_buf.is_none() != (rule == kAdagrad)) value_error("adam_apply: the first moment is needed exactly when the "
                                                          "rule is not Adagrad");
  if (vhat_buf.is_none() != (rule != kAms)) value_error("adam_apply: vhat is needed exactly for AMS");
  View m = m_buf.is_none() ? View{} : flat_view(m_buf, "m", C, p.numel);
  View v = flat_view(v_buf, "v", C, p.numel);
  View vh = vhat_buf.is_none() ? View{} : flat_view(vhat_buf, "vhat", C, p.numel);
  View lr_v = flat_view(lr, "lr", kF64, 1);
  View fin = flat_view(finite, "finite", kBool, 1);
  View over = flat_view(overflow, "overflow_out", kI32, 1);
  std::vector<const View*> writes = pointers(p.views);
  for (const View* x : {&m, &v, &vh, &over}) writes.push_back(x);
  check_overlaps(writes, {&g, &lr_v, &fin});

  AdamArgs a{};
  a.num_segments = static_cast<int64_t>(p.views.size());
  a.param_dtype = p.kind;
  a.compute_dtype = C;
  a.param_ptrs = p.ptrs.data();
  a.seg_len = p.lens.data();
  a.seg_off = p.offs.data();
  a.mean = g.data;
  a.m = m.data;
  a.v = v.data;
  a.vhat = vh.data;
  a.lr = reinterpret_cast<const double*>(lr_v.data);
  a.finite = reinterpret_cast<const uint8_t*>(fin.data);
  a.rule = rule;
  a.beta1 = beta1;
  a.beta2 = beta2;
  a.tau = tau;
  a.ams_eps = ams_eps;
  a.overflow = reinterpret_cast<int32_t*>(over.data);
  py::gil_scoped_release release;
  fastagg::adam_apply(a);
}

// ---- local_step ---------------------------------------------------------------------------------------------

// Rows of a batch: (base [R, d] capsule, int64 index [M] capsule or None, shared). Row i is base row index[i]
// (row i without an index; row 0 for every i when shared).
struct Table {
  View base, index;
  std::vector<uint64_t> ptrs;
};

Table table_of(py::handle spec, const std::string& name, int kind, int64_t M, int64_t d, bool written) {
  Table t;
  if (spec.is_none()) return t;
  auto tup = spec.cast<py::tuple>();
  if (tup.size() != 3) type_error(name + " must be (base, index, shared)");
  t.base = view_of(tup[0], name, kind);
  const bool shared = tup[2].cast<bool>();
  if (t.base.shape.size() != 2) value_error(name + " must be 2-D [rows, d]");
  const int64_t R = t.base.shape[0];
  if (t.base.shape[1] != d) value_error(name + " has " + str(t.base.shape[1]) + " columns; expected " + str(d));
  if (d > 1 && t.base.strides[1] != 1) value_error(name + " must have unit stride along the parameters");
  const int64_t rs = t.base.strides[0];
  std::vector<int64_t> rows(M);
  if (shared) {
    if (written) value_error(name + " is written and cannot be one row shared by every client");
    if (R < 1 || !tup[1].is_none()) value_error(name + " (shared) must be one row and no index");
    std::fill(rows.begin(), rows.end(), 0);
  } else if (tup[1].is_none()) {
    if (R != M) value_error(name + " has " + str(R) + " rows; expected " + str(M));
    for (int64_t i = 0; i < M; ++i) rows[i] = i;
  } else {
    t.index = flat_view(tup[1], name + "'s client_ids", kI64, M);
    const auto* idx = reinterpret_cast<const int64_t*>(t.index.data);
    for (int64_t i = 0; i < M; ++i) {
      if (idx[i] < 0 || idx[i] >= R)
        value_error(name + ": client_ids[" + str(i) + "] = " + str(idx[i]) + " is outside [0, " + str(R) + ")");
      rows[i] = idx[i];
    }
  }
  if (written && M > 1) {
    std::vector<int64_t> sorted(rows);
    std::sort(sorted.begin(), sorted.end());
    if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end())
      value_error(name + " is written and two clients select the same row");
    if (d > 0 && (rs < 0 ? -rs : rs) < d) value_error(name + "'s rows overlap (row stride " + str(rs) + " < " +
                                                       str(d) + "); it is written");
  }
  t.ptrs.resize(M);
  for (int64_t i = 0; i < M; ++i) t.ptrs[i] = address(t.base, rows[i] * rs);
  return t;
}

PerRow per_row(py::handle v, const std::string& name, int64_t M, View& keep) {
  if (PyFloat_Check(v.ptr()) || PyLong_Check(v.ptr())) return PerRow{nullptr, v.cast<double>()};
  keep = flat_view(v, name, kF64, M);
  return PerRow{reinterpret_cast<const double*>(keep.data), 0.0};
}

void checked_local_step(int64_t M, int64_t d, py::handle x, py::handle g, py::handle anchor, py::handle control,
                py::handle ci, py::handle buf, py::handle lr, py::handle loss, py::handle l_star, py::handle sps_c,
                py::handle cap, py::handle first, double prox, double clip_norm, double weight_decay,
                double momentum, double eta2, double tiny, int rule, int mode, py::handle step_out) {
  if (M < 1 || d < 0) value_error("local_step needs at least one row");
  if (rule < kRuleFixed || rule > kRuleSps || mode < kModeNone || mode > kModeMass) value_error("unknown rule/mode");
  Table xs = table_of(x, "params", kAnyFloat, M, d, true);
  const int T = xs.base.kind, C = compute_kind(T);
  Table gs = table_of(g, "grads", T, M, d, false);
  Table as = table_of(anchor, "prox anchor", T, M, d, false);
  Table cis = table_of(ci, "control c_i", C, M, d, false);
  Table bs = table_of(buf, "client state", C, M, d, true);
  if (gs.ptrs.empty()) value_error("grads are required");
  if ((mode != kModeNone) != !bs.ptrs.empty()) value_error("client state is needed exactly with momentum or MaSS");
  if (!control.is_none() && cis.ptrs.empty()) value_error("control c needs control c_i");
  View ctl = control.is_none() ? View{} : flat_view(control, "control c", C, d);
  View keep[5];
  LocalArgs a{};
  a.lr = per_row(lr, "lr", M, keep[0]);
  a.loss = per_row(loss, "losses", M, keep[1]);
  a.l_star = per_row(l_star, "l_star", M, keep[2]);
  a.sps_c = per_row(sps_c, "c", M, keep[3]);
  a.cap = per_row(cap, "cap", M, keep[4]);
  View fst = first.is_none() ? View{} : flat_view(first, "first", kF64, M);
  View step = flat_view(step_out, "step_out", kF64, M);
  std::vector<const View*> reads = {&gs.base, &as.base, &cis.base, &ctl, &gs.index, &as.index, &cis.index,
                                    &xs.index, &bs.index, &fst};
  for (const View& k : keep) reads.push_back(&k);
  check_overlaps({&xs.base, &bs.base, &step}, reads);

  a.num_rows = M;
  a.numel = d;
  a.dtype = T;
  a.x_ptrs = xs.ptrs.data();
  a.g_ptrs = gs.ptrs.data();
  a.anchor_ptrs = as.ptrs.empty() ? nullptr : as.ptrs.data();
  a.control = ctl.data;
  a.ci_ptrs = cis.ptrs.empty() ? nullptr : cis.ptrs.data();
  a.buf_ptrs = bs.ptrs.empty() ? nullptr : bs.ptrs.data();
  a.first = reinterpret_cast<const double*>(fst.data);
  a.prox = prox;
  a.clip_norm = clip_norm;
  a.weight_decay = weight_decay;
  a.momentum = momentum;
  a.eta2 = eta2;
  a.tiny = tiny;
  a.rule = rule;
  a.mode = mode;
  a.step_out = reinterpret_cast<double*>(step.data);
  py::gil_scoped_release release;
  fastagg::local_step(a);
}

}  // namespace

#ifndef FASTAGG_MODULE
#define FASTAGG_MODULE _C
#endif

PYBIND11_MODULE(FASTAGG_MODULE, m) {
  m.doc() = "fastagg compiled CPU kernels (OpenMP). Use fastagg.ops, not this module.";
  m.def("round_stats", &checked_round_stats);
  m.def("gaussian_noise", &checked_gaussian_noise);
  m.def("philox4x32_10", &checked_philox);
  m.def("blockwise_fold", &checked_blockwise_fold);
  m.def("sparse_fold", &checked_sparse_fold);
  m.def("sparse_scan", &checked_sparse_scan);
  m.def("scale_scan", &checked_scale_scan);
  m.def("quantize_int8_rows", &checked_quantize_int8_rows);
  m.def("quantize_fp8_rows", &checked_quantize_fp8_rows);
  m.def("coord_select", &checked_coord_select);
  m.def("gram", &checked_gram);
  m.def("momentum_apply", &checked_momentum_apply);
  m.def("adam_apply", &checked_adam_apply);
  m.def("local_step", &checked_local_step);
  m.def("num_threads", []() {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
  });
  // The team-size policy (csrc/segments.h): threads a pass touching n bytes gets, and the bytes per thread
  m.def("threads_for", [](int64_t bytes) { return fastagg::threads_for(bytes); });
  m.def("bytes_per_thread", []() { return fastagg::bytes_per_thread(); });
  m.def("set_bytes_per_thread", [](int64_t bytes) {
    if (bytes < 1) value_error("set_bytes_per_thread: bytes must be >= 1, got " + str(bytes));
    fastagg::bytes_per_thread() = bytes;
  });
  m.attr("openmp") =
#ifdef _OPENMP
      true;
#else
      false;
#endif
}
