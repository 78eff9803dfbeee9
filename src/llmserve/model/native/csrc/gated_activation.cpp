// The SwiGLU activation of a fused [gate | up] projection: llmserve_native::silu_mul.
//
//   y[t, i] = bf16( bf16(silu(gate[t, i])) * up[t, i] ),  silu(g) = g / (1 + exp(-g))
//
// computed in float32 with the roundings of PyTorch's bf16 `F.silu(gate) * up` (the silu
// rounded to bf16, then the product rounded), so the result is that expression's up to the
// last bits of exp. It replaces inductor's loop for the same expression (in the compiled
// steps) and the compiled many-row function (in prefill chunks) with one kernel whose exp is
// a short polynomial instead of Sleef's: ~0.75x the compiled function's time at 416 rows.
// Every path of a model calls this one kernel (layers/norm.py), and each element is computed
// on its own, so a row's bits never depend on the batch, the thread split or the path.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "bf16_vec.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace {

using llmserve_native::first_lanes16;
using llmserve_native::load_bf16x16_masked;
using llmserve_native::widen_bf16x16;


constexpr int64_t kChunk = 256;        // columns of one task
constexpr int64_t kParallelMin = 16384; // outputs below which one thread does it all

// bf16 rounding (to nearest even, NaN kept) and back, as a float32 value
inline __m512 round_bf16(__m512 v) {
  return widen_bf16x16((__m256i)_mm512_cvtneps_pbh(v));
}

// exp(x) in float32: x = n ln2 + r (Cody-Waite, |r| <= ln2 / 2), e^r by a degree-6
// polynomial (a few ulp), scaled by 2^n. Inputs are clamped to [-104, 89]: below, exp
// is 0 in float32 (here 0 or the smallest subnormal, which 1 + e cannot tell apart); above,
// 2^n overflows to +inf as float32's exp does. A NaN input is lost to the clamp; the
// caller's numerator carries it.
inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(89.0f)), _mm512_set1_ps(-104.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// columns [c0, c1) of one row; the tail through masked loads and stores
inline void silu_mul_cols(const uint16_t* gate, const uint16_t* up, uint16_t* y, int64_t c0,
                          int64_t c1) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t c = c0; c < c1; c += 16) {
    const __mmask16 m = first_lanes16(c1 - c);
    const __m512 g = load_bf16x16_masked(gate + c, m), u = load_bf16x16_masked(up + c, m);
    const __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g));
    const __m512 s = round_bf16(_mm512_div_ps(g, _mm512_add_ps(one, e)));
    _mm256_mask_storeu_epi16(y + c, m, (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(s, u)));
  }
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == at::kBFloat16 &&
                  gate_up.stride(1) == 1,
              "silu_mul: gate_up must be a 2-D bf16 tensor with contiguous rows");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_mul: gate_up's last dimension (",
              gate_up.size(1), ") must be even: [gate | up]");
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2, ld = gate_up.stride(0);
  at::Tensor out = at::empty({rows, width}, gate_up.options());
  if (rows == 0 || width == 0) return out;
  const auto* in = reinterpret_cast<const uint16_t*>(gate_up.data_ptr());
  auto* y = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t chunks = (width + kChunk - 1) / kChunk;
  const auto run = [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t row = t / chunks, c0 = (t % chunks) * kChunk;
      const uint16_t* g = in + row * ld;
      silu_mul_cols(g, g + width, y + row * width, c0, std::min(c0 + kChunk, width));
    }
  };
  if (rows * width < kParallelMin) {
    run(0, rows * chunks);
  } else {
    at::parallel_for(0, rows * chunks, 1, run);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmserve_native, m) {
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.impl("silu_mul", c10::DispatchKey::CPU, TORCH_FN(silu_mul));
}
