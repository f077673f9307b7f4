// Linear cross-entropy: the CPU backend against a naive float64 reference, the CUDA path against the CPU
// backend over dtype x shape x layout x options x entry point x chunking; the planner; bad input.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <iterator>
#include <optional>
#include <random>
#include <sstream>
#include <tuple>

#include "linear_cross_entropy/cuda/plan.h"
#include "linear_head/cuda/grad_columns.h"
#include "linear_head/cuda/plan.h"
#include "logitless/vocab_parallel.h"
#if defined(LOGITLESS_WITH_CUDA)
#include "linear_cross_entropy/cuda/kernels.h"
#include "linear_cross_entropy/cuda/kernels_hopper.h"
#include "linear_head/cuda/accumulate_gemm.h"
#endif
#include "layout_test_util.h"
#include "test_util.h"

namespace logitless::test {
namespace {

// kPadded: hidden rows with a stride > H (one common stride: the GEMMs read them in place), a weight with
// padded rows. kShifted: the causal-LM view h[:, :-1, :] of [B, T+1, H] (rows of two strides: copied).
enum class Layout { kContiguous, kPadded, kShifted };
// kWide: logits spread over hundreds of units, most targets far below their row's maximum (the fused gradient in
// forward rewrites such rows: params.h, ExpGradParams).
enum class Preset {
  kPlain,
  kIgnore,
  kSmoothing,
  kWeights,
  kZLoss,
  kSoftcap,
  kAll,
  kAllIgnored,
  kBadTargetNoCheck,
  kWide
};

const char* layout_name(Layout l) {
  switch (l) {
    case Layout::kContiguous:
      return "contig";
    case Layout::kPadded:
      return "padded";
    case Layout::kShifted:
      return "shifted";
  }
  return "?";
}
const char* preset_name(Preset p) {
  switch (p) {
    case Preset::kPlain:
      return "plain";
    case Preset::kIgnore:
      return "ignore";
    case Preset::kSmoothing:
      return "smooth";
    case Preset::kWeights:
      return "weights";
    case Preset::kZLoss:
      return "zloss";
    case Preset::kSoftcap:
      return "softcap";
    case Preset::kAll:
      return "all";
    case Preset::kAllIgnored:
      return "allignored";
    case Preset::kBadTargetNoCheck:
      return "badnocheck";
    case Preset::kWide:
      return "wide";
  }
  return "?";
}
const char* reduction_name(Reduction r) {
  return r == Reduction::kNone ? "none" : r == Reduction::kSum ? "sum" : "mean";
}

struct LceCase {
  int64_t n, h, v;
  DType dtype;
  Layout layout;
  Preset preset;
  Reduction reduction;
  bool bias;
};

std::string case_name(const LceCase& c) {
  std::ostringstream os;
  os << "N" << c.n << "_H" << c.h << "_V" << c.v << "_" << dtype_tag(c.dtype) << "_" << layout_name(c.layout) << "_"
     << preset_name(c.preset) << "_" << reduction_name(c.reduction) << (c.bias ? "_bias" : "");
  return os.str();
}
void PrintTo(const LceCase& c, std::ostream* os) { *os << case_name(c); }

LinearCrossEntropyOptions options_for(const LceCase& c) {
  LinearCrossEntropyOptions o;
  o.reduction = c.reduction;
  switch (c.preset) {
    case Preset::kSmoothing:
      o.label_smoothing = 0.1;
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
    case Preset::kBadTargetNoCheck:
      o.check_targets = false;
      break;
    default:
      break;
  }
  return o;
}

bool uses_class_weights(Preset p) { return p == Preset::kWeights || p == Preset::kAll; }

std::vector<int64_t> with_last(std::vector<int64_t> lead, int64_t last) {
  lead.push_back(last);
  return lead;
}

struct LceInputs {
  LceCase c;
  LinearCrossEntropyOptions opt;
  TestTensor hidden, weight, bias, target, class_weight;
  std::vector<int64_t> lead;

  LceInputs(const LceCase& cs, uint64_t seed) : c(cs), opt(options_for(cs)) {
    const int64_t N = c.n, H = c.h, V = c.v;
    const DType tdt = V % 2 ? DType::kInt32 : DType::kInt64;
    switch (c.layout) {
      case Layout::kContiguous:
        lead = {N};
        hidden = TestTensor(c.dtype, {N, H});
        weight = TestTensor(c.dtype, {V, H});
        target = TestTensor(tdt, {N});
        break;
      case Layout::kPadded:
        lead = {N};
        hidden = TestTensor(c.dtype, {N, H}, {H + 5, 1}, /*offset=*/1);
        weight = TestTensor(c.dtype, {V, H}, {H + 3, 1}, /*offset=*/2);
        target = TestTensor(tdt, {N}, {3});
        break;
      case Layout::kShifted: {
        const int64_t B = N % 2 == 0 && N > 0 ? 2 : 1, T = N / B;
        lead = {B, T};
        hidden = TestTensor(c.dtype, {B, T, H}, {(T + 1) * H, H, 1});
        weight = TestTensor(c.dtype, {V, H});
        target = TestTensor(tdt, {B, T}, {T + 1, 1}, /*offset=*/1);
        break;
      }
    }
    hidden.fill_storage_nan();
    weight.fill_storage_nan();
    target.fill_storage_bytes(0x7F);
    hidden.fill_normal(seed, 1.f);
    // Logits of about unit spread (several units with softcap, so that the cap bends them).
    const float spread = c.preset == Preset::kWide                                  ? 60.f
                         : c.preset == Preset::kSoftcap || c.preset == Preset::kAll ? 6.f
                                                                                    : 2.f;
    weight.fill_normal(seed + 1, spread / std::sqrt(static_cast<float>(H)));
    if (c.bias) {
      bias = TestTensor(c.dtype, {V});
      bias.fill_normal(seed + 2, 0.5f);
    }
    std::mt19937_64 rng(seed + 3);
    std::uniform_int_distribution<int64_t> tdist(0, V - 1);
    for (int64_t i = 0; i < N; ++i) {
      int64_t t = tdist(rng);
      if (c.preset != Preset::kPlain && c.preset != Preset::kSoftcap && i % 3 == 1) t = opt.ignore_index;
      if (c.preset == Preset::kAllIgnored) t = opt.ignore_index;
      if (c.preset == Preset::kBadTargetNoCheck && i % 4 == 2) t = (i % 8 == 2) ? V + 5 : -7;
      target.set_index(i, t);
    }
    if (uses_class_weights(c.preset)) {
      class_weight = TestTensor(DType::kFloat32, {V});
      std::uniform_real_distribution<float> u(0.25f, 2.f);
      for (int64_t j = 0; j < V; ++j) class_weight.set(j, u(rng));
    }
  }
  bool has_bias() const { return c.bias; }
  bool has_class_weight() const { return uses_class_weights(c.preset); }
  TensorView bv(bool dev) const { return has_bias() ? bias.view(dev) : TensorView{}; }
  TensorView cwv(bool dev) const { return has_class_weight() ? class_weight.view(dev) : TensorView{}; }
  void to_device() {
    hidden.to_device();
    weight.to_device();
    target.to_device();
    if (has_bias()) bias.to_device();
    if (has_class_weight()) class_weight.to_device();
  }
};

// ---- float64 reference: logits from the inputs' values, textbook cross-entropy, the three products ------
struct Outputs {
  std::vector<double> loss, lse;
  std::vector<double> dx, dw, db;  // logical (flat) order
};

// v rounded to a 16-bit dtype through float32, as a 16-bit tensor holds it.
double rounded_to(DType dt, double v) {
  const float f = static_cast<float>(v);
  return dt == DType::kBFloat16 ? bf16_bits_to_float(float_to_bf16_bits(f)) : half_bits_to_float(float_to_half_bits(f));
}

// dw_round_rows > 0: grad_weight's running sum is rounded to the inputs' (16-bit) dtype after every that many tokens
// and after the last, as GradWeightAccumulation::kWeightDtype sums it over token groups.
Outputs reference(const LceInputs& in, const std::vector<double>& upstream /* [1] or [N] */,
                  int64_t dw_round_rows = 0) {
  const int64_t N = in.c.n, H = in.c.h, V = in.c.v;
  const auto& o = in.opt;
  auto w = [&](int64_t j) { return in.has_class_weight() ? static_cast<double>(in.class_weight.get(j)) : 1.0; };
  std::vector<double> X(N * H), Wt(V * H), z(N * V), g(N * V, 0.0);
  for (int64_t i = 0; i < N * H; ++i) X[i] = in.hidden.get(i);
  for (int64_t i = 0; i < V * H; ++i) Wt[i] = in.weight.get(i);
  for (int64_t i = 0; i < N; ++i)
    for (int64_t j = 0; j < V; ++j) {
      double acc = in.has_bias() ? static_cast<double>(in.bias.get(j)) : 0.0;
      for (int64_t k = 0; k < H; ++k) acc += X[i * H + k] * Wt[j * H + k];
      z[i * V + j] = acc;
    }
  Outputs r;
  std::vector<double> rows(N, 0.0), rows_z(N, 0.0), lse(N, 0.0);
  double denom = 0, count = 0, W = 0;  // mean: the z-loss terms over the count, the rest over the summed weights
  for (int64_t j = 0; j < V; ++j) W += w(j);
  std::vector<char> valid(N, 0);
  for (int64_t i = 0; i < N; ++i) {
    const int64_t t = in.target.get_index(i);
    if (t == o.ignore_index) continue;
    if (t < 0 || t >= V) {
      rows[i] = lse[i] = NAN;
      continue;
    }
    valid[i] = 1;
    denom += w(t);
    count += 1;
    std::vector<double> x(V);
    double m = -INFINITY;
    for (int64_t j = 0; j < V; ++j) {
      const double y = z[i * V + j];
      x[j] = o.softcap > 0 ? o.softcap * std::tanh(y / o.softcap) : y;
      m = std::max(m, x[j]);
    }
    double s = 0;
    for (int64_t j = 0; j < V; ++j) s += std::exp(x[j] - m);
    lse[i] = m + std::log(s);
    double smooth = 0;  // only with label smoothing: a class masked to -inf makes it infinite
    const double eps = o.label_smoothing;
    if (eps != 0)
      for (int64_t j = 0; j < V; ++j) smooth -= w(j) * (x[j] - lse[i]);
    rows_z[i] = o.z_loss * lse[i] * lse[i];
    rows[i] = -(1 - eps) * w(t) * (x[t] - lse[i]) + eps / V * smooth + rows_z[i];
  }
  const bool mean = o.reduction == Reduction::kMean;
  const double inv = mean ? (denom != 0 ? 1.0 / denom : 0.0) : 1.0;
  const double inv_count = mean ? (count != 0 ? 1.0 / count : 0.0) : 1.0;
  if (o.reduction == Reduction::kNone) {
    r.loss = rows;
  } else {
    double total = 0;
    for (int64_t i = 0; i < N; ++i) total += (rows[i] - rows_z[i]) * inv + rows_z[i] * inv_count;
    r.loss = {total};
  }
  r.lse = lse;
  for (int64_t i = 0; i < N; ++i) {
    const int64_t t = in.target.get_index(i);
    if (t == o.ignore_index) continue;
    if (!valid[i]) {
      for (int64_t j = 0; j < V; ++j) g[i * V + j] = NAN;
      continue;
    }
    const double up = upstream[upstream.size() == 1 ? 0 : i], eps = o.label_smoothing;
    for (int64_t j = 0; j < V; ++j) {
      const double y = z[i * V + j];
      const double xj = o.softcap > 0 ? o.softcap * std::tanh(y / o.softcap) : y;
      const double p = std::exp(xj - lse[i]);
      double d = (1 - eps) * w(t) * (p - (j == t ? 1.0 : 0.0));       // -(1-eps) w_t d log p_t / dx_j
      if (eps != 0) d += eps / V * (W * p - w(j));                    // label smoothing
      d = up * inv * d + up * inv_count * 2 * o.z_loss * lse[i] * p;  // z-loss: d(lse^2) = 2 lse p_j
      if (o.softcap > 0) d *= 1 - (xj / o.softcap) * (xj / o.softcap);
      g[i * V + j] = d;
    }
  }
  r.dx.assign(N * H, 0.0);
  r.dw.assign(V * H, 0.0);
  r.db.assign(V, 0.0);
  for (int64_t i = 0; i < N; ++i) {
    for (int64_t j = 0; j < V; ++j) {
      const double gij = g[i * V + j];
      for (int64_t k = 0; k < H; ++k) {
        r.dx[i * H + k] += gij * Wt[j * H + k];
        r.dw[j * H + k] += gij * X[i * H + k];
      }
      r.db[j] += gij;
    }
    if (dw_round_rows > 0 && ((i + 1) % dw_round_rows == 0 || i + 1 == N))
      for (double& d : r.dw) d = rounded_to(in.c.dtype, d);
  }
  return r;
}

// ---- running a backend --------------------------------------------------------------------------------
enum class Entry { kForward, kForwardBackward, kBackward };
const char* entry_name(Entry e) {
  return e == Entry::kForward ? "forward" : e == Entry::kForwardBackward ? "forward_backward" : "backward";
}

// How the CUDA path chunks: as the budget says by default; small explicit chunks (several token groups, so a
// float32 grad_weight accumulator, and several vocabulary chunks, so a float32 grad_hidden accumulator); a
// small budget (logits chunks smaller than the token groups, several vocabulary chunks).
enum class Chunking { kDefault, kSmall, kBudget };
const char* chunking_name(Chunking c) {
  return c == Chunking::kDefault ? "default chunks" : c == Chunking::kSmall ? "small chunks" : "small budget";
}

LinearCrossEntropyOptions chunked(const LceInputs& in, Chunking ch) {
  LinearCrossEntropyOptions o = in.opt;
  if (ch == Chunking::kSmall) {
    o.chunk_tokens = in.c.n / 3 + 1;
    o.chunk_vocab = in.c.v / 3 + 1;
  } else if (ch == Chunking::kBudget) {
    const int64_t ldv = (in.c.v + 7) / 8 * 8;
    o.memory_budget = static_cast<size_t>(4 * ldv * 64);  // 16-row logits chunks, 96-row groups (16-bit)
  }
  return o;
}

struct GradDtypes {
  bool f32 = false;    // float32 gradient outputs whatever the inputs' dtype
  int64_t dw_pad = 0;  // grad_weight's rows this many elements apart beyond H
  int64_t dx_pad = 0;  // grad_hidden's rows this many elements apart beyond H
};

// Row-major strides of `sizes` whose last dimension's rows lie pad elements apart beyond its length.
std::vector<int64_t> padded_rows(const std::vector<int64_t>& sizes, int64_t pad) {
  std::vector<int64_t> strides(sizes.size(), 1);
  int64_t step = sizes.back() + pad;
  for (size_t d = sizes.size() - 1; d-- > 0;) {
    strides[d] = step;
    step *= sizes[d];
  }
  return strides;
}

Outputs run_backend(LceInputs& in, Entry e, bool dev, const std::vector<double>& upstream,
                    const std::vector<double>* lse_in, Chunking ch = Chunking::kDefault, GradDtypes gd = {}) {
  const int64_t N = in.c.n, H = in.c.h, V = in.c.v;
  const bool none = in.opt.reduction == Reduction::kNone;
  const DType gdt = gd.f32 ? DType::kFloat32 : in.c.dtype;
  TestTensor loss(DType::kFloat32, none ? in.lead : std::vector<int64_t>{});
  TestTensor lse(DType::kFloat32, in.lead);
  TestTensor gx(gdt, with_last(in.lead, H), padded_rows(with_last(in.lead, H), gd.dx_pad)),
      gw(gdt, {V, H}, {H + gd.dw_pad, 1}), gb(gdt, {V});
  // The upstream factor: [] for sum/mean, one per token for none.
  TestTensor up(DType::kFloat32, none ? in.lead : std::vector<int64_t>{});
  for (int64_t i = 0; i < up.numel(); ++i) up.set(i, static_cast<float>(upstream[upstream.size() == 1 ? 0 : i]));
  if (lse_in)
    for (int64_t i = 0; i < N; ++i) lse.set(i, static_cast<float>((*lse_in)[i]));
  else
    lse.fill_storage_nan();
  loss.fill_storage_nan();
  gx.fill_storage_nan();
  gw.fill_storage_nan();
  gb.fill_storage_nan();
  if (dev) {
    in.to_device();
    for (TestTensor* t : {&loss, &lse, &gx, &gw, &gb, &up}) t->to_device();
  }
  const LinearCrossEntropyOptions o = chunked(in, ch);
  const TensorView h = in.hidden.view(dev), w = in.weight.view(dev), t = in.target.view(dev);
  const TensorView gxv = gx.view(dev), gwv = gw.view(dev), gbv = in.has_bias() ? gb.view(dev) : TensorView{};
  size_t bytes = 0;
  switch (e) {
    case Entry::kForward:
      bytes = linear_cross_entropy_forward_workspace_bytes(h, w, t, o);
      break;
    case Entry::kForwardBackward:
      bytes = linear_cross_entropy_forward_backward_workspace_bytes(h, w, t, gxv, gwv, gbv, o);
      break;
    case Entry::kBackward:
      bytes = linear_cross_entropy_backward_workspace_bytes(h, w, t, gxv, gwv, gbv, o);
      break;
  }
  if (!dev) EXPECT_EQ(bytes, 0u);
  DeviceScratch ws(dev ? bytes : 0);
  switch (e) {
    case Entry::kForward:
      linear_cross_entropy_forward(h, w, in.bv(dev), t, in.cwv(dev), o, loss.view(dev), lse.view(dev), ws.ws(),
                                   nullptr);
      break;
    case Entry::kForwardBackward:
      linear_cross_entropy_forward_backward(h, w, in.bv(dev), t, in.cwv(dev), o, loss.view(dev), lse.view(dev), gxv,
                                            gwv, gbv, up.view(dev), ws.ws(), nullptr);
      break;
    case Entry::kBackward:
      linear_cross_entropy_backward(h, w, in.bv(dev), t, in.cwv(dev), lse.view(dev), up.view(dev), o, gxv, gwv, gbv,
                                    ws.ws(), nullptr);
      break;
  }
  if (dev) {
    device_synchronize();
    for (TestTensor* x : {&loss, &lse, &gx, &gw, &gb}) x->to_host();
  }
  Outputs out;
  auto doubles = [](const TestTensor& x) {
    const std::vector<float> f = x.gather_float();
    return std::vector<double>(f.begin(), f.end());
  };
  if (e != Entry::kBackward) {
    out.loss = doubles(loss);
    out.lse = doubles(lse);
  }
  if (e != Entry::kForward) {
    out.dx = doubles(gx);
    out.dw = doubles(gw);
    if (in.has_bias()) out.db = doubles(gb);
  }
  return out;
}

std::vector<double> upstream_for(const LceInputs& in, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(0.5, 1.5);
  std::vector<double> up(in.opt.reduction == Reduction::kNone ? std::max<int64_t>(in.c.n, 0) : 1);
  for (auto& v : up) v = static_cast<float>(u(rng));  // float32-exact
  if (up.empty()) up.push_back(1.0);                  // reduction none over no tokens: a [0] tensor (not read)
  return up;
}

// 1/denominator for mean, 1 for sum: the natural size of a reduced loss's terms.
double loss_unit(const LceInputs& in) {
  if (in.opt.reduction != Reduction::kMean) return 1.0;
  double denom = 0;
  for (int64_t i = 0; i < in.c.n; ++i) {
    const int64_t t = in.target.get_index(i);
    if (t != in.opt.ignore_index && t >= 0 && t < in.c.v) denom += in.has_class_weight() ? in.class_weight.get(t) : 1.0;
  }
  return denom > 0 ? 1.0 / denom : 1.0;
}

void expect_outputs(const LceInputs& in, Entry e, const Outputs& got, const Outputs& want, const std::string& who,
                    DType grad_dtype) {
  const std::string tag = who + " " + entry_name(e);
  if (e != Entry::kBackward) {
    // A reduced loss sums rows whose float32 rounding error scales with their lse (lse - x_t cancels).
    double loss_scale = std::max(1.0, max_abs(want.loss));
    if (in.opt.reduction != Reduction::kNone) {
      double acc = 0;
      for (double l : want.lse)
        if (std::isfinite(l)) acc += std::abs(l);
      loss_scale = std::max(loss_scale, acc * loss_unit(in));
    }
    EXPECT_TRUE(all_close(got.loss, want.loss, tolerance(in.c.dtype, Quantity::kLoss), loss_scale, tag + " loss"));
    EXPECT_TRUE(all_close(got.lse, want.lse, tolerance(in.c.dtype, Quantity::kLse), std::max(1.0, max_abs(want.lse)),
                          tag + " lse"));
  }
  if (e != Entry::kForward) {
    const Tol tol = tolerance(grad_dtype, Quantity::kLceGrad);
    EXPECT_TRUE(grad_close(got.dx, want.dx, tol, tag + " grad_hidden"));
    EXPECT_TRUE(grad_close(got.dw, want.dw, tol, tag + " grad_weight"));
    if (in.has_bias()) EXPECT_TRUE(grad_close(got.db, want.db, tol, tag + " grad_bias"));
  }
}

// ---- the case lists ------------------------------------------------------------------------------------
std::vector<LceCase> make_cpu_cases() {
  std::vector<LceCase> cases;
  const DType dts[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};
  struct Shape {
    int64_t n, h, v;
  };
  // N=0 and N=1, V=1 and odd V and H, H=1; every preset at one shape per dtype.
  const Shape shapes[] = {{0, 8, 11}, {1, 5, 1}, {1, 16, 37}, {7, 1, 13}, {7, 33, 101}, {24, 48, 1000}};
  for (DType dt : dts) {
    for (const Shape& s : shapes) {
      cases.push_back({s.n, s.h, s.v, dt, Layout::kContiguous, Preset::kPlain, Reduction::kMean, false});
      cases.push_back({s.n, s.h, s.v, dt, Layout::kPadded, Preset::kIgnore, Reduction::kSum, true});
      cases.push_back({s.n, s.h, s.v, dt, Layout::kShifted, Preset::kAll, Reduction::kNone, true});
    }
    for (Preset p : {Preset::kSmoothing, Preset::kWeights, Preset::kZLoss, Preset::kSoftcap, Preset::kAll,
                     Preset::kAllIgnored, Preset::kBadTargetNoCheck})
      for (Reduction r : {Reduction::kMean, Reduction::kNone})
        cases.push_back({12, 20, 53, dt, Layout::kContiguous, p, r, p == Preset::kAll});
  }
  return cases;
}

std::vector<LceCase> make_cuda_cases() {
  std::vector<LceCase> cases;
  const DType dts[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};
  struct Shape {
    int64_t n, h, v;
  };
  // The CPU oracle (double sums) bounds the sizes: at most ~1e9 multiply-adds per product.
  const Shape shapes[] = {{0, 64, 1000},     {1, 64, 32003},    {7, 33, 1000},    {333, 96, 7777},
                          {256, 128, 32003}, {64, 128, 128256}, {1024, 256, 4099}};
  for (DType dt : dts) {
    for (const Shape& s : shapes) {
      cases.push_back({s.n, s.h, s.v, dt, Layout::kContiguous, Preset::kPlain, Reduction::kMean, false});
      cases.push_back({s.n, s.h, s.v, dt, Layout::kShifted, Preset::kAll, Reduction::kNone, true});
      if (s.n * s.v > 2e7 && dt != DType::kBFloat16) continue;
      cases.push_back({s.n, s.h, s.v, dt, Layout::kPadded, Preset::kIgnore, Reduction::kSum, true});
      cases.push_back({s.n, s.h, s.v, dt, Layout::kContiguous, Preset::kSmoothing, Reduction::kMean, false});
      cases.push_back({s.n, s.h, s.v, dt, Layout::kContiguous, Preset::kWeights, Reduction::kMean, true});
      cases.push_back({s.n, s.h, s.v, dt, Layout::kShifted, Preset::kSoftcap, Reduction::kSum, false});
      cases.push_back({s.n, s.h, s.v, dt, Layout::kContiguous, Preset::kZLoss, Reduction::kNone, false});
    }
    for (Preset p : {Preset::kAllIgnored, Preset::kBadTargetNoCheck})
      cases.push_back({96, 40, 1001, dt, Layout::kContiguous, p, Reduction::kMean, true});
    cases.push_back({200, 64, 3001, dt, Layout::kContiguous, Preset::kWide, Reduction::kMean, false});
  }
  return cases;
}

uint64_t seed_of(const LceCase& c) { return std::hash<std::string>{}(case_name(c)); }
std::string param_name(const ::testing::TestParamInfo<LceCase>& info) { return case_name(info.param); }

class LinearCrossEntropyCpu : public ::testing::TestWithParam<LceCase> {};
class LinearCrossEntropyCuda : public ::testing::TestWithParam<LceCase> {};

TEST_P(LinearCrossEntropyCpu, MatchesFloat64Reference) {
  LceInputs in(GetParam(), seed_of(GetParam()));
  const auto up = upstream_for(in, seed_of(GetParam()) + 1);
  const Outputs want = reference(in, up);
  for (Entry e : {Entry::kForward, Entry::kForwardBackward, Entry::kBackward}) {
    SCOPED_TRACE(entry_name(e));
    const Outputs got = run_backend(in, e, /*dev=*/false, up, &want.lse);
    expect_outputs(in, e, got, want, "cpu", in.c.dtype);
  }
}

TEST_P(LinearCrossEntropyCuda, MatchesCpuBackend) {
  LOGITLESS_SKIP_WITHOUT_GPU();
  LceInputs in(GetParam(), seed_of(GetParam()));
  const auto up = upstream_for(in, seed_of(GetParam()) + 1);
  // One CPU run is the expectation of every entry point and chunking: the forward's loss and lse, the
  // gradients with the same upstream factor (the backward gets the CPU's lse and that factor as grad_loss).
  const Outputs want = run_backend(in, Entry::kForwardBackward, false, up, nullptr);
  for (Chunking ch : {Chunking::kDefault, Chunking::kSmall, Chunking::kBudget}) {
    SCOPED_TRACE(chunking_name(ch));
    for (Entry e : {Entry::kForward, Entry::kForwardBackward, Entry::kBackward}) {
      SCOPED_TRACE(entry_name(e));
      const Outputs got = run_backend(in, e, /*dev=*/true, up, &want.lse, ch);
      expect_outputs(in, e, got, want, "cuda", in.c.dtype);
    }
  }
}

#if defined(LOGITLESS_WITH_CUDA)
// The generic path (cuBLAS and the row kernels) where the fused Hopper kernels would otherwise run: the path of
// every other GPU, kept tested on Hopper too. On other GPUs this repeats MatchesCpuBackend.
TEST_P(LinearCrossEntropyCuda, GenericPathMatchesCpuBackend) {
  LOGITLESS_SKIP_WITHOUT_GPU();
  LceInputs in(GetParam(), seed_of(GetParam()));
  const auto up = upstream_for(in, seed_of(GetParam()) + 1);
  const Outputs want = run_backend(in, Entry::kForwardBackward, false, up, nullptr);
  lce::debug::set_fused_kernels(false);
  for (Entry e : {Entry::kForward, Entry::kForwardBackward, Entry::kBackward}) {
    SCOPED_TRACE(entry_name(e));
    const Outputs got = run_backend(in, e, /*dev=*/true, up, &want.lse);
    EXPECT_EQ(lce::debug::last_kernel.get(), lce::Kernel::kCublasChunked);
    expect_outputs(in, e, got, want, "cuda generic", in.c.dtype);
  }
  lce::debug::set_fused_kernels(true);
}

// The generic gradient in forward (the exponential form switched off; MatchesCpuBackend covers the default) against
// the CPU backend with the suite's tolerances.
TEST_P(LinearCrossEntropyCuda, GenericGradientInForwardMatchesCpuBackend) {
  LOGITLESS_SKIP_WITHOUT_GPU();
  LceInputs in(GetParam(), seed_of(GetParam()));
  const auto up = upstream_for(in, seed_of(GetParam()) + 1);
  const Outputs want = run_backend(in, Entry::kForwardBackward, false, up, nullptr);
  lce::debug::set_exp_form(false);
  for (Chunking ch : {Chunking::kDefault, Chunking::kSmall}) {
    SCOPED_TRACE(chunking_name(ch));
    const Outputs got = run_backend(in, Entry::kForwardBackward, /*dev=*/true, up, &want.lse, ch);
    expect_outputs(in, Entry::kForwardBackward, got, want, "cuda generic gradient in forward", in.c.dtype);
  }
  lce::debug::set_exp_form(true);
}

// Where the fused Hopper kernels run: an sm_90 device 0 and a build that has them (it found the CUTLASS headers).
bool fused_kernels_run() {
  int major = 0, minor = 0;
  EXPECT_EQ(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0), cudaSuccess);
  EXPECT_EQ(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0), cudaSuccess);
  return major == 9 && minor == 0 && lce::debug::fused_kernels_built();
}

