// Linear policy losses and linear selective log-softmax: the CPU backend against a naive float64 reference, the
// CUDA path against the CPU backend over dtype x layout x loss type x importance level x options x entry point x
// chunking; the chunk planner; bad input.
//
// The reference is written independently of policy_loss/math.h: the logits are products of the inputs' values
// in double, the loss a textbook function of the per-token log-probabilities, whose derivative in each of them is
// taken by central differences (in double, on the cheap [B, L] function); the chain to the logits and on to
// hidden, weight and bias is analytic, and checked against central differences over the inputs on tiny shapes.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <functional>
#include <optional>
#include <random>
#include <set>
#include <sstream>

#include "layout_test_util.h"
#include "linear_policy_loss/cuda/plan.h"
#include "policy_test_util.h"
#include "test_util.h"

namespace logitless::test {
namespace {

// kShifted: hidden [B, L+1, H] contiguous (the GEMMs take all positions in place). kAligned: [B, L, H] with
// padded rows, a padded weight and a padded grad_hidden. kView: hidden[:, -(L+1):, :] of a longer [B, L+4, H]
// (positions of two strides: copied), ids a view too.
enum class Layout { kShifted, kAligned, kView };

const char* layout_name(Layout l) {
  switch (l) {
    case Layout::kShifted:
      return "shifted";
    case Layout::kAligned:
      return "aligned";
    case Layout::kView:
      return "view";
  }
  return "?";
}
struct LplCase {
  int64_t B, L, H, V;
  DType dtype;
  Layout layout;
  Preset preset;
  PolicyLossType type;
  ImportanceSamplingLevel level;
  bool bias;
};

std::string case_name(const LplCase& c) {
  std::ostringstream os;
  os << "B" << c.B << "_L" << c.L << "_H" << c.H << "_V" << c.V << "_" << dtype_tag(c.dtype) << "_"
     << layout_name(c.layout) << "_" << preset_name(c.preset) << "_" << type_name(c.type) << "_" << level_name(c.level)
     << (c.bias ? "_bias" : "");
  return os.str();
}
void PrintTo(const LplCase& c, std::ostream* os) { *os << case_name(c); }

// ---- inputs -------------------------------------------------------------------------------------------------
struct LplInputs : PolicyTokenInputs {
  LplCase c;
  LinearPolicyLossOptions opt;
  int64_t Lg = 0;  // positions per sequence: L + 1 or L
  TestTensor hidden, weight, bias;
  std::vector<double> h64, w64, b64;  // hidden, weight and bias in double, flat order

  LplInputs(const LplCase& cs, uint64_t seed) : c(cs) {
    std::mt19937_64 rng(seed);
    const int64_t B = c.B, L = c.L, H = c.H, V = c.V;
    PolicyLossOptions& po = opt.policy;
    po.loss_type = c.type;
    po.importance_sampling_level = c.level;
    po.beta = 0.0;
    po.max_completion_length = L + 3;
    switch (c.layout) {
      case Layout::kShifted:
        Lg = L + 1;
        hidden = TestTensor(c.dtype, {B, Lg, H});
        weight = TestTensor(c.dtype, {V, H});
        ids = TestTensor(DType::kInt64, {B, L});
        break;
      case Layout::kAligned:
        Lg = L;
        hidden = TestTensor(c.dtype, {B, L, H}, {L * (H + 3), H + 3, 1}, /*offset=*/1);
        weight = TestTensor(c.dtype, {V, H}, {H + 2, 1}, /*offset=*/2);
        ids = TestTensor(DType::kInt32, {B, L});
        break;
      case Layout::kView: {
        Lg = L + 1;
        const int64_t T = L + 4;
        hidden = TestTensor(c.dtype, {B, Lg, H}, {T * H, H, 1}, /*offset=*/(T - Lg) * H);
        weight = TestTensor(c.dtype, {V, H});
        ids = TestTensor(DType::kInt32, {B, L}, {L + 7, 1}, /*offset=*/7);
        break;
      }
    }
    hidden.fill_storage_nan();  // padding poisoned: a kernel that reads outside the view returns NaN
    weight.fill_storage_nan();
    ids.fill_storage_bytes(0x7F);
    hidden.fill_normal(seed, 1.f);
    // Logits of about two units of spread.
    weight.fill_normal(seed + 1, 2.f / std::sqrt(static_cast<float>(H)));
    if (c.bias) {
      bias = TestTensor(c.dtype, {V});
      bias.fill_normal(seed + 2, 0.5f);
    }
    // The inputs' values in double, read by the reference (TestTensor::get per element is too slow for it).
    for (int64_t i = 0; i < hidden.numel(); ++i) h64.push_back(hidden.get(i));
    for (int64_t i = 0; i < weight.numel(); ++i) w64.push_back(weight.get(i));
    for (int64_t j = 0; c.bias && j < V; ++j) b64.push_back(bias.get(j));
    adv = TestTensor(DType::kFloat32, {B});
    fill_random(rng, B, L, V);

    auto token_tensor = [&](DType dt) { return TestTensor(dt, {B, L}); };
    apply_preset(c.preset, B, L, po, token_tensor);
    if (c.preset == Preset::kFloatMask) po.temperature = 1.3;  // this suite runs it at its own temperature
    if (has_mask) write_mask();
    apply_preset_ids(c.preset, V);
    if (has_old || has_ref) make_old_ref(true_logp(*this, B * L), rng, token_tensor);
  }

  int64_t N() const { return c.B * c.L; }
  bool bad(int64_t t) const { return id(t) < 0 || id(t) >= c.V; }
  int64_t pos(int64_t t) const { return (t / c.L) * Lg + t % c.L; }  // the hidden position of token t

  // Perturbations for the finite-difference test: one element of hidden, weight or bias, by `step`.
  int perturb_what = -1;  // 0 hidden, 1 weight, 2 bias
  int64_t perturb_at = -1;
  double perturb_by = 0;
  double hv(int64_t flat) const { return h64[flat] + (perturb_what == 0 && perturb_at == flat ? perturb_by : 0.0); }
  double wv(int64_t flat) const { return w64[flat] + (perturb_what == 1 && perturb_at == flat ? perturb_by : 0.0); }
  double bv(int64_t j) const {
    if (!c.bias) return 0.0;
    return b64[j] + (perturb_what == 2 && perturb_at == j ? perturb_by : 0.0);
  }
  // z_j of token t (not divided by the temperature).
  std::vector<double> z(int64_t t) const {
    std::vector<double> out(static_cast<size_t>(c.V));
    const int64_t p0 = pos(t) * c.H;
    std::vector<double> x(static_cast<size_t>(c.H));
    for (int64_t k = 0; k < c.H; ++k) x[k] = hv(p0 + k);
    for (int64_t j = 0; j < c.V; ++j) {
      double acc = bv(j);
      if (perturb_what == 1) {
        for (int64_t k = 0; k < c.H; ++k) acc += x[k] * wv(j * c.H + k);
      } else {
        const double* wj = w64.data() + j * c.H;
        for (int64_t k = 0; k < c.H; ++k) acc += x[k] * wj[k];
      }
      out[j] = acc;
    }
    return out;
  }

  std::vector<double> row(int64_t t) const {  // z(t) / temperature
    std::vector<double> x = z(t);
    for (double& v : x) v /= opt.policy.temperature;
    return x;
  }

