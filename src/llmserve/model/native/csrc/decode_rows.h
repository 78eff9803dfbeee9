// paged_decode's work split and context pulls (paged_decode.cpp): which keys a query row
// reads, how rows are split over the threads, and the loop that pulls a row's K or V rows
// into cache before they are scored or summed.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <vector>

namespace llmserve_native {

// Requests the K (or V) rows of keys [l0, l1) into L2 by software prefetches (HINT: T1 or
// T2; both land in L2 here). They retire at once, so a core has far more lines in flight
// than its load queue allows. Uses: before a pull's loads (below); the next query row's
// first keys when a row task starts (paged_decode.cpp); the V rows of a 16-key block while
// its K rows are scored (T1), so that the V pulls after the softmax find them: on cold
// caches (30 layers in turn, 32-64 rows x ~170 keys) 0.94-0.96x the call's time, the same
// bits; the pulls stay (without them the prefetched rows had not arrived: 1.1-1.2x).
// `width` elements (a multiple of 32: head sizes 64 and 128) from each row start: the
// row's heads that the task reads.
template <_mm_hint HINT>
inline void request_rows(const uint16_t* cache, const int64_t* slots, const bool* valid,
                         int64_t l0, int64_t l1, int64_t row_stride, int64_t width) {
  for (int64_t l = l0; l < l1; ++l) {
    if (!valid[l]) continue;
    const char* row = reinterpret_cast<const char*>(cache + slots[l] * row_stride);
    for (int64_t o = 0; o < width * 2; o += 64) _mm_prefetch(row + o, HINT);
  }
}

// Loads every 64-byte line of the K (or V) rows of keys [l0, l1) that a task reads, and drops
// them: a loop of independent loads keeps many cache misses in flight, where the scoring
// loops, dozens of instructions a key, stall on one block's misses at a time. Measured
// inside the engine at 32 sequences x ~160 keys: 144 against 246-268 us a call
// (docs/BENCHMARKS.md, "Attention that pulls its context"). The loads are preceded by
// requests to L2 for the same lines, so they find most of them in L2 or on their way (cold
// 32 x 176-key calls: 203-211 against 243-257 us; docs/BENCHMARKS.md, "Huge pages").
inline void pull_rows(const uint16_t* cache, const int64_t* slots, const bool* valid,
                      int64_t l0, int64_t l1, int64_t row_stride, int64_t width) {
  request_rows<_MM_HINT_T2>(cache, slots, valid, l0, l1, row_stride, width);
  __m512i x = _mm512_setzero_si512();
  for (int64_t l = l0; l < l1; ++l) {
    if (!valid[l]) continue;
    const uint16_t* row = cache + slots[l] * row_stride;
    for (int64_t o = 0; o < width; o += 32)
      x = _mm512_xor_si512(x, _mm512_loadu_si512(row + o));
  }
  volatile int64_t sink = _mm512_reduce_add_epi64(x);
  (void)sink;
}

// Keys pulled at a time: 128 keys of a (slots, 2, 64) or (slots, 8, 128) cache are 32-256 KB
// of K or V, within L2.
constexpr int64_t kPullKeys = 128;
// Keys of the next query row's K requested into L2 when a row task starts (paged_decode.cpp):
// they arrive while this row is scored and summed. Cold 32 / 64-row calls over 176 keys:
// 193-201 / 414-431 against 207-213 / 451-457 us without (K and V of the next row: no gain).
constexpr int64_t kNextRowKeys = 256;
static_assert(kPullKeys % 16 == 0, "a pull chunk is whole 16-key blocks");

// One past a row's last valid key (0: none), 64 flags at a time from the end: a row short
// of the call's longest is padded with invalid keys.
inline int64_t valid_length(const bool* row, int64_t len) {
  int64_t end = len;
  while (end >= 64) {
    const __m512i flags = _mm512_loadu_si512(row + end - 64);
    if (_mm512_test_epi8_mask(flags, flags)) break;
    end -= 64;
  }
  while (end > 0 && !row[end - 1]) --end;
  return end;
}

// Splits tasks [0, n) (task t: row t / per_row, of `keys[row]` keys) into `parts` contiguous
// ranges of about equal work, so that a batch whose older, longer rows come first, or a
// prompt's causal rows, do not leave one thread waiting for the other.
inline std::vector<int64_t> balanced_bounds(const std::vector<int64_t>& keys, int64_t n,
                                            int64_t per_row, int64_t parts) {
  std::vector<int64_t> cum(static_cast<size_t>(n + 1), 0);
  for (int64_t t = 0; t < n; ++t) cum[t + 1] = cum[t] + keys[t / per_row] + 16;
  std::vector<int64_t> bounds(static_cast<size_t>(parts + 1), n);
  bounds[0] = 0;
  int64_t t = 0;
  for (int64_t p = 1; p < parts; ++p) {
    const int64_t target = cum[n] * p / parts;
    while (t < n && cum[t] < target) ++t;
    bounds[p] = t;
  }
  return bounds;
}

}  // namespace llmserve_native
