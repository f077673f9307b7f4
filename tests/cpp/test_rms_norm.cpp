// RMSNorm: the CPU backend against a naive float64 reference for every casting mode, the CUDA kernels
// against the CPU backend (each kernel path), in-place variants, dW determinism across runs, row offsets
// past 2^31, the launch plan, and bad input.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <random>
#include <sstream>

#include "rms_norm/cuda/plan.h"
#include "test_util.h"

namespace logitless::test {
namespace {

// kPadded: row stride H + 3 and a one-element storage offset, so rows start misaligned (generic kernels).
// kStrided: a [B, T, H] view of [B, T + 1, H] storage (the causal-LM shift): two strided row dimensions.
enum class Layout { kContiguous, kPadded, kStrided };

const char* layout_name(Layout l) {
  switch (l) {
    case Layout::kContiguous:
      return "contig";
    case Layout::kPadded:
      return "padded";
    case Layout::kStrided:
      return "strided";
  }
  return "?";
}
const char* casting_name(RMSNormCasting c) {
  switch (c) {
    case RMSNormCasting::kLlama:
      return "llama";
    case RMSNormCasting::kGemma:
      return "gemma";
    case RMSNormCasting::kNone:
      return "none";
  }
  return "?";
}

struct RmsCase {
  int64_t n, h;
  DType dtype;
  bool weight_f32;
  RMSNormCasting casting;
  double offset;
  bool residual;
  Layout layout;
};

std::string case_name(const RmsCase& c) {
  std::ostringstream os;
  os << "N" << c.n << "_H" << c.h << "_" << dtype_tag(c.dtype) << (c.weight_f32 ? "_wf32" : "_wsame") << "_"
     << casting_name(c.casting) << "_off" << static_cast<int>(c.offset) << (c.residual ? "_res" : "_nores") << "_"
     << layout_name(c.layout);
  return os.str();
}
void PrintTo(const RmsCase& c, std::ostream* os) { *os << case_name(c); }

// A [*, H] tensor in the case's layout; `lead` receives its leading shape.
TestTensor rows_tensor(const RmsCase& c, DType dt, std::vector<int64_t>* lead) {
  const int64_t N = c.n, H = c.h;
  switch (c.layout) {
    case Layout::kContiguous:
      *lead = {N};
      return TestTensor(dt, {N, H});
    case Layout::kPadded:
      *lead = {N};
      return TestTensor(dt, {N, H}, {H + 3, 1}, /*offset=*/1);
    case Layout::kStrided: {
      const int64_t B = N % 2 == 0 && N > 0 ? 2 : 1, T = N / B;
      *lead = {B, T};
      return TestTensor(dt, {B, T, H}, {(T + 1) * H, H, 1});
    }
  }
  return {};
}

std::vector<int64_t> with_h(std::vector<int64_t> lead, int64_t H) {
  lead.push_back(H);
  return lead;
}

// A copy of `t` with the same sizes, strides and storage offset (for in-place calls).
TestTensor same_layout_copy(const TestTensor& t) { return t.clone(); }

struct Inputs {
  RmsCase c;
  RMSNormOptions opt;
  std::vector<int64_t> lead;
  TestTensor x, residual, weight, dy, dres;

