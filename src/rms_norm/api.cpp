// RMSNorm: argument validation and dispatch. Every check happens here, before any backend runs, so a bad
// call never touches memory.
#include <cmath>
#include <utility>
#include <vector>

#include "common/check.h"
#include "logitless/rms_norm.h"
#include "rms_norm/problem.h"

namespace logitless {
namespace {

using rms::BackwardProblem;
using rms::ForwardProblem;

void check_options(const RMSNormOptions& o) {
  LOGITLESS_CHECK_ARG(std::isfinite(o.eps) && o.eps > 0.0, "eps", "a finite value > 0", o.eps);
  LOGITLESS_CHECK_ARG(std::isfinite(o.offset), "offset", "a finite value", o.offset);
  LOGITLESS_CHECK_ARG(
      o.casting == RMSNormCasting::kLlama || o.casting == RMSNormCasting::kGemma || o.casting == RMSNormCasting::kNone,
      "casting", "llama, gemma or none", static_cast<int>(o.casting));
  LOGITLESS_CHECK_ARG(
      o.algo == RMSNormAlgo::kAuto || o.algo == RMSNormAlgo::kRegisters || o.algo == RMSNormAlgo::kGeneric, "algo",
      "auto, registers or generic", static_cast<int>(o.algo));
  LOGITLESS_CHECK_ARG(o.vectors_per_thread == 0 || o.vectors_per_thread == 4 || o.vectors_per_thread == 8,
                      "vectors_per_thread", "0 (auto), 4 or 8", o.vectors_per_thread);
}

// The [*, H] tensor every other one is checked against (x in the forward, grad_y in the backward).
int64_t check_primary(const TensorView& t, const char* name) {
  check_defined(t, name);
  check_float_dtype(t, name);
  LOGITLESS_CHECK_ARG(t.ndim >= 1, name, "at least 1 dimension ([*, H])", "a 0-d tensor");
  LOGITLESS_CHECK_ARG(t.device.type == DeviceType::kCPU || t.device.type == DeviceType::kCUDA, name,
                      "a CPU or CUDA tensor", static_cast<int>(t.device.type));
  const int64_t H = t.size(-1);
  LOGITLESS_CHECK_ARG(H >= 1, name, "a last dimension (hidden size) of size >= 1", str_cat("shape ", shape_str(t)));
  LOGITLESS_CHECK_ARG(t.stride(-1) == 1 || H == 1, name, "a last dimension with stride 1",
                      str_cat("stride ", t.stride(-1)));
  check_nonnull(t, name);
  return H;
}

// Another [*, H] tensor of the call: same dtype, device and shape as `like`, last dimension contiguous.
void check_like(const TensorView& t, const char* name, const TensorView& like, const char* like_name) {
  check_defined(t, name);
  LOGITLESS_CHECK_ARG(t.dtype == like.dtype, name, str_cat("dtype ", dtype_name(like.dtype), " (", like_name, "'s)"),
                      dtype_name(t.dtype));
  check_device(t, name, like.device);
  check_shape(t, name, like, like.ndim, str_cat(like_name, "'s shape").c_str());
  LOGITLESS_CHECK_ARG(t.stride(-1) == 1 || t.size(-1) == 1, name, "a last dimension with stride 1",
                      str_cat("stride ", t.stride(-1)));
  check_nonnull(t, name);
}

void check_weight(const TensorView& w, const TensorView& like, int64_t H) {
  check_defined(w, "weight");
  LOGITLESS_CHECK_ARG(w.dtype == like.dtype || w.dtype == DType::kFloat32, "weight",
                      str_cat("dtype ", dtype_name(like.dtype), " (x's) or float32"), dtype_name(w.dtype));
  check_device(w, "weight", like.device);
  LOGITLESS_CHECK_ARG(w.ndim == 1 && w.sizes[0] == H, "weight", str_cat("shape [", H, "] (the last dimension of x)"),
                      str_cat("shape ", shape_str(w)));
  LOGITLESS_CHECK_ARG(w.strides[0] == 1 || H == 1, "weight", "a contiguous tensor", str_cat("stride ", w.strides[0]));
  check_nonnull(w, "weight");
}

const float* check_rstd(const TensorView& t, int64_t n_rows, const Device& dev, const char* what) {
  check_dtype(t, "rstd", DType::kFloat32);
  check_device(t, "rstd", dev);
  check_numel(t, "rstd", n_rows, what);
  check_contiguous(t, "rstd");
  check_nonnull(t, "rstd");
  return static_cast<const float*>(t.data);
}

// Bytes [lo, hi) a tensor's elements occupy (strides >= 0, as torch makes them).
std::pair<const char*, const char*> span_of(const TensorView& t) {
  int64_t hi = 0;
  for (int d = 0; d < t.ndim; ++d) hi += (t.sizes[d] - 1) * t.strides[d];
  const char* b = static_cast<const char*>(t.data);
  return {b, b + (hi + 1) * dtype_size(t.dtype)};
}

bool overlap(const TensorView& a, const TensorView& b) {
  if (!a.defined() || !b.defined() || a.numel() == 0 || b.numel() == 0) return false;
  const auto sa = span_of(a), sb = span_of(b);
  return sa.first < sb.second && sb.first < sa.second;
}

bool same_view(const TensorView& a, const TensorView& b) {
  if (a.data != b.data || a.ndim != b.ndim || a.dtype != b.dtype) return false;
  for (int d = 0; d < a.ndim; ++d)
    if (a.sizes[d] != b.sizes[d] || (a.sizes[d] != 1 && a.strides[d] != b.strides[d])) return false;
  return true;
}

// An output may be an input itself (the kernels read each element before the same thread writes it) but
// must not overlap it otherwise.
void check_output_vs_input(const TensorView& out, const char* out_name, const TensorView& in, const char* in_name,
                           bool may_alias) {
  if (!overlap(out, in)) return;
  if (may_alias && same_view(out, in)) return;
  throw_expected(out_name,
                 may_alias ? str_cat(in_name, " itself (in place) or memory that does not overlap ", in_name)
                           : str_cat("memory that does not overlap ", in_name),
                 "an overlapping buffer");
}

void check_rows_disjoint(const RowLayout& rows, int64_t H, const char* name) {
  LOGITLESS_CHECK_ARG(rows_disjoint(rows, H), name, "rows that do not overlap",
                      "overlapping rows (a broadcast or a row stride < H)");
}

// `primary`: the tensor whose device the call runs on (every other one is checked against it).
template <typename Fwd, typename Bwd>
void dispatch(const Device& dev, const char* what, const char* primary, StreamHandle stream, Fwd&& cpu, Bwd&& cuda) {
  if (dev.type == DeviceType::kCPU) {
    cpu();
    return;
  }
#if defined(LOGITLESS_WITH_CUDA)
  (void)what;
  check_cuda_target(primary, dev, stream);
  cuda();
#else
  (void)primary;
  (void)stream;
  (void)cuda;
  throw_runtime(str_cat(what, ": logitless was built without its CUDA backend; CUDA tensors are not supported"));
#endif
}

}  // namespace

size_t rms_norm_forward_workspace_bytes(const TensorView& x, const TensorView& weight, const RMSNormOptions& options) {
  (void)x;
  (void)weight;
  (void)options;
  return 0;
}

size_t rms_norm_backward_workspace_bytes(const TensorView& x, const TensorView& weight, const RMSNormOptions& options) {
  check_options(options);
  const int64_t H = check_primary(x, "x");
  check_weight(weight, x, H);
  if (x.device.type != DeviceType::kCUDA) return 0;
#if defined(LOGITLESS_WITH_CUDA)
  check_cuda_target("x", x.device, nullptr);  // the size depends on the device's properties
  return rms::backward_workspace_bytes_cuda(x.numel() / H, H, x.dtype, options, x.device.index);
#else
  return 0;
#endif
}

void rms_norm_forward(const TensorView& x, const TensorView& residual, const TensorView& weight,
                      const RMSNormOptions& options, const TensorView& y, const TensorView& residual_out,
                      const TensorView& rstd, Workspace workspace, StreamHandle stream) {
  (void)workspace;  // the forward needs none
  check_options(options);
  const int64_t H = check_primary(x, "x");
  check_weight(weight, x, H);
  const bool has_res = residual.defined();
  if (has_res) check_like(residual, "residual", x, "x");
  check_like(y, "y", x, "x");
  if (has_res) {
    LOGITLESS_CHECK_ARG(residual_out.defined(), "residual_out", "a tensor for x + residual (residual was given)",
                        "None");
    check_like(residual_out, "residual_out", x, "x");
  } else {
    LOGITLESS_CHECK_ARG(!residual_out.defined(), "residual_out", "None (no residual was given)", "a tensor");
  }

  ForwardProblem p;
  p.hidden = H;
  p.n_rows = x.numel() / H;
  p.dtype = x.dtype;
  p.weight_dtype = weight.dtype;
  p.device = x.device;
  if (rstd.defined()) p.rstd = const_cast<float*>(check_rstd(rstd, p.n_rows, x.device, "one per row of x"));

  std::vector<const int64_t*> strides = {x.strides, y.strides};
  if (has_res) {
    strides.push_back(residual.strides);
    strides.push_back(residual_out.strides);
  }
  const auto L = collapse_rows(x.sizes, x.ndim - 1, strides, "x");
  p.x = x.data;
  p.x_rows = L[0];
  p.y = y.data;
  p.y_rows = L[1];
  check_rows_disjoint(p.y_rows, H, "y");
  if (has_res) {
    p.residual = residual.data;
    p.residual_rows = L[2];
    p.residual_out = residual_out.data;
    p.residual_out_rows = L[3];
    check_rows_disjoint(p.residual_out_rows, H, "residual_out");
  }
  // In place: y may be x, and residual_out may be x or residual (every element is read before the thread
  // that reads it writes there). Nothing else may overlap an output.
  check_output_vs_input(y, "y", x, "x", true);
  if (has_res) {
    check_output_vs_input(y, "y", residual, "residual", false);
    check_output_vs_input(y, "y", residual_out, "residual_out", false);
    check_output_vs_input(residual_out, "residual_out", x, "x", true);
    check_output_vs_input(residual_out, "residual_out", residual, "residual", true);
  }
  check_output_vs_input(y, "y", weight, "weight", false);
  if (has_res) check_output_vs_input(residual_out, "residual_out", weight, "weight", false);
  if (rstd.defined()) {
    for (const auto& [t, n] : {std::pair<const TensorView*, const char*>{&x, "x"},
                               {&y, "y"},
                               {&weight, "weight"},
                               {&residual, "residual"},
                               {&residual_out, "residual_out"}})
      check_output_vs_input(rstd, "rstd", *t, n, false);
  }
  p.weight = weight.data;
  p.eps = static_cast<float>(options.eps);
  p.offset = static_cast<float>(options.offset);
  p.casting = options.casting;
  p.algo = options.algo;
  p.vectors_per_thread = options.vectors_per_thread;
  if (p.n_rows == 0) return;
  dispatch(
      x.device, "rms_norm", "x", stream, [&] { rms::forward_cpu(p); },
      [&] {
#if defined(LOGITLESS_WITH_CUDA)
        rms::forward_cuda(p, stream);
#else
        (void)stream;
#endif
      });
}

void rms_norm_backward(const TensorView& grad_y, const TensorView& grad_residual_out, const TensorView& x,
                       const TensorView& weight, const TensorView& rstd, const RMSNormOptions& options,
                       const TensorView& grad_x, const TensorView& grad_weight, Workspace workspace,
                       StreamHandle stream) {
  check_options(options);
  const int64_t H = check_primary(grad_y, "grad_y");
  check_like(x, "x", grad_y, "grad_y");
  check_weight(weight, x, H);
  const bool has_dres = grad_residual_out.defined();
  if (has_dres) check_like(grad_residual_out, "grad_residual_out", grad_y, "grad_y");
  check_like(grad_x, "grad_x", grad_y, "grad_y");

  BackwardProblem p;
  p.hidden = H;
  p.n_rows = grad_y.numel() / H;
  p.dtype = grad_y.dtype;
  p.weight_dtype = weight.dtype;
  p.device = grad_y.device;
  check_defined(rstd, "rstd");
  p.rstd = check_rstd(rstd, p.n_rows, p.device, "one per row, from the forward");
  if (grad_weight.defined()) {
    LOGITLESS_CHECK_ARG(grad_weight.dtype == weight.dtype || grad_weight.dtype == DType::kFloat32, "grad_weight",
                        str_cat("dtype ", dtype_name(weight.dtype), " (weight's) or float32"),
                        dtype_name(grad_weight.dtype));
    check_device(grad_weight, "grad_weight", p.device);
    LOGITLESS_CHECK_ARG(grad_weight.ndim == 1 && grad_weight.sizes[0] == H, "grad_weight",
                        str_cat("shape [", H, "] (weight's)"), str_cat("shape ", shape_str(grad_weight)));
    check_contiguous(grad_weight, "grad_weight");
    check_nonnull(grad_weight, "grad_weight");
    p.grad_weight = grad_weight.data;
    p.grad_weight_dtype = grad_weight.dtype;
  }

  std::vector<const int64_t*> strides = {grad_y.strides, x.strides, grad_x.strides};
  if (has_dres) strides.push_back(grad_residual_out.strides);
  const auto L = collapse_rows(grad_y.sizes, grad_y.ndim - 1, strides, "grad_y");
  p.grad_y = grad_y.data;
  p.grad_y_rows = L[0];
  p.x = x.data;
  p.x_rows = L[1];
  p.grad_x = grad_x.data;
  p.grad_x_rows = L[2];
  check_rows_disjoint(p.grad_x_rows, H, "grad_x");
  if (has_dres) {
    p.grad_residual_out = grad_residual_out.data;
    p.grad_residual_out_rows = L[3];
  }
  // grad_x may be grad_y or grad_residual_out itself (each element is read before the same thread writes
  // it); it must not overlap anything the kernels read later or by another thread.
  check_output_vs_input(grad_x, "grad_x", grad_y, "grad_y", true);
  if (has_dres) check_output_vs_input(grad_x, "grad_x", grad_residual_out, "grad_residual_out", true);
  check_output_vs_input(grad_x, "grad_x", x, "x", false);
  check_output_vs_input(grad_x, "grad_x", weight, "weight", false);
  check_output_vs_input(grad_x, "grad_x", rstd, "rstd", false);
  if (grad_weight.defined()) {
    for (const auto& [t, n] : {std::pair<const TensorView*, const char*>{&grad_y, "grad_y"},
                               {&x, "x"},
                               {&weight, "weight"},
                               {&grad_x, "grad_x"},
                               {&grad_residual_out, "grad_residual_out"},
                               {&rstd, "rstd"}})
      check_output_vs_input(grad_weight, "grad_weight", *t, n, false);
  }
  p.weight = weight.data;
  p.offset = static_cast<float>(options.offset);
  p.casting = options.casting;
  p.algo = options.algo;
  p.vectors_per_thread = options.vectors_per_thread;

  // The CUDA launcher checks the workspace against what its launch writes (no second workspace query per call).
  dispatch(
      p.device, "rms_norm", "grad_y", stream, [&] { rms::backward_cpu(p); },
      [&] {
#if defined(LOGITLESS_WITH_CUDA)
        rms::backward_cuda(p, workspace, stream);
#else
        (void)workspace;
        (void)stream;
#endif
      });
}

}  // namespace logitless
