// The Hopper cross-entropy kernel: each row is read from HBM exactly once.
//
// A bf16 row of 128256 logits is 256 KB, more than one SM's shared memory (227 KB), and the gradient needs
// the row's log-sum-exp before its first element can be written. A thread-block cluster of C CTAs therefore
// shares a row: CTA r bulk-copies its 1/C slice into shared memory (TMA, completing on an mbarrier), reduces
// it to a partial (max, sum of exp, sum of w*x), and the partials are exchanged through distributed shared
// memory. Every CTA then finishes the row's statistics itself and writes the gradient of its slice straight
// from shared memory. HBM traffic is one read of the logits and one write of the gradient, in place or not.
//
// Each CTA keeps `stages` slices in flight: while row k is reduced, rows k+1..k+stages-1 are landing. Rows
// whose target is ignore_index (or out of range) are never loaded.
#include <cooperative_groups.h>
#include <cuda/ptx>

#include "common/cuda/check.cuh"
#include "cross_entropy/cuda/device.cuh"
#include "cross_entropy/cuda/kernels.h"

namespace logitless::ce {
namespace {

namespace cg = cooperative_groups;

int debug_max_clusters = 0;

struct ResidentShape {
  int64_t slice;  // elements per CTA
  int stages;
  int stage_bytes;
  int pieces;     // bulk copies per slice
};

// The hot loops come in two flavours: kGeneral handles soft-capping and label smoothing (a tanh, a division
// and a class-weight load per element); the plain one, which covers class weights and z-loss too (they act
// per row), is straight-line code: with only 16 warps per SM to hide latency, per-element branches cost a
// factor of several (measured: 28% of copy bandwidth with them, see bench/RESULTS.md).
template <typename T, bool kGeneral>
struct SliceMath {
  static constexpr int kVec = Vec<T>::kN;
  static constexpr int kUnroll = 4;  // 16-byte chunks in flight per thread and pass
  const KernelParams& p;

  __device__ float cap(float y) const {
    if constexpr (kGeneral) return capped(p, y);
    return y;
  }

  // Chunk q's values (capped), adding w_j x_j to swx for label smoothing.
  __device__ void load_x(const char* stage, int q, int64_t j0, float* x, float& swx) const {
    Vec<T>::unpack(*reinterpret_cast<const uint4*>(stage + 16 * q), x);
    if constexpr (kGeneral) {
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        x[i] = capped(p, x[i]);
        if (p.eps != 0.f) swx += class_weight(p, j0 + static_cast<int64_t>(q) * kVec + i) * x[i];
      }
    }
  }

  // Statistics of the slice's whole chunks [q_lo, q_hi), read from shared memory, merged into (m, s, swx).
  // The main loop issues kUnroll loads with no branch between them; a remainder loop takes the rest.
  __device__ void stats(const char* stage, int q_lo, int q_hi, int64_t j0, float& m, float& s, float& swx) const {
    const int nt = blockDim.x;
    int q = q_lo + static_cast<int>(threadIdx.x);
    for (; q + (kUnroll - 1) * nt < q_hi; q += kUnroll * nt) {
      float x[kUnroll * kVec];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) load_x(stage, q + u * nt, j0, x + u * kVec, swx);
      online_add<kUnroll * kVec>(m, s, x);
    }
    for (; q < q_hi; q += nt) {
      float x[kVec];
      load_x(stage, q, j0, x, swx);
      online_add<kVec>(m, s, x);
    }
  }

  // Gradient of whole chunk q (values v, in place).
  __device__ void grad_chunk(float* v, int q, int64_t j0, const GradCoeffs& g, float lse_l2, int q_t, int slot_t,
                             int64_t t) const {
    if constexpr (kGeneral) {
#pragma unroll
      for (int i = 0; i < kVec; ++i)
        v[i] = grad_elem(p, g, lse_l2, capped(p, v[i]), j0 + static_cast<int64_t>(q) * kVec + i, t);
    } else {
#pragma unroll
      for (int i = 0; i < kVec; ++i) v[i] = g.a * fast_exp2(fmaf(v[i], kLog2e, -lse_l2));
      if (q == q_t) {
#pragma unroll
        for (int i = 0; i < kVec; ++i)
          if (i == slot_t) v[i] -= g.b;
      }
    }
  }

