// The per-row algebra of cross-entropy with label smoothing, class weights, z-loss and soft-capping,
// written once for the CUDA kernels (the CPU backend evaluates the same formulas in double).
//
// With x the (capped) logits of a row, p = softmax(x), target t, eps = label_smoothing, w the class
// weights (all ones without them), W = sum_j w_j, z = z_loss scale and s the upstream factor
// (1/denominator for mean, times the incoming gradient):
//   loss = (1-eps) w_t (lse - x_t) + (eps/V) (W lse - sum_j w_j x_j) + z lse^2
//   dloss/dx_j = s * ( p_j * [(1-eps) w_t + (eps/V) W + 2 z lse] - (eps/V) w_j - [j == t] (1-eps) w_t )
// and through the cap x = c tanh(y / c): dx/dy = 1 - (x / c)^2.
#pragma once

#include <cmath>

#include "common/macros.h"

namespace logitless::ce {

struct RowStats {
  float lse;          // log-sum-exp of x
  float x_target;     // x_t
  float sum_wx;       // sum_j w_j x_j (only needed with label smoothing)
};

struct LossTerms {
  float loss;    // the row's loss, z-loss included
  float z_term;  // z * lse^2
};

LOGITLESS_HD LossTerms row_loss(const RowStats& s, float w_t, float W, float eps, float inv_v, float z) {
  float loss = (1.f - eps) * w_t * (s.lse - s.x_target);
  if (eps != 0.f) loss += eps * inv_v * (W * s.lse - s.sum_wx);
  const float zt = z * s.lse * s.lse;
  return {loss + zt, zt};
}

// Gradient coefficients of one row: dx_j = (a * p_j - c * w_j - [j == t] b) * cap'(x_j).
struct GradCoeffs {
  float a, b, c;
};

LOGITLESS_HD GradCoeffs row_grad_coeffs(float lse, float w_t, float W, float eps, float inv_v, float z,
                                        float scale) {
  GradCoeffs g;
  g.b = scale * (1.f - eps) * w_t;
  g.c = scale * eps * inv_v;
  g.a = g.b + g.c * W + scale * 2.f * z * lse;
  return g;
}

}  // namespace logitless::ce
