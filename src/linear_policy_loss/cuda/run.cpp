// The CUDA path of the linear policy loss and linear selective log-softmax: cuBLAS GEMMs per chunk of hidden
// positions, the policy-loss steps (policy_loss/cuda/steps.h) for the statistics and the per-token terms, this
// family's gradient kernel, and the linear cross-entropy's helpers (bias fill, column sums, casts, row copy).
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
#include <algorithm>
#include <optional>

#include "common/cuda/check.cuh"
#include "common/cuda/cublas.h"
#include "linear_cross_entropy/cuda/kernels.h"
#include "linear_cross_entropy/cuda/plan.h"
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
  in.cublas_workspace_bytes = lce::cublas_workspace_for(device_info(p.device.index).sm_major);
  if (uses_steps(p)) in.steps_bytes = pl::cuda_workspace_bytes(t.op, t.n_seqs, t.n_rows, t.level);
  return in;
}

struct Run {
  const Problem& p;
  const Plan& plan;
  cudaStream_t stream;
  char* ws;
  int sm_count = 0;
  cublasHandle_t blas = nullptr;
  const void* x = nullptr;  // hidden positions as a GEMM operand [n_rows, H] (ldx)
  int64_t ldx = 0;
  pl::Problem tokens;      // the policy steps' problem: float32 chunks, per-token state in place
  float* coeff = nullptr;  // [tokens]
  const float* lse = nullptr;

  template <typename T>
  T* at(size_t off) const {
    return off == Plan::kNone ? nullptr : reinterpret_cast<T*>(ws + off);
  }

  const void* weight_rows(int64_t v0) const {
    return static_cast<const char*>(p.weight.data) + v0 * p.weight.ld * dtype_size(p.dtype);
  }
  const void* hidden_rows(int64_t r0) const { return static_cast<const char*>(x) + r0 * ldx * dtype_size(p.dtype); }

  // Z [rows, V] (float32, ld_logits) = X[r0 : r0 + rows] · Wᵀ (+ bias), at row `at_row` of the logits buffer.
  float* logits(int64_t r0, int64_t rows, int64_t at_row) const {
    float* z = at<float>(plan.off_logits) + at_row * plan.ld_logits;
    if (p.bias)
      lce::launch_fill_bias(z, plan.ld_logits, rows, p.vocab, p.bias, p.bias_dtype, p.bias_stride, 0, sm_count, stream);
    gemm_row_major(blas, false, true, rows, p.vocab, p.hidden, hidden_rows(r0), ldx, p.weight.data, p.weight.ld,
                   p.dtype, z, plan.ld_logits, DType::kFloat32, /*accumulate=*/p.bias != nullptr);
    return z;
  }

  pl::Chunk chunk_of(const RowChunk& rc, const float* z) const {
    pl::Chunk c;
    c.logits = z;
    c.logits_rows = rc.token_rows;
    for (int d = 0; d < c.logits_rows.nd; ++d) c.logits_rows.strides[d] *= plan.ld_logits;
    c.first_token = rc.first_token;
    c.n_tokens = rc.n_tokens;
    return c;
  }

  // The gradient of a chunk's logits into rows [rc.row0 - g0, ...) of the group's buffer, and its column sums.
  void chunk_grad(const RowChunk& rc, const float* z, int64_t g0) const {
    const pl::Problem& t = p.tokens;
    const int64_t es = dtype_size(p.dtype);
    GradParams g;
    g.logits = z;
    g.ld_logits = plan.ld_logits;
    char* dz = plan.dlogits_in_place ? reinterpret_cast<char*>(const_cast<float*>(z)) : at<char>(plan.off_dlogits);
    g.dlogits = plan.dlogits_in_place ? static_cast<void*>(dz) : dz + (rc.row0 - g0) * plan.ld_dlogits * es;
    g.ld_dlogits = plan.ld_dlogits;
    g.db_partial = at<float>(plan.off_db_partial);
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
    if (g.db_partial)
      lce::launch_column_sums(g.db_partial, (rc.rows + lce::kGradRowsPerBlock - 1) / lce::kGradRowsPerBlock,
                              plan.ld_logits, p.vocab, at<float>(plan.off_db), nullptr, DType::kFloat32, 1, stream);
  }

