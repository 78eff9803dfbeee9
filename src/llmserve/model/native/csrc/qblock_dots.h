// The int32 dots of one block of GGUF block codes with int8 activation codes, for
// qblock_a8_mm (qblock_int8_gemm.cpp has the weight layout): the exact integer part of
// its products, for tiles of rows over one strip or a pair of strips.
#pragma once

#include "int8_rows.h"

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace llmserve_native {

inline __mmask64 load_mask(const uint8_t* p) {
  uint64_t m;
  std::memcpy(&m, p, sizeof(m));
  return static_cast<__mmask64>(m);
}

// The codes of unit o (8 k's) of one strip's block of BITS-bit codes (4-6), as bytes: `lo`
// holds k's 8o..8o+3 of each channel, `hi` k's 8o+4..8o+7 (the 8-bit layout's quads 2o, 2o+1).
template <int BITS>
__attribute__((target("avx512vnni"))) inline void unpack_unit(const uint8_t* wb, int o,
                                                              __m512i& lo, __m512i& hi) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i v = _mm512_loadu_si512(wb + 64 * o);
  const uint8_t* planes = wb + 256;
  lo = _mm512_and_si512(v, low4);
  hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
  if constexpr (BITS >= 5) {
    lo = _mm512_mask_add_epi8(lo, load_mask(planes + 16 * o), lo, _mm512_set1_epi8(16));
    hi = _mm512_mask_add_epi8(hi, load_mask(planes + 16 * o + 8), hi, _mm512_set1_epi8(16));
  }
  if constexpr (BITS == 6) {
    lo = _mm512_mask_add_epi8(lo, load_mask(planes + 64 + 16 * o), lo, _mm512_set1_epi8(32));
    hi = _mm512_mask_add_epi8(hi, load_mask(planes + 64 + 16 * o + 8), hi,
                              _mm512_set1_epi8(32));
  }
}

// `blocks` blocks of one strip's BITS-bit codes (4-6) rewritten as bytes in the 8-bit
// layout (512 bytes a block), for products whose row tiles would otherwise unpack every
// block once per tile.
template <int BITS>
__attribute__((target("avx512vnni"))) inline void expand_blocks(const uint8_t* w,
                                                                int64_t blocks, uint8_t* out) {
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* wb = w + b * 64 * BITS;
    uint8_t* ob = out + b * 512;
#pragma GCC unroll 4
    for (int o = 0; o < 4; ++o) {
      __m512i lo, hi;
      unpack_unit<BITS>(wb, o, lo, hi);
      _mm512_storeu_si512(ob + 128 * o, lo);
      _mm512_storeu_si512(ob + 128 * o + 64, hi);
    }
  }
}

// The int32 dots of ROWS rows with units [U0, U1) of one block of NS strips (a unit: 4 k's
// of 8-bit codes, 8 k's of 4-6-bit ones), row r's sums starting from `scale * start[r *
// stride]` in every lane (a row's integer offset term) or, with no `start`, from zero. One
// strip of up to 3 rows runs two chains a row to hide vpdpbusd's latency; otherwise the
// (strip, row) pairs are the chains, and each broadcast of a row's codes feeds every strip.
// The int32 sums are exact: the chains, the start and the strips sharing a tile never change
// a result. The k16 mode calls this once per block half.
template <int BITS, int U0, int U1, int ROWS, int NS>
__attribute__((target("avx512vnni"))) inline void block_dots(const uint8_t* const (&wb)[NS],
                                                             const int8_t* xq, int64_t ldx,
                                                             int64_t k0,
                                                             __m512i (&acc)[NS][ROWS],
                                                             const int32_t* start = nullptr,
                                                             int64_t stride = 0,
                                                             int32_t scale = 0) {
  constexpr bool kTwoChains = NS == 1 && ROWS <= 3;
  __m512i acc2[NS][ROWS];
  for (int s = 0; s < NS; ++s)
    for (int r = 0; r < ROWS; ++r) {
      acc[s][r] = start == nullptr ? _mm512_setzero_si512()
                                   : _mm512_set1_epi32(scale * start[r * stride]);
      acc2[s][r] = _mm512_setzero_si512();
    }
  if constexpr (BITS == 8) {
#pragma GCC unroll 8
    for (int o = U0; o < U1; ++o) {
      __m512i v[NS];
      for (int s = 0; s < NS; ++s) v[s] = _mm512_loadu_si512(wb[s] + 64 * o);
      for (int r = 0; r < ROWS; ++r) {
        const __m512i xb = broadcast4(xq + r * ldx + k0 + 4 * o);
        for (int s = 0; s < NS; ++s) {
          __m512i& a = kTwoChains && (o & 1) ? acc2[s][r] : acc[s][r];
          a = _mm512_dpbusd_epi32(a, v[s], xb);
        }
      }
    }
  } else {
#pragma GCC unroll 4
    for (int o = U0; o < U1; ++o) {
      __m512i lo[NS], hi[NS];
      for (int s = 0; s < NS; ++s) unpack_unit<BITS>(wb[s], o, lo[s], hi[s]);
      for (int r = 0; r < ROWS; ++r) {
        const int8_t* xr = xq + r * ldx + k0 + 8 * o;
        const __m512i x_lo = broadcast4(xr), x_hi = broadcast4(xr + 4);
        for (int s = 0; s < NS; ++s) {
          acc[s][r] = _mm512_dpbusd_epi32(acc[s][r], lo[s], x_lo);
          __m512i& b = kTwoChains ? acc2[s][r] : acc[s][r];
          b = _mm512_dpbusd_epi32(b, hi[s], x_hi);
        }
      }
    }
  }
  if constexpr (kTwoChains)
    for (int s = 0; s < NS; ++s)
      for (int r = 0; r < ROWS; ++r) acc[s][r] = _mm512_add_epi32(acc[s][r], acc2[s][r]);
}

}  // namespace llmserve_native
