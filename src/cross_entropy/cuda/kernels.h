// Launchers of the cross-entropy kernels (host side). Each takes validated KernelParams.
#pragma once

#include <cuda_runtime.h>

#include "cross_entropy/cuda/params.h"
#include "cross_entropy/cuda/plan.h"
#include "logitless/tensor.h"

namespace logitless::ce {

// True when this build holds the Hopper row-resident kernel for the current device's architecture.
bool row_resident_available(int device);

// Returns false (launching nothing) when no cluster of plan.cluster CTAs fits on the device.
bool launch_row_resident(DType dtype, const KernelParams& p, const Plan& plan, cudaStream_t stream);

// One CTA per row; with_lse: the gradient from p.lse_in (no statistics pass).
void launch_streaming(DType dtype, const KernelParams& p, bool with_lse, int sm_count, cudaStream_t stream);

void launch_scale_rows(DType dtype, char* grad, const RowLayout& rows, int64_t n_rows, int64_t vocab,
                       const float* scale, bool per_row, int sm_count, cudaStream_t stream);

}  // namespace logitless::ce
