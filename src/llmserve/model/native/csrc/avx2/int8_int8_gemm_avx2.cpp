// int8 weights (per output channel) x int8 activations on AVX2 + FMA:
// llmserve_avx2::int8_a8_mm, the avx2 tier's twin of ../int8_int8_gemm.cpp (same weight
// layout: codes stored as q + 128; same results).
//
// vpmaddubsw multiplies unsigned by signed bytes and saturates its int16 pair sums, so the
// offset codes cannot go in as they are (255 * 127 * 2 overflows). Each quad's 32 bytes are
// turned back into signed codes q (xor 0x80), and the products are formed as
// |q| * (x * sign(q)) (vpabsb, vpsignb): |q| <= 128 and |x| <= 127, so a pair is at most
// 32512 and exact; vpmaddwd widens each pair sum to int32 at once. The int32 block dot equals
// the AVX-512 kernel's sum((q + 128) * x) - 128 * sum(x), and the float32 epilogue is its own:
//
//     y += dot * s   per block;   y *= scale[channel] at the end
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "../int8_operands.h"
#include "vec_avx2.h"
#include "../row_scratch.h"

#include <immintrin.h>

#include <cstdint>

namespace {

using llmserve_avx2::broadcast4;
using llmserve_avx2::kQuantBlock;

constexpr int kStrip = 16;
constexpr int kQuadBytes = 64;                       // 4 k's x 16 channels
constexpr int kQuadsPerBlock = kQuantBlock / 4;      // 8
constexpr int kMaxRows = 4;

template <int ROWS>
void strip_rows(const uint8_t* w, const __m256* scale, const int8_t* xq, int64_t ldx,
                const float* xs, int64_t blocks, void* y, int64_t ldy, bool float_out) {
  const __m256i offset = _mm256_set1_epi8(static_cast<char>(0x80));
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 out[ROWS][2];
  for (int r = 0; r < ROWS; ++r) out[r][0] = out[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* wb = w + b * kQuadsPerBlock * kQuadBytes;
    __m256i acc[ROWS][2];
    for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int o = 0; o < kQuadsPerBlock; ++o) {
      const int64_t k = b * kQuantBlock + 4 * o;
      for (int h = 0; h < 2; ++h) {
        const __m256i q = _mm256_xor_si256(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + o * kQuadBytes + 32 * h)),
            offset);
        const __m256i aq = _mm256_abs_epi8(q);
        for (int r = 0; r < ROWS; ++r) {
          const __m256i sx = _mm256_sign_epi8(broadcast4(xq + r * ldx + k), q);
          acc[r][h] = _mm256_add_epi32(
              acc[r][h], _mm256_madd_epi16(_mm256_maddubs_epi16(aq, sx), ones));
        }
      }
    }
    for (int r = 0; r < ROWS; ++r) {
      const __m256 xsb = _mm256_set1_ps(xs[r * blocks + b]);
      for (int h = 0; h < 2; ++h)
        out[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][h]), xsb, out[r][h]);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    for (int h = 0; h < 2; ++h) {
      const __m256 v = _mm256_mul_ps(out[r][h], scale[h]);
      if (float_out)
        _mm256_storeu_ps(static_cast<float*>(y) + r * ldy + 8 * h, v);
      else
        llmserve_avx2::store_bf16x8(static_cast<uint16_t*>(y) + r * ldy + 8 * h, v);
    }
  }
}

using StripFn = void (*)(const uint8_t*, const __m256*, const int8_t*, int64_t, const float*,
                         int64_t, void*, int64_t, bool);

constexpr StripFn kStripFns[kMaxRows + 1] = {nullptr, strip_rows<1>, strip_rows<2>,
                                             strip_rows<3>, strip_rows<4>};

at::Tensor int8_a8_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                      bool float_out) {
  const auto [rows, k, strips] = llmserve_native::check_int8_operands(
      "int8_a8_mm (avx2)", x, packed, scale, at::kByte, "uint8",
      [](int64_t k) { return k > 0 && k % kQuantBlock == 0; }, "a positive multiple of 32");
  const int64_t n = strips * kStrip, blocks = k / kQuantBlock;
  at::Tensor y = at::empty({rows, n}, x.options().dtype(float_out ? at::kFloat : at::kBFloat16));
  if (rows == 0 || n == 0) return y;
  int8_t* xq = llmserve_native::row_scratch<int8_t>(0, rows * k);
  float* xs = llmserve_native::row_scratch<float>(1, rows * blocks);
  llmserve_avx2::quantize_rows(reinterpret_cast<const uint16_t*>(x.data_ptr()), rows, k, xq,
                               xs, nullptr);
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scale.data_ptr());
  char* yp = static_cast<char*>(y.data_ptr());
  const int64_t out_bytes = float_out ? 4 : 2, strip_bytes = k * kStrip;
  at::parallel_for(0, strips, 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      const __m256 sc[2] = {llmserve_avx2::load_bf16x8(sp + s * kStrip),
                            llmserve_avx2::load_bf16x8(sp + s * kStrip + 8)};
      for (int64_t r0 = 0; r0 < rows; r0 += kMaxRows) {
        const int64_t tile = rows - r0 < kMaxRows ? rows - r0 : kMaxRows;
        kStripFns[tile](wp + s * strip_bytes, sc, xq + r0 * k, k, xs + r0 * blocks, blocks,
                        yp + (r0 * n + s * kStrip) * out_bytes, n, float_out);
      }
    }
  });
  return y;
}

bool cpu_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmserve_avx2, m) {
  m.def("int8_a8_mm(Tensor x, Tensor packed, Tensor scale, bool float_out=False) -> Tensor");
  m.impl("int8_a8_mm", c10::DispatchKey::CPU, TORCH_FN(int8_a8_mm));
  m.def("cpu_supported() -> bool", &cpu_supported);
}
