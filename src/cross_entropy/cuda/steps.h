// The steps of one cross-entropy call on CUDA, for callers inside the library that produce the logits themselves
// (a linear head computes them a chunk of rows at a time) and so must not go through the public API, which
// validates and prepasses every call. run_cuda composes them over the given logits:
//
//   kp = make_params(problem, scalars, row_loss);
//   launch_prepass(kp, {reduction, scalars}, stream);   // once per call: the mean's divisors, W, the first bad row
//   launch_rows(problem, kp, stream);                   // per chunk of rows: the row kernel of problem.mode
//
// A chunked caller prepasses its whole call once (with rows_out: the scalars its per-chunk calls take, which
// reduce nothing) and then calls launch_rows per chunk with a Problem of that chunk: reduction none, the rows'
// targets, any logits layout.
#pragma once

#include <cuda_runtime.h>

#include "common/cuda/index_readback.h"
#include "cross_entropy/cuda/params.h"
#include "cross_entropy/problem.h"

namespace logitless::ce {

KernelParams make_params(const Problem& pr, const Scalars* scalars, float* row_loss);

// What the prepass writes besides reading the targets of p (p.n_rows of them, classified against p.vocab_total,
// weighted by p.weight).
struct Prepass {
  Reduction reduction = Reduction::kMean;  // the divisors of `out`: the mean's, or 1
  Scalars* out = nullptr;
  Scalars* rows_out = nullptr;     // optional: the same W and first bad row with divisors 1 (per-row calls)
  int64_t* targets_out = nullptr;  // optional: the targets as contiguous int64 [n_rows]
};
// One CTA, a fixed order: the sums are bit-identical on every run.
void launch_prepass(const KernelParams& p, const Prepass& q, cudaStream_t stream);

// Waits for the read-back of the prepass's first bad row and throws if there is one, naming the target found there
// (`targets`: int32 or int64, rows laid out by `rows`; classes in [0, vocab) or ignore_index).
void throw_if_bad_target(IndexReadback& rb, int64_t n_rows, const void* targets, DType dtype, const RowLayout& rows,
                         int64_t vocab, int64_t ignore_index);

// The row kernel of pr.mode (kForward, kForwardBackward, kBackward, kPartials, kFinalize) over pr's rows, as
// run_cuda plans it (row-resident or streaming; a shard streams). No prepass, no check, no reduction, no workspace.
void launch_rows(const Problem& pr, const KernelParams& kp, cudaStream_t stream);

}  // namespace logitless::ce