  Inputs(const RmsCase& cs, uint64_t seed) : c(cs) {
    opt.casting = c.casting;
    opt.offset = c.offset;
    opt.eps = 1e-5;
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> normal(0.f, 1.f);
    const int64_t N = c.n, H = c.h;
    std::vector<int64_t> l2;
    // Padding and gaps poisoned, viewed elements ~ N(0, 1) (a parallel, counter-based generator).
    auto fill = [&](TestTensor& t, uint64_t stream) {
      t = rows_tensor(c, c.dtype, &l2);
      t.fill_storage_nan();
      t.fill_normal(seed * 8 + stream, 1.f);
    };
    fill(x, 1);
    lead = l2;
    fill(dy, 2);
    // Rows of different scales: the normalization must take each row's own.
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < N; ++i) {
      const float scale = 0.25f + static_cast<float>(i % 5);
      for (int64_t j = 0; j < H; ++j) x.set(i * H + j, scale * x.get(i * H + j));
    }
    if (c.residual) {
      fill(residual, 3);
      fill(dres, 4);
    }
    // Llama keeps weights near 1; zero-centered weights (offset 1, Gemma) near 0.
    weight = TestTensor(c.weight_f32 ? DType::kFloat32 : c.dtype, {H});
    for (int64_t j = 0; j < H; ++j) weight.set(j, (c.offset != 0 ? 0.f : 1.f) + 0.2f * normal(rng));
  }
  TensorView res_view(bool dev) const { return c.residual ? residual.view(dev) : TensorView{}; }
  TensorView dres_view(bool dev) const { return c.residual ? dres.view(dev) : TensorView{}; }
};

// ---- float64 reference: the formulas of include/logitless/rms_norm.h, term by term -------------------------
double round_to(DType dt, double v) {
  if (dt == DType::kFloat32) return static_cast<float>(v);
  std::vector<uint16_t> tmp(1);
  store_float(tmp.data(), dt, 0, static_cast<float>(v));
  return load_float(tmp.data(), dt, 0);
}

struct RefOut {
  std::vector<double> y, s, rstd, dx, dw;
};

RefOut reference(const Inputs& in) {
  const int64_t N = in.c.n, H = in.c.h;
  const DType dt = in.c.dtype;
  const auto mode = in.c.casting;
  const bool none = mode == RMSNormCasting::kNone;
  RefOut o;
  o.y.assign(N * H, 0);
  o.s.assign(N * H, 0);
  o.rstd.assign(N, 0);
  o.dx.assign(N * H, 0);
  o.dw.assign(H, 0);
  std::vector<double> g(H);
  for (int64_t j = 0; j < H; ++j) {
    g[j] = static_cast<double>(in.weight.get(j)) + in.c.offset;
    if (none) g[j] = round_to(dt, g[j]);
  }
  for (int64_t i = 0; i < N; ++i) {
    double ms = 0;
    for (int64_t j = 0; j < H; ++j) {
      double s = in.x.get(i * H + j);
      if (in.c.residual) s = round_to(dt, s + in.residual.get(i * H + j));
      o.s[i * H + j] = s;
      ms += s * s;
    }
    ms /= static_cast<double>(H);
    double r = 1.0 / std::sqrt(ms + in.opt.eps);
    if (none) r = round_to(dt, r);
    o.rstd[i] = r;
    double dot = 0;
    for (int64_t j = 0; j < H; ++j) {
      const double s = o.s[i * H + j];
      const double n = mode == RMSNormCasting::kGemma ? s * r : round_to(dt, s * r);
      o.y[i * H + j] = round_to(dt, n * g[j]);
      const double d = in.dy.get(i * H + j);
      o.dw[j] += d * n;
      dot += d * g[j] * s;
    }
    for (int64_t j = 0; j < H; ++j) {
      const double s = o.s[i * H + j], a = in.dy.get(i * H + j) * g[j];
      double dx = r * a - s * r * r * r * dot / static_cast<double>(H);
      if (in.c.residual) dx += in.dres.get(i * H + j);
      o.dx[i * H + j] = dx;
    }
  }
  return o;
}

// ---- running a backend -------------------------------------------------------------------------------------
std::vector<double> values(const TestTensor& t) {
  const std::vector<float> f = t.gather_float();
  return std::vector<double>(f.begin(), f.end());
}

struct Forward {
  TestTensor y, s, rstd;  // s: residual_out (empty without a residual)
};

// The forward on the CPU (dev = false) or the GPU; outputs are poisoned first. In place: y overwrites a copy of
// x (no residual) or residual_out a copy of residual, each in the input's own layout.
Forward run_forward(Inputs& in, bool dev, bool in_place, const RMSNormOptions& opt) {
  const int64_t H = in.c.h;
  Forward f;
  f.rstd = TestTensor(DType::kFloat32, in.lead);
  f.rstd.fill_storage_nan();
  std::optional<TestTensor> xin, resin;
  if (in_place && !in.c.residual) {
    xin.emplace(same_layout_copy(in.x));
  } else {
    f.y = TestTensor(in.c.dtype, with_h(in.lead, H));
    f.y.fill_storage_nan();
  }
  if (in.c.residual) {
    if (in_place) {
      resin.emplace(same_layout_copy(in.residual));
    } else {
      f.s = TestTensor(in.c.dtype, with_h(in.lead, H));
      f.s.fill_storage_nan();
    }
  }
  if (dev) {
    in.x.to_device();
    in.weight.to_device();
    if (in.c.residual) in.residual.to_device();
    f.rstd.to_device();
    if (xin)
      xin->to_device();
    else
      f.y.to_device();
    if (resin)
      resin->to_device();
    else if (in.c.residual)
      f.s.to_device();
  }
  const TensorView xv = xin ? xin->view(dev) : in.x.view(dev);
  const TensorView yv = xin ? xin->view(dev) : f.y.view(dev);
  const TensorView rv = resin ? resin->view(dev) : in.res_view(dev);
  const TensorView sv = resin ? resin->view(dev) : (in.c.residual ? f.s.view(dev) : TensorView{});
  rms_norm_forward(xv, rv, in.weight.view(dev), opt, yv, sv, f.rstd.view(dev), {}, nullptr);
  if (dev) {
    device_synchronize();
    f.rstd.to_host();
    if (xin)
      xin->to_host();
    else
      f.y.to_host();
    if (resin)
      resin->to_host();
    else if (in.c.residual)
      f.s.to_host();
  }
  if (xin) f.y = std::move(*xin);
  if (resin) f.s = std::move(*resin);
  return f;
}

struct Backward {
  TestTensor dx, dw;
};

// The backward from `xs` (what the forward normalized) and `rstd`; in place: grad_x overwrites a copy of
// grad_y in grad_y's layout.
Backward run_backward(Inputs& in, TestTensor& xs, TestTensor& rstd, bool dev, bool in_place,
                      const RMSNormOptions& opt) {
  const int64_t H = in.c.h;
  Backward b;
  std::optional<TestTensor> dyin;
  if (in_place) {
    dyin.emplace(same_layout_copy(in.dy));
  } else {
    b.dx = TestTensor(in.c.dtype, with_h(in.lead, H));
    b.dx.fill_storage_nan();
  }
  b.dw = TestTensor(in.weight.dtype(), {H});
  b.dw.fill_storage_nan();
  if (dev) {
    xs.to_device();
    rstd.to_device();
    in.weight.to_device();
    in.dy.to_device();
    if (in.c.residual) in.dres.to_device();
    if (dyin)
      dyin->to_device();
    else
      b.dx.to_device();
    b.dw.to_device();
  }
  const TensorView dyv = dyin ? dyin->view(dev) : in.dy.view(dev);
  const TensorView dxv = dyin ? dyin->view(dev) : b.dx.view(dev);
  const size_t ws_bytes = rms_norm_backward_workspace_bytes(xs.view(dev), in.weight.view(dev), opt);
  if (!dev) EXPECT_EQ(ws_bytes, 0u);
  DeviceScratch ws(dev ? ws_bytes : 0);
  rms_norm_backward(dyv, in.dres_view(dev), xs.view(dev), in.weight.view(dev), rstd.view(dev), opt, dxv, b.dw.view(dev),
                    ws.ws(), nullptr);
  if (dev) {
    device_synchronize();
    if (dyin)
      dyin->to_host();
    else
      b.dx.to_host();
    b.dw.to_host();
  }
  if (dyin) b.dx = std::move(*dyin);
  return b;
}

void expect_close(const std::vector<double>& got, const std::vector<double>& want, Tol tol, const std::string& what) {
  EXPECT_TRUE(all_close(got, want, tol, std::max(1.0, max_abs(want)), what));
}

Tol rstd_tol(const Inputs& in) {
  // kNone stores r rounded to x's dtype: a last-bit difference of float32 r may round it the other way.
  return in.c.casting == RMSNormCasting::kNone ? tolerance(in.c.dtype, Quantity::kNormOut)
                                               : tolerance(DType::kFloat32, Quantity::kNormRstd);
}

// grad_weight sums dy * n with n rounded to x's dtype (kLlama, kNone): a backend whose r differs from the
// reference's in the last bit may round an n the other way, a 1-ulp error of x's dtype in that term (with one
// row, of the whole sum). So the looser of the two dtypes' tolerances.
Tol dw_tol(const Inputs& in) {
  const Tol a = tolerance(in.weight.dtype(), Quantity::kNormWeightGrad);
  const Tol b = tolerance(in.c.dtype, Quantity::kNormWeightGrad);
  return a.rtol >= b.rtol ? a : b;
}

// ---- the case lists ----------------------------------------------------------------------------------------
void add_variants(std::vector<RmsCase>& cases, int64_t N, int64_t H, DType dt, bool few) {
  using C = RMSNormCasting;
  cases.push_back({N, H, dt, false, C::kLlama, 0.0, false, Layout::kContiguous});
  cases.push_back({N, H, dt, dt != DType::kFloat32, C::kGemma, 1.0, true, Layout::kContiguous});
  if (few) return;
  cases.push_back({N, H, dt, false, C::kNone, 0.0, true, Layout::kStrided});
  cases.push_back({N, H, dt, dt != DType::kFloat32, C::kLlama, 0.0, true, Layout::kPadded});
  cases.push_back({N, H, dt, false, C::kGemma, 1.0, false, Layout::kStrided});
  cases.push_back({N, H, dt, dt != DType::kFloat32, C::kNone, 0.0, false, Layout::kPadded});
  cases.push_back({N, H, dt, false, C::kLlama, 1.0, false, Layout::kStrided});  // llama casting, zero-centered
}

std::vector<RmsCase> make_cases(bool gpu_suite) {
  std::vector<RmsCase> cases;
  const std::vector<DType> dts = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};
  // Shapes for both suites: N = 0 and 1, odd H, H below a warp, and a hidden size of a real model.
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{0, 64},  {1, 1},     {1, 4096},  {7, 3},
                                                           {5, 100}, {33, 1000}, {64, 4096}, {9, 4097}};
  for (const auto& [N, H] : shapes)
    for (DType dt : dts) add_variants(cases, N, H, dt, false);
  if (gpu_suite) {
    // Every register-path width (power-of-two and 96/160-thread rows), the register limits (16384 for the
    // backward, 32768 for the forward), the generic path's shared-memory and workspace dW sums (65536, 100003),
    // and enough rows for many persistent-CTA iterations.
    // About 4M elements each (the CPU expectation and the host-side checks dominate the suite's time), with
    // enough rows for at least two persistent-CTA iterations on an H100; one 16M-element shape for many.
    const std::vector<std::pair<int64_t, int64_t>> big = {{4096, 896},  {3000, 1536}, {2048, 2048}, {1024, 3072},
                                                          {1056, 4096}, {777, 5120},  {528, 8192},  {300, 16384},
                                                          {64, 32768},  {16, 65536},  {5, 100003}};
    for (const auto& [N, H] : big)
      for (DType dt : dts) add_variants(cases, N, H, dt, dt != DType::kBFloat16);
    add_variants(cases, 16384, 1024, DType::kBFloat16, true);
  }
  return cases;
}

