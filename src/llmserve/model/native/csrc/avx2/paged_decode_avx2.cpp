// Paged decode attention of the avx2 tier: llmserve_avx2::paged_decode, the contract of
// ../paged_decode.cpp (q (B, H, D) against each row's cached K/V rows slots (B, L) where
// valid (B, L) -> (B, H * D)) on AVX2 + FMA, for bf16 or float32 queries and caches (one
// dtype for all three and the output): a CPU without native bf16 runs float32 models. It
// also reads 8-bit caches (model/quant/kv.py: each (slot, head) row holds D int8 or fp8 e4m3
// codes, then their float32 scale) under bf16 or float32 queries: the one kernel of such a
// cache's decode, verify and prompt rows on the avx2 tier, and under float32 queries on the
// AVX-512 tiers (bf16 queries there take ../paged_decode_q8.cpp).
//
// Per query head, in this order, whatever the other rows of the call:
//   s_l = scale * sum_c (q_c . k_c)  for each valid key l up to the row's last valid one,
//         q_c . k_c in 8 lanes by fused multiply-adds over the head's 8-wide chunks c in
//         order, the lanes added pairwise (4 + 4, 2 + 2, 1 + 1); softcap * tanh(s / softcap)
//         (an 8-bit row: the same sum over its codes, times the row's scale, then `scale`)
//   p_l = e^(s_l - max s) (a degree-6 polynomial; 0 for masked keys and below e^-87)
//   o   = bf16( (sum_l p_l v_l) * (1 / sum_l p_l) ),  both sums in key order
//         (sum_l p_l in 8 lanes by key index, then the pairwise lane adds; an 8-bit V row
//         adds (p_l * its scale) * its codes)
// so a row decoded alone, in a batch, verified among drafts or as a prompt's causal row
// (the paged backend's one path on this tier, as the AVX-512 kernel's on its own) gets the
// same bits. Rows are split over the threads, or (row, KV head) pairs when there are fewer
// than two rows a thread; the split changes no arithmetic.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "../decode_operands.h"
#include "vec_avx2.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using llmserve_avx2::load_bf16x8;
using llmserve_avx2::store_bf16x8;

// 8 values of a bf16 (uint16_t) or float32 row as floats, and back
inline __m256 load8(const uint16_t* p) { return load_bf16x8(p); }
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline void store8(uint16_t* p, __m256 v) { store_bf16x8(p, v); }
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
// 8 codes of an int8 cache row as floats (exact); the row's scale is applied apart
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// A code of an fp8 e4m3 cache (torch's float8_e4m3fn bits).
struct Fp8E4m3 {
  uint8_t bits;
};

// 8 fp8 e4m3 codes as floats: torch's values exactly (the NaN code, which quantize_kv never
// writes, reads 480); paged_decode_q8.cpp's Fp8Codes in 8 lanes.
inline __m256 load8(const Fp8E4m3* p) {
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i lo7 = _mm256_and_si256(b, _mm256_set1_epi32(0x7F));
  const __m256 normal = _mm256_castsi256_ps(
      _mm256_add_epi32(_mm256_slli_epi32(lo7, 20), _mm256_set1_epi32(120 << 23)));
  const __m256 sub = _mm256_mul_ps(
      _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(7))), _mm256_set1_ps(1.f / 512));
  const __m256i tiny = _mm256_cmpeq_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x78)),
                                          _mm256_setzero_si256());
  const __m256 mag = _mm256_blendv_ps(normal, sub, _mm256_castsi256_ps(tiny));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24);
  return _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(mag), sign));
}

// An 8-bit code type (a quantized cache's rows: codes, then a float32 scale).
template <typename C>
constexpr bool kCoded = std::is_same_v<C, int8_t> || std::is_same_v<C, Fp8E4m3>;

// Elements of one (slot, head) row of a cache of C: the head's D values, and for 8-bit codes
// the 4 bytes of their float32 scale after them.
template <typename C>
constexpr int64_t kScaleBytes = kCoded<C> ? 4 : 0;

// The float32 scale stored after an 8-bit row's `d` codes.
template <typename C>
inline float code_row_scale(const C* row, int64_t d) {
  float s;
  std::memcpy(&s, reinterpret_cast<const char*>(row + d), sizeof(s));
  return s;
}

