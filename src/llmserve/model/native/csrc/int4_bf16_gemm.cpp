// int4 x bf16 matrix product for AVX512-BF16 CPUs: llmserve_native::int4_mm.
//
// Weight layout (packed once at load by llmserve.model.quant.native_int4.pack_int4):
//   strips of 16 output channels; per strip, K/4 chunks of 32 bytes, one chunk per 4 k's:
//
//     chunk (strip s, k = 4j..4j+3), byte b = 2c + t (c: channel 16s + c, t: 0/1)
//         low nibble  = q[16s + c][4j + t]        -> word b of vector "lo": pair (k0, k1)
//         high nibble = q[16s + c][4j + 2 + t]    -> word b of vector "hi": pair (k2, k3)
//
//   so zero-extending the 32 bytes to 32 words gives, after a nibble lookup, two vectors of
//   16 (k, k+1) bf16 pairs: exactly the operand layout of vdpbf16ps against an activation pair
//   (x[k], x[k+1]) broadcast to every lane.
//   scales/zeros: (strips, groups, 2, 16) bf16: w = (q - 8) * scale + zero.
//
// Per group the codes (q - 8, exact in bf16) are dotted with the bf16 activations in fp32
// (vdpbf16ps products are exact), then  y += scale * dot + zero * sum(x over the group).
// Row tiles of up to 4 activations share each dequantized vector; strips split over threads.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "bf16_vec.h"
#include "int4_operands.h"
#include "pair_tiles.h"

#include <immintrin.h>

#include <cstdint>
#include <array>
#include <cstring>
#include <utility>
#include <vector>

namespace {

using llmserve_native::broadcast_pair;
using llmserve_native::load_bf16x16;

constexpr int kStrip = 16;      // output channels per strip (one fp32 zmm)
constexpr int kChunkBytes = 32; // 4 k's x 16 channels x 4 bits
constexpr int kMaxRows = 4;     // activation rows per tile (x 4 chains: 16 accumulators)
constexpr int64_t kPrefetchBytes = 2048;  // row tiles: prefetch distance of the codes,
constexpr int64_t kPrefetchGroups = 8;    // ... and of the scales (in groups)
// from here: expanded panels (int4_mm_panels); at 16-48 rows they take 0.83-0.94x the row
// tiles' time (each tile of 4 rows unpacks the codes again), at 8 rows the same
constexpr int64_t kPanelMinRows = 16;

struct CodeTable {
  alignas(64) uint16_t words[32];
  CodeTable() {
    for (int i = 0; i < 32; ++i) {
      float f = static_cast<float>((i & 15) - 8);
      uint32_t bits;
      std::memcpy(&bits, &f, sizeof(bits));
      words[i] = static_cast<uint16_t>(bits >> 16);  // small integers are exact in bf16
    }
  }
};
const CodeTable kCodes;

// The summation order of every row count (a row's bits never depend on its batch): within a
// group, pair j of (k, k+1) codes goes to partial sum j % 4, in j order (chunk c's "lo" pair
// is j = 2c, its "hi" pair 2c + 1); the group's dot is ((0 + 1) + 2) + 3, then
//     y += scale * dot + zero * sum(x over the group)
// group by group. The many-row panels below sum the same chains one after another. Four
// chains per row hide vdpbf16ps's latency at one row.
// (pair_tiles.h's rule: the same chains, the same final sum)
constexpr int kChains = llmserve_native::kPairChains;

// ROWS activation rows (up to 4: 16 accumulators) x one strip.
template <int ROWS>
void strip_rows(const uint8_t* w, const uint16_t* sz, const uint16_t* x, int64_t ldx,
                const float* xsum, int64_t groups, int64_t chunks_per_group, uint16_t* y,
                int64_t ldy) {
  const __m512i table = _mm512_load_si512(kCodes.words);
  __m512 out[ROWS];
  for (int r = 0; r < ROWS; ++r) out[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 acc[ROWS][kChains];
    for (int r = 0; r < ROWS; ++r)
      for (int a = 0; a < kChains; ++a) acc[r][a] = _mm512_setzero_ps();
    const uint8_t* wg = w + g * chunks_per_group * kChunkBytes;
    // the codes a few groups ahead: with 2+ rows of products per code the hardware
    // prefetcher falls behind; past the strip's end this touches the next strip, which
    // the thread most likely takes next (one row streams fine without it)
    if constexpr (ROWS >= 2) {
      for (int64_t off = 0; off < chunks_per_group * kChunkBytes; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(wg + kPrefetchBytes + off), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(sz + (g + kPrefetchGroups) * 2 * kStrip),
                   _MM_HINT_T0);
    }
    const int64_t k0 = g * chunks_per_group * 4;
    // chunks_per_group is even (the group is a multiple of 8): chunks c, c + 1 feed chains
    // 0, 1 and 2, 3
    for (int64_t c = 0; c < chunks_per_group; c += 2) {
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const __m512i bytes = _mm512_cvtepu8_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + (c + h) * kChunkBytes)));
        const __m512bh lo = (__m512bh)_mm512_permutexvar_epi16(bytes, table);
        const __m512bh hi = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(bytes, 4), table);
        const int64_t k = k0 + (c + h) * 4;
        for (int r = 0; r < ROWS; ++r) {
          const uint16_t* xr = x + r * ldx + k;
          acc[r][2 * h] = _mm512_dpbf16_ps(acc[r][2 * h], lo, broadcast_pair(xr));
          acc[r][2 * h + 1] = _mm512_dpbf16_ps(acc[r][2 * h + 1], hi, broadcast_pair(xr + 2));
        }
      }
    }
    const __m512 scale = load_bf16x16(sz + g * 2 * kStrip);
    const __m512 zero = load_bf16x16(sz + g * 2 * kStrip + kStrip);
    for (int r = 0; r < ROWS; ++r) {
      const __m512 dot = llmserve_native::sum_chains(acc[r]);
      out[r] = _mm512_fmadd_ps(dot, scale, out[r]);
      out[r] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[r * groups + g]), zero, out[r]);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    __m256bh v = _mm512_cvtneps_pbh(out[r]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy), (__m256i)v);
  }
}

