#include "glu/cuda/plan.h"

#include <algorithm>

namespace logitless::glu {

Plan plan_glu(const PlanInputs& in) {
  Plan p;
  const int64_t per_vec = 16 / in.elem_bytes;
  const bool can_vector = in.vector_ok && in.width % per_vec == 0;
  if (in.requested == GLUAlgo::kVector && !can_vector) {
    p.why_not = "rows are not all 16-byte aligned, or I is not a whole number of 16-byte vectors";
    return p;
  }
  p.vector = in.requested != GLUAlgo::kScalar && can_vector;
  p.units = p.vector ? in.width / per_vec : in.width;
  // The first CTA size (in order of preference) whose chunks waste at most 1/32 of the row's last chunk slots;
  // failing that, the least wasteful.
  int best = 0;
  double best_waste = 2.0;
  for (const int threads : {256, 128, 512, 64, 32}) {
    const int64_t chunk = int64_t{threads} * kUnitsPerThread;
    const int64_t chunks = (p.units + chunk - 1) / chunk;
    const double waste = p.units == 0 ? 0.0 : static_cast<double>(chunks * chunk - p.units) / (chunks * chunk);
    if (waste <= 1.0 / 32) {
      best = threads;
      break;
    }
    if (waste < best_waste) best = threads, best_waste = waste;
  }
  p.threads = best;
  const int64_t chunk = int64_t{best} * kUnitsPerThread;
  p.chunks = (p.units + chunk - 1) / chunk;
  p.grid_x = std::min(p.chunks, kMaxGridX);
  p.grid_y = std::min(in.n_rows, kMaxGridY);
  return p;
}

}  // namespace logitless::glu
