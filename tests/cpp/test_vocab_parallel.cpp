// Vocabulary-parallel cross-entropy and linear cross-entropy (include/logitless/vocab_parallel.h): several ranks
// simulated in one process, each holding a shard of the vocabulary (a view of the whole tensor), the exchange a
// copy of every rank's partials, against the unsharded call on the CPU. Every option and reduction, uneven
// shards, an empty shard, targets in the last shard, every token ignored, bad targets; the linear variant's
// recompute schedule and its gradient-in-forward steps in both orders; the planner; bad input.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <sstream>

#include "layout_test_util.h"
#include "linear_cross_entropy/cuda/plan.h"
#include "linear_head/cuda/plan.h"
#include "logitless/vocab_parallel.h"
#include "test_util.h"

namespace logitless::test {
namespace {

enum class Preset { kPlain, kIgnore, kSmoothing, kWeightsSmoothing, kZLoss, kSoftcap, kAll, kAllIgnored, kBadNoCheck };

const char* preset_name(Preset p) {
  switch (p) {
    case Preset::kPlain:
      return "plain";
    case Preset::kIgnore:
      return "ignore";
    case Preset::kSmoothing:
      return "smooth";
    case Preset::kWeightsSmoothing:
      return "wsmooth";
    case Preset::kZLoss:
      return "zloss";
    case Preset::kSoftcap:
      return "softcap";
    case Preset::kAll:
      return "all";
    case Preset::kAllIgnored:
      return "allignored";
    case Preset::kBadNoCheck:
      return "badnocheck";
  }
  return "?";
}
const char* reduction_name(Reduction r) {
  return r == Reduction::kNone ? "none" : r == Reduction::kSum ? "sum" : "mean";
}

const Preset kPresets[] = {Preset::kPlain,     Preset::kIgnore,  Preset::kSmoothing, Preset::kWeightsSmoothing,
                           Preset::kZLoss,     Preset::kSoftcap, Preset::kAll,       Preset::kAllIgnored,
                           Preset::kBadNoCheck};

// The options of a preset, in the cross-entropy family's terms (the linear variant copies them).
CrossEntropyOptions ce_options_for(Preset p, Reduction r) {
  CrossEntropyOptions o;
  o.reduction = r;
  switch (p) {
    case Preset::kSmoothing:
      o.label_smoothing = 0.1;
      break;
    case Preset::kWeightsSmoothing:
      o.label_smoothing = 0.2;
      break;
    case Preset::kZLoss:
      o.z_loss = 1e-3;
      break;
    case Preset::kSoftcap:
      o.softcap = 4.0;
      break;
    case Preset::kAll:
      o.label_smoothing = 0.05;
      o.z_loss = 1e-2;
      o.softcap = 8.0;
      o.ignore_index = 2;  // an index inside [0, V)
      break;
    case Preset::kBadNoCheck:
      o.check_targets = false;
      break;
    default:
      break;
  }
  return o;
}

LinearCrossEntropyOptions lce_options_for(Preset p, Reduction r) {
  const CrossEntropyOptions c = ce_options_for(p, r);
  LinearCrossEntropyOptions o;
  o.reduction = r;
  o.ignore_index = c.ignore_index;
  o.label_smoothing = c.label_smoothing;
  o.z_loss = c.z_loss;
  o.softcap = c.softcap;
  o.check_targets = c.check_targets;
  return o;
}

bool uses_weights(Preset p) { return p == Preset::kWeightsSmoothing || p == Preset::kAll; }

// Targets: random classes; every third row ignored (except plain and softcap); row 0 in the last class (so the
// last shard holds a target); bad targets in the no-check preset.
void fill_targets(TestTensor& target, int64_t N, int64_t V, Preset p, int64_t ignore_index, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int64_t> tdist(0, V - 1);
  for (int64_t i = 0; i < N; ++i) {
    int64_t t = i == 0 ? V - 1 : tdist(rng);
    if (p != Preset::kPlain && p != Preset::kSoftcap && i % 3 == 1) t = ignore_index;
    if (p == Preset::kAllIgnored) t = ignore_index;
    if (p == Preset::kBadNoCheck && i % 4 == 2) t = (i % 8 == 2) ? V + 5 : -7;
    if (p == Preset::kAll && t == 2 && i % 3 != 1) t = V - 1;  // class 2 is ignore_index there
    target.set_index(i, t);
  }
}

void fill_class_weights(TestTensor& w, int64_t V, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(0.25f, 2.f);
  for (int64_t j = 0; j < V; ++j) w.set(j, u(rng));
}

// Shard widths (rank order) summing to V: one shard; halves; uneven thirds with a one-class first shard; an empty
// shard in the middle.
std::vector<std::vector<int64_t>> splits_for(int64_t V) {
  std::vector<std::vector<int64_t>> s = {{V}};
  if (V >= 2) s.push_back({V / 2, V - V / 2});
  if (V >= 4) s.push_back({1, V - 3, 2});
  s.push_back({V - V / 3, 0, V / 3});
  return s;
}

std::string split_name(const std::vector<int64_t>& s) {
  std::ostringstream os;
  os << "split";
  for (int64_t w : s) os << "_" << w;
  return os.str();
}

std::vector<int64_t> offsets_of(const std::vector<int64_t>& split) {
  std::vector<int64_t> off(split.size(), 0);
  for (size_t r = 1; r < split.size(); ++r) off[r] = off[r - 1] + split[r - 1];
  return off;
}

int64_t widest(const std::vector<int64_t>& split) { return *std::max_element(split.begin(), split.end()); }

// A view of `full` ([rows, cols] with unit column stride) restricted to columns [c0, c0 + width).
TensorView columns(const TestTensor& full, bool dev, int64_t c0, int64_t width) {
  TensorView v = full.view(dev);
  v.data = static_cast<char*>(v.data) + c0 * v.strides[v.ndim - 1] * dtype_size(v.dtype);
  v.sizes[v.ndim - 1] = width;
  return v;
}

// A view of `full` ([rows, H] or [rows]) restricted to rows [r0, r0 + n).
TensorView rows_of(const TestTensor& full, bool dev, int64_t r0, int64_t n) {
  TensorView v = full.view(dev);
  v.data = static_cast<char*>(v.data) + r0 * v.strides[0] * dtype_size(v.dtype);
  v.sizes[0] = n;
  return v;
}

// Scratch on the CPU (host memory, 8-byte aligned) or the GPU.
class Scratch {
 public:
  Scratch(size_t bytes, bool dev) {
    if (dev) {
      dev_ = std::make_unique<DeviceScratch>(bytes);
      ws_ = dev_->ws();
    } else {
      host_.resize((bytes + 7) / 8);
      ws_ = Workspace{bytes ? host_.data() : nullptr, bytes};
    }
  }
  Workspace ws() const { return ws_; }

