// The row kernels of the gradient in forward on the fused Hopper path (params.h, ExpGradParams): the shift
// before the logits GEMM; the per-row scale and target term after it, and the rewrite of the rows the scaled form
// does not suit; after the grad_weight and grad_hidden GEMMs, their target terms in float32. None touches more than
// one element of a [rows, V] row, except exp_fixup on the rows it rewrites.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cub/device/device_radix_sort.cuh>
#include <type_traits>

#include "common/cuda/check.cuh"
#include "common/cuda/vec.cuh"
#include "cross_entropy/cuda/device.cuh"
#include "linear_cross_entropy/cuda/dtype_io.cuh"
#include "linear_cross_entropy/cuda/kernels.h"
#include "linear_cross_entropy/cuda/plan.h"  // kFusedTileCols

namespace logitless::lce {
namespace {

constexpr int kRowThreads = 256;  // a warp per row
constexpr int kFixThreads = 256;  // exp_fixup: 8 warps x 8 columns
constexpr int kFixColsPerWarp = 8;
constexpr int kFixCols = kFixThreads / 32 * kFixColsPerWarp;
constexpr int kFixRows = 8;    // rows rewritten per pass over the weight
constexpr int kFixSpan = 256;  // hidden elements per shared-memory slice

__device__ __forceinline__ const __nv_bfloat16* bf16_row(const void* base, int64_t ld, int64_t r) {
  return static_cast<const __nv_bfloat16*>(base) + r * ld;
}

// d(loss)/dZ[r, j] = a p_j - [j == t] b (no label smoothing, no soft cap: ExpGradParams' options).
__device__ __forceinline__ ce::GradCoeffs coeffs_of(const ExpGradParams& p, int64_t r, int64_t t, float lse) {
  const float up = p.upstream ? p.upstream[p.upstream_per_row ? r : 0] : 1.f;
  return ce::row_grad_coeffs(lse, ce::target_weight(p.ce, t), p.scalars->weight_sum, 0.f, p.ce.inv_v, p.ce.z,
                             p.scalars->inv_denom * up, p.scalars->inv_count * up);
}

// A warp's dot product of a bfloat16 hidden row and a weight row (16-byte loads where both rows allow them).
__device__ __forceinline__ float warp_dot(const __nv_bfloat16* a, const __nv_bfloat16* b, int64_t h) {
  const int lane = threadIdx.x & 31;
  float acc = 0.f;
  int64_t h8 = 0;
  if (reinterpret_cast<uintptr_t>(a) % 16 == 0 && reinterpret_cast<uintptr_t>(b) % 16 == 0) {
    h8 = h / 8 * 8;
    for (int64_t i = lane * 8; i < h8; i += 32 * 8) {
      const uint4 ua = *reinterpret_cast<const uint4*>(a + i), ub = *reinterpret_cast<const uint4*>(b + i);
      const __nv_bfloat162* pa = reinterpret_cast<const __nv_bfloat162*>(&ua);
      const __nv_bfloat162* pb = reinterpret_cast<const __nv_bfloat162*>(&ub);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float2 fa = __bfloat1622float2(pa[k]), fb = __bfloat1622float2(pb[k]);
        acc = fmaf(fa.x, fb.x, fmaf(fa.y, fb.y, acc));
      }
    }
  }
  for (int64_t i = h8 + lane; i < h; i += 32) acc = fmaf(__bfloat162float(a[i]), __bfloat162float(b[i]), acc);
  return ce::warp_sum(acc);
}

__host__ __device__ __forceinline__ bool aligned(const void* ptr, size_t bytes) {
  return reinterpret_cast<uintptr_t>(ptr) % bytes == 0;
}

// Four consecutive elements of T as float: 8-byte aligned for 16-bit T, 16-byte for float.
template <typename T>
__device__ __forceinline__ void load4(const T* ptr, float (&v)[4]) {
  if constexpr (std::is_same_v<T, float>) {
    const float4 f = *reinterpret_cast<const float4*>(ptr);
    v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
  } else {
    const uint2 u = *reinterpret_cast<const uint2*>(ptr);
    const uint32_t halves[2] = {u.x, u.y};
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      float2 f;
      if constexpr (std::is_same_v<T, __nv_bfloat16>)
        f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&halves[k]));
      else
        f = __half22float2(*reinterpret_cast<const __half2*>(&halves[k]));
      v[2 * k] = f.x, v[2 * k + 1] = f.y;
    }
  }
}

