// Linear cross-entropy on the CPU: the oracle the CUDA path is tested against, and a real backend.
//
// Per chunk of tokens: the logits in double (products of the inputs' values summed in double) rounded to
// float32, the cross-entropy family's CPU backend over them (its math, in double, with the gradient written
// in place over the chunk), then the three gradient products in double. Both schedules compute the same
// numbers here; only the CUDA path's memory and time differ between them.
#include <algorithm>
#include <cmath>
#include <vector>

#include "common/check.h"
#include "common/host_float.h"
#include "cross_entropy/problem.h"
#include "linear_cross_entropy/problem.h"

namespace logitless::lce {
namespace {

// Below this many multiply-adds per product a call stays on one thread: an OpenMP team next to PyTorch's own
// runtime costs milliseconds to wake, more than such a product takes.
constexpr int64_t kParallelMacs = int64_t{1} << 20;

bool valid_target(int64_t t, int64_t V) { return t >= 0 && t < V; }

}  // namespace

void run_cpu(const Problem& p) {
  const int64_t N = p.n_tokens, H = p.hidden, V = p.vocab;
  const auto& o = p.options;

  // Targets first: a bad one is reported before any output is written (the backward trusts the forward).
  std::vector<int64_t> target(static_cast<size_t>(N));
  double denom = 0;
  for (int64_t i = 0; i < N; ++i) {
    const int64_t t = load_index(p.target, p.target_dtype, p.target_rows.offset(i));
    target[i] = t;
    if (t == o.ignore_index) continue;
    if (!valid_target(t, V)) {
      if (o.check_targets && p.mode != Mode::kBackward)
        throw_invalid(str_cat("target: expected values in [0, ", V, ") or ignore_index (", o.ignore_index, "), got ", t,
                              " at row ", i, " (the first bad row)"));
      continue;  // its loss and gradient are NaN; the denominator counts only valid rows
    }
    denom += p.class_weight ? static_cast<double>(p.class_weight[t * p.class_weight_stride]) : 1.0;
  }
  // Mean over no rows is 0 with gradient 0 (the cross-entropy family's convention), not NaN.
  const double inv_denom = o.reduction == Reduction::kMean ? (denom != 0 ? 1.0 / denom : 0.0) : 1.0;
  const bool grads = p.mode != Mode::kForward;

  // The weight as float (exact for every input dtype), [V, H] contiguous.
  std::vector<float> w(static_cast<size_t>(V * H));
  for (int64_t j = 0; j < V; ++j)
    for (int64_t k = 0; k < H; ++k) w[j * H + k] = load_float(p.weight.data, p.dtype, j * p.weight.ld + k);
  std::vector<double> bias(static_cast<size_t>(V), 0.0);
  if (p.bias)
    for (int64_t j = 0; j < V; ++j) bias[j] = load_float(p.bias, p.bias_dtype, j * p.bias_stride);

  // Per-token upstream factor of the gradient: incoming gradient (if any) over the mean's denominator.
  std::vector<float> row_scale;
  if (grads) {
    row_scale.resize(static_cast<size_t>(N));
    for (int64_t i = 0; i < N; ++i) {
      const double up = p.grad_scale ? p.grad_scale[p.grad_scale_per_row ? i : 0] : 1.0;
      row_scale[i] = static_cast<float>(up * inv_denom);
    }
  }
  std::vector<float> row_loss(static_cast<size_t>(N)), lse_buf;
  float* lse = p.lse;
  if (!lse) {
    lse_buf.resize(static_cast<size_t>(N));
    lse = lse_buf.data();
  }
  std::vector<double> dw(p.grad_weight.data ? static_cast<size_t>(V * H) : 0, 0.0);
  std::vector<double> db(p.grad_bias ? static_cast<size_t>(V) : 0, 0.0);

  // Chunks of about 16 MB of float32 logits.
  const int64_t chunk = std::max<int64_t>(1, std::min<int64_t>(N, (int64_t{1} << 22) / V));
  std::vector<float> x(static_cast<size_t>(chunk * H)), z(static_cast<size_t>(chunk * V));
  for (int64_t c0 = 0; c0 < N; c0 += chunk) {
    const int64_t rows = std::min(chunk, N - c0);
    const bool parallel = rows * V * H >= kParallelMacs;
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t off = p.hidden_rows.offset(c0 + i);
      for (int64_t k = 0; k < H; ++k) x[i * H + k] = load_float(p.hidden_data, p.dtype, off + k);
    }
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t e = 0; e < rows * V; ++e) {
      const int64_t i = e / V, j = e - i * V;
      const float* xi = &x[i * H];
      const float* wj = &w[j * H];
      double acc = bias[j];
      for (int64_t k = 0; k < H; ++k) acc += static_cast<double>(xi[k]) * wj[k];
      z[e] = static_cast<float>(acc);
    }

