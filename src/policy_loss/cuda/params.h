// The parameters of the policy-loss kernels: plain pointers, int64 sizes and RowLayouts.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/layout.h"

namespace logitless::pl {

// Workspace layout (device memory the caller provides): Scalars, then SeqStats[n_seqs], then per-token scratch.
struct Scalars {
  double total_weight;  // sum of the token weights over the batch
  long long first_bad;  // smallest token with an unmasked id outside [0, V); n_rows if none
};
inline constexpr size_t kScalarsBytes = 256;

struct SeqStats {
  float weight;         // W_b: the sequence's sum of token weights
  float factor;         // what each token's w * per_token_loss is multiplied by in the loss (math.h seq_factor)
  float ratio;          // sequence level: R_b = exp(S_b)
  float ratio_coeff;    // sequence level: the ratio term's share of d(loss)/d(logp) per unit of token weight
  double loss;          // sequence level: the sequence's share of the loss
  long long first_bad;  // prepass: the sequence's first bad token (n_rows if none)
};

// What the row kernel does after a row's statistics (the kernels are shared by both ops).
enum class RowOp : int32_t {
  kSelective = 0,       // logp / entropy / lse; backward: c = grad_logp
  kPolicyToken = 1,     // token-level ratio: every output and c from the token alone (fused gradient)
  kPolicySequence = 2,  // statistics only (the sequence kernel does the rest); backward: c from SeqStats
};

struct KernelParams {
  const char* logits = nullptr;  // bytes; token rows
  RowLayout logits_rows;
  const void* ids = nullptr;
  int ids_is64 = 1;
  RowLayout ids_rows;
  const void* mask = nullptr;  // optional token weights
  int32_t mask_dtype = 0;      // logitless::DType code
  RowLayout mask_rows;
  const float* old_logp = nullptr;
  RowLayout old_rows;
  const float* ref_logp = nullptr;
  RowLayout ref_rows;
  const float* adv = nullptr;
  int64_t adv_stride = 1;

  char* grad = nullptr;  // bytes; nullptr: no gradient
  RowLayout grad_rows;

  // Per-token outputs, contiguous [n_rows], each optional.
  float* out_logp = nullptr;
  float* out_entropy = nullptr;
  float* out_lse = nullptr;
  float* out_loss = nullptr;  // per_token_loss
  float* out_kl = nullptr;
  uint8_t* out_clipped = nullptr;
  uint8_t* out_top1 = nullptr;  // selective forward: the id is the row's first maximum (the kTop1 kernels only)
  float* row_loss = nullptr;    // token level: each token's share of the loss (workspace), for a fixed-order sum

  const float* lse_in = nullptr;      // backward from saved statistics: lse per token
  const float* logp_in = nullptr;     // ... and logp per token (sequence level)
  const float* grad_logp = nullptr;   // selective backward: the incoming gradient of logp
  const float* grad_scale = nullptr;  // [] optional upstream factor of the loss's gradient
  SeqStats* seq = nullptr;
  Scalars* scalars = nullptr;

  int64_t n_rows = 0;       // rows of this launch (a chunk's tokens); the prepass and the loss: every token
  int64_t first_token = 0;  // the token of row 0: per-token arrays are indexed by first_token + row, the logits
                            // and gradient rows by row (a chunk of logits computed from hidden states)
  int64_t vocab = 0;
  int64_t seq_len = 1;  // tokens per sequence (row r belongs to sequence r / seq_len)
  int64_t n_seqs = 0;
  int64_t slice = 0;  // elements of a row each CTA of a cluster owns (vocab without a cluster)
  int32_t op = 0;     // RowOp
  int32_t has_old = 0, has_ref = 0;
  float inv_temp = 1.f;  // 1 / temperature
  float scale_l2 = 0.f;  // log2(e) / temperature
  float beta = 0.f, eps_low = 0.f, eps_high = 0.f;
};

}  // namespace logitless::pl
