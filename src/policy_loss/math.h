// The per-token and per-sequence algebra of the policy losses, written once for the CUDA kernels (F = float)
// and the CPU backend (F = double). include/logitless/policy_loss.h states the formulas; this file is them.
//
// Every token's loss is a function of its log-probability logp (and, at the sequence level, of its sequence's
// mean log-ratio S_b). The losses are linear in the per-token terms, so d(loss)/d(logits) of a row is
// c * ([j == id] - p_j) / temperature with c = d(loss)/d(logp) of that token, and c is what these functions
// compute besides the values.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/macros.h"
#include "logitless/policy_loss.h"

namespace logitless::pl {

LOGITLESS_HD float pexp(float x) { return expf(x); }
LOGITLESS_HD double pexp(double x) { return exp(x); }

template <typename F>
struct KlTerm {
  F value;  // exp(ref - logp) - (ref - logp) - 1
  F dlogp;  // d value / d logp = 1 - exp(ref - logp)
};

template <typename F>
LOGITLESS_HD KlTerm<F> k3(F logp, F ref) {
  const F d = ref - logp;
  const F e = pexp(d);
  return {e - d - F(1), F(1) - e};
}

template <typename F>
struct ClipTerm {
  F value;       // -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)
  F dratio;      // d value / d r: -A, or 0 where the clip is active
  bool clipped;  // the clip is active (the branch min picks is the constant one)
};

// The PPO-clip term. Where r is inside the clip range both branches of min are equal and the gradient is -A
// (torch's min splits it evenly between two equal branches, and the clamp passes its half through).
template <typename F>
LOGITLESS_HD ClipTerm<F> clip_term(F r, F adv, F eps_low, F eps_high) {
  const F lo = F(1) - eps_low, hi = F(1) + eps_high;
  const bool clipped = (adv > F(0) && r > hi) || (adv < F(0) && r < lo);
  const F rc = r < lo ? lo : (r > hi ? hi : r);
  const F a = r * adv, b = rc * adv;
  return {-(a < b ? a : b), clipped ? F(0) : -adv, clipped};
}

// What every token of sequence b is multiplied by in the reduced loss, per unit of its weight w:
// d(loss)/d(per_token_loss) = w * seq_factor. `weight` is the sequence's sum of w, `total` the batch's.
template <typename F>
LOGITLESS_HD F seq_factor(PolicyLossType type, F weight, F total, int64_t n_seqs, int64_t max_completion_length,
                          F num_items_in_batch) {
  const F one(1);
  switch (type) {
    case PolicyLossType::kGrpo:
      return one / (static_cast<F>(n_seqs) * (weight > one ? weight : one));
    case PolicyLossType::kBnpo:
      return one / (total > one ? total : one);
    case PolicyLossType::kDrGrpo:
      return one / (static_cast<F>(n_seqs) * static_cast<F>(max_completion_length));
    case PolicyLossType::kDapo:
      return num_items_in_batch > F(0) ? one / num_items_in_batch : one / (total > one ? total : one);
  }
  return F(0);
}

// The token's count in S_b's mean: D_b = max(sum of w over the sequence, 1).
template <typename F>
LOGITLESS_HD F seq_denominator(F weight) {
  return weight > F(1) ? weight : F(1);
}

// The options every term needs, in F.
template <typename F>
struct TermOptions {
  F beta, eps_low, eps_high;
  bool has_old, has_ref;
};

// Values of one unmasked token and its own part of c.
template <typename F>
struct TokenTerms {
  F loss;  // per_token_loss (unweighted)
  F kl;    // 0 without ref_logp
  bool clipped;
  F dlogp;  // d(per_token_loss)/d(logp) through this token's own ratio (token level) and KL; the sequence
            // level's ratio term reaches logp through S_b and is added by the caller (see seq_ratio_coeff)
};

// The KL output without a reference: 0, or NaN for a token whose logp is NaN (a bad id or NaN logits), whose
// every output is NaN.
template <typename F>
LOGITLESS_HD F no_kl(F logp) {
  return logp != logp ? logp : F(0);
}

// The KL term's share of a token's loss and of c: with beta = 0 it has none, and the KL value (still reported,
// from a given ref_logp) is never multiplied by 0: an inf or NaN in ref_logp would make the loss NaN (0 * inf),
// and TRL does not evaluate the KL term at all when beta is 0.
template <typename F>
LOGITLESS_HD void add_kl(TokenTerms<F>& t, F logp, F ref_logp, const TermOptions<F>& o) {
  t.kl = no_kl(logp);
  if (!o.has_ref) return;
  const KlTerm<F> k = k3(logp, ref_logp);
  t.kl = k.value;
  if (o.beta != F(0)) {
    t.loss += o.beta * k.value;
    t.dlogp += o.beta * k.dlogp;
  }
}

// Token level: r = exp(logp - old) (old absent: r = exp(logp - logp) = 1 with d r / d logp = 1, the
// exp(logp - logp.detach()) trick; written as the difference so that a NaN logp stays NaN).
template <typename F>
LOGITLESS_HD TokenTerms<F> token_terms(F logp, F old_logp, F ref_logp, F adv, const TermOptions<F>& o) {
  const F r = pexp(logp - (o.has_old ? old_logp : logp));
  const ClipTerm<F> c = clip_term(r, adv, o.eps_low, o.eps_high);
  TokenTerms<F> t;
  t.loss = c.value;
  t.clipped = c.clipped;
  t.dlogp = c.dratio * r;  // d r / d logp = r
  add_kl(t, logp, ref_logp, o);
  return t;
}

// Sequence level: the ratio R = exp(S_b) is shared; only the KL part of c is the token's own.
template <typename F>
LOGITLESS_HD TokenTerms<F> token_terms_seq(F logp, F ref_logp, F adv, F ratio, const TermOptions<F>& o) {
  const ClipTerm<F> c = clip_term(ratio, adv, o.eps_low, o.eps_high);
  TokenTerms<F> t;
  t.loss = c.value;
  t.clipped = c.clipped;
  t.dlogp = F(0);
  add_kl(t, logp, ref_logp, o);
  return t;
}

// Sequence level: the ratio term's share of c for a token of weight w is w * seq_ratio_coeff, where
//   seq_ratio_coeff = d(sum_l w_l factor ratio_term)/dS_b / D_b = factor * W_b * dratio * R / D_b
// (every token of the sequence has the same ratio term; dR/dS = R; dS/dlogp_l = w_l / D_b).
template <typename F>
LOGITLESS_HD F seq_ratio_coeff(F ratio, F adv, F factor, F weight, const TermOptions<F>& o) {
  const ClipTerm<F> c = clip_term(ratio, adv, o.eps_low, o.eps_high);
  return factor * weight * c.dratio * ratio / seq_denominator(weight);
}

}  // namespace logitless::pl
