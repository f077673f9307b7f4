// RMSNorm on the CPU: the oracle the CUDA kernels are tested against, and a real backend. It rounds at the
// same points as the GPU (the casting modes are about where values are rounded to x's dtype), and computes
// its sums in double, so it is at least as accurate as any GPU path.
#include <algorithm>
#include <cmath>
#include <vector>

#include "common/check.h"
#include "common/host_float.h"
#include "rms_norm/problem.h"

namespace logitless::rms {
namespace {

float round_to(DType dt, float v) {
  switch (dt) {
    case DType::kBFloat16:
      return bf16_bits_to_float(float_to_bf16_bits(v));
    case DType::kFloat16:
      return half_bits_to_float(float_to_half_bits(v));
    default:
      return v;
  }
}

// g_j = weight_j + offset in float32; kNone rounds it to x's dtype like a module run in that dtype.
std::vector<float> weight_plus_offset(const void* weight, DType wdt, int64_t H, float offset, RMSNormCasting c,
                                      DType dt) {
  std::vector<float> g(static_cast<size_t>(H));
  for (int64_t j = 0; j < H; ++j) {
    g[j] = load_float(weight, wdt, j) + offset;
    if (c == RMSNormCasting::kNone) g[j] = round_to(dt, g[j]);
  }
  return g;
}

// The value the weight multiplies: s * r rounded to x's dtype, except in Gemma's all-float32 mode.
float normalized(float s, float r, RMSNormCasting c, DType dt) {
  const float n = s * r;
  return c == RMSNormCasting::kGemma ? n : round_to(dt, n);
}

// Below this many elements a call runs on one thread: an OpenMP team costs more than the work, and inside a
// PyTorch process (whose own OpenMP pool may be spinning) starting one costs milliseconds, even for a 1 x 8 call.
constexpr int64_t kParallelElems = int64_t{1} << 16;

}  // namespace

void forward_cpu(const ForwardProblem& p) {
  const int64_t N = p.n_rows, H = p.hidden;
  const DType dt = p.dtype;
  const std::vector<float> g = weight_plus_offset(p.weight, p.weight_dtype, H, p.offset, p.casting, dt);
#pragma omp parallel if (N * H >= kParallelElems)
  {
    std::vector<float> s(static_cast<size_t>(H));
#pragma omp for schedule(static)
    for (int64_t i = 0; i < N; ++i) {
      const int64_t xo = p.x_rows.offset(i);
      double sum_sq = 0;
      // Every element of the row is read before anything is written: y may be x, residual_out x or residual.
      for (int64_t j = 0; j < H; ++j) s[j] = load_float(p.x, dt, xo + j);
      if (p.residual) {
        const int64_t ro = p.residual_rows.offset(i), oo = p.residual_out_rows.offset(i);
        for (int64_t j = 0; j < H; ++j) s[j] = round_to(dt, s[j] + load_float(p.residual, dt, ro + j));
        for (int64_t j = 0; j < H; ++j) store_float(p.residual_out, dt, oo + j, s[j]);
      }
      for (int64_t j = 0; j < H; ++j) sum_sq += static_cast<double>(s[j]) * s[j];
      // The GPU's expression in float32, fed the more exact mean.
      float r = 1.f / std::sqrt(static_cast<float>(sum_sq / static_cast<double>(H)) + p.eps);
      if (p.casting == RMSNormCasting::kNone) r = round_to(dt, r);
      if (p.rstd) p.rstd[i] = r;
      const int64_t yo = p.y_rows.offset(i);
      for (int64_t j = 0; j < H; ++j) {
        const float y =
            p.casting == RMSNormCasting::kGemma ? (s[j] * r) * g[j] : g[j] * normalized(s[j], r, p.casting, dt);
        store_float(p.y, dt, yo + j, y);
      }
    }
  }
}

void backward_cpu(const BackwardProblem& p) {
  const int64_t N = p.n_rows, H = p.hidden;
  const DType dt = p.dtype;
  const std::vector<float> g = weight_plus_offset(p.weight, p.weight_dtype, H, p.offset, p.casting, dt);

  // dW first: grad_x may overwrite grad_y. Columns in blocks, each summed over all rows in row order, so
  // the result does not depend on the thread count.
  if (p.grad_weight) {
    constexpr int64_t kCols = 64;
    const int64_t blocks = (H + kCols - 1) / kCols;
#pragma omp parallel for schedule(static) if (N * H >= kParallelElems)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t c0 = b * kCols, c1 = std::min(H, c0 + kCols);
      double acc[kCols] = {};
      for (int64_t i = 0; i < N; ++i) {
        const int64_t xo = p.x_rows.offset(i), go = p.grad_y_rows.offset(i);
        const float r = p.rstd[i];
        for (int64_t j = c0; j < c1; ++j) {
          const float n = normalized(load_float(p.x, dt, xo + j), r, p.casting, dt);
          acc[j - c0] += static_cast<double>(load_float(p.grad_y, dt, go + j)) * n;
        }
      }
      for (int64_t j = c0; j < c1; ++j)
        store_float(p.grad_weight, p.grad_weight_dtype, j, static_cast<float>(acc[j - c0]));
    }
  }

#pragma omp parallel if (N * H >= kParallelElems)
  {
    std::vector<double> a(static_cast<size_t>(H)), s(static_cast<size_t>(H)), extra(static_cast<size_t>(H));
#pragma omp for schedule(static)
    for (int64_t i = 0; i < N; ++i) {
      const int64_t xo = p.x_rows.offset(i), go = p.grad_y_rows.offset(i), dxo = p.grad_x_rows.offset(i);
      const double r = p.rstd[i];
      double dot = 0;
      for (int64_t j = 0; j < H; ++j) {
        s[j] = load_float(p.x, dt, xo + j);
        a[j] = static_cast<double>(load_float(p.grad_y, dt, go + j)) * g[j];
        dot += a[j] * s[j];
      }
      if (p.grad_residual_out) {
        const int64_t ro = p.grad_residual_out_rows.offset(i);
        for (int64_t j = 0; j < H; ++j) extra[j] = load_float(p.grad_residual_out, dt, ro + j);
      }
      // dx_j = r a_j - s_j r^3 (sum_k a_k s_k) / H (+ the gradient flowing into residual_out).
      const double c = r * r * r * dot / static_cast<double>(H);
      for (int64_t j = 0; j < H; ++j) {
        double dx = r * a[j] - s[j] * c;
        if (p.grad_residual_out) dx += extra[j];
        store_float(p.grad_x, dt, dxo + j, static_cast<float>(dx));
      }
    }
  }
}

}  // namespace logitless::rms
