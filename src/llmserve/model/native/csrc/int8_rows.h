// Activation rows -> int8 codes in blocks of 32, shared by the int8-activation products
// (int4_a8_mm, int8_a8_mm): llama.cpp's Q8 arithmetic. Also the broadcast of 4 codes that
// both kernels feed to vpdpbusd.
//
//   per (row, block of 32 k's):  s = max|x| / 127,  code = round_half_even(x / s)
//
// stored as codes (rows, K) int8, scales[r, b] = s and, when asked (non-null),
// scaled_sums[r, b] = s * sum(codes), sums[r, b] = sum(codes) and half_sums[r, b, h] = the sum
// of codes 16h .. 16h + 15 of the block. A NaN or an infinity makes the block's scale NaN and
// its codes 0, so every output it feeds is NaN (an int8 code cannot stand for either); a block
// with max|x| <= 1e-30 quantizes to zeros (127 / max|x| would overflow). Rows are independent: a row's codes never depend on its batch.
#pragma once

#include <ATen/Parallel.h>

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <limits>

namespace llmserve_native {

constexpr int kQuantBlock = 32;        // activation quantization block (k's)
constexpr float kTinyBlock = 1e-30f;   // blocks with max|x| <= this are zeros

inline void quantize_rows(const uint16_t* x, int64_t rows, int64_t k, int8_t* codes,
                          float* scales, float* scaled_sums, int32_t* sums = nullptr,
                          int32_t* half_sums = nullptr) {
  const int64_t blocks = k / kQuantBlock;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t b = 0; b < blocks; ++b) {
        const uint16_t* p = x + r * k + b * kQuantBlock;
        __m512 v[2];
        for (int h = 0; h < 2; ++h) {
          const __m512i w = _mm512_cvtepu16_epi32(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 * h)));
          v[h] = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
        }
        const float amax = _mm512_reduce_max_ps(
            _mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
        // NaN or inf: no int8 code stands for it; the block's scale is NaN, its codes 0
        const bool nan = (_mm512_cmp_ps_mask(v[0], v[0], _CMP_UNORD_Q) |
                          _mm512_cmp_ps_mask(v[1], v[1], _CMP_UNORD_Q)) != 0 ||
                         amax == std::numeric_limits<float>::infinity();
        const float inv = amax > kTinyBlock && !nan ? 127.0f / amax : 0.0f;
        const __m512 vinv = _mm512_set1_ps(inv);
        int32_t sum = 0;
        for (int h = 0; h < 2; ++h) {
          // round to nearest even (the MXCSR default), as torch.round
          const __m512i q = nan ? _mm512_setzero_si512()
                                : _mm512_cvtps_epi32(_mm512_mul_ps(v[h], vinv));
          const int32_t half = _mm512_reduce_add_epi32(q);
          sum += half;
          if (half_sums != nullptr) half_sums[(r * blocks + b) * 2 + h] = half;
          _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + r * k + b * kQuantBlock + 16 * h),
                           _mm512_cvtsepi32_epi8(q));
        }
        const float s = nan ? std::numeric_limits<float>::quiet_NaN() : amax / 127.0f;
        scales[r * blocks + b] = s;
        if (scaled_sums != nullptr) scaled_sums[r * blocks + b] = s * static_cast<float>(sum);
        if (sums != nullptr) sums[r * blocks + b] = sum;
      }
    }
  });
}

// Four int8 codes (k..k+3) in every 32-bit lane: vpdpbusd's signed operand.
inline __m512i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm512_set1_epi32(v);
}

}  // namespace llmserve_native
