// The CUDA path of the linear policy loss and linear selective log-softmax on the linear-head engine
// (linear_head/cuda/engine.h): its GEMMs per chunk of hidden positions, the policy-loss steps
// (policy_loss/cuda/steps.h) for the statistics and the per-token terms, and this family's gradient kernel.
// Host code only: it sequences launches on the caller's stream and never synchronizes, except where the policy
// steps report a bad id (eagerly, once per call, not while a CUDA graph is captured).
//
// Per call (S positions per chunk, G per group; plan.h):
//   forward:                per chunk: Z = X_c Wᵀ (+b) in float32; the row kernel -> logp, lse, outputs, the
//                           loss's shares; sequence level: then the sequence terms; the loss.
//   gradient in forward,    per chunk as above, then every token's c = d(loss)/d(logp), and dZ (the inputs'
//   token level:            dtype) into the group's buffer; per group: dX_g = dZ_g W, dW (+)= dZ_gᵀ X_g, db += Σ dZ.
//   gradient in forward,    the forward's chunks; the sequence terms and every c; then the gradient pass: per
//   sequence level:         chunk Z again and dZ, per group the GEMMs.
//   backward:               the sequence terms (sequence level) and every c from the saved logp and the incoming
//                           gradient (selective: c = grad_logp); the gradient pass.
#include <optional>

#include "common/cuda/check.cuh"
#include "common/cuda/cublas.h"
#include "linear_head/cuda/engine.h"
#include "linear_head/cuda/kernels.h"
#include "linear_head/cuda/plan.h"
#include "linear_policy_loss/cuda/kernels.h"
#include "linear_policy_loss/cuda/plan.h"
#include "linear_policy_loss/problem.h"
#include "policy_loss/cuda/steps.h"

namespace logitless::lpl {
namespace {

bool policy_op(const Problem& p) { return p.tokens.op == pl::Op::kPolicy; }
bool grads_pass(const Problem& p) { return p.mode != Mode::kForward && p.wants_grads(); }

// The policy steps run in every call but the selective backward (which has its coefficients given).
bool uses_steps(const Problem& p) { return policy_op(p) || p.mode == Mode::kForward; }

PlanInputs plan_inputs(const Problem& p) {
  const pl::Problem& t = p.tokens;
  PlanInputs in;
  in.grads = grads_pass(p);
  in.rows = p.n_rows;
  in.row_len = p.row_len;
  in.seq_len = t.seq_len;
  in.tokens = t.n_rows;
  in.h = p.hidden;
  in.v = p.vocab;
  in.elem_bytes = static_cast<int>(dtype_size(p.dtype));
  in.need_dx = p.grad_hidden.data != nullptr;
  in.need_dw = p.grad_weight.data != nullptr;
  in.need_db = p.grad_bias != nullptr;
  in.grad_weight_f32 = in.need_dw && p.grad_weight.dtype == DType::kFloat32;
  in.copy_hidden = !p.hidden_uniform;
  if (in.grads) {
    // The gradient pass reads every token's lse and c; the coefficients read logp (the backward's come saved).
    in.token_coeff = policy_op(p);
    in.token_lse = p.mode != Mode::kBackward && !t.lse;
    in.token_logp = policy_op(p) && p.mode != Mode::kBackward && !t.logp;
  }
  in.chunk_tokens = p.chunk_tokens;
  in.memory_budget = p.memory_budget;
  in.cublas_workspace_bytes = head::cublas_workspace_for(device_info(p.device.index).sm_major);
  if (uses_steps(p)) in.steps_bytes = pl::cuda_workspace_bytes(t.op, t.n_seqs, t.n_rows, t.level);
  return in;
}

// The loss side of the engine's sweep (linear_head/cuda/engine.h): chunks cut at sequence ends, the policy steps'
// statistics (with `steps`) and coefficients (token level, chunk by chunk), and this family's gradient kernel.
struct PolicyRows {
  using Chunk = RowChunk;
  const Problem& p;
  cudaStream_t stream;
  pl::PolicySteps* steps = nullptr;
  bool chunk_coeffs = false;
  float* coeff = nullptr;  // [tokens]
  const float* lse = nullptr;

  Chunk chunk_at(int64_t row0, int64_t max_rows, int64_t limit) const {
    return lpl::chunk_at(row0, max_rows, limit, p.row_len, p.tokens.seq_len);
  }

  void rows(const Chunk& rc, const float* z, int64_t ld) const {
    if (steps) {
      pl::Chunk c;
      c.logits = z;
      c.logits_rows = rc.token_rows;
      for (int d = 0; d < c.logits_rows.nd; ++d) c.logits_rows.strides[d] *= ld;
      c.first_token = rc.first_token;
      c.n_tokens = rc.n_tokens;
      steps->rows(c);
    }
    if (chunk_coeffs) steps->coefficients(rc.first_token, rc.n_tokens, coeff);
  }

