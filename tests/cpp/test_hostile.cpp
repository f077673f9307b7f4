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

#include <algorithm>
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

#include "common/layout.h"
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
  std::function<void(const Views&, Workspace, StreamHandle)> fn;
  std::function<size_t(const Views&)> ws_query;  // the CUDA workspace the call needs (where it has a query)
  std::vector<std::pair<std::string, std::string>> in_place;  // (output, input) pairs the op may alias exactly

  void add(const std::string& n, TestTensor t, bool primary = false, bool fixed_rank = false) {
    args.push_back(Arg{n, std::make_unique<TestTensor>(std::move(t)), primary, fixed_rank, false});
  }
  void out(const std::string& n, TestTensor t, bool fixed_rank = false) {
    args.push_back(Arg{n, std::make_unique<TestTensor>(std::move(t)), false, fixed_rank, true});
  }
  TestTensor& tensor(const std::string& n) {
    for (Arg& a : args)
      if (a.name == n) return *a.t;
    throw std::runtime_error("no argument " + n);
  }
  Views views(bool dev = false) const {
    Views v;
    for (const Arg& a : args) v[a.name] = a.t->view(dev);
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
      {"negative CUDA ordinal",
       [](TensorView& t, const Arg&) {
         return t.device = Device{DeviceType::kCUDA, -1}, true;
       }},
      {"nine dimensions",
       [](TensorView& t, const Arg&) {
         for (int d = t.ndim; d < kMaxDims; ++d) t.sizes[d] = 1, t.strides[d] = 1;
         t.ndim = kMaxDims + 1;
         return true;
       }},
      {"another device (the rest on the CPU)",
       [](TensorView& t, const Arg& a) {
         return a.primary ? false : (t.device = Device{DeviceType::kCUDA, 0}, true);
       }},
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
    const std::string err = error_of([&] { c.fn(c.views(), c.ws, nullptr); });
    ASSERT_EQ(err, "") << "the valid call raised";
  }
  for (const Arg& a : c.args) {
    for (const Mutation& m : mutations()) {
      Views v = c.views();
      if (!m.apply(v[a.name], a)) continue;
      expect_rejected(c, a.name, m.what, [&] { c.fn(v, c.ws, nullptr); });
    }
    // Every tensor on cuda:0 but this one on cuda:1 (validation precedes any device use: no GPU needed).
    if (!a.primary) {
      Views v = c.views();
      for (auto& kv : v) kv.second.device = Device{DeviceType::kCUDA, 0};
      v[a.name].device = Device{DeviceType::kCUDA, 1};
      expect_rejected(c, a.name, "cuda:1 while the rest are on cuda:0", [&] { c.fn(v, c.ws, nullptr); });
    }
  }
  // An output over another argument's memory (the pairs an op writes in place excepted). It is placed only where it
  // fits inside that argument's storage, so that it overlaps no third one. Two outputs: either may be named.
  for (const Arg& o : c.args) {
    if (!o.output) continue;
    for (const Arg& a : c.args) {
      if (&a == &o || a.t->numel() == 0) continue;
      if (std::find(c.in_place.begin(), c.in_place.end(), std::make_pair(o.name, a.name)) != c.in_place.end()) continue;
      Views v = c.views();
      TensorView& ov = v[o.name];
      const TensorView& av = v[a.name];
      ov.data = av.data;
      const auto span = byte_span(ov);
      if (span.second - span.first > a.t->storage_elems() * dtype_size(a.t->dtype())) continue;
      if (reinterpret_cast<uintptr_t>(ov.data) % dtype_size(ov.dtype) != 0) continue;
      expect_rejected(
          c, o.name, "the memory of " + a.name, [&] { c.fn(v, c.ws, nullptr); }, a.output ? a.name : "");
    }
  }
  if (c.ws.bytes > 0) {
    const Workspace small{c.ws.data, c.ws.bytes - 1}, null{nullptr, c.ws.bytes},
        misaligned{static_cast<char*>(c.ws.data) + 8, c.ws.bytes};
    expect_rejected(c, "workspace", "one byte too few", [&] { c.fn(c.views(), small, nullptr); });
    expect_rejected(c, "workspace", "a null pointer", [&] { c.fn(c.views(), null, nullptr); });
    expect_rejected(c, "workspace", "a pointer 8 bytes off 16", [&] { c.fn(c.views(), misaligned, nullptr); });
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

Call ce_call(const std::string& which, Draw& d, Reduction reduction = Reduction::kMean) {
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
    c.out("loss",
          poisoned(DType::kFloat32, reduction == Reduction::kNone ? std::vector<int64_t>{kN} : std::vector<int64_t>{}));
    c.out("lse", poisoned(DType::kFloat32, {kN}));
    c.out("z_loss", poisoned(DType::kFloat32, {kN}));
  }
  const std::vector<int64_t> per_call =
      reduction == Reduction::kNone ? std::vector<int64_t>{kN} : std::vector<int64_t>{};
  if (which == "forward_backward") c.add("grad_scale", d.normal(DType::kFloat32, per_call));
  if (which == "backward" || which == "shard_backward") {
    c.add("lse", d.uniform_tensor({kN}, 2.0, 4.0));  // above every row's largest logit: probabilities below 1
    c.add("grad_loss", d.normal(DType::kFloat32, per_call));
  }
  if (which == "forward_backward" || which == "backward" || which == "shard_backward")
    c.out("grad_logits", poisoned(DType::kFloat32, {kN, Vr}));
  if (which == "shard_partials") c.out("partials", poisoned(DType::kFloat32, {kN, kShardStats}));
  if (which == "shard_finalize") {
    TestTensor parts(DType::kFloat32, {2, kN, kShardStats});  // two shards' partials: finite statistics
    for (int64_t i = 0; i < parts.numel(); ++i) parts.set(i, i % 4 == 1 ? 1.5f : static_cast<float>(d.uniform(-1, 1)));
    c.add("partials", std::move(parts), false, true);
  }
  c.in_place = {{"grad_logits", "logits"}};
  const CrossEntropyOptions o = ce_opts(reduction);
  c.ws_query = [which, o](const Views& v) {
    if (which.rfind("shard_", 0) == 0) return cross_entropy_shard_workspace_bytes(at(v, "target"), o);
    return cross_entropy_workspace_bytes(at(v, "logits"), at(v, "target"), at(v, "weight"), o);
  };
  c.fn = [which, o, vs](const Views& v, Workspace ws, StreamHandle stream) {
    const auto& L = at(v, "logits");
    const auto& T = at(v, "target");
    const auto& W = at(v, "weight");
    if (which == "forward") {
      cross_entropy_forward(L, T, W, o, at(v, "loss"), at(v, "lse"), at(v, "z_loss"), ws, stream);
    } else if (which == "forward_backward") {
      cross_entropy_forward_backward(L, T, W, o, at(v, "loss"), at(v, "lse"), at(v, "z_loss"), at(v, "grad_logits"),
                                     at(v, "grad_scale"), ws, stream);
    } else if (which == "backward") {
      cross_entropy_backward(L, T, W, at(v, "lse"), at(v, "grad_loss"), o, at(v, "grad_logits"), ws, stream);
    } else if (which == "shard_partials") {
      cross_entropy_shard_partials(L, T, W, vs, o, at(v, "partials"), ws, stream);
    } else if (which == "shard_finalize") {
      cross_entropy_shard_finalize(at(v, "partials"), T, W, kV, o, at(v, "loss"), at(v, "lse"), at(v, "z_loss"), ws,
                                   stream);
    } else {
      cross_entropy_shard_backward(L, T, W, vs, at(v, "lse"), at(v, "grad_loss"), o, at(v, "grad_logits"), ws, stream);
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
  c.fn = [](const Views& v, Workspace, StreamHandle stream) { scale_rows(at(v, "grad"), at(v, "scale"), stream); };
  return c;
}

LinearCrossEntropyOptions lce_opts(Reduction reduction = Reduction::kMean) {
  LinearCrossEntropyOptions o;
  o.reduction = reduction;
  o.z_loss = 1e-3;
  o.chunk_tokens = 4;  // the steps' agreed chunk
  return o;
}

Call lce_call(const std::string& which, Draw& d, Reduction reduction = Reduction::kMean) {
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
  const bool grads =
      which == "forward_backward" || which == "backward" || which == "shard_backward" || which == "shard_step";
  const std::vector<int64_t> per_call =
      reduction == Reduction::kNone ? std::vector<int64_t>{kN} : std::vector<int64_t>{};
  if (fwd) {
    c.out("loss", poisoned(DType::kFloat32, per_call));
    c.out("lse", poisoned(DType::kFloat32, {kN}));
  }
  if (which == "backward" || which == "shard_backward") {
    c.add("lse", d.uniform_tensor({kN}, 6.0, 8.0));  // above every token's largest logit
    c.add("grad_loss", d.normal(DType::kFloat32, per_call));
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
  const LinearCrossEntropyOptions o = lce_opts(reduction);
  if (which == "forward")
    c.ws_query = [o](const Views& v) {
      return linear_cross_entropy_forward_workspace_bytes(at(v, "hidden"), at(v, "weight"), at(v, "target"), o);
    };
  if (which == "forward_backward")
    c.ws_query = [o](const Views& v) {
      return linear_cross_entropy_forward_backward_workspace_bytes(at(v, "hidden"), at(v, "weight"), at(v, "target"),
                                                                   at(v, "grad_hidden"), at(v, "grad_weight"),
                                                                   at(v, "grad_bias"), o);
    };
  c.fn = [which, o, vs](const Views& v, Workspace ws, StreamHandle stream) {
    const auto &X = at(v, "hidden"), &W = at(v, "weight"), &b = at(v, "bias"), &T = at(v, "target"),
               &cw = at(v, "class_weight");
    if (which == "forward") {
      linear_cross_entropy_forward(X, W, b, T, cw, o, at(v, "loss"), at(v, "lse"), ws, stream);
    } else if (which == "forward_backward") {
      linear_cross_entropy_forward_backward(X, W, b, T, cw, o, at(v, "loss"), at(v, "lse"), at(v, "grad_hidden"),
                                            at(v, "grad_weight"), at(v, "grad_bias"), at(v, "grad_scale"), ws, stream);
    } else if (which == "backward") {
      linear_cross_entropy_backward(X, W, b, T, cw, at(v, "lse"), at(v, "grad_loss"), o, at(v, "grad_hidden"),
                                    at(v, "grad_weight"), at(v, "grad_bias"), ws, stream);
    } else if (which == "shard_partials") {
      linear_cross_entropy_shard_partials(X, W, b, T, cw, vs, o, at(v, "partials"), ws, stream);
    } else if (which == "shard_backward") {
      linear_cross_entropy_shard_backward(X, W, b, T, cw, vs, at(v, "lse"), at(v, "grad_loss"), o, at(v, "grad_hidden"),
                                          at(v, "grad_weight"), at(v, "grad_bias"), ws, stream);
    } else {
      linear_cross_entropy_shard_forward_backward_step(ShardStep::kLogits, 0, at(v, "partials"), X, W, b, T, cw, vs, o,
                                                       at(v, "loss"), at(v, "lse"), at(v, "grad_hidden"),
                                                       at(v, "grad_weight"), at(v, "grad_bias"), ws, stream);
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
  c.in_place = {{"grad_logits", "logits"}};
  const PolicyLossOptions o = pl_opts();
  c.ws_query = [o](const Views& v) {
    PolicyLossInputs in;
    in.logits = at(v, "logits");
    in.completion_ids = at(v, "completion_ids");
    return policy_loss_workspace_bytes(in, o);
  };
  c.fn = [which, o](const Views& v, Workspace ws, StreamHandle stream) {
    PolicyLossInputs in;
    in.logits = at(v, "logits");
    in.completion_ids = at(v, "completion_ids");
    in.advantages = at(v, "advantages");
    in.completion_mask = at(v, "completion_mask");
    in.old_logp = at(v, "old_logp");
    in.ref_logp = at(v, "ref_logp");
    if (which == "forward") {
      policy_loss_forward(in, o, policy_outputs(v), ws, stream);
    } else {
      policy_loss_forward_backward(in, o, policy_outputs(v), at(v, "grad_logits"), at(v, "grad_scale"), ws, stream);
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
  c.in_place = {{"grad_logits", "logits"}};
  SelectiveLogSoftmaxOptions o;
  c.ws_query = [o](const Views& v) { return selective_log_softmax_workspace_bytes(at(v, "logits"), at(v, "ids"), o); };
  c.fn = [which, o](const Views& v, Workspace ws, StreamHandle stream) {
    if (which == "forward") {
      selective_log_softmax_forward(at(v, "logits"), at(v, "ids"), o, at(v, "logp"), at(v, "entropy"), at(v, "lse"), ws,
                                    stream);
    } else {
      selective_log_softmax_backward(at(v, "logits"), at(v, "ids"), at(v, "lse"), at(v, "grad_logp"), o,
                                     at(v, "grad_logits"), ws, stream);
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
  if (which == "forward")
    c.ws_query = [o](const Views& v) {
      LinearPolicyLossInputs in;
      in.hidden = at(v, "hidden");
      in.weight = at(v, "weight");
      in.completion_ids = at(v, "completion_ids");
      in.advantages = at(v, "advantages");
      in.completion_mask = at(v, "completion_mask");
      in.old_logp = at(v, "old_logp");
      in.ref_logp = at(v, "ref_logp");
      return linear_policy_loss_forward_workspace_bytes(in, o);
    };
  c.fn = [which, o](const Views& v, Workspace ws, StreamHandle stream) {
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
      linear_policy_loss_forward(in, o, policy_outputs(v), ws, stream);
    } else if (which == "forward_backward") {
      linear_policy_loss_forward_backward(in, o, policy_outputs(v), g, at(v, "grad_scale"), ws, stream);
    } else {
      linear_policy_loss_backward(in, o, at(v, "logp"), at(v, "lse"), at(v, "grad_loss"), g, ws, stream);
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
    TestTensor top1(DType::kBool, {kN});
    top1.fill_storage_bytes(0xA5);
    c.out("is_top1", std::move(top1));
  } else {
    c.add("lse", d.normal(DType::kFloat32, {kN}));
    c.add("grad_logp", d.normal(DType::kFloat32, {kN}));
    c.out("grad_hidden", poisoned(DType::kFloat16, {kN, kH}), true);
    c.out("grad_weight", poisoned(DType::kFloat32, {kV, kH}), true);
    c.out("grad_bias", poisoned(DType::kFloat16, {kV}), true);
  }
  LinearSelectiveLogSoftmaxOptions o;
  c.fn = [which, o](const Views& v, Workspace ws, StreamHandle stream) {
    if (which == "forward") {
      linear_selective_log_softmax_forward(at(v, "hidden"), at(v, "weight"), at(v, "bias"), at(v, "ids"), o,
                                           at(v, "logp"), at(v, "entropy"), at(v, "lse"), at(v, "is_top1"), ws, stream);
    } else {
      LinearPolicyLossGrads g{at(v, "grad_hidden"), at(v, "grad_weight"), at(v, "grad_bias")};
      linear_selective_log_softmax_backward(at(v, "hidden"), at(v, "weight"), at(v, "bias"), at(v, "ids"), at(v, "lse"),
                                            at(v, "grad_logp"), o, g, ws, stream);
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
  c.in_place = {{"y", "x"},
                {"residual_out", "x"},
                {"residual_out", "residual"},
                {"grad_x", "grad_y"},
                {"grad_x", "grad_residual_out"}};
  RMSNormOptions o;
  if (which == "backward")
    c.ws_query = [o](const Views& v) { return rms_norm_backward_workspace_bytes(at(v, "x"), at(v, "weight"), o); };
  c.fn = [which, o](const Views& v, Workspace ws, StreamHandle stream) {
    if (which == "forward") {
      rms_norm_forward(at(v, "x"), at(v, "residual"), at(v, "weight"), o, at(v, "y"), at(v, "residual_out"),
                       at(v, "rstd"), ws, stream);
    } else {
      rms_norm_backward(at(v, "grad_y"), at(v, "grad_residual_out"), at(v, "x"), at(v, "weight"), at(v, "rstd"), o,
                        at(v, "grad_x"), at(v, "grad_weight"), ws, stream);
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
                         [](const ::testing::TestParamInfo<int>& i) {
                           return std::string(entry_cases()[i.param].name);
                         });

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

// ---- part 2: NaN and inf in each float input ------------------------------------------------------------------
// The documented result of a non-finite element, per output element: unchanged (bit for bit the clean call's, so
// the rows it does not reach are exactly what the clean call computes), NaN, not finite (inf or NaN), or (kRef)
// finite and equal to the float64 reference of the changed inputs.
enum class Expect { kSame, kNaN, kNonFinite, kRef };
using Predicate = std::function<Expect(const std::string& out, int64_t flat)>;
using Outs = std::map<std::string, std::vector<float>>;

// The call's float outputs after a run over poisoned storage.
Outs run_outputs(Call& c) {
  for (Arg& a : c.args)
    if (a.output) a.t->fill_storage_nan();
  c.fn(c.views(), c.ws, nullptr);
  Outs o;
  for (const Arg& a : c.args) {
    const DType dt = a.t->dtype();
    if (a.output && (dt == DType::kFloat32 || dt == DType::kFloat16 || dt == DType::kBFloat16))
      o[a.name] = a.t->gather_float();
  }
  return o;
}

// Element `flat` of input `input` set to `value`: every output element as `pred` says, against `clean` (the call's
// outputs on the unchanged inputs) and `ref` (where kRef: the float64 reference on the changed inputs).
void expect_propagation(Call& c, const std::string& input, int64_t flat, float value, const Outs& clean,
                        const Predicate& pred, const std::function<Outs()>& ref = nullptr) {
  SCOPED_TRACE(c.name + ": " + input + "[" + std::to_string(flat) + "] = " + std::to_string(value));
  TestTensor& t = c.tensor(input);
  const float old = t.get(flat);
  t.set(flat, value);
  const Outs dirty = run_outputs(c);
  const Outs want = ref ? ref() : Outs{};
  t.set(flat, old);
  for (const auto& [name, got] : dirty) {
    const std::vector<float>& base = clean.at(name);
    int bad = 0;
    for (int64_t i = 0; i < static_cast<int64_t>(got.size()) && bad < 3; ++i) {
      const float g = got[i], b = base[i];
      const Expect e = pred(name, i);
      bool ok = true;
      switch (e) {
        case Expect::kSame:
          ok = std::memcmp(&g, &b, sizeof g) == 0 || (std::isnan(g) && std::isnan(b));
          break;
        case Expect::kNaN:
          ok = std::isnan(g);
          break;
        case Expect::kNonFinite:
          ok = !std::isfinite(g);
          break;
        case Expect::kRef: {
          const float w = want.at(name)[i];
          ok = std::isfinite(g) && std::abs(g - w) <= 1e-4 * std::max(1.f, std::abs(w));
          break;
        }
      }
      if (!ok) {
        ++bad;
        ADD_FAILURE() << name << "[" << i << "] = " << g << " (clean " << b << "), expected "
                      << (e == Expect::kSame        ? "the clean value"
                          : e == Expect::kNaN       ? "NaN"
                          : e == Expect::kNonFinite ? "inf or NaN"
                                                    : "the reference");
      }
    }
  }
}

// Cross-entropy reduction none with class weights and z-loss, float64: loss, lse, z-loss and the gradient of
// sum_i grad_scale_i loss_i, from the call's (changed) inputs.
Outs ce_reference(Call& c) {
  const TestTensor &L = c.tensor("logits"), &T = c.tensor("target"), &W = c.tensor("weight");
  const TestTensor& G = c.tensor("grad_scale");
  const double z = ce_opts().z_loss;
  Outs o;
  o["loss"].resize(kN), o["lse"].resize(kN), o["z_loss"].resize(kN), o["grad_logits"].resize(kN * kV);
  for (int64_t i = 0; i < kN; ++i) {
    const int64_t t = T.get_index(i);
    double m = -INFINITY, s = 0;
    for (int64_t j = 0; j < kV; ++j) m = std::max(m, static_cast<double>(L.get(i * kV + j)));
    for (int64_t j = 0; j < kV; ++j) s += std::exp(L.get(i * kV + j) - m);
    const double lse = m + std::log(s), wt = W.get(t);
    o["loss"][i] = static_cast<float>(wt * (lse - L.get(i * kV + t)) + z * lse * lse);
    o["lse"][i] = static_cast<float>(lse);
    o["z_loss"][i] = static_cast<float>(z * lse * lse);
    for (int64_t j = 0; j < kV; ++j) {
      const double p = std::exp(L.get(i * kV + j) - lse);
      o["grad_logits"][i * kV + j] = static_cast<float>(G.get(i) * ((wt + 2 * z * lse) * p - (j == t ? wt : 0.0)));
    }
  }
  return o;
}

TEST(HostileNumbers, CrossEntropy) {
  LOGITLESS_TRACE_SEED();
  Draw d(201);
  Call c = ce_call("forward_backward", d, Reduction::kNone);
  const Outs clean = run_outputs(c);
  {  // the clean call against the float64 reference
    const Outs ref = ce_reference(c);
    for (const auto& [name, got] : clean)
      for (size_t i = 0; i < got.size(); ++i)
        ASSERT_NEAR(got[i], ref.at(name)[i], 1e-5 * std::max(1.f, std::abs(ref.at(name)[i]))) << name << " " << i;
  }
  const TestTensor& T = c.tensor("target");
  const int64_t i = d.index(kN), t = T.get_index(i);
  int64_t j = d.index(kV - 1);
  j += j >= t ? 1 : 0;  // a column other than the target
  auto row_is = [&](int64_t row, Expect e) {
    return [row, e](const std::string& out, int64_t f) {
      return (out == "grad_logits" ? f / kV : f) == row ? e : Expect::kSame;
    };
  };
  // A NaN or +inf logit: its row's loss, lse, z-loss and gradient are NaN; the other rows are untouched.
  for (float v : {NAN, INFINITY}) expect_propagation(c, "logits", i * kV + j, v, clean, row_is(i, Expect::kNaN));
  // A -inf logit is a probability of 0: the row stays finite, as the reference computes it.
  expect_propagation(c, "logits", i * kV + j, -INFINITY, clean, row_is(i, Expect::kRef),
                     [&] { return ce_reference(c); });
  // ... at the target: loss +inf, every other output of the row finite (the target's probability is 0).
  expect_propagation(
      c, "logits", i * kV + t, -INFINITY, clean,
      [&](const std::string& out, int64_t f) {
        if ((out == "grad_logits" ? f / kV : f) != i) return Expect::kSame;
        return out == "loss" ? Expect::kNonFinite : Expect::kRef;
      },
      [&] { return ce_reference(c); });
  // A NaN weight of a targeted class: the rows that target it are NaN (loss and gradient; lse and z-loss are not
  // weighted). A NaN or inf weight of a class no row targets changes nothing (no label smoothing).
  std::vector<bool> targeted(kV, false);
  for (int64_t r = 0; r < kN; ++r) targeted[T.get_index(r)] = true;
  expect_propagation(c, "weight", t, NAN, clean, [&](const std::string& out, int64_t f) {
    const int64_t r = out == "grad_logits" ? f / kV : f;
    return T.get_index(r) == t && (out == "loss" || out == "grad_logits") ? Expect::kNaN : Expect::kSame;
  });
  for (int64_t k = 0; k < kV; ++k)
    if (!targeted[k])
      for (float v : {NAN, INFINITY})
        expect_propagation(c, "weight", k, v, clean, [](const std::string&, int64_t) { return Expect::kSame; });
  // A NaN upstream factor of a row (reduction none): that row's gradient only.
  expect_propagation(c, "grad_scale", i, NAN, clean, [&](const std::string& out, int64_t f) {
    return out == "grad_logits" && f / kV == i ? Expect::kNaN : Expect::kSame;
  });
}

TEST(HostileNumbers, CrossEntropyReducedAndBackward) {
  LOGITLESS_TRACE_SEED();
  Draw d(202);
  // Mean: a NaN row makes the loss NaN; every other row's gradient is untouched (the denominator is the targets').
  Call m = ce_call("forward_backward", d, Reduction::kMean);
  const Outs clean = run_outputs(m);
  const int64_t i = d.index(kN);
  expect_propagation(m, "logits", i * kV + d.index(kV), NAN, clean, [&](const std::string& out, int64_t f) {
    if (out == "loss") return Expect::kNaN;
    return (out == "grad_logits" ? f / kV : f) == i ? Expect::kNaN : Expect::kSame;
  });
  // A NaN upstream gradient of the reduced loss: every gradient element, nothing else.
  expect_propagation(m, "grad_scale", 0, NAN, clean, [](const std::string& out, int64_t) {
    return out == "grad_logits" ? Expect::kNaN : Expect::kSame;
  });
  // Backward from a saved lse: a NaN lse or upstream factor makes its row's gradient NaN.
  Call b = ce_call("backward", d, Reduction::kNone);
  const Outs bclean = run_outputs(b);
  for (const char* in : {"lse", "grad_loss"})
    expect_propagation(b, in, i, NAN, bclean,
                       [&](const std::string&, int64_t f) { return f / kV == i ? Expect::kNaN : Expect::kSame; });
  // Finalize from every shard's partials: a NaN statistic (a shard's max or sum) makes its row NaN.
  Call f = ce_call("shard_finalize", d, Reduction::kNone);
  const Outs fclean = run_outputs(f);
  for (int64_t stat : {0, 1})
    expect_propagation(f, "partials", (d.index(2) * kN + i) * kShardStats + stat, NAN, fclean,
                       [&](const std::string&, int64_t r) { return r == i ? Expect::kNaN : Expect::kSame; });
}

TEST(HostileNumbers, ScaleRows) {
  LOGITLESS_TRACE_SEED();
  Draw d(203);
  Call c = scale_rows_call(d);
  c.tensor("scale").set(d.index(kN), 1.f);  // a row of factor 1 is left as it is
  // grad is both input and output here: compare against a fresh copy each time.
  const TestTensor grad0 = c.tensor("grad").clone();
  const int64_t i = d.index(kN);
  c.tensor("scale").set(i, NAN);
  c.fn(c.views(), c.ws, nullptr);
  const std::vector<float> got = c.tensor("grad").gather_float(), before = grad0.gather_float();
  const TestTensor& s = c.tensor("scale");
  for (int64_t f = 0; f < kN * kV; ++f) {
    const int64_t r = f / kV;
    if (r == i) {
      ASSERT_TRUE(std::isnan(got[f])) << f;
    } else {
      TestTensor rounded(DType::kBFloat16, {1});  // the product in float32, rounded to the gradient's dtype
      rounded.set(0, before[f] * s.get(r));
      ASSERT_EQ(got[f], rounded.get(0)) << f;
    }
  }
}

TEST(HostileNumbers, PolicyLoss) {
  LOGITLESS_TRACE_SEED();
  Draw d(204);
  Call c = pl_call("forward_backward", d);
  const Outs clean = run_outputs(c);
  const TestTensor& mask = c.tensor("completion_mask");
  int64_t tok = d.index(kB * kL);
  while (mask.get(tok) == 0.f) tok = (tok + 1) % (kB * kL);  // an unmasked token
  const int64_t b = tok / kL, l = tok % kL;
  const int64_t row = b * (kL + 1) + l;  // its row of the [B, L+1, V] logits and gradient
  // Which outputs a token reaches: its own per-token outputs and gradient row, and the loss.
  auto token_only = [&](Expect e, bool stats) {
    return [=](const std::string& out, int64_t f) {
      if (out == "loss") return e;
      if (out == "grad_logits") return f / kV == row ? e : Expect::kSame;
      if (f != tok) return Expect::kSame;
      const bool stat_out = out == "logp" || out == "lse" || out == "entropy";
      return stat_out && !stats ? Expect::kSame : (out == "kl" && !stats ? Expect::kSame : e);
    };
  };
  // A NaN or +inf logit at an unmasked token: that token's every output and gradient row, and the loss.
  for (float v : {NAN, INFINITY})
    expect_propagation(c, "logits", row * kV + d.index(kV), v, clean, token_only(Expect::kNaN, true));
  // The unused last position and masked tokens are never read.
  expect_propagation(c, "logits", (b * (kL + 1) + kL) * kV + d.index(kV), NAN, clean,
                     [](const std::string&, int64_t) { return Expect::kSame; });
  for (int64_t t = 0; t < kB * kL; ++t)
    if (mask.get(t) == 0.f) {
      expect_propagation(c, "logits", ((t / kL) * (kL + 1) + t % kL) * kV + d.index(kV), NAN, clean,
                         [](const std::string&, int64_t) { return Expect::kSame; });
      for (const char* in : {"old_logp", "ref_logp"})
        expect_propagation(c, in, t, NAN, clean, [](const std::string&, int64_t) { return Expect::kSame; });
      break;
    }
  // A NaN old_logp: that token's ratio, loss and gradient (its logp, lse, entropy and kl stand).
  expect_propagation(c, "old_logp", tok, NAN, clean, token_only(Expect::kNaN, false));
  // A NaN ref_logp with beta > 0: its kl, loss and gradient.
  expect_propagation(c, "ref_logp", tok, NAN, clean, [&](const std::string& out, int64_t f) {
    if (out == "loss") return Expect::kNaN;
    if (out == "grad_logits") return f / kV == row ? Expect::kNaN : Expect::kSame;
    return f == tok && (out == "kl" || out == "per_token_loss") ? Expect::kNaN : Expect::kSame;
  });
  // A NaN advantage: every token of its sequence (loss and gradient; the statistics and kl stand).
  expect_propagation(c, "advantages", b, NAN, clean, [&](const std::string& out, int64_t f) {
    if (out == "loss") return Expect::kNaN;
    const int64_t s = out == "grad_logits" ? f / kV / (kL + 1) : f / kL;
    const bool unmasked = out == "grad_logits" ? (f / kV) % (kL + 1) < kL && mask.get(s * kL + (f / kV) % (kL + 1)) != 0
                                               : mask.get(f) != 0;
    if (s != b || !unmasked) return Expect::kSame;
    return out == "grad_logits" || out == "per_token_loss" ? Expect::kNaN : Expect::kSame;
  });
  // A NaN upstream gradient: every unmasked gradient row.
  expect_propagation(c, "grad_scale", 0, NAN, clean, [&](const std::string& out, int64_t f) {
    if (out != "grad_logits") return Expect::kSame;
    const int64_t r = f / kV, s = r / (kL + 1), p = r % (kL + 1);
    return p < kL && mask.get(s * kL + p) != 0 ? Expect::kNaN : Expect::kSame;
  });
}

TEST(HostileNumbers, SelectiveLogSoftmax) {
  LOGITLESS_TRACE_SEED();
  Draw d(205);
  Call f = sls_call("forward", d);
  const Outs clean = run_outputs(f);
  const int64_t i = d.index(kN);
  for (float v : {NAN, INFINITY})
    expect_propagation(f, "logits", i * kV + d.index(kV), v, clean,
                       [&](const std::string&, int64_t r) { return r == i ? Expect::kNaN : Expect::kSame; });
  Call b = sls_call("backward", d);
  const Outs bclean = run_outputs(b);
  for (const char* in : {"lse", "grad_logp"})
    expect_propagation(b, in, i, NAN, bclean,
                       [&](const std::string&, int64_t x) { return x / kV == i ? Expect::kNaN : Expect::kSame; });
}

TEST(HostileNumbers, LinearCrossEntropy) {
  LOGITLESS_TRACE_SEED();
  Draw d(206);
  Call c = lce_call("forward", d, Reduction::kNone);
  const Outs clean = run_outputs(c);
  const int64_t i = d.index(kN), j = d.index(kV);
  const TestTensor& T = c.tensor("target");
  // A NaN in a token's hidden row: its loss and lse only.
  expect_propagation(c, "hidden", i * kH + d.index(kH), NAN, clean,
                     [&](const std::string&, int64_t r) { return r == i ? Expect::kNaN : Expect::kSame; });
  // A NaN in a weight row or bias element: that class's logit in every token, so every token.
  expect_propagation(c, "weight", j * kH + d.index(kH), NAN, clean,
                     [](const std::string&, int64_t) { return Expect::kNaN; });
  expect_propagation(c, "bias", j, NAN, clean, [](const std::string&, int64_t) { return Expect::kNaN; });
  // A NaN class weight: the losses of the tokens that target that class (their lse stands).
  const int64_t t = T.get_index(i);
  expect_propagation(c, "class_weight", t, NAN, clean, [&](const std::string& out, int64_t r) {
    return out == "loss" && T.get_index(r) == t ? Expect::kNaN : Expect::kSame;
  });
  // Backward (reduction none): a NaN hidden row reaches that token's grad_hidden row and all of grad_weight and
  // grad_bias (g^T hidden sums over tokens); a NaN lse or upstream factor of a token likewise.
  Call b = lce_call("backward", d, Reduction::kNone);
  const Outs bclean = run_outputs(b);
  auto token_grads = [&](const std::string& out, int64_t f) {
    if (out == "grad_hidden") return f / kH == i ? Expect::kNaN : Expect::kSame;
    return Expect::kNaN;
  };
  expect_propagation(b, "hidden", i * kH + d.index(kH), NAN, bclean, token_grads);
  for (const char* in : {"lse", "grad_loss"}) expect_propagation(b, in, i, NAN, bclean, token_grads);
}

TEST(HostileNumbers, LinearPolicyLoss) {
  LOGITLESS_TRACE_SEED();
  Draw d(207);
  Call c = lpl_call("forward", d);
  const Outs clean = run_outputs(c);
  const TestTensor& mask = c.tensor("completion_mask");
  int64_t tok = d.index(kB * kL);
  while (mask.get(tok) == 0.f) tok = (tok + 1) % (kB * kL);
  const int64_t pos = (tok / kL) * (kL + 1) + tok % kL;  // its hidden row
  // A NaN in an unmasked token's hidden row: its per-token outputs and the loss.
  expect_propagation(c, "hidden", pos * kH + d.index(kH), NAN, clean, [&](const std::string& out, int64_t f) {
    return out == "loss" || f == tok ? Expect::kNaN : Expect::kSame;
  });
  // The unused last position's hidden row is never read by the row kernels (its logits are never used).
  expect_propagation(c, "hidden", ((tok / kL) * (kL + 1) + kL) * kH + d.index(kH), NAN, clean,
                     [](const std::string&, int64_t) { return Expect::kSame; });
  // A NaN weight row: every unmasked token.
  expect_propagation(c, "weight", d.index(kV) * kH + d.index(kH), NAN, clean, [&](const std::string& out, int64_t f) {
    return out == "loss" || mask.get(f) != 0 ? Expect::kNaN : Expect::kSame;
  });
}

TEST(HostileNumbers, RmsNorm) {
  LOGITLESS_TRACE_SEED();
  Draw d(208);
  Call f = rms_call("forward", d);
  const Outs clean = run_outputs(f);
  const int64_t i = d.index(kN), j = d.index(kH);
  // A NaN in x or the residual at (i, j): row i of y and its rstd; residual_out only at (i, j).
  for (const char* in : {"x", "residual"})
    expect_propagation(f, in, i * kH + j, NAN, clean, [&](const std::string& out, int64_t x) {
      if (out == "residual_out") return x == i * kH + j ? Expect::kNaN : Expect::kSame;
      return (out == "rstd" ? x : x / kH) == i ? Expect::kNaN : Expect::kSame;
    });
  // A NaN weight element: column j of y.
  expect_propagation(f, "weight", j, NAN, clean, [&](const std::string& out, int64_t x) {
    return out == "y" && x % kH == j ? Expect::kNaN : Expect::kSame;
  });
  // Backward: a NaN in grad_y, x or rstd of row i: row i of grad_x (through the row's sum), and grad_weight (a sum
  // over rows): column j for grad_y and x, all of it for rstd (the row's every normalized value is NaN).
  Call b = rms_call("backward", d);
  const Outs bclean = run_outputs(b);
  expect_propagation(b, "grad_y", i * kH + j, NAN, bclean, [&](const std::string& out, int64_t x) {
    if (out == "grad_weight") return x == j ? Expect::kNaN : Expect::kSame;
    return x / kH == i ? Expect::kNaN : Expect::kSame;
  });
  expect_propagation(b, "x", i * kH + j, NAN, bclean, [&](const std::string& out, int64_t x) {
    if (out == "grad_weight") return x == j ? Expect::kNaN : Expect::kSame;
    return x / kH == i ? Expect::kNaN : Expect::kSame;
  });
  expect_propagation(b, "rstd", i, NAN, bclean, [&](const std::string& out, int64_t x) {
    if (out == "grad_weight") return Expect::kNaN;
    return x / kH == i ? Expect::kNaN : Expect::kSame;
  });
  // grad_residual_out is added to grad_x elementwise.
  expect_propagation(b, "grad_residual_out", i * kH + j, NAN, bclean, [&](const std::string& out, int64_t x) {
    return out == "grad_x" && x == i * kH + j ? Expect::kNaN : Expect::kSame;
  });
}

// ---- part 3: on a GPU ------------------------------------------------------------------------------------------
#if defined(LOGITLESS_WITH_CUDA)

// Every argument of `c` to the GPU; its device bytes (read back) compare before and after a refused call.
std::vector<std::vector<uint8_t>> device_bytes(Call& c) {
  std::vector<std::vector<uint8_t>> out;
  for (Arg& a : c.args) {
    a.t->to_host();
    out.push_back(bytes_of(*a.t));
  }
  return out;
}

void expect_refused_on_gpu(Call& c, const std::string& arg, const std::string& what, const std::function<void()>& fn) {
  SCOPED_TRACE(c.name + " on the GPU: " + what);
  const auto before = device_bytes(c);
  std::string msg;
  Error::Kind kind = Error::Kind::kRuntime;
  try {
    fn();
  } catch (const Error& e) {
    msg = e.what();
    kind = e.kind();
  }
  device_synchronize();
  ASSERT_FALSE(msg.empty()) << "accepted";
  EXPECT_EQ(kind, Error::Kind::kInvalidArgument) << msg;
  EXPECT_EQ(msg.rfind(arg + ":", 0), 0u) << msg;
  const auto after = device_bytes(c);
  for (size_t i = 0; i < c.args.size(); ++i) EXPECT_TRUE(after[i] == before[i]) << c.args[i].name << " was written";
}

// Scratch on the GPU with room for a pointer 8 bytes past a 16-byte boundary.
struct GpuScratch {
  DeviceScratch mem;
  size_t bytes;
  explicit GpuScratch(size_t b) : mem(b + 16), bytes(b) {}
  Workspace ws() const { return mem.ws().data ? Workspace{mem.ws().data, bytes} : Workspace{nullptr, bytes}; }
  Workspace misaligned() const { return Workspace{static_cast<char*>(mem.ws().data) + 8, bytes}; }
};

#endif  // LOGITLESS_WITH_CUDA

// The CUDA workspace of every family that needs one: too small, null or misaligned is refused naming it, and nothing
// on the device is written; the exact size works.
TEST(HostileGpu, Workspaces) {
  LOGITLESS_SKIP_WITHOUT_GPU();
#if defined(LOGITLESS_WITH_CUDA)
  LOGITLESS_TRACE_SEED();
  Draw d(301);
  std::vector<Call> calls;
  calls.push_back(ce_call("forward", d));
  calls.push_back(ce_call("shard_partials", d));
  calls.push_back(pl_call("forward", d));
  calls.push_back(sls_call("forward", d));
  calls.push_back(lce_call("forward", d));
  calls.push_back(lpl_call("forward", d));
  calls.push_back(rms_call("backward", d));
  for (Call& c : calls) {
    for (Arg& a : c.args) a.t->to_device();
    const Views v = c.views(true);
    const size_t need = c.ws_query(v);
    ASSERT_GT(need, 0u) << c.name;
    const GpuScratch s(need);
    const Workspace small{s.ws().data, need - 1};
    expect_refused_on_gpu(c, "workspace", "one byte too few", [&] { c.fn(v, small, nullptr); });
    expect_refused_on_gpu(c, "workspace", "a null pointer", [&] { c.fn(v, Workspace{nullptr, need}, nullptr); });
    expect_refused_on_gpu(c, "workspace", "a misaligned pointer", [&] { c.fn(v, s.misaligned(), nullptr); });
    EXPECT_EQ(error_of([&] { c.fn(v, s.ws(), nullptr); }), "") << c.name;
    device_synchronize();
  }
#endif
}

// Tensors of one call on two devices (real device memory): refused naming the one that differs, nothing written.
TEST(HostileGpu, DeviceMismatch) {
  LOGITLESS_SKIP_WITHOUT_GPU();
#if defined(LOGITLESS_WITH_CUDA)
  LOGITLESS_TRACE_SEED();
  Draw d(302);
  Call c = ce_call("forward_backward", d);
  for (Arg& a : c.args) a.t->to_device();
  const DeviceScratch s(c.ws_query(c.views(true)));
  for (const Arg& a : c.args) {
    if (a.primary) continue;
    Views v = c.views(true);
    v[a.name] = a.t->host_view();  // this one on the CPU
    expect_refused_on_gpu(c, a.name, "on the CPU", [&] { c.fn(v, s.ws(), nullptr); });
  }
  Views v = c.views(false);  // everything on the CPU but the logits
  v["logits"] = c.tensor("logits").view(true);
  expect_refused_on_gpu(c, "target", "logits alone on the GPU", [&] { c.fn(v, s.ws(), nullptr); });
#endif
}

// Tensors on a device the process does not see (cuda:N of N visible, also with no GPU at all) are refused naming the
// tensor the call runs on, before any CUDA call. Needs the CUDA backend, not a GPU.
TEST(HostileGpu, InvisibleDevice) {
  if (!built_with_cuda()) GTEST_SKIP() << "built without the CUDA backend";
  LOGITLESS_TRACE_SEED();
  Draw d(304);
  const Device gone{DeviceType::kCUDA, cuda_device_count()};
  std::vector<Call> calls;
  calls.push_back(ce_call("forward", d));
  calls.push_back(pl_call("forward", d));
  calls.push_back(rms_call("forward", d));
  for (Call& c : calls) {
    Views v = c.views();
    for (auto& kv : v) kv.second.device = gone;
    const std::string primary = c.args.front().name;
    // Host scratch stands in for the workspace: the device check comes first and nothing is read or written.
    c.workspace(c.ws_query ? c.ws_query(v) : 0);
    expect_rejected(c, primary, "cuda:" + std::to_string(gone.index), [&] { c.fn(v, c.ws, nullptr); });
  }
}

// The device and stream checks run inside CUDA graph capture too (global mode, which refuses any call that could
// synchronize): a captured call replays to the eager call's outputs.
TEST(HostileGpu, ChecksPassInsideGraphCapture) {
  LOGITLESS_SKIP_WITHOUT_GPU();
#if defined(LOGITLESS_WITH_CUDA)
  LOGITLESS_TRACE_SEED();
  Draw d(305);
  std::vector<Call> calls;
  calls.push_back(ce_call("forward_backward", d));
  calls.push_back(pl_call("forward_backward", d));
  calls.push_back(rms_call("forward", d));
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  for (Call& c : calls) {
    SCOPED_TRACE(c.name);
    for (Arg& a : c.args) a.t->to_device();
    const Views v = c.views(true);
    const DeviceScratch s(c.ws_query ? c.ws_query(v) : 0);
    ASSERT_EQ(error_of([&] { c.fn(v, s.ws(), stream); }), "");
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    const auto eager = device_bytes(c);
    cudaGraph_t graph = nullptr;
    ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
    const std::string err = error_of([&] { c.fn(v, s.ws(), stream); });
    ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
    ASSERT_EQ(err, "");
    cudaGraphExec_t exec = nullptr;
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    for (Arg& a : c.args)
      if (a.output) {
        a.t->fill_storage_nan();
        a.t->to_device();
      }
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    const auto replayed = device_bytes(c);
    for (size_t i = 0; i < c.args.size(); ++i) EXPECT_TRUE(replayed[i] == eager[i]) << c.args[i].name;
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
  cudaStreamDestroy(stream);
#endif
}

// A stream of another device is refused naming it, before anything is launched (two GPUs; skipped with fewer).
TEST(HostileGpu, StreamOfAnotherDevice) {
  LOGITLESS_SKIP_WITHOUT_GPU();
#if defined(LOGITLESS_WITH_CUDA)
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs two GPUs";
  LOGITLESS_TRACE_SEED();
  Draw d(303);
  cudaStream_t other = nullptr;
  ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
  ASSERT_EQ(cudaStreamCreate(&other), cudaSuccess);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  std::vector<Call> calls;
  calls.push_back(ce_call("forward_backward", d));
  calls.push_back(pl_call("forward_backward", d));
  calls.push_back(lce_call("forward_backward", d));
  calls.push_back(rms_call("forward", d));
  for (Call& c : calls) {
    for (Arg& a : c.args) a.t->to_device();
    const Views v = c.views(true);
    const DeviceScratch s(c.ws_query ? c.ws_query(v) : 0);
    expect_refused_on_gpu(c, "stream", "a stream of cuda:1", [&] { c.fn(v, s.ws(), other); });
    EXPECT_EQ(error_of([&] { c.fn(v, s.ws(), nullptr); }), "") << c.name;
    device_synchronize();
  }
  cudaStreamDestroy(other);
#endif
}

}  // namespace
}  // namespace logitless::test