// The four values of a row of T at columns [c, c + 4): one vector access where `vec4` (the row allows them and
// h % 4 == 0), else the elements below h, with zeros past it. c < h.
template <typename T>
__device__ __forceinline__ void load4_within(const T* row, int64_t c, int64_t h, bool vec4, float (&v)[4]) {
  if (vec4) return load4(row + c, v);
#pragma unroll
  for (int e = 0; e < 4; ++e) v[e] = c + e < h ? Vec<T>::load1(row + c + e) : 0.f;
}

// Their store: the same accesses, rounded to nearest (nothing past h).
template <typename T>
__device__ __forceinline__ void store4_within(T* row, int64_t c, int64_t h, bool vec4, const float (&v)[4]) {
  if (vec4) return head::store4<T>(row, c, v);
#pragma unroll
  for (int e = 0; e < 4; ++e)
    if (c + e < h) Vec<T>::store1(row + c + e, v[e]);
}

// xs[r] = s * x[r], by `step` threads (lane: this one's index among them); 16-byte accesses where the rows allow.
__device__ __forceinline__ void write_scaled_row(const ExpGradParams& p, int64_t r, float s, int lane, int step) {
  if (!p.xs) return;
  const __nv_bfloat16* xr = bf16_row(p.x, p.ldx, r);
  __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.xs) + r * p.h;
  if (p.h % 8 == 0 && aligned(xr, 16) && aligned(out, 16)) {
    for (int64_t i = lane * 8; i < p.h; i += step * 8) {
      uint4 u = *reinterpret_cast<const uint4*>(xr + i);
      __nv_bfloat162* q = reinterpret_cast<__nv_bfloat162*>(&u);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float2 f = __bfloat1622float2(q[k]);
        q[k] = __floats2bfloat162_rn(s * f.x, s * f.y);
      }
      *reinterpret_cast<uint4*>(out + i) = u;
    }
    return;
  }
  for (int64_t i = lane; i < p.h; i += step) out[i] = __float2bfloat16_rn(s * __bfloat162float(xr[i]));
}

// The sort's key and value of row r: its target's column (v: no target term to add to grad_weight).
__device__ __forceinline__ void set_class_key(const ExpGradParams& p, int64_t r, int64_t column) {
  if (!p.class_keys) return;
  p.class_keys[r] = static_cast<int>(column);
  p.class_rows[r] = static_cast<int>(r);
}

__global__ void __launch_bounds__(kRowThreads) target_shift_kernel(const ExpGradParams p) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kRowThreads / 32);
  for (int64_t r = blockIdx.x * static_cast<int64_t>(kRowThreads / 32) + threadIdx.x / 32; r < p.rows; r += warps) {
    const int64_t t = p.target[r];
    if (ce::classify(p.ce, t) != ce::RowKind::kValid) {  // uniform over the warp
      if (lane == 0) p.shift[r] = 0.f;
      continue;
    }
    const int64_t j = ce::target_column(p.ce, t);
    float z = warp_dot(bf16_row(p.x, p.ldx, r), bf16_row(p.w, p.ldw, j), p.h);
    if (p.bias) z += load_as_float(p.bias, p.bias_dtype, j * p.bias_stride);
    if (lane == 0) p.shift[r] = z;
  }
}

__global__ void __launch_bounds__(kRowThreads) exp_rows_kernel(const ExpGradParams p) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kRowThreads / 32);
  for (int64_t r = blockIdx.x * static_cast<int64_t>(kRowThreads / 32) + threadIdx.x / 32; r < p.rows; r += warps) {
    const int64_t t = p.target[r];
    const ce::RowKind kind = ce::classify(p.ce, t);
    if (kind != ce::RowKind::kValid) {  // no gradient (ignored) or NaN (a bad target; its E row is NaN)
      if (lane == 0) {
        p.scale[r] = p.target_coef[r] = kind == ce::RowKind::kBad ? NAN : 0.f;
        set_class_key(p, r, p.v);
      }
      write_scaled_row(p, r, 0.f, lane, 32);
      continue;
    }
    const float lse = p.lse[r], c = p.shift[r];
    const ce::GradCoeffs g = coeffs_of(p, r, t, lse);
    const int64_t j = ce::target_column(p.ce, t);
    if (lane == 0) set_class_key(p, r, j);
    // Rewritten by exp_fixup: E may exceed e^kExpRange (lse, at least the row's maximum logit, is that far above
    // shift), or a is so small beside b (a z-loss cancelling the target's weight) that the target's element,
    // (a p_t - b) / (a exp(c - lse)), would lose its precision.
    if (p.force_fixups || lse - c > kExpRange || !(fabsf(g.a) >= 0x1p-8f * fabsf(g.b))) {
      if (lane == 0) p.fixups[1 + atomicAdd(p.fixups, 1)] = static_cast<int>(r);
      continue;
    }
    const float s = g.a * expf(c - lse);
    if (lane == 0) {
      static_cast<__nv_bfloat16*>(p.e)[r * p.ld_e + j] = __float2bfloat16_rn(0.f);
      p.target_coef[r] = s - g.b;  // a p_t - b, with p_t = exp(c - lse): c is the target's logit
      p.scale[r] = s;
    }
    write_scaled_row(p, r, s, lane, 32);
  }
}

