// logitless: vocabulary-parallel (tensor-parallel) cross-entropy and linear cross-entropy.
//
// A large model shards its LM head along the vocabulary: rank r holds the rows [offset_r, offset_r + V_r) of the
// weight (or the columns of the logits), the shards tiling [0, V) in order. Gathering the logits to compute the
// loss would move N·V numbers; the loss needs only O(N) numbers from each shard. The calls below split the
// cross-entropy family's math (include/logitless/cross_entropy.h: every option, every reduction) into
//
//   1. per-shard partial statistics  (this shard's logits -> float32 [N, 4] per rank)
//   2. an exchange of the partials    (the caller's collective: every rank gets every rank's partials)
//   3. finalize                       (all partials -> loss, global lse, z-loss; identical on every rank)
//   4. the backward of each shard     (its own logits, the global lse and the upstream gradient: no exchange)
//
// The library never communicates: step 2 is the caller's (the Python package uses torch.distributed: one
// all_gather of the partials; NCCL, gloo, or anything else). Every rank sees every token's target (the
// hidden states and targets are replicated across the vocabulary-parallel group), so everything that depends
// on targets only is local arithmetic, the same on every rank: which rows are ignored, the out-of-range check
// (a target is valid in [0, V), V the whole vocabulary), and reduction mean's denominator.
//
// Shards and class weights. A VocabShard says where a shard's columns sit: column j is class offset + j, of a
// vocabulary of `vocab` classes. A shard may be empty (V_r = 0: it contributes nothing and gets an empty
// gradient). Class weights, when given, are the whole vocabulary's [V] on every rank (V floats: small); a
// shard reads the weights of its own classes and of each row's target.
//
// Partial statistics, one float32 row of kShardStats per token (contiguous [N, 4]), x the shard's (capped) logits:
//   [0] m   = max_j x_j                              (-inf for an empty shard; NaN if some x_j is NaN)
//   [1] s   = sum_j exp(x_j - m)                     (0 for an empty shard; NaN when m = +inf)
//   [2] x_t = x_{t - offset} when this shard holds the target t, else 0
//   [3] sum_j w_{offset+j} x_j                       (label smoothing's term; 0 when label_smoothing = 0)
// Rows whose target is ignore_index or out of range are not read; their partials are (-inf, 0, 0, 0).
// Finalize takes every shard's rows stacked as [R, N, 4] (what an all_gather of the [N, 4] tensors gives, in
// rank order) and combines them in that order, so every rank computes bit-identical results:
//   lse = M + log(sum_r s_r exp(m_r - M)),  M = max_r m_r        x_t = sum_r x_t,r       sum_wx = sum_r (...)
// and then the loss of cross_entropy.h with V the whole vocabulary. A row is NaN exactly where the unsharded
// call's row is NaN (a NaN or +inf logit anywhere in the row, or every logit -inf).
//
// The backward of a shard is the cross-entropy gradient of its columns, d(loss)/dx_j for class offset + j, from
// the global lse: the same formula (cross_entropy.h) with the target compared in global classes (a row whose
// target lies in another shard has no target term here) and V, W = sum of all class weights, and the mean's
// denominators (the summed target weights, and the row count for the z-loss terms) global. The soft cap acts per
// element, so it shards trivially.
//
// Linear cross-entropy. The weight shard is [V_r, H] (and the bias shard [V_r]); hidden [*, H] and targets are
// the whole batch on every rank. Each rank's gradient of hidden is a partial sum over its classes: the caller
// sums it over the ranks (all_reduce; or reduce_scatter over tokens under sequence parallelism, where each
// rank keeps the rows of its own tokens). grad_weight and grad_bias are the shard's own and final.
//
// Two exact schedules, as for one device:
//  * recompute: linear_cross_entropy_shard_partials (one logits GEMM over token chunks), exchange, finalize
//    (cross_entropy_shard_finalize above), then linear_cross_entropy_shard_backward from the global lse
//    (logits again, grad_hidden, grad_weight: three GEMMs). Four GEMMs on V_r classes per rank.
//  * gradient in the forward (reduction sum/mean), in steps: the token chunks are walked once. For chunk k,
//    the logits step computes the chunk's logits (float32, into a workspace slot) and its partials; the
//    caller exchanges that chunk's partials (an O(chunk) collective; O(N) in all); the gradient step finalizes
//    the chunk (its lse and losses), forms the gradient of its logits while they are still in the workspace,
//    and feeds it to the grad_hidden / grad_weight GEMMs. Three GEMMs on V_r classes per rank: on R ranks
//    the GEMM work of one device's gradient-in-forward call divided by R, which is what makes two devices
//    close to twice as fast as one (the recompute schedule's four GEMMs on half the vocabulary would give only
//    1.5x against one device's three). The workspace has two logits slots (chunk k uses slot k % 2), so the
//    caller may start chunk k + 1's logits step before chunk k's gradient step, and overlap chunk k's exchange
//    with chunk k + 1's GEMM: the exchange's latency is hidden. Every rank must use the same token chunks
//    (the exchange pairs them up), hence linear_cross_entropy_shard_chunk_tokens.
//
// Pointers are read at each call: nothing of a tensor is kept from one call to another. Between the steps of
// one gradient-in-forward sequence the workspace carries state (targets, scalars, the logits slots, gradient
// accumulators); the tensors are read again at every step and must be the same ones. (A framework that frees
// and regathers a sharded weight between forward and backward, as FSDP does, is safe with either schedule: the
// steps all run in the forward; the recompute backward reads the weight it is given at its call.)
#pragma once

