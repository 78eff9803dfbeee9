// Streaming a weight larger than the caches, strip after strip: while a strip's row tiles
// compute, the next strip's cache lines are requested into L2, an equal share per block of
// every tile, so the memory reads overlap the arithmetic however many tiles share a strip
// (requesting only a fixed distance ahead inside the strip left the first tile waiting on
// memory and the others with nothing in flight). Shares are rounded up to whole lines and
// cut at the next strip's end.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace llmserve_native {

// Lines of ``bytes`` each of ``tiles * blocks`` blocks requests.
inline int64_t next_strip_lines(int64_t bytes, int64_t tiles, int64_t blocks) {
  return (bytes / 64 + tiles * blocks - 1) / (tiles * blocks);
}

// Block ``b`` of tile ``t``'s share of the next strip (``bytes`` from ``next``).
inline void prefetch_share(const uint8_t* next, int64_t bytes, int64_t t, int64_t blocks,
                           int64_t b, int64_t lines) {
  const int64_t first = (t * blocks + b) * lines, total = bytes / 64;
  const int64_t last = first + lines < total ? first + lines : total;
  const char* p = reinterpret_cast<const char*>(next);
  for (int64_t i = first; i < last; ++i) _mm_prefetch(p + 64 * i, _MM_HINT_T1);
}

}  // namespace llmserve_native
