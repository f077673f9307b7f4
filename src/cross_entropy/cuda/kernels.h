// Launchers of the cross-entropy kernels (host side). Each takes validated KernelParams.
#pragma once

#include <cuda_runtime.h>

#include "common/debug_hooks.h"
#include "cross_entropy/cuda/params.h"
#include "cross_entropy/cuda/plan.h"
#include "logitless/tensor.h"

namespace logitless::ce {

// True when this build holds the Hopper row-resident kernel for the current device's architecture.
bool row_resident_available(int device);

// Returns the number of clusters launched; 0 (launching nothing) when no cluster of plan.cluster CTAs fits.
// `device`: the current device (its launch set-up is cached per device).
int launch_row_resident(DType dtype, const KernelParams& p, const Plan& plan, int device, cudaStream_t stream);

// One CTA per row; with_lse: the gradient from p.lse_in (no statistics pass).
void launch_streaming(DType dtype, const KernelParams& p, bool with_lse, int sm_count, cudaStream_t stream);

void launch_scale_rows(DType dtype, char* grad, const RowLayout& rows, int64_t n_rows, int64_t vocab,
                       const float* scale, bool per_row, int sm_count, cudaStream_t stream);

// Benchmark and test hooks (not part of the public API): a function that may rewrite each plan before it is
// launched, and what the last call ran.
namespace debug {
using PlanHook = void (*)(Plan&);
inline logitless::debug::Slot<PlanHook> plan_hook;
struct LaunchRecord {
  Plan plan;
  int clusters = 0;  // row-resident clusters launched (0: the streaming kernel ran)
};
inline logitless::debug::Slot<LaunchRecord> last_launch;
// What the occupancy calculator reported at the last row-resident launch.
inline logitless::debug::Slot<int> row_resident_max_clusters;
}  // namespace debug

}  // namespace logitless::ce
