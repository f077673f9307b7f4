// The activations of the GLU family and their derivatives, written once for the CUDA kernels (F = float) and
// the CPU backend (F = double). See include/logitless/glu.h for the formulas.
#pragma once

#include <cmath>

#include "common/macros.h"
#include "logitless/glu.h"

namespace logitless::glu {

// sqrt(2 / pi), the cubic coefficient of the tanh approximation, 1 / sqrt(2), 1 / sqrt(2 pi).
inline constexpr double kSqrt2OverPi = 0.7978845608028654;
inline constexpr double kGeluCubic = 0.044715;
inline constexpr double kSqrtHalf = 0.7071067811865476;
inline constexpr double kInvSqrt2Pi = 0.3989422804014327;

// act(g), and its derivative in *dact when dact is not null.
template <GLUActivation A, typename F>
LOGITLESS_HD F activation(F g, F* dact) {
  if constexpr (A == GLUActivation::kSiLU) {
    // exp(-g) overflows to inf for g below about -88 (float): s = 0, act = -0, act' = 0, as the limits are.
    const F s = F(1) / (F(1) + std::exp(-g));
    if (dact) *dact = s * (F(1) + g * (F(1) - s));
    return g * s;
  } else if constexpr (A == GLUActivation::kGeluTanh) {
    const F t = std::tanh(F(kSqrt2OverPi) * (g + F(kGeluCubic) * g * g * g));
    if (dact) {
      // Where tanh has saturated, 1 - t^2 is 0 and the second term is 0, even where g^2 overflows (0 * inf).
      const F sech2 = F(1) - t * t;
      const F inner = sech2 == F(0) ? F(0) : F(0.5) * g * sech2 * F(kSqrt2OverPi) * (F(1) + F(3 * kGeluCubic) * g * g);
      *dact = F(0.5) * (F(1) + t) + inner;
    }
    return F(0.5) * g * (F(1) + t);
  } else {
    const F cdf = F(0.5) * (F(1) + std::erf(g * F(kSqrtHalf)));
    if (dact) *dact = cdf + g * F(kInvSqrt2Pi) * std::exp(F(-0.5) * g * g);
    return g * cdf;
  }
}

}  // namespace logitless::glu
