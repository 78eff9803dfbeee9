// Small AVX-512 helpers shared by llmserve's native kernels (bf16 stored as uint16_t).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace llmserve_native {

// 16 bf16 values -> 16 floats (bf16 is the high half of a float32).
inline __m512 load_bf16x16(const uint16_t* p) {
  const __m512i w =
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

// 16 bf16 values already in a register -> 16 floats.
inline __m512 widen_bf16x16(__m256i v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// The first `n` lanes set (all 16 from n = 16 on): the tail of a row of bf16 or floats.
inline __mmask16 first_lanes16(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
}

// The lanes of `m` loaded from p as floats (the others 0; nothing read past them).
inline __m512 load_bf16x16_masked(const uint16_t* p, __mmask16 m) {
  return widen_bf16x16(_mm256_maskz_loadu_epi16(m, p));
}

// The bf16 pair (p[0], p[1]) broadcast to all 16 lanes: vdpbf16ps's activation operand.
inline __m512bh broadcast_pair(const uint16_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return (__m512bh)_mm512_set1_epi32(v);
}

}  // namespace llmserve_native
