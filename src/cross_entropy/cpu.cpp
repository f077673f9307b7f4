// Cross-entropy on the CPU: the oracle the CUDA kernels are tested against, and a real backend.
// Per row: two passes (max, then sums) in double, so it is more accurate than any GPU path.
#include <algorithm>
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
  double loss = 0, ce = 0, lse = 0, z = 0;  // loss = ce (the cross-entropy term) + z (the z-loss term)
  bool ignored = true;
};

// Everything about a row that does not depend on the reduction. Column j of a row is class offset + j (a
// vocabulary shard's columns; offset 0 and vocab == V otherwise).
struct RowContext {
  const Problem& p;
  double W;  // sum of the class weights over the whole vocabulary (V without weights)
  int64_t V = p.total_vocab();

  // The weight of class c (global index).
  double class_weight(int64_t c) const { return p.weight ? static_cast<double>(p.weight[c * p.weight_stride]) : 1.0; }
  // The weight of column j.
  double weight(int64_t j) const { return class_weight(p.vocab_offset + j); }

  double capped(double y) const { return p.softcap > 0 ? p.softcap * std::tanh(y / p.softcap) : y; }

  int64_t target(int64_t i) const { return load_index(p.target, p.target_dtype, p.target_rows.offset(i)); }

  bool valid(int64_t t) const { return t >= 0 && t < V; }

  // The column of class t in these logits, or -1 when another shard holds it.
  int64_t column(int64_t t) const {
    const int64_t c = t - p.vocab_offset;
    return c >= 0 && c < p.vocab ? c : -1;
  }

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

  // The loss of a row from its statistics (the algebra of math.h, in double).
  RowResult row_result(int64_t t, double lse, double x_t, double swx) const {
    RowResult r;
    r.ignored = false;
    const double eps = p.label_smoothing;
    double loss = (1 - eps) * class_weight(t) * (lse - x_t);
    if (eps != 0) loss += eps / static_cast<double>(V) * (W * lse - swx);
    r.z = p.z_loss_scale != 0 ? p.z_loss_scale * lse * lse : 0.0;
    r.ce = loss;
    r.loss = loss + r.z;
    r.lse = lse;
    return r;
  }

  RowResult forward_row(int64_t i, std::vector<double>& x) const {
    RowResult r;
    const int64_t t = target(i);
    if (t == p.ignore_index) return r;
    r.ignored = false;
    if (!valid(t)) {
      r.loss = r.ce = r.lse = r.z = kNaN;
      return r;
    }
    load_row(i, x);
    double swx = 0;
    if (p.label_smoothing != 0)
      for (int64_t j = 0; j < p.vocab; ++j) swx += weight(j) * x[j];
    return row_result(t, lse_of(x), x[t], swx);
  }

  // A shard's partial statistics of row i (include/logitless/vocab_parallel.h), in double, stored as float.
  void partials_row(int64_t i, std::vector<double>& x, float* out) const {
    const double inf = std::numeric_limits<double>::infinity();
    double m = -inf, s = 0, x_t = 0, swx = 0;
    const int64_t t = target(i);
    if (t != p.ignore_index && valid(t)) {
      load_row(i, x);
      bool nan = false;
      for (int64_t j = 0; j < p.vocab; ++j) {
        nan = nan || std::isnan(x[j]);
        m = x[j] > m ? x[j] : m;
      }
      if (nan) {
        m = s = kNaN;
      } else if (m == inf) {
        s = kNaN;
      } else if (m != -inf) {
        for (int64_t j = 0; j < p.vocab; ++j) s += std::exp(x[j] - m);
      }
      const int64_t c = column(t);
      if (c >= 0) x_t = x[c];
      if (p.label_smoothing != 0)
        for (int64_t j = 0; j < p.vocab; ++j) swx += weight(j) * x[j];
    }
    out[0] = static_cast<float>(m);
    out[1] = static_cast<float>(s);
    out[2] = static_cast<float>(x_t);
    out[3] = static_cast<float>(swx);
  }

  // Row i's loss from every shard's partials (rank order).
  RowResult finalize_row(int64_t i) const {
    RowResult r;
    const int64_t t = target(i);
    if (t == p.ignore_index) return r;
    r.ignored = false;
    if (!valid(t)) {
      r.loss = r.ce = r.lse = r.z = kNaN;
      return r;
    }
    const double inf = std::numeric_limits<double>::infinity();
    const int64_t N = p.n_rows;
    double M = -inf;
    bool nan = false;
    for (int64_t k = 0; k < p.n_shards; ++k) {
      const double m = p.partials_in[(k * N + i) * 4];
      nan = nan || std::isnan(m);
      M = m > M ? m : M;
    }
    double lse = kNaN, x_t = 0, swx = 0;
    if (!nan && std::isfinite(M)) {
      double s = 0;
      for (int64_t k = 0; k < p.n_shards; ++k) {
        const float* q = p.partials_in + (k * N + i) * 4;
        if (q[0] != -inf) s += static_cast<double>(q[1]) * std::exp(static_cast<double>(q[0]) - M);
        x_t += q[2];
        swx += q[3];
      }
      lse = M + std::log(s);
    }
    return row_result(t, lse, x_t, swx);
  }

