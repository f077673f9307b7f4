// Machinery the policy-loss suites share (test_policy_loss.cpp and test_linear_policy_loss.cpp): the option presets
// and the per-token inputs they set up, the float64 reference of the loss as a function of the per-token
// log-probabilities (and its derivative in them by central differences), the output tensors every entry point
// writes, and the comparison of those outputs.
//
// The reference is written independently of policy_loss/math.h: the loss is a textbook function of the vector of
// per-token log-probabilities. How those log-probabilities come about (logits, or a linear head) is each suite's.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "test_util.h"

namespace logitless::test {

// The option sets the suites sweep; their names are part of the test names.
enum class Preset { kPlain, kFull, kFloatMask, kSeedLike, kAllMasked, kBadIdNoCheck, kDapoGlobal };

inline const char* preset_name(Preset p) {
  switch (p) {
    case Preset::kPlain:
      return "plain";
    case Preset::kFull:
      return "full";
    case Preset::kFloatMask:
      return "floatmask";
    case Preset::kSeedLike:
      return "seedlike";
    case Preset::kAllMasked:
      return "allmasked";
    case Preset::kBadIdNoCheck:
      return "badnocheck";
    case Preset::kDapoGlobal:
      return "dapoglobal";
  }
  return "?";
}
inline const char* type_name(PolicyLossType t) {
  switch (t) {
    case PolicyLossType::kGrpo:
      return "grpo";
    case PolicyLossType::kBnpo:
      return "bnpo";
    case PolicyLossType::kDrGrpo:
      return "drgrpo";
    case PolicyLossType::kDapo:
      return "dapo";
  }
  return "?";
}
inline const char* level_name(ImportanceSamplingLevel l) {
  return l == ImportanceSamplingLevel::kToken ? "token" : "seq";
}

// A float tensor's viewed elements as double, flat order.
inline std::vector<double> as_doubles(const TestTensor& x) {
  const std::vector<float> f = x.gather_float();
  return std::vector<double>(f.begin(), f.end());
}

// log(sum_j exp(x_j)) in double, from the largest x_j.
inline double log_sum_exp(const std::vector<double>& x) {
  double m = -INFINITY;
  for (double v : x) m = std::max(m, v);
  double s = 0;
  for (double v : x) s += std::exp(v - m);
  return m + std::log(s);
}

// The log-sum-exp of a row x (logits / T) and the entropy of softmax(x), in double.
struct SoftmaxStats {
  double lse, entropy;
};
inline SoftmaxStats softmax_stats(const std::vector<double>& x) {
  const double lse = log_sum_exp(x);
  double h = 0;
  for (double v : x) h -= std::exp(v - lse) * (v - lse);
  return {lse, h};
}

// Makes a [B, L] token tensor of a dtype, stored as the suite's layout wants it.
using TokenTensorFn = std::function<TestTensor(DType)>;

// ---- the per-token inputs ---------------------------------------------------------------------------------------
// What both families take per sequence and per token: ids, advantages, and the optional mask, old and reference
// log-probabilities; `w` holds the mask's values (the token weights) in double.
struct PolicyTokenInputs {
  TestTensor ids, adv, mask, old, ref;
  bool has_mask = false, has_old = false, has_ref = false;
  std::vector<double> w;  // [B*L] token weights

  int64_t id(int64_t t) const { return ids.get_index(t); }
  double a(int64_t b) const { return adv.get(b); }

  // Advantages ~ N(0, 1), then ids uniform in [0, V), both drawn from `rng`.
  void fill_random(std::mt19937_64& rng, int64_t B, int64_t L, int64_t V) {
    std::normal_distribution<double> nd(0.0, 1.0);
    for (int64_t b = 0; b < B; ++b) adv.set(b, static_cast<float>(nd(rng)));
    std::uniform_int_distribution<int64_t> idd(0, V - 1);
    for (int64_t r = 0; r < B * L; ++r) ids.set_index(r, idd(rng));
  }

