// Chunking and workspace layout of the CUDA linear cross-entropy: one pure host function (no CUDA calls), so
// that a CPU test can check every decision. The launcher only executes a Plan.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cross_entropy/cuda/params.h"
#include "linear_head/cuda/plan.h"

namespace logitless::lce {

// Which implementation runs a plan's logits GEMMs.
//  * kCublasChunked (any GPU from sm_80): cuBLAS writes float32 logits; the cross-entropy family's row kernel
//    reads them for the statistics, this family's gradient kernel for the gradient.
//  * kHopperFused (sm_90a, 16-bit inputs; cuda/kernels_hopper.h): the logits GEMM computes the statistics (forward) or
//    the gradient (recompute backward) in its epilogue: the forward keeps no logits, the backward writes the
//    16-bit gradient straight from the accumulators. The gradient in forward takes it when PlanInputs::fused_exp
//    is set (bfloat16 inputs without soft cap or label smoothing, and the exponential form switched on: it is off
//    by default, see run.cpp): the GEMM writes the statistics and the
//    exponentials of params.h's ExpGradParams, token groups of whole rows. Not for a bias gradient. The
//    grad_hidden / grad_weight GEMMs are cuBLAS's either way.
enum class Kernel : int32_t { kCublasChunked = 0, kHopperFused = 1 };

enum class Pass : int32_t { kForward = 0, kForwardBackward = 1, kBackward = 2 };

using head::cublas_workspace_for;
using head::kGradRowsPerBlock;

// Columns of one tile of the fused Hopper GEMM, and the statistics it writes per token and tile: the forward's four
// floats (maximum, sum of exp, the target's logit, sum of w x), the gradient in forward's two (the tile's base and
// the sum of its E: the target's logit is the row's shift there, and label smoothing does not take that path). The
// smaller record lets a token's statistics fit a float32 grad_hidden row at twice the classes (Plan::
// shared_in_grad_hidden: 256000 classes at H = 2304).
inline constexpr int64_t kFusedTileCols = 256;
inline constexpr int kStatsFloats = 4, kExpStatsFloats = 2;

struct PlanInputs {
  Pass pass = Pass::kForward;
  int64_t n = 0, h = 0, v = 0;
  int elem_bytes = 2;  // hidden and weight (and so the logits' gradient the GEMMs read)
  bool need_dx = false, need_dw = false, need_db = false;
  bool grad_hidden_f32 = false;  // grad_hidden is float32 (sums into it directly, no accumulator)
  bool grad_weight_f32 = false;
  bool copy_hidden = false;     // hidden's rows do not have one stride a GEMM can take
  bool reduction_none = false;  // per-token losses go straight to the output
  bool z_rows = false;          // the z-loss terms are reduced apart from the rest (mean with z-loss: they are
                                // divided by the token count, the rest by the summed class weights)
  bool fused = false;           // the device and operands take the fused Hopper kernels (kernels_hopper.h)
  bool fused_exp = false;       // ... and the gradient in forward's exponential form (bfloat16, plain options)
  // The vocabulary-parallel gradient-in-forward steps (include/logitless/vocab_parallel.h): pass
  // kForwardBackward with chunks of exactly chunk_tokens (agreed between the ranks), two float32 logits slots
  // (a chunk's logits wait in one while the next chunk's are computed), groups of whole chunks.
  bool steps = false;
  int64_t chunk_tokens = 0;  // options (0: from the budget)
  int64_t chunk_vocab = 0;
  size_t memory_budget = size_t{512} << 20;
  size_t cublas_workspace_bytes = size_t{32} << 20;
  size_t target_sort_bytes = 0;  // the exponential form's sort of the rows by target (kernels.h), for up to n rows
  // A 16-bit grad_weight sums over token groups in itself, not in a float32 accumulator (the options'
  // GradWeightAccumulation::kWeightDtype).
  bool dw_weight_dtype = false;
  // The call writes the row statistics (LinearCrossEntropyOptions::row_stats): the fused forward (whose epilogue
  // keeps none of them) gives way to the generic one; the exponential form keeps their tile partials too.
  bool row_stats = false;
  // Bytes of grad_weight's storage a plan may use as scratch while the float32 accumulator holds the sums
  // (16-bit, rows contiguous; 256 less than its size, so that the regions start 256-aligned wherever it does).
  size_t grad_weight_scratch = 0;
  // grad_hidden is float32 with contiguous, 16-byte aligned rows of a multiple of 4 elements: a token group's own
  // rows of it hold nothing until the group's grad_hidden GEMM writes them, and each holds 4·H bytes.
  bool grad_hidden_rows_scratch = false;
  bool dw_tail = true;  // the accumulator's tail may use that storage (Plan::dw_tail_rows; off: benchmarks)
  bool dlogits_in_grad_weight = true;  // ... and the exponentials, in its place (Plan::dlogits_in_grad_weight)
  bool dw_written = true;  // the last group's products may write grad_weight (Plan::dw_written_rows; off: benchmarks)
};

// The float32 grad_weight accumulator that several token groups of the gradient in forward would need, in bytes:
// 4·V·H, or 0 where grad_weight takes the sums itself (float32, or dw_weight_dtype) or is not wanted. The planner
// weighs it against holding every token's gradient (one group).
inline size_t dw_accumulator_bytes(const PlanInputs& in) {
  const bool acc = in.need_dw && !in.grad_weight_f32 && !in.dw_weight_dtype;
  return acc ? static_cast<size_t>(in.v) * static_cast<size_t>(in.h) * 4 : 0;
}

struct Plan {
  Kernel kernel = Kernel::kCublasChunked;
  Pass pass = Pass::kForward;
  // Forward and gradient in the forward: token chunks. `chunk_rows` rows of float32 logits per GEMM and
  // cross-entropy call; `group_rows` (>= chunk_rows) rows of the logits' gradient held for one grad_hidden /
  // grad_weight GEMM pair. Backward: `vocab_cols` vocabulary rows of the weight per chunk, every token at once.
  int64_t chunk_rows = 0;
  int64_t group_rows = 0;
  int64_t vocab_cols = 0;
  int64_t ld_logits = 0;            // elements per row of the float32 logits chunk (16-byte rows for vector loads)
  int64_t ld_dlogits = 0;           // elements per row of the logits' gradient (its own buffer, or the logits' rows)
  bool dlogits_in_place = false;    // float32 inputs: the gradient overwrites its float32 logits
  bool dw_accumulator = false;      // grad_weight sums over token groups in a float32 buffer, cast at the end
                                    // (without it, several groups sum in grad_weight itself)
  bool dx_accumulator = false;      // (backward) grad_hidden sums over vocabulary chunks in a float32 buffer
  int64_t db_partial_rows = 0;      // float32 rows of bias-gradient partial sums per chunk (0: no bias gradient)
  bool exp_in_grad_weight = false;  // exponential form with the accumulator: its per-group regions (declare_exp)
                                    // lie in grad_weight's storage (PlanInputs::grad_weight_scratch), not in the
                                    // workspace, after the accumulator's tail (with the exponentials there, or
                                    // where the last group's products do not write grad_weight)
  int64_t dw_tail_rows = 0;         // the accumulator's last rows kept in grad_weight's storage (head::DwAccumulator;
                                    // one call's sums only: not the steps, whose sums outlive a call)
  bool dlogits_in_grad_weight = false;  // exponential form: the group's exponentials lie in grad_weight's storage
                                        // too, between the tail (shorter, for them) and the per-group regions
  // The last token group's grad_weight products write the 16-bit grad_weight themselves, the head's first
  // dw_written_rows rows and the tail's, instead of leaving the float32 sums to a cast (head::DwAccumulator::
  // written): all of them where grad_weight's storage holds nothing that group reads but the tail's sums, which its
  // own product reads before the head's write over them; 0 otherwise (exp_in_grad_weight, the steps, or
  // PlanInputs::dw_written off).
  int64_t dw_written_rows = 0;