using StripFn = void (*)(const uint8_t*, const uint16_t*, const uint16_t*, int64_t, const float*,
                         int64_t, int64_t, uint16_t*, int64_t);

constexpr StripFn kStripFns[kMaxRows + 1] = {
    nullptr,
    strip_rows<1>, strip_rows<2>, strip_rows<3>, strip_rows<4>,
};

// ---- many rows (decode batches, prefill chunks): codes of two strips expanded once ----
//
// From kPanelMinRows rows the codes (q - 8) of two strips are expanded to bf16 (exact) once
// into a per-thread buffer of (k, k+1) pair vectors, so tiles of 6 rows x 2 strips spend no
// work on dequantization; per group they still apply y += scale * dot + zero * sum(x), the
// same arithmetic and summation order as the row tiles above (bit for bit).
constexpr int kPanelRows = 4;   // 4 rows x 2 strips: outputs, dots, a chain's sums: 24 zmm

void expand_strip(const uint8_t* w, int64_t chunks, __m512bh* out) {
  const __m512i table = _mm512_load_si512(kCodes.words);
  for (int64_t c = 0; c < chunks; ++c) {
    const __m512i bytes = _mm512_cvtepu8_epi16(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * kChunkBytes)));
    out[2 * c] = (__m512bh)_mm512_permutexvar_epi16(bytes, table);
    out[2 * c + 1] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(bytes, 4), table);
  }
}

template <int ROWS, int STRIPS>
void panel_rows(const __m512bh* w, int64_t pairs, const uint16_t* const* sz, const uint16_t* x,
                int64_t ldx, const float* xsum, int64_t groups, int64_t pairs_per_group,
                uint16_t* y, int64_t ldy) {
  __m512 out[ROWS][STRIPS];
  for (int r = 0; r < ROWS; ++r)
    for (int t = 0; t < STRIPS; ++t) out[r][t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    // the row tiles' chains (pair j of the group in chain j % 4), one after another
    __m512 dot[ROWS][STRIPS];
    for (int a = 0; a < kChains; ++a) {
      __m512 acc[ROWS][STRIPS];
      for (int r = 0; r < ROWS; ++r)
        for (int t = 0; t < STRIPS; ++t) acc[r][t] = _mm512_setzero_ps();
      for (int64_t j = g * pairs_per_group + a; j < (g + 1) * pairs_per_group; j += kChains) {
        __m512bh wv[STRIPS];
        for (int t = 0; t < STRIPS; ++t) wv[t] = w[t * pairs + j];
        for (int r = 0; r < ROWS; ++r) {
          const __m512bh xb = broadcast_pair(x + r * ldx + 2 * j);
          for (int t = 0; t < STRIPS; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], wv[t], xb);
        }
      }
      for (int r = 0; r < ROWS; ++r)
        for (int t = 0; t < STRIPS; ++t)
          dot[r][t] = a == 0 ? acc[r][t] : _mm512_add_ps(dot[r][t], acc[r][t]);
    }
    for (int t = 0; t < STRIPS; ++t) {
      const __m512 scale = load_bf16x16(sz[t] + g * 2 * kStrip);
      const __m512 zero = load_bf16x16(sz[t] + g * 2 * kStrip + kStrip);
      for (int r = 0; r < ROWS; ++r) {
        out[r][t] = _mm512_fmadd_ps(dot[r][t], scale, out[r][t]);
        out[r][t] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[r * groups + g]), zero, out[r][t]);
      }
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int t = 0; t < STRIPS; ++t)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy + t * kStrip),
                          (__m256i)_mm512_cvtneps_pbh(out[r][t]));
}

