// Paged decode attention for bf16 KV caches on AVX-512 CPUs: llmserve_native::paged_decode.
//
//   q (B, H, D) bf16, k_cache/v_cache (slots, Hkv, D) bf16, slots (B, L) int64 cache rows,
//   valid (B, L) bool -> out (B, H * D) bf16, for query heads grouped over KV heads
//   (head h reads KV head h / (H / Hkv)). The same arithmetic as the reference backend:
//   float32 scores s = scale * q.k (optionally softcap * tanh(s / softcap)), a softmax over
//   the valid keys, float32 sums of p * v.
//
// The common GQA shapes (head size 64 or 128, up to 8 query heads a KV head) run one task a
// query row: every head of the row reads each K row and V row where it lives in the cache
// (no gathered copy of the context), after the row's keys are pulled into cache chunk by
// chunk; rows are split over the threads by their keys. Other shapes run one task per
// (row, KV head).
// _mm512_reduce_max_ps inlines GCC 12's `_mm256_undefined_pd` (`__Y = __Y`), which
// -Wuninitialized reports here: a false positive in the compiler's own header.
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "bf16_vec.h"
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
using llmserve_native::load_bf16x16;
using llmserve_native::request_rows;
using llmserve_native::pull_rows;
using llmserve_native::softmax_row;
using llmserve_native::sum_lanes16;

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

