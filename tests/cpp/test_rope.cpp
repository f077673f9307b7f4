// Rotary embedding: the CPU backend against a naive float64 reference (forward and inverse, every layout and
// form of cos/sin), the CUDA kernels against the CPU backend (each kernel path, in place and not), element offsets
// past 2^31, positions out of range, and bad input.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <random>
#include <sstream>

#include "rope/cuda/plan.h"
#include "test_util.h"

namespace logitless::test {
namespace {

// kBhtd: contiguous [B, H, T, D]. kBthd: the [B, T, H, D] projection seen as [B, H, T, D]. kPadded: rows D + 3
// apart from a one-element offset (misaligned: the scalar kernels).
enum class Layout { kBhtd, kBthd, kPadded };
// cos/sin as [B, T, Dr], [1, T, Dr], [T, Dr], or [P, Dr] tables indexed by position_ids [B, T] (int64 / int32).
enum class Tables { kBT, k1T, kT, kPos64, kPos32 };

const char* layout_name(Layout l) {
  switch (l) {
    case Layout::kBhtd:
      return "bhtd";
    case Layout::kBthd:
      return "bthd";
    case Layout::kPadded:
      return "padded";
  }
  return "?";
}
const char* tables_name(Tables t) {
  switch (t) {
    case Tables::kBT:
      return "cos_bt";
    case Tables::k1T:
      return "cos_1t";
    case Tables::kT:
      return "cos_t";
    case Tables::kPos64:
      return "pos64";
    case Tables::kPos32:
      return "pos32";
  }
  return "?";
}

struct RopeCase {
  int64_t b, hq, hk, t, d, dr;
  DType dtype;
  bool cs_f32;
  Layout layout;
  Tables tables;
};

std::string case_name(const RopeCase& c) {
  std::ostringstream os;
  os << "B" << c.b << "_Hq" << c.hq << "_Hk" << c.hk << "_T" << c.t << "_D" << c.d << "_Dr" << c.dr << "_"
     << dtype_tag(c.dtype) << (c.cs_f32 ? "_csf32" : "_cssame") << "_" << layout_name(c.layout) << "_"
     << tables_name(c.tables);
  return os.str();
}
void PrintTo(const RopeCase& c, std::ostream* os) { *os << case_name(c); }
uint64_t seed_of(const RopeCase& c) { return std::hash<std::string>{}(case_name(c)); }

TestTensor heads_tensor(const RopeCase& c, int64_t H) {
  const int64_t B = c.b, T = c.t, D = c.d;
  switch (c.layout) {
    case Layout::kBthd:
      return TestTensor(c.dtype, {B, H, T, D}, {T * H * D, D, H * D, 1});
    case Layout::kPadded:
      return TestTensor(c.dtype, {B, H, T, D}, {H * T * (D + 3), T * (D + 3), D + 3, 1}, 1);
    default:
      return TestTensor(c.dtype, {B, H, T, D});
  }
}

struct Inputs {
  RopeCase c;
  TestTensor q, k, cos, sin, pos;
  int64_t n_pos = 0;

