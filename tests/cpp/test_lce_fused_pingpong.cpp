// The fused Hopper exponentials' two schedules (linear_cross_entropy/cuda/hopper/kernel.cuh, kernel_pingpong.cuh;
// common/debug_hooks.h's kLceFusedPingPong) on the same inputs: the same WGMMAs in the same k order and the same
// epilogue per element, so E, the tile statistics and the row statistics' partials must agree to the bit. Outputs
// are poisoned with a different byte pattern before each run, so that an element one schedule leaves unwritten
// differs too. The end-to-end check against the CPU backend is in test_linear_cross_entropy.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "common/debug_hooks.h"
#include "test_util.h"
#if defined(LOGITLESS_WITH_CUDA)
#include <cuda_runtime.h>

#include "linear_cross_entropy/cuda/kernels_hopper.h"
#endif

namespace logitless::test {
namespace {

using logitless::debug::Hook;

// The kLceFusedPingPong hook at `on` for the scope, as it was after it.
class PingPongScope {
 public:
  explicit PingPongScope(bool on) : before_(logitless::debug::hook(Hook::kLceFusedPingPong)) {
    logitless::debug::set_hook(Hook::kLceFusedPingPong, on ? 1 : 0);
  }
  ~PingPongScope() { logitless::debug::set_hook(Hook::kLceFusedPingPong, before_); }
  PingPongScope(const PingPongScope&) = delete;
  PingPongScope& operator=(const PingPongScope&) = delete;

 private:
  int64_t before_;
};

// The hook is read at each call and set back by the scope; it is also known by name (benchmark harnesses).
TEST(LinearCrossEntropyFusedPingPongHook, ScopeRestoresTheHook) {
  const int64_t before = logitless::debug::hook(Hook::kLceFusedPingPong);
  {
    const PingPongScope scope(before == 0);
    EXPECT_EQ(logitless::debug::hook(Hook::kLceFusedPingPong), before == 0 ? 1 : 0);
  }
  EXPECT_EQ(logitless::debug::hook(Hook::kLceFusedPingPong), before);
  EXPECT_TRUE(logitless::debug::set_hook("lce_fused_pingpong", before));
}

#if defined(LOGITLESS_WITH_CUDA)
bool hopper_with_fused_kernels() {
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0) != cudaSuccess) return false;
  if (cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0) != cudaSuccess) return false;
  return major == 9 && minor == 0 && lce::debug::fused_kernels_built();
}

int device_sm_count() {
  int sms = 0;
  return cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0) == cudaSuccess ? sms : 132;
}

struct ExpShape {
  int64_t m, n, k;
};

// The inputs of one shape: x [m, k] and w [n, k] in bfloat16 (logits of about unit spread), targets with some ignored
// (-100) and some out of range (NaN rows of E), and per-row shifts near the logits' range.
struct ExpInputs {
  ExpShape s;
  TestTensor x, w, target, shift;

  explicit ExpInputs(const ExpShape& shape)
      : s(shape),
        x(DType::kBFloat16, {shape.m, shape.k}),
        w(DType::kBFloat16, {shape.n, shape.k}),
        target(DType::kInt64, {shape.m}),
        shift(DType::kFloat32, {shape.m}) {
    x.fill_normal(static_cast<uint64_t>(shape.m * 7 + shape.k), 1.f);
    w.fill_normal(static_cast<uint64_t>(shape.n * 11 + shape.k), 1.f / std::sqrt(static_cast<float>(shape.k)));
    shift.fill_normal(static_cast<uint64_t>(shape.m * 13 + 1), 0.5f);
    for (int64_t r = 0; r < shape.m; ++r) {
      const int64_t t = (r * 2654435761LL) % shape.n;
      target.set_index(r, r % 17 == 3 ? -100 : r % 29 == 5 ? shape.n + 5 : t);
    }
    for (TestTensor* t : {&x, &w, &target, &shift}) t->to_device();
  }
};

// What launch_fused_exp wrote, as float values (bfloat16 E widened exactly).
struct ExpOutputs {
  std::vector<float> e, partials, row_partials;
};

