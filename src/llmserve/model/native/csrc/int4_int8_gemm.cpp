// int4 weights x int8 activations for AVX512-VNNI CPUs: llmserve_native::int4_a8_mm.
//
// The arithmetic of llama.cpp's Q4_1 x Q8_1 dot products: each activation row is quantized
// in blocks of 32 (symmetric, s = max|x| / 127, q = round(x / s)), the 4-bit codes (0..15)
// are dotted with the int8 codes exactly in int32 by vpdpbusd (unsigned x signed bytes,
// 64 products per instruction, twice vdpbf16ps's 32), and per block
//
//     y += (scale * s) * sum(w_code * x_code) + min * (s * sum(x_code))
//
// in float32, where w = w_code * scale + min (min = zero - 8 * scale of the bf16 kernel's
// layout). Rows are quantized independently, so a row's result never depends on its batch.
//
// Weight layout (packed once at load by llmserve.model.quant.native_int4.pack_int4_a8):
//   strips of 16 output channels; per strip, K/8 octets of 64 bytes, one octet per 8 k's:
//
//     octet o, byte 4c + j (c: channel 16s + c, j < 4)
//         low nibble  = q[16s + c][8o + j]       -> lane c of vector "lo": k = 8o .. 8o+3
//         high nibble = q[16s + c][8o + 4 + j]   -> lane c of vector "hi": k = 8o+4 .. 8o+7
//
//   so masking / shifting the 64 bytes gives two vectors of 16 lanes x 4 codes: vpdpbusd's
//   unsigned operand against 4 activation codes broadcast to every lane.
//   scales_mins: (strips, K/group, 2, 16) fp16 (a Q4_1 file's d and m exactly).
// One row: strips split over threads, a strip at a time. More rows: pairs of strips split
// over threads, tiles of up to 6 rows sharing each unpacked vector and each broadcast.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "int4_operands.h"
#include "int8_rows.h"
#include "row_scratch.h"

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace {

using llmserve_native::broadcast4;
constexpr int kStrip = 16;         // output channels per strip (one fp32 zmm)
constexpr int kOctetBytes = 64;    // 8 k's x 16 channels x 4 bits
constexpr int kBlock = llmserve_native::kQuantBlock;   // activation quantization block
constexpr int kMaxRows = 8;        // activation rows per tile
constexpr int64_t kPrefetchBytes = 1024;

inline __m512 load_fp16x16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// ROWS activation rows x one strip. With few rows the low and high nibbles accumulate
// separately (two chains per row) to hide vpdpbusd's latency.
// vpdpbusd needs AVX512-VNNI: enabled for these functions only (the library's other
// kernels need AVX512-BF16 alone); a8_supported() gates every call.
template <int ROWS>
__attribute__((target("avx512vnni"))) void strip_rows(
    const uint8_t* w, const uint16_t* sm, const int8_t* xq, int64_t ldx, const float* xs,
    const float* xt, int64_t blocks, int64_t blocks_per_group, uint16_t* y, int64_t ldy) {
  constexpr bool kSplit = ROWS <= 3;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 out[ROWS];
  for (int r = 0; r < ROWS; ++r) out[r] = _mm512_setzero_ps();
  __m512 scale = _mm512_setzero_ps(), min = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    if (b % blocks_per_group == 0) {
      const int64_t g = b / blocks_per_group;
      scale = load_fp16x16(sm + g * 2 * kStrip);
      min = load_fp16x16(sm + g * 2 * kStrip + kStrip);
    }
    const uint8_t* wb = w + b * (kBlock / 8) * kOctetBytes;
    if constexpr (ROWS >= 2) {
      for (int off = 0; off < (kBlock / 8) * kOctetBytes; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(wb + kPrefetchBytes + off), _MM_HINT_T0);
    }
    __m512i acc[ROWS], acc2[ROWS];
    for (int r = 0; r < ROWS; ++r) acc[r] = acc2[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int o = 0; o < kBlock / 8; ++o) {
      const __m512i v = _mm512_loadu_si512(wb + o * kOctetBytes);
      const __m512i lo = _mm512_and_si512(v, low4);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      const int64_t k = b * kBlock + 8 * o;
      for (int r = 0; r < ROWS; ++r) {
        const int8_t* xr = xq + r * ldx + k;
        acc[r] = _mm512_dpbusd_epi32(acc[r], lo, broadcast4(xr));
        if constexpr (kSplit)
          acc2[r] = _mm512_dpbusd_epi32(acc2[r], hi, broadcast4(xr + 4));
        else
          acc[r] = _mm512_dpbusd_epi32(acc[r], hi, broadcast4(xr + 4));
      }
    }
    for (int r = 0; r < ROWS; ++r) {
      __m512i dot = acc[r];
      if constexpr (kSplit) dot = _mm512_add_epi32(dot, acc2[r]);
      const __m512 f = _mm512_cvtepi32_ps(dot);
      out[r] = _mm512_fmadd_ps(f, _mm512_mul_ps(scale, _mm512_set1_ps(xs[r * blocks + b])),
                               out[r]);
      out[r] = _mm512_fmadd_ps(min, _mm512_set1_ps(xt[r * blocks + b]), out[r]);
    }
  }
  for (int r = 0; r < ROWS; ++r)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy),
                        (__m256i)_mm512_cvtneps_pbh(out[r]));
}

