// GGUF block-quantized weights (Q8_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) x int8 activations for
// AVX512-VNNI CPUs: llmserve_native::qblock_a8_mm (and qblock_rows, qblock_rows.h).
//
// The weights keep their file's codes and scales (an exact re-layout, no second rounding);
// each activation row is quantized in blocks of 32 (int8_rows.h), and per (row, block of 32
// k's, channel) the unsigned weight codes u are dotted with the activation codes c exactly in
// int32 by vpdpbusd. Three scale modes, each what its GGUF type stores:
//
//   mode 0 (f16, Q5_1)                 w = scale * u + min          fp16 scale, min per block
//        y += (scale * s) * dot + min * (s * sum(c))
//   mode 3 (f16s, Q8_0 / Q5_0)         w = d (u - 2^(BITS-1))       fp16 d per block
//        y += (d * s) * (dot - 2^(BITS-1) sum(c))
//   mode 1 (k32, Q4_K / Q5_K)          w = d sc u - dmin mn         uint8 sc, mn per block,
//        y += (d sc s) * dot - (dmin mn) * (s * sum(c))             fp16 d, dmin per 256 k's
//   mode 2 (k16, Q6_K)                 w = d sc_h (u - 32)          int8 sc_h per 16 k's,
//        y += (d sc_h s) * (dot_h - 32 sum_h(c))   (h: block half)  fp16 d per 256 k's
//                                                  (each half's sum starts at its offset)
//
// d * sc is formed in float32, where it is exact (11 x 8 significant bits), so the weights
// are the values gguf's own dequantizer gives. Rows are independent and every row count runs
// the same arithmetic in the same order: a row's result never depends on its batch.
//
// Weight layout (packed once at load by llmserve.model.quant.native_qblock.pack_qblock):
//   strips of 16 output channels; per strip, K/32 blocks of 64 * BITS bytes:
//   BITS 8:     8 quads of 64 bytes: byte 4c + j of quad o = u[16s + c][32b + 4o + j]
//   BITS 4-6:   4 octets of 64 nibble bytes (int4_int8_gemm.cpp's layout: low nibble of
//               byte 4c + j = bits 0-3 of u[c][8o + j], high nibble = those of u[c][8o+4+j]),
//               then BITS - 4 planes of 64 bytes: plane p, octet o, half v (low/high
//               nibbles): 8 bytes whose bit 4c + j is bit 4 + p of that code.
//   sub:  (strips, K/32, 2, 16): fp16 (scale, min) | uint8 (sc, mn) | int8 (sc_0, sc_1);
//         (strips, K/32, 1, 16) fp16 d for mode 3
//   sup:  (strips, K/256, 2, 16) fp16 (d, dmin) for mode 1, (strips, K/256, 1, 16) (d) for 2
//         (the file's own fp16 values: bits per weight Q4_K 4.625, Q5_K 5.625, Q6_K 6.5625)
// One row: strips split over threads, tiles of one strip. More rows: pairs of strips split
// over threads, tiles of up to 6 rows x 2 strips sharing each broadcast of activation
// codes. From kPanelRows (Q6_K: kPanelRowsK16) 5- and 6-bit codes are first expanded to bytes,
// a strip pair at a time, so the tiles do not unpack them again. Each tile's blocks
// prefetch the next strip (or pair) (next_strip_prefetch.h).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "int8_rows.h"
#include "next_strip_prefetch.h"
#include "qblock_dots.h"
#include "qblock_rows.h"
#include "row_scratch.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>

