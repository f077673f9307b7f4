#include "linear_policy_loss/cuda/plan.h"

#include <algorithm>

#include "linear_head/cuda/plan.h"

namespace logitless::lpl {
Plan plan_linear_policy_loss(const PlanInputs& in) {
  Plan p;
  p.ld_logits = (in.v + 7) / 8 * 8;  // 32-byte float32 rows; 16-byte rows of a 16-bit gradient alike
  p.ld_dlogits = p.ld_logits;
  p.dlogits_in_place = in.grads && in.elem_bytes == 4;
  head::ChunkInputs c;  // the linear head's chunks, as the linear cross-entropy's generic path takes them
  c.n = in.rows;
  c.chunk_tokens = in.chunk_tokens;
  c.memory_budget = in.memory_budget;
  c.group_row_bytes = in.grads && !p.dlogits_in_place ? in.elem_bytes * p.ld_logits : 0;
  c.dw_accumulator_bytes = in.need_dw && !in.grad_weight_f32 ? static_cast<size_t>(4 * in.v * in.h) : 0;
  c.float32_grad_weight = in.grads && in.need_dw && in.grad_weight_f32;
  const head::ChunkPlan cp = head::plan_token_chunks(c, 4 * p.ld_logits);
  p.chunk_rows = std::max<int64_t>(cp.chunk_rows, 1);
  p.group_rows = std::max<int64_t>(cp.group_rows, p.chunk_rows);
  const int64_t Lg = std::max<int64_t>(in.row_len, 1);
  if (Lg != in.seq_len && p.chunk_rows >= Lg) {
    // Whole sequences per chunk and per group (positions of the unused last row sit between them).
    p.chunk_rows = p.chunk_rows / Lg * Lg;
    p.group_rows = p.dlogits_in_place ? p.chunk_rows : std::max(p.group_rows / Lg * Lg, p.chunk_rows);
  }
  p.dw_accumulator = in.grads && in.need_dw && !in.grad_weight_f32 && p.group_rows < in.rows;
  if (in.grads && in.need_db)
    p.db_partial_rows = (p.chunk_rows + head::kGradRowsPerBlock - 1) / head::kGradRowsPerBlock;

  Buffers b;
  head::WorkspaceLayout L;
  declare_workspace(in, p, L, &b);
  p.bytes = L.bytes();
  return p;
}

void declare_workspace(const PlanInputs& in, const Plan& p, head::WorkspaceLayout& L, Buffers* b) {
  const size_t nt = static_cast<size_t>(std::max<int64_t>(in.tokens, 0));
  PolicyBuffers& s = b->policy;
  L.add(&s.steps, in.steps_bytes);
  if (in.token_logp) L.add(&s.logp, nt * 4);
  if (in.token_lse) L.add(&s.lse, nt * 4);
  if (in.token_coeff) L.add(&s.coeff, nt * 4);
  if (in.rows <= 0) return;
  const auto es = static_cast<size_t>(in.elem_bytes), ld = static_cast<size_t>(p.ld_logits);
  head::HeadBytes h;
  h.cublas = in.cublas_workspace_bytes;
  h.hidden = in.copy_hidden ? static_cast<size_t>(in.rows * in.h) * es : 0;
  h.logits = static_cast<size_t>(p.chunk_rows) * ld * 4;
  if (in.grads) {
    h.dlogits = p.dlogits_in_place ? 0 : static_cast<size_t>(p.group_rows * p.ld_dlogits) * es;
    h.dw_acc = p.dw_accumulator ? static_cast<size_t>(in.v * in.h) * 4 : 0;
    h.db = in.need_db ? static_cast<size_t>(in.v) * 4 : 0;
    h.db_partial = in.need_db ? static_cast<size_t>(p.db_partial_rows) * ld * 4 : 0;
  }
  b->head.declare(L, h);
}

RowChunk chunk_at(int64_t row0, int64_t max_rows, int64_t limit, int64_t row_len, int64_t seq_len) {
  RowChunk c;
  c.row0 = row0;
  const int64_t Lg = std::max<int64_t>(row_len, 1), L = seq_len;
  int64_t end = std::min(row0 + std::max<int64_t>(max_rows, 1), limit);
  const int64_t b0 = row0 / Lg, l0 = row0 - b0 * Lg;
  c.token_rows.nd = 1;
  c.token_rows.sizes[0] = 1;
  c.token_rows.strides[0] = 1;
  if (Lg == L) {  // positions are tokens
    c.rows = end - row0;
    c.first_token = row0;
    c.n_tokens = c.rows;
    c.token_rows.sizes[0] = c.n_tokens;
    return c;
  }
  if (l0 != 0 || end - row0 < Lg) {  // inside one sequence: up to its end
    end = std::min(end, (b0 + 1) * Lg);
    c.rows = end - row0;
    c.first_token = b0 * L + std::min(l0, L);
    c.n_tokens = std::max<int64_t>(0, std::min(end - b0 * Lg, L) - l0);
    c.token_rows.sizes[0] = std::max<int64_t>(c.n_tokens, 1);
    return c;
  }
  // Whole sequences (the plan's sizes are multiples of Lg; a remainder would start the next chunk).
  const int64_t k = (end - row0) / Lg;
  c.rows = k * Lg;
  c.first_token = b0 * L;
  c.n_tokens = k * L;
  c.token_rows.nd = 2;
  c.token_rows.sizes[0] = k;
  c.token_rows.sizes[1] = L;
  c.token_rows.strides[0] = Lg;
  c.token_rows.strides[1] = 1;
  return c;
}

}  // namespace logitless::lpl
