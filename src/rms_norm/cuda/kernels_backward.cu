// RMSNorm backward on CUDA: dx in one read of x and dy (and the residual-output gradient) and one write,
// and dW reduced in float32 without atomics, in two steps:
//   1. the row kernel is persistent: each CTA walks rows base, base + grid * slots, ... in a fixed order,
//      accumulates dy * n for the columns each thread owns (in registers, or in shared memory: the generic
//      path and, for rows over 8 KB, the register kernels' smem_dw variants), adds its row slots together in
//      slot order, and writes one float32 row of H to the workspace. The register kernel holds the weight
//      across its rows (smem_dw: reads it from L1 where used) and may load a slot's next row before it
//      reduces the current one (plan.prefetch), so the loads stay in flight through the reduction;
//   2. reduce_dw adds the workspace rows column by column in a fixed order and rounds once to dW's dtype.
// Nothing depends on timing, so the bits repeat from run to run. The workspace is (CTAs x H) floats (a small
// fraction of the bytes the row kernel moves once N is many times the CTA count), written once and read once.
#include <algorithm>

#include "common/cuda/check.cuh"
#include "common/cuda/launch_cache.h"
#include "rms_norm/cuda/device.cuh"
#include "rms_norm/cuda/plan.h"
#include "rms_norm/cuda/run.h"
#include "rms_norm/problem.h"

namespace logitless::rms {
namespace {

// Thread t's vectors of x, dy (and the residual-output gradient) in row `row`, and the row's rstd. The
// residual-output gradient is only added at the end, but loaded now: issued after the reduction it would
// cost every row a full memory latency.
template <typename T, int VPT, bool kResidual>
__device__ __forceinline__ void load_grad_row(const BackwardParams& p, int64_t row, int t, int tpr, int64_t nvec,
                                              uint4* xs, uint4* dys, uint4* drs, float& r) {
  constexpr int kN = Vec<T>::kN;
  const RowCoords rc = row_coords(p.x_rows, row);
  const T* x = static_cast<const T*>(p.x) + row_offset(p.x_rows, rc);
  const T* dy = static_cast<const T*>(p.grad_y) + row_offset(p.grad_y_rows, rc);
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int64_t v = t + static_cast<int64_t>(k) * tpr;
    if (v < nvec) {
      xs[k] = load16(x + v * kN);
      dys[k] = load16(dy + v * kN);
    }
  }
  if constexpr (kResidual) {
    const T* dr = static_cast<const T*>(p.grad_residual_out) + row_offset(p.grad_residual_out_rows, rc);
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int64_t v = t + static_cast<int64_t>(k) * tpr;
      if (v < nvec) drs[k] = load16(dr + v * kN);
    }
  }
  r = p.rstd[row];
}

// kPrefetch: the loads of a slot's next row are issued before its current row is reduced (two rows in
// registers), so they are in flight while the slot waits for its row's other warps and computes dx.
// kResidual: p.grad_residual_out is set (without it the kernel holds less, so more rows fit on an SM).
// kSmemDw: each row slot sums its dW in shared memory (H floats a slot; piece q of vector v, i.e. columns
// v kN + 4q .. + 3, at float4 index q nvec + v, so a warp's accesses are contiguous) and the weight is read
// from L1 where used: the thread holds only its rows, and more of them fit on an SM.
template <typename T, int VPT, bool kPrefetch, bool kResidual, bool kSmemDw>
__global__ void __maxnreg__(register_cap(true, VPT, kPrefetch, kResidual, kSmemDw))
    backward_registers(const BackwardParams p) {
  using V = Vec<T>;
  constexpr int kN = V::kN;
  constexpr int kQ = kN / 4;  // float4 pieces of a vector's dW sums
  // Several row slots without kSmemDw: one row of H floats where the slots add their register sums. kSmemDw:
  // each slot's sums, [slots][H].
  extern __shared__ __align__(16) float dw_row[];
  // Two scratch buffers, alternating by iteration: a row's next reduction may start while a slow warp of the
  // row still reads this one's partials, and the barrier of that next reduction is what separates the two.
  __shared__ float scratch[2][32];
  const int tpr = blockDim.x, t = threadIdx.x, slot = threadIdx.y, slots = blockDim.y;
  const int64_t H = p.hidden, nvec = H / kN;
  const int64_t step = static_cast<int64_t>(gridDim.x) * slots;
  const bool want_dw = p.partials != nullptr;
  RowWeight<T, VPT> w;  // held across the CTA's rows (not with kSmemDw)
  if constexpr (!kSmemDw) w.load(p.weight, p.weight_f32, t, tpr, nvec);
  auto weight_of = [&](int k, int64_t v, float* g) {
    if constexpr (kSmemDw)
      load_weight_vec<T>(p.weight, p.weight_f32, v, p.offset, p.casting, g);
    else
      w.get(k, v, p.weight, p.weight_f32, p.offset, p.casting, g);
  };

  float dw[VPT][kN];
  float4* acc = reinterpret_cast<float4*>(dw_row + static_cast<int64_t>(slot) * H);  // kSmemDw
  if constexpr (kSmemDw) {
    if (want_dw)
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        const int64_t v = t + static_cast<int64_t>(k) * tpr;
        if (v < nvec)
#pragma unroll
          for (int q = 0; q < kQ; ++q) acc[q * nvec + v] = make_float4(0.f, 0.f, 0.f, 0.f);
      }
  } else {
#pragma unroll
    for (int k = 0; k < VPT; ++k)
#pragma unroll
      for (int e = 0; e < kN; ++e) dw[k][e] = 0.f;
  }

  uint4 next_x[VPT], next_dy[VPT], next_dr[VPT];  // kPrefetch: the slot's next row
  float next_r = 0.f;
