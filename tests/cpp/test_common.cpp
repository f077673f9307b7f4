#include <algorithm>
#include <sstream>

#include "test_util.h"

#if defined(LOGITLESS_WITH_CUDA)
#include <cuda_runtime.h>
#endif

namespace logitless::test {

bool has_gpu() {
  static const bool gpu = logitless::cuda_device_count() > 0;
  return gpu;
}

namespace {
void check_cuda(int err, const char* what) {
  if (err != 0) throw std::runtime_error(std::string("CUDA call failed in test harness: ") + what);
}
}  // namespace

TestTensor::TestTensor(DType dtype, std::vector<int64_t> sizes, std::vector<int64_t> strides, int64_t offset)
    : dtype_(dtype), sizes_(std::move(sizes)), strides_(std::move(strides)), offset_(offset) {
  if (strides_.empty()) {
    strides_.resize(sizes_.size());
    int64_t s = 1;
    for (int d = static_cast<int>(sizes_.size()) - 1; d >= 0; --d) {
      strides_[d] = s;
      s *= sizes_[d];
    }
  }
  int64_t span = 1;  // elements spanned (max index + 1)
  for (size_t d = 0; d < sizes_.size(); ++d) {
    if (sizes_[d] == 0) span = 0;
  }
  if (span) {
    for (size_t d = 0; d < sizes_.size(); ++d) span += (sizes_[d] - 1) * strides_[d];
  }
  host_.assign(static_cast<size_t>((offset_ + span) * dtype_size(dtype_)), 0);
}

int64_t TestTensor::numel() const {
  int64_t n = 1;
  for (int64_t s : sizes_) n *= s;
  return n;
}

int64_t TestTensor::storage_index(int64_t flat) const {
  int64_t off = 0;
  for (int d = static_cast<int>(sizes_.size()) - 1; d >= 0; --d) {
    off += (flat % sizes_[d]) * strides_[d];
    flat /= sizes_[d];
  }
  return off;
}

void TestTensor::set_index(int64_t flat, int64_t v) {
  const int64_t i = storage_index(flat) + offset_;
  if (dtype_ == DType::kInt32) {
    reinterpret_cast<int32_t*>(host_.data())[i] = static_cast<int32_t>(v);
  } else {
    reinterpret_cast<int64_t*>(host_.data())[i] = v;
  }
}

void TestTensor::fill_storage_bytes(uint8_t byte) { std::fill(host_.begin(), host_.end(), byte); }

void TestTensor::fill_normal(uint64_t seed, float stddev) {
  const int64_t n = numel();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    // splitmix64 of (seed, i) -> two uniforms -> Box-Muller
    auto mix = [](uint64_t z) {
      z += 0x9E3779B97F4A7C15ull;
      z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
      z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
      return z ^ (z >> 31);
    };
    const uint64_t a = mix(seed * 0x632BE59BD9B4E019ull + 2 * static_cast<uint64_t>(i));
    const uint64_t b = mix(a ^ 0xD1B54A32D192ED03ull);
    const double u1 = (static_cast<double>(a >> 11) + 1.0) * 0x1.0p-53;  // (0, 1]
    const double u2 = static_cast<double>(b >> 11) * 0x1.0p-53;
    const double z = std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
    set(i, static_cast<float>(stddev * z));
  }
}

TestTensor TestTensor::clone() const {
  TestTensor t;
  t.dtype_ = dtype_;
  t.sizes_ = sizes_;
  t.strides_ = strides_;
  t.offset_ = offset_;
  t.host_ = host_;
  return t;
}

std::vector<float> TestTensor::gather_float() const {
  std::vector<float> out(static_cast<size_t>(numel()));
  const int64_t n = numel();
  bool contiguous = true;
  for (int64_t d = static_cast<int64_t>(sizes_.size()) - 1, s = 1; d >= 0; --d) {
    contiguous = contiguous && (sizes_[d] == 1 || strides_[d] == s);
    s *= sizes_[d];
  }
  if (contiguous) {  // the common case, without per-element index arithmetic
    const uint8_t* base = host_.data() + offset_ * dtype_size(dtype_);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) out[i] = load_float(base, dtype_, i);
    return out;
  }
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) out[i] = get(i);
  return out;
}

void TestTensor::fill_storage_nan() {
  // All-ones bytes are a NaN in float32, float16 and bfloat16 alike: a memset poisons any float tensor.
  std::fill(host_.begin(), host_.end(), static_cast<uint8_t>(0xFF));
}

