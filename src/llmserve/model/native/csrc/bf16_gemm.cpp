// Dense bf16 weights x bf16 activations for AVX512-BF16 CPUs: llmserve_native::bf16_mm.
//
// Weight layout (packed once at load by llmserve.model.layers.native_dense.pack_bf16):
//   strips of 16 output channels; per strip, K/2 vectors of 32 bf16, one per k pair:
//
//     vector j of strip s, word 2c + t  =  w[16s + c][2j + t]          (c < 16, t < 2)
//
//   which is vdpbf16ps's operand layout against a broadcast activation pair (x[2j], x[2j+1]).
// Up to 8 rows: tiles of up to 4 rows x one strip (a decode step is a chain of
// matrix-vector products: this reads the weights at ~0.9x the streaming bandwidth, oneDNN's
// packed matvec ~0.6x). More rows: tiles of 3 rows x 2 strips with the row tiles' four
// chains each (24 accumulators), summed in the row tiles' order, so a row's bits are the same
// at every row count.
// Outputs are bf16, or float32 with float_out (an LM head: no rounding of near-tied logits).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "bf16_vec.h"
#include "pair_tiles.h"

#include <immintrin.h>

#include <array>
#include <cstdint>
#include <utility>

namespace {

using llmserve_native::broadcast_pair;
using llmserve_native::kPairChains;
using llmserve_native::pair_strip_all_rows;
using llmserve_native::store16;

constexpr int kStrip = 16;
constexpr int kRowTileMax = 8;   // up to here: row tiles, then panels
constexpr int kPanelRows = 3;   // 3 rows x 2 strips x 4 chains: 24 accumulators

template <int ROWS, int STRIPS>
void panel_rows(const __m512bh* w, int64_t pairs, const uint16_t* x, int64_t ldx, void* y,
                int64_t y0, int64_t ldy, bool float_out) {
  // the row tiles' order (pair_tiles.h): pair j into chain j % 4, chains added in order
  __m512 acc[ROWS][STRIPS][kPairChains];
  for (int r = 0; r < ROWS; ++r)
    for (int t = 0; t < STRIPS; ++t)
      for (int a = 0; a < kPairChains; ++a) acc[r][t][a] = _mm512_setzero_ps();
  const auto step = [&](int64_t j, int a) {
    __m512bh wv[STRIPS];
    for (int t = 0; t < STRIPS; ++t) wv[t] = (__m512bh)_mm512_loadu_si512(w + t * pairs + j);
    for (int r = 0; r < ROWS; ++r) {
      const __m512bh xb = broadcast_pair(x + r * ldx + 2 * j);
      for (int t = 0; t < STRIPS; ++t) acc[r][t][a] = _mm512_dpbf16_ps(acc[r][t][a], wv[t], xb);
    }
  };
  int64_t j = 0;
  for (; j + kPairChains <= pairs; j += kPairChains)
    for (int a = 0; a < kPairChains; ++a) step(j + a, a);
  for (int a = 0; j < pairs; ++j, ++a) step(j, a);
  for (int r = 0; r < ROWS; ++r)
    for (int t = 0; t < STRIPS; ++t)
      store16(y, y0 + r * ldy + t * kStrip, llmserve_native::sum_chains(acc[r][t]), float_out);
}

using TileFn = void (*)(const __m512bh*, int64_t, const uint16_t*, int64_t, void*, int64_t,
                        int64_t, bool);

template <int STRIPS, size_t... R>
constexpr std::array<TileFn, sizeof...(R)> panel_table(std::index_sequence<R...>) {
  return {{(R == 0 ? nullptr : panel_rows<(R == 0 ? 1 : static_cast<int>(R)), STRIPS>)...}};
}

constexpr auto kPanel1 = panel_table<1>(std::make_index_sequence<kPanelRows + 1>{});
constexpr auto kPanel2 = panel_table<2>(std::make_index_sequence<kPanelRows + 1>{});

at::Tensor bf16_mm(const at::Tensor& x, const at::Tensor& packed, bool float_out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "bf16_mm: x must be a contiguous 2-D bf16 tensor");
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kBFloat16 &&
                  packed.is_contiguous(),
              "bf16_mm: packed must be a contiguous 2-D bf16 tensor");
  const int64_t rows = x.size(0), k = x.size(1), strips = packed.size(0);
  TORCH_CHECK(k % 2 == 0 && packed.size(1) == k * kStrip, "bf16_mm: packed weight is for K=",
              packed.size(1) / kStrip, ", x has K=", k, " (K must be even)");
  const int64_t n = strips * kStrip, pairs = k / 2;
  at::Tensor y = at::empty({rows, n}, x.options().dtype(float_out ? at::kFloat : at::kBFloat16));
  if (rows == 0 || n == 0) return y;
  const auto* wp = reinterpret_cast<const __m512bh*>(packed.data_ptr());
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  void* yp = y.data_ptr();
  if (rows <= kRowTileMax) {
    at::parallel_for(0, strips, 1, [&](int64_t begin, int64_t end) {
      for (int64_t s = begin; s < end; ++s)
        pair_strip_all_rows(wp + s * pairs, pairs, xp, rows, k, nullptr, yp, s * kStrip, n,
                            float_out);
    });
    return y;
  }
  at::parallel_for(0, (strips + 1) / 2, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t s0 = 2 * p;
      const auto& table = s0 + 1 < strips ? kPanel2 : kPanel1;
      for (int64_t r0 = 0; r0 < rows; r0 += kPanelRows) {
        const int64_t tile = rows - r0 < kPanelRows ? rows - r0 : kPanelRows;
        table[tile](wp + s0 * pairs, pairs, xp + r0 * k, k, yp, r0 * n + s0 * kStrip, n,
                    float_out);
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmserve_native, m) {
  m.def("bf16_mm(Tensor x, Tensor packed, bool float_out=False) -> Tensor");
  m.impl("bf16_mm", c10::DispatchKey::CPU, TORCH_FN(bf16_mm));
}
