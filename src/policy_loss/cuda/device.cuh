// Device pieces shared by the policy-loss row kernels (kernels_streaming.cu streams each row from global memory,
// kernels_row_resident.cu keeps a CTA's slice of it in shared memory): the per-element work of the shared chunk loops,
// a token's inputs and kind, the per-token epilogues, and the exchange of the statistics between the CTAs of a
// cluster.
#pragma once

#include <cooperative_groups.h>
#include <cuda/ptx>

#include <cfloat>

#include "common/cuda/chunk_loops.cuh"
#include "common/cuda/cluster_exchange.cuh"
#include "common/cuda/first_max.cuh"
#include "common/cuda/online_softmax.cuh"
#include "logitless/tensor.h"
#include "policy_loss/cuda/params.h"
#include "policy_loss/cuda/plan.h"
#include "policy_loss/cuda/tokens.cuh"
#include "policy_loss/math.h"

namespace logitless::pl {
namespace rows_dev {

// The per-element work of the shared loops: the values as they are (the temperature acts through c), the
// online-softmax state with or without the entropy accumulator (and, kTop1, the first maximum of the logits
// themselves: a positive temperature does not reorder them), the softmax gradient.
template <typename T, bool kEntropy, bool kTop1 = false>
struct PolicyElem {
  static constexpr int kVec = Vec<T>::kN;
  float c;  // log2(e) / temperature
  struct Acc {
    float m = -INFINITY, s = 0.f, u = 0.f;
    FirstMax top = FirstMax::none();  // kTop1 only
  };