// The Hopper accumulating grad_weight product (linear_head/cuda/accumulate_gemm.h): d += aᵀ b against float64 sums
// of the same bf16 values, on row-padded operands whose m is no multiple of the tile, on the head's tiling and the
// tail's, in place and into a bfloat16 out (d then only read); it runs on an sm_90 device of a build with CUTLASS,
// and declines (leaving d alone) a row stride that is no multiple of 8 elements, a k of kCublasAccumulatesFrom or
// more (with out: more than kWritesOutUpTo).
TEST(LinearHeadAccumulateGemm, AddsTheProductOnHopper) {
  LOGITLESS_SKIP_WITHOUT_GPU();
  const bool runs = fused_kernels_run();
  struct Shape {
    int64_t m, n, k;
  };
  // Padded row strides; m and n no multiples of the 128 x 128 tile (an odd tile count along m: the cluster of two
  // hangs over the edge), k no multiple of 64; the last shape is smaller than one tile in every dimension (a token
  // group of 8 rows).
  for (const Shape& s : {Shape{1000, 264, 200}, Shape{1064, 520, 200}, Shape{56, 40, 8}}) {
    const int64_t M = s.m, N = s.n, K = s.k, lda = M + 8, ldb = N + 8, ldd = N + 4, ldo = N + 8;
    TestTensor a(DType::kBFloat16, {K, M}, {lda, 1}), b(DType::kBFloat16, {K, N}, {ldb, 1});
    a.fill_normal(1, 1.f);
    b.fill_normal(2, 1.f);
    const std::vector<float> av = a.gather_float(), bv = b.gather_float();
    a.to_device();
    b.to_device();
    for (const bool tail : {false, true})
      for (const bool to_out : {false, true}) {
        SCOPED_TRACE(::testing::Message() << "m=" << M << " n=" << N << " k=" << K << (tail ? ", tail" : "")
                                          << (to_out ? ", bf16 out" : ""));
        TestTensor d(DType::kFloat32, {M, N}, {ldd, 1}), out(DType::kBFloat16, {M, N}, {ldo, 1});
        d.fill_normal(3, 4.f);
        out.fill_storage_nan();
        const std::vector<float> before = d.gather_float();
        std::vector<double> want(before.begin(), before.end());
        for (int64_t k = 0; k < K; ++k)
          for (int64_t i = 0; i < M; ++i)
            for (int64_t j = 0; j < N; ++j)
              want[static_cast<size_t>(i * N + j)] +=
                  static_cast<double>(av[static_cast<size_t>(k * M + i)]) * bv[static_cast<size_t>(k * N + j)];
        d.to_device();
        out.to_device();
        const TensorView avw = a.view(true), bvw = b.view(true), dvw = d.view(true), ovw = out.view(true);
        head::AccumulateGemm g{
            DType::kBFloat16, M, N, K, avw.data, lda, bvw.data, ldb, static_cast<float*>(dvw.data), ldd};
        g.tail = g.any_k = tail;
        if (to_out) {
          g.out = ovw.data;
          g.ldo = ldo;
        }
        head::AccumulateGemm misaligned = g, long_k = g;
        misaligned.lda = lda - 1;
        EXPECT_FALSE(head::launch_accumulate_gemm(misaligned, 0, 1, nullptr));
        if (!tail) {  // cuBLAS's from there on (reads no operand: declined before)
          long_k.k = to_out ? head::kWritesOutUpTo + 1 : head::kCublasAccumulatesFrom;
          EXPECT_FALSE(head::launch_accumulate_gemm(long_k, 0, 132, nullptr));
        }
        ASSERT_EQ(head::launch_accumulate_gemm(g, 0, 132, nullptr), runs);
        device_synchronize();
        d.to_host();
        out.to_host();
        const std::vector<float> got = d.gather_float();
        if (!runs || to_out) EXPECT_EQ(got, before);
        if (!runs) continue;
        if (!to_out) {
          EXPECT_TRUE(all_close(std::vector<double>(got.begin(), got.end()), want, Tol{1e-5, 1e-5}, 16.0, "d"));
          continue;
        }
        // The sum rounded once to bfloat16: within half a unit in its last place (2^-9 relative), and float32's
        // error beside it.
        const std::vector<float> o = out.gather_float();
        EXPECT_TRUE(
            all_close(std::vector<double>(o.begin(), o.end()), want, Tol{std::ldexp(1.0, -8), 1e-5}, 16.0, "out"));
      }
  }
}

// finish_rows reads 4-float records (the forward's) or 2-float ones with the target logits given apart (the
// exponential form's, plan.h): any other record size, or pairs without target logits, is refused before a launch,
// so no device is needed.
TEST(LinearCrossEntropyFinishRows, RefusesARecordItCannotRead) {
  const ce::KernelParams params{};
  float target_logit = 0.f;
  const auto refused = [&](int floats, const float* logits) {
    try {
      lce::launch_finish_rows(nullptr, floats, 1, 1, nullptr, logits, params, nullptr, nullptr, nullptr, nullptr, 1,
                              nullptr);
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), Error::Kind::kInvalidArgument) << e.what();
      return std::string(e.what()).find("records of 4 floats") != std::string::npos;
    }
    return false;
  };
  EXPECT_TRUE(refused(lce::kExpStatsFloats, nullptr));
  EXPECT_TRUE(refused(3, &target_logit));
  EXPECT_TRUE(refused(0, nullptr));
}

// Which kernel the 16-bit cases ran: the fused one in the forward and the backward on an sm_90 device when the
// build has it and the shapes allow (H a multiple of 8: TMA row strides), so MatchesCpuBackend covers it there.
TEST(LinearCrossEntropyCudaFused, RunsOnHopperFor16BitInputs) {
  LOGITLESS_SKIP_WITHOUT_GPU();
  const bool hopper = fused_kernels_run();
  for (const LceCase c :
       {LceCase{64, 128, 1000, DType::kBFloat16, Layout::kContiguous, Preset::kPlain, Reduction::kMean, false},
        LceCase{7, 33, 1000, DType::kBFloat16, Layout::kContiguous, Preset::kPlain, Reduction::kMean, false},
        LceCase{64, 128, 1000, DType::kFloat32, Layout::kContiguous, Preset::kPlain, Reduction::kMean, false}}) {
    SCOPED_TRACE(case_name(c));
    LceInputs in(c, seed_of(c));
    const auto up = upstream_for(in, seed_of(c) + 1);
    const bool fused = hopper && c.dtype == DType::kBFloat16 && c.h % 8 == 0;
    for (Entry e : {Entry::kForward, Entry::kForwardBackward, Entry::kBackward}) {
      SCOPED_TRACE(entry_name(e));
      run_backend(in, e, /*dev=*/true, up, nullptr);
      EXPECT_EQ(lce::debug::last_kernel.get(), fused ? lce::Kernel::kHopperFused : lce::Kernel::kCublasChunked);
    }
    // With the exponential form off, the gradient in forward is generic.
    lce::debug::set_exp_form(false);
    run_backend(in, Entry::kForwardBackward, /*dev=*/true, up, nullptr);
    EXPECT_EQ(lce::debug::last_kernel.get(), lce::Kernel::kCublasChunked);
    lce::debug::set_exp_form(true);
  }
}

// The fused gradient in forward's row rewrite (exp_fixup), which real inputs reach only for rows far from the usual
// range (the kWide cases above): every valid row through it, against the CPU backend, for the options the
// exponential form takes (class weights, z-loss, ignored and bad rows, bias, per-token upstream factors), with
// one group and with several (a float32 grad_weight accumulator).
TEST(LinearCrossEntropyCudaFused, RewrittenRowsMatchCpuBackend) {
  LOGITLESS_SKIP_WITHOUT_GPU();
  const LceCase cases[] = {
      {333, 96, 7777, DType::kBFloat16, Layout::kContiguous, Preset::kPlain, Reduction::kMean, false},
      {333, 96, 7777, DType::kBFloat16, Layout::kPadded, Preset::kIgnore, Reduction::kSum, true},
      {256, 128, 4099, DType::kBFloat16, Layout::kContiguous, Preset::kWeights, Reduction::kMean, true},
      {256, 128, 4099, DType::kBFloat16, Layout::kShifted, Preset::kZLoss, Reduction::kNone, false},
      {96, 40, 1001, DType::kBFloat16, Layout::kContiguous, Preset::kBadTargetNoCheck, Reduction::kMean, true},
      {200, 64, 3001, DType::kBFloat16, Layout::kContiguous, Preset::kWide, Reduction::kMean, false}};
  for (const LceCase& c : cases) {
    SCOPED_TRACE(case_name(c));
    LceInputs in(c, seed_of(c));
    const auto up = upstream_for(in, seed_of(c) + 1);
    const Outputs want = run_backend(in, Entry::kForwardBackward, false, up, nullptr);
    lce::debug::set_exp_fixup_all(true);
    for (Chunking ch : {Chunking::kDefault, Chunking::kSmall}) {
      SCOPED_TRACE(chunking_name(ch));
      const Outputs got = run_backend(in, Entry::kForwardBackward, /*dev=*/true, up, &want.lse, ch);
      expect_outputs(in, Entry::kForwardBackward, got, want, "cuda rewritten rows", in.c.dtype);
    }
    lce::debug::set_exp_fixup_all(false);
  }
}

// The gradient in forward on each schedule of the fused exponentials (common/debug_hooks.h, kLceFusedPingPong: 0
// cooperative, the default, 1 ping-pong; test_lce_fused_pingpong.cpp compares the kernels, row statistics'
// included, to the bit) against the CPU backend; the hook as it was afterwards.
TEST(LinearCrossEntropyCudaFusedPingPong, GradientInForwardMatchesCpuBackend) {
  LOGITLESS_SKIP_WITHOUT_GPU();
  using logitless::debug::Hook;
  const int64_t before = logitless::debug::hook(Hook::kLceFusedPingPong);
  const LceCase cases[] = {
      {333, 96, 7777, DType::kBFloat16, Layout::kContiguous, Preset::kPlain, Reduction::kMean, false},
      {256, 128, 4099, DType::kBFloat16, Layout::kPadded, Preset::kIgnore, Reduction::kSum, true}};
  for (const int64_t schedule : {0, 1}) {
    SCOPED_TRACE(schedule == 0 ? "cooperative" : "ping-pong");
    logitless::debug::set_hook(Hook::kLceFusedPingPong, schedule);
    for (const LceCase& c : cases) {
      SCOPED_TRACE(case_name(c));
      LceInputs in(c, seed_of(c));
      const auto up = upstream_for(in, seed_of(c) + 1);
      const Outputs want = run_backend(in, Entry::kForwardBackward, false, up, nullptr);
      for (Chunking ch : {Chunking::kDefault, Chunking::kSmall}) {
        SCOPED_TRACE(chunking_name(ch));
        const Outputs got = run_backend(in, Entry::kForwardBackward, /*dev=*/true, up, &want.lse, ch);
        expect_outputs(in, Entry::kForwardBackward, got, want, "cuda fused", in.c.dtype);
      }
    }
  }
  logitless::debug::set_hook(Hook::kLceFusedPingPong, before);
}

// GradWeightAccumulation::kWeightDtype on the GPU (several token groups summing in the 16-bit grad_weight: explicit
// chunks, a small budget; one group by default) against the CPU backend, which rounds its running sum at the same
// groups: the generic path, the fused exponential form where the device has it, and the recompute backward (where
// the option does nothing).
TEST(LinearCrossEntropyCuda, WeightDtypeAccumulationMatchesCpuBackend) {
  LOGITLESS_SKIP_WITHOUT_GPU();
  const LceCase cases[] = {
      {333, 96, 7777, DType::kBFloat16, Layout::kContiguous, Preset::kPlain, Reduction::kMean, false},
      {256, 128, 4099, DType::kFloat16, Layout::kPadded, Preset::kIgnore, Reduction::kSum, true},
      {1024, 256, 4099, DType::kBFloat16, Layout::kShifted, Preset::kZLoss, Reduction::kMean, false},
      {200, 64, 3001, DType::kBFloat16, Layout::kContiguous, Preset::kAll, Reduction::kNone, true}};
  for (const LceCase& c : cases) {
    SCOPED_TRACE(case_name(c));
    LceInputs in(c, seed_of(c));
    in.opt.grad_weight_accumulation = GradWeightAccumulation::kWeightDtype;
    const auto up = upstream_for(in, seed_of(c) + 1);
    for (Chunking ch : {Chunking::kDefault, Chunking::kSmall, Chunking::kBudget}) {
      SCOPED_TRACE(chunking_name(ch));
      const Outputs want = run_backend(in, Entry::kForwardBackward, false, up, nullptr, ch);
      for (bool exp_form : {false, true}) {
        lce::debug::set_exp_form(exp_form);
        const Outputs got = run_backend(in, Entry::kForwardBackward, /*dev=*/true, up, &want.lse, ch);
        expect_outputs(in, Entry::kForwardBackward, got, want, exp_form ? "cuda exponential form" : "cuda", c.dtype);
        lce::debug::set_exp_form(false);
      }
      const Outputs back = run_backend(in, Entry::kBackward, /*dev=*/true, up, &want.lse, ch);
      expect_outputs(in, Entry::kBackward, back, run_backend(in, Entry::kBackward, false, up, &want.lse, ch), "cuda",
                     c.dtype);
    }
  }
  lce::debug::set_exp_form(true);  // the default, which the tests after this one in the process expect
}
#endif

