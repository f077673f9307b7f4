// Linear policy losses and linear selective log-softmax: argument validation and dispatch. Every check happens
// here, before any backend runs, so a bad call never touches memory.
#include <cmath>
#include <utility>

#include "common/check.h"
#include "linear_policy_loss/problem.h"
#include "logitless/linear_policy_loss.h"

namespace logitless {
namespace {

using lpl::Mode;
using lpl::Problem;

void check_chunking(int64_t chunk_tokens, size_t memory_budget) {
  LOGITLESS_CHECK_ARG(chunk_tokens >= 0, "chunk_tokens", "a count >= 1 (or 0: from memory_budget)", chunk_tokens);
  LOGITLESS_CHECK_ARG(memory_budget >= 1, "memory_budget", "at least 1 byte", memory_budget);
}

// hidden [*, H] (`lead` leading dimensions) and weight [V, H]: dtypes, devices, layouts. Fills the GEMM side of p.
void add_hidden_weight(Problem& p, const TensorView& hidden, const TensorView& weight) {
  const head::HiddenWeight hw = head::check_hidden_weight(hidden, weight, /*empty_vocab_ok=*/false);
  p.hidden = hw.hidden;
  p.vocab = hw.vocab;
  p.dtype = hw.dtype;
  p.device = hw.device;
  p.hidden_data = hw.hidden_data;
  p.hidden_rows = hw.hidden_rows;
  p.hidden_uniform = hw.hidden_uniform;
  p.hidden_ld = hw.hidden_ld;
  p.weight = hw.weight;
}

void add_bias(Problem& p, const TensorView& bias) {
  const head::BiasInput b = head::check_bias(bias, p.dtype, p.vocab, p.device);
  p.bias = b.data;
  p.bias_dtype = b.dtype;
  p.bias_stride = b.stride;
}

void check_extents(const Problem& p) {
  if (p.device.type != DeviceType::kCUDA) return;
  head::check_gemm_extent(p.n_rows, "hidden", "a number of positions");
  head::check_gemm_extent(p.vocab, "weight", "a vocabulary size");
  head::check_gemm_extent(p.hidden_ld, "hidden", "a row stride");
  head::check_gemm_extent(p.weight.ld, "weight", "a row stride");
}

// The gradient outputs (any may be absent). `bias` is null when only sizing a workspace.
void add_grads(Problem& p, const TensorView& hidden, const TensorView& weight, const TensorView* bias,
               const LinearPolicyLossGrads& g) {
  const head::GradOutputs o = head::check_grad_outputs(hidden, weight, bias, p.hidden, p.vocab, p.device, g.grad_hidden,
                                                       g.grad_weight, g.grad_bias);
  p.grad_hidden = o.grad_hidden;
  p.grad_weight = o.grad_weight;
  p.grad_bias = o.grad_bias;
  p.grad_bias_dtype = o.grad_bias_dtype;
  p.grad_bias_stride = o.grad_bias_stride;
}

// No output may share memory with an input or with another output: the GEMMs and the row kernels read the inputs
// while writing the outputs. `more`: the call's other inputs (the backward's saved logp and lse, an upstream
// gradient).
void check_no_aliasing(const TensorView& hidden, const TensorView& weight, const TensorView& bias,
                       const LinearPolicyLossGrads& g, const PolicyLossOutputs* out = nullptr,
                       const PolicyLossInputs* tokens = nullptr, std::vector<NamedView> more = {}) {
  std::vector<NamedView> outs = {
      {g.grad_hidden, "grad_hidden"}, {g.grad_weight, "grad_weight"}, {g.grad_bias, "grad_bias"}};
  if (out) {
    for (const NamedView& o :
         {NamedView{out->loss, "loss"}, NamedView{out->per_token_loss, "per_token_loss"}, NamedView{out->kl, "kl"},
          NamedView{out->is_clipped, "is_clipped"}, NamedView{out->logp, "logp"}, NamedView{out->entropy, "entropy"},
          NamedView{out->lse, "lse"}})
      outs.push_back(o);
  }
  std::vector<NamedView> ins = {{hidden, "hidden"}, {weight, "weight"}, {bias, "bias"}};
  if (tokens) {
    for (const NamedView& i :
         {NamedView{tokens->completion_ids, "completion_ids"}, NamedView{tokens->advantages, "advantages"},
          NamedView{tokens->completion_mask, "completion_mask"}, NamedView{tokens->old_logp, "old_logp"},
          NamedView{tokens->ref_logp, "ref_logp"}})
      ins.push_back(i);
  }
  for (const NamedView& m : more) ins.push_back(m);
  check_outputs_apart(outs, ins);
}

// A float32 tensor of `n` elements, contiguous.
const float* check_token_vector(const TensorView& t, const char* name, int64_t n, const Device& dev, const char* what) {
  check_defined(t, name);
  check_dtype(t, name, DType::kFloat32);
  check_device(t, name, dev);
  check_numel(t, name, n, what);
  check_contiguous(t, name);
  check_nonnull(t, name);
  return static_cast<const float*>(t.data);
}

// A bool or uint8 tensor of `n` elements, contiguous: a per-row flag output.
uint8_t* check_flag_vector(const TensorView& t, const char* name, int64_t n, const Device& dev) {
  check_view(t, name);
  LOGITLESS_CHECK_ARG(t.dtype == DType::kBool || t.dtype == DType::kUInt8, name, "dtype bool or uint8",
                      dtype_name(t.dtype));
  check_device(t, name, dev);
  check_numel(t, name, n, "one per row");
  check_contiguous(t, name);
  check_nonnull(t, name);
  return static_cast<uint8_t*>(t.data);
}

// ---- the policy loss ---------------------------------------------------------------------------------------------

PolicyLossInputs token_inputs(const LinearPolicyLossInputs& in) {
  PolicyLossInputs t;
  t.completion_ids = in.completion_ids;
  t.advantages = in.advantages;
  t.completion_mask = in.completion_mask;
  t.old_logp = in.old_logp;
  t.ref_logp = in.ref_logp;
  return t;
}

// Everything but the gradients. `outputs` may hold only the loss slot undefined when sizing a workspace.
Problem policy_problem(Mode mode, const LinearPolicyLossInputs& in, const LinearPolicyLossOptions& o,
                       const PolicyLossOutputs& outputs) {
  check_chunking(o.chunk_tokens, o.memory_budget);
  Problem p;
  p.op = pl::Op::kPolicy;
  p.mode = mode;
  p.chunk_tokens = o.chunk_tokens;
  p.memory_budget = o.memory_budget;
  add_hidden_weight(p, in.hidden, in.weight);
  // hidden against completion_ids first: that mismatch is the one to report, not what follows from it.
  const TensorView& ids = in.completion_ids;
  check_defined(ids, "completion_ids");
  check_ndim(ids, "completion_ids", 2);
  const int64_t B = ids.sizes[0], L = ids.sizes[1];
  const TensorView& h = in.hidden;
  LOGITLESS_CHECK_ARG(h.ndim == 3 && h.sizes[0] == B && (h.sizes[1] == L + 1 || h.sizes[1] == L), "hidden",
                      str_cat("shape [", B, ", ", L + 1,
                              ", H] (the last hidden states over the completion and the "
                              "position after it) or [",
                              B, ", ", L, ", H], from completion_ids of shape [", B, ", ", L, "]"),
                      str_cat("shape ", shape_str(h)));
  const pl::Mode tm = mode == Mode::kForward ? pl::Mode::kForward : pl::Mode::kForwardBackward;
  p.tokens = pl::make_token_problem(tm, token_inputs(in), o.policy, outputs, p.device, p.vocab);
  p.row_len = h.sizes[1];
  p.n_rows = B * p.row_len;
  add_bias(p, in.bias);
  check_extents(p);
  return p;
}

// A loss slot for the workspace queries, which take no outputs: a valid scalar on the inputs' device that no
// call writes through.
PolicyLossOutputs sizing_outputs(const TensorView& hidden) {
  static float dummy = 0.f;
  PolicyLossOutputs out;
  out.loss = TensorView::make(&dummy, DType::kFloat32, hidden.device, {});
  return out;
}

// ---- selective log-softmax ---------------------------------------------------------------------------------------

Problem selective_problem(Mode mode, const TensorView& hidden, const TensorView& weight, const TensorView& ids,
                          const LinearSelectiveLogSoftmaxOptions& o) {
  LOGITLESS_CHECK_ARG(o.temperature > 0.0 && std::isfinite(o.temperature), "temperature", "a finite value > 0",
                      o.temperature);
  check_chunking(o.chunk_tokens, o.memory_budget);
  Problem p;
  p.op = pl::Op::kSelective;
  p.mode = mode;
  p.chunk_tokens = o.chunk_tokens;
  p.memory_budget = o.memory_budget;
  add_hidden_weight(p, hidden, weight);
  check_defined(ids, "ids");
  check_index_dtype(ids, "ids");
  check_device(ids, "ids", p.device);
  check_shape(ids, "ids", hidden, hidden.ndim - 1, "the leading dimensions of hidden");
  check_nonnull(ids, "ids");
  const int64_t N = ids.numel();
  p.n_rows = N;
  p.row_len = std::max<int64_t>(N, 1);
  pl::Problem& t = p.tokens;
  t.op = pl::Op::kSelective;
  t.mode = pl::Mode::kForward;
  t.n_seqs = 1;
  t.seq_len = N;
  t.n_rows = N;
  t.vocab = p.vocab;
  t.device = p.device;
  t.ids = ids.data;
  t.ids_dtype = ids.dtype;
  t.ids_rows = collapse_rows(ids.sizes, ids.ndim, {ids.strides}, "ids")[0];
  t.temperature = o.temperature;
  t.check_ids = o.check_ids;
  t.beta = 0;
  check_extents(p);
  return p;
}

// ---- dispatch ----------------------------------------------------------------------------------------------------

size_t workspace_bytes(const Problem& p) {
  if (p.device.type != DeviceType::kCUDA) return 0;
#if defined(LOGITLESS_WITH_CUDA)
  check_cuda_target("hidden", p.device, nullptr);  // the plan reads the device's properties
  return lpl::cuda_workspace_bytes(p);
#else
  return 0;
#endif
}

void dispatch(const Problem& p, Workspace ws, StreamHandle stream, const char* what) {
  if (p.device.type == DeviceType::kCPU) {
    lpl::run_cpu(p);
    return;
  }
#if defined(LOGITLESS_WITH_CUDA)
  (void)what;
  check_cuda_target("hidden", p.device, stream);
  check_workspace(ws, lpl::cuda_workspace_bytes(p));
  lpl::run_cuda(p, ws, stream);
#else
  (void)ws;
  (void)stream;
  throw_runtime(str_cat(what, ": logitless was built without its CUDA backend; CUDA tensors are not supported"));
#endif
}

}  // namespace

size_t linear_policy_loss_forward_workspace_bytes(const LinearPolicyLossInputs& inputs,
                                                  const LinearPolicyLossOptions& options) {
  return workspace_bytes(policy_problem(Mode::kForward, inputs, options, sizing_outputs(inputs.hidden)));
}

size_t linear_policy_loss_forward_backward_workspace_bytes(const LinearPolicyLossInputs& inputs,
                                                           const LinearPolicyLossOptions& options,
                                                           const LinearPolicyLossGrads& grads) {
  Problem p = policy_problem(Mode::kForwardBackward, inputs, options, sizing_outputs(inputs.hidden));
  add_grads(p, inputs.hidden, inputs.weight, nullptr, grads);
  return workspace_bytes(p);
}

size_t linear_policy_loss_backward_workspace_bytes(const LinearPolicyLossInputs& inputs,
                                                   const LinearPolicyLossOptions& options,
                                                   const LinearPolicyLossGrads& grads) {
  Problem p = policy_problem(Mode::kBackward, inputs, options, sizing_outputs(inputs.hidden));
  add_grads(p, inputs.hidden, inputs.weight, nullptr, grads);
  return workspace_bytes(p);
}

void linear_policy_loss_forward(const LinearPolicyLossInputs& inputs, const LinearPolicyLossOptions& options,
                                const PolicyLossOutputs& outputs, Workspace workspace, StreamHandle stream) {
  const Problem p = policy_problem(Mode::kForward, inputs, options, outputs);
  const PolicyLossInputs tokens = token_inputs(inputs);
  check_no_aliasing(inputs.hidden, inputs.weight, inputs.bias, {}, &outputs, &tokens);
  dispatch(p, workspace, stream, "linear_policy_loss");
}

void linear_policy_loss_forward_backward(const LinearPolicyLossInputs& inputs, const LinearPolicyLossOptions& options,
                                         const PolicyLossOutputs& outputs, const LinearPolicyLossGrads& grads,
                                         const TensorView& grad_scale, Workspace workspace, StreamHandle stream) {
  Problem p = policy_problem(Mode::kForwardBackward, inputs, options, outputs);
  add_grads(p, inputs.hidden, inputs.weight, &inputs.bias, grads);
  if (grad_scale.defined()) p.tokens.grad_scale = check_token_vector(grad_scale, "grad_scale", 1, p.device, "a scalar");
  const PolicyLossInputs tokens = token_inputs(inputs);
  check_no_aliasing(inputs.hidden, inputs.weight, inputs.bias, grads, &outputs, &tokens, {{grad_scale, "grad_scale"}});
  dispatch(p, workspace, stream, "linear_policy_loss");
}

void linear_policy_loss_backward(const LinearPolicyLossInputs& inputs, const LinearPolicyLossOptions& options,
                                 const TensorView& logp, const TensorView& lse, const TensorView& grad_loss,
                                 const LinearPolicyLossGrads& grads, Workspace workspace, StreamHandle stream) {
  Problem p = policy_problem(Mode::kBackward, inputs, options, sizing_outputs(inputs.hidden));
  p.tokens.loss = nullptr;     // the backward writes no loss
  p.tokens.check_ids = false;  // the forward checked them
  add_grads(p, inputs.hidden, inputs.weight, &inputs.bias, grads);
  const int64_t n = p.n_tokens();
  p.logp_in = check_token_vector(logp, "logp", n, p.device, "one per token, from the forward");
  p.lse_in = check_token_vector(lse, "lse", n, p.device, "one per token, from the forward");
  p.tokens.grad_scale = check_token_vector(grad_loss, "grad_loss", 1, p.device, "a scalar");
  const PolicyLossInputs tokens = token_inputs(inputs);
  check_no_aliasing(inputs.hidden, inputs.weight, inputs.bias, grads, nullptr, &tokens,
                    {{logp, "logp"}, {lse, "lse"}, {grad_loss, "grad_loss"}});
  dispatch(p, workspace, stream, "linear_policy_loss");
}

size_t linear_selective_log_softmax_forward_workspace_bytes(const TensorView& hidden, const TensorView& weight,
                                                            const TensorView& ids,
                                                            const LinearSelectiveLogSoftmaxOptions& options) {
  return workspace_bytes(selective_problem(Mode::kForward, hidden, weight, ids, options));
}

size_t linear_selective_log_softmax_backward_workspace_bytes(const TensorView& hidden, const TensorView& weight,
                                                             const TensorView& ids,
                                                             const LinearSelectiveLogSoftmaxOptions& options,
                                                             const LinearPolicyLossGrads& grads) {
  Problem p = selective_problem(Mode::kBackward, hidden, weight, ids, options);
  add_grads(p, hidden, weight, nullptr, grads);
  return workspace_bytes(p);
}

void linear_selective_log_softmax_forward(const TensorView& hidden, const TensorView& weight, const TensorView& bias,
                                          const TensorView& ids, const LinearSelectiveLogSoftmaxOptions& options,
                                          const TensorView& logp, const TensorView& entropy, const TensorView& lse,
                                          const TensorView& is_top1, Workspace workspace, StreamHandle stream) {
  Problem p = selective_problem(Mode::kForward, hidden, weight, ids, options);
  add_bias(p, bias);
  const int64_t n = p.n_tokens();
  p.tokens.logp = const_cast<float*>(check_token_vector(logp, "logp", n, p.device, "one per row"));
  if (entropy.defined())
    p.tokens.entropy = const_cast<float*>(check_token_vector(entropy, "entropy", n, p.device, "one per row"));
  if (lse.defined()) p.tokens.lse = const_cast<float*>(check_token_vector(lse, "lse", n, p.device, "one per row"));
  if (is_top1.defined()) p.tokens.is_top1 = check_flag_vector(is_top1, "is_top1", n, p.device);
  check_outputs_apart({{logp, "logp"}, {entropy, "entropy"}, {lse, "lse"}, {is_top1, "is_top1"}},
                      {{hidden, "hidden"}, {weight, "weight"}, {bias, "bias"}, {ids, "ids"}});
  dispatch(p, workspace, stream, "linear_selective_log_softmax");
}

void linear_selective_log_softmax_backward(const TensorView& hidden, const TensorView& weight, const TensorView& bias,
                                           const TensorView& ids, const TensorView& lse, const TensorView& grad_logp,
                                           const LinearSelectiveLogSoftmaxOptions& options,
                                           const LinearPolicyLossGrads& grads, Workspace workspace,
                                           StreamHandle stream) {
  Problem p = selective_problem(Mode::kBackward, hidden, weight, ids, options);
  p.tokens.check_ids = false;  // the forward checked them
  add_bias(p, bias);
  add_grads(p, hidden, weight, &bias, grads);
  const int64_t n = p.n_tokens();
  p.lse_in = check_token_vector(lse, "lse", n, p.device, "one per row, from the forward");
  p.grad_logp = check_token_vector(grad_logp, "grad_logp", n, p.device, "one per row");
  check_no_aliasing(hidden, weight, bias, grads, nullptr, nullptr,
                    {{ids, "ids"}, {lse, "lse"}, {grad_logp, "grad_logp"}});
  dispatch(p, workspace, stream, "linear_selective_log_softmax");
}

}  // namespace logitless