  Inputs(const RopeCase& cs, uint64_t seed) : c(cs) {
    q = heads_tensor(c, c.hq);
    k = heads_tensor(c, c.hk);
    q.fill_storage_nan();
    k.fill_storage_nan();
    q.fill_normal(seed * 8 + 1, 1.f);
    k.fill_normal(seed * 8 + 2, 1.f);
    const DType cdt = c.cs_f32 ? DType::kFloat32 : c.dtype;
    const int64_t B = c.b, T = c.t, Dr = c.dr, h = Dr / 2;
    std::vector<int64_t> shape;
    switch (c.tables) {
      case Tables::kBT:
        shape = {B, T, Dr};
        break;
      case Tables::k1T:
        shape = {1, T, Dr};
        break;
      case Tables::kT:
        shape = {T, Dr};
        break;
      default:
        n_pos = T + 5, shape = {n_pos, Dr};
        break;
    }
    cos = TestTensor(cdt, shape);
    sin = TestTensor(cdt, shape);
    const int64_t rows = cos.numel() / Dr;
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<double> angle(-3.2, 3.2), any(-1.5, 1.5);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < h; ++i) {
        if (c.tables == Tables::kBT) {
          // Arbitrary values, halves unequal: the inverse must be the transpose, not the rotation by -sin.
          for (int64_t j : {i, i + h})
            cos.set(r * Dr + j, static_cast<float>(any(rng))), sin.set(r * Dr + j, static_cast<float>(any(rng)));
        } else {
          const double a = angle(rng);  // what a rotary module makes: one angle for both halves
          for (int64_t j : {i, i + h})
            cos.set(r * Dr + j, static_cast<float>(std::cos(a))), sin.set(r * Dr + j, static_cast<float>(std::sin(a)));
        }
      }
    if (n_pos) {
      pos = TestTensor(c.tables == Tables::kPos32 ? DType::kInt32 : DType::kInt64, {B, T});
      std::uniform_int_distribution<int64_t> p(0, n_pos - 1);
      for (int64_t i = 0; i < B * T; ++i) pos.set_index(i, p(rng));
    }
  }
  bool has_pos() const { return n_pos > 0; }
  TensorView pos_view(bool dev) const { return has_pos() ? pos.view(dev) : TensorView{}; }
  void to_device() {
    for (TestTensor* t : {&q, &k, &cos, &sin}) t->to_device();
    if (has_pos()) pos.to_device();
  }
  // The cos/sin row of token (b, t).
  int64_t table_row(int64_t b, int64_t t) const {
    switch (c.tables) {
      case Tables::kBT:
        return b * c.t + t;
      case Tables::k1T:
      case Tables::kT:
        return t;
      default:
        return pos.get_index(b * c.t + t);
    }
  }
};

// ---- float64 reference: the formulas of include/logitless/rope.h, pair by pair -----------------------------------
std::vector<double> reference(const Inputs& in, const TestTensor& x, bool inverse) {
  const int64_t B = in.c.b, H = x.sizes()[1], T = in.c.t, D = in.c.d, Dr = in.c.dr, h = Dr / 2;
  std::vector<double> out(static_cast<size_t>(x.numel()));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t hd = 0; hd < H; ++hd)
      for (int64_t t = 0; t < T; ++t) {
        const int64_t row = ((b * H + hd) * T + t) * D, cs = in.table_row(b, t) * Dr;
        for (int64_t i = 0; i < h; ++i) {
          const double lo = x.get(row + i), hi = x.get(row + i + h);
          const double cl = in.cos.get(cs + i), ch = in.cos.get(cs + i + h), sl = in.sin.get(cs + i),
                       sh = in.sin.get(cs + i + h);
          out[row + i] = inverse ? lo * cl + hi * sh : lo * cl - hi * sl;
          out[row + i + h] = inverse ? hi * ch - lo * sl : hi * ch + lo * sh;
        }
        for (int64_t j = Dr; j < D; ++j) out[row + j] = x.get(row + j);
      }
  return out;
}

std::vector<double> values(const TestTensor& t) {
  const std::vector<float> f = t.gather_float();
  return std::vector<double>(f.begin(), f.end());
}

