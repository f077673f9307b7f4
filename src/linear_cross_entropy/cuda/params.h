// What the linear cross-entropy kernels take: plain pointers, int64 sizes, and the cross-entropy family's
// KernelParams for the per-element math they share with it.
#pragma once

#include <cstdint>

#include "common/layout.h"
#include "cross_entropy/cuda/params.h"
#include "logitless/tensor.h"

namespace logitless::lce {

// Per-call scalars, computed on the device by the prepass (workspace region Plan::off_scalars).
struct Scalars {
  float inv_denom;      // mean: 1 / sum of the class weights of the tokens not ignored (0 when there are none);
                        // sum and none: 1
  float weight_sum;     // W = sum of the class weights (V without them; only label smoothing uses it)
  long long first_bad;  // smallest token with a target outside [0, V) other than ignore_index; N if none
};

struct PrepassParams {
  const void* target = nullptr;
  int target_is64 = 1;
  RowLayout target_rows;
  int64_t n = 0, vocab = 0, ignore_index = -100;
  const float* class_weight = nullptr;
  int64_t class_weight_stride = 1;
  int mean = 0;
  int need_weight_sum = 0;
  int64_t* targets_out = nullptr;  // [n] int64, contiguous
  Scalars* scalars = nullptr;
};

// The gradient of a chunk of float32 logits: rows [0, rows) of the chunk are tokens row0 + r, its columns
// [0, width) are classes col0 + c.
struct GradParams {
  const float* logits = nullptr;  // [rows, ld_logits]
  int64_t ld_logits = 0;
  void* dlogits = nullptr;        // [rows, ld_dlogits] in the GEMMs' dtype; may be `logits` itself (float32)
  int64_t ld_dlogits = 0;
  float* db_partial = nullptr;    // [ceil(rows / kGradRowsPerBlock), ld_logits] column sums, or nullptr
  const int64_t* target = nullptr;  // [rows]: the chunk's targets
  const float* lse = nullptr;       // [rows]
  const float* upstream = nullptr;  // nullptr (1), [] or [rows] (per_row)
  int upstream_per_row = 0;
  const Scalars* scalars = nullptr;
  int64_t rows = 0, width = 0, col0 = 0;
  ce::KernelParams ce;  // vocab, ignore_index, eps, inv_v, z, softcap, class weights: the family's definitions
};

}  // namespace logitless::lce