#pragma unroll
  for (int k = 0; k < VPT; ++k) next_x[k] = next_dy[k] = next_dr[k] = make_uint4(0, 0, 0, 0);
  int64_t row = static_cast<int64_t>(blockIdx.x) * slots + slot;
  if (kPrefetch && row < p.n_rows)
    load_grad_row<T, VPT, kResidual>(p, row, t, tpr, nvec, next_x, next_dy, next_dr, next_r);

  int parity = 0;
#pragma unroll 1
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * slots; base < p.n_rows;
       base += step, row += step, parity ^= 1) {
    const bool active = row < p.n_rows;
    uint4 xs[VPT], dys[VPT], dres[VPT];
    float r = 0.f, dot = 0.f;
    if (kPrefetch) {
#pragma unroll
      for (int k = 0; k < VPT; ++k) xs[k] = next_x[k], dys[k] = next_dy[k], dres[k] = next_dr[k];
      r = next_r;
      if (row + step < p.n_rows)
        load_grad_row<T, VPT, kResidual>(p, row + step, t, tpr, nvec, next_x, next_dy, next_dr, next_r);
    } else if (active) {
      load_grad_row<T, VPT, kResidual>(p, row, t, tpr, nvec, xs, dys, dres, r);
    }
    if (active) {
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        const int64_t v = t + static_cast<int64_t>(k) * tpr;
        if (v < nvec) {
          float a[kN], d[kN], g[kN];
          V::unpack(xs[k], a);
          V::unpack(dys[k], d);
          weight_of(k, v, g);
#pragma unroll
          for (int e = 0; e < kN; ++e) dot += (d[e] * g[e]) * a[e];
        }
      }
    }
    dot = row_sum(dot, scratch[parity]);
    if (active) {
      // dx_j = r a_j - s_j r^3 (sum_k a_k s_k) / H, a = dy * g.
      const float c = (r * r * r) * (dot / static_cast<float>(H));
      T* dx = static_cast<T*>(p.grad_x) + row_offset(p.grad_x_rows, row_coords(p.x_rows, row));
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        const int64_t v = t + static_cast<int64_t>(k) * tpr;
        if (v < nvec) {
          float a[kN], d[kN], g[kN], o[kN];
          V::unpack(xs[k], a);
          V::unpack(dys[k], d);
          weight_of(k, v, g);
#pragma unroll
          for (int e = 0; e < kN; ++e) {
            o[e] = r * (d[e] * g[e]) - a[e] * c;
            if constexpr (!kSmemDw)
              if (want_dw) dw[k][e] += d[e] * normalized<T>(a[e], r, p.casting);
          }
          if constexpr (kSmemDw) {
            if (want_dw)
#pragma unroll
              for (int q = 0; q < kQ; ++q) {
                float4 u = acc[q * nvec + v];
                u.x += d[4 * q] * normalized<T>(a[4 * q], r, p.casting);
                u.y += d[4 * q + 1] * normalized<T>(a[4 * q + 1], r, p.casting);
                u.z += d[4 * q + 2] * normalized<T>(a[4 * q + 2], r, p.casting);
                u.w += d[4 * q + 3] * normalized<T>(a[4 * q + 3], r, p.casting);
                acc[q * nvec + v] = u;
              }
          }
          if constexpr (kResidual) {
            float b[kN];
            V::unpack(dres[k], b);
#pragma unroll
            for (int e = 0; e < kN; ++e) o[e] += b[e];
          }
          store16(dx + v * kN, V::pack(o));
        }
      }
    }
  }
  if (!want_dw) return;

  float* out = p.partials + static_cast<int64_t>(blockIdx.x) * p.partial_stride;
  if constexpr (kSmemDw) {
    // Slot 0's threads add the slots' sums of their own columns in slot order.
    if (slots > 1) __syncthreads();
    if (slot != 0) return;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int64_t v = t + static_cast<int64_t>(k) * tpr;
      if (v < nvec)
#pragma unroll
        for (int q = 0; q < kQ; ++q) {
          float4 u = acc[q * nvec + v];
          for (int z = 1; z < slots; ++z) {
            const float4 o = reinterpret_cast<const float4*>(dw_row + static_cast<int64_t>(z) * H)[q * nvec + v];
            u.x += o.x, u.y += o.y, u.z += o.z, u.w += o.w;
          }
          store16(out + v * kN + 4 * q,
                  make_uint4(__float_as_uint(u.x), __float_as_uint(u.y), __float_as_uint(u.z), __float_as_uint(u.w)));
        }
    }
    return;
  }
  if (slots == 1) {  // this thread's sums are the CTA's: straight to the workspace
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int64_t v = t + static_cast<int64_t>(k) * tpr;
      if (v < nvec)
#pragma unroll
        for (int q = 0; q < kN / 4; ++q)
          store16(out + v * kN + 4 * q,
                  make_uint4(__float_as_uint(dw[k][4 * q]), __float_as_uint(dw[k][4 * q + 1]),
                             __float_as_uint(dw[k][4 * q + 2]), __float_as_uint(dw[k][4 * q + 3])));
    }
    return;
  }
  // Slots add their sums into one shared row in slot order (slot 0 writes, the others add): fixed order.
  for (int q = 0; q < slots; ++q) {
    if (slot == q) {
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        const int64_t v = t + static_cast<int64_t>(k) * tpr;
        if (v < nvec)
#pragma unroll
          for (int e = 0; e < kN; ++e) dw_row[v * kN + e] = q == 0 ? dw[k][e] : dw_row[v * kN + e] + dw[k][e];
      }
    }
    __syncthreads();
  }
  const int tid = slot * tpr + t, nthreads = slots * tpr;
  for (int64_t i = tid; i < H / 4; i += nthreads) store16(out + 4 * i, reinterpret_cast<const uint4*>(dw_row)[i]);
}

