// Float32 dense products, one summation order for every row count: <library>::f32_mm.
//
//   x (M, K) float32, packed (S, K * 16) float32 (strip s holds output channels 16s..16s+15,
//   k-major: element 16k + c is w[16s + c][k]; N padded with zero rows) -> y (M, 16 S)
//
//   y[m, n] = fma(x[m, K-1], w[n, K-1], ... fma(x[m, 1], w[n, 1], x[m, 0] * w[n, 0]))
//
// one fused multiply-add per k, in k order, for every output: the same bits whether a row
// is multiplied alone, in a tile of up to six rows or among hundreds, on either thread.
// PyTorch's float32 GEMM (MKL) picks its kernel by the row count, and a row's sums moved by
// ~1e-5 between 1, 2, 3 or 5 rows and a batch: with float32 weights (a dense checkpoint on a
// CPU without native bf16, the avx2 tier's default) a sequence's logits then depended on
// what shared its step (tests/model/test_batch_invariance.py).
//
// Plain C++: a strip's 16 accumulators a row are 16 independent lanes the compiler
// vectorizes for the library's tier (two ymm or one zmm); the rows of a tile share each
// weight load: 6 rows with AVX-512 (6 zmm accumulators), 4 with avx2 (8 ymm, the rest of
// the 16 registers for operands). A row of products streams the weights once (decodes: the
// read bandwidth bounds it). Rows go in blocks of 64 and the strips of a block over the
// threads, so a block's rows stay in cache while the weights stream by. Built into each
// tier's library; LLMSERVE_LIBRARY names the namespace.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>

#ifndef LLMSERVE_LIBRARY
#error "LLMSERVE_LIBRARY must name the operator namespace (llmserve_native, llmserve_avx2)"
#endif

namespace {

constexpr int kStrip = 16;    // output channels a strip
constexpr int64_t kBlockRows = 64;   // rows whose strips the threads share at a time
#ifdef __AVX512F__
constexpr int kMaxRows = 6;   // rows a tile: 6 zmm accumulators
#else
constexpr int kMaxRows = 4;   // rows a tile: 8 ymm accumulators, the rest for operands
#endif

// Rows [0, R) of x against one strip: R x 16 sums over k, each in k order.
template <int R>
void strip_rows(const float* __restrict x, int64_t ldx, const float* __restrict w, int64_t k,
                float* __restrict y, int64_t ldy) {
  float acc[R][kStrip];
  for (int r = 0; r < R; ++r) {
    const float xv = x[r * ldx];
#pragma GCC unroll 16
    for (int c = 0; c < kStrip; ++c) acc[r][c] = xv * w[c];
  }
  for (int64_t i = 1; i < k; ++i) {
    const float* wi = w + i * kStrip;
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * ldx + i];
#pragma GCC unroll 16
      for (int c = 0; c < kStrip; ++c) acc[r][c] = __builtin_fmaf(xv, wi[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int c = 0; c < kStrip; ++c) y[r * ldy + c] = acc[r][c];
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t);
constexpr TileFn kTiles[7] = {nullptr,       strip_rows<1>, strip_rows<2>, strip_rows<3>,
                              strip_rows<4>, strip_rows<5>, strip_rows<6>};

at::Tensor f32_mm(const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() &&
                  x.device().is_cpu() && packed.device().is_cpu(),
              "f32_mm: x must be a contiguous float32 (M, K) CPU tensor (and packed on the "
              "CPU), got ", x.scalar_type(), " ", x.sizes());
  const int64_t rows = x.size(0), k = x.size(1);
  TORCH_CHECK(k > 0, "f32_mm: K must be positive");
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kFloat &&
                  packed.is_contiguous() && packed.size(1) == k * kStrip,
              "f32_mm: packed must be contiguous float32 (S, K * 16) for K = ", k, ", got ",
              packed.scalar_type(), " ", packed.sizes());
  const int64_t strips = packed.size(0), n = strips * kStrip;
  at::Tensor y = at::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t b0 = 0; b0 < rows; b0 += kBlockRows) {
    const int64_t b1 = rows - b0 < kBlockRows ? rows : b0 + kBlockRows;
    at::parallel_for(0, strips, 1, [&](int64_t begin, int64_t end) {
      for (int64_t s = begin; s < end; ++s)
        for (int64_t r0 = b0; r0 < b1; r0 += kMaxRows) {
          const int64_t tile = b1 - r0 < kMaxRows ? b1 - r0 : kMaxRows;
          kTiles[tile](xp + r0 * k, k, wp + s * k * kStrip, k, yp + r0 * n + s * kStrip, n);
        }
    });
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(LLMSERVE_LIBRARY, m) {
  m.def("f32_mm(Tensor x, Tensor packed) -> Tensor");
  m.impl("f32_mm", c10::DispatchKey::CPU, TORCH_FN(f32_mm));
}
