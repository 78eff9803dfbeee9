// AVX2 + FMA + F16C building blocks of the avx2 tier's kernels (llmserve_avx2::*): the
// activation quantizer of ../int8_rows.h in 256-bit vectors, and bf16 / fp16 conversions.
//
// The quantizer's arithmetic is the AVX-512 one, operation for operation (max |x| of the
// block, 127 / max, x * inv rounded to nearest even, s = max / 127), so both tiers give every
// row the same int8 codes and scales; a row's codes never depend on its batch.
#pragma once

#include <ATen/Parallel.h>

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <limits>

namespace llmserve_avx2 {

constexpr int kQuantBlock = 32;        // activation quantization block (k's)
constexpr float kTinyBlock = 1e-30f;   // blocks with max|x| <= this are zeros

// 8 bf16 values -> float32.
inline __m256 load_bf16x8(const uint16_t* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

// 8 fp16 values -> float32.
inline __m256 load_fp16x8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// float32 -> 8 bf16, rounded to nearest even; a NaN stays a (quiet) NaN of its sign. The
// rounding of AVX512-BF16's vcvtneps2bf16 for normal numbers.
inline void store_bf16x8(uint16_t* p, __m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(0x40));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  const __m256i r = _mm256_blendv_epi8(rounded, quiet, nan);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0b1000);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

inline int32_t hsum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01001110));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10110001));
  return _mm_cvtsi128_si32(s);
}

// Rows of bf16 ``x (rows, k)`` -> int8 codes in blocks of 32, their scales and (when
// non-null) s * sum(codes) and sum(codes), as ../int8_rows.h's quantize_rows.
inline void quantize_rows(const uint16_t* x, int64_t rows, int64_t k, int8_t* codes,
                          float* scales, float* scaled_sums, int32_t* sums = nullptr) {
  const int64_t blocks = k / kQuantBlock;
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t b = 0; b < blocks; ++b) {
        const uint16_t* p = x + r * k + b * kQuantBlock;
        __m256 v[4];
        __m256 amax_v = _mm256_setzero_ps(), unord = _mm256_setzero_ps();
        for (int i = 0; i < 4; ++i) {
          v[i] = load_bf16x8(p + 8 * i);
          amax_v = _mm256_max_ps(amax_v, _mm256_and_ps(v[i], abs_mask));
          unord = _mm256_or_ps(unord, _mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q));
        }
        const float amax = hmax(amax_v);
        const bool nan = _mm256_movemask_ps(unord) != 0 ||
                         amax == std::numeric_limits<float>::infinity();
        const float inv = amax > kTinyBlock && !nan ? 127.0f / amax : 0.0f;
        const __m256 vinv = _mm256_set1_ps(inv);
        __m256i q[4], total = _mm256_setzero_si256();
        for (int i = 0; i < 4; ++i) {
          q[i] = nan ? _mm256_setzero_si256() : _mm256_cvtps_epi32(_mm256_mul_ps(v[i], vinv));
          total = _mm256_add_epi32(total, q[i]);
        }
        // int32 -> int8 (values within +-127): two saturating packs, then the lanes in order
        const __m256i bytes = _mm256_permutevar8x32_epi32(
            _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])),
            order);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + r * k + b * kQuantBlock), bytes);
        const int32_t sum = hsum(total);
        const float s = nan ? std::numeric_limits<float>::quiet_NaN() : amax / 127.0f;
        scales[r * blocks + b] = s;
        if (scaled_sums != nullptr) scaled_sums[r * blocks + b] = s * static_cast<float>(sum);
        if (sums != nullptr) sums[r * blocks + b] = sum;
      }
    }
  });
}

// Four int8 codes (k..k+3) in every 32-bit lane.
inline __m256i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm256_set1_epi32(v);
}

}  // namespace llmserve_avx2
