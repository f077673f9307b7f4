// The column geometry of the linear heads' gradient kernels (linear_cross_entropy/cuda/kernels.cu,
// linear_policy_loss/cuda/kernels.cu) and what one thread does
// with one row of its columns, written for host and device so that a CPU test runs the same code the kernel
// does (tests/cpp/test_linear_cross_entropy.cpp, LinearCrossEntropyGradColumns).
//
// A thread owns the group of kGradCols adjacent columns [c, c + kGradCols) of a chunk of float32 logits that is
// `width` columns wide, with c a multiple of kGradCols and c < width. Column c + k is class col0 + c + k: whole
// rows in the forward (col0 = 0, width = V), the backward's vocabulary slices [col0, col0 + width) otherwise.
// Every group but the last of a chunk lies inside it. When width is not a multiple of kGradCols the last group
// is partial, and its slots c + k >= width are past the chunk:
//   - their logits are the row's padding up to ld (the planner rounds ld up to 8 columns, so the padding holds
//     them), which no GEMM writes: never read;
//   - their classes are past the slice: the next slice's first classes (an interior slice of the backward) or
//     V and beyond (whole rows, and the backward's last slice). The per-element gradient reads the class weight
//     of its class under label smoothing, so evaluating it there read past the end of the class weights (as the
//     cross-entropy kernels once did): it is evaluated only for slots inside the chunk, the others are 0;
//   - their gradient and bias-gradient partials would belong to no class: never written (the GEMMs that
//     read the gradient take `width` columns, the column sums `width` partials).
// A full group takes one 16-byte load and one vector store, with no per-slot test (the hot path stays
// straight-line); only a partial group goes slot by slot under its mask.
#pragma once

#include <cstdint>

#include "common/macros.h"

// Device passes only: the host compiler of a .cu file sees the expanded pragma and warns about it.
#if defined(__CUDA_ARCH__)
#define LOGITLESS_HEAD_UNROLL _Pragma("unroll")
#else
#define LOGITLESS_HEAD_UNROLL
#endif

namespace logitless::head {

inline constexpr int kGradCols = 4;  // float32 columns per thread: one 16-byte load per row
inline constexpr uint32_t kGradFullMask = (1u << kGradCols) - 1u;

// Bit k set: column c + k lies inside a chunk `width` columns wide.
LOGITLESS_HD uint32_t grad_slot_mask(int64_t c, int64_t width) {
  const int64_t n = width - c;
  return n >= kGradCols ? kGradFullMask : n > 0 ? (1u << n) - 1u : 0u;
}

// One row's gradient values of a group into v[kGradCols]: `load_full(x)` reads the group's kGradCols logits at
// once, `load_one(k)` the logit of slot k, `elem(x_k, k)` is d(loss)/d(logit) of slot k. A partial group
// loads and evaluates only the slots in `mask`; the others get 0.
template <typename LoadFull, typename LoadOne, typename Elem>
LOGITLESS_HD void grad_group_values(uint32_t mask, const LoadFull& load_full, const LoadOne& load_one, const Elem& elem,
                                    float* v) {
  if (mask == kGradFullMask) {
    float x[kGradCols];
    load_full(x);
    LOGITLESS_HEAD_UNROLL
    for (int k = 0; k < kGradCols; ++k) v[k] = elem(x[k], k);
    return;
  }
  LOGITLESS_HEAD_UNROLL
  for (int k = 0; k < kGradCols; ++k) v[k] = (mask >> k) & 1u ? elem(load_one(k), k) : 0.f;
}

// A row's values that are not gradients of its logits (an ignored or bad token's 0 or NaN): `value` in the
// slots of `mask`, 0 in the others.
LOGITLESS_HD void grad_group_fill(uint32_t mask, float value, float* v) {
  LOGITLESS_HEAD_UNROLL
  for (int k = 0; k < kGradCols; ++k) v[k] = (mask >> k) & 1u ? value : 0.f;
}

// Stores a row's values (`store_full(v)` all at once, `store_one(k, v_k)` one slot) and adds them to the group's
// column sums; a partial group stores and sums only the slots in `mask`.
template <typename StoreFull, typename StoreOne>
LOGITLESS_HD void grad_group_store(uint32_t mask, const float* v, const StoreFull& store_full,
                                   const StoreOne& store_one, float* colsum) {
  if (mask == kGradFullMask) {
    store_full(v);
    LOGITLESS_HEAD_UNROLL
    for (int k = 0; k < kGradCols; ++k) colsum[k] += v[k];
    return;
  }
  LOGITLESS_HEAD_UNROLL
  for (int k = 0; k < kGradCols; ++k)
    if ((mask >> k) & 1u) {
      store_one(k, v[k]);
      colsum[k] += v[k];
    }
}

// The group's column sums over a row block into its row of bias-gradient partials (`out` points at column c).
LOGITLESS_HD void grad_group_store_sums(uint32_t mask, const float* colsum, float* out) {
  LOGITLESS_HEAD_UNROLL
  for (int k = 0; k < kGradCols; ++k)
    if ((mask >> k) & 1u) out[k] = colsum[k];
}

}  // namespace logitless::head