    // The cross-entropy of the chunk, per token (reduction none): this file reduces over all chunks.
    ce::Problem q;
    q.mode = p.mode == Mode::kForward ? ce::Mode::kForward
                                      : (p.mode == Mode::kBackward ? ce::Mode::kBackward : ce::Mode::kForwardBackward);
    q.n_rows = rows;
    q.vocab = V;
    q.dtype = DType::kFloat32;
    q.logits = z.data();
    q.logits_rows.nd = 1;
    q.logits_rows.sizes[0] = rows;
    q.logits_rows.strides[0] = V;
    q.target = target.data() + c0;
    q.target_dtype = DType::kInt64;
    q.target_rows.nd = 1;
    q.target_rows.sizes[0] = rows;
    q.target_rows.strides[0] = 1;
    q.weight = p.class_weight;
    q.weight_stride = p.class_weight_stride;
    const bool none = o.reduction == Reduction::kNone;
    q.loss = none && p.loss ? p.loss + c0 : row_loss.data() + c0;
    if (p.mode == Mode::kBackward) {
      q.lse_in = p.lse + c0;
    } else {
      q.lse = lse + c0;
    }
    if (grads) {
      q.grad = z.data();  // in place: each row is read whole before its gradient is written
      q.grad_rows = q.logits_rows;
      q.grad_scale = row_scale.data() + c0;
      q.grad_scale_per_row = true;
    }
    q.ignore_index = o.ignore_index;
    q.reduction = Reduction::kNone;
    q.label_smoothing = static_cast<float>(o.label_smoothing);
    q.z_loss_scale = static_cast<float>(o.z_loss);
    q.softcap = static_cast<float>(o.softcap);
    q.check_targets = false;  // checked above, over every token
    q.device = p.device;
    ce::run_cpu(q);
    if (!grads) continue;

    // z now holds g = d(loss)/d(logits) of the chunk.
    if (p.grad_hidden.data) {
#pragma omp parallel if (parallel)
      {
        std::vector<double> acc(static_cast<size_t>(H));
#pragma omp for schedule(static)
        for (int64_t i = 0; i < rows; ++i) {
          std::fill(acc.begin(), acc.end(), 0.0);
          for (int64_t j = 0; j < V; ++j) {
            const double g = z[i * V + j];
            const float* wj = &w[j * H];
            for (int64_t k = 0; k < H; ++k) acc[k] += g * wj[k];
          }
          const int64_t off = (c0 + i) * p.grad_hidden.ld;
          for (int64_t k = 0; k < H; ++k)
            store_float(p.grad_hidden.data, p.grad_hidden.dtype, off + k, static_cast<float>(acc[k]));
        }
      }
    }
    if (p.grad_weight.data || p.grad_bias) {
#pragma omp parallel for schedule(static) if (parallel)
      for (int64_t j = 0; j < V; ++j) {
        double* dwj = p.grad_weight.data ? &dw[j * H] : nullptr;
        double bsum = 0;
        for (int64_t i = 0; i < rows; ++i) {
          const double g = z[i * V + j];
          bsum += g;
          if (dwj) {
            const float* xi = &x[i * H];
            for (int64_t k = 0; k < H; ++k) dwj[k] += g * xi[k];
          }
        }
        if (p.grad_bias) db[j] += bsum;
      }
    }
  }

  if (p.mode != Mode::kBackward && o.reduction != Reduction::kNone) {
    double total = 0;
    for (int64_t i = 0; i < N; ++i) total += row_loss[i];  // fixed order: deterministic
    p.loss[0] = static_cast<float>(total * inv_denom);
  }
  if (p.grad_weight.data)
    for (int64_t j = 0; j < V; ++j)
      for (int64_t k = 0; k < H; ++k)
        store_float(p.grad_weight.data, p.grad_weight.dtype, j * p.grad_weight.ld + k, static_cast<float>(dw[j * H + k]));
  if (p.grad_bias)
    for (int64_t j = 0; j < V; ++j)
      store_float(p.grad_bias, p.grad_bias_dtype, j * p.grad_bias_stride, static_cast<float>(db[j]));
}

}  // namespace logitless::lce
