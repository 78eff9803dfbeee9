// Rotary position embedding of many rows: llmserve_native::rotate_qk.
//
// For each token t and head, with c = cos_sin[pos[t], i] and s = cos_sin[pos[t], d/2 + i]
// (a float32 [cos | sin] table) and the half-split pairs (x_i, y_i = x_{d/2 + i}):
//
//     x' = bf16(x c - y s)        y' = bf16(y c + x s)          (float32, products rounded)
//
// the operations and roundings of layers/rotary.py's PyTorch expression (each product
// rounded to float32, then the sum; no fused multiply-add: this file is built without
// contraction for that), so a prefill chunk's rotated rows equal those of the compiled
// decode step and of eager steps bit for bit. It replaces the compiled many-row function
// of prefill chunks, ~5x slower at 416 rows; one task a block of rows, each element on its
// own.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "bf16_vec.h"

#include <immintrin.h>

#include <cstdint>
#include <tuple>

namespace {

using llmserve_native::first_lanes16;
using llmserve_native::load_bf16x16_masked;

// x' and y' of one head's `half` pairs
__attribute__((optimize("fp-contract=off"))) void rotate_head(const uint16_t* in, uint16_t* out,
                                                                const float* cs, int64_t half) {
  for (int64_t i = 0; i < half; i += 16) {
    const __mmask16 m = first_lanes16(half - i);
    const __m512 x = load_bf16x16_masked(in + i, m), y = load_bf16x16_masked(in + half + i, m);
    const __m512 c = _mm512_maskz_loadu_ps(m, cs + i), s = _mm512_maskz_loadu_ps(m, cs + half + i);
    const __m512 xc = _mm512_mul_ps(x, c), ys = _mm512_mul_ps(y, s);
    const __m512 yc = _mm512_mul_ps(y, c), xs = _mm512_mul_ps(x, s);
    const __m512 rx = _mm512_sub_ps(xc, ys), ry = _mm512_add_ps(yc, xs);
    _mm256_mask_storeu_epi16(out + i, m, (__m256i)_mm512_cvtneps_pbh(rx));
    _mm256_mask_storeu_epi16(out + half + i, m, (__m256i)_mm512_cvtneps_pbh(ry));
  }
}

// A (T, H, D) bf16 view whose heads are contiguous rows of D (a split of a fused projection)
void check_heads(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kBFloat16 && x.stride(2) == 1 &&
                  x.stride(1) == x.size(2),
              "rotate_qk: ", name, " must be (T, H, D) bf16 with contiguous heads");
}

at::Tensor rotated(const at::Tensor& x, const float* table, const int64_t* pos) {
  const int64_t t = x.size(0), h = x.size(1), d = x.size(2), half = d / 2;
  at::Tensor out = at::empty({t, h, d}, x.options());
  const auto* in = reinterpret_cast<const uint16_t*>(x.data_ptr());
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t ld = x.stride(0);
  at::parallel_for(0, t, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t head = 0; head < h; ++head)
        rotate_head(in + r * ld + head * d, o + (r * h + head) * d, table + pos[r] * d, half);
    }
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> rotate_qk(const at::Tensor& cos_sin, const at::Tensor& positions,
                                             const at::Tensor& q, const at::Tensor& k) {
  check_heads(q, "q");
  check_heads(k, "k");
  TORCH_CHECK(cos_sin.dim() == 2 && cos_sin.scalar_type() == at::kFloat && cos_sin.is_contiguous() &&
                  cos_sin.size(1) == q.size(2) && q.size(2) == k.size(2) && q.size(2) % 2 == 0,
              "rotate_qk: cos_sin must be a contiguous (positions, D) float32 table, D even and "
              "equal to q's and k's head size");
  TORCH_CHECK(positions.dim() == 1 && positions.scalar_type() == at::kLong &&
                  positions.size(0) == q.size(0) && k.size(0) == q.size(0),
              "rotate_qk: positions (T,) int64 for T rows of q and k");
  const at::Tensor pc = positions.contiguous();
  const float* table = cos_sin.data_ptr<float>();
  const int64_t* pos = pc.data_ptr<int64_t>();
  for (int64_t r = 0; r < pc.size(0); ++r)
    TORCH_CHECK(pos[r] >= 0 && pos[r] < cos_sin.size(0), "rotate_qk: position ", pos[r],
                " outside the table of ", cos_sin.size(0), " positions");
  return {rotated(q, table, pos), rotated(k, table, pos)};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmserve_native, m) {
  m.def("rotate_qk(Tensor cos_sin, Tensor positions, Tensor q, Tensor k) -> (Tensor, Tensor)");
  m.impl("rotate_qk", c10::DispatchKey::CPU, TORCH_FN(rotate_qk));
}
