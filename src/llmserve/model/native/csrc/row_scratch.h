// Per-thread scratch for an int8-activation product's quantized rows (codes, scales, sums).
//
// A decode step calls ~120 of these products; each used to allocate three small tensors for
// its activation codes and statistics and free them on return. The calling thread keeps one
// growing buffer per slot instead: a product asks for its bytes, gets a 64-byte aligned
// pointer valid until its next request for the same slot on the same thread. The product's
// worker threads only read or write through that pointer while the call runs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>

namespace llmserve_native {

constexpr int kScratchSlots = 4;

struct RowScratch {
  void* data[kScratchSlots] = {};
  size_t bytes[kScratchSlots] = {};
  ~RowScratch() {
    for (int i = 0; i < kScratchSlots; ++i) std::free(data[i]);
  }
};

// This thread's scratch: one set of slots, whatever element type a product asks for.
inline RowScratch& thread_scratch() {
  thread_local RowScratch scratch;
  return scratch;
}

// `count` elements of T in slot `slot` (0 .. kScratchSlots - 1) of this thread's scratch.
template <typename T>
inline T* row_scratch(int slot, int64_t count) {
  RowScratch& scratch = thread_scratch();
  const size_t need = (static_cast<size_t>(count) * sizeof(T) + 63) / 64 * 64;
  if (need > scratch.bytes[slot]) {
    std::free(scratch.data[slot]);
    scratch.data[slot] = nullptr;
    scratch.bytes[slot] = 0;
    void* p = std::aligned_alloc(64, need);
    if (p == nullptr) throw std::bad_alloc();
    scratch.data[slot] = p;
    scratch.bytes[slot] = need;
  }
  return static_cast<T*>(scratch.data[slot]);
}

}  // namespace llmserve_native
