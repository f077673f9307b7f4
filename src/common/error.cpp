#include "common/check.h"

#include <cstdint>

namespace logitless {

std::string shape_str(const TensorView& t) {
  if (!t.defined()) return "None";
  std::string s = "[";
  for (int d = 0; d < t.ndim && d < kMaxDims; ++d) s += str_cat(d ? ", " : "", t.sizes[d]);
  return s + "]";
}

std::string device_str(const Device& d) {
  return d.type == DeviceType::kCPU ? std::string("cpu") : str_cat("cuda:", d.index);
}

namespace {
bool known_dtype(DType dt) {
  switch (dt) {
    case DType::kFloat32:
    case DType::kFloat16:
    case DType::kBFloat16:
    case DType::kFloat64:
    case DType::kInt32:
    case DType::kInt64:
    case DType::kUInt8:
    case DType::kBool:
      return true;
  }
  return false;
}
}  // namespace

void check_view(const TensorView& t, const char* name) {
  if (!t.defined()) return;
  LOGITLESS_CHECK_ARG(t.ndim <= kMaxDims, name, str_cat("at most ", kMaxDims, " dimensions"), t.ndim);
  LOGITLESS_CHECK_ARG(known_dtype(t.dtype), name, "a known dtype code", static_cast<int>(t.dtype));
  LOGITLESS_CHECK_ARG(t.device.type == DeviceType::kCPU || t.device.type == DeviceType::kCUDA, name,
                      "a CPU or CUDA tensor", str_cat("device type ", static_cast<int>(t.device.type)));
  LOGITLESS_CHECK_ARG(t.device.type != DeviceType::kCUDA || t.device.index >= 0, name, "a CUDA ordinal >= 0",
                      device_str(t.device));
  bool empty = false;
  for (int d = 0; d < t.ndim; ++d) {
    LOGITLESS_CHECK_ARG(t.sizes[d] >= 0, name, "sizes >= 0", str_cat("size ", t.sizes[d], " in dimension ", d));
    // A dimension of size 0 or 1 never steps: its stride addresses nothing.
    LOGITLESS_CHECK_ARG(t.strides[d] >= 0 || t.sizes[d] <= 1, name, "strides >= 0",
                        str_cat("stride ", t.strides[d], " in dimension ", d));
    empty = empty || t.sizes[d] == 0;
  }
  if (empty) return;
  // Every product the library forms from a view (its element count, its last element's byte offset) in int64.
  int64_t n = 1, last = 0;
  for (int d = 0; d < t.ndim; ++d) {
    int64_t step = 0;
    const bool ok = !__builtin_mul_overflow(n, t.sizes[d], &n) &&
                    !__builtin_mul_overflow(t.sizes[d] - 1, t.sizes[d] > 1 ? t.strides[d] : 0, &step) &&
                    !__builtin_add_overflow(last, step, &last);
    LOGITLESS_CHECK_ARG(ok, name, "an element count and extent that fit in int64",
                        str_cat("shape ", shape_str(t), " (a product of sizes and strides overflows)"));
  }
  const int64_t es = dtype_size(t.dtype);
  int64_t bytes = 0;
  LOGITLESS_CHECK_ARG(!__builtin_add_overflow(last, 1, &bytes) && !__builtin_mul_overflow(bytes, es, &bytes), name,
                      "a byte extent that fits in int64",
                      str_cat("shape ", shape_str(t), " (its last element lies past 2^63 bytes)"));
  LOGITLESS_CHECK_ARG(reinterpret_cast<uintptr_t>(t.data) % static_cast<uintptr_t>(es) == 0, name,
                      str_cat("a data pointer aligned to its element size (", es, " bytes)"), "a misaligned pointer");
}

void check_defined(const TensorView& t, const char* name) {
  LOGITLESS_CHECK_ARG(t.defined(), name, "a tensor", "None");
  check_view(t, name);
}

void check_dtype(const TensorView& t, const char* name, DType expected) {
  check_view(t, name);
  LOGITLESS_CHECK_ARG(t.dtype == expected, name, str_cat("dtype ", dtype_name(expected)), dtype_name(t.dtype));
}

void check_float_dtype(const TensorView& t, const char* name) {
  check_view(t, name);
  LOGITLESS_CHECK_ARG(t.dtype == DType::kFloat32 || t.dtype == DType::kFloat16 || t.dtype == DType::kBFloat16, name,
                      "dtype float32, float16 or bfloat16", dtype_name(t.dtype));
}

void check_index_dtype(const TensorView& t, const char* name) {
  check_view(t, name);
  LOGITLESS_CHECK_ARG(t.dtype == DType::kInt32 || t.dtype == DType::kInt64, name, "dtype int32 or int64",
                      dtype_name(t.dtype));
}

void check_device(const TensorView& t, const char* name, const Device& expected) {
  check_view(t, name);
  LOGITLESS_CHECK_ARG(same_device(t.device, expected), name, str_cat("device ", device_str(expected)),
                      device_str(t.device));
}

void check_ndim(const TensorView& t, const char* name, int ndim) {
  check_view(t, name);
  LOGITLESS_CHECK_ARG(t.ndim == ndim, name, str_cat(ndim, " dimensions"),
                      str_cat(t.ndim, " (shape ", shape_str(t), ")"));
}

void check_shape(const TensorView& t, const char* name, const TensorView& like, int ndim_like, const char* like_what) {
  check_view(t, name);
  bool ok = t.ndim == ndim_like;
  for (int d = 0; ok && d < ndim_like; ++d) ok = t.sizes[d] == like.sizes[d];
  if (!ok) {
    TensorView want = like;
    want.ndim = ndim_like;
    throw_expected(name, str_cat("shape ", shape_str(want), " (", like_what, ")"), str_cat("shape ", shape_str(t)));
  }
}

void check_contiguous(const TensorView& t, const char* name) {
  check_view(t, name);
  LOGITLESS_CHECK_ARG(t.is_contiguous(), name, "a contiguous tensor", "a strided one");
}

void check_numel(const TensorView& t, const char* name, int64_t numel, const char* what) {
  check_view(t, name);
  LOGITLESS_CHECK_ARG(t.numel() == numel, name, str_cat(numel, " elements (", what, ")"),
                      str_cat(t.numel(), " (shape ", shape_str(t), ")"));
}

void check_nonnull(const TensorView& t, const char* name) {
  check_view(t, name);
  LOGITLESS_CHECK_ARG(t.data != nullptr || t.numel() == 0, name, "a non-null data pointer", "nullptr");
}

int64_t checked_product(int64_t a, int64_t b, const char* name) {
  int64_t r = 0;
  LOGITLESS_CHECK_ARG(!__builtin_mul_overflow(a, b, &r), name, "a size whose element count fits in int64",
                      str_cat(a, " x ", b, " elements"));
  return r;
}

void check_workspace(const Workspace& ws, size_t need, const char* what) {
  LOGITLESS_CHECK_ARG(ws.bytes >= need, "workspace", str_cat(">= ", need, " bytes", what), str_cat(ws.bytes, " bytes"));
  if (need == 0) return;
  LOGITLESS_CHECK_ARG(ws.data != nullptr, "workspace", "a non-null pointer", "nullptr");
  // The kernels keep 16-byte vectors and 8-byte scalars in it, and TMA descriptors need 16-byte addresses.
  LOGITLESS_CHECK_ARG(reinterpret_cast<uintptr_t>(ws.data) % kWorkspaceAlign == 0, "workspace",
                      str_cat("a ", kWorkspaceAlign, "-byte aligned pointer"), "a misaligned pointer");
}

}  // namespace logitless