// One query row (all its KV heads, or one: hkv = 1 and the pointers at that head) with the
// head size and group as constants.
// The row's context is walked in chunks of kPullKeys keys: a chunk's K rows are pulled
// (when `pull`), then every head scores them (q.k as DC/2 vdpbf16ps per key and head, exact
// products; the scores of 16 keys summed across lanes together, sum_lanes16), while the V
// rows of the same keys are requested into L2 (`prefetch_v`: a task a row); after the
// softmax, each chunk's V rows are pulled and every head sums p * v over them. Per query
// head and key the arithmetic and its order do not depend on the other rows of the call.
template <int DC, int G>
void decode_row(const uint16_t* q, const uint16_t* kc, const uint16_t* vc, const int64_t* slots,
                const bool* valid, int64_t len, int64_t hkv, int64_t row_stride, float scale,
                float softcap, bool pull, bool prefetch_v, uint16_t* out,
                std::vector<float>& buf) {
  constexpr int d = DC * 16;
  const int64_t padded = (len + 15) / 16 * 16, heads = hkv * G;
  buf.resize(static_cast<size_t>(heads * (padded + d + 17)));
  float* scores = buf.data();                  // (heads, padded)
  float* sums = scores + heads * padded;       // (heads, d): value sums between chunks
  float* peaks = sums + heads * d;             // (heads, 16): running vector maxima
  float* inv = peaks + heads * 16;             // (heads): 1 / the softmax's total
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const __m512 vneg_inf = _mm512_set1_ps(neg_inf), vscale = _mm512_set1_ps(scale);
  for (int64_t h = 0; h < heads; ++h) _mm512_storeu_ps(peaks + 16 * h, vneg_inf);
  for (int64_t l0 = 0; l0 < len; l0 += 16) {
    if (pull && l0 % kPullKeys == 0)
      pull_rows(kc, slots, valid, l0, std::min(len, l0 + kPullKeys), row_stride, hkv * d);
    const int n = len - l0 < 16 ? static_cast<int>(len - l0) : 16;
    if (pull && prefetch_v)
      request_rows<_MM_HINT_T1>(vc, slots, valid, l0, l0 + n, row_stride, hkv * d);
    __mmask16 live = 0;
    const uint16_t* krow[16];
    for (int i = 0; i < 16; ++i) {
      const bool in = i < n && valid[l0 + i];
      live = static_cast<__mmask16>(live | (static_cast<unsigned>(in) << i));
      krow[i] = in ? kc + slots[l0 + i] * row_stride : kc;   // masked keys read row 0
    }
    if (!live) {           // a block past a causal row's position or outside its window
      for (int64_t h = 0; h < heads; ++h) _mm512_storeu_ps(scores + h * padded + l0, vneg_inf);
      continue;
    }
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t kv_offset = (h / G) * d;
      __m512bh qp[DC / 2];
      for (int c = 0; c < DC / 2; ++c) qp[c] = (__m512bh)_mm512_loadu_si512(q + h * d + 32 * c);
      __m512 part[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) {
        const uint16_t* k = krow[i] + kv_offset;
        part[i] = _mm512_dpbf16_ps(_mm512_setzero_ps(), qp[0], (__m512bh)_mm512_loadu_si512(k));
#pragma GCC unroll 8
        for (int c = 1; c < DC / 2; ++c)
          part[i] = _mm512_dpbf16_ps(part[i], qp[c], (__m512bh)_mm512_loadu_si512(k + 32 * c));
      }
      __m512 s = _mm512_mul_ps(sum_lanes16(part), vscale);
      if (softcap > 0.f) {
        alignas(64) float t[16];
        _mm512_store_ps(t, s);
        for (int i = 0; i < 16; ++i) t[i] = std::tanh(t[i] / softcap) * softcap;
        s = _mm512_load_ps(t);
      }
      s = _mm512_mask_mov_ps(vneg_inf, live, s);
      // a NaN score never becomes the peak
      _mm512_storeu_ps(peaks + 16 * h, _mm512_max_ps(s, _mm512_loadu_ps(peaks + 16 * h)));
      _mm512_storeu_ps(scores + h * padded + l0, s);
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
    if (pull) pull_rows(vc, slots, valid, l0, l1, row_stride, hkv * d);
    for (int64_t kvh = 0; kvh < hkv; ++kvh) {
      float* head_sums = sums + kvh * G * d;
      __m512 acc[G][DC];
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < DC; ++c) acc[g][c] = _mm512_loadu_ps(head_sums + g * d + 16 * c);
      for (int64_t l = l0; l < l1; ++l) {
        if (!valid[l]) continue;
        const uint16_t* vrow = vc + slots[l] * row_stride + kvh * d;
        __m512 p[G];
        for (int g = 0; g < G; ++g) p[g] = _mm512_set1_ps(scores[(kvh * G + g) * padded + l]);
        for (int c = 0; c < DC; ++c) {
          const __m512 v = load_bf16x16(vrow + 16 * c);
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

using RowFn = void (*)(const uint16_t*, const uint16_t*, const uint16_t*, const int64_t*,
                      const bool*, int64_t, int64_t, int64_t, float, float, bool, bool,
                      uint16_t*, std::vector<float>&);

template <int DC>
RowFn fixed_kernel_of(int64_t g) {
  switch (g) {
    case 1: return decode_row<DC, 1>;
    case 2: return decode_row<DC, 2>;
    case 3: return decode_row<DC, 3>;
    case 4: return decode_row<DC, 4>;
    case 5: return decode_row<DC, 5>;
    case 6: return decode_row<DC, 6>;
    case 7: return decode_row<DC, 7>;
    case 8: return decode_row<DC, 8>;
    default: return nullptr;
  }
}

// The fixed kernel of a head size and group, nullptr where decode_one serves: the groups of
// the common GQA models (up to 8 query heads a KV head: Qwen2.5-0.5B 14 heads over 2 at 64;
// Llama-3.1-8B 32 over 8, Qwen2.5-7B 28 over 4, Qwen2.5-3B 16 over 2 at 128). Past ~4 heads
// its registers spill, and it is still 2-3x decode_one (a 16 x 208-key call at 14 heads
// over 2: 132 against 365 us; 32 over 8 at 128: 773 against 1622 us). The choice follows
// the model's shape, so every row of a model, decoded or verified or prefilled, runs the
// same kernel.
RowFn fixed_kernel(int64_t d, int64_t g) {
  return d == 64 ? fixed_kernel_of<4>(g) : d == 128 ? fixed_kernel_of<8>(g) : nullptr;
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& slots, const at::Tensor& valid, double scale,
                        double softcap) {
  llmserve_native::check_decode_operands(q, k_cache, v_cache, slots, valid, false);
  const int64_t b = q.size(0), h = q.size(1), d = q.size(2), hkv = k_cache.size(1);
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
  const RowFn fixed = fixed_kernel(d, g_heads);
  if (fixed) {
    llmserve_native::run_decode_tasks(
        b, hkv, sp, mp, len, [&](int64_t i, int64_t kvh, int64_t task_hkv, int64_t keys,
                                 bool pull, bool prefetch_v, std::vector<float>& buf) {
          const int64_t head = i * h + kvh * g_heads, kv_offset = kvh * d;
          // a task a row: the next row's first keys into L2, unless it reads this row's
          // context (a prompt's causal rows start at the same slot)
          if (prefetch_v && i + 1 < b && sp[(i + 1) * len] != sp[i * len])
            request_rows<_MM_HINT_T2>(kp, sp + (i + 1) * len, mp + (i + 1) * len, 0,
                                    std::min(len, llmserve_native::kNextRowKeys),
                                    row_stride, hkv * d);
          fixed(qp + head * d, kp + kv_offset, vp + kv_offset, sp + i * len, mp + i * len,
                keys, task_hkv, row_stride, static_cast<float>(scale),
                static_cast<float>(softcap), pull, prefetch_v, op + head * d, buf);
        });
    return out;
  }
  at::parallel_for(0, b * hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / hkv, kvh = task % hkv;
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
