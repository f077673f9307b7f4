// C++ micro-benchmark of the linear cross-entropy's fused Hopper logits GEMM (kernels_hopper.h) against cuBLAS's X·Wᵀ
// with a bfloat16 output, timed in turns in one process (a GPU under load lowers its clocks: whatever ran first on
// an idle one would look fast). Each variant is the same [N, H] x [V, H]ᵀ product with another epilogue:
//   cublas    X·Wᵀ into a bfloat16 [N, V] (the yardstick)
//   mainloop  the fused GEMM with no epilogue (its accumulators dropped): the mainloop's speed alone
//   stats     per-tile softmax statistics (the recompute forward)
//   exp       statistics and E = exp(z - shift) in bfloat16 (the gradient in forward)
//   grad      d(loss)/dZ in bfloat16 from a given lse (the recompute backward)
//   exp_max   exp with every tile's maximum taken before its exponentials (common/debug_hooks.h, kLceExpOnShift)
//   mainloop_pp, exp_pp  mainloop and exp on the ping-pong schedule (the consumer warpgroups alternate: one's epilogue
//             under the other's WGMMAs; common/debug_hooks.h, kLceFusedPingPong), the others cooperative
// and, for the gradient in forward's other two products, cuBLAS's dX = E W (dx_f32, dx_bf16: its output dtype) and
// dW = E^T X (dw_bf16), 2 N H V each.
//
//   bench_lce_gemm [N H V [rounds [variant...]]]     (default 8192 4096 128256 7, every variant)
//
// Prints the median ms of each, its ratio to cuBLAS and its TFLOP/s (2 N H V). Naming variants runs only those
// (e.g. one launch each under a profiler: rounds 1).
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "bench_util.cuh"
#include "common/debug_hooks.h"
#include "linear_cross_entropy/cuda/kernels.h"
#include "linear_cross_entropy/cuda/kernels_hopper.h"

using namespace logitless;
using namespace logitless::lce;

// Normal-ish values of standard deviation `sd` (a sum of four uniforms), from a counter-based hash.
__global__ void fill_normalish(__nv_bfloat16* x, int64_t n, float sd, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    float s = 0.f;
    for (int k = 0; k < 4; ++k) s += hash_uniform(4 * i + k, seed) - 0.5f;
    x[i] = __float2bfloat16(s * sd * 1.7320508f);  // the sum of 4 uniforms on [-1/2, 1/2) has variance 1/3
  }
}

