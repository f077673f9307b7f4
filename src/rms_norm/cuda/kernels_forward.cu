// RMSNorm forward on CUDA. One CTA holds rows_per_cta rows; each row is read once (x, and residual) and
// written once (y, and residual_out), and its rstd is stored for the backward.
//
// Register path: thread t of a row holds the row's 16-byte vectors t, t + tpr, t + 2 tpr, ... (VPT of them),
// so every warp-wide access is one contiguous 512-byte span. The sum of squares is reduced across the row,
// then the same registers produce y: x is never read twice. Generic path: any H and alignment, element
// accesses in chunks of kGenericElemsPerThread per thread, and a second read of the row (from L1/L2).
// The register kernel loops over row groups when the plan asks for a persistent grid, and may then load
// each thread's next row before it reduces the current one (plan.prefetch).
#include <algorithm>

#include "common/cuda/check.cuh"
#include "rms_norm/cuda/device.cuh"
#include "rms_norm/cuda/plan.h"
#include "rms_norm/cuda/run.h"
#include "rms_norm/problem.h"

namespace logitless::rms {
namespace {

// Thread t's vectors of x (and the residual) in row `row`: vectors t, t + tpr, ... (VPT of them).
template <typename T, int VPT, bool kResidual>
__device__ __forceinline__ void load_row(const ForwardParams& p, int64_t row, int t, int tpr, int64_t nvec, uint4* xs,
                                         uint4* rs) {
  constexpr int kN = Vec<T>::kN;
  const RowCoords rc = row_coords(p.x_rows, row);
  const T* x = static_cast<const T*>(p.x) + row_offset(p.x_rows, rc);
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int64_t v = t + static_cast<int64_t>(k) * tpr;
    if (v < nvec) xs[k] = load16(x + v * kN);
  }
  if constexpr (kResidual) {
    // All residual loads before the first store: residual_out may alias an input, so a store would
    // otherwise hold back every later load (one memory round trip per vector).
    const T* res = static_cast<const T*>(p.residual) + row_offset(p.residual_rows, rc);
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int64_t v = t + static_cast<int64_t>(k) * tpr;
      if (v < nvec) rs[k] = load16(res + v * kN);
    }
  }
}