void TestTensor::to_device() {
#if defined(LOGITLESS_WITH_CUDA)
  if (!dev_ && !host_.empty()) check_cuda(cudaMalloc(&dev_, host_.size()), "cudaMalloc");
  if (dev_) check_cuda(cudaMemcpy(dev_, host_.data(), host_.size(), cudaMemcpyHostToDevice), "upload");
#else
  throw std::runtime_error("built without CUDA");
#endif
}

void TestTensor::to_host() {
#if defined(LOGITLESS_WITH_CUDA)
  if (dev_) check_cuda(cudaMemcpy(host_.data(), dev_, host_.size(), cudaMemcpyDeviceToHost), "download");
#endif
}

TensorView TestTensor::view(bool device) const {
  TensorView t;
  uint8_t* base = device ? static_cast<uint8_t*>(dev_) : const_cast<uint8_t*>(host_.data());
  t.data = base ? base + offset_ * dtype_size(dtype_) : nullptr;
  t.dtype = dtype_;
  t.device = device ? Device{DeviceType::kCUDA, 0} : Device{DeviceType::kCPU, 0};
  t.ndim = static_cast<int32_t>(sizes_.size());
  for (size_t d = 0; d < sizes_.size(); ++d) {
    t.sizes[d] = sizes_[d];
    t.strides[d] = strides_[d];
  }
  return t;
}

TestTensor::~TestTensor() {
#if defined(LOGITLESS_WITH_CUDA)
  if (dev_) cudaFree(dev_);
#endif
}

TestTensor& TestTensor::operator=(TestTensor&& o) noexcept {
  if (this != &o) {
#if defined(LOGITLESS_WITH_CUDA)
    if (dev_) cudaFree(dev_);
#endif
    dtype_ = o.dtype_;
    sizes_ = std::move(o.sizes_);
    strides_ = std::move(o.strides_);
    offset_ = o.offset_;
    host_ = std::move(o.host_);
    dev_ = o.dev_;
    o.dev_ = nullptr;
  }
  return *this;
}

DeviceScratch::DeviceScratch(size_t bytes) : bytes_(bytes) {
#if defined(LOGITLESS_WITH_CUDA)
  if (bytes) check_cuda(cudaMalloc(&ptr_, bytes), "cudaMalloc scratch");
  // Poison: the library must not rely on zeroed scratch.
  if (bytes) check_cuda(cudaMemset(ptr_, 0xA5, bytes), "memset scratch");
#endif
}

DeviceScratch::~DeviceScratch() {
#if defined(LOGITLESS_WITH_CUDA)
  if (ptr_) cudaFree(ptr_);
#endif
}

void device_synchronize() {
#if defined(LOGITLESS_WITH_CUDA)
  check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
#endif
}

void test_copy_device_to_host(void* dst, const void* src, size_t bytes) {
#if defined(LOGITLESS_WITH_CUDA)
  check_cuda(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost), "download");
#else
  (void)dst, (void)src, (void)bytes;
  throw std::runtime_error("built without CUDA");
#endif
}

