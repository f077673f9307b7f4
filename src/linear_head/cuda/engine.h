// The linear-head engine: every loss computed from hidden states runs its GEMMs through it.
//
//   Z = X · Wᵀ (+ b)           per chunk of rows, float32, into the plan's logits buffer
//   loss.rows(chunk, Z)        the loss's per-row step: its statistics and outputs
//   loss.grad(chunk, Z, dZ)    the loss's gradient of the chunk's logits, in the GEMMs' dtype, into the group's rows
//   dX_g = dZ_g W, dW (+)= dZ_gᵀ X_g, db += Σ dZ      once per group of chunks, here and nowhere else
//
// A loss plugs in as a type (resolved at compile time, no indirection on the hot path) with
//
//   using Chunk = ...;                                          // has int64_t row0, rows
//   Chunk chunk_at(int64_t row0, int64_t max_rows, int64_t limit) const;   // how rows are cut (PlainChunks: evenly)
//   void rows(const Chunk& c, const float* z, int64_t ld);
//   void grad(const Chunk& c, const float* z, int64_t ld, void* dz, int64_t ld_dz, float* db_partial);
//
// and brings its own kernels (a row step, a gradient kernel using grad_columns.h) and its own workspace stage
// (plan.h). Cross-entropy and the policy losses are such types; a loss between two heads (KL or JSD between a
// student and a teacher) runs a teacher Engine's logits() into a second buffer inside its rows(), and a preference
// loss (DPO) is a rows() over chunks that hold a chosen and a rejected sequence: neither edits this file.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "linear_head/cuda/plan.h"
#include "linear_head/problem.h"
#include "logitless/tensor.h"

namespace logitless::head {

// One call's operands and gradient outputs.
struct HeadIO {
  int device = 0;
  DType dtype = DType::kBFloat16;  // hidden and weight
  int64_t n = 0, h = 0, v = 0;     // rows of hidden, hidden size, rows of the weight
  const void* x = nullptr;         // hidden rows as a GEMM operand [n, h], row stride ldx
  int64_t ldx = 0;
  Matrix w;                    // [v, h]
  const void* bias = nullptr;  // [v] or nullptr
  DType bias_dtype = DType::kFloat32;
  int64_t bias_stride = 1;
  Matrix grad_hidden, grad_weight;  // [n, h], [v, h]
  void* grad_bias = nullptr;        // [v] or nullptr
  DType grad_bias_dtype = DType::kFloat32;
  int64_t grad_bias_stride = 1;
};

// The HeadIO of a family's problem (fields named as the linear cross-entropy's and policy loss's problems name
// them): n rows of hidden read at x (row stride ldx).
template <typename Problem>
HeadIO head_io(const Problem& p, int64_t n, const void* x, int64_t ldx) {
  HeadIO io;
  io.device = p.device.index;
  io.dtype = p.dtype;
  io.n = n;
  io.h = p.hidden;
  io.v = p.vocab;
  io.x = x;
  io.ldx = ldx;
  io.w = p.weight;
  io.bias = p.bias;
  io.bias_dtype = p.bias_dtype;
  io.bias_stride = p.bias_stride;
  io.grad_hidden = p.grad_hidden;
  io.grad_weight = p.grad_weight;
  io.grad_bias = p.grad_bias;
  io.grad_bias_dtype = p.grad_bias_dtype;
  io.grad_bias_stride = p.grad_bias_stride;
  return io;
}

// The buffers of a sweep, as the loss's plan sized them.
struct SweepBuffers {
  int64_t chunk_rows = 0, group_rows = 0;
  float* logits = nullptr;  // float32 [chunk_rows (in place: group_rows), ld_logits]
  int64_t ld_logits = 0;
  void* dlogits = nullptr;  // [group_rows, ld_dlogits] in the GEMMs' dtype; nullptr: in place over the logits
  int64_t ld_dlogits = 0;
  DwAccumulator dw_acc;         // float32 [v, h] when grad_weight sums over several groups; none: the group GEMMs
                                // sum in grad_weight itself (beta = 1 from the second group on)
  float* db = nullptr;          // float32 [v] with a bias gradient
  float* db_partial = nullptr;  // float32 [ceil(chunk_rows / kGradRowsPerBlock), ld_logits]
};

// Chunks of at most max_rows rows, cut only by the group's end.
struct PlainChunk {
  int64_t row0 = 0, rows = 0;
};
struct PlainChunks {
  using Chunk = PlainChunk;
  Chunk chunk_at(int64_t row0, int64_t max_rows, int64_t limit) const {
    return Chunk{row0, std::min(std::max<int64_t>(max_rows, 1), limit - row0)};
  }
};

class Engine {
 public:
  Engine(const HeadIO& io, cublasHandle_t blas, int sm_count, cudaStream_t stream)
      : io_(io), blas_(blas), sm_count_(sm_count), stream_(stream) {}
  const HeadIO& io() const { return io_; }
  int sm_count() const { return sm_count_; }
  cudaStream_t stream() const { return stream_; }

