#include "common/check.h"

namespace logitless {

std::string shape_str(const TensorView& t) {
  if (!t.defined()) return "None";
  std::string s = "[";
  for (int d = 0; d < t.ndim; ++d) s += str_cat(d ? ", " : "", t.sizes[d]);
  return s + "]";
}

std::string device_str(const Device& d) {
  return d.type == DeviceType::kCPU ? std::string("cpu") : str_cat("cuda:", d.index);
}

void check_defined(const TensorView& t, const char* name) {
  LOGITLESS_CHECK_ARG(t.defined(), name, "a tensor", "None");
  LOGITLESS_CHECK_ARG(t.ndim <= kMaxDims, name, str_cat("at most ", kMaxDims, " dimensions"), t.ndim);
}

void check_dtype(const TensorView& t, const char* name, DType expected) {
  LOGITLESS_CHECK_ARG(t.dtype == expected, name, str_cat("dtype ", dtype_name(expected)),
                      dtype_name(t.dtype));
}

void check_float_dtype(const TensorView& t, const char* name) {
  LOGITLESS_CHECK_ARG(t.dtype == DType::kFloat32 || t.dtype == DType::kFloat16 || t.dtype == DType::kBFloat16,
                      name, "dtype float32, float16 or bfloat16", dtype_name(t.dtype));
}

void check_index_dtype(const TensorView& t, const char* name) {
  LOGITLESS_CHECK_ARG(t.dtype == DType::kInt32 || t.dtype == DType::kInt64, name, "dtype int32 or int64",
                      dtype_name(t.dtype));
}

void check_device(const TensorView& t, const char* name, const Device& expected) {
  LOGITLESS_CHECK_ARG(same_device(t.device, expected), name, str_cat("device ", device_str(expected)),
                      device_str(t.device));
}

void check_ndim(const TensorView& t, const char* name, int ndim) {
  LOGITLESS_CHECK_ARG(t.ndim == ndim, name, str_cat(ndim, " dimensions"), str_cat(t.ndim, " (shape ", shape_str(t), ")"));
}

void check_shape(const TensorView& t, const char* name, const TensorView& like, int ndim_like,
                 const char* like_what) {
  bool ok = t.ndim == ndim_like;
  for (int d = 0; ok && d < ndim_like; ++d) ok = t.sizes[d] == like.sizes[d];
  if (!ok) {
    TensorView want = like;
    want.ndim = ndim_like;
    throw_expected(name, str_cat("shape ", shape_str(want), " (", like_what, ")"), str_cat("shape ", shape_str(t)));
  }
}

void check_contiguous(const TensorView& t, const char* name) {
  LOGITLESS_CHECK_ARG(t.is_contiguous(), name, "a contiguous tensor", "a strided one");
}

void check_numel(const TensorView& t, const char* name, int64_t numel, const char* what) {
  LOGITLESS_CHECK_ARG(t.numel() == numel, name, str_cat(numel, " elements (", what, ")"),
                      str_cat(t.numel(), " (shape ", shape_str(t), ")"));
}

void check_nonnull(const TensorView& t, const char* name) {
  LOGITLESS_CHECK_ARG(t.data != nullptr || t.numel() == 0, name, "a non-null data pointer", "nullptr");
}

}  // namespace logitless