template <typename T>
__global__ void __launch_bounds__(kGenericCtaThreads) backward_generic(const BackwardParams p) {
  using V = Vec<T>;
  constexpr int U = kGenericElemsPerThread;
  extern __shared__ __align__(16) float dw_smem[];  // [slots][H] when dw_in_smem
  __shared__ float scratch[2][32];
  const int tpr = blockDim.x, t = threadIdx.x, slot = threadIdx.y, slots = blockDim.y;
  const int64_t H = p.hidden;
  const bool want_dw = p.partials != nullptr;

  // This slot's dW sums: in shared memory, or in its own workspace row. Each column is touched by one
  // thread only, so no barrier is needed until the slots are combined.
  float* acc = nullptr;
  if (want_dw) {
    acc = p.dw_in_smem ? dw_smem + slot * H
                       : p.partials + (static_cast<int64_t>(blockIdx.x) * slots + slot) * p.partial_stride;
    for (int64_t j = t; j < H; j += tpr) acc[j] = 0.f;
  }

  int parity = 0;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * slots; base < p.n_rows;
       base += static_cast<int64_t>(gridDim.x) * slots, parity ^= 1) {
    const int64_t row = base + slot;
    const bool active = row < p.n_rows;
    const RowCoords rc = row_coords(p.x_rows, row);
    const T* x = nullptr;
    const T* dy = nullptr;
    float r = 0.f, dot = 0.f;
    if (active) {
      x = static_cast<const T*>(p.x) + row_offset(p.x_rows, rc);
      dy = static_cast<const T*>(p.grad_y) + row_offset(p.grad_y_rows, rc);
      r = p.rstd[row];
      for (int64_t j0 = t; j0 < H; j0 += static_cast<int64_t>(tpr) * U) {
        float a[U], d[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int64_t j = j0 + static_cast<int64_t>(u) * tpr;
          a[u] = j < H ? V::load1(x + j) : 0.f;
          d[u] = j < H ? V::load1(dy + j) : 0.f;
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int64_t j = j0 + static_cast<int64_t>(u) * tpr;
          if (j < H) dot += (d[u] * load_weight1<T>(p.weight, p.weight_f32, j, p.offset, p.casting)) * a[u];
        }
      }
    }
    dot = row_sum(dot, scratch[parity]);
    if (active) {
      const float c = (r * r * r) * (dot / static_cast<float>(H));
      const T* dr = p.grad_residual_out
                        ? static_cast<const T*>(p.grad_residual_out) + row_offset(p.grad_residual_out_rows, rc)
                        : nullptr;
      T* dx = static_cast<T*>(p.grad_x) + row_offset(p.grad_x_rows, rc);
      for (int64_t j0 = t; j0 < H; j0 += static_cast<int64_t>(tpr) * U) {
        float a[U], d[U], b[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int64_t j = j0 + static_cast<int64_t>(u) * tpr;
          a[u] = j < H ? V::load1(x + j) : 0.f;
          d[u] = j < H ? V::load1(dy + j) : 0.f;
          b[u] = dr && j < H ? V::load1(dr + j) : 0.f;
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int64_t j = j0 + static_cast<int64_t>(u) * tpr;
          if (j < H) {
            const float g = load_weight1<T>(p.weight, p.weight_f32, j, p.offset, p.casting);
            V::store1(dx + j, r * (d[u] * g) - a[u] * c + b[u]);
            if (acc) acc[j] += d[u] * normalized<T>(a[u], r, p.casting);
          }
        }
      }
    }
  }
  if (!want_dw || !p.dw_in_smem) return;
  __syncthreads();
  float* out = p.partials + static_cast<int64_t>(blockIdx.x) * p.partial_stride;
  const int tid = slot * tpr + t, nthreads = slots * tpr;
  for (int64_t j = tid; j < H; j += nthreads) {
    float s = 0.f;
    for (int q = 0; q < slots; ++q) s += dw_smem[q * H + j];  // slot order
    out[j] = s;
  }
}