// Row groups base, base + grid * rows_per_cta, ...: one iteration unless the plan asks for a persistent
// grid. kPrefetch: the loads of a thread's next row are issued before its current row is reduced, so they
// are in flight while it waits for the row's other warps and computes y. kResidual: p.residual is set (the
// kernel without it holds half the data, so more of its CTAs fit on an SM).
template <typename T, int VPT, bool kPrefetch, bool kResidual>
__global__ void __maxnreg__(register_cap(false, VPT, kPrefetch, kResidual)) forward_registers(const ForwardParams p) {
  using V = Vec<T>;
  constexpr int kN = V::kN;
  // Two scratch buffers, alternating by iteration: a row's next reduction may start while a slow warp of the
  // row still reads this one's partials, and the barrier of that next reduction is what separates the two.
  __shared__ float scratch[2][32];
  const int tpr = blockDim.x, t = threadIdx.x, slots = blockDim.y;
  const int64_t nvec = p.hidden / kN;
  const int64_t step = static_cast<int64_t>(gridDim.x) * slots;

  uint4 next_x[VPT], next_r[VPT];  // kPrefetch: the thread's next row
#pragma unroll
  for (int k = 0; k < VPT; ++k) next_x[k] = next_r[k] = make_uint4(0, 0, 0, 0);
  int64_t row = static_cast<int64_t>(blockIdx.x) * slots + threadIdx.y;
  if (kPrefetch && row < p.n_rows) load_row<T, VPT, kResidual>(p, row, t, tpr, nvec, next_x, next_r);

  int parity = 0;
#pragma unroll 1
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * slots; base < p.n_rows;
       base += step, row += step, parity ^= 1) {
    const bool active = row < p.n_rows;
    uint4 s[VPT], rv[VPT];
    if (kPrefetch) {
#pragma unroll
      for (int k = 0; k < VPT; ++k) s[k] = next_x[k], rv[k] = next_r[k];
      if (row + step < p.n_rows) load_row<T, VPT, kResidual>(p, row + step, t, tpr, nvec, next_x, next_r);
    } else if (active) {
      load_row<T, VPT, kResidual>(p, row, t, tpr, nvec, s, rv);
    }
    const RowCoords rc = row_coords(p.x_rows, row);
    float sum_sq = 0.f;
    if (active) {
      if constexpr (kResidual) {
        T* out = static_cast<T*>(p.residual_out) + row_offset(p.residual_out_rows, rc);
#pragma unroll
        for (int k = 0; k < VPT; ++k) {
          const int64_t v = t + static_cast<int64_t>(k) * tpr;
          if (v < nvec) {
            float a[kN], b[kN];
            V::unpack(s[k], a);
            V::unpack(rv[k], b);
#pragma unroll
            for (int e = 0; e < kN; ++e) a[e] += b[e];
            s[k] = V::pack(a);  // rounded to T: the sum the model carries on, and the one normalized
            store16(out + v * kN, s[k]);
          }
        }
      }
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        const int64_t v = t + static_cast<int64_t>(k) * tpr;
        if (v < nvec) {
          float a[kN];
          V::unpack(s[k], a);
#pragma unroll
          for (int e = 0; e < kN; ++e) sum_sq += a[e] * a[e];
        }
      }
    }
    RowWeight<T, VPT> w;
    if (active) w.load(p.weight, p.weight_f32, t, tpr, nvec);  // in flight during the reduction
    sum_sq = row_sum(sum_sq, scratch[parity]);
    if (!active) continue;  // the loop condition is the CTA's: every thread reaches each reduction

    float r = rstd_of(sum_sq, p.hidden, p.eps);
    if (p.casting == RMSNormCasting::kNone) r = V::round(r);
    if (t == 0 && p.rstd) p.rstd[row] = r;
    T* y = static_cast<T*>(p.y) + row_offset(p.y_rows, rc);
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int64_t v = t + static_cast<int64_t>(k) * tpr;
      if (v < nvec) {
        float a[kN], g[kN];
        V::unpack(s[k], a);
        w.get(k, v, p.weight, p.weight_f32, p.offset, p.casting, g);
#pragma unroll
        for (int e = 0; e < kN; ++e) a[e] = output<T>(a[e], r, g[e], p.casting);
        store16(y + v * kN, V::pack(a));
      }
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kGenericCtaThreads) forward_generic(const ForwardParams p) {
  using V = Vec<T>;
  constexpr int U = kGenericElemsPerThread;
  __shared__ float scratch[32];
  const int tpr = blockDim.x, t = threadIdx.x;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  const bool active = row < p.n_rows;
  const RowCoords rc = row_coords(p.x_rows, row);
  const int64_t H = p.hidden;

  const T* x = nullptr;
  T* res_out = nullptr;
  float sum_sq = 0.f;
  if (active) {
    x = static_cast<const T*>(p.x) + row_offset(p.x_rows, rc);
    const T* res = p.residual ? static_cast<const T*>(p.residual) + row_offset(p.residual_rows, rc) : nullptr;
    if (res) res_out = static_cast<T*>(p.residual_out) + row_offset(p.residual_out_rows, rc);
    // Chunks of U elements a thread: all loads of a chunk before its stores (outputs may alias inputs).
    for (int64_t j0 = t; j0 < H; j0 += static_cast<int64_t>(tpr) * U) {
      float a[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t j = j0 + static_cast<int64_t>(u) * tpr;
        a[u] = j < H ? V::load1(x + j) : 0.f;
      }
      if (res) {
        float b[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int64_t j = j0 + static_cast<int64_t>(u) * tpr;
          b[u] = j < H ? V::load1(res + j) : 0.f;
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int64_t j = j0 + static_cast<int64_t>(u) * tpr;
          a[u] = V::round(a[u] + b[u]);
          if (j < H) V::store1(res_out + j, a[u]);
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) sum_sq += a[u] * a[u];
    }
  }
  sum_sq = row_sum(sum_sq, scratch);
  if (!active) return;

  float r = rstd_of(sum_sq, H, p.eps);
  if (p.casting == RMSNormCasting::kNone) r = V::round(r);
  if (t == 0 && p.rstd) p.rstd[row] = r;
  const T* src = res_out ? res_out : x;  // the second read: this thread's own elements, still in L1/L2
  T* y = static_cast<T*>(p.y) + row_offset(p.y_rows, rc);
  for (int64_t j0 = t; j0 < H; j0 += static_cast<int64_t>(tpr) * U) {
    float a[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t j = j0 + static_cast<int64_t>(u) * tpr;
      a[u] = j < H ? V::load1(src + j) : 0.f;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t j = j0 + static_cast<int64_t>(u) * tpr;
      if (j < H)
        V::store1(y + j,
                  output<T>(a[u], r, load_weight1<T>(p.weight, p.weight_f32, j, p.offset, p.casting), p.casting));
    }
  }
}

using ForwardKernel = void (*)(ForwardParams);

template <typename T, bool kResidual>
ForwardKernel pick_registers(const Plan& plan) {
  // kForwardVariants
  if (!plan.prefetch) {
    switch (plan.vpt) {
      case 4:
        return forward_registers<T, 4, false, kResidual>;
      case 8:
        return forward_registers<T, 8, false, kResidual>;
      case 16:
        return forward_registers<T, 16, false, kResidual>;
    }
  } else {
    switch (plan.vpt) {
      case 4:
        return forward_registers<T, 4, true, kResidual>;
      case 8:
        return forward_registers<T, 8, true, kResidual>;
    }
  }
  throw_runtime(str_cat("rms_norm forward: no register kernel for ", plan.vpt, " vectors per thread, prefetch ",
                        plan.prefetch ? 1 : 0));
}

template <typename T>
ForwardKernel pick(const Plan& plan, bool residual) {
  if (plan.algo == RMSNormAlgo::kGeneric) return forward_generic<T>;
  return residual ? pick_registers<T, true>(plan) : pick_registers<T, false>(plan);
}

ForwardKernel pick(DType dtype, const Plan& plan, bool residual) {
  switch (dtype) {
    case DType::kFloat32:
      return pick<float>(plan, residual);
    case DType::kFloat16:
      return pick<__half>(plan, residual);
    case DType::kBFloat16:
      return pick<__nv_bfloat16>(plan, residual);
    default:
      throw_invalid(str_cat("x: expected dtype float32, float16 or bfloat16, got ", dtype_name(dtype)));
  }
}

}  // namespace