  // Gradient of the whole chunks, shared memory -> gdst: 16-byte stores when the gradient's alignment matches
  // the logits' (always, in place), element stores otherwise.
  template <bool kVecStore>
  __device__ void grad(const char* stage, int q_lo, int q_hi, int64_t j0, const GradCoeffs& g, float lse_l2,
                       int q_t, int slot_t, int64_t t, const ChunkSpan<T>& span, char* gdst) const {
    const int nt = blockDim.x;
    char* gbase = gdst - span.mis;
    auto put = [&](int q, const float* v) {
      if constexpr (kVecStore) {
        *reinterpret_cast<uint4*>(gbase + 16 * q) = Vec<T>::pack(v);
      } else {
        store_chunk(span, q, gdst, false, v);
      }
    };
    int q = q_lo + static_cast<int>(threadIdx.x);
    for (; q + (kUnroll - 1) * nt < q_hi; q += kUnroll * nt) {
      float v[kUnroll][kVec];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) Vec<T>::unpack(*reinterpret_cast<const uint4*>(stage + 16 * (q + u * nt)), v[u]);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        grad_chunk(v[u], q + u * nt, j0, g, lse_l2, q_t, slot_t, t);
        put(q + u * nt, v[u]);
      }
    }
    for (; q < q_hi; q += nt) {
      float v[kVec];
      Vec<T>::unpack(*reinterpret_cast<const uint4*>(stage + 16 * q), v);
      grad_chunk(v, q, j0, g, lse_l2, q_t, slot_t, t);
      put(q, v);
    }
  }
};

