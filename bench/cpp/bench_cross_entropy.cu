// C++ micro-benchmark of the cross-entropy kernels against a device-to-device copy timed in the same run.
// The full comparison with peers (torch, Liger, ...) is bench/bench.py; this one needs only the CUDA runtime
// and isolates the kernels: `bench_cross_entropy [N V]`.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "bench_util.cuh"
#include "cross_entropy/cuda/kernels.h"
#include "logitless/logitless.h"

using namespace logitless;

// Variants of the row-resident plan, applied through the planner's hook.
static int g_pieces = 0, g_threads = 0, g_cluster = 0, g_grid = 0, g_pipe = 0, g_stages = 0;
static void tweak(ce::Plan& p) {
  if (p.algo != CrossEntropyAlgo::kRowResident) return;
  if (g_pieces) p.copy_pieces = g_pieces;
  if (g_threads) p.threads = g_threads;
  if (g_grid) p.grid_clusters = g_grid;
  p.pipelined = g_pipe != 0;
  if (g_cluster && g_cluster != p.cluster) {  // re-slice for another cluster size
    const int64_t V = p.slice * p.cluster;
    p.cluster = g_cluster;
    p.slice = ((V + g_cluster - 1) / g_cluster + 7) / 8 * 8;
    p.stage_bytes = ((p.slice * 2 + 16) + 127) / 128 * 128;
    p.stages = std::min<int>(4, (227 * 1024 - 4096) / p.stage_bytes);  // < 2 is refused by the launcher
    p.smem_bytes = p.stage_bytes * p.stages;
  }
  if (g_stages) {  // fewer stages per CTA leave room for several CTAs per SM
    p.stages = g_stages;
    p.smem_bytes = p.stage_bytes * p.stages;
  }
}
static void describe(const char* what) {
  const auto r = ce::debug::last_launch.get();
  std::printf("   [%s: algo=%d cluster=%d stages=%d threads=%d slice=%lld pipelined=%d clusters=%d (occupancy %d)]\n",
              what, static_cast<int>(r.plan.algo), r.plan.cluster, r.plan.stages, r.plan.threads,
              (long long)r.plan.slice, r.plan.pipelined ? 1 : 0, r.clusters,
              ce::debug::row_resident_max_clusters.get());
}

__global__ void fill_random(__nv_bfloat16* x, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    x[i] = __float2bfloat16(6.f * hash_uniform(i, seed) - 3.f);
  }
}

