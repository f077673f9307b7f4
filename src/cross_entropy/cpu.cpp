// Cross-entropy on the CPU: the oracle the CUDA kernels are tested against, and a real backend.
// Per row: two passes (max, then sums) in double, so it is more accurate than any GPU path.
#include <cmath>
#include <limits>
#include <vector>

#include "common/check.h"
#include "common/host_float.h"
#include "cross_entropy/problem.h"

namespace logitless::ce {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

struct RowResult {
  double loss = 0, lse = 0, z = 0;
  bool ignored = true;
};

// Everything about a row that does not depend on the reduction.
struct RowContext {
  const Problem& p;
  double W;  // sum of class weights (V without weights)

  double weight(int64_t j) const { return p.weight ? static_cast<double>(p.weight[j * p.weight_stride]) : 1.0; }

  double capped(double y) const { return p.softcap > 0 ? p.softcap * std::tanh(y / p.softcap) : y; }

  int64_t target(int64_t i) const { return load_index(p.target, p.target_dtype, p.target_rows.offset(i)); }

  bool valid(int64_t t) const { return t >= 0 && t < p.vocab; }

  // x_j of row i (after the cap), in double.
  void load_row(int64_t i, std::vector<double>& x) const {
    const int64_t off = p.logits_rows.offset(i);
    for (int64_t j = 0; j < p.vocab; ++j) x[j] = capped(load_float(p.logits, p.dtype, off + j));
  }

  double lse_of(const std::vector<double>& x) const {
    double m = -std::numeric_limits<double>::infinity();
    bool nan = false;
    for (double v : x) {
      nan = nan || std::isnan(v);
      m = v > m ? v : m;
    }
    if (nan || m == std::numeric_limits<double>::infinity()) return kNaN;
    if (m == -std::numeric_limits<double>::infinity()) return kNaN;  // every logit is -inf
    double s = 0;
    for (double v : x) s += std::exp(v - m);
    return m + std::log(s);
  }

  RowResult forward_row(int64_t i, std::vector<double>& x, double* lse_override) const {
    RowResult r;
    const int64_t t = target(i);
    if (t == p.ignore_index) return r;
    r.ignored = false;
    if (!valid(t)) {
      r.loss = r.lse = r.z = kNaN;
      return r;
    }
    load_row(i, x);
    const double lse = lse_override ? *lse_override : lse_of(x);
    const double eps = p.label_smoothing, V = static_cast<double>(p.vocab);
    double loss = (1 - eps) * weight(t) * (lse - x[t]);
    if (eps != 0) {
      double swx = 0;
      for (int64_t j = 0; j < p.vocab; ++j) swx += weight(j) * x[j];
      loss += eps / V * (W * lse - swx);
    }
    r.z = p.z_loss_scale * lse * lse;
    r.loss = loss + r.z;
    r.lse = lse;
    return r;
  }

  // Writes scale * d(loss_i)/d(logits_i) into the gradient row; x holds the row's capped logits.
  void grad_row(int64_t i, const std::vector<double>& x, double lse, double scale) const {
    const int64_t t = target(i);
    const int64_t off = p.grad_rows.offset(i);
    if (t == p.ignore_index) {
      for (int64_t j = 0; j < p.vocab; ++j) store_float(p.grad, p.dtype, off + j, 0.f);
      return;
    }
    if (!valid(t) || std::isnan(lse)) {
      for (int64_t j = 0; j < p.vocab; ++j) store_float(p.grad, p.dtype, off + j, NAN);
      return;
    }
    const double eps = p.label_smoothing, V = static_cast<double>(p.vocab);
    const double b = scale * (1 - eps) * weight(t);
    const double c = scale * eps / V;
    const double a = b + c * W + scale * 2.0 * p.z_loss_scale * lse;
    for (int64_t j = 0; j < p.vocab; ++j) {
      double g = a * std::exp(x[j] - lse) - c * weight(j) - (j == t ? b : 0.0);
      if (p.softcap > 0) {
        const double u = x[j] / p.softcap;
        g *= 1.0 - u * u;
      }
      store_float(p.grad, p.dtype, off + j, static_cast<float>(g));
    }
  }
};

}  // namespace

