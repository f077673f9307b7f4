// C++ micro-benchmark of the RMSNorm kernels against a device-to-device copy timed in the same run: the
// default plan and plan variants (vectors per thread, prefetch, CTA size, persistent grids), applied through
// the planner's debug hook so that the library's own kernels are timed. bf16 activations and weight, Llama
// casting. `bench_rms_norm [N H]` (default N = 16384, H = 2048, 4096, 8192).
//
// Bytes counted per element (2-byte elements): forward x read + y written (4), with the fused residual also
// the residual read and x + residual written (8); backward x, dy read + dx written (6), with the residual the
// residual-output gradient read too (8); fwd+bwd their sums (10, 16). rstd, the weight and the dW partial
// sums are not counted. Each time is the median over samples of a batch of back-to-back calls (per call),
// cycling through two sets of buffers so that no call finds its inputs in L2; the copy is timed the same way.
//
// Output (compact, so that the end of a long log holds all of it): one line per shape and pass with every
// variant's % of the copy, then the fastest variant per shape and pass, last. Variant names: v<vectors a
// thread>[p = prefetch][s = dW in shared memory] c<target CTA threads>[P = persistent grid, as many CTAs as
// fit | /n = at most n CTAs an SM]; "def" is the library's default plan (what it launched follows in brackets).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <map>
#include <string>
#include <vector>

#include "bench_util.cuh"
#include "logitless/logitless.h"
#include "rms_norm/cuda/plan.h"

using namespace logitless;

__global__ void fill_random(__nv_bfloat16* x, int64_t n, uint64_t seed, float scale, float shift) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    x[i] = __float2bfloat16(scale * hash_uniform(i, seed) + shift);
  }
}

// Elements of `a` farther than 2% (of |b| + 0.01) from `b`: the variants round sums in other orders, so y
// and dx may differ from the default's by an ulp, never by more.
__global__ void count_mismatches(const __nv_bfloat16* a, const __nv_bfloat16* b, int64_t n, unsigned long long* bad) {
  unsigned long long mine = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float x = __bfloat162float(a[i]), y = __bfloat162float(b[i]);
    if (!(fabsf(x - y) <= 0.02f * (fabsf(y) + 0.01f))) ++mine;
  }
  if (mine) atomicAdd(bad, mine);
}

// ---- plan variants -------------------------------------------------------------------------------------------
struct Variant {
  const char* name;
  int vpt;  // 0: the default plan (no hook)
  bool prefetch;
  int cta_threads;       // target CTA size: rows_per_cta = max(1, cta_threads / threads_per_row)
  int ctas_per_sm;       // 0: forward one CTA per row group / backward as many as fit; else a persistent cap
  bool smem_dw = false;  // backward: dW sums in shared memory, the weight from L1
};

static Variant g_variant{};
static bool g_hook_backward = false;  // which pass the hook rewrites (the other keeps its default plan)
static int64_t g_nvec = 0;

static void hook(rms::Plan& p, const rms::PlanInputs& in) {
  const bool backward = in.backward;
  if (backward != g_hook_backward || p.algo != RMSNormAlgo::kRegisters || g_variant.vpt == 0) return;
  const Variant& v = g_variant;
  p.vpt = v.vpt;
  p.prefetch = v.prefetch;
  p.dw_in_smem = backward && v.smem_dw;
  const int64_t want = (g_nvec + v.vpt - 1) / v.vpt;
  int tpr = 1;
  while (tpr < want && tpr < 32) tpr <<= 1;
  if (want > 32) tpr = static_cast<int>((want + 31) / 32 * 32);
  p.threads_per_row = tpr;
  const int cap =
      std::min(v.cta_threads, rms::max_cta_threads(backward, v.vpt, v.prefetch, in.residual, backward && v.smem_dw));
  p.rows_per_cta = std::max(1, cap / tpr);
  if (tpr > 32) p.rows_per_cta = std::min(p.rows_per_cta, rms::kMaxNamedBarrierRows);
  p.ctas_per_sm = v.ctas_per_sm;
}

// What the last launch of a pass ran, compactly: "v4p 128x2 1056" (vectors, prefetch, threads a row x
// rows a CTA, CTAs), "generic 256x1 ..." for the generic kernel.
static std::string describe(bool backward) {
  const rms::debug::LaunchRecord r = (backward ? rms::debug::last_backward : rms::debug::last_forward).get();
  char buf[96];
  if (r.plan.algo == RMSNormAlgo::kGeneric)
    std::snprintf(buf, sizeof buf, "generic %dx%d %lld", r.plan.threads_per_row, r.plan.rows_per_cta,
                  (long long)r.ctas);
  else
    std::snprintf(buf, sizeof buf, "v%d%s%s %dx%d %lld", r.plan.vpt, r.plan.prefetch ? "p" : "",
                  r.plan.dw_in_smem && r.plan.algo == RMSNormAlgo::kRegisters ? "s" : "", r.plan.threads_per_row,
                  r.plan.rows_per_cta, (long long)r.ctas);
  return buf;
}

