// GLU (SwiGLU, GeGLU): the CPU backend against a naive float64 reference for every activation and layout, the
// CUDA kernels against the CPU backend (each kernel path, in place and not), element offsets past 2^31, and bad
// input.
#include <gtest/gtest.h>

#include <cmath>
#include <optional>
#include <sstream>

#include "glu/cuda/plan.h"
#include "test_util.h"

namespace logitless::test {
namespace {

// kPadded: row stride I + 3 and a one-element storage offset, so rows start misaligned (the scalar kernels).
// kStrided: a [B, T, I] view of [B, T + 1, I] storage (the causal-LM shift): two strided row dimensions.
// kConcat: gate and up are the two halves of one [N, 2I] tensor (Phi-3's gate_up), and so are the gradients.
enum class Layout { kContiguous, kPadded, kStrided, kConcat };

const char* layout_name(Layout l) {
  switch (l) {
    case Layout::kContiguous:
      return "contig";
    case Layout::kPadded:
      return "padded";
    case Layout::kStrided:
      return "strided";
    case Layout::kConcat:
      return "gate_up";
  }
  return "?";
}
const char* act_name(GLUActivation a) {
  switch (a) {
    case GLUActivation::kSiLU:
      return "silu";
    case GLUActivation::kGeluTanh:
      return "gelu_tanh";
    case GLUActivation::kGelu:
      return "gelu";
  }
  return "?";
}

struct GluCase {
  int64_t n, inter;
  DType dtype;
  GLUActivation act;
  Layout layout;
};

std::string case_name(const GluCase& c) {
  std::ostringstream os;
  os << "N" << c.n << "_I" << c.inter << "_" << dtype_tag(c.dtype) << "_" << act_name(c.act) << "_"
     << layout_name(c.layout);
  return os.str();
}
void PrintTo(const GluCase& c, std::ostream* os) { *os << case_name(c); }
uint64_t seed_of(const GluCase& c) { return std::hash<std::string>{}(case_name(c)); }

// One [N, I] row tensor in a layout other than kConcat.
TestTensor rows_tensor(const GluCase& c, Layout l) {
  const int64_t N = c.n, I = c.inter;
  switch (l) {
    case Layout::kPadded:
      return TestTensor(c.dtype, {N, I}, {I + 3, 1}, 1);
    case Layout::kStrided: {
      const int64_t B = N % 2 == 0 && N > 0 ? 2 : 1, T = N / B;
      return TestTensor(c.dtype, {B, T, I}, {(T + 1) * I, I, 1});
    }
    default:
      return TestTensor(c.dtype, {N, I});
  }
}

// A pair of [N, I] operands (gate and up, or their gradients): two tensors, or the two halves of one [N, 2I].
struct Pair {
  Layout layout;
  TestTensor a, b, ab;

  Pair(const GluCase& c, Layout l) : layout(l) {
    if (l == Layout::kConcat) {
      ab = TestTensor(c.dtype, {c.n, 2 * c.inter});
    } else {
      a = rows_tensor(c, l);
      b = rows_tensor(c, l);
    }
  }
  Pair(const Pair& o) : layout(o.layout), a(o.a.clone()), b(o.b.clone()), ab(o.ab.clone()) {}

  int64_t inter() const { return layout == Layout::kConcat ? ab.sizes()[1] / 2 : a.sizes().back(); }
  TensorView half(bool dev, int which) const {
    if (layout != Layout::kConcat) return which == 0 ? a.view(dev) : b.view(dev);
    TensorView v = ab.view(dev);
    const int64_t I = inter();
    v.sizes[1] = I;
    v.data = static_cast<char*>(v.data) + which * I * dtype_size(v.dtype);
    return v;
  }
  float get(int which, int64_t flat) const {
    if (layout != Layout::kConcat) return which == 0 ? a.get(flat) : b.get(flat);
    const int64_t I = inter();
    return ab.get((flat / I) * 2 * I + which * I + flat % I);
  }
  void set(int which, int64_t flat, float v) {
    if (layout != Layout::kConcat) return which == 0 ? a.set(flat, v) : b.set(flat, v);
    const int64_t I = inter();
    ab.set((flat / I) * 2 * I + which * I + flat % I, v);
  }
  void poison() {
    for (TestTensor* t : {&a, &b, &ab}) t->fill_storage_nan();
  }
  void to_device() {
    if (layout == Layout::kConcat) {
      ab.to_device();
    } else {
      a.to_device();
      b.to_device();
    }
  }
  void to_host() {
    if (layout == Layout::kConcat) {
      ab.to_host();
    } else {
      a.to_host();
      b.to_host();
    }
  }
  std::vector<double> values(int which, int64_t n) const {
    std::vector<double> v(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) v[i] = get(which, i);
    return v;
  }
};

struct Inputs {
  GluCase c;
  GLUOptions opt;
  Pair gu;
  TestTensor dy;

