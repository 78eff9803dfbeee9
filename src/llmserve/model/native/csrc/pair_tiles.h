// Row tiles over weights in the pair layout (strips of 16 output channels, each as K/2
// vectors of 16 (k, k+1) bf16 pairs), shared by bf16_mm (the packed weight itself) and
// int8_mm (a strip converted to that layout in a per-thread buffer).
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "bf16_vec.h"

namespace llmserve_native {

// 16 float32 outputs stored as bf16, or as float32 (an LM head's logits).
inline void store16(void* y, int64_t index, __m512 v, bool float_out) {
  if (float_out) {
    _mm512_storeu_ps(static_cast<float*>(y) + index, v);
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(y) + index),
                        (__m256i)_mm512_cvtneps_pbh(v));
  }
}

// The summation order every pair-layout product uses, whatever its row count (a row's bits
// never depend on its batch): pair j of a strip is added to partial sum j % kPairChains of
// its row, in j order, and the partial sums are added ((0 + 1) + 2) + 3 at the end. Four
// chains hide vdpbf16ps's latency at one row; the many-row panels of bf16_mm keep the same
// four chains per row and strip (bf16_gemm.cpp).
constexpr int kPairChains = 4;

// ((acc[0] + acc[1]) + acc[2]) + acc[3]
inline __m512 sum_chains(const __m512* acc) {
  __m512 s = acc[0];
  for (int a = 1; a < kPairChains; ++a) s = _mm512_add_ps(s, acc[a]);
  return s;
}

// ROWS activation rows x one strip. ``scale`` (per channel, or null) multiplies the sums.
template <int ROWS>
void pair_strip_rows(const __m512bh* w, int64_t pairs, const uint16_t* x, int64_t ldx,
                     const __m512* scale, void* y, int64_t y0, int64_t ldy, bool float_out) {
  __m512 acc[ROWS][kPairChains];
  for (int r = 0; r < ROWS; ++r)
    for (int a = 0; a < kPairChains; ++a) acc[r][a] = _mm512_setzero_ps();
  const auto step = [&](int64_t j, int a) {
    // bf16_mm streams its weights from memory: with 2+ rows of products per vector the
    // hardware prefetcher falls behind, so fetch 32 vectors (2 KiB) ahead
    if constexpr (ROWS >= 2)
      _mm_prefetch(reinterpret_cast<const char*>(w + j + 32), _MM_HINT_T0);
    const __m512bh v = (__m512bh)_mm512_loadu_si512(w + j);
    for (int r = 0; r < ROWS; ++r)
      acc[r][a] = _mm512_dpbf16_ps(acc[r][a], v, broadcast_pair(x + r * ldx + 2 * j));
  };
  int64_t j = 0;
  for (; j + kPairChains <= pairs; j += kPairChains)
    for (int a = 0; a < kPairChains; ++a) step(j + a, a);
  for (int a = 0; j < pairs; ++j, ++a) step(j, a);   // the last pairs: chain j % 4
  for (int r = 0; r < ROWS; ++r) {
    const __m512 s = sum_chains(acc[r]);
    store16(y, y0 + r * ldy, scale ? _mm512_mul_ps(s, *scale) : s, float_out);
  }
}

using PairRowsFn = void (*)(const __m512bh*, int64_t, const uint16_t*, int64_t, const __m512*,
                            void*, int64_t, int64_t, bool);

// rows per tile: 4 rows x 4 chains = 16 float32 accumulators
constexpr int kPairMaxRows = 4;

// pair_strip_rows for 1..4 rows (index = rows).
constexpr PairRowsFn kPairRows[kPairMaxRows + 1] = {
    nullptr, pair_strip_rows<1>, pair_strip_rows<2>, pair_strip_rows<3>, pair_strip_rows<4>,
};

// All ``rows`` rows of x (leading dimension ldx) against one strip, in tiles of up to
// kPairMaxRows rows; the strip's outputs start at column ``col`` of y (leading dim ldy).
inline void pair_strip_all_rows(const __m512bh* w, int64_t pairs, const uint16_t* x, int64_t rows,
                                int64_t ldx, const __m512* scale, void* y, int64_t col,
                                int64_t ldy, bool float_out) {
  for (int64_t r0 = 0; r0 < rows; r0 += kPairMaxRows) {
    const int64_t tile = rows - r0 < kPairMaxRows ? rows - r0 : kPairMaxRows;
    kPairRows[tile](w, pairs, x + r0 * ldx, ldx, scale, y, r0 * ldy + col, ldy, float_out);
  }
}

}  // namespace llmserve_native