void forward_cuda(const ForwardProblem& p, StreamHandle stream) {
  if (p.n_rows == 0) return;
  DeviceGuard guard(p.device.index);
  const DeviceInfo& info = device_info(p.device.index);
  const int64_t es = dtype_size(p.dtype);

  PlanInputs in;
  in.hidden = p.hidden;
  in.elem_bytes = static_cast<int>(es);
  in.backward = false;
  in.vector_ok = rows_aligned16(p.x, p.x_rows, es) && rows_aligned16(p.residual, p.residual_rows, es) &&
                 rows_aligned16(p.y, p.y_rows, es) && rows_aligned16(p.residual_out, p.residual_out_rows, es) &&
                 aligned16(p.weight);
  in.requested = p.algo;
  in.residual = p.residual != nullptr;
  in.vpt = p.vectors_per_thread;
  in.smem_per_block = info.max_smem_per_block_optin;
  Plan plan = plan_rms_norm(in);
  if (plan.algo == RMSNormAlgo::kAuto)
    throw_invalid(
        str_cat("algo: expected a kernel that can run these arguments, got registers, which cannot: ", plan.why_not));
  if (const debug::PlanHook hook = debug::plan_hook.get()) {
    hook(plan, in);
    if (const char* why = plan_error(plan, in))
      throw_invalid(str_cat("rms_norm forward: a debug plan hook made an unusable plan: ", why));
  }
  const ForwardKernel kernel = pick(p.dtype, plan, in.residual);
  // One CTA per row group, or a persistent grid whose CTAs loop over the row groups.
  int64_t grid = (p.n_rows + plan.rows_per_cta - 1) / plan.rows_per_cta;
  if (plan.ctas_per_sm > 0) {
    const int fit =
        max_ctas_per_sm(reinterpret_cast<const void*>(kernel), plan.threads(), plan.smem_bytes, p.device.index);
    grid = persistent_grid(plan, p.n_rows, info.sm_count, std::min(plan.ctas_per_sm, fit)).ctas;
  }
  if (grid > 0x7FFFFFFF)
    throw_invalid(str_cat("x: expected at most ", 0x7FFFFFFFLL * plan.rows_per_cta, " rows, got ", p.n_rows));
  debug::last_forward.set({plan, grid});

  ForwardParams kp;
  kp.x = p.x;
  kp.x_rows = p.x_rows;
  kp.residual = p.residual;
  kp.residual_rows = p.residual_rows;
  kp.weight = p.weight;
  kp.weight_f32 = p.weight_dtype == DType::kFloat32 && p.dtype != DType::kFloat32;
  kp.y = p.y;
  kp.y_rows = p.y_rows;
  kp.residual_out = p.residual_out;
  kp.residual_out_rows = p.residual_out_rows;
  kp.rstd = p.rstd;
  kp.n_rows = p.n_rows;
  kp.hidden = p.hidden;
  kp.eps = p.eps;
  kp.offset = p.offset;
  kp.casting = p.casting;

  launch_kernel("launch of rms_norm forward", kernel, dim3(static_cast<unsigned>(grid)),
                dim3(plan.threads_per_row, plan.rows_per_cta), plan.smem_bytes, static_cast<cudaStream_t>(stream), kp);
}

}  // namespace logitless::rms
