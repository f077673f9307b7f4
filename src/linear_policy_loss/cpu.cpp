// Linear policy losses and linear selective log-softmax on the CPU: the oracle the CUDA path is tested against,
// and a real backend.
//
// Two passes over chunks of the tokens that are read (masked tokens and the unused position are not: no logits
// are computed for them). Pass 1: the logits of a chunk in double (products of the inputs' values summed in
// double), each token's log-sum-exp, logp, entropy and (selective) whether its id is the first maximum. Between
// the passes, per sequence and per token, the policy terms of policy_loss/math.h evaluated in double, as the logits
// backend (policy_loss/cpu.cpp) evaluates them: outputs, the loss, and c = d(loss)/d(logp). Pass 2: the logits
// again, the gradient of each row c ([j == id] - p_j) / temperature, and the three products in double.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "common/check.h"
#include "common/host_float.h"
#include "linear_policy_loss/problem.h"
#include "policy_loss/math.h"

namespace logitless::lpl {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
// Below this many multiply-adds per product a call stays on one thread (an OpenMP team next to PyTorch's own
// runtime costs milliseconds to wake).
constexpr int64_t kParallelMacs = int64_t{1} << 20;

struct Stats {
  double lse = 0, logp = 0, entropy = 0;
  bool top1 = false;  // the id is the row's first maximum
};

[[noreturn]] void throw_bad_id(const pl::Problem& t, int64_t r, int64_t id) {
  if (t.op == pl::Op::kSelective)
    throw_invalid(
        str_cat("ids: expected values in [0, ", t.vocab, "), got ", id, " at row ", r, " (the first bad row)"));
  throw_invalid(str_cat("completion_ids: expected values in [0, ", t.vocab, ") at unmasked tokens, got ", id, " at [",
                        r / t.seq_len, ", ", r % t.seq_len, "] (the first bad token)"));
}

// The logits of chunks of tokens, in double.
class Logits {
 public:
  explicit Logits(const Problem& p) : p_(p), H_(p.hidden), V_(p.vocab) {
    w_.resize(static_cast<size_t>(V_ * H_));
    for (int64_t j = 0; j < V_; ++j)
      for (int64_t k = 0; k < H_; ++k) w_[j * H_ + k] = load_float(p.weight.data, p.dtype, j * p.weight.ld + k);
    bias_.assign(static_cast<size_t>(V_), 0.0);
    if (p.bias)
      for (int64_t j = 0; j < V_; ++j) bias_[j] = load_float(p.bias, p.bias_dtype, j * p.bias_stride);
    // About 32 MB of double logits per chunk.
    chunk_ = std::max<int64_t>(1, (int64_t{1} << 22) / V_);
  }

  int64_t chunk() const { return chunk_; }
  const float* weight_row(int64_t j) const { return &w_[j * H_]; }

  // The hidden row of token t (position t % L of sequence t / L).
  int64_t row_of(int64_t t) const {
    const int64_t L = p_.seq_len();
    return (t / L) * p_.row_len + t % L;
  }

  // x [n, H] (float) and z [n, V] (double) of the tokens `toks`.
  void compute(const std::vector<int64_t>& toks, std::vector<float>& x, std::vector<double>& z) const {
    const int64_t n = static_cast<int64_t>(toks.size());
    x.resize(static_cast<size_t>(n * H_));
    z.resize(static_cast<size_t>(n * V_));
    for (int64_t i = 0; i < n; ++i) {
      const int64_t off = p_.hidden_rows.offset(row_of(toks[i]));
      for (int64_t k = 0; k < H_; ++k) x[i * H_ + k] = load_float(p_.hidden_data, p_.dtype, off + k);
    }
    const bool parallel = n * V_ * H_ >= kParallelMacs;
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t e = 0; e < n * V_; ++e) {
      const int64_t i = e / V_, j = e - i * V_;
      const float* xi = &x[i * H_];
      const float* wj = &w_[j * H_];
      double acc = bias_[j];
      for (int64_t k = 0; k < H_; ++k) acc += static_cast<double>(xi[k]) * wj[k];
      z[e] = acc;
    }
  }

