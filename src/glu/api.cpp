// GLU: argument validation and dispatch. Every check happens here, before any backend runs, so a bad call
// never touches memory.
#include <utility>
#include <vector>

#include "common/check.h"
#include "common/layout.h"
#include "common/overlap.h"
#include "glu/problem.h"
#include "logitless/glu.h"

namespace logitless {
namespace {

using glu::Problem;

void check_options(const GLUOptions& o) {
  LOGITLESS_CHECK_ARG(o.activation == GLUActivation::kSiLU || o.activation == GLUActivation::kGeluTanh ||
                          o.activation == GLUActivation::kGelu,
                      "activation", "silu, gelu_tanh or gelu", static_cast<int>(o.activation));
  LOGITLESS_CHECK_ARG(o.algo == GLUAlgo::kAuto || o.algo == GLUAlgo::kVector || o.algo == GLUAlgo::kScalar, "algo",
                      "auto, vector or scalar", static_cast<int>(o.algo));
}

// The [*, I] tensor every other one is checked against. float64 is a CPU-only dtype (the oracle of gradcheck).
void check_primary(const TensorView& t, const char* name) {
  check_defined(t, name);
  LOGITLESS_CHECK_ARG(t.device.type == DeviceType::kCPU || t.device.type == DeviceType::kCUDA, name,
                      "a CPU or CUDA tensor", static_cast<int>(t.device.type));
  const bool f64_ok = t.dtype == DType::kFloat64 && t.device.type == DeviceType::kCPU;
  if (!f64_ok) {
    LOGITLESS_CHECK_ARG(t.dtype == DType::kFloat32 || t.dtype == DType::kFloat16 || t.dtype == DType::kBFloat16, name,
                        t.device.type == DeviceType::kCPU ? "dtype float32, float16, bfloat16 or float64"
                                                          : "dtype float32, float16 or bfloat16 (float64 on the CPU)",
                        dtype_name(t.dtype));
  }
  LOGITLESS_CHECK_ARG(t.ndim >= 1, name, "at least 1 dimension ([*, I])", "a 0-d tensor");
  LOGITLESS_CHECK_ARG(t.stride(-1) == 1 || t.size(-1) <= 1, name, "a last dimension with stride 1",
                      str_cat("stride ", t.stride(-1)));
  check_nonnull(t, name);
}

// Another [*, I] tensor of the call: same dtype, device and shape as `like`, last dimension contiguous.
void check_like(const TensorView& t, const char* name, const TensorView& like, const char* like_name) {
  check_defined(t, name);
  LOGITLESS_CHECK_ARG(t.dtype == like.dtype, name, str_cat("dtype ", dtype_name(like.dtype), " (", like_name, "'s)"),
                      dtype_name(t.dtype));
  check_device(t, name, like.device);
  check_shape(t, name, like, like.ndim, str_cat(like_name, "'s shape").c_str());
  LOGITLESS_CHECK_ARG(t.stride(-1) == 1 || t.size(-1) <= 1, name, "a last dimension with stride 1",
                      str_cat("stride ", t.stride(-1)));
  check_nonnull(t, name);
}

// The jointly collapsed rows of the tensors (strides over the leading dimensions of `shape`), folded into one
// row of N * I elements where every tensor's rows follow each other densely.
void layout_rows(const TensorView& shape, const std::vector<const int64_t*>& strides, Problem& p,
                 std::vector<RowLayout*> outs) {
  const int64_t I = shape.size(-1);
  p.width = I;
  p.n_rows = I == 0 ? 0 : shape.numel() / I;
  const auto L = collapse_rows(shape.sizes, shape.ndim - 1, strides, "gate");
  bool dense = true;
  for (const RowLayout& l : L) dense = dense && l.nd == 1 && (l.sizes[0] <= 1 || l.strides[0] == I);
  for (size_t t = 0; t < L.size(); ++t) *outs[t] = L[t];
  if (dense && p.n_rows > 1) {
    p.width = p.n_rows * I;
    p.n_rows = 1;
    for (RowLayout* l : outs) *l = RowLayout{};
  }
}

template <typename Cpu>
void dispatch(const Problem& p, Cpu&& cpu, StreamHandle stream) {
  if (p.n_rows == 0 || p.width == 0) return;
  if (p.device.type == DeviceType::kCPU) {
    (void)stream;
    cpu();
    return;
  }
#if defined(LOGITLESS_WITH_CUDA)
  check_cuda_target("gate", p.device, stream);
  glu::run_cuda(p, stream);
#else
  throw_runtime("glu: logitless was built without its CUDA backend; CUDA tensors are not supported");
#endif
}

}  // namespace

void glu_forward(const TensorView& gate, const TensorView& up, const GLUOptions& options, const TensorView& y,
                 StreamHandle stream) {
  check_options(options);
  check_primary(gate, "gate");
  check_like(up, "up", gate, "gate");
  check_like(y, "y", gate, "gate");
  check_output_vs(y, "y", gate, "gate", true);
  check_output_vs(y, "y", up, "up", true);

  Problem p;
  p.backward = false;
  p.dtype = gate.dtype;
  p.device = gate.device;
  p.activation = options.activation;
  p.algo = options.algo;
  p.gate = gate.data;
  p.up = up.data;
  p.y = y.data;
  layout_rows(gate, {gate.strides, up.strides, y.strides}, p, {&p.gate_rows, &p.up_rows, &p.y_rows});
  LOGITLESS_CHECK_ARG(p.n_rows <= 1 || rows_disjoint(p.y_rows, p.width), "y", "rows that do not overlap",
                      "overlapping rows (a broadcast or a row stride < I)");
  dispatch(
      p, [&] { glu::run_cpu(p); }, stream);
}

void glu_backward(const TensorView& grad_y, const TensorView& gate, const TensorView& up, const GLUOptions& options,
                  const TensorView& grad_gate, const TensorView& grad_up, StreamHandle stream) {
  check_options(options);
  check_primary(gate, "gate");
  check_like(up, "up", gate, "gate");
  check_like(grad_y, "grad_y", gate, "gate");
  check_like(grad_gate, "grad_gate", gate, "gate");
  check_like(grad_up, "grad_up", gate, "gate");
  // In place: grad_gate over gate, grad_up over up. Never over the incoming gradient, and never over the
  // other input or the other output (another thread reads or writes those elements).
  check_output_vs(grad_gate, "grad_gate", gate, "gate", true);
  check_output_vs(grad_gate, "grad_gate", up, "up", false);
  check_output_vs(grad_gate, "grad_gate", grad_y, "grad_y", false);
  check_output_vs(grad_up, "grad_up", up, "up", true);
  check_output_vs(grad_up, "grad_up", gate, "gate", false);
  check_output_vs(grad_up, "grad_up", grad_y, "grad_y", false);
  check_output_vs(grad_up, "grad_up", grad_gate, "grad_gate", false);

  Problem p;
  p.backward = true;
  p.dtype = gate.dtype;
  p.device = gate.device;
  p.activation = options.activation;
  p.algo = options.algo;
  p.gate = gate.data;
  p.up = up.data;
  p.grad_y = grad_y.data;
  p.grad_gate = grad_gate.data;
  p.grad_up = grad_up.data;
  layout_rows(gate, {gate.strides, up.strides, grad_y.strides, grad_gate.strides, grad_up.strides}, p,
              {&p.gate_rows, &p.up_rows, &p.grad_y_rows, &p.grad_gate_rows, &p.grad_up_rows});
  LOGITLESS_CHECK_ARG(p.n_rows <= 1 || rows_disjoint(p.grad_gate_rows, p.width), "grad_gate",
                      "rows that do not overlap", "overlapping rows (a broadcast or a row stride < I)");
  LOGITLESS_CHECK_ARG(p.n_rows <= 1 || rows_disjoint(p.grad_up_rows, p.width), "grad_up", "rows that do not overlap",
                      "overlapping rows (a broadcast or a row stride < I)");
  dispatch(
      p, [&] { glu::run_cpu(p); }, stream);
}

}  // namespace logitless