  Inputs(const GluCase& cs, uint64_t seed) : c(cs), gu(cs, cs.layout) {
    opt.activation = c.act;
    const int64_t n = c.n * c.inter;
    gu.poison();  // padding and gaps stay NaN; viewed elements are filled
    TestTensor g = TestTensor(c.dtype, {c.n, c.inter}), u = TestTensor(c.dtype, {c.n, c.inter});
    g.fill_normal(seed * 4 + 1, 2.5f);  // over the activations' curved range
    u.fill_normal(seed * 4 + 2, 1.f);
    for (int64_t i = 0; i < n; ++i) {
      gu.set(0, i, g.get(i));
      gu.set(1, i, u.get(i));
    }
    dy = out_tensor();
    dy.fill_storage_nan();
    dy.fill_normal(seed * 4 + 3, 1.f);
  }
  // y and grad_y: in the case's layout, except beside a concatenated gate_up ([N, I] then).
  TestTensor out_tensor() const {
    return c.layout == Layout::kConcat ? TestTensor(c.dtype, {c.n, c.inter}) : rows_tensor(c, c.layout);
  }
  int64_t numel() const { return c.n * c.inter; }
};

// ---- float64 reference: the formulas of include/logitless/glu.h, written out -----------------------------------
double act_ref(GLUActivation a, double g) {
  switch (a) {
    case GLUActivation::kSiLU:
      return g / (1.0 + std::exp(-g));
    case GLUActivation::kGeluTanh:
      return 0.5 * g * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (g + 0.044715 * g * g * g)));
    case GLUActivation::kGelu:
      return 0.5 * g * (1.0 + std::erf(g / std::sqrt(2.0)));
  }
  return NAN;
}
double dact_ref(GLUActivation a, double g) {
  switch (a) {
    case GLUActivation::kSiLU: {
      const double s = 1.0 / (1.0 + std::exp(-g));
      return s + g * s * (1.0 - s);
    }
    case GLUActivation::kGeluTanh: {
      const double k = std::sqrt(2.0 / M_PI), t = std::tanh(k * (g + 0.044715 * g * g * g));
      return 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * k * (1.0 + 3 * 0.044715 * g * g);
    }
    case GLUActivation::kGelu:
      return 0.5 * (1.0 + std::erf(g / std::sqrt(2.0))) + g * std::exp(-0.5 * g * g) / std::sqrt(2.0 * M_PI);
  }
  return NAN;
}

struct RefOut {
  std::vector<double> y, dg, du;
};

RefOut reference(const Inputs& in) {
  const int64_t n = in.numel();
  RefOut r;
  r.y.resize(n), r.dg.resize(n), r.du.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    const double g = in.gu.get(0, i), u = in.gu.get(1, i), dy = in.dy.get(i);
    r.y[i] = act_ref(in.c.act, g) * u;
    r.dg[i] = dy * u * dact_ref(in.c.act, g);
    r.du[i] = dy * act_ref(in.c.act, g);
  }
  return r;
}

// ---- running a backend -------------------------------------------------------------------------------------
std::vector<double> values(const TestTensor& t) {
  const std::vector<float> f = t.gather_float();
  return std::vector<double>(f.begin(), f.end());
}

