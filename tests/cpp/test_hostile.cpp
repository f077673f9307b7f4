// Hostile input to the public C++ API (include/logitless/*.h).
//
// Part 1, malformed calls: for every entry point, each tensor argument in turn gets a null data pointer, a negative
// size or stride, sizes or strides whose products overflow int64, a misaligned pointer, an unknown dtype or device
// code, too many dimensions, a dtype no op takes, another device, another rank; and the workspace is made too small,
// null or misaligned where the call needs one. Each must raise an invalid-argument Error whose message begins with
// the argument's name, before anything is written: every tensor of the call, inputs and poisoned outputs alike, is
// compared byte for byte afterwards. The unmutated call must succeed, so every rejection is the mutation's.
//
// Part 2, NaN and inf in each float input of each op: the documented result (include/logitless/*.h), against a
// float64 reference wherever that result is finite.
//
// Part 3, on a GPU (skipped without one): a real device mismatch, another device's stream, an invisible device, and
// CUDA workspaces that are too small, null or misaligned.
//
// Inputs are drawn from a seed fresh per process (LOGITLESS_TEST_SEED overrides it), printed with every failure.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "test_util.h"

#if defined(LOGITLESS_WITH_CUDA)
#include <cuda_runtime.h>
#endif

namespace logitless::test {
namespace {

// A fresh stream of draws for one test: the process seed mixed with the test's own salt.
struct Draw {
  std::mt19937_64 rng;
  uint64_t next_seed;
  explicit Draw(uint64_t salt) : rng(fresh_seed() ^ (salt * 0x9E3779B97F4A7C15ull)), next_seed(rng()) {}
  int64_t index(int64_t n) { return std::uniform_int_distribution<int64_t>(0, n - 1)(rng); }
  double uniform(double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(rng); }
  // A float tensor of N(0, stddev^2) values.
  TestTensor normal(DType dt, std::vector<int64_t> sizes, float stddev = 1.f) {
    TestTensor t(dt, std::move(sizes));
    t.fill_normal(next_seed++, stddev);
    return t;
  }
  TestTensor uniform_tensor(std::vector<int64_t> sizes, double lo, double hi) {
    TestTensor t(DType::kFloat32, std::move(sizes));
    for (int64_t i = 0; i < t.numel(); ++i) t.set(i, static_cast<float>(uniform(lo, hi)));
    return t;
  }
  TestTensor indices(DType dt, std::vector<int64_t> sizes, int64_t n) {
    TestTensor t(dt, std::move(sizes));
    for (int64_t i = 0; i < t.numel(); ++i) t.set_index(i, index(n));
    return t;
  }
};

TestTensor poisoned(DType dt, std::vector<int64_t> sizes) {
  TestTensor t(dt, std::move(sizes));
  t.fill_storage_nan();
  return t;
}

std::vector<uint8_t> bytes_of(const TestTensor& t) {
  const auto* p = static_cast<const uint8_t*>(t.host_view().data);
  return std::vector<uint8_t>(p, p + t.storage_elems() * dtype_size(t.dtype()));
}

// ---- part 1: malformed calls ----------------------------------------------------------------------------------

struct Arg {
  std::string name;
  std::unique_ptr<TestTensor> t;
  bool primary = false;     // every other tensor's device is checked against this one's: no device mutation
  bool fixed_rank = false;  // another rank (one more dimension, or none) is rejected naming it
  bool output = false;      // written by the call: it may share memory with no other argument
};

using Views = std::map<std::string, TensorView>;

// One entry point with valid CPU arguments. `call` takes the (possibly mutated) views by name; an argument the
// call does not get is simply absent from `args`.
struct Call {
  std::string name;
  std::vector<Arg> args;
  std::vector<uint64_t> ws_store;  // 16-byte aligned host scratch (the CPU steps' accumulators)
  Workspace ws;
  std::function<void(const Views&, Workspace)> fn;