uint64_t seed_of(const RmsCase& c) { return std::hash<std::string>{}(case_name(c)); }

class RMSNormCpu : public ::testing::TestWithParam<RmsCase> {};
class RMSNormCuda : public ::testing::TestWithParam<RmsCase> {};

TEST_P(RMSNormCpu, MatchesFloat64Reference) {
  Inputs in(GetParam(), seed_of(GetParam()));
  const RefOut ref = reference(in);
  const DType dt = in.c.dtype;
  for (bool in_place : {false, true}) {
    SCOPED_TRACE(in_place ? "in place" : "out of place");
    Forward f = run_forward(in, false, in_place, in.opt);
    expect_close(values(f.y), ref.y, tolerance(dt, Quantity::kNormOut), "cpu y");
    if (in.c.residual) expect_close(values(f.s), ref.s, tolerance(dt, Quantity::kNormOut), "cpu residual_out");
    expect_close(values(f.rstd), ref.rstd, rstd_tol(in), "cpu rstd");
    TestTensor& xs = in.c.residual ? f.s : in.x;
    const Backward b = run_backward(in, xs, f.rstd, false, in_place, in.opt);
    expect_close(values(b.dx), ref.dx, tolerance(dt, Quantity::kNormOut), "cpu grad_x");
    expect_close(values(b.dw), ref.dw, dw_tol(in), "cpu grad_weight");
  }
}

// The options of each CUDA kernel that can run this case: auto, generic, and the register kernel at its
// non-default width (8 vectors in the backward, 4 in the forward) when the rows allow it.
std::vector<std::pair<std::string, RMSNormOptions>> cuda_variants(const Inputs& in, bool backward) {
  std::vector<std::pair<std::string, RMSNormOptions>> v;
  v.push_back({"auto", in.opt});
  RMSNormOptions g = in.opt;
  g.algo = RMSNormAlgo::kGeneric;
  v.push_back({"generic", g});
  rms::PlanInputs pi;
  pi.hidden = in.c.h;
  pi.elem_bytes = static_cast<int>(dtype_size(in.c.dtype));
  pi.backward = backward;
  pi.vector_ok = in.c.layout != Layout::kPadded;
  pi.requested = RMSNormAlgo::kRegisters;
  pi.vpt = backward ? 8 : 4;
  if (rms::plan_rms_norm(pi).algo == RMSNormAlgo::kRegisters) {
    RMSNormOptions r = in.opt;
    r.algo = RMSNormAlgo::kRegisters;
    r.vectors_per_thread = pi.vpt;
    v.push_back({backward ? "registers8" : "registers4", r});
  }
  return v;
}

TEST_P(RMSNormCuda, MatchesCpuBackend) {
  LOGITLESS_SKIP_WITHOUT_GPU();
  Inputs in(GetParam(), seed_of(GetParam()));
  const DType dt = in.c.dtype;
  Forward cpu = run_forward(in, false, false, in.opt);
  const auto y_cpu = values(cpu.y), r_cpu = values(cpu.rstd);
  const auto s_cpu = in.c.residual ? values(cpu.s) : std::vector<double>{};
  // The backward of both backends starts from the CPU forward's s and rstd, so that only the backward differs.
  TestTensor& xs = in.c.residual ? cpu.s : in.x;
  const Backward bcpu = run_backward(in, xs, cpu.rstd, false, false, in.opt);
  const auto dx_cpu = values(bcpu.dx), dw_cpu = values(bcpu.dw);
  for (const auto& [name, opt] : cuda_variants(in, false)) {
    for (bool in_place : {false, true}) {
      SCOPED_TRACE(name + (in_place ? " forward in place" : " forward"));
      Forward f = run_forward(in, true, in_place, opt);
      expect_close(values(f.y), y_cpu, tolerance(dt, Quantity::kNormOut), "cuda y");
      if (in.c.residual) expect_close(values(f.s), s_cpu, tolerance(dt, Quantity::kNormOut), "cuda residual_out");
      expect_close(values(f.rstd), r_cpu, rstd_tol(in), "cuda rstd");
    }
  }
  for (const auto& [name, opt] : cuda_variants(in, true)) {
    for (bool in_place : {false, true}) {
      SCOPED_TRACE(name + (in_place ? " backward in place" : " backward"));
      const Backward b = run_backward(in, xs, cpu.rstd, true, in_place, opt);
      expect_close(values(b.dx), dx_cpu, tolerance(dt, Quantity::kNormOut), "cuda grad_x");
      expect_close(values(b.dw), dw_cpu, dw_tol(in), "cuda grad_weight");
    }
  }
}

std::string param_name(const ::testing::TestParamInfo<RmsCase>& info) { return case_name(info.param); }

INSTANTIATE_TEST_SUITE_P(Shapes, RMSNormCpu, ::testing::ValuesIn(make_cases(false)), param_name);
INSTANTIATE_TEST_SUITE_P(Shapes, RMSNormCuda, ::testing::ValuesIn(make_cases(true)), param_name);

// ---- every register kernel, through the plan hook ---------------------------------------------------------
// The public options reach two widths; the other instantiations (prefetching, 2 and 16 vectors) and the
// persistent forward grid are what the benchmark's variants and future defaults use, so each runs here
// against the CPU backend: one CTA per SM (many iterations of each CTA's loop) and as many as fit.
struct HookState {
  int64_t nvec = 0;
  rms::KernelVariant fwd{8, false}, bwd{4, true};
  int ctas_per_sm = 0;
};
HookState g_hook;

void variant_hook(rms::Plan& p, const rms::PlanInputs& in) {
  const bool backward = in.backward;
  if (p.algo != RMSNormAlgo::kRegisters) return;
  const rms::KernelVariant k = backward ? g_hook.bwd : g_hook.fwd;
  p.vpt = k.vpt;
  p.prefetch = k.prefetch;
  p.dw_in_smem = backward && k.smem_dw;
  const int64_t want = (g_hook.nvec + k.vpt - 1) / k.vpt;
  int tpr = 1;
  while (tpr < want && tpr < 32) tpr <<= 1;
  if (want > 32) tpr = static_cast<int>((want + 31) / 32 * 32);
  p.threads_per_row = tpr;
  p.rows_per_cta =
      std::max(1, std::min(256, rms::max_cta_threads(backward, k.vpt, k.prefetch, in.residual, k.smem_dw)) / tpr);
  if (tpr > 32) p.rows_per_cta = std::min(p.rows_per_cta, rms::kMaxNamedBarrierRows);
  p.ctas_per_sm = g_hook.ctas_per_sm;
}

