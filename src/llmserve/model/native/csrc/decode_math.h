// The AVX-512 decode attention kernels' shared parts (paged_decode.cpp for bf16 caches,
// paged_decode_q8.cpp for 8-bit ones): the softmax's exponential, the lane sums of sixteen
// keys' scores, and the split of a call's query rows over the threads. Both kernels run a
// row with this arithmetic in this order whatever else is in the call.
// _mm512_reduce_max_ps inlines GCC 12's `_mm256_undefined_pd` (`__Y = __Y`), which
// -Wuninitialized reports here: a false positive in the compiler's own header.
#pragma once
#pragma GCC diagnostic ignored "-Wuninitialized"

#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "decode_rows.h"

namespace llmserve_native {

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
inline float softmax_row(float* s, int64_t len, float peak) {
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

// Sixteen vectors -> one: lane i holds the sum of v[i]'s sixteen lanes, by four levels of
// pairwise combines (45 shuffles and adds for 16 sums, against ~8 ops for each sum alone):
// unpack_ps + add -> 8, unpack_pd + add -> 4, shuffle_f32x4 + add -> 2, -> 1.
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

// Runs every query row of a call through `row(i, kvh, task_hkv, keys, pull, prefetch_v, buf)`:
// a task a row (kvh 0, task_hkv = hkv: every KV head of the row), or a task per (row, KV
// head) (task_hkv 1) when there are fewer than two rows a thread (one sequence decoding must
// not leave a core idle); the same arithmetic either way. `keys`: the row's keys up to its
// last valid one (the keys past it would only add exact zeros). Tasks are split into
// contiguous ranges of about equal work; a row whose context the previous row of its range
// held (a prompt's causal rows, a draft's verified rows) finds it in cache (`pull` false).
// `prefetch_v`: a task a row, whose V rows are worth requesting while its K rows are scored.
template <typename RowFn>
void run_decode_tasks(int64_t b, int64_t hkv, const int64_t* slots, const bool* valid,
                      int64_t len, RowFn&& row) {
  const int64_t threads = at::get_num_threads();
  const int64_t per_row = b < 2 * threads ? hkv : 1, tasks = b * per_row;
  const int64_t parts = std::min(threads, tasks);
  std::vector<int64_t> keys(static_cast<size_t>(b));
  for (int64_t i = 0; i < b; ++i) keys[i] = valid_length(valid + i * len, len);
  const std::vector<int64_t> bounds = balanced_bounds(keys, tasks, per_row, parts);
  // row i - 1 held row i's context when it starts with the same slot and has row i's
  // next-to-last key in the same slot (not another sequence sharing a cached prefix)
  auto previous_row_held = [&](int64_t i) {
    const int64_t last = keys[i] - 2;
    return keys[i - 1] > std::max<int64_t>(last, 0) && slots[i * len] == slots[(i - 1) * len] &&
           (last <= 0 || slots[i * len + last] == slots[(i - 1) * len + last]);
  };
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf;
    for (int64_t part = begin; part < end; ++part)
      for (int64_t t = bounds[part]; t < bounds[part + 1]; ++t) {
        const int64_t i = t / per_row;
        const bool pull = t == bounds[part] || per_row > 1 || !previous_row_held(i);
        row(i, per_row == 1 ? 0 : t % per_row, per_row == 1 ? hkv : 1, keys[i], pull,
            per_row == 1, buf);
      }
  });
}

}  // namespace llmserve_native
