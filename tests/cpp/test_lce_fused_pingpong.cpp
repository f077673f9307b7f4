// Variants of the fused Hopper exponentials (linear_cross_entropy/cuda/hopper/) on the same inputs, which must agree
// to the bit:
// - the two schedules (kernel.cuh, kernel_pingpong.cuh; common/debug_hooks.h's kLceFusedPingPong): the same WGMMAs
//   in the same k order and the same epilogue per element, so E, the tile statistics and the row statistics'
//   partials;
// - interior tiles on shift or after the tile's maximum (epilogue_exp.cuh; kLceExpOnShift): the same E and
//   statistics, except E in rows whose tile is far above shift (which exp_fixup rewrites).
// Outputs are poisoned with a different byte pattern before each run, so that an element one variant leaves
// unwritten differs too; E's rows are padded, and every run must leave the padding past the row's last 16-byte
// granule poisoned. The end-to-end check against the CPU backend is in test_linear_cross_entropy.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "common/debug_hooks.h"
#include "common/host_float.h"
#include "test_util.h"
#if defined(LOGITLESS_WITH_CUDA)
#include <cuda_runtime.h>

#include "linear_cross_entropy/cuda/kernels_hopper.h"
#endif

namespace logitless::test {
namespace {

using logitless::debug::Hook;

// A hook at `value` for the scope, as it was after it.
class HookScope {
 public:
  HookScope(Hook h, int64_t value) : h_(h), before_(logitless::debug::hook(h)) { logitless::debug::set_hook(h, value); }
  ~HookScope() { logitless::debug::set_hook(h_, before_); }
  HookScope(const HookScope&) = delete;
  HookScope& operator=(const HookScope&) = delete;

