// Paged decode attention over 8-bit KV caches on AVX-512 CPUs: llmserve_native::paged_decode_q8.
//
//   q (B, H, D) bf16, k_cache/v_cache (slots, Hkv, D + 4) int8 or float8_e4m3fn
//   (model/quant/kv.py: each (slot, head) row holds the head's D codes, then the 4 bytes of
//   its float32 scale), slots (B, L) int64 cache rows, valid (B, L) bool -> out (B, H * D) bf16.
//
// paged_decode's contract and work split (decode_math.h) over the codes, read in place: the
// cache is half the bytes of a bf16 one. Per query head and key, in this order, whatever the
// other rows of the call:
//   s_l = ((q . c_l) * scale_l) * scale   q . c_l by vdpbf16ps: a key's codes are widened to
//         bf16 (exact: an int8 code or an fp8 e4m3 value has at most 8 significant bits)
//         once per KV head into a 16-key scratch that every head of the group scores, and the
//         16 keys' lanes are summed by sum_lanes16; then softcap * tanh(s / softcap) where a
//         softcap is set
//   p_l = e^(s_l - max s) (paged_decode's softmax; masked keys exactly 0)
//   o   = bf16((sum_l (p_l * vscale_l) * v_l) * (1 / sum_l p_l)), the sums in key order
// so a row decoded alone, in a batch, verified among drafts or as a prompt's causal row
// gets the same bits. Head sizes 64 and 128 with up to 8 query heads a KV head run a kernel
// with both as constants (registers hold the group's value sums); other shapes (a multiple
// of 16) one task per (row, KV head) with loops sized at run time. Float32 queries take the
// avx2 library's kernel (csrc/avx2/paged_decode_avx2.cpp).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "decode_math.h"
#include "decode_operands.h"
#include "decode_rows.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using llmserve_native::kPullKeys;
using llmserve_native::softmax_row;
using llmserve_native::sum_lanes16;

// 16 int8 codes -> 16 floats (exact).
struct Int8Codes {
  static __m512 load16(const int8_t* p) {
    return _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
};

// 16 fp8 e4m3 codes -> 16 floats: torch's float8_e4m3fn values exactly (the NaN code, which
// quantize_kv never writes, reads 480). A normal code's exponent and mantissa move into
// float32's fields (bias 7 -> 127), a subnormal one (exponent 0) is m * 2^-9, then the sign.
struct Fp8Codes {
  static __m512 load16(const int8_t* p) {
    const __m512i b =
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m512i lo7 = _mm512_and_si512(b, _mm512_set1_epi32(0x7F));
    const __m512 normal = _mm512_castsi512_ps(
        _mm512_add_epi32(_mm512_slli_epi32(lo7, 20), _mm512_set1_epi32(120 << 23)));
    const __m512 sub = _mm512_mul_ps(
        _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(7))), _mm512_set1_ps(1.f / 512));
    const __mmask16 tiny = _mm512_testn_epi32_mask(b, _mm512_set1_epi32(0x78));
    const __m512i mag = _mm512_castps_si512(_mm512_mask_mov_ps(normal, tiny, sub));
    const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
    return _mm512_castsi512_ps(_mm512_or_si512(mag, sign));
  }
};

// The float32 scale stored after a row's `d` codes.
inline float row_scale(const int8_t* row, int64_t d) {
  float s;
  std::memcpy(&s, row + d, sizeof(s));
  return s;
}

// Touches every 64-byte line of the rows of keys [l0, l1) that a task reads (`width` bytes
// from each row start), by independent loads: paged_decode's pulls, for rows of bytes.
inline void pull_code_rows(const int8_t* cache, const int64_t* slots, const bool* valid,
                           int64_t l0, int64_t l1, int64_t row_stride, int64_t width) {
  int8_t x = 0;
  for (int64_t l = l0; l < l1; ++l) {
    if (!valid[l]) continue;
    const int8_t* row = cache + slots[l] * row_stride;
    for (int64_t o = 0; o < width; o += 64) x = static_cast<int8_t>(x ^ row[o]);
    x = static_cast<int8_t>(x ^ row[width - 1]);
  }
  volatile int8_t sink = x;
  (void)sink;
}

// Requests the rows of keys [l0, l1) into L2 (the V rows of a block while its K rows are
// scored).
inline void prefetch_code_rows(const int8_t* cache, const int64_t* slots, const bool* valid,
                               int64_t l0, int64_t l1, int64_t row_stride, int64_t width) {
  for (int64_t l = l0; l < l1; ++l) {
    if (!valid[l]) continue;
    const char* row = reinterpret_cast<const char*>(cache + slots[l] * row_stride);
    for (int64_t o = 0; o < width; o += 64) _mm_prefetch(row + o, _MM_HINT_T1);
    _mm_prefetch(row + width - 1, _MM_HINT_T1);
  }
}

