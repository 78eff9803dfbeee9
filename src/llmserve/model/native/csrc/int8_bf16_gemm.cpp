// int8 (per output channel) x bf16 matrix product for AVX512-BF16 CPUs: llmserve_native::int8_mm.
//
// Weight layout (packed once at load by llmserve.model.quant.native_int8.pack_int8):
//   strips of 16 output channels; per strip, K/2 vectors of 32 bytes, one per k pair:
//
//     vector j of strip s, byte 2c + t  =  q[16s + c][2j + t]        (c < 16, t < 2)
//
//   int8 codes are exact in bf16, so a vector converts to 16 (k, k+1) bf16 pairs: the operand
//   of vdpbf16ps against a broadcast activation pair. scale: (strips * 16,) bf16 per channel.
//
// A strip is converted once into a per-thread buffer (K x 16 bf16: 18 KB at K = 576, in L1),
// then every tile of up to 4 activation rows reads it; y = scale * (x . q), float32 sums,
// stored as bf16 or (float_out: an LM head's logits) float32.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "bf16_vec.h"
#include "int8_operands.h"
#include "pair_tiles.h"

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using llmserve_native::pair_strip_all_rows;
using llmserve_native::load_bf16x16;

constexpr int kStrip = 16;

// Prefetch distance of the int8 codes: a strip streams from memory (the LM head is larger
// than the caches) and its conversion alone does not cover the DRAM latency.
constexpr int64_t kPrefetchBytes = 2048;

void convert_strip(const int8_t* w, int64_t pairs, __m512bh* out) {
  for (int64_t j = 0; j < pairs; ++j) {
    if (j % 2 == 0)
      _mm_prefetch(reinterpret_cast<const char*>(w + 32 * j + kPrefetchBytes), _MM_HINT_T0);
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * j));
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1)));
    out[j] = _mm512_cvtne2ps_pbh(hi, lo);
  }
}

at::Tensor int8_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                   bool float_out) {
  const auto [rows, k, strips] = llmserve_native::check_int8_operands(
      "int8_mm", x, packed, scale, at::kChar, "int8",
      [](int64_t k) { return k % 2 == 0; }, "even");
  const int64_t n = strips * kStrip, pairs = k / 2;
  at::Tensor y = at::empty({rows, n}, x.options().dtype(float_out ? at::kFloat : at::kBFloat16));
  if (rows == 0 || n == 0) return y;
  const int8_t* wp = packed.data_ptr<int8_t>();
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scale.data_ptr());
  void* yp = y.data_ptr();
  at::parallel_for(0, strips, 1, [&](int64_t begin, int64_t end) {
    std::vector<__m512bh> buf(static_cast<size_t>(pairs));
    for (int64_t s = begin; s < end; ++s) {
      convert_strip(wp + s * k * kStrip, pairs, buf.data());
      const __m512 sc = load_bf16x16(sp + s * kStrip);
      pair_strip_all_rows(buf.data(), pairs, xp, rows, k, &sc, yp, s * kStrip, n, float_out);
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmserve_native, m) {
  m.def("int8_mm(Tensor x, Tensor packed, Tensor scale, bool float_out=False) -> Tensor");
  m.impl("int8_mm", c10::DispatchKey::CPU, TORCH_FN(int8_mm));
}
