// The accumulating product's variant 5: ping-pong, tile 64x256x64, cluster 2x1.
#if defined(LOGITLESS_WITH_CUTLASS)
#include "linear_head/cuda/accumulate_gemm_kernel.cuh"

namespace logitless::head::accumulate {
template bool run<5>(const AccumulateGemm&, const AccumulateGemmConfig&, int, int, cudaStream_t);
}  // namespace logitless::head::accumulate
#endif