// One query row (all its KV heads, or one: hkv = 1 and the pointers at that head) with the
// head size and group as constants; the walk of paged_decode's decode_row.
template <typename Codes, int DC, int G>
void decode_row(const uint16_t* q, const int8_t* kc, const int8_t* vc, const int64_t* slots,
                const bool* valid, int64_t len, int64_t hkv, int64_t row_stride, float scale,
                float softcap, bool pull, bool prefetch_v, uint16_t* out,
                std::vector<float>& buf) {
  static_assert(DC % 2 == 0, "whole 32-code pairs: kb's rows stay 64-byte aligned");
  constexpr int d = DC * 16;
  constexpr int64_t width = d + 4;                  // bytes of one head's row
  const int64_t padded = (len + 15) / 16 * 16, heads = hkv * G;
  buf.resize(static_cast<size_t>(heads * (padded + d + 17)));
  float* scores = buf.data();                  // (heads, padded)
  float* sums = scores + heads * padded;       // (heads, d): value sums between chunks
  float* peaks = sums + heads * d;             // (heads, 16): running vector maxima
  float* inv = peaks + heads * 16;             // (heads): 1 / the softmax's total
  alignas(64) uint16_t kb[16 * d];             // a KV head's 16 keys widened to bf16
  alignas(64) float ks[16];                    // and their scales
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const __m512 vneg_inf = _mm512_set1_ps(neg_inf), vscale = _mm512_set1_ps(scale);
  const int64_t used = hkv * width;            // bytes of a slot's row the task reads
  for (int64_t h = 0; h < heads; ++h) _mm512_storeu_ps(peaks + 16 * h, vneg_inf);
  for (int64_t l0 = 0; l0 < len; l0 += 16) {
    if (pull && l0 % kPullKeys == 0)
      pull_code_rows(kc, slots, valid, l0, std::min(len, l0 + kPullKeys), row_stride, used);
    const int n = len - l0 < 16 ? static_cast<int>(len - l0) : 16;
    if (pull && prefetch_v) prefetch_code_rows(vc, slots, valid, l0, l0 + n, row_stride, used);
    __mmask16 live = 0;
    for (int i = 0; i < 16; ++i)
      live = static_cast<__mmask16>(live | (static_cast<unsigned>(i < n && valid[l0 + i]) << i));
    if (!live) {           // a block past a causal row's position or outside its window
      for (int64_t h = 0; h < heads; ++h) _mm512_storeu_ps(scores + h * padded + l0, vneg_inf);
      continue;
    }
    for (int64_t kvh = 0; kvh < hkv; ++kvh) {
      for (int i = 0; i < 16; ++i) {
        uint16_t* dst = kb + i * d;
        if (!((live >> i) & 1)) {            // a masked key scores 0, then -inf
          std::memset(dst, 0, sizeof(uint16_t) * d);
          ks[i] = 0.f;
          continue;
        }
        const int8_t* k = kc + slots[l0 + i] * row_stride + kvh * width;
        for (int c = 0; c < DC / 2; ++c) {
          const __m512bh pair = _mm512_cvtne2ps_pbh(Codes::load16(k + 32 * c + 16),
                                                    Codes::load16(k + 32 * c));
          _mm512_store_si512(dst + 32 * c, (__m512i)pair);
        }
        ks[i] = row_scale(k, d);
      }
      const __m512 kscale = _mm512_load_ps(ks);
      for (int g = 0; g < G; ++g) {
        const int64_t h = kvh * G + g;
        __m512bh qp[DC / 2];
        for (int c = 0; c < DC / 2; ++c) qp[c] = (__m512bh)_mm512_loadu_si512(q + h * d + 32 * c);
        __m512 part[16];
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) {
          const uint16_t* k = kb + i * d;
          part[i] = _mm512_dpbf16_ps(_mm512_setzero_ps(), qp[0], (__m512bh)_mm512_load_si512(k));
#pragma GCC unroll 8
          for (int c = 1; c < DC / 2; ++c)
            part[i] = _mm512_dpbf16_ps(part[i], qp[c], (__m512bh)_mm512_load_si512(k + 32 * c));
        }
        __m512 s = _mm512_mul_ps(_mm512_mul_ps(sum_lanes16(part), kscale), vscale);
        if (softcap > 0.f) {
          alignas(64) float t[16];
          _mm512_store_ps(t, s);
          for (int i = 0; i < 16; ++i) t[i] = std::tanh(t[i] / softcap) * softcap;
          s = _mm512_load_ps(t);
        }
        s = _mm512_mask_mov_ps(vneg_inf, live, s);
        _mm512_storeu_ps(peaks + 16 * h, _mm512_max_ps(s, _mm512_loadu_ps(peaks + 16 * h)));
        _mm512_storeu_ps(scores + h * padded + l0, s);
      }
    }
  }
  for (int64_t h = 0; h < heads; ++h) {
    const float total = softmax_row(scores + h * padded, len,
                                    _mm512_reduce_max_ps(_mm512_loadu_ps(peaks + 16 * h)));
    inv[h] = total > 0.f ? 1.f / total : 0.f;
  }
  for (int64_t i = 0; i < heads * d; ++i) sums[i] = 0.f;
  for (int64_t l0 = 0; l0 < len; l0 += kPullKeys) {
    const int64_t l1 = std::min(len, l0 + kPullKeys);
    if (pull) pull_code_rows(vc, slots, valid, l0, l1, row_stride, used);
    for (int64_t kvh = 0; kvh < hkv; ++kvh) {
      float* head_sums = sums + kvh * G * d;
      __m512 acc[G][DC];
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < DC; ++c) acc[g][c] = _mm512_loadu_ps(head_sums + g * d + 16 * c);
      for (int64_t l = l0; l < l1; ++l) {
        if (!valid[l]) continue;
        const int8_t* vrow = vc + slots[l] * row_stride + kvh * width;
        const float vs = row_scale(vrow, d);
        __m512 p[G];
        for (int g = 0; g < G; ++g) p[g] = _mm512_set1_ps(scores[(kvh * G + g) * padded + l] * vs);
        for (int c = 0; c < DC; ++c) {
          const __m512 v = Codes::load16(vrow + 16 * c);
          for (int g = 0; g < G; ++g) acc[g][c] = _mm512_fmadd_ps(p[g], v, acc[g][c]);
        }
      }
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < DC; ++c) _mm512_storeu_ps(head_sums + g * d + 16 * c, acc[g][c]);
    }
  }
  for (int64_t h = 0; h < heads; ++h)
    for (int c = 0; c < DC; ++c) {
      const __m256bh o = _mm512_cvtneps_pbh(
          _mm512_mul_ps(_mm512_loadu_ps(sums + h * d + 16 * c), _mm512_set1_ps(inv[h])));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + h * d + 16 * c), (__m256i)o);
    }
}