  // The preset's options, token weights and optional inputs. The mask is made (not yet written: write_mask);
  // old and ref are made by make_old_ref, which needs the true log-probabilities.
  void apply_preset(Preset preset, int64_t B, int64_t L, PolicyLossOptions& o, const TokenTensorFn& token_tensor) {
    w.assign(static_cast<size_t>(B * L), 1.0);
    switch (preset) {
      case Preset::kPlain:
        break;
      case Preset::kFull:
      case Preset::kDapoGlobal:
      case Preset::kBadIdNoCheck:
        has_mask = has_old = has_ref = true;
        o.beta = 0.04;
        o.temperature = 0.7;
        o.eps_high = 0.28;  // DAPO's clip-higher
        mask = token_tensor(DType::kInt32);
        for (int64_t r = 0; r < B * L; ++r) {  // every other sequence has its second half masked
          const int64_t b = r / L, l = r % L;
          w[r] = (b % 2 == 0 && l >= (L + 1) / 2) ? 0.0 : 1.0;
        }
        break;
      case Preset::kFloatMask:
        has_mask = has_old = has_ref = true;
        o.beta = 0.1;
        o.eps_low = 0.1;
        mask = token_tensor(DType::kFloat32);
        for (int64_t r = 0; r < B * L; ++r) w[r] = std::array<double, 4>{0.0, 0.5, 1.0, 2.0}[r % 4];
        break;
      case Preset::kSeedLike:  // seed 003: no old policy (ratio 1 with gradient), reference KL, bool mask
        has_mask = has_ref = true;
        o.beta = 0.04;
        mask = token_tensor(DType::kBool);
        for (int64_t r = 0; r < B * L; ++r) w[r] = (r % 5 == 3) ? 0.0 : 1.0;
        break;
      case Preset::kAllMasked:
        has_mask = has_old = true;
        mask = token_tensor(DType::kUInt8);
        for (int64_t r = 0; r < B * L; ++r) w[r] = 0.0;
        break;
    }
    if (preset == Preset::kBadIdNoCheck) o.check_ids = false;
    if (preset == Preset::kDapoGlobal) {
      double total = 0;
      for (double x : w) total += x;
      o.num_items_in_batch = 1.7 * total + 1.0;  // other micro-batches' tokens count too
    }
  }

  // The token weights into the mask, in its dtype.
  void write_mask() {
    for (int64_t r = 0; r < static_cast<int64_t>(w.size()); ++r) {
      if (mask.dtype() == DType::kFloat32) {
        mask.set(r, static_cast<float>(w[r]));
      } else if (mask.dtype() == DType::kInt32) {
        mask.set_index(r, static_cast<int64_t>(w[r]));
      } else {  // bool / uint8: one byte
        reinterpret_cast<uint8_t*>(const_cast<void*>(mask.host_view().data))[mask.storage_index(r)] =
            static_cast<uint8_t>(w[r] != 0);
      }
    }
  }

  // The preset's ids outside [0, V): kBadIdNoCheck puts some on masked and unmasked tokens alike; the others put
  // -100 on some masked tokens.
  void apply_preset_ids(Preset preset, int64_t V) {
    const int64_t n = static_cast<int64_t>(w.size());
    if (preset == Preset::kBadIdNoCheck) {
      for (int64_t r = 0; r < n; ++r)
        if (r % 7 == 2) ids.set_index(r, r % 2 ? V + 3 : -5);  // some masked (ignored), some not (NaN rows)
    } else {
      for (int64_t r = 0; r < n; ++r)  // masked tokens may hold anything, e.g. -100 padding
        if (w[r] == 0 && r % 3 == 0) ids.set_index(r, -100);
    }
  }