INSTANTIATE_TEST_SUITE_P(Shapes, LinearCrossEntropyCpu, ::testing::ValuesIn(make_cpu_cases()), param_name);
INSTANTIATE_TEST_SUITE_P(Shapes, LinearCrossEntropyCuda, ::testing::ValuesIn(make_cuda_cases()), param_name);

// float32 gradient outputs for 16-bit inputs (e.g. float32 main gradients): summed into directly, no accumulator.
// Under the small budget the token groups grow within twice it (head::group_min_rows): the generic path's groups of
// 128 and 72 rows instead of 78-row ones, the exponential form's one group instead of two.
TEST(LinearCrossEntropy, Float32GradientsOf16BitInputs) {
  for (bool dev : {false, true}) {
    if (dev && !has_gpu()) continue;
    for (const LceCase& c :
         {LceCase{200, 64, 3001, DType::kBFloat16, Layout::kContiguous, Preset::kAll, Reduction::kMean, true},
          LceCase{200, 64, 3001, DType::kBFloat16, Layout::kContiguous, Preset::kPlain, Reduction::kMean, false}}) {
      LceInputs in(c, 17);
      const auto up = upstream_for(in, 18);
      const Outputs want = reference(in, up);
      for (Chunking ch : {Chunking::kDefault, Chunking::kSmall, Chunking::kBudget}) {
        for (Entry e : {Entry::kForwardBackward, Entry::kBackward}) {
          SCOPED_TRACE(std::string(dev ? "cuda " : "cpu ") + case_name(c) + " " + chunking_name(ch) + " " +
                       entry_name(e));
          const Outputs got = run_backend(in, e, dev, up, &want.lse, ch, GradDtypes{true});
          // The CUDA path still rounds the logits' gradient to bf16 before the GEMMs.
          expect_outputs(in, e, got, want, dev ? "cuda" : "cpu", dev ? DType::kBFloat16 : DType::kFloat32);
        }
      }
    }
  }
}

// The token groups of the CUDA generic plan for these options: where GradWeightAccumulation::kWeightDtype rounds
// grad_weight's running sum (the CPU backend rounds at the same rows).
int64_t planned_group_rows(const LceInputs& in, const LinearCrossEntropyOptions& o) {
  lce::PlanInputs p;
  p.pass = lce::Pass::kForwardBackward;
  p.n = in.c.n;
  p.h = in.c.h;
  p.v = in.c.v;
  p.elem_bytes = static_cast<int>(dtype_size(in.c.dtype));
  p.need_dx = p.need_dw = true;
  p.need_db = in.has_bias();
  p.dw_weight_dtype = true;
  p.chunk_tokens = o.chunk_tokens;
  p.memory_budget = o.memory_budget;
  return lce::plan_linear_cross_entropy(p).group_rows;
}

// grad_weight summed in its own 16-bit dtype against the float64 reference that rounds its running sum after each
// token group: the CPU's float32 gradient of the logits (the reference's is float64) may flip a rounding now and
// then, never by more than one unit in the last place of the largest element.
void expect_rounded_per_group(const std::vector<double>& got, const std::vector<double>& want, DType dt,
                              const std::string& what) {
  const double ulp = std::ldexp(1.0, std::ilogb(max_abs(want)) - (dt == DType::kBFloat16 ? 7 : 10));
  size_t same = 0;
  double worst = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    same += got[i] == want[i];
    worst = std::max(worst, std::abs(got[i] - want[i]));
  }
  EXPECT_GE(same, want.size() * 99 / 100) << what << ": elements equal to the per-group rounding";
  EXPECT_LE(worst, ulp) << what;
}

// GradWeightAccumulation::kWeightDtype on the CPU: with several token groups (explicit chunks, a small budget)
// grad_weight is the per-group rounding of its running sum, visibly not the float32 accumulation's; with one group
// it is that accumulation's result. Loss, lse, grad_hidden and grad_bias are bit-identical either way, and the
// recompute backward, float32 inputs and float32 gradient outputs are untouched.
TEST(LinearCrossEntropy, WeightDtypeAccumulationRoundsPerTokenGroup) {
  const auto with = [](LceInputs& in, GradWeightAccumulation a) { in.opt.grad_weight_accumulation = a; };
  for (DType dt : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
    LceInputs in(LceCase{200, 40, 301, dt, Layout::kPadded, Preset::kAll, Reduction::kMean, true}, 23);
    const auto up = upstream_for(in, 24);
    for (Chunking ch : {Chunking::kDefault, Chunking::kSmall, Chunking::kBudget}) {
      const std::string tag = std::string(dtype_tag(dt)) + " " + chunking_name(ch);
      SCOPED_TRACE(tag);
      with(in, GradWeightAccumulation::kFloat32);
      const Outputs f32 = run_backend(in, Entry::kForwardBackward, false, up, nullptr, ch);
      const Outputs f32_back = run_backend(in, Entry::kBackward, false, up, &f32.lse, ch);
      const Outputs f32_out = run_backend(in, Entry::kForwardBackward, false, up, nullptr, ch, GradDtypes{true});
      with(in, GradWeightAccumulation::kWeightDtype);
      const Outputs wd = run_backend(in, Entry::kForwardBackward, false, up, nullptr, ch);
      EXPECT_EQ(wd.loss, f32.loss);
      EXPECT_EQ(wd.lse, f32.lse);
      EXPECT_EQ(wd.dx, f32.dx);
      EXPECT_EQ(wd.db, f32.db);
      EXPECT_EQ(run_backend(in, Entry::kBackward, false, up, &f32.lse, ch).dw, f32_back.dw);
      EXPECT_EQ(run_backend(in, Entry::kForwardBackward, false, up, nullptr, ch, GradDtypes{true}).dw, f32_out.dw);
      const int64_t G = planned_group_rows(in, chunked(in, ch));
      EXPECT_EQ(G < in.c.n, ch != Chunking::kDefault);
      if (dt == DType::kFloat32 || G >= in.c.n) {
        EXPECT_EQ(wd.dw, f32.dw);
        continue;
      }
      expect_rounded_per_group(wd.dw, reference(in, up, G).dw, dt, tag);
      size_t changed = 0;
      for (size_t i = 0; i < wd.dw.size(); ++i) changed += wd.dw[i] != f32.dw[i];
      EXPECT_GE(changed, wd.dw.size() / 20) << "elements the per-group rounding changed";
    }
  }
}

// Issue 19: with class weights, z-loss and reduction mean, the z-loss terms are divided by the count of tokens not
// ignored and the rest by their summed class weights, so scaling every class weight by 10 leaves the loss and the
// gradients as they were: against the float64 reference in every schedule and chunking, on the CPU and on the GPU's
// paths (fused where the GPU has it, generic, and the gradient in forward's exponential form).
TEST(LinearCrossEntropy, ZLossOfAWeightedMeanIsOverTheTokenCount) {
  LOGITLESS_TRACE_SEED();
  const uint64_t seed = fresh_seed();
  struct Path {
    bool dev, fused, exp_form;
    const char* name;
  };
  const Path paths[] = {{false, true, true, "cpu"},
                        {true, true, true, "cuda"},
                        {true, false, false, "cuda generic"},
                        {true, true, false, "cuda without the exponential form"}};
  for (const Path& path : paths) {
    if (path.dev && !has_gpu()) continue;
    SCOPED_TRACE(path.name);
    LceCase c{45, 32, 301, DType::kBFloat16, Layout::kContiguous, Preset::kWeights, Reduction::kMean, true};
    LceInputs in(c, seed);
    in.opt.z_loss = 0.05;
    const auto up = upstream_for(in, seed + 1);
    const Outputs want = reference(in, up);
#if defined(LOGITLESS_WITH_CUDA)
    lce::debug::set_fused_kernels(path.fused);
    lce::debug::set_exp_form(path.exp_form);
#endif
    for (Chunking ch : {Chunking::kDefault, Chunking::kSmall}) {
      for (Entry e : {Entry::kForward, Entry::kForwardBackward, Entry::kBackward}) {
        if (!path.exp_form && path.fused && e != Entry::kForwardBackward) continue;
        SCOPED_TRACE(std::string(chunking_name(ch)) + " " + entry_name(e));
        const Outputs got = run_backend(in, e, path.dev, up, &want.lse, ch);
        expect_outputs(in, e, got, want, path.name, in.c.dtype);
      }
    }
    for (int64_t j = 0; j < c.v; ++j) in.class_weight.set(j, 10.f * in.class_weight.get(j));
    const Outputs scaled = run_backend(in, Entry::kForwardBackward, path.dev, up, nullptr);
    expect_outputs(in, Entry::kForwardBackward, scaled, want, std::string(path.name) + " weights x 10", in.c.dtype);
#if defined(LOGITLESS_WITH_CUDA)
    lce::debug::set_fused_kernels(true);
    lce::debug::set_exp_form(true);
#endif
  }
}

// A float32 bias beside 16-bit hidden states and weights.
TEST(LinearCrossEntropy, Float32Bias) {
  for (bool dev : {false, true}) {
    if (dev && !has_gpu()) continue;
    LceCase c{50, 24, 301, DType::kBFloat16, Layout::kContiguous, Preset::kPlain, Reduction::kSum, true};
    LceInputs in(c, 23);
    TestTensor b32(DType::kFloat32, {c.v});
    b32.fill_normal(24, 0.5f);
    in.bias = std::move(b32);
    const auto up = upstream_for(in, 25);
    const Outputs want = reference(in, up);
    for (Entry e : {Entry::kForward, Entry::kForwardBackward, Entry::kBackward}) {
      SCOPED_TRACE(std::string(dev ? "cuda " : "cpu ") + entry_name(e));
      // grad_bias comes in bias's dtype: run_backend allocates the inputs' dtype, so compare through floats.
      const Outputs got = run_backend(in, e, dev, up, &want.lse, Chunking::kDefault, GradDtypes{true});
      expect_outputs(in, e, got, want, dev ? "cuda" : "cpu", dev ? DType::kBFloat16 : DType::kFloat32);
    }
  }
}

// Classes masked by a bias of -inf, some of them targets: those rows' loss is +inf and their gradient finite (the
// target's probability is 0). The fused gradient in forward divides by exp(the target's logit) and must rewrite
// such rows instead.
TEST(LinearCrossEntropy, ClassesMaskedByBias) {
  for (bool dev : {false, true}) {
    if (dev && !has_gpu()) continue;
    for (Reduction red : {Reduction::kNone, Reduction::kMean}) {
      LceCase c{200, 64, 3001, DType::kBFloat16, Layout::kContiguous, Preset::kPlain, red, true};
      LceInputs in(c, 41);
      for (int64_t j = 0; j < c.v; j += 7) in.bias.set(j, -INFINITY);
      for (int64_t i = 0; i < c.n; i += 5) in.target.set_index(i, (i * 7) % c.v / 7 * 7);
      const auto up = upstream_for(in, 42);
      const Outputs want = reference(in, up);
      for (Entry e : {Entry::kForward, Entry::kForwardBackward, Entry::kBackward}) {
        SCOPED_TRACE(std::string(dev ? "cuda " : "cpu ") + reduction_name(red) + " " + entry_name(e));
        if (e != Entry::kBackward) {
          ASSERT_TRUE(std::isinf(want.loss[0])) << "the case must have a masked target";
        }
        const Outputs got = run_backend(in, e, dev, up, &want.lse);
        expect_outputs(in, e, got, want, dev ? "cuda" : "cpu", in.c.dtype);
      }
    }
  }
}

// Hidden states broadcast over tokens (a stride-0 leading dimension, which no GEMM can take): copied first.
TEST(LinearCrossEntropy, BroadcastHiddenRows) {
  for (bool dev : {false, true}) {
    if (dev && !has_gpu()) continue;
    LceCase c{9, 16, 40, DType::kFloat32, Layout::kContiguous, Preset::kPlain, Reduction::kMean, false};
    LceInputs in(c, 31);
    TestTensor row(DType::kFloat32, {c.n, c.h}, {0, 1});
    row.fill_normal(32, 1.f);
    in.hidden = std::move(row);
    const auto up = upstream_for(in, 33);
    const Outputs want = reference(in, up);
    for (Entry e : {Entry::kForward, Entry::kForwardBackward, Entry::kBackward}) {
      SCOPED_TRACE(std::string(dev ? "cuda " : "cpu ") + entry_name(e));
      const Outputs got = run_backend(in, e, dev, up, &want.lse);
      expect_outputs(in, e, got, want, dev ? "cuda" : "cpu", DType::kFloat32);
    }
  }
}

// Bit equality of two runs' outputs, and every element finite: two NaN results would be equal bits of a broken
// run (and EXPECT_EQ on NaNs fails however the bits compare), so a NaN-producing regression must fail here.
::testing::AssertionResult same_finite_bits(const std::vector<double>& a, const std::vector<double>& b,
                                            const std::string& what) {
  if (a.size() != b.size())
    return ::testing::AssertionFailure() << what << ": " << a.size() << " vs " << b.size() << " elements";
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i]) || !std::isfinite(b[i]))
      return ::testing::AssertionFailure()
             << what << "[" << i << "]: " << a[i] << " and " << b[i] << " (expected finite)";
    // The values are floats widened exactly to double: equal double bits are equal float bits (-0 != +0).
    if (std::memcmp(&a[i], &b[i], sizeof(double)) != 0)
      return ::testing::AssertionFailure() << what << "[" << i << "]: " << std::hexfloat << a[i] << " vs " << b[i];
  }
  return ::testing::AssertionSuccess();
}

void expect_same_finite_bits(const Outputs& a, const Outputs& b, const std::string& what) {
  EXPECT_TRUE(same_finite_bits(a.loss, b.loss, what + " loss"));
  EXPECT_TRUE(same_finite_bits(a.lse, b.lse, what + " lse"));
  EXPECT_TRUE(same_finite_bits(a.dx, b.dx, what + " grad_hidden"));
  EXPECT_TRUE(same_finite_bits(a.dw, b.dw, what + " grad_weight"));
  EXPECT_TRUE(same_finite_bits(a.db, b.db, what + " grad_bias"));
}

#if defined(LOGITLESS_WITH_CUDA)
// bfloat16 cases of the fused gradient in forward over several token groups, whose scratch can lie in grad_weight's
// storage: plain mean, shifted rows with class weights and sum, z-loss with per-token losses.
constexpr LceCase kScratchCases[] = {
    {333, 96, 7777, DType::kBFloat16, Layout::kContiguous, Preset::kPlain, Reduction::kMean, false},
    {256, 128, 4099, DType::kBFloat16, Layout::kShifted, Preset::kWeights, Reduction::kSum, false},
    {200, 64, 3001, DType::kBFloat16, Layout::kContiguous, Preset::kZLoss, Reduction::kNone, false}};

// The gradient in forward over several token groups keeps the float32 accumulator's last rows and (fused, with the
// last group's products not writing grad_weight: the hook off) its per-group regions in grad_weight's storage when
// grad_weight's rows are contiguous, in the workspace when they are padded (plan.h, Plan::dw_tail_rows and
// exp_in_grad_weight): the same groups (explicit chunk_tokens) give the same bits either way, and both match the CPU
// backend.
TEST(LinearCrossEntropyCudaFused, RegionsInGradWeightMatchRegionsInWorkspace) {
  LOGITLESS_SKIP_WITHOUT_GPU();
  const bool fused = fused_kernels_run();
  logitless::debug::set_hook(logitless::debug::Hook::kLceDwWritten, 0);
  std::vector<LceCase> cases(std::begin(kScratchCases), std::end(kScratchCases));
  // the generic gradient in forward (soft cap, smoothing, bias): the accumulator's tail alone
  cases.push_back({200, 64, 3001, DType::kBFloat16, Layout::kContiguous, Preset::kAll, Reduction::kMean, true});
  for (const LceCase& c : cases) {
    SCOPED_TRACE(case_name(c));
    LceInputs in(c, seed_of(c));
    in.opt.chunk_tokens = 64;
    const auto up = upstream_for(in, seed_of(c) + 1);
    const Outputs want = run_backend(in, Entry::kForwardBackward, false, up, nullptr);
    const Outputs in_gw = run_backend(in, Entry::kForwardBackward, true, up, nullptr);
    EXPECT_EQ(lce::debug::last_exp_in_grad_weight.get(), fused && c.preset != Preset::kAll);
    // The accumulator's last rows too (plan.h, Plan::dw_tail_rows), on every GPU: whole 128-row tiles before them.
    const int64_t tail = lce::debug::last_dw_tail_rows.get();
    EXPECT_GT(tail, 0);
    EXPECT_EQ((c.v - tail) % 128, 0);
    GradDtypes padded;
    padded.dw_pad = 8;
    const Outputs in_ws = run_backend(in, Entry::kForwardBackward, true, up, nullptr, Chunking::kDefault, padded);
    EXPECT_FALSE(lce::debug::last_exp_in_grad_weight.get());
    EXPECT_EQ(lce::debug::last_dw_tail_rows.get(), 0);
    expect_outputs(in, Entry::kForwardBackward, in_gw, want, "regions in grad_weight", c.dtype);
    expect_same_finite_bits(in_gw, in_ws, "regions in grad_weight against the workspace");
  }
  logitless::debug::set_hook(logitless::debug::Hook::kLceDwWritten, 1);
}

// Two bfloat16 results of float32 sums taken in different orders, both finite: at most one rounding step apart
// (2^-7 of the larger), or, where the sum cancels to near zero, within float32's rounding of the largest
// magnitude (2^-20 of it).
::testing::AssertionResult within_one_bf16_step(const std::vector<double>& a, const std::vector<double>& b,
                                                const std::string& what) {
  if (a.size() != b.size())
    return ::testing::AssertionFailure() << what << ": " << a.size() << " vs " << b.size() << " elements";
  double largest = 0;
  for (const double x : a) largest = std::max(largest, std::fabs(x));
  for (size_t i = 0; i < a.size(); ++i)
    if (!std::isfinite(a[i]) || !std::isfinite(b[i]) ||
        std::fabs(a[i] - b[i]) > std::ldexp(std::max(std::fabs(a[i]), std::fabs(b[i])), -7) + std::ldexp(largest, -20))
      return ::testing::AssertionFailure()
             << what << "[" << i << "]: " << a[i] << " vs " << b[i] << " (largest " << largest << ")";
  return ::testing::AssertionSuccess();
}

// The last token group's grad_weight products write grad_weight themselves (plan.h, Plan::dw_written_rows): every
// row, the tail's and the head's, with the fused path's regions beside the budget. Against the float32 sums cast
// after the products (the hook off, which puts those regions in grad_weight's storage): the same loss, lse and
// grad_hidden bits; grad_weight's last sums add the fused path's target terms before the products instead of after
// them, and the products may run on other kernels, so within a bfloat16 rounding step. And the CPU backend's values.
TEST(LinearCrossEntropyCudaFused, LastGroupWritesGradWeight) {
  LOGITLESS_SKIP_WITHOUT_GPU();
  const bool fused = fused_kernels_run();
  std::vector<LceCase> cases(std::begin(kScratchCases), std::end(kScratchCases));
  cases.push_back({200, 64, 3001, DType::kBFloat16, Layout::kContiguous, Preset::kAll, Reduction::kMean, true});
  cases.push_back({300, 64, 2048, DType::kFloat16, Layout::kContiguous, Preset::kPlain, Reduction::kMean, false});
  // Row counts in whole 8s (the tail's 1280, the head's 2816 or 4096): the Hopper kernel writes them.
  cases.push_back({300, 64, 4096, DType::kBFloat16, Layout::kContiguous, Preset::kPlain, Reduction::kMean, false});
  for (const LceCase& c : cases)
    for (const int pad : {0, 8}) {
      SCOPED_TRACE(case_name(c) + (pad ? ", padded grad_weight" : ""));
      LceInputs in(c, seed_of(c));
      in.opt.chunk_tokens = 64;
      const auto up = upstream_for(in, seed_of(c) + 1);
      GradDtypes dtypes;
      dtypes.dw_pad = pad;
      const Outputs want = run_backend(in, Entry::kForwardBackward, false, up, nullptr);
      logitless::debug::set_hook(logitless::debug::Hook::kLceDwWritten, 0);
      const Outputs cast = run_backend(in, Entry::kForwardBackward, true, up, nullptr, Chunking::kDefault, dtypes);
      EXPECT_EQ(lce::debug::last_dw_written_rows.get(), 0);
      EXPECT_EQ(lce::debug::last_exp_in_grad_weight.get(),
                fused && !pad && c.dtype == DType::kBFloat16 && c.preset != Preset::kAll);
      logitless::debug::set_hook(logitless::debug::Hook::kLceDwWritten, 1);
      const Outputs written = run_backend(in, Entry::kForwardBackward, true, up, nullptr, Chunking::kDefault, dtypes);
      const int64_t rows = lce::debug::last_dw_written_rows.get(), tail = lce::debug::last_dw_tail_rows.get();
      EXPECT_FALSE(lce::debug::last_exp_in_grad_weight.get());  // the fused path's regions beside the budget
      EXPECT_EQ(rows, c.v - tail);
      EXPECT_EQ(tail > 0, !pad);
      expect_outputs(in, Entry::kForwardBackward, written, want, "written by the last products", c.dtype);
      EXPECT_TRUE(same_finite_bits(written.loss, cast.loss, "loss"));
      EXPECT_TRUE(same_finite_bits(written.lse, cast.lse, "lse"));
      EXPECT_TRUE(same_finite_bits(written.dx, cast.dx, "grad_hidden"));
      EXPECT_TRUE(within_one_bf16_step(written.dw, cast.dw, "grad_weight"));
    }
}

