// Argument checks that throw logitless::Error with the argument's name, what was expected and what came.
#pragma once

#include <cstddef>
#include <cstdio>
#include <string>
#include <type_traits>

#include "logitless/error.h"
#include "logitless/tensor.h"

namespace logitless {

// Message formatting without iostreams: a stream's locale facets come from whichever libstdc++ the host
// process loaded first, and inside one Python process (next to PyTorch's) formatting a double through them
// crashed; snprintf and std::to_string have no such state.
namespace detail {
inline void append(std::string& s, const std::string& v) { s += v; }
inline void append(std::string& s, const char* v) { s += v ? v : "(null)"; }
inline void append(std::string& s, char v) { s += v; }
template <typename T>
std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, char>> append(std::string& s, T v) {
  s += std::to_string(v);
}
template <typename T>
std::enable_if_t<std::is_floating_point_v<T>> append(std::string& s, T v) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%g", static_cast<double>(v));
  s += buf;
}
}  // namespace detail

template <typename... Args>
std::string str_cat(const Args&... args) {
  std::string s;
  (detail::append(s, args), ...);
  return s;
}

[[noreturn]] inline void throw_invalid(const std::string& msg) { throw Error(Error::Kind::kInvalidArgument, msg); }
[[noreturn]] inline void throw_runtime(const std::string& msg) { throw Error(Error::Kind::kRuntime, msg); }

// "name: expected <what>, got <got>"
template <typename Expected, typename Got>
[[noreturn]] void throw_expected(const char* name, const Expected& expected, const Got& got) {
  throw_invalid(str_cat(name, ": expected ", expected, ", got ", got));
}

#define LOGITLESS_CHECK_ARG(cond, name, expected, got)             \
  do {                                                             \
    if (!(cond)) ::logitless::throw_expected(name, expected, got); \
  } while (0)

// a * b for a count the checks compare against, or an invalid-argument Error naming `name` when the product
// overflows int64 (a and b >= 0).
int64_t checked_product(int64_t a, int64_t b, const char* name);

std::string shape_str(const TensorView& t);
std::string device_str(const Device& d);

inline bool same_device(const Device& a, const Device& b) { return a.type == b.type && a.index == b.index; }

// Common checks on a tensor argument. Each of them first checks that a defined `t` is a well-formed view
// (check_view), so whichever of them an entry point applies to an argument first, no size, stride or pointer of a
// malformed view is used.
// A well-formed view: at most kMaxDims dimensions, sizes >= 0, strides >= 0 (where the size is > 1), a known dtype,
// a CPU or CUDA device (CUDA ordinal >= 0), an element count and a byte extent that fit in int64, and a data pointer
// aligned to its element size. An undefined (absent) view passes.
void check_view(const TensorView& t, const char* name);
void check_defined(const TensorView& t, const char* name);
void check_dtype(const TensorView& t, const char* name, DType expected);
void check_float_dtype(const TensorView& t, const char* name);  // fp32 / fp16 / bf16
void check_index_dtype(const TensorView& t, const char* name);  // int32 / int64
void check_device(const TensorView& t, const char* name, const Device& expected);
void check_ndim(const TensorView& t, const char* name, int ndim);
void check_shape(const TensorView& t, const char* name, const TensorView& like, int ndim_like,
                 const char* like_what);  // t's sizes equal like.sizes[0:ndim_like]
void check_contiguous(const TensorView& t, const char* name);
void check_numel(const TensorView& t, const char* name, int64_t numel, const char* what);
void check_nonnull(const TensorView& t, const char* name);  // data != nullptr unless numel == 0

// The caller's scratch for a call that needs `need` bytes: at least that many, and a non-null pointer aligned to
// kWorkspaceAlign bytes whenever any are needed. `what` qualifies the size in the message ("" or e.g. " (the
// sequence's)").
inline constexpr size_t kWorkspaceAlign = 16;
void check_workspace(const Workspace& ws, size_t need, const char* what = "");

#if defined(LOGITLESS_WITH_CUDA)
// Where a CUDA call will run: `device` (that of the tensor `name`, which every other tensor of the call shares) is a
// visible CUDA device, and `stream` belongs to it or is a default stream (which follows the device the call makes
// current). Defined with the CUDA backend (common/cuda/device_info.cu).
void check_cuda_target(const char* name, const Device& device, StreamHandle stream);
#endif

}  // namespace logitless
