// The accumulating product's variant 2: cooperative, tile 256x128x64, cluster 2x1.
#if defined(LOGITLESS_WITH_CUTLASS)
#include "linear_head/cuda/accumulate_gemm_kernel.cuh"

namespace logitless::head::accumulate {
template bool run<2>(const AccumulateGemm&, const AccumulateGemmConfig&, int, int, cudaStream_t);
}  // namespace logitless::head::accumulate
#endif