TEST(RMSNormCudaVariants, EveryRegisterKernelMatchesCpuBackend) {
  LOGITLESS_SKIP_WITHOUT_GPU();
  using C = RMSNormCasting;
  const RmsCase cases[] = {
      {1056, 4096, DType::kBFloat16, false, C::kLlama, 0.0, false, Layout::kContiguous},
      {777, 2048, DType::kFloat16, true, C::kGemma, 1.0, true, Layout::kStrided},
      {300, 1024, DType::kFloat32, false, C::kNone, 0.0, true, Layout::kContiguous},
      {2000, 1024, DType::kBFloat16, true, C::kGemma, 1.0, true, Layout::kContiguous},
      {1000, 2048, DType::kFloat16, false, C::kLlama, 0.0, false, Layout::kStrided},
  };
  const size_t n = std::max(std::size(rms::kForwardVariants), std::size(rms::kBackwardVariants));
  for (const RmsCase& c : cases) {
    Inputs in(c, seed_of(c));
    Forward cpu = run_forward(in, false, false, in.opt);
    TestTensor& xs = c.residual ? cpu.s : in.x;
    const Backward bcpu = run_backward(in, xs, cpu.rstd, false, false, in.opt);
    const DType dt = c.dtype;
    g_hook.nvec = c.h / (16 / static_cast<int64_t>(dtype_size(dt)));
    for (size_t i = 0; i < n; ++i) {
      g_hook.fwd = rms::kForwardVariants[i % std::size(rms::kForwardVariants)];
      g_hook.bwd = rms::kBackwardVariants[i % std::size(rms::kBackwardVariants)];
      for (int ctas : {0, 1}) {
        g_hook.ctas_per_sm = ctas;
        SCOPED_TRACE(testing::Message() << case_name(c) << " forward vpt " << g_hook.fwd.vpt << " prefetch "
                                        << g_hook.fwd.prefetch << ", backward vpt " << g_hook.bwd.vpt << " prefetch "
                                        << g_hook.bwd.prefetch << " dW in shared memory " << g_hook.bwd.smem_dw
                                        << ", ctas_per_sm " << ctas);
        rms::debug::plan_hook.set(variant_hook);
        Forward f = run_forward(in, true, false, in.opt);
        const Backward b = run_backward(in, xs, cpu.rstd, true, true, in.opt);
        const rms::debug::LaunchRecord lf = rms::debug::last_forward.get(), lb = rms::debug::last_backward.get();
        rms::debug::plan_hook.set(nullptr);
        EXPECT_EQ(lf.plan.vpt, g_hook.fwd.vpt);
        EXPECT_EQ(lb.plan.prefetch, g_hook.bwd.prefetch);
        EXPECT_EQ(lb.plan.dw_in_smem, g_hook.bwd.smem_dw);
        expect_close(values(f.y), values(cpu.y), tolerance(dt, Quantity::kNormOut), "cuda y");
        if (c.residual) expect_close(values(f.s), values(cpu.s), tolerance(dt, Quantity::kNormOut), "cuda s");
        expect_close(values(f.rstd), values(cpu.rstd), rstd_tol(in), "cuda rstd");
        expect_close(values(b.dx), values(bcpu.dx), tolerance(dt, Quantity::kNormOut), "cuda grad_x");
        expect_close(values(b.dw), values(bcpu.dw), dw_tol(in), "cuda grad_weight");
      }
    }
  }
}

// ---- the reference itself: its gradients against central differences ---------------------------------------
// With fp32 tensors and Gemma's casting nothing is rounded but the float32 storage, so the double reference is
// differentiable: L = sum(dy * y) + sum(dres * residual_out), and dL/dx, dL/dweight are what it returns.
TEST(RMSNormReference, GradientsMatchFiniteDifferences) {
  for (bool res : {false, true}) {
    RmsCase c{3, 7, DType::kFloat32, false, RMSNormCasting::kGemma, 1.0, res, Layout::kContiguous};
    Inputs in(c, 123);
    const RefOut r = reference(in);
    auto loss = [&](const RefOut& o) {
      double l = 0;
      for (int64_t k = 0; k < c.n * c.h; ++k) {
        l += in.dy.get(k) * o.y[k];
        if (res) l += in.dres.get(k) * o.s[k];
      }
      return l;
    };
    // The reference rounds y to float32: a step of 1e-3 keeps that noise (1e-7 of a loss near 1) well under
    // the tolerance, and the derivative divides by the step the float32 inputs actually took.
    const double h = 1e-3;
    auto central = [&](TestTensor& t, int64_t k) {
      const float v0 = t.get(k);
      t.set(k, v0 + static_cast<float>(h));
      const double vp = t.get(k), fp = loss(reference(in));
      t.set(k, v0 - static_cast<float>(h));
      const double vm = t.get(k), fm = loss(reference(in));
      t.set(k, v0);
      return (fp - fm) / (vp - vm);
    };
    for (int64_t k = 0; k < c.n * c.h; ++k)
      EXPECT_NEAR(r.dx[k], central(in.x, k), 2e-3) << "dx element " << k << (res ? " (residual)" : "");
    for (int64_t j = 0; j < c.h; ++j) EXPECT_NEAR(r.dw[j], central(in.weight, j), 2e-3) << "dw element " << j;
  }
}

// With fp32 tensors the three casting modes are the same function.
TEST(RMSNormCpuModes, AgreeInFloat32) {
  std::vector<std::vector<double>> ys;
  for (auto m : {RMSNormCasting::kLlama, RMSNormCasting::kGemma, RMSNormCasting::kNone}) {
    RmsCase c{6, 40, DType::kFloat32, false, m, 0.0, false, Layout::kContiguous};
    Inputs in(c, 77);  // the same seed: the same inputs
    ys.push_back(values(run_forward(in, false, false, in.opt).y));
  }
  EXPECT_TRUE(all_close(ys[1], ys[0], {1e-6, 1e-7}, 1.0, "gemma vs llama"));
  EXPECT_TRUE(all_close(ys[2], ys[0], {1e-6, 1e-7}, 1.0, "none vs llama"));
}

// ---- determinism -------------------------------------------------------------------------------------------
std::vector<uint32_t> bits(const TestTensor& t) {
  const std::vector<float> f = t.gather_float();
  std::vector<uint32_t> b(f.size());
  std::memcpy(b.data(), f.data(), f.size() * 4);
  return b;
}