template <typename T, bool kGeneral>
__global__ void __launch_bounds__(512, 1) row_resident_kernel(const __grid_constant__ KernelParams p,
                                                              const ResidentShape shape) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int kVec = Vec<T>::kN;
  constexpr int64_t kEs = sizeof(T);
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ __align__(8) uint64_t bars[kMaxStages];
  __shared__ float4 xchg[2][kMaxCluster];  // partials of every CTA of the cluster, double-buffered by row
  __shared__ float4 red[32];

  cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  const int csize = static_cast<int>(cluster.num_blocks());
  const int64_t cluster_id = blockIdx.x / csize;
  const int64_t num_clusters = gridDim.x / csize;
  const int tid = threadIdx.x;
  const int64_t slice_begin = rank * shape.slice;
  const int64_t len = max(static_cast<int64_t>(0), min(shape.slice, p.vocab - slice_begin));
  const int S = shape.stages;
  const SliceMath<T, kGeneral> math{p};

  if (tid == 0) {
    for (int s = 0; s < S; ++s) cuda::ptx::mbarrier_init(&bars[s], 1);
    cuda::ptx::fence_mbarrier_init(cuda::ptx::sem_release, cuda::ptx::scope_cluster);
  }
  // Also guarantees every CTA of the cluster runs before anyone writes into a peer's shared memory.
  cluster.sync();

  auto row_of = [&](int64_t k) { return cluster_id + k * num_clusters; };
  auto slice_src = [&](int64_t row) { return p.logits + (p.logits_rows.offset(row) + slice_begin) * kEs; };
  // Producer (thread 0): start the load of iteration k's slice into stage k % S, if the row needs reading.
  auto issue = [&](int64_t k) {
    const int64_t row = row_of(k);
    if (row >= p.n_rows || classify(p, load_target(p, row)) != RowKind::kValid) return;
    const ChunkSpan<T> span(slice_src(row), len);
    const int64_t q0 = span.mis ? 1 : 0, q1 = span.end / 16;  // the whole 16-byte chunks
    const uint32_t bytes = q1 > q0 ? static_cast<uint32_t>((q1 - q0) * 16) : 0u;
    const int s = static_cast<int>(k % S);
    cuda::ptx::mbarrier_arrive_expect_tx(cuda::ptx::sem_release, cuda::ptx::scope_cta, cuda::ptx::space_shared,
                                         &bars[s], bytes);
    // The slice goes as `pieces` bulk copies on one barrier.
    const int64_t nq = q1 - q0;
    for (int i = 0; i < shape.pieces && nq > 0; ++i) {
      const int64_t a = q0 + nq * i / shape.pieces, b = q0 + nq * (i + 1) / shape.pieces;
      if (b > a)
        cuda::ptx::cp_async_bulk(cuda::ptx::space_cluster, cuda::ptx::space_global,
                                 smem + static_cast<size_t>(s) * shape.stage_bytes + 16 * a, span.base + 16 * a,
                                 static_cast<uint32_t>((b - a) * 16), &bars[s]);
    }
  };

  if (tid == 0)
    for (int k = 0; k < S; ++k) issue(k);

  uint32_t phase_bits = 0;  // expected parity of each stage's barrier
  int parity = 0;           // exchange buffer of the next row that exchanges
  const float W = p.scalars->weight_sum;

  for (int64_t k = 0;; ++k) {
    const int64_t row = row_of(k);
    if (row >= p.n_rows) break;
    const int s = static_cast<int>(k % S);
    const int64_t t = load_target(p, row);
    const RowKind kind = classify(p, t);
    char* gdst = p.grad ? p.grad + (p.grad_rows.offset(row) + slice_begin) * kEs : nullptr;

    if (kind == RowKind::kValid) {
      const ChunkSpan<T> span(slice_src(row), len);
      const char* stage = reinterpret_cast<const char*>(smem) + static_cast<size_t>(s) * shape.stage_bytes;
      // Whole chunks [q_lo, q_hi) sit in shared memory; a partial first / last chunk is read from global
      // memory by threads 0 / 1. Slot i of chunk q is element j0 + q * kVec + i of the row.
      const int q_lo = span.mis ? 1 : 0, q_hi = static_cast<int>(span.end / 16);
      const int nch = static_cast<int>(span.nchunks);
      const int64_t j0 = slice_begin - span.mis / kEs;
      const int my_partial = tid == 0 ? (span.mis ? 0 : -1)
                             : tid == 1 ? ((span.end & 15) && nch - 1 != (span.mis ? 0 : -1) ? nch - 1 : -1)
                                        : -1;
      // The target logit is read before the exchange: after it, peers may overwrite the row (in place).
      float x_t = 0.f;
      if (rank == 0 && tid == 0) x_t = capped(p, Vec<T>::load1(p.logits + (p.logits_rows.offset(row) + t) * kEs));

      while (!cuda::ptx::mbarrier_try_wait_parity(&bars[s], (phase_bits >> s) & 1u)) {
      }
      phase_bits ^= 1u << s;

      // Pass 1: online (max, sum of exp) over the slice, and sum of w_j x_j for label smoothing.
      float m = -INFINITY, se = 0.f, swx = 0.f;
      math.stats(stage, q_lo, q_hi, j0, m, se, swx);
      if (my_partial >= 0) {
        float v[kVec];
        const uint32_t mask = load_chunk(span, my_partial, nullptr, v);
#pragma unroll
        for (int i = 0; i < kVec; ++i) {
          const bool ok = (mask >> i) & 1u;
          v[i] = ok ? capped(p, v[i]) : -INFINITY;
          if (p.eps != 0.f && ok) swx += class_weight(p, slice_begin + span.elem(my_partial, i)) * v[i];
        }
        online_add<kVec>(m, se, v);
      }
      block_online(m, se, swx, red);

      // Exchange the partials through distributed shared memory.
      if (tid == 0) {
        const float4 part = make_float4(m, se, swx, 0.f);
        for (int dst = 0; dst < csize; ++dst) *cluster.map_shared_rank(&xchg[parity][rank], dst) = part;
      }
      cluster.sync();
      float M = -INFINITY, S_sum = 0.f, SWX = 0.f;
      for (int r = 0; r < csize; ++r) {
        const float4 pr = xchg[parity][r];
        online_merge(M, S_sum, pr.x, pr.y);
        SWX += pr.z;
      }
      parity ^= 1;
      const float lse = M == -INFINITY ? NAN : M + logf(S_sum);

      if (rank == 0 && tid == 0) write_row_outputs(p, row, kind, RowStats{lse, x_t, SWX}, t);

      // Pass 2: the gradient of the slice, from shared memory straight to its destination.
      if (gdst) {
        const GradCoeffs g = row_grad_coeffs(lse, class_weight(p, t), W, p.eps, p.inv_v, p.z, row_grad_scale(p, row));
        const float lse_l2 = lse * kLog2e;
        const bool vec_ok = (reinterpret_cast<uintptr_t>(gdst) & 15u) == static_cast<uintptr_t>(span.mis);
        const int64_t t_local = t - slice_begin;
        int q_t = -1, slot_t = 0;
        if (t_local >= 0 && t_local < len) {
          const int64_t b = span.mis + t_local * kEs;
          q_t = static_cast<int>(b >> 4);
          slot_t = static_cast<int>((b & 15) / kEs);
        }
        if (vec_ok) {
          math.template grad<true>(stage, q_lo, q_hi, j0, g, lse_l2, q_t, slot_t, t, span, gdst);
        } else {
          math.template grad<false>(stage, q_lo, q_hi, j0, g, lse_l2, q_t, slot_t, t, span, gdst);
        }
        if (my_partial >= 0) {
          float v[kVec];
          const uint32_t mask = load_chunk(span, my_partial, nullptr, v);
#pragma unroll
          for (int i = 0; i < kVec; ++i)
            v[i] = (mask >> i) & 1u ? grad_elem(p, g, lse_l2, capped(p, v[i]), slice_begin + span.elem(my_partial, i), t)
                                    : 0.f;
          store_chunk(span, my_partial, gdst, false, v);
        }
      }
    } else {
      // Ignored rows: loss 0, gradient 0. Out-of-range targets (checks off): NaN. Nothing is read.
      if (rank == 0 && tid == 0) write_row_outputs(p, row, kind, RowStats{0.f, 0.f, 0.f}, t);
      if (gdst) {
        const ChunkSpan<T> gspan(gdst, len);
        float v[kVec];
#pragma unroll
        for (int i = 0; i < kVec; ++i) v[i] = kind == RowKind::kBad ? NAN : 0.f;
        for (int64_t q = tid; q < gspan.nchunks; q += blockDim.x) store_chunk(gspan, q, gdst, true, v);
      }
    }
    __syncthreads();  // stage s is consumed: it may be refilled
    if (tid == 0) issue(k + S);
  }
  // No CTA may exit while a peer could still write its partial into this CTA's shared memory.
  cluster.sync();
