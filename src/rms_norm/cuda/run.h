// Host-side helpers shared by the RMSNorm launchers.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/layout.h"

namespace logitless::rms {

// True when every row of a tensor with this base and layout starts on a 16-byte boundary (the register
// kernels read and write whole 16-byte vectors from each row's start).
inline bool rows_aligned16(const void* base, const RowLayout& rows, int64_t elem_bytes) {
  if (base == nullptr) return true;  // an absent optional tensor
  if (reinterpret_cast<uintptr_t>(base) % 16 != 0) return false;
  for (int d = 0; d < rows.nd; ++d)
    if (rows.sizes[d] > 1 && (rows.strides[d] * elem_bytes) % 16 != 0) return false;
  return true;
}

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// CTAs of `kernel` at this shape that fit on one SM of `device` (the occupancy calculator's answer, cached
// per process; the opt-in for more than 48 KB of shared memory is set on the way). Raises if none fits.
int max_ctas_per_sm(const void* kernel, int threads, size_t smem, int device);

}  // namespace logitless::rms
