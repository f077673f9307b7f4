// logitless: the one tensor description every public function takes.
//
// A TensorView does not own memory. It is a data pointer plus dtype, device, sizes and strides (in
// elements, as torch counts them), so any framework can hand its tensors over without a copy.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>

namespace logitless {

enum class DType : int32_t {
  kFloat32 = 0,
  kFloat16 = 1,
  kBFloat16 = 2,
  kFloat64 = 3,
  kInt32 = 4,
  kInt64 = 5,
  kUInt8 = 6,
  kBool = 7,
};

const char* dtype_name(DType dtype);
int64_t dtype_size(DType dtype);  // bytes per element

enum class DeviceType : int32_t { kCPU = 0, kCUDA = 1 };

struct Device {
  DeviceType type = DeviceType::kCPU;
  int32_t index = 0;  // CUDA ordinal; 0 for the CPU
};

inline constexpr int kMaxDims = 8;

// Every entry point refuses (an invalid-argument Error naming the argument, before anything is read or written) a
// view that is not well formed: more than kMaxDims dimensions, a negative size, a negative stride in a dimension of
// size > 1, an unknown dtype or device code, a negative CUDA ordinal, an element count or byte extent beyond int64,
// a data pointer not aligned to its element size, or a null one with elements. Outputs may share memory with no
// input and no other output, except where an op says it writes in place.
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  Device device{};
  int32_t ndim = -1;  // -1: the tensor is absent (an optional argument that was not given)
  int64_t sizes[kMaxDims] = {};
  int64_t strides[kMaxDims] = {};  // in elements, may be 0 for broadcast dimensions of inputs

  bool defined() const { return ndim >= 0; }
  int64_t size(int d) const { return sizes[d < 0 ? d + ndim : d]; }
  int64_t stride(int d) const { return strides[d < 0 ? d + ndim : d]; }
  int64_t numel() const;
  bool is_contiguous() const;
  bool is_cuda() const { return device.type == DeviceType::kCUDA; }

  // A view of `data` with the given sizes; contiguous (row-major) strides when `strides` is empty.
  static TensorView make(void* data, DType dtype, Device device, std::initializer_list<int64_t> sizes,
                         std::initializer_list<int64_t> strides = {});
  static TensorView make(void* data, DType dtype, Device device, int32_t ndim, const int64_t* sizes,
                         const int64_t* strides /* nullptr: contiguous */);
};

// Scratch memory the caller provides (see each op's *_workspace_bytes). On CUDA it must be device
// memory on the op's device; it may be left uninitialized. When an op needs any, the pointer must be non-null and
// 16-byte aligned (as every allocator's is).
struct Workspace {
  void* data = nullptr;
  size_t bytes = 0;
};

// A CUDA stream as an opaque handle (a cudaStream_t); nullptr is the legacy default stream. A stream of another
// device than the tensors' is refused naming it, and so are tensors on a device the process does not see.
using StreamHandle = void*;

}  // namespace logitless
