// Argument checks that throw logitless::Error with the argument's name, what was expected and what came.
#pragma once

#include <sstream>
#include <string>

#include "logitless/error.h"
#include "logitless/tensor.h"

namespace logitless {

template <typename... Args>
std::string str_cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
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
