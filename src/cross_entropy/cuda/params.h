// The parameters every cross-entropy kernel takes: plain pointers, int64 sizes and RowLayouts.
#pragma once

#include <cstdint>

#include "common/layout.h"

namespace logitless::ce {

// Workspace layout (device memory the caller provides).
struct Scalars {
  float inv_denom;   // 1/sum of target weights for mean (0 when every row is ignored), 1 otherwise
  float inv_count;   // 1/count of the rows not ignored for mean (the z-loss term's divisor; 0 when none), 1 otherwise
  float weight_sum;  // W = sum_j w_j (V without class weights)
  long long first_bad;  // smallest row with a target outside [0, V) and != ignore_index; n_rows if none
};
inline constexpr size_t kScalarsBytes = 256;

struct KernelParams {
  const char* logits = nullptr;  // bytes
  RowLayout logits_rows;
  const void* target = nullptr;
  int target_is64 = 1;
  RowLayout target_rows;
  const float* weight = nullptr;  // [vocab_total]: every class's weight
  int64_t weight_stride = 1;

  float* row_loss = nullptr;  // [N]: the loss output for reduction none; otherwise workspace partials, each row's
                              // share of the reduced loss (math.h, reduced_row_loss)
  float* lse = nullptr;       // [N] optional
  float* z_loss = nullptr;    // [N] optional
  char* grad = nullptr;       // bytes; nullptr: no gradient
  RowLayout grad_rows;
  const float* lse_in = nullptr;  // [N]: backward from a saved lse
  const float* grad_scale = nullptr;
  int grad_scale_per_row = 0;
  const Scalars* scalars = nullptr;
  float* partials = nullptr;  // [N, 4] (16-byte rows): a vocabulary shard's partial statistics, written instead of
                              // the outputs

  int64_t n_rows = 0;
  int64_t vocab = 0;         // columns of the logits: the whole vocabulary, or a shard's slice of it
  int64_t vocab_offset = 0;  // the class of column 0 (a vocabulary shard's offset)
  int64_t vocab_total = 0;   // the whole vocabulary: targets are valid in [0, vocab_total), inv_v is its inverse
  int64_t ignore_index = -100;
  float eps = 0.f;      // label smoothing
  float inv_v = 0.f;    // 1 / V
  float z = 0.f;        // z-loss scale
  float softcap = 0.f;  // 0: off
  // Eager target checks: the prepass's first bad row is read back while the row kernels are already queued, so
  // a kernel that finds one (scalars->first_bad < n_rows) writes nothing and the host throws.
  int abort_on_bad = 0;
};

}  // namespace logitless::ce