// dW[j] = sum over workspace rows of partials[q][j]: 32 columns x 32 row groups per CTA. Row group y adds
// rows y, y + 32, ... in order, then group 0 adds the 32 group sums in order, and rounds once.
constexpr int kReduceCols = 32, kReduceGroups = 32;

template <typename W>
__global__ void __launch_bounds__(kReduceCols* kReduceGroups)
    reduce_dw(const float* partials, int64_t rows, int64_t stride, int64_t H, W* dw) {
  __shared__ float sums[kReduceGroups][kReduceCols + 1];
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kReduceCols + threadIdx.x;
  float s = 0.f;
  if (col < H) {
#pragma unroll 4
    for (int64_t q = threadIdx.y; q < rows; q += kReduceGroups) s += partials[q * stride + col];
  }
  sums[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && col < H) {
    float total = 0.f;
    for (int q = 0; q < kReduceGroups; ++q) total += sums[q][threadIdx.x];
    Vec<W>::store1(dw + col, total);
  }
}

using BackwardKernel = void (*)(BackwardParams);

template <typename T, bool kResidual>
BackwardKernel pick_registers(const Plan& plan) {
  // kBackwardVariants
  if (plan.dw_in_smem) {
    if (plan.prefetch && plan.vpt == 4) return backward_registers<T, 4, true, kResidual, true>;
    if (!plan.prefetch && plan.vpt == 8) return backward_registers<T, 8, false, kResidual, true>;
  } else if (!plan.prefetch) {
    switch (plan.vpt) {
      case 4:
        return backward_registers<T, 4, false, kResidual, false>;
      case 8:
        return backward_registers<T, 8, false, kResidual, false>;
    }
  } else {
    switch (plan.vpt) {
      case 2:
        return backward_registers<T, 2, true, kResidual, false>;
      case 4:
        return backward_registers<T, 4, true, kResidual, false>;
    }
  }
  throw_runtime(str_cat("rms_norm backward: no register kernel for ", plan.vpt, " vectors per thread, prefetch ",
                        plan.prefetch ? 1 : 0, ", dW in shared memory ", plan.dw_in_smem ? 1 : 0));
}