// y on the CPU (dev = false) or the GPU, poisoned first; in place: over a copy of gate (which has y's shape in every
// layout, the gate half of gate_up included).
std::vector<double> run_forward(Inputs& in, bool dev, bool in_place, const GLUOptions& opt) {
  Pair gu = in.gu;
  TestTensor y = in.out_tensor();
  y.fill_storage_nan();
  if (dev) {
    gu.to_device();
    y.to_device();
  }
  const bool over_gate = in_place;
  glu_forward(gu.half(dev, 0), gu.half(dev, 1), opt, over_gate ? gu.half(dev, 0) : y.view(dev), nullptr);
  if (dev) {
    device_synchronize();
    gu.to_host();
    y.to_host();
  }
  return over_gate ? gu.values(0, in.numel()) : values(y);
}

// (grad_gate, grad_up); in place: over copies of gate and up.
std::pair<std::vector<double>, std::vector<double>> run_backward(Inputs& in, bool dev, bool in_place,
                                                                 const GLUOptions& opt) {
  Pair gu = in.gu;
  Pair grads(in.c, in.c.layout);
  grads.poison();
  if (dev) {
    gu.to_device();
    in.dy.to_device();
    grads.to_device();
  }
  Pair& out = in_place ? gu : grads;
  glu_backward(in.dy.view(dev), gu.half(dev, 0), gu.half(dev, 1), opt, out.half(dev, 0), out.half(dev, 1), nullptr);
  if (dev) {
    device_synchronize();
    out.to_host();
  }
  return {out.values(0, in.numel()), out.values(1, in.numel())};
}

void expect_close(const std::vector<double>& got, const std::vector<double>& want, DType dt, const std::string& what) {
  EXPECT_TRUE(all_close(got, want, tolerance(dt, Quantity::kElementwise), std::max(1.0, max_abs(want)), what));
}

// ---- the case lists ----------------------------------------------------------------------------------------
std::vector<GluCase> make_cases(bool gpu_suite) {
  std::vector<GluCase> cases;
  const DType dts[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};
  const GLUActivation acts[] = {GLUActivation::kSiLU, GLUActivation::kGeluTanh, GLUActivation::kGelu};
  const Layout layouts[] = {Layout::kContiguous, Layout::kPadded, Layout::kStrided, Layout::kConcat};
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{0, 64},    {1, 1},     {7, 3},   {5, 100},
                                                           {33, 1000}, {64, 4096}, {9, 4097}};
  int k = 0;
  for (const auto& [N, I] : shapes)
    for (DType dt : dts)
      for (Layout l : layouts) cases.push_back({N, I, dt, acts[k++ % 3], l});
  if (gpu_suite) {
    // Llama-3-8B's intermediate size (14336: whole vectors, a plan whose CTAs divide the row), an odd one
    // (the scalar path's tail), and one folded contiguous row of 16M elements with the grid's column loop.
    const std::vector<std::pair<int64_t, int64_t>> big = {{300, 14336}, {777, 5504}, {1000, 2731}, {1024, 16384}};
    for (const auto& [N, I] : big)
      for (DType dt : dts)
        for (Layout l : layouts) cases.push_back({N, I, dt, acts[k++ % 3], l});
  }
  return cases;
}

class GLUCpu : public ::testing::TestWithParam<GluCase> {};
class GLUCuda : public ::testing::TestWithParam<GluCase> {};

TEST_P(GLUCpu, MatchesFloat64Reference) {
  Inputs in(GetParam(), seed_of(GetParam()));
  const RefOut ref = reference(in);
  const DType dt = in.c.dtype;
  for (bool in_place : {false, true}) {
    SCOPED_TRACE(in_place ? "in place" : "out of place");
    expect_close(run_forward(in, false, in_place, in.opt), ref.y, dt, "cpu y");
    const auto [dg, du] = run_backward(in, false, in_place, in.opt);
    expect_close(dg, ref.dg, dt, "cpu grad_gate");
    expect_close(du, ref.du, dt, "cpu grad_up");
  }
}

