// Launchers of the policy-loss kernels (host side). Each takes validated KernelParams.
#pragma once

#include <cuda_runtime.h>

#include "common/debug_hooks.h"
#include "logitless/tensor.h"
#include "policy_loss/cuda/params.h"
#include "policy_loss/cuda/plan.h"

namespace logitless::pl {

// The row kernel's variants: which instantiation runs.
struct RowsVariant {
  bool with_lse = false;  // the statistics come saved (backward): no statistics pass
  bool entropy = false;   // the statistics pass also accumulates the entropy
  bool top1 = false;      // ... and the row's first maximum (float32 logits, one CTA per row: the streaming kernel)
};

// True when this build holds the row kernel for sm_90+ and the device can launch clusters.
bool cluster_launch_available(int device);

// Resident CTAs per SM of the row kernel at `threads` (the occupancy calculator's answer).
int rows_ctas_per_sm(DType dtype, RowsVariant v, int threads);

// Launches the row kernel over p.n_rows rows with `plan` (p.slice must be plan.slice). Returns false, launching
// nothing, when no cluster of plan.cluster CTAs can be placed on this device.
bool launch_rows(DType dtype, RowsVariant v, const KernelParams& p, const RowsPlan& plan, int sm_count,
                 cudaStream_t stream);

// True when this build holds the row-resident kernel for sm_90+ and the device is Hopper or newer.
bool rows_resident_available(int device);

// Launches the row-resident kernel (kernels_row_resident.cu: the fused pass, each row read once) over p.n_rows rows
// with a kRowResident `plan` (p.slice must be plan.slice). Returns false, launching nothing, when no cluster of
// plan.cluster CTAs with plan.smem_bytes of shared memory each can be placed on this device.
bool launch_rows_resident(DType dtype, RowsVariant v, const KernelParams& p, const RowsPlan& plan, cudaStream_t stream);

// Zeroes `n` rows of `vocab` elements, `stride` elements apart (the unused last position's gradient).
void launch_zero_rows(DType dtype, char* base, int64_t stride, int64_t n, int64_t vocab, cudaStream_t stream);

// Benchmark and test hook (not part of the public API): the plan of the last row kernel launched.
namespace debug {
inline logitless::debug::Slot<RowsPlan> last_rows_plan;
}  // namespace debug

}  // namespace logitless::pl
