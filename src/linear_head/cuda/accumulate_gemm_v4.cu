// The accumulating product's variant 4: ping-pong, tile 128x128x64, cluster 1x1.
#if defined(LOGITLESS_WITH_CUTLASS)
#include "linear_head/cuda/accumulate_gemm_kernel.cuh"

namespace logitless::head::accumulate {
template bool run<4>(const AccumulateGemm&, const AccumulateGemmConfig&, int, int, cudaStream_t);
}  // namespace logitless::head::accumulate
#endif