  // The group's gradients: its rows of grad_hidden are final; grad_weight sums over groups in float32.
  void group_gemms(int64_t g0, int64_t grows) const {
    const void* dz =
        plan.dlogits_in_place ? static_cast<const void*>(at<float>(plan.off_logits)) : at<void>(plan.off_dlogits);
    if (p.grad_hidden.data) {
      char* dx = static_cast<char*>(p.grad_hidden.data) + g0 * p.grad_hidden.ld * dtype_size(p.grad_hidden.dtype);
      gemm_row_major(blas, false, false, grows, p.hidden, p.vocab, dz, plan.ld_dlogits, p.weight.data, p.weight.ld,
                     p.dtype, dx, p.grad_hidden.ld, p.grad_hidden.dtype, false);
    }
    if (p.grad_weight.data) {
      float* acc = at<float>(plan.off_dw);
      void* dw = acc ? static_cast<void*>(acc) : p.grad_weight.data;
      const int64_t ldw = acc ? p.hidden : p.grad_weight.ld;
      const DType dwt = acc ? DType::kFloat32 : p.grad_weight.dtype;
      gemm_row_major(blas, true, false, p.vocab, p.hidden, grows, dz, plan.ld_dlogits, hidden_rows(g0), ldx, p.dtype,
                     dw, ldw, dwt, /*accumulate=*/g0 > 0);
    }
  }

  // One sweep over the positions, group by group and chunk by chunk: the statistics (with `steps`), the
  // coefficients chunk by chunk (token level), and the gradient (`grads`).
  void sweep(pl::PolicySteps* steps, bool chunk_coeffs, bool grads) const {
    const int64_t R = p.n_rows, S = plan.chunk_rows, G = grads ? plan.group_rows : R;
    if (grads && p.grad_bias) LOGITLESS_CUDA_CHECK(cudaMemsetAsync(at<float>(plan.off_db), 0, p.vocab * 4, stream));
    for_each_chunk(
        R, S, G, p.row_len, p.tokens.seq_len,
        [&](const RowChunk& rc, int64_t g0) {
          // In place (float32), the group is one buffer of chunk_rows rows that may hold several chunks cut at
          // sequence ends: each chunk's logits, then its gradient, sit at its own rows.
          const float* z = logits(rc.row0, rc.rows, grads && plan.dlogits_in_place ? rc.row0 - g0 : 0);
          if (steps) steps->rows(chunk_of(rc, z));
          if (chunk_coeffs) steps->coefficients(rc.first_token, rc.n_tokens, coeff);
          if (grads) chunk_grad(rc, z, g0);
        },
        [&](int64_t g0, int64_t g1) {
          if (grads) group_gemms(g0, g1 - g0);
        });
    if (!grads) return;
    if (float* acc = at<float>(plan.off_dw))
      lce::launch_cast(acc, p.hidden, p.vocab, p.hidden, p.grad_weight.data, p.grad_weight.dtype, p.grad_weight.ld, 1,
                       sm_count, stream);
    if (p.grad_bias)
      lce::launch_cast(at<float>(plan.off_db), p.vocab, 1, p.vocab, p.grad_bias, p.grad_bias_dtype, 0,
                       p.grad_bias_stride, sm_count, stream);
  }