  // Old and reference log-probs near the true ones `lp` (-3 for a bad id), so ratios spread over [0.5, 2] and
  // some clip.
  void make_old_ref(const std::vector<double>& lp, std::mt19937_64& rng, const TokenTensorFn& token_tensor) {
    std::normal_distribution<double> n_old(0.0, 0.3), n_ref(0.0, 0.5);
    auto near = [&](TestTensor& t, std::normal_distribution<double>& noise) {
      t = token_tensor(DType::kFloat32);
      for (int64_t r = 0; r < static_cast<int64_t>(lp.size()); ++r)
        t.set(r, static_cast<float>((std::isfinite(lp[r]) ? lp[r] : -3.0) + noise(rng)));
    };
    if (has_old) near(old, n_old);
    if (has_ref) near(ref, n_ref);
  }

  // The per-token fields of PolicyLossInputs or LinearPolicyLossInputs.
  template <class Inputs>
  void token_views(Inputs& in, bool dev) const {
    in.completion_ids = ids.view(dev);
    in.advantages = adv.view(dev);
    if (has_mask) in.completion_mask = mask.view(dev);
    if (has_old) in.old_logp = old.view(dev);
    if (has_ref) in.ref_logp = ref.view(dev);
  }
  void tokens_to_device() {
    for (TestTensor* t : {&ids, &adv}) t->to_device();
    if (has_mask) mask.to_device();
    if (has_old) old.to_device();
    if (has_ref) ref.to_device();
  }
};

// ---- outputs ------------------------------------------------------------------------------------------------------
// The forward outputs of every policy-loss entry point, in double ([B*L] each; `loss` a scalar).
struct PolicyForwardOut {
  double loss = 0;
  std::vector<double> per_token_loss, kl, logp, entropy, lse;
  std::vector<uint8_t> clipped;
};

// The output tensors of PolicyLossOutputs, poisoned: NaN floats, 0x77 flags.
struct PolicyOutputTensors {
  TestTensor loss, ptl, kl, logp, ent, lse, clipped;

  PolicyOutputTensors(int64_t B, int64_t L)
      : loss(DType::kFloat32, {}),
        ptl(DType::kFloat32, {B, L}),
        kl(DType::kFloat32, {B, L}),
        logp(DType::kFloat32, {B, L}),
        ent(DType::kFloat32, {B, L}),
        lse(DType::kFloat32, {B, L}),
        clipped(DType::kBool, {B, L}) {
    for (TestTensor* t : {&loss, &ptl, &kl, &logp, &ent, &lse}) t->fill_storage_nan();
    clipped.fill_storage_bytes(0x77);
  }
  void to_device() {
    for (TestTensor* t : {&loss, &ptl, &kl, &logp, &ent, &lse, &clipped}) t->to_device();
  }
  void to_host() {
    for (TestTensor* t : {&loss, &ptl, &kl, &logp, &ent, &lse, &clipped}) t->to_host();
  }
  // Every output requested; the entropy only `with_entropy`.
  PolicyLossOutputs views(bool dev, bool with_entropy = true) const {
    PolicyLossOutputs out;
    out.loss = loss.view(dev);
    out.per_token_loss = ptl.view(dev);
    out.kl = kl.view(dev);
    out.is_clipped = clipped.view(dev);
    out.logp = logp.view(dev);
    if (with_entropy) out.entropy = ent.view(dev);
    out.lse = lse.view(dev);
    return out;
  }
  // The host values into `o` (the entropy 0 where it was not requested).
  void read(PolicyForwardOut& o, bool with_entropy = true) const {
    const int64_t n = ptl.numel();
    o.loss = loss.get(0);
    o.per_token_loss = as_doubles(ptl);
    o.kl = as_doubles(kl);
    o.logp = as_doubles(logp);
    o.entropy = with_entropy ? as_doubles(ent) : std::vector<double>(static_cast<size_t>(n), 0.0);
    o.lse = as_doubles(lse);
    o.clipped.clear();
    for (int64_t t = 0; t < n; ++t) o.clipped.push_back(reinterpret_cast<const uint8_t*>(clipped.host_view().data)[t]);
  }
};

// ---- float64 reference --------------------------------------------------------------------------------------------
// The reference's forward outputs (0 at masked tokens), with what the tolerances scale with.
struct PolicyReference : PolicyForwardOut {
  std::vector<double> ratio, dlogp;  // [B*L]: the importance ratio, d(loss)/d(logp) (upstream factor applied)
  double loss_scale = 1;             // the size the loss's rounding errors scale with