// (q_out, k_out) on the CPU (dev = false) or the GPU, poisoned first; in place: over copies of q and k in their
// own layouts.
std::pair<std::vector<double>, std::vector<double>> run(Inputs& in, bool dev, bool in_place, const RopeOptions& o) {
  TestTensor qo = in_place ? in.q.clone() : heads_tensor(in.c, in.c.hq);
  TestTensor ko = in_place ? in.k.clone() : heads_tensor(in.c, in.c.hk);
  if (!in_place) {
    qo.fill_storage_nan();
    ko.fill_storage_nan();
  }
  if (dev) {
    in.to_device();
    qo.to_device();
    ko.to_device();
  }
  const TensorView qi = in_place ? qo.view(dev) : in.q.view(dev), ki = in_place ? ko.view(dev) : in.k.view(dev);
  rope_apply(qi, ki, in.cos.view(dev), in.sin.view(dev), in.pos_view(dev), o, qo.view(dev), ko.view(dev), nullptr);
  if (dev) {
    device_synchronize();
    qo.to_host();
    ko.to_host();
  }
  return {values(qo), values(ko)};
}

void expect_close(const std::vector<double>& got, const std::vector<double>& want, DType dt, const std::string& what) {
  EXPECT_TRUE(all_close(got, want, tolerance(dt, Quantity::kElementwise), std::max(1.0, max_abs(want)), what));
}

// ---- the case lists ----------------------------------------------------------------------------------------
std::vector<RopeCase> make_cases(bool gpu_suite) {
  std::vector<RopeCase> cases;
  const DType dts[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};
  const Layout layouts[] = {Layout::kBhtd, Layout::kBthd, Layout::kPadded};
  const Tables tables[] = {Tables::kBT, Tables::k1T, Tables::kT, Tables::kPos64, Tables::kPos32};
  // (B, Hq, Hk, T, D, Dr): GQA, no k, partial rotary (Phi's 32 of 80, a quarter, half), D below a vector,
  // nothing to do, one token.
  const std::vector<std::array<int64_t, 6>> shapes = {{2, 4, 2, 7, 64, 64},  {1, 3, 0, 5, 16, 16}, {2, 2, 1, 9, 80, 32},
                                                      {1, 2, 2, 3, 128, 32}, {3, 1, 1, 4, 8, 4},   {1, 2, 1, 1, 64, 64},
                                                      {0, 2, 1, 3, 16, 16},  {2, 2, 1, 5, 6, 2}};
  int k = 0;
  for (const auto& s : shapes)
    for (DType dt : dts)
      for (Layout l : layouts) {
        cases.push_back({s[0], s[1], s[2], s[3], s[4], s[5], dt, k % 2 == 0, l, tables[k % 5]});
        ++k;
      }
  if (gpu_suite) {
    // Llama-3-8B's heads (32 q, 8 kv of 128) on real sequence lengths, a partial-rotary model (Phi-2: 32 of 80),
    // and heads of 64 and 256.
    const std::vector<std::array<int64_t, 6>> big = {
        {2, 32, 8, 257, 128, 128}, {1, 32, 32, 300, 80, 32}, {4, 8, 1, 129, 64, 64}, {1, 8, 4, 100, 256, 128}};
    for (const auto& s : big)
      for (DType dt : dts)
        for (Layout l : layouts) {
          cases.push_back({s[0], s[1], s[2], s[3], s[4], s[5], dt, k % 2 == 0, l, tables[k % 5]});
          ++k;
        }
  }
  return cases;
}

class RopeCpu : public ::testing::TestWithParam<RopeCase> {};
class RopeCuda : public ::testing::TestWithParam<RopeCase> {};

TEST_P(RopeCpu, MatchesFloat64Reference) {
  Inputs in(GetParam(), seed_of(GetParam()));
  const DType dt = in.c.dtype;
  for (bool inverse : {false, true})
    for (bool in_place : {false, true}) {
      SCOPED_TRACE(testing::Message() << (inverse ? "inverse" : "forward") << (in_place ? " in place" : ""));
      RopeOptions o;
      o.inverse = inverse;
      const auto [qo, ko] = run(in, false, in_place, o);
      expect_close(qo, reference(in, in.q, inverse), dt, "cpu q_out");
      expect_close(ko, reference(in, in.k, inverse), dt, "cpu k_out");
    }
}