template <typename T>
BackwardKernel pick(const Plan& plan, bool residual) {
  if (plan.algo == RMSNormAlgo::kGeneric) return backward_generic<T>;
  return residual ? pick_registers<T, true>(plan) : pick_registers<T, false>(plan);
}

BackwardKernel pick(DType dtype, const Plan& plan, bool residual) {
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

struct Launch {
  Plan plan;
  BackwardKernel kernel = nullptr;
  int ctas_per_sm = 0;  // the persistent grid's bound: what fits (the occupancy), capped by the plan
};

PlanInputs plan_inputs(DType dtype, int64_t hidden, RMSNormAlgo algo, int vpt, bool vector_ok, bool residual,
                       const DeviceInfo& info) {
  PlanInputs in;
  in.hidden = hidden;
  in.elem_bytes = static_cast<int>(dtype_size(dtype));
  in.backward = true;
  in.vector_ok = vector_ok;
  in.residual = residual;
  in.requested = algo;
  in.vpt = vpt;
  in.smem_per_block = info.max_smem_per_block_optin;
  return in;
}

// The kernel and its CTAs per SM for a plan (the occupancy is the device's answer for this kernel, so the workspace
// size and the launch agree). Runtime calls only the first time a kernel meets a device.
Launch complete(DType dtype, Plan plan, const PlanInputs& in, int device) {
  if (const debug::PlanHook hook = debug::plan_hook.get()) {
    hook(plan, in);
    plan.smem_bytes = plan_smem_bytes(plan, in);
    if (const char* why = plan_error(plan, in))
      throw_invalid(str_cat("rms_norm backward: a debug plan hook made an unusable plan: ", why));
  }
  Launch l;
  l.plan = plan;
  l.kernel = pick(dtype, plan, in.residual);
  l.ctas_per_sm = max_ctas_per_sm(reinterpret_cast<const void*>(l.kernel), plan.threads(), plan.smem_bytes, device);
  if (plan.ctas_per_sm > 0) l.ctas_per_sm = std::min(l.ctas_per_sm, plan.ctas_per_sm);
  return l;
}

// The launch for these arguments: the plan, its kernel and its CTAs per SM.
Launch prepare(DType dtype, int64_t hidden, RMSNormAlgo algo, int vpt, bool vector_ok, bool residual, int device) {
  const PlanInputs in = plan_inputs(dtype, hidden, algo, vpt, vector_ok, residual, device_info(device));
  const Plan plan = plan_rms_norm(in);
  if (plan.algo == RMSNormAlgo::kAuto)
    throw_invalid(
        str_cat("algo: expected a kernel that can run these arguments, got registers, which cannot: ", plan.why_not));
  return complete(dtype, plan, in, device);
}

template <typename W>
void launch_reduce(const float* partials, int64_t rows, int64_t stride, int64_t H, void* dw, cudaStream_t stream) {
  const int64_t grid = (H + kReduceCols - 1) / kReduceCols;
  launch_kernel("launch of rms_norm dW reduction", reduce_dw<W>, dim3(static_cast<unsigned>(grid)),
                dim3(kReduceCols, kReduceGroups), 0, stream, partials, rows, stride, H, static_cast<W*>(dw));
}

}  // namespace

// The occupancy the device reports for a kernel at a CTA shape, from the process-wide launch cache: every backward
// asks twice (for the workspace size and for the launch), and the answer never changes for a process. `device` is
// passed on, so that a cached answer costs no runtime call at all.
int max_ctas_per_sm(const void* kernel, int threads, size_t smem, int device) {
  if (smem > 48 * 1024) LOGITLESS_CUDA_CHECK(launch_cache::reserve_dynamic_smem(device, kernel, smem));
  const int n = launch_cache::max_active_blocks(device, kernel, threads, smem);
  if (n < 1) throw_runtime("rms_norm: the kernel does not fit on this device");
  return n;
}

