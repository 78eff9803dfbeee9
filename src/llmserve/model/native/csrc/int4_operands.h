// Operand checks shared by the int4 products (int4_mm, int4_a8_mm).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace llmserve_native {

struct Int4Operands {
  int64_t rows, k, strips, groups;
};

// x (M, K) contiguous bf16; packed (strips, K * 8) uint8: 16 channels x K codes of 4 bits per
// strip, in either kernel's layout; per-group scales (strips, K / group, 2, 16) of
// ``scale_type`` (``scale_desc`` names them in the error); the group a positive multiple of
// ``group_multiple`` dividing K.
inline Int4Operands check_int4_operands(const char* op, const at::Tensor& x,
                                        const at::Tensor& packed, const at::Tensor& scales,
                                        int64_t group_size, int64_t group_multiple,
                                        at::ScalarType scale_type, const char* scale_desc) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), op,
              ": x must be a contiguous 2-D bf16 tensor");
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous(),
              op, ": packed must be a contiguous 2-D uint8 tensor");
  const int64_t rows = x.size(0), k = x.size(1), strips = packed.size(0);
  TORCH_CHECK(group_size > 0 && group_size % group_multiple == 0 && k % group_size == 0, op,
              ": K=", k, " is not a multiple of the group size ", group_size,
              " (a multiple of ", group_multiple, ")");
  TORCH_CHECK(packed.size(1) == k * 8, op, ": packed weight is for K=", packed.size(1) / 8,
              ", x has K=", k);
  const int64_t groups = k / group_size;
  TORCH_CHECK(scales.scalar_type() == scale_type && scales.is_contiguous() &&
                  scales.dim() == 4 && scales.size(0) == strips && scales.size(1) == groups &&
                  scales.size(2) == 2 && scales.size(3) == 16,
              op, ": ", scale_desc, " (strips, K/group, 2, 16)");
  return {rows, k, strips, groups};
}

}  // namespace llmserve_native
