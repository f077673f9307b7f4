// One of bench_accumulate_gemm's alternatives to the library's accumulating grad_weight product, compiled once per
// configuration (ACCUMULATE_CONFIG = its index) so that the build runs them in parallel. Each defines
// run_accumulate_config_<index>, which bench_accumulate_gemm.cu calls by its name. Those with WRITES_OUT also build
// the kernel with a bfloat16 output (AccumulateGemm::out); the others return false for it.
#include "linear_head/cuda/accumulate_gemm_kernel.cuh"

namespace acc = logitless::head::accumulate;
using cute::_1;
using cute::_128;
using cute::_2;
using cute::_256;
using cute::_32;
using cute::_64;
using cute::Shape;
using Tile128 = Shape<_128, _128, _64>;
using C21 = Shape<_2, _1, _1>;

#if ACCUMULATE_CONFIG == 0  // the library's: ping-pong 128 × 128, cluster 2 × 1, the builder's staging
using Cfg = acc::Config<Tile128, C21, false, acc::Staging::kAuto>;
#define NAME "pp_auto"
#define WRITES_OUT 1
#elif ACCUMULATE_CONFIG == 1  // 64 × 64 subtiles, the builder's staging (4 C buffers reused by D)
using Cfg = acc::Config<Tile128, C21, false, acc::Staging::kAuto, Shape<_64, _64> >;
#define NAME "pp_epi64"
#elif ACCUMULATE_CONFIG == 2  // 8 C buffers of 64 × 32, 2 D buffers apart
using Cfg = acc::Config<Tile128, C21, false, acc::Staging::kSeparate, Shape<_64, _32>, 8, 2>;
#define NAME "pp_c8d2"
#elif ACCUMULATE_CONFIG == 3  // 4 C buffers of 64 × 64, 2 D buffers apart
using Cfg = acc::Config<Tile128, C21, false, acc::Staging::kSeparate, Shape<_64, _64>, 4, 2>;
#define NAME "pp_epi64_c4d2"
#elif ACCUMULATE_CONFIG == 4  // 6 C buffers of 64 × 32, 2 D buffers apart
using Cfg = acc::Config<Tile128, C21, false, acc::Staging::kSeparate, Shape<_64, _32>, 6, 2>;
#define NAME "pp_c6d2"
#elif ACCUMULATE_CONFIG == 5  // no cluster
using Cfg = acc::Config<Tile128, Shape<_1, _1, _1>, false, acc::Staging::kAuto>;
#define NAME "pp_auto_c11"
#elif ACCUMULATE_CONFIG == 6  // cooperative 256 × 128: both warp groups on one tile, its epilogue after its math
using Cfg = acc::Config<Shape<_256, _128, _64>, C21, true, acc::Staging::kAuto>;
#define NAME "coop256"
#elif ACCUMULATE_CONFIG == 7  // C and D straight between registers and global memory
using Cfg = acc::Config<Tile128, C21, false, acc::Staging::kNoSmem>;
#define NAME "pp_nosmem"
#elif ACCUMULATE_CONFIG == 8  // cluster 1 × 2: A (dZ, from DRAM) multicast instead of B (x, in L2)
using Cfg = acc::Config<Tile128, Shape<_1, _2, _1>, false, acc::Staging::kAuto>;
#define NAME "pp_auto_c12"
#define WRITES_OUT 1
#elif ACCUMULATE_CONFIG == 9  // cooperative 256 × 128, cluster 1 × 2
using Cfg = acc::Config<Shape<_256, _128, _64>, Shape<_1, _2, _1>, true, acc::Staging::kAuto>;
#define NAME "coop256_c12"
#elif ACCUMULATE_CONFIG == 10  // cluster 1 × 2 with 6 C buffers of 64 × 32 and 2 D buffers apart
using Cfg = acc::Config<Tile128, Shape<_1, _2, _1>, false, acc::Staging::kSeparate, Shape<_64, _32>, 6, 2>;
#define NAME "pp_c12_c6d2"
#define WRITES_OUT 1
#elif ACCUMULATE_CONFIG == 11  // the library's tiling, D added by TMA reduce-add stores (no C)
using Cfg = acc::Config<Tile128, C21, false, acc::Staging::kReduce>;
#define NAME "pp_reduce"
#elif ACCUMULATE_CONFIG == 12  // the same, cluster 1 × 2
using Cfg = acc::Config<Tile128, Shape<_1, _2, _1>, false, acc::Staging::kReduce>;
#define NAME "pp_reduce_c12"
#elif ACCUMULATE_CONFIG == 13  // cooperative 256 × 128, reduce-add stores
using Cfg = acc::Config<Shape<_256, _128, _64>, C21, true, acc::Staging::kReduce>;
#define NAME "coop256_reduce"
#elif ACCUMULATE_CONFIG == 14  // the library's, each tile's C prefetched into the L2 first
using Cfg = acc::WithPrefetchC<acc::Config<Tile128, C21, false, acc::Staging::kAuto> >;
#define NAME "pp_prefetch"
#elif ACCUMULATE_CONFIG == 15  // the same, cluster 1 × 2
using Cfg = acc::WithPrefetchC<acc::Config<Tile128, Shape<_1, _2, _1>, false, acc::Staging::kAuto> >;
#define NAME "pp_prefetch_c12"
#endif

#define CAT2(a, b) a##b
#define CAT(a, b) CAT2(a, b)

const char* CAT(accumulate_config_name_, ACCUMULATE_CONFIG)() { return NAME; }

bool CAT(run_accumulate_config_, ACCUMULATE_CONFIG)(const logitless::head::AccumulateGemm& g, float beta, int device,
                                                    int sm_count, cudaStream_t stream) {
#if defined(WRITES_OUT)
  return acc::run<Cfg>(g, beta, device, sm_count, stream);
#else
  return !g.out && acc::Kernel<Cfg>::run(g, beta, device, sm_count, stream);
#endif
}

int CAT(accumulate_config_smem_, ACCUMULATE_CONFIG)() {
  return static_cast<int>(sizeof(typename acc::Kernel<Cfg>::GemmKernel::SharedStorage));
}
int CAT(accumulate_config_stages_, ACCUMULATE_CONFIG)() { return acc::Kernel<Cfg>::Mainloop::DispatchPolicy::Stages; }