  const void* x_rows(int64_t r0) const;
  const void* w_rows(int64_t v0) const;
  // Z [rows, width] (float32, ld) = X[r0 : r0 + rows] · W[v0 : v0 + width]ᵀ (+ bias[v0 : v0 + width]).
  void logits(float* z, int64_t ld, int64_t r0, int64_t rows, int64_t v0, int64_t width) const;
  // dx [rows, h] (+)= dZ [rows, cols] · W[v0 : v0 + cols].
  void grad_hidden_gemm(const void* dz, int64_t ld_dz, int64_t rows, int64_t v0, int64_t cols, const Matrix& dx,
                        bool accumulate) const;
  // dw [cols, h] (+)= dZ [rows, cols]ᵀ · x [rows, h] (ldx); tail: the accumulator's tail rows, a float32 sum on
  // the Hopper kernel whatever the rows, on its tiling for them (accumulate_gemm.h). With `out` (a 16-bit
  // [cols, h]), the sums are written there, dw only read where the Hopper kernel takes it, else cast after it.
  void grad_weight_gemm(const void* dz, int64_t ld_dz, int64_t rows, int64_t cols, const void* x, int64_t ldx,
                        const Matrix& dw, bool accumulate, bool tail = false, const Matrix& out = {}) const;
  // The same into every row of grad_weight's sums: the accumulator's parts where there is one, else grad_weight.
  // `written`: the head rows these products also write into grad_weight (DwAccumulator::rows_written_by; the last
  // group's, with accumulate, after every other sum into them), and the tail's rows with them.
  void grad_weight_sums(const void* dz, int64_t ld_dz, int64_t rows, const void* x, int64_t ldx,
                        const DwAccumulator& acc, bool accumulate, int64_t written = 0) const;
  // A token group's GEMMs: its rows of grad_hidden are final; grad_weight sums over groups (in acc if given), the
  // last group's products writing the rows the accumulator says.
  void group_gemms(const void* dz, int64_t ld_dz, int64_t g0, int64_t rows, const DwAccumulator& acc) const;
  // db (+)= the column sums of a gradient kernel's partials of `rows` rows.
  void bias_sums(const float* db_partial, int64_t rows, int64_t ld, float* db) const;
  // The float32 sums cast into grad_weight and grad_bias (either may be absent): the accumulator's tail first
  // (its 16-bit rows lie past its float32 copy), then its head; neither the tail nor the head's rows that the
  // last group's products wrote (DwAccumulator::written).
  void finish(const DwAccumulator& acc, const float* db) const;
  // No rows: grad_hidden's `dx_rows` rows, grad_weight and grad_bias are zero.
  void zero_grads(int64_t dx_rows) const;
  void clear(float* buffer, int64_t floats) const;

 private:
  HeadIO io_;
  cublasHandle_t blas_;
  int sm_count_;
  cudaStream_t stream_;
};

// One pass over every row, group by group and chunk by chunk: logits, loss.rows, and with `grads` loss.grad and the
// group's GEMMs; the sums cast at the end.
template <typename Loss>
void sweep(const Engine& e, const SweepBuffers& b, Loss& loss, bool grads) {
  const HeadIO& io = e.io();
  const int64_t N = io.n, S = b.chunk_rows, G = grads ? b.group_rows : N;
  const int64_t es = static_cast<int64_t>(dtype_size(io.dtype));
  if (grads && b.db) e.clear(b.db, io.v);
  for (int64_t g0 = 0; g0 < N; g0 += std::max<int64_t>(G, 1)) {
    const int64_t g1 = std::min(g0 + std::max<int64_t>(G, 1), N);
    for (int64_t r0 = g0; r0 < g1;) {
      const typename Loss::Chunk c = loss.chunk_at(r0, S, g1);
      // In place (float32), the group is one buffer that may hold several chunks: each at its own rows.
      float* z = b.logits + (grads && !b.dlogits ? (c.row0 - g0) * b.ld_logits : 0);
      e.logits(z, b.ld_logits, c.row0, c.rows, 0, io.v);
      loss.rows(c, z, b.ld_logits);
      if (grads) {
        void* dz = b.dlogits ? static_cast<void*>(static_cast<char*>(b.dlogits) + (c.row0 - g0) * b.ld_dlogits * es)
                             : static_cast<void*>(z);
        loss.grad(c, z, b.ld_logits, dz, b.ld_dlogits, b.db ? b.db_partial : nullptr);
        if (b.db) e.bias_sums(b.db_partial, c.rows, b.ld_logits, b.db);
      }
      r0 += c.rows;
    }
    if (grads) e.group_gemms(b.dlogits ? b.dlogits : b.logits, b.ld_dlogits, g0, g1 - g0, b.dw_acc);
  }
  if (grads) e.finish(b.dw_acc, b.db);
}

}  // namespace logitless::head