// Any head size (a multiple of 16) and group: one (row, KV head) with loops and buffers
// sized at run time; q . c by float32 fused multiply-adds over 16-wide chunks and one lane
// reduction a key (not decode_row's order, but a model's shape picks one of the two for
// all its rows).
template <typename Codes>
void decode_any(const uint16_t* q, const int8_t* kc, const int8_t* vc, const int64_t* slots,
                const bool* valid, int64_t len, int64_t g_heads, int64_t d, int64_t row_stride,
                float scale, float softcap, uint16_t* out, std::vector<float>& buf) {
  const int64_t chunks = d / 16;
  buf.assign(static_cast<size_t>(g_heads * (len + 2 * d)), 0.f);
  float* scores = buf.data();                       // (G, len)
  float* qf = scores + g_heads * len;               // (G, D) query in float32
  float* acc = qf + g_heads * d;                    // (G, D) weighted sum of values
  for (int64_t i = 0; i < g_heads * d; ++i) {
    const uint32_t bits = static_cast<uint32_t>(q[i]) << 16;
    std::memcpy(&qf[i], &bits, sizeof(float));
  }
  const float neg_inf = -std::numeric_limits<float>::infinity();
  std::vector<float> peak(static_cast<size_t>(g_heads), neg_inf);
  for (int64_t l = 0; l < len; ++l) {
    if (!valid[l]) {
      for (int64_t g = 0; g < g_heads; ++g) scores[g * len + l] = neg_inf;
      continue;
    }
    const int8_t* krow = kc + slots[l] * row_stride;
    for (int64_t g = 0; g < g_heads; ++g) {
      __m512 s = _mm512_setzero_ps();
      for (int64_t c = 0; c < chunks; ++c)
        s = _mm512_fmadd_ps(_mm512_loadu_ps(qf + g * d + 16 * c), Codes::load16(krow + 16 * c), s);
      float v = _mm512_reduce_add_ps(s) * row_scale(krow, d) * scale;
      if (softcap > 0.f) v = std::tanh(v / softcap) * softcap;
      scores[g * len + l] = v;
      if (v > peak[g]) peak[g] = v;
    }
  }
  for (int64_t g = 0; g < g_heads; ++g) {
    const float total = softmax_row(scores + g * len, len, peak[g]);
    for (int64_t l = 0; l < len; ++l) {
      if (!valid[l]) continue;
      const int8_t* vrow = vc + slots[l] * row_stride;
      const __m512 p = _mm512_set1_ps(scores[g * len + l] * row_scale(vrow, d));
      for (int64_t c = 0; c < chunks; ++c) {
        float* a = acc + g * d + 16 * c;
        _mm512_storeu_ps(a, _mm512_fmadd_ps(p, Codes::load16(vrow + 16 * c), _mm512_loadu_ps(a)));
      }
    }
    const __m512 inv = _mm512_set1_ps(total > 0.f ? 1.f / total : 0.f);
    for (int64_t c = 0; c < chunks; ++c) {
      const __m256bh o = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(acc + g * d + 16 * c), inv));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + g * d + 16 * c), (__m256i)o);
    }
  }
}