// A variant's short name: v4pc128P, v8c256, v4c512/1; "def" for the default plan.
static std::string short_name(const Variant& v) {
  if (v.vpt == 0) return "def";
  std::string n = "v" + std::to_string(v.vpt) + (v.prefetch ? "p" : "") + (v.smem_dw ? "s" : "") + "c" +
                  std::to_string(v.cta_threads);
  if (v.ctas_per_sm >= rms::kPersistentCtasPerSm)
    n += "P";
  else if (v.ctas_per_sm > 0)
    n += "/" + std::to_string(v.ctas_per_sm);
  return n;
}

// Median milliseconds per call of f(i): `samples` samples, each a batch of `batch` calls between two events.
template <typename F>
static float per_call_ms(F&& f, int batch = 10, int samples = 15) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < 4; ++i) f(i);
  CK(cudaDeviceSynchronize());
  std::vector<float> t;
  for (int s = 0; s < samples; ++s) {
    CK(cudaEventRecord(a));
    for (int i = 0; i < batch; ++i) f(i);
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms / batch);
  }
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

int main(int argc, char** argv) {
  std::vector<std::pair<int64_t, int64_t>> shapes = {{16384, 2048}, {16384, 4096}, {16384, 8192}};
  if (argc == 3) shapes = {{std::atoll(argv[1]), std::atoll(argv[2])}};
  const cudaDeviceProp prop = bench_device();
  std::printf("device: %s, %d SMs, L2 %d MB; %% of a D2D copy per variant (- refused, ! mismatch)\n", prop.name,
              prop.multiProcessorCount, prop.l2CacheSize >> 20);

  const std::vector<Variant> fwd_variants = {
      {"default", 0, false, 0, 0},
      {"vpt4 cta128", 4, false, 128, 0},
      {"vpt4 cta256", 4, false, 256, 0},
      {"vpt4 cta512", 4, false, 512, 0},
      {"vpt8 cta64", 8, false, 64, 0},
      {"vpt8 cta128", 8, false, 128, 0},
      {"vpt8 cta256", 8, false, 256, 0},
      {"vpt16 cta128", 16, false, 128, 0},
      {"vpt16 cta256", 16, false, 256, 0},
      {"vpt8 cta128 persistent", 8, false, 128, rms::kPersistentCtasPerSm},
      {"vpt4 prefetch cta128 persistent", 4, true, 128, rms::kPersistentCtasPerSm},
      {"vpt4 prefetch cta256 persistent", 4, true, 256, rms::kPersistentCtasPerSm},
      {"vpt8 prefetch cta128 persistent", 8, true, 128, rms::kPersistentCtasPerSm},
      {"vpt8 prefetch cta256 persistent", 8, true, 256, rms::kPersistentCtasPerSm},
      {"vpt8 prefetch cta128 2/SM", 8, true, 128, 2},
  };
  const std::vector<Variant> bwd_variants = {
      {"default", 0, false, 0, 0},
      {"vpt4 cta128", 4, false, 128, 0},
      {"vpt4 cta256", 4, false, 256, 0},
      {"vpt4 cta512", 4, false, 512, 0},
      {"vpt4 cta512 1/SM", 4, false, 512, 1},
      {"vpt8 cta128", 8, false, 128, 0},
      {"vpt8 cta256", 8, false, 256, 0},
      {"vpt2 prefetch cta128", 2, true, 128, 0},
      {"vpt2 prefetch cta256", 2, true, 256, 0},
      {"vpt2 prefetch cta512", 2, true, 512, 0},
      {"vpt4 prefetch cta128", 4, true, 128, 0},
      {"vpt4 prefetch cta256", 4, true, 256, 0},
      {"vpt4 prefetch cta512", 4, true, 512, 0},
      {"vpt4 prefetch cta128 1/SM", 4, true, 128, 1},
      {"vpt4 prefetch smem-dW cta128", 4, true, 128, 0, true},
      {"vpt4 prefetch smem-dW cta256", 4, true, 256, 0, true},
      {"vpt4 prefetch smem-dW cta512", 4, true, 512, 0, true},
      {"vpt8 smem-dW cta128", 8, false, 128, 0, true},
      {"vpt8 smem-dW cta256", 8, false, 256, 0, true},
  };

  struct Best {
    std::string name;
    double pct = 0;
    double def_pct = 0;    // the default plan's
    std::string def_plan;  // what the default launched
  };
  std::map<std::string, Best> best;  // "shape pass" -> fastest variant
  std::vector<std::string> order;

  const Device dev{DeviceType::kCUDA, 0};
  constexpr int kSets = 2;
  rms::debug::plan_hook.set(hook);
  for (const auto& shp : shapes) {
    const int64_t N = shp.first, H = shp.second;
    const size_t elems = size_t(N) * H, bytes = elems * 2;
    g_nvec = H / 8;
    struct Set {
      __nv_bfloat16 *x, *res, *dy, *dres, *y, *s, *dx;
      float* rstd;
    } sets[kSets];
    for (Set& st : sets) {
      for (__nv_bfloat16** p : {&st.x, &st.res, &st.dy, &st.dres, &st.y, &st.s, &st.dx}) CK(cudaMalloc(p, bytes));
      CK(cudaMalloc(&st.rstd, N * 4));
    }
    __nv_bfloat16 *w, *dw, *ref_y, *ref_dx, *ref_dw;
    CK(cudaMalloc(&w, H * 2));
    CK(cudaMalloc(&dw, H * 2));
    CK(cudaMalloc(&ref_dw, H * 2));
    CK(cudaMalloc(&ref_y, bytes));
    CK(cudaMalloc(&ref_dx, bytes));
    unsigned long long* bad;
    CK(cudaMalloc(&bad, sizeof *bad));
    for (int k = 0; k < kSets; ++k) {
      fill_random<<<1024, 256>>>(sets[k].x, elems, 11 + k, 6.f, -3.f);
      fill_random<<<1024, 256>>>(sets[k].res, elems, 21 + k, 2.f, -1.f);
      fill_random<<<1024, 256>>>(sets[k].dy, elems, 31 + k, 2.f, -1.f);
      fill_random<<<1024, 256>>>(sets[k].dres, elems, 41 + k, 2.f, -1.f);
    }
    fill_random<<<64, 256>>>(w, H, 7, 0.2f, 0.9f);
    // Partial rows for any variant: at most 32 CTAs an SM (64-thread CTAs), one float32 row of H each.
    const size_t ws_bytes = size_t(prop.multiProcessorCount) * 32 * ((H + 3) / 4 * 4) * 4;
    void* ws;
    CK(cudaMalloc(&ws, ws_bytes));
    const Workspace work{ws, ws_bytes};

    auto view = [&](void* p) { return TensorView::make(p, DType::kBFloat16, dev, {N, H}); };
    const TensorView wv = TensorView::make(w, DType::kBFloat16, dev, {H});
    const TensorView dwv = TensorView::make(dw, DType::kBFloat16, dev, {H});
    RMSNormOptions o;
    o.eps = 1e-6;
    auto forward = [&](int i, bool residual) {
      const Set& st = sets[i % kSets];
      rms_norm_forward(view(st.x), residual ? view(st.res) : TensorView{}, wv, o, view(st.y),
                       residual ? view(st.s) : TensorView{}, TensorView::make(st.rstd, DType::kFloat32, dev, {N}), {},
                       nullptr);
    };
    auto backward = [&](int i, bool residual) {
      const Set& st = sets[i % kSets];
      rms_norm_backward(view(st.dy), residual ? view(st.dres) : TensorView{}, residual ? view(st.s) : view(st.x), wv,
                        TensorView::make(st.rstd, DType::kFloat32, dev, {N}), o, view(st.dx), dwv, work, nullptr);
    };

    const float copy_ms = per_call_ms(
        [&](int i) { CK(cudaMemcpyAsync(sets[i % kSets].y, sets[i % kSets].x, bytes, cudaMemcpyDeviceToDevice)); });
    const double copy_bw = 2.0 * bytes / copy_ms / 1e6;  // GB/s, read + write
    char shape[32];
    std::snprintf(shape, sizeof shape, "%lldx%lld", (long long)N, (long long)H);
    // One line per pass: "<shape> <pass> def[plan] 99.1 | v4c128 97.0 | ...", printed when the pass is done.
    std::map<std::string, std::string> lines;
    auto row = [&](const char* pass, const Variant& v, float ms, double per_elem, const std::string& plan, bool bad) {
      const double bw = per_elem * elems / ms / 1e6, pct = 100.0 * bw / copy_bw;
      const std::string key = std::string(shape) + " " + pass;
      if (!best.count(key)) order.push_back(key);
      Best& b = best[key];
      if (pct > b.pct) b.name = short_name(v), b.pct = pct;
      if (v.vpt == 0) b.def_pct = pct, b.def_plan = plan;
      char cell[96];
      if (v.vpt == 0)
        std::snprintf(cell, sizeof cell, "def[%s] %.1f%s", plan.c_str(), pct, bad ? "!" : "");
      else
        std::snprintf(cell, sizeof cell, " | %s %.1f%s", short_name(v).c_str(), pct, bad ? "!" : "");
      lines[pass] += cell;
    };
    auto refused = [&](const char* pass, const Variant& v) { lines[pass] += " | " + short_name(v) + " -"; };
    auto flush = [&](const char* pass) {
      std::printf("%s %-7s %s\n", shape, pass, lines[pass].c_str());
      lines.erase(pass);
    };
    std::printf("%s copy %.4f ms %.0f GB/s\n", shape, copy_ms, copy_bw);

    // Mismatches of one output against the reference the default plan wrote.
    auto mismatches = [&](const __nv_bfloat16* a, const __nv_bfloat16* ref, int64_t n) {
      CK(cudaMemset(bad, 0, sizeof *bad));
      count_mismatches<<<1024, 256>>>(a, ref, n, bad);
      unsigned long long h = 0;
      CK(cudaMemcpy(&h, bad, sizeof h, cudaMemcpyDeviceToHost));
      return h;
    };

    for (bool residual : {false, true}) {
      const char* fpass = residual ? "fwd+res" : "fwd";
      g_hook_backward = false;
      for (const Variant& v : fwd_variants) {
        g_variant = v;
        try {
          forward(0, residual);
          CK(cudaDeviceSynchronize());
          const std::string launched = describe(false);
          unsigned long long m = 0;
          if (v.vpt == 0) {
            CK(cudaMemcpy(ref_y, sets[0].y, bytes, cudaMemcpyDeviceToDevice));
          } else if ((m = mismatches(sets[0].y, ref_y, elems)) != 0) {
            std::printf("MISMATCH %s %s %s: %llu elements of y\n", shape, fpass, short_name(v).c_str(), m);
          }
          row(fpass, v, per_call_ms([&](int i) { forward(i, residual); }), residual ? 8.0 : 4.0, launched, m != 0);
        } catch (const std::exception&) {  // a plan the kernels cannot run: "-"
          refused(fpass, v);
        }
      }
      flush(fpass);
      g_variant = {};
      forward(0, residual);  // the default forward's rstd (and s) for the backward's checks
      const char* bpass = residual ? "bwd+res" : "bwd";
      const char* fbpass = residual ? "fb+res" : "fwd+bwd";
      g_hook_backward = true;
      for (const Variant& v : bwd_variants) {
        g_variant = v;
        try {
          backward(0, residual);
          CK(cudaDeviceSynchronize());
          const std::string launched = describe(true);
          unsigned long long mx = 0, mw = 0;
          if (v.vpt == 0) {
            CK(cudaMemcpy(ref_dx, sets[0].dx, bytes, cudaMemcpyDeviceToDevice));
            CK(cudaMemcpy(ref_dw, dw, H * 2, cudaMemcpyDeviceToDevice));
          } else {
            mx = mismatches(sets[0].dx, ref_dx, elems), mw = mismatches(dw, ref_dw, H);
            if (mx || mw)
              std::printf("MISMATCH %s %s %s: %llu of dx, %llu of dW\n", shape, bpass, short_name(v).c_str(), mx, mw);
          }
          row(bpass, v, per_call_ms([&](int i) { backward(i, residual); }), residual ? 8.0 : 6.0, launched, mx || mw);
          row(fbpass, v, per_call_ms([&](int i) {
                forward(i, residual);  // default plan (the hook rewrites the backward only)
                backward(i, residual);
              }),
              residual ? 16.0 : 10.0, launched, mx || mw);
        } catch (const std::exception&) {  // a plan the kernels cannot run: "-"
          refused(bpass, v);
          refused(fbpass, v);
        }
      }
      flush(bpass);
      flush(fbpass);
      g_variant = {};
    }
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    for (Set& st : sets)
      for (void* p : {(void*)st.x, (void*)st.res, (void*)st.dy, (void*)st.dres, (void*)st.y, (void*)st.s, (void*)st.dx,
                      (void*)st.rstd})
        CK(cudaFree(p));
    for (void* p : {(void*)w, (void*)dw, (void*)ref_dw, (void*)ref_y, (void*)ref_dx, (void*)bad, ws}) CK(cudaFree(p));
  }
  rms::debug::plan_hook.set(nullptr);

  // The summary, last: the fastest variant per shape and pass against the default.
  std::printf("\nfastest per shape and pass (%% of copy; fwd+bwd rows run the default forward):\n");
  for (const std::string& key : order) {
    const Best& b = best[key];
    std::printf("  %-18s best %-10s %5.1f%%  def %5.1f%% [%s]\n", key.c_str(), b.name.c_str(), b.pct, b.def_pct,
                b.def_plan.c_str());
  }
  return 0;
}
