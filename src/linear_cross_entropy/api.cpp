// Linear cross-entropy: argument validation and dispatch. Every argument check happens here, before any backend
// runs, so a bad call never touches memory; the CUDA runner checks the workspace against the plan it makes, also
// before it queues any work.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>

#include "common/check.h"
#include "linear_cross_entropy/cuda/plan.h"
#include "linear_cross_entropy/problem.h"
#include "linear_head/problem.h"
#include "logitless/linear_cross_entropy.h"
#include "logitless/vocab_parallel.h"

namespace logitless {
namespace {

using head::check_gemm_extent;
using lce::Matrix;
using lce::Mode;
using lce::Problem;

void check_options(const LinearCrossEntropyOptions& o) {
  LOGITLESS_CHECK_ARG(
      o.reduction == Reduction::kNone || o.reduction == Reduction::kSum || o.reduction == Reduction::kMean, "reduction",
      "none, sum or mean", static_cast<int>(o.reduction));
  LOGITLESS_CHECK_ARG(o.label_smoothing >= 0.0 && o.label_smoothing <= 1.0, "label_smoothing", "a value in [0, 1]",
                      o.label_smoothing);
  LOGITLESS_CHECK_ARG(o.z_loss >= 0.0 && std::isfinite(o.z_loss), "z_loss", "a finite value >= 0", o.z_loss);
  LOGITLESS_CHECK_ARG(o.softcap >= 0.0 && std::isfinite(o.softcap), "softcap", "a finite value > 0 (or 0 for no cap)",
                      o.softcap);
  LOGITLESS_CHECK_ARG(o.chunk_tokens >= 0, "chunk_tokens", "a count >= 1 (or 0: from memory_budget)", o.chunk_tokens);
  LOGITLESS_CHECK_ARG(o.chunk_vocab >= 0, "chunk_vocab", "a count >= 1 (or 0: from memory_budget)", o.chunk_vocab);
  LOGITLESS_CHECK_ARG(o.memory_budget >= 1, "memory_budget", "at least 1 byte", o.memory_budget);
  LOGITLESS_CHECK_ARG(o.grad_weight_accumulation == GradWeightAccumulation::kFloat32 ||
                          o.grad_weight_accumulation == GradWeightAccumulation::kWeightDtype,
                      "grad_weight_accumulation", "float32 or weight_dtype",
                      static_cast<int>(o.grad_weight_accumulation));
}

// hidden, weight and target, and the options: what every entry point (and every workspace query) takes.
// `shard`: the weight is a vocabulary shard's rows (which may be none); targets and class weights are of the
// whole vocabulary.
Problem base_problem(Mode mode, const TensorView& hidden, const TensorView& weight, const TensorView& target,
                     const LinearCrossEntropyOptions& o, const VocabShard* shard = nullptr) {
  check_options(o);
  const head::HiddenWeight hw = head::check_hidden_weight(hidden, weight, /*empty_vocab_ok=*/shard != nullptr);
  const int64_t H = hw.hidden, V = hw.vocab;
  const Device dev = hw.device;
  if (shard) {
    LOGITLESS_CHECK_ARG(shard->offset >= 0, "shard.offset", "a class index >= 0", shard->offset);
    LOGITLESS_CHECK_ARG(
        shard->vocab >= 1 && shard->vocab - shard->offset >= V, "shard.vocab",
        str_cat("the whole vocabulary, >= 1 and >= offset + the shard's ", V, " classes (", shard->offset + V, ")"),
        shard->vocab);
  }

  LOGITLESS_CHECK_ARG(!(shard && o.row_stats && mode != Mode::kBackward), "options.row_stats",
                      "false for a vocabulary shard (its exchange carries no entropy or argmax)", "true");

  check_defined(target, "target");
  check_index_dtype(target, "target");
  check_device(target, "target", dev);
  check_shape(target, "target", hidden, hidden.ndim - 1, "the leading dimensions of hidden");
  check_nonnull(target, "target");

  Problem p;
  p.mode = mode;
  p.n_tokens = target.numel();
  p.hidden = H;
  p.vocab = V;
  p.vocab_offset = shard ? shard->offset : 0;
  p.vocab_total = shard ? shard->vocab : V;
  p.dtype = hw.dtype;
  p.device = dev;
  p.options = o;
  if (mode == Mode::kBackward) p.options.row_stats = false;  // the forward's outputs: nothing to write here
  p.hidden_data = hw.hidden_data;
  p.hidden_rows = hw.hidden_rows;
  p.hidden_uniform = hw.hidden_uniform;
  p.hidden_ld = hw.hidden_ld;
  p.weight = hw.weight;
  p.target = target.data;
  p.target_dtype = target.dtype;
  p.target_rows = collapse_rows(target.sizes, target.ndim, {target.strides}, "target")[0];
  if (dev.type == DeviceType::kCUDA) {
    check_gemm_extent(p.n_tokens, "hidden", "a token count");
    check_gemm_extent(p.vocab_total, "weight", "a vocabulary size");
    check_gemm_extent(p.hidden_ld, "hidden", "a row stride");
    check_gemm_extent(p.weight.ld, "weight", "a row stride");
  }
  return p;
}

// The gradient outputs (any may be absent). `bias` is null when only sizing a workspace.
void add_grads(Problem& p, const TensorView& hidden, const TensorView& weight, const TensorView* bias,
               const TensorView& grad_hidden, const TensorView& grad_weight, const TensorView& grad_bias) {
  const head::GradOutputs g =
      head::check_grad_outputs(hidden, weight, bias, p.hidden, p.vocab, p.device, grad_hidden, grad_weight, grad_bias);
  p.grad_hidden = g.grad_hidden;
  p.grad_weight = g.grad_weight;
  p.grad_bias = g.grad_bias;
  p.grad_bias_dtype = g.grad_bias_dtype;
  p.grad_bias_stride = g.grad_bias_stride;
}

void add_inputs(Problem& p, const TensorView& bias, const TensorView& class_weight) {
  const head::BiasInput b = head::check_bias(bias, p.dtype, p.vocab, p.device);
  p.bias = b.data;
  p.bias_dtype = b.dtype;
  p.bias_stride = b.stride;
  if (class_weight.defined()) {
    check_defined(class_weight, "class_weight");
    check_dtype(class_weight, "class_weight", DType::kFloat32);
    check_device(class_weight, "class_weight", p.device);
    check_ndim(class_weight, "class_weight", 1);
    LOGITLESS_CHECK_ARG(class_weight.sizes[0] == p.vocab_total, "class_weight",
                        str_cat("shape [", p.vocab_total, "] (one weight per class)"),
                        str_cat("shape ", shape_str(class_weight)));
    check_nonnull(class_weight, "class_weight");
    p.class_weight = static_cast<const float*>(class_weight.data);
    p.class_weight_stride = class_weight.strides[0];
  }
}

// A float32 tensor of `n` elements, contiguous.
float* check_row_vector(const TensorView& t, const char* name, int64_t n, const Device& dev, const char* what) {
  check_defined(t, name);
  check_dtype(t, name, DType::kFloat32);
  check_device(t, name, dev);
  check_numel(t, name, n, what);
  check_contiguous(t, name);
  check_nonnull(t, name);
  return static_cast<float*>(t.data);
}

void add_forward_outputs(Problem& p, const TensorView& loss, const TensorView& lse) {
  const bool none = p.options.reduction == Reduction::kNone;
  p.loss = check_row_vector(loss, "loss", none ? p.n_tokens : 1, p.device,
                            none ? "one per token for reduction none" : "a scalar for reduction sum or mean");
  if (lse.defined()) p.lse = check_row_vector(lse, "lse", p.n_tokens, p.device, "one per token");
}

// The row statistics' outputs: both given exactly when options.row_stats asks for them.
void add_row_stats(Problem& p, const LinearCrossEntropyRowStats& rs) {
  if (!p.options.row_stats) {
    LOGITLESS_CHECK_ARG(!rs.entropy.defined() && !rs.is_top1.defined(), "row_stats",
                        "no entropy or is_top1 output unless options.row_stats is set", "an output");
    return;
  }
  p.entropy = check_row_vector(rs.entropy, "row_stats.entropy", p.n_tokens, p.device, "one per token");
  const TensorView& t = rs.is_top1;
  check_defined(t, "row_stats.is_top1");
  LOGITLESS_CHECK_ARG(t.dtype == DType::kBool || t.dtype == DType::kUInt8, "row_stats.is_top1", "dtype bool or uint8",
                      dtype_name(t.dtype));
  check_device(t, "row_stats.is_top1", p.device);
  check_numel(t, "row_stats.is_top1", p.n_tokens, "one per token");
  check_contiguous(t, "row_stats.is_top1");
  check_nonnull(t, "row_stats.is_top1");
  p.is_top1 = static_cast<uint8_t*>(t.data);
}

const float* upstream(const Problem& p, const TensorView& t, const char* name) {
  const bool none = p.options.reduction == Reduction::kNone;
  return check_row_vector(t, name, none ? p.n_tokens : 1, p.device,
                          none ? "one per token for reduction none" : "a scalar for reduction sum or mean");
}

// No output may share memory with an input or with another output: the GEMMs and row kernels read the inputs
// while writing the outputs. `outs` and `ins`: the call's other outputs (loss, lse, partials) and inputs (target,
// class weights, saved lse, upstream gradient, gathered partials).
void check_no_aliasing(const TensorView& hidden, const TensorView& weight, const TensorView& bias,
                       const TensorView& grad_hidden, const TensorView& grad_weight, const TensorView& grad_bias,
                       std::vector<NamedView> outs, std::vector<NamedView> ins) {
  for (const NamedView& o : {NamedView{grad_hidden, "grad_hidden"}, NamedView{grad_weight, "grad_weight"},
                             NamedView{grad_bias, "grad_bias"}})
    outs.push_back(o);
  for (const NamedView& i : {NamedView{hidden, "hidden"}, NamedView{weight, "weight"}, NamedView{bias, "bias"}})
    ins.push_back(i);
  check_outputs_apart(outs, ins);
}

size_t workspace_bytes(const Problem& p) {
  if (p.device.type != DeviceType::kCUDA) return 0;
#if defined(LOGITLESS_WITH_CUDA)
  check_cuda_target("hidden", p.device, nullptr);  // the plan reads the device's properties
  return lce::cuda_workspace_bytes(p);
#else
  return 0;
#endif
}

void dispatch(const Problem& p, Workspace ws, StreamHandle stream) {
  if (p.device.type == DeviceType::kCPU) {
    lce::run_cpu(p);
    return;
  }
#if defined(LOGITLESS_WITH_CUDA)
  check_cuda_target("hidden", p.device, stream);
  lce::run_cuda(p, ws, stream);  // checks the workspace against the plan it makes
#else
  (void)ws;
  (void)stream;
  throw_runtime("linear_cross_entropy: logitless was built without its CUDA backend; CUDA tensors are not supported");
#endif
}

}  // namespace

bool linear_cross_entropy_recompute_is_faster(int64_t n_tokens, int64_t hidden, int64_t vocab, DType dtype,
                                              Device device, bool need_grad_hidden, bool need_grad_weight,
                                              bool need_grad_bias, const LinearCrossEntropyOptions& options) {
  check_options(options);
  LOGITLESS_CHECK_ARG(n_tokens >= 0, "n_tokens", ">= 0", n_tokens);
  LOGITLESS_CHECK_ARG(hidden >= 1, "hidden", ">= 1", hidden);
  LOGITLESS_CHECK_ARG(vocab >= 1, "vocab", ">= 1", vocab);
  LOGITLESS_CHECK_ARG(dtype == DType::kFloat32 || dtype == DType::kFloat16 || dtype == DType::kBFloat16, "dtype",
                      "float32, float16 or bfloat16", dtype_name(dtype));
  LOGITLESS_CHECK_ARG(device.type == DeviceType::kCPU || device.type == DeviceType::kCUDA, "device", "CPU or CUDA",
                      static_cast<int>(device.type));
  if (device.type != DeviceType::kCUDA || dtype == DType::kFloat32) return false;
#if defined(LOGITLESS_WITH_CUDA)
  check_cuda_target("device", device, nullptr);
  Problem p;
  p.mode = Mode::kForwardBackward;
  p.n_tokens = n_tokens;
  p.hidden = hidden;
  p.vocab = p.vocab_total = vocab;
  p.dtype = dtype;
  p.device = device;
  p.options = options;
  p.hidden_uniform = true;
  p.hidden_ld = hidden;
  p.weight = Matrix{nullptr, dtype, hidden};
  return lce::cuda_recompute_is_faster(p, need_grad_hidden, need_grad_weight, need_grad_bias);
#else
  (void)need_grad_hidden;
  (void)need_grad_weight;
  (void)need_grad_bias;
  throw_runtime("linear_cross_entropy: logitless was built without its CUDA backend; CUDA tensors are not supported");
#endif
}

size_t linear_cross_entropy_forward_workspace_bytes(const TensorView& hidden, const TensorView& weight,
                                                    const TensorView& target,
                                                    const LinearCrossEntropyOptions& options) {
  return workspace_bytes(base_problem(Mode::kForward, hidden, weight, target, options));
}

size_t linear_cross_entropy_forward_backward_workspace_bytes(const TensorView& hidden, const TensorView& weight,
                                                             const TensorView& target, const TensorView& grad_hidden,
                                                             const TensorView& grad_weight, const TensorView& grad_bias,
                                                             const LinearCrossEntropyOptions& options) {
  Problem p = base_problem(Mode::kForwardBackward, hidden, weight, target, options);
  add_grads(p, hidden, weight, nullptr, grad_hidden, grad_weight, grad_bias);
  return workspace_bytes(p);
}

size_t linear_cross_entropy_backward_workspace_bytes(const TensorView& hidden, const TensorView& weight,
                                                     const TensorView& target, const TensorView& grad_hidden,
                                                     const TensorView& grad_weight, const TensorView& grad_bias,
                                                     const LinearCrossEntropyOptions& options) {
  Problem p = base_problem(Mode::kBackward, hidden, weight, target, options);
  add_grads(p, hidden, weight, nullptr, grad_hidden, grad_weight, grad_bias);
  return workspace_bytes(p);
}

void linear_cross_entropy_forward(const TensorView& hidden, const TensorView& weight, const TensorView& bias,
                                  const TensorView& target, const TensorView& class_weight,
                                  const LinearCrossEntropyOptions& options, const TensorView& loss,
                                  const TensorView& lse, Workspace workspace, StreamHandle stream,
                                  const LinearCrossEntropyRowStats& row_stats) {
  Problem p = base_problem(Mode::kForward, hidden, weight, target, options);
  add_inputs(p, bias, class_weight);
  add_forward_outputs(p, loss, lse);
  add_row_stats(p, row_stats);
  check_no_aliasing(hidden, weight, bias, {}, {}, {},
                    {{loss, "loss"}, {lse, "lse"}, {row_stats.entropy, "entropy"}, {row_stats.is_top1, "is_top1"}},
                    {{target, "target"}, {class_weight, "class_weight"}});
  dispatch(p, workspace, stream);
}

void linear_cross_entropy_forward_backward(const TensorView& hidden, const TensorView& weight, const TensorView& bias,
                                           const TensorView& target, const TensorView& class_weight,
                                           const LinearCrossEntropyOptions& options, const TensorView& loss,
                                           const TensorView& lse, const TensorView& grad_hidden,
                                           const TensorView& grad_weight, const TensorView& grad_bias,
                                           const TensorView& grad_scale, Workspace workspace, StreamHandle stream,
                                           const LinearCrossEntropyRowStats& row_stats) {
  Problem p = base_problem(Mode::kForwardBackward, hidden, weight, target, options);
  add_inputs(p, bias, class_weight);
  add_grads(p, hidden, weight, &bias, grad_hidden, grad_weight, grad_bias);
  add_forward_outputs(p, loss, lse);
  add_row_stats(p, row_stats);
  if (grad_scale.defined()) {
    p.grad_scale = upstream(p, grad_scale, "grad_scale");
    p.grad_scale_per_row = options.reduction == Reduction::kNone;
  }
  check_no_aliasing(hidden, weight, bias, grad_hidden, grad_weight, grad_bias,
                    {{loss, "loss"}, {lse, "lse"}, {row_stats.entropy, "entropy"}, {row_stats.is_top1, "is_top1"}},
                    {{target, "target"}, {class_weight, "class_weight"}, {grad_scale, "grad_scale"}});
  dispatch(p, workspace, stream);
}

void linear_cross_entropy_backward(const TensorView& hidden, const TensorView& weight, const TensorView& bias,
                                   const TensorView& target, const TensorView& class_weight, const TensorView& lse,
                                   const TensorView& grad_loss, const LinearCrossEntropyOptions& options,
                                   const TensorView& grad_hidden, const TensorView& grad_weight,
                                   const TensorView& grad_bias, Workspace workspace, StreamHandle stream) {
  Problem p = base_problem(Mode::kBackward, hidden, weight, target, options);
  add_inputs(p, bias, class_weight);
  add_grads(p, hidden, weight, &bias, grad_hidden, grad_weight, grad_bias);
  p.lse = check_row_vector(lse, "lse", p.n_tokens, p.device, "one per token, from the forward");
  p.grad_scale = upstream(p, grad_loss, "grad_loss");
  p.grad_scale_per_row = options.reduction == Reduction::kNone;
  check_no_aliasing(hidden, weight, bias, grad_hidden, grad_weight, grad_bias, {},
                    {{target, "target"}, {class_weight, "class_weight"}, {lse, "lse"}, {grad_loss, "grad_loss"}});
  dispatch(p, workspace, stream);
}

// ---- vocabulary-parallel (include/logitless/vocab_parallel.h) -------------------------------------------------

namespace {

// float32 [shards * rows * 4] contiguous, last dimension 4; 16-byte aligned on CUDA (rows are read as float4).
float* check_partials(const TensorView& t, int64_t rows, int64_t shards, const Device& dev, const char* what) {
  check_defined(t, "partials");
  check_dtype(t, "partials", DType::kFloat32);
  check_device(t, "partials", dev);
  const int64_t want = checked_product(checked_product(shards, rows, "partials"), kShardStats, "partials");
  LOGITLESS_CHECK_ARG(t.ndim >= 1 && t.size(-1) == kShardStats && t.numel() == want, "partials",
                      str_cat(what, " with ", want, " elements"), str_cat("shape ", shape_str(t)));
  check_contiguous(t, "partials");
  check_nonnull(t, "partials");
  LOGITLESS_CHECK_ARG(dev.type != DeviceType::kCUDA || reinterpret_cast<uintptr_t>(t.data) % 16 == 0, "partials",
                      "a 16-byte aligned pointer", "a misaligned view");
  return static_cast<float*>(t.data);
}

}  // namespace

size_t linear_cross_entropy_shard_partials_workspace_bytes(const TensorView& hidden, const TensorView& weight,
                                                           const TensorView& target, const VocabShard& shard,
                                                           const LinearCrossEntropyOptions& options) {
  return workspace_bytes(base_problem(Mode::kPartials, hidden, weight, target, options, &shard));
}

void linear_cross_entropy_shard_partials(const TensorView& hidden, const TensorView& weight, const TensorView& bias,
                                         const TensorView& target, const TensorView& class_weight,
                                         const VocabShard& shard, const LinearCrossEntropyOptions& options,
                                         const TensorView& partials, Workspace workspace, StreamHandle stream) {
  Problem p = base_problem(Mode::kPartials, hidden, weight, target, options, &shard);
  add_inputs(p, bias, class_weight);
  p.partials = check_partials(partials, p.n_tokens, 1, p.device, "[*, 4] (4 per token)");
  check_no_aliasing(hidden, weight, bias, {}, {}, {}, {{partials, "partials"}},
                    {{target, "target"}, {class_weight, "class_weight"}});
  dispatch(p, workspace, stream);
}

size_t linear_cross_entropy_shard_backward_workspace_bytes(const TensorView& hidden, const TensorView& weight,
                                                           const TensorView& target, const TensorView& grad_hidden,
                                                           const TensorView& grad_weight, const TensorView& grad_bias,
                                                           const VocabShard& shard,
                                                           const LinearCrossEntropyOptions& options) {
  Problem p = base_problem(Mode::kBackward, hidden, weight, target, options, &shard);
  add_grads(p, hidden, weight, nullptr, grad_hidden, grad_weight, grad_bias);
  return workspace_bytes(p);
}

void linear_cross_entropy_shard_backward(const TensorView& hidden, const TensorView& weight, const TensorView& bias,
                                         const TensorView& target, const TensorView& class_weight,
                                         const VocabShard& shard, const TensorView& lse, const TensorView& grad_loss,
                                         const LinearCrossEntropyOptions& options, const TensorView& grad_hidden,
                                         const TensorView& grad_weight, const TensorView& grad_bias,
                                         Workspace workspace, StreamHandle stream) {
  Problem p = base_problem(Mode::kBackward, hidden, weight, target, options, &shard);
  add_inputs(p, bias, class_weight);
  add_grads(p, hidden, weight, &bias, grad_hidden, grad_weight, grad_bias);
  p.lse = check_row_vector(lse, "lse", p.n_tokens, p.device, "one per token, from the finalize");
  p.grad_scale = upstream(p, grad_loss, "grad_loss");
  p.grad_scale_per_row = options.reduction == Reduction::kNone;
  check_no_aliasing(hidden, weight, bias, grad_hidden, grad_weight, grad_bias, {},
                    {{target, "target"}, {class_weight, "class_weight"}, {lse, "lse"}, {grad_loss, "grad_loss"}});
  dispatch(p, workspace, stream);
}

int64_t linear_cross_entropy_shard_chunk_tokens(int64_t n_tokens, int64_t widest_shard,
                                                const LinearCrossEntropyOptions& options) {
  check_options(options);
  LOGITLESS_CHECK_ARG(n_tokens >= 0, "n_tokens", "a count >= 0", n_tokens);
  LOGITLESS_CHECK_ARG(widest_shard >= 0, "widest_shard", "a count >= 0", widest_shard);
  return lce::shard_chunk_tokens(n_tokens, widest_shard, options.chunk_tokens, options.memory_budget);
}

namespace {

// The common part of a step sequence's calls: the problem with its gradients, its chunk count.
Problem step_problem(Mode mode, const TensorView& hidden, const TensorView& weight, const TensorView& target,
                     const TensorView& grad_hidden, const TensorView& grad_weight, const TensorView& grad_bias,
                     const TensorView* bias, const VocabShard& shard, const LinearCrossEntropyOptions& options,
                     int64_t* num_chunks) {
  LOGITLESS_CHECK_ARG(options.chunk_tokens > 0, "options.chunk_tokens",
                      "the token chunk every rank uses (linear_cross_entropy_shard_chunk_tokens), > 0",
                      options.chunk_tokens);
  LOGITLESS_CHECK_ARG(options.reduction != Reduction::kNone, "reduction",
                      "sum or mean (the gradient in the forward needs the upstream gradient of a scalar)", "none");
  Problem p = base_problem(mode, hidden, weight, target, options, &shard);
  add_grads(p, hidden, weight, bias, grad_hidden, grad_weight, grad_bias);
  *num_chunks = p.n_tokens / options.chunk_tokens + (p.n_tokens % options.chunk_tokens != 0 ? 1 : 0);
  return p;
}

size_t step_workspace_bytes(const Problem& p) {
  if (p.device.type == DeviceType::kCPU) return lce::cpu_step_workspace_bytes(p);
  return workspace_bytes(p);
}

}  // namespace

LinearCrossEntropyShardSteps linear_cross_entropy_shard_steps(const TensorView& hidden, const TensorView& weight,
                                                              const TensorView& target, const TensorView& grad_hidden,
                                                              const TensorView& grad_weight,
                                                              const TensorView& grad_bias, const VocabShard& shard,
                                                              const LinearCrossEntropyOptions& options) {
  LinearCrossEntropyShardSteps out;
  const Problem p = step_problem(Mode::kStepLogits, hidden, weight, target, grad_hidden, grad_weight, grad_bias,
                                 nullptr, shard, options, &out.num_chunks);
  out.chunk_tokens = options.chunk_tokens;
  out.workspace_bytes = step_workspace_bytes(p);
  return out;
}

void linear_cross_entropy_shard_forward_backward_step(ShardStep step, int64_t chunk, const TensorView& partials,
                                                      const TensorView& hidden, const TensorView& weight,
                                                      const TensorView& bias, const TensorView& target,
                                                      const TensorView& class_weight, const VocabShard& shard,
                                                      const LinearCrossEntropyOptions& options, const TensorView& loss,
                                                      const TensorView& lse, const TensorView& grad_hidden,
                                                      const TensorView& grad_weight, const TensorView& grad_bias,
                                                      Workspace workspace, StreamHandle stream) {
  LOGITLESS_CHECK_ARG(step == ShardStep::kLogits || step == ShardStep::kGradient, "step", "logits or gradient",
                      static_cast<int>(step));
  int64_t chunks = 0;
  Problem p = step_problem(step == ShardStep::kLogits ? Mode::kStepLogits : Mode::kStepGradient, hidden, weight, target,
                           grad_hidden, grad_weight, grad_bias, &bias, shard, options, &chunks);
  LOGITLESS_CHECK_ARG(chunk >= 0 && chunk < chunks, "chunk", str_cat("a chunk in [0, ", chunks, ")"), chunk);
  add_inputs(p, bias, class_weight);
  add_forward_outputs(p, loss, lse);
  p.step_chunk = chunk;
  const int64_t rows = std::min(options.chunk_tokens, p.n_tokens - chunk * options.chunk_tokens);
  if (step == ShardStep::kLogits) {
    p.partials = check_partials(partials, rows, 1, p.device, "[rows, 4] (this shard's partials of the chunk)");
  } else {
    check_defined(partials, "partials");
    const int64_t shards = partials.numel() / checked_product(rows, kShardStats, "partials");
    LOGITLESS_CHECK_ARG(shards >= 1, "partials", "every shard's partials of the chunk, [R, rows, 4] with R >= 1",
                        str_cat("shape ", shape_str(partials)));
    p.partials_in = check_partials(partials, rows, shards, p.device, "[R, rows, 4] (every shard's, rank order)");
    p.n_shards = shards;
  }
  const bool partials_out = step == ShardStep::kLogits;
  std::vector<NamedView> outs = {{loss, "loss"}, {lse, "lse"}};
  std::vector<NamedView> ins = {{target, "target"}, {class_weight, "class_weight"}};
  (partials_out ? outs : ins).push_back(NamedView{partials, "partials"});
  check_no_aliasing(hidden, weight, bias, grad_hidden, grad_weight, grad_bias, outs, ins);
  check_workspace(workspace, step_workspace_bytes(p), " (the sequence's)");
  if (p.device.type == DeviceType::kCPU) {
    lce::run_cpu_step(p, workspace);
    return;
  }
  dispatch(p, workspace, stream);
}

}  // namespace logitless