namespace {

using llmserve_native::block_dots;
using llmserve_native::kQuantBlock;

constexpr int kStrip = 16;
constexpr int kMaxRows = 8;
constexpr int kSuperBlocks = 8;   // blocks of 32 per K-quant super-block of 256
enum Mode : int { kF16 = 0, kK32 = 1, kK16 = 2, kF16S = 3 };

inline __m512 u8x16_ps(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

inline __m512 f16x16_ps(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline __m512 i8x16_ps(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

struct Strip {
  const uint8_t* w;     // this strip's packed codes
  const void* sub;      // this strip's per-block scales
  const uint16_t* sup;  // this strip's fp16 per-super-block scales (modes 1, 2)
};

struct Rows {
  const int8_t* xq;     // codes of the tile's first row
  int64_t ldx;
  const float* xs;      // (rows, blocks) scales
  const float* xt;      // (rows, blocks) scale * sum(codes)
  const int32_t* xsum;  // (rows, blocks) sum(codes)
  const int32_t* xh;    // (rows, blocks, 2) half sums of codes
};

// ROWS activation rows x NS adjacent strips (st[0..NS)); per strip, row and block the
// scale arithmetic and its order are the same for every NS and ROWS. With PANEL, the strips'
// codes are bytes already (a panel expand_blocks filled: the 8-bit layout); their integer
// dots are the same numbers, so a panel changes no result.
template <int BITS, int MODE, int ROWS, int NS, bool PANEL = false>
__attribute__((target("avx512vnni"))) void strip_rows(const Strip* st, Rows x, int64_t blocks,
                                                      void* y, int64_t ldy, bool float_out,
                                                      const uint8_t* next, int64_t next_bytes,
                                                      int64_t t, int64_t pf_lines) {
  constexpr int kLayoutBits = PANEL ? 8 : BITS;
  constexpr int64_t kBlockBytes = 64 * kLayoutBits;
  __m512 out[NS][ROWS];
  for (int s = 0; s < NS; ++s)
    for (int r = 0; r < ROWS; ++r) out[s][r] = _mm512_setzero_ps();
  __m512 sup0[NS], sup1[NS];   // a super-block's d, dmin
  for (int s = 0; s < NS; ++s) sup0[s] = sup1[s] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    llmserve_native::prefetch_share(next, next_bytes, t, blocks, b, pf_lines);
    if constexpr (MODE == kK32 || MODE == kK16) {
      if (b % kSuperBlocks == 0) {
        for (int s = 0; s < NS; ++s) {
          const uint16_t* dd = st[s].sup + (b / kSuperBlocks) * (MODE == kK32 ? 2 : 1) * kStrip;
          sup0[s] = f16x16_ps(dd);
          if constexpr (MODE == kK32) sup1[s] = f16x16_ps(dd + kStrip);
        }
      }
    }
    constexpr int kUnits = kLayoutBits == 8 ? 8 : 4;
    const uint8_t* wb[NS];
    for (int s = 0; s < NS; ++s) wb[s] = st[s].w + b * kBlockBytes;
    const int64_t k0 = b * kQuantBlock;
    __m512i acc[NS][ROWS];
    if constexpr (MODE != kK16)
      block_dots<kLayoutBits, 0, kUnits, ROWS, NS>(wb, x.xq, x.ldx, k0, acc);
    if constexpr (MODE == kF16S) {
      // (the offset subtracted here: starting the sums at it, as k16 does, measured 1.03-1.1x
      // slower in the strip-pair tiles)
      constexpr int32_t kOffset = 1 << (BITS - 1);
      for (int s = 0; s < NS; ++s) {
        const __m512 d = f16x16_ps(static_cast<const uint16_t*>(st[s].sub) + b * kStrip);
        for (int r = 0; r < ROWS; ++r) {
          const int64_t rb = r * blocks + b;
          const __m512i dot = _mm512_sub_epi32(acc[s][r], _mm512_set1_epi32(kOffset * x.xsum[rb]));
          out[s][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                                      _mm512_mul_ps(d, _mm512_set1_ps(x.xs[rb])), out[s][r]);
        }
      }
    } else if constexpr (MODE == kF16) {
      for (int s = 0; s < NS; ++s) {
        const uint16_t* sm = static_cast<const uint16_t*>(st[s].sub) + b * 2 * kStrip;
        const __m512 scale = f16x16_ps(sm);
        const __m512 min = f16x16_ps(sm + kStrip);
        for (int r = 0; r < ROWS; ++r) {
          const __m512 dot = _mm512_cvtepi32_ps(acc[s][r]);
          const int64_t rb = r * blocks + b;
          out[s][r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(scale, _mm512_set1_ps(x.xs[rb])),
                                      out[s][r]);
          out[s][r] = _mm512_fmadd_ps(min, _mm512_set1_ps(x.xt[rb]), out[s][r]);
        }
      }
    } else if constexpr (MODE == kK32) {
      for (int s = 0; s < NS; ++s) {
        const uint8_t* sm = static_cast<const uint8_t*>(st[s].sub) + b * 2 * kStrip;
        const __m512 scale = _mm512_mul_ps(sup0[s], u8x16_ps(sm));
        const __m512 min = _mm512_mul_ps(sup1[s], u8x16_ps(sm + kStrip));
        for (int r = 0; r < ROWS; ++r) {
          const __m512 dot = _mm512_cvtepi32_ps(acc[s][r]);
          const int64_t rb = r * blocks + b;
          out[s][r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(scale, _mm512_set1_ps(x.xs[rb])),
                                      out[s][r]);
          out[s][r] = _mm512_fnmadd_ps(min, _mm512_set1_ps(x.xt[rb]), out[s][r]);
        }
      }
    } else {   // k16: each half of the block with its own scale, in order; a half's sums
               // start from -32 sum_h(c), so they come out as dot_h - 32 sum_h(c)
      constexpr int kHalf = kUnits / 2;
      block_dots<kLayoutBits, 0, kHalf, ROWS, NS>(wb, x.xq, x.ldx, k0, acc, x.xh + 2 * b,
                                                 2 * blocks, -32);
      for (int s = 0; s < NS; ++s) {
        const int8_t* sm = static_cast<const int8_t*>(st[s].sub) + b * 2 * kStrip;
        const __m512 scale0 = _mm512_mul_ps(sup0[s], i8x16_ps(sm));
        for (int r = 0; r < ROWS; ++r) {
          const int64_t rb = r * blocks + b;
          out[s][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[s][r]),
                                      _mm512_mul_ps(scale0, _mm512_set1_ps(x.xs[rb])), out[s][r]);
        }
      }
      block_dots<kLayoutBits, kHalf, kUnits, ROWS, NS>(wb, x.xq, x.ldx, k0, acc,
                                                      x.xh + 2 * b + 1, 2 * blocks, -32);
      for (int s = 0; s < NS; ++s) {
        const int8_t* sm = static_cast<const int8_t*>(st[s].sub) + b * 2 * kStrip;
        const __m512 scale1 = _mm512_mul_ps(sup0[s], i8x16_ps(sm + kStrip));
        for (int r = 0; r < ROWS; ++r) {
          const int64_t rb = r * blocks + b;
          out[s][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[s][r]),
                                      _mm512_mul_ps(scale1, _mm512_set1_ps(x.xs[rb])), out[s][r]);
        }
      }
    }
  }
  for (int s = 0; s < NS; ++s)
    for (int r = 0; r < ROWS; ++r) {
      if (float_out)
        _mm512_storeu_ps(static_cast<float*>(y) + r * ldy + s * kStrip, out[s][r]);
      else
        _mm256_storeu_si256(
            reinterpret_cast<__m256i*>(static_cast<uint16_t*>(y) + r * ldy + s * kStrip),
            (__m256i)_mm512_cvtneps_pbh(out[s][r]));
    }
}

using StripFn = void (*)(const Strip*, Rows, int64_t, void*, int64_t, bool, const uint8_t*,
                         int64_t, int64_t, int64_t);

constexpr int kPairRows = 6;   // activation rows per tile of a strip pair

template <int BITS, int MODE, bool PANEL = false>
constexpr StripFn kRowFns[kMaxRows + 1] = {
    nullptr,
    strip_rows<BITS, MODE, 1, 1, PANEL>, strip_rows<BITS, MODE, 2, 1, PANEL>,
    strip_rows<BITS, MODE, 3, 1, PANEL>, strip_rows<BITS, MODE, 4, 1, PANEL>,
    strip_rows<BITS, MODE, 5, 1, PANEL>, strip_rows<BITS, MODE, 6, 1, PANEL>,
    strip_rows<BITS, MODE, 7, 1, PANEL>, strip_rows<BITS, MODE, 8, 1, PANEL>,
};

template <int BITS, int MODE, bool PANEL = false>
constexpr StripFn kPairFns[kPairRows + 1] = {
    nullptr,
    strip_rows<BITS, MODE, 1, 2, PANEL>, strip_rows<BITS, MODE, 2, 2, PANEL>,
    strip_rows<BITS, MODE, 3, 2, PANEL>, strip_rows<BITS, MODE, 4, 2, PANEL>,
    strip_rows<BITS, MODE, 5, 2, PANEL>, strip_rows<BITS, MODE, 6, 2, PANEL>,
};

using ExpandFn = void (*)(const uint8_t*, int64_t, uint8_t*);

// The row functions of a (bits, mode) the loader packs: one strip and strip pairs over the
// packed codes (none for Q6_K's k16 mode: with its two half-block epilogues, pairs measured
// 1.05x slower), and for 5- and 6-bit codes strip pairs over a panel of bytes plus the
// expansion that fills it (4-bit codes unpack in three operations: a panel of Q4_K measured
// 0.89-1.0x); nulls for any other pair.
struct KernelFns {
  const StripFn* one;
  const StripFn* pair;
  const StripFn* panel_pair;
  const StripFn* panel_one;
  ExpandFn expand;
};

template <int BITS, int MODE>
constexpr KernelFns kernel_fns() {   // k16's pair kernels over packed codes never instantiated
  if constexpr (BITS == 8 || BITS == 4)
    return {kRowFns<BITS, MODE>, kPairFns<BITS, MODE>, nullptr, nullptr, nullptr};
  else if constexpr (MODE == kK16)
    return {kRowFns<BITS, MODE>, nullptr, kPairFns<BITS, MODE, true>,
            kRowFns<BITS, MODE, true>, llmserve_native::expand_blocks<BITS>};
  else
    return {kRowFns<BITS, MODE>, kPairFns<BITS, MODE>, kPairFns<BITS, MODE, true>,
            kRowFns<BITS, MODE, true>, llmserve_native::expand_blocks<BITS>};
}

template <int BITS, int MODE>
constexpr KernelFns kFns = kernel_fns<BITS, MODE>();

KernelFns row_fns(int64_t bits, int64_t mode) {
  if (bits == 8 && mode == kF16S) return kFns<8, kF16S>;
  if (bits == 5 && mode == kF16S) return kFns<5, kF16S>;
  if (bits == 5 && mode == kF16) return kFns<5, kF16>;
  if (bits == 4 && mode == kK32) return kFns<4, kK32>;
  if (bits == 5 && mode == kK32) return kFns<5, kK32>;
  if (bits == 6 && mode == kK16) return kFns<6, kK16>;
  return KernelFns{nullptr, nullptr, nullptr, nullptr, nullptr};
}

// Rows from which a product first expands each strip pair's 5- or 6-bit codes to bytes (a
// thread's panel) and runs its row tiles over the bytes: once a strip is read by more than
// one row tile, its unpacking (a nibble split and one or two bit planes) costs more than
// writing and reading the panel. Hot, 1024 x 2048, panel against packed codes: Q6_K 1.09x
// at 9 rows, 1.19x at 130; Q5_K 0.95x at 9, 1.0x at 16, 1.05x at 24, 1.12x at 130; Q5_0
// 1.24x and Q5_1 1.13x at 130.
// Integer dots are the same numbers either way, so the choice changes no result.
constexpr int64_t kPanelRowsK16 = kMaxRows + 1;
constexpr int64_t kPanelRows = 24;

void check_scales(const at::Tensor& t, at::ScalarType type, int64_t strips, int64_t n1,
                  int64_t n2, const char* what) {
  TORCH_CHECK(t.scalar_type() == type && t.is_contiguous() && t.dim() == 4 &&
                  t.size(0) == strips && t.size(1) == n1 && t.size(2) == n2 && t.size(3) == 16,
              "qblock_a8_mm: ", what, " must be contiguous (", strips, ", ", n1, ", ", n2,
              ", 16) of ", c10::toString(type));
}

at::Tensor qblock_a8_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sub,
                        const std::optional<at::Tensor>& sup, int64_t bits, int64_t mode,
                        bool float_out) {
  const KernelFns fns = row_fns(bits, mode);
  TORCH_CHECK(fns.one != nullptr, "qblock_a8_mm: no kernel for ", bits, "-bit codes in mode ",
              mode);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "qblock_a8_mm: x must be a contiguous 2-D bf16 tensor");
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "qblock_a8_mm: packed must be a contiguous 2-D uint8 tensor");
  const int64_t rows = x.size(0), k = x.size(1), strips = packed.size(0);
  const bool per_block = mode == kF16 || mode == kF16S;
  const int64_t unit = per_block ? kQuantBlock : kQuantBlock * kSuperBlocks;
  TORCH_CHECK(k > 0 && k % unit == 0, "qblock_a8_mm: K=", k, " is not a multiple of ", unit);
  const int64_t blocks = k / kQuantBlock, block_bytes = 64 * bits;
  TORCH_CHECK(packed.size(1) == blocks * block_bytes, "qblock_a8_mm: packed weight is for K=",
              packed.size(1) / block_bytes * kQuantBlock, ", x has K=", k);
  const at::ScalarType sub_type = per_block ? at::kHalf : mode == kK32 ? at::kByte : at::kChar;
  const int64_t sub_rows = mode == kF16S ? 1 : 2;
  check_scales(sub, sub_type, strips, blocks, sub_rows, "sub");
  const uint16_t* supp = nullptr;
  if (!per_block) {
    TORCH_CHECK(sup.has_value(), "qblock_a8_mm: mode ", mode, " needs super-block scales");
    check_scales(*sup, at::kHalf, strips, blocks / kSuperBlocks, mode == kK32 ? 2 : 1, "sup");
    supp = reinterpret_cast<const uint16_t*>(sup->data_ptr());
  }
  const int64_t n = strips * kStrip;
  at::Tensor y = at::empty({rows, n}, x.options().dtype(float_out ? at::kFloat : at::kBFloat16));
  if (rows == 0 || n == 0) return y;
  int8_t* xq = llmserve_native::row_scratch<int8_t>(0, rows * k);
  float* xs = llmserve_native::row_scratch<float>(1, 2 * rows * blocks);
  float* xt = xs + rows * blocks;
  int32_t* xh = llmserve_native::row_scratch<int32_t>(2, rows * blocks * 3);
  int32_t* xsum = xh + rows * blocks * 2;
  llmserve_native::quantize_rows(reinterpret_cast<const uint16_t*>(x.data_ptr()), rows, k, xq,
                                 xs, xt, mode == kF16S ? xsum : nullptr,
                                 mode == kK16 ? xh : nullptr);
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const char* subp = static_cast<const char*>(sub.data_ptr());
  const int64_t sub_bytes = blocks * sub_rows * kStrip * sub.element_size();
  const int64_t sup_halves = blocks / kSuperBlocks * (mode == kK32 ? 2 : 1) * kStrip;
  char* yp = static_cast<char*>(y.data_ptr());
  const int64_t out_bytes = float_out ? 4 : 2, strip_bytes = blocks * block_bytes;
  auto strip_at = [&](int64_t s) {
    return Strip{wp + s * strip_bytes, subp + s * sub_bytes,
                 supp == nullptr ? nullptr : supp + s * sup_halves};
  };
  auto rows_at = [&](int64_t r0) {
    return Rows{xq + r0 * k, k, xs + r0 * blocks, xt + r0 * blocks, xsum + r0 * blocks,
                xh + r0 * blocks * 2};
  };
  // tiles of up to `per` rows of strips `st` from strip s, `next_bytes` from `next` (the
  // strips after them; 0: none) prefetched while they compute
  auto run_tiles = [&](const Strip (&st)[2], int64_t s, int64_t per, const StripFn* table,
                       const uint8_t* next, int64_t next_bytes) {
    const int64_t tiles = (rows + per - 1) / per;
    const int64_t pf_lines =
        next_bytes > 0 ? llmserve_native::next_strip_lines(next_bytes, tiles, blocks) : 0;
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t r0 = t * per;
      const int64_t tile = rows - r0 < per ? rows - r0 : per;
      table[tile](st, rows_at(r0), blocks, yp + (r0 * n + s * kStrip) * out_bytes, n,
                  float_out, next, next_bytes, t, pf_lines);
    }
  };
  // `ns` strips from s over their packed codes, the `next` strips after them prefetched
  auto packed_tiles = [&](int64_t s, int64_t ns, int64_t per, const StripFn* table,
                          int64_t next) {
    const Strip st[2] = {strip_at(s), strip_at(ns == 2 ? s + 1 : s)};
    run_tiles(st, s, per, table, st[0].w + ns * strip_bytes, next * strip_bytes);
  };
  // the same, the codes first expanded to bytes in this thread's panel (no unpacking per tile)
  auto panel_tiles = [&](int64_t s, int64_t ns, int64_t per, const StripFn* table,
                         int64_t next) {
    constexpr int64_t kPanelBlockBytes = 512;
    uint8_t* panel = llmserve_native::row_scratch<uint8_t>(3, ns * blocks * kPanelBlockBytes);
    Strip st[2] = {strip_at(s), strip_at(ns == 2 ? s + 1 : s)};
    for (int64_t i = 0; i < ns; ++i) {
      fns.expand(st[i].w, blocks, panel + i * blocks * kPanelBlockBytes);
      st[i].w = panel + i * blocks * kPanelBlockBytes;
    }
    run_tiles(st, s, per, table, wp + (s + ns) * strip_bytes, next * strip_bytes);
  };
  // strip pairs over threads, rows in tiles of kPairRows; an odd last strip alone; each
  // pair's tiles prefetch the next pair (or the odd last strip)
  auto over_pairs = [&](const auto& tiles, const StripFn* one, const StripFn* pair) {
    at::parallel_for(0, (strips + 1) / 2, 1, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const int64_t s = 2 * p;
        if (s + 1 == strips)
          tiles(s, 1, kMaxRows, one, 0);
        else
          tiles(s, 2, kPairRows, pair, p + 1 < end ? std::min<int64_t>(2, strips - s - 2) : 0);
      }
    });
  };
  if (fns.expand != nullptr && rows >= (mode == kK16 ? kPanelRowsK16 : kPanelRows)) {
    over_pairs(panel_tiles, fns.panel_one, fns.panel_pair);
  } else if (rows == 1 || fns.pair == nullptr) {   // one row streams its weights; k16 one strip
    at::parallel_for(0, strips, 1, [&](int64_t begin, int64_t end) {
      for (int64_t s = begin; s < end; ++s)
        packed_tiles(s, 1, kMaxRows, fns.one, s + 1 < end ? 1 : 0);
    });
  } else {
    over_pairs(packed_tiles, fns.one, fns.pair);
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmserve_native, m) {
  m.def("qblock_a8_mm(Tensor x, Tensor packed, Tensor sub, Tensor? sup, int bits, int mode, "
        "bool float_out=False) -> Tensor");
  m.impl("qblock_a8_mm", c10::DispatchKey::CPU, TORCH_FN(qblock_a8_mm));
  m.def("qblock_rows(Tensor ids, Tensor packed, Tensor sub, Tensor? sup, int bits, int mode, "
        "int rows) -> Tensor");
  m.impl("qblock_rows", c10::DispatchKey::CPU,
         TORCH_FN(llmserve_native::qblock_table::qblock_rows));
}
