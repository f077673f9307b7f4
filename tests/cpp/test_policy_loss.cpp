// Policy losses and selective log-softmax: the CPU backend against a naive float64 reference, the CUDA kernels
// against the CPU backend, over dtype x layout x loss type x importance level x options x entry point; the
// reference's gradient against central differences; bad-input checks.
//
// The reference is written independently of policy_loss/math.h: the loss is a textbook function of the vector
// of per-token log-probabilities, and its derivative in each log-probability is taken by central differences
// (in double, on the cheap [B, L] function); the chain to the logits, ([j == id] - p_j) / T, is analytic and is
// itself checked against central differences over the logits on tiny shapes.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <functional>
#include <limits>
#include <optional>
#include <random>
#include <sstream>

#include "policy_loss/cuda/plan.h"
#include "policy_test_util.h"
#include "test_util.h"

#if defined(LOGITLESS_WITH_CUDA)
#include "policy_loss/cuda/kernels.h"
#include "policy_loss/cuda/steps.h"
#endif

namespace logitless::test {
namespace {

enum class PlLayout { kShifted, kAligned, kStrided };
const char* layout_name(PlLayout l) {
  switch (l) {
    case PlLayout::kShifted:
      return "shifted";
    case PlLayout::kAligned:
      return "aligned";
    case PlLayout::kStrided:
      return "strided";
  }
  return "?";
}

struct PlCase {
  int64_t B, L, V;
  DType dtype;
  PlLayout layout;
  Preset preset;
  PolicyLossType type;
  ImportanceSamplingLevel level;
};

std::string case_name(const PlCase& c) {
  std::ostringstream os;
  os << "B" << c.B << "_L" << c.L << "_V" << c.V << "_" << dtype_tag(c.dtype) << "_" << layout_name(c.layout) << "_"
     << preset_name(c.preset) << "_" << type_name(c.type) << "_" << level_name(c.level);
  return os.str();
}
void PrintTo(const PlCase& c, std::ostream* os) { *os << case_name(c); }

// ---- inputs -------------------------------------------------------------------------------------------------
struct PlInputs : PolicyTokenInputs {
  PlCase c;
  PolicyLossOptions opt;
  int64_t Lg = 0;  // logits positions per sequence: L + 1 (the model's output) or L
  TestTensor logits;

  PlInputs(const PlCase& cs, uint64_t seed) : c(cs) {
    std::mt19937_64 rng(seed);
    const int64_t B = c.B, L = c.L, V = c.V;
    opt.loss_type = c.type;
    opt.importance_sampling_level = c.level;
    opt.beta = 0.0;
    opt.max_completion_length = L + 3;
    switch (c.layout) {
      case PlLayout::kShifted:  // the model's [B, L+1, V] output, contiguous
        Lg = L + 1;
        logits = TestTensor(c.dtype, {B, Lg, V});
        ids = TestTensor(DType::kInt64, {B, L});
        break;
      case PlLayout::kAligned:  // [B, L, V] with padded rows starting at odd element offsets (misaligned)
        Lg = L;
        logits = TestTensor(c.dtype, {B, L, V}, {L * (V + 3), V + 3, 1}, /*offset=*/1);
        ids = TestTensor(DType::kInt32, {B, L});
        break;
      case PlLayout::kStrided:  // [B, L+1, V] rows of a wider buffer; ids a view input_ids[:, -L:]
        Lg = L + 1;
        logits = TestTensor(c.dtype, {B, Lg, V}, {Lg * (V + 5), V + 5, 1}, /*offset=*/3);
        ids = TestTensor(DType::kInt32, {B, L}, {L + 7, 1}, /*offset=*/7);
        break;
    }
    logits.fill_storage_nan();  // padding poisoned: a kernel that reads outside the view returns NaN
    ids.fill_storage_bytes(0x7F);
    logits.fill_normal(seed, 2.f);
    adv = TestTensor(DType::kFloat32, {B}, {c.layout == PlLayout::kStrided ? 2 : 1});
    fill_random(rng, B, L, V);

    const bool strided = c.layout == PlLayout::kStrided;
    auto token_tensor = [&](DType dt) {  // [B, L]; stored transposed in the strided layout
      return strided ? TestTensor(dt, {B, L}, {1, B}) : TestTensor(dt, {B, L});
    };
    apply_preset(c.preset, B, L, opt, token_tensor);
    if (has_mask) {
      mask.fill_storage_bytes(0x5A);
      write_mask();
    }
    apply_preset_ids(c.preset, V);
    if (has_old || has_ref) make_old_ref(true_logp(*this, B * L), rng, token_tensor);
  }

  // A perturbation of one logit in double (the finite-difference test's step), on top of the stored value.
  int64_t perturb_at = -1;
  double perturb_by = 0;
  double x(int64_t b, int64_t l, int64_t j) const {  // logits / temperature
    const int64_t k = (b * Lg + l) * c.V + j;
    const double v = static_cast<double>(logits.get(k)) + (k == perturb_at ? perturb_by : 0.0);
    return v / opt.temperature;
  }
  bool bad(int64_t r) const { return id(r) < 0 || id(r) >= c.V; }

  std::vector<double> row(int64_t t) const {  // token t's logits / temperature
    std::vector<double> out(static_cast<size_t>(c.V));
    for (int64_t j = 0; j < c.V; ++j) out[j] = x(t / c.L, t % c.L, j);
    return out;
  }

