// Shared test machinery: tensors that live on the host or a GPU, random fills, poison, the tolerance
// table (one place for every op), and the GPU skip.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "common/host_float.h"
#include "logitless/logitless.h"

namespace logitless::test {

bool has_gpu();

#define LOGITLESS_SKIP_WITHOUT_GPU()                                     \
  do {                                                                   \
    if (!::logitless::test::has_gpu()) GTEST_SKIP() << "no CUDA device"; \
  } while (0)

// A tensor with host storage, mirrored to a GPU on request. Sizes/strides in elements; the storage holds
// `storage_elems` elements starting at element `offset` (so views with padding or offsets are testable).
class TestTensor {
 public:
  TestTensor() = default;
  TestTensor(DType dtype, std::vector<int64_t> sizes, std::vector<int64_t> strides = {}, int64_t offset = 0);

  DType dtype() const { return dtype_; }
  const std::vector<int64_t>& sizes() const { return sizes_; }
  const std::vector<int64_t>& strides() const { return strides_; }
  int64_t numel() const;
  int64_t storage_elems() const { return static_cast<int64_t>(host_.size() / dtype_size(dtype_)); }

  // Element offset (into storage) of the multi-index `idx` (row-major over sizes).
  int64_t storage_index(int64_t flat) const;

  float get(int64_t flat) const { return load_float(host_.data(), dtype_, storage_index(flat) + offset_); }
  void set(int64_t flat, float v) { store_float(host_.data(), dtype_, storage_index(flat) + offset_, v); }
  int64_t get_index(int64_t flat) const { return load_index(host_.data(), dtype_, storage_index(flat) + offset_); }
  void set_index(int64_t flat, int64_t v);

  void fill_storage_bytes(uint8_t byte);  // the whole storage, padding included
  // Every viewed element ~ N(0, stddev^2) (float tensors), from a counter-based generator: parallel, and the
  // same values for the same seed whatever the thread count.
  void fill_normal(uint64_t seed, float stddev);
  TestTensor clone() const;                 // same dtype, sizes, strides, offset and storage bytes (host side)
  std::vector<float> gather_float() const;  // the viewed elements as float, flat order
  void fill_storage_nan();                  // float tensors: every storage element NaN (poison)

  // Device mirror. to_device() allocates (once) and uploads; to_host() downloads.
  void to_device();
  void to_host();
  bool on_device() const { return dev_ != nullptr; }

  TensorView view(bool device) const;
  TensorView host_view() const { return view(false); }

  ~TestTensor();
  TestTensor(TestTensor&& o) noexcept { *this = std::move(o); }
  TestTensor& operator=(TestTensor&& o) noexcept;
  TestTensor(const TestTensor&) = delete;
  TestTensor& operator=(const TestTensor&) = delete;

 private:
  DType dtype_ = DType::kFloat32;
  std::vector<int64_t> sizes_, strides_;
  int64_t offset_ = 0;
  std::vector<uint8_t> host_;
  void* dev_ = nullptr;
};

// Device scratch of `bytes` (nullptr for 0), freed with the object.
class DeviceScratch {
 public:
  explicit DeviceScratch(size_t bytes);
  ~DeviceScratch();
  Workspace ws() const { return {ptr_, bytes_}; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

void device_synchronize();
void test_copy_device_to_host(void* dst, const void* src, size_t bytes);

// --- tolerances: one table for the whole suite ------------------------------------------------------
struct Tol {
  double rtol, atol;
  double floor = 0;  // absolute slack independent of scale (float16 subnormals are 6e-8 apart)
};
enum class Quantity {
  kLoss,
  kLse,
  kGrad,  // cross-entropy
  kNormOut,
  kNormRstd,
  kNormWeightGrad,  // rms_norm: y / residual_out / grad_x; rstd; grad_weight (its dtype)
  kElementwise,     // glu, rope: outputs and gradients of float32 (CPU: double) arithmetic rounded once to the dtype
  kLceGrad          // linear_cross_entropy grad_hidden / grad_weight / grad_bias: rtol = relative L2 error of the
                    // tensor, atol = any element's error over the tensor's largest magnitude
};
// Tolerance of a backend's output in `dtype` (the logits dtype) against a more exact reference.
Tol tolerance(DType dtype, Quantity q);

// |a - b| <= floor + atol * scale + rtol * |b| elementwise (NaN must match NaN); reports the worst element.
::testing::AssertionResult all_close(const std::vector<double>& actual, const std::vector<double>& expected, Tol tol,
                                     double scale, const std::string& what);
::testing::AssertionResult all_close(const std::vector<float>& actual, const std::vector<float>& expected, Tol tol,
                                     double scale, const std::string& what);

std::string dtype_tag(DType dt);

// The largest finite |x| (0 where there is none).
inline double max_abs(const std::vector<double>& v) {
  double m = 0;
  for (double x : v)
    if (std::isfinite(x)) m = std::max(m, std::abs(x));
  return m;
}

// A gradient against its reference: every element within atol of the largest magnitude (at least `unit`), and the
// relative L2 error over the elements finite in both (NaN patterns are checked elementwise) within rtol. With
// unit > 0 the error is relative to the tensor's norm but never to less than one element of that natural size:
// where the exact gradient cancels (V = 1) the reference holds float32 roundings of 0, and their norm is no scale.
inline ::testing::AssertionResult grad_close(const std::vector<double>& got, const std::vector<double>& want, Tol tol,
                                             double unit, const std::string& what) {
  const auto elementwise = all_close(got, want, Tol{0.0, tol.atol}, std::max(max_abs(want), unit), what);
  if (!elementwise) return elementwise;
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (!std::isfinite(want[i]) || !std::isfinite(got[i])) continue;
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  double rel = 0;
  if (unit > 0) {
    rel = std::sqrt(num / std::max(den, unit * unit + 1e-300));
    if (den == 0 && num <= unit * unit * tol.atol * tol.atol) return ::testing::AssertionSuccess();
  } else {
    rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  }
  if (rel <= tol.rtol) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": relative L2 error " << rel << " > " << tol.rtol;
}
inline ::testing::AssertionResult grad_close(const std::vector<double>& got, const std::vector<double>& want, Tol tol,
                                             const std::string& what) {
  return grad_close(got, want, tol, 0.0, what);
}

// A seed fresh per process (LOGITLESS_TEST_SEED overrides it): tests that draw from it see new inputs on every run,
// and print it (LOGITLESS_TRACE_SEED) so that a failure can be replayed.
inline uint64_t fresh_seed() {
  static const uint64_t seed = [] {
    if (const char* s = std::getenv("LOGITLESS_TEST_SEED")) return static_cast<uint64_t>(std::strtoull(s, nullptr, 10));
    std::random_device rd;
    return (static_cast<uint64_t>(rd()) << 32) ^ rd();
  }();
  return seed;
}
#define LOGITLESS_TRACE_SEED() SCOPED_TRACE("LOGITLESS_TEST_SEED=" + std::to_string(::logitless::test::fresh_seed()))

// The message of the Error that f raises ("" when it raises none), and its kind when `kind` is given.
inline std::string error_of(const std::function<void()>& f, Error::Kind* kind = nullptr) {
  try {
    f();
  } catch (const Error& e) {
    if (kind) *kind = e.kind();
    return e.what();
  }
  return "";
}

}  // namespace logitless::test