TEST_P(RopeCuda, MatchesCpuBackend) {
  LOGITLESS_SKIP_WITHOUT_GPU();
  Inputs in(GetParam(), seed_of(GetParam()));
  const DType dt = in.c.dtype;
  const int64_t es = dtype_size(dt);
  const bool vector_ok = in.c.layout != Layout::kPadded && (in.c.dr / 2 * es) % 16 == 0 && (in.c.d * es) % 16 == 0;
  for (bool inverse : {false, true}) {
    RopeOptions o;
    o.inverse = inverse;
    const auto [q_cpu, k_cpu] = run(in, false, false, o);
    for (RopeAlgo algo : {RopeAlgo::kAuto, RopeAlgo::kVector, RopeAlgo::kScalar})
      for (bool in_place : {false, true}) {
        SCOPED_TRACE(testing::Message() << (inverse ? "inverse" : "forward") << " algo " << static_cast<int>(algo)
                                        << (in_place ? " in place" : ""));
        o.algo = algo;
        if (algo == RopeAlgo::kVector && !vector_ok && in.c.b > 0) {  // an empty problem launches nothing
          EXPECT_NE(error_of([&] { run(in, true, in_place, o); }).find("algo"), std::string::npos);
          continue;
        }
        const auto [qg, kg] = run(in, true, in_place, o);
        expect_close(qg, q_cpu, dt, "cuda q_out");
        expect_close(kg, k_cpu, dt, "cuda k_out");
      }
  }
}

std::string param_name(const ::testing::TestParamInfo<RopeCase>& info) { return case_name(info.param); }

INSTANTIATE_TEST_SUITE_P(Shapes, RopeCpu, ::testing::ValuesIn(make_cases(false)), param_name);
INSTANTIATE_TEST_SUITE_P(Shapes, RopeCuda, ::testing::ValuesIn(make_cases(true)), param_name);

// ---- the reference itself ----------------------------------------------------------------------------------
// The inverse is the transpose of the forward (<R x, y> = <x, R^T y>) for any cos and sin; for the cos/sin of a
// rotary module (one angle per pair) it undoes the forward.
TEST(RopeReference, InverseIsTheTransposeAndUndoesARotation) {
  for (Tables t : {Tables::kBT, Tables::k1T}) {
    RopeCase c{2, 3, 1, 5, 24, 16, DType::kFloat32, true, Layout::kBhtd, t};
    Inputs in(c, 5);
    const auto rq = reference(in, in.q, false);
    const auto rtq = reference(in, in.q, true);
    double lhs = 0, rhs = 0;
    for (size_t i = 0; i < rq.size(); ++i) {
      lhs += rq[i] * in.q.get(static_cast<int64_t>(i));
      rhs += in.q.get(static_cast<int64_t>(i)) * rtq[i];
    }
    EXPECT_NEAR(lhs, rhs, 1e-9 * (1 + std::abs(lhs)));
    if (t == Tables::k1T) {
      TestTensor back(DType::kFloat32, in.q.sizes());
      for (int64_t i = 0; i < in.q.numel(); ++i) back.set(i, static_cast<float>(rq[i]));
      const auto again = reference(in, back, true);
      for (int64_t i = 0; i < in.q.numel(); ++i) EXPECT_NEAR(again[i], in.q.get(i), 1e-5);
    }
  }
}

// ---- positions out of range ----------------------------------------------------------------------------------
TEST(RopePositions, OutOfRangeRaisesOnTheCpuAndGivesNanOnTheGpu) {
  RopeCase c{1, 2, 1, 4, 16, 8, DType::kFloat32, true, Layout::kBhtd, Tables::kPos64};
  Inputs in(c, 3);
  in.pos.set_index(2, in.n_pos);  // one past the table
  in.pos.set_index(3, -1);
  const std::string msg = error_of([&] { run(in, false, false, {}); });
  EXPECT_NE(msg.find("position_ids: expected values in [0, 9)"), std::string::npos) << msg;
  if (!has_gpu()) return;
  const auto [qo, ko] = run(in, true, false, {});
  for (int64_t hd = 0; hd < 2; ++hd)
    for (int64_t t = 0; t < 4; ++t)
      for (int64_t j = 0; j < 16; ++j) {
        const double v = qo[(hd * 4 + t) * 16 + j];
        if (j >= 8) {
          EXPECT_EQ(v, in.q.get((hd * 4 + t) * 16 + j));  // pass-through
        } else {
          EXPECT_EQ(std::isnan(v), t >= 2) << "head " << hd << " token " << t << " channel " << j;
        }
      }
}

