// C++ micro-benchmark of the accumulating grad_weight product (linear_head/cuda/accumulate_gemm.h): D (float32,
// [m, n]) = Aᵀ B + β D with A [k, m] and B [k, n] in bfloat16, the product each token group after the first runs
// (m = vocabulary, n = hidden, k = tokens in the group). Timed in turns in one process against cuBLAS:
//   cublas_b0, cublas_b1  cuBLAS with β = 0 (no read of D) and β = 1
//   cublas_b1_cast        cuBLAS with β = 1, then D cast into a bfloat16 copy: the last token group's product
//                         and the sums' cast after it
//   <config>, <config>/b0  each of accumulate_configs.cu's CUTLASS configurations with β = 1 and β = 0 (its first,
//                         pp_auto, is the library's; the reduce-add ones, which read no C, with β = 1 only)
//   <config>/bf16         the same with β = 1 into a bfloat16 out, D only read: the last group's product and the
//                         cast in one (the configurations that build it: accumulate_configs.cu, WRITES_OUT)
// β = 0 against β = 1 shows what reading the float32 D costs beyond the math and the write.
//
//   bench_accumulate_gemm [M N K [rounds [variant...]]]   (default 128256 2048 2048 7, every variant)
//
// Before timing, each configuration's D is checked against cuBLAS's (β = 0, then β = 1 on top of it). Prints the
// median ms of each (a block of launches per turn), its ratio to cublas_b0 and its TFLOP/s. With
// BENCH_BLOCK_LOG=path, each timed block's variant and wall-clock start and end (ms since the epoch) go there, to
// line up with a clock and power log taken beside it.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "bench_util.cuh"
#include "linear_head/cuda/accumulate_gemm.h"
#include "linear_head/cuda/kernels.h"

using logitless::head::AccumulateGemm;
using RunFn = bool (*)(const AccumulateGemm&, float, int, int, cudaStream_t);

#define DECLARE_CONFIG(i)                                                               \
  const char* accumulate_config_name_##i();                                             \
  bool run_accumulate_config_##i(const AccumulateGemm&, float, int, int, cudaStream_t); \
  int accumulate_config_smem_##i();                                                     \
  int accumulate_config_stages_##i();
DECLARE_CONFIG(0)
DECLARE_CONFIG(1)
DECLARE_CONFIG(2)
DECLARE_CONFIG(3)
DECLARE_CONFIG(4)
DECLARE_CONFIG(5)
DECLARE_CONFIG(6)
DECLARE_CONFIG(7)
DECLARE_CONFIG(8)
DECLARE_CONFIG(9)
DECLARE_CONFIG(10)
DECLARE_CONFIG(11)
DECLARE_CONFIG(12)
DECLARE_CONFIG(13)
DECLARE_CONFIG(14)
DECLARE_CONFIG(15)

struct ConfigEntry {
  const char* name;
  RunFn run;
  int smem, stages;
};
#define CONFIG(i)                                                                          \
  ConfigEntry {                                                                            \
    accumulate_config_name_##i(), run_accumulate_config_##i, accumulate_config_smem_##i(), \
        accumulate_config_stages_##i()                                                     \
  }

__global__ void fill_uniform(__nv_bfloat16* x, int64_t n, float lo, float hi, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    x[i] = __float2bfloat16(lo + (hi - lo) * hash_uniform(i, seed));
}

__device__ float as_float(float x) { return x; }
__device__ float as_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// max |d - ref| / max |ref|, over n values.
template <class T>
__global__ void max_diff(const T* d, const float* ref, int64_t n, float* out) {
  float e = 0.f, r = 0.f;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    e = fmaxf(e, fabsf(as_float(d[i]) - ref[i]));
    r = fmaxf(r, fabsf(ref[i]));
  }
  atomicMax(reinterpret_cast<int*>(out), __float_as_int(e));  // non-negative floats order as their bits
  atomicMax(reinterpret_cast<int*>(out) + 1, __float_as_int(r));
}

