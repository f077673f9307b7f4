// The steps of one policy-loss call on CUDA. run_cuda composes them over the given logits; a caller that produces
// the logits a chunk of tokens at a time (a fused linear head computes them from hidden states and consumes their
// gradient) composes them itself:
//
//   PolicySteps s(problem, workspace, stream);   // problem: the token-level inputs and outputs (its logits unused)
//   s.begin();                                   // everything that needs no logits: weights, factors, id check
//   s.check_ids();                               // waits for the id check's read-back: throws on a bad id
//   for each chunk: s.rows(chunk);               // statistics, outputs, loss shares; token level: the gradient
//   if sequence level: s.sequence();             //   the shared ratios, once every chunk's statistics are in
//                      for each chunk: s.rows_backward(chunk);   // the gradient from the saved lse
//   s.finish();                                  // the loss
//
// Such a caller may also want c = d(loss)/d(logp) per token rather than the gradient of its logits (it forms that
// gradient in its own kernel, e.g. narrowed to the dtype of its GEMMs): s.coefficients(...) after s.rows(...) of
// those tokens (token level; the problem's logp output must be given) or after s.sequence() (sequence level).
//
// A chunk is a set of consecutive tokens [first_token, first_token + n_tokens) with its own logits rows (any
// layout, e.g. a GEMM's [n_tokens, V] output) and gradient rows (may be the logits, in place).
#pragma once

#include <cuda_runtime.h>

#include "common/cuda/index_readback.h"
#include "common/layout.h"
#include "policy_loss/cuda/params.h"
#include "policy_loss/problem.h"

namespace logitless::pl {

struct Chunk {
  const void* logits = nullptr;
  RowLayout logits_rows;
  void* grad = nullptr;  // nullptr: no gradient
  RowLayout grad_rows;
  int64_t first_token = 0;
  int64_t n_tokens = 0;
};

class PolicySteps {
 public:
  PolicySteps(const Problem& pr, Workspace ws, cudaStream_t stream);
  void begin();
  // Throws on a bad id (an eager call of a forward mode): before anything the caller sees is written. Work queued
  // since begin() that writes only the caller's workspace overlaps the wait.
  void check_ids();
  void rows(const Chunk& c);
  void sequence();
  void rows_backward(const Chunk& c);
  // coeff[t] = d(loss)/d(logp_t) times grad_scale, for the tokens t in [first_token, first_token + n_tokens)
  // (float32, indexed by token): 0 at masked tokens, NaN at a bad id or a NaN logp (and, at the sequence level,
  // at every token of a sequence whose log-ratio is NaN). Reads logp from the problem's logp output.
  void coefficients(int64_t first_token, int64_t n_tokens, float* coeff);
  void finish();

  // The chunk covering every token of the problem with its own logits and gradient.
  Chunk whole() const;

 private:
  const Problem& pr_;
  char* ws_;
  cudaStream_t stream_;
  KernelParams base_;
  IndexReadback* readback_ = nullptr;  // begin()'s id check in flight
};

}  // namespace logitless::pl