  // No tokens: every gradient is 0 (grad_hidden has a row per position, all unused when L = 0).
  void zero_grads() const {
    if (!grads_pass(p)) return;
    if (p.grad_hidden.data)
      lce::launch_cast(nullptr, 0, p.n_rows, p.hidden, p.grad_hidden.data, p.grad_hidden.dtype, p.grad_hidden.ld, 1,
                       sm_count, stream);
    if (p.grad_weight.data)
      lce::launch_cast(nullptr, 0, p.vocab, p.hidden, p.grad_weight.data, p.grad_weight.dtype, p.grad_weight.ld, 1,
                       sm_count, stream);
    if (p.grad_bias)
      lce::launch_cast(nullptr, 0, 1, p.vocab, p.grad_bias, p.grad_bias_dtype, 0, p.grad_bias_stride, sm_count, stream);
  }
};

}  // namespace

size_t cuda_workspace_bytes(const Problem& p) {
  DeviceGuard guard(p.device.index);
  return plan_linear_policy_loss(plan_inputs(p)).bytes;
}

void run_cuda(const Problem& p, Workspace ws, StreamHandle stream_handle) {
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_handle);
  DeviceGuard guard(p.device.index);
  const Plan plan = plan_linear_policy_loss(plan_inputs(p));
  Run r{p, plan, stream, static_cast<char*>(ws.data), 0, nullptr, nullptr, 0, pl::Problem{}, nullptr, nullptr};
  r.sm_count = device_info(p.device.index).sm_count;
  const bool policy = policy_op(p), grads = grads_pass(p);
  const bool seq = p.tokens.sequence_level();

  // The steps' problem: float32 logits chunks; logp and lse where the coefficients and the gradient find them.
  r.tokens = p.tokens;
  pl::Problem& t = r.tokens;
  t.dtype = DType::kFloat32;
  t.logits = nullptr;
  t.grad = nullptr;
  if (p.mode == Mode::kBackward) {
    t.logp = const_cast<float*>(p.logp_in);  // read by the sequence terms and the coefficients only
    r.lse = p.lse_in;
  } else {
    if (!t.logp) t.logp = r.at<float>(plan.off_logp);
    if (!t.lse) t.lse = r.at<float>(plan.off_lse);
    r.lse = t.lse;
  }
  r.coeff = policy ? r.at<float>(plan.off_coeff) : const_cast<float*>(p.grad_logp);

  std::optional<pl::PolicySteps> steps;
  if (uses_steps(p)) {
    steps.emplace(t, Workspace{r.at<char>(plan.off_steps), plan.steps_bytes}, stream);
    steps->begin();  // weights, factors and (forward modes) the id check, before anything is written
  }
  if (t.n_rows == 0) {
    r.zero_grads();
    if (steps && p.mode != Mode::kBackward) steps->finish();
    return;
  }
  r.x = p.hidden_data;
  r.ldx = p.hidden_ld;
  if (!p.hidden_uniform) {
    void* copy = r.at<void>(plan.off_hidden);
    lce::launch_copy_rows(p.hidden_data, p.hidden_rows, p.n_rows, p.hidden, static_cast<int>(dtype_size(p.dtype)), copy,
                          r.sm_count, stream);
    r.x = copy;
    r.ldx = p.hidden;
  }
  r.blas = cublas_handle(stream, r.at<void>(plan.off_cublas), plan.cublas_bytes);

  if (p.mode == Mode::kBackward) {
    if (!grads) return;  // no gradient asked for
    if (policy) {
      if (seq) steps->sequence();
      steps->coefficients(0, t.n_rows, r.coeff);
    }
    r.sweep(nullptr, false, true);
    return;
  }
  if (!grads || !policy) {  // the forward (and its sequence terms)
    r.sweep(&*steps, false, false);
    steps->sequence();
  } else if (!seq) {  // token level: statistics, coefficients and gradient in one pass
    r.sweep(&*steps, true, true);
  } else {  // sequence level: statistics, the sequence terms and every coefficient, then the gradient pass
    r.sweep(&*steps, false, false);
    steps->sequence();
    steps->coefficients(0, t.n_rows, r.coeff);
    r.sweep(nullptr, false, true);
  }
  steps->finish();
}

}  // namespace logitless::lpl