#include <cstddef>
#include <cstdint>

#include "logitless/cross_entropy.h"
#include "logitless/linear_cross_entropy.h"
#include "logitless/tensor.h"

namespace logitless {

// Where a shard's columns (logits) or rows (weight) sit in the whole vocabulary.
struct VocabShard {
  int64_t offset = 0;  // the class of the shard's first column, >= 0
  int64_t vocab = 0;   // V, the whole vocabulary: >= 1 and >= offset + V_shard
};

// Floats per token in a shard's partial statistics (see above).
inline constexpr int64_t kShardStats = 4;

// ---- cross-entropy over given logits ---------------------------------------------------------------------
//   logits      [*, V_r]  this shard's columns: fp32 / fp16 / bf16, last dimension contiguous, leading dimensions
//                         with any strides that do not overlap rows (as cross_entropy.h); V_r may be 0
//   target      [*]       int32 / int64 global class indices (or ignore_index), the leading shape of logits
//   weight      [V]       float32, optional: the whole vocabulary's class weights
//   partials    [*, 4]    float32, contiguous (N rows of kShardStats); finalize takes [R, *, 4], contiguous
//   loss, lse, z_loss, grad_loss, grad_logits: as in cross_entropy.h (grad_logits: [*, V_r]; may be logits)

// Bytes of scratch each cross-entropy shard call needs for N = target.numel() rows (0 on the CPU).
size_t cross_entropy_shard_workspace_bytes(const TensorView& target, const CrossEntropyOptions& options);

// This shard's partial statistics: one read of its logits. Targets are checked here (check_targets) against
// the whole vocabulary, so every rank raises the same error before any exchange.
void cross_entropy_shard_partials(const TensorView& logits, const TensorView& target, const TensorView& weight,
                                  const VocabShard& shard, const CrossEntropyOptions& options,
                                  const TensorView& partials, Workspace workspace, StreamHandle stream);

// Loss (and optional lse / z_loss) from every shard's partials [R, *, 4] (R >= 1, rank order); `vocab` is V.
// options.softcap is not used here (the partials are of capped logits already).
void cross_entropy_shard_finalize(const TensorView& partials, const TensorView& target, const TensorView& weight,
                                  int64_t vocab, const CrossEntropyOptions& options, const TensorView& loss,
                                  const TensorView& lse, const TensorView& z_loss, Workspace workspace,
                                  StreamHandle stream);

// The gradient of this shard's logits from the global lse (finalize's): grad_logits = d(loss)/d(logits) *
// grad_loss (float32 [] for sum/mean, [*] for none), one read of the logits and one write. Targets are not
// checked again.
void cross_entropy_shard_backward(const TensorView& logits, const TensorView& target, const TensorView& weight,
                                  const VocabShard& shard, const TensorView& lse, const TensorView& grad_loss,
                                  const CrossEntropyOptions& options, const TensorView& grad_logits,
                                  Workspace workspace, StreamHandle stream);

// ---- linear cross-entropy ------------------------------------------------------------------------------
//   hidden        [*, H]   as in linear_cross_entropy.h (every token, on every rank)
//   weight        [V_r, H] this shard's rows of the LM head, hidden's dtype; V_r may be 0
//   bias          [V_r]    optional, this shard's entries
//   target        [*]      global class indices
//   class_weight  [V]      optional, the whole vocabulary's
//   partials      [*, 4]   float32 contiguous, as above
//   grad_hidden   [*, H]   optional: this shard's partial sum (to be summed over the ranks); hidden's dtype or
//                          float32 (float32 keeps the sum over ranks from rounding each rank's part to 16 bits)
//   grad_weight   [V_r, H], grad_bias [V_r]: optional, the shard's own
// Options as in linear_cross_entropy.h; chunk_vocab and memory_budget size the chunks.

size_t linear_cross_entropy_shard_partials_workspace_bytes(const TensorView& hidden, const TensorView& weight,
                                                           const TensorView& target, const VocabShard& shard,
                                                           const LinearCrossEntropyOptions& options);

// The recompute schedule's forward: this shard's partials, one GEMM over token chunks. Targets are checked.
void linear_cross_entropy_shard_partials(const TensorView& hidden, const TensorView& weight, const TensorView& bias,
                                         const TensorView& target, const TensorView& class_weight,
                                         const VocabShard& shard, const LinearCrossEntropyOptions& options,
                                         const TensorView& partials, Workspace workspace, StreamHandle stream);

size_t linear_cross_entropy_shard_backward_workspace_bytes(const TensorView& hidden, const TensorView& weight,
                                                           const TensorView& target, const TensorView& grad_hidden,
                                                           const TensorView& grad_weight, const TensorView& grad_bias,
                                                           const VocabShard& shard,
                                                           const LinearCrossEntropyOptions& options);

// The recompute schedule's backward from the global lse (cross_entropy_shard_finalize's) times grad_loss.
void linear_cross_entropy_shard_backward(const TensorView& hidden, const TensorView& weight, const TensorView& bias,
                                         const TensorView& target, const TensorView& class_weight,
                                         const VocabShard& shard, const TensorView& lse, const TensorView& grad_loss,
                                         const LinearCrossEntropyOptions& options, const TensorView& grad_hidden,
                                         const TensorView& grad_weight, const TensorView& grad_bias,
                                         Workspace workspace, StreamHandle stream);

// The gradient-in-forward schedule in steps (reduction sum/mean; the gradients are those of the reduced loss,
// upstream gradient 1). The token chunk every rank must use: options.chunk_tokens when > 0, else a quarter of
// options.memory_budget over a float32 logits row of the widest shard (rounded to multiples of 128 tokens:
// 512 tokens at V_r = 64128 with the default 512 MiB, as many GEMM tiles per logits GEMM as one device's
// 256-token chunks at V = 128256). A pure function: equal arguments give equal chunks on every rank. With 16-bit
// inputs the grad_hidden / grad_weight GEMMs run over groups of whole chunks that the rest of the budget holds; where
// grad_weight is float32 (its sums over the groups land in it directly, as under autocast over float32 weights), the
// groups grow toward 2048 tokens as far as twice the budget holds them beside the two chunk slots, as on one device
// (at V_r = 128000 with the default budget: 2048 tokens instead of 1024).
int64_t linear_cross_entropy_shard_chunk_tokens(int64_t n_tokens, int64_t widest_shard,
                                                const LinearCrossEntropyOptions& options);

struct LinearCrossEntropyShardSteps {
  int64_t chunk_tokens = 0;    // tokens per chunk (the last may be shorter)
  int64_t num_chunks = 0;      // ceil(N / chunk_tokens); 0 for N = 0
  size_t workspace_bytes = 0;  // for every step of the sequence (on the CPU too: it holds the accumulators)
};

// The chunks and workspace of a step sequence: options.chunk_tokens must be > 0 (the agreed chunk).
LinearCrossEntropyShardSteps linear_cross_entropy_shard_steps(const TensorView& hidden, const TensorView& weight,
                                                              const TensorView& target, const TensorView& grad_hidden,
                                                              const TensorView& grad_weight,
                                                              const TensorView& grad_bias, const VocabShard& shard,
                                                              const LinearCrossEntropyOptions& options);

enum class ShardStep : int32_t {
  kLogits = 0,    // chunk k's logits into slot k % 2 and its partials into `partials` [rows_k, 4] (written).
                  // Chunk 0 first checks the targets and sets up the sequence.
  kGradient = 1,  // from `partials` [R, rows_k, 4] (every rank's partials of chunk k, read): the chunk's lse and
                  // losses, the gradient of its logits, and the gradients' GEMMs. The last chunk finishes the
                  // loss and the gradients.
};

// One step of the sequence for chunk `chunk`. Order: logits steps in chunk order, gradient steps in chunk order,
// gradient(k) after logits(k) (and after the exchange of its partials), logits(k + 2) after gradient(k) (slot
// reuse). Every step of a sequence gets the same tensors and options (with options.chunk_tokens > 0) and the
// same workspace. With N = 0 there are no steps: use linear_cross_entropy_forward_backward (nothing to exchange).
void linear_cross_entropy_shard_forward_backward_step(ShardStep step, int64_t chunk, const TensorView& partials,
                                                      const TensorView& hidden, const TensorView& weight,
                                                      const TensorView& bias, const TensorView& target,
                                                      const TensorView& class_weight, const VocabShard& shard,
                                                      const LinearCrossEntropyOptions& options, const TensorView& loss,
                                                      const TensorView& lse, const TensorView& grad_hidden,
                                                      const TensorView& grad_weight, const TensorView& grad_bias,
                                                      Workspace workspace, StreamHandle stream);

}  // namespace logitless
