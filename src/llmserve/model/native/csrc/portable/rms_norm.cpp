// RMSNorm of rows, one summation order for every row count: <library>::rms_norm.
//
//   y[t, i] = round( (x[t, i] * r[t]) * w[i] ),
//   r[t] = 1 / sqrt(float(sum_i x[t, i]^2 / n) + eps)
//
// in float32, rounded once to the input's dtype (bf16 or float32): the operations of
// PyTorch's `F.rms_norm`, except that the mean of squares is summed in float64 (then
// rounded to float32), in a fixed order: element i goes to accumulator i mod 16, each
// accumulator adds its elements in column order, then the 16 are added pairwise (8 + 8,
// 4 + 4, 2 + 2, 1 + 1). A row's bits therefore do not depend on how many rows share the
// call, on the thread split, or on the path that calls it (the compiled decode and verify
// steps, eager prefill chunks): inductor and ATen each pick a float32 reduction order per
// graph and shape, and a row normed in a step of 64 or more rows came out a few ulp apart
// from the same row normed alone, enough to flip a greedy token
// (tests/model/test_batch_invariance.py). The float64 sum is the nearest to the exact mean:
// a float32 sum in one fixed order or another moved the default model's quality-gate
// perplexity between +0.3% and +0.9% of fp32's (docs/BENCHMARKS.md); a norm is a small
// part of a step, and the wider sum costs nothing measurable there.
//
// Plain C++ without intrinsics and without contracted multiply-adds: the compiler
// vectorizes the 16 accumulators for the library's CPU tier, and every tier computes the
// same bits. Built into each tier's library; LLMSERVE_LIBRARY names the operator namespace.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#ifndef LLMSERVE_LIBRARY
#error "LLMSERVE_LIBRARY must name the operator namespace (llmserve_native, llmserve_avx2)"
#endif

namespace {

constexpr int kLanes = 16;              // accumulators of a row's sum of squares
constexpr int64_t kParallelMin = 32768; // elements below which one thread does it all

inline float widen(uint16_t v) {
  const uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline float widen(float v) { return v; }

// float32 -> bf16, round to nearest even; a NaN stays a (quiet) NaN
inline uint16_t narrow(float f, uint16_t) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline float narrow(float f, float) { return f; }

template <typename T>
__attribute__((optimize("fp-contract=off"))) void norm_row(const T* x, const T* w, T* y,
                                                           int64_t n, float eps) {
  double acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      const double v = widen(x[i + l]);
      acc[l] += v * v;
    }
  }
  for (int l = 0; i + l < n; ++l) {   // the tail: the first lanes
    const double v = widen(x[i + l]);
    acc[l] += v * v;
  }
  for (int width = kLanes / 2; width >= 1; width /= 2) {
    for (int l = 0; l < width; ++l) acc[l] += acc[l + width];
  }
  const float mean = static_cast<float>(acc[0] / static_cast<double>(n));
  const float r = 1.0f / std::sqrt(mean + eps);
  for (int64_t c = 0; c < n; ++c) y[c] = narrow((widen(x[c]) * r) * widen(w[c]), T{});
}

template <typename T>
void norm_rows(const at::Tensor& x, const at::Tensor& weight, at::Tensor& out, float eps) {
  const int64_t rows = x.size(0), n = x.size(1), ld = x.stride(0);
  const T* in = reinterpret_cast<const T*>(x.data_ptr());
  const T* w = reinterpret_cast<const T*>(weight.data_ptr());
  T* y = reinterpret_cast<T*>(out.data_ptr());
  const auto run = [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) norm_row(in + t * ld, w, y + t * n, n, eps);
  };
  if (rows * n < kParallelMin) {
    run(0, rows);
  } else {
    at::parallel_for(0, rows, 1, run);
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1,
              "rms_norm: x must be 2-D with contiguous rows, got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "rms_norm: x must be bf16 or float32, got ", x.scalar_type());
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              "rms_norm: weight must be a contiguous (", x.size(1), ") tensor of x's dtype");
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  if (x.size(0) == 0 || x.size(1) == 0) return out;
  if (x.scalar_type() == at::kBFloat16) {
    norm_rows<uint16_t>(x, weight, out, static_cast<float>(eps));
  } else {
    norm_rows<float>(x, weight, out, static_cast<float>(eps));
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(LLMSERVE_LIBRARY, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(rms_norm));
}
