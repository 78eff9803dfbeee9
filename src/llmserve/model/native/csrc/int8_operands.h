// Operand checks shared by the int8 products (int8_mm, int8_a8_mm), as int4_operands.h is
// for the int4 ones.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace llmserve_native {

struct Int8Operands {
  int64_t rows, k, strips;
};

// x (M, K) contiguous bf16; packed (strips, K * 16) contiguous of ``packed_type`` (named
// ``packed_desc`` in the error): 16 channels x K one-byte codes per strip, in either
// kernel's layout; scale bf16, one value per (padded) channel. ``k_ok`` is the kernel's own
// rule on K, ``k_rule`` its words ("even", "a positive multiple of 32").
inline Int8Operands check_int8_operands(const char* op, const at::Tensor& x,
                                        const at::Tensor& packed, const at::Tensor& scale,
                                        at::ScalarType packed_type, const char* packed_desc,
                                        bool (*k_ok)(int64_t), const char* k_rule) {
  constexpr int64_t kStrip = 16;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), op,
              ": x must be a contiguous 2-D bf16 tensor");
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == packed_type && packed.is_contiguous(),
              op, ": packed must be a contiguous 2-D ", packed_desc, " tensor");
  const int64_t rows = x.size(0), k = x.size(1), strips = packed.size(0);
  TORCH_CHECK(k_ok(k) && packed.size(1) == k * kStrip, op, ": packed weight is for K=",
              packed.size(1) / kStrip, ", x has K=", k, " (K must be ", k_rule, ")");
  TORCH_CHECK(scale.scalar_type() == at::kBFloat16 && scale.is_contiguous() &&
                  scale.numel() == strips * kStrip,
              op, ": scale must be contiguous bf16 with one value per (padded) channel");
  return {rows, k, strips};
}

}  // namespace llmserve_native