  LinearPolicyLossInputs view(bool dev) const {
    LinearPolicyLossInputs in;
    in.hidden = hidden.view(dev);
    in.weight = weight.view(dev);
    if (c.bias) in.bias = bias.view(dev);
    token_views(in, dev);
    return in;
  }
  void to_device() {
    for (TestTensor* t : {&hidden, &weight}) t->to_device();
    if (c.bias) bias.to_device();
    tokens_to_device();
  }
};

// ---- float64 reference ----------------------------------------------------------------------------------------
struct Ref : PolicyReference {
  std::vector<double> dx, dw, db;  // [B*Lg*H], [V*H], [V]: upstream factor applied
};

// The loss as a function of the per-token log-probabilities `lp`, a detached logp holding `base` (see
// policy_reference_loss): the function the finite-difference test differentiates.
double reference_loss(const LplInputs& in, const std::vector<double>& lp, const std::vector<double>& base) {
  return policy_reference_loss(in, in.c.B, in.c.L, in.opt.policy, lp, base, nullptr);
}

Ref reference(const LplInputs& in, double upstream, bool want_grads) {
  const int64_t L = in.c.L, H = in.c.H, V = in.c.V, N = in.N();
  const double T = in.opt.policy.temperature;
  Ref r;
  // The finite differences leave tokens of a NaN log-probability or loss out of the loss, so that the other sequences'
  // coefficients stay finite. Sequence level: a bad id makes its sequence's shared ratio NaN, and so every
  // coefficient of the sequence.
  policy_reference_forward(in, in.c.B, L, in.opt.policy, upstream, SkipNan::kLogpAndLoss, r);
  if (in.opt.policy.importance_sampling_level == ImportanceSamplingLevel::kSequence) {
    for (int64_t b = 0; b < in.c.B; ++b) {
      bool nan = false;
      for (int64_t l = 0; l < L; ++l) nan = nan || (in.w[b * L + l] != 0 && std::isnan(r.logp[b * L + l]));
      for (int64_t l = 0; nan && l < L; ++l)
        if (in.w[b * L + l] != 0) r.dlogp[b * L + l] = NAN;
    }
  }
  if (!want_grads) return r;
  // g = dlogp ([j == id] - p_j) / T per read token; dX = g W, dW = gᵀ X, db = Σ g. A bad id's NaN row reaches its
  // own row of dX and all of dW and db (as in the GEMMs).
  r.dx.assign(static_cast<size_t>(in.c.B * in.Lg * H), 0.0);
  r.dw.assign(static_cast<size_t>(V * H), 0.0);
  r.db.assign(static_cast<size_t>(V), 0.0);
  bool any_nan = false;
  for (int64_t t = 0; t < N; ++t) {
    if (in.w[t] == 0) continue;
    const int64_t p0 = in.pos(t) * H;
    if (in.bad(t)) {
      any_nan = true;
      for (int64_t k = 0; k < H; ++k) r.dx[p0 + k] = NAN;
      continue;
    }
    const std::vector<double> x = in.row(t);
    for (int64_t j = 0; j < V; ++j) {
      const double g = r.dlogp[t] * ((j == in.id(t) ? 1.0 : 0.0) - std::exp(x[j] - r.lse[t])) / T;
      for (int64_t k = 0; k < H; ++k) {
        r.dx[p0 + k] += g * in.wv(j * H + k);
        r.dw[j * H + k] += g * in.hv(p0 + k);
      }
      r.db[j] += g;
    }
  }
  if (any_nan) {
    std::fill(r.dw.begin(), r.dw.end(), NAN);
    std::fill(r.db.begin(), r.db.end(), NAN);
  }
  return r;
}

// ---- running a backend ---------------------------------------------------------------------------------------
enum class Entry { kForward, kForwardBackward, kBackward };
const char* entry_name(Entry e) {
  return e == Entry::kForward ? "forward" : e == Entry::kForwardBackward ? "forward_backward" : "backward";
}

// How the CUDA path chunks: by the default budget; short chunks cut at sequence ends; chunks of whole sequences
// (several groups: a float32 grad_weight accumulator); a small budget (logits chunks shorter than the groups).
enum class Chunking { kDefault, kShort, kSequences, kBudget };
const char* chunking_name(Chunking c) {
  switch (c) {
    case Chunking::kDefault:
      return "default chunks";
    case Chunking::kShort:
      return "short chunks";
    case Chunking::kSequences:
      return "sequence chunks";
    case Chunking::kBudget:
      return "small budget";
  }
  return "?";
}

LinearPolicyLossOptions chunked(const LplInputs& in, Chunking ch) {
  LinearPolicyLossOptions o = in.opt;
  switch (ch) {
    case Chunking::kDefault:
      break;
    case Chunking::kShort:
      o.chunk_tokens = std::max<int64_t>(1, in.Lg / 2 + 1);
      break;
    case Chunking::kSequences:
      o.chunk_tokens = 2 * in.Lg + 1;
      break;
    case Chunking::kBudget:
      o.memory_budget = static_cast<size_t>(4 * ((in.c.V + 7) / 8 * 8) * 12);
      break;
  }
  return o;
}

struct Out : PolicyForwardOut {
  std::vector<double> dx, dw, db;
};

// `saved`: the logp and lse the backward takes (a forward's).
Out run_backend(LplInputs& in, Entry e, bool dev, float upstream, const Out* saved, Chunking ch = Chunking::kDefault,
                bool f32_grads = false) {
  const int64_t B = in.c.B, L = in.c.L, H = in.c.H, V = in.c.V;
  const DType gdt = f32_grads ? DType::kFloat32 : in.c.dtype;
  PolicyOutputTensors outs(B, L);
  TestTensor gx = in.c.layout == Layout::kAligned ? TestTensor(gdt, {B, in.Lg, H}, {in.Lg * (H + 5), H + 5, 1}, 2)
                                                  : TestTensor(gdt, {B, in.Lg, H});
  TestTensor gw(gdt, {V, H}), gb(gdt, {V});
  TestTensor gscale(DType::kFloat32, {});
  gscale.set(0, upstream);
  for (TestTensor* t : {&gx, &gw, &gb}) t->fill_storage_nan();
  if (e == Entry::kBackward) {
    for (int64_t t = 0; t < B * L; ++t) {
      outs.logp.set(t, static_cast<float>(saved->logp[t]));
      outs.lse.set(t, static_cast<float>(saved->lse[t]));
    }
  }
  if (dev) {
    in.to_device();
    outs.to_device();
    for (TestTensor* t : {&gx, &gw, &gb, &gscale}) t->to_device();
  }
  const LinearPolicyLossInputs pin = in.view(dev);
  const LinearPolicyLossOptions o = chunked(in, ch);
  const PolicyLossOutputs out = outs.views(dev);
  LinearPolicyLossGrads g;
  g.grad_hidden = gx.view(dev);
  g.grad_weight = gw.view(dev);
  if (in.c.bias) g.grad_bias = gb.view(dev);
  size_t bytes = 0;
  switch (e) {
    case Entry::kForward:
      bytes = linear_policy_loss_forward_workspace_bytes(pin, o);
      break;
    case Entry::kForwardBackward:
      bytes = linear_policy_loss_forward_backward_workspace_bytes(pin, o, g);
      break;
    case Entry::kBackward:
      bytes = linear_policy_loss_backward_workspace_bytes(pin, o, g);
      break;
  }
  if (!dev) EXPECT_EQ(bytes, 0u);
  DeviceScratch ws(dev ? bytes : 0);
  switch (e) {
    case Entry::kForward:
      linear_policy_loss_forward(pin, o, out, ws.ws(), nullptr);
      break;
    case Entry::kForwardBackward:
      linear_policy_loss_forward_backward(pin, o, out, g, gscale.view(dev), ws.ws(), nullptr);
      break;
    case Entry::kBackward:
      linear_policy_loss_backward(pin, o, outs.logp.view(dev), outs.lse.view(dev), gscale.view(dev), g, ws.ws(),
                                  nullptr);
      break;
  }
  if (dev) {
    device_synchronize();
    outs.to_host();
    for (TestTensor* t : {&gx, &gw, &gb}) t->to_host();
  }
  Out r;
  if (e != Entry::kBackward) outs.read(r);
  if (e != Entry::kForward) {
    r.dx = as_doubles(gx);
    r.dw = as_doubles(gw);
    if (in.c.bias) r.db = as_doubles(gb);
  }
  return r;
}

Out from_reference(const Ref& r) {
  Out o;
  static_cast<PolicyForwardOut&>(o) = r;  // the forward outputs
  o.dx = r.dx;
  o.dw = r.dw;
  o.db = r.db;
  return o;
}

// Compares a backend's outputs with expected ones (the reference's, or the CPU backend's); `ref` gives the sizes
// tolerances scale with. `gdt`: the dtype whose rounding the gradients carry.
void expect_outputs(const LplInputs& in, Entry e, const Out& got, const Out& want, const Ref& ref,
                    const std::string& who, DType gdt, bool logits_rounded) {
  const DType dt = in.c.dtype;
  const std::string tag = who + " " + entry_name(e);
  if (e != Entry::kBackward) {
    expect_forward_close(got, want, ref, dt, logp_unit(ref), tag);
    // A ratio within rounding of a clip boundary may fall either way when the logits are rounded differently.
    const double lo = 1 - in.opt.policy.eps_low, hi = 1 + in.opt.policy.eps_high;
    int64_t mismatch = 0, first = -1;
    for (int64_t t = 0; t < in.N(); ++t) {
      if (got.clipped[t] == want.clipped[t]) continue;
      const double q = ref.ratio[t];
      if (logits_rounded && (std::abs(q - lo) < 1e-4 || std::abs(q - hi) < 1e-4)) continue;
      mismatch++;
      first = first < 0 ? t : first;
    }
    EXPECT_EQ(mismatch, 0) << tag << " is_clipped differs first at token " << first;
  }
  if (e != Entry::kForward) {
    // Every gradient is a sum of rows c ([j == id] - p_j) / T: its natural size is the largest |c| / T times the
    // inputs' scale (an element can cancel to 0 while its error does not).
    double cmax = 0;
    for (double d : ref.dlogp)
      if (std::isfinite(d)) cmax = std::max(cmax, std::abs(d) / in.opt.policy.temperature);
    const Tol tol = tolerance(gdt, Quantity::kLceGrad);
    EXPECT_TRUE(grad_close(got.dx, want.dx, tol, cmax * 1e-3, tag + " grad_hidden"));
    EXPECT_TRUE(grad_close(got.dw, want.dw, tol, cmax * 1e-3, tag + " grad_weight"));
    if (in.c.bias) EXPECT_TRUE(grad_close(got.db, want.db, tol, cmax * 1e-3, tag + " grad_bias"));
  }
}

// ---- the case lists ---------------------------------------------------------------------------------------------
std::vector<LplCase> make_cases(bool gpu) {
  std::vector<LplCase> cases;
  const PolicyLossType types[] = {PolicyLossType::kGrpo, PolicyLossType::kBnpo, PolicyLossType::kDrGrpo,
                                  PolicyLossType::kDapo};
  const ImportanceSamplingLevel levels[] = {ImportanceSamplingLevel::kToken, ImportanceSamplingLevel::kSequence};
  const DType dts[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};
  using Shape = std::array<int64_t, 4>;  // B, L, H, V
  // CPU: small shapes (the reference is O(B L H V)). GPU: the CPU backend is the expectation (O(B L H V) in
  // double per pass), so vocabularies up to Qwen's 150000 at a few tokens, and a few hundred tokens at V=4099.
  const std::vector<Shape> shapes =
      gpu ? std::vector<Shape>{{3, 5, 64, 1000}, {2, 37, 96, 32003}, {2, 3, 64, 150000}, {4, 64, 128, 4099}}
          : std::vector<Shape>{{3, 5, 16, 37}, {2, 4, 33, 200}};
  for (size_t si = 0; si < shapes.size(); ++si) {
    const Shape& s = shapes[si];
    const bool bias = si % 2 == 0;
    // On the GPU every case runs the CPU backend and twelve device calls: the whole sweep on the first (small)
    // shape, the presets in bf16 on the larger ones (the full sweep there took 8 minutes of an H100 round).
    const bool sweep = !gpu || si == 0;
    for (DType dt : dts) {
      if (!sweep && dt != DType::kBFloat16) continue;
      for (auto t : types)
        for (auto l : levels)
          if (sweep || (t == PolicyLossType::kGrpo && l == ImportanceSamplingLevel::kToken))
            cases.push_back({s[0], s[1], s[2], s[3], dt, Layout::kShifted, Preset::kFull, t, l, bias});
      cases.push_back({s[0], s[1], s[2], s[3], dt, Layout::kAligned, Preset::kFloatMask, PolicyLossType::kGrpo,
                       ImportanceSamplingLevel::kSequence, !bias});
      cases.push_back({s[0], s[1], s[2], s[3], dt, Layout::kView, Preset::kFloatMask, PolicyLossType::kBnpo,
                       ImportanceSamplingLevel::kToken, bias});
      cases.push_back({s[0], s[1], s[2], s[3], dt, Layout::kView, Preset::kSeedLike, PolicyLossType::kGrpo,
                       ImportanceSamplingLevel::kToken, !bias});
      cases.push_back({s[0], s[1], s[2], s[3], dt, Layout::kAligned, Preset::kPlain, PolicyLossType::kDrGrpo,
                       ImportanceSamplingLevel::kToken, bias});
      cases.push_back({s[0], s[1], s[2], s[3], dt, Layout::kShifted, Preset::kPlain, PolicyLossType::kGrpo,
                       ImportanceSamplingLevel::kSequence, bias});
      cases.push_back({s[0], s[1], s[2], s[3], dt, Layout::kShifted, Preset::kDapoGlobal, PolicyLossType::kDapo,
                       ImportanceSamplingLevel::kToken, bias});
      cases.push_back({s[0], s[1], s[2], s[3], dt, Layout::kShifted, Preset::kAllMasked, PolicyLossType::kGrpo,
                       ImportanceSamplingLevel::kSequence, true});
      cases.push_back({s[0], s[1], s[2], s[3], dt, Layout::kAligned, Preset::kBadIdNoCheck, PolicyLossType::kBnpo,
                       ImportanceSamplingLevel::kToken, true});
      cases.push_back({s[0], s[1], s[2], s[3], dt, Layout::kShifted, Preset::kBadIdNoCheck, PolicyLossType::kGrpo,
                       ImportanceSamplingLevel::kSequence, false});
    }
  }
  // Edge shapes: one token, one class, H = 1, an empty batch, sequences of no tokens (positions but no tokens).
  for (const Shape& s :
       {Shape{1, 1, 8, 7}, Shape{2, 3, 5, 1}, Shape{2, 3, 1, 9}, Shape{0, 4, 8, 9}, Shape{3, 0, 8, 9}}) {
    cases.push_back({s[0], s[1], s[2], s[3], DType::kFloat32, Layout::kShifted, Preset::kFull, PolicyLossType::kGrpo,
                     ImportanceSamplingLevel::kSequence, true});
    cases.push_back({s[0], s[1], s[2], s[3], DType::kBFloat16, Layout::kAligned, Preset::kSeedLike,
                     PolicyLossType::kDapo, ImportanceSamplingLevel::kToken, false});
  }
  return cases;
}

uint64_t seed_of(const LplCase& c) { return std::hash<std::string>{}(case_name(c)); }
std::string param_name(const ::testing::TestParamInfo<LplCase>& info) { return case_name(info.param); }

class LinearPolicyLossCpu : public ::testing::TestWithParam<LplCase> {};
class LinearPolicyLossCuda : public ::testing::TestWithParam<LplCase> {};

TEST_P(LinearPolicyLossCpu, MatchesFloat64Reference) {
  LplInputs in(GetParam(), seed_of(GetParam()));
  const float up = 1.25f;
  const Ref ref = reference(in, up, /*want_grads=*/true);
  const Out want = from_reference(ref);
  for (Entry e : {Entry::kForward, Entry::kForwardBackward, Entry::kBackward}) {
    SCOPED_TRACE(entry_name(e));
    const Out got = run_backend(in, e, /*dev=*/false, up, &want);
    expect_outputs(in, e, got, want, ref, "cpu", in.c.dtype, false);
    if (e == Entry::kForward) continue;
    // Masked tokens' rows and the unused position are exactly 0.
    for (int64_t b = 0; b < in.c.B; ++b)
      for (int64_t l = 0; l < in.Lg; ++l) {
        if (l < in.c.L && in.w[b * in.c.L + l] != 0) continue;
        for (int64_t k = 0; k < in.c.H; ++k) ASSERT_EQ(got.dx[(b * in.Lg + l) * in.c.H + k], 0.0) << b << " " << l;
      }
  }
}

TEST_P(LinearPolicyLossCuda, MatchesCpuBackend) {
  LOGITLESS_SKIP_WITHOUT_GPU();
  LplInputs in(GetParam(), seed_of(GetParam()));
  const float up = 0.75f;
  const Ref ref = reference(in, up, /*want_grads=*/false);  // tolerance sizes
  const Out want_fwd = run_backend(in, Entry::kForward, false, up, nullptr);
  const Out want = run_backend(in, Entry::kForwardBackward, false, up, nullptr);
  for (Chunking ch : {Chunking::kDefault, Chunking::kShort, Chunking::kSequences, Chunking::kBudget}) {
    SCOPED_TRACE(chunking_name(ch));
    for (Entry e : {Entry::kForward, Entry::kForwardBackward, Entry::kBackward}) {
      SCOPED_TRACE(entry_name(e));
      const Out got = run_backend(in, e, /*dev=*/true, up, &want_fwd, ch);
      expect_outputs(in, e, got, e == Entry::kForward ? want_fwd : want, ref, "cuda", in.c.dtype, true);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, LinearPolicyLossCpu, ::testing::ValuesIn(make_cases(false)), param_name);
INSTANTIATE_TEST_SUITE_P(Shapes, LinearPolicyLossCuda, ::testing::ValuesIn(make_cases(true)), param_name);

// float32 gradient outputs for 16-bit inputs (e.g. float32 main gradients). Under the small budget the groups grow
// within twice it (head::group_min_rows): 40 of the 123 rows instead of 16.
TEST(LinearPolicyLoss, Float32GradientsOf16BitInputs) {
  for (bool dev : {false, true}) {
    if (dev && !has_gpu()) continue;
    const LplCase c{3,
                    40,
                    64,
                    3001,
                    DType::kBFloat16,
                    Layout::kShifted,
                    Preset::kFull,
                    PolicyLossType::kBnpo,
                    ImportanceSamplingLevel::kSequence,
                    true};
    LplInputs in(c, 17);
    const Ref ref = reference(in, 1.f, /*want_grads=*/!dev);
    const Out want = dev ? run_backend(in, Entry::kForwardBackward, false, 1.f, nullptr) : from_reference(ref);
    for (Chunking ch : {Chunking::kDefault, Chunking::kShort, Chunking::kBudget}) {
      for (Entry e : {Entry::kForwardBackward, Entry::kBackward}) {
        SCOPED_TRACE(std::string(dev ? "cuda " : "cpu ") + chunking_name(ch) + " " + entry_name(e));
        const Out got = run_backend(in, e, dev, 1.f, &want, ch, /*f32_grads=*/true);
        // The CUDA path still rounds the logits' gradient to bf16 before the GEMMs.
        expect_outputs(in, e, got, want, ref, dev ? "cuda" : "cpu", dev ? DType::kBFloat16 : DType::kFloat32, dev);
      }
    }
  }
}

// ---- the reference itself: its gradients against central differences over hidden, weight and bias ----------------
TEST(LinearPolicyLossReference, GradientsMatchFiniteDifferences) {
  for (Preset preset : {Preset::kFull, Preset::kSeedLike, Preset::kFloatMask}) {
    for (auto level : {ImportanceSamplingLevel::kToken, ImportanceSamplingLevel::kSequence}) {
      const LplCase c{2, 3, 3, 5, DType::kFloat32, Layout::kShifted, preset, PolicyLossType::kGrpo, level, true};
      LplInputs in(c, 23);
      const Ref r = reference(in, 1.0, /*want_grads=*/true);
      const std::vector<double> base = r.logp;  // the detached logp stays at its unperturbed value
      const double h = 1e-5;
      auto loss_at = [&](int what, int64_t at, double step) {
        in.perturb_what = what;
        in.perturb_at = at;
        in.perturb_by = step;
        const Ref q = reference(in, 1.0, /*want_grads=*/false);
        in.perturb_what = -1;
        return reference_loss(in, q.logp, base);
      };
      const std::vector<double>* grads[] = {&r.dx, &r.dw, &r.db};
      const int64_t sizes[] = {in.hidden.numel(), in.weight.numel(), in.bias.numel()};
      for (int what = 0; what < 3; ++what)
        for (int64_t k = 0; k < sizes[what]; ++k) {
          const double fd = (loss_at(what, k, h) - loss_at(what, k, -h)) / (2 * h);
          EXPECT_NEAR((*grads[what])[k], fd, 1e-6)
              << preset_name(preset) << " " << level_name(level) << " input " << what << " element " << k;
        }
    }
  }
}

// ---- the planner and the chunk sweep (pure host functions) ---------------------------------------------------------
// Every sweep covers each position once, in order, and each token once, at its own position.
void expect_sweep_covers(int64_t B, int64_t L, int64_t Lg, int64_t S, int64_t G) {
  SCOPED_TRACE("B " + std::to_string(B) + " L " + std::to_string(L) + " Lg " + std::to_string(Lg) + " S " +
               std::to_string(S) + " G " + std::to_string(G));
  const int64_t R = B * Lg;
  int64_t next_row = 0, next_token = 0, next_group = 0;
  lpl::for_each_chunk(
      R, S, G, Lg, L,
      [&](const lpl::RowChunk& c, int64_t g0) {
        ASSERT_EQ(c.row0, next_row);
        ASSERT_GE(c.rows, 1);
        ASSERT_LE(c.rows, S);
        ASSERT_GE(c.row0, g0);
        ASSERT_LE(c.row0 + c.rows, std::min(R, g0 + G));
        ASSERT_EQ(c.first_token, next_token);
        for (int64_t i = 0; i < c.n_tokens; ++i) {
          const int64_t t = c.first_token + i;
          ASSERT_EQ(c.row0 + c.token_rows.offset(i), (t / L) * Lg + t % L) << "token " << t;
        }
        next_row += c.rows;
        next_token += c.n_tokens;
      },
      [&](int64_t g0, int64_t g1) {
        ASSERT_EQ(g0, next_group);
        ASSERT_EQ(g1, next_row);
        next_group = g1;
      });
  EXPECT_EQ(next_row, R);
  EXPECT_EQ(next_token, B * L);
}

TEST(LinearPolicyLossPlan, SweepsCoverEveryPositionAndToken) {
  for (int64_t L : {1, 2, 7, 16}) {
    for (int64_t B : {1, 3, 5}) {
      for (int64_t extra : {0, 1}) {
        for (int64_t S : {1, 3, 8, 17, 40}) {
          for (int64_t G : {S, 2 * S + 1, int64_t{1000}}) {
            const int64_t Lg = L + extra;
            // The planner's rule: sizes of at least a sequence are whole sequences.
            int64_t s = S, g = G;
            if (extra && s >= Lg) {
              s = s / Lg * Lg;
              g = std::max(g / Lg * Lg, s);
            }
            expect_sweep_covers(B, L, Lg, s, g);
          }
        }
      }
    }
  }
}

lpl::PlanInputs plan_in(int64_t B, int64_t L, int64_t Lg, int64_t H, int64_t V, int es, bool grads) {
  lpl::PlanInputs in;
  in.grads = grads;
  in.rows = B * Lg;
  in.row_len = Lg;
  in.seq_len = L;
  in.tokens = B * L;
  in.h = H;
  in.v = V;
  in.elem_bytes = es;
  in.need_dx = in.need_dw = in.need_db = grads;
  in.token_logp = in.token_lse = in.token_coeff = grads;
  in.steps_bytes = 4096;
  return in;
}

using Laid = LaidPlan<lpl::Plan, lpl::Buffers>;
Laid lay(const lpl::PlanInputs& in) { return lay_plan(in, lpl::plan_linear_policy_loss, lpl::declare_workspace); }

TEST(LinearPolicyLossPlan, ChunksAreWholeSequencesAndRegionsDisjoint) {
  // The benchmark's shape: B=8, L=1024, V=150000, H=4096, bf16, 512 MiB.
  lpl::PlanInputs in = plan_in(8, 1024, 1025, 4096, 150000, 2, true);
  Laid p = lay(in);
  EXPECT_GE(p.chunk_rows, 1);
  EXPECT_LE(static_cast<size_t>(p.chunk_rows * p.ld_logits * 4), in.memory_budget);  // a quarter, as in the LCE
  EXPECT_FALSE(p.dlogits_in_place);
  EXPECT_EQ(p.ld_logits % 8, 0);
  // Every position's 16-bit gradient (2.5 GB) fits the budget plus the float32 accumulator it saves (2.5 GB).
  EXPECT_EQ(p.group_rows, in.rows);
  EXPECT_FALSE(p.dw_accumulator);
  // Regions: 256-aligned, disjoint, inside `bytes`.
  std::vector<std::pair<size_t, size_t>> regions = p.regions;
  EXPECT_EQ(regions.size(), 9u);  // steps, logp, lse, coeff, cuBLAS, logits, dlogits, db and its partials
  std::sort(regions.begin(), regions.end());
  for (size_t i = 0; i < regions.size(); ++i) {
    EXPECT_EQ(regions[i].first % 256, 0u);
    if (i + 1 < regions.size()) EXPECT_LE(regions[i].first + regions[i].second, regions[i + 1].first);
    EXPECT_LE(regions[i].first + regions[i].second, p.bytes);
  }

  // Chunks of at least a sequence are whole sequences; groups too.
  in = plan_in(6, 20, 21, 64, 1000, 2, true);
  in.chunk_tokens = 50;
  p = lay(in);
  EXPECT_EQ(p.chunk_rows % 21, 0);
  EXPECT_EQ(p.group_rows % 21, 0);
  EXPECT_TRUE(p.dw_accumulator);  // 42 of 126 positions per group
  EXPECT_NE(off(p.b.head.dw_acc), kNone);
  // float32: the gradient overwrites its logits, one chunk per group.
  in = plan_in(6, 20, 21, 64, 1000, 4, true);
  in.chunk_tokens = 50;
  p = lay(in);
  EXPECT_TRUE(p.dlogits_in_place);
  EXPECT_EQ(p.group_rows, p.chunk_rows);
  EXPECT_EQ(off(p.b.head.dlogits), kNone);
  // The forward holds no gradient and no per-token state of its own.
  in = plan_in(6, 20, 21, 64, 1000, 2, false);
  in.token_logp = in.token_lse = in.token_coeff = false;
  p = lay(in);
  EXPECT_EQ(off(p.b.head.dlogits), kNone);
  EXPECT_EQ(off(p.b.policy.coeff), kNone);
  EXPECT_EQ(off(p.b.head.dw_acc), kNone);

  // A float32 grad_weight sums over the groups itself: they grow toward 2048 positions within twice the budget (the
  // linear head's rule). Without a weight gradient they stay the budget's.
  in = plan_in(8, 1024, 1025, 4096, 150000, 2, true);
  in.grad_weight_f32 = true;
  p = lay(in);
  lpl::PlanInputs frozen = in;
  frozen.need_dw = false;
  const Laid budget_only = lay(frozen);
  EXPECT_FALSE(p.dw_accumulator);
  EXPECT_GT(p.group_rows, budget_only.group_rows);
  EXPECT_LE(p.group_rows, head::kFloat32SumsGroupRows);
  EXPECT_LE(static_cast<size_t>(p.group_rows * p.ld_dlogits * 2 + p.chunk_rows * p.ld_logits * 4),
            2 * in.memory_budget);
}

// ---- selective log-softmax ----------------------------------------------------------------------------------------
struct SelCase {
  int64_t N, H, V;
  DType dtype;
  bool padded;
  double temperature;
  bool bias;
};
std::string sel_name(const SelCase& c) {
  std::ostringstream os;
  os << "N" << c.N << "_H" << c.H << "_V" << c.V << "_" << dtype_tag(c.dtype) << (c.padded ? "_padded" : "_contig")
     << "_T" << static_cast<int>(c.temperature * 10) << (c.bias ? "_bias" : "");
  return os.str();
}

// The logits of row i (without the temperature), in double: products of the inputs' values, summed in order.
std::vector<double> logits_row(const TestTensor& hidden, const TestTensor& weight, const TestTensor* bias, int64_t i) {
  const int64_t H = weight.sizes()[1], V = weight.sizes()[0];
  std::vector<double> z(V);
  for (int64_t j = 0; j < V; ++j) {
    double acc = bias ? bias->get(j) : 0.0;
    for (int64_t k = 0; k < H; ++k) acc += static_cast<double>(hidden.get(i * H + k)) * weight.get(j * H + k);
    z[j] = acc;
  }
  return z;
}

// torch.argmax's answer: the first maximum (z holds no NaN here). `last`: the last one instead (a tie's partner).
int64_t max_index(const std::vector<double>& z, bool last) {
  int64_t m = 0;
  for (int64_t j = 1; j < static_cast<int64_t>(z.size()); ++j)
    if (z[j] > z[m] || (last && z[j] == z[m])) m = j;
  return m;
}

struct SelInputs {
  SelCase c;
  TestTensor hidden, weight, bias, ids, grad_logp;
  SelInputs(const SelCase& cs, uint64_t seed) : c(cs) {
    const int64_t N = c.N, H = c.H, V = c.V;
    // padded: [2, N/2]-shaped... kept 1-D here: rows with a stride > H, ids strided.
    hidden = c.padded ? TestTensor(c.dtype, {N, H}, {H + 3, 1}, 1) : TestTensor(c.dtype, {N, H});
    weight = TestTensor(c.dtype, {V, H});
    ids = c.padded ? TestTensor(DType::kInt32, {N}, {3}) : TestTensor(DType::kInt64, {N});
    hidden.fill_storage_nan();
    hidden.fill_normal(seed, 1.f);
    weight.fill_normal(seed + 1, 2.f / std::sqrt(static_cast<float>(H)));
    if (c.bias) {
      bias = TestTensor(DType::kFloat32, {V});
      bias.fill_normal(seed + 2, 0.5f);
    }
    std::mt19937_64 rng(seed);
    add_top_tie();
    pick_ids(rng);
    grad_logp = TestTensor(DType::kFloat32, {N});
    std::uniform_real_distribution<float> u(-1.5f, 1.5f);
    for (int64_t i = 0; i < N; ++i) grad_logp.set(i, u(rng));
  }
  TensorView bv(bool dev) const { return c.bias ? bias.view(dev) : TensorView{}; }
  std::vector<double> logits(int64_t i) const { return logits_row(hidden, weight, c.bias ? &bias : nullptr, i); }

 private:
  // An exact tie at the top of every third row from row 1: class V-1 a copy of class V/3 (weight row and bias), and
  // those rows' hidden states close to 3x that weight row, so that both classes' logits are the row's maximum, bit for
  // bit in any arithmetic that treats two equal columns alike.
  void add_top_tie() {
    const int64_t H = c.H, V = c.V, a = V / 3, b = V - 1;
    if (b <= a) return;
    for (int64_t k = 0; k < H; ++k) weight.set(b * H + k, weight.get(a * H + k));
    if (c.bias) bias.set(b, bias.get(a));
    for (int64_t i = 1; i < c.N; i += 3)
      for (int64_t k = 0; k < H; ++k) hidden.set(i * H + k, 3.f * weight.get(a * H + k) + 0.1f * hidden.get(i * H + k));
  }
  // Ids that make is_top1 answer both ways: the first maximum, the last one (the tie's partner where there is a
  // tie), or a random class.
  void pick_ids(std::mt19937_64& rng) {
    std::uniform_int_distribution<int64_t> idd(0, c.V - 1);
    for (int64_t i = 0; i < c.N; ++i) {
      const int64_t kind = i % 4;
      ids.set_index(i, kind < 2 ? max_index(logits(i), kind == 1) : idd(rng));
    }
  }
};

struct SelOut : SelectiveForwardOut {
  std::vector<double> dx, dw, db;
  std::vector<uint8_t> top1;
};

SelOut run_selective(SelInputs& in, bool dev, Chunking ch = Chunking::kDefault) {
  const int64_t N = in.c.N, H = in.c.H, V = in.c.V;
  LinearSelectiveLogSoftmaxOptions o;
  o.temperature = in.c.temperature;
  if (ch == Chunking::kShort) o.chunk_tokens = 3;
  if (ch == Chunking::kBudget) o.memory_budget = static_cast<size_t>(4 * ((V + 7) / 8 * 8) * 12);
  TestTensor logp(DType::kFloat32, {N}), ent(DType::kFloat32, {N}), lse(DType::kFloat32, {N});
  TestTensor gx(in.c.dtype, {N, H}), gw(in.c.dtype, {V, H}), gb(DType::kFloat32, {V});
  TestTensor top1(in.c.padded ? DType::kUInt8 : DType::kBool, {N});
  for (TestTensor* t : {&logp, &ent, &lse, &gx, &gw, &gb}) t->fill_storage_nan();
  top1.fill_storage_bytes(0xA5);
  if (dev) {
    for (TestTensor* t : {&in.hidden, &in.weight, &in.ids, &in.grad_logp, &logp, &ent, &lse, &gx, &gw, &gb, &top1})
      t->to_device();
    if (in.c.bias) in.bias.to_device();
  }
  LinearPolicyLossGrads g;
  g.grad_hidden = gx.view(dev);
  g.grad_weight = gw.view(dev);
  if (in.c.bias) g.grad_bias = gb.view(dev);
  const TensorView h = in.hidden.view(dev), w = in.weight.view(dev), i = in.ids.view(dev);
  {
    DeviceScratch ws(dev ? linear_selective_log_softmax_forward_workspace_bytes(h, w, i, o) : 0);
    linear_selective_log_softmax_forward(h, w, in.bv(dev), i, o, logp.view(dev), ent.view(dev), lse.view(dev),
                                         top1.view(dev), ws.ws(), nullptr);
  }
  {
    DeviceScratch ws(dev ? linear_selective_log_softmax_backward_workspace_bytes(h, w, i, o, g) : 0);
    linear_selective_log_softmax_backward(h, w, in.bv(dev), i, lse.view(dev), in.grad_logp.view(dev), o, g, ws.ws(),
                                          nullptr);
  }
  if (dev) {
    device_synchronize();
    for (TestTensor* t : {&logp, &ent, &lse, &gx, &gw, &gb, &top1}) t->to_host();
  }
  SelOut r{{as_doubles(logp), as_doubles(ent), as_doubles(lse)}, as_doubles(gx), as_doubles(gw), {}, {}};
  if (in.c.bias) r.db = as_doubles(gb);
  const uint8_t* flags = static_cast<const uint8_t*>(top1.host_view().data);
  r.top1.assign(flags, flags + N);
  return r;
}

SelOut selective_reference(const SelInputs& in) {
  const int64_t N = in.c.N, H = in.c.H, V = in.c.V;
  const double T = in.c.temperature;
  SelOut r;
  r.dx.assign(N * H, 0.0);
  r.dw.assign(V * H, 0.0);
  r.db.assign(V, 0.0);
  for (int64_t i = 0; i < N; ++i) {
    std::vector<double> x = in.logits(i);
    const int64_t t = in.ids.get_index(i);
    r.top1.push_back(max_index(x, false) == t ? 1 : 0);  // on the logits themselves, before the temperature
    for (double& v : x) v /= T;
    const double lse = push_selective_row(x, t, r);
    for (int64_t j = 0; j < V; ++j) {
      const double g = in.grad_logp.get(i) * ((j == t) - std::exp(x[j] - lse)) / T;
      for (int64_t k = 0; k < H; ++k) {
        r.dx[i * H + k] += g * in.weight.get(j * H + k);
        r.dw[j * H + k] += g * in.hidden.get(i * H + k);
      }
      r.db[j] += g;
    }
  }
  if (!in.c.bias) r.db.clear();
  return r;
}

// Whether the first-maximum question of row z at `id` depends on roundings: id's logit is within `eps` of the max,
// and so is a logit of another value (classes whose logits are exactly equal are copies, and rank by index in any
// arithmetic).
bool top1_fragile(const std::vector<double>& z, int64_t id, double eps) {
  const double m = *std::max_element(z.begin(), z.end());
  if (z[id] < m - eps) return false;
  for (double v : z)
    if (v >= m - eps && v != z[id]) return true;
  return false;
}

// is_top1 row by row: every flag written (0 or 1), and equal to the reference's except where float32 logits may
// rank two near-equal classes otherwise than double ones.
void expect_top1(const SelInputs& in, const SelOut& got, const SelOut& want, const std::string& who) {
  ASSERT_EQ(got.top1.size(), want.top1.size());
  int bad = 0;
  for (int64_t i = 0; i < static_cast<int64_t>(got.top1.size()) && bad < 3; ++i) {
    if (got.top1[i] == want.top1[i]) continue;
    const std::vector<double> z = in.logits(i);
    const double eps = 1e-4 * std::max(1.0, std::abs(*std::max_element(z.begin(), z.end())));
    if (got.top1[i] <= 1 && top1_fragile(z, in.ids.get_index(i), eps)) continue;
    ++bad;
    ADD_FAILURE() << who << " is_top1[" << i << "] = " << int{got.top1[i]} << ", expected " << int{want.top1[i]}
                  << " (id " << in.ids.get_index(i) << ")";
  }
}

void expect_selective(const SelInputs& in, const SelOut& got, const SelOut& want, const std::string& who) {
  const DType dt = in.c.dtype;
  expect_selective_forward_close(got, want, dt, who);
  expect_top1(in, got, want, who);
  const Tol tol = tolerance(dt, Quantity::kLceGrad);
  // The natural size of a gradient element: every term is g_i ([j == id] - p_j) / T times a weight (grad_hidden)
  // or a hidden value (grad_weight), and the p_j of a row sum to 1. Errors are roundings of such terms also where
  // the exact gradient cancels to 0 (V = 1: p = 1 exactly on the CPU, within float32 rounding on the GPU).
  double gmax = 0, wmax = 0, hmax = 0;
  for (int64_t i = 0; i < in.c.N; ++i) gmax = std::max(gmax, std::abs(static_cast<double>(in.grad_logp.get(i))));
  for (int64_t i = 0; i < in.c.V * in.c.H; ++i) wmax = std::max(wmax, std::abs(static_cast<double>(in.weight.get(i))));
  for (int64_t i = 0; i < in.c.N * in.c.H; ++i) hmax = std::max(hmax, std::abs(static_cast<double>(in.hidden.get(i))));
  const double unit = std::max(gmax * std::max({wmax, hmax, 1.0}) / in.c.temperature, 1.5e-3 / in.c.temperature);
  EXPECT_TRUE(grad_close(got.dx, want.dx, tol, unit, who + " grad_hidden"));
  EXPECT_TRUE(grad_close(got.dw, want.dw, tol, unit, who + " grad_weight"));
  if (in.c.bias)
    EXPECT_TRUE(grad_close(got.db, want.db, tolerance(DType::kFloat32, Quantity::kLceGrad), unit, who + " grad_bias"));
}

std::vector<SelCase> sel_cases(bool gpu) {
  std::vector<SelCase> cases;
  struct Shape {
    int64_t n, h, v;
  };
  const std::vector<Shape> shapes =
      gpu ? std::vector<Shape>{{0, 64, 5}, {1, 64, 1}, {37, 96, 1000}, {5, 64, 150000}, {300, 128, 32003}}
          : std::vector<Shape>{{0, 8, 5}, {1, 4, 1}, {7, 5, 3}, {9, 16, 200}};
  for (const Shape& s : shapes)
    for (DType dt : {DType::kFloat32, DType::kFloat16, DType::kBFloat16})
      for (bool padded : {false, true}) cases.push_back({s.n, s.h, s.v, dt, padded, padded ? 0.6 : 1.0, padded});
  return cases;
}

class LinearSelectiveLogSoftmaxCpu : public ::testing::TestWithParam<SelCase> {};
class LinearSelectiveLogSoftmaxCuda : public ::testing::TestWithParam<SelCase> {};

TEST_P(LinearSelectiveLogSoftmaxCpu, MatchesFloat64Reference) {
  SelInputs in(GetParam(), std::hash<std::string>{}(sel_name(GetParam())));
  const SelOut want = selective_reference(in);
  expect_selective(in, run_selective(in, false), want, "cpu");
  // The inputs hold a tie lost on the index (id at the row's maximum, yet not the first) wherever they can.
  if (in.c.N >= 2 && in.c.V >= 3) {
    const std::vector<double> z = in.logits(1);
    const int64_t id = in.ids.get_index(1);
    EXPECT_TRUE(z[id] == *std::max_element(z.begin(), z.end()) && want.top1[1] == 0) << "row 1 is no lost tie";
  }
}

TEST_P(LinearSelectiveLogSoftmaxCuda, MatchesCpuBackend) {
  LOGITLESS_SKIP_WITHOUT_GPU();
  SelInputs in(GetParam(), std::hash<std::string>{}(sel_name(GetParam())));
  const SelOut want = run_selective(in, false);
  for (Chunking ch : {Chunking::kDefault, Chunking::kShort, Chunking::kBudget}) {
    SCOPED_TRACE(chunking_name(ch));
    expect_selective(in, run_selective(in, true, ch), want, "cuda");
  }
}

std::string sel_param_name(const ::testing::TestParamInfo<SelCase>& info) { return sel_name(info.param); }
INSTANTIATE_TEST_SUITE_P(Shapes, LinearSelectiveLogSoftmaxCpu, ::testing::ValuesIn(sel_cases(false)), sel_param_name);
INSTANTIATE_TEST_SUITE_P(Shapes, LinearSelectiveLogSoftmaxCuda, ::testing::ValuesIn(sel_cases(true)), sel_param_name);

// is_top1 on exact logits (H = 2): classes 2 and 4 copy classes 0 and 1, class 5 ties with four others in row 3,
// row 4's hidden state has a NaN, and a bias can add +inf or -inf to classes.
struct Top1Logits {
  static constexpr int64_t kN = 5, kV = 6;
  TestTensor hidden{DType::kFloat32, {kN, 2}}, weight{DType::kFloat32, {kV, 2}}, bias{DType::kFloat32, {kV}};
  Top1Logits() {
    const float w[kV][2] = {{1, 0}, {0, 1}, {1, 0}, {-1, 0}, {0, 1}, {0.5f, 0.5f}};
    const float h[kN][2] = {{1, 0}, {0, 1}, {-1, 0}, {1, 1}, {NAN, 0}};
    for (int64_t j = 0; j < kV; ++j) weight.set(2 * j, w[j][0]), weight.set(2 * j + 1, w[j][1]);
    for (int64_t i = 0; i < kN; ++i) hidden.set(2 * i, h[i][0]), hidden.set(2 * i + 1, h[i][1]);
  }
  // The flags for `ids`, with the bias `b` (empty: none), at temperature 0.7, two rows per chunk on CUDA.
  std::vector<int> run(const std::vector<int64_t>& id, const std::vector<float>& b, bool dev) {
    TestTensor ids(DType::kInt64, {kN}), logp(DType::kFloat32, {kN}), top1(DType::kBool, {kN});
    for (int64_t i = 0; i < kN; ++i) ids.set_index(i, id[i]);
    for (int64_t j = 0; j < static_cast<int64_t>(b.size()); ++j) bias.set(j, b[j]);
    top1.fill_storage_bytes(0xA5);
    if (dev)
      for (TestTensor* t : {&hidden, &weight, &bias, &ids, &logp, &top1}) t->to_device();
    LinearSelectiveLogSoftmaxOptions o;
    o.temperature = 0.7;
    o.chunk_tokens = 2;
    const TensorView bv = b.empty() ? TensorView{} : bias.view(dev);
    {
      DeviceScratch ws(dev ? linear_selective_log_softmax_forward_workspace_bytes(hidden.view(dev), weight.view(dev),
                                                                                  ids.view(dev), o)
                           : 0);
      linear_selective_log_softmax_forward(hidden.view(dev), weight.view(dev), bv, ids.view(dev), o, logp.view(dev), {},
                                           {}, top1.view(dev), ws.ws(), nullptr);
    }
    if (dev) {
      device_synchronize();
      top1.to_host();
    }
    const uint8_t* f = static_cast<const uint8_t*>(top1.host_view().data);
    return std::vector<int>(f, f + kN);
  }
};

void expect_top1_exact(bool dev) {
  Top1Logits t;
  const float inf = INFINITY;
  // First maxima without a bias: 0 (tied with 2), 1 (tied with 4), 3, 0 (tied with 1, 2, 4, 5); row 4 has a NaN.
  EXPECT_EQ(t.run({0, 1, 3, 0, 0}, {}, dev), (std::vector<int>{1, 1, 1, 1, 0}));
  EXPECT_EQ(t.run({2, 4, 0, 5, 1}, {}, dev), (std::vector<int>{0, 0, 0, 0, 0}));
  // +inf at classes 3 and 5: the first is 3 in every row without a NaN.
  const std::vector<float> two_inf = {0, 0, 0, inf, 0, inf};
  EXPECT_EQ(t.run({3, 3, 3, 3, 3}, two_inf, dev), (std::vector<int>{1, 1, 1, 1, 0}));
  EXPECT_EQ(t.run({5, 5, 5, 5, 3}, two_inf, dev), (std::vector<int>{0, 0, 0, 0, 0}));
  // Every logit -inf: torch.argmax answers 0.
  const std::vector<float> all_ninf(Top1Logits::kV, -inf);
  EXPECT_EQ(t.run({0, 0, 0, 0, 0}, all_ninf, dev), (std::vector<int>{1, 1, 1, 1, 0}));
  EXPECT_EQ(t.run({1, 2, 3, 5, 0}, all_ninf, dev), (std::vector<int>{0, 0, 0, 0, 0}));
}

TEST(LinearSelectiveLogSoftmaxTop1, TiesNaNAndInfCpu) { expect_top1_exact(false); }

TEST(LinearSelectiveLogSoftmaxTop1, TiesNaNAndInfCuda) {
  LOGITLESS_SKIP_WITHOUT_GPU();
  expect_top1_exact(true);
}

// ---- bad input ----------------------------------------------------------------------------------------------------
struct Small {
  TestTensor hidden{DType::kFloat32, {2, 4, 5}}, weight{DType::kFloat32, {6, 5}}, bias{DType::kFloat32, {6}},
      ids{DType::kInt64, {2, 3}}, adv{DType::kFloat32, {2}}, mask{DType::kInt32, {2, 3}}, ref{DType::kFloat32, {2, 3}},
      loss{DType::kFloat32, {}}, gx{DType::kFloat32, {2, 4, 5}}, gw{DType::kFloat32, {6, 5}}, gb{DType::kFloat32, {6}};
  LinearPolicyLossOptions opt;
  Small() {
    hidden.fill_normal(3, 1.f);
    weight.fill_normal(4, 1.f);
    for (int64_t i = 0; i < 6; ++i) ids.set_index(i, i % 6), mask.set_index(i, 1), ref.set(i, -2.f);
    adv.set(0, 1.f), adv.set(1, -1.f);
    loss.set(0, 123.f);
  }
  LinearPolicyLossInputs in() const {
    LinearPolicyLossInputs p;
    p.hidden = hidden.host_view();
    p.weight = weight.host_view();
    p.bias = bias.host_view();
    p.completion_ids = ids.host_view();
    p.advantages = adv.host_view();
    p.completion_mask = mask.host_view();
    p.ref_logp = ref.host_view();
    return p;
  }
  LinearPolicyLossGrads grads() const {
    LinearPolicyLossGrads g;
    g.grad_hidden = gx.host_view();
    g.grad_weight = gw.host_view();
    g.grad_bias = gb.host_view();
    return g;
  }
  std::string run(const LinearPolicyLossInputs& p, const LinearPolicyLossGrads& g) const {
    PolicyLossOutputs o;
    o.loss = loss.host_view();
    return error_of([&] { linear_policy_loss_forward_backward(p, opt, o, g, {}, {}, nullptr); });
  }
};

TEST(LinearPolicyLossErrors, ShapesNameTheArgument) {
  Small s;
  EXPECT_EQ(s.run(s.in(), s.grads()), "");
  s.loss.set(0, 123.f);
  TestTensor h_long(DType::kFloat32, {2, 5, 5}), h2(DType::kFloat32, {8, 5}), w_h(DType::kFloat32, {6, 4}),
      b7(DType::kFloat32, {7}), ids3(DType::kInt64, {3, 3}), adv3(DType::kFloat32, {3}),
      gx_bad(DType::kFloat32, {2, 3, 5}), gw_bad(DType::kFloat32, {5, 5}), h16(DType::kFloat16, {2, 4, 5});
  auto with = [&](auto f) {
    LinearPolicyLossInputs p = s.in();
    LinearPolicyLossGrads g = s.grads();
    f(p, g);
    return s.run(p, g);
  };
  auto has = [](const std::string& msg, const std::string& what) {
    return msg.find(what) != std::string::npos
               ? ::testing::AssertionSuccess()
               : ::testing::AssertionFailure() << "'" << msg << "' lacks '" << what << "'";
  };
  EXPECT_TRUE(has(with([&](auto& p, auto&) { p.hidden = h_long.host_view(); }), "hidden: expected shape [2, 4, H]"));
  EXPECT_TRUE(has(with([&](auto& p, auto&) { p.hidden = h2.host_view(); }), "hidden: expected shape [2, 4, H]"));
  EXPECT_TRUE(has(with([&](auto& p, auto&) {
                    p.completion_ids = ids3.host_view();
                    p.advantages = adv3.host_view();
                  }),
                  "hidden: expected shape [3, 4, H]"));
  EXPECT_TRUE(has(with([&](auto& p, auto&) { p.weight = w_h.host_view(); }), "weight: expected shape [V, 5]"));
  EXPECT_TRUE(has(with([&](auto& p, auto&) { p.weight = h16.host_view(); }), "weight: expected dtype float32"));
  EXPECT_TRUE(has(with([&](auto& p, auto&) { p.bias = b7.host_view(); }), "bias: expected shape [6]"));
  EXPECT_TRUE(has(with([&](auto& p, auto&) { p.advantages = adv3.host_view(); }), "advantages: expected shape [2]"));
  EXPECT_TRUE(has(with([&](auto&, auto& g) { g.grad_hidden = gx_bad.host_view(); }), "grad_hidden: expected shape"));
  EXPECT_TRUE(has(with([&](auto&, auto& g) { g.grad_weight = gw_bad.host_view(); }), "grad_weight: expected shape"));
  EXPECT_TRUE(has(with([&](auto& p, auto&) { p.bias = {}; }), "grad_bias: expected None (there is no bias)"));
  EXPECT_TRUE(has(with([&](auto& p, auto& g) { g.grad_weight = p.weight; }),
                  "grad_weight: expected memory that does not overlap weight"));
  TensorView strided = s.hidden.host_view();
  strided.strides[2] = 2;
  EXPECT_TRUE(
      has(with([&](auto& p, auto&) { p.hidden = strided; }), "hidden: expected a last dimension with stride 1"));
  EXPECT_EQ(s.loss.get(0), 123.f);  // nothing was written by any failing call
}

TEST(LinearPolicyLossErrors, OptionsIdsAndBackwardInputs) {
  Small s;
  {
    Small t;
    t.opt.policy.beta = 0.5;
    LinearPolicyLossInputs p = t.in();
    p.ref_logp = {};
    EXPECT_NE(t.run(p, t.grads()).find("ref_logp: expected a tensor when beta > 0"), std::string::npos);
  }
  {
    Small t;
    t.opt.memory_budget = 0;
    EXPECT_NE(t.run(t.in(), t.grads()).find("memory_budget"), std::string::npos);
    t.opt.memory_budget = 1 << 20;
    t.opt.chunk_tokens = -1;
    EXPECT_NE(t.run(t.in(), t.grads()).find("chunk_tokens"), std::string::npos);
    t.opt.chunk_tokens = 0;
    t.opt.policy.loss_type = PolicyLossType::kDrGrpo;
    EXPECT_NE(t.run(t.in(), t.grads()).find("max_completion_length"), std::string::npos);
  }
  {
    Small t;
    t.ids.set_index(1, 6);  // [0, 1]: masked below, so ignored
    t.mask.set_index(1, 0);
    t.ids.set_index(4, -1);  // [1, 1]: the first bad unmasked token
    Error::Kind kind{};
    PolicyLossOutputs o;
    o.loss = t.loss.host_view();
    const std::string msg =
        error_of([&] { linear_policy_loss_forward_backward(t.in(), t.opt, o, t.grads(), {}, {}, nullptr); }, &kind);
    EXPECT_NE(msg.find("completion_ids: expected values in [0, 6) at unmasked tokens, got -1 at [1, 1]"),
              std::string::npos)
        << msg;
    EXPECT_EQ(kind, Error::Kind::kInvalidArgument);
    EXPECT_EQ(t.loss.get(0), 123.f);
  }
  TestTensor logp5(DType::kFloat32, {5}), lse(DType::kFloat32, {2, 3}), gl(DType::kFloat32, {});
  EXPECT_NE(error_of([&] {
              linear_policy_loss_backward(s.in(), s.opt, logp5.host_view(), lse.host_view(), gl.host_view(), s.grads(),
                                          {}, nullptr);
            }).find("logp: expected 6 elements"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              linear_policy_loss_backward(s.in(), s.opt, lse.host_view(), lse.host_view(), {}, s.grads(), {}, nullptr);
            }).find("grad_loss"),
            std::string::npos);
}

TEST(LinearPolicyLossErrors, Selective) {
  TestTensor hidden(DType::kFloat32, {4, 3}), weight(DType::kFloat32, {5, 3}), ids(DType::kInt64, {4}),
      ids3(DType::kInt64, {3}), logp(DType::kFloat32, {4}), top1(DType::kUInt8, {4}), top1_3(DType::kBool, {3});
  hidden.fill_normal(1, 1.f);
  weight.fill_normal(2, 1.f);
  for (int64_t i = 0; i < 4; ++i) ids.set_index(i, i);
  LinearSelectiveLogSoftmaxOptions o;
  auto fwd = [&](const TensorView& i, const TensorView& t1 = {}) {
    return error_of([&] {
      linear_selective_log_softmax_forward(hidden.host_view(), weight.host_view(), {}, i, o, logp.host_view(), {}, {},
                                           t1, {}, nullptr);
    });
  };
  EXPECT_EQ(fwd(ids.host_view()), "");
  EXPECT_EQ(fwd(ids.host_view(), top1.host_view()), "");
  EXPECT_NE(fwd(ids.host_view(), logp.host_view()).find("is_top1: expected dtype bool or uint8"), std::string::npos);
  EXPECT_NE(fwd(ids.host_view(), top1_3.host_view()).find("is_top1: expected 4 elements"), std::string::npos);
  EXPECT_NE(fwd(ids.host_view(), ids.host_view()).find("is_top1"), std::string::npos);
  EXPECT_NE(fwd(ids3.host_view()).find("ids: expected shape [4]"), std::string::npos);
  ids.set_index(2, 5);
  EXPECT_NE(fwd(ids.host_view()).find("ids: expected values in [0, 5), got 5 at row 2"), std::string::npos);
  ids.set_index(2, 2);
  o.temperature = 0;
  EXPECT_NE(fwd(ids.host_view()).find("temperature"), std::string::npos);
}

TEST(LinearPolicyLossCudaErrors, BadIdAndWorkspaceOnGpu) {
  LOGITLESS_SKIP_WITHOUT_GPU();
  Small s;
  s.ids.set_index(3, 6);
  for (TestTensor* t : {&s.hidden, &s.weight, &s.bias, &s.ids, &s.adv, &s.mask, &s.ref, &s.loss}) t->to_device();
  LinearPolicyLossInputs p;
  p.hidden = s.hidden.view(true);
  p.weight = s.weight.view(true);
  p.bias = s.bias.view(true);
  p.completion_ids = s.ids.view(true);
  p.advantages = s.adv.view(true);
  p.completion_mask = s.mask.view(true);
  p.ref_logp = s.ref.view(true);
  PolicyLossOutputs o;
  o.loss = s.loss.view(true);
  expect_gpu_workspace_and_bad_id_errors([&](Workspace ws) { linear_policy_loss_forward(p, s.opt, o, ws, nullptr); },
                                         linear_policy_loss_forward_workspace_bytes(p, s.opt));
}

}  // namespace
}  // namespace logitless::test