  PolicyLossInputs view(bool dev) const {
    PolicyLossInputs in;
    in.logits = logits.view(dev);
    token_views(in, dev);
    return in;
  }
  void to_device() {
    logits.to_device();
    tokens_to_device();
  }
};

// ---- float64 reference ----------------------------------------------------------------------------------------
struct PlRef : PolicyReference {
  std::vector<double> grad;  // [B*Lg*V] in the logits view's flat order, upstream factor applied
  double grad_unit = 0;      // the largest |d(loss)/d(logp)| / T (upstream included): the natural size of a
                             // gradient row, which is that coefficient times ([j == id] - p_j)
};

// The loss as a function of the per-token log-probabilities `lp`, a detached logp holding `base` (see
// policy_reference_loss): the function the finite-difference test differentiates.
double reference_loss(const PlInputs& in, const std::vector<double>& lp, const std::vector<double>& base) {
  return policy_reference_loss(in, in.c.B, in.c.L, in.opt, lp, base, nullptr);
}

// The coefficients d(loss)/d(logp) (and with them grad_unit) are always computed: every gradient comparison scales
// its tolerance with them, the CUDA tests' too. `want_logits_grad` adds the [B*Lg*V] gradient itself.
PlRef reference(const PlInputs& in, double upstream, bool want_logits_grad) {
  const int64_t B = in.c.B, L = in.c.L, V = in.c.V, N = B * L;
  PlRef r;
  // The finite differences leave bad ids' tokens out of the loss, so that the other tokens' coefficients stay finite.
  policy_reference_forward(in, B, L, in.opt, upstream, SkipNan::kLogp, r);
  for (int64_t t = 0; t < N; ++t)
    if (std::isfinite(r.dlogp[t])) r.grad_unit = std::max(r.grad_unit, std::abs(r.dlogp[t]) / in.opt.temperature);
  if (!want_logits_grad) return r;
  r.grad.assign(static_cast<size_t>(B * in.Lg * V), 0.0);
  for (int64_t t = 0; t < N; ++t) {
    const int64_t b = t / L, l = t % L;
    double* g = r.grad.data() + (b * in.Lg + l) * V;
    if (in.w[t] == 0) continue;
    for (int64_t j = 0; j < V; ++j) {
      if (std::isnan(r.dlogp[t])) {
        g[j] = NAN;
        continue;
      }
      const double pj = std::exp(in.x(b, l, j) - r.lse[t]);
      g[j] = r.dlogp[t] * ((j == in.id(t) ? 1.0 : 0.0) - pj) / in.opt.temperature;
    }
  }
  return r;
}

// ---- running a backend ---------------------------------------------------------------------------------------
enum class PlEntry { kForward, kForwardBackward, kInPlace };
const char* entry_name(PlEntry e) {
  switch (e) {
    case PlEntry::kForward:
      return "forward";
    case PlEntry::kForwardBackward:
      return "forward_backward";
    case PlEntry::kInPlace:
      return "forward_backward(in place)";
  }
  return "?";
}

struct PlOut : PolicyForwardOut {
  std::vector<float> grad;
};

PlOut run_backend(PlInputs& in, PlEntry e, bool dev, float upstream, bool want_entropy = true) {
  PolicyOutputTensors outs(in.c.B, in.c.L);
  TestTensor grad(in.c.dtype, in.logits.sizes());
  TestTensor gscale(DType::kFloat32, {});
  gscale.set(0, upstream);
  grad.fill_storage_nan();
  std::optional<TestTensor> inplace;
  if (e == PlEntry::kInPlace) inplace.emplace(in.logits.clone());
  if (dev) {
    in.to_device();
    outs.to_device();
    for (TestTensor* t : {&grad, &gscale}) t->to_device();
    if (inplace) inplace->to_device();
  }
  PolicyLossInputs pin = in.view(dev);
  if (inplace) pin.logits = inplace->view(dev);
  const PolicyLossOutputs out = outs.views(dev, want_entropy);
  DeviceScratch ws(dev ? policy_loss_workspace_bytes(pin, in.opt) : 0);
  switch (e) {
    case PlEntry::kForward:
      policy_loss_forward(pin, in.opt, out, ws.ws(), nullptr);
      break;
    case PlEntry::kForwardBackward:
      policy_loss_forward_backward(pin, in.opt, out, grad.view(dev), gscale.view(dev), ws.ws(), nullptr);
      break;
    case PlEntry::kInPlace:
      policy_loss_forward_backward(pin, in.opt, out, pin.logits, gscale.view(dev), ws.ws(), nullptr);
      break;
  }
  if (dev) {
    device_synchronize();
    outs.to_host();
    grad.to_host();
    if (inplace) inplace->to_host();
  }
  PlOut o;
  outs.read(o, want_entropy);
  if (e != PlEntry::kForward) o.grad = (inplace ? *inplace : grad).gather_float();
  return o;
}

// Compares a backend's outputs with expected ones (the reference's, or the CPU backend's).
void expect_outputs(const PlInputs& in, PlEntry e, const PlOut& got, const PlOut& want, const PlRef& ref,
                    const std::string& who) {
  const DType dt = in.c.dtype;
  const std::string tag = who + " " + entry_name(e);
  const double u = logp_unit(ref);
  expect_forward_close(got, want, ref, dt, u, tag);
  int64_t clip_mismatch = 0, first = -1;
  for (size_t t = 0; t < got.clipped.size(); ++t)
    if (got.clipped[t] != want.clipped[t]) clip_mismatch++, first = first < 0 ? static_cast<int64_t>(t) : first;
  EXPECT_EQ(clip_mismatch, 0) << tag << " is_clipped differs first at token " << first;
  if (e != PlEntry::kForward) {
    // A gradient element is c ([j == id] - p_j) / T: its errors are roundings of c (carrying logp's, hence u) and
    // of p_j, so they scale with the token's coefficient |c| / T (ref.grad_unit, the largest), also where the
    // element itself cancels to 0 (p = 1 at V = 1).
    double gmax = 0;
    for (float x : want.grad)
      if (std::isfinite(x)) gmax = std::max(gmax, static_cast<double>(std::abs(x)));
    const double scale = std::max(gmax, ref.grad_unit * u);
    EXPECT_TRUE(all_close(got.grad, want.grad, tolerance(dt, Quantity::kGrad), scale, tag + " grad"));
  }
}

PlOut from_reference(const PlRef& r) {
  PlOut o;
  static_cast<PolicyForwardOut&>(o) = r;  // the forward outputs
  o.grad.assign(r.grad.begin(), r.grad.end());
  return o;
}

// ---- the case list ---------------------------------------------------------------------------------------------
std::vector<PlCase> make_cases(bool gpu_suite) {
  std::vector<PlCase> cases;
  const PolicyLossType types[] = {PolicyLossType::kGrpo, PolicyLossType::kBnpo, PolicyLossType::kDrGrpo,
                                  PolicyLossType::kDapo};
  const ImportanceSamplingLevel levels[] = {ImportanceSamplingLevel::kToken, ImportanceSamplingLevel::kSequence};
  const DType dts[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};
  using Shape = std::array<int64_t, 3>;
  // CPU: small shapes (the float64 reference is O(B L V) per loss evaluation). GPU: the CPU backend is the
  // expectation, so larger vocabularies (V=150000 is Qwen's, the benchmark's) and a few hundred rows.
  const std::vector<Shape> shapes =
      gpu_suite ? std::vector<Shape>{{3, 5, 1000}, {2, 37, 32003}, {2, 3, 150000}, {4, 64, 4099}}
                : std::vector<Shape>{{3, 5, 37}, {2, 4, 1000}};
  for (const Shape& s : shapes) {
    for (DType dt : dts) {
      // Every loss type at both levels with every option set (mask, old, ref, temperature, clip-higher).
      for (auto t : types)
        for (auto l : levels) cases.push_back({s[0], s[1], s[2], dt, PlLayout::kShifted, Preset::kFull, t, l});
      cases.push_back({s[0], s[1], s[2], dt, PlLayout::kAligned, Preset::kFloatMask, PolicyLossType::kGrpo,
                       ImportanceSamplingLevel::kSequence});
      cases.push_back({s[0], s[1], s[2], dt, PlLayout::kStrided, Preset::kFloatMask, PolicyLossType::kBnpo,
                       ImportanceSamplingLevel::kToken});
      cases.push_back({s[0], s[1], s[2], dt, PlLayout::kStrided, Preset::kSeedLike, PolicyLossType::kGrpo,
                       ImportanceSamplingLevel::kToken});
      cases.push_back({s[0], s[1], s[2], dt, PlLayout::kAligned, Preset::kPlain, PolicyLossType::kDrGrpo,
                       ImportanceSamplingLevel::kToken});
      cases.push_back({s[0], s[1], s[2], dt, PlLayout::kShifted, Preset::kPlain, PolicyLossType::kGrpo,
                       ImportanceSamplingLevel::kSequence});
      cases.push_back({s[0], s[1], s[2], dt, PlLayout::kShifted, Preset::kDapoGlobal, PolicyLossType::kDapo,
                       ImportanceSamplingLevel::kToken});
      cases.push_back({s[0], s[1], s[2], dt, PlLayout::kShifted, Preset::kAllMasked, PolicyLossType::kGrpo,
                       ImportanceSamplingLevel::kToken});
      cases.push_back({s[0], s[1], s[2], dt, PlLayout::kAligned, Preset::kBadIdNoCheck, PolicyLossType::kBnpo,
                       ImportanceSamplingLevel::kToken});
    }
  }
  // Edge shapes: one token, one class, an empty batch.
  for (const Shape& s : {Shape{1, 1, 7}, Shape{2, 3, 1}, Shape{0, 4, 9}, Shape{3, 0, 9}}) {
    cases.push_back({s[0], s[1], s[2], DType::kFloat32, PlLayout::kShifted, Preset::kFull, PolicyLossType::kGrpo,
                     ImportanceSamplingLevel::kSequence});
    cases.push_back({s[0], s[1], s[2], DType::kBFloat16, PlLayout::kAligned, Preset::kSeedLike, PolicyLossType::kDapo,
                     ImportanceSamplingLevel::kToken});
  }
  return cases;
}

uint64_t seed_of(const PlCase& c) { return std::hash<std::string>{}(case_name(c)); }

class PolicyLossCpu : public ::testing::TestWithParam<PlCase> {};
class PolicyLossCuda : public ::testing::TestWithParam<PlCase> {};

const PlEntry kEntries[] = {PlEntry::kForward, PlEntry::kForwardBackward, PlEntry::kInPlace};

TEST_P(PolicyLossCpu, MatchesFloat64Reference) {
  PlInputs in(GetParam(), seed_of(GetParam()));
  const float up = 1.25f;
  const PlRef ref = reference(in, up, /*want_logits_grad=*/true);
  PlOut want = from_reference(ref);
  for (PlEntry e : kEntries) {
    SCOPED_TRACE(entry_name(e));
    PlOut got = run_backend(in, e, /*dev=*/false, up);
    // The reference's loss is that of upstream factor 1; only the gradient carries `up`.
    expect_outputs(in, e, got, want, ref, "cpu");
    if (e != PlEntry::kForward) {
      // Masked rows and the unused last position are exactly 0.
      for (int64_t b = 0; b < in.c.B; ++b)
        for (int64_t l = 0; l < in.Lg; ++l) {
          if (l < in.c.L && in.w[b * in.c.L + l] != 0) continue;
          for (int64_t j = 0; j < in.c.V; ++j) ASSERT_EQ(got.grad[(b * in.Lg + l) * in.c.V + j], 0.f);
        }
    }
  }
}

TEST_P(PolicyLossCuda, MatchesCpuBackend) {
  LOGITLESS_SKIP_WITHOUT_GPU();
  PlInputs in(GetParam(), seed_of(GetParam()));
  const float up = 0.75f;
  // The sizes the tolerances scale with, the gradient's unit among them. That unit is the reference's coefficient,
  // not the CPU result's largest element: at V = 1 every gradient element cancels to exactly 0 (p = 1), while the
  // kernel's p carries float32 rounding, so its error is a rounding of the coefficient, not of 0.
  const PlRef ref = reference(in, up, /*want_logits_grad=*/false);
  const PlOut want = run_backend(in, PlEntry::kForwardBackward, false, up);
  for (PlEntry e : kEntries) {
    SCOPED_TRACE(entry_name(e));
    const PlOut got = run_backend(in, e, /*dev=*/true, up);
    expect_outputs(in, e, got, want, ref, "cuda");
  }
}

// Every CUDA algorithm must agree with the CPU, not only the one kAuto picks; tiles swept too.
TEST_P(PolicyLossCuda, EveryAlgorithmMatchesCpuBackend) {
  LOGITLESS_SKIP_WITHOUT_GPU();
  const PlCase c = GetParam();
  if (c.preset != Preset::kFull && c.preset != Preset::kFloatMask) GTEST_SKIP() << "covered by MatchesCpuBackend";
  PlInputs in(c, seed_of(c) + 3);
  const float up = 1.5f;
  const PlRef ref = reference(in, up, /*want_logits_grad=*/false);  // tolerance sizes, as in MatchesCpuBackend
  const PlOut want = run_backend(in, PlEntry::kForwardBackward, false, up);
  struct Variant {
    PolicyLossAlgo algo;
    int cluster, threads;
  };
  for (const Variant v :
       {Variant{PolicyLossAlgo::kStreaming, 0, 0}, Variant{PolicyLossAlgo::kStreaming, 0, 512},
        Variant{PolicyLossAlgo::kCluster, 0, 0}, Variant{PolicyLossAlgo::kCluster, 2, 256},
        Variant{PolicyLossAlgo::kCluster, 8, 128}, Variant{PolicyLossAlgo::kRowResident, 0, 0},
        Variant{PolicyLossAlgo::kRowResident, 3, 128}, Variant{PolicyLossAlgo::kRowResident, 16, 0}}) {
    SCOPED_TRACE(std::to_string(static_cast<int>(v.algo)) + " cluster " + std::to_string(v.cluster) + " threads " +
                 std::to_string(v.threads));
    in.opt.algo = v.algo;
    in.opt.cluster_size = v.cluster;
    in.opt.threads = v.threads;
    try {
      const PlOut got = run_backend(in, PlEntry::kInPlace, true, up, c.preset == Preset::kFull);
#if defined(LOGITLESS_WITH_CUDA)
      // Token level, the fused pass is the last row launch: the resident kernel ran it (sequence level, the last
      // launch is the backward from the saved lse, which streams).
      if (v.algo == PolicyLossAlgo::kRowResident && c.level == ImportanceSamplingLevel::kToken && c.B * c.L > 0)
        EXPECT_EQ(pl::debug::last_rows_plan.get().algo, PolicyLossAlgo::kRowResident);
#endif
      PlOut w = want;
      if (c.preset != Preset::kFull) w.entropy = got.entropy;  // not requested in this run
      expect_outputs(in, PlEntry::kInPlace, got, w, ref, "cuda variant");
    } catch (const Error& err) {
      const std::string msg = err.what();
      if (v.algo == PolicyLossAlgo::kCluster && msg.find("algo") != std::string::npos) continue;  // not Hopper
#if defined(LOGITLESS_WITH_CUDA)
      // Every variant's tiles fit every shape here on Hopper: a refusal is a failure there.
      if (v.algo == PolicyLossAlgo::kRowResident && msg.find("algo") != std::string::npos &&
          !pl::rows_resident_available(0))
        continue;
#endif

      throw;
    }
  }
}

std::string param_name(const ::testing::TestParamInfo<PlCase>& info) { return case_name(info.param); }

INSTANTIATE_TEST_SUITE_P(Shapes, PolicyLossCpu, ::testing::ValuesIn(make_cases(false)), param_name);
INSTANTIATE_TEST_SUITE_P(Shapes, PolicyLossCuda, ::testing::ValuesIn(make_cases(true)), param_name);

// ---- the reference itself: its gradient against central differences over the logits ----------------------------
TEST(PolicyLossReference, GradientMatchesFiniteDifferences) {
  for (Preset preset : {Preset::kFull, Preset::kSeedLike, Preset::kFloatMask}) {
    for (auto level : {ImportanceSamplingLevel::kToken, ImportanceSamplingLevel::kSequence}) {
      for (auto type : {PolicyLossType::kGrpo, PolicyLossType::kDrGrpo}) {
        PlCase c{2, 3, 5, DType::kFloat32, PlLayout::kShifted, preset, type, level};
        PlInputs in(c, 17);
        const PlRef r = reference(in, 1.0, /*want_logits_grad=*/true);
        const double h = 1e-5;
        const std::vector<double> base = r.logp;  // the detached logp stays at its unperturbed value
        for (int64_t k = 0; k < in.logits.numel(); ++k) {
          auto loss_at = [&](double step) {
            in.perturb_at = k;
            in.perturb_by = step;
            const PlRef q = reference(in, 1.0, /*want_logits_grad=*/false);
            return reference_loss(in, q.logp, base);
          };
          const double fp = loss_at(h), fm = loss_at(-h);
          in.perturb_at = -1;
          EXPECT_NEAR(r.grad[k], (fp - fm) / (2 * h), 1e-6)
              << preset_name(preset) << " " << level_name(level) << " " << type_name(type) << " element " << k;
        }
      }
    }
  }
}

// The loss and its gradient at the seed's setting by hand: no old policy, so the ratio term is -A per token and
// the gradient of logp_t is (-A + beta (1 - exp(ref - logp))) times the reduction's factor.
TEST(PolicyLossReference, SeedSettingByHand) {
  PlCase c{2,
           2,
           4,
           DType::kFloat32,
           PlLayout::kShifted,
           Preset::kSeedLike,
           PolicyLossType::kBnpo,
           ImportanceSamplingLevel::kToken};
  PlInputs in(c, 5);
  const PlRef r = reference(in, 1.0, /*want_logits_grad=*/true);
  double total_w = 0, loss = 0;
  for (double v : in.w) total_w += v;
  for (int64_t t = 0; t < 4; ++t) {
    if (in.w[t] == 0) continue;
    const double d = in.ref.get(t) - r.logp[t];
    loss += -in.a(t / 2) + 0.04 * (std::exp(d) - d - 1);
    EXPECT_NEAR(r.dlogp[t], (-in.a(t / 2) + 0.04 * (1 - std::exp(d))) / total_w, 1e-7);
  }
  EXPECT_NEAR(r.loss, loss / total_w, 1e-12);
}

// Issue 19: with beta = 0 the KL term enters neither the loss nor the gradient, so -inf or NaN in ref_logp leaves
// them finite (TRL does not evaluate the KL term then; 0 * inf made them NaN). The kl output still reports the k3
// value of a given ref_logp: +inf for a -inf ref_logp, NaN for a NaN one. Against the float64 reference, and every
// output but kl equal to that of the same call with those ref_logp finite; on the CPU and the GPU.
TEST(PolicyLossNumerics, BetaZeroLeavesNonFiniteRefLogpOutOfTheLoss) {
  LOGITLESS_TRACE_SEED();
  const uint64_t seed = fresh_seed();
  for (bool dev : {false, true}) {
    if (dev && !has_gpu()) continue;
    for (ImportanceSamplingLevel level : {ImportanceSamplingLevel::kToken, ImportanceSamplingLevel::kSequence}) {
      SCOPED_TRACE(std::string(dev ? "cuda " : "cpu ") + level_name(level));
      PlCase c{3, 5, 37, DType::kFloat32, PlLayout::kShifted, Preset::kFull, PolicyLossType::kGrpo, level};
      PlInputs in(c, seed);
      in.opt.beta = 0.0;
      const PlOut finite = run_backend(in, PlEntry::kForwardBackward, dev, 1.f);
      std::vector<int64_t> hit;  // two unmasked tokens: -inf and NaN
      for (int64_t t = 0; t < c.B * c.L && hit.size() < 2; ++t)
        if (in.w[t] != 0 && (t % 4 == static_cast<int64_t>(seed % 4) || t > 8)) hit.push_back(t);
      ASSERT_EQ(hit.size(), 2u);
      in.ref.set(hit[0], -INFINITY);
      in.ref.set(hit[1], NAN);
      const PlRef ref = reference(in, 1.0, /*want_logits_grad=*/true);
      const PlOut got = run_backend(in, PlEntry::kForwardBackward, dev, 1.f);
      expect_outputs(in, PlEntry::kForwardBackward, got, from_reference(ref), ref, dev ? "cuda" : "cpu");
      EXPECT_TRUE(std::isfinite(got.loss));
      EXPECT_EQ(got.loss, finite.loss);
      EXPECT_EQ(got.per_token_loss, finite.per_token_loss);
      ASSERT_EQ(got.grad.size(), finite.grad.size());
      for (size_t i = 0; i < got.grad.size(); ++i) ASSERT_EQ(got.grad[i], finite.grad[i]) << "element " << i;
      EXPECT_EQ(got.kl[hit[0]], INFINITY);
      EXPECT_TRUE(std::isnan(got.kl[hit[1]]));
      // With beta > 0 the penalty counts: that token's loss is +inf (and so is the loss) or NaN.
      in.opt.beta = 0.04;
      in.ref.set(hit[1], -2.f);
      const PlOut penalized = run_backend(in, PlEntry::kForward, dev, 1.f);
      EXPECT_EQ(penalized.per_token_loss[hit[0]], INFINITY);
      EXPECT_EQ(penalized.loss, INFINITY);
    }
  }
}

// ---- selective log-softmax --------------------------------------------------------------------------------------
struct SelCase {
  int64_t N, V;
  DType dtype;
  bool padded;
  double temperature;
};
std::string sel_name(const SelCase& c) {
  std::ostringstream os;
  os << "N" << c.N << "_V" << c.V << "_" << dtype_tag(c.dtype) << (c.padded ? "_padded" : "_contig") << "_T"
     << static_cast<int>(c.temperature * 10);
  return os.str();
}

struct SelRun : SelectiveForwardOut {
  std::vector<float> grad;
};

struct SelInputs {
  SelCase c;
  TestTensor logits, ids, grad_logp;
  SelInputs(const SelCase& cs, uint64_t seed) : c(cs) {
    logits = c.padded ? TestTensor(c.dtype, {c.N, c.V}, {c.V + 3, 1}, 1) : TestTensor(c.dtype, {c.N, c.V});
    ids = c.padded ? TestTensor(DType::kInt32, {c.N}, {3}) : TestTensor(DType::kInt64, {c.N});
    logits.fill_storage_nan();
    logits.fill_normal(seed, 2.f);
    std::mt19937_64 rng(seed);
    std::uniform_int_distribution<int64_t> idd(0, c.V - 1);
    for (int64_t i = 0; i < c.N; ++i) ids.set_index(i, idd(rng));
    grad_logp = TestTensor(DType::kFloat32, {c.N});
    std::uniform_real_distribution<float> u(-1.5f, 1.5f);
    for (int64_t i = 0; i < c.N; ++i) grad_logp.set(i, u(rng));
  }
};

SelRun run_selective(SelInputs& in, bool dev) {
  SelectiveLogSoftmaxOptions o;
  o.temperature = in.c.temperature;
  TestTensor logp(DType::kFloat32, {in.c.N}), ent(DType::kFloat32, {in.c.N}), lse(DType::kFloat32, {in.c.N});
  TestTensor grad(in.c.dtype, {in.c.N, in.c.V});
  for (TestTensor* t : {&logp, &ent, &lse, &grad}) t->fill_storage_nan();
  if (dev) {
    for (TestTensor* t : {&in.logits, &in.ids, &in.grad_logp, &logp, &ent, &lse, &grad}) t->to_device();
  }
  DeviceScratch ws(dev ? selective_log_softmax_workspace_bytes(in.logits.view(dev), in.ids.view(dev), o) : 0);
  selective_log_softmax_forward(in.logits.view(dev), in.ids.view(dev), o, logp.view(dev), ent.view(dev), lse.view(dev),
                                ws.ws(), nullptr);
  selective_log_softmax_backward(in.logits.view(dev), in.ids.view(dev), lse.view(dev), in.grad_logp.view(dev), o,
                                 grad.view(dev), ws.ws(), nullptr);
  if (dev) {
    device_synchronize();
    for (TestTensor* t : {&logp, &ent, &lse, &grad}) t->to_host();
  }
  SelRun r;
  for (int64_t i = 0; i < in.c.N; ++i) {
    r.logp.push_back(logp.get(i));
    r.entropy.push_back(ent.get(i));
    r.lse.push_back(lse.get(i));
  }
  r.grad = grad.gather_float();
  return r;
}

SelRun selective_reference(const SelInputs& in) {
  SelRun r;
  const double T = in.c.temperature;
  for (int64_t i = 0; i < in.c.N; ++i) {
    std::vector<double> x(in.c.V);
    for (int64_t j = 0; j < in.c.V; ++j) x[j] = in.logits.get(i * in.c.V + j) / T;
    const int64_t t = in.ids.get_index(i);
    const double lse = push_selective_row(x, t, r);
    for (int64_t j = 0; j < in.c.V; ++j)
      r.grad.push_back(static_cast<float>(in.grad_logp.get(i) * ((j == t) - std::exp(x[j] - lse)) / T));
  }
  return r;
}

void expect_selective(const SelInputs& in, const SelRun& got, const SelRun& want, const std::string& who) {
  const DType dt = in.c.dtype;
  expect_selective_forward_close(got, want, dt, who);
  double gmax = 1.5 / in.c.temperature;
  EXPECT_TRUE(all_close(got.grad, want.grad, tolerance(dt, Quantity::kGrad), gmax, who + " grad"));
}

std::vector<SelCase> sel_cases(bool gpu) {
  std::vector<SelCase> cases;
  const std::vector<std::array<int64_t, 2>> shapes =
      gpu ? std::vector<std::array<int64_t, 2>>{{0, 5}, {1, 1}, {37, 1000}, {5, 150000}, {300, 32003}}
          : std::vector<std::array<int64_t, 2>>{{0, 5}, {1, 1}, {7, 3}, {9, 1000}};
  for (auto s : shapes)
    for (DType dt : {DType::kFloat32, DType::kFloat16, DType::kBFloat16})
      for (bool padded : {false, true}) cases.push_back({s[0], s[1], dt, padded, padded ? 0.6 : 1.0});
  return cases;
}

class SelectiveLogSoftmaxCpu : public ::testing::TestWithParam<SelCase> {};
class SelectiveLogSoftmaxCuda : public ::testing::TestWithParam<SelCase> {};

TEST_P(SelectiveLogSoftmaxCpu, MatchesFloat64Reference) {
  SelInputs in(GetParam(), std::hash<std::string>{}(sel_name(GetParam())));
  expect_selective(in, run_selective(in, false), selective_reference(in), "cpu");
}

TEST_P(SelectiveLogSoftmaxCuda, MatchesCpuBackend) {
  LOGITLESS_SKIP_WITHOUT_GPU();
  SelInputs in(GetParam(), std::hash<std::string>{}(sel_name(GetParam())));
  const SelRun want = run_selective(in, false);
  expect_selective(in, run_selective(in, true), want, "cuda");
}

std::string sel_param_name(const ::testing::TestParamInfo<SelCase>& info) { return sel_name(info.param); }
INSTANTIATE_TEST_SUITE_P(Shapes, SelectiveLogSoftmaxCpu, ::testing::ValuesIn(sel_cases(false)), sel_param_name);
INSTANTIATE_TEST_SUITE_P(Shapes, SelectiveLogSoftmaxCuda, ::testing::ValuesIn(sel_cases(true)), sel_param_name);

// ---- bad input --------------------------------------------------------------------------------------------------
struct SmallPolicy {
  TestTensor logits{DType::kFloat32, {2, 4, 6}}, ids{DType::kInt64, {2, 3}}, adv{DType::kFloat32, {2}},
      mask{DType::kInt32, {2, 3}}, ref{DType::kFloat32, {2, 3}}, loss{DType::kFloat32, {}};
  PolicyLossOptions opt;
  SmallPolicy() {
    logits.fill_normal(3, 1.f);
    for (int64_t i = 0; i < 6; ++i) ids.set_index(i, i % 6), mask.set_index(i, 1), ref.set(i, -2.f);
    adv.set(0, 1.f), adv.set(1, -1.f);
  }
  PolicyLossInputs in() const {
    PolicyLossInputs p;
    p.logits = logits.host_view();
    p.completion_ids = ids.host_view();
    p.advantages = adv.host_view();
    p.completion_mask = mask.host_view();
    p.ref_logp = ref.host_view();
    return p;
  }
  std::string run(const PolicyLossInputs& p) const {
    PolicyLossOutputs o;
    o.loss = loss.host_view();
    return error_of([&] { policy_loss_forward(p, opt, o, {}, nullptr); });
  }
};

TEST(PolicyLossErrors, ShapesNameTheArgument) {
  SmallPolicy s;
  EXPECT_EQ(s.run(s.in()), "");
  TestTensor ids3(DType::kInt64, {3, 3}), adv3(DType::kFloat32, {3}), mask2(DType::kInt32, {2, 4}),
      ref2(DType::kFloat32, {3, 2}), logits_bad(DType::kFloat32, {2, 6, 6}), logits2(DType::kFloat32, {8, 6});
  auto with = [&](auto f) {
    PolicyLossInputs p = s.in();
    f(p);
    return s.run(p);
  };
  EXPECT_NE(with([&](auto& p) { p.completion_ids = ids3.host_view(); }).find("logits: expected shape [3, 4, V]"),
            std::string::npos);
  EXPECT_NE(with([&](auto& p) { p.advantages = adv3.host_view(); }).find("advantages: expected shape [2]"),
            std::string::npos);
  EXPECT_NE(
      with([&](auto& p) { p.completion_mask = mask2.host_view(); }).find("completion_mask: expected shape [2, 3]"),
      std::string::npos);
  EXPECT_NE(with([&](auto& p) { p.ref_logp = ref2.host_view(); }).find("ref_logp: expected shape [2, 3]"),
            std::string::npos);
  EXPECT_NE(with([&](auto& p) { p.logits = logits_bad.host_view(); }).find("logits: expected shape [2, 4, V]"),
            std::string::npos);
  EXPECT_NE(with([&](auto& p) { p.logits = logits2.host_view(); }).find("logits"), std::string::npos);
  TestTensor mask_f16(DType::kFloat16, {2, 3});
  EXPECT_NE(with([&](auto& p) { p.completion_mask = mask_f16.host_view(); }).find("completion_mask: expected dtype"),
            std::string::npos);
  TestTensor ids_f(DType::kFloat32, {2, 3});
  EXPECT_NE(with([&](auto& p) {
              p.completion_ids = ids_f.host_view();
            }).find("completion_ids: expected dtype int32 or int64"),
            std::string::npos);
  TensorView strided = s.logits.host_view();
  strided.strides[2] = 2;
  EXPECT_NE(with([&](auto& p) { p.logits = strided; }).find("stride 1"), std::string::npos);
}

TEST(PolicyLossErrors, OptionsNameTheArgument) {
  SmallPolicy s;
  auto with = [&](auto f) {
    SmallPolicy t;
    f(t.opt);
    PolicyLossInputs p = t.in();
    if (t.opt.beta > 1.0) p.ref_logp = {};  // the KL case below
    return t.run(p);
  };
  EXPECT_NE(with([](auto& o) { o.beta = 2.0; }).find("ref_logp: expected a tensor when beta > 0"), std::string::npos);
  EXPECT_NE(with([](auto& o) { o.loss_type = PolicyLossType::kDrGrpo; }).find("max_completion_length"),
            std::string::npos);
  EXPECT_NE(with([](auto& o) { o.temperature = 0; }).find("temperature"), std::string::npos);
  EXPECT_NE(with([](auto& o) { o.eps_low = -0.1; }).find("eps_low"), std::string::npos);
  EXPECT_NE(with([](auto& o) { o.beta = -1; }).find("beta"), std::string::npos);
  EXPECT_NE(with([](auto& o) { o.num_items_in_batch = -3; }).find("num_items_in_batch"), std::string::npos);
  EXPECT_NE(with([](auto& o) { o.loss_type = static_cast<PolicyLossType>(9); }).find("loss_type"), std::string::npos);
  EXPECT_NE(with([](auto& o) { o.threads = 100; }).find("threads"), std::string::npos);
  (void)s;
}

TEST(PolicyLossErrors, BadIdNamesFirstUnmaskedToken) {
  SmallPolicy s;
  s.ids.set_index(1, 6);  // [0, 1]: masked below, so ignored
  s.mask.set_index(1, 0);
  s.ids.set_index(4, -1);  // [1, 1]: the first bad unmasked token
  s.ids.set_index(5, 99);
  Error::Kind kind{};
  const std::string msg = error_of(
      [&] {
        PolicyLossOutputs o;
        o.loss = s.loss.host_view();
        policy_loss_forward(s.in(), s.opt, o, {}, nullptr);
      },
      &kind);
  EXPECT_NE(msg.find("completion_ids"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[1, 1]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("got -1"), std::string::npos) << msg;
  EXPECT_EQ(kind, Error::Kind::kInvalidArgument);
  EXPECT_EQ(s.loss.get(0), 0.f);  // nothing was written
}

TEST(PolicyLossErrors, GradientBufferMustNotPartiallyOverlap) {
  SmallPolicy s;
  TensorView g = s.logits.host_view();
  g.data = static_cast<float*>(g.data) + 1;
  PolicyLossOutputs o;
  o.loss = s.loss.host_view();
  const std::string msg = error_of([&] { policy_loss_forward_backward(s.in(), s.opt, o, g, {}, {}, nullptr); });
  EXPECT_NE(msg.find("grad_logits"), std::string::npos) << msg;
}

TEST(PolicyLossErrors, OutputsAndSelective) {
  SmallPolicy s;
  TestTensor small(DType::kFloat32, {5}), clip_f(DType::kFloat32, {2, 3});
  PolicyLossOutputs o;
  o.loss = s.loss.host_view();
  o.kl = small.host_view();
  EXPECT_NE(error_of([&] { policy_loss_forward(s.in(), s.opt, o, {}, nullptr); }).find("kl: expected 6 elements"),
            std::string::npos);
  o.kl = {};
  o.is_clipped = clip_f.host_view();
  EXPECT_NE(
      error_of([&] { policy_loss_forward(s.in(), s.opt, o, {}, nullptr); }).find("is_clipped: expected dtype bool"),
      std::string::npos);

  TestTensor logits(DType::kFloat32, {4, 5}), ids(DType::kInt64, {4}), logp(DType::kFloat32, {4}),
      ids3(DType::kInt64, {3});
  logits.fill_normal(1, 1.f);
  for (int64_t i = 0; i < 4; ++i) ids.set_index(i, i);
  SelectiveLogSoftmaxOptions so;
  EXPECT_EQ(error_of([&] {
              selective_log_softmax_forward(logits.host_view(), ids.host_view(), so, logp.host_view(), {}, {}, {},
                                            nullptr);
            }),
            "");
  EXPECT_NE(error_of([&] {
              selective_log_softmax_forward(logits.host_view(), ids3.host_view(), so, logp.host_view(), {}, {}, {},
                                            nullptr);
            }).find("ids: expected shape [4]"),
            std::string::npos);
  ids.set_index(2, 5);
  EXPECT_NE(error_of([&] {
              selective_log_softmax_forward(logits.host_view(), ids.host_view(), so, logp.host_view(), {}, {}, {},
                                            nullptr);
            }).find("ids: expected values in [0, 5), got 5 at row 2"),
            std::string::npos);
  so.temperature = -1;
  EXPECT_NE(error_of([&] {
              selective_log_softmax_forward(logits.host_view(), ids.host_view(), so, logp.host_view(), {}, {}, {},
                                            nullptr);
            }).find("temperature"),
            std::string::npos);
}

TEST(PolicyLossCudaErrors, BadIdAndWorkspaceOnGpu) {
  LOGITLESS_SKIP_WITHOUT_GPU();
  SmallPolicy s;
  s.ids.set_index(3, 6);
  for (TestTensor* t : {&s.logits, &s.ids, &s.adv, &s.mask, &s.ref, &s.loss}) t->to_device();
  PolicyLossInputs p;
  p.logits = s.logits.view(true);
  p.completion_ids = s.ids.view(true);
  p.advantages = s.adv.view(true);
  p.completion_mask = s.mask.view(true);
  p.ref_logp = s.ref.view(true);
  PolicyLossOutputs o;
  o.loss = s.loss.view(true);
  expect_gpu_workspace_and_bad_id_errors([&](Workspace ws) { policy_loss_forward(p, s.opt, o, ws, nullptr); },
                                         policy_loss_workspace_bytes(p, s.opt));
}

// B * (L+1) * V > 2^31: element offsets past the int32 range. GPU only (4.9 GB of bf16 logits); rows near the
// end are compared with the CPU backend one token at a time.
TEST(PolicyLossLarge, BeyondInt32Offsets) {
  LOGITLESS_SKIP_WITHOUT_GPU();
  const int64_t B = 2, L = 8192, V = 150000;
  ASSERT_GT(B * (L + 1) * V, int64_t{1} << 31);
  TestTensor logits(DType::kBFloat16, {B, L + 1, V}), ids(DType::kInt64, {B, L}), adv(DType::kFloat32, {B}),
      loss(DType::kFloat32, {}), logp(DType::kFloat32, {B, L});
  logits.fill_normal(77, 2.f);
  std::mt19937_64 rng(77);
  std::uniform_int_distribution<int64_t> idd(0, V - 1);
  for (int64_t i = 0; i < B * L; ++i) ids.set_index(i, idd(rng));
  adv.set(0, 0.5f), adv.set(1, -1.25f);
  PolicyLossOptions o;
  o.beta = 0;
  o.loss_type = PolicyLossType::kBnpo;
  for (TestTensor* t : {&logits, &ids, &adv, &loss, &logp}) t->to_device();
  PolicyLossInputs in;
  in.logits = logits.view(true);
  in.completion_ids = ids.view(true);
  in.advantages = adv.view(true);
  PolicyLossOutputs out;
  out.loss = loss.view(true);
  out.logp = logp.view(true);
  DeviceScratch ws(policy_loss_workspace_bytes(in, o));
  policy_loss_forward_backward(in, o, out, in.logits, {}, ws.ws(), nullptr);  // in place
  device_synchronize();
  logp.to_host();
  // Without old_logp the gradient of token t is (-A / count) ([j == id] - p_j): check the last tokens' rows.
  const int64_t es = 2;
  std::vector<uint16_t> row(V);
  for (int64_t t : {int64_t{0}, B * L - 2, B * L - 1}) {
    const int64_t b = t / L, l = t % L;
    double m = -INFINITY, s = 0;
    std::vector<double> x(V);
    for (int64_t j = 0; j < V; ++j) m = std::max(m, x[j] = logits.get((b * (L + 1) + l) * V + j));
    for (double v : x) s += std::exp(v - m);
    const double lse = m + std::log(s);
    const int64_t id = ids.get_index(t);
    EXPECT_NEAR(logp.get(t), x[id] - lse, 1e-4) << t;
    test_copy_device_to_host(row.data(), static_cast<const char*>(logits.view(true).data) + (b * (L + 1) + l) * V * es,
                             V * es);
    const double c = -adv.get(b) / static_cast<double>(B * L);
    std::vector<double> got(V), want(V);
    for (int64_t j = 0; j < V; ++j) {
      got[j] = bf16_bits_to_float(row[j]);
      want[j] = c * ((j == id) - std::exp(x[j] - lse));
    }
    EXPECT_TRUE(all_close(got, want, tolerance(DType::kBFloat16, Quantity::kGrad), std::abs(c), "row"));
  }
  // The unused last position of the last sequence is zero.
  const char* last = static_cast<const char*>(logits.view(true).data) + ((B - 1) * (L + 1) + L) * V * es;
  test_copy_device_to_host(row.data(), last, V * es);
  for (int64_t j = 0; j < V; ++j) ASSERT_EQ(row[j], 0) << j;
}

// ---- the tile planner (a pure host function) ------------------------------------------------------------------
pl::RowsPlanInputs hopper(int64_t V, int elem_bytes, bool fused) {
  pl::RowsPlanInputs in;
  in.vocab = V;
  in.elem_bytes = elem_bytes;
  in.fused = fused;
  in.cluster_capable = true;
  in.ctas_per_sm = 2;  // 512 threads at 64 registers
  return in;
}

TEST(PolicyLossPlan, ClusterOnlyForLongFusedRowsWithinTheL2Budget) {
  const pl::RowsPlan a = pl::plan_rows(hopper(150000, 2, true));
  EXPECT_EQ(a.algo, PolicyLossAlgo::kCluster);
  EXPECT_EQ(a.threads, 512);
  // 2 resident CTAs x 300 KB / C within 160 KB per SM: C = 4.
  EXPECT_EQ(a.cluster, 4);
  EXPECT_GE(a.slice * a.cluster, 150000);
  EXPECT_EQ(a.slice % 8, 0);  // whole 16-byte chunks
  EXPECT_LE(2 * a.slice * 2, pl::kSliceBudgetPerSm);
  const pl::RowsPlan f32 = pl::plan_rows(hopper(256000, 4, true));
  EXPECT_EQ(f32.cluster, 8);  // capped at the portable size
  EXPECT_EQ(f32.slice % 4, 0);

  pl::RowsPlanInputs in = hopper(150000, 2, false);  // one read: nothing to keep in L2
  EXPECT_EQ(pl::plan_rows(in).algo, PolicyLossAlgo::kStreaming);
  EXPECT_EQ(pl::plan_rows(in).cluster, 1);
  EXPECT_EQ(pl::plan_rows(in).threads, 256);
  EXPECT_EQ(pl::plan_rows(in).slice, 150000);
  in = hopper(16000, 2, true);  // 32 KB rows: the streaming kernel's second read hits L2 already
  EXPECT_EQ(pl::plan_rows(in).algo, PolicyLossAlgo::kStreaming);
  in = hopper(150000, 2, true);
  in.cluster_capable = false;  // an A100, or a build without sm_90
  EXPECT_EQ(pl::plan_rows(in).algo, PolicyLossAlgo::kStreaming);
  in.requested = PolicyLossAlgo::kCluster;  // asked for explicitly: refused (the launcher raises)
  EXPECT_EQ(pl::plan_rows(in).algo, PolicyLossAlgo::kAuto);
}

TEST(PolicyLossPlan, ExplicitTilesAreKept) {
  pl::RowsPlanInputs in = hopper(1000, 2, false);
  in.requested = PolicyLossAlgo::kCluster;
  in.cluster_size = 8;
  in.threads = 128;
  const pl::RowsPlan p = pl::plan_rows(in);
  EXPECT_EQ(p.algo, PolicyLossAlgo::kCluster);
  EXPECT_EQ(p.cluster, 8);
  EXPECT_EQ(p.threads, 128);
  EXPECT_EQ(p.slice, 128);  // ceil(1000 / 8) = 125, rounded up to whole chunks of 8
  in.requested = PolicyLossAlgo::kStreaming;
  EXPECT_EQ(pl::plan_rows(in).cluster, 1);
  EXPECT_EQ(pl::plan_rows(in).threads, 128);
}

// H100: 228 KB of shared memory per SM, 227 KB per CTA after opting in (less the kernel's static 2 KB).
pl::RowsPlanInputs hopper_resident(int64_t V, int elem_bytes, bool fused) {
  pl::RowsPlanInputs in = hopper(V, elem_bytes, fused);
  in.resident_capable = true;
  in.smem_per_sm = 233472;
  in.smem_per_block = 232448 - 2048;
  return in;
}

TEST(PolicyLossPlan, RowResidentForLongFusedRows) {
  // V = 150000 bf16 (300 KB rows): the smallest cluster whose one-stage slices let two CTAs share an SM is 3.
  const pl::RowsPlan a = pl::plan_rows(hopper_resident(150000, 2, true));
  EXPECT_EQ(a.algo, PolicyLossAlgo::kRowResident);
  EXPECT_EQ(a.cluster, 3);
  EXPECT_EQ(a.slice, 50000);
  EXPECT_EQ(a.stages, 1);
  EXPECT_EQ(a.stage_bytes, 100096);  // 100000 bytes + 16 of lead-in, rounded up to 128
  EXPECT_EQ(a.smem_bytes, a.stage_bytes);
  EXPECT_EQ(a.threads, pl::kResidentMaxThreads);
  EXPECT_LE(2 * (a.smem_bytes + pl::kResidentReserve), 233472);
  // As the cross-entropy plan: 3 CTAs at 128256, 5 at 256000 (bf16); float32 rows need twice the CTAs.
  EXPECT_EQ(pl::plan_rows(hopper_resident(128256, 2, true)).cluster, 3);
  EXPECT_EQ(pl::plan_rows(hopper_resident(256000, 2, true)).cluster, 5);
  const pl::RowsPlan f32 = pl::plan_rows(hopper_resident(150000, 4, true));
  EXPECT_EQ(f32.cluster, 6);
  EXPECT_EQ(f32.slice % 4, 0);
  EXPECT_GE(f32.slice * f32.cluster, 150000);
  // A row that fits one CTA twice per SM: no cluster (V = 40000 bf16, 80 KB).
  const pl::RowsPlan one = pl::plan_rows(hopper_resident(40000, 2, true));
  EXPECT_EQ(one.algo, PolicyLossAlgo::kRowResident);
  EXPECT_EQ(one.cluster, 1);
  EXPECT_EQ(one.slice, 40000);
  EXPECT_EQ(one.stages, 1);
  for (int64_t V : {int64_t{32768}, int64_t{50000}, int64_t{150000}, int64_t{256000}, int64_t{800000}}) {
    SCOPED_TRACE(V);
    const pl::RowsPlan p = pl::plan_rows(hopper_resident(V, 2, true));
    ASSERT_EQ(p.algo, PolicyLossAlgo::kRowResident);
    EXPECT_GE(p.slice * p.cluster, V);
    EXPECT_EQ(p.slice % 8, 0);
    EXPECT_GE(p.stage_bytes, p.slice * 2 + 16);
    EXPECT_EQ(p.stage_bytes % 128, 0);
    EXPECT_LE(p.smem_bytes, 232448 - 2048);
    EXPECT_LE(2 * (p.smem_bytes + pl::kResidentReserve), 233472);
    if (p.cluster > 1) {  // the next smaller cluster would not let two CTAs share an SM
      pl::RowsPlanInputs in = hopper_resident(V, 2, true);
      in.cluster_size = p.cluster - 1;
      in.requested = PolicyLossAlgo::kRowResident;
      const pl::RowsPlan q = pl::plan_rows(in);
      EXPECT_TRUE(q.algo != PolicyLossAlgo::kRowResident || 2 * (q.stage_bytes + pl::kResidentReserve) > 233472);
    }
  }
}

TEST(PolicyLossPlan, RowResidentOnlyWhereItPays) {
  // Passes that read each row once (no gradient, or the backward from a saved lse) stream, also when asked for.
  pl::RowsPlanInputs in = hopper_resident(150000, 2, false);
  EXPECT_EQ(pl::plan_rows(in).algo, PolicyLossAlgo::kStreaming);
  in.requested = PolicyLossAlgo::kRowResident;
  EXPECT_EQ(pl::plan_rows(in).algo, PolicyLossAlgo::kStreaming);
  EXPECT_EQ(pl::plan_rows(in).slice, 150000);
  // Short rows: auto keeps the streaming kernel (its second read hits L2).
  EXPECT_EQ(pl::plan_rows(hopper_resident(16000, 2, true)).algo, PolicyLossAlgo::kStreaming);
  // No resident kernel here (not Hopper, or a pass the caller does not offer it for): the cluster plan as before.
  in = hopper_resident(150000, 2, true);
  in.resident_capable = false;
  EXPECT_EQ(pl::plan_rows(in).algo, PolicyLossAlgo::kCluster);
  EXPECT_EQ(pl::plan_rows(in).cluster, 4);
  in.requested = PolicyLossAlgo::kRowResident;  // asked for explicitly: refused (the launcher raises)
  EXPECT_EQ(pl::plan_rows(in).algo, PolicyLossAlgo::kAuto);
  // Rows longer than 16 CTAs' shared memory (8 MB bf16): auto falls back to the cluster kernel, a request fails.
  in = hopper_resident(4000000, 2, true);
  EXPECT_EQ(pl::plan_rows(in).algo, PolicyLossAlgo::kCluster);
  in.requested = PolicyLossAlgo::kRowResident;
  EXPECT_EQ(pl::plan_rows(in).algo, PolicyLossAlgo::kAuto);
  // An explicit stream or cluster request is kept.
  in = hopper_resident(150000, 2, true);
  in.requested = PolicyLossAlgo::kCluster;
  EXPECT_EQ(pl::plan_rows(in).algo, PolicyLossAlgo::kCluster);
  in.requested = PolicyLossAlgo::kStreaming;
  EXPECT_EQ(pl::plan_rows(in).algo, PolicyLossAlgo::kStreaming);
}

TEST(PolicyLossPlan, RowResidentExplicitTiles) {
  pl::RowsPlanInputs in = hopper_resident(1000, 2, true);
  in.requested = PolicyLossAlgo::kRowResident;
  pl::RowsPlan p = pl::plan_rows(in);  // short rows asked for: one CTA, several rows in flight
  EXPECT_EQ(p.algo, PolicyLossAlgo::kRowResident);
  EXPECT_EQ(p.cluster, 1);
  EXPECT_EQ(p.slice, 1000);
  EXPECT_EQ(p.stage_bytes, 2048);
  EXPECT_EQ(p.stages, pl::kResidentMaxStages);
  EXPECT_EQ(p.smem_bytes, 2048 * pl::kResidentMaxStages);
  in.cluster_size = 8;
  in.threads = 512;  // above the kernel's bound: capped
  p = pl::plan_rows(in);
  EXPECT_EQ(p.cluster, 8);
  EXPECT_EQ(p.slice, 128);
  EXPECT_EQ(p.threads, pl::kResidentMaxThreads);
  in.threads = 128;
  EXPECT_EQ(pl::plan_rows(in).threads, 128);
  // An explicit cluster whose slice does not fit a CTA: refused.
  in = hopper_resident(150000, 2, true);
  in.requested = PolicyLossAlgo::kRowResident;
  in.cluster_size = 1;
  EXPECT_EQ(pl::plan_rows(in).algo, PolicyLossAlgo::kAuto);
  in.cluster_size = 2;  // 150 KB: fits one CTA per SM
  p = pl::plan_rows(in);
  EXPECT_EQ(p.algo, PolicyLossAlgo::kRowResident);
  EXPECT_EQ(p.stages, 1);
  EXPECT_EQ(p.stage_bytes, 150016);
}

#if defined(LOGITLESS_WITH_CUDA)
// The steps a fused linear head would run chunk by chunk (cuda/steps.h) give what one call gives, at both levels.
TEST(PolicyLossSteps, ChunkedCallsMatchOneCall) {
  LOGITLESS_SKIP_WITHOUT_GPU();
  for (auto level : {ImportanceSamplingLevel::kToken, ImportanceSamplingLevel::kSequence}) {
    SCOPED_TRACE(level_name(level));
    const PlCase c{4, 24, 5003, DType::kBFloat16, PlLayout::kAligned, Preset::kFull, PolicyLossType::kGrpo, level};
    PlInputs in(c, 31);
    const PlOut want = run_backend(in, PlEntry::kForwardBackward, true, 1.f, /*want_entropy=*/false);

    const int64_t B = c.B, L = c.L, V = c.V, N = B * L;
    TestTensor loss(DType::kFloat32, {}), ptl(DType::kFloat32, {B, L}), logp(DType::kFloat32, {B, L}),
        grad(c.dtype, {B, L, V});
    for (TestTensor* t : {&loss, &ptl, &logp, &grad}) {
      t->fill_storage_nan();
      t->to_device();
    }
    PolicyLossOutputs out;
    out.loss = loss.view(true);
    out.per_token_loss = ptl.view(true);
    out.logp = logp.view(true);
    const TensorView g = grad.view(true);
    const PolicyLossInputs pin = in.view(true);
    const pl::Problem pr = pl::make_policy_problem(pl::Mode::kForwardBackward, pin, in.opt, out, &g);
    DeviceScratch ws(policy_loss_workspace_bytes(pin, in.opt));
    pl::PolicySteps steps(pr, ws.ws(), nullptr);
    // Chunks of uneven sizes that cut sequences: tokens [0, 7), [7, 50), [50, N).
    std::vector<pl::Chunk> chunks;
    const int64_t es = dtype_size(c.dtype), ls = V + 3;  // the aligned layout's row stride
    for (auto [t0, t1] : {std::pair<int64_t, int64_t>{0, 7}, {7, 50}, {50, N}}) {
      pl::Chunk k;
      k.first_token = t0;
      k.n_tokens = t1 - t0;
      k.logits = static_cast<const char*>(pin.logits.data) + t0 * ls * es;
      k.logits_rows.strides[0] = ls;
      k.grad = static_cast<char*>(g.data) + t0 * V * es;
      k.grad_rows.strides[0] = V;
      chunks.push_back(k);
    }
    steps.begin();
    for (const auto& k : chunks) steps.rows(k);
    steps.sequence();
    if (level == ImportanceSamplingLevel::kSequence)
      for (const auto& k : chunks) steps.rows_backward(k);
    steps.finish();
    device_synchronize();
    for (TestTensor* t : {&loss, &ptl, &logp, &grad}) t->to_host();
    const Tol exact{0, 0};
    EXPECT_TRUE(all_close(std::vector<double>{loss.get(0)}, std::vector<double>{want.loss}, exact, 1, "loss"));
    std::vector<double> p1(N), p2(N);
    for (int64_t t = 0; t < N; ++t) p1[t] = ptl.get(t), p2[t] = logp.get(t);
    EXPECT_TRUE(all_close(p1, want.per_token_loss, exact, 1, "per_token_loss"));
    EXPECT_TRUE(all_close(p2, want.logp, exact, 1, "logp"));
    EXPECT_TRUE(all_close(grad.gather_float(), want.grad, exact, 1, "grad"));
  }
}
#endif

}  // namespace
}  // namespace logitless::test