TEST_P(GLUCuda, MatchesCpuBackend) {
  LOGITLESS_SKIP_WITHOUT_GPU();
  Inputs in(GetParam(), seed_of(GetParam()));
  const DType dt = in.c.dtype;
  const auto y_cpu = run_forward(in, false, false, in.opt);
  const auto [dg_cpu, du_cpu] = run_backward(in, false, false, in.opt);
  for (GLUAlgo algo : {GLUAlgo::kAuto, GLUAlgo::kVector, GLUAlgo::kScalar}) {
    GLUOptions o = in.opt;
    o.algo = algo;
    for (bool in_place : {false, true}) {
      SCOPED_TRACE(testing::Message() << "algo " << static_cast<int>(algo) << (in_place ? " in place" : ""));
      if (algo == GLUAlgo::kVector) {
        // The vector kernel takes rows of whole 16-byte vectors that start 16-byte aligned; elsewhere it refuses.
        // Dense tensors fold into one row of N x I elements first, and an empty problem launches nothing.
        const int64_t es = dtype_size(dt);
        const bool ok =
            in.c.layout != Layout::kPadded &&
            ((in.c.inter * es) % 16 == 0 || (in.c.layout == Layout::kContiguous && in.c.n * in.c.inter * es % 16 == 0));
        if (!ok && in.c.n > 0) {
          EXPECT_NE(error_of([&] { run_forward(in, true, in_place, o); }).find("algo"), std::string::npos);
          continue;
        }
      }
      expect_close(run_forward(in, true, in_place, o), y_cpu, dt, "cuda y");
      const auto [dg, du] = run_backward(in, true, in_place, o);
      expect_close(dg, dg_cpu, dt, "cuda grad_gate");
      expect_close(du, du_cpu, dt, "cuda grad_up");
    }
  }
}

std::string param_name(const ::testing::TestParamInfo<GluCase>& info) { return case_name(info.param); }

INSTANTIATE_TEST_SUITE_P(Shapes, GLUCpu, ::testing::ValuesIn(make_cases(false)), param_name);
INSTANTIATE_TEST_SUITE_P(Shapes, GLUCuda, ::testing::ValuesIn(make_cases(true)), param_name);

// ---- the reference itself: its derivatives against central differences -----------------------------------------
TEST(GLUReference, DerivativesMatchFiniteDifferences) {
  for (GLUActivation a : {GLUActivation::kSiLU, GLUActivation::kGeluTanh, GLUActivation::kGelu})
    for (double g = -6.0; g <= 6.0; g += 0.37) {
      const double h = 1e-5, fd = (act_ref(a, g + h) - act_ref(a, g - h)) / (2 * h);
      EXPECT_NEAR(dact_ref(a, g), fd, 1e-8) << act_name(a) << " at " << g;
    }
}

// ---- element offsets past 2^31 -------------------------------------------------------------------------------
// gate's rows 716e6 elements apart (a multiple of 8: vectors still run): row 3 starts at element 2.1e9. GPU only
// (the view spans 4.3 GB); compared with the CPU backend on a compact copy.
TEST(GLULarge, RowOffsetsBeyondInt32) {
  LOGITLESS_SKIP_WITHOUT_GPU();
  const int64_t N = 4, I = 4096, stride = 716000000;
  const DType bf = DType::kBFloat16;
  TestTensor gate(bf, {N, I}, {stride, 1}), gc(bf, {N, I}), up(bf, {N, I}), dy(bf, {N, I});
  gc.fill_normal(1, 2.f);
  up.fill_normal(2, 1.f);
  dy.fill_normal(3, 1.f);
  for (int64_t k = 0; k < N * I; ++k) gate.set(k, gc.get(k));
  GLUOptions o;
  TestTensor y(bf, {N, I}), dg(bf, {N, I}), du(bf, {N, I});
  for (TestTensor* t : {&gate, &up, &dy, &y, &dg, &du}) t->to_device();
  glu_forward(gate.view(true), up.view(true), o, y.view(true), nullptr);
  glu_backward(dy.view(true), gate.view(true), up.view(true), o, dg.view(true), du.view(true), nullptr);
  device_synchronize();
  for (TestTensor* t : {&y, &dg, &du}) t->to_host();
  TestTensor yc(bf, {N, I}), dgc(bf, {N, I}), duc(bf, {N, I});
  glu_forward(gc.host_view(), up.host_view(), o, yc.host_view(), nullptr);
  glu_backward(dy.host_view(), gc.host_view(), up.host_view(), o, dgc.host_view(), duc.host_view(), nullptr);
  expect_close(values(y), values(yc), bf, "y");
  expect_close(values(dg), values(dgc), bf, "grad_gate");
  expect_close(values(du), values(duc), bf, "grad_up");
}

