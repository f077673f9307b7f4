// Launchers of the linear cross-entropy's own kernels (the GEMMs and the shared kernels are the linear head's,
// linear_head/cuda/; the row statistics the cross-entropy family's). All take the caller's stream.
#pragma once

#include <cuda_runtime.h>

#include "linear_cross_entropy/cuda/params.h"

namespace logitless::lce {

// d(loss)/d(logits) of a chunk (see GradParams), into p.dlogits in `out_dtype`, and its column sums.
void launch_grad(const GradParams& p, DType out_dtype, cudaStream_t stream);

// The rows' loss and lse from the fused GEMM's tile statistics partials [rows, tiles, stats_floats]
// (kernels_hopper.h): one warp per row combines its tiles as a vocabulary-parallel finalize combines shards
// (include/logitless/vocab_parallel.h) and applies the cross-entropy's row loss. stats_floats: the forward's
// kStatsFloats, or the exponential form's kExpStatsFloats (plan.h), which needs target_logit. target_logit: the rows'
// target logits, or nullptr to take them from the partials. lse and z_rows (the rows' z-loss terms) may be nullptr.
// ce: the row kinds, class weights and options.
void launch_finish_rows(const float* partials, int stats_floats, int64_t rows, int64_t tiles, const int64_t* target,
                        const float* target_logit, const ce::KernelParams& ce, const Scalars* scalars, float* loss,
                        float* lse, float* z_rows, int sm_count, cudaStream_t stream);

// The row statistics (LinearCrossEntropyOptions::row_stats; kernels_row_stats.cu), per token: entropy (float32) and
// is_top1 (0 or 1), 0 and 0 for an ignored row, NaN and 0 for a bad one.
//  * launch_chunk_row_stats: from a chunk of whole rows of float32 logits z [rows, ld] (the generic path; a block per
//    row reads it once): the entropy of softmax of the capped logits, the first maximum of z.
//  * launch_finish_row_stats: from the fused exponential form's tile partials (its statistics [rows, tiles,
//    kExpStatsFloats], and the row statistics' own [rows, tiles, 4]: hopper/epilogue_exp_row_stats.cuh) and the rows'
//    lse (launch_finish_rows' output).
// target: the rows' targets; ce: the row kinds and options.
void launch_chunk_row_stats(const float* z, int64_t ld, int64_t rows, int64_t width, const int64_t* target,
                            const ce::KernelParams& ce, float* entropy, uint8_t* is_top1, int sm_count,
                            cudaStream_t stream);
void launch_finish_row_stats(const float* partials, const float* row_partials, int64_t rows, int64_t tiles,
                             const int64_t* target, const float* lse, const ce::KernelParams& ce, float* entropy,
                             uint8_t* is_top1, int sm_count, cudaStream_t stream);

// The gradient in forward's fused path (ExpGradParams, kernels_exp_grad.cu). Before the logits GEMM: shift[r] = the
// target's logit (0 for rows without one). After it and launch_finish_rows: every row's scale, the target's
// element of E and the scaled hidden row, or (the rows the scaled form does not suit) a rewrite of the row.
void launch_target_shift(const ExpGradParams& p, int sm_count, cudaStream_t stream);
void launch_exp_rows(const ExpGradParams& p, int sm_count, cudaStream_t stream);

// The rows' target terms of grad_weight (after the grad_weight GEMM of E and the scaled hidden rows): the rows
// sorted by target (p.class_keys / class_rows into `sort`), then each class's sum added to its grad_weight row, in
// float32 or, for a 16-bit grad_weight written by the GEMM, rounded once more. exp_target_sort_bytes: the sort's
// temporary storage for up to `rows` rows.
struct TargetSort {
  int* keys = nullptr;  // [rows] each
  int* rows = nullptr;
  void* temp = nullptr;
  size_t temp_bytes = 0;
};
// Where grad_weight's rows are summed: rows [0, split) at `head`, rows [split, v) at `tail` (head::DwAccumulator's
// parts; split = v with no tail), one dtype and row stride.
struct TargetRowsOut {
  void* head = nullptr;
  void* tail = nullptr;
  int64_t split = 0;
  DType dtype = DType::kFloat32;
  int64_t ld = 0;
};
size_t exp_target_sort_bytes(int64_t rows);
void launch_grad_weight_targets(const ExpGradParams& p, const TargetSort& sort, const TargetRowsOut& dw,
                                cudaStream_t stream);
// grad_hidden's rows from y = E W (float32 [rows, ldy]): scale ⊙ y + target_coef ⊙ W[t], in dx_dtype (in place
// when dx is y).
void launch_grad_hidden_rows(const ExpGradParams& p, const float* y, int64_t ldy, void* dx, DType dx_dtype,
                             int64_t ld_dx, int sm_count, cudaStream_t stream);

}  // namespace logitless::lce