// ---- element offsets past 2^31 -------------------------------------------------------------------------------
// Heads 716e6 elements apart: head 3 starts at element 2.1e9. GPU only (the view spans 4.3 GB); against the CPU
// backend on a compact copy.
TEST(RopeLarge, OffsetsBeyondInt32) {
  LOGITLESS_SKIP_WITHOUT_GPU();
  const int64_t H = 4, T = 2, D = 128, S = 716000000;
  const DType bf = DType::kBFloat16;
  TestTensor q(bf, {1, H, T, D}, {H * S, S, D, 1}), qc(bf, {1, H, T, D}), cos(bf, {T, D}), sin(bf, {T, D});
  qc.fill_normal(1, 1.f);
  for (int64_t i = 0; i < qc.numel(); ++i) q.set(i, qc.get(i));
  for (int64_t i = 0; i < T * D; ++i) cos.set(i, std::cos(0.01f * i)), sin.set(i, std::sin(0.01f * i));
  TestTensor out(bf, {1, H, T, D}), outc(bf, {1, H, T, D});
  for (TestTensor* t : {&q, &cos, &sin, &out}) t->to_device();
  rope_apply(q.view(true), {}, cos.view(true), sin.view(true), {}, {}, out.view(true), {}, nullptr);
  rope_apply(q.view(true), {}, cos.view(true), sin.view(true), {}, {}, q.view(true), {}, nullptr);  // in place
  device_synchronize();
  out.to_host();
  q.to_host();
  rope_apply(qc.host_view(), {}, cos.host_view(), sin.host_view(), {}, {}, outc.host_view(), {}, nullptr);
  expect_close(values(out), values(outc), bf, "q_out");
  expect_close(values(q), values(outc), bf, "q in place");
}

// ---- the launch plan ---------------------------------------------------------------------------------------
rope::Plan plan(int64_t tokens, int64_t heads, int64_t d, int64_t dr, int es, bool aligned,
                RopeAlgo algo = RopeAlgo::kAuto) {
  rope::PlanInputs in;
  in.tokens = tokens;
  in.heads = heads;
  in.head_dim = d;
  in.rot_dim = dr;
  in.elem_bytes = es;
  in.vector_ok = aligned;
  in.requested = algo;
  return rope::plan_rope(in);
}

