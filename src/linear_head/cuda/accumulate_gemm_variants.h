// What the accumulating product's dispatcher (accumulate_gemm.cu) and its variants' translation units
// (accumulate_gemm_v<N>.cu, each one explicit instantiation of accumulate_gemm_kernel.cuh's run<N>) share, without
// CUTLASS's headers.
#pragma once

#include <cuda_runtime.h>

#include "linear_head/cuda/accumulate_gemm.h"

namespace logitless::head::accumulate {

// Operand alignment every variant is built for: 16 bytes, what TMA takes.
inline constexpr int kAlign16 = 8;  // bfloat16 elements
inline constexpr int kAlign32 = 4;  // float elements

// Variant N (1..kAccumulateGemmVariants) of plan.h's AccumulateGemmConfig: see accumulate_gemm_kernel.cuh.
template <int N>
bool run(const AccumulateGemm& g, const AccumulateGemmConfig& config, int device, int sm_count, cudaStream_t stream);

}  // namespace logitless::head::accumulate
