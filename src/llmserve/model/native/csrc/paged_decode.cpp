// Paged decode attention for bf16 KV caches on AVX-512 CPUs: llmserve_native::paged_decode.
//
//   q (B, H, D) bf16, k_cache/v_cache (slots, Hkv, D) bf16, slots (B, L) int64 cache rows,
//   valid (B, L) bool -> out (B, H * D) bf16, for query heads grouped over KV heads
//   (head h reads KV head h / (H / Hkv)). The same arithmetic as the reference backend:
//   float32 scores s = scale * q.k (optionally softcap * tanh(s / softcap)), a softmax over
//   the valid keys, float32 sums of p * v.
//
// One task per (sequence, KV head): its G query heads read each K row and V row once,
// where it lives in the cache (no gathered copy of the context).
// _mm512_reduce_max_ps inlines GCC 12's `_mm256_undefined_pd` (`__Y = __Y`), which
// -Wuninitialized reports here: a false positive in the compiler's own header.
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "bf16_vec.h"

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using llmserve_native::load_bf16x16;

// e^x for x <= 0 (scores minus their maximum): 2^n * 2^r, |r| <= 1/2, degree-6 Taylor
// polynomial of 2^r (relative error ~1e-7), scaled by vscalefps (exact, underflows to 0).
inline __m512 exp_nonpositive(__m512 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-150.f)),
                                 _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.69314718055994531f));
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// In place: scores (-inf where masked) -> e^(s - peak), masked ones exactly 0; returns the sum.
float softmax_row(float* s, int64_t len, float peak) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  if (peak == neg_inf) {                              // no valid key: the output stays 0
    for (int64_t l = 0; l < len; ++l) s[l] = 0.f;
    return 0.f;
  }
  const __m512 top = _mm512_set1_ps(peak);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t l = 0; l < len; l += 16) {
    const __mmask16 in = len - l >= 16 ? static_cast<__mmask16>(0xFFFF)
                                       : static_cast<__mmask16>((1u << (len - l)) - 1);
    const __m512 x = _mm512_mask_loadu_ps(_mm512_set1_ps(neg_inf), in, s + l);
    const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(neg_inf), _CMP_NEQ_OQ);
    const __m512 p = _mm512_maskz_mov_ps(live, exp_nonpositive(_mm512_sub_ps(x, top)));
    _mm512_mask_storeu_ps(s + l, in, p);
    sum = _mm512_add_ps(sum, p);
  }
  return _mm512_reduce_add_ps(sum);
}

// Any head size (a multiple of 16) and group: loops and buffers sized at run time.
void decode_one(const uint16_t* q, const uint16_t* kc, const uint16_t* vc, const int64_t* slots,
                const bool* valid, int64_t len, int64_t g_heads, int64_t d, int64_t row_stride,
                float scale, float softcap, uint16_t* out, std::vector<float>& buf) {
  const int64_t chunks = d / 16;
  buf.assign(static_cast<size_t>(g_heads * (len + d) + g_heads * d), 0.f);
  float* scores = buf.data();                       // (G, len)
  float* qf = scores + g_heads * len;               // (G, D) query in float32
  float* acc = qf + g_heads * d;                    // (G, D) weighted sum of values
  for (int64_t i = 0; i < g_heads * d; ++i) {
    uint32_t bits = static_cast<uint32_t>(q[i]) << 16;
    std::memcpy(&qf[i], &bits, sizeof(float));
  }
  const float neg_inf = -std::numeric_limits<float>::infinity();
  std::vector<float> peak(g_heads, neg_inf);
  for (int64_t l = 0; l < len; ++l) {
    if (!valid[l]) {
      for (int64_t g = 0; g < g_heads; ++g) scores[g * len + l] = neg_inf;
      continue;
    }
    const uint16_t* krow = kc + slots[l] * row_stride;
    for (int64_t g = 0; g < g_heads; ++g) {
      __m512 s = _mm512_setzero_ps();
      for (int64_t c = 0; c < chunks; ++c)
        s = _mm512_fmadd_ps(_mm512_loadu_ps(qf + g * d + 16 * c), load_bf16x16(krow + 16 * c), s);
      float v = _mm512_reduce_add_ps(s) * scale;
      if (softcap > 0.f) v = std::tanh(v / softcap) * softcap;
      scores[g * len + l] = v;
      if (v > peak[g]) peak[g] = v;
    }
  }
  std::vector<float> total(g_heads, 0.f);
  for (int64_t g = 0; g < g_heads; ++g) total[g] = softmax_row(scores + g * len, len, peak[g]);
  for (int64_t l = 0; l < len; ++l) {
    if (!valid[l]) continue;
    const uint16_t* vrow = vc + slots[l] * row_stride;
    for (int64_t c = 0; c < chunks; ++c) {
      const __m512 v = load_bf16x16(vrow + 16 * c);
      for (int64_t g = 0; g < g_heads; ++g) {
        float* a = acc + g * d + 16 * c;
        _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_set1_ps(scores[g * len + l]), v,
                                            _mm512_loadu_ps(a)));
      }
    }
  }
  for (int64_t g = 0; g < g_heads; ++g) {
    const __m512 inv = _mm512_set1_ps(total[g] > 0.f ? 1.f / total[g] : 0.f);
    for (int64_t c = 0; c < chunks; ++c) {
      const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(acc + g * d + 16 * c), inv);
      const __m256bh o = _mm512_cvtneps_pbh(v);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + g * d + 16 * c), (__m256i)o);
    }
  }
}