using PanelFn = void (*)(const __m512bh*, int64_t, const uint16_t* const*, const uint16_t*,
                         int64_t, const float*, int64_t, int64_t, uint16_t*, int64_t);

template <int STRIPS, size_t... R>
constexpr std::array<PanelFn, sizeof...(R)> panel_table(std::index_sequence<R...>) {
  return {{(R == 0 ? nullptr : panel_rows<(R == 0 ? 1 : static_cast<int>(R)), STRIPS>)...}};
}

constexpr auto kPanel1 = panel_table<1>(std::make_index_sequence<kPanelRows + 1>{});
constexpr auto kPanel2 = panel_table<2>(std::make_index_sequence<kPanelRows + 1>{});

void int4_mm_panels(const uint16_t* xp, int64_t rows, int64_t k, const float* xsum,
                    const uint8_t* wp, const uint16_t* szp, int64_t strips, int64_t groups,
                    int64_t group_size, uint16_t* yp) {
  const int64_t n = strips * kStrip, pairs = k / 2, pairs_per_group = group_size / 2;
  const int64_t strip_bytes = k / 4 * kChunkBytes;
  at::parallel_for(0, (strips + 1) / 2, 1, [&](int64_t begin, int64_t end) {
    std::vector<__m512bh> buf(static_cast<size_t>(2 * pairs));
    for (int64_t p = begin; p < end; ++p) {
      const int64_t s0 = 2 * p, width = s0 + 1 < strips ? 2 : 1;
      const uint16_t* sz[2] = {szp + s0 * groups * 2 * kStrip,
                               szp + (s0 + width - 1) * groups * 2 * kStrip};
      for (int64_t t = 0; t < width; ++t)
        expand_strip(wp + (s0 + t) * strip_bytes, k / 4, buf.data() + t * pairs);
      const auto& table = width == 2 ? kPanel2 : kPanel1;
      for (int64_t r0 = 0; r0 < rows; r0 += kPanelRows) {
        const int64_t tile = rows - r0 < kPanelRows ? rows - r0 : kPanelRows;
        table[tile](buf.data(), pairs, sz, xp + r0 * k, k, xsum + r0 * groups, groups,
                    pairs_per_group, yp + r0 * n + s0 * kStrip, n);
      }
    }
  });
}

at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales_zeros,
                   int64_t group_size) {
  const auto [rows, k, strips, groups] = llmserve_native::check_int4_operands(
      "int4_mm", x, packed, scales_zeros, group_size, 8, at::kBFloat16,
      "scales_zeros must be contiguous bf16");
  const int64_t n = strips * kStrip;
  at::Tensor y = at::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return y;
  // sum of each row's activations over each group (the zeros' term)
  at::Tensor xsum_t = at::empty({rows, groups}, x.options().dtype(at::kFloat));
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  float* xsum = xsum_t.data_ptr<float>();
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t g = 0; g < groups; ++g) {
        const uint16_t* p = xp + r * k + g * group_size;
        __m512 s = _mm512_setzero_ps();
        for (int64_t i = 0; i < group_size; i += 16) s = _mm512_add_ps(s, load_bf16x16(p + i));
        xsum[r * groups + g] = _mm512_reduce_add_ps(s);
      }
    }
  });

  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const uint16_t* szp = reinterpret_cast<const uint16_t*>(scales_zeros.data_ptr());
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  if (rows >= kPanelMinRows) {
    int4_mm_panels(xp, rows, k, xsum, wp, szp, strips, groups, group_size, yp);
    return y;
  }
  const int64_t chunks_per_group = group_size / 4;
  const int64_t strip_bytes = k / 4 * kChunkBytes;
  at::parallel_for(0, strips, 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      for (int64_t r0 = 0; r0 < rows; r0 += kMaxRows) {
        const int64_t tile = rows - r0 < kMaxRows ? rows - r0 : kMaxRows;
        kStripFns[tile](wp + s * strip_bytes, szp + s * groups * 2 * kStrip, xp + r0 * k, k,
                        xsum + r0 * groups, groups, chunks_per_group, yp + r0 * n + s * kStrip, n);
      }
    }
  });
  return y;
}

bool cpu_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512bf16");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmserve_native, m) {
  m.def("int4_mm(Tensor x, Tensor packed, Tensor scales_zeros, int group_size) -> Tensor");
  m.impl("int4_mm", c10::DispatchKey::CPU, TORCH_FN(int4_mm));
  m.def("cpu_supported() -> bool", &cpu_supported);
}
