#include "logitless/tensor.h"

#include "common/check.h"
#include "logitless/version.h"

namespace logitless {

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kFloat64:
      return "float64";
    case DType::kInt32:
      return "int32";
    case DType::kInt64:
      return "int64";
    case DType::kUInt8:
      return "uint8";
    case DType::kBool:
      return "bool";
  }
  return "unknown dtype";
}

int64_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
    case DType::kInt32:
      return 4;
    case DType::kFloat16:
    case DType::kBFloat16:
      return 2;
    case DType::kFloat64:
    case DType::kInt64:
      return 8;
    case DType::kUInt8:
    case DType::kBool:
      return 1;
  }
  throw_invalid(str_cat("unknown dtype code ", static_cast<int>(dtype)));
}

int64_t TensorView::numel() const {
  if (ndim < 0) return 0;
  int64_t n = 1;
  for (int d = 0; d < ndim; ++d) n *= sizes[d];
  return n;
}

bool TensorView::is_contiguous() const {
  if (numel() == 0) return true;  // as torch: an empty tensor's strides address nothing
  int64_t expected = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    if (sizes[d] != 1 && strides[d] != expected) return false;
    expected *= sizes[d];
  }
  return true;
}

TensorView TensorView::make(void* data, DType dtype, Device device, int32_t ndim, const int64_t* sizes,
                            const int64_t* strides) {
  if (ndim < 0 || ndim > kMaxDims) throw_invalid(str_cat("tensor: expected 0..", kMaxDims, " dimensions, got ", ndim));
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.device = device;
  t.ndim = ndim;
  int64_t running = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    if (sizes[d] < 0) throw_invalid(str_cat("tensor: expected sizes >= 0, got ", sizes[d], " in dimension ", d));
    t.sizes[d] = sizes[d];
    t.strides[d] = strides ? strides[d] : running;
    running *= sizes[d];
  }
  return t;
}

TensorView TensorView::make(void* data, DType dtype, Device device, std::initializer_list<int64_t> sizes,
                            std::initializer_list<int64_t> strides) {
  if (strides.size() != 0 && strides.size() != sizes.size())
    throw_invalid(str_cat("tensor: expected ", sizes.size(), " strides, got ", strides.size()));
  return make(data, dtype, device, static_cast<int32_t>(sizes.size()), sizes.begin(),
              strides.size() ? strides.begin() : nullptr);
}

const char* version() { return "0.1.0"; }

}  // namespace logitless