// Sixteen vectors -> one: lane i holds the sum of v[i]'s sixteen lanes. Four levels of
// pairwise combines (45 shuffles and adds for 16 sums, against ~8 ops for each sum alone):
//
//   v[16] --unpack_ps, add--> a[8]  --unpack_pd, add--> b[4]   (each 128-bit lane: 4 sums'
//   partials, in order) --shuffle_f32x4, add--> d[2] --shuffle_f32x4, add--> r
inline __m512 sum_lanes16(const __m512* v) {
  __m512 a[8], b[4];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int j = 0; j < 4; ++j) {
    const __m512d x = _mm512_castps_pd(a[2 * j]), y = _mm512_castps_pd(a[2 * j + 1]);
    b[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(d0, d1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// The same computation with the head size and group as constants: the query pairs and the
// value sums stay in registers, q.k is DC/2 vdpbf16ps per key (exact products), and the
// scores of 16 keys are summed across lanes together (sum_lanes16) and stored as a vector.
template <int DC, int G>
void decode_fixed(const uint16_t* q, const uint16_t* kc, const uint16_t* vc,
                  const int64_t* slots, const bool* valid, int64_t len, int64_t row_stride,
                  float scale, float softcap, uint16_t* out, std::vector<float>& buf) {
  constexpr int d = DC * 16;
  const int64_t padded = (len + 15) / 16 * 16;
  buf.resize(static_cast<size_t>(G * padded));
  float* scores = buf.data();                       // (G, padded)
  __m512bh qp[G][DC / 2];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < DC / 2; ++c)
      qp[g][c] = (__m512bh)_mm512_loadu_si512(q + g * d + 32 * c);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const __m512 vneg_inf = _mm512_set1_ps(neg_inf), vscale = _mm512_set1_ps(scale);
  __m512 vpeak[G];
  for (int g = 0; g < G; ++g) vpeak[g] = vneg_inf;
  for (int64_t l0 = 0; l0 < len; l0 += 16) {
    const int n = len - l0 < 16 ? static_cast<int>(len - l0) : 16;
    __mmask16 live = 0;
    const uint16_t* krow[16];
    for (int i = 0; i < 16; ++i) {
      const bool in = i < n && valid[l0 + i];
      live = static_cast<__mmask16>(live | (static_cast<unsigned>(in) << i));
      krow[i] = in ? kc + slots[l0 + i] * row_stride : kc;   // masked keys read row 0
    }
    if (!live) {           // a block past a causal row's position or outside its window
      for (int g = 0; g < G; ++g) _mm512_storeu_ps(scores + g * padded + l0, vneg_inf);
      continue;
    }
    for (int g = 0; g < G; ++g) {
      __m512 part[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) {
        part[i] = _mm512_dpbf16_ps(_mm512_setzero_ps(), qp[g][0],
                                   (__m512bh)_mm512_loadu_si512(krow[i]));
#pragma GCC unroll 8
        for (int c = 1; c < DC / 2; ++c)
          part[i] = _mm512_dpbf16_ps(part[i], qp[g][c],
                                     (__m512bh)_mm512_loadu_si512(krow[i] + 32 * c));
      }
      __m512 s = _mm512_mul_ps(sum_lanes16(part), vscale);
      if (softcap > 0.f) {
        alignas(64) float t[16];
        _mm512_store_ps(t, s);
        for (int i = 0; i < 16; ++i) t[i] = std::tanh(t[i] / softcap) * softcap;
        s = _mm512_load_ps(t);
      }
      s = _mm512_mask_mov_ps(vneg_inf, live, s);
      vpeak[g] = _mm512_max_ps(s, vpeak[g]);   // a NaN score never becomes the peak
      _mm512_storeu_ps(scores + g * padded + l0, s);
    }
  }
  float inv[G];
  for (int g = 0; g < G; ++g) {
    const float total = softmax_row(scores + g * padded, len, _mm512_reduce_max_ps(vpeak[g]));
    inv[g] = total > 0.f ? 1.f / total : 0.f;
  }
  __m512 acc[G][DC];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < DC; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t l = 0; l < len; ++l) {
    if (!valid[l]) continue;
    const uint16_t* vrow = vc + slots[l] * row_stride;
    __m512 p[G];
    for (int g = 0; g < G; ++g) p[g] = _mm512_set1_ps(scores[g * padded + l]);
    for (int c = 0; c < DC; ++c) {
      const __m512 v = load_bf16x16(vrow + 16 * c);
      for (int g = 0; g < G; ++g) acc[g][c] = _mm512_fmadd_ps(p[g], v, acc[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < DC; ++c) {
      const __m256bh o = _mm512_cvtneps_pbh(_mm512_mul_ps(acc[g][c], _mm512_set1_ps(inv[g])));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + g * d + 16 * c), (__m256i)o);
    }
}

using FixedFn = void (*)(const uint16_t*, const uint16_t*, const uint16_t*, const int64_t*,
                         const bool*, int64_t, int64_t, float, float, uint16_t*,
                         std::vector<float>&);

// The fixed kernel of a head size and group, nullptr where decode_one serves: the groups of
// the common GQA models (up to 8 query heads a KV head). Past ~4 heads its registers spill,
// and it is still 2-3x decode_one (a 16 x 208-key call at 14 heads over 2: 132 against
// 365 us; 32 over 8 at 128: 773 against 1622 us). The choice follows the model's shape, so
// every row of a model, decoded or verified or prefilled, runs the same kernel.
FixedFn fixed_kernel(int64_t d, int64_t g) {
  if (d == 64) {
    switch (g) {
      case 1: return decode_fixed<4, 1>;
      case 2: return decode_fixed<4, 2>;
      case 3: return decode_fixed<4, 3>;
      case 4: return decode_fixed<4, 4>;
      case 5: return decode_fixed<4, 5>;
      case 6: return decode_fixed<4, 6>;
      case 7: return decode_fixed<4, 7>;   // Qwen2.5-0.5B: 14 heads over 2
      case 8: return decode_fixed<4, 8>;
      default: return nullptr;
    }
  }
  if (d == 128) {
    switch (g) {
      case 1: return decode_fixed<8, 1>;
      case 2: return decode_fixed<8, 2>;
      case 3: return decode_fixed<8, 3>;
      case 4: return decode_fixed<8, 4>;   // Llama-3.1-8B: 32 heads over 8
      case 5: return decode_fixed<8, 5>;
      case 6: return decode_fixed<8, 6>;
      case 7: return decode_fixed<8, 7>;   // Qwen2.5-7B: 28 over 4
      case 8: return decode_fixed<8, 8>;   // Qwen2.5-3B: 16 over 2
      default: return nullptr;
    }
  }
  return nullptr;
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& slots, const at::Tensor& valid, double scale,
                        double softcap) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kBFloat16,
              "paged_decode: q must be (B, H, D) bf16");
  TORCH_CHECK(k_cache.scalar_type() == at::kBFloat16 && v_cache.scalar_type() == at::kBFloat16 &&
                  k_cache.dim() == 3 && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_decode: caches must be contiguous (slots, Hkv, D) bf16 of one shape");
  const int64_t b = q.size(0), h = q.size(1), d = q.size(2), hkv = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == d && d % 16 == 0, "paged_decode: head size ", d,
              " must match the cache and be a multiple of 16");
  TORCH_CHECK(hkv > 0 && h % hkv == 0, "paged_decode: ", h, " heads over ", hkv, " KV heads");
  TORCH_CHECK(slots.scalar_type() == at::kLong && valid.scalar_type() == at::kBool &&
                  slots.dim() == 2 && slots.sizes() == valid.sizes() && slots.size(0) == b,
              "paged_decode: slots (B, L) int64 and valid (B, L) bool expected");
  const at::Tensor qc = q.contiguous(), sc = slots.contiguous(), vm = valid.contiguous();
  at::Tensor out = at::empty({b, h * d}, q.options());
  const int64_t len = sc.size(1), g_heads = h / hkv;
  if (b == 0) return out;
  const int64_t row_stride = hkv * d;
  const uint16_t* qp = reinterpret_cast<const uint16_t*>(qc.data_ptr());
  const uint16_t* kp = reinterpret_cast<const uint16_t*>(k_cache.data_ptr());
  const uint16_t* vp = reinterpret_cast<const uint16_t*>(v_cache.data_ptr());
  const int64_t* sp = sc.data_ptr<int64_t>();
  const bool* mp = vm.data_ptr<bool>();
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const FixedFn fixed = fixed_kernel(d, g_heads);
  at::parallel_for(0, b * hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / hkv, kvh = task % hkv;
      if (fixed) {
        fixed(qp + (i * h + kvh * g_heads) * d, kp + kvh * d, vp + kvh * d, sp + i * len,
              mp + i * len, len, row_stride, static_cast<float>(scale),
              static_cast<float>(softcap), op + (i * h + kvh * g_heads) * d, buf);
        continue;
      }
      decode_one(qp + (i * h + kvh * g_heads) * d, kp + kvh * d, vp + kvh * d, sp + i * len,
                 mp + i * len, len, g_heads, d, row_stride, static_cast<float>(scale),
                 static_cast<float>(softcap), op + (i * h + kvh * g_heads) * d, buf);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmserve_native, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, Tensor valid, "
        "float scale, float softcap) -> Tensor");
  m.impl("paged_decode", c10::DispatchKey::CPU, TORCH_FN(paged_decode));
}