 private:
  const Problem& p_;
  int64_t H_, V_;
  std::vector<float> w_;
  std::vector<double> bias_;
  int64_t chunk_ = 1;
};

// Statistics of one row of logits z (not yet divided by the temperature).
Stats row_stats(const double* z, int64_t V, double inv_t, int64_t id, bool entropy) {
  double m = -std::numeric_limits<double>::infinity();
  bool nan = false;
  for (int64_t j = 0; j < V; ++j) {
    const double x = z[j] * inv_t;
    nan = nan || std::isnan(x);
    m = x > m ? x : m;
  }
  if (nan || std::isinf(m)) return {kNaN, kNaN, kNaN};  // a NaN or +inf logit, or every logit -inf
  double sum = 0;
  for (int64_t j = 0; j < V; ++j) sum += std::exp(z[j] * inv_t - m);
  Stats s;
  s.lse = m + std::log(sum);
  s.logp = z[id] * inv_t - s.lse;
  if (entropy) {
    double h = 0;
    for (int64_t j = 0; j < V; ++j) {
      const double lp = z[j] * inv_t - s.lse, pj = std::exp(lp);
      if (pj > 0) h -= pj * lp;  // 0 log 0 = 0
    }
    s.entropy = h;
  }
  return s;
}

// Whether `id` is the first maximum of the logits z (torch.argmax's answer: the lowest index among equal maxima), on
// z itself: a positive temperature does not reorder it. A row with a NaN logit: false.
bool first_max_is(const double* z, int64_t V, int64_t id) {
  int64_t first = 0;
  for (int64_t j = 0; j < V; ++j) {
    if (std::isnan(z[j])) return false;
    if (z[j] > z[first]) first = j;
  }
  return first == id;
}

}  // namespace