// A budget small beside grad_weight: the fused gradient in forward keeps the group's exponentials in grad_weight's
// storage too, after a shorter accumulator tail (plan.h, Plan::dlogits_in_grad_weight), for fewer groups than the
// budget alone holds. Against those groups with every region in the workspace (grad_weight's rows padded): the same
// exponentials, so the same bits of loss, lse and grad_hidden; grad_weight's products split its rows elsewhere (no
// tail there), so other kernels may run them (cuBLAS's or the Hopper accumulating one, which takes row counts in
// whole 8s), summing these group lengths (not multiples of 16) in another order: within a bfloat16 rounding step.
// And the CPU backend's values.
TEST(LinearCrossEntropyCudaFused, ExponentialsInGradWeightMatchTheWorkspace) {
  LOGITLESS_SKIP_WITHOUT_GPU();
  const bool fused = fused_kernels_run();
  for (const LceCase& c : kScratchCases) {
    SCOPED_TRACE(case_name(c));
    LceInputs in(c, seed_of(c));
    in.opt.memory_budget = static_cast<size_t>(16 * ((c.v + 7) / 8 * 8) * 2);  // 16 tokens' exponentials
    const auto up = upstream_for(in, seed_of(c) + 1);
    const Outputs want = run_backend(in, Entry::kForwardBackward, false, up, nullptr);
    const Outputs in_gw = run_backend(in, Entry::kForwardBackward, true, up, nullptr);
    EXPECT_EQ(lce::debug::last_dlogits_in_grad_weight.get(), fused);
    const int64_t rows = lce::debug::last_group_rows.get();
    EXPECT_LT(rows, c.n);
    if (fused) EXPECT_GT(rows, 16);
    expect_outputs(in, Entry::kForwardBackward, in_gw, want, "exponentials in grad_weight", c.dtype);
    in.opt.chunk_tokens = rows;
    GradDtypes padded;
    padded.dw_pad = 8;
    const Outputs in_ws = run_backend(in, Entry::kForwardBackward, true, up, nullptr, Chunking::kDefault, padded);
    EXPECT_FALSE(lce::debug::last_dlogits_in_grad_weight.get());
    EXPECT_EQ(lce::debug::last_group_rows.get(), rows);
    EXPECT_TRUE(same_finite_bits(in_gw.loss, in_ws.loss, "loss"));
    EXPECT_TRUE(same_finite_bits(in_gw.lse, in_ws.lse, "lse"));
    EXPECT_TRUE(same_finite_bits(in_gw.dx, in_ws.dx, "grad_hidden"));
    EXPECT_TRUE(within_one_bf16_step(in_gw.dw, in_ws.dw, "grad_weight"));
  }
}

// grad_hidden's and grad_weight's rows at strides of no multiple of 4 elements: the fused gradient in forward's row
// kernels take their element loops there (kernels_exp_grad.cu, rows_take_vec4), with one group (grad_weight itself
// takes the target terms) and with several (the float32 accumulator does). Against the CPU backend.
TEST(LinearCrossEntropyCudaFused, OddGradientStridesMatchCpuBackend) {
  LOGITLESS_SKIP_WITHOUT_GPU();
  const bool fused = fused_kernels_run();
  GradDtypes odd;
  odd.dw_pad = 5;
  odd.dx_pad = 3;
  for (const LceCase& c : kScratchCases) {
    SCOPED_TRACE(case_name(c));
    LceInputs in(c, seed_of(c));
    const auto up = upstream_for(in, seed_of(c) + 1);
    for (Chunking ch : {Chunking::kDefault, Chunking::kSmall}) {
      SCOPED_TRACE(chunking_name(ch));
      const Outputs want = run_backend(in, Entry::kForwardBackward, false, up, nullptr, ch, odd);
      const Outputs got = run_backend(in, Entry::kForwardBackward, true, up, nullptr, ch, odd);
      EXPECT_EQ(lce::debug::last_kernel.get(), fused ? lce::Kernel::kHopperFused : lce::Kernel::kCublasChunked);
      expect_outputs(in, Entry::kForwardBackward, got, want, "odd gradient strides", c.dtype);
    }
  }
}

// float32 gradients of bfloat16 inputs (autocast over float32 master weights): each token group's shared region lies
// in its own rows of grad_hidden (plan.h, Plan::shared_in_grad_hidden), or in the workspace where grad_hidden's rows
// are padded. One group and several: the same bits either way, and the CPU backend's values.
TEST(LinearCrossEntropyCudaFused, SharedRegionInGradHiddenMatchesTheWorkspace) {
  LOGITLESS_SKIP_WITHOUT_GPU();
  const bool fused = fused_kernels_run();
  GradDtypes f32, padded;
  f32.f32 = padded.f32 = true;
  padded.dx_pad = 4;
  std::vector<LceCase> cases(std::begin(kScratchCases), std::end(kScratchCases));
  cases.push_back({333, 32, 7777, DType::kBFloat16, Layout::kContiguous, Preset::kPlain, Reduction::kMean, false});
  for (const LceCase& c : cases) {
    for (const int64_t chunk : {int64_t{0}, int64_t{64}}) {
      SCOPED_TRACE(::testing::Message() << case_name(c) << " chunk_tokens=" << chunk);
      LceInputs in(c, seed_of(c));
      in.opt.chunk_tokens = chunk;
      const auto up = upstream_for(in, seed_of(c) + 1);
      const Outputs want = run_backend(in, Entry::kForwardBackward, false, up, nullptr, Chunking::kDefault, f32);
      const Outputs in_gh = run_backend(in, Entry::kForwardBackward, true, up, nullptr, Chunking::kDefault, f32);
      // Where a grad_hidden row (4 H bytes) holds a token's statistics (8 bytes per 256 classes): not at
      // 32 × 7777, whose region stays in the workspace either way.
      const bool fits = 8 * ((c.v + 255) / 256) <= 4 * c.h;
      EXPECT_EQ(lce::debug::last_shared_in_grad_hidden.get(), fused && fits);
      EXPECT_EQ(lce::debug::last_group_rows.get(), chunk ? chunk : c.n);
      const Outputs in_ws = run_backend(in, Entry::kForwardBackward, true, up, nullptr, Chunking::kDefault, padded);
      EXPECT_FALSE(lce::debug::last_shared_in_grad_hidden.get());
      expect_outputs(in, Entry::kForwardBackward, in_gh, want, "region in grad_hidden", c.dtype);
      expect_same_finite_bits(in_gh, in_ws, "region in grad_hidden against the workspace");
    }
  }
}

// With check_targets, a bad target throws naming its first row and leaves every output as it was, whether the host
// waits for the check behind the first logits GEMM (run.cpp, checks_behind_logits: the fused forward, or a fused
// gradient in forward whose regions lie in the workspace) or before it (regions in grad_weight's storage or in a
// float32 grad_hidden's rows, or the generic kernels). A later call with good targets then matches the CPU backend.
TEST(LinearCrossEntropyCuda, BadTargetWritesNoOutputWhereverTheCheckWaits) {
  LOGITLESS_SKIP_WITHOUT_GPU();
  const bool fused = fused_kernels_run();
  // H = 128: a float32 grad_hidden row (512 bytes) holds a token's 31 tiles of statistics.
  const LceCase c{333, 128, 7777, DType::kBFloat16, Layout::kContiguous, Preset::kWeights, Reduction::kMean, false};
  const int64_t N = c.n, H = c.h, V = c.v;
  for (const int64_t chunk : {int64_t{0}, int64_t{64}})
    for (const Entry e : {Entry::kForward, Entry::kForwardBackward})
      for (const bool f32 : {false, true}) {  // float32 gradients: the gradient in forward only
        if (f32 && e != Entry::kForwardBackward) continue;
        SCOPED_TRACE(::testing::Message()
                     << entry_name(e) << " chunk_tokens=" << chunk << (f32 ? " float32 grads" : ""));
        LceInputs in(c, seed_of(c));
        in.opt.chunk_tokens = chunk;
        const int64_t t200 = in.target.get_index(200), t250 = in.target.get_index(250);
        in.target.set_index(200, V + 3);
        in.target.set_index(250, -5);
        in.to_device();
        const DType gdt = f32 ? DType::kFloat32 : c.dtype;
        TestTensor loss(DType::kFloat32, {}), lse(DType::kFloat32, {N}), gx(gdt, {N, H}), gw(gdt, {V, H});
        for (TestTensor* t : {&loss, &lse, &gx, &gw}) {
          t->fill_storage_nan();
          t->to_device();
        }
        const TensorView h = in.hidden.view(true), w = in.weight.view(true), t = in.target.view(true);
        const TensorView gxv = gx.view(true), gwv = gw.view(true);
        const bool fb = e == Entry::kForwardBackward;
        DeviceScratch ws(fb ? linear_cross_entropy_forward_backward_workspace_bytes(h, w, t, gxv, gwv, {}, in.opt)
                            : linear_cross_entropy_forward_workspace_bytes(h, w, t, in.opt));
        const std::string msg = error_of([&] {
          if (fb)
            linear_cross_entropy_forward_backward(h, w, {}, t, in.cwv(true), in.opt, loss.view(true), lse.view(true),
                                                  gxv, gwv, {}, {}, ws.ws(), nullptr);
          else
            linear_cross_entropy_forward(h, w, {}, t, in.cwv(true), in.opt, loss.view(true), lse.view(true), ws.ws(),
                                         nullptr);
        });
        EXPECT_NE(msg.find("got " + std::to_string(V + 3) + " at row 200"), std::string::npos) << msg;
        EXPECT_EQ(lce::debug::last_kernel.get(), fused ? lce::Kernel::kHopperFused : lce::Kernel::kCublasChunked);
        if (fused && fb) {  // the regions in the workspace (with 64-token groups beside the budget)
          EXPECT_FALSE(lce::debug::last_exp_in_grad_weight.get());
          EXPECT_EQ(lce::debug::last_shared_in_grad_hidden.get(), f32);  // ... or in grad_hidden's rows
        }
        device_synchronize();
        for (TestTensor* x : {&loss, &lse, &gx, &gw}) {
          x->to_host();
          for (const float v : x->gather_float()) ASSERT_TRUE(std::isnan(v)) << "an output was written";
        }
        in.target.set_index(200, t200);
        in.target.set_index(250, t250);
        const auto up = upstream_for(in, seed_of(c) + 1);
        const Outputs want = run_backend(in, e, false, up, nullptr, Chunking::kDefault, GradDtypes{f32});
        expect_outputs(in, e, run_backend(in, e, true, up, nullptr, Chunking::kDefault, GradDtypes{f32}), want,
                       "after a bad target", c.dtype);
      }
}
#endif

// Same inputs, same GPU: the same bits (fixed-order reductions, cuBLAS without atomics). The backward gets the
// lse that the gradient-in-forward run produced, as a training step's backward gets its forward's.
TEST(LinearCrossEntropyCudaNumerics, Deterministic) {
  LOGITLESS_SKIP_WITHOUT_GPU();
  LceCase c{300, 64, 5000, DType::kBFloat16, Layout::kContiguous, Preset::kAll, Reduction::kMean, true};
  LceInputs in(c, 41);
  const std::vector<double> up{1.0};
  const Outputs fa = run_backend(in, Entry::kForwardBackward, true, up, nullptr, Chunking::kSmall);
  const Outputs fb = run_backend(in, Entry::kForwardBackward, true, up, nullptr, Chunking::kSmall);
  // Every output is there (an empty vector would compare equal and finite).
  ASSERT_EQ(fa.loss.size(), 1u);
  ASSERT_EQ(fa.lse.size(), static_cast<size_t>(c.n));
  ASSERT_EQ(fa.dx.size(), static_cast<size_t>(c.n * c.h));
  ASSERT_EQ(fa.dw.size(), static_cast<size_t>(c.v * c.h));
  ASSERT_EQ(fa.db.size(), static_cast<size_t>(c.v));
  expect_same_finite_bits(fa, fb, "forward_backward");
  const Outputs ba = run_backend(in, Entry::kBackward, true, up, &fa.lse, Chunking::kSmall);
  const Outputs bb = run_backend(in, Entry::kBackward, true, up, &fa.lse, Chunking::kSmall);
  ASSERT_EQ(ba.dx.size(), fa.dx.size());
  ASSERT_EQ(ba.dw.size(), fa.dw.size());
  ASSERT_EQ(ba.db.size(), fa.db.size());
  expect_same_finite_bits(ba, bb, "backward");
}

// ---- the reference itself: its gradients against central differences of its loss ---------------------------
TEST(LinearCrossEntropyReference, GradientsMatchFiniteDifferences) {
  for (Preset p : {Preset::kPlain, Preset::kAll}) {
    LceCase c{3, 4, 7, DType::kFloat32, Layout::kContiguous, p, Reduction::kSum, true};
    LceInputs in(c, 99);
    const Outputs r = reference(in, {1.0});
    const double h = 1e-3;
    auto check = [&](TestTensor& t, const std::vector<double>& grad, const char* what) {
      for (int64_t k = 0; k < t.numel(); ++k) {
        const float x0 = t.get(k);
        t.set(k, x0 + static_cast<float>(h));
        const double fp = reference(in, {1.0}).loss[0];
        t.set(k, x0 - static_cast<float>(h));
        const double fm = reference(in, {1.0}).loss[0];
        t.set(k, x0);
        EXPECT_NEAR(grad[k], (fp - fm) / (2 * h), 2e-3) << preset_name(p) << " " << what << " element " << k;
      }
    };
    check(in.hidden, r.dx, "hidden");
    check(in.weight, r.dw, "weight");
    check(in.bias, r.db, "bias");
  }
}

// ---- the gradient kernel's column groups (grad_columns.h: the code the kernel runs per thread and row) -----
// Whole rows and every vocabulary slice of several slicings, with widths of every residue modulo kGradCols: each
// class of a chunk is loaded, evaluated, stored and summed exactly once, and nothing outside the chunk is
// touched: not the logits' padding, not the class weights of classes at V and beyond (the out-of-bounds read
// of label smoothing with class weights at V = 32003), not the next slice's classes.
TEST(LinearCrossEntropyGradColumns, GroupsTouchOnlyTheirChunk) {
  constexpr int K = head::kGradCols;
  for (int64_t V : {1, 2, 3, 4, 5, 7, 8, 9, 37, 1001, 32003}) {
    // Chunk widths: whole rows, the tests' small vocabulary chunks (V / 3 + 1), and narrow ones.
    for (int64_t C : {V, V / 3 + 1, int64_t{1}, int64_t{5}, int64_t{8}, int64_t{13}}) {
      C = std::min(C, V);
      SCOPED_TRACE("V=" + std::to_string(V) + " chunk=" + std::to_string(C));
      const int64_t ld = (C + 7) / 8 * 8;  // the planner's row length
      std::vector<float> weight(V);        // exactly V class weights, as the caller's tensor
      for (int64_t j = 0; j < V; ++j) weight[j] = 0.5f + static_cast<float>(j % 7);
      std::vector<int> loaded(V, 0), evaluated(V, 0), stored(V, 0);
      std::string violation;  // the first access outside the chunk
      auto outside = [&](const std::string& what, int64_t col, int64_t width) {
        if (violation.empty())
          violation = what + " at column " + std::to_string(col) + " of a chunk " + std::to_string(width) + " wide";
      };
      for (int64_t v0 = 0; v0 < V; v0 += C) {
        const int64_t width = std::min(C, V - v0);
        // Two rows of logits, padding poisoned; the gradient and the column sums poisoned everywhere.
        std::vector<float> logits(2 * ld, NAN), grad(2 * ld, NAN), sums(ld, NAN);
        for (int r = 0; r < 2; ++r)
          for (int64_t col = 0; col < width; ++col) logits[r * ld + col] = static_cast<float>(r + 1) + 0.001f * col;
        for (int64_t c = 0; c < width; c += K) {
          const uint32_t mask = head::grad_slot_mask(c, width);
          EXPECT_EQ(__builtin_popcount(mask), std::min<int64_t>(K, width - c)) << "group at " << c;
          float colsum[K] = {0.f, 0.f, 0.f, 0.f};
          for (int r = 0; r < 2; ++r) {
            const float* src = logits.data() + r * ld + c;
            float* dst = grad.data() + r * ld + c;
            const auto load_full = [&](float* x) {
              for (int k = 0; k < K; ++k) {
                if (c + k >= width)
                  outside("full load", c + k, width);
                else if (r == 0)
                  ++loaded[v0 + c + k];
                x[k] = src[k];
              }
            };
            const auto load_one = [&](int k) {
              if (c + k >= width)
                outside("load", c + k, width);
              else if (r == 0)
                ++loaded[v0 + c + k];
              return src[k];
            };
            // The label-smoothing gradient's class-weight read, as ce::grad_elem does it.
            const auto elem = [&](float x, int k) {
              const int64_t j = v0 + c + k;
              if (c + k >= width || j >= V) {
                outside("gradient of class " + std::to_string(j), c + k, width);
                return NAN;
              }
              if (r == 0) ++evaluated[j];
              return x * weight[j];
            };
            float v[K];
            head::grad_group_values(mask, load_full, load_one, elem, v);
            for (int k = 0; k < K; ++k)
              if (!((mask >> k) & 1u)) EXPECT_EQ(v[k], 0.f) << "slot " << k << " of the group at " << c;
            const auto store_full = [&](const float* w) {
              for (int k = 0; k < K; ++k) {
                if (c + k >= width)
                  outside("full store", c + k, width);
                else if (r == 0)
                  ++stored[v0 + c + k];
                dst[k] = w[k];
              }
            };
            const auto store_one = [&](int k, float w) {
              if (c + k >= width)
                outside("store", c + k, width);
              else if (r == 0)
                ++stored[v0 + c + k];
              dst[k] = w;
            };
            head::grad_group_store(mask, v, store_full, store_one, colsum);
          }
          head::grad_group_store_sums(mask, colsum, sums.data() + c);
        }
        // Values: x * w in the chunk, the poison left in the padding.
        for (int64_t col = 0; col < ld; ++col) {
          const bool in = col < width;
          double want_sum = 0;
          for (int r = 0; r < 2; ++r) {
            const float g = grad[r * ld + col];
            if (in) {
              const float want = logits[r * ld + col] * weight[v0 + col];
              EXPECT_EQ(g, want) << "row " << r << " column " << col << " of the slice at " << v0;
              want_sum += want;
            } else {
              EXPECT_TRUE(std::isnan(g)) << "padding column " << col << " written";
            }
          }
          if (in) {
            EXPECT_FLOAT_EQ(sums[col], static_cast<float>(want_sum)) << "column sum " << col;
          } else {
            EXPECT_TRUE(std::isnan(sums[col])) << "padding column sum " << col << " written";
          }
        }
      }
      EXPECT_EQ(violation, "");
      for (int64_t j = 0; j < V; ++j) {
        ASSERT_EQ(loaded[j], 1) << "class " << j;
        ASSERT_EQ(evaluated[j], 1) << "class " << j;
        ASSERT_EQ(stored[j], 1) << "class " << j;
      }
    }
  }
}

// ---- the planner (a pure host function) ------------------------------------------------------------------
lce::PlanInputs llama_inputs(lce::Pass pass, int64_t n, int64_t h, int64_t v) {
  lce::PlanInputs in;
  in.pass = pass;
  in.n = n;
  in.h = h;
  in.v = v;
  in.elem_bytes = 2;
  in.need_dx = in.need_dw = true;
  return in;
}