  void grad(const Chunk& rc, const float* z, int64_t ld, void* dz, int64_t ld_dz, float* db_partial) const {
    const pl::Problem& t = p.tokens;
    GradParams g;
    g.logits = z;
    g.ld_logits = ld;
    g.dlogits = dz;
    g.ld_dlogits = ld_dz;
    g.db_partial = db_partial;
    g.rows = rc.rows;
    g.row0 = rc.row0;
    g.vocab = p.vocab;
    g.row_len = p.row_len;
    g.seq_len = t.seq_len;
    g.coeff = coeff;
    g.lse = lse;
    g.ids = t.ids;
    g.ids_is64 = t.ids_dtype == DType::kInt64;
    g.ids_rows = t.ids_rows;
    g.mask = t.mask;
    g.mask_dtype = static_cast<int32_t>(t.mask_dtype);
    g.mask_rows = t.mask_rows;
    g.inv_temp = static_cast<float>(1.0 / t.temperature);
    g.scale_l2 = static_cast<float>(1.4426950408889634 / t.temperature);
    launch_grad(g, p.dtype, stream);
  }
};

head::SweepBuffers sweep_buffers(const Plan& plan, const head::HeadBuffers& h) {
  head::SweepBuffers b;
  b.chunk_rows = plan.chunk_rows;
  b.group_rows = plan.group_rows;
  b.logits = h.logits;
  b.ld_logits = plan.ld_logits;
  b.dlogits = h.dlogits;  // nullptr when in place
  b.ld_dlogits = plan.ld_dlogits;
  b.dw_acc.head = h.dw_acc;
  b.db = h.db;
  b.db_partial = h.db_partial;
  return b;
}

}  // namespace

size_t cuda_workspace_bytes(const Problem& p) {
  DeviceGuard guard(p.device.index);
  return plan_linear_policy_loss(plan_inputs(p)).bytes;
}

void run_cuda(const Problem& p, Workspace ws, StreamHandle stream_handle) {
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_handle);
  DeviceGuard guard(p.device.index);
  const PlanInputs in = plan_inputs(p);
  const Plan plan = plan_linear_policy_loss(in);
  Buffers b;
  head::WorkspaceLayout layout;
  declare_workspace(in, plan, layout, &b);
  layout.carve(ws.data);
  const int sm_count = device_info(p.device.index).sm_count;
  const bool policy = policy_op(p), grads = grads_pass(p);
  const bool seq = p.tokens.sequence_level();

  // The steps' problem: float32 logits chunks; logp and lse where the coefficients and the gradient find them.
  pl::Problem t = p.tokens;
  t.dtype = DType::kFloat32;
  t.logits = nullptr;
  t.grad = nullptr;
  PolicyRows loss{p, stream};
  if (p.mode == Mode::kBackward) {
    t.logp = const_cast<float*>(p.logp_in);  // read by the sequence terms and the coefficients only
    loss.lse = p.lse_in;
  } else {
    if (!t.logp) t.logp = b.policy.logp;
    if (!t.lse) t.lse = b.policy.lse;
    loss.lse = t.lse;
  }
  loss.coeff = policy ? b.policy.coeff : const_cast<float*>(p.grad_logp);

  std::optional<pl::PolicySteps> steps;
  if (uses_steps(p)) {
    steps.emplace(t, Workspace{b.policy.steps, in.steps_bytes}, stream);
    steps->begin();  // weights, factors and (forward modes) the id check's read-back
  }
  const void* x = p.hidden_data;
  int64_t ldx = p.hidden_ld;
  if (b.head.hidden && t.n_rows > 0) {  // positions without one stride: their contiguous copy
    x = b.head.hidden;
    ldx = p.hidden;
    head::launch_copy_rows(p.hidden_data, p.hidden_rows, p.n_rows, p.hidden, static_cast<int>(dtype_size(p.dtype)),
                           b.head.hidden, sm_count, stream);
  }
  cublasHandle_t blas = t.n_rows > 0 ? cublas_handle(stream, b.head.cublas, in.cublas_workspace_bytes) : nullptr;
  if (steps) steps->check_ids();  // nothing the caller sees is written before this
  const head::Engine e(head::head_io(p, p.n_rows, x, ldx), blas, sm_count, stream);
  if (t.n_rows == 0) {  // no tokens: every gradient is 0 (grad_hidden has a row per position, all unused when L = 0)
    if (grads) e.zero_grads(p.n_rows);
    if (steps && p.mode != Mode::kBackward) steps->finish();
    return;
  }
  const head::SweepBuffers sb = sweep_buffers(plan, b.head);
  if (p.mode == Mode::kBackward) {
    if (!grads) return;  // no gradient asked for
    if (policy) {
      if (seq) steps->sequence();
      steps->coefficients(0, t.n_rows, loss.coeff);
    }
    head::sweep(e, sb, loss, true);
    return;
  }
  loss.steps = steps ? &*steps : nullptr;
  if (!grads || !policy) {  // the forward (and its sequence terms)
    head::sweep(e, sb, loss, false);
    steps->sequence();
  } else if (!seq) {  // token level: statistics, coefficients and gradient in one pass
    loss.chunk_coeffs = true;
    head::sweep(e, sb, loss, true);
  } else {  // sequence level: statistics, the sequence terms and every coefficient, then the gradient pass
    head::sweep(e, sb, loss, false);
    steps->sequence();
    steps->coefficients(0, t.n_rows, loss.coeff);
    loss.steps = nullptr;
    head::sweep(e, sb, loss, true);
  }
  steps->finish();
}

}  // namespace logitless::lpl