ExpOutputs run_fused_exp(const ExpInputs& in, bool pingpong, bool row_stats, uint8_t poison) {
  const ExpShape& s = in.s;
  const int64_t tiles = (s.n + lce::kFusedTileCols - 1) / lce::kFusedTileCols;
  const int64_t ld_e = (s.n + 7) / 8 * 8 + 8;  // padded rows: what lies past n is never compared
  TestTensor e(DType::kBFloat16, {s.m, s.n}, {ld_e, 1}), partials(DType::kFloat32, {s.m, tiles * 4}),
      row_partials(DType::kFloat32, {s.m, tiles * 4});
  for (TestTensor* t : {&e, &partials, &row_partials}) {
    t->fill_storage_bytes(poison);
    t->to_device();
  }
  lce::FusedGemmParams f;
  f.dtype = DType::kBFloat16;
  f.x = in.x.view(true).data;
  f.ldx = s.k;
  f.w = in.w.view(true).data;
  f.ldw = s.k;
  f.m = s.m;
  f.n = s.n;
  f.k = s.k;
  f.target = static_cast<const int64_t*>(in.target.view(true).data);
  f.ce.vocab = f.ce.vocab_total = s.n;
  f.ce.inv_v = 1.f / static_cast<float>(s.n);
  f.partials = static_cast<float*>(partials.view(true).data);
  f.shift = static_cast<const float*>(in.shift.view(true).data);
  f.dlogits = e.view(true).data;
  f.ld_dlogits = ld_e;
  f.row_partials = row_stats ? static_cast<float*>(row_partials.view(true).data) : nullptr;
  {
    const PingPongScope scope(pingpong);
    lce::launch_fused_exp(f, device_sm_count(), nullptr);
  }
  device_synchronize();
  ExpOutputs out;
  e.to_host();
  partials.to_host();
  out.e = e.gather_float();
  out.partials = partials.gather_float();
  if (row_stats) {
    row_partials.to_host();
    out.row_partials = row_partials.gather_float();
  }
  return out;
}

// Bitwise equality (NaN payloads included), naming the first element that differs.
::testing::AssertionResult same_bits(const std::vector<float>& a, const std::vector<float>& b, int64_t cols,
                                     const char* what) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << what << ": sizes differ";
  for (size_t i = 0; i < a.size(); ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0)
      return ::testing::AssertionFailure()
             << what << ": first difference at row " << static_cast<int64_t>(i) / cols << ", column "
             << static_cast<int64_t>(i) % cols << ": " << a[i] << " (cooperative) vs " << b[i] << " (ping-pong)";
  return ::testing::AssertionSuccess();
}

void expect_schedules_agree(const ExpShape& s, bool row_stats) {
  SCOPED_TRACE(::testing::Message() << "m=" << s.m << " n=" << s.n << " k=" << s.k
                                    << (row_stats ? " with row statistics" : ""));
  const ExpInputs in(s);
  const ExpOutputs cooperative = run_fused_exp(in, /*pingpong=*/false, row_stats, 0xA5);
  const ExpOutputs pingpong = run_fused_exp(in, /*pingpong=*/true, row_stats, 0x5A);
  const int64_t tile_cols = (s.n + lce::kFusedTileCols - 1) / lce::kFusedTileCols * 4;
  EXPECT_TRUE(same_bits(cooperative.e, pingpong.e, s.n, "E"));
  EXPECT_TRUE(same_bits(cooperative.partials, pingpong.partials, tile_cols, "partials"));
  if (row_stats) EXPECT_TRUE(same_bits(cooperative.row_partials, pingpong.row_partials, tile_cols, "row partials"));
}

// Shapes, with the work units (pairs of 128-row token tiles x 256-column class tiles) each gives:
//   300 x 1000 x 40:     3 token tiles (the second CTA of the last pair is past the end, and in the last tile
//                        warpgroup 0's rows are partly in the problem, warpgroup 1's not at all), m and n no
//                        multiples of 64 and 256, one partial k step; 8 units, one per cluster.
//   520 x 13500 x 2048:  5 token tiles (the last with 8 rows), 3 x 53 = 159 units, more than the clusters a device
//                        holds; an odd count, so whatever the cluster count some CTA takes an odd number of units;
//                        a long k loop (32 steps per warpgroup).
//   200 x 3000 x 2048:   2 token tiles, rows 64.. of the second partly in; 12 units.
//   256 x 512 x 64:      every tile full, one k step, 2 units.
const ExpShape kShapes[] = {{300, 1000, 40}, {520, 13500, 2048}, {200, 3000, 2048}, {256, 512, 64}};

TEST(LinearCrossEntropyCudaFusedPingPong, ExponentialsMatchCooperative) {
  LOGITLESS_SKIP_WITHOUT_GPU();
  if (!hopper_with_fused_kernels()) GTEST_SKIP() << "no sm_90 device or no fused kernels in this build";
  for (const ExpShape& s : kShapes) expect_schedules_agree(s, /*row_stats=*/false);
}

TEST(LinearCrossEntropyCudaFusedPingPong, RowStatisticsMatchCooperative) {
  LOGITLESS_SKIP_WITHOUT_GPU();
  if (!hopper_with_fused_kernels()) GTEST_SKIP() << "no sm_90 device or no fused kernels in this build";
  for (const ExpShape& s : kShapes) expect_schedules_agree(s, /*row_stats=*/true);
}

#endif

}  // namespace
}  // namespace logitless::test