TEST(RMSNormCudaDeterminism, GradWeightAndGradXAreBitwiseEqualAcrossRuns) {
  LOGITLESS_SKIP_WITHOUT_GPU();
  const RmsCase cases[] = {
      {16384, 4096, DType::kBFloat16, false, RMSNormCasting::kLlama, 0.0, false, Layout::kContiguous},
      {16384, 4096, DType::kBFloat16, true, RMSNormCasting::kGemma, 1.0, true, Layout::kContiguous},
      {3001, 2048, DType::kFloat32, false, RMSNormCasting::kLlama, 0.0, false, Layout::kStrided},
      {777, 4097, DType::kFloat16, false, RMSNormCasting::kNone, 0.0, false, Layout::kPadded},
      {9, 100003, DType::kBFloat16, false, RMSNormCasting::kLlama, 0.0, false, Layout::kContiguous},
  };
  for (const RmsCase& c : cases) {
    SCOPED_TRACE(case_name(c));
    Inputs in(c, seed_of(c));
    Forward f = run_forward(in, true, false, in.opt);
    TestTensor& xs = c.residual ? f.s : in.x;
    for (RMSNormAlgo algo : {RMSNormAlgo::kAuto, RMSNormAlgo::kGeneric}) {
      RMSNormOptions o = in.opt;
      o.algo = algo;
      const Backward a = run_backward(in, xs, f.rstd, true, false, o);
      const Backward b = run_backward(in, xs, f.rstd, true, false, o);  // a fresh, differently poisoned workspace
      EXPECT_TRUE(bits(a.dw) == bits(b.dw)) << "grad_weight differs between runs, algo " << static_cast<int>(algo);
      EXPECT_TRUE(bits(a.dx) == bits(b.dx)) << "grad_x differs between runs, algo " << static_cast<int>(algo);
    }
  }
}

// ---- element offsets past 2^31 -------------------------------------------------------------------------------
// Rows 716e6 elements apart (a multiple of 8: the register kernels still run): row 3 starts at element 2.1e9.
// GPU only (the view spans 4.3 GB); compared with the CPU backend on a compact copy of the rows.
TEST(RMSNormLarge, RowOffsetsBeyondInt32) {
  LOGITLESS_SKIP_WITHOUT_GPU();
  const int64_t N = 4, H = 4096, stride = 716000000;
  TestTensor x(DType::kBFloat16, {N, H}, {stride, 1});
  TestTensor xc(DType::kBFloat16, {N, H}), dy(DType::kBFloat16, {N, H}), weight(DType::kBFloat16, {H});
  std::mt19937_64 rng(9);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (int64_t k = 0; k < N * H; ++k) {
    const float v = normal(rng);
    x.set(k, v);
    xc.set(k, v);
    dy.set(k, normal(rng));
  }
  for (int64_t j = 0; j < H; ++j) weight.set(j, 1.f + 0.1f * normal(rng));
  RMSNormOptions o;
  // Device: the strided view.
  TestTensor y(DType::kBFloat16, {N, H}), rstd(DType::kFloat32, {N}), dx(DType::kBFloat16, {N, H}),
      dw(DType::kBFloat16, {H});
  for (TestTensor* t : {&x, &dy, &weight, &y, &rstd, &dx, &dw}) t->to_device();
  rms_norm_forward(x.view(true), {}, weight.view(true), o, y.view(true), {}, rstd.view(true), {}, nullptr);
  DeviceScratch ws(rms_norm_backward_workspace_bytes(x.view(true), weight.view(true), o));
  rms_norm_backward(dy.view(true), {}, x.view(true), weight.view(true), rstd.view(true), o, dx.view(true),
                    dw.view(true), ws.ws(), nullptr);
  device_synchronize();
  for (TestTensor* t : {&y, &rstd, &dx, &dw}) t->to_host();
  // Host: the compact copy.
  TestTensor yc(DType::kBFloat16, {N, H}), rc(DType::kFloat32, {N}), dxc(DType::kBFloat16, {N, H}),
      dwc(DType::kBFloat16, {H});
  rms_norm_forward(xc.host_view(), {}, weight.host_view(), o, yc.host_view(), {}, rc.host_view(), {}, nullptr);
  rms_norm_backward(dy.host_view(), {}, xc.host_view(), weight.host_view(), rc.host_view(), o, dxc.host_view(),
                    dwc.host_view(), {}, nullptr);
  const DType bf = DType::kBFloat16;
  expect_close(values(y), values(yc), tolerance(bf, Quantity::kNormOut), "y");
  expect_close(values(rstd), values(rc), tolerance(DType::kFloat32, Quantity::kNormRstd), "rstd");
  expect_close(values(dx), values(dxc), tolerance(bf, Quantity::kNormOut), "grad_x");
  expect_close(values(dw), values(dwc), tolerance(bf, Quantity::kNormWeightGrad), "grad_weight");
}

