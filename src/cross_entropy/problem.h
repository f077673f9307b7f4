// The validated, framework-free description of one cross-entropy call that every backend consumes.
// api.cpp builds it (all argument checking happens there); cpu.cpp and cuda/ only compute.
#pragma once

#include <cstdint>

#include "common/layout.h"
#include "logitless/cross_entropy.h"

namespace logitless::ce {

// kPartials and kFinalize are the vocabulary-parallel steps (include/logitless/vocab_parallel.h): a shard's
// partial statistics, and the loss from every shard's partials (no logits).
enum class Mode { kForward, kForwardBackward, kBackward, kPartials, kFinalize };

struct Problem {
  Mode mode = Mode::kForward;
  int64_t n_rows = 0;
  int64_t vocab = 0;              // columns of the logits (a shard's V_r; kFinalize: the whole vocabulary)
  int64_t vocab_offset = 0;       // the class of column 0 (a vocabulary shard's offset; 0 otherwise)
  int64_t vocab_total = 0;        // the whole vocabulary V (0: vocab): targets are valid in [0, V), W and eps / V
                                  // are over it
  DType dtype = DType::kFloat32;  // logits and grad

  const void* logits = nullptr;
  RowLayout logits_rows;
  const void* target = nullptr;
  DType target_dtype = DType::kInt64;
  RowLayout target_rows;
  const float* weight = nullptr;  // [total_vocab()] (every class, also for a shard) or nullptr
  int64_t weight_stride = 1;

  float* loss = nullptr;    // [] (sum/mean) or [N] contiguous (none); unused in kBackward
  float* lse = nullptr;     // [N] contiguous, optional (forward modes)
  float* z_loss = nullptr;  // [N] contiguous, optional (forward modes)
  void* grad = nullptr;     // grad_logits (kForwardBackward, kBackward)
  RowLayout grad_rows;
  const float* lse_in = nullptr;      // [N] (kBackward)
  const float* grad_scale = nullptr;  // [] or [N]; kForwardBackward: optional; kBackward: grad_loss
  bool grad_scale_per_row = false;
  // The z-loss term's own upstream factor, laid out as grad_scale, where it differs from grad_scale's (a linear
  // head's chunks, reduction none here: grad_scale holds upstream / sum of target weights, this upstream / count);
  // nullptr: grad_scale's. CPU backend only.
  const float* z_grad_scale = nullptr;
  float* partials = nullptr;           // kPartials: [N, 4] out
  const float* partials_in = nullptr;  // kFinalize: [n_shards, N, 4]
  int64_t n_shards = 0;

  int64_t ignore_index = -100;
  Reduction reduction = Reduction::kMean;
  float label_smoothing = 0.f;
  float z_loss_scale = 0.f;
  float softcap = 0.f;
  bool check_targets = true;
  CrossEntropyAlgo algo = CrossEntropyAlgo::kAuto;
  Device device;

  int64_t total_vocab() const { return vocab_total > 0 ? vocab_total : vocab; }
};

void run_cpu(const Problem& p);
void scale_rows_cpu(void* grad, DType dtype, const RowLayout& rows, int64_t n_rows, int64_t vocab, const float* scale,
                    bool per_row);

#if defined(LOGITLESS_WITH_CUDA)
size_t cuda_workspace_bytes(int64_t n_rows, int64_t vocab, bool has_weight, const CrossEntropyOptions& o);
void run_cuda(const Problem& p, Workspace ws, StreamHandle stream);
void scale_rows_cuda(void* grad, DType dtype, const RowLayout& rows, int64_t n_rows, int64_t vocab, const float* scale,
                     bool per_row, Device device, StreamHandle stream);
#endif

}  // namespace logitless::ce
