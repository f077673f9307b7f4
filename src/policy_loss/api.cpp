// Policy losses and selective log-softmax: argument validation and dispatch. Every check happens here, before
// any backend runs, so a bad call never touches memory.
#include <cmath>
#include <utility>
#include <vector>

#include "common/check.h"
#include "logitless/policy_loss.h"
#include "policy_loss/problem.h"

namespace logitless {
namespace {

using pl::Mode;
using pl::Op;
using pl::Problem;

void check_common_tiles(PolicyLossAlgo algo, int cluster_size, int threads) {
  LOGITLESS_CHECK_ARG(algo == PolicyLossAlgo::kAuto || algo == PolicyLossAlgo::kStreaming ||
                          algo == PolicyLossAlgo::kCluster || algo == PolicyLossAlgo::kRowResident,
                      "algo", "auto, streaming, cluster or row_resident", static_cast<int>(algo));
  LOGITLESS_CHECK_ARG(cluster_size >= 0 && cluster_size <= 16, "cluster_size", "0 (auto) or 1..16", cluster_size);
  LOGITLESS_CHECK_ARG(threads == 0 || threads == 128 || threads == 256 || threads == 512, "threads",
                      "0 (auto), 128, 256 or 512", threads);
}

void check_temperature(double t) {
  LOGITLESS_CHECK_ARG(t > 0.0 && std::isfinite(t), "temperature", "a finite value > 0", t);
}

void check_options(const PolicyLossOptions& o) {
  LOGITLESS_CHECK_ARG(o.loss_type == PolicyLossType::kGrpo || o.loss_type == PolicyLossType::kBnpo ||
                          o.loss_type == PolicyLossType::kDrGrpo || o.loss_type == PolicyLossType::kDapo,
                      "loss_type", "grpo, bnpo, dr_grpo or dapo", static_cast<int>(o.loss_type));
  LOGITLESS_CHECK_ARG(o.importance_sampling_level == ImportanceSamplingLevel::kToken ||
                          o.importance_sampling_level == ImportanceSamplingLevel::kSequence,
                      "importance_sampling_level", "token or sequence", static_cast<int>(o.importance_sampling_level));
  LOGITLESS_CHECK_ARG(o.beta >= 0.0 && std::isfinite(o.beta), "beta", "a finite value >= 0", o.beta);
  LOGITLESS_CHECK_ARG(o.eps_low >= 0.0 && std::isfinite(o.eps_low), "eps_low", "a finite value >= 0", o.eps_low);
  LOGITLESS_CHECK_ARG(o.eps_high >= 0.0 && std::isfinite(o.eps_high), "eps_high", "a finite value >= 0", o.eps_high);
  check_temperature(o.temperature);
  if (o.loss_type == PolicyLossType::kDrGrpo) {
    LOGITLESS_CHECK_ARG(o.max_completion_length > 0, "max_completion_length",
                        "a length > 0 for loss_type dr_grpo (its normalizer is B * max_completion_length)",
                        o.max_completion_length);
  } else {
    LOGITLESS_CHECK_ARG(o.max_completion_length >= 0, "max_completion_length", "a length >= 0",
                        o.max_completion_length);
  }
  LOGITLESS_CHECK_ARG(o.num_items_in_batch >= 0.0 && std::isfinite(o.num_items_in_batch), "num_items_in_batch",
                      "a finite value >= 0 (0: this batch's token count)", o.num_items_in_batch);
  check_common_tiles(o.algo, o.cluster_size, o.threads);
}

void check_logits_common(const TensorView& logits) {
  check_defined(logits, "logits");
  check_float_dtype(logits, "logits");
  LOGITLESS_CHECK_ARG(logits.device.type == DeviceType::kCPU || logits.device.type == DeviceType::kCUDA, "logits",
                      "a CPU or CUDA tensor", static_cast<int>(logits.device.type));
  LOGITLESS_CHECK_ARG(logits.ndim >= 1, "logits", "at least 1 dimension ([*, V])", "a 0-d tensor");
  LOGITLESS_CHECK_ARG(logits.size(-1) >= 1, "logits", "a last dimension (vocabulary) of size >= 1",
                      str_cat("shape ", shape_str(logits)));
  LOGITLESS_CHECK_ARG(logits.stride(-1) == 1 || logits.size(-1) == 1, "logits", "a last dimension with stride 1",
                      str_cat("stride ", logits.stride(-1)));
  check_nonnull(logits, "logits");
}

// A [B, L] per-token input.
void check_token_shape(const TensorView& t, const char* name, int64_t B, int64_t L) {
  bool ok = t.ndim == 2 && t.sizes[0] == B && t.sizes[1] == L;
  if (!ok)
    throw_expected(name, str_cat("shape [", B, ", ", L, "] (the shape of completion_ids)"),
                   str_cat("shape ", shape_str(t)));
}

RowLayout token_layout(const TensorView& t, int64_t B, int64_t L, const char* name) {
  const int64_t sizes[2] = {B, L};
  return collapse_rows(sizes, 2, {t.strides}, name)[0];
}

// An output with one float32 (or, for `allow_bool`, bool / uint8) element per token, contiguous.
template <typename Ptr>
Ptr* check_token_output(const TensorView& t, const char* name, int64_t n_rows, const Device& dev, bool allow_bool) {
  if (!t.defined()) return nullptr;
  if (allow_bool) {
    LOGITLESS_CHECK_ARG(t.dtype == DType::kBool || t.dtype == DType::kUInt8, name, "dtype bool or uint8",
                        dtype_name(t.dtype));
  } else {
    check_dtype(t, name, DType::kFloat32);
  }
  check_device(t, name, dev);
  check_numel(t, name, n_rows, "one per token");
  check_contiguous(t, name);
  check_nonnull(t, name);
  return static_cast<Ptr*>(t.data);
}

const float* check_float_input(const TensorView& t, const char* name, int64_t n, const Device& dev, const char* what) {
  check_defined(t, name);
  check_dtype(t, name, DType::kFloat32);
  check_device(t, name, dev);
  check_numel(t, name, n, what);
  check_contiguous(t, name);
  check_nonnull(t, name);
  return static_cast<const float*>(t.data);
}

// grad_logits: the logits' shape and dtype, rows that do not overlap, and either the logits themselves (same
// strides) or memory apart from them. `lead` leading dimensions (the rows) are checked for row overlap.
void check_grad_logits(const TensorView& g, const TensorView& logits) {
  check_defined(g, "grad_logits");
  check_dtype(g, "grad_logits", logits.dtype);
  check_device(g, "grad_logits", logits.device);
  check_shape(g, "grad_logits", logits, logits.ndim, "the shape of logits");
  LOGITLESS_CHECK_ARG(g.stride(-1) == 1 || g.size(-1) == 1, "grad_logits", "a last dimension with stride 1",
                      str_cat("stride ", g.stride(-1)));
  check_nonnull(g, "grad_logits");
  const int64_t V = logits.size(-1);
  const auto all_rows = collapse_rows(g.sizes, g.ndim - 1, {g.strides}, "grad_logits")[0];
  LOGITLESS_CHECK_ARG(rows_disjoint(all_rows, V), "grad_logits", "rows that do not overlap",
                      "overlapping rows (a broadcast or too-small stride)");
  if (g.data == logits.data) {
    bool same = true;
    for (int d = 0; d + 1 < logits.ndim; ++d) same = same && (g.strides[d] == logits.strides[d] || g.sizes[d] == 1);
    LOGITLESS_CHECK_ARG(same, "grad_logits", "the strides of logits when it aliases logits (in-place)",
                        "different strides");
  } else if (logits.numel() > 0) {
    // A separate gradient buffer must not overlap the logits: the kernels read one while writing the other.
    const int64_t es = dtype_size(logits.dtype);
    auto span = [&](const TensorView& t) {
      int64_t hi = 0;
      for (int d = 0; d < t.ndim; ++d) hi += (t.sizes[d] - 1) * t.strides[d];
      const char* b = static_cast<const char*>(t.data);
      return std::pair<const char*, const char*>(b, b + (hi + 1) * es);
    };
    const auto a = span(logits), b = span(g);
    LOGITLESS_CHECK_ARG(a.second <= b.first || b.second <= a.first, "grad_logits",
                        "either logits itself (in place) or memory that does not overlap logits",
                        "a partially overlapping buffer");
  }
}

// completion_ids: [B, L] int32 / int64 on `dev`.
void check_completion_ids(const TensorView& ids, const Device& dev) {
  check_defined(ids, "completion_ids");
  check_index_dtype(ids, "completion_ids");
  check_device(ids, "completion_ids", dev);
  check_ndim(ids, "completion_ids", 2);
  check_nonnull(ids, "completion_ids");
}

// Everything of a policy call but the logits and their gradient: the options, the per-token and per-sequence
// inputs and the outputs, for a vocabulary of V on `dev`. The caller has checked the options and completion_ids.
Problem build_token_problem(Mode mode, const PolicyLossInputs& in, const PolicyLossOptions& o,
                            const PolicyLossOutputs& out, const Device& dev, int64_t V) {
  const int64_t B = in.completion_ids.sizes[0], L = in.completion_ids.sizes[1];
  Problem p;
  p.op = Op::kPolicy;
  p.mode = mode;
  p.n_seqs = B;
  p.seq_len = L;
  p.n_rows = B * L;
  p.vocab = V;
  p.device = dev;
  p.ids = in.completion_ids.data;
  p.ids_dtype = in.completion_ids.dtype;
  p.ids_rows = token_layout(in.completion_ids, B, L, "completion_ids");
  p.loss_type = o.loss_type;
  p.level = o.importance_sampling_level;
  p.beta = o.beta;
  p.eps_low = o.eps_low;
  p.eps_high = o.eps_high;
  p.temperature = o.temperature;
  p.max_completion_length = o.max_completion_length;
  p.num_items_in_batch = o.num_items_in_batch;
  p.check_ids = o.check_ids;
  p.algo = o.algo;
  p.cluster_size = o.cluster_size;
  p.threads = o.threads;

  check_defined(in.advantages, "advantages");
  check_dtype(in.advantages, "advantages", DType::kFloat32);
  check_device(in.advantages, "advantages", dev);
  LOGITLESS_CHECK_ARG(in.advantages.ndim == 1 && in.advantages.sizes[0] == B, "advantages",
                      str_cat("shape [", B, "] (one per sequence of completion_ids)"),
                      str_cat("shape ", shape_str(in.advantages)));
  check_nonnull(in.advantages, "advantages");
  p.advantages = static_cast<const float*>(in.advantages.data);
  p.adv_stride = in.advantages.strides[0];

  if (in.completion_mask.defined()) {
    const TensorView& m = in.completion_mask;
    LOGITLESS_CHECK_ARG(m.dtype == DType::kBool || m.dtype == DType::kUInt8 || m.dtype == DType::kInt32 ||
                            m.dtype == DType::kInt64 || m.dtype == DType::kFloat32,
                        "completion_mask", "dtype bool, uint8, int32, int64 or float32", dtype_name(m.dtype));
    check_device(m, "completion_mask", dev);
    check_token_shape(m, "completion_mask", B, L);
    check_nonnull(m, "completion_mask");
    p.mask = m.data;
    p.mask_dtype = m.dtype;
    p.mask_rows = token_layout(m, B, L, "completion_mask");
  }
  auto token_input = [&](const TensorView& t, const char* name, const float*& ptr, RowLayout& rows) {
    if (!t.defined()) return;
    check_dtype(t, name, DType::kFloat32);
    check_device(t, name, dev);
    check_token_shape(t, name, B, L);
    check_nonnull(t, name);
    ptr = static_cast<const float*>(t.data);
    rows = token_layout(t, B, L, name);
  };
  token_input(in.old_logp, "old_logp", p.old_logp, p.old_rows);
  token_input(in.ref_logp, "ref_logp", p.ref_logp, p.ref_rows);
  if (o.beta > 0.0 && !in.ref_logp.defined())
    throw_expected(
        "ref_logp",
        str_cat("a tensor when beta > 0 (the KL penalty needs the reference log-probs; beta = ", o.beta, ")"),
        "None (pass ref_logp, or beta=0)");

  check_defined(out.loss, "loss");
  check_dtype(out.loss, "loss", DType::kFloat32);
  check_device(out.loss, "loss", dev);
  check_numel(out.loss, "loss", 1, "a scalar");
  check_nonnull(out.loss, "loss");
  p.loss = static_cast<float*>(out.loss.data);
  const int64_t n = p.n_rows;
  p.per_token_loss = check_token_output<float>(out.per_token_loss, "per_token_loss", n, dev, false);
  p.kl = check_token_output<float>(out.kl, "kl", n, dev, false);
  p.is_clipped = check_token_output<uint8_t>(out.is_clipped, "is_clipped", n, dev, true);
  p.logp = check_token_output<float>(out.logp, "logp", n, dev, false);
  p.entropy = check_token_output<float>(out.entropy, "entropy", n, dev, false);
  p.lse = check_token_output<float>(out.lse, "lse", n, dev, false);
  return p;
}

Problem build_policy_problem(Mode mode, const PolicyLossInputs& in, const PolicyLossOptions& o,
                             const PolicyLossOutputs& out, const TensorView* grad_logits) {
  check_options(o);
  const TensorView& logits = in.logits;
  check_logits_common(logits);
  const Device dev = logits.device;

  check_completion_ids(in.completion_ids, dev);
  const int64_t B = in.completion_ids.sizes[0], L = in.completion_ids.sizes[1];
  LOGITLESS_CHECK_ARG(logits.ndim == 3 && logits.sizes[0] == B && (logits.sizes[1] == L + 1 || logits.sizes[1] == L),
                      "logits",
                      str_cat("shape [", B, ", ", L + 1,
                              ", V] (the model's output over the completion and the "
                              "position after it) or [",
                              B, ", ", L, ", V], from completion_ids of shape [", B, ", ", L, "]"),
                      str_cat("shape ", shape_str(logits)));
  const int64_t V = logits.sizes[2];
  Problem p = build_token_problem(mode, in, o, out, dev, V);
  p.dtype = logits.dtype;
  p.logits = logits.data;

  // Token rows of the logits (and of the gradient): the first L positions of each sequence.
  std::vector<const int64_t*> strides = {logits.strides};
  if (grad_logits) {
    check_grad_logits(*grad_logits, logits);
    strides.push_back(grad_logits->strides);
  }
  const int64_t sizes[2] = {B, L};
  const auto layouts = collapse_rows(sizes, 2, strides, "logits");
  p.logits_rows = layouts[0];
  if (grad_logits) {
    p.grad = grad_logits->data;
    p.grad_rows = layouts[1];
    if (logits.sizes[1] == L + 1 && B > 0) {
      p.grad_pad = static_cast<char*>(grad_logits->data) + L * grad_logits->strides[1] * dtype_size(p.dtype);
      p.grad_pad_stride = grad_logits->strides[0];
      p.n_pad = B;
    }
  }
  return p;
}

Problem make_selective_problem(Mode mode, const TensorView& logits, const TensorView& ids,
                               const SelectiveLogSoftmaxOptions& o, const TensorView* grad_logits) {
  check_temperature(o.temperature);
  check_logits_common(logits);
  const Device dev = logits.device;
  check_defined(ids, "ids");
  check_index_dtype(ids, "ids");
  check_device(ids, "ids", dev);
  check_shape(ids, "ids", logits, logits.ndim - 1, "the leading dimensions of logits");
  check_nonnull(ids, "ids");

  Problem p;
  p.op = Op::kSelective;
  p.mode = mode;
  p.n_rows = ids.numel();
  p.n_seqs = 1;
  p.seq_len = p.n_rows;
  p.vocab = logits.size(-1);
  p.dtype = logits.dtype;
  p.device = dev;
  p.logits = logits.data;
  p.ids = ids.data;
  p.ids_dtype = ids.dtype;
  p.temperature = o.temperature;
  p.check_ids = o.check_ids;
  p.beta = 0;
  std::vector<const int64_t*> strides = {logits.strides, ids.strides};
  if (grad_logits) {
    check_grad_logits(*grad_logits, logits);
    strides.push_back(grad_logits->strides);
  }
  const auto layouts = collapse_rows(logits.sizes, logits.ndim - 1, strides, "logits");
  p.logits_rows = layouts[0];
  p.ids_rows = layouts[1];
  if (grad_logits) {
    p.grad = grad_logits->data;
    p.grad_rows = layouts[2];
  }
  return p;
}

void dispatch(const Problem& p, Workspace ws, StreamHandle stream, const char* what) {
  if (p.device.type == DeviceType::kCPU) {
    pl::run_cpu(p);
    return;
  }
#if defined(LOGITLESS_WITH_CUDA)
  (void)what;
  check_cuda_target("logits", p.device, stream);
  pl::run_cuda(p, ws, stream);
#else
  (void)ws;
  (void)stream;
  throw_runtime(str_cat(what, ": logitless was built without its CUDA backend; CUDA tensors are not supported"));
#endif
}

}  // namespace

namespace pl {
void check_policy_apart(const PolicyLossInputs& in, const PolicyLossOutputs& out, const TensorView* grad_logits,
                        const TensorView& grad_scale) {
  const TensorView none;
  const TensorView& g = grad_logits ? *grad_logits : none;
  // The gradient may be the logits themselves (build_policy_problem checks that pair).
  check_outputs_apart({{out.loss, "loss"},
                       {out.per_token_loss, "per_token_loss"},
                       {out.kl, "kl"},
                       {out.is_clipped, "is_clipped"},
                       {out.logp, "logp"},
                       {out.entropy, "entropy"},
                       {out.lse, "lse"}},
                      {{in.logits, "logits"}});
  check_outputs_apart({{out.loss, "loss"},
                       {out.per_token_loss, "per_token_loss"},
                       {out.kl, "kl"},
                       {out.is_clipped, "is_clipped"},
                       {out.logp, "logp"},
                       {out.entropy, "entropy"},
                       {out.lse, "lse"},
                       {g, "grad_logits"}},
                      {{in.completion_ids, "completion_ids"},
                       {in.advantages, "advantages"},
                       {in.completion_mask, "completion_mask"},
                       {in.old_logp, "old_logp"},
                       {in.ref_logp, "ref_logp"},
                       {grad_scale, "grad_scale"}});
}

Problem make_policy_problem(Mode mode, const PolicyLossInputs& inputs, const PolicyLossOptions& options,
                            const PolicyLossOutputs& outputs, const TensorView* grad_logits) {
  return build_policy_problem(mode, inputs, options, outputs, grad_logits);
}

Problem make_token_problem(Mode mode, const PolicyLossInputs& inputs, const PolicyLossOptions& options,
                           const PolicyLossOutputs& outputs, const Device& device, int64_t vocab) {
  check_options(options);
  check_completion_ids(inputs.completion_ids, device);
  return build_token_problem(mode, inputs, options, outputs, device, vocab);
}
}  // namespace pl

size_t policy_loss_workspace_bytes(const PolicyLossInputs& inputs, const PolicyLossOptions& options) {
  check_defined(inputs.logits, "logits");
  if (inputs.logits.device.type != DeviceType::kCUDA) return 0;
#if defined(LOGITLESS_WITH_CUDA)
  const TensorView& ids = inputs.completion_ids;
  const int64_t B = ids.defined() && ids.ndim >= 1 ? ids.sizes[0] : 0;
  return pl::cuda_workspace_bytes(Op::kPolicy, B, ids.defined() ? ids.numel() : 0, options.importance_sampling_level);
#else
  (void)options;
  return 0;
#endif
}

void policy_loss_forward(const PolicyLossInputs& inputs, const PolicyLossOptions& options,
                         const PolicyLossOutputs& outputs, Workspace workspace, StreamHandle stream) {
  const Problem p = build_policy_problem(Mode::kForward, inputs, options, outputs, nullptr);
  pl::check_policy_apart(inputs, outputs, nullptr, TensorView{});
  check_workspace(workspace, policy_loss_workspace_bytes(inputs, options));
  dispatch(p, workspace, stream, "policy_loss");
}

void policy_loss_forward_backward(const PolicyLossInputs& inputs, const PolicyLossOptions& options,
                                  const PolicyLossOutputs& outputs, const TensorView& grad_logits,
                                  const TensorView& grad_scale, Workspace workspace, StreamHandle stream) {
  Problem p = build_policy_problem(Mode::kForwardBackward, inputs, options, outputs, &grad_logits);
  if (grad_scale.defined()) p.grad_scale = check_float_input(grad_scale, "grad_scale", 1, p.device, "a scalar");
  pl::check_policy_apart(inputs, outputs, &grad_logits, grad_scale);
  check_workspace(workspace, policy_loss_workspace_bytes(inputs, options));
  dispatch(p, workspace, stream, "policy_loss");
}

size_t selective_log_softmax_workspace_bytes(const TensorView& logits, const TensorView& ids,
                                             const SelectiveLogSoftmaxOptions& options) {
  check_defined(logits, "logits");
  (void)options;
  if (logits.device.type != DeviceType::kCUDA) return 0;
#if defined(LOGITLESS_WITH_CUDA)
  return pl::cuda_workspace_bytes(Op::kSelective, 1, ids.defined() ? ids.numel() : 0, ImportanceSamplingLevel::kToken);
#else
  (void)ids;
  return 0;
#endif
}

void selective_log_softmax_forward(const TensorView& logits, const TensorView& ids,
                                   const SelectiveLogSoftmaxOptions& options, const TensorView& logp,
                                   const TensorView& entropy, const TensorView& lse, Workspace workspace,
                                   StreamHandle stream) {
  Problem p = make_selective_problem(Mode::kForward, logits, ids, options, nullptr);
  check_defined(logp, "logp");
  p.logp = check_token_output<float>(logp, "logp", p.n_rows, p.device, false);
  p.entropy = check_token_output<float>(entropy, "entropy", p.n_rows, p.device, false);
  p.lse = check_token_output<float>(lse, "lse", p.n_rows, p.device, false);
  check_outputs_apart({{logp, "logp"}, {entropy, "entropy"}, {lse, "lse"}}, {{logits, "logits"}, {ids, "ids"}});
  check_workspace(workspace, selective_log_softmax_workspace_bytes(logits, ids, options));
  dispatch(p, workspace, stream, "selective_log_softmax");
}

void selective_log_softmax_backward(const TensorView& logits, const TensorView& ids, const TensorView& lse,
                                    const TensorView& grad_logp, const SelectiveLogSoftmaxOptions& options,
                                    const TensorView& grad_logits, Workspace workspace, StreamHandle stream) {
  Problem p = make_selective_problem(Mode::kBackward, logits, ids, options, &grad_logits);
  p.lse_in = check_float_input(lse, "lse", p.n_rows, p.device, "one per row, from the forward");
  p.grad_logp = check_float_input(grad_logp, "grad_logp", p.n_rows, p.device, "one per row");
  check_outputs_apart({{grad_logits, "grad_logits"}}, {{ids, "ids"}, {lse, "lse"}, {grad_logp, "grad_logp"}});
  check_workspace(workspace, selective_log_softmax_workspace_bytes(logits, ids, options));
  dispatch(p, workspace, stream, "selective_log_softmax");
}

}  // namespace logitless