// ---- the launch plan ---------------------------------------------------------------------------------------
glu::Plan plan(int64_t n_rows, int64_t width, int es, bool aligned, GLUAlgo algo = GLUAlgo::kAuto) {
  glu::PlanInputs in;
  in.n_rows = n_rows;
  in.width = width;
  in.elem_bytes = es;
  in.vector_ok = aligned;
  in.requested = algo;
  return glu::plan_glu(in);
}

TEST(GLUPlan, Decisions) {
  // Llama-3-8B's gate_up halves (rows 2I apart): 1792 bf16 vectors a row tile exactly into 7 chunks of 128 threads
  // x 2 vectors, where 256-thread CTAs would leave an eighth of the last chunk idle.
  glu::Plan p = plan(16384, 14336, 2, true);
  EXPECT_TRUE(p.vector);
  EXPECT_EQ(p.units, 1792);
  EXPECT_EQ(p.threads, 128);
  EXPECT_EQ(p.chunks, 7);
  EXPECT_EQ(p.grid_x, 7);
  EXPECT_EQ(p.grid_y, 16384);
  // Dense tensors fold into one row of N x I elements: 256-thread CTAs, no idle tail to speak of.
  glu::Plan f = plan(1, int64_t{16384} * 14336, 2, true);
  EXPECT_EQ(f.threads, 256);
  EXPECT_EQ(f.units, int64_t{16384} * 14336 / 8);
  EXPECT_EQ(f.grid_y, 1);
  // float32: 4 elements a vector.
  EXPECT_EQ(plan(10, 4096, 4, true).units, 1024);
  // Rows the vector kernel cannot take go to the scalar one, unless the vector one was asked for.
  EXPECT_FALSE(plan(10, 4096, 2, false).vector);
  EXPECT_FALSE(plan(10, 4097, 2, true).vector);
  EXPECT_EQ(plan(10, 4097, 2, true).units, 4097);
  EXPECT_NE(plan(10, 4097, 2, true, GLUAlgo::kVector).why_not, nullptr);
  EXPECT_EQ(plan(10, 4096, 2, true, GLUAlgo::kVector).why_not, nullptr);
  EXPECT_FALSE(plan(10, 4096, 2, true, GLUAlgo::kScalar).vector);
  // More rows than grid.y holds: the rows loop.
  EXPECT_EQ(plan(100000, 64, 2, true).grid_y, glu::kMaxGridY);
}

// Every chunking covers the row exactly once: chunks of threads x kUnitsPerThread units, the last one partly empty.
TEST(GLUPlan, ChunksCoverEveryRow) {
  for (int es : {2, 4})
    for (bool aligned : {false, true})
      for (int64_t width = 1; width <= 20000; width += (width < 600 ? 1 : 97)) {
        const glu::Plan p = plan(3, width, es, aligned);
        SCOPED_TRACE(testing::Message() << "width " << width << " es " << es << " aligned " << aligned);
        ASSERT_EQ(p.why_not, nullptr);
        ASSERT_TRUE(p.threads == 32 || p.threads == 64 || p.threads == 128 || p.threads == 256 || p.threads == 512);
        ASSERT_LE(p.threads, glu::kMaxThreads);
        const int64_t chunk = int64_t{p.threads} * glu::kUnitsPerThread;
        ASSERT_GE(p.chunks * chunk, p.units);
        ASSERT_LT((p.chunks - 1) * chunk, p.units);
        ASSERT_EQ(p.vector ? p.units * (16 / es) : p.units, width);
      }
}

// ---- bad input ---------------------------------------------------------------------------------------------
#define EXPECT_MSG(msg, needle) EXPECT_NE((msg).find(needle), std::string::npos) << (msg)