int main(int argc, char** argv) {
  const GemmBenchArgs args(argc, argv, 8192, 4096, 128256, 7);
  const int64_t N = args.dims[0], H = args.dims[1], V = args.dims[2];
  const int rounds = args.rounds;
  const cudaDeviceProp prop = bench_device();
  std::printf("device: %s, %d SMs; N=%lld H=%lld V=%lld, %d rounds\n", prop.name, prop.multiProcessorCount,
              (long long)N, (long long)H, (long long)V, rounds);
  if (!lce::debug::fused_kernels_built() || !fused_gemm_supported(0, DType::kBFloat16, nullptr, H, nullptr, H, H)) {
    std::printf("the fused kernels are not built or not supported here\n");
    return 0;
  }
  const int sms = prop.multiProcessorCount;
  const int64_t tiles = (V + kFusedTileCols - 1) / kFusedTileCols;
  __nv_bfloat16 *x, *w, *z;
  int64_t* target;
  float *partials, *shift, *lse;
  Scalars* scalars;
  CK(cudaMalloc(&x, N * H * 2));
  CK(cudaMalloc(&w, V * H * 2));
  CK(cudaMalloc(&z, N * V * 2));
  CK(cudaMalloc(&target, N * 8));
  CK(cudaMalloc(&partials, N * tiles * 16));
  CK(cudaMalloc(&shift, N * 4));
  CK(cudaMalloc(&lse, N * 4));
  CK(cudaMalloc(&scalars, sizeof(Scalars)));
  fill_normalish<<<1024, 256>>>(x, N * H, 0.5f, 1);  // as bench/lce_probe.py: logits of about 0.64 spread
  fill_normalish<<<1024, 256>>>(w, V * H, 0.02f, 2);
  std::vector<int64_t> ht(N);
  for (int64_t i = 0; i < N; ++i) ht[i] = static_cast<int64_t>((i * 2654435761ull) % V);
  CK(cudaMemcpy(target, ht.data(), N * 8, cudaMemcpyHostToDevice));
  // A mean over N valid rows, no class weights, no bad target (cross_entropy/cuda/params.h).
  const Scalars hs{1.f / static_cast<float>(N), 1.f / static_cast<float>(N), static_cast<float>(V),
                   static_cast<long long>(N)};
  CK(cudaMemcpy(scalars, &hs, sizeof hs, cudaMemcpyHostToDevice));
  std::vector<float> hl(N, std::log(static_cast<float>(V)));
  CK(cudaMemcpy(lse, hl.data(), N * 4, cudaMemcpyHostToDevice));

  FusedGemmParams f;
  f.x = x;
  f.ldx = H;
  f.w = w;
  f.ldw = H;
  f.m = N;
  f.n = V;
  f.k = H;
  f.target = target;
  f.ce.vocab = f.ce.vocab_total = V;
  f.ce.inv_v = 1.f / static_cast<float>(V);
  f.partials = partials;
  f.shift = shift;
  f.lse = lse;
  f.scalars = scalars;
  f.dlogits = z;
  f.ld_dlogits = V;
  ExpGradParams e;
  e.rows = N;
  e.h = H;
  e.v = V;
  e.x = x;
  e.ldx = H;
  e.w = w;
  e.ldw = H;
  e.target = target;
  e.ce = f.ce;
  e.shift = shift;
  launch_target_shift(e, sms, nullptr);
  CK(cudaDeviceSynchronize());

  cublasHandle_t blas;
  CB(cublasCreate(&blas));
  const float one = 1.f, zero = 0.f;
  void *dx, *dw;
  CK(cudaMalloc(&dx, N * H * 4));
  CK(cudaMalloc(&dw, V * H * 2));
  // Column-major C [m, n] = op(A) op(B), bfloat16 operands, float32 accumulation.
  const auto gemm = [&](cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n, int64_t k, const void* a,
                        int64_t lda, const void* b, int64_t ldb, void* c, cudaDataType ct, int64_t ldc) {
    CB(cublasGemmEx(blas, ta, tb, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), &one, a, CUDA_R_16BF,
                    static_cast<int>(lda), b, CUDA_R_16BF, static_cast<int>(ldb), &zero, c, ct, static_cast<int>(ldc),
                    CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  };
  struct Variant {
    const char* name;
    std::function<void()> run;
  };
  // The launch on one schedule (0 cooperative, 1 ping-pong), the hook as it was after it: each variant names its
  // schedule, whatever the library's default.
  using logitless::debug::Hook;
  const auto with_hook = [](Hook h, int64_t value, const std::function<void()>& launch) {
    const int64_t before = logitless::debug::hook(h);
    logitless::debug::set_hook(h, value);
    launch();
    logitless::debug::set_hook(h, before);
  };
  const auto on_schedule = [&](int64_t schedule, const std::function<void()>& launch) {
    with_hook(Hook::kLceFusedPingPong, schedule, launch);
  };
  const auto cooperative = [&](const std::function<void()>& launch) { on_schedule(0, launch); };
  const auto pingpong = [&](const std::function<void()>& launch) { on_schedule(1, launch); };
  std::vector<Variant> all = {
      {"cublas",
       [&] {
         CB(cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(V), static_cast<int>(N), static_cast<int>(H),
                         &one, w, CUDA_R_16BF, static_cast<int>(H), x, CUDA_R_16BF, static_cast<int>(H), &zero, z,
                         CUDA_R_16BF, static_cast<int>(V), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
       }},
      {"mainloop", [&] { cooperative([&] { lce::debug::launch_fused_mainloop(f, sms, nullptr); }); }},
      {"mainloop_pp", [&] { pingpong([&] { lce::debug::launch_fused_mainloop(f, sms, nullptr); }); }},
      {"spin1000",
       [&] {
         FusedGemmParams g = f;
         g.debug_spin = 1000;
         cooperative([&] { lce::debug::launch_fused_mainloop(g, sms, nullptr); });
       }},
      {"spin2000",
       [&] {
         FusedGemmParams g = f;
         g.debug_spin = 2000;
         cooperative([&] { lce::debug::launch_fused_mainloop(g, sms, nullptr); });
       }},
      {"spin4000",
       [&] {
         FusedGemmParams g = f;
         g.debug_spin = 4000;
         cooperative([&] { lce::debug::launch_fused_mainloop(g, sms, nullptr); });
       }},
      // The gradient in forward's other two products, on the E the exp variant wrote: dX = E W (float32 out, as
      // the library runs it, and bfloat16 out) and dW = E^T X (bfloat16 out).
      {"dx_f32", [&] { gemm(CUBLAS_OP_N, CUBLAS_OP_N, H, N, V, w, H, z, V, dx, CUDA_R_32F, H); }},
      {"dx_bf16", [&] { gemm(CUBLAS_OP_N, CUBLAS_OP_N, H, N, V, w, H, z, V, dx, CUDA_R_16BF, H); }},
      {"dw_bf16", [&] { gemm(CUBLAS_OP_N, CUBLAS_OP_T, H, V, N, x, H, z, V, dw, CUDA_R_16BF, H); }},
      {"stats", [&] { launch_fused_stats(f, sms, nullptr); }},
      {"exp", [&] { cooperative([&] { launch_fused_exp(f, sms, nullptr); }); }},
      {"exp_pp", [&] { pingpong([&] { launch_fused_exp(f, sms, nullptr); }); }},
      {"exp_max",
       [&] { cooperative([&] { with_hook(Hook::kLceExpOnShift, 0, [&] { launch_fused_exp(f, sms, nullptr); }); }); }},
      {"grad", [&] { launch_fused_grad(f, sms, nullptr); }},
  };
  std::vector<Variant> vs;
  for (const Variant& v : all)
    if (args.wants(v.name)) vs.push_back(v);

  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (const Variant& v : vs) v.run();  // warm-up (and cuBLAS's heuristics)
  CK(cudaDeviceSynchronize());
  std::vector<std::vector<float>> t(vs.size());
  for (int r = 0; r < rounds; ++r) {
    for (size_t i = 0; i < vs.size(); ++i) {
      CK(cudaEventRecord(a));
      vs[i].run();
      CK(cudaEventRecord(b));
      CK(cudaEventSynchronize(b));
      float ms = 0;
      CK(cudaEventElapsedTime(&ms, a, b));
      t[i].push_back(ms);
    }
  }
  CK(cudaGetLastError());
  float base = 0;
  for (size_t i = 0; i < vs.size(); ++i) {
    std::sort(t[i].begin(), t[i].end());
    const float ms = t[i][t[i].size() / 2];
    if (std::strcmp(vs[i].name, "cublas") == 0) base = ms;
    std::printf("%-11s %9.3f ms  %6.1f TFLOP/s", vs[i].name, ms, 2.0 * N * H * V / ms / 1e9);
    if (base > 0) std::printf("  %.3fx cublas", ms / base);
    std::printf("\n");
  }
  CB(cublasDestroy(blas));
  return 0;
}
