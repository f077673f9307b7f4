// Cross-entropy: argument validation and dispatch. Every check happens here, before any backend runs,
// so a bad call never touches memory.
#include <cmath>
#include <cstdint>

#include "common/check.h"
#include "cross_entropy/problem.h"
#include "logitless/cross_entropy.h"
#include "logitless/vocab_parallel.h"

namespace logitless {
namespace {

using ce::Mode;
using ce::Problem;

void check_options(const CrossEntropyOptions& o) {
  LOGITLESS_CHECK_ARG(
      o.reduction == Reduction::kNone || o.reduction == Reduction::kSum || o.reduction == Reduction::kMean, "reduction",
      "none, sum or mean", static_cast<int>(o.reduction));
  LOGITLESS_CHECK_ARG(o.label_smoothing >= 0.0 && o.label_smoothing <= 1.0, "label_smoothing", "a value in [0, 1]",
                      o.label_smoothing);
  LOGITLESS_CHECK_ARG(o.z_loss >= 0.0 && std::isfinite(o.z_loss), "z_loss", "a finite value >= 0", o.z_loss);
  LOGITLESS_CHECK_ARG(o.softcap >= 0.0 && std::isfinite(o.softcap), "softcap", "a finite value > 0 (or 0 for no cap)",
                      o.softcap);
  LOGITLESS_CHECK_ARG(o.algo == CrossEntropyAlgo::kAuto || o.algo == CrossEntropyAlgo::kRowResident ||
                          o.algo == CrossEntropyAlgo::kStreaming,
                      "algo", "auto, row_resident or streaming", static_cast<int>(o.algo));
}

// A float32 per-row (or scalar) tensor: `per_row` rows, contiguous.
const float* check_row_vector(const TensorView& t, const char* name, int64_t n_rows, const Device& dev,
                              const char* what) {
  check_dtype(t, name, DType::kFloat32);
  check_device(t, name, dev);
  check_numel(t, name, n_rows, what);
  check_contiguous(t, name);
  check_nonnull(t, name);
  return static_cast<const float*>(t.data);
}

void check_shard(const VocabShard& shard, int64_t columns) {
  LOGITLESS_CHECK_ARG(shard.offset >= 0, "shard.offset", "a class index >= 0", shard.offset);
  LOGITLESS_CHECK_ARG(shard.vocab >= 1 && shard.vocab - shard.offset >= columns, "shard.vocab",
                      str_cat("the whole vocabulary, >= 1 and >= offset + the shard's ", columns, " classes (",
                              shard.offset + columns, ")"),
                      shard.vocab);
}

// The class weights [V] (V the whole vocabulary), optional.
void add_weight(Problem& p, const TensorView& weight) {
  if (!weight.defined()) return;
  const int64_t V = p.total_vocab();
  check_dtype(weight, "weight", DType::kFloat32);
  check_device(weight, "weight", p.device);
  check_ndim(weight, "weight", 1);
  LOGITLESS_CHECK_ARG(weight.sizes[0] == V, "weight", str_cat("shape [", V, "] (one weight per class)"),
                      str_cat("shape ", shape_str(weight)));
  check_nonnull(weight, "weight");
  p.weight = static_cast<const float*>(weight.data);
  p.weight_stride = weight.strides[0];
}

void fill_options(Problem& p, const CrossEntropyOptions& o) {
  p.ignore_index = o.ignore_index;
  p.reduction = o.reduction;
  p.label_smoothing = static_cast<float>(o.label_smoothing);
  p.z_loss_scale = static_cast<float>(o.z_loss);
  p.softcap = static_cast<float>(o.softcap);
  p.check_targets = o.check_targets;
  p.algo = o.algo;
}

// Validates the inputs shared by all entry points and fills the common part of the problem. `shard`: the
// logits are a vocabulary shard's columns (which may be none), the weight is the whole vocabulary's.
Problem make_problem(Mode mode, const TensorView& logits, const TensorView& target, const TensorView& weight,
                     const CrossEntropyOptions& o, const TensorView* grad_logits, const VocabShard* shard = nullptr) {
  check_options(o);
  check_defined(logits, "logits");
  check_float_dtype(logits, "logits");
  LOGITLESS_CHECK_ARG(logits.ndim >= 1, "logits", "at least 1 dimension ([*, V])", "a 0-d tensor");
  LOGITLESS_CHECK_ARG(logits.device.type == DeviceType::kCPU || logits.device.type == DeviceType::kCUDA, "logits",
                      "a CPU or CUDA tensor", static_cast<int>(logits.device.type));
  const int64_t V = logits.size(-1);
  if (shard) {
    check_shard(*shard, V);
  } else {
    LOGITLESS_CHECK_ARG(V >= 1, "logits", "a last dimension (vocabulary) of size >= 1",
                        str_cat("shape ", shape_str(logits)));
  }
  LOGITLESS_CHECK_ARG(logits.stride(-1) == 1 || V <= 1, "logits", "a last dimension with stride 1",
                      str_cat("stride ", logits.stride(-1)));
  check_nonnull(logits, "logits");
  const Device dev = logits.device;

  check_defined(target, "target");
  check_index_dtype(target, "target");
  check_device(target, "target", dev);
  check_shape(target, "target", logits, logits.ndim - 1, "the leading dimensions of logits");
  check_nonnull(target, "target");

  Problem p;
  p.mode = mode;
  p.vocab = V;
  p.vocab_offset = shard ? shard->offset : 0;
  p.vocab_total = shard ? shard->vocab : V;
  p.n_rows = target.numel();
  p.dtype = logits.dtype;
  p.device = dev;
  p.logits = logits.data;
  p.target = target.data;
  p.target_dtype = target.dtype;
  fill_options(p, o);
  add_weight(p, weight);

  std::vector<const int64_t*> strides = {logits.strides, target.strides};
  if (grad_logits) {
    const TensorView& g = *grad_logits;
    check_defined(g, "grad_logits");
    check_dtype(g, "grad_logits", logits.dtype);
    check_device(g, "grad_logits", dev);
    check_shape(g, "grad_logits", logits, logits.ndim, "the shape of logits");
    LOGITLESS_CHECK_ARG(g.stride(-1) == 1 || V <= 1, "grad_logits", "a last dimension with stride 1",
                        str_cat("stride ", g.stride(-1)));
    check_nonnull(g, "grad_logits");
    if (g.data == logits.data && g.numel() > 0) {  // (two empty tensors may both have no storage)
      bool same = true;
      for (int d = 0; d + 1 < logits.ndim; ++d) same = same && (g.strides[d] == logits.strides[d] || g.sizes[d] == 1);
      LOGITLESS_CHECK_ARG(same, "grad_logits", "the strides of logits when it aliases logits (in-place)",
                          "different strides");
    }
    p.grad = g.data;
    strides.push_back(g.strides);
  }
  const auto layouts = collapse_rows(logits.sizes, logits.ndim - 1, strides, "logits");
  p.logits_rows = layouts[0];
  p.target_rows = layouts[1];
  if (grad_logits) {
    p.grad_rows = layouts[2];
    LOGITLESS_CHECK_ARG(rows_disjoint(p.grad_rows, V), "grad_logits", "rows that do not overlap",
                        "overlapping rows (a broadcast or too-small stride)");
    if (p.grad != p.logits && p.n_rows > 0 && V > 0) {
      // A separate gradient buffer must not overlap the logits: the kernels read one while writing the other.
      const int64_t es = dtype_size(p.dtype);
      auto span = [&](const void* base, const TensorView& t) {
        int64_t hi = 0;
        for (int d = 0; d < t.ndim; ++d) hi += (t.sizes[d] - 1) * t.strides[d];
        const char* b = static_cast<const char*>(base);
        return std::pair<const char*, const char*>(b, b + (hi + 1) * es);
      };
      const auto a = span(p.logits, logits), b = span(p.grad, *grad_logits);
      LOGITLESS_CHECK_ARG(a.second <= b.first || b.second <= a.first, "grad_logits",
                          "either logits itself (in place) or memory that does not overlap logits",
                          "a partially overlapping buffer");
    }
  }
  return p;
}

void check_outputs(Problem& p, const TensorView& loss, const TensorView& lse, const TensorView& z_loss) {
  check_defined(loss, "loss");
  check_dtype(loss, "loss", DType::kFloat32);
  check_device(loss, "loss", p.device);
  if (p.reduction == Reduction::kNone) {
    check_numel(loss, "loss", p.n_rows, "one per row for reduction none");
  } else {
    check_numel(loss, "loss", 1, "a scalar for reduction sum or mean");
  }
  check_contiguous(loss, "loss");
  check_nonnull(loss, "loss");
  p.loss = static_cast<float*>(loss.data);
  if (lse.defined()) p.lse = const_cast<float*>(check_row_vector(lse, "lse", p.n_rows, p.device, "one per row"));
  if (z_loss.defined())
    p.z_loss = const_cast<float*>(check_row_vector(z_loss, "z_loss", p.n_rows, p.device, "one per row"));
}

void check_workspace(const Problem& p, const TensorView& logits, const TensorView& target, const TensorView& weight,
                     const CrossEntropyOptions& o, Workspace ws) {
  check_workspace(ws, cross_entropy_workspace_bytes(logits, target, weight, o));
  (void)p;
}

void dispatch(const Problem& p, Workspace ws, StreamHandle stream) {
  if (p.device.type == DeviceType::kCPU) {
    ce::run_cpu(p);
    return;
  }
#if defined(LOGITLESS_WITH_CUDA)
  check_cuda_target(p.mode == Mode::kFinalize ? "target" : "logits", p.device, stream);
  ce::run_cuda(p, ws, stream);
#else
  (void)ws;
  (void)stream;
  throw_runtime("cross_entropy: logitless was built without its CUDA backend; CUDA tensors are not supported");
#endif
}

}  // namespace

size_t cross_entropy_workspace_bytes(const TensorView& logits, const TensorView& target, const TensorView& weight,
                                     const CrossEntropyOptions& options) {
  check_defined(logits, "logits");
  if (logits.device.type != DeviceType::kCUDA) return 0;
#if defined(LOGITLESS_WITH_CUDA)
  const int64_t n = target.defined() ? target.numel() : 0;
  return ce::cuda_workspace_bytes(n, logits.ndim >= 1 ? logits.size(-1) : 0, weight.defined(), options);
#else
  (void)target;
  (void)weight;
  (void)options;
  return 0;
#endif
}

void cross_entropy_forward(const TensorView& logits, const TensorView& target, const TensorView& weight,
                           const CrossEntropyOptions& options, const TensorView& loss, const TensorView& lse,
                           const TensorView& z_loss, Workspace workspace, StreamHandle stream) {
  Problem p = make_problem(Mode::kForward, logits, target, weight, options, nullptr);
  check_outputs(p, loss, lse, z_loss);
  check_outputs_apart({{loss, "loss"}, {lse, "lse"}, {z_loss, "z_loss"}},
                      {{logits, "logits"}, {target, "target"}, {weight, "weight"}});
  check_workspace(p, logits, target, weight, options, workspace);
  dispatch(p, workspace, stream);
}

void cross_entropy_forward_backward(const TensorView& logits, const TensorView& target, const TensorView& weight,
                                    const CrossEntropyOptions& options, const TensorView& loss, const TensorView& lse,
                                    const TensorView& z_loss, const TensorView& grad_logits,
                                    const TensorView& grad_scale, Workspace workspace, StreamHandle stream) {
  Problem p = make_problem(Mode::kForwardBackward, logits, target, weight, options, &grad_logits);
  check_outputs(p, loss, lse, z_loss);
  if (grad_scale.defined()) {
    const bool per_row = options.reduction == Reduction::kNone;
    p.grad_scale = check_row_vector(grad_scale, "grad_scale", per_row ? p.n_rows : 1, p.device,
                                    per_row ? "one per row for reduction none" : "a scalar for reduction sum or mean");
    p.grad_scale_per_row = per_row;
  }
  // The gradient may be the logits themselves (make_problem checks that pair).
  check_outputs_apart({{loss, "loss"}, {lse, "lse"}, {z_loss, "z_loss"}}, {{logits, "logits"}});
  check_outputs_apart({{loss, "loss"}, {lse, "lse"}, {z_loss, "z_loss"}, {grad_logits, "grad_logits"}},
                      {{target, "target"}, {weight, "weight"}, {grad_scale, "grad_scale"}});
  check_workspace(p, logits, target, weight, options, workspace);
  dispatch(p, workspace, stream);
}

void cross_entropy_backward(const TensorView& logits, const TensorView& target, const TensorView& weight,
                            const TensorView& lse, const TensorView& grad_loss, const CrossEntropyOptions& options,
                            const TensorView& grad_logits, Workspace workspace, StreamHandle stream) {
  Problem p = make_problem(Mode::kBackward, logits, target, weight, options, &grad_logits);
  check_defined(lse, "lse");
  p.lse_in = check_row_vector(lse, "lse", p.n_rows, p.device, "one per row, from the forward");
  check_defined(grad_loss, "grad_loss");
  const bool per_row = options.reduction == Reduction::kNone;
  p.grad_scale = check_row_vector(grad_loss, "grad_loss", per_row ? p.n_rows : 1, p.device,
                                  per_row ? "one per row for reduction none" : "a scalar for reduction sum or mean");
  p.grad_scale_per_row = per_row;
  check_outputs_apart({{grad_logits, "grad_logits"}},
                      {{target, "target"}, {weight, "weight"}, {lse, "lse"}, {grad_loss, "grad_loss"}});
  check_workspace(p, logits, target, weight, options, workspace);
  dispatch(p, workspace, stream);
}

// ---- vocabulary-parallel (include/logitless/vocab_parallel.h) -------------------------------------------------

size_t cross_entropy_shard_workspace_bytes(const TensorView& target, const CrossEntropyOptions& options) {
  check_defined(target, "target");
  if (target.device.type != DeviceType::kCUDA) return 0;
#if defined(LOGITLESS_WITH_CUDA)
  // Every shard call needs what a call over the same rows does: the scalars and the rows' partial losses.
  return ce::cuda_workspace_bytes(target.numel(), 0, false, options);
#else
  (void)options;
  return 0;
#endif
}

namespace {
void check_shard_workspace(const Problem& p, const TensorView& target, const CrossEntropyOptions& o, Workspace ws) {
  check_workspace(ws, cross_entropy_shard_workspace_bytes(target, o));
  (void)p;
}

// partials: float32 [*shape, 4] contiguous, with `lead` leading dimensions of `target`'s shape after `shards`.
const float* check_partials(const TensorView& t, const TensorView& target, int64_t shards, const Device& dev) {
  check_defined(t, "partials");
  check_dtype(t, "partials", DType::kFloat32);
  check_device(t, "partials", dev);
  const int64_t want = checked_product(checked_product(shards, target.numel(), "partials"), kShardStats, "partials");
  LOGITLESS_CHECK_ARG(
      t.ndim >= 1 && t.size(-1) == kShardStats && t.numel() == want, "partials",
      str_cat(shards > 1 ? "[R, *, 4]" : "[*, 4]", " with ", want, " elements (4 per row of target, per shard)"),
      str_cat("shape ", shape_str(t)));
  check_contiguous(t, "partials");
  check_nonnull(t, "partials");
  // The CUDA kernels move a row of partials as one float4.
  LOGITLESS_CHECK_ARG(dev.type != DeviceType::kCUDA || reinterpret_cast<uintptr_t>(t.data) % 16 == 0, "partials",
                      "a 16-byte aligned pointer", "a misaligned view");
  return static_cast<const float*>(t.data);
}
}  // namespace

void cross_entropy_shard_partials(const TensorView& logits, const TensorView& target, const TensorView& weight,
                                  const VocabShard& shard, const CrossEntropyOptions& options,
                                  const TensorView& partials, Workspace workspace, StreamHandle stream) {
  Problem p = make_problem(Mode::kPartials, logits, target, weight, options, nullptr, &shard);
  p.partials = const_cast<float*>(check_partials(partials, target, 1, p.device));
  check_outputs_apart({{partials, "partials"}}, {{logits, "logits"}, {target, "target"}, {weight, "weight"}});
  check_shard_workspace(p, target, options, workspace);
  dispatch(p, workspace, stream);
}

void cross_entropy_shard_finalize(const TensorView& partials, const TensorView& target, const TensorView& weight,
                                  int64_t vocab, const CrossEntropyOptions& options, const TensorView& loss,
                                  const TensorView& lse, const TensorView& z_loss, Workspace workspace,
                                  StreamHandle stream) {
  check_options(options);
  check_defined(target, "target");
  check_index_dtype(target, "target");
  LOGITLESS_CHECK_ARG(target.device.type == DeviceType::kCPU || target.device.type == DeviceType::kCUDA, "target",
                      "a CPU or CUDA tensor", static_cast<int>(target.device.type));
  check_nonnull(target, "target");
  LOGITLESS_CHECK_ARG(vocab >= 1, "vocab", "the whole vocabulary's size, >= 1", vocab);
  check_defined(partials, "partials");
  const int64_t n = target.numel();
  // R from the partials' size: [R, *, 4] (R = 1 may also come as [*, 4]); with no rows there is nothing to combine.
  const int64_t per_shard = checked_product(n, kShardStats, "partials");
  const int64_t shards = per_shard > 0 ? partials.numel() / per_shard : 1;
  LOGITLESS_CHECK_ARG(shards >= 1, "partials", "every shard's partials, [R, *, 4] with R >= 1",
                      str_cat("shape ", shape_str(partials)));
  Problem p;
  p.mode = Mode::kFinalize;
  p.device = target.device;
  p.n_rows = n;
  p.vocab = vocab;
  p.vocab_total = vocab;
  p.target = target.data;
  p.target_dtype = target.dtype;
  p.target_rows = collapse_rows(target.sizes, target.ndim, {target.strides}, "target")[0];
  fill_options(p, options);
  add_weight(p, weight);
  p.partials_in = check_partials(partials, target, shards, p.device);
  p.n_shards = shards;
  check_outputs(p, loss, lse, z_loss);
  check_outputs_apart({{loss, "loss"}, {lse, "lse"}, {z_loss, "z_loss"}},
                      {{partials, "partials"}, {target, "target"}, {weight, "weight"}});
  check_shard_workspace(p, target, options, workspace);
  dispatch(p, workspace, stream);
}

void cross_entropy_shard_backward(const TensorView& logits, const TensorView& target, const TensorView& weight,
                                  const VocabShard& shard, const TensorView& lse, const TensorView& grad_loss,
                                  const CrossEntropyOptions& options, const TensorView& grad_logits,
                                  Workspace workspace, StreamHandle stream) {
  Problem p = make_problem(Mode::kBackward, logits, target, weight, options, &grad_logits, &shard);
  check_defined(lse, "lse");
  p.lse_in = check_row_vector(lse, "lse", p.n_rows, p.device, "one per row, from the finalize");
  check_defined(grad_loss, "grad_loss");
  const bool per_row = options.reduction == Reduction::kNone;
  p.grad_scale = check_row_vector(grad_loss, "grad_loss", per_row ? p.n_rows : 1, p.device,
                                  per_row ? "one per row for reduction none" : "a scalar for reduction sum or mean");
  p.grad_scale_per_row = per_row;
  check_outputs_apart({{grad_logits, "grad_logits"}},
                      {{target, "target"}, {weight, "weight"}, {lse, "lse"}, {grad_loss, "grad_loss"}});
  check_shard_workspace(p, target, options, workspace);
  dispatch(p, workspace, stream);
}

void scale_rows(const TensorView& grad, const TensorView& scale, StreamHandle stream) {
  check_defined(grad, "grad");
  check_float_dtype(grad, "grad");
  LOGITLESS_CHECK_ARG(grad.ndim >= 1, "grad", "at least 1 dimension ([*, V])", "a 0-d tensor");
  LOGITLESS_CHECK_ARG(grad.stride(-1) == 1 || grad.size(-1) == 1, "grad", "a last dimension with stride 1",
                      str_cat("stride ", grad.stride(-1)));
  check_nonnull(grad, "grad");
  const int64_t V = grad.size(-1);
  const int64_t n = V > 0 ? grad.numel() / V : 0;
  check_defined(scale, "scale");
  const bool per_row = scale.numel() != 1 || n == 1;
  const float* s = check_row_vector(scale, "scale", per_row ? n : 1, grad.device, "a scalar or one per row of grad");
  const auto L = collapse_rows(grad.sizes, grad.ndim - 1, {grad.strides}, "grad")[0];
  LOGITLESS_CHECK_ARG(rows_disjoint(L, V), "grad", "rows that do not overlap", "overlapping rows");
  check_outputs_apart({{grad, "grad"}}, {{scale, "scale"}});
  if (n == 0 || V == 0) return;
  if (grad.device.type == DeviceType::kCPU) {
    ce::scale_rows_cpu(grad.data, grad.dtype, L, n, V, s, per_row);
    return;
  }
#if defined(LOGITLESS_WITH_CUDA)
  check_cuda_target("grad", grad.device, stream);
  ce::scale_rows_cuda(grad.data, grad.dtype, L, n, V, s, per_row, grad.device, stream);
#else
  (void)stream;
  throw_runtime("scale_rows: logitless was built without its CUDA backend; CUDA tensors are not supported");
#endif
}

}  // namespace logitless