using RowFn = void (*)(const uint16_t*, const int8_t*, const int8_t*, const int64_t*,
                      const bool*, int64_t, int64_t, int64_t, float, float, bool, bool,
                      uint16_t*, std::vector<float>&);

template <typename Codes, int DC>
RowFn fixed_kernel_of(int64_t g) {
  switch (g) {
    case 1: return decode_row<Codes, DC, 1>;
    case 2: return decode_row<Codes, DC, 2>;
    case 3: return decode_row<Codes, DC, 3>;
    case 4: return decode_row<Codes, DC, 4>;
    case 5: return decode_row<Codes, DC, 5>;
    case 6: return decode_row<Codes, DC, 6>;
    case 7: return decode_row<Codes, DC, 7>;
    case 8: return decode_row<Codes, DC, 8>;
    default: return nullptr;
  }
}

// paged_decode's choice: a model's shape (and its cache's codes) pick one kernel for all of
// its rows.
template <typename Codes>
RowFn fixed_kernel(int64_t d, int64_t g) {
  return d == 64 ? fixed_kernel_of<Codes, 4>(g) : d == 128 ? fixed_kernel_of<Codes, 8>(g)
                                                           : nullptr;
}

template <typename Codes>
void decode_rows(const uint16_t* qp, const int8_t* kp, const int8_t* vp, const int64_t* sp,
                 const bool* mp, int64_t b, int64_t h, int64_t d, int64_t hkv, int64_t len,
                 float sf, float cap, uint16_t* op) {
  const int64_t g_heads = h / hkv, width = d + 4, row_stride = hkv * width;
  if (const RowFn fixed = fixed_kernel<Codes>(d, g_heads)) {
    llmserve_native::run_decode_tasks(
        b, hkv, sp, mp, len, [&](int64_t i, int64_t kvh, int64_t task_hkv, int64_t keys,
                                 bool pull, bool prefetch_v, std::vector<float>& buf) {
          const int64_t head = i * h + kvh * g_heads;
          fixed(qp + head * d, kp + kvh * width, vp + kvh * width, sp + i * len, mp + i * len,
                keys, task_hkv, row_stride, sf, cap, pull, prefetch_v, op + head * d, buf);
        });
    return;
  }
  at::parallel_for(0, b * hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / hkv, kvh = task % hkv, head = i * h + kvh * g_heads;
      decode_any<Codes>(qp + head * d, kp + kvh * width, vp + kvh * width, sp + i * len,
                        mp + i * len, len, g_heads, d, row_stride, sf, cap, op + head * d, buf);
    }
  });
}

at::Tensor paged_decode_q8(const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& slots,
                           const at::Tensor& valid, double scale, double softcap) {
  llmserve_native::check_code_decode_operands(q, k_cache, v_cache, slots, valid);
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && q.size(2) % 16 == 0,
              "paged_decode_q8: bf16 queries with a head size of a multiple of 16");
  const int64_t b = q.size(0), h = q.size(1), d = q.size(2), hkv = k_cache.size(1);
  const at::Tensor qc = q.contiguous(), sc = slots.contiguous(), vm = valid.contiguous();
  at::Tensor out = at::empty({b, h * d}, q.options());
  if (b == 0) return out;
  const uint16_t* qp = reinterpret_cast<const uint16_t*>(qc.data_ptr());
  const int8_t* kp = reinterpret_cast<const int8_t*>(k_cache.data_ptr());
  const int8_t* vp = reinterpret_cast<const int8_t*>(v_cache.data_ptr());
  const int64_t* sp = sc.data_ptr<int64_t>();
  const bool* mp = vm.data_ptr<bool>();
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const float sf = static_cast<float>(scale), cap = static_cast<float>(softcap);
  if (k_cache.scalar_type() == at::kChar) {
    decode_rows<Int8Codes>(qp, kp, vp, sp, mp, b, h, d, hkv, sc.size(1), sf, cap, op);
  } else {
    decode_rows<Fp8Codes>(qp, kp, vp, sp, mp, b, h, d, hkv, sc.size(1), sf, cap, op);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmserve_native, m) {
  m.def("paged_decode_q8(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, "
        "Tensor valid, float scale, float softcap) -> Tensor");
  m.impl("paged_decode_q8", c10::DispatchKey::CPU, TORCH_FN(paged_decode_q8));
}