using Laid = LaidPlan<lce::Plan, lce::Buffers>;
Laid lay(const lce::PlanInputs& in) { return lay_plan(in, lce::plan_linear_cross_entropy, lce::declare_workspace); }

// Every region is 256-aligned, lies inside the total, and no two overlap.
void expect_layout_sound(const Laid& p) {
  std::vector<std::pair<size_t, size_t>> regions = p.regions;
  std::sort(regions.begin(), regions.end());
  for (size_t i = 0; i < regions.size(); ++i) {
    EXPECT_EQ(regions[i].first % 256, 0u);
    EXPECT_LE(regions[i].first + regions[i].second, p.bytes);
    if (i) EXPECT_LE(regions[i - 1].first + regions[i - 1].second, regions[i].first);
  }
}

TEST(LinearHeadWorkspace, StagesCarveWhatTheyDeclare) {
  struct Stage {
    float* a = nullptr;
    int* b = nullptr;
    void* none = nullptr;
    char* shared = nullptr;
  } s;
  head::WorkspaceLayout L;
  L.add(&s.a, 10);
  const size_t at_b = L.add(&s.b, 300);
  L.add(&s.none, 0);  // absent: no region, the pointer stays null
  L.alias(&s.shared, at_b);
  EXPECT_EQ(L.bytes(), 256u + 512u);
  EXPECT_EQ(L.regions(), (std::vector<std::pair<size_t, size_t>>{{0, 10}, {256, 300}}));
  alignas(256) static char ws[768];
  L.carve(ws);
  EXPECT_EQ(reinterpret_cast<char*>(s.a), ws);
  EXPECT_EQ(reinterpret_cast<char*>(s.b), ws + 256);
  EXPECT_EQ(s.shared, ws + 256);
  EXPECT_EQ(s.none, nullptr);
}

TEST(LinearCrossEntropyPlan, GradientInForwardAtLlamaShapes) {
  // bf16, N=8192, H=4096, V=128256, 512 MiB: holding every token's bf16 gradient (2.1 GB) costs no more than
  // budget + the float32 grad_weight accumulator (2.1 GB) would, so one group and no accumulator; the float32
  // logits chunk then takes the rest of that allowance (512 MiB: 1046 rows, 1024 at most).
  Laid p = lay(llama_inputs(lce::Pass::kForwardBackward, 8192, 4096, 128256));
  EXPECT_EQ(p.chunk_rows, 1024);
  EXPECT_EQ(p.group_rows, 8192);
  EXPECT_FALSE(p.dw_accumulator);
  EXPECT_FALSE(p.dlogits_in_place);
  EXPECT_EQ(p.ld_logits, 128256);
  EXPECT_LE(static_cast<size_t>(p.chunk_rows * p.ld_logits * 4 + p.group_rows * p.ld_dlogits * 2),
            (size_t{512} << 20) + size_t{4} * 128256 * 4096);
  EXPECT_LE(p.bytes, size_t{2700} << 20);
  expect_layout_sound(p);
  // 4096 tokens: the same trade, a chunk of 1024 tokens.
  p = lay(llama_inputs(lce::Pass::kForwardBackward, 4096, 4096, 128256));
  EXPECT_EQ(p.group_rows, 4096);
  EXPECT_EQ(p.chunk_rows, 1024);
  // Few tokens: never more rows than there are.
  p = lay(llama_inputs(lce::Pass::kForwardBackward, 300, 4096, 128256));
  EXPECT_LE(p.chunk_rows, 300);
  EXPECT_EQ(p.group_rows, 300);
  // Gemma-2-like: V=256000, H=2304: every token's gradient (4.2 GB) would exceed budget + accumulator (2.9 GB).
  // 2/5 of the budget for the float32 chunk in 64-token steps (204 MiB: 209 rows -> 192), the rest for the group.
  p = lay(llama_inputs(lce::Pass::kForwardBackward, 8192, 2304, 256000));
  EXPECT_EQ(p.chunk_rows, 192);
  EXPECT_EQ(p.group_rows, 640);
  EXPECT_TRUE(p.dw_accumulator);
  EXPECT_LE(p.chunk_rows * p.ld_logits * 4 + p.group_rows * p.ld_dlogits * 2, int64_t{512} << 20);
  expect_layout_sound(p);
  // A float32 grad_weight takes the sums itself, no accumulator. The budget's group (1280 tokens) grows to 2048 within
  // twice the budget (head::group_min_rows).
  lce::PlanInputs in = llama_inputs(lce::Pass::kForwardBackward, 8192, 4096, 128256);
  in.grad_weight_f32 = true;
  p = lay(in);
  EXPECT_EQ(p.chunk_rows, 384);
  EXPECT_EQ(p.group_rows, head::kFloat32SumsGroupRows);
  EXPECT_FALSE(p.dw_accumulator);
  EXPECT_EQ(off(p.b.head.dw_acc), kNone);
  EXPECT_LE(p.chunk_rows * p.ld_logits * 4 + p.group_rows * p.ld_dlogits * 2, int64_t{1024} << 20);
  expect_layout_sound(p);
  // A frozen weight (no grad_weight): nothing sums over the groups, groups from the budget.
  in = llama_inputs(lce::Pass::kForwardBackward, 8192, 4096, 128256);
  in.need_dw = false;
  EXPECT_EQ(lay(in).group_rows, 1280);
}

// Where a float32 grad_weight sums over token groups itself, groups grow toward 2048 tokens as far as twice the
// budget holds; nowhere else, and never past what the caller fixed.
TEST(LinearCrossEntropyPlan, Float32GradWeightGroupsGrowWithinTwiceTheBudget) {
  const auto f32 = [](int64_t n, int64_t h, int64_t v, bool fused) {
    lce::PlanInputs in = llama_inputs(lce::Pass::kForwardBackward, n, h, v);
    in.fused = in.fused_exp = fused;
    in.grad_hidden_f32 = in.grad_weight_f32 = in.grad_hidden_rows_scratch = true;
    in.target_sort_bytes = size_t{1} << 20;
    return in;
  };
  const int64_t floor = head::kFloat32SumsGroupRows;
  for (const bool fused : {true, false}) {
    // 256000 classes (512000 bytes of exponentials a token; the budget holds 1048): four groups of 2048.
    lce::PlanInputs in = f32(8192, 2304, 256000, fused);
    Laid p = lay(in);
    // The generic path's float32 logits chunk (192 tokens) shares twice the budget: 1664-token groups.
    EXPECT_EQ(p.group_rows, fused ? floor : 1664) << fused;
    EXPECT_FALSE(p.dw_accumulator);
    EXPECT_LE(p.group_rows * p.ld_dlogits * 2 + (fused ? 0 : p.chunk_rows * p.ld_logits * 4), int64_t{1024} << 20);
    expect_layout_sound(p);
    // Gemma 3's 262144 classes: 2048 tokens' exponentials are exactly twice the budget.
    if (fused) EXPECT_EQ(lay(f32(8192, 2304, 262144, true)).group_rows, floor);
    // A small budget: the groups grow only as far as twice it holds.
    in.memory_budget = size_t{64} << 20;
    p = lay(in);
    lce::PlanInputs no_dw = in;
    no_dw.need_dw = false;
    EXPECT_LT(p.group_rows, floor);
    EXPECT_GT(p.group_rows, lay(no_dw).group_rows) << fused;
    EXPECT_LE(p.group_rows * p.ld_dlogits * 2 + (fused ? 0 : p.chunk_rows * p.ld_logits * 4), int64_t{128} << 20);
    // Groups the caller fixed stay as they are.
    in.memory_budget = size_t{512} << 20;
    in.chunk_tokens = 1024;
    EXPECT_EQ(lay(in).group_rows, 1024);
    // A budget that holds longer groups keeps them.
    in.chunk_tokens = 0;
    in.memory_budget = size_t{3} << 30;
    EXPECT_GT(lay(in).group_rows, floor);
  }
  // A 16-bit grad_weight summing in itself (weight_dtype accumulation): groups from the budget alone (1024 at 256000
  // classes). No gradient of the weight: likewise.
  lce::PlanInputs wd = llama_inputs(lce::Pass::kForwardBackward, 8192, 2304, 256000);
  wd.fused = wd.fused_exp = true;
  wd.target_sort_bytes = size_t{1} << 20;
  wd.dw_weight_dtype = true;
  EXPECT_EQ(lay(wd).group_rows, 1024);
  lce::PlanInputs frozen = f32(8192, 2304, 256000, true);
  frozen.need_dw = false;
  EXPECT_EQ(lay(frozen).group_rows, 1024);
}

// The schedule "auto" takes for bf16 (recompute_is_faster): the three shapes measured on H100 (bench/RESULTS.md), and
// where the model does not apply.
TEST(LinearCrossEntropyPlan, RecomputeWhereTheGradientAccumulatorCostsMore) {
  using lce::Pass;
  // 8192 x 2304 x 256000: 13 float32 grad_weight accumulations and 43 short chunks against a fourth GEMM.
  EXPECT_TRUE(lce::recompute_is_faster(llama_inputs(Pass::kForwardBackward, 8192, 2304, 256000)));
  // 16384 x 2048 x 128256: 13 accumulations of a smaller grad_weight cost less than the fourth GEMM.
  EXPECT_FALSE(lce::recompute_is_faster(llama_inputs(Pass::kForwardBackward, 16384, 2048, 128256)));
  // No accumulator (every token's gradient held): gradient in the forward.
  EXPECT_FALSE(lce::recompute_is_faster(llama_inputs(Pass::kForwardBackward, 8192, 4096, 128256)));
  EXPECT_FALSE(lce::recompute_is_faster(llama_inputs(Pass::kForwardBackward, 4096, 4096, 128256)));
  // The same with the fused kernels (exponential form): the gradient in forward's 10 accumulations at V=256000
  // still cost more than the fourth GEMM; at 16384 x 2048 its 9 do not.
  for (const auto& [n, h, v, want] : {std::tuple{8192, 2304, 256000, true}, std::tuple{16384, 2048, 128256, false},
                                      std::tuple{8192, 4096, 128256, false}, std::tuple{4096, 4096, 128256, false}}) {
    lce::PlanInputs f = llama_inputs(Pass::kForwardBackward, n, h, v);
    f.fused = f.fused_exp = true;
    EXPECT_EQ(lce::recompute_is_faster(f), want) << n << "x" << h << "x" << v;
  }
  // With grad_weight's storage (contiguous rows, as the Python package allocates it) the fused plan keeps the
  // exponentials there: 4 groups of 2048 at V=256000, the gradient in forward (bench/RESULTS.md); an eighth of the
  // budget makes 9 groups of 911, recompute again.
  lce::PlanInputs wide = llama_inputs(Pass::kForwardBackward, 8192, 2304, 256000);
  wide.fused = wide.fused_exp = true;
  wide.grad_weight_scratch = size_t{256000} * 2304 * 2 - 256;
  EXPECT_FALSE(lce::recompute_is_faster(wide));
  wide.memory_budget = size_t{64} << 20;
  EXPECT_TRUE(lce::recompute_is_faster(wide));
  // A bigger budget removes the accumulations at V=256000 (every token's 4.2 GB gradient fits 4 GiB + the
  // 2.4 GB accumulator it replaces).
  lce::PlanInputs in = llama_inputs(Pass::kForwardBackward, 8192, 2304, 256000);
  in.memory_budget = size_t{4} << 30;
  EXPECT_FALSE(lce::recompute_is_faster(in));
  // A float32 grad_weight sums in place (no accumulator), a frozen weight has none.
  in = llama_inputs(Pass::kForwardBackward, 8192, 2304, 256000);
  in.grad_weight_f32 = true;
  EXPECT_FALSE(lce::recompute_is_faster(in));
  in = llama_inputs(Pass::kForwardBackward, 8192, 2304, 256000);
  in.need_dw = false;
  EXPECT_FALSE(lce::recompute_is_faster(in));
  // Outside the model: float32 inputs, other passes, the vocabulary-parallel steps, no tokens.
  in = llama_inputs(Pass::kForwardBackward, 8192, 2304, 256000);
  in.elem_bytes = 4;
  EXPECT_FALSE(lce::recompute_is_faster(in));
  EXPECT_FALSE(lce::recompute_is_faster(llama_inputs(Pass::kForward, 8192, 2304, 256000)));
  EXPECT_FALSE(lce::recompute_is_faster(llama_inputs(Pass::kBackward, 8192, 2304, 256000)));
  in = llama_inputs(Pass::kForwardBackward, 8192, 2304, 256000);
  in.steps = true;
  in.chunk_tokens = 512;
  EXPECT_FALSE(lce::recompute_is_faster(in));
  EXPECT_FALSE(lce::recompute_is_faster(llama_inputs(Pass::kForwardBackward, 0, 2304, 256000)));
}

TEST(LinearCrossEntropyPlan, Float32InputsOverwriteTheirLogits) {
  lce::PlanInputs in = llama_inputs(lce::Pass::kForwardBackward, 8192, 4096, 128256);
  in.elem_bytes = 4;
  in.grad_weight_f32 = true;
  const Laid p = lay(in);
  EXPECT_TRUE(p.dlogits_in_place);
  EXPECT_EQ(off(p.b.head.dlogits), kNone);
  EXPECT_EQ(p.chunk_rows, p.group_rows);
  EXPECT_EQ(p.chunk_rows, 1024);  // 512 MiB / (4 x 128256) = 1046
  expect_layout_sound(p);
}

TEST(LinearCrossEntropyPlan, ForwardAndBackward) {
  Laid f = lay(llama_inputs(lce::Pass::kForward, 8192, 4096, 128256));
  EXPECT_EQ(f.chunk_rows, 1024);
  EXPECT_EQ(off(f.b.head.dlogits), kNone);
  expect_layout_sound(f);
  // Backward: vocabulary chunks of 512 MiB / (6 bytes x 8192 tokens) = 10922 -> 10880 columns; grad_hidden
  // sums over 12 chunks in float32.
  Laid b = lay(llama_inputs(lce::Pass::kBackward, 8192, 4096, 128256));
  EXPECT_EQ(b.vocab_cols, 10880);
  EXPECT_EQ(b.ld_logits % 8, 0);
  EXPECT_TRUE(b.dx_accumulator);
  EXPECT_NE(off(b.b.head.dx_acc), kNone);
  EXPECT_EQ(off(b.b.head.dw_acc), kNone);  // each chunk of grad_weight rows is final when written
  expect_layout_sound(b);
  // Few tokens: the whole vocabulary in one chunk costs no more than the budget plus that accumulator.
  b = lay(llama_inputs(lce::Pass::kBackward, 256, 4096, 128256));
  EXPECT_EQ(b.vocab_cols, 128256);
  EXPECT_FALSE(b.dx_accumulator);
}

TEST(LinearCrossEntropyPlan, FusedHopperKernels) {
  lce::PlanInputs in = llama_inputs(lce::Pass::kForward, 8192, 4096, 128256);
  in.fused = true;
  // Forward: no logits, no cross-entropy scratch; 16 bytes per token and 256-column tile (501 tiles), so every
  // token fits one chunk.
  Laid f = lay(in);
  EXPECT_EQ(f.kernel, lce::Kernel::kHopperFused);
  EXPECT_EQ(off(f.b.head.logits), kNone);
  EXPECT_EQ(f.chunk_rows, 8192);
  EXPECT_NE(off(f.b.fused.partials), kNone);
  EXPECT_GE(f.bytes - off(f.b.fused.partials), size_t{8192} * 501 * 16);
  expect_layout_sound(f);
  // Gradient in forward without the exponential form (float16, soft cap, label smoothing): generic, the plan as
  // without the flag.
  in.pass = lce::Pass::kForwardBackward;
  Laid g = lay(in);
  EXPECT_EQ(g.kernel, lce::Kernel::kCublasChunked);
  EXPECT_EQ(off(g.b.fused.partials), kNone);
  EXPECT_EQ(off(g.b.fused.shift), kNone);
  EXPECT_EQ(g.chunk_rows, 1024);
  EXPECT_EQ(g.group_rows, 8192);
  expect_layout_sound(g);
  // With it: one GEMM per group, no float32 logits. Per token 2 x 128256 (exponentials) + 12 + one region that
  // holds in turn the statistics (16 x 501), the scaled hidden row (2 x 4096) and the float32 grad_hidden row
  // (4 x 4096): 272908 bytes. Every token's (2.24 GB) costs less than budget + the float32 grad_weight accumulator
  // (2.64 GB), so one group and no accumulator.
  in.fused_exp = true;
  g = lay(in);
  EXPECT_EQ(g.kernel, lce::Kernel::kHopperFused);
  EXPECT_EQ(g.chunk_rows, 8192);
  EXPECT_EQ(g.group_rows, 8192);
  EXPECT_FALSE(g.dw_accumulator);
  EXPECT_EQ(off(g.b.head.logits), kNone);
  for (size_t off : {off(g.b.fused.partials), off(g.b.head.dlogits), off(g.b.fused.shift), off(g.b.fused.row_scale),
                     off(g.b.fused.fixups), off(g.b.fused.scaled_hidden), off(g.b.fused.dx_rows)})
    EXPECT_NE(off, kNone);
  EXPECT_GE(g.bytes, size_t{8192} * 272908);
  EXPECT_LE(g.bytes, size_t{8192} * 272908 + (size_t{40} << 20));
  EXPECT_EQ(off(g.b.fused.scaled_hidden), off(g.b.fused.partials));
  EXPECT_EQ(off(g.b.fused.dx_rows), off(g.b.fused.partials));
  EXPECT_GE(g.bytes - off(g.b.fused.partials), size_t{8192} * 4 * 4096);
  expect_layout_sound(g);
  // 16384 x 2048 x 128256: 264716 bytes a token; every token's (4.3 GB) exceeds budget + accumulator (1.6 GB), so
  // groups from the budget (2028 -> 1920 rows) and the accumulator.
  lce::PlanInputs in2 = llama_inputs(lce::Pass::kForwardBackward, 16384, 2048, 128256);
  in2.fused = in2.fused_exp = true;
  g = lay(in2);
  EXPECT_EQ(g.kernel, lce::Kernel::kHopperFused);
  EXPECT_EQ(g.group_rows, 1920);
  EXPECT_EQ(g.chunk_rows, 1920);
  EXPECT_TRUE(g.dw_accumulator);
  expect_layout_sound(g);
  // Float32 grad_hidden (the GEMM writes it, then scales it in place): no float32 rows; a frozen weight: no scaled
  // hidden; a bias gradient: generic.
  in2.grad_hidden_f32 = true;
  in2.need_dw = false;
  g = lay(in2);
  EXPECT_EQ(off(g.b.fused.dx_rows), kNone);
  EXPECT_EQ(off(g.b.fused.scaled_hidden), kNone);
  in2.need_db = true;
  EXPECT_EQ(lay(in2).kernel, lce::Kernel::kCublasChunked);
  in2.need_db = false;
  in.fused_exp = false;
  // Backward: only the 16-bit gradient per column, 512 MiB / (2 bytes x 8192) = 32768 columns (whole tiles).
  in.pass = lce::Pass::kBackward;
  Laid b = lay(in);
  EXPECT_EQ(b.kernel, lce::Kernel::kHopperFused);
  EXPECT_EQ(off(b.b.head.logits), kNone);
  EXPECT_EQ(b.vocab_cols, 32768);
  EXPECT_TRUE(b.dx_accumulator);
  expect_layout_sound(b);
  // What stays generic: a backward with a bias gradient, float32 inputs, the vocabulary-parallel steps.
  in.need_db = true;
  EXPECT_EQ(lay(in).kernel, lce::Kernel::kCublasChunked);
  in.need_db = false;
  in.elem_bytes = 4;
  EXPECT_EQ(lay(in).kernel, lce::Kernel::kCublasChunked);
  in = llama_inputs(lce::Pass::kForwardBackward, 8192, 4096, 128256);
  in.fused = true;
  in.steps = true;
  in.chunk_tokens = 512;
  EXPECT_EQ(lay(in).kernel, lce::Kernel::kCublasChunked);
  // Without the flag (another GPU, other operands): the generic plan, as before.
  in = llama_inputs(lce::Pass::kBackward, 8192, 4096, 128256);
  EXPECT_EQ(lay(in).kernel, lce::Kernel::kCublasChunked);
  EXPECT_EQ(lay(in).vocab_cols, 10880);
}