// The eight lanes added pairwise: (0..3) + (4..7), then (0,1) + (2,3), then 0 + 1.
inline float sum_lanes8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// e^x for x <= 0: 2^n * 2^r with n = round(x log2 e), |r| <= 1/2, a degree-6 Taylor
// polynomial of 2^r; 2^n built in the exponent bits. Below -87 (2^n no longer normal) 0.
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 low = _mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_GE_OQ);
  const __m256 t = _mm256_mul_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)),
                                 _mm256_set1_ps(1.44269504088896341f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_mul_ps(_mm256_sub_ps(t, n), _mm256_set1_ps(0.69314718055994531f));
  __m256 p = _mm256_set1_ps(1.f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(bits)), low);
}

// One query row's `heads` heads (`group` query heads a KV head) against its first `len`
// keys. `d` is a multiple of 8; T is the dtype of q and the output, C the caches' (T, or
// 8-bit codes with a scale a row).
template <typename T, typename C>
void decode_heads(const T* q, const C* kc, const C* vc, const int64_t* slots,
                  const bool* valid, int64_t len, int64_t heads, int64_t group, int64_t d,
                  int64_t row_stride, float scale, float softcap, T* out,
                  std::vector<float>& buf) {
  constexpr bool coded = kCoded<C>;
  const int64_t head_width = d + kScaleBytes<C>;
  const int64_t padded = (len + 7) / 8 * 8;
  buf.assign(static_cast<size_t>(heads * (padded + 2 * d)), 0.f);
  float* scores = buf.data();                  // (heads, padded)
  float* qf = scores + heads * padded;         // (heads, d)
  float* sums = qf + heads * d;                // (heads, d)
  for (int64_t i = 0; i < heads * d; i += 8) _mm256_storeu_ps(qf + i, load8(q + i));
  const float neg_inf = -std::numeric_limits<float>::infinity();
  std::vector<float> peak(static_cast<size_t>(heads), neg_inf);
  for (int64_t l = 0; l < padded; ++l) {
    const bool in = l < len && valid[l];
    if (!in) {
      for (int64_t h = 0; h < heads; ++h) scores[h * padded + l] = neg_inf;
      continue;
    }
    const C* krow = kc + slots[l] * row_stride;
    for (int64_t h = 0; h < heads; ++h) {
      const C* k = krow + (h / group) * head_width;
      __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(qf + h * d), load8(k));
      for (int64_t c = 8; c < d; c += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(qf + h * d + c), load8(k + c), acc);
      float s = sum_lanes8(acc);
      if constexpr (coded) s *= code_row_scale(k, d);
      s *= scale;
      if (softcap > 0.f) s = std::tanh(s / softcap) * softcap;
      scores[h * padded + l] = s;
      if (s > peak[h]) peak[h] = s;   // a NaN score never becomes the peak
    }
  }
  for (int64_t h = 0; h < heads; ++h) {
    float* s = scores + h * padded;
    float inv = 0.f;
    if (peak[h] != neg_inf) {
      const __m256 top = _mm256_set1_ps(peak[h]), vneg_inf = _mm256_set1_ps(neg_inf);
      __m256 total = _mm256_setzero_ps();
      for (int64_t l = 0; l < padded; l += 8) {
        const __m256 x = _mm256_loadu_ps(s + l);
        const __m256 live = _mm256_cmp_ps(x, vneg_inf, _CMP_NEQ_OQ);
        const __m256 p = _mm256_and_ps(exp_nonpositive(_mm256_sub_ps(x, top)), live);
        _mm256_storeu_ps(s + l, p);
        total = _mm256_add_ps(total, p);
      }
      const float t = sum_lanes8(total);
      inv = t > 0.f ? 1.f / t : 0.f;
    } else {
      for (int64_t l = 0; l < padded; ++l) s[l] = 0.f;   // no valid key: the output is 0
    }
    for (int64_t c = 0; c < d; ++c) sums[h * d + c] = 0.f;
    // p * V by key, in key order (masked keys were skipped in the scores and add nothing)
    for (int64_t l = 0; l < len; ++l) {
      if (!valid[l]) continue;
      const C* v = vc + slots[l] * row_stride + (h / group) * head_width;
      float pl = s[l];
      if constexpr (coded) pl *= code_row_scale(v, d);
      const __m256 p = _mm256_set1_ps(pl);
      for (int64_t c = 0; c < d; c += 8)
        _mm256_storeu_ps(sums + h * d + c, _mm256_fmadd_ps(p, load8(v + c),
                                                           _mm256_loadu_ps(sums + h * d + c)));
    }
    const __m256 vinv = _mm256_set1_ps(inv);
    for (int64_t c = 0; c < d; c += 8)
      store8(out + h * d + c, _mm256_mul_ps(_mm256_loadu_ps(sums + h * d + c), vinv));
  }
}

