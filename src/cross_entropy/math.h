// The per-row algebra of cross-entropy with label smoothing, class weights, z-loss and soft-capping,
// written once for the CUDA kernels (the CPU backend evaluates the same formulas in double).
//
// With x the (capped) logits of a row, p = softmax(x), target t, eps = label_smoothing, w the class
// weights (all ones without them), W = sum_j w_j, z = z_loss scale, s the cross-entropy term's upstream factor
// (1/sum of the target weights for mean, times the incoming gradient) and s_z the z-loss term's (1/count of the
// rows not ignored for mean, times the incoming gradient; the z-loss does not scale with the class weights):
//   loss = (1-eps) w_t (lse - x_t) + (eps/V) (W lse - sum_j w_j x_j) + z lse^2
//   dloss/dx_j = p_j * [s (1-eps) w_t + s (eps/V) W + s_z 2 z lse] - s (eps/V) w_j - [j == t] s (1-eps) w_t
// and through the cap x = c tanh(y / c): dx/dy = 1 - (x / c)^2.
//
// A term whose coefficient is 0 (eps = 0, z = 0) is left out rather than multiplied by 0: its factor may be
// inf or NaN (a class weight no row targets, the sum W of such weights), and 0 * inf would make every gradient
// NaN where the loss itself is finite.
#pragma once

#include <cmath>

#include "common/macros.h"

namespace logitless::ce {

struct RowStats {
  float lse;       // log-sum-exp of x
  float x_target;  // x_t
  float sum_wx;    // sum_j w_j x_j (only needed with label smoothing)
};

struct LossTerms {
  float loss;    // the row's loss, z-loss included
  float z_term;  // z * lse^2
  float ce;      // loss without the z-loss term (what a mean divides by the target weights)
};

LOGITLESS_HD LossTerms row_loss(const RowStats& s, float w_t, float W, float eps, float inv_v, float z) {
  float loss = (1.f - eps) * w_t * (s.lse - s.x_target);
  if (eps != 0.f) loss += eps * inv_v * (W * s.lse - s.sum_wx);
  const float zt = z != 0.f ? z * s.lse * s.lse : 0.f;
  return {loss + zt, zt, loss};
}

// A row's share of a reduced loss: the cross-entropy term over the target weights' sum and the z-loss term over
// the count (inv_denom = inv_count = 1 for sum and none, where this is the row's loss).
LOGITLESS_HD float reduced_row_loss(const LossTerms& lt, float inv_denom, float inv_count) {
  return lt.z_term != 0.f ? lt.ce * inv_denom + lt.z_term * inv_count : lt.ce * inv_denom;
}

// Gradient coefficients of one row: dx_j = (a * p_j - c * w_j - [j == t] b) * cap'(x_j).
struct GradCoeffs {
  float a, b, c;
};

// `scale`: the cross-entropy term's upstream factor s; `z_scale`: the z-loss term's s_z.
LOGITLESS_HD GradCoeffs row_grad_coeffs(float lse, float w_t, float W, float eps, float inv_v, float z, float scale,
                                        float z_scale) {
  GradCoeffs g;
  g.b = scale * (1.f - eps) * w_t;
  g.c = scale * eps * inv_v;
  g.a = g.b;
  if (eps != 0.f) g.a += g.c * W;
  if (z != 0.f) g.a += z_scale * 2.f * z * lse;
  return g;
}

}  // namespace logitless::ce