// With the float32 grad_weight accumulator, grad_weight's own storage holds nothing but the accumulator's tail until
// the sums are written into it: where it could hold the exponential form's per-group regions, the budget holds the
// exponentials alone, and the regions lie beside the budget in the workspace, so that the last group's products write
// grad_weight (Plan::dw_written_rows), or, with that off, in grad_weight's storage (Plan::exp_in_grad_weight). At the
// fine-tuning shape that makes 8 groups of 2048 tokens instead of 9. At 256000 classes,
// where grad_weight's storage outgrows the budget, the exponentials go there too (Plan::dlogits_in_grad_weight), in
// the accumulator tail's place: 4 groups of 2048 instead of 8 of 1024, in at most one budget more workspace. Groups
// are cut evenly, so that no short last group costs a whole accumulator pass.
// Float32 gradients of bfloat16 inputs (autocast over float32 hidden and weight): a token group's shared region
// (statistics, then scaled hidden rows) lies in its own rows of grad_hidden where they are contiguous and 4 H bytes
// hold it: less workspace, and longer groups where the budget holds more than 2048 tokens (below that they grow to
// 2048 within twice the budget, the regions beside it, wherever the regions lie).
TEST(LinearCrossEntropyPlan, SharedRegionInFloat32GradHidden) {
  lce::PlanInputs in = llama_inputs(lce::Pass::kForwardBackward, 8192, 4096, 128256);
  in.fused = in.fused_exp = true;
  in.grad_hidden_f32 = in.grad_weight_f32 = true;
  // In the workspace: 2 x 128256 + 32 + 8192 (the scaled hidden row, over 8 x 501 statistics) bytes a token;
  // 512 MiB hold 2027 rows, grown to 2048.
  Laid ws = lay(in);
  EXPECT_EQ(ws.kernel, lce::Kernel::kHopperFused);
  EXPECT_FALSE(ws.shared_in_grad_hidden);
  EXPECT_EQ(ws.group_rows, 2048);
  EXPECT_NE(off(ws.b.fused.partials), kNone);
  EXPECT_EQ(off(ws.b.fused.scaled_hidden), off(ws.b.fused.partials));
  expect_layout_sound(ws);
  // In grad_hidden's rows (16 KiB each): 2092 rows fit, so 4 groups of 2048, and no such region in the workspace.
  in.grad_hidden_rows_scratch = true;
  Laid gh = lay(in);
  EXPECT_TRUE(gh.shared_in_grad_hidden);
  EXPECT_EQ(gh.group_rows, 2048);
  EXPECT_EQ(off(gh.b.fused.partials), kNone);
  EXPECT_EQ(off(gh.b.fused.scaled_hidden), kNone);
  EXPECT_EQ(off(gh.b.fused.dx_rows), kNone);
  EXPECT_NE(off(gh.b.head.dlogits), kNone);
  EXPECT_LE(gh.bytes, in.memory_budget + (size_t{64} << 20));
  EXPECT_LE(gh.bytes + size_t{2048} * 8192, ws.bytes);
  expect_layout_sound(gh);
  // 1020 MiB hold 4040 tokens with the region (3 groups of 2816) and 4169 without it (2 of 4096).
  in.memory_budget = size_t{1020} << 20;
  EXPECT_EQ(lay(in).group_rows, 4096);
  in.grad_hidden_rows_scratch = false;
  EXPECT_EQ(lay(in).group_rows, 2816);
  in.memory_budget = size_t{512} << 20;
  // 256000 classes at H = 2304: 8 x 1000 bytes of statistics a token fit a row's 4 x 2304 (16 bytes a tile would
  // not have). The budget holds 1048 tokens' exponentials (2 x 256000 + 32 bytes each), in the workspace too (520032
  // bytes a token) 1032; twice it 2097: 4 groups of 2048 either way. At H = 1024 the statistics exceed the row: the
  // workspace.
  lce::PlanInputs wide = llama_inputs(lce::Pass::kForwardBackward, 8192, 2304, 256000);
  wide.fused = wide.fused_exp = true;
  wide.grad_hidden_f32 = wide.grad_weight_f32 = wide.grad_hidden_rows_scratch = true;
  Laid wide_gh = lay(wide);
  EXPECT_TRUE(wide_gh.shared_in_grad_hidden);
  EXPECT_EQ(wide_gh.group_rows, 2048);
  expect_layout_sound(wide_gh);
  wide.grad_hidden_rows_scratch = false;
  EXPECT_EQ(lay(wide).group_rows, 2048);
  wide.grad_hidden_rows_scratch = true;
  wide.h = 1024;
  EXPECT_FALSE(lay(wide).shared_in_grad_hidden);
  // A 16-bit grad_hidden takes the float32 rows in that region: never.
  in.grad_hidden_f32 = false;
  EXPECT_FALSE(lay(in).shared_in_grad_hidden);
  // The generic path: none.
  in.grad_hidden_f32 = true;
  in.fused_exp = false;
  EXPECT_FALSE(lay(in).shared_in_grad_hidden);
}

TEST(LinearCrossEntropyPlan, ExponentialFormScratchInGradWeight) {
  lce::PlanInputs in = llama_inputs(lce::Pass::kForwardBackward, 16384, 2048, 128256);
  in.fused = in.fused_exp = true;
  in.target_sort_bytes = size_t{1} << 20;
  in.grad_weight_scratch = size_t{128256} * 2048 * 2 - 256;
  const auto laid = [](const lce::PlanInputs& i, lce::Plan* p, lce::Buffers* b, head::WorkspaceLayout* scratch) {
    *p = lce::plan_linear_cross_entropy(i);
    head::WorkspaceLayout L;
    lce::declare_workspace(i, *p, L, b, scratch);
    EXPECT_EQ(L.bytes(), p->bytes);
    L.carve(reinterpret_cast<void*>(uintptr_t{1} << 40));
    scratch->carve(reinterpret_cast<void*>(uintptr_t{1} << 44));
  };
  lce::Plan p;
  lce::Buffers b;
  head::WorkspaceLayout S;
  // The default: the regions beside the budget (18 MB), every row written by the last group's products.
  laid(in, &p, &b, &S);
  EXPECT_FALSE(p.exp_in_grad_weight);
  EXPECT_EQ(p.group_rows, 2048);
  EXPECT_EQ(p.dw_tail_rows, 42624);
  EXPECT_EQ(p.dw_written_rows, 128256 - 42624);
  EXPECT_LE(p.bytes, size_t{512 + 1002 + 32 + 2 + 18} << 20);
  EXPECT_EQ(S.bytes(), static_cast<size_t>(42624) * 2048 * 4);  // the tail alone
  // With that off, the regions in grad_weight's storage after the tail.
  in.dw_written = false;
  S = head::WorkspaceLayout{};
  laid(in, &p, &b, &S);
  EXPECT_TRUE(p.exp_in_grad_weight);
  EXPECT_TRUE(p.dw_accumulator);
  EXPECT_EQ(p.group_rows, 2048);
  EXPECT_LE(static_cast<size_t>(p.group_rows * p.ld_dlogits * 2), size_t{512} << 20);
  // The workspace: the exponentials, the accumulator, cuBLAS's and the per-token loss state; the rest in the scratch.
  EXPECT_LE(p.bytes, size_t{512 + 1002 + 32 + 2} << 20);
  EXPECT_LE(S.bytes(), in.grad_weight_scratch);
  const auto in_scratch = [&](const void* ptr) {
    const auto a = reinterpret_cast<uintptr_t>(ptr);
    return a >= (uintptr_t{1} << 44) && a < (uintptr_t{1} << 44) + S.bytes();
  };
  for (const void* ptr : {static_cast<const void*>(b.fused.partials), static_cast<const void*>(b.fused.shift),
                          static_cast<const void*>(b.fused.row_scale), static_cast<const void*>(b.fused.target_coef),
                          static_cast<const void*>(b.fused.fixups), static_cast<const void*>(b.fused.class_keys[1]),
                          static_cast<const void*>(b.fused.sort_temp), static_cast<const void*>(b.fused.scaled_hidden),
                          static_cast<const void*>(b.fused.dx_rows)})
    EXPECT_TRUE(in_scratch(ptr));
  EXPECT_FALSE(in_scratch(b.head.dlogits));
  EXPECT_FALSE(in_scratch(b.head.dw_acc));
  EXPECT_FALSE(p.dlogits_in_grad_weight);  // 512 MiB of exponentials would not fit its 501 MiB
  EXPECT_EQ(p.dw_tail_rows, 42624);
  EXPECT_EQ(p.dw_written_rows, 0);
  in.dw_written = true;
  // 256000 classes: the exponentials in grad_weight's storage too, after a shorter tail.
  lce::PlanInputs wide = llama_inputs(lce::Pass::kForwardBackward, 8192, 2304, 256000);
  wide.fused = wide.fused_exp = true;
  wide.target_sort_bytes = size_t{1} << 20;
  wide.grad_weight_scratch = size_t{256000} * 2304 * 2 - 256;
  S = head::WorkspaceLayout{};
  laid(wide, &p, &b, &S);
  EXPECT_EQ(p.group_rows, 2048);
  EXPECT_TRUE(p.dlogits_in_grad_weight);
  EXPECT_TRUE(p.exp_in_grad_weight);
  EXPECT_LE(S.bytes(), wide.grad_weight_scratch);
  EXPECT_TRUE(in_scratch(b.head.dlogits));
  EXPECT_TRUE(in_scratch(b.fused.scaled_hidden));
  EXPECT_FALSE(in_scratch(b.head.dw_acc));
  // The tail first, then the exponentials, then the regions.
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b.dw_tail), uintptr_t{1} << 44);
  EXPECT_GE(reinterpret_cast<uintptr_t>(b.head.dlogits),
            (uintptr_t{1} << 44) + static_cast<uintptr_t>(p.dw_tail_rows) * 2304 * 4);
  EXPECT_GE(reinterpret_cast<uintptr_t>(b.fused.shift),
            reinterpret_cast<uintptr_t>(b.head.dlogits) + static_cast<uintptr_t>(2048 * p.ld_dlogits * 2));
  EXPECT_EQ(p.dw_tail_rows, 256000 - 243968);
  EXPECT_EQ(p.dw_written_rows, 0);  // the last group's products read the exponentials there
  // A grad_weight with padded rows (no scratch): every row written by the last products.
  in.grad_weight_scratch = 0;
  EXPECT_EQ(lce::plan_linear_cross_entropy(in).dw_written_rows, 128256);
  in.grad_weight_scratch = size_t{128256} * 2048 * 2 - 256;
  // At most one budget over the workspace of the budget's exponentials beside the longest tail.
  wide.dlogits_in_grad_weight = false;
  const lce::Plan budget_plan = lce::plan_linear_cross_entropy(wide);
  wide.dlogits_in_grad_weight = true;
  EXPECT_EQ(budget_plan.group_rows, 1024);
  EXPECT_EQ(budget_plan.dw_tail_rows, 256000 - 170752);
  EXPECT_GT(p.bytes, budget_plan.bytes);
  EXPECT_LE(p.bytes, budget_plan.bytes + wide.memory_budget);
  // Without the tail (a benchmark's switch): the budget holds the exponentials, 8 groups of 1024.
  wide.dw_tail = false;
  EXPECT_EQ(lce::plan_linear_cross_entropy(wide).group_rows, 1024);
  EXPECT_FALSE(lce::plan_linear_cross_entropy(wide).dlogits_in_grad_weight);
  wide.dw_tail = true;
  // Without the scratch (a grad_weight with padded rows): the per-token regions count in the budget (520032 bytes
  // a token: 1032 fit), 8 even groups of 1024.
  wide.grad_weight_scratch = 0;
  wide.target_sort_bytes = 0;
  EXPECT_EQ(lce::plan_linear_cross_entropy(wide).group_rows, 1024);
  EXPECT_FALSE(lce::plan_linear_cross_entropy(wide).exp_in_grad_weight);
  EXPECT_FALSE(lce::plan_linear_cross_entropy(wide).dlogits_in_grad_weight);
  // A scratch too small for the regions: in the workspace, groups as without it (2028 fit: 9 groups, 1920-row tiles).
  in.grad_weight_scratch = 1000;
  S = head::WorkspaceLayout{};
  laid(in, &p, &b, &S);
  EXPECT_FALSE(p.exp_in_grad_weight);
  EXPECT_EQ(p.group_rows, 1920);
  EXPECT_EQ(S.bytes(), 0u);
  // grad_weight as the running sum (weight-dtype accumulation), or one group (no accumulator): no scratch there.
  in.grad_weight_scratch = size_t{128256} * 2048 * 2 - 256;
  in.dw_weight_dtype = true;
  EXPECT_FALSE(lce::plan_linear_cross_entropy(in).exp_in_grad_weight);
  in.dw_weight_dtype = false;
  in.n = 1024;
  EXPECT_EQ(lce::plan_linear_cross_entropy(in).group_rows, 1024);
  EXPECT_FALSE(lce::plan_linear_cross_entropy(in).exp_in_grad_weight);
}

// The fused gradient in forward's groups over a sweep of shapes and budgets: what the budget holds (the group's
// exponentials, and its other per-token regions unless they lie in grad_weight's storage) stays within it, those
// regions fit the scratch they are put in, and no plan has more groups than the budget forces.
TEST(LinearCrossEntropyPlan, ExponentialFormGroupsWithinTheBudget) {
  int exponentials_in_grad_weight = 0;
  for (const int64_t n : {1, 127, 1000, 4097, 16384, 30001})
    for (const int64_t h : {64, 2048, 4096})
      for (const int64_t v : {1000, 32000, 128256, 256000})
        for (const size_t budget : {size_t{1} << 20, size_t{64} << 20, size_t{512} << 20})
          for (const bool scratch : {false, true}) {
            lce::PlanInputs in = llama_inputs(lce::Pass::kForwardBackward, n, h, v);
            in.fused = in.fused_exp = true;
            in.memory_budget = budget;
            in.target_sort_bytes = size_t{4} * static_cast<size_t>(n) + 4096;
            in.grad_weight_scratch = scratch ? static_cast<size_t>(v * h * 2 - 256) : 0;
            SCOPED_TRACE(::testing::Message()
                         << n << " x " << h << " x " << v << ", budget " << budget << ", scratch " << scratch);
            const lce::Plan p = lce::plan_linear_cross_entropy(in);
            ASSERT_EQ(p.kernel, lce::Kernel::kHopperFused);
            EXPECT_EQ(p.chunk_rows, p.group_rows);
            EXPECT_GE(p.group_rows, 1);
            EXPECT_LE(p.group_rows, n);
            lce::Buffers b;
            head::WorkspaceLayout L, S;
            lce::declare_workspace(in, p, L, &b, &S);
            EXPECT_EQ(L.bytes(), p.bytes);
            EXPECT_EQ(S.bytes() > 0, p.exp_in_grad_weight || p.dw_tail_rows > 0);
            EXPECT_LE(S.bytes(), in.grad_weight_scratch);
            if (p.exp_in_grad_weight || p.dw_tail_rows > 0) EXPECT_TRUE(scratch && p.dw_accumulator);
            if (p.dlogits_in_grad_weight) EXPECT_TRUE(p.exp_in_grad_weight && p.group_rows < n);
            // The regions' room in grad_weight's storage: what the longest accumulator tail leaves (it has one
            // with several groups).
            const int64_t tail = scratch ? head::accumulator_tail_rows(v, h, in.grad_weight_scratch) : 0;
            const auto bytes32 = [&](int64_t rows) { return static_cast<size_t>((rows * h * 4 + 255) / 256 * 256); };
            const size_t room = in.grad_weight_scratch > bytes32(tail) ? in.grad_weight_scratch - bytes32(tail) : 0;
            const auto e_row = static_cast<size_t>(p.ld_dlogits * 2), row = e_row + p.exp_shared_row + 32;
            const auto regions = [&](int64_t rows) {
              lce::Plan q = p;
              q.group_rows = rows;
              head::WorkspaceLayout E;
              lce::FusedBuffers f;
              lce::declare_exp(in, q, E, &f);
              return E.bytes();
            };
            // With the exponentials there too, their bytes and the regions' come off the tail's room.
            const auto with_dlogits = [&](int64_t rows) { return (rows * e_row + 255) / 256 * 256 + regions(rows); };
            if (p.dw_accumulator && !p.dlogits_in_grad_weight) EXPECT_EQ(p.dw_tail_rows, tail);
            // The last group's products write grad_weight where its storage holds no regions (Plan::
            // dw_written_rows): the tail's rows lie past its float32 copy, the head's over it.
            EXPECT_EQ(p.dw_written_rows, p.dw_accumulator && !p.exp_in_grad_weight ? v - p.dw_tail_rows : 0);
            if (p.dlogits_in_grad_weight) {
              ++exponentials_in_grad_weight;
              const size_t behind = with_dlogits(p.group_rows);
              ASSERT_LE(behind, in.grad_weight_scratch);
              EXPECT_EQ(p.dw_tail_rows,
                        head::accumulator_tail_rows(v, h, (in.grad_weight_scratch - behind) / 256 * 256));
              EXPECT_EQ(S.bytes(), bytes32(p.dw_tail_rows) + behind);
              // The workspace's accumulator grows by no more than twice the budget (and a 128-row tile) over its
              // rows beside the longest tail: one budget more than the plan with the budget's exponentials there.
              EXPECT_LE(bytes32(v - p.dw_tail_rows), bytes32(v - tail) + 2 * budget + bytes32(128));
            }
            if (p.group_rows == n) continue;  // one group (a budget that holds it, or every token for the accumulator)
            // Several groups: the budget holds the group's exponentials and, unless they lie in grad_weight's storage,
            // its other regions (32 + the shared region per token here: a grad_weight, no row statistics); or
            // grad_weight's storage holds both, within the budget and the longest tail's room.
            const auto fits = [&](int64_t rows, int where) {
              if (where == 0) return static_cast<size_t>(rows) * row <= budget;
              if (where == 1) return static_cast<size_t>(rows) * e_row <= budget && regions(rows) <= room;
              return tail > 0 && rows < n && with_dlogits(rows) <= std::min(in.grad_weight_scratch, 2 * budget + room);
            };
            // (The regions beside the budget where grad_weight's storage could hold them: as there.)
            const bool beside = p.dw_accumulator && !p.exp_in_grad_weight && fits(p.group_rows, 1);
            EXPECT_TRUE(fits(p.group_rows, p.dlogits_in_grad_weight ? 2 : p.exp_in_grad_weight || beside ? 1 : 0));
            // And no fewer groups would do, any way.
            const int64_t groups = (n + p.group_rows - 1) / p.group_rows;
            if (groups > 1) {
              const int64_t fewer = (n + groups - 2) / (groups - 1);
              EXPECT_FALSE(fits(fewer, 0));
              if (p.dw_accumulator) EXPECT_FALSE(fits(fewer, 1));
              if (p.dw_accumulator) EXPECT_FALSE(fits(fewer, 2));
            }
          }
  EXPECT_GT(exponentials_in_grad_weight, 0);  // the sweep reaches that plan
}

// head::accumulator_tail_rows: as many rows as fit, in whole 128-row tiles from the end, and no more than leave the
// tail's float32 copy (from up to 256 bytes into grad_weight's storage) ending before the 16-bit rows it is cast into.
TEST(LinearHeadPlan, AccumulatorTailRows) {
  for (const int64_t v : {1, 100, 129, 1000, 7777, 128256, 256000})
    for (const int64_t h : {1, 8, 96, 2048, 2304})
      for (const size_t bytes : {size_t{0}, size_t{1000}, static_cast<size_t>(v * h), static_cast<size_t>(2 * v * h)}) {
        SCOPED_TRACE(::testing::Message() << "v " << v << " h " << h << " bytes " << bytes);
        const auto fits = [&](int64_t t) {
          return t == 0 || (t <= v && static_cast<size_t>(4 * t * h) <= bytes && 256 + 4 * t * h <= 2 * (v - t) * h);
        };
        const int64_t t = head::accumulator_tail_rows(v, h, bytes);
        EXPECT_GE(t, 0);
        EXPECT_TRUE(fits(t));
        if (t > 0) EXPECT_EQ((v - t) % 128, 0);
        // The next whole tile would not fit.
        const int64_t next = t > 0 ? t + 128 : v - (v - 1) / 128 * 128;
        if (next > 0 && next < v) EXPECT_FALSE(fits(next)) << "next " << next;
      }
  // 128256 x 2048: a third of the rows at most (42751), from row 85632 on.
  EXPECT_EQ(head::accumulator_tail_rows(128256, 2048, size_t{128256} * 2048 * 2 - 256), 128256 - 85632);
}

// head::DwAccumulator::rows_written_by: only the last of several token groups writes grad_weight's rows, as many
// of the head's as the plan allows.
TEST(LinearHeadPlan, OnlyTheLastOfSeveralGroupsWritesGradWeight) {
  float sums[1] = {};
  head::DwAccumulator acc{sums, nullptr, 0, 700};
  const int64_t n = 5000, v = 1000;
  EXPECT_EQ(acc.rows_written_by(0, 2048, n, v), 0);     // the first group sets the sums
  EXPECT_EQ(acc.rows_written_by(2048, 2048, n, v), 0);  // a middle one adds to them
  EXPECT_EQ(acc.rows_written_by(4096, 904, n, v), 700);
  EXPECT_EQ(acc.rows_written_by(0, n, n, v), 0);  // one group: nothing to add to, the sums are cast
  acc.tail = sums;                                // a tail from row 600 on: the head's 600 rows at most
  acc.split = 600;
  EXPECT_EQ(acc.rows_written_by(4096, 904, n, v), 600);
  acc.written = 0;  // a plan that writes nothing
  EXPECT_EQ(acc.rows_written_by(4096, 904, n, v), 0);
}

