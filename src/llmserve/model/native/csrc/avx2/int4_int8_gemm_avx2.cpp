// int4 weights x int8 activations on AVX2 + FMA: llmserve_avx2::int4_a8_mm, the avx2 tier's
// twin of ../int4_int8_gemm.cpp (same weight layout, same operands, same results).
//
// Each 64-byte octet of the AVX-512 layout holds 16 channels x 8 k's; here its two 32-byte
// halves (channels 0-7 and 8-15 of the strip) are two vectors of 8 lanes x 4 codes. Without
// vpdpbusd the dot of 4 unsigned codes (0..15) with 4 int8 activation codes (-127..127) is
// vpmaddubsw (pairs -> int16, at most 2 * 15 * 127 = 3810, never saturated) then int16 adds;
// a block of 32 k's sums 8 such pairs per lane (at most 30480 < 32767), so the block's int16
// sums are widened once by vpmaddwd. The int32 block dot is exactly vpdpbusd's, and the
// float32 epilogue per block is the AVX-512 kernel's, operation for operation:
//
//     y += dot * (scale * s) ; y += min * (s * sum(x_code))        (two FMAs)
//
// so both tiers return the same bf16 bits for the same operands.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "../int4_operands.h"
#include "vec_avx2.h"
#include "../row_scratch.h"

#include <immintrin.h>

#include <cstdint>

namespace {

using llmserve_avx2::broadcast4;
constexpr int kStrip = 16;
constexpr int kOctetBytes = 64;
constexpr int kBlock = llmserve_avx2::kQuantBlock;
constexpr int kMaxRows = 4;        // 16 ymm registers: 4 rows x 2 halves of int16 sums

template <int ROWS>
void strip_rows(const uint8_t* w, const uint16_t* sm, const int8_t* xq, int64_t ldx,
                const float* xs, const float* xt, int64_t blocks, int64_t blocks_per_group,
                uint16_t* y, int64_t ldy) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 out[ROWS][2];
  for (int r = 0; r < ROWS; ++r) out[r][0] = out[r][1] = _mm256_setzero_ps();
  __m256 scale[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  __m256 min[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t b = 0; b < blocks; ++b) {
    if (b % blocks_per_group == 0) {
      const uint16_t* g = sm + b / blocks_per_group * 2 * kStrip;
      for (int h = 0; h < 2; ++h) {
        scale[h] = llmserve_avx2::load_fp16x8(g + 8 * h);
        min[h] = llmserve_avx2::load_fp16x8(g + kStrip + 8 * h);
      }
    }
    const uint8_t* wb = w + b * (kBlock / 8) * kOctetBytes;
    __m256i acc[ROWS][2];
    for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int o = 0; o < kBlock / 8; ++o) {
      const int64_t k = b * kBlock + 8 * o;
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(wb + o * kOctetBytes + 32 * h));
        const __m256i lo = _mm256_and_si256(v, low4);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        for (int r = 0; r < ROWS; ++r) {
          const int8_t* xr = xq + r * ldx + k;
          acc[r][h] = _mm256_add_epi16(acc[r][h], _mm256_maddubs_epi16(lo, broadcast4(xr)));
          acc[r][h] = _mm256_add_epi16(acc[r][h],
                                       _mm256_maddubs_epi16(hi, broadcast4(xr + 4)));
        }
      }
    }
    for (int r = 0; r < ROWS; ++r) {
      const __m256 xsb = _mm256_set1_ps(xs[r * blocks + b]);
      const __m256 xtb = _mm256_set1_ps(xt[r * blocks + b]);
      for (int h = 0; h < 2; ++h) {
        const __m256 f = _mm256_cvtepi32_ps(_mm256_madd_epi16(acc[r][h], ones));
        out[r][h] = _mm256_fmadd_ps(f, _mm256_mul_ps(scale[h], xsb), out[r][h]);
        out[r][h] = _mm256_fmadd_ps(min[h], xtb, out[r][h]);
      }
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int h = 0; h < 2; ++h) llmserve_avx2::store_bf16x8(y + r * ldy + 8 * h, out[r][h]);
}

using StripFn = void (*)(const uint8_t*, const uint16_t*, const int8_t*, int64_t, const float*,
                         const float*, int64_t, int64_t, uint16_t*, int64_t);

constexpr StripFn kStripFns[kMaxRows + 1] = {nullptr, strip_rows<1>, strip_rows<2>,
                                             strip_rows<3>, strip_rows<4>};

at::Tensor int4_a8_mm(const at::Tensor& x, const at::Tensor& packed,
                      const at::Tensor& scales_mins, int64_t group_size) {
  const auto [rows, k, strips, groups] = llmserve_native::check_int4_operands(
      "int4_a8_mm (avx2)", x, packed, scales_mins, group_size, kBlock, at::kHalf,
      "scales_mins must be contiguous fp16");
  const int64_t blocks = k / kBlock;
  const int64_t n = strips * kStrip;
  at::Tensor y = at::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return y;
  int8_t* xq = llmserve_native::row_scratch<int8_t>(0, rows * k);
  float* xs = llmserve_native::row_scratch<float>(1, 2 * rows * blocks);
  float* xt = xs + rows * blocks;
  llmserve_avx2::quantize_rows(reinterpret_cast<const uint16_t*>(x.data_ptr()), rows, k, xq,
                               xs, xt);
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const uint16_t* smp = reinterpret_cast<const uint16_t*>(scales_mins.data_ptr());
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const int64_t strip_bytes = k / 8 * kOctetBytes, blocks_per_group = group_size / kBlock;
  at::parallel_for(0, strips, 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      for (int64_t r0 = 0; r0 < rows; r0 += kMaxRows) {
        const int64_t tile = rows - r0 < kMaxRows ? rows - r0 : kMaxRows;
        kStripFns[tile](wp + s * strip_bytes, smp + s * groups * 2 * kStrip, xq + r0 * k, k,
                        xs + r0 * blocks, xt + r0 * blocks, blocks, blocks_per_group,
                        yp + r0 * n + s * kStrip, n);
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmserve_avx2, m) {
  m.def("int4_a8_mm(Tensor x, Tensor packed, Tensor scales_mins, int group_size) -> Tensor");
  m.impl("int4_a8_mm", c10::DispatchKey::CPU, TORCH_FN(int4_a8_mm));
}
