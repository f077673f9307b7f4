// Policy losses and selective log-softmax on the CPU: the oracle the CUDA kernels are tested against, and a real
// backend. Per row: two passes (max, then sums) in double; the per-token and per-sequence terms come from
// policy_loss/math.h, the formulas the kernels use, evaluated in double.
#include <cmath>
#include <limits>
#include <vector>

#include "common/check.h"
#include "common/host_float.h"
#include "policy_loss/math.h"
#include "policy_loss/problem.h"

namespace logitless::pl {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

struct RowStats {
  double lse = 0, logp = 0, entropy = 0;
};

struct Ctx {
  const Problem& p;
  double inv_t;

  int64_t id(int64_t r) const { return load_index(p.ids, p.ids_dtype, p.ids_rows.offset(r)); }
  bool valid_id(int64_t t) const { return t >= 0 && t < p.vocab; }
  double weight(int64_t r) const { return p.mask ? mask_weight(p.mask, p.mask_dtype, p.mask_rows.offset(r)) : 1.0; }

  // x_j = logits_j / temperature of row r, in double.
  void load_row(int64_t r, std::vector<double>& x) const {
    const int64_t off = p.logits_rows.offset(r);
    for (int64_t j = 0; j < p.vocab; ++j) x[j] = load_float(p.logits, p.dtype, off + j) * inv_t;
  }

  RowStats stats(const std::vector<double>& x, int64_t t) const {
    RowStats s;
    double m = -std::numeric_limits<double>::infinity();
    bool nan = false;
    for (double v : x) {
      nan = nan || std::isnan(v);
      m = v > m ? v : m;
    }
    if (nan || std::isinf(m)) return {kNaN, kNaN, kNaN};  // a NaN or +inf logit, or every logit -inf
    double sum = 0;
    for (double v : x) sum += std::exp(v - m);
    s.lse = m + std::log(sum);
    s.logp = x[t] - s.lse;
    if (p.entropy) {
      double h = 0;
      for (double v : x) {
        const double lp = v - s.lse, pj = std::exp(lp);
        if (pj > 0) h -= pj * lp;  // 0 log 0 = 0 (a -inf logit)
      }
      s.entropy = h;
    }
    return s;
  }

  // grad_j = c * ([j == t] - p_j) / temperature; c already holds every upstream factor.
  void grad_row(int64_t r, const std::vector<double>& x, double lse, double c, int64_t t) const {
    const int64_t off = p.grad_rows.offset(r);
    const double k = c * inv_t;
    for (int64_t j = 0; j < p.vocab; ++j) {
      const double g = k * ((j == t ? 1.0 : 0.0) - std::exp(x[j] - lse));
      store_float(p.grad, p.dtype, off + j, static_cast<float>(g));
    }
  }

  void fill_row(void* base, const RowLayout& rows, int64_t r, float v) const {
    const int64_t off = rows.offset(r);
    for (int64_t j = 0; j < p.vocab; ++j) store_float(base, p.dtype, off + j, v);
  }
};

[[noreturn]] void throw_bad_id(const Problem& p, int64_t r, int64_t t) {
  if (p.op == Op::kSelective)
    throw_invalid(
        str_cat("ids: expected values in [0, ", p.vocab, "), got ", t, " at row ", r, " (the first bad row)"));
  throw_invalid(str_cat("completion_ids: expected values in [0, ", p.vocab, ") at unmasked tokens, got ", t, " at [",
                        r / p.seq_len, ", ", r % p.seq_len, "] (the first bad token)"));
}

}  // namespace

