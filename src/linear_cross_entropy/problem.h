// The validated, framework-free description of one linear cross-entropy call that every backend consumes.
// api.cpp builds it (all argument checking happens there); cpu.cpp and cuda/ only compute.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/layout.h"
#include "linear_head/problem.h"
#include "logitless/linear_cross_entropy.h"

namespace logitless::lce {

// kPartials and the two steps are the vocabulary-parallel calls (include/logitless/vocab_parallel.h): a shard's
// partial statistics (the recompute schedule's forward), and the gradient-in-forward schedule's steps.
enum class Mode { kForward, kForwardBackward, kBackward, kPartials, kStepLogits, kStepGradient };

using head::Matrix;

struct Problem {
  Mode mode = Mode::kForward;
  int64_t n_tokens = 0;           // N
  int64_t hidden = 0;             // H
  int64_t vocab = 0;              // V: the weight's rows (a vocabulary shard's V_r)
  int64_t vocab_offset = 0;       // a shard's first class (0 otherwise)
  int64_t vocab_total = 0;        // the whole vocabulary (== vocab unless sharded): targets and class weights are of it
  DType dtype = DType::kFloat32;  // hidden and weight
  Device device;

  // hidden: rows by `hidden_rows` (any collapsed layout); `hidden_uniform` when they also have one stride
  // >= H (then hidden_ld is it), so a GEMM can read them in place.
  const void* hidden_data = nullptr;
  RowLayout hidden_rows;
  bool hidden_uniform = true;
  int64_t hidden_ld = 0;
  Matrix weight;               // [V, H]
  const void* bias = nullptr;  // [V] or nullptr
  DType bias_dtype = DType::kFloat32;
  int64_t bias_stride = 1;

  const void* target = nullptr;
  DType target_dtype = DType::kInt64;
  RowLayout target_rows;
  const float* class_weight = nullptr;  // [vocab_total] or nullptr
  int64_t class_weight_stride = 1;

  float* loss = nullptr;       // [] or [N] (none); forward modes
  float* lse = nullptr;        // [N]: output (forward modes, optional) or input (backward)
  float* entropy = nullptr;    // [N]: options.row_stats (kForward, kForwardBackward), else nullptr
  uint8_t* is_top1 = nullptr;  // [N]: with entropy
  Matrix grad_hidden;          // data == nullptr: not wanted
  Matrix grad_weight;
  void* grad_bias = nullptr;  // [V] or nullptr
  DType grad_bias_dtype = DType::kFloat32;
  int64_t grad_bias_stride = 1;
  const float* grad_scale = nullptr;  // kForwardBackward: optional upstream factor; kBackward: grad_loss
  bool grad_scale_per_row = false;
  float* partials = nullptr;           // kPartials, kStepLogits: [rows, 4] out (the whole call's, or the chunk's)
  const float* partials_in = nullptr;  // kStepGradient: [n_shards, rows of the chunk, 4]
  int64_t n_shards = 0;
  int64_t step_chunk = 0;  // the steps' chunk

  LinearCrossEntropyOptions options;

  bool sharded() const { return vocab_offset != 0 || vocab != vocab_total; }
};

void run_cpu(const Problem& p);
// The steps on the CPU keep their gradient accumulators in the caller's workspace (host memory) between calls.
size_t cpu_step_workspace_bytes(const Problem& p);
void run_cpu_step(const Problem& p, Workspace ws);

#if defined(LOGITLESS_WITH_CUDA)
size_t cuda_workspace_bytes(const Problem& p);
void run_cuda(const Problem& p, Workspace ws, StreamHandle stream);
// p: kForwardBackward without gradient outputs; the flags say which ones (in the inputs' dtype) the call would have.
bool cuda_recompute_is_faster(const Problem& p, bool need_dx, bool need_dw, bool need_db);
#endif

}  // namespace logitless::lce