// The number of keys up to the row's last valid one (the keys past it add exact zeros).
int64_t valid_length(const bool* row, int64_t len) {
  while (len > 0 && !row[len - 1]) --len;
  return len;
}

template <typename T, typename C>
void decode_rows(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const at::Tensor& slots, const at::Tensor& valid, float scale, float softcap,
                 at::Tensor& out) {
  const int64_t b = q.size(0), h = q.size(1), d = q.size(2), hkv = k_cache.size(1);
  const int64_t head_width = d + kScaleBytes<C>;
  const int64_t len = slots.size(1), group = h / hkv, row_stride = hkv * head_width;
  const T* qp = reinterpret_cast<const T*>(q.data_ptr());
  const C* kp = reinterpret_cast<const C*>(k_cache.data_ptr());
  const C* vp = reinterpret_cast<const C*>(v_cache.data_ptr());
  const int64_t* sp = slots.data_ptr<int64_t>();
  const bool* mp = valid.data_ptr<bool>();
  T* op = reinterpret_cast<T*>(out.data_ptr());
  const int64_t per_row = b < 2 * at::get_num_threads() ? hkv : 1;
  at::parallel_for(0, b * per_row, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t i = t / per_row, kvh = per_row == 1 ? 0 : t % per_row;
      const int64_t head = i * h + kvh * group, kv_offset = kvh * head_width;
      decode_heads<T, C>(qp + head * d, kp + kv_offset, vp + kv_offset, sp + i * len,
                      mp + i * len, valid_length(mp + i * len, len), per_row == 1 ? h : group,
                      group, d, row_stride, scale, softcap, op + head * d, buf);
    }
  });
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& slots, const at::Tensor& valid, double scale,
                        double softcap) {
  const auto cache = k_cache.scalar_type();
  const bool coded = cache == at::kChar || cache == at::kFloat8_e4m3fn;
  if (coded) {
    llmserve_native::check_code_decode_operands(q, k_cache, v_cache, slots, valid);
  } else {
    llmserve_native::check_decode_operands(q, k_cache, v_cache, slots, valid, true);
  }
  const bool bf16 = q.scalar_type() == at::kBFloat16;
  const int64_t b = q.size(0), h = q.size(1), d = q.size(2);
  const at::Tensor qc = q.contiguous(), sc = slots.contiguous(), vm = valid.contiguous();
  at::Tensor out = at::empty({b, h * d}, q.options());
  if (b == 0) return out;
  const float sf = static_cast<float>(scale), cap = static_cast<float>(softcap);
  if (cache == at::kChar) {
    if (bf16) decode_rows<uint16_t, int8_t>(qc, k_cache, v_cache, sc, vm, sf, cap, out);
    else decode_rows<float, int8_t>(qc, k_cache, v_cache, sc, vm, sf, cap, out);
  } else if (cache == at::kFloat8_e4m3fn) {
    if (bf16) decode_rows<uint16_t, Fp8E4m3>(qc, k_cache, v_cache, sc, vm, sf, cap, out);
    else decode_rows<float, Fp8E4m3>(qc, k_cache, v_cache, sc, vm, sf, cap, out);
  } else if (bf16) {
    decode_rows<uint16_t, uint16_t>(qc, k_cache, v_cache, sc, vm, sf, cap, out);
  } else {
    decode_rows<float, float>(qc, k_cache, v_cache, sc, vm, sf, cap, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmserve_avx2, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, Tensor valid, "
        "float scale, float softcap) -> Tensor");
  m.impl("paged_decode", c10::DispatchKey::CPU, TORCH_FN(paged_decode));
}