using StripFn = void (*)(const uint8_t*, const uint16_t*, const int8_t*, int64_t, const float*,
                         const float*, int64_t, int64_t, uint16_t*, int64_t);

constexpr StripFn kStripFns[kMaxRows + 1] = {
    nullptr,         strip_rows<1>, strip_rows<2>, strip_rows<3>, strip_rows<4>,
    strip_rows<5>,   strip_rows<6>, strip_rows<7>, strip_rows<8>,
};

constexpr int kPairRows = 6;       // activation rows per tile of a strip pair

// ROWS activation rows x two adjacent strips (32 channels): each broadcast of 4 activation
// codes feeds both strips, and the 2 * ROWS accumulator chains keep vpdpbusd's two pipes
// busy: 1.2x the one-strip tiles of 8 rows on one core, hot, at 8-48 rows.
// Per row, channel and block the operations and their order are strip_rows's, so a row's
// output has the same bits whichever kernel computed it.
template <int ROWS>
__attribute__((target("avx512vnni"))) void strip_pair_rows(
    const uint8_t* w, const uint16_t* sm, const int8_t* xq, int64_t ldx, const float* xs,
    const float* xt, int64_t blocks, int64_t blocks_per_group, uint16_t* y, int64_t ldy,
    int64_t strip_bytes, int64_t group_stride) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 out[2][ROWS];
  for (int s = 0; s < 2; ++s)
    for (int r = 0; r < ROWS; ++r) out[s][r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t g = b / blocks_per_group;
    const uint8_t* wb[2] = {w + b * (kBlock / 8) * kOctetBytes,
                            w + strip_bytes + b * (kBlock / 8) * kOctetBytes};
    for (int s = 0; s < 2; ++s)
      for (int off = 0; off < (kBlock / 8) * kOctetBytes; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(wb[s] + kPrefetchBytes + off), _MM_HINT_T0);
    __m512i acc[2][ROWS];
    for (int s = 0; s < 2; ++s)
      for (int r = 0; r < ROWS; ++r) acc[s][r] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int o = 0; o < kBlock / 8; ++o) {
      __m512i lo[2], hi[2];
      for (int s = 0; s < 2; ++s) {
        const __m512i v = _mm512_loadu_si512(wb[s] + o * kOctetBytes);
        lo[s] = _mm512_and_si512(v, low4);
        hi[s] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      }
      const int64_t k = b * kBlock + 8 * o;
      for (int r = 0; r < ROWS; ++r) {
        const int8_t* xr = xq + r * ldx + k;
        const __m512i x_lo = broadcast4(xr), x_hi = broadcast4(xr + 4);
        for (int s = 0; s < 2; ++s) {
          acc[s][r] = _mm512_dpbusd_epi32(acc[s][r], lo[s], x_lo);
          acc[s][r] = _mm512_dpbusd_epi32(acc[s][r], hi[s], x_hi);
        }
      }
    }
    for (int s = 0; s < 2; ++s) {
      const uint16_t* gsm = sm + s * group_stride + g * 2 * kStrip;
      const __m512 scale = load_fp16x16(gsm), min = load_fp16x16(gsm + kStrip);
      for (int r = 0; r < ROWS; ++r) {
        const __m512 f = _mm512_cvtepi32_ps(acc[s][r]);
        out[s][r] = _mm512_fmadd_ps(
            f, _mm512_mul_ps(scale, _mm512_set1_ps(xs[r * blocks + b])), out[s][r]);
        out[s][r] = _mm512_fmadd_ps(min, _mm512_set1_ps(xt[r * blocks + b]), out[s][r]);
      }
    }
  }
  for (int s = 0; s < 2; ++s)
    for (int r = 0; r < ROWS; ++r)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy + s * kStrip),
                          (__m256i)_mm512_cvtneps_pbh(out[s][r]));
}

