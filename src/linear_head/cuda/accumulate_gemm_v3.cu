// The accumulating product's variant 3: cooperative, tile 128x256x64, cluster 1x2.
#if defined(LOGITLESS_WITH_CUTLASS)
#include "linear_head/cuda/accumulate_gemm_kernel.cuh"

namespace logitless::head::accumulate {
template bool run<3>(const AccumulateGemm&, const AccumulateGemmConfig&, int, int, cudaStream_t);
}  // namespace logitless::head::accumulate
#endif