// The rows exp_rows listed: their logits again (float32 dot products), then E[r, j] = d(loss)/dZ[r, j] / s with
// s = max(|a|, |b|), at least the row's largest gradient term (|a p_j - [j = t] b| <= |a| + |b|), so that every
// element is at most 2.
// Each CTA owns kFixCols columns and reads their weight rows once per kFixRows listed rows. CTA 0 writes the
// rows' scale and scaled hidden row.
__global__ void __launch_bounds__(kFixThreads) exp_fixup_kernel(const ExpGradParams p) {
  __shared__ float xsh[kFixRows][kFixSpan];
  const int count = p.fixups[0];
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * kFixCols + warp * kFixColsPerWarp;
  for (int k0 = 0; k0 < count; k0 += kFixRows) {
    const int nr = min(kFixRows, count - k0);
    float acc[kFixColsPerWarp][kFixRows];
#pragma unroll
    for (int c = 0; c < kFixColsPerWarp; ++c)
#pragma unroll
      for (int q = 0; q < kFixRows; ++q) acc[c][q] = 0.f;
    for (int64_t h0 = 0; h0 < p.h; h0 += kFixSpan) {
      const int span = static_cast<int>(p.h - h0 < kFixSpan ? p.h - h0 : kFixSpan);
      __syncthreads();
      for (int i = threadIdx.x; i < kFixRows * kFixSpan; i += kFixThreads) {
        const int q = i / kFixSpan, k = i % kFixSpan;
        xsh[q][k] = q < nr && k < span ? __bfloat162float(bf16_row(p.x, p.ldx, p.fixups[1 + k0 + q])[h0 + k]) : 0.f;
      }
      __syncthreads();
#pragma unroll
      for (int c = 0; c < kFixColsPerWarp; ++c) {
        if (col0 + c >= p.v) break;
        const __nv_bfloat16* wr = bf16_row(p.w, p.ldw, col0 + c) + h0;
        for (int k = lane; k < span; k += 32) {
          const float wv = __bfloat162float(wr[k]);
#pragma unroll
          for (int q = 0; q < kFixRows; ++q) acc[c][q] = fmaf(wv, xsh[q][k], acc[c][q]);
        }
      }
    }
#pragma unroll
    for (int q = 0; q < kFixRows; ++q) {
      if (q >= nr) break;
      const int64_t r = p.fixups[1 + k0 + q], t = p.target[r];
      const float lse = p.lse[r];
      const ce::GradCoeffs g = coeffs_of(p, r, t, lse);
      const float s = fmaxf(fabsf(g.a), fabsf(g.b));
      const int64_t tc = ce::target_column(p.ce, t);
#pragma unroll
      for (int c = 0; c < kFixColsPerWarp; ++c) {
        const float dot = ce::warp_sum(acc[c][q]);
        const int64_t j = col0 + c;
        if (lane != 0 || j >= p.v) continue;
        const float z = p.bias ? dot + load_as_float(p.bias, p.bias_dtype, j * p.bias_stride) : dot;
        const float d = g.a * expf(z - lse);
        float e = s != 0.f ? d / s : 0.f;
        if (j == tc) p.target_coef[r] = d - g.b, e = 0.f;  // kept out of E in float32, as exp_rows does
        static_cast<__nv_bfloat16*>(p.e)[r * p.ld_e + j] = __float2bfloat16_rn(e);
      }
      if (blockIdx.x == 0) {
        if (threadIdx.x == 0) p.scale[r] = s;
        write_scaled_row(p, r, s, threadIdx.x, kFixThreads);
      }
    }
  }
}

constexpr int kTermThreads = 256;
constexpr int kTermVectors = 4;                             // 4-column vectors per thread
constexpr int kTermCols = kTermThreads * 4 * kTermVectors;  // columns of grad_weight per CTA

