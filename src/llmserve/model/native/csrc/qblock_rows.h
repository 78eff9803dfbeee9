// Rows of a packed GGUF block table decoded to float32: llmserve_native::qblock_rows, the
// embedding lookup of a GGUF token table whose LM head runs qblock_a8_mm on the same bytes
// (qblock_int8_gemm.cpp documents the layout: strips of 16 rows, per block of 32 k's the
// nibble or byte codes and the bit planes, then the per-block and per-super-block scales).
// qblock_int8_gemm.cpp includes this header and registers the op: one translation unit, so
// the library build parses torch's headers once for both.
//
// Each value is what BlockCodes.dequantize (and so gguf's own dequantizer) gives, rounded the
// same way: d * sc is exact in float32 and every other product and sum is rounded on its own,
// so the decoding is built without fused multiply-adds (GCC's optimize attribute below,
// clang's pragma).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <optional>

namespace llmserve_native::qblock_table {

constexpr int kStrip = 16;
constexpr int kBlock = 32;
constexpr int kSuperBlocks = 8;   // blocks of 32 per K-quant super-block of 256
enum Mode : int { kF16 = 0, kK32 = 1, kK16 = 2, kF16S = 3 };

// The 32 unsigned codes of channel c of a strip in one block of BITS-bit codes.
inline void block_codes(const uint8_t* wb, int64_t bits, int c, int32_t (&u)[kBlock]) {
  if (bits == 8) {
    for (int o = 0; o < 8; ++o)
      for (int j = 0; j < 4; ++j) u[4 * o + j] = wb[64 * o + 4 * c + j];
    return;
  }
  for (int o = 0; o < 4; ++o)
    for (int j = 0; j < 4; ++j) {
      const uint8_t byte = wb[64 * o + 4 * c + j];
      u[8 * o + j] = byte & 15;
      u[8 * o + 4 + j] = byte >> 4;
    }
  for (int p = 0; p < bits - 4; ++p)
    for (int o = 0; o < 4; ++o)
      for (int v = 0; v < 2; ++v) {
        const int byte = wb[256 + 64 * p + 16 * o + 8 * v + c / 2] >> (4 * (c & 1));
        for (int j = 0; j < 4; ++j) u[8 * o + 4 * v + j] |= ((byte >> j) & 1) << (4 + p);
      }
}

inline float half_at(const void* p, int64_t i) {
  return static_cast<float>(static_cast<const c10::Half*>(p)[i]);
}

struct Table {
  const uint8_t* packed;
  const void* sub;
  const uint16_t* sup;   // fp16 bits
  int64_t bits, mode, blocks, sub_rows, sup_rows;
};

__attribute__((optimize("fp-contract=off"))) inline void decode_row(const Table& t, int64_t id,
                                                                     float* out) {
#ifdef __clang__
#pragma clang fp contract(off)
#endif
  const int64_t s = id / kStrip;
  const int c = static_cast<int>(id % kStrip);
  const int64_t strip_bytes = t.blocks * 64 * t.bits;
  const int64_t supers = t.blocks / kSuperBlocks;
  for (int64_t b = 0; b < t.blocks; ++b) {
    int32_t u[kBlock];
    block_codes(t.packed + s * strip_bytes + b * 64 * t.bits, t.bits, c, u);
    // sub (strips, blocks, sub_rows, 16), sup (strips, supers, sup_rows, 16)
    const int64_t at = ((s * t.blocks + b) * t.sub_rows) * kStrip + c;
    const int64_t sat = ((s * supers + b / kSuperBlocks) * t.sup_rows) * kStrip + c;
    float* o = out + b * kBlock;
    if (t.mode == kF16S) {
      const float d = half_at(t.sub, at);
      const float offset = static_cast<float>(1 << (t.bits - 1));
      for (int i = 0; i < kBlock; ++i) o[i] = (static_cast<float>(u[i]) - offset) * d;
    } else if (t.mode == kF16) {
      const float scale = half_at(t.sub, at), min = half_at(t.sub, at + kStrip);
      for (int i = 0; i < kBlock; ++i) o[i] = static_cast<float>(u[i]) * scale + min;
    } else if (t.mode == kK32) {
      const uint8_t* sm = static_cast<const uint8_t*>(t.sub);
      const float scale = half_at(t.sup, sat) * static_cast<float>(sm[at]);
      const float dmin = half_at(t.sup, sat + kStrip) * static_cast<float>(sm[at + kStrip]);
      for (int i = 0; i < kBlock; ++i) o[i] = static_cast<float>(u[i]) * scale - dmin;
    } else {
      const int8_t* sm = static_cast<const int8_t*>(t.sub);
      const float d = half_at(t.sup, sat);
      for (int h = 0; h < 2; ++h) {
        const float scale = d * static_cast<float>(sm[at + h * kStrip]);
        for (int i = 16 * h; i < 16 * h + 16; ++i)
          o[i] = (static_cast<float>(u[i]) - 32.0f) * scale;
      }
    }
  }
}

// rows: the table's rows (the packed strips may hold up to 15 zero rows past them).
inline at::Tensor qblock_rows(const at::Tensor& ids, const at::Tensor& packed, const at::Tensor& sub,
                       const std::optional<at::Tensor>& sup, int64_t bits, int64_t mode,
                       int64_t rows) {
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong && ids.is_contiguous(),
              "qblock_rows: ids must be a contiguous 1-D int64 tensor");
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "qblock_rows: packed must be a contiguous 2-D uint8 tensor");
  const bool k_mode = mode == kK32 || mode == kK16;
  TORCH_CHECK((bits == 8 && mode == kF16S) || (bits == 5 && (mode == kF16S || mode == kF16)) ||
                  ((bits == 4 || bits == 5) && mode == kK32) || (bits == 6 && mode == kK16),
              "qblock_rows: no table of ", bits, "-bit codes in mode ", mode);
  const at::ScalarType sub_type = !k_mode ? at::kHalf : mode == kK32 ? at::kByte : at::kChar;
  const int64_t strips = packed.size(0);
  const int64_t sub_rows = mode == kF16S ? 1 : 2;
  TORCH_CHECK(sub.dim() == 4 && sub.scalar_type() == sub_type && sub.is_contiguous() &&
                  sub.size(0) == strips && sub.size(2) == sub_rows && sub.size(3) == kStrip,
              "qblock_rows: sub must be contiguous (", strips, ", blocks, ", sub_rows,
              ", 16) of ", c10::toString(sub_type));
  TORCH_CHECK(rows > strips * kStrip - kStrip && rows <= strips * kStrip,
              "qblock_rows: ", rows, " rows do not fill ", strips, " strips of 16");
  const int64_t blocks = sub.size(1);
  TORCH_CHECK(packed.size(1) == blocks * 64 * bits, "qblock_rows: packed and sub disagree");
  const uint16_t* supp = nullptr;
  int64_t sup_rows = 0;
  if (k_mode) {
    sup_rows = mode == kK32 ? 2 : 1;
    TORCH_CHECK(sup.has_value() && sup->scalar_type() == at::kHalf && sup->is_contiguous() &&
                    sup->dim() == 4 && sup->size(0) == strips &&
                    sup->size(1) * kSuperBlocks == blocks && sup->size(2) == sup_rows &&
                    sup->size(3) == kStrip,
                "qblock_rows: mode ", mode, " needs fp16 super-block scales (", strips,
                ", blocks / 8, ", sup_rows, ", 16)");
    supp = reinterpret_cast<const uint16_t*>(sup->data_ptr());
  }
  const int64_t n = ids.size(0);
  const int64_t* idp = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(idp[i] >= 0 && idp[i] < rows, "qblock_rows: id ", idp[i], " outside the ",
                rows, " rows of the table");
  at::Tensor out = at::empty({n, blocks * kBlock}, packed.options().dtype(at::kFloat));
  const Table t{packed.data_ptr<uint8_t>(), sub.data_ptr(), supp, bits, mode, blocks,
                sub_rows, sup_rows};
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) decode_row(t, idp[i], op + i * blocks * kBlock);
  });
  return out;
}

}  // namespace llmserve_native::qblock_table