  // Writes d(loss_i)/d(logits_i) into the gradient row, its cross-entropy term times `scale` and its z-loss term
  // times `z_scale`; x holds the row's capped logits. A term whose coefficient is 0 is left out, not multiplied
  // by 0 (math.h): a class weight no row targets may be inf or NaN.
  void grad_row(int64_t i, const std::vector<double>& x, double lse, double scale, double z_scale) const {
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
    const double eps = p.label_smoothing;
    const double b = scale * (1 - eps) * class_weight(t);
    const double c = scale * eps / static_cast<double>(V);
    double a = b;
    if (eps != 0) a += c * W;
    if (p.z_loss_scale != 0) a += z_scale * 2.0 * p.z_loss_scale * lse;
    const int64_t tc = column(t);
    for (int64_t j = 0; j < p.vocab; ++j) {
      double g = a * std::exp(x[j] - lse) - (j == tc ? b : 0.0);
      if (eps != 0) g -= c * weight(j);
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
  const int64_t N = p.n_rows, V = p.vocab, Vt = p.total_vocab();
  double W = static_cast<double>(Vt);
  if (p.weight) {
    W = 0;
    for (int64_t j = 0; j < Vt; ++j) W += p.weight[j * p.weight_stride];
  }
  const RowContext ctx{p, W};
  // A thread team costs milliseconds beside PyTorch's own OpenMP runtime: small problems run on one thread.
  const bool parallel = N * std::max<int64_t>(V, 1) >= (int64_t{1} << 16);

  // Targets first: a bad one is reported before any output is written.
  double denom = 0, count = 0;
  for (int64_t i = 0; i < N; ++i) {
    const int64_t t = ctx.target(i);
    if (t == p.ignore_index) continue;
    if (!ctx.valid(t)) {
      if (p.check_targets)
        throw_invalid(str_cat("target: expected values in [0, ", Vt, ") or ignore_index (", p.ignore_index, "), got ",
                              t, " at row ", i, " (the first bad row)"));
      continue;  // its loss is NaN; the denominator counts only rows with a valid target
    }
    denom += ctx.class_weight(t);
    count += 1;
  }
  // Mean: the cross-entropy terms over the target weights' sum (torch's weighted mean), the z-loss terms over the
  // count of rows (so scaling every class weight leaves them alone). Over no rows it is 0 with gradient 0
  // (documented), not NaN.
  const bool mean = p.reduction == Reduction::kMean;
  const double inv_denom = mean ? (denom != 0 ? 1.0 / denom : 0.0) : 1.0;
  const double inv_count = mean ? (count != 0 ? 1.0 / count : 0.0) : 1.0;

  auto upstream = [&](int64_t i) -> double {
    if (!p.grad_scale) return 1.0;
    return p.grad_scale[p.grad_scale_per_row ? i : 0];
  };
  auto z_upstream = [&](int64_t i) -> double {
    if (!p.z_grad_scale) return upstream(i);
    return p.z_grad_scale[p.grad_scale_per_row ? i : 0];
  };

  if (p.mode == Mode::kPartials) {
#pragma omp parallel if (parallel)
    {
      std::vector<double> x(static_cast<size_t>(V));
#pragma omp for schedule(static)
      for (int64_t i = 0; i < N; ++i) ctx.partials_row(i, x, p.partials + i * 4);
    }
    return;
  }

  if (p.mode == Mode::kBackward) {
#pragma omp parallel if (parallel)
    {
      std::vector<double> x(static_cast<size_t>(V));
#pragma omp for schedule(static)
      for (int64_t i = 0; i < N; ++i) {
        const int64_t t = ctx.target(i);
        if (t != p.ignore_index && ctx.valid(t)) ctx.load_row(i, x);
        ctx.grad_row(i, x, p.lse_in[i], upstream(i) * inv_denom, z_upstream(i) * inv_count);
      }
    }
    return;
  }

  std::vector<double> row_loss(static_cast<size_t>(N)), row_z(static_cast<size_t>(N));
#pragma omp parallel if (parallel)
  {
    std::vector<double> x(static_cast<size_t>(V));
#pragma omp for schedule(static)
    for (int64_t i = 0; i < N; ++i) {
      const RowResult r = p.mode == Mode::kFinalize ? ctx.finalize_row(i) : ctx.forward_row(i, x);
      row_loss[i] = r.ce;
      row_z[i] = r.z;
      if (p.lse) p.lse[i] = static_cast<float>(r.lse);
      if (p.z_loss) p.z_loss[i] = static_cast<float>(r.z);
      if (p.reduction == Reduction::kNone) p.loss[i] = static_cast<float>(r.loss);
      if (p.mode == Mode::kForwardBackward)
        ctx.grad_row(i, x, r.lse, upstream(i) * inv_denom, z_upstream(i) * inv_count);
    }
  }
  if (p.reduction != Reduction::kNone) {
    double total = 0, total_z = 0;
    for (int64_t i = 0; i < N; ++i) total += row_loss[i], total_z += row_z[i];  // fixed order: deterministic
    p.loss[0] = static_cast<float>(total * inv_denom + (total_z != 0 ? total_z * inv_count : 0.0));
  }
}

void scale_rows_cpu(void* grad, DType dtype, const RowLayout& rows, int64_t n_rows, int64_t vocab, const float* scale,
                    bool per_row) {
#pragma omp parallel for schedule(static) if (n_rows * vocab >= (int64_t{1} << 16))
  for (int64_t i = 0; i < n_rows; ++i) {
    const float f = scale[per_row ? i : 0];
    if (f == 1.f) continue;
    const int64_t off = rows.offset(i);
    for (int64_t j = 0; j < vocab; ++j) store_float(grad, dtype, off + j, load_float(grad, dtype, off + j) * f);
  }
}

}  // namespace logitless::ce