  int64_t stats_row = 0;       // kHopperFused forward: bytes of tile statistics per token (16 per 256 columns; the
                               // row statistics' partials alike)
  int64_t exp_shared_row = 0;  // exponential form: bytes per token of the region that the statistics, the scaled
                               // hidden row and the float32 grad_hidden row take in turn
  bool shared_in_grad_hidden = false;  // ... and that region lies in the group's own rows of a float32 grad_hidden
                                       // (PlanInputs::grad_hidden_rows_scratch), not in the workspace
  size_t slot_bytes = 0;               // the steps' logits slot (two, one after the other)
  size_t sort_bytes = 0;               // exponential form with grad_weight: the sort's temporary storage
  size_t bytes = 0;                    // the workspace: every stage of declare_workspace
};

// The cross-entropy's stage: the prepass's scalars and the per-token state.
struct LossBuffers {
  ce::Scalars* scalars = nullptr;  // the call's, and (kRowScalarsAt bytes on) the chunks' row steps'
  int64_t* targets = nullptr;      // [N]: the targets, contiguous
  float* row_loss = nullptr;       // [N]: per-token losses before the reduction
  float* row_z = nullptr;          // [N]: their z-loss terms (PlanInputs::z_rows)
  float* lse = nullptr;  // [N]: the gradient pass's lse when the caller asks for none (always reserved: the workspace
                         // queries do not see the lse argument)
};
inline constexpr size_t kRowScalarsAt = 128;

// The fused Hopper path's stage. Forward: the tile statistics [chunk_rows, ceil(V / 256), 4]. Gradient in forward
// (params.h, ExpGradParams), per token of a group: the rows' shift, scale and rewrite list, and one region holding in
// turn the statistics, hidden scaled by row (with a grad_weight) and the unscaled float32 grad_hidden rows (with a
// 16-bit grad_hidden); the exponentials go to the engine's dlogits.
struct FusedBuffers {
  float* partials = nullptr;
  float* row_partials = nullptr;  // exponential form with row statistics: [group_rows, ceil(V / 256), 4]
  float* shift = nullptr;
  float* row_scale = nullptr;
  int* fixups = nullptr;
  float* target_coef = nullptr;
  int* class_keys[2] = {};  // the sort's input and output
  int* class_rows[2] = {};
  void* sort_temp = nullptr;
  void* scaled_hidden = nullptr;
  float* dx_rows = nullptr;
};

struct Buffers {
  LossBuffers loss;
  head::HeadBuffers head;
  FusedBuffers fused;
  float* dw_tail = nullptr;  // Plan::dw_tail_rows rows of float32 sums, at grad_weight's storage
};

// Every stage's regions of plan `p` in `L`, pointers into `b` (set by L.carve): the loss's, the engine's, the fused
// path's; the accumulator's tail, the exponentials of Plan::dlogits_in_grad_weight and the regions of
// Plan::exp_in_grad_weight in `grad_weight_scratch` instead, in that order (carved at grad_weight's storage; none
// declared where it is null).
void declare_workspace(const PlanInputs& in, const Plan& p, head::WorkspaceLayout& L, Buffers* b,
                       head::WorkspaceLayout* grad_weight_scratch);
inline void declare_workspace(const PlanInputs& in, const Plan& p, head::WorkspaceLayout& L, Buffers* b) {
  declare_workspace(in, p, L, b, nullptr);
}
// The exponential form's regions for one token group: shift, scale, target term, rewrite list, the sort's keys,
// rows and storage, and one region holding in turn the statistics, the scaled hidden rows and the float32
// grad_hidden rows (none where Plan::shared_in_grad_hidden: the run points it at the group's grad_hidden rows).
void declare_exp(const PlanInputs& in, const Plan& p, head::WorkspaceLayout& L, FusedBuffers* f);

Plan plan_linear_cross_entropy(const PlanInputs& in);

// Whether the recompute schedule is expected to finish sooner than the gradient-in-forward plan of `gif` (a
// kForwardBackward, one-device input with 16-bit hidden and weight; false otherwise): a cost model in bytes at
// copy bandwidth, a GEMM's FLOPs counted at kFlopsPerByte. See plan.cpp for the terms, bench/RESULTS.md for the
// measurements.
bool recompute_is_faster(const PlanInputs& gif);
inline constexpr double kFlopsPerByte = 250.0;  // an H100's bf16 GEMM rate over its copy bandwidth

// The token chunk of the vocabulary-parallel steps: `chunk_tokens` when > 0, else a quarter of the budget over a
// float32 logits row of the widest shard (the two slots take half of it), in multiples of 128, at most n (>= 1).
int64_t shard_chunk_tokens(int64_t n, int64_t widest_shard, int64_t chunk_tokens, size_t memory_budget);

}  // namespace logitless::lce