using PairFn = void (*)(const uint8_t*, const uint16_t*, const int8_t*, int64_t, const float*,
                        const float*, int64_t, int64_t, uint16_t*, int64_t, int64_t, int64_t);

constexpr PairFn kPairFns[kPairRows + 1] = {
    nullptr,           strip_pair_rows<1>, strip_pair_rows<2>, strip_pair_rows<3>,
    strip_pair_rows<4>, strip_pair_rows<5>, strip_pair_rows<6>,
};

at::Tensor int4_a8_mm(const at::Tensor& x, const at::Tensor& packed,
                      const at::Tensor& scales_mins, int64_t group_size) {
  const auto [rows, k, strips, groups] = llmserve_native::check_int4_operands(
      "int4_a8_mm", x, packed, scales_mins, group_size, kBlock, at::kHalf,
      "scales_mins must be contiguous fp16");
  const int64_t blocks = k / kBlock;
  const int64_t n = strips * kStrip;
  at::Tensor y = at::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return y;
  int8_t* xq = llmserve_native::row_scratch<int8_t>(0, rows * k);
  float* xs = llmserve_native::row_scratch<float>(1, 2 * rows * blocks);
  float* xt = xs + rows * blocks;
  llmserve_native::quantize_rows(reinterpret_cast<const uint16_t*>(x.data_ptr()), rows, k, xq,
                                 xs, xt);

  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const uint16_t* smp = reinterpret_cast<const uint16_t*>(scales_mins.data_ptr());
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const int64_t strip_bytes = k / 8 * kOctetBytes, blocks_per_group = group_size / kBlock;
  const int64_t group_stride = groups * 2 * kStrip;
  auto one_strip = [&](int64_t s) {
    for (int64_t r0 = 0; r0 < rows; r0 += kMaxRows) {
      const int64_t tile = rows - r0 < kMaxRows ? rows - r0 : kMaxRows;
      kStripFns[tile](wp + s * strip_bytes, smp + s * group_stride, xq + r0 * k, k,
                      xs + r0 * blocks, xt + r0 * blocks, blocks, blocks_per_group,
                      yp + r0 * n + s * kStrip, n);
    }
  };
  if (rows == 1) {   // one row streams its weights: a strip at a time, as measured best
    at::parallel_for(0, strips, 1, [&](int64_t begin, int64_t end) {
      for (int64_t s = begin; s < end; ++s) one_strip(s);
    });
    return y;
  }
  // strip pairs over threads, rows in tiles of kPairRows; an odd last strip alone
  at::parallel_for(0, (strips + 1) / 2, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t s = 2 * p;
      if (s + 1 == strips) {
        one_strip(s);
        continue;
      }
      for (int64_t r0 = 0; r0 < rows; r0 += kPairRows) {
        const int64_t tile = rows - r0 < kPairRows ? rows - r0 : kPairRows;
        kPairFns[tile](wp + s * strip_bytes, smp + s * group_stride, xq + r0 * k, k,
                       xs + r0 * blocks, xt + r0 * blocks, blocks, blocks_per_group,
                       yp + r0 * n + s * kStrip, n, strip_bytes, group_stride);
      }
    }
  });
  return y;
}

bool a8_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vnni");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmserve_native, m) {
  m.def("int4_a8_mm(Tensor x, Tensor packed, Tensor scales_mins, int group_size) -> Tensor");
  m.impl("int4_a8_mm", c10::DispatchKey::CPU, TORCH_FN(int4_a8_mm));
  m.def("a8_supported() -> bool", &a8_supported);
}
