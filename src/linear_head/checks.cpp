// The linear head's argument checks (linear_head/problem.h), shared by every family that computes a loss from
// hidden states.
#include <limits>

#include "common/check.h"
#include "linear_head/problem.h"

namespace logitless::head {

void check_gemm_extent(int64_t value, const char* name, const char* what) {
  LOGITLESS_CHECK_ARG(value <= std::numeric_limits<int32_t>::max(), name,
                      str_cat(what, " below 2^31 (cuBLAS's 32-bit sizes)"), value);
}

BiasInput check_bias(const TensorView& bias, DType dtype, int64_t V, const Device& device) {
  BiasInput b;
  if (!bias.defined()) return b;
  check_defined(bias, "bias");
  LOGITLESS_CHECK_ARG(bias.dtype == dtype || bias.dtype == DType::kFloat32, "bias",
                      str_cat("dtype ", dtype_name(dtype), " (hidden's) or float32"), dtype_name(bias.dtype));
  check_device(bias, "bias", device);
  check_ndim(bias, "bias", 1);
  LOGITLESS_CHECK_ARG(bias.sizes[0] == V, "bias", str_cat("shape [", V, "] (one per class, V from weight)"),
                      str_cat("shape ", shape_str(bias)));
  check_nonnull(bias, "bias");
  b.data = bias.data;
  b.dtype = bias.dtype;
  b.stride = bias.strides[0];
  return b;
}

namespace {
// A gradient output's dtype (its input's, `of` naming that input, or float32) and device.
void check_grad_dtype_device(const TensorView& grad, const char* name, DType input_dtype, const char* of,
                             const Device& device) {
  check_defined(grad, name);
  LOGITLESS_CHECK_ARG(grad.dtype == input_dtype || grad.dtype == DType::kFloat32, name,
                      str_cat("dtype ", dtype_name(input_dtype), " (", of, ") or float32"), dtype_name(grad.dtype));
  check_device(grad, name, device);
}
}  // namespace

GradOutputs check_grad_outputs(const TensorView& hidden, const TensorView& weight, const TensorView* bias, int64_t H,
                               int64_t V, const Device& device, const TensorView& grad_hidden,
                               const TensorView& grad_weight, const TensorView& grad_bias) {
  GradOutputs g;
  if (grad_hidden.defined()) {
    check_grad_dtype_device(grad_hidden, "grad_hidden", hidden.dtype, "hidden's", device);
    check_shape(grad_hidden, "grad_hidden", hidden, hidden.ndim, "the shape of hidden");
    LOGITLESS_CHECK_ARG(grad_hidden.stride(-1) == 1 || H == 1, "grad_hidden", "a last dimension with stride 1",
                        str_cat("stride ", grad_hidden.stride(-1)));
    check_nonnull(grad_hidden, "grad_hidden");
    const int64_t ld = uniform_row_stride(grad_hidden, grad_hidden.ndim - 1, "grad_hidden", H);
    LOGITLESS_CHECK_ARG(ld >= H, "grad_hidden",
                        str_cat("rows with one common stride >= ", H, " (e.g. a contiguous tensor)"),
                        "rows a GEMM cannot write in place");
    if (device.type == DeviceType::kCUDA) check_gemm_extent(ld, "grad_hidden", "a row stride");
    g.grad_hidden = Matrix{grad_hidden.data, grad_hidden.dtype, ld};
  }
  if (grad_weight.defined()) {
    check_grad_dtype_device(grad_weight, "grad_weight", weight.dtype, "weight's", device);
    check_shape(grad_weight, "grad_weight", weight, 2, "the shape of weight");
    LOGITLESS_CHECK_ARG(grad_weight.strides[1] == 1 || H == 1, "grad_weight", "a last dimension with stride 1",
                        str_cat("stride ", grad_weight.strides[1]));
    LOGITLESS_CHECK_ARG(grad_weight.strides[0] >= H || V <= 1, "grad_weight",
                        str_cat("a row stride >= ", H, " (rows that do not overlap)"),
                        str_cat("stride ", grad_weight.strides[0]));
    check_nonnull(grad_weight, "grad_weight");
    const int64_t ld = V <= 1 ? H : grad_weight.strides[0];
    if (device.type == DeviceType::kCUDA) check_gemm_extent(ld, "grad_weight", "a row stride");
    g.grad_weight = Matrix{grad_weight.data, grad_weight.dtype, ld};
  }
  if (grad_bias.defined()) {
    check_defined(grad_bias, "grad_bias");
    if (bias) {
      LOGITLESS_CHECK_ARG(bias->defined(), "grad_bias", "None (there is no bias)", "a tensor");
      check_grad_dtype_device(grad_bias, "grad_bias", bias->dtype, "bias's", device);
    } else {
      check_float_dtype(grad_bias, "grad_bias");
      check_device(grad_bias, "grad_bias", device);
    }
    check_ndim(grad_bias, "grad_bias", 1);
    LOGITLESS_CHECK_ARG(grad_bias.sizes[0] == V, "grad_bias", str_cat("shape [", V, "] (one per class)"),
                        str_cat("shape ", shape_str(grad_bias)));
    check_nonnull(grad_bias, "grad_bias");
    g.grad_bias = grad_bias.data;
    g.grad_bias_dtype = grad_bias.dtype;
    g.grad_bias_stride = grad_bias.strides[0];
  }
  return g;
}

HiddenWeight check_hidden_weight(const TensorView& hidden, const TensorView& weight, bool empty_vocab_ok) {
  check_defined(hidden, "hidden");
  check_float_dtype(hidden, "hidden");
  LOGITLESS_CHECK_ARG(hidden.ndim >= 1, "hidden", "at least 1 dimension ([*, H])", "a 0-d tensor");
  LOGITLESS_CHECK_ARG(hidden.device.type == DeviceType::kCPU || hidden.device.type == DeviceType::kCUDA, "hidden",
                      "a CPU or CUDA tensor", static_cast<int>(hidden.device.type));
  const int64_t H = hidden.size(-1);
  LOGITLESS_CHECK_ARG(H >= 1, "hidden", "a last dimension (hidden size) of size >= 1",
                      str_cat("shape ", shape_str(hidden)));
  LOGITLESS_CHECK_ARG(hidden.stride(-1) == 1 || H == 1, "hidden", "a last dimension with stride 1",
                      str_cat("stride ", hidden.stride(-1)));
  check_nonnull(hidden, "hidden");
  const Device dev = hidden.device;

  check_defined(weight, "weight");
  LOGITLESS_CHECK_ARG(weight.dtype == hidden.dtype, "weight",
                      str_cat("dtype ", dtype_name(hidden.dtype), " (hidden's)"), dtype_name(weight.dtype));
  check_device(weight, "weight", dev);
  LOGITLESS_CHECK_ARG(weight.ndim == 2 && weight.sizes[1] == H, "weight",
                      str_cat("shape [V, ", H, "] ([V, H], H from hidden)"), str_cat("shape ", shape_str(weight)));
  const int64_t V = weight.sizes[0];
  if (!empty_vocab_ok)
    LOGITLESS_CHECK_ARG(V >= 1, "weight", "a vocabulary (first dimension) of size >= 1",
                        str_cat("shape ", shape_str(weight)));
  LOGITLESS_CHECK_ARG(weight.strides[1] == 1 || H == 1, "weight", "a last dimension with stride 1",
                      str_cat("stride ", weight.strides[1]));
  LOGITLESS_CHECK_ARG(weight.strides[0] >= H || V <= 1, "weight",
                      str_cat("a row stride >= ", H, " (rows that do not overlap)"),
                      str_cat("stride ", weight.strides[0]));
  check_nonnull(weight, "weight");

  HiddenWeight hw;
  hw.hidden = H;
  hw.vocab = V;
  hw.dtype = hidden.dtype;
  hw.device = dev;
  hw.hidden_data = hidden.data;
  hw.hidden_rows = collapse_rows(hidden.sizes, hidden.ndim - 1, {hidden.strides}, "hidden")[0];
  const int64_t ld = uniform_row_stride(hidden, hidden.ndim - 1, "hidden", H);
  hw.hidden_uniform = ld >= H;  // stride 0 (a broadcast) or overlapping rows: a GEMM cannot read them in place
  hw.hidden_ld = hw.hidden_uniform ? ld : H;
  hw.weight = Matrix{weight.data, weight.dtype, V <= 1 ? H : weight.strides[0]};
  return hw;
}

}  // namespace logitless::head