// The gradient in forward's float32 accumulator keeps its last rows in a contiguous 16-bit grad_weight's storage
// (Plan::dw_tail_rows), before the fused path's regions there; the workspace holds the rest. Not for the steps,
// weight-dtype accumulation, a float32 grad_weight or one group.
TEST(LinearCrossEntropyPlan, AccumulatorTailInGradWeight) {
  const size_t gw = size_t{128256} * 2048 * 2 - 256;
  for (const bool fused : {true, false}) {
    SCOPED_TRACE(fused ? "fused" : "generic");
    lce::PlanInputs in = llama_inputs(lce::Pass::kForwardBackward, 16384, 2048, 128256);
    in.fused = in.fused_exp = fused;
    in.target_sort_bytes = size_t{1} << 20;
    in.grad_weight_scratch = gw;
    EXPECT_FALSE(lce::plan_linear_cross_entropy(in).exp_in_grad_weight);  // the regions beside the budget
    in.dw_written = false;  // (which puts them in grad_weight's storage: as below)
    const lce::Plan p = lce::plan_linear_cross_entropy(in);
    ASSERT_TRUE(p.dw_accumulator);
    EXPECT_EQ(p.dw_tail_rows, 128256 - 85632);
    EXPECT_EQ(p.exp_in_grad_weight, fused);
    lce::Buffers b;
    head::WorkspaceLayout L, S;
    lce::declare_workspace(in, p, L, &b, &S);
    L.carve(reinterpret_cast<void*>(uintptr_t{1} << 40));
    S.carve(reinterpret_cast<void*>(uintptr_t{1} << 44));
    EXPECT_LE(S.bytes(), gw);
    // The tail first in the storage, every other region there after it; the workspace's accumulator holds the rest.
    const auto tail_end = (uintptr_t{1} << 44) + static_cast<uintptr_t>(p.dw_tail_rows) * 2048 * 4;
    EXPECT_EQ(reinterpret_cast<uintptr_t>(b.dw_tail), uintptr_t{1} << 44);
    for (const auto& r : S.regions())
      if (r.first > 0) EXPECT_GE((uintptr_t{1} << 44) + r.first, tail_end);
    bool head_rows = false;
    for (const auto& r : L.regions())
      if ((uintptr_t{1} << 40) + r.first == reinterpret_cast<uintptr_t>(b.head.dw_acc))
        head_rows = r.second == size_t{85632} * 2048 * 4;
    EXPECT_TRUE(head_rows);
    // Without the storage (padded rows): the whole accumulator in the workspace.
    lce::PlanInputs padded = in;
    padded.grad_weight_scratch = 0;
    EXPECT_EQ(lce::plan_linear_cross_entropy(padded).dw_tail_rows, 0);
    // The generic plan's workspace shrinks by the tail exactly; the fused one's budget then also holds the
    // regions (a few groups' more).
    const size_t tail_bytes = size_t{42624} * 2048 * 4, padded_bytes = lce::plan_linear_cross_entropy(padded).bytes;
    if (fused)
      EXPECT_GE(padded_bytes, p.bytes + tail_bytes - (size_t{32} << 20));
    else
      EXPECT_EQ(padded_bytes, p.bytes + tail_bytes);
  }
  lce::PlanInputs in = llama_inputs(lce::Pass::kForwardBackward, 16384, 2048, 128256);
  in.grad_weight_scratch = gw;
  in.dw_weight_dtype = true;
  EXPECT_EQ(lce::plan_linear_cross_entropy(in).dw_tail_rows, 0);
  in.dw_weight_dtype = false;
  in.grad_weight_f32 = true;
  EXPECT_EQ(lce::plan_linear_cross_entropy(in).dw_tail_rows, 0);
  in.grad_weight_f32 = false;
  in.n = 1024;  // one group: no accumulator
  EXPECT_EQ(lce::plan_linear_cross_entropy(in).dw_tail_rows, 0);
  in.n = 16384;
  in.steps = true;
  in.chunk_tokens = 1024;
  const lce::Plan steps = lce::plan_linear_cross_entropy(in);
  EXPECT_TRUE(steps.dw_accumulator);
  EXPECT_EQ(steps.dw_tail_rows, 0);
}

TEST(LinearCrossEntropyPlan, ExplicitChunksAndTinyBudgets) {
  lce::PlanInputs in = llama_inputs(lce::Pass::kForwardBackward, 100, 16, 1000);
  in.chunk_tokens = 7;
  Laid p = lay(in);
  EXPECT_EQ(p.group_rows, 7);
  EXPECT_LE(p.chunk_rows, 7);
  EXPECT_TRUE(p.dw_accumulator);
  in.chunk_tokens = 0;
  in.memory_budget = 1;  // smaller than one row: still one row at a time
  p = lay(in);
  EXPECT_EQ(p.chunk_rows, 1);
  EXPECT_GE(p.group_rows, 1);
  expect_layout_sound(p);
  in = llama_inputs(lce::Pass::kBackward, 100, 16, 1000);
  in.chunk_vocab = 333;
  p = lay(in);
  EXPECT_EQ(p.vocab_cols, 333);
  EXPECT_EQ(p.ld_logits, 336);
  in.chunk_vocab = 5000;
  EXPECT_EQ(lay(in).vocab_cols, 1000);
  // No tokens: nothing but the scalars.
  in = llama_inputs(lce::Pass::kForwardBackward, 0, 16, 1000);
  p = lay(in);
  EXPECT_EQ(off(p.b.head.logits), kNone);
  EXPECT_EQ(off(p.b.head.cublas), kNone);
}

// GradWeightAccumulation::kWeightDtype: no float32 grad_weight accumulator, so nothing to trade against holding every
// token's gradient: groups from the budget alone, the workspace within it.
TEST(LinearCrossEntropyPlan, WeightDtypeAccumulationPlansNoAccumulator) {
  const auto weight_dtype = [](lce::PlanInputs in) {
    in.dw_weight_dtype = true;
    return in;
  };
  // Gemma-2-like (groups of 640 either way): the workspace shrinks by exactly the accumulator, 4 V H bytes.
  lce::PlanInputs in = llama_inputs(lce::Pass::kForwardBackward, 8192, 2304, 256000);
  Laid f32 = lay(in), wd = lay(weight_dtype(in));
  EXPECT_TRUE(f32.dw_accumulator);
  EXPECT_FALSE(wd.dw_accumulator);
  EXPECT_EQ(off(wd.b.head.dw_acc), kNone);
  EXPECT_EQ(wd.chunk_rows, f32.chunk_rows);
  EXPECT_EQ(wd.group_rows, f32.group_rows);
  EXPECT_EQ(f32.bytes - wd.bytes, size_t{4} * 256000 * 2304);
  expect_layout_sound(wd);
  // Llama-like: the float32 plan holds every token's gradient (one group, 2.1 GB, no accumulator); this one takes
  // groups from the 512 MiB budget (7 of 1280 tokens) and stays within it (plus cuBLAS's and the per-token scratch).
  in = llama_inputs(lce::Pass::kForwardBackward, 8192, 4096, 128256);
  f32 = lay(in);
  wd = lay(weight_dtype(in));
  EXPECT_EQ(f32.group_rows, 8192);
  EXPECT_EQ(wd.chunk_rows, 384);
  EXPECT_EQ(wd.group_rows, 1280);
  EXPECT_FALSE(wd.dw_accumulator);
  EXPECT_LE(wd.bytes, (size_t{512} << 20) + in.cublas_workspace_bytes + (size_t{1} << 20));
  expect_layout_sound(wd);
  // The vocabulary-parallel steps: the same trade (groups of whole chunks).
  lce::PlanInputs st = llama_inputs(lce::Pass::kForwardBackward, 16384, 4096, 64128);
  st.steps = true;
  st.chunk_tokens = 512;
  f32 = lay(st);
  wd = lay(weight_dtype(st));
  EXPECT_TRUE(f32.dw_accumulator);
  EXPECT_FALSE(wd.dw_accumulator);
  EXPECT_EQ(wd.group_rows, f32.group_rows);
  EXPECT_EQ(f32.bytes - wd.bytes, size_t{4} * 64128 * 4096);
  // The fused exponential form sums in grad_weight too.
  lce::PlanInputs fx = llama_inputs(lce::Pass::kForwardBackward, 16384, 2048, 128256);
  fx.fused = fx.fused_exp = true;
  wd = lay(weight_dtype(fx));
  EXPECT_EQ(wd.kernel, lce::Kernel::kHopperFused);
  EXPECT_FALSE(wd.dw_accumulator);
  EXPECT_EQ(off(wd.b.head.dw_acc), kNone);
  expect_layout_sound(wd);
  // Where there is no float32 accumulation to replace, the plan is unchanged: a float32 grad_weight, no
  // grad_weight, the recompute backward.
  lce::PlanInputs g32 = in;
  g32.grad_weight_f32 = true;
  EXPECT_EQ(lay(weight_dtype(g32)).bytes, lay(g32).bytes);
  lce::PlanInputs frozen = in;
  frozen.need_dw = false;
  EXPECT_EQ(lay(weight_dtype(frozen)).bytes, lay(frozen).bytes);
  const lce::PlanInputs back = llama_inputs(lce::Pass::kBackward, 8192, 4096, 128256);
  EXPECT_EQ(lay(weight_dtype(back)).bytes, lay(back).bytes);
  EXPECT_EQ(lay(weight_dtype(back)).vocab_cols, lay(back).vocab_cols);
  // The cost model counts the 16-bit sums at half the float32 accumulator's bytes: never more reason to recompute.
  for (const auto& [n, h, v] :
       {std::tuple{8192, 2304, 256000}, std::tuple{16384, 2048, 128256}, std::tuple{8192, 4096, 128256}}) {
    const lce::PlanInputs gif = llama_inputs(lce::Pass::kForwardBackward, n, h, v);
    if (lce::recompute_is_faster(weight_dtype(gif))) EXPECT_TRUE(lce::recompute_is_faster(gif)) << n << "x" << h;
  }
  EXPECT_FALSE(lce::recompute_is_faster(weight_dtype(llama_inputs(lce::Pass::kForwardBackward, 8192, 4096, 128256))));
}

// ---- bad input ----------------------------------------------------------------------------------------------
struct Small {
  int64_t N = 4, H = 6, V = 5;
  TestTensor hidden{DType::kFloat32, {4, 6}}, weight{DType::kFloat32, {5, 6}}, target{DType::kInt64, {4}},
      loss{DType::kFloat32, {}}, lse{DType::kFloat32, {4}}, gx{DType::kFloat32, {4, 6}}, gw{DType::kFloat32, {5, 6}},
      bias{DType::kFloat32, {5}}, gb{DType::kFloat32, {5}};
  Small() {
    hidden.fill_normal(1, 1.f);
    weight.fill_normal(2, 1.f);
    bias.fill_normal(3, 1.f);
    for (int64_t i = 0; i < 4; ++i) target.set_index(i, i);
    lse.fill_storage_bytes(0);
  }
  std::string forward(const TensorView& h, const TensorView& w, const TensorView& b, const TensorView& t,
                      const TensorView& l, LinearCrossEntropyOptions o = {}) {
    return error_of([&] { linear_cross_entropy_forward(h, w, b, t, {}, o, l, {}, {}, nullptr); });
  }
  std::string fwd_bwd(const TensorView& gxv, const TensorView& gwv, const TensorView& gbv, const TensorView& b) {
    return error_of([&] {
      linear_cross_entropy_forward_backward(hidden.host_view(), weight.host_view(), b, target.host_view(), {}, {},
                                            loss.host_view(), {}, gxv, gwv, gbv, {}, {}, nullptr);
    });
  }
};

bool has(const std::string& msg, const std::string& what) { return msg.find(what) != std::string::npos; }

TEST(LinearCrossEntropyErrors, ShapesAndDtypes) {
  Small s;
  const TensorView h = s.hidden.host_view(), w = s.weight.host_view(), t = s.target.host_view(), l = s.loss.host_view();
  TestTensor w7(DType::kFloat32, {5, 7});
  EXPECT_TRUE(has(s.forward(h, w7.host_view(), {}, t, l), "weight: expected shape [V, 6]"));
  TestTensor wbf(DType::kBFloat16, {5, 6});
  EXPECT_TRUE(has(s.forward(h, wbf.host_view(), {}, t, l), "weight: expected dtype float32 (hidden's), got bfloat16"));
  TestTensor b4(DType::kFloat32, {4});
  EXPECT_TRUE(has(s.forward(h, w, b4.host_view(), t, l), "bias: expected shape [5]"));
  TestTensor t3(DType::kInt64, {3});
  EXPECT_TRUE(has(s.forward(h, w, {}, t3.host_view(), l), "target: expected shape [4]"));
  TestTensor tf(DType::kFloat32, {4});
  EXPECT_TRUE(has(s.forward(h, w, {}, tf.host_view(), l), "target: expected dtype int32 or int64"));
  TestTensor hi(DType::kInt32, {4, 6});
  EXPECT_TRUE(has(s.forward(hi.host_view(), w, {}, t, l), "hidden: expected dtype float32, float16 or bfloat16"));
  TestTensor l4(DType::kFloat32, {4});
  EXPECT_TRUE(has(s.forward(h, w, {}, t, l4.host_view()), "loss: expected 1 elements"));
  TensorView strided_w = w;
  strided_w.strides[1] = 2;
  EXPECT_TRUE(has(s.forward(h, strided_w, {}, t, l), "weight: expected a last dimension with stride 1"));
  TensorView overlapping_w = w;
  overlapping_w.strides[0] = 3;
  EXPECT_TRUE(has(s.forward(h, overlapping_w, {}, t, l), "weight: expected a row stride >= 6"));
  TensorView strided_h = h;
  strided_h.strides[1] = 2;
  EXPECT_TRUE(has(s.forward(strided_h, w, {}, t, l), "hidden: expected a last dimension with stride 1"));
  TensorView cuda_w = w;
  cuda_w.device = {DeviceType::kCUDA, 0};
  EXPECT_TRUE(has(s.forward(h, cuda_w, {}, t, l), "weight: expected device cpu, got cuda:0"));
  LinearCrossEntropyOptions o;
  o.label_smoothing = 1.5;
  EXPECT_TRUE(has(s.forward(h, w, {}, t, l, o), "label_smoothing"));
  o = {};
  o.memory_budget = 0;
  EXPECT_TRUE(has(s.forward(h, w, {}, t, l, o), "memory_budget"));
  o = {};
  o.chunk_tokens = -1;
  EXPECT_TRUE(has(s.forward(h, w, {}, t, l, o), "chunk_tokens"));
}

TEST(LinearCrossEntropyErrors, GradientOutputs) {
  Small s;
  const TensorView gx = s.gx.host_view(), gw = s.gw.host_view();
  // Rows of two strides cannot be written by one GEMM.
  TestTensor gx3(DType::kFloat32, {2, 2, 6}, {18, 6, 1});
  TensorView gx_view = gx3.host_view();
  TestTensor h3(DType::kFloat32, {2, 2, 6});
  h3.fill_normal(5, 1.f);
  TestTensor t3(DType::kInt64, {2, 2});
  for (int64_t i = 0; i < 4; ++i) t3.set_index(i, i);
  const std::string m = error_of([&] {
    linear_cross_entropy_forward_backward(h3.host_view(), s.weight.host_view(), {}, t3.host_view(), {}, {},
                                          s.loss.host_view(), {}, gx_view, {}, {}, {}, {}, nullptr);
  });
  EXPECT_TRUE(has(m, "grad_hidden: expected rows with one common stride")) << m;
  TestTensor gw16(DType::kFloat16, {5, 6});
  EXPECT_TRUE(has(s.fwd_bwd(gx, gw16.host_view(), {}, {}), "grad_weight: expected dtype float32 (weight's)"));
  EXPECT_TRUE(has(s.fwd_bwd(gx, gw, s.gb.host_view(), {}), "grad_bias: expected None (there is no bias)"));
  // A gradient output may not share memory with an input.
  EXPECT_TRUE(
      has(s.fwd_bwd(s.hidden.host_view(), gw, {}, {}), "grad_hidden: expected memory that does not overlap hidden"));
  EXPECT_TRUE(
      has(s.fwd_bwd(gx, s.weight.host_view(), {}, {}), "grad_weight: expected memory that does not overlap weight"));
  // The backward needs the forward's lse.
  const std::string b = error_of([&] {
    linear_cross_entropy_backward(s.hidden.host_view(), s.weight.host_view(), {}, s.target.host_view(), {}, {},
                                  s.loss.host_view(), {}, gx, gw, {}, {}, nullptr);
  });
  EXPECT_TRUE(has(b, "lse: expected a tensor, got None")) << b;
}

TEST(LinearCrossEntropyErrors, BadTargetNamesFirstRowAndWritesNothing) {
  Small s;
  s.target.set_index(2, 5);
  s.target.set_index(3, -1);
  s.loss.fill_storage_nan();
  Error::Kind kind{};
  const std::string msg = error_of(
      [&] {
        linear_cross_entropy_forward(s.hidden.host_view(), s.weight.host_view(), {}, s.target.host_view(), {}, {},
                                     s.loss.host_view(), {}, {}, nullptr);
      },
      &kind);
  EXPECT_TRUE(has(msg, "target: expected values in [0, 5)")) << msg;
  EXPECT_TRUE(has(msg, "got 5 at row 2")) << msg;
  EXPECT_EQ(kind, Error::Kind::kInvalidArgument);
  EXPECT_TRUE(std::isnan(s.loss.get(0)));
}

// The public advice behind schedule="auto": false on the CPU and for float32, the planner's model on CUDA, and
// bad sizes rejected with the argument's name.
TEST(LinearCrossEntropySchedule, RecomputeIsFasterQuery) {
  const LinearCrossEntropyOptions o;
  const Device cpu{DeviceType::kCPU, 0};
  EXPECT_FALSE(
      linear_cross_entropy_recompute_is_faster(8192, 2304, 256000, DType::kBFloat16, cpu, true, true, false, o));
  EXPECT_TRUE(has(error_of([&] {
                    linear_cross_entropy_recompute_is_faster(-1, 2304, 256000, DType::kBFloat16, cpu, true, true, false,
                                                             o);
                  }),
                  "n_tokens"));
  EXPECT_TRUE(has(error_of([&] {
                    linear_cross_entropy_recompute_is_faster(8, 0, 256000, DType::kBFloat16, cpu, true, true, false, o);
                  }),
                  "hidden"));
  EXPECT_TRUE(has(error_of([&] {
                    linear_cross_entropy_recompute_is_faster(8, 16, 0, DType::kBFloat16, cpu, true, true, false, o);
                  }),
                  "vocab"));
  EXPECT_TRUE(has(
      error_of([&] { linear_cross_entropy_recompute_is_faster(8, 16, 32, DType::kInt64, cpu, true, true, false, o); }),
      "dtype"));
}

#if defined(LOGITLESS_WITH_CUDA)  // fused_kernels_run
TEST(LinearCrossEntropyCudaSchedule, RecomputeIsFasterQuery) {
  LOGITLESS_SKIP_WITHOUT_GPU();
  LinearCrossEntropyOptions o;
  const Device gpu{DeviceType::kCUDA, 0};
  // 256000 classes: the fused kernels' exponentials in grad_weight's storage make 4 token groups (gradient in
  // forward); the generic ones 13. An eighth of the budget makes more groups either way (recompute).
  EXPECT_EQ(linear_cross_entropy_recompute_is_faster(8192, 2304, 256000, DType::kBFloat16, gpu, true, true, false, o),
            !fused_kernels_run());
  o.memory_budget = size_t{64} << 20;
  EXPECT_TRUE(
      linear_cross_entropy_recompute_is_faster(8192, 2304, 256000, DType::kBFloat16, gpu, true, true, false, o));
  o.memory_budget = size_t{512} << 20;
  EXPECT_FALSE(
      linear_cross_entropy_recompute_is_faster(16384, 2048, 128256, DType::kBFloat16, gpu, true, true, false, o));
  EXPECT_FALSE(
      linear_cross_entropy_recompute_is_faster(8192, 4096, 128256, DType::kBFloat16, gpu, true, true, true, o));
  EXPECT_FALSE(
      linear_cross_entropy_recompute_is_faster(8192, 2304, 256000, DType::kFloat32, gpu, true, true, false, o));
  EXPECT_FALSE(
      linear_cross_entropy_recompute_is_faster(8192, 2304, 256000, DType::kBFloat16, gpu, true, false, false, o));
}
#endif