  void init(int64_t n) {  // every per-token vector n zeros
    for (auto* v : {&logp, &lse, &entropy, &per_token_loss, &kl, &ratio, &dlogp}) v->assign(n, 0.0);
    clipped.assign(n, 0);
  }
};

// Which tokens the loss leaves out of its sum, beside the masked ones: none; those whose log-probability is NaN (a
// bad id), so that the other tokens' derivatives stay finite; or also those whose loss is NaN (a sequence-level
// ratio made NaN by a bad id elsewhere in the sequence).
enum class SkipNan { kNone, kLogp, kLogpAndLoss };

// The loss as a function of the per-token log-probabilities `lp` of B sequences of L tokens; `base` is what a
// detached logp holds (the ratio without old_logp is exp(lp - base)). Optionally reports the per-token values.
inline double policy_reference_loss(const PolicyTokenInputs& in, int64_t B, int64_t L, const PolicyLossOptions& o,
                                    const std::vector<double>& lp, const std::vector<double>& base,
                                    PolicyReference* out, SkipNan skip = SkipNan::kNone) {
  const double lo = 1 - o.eps_low, hi = 1 + o.eps_high;
  double total_w = 0;
  for (double v : in.w) total_w += v;
  double loss = 0;
  for (int64_t b = 0; b < B; ++b) {
    double wb = 0, s = 0;
    for (int64_t l = 0; l < L; ++l) {
      const int64_t r = b * L + l;
      if (in.w[r] == 0) continue;
      wb += in.w[r];
      const double old = in.has_old ? in.old.get(r) : base[r];
      s += in.w[r] * (lp[r] - old);
    }
    double factor = 0;  // what sum_l w per_token_loss of this sequence is multiplied by
    switch (o.loss_type) {
      case PolicyLossType::kGrpo:
        factor = 1.0 / std::max(wb, 1.0) / static_cast<double>(B);
        break;
      case PolicyLossType::kBnpo:
        factor = 1.0 / std::max(total_w, 1.0);
        break;
      case PolicyLossType::kDrGrpo:
        factor = 1.0 / (static_cast<double>(B) * o.max_completion_length);
        break;
      case PolicyLossType::kDapo:
        factor = 1.0 / (o.num_items_in_batch > 0 ? o.num_items_in_batch : std::max(total_w, 1.0));
        break;
    }
    const double seq_ratio = std::exp(s / std::max(wb, 1.0));
    const double A = in.a(b);
    for (int64_t l = 0; l < L; ++l) {
      const int64_t r = b * L + l;
      if (in.w[r] == 0 || (skip != SkipNan::kNone && std::isnan(lp[r]))) continue;
      const double old = in.has_old ? in.old.get(r) : base[r];
      const double ratio =
          o.importance_sampling_level == ImportanceSamplingLevel::kToken ? std::exp(lp[r] - old) : seq_ratio;
      const double clipped_ratio = std::min(std::max(ratio, lo), hi);
      double kl = 0;
      if (in.has_ref) {
        const double d = in.ref.get(r) - lp[r];
        kl = std::exp(d) - d - 1;
      }
      // With beta = 0 the KL term is no part of the loss (a NaN or inf kl is reported, never multiplied by 0).
      const double tok = -std::min(ratio * A, clipped_ratio * A) + (o.beta != 0 ? o.beta * kl : 0.0);
      if (skip == SkipNan::kLogpAndLoss && std::isnan(tok)) continue;
      loss += factor * in.w[r] * tok;
      if (out) {
        out->per_token_loss[r] = tok;
        out->kl[r] = kl;
        out->ratio[r] = ratio;
        out->clipped[r] = (A > 0 && ratio > hi) || (A < 0 && ratio < lo);
        if (std::isfinite(tok)) out->loss_scale += factor * in.w[r] * (std::abs(A) * ratio + o.beta * (kl + 1));
      }
    }
  }
  return loss;
}

// upstream * d(loss)/d(logp_t) into dlogp[t] for every token of nonzero weight, by central differences in double
// (O(N^2), cheap beside the O(N V) rows at every shape the suites use); NaN where lp[t] is. `loss_at(p)` is the
// loss at log-probabilities p with the detached base kept at lp.
inline void dlogp_by_central_differences(const std::vector<double>& w, const std::vector<double>& lp, double upstream,
                                         const std::function<double(const std::vector<double>&)>& loss_at,
                                         std::vector<double>& dlogp) {
  const double h = 1e-6;
  for (size_t t = 0; t < lp.size(); ++t) {
    if (w[t] == 0) continue;
    if (std::isnan(lp[t])) {
      dlogp[t] = NAN;  // a bad id: NaN row
      continue;
    }
    std::vector<double> p = lp;
    p[t] = lp[t] + h;
    const double fp = loss_at(p);
    p[t] = lp[t] - h;
    const double fm = loss_at(p);
    dlogp[t] = upstream * (fp - fm) / (2 * h);
  }
}

// The suites' inputs (PlInputs, LplInputs) give, beside PolicyTokenInputs, `bad(t)` (token t's id out of range)
// and `row(t)` (token t's logits / T in double, with any finite-difference perturbation applied).

// log_softmax(row(t))[id] of each of the n tokens, masked ones included (NaN for a bad id).
template <class Inputs>
std::vector<double> true_logp(const Inputs& in, int64_t n) {
  std::vector<double> lp(static_cast<size_t>(n), NAN);
  for (int64_t t = 0; t < n; ++t) {
    if (in.bad(t)) continue;
    const std::vector<double> x = in.row(t);
    lp[t] = x[in.id(t)] - log_sum_exp(x);
  }
  return lp;
}

// The reference's forward outputs (NaN at a bad id's unmasked token) and its coefficients d(loss)/d(logp), times
// `upstream`, for B sequences of L tokens; `skip` as in policy_reference_loss for the finite differences.
template <class Inputs>
void policy_reference_forward(const Inputs& in, int64_t B, int64_t L, const PolicyLossOptions& o, double upstream,
                              SkipNan skip, PolicyReference& r) {
  const int64_t N = B * L;
  r.init(N);
  std::vector<double> lp(N, 0.0);
  for (int64_t t = 0; t < N; ++t) {
    if (in.w[t] == 0) continue;
    if (in.bad(t)) {
      r.logp[t] = r.lse[t] = r.entropy[t] = lp[t] = NAN;
      continue;
    }
    const std::vector<double> x = in.row(t);
    const SoftmaxStats st = softmax_stats(x);
    r.lse[t] = st.lse;
    r.entropy[t] = st.entropy;
    lp[t] = r.logp[t] = x[in.id(t)] - st.lse;
  }
  r.loss = policy_reference_loss(in, B, L, o, lp, lp, &r);
  for (int64_t t = 0; t < N; ++t)
    if (in.w[t] != 0 && in.bad(t)) r.per_token_loss[t] = r.kl[t] = NAN;
  // d(loss)/d(logp_t) by central differences in double (the detached base stays fixed).
  dlogp_by_central_differences(
      in.w, lp, upstream,
      [&](const std::vector<double>& p) { return policy_reference_loss(in, B, L, o, p, lp, nullptr, skip); }, r.dlogp);
}

// ---- selective log-softmax ----------------------------------------------------------------------------------------
// The forward outputs of a selective log-softmax, one per row.
struct SelectiveForwardOut {
  std::vector<double> logp, entropy, lse;
};

// Appends the reference's outputs for one row x (logits / T) whose selected class is `id`; returns the row's lse.
inline double push_selective_row(const std::vector<double>& x, int64_t id, SelectiveForwardOut& r) {
  const SoftmaxStats st = softmax_stats(x);
  r.logp.push_back(x[id] - st.lse);
  r.lse.push_back(st.lse);
  r.entropy.push_back(st.entropy);
  return st.lse;
}

// ---- comparing outputs --------------------------------------------------------------------------------------------
// A logp carries a float32 rounding error of about eps * |lse| (lse - x_id cancels), which the ratio and the KL pass
// on, amplified by |A| r and exp(ref - logp): the tolerances scale with those sizes, `u` the first.
inline double logp_unit(const PolicyReference& ref) { return std::max(1.0, max_abs(ref.lse)); }

// The forward outputs but is_clipped (each suite has its own rule there); `ref` gives the sizes.
inline void expect_forward_close(const PolicyForwardOut& got, const PolicyForwardOut& want, const PolicyReference& ref,
                                 DType dt, double u, const std::string& tag) {
  EXPECT_TRUE(all_close(std::vector<double>{got.loss}, std::vector<double>{want.loss}, tolerance(dt, Quantity::kLoss),
                        ref.loss_scale * u, tag + " loss"));
  EXPECT_TRUE(all_close(got.logp, want.logp, tolerance(dt, Quantity::kLse), u, tag + " logp"));
  EXPECT_TRUE(all_close(got.lse, want.lse, tolerance(dt, Quantity::kLse), u, tag + " lse"));
  EXPECT_TRUE(all_close(got.entropy, want.entropy, tolerance(dt, Quantity::kLse), u, tag + " entropy"));
  double amp = 1;
  for (size_t t = 0; t < ref.kl.size(); ++t)
    if (std::isfinite(ref.kl[t])) amp = std::max(amp, ref.kl[t] + 2 + std::abs(ref.per_token_loss[t]));
  EXPECT_TRUE(all_close(got.kl, want.kl, tolerance(dt, Quantity::kLoss), amp * u, tag + " kl"));
  EXPECT_TRUE(all_close(got.per_token_loss, want.per_token_loss, tolerance(dt, Quantity::kLoss), amp * u,
                        tag + " per_token_loss"));
}

// A selective log-softmax's forward outputs, in `dt`'s tolerances scaled by the largest |lse|.
inline void expect_selective_forward_close(const SelectiveForwardOut& got, const SelectiveForwardOut& want, DType dt,
                                           const std::string& who) {
  const double u = std::max(1.0, max_abs(want.lse));
  EXPECT_TRUE(all_close(got.logp, want.logp, tolerance(dt, Quantity::kLse), u, who + " logp"));
  EXPECT_TRUE(all_close(got.lse, want.lse, tolerance(dt, Quantity::kLse), u, who + " lse"));
  EXPECT_TRUE(all_close(got.entropy, want.entropy, tolerance(dt, Quantity::kLse), u, who + " entropy"));
}

// On the GPU, `forward(workspace)` of the small bad-input case (id 6 of V = 6 at token [1, 0]) refuses a missing
// workspace, then, given `workspace_bytes`, names the bad id.
inline void expect_gpu_workspace_and_bad_id_errors(const std::function<void(Workspace)>& forward,
                                                   size_t workspace_bytes) {
  EXPECT_NE(error_of([&] { forward({}); }).find("workspace: expected >="), std::string::npos);
  DeviceScratch ws(workspace_bytes);
  const std::string msg = error_of([&] { forward(ws.ws()); });
  EXPECT_NE(msg.find("completion_ids"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[1, 0]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("got 6"), std::string::npos) << msg;
}

}  // namespace logitless::test