void run_cpu(const Problem& p) {
  const int64_t N = p.n_rows, V = p.vocab;
  double W = static_cast<double>(V);
  if (p.weight) {
    W = 0;
    for (int64_t j = 0; j < V; ++j) W += p.weight[j * p.weight_stride];
  }
  const RowContext ctx{p, W};
  // A thread team costs milliseconds beside PyTorch's own OpenMP runtime: small problems run on one thread.
  const bool parallel = N * V >= (int64_t{1} << 16);

  // Targets first: a bad one is reported before any output is written.
  double denom = 0;
  for (int64_t i = 0; i < N; ++i) {
    const int64_t t = ctx.target(i);
    if (t == p.ignore_index) continue;
    if (!ctx.valid(t)) {
      if (p.check_targets)
        throw_invalid(str_cat("target: expected values in [0, ", V, ") or ignore_index (", p.ignore_index,
                              "), got ", t, " at row ", i, " (the first bad row)"));
      continue;  // its loss is NaN; the denominator counts only rows with a valid target
    }
    denom += ctx.weight(t);
  }
  // Mean over no rows is 0 with gradient 0 (documented), not NaN.
  const double inv_denom = p.reduction == Reduction::kMean ? (denom != 0 ? 1.0 / denom : 0.0) : 1.0;

  auto upstream = [&](int64_t i) -> double {
    if (!p.grad_scale) return 1.0;
    return p.grad_scale[p.grad_scale_per_row ? i : 0];
  };

  if (p.mode == Mode::kBackward) {
#pragma omp parallel if (parallel)
    {
      std::vector<double> x(static_cast<size_t>(V));
#pragma omp for schedule(static)
      for (int64_t i = 0; i < N; ++i) {
        const int64_t t = ctx.target(i);
        if (t != p.ignore_index && ctx.valid(t)) ctx.load_row(i, x);
        ctx.grad_row(i, x, p.lse_in[i], upstream(i) * inv_denom);
      }
    }
    return;
  }

  std::vector<double> row_loss(static_cast<size_t>(N));
#pragma omp parallel if (parallel)
  {
    std::vector<double> x(static_cast<size_t>(V));
#pragma omp for schedule(static)
    for (int64_t i = 0; i < N; ++i) {
      const RowResult r = ctx.forward_row(i, x, nullptr);
      row_loss[i] = r.loss;
      if (p.lse) p.lse[i] = static_cast<float>(r.lse);
      if (p.z_loss) p.z_loss[i] = static_cast<float>(r.z);
      if (p.reduction == Reduction::kNone) p.loss[i] = static_cast<float>(r.loss);
      if (p.mode == Mode::kForwardBackward) ctx.grad_row(i, x, r.lse, upstream(i) * inv_denom);
    }
  }
  if (p.reduction != Reduction::kNone) {
    double total = 0;
    for (int64_t i = 0; i < N; ++i) total += row_loss[i];  // fixed order: deterministic
    p.loss[0] = static_cast<float>(total * inv_denom);
  }
}

void scale_rows_cpu(void* grad, DType dtype, const RowLayout& rows, int64_t n_rows, int64_t vocab,
                    const float* scale, bool per_row) {
#pragma omp parallel for schedule(static) if (n_rows * vocab >= (int64_t{1} << 16))
  for (int64_t i = 0; i < n_rows; ++i) {
    const float f = scale[per_row ? i : 0];
    if (f == 1.f) continue;
    const int64_t off = rows.offset(i);
    for (int64_t j = 0; j < vocab; ++j) store_float(grad, dtype, off + j, load_float(grad, dtype, off + j) * f);
  }
}

}  // namespace logitless::ce