#endif
}

template <typename T>
int launch_typed(const KernelParams& p, const Plan& plan, cudaStream_t stream) {
  const bool general = p.softcap > 0.f || p.eps != 0.f;
  auto kernel = general ? row_resident_kernel<T, true> : row_resident_kernel<T, false>;
  LOGITLESS_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(plan.smem_bytes)));
  if (plan.cluster > 8)
    LOGITLESS_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = plan.cluster;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  cfg.blockDim = dim3(plan.threads);
  cfg.dynamicSmemBytes = plan.smem_bytes;
  cfg.stream = stream;
  cfg.gridDim = dim3(plan.cluster);
  int max_clusters = 0;
  const cudaError_t occ = cudaOccupancyMaxActiveClusters(&max_clusters, kernel, &cfg);
  if (occ != cudaSuccess) {
    cudaGetLastError();  // the cluster size is not supported here: not an error, the caller falls back
    return 0;
  }
  if (max_clusters <= 0) return 0;
  // Persistent clusters: one wave, rows strided across them.
  const int64_t clusters = std::min<int64_t>(plan.grid_clusters > 0 ? plan.grid_clusters : max_clusters, p.n_rows);
  debug_max_clusters = max_clusters;
  cfg.gridDim = dim3(static_cast<unsigned>(clusters * plan.cluster));
  const ResidentShape shape{plan.slice, plan.stages, static_cast<int>(plan.stage_bytes), std::max(1, plan.copy_pieces)};
  LOGITLESS_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, p, shape));
  return static_cast<int>(clusters);
}

}  // namespace

int debug::row_resident_max_clusters() { return debug_max_clusters; }

bool row_resident_available(int device) {
  const DeviceInfo& info = device_info(device);
  if (info.sm_major < 9) return false;
  cudaFuncAttributes attr{};
  if (cudaFuncGetAttributes(&attr, row_resident_kernel<__nv_bfloat16, false>) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  // The kernel body exists only in the sm_90+ binaries of this build.
  return attr.binaryVersion >= 90;
}

int launch_row_resident(DType dtype, const KernelParams& p, const Plan& plan, cudaStream_t stream) {
  switch (dtype) {
    case DType::kFloat32: return launch_typed<float>(p, plan, stream);
    case DType::kFloat16: return launch_typed<__half>(p, plan, stream);
    case DType::kBFloat16: return launch_typed<__nv_bfloat16>(p, plan, stream);
    default: throw_invalid("logits: unsupported dtype");
  }
}

}  // namespace logitless::ce