TEST(GLUErrors, NamesTheArgumentWithExpectedAndGot) {
  const DType bf = DType::kBFloat16;
  TestTensor g(bf, {4, 6}), u(bf, {4, 6}), y(bf, {4, 6}), dy(bf, {4, 6}), dg(bf, {4, 6}), du(bf, {4, 6});
  TestTensor u5(bf, {4, 5}), uh(DType::kFloat16, {4, 6}), gi(DType::kInt32, {4, 6}), gu(bf, {4, 12});
  const GLUOptions o;
  auto fwd = [&](const TensorView& a, const TensorView& b, const TensorView& c, GLUOptions opt = {}) {
    return error_of([&] { glu_forward(a, b, opt, c, nullptr); });
  };
  auto bwd = [&](const TensorView& d, const TensorView& a, const TensorView& b, const TensorView& ga,
                 const TensorView& gb) { return error_of([&] { glu_backward(d, a, b, o, ga, gb, nullptr); }); };
  const TensorView gv = g.host_view(), uv = u.host_view(), yv = y.host_view();
  EXPECT_MSG(fwd(gv, u5.host_view(), yv), "up: expected shape [4, 6] (gate's shape), got shape [4, 5]");
  EXPECT_MSG(fwd(gv, uh.host_view(), yv), "up: expected dtype bfloat16 (gate's), got float16");
  EXPECT_MSG(fwd(gi.host_view(), uv, yv), "gate: expected dtype float32, float16, bfloat16 or float64, got int32");
  EXPECT_MSG(fwd(gv, uv, TensorView{}), "y: expected a tensor");
  GLUOptions bad;
  bad.activation = static_cast<GLUActivation>(7);
  EXPECT_MSG(fwd(gv, uv, yv, bad), "activation: expected silu, gelu_tanh or gelu, got 7");
  // Outputs: in place over the matching input only.
  EXPECT_EQ(fwd(gv, uv, gv), "");
  TensorView shifted = gv;
  shifted.data = static_cast<char*>(shifted.data) + 2;
  shifted.sizes[1] = 5;
  TensorView gv5 = gv, uv5 = uv;
  gv5.sizes[1] = uv5.sizes[1] = 5;
  EXPECT_MSG(fwd(gv5, uv5, shifted), "y: expected gate itself (in place) or memory that does not overlap gate");
  const TensorView dyv = dy.host_view(), dgv = dg.host_view(), duv = du.host_view();
  EXPECT_EQ(bwd(dyv, gv, uv, gv, uv), "");  // both gradients in place
  EXPECT_MSG(bwd(dyv, gv, uv, dyv, duv), "grad_gate: expected memory that does not overlap grad_y");
  EXPECT_MSG(bwd(dyv, gv, uv, uv, duv), "grad_gate: expected memory that does not overlap up");
  EXPECT_MSG(bwd(dyv, gv, uv, dgv, dgv), "grad_up: expected memory that does not overlap grad_gate");
  EXPECT_MSG(bwd(dyv, gv, uv, dgv, gv), "grad_up: expected memory that does not overlap gate");
  // The two halves of one gate_up buffer share no element: in place and out of place are both fine.
  TensorView lo = gu.host_view(), hi = gu.host_view();
  lo.sizes[1] = hi.sizes[1] = 6;
  hi.data = static_cast<char*>(hi.data) + 6 * 2;
  EXPECT_EQ(bwd(dyv, lo, hi, lo, hi), "");
  EXPECT_EQ(fwd(lo, hi, yv), "");
  // Broadcast output rows collide.
  TensorView bcast = yv;
  bcast.strides[0] = 0;
  EXPECT_MSG(fwd(gv, uv, bcast), "y: expected rows that do not overlap");
  // float64 is a CPU-only dtype; CUDA tensors need the CUDA backend.
  TensorView cuda_g = gv;
  cuda_g.device.type = DeviceType::kCUDA;
  if (!built_with_cuda()) {
    TensorView cu = uv, cy = yv;
    cu.device.type = cy.device.type = DeviceType::kCUDA;
    EXPECT_MSG(fwd(cuda_g, cu, cy), "built without its CUDA backend");
  }
}

}  // namespace
}  // namespace logitless::test
