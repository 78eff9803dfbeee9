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

// ROWS activation rows x one strip; NACC partial sums per row hide vdpbf16ps's latency when
// few rows give few independent chains. ``scale`` (per channel, or null) multiplies the sums.
template <int ROWS, int NACC>
void pair_strip_rows(const __m512bh* w, int64_t pairs, const uint16_t* x, int64_t ldx,
                     const __m512* scale, void* y, int64_t y0, int64_t ldy, bool float_out) {
  __m512 acc[ROWS][NACC];
  for (int r = 0; r < ROWS; ++r)
    for (int a = 0; a < NACC; ++a) acc[r][a] = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + NACC <= pairs; j += NACC)
    for (int a = 0; a < NACC; ++a) {
      // bf16_mm streams its weights from memory: with 2+ rows of products per vector the
      // hardware prefetcher falls behind, so fetch 32 vectors (2 KiB) ahead
      if constexpr (ROWS >= 2)
        _mm_prefetch(reinterpret_cast<const char*>(w + j + a + 32), _MM_HINT_T0);
      const __m512bh v = (__m512bh)_mm512_loadu_si512(w + j + a);
      for (int r = 0; r < ROWS; ++r)
        acc[r][a] = _mm512_dpbf16_ps(acc[r][a], v, broadcast_pair(x + r * ldx + 2 * (j + a)));
    }
  for (; j < pairs; ++j) {
    const __m512bh v = (__m512bh)_mm512_loadu_si512(w + j);
    for (int r = 0; r < ROWS; ++r)
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], v, broadcast_pair(x + r * ldx + 2 * j));
  }
  for (int r = 0; r < ROWS; ++r) {
    __m512 s = acc[r][0];
    for (int a = 1; a < NACC; ++a) s = _mm512_add_ps(s, acc[r][a]);
    store16(y, y0 + r * ldy, scale ? _mm512_mul_ps(s, *scale) : s, float_out);
  }
}

using PairRowsFn = void (*)(const __m512bh*, int64_t, const uint16_t*, int64_t, const __m512*,
                            void*, int64_t, int64_t, bool);

constexpr int kPairMaxRows = 8;

// pair_strip_rows for 1..8 rows (index = rows).
constexpr PairRowsFn kPairRows[kPairMaxRows + 1] = {
    nullptr,
    pair_strip_rows<1, 4>, pair_strip_rows<2, 4>, pair_strip_rows<3, 2>, pair_strip_rows<4, 2>,
    pair_strip_rows<5, 1>, pair_strip_rows<6, 1>, pair_strip_rows<7, 1>, pair_strip_rows<8, 1>,
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
