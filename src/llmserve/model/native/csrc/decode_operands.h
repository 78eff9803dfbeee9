// Operand checks shared by the paged decode kernels (paged_decode.cpp, paged_decode_q8.cpp,
// avx2/paged_decode_avx2.cpp).
#pragma once

#include <ATen/core/Tensor.h>

namespace llmserve_native {

// What every paged decode kernel checks beyond its cache's dtype and row width: the query
// heads a multiple of the cache's KV heads; slots (B, L) int64 and valid (B, L) bool.
inline void check_decode_rows(const at::Tensor& q, const at::Tensor& k_cache,
                              const at::Tensor& slots, const at::Tensor& valid) {
  const int64_t h = q.size(1), hkv = k_cache.size(1);
  TORCH_CHECK(hkv > 0 && h % hkv == 0, "paged_decode: ", h, " heads over ", hkv, " KV heads");
  TORCH_CHECK(slots.scalar_type() == at::kLong && valid.scalar_type() == at::kBool &&
                  slots.dim() == 2 && slots.sizes() == valid.sizes() &&
                  slots.size(0) == q.size(0),
              "paged_decode: slots (B, L) int64 and valid (B, L) bool expected");
}

// q (B, H, D) of `dtype` (bf16, or float32 where `float_ok`); k_cache and v_cache contiguous
// (slots, Hkv, D) of q's dtype and one shape, D a multiple of 16 and H a multiple of Hkv;
// slots (B, L) int64 and valid (B, L) bool.
inline void check_decode_operands(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& slots,
                                  const at::Tensor& valid, bool float_ok) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK(q.dim() == 3 && (dtype == at::kBFloat16 || (float_ok && dtype == at::kFloat)),
              "paged_decode: q must be (B, H, D) ", float_ok ? "bf16 or float32" : "bf16");
  TORCH_CHECK(k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype &&
                  k_cache.dim() == 3 && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_decode: caches must be contiguous (slots, Hkv, D) of q's dtype, one shape");
  const int64_t d = q.size(2);
  TORCH_CHECK(k_cache.size(2) == d && d % 16 == 0, "paged_decode: head size ", d,
              " must match the cache and be a multiple of 16");
  check_decode_rows(q, k_cache, slots, valid);
}

// q (B, H, D) bf16 or float32 over 8-bit caches (model/quant/kv.py): k_cache and v_cache
// contiguous (slots, Hkv, D + 4) int8 or float8_e4m3fn of one shape and dtype (each row D
// codes, then the 4 bytes of its float32 scale), D a multiple of 8 and H a multiple of Hkv;
// slots (B, L) int64 and valid (B, L) bool.
inline void check_code_decode_operands(const at::Tensor& q, const at::Tensor& k_cache,
                                       const at::Tensor& v_cache, const at::Tensor& slots,
                                       const at::Tensor& valid) {
  TORCH_CHECK(q.dim() == 3 && (q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat),
              "paged_decode: q must be (B, H, D) bf16 or float32 over an int8 or fp8 cache");
  const auto code = k_cache.scalar_type();
  TORCH_CHECK((code == at::kChar || code == at::kFloat8_e4m3fn) &&
                  v_cache.scalar_type() == code && k_cache.dim() == 3 &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous(),
              "paged_decode: int8 or fp8 caches must be contiguous (slots, Hkv, D + 4), one "
              "shape and dtype");
  const int64_t d = q.size(2);
  TORCH_CHECK(k_cache.size(2) == d + 4 && d % 8 == 0, "paged_decode: head size ", d,
              " must be a multiple of 8, with rows of D + 4 in the int8 or fp8 cache");
  check_decode_rows(q, k_cache, slots, valid);
}

}  // namespace llmserve_native
