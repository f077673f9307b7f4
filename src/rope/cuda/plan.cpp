#include "rope/cuda/plan.h"

#include <algorithm>

namespace logitless::rope {

namespace {
int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
}  // namespace

Plan plan_rope(const PlanInputs& in) {
  Plan p;
  const int64_t per_vec = 16 / in.elem_bytes, half = in.rot_dim / 2;
  // Whole vectors in both halves and in the pass-through channels (D and Dr/2 multiples of a vector).
  const bool can_vector = in.vector_ok && half % per_vec == 0 && in.head_dim % per_vec == 0;
  if (in.requested == RopeAlgo::kVector && !can_vector) {
    p.why_not = "a base or stride is not 16-byte aligned, or D or Dr / 2 is not a whole number of 16-byte vectors";
    return p;
  }
  p.vector = in.requested != RopeAlgo::kScalar && can_vector;
  const int64_t unit = p.vector ? per_vec : 1;
  p.pair_units = half / unit;
  p.pass_units = (in.head_dim - in.rot_dim) / unit;
  p.x = static_cast<int>(std::min<int64_t>(std::max<int64_t>(p.pair_units, 1), kMaxPairLanes));
  const int64_t heads = std::max<int64_t>(in.heads, 1);
  const int64_t max_lanes = std::max<int64_t>(1, kTargetThreads / p.x);
  // Heads a thread takes: as few as the CTA size allows, but two where there are two; then the fewest lanes that
  // cover the heads in that many steps.
  const int64_t steps = std::max(ceil_div(heads, max_lanes), std::min<int64_t>(heads, 2));
  p.y = static_cast<int>(ceil_div(heads, steps));
  p.z = static_cast<int>(std::clamp<int64_t>(kTargetThreads / (int64_t{p.x} * p.y), 1, kMaxBlockZ));
  p.z = static_cast<int>(std::min<int64_t>(p.z, std::max<int64_t>(in.tokens, 1)));
  p.grid = std::min(ceil_div(in.tokens, p.z), kMaxGrid);
  return p;
}

}  // namespace logitless::rope