TEST(RopePlan, Decisions) {
  // Llama-3-8B: 32 + 8 heads of 128 bf16 channels, 8 pairs of vectors a head: 8 x 20 threads, two heads each, one
  // token a CTA.
  rope::Plan p = plan(16384, 40, 128, 128, 2, true);
  EXPECT_TRUE(p.vector);
  EXPECT_EQ(p.pair_units, 8);
  EXPECT_EQ(p.pass_units, 0);
  EXPECT_EQ(p.x, 8);
  EXPECT_EQ(p.y, 20);
  EXPECT_EQ(p.z, 1);
  EXPECT_EQ(p.grid, 16384);
  // float32: 16 pairs of vectors; 14 head lanes take the 40 heads in three steps.
  rope::Plan f = plan(16384, 40, 128, 128, 4, true);
  EXPECT_EQ(f.x, 16);
  EXPECT_EQ(f.y, 14);
  // Partial rotary (Phi-2: 32 of 80 channels): 2 pairs of vectors and 6 pass-through vectors a head; small CTAs
  // of one token take several tokens.
  rope::Plan ph = plan(4096, 64, 80, 32, 2, true);
  EXPECT_TRUE(ph.vector);
  EXPECT_EQ(ph.pair_units, 2);
  EXPECT_EQ(ph.pass_units, 6);
  EXPECT_EQ(ph.x, 2);
  EXPECT_EQ(ph.y * 2, 64);
  EXPECT_EQ(ph.z, 4);
  EXPECT_EQ(ph.grid, 1024);
  // Halves that are not whole vectors, or misaligned tensors: the scalar kernel (an error if vectors were asked for).
  EXPECT_FALSE(plan(64, 8, 64, 12, 2, true).vector);
  EXPECT_EQ(plan(64, 8, 64, 12, 2, true).pair_units, 6);
  EXPECT_NE(plan(64, 8, 64, 12, 2, true, RopeAlgo::kVector).why_not, nullptr);
  EXPECT_FALSE(plan(64, 8, 128, 128, 2, false).vector);
  EXPECT_FALSE(plan(64, 8, 128, 128, 2, true, RopeAlgo::kScalar).vector);
  // A single head: one step.
  EXPECT_EQ(plan(10, 1, 128, 128, 2, true).y, 1);
}

TEST(RopePlan, InvariantsForEveryShape) {
  for (int es : {2, 4})
    for (bool aligned : {false, true})
      for (int64_t heads : {1, 2, 3, 6, 8, 40, 41, 96, 257})
        for (int64_t d = 2; d <= 512; d += 2)
          for (int64_t dr : {d, d / 2 / 2 * 2, int64_t{2}}) {
            if (dr < 2) continue;
            const rope::Plan p = plan(1000, heads, d, dr, es, aligned);
            SCOPED_TRACE(testing::Message() << "heads " << heads << " D " << d << " Dr " << dr << " es " << es);
            ASSERT_EQ(p.why_not, nullptr);
            ASSERT_GE(p.x, 1);
            ASSERT_LE(p.x, rope::kMaxPairLanes);
            ASSERT_LE(p.threads(), rope::kMaxThreads);
            ASSERT_LE(p.z, 64);                                 // blockDim.z's hardware limit
            ASSERT_GE(p.y * ((heads + p.y - 1) / p.y), heads);  // the lanes cover the heads
            ASSERT_LE(p.y, heads);
            const int64_t unit = p.vector ? 16 / es : 1;
            ASSERT_EQ(p.pair_units * unit, dr / 2);
            ASSERT_EQ(p.pass_units * unit, d - dr);
            ASSERT_EQ(p.grid, (1000 + p.z - 1) / p.z);
          }
}

// ---- bad input ---------------------------------------------------------------------------------------------
#define EXPECT_MSG(msg, needle) EXPECT_NE((msg).find(needle), std::string::npos) << (msg)