void run_cpu(const Problem& p) {
  const int64_t N = p.n_rows, V = p.vocab, B = p.n_seqs, L = p.seq_len;
  const Ctx ctx{p, 1.0 / p.temperature};
  // A thread team costs milliseconds beside PyTorch's own OpenMP runtime: small problems run on one thread.
  const bool parallel = N * V >= (int64_t{1} << 16);

  // Token weights, and the ids of the tokens that will be read: a bad one is reported before anything is written.
  std::vector<double> w(static_cast<size_t>(N));
  std::vector<int64_t> ids(static_cast<size_t>(N));
  for (int64_t r = 0; r < N; ++r) {
    w[r] = p.op == Op::kSelective ? 1.0 : ctx.weight(r);
    ids[r] = w[r] != 0 ? ctx.id(r) : 0;
    if (w[r] != 0 && !ctx.valid_id(ids[r]) && p.check_ids && p.mode != Mode::kBackward) throw_bad_id(p, r, ids[r]);
  }

  if (p.mode == Mode::kBackward) {  // selective log-softmax, from the saved lse
#pragma omp parallel if (parallel)
    {
      std::vector<double> x(static_cast<size_t>(V));
#pragma omp for schedule(static)
      for (int64_t r = 0; r < N; ++r) {
        if (!ctx.valid_id(ids[r])) {
          ctx.fill_row(p.grad, p.grad_rows, r, NAN);
          continue;
        }
        ctx.load_row(r, x);
        ctx.grad_row(r, x, p.lse_in[r], p.grad_logp[r], ids[r]);
      }
    }
    return;
  }

  // Pass 1: the statistics of every token that is read.
  std::vector<RowStats> st(static_cast<size_t>(N));
#pragma omp parallel if (parallel)
  {
    std::vector<double> x(static_cast<size_t>(V));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < N; ++r) {
      if (w[r] == 0) continue;  // masked: 0 everywhere, never read
      if (!ctx.valid_id(ids[r])) {
        st[r] = {kNaN, kNaN, kNaN};
        continue;
      }
      ctx.load_row(r, x);
      st[r] = ctx.stats(x, ids[r]);
    }
  }
  for (int64_t r = 0; r < N; ++r) {
    if (p.logp) p.logp[r] = static_cast<float>(st[r].logp);
    if (p.lse) p.lse[r] = static_cast<float>(st[r].lse);
    if (p.entropy) p.entropy[r] = static_cast<float>(st[r].entropy);
  }
  if (p.op == Op::kSelective) return;

  // Per sequence: the weight sums, the reduction's factor, and (sequence level) the shared ratio.
  const TermOptions<double> o{p.beta, p.eps_low, p.eps_high, p.old_logp != nullptr, p.ref_logp != nullptr};
  const size_t nb = static_cast<size_t>(B);
  std::vector<double> wsum(nb, 0.0), factor(nb), ratio(nb, 1.0), ratio_coeff(nb, 0.0);
  double total = 0;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t l = 0; l < L; ++l) wsum[b] += w[b * L + l];
    total += wsum[b];
  }
  auto old_of = [&](int64_t r) {
    return p.old_logp ? static_cast<double>(p.old_logp[p.old_rows.offset(r)]) : st[r].logp;
  };
  auto ref_of = [&](int64_t r) { return p.ref_logp ? static_cast<double>(p.ref_logp[p.ref_rows.offset(r)]) : 0.0; };
  auto adv_of = [&](int64_t b) { return static_cast<double>(p.advantages[b * p.adv_stride]); };
  for (int64_t b = 0; b < B; ++b) {
    factor[b] = seq_factor<double>(p.loss_type, wsum[b], total, B, p.max_completion_length, p.num_items_in_batch);
    if (p.sequence_level()) {
      double s = 0;
      for (int64_t l = 0; l < L; ++l) {
        const int64_t r = b * L + l;
        if (w[r] != 0) s += w[r] * (st[r].logp - old_of(r));
      }
      ratio[b] = std::exp(s / seq_denominator(wsum[b]));
      ratio_coeff[b] = seq_ratio_coeff<double>(ratio[b], adv_of(b), factor[b], wsum[b], o);
    }
  }

  // Per token: values, the loss's terms and c = d(loss)/d(logp).
  std::vector<double> contrib(static_cast<size_t>(N), 0.0), coeff(static_cast<size_t>(N), 0.0);
  for (int64_t r = 0; r < N; ++r) {
    const int64_t b = r / L;
    float loss_tok = 0, kl = 0;
    uint8_t clipped = 0;
    if (w[r] != 0) {
      const TokenTerms<double> t = p.sequence_level()
                                       ? token_terms_seq<double>(st[r].logp, ref_of(r), adv_of(b), ratio[b], o)
                                       : token_terms<double>(st[r].logp, old_of(r), ref_of(r), adv_of(b), o);
      const double k = w[r] * factor[b];
      contrib[r] = k * t.loss;
      coeff[r] = k * t.dlogp + (p.sequence_level() ? w[r] * ratio_coeff[b] : 0.0);
      loss_tok = static_cast<float>(t.loss);
      kl = static_cast<float>(t.kl);
      clipped = t.clipped ? 1 : 0;
    }
    if (p.per_token_loss) p.per_token_loss[r] = loss_tok;
    if (p.kl) p.kl[r] = kl;
    if (p.is_clipped) p.is_clipped[r] = clipped;
  }
  double loss = 0;
  for (int64_t r = 0; r < N; ++r) loss += contrib[r];  // fixed order: deterministic
  p.loss[0] = static_cast<float>(loss);
  if (p.mode != Mode::kForwardBackward) return;

  // Pass 2: the gradient rows; masked tokens and the unused last position get 0.
  const double scale = p.grad_scale ? static_cast<double>(p.grad_scale[0]) : 1.0;
#pragma omp parallel if (parallel)
  {
    std::vector<double> x(static_cast<size_t>(V));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < N; ++r) {
      if (w[r] == 0) {
        ctx.fill_row(p.grad, p.grad_rows, r, 0.f);
        continue;
      }
      if (!ctx.valid_id(ids[r]) || std::isnan(st[r].lse)) {
        ctx.fill_row(p.grad, p.grad_rows, r, NAN);
        continue;
      }
      ctx.load_row(r, x);
      ctx.grad_row(r, x, st[r].lse, coeff[r] * scale, ids[r]);
    }
  }
  const int64_t es = dtype_size(p.dtype);
  for (int64_t b = 0; b < p.n_pad; ++b) {
    char* row = p.grad_pad + b * p.grad_pad_stride * es;
    for (int64_t j = 0; j < V; ++j) store_float(row, p.dtype, j, 0.f);
  }
}

}  // namespace logitless::pl