// ---- the launch plan ---------------------------------------------------------------------------------------
TEST(RMSNormPlan, Decisions) {
  using rms::Plan;
  using rms::PlanInputs;
  auto plan = [](int64_t H, int es, bool bwd, bool aligned, RMSNormAlgo algo = RMSNormAlgo::kAuto, int vpt = 0,
                 bool residual = false) {
    PlanInputs in;
    in.hidden = H;
    in.elem_bytes = es;
    in.backward = bwd;
    in.vector_ok = aligned;
    in.residual = residual;
    in.requested = algo;
    in.vpt = vpt;
    in.smem_per_block = 227 * 1024;
    return rms::plan_rms_norm(in);
  };
  // The defaults follow rms::default_variant (the benchmark's fastest variants by row size and residual).
  // bf16 H = 4096 (8 KB rows), no residual: the forward holds 8 vectors a thread, no prefetch, one row group a
  // 128-thread CTA (64 threads a row, 2 rows).
  Plan f = plan(4096, 2, false, true);
  EXPECT_EQ(f.algo, RMSNormAlgo::kRegisters);
  EXPECT_EQ(f.vpt, 8);
  EXPECT_FALSE(f.prefetch);
  EXPECT_EQ(f.threads_per_row, 64);
  EXPECT_EQ(f.rows_per_cta, 2);
  EXPECT_EQ(f.ctas_per_sm, 0);
  EXPECT_EQ(plan(2048, 2, false, true).rows_per_cta, 4);  // 4 KB rows: a warp a row
  // Rows that are not whole warps at 8 vectors keep 4 vectors with prefetch in a persistent grid.
  Plan f5 = plan(5120, 2, false, true);
  EXPECT_EQ(f5.vpt, 4);
  EXPECT_TRUE(f5.prefetch);
  EXPECT_EQ(f5.ctas_per_sm, rms::kPersistentCtasPerSm);
  // With the residual: 4 vectors, no prefetch, one row group a CTA of 256 threads.
  Plan fr = plan(4096, 2, false, true, RMSNormAlgo::kAuto, 0, true);
  EXPECT_EQ(fr.vpt, 4);
  EXPECT_FALSE(fr.prefetch);
  EXPECT_EQ(fr.rows_per_cta, 2);
  EXPECT_EQ(fr.ctas_per_sm, 0);
  // The backward at 2 vectors a thread, prefetching: 256 threads a row, one row a CTA (no shared dW row).
  Plan b = plan(4096, 2, true, true);
  EXPECT_EQ(b.vpt, 2);
  EXPECT_TRUE(b.prefetch);
  EXPECT_EQ(b.threads_per_row, 256);
  EXPECT_EQ(b.rows_per_cta, 1);
  EXPECT_EQ(b.smem_bytes, 0u);
  // 4 KB rows with the residual: 128 threads a row, 2 rows in a 256-thread CTA summing dW in shared memory.
  Plan br = plan(2048, 2, true, true, RMSNormAlgo::kAuto, 0, true);
  EXPECT_EQ(br.vpt, 2);
  EXPECT_EQ(br.rows_per_cta, 2);
  EXPECT_EQ(br.smem_bytes, 2048u * 4);
  // 16 KB rows: dW sums in shared memory; 8 vectors, 2 rows of 128 threads a CTA (one shared row of sums each),
  // and with the residual 4 vectors, prefetching.
  Plan b16 = plan(8192, 2, true, true);
  EXPECT_EQ(b16.vpt, 8);
  EXPECT_FALSE(b16.prefetch);
  EXPECT_TRUE(b16.dw_in_smem);
  EXPECT_EQ(b16.threads_per_row, 128);
  EXPECT_EQ(b16.rows_per_cta, 2);
  EXPECT_EQ(b16.smem_bytes, 2u * 8192 * 4);
  Plan b16r = plan(8192, 2, true, true, RMSNormAlgo::kAuto, 0, true);
  EXPECT_EQ(b16r.vpt, 4);
  EXPECT_TRUE(b16r.prefetch);
  EXPECT_TRUE(b16r.dw_in_smem);
  EXPECT_FALSE(plan(4096, 2, true, true).dw_in_smem);  // 8 KB rows keep their sums in registers
  Plan b2 = plan(12288, 2, true, true);
  EXPECT_EQ(b2.vpt, 8);
  EXPECT_EQ(b2.rows_per_cta, 1);
  EXPECT_EQ(plan(16384, 2, true, true).vpt, 8);
  // The longest rows: one row a CTA (the sums of two would not fit), up to 32768 bf16 / 16384 float32.
  Plan b64 = plan(32768, 2, true, true);
  EXPECT_EQ(b64.algo, RMSNormAlgo::kRegisters);
  EXPECT_EQ(b64.rows_per_cta, 1);
  EXPECT_EQ(b64.smem_bytes, 32768u * 4);
  // Forced widths: the backward at 4 still prefetches; a width never moves to another one.
  EXPECT_TRUE(plan(4096, 2, true, true, RMSNormAlgo::kAuto, 4).prefetch);
  Plan f4 = plan(16384, 2, true, true, RMSNormAlgo::kRegisters, 4);
  EXPECT_EQ(f4.vpt, 4);
  EXPECT_TRUE(f4.prefetch);
  EXPECT_TRUE(f4.dw_in_smem);
  EXPECT_EQ(plan(32768, 2, true, true, RMSNormAlgo::kRegisters, 4).algo, RMSNormAlgo::kAuto);
  EXPECT_EQ(plan(32768, 2, true, true, RMSNormAlgo::kAuto, 4).algo, RMSNormAlgo::kGeneric);
  // H = 5120 (160 threads at 4 vectors): whole warps, not a power of two.
  EXPECT_EQ(plan(5120, 2, false, true).threads_per_row, 160);
  // Short rows share a warp in power-of-two groups.
  Plan s = plan(64, 2, false, true);
  EXPECT_EQ(s.threads_per_row, 2);
  EXPECT_EQ(s.rows_per_cta, 64);
  // Misaligned rows, odd H, or rows beyond the register limits take the generic kernels.
  EXPECT_EQ(plan(4096, 2, false, false).algo, RMSNormAlgo::kGeneric);
  EXPECT_EQ(plan(4097, 2, false, true).algo, RMSNormAlgo::kGeneric);
  EXPECT_EQ(plan(32768, 2, false, true).algo, RMSNormAlgo::kRegisters);
  EXPECT_EQ(plan(32768, 2, false, true).vpt, 8);  // without the residual's registers 8 reach 32768
  EXPECT_EQ(plan(32768, 2, false, true, RMSNormAlgo::kAuto, 0, true).vpt, 16);
  EXPECT_EQ(plan(65536, 2, false, true).algo, RMSNormAlgo::kGeneric);
  EXPECT_EQ(plan(16384, 2, true, true).algo, RMSNormAlgo::kRegisters);
  EXPECT_EQ(plan(65536, 2, true, true).algo, RMSNormAlgo::kGeneric);
  EXPECT_EQ(plan(16384, 4, true, true).algo, RMSNormAlgo::kRegisters);
  EXPECT_EQ(plan(32768, 4, true, true).algo, RMSNormAlgo::kGeneric);
  // Asking for registers where they cannot run says why.
  Plan no = plan(65536, 2, false, true, RMSNormAlgo::kRegisters);
  EXPECT_EQ(no.algo, RMSNormAlgo::kAuto);
  ASSERT_NE(no.why_not, nullptr);
  EXPECT_EQ(plan(4096, 2, false, true, RMSNormAlgo::kRegisters, 8).vpt, 8);
  // Generic backward: dW sums in shared memory while a row fits, in the workspace beyond.
  Plan g = plan(50000, 2, true, true);
  EXPECT_EQ(g.algo, RMSNormAlgo::kGeneric);
  EXPECT_TRUE(g.dw_in_smem);
  EXPECT_EQ(g.smem_bytes, 50000u * 4);
  EXPECT_FALSE(plan(100003, 2, true, true).dw_in_smem);
  // Small generic rows: tpr = ceil(H / 8) rounded to a power of two, several rows a CTA.
  Plan gs = plan(100, 2, true, false);
  EXPECT_EQ(gs.threads_per_row, 16);
  EXPECT_EQ(gs.rows_per_cta, 16);
  EXPECT_TRUE(gs.dw_in_smem);
}

// Invariants the kernels rely on, over every H up to 70000: whole warps per CTA, power-of-two groups below a
// warp, named barriers for at most 15 rows, the CTA within the kernel's launch bounds, and a register row
// that covers H.
TEST(RMSNormPlan, InvariantsForEveryHiddenSize) {
  for (int es : {2, 4})
    for (bool bwd : {false, true})
      for (bool aligned : {true, false})
        for (int vpt : {0, 8})
          for (bool res : {false, true})
            for (int64_t H = 1; H <= 70000; H += (H < 2048 ? 1 : 61)) {
              rms::PlanInputs in;
              in.hidden = H;
              in.elem_bytes = es;
              in.backward = bwd;
              in.vector_ok = aligned;
              in.residual = res;
              in.vpt = vpt;
              in.smem_per_block = 227 * 1024;
              const rms::Plan p = rms::plan_rms_norm(in);
              const int tpr = p.threads_per_row, rows = p.rows_per_cta;
              SCOPED_TRACE(testing::Message()
                           << "H " << H << " es " << es << " bwd " << bwd << " vpt " << vpt << " residual " << res);
              ASSERT_EQ(p.threads() % 32, 0);
              if (tpr > 32) {
                ASSERT_EQ(tpr % 32, 0);
                ASSERT_LE(rows, rms::kMaxNamedBarrierRows);
              } else {
                ASSERT_EQ(tpr & (tpr - 1), 0);
              }
              ASSERT_EQ(rms::plan_error(p, in), nullptr);
              if (p.algo == RMSNormAlgo::kRegisters) {
                ASSERT_TRUE(rms::instantiated(bwd, p.vpt, p.prefetch, p.dw_in_smem));
                ASSERT_LE(p.threads(), rms::max_cta_threads(bwd, p.vpt, p.prefetch, res, p.dw_in_smem));
                // A prefetching forward needs a next row: a persistent grid.
                if (!bwd && p.prefetch) ASSERT_GT(p.ctas_per_sm, 0);
                ASSERT_GE(static_cast<int64_t>(tpr) * p.vpt * (16 / es), H);
                ASSERT_EQ(H % (16 / es), 0);
                ASSERT_LE(p.smem_bytes, p.dw_in_smem ? 227u * 1024 : 48u * 1024);
                if (p.dw_in_smem) ASSERT_TRUE(bwd);
              } else {
                ASSERT_EQ(p.algo, RMSNormAlgo::kGeneric);
                ASSERT_LE(p.threads(), rms::kGenericCtaThreads);
                if (bwd && p.dw_in_smem) ASSERT_EQ(p.smem_bytes, static_cast<size_t>(rows) * H * 4);
              }
            }
}