// grad_weight[j] += Σ target_coef[r] x[r] over the rows r whose target is class j, in float32, rounded once into
// grad_weight (of type T). keys / rows: every row's target column (v: none) and index, sorted by column, so that
// position i starts class keys[i]'s run where keys[i - 1] differs; that CTA sums the whole run (in row order:
// deterministic) and is the only writer of the class's row, so no atomics are needed. Grid: positions × column
// slices. A CTA's loads are few and dependent (key, row, coefficient, then the rows), so each thread takes several
// vectors of 4 columns at once (vec4: the rows allow 8- and 16-byte accesses), and a CTA a whole slice of H.
template <typename T>
__global__ void __launch_bounds__(kTermThreads)
    grad_weight_targets_kernel(const ExpGradParams p, const int* keys, const int* rows, const TargetRowsOut dw,
                               bool vec4) {
  const int64_t i = blockIdx.x;
  const int key = keys[i];
  if (key >= p.v || (i > 0 && keys[i - 1] == key)) return;
  const int64_t c0 = static_cast<int64_t>(blockIdx.y) * kTermCols + threadIdx.x * 4;
  float acc[kTermVectors][4] = {};
  for (int64_t k = i; k < p.rows && keys[k] == key; ++k) {
    const int64_t r = rows[k];
    const float coef = p.target_coef[r];
    const __nv_bfloat16* xr = bf16_row(p.x, p.ldx, r);
#pragma unroll
    for (int q = 0; q < kTermVectors; ++q) {
      const int64_t c = c0 + q * kTermThreads * 4;
      if (c >= p.h) break;
      float x[4];
      load4_within(xr, c, p.h, vec4, x);
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[q][e] = fmaf(coef, x[e], acc[q][e]);
    }
  }
  T* out = static_cast<T*>(key < dw.split ? dw.head : dw.tail) + (key < dw.split ? key : key - dw.split) * dw.ld;
#pragma unroll
  for (int q = 0; q < kTermVectors; ++q) {
    const int64_t c = c0 + q * kTermThreads * 4;
    if (c >= p.h) break;
    float v[4];
    load4_within(out, c, p.h, vec4, v);
#pragma unroll
    for (int e = 0; e < 4; ++e) v[e] += acc[q][e];
    store4_within(out, c, p.h, vec4, v);
  }
}

// grad_hidden[r] = scale[r] y[r] + target_coef[r] W[t_r] (y = E W, float32), in grad_hidden's type T: a CTA per row,
// in place when grad_hidden is y itself; vectors of 4 columns where the rows allow (vec4).
template <typename T>
__global__ void __launch_bounds__(kTermThreads)
    grad_hidden_rows_kernel(const ExpGradParams p, const float* y, int64_t ldy, T* dx, int64_t ld_dx, bool vec4) {
  for (int64_t r = blockIdx.x; r < p.rows; r += gridDim.x) {
    const int64_t t = p.target[r];
    const bool valid = ce::classify(p.ce, t) == ce::RowKind::kValid;
    const __nv_bfloat16* wt = valid ? bf16_row(p.w, p.ldw, ce::target_column(p.ce, t)) : nullptr;
    const float s = p.scale[r], coef = p.target_coef[r];
    const float* yr = y + r * ldy;
    T* out = dx + r * ld_dx;
    for (int64_t c = threadIdx.x * 4; c < p.h; c += kTermThreads * 4) {
      float v[4], w[4];
      load4_within(yr, c, p.h, vec4, v);
#pragma unroll
      for (int e = 0; e < 4; ++e) v[e] *= s;
      if (valid) {
        load4_within(wt, c, p.h, vec4, w);
#pragma unroll
        for (int e = 0; e < 4; ++e) v[e] = fmaf(coef, w[e], v[e]);
      }
      store4_within(out, c, p.h, vec4, v);
    }
  }
}

int row_blocks(int64_t rows, int sm_count) {
  return static_cast<int>(std::max<int64_t>(
      1, std::min<int64_t>((rows + kRowThreads / 32 - 1) / (kRowThreads / 32), int64_t{sm_count} * 8)));
}

// The radix sort's key bits: keys run from 0 to v.
int key_bits(int64_t v) {
  int bits = 1;
  while ((int64_t{1} << bits) <= v) ++bits;
  return bits;
}

}  // namespace

