// Chunking and workspace layout of the CUDA linear policy loss: pure host functions (no CUDA calls), so that a CPU
// test can check every decision. The runner (cuda/run.cpp) only executes a Plan.
//
// Chunk sizes come from the linear head's planner (linear_head/cuda/plan.h, plan_token_chunks: float32 logits of
// `chunk_rows` positions, the gradient of `group_rows` positions in the inputs' dtype for one dX / dW GEMM pair,
// a float32 grad_weight accumulator only where several groups need one). This file adds what the policy loss
// needs on top: chunks that map onto runs of tokens, and the per-token state.
//
// Rows and tokens (linear_policy_loss/problem.h): with hidden [B, L+1, H] the GEMMs run over all B (L+1)
// positions as one matrix (the unused last position costs 1 / (L+1) of the work, where leaving it out would
// cost a copy of hidden and a scatter of grad_hidden), and a chunk must be a run of positions that the policy row
// kernel can address: either inside one sequence, or whole sequences. So chunks of at least L+1 positions are
// whole sequences (chunk and group sizes rounded down to multiples of L+1), and shorter chunks stop at sequence
// ends.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/layout.h"
#include "linear_head/cuda/plan.h"

namespace logitless::lpl {

struct PlanInputs {
  bool grads = false;   // a gradient pass runs (forward-backward or backward)
  int64_t rows = 0;     // positions: B * row_len
  int64_t row_len = 1;  // positions per sequence (L or L + 1)
  int64_t seq_len = 1;  // tokens per sequence (L)
  int64_t tokens = 0;   // B * L
  int64_t h = 0, v = 0;
  int elem_bytes = 2;  // hidden and weight
  bool need_dx = false, need_dw = false, need_db = false;
  bool grad_weight_f32 = false;
  bool copy_hidden = false;  // hidden's positions have no one stride a GEMM can take
  bool token_logp = false;   // per-token logp kept in the workspace (the caller's output absent)
  bool token_lse = false;    // per-token lse likewise
  bool token_coeff = false;  // per-token d(loss)/d(logp)
  int64_t chunk_tokens = 0;
  size_t memory_budget = size_t{512} << 20;
  size_t cublas_workspace_bytes = size_t{32} << 20;
  size_t steps_bytes = 0;  // the policy steps' own workspace (policy_loss/cuda/steps.h)
};

struct Plan {
  int64_t chunk_rows = 0;         // positions of float32 logits per GEMM
  int64_t group_rows = 0;         // positions of the logits' gradient per dX / dW GEMM pair
  int64_t ld_logits = 0;          // elements per row of the float32 logits chunk
  int64_t ld_dlogits = 0;         // ... of the logits' gradient
  bool dlogits_in_place = false;  // float32 inputs: the gradient overwrites its logits
  bool dw_accumulator = false;    // grad_weight sums over groups in a float32 buffer, cast at the end
  int64_t db_partial_rows = 0;    // float32 rows of bias-gradient partial sums per chunk (0: no bias gradient)

  size_t bytes = 0;  // the workspace: every stage of declare_workspace
};

// The policy loss's stage: the policy steps' own workspace and the per-token state (float32 [tokens]).
struct PolicyBuffers {
  char* steps = nullptr;
  float* logp = nullptr;
  float* lse = nullptr;
  float* coeff = nullptr;
};

struct Buffers {
  PolicyBuffers policy;
  head::HeadBuffers head;
};

// Every stage's regions of plan `p` in `L`, pointers into `b` (set by L.carve): the policy loss's, then the engine's.
void declare_workspace(const PlanInputs& in, const Plan& p, head::WorkspaceLayout& L, Buffers* b);

Plan plan_linear_policy_loss(const PlanInputs& in);

// A chunk of positions and the run of tokens it holds. Token i of the run is at position `token_rows.offset(i)`
// (in rows) of the chunk.
struct RowChunk {
  int64_t row0 = 0, rows = 0;
  int64_t first_token = 0, n_tokens = 0;
  RowLayout token_rows;  // in units of chunk rows
};

// The chunk that starts at position `row0`, at most `max_rows` long and ending by `limit`, cut at the end of
// its sequence when it starts inside one or is shorter than a sequence.
RowChunk chunk_at(int64_t row0, int64_t max_rows, int64_t limit, int64_t row_len, int64_t seq_len);

// The sweep over `rows` positions that every pass makes: groups of `group_rows` (on_group(g0, g1) after the
// group's chunks), each cut into chunks of at most `chunk_rows` by chunk_at (on_chunk(chunk, g0)).
template <typename OnChunk, typename OnGroup>
void for_each_chunk(int64_t rows, int64_t chunk_rows, int64_t group_rows, int64_t row_len, int64_t seq_len,
                    const OnChunk& on_chunk, const OnGroup& on_group) {
  const int64_t G = group_rows > 0 ? group_rows : 1;
  for (int64_t g0 = 0; g0 < rows; g0 += G) {
    const int64_t g1 = g0 + G < rows ? g0 + G : rows;
    for (int64_t r0 = g0; r0 < g1;) {
      const RowChunk c = chunk_at(r0, chunk_rows, g1, row_len, seq_len);
      on_chunk(c, g0);
      r0 += c.rows;
    }
    on_group(g0, g1);
  }
}

}  // namespace logitless::lpl