TEST(LinearCrossEntropyCudaErrors, BadTargetAndSmallWorkspace) {
  LOGITLESS_SKIP_WITHOUT_GPU();
  Small s;
  s.target.set_index(1, 9);
  for (TestTensor* t : {&s.hidden, &s.weight, &s.target, &s.loss}) t->to_device();
  const TensorView h = s.hidden.view(true), w = s.weight.view(true), t = s.target.view(true), l = s.loss.view(true);
  const size_t bytes = linear_cross_entropy_forward_workspace_bytes(h, w, t, {});
  EXPECT_GT(bytes, 0u);
  DeviceScratch ws(bytes);
  std::string msg = error_of([&] { linear_cross_entropy_forward(h, w, {}, t, {}, {}, l, {}, ws.ws(), nullptr); });
  EXPECT_TRUE(has(msg, "got 9 at row 1")) << msg;
  msg = error_of([&] {
    linear_cross_entropy_forward(h, w, {}, t, {}, {}, l, {}, Workspace{ws.ws().data, bytes - 1}, nullptr);
  });
  EXPECT_TRUE(has(msg, "workspace: expected >=")) << msg;
}

// ---- row statistics (LinearCrossEntropyOptions::row_stats) ----------------------------------------------------
struct RowStatsOut {
  std::vector<double> loss, entropy;
  std::vector<int> top1;
};

// The forward or the gradient in forward with the row statistics (no bias gradient: the fused exponential form
// takes none), outputs poisoned before the call.
RowStatsOut run_row_stats(LceInputs& in, Entry e, bool dev, Chunking ch = Chunking::kDefault) {
  const int64_t H = in.c.h, V = in.c.v;
  const bool none = in.opt.reduction == Reduction::kNone;
  TestTensor loss(DType::kFloat32, none ? in.lead : std::vector<int64_t>{}), entropy(DType::kFloat32, in.lead);
  TestTensor top1(DType::kUInt8, in.lead), gx(in.c.dtype, with_last(in.lead, H)), gw(in.c.dtype, {V, H});
  for (TestTensor* t : {&loss, &entropy, &gx, &gw}) t->fill_storage_nan();
  top1.fill_storage_bytes(0x5A);
  if (dev) {
    in.to_device();
    for (TestTensor* t : {&loss, &entropy, &top1, &gx, &gw}) t->to_device();
  }
  LinearCrossEntropyOptions o = chunked(in, ch);
  o.row_stats = true;
  const TensorView h = in.hidden.view(dev), w = in.weight.view(dev), t = in.target.view(dev);
  const LinearCrossEntropyRowStats rs{entropy.view(dev), top1.view(dev)};
  if (e == Entry::kForward) {
    DeviceScratch ws(dev ? linear_cross_entropy_forward_workspace_bytes(h, w, t, o) : 0);
    linear_cross_entropy_forward(h, w, in.bv(dev), t, in.cwv(dev), o, loss.view(dev), {}, ws.ws(), nullptr, rs);
  } else {
    const TensorView gxv = gx.view(dev), gwv = gw.view(dev);
    DeviceScratch ws(dev ? linear_cross_entropy_forward_backward_workspace_bytes(h, w, t, gxv, gwv, {}, o) : 0);
    linear_cross_entropy_forward_backward(h, w, in.bv(dev), t, in.cwv(dev), o, loss.view(dev), {}, gxv, gwv, {}, {},
                                          ws.ws(), nullptr, rs);
  }
  if (dev) {
    device_synchronize();
    for (TestTensor* x : {&loss, &entropy, &top1}) x->to_host();
  }
  RowStatsOut out;
  for (float f : loss.gather_float()) out.loss.push_back(f);
  for (float f : entropy.gather_float()) out.entropy.push_back(f);
  const uint8_t* flags = static_cast<const uint8_t*>(top1.host_view().data);  // contiguous
  for (int64_t i = 0; i < top1.numel(); ++i) out.top1.push_back(flags[i]);
  return out;
}

// Brute force in double from the inputs' values: the entropy of softmax of the capped logits, the first maximum of
// the logits, and each valid row's margin (its target's logit against the largest other one) for near-ties.
struct WantRowStats {
  std::vector<double> entropy, margin;
  std::vector<int> top1;
};

WantRowStats reference_row_stats(const LceInputs& in) {
  const int64_t N = in.c.n, H = in.c.h, V = in.c.v;
  const double cap = in.opt.softcap;
  WantRowStats r;
  for (int64_t i = 0; i < N; ++i) {
    const int64_t t = in.target.get_index(i);
    double entropy = 0, margin = INFINITY;
    int top1 = 0;
    if (t != in.opt.ignore_index && (t < 0 || t >= V)) entropy = NAN;
    if (t != in.opt.ignore_index && t >= 0 && t < V) {
      std::vector<double> z(V), x(V);
      bool nan = false;
      int64_t first = 0;
      double m = -INFINITY, other = -INFINITY;
      for (int64_t j = 0; j < V; ++j) {
        double acc = in.has_bias() ? static_cast<double>(in.bias.get(j)) : 0.0;
        for (int64_t k = 0; k < H; ++k) acc += static_cast<double>(in.hidden.get(i * H + k)) * in.weight.get(j * H + k);
        z[j] = acc;
        x[j] = cap > 0 ? cap * std::tanh(acc / cap) : acc;
        nan = nan || std::isnan(acc);
        if (z[j] > z[first]) first = j;
        m = std::max(m, x[j]);
        if (j != t) other = std::max(other, acc);
      }
      top1 = !nan && first == t;
      margin = std::abs(z[t] - other);
      if (nan || std::isinf(m)) {
        entropy = NAN;
      } else {
        double s = 0;
        for (int64_t j = 0; j < V; ++j) s += std::exp(x[j] - m);
        const double lse = m + std::log(s);
        for (int64_t j = 0; j < V; ++j) {
          const double pj = std::exp(x[j] - lse);
          if (pj > 0) entropy -= pj * (x[j] - lse);
        }
      }
    }
    r.entropy.push_back(entropy);
    r.top1.push_back(top1);
    r.margin.push_back(margin);
  }
  return r;
}

// is_top1 equal on every row whose target is more than `tie` (relative) from the largest other logit.
void expect_top1(const std::vector<int>& got, const WantRowStats& want, double tie, const std::string& what) {
  ASSERT_EQ(got.size(), want.top1.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    if (!(want.margin[i] <= tie))
      EXPECT_EQ(got[i], want.top1[i]) << what << " is_top1 at row " << i << " (margin " << want.margin[i] << ")";
}

void expect_row_stats(const RowStatsOut& got, const WantRowStats& want, Tol tol, double tie, const std::string& what) {
  EXPECT_TRUE(all_close(got.entropy, want.entropy, tol, std::max(1.0, max_abs(want.entropy)), what + " entropy"));
  expect_top1(got.top1, want, tie, what);
}

std::vector<LceCase> row_stats_cpu_cases() {
  std::vector<LceCase> cases;
  for (DType dt : {DType::kFloat32, DType::kBFloat16}) {
    for (Preset p : {Preset::kPlain, Preset::kIgnore, Preset::kSoftcap, Preset::kAll, Preset::kAllIgnored,
                     Preset::kBadTargetNoCheck, Preset::kWide})
      cases.push_back({12, 20, 53, dt, Layout::kContiguous, p, Reduction::kMean, p == Preset::kAll});
    cases.push_back({0, 8, 11, dt, Layout::kContiguous, Preset::kPlain, Reduction::kSum, false});
    cases.push_back({1, 5, 1, dt, Layout::kPadded, Preset::kPlain, Reduction::kNone, true});
    cases.push_back({7, 33, 101, dt, Layout::kShifted, Preset::kIgnore, Reduction::kNone, true});
  }
  return cases;
}

// The CPU oracle against brute force; the loss and gradients are those of the call without the statistics.
TEST(LinearCrossEntropyRowStats, CpuMatchesBruteForce) {
  for (const LceCase& c : row_stats_cpu_cases()) {
    SCOPED_TRACE(case_name(c));
    LceInputs in(c, seed_of(c));
    const WantRowStats want = reference_row_stats(in);
    const auto up = std::vector<double>(c.reduction == Reduction::kNone ? std::max<int64_t>(c.n, 1) : 1, 1.0);
    for (Entry e : {Entry::kForward, Entry::kForwardBackward}) {
      if (e == Entry::kForwardBackward && c.reduction == Reduction::kNone) continue;
      SCOPED_TRACE(entry_name(e));
      const RowStatsOut got = run_row_stats(in, e, /*dev=*/false);
      expect_row_stats(got, want, Tol{1e-5, 1e-5}, 1e-5, "cpu");
      const Outputs plain = run_backend(in, e, /*dev=*/false, up, nullptr);
      EXPECT_TRUE(all_close(got.loss, plain.loss, Tol{0, 0}, 1.0, "loss with and without the statistics"));
    }
  }
}

// Logits set exactly (an identity weight: z = hidden + bias, every value exact in bfloat16 and in the GEMMs' float32
// sums), V = H = 520 (three 256-column tiles): ties within and across tiles, classes masked to -inf by the bias, a
// NaN row, ignored and bad rows, a target far below its row's maximum and a tile far above the target (the exponential
// form's far-tile rule). all_masked: every bias -inf (rows of -inf only: entropy NaN, is_top1 for target 0 only).
LceInputs exact_logits_inputs(DType dt, bool all_masked) {
  const int64_t N = 12, V = 520;
  LceInputs in(LceCase{N, V, V, dt, Layout::kContiguous, Preset::kIgnore, Reduction::kSum, true}, 7);
  in.opt.check_targets = false;
  for (int64_t j = 0; j < V; ++j)
    for (int64_t k = 0; k < V; ++k) in.weight.set(j * V + k, j == k ? 1.f : 0.f);
  for (int64_t j = 0; j < V; ++j) in.bias.set(j, all_masked ? -INFINITY : (j == 200 || j == 450) ? -INFINITY : 0.f);
  for (int64_t i = 0; i < N; ++i)
    for (int64_t k = 0; k < V; ++k) in.hidden.set(i * V + k, static_cast<float>((i * 7 + k * 13) % 17) * 0.25f - 2.f);
  const auto put = [&](int64_t i, int64_t k, float v) { in.hidden.set(i * V + k, v); };
  for (int64_t i : {0, 1}) put(i, 10, 9.f), put(i, 300, 9.f);  // a tie across tiles
  for (int64_t i : {2, 3}) put(i, 3, 8.f), put(i, 4, 8.f);     // a tie within a tile
  put(5, 7, NAN);
  put(7, 60, -100.f), put(7, 61, 5.f);   // the target far below the maximum
  put(8, 400, 80.f), put(8, 401, 80.f);  // a tile far above the target's logit
  const int64_t targets[N] = {10, 300, 4, 3, in.opt.ignore_index, 0, 200, 60, 5, V + 3, 519, 512};
  for (int64_t i = 0; i < N; ++i) in.target.set_index(i, targets[i]);
  if (all_masked) in.target.set_index(11, 0);
  return in;
}

TEST(LinearCrossEntropyRowStats, ExactTiesInfinitiesAndOddRows) {
  for (DType dt : {DType::kFloat32, DType::kBFloat16}) {
    for (bool all_masked : {false, true}) {
      SCOPED_TRACE(dtype_tag(dt) + (all_masked ? " every class masked" : ""));
      LceInputs in = exact_logits_inputs(dt, all_masked);
      const WantRowStats want = reference_row_stats(in);
      if (!all_masked) {  // the construction's own answers
        EXPECT_EQ(want.top1[0], 1);
        EXPECT_EQ(want.top1[1], 0);
        EXPECT_EQ(want.top1[2], 0);
        EXPECT_EQ(want.top1[3], 1);
        EXPECT_TRUE(std::isnan(want.entropy[5]));
      } else {
        EXPECT_EQ(want.top1[11], 1);
        EXPECT_EQ(want.top1[5], 0);  // a NaN row
      }
      for (Entry e : {Entry::kForward, Entry::kForwardBackward}) {
        SCOPED_TRACE(entry_name(e));
        expect_row_stats(run_row_stats(in, e, /*dev=*/false), want, Tol{1e-5, 1e-5}, -1.0, "cpu");
      }
    }
  }
}

TEST(LinearCrossEntropyRowStats, Errors) {
  Small s;
  const TensorView h = s.hidden.host_view(), w = s.weight.host_view(), t = s.target.host_view(), l = s.loss.host_view();
  TestTensor entropy(DType::kFloat32, {4}), top1(DType::kBool, {4}), top1_f(DType::kFloat32, {4}),
      e3(DType::kFloat32, {3});
  const LinearCrossEntropyRowStats rs{entropy.host_view(), top1.host_view()};
  LinearCrossEntropyOptions on;
  on.row_stats = true;
  const auto forward = [&](const LinearCrossEntropyOptions& o, const LinearCrossEntropyRowStats& r) {
    return error_of([&] { linear_cross_entropy_forward(h, w, {}, t, {}, o, l, {}, {}, nullptr, r); });
  };
  EXPECT_EQ(forward(on, rs), "");
  EXPECT_TRUE(has(forward({}, rs), "row_stats: expected no entropy or is_top1 output unless options.row_stats"));
  EXPECT_TRUE(has(forward(on, {}), "row_stats.entropy"));
  EXPECT_TRUE(has(forward(on, {entropy.host_view(), {}}), "row_stats.is_top1"));
  EXPECT_TRUE(has(forward(on, {entropy.host_view(), top1_f.host_view()}), "dtype bool or uint8"));
  EXPECT_TRUE(has(forward(on, {e3.host_view(), top1.host_view()}), "row_stats.entropy"));
  EXPECT_TRUE(has(forward(on, {l, top1.host_view()}), "row_stats.entropy"));  // a scalar: one element, not 4
  // A vocabulary shard: refused by name.
  TestTensor partials(DType::kFloat32, {4, 4});
  const std::string msg = error_of([&] {
    linear_cross_entropy_shard_partials(h, w, {}, t, {}, VocabShard{0, 5}, on, partials.host_view(), {}, nullptr);
  });
  EXPECT_TRUE(has(msg, "options.row_stats: expected false for a vocabulary shard")) << msg;
  // The recompute backward ignores it (the forward's outputs).
  TestTensor gx(DType::kFloat32, {4, 6}), up(DType::kFloat32, {});
  up.set(0, 1.f);
  EXPECT_EQ(error_of([&] {
              linear_cross_entropy_backward(h, w, {}, t, {}, s.lse.host_view(), up.host_view(), on, gx.host_view(), {},
                                            {}, {}, nullptr);
            }),
            "");
}

// The planner: the fused forward keeps no row statistics (the generic one runs); the exponential form reserves their
// tile partials, 16 bytes per token and 256 columns on top.
TEST(LinearCrossEntropyPlan, RowStatistics) {
  lce::PlanInputs in = llama_inputs(lce::Pass::kForward, 4096, 4096, 128256);
  in.fused = in.fused_exp = true;
  EXPECT_EQ(lce::plan_linear_cross_entropy(in).kernel, lce::Kernel::kHopperFused);
  in.row_stats = true;
  EXPECT_EQ(lce::plan_linear_cross_entropy(in).kernel, lce::Kernel::kCublasChunked);
  in.pass = lce::Pass::kForwardBackward;
  in.chunk_tokens = 1024;
  in.row_stats = false;
  const lce::Plan plain = lce::plan_linear_cross_entropy(in);
  in.row_stats = true;
  const Laid with = lay(in);
  ASSERT_EQ(with.kernel, lce::Kernel::kHopperFused);
  EXPECT_EQ(with.group_rows, 1024);
  EXPECT_GE(with.bytes, plain.bytes + static_cast<size_t>(1024 * with.stats_row));
  EXPECT_NE(with.b.fused.row_partials, nullptr);
  expect_layout_sound(with);
}

#if defined(LOGITLESS_WITH_CUDA)
std::vector<LceCase> row_stats_cuda_cases() {
  std::vector<LceCase> cases;
  for (DType dt : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    cases.push_back({333, 96, 7777, dt, Layout::kContiguous, Preset::kPlain, Reduction::kMean, false});
    cases.push_back({256, 128, 4099, dt, Layout::kPadded, Preset::kIgnore, Reduction::kSum, true});
    cases.push_back({256, 128, 4099, dt, Layout::kShifted, Preset::kWeights, Reduction::kMean, false});
    cases.push_back({200, 64, 3001, dt, Layout::kContiguous, Preset::kSoftcap, Reduction::kNone, false});
    cases.push_back({96, 40, 1001, dt, Layout::kContiguous, Preset::kBadTargetNoCheck, Reduction::kMean, false});
    cases.push_back({200, 64, 3001, dt, Layout::kContiguous, Preset::kWide, Reduction::kMean, false});
    cases.push_back({1, 64, 32003, dt, Layout::kContiguous, Preset::kPlain, Reduction::kMean, false});
  }
  return cases;
}

// CUDA against the CPU oracle: the forward (generic: the fused forward gives way) and the gradient in forward on
// the fused exponential form (bfloat16 plain options on Hopper), on the generic path (exponential form off), with
// one token group and several.
TEST(LinearCrossEntropyRowStatsCuda, MatchesCpuBackend) {
  LOGITLESS_SKIP_WITHOUT_GPU();
  for (const LceCase& c : row_stats_cuda_cases()) {
    SCOPED_TRACE(case_name(c));
    LceInputs in(c, seed_of(c));
    const RowStatsOut want = run_row_stats(in, Entry::kForward, /*dev=*/false);
    WantRowStats margins = reference_row_stats(in);
    margins.top1 = want.top1;
    for (bool exp_form : {true, false}) {
      lce::debug::set_exp_form(exp_form);
      for (Entry e : {Entry::kForward, Entry::kForwardBackward}) {
        if (e == Entry::kForwardBackward && c.reduction == Reduction::kNone) continue;
        for (Chunking ch : {Chunking::kDefault, Chunking::kSmall}) {
          SCOPED_TRACE(std::string(entry_name(e)) + ", " + chunking_name(ch) + (exp_form ? "" : ", generic"));
          const RowStatsOut got = run_row_stats(in, e, /*dev=*/true, ch);
          if (e == Entry::kForward) EXPECT_EQ(lce::debug::last_kernel.get(), lce::Kernel::kCublasChunked);
          EXPECT_TRUE(all_close(got.entropy, want.entropy, Tol{2e-4, 2e-4}, std::max(1.0, max_abs(want.entropy)),
                                "cuda entropy"));
          expect_top1(got.top1, margins, 1e-4 * (1 + max_abs(want.entropy)), "cuda");
          EXPECT_TRUE(all_close(got.loss, run_row_stats(in, e, false).loss, tolerance(c.dtype, Quantity::kLoss),
                                std::max(1.0, max_abs(want.loss)), "cuda loss"));
        }
      }
    }
    lce::debug::set_exp_form(true);
  }
}

// The exact logits of exact_logits_inputs on every CUDA path: is_top1 exactly as brute force (the ties are exact in
// the GEMMs too), the entropy within float32 rounding; the fused exponential form where the device has it.
TEST(LinearCrossEntropyRowStatsCuda, ExactTiesInfinitiesAndOddRows) {
  LOGITLESS_SKIP_WITHOUT_GPU();
  for (DType dt : {DType::kFloat32, DType::kBFloat16}) {
    for (bool all_masked : {false, true}) {
      SCOPED_TRACE(dtype_tag(dt) + (all_masked ? " every class masked" : ""));
      LceInputs in = exact_logits_inputs(dt, all_masked);
      const WantRowStats want = reference_row_stats(in);
      for (bool exp_form : {true, false}) {
        lce::debug::set_exp_form(exp_form);
        for (Entry e : {Entry::kForward, Entry::kForwardBackward}) {
          for (Chunking ch : {Chunking::kDefault, Chunking::kSmall}) {
            SCOPED_TRACE(std::string(entry_name(e)) + ", " + chunking_name(ch) + (exp_form ? "" : ", generic"));
            expect_row_stats(run_row_stats(in, e, /*dev=*/true, ch), want, Tol{1e-4, 1e-4}, -1.0, "cuda");
          }
        }
      }
      lce::debug::set_exp_form(true);
    }
  }
}

// Which kernel the gradient in forward with row statistics runs: the fused exponential form for bfloat16 plain
// options on Hopper (with its row-statistics epilogue), the generic path otherwise.
TEST(LinearCrossEntropyRowStatsCuda, FusedOnHopperForBfloat16) {
  LOGITLESS_SKIP_WITHOUT_GPU();
  const bool hopper = fused_kernels_run();
  LceInputs in(LceCase{64, 128, 1000, DType::kBFloat16, Layout::kContiguous, Preset::kPlain, Reduction::kMean, false},
               11);
  run_row_stats(in, Entry::kForwardBackward, /*dev=*/true);
  EXPECT_EQ(lce::debug::last_kernel.get(), hopper ? lce::Kernel::kHopperFused : lce::Kernel::kCublasChunked);
}
#endif
}  // namespace
}  // namespace logitless::test
