// The parameters every cross-entropy kernel takes: plain pointers, int64 sizes and RowLayouts.
#pragma once

#include <cstdint>

#include "common/layout.h"

namespace logitless::ce {

// Workspace layout (device memory the caller provides).
struct Scalars {
  float inv_denom;      // 1/sum of target weights for mean (0 when every row is ignored), 1 otherwise
  float weight_sum;     // W = sum_j w_j (V without class weights)
  long long first_bad;  // smallest row with a target outside [0, V) and != ignore_index; n_rows if none
};
inline constexpr size_t kScalarsBytes = 256;

struct KernelParams {
  const char* logits = nullptr;  // bytes
  RowLayout logits_rows;
  const void* target = nullptr;
  int target_is64 = 1;
  RowLayout target_rows;
  const float* weight = nullptr;
  int64_t weight_stride = 1;

  float* row_loss = nullptr;  // [N]: the loss output for reduction none, workspace partials otherwise
  float* lse = nullptr;       // [N] optional
  float* z_loss = nullptr;    // [N] optional
  char* grad = nullptr;       // bytes; nullptr: no gradient
  RowLayout grad_rows;
  const float* lse_in = nullptr;  // [N]: backward from a saved lse
  const float* grad_scale = nullptr;
  int grad_scale_per_row = 0;
  const Scalars* scalars = nullptr;

  int64_t n_rows = 0;
  int64_t vocab = 0;
  int64_t ignore_index = -100;
  float eps = 0.f;      // label smoothing
  float inv_v = 0.f;    // 1 / V
  float z = 0.f;        // z-loss scale
  float softcap = 0.f;  // 0: off
};

}  // namespace logitless::ce