TEST(RMSNormPlan, PersistentGridIsBalancedAndBounded) {
  rms::Plan p;
  p.algo = RMSNormAlgo::kRegisters;
  p.rows_per_cta = 4;
  // 132 SMs x 1 CTA x 4 slots = 528 slots for 16384 rows: 32 iterations, and then 128 CTAs do exactly 32 each.
  rms::PersistentGrid g = rms::persistent_grid(p, 16384, 132, 1);
  EXPECT_EQ(g.ctas, 128);
  EXPECT_EQ(g.partial_rows, 128);
  EXPECT_EQ(rms::workspace_bytes(g, 4096), 128u * 4096 * 4);
  // Few rows: no more CTAs than rows need.
  EXPECT_EQ(rms::persistent_grid(p, 5, 132, 1).ctas, 2);
  EXPECT_EQ(rms::persistent_grid(p, 0, 132, 1).ctas, 0);
  // The generic kernel with its sums in the workspace has one partial row per slot.
  p.algo = RMSNormAlgo::kGeneric;
  p.dw_in_smem = false;
  p.rows_per_cta = 1;
  g = rms::persistent_grid(p, 1000, 132, 3);
  EXPECT_EQ(g.ctas * 1, g.partial_rows);
  EXPECT_LE(g.ctas, 396);
  EXPECT_EQ(rms::workspace_row_stride(4097), 4100);
}

// Plans a debug hook rewrites are checked before they launch: every way to break one is named.
TEST(RMSNormPlan, PlanErrorRefusesWhatTheKernelsCannotRun) {
  rms::PlanInputs in;
  in.hidden = 4096;
  in.elem_bytes = 2;
  in.vector_ok = true;
  in.smem_per_block = 227 * 1024;
  in.vpt = 4;
  // The 4-vector prefetching forward (128 threads a row; its bound: 608 threads, 512 with the residual).
  rms::Plan good = rms::plan_rms_norm(in);
  good.prefetch = true;
  in.vpt = 0;
  ASSERT_EQ(good.vpt, 4);
  ASSERT_EQ(good.threads_per_row, 128);
  ASSERT_EQ(rms::plan_error(good, in), nullptr);
  auto broken = [&](auto&& edit) {
    rms::Plan p = good;
    edit(p);
    return rms::plan_error(p, in) != nullptr;
  };
  EXPECT_TRUE(broken([](rms::Plan& p) { p.vpt = 2; }));                      // no forward kernel at 2
  EXPECT_TRUE(broken([](rms::Plan& p) { p.vpt = 16, p.prefetch = true; }));  // nor 16 prefetching
  EXPECT_TRUE(broken([](rms::Plan& p) { p.threads_per_row = 32; }));         // does not cover H
  EXPECT_TRUE(broken([](rms::Plan& p) { p.threads_per_row = 48; }));         // not whole warps
  EXPECT_TRUE(broken([](rms::Plan& p) { p.rows_per_cta = 16; }));            // named barriers
  EXPECT_TRUE(broken([](rms::Plan& p) { p.rows_per_cta = 0; }));
  EXPECT_TRUE(broken([](rms::Plan& p) { p.rows_per_cta = 8; }));  // 1024 > its 608 threads
  EXPECT_TRUE(broken([](rms::Plan& p) { p.ctas_per_sm = -1; }));
  EXPECT_TRUE(broken([](rms::Plan& p) { p.smem_bytes = 16; }));
  EXPECT_FALSE(broken([](rms::Plan& p) { p.rows_per_cta = 4, p.ctas_per_sm = 2; }));
  EXPECT_FALSE(broken([](rms::Plan& p) { p.vpt = 16, p.prefetch = false, p.threads_per_row = 32; }));
  // The residual's registers: 3 rows of 192 threads fit the plain kernel (608), not the fused one (512).
  rms::PlanInputs with_res = in;
  with_res.residual = true;
  rms::Plan wide = good;
  wide.threads_per_row = 192;
  wide.rows_per_cta = 3;
  EXPECT_EQ(rms::plan_error(wide, in), nullptr);
  EXPECT_NE(rms::plan_error(wide, with_res), nullptr);
  rms::PlanInputs misaligned = in;
  misaligned.vector_ok = false;
  EXPECT_NE(rms::plan_error(good, misaligned), nullptr);
  // The generic forward runs one CTA per row group: no persistent grid.
  misaligned.requested = RMSNormAlgo::kGeneric;
  rms::Plan g = rms::plan_rms_norm(misaligned);
  EXPECT_EQ(rms::plan_error(g, misaligned), nullptr);
  g.ctas_per_sm = 1;
  EXPECT_NE(rms::plan_error(g, misaligned), nullptr);
  // Every instantiated register kernel has a plan at H = 4096 bf16 in both directions.
  for (bool bwd : {false, true}) {
    in.backward = bwd;
    for (const rms::KernelVariant& k :
         bwd ? std::vector<rms::KernelVariant>(std::begin(rms::kBackwardVariants), std::end(rms::kBackwardVariants))
             : std::vector<rms::KernelVariant>(std::begin(rms::kForwardVariants), std::end(rms::kForwardVariants))) {
      rms::Plan p = rms::plan_rms_norm(in);
      p.vpt = k.vpt;
      p.prefetch = k.prefetch;
      p.dw_in_smem = k.smem_dw;
      p.threads_per_row = static_cast<int>(512 / k.vpt);
      p.rows_per_cta = 1;
      p.smem_bytes = rms::plan_smem_bytes(p, in);
      EXPECT_EQ(rms::plan_error(p, in), nullptr) << "bwd " << bwd << " vpt " << k.vpt << " prefetch " << k.prefetch;
    }
  }
}

// ---- bad input ---------------------------------------------------------------------------------------------
struct Small {
  TestTensor x{DType::kBFloat16, {4, 5}}, w{DType::kBFloat16, {5}}, y{DType::kBFloat16, {4, 5}},
      rstd{DType::kFloat32, {4}}, dy{DType::kBFloat16, {4, 5}}, dx{DType::kBFloat16, {4, 5}}, dw{DType::kBFloat16, {5}};
  Small() {
    for (int64_t i = 0; i < 20; ++i) x.set(i, 0.1f * static_cast<float>(i % 7) - 0.2f), dy.set(i, 1.f);
    for (int64_t j = 0; j < 5; ++j) w.set(j, 1.f);
    for (int64_t i = 0; i < 4; ++i) rstd.set(i, 1.f);
  }
  std::string fwd(const TensorView& x_, const TensorView& res, const TensorView& w_, const TensorView& y_,
                  const TensorView& s, const TensorView& r, RMSNormOptions o = {}) {
    return error_of([&] { rms_norm_forward(x_, res, w_, o, y_, s, r, {}, nullptr); });
  }
  std::string bwd(const TensorView& dy_, const TensorView& x_, const TensorView& w_, const TensorView& r,
                  const TensorView& dx_, const TensorView& dw_) {
    return error_of([&] { rms_norm_backward(dy_, {}, x_, w_, r, {}, dx_, dw_, {}, nullptr); });
  }
};