 private:
  Hook h_;
  int64_t before_;
};

// The hooks are read at each call and set back by the scope; they are also known by name (benchmark harnesses).
TEST(LinearCrossEntropyFusedPingPongHook, ScopeRestoresTheHook) {
  for (const auto& [hook, name] : {std::pair{Hook::kLceFusedPingPong, "lce_fused_pingpong"},
                                   std::pair{Hook::kLceExpOnShift, "lce_exp_on_shift"}}) {
    const int64_t before = logitless::debug::hook(hook);
    {
      const HookScope scope(hook, before == 0 ? 1 : 0);
      EXPECT_EQ(logitless::debug::hook(hook), before == 0 ? 1 : 0) << name;
    }
    EXPECT_EQ(logitless::debug::hook(hook), before) << name;
    EXPECT_TRUE(logitless::debug::set_hook(name, before)) << name;
  }
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

// The variant a run takes: its schedule and whether interior tiles go on shift.
struct ExpVariant {
  bool pingpong = false;
  bool on_shift = true;
};

ExpOutputs run_fused_exp(const ExpInputs& in, ExpVariant variant, bool row_stats, uint8_t poison) {
  const ExpShape& s = in.s;
  const int64_t tiles = (s.n + lce::kFusedTileCols - 1) / lce::kFusedTileCols;
  // Padded rows, read back whole. The TMA store writes whole 16-byte granules of a row (columns n .. round_up(n, 8)
  // of a row may change); the library's buffers have rows of a multiple of 8 elements, so nothing past that may.
  const int64_t granules_end = (s.n + 7) / 8 * 8, ld_e = granules_end + 8;
  TestTensor e(DType::kBFloat16, {s.m, ld_e}), partials(DType::kFloat32, {s.m, tiles * lce::kExpStatsFloats}),
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
    const HookScope schedule(Hook::kLceFusedPingPong, variant.pingpong ? 1 : 0);
    const HookScope on_shift(Hook::kLceExpOnShift, variant.on_shift ? 1 : 0);
    lce::launch_fused_exp(f, device_sm_count(), nullptr);
  }
  device_synchronize();
  ExpOutputs out;
  e.to_host();
  partials.to_host();
  const std::vector<float> rows = e.gather_float();
  int64_t written_past = 0;
  for (int64_t r = 0; r < s.m; ++r) {
    const auto row = rows.begin() + r * ld_e;
    out.e.insert(out.e.end(), row, row + s.n);
    written_past += std::count_if(row + granules_end, row + ld_e, [&](float v) {
      return float_to_bf16_bits(v) != static_cast<uint16_t>(poison | poison << 8);
    });
  }
  EXPECT_EQ(written_past, 0) << "E written past its rows' last 16-byte granule";
  out.partials = partials.gather_float();
  if (row_stats) {
    row_partials.to_host();
    out.row_partials = row_partials.gather_float();
  }
  return out;
}

// Bitwise equality (NaN payloads included) of rows [0, size / cols) except those `skip` names, naming the first
// element that differs.
template <class Skip>
::testing::AssertionResult same_bits(const std::vector<float>& a, const std::vector<float>& b, int64_t cols,
                                     const char* what, Skip&& skip) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << what << ": sizes differ";
  for (size_t i = 0; i < a.size(); ++i)
    if (!skip(static_cast<int64_t>(i) / cols) && std::memcmp(&a[i], &b[i], sizeof(float)) != 0)
      return ::testing::AssertionFailure()
             << what << ": first difference at row " << static_cast<int64_t>(i) / cols << ", column "
             << static_cast<int64_t>(i) % cols << ": " << a[i] << " vs " << b[i];
  return ::testing::AssertionSuccess();
}
::testing::AssertionResult same_bits(const std::vector<float>& a, const std::vector<float>& b, int64_t cols,
                                     const char* what) {
  return same_bits(a, b, cols, what, [](int64_t) { return false; });
}

void expect_schedules_agree(const ExpShape& s, bool row_stats) {
  SCOPED_TRACE(::testing::Message() << "m=" << s.m << " n=" << s.n << " k=" << s.k
                                    << (row_stats ? " with row statistics" : ""));
  const ExpInputs in(s);
  const ExpOutputs cooperative = run_fused_exp(in, ExpVariant{false, true}, row_stats, 0xA5);
  const ExpOutputs pingpong = run_fused_exp(in, ExpVariant{true, true}, row_stats, 0x5A);
  const int64_t tiles = (s.n + lce::kFusedTileCols - 1) / lce::kFusedTileCols;
  EXPECT_TRUE(same_bits(cooperative.e, pingpong.e, s.n, "E"));
  EXPECT_TRUE(same_bits(cooperative.partials, pingpong.partials, tiles * lce::kExpStatsFloats, "partials"));
  if (row_stats) EXPECT_TRUE(same_bits(cooperative.row_partials, pingpong.row_partials, tiles * 4, "row partials"));
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

// Interior tiles on shift against the maximum first, on both schedules. Besides the inputs' rows (shifts near the
// logits), every 11th row has a shift 100 below them (its tiles are far: the sums on shift exceed e^64, so the
// warp takes the maxima after its exponentials), and rows 7 and 40 (when in the problem) a shift of -inf and NaN
// (their warps take the maximum first). The statistics must agree everywhere, E outside the far rows.
TEST(LinearCrossEntropyCudaFused, ExponentialsOnShiftMatchMaximumFirst) {
  LOGITLESS_SKIP_WITHOUT_GPU();
  if (!hopper_with_fused_kernels()) GTEST_SKIP() << "no sm_90 device or no fused kernels in this build";
  for (const ExpShape& s : kShapes) {
    ExpInputs in(s);
    const auto far = [](int64_t r) { return r % 11 == 4; };
    for (int64_t r = 0; r < s.m; ++r)
      if (far(r)) in.shift.set(r, -100.f);
    if (s.m > 40) {
      in.shift.set(7, -INFINITY);
      in.shift.set(40, NAN);
    }
    in.shift.to_device();
    const int64_t tile_cols = (s.n + lce::kFusedTileCols - 1) / lce::kFusedTileCols * 4;
    for (const bool pingpong : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "m=" << s.m << " n=" << s.n << " k=" << s.k
                                        << (pingpong ? " ping-pong" : " cooperative"));
      const ExpOutputs first = run_fused_exp(in, ExpVariant{pingpong, false}, false, 0xA5);
      const ExpOutputs on_shift = run_fused_exp(in, ExpVariant{pingpong, true}, false, 0x5A);
      EXPECT_TRUE(same_bits(first.partials, on_shift.partials, tile_cols, "partials"));
      EXPECT_TRUE(same_bits(first.e, on_shift.e, s.n, "E outside the far rows", far));
    }
  }
}

#endif

}  // namespace
}  // namespace logitless::test
