// Argument checks that throw logitless::Error with the argument's name, what was expected and what came.
#pragma once

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

[[noreturn]] inline void throw_invalid(const std::string& msg) {
  throw Error(Error::Kind::kInvalidArgument, msg);
}
[[noreturn]] inline void throw_runtime(const std::string& msg) { throw Error(Error::Kind::kRuntime, msg); }

// "name: expected <what>, got <got>"
template <typename Expected, typename Got>
[[noreturn]] void throw_expected(const char* name, const Expected& expected, const Got& got) {
  throw_invalid(str_cat(name, ": expected ", expected, ", got ", got));
}

#define LOGITLESS_CHECK_ARG(cond, name, expected, got) \
  do {                                                 \
    if (!(cond)) ::logitless::throw_expected(name, expected, got); \
  } while (0)

std::string shape_str(const TensorView& t);
std::string device_str(const Device& d);

inline bool same_device(const Device& a, const Device& b) { return a.type == b.type && a.index == b.index; }

// Common checks on a tensor argument.
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

}  // namespace logitless