size_t exp_target_sort_bytes(int64_t rows) {
  size_t bytes = 0;
  LOGITLESS_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, bytes, static_cast<const int*>(nullptr),
                                                       static_cast<int*>(nullptr), static_cast<const int*>(nullptr),
                                                       static_cast<int*>(nullptr), static_cast<int>(rows)));
  return bytes;
}

// Calls f(T{}) with T the C++ type of a float32, float16 or bfloat16 buffer.
template <typename F>
void with_type(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat16:
      return f(__half{});
    case DType::kBFloat16:
      return f(__nv_bfloat16{});
    default:
      return f(float{});
  }
}

// Whether rows of T with this base and stride take 4-column vectors (8 bytes for 16-bit T, 16 for float) at every
// column that is a multiple of 4 below h.
bool rows_take_vec4(const void* base, int64_t ld, int64_t h, DType dtype) {
  const size_t bytes = 4 * dtype_size(dtype);
  return h % 4 == 0 && ld % 4 == 0 && aligned(base, bytes);
}

void launch_grad_weight_targets(const ExpGradParams& p, const TargetSort& sort, const TargetRowsOut& dw,
                                cudaStream_t stream) {
  if (p.rows <= 0) return;
  size_t bytes = sort.temp_bytes;
  LOGITLESS_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(sort.temp, bytes, p.class_keys, sort.keys, p.class_rows,
                                                       sort.rows, static_cast<int>(p.rows), 0, key_bits(p.v), stream));
  const bool vec4 = rows_take_vec4(p.x, p.ldx, p.h, DType::kBFloat16) &&
                    rows_take_vec4(dw.head, dw.ld, p.h, dw.dtype) &&
                    (!dw.tail || rows_take_vec4(dw.tail, dw.ld, p.h, dw.dtype));
  const dim3 grid(static_cast<unsigned>(p.rows), static_cast<unsigned>((p.h + kTermCols - 1) / kTermCols));
  with_type(dw.dtype, [&](auto t) {
    grad_weight_targets_kernel<decltype(t)><<<grid, kTermThreads, 0, stream>>>(p, sort.keys, sort.rows, dw, vec4);
  });
  LOGITLESS_CUDA_CHECK_LAUNCH("linear cross-entropy grad_weight target terms");
}

void launch_grad_hidden_rows(const ExpGradParams& p, const float* y, int64_t ldy, void* dx, DType dx_dtype,
                             int64_t ld_dx, int sm_count, cudaStream_t stream) {
  if (p.rows <= 0) return;
  const auto blocks = static_cast<unsigned>(std::min<int64_t>(p.rows, int64_t{sm_count} * 8));
  const bool vec4 = rows_take_vec4(y, ldy, p.h, DType::kFloat32) && rows_take_vec4(p.w, p.ldw, p.h, DType::kBFloat16) &&
                    rows_take_vec4(dx, ld_dx, p.h, dx_dtype);
  with_type(dx_dtype, [&](auto t) {
    using T = decltype(t);
    grad_hidden_rows_kernel<T><<<blocks, kTermThreads, 0, stream>>>(p, y, ldy, static_cast<T*>(dx), ld_dx, vec4);
  });
  LOGITLESS_CUDA_CHECK_LAUNCH("linear cross-entropy grad_hidden rows");
}

void launch_target_shift(const ExpGradParams& p, int sm_count, cudaStream_t stream) {
  if (p.rows <= 0) return;
  target_shift_kernel<<<row_blocks(p.rows, sm_count), kRowThreads, 0, stream>>>(p);
  LOGITLESS_CUDA_CHECK_LAUNCH("linear cross-entropy target shift");
}

void launch_exp_rows(const ExpGradParams& p, int sm_count, cudaStream_t stream) {
  if (p.rows <= 0) return;
  LOGITLESS_CUDA_CHECK(cudaMemsetAsync(p.fixups, 0, sizeof(int), stream));
  exp_rows_kernel<<<row_blocks(p.rows, sm_count), kRowThreads, 0, stream>>>(p);
  LOGITLESS_CUDA_CHECK_LAUNCH("linear cross-entropy gradient row scales");
  // One CTA per kFixCols columns; with no listed row (the usual case) each reads the count and returns.
  const int64_t blocks = (p.v + kFixCols - 1) / kFixCols;
  exp_fixup_kernel<<<static_cast<unsigned>(blocks), kFixThreads, 0, stream>>>(p);
  LOGITLESS_CUDA_CHECK_LAUNCH("linear cross-entropy gradient row rewrite");
}

}  // namespace logitless::lce