template <typename F>
float median_ms(F&& f, int iters = 20) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) f();
  std::vector<float> t;
  for (int i = 0; i < iters; ++i) {
    CK(cudaEventRecord(a));
    f();
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

int main(int argc, char** argv) {
  std::vector<std::pair<int64_t, int64_t>> shapes = {{16384, 128256}, {4096, 256000}};
  if (argc == 3) shapes = {{std::atoll(argv[1]), std::atoll(argv[2])}};
  const cudaDeviceProp prop = bench_device();
  std::printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);
  std::printf("%-16s %-28s %9s %9s %8s\n", "shape", "variant", "ms", "GB/s", "%copy");
  for (auto [N, V] : shapes) {
    const size_t bytes = size_t(N) * V * 2;
    __nv_bfloat16 *x, *x2, *g;
    int64_t* tgt;
    float *loss, *lse;
    CK(cudaMalloc(&x, bytes));
    CK(cudaMalloc(&x2, bytes));
    CK(cudaMalloc(&g, bytes));
    CK(cudaMalloc(&tgt, N * 8));
    CK(cudaMalloc(&loss, N * 4));
    CK(cudaMalloc(&lse, N * 4));
    fill_random<<<1024, 256>>>(x, int64_t(N) * V, 1);
    std::vector<int64_t> ht(N);
    for (int64_t i = 0; i < N; ++i) ht[i] = (i * 2654435761ull) % V;
    CK(cudaMemcpy(tgt, ht.data(), N * 8, cudaMemcpyHostToDevice));
    const Device dev{DeviceType::kCUDA, 0};
    const TensorView lv = TensorView::make(x, DType::kBFloat16, dev, {N, V});
    const TensorView gv = TensorView::make(g, DType::kBFloat16, dev, {N, V});
    const TensorView tv = TensorView::make(tgt, DType::kInt64, dev, {N});
    const TensorView scalar_loss = TensorView::make(loss, DType::kFloat32, dev, {});
    const TensorView lsev = TensorView::make(lse, DType::kFloat32, dev, {N});
    CrossEntropyOptions o;
    const size_t wsb = cross_entropy_workspace_bytes(lv, tv, {}, o);
    void* ws;
    CK(cudaMalloc(&ws, wsb));
    const Workspace w{ws, wsb};

    const float copy_ms = median_ms([&] { CK(cudaMemcpyAsync(x2, x, bytes, cudaMemcpyDeviceToDevice)); });
    const double copy_bw = 2.0 * bytes / copy_ms / 1e6;  // GB/s, read + write
    char shape[64];
    std::snprintf(shape, sizeof shape, "%lldx%lld", (long long)N, (long long)V);
    auto row = [&](const char* name, float ms, double moved) {
      const double bw = moved / ms / 1e6;
      std::printf("%-16s %-28s %9.3f %9.0f %7.1f%%\n", shape, name, ms, bw, 100.0 * bw / copy_bw);
    };
    row("device copy (1R+1W)", copy_ms, 2.0 * bytes);
    for (CrossEntropyAlgo algo : {CrossEntropyAlgo::kAuto, CrossEntropyAlgo::kStreaming}) {
      o.algo = algo;
      o.check_targets = false;  // the benchmark times the kernels, not the eager-mode host check
      const char* an = algo == CrossEntropyAlgo::kAuto ? "auto" : "streaming";
      char name[64];
      std::snprintf(name, sizeof name, "%s forward (1R)", an);
      row(name, median_ms([&] { cross_entropy_forward(lv, tv, {}, o, scalar_loss, lsev, {}, w, nullptr); }),
          double(bytes));
      std::snprintf(name, sizeof name, "%s fwd+bwd sep (1R+1W)", an);
      row(name,
          median_ms([&] { cross_entropy_forward_backward(lv, tv, {}, o, scalar_loss, lsev, {}, gv, {}, w, nullptr); }),
          2.0 * bytes);
      // In place overwrites x with the gradient; timing repeated calls on gradients is still one read + one
      // write per call, and refilling would add a pass. The values stay finite (gradients are in [-1, 1]).
      std::snprintf(name, sizeof name, "%s fwd+bwd in place (1R+1W)", an);
      row(name,
          median_ms([&] { cross_entropy_forward_backward(lv, tv, {}, o, scalar_loss, lsev, {}, lv, {}, w, nullptr); }),
          2.0 * bytes);
      fill_random<<<1024, 256>>>(x, int64_t(N) * V, 1);
    }
    o.algo = CrossEntropyAlgo::kAuto;
    const TensorView gl = TensorView::make(loss, DType::kFloat32, dev, {});
    row("backward from lse (1R+1W)",
        median_ms([&] { cross_entropy_backward(lv, tv, {}, lsev, gl, o, gv, w, nullptr); }), 2.0 * bytes);
    // Row-resident variants: copy pieces, threads, cluster size, grid.
    ce::debug::plan_hook.set(tweak);
    struct Var {
      int pieces, threads, cluster, grid, pipe, stages;
    };
    const int sms = prop.multiProcessorCount;
    (void)sms;
    const bool all_variants = std::getenv("BENCH_VARIANTS") != nullptr;
    for (Var v : {Var{1, 0, 0, 0, 0, 0}, Var{1, 0, 0, 0, 1, 0}, Var{1, 0, 3, 0, 0, 0}, Var{1, 0, 4, 0, 0, 0},
                  Var{1, 0, 6, 0, 0, 0}, Var{1, 0, 8, 0, 0, 0}, Var{1, 256, 3, 0, 0, 1}, Var{1, 256, 4, 0, 0, 1},
                  Var{1, 128, 4, 0, 0, 1}, Var{1, 256, 6, 0, 0, 1}, Var{1, 256, 8, 0, 0, 2}, Var{1, 256, 5, 0, 0, 1},
                  Var{1, 128, 3, 0, 0, 1}, Var{1, 256, 3, 0, 0, 2}, Var{1, 256, 5, 0, 0, 2}}) {
      // Default run: the plan and the multi-CTA-per-SM variants; BENCH_VARIANTS=1 adds the rest.
      if (!all_variants && (v.pipe || (v.stages == 0 && (v.cluster == 3 || v.cluster == 6)))) continue;
      g_pieces = v.pieces, g_threads = v.threads, g_cluster = v.cluster, g_grid = v.grid, g_pipe = v.pipe;
      g_stages = v.stages;
      o.algo = CrossEntropyAlgo::kRowResident;
      try {
        char name[96];
        std::snprintf(name, sizeof name, "rr t%d c%d s%d pipe%d fwdbwd", v.threads, v.cluster, v.stages, v.pipe);
        row(name, median_ms([&] {
              cross_entropy_forward_backward(lv, tv, {}, o, scalar_loss, lsev, {}, gv, {}, w, nullptr);
            }),
            2.0 * bytes);
        describe("fwdbwd");
      } catch (const std::exception& e) {
        std::printf("   [variant refused: %s]\n", e.what());
      }
    }
    o.algo = CrossEntropyAlgo::kAuto;
    g_pieces = g_threads = g_cluster = g_grid = g_pipe = g_stages = 0;
    ce::debug::plan_hook.set(nullptr);
    o.check_targets = true;
    row("auto fwd+bwd, eager target check",
        median_ms([&] { cross_entropy_forward_backward(lv, tv, {}, o, scalar_loss, lsev, {}, gv, {}, w, nullptr); }),
        2.0 * bytes);
    o.check_targets = false;
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    for (void* p : {(void*)x, (void*)x2, (void*)g, (void*)tgt, (void*)loss, (void*)lse, ws}) CK(cudaFree(p));
  }
  return 0;
}