  void add(const std::string& n, TestTensor t, bool primary = false, bool fixed_rank = false) {
    args.push_back(Arg{n, std::make_unique<TestTensor>(std::move(t)), primary, fixed_rank, false});
  }
  void out(const std::string& n, TestTensor t, bool fixed_rank = false) {
    args.push_back(Arg{n, std::make_unique<TestTensor>(std::move(t)), false, fixed_rank, true});
  }
  Views views() const {
    Views v;
    for (const Arg& a : args) v[a.name] = a.t->host_view();
    return v;
  }
  void workspace(size_t bytes) {
    ws_store.assign((bytes + 7) / 8 + 2, 0);
    ws = Workspace{ws_store.data(), bytes};
  }
};

const TensorView& at(const Views& v, const char* name) {
  static const TensorView none;
  const auto it = v.find(name);
  return it == v.end() ? none : it->second;
}

struct Mutation {
  const char* what;
  std::function<bool(TensorView&, const Arg&)> apply;  // false: does not apply to this argument
};

int first_stepping_dim(const TensorView& t) {
  for (int d = 0; d < t.ndim; ++d)
    if (t.sizes[d] > 1 && t.strides[d] > 0) return d;
  return -1;
}

const std::vector<Mutation>& mutations() {
  static const std::vector<Mutation> m = {
      {"null data", [](TensorView& t, const Arg&) { return t.numel() > 0 ? (t.data = nullptr, true) : false; }},
      {"negative size", [](TensorView& t, const Arg&) { return t.ndim >= 1 ? (t.sizes[0] = -1, true) : false; }},
      {"negative stride",
       [](TensorView& t, const Arg&) {
         const int d = first_stepping_dim(t);
         return d >= 0 ? (t.strides[d] = -t.strides[d], true) : false;
       }},
      {"sizes whose product overflows",
       [](TensorView& t, const Arg&) {
         if (t.ndim >= 2) {
           t.sizes[0] = t.sizes[1] = int64_t{1} << 40;
         } else if (t.ndim == 1) {
           t.sizes[0] = int64_t{1} << 62;
           t.strides[0] = 8;
         } else {
           return false;
         }
         return true;
       }},
      {"a stride whose extent overflows",
       [](TensorView& t, const Arg&) {
         const int d = first_stepping_dim(t);
         return d >= 0 ? (t.strides[d] = std::numeric_limits<int64_t>::max() / 2 + 1, true) : false;
       }},
      {"misaligned pointer",
       [](TensorView& t, const Arg&) {
         if (!t.data || dtype_size(t.dtype) == 1) return false;
         t.data = static_cast<char*>(t.data) + 1;
         return true;
       }},
      {"unknown dtype code", [](TensorView& t, const Arg&) { return t.dtype = static_cast<DType>(99), true; }},
      {"float64 (no op takes it)", [](TensorView& t, const Arg&) { return t.dtype = DType::kFloat64, true; }},
      {"unknown device type",
       [](TensorView& t, const Arg&) { return t.device.type = static_cast<DeviceType>(7), true; }},
      {"negative CUDA ordinal", [](TensorView& t, const Arg&) { return t.device = Device{DeviceType::kCUDA, -1}, true; }},
      {"nine dimensions",
       [](TensorView& t, const Arg&) {
         for (int d = t.ndim; d < kMaxDims; ++d) t.sizes[d] = 1, t.strides[d] = 1;
         t.ndim = kMaxDims + 1;
         return true;
       }},
      {"another device (the rest on the CPU)",
       [](TensorView& t, const Arg& a) { return a.primary ? false : (t.device = Device{DeviceType::kCUDA, 0}, true); }},
      {"one more dimension",
       [](TensorView& t, const Arg& a) {
         if (!a.fixed_rank || t.ndim >= kMaxDims) return false;
         t.sizes[t.ndim] = 1;
         t.strides[t.ndim] = 1;
         ++t.ndim;
         return true;
       }},
      {"no dimensions", [](TensorView& t, const Arg& a) { return a.fixed_rank ? (t.ndim = 0, true) : false; }},
  };
  return m;
}

// Runs `fn` expecting an invalid-argument Error that names `arg` (or `arg2`, when given), with every tensor of `c`
// unchanged.
void expect_rejected(const Call& c, const std::string& arg, const std::string& what, const std::function<void()>& fn,
                     const std::string& arg2 = "") {
  SCOPED_TRACE(c.name + ": " + arg + " with " + what);
  std::vector<std::vector<uint8_t>> before;
  for (const Arg& a : c.args) before.push_back(bytes_of(*a.t));
  Error::Kind kind = Error::Kind::kRuntime;
  std::string msg;
  try {
    fn();
  } catch (const Error& e) {
    msg = e.what();
    kind = e.kind();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "raised a " << typeid(e).name() << " (not logitless::Error): " << e.what();
    return;
  }
  ASSERT_FALSE(msg.empty()) << "accepted";
  EXPECT_EQ(kind, Error::Kind::kInvalidArgument) << msg;
  EXPECT_TRUE(msg.rfind(arg + ":", 0) == 0 || (!arg2.empty() && msg.rfind(arg2 + ":", 0) == 0))
      << "the message does not begin with '" << arg << ":'" << (arg2.empty() ? "" : " or '" + arg2 + ":'") << ": "
      << msg;
  for (size_t i = 0; i < c.args.size(); ++i)
    EXPECT_TRUE(bytes_of(*c.args[i].t) == before[i]) << c.args[i].name << " was written";
}

void run_hostile(Call& c) {
  LOGITLESS_TRACE_SEED();
  // The unmutated call succeeds: whatever follows is the mutation's doing.
  {
    SCOPED_TRACE(c.name + ": the valid call");
    const std::string err = error_of([&] { c.fn(c.views(), c.ws); });
    ASSERT_EQ(err, "") << "the valid call raised";
  }
  for (const Arg& a : c.args) {
    for (const Mutation& m : mutations()) {
      Views v = c.views();
      if (!m.apply(v[a.name], a)) continue;
      expect_rejected(c, a.name, m.what, [&] { c.fn(v, c.ws); });
    }
    // Every tensor on cuda:0 but this one on cuda:1 (validation precedes any device use: no GPU needed).
    if (!a.primary) {
      Views v = c.views();
      for (auto& kv : v) kv.second.device = Device{DeviceType::kCUDA, 0};
      v[a.name].device = Device{DeviceType::kCUDA, 1};
      expect_rejected(c, a.name, "cuda:1 while the rest are on cuda:0", [&] { c.fn(v, c.ws); });
    }
  }
  // An output over another argument's memory (the same view of the same dtype excepted: where an op takes that in
  // place, as a gradient over the logits, it is valid). Two outputs: either may be named.
  for (const Arg& o : c.args) {
    if (!o.output) continue;
    for (const Arg& a : c.args) {
      if (&a == &o || a.t->numel() == 0) continue;
      Views v = c.views();
      TensorView& ov = v[o.name];
      const TensorView& av = v[a.name];
      bool same = ov.dtype == av.dtype && ov.ndim == av.ndim;
      for (int d = 0; same && d < ov.ndim; ++d) same = ov.sizes[d] == av.sizes[d] && ov.strides[d] == av.strides[d];
      if (same) continue;
      ov.data = av.data;
      if (reinterpret_cast<uintptr_t>(ov.data) % dtype_size(ov.dtype) != 0) continue;
      expect_rejected(c, o.name, "the memory of " + a.name, [&] { c.fn(v, c.ws); }, a.output ? a.name : "");
    }
  }
  if (c.ws.bytes > 0) {
    const Workspace small{c.ws.data, c.ws.bytes - 1}, null{nullptr, c.ws.bytes},
        misaligned{static_cast<char*>(c.ws.data) + 8, c.ws.bytes};
    expect_rejected(c, "workspace", "one byte too few", [&] { c.fn(c.views(), small); });
    expect_rejected(c, "workspace", "a null pointer", [&] { c.fn(c.views(), null); });
    expect_rejected(c, "workspace", "a pointer 8 bytes off 16", [&] { c.fn(c.views(), misaligned); });
  }
}

// ---- the entry points -----------------------------------------------------------------------------------------

constexpr int64_t kN = 6, kV = 11, kH = 8, kB = 2, kL = 3;

CrossEntropyOptions ce_opts(Reduction r = Reduction::kMean) {
  CrossEntropyOptions o;
  o.reduction = r;
  o.z_loss = 1e-3;
  return o;
}

Call ce_call(const std::string& which, Draw& d) {
  Call c;
  c.name = "cross_entropy_" + which;
  const bool shard = which.rfind("shard_", 0) == 0;
  const int64_t Vr = shard ? 5 : kV;  // a shard: classes [4, 9) of kV
  const VocabShard vs{4, kV};
  if (which != "shard_finalize") c.add("logits", d.normal(DType::kFloat32, {kN, Vr}), true);
  // finalize: target is what every other tensor is checked against, and any shape of it is N rows.
  c.add("target", d.indices(DType::kInt64, {kN}, kV), which == "shard_finalize", which != "shard_finalize");
  c.add("weight", d.uniform_tensor({kV}, 0.5, 2.0), false, true);
  if (which == "forward" || which == "forward_backward" || which == "shard_finalize") {
    c.out("loss", poisoned(DType::kFloat32, {}));
    c.out("lse", poisoned(DType::kFloat32, {kN}));
    c.out("z_loss", poisoned(DType::kFloat32, {kN}));
  }
  if (which == "forward_backward") c.add("grad_scale", d.normal(DType::kFloat32, {}));
  if (which == "backward" || which == "shard_backward") {
    c.add("lse", d.normal(DType::kFloat32, {kN}));
    c.add("grad_loss", d.normal(DType::kFloat32, {}));
  }
  if (which == "forward_backward" || which == "backward" || which == "shard_backward")
    c.out("grad_logits", poisoned(DType::kFloat32, {kN, Vr}));
  if (which == "shard_partials") c.out("partials", poisoned(DType::kFloat32, {kN, kShardStats}));
  if (which == "shard_finalize") {
    TestTensor parts(DType::kFloat32, {2, kN, kShardStats});  // two shards' partials: finite statistics
    for (int64_t i = 0; i < parts.numel(); ++i) parts.set(i, i % 4 == 1 ? 1.5f : static_cast<float>(d.uniform(-1, 1)));
    c.add("partials", std::move(parts), false, true);
  }
  const CrossEntropyOptions o = ce_opts();
  c.fn = [which, o, vs](const Views& v, Workspace ws) {
    const auto& L = at(v, "logits");
    const auto& T = at(v, "target");
    const auto& W = at(v, "weight");
    if (which == "forward") {
      cross_entropy_forward(L, T, W, o, at(v, "loss"), at(v, "lse"), at(v, "z_loss"), ws, nullptr);
    } else if (which == "forward_backward") {
      cross_entropy_forward_backward(L, T, W, o, at(v, "loss"), at(v, "lse"), at(v, "z_loss"), at(v, "grad_logits"),
                                     at(v, "grad_scale"), ws, nullptr);
    } else if (which == "backward") {
      cross_entropy_backward(L, T, W, at(v, "lse"), at(v, "grad_loss"), o, at(v, "grad_logits"), ws, nullptr);
    } else if (which == "shard_partials") {
      cross_entropy_shard_partials(L, T, W, vs, o, at(v, "partials"), ws, nullptr);
    } else if (which == "shard_finalize") {
      cross_entropy_shard_finalize(at(v, "partials"), T, W, kV, o, at(v, "loss"), at(v, "lse"), at(v, "z_loss"), ws,
                                   nullptr);
    } else {
      cross_entropy_shard_backward(L, T, W, vs, at(v, "lse"), at(v, "grad_loss"), o, at(v, "grad_logits"), ws,
                                   nullptr);
    }
  };
  return c;
}

Call scale_rows_call(Draw& d) {
  Call c;
  c.name = "scale_rows";
  c.add("grad", d.normal(DType::kBFloat16, {kN, kV}), true);
  c.args.back().output = true;  // scaled in place
  c.add("scale", d.normal(DType::kFloat32, {kN}));
  c.fn = [](const Views& v, Workspace) { scale_rows(at(v, "grad"), at(v, "scale"), nullptr); };
  return c;
}

LinearCrossEntropyOptions lce_opts() {
  LinearCrossEntropyOptions o;
  o.z_loss = 1e-3;
  o.chunk_tokens = 4;  // the steps' agreed chunk
  return o;
}

Call lce_call(const std::string& which, Draw& d) {
  Call c;
  c.name = "linear_cross_entropy_" + which;
  const bool shard = which.rfind("shard_", 0) == 0;
  const int64_t Vr = shard ? 5 : kV;
  const VocabShard vs{4, kV};
  const DType dt = DType::kBFloat16;
  c.add("hidden", d.normal(dt, {kN, kH}), true);
  c.add("weight", d.normal(dt, {Vr, kH}), false, true);
  c.add("bias", d.normal(DType::kFloat32, {Vr}), false, true);
  c.add("target", d.indices(DType::kInt32, {kN}, kV), false, true);
  c.add("class_weight", d.uniform_tensor({kV}, 0.5, 2.0), false, true);
  const bool fwd = which == "forward" || which == "forward_backward" || which == "shard_step";
  const bool grads = which == "forward_backward" || which == "backward" || which == "shard_backward" ||
                     which == "shard_step";
  if (fwd) {
    c.out("loss", poisoned(DType::kFloat32, {}));
    c.out("lse", poisoned(DType::kFloat32, {kN}));
  }
  if (which == "backward" || which == "shard_backward") {
    c.add("lse", d.normal(DType::kFloat32, {kN}));
    c.add("grad_loss", d.normal(DType::kFloat32, {}));
  }
  if (grads) {
    c.out("grad_hidden", poisoned(DType::kFloat32, {kN, kH}), true);
    c.out("grad_weight", poisoned(dt, {Vr, kH}), true);
    c.out("grad_bias", poisoned(DType::kFloat32, {Vr}), true);
  }
  if (which == "forward_backward") c.add("grad_scale", d.normal(DType::kFloat32, {}));
  if (which == "shard_partials") c.out("partials", poisoned(DType::kFloat32, {kN, kShardStats}));
  if (which == "shard_step") {
    c.out("partials", poisoned(DType::kFloat32, {4, kShardStats}));  // chunk 0's rows
    const Views v = c.views();
    c.workspace(linear_cross_entropy_shard_steps(at(v, "hidden"), at(v, "weight"), at(v, "target"),
                                                 at(v, "grad_hidden"), at(v, "grad_weight"), at(v, "grad_bias"), vs,
                                                 lce_opts())
                    .workspace_bytes);
  }
  const LinearCrossEntropyOptions o = lce_opts();
  c.fn = [which, o, vs](const Views& v, Workspace ws) {
    const auto &X = at(v, "hidden"), &W = at(v, "weight"), &b = at(v, "bias"), &T = at(v, "target"),
               &cw = at(v, "class_weight");
    if (which == "forward") {
      linear_cross_entropy_forward(X, W, b, T, cw, o, at(v, "loss"), at(v, "lse"), ws, nullptr);
    } else if (which == "forward_backward") {
      linear_cross_entropy_forward_backward(X, W, b, T, cw, o, at(v, "loss"), at(v, "lse"), at(v, "grad_hidden"),
                                            at(v, "grad_weight"), at(v, "grad_bias"), at(v, "grad_scale"), ws,
                                            nullptr);
    } else if (which == "backward") {
      linear_cross_entropy_backward(X, W, b, T, cw, at(v, "lse"), at(v, "grad_loss"), o, at(v, "grad_hidden"),
                                    at(v, "grad_weight"), at(v, "grad_bias"), ws, nullptr);
    } else if (which == "shard_partials") {
      linear_cross_entropy_shard_partials(X, W, b, T, cw, vs, o, at(v, "partials"), ws, nullptr);
    } else if (which == "shard_backward") {
      linear_cross_entropy_shard_backward(X, W, b, T, cw, vs, at(v, "lse"), at(v, "grad_loss"), o,
                                          at(v, "grad_hidden"), at(v, "grad_weight"), at(v, "grad_bias"), ws,
                                          nullptr);
    } else {
      linear_cross_entropy_shard_forward_backward_step(ShardStep::kLogits, 0, at(v, "partials"), X, W, b, T, cw, vs, o,
                                                       at(v, "loss"), at(v, "lse"), at(v, "grad_hidden"),
                                                       at(v, "grad_weight"), at(v, "grad_bias"), ws, nullptr);
    }
  };
  return c;
}

PolicyLossOptions pl_opts() {
  PolicyLossOptions o;
  o.beta = 0.04;
  return o;
}

void add_token_inputs(Call& c, Draw& d) {
  c.add("completion_ids", d.indices(DType::kInt64, {kB, kL}, kV), false, true);
  c.add("advantages", d.normal(DType::kFloat32, {kB}), false, true);
  TestTensor mask(DType::kFloat32, {kB, kL});
  for (int64_t i = 0; i < mask.numel(); ++i) mask.set(i, i % 3 == 2 ? 0.f : 1.f);
  c.add("completion_mask", std::move(mask), false, true);
  c.add("old_logp", d.uniform_tensor({kB, kL}, -4.0, -1.0), false, true);
  c.add("ref_logp", d.uniform_tensor({kB, kL}, -4.0, -1.0), false, true);
}

void add_policy_outputs(Call& c) {
  c.out("loss", poisoned(DType::kFloat32, {}));
  for (const char* n : {"per_token_loss", "kl", "logp", "entropy", "lse"})
    c.out(n, poisoned(DType::kFloat32, {kB, kL}));
  TestTensor clipped(DType::kBool, {kB, kL});
  clipped.fill_storage_bytes(0xA5);
  c.out("is_clipped", std::move(clipped));
}

PolicyLossOutputs policy_outputs(const Views& v) {
  PolicyLossOutputs out;
  out.loss = at(v, "loss");
  out.per_token_loss = at(v, "per_token_loss");
  out.kl = at(v, "kl");
  out.is_clipped = at(v, "is_clipped");
  out.logp = at(v, "logp");
  out.entropy = at(v, "entropy");
  out.lse = at(v, "lse");
  return out;
}

Call pl_call(const std::string& which, Draw& d) {
  Call c;
  c.name = "policy_loss_" + which;
  c.add("logits", d.normal(DType::kFloat16, {kB, kL + 1, kV}), true);
  add_token_inputs(c, d);
  add_policy_outputs(c);
  if (which == "forward_backward") {
    c.out("grad_logits", poisoned(DType::kFloat16, {kB, kL + 1, kV}), true);
    c.add("grad_scale", d.normal(DType::kFloat32, {}));
  }
  const PolicyLossOptions o = pl_opts();
  c.fn = [which, o](const Views& v, Workspace ws) {
    PolicyLossInputs in;
    in.logits = at(v, "logits");
    in.completion_ids = at(v, "completion_ids");
    in.advantages = at(v, "advantages");
    in.completion_mask = at(v, "completion_mask");
    in.old_logp = at(v, "old_logp");
    in.ref_logp = at(v, "ref_logp");
    if (which == "forward") {
      policy_loss_forward(in, o, policy_outputs(v), ws, nullptr);
    } else {
      policy_loss_forward_backward(in, o, policy_outputs(v), at(v, "grad_logits"), at(v, "grad_scale"), ws, nullptr);
    }
  };
  return c;
}

Call sls_call(const std::string& which, Draw& d) {
  Call c;
  c.name = "selective_log_softmax_" + which;
  c.add("logits", d.normal(DType::kFloat32, {kN, kV}), true);
  c.add("ids", d.indices(DType::kInt32, {kN}, kV), false, true);
  if (which == "forward") {
    for (const char* n : {"logp", "entropy", "lse"}) c.out(n, poisoned(DType::kFloat32, {kN}));
  } else {
    c.add("lse", d.normal(DType::kFloat32, {kN}));
    c.add("grad_logp", d.normal(DType::kFloat32, {kN}));
    c.out("grad_logits", poisoned(DType::kFloat32, {kN, kV}), true);
  }
  SelectiveLogSoftmaxOptions o;
  c.fn = [which, o](const Views& v, Workspace ws) {
    if (which == "forward") {
      selective_log_softmax_forward(at(v, "logits"), at(v, "ids"), o, at(v, "logp"), at(v, "entropy"), at(v, "lse"),
                                    ws, nullptr);
    } else {
      selective_log_softmax_backward(at(v, "logits"), at(v, "ids"), at(v, "lse"), at(v, "grad_logp"), o,
                                     at(v, "grad_logits"), ws, nullptr);
    }
  };
  return c;
}

Call lpl_call(const std::string& which, Draw& d) {
  Call c;
  c.name = "linear_policy_loss_" + which;
  c.add("hidden", d.normal(DType::kFloat32, {kB, kL + 1, kH}), true);
  c.add("weight", d.normal(DType::kFloat32, {kV, kH}), false, true);
  c.add("bias", d.normal(DType::kFloat32, {kV}), false, true);
  add_token_inputs(c, d);
  if (which != "backward") add_policy_outputs(c);
  if (which == "backward") {
    c.add("logp", d.uniform_tensor({kB, kL}, -4.0, -1.0));
    c.add("lse", d.normal(DType::kFloat32, {kB, kL}));
    c.add("grad_loss", d.normal(DType::kFloat32, {}));
  }
  if (which != "forward") {
    c.out("grad_hidden", poisoned(DType::kFloat32, {kB, kL + 1, kH}), true);
    c.out("grad_weight", poisoned(DType::kFloat32, {kV, kH}), true);
    c.out("grad_bias", poisoned(DType::kFloat32, {kV}), true);
  }
  if (which == "forward_backward") c.add("grad_scale", d.normal(DType::kFloat32, {}));
  LinearPolicyLossOptions o;
  o.policy = pl_opts();
  c.fn = [which, o](const Views& v, Workspace ws) {
    LinearPolicyLossInputs in;
    in.hidden = at(v, "hidden");
    in.weight = at(v, "weight");
    in.bias = at(v, "bias");
    in.completion_ids = at(v, "completion_ids");
    in.advantages = at(v, "advantages");
    in.completion_mask = at(v, "completion_mask");
    in.old_logp = at(v, "old_logp");
    in.ref_logp = at(v, "ref_logp");
    LinearPolicyLossGrads g{at(v, "grad_hidden"), at(v, "grad_weight"), at(v, "grad_bias")};
    if (which == "forward") {
      linear_policy_loss_forward(in, o, policy_outputs(v), ws, nullptr);
    } else if (which == "forward_backward") {
      linear_policy_loss_forward_backward(in, o, policy_outputs(v), g, at(v, "grad_scale"), ws, nullptr);
    } else {
      linear_policy_loss_backward(in, o, at(v, "logp"), at(v, "lse"), at(v, "grad_loss"), g, ws, nullptr);
    }
  };
  return c;
}

Call lsls_call(const std::string& which, Draw& d) {
  Call c;
  c.name = "linear_selective_log_softmax_" + which;
  c.add("hidden", d.normal(DType::kFloat16, {kN, kH}), true);
  c.add("weight", d.normal(DType::kFloat16, {kV, kH}), false, true);
  c.add("bias", d.normal(DType::kFloat16, {kV}), false, true);
  c.add("ids", d.indices(DType::kInt64, {kN}, kV), false, true);
  if (which == "forward") {
    for (const char* n : {"logp", "entropy", "lse"}) c.out(n, poisoned(DType::kFloat32, {kN}));
  } else {
    c.add("lse", d.normal(DType::kFloat32, {kN}));
    c.add("grad_logp", d.normal(DType::kFloat32, {kN}));
    c.out("grad_hidden", poisoned(DType::kFloat16, {kN, kH}), true);
    c.out("grad_weight", poisoned(DType::kFloat32, {kV, kH}), true);
    c.out("grad_bias", poisoned(DType::kFloat16, {kV}), true);
  }
  LinearSelectiveLogSoftmaxOptions o;
  c.fn = [which, o](const Views& v, Workspace ws) {
    if (which == "forward") {
      linear_selective_log_softmax_forward(at(v, "hidden"), at(v, "weight"), at(v, "bias"), at(v, "ids"), o,
                                           at(v, "logp"), at(v, "entropy"), at(v, "lse"), ws, nullptr);
    } else {
      LinearPolicyLossGrads g{at(v, "grad_hidden"), at(v, "grad_weight"), at(v, "grad_bias")};
      linear_selective_log_softmax_backward(at(v, "hidden"), at(v, "weight"), at(v, "bias"), at(v, "ids"),
                                            at(v, "lse"), at(v, "grad_logp"), o, g, ws, nullptr);
    }
  };
  return c;
}

Call rms_call(const std::string& which, Draw& d) {
  Call c;
  c.name = "rms_norm_" + which;
  const DType dt = DType::kBFloat16;
  if (which == "forward") {
    c.add("x", d.normal(dt, {kN, kH}), true);
    c.add("residual", d.normal(dt, {kN, kH}));
    c.add("weight", d.normal(DType::kFloat32, {kH}), false, true);
    c.out("y", poisoned(dt, {kN, kH}));
    c.out("residual_out", poisoned(dt, {kN, kH}));
    c.out("rstd", poisoned(DType::kFloat32, {kN}));
  } else {
    c.add("grad_y", d.normal(dt, {kN, kH}), true);
    c.add("grad_residual_out", d.normal(dt, {kN, kH}));
    c.add("x", d.normal(dt, {kN, kH}));
    c.add("weight", d.normal(dt, {kH}), false, true);
    TestTensor rstd(DType::kFloat32, {kN});
    for (int64_t i = 0; i < kN; ++i) rstd.set(i, static_cast<float>(d.uniform(0.5, 2.0)));
    c.add("rstd", std::move(rstd));
    c.out("grad_x", poisoned(dt, {kN, kH}));
    c.out("grad_weight", poisoned(DType::kFloat32, {kH}), true);
  }
  RMSNormOptions o;
  c.fn = [which, o](const Views& v, Workspace ws) {
    if (which == "forward") {
      rms_norm_forward(at(v, "x"), at(v, "residual"), at(v, "weight"), o, at(v, "y"), at(v, "residual_out"),
                       at(v, "rstd"), ws, nullptr);
    } else {
      rms_norm_backward(at(v, "grad_y"), at(v, "grad_residual_out"), at(v, "x"), at(v, "weight"), at(v, "rstd"), o,
                        at(v, "grad_x"), at(v, "grad_weight"), ws, nullptr);
    }
  };
  return c;
}

struct EntryCase {
  const char* name;
  std::function<Call(Draw&)> make;
};

const std::vector<EntryCase>& entry_cases() {
  static const std::vector<EntryCase> e = {
      {"ce_forward", [](Draw& d) { return ce_call("forward", d); }},
      {"ce_forward_backward", [](Draw& d) { return ce_call("forward_backward", d); }},
      {"ce_backward", [](Draw& d) { return ce_call("backward", d); }},
      {"ce_shard_partials", [](Draw& d) { return ce_call("shard_partials", d); }},
      {"ce_shard_finalize", [](Draw& d) { return ce_call("shard_finalize", d); }},
      {"ce_shard_backward", [](Draw& d) { return ce_call("shard_backward", d); }},
      {"scale_rows", [](Draw& d) { return scale_rows_call(d); }},
      {"lce_forward", [](Draw& d) { return lce_call("forward", d); }},
      {"lce_forward_backward", [](Draw& d) { return lce_call("forward_backward", d); }},
      {"lce_backward", [](Draw& d) { return lce_call("backward", d); }},
      {"lce_shard_partials", [](Draw& d) { return lce_call("shard_partials", d); }},
      {"lce_shard_backward", [](Draw& d) { return lce_call("shard_backward", d); }},
      {"lce_shard_step", [](Draw& d) { return lce_call("shard_step", d); }},
      {"policy_forward", [](Draw& d) { return pl_call("forward", d); }},
      {"policy_forward_backward", [](Draw& d) { return pl_call("forward_backward", d); }},
      {"selective_forward", [](Draw& d) { return sls_call("forward", d); }},
      {"selective_backward", [](Draw& d) { return sls_call("backward", d); }},
      {"linear_policy_forward", [](Draw& d) { return lpl_call("forward", d); }},
      {"linear_policy_forward_backward", [](Draw& d) { return lpl_call("forward_backward", d); }},
      {"linear_policy_backward", [](Draw& d) { return lpl_call("backward", d); }},
      {"linear_selective_forward", [](Draw& d) { return lsls_call("forward", d); }},
      {"linear_selective_backward", [](Draw& d) { return lsls_call("backward", d); }},
      {"rms_norm_forward", [](Draw& d) { return rms_call("forward", d); }},
      {"rms_norm_backward", [](Draw& d) { return rms_call("backward", d); }},
  };
  return e;
}

class HostileCall : public ::testing::TestWithParam<int> {};

TEST_P(HostileCall, EveryMalformedArgumentIsNamedAndNothingIsWritten) {
  Draw d(static_cast<uint64_t>(GetParam()) + 1);
  Call c = entry_cases()[GetParam()].make(d);
  run_hostile(c);
}

INSTANTIATE_TEST_SUITE_P(EntryPoints, HostileCall, ::testing::Range(0, static_cast<int>(entry_cases().size())),
                         [](const ::testing::TestParamInfo<int>& i) { return std::string(entry_cases()[i.param].name); });

// Arguments that are not tensors: counts whose products would overflow, and chunk arithmetic at the int64 limit.
TEST(Hostile, CountsAtTheInt64Limit) {
  LOGITLESS_TRACE_SEED();
  Draw d(101);
  LinearCrossEntropyOptions o;
  o.chunk_tokens = std::numeric_limits<int64_t>::max();  // N + chunk - 1 would overflow
  const TestTensor h = d.normal(DType::kFloat32, {kN, kH}), w = d.normal(DType::kFloat32, {kV, kH});
  const TestTensor t = d.indices(DType::kInt64, {kN}, kV);
  const VocabShard vs{0, kV};
  LinearCrossEntropyShardSteps s{};
  EXPECT_EQ(error_of([&] {
              s = linear_cross_entropy_shard_steps(h.host_view(), w.host_view(), t.host_view(), {}, {}, {}, vs, o);
            }),
            "");
  EXPECT_EQ(s.num_chunks, 1);
  // A broadcast target of 2^62 rows: its partials would hold 2^64 floats.
  TensorView big = t.host_view();
  big.sizes[0] = int64_t{1} << 62;
  big.strides[0] = 0;
  TestTensor parts = poisoned(DType::kFloat32, {kN, kShardStats});
  TestTensor loss = poisoned(DType::kFloat32, {});
  TensorView pv = parts.host_view();
  const std::string err = error_of([&] {
    cross_entropy_shard_finalize(pv, big, {}, kV, CrossEntropyOptions{}, loss.host_view(), {}, {}, {}, nullptr);
  });
  EXPECT_EQ(err.rfind("partials:", 0), 0u) << err;
}

}  // namespace
}  // namespace logitless::test