static double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::system_clock::now().time_since_epoch()).count();
}

int main(int argc, char** argv) {
  const GemmBenchArgs args(argc, argv, 128256, 2048, 2048, 7);
  const int64_t M = args.dims[0], N = args.dims[1], K = args.dims[2];
  const int rounds = args.rounds;
  const cudaDeviceProp prop = bench_device();
  const int sms = prop.multiProcessorCount;
  std::printf("device: %s, %d SMs; M=%lld N=%lld K=%lld, %d rounds\n", prop.name, sms, (long long)M, (long long)N,
              (long long)K, rounds);
  if (prop.major != 9) {
    std::printf("the CUTLASS configurations need compute capability 9.0\n");
    return 0;
  }
  const std::vector<ConfigEntry> configs = {CONFIG(0),  CONFIG(1),  CONFIG(2),  CONFIG(3), CONFIG(4),  CONFIG(5),
                                            CONFIG(6),  CONFIG(7),  CONFIG(8),  CONFIG(9), CONFIG(10), CONFIG(11),
                                            CONFIG(12), CONFIG(13), CONFIG(14), CONFIG(15)};
  __nv_bfloat16 *a, *b;
  __nv_bfloat16* out;
  float *d, *ref, *diff;
  CK(cudaMalloc(&out, M * N * 2));
  CK(cudaMalloc(&a, K * M * 2));
  CK(cudaMalloc(&b, K * N * 2));
  CK(cudaMalloc(&d, M * N * 4));
  CK(cudaMalloc(&ref, M * N * 4));
  CK(cudaMalloc(&diff, 8));
  fill_uniform<<<1024, 256>>>(a, K * M, 0.f, 1.f, 1);  // exponentials of logits below their shift
  fill_uniform<<<1024, 256>>>(b, K * N, -1.f, 1.f, 2);
  const AccumulateGemm g{logitless::DType::kBFloat16, M, N, K, a, M, b, N, d, N};
  AccumulateGemm g_out = g;
  g_out.out = out;
  g_out.ldo = N;

  cublasHandle_t blas;
  CB(cublasCreate(&blas));
  // Row-major D [m, n] is column-major [n, m]: D = B_cm [n, k] · (A_cm [m, k])ᵀ.
  const auto cublas = [&](float beta, float* out) {
    const float one = 1.f;
    CB(cublasGemmEx(blas, CUBLAS_OP_N, CUBLAS_OP_T, int(N), int(M), int(K), &one, b, CUDA_R_16BF, int(N), a,
                    CUDA_R_16BF, int(M), &beta, out, CUDA_R_32F, int(N), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  };
  // d (or out, within bfloat16's rounding) against ref, both already computed.
  const auto check = [&](const char* what, float beta, bool bf16 = false) {
    CK(cudaMemset(diff, 0, 8));
    if (bf16)
      max_diff<<<1024, 256>>>(out, ref, M * N, diff);
    else
      max_diff<<<1024, 256>>>(d, ref, M * N, diff);
    float h[2];
    CK(cudaMemcpy(h, diff, 8, cudaMemcpyDeviceToHost));
    const float rel = h[0] / std::max(h[1], 1e-30f), bound = bf16 ? 4e-3f : 1e-5f;
    std::printf("check %-14s beta=%g%s: max |d - cublas| / max |cublas| = %.2e%s\n", what, beta, bf16 ? " bf16" : "",
                rel, rel < bound ? "" : "  MISMATCH");
    return rel < bound;
  };
  bool ok = true;
  struct Usable {
    ConfigEntry c;
    bool writes_out;
  };
  std::vector<Usable> usable;
  for (const ConfigEntry& c : configs) {
    std::printf("config %-14s smem %6d B, %d mainloop stages\n", c.name, c.smem, c.stages);
    cublas(0.f, ref);
    CK(cudaMemset(d, 0xff, M * N * 4));  // NaN: a tile left unwritten shows
    if (!c.run(g, 0.f, 0, sms, nullptr)) {
      std::printf("check %-14s: CUTLASS cannot run it here\n", c.name);
      continue;
    }
    bool good = check(c.name, 0.f);
    cublas(1.f, ref);  // ref = 2 Aᵀ B
    if (!c.run(g, 1.f, 0, sms, nullptr)) std::exit(1);
    good = check(c.name, 1.f) && good;
    cublas(0.f, d);  // out = d + aᵀ b with d = aᵀ b: 2 aᵀ b, as ref
    CK(cudaMemset(out, 0xff, M * N * 2));
    const bool writes_out = c.run(g_out, 1.f, 0, sms, nullptr);
    if (writes_out) good = check(c.name, 1.f, true) && good;
    ok = ok && good;
    if (good) usable.push_back({c, writes_out});
  }

  struct Variant {
    std::string name;
    std::function<void()> run;
  };
  std::vector<Variant> all = {{"cublas_b0", [&] { cublas(0.f, d); }},
                              {"cublas_b1", [&] { cublas(1.f, d); }},
                              {"cublas_b1_cast", [&] {
                                 cublas(1.f, d);
                                 // The library's cast, which its call runs after cuBLAS's product.
                                 logitless::head::launch_cast(d, N, M, N, out, logitless::DType::kBFloat16, N, 1, sms,
                                                              nullptr);
                               }}};
  for (const Usable& u : usable) {
    const ConfigEntry c = u.c;
    all.push_back({c.name, [&g, &sms, c] { c.run(g, 1.f, 0, sms, nullptr); }});
    // A reduce-add configuration's β = 0 zeroes D first: no product without D's traffic to time there.
    if (std::string(c.name).find("reduce") == std::string::npos)
      all.push_back({std::string(c.name) + "/b0", [&g, &sms, c] { c.run(g, 0.f, 0, sms, nullptr); }});
    if (u.writes_out)
      all.push_back({std::string(c.name) + "/bf16", [&g_out, &sms, c] { c.run(g_out, 1.f, 0, sms, nullptr); }});
  }
  std::vector<Variant> vs;
  for (const Variant& v : all)
    if (args.wants(v.name)) vs.push_back(v);

  FILE* blocks = std::getenv("BENCH_BLOCK_LOG") ? std::fopen(std::getenv("BENCH_BLOCK_LOG"), "w") : nullptr;
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  for (const Variant& v : vs) v.run();  // warm-up (and cuBLAS's heuristics)
  CK(cudaDeviceSynchronize());
  const int reps = 10;  // launches per timed block: long enough for a clock and power log to sample it
  std::vector<std::vector<float>> t(vs.size());
  for (int r = 0; r < rounds; ++r) {
    for (size_t i = 0; i < vs.size(); ++i) {
      const double w0 = now_ms();
      CK(cudaEventRecord(e0));
      for (int j = 0; j < reps; ++j) vs[i].run();
      CK(cudaEventRecord(e1));
      CK(cudaEventSynchronize(e1));
      if (blocks) std::fprintf(blocks, "%s %.1f %.1f\n", vs[i].name.c_str(), w0, now_ms());
      float ms = 0;
      CK(cudaEventElapsedTime(&ms, e0, e1));
      t[i].push_back(ms / reps);
    }
  }
  CK(cudaGetLastError());
  if (blocks) std::fclose(blocks);
  float base = 0;
  for (size_t i = 0; i < vs.size(); ++i) {
    std::sort(t[i].begin(), t[i].end());
    const float ms = t[i][t[i].size() / 2];
    if (vs[i].name == "cublas_b0") base = ms;
    std::printf("%-18s %8.3f ms  %6.1f TFLOP/s", vs[i].name.c_str(), ms, 2.0 * M * N * K / ms / 1e9);
    if (base > 0) std::printf("  %.3fx cublas_b0", ms / base);
    std::printf("\n");
  }
  CB(cublasDestroy(blas));
  return ok ? 0 : 1;
}