#define EXPECT_MSG(msg, needle) EXPECT_NE((msg).find(needle), std::string::npos) << (msg)

TEST(RMSNormErrors, NamesTheArgumentWithExpectedAndGot) {
  Small s;
  const TensorView x = s.x.host_view(), w = s.w.host_view(), y = s.y.host_view(), r = s.rstd.host_view();
  TestTensor w4(DType::kBFloat16, {4});
  EXPECT_MSG(s.fwd(x, {}, w4.host_view(), y, {}, r),
             "weight: expected shape [5] (the last dimension of x), got shape [4]");
  TestTensor wh(DType::kFloat16, {5});
  EXPECT_MSG(s.fwd(x, {}, wh.host_view(), y, {}, r), "weight: expected dtype bfloat16 (x's) or float32, got float16");
  TestTensor res16(DType::kFloat16, {4, 5}), s16(DType::kBFloat16, {4, 5});
  EXPECT_MSG(s.fwd(x, res16.host_view(), w, y, s16.host_view(), r),
             "residual: expected dtype bfloat16 (x's), got float16");
  TestTensor yf(DType::kFloat32, {4, 5});
  EXPECT_MSG(s.fwd(x, {}, w, yf.host_view(), {}, r), "y: expected dtype bfloat16 (x's), got float32");
  TestTensor y3(DType::kBFloat16, {3, 5});
  EXPECT_MSG(s.fwd(x, {}, w, y3.host_view(), {}, r), "y: expected shape [4, 5]");
  TestTensor r3(DType::kFloat32, {3});
  EXPECT_MSG(s.fwd(x, {}, w, y, {}, r3.host_view()), "rstd: expected 4 elements");
  TestTensor res(DType::kBFloat16, {4, 5});
  EXPECT_MSG(s.fwd(x, res.host_view(), w, y, {}, r), "residual_out: expected a tensor for x + residual");
  EXPECT_MSG(s.fwd(x, {}, w, y, res.host_view(), r), "residual_out: expected None");
  TestTensor xi(DType::kInt32, {4, 5});
  EXPECT_MSG(s.fwd(xi.host_view(), {}, w, y, {}, r), "x: expected dtype float32, float16 or bfloat16, got int32");
  TensorView strided = x;
  strided.strides[1] = 2;
  EXPECT_MSG(s.fwd(strided, {}, w, y, {}, r), "x: expected a last dimension with stride 1, got stride 2");
  TensorView cuda_w = w;
  cuda_w.device = {DeviceType::kCUDA, 0};
  EXPECT_MSG(s.fwd(x, {}, cuda_w, y, {}, r), "weight: expected device cpu, got cuda:0");
  for (double eps : {0.0, -1e-6, static_cast<double>(NAN), static_cast<double>(INFINITY)}) {
    RMSNormOptions o;
    o.eps = eps;
    Error::Kind kind{};
    const std::string msg = error_of([&] { rms_norm_forward(x, {}, w, o, y, {}, r, {}, nullptr); }, &kind);
    EXPECT_MSG(msg, "eps: expected a finite value > 0, got ");
    EXPECT_EQ(kind, Error::Kind::kInvalidArgument);
  }
  RMSNormOptions bad;
  bad.casting = static_cast<RMSNormCasting>(7);
  EXPECT_MSG(s.fwd(x, {}, w, y, {}, r, bad), "casting: expected llama, gemma or none, got 7");
  bad = {};
  bad.vectors_per_thread = 3;
  EXPECT_MSG(s.fwd(x, {}, w, y, {}, r, bad), "vectors_per_thread: expected 0 (auto), 4 or 8, got 3");
  // Backward.
  const TensorView dy = s.dy.host_view(), dx = s.dx.host_view(), dw = s.dw.host_view();
  TestTensor dwh(DType::kFloat16, {5});
  EXPECT_MSG(s.bwd(dy, x, w, r, dx, dwh.host_view()),
             "grad_weight: expected dtype bfloat16 (weight's) or float32, got float16");
  EXPECT_MSG(s.bwd(dy, x, w, {}, dx, dw), "rstd: expected a tensor, got None");
  TestTensor xf(DType::kFloat32, {4, 5});
  EXPECT_MSG(s.bwd(dy, xf.host_view(), w, r, dx, dw), "x: expected dtype bfloat16 (grad_y's), got float32");
  EXPECT_MSG(s.bwd(dy, x, w4.host_view(), r, dx, dw), "weight: expected shape [5]");
}

TEST(RMSNormErrors, OutputsMustNotPartiallyOverlapInputs) {
  Small s;
  TensorView y = s.x.host_view();
  y.data = static_cast<uint16_t*>(y.data) + 1;  // x shifted by one element: overlapping, not in place
  y.sizes[0] = 3;
  TensorView x3 = s.x.host_view();
  x3.sizes[0] = 3;
  TestTensor r3(DType::kFloat32, {3});
  EXPECT_MSG(s.fwd(x3, {}, s.w.host_view(), y, {}, r3.host_view()),
             "y: expected x itself (in place) or memory that does not overlap x, got an overlapping buffer");
  // grad_x may be grad_y itself but never x.
  EXPECT_MSG(
      s.bwd(s.dy.host_view(), s.x.host_view(), s.w.host_view(), s.rstd.host_view(), s.x.host_view(), s.dw.host_view()),
      "grad_x: expected memory that does not overlap x");
  EXPECT_EQ(
      s.bwd(s.dy.host_view(), s.x.host_view(), s.w.host_view(), s.rstd.host_view(), s.dy.host_view(), s.dw.host_view()),
      "");
  // Output rows must not overlap each other (a broadcast output).
  TensorView yb = s.y.host_view();
  yb.strides[0] = 0;
  EXPECT_MSG(s.fwd(s.x.host_view(), {}, s.w.host_view(), yb, {}, s.rstd.host_view()),
             "y: expected rows that do not overlap");
}

TEST(RMSNormErrors, WorkspaceTooSmallOnCuda) {
  LOGITLESS_SKIP_WITHOUT_GPU();
  Small s;
  for (TestTensor* t : {&s.x, &s.w, &s.y, &s.rstd, &s.dy, &s.dx, &s.dw}) t->to_device();
  const size_t need = rms_norm_backward_workspace_bytes(s.x.view(true), s.w.view(true), {});
  EXPECT_GT(need, 0u);
  DeviceScratch ws(need / 2);
  const std::string msg = error_of([&] {
    rms_norm_backward(s.dy.view(true), {}, s.x.view(true), s.w.view(true), s.rstd.view(true), {}, s.dx.view(true),
                      s.dw.view(true), ws.ws(), nullptr);
  });
  EXPECT_MSG(msg, "workspace: expected >= ");
  // Registers forced where the rows are misaligned: the Error says why.
  RMSNormOptions o;
  o.algo = RMSNormAlgo::kRegisters;
  EXPECT_MSG(error_of([&] {
               rms_norm_forward(s.x.view(true), {}, s.w.view(true), o, s.y.view(true), {}, s.rstd.view(true), {},
                                nullptr);
             }),
             "algo: expected a kernel that can run these arguments");
}

}  // namespace
}  // namespace logitless::test