void run_cpu(const Problem& p) {
  const pl::Problem& t = p.tokens;
  const int64_t N = t.n_rows, B = t.n_seqs, L = t.seq_len, H = p.hidden, V = p.vocab;
  const bool policy = t.op == pl::Op::kPolicy;
  const double inv_t = 1.0 / t.temperature;

  // Token weights, and the ids of the tokens that are read: a bad one is reported before anything is written.
  std::vector<double> w(static_cast<size_t>(N), 1.0);
  std::vector<int64_t> ids(static_cast<size_t>(N), 0);
  for (int64_t r = 0; r < N; ++r) {
    if (policy && t.mask) w[r] = pl::mask_weight(t.mask, t.mask_dtype, t.mask_rows.offset(r));
    if (w[r] == 0) continue;
    ids[r] = load_index(t.ids, t.ids_dtype, t.ids_rows.offset(r));
    if ((ids[r] < 0 || ids[r] >= V) && t.check_ids && p.mode != Mode::kBackward) throw_bad_id(t, r, ids[r]);
  }
  auto valid = [&](int64_t r) { return w[r] != 0 && ids[r] >= 0 && ids[r] < V; };
  // The tokens whose logits are read, in order.
  std::vector<int64_t> active;
  for (int64_t r = 0; r < N; ++r)
    if (valid(r)) active.push_back(r);

  const Logits logits(p);
  const int64_t C = logits.chunk();
  std::vector<float> x;
  std::vector<double> z;

  // Pass 1 (forward modes): the statistics of every token that is read; the backward has them saved.
  std::vector<Stats> st(static_cast<size_t>(N));
  if (p.mode == Mode::kBackward) {
    for (int64_t r = 0; r < N; ++r) {
      st[r].lse = p.lse_in[r];
      if (policy) st[r].logp = p.logp_in[r];
    }
  } else {
    for (int64_t r = 0; r < N; ++r)
      if (w[r] != 0 && !valid(r)) st[r] = {kNaN, kNaN, kNaN};
    for (size_t a0 = 0; a0 < active.size(); a0 += static_cast<size_t>(C)) {
      const std::vector<int64_t> toks(active.begin() + a0,
                                      active.begin() + std::min(active.size(), a0 + static_cast<size_t>(C)));
      logits.compute(toks, x, z);
      for (size_t i = 0; i < toks.size(); ++i) {
        const int64_t r = toks[i];
        st[r] = row_stats(&z[i * V], V, inv_t, ids[r], t.entropy != nullptr);
        if (t.is_top1) st[r].top1 = first_max_is(&z[i * V], V, ids[r]);
      }
    }
    for (int64_t r = 0; r < N; ++r) {
      if (t.logp) t.logp[r] = static_cast<float>(st[r].logp);
      if (t.lse) t.lse[r] = static_cast<float>(st[r].lse);
      if (t.entropy) t.entropy[r] = static_cast<float>(st[r].entropy);
      if (t.is_top1) t.is_top1[r] = st[r].top1 ? 1 : 0;
    }
  }

  // c = d(loss)/d(logp) per token, every upstream factor included.
  std::vector<double> coeff(static_cast<size_t>(N), 0.0);
  if (!policy) {
    if (p.mode == Mode::kBackward)
      for (int64_t r = 0; r < N; ++r) coeff[r] = p.grad_logp[r];
  } else {
    // Per sequence: the weight sums, the reduction's factor, and (sequence level) the shared ratio.
    const pl::TermOptions<double> o{t.beta, t.eps_low, t.eps_high, t.old_logp != nullptr, t.ref_logp != nullptr};
    const size_t nb = static_cast<size_t>(B);
    std::vector<double> wsum(nb, 0.0), factor(nb), ratio(nb, 1.0), ratio_coeff(nb, 0.0);
    double total = 0;
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t l = 0; l < L; ++l) wsum[b] += w[b * L + l];
      total += wsum[b];
    }
    auto old_of = [&](int64_t r) {
      return t.old_logp ? static_cast<double>(t.old_logp[t.old_rows.offset(r)]) : st[r].logp;
    };
    auto ref_of = [&](int64_t r) { return t.ref_logp ? static_cast<double>(t.ref_logp[t.ref_rows.offset(r)]) : 0.0; };
    auto adv_of = [&](int64_t b) { return static_cast<double>(t.advantages[b * t.adv_stride]); };
    const bool seq = t.sequence_level();
    for (int64_t b = 0; b < B; ++b) {
      factor[b] = pl::seq_factor<double>(t.loss_type, wsum[b], total, B, t.max_completion_length, t.num_items_in_batch);
      if (seq) {
        double s = 0;
        for (int64_t l = 0; l < L; ++l) {
          const int64_t r = b * L + l;
          if (w[r] != 0) s += w[r] * (st[r].logp - old_of(r));
        }
        ratio[b] = std::exp(s / pl::seq_denominator(wsum[b]));
        ratio_coeff[b] = pl::seq_ratio_coeff<double>(ratio[b], adv_of(b), factor[b], wsum[b], o);
      }
    }
    const double scale = t.grad_scale ? static_cast<double>(t.grad_scale[0]) : 1.0;
    std::vector<double> contrib(static_cast<size_t>(N), 0.0);
    for (int64_t r = 0; r < N; ++r) {
      const int64_t b = r / L;
      float loss_tok = 0, kl = 0;
      uint8_t clipped = 0;
      if (w[r] != 0) {
        const pl::TokenTerms<double> tt =
            seq ? pl::token_terms_seq<double>(st[r].logp, ref_of(r), adv_of(b), ratio[b], o)
                : pl::token_terms<double>(st[r].logp, old_of(r), ref_of(r), adv_of(b), o);
        const double k = w[r] * factor[b];
        contrib[r] = k * tt.loss;
        coeff[r] = (k * tt.dlogp + (seq ? w[r] * ratio_coeff[b] : 0.0)) * scale;
        loss_tok = static_cast<float>(tt.loss);
        kl = static_cast<float>(tt.kl);
        clipped = tt.clipped ? 1 : 0;
      }
      if (p.mode == Mode::kBackward) continue;
      if (t.per_token_loss) t.per_token_loss[r] = loss_tok;
      if (t.kl) t.kl[r] = kl;
      if (t.is_clipped) t.is_clipped[r] = clipped;
    }
    if (t.loss) {
      double loss = 0;
      for (int64_t r = 0; r < N; ++r) loss += contrib[r];  // fixed order: deterministic
      t.loss[0] = static_cast<float>(loss);
    }
  }
  if (p.mode == Mode::kForward || !p.wants_grads()) return;

  // Pass 2: the gradient rows of the tokens that are read, and the three products. Rows of masked tokens and of
  // the unused position are 0; a bad id's row is NaN.
  std::vector<double> dx(p.grad_hidden.data ? static_cast<size_t>(N * H) : 0, 0.0);
  std::vector<double> dw(p.grad_weight.data ? static_cast<size_t>(V * H) : 0, 0.0);
  std::vector<double> db(p.grad_bias ? static_cast<size_t>(V) : 0, 0.0);
  std::vector<int64_t> nan_rows;
  for (int64_t r = 0; r < N; ++r)
    if (w[r] != 0 && !valid(r)) nan_rows.push_back(r);
  for (size_t a0 = 0; a0 < active.size(); a0 += static_cast<size_t>(C)) {
    const std::vector<int64_t> toks(active.begin() + a0,
                                    active.begin() + std::min(active.size(), a0 + static_cast<size_t>(C)));
    const int64_t n = static_cast<int64_t>(toks.size());
    logits.compute(toks, x, z);
    const bool parallel = n * V * H >= kParallelMacs;
    // z becomes g = c ([j == id] - p_j) / temperature.
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t i = 0; i < n; ++i) {
      const int64_t r = toks[i];
      const double k = coeff[r] * inv_t, lse = st[r].lse;
      double* zi = &z[i * V];
      for (int64_t j = 0; j < V; ++j) zi[j] = k * ((j == ids[r] ? 1.0 : 0.0) - std::exp(zi[j] * inv_t - lse));
    }
    if (p.grad_hidden.data) {
#pragma omp parallel for schedule(static) if (parallel)
      for (int64_t i = 0; i < n; ++i) {
        double* acc = &dx[toks[i] * H];
        for (int64_t j = 0; j < V; ++j) {
          const double g = z[i * V + j];
          const float* wj = logits.weight_row(j);
          for (int64_t k = 0; k < H; ++k) acc[k] += g * wj[k];
        }
      }
    }
    if (p.grad_weight.data || p.grad_bias) {
#pragma omp parallel for schedule(static) if (parallel)
      for (int64_t j = 0; j < V; ++j) {
        double* dwj = p.grad_weight.data ? &dw[j * H] : nullptr;
        double bsum = 0;
        for (int64_t i = 0; i < n; ++i) {
          const double g = z[i * V + j];
          bsum += g;
          if (dwj)
            for (int64_t k = 0; k < H; ++k) dwj[k] += g * x[i * H + k];
        }
        if (p.grad_bias) db[j] += bsum;
      }
    }
  }
  if (!nan_rows.empty()) {  // an unchecked bad id: its row of the logits' gradient is NaN, and so is what it reaches
    for (int64_t r : nan_rows)
      if (p.grad_hidden.data) std::fill(dx.begin() + r * H, dx.begin() + (r + 1) * H, kNaN);
    std::fill(dw.begin(), dw.end(), kNaN);
    std::fill(db.begin(), db.end(), kNaN);
  }

  if (p.grad_hidden.data) {
    const head::Matrix& g = p.grad_hidden;
    for (int64_t row = 0; row < p.n_rows; ++row)
      for (int64_t k = 0; k < H; ++k) store_float(g.data, g.dtype, row * g.ld + k, 0.f);
    for (int64_t r = 0; r < N; ++r) {
      if (w[r] == 0) continue;
      const int64_t row = logits.row_of(r);
      for (int64_t k = 0; k < H; ++k) store_float(g.data, g.dtype, row * g.ld + k, static_cast<float>(dx[r * H + k]));
    }
  }
  if (p.grad_weight.data)
    for (int64_t j = 0; j < V; ++j)
      for (int64_t k = 0; k < H; ++k)
        store_float(p.grad_weight.data, p.grad_weight.dtype, j * p.grad_weight.ld + k,
                    static_cast<float>(dw[j * H + k]));
  if (p.grad_bias)
    for (int64_t j = 0; j < V; ++j)
      store_float(p.grad_bias, p.grad_bias_dtype, j * p.grad_bias_stride, static_cast<float>(db[j]));
}

}  // namespace logitless::lpl