size_t backward_workspace_bytes_cuda(int64_t n_rows, int64_t hidden, DType dtype, const RMSNormOptions& o, int device) {
  if (n_rows == 0) return 0;
  const DeviceInfo& info = device_info(device);
  // Alignment is a property of the tensors the backward will get, unknown here, and so is whether a
  // residual-output gradient comes with them (the plan depends on it): size for every kernel that may run
  // (the register ones as if aligned, with and without the residual, and the generic one). Each is a pure plan
  // and a cached occupancy: arithmetic once the kernels have met the device.
  size_t need = 0;
  auto add = [&](const PlanInputs& in, const Plan& plan) {
    const Launch l = complete(dtype, plan, in, device);
    need = std::max(need, workspace_bytes(persistent_grid(l.plan, n_rows, info.sm_count, l.ctas_per_sm), hidden));
  };
  for (bool residual : {false, true}) {
    if (o.algo != RMSNormAlgo::kGeneric) {
      const PlanInputs in =
          plan_inputs(dtype, hidden, RMSNormAlgo::kRegisters, o.vectors_per_thread, true, residual, info);
      const Plan plan = plan_rms_norm(in);
      if (plan.algo == RMSNormAlgo::kRegisters) add(in, plan);
    }
    if (o.algo != RMSNormAlgo::kRegisters) {
      const PlanInputs in = plan_inputs(dtype, hidden, RMSNormAlgo::kGeneric, 0, false, residual, info);
      add(in, plan_rms_norm(in));
    }
  }
  return need;
}

void backward_cuda(const BackwardProblem& p, Workspace ws, StreamHandle stream) {
  DeviceGuard guard(p.device.index);
  const auto s = static_cast<cudaStream_t>(stream);
  const int64_t es = dtype_size(p.dtype);
  const bool vector_ok = rows_aligned16(p.grad_y, p.grad_y_rows, es) &&
                         rows_aligned16(p.grad_residual_out, p.grad_residual_out_rows, es) &&
                         rows_aligned16(p.x, p.x_rows, es) && rows_aligned16(p.grad_x, p.grad_x_rows, es) &&
                         aligned16(p.weight);
  const int64_t stride = workspace_row_stride(p.hidden);
  PersistentGrid grid;
  if (p.n_rows > 0) {
    const Launch l = prepare(p.dtype, p.hidden, p.algo, p.vectors_per_thread, vector_ok, p.grad_residual_out != nullptr,
                             p.device.index);
    grid = persistent_grid(l.plan, p.n_rows, device_info(p.device.index).sm_count, l.ctas_per_sm);
    BackwardParams kp;
    kp.grad_y = p.grad_y;
    kp.grad_y_rows = p.grad_y_rows;
    kp.grad_residual_out = p.grad_residual_out;
    kp.grad_residual_out_rows = p.grad_residual_out_rows;
    kp.x = p.x;
    kp.x_rows = p.x_rows;
    kp.weight = p.weight;
    kp.weight_f32 = p.weight_dtype == DType::kFloat32 && p.dtype != DType::kFloat32;
    kp.rstd = p.rstd;
    kp.grad_x = p.grad_x;
    kp.grad_x_rows = p.grad_x_rows;
    kp.n_rows = p.n_rows;
    kp.hidden = p.hidden;
    kp.offset = p.offset;
    kp.casting = p.casting;
    kp.dw_in_smem = l.plan.dw_in_smem;
    if (p.grad_weight) {
      // What this launch writes, at most what rms_norm_backward_workspace_bytes said (the largest of the kernels
      // that may run): checked here rather than by a second workspace query per call.
      check_workspace(ws, workspace_bytes(grid, p.hidden));
      kp.partials = static_cast<float*>(ws.data);
      kp.partial_stride = stride;
    }
    debug::last_backward.set({l.plan, grid.ctas});
    launch_kernel("launch of rms_norm backward", l.kernel, dim3(static_cast<unsigned>(grid.ctas)),
                  dim3(l.plan.threads_per_row, l.plan.rows_per_cta), l.plan.smem_bytes, s, kp);
  }
  if (!p.grad_weight) return;
  // With no rows the reduction adds nothing and writes zeros.
  const float* partials = static_cast<const float*>(ws.data);
  switch (p.grad_weight_dtype) {
    case DType::kFloat32:
      launch_reduce<float>(partials, grid.partial_rows, stride, p.hidden, p.grad_weight, s);
      break;
    case DType::kFloat16:
      launch_reduce<__half>(partials, grid.partial_rows, stride, p.hidden, p.grad_weight, s);
      break;
    case DType::kBFloat16:
      launch_reduce<__nv_bfloat16>(partials, grid.partial_rows, stride, p.hidden, p.grad_weight, s);
      break;
    default:
      throw_invalid(
          str_cat("grad_weight: expected dtype float32, float16 or bfloat16, got ", dtype_name(p.grad_weight_dtype)));
  }
}

}  // namespace logitless::rms