TEST(RopeErrors, NamesTheArgumentWithExpectedAndGot) {
  const DType bf = DType::kBFloat16;
  TestTensor q(bf, {2, 4, 3, 16}), k(bf, {2, 2, 3, 16}), qo(bf, {2, 4, 3, 16}), ko(bf, {2, 2, 3, 16}),
      cos(bf, {2, 3, 16}), sin(bf, {2, 3, 16});
  auto call = [&](const TensorView& a, const TensorView& b, const TensorView& c, const TensorView& s,
                  const TensorView& p, const TensorView& ao,
                  const TensorView& bo) { return error_of([&] { rope_apply(a, b, c, s, p, {}, ao, bo, nullptr); }); };
  const TensorView qv = q.host_view(), kv = k.host_view(), qov = qo.host_view(), kov = ko.host_view(),
                   cv = cos.host_view(), sv = sin.host_view();
  EXPECT_EQ(call(qv, kv, cv, sv, {}, qov, kov), "");
  EXPECT_EQ(call(qv, kv, cv, sv, {}, qv, kv), "");  // in place
  TestTensor k3(bf, {2, 2, 3, 8}), kh(DType::kFloat16, {2, 2, 3, 16}), q3(bf, {2, 4, 16});
  EXPECT_MSG(call(qv, k3.host_view(), cv, sv, {}, qov, kov), "k: expected shape [2, H, 3, 16] (q's B, T, D)");
  EXPECT_MSG(call(qv, kh.host_view(), cv, sv, {}, qov, kov), "k: expected dtype bfloat16 (q's), got float16");
  EXPECT_MSG(call(q3.host_view(), {}, cv, sv, {}, q3.host_view(), {}), "q: expected 4 dimensions");
  EXPECT_MSG(call(qv, kv, cv, sv, {}, qov, {}), "k_out: expected a tensor (k was given)");
  TestTensor c7(bf, {2, 3, 7}), c18(bf, {2, 3, 18}), cf(DType::kFloat16, {2, 3, 16}), c5(bf, {2, 5, 16});
  EXPECT_MSG(call(qv, kv, c7.host_view(), c7.host_view(), {}, qov, kov),
             "cos: expected a last dimension (the rotary width) that is even");
  EXPECT_MSG(call(qv, kv, c18.host_view(), c18.host_view(), {}, qov, kov), "in [2, 16]");
  EXPECT_MSG(call(qv, kv, cf.host_view(), cf.host_view(), {}, qov, kov),
             "cos: expected dtype bfloat16 (q's) or float32");
  EXPECT_MSG(call(qv, kv, cv, cf.host_view(), {}, qov, kov), "sin: expected dtype bfloat16 (cos's)");
  EXPECT_MSG(call(qv, kv, c5.host_view(), c5.host_view(), {}, qov, kov),
             "cos: expected shape [2, 3, Dr], [1, 3, Dr] or [3, Dr]");
  TestTensor table(bf, {10, 16}), pos(DType::kInt64, {2, 3}), posf(DType::kFloat32, {2, 3}),
      pos4(DType::kInt64, {2, 4});
  EXPECT_EQ(call(qv, kv, table.host_view(), table.host_view(), pos.host_view(), qov, kov), "");
  EXPECT_MSG(call(qv, kv, table.host_view(), table.host_view(), posf.host_view(), qov, kov),
             "position_ids: expected dtype int32 or int64");
  EXPECT_MSG(call(qv, kv, table.host_view(), table.host_view(), pos4.host_view(), qov, kov),
             "position_ids: expected shape [2, 3]");
  EXPECT_MSG(call(qv, kv, cv, sv, pos.host_view(), qov, kov), "cos: expected shape [P, Dr]");
  // Outputs: in place over the matching input only.
  EXPECT_MSG(call(qv, kv, cv, sv, {}, qov, qov), "k_out: expected shape [2, 2, 3, 16]");
  EXPECT_MSG(call(qv, kv, cv, sv, {}, kv, kov), "q_out: expected shape [2, 4, 3, 16]");
  TensorView shifted = qv;
  shifted.data = static_cast<char*>(shifted.data) + 2;
  shifted.sizes[3] = 15;
  TensorView q15 = qv;
  q15.sizes[3] = 15;
  TestTensor c14(bf, {2, 3, 14});
  EXPECT_MSG(call(q15, {}, c14.host_view(), c14.host_view(), {}, shifted, {}),
             "q_out: expected q itself (in place) or memory that does not overlap q");
  EXPECT_MSG(call(qv, kv, cv, sv, {}, qov, cv), "k_out: expected shape");
  TensorView bcast = qov;
  bcast.strides[1] = 0;
  EXPECT_MSG(call(qv, kv, cv, sv, {}, bcast, kov), "q_out: expected rows of D elements that do not overlap");
}

}  // namespace
}  // namespace logitless::test