  __device__ void load(const char* src, int q, int64_t j0, float* x, Acc& a) const {
    Vec<T>::unpack(load16(src + 16 * q), x);
    if constexpr (kTop1) a.top.template add_later<kVec>(x, j0 + static_cast<int64_t>(q) * kVec);
  }
  template <int kN>
  __device__ void add(Acc& a, const float* x) const {
    if constexpr (kEntropy) {
      online_add_entropy<kN>(a.m, a.s, a.u, x, c);
    } else {
      online_add_scaled<kN>(a.m, a.s, x, c);
    }
  }
  template <typename G>
  __device__ void grad(float* v, int q, int64_t, const G& g, float lse_l2, int q_t, int slot_t, int64_t) const {
    softmax_grad_chunk<kVec>(v, g.a, g.b, c, lse_l2, q == q_t, slot_t);
  }
};

struct Coeffs {
  float a, b;  // grad_j = a p_j - [j == id] b
};

// A token's id and weight: what decides whether its row is read. Both loads are unconditional (a masked token's
// id is valid memory too), so neither waits for the other, and the kernel issues them one row ahead.
struct Token {
  int64_t id = 0;
  float w = 0.f;
};

// The rest of a token's inputs, needed only once its row's statistics are known.
struct TokenInputs {
  float adv = 0.f, old = 0.f, ref = 0.f, factor = 0.f;
  float lse = 0.f, saved = 0.f;          // backward: saved lse, and saved logp (policy) or grad_logp (selective)
  float ratio = 0.f, ratio_coeff = 0.f;  // backward, sequence level
};

__device__ __forceinline__ Token load_token(const KernelParams& p, int64_t r) {
  Token k;
  k.w = token_weight(p, r);
  k.id = token_id(p, r);
  return k;
}

template <bool kWithLse>
__device__ __forceinline__ TokenInputs load_inputs(const KernelParams& p, int64_t r) {
  TokenInputs k;
  if (p.op != static_cast<int>(RowOp::kSelective)) {
    const int64_t b = r / p.seq_len;
    k.adv = p.adv[b * p.adv_stride];
    if (p.has_old) k.old = p.old_logp[p.old_rows.offset(r)];
    if (p.has_ref) k.ref = p.ref_logp[p.ref_rows.offset(r)];
    k.factor = p.seq[b].factor;
    if (kWithLse) {
      k.ratio = p.seq[b].ratio;
      k.ratio_coeff = p.seq[b].ratio_coeff;
    }
  }
  if (kWithLse) {
    k.lse = p.lse_in[r];
    k.saved = p.op == static_cast<int>(RowOp::kSelective) ? p.grad_logp[r] : p.logp_in[r];
  }
  return k;
}

enum Kind { kValid = 0, kMasked = 1, kBad = 2 };
__device__ __forceinline__ int kind_of(const KernelParams& p, const Token& k) {
  if (k.w == 0.f) return kMasked;
  return (k.id >= 0 && k.id < p.vocab) ? kValid : kBad;
}

__device__ __forceinline__ TermOptions<float> term_options(const KernelParams& p) {
  return {p.beta, p.eps_low, p.eps_high, p.has_old != 0, p.has_ref != 0};
}

// Outputs of a row that is not read (thread 0 of rank 0): masked tokens get 0, bad ids NaN.
__device__ __forceinline__ void write_skipped(const KernelParams& p, int64_t r, int kind) {
  const float v = kind == kBad ? NAN : 0.f;
  if (p.out_logp) p.out_logp[r] = v;
  if (p.out_lse) p.out_lse[r] = v;
  if (p.out_entropy) p.out_entropy[r] = v;
  if (p.out_top1) p.out_top1[r] = 0;
  if (p.op == static_cast<int>(RowOp::kPolicyToken)) {
    if (p.out_loss) p.out_loss[r] = v;
    if (p.out_kl) p.out_kl[r] = v;
    if (p.out_clipped) p.out_clipped[r] = 0;
    p.row_loss[r] = v;
  }
}

// The forward epilogue of a read row: its outputs (when `writer`) and c = d(loss)/d(logp), scaled by gscale.
__device__ __forceinline__ float forward_epilogue(const KernelParams& p, int64_t r, const TokenInputs& k, float w,
                                                  float lse, float logp, float entropy, bool writer, float gscale) {
  if (writer) {
    if (p.out_logp) p.out_logp[r] = logp;
    if (p.out_lse) p.out_lse[r] = lse;
    if (p.out_entropy) p.out_entropy[r] = entropy;
  }
  if (p.op != static_cast<int>(RowOp::kPolicyToken)) return 0.f;
  const TokenTerms<float> t = token_terms<float>(logp, p.has_old ? k.old : logp, k.ref, k.adv, term_options(p));
  const float kappa = w * k.factor;
  if (writer) {
    if (p.out_loss) p.out_loss[r] = t.loss;
    if (p.out_kl) p.out_kl[r] = t.kl;
    if (p.out_clipped) p.out_clipped[r] = t.clipped ? 1 : 0;
    p.row_loss[r] = kappa * t.loss;
  }
  return kappa * t.dlogp * gscale;
}

// The backward epilogue: c from the saved statistics.
__device__ __forceinline__ float backward_coeff(const KernelParams& p, const TokenInputs& k, float w, float gscale) {
  if (p.op == static_cast<int>(RowOp::kSelective)) return k.saved;
  const TokenTerms<float> t = token_terms_seq<float>(k.saved, k.ref, k.adv, k.ratio, term_options(p));
  return (w * k.factor * t.dlogp + w * k.ratio_coeff) * gscale;
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// Every CTA of a cluster publishes its partial state (m, s, u, sum of the chosen logit) of a row to every peer
// (common/cuda/cluster_exchange.cuh), waits for all of them and merges them in rank order, so that every CTA agrees
// on lse and c to the bit. The block reduction before each call is the CTA barrier the exchange needs between one
// row's reads and the next row's publish.
template <bool kEntropy>
__device__ __forceinline__ void cluster_merge(ClusterExchange<kMaxCluster>& xchg,
                                              typename ClusterExchange<kMaxCluster>::Cursor& cur, int rank, int csize,
                                              float c, float& m, float& s, float& u, float& xt) {
  xchg.publish(cur, rank, csize, make_float4(m, s, u, xt));
  const float4* parts = xchg.wait(cur);
  float M = -INFINITY, S = 0.f, U = 0.f, X = 0.f;
  for (int r = 0; r < csize; ++r) {
    const float4 v = parts[r];
    if constexpr (kEntropy) {
      online_merge_entropy(M, S, U, v.x, v.y, v.z, c);
    } else {
      online_merge_scaled(M, S, v.x, v.y, c);
    }
    X += v.w;
  }
  m = M, s = S, u = U, xt = X;
}
#endif

}  // namespace rows_dev
}  // namespace logitless::pl