Tol tolerance(DType dtype, Quantity q) {
  // Rows of the table: the output dtype bounds what any backend can match. The loss and lse are float32
  // outputs computed from the same inputs, so they get tight tolerances whatever the logits dtype;
  // gradients are stored in the logits dtype (bf16 keeps 8 mantissa bits: 2^-8 = 0.4%).
  switch (q) {
    case Quantity::kLoss:
      return {2e-5, 2e-5};
    case Quantity::kLse:
      return {2e-6, 2e-5};
    case Quantity::kGrad:
      switch (dtype) {
        case DType::kFloat32:
          return {1e-4, 1e-6};
        case DType::kFloat16:
          return {2e-3, 1e-5, 6e-8};
        case DType::kBFloat16:
          return {1.6e-2, 1e-4};
        default:
          return {1e-4, 1e-6};
      }
    // RMSNorm outputs in a 16-bit dtype pass through up to three roundings (n, y; r and g in kNone), and a
    // backend whose float32 r differs from the reference's in the last bit may round n the other way: 4
    // ulps (bf16 2^-8, fp16 2^-11). Sums cancel in grad_x and grad_weight, hence the scaled atol.
    case Quantity::kNormOut:
      switch (dtype) {
        case DType::kFloat16:
          return {2e-3, 2e-5, 6e-8};
        case DType::kBFloat16:
          return {1.6e-2, 2e-4};
        default:
          return {2e-5, 2e-6};
      }
    case Quantity::kNormRstd:
      return {1e-5, 0};  // float32 sums of squares over up to 256 elements a thread
    case Quantity::kNormWeightGrad:
      switch (dtype) {
        case DType::kFloat16:
          return {2e-3, 1e-4};
        case DType::kBFloat16:
          return {1.6e-2, 1e-3};
        default:
          return {1e-4, 2e-5};
      }
    // Elementwise ops (glu, rope): one rounding to the dtype of a float32 (CPU: double) result, half an ulp each, so
    // two backends are at most an ulp apart (bf16 2^-8, fp16 2^-11 relative); float32 adds a few ulps of exp, tanh
    // and erf. Results where two terms cancel (a rotation, dgate near its zero) get a floor scaled by the largest.
    case Quantity::kElementwise:
      switch (dtype) {
        case DType::kFloat16:
          return {1e-3, 1e-5, 6e-8};
        case DType::kBFloat16:
          return {8e-3, 1e-4};
        default:
          return {1e-5, 1e-6};
      }
    // Linear cross-entropy: the CUDA path rounds the logits' gradient to the inputs' dtype before the two GEMMs
    // that consume it (as torch's own backward does), then rounds each output once; the CPU oracle keeps that
    // gradient in float32. Simulated at N=7..1024, H=33..128, V=1000..32003 (mean, sum, smoothing): bf16 3e-3
    // relative L2 and 7e-3 of the largest element; fp16 2e-3 and 2.6e-3 (tiny gradients lose bits as fp16
    // subnormals).
    case Quantity::kLceGrad:
      switch (dtype) {
        case DType::kFloat16:
          return {6e-3, 1e-2};
        case DType::kBFloat16:
          return {1e-2, 2.5e-2};
        default:
          return {1e-4, 1e-3};
      }
  }
  return {0, 0};
}

namespace {
template <typename F>
::testing::AssertionResult all_close_impl(const std::vector<F>& actual, const std::vector<F>& expected, Tol tol,
                                          double scale, const std::string& what) {
  if (actual.size() != expected.size()) {
    return ::testing::AssertionFailure() << what << ": size " << actual.size() << " vs " << expected.size();
  }
  const int64_t n = static_cast<int64_t>(actual.size());
  auto excess = [&](int64_t i) -> double {  // > 0: element i is out of tolerance
    const double a = actual[i], e = expected[i];
    if (std::isnan(e) || std::isnan(a)) return std::isnan(e) != std::isnan(a) ? INFINITY : -1.0;
    if (std::isinf(e) || std::isinf(a)) return a != e ? INFINITY : -1.0;
    return std::abs(a - e) - (tol.floor + tol.atol * scale + tol.rtol * std::abs(e));
  };
  int64_t bad = 0;
#pragma omp parallel for reduction(+ : bad) schedule(static)
  for (int64_t i = 0; i < n; ++i) bad += excess(i) > 0 ? 1 : 0;
  if (bad == 0) return ::testing::AssertionSuccess();
  int64_t worst = 0;
  double worst_excess = -INFINITY;
  for (int64_t i = 0; i < n; ++i) {
    const double x = excess(i);
    if (x > worst_excess) worst_excess = x, worst = i;
  }
  std::ostringstream os;
  os << what << ": " << bad << " of " << n << " elements differ; worst at " << worst << ": got " << actual[worst]
     << ", expected " << expected[worst] << " (rtol " << tol.rtol << ", atol " << tol.atol << " x scale " << scale
     << ", floor " << tol.floor << ")";
  return ::testing::AssertionFailure() << os.str();
}
}  // namespace

::testing::AssertionResult all_close(const std::vector<double>& actual, const std::vector<double>& expected, Tol tol,
                                     double scale, const std::string& what) {
  return all_close_impl(actual, expected, tol, scale, what);
}

::testing::AssertionResult all_close(const std::vector<float>& actual, const std::vector<float>& expected, Tol tol,
                                     double scale, const std::string& what) {
  return all_close_impl(actual, expected, tol, scale, what);
}

std::string dtype_tag(DType dt) {
  switch (dt) {
    case DType::kFloat32:
      return "f32";
    case DType::kFloat16:
      return "f16";
    case DType::kBFloat16:
      return "bf16";
    case DType::kInt32:
      return "i32";
    case DType::kInt64:
      return "i64";
    default:
      return dtype_name(dt);
  }
}

}  // namespace logitless::test
