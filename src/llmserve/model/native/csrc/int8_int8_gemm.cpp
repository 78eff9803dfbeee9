// int8 weights (per output channel) x int8 activations for AVX512-VNNI CPUs:
// llmserve_native::int8_a8_mm (the default model's LM head: its tied int8 table).
//
// Each activation row is quantized in blocks of 32 (int8_rows.h: s, codes c, sum(c)). The
// weight codes q (-128..127) are stored offset by 128 as unsigned bytes, vpdpbusd's
// unsigned operand, so per (row, block, channel)
//
//     dot = sum((q + 128) * c) - 128 * sum(c)         exact in int32
//     y  += s * dot                                   float32, one FMA per 8 vpdpbusd
//
// and at the end y *= scale[channel]. (The int4 product needs a multiply and two FMAs per
// block for its per-block weight scale and minimum: this one is ~1.3x its speed per k.)
//
// Weight layout (packed once at load by llmserve.model.quant.native_int8.pack_int8_a8):
//   strips of 16 output channels; per strip, K/4 quads of 64 bytes, one per 4 k's:
//
//     quad o of strip s, byte 4c + j  =  q[16s + c][4o + j] + 128        (c < 16, j < 4)
//
//   scale: (strips * 16,) bf16 per channel, as int8_mm's.
// Row tiles of up to 8 rows share each loaded quad; strips split over threads.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "bf16_vec.h"
#include "int8_operands.h"
#include "int8_rows.h"
#include "next_strip_prefetch.h"
#include "row_scratch.h"

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace {

using llmserve_native::broadcast4;
using llmserve_native::kQuantBlock;
using llmserve_native::load_bf16x16;

constexpr int kStrip = 16;
constexpr int kQuadBytes = 64;                       // 4 k's x 16 channels
constexpr int kQuadsPerBlock = kQuantBlock / 4;      // 8
constexpr int kMaxRows = 8;

// ROWS activation rows x one strip. Few rows keep two accumulator chains per row (even and
// odd quads) to hide vpdpbusd's latency. Tile ``t`` requests its share of the next strip
// (``next``, ``pf_lines`` per block: next_strip_prefetch.h).
template <int ROWS>
__attribute__((target("avx512vnni"))) void strip_rows(
    const uint8_t* w, __m512 scale, const int8_t* xq, int64_t ldx, const float* xs,
    const int32_t* xsum, int64_t blocks, void* y, int64_t ldy, bool float_out,
    const uint8_t* next, int64_t next_bytes, int64_t t, int64_t pf_lines) {
  constexpr bool kSplit = ROWS <= 3;
  __m512 out[ROWS];
  for (int r = 0; r < ROWS; ++r) out[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* wb = w + b * kQuadsPerBlock * kQuadBytes;
    llmserve_native::prefetch_share(next, next_bytes, t, blocks, b, pf_lines);
    __m512i acc[ROWS], acc2[ROWS];
    for (int r = 0; r < ROWS; ++r) acc[r] = acc2[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int o = 0; o < kQuadsPerBlock; ++o) {
      const __m512i v = _mm512_loadu_si512(wb + o * kQuadBytes);
      const int64_t k = b * kQuantBlock + 4 * o;
      for (int r = 0; r < ROWS; ++r) {
        const __m512i xr = broadcast4(xq + r * ldx + k);
        if (kSplit && (o & 1))
          acc2[r] = _mm512_dpbusd_epi32(acc2[r], v, xr);
        else
          acc[r] = _mm512_dpbusd_epi32(acc[r], v, xr);
      }
    }
    for (int r = 0; r < ROWS; ++r) {
      __m512i dot = acc[r];
      if constexpr (kSplit) dot = _mm512_add_epi32(dot, acc2[r]);
      dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(128 * xsum[r * blocks + b]));
      out[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(xs[r * blocks + b]),
                               out[r]);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    const __m512 v = _mm512_mul_ps(out[r], scale);
    if (float_out)
      _mm512_storeu_ps(static_cast<float*>(y) + r * ldy, v);
    else
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(y) + r * ldy),
                          (__m256i)_mm512_cvtneps_pbh(v));
  }
}

using StripFn = void (*)(const uint8_t*, __m512, const int8_t*, int64_t, const float*,
                         const int32_t*, int64_t, void*, int64_t, bool, const uint8_t*, int64_t,
                         int64_t, int64_t);

constexpr StripFn kStripFns[kMaxRows + 1] = {
    nullptr,         strip_rows<1>, strip_rows<2>, strip_rows<3>, strip_rows<4>,
    strip_rows<5>,   strip_rows<6>, strip_rows<7>, strip_rows<8>,
};

at::Tensor int8_a8_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                      bool float_out) {
  const auto [rows, k, strips] = llmserve_native::check_int8_operands(
      "int8_a8_mm", x, packed, scale, at::kByte, "uint8",
      [](int64_t k) { return k > 0 && k % kQuantBlock == 0; }, "a positive multiple of 32");
  const int64_t n = strips * kStrip, blocks = k / kQuantBlock;
  at::Tensor y = at::empty({rows, n}, x.options().dtype(float_out ? at::kFloat : at::kBFloat16));
  if (rows == 0 || n == 0) return y;
  int8_t* xq = llmserve_native::row_scratch<int8_t>(0, rows * k);
  float* xs = llmserve_native::row_scratch<float>(1, rows * blocks);
  int32_t* xsum = llmserve_native::row_scratch<int32_t>(2, rows * blocks);
  llmserve_native::quantize_rows(reinterpret_cast<const uint16_t*>(x.data_ptr()), rows, k, xq,
                                 xs, nullptr, xsum);
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scale.data_ptr());
  char* yp = static_cast<char*>(y.data_ptr());
  const int64_t out_bytes = float_out ? 4 : 2, strip_bytes = k * kStrip;
  const int64_t tiles = (rows + kMaxRows - 1) / kMaxRows;
  const int64_t pf_lines = llmserve_native::next_strip_lines(strip_bytes, tiles, blocks);
  at::parallel_for(0, strips, 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      const __m512 sc = load_bf16x16(sp + s * kStrip);
      const uint8_t* w = wp + s * strip_bytes;
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t r0 = t * kMaxRows;
        const int64_t tile = rows - r0 < kMaxRows ? rows - r0 : kMaxRows;
        kStripFns[tile](w, sc, xq + r0 * k, k, xs + r0 * blocks, xsum + r0 * blocks, blocks,
                        yp + (r0 * n + s * kStrip) * out_bytes, n, float_out, w + strip_bytes,
                        strip_bytes, t, s + 1 < end ? pf_lines : 0);
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmserve_native, m) {
  m.def("int8_a8_mm(Tensor x, Tensor packed, Tensor scale, bool float_out=False) -> Tensor");
  m.impl("int8_a8_mm", c10::DispatchKey::CPU, TORCH_FN(int8_a8_mm));
}