 private:
  std::unique_ptr<DeviceScratch> dev_;
  std::vector<double> host_;
  Workspace ws_;
};

std::vector<double> doubles(const TestTensor& t) {
  const std::vector<float> f = t.gather_float();
  return std::vector<double>(f.begin(), f.end());
}

// Stacks every rank's partials (host copies) into [R, rows, 4], on the device if asked: the exchange.
void exchange(std::vector<TestTensor>& partials, TestTensor& gathered, bool dev) {
  int64_t at = 0;
  for (TestTensor& p : partials) {
    if (dev) p.to_host();
    for (int64_t i = 0; i < p.numel(); ++i) gathered.set(at++, p.get(i));
  }
  if (dev) gathered.to_device();
}

// Bitwise equality (float outputs of two ranks' finalize).
::testing::AssertionResult same_bits(const std::vector<float>& a, const std::vector<float>& b, const std::string& w) {
  if (a.size() != b.size() || (!a.empty() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) != 0))
    return ::testing::AssertionFailure() << w << ": ranks disagree";
  return ::testing::AssertionSuccess();
}

// ================================ cross-entropy over given logits ===============================================

struct CeCase {
  int64_t n, v;
  DType dtype;
  Preset preset;
};
std::string case_name(const CeCase& c) {
  std::ostringstream os;
  os << "N" << c.n << "_V" << c.v << "_" << dtype_tag(c.dtype) << "_" << preset_name(c.preset);
  return os.str();
}
void PrintTo(const CeCase& c, std::ostream* os) { *os << case_name(c); }

struct CeInputs {
  CeCase c;
  TestTensor logits, target, weight;
  bool has_weight = false;
  CeInputs(const CeCase& cs, uint64_t seed) : c(cs) {
    const int64_t N = c.n, V = c.v;
    // Padded rows (stride V + 3): each shard is then a strided column range of them.
    logits = TestTensor(c.dtype, {N, V}, {V + 3, 1});
    target = TestTensor(V % 2 ? DType::kInt32 : DType::kInt64, {N});
    logits.fill_storage_nan();
    logits.fill_normal(seed, c.preset == Preset::kSoftcap || c.preset == Preset::kAll ? 6.f : 2.f);
    fill_targets(target, N, V, c.preset, ce_options_for(c.preset, Reduction::kMean).ignore_index, seed + 1);
    if (uses_weights(c.preset)) {
      has_weight = true;
      weight = TestTensor(DType::kFloat32, {V});
      fill_class_weights(weight, V, seed + 2);
    }
  }
  TensorView wv(bool dev) const { return has_weight ? weight.view(dev) : TensorView{}; }
  void to_device() {
    logits.to_device();
    target.to_device();
    if (has_weight) weight.to_device();
  }
};

struct CeOut {
  std::vector<double> loss, lse, z;
  std::vector<float> grad;
};

std::vector<double> upstream_for(int64_t n, Reduction r, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(0.5, 1.5);
  std::vector<double> up(r == Reduction::kNone ? std::max<int64_t>(n, 1) : 1);
  for (auto& v : up) v = static_cast<float>(u(rng));
  return up;
}

TestTensor upstream_tensor(const std::vector<double>& up, int64_t n, Reduction r) {
  TestTensor t(DType::kFloat32, r == Reduction::kNone ? std::vector<int64_t>{n} : std::vector<int64_t>{});
  for (int64_t i = 0; i < t.numel(); ++i) t.set(i, static_cast<float>(up[up.size() == 1 ? 0 : i]));
  return t;
}

// The unsharded call on the CPU: loss, lse, z-loss and the gradient with the upstream factor.
CeOut ce_unsharded(CeInputs& in, const CrossEntropyOptions& o, const std::vector<double>& up) {
  const int64_t N = in.c.n, V = in.c.v;
  const bool none = o.reduction == Reduction::kNone;
  TestTensor loss(DType::kFloat32, none ? std::vector<int64_t>{N} : std::vector<int64_t>{});
  TestTensor lse(DType::kFloat32, {N}), z(DType::kFloat32, {N}), grad(in.c.dtype, {N, V});
  TestTensor g = upstream_tensor(up, N, o.reduction);
  cross_entropy_forward_backward(in.logits.host_view(), in.target.host_view(), in.wv(false), o, loss.host_view(),
                                 lse.host_view(), z.host_view(), grad.host_view(), g.host_view(), {}, nullptr);
  return CeOut{doubles(loss), doubles(lse), doubles(z), grad.gather_float()};
}

// The sharded calls: partials per rank, the exchange, finalize (on the first and the last rank: the same bits),
// the backward of every shard from the global lse into its columns of one gradient (in place: over a copy of the
// logits).
CeOut ce_sharded(CeInputs& in, const CrossEntropyOptions& o, const std::vector<double>& up,
                 const std::vector<int64_t>& split, bool dev, bool in_place) {
  const int64_t N = in.c.n, V = in.c.v, R = static_cast<int64_t>(split.size());
  const std::vector<int64_t> off = offsets_of(split);
  const bool none = o.reduction == Reduction::kNone;
  if (dev) in.to_device();
  const TensorView tv = in.target.view(dev);
  Scratch ws(cross_entropy_shard_workspace_bytes(tv, o), dev);
  std::vector<TestTensor> partials;
  for (int64_t r = 0; r < R; ++r) {
    partials.emplace_back(DType::kFloat32, std::vector<int64_t>{N, kShardStats});
    partials.back().fill_storage_nan();
    if (dev) partials.back().to_device();
    cross_entropy_shard_partials(columns(in.logits, dev, off[r], split[r]), tv, in.wv(dev), VocabShard{off[r], V}, o,
                                 partials.back().view(dev), ws.ws(), nullptr);
  }
  TestTensor gathered(DType::kFloat32, {R, N, kShardStats});
  exchange(partials, gathered, dev);

  std::vector<CeOut> fin;
  std::vector<std::vector<float>> bits;
  TestTensor lse_keep(DType::kFloat32, {N});
  for (int64_t r : {int64_t{0}, R - 1}) {
    TestTensor loss(DType::kFloat32, none ? std::vector<int64_t>{N} : std::vector<int64_t>{});
    TestTensor lse(DType::kFloat32, {N}), z(DType::kFloat32, {N});
    for (TestTensor* t : {&loss, &lse, &z}) {
      t->fill_storage_nan();
      if (dev) t->to_device();
    }
    cross_entropy_shard_finalize(gathered.view(dev), tv, in.wv(dev), V, o, loss.view(dev), lse.view(dev), z.view(dev),
                                 ws.ws(), nullptr);
    if (dev) {
      device_synchronize();
      for (TestTensor* t : {&loss, &lse, &z}) t->to_host();
    }
    std::vector<float> b = loss.gather_float();
    for (const TestTensor* t : {&lse, &z}) {
      const std::vector<float> f = t->gather_float();
      b.insert(b.end(), f.begin(), f.end());
    }
    bits.push_back(b);
    EXPECT_TRUE(same_bits(bits.back(), bits.front(), "finalize outputs")) << "rank " << r;
    fin.push_back(CeOut{doubles(loss), doubles(lse), doubles(z), {}});
    if (r == 0) lse_keep = lse.clone();
  }
  if (dev) lse_keep.to_device();

  TestTensor g = upstream_tensor(up, N, o.reduction);
  if (dev) g.to_device();
  TestTensor grad = in_place ? in.logits.clone() : TestTensor(in.c.dtype, {N, V}, {V + 3, 1});
  if (!in_place) grad.fill_storage_nan();
  if (dev) grad.to_device();
  for (int64_t r = 0; r < R; ++r) {
    const TensorView gv = columns(grad, dev, off[r], split[r]);
    const TensorView lv = in_place ? gv : columns(in.logits, dev, off[r], split[r]);
    cross_entropy_shard_backward(lv, tv, in.wv(dev), VocabShard{off[r], V}, lse_keep.view(dev), g.view(dev), o, gv,
                                 ws.ws(), nullptr);
  }
  if (dev) {
    device_synchronize();
    grad.to_host();
  }
  CeOut out = fin[0];
  out.grad = grad.gather_float();
  return out;
}

double grad_unit(const CeInputs& in, const CrossEntropyOptions& o, const std::vector<double>& up) {
  double u = 0;
  for (double x : up) u = std::max(u, std::abs(x));
  if (o.reduction != Reduction::kMean) return u;
  double denom = 0;
  for (int64_t i = 0; i < in.c.n; ++i) {
    const int64_t t = in.target.get_index(i);
    if (t != o.ignore_index && t >= 0 && t < in.c.v) denom += in.has_weight ? in.weight.get(t) : 1.0;
  }
  return denom > 0 ? u / denom : u;
}

void expect_ce(const CeInputs& in, const CrossEntropyOptions& o, const std::vector<double>& up, const CeOut& got,
               const CeOut& want, const std::string& tag) {
  double loss_scale = std::max(1.0, max_abs(want.loss));
  if (o.reduction != Reduction::kNone) {
    double acc = 0;
    for (double l : want.lse)
      if (std::isfinite(l)) acc += std::abs(l);
    loss_scale = std::max(loss_scale, acc * grad_unit(in, o, std::vector<double>{1.0}));
  }
  const DType dt = in.c.dtype;
  EXPECT_TRUE(all_close(got.loss, want.loss, tolerance(dt, Quantity::kLoss), loss_scale, tag + " loss"));
  EXPECT_TRUE(
      all_close(got.lse, want.lse, tolerance(dt, Quantity::kLse), std::max(1.0, max_abs(want.lse)), tag + " lse"));
  EXPECT_TRUE(
      all_close(got.z, want.z, tolerance(dt, Quantity::kLoss), std::max(1.0, max_abs(want.z)), tag + " z_loss"));
  double gmax = 0;
  for (float x : want.grad)
    if (std::isfinite(x)) gmax = std::max(gmax, static_cast<double>(std::abs(x)));
  EXPECT_TRUE(all_close(got.grad, want.grad, tolerance(dt, Quantity::kGrad), std::max(gmax, grad_unit(in, o, up)),
                        tag + " grad"));
}

std::vector<CeCase> ce_cases() {
  std::vector<CeCase> cases;
  struct Shape {
    int64_t n, v;
  };
  const Shape shapes[] = {{0, 5}, {1, 1}, {1, 3}, {7, 37}, {33, 1000}};
  for (DType dt : {DType::kFloat32, DType::kBFloat16, DType::kFloat16})
    for (const Shape& s : shapes)
      for (Preset p : kPresets) {
        if (dt == DType::kFloat16 && s.n != 33) continue;  // float16 at one shape: the dtype only changes loads
        cases.push_back({s.n, s.v, dt, p});
      }
  return cases;
}

uint64_t seed_of(const std::string& s) { return std::hash<std::string>{}(s); }

class VocabParallelCrossEntropy : public ::testing::TestWithParam<CeCase> {};

void run_ce_case(const CeCase& c, bool dev) {
  CeInputs in(c, seed_of(case_name(c)));
  for (Reduction red : {Reduction::kNone, Reduction::kSum, Reduction::kMean}) {
    const CrossEntropyOptions o = ce_options_for(c.preset, red);
    const auto up = upstream_for(c.n, red, seed_of(case_name(c)) + static_cast<int>(red));
    const CeOut want = ce_unsharded(in, o, up);
    for (const auto& split : splits_for(c.v)) {
      for (bool in_place : {false, true}) {
        const std::string tag = std::string(dev ? "cuda " : "cpu ") + reduction_name(red) + " " + split_name(split) +
                                (in_place ? " in place" : "");
        SCOPED_TRACE(tag);
        expect_ce(in, o, up, ce_sharded(in, o, up, split, dev, in_place), want, tag);
      }
    }
  }
}

TEST_P(VocabParallelCrossEntropy, CpuShardsMatchUnsharded) { run_ce_case(GetParam(), false); }

TEST_P(VocabParallelCrossEntropy, CudaShardsMatchCpuUnsharded) {
  LOGITLESS_SKIP_WITHOUT_GPU();
  run_ce_case(GetParam(), true);
}

INSTANTIATE_TEST_SUITE_P(Shapes, VocabParallelCrossEntropy, ::testing::ValuesIn(ce_cases()),
                         [](const ::testing::TestParamInfo<CeCase>& i) { return case_name(i.param); });

// Large shards on the GPU (the streaming kernels' whole-chunk loops over long rows, a target far into the last
// shard), bf16, against the CPU.
TEST(VocabParallelCrossEntropyCuda, LargeVocabulary) {
  LOGITLESS_SKIP_WITHOUT_GPU();
  for (Preset p : {Preset::kPlain, Preset::kAll}) {
    CeInputs in(CeCase{64, 128256, DType::kBFloat16, p}, 77);
    const CrossEntropyOptions o = ce_options_for(p, Reduction::kMean);
    const auto up = upstream_for(64, Reduction::kMean, 78);
    const CeOut want = ce_unsharded(in, o, up);
    for (const auto& split : {std::vector<int64_t>{64128, 64128}, std::vector<int64_t>{42752, 42752, 42752},
                              std::vector<int64_t>{100001, 28255}}) {
      SCOPED_TRACE(split_name(split));
      expect_ce(in, o, up, ce_sharded(in, o, up, split, true, false), want, "cuda");
    }
  }
}

// The partial statistics themselves: a row's max, sum of exp, target logit (0 outside the shard) and smoothing sum.
TEST(VocabParallelCrossEntropy, PartialsAreTheShardsStatistics) {
  TestTensor logits(DType::kFloat32, {2, 6}), target(DType::kInt64, {2}), partials(DType::kFloat32, {2, 4});
  const float x[12] = {1, 2, 3, 4, 5, 6, -1, 0.5f, 2, 0, 0, 1};
  for (int i = 0; i < 12; ++i) logits.set(i, x[i]);
  target.set_index(0, 4);  // in the shard [3, 6)
  target.set_index(1, 0);  // in another shard
  CrossEntropyOptions o;
  o.label_smoothing = 0.1;
  cross_entropy_shard_partials(columns(logits, false, 3, 3), target.host_view(), {}, VocabShard{3, 6}, o,
                               partials.host_view(), {}, nullptr);
  const double s0 = std::exp(-2.0) + std::exp(-1.0) + 1.0, s1 = std::exp(-1.0) * 2 + 1.0;
  EXPECT_FLOAT_EQ(partials.get(0), 6.f);
  EXPECT_FLOAT_EQ(partials.get(1), static_cast<float>(s0));
  EXPECT_FLOAT_EQ(partials.get(2), 5.f);
  EXPECT_FLOAT_EQ(partials.get(3), 15.f);
  EXPECT_FLOAT_EQ(partials.get(4), 1.f);
  EXPECT_FLOAT_EQ(partials.get(5), static_cast<float>(s1));
  EXPECT_FLOAT_EQ(partials.get(6), 0.f);
  EXPECT_FLOAT_EQ(partials.get(7), 1.f);
}

// A NaN or +inf logit in one shard makes its row NaN everywhere, as for one device; other rows are unaffected.
TEST(VocabParallelCrossEntropy, NanAndInfStayInTheirRow) {
  for (bool dev : {false, true}) {
    if (dev && !has_gpu()) continue;
    CeInputs in(CeCase{4, 100, DType::kBFloat16, Preset::kPlain}, 5);
    in.logits.set(1 * 100 + 70, NAN);
    in.logits.set(2 * 100 + 10, INFINITY);
    const CrossEntropyOptions o = ce_options_for(Preset::kPlain, Reduction::kNone);
    const std::vector<double> up(4, 1.0);
    const CeOut got = ce_sharded(in, o, up, {50, 50}, dev, false);
    EXPECT_TRUE(std::isfinite(got.loss[0]) && std::isfinite(got.loss[3])) << dev;
    EXPECT_TRUE(std::isnan(got.loss[1]) && std::isnan(got.loss[2])) << dev;
    for (int64_t j = 0; j < 100; ++j) {
      ASSERT_TRUE(std::isfinite(got.grad[j]) && std::isfinite(got.grad[300 + j])) << dev << " " << j;
      ASSERT_TRUE(std::isnan(got.grad[100 + j]) && std::isnan(got.grad[200 + j])) << dev << " " << j;
    }
  }
}

// Issue 19, sharded: with class weights, z-loss and reduction mean the z-loss terms are divided by the count of rows
// (scaling every class weight by 10 changes nothing), and without label smoothing a NaN or inf weight of a class no
// row targets leaves every output as it was with that weight finite. Every split, on the CPU and the GPU.
TEST(VocabParallelCrossEntropy, WeightsScaleAndUntargetedNonFiniteWeight) {
  LOGITLESS_TRACE_SEED();
  const uint64_t seed = fresh_seed();
  for (bool dev : {false, true}) {
    if (dev && !has_gpu()) continue;
    const CeCase c{23, 37, DType::kFloat32, Preset::kWeightsSmoothing};
    CeInputs in(c, seed);
    CrossEntropyOptions o = ce_options_for(c.preset, Reduction::kMean);
    o.label_smoothing = 0.0;
    o.z_loss = 0.05;
    const auto up = upstream_for(c.n, o.reduction, seed + 1);
    std::mt19937_64 rng(seed + 2);
    const int64_t k = std::uniform_int_distribution<int64_t>(0, c.v - 1)(rng);
    for (int64_t i = 0; i < c.n; ++i)
      if (in.target.get_index(i) == k) in.target.set_index(i, (k + 1) % c.v);
    const CeOut want = ce_unsharded(in, o, up);
    const TestTensor w0 = in.weight.clone();
    for (const auto& split : splits_for(c.v)) {
      const std::string tag = std::string(dev ? "cuda " : "cpu ") + split_name(split);
      SCOPED_TRACE(tag);
      const CeOut base = ce_sharded(in, o, up, split, dev, false);
      expect_ce(in, o, up, base, want, tag);
      const float wk = in.weight.get(k);
      for (float bad : {NAN, INFINITY}) {
        in.weight.set(k, bad);
        const CeOut got = ce_sharded(in, o, up, split, dev, false);
        EXPECT_EQ(got.loss, base.loss) << bad;
        EXPECT_EQ(got.grad, base.grad) << bad;
      }
      in.weight.set(k, wk);
      for (int64_t j = 0; j < c.v; ++j) in.weight.set(j, 10.f * in.weight.get(j));
      const CeOut scaled = ce_sharded(in, o, up, split, dev, false);
      for (int64_t j = 0; j < c.v; ++j) in.weight.set(j, w0.get(j));
      EXPECT_TRUE(all_close(scaled.loss, base.loss, Tol{1e-5, 0}, 1.0, tag + " loss, weights x 10"));
      double gmax = 0;
      for (float x : base.grad) gmax = std::max(gmax, static_cast<double>(std::abs(x)));
      EXPECT_TRUE(all_close(scaled.grad, base.grad, Tol{1e-5, 1e-6}, gmax, tag + " grad, weights x 10"));
    }
  }
}

TEST(VocabParallelCrossEntropyErrors, BadArguments) {
  TestTensor logits(DType::kFloat32, {4, 3}), target(DType::kInt64, {4}), partials(DType::kFloat32, {4, 4});
  TestTensor loss(DType::kFloat32, {}), w5(DType::kFloat32, {5}), w3(DType::kFloat32, {3});
  for (int64_t i = 0; i < 4; ++i) target.set_index(i, i);
  const auto part = [&](VocabShard s, const TensorView& w = {}, const TensorView& pv = {}) {
    return error_of([&] {
      cross_entropy_shard_partials(logits.host_view(), target.host_view(), w, s, {},
                                   pv.defined() ? pv : partials.host_view(), {}, nullptr);
    });
  };
  EXPECT_EQ(part({2, 5}), "");
  EXPECT_NE(part({3, 5}).find("shard.vocab: expected the whole vocabulary"), std::string::npos) << part({3, 5});
  EXPECT_NE(part({-1, 5}).find("shard.offset"), std::string::npos);
  // Class weights are the whole vocabulary's.
  EXPECT_EQ(part({2, 5}, w5.host_view()), "");
  EXPECT_NE(part({2, 5}, w3.host_view()).find("weight: expected shape [5]"), std::string::npos);
  TestTensor p3(DType::kFloat32, {4, 3});
  EXPECT_NE(part({2, 5}, {}, p3.host_view()).find("partials"), std::string::npos);
  // Targets are checked against the whole vocabulary: 4 is valid in a vocabulary of 5, 5 is not.
  target.set_index(2, 5);
  const std::string bad = part({2, 5});
  EXPECT_NE(bad.find("expected values in [0, 5)"), std::string::npos) << bad;
  EXPECT_NE(bad.find("row 2"), std::string::npos) << bad;
  target.set_index(2, 4);
  // Finalize: partials of R shards for N rows.
  TestTensor g2(DType::kFloat32, {2, 4, 4}), g_bad(DType::kFloat32, {2, 3, 4});
  for (int64_t i = 0; i < g2.numel(); ++i) g2.set(i, 0.f);
  const auto fin = [&](const TensorView& g, int64_t V) {
    return error_of(
        [&] { cross_entropy_shard_finalize(g, target.host_view(), {}, V, {}, loss.host_view(), {}, {}, {}, nullptr); });
  };
  EXPECT_EQ(fin(g2.host_view(), 5), "");
  EXPECT_NE(fin(g_bad.host_view(), 5).find("partials"), std::string::npos);
  EXPECT_NE(fin(g2.host_view(), 0).find("vocab"), std::string::npos);
}

// ================================ linear cross-entropy ==========================================================

struct LceCase {
  int64_t n, h, v;
  DType dtype;
  Preset preset;
  bool bias;
};
std::string case_name(const LceCase& c) {
  std::ostringstream os;
  os << "N" << c.n << "_H" << c.h << "_V" << c.v << "_" << dtype_tag(c.dtype) << "_" << preset_name(c.preset)
     << (c.bias ? "_bias" : "");
  return os.str();
}
void PrintTo(const LceCase& c, std::ostream* os) { *os << case_name(c); }

struct LceInputs {
  LceCase c;
  TestTensor hidden, weight, bias, target, class_weight;
  LceInputs(const LceCase& cs, uint64_t seed) : c(cs) {
    const int64_t N = c.n, H = c.h, V = c.v;
    hidden = TestTensor(c.dtype, {N, H});
    weight = TestTensor(c.dtype, {V, H}, {H + 3, 1});  // padded rows: each shard is a row range of them
    target = TestTensor(V % 2 ? DType::kInt32 : DType::kInt64, {N});
    hidden.fill_normal(seed, 1.f);
    weight.fill_storage_nan();
    const float spread = c.preset == Preset::kSoftcap || c.preset == Preset::kAll ? 6.f : 2.f;
    weight.fill_normal(seed + 1, spread / std::sqrt(static_cast<float>(H)));
    if (c.bias) {
      bias = TestTensor(c.dtype, {V});
      bias.fill_normal(seed + 2, 0.5f);
    }
    fill_targets(target, N, V, c.preset, ce_options_for(c.preset, Reduction::kMean).ignore_index, seed + 3);
    if (uses_weights(c.preset)) {
      class_weight = TestTensor(DType::kFloat32, {V});
      fill_class_weights(class_weight, V, seed + 4);
    }
  }
  bool has_cw() const { return uses_weights(c.preset); }
  TensorView cwv(bool dev) const { return has_cw() ? class_weight.view(dev) : TensorView{}; }
  TensorView bias_rows(bool dev, int64_t r0, int64_t n) const {
    return c.bias ? rows_of(bias, dev, r0, n) : TensorView{};
  }
  void to_device() {
    hidden.to_device();
    weight.to_device();
    target.to_device();
    if (c.bias) bias.to_device();
    if (has_cw()) class_weight.to_device();
  }
};

struct LceOut {
  std::vector<double> loss, lse, dx, dw, db;
};

// The unsharded linear cross-entropy on the CPU: forward, then the backward from its lse with the upstream factor.
LceOut lce_unsharded(LceInputs& in, const LinearCrossEntropyOptions& o, const std::vector<double>& up) {
  const int64_t N = in.c.n, H = in.c.h, V = in.c.v;
  const bool none = o.reduction == Reduction::kNone;
  TestTensor loss(DType::kFloat32, none ? std::vector<int64_t>{N} : std::vector<int64_t>{});
  TestTensor lse(DType::kFloat32, {N}), gx(DType::kFloat32, {N, H}), gw(DType::kFloat32, {V, H}),
      gb(DType::kFloat32, {V});
  TestTensor g = upstream_tensor(up, N, o.reduction);
  const TensorView bv = in.c.bias ? in.bias.host_view() : TensorView{};
  linear_cross_entropy_forward(in.hidden.host_view(), in.weight.host_view(), bv, in.target.host_view(), in.cwv(false),
                               o, loss.host_view(), lse.host_view(), {}, nullptr);
  linear_cross_entropy_backward(in.hidden.host_view(), in.weight.host_view(), bv, in.target.host_view(), in.cwv(false),
                                lse.host_view(), g.host_view(), o, gx.host_view(), gw.host_view(),
                                in.c.bias ? gb.host_view() : TensorView{}, {}, nullptr);
  LceOut out{doubles(loss), doubles(lse), doubles(gx), doubles(gw), {}};
  if (in.c.bias) out.db = doubles(gb);
  return out;
}

CrossEntropyOptions ce_of(const LinearCrossEntropyOptions& o) {
  CrossEntropyOptions c;
  c.ignore_index = o.ignore_index;
  c.reduction = o.reduction;
  c.label_smoothing = o.label_smoothing;
  c.z_loss = o.z_loss;
  c.softcap = o.softcap;
  c.check_targets = o.check_targets;
  return c;
}

// Every rank's gradient outputs: its own partial grad_hidden (summed over the ranks here, as an all_reduce
// would), and its rows of one grad_weight / grad_bias.
struct ShardGrads {
  std::vector<TestTensor> gx;
  TestTensor gw, gb;
  ShardGrads(const LceInputs& in, int64_t R, DType gdt, bool dev) {
    const int64_t N = in.c.n, H = in.c.h, V = in.c.v;
    for (int64_t r = 0; r < R; ++r) {
      gx.emplace_back(gdt, std::vector<int64_t>{N, H});
      gx.back().fill_storage_nan();
      if (dev) gx.back().to_device();
    }
    gw = TestTensor(gdt, {V, H});
    gb = TestTensor(gdt, {V});
    for (TestTensor* t : {&gw, &gb}) {
      t->fill_storage_nan();
      if (dev) t->to_device();
    }
  }
  TensorView gwv(bool dev, int64_t r0, int64_t n) const { return rows_of(gw, dev, r0, n); }
  TensorView gbv(const LceInputs& in, bool dev, int64_t r0, int64_t n) const {
    return in.c.bias ? rows_of(gb, dev, r0, n) : TensorView{};
  }
  void collect(const LceInputs& in, bool dev, LceOut& out) {
    if (dev) {
      device_synchronize();
      for (TestTensor& t : gx) t.to_host();
      gw.to_host();
      gb.to_host();
    }
    out.dx.assign(static_cast<size_t>(in.c.n * in.c.h), 0.0);
    for (const TestTensor& t : gx) {
      const std::vector<double> d = doubles(t);
      for (size_t i = 0; i < d.size(); ++i) out.dx[i] += d[i];
    }
    out.dw = doubles(gw);
    if (in.c.bias) out.db = doubles(gb);
  }
};

// The recompute schedule: partials per rank, the exchange, finalize, every shard's backward.
LceOut lce_recompute(LceInputs& in, const LinearCrossEntropyOptions& o, const std::vector<double>& up,
                     const std::vector<int64_t>& split, DType gdt, bool dev) {
  const int64_t N = in.c.n, V = in.c.v, R = static_cast<int64_t>(split.size());
  const std::vector<int64_t> off = offsets_of(split);
  const bool none = o.reduction == Reduction::kNone;
  if (dev) in.to_device();
  const TensorView h = in.hidden.view(dev), t = in.target.view(dev);
  std::vector<TestTensor> partials;
  for (int64_t r = 0; r < R; ++r) {
    const TensorView w = rows_of(in.weight, dev, off[r], split[r]);
    const VocabShard shard{off[r], V};
    partials.emplace_back(DType::kFloat32, std::vector<int64_t>{N, kShardStats});
    partials.back().fill_storage_nan();
    if (dev) partials.back().to_device();
    Scratch ws(linear_cross_entropy_shard_partials_workspace_bytes(h, w, t, shard, o), dev);
    linear_cross_entropy_shard_partials(h, w, in.bias_rows(dev, off[r], split[r]), t, in.cwv(dev), shard, o,
                                        partials.back().view(dev), ws.ws(), nullptr);
  }
  TestTensor gathered(DType::kFloat32, {R, N, kShardStats});
  exchange(partials, gathered, dev);
  TestTensor loss(DType::kFloat32, none ? std::vector<int64_t>{N} : std::vector<int64_t>{}), lse(DType::kFloat32, {N});
  for (TestTensor* x : {&loss, &lse}) {
    x->fill_storage_nan();
    if (dev) x->to_device();
  }
  const CrossEntropyOptions co = ce_of(o);
  Scratch fws(cross_entropy_shard_workspace_bytes(t, co), dev);
  cross_entropy_shard_finalize(gathered.view(dev), t, in.cwv(dev), V, co, loss.view(dev), lse.view(dev), {}, fws.ws(),
                               nullptr);

  TestTensor g = upstream_tensor(up, N, o.reduction);
  if (dev) g.to_device();
  ShardGrads grads(in, R, gdt, dev);
  for (int64_t r = 0; r < R; ++r) {
    const TensorView w = rows_of(in.weight, dev, off[r], split[r]);
    const VocabShard shard{off[r], V};
    const TensorView gx = grads.gx[r].view(dev), gw = grads.gwv(dev, off[r], split[r]),
                     gb = grads.gbv(in, dev, off[r], split[r]);
    Scratch ws(linear_cross_entropy_shard_backward_workspace_bytes(h, w, t, gx, gw, gb, shard, o), dev);
    linear_cross_entropy_shard_backward(h, w, in.bias_rows(dev, off[r], split[r]), t, in.cwv(dev), shard, lse.view(dev),
                                        g.view(dev), o, gx, gw, gb, ws.ws(), nullptr);
  }
  LceOut out;
  grads.collect(in, dev, out);
  if (dev) {
    loss.to_host();
    lse.to_host();
  }
  out.loss = doubles(loss);
  out.lse = doubles(lse);
  return out;
}

// The gradient-in-forward steps, every rank in lockstep. Sequential: logits(k), exchange, gradient(k). Overlapped:
// logits(k + 1) before gradient(k), as a caller that hides the exchange does.
LceOut lce_steps(LceInputs& in, LinearCrossEntropyOptions o, int64_t chunk, const std::vector<int64_t>& split,
                 DType gdt, bool dev, bool overlapped) {
  const int64_t N = in.c.n, V = in.c.v, R = static_cast<int64_t>(split.size());
  const std::vector<int64_t> off = offsets_of(split);
  o.chunk_tokens = linear_cross_entropy_shard_chunk_tokens(N, widest(split), o);
  if (chunk > 0) {
    o.chunk_tokens = chunk;
    EXPECT_EQ(linear_cross_entropy_shard_chunk_tokens(N, widest(split), o), std::min(chunk, std::max<int64_t>(N, 1)));
  }
  if (dev) in.to_device();
  const TensorView h = in.hidden.view(dev), t = in.target.view(dev);
  ShardGrads grads(in, R, gdt, dev);
  std::vector<TestTensor> loss, lse;
  std::vector<std::unique_ptr<Scratch>> ws;
  int64_t chunks = -1;
  for (int64_t r = 0; r < R; ++r) {
    const LinearCrossEntropyShardSteps st = linear_cross_entropy_shard_steps(
        h, rows_of(in.weight, dev, off[r], split[r]), t, grads.gx[r].view(dev), grads.gwv(dev, off[r], split[r]),
        grads.gbv(in, dev, off[r], split[r]), VocabShard{off[r], V}, o);
    EXPECT_EQ(st.chunk_tokens, o.chunk_tokens);
    if (chunks >= 0) EXPECT_EQ(st.num_chunks, chunks);
    chunks = st.num_chunks;
    ws.push_back(std::make_unique<Scratch>(st.workspace_bytes, dev));
    loss.emplace_back(DType::kFloat32, std::vector<int64_t>{});
    lse.emplace_back(DType::kFloat32, std::vector<int64_t>{N});
    for (TestTensor* x : {&loss.back(), &lse.back()}) {
      x->fill_storage_nan();
      if (dev) x->to_device();
    }
  }
  EXPECT_EQ(chunks, (N + o.chunk_tokens - 1) / o.chunk_tokens);
  auto step = [&](ShardStep s, int64_t k, int64_t r, const TensorView& partials) {
    linear_cross_entropy_shard_forward_backward_step(
        s, k, partials, h, rows_of(in.weight, dev, off[r], split[r]), in.bias_rows(dev, off[r], split[r]), t,
        in.cwv(dev), VocabShard{off[r], V}, o, loss[r].view(dev), lse[r].view(dev), grads.gx[r].view(dev),
        grads.gwv(dev, off[r], split[r]), grads.gbv(in, dev, off[r], split[r]), ws[r]->ws(), nullptr);
  };
  std::vector<std::vector<TestTensor>> partials(static_cast<size_t>(chunks));
  auto logits_step = [&](int64_t k) {
    const int64_t rows = std::min(o.chunk_tokens, N - k * o.chunk_tokens);
    for (int64_t r = 0; r < R; ++r) {
      partials[k].emplace_back(DType::kFloat32, std::vector<int64_t>{rows, kShardStats});
      partials[k].back().fill_storage_nan();
      if (dev) partials[k].back().to_device();
      step(ShardStep::kLogits, k, r, partials[k].back().view(dev));
    }
  };
  auto gradient_step = [&](int64_t k) {
    const int64_t rows = std::min(o.chunk_tokens, N - k * o.chunk_tokens);
    TestTensor gathered(DType::kFloat32, {R, rows, kShardStats});
    exchange(partials[k], gathered, dev);
    for (int64_t r = 0; r < R; ++r) step(ShardStep::kGradient, k, r, gathered.view(dev));
  };
  if (overlapped) {
    if (chunks > 0) logits_step(0);
    for (int64_t k = 0; k < chunks; ++k) {
      if (k + 1 < chunks) logits_step(k + 1);
      gradient_step(k);
    }
  } else {
    for (int64_t k = 0; k < chunks; ++k) {
      logits_step(k);
      gradient_step(k);
    }
  }
  LceOut out;
  grads.collect(in, dev, out);
  for (int64_t r = 0; r < R; ++r) {
    if (dev) {
      loss[r].to_host();
      lse[r].to_host();
    }
    EXPECT_TRUE(same_bits(loss[r].gather_float(), loss[0].gather_float(), "loss")) << "rank " << r;
  }
  out.loss = doubles(loss[0]);
  out.lse = doubles(lse[0]);
  return out;
}

void expect_lce(const LceInputs& in, const LinearCrossEntropyOptions& o, const LceOut& got, const LceOut& want,
                DType grad_dtype, const std::string& tag) {
  double loss_scale = std::max(1.0, max_abs(want.loss));
  if (o.reduction != Reduction::kNone) {
    double acc = 0, denom = 0;
    for (double l : want.lse)
      if (std::isfinite(l)) acc += std::abs(l);
    for (int64_t i = 0; i < in.c.n; ++i) {
      const int64_t t = in.target.get_index(i);
      if (t != o.ignore_index && t >= 0 && t < in.c.v) denom += in.has_cw() ? in.class_weight.get(t) : 1.0;
    }
    loss_scale = std::max(loss_scale, acc * (o.reduction == Reduction::kMean && denom > 0 ? 1.0 / denom : 1.0));
  }
  EXPECT_TRUE(all_close(got.loss, want.loss, tolerance(in.c.dtype, Quantity::kLoss), loss_scale, tag + " loss"));
  EXPECT_TRUE(all_close(got.lse, want.lse, tolerance(in.c.dtype, Quantity::kLse), std::max(1.0, max_abs(want.lse)),
                        tag + " lse"));
  const Tol tol = tolerance(grad_dtype, Quantity::kLceGrad);
  EXPECT_TRUE(grad_close(got.dx, want.dx, tol, tag + " grad_hidden"));
  EXPECT_TRUE(grad_close(got.dw, want.dw, tol, tag + " grad_weight"));
  if (in.c.bias) EXPECT_TRUE(grad_close(got.db, want.db, tol, tag + " grad_bias"));
}

std::vector<LceCase> lce_cases() {
  std::vector<LceCase> cases;
  for (DType dt : {DType::kFloat32, DType::kBFloat16}) {
    for (Preset p : kPresets) cases.push_back({13, 16, 29, dt, p, p == Preset::kAll || p == Preset::kIgnore});
    cases.push_back({0, 8, 11, dt, Preset::kPlain, true});
    cases.push_back({1, 5, 1, dt, Preset::kPlain, false});
    cases.push_back({40, 24, 301, dt, Preset::kAll, true});
  }
  return cases;
}

class VocabParallelLinearCrossEntropy : public ::testing::TestWithParam<LceCase> {};

void run_lce_case(const LceCase& c, bool dev) {
  LceInputs in(c, seed_of(case_name(c)));
  // The CPU computes in double either way: float32 outputs compare at float32 tolerances. The CUDA path rounds
  // the logits' gradient to the inputs' dtype before its GEMMs, and each rank's grad_hidden once more.
  const DType gdt = dev ? c.dtype : DType::kFloat32;
  for (Reduction red : {Reduction::kNone, Reduction::kSum, Reduction::kMean}) {
    const LinearCrossEntropyOptions o = lce_options_for(c.preset, red);
    const auto up = upstream_for(c.n, red, seed_of(case_name(c)) + static_cast<int>(red));
    const LceOut want = lce_unsharded(in, o, up);
    const LceOut want1 = red == Reduction::kNone ? LceOut{} : lce_unsharded(in, o, {1.0});
    for (const auto& split : splits_for(c.v)) {
      const std::string base = std::string(dev ? "cuda " : "cpu ") + reduction_name(red) + " " + split_name(split);
      {
        SCOPED_TRACE(base + " recompute");
        expect_lce(in, o, lce_recompute(in, o, up, split, DType::kFloat32, dev), want, gdt, base + " recompute");
      }
      if (red == Reduction::kNone || c.n == 0) continue;  // steps: sum and mean, and at least one token
      for (int64_t chunk : {int64_t{0}, int64_t{1}, c.n / 3 + 1}) {
        for (bool overlapped : {false, true}) {
          const std::string tag = base + " steps chunk " + std::to_string(chunk) + (overlapped ? " overlapped" : "");
          SCOPED_TRACE(tag);
          expect_lce(in, o, lce_steps(in, o, chunk, split, DType::kFloat32, dev, overlapped), want1, gdt, tag);
        }
      }
    }
  }
}

TEST_P(VocabParallelLinearCrossEntropy, CpuShardsMatchUnsharded) { run_lce_case(GetParam(), false); }

TEST_P(VocabParallelLinearCrossEntropy, CudaShardsMatchCpuUnsharded) {
  LOGITLESS_SKIP_WITHOUT_GPU();
  run_lce_case(GetParam(), true);
}

INSTANTIATE_TEST_SUITE_P(Shapes, VocabParallelLinearCrossEntropy, ::testing::ValuesIn(lce_cases()),
                         [](const ::testing::TestParamInfo<LceCase>& i) { return case_name(i.param); });

// 16-bit gradient outputs (grad_hidden rounded per rank before the sum), on either backend.
TEST(VocabParallelLinearCrossEntropy, SixteenBitGradients) {
  for (bool dev : {false, true}) {
    if (dev && !has_gpu()) continue;
    LceInputs in(LceCase{24, 32, 97, DType::kBFloat16, Preset::kAll, true}, 91);
    const LinearCrossEntropyOptions o = lce_options_for(Preset::kAll, Reduction::kMean);
    const LceOut want = lce_unsharded(in, o, {1.0});
    const std::vector<int64_t> split{40, 0, 57};
    SCOPED_TRACE(dev ? "cuda" : "cpu");
    expect_lce(in, o, lce_recompute(in, o, {1.0}, split, DType::kBFloat16, dev), want, DType::kBFloat16, "recompute");
    expect_lce(in, o, lce_steps(in, o, 7, split, DType::kBFloat16, dev, true), want, DType::kBFloat16, "steps");
  }
}

// GradWeightAccumulation::kWeightDtype in the steps: a budget too small for more than one chunk per token group makes
// each 7-token chunk a group, after which every rank rounds the running sum of its 16-bit grad_weight rows. The loss
// and the other gradients are bit-identical to the float32 accumulation's (on the CPU); grad_weight differs by those
// roundings and stays within the 16-bit tolerance of the unsharded result; the GPU matches the CPU.
TEST(VocabParallelLinearCrossEntropy, WeightDtypeAccumulationInTheSteps) {
  LceInputs in(LceCase{24, 32, 97, DType::kBFloat16, Preset::kAll, true}, 92);
  LinearCrossEntropyOptions o = lce_options_for(Preset::kAll, Reduction::kMean);
  o.memory_budget = 1;
  const LceOut want = lce_unsharded(in, o, {1.0});
  const std::vector<int64_t> split{40, 0, 57};
  const LceOut f32 = lce_steps(in, o, 7, split, DType::kBFloat16, false, true);
  o.grad_weight_accumulation = GradWeightAccumulation::kWeightDtype;
  const LceOut cpu = lce_steps(in, o, 7, split, DType::kBFloat16, false, true);
  EXPECT_EQ(cpu.loss, f32.loss);
  EXPECT_EQ(cpu.lse, f32.lse);
  EXPECT_EQ(cpu.dx, f32.dx);
  EXPECT_EQ(cpu.db, f32.db);
  size_t changed = 0;
  for (size_t i = 0; i < cpu.dw.size(); ++i) changed += cpu.dw[i] != f32.dw[i];
  EXPECT_GE(changed, cpu.dw.size() / 20) << "elements the per-group rounding changed";
  expect_lce(in, o, cpu, want, DType::kBFloat16, "cpu steps");
  if (!has_gpu()) return;
  expect_lce(in, o, lce_steps(in, o, 7, split, DType::kBFloat16, true, true), cpu, DType::kBFloat16, "cuda steps");
}

// GPU shapes past the chunking thresholds: several token groups (a float32 grad_weight accumulator), several
// vocabulary chunks in the recompute backward, bf16, every option.
TEST(VocabParallelLinearCrossEntropyCuda, ChunkedShapes) {
  LOGITLESS_SKIP_WITHOUT_GPU();
  LceInputs in(LceCase{300, 64, 5003, DType::kBFloat16, Preset::kAll, true}, 93);
  for (Reduction red : {Reduction::kMean, Reduction::kSum}) {
    LinearCrossEntropyOptions o = lce_options_for(Preset::kAll, red);
    o.memory_budget = size_t{4} * 2504 * 4 * 32;  // small chunks: 32-token slots, groups of a few chunks
    o.chunk_vocab = 1200;
    const LceOut want = lce_unsharded(in, o, {1.0});
    for (const auto& split : {std::vector<int64_t>{2502, 2501}, std::vector<int64_t>{1000, 3000, 1003}}) {
      const std::string tag = std::string(reduction_name(red)) + " " + split_name(split);
      SCOPED_TRACE(tag);
      expect_lce(in, o, lce_recompute(in, o, {1.0}, split, DType::kFloat32, true), want, DType::kBFloat16, tag);
      expect_lce(in, o, lce_steps(in, o, 0, split, DType::kFloat32, true, true), want, DType::kBFloat16, tag);
      expect_lce(in, o, lce_steps(in, o, 0, split, DType::kBFloat16, true, false), want, DType::kBFloat16, tag);
      // A quarter of the budget: 8-token chunks, and float32 grad_weight groups that grew (32 -> 96 tokens at
      // V_r = 2502) and still split the tokens.
      LinearCrossEntropyOptions quarter = o;
      quarter.memory_budget = o.memory_budget / 4;
      expect_lce(in, quarter, lce_steps(in, quarter, 0, split, DType::kFloat32, true, true), want, DType::kBFloat16,
                 tag + " quarter budget");
    }
  }
}

TEST(VocabParallelLinearCrossEntropyErrors, BadArguments) {
  LceInputs in(LceCase{6, 4, 9, DType::kFloat32, Preset::kPlain, false}, 3);
  const TensorView h = in.hidden.host_view(), t = in.target.host_view();
  const TensorView w = rows_of(in.weight, false, 3, 4);
  TestTensor partials(DType::kFloat32, {6, 4}), loss(DType::kFloat32, {}), gx(DType::kFloat32, {6, 4}),
      cw(DType::kFloat32, {4});
  LinearCrossEntropyOptions o;
  EXPECT_NE(
      error_of([&] {
        linear_cross_entropy_shard_partials(h, w, {}, t, {}, VocabShard{6, 9}, o, partials.host_view(), {}, nullptr);
      }).find("shard.vocab"),
      std::string::npos);
  EXPECT_NE(error_of([&] {
              linear_cross_entropy_shard_partials(h, w, {}, t, cw.host_view(), VocabShard{3, 9}, o,
                                                  partials.host_view(), {}, nullptr);
            }).find("class_weight: expected shape [9]"),
            std::string::npos);
  // The steps need the agreed chunk, a reduced loss and a chunk in range.
  EXPECT_NE(error_of([&] {
              linear_cross_entropy_shard_steps(h, w, t, gx.host_view(), {}, {}, VocabShard{3, 9}, o);
            }).find("chunk_tokens"),
            std::string::npos);
  o.chunk_tokens = 4;
  o.reduction = Reduction::kNone;
  EXPECT_NE(error_of([&] {
              linear_cross_entropy_shard_steps(h, w, t, gx.host_view(), {}, {}, VocabShard{3, 9}, o);
            }).find("reduction"),
            std::string::npos);
  o.reduction = Reduction::kMean;
  const LinearCrossEntropyShardSteps st =
      linear_cross_entropy_shard_steps(h, w, t, gx.host_view(), {}, {}, VocabShard{3, 9}, o);
  EXPECT_EQ(st.num_chunks, 2);
  std::vector<double> host((st.workspace_bytes + 7) / 8);
  const Workspace ws{host.data(), st.workspace_bytes};
  TestTensor p4(DType::kFloat32, {4, 4}), p2(DType::kFloat32, {2, 4}), lse(DType::kFloat32, {6});
  const auto step = [&](ShardStep s, int64_t k, const TensorView& p, Workspace wsp) {
    return error_of([&] {
      linear_cross_entropy_shard_forward_backward_step(s, k, p, h, w, {}, t, {}, VocabShard{3, 9}, o, loss.host_view(),
                                                       lse.host_view(), gx.host_view(), {}, {}, wsp, nullptr);
    });
  };
  EXPECT_EQ(step(ShardStep::kLogits, 0, p4.host_view(), ws), "");
  EXPECT_NE(step(ShardStep::kLogits, 2, p4.host_view(), ws).find("chunk: expected a chunk in [0, 2)"),
            std::string::npos);
  EXPECT_NE(step(ShardStep::kLogits, 1, p4.host_view(), ws).find("partials"), std::string::npos);  // 2 rows
  EXPECT_EQ(step(ShardStep::kLogits, 1, p2.host_view(), ws), "");
  EXPECT_NE(step(ShardStep::kLogits, 0, p4.host_view(), Workspace{host.data(), 8}).find("workspace"),
            std::string::npos);
  // A bad target fails the first step, before any exchange.
  in.target.set_index(3, 9);
  const std::string bad = step(ShardStep::kLogits, 0, p4.host_view(), ws);
  EXPECT_NE(bad.find("expected values in [0, 9)"), std::string::npos) << bad;
}

// ---- the planner ------------------------------------------------------------------------------------------------

lce::PlanInputs step_inputs(int64_t n, int64_t h, int64_t v, int64_t chunk) {
  lce::PlanInputs in;
  in.pass = lce::Pass::kForwardBackward;
  in.steps = true;
  in.n = n;
  in.h = h;
  in.v = v;
  in.elem_bytes = 2;
  in.need_dx = in.need_dw = true;
  in.chunk_tokens = chunk;
  return in;
}

using Laid = LaidPlan<lce::Plan, lce::Buffers>;
Laid lay(const lce::PlanInputs& in) { return lay_plan(in, lce::plan_linear_cross_entropy, lce::declare_workspace); }

TEST(VocabParallelPlan, ChunksAtTheBenchmarkShape) {
  // N=16384, H=4096, V=128256 on two ranks (V_r = 64128), bf16, 512 MiB: 512-token chunks (a quarter of the
  // budget each, two slots), groups of 2048 tokens (the rest), a float32 grad_weight accumulator (every token's
  // gradient, 2.1 GB, would exceed the budget plus the 1.05 GB accumulator).
  const int64_t chunk = lce::shard_chunk_tokens(16384, 64128, 0, size_t{512} << 20);
  EXPECT_EQ(chunk, 512);
  const Laid p = lay(step_inputs(16384, 4096, 64128, chunk));
  EXPECT_EQ(p.chunk_rows, 512);
  EXPECT_EQ(p.group_rows, 2048);
  EXPECT_EQ(p.group_rows % p.chunk_rows, 0);
  EXPECT_TRUE(p.dw_accumulator);
  EXPECT_EQ(p.slot_bytes, static_cast<size_t>(512 * 64128 * 4));
  EXPECT_LE(2 * p.slot_bytes + static_cast<size_t>(p.group_rows * p.ld_dlogits * 2), size_t{512} << 20);
  // The two slots lie one after the other, before the next region.
  EXPECT_LE(off(p.b.head.logits) + 2 * p.slot_bytes, off(p.b.head.dlogits));
  // Small problems: every token in one group; an option overrides the chunk; the chunk never exceeds N.
  EXPECT_EQ(lce::shard_chunk_tokens(100, 64128, 0, size_t{512} << 20), 100);
  EXPECT_EQ(lce::shard_chunk_tokens(16384, 64128, 77, size_t{512} << 20), 77);
  EXPECT_EQ(lce::shard_chunk_tokens(0, 0, 0, size_t{512} << 20), 1);
  const Laid s = lay(step_inputs(1000, 64, 500, 96));
  EXPECT_EQ(s.chunk_rows, 96);
  EXPECT_EQ(s.group_rows, 1056);  // 11 whole chunks cover the 1000 tokens
  EXPECT_FALSE(s.dw_accumulator);
  // float32 inputs form the gradient in their slot: a group is a chunk.
  lce::PlanInputs f32 = step_inputs(1000, 64, 500, 96);
  f32.elem_bytes = 4;
  const Laid f = lay(f32);
  EXPECT_TRUE(f.dlogits_in_place);
  EXPECT_EQ(f.group_rows, 96);
  EXPECT_EQ(off(f.b.head.dlogits), kNone);
}

// A float32 grad_weight (autocast over float32 master weights) takes every group's sums itself: the groups grow
// toward head::kFloat32SumsGroupRows as far as twice the budget holds them beside the slots, as on one device.
TEST(VocabParallelPlan, Float32GradWeightGroupsGrowWithinTwiceTheBudget) {
  const auto f32_grads = [](lce::PlanInputs in) {
    in.grad_hidden_f32 = in.grad_weight_f32 = true;
    return in;
  };
  const auto used = [](const Laid& p) {
    return 2 * p.slot_bytes + static_cast<size_t>(p.group_rows * p.ld_dlogits * 2);
  };
  // N=8192, H=2304, V=256000 on two ranks (V_r = 128000): 256-token chunks; a 16-bit grad_weight's groups are the
  // 1024 tokens the budget holds, a float32 one's 2048.
  const size_t budget = size_t{512} << 20;
  const int64_t chunk = lce::shard_chunk_tokens(8192, 128000, 0, budget);
  ASSERT_EQ(chunk, 256);
  const lce::PlanInputs in = step_inputs(8192, 2304, 128000, chunk);
  const Laid bf16 = lay(in), f32 = lay(f32_grads(in));
  EXPECT_EQ(bf16.group_rows, 1024);
  EXPECT_TRUE(bf16.dw_accumulator);
  EXPECT_EQ(f32.group_rows, head::kFloat32SumsGroupRows);
  EXPECT_FALSE(f32.dw_accumulator);
  EXPECT_EQ(f32.chunk_rows, chunk);
  EXPECT_LE(used(f32), 2 * budget);
  // A small budget: as far as twice it holds, in whole chunks.
  lce::PlanInputs small = in;
  small.memory_budget = size_t{64} << 20;
  small.chunk_tokens = lce::shard_chunk_tokens(8192, 128000, 0, small.memory_budget);
  const Laid sb = lay(small), sf = lay(f32_grads(small));
  EXPECT_GT(sf.group_rows, sb.group_rows);
  EXPECT_LT(sf.group_rows, head::kFloat32SumsGroupRows);
  EXPECT_EQ(sf.group_rows % sf.chunk_rows, 0);
  EXPECT_LE(used(sf), 2 * small.memory_budget);
  // No gradient of the weight: the budget's groups.
  lce::PlanInputs frozen = f32_grads(in);
  frozen.need_dw = false;
  EXPECT_EQ(lay(frozen).group_rows, 1024);
  // Groups the budget already makes 2048 long (V_r = 64128) stay so.
  const int64_t c2 = lce::shard_chunk_tokens(16384, 64128, 0, budget);
  EXPECT_EQ(lay(f32_grads(step_inputs(16384, 4096, 64128, c2))).group_rows, 2048);
}

}  // namespace
}  // namespace logitless::test
