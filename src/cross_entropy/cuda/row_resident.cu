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

struct ResidentShape {
  int64_t slice;       // elements per CTA
  int stages;
  int stage_bytes;
};

template <typename T>
__global__ void __launch_bounds__(512, 1) row_resident_kernel(const __grid_constant__ KernelParams p,
                                                              const ResidentShape shape) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int kVec = Vec<T>::kN;
  constexpr int64_t kEs = sizeof(T);
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ __align__(8) uint64_t bars[kMaxStages];
  __shared__ float4 xchg[2][kMaxCluster];  // partials of every CTA of the cluster, double-buffered by row
  __shared__ float red1[32];
  __shared__ float2 red2[32];

  cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  const int csize = static_cast<int>(cluster.num_blocks());
  const int64_t cluster_id = blockIdx.x / csize;
  const int64_t num_clusters = gridDim.x / csize;
  const int tid = threadIdx.x;
  const int64_t slice_begin = rank * shape.slice;
  const int64_t len = max(static_cast<int64_t>(0), min(shape.slice, p.vocab - slice_begin));
  const int S = shape.stages;

  if (tid == 0) {
    for (int s = 0; s < S; ++s) cuda::ptx::mbarrier_init(&bars[s], 1);
    cuda::ptx::fence_mbarrier_init(cuda::ptx::sem_release, cuda::ptx::scope_cluster);
  }
  // Also guarantees every CTA of the cluster runs before anyone writes into a peer's shared memory.
  cluster.sync();

  auto row_of = [&](int64_t k) { return cluster_id + k * num_clusters; };
  auto slice_src = [&](int64_t row) {
    return p.logits + (p.logits_rows.offset(row) + slice_begin) * kEs;
  };
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
    if (bytes)
      cuda::ptx::cp_async_bulk(cuda::ptx::space_cluster, cuda::ptx::space_global,
                               smem + static_cast<size_t>(s) * shape.stage_bytes + 16 * q0, span.base + 16 * q0, bytes,
                               &bars[s]);
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
      // The target logit is read before the exchange: after it, peers may overwrite the row (in place).
      float x_t = 0.f;
      if (rank == 0 && tid == 0)
        x_t = capped(p, Vec<T>::load1(p.logits + (p.logits_rows.offset(row) + t) * kEs));

      while (!cuda::ptx::mbarrier_try_wait_parity(&bars[s], (phase_bits >> s) & 1u)) {
      }
      phase_bits ^= 1u << s;

      // Pass 1: the slice's max. tanh is monotonic, so the capped max is the cap of the max.
      float m = -INFINITY;
      for (int64_t q = tid; q < span.nchunks; q += blockDim.x) {
        float v[kVec];
        const uint32_t mask = load_chunk(span, q, stage + 16 * q, v);
#pragma unroll
        for (int i = 0; i < kVec; ++i) m = max_nan(m, (mask >> i) & 1u ? v[i] : -INFINITY);
      }
      m = capped(p, block_max(m, red1));

      // Pass 2: sum of exp(x - m), and sum of w_j x_j for label smoothing.
      float se = 0.f, swx = 0.f;
      if (m != -INFINITY) {  // an all -inf slice contributes nothing (and -inf - -inf would be NaN)
        const float m_l2 = m * kLog2e;
        for (int64_t q = tid; q < span.nchunks; q += blockDim.x) {
          float v[kVec];
          const uint32_t mask = load_chunk(span, q, stage + 16 * q, v);
#pragma unroll
          for (int i = 0; i < kVec; ++i) {
            const bool ok = (mask >> i) & 1u;
            const float x = capped(p, v[i]);
            se += ok ? fast_exp2(fmaf(x, kLog2e, -m_l2)) : 0.f;
            if (p.eps != 0.f && ok) swx += class_weight(p, slice_begin + span.elem(q, i)) * x;
          }
        }
      }
      const float2 red = block_sum2(make_float2(se, swx), red2);

      // Exchange the partials through distributed shared memory.
      if (tid == 0) {
        const float4 part = make_float4(m, red.x, red.y, 0.f);
        for (int dst = 0; dst < csize; ++dst) *cluster.map_shared_rank(&xchg[parity][rank], dst) = part;
      }
      cluster.sync();
      float M = -INFINITY;
      for (int r = 0; r < csize; ++r) M = max_nan(M, xchg[parity][r].x);
      float S_sum = 0.f, SWX = 0.f;
      for (int r = 0; r < csize; ++r) {
        const float4 pr = xchg[parity][r];
        S_sum += pr.x == -INFINITY ? 0.f : pr.y * fast_exp2((pr.x - M) * kLog2e);
        SWX += pr.z;
      }
      parity ^= 1;
      const float lse = M == -INFINITY ? NAN : M + logf(S_sum);

      if (rank == 0 && tid == 0) write_row_outputs(p, row, kind, RowStats{lse, x_t, SWX}, t);

      // Pass 3: the gradient of the slice, from shared memory straight to its destination.
      if (gdst) {
        const GradCoeffs g = row_grad_coeffs(lse, class_weight(p, t), W, p.eps, p.inv_v, p.z, row_grad_scale(p, row));
        const float lse_l2 = lse * kLog2e;
        const bool vec_ok = (reinterpret_cast<uintptr_t>(gdst) & 15u) == static_cast<uintptr_t>(span.mis);
        for (int64_t q = tid; q < span.nchunks; q += blockDim.x) {
          float v[kVec];
          load_chunk(span, q, stage + 16 * q, v);
#pragma unroll
          for (int i = 0; i < kVec; ++i) v[i] = grad_elem(p, g, lse_l2, capped(p, v[i]), slice_begin + span.elem(q, i), t);
          store_chunk(span, q, gdst, vec_ok, v);
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
bool launch_typed(const KernelParams& p, const Plan& plan, cudaStream_t stream) {
  auto kernel = row_resident_kernel<T>;
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
    return false;
  }
  if (max_clusters <= 0) return false;
  // Persistent clusters: one wave, rows strided across them.
  const int64_t clusters = std::min<int64_t>(max_clusters, p.n_rows);
  cfg.gridDim = dim3(static_cast<unsigned>(clusters * plan.cluster));
  const ResidentShape shape{plan.slice, plan.stages, static_cast<int>(plan.stage_bytes)};
  LOGITLESS_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, p, shape));
  return true;
}

}  // namespace

bool row_resident_available(int device) {
  const DeviceInfo& info = device_info(device);
  if (info.sm_major < 9) return false;
  cudaFuncAttributes attr{};
  if (cudaFuncGetAttributes(&attr, row_resident_kernel<__nv_bfloat16>) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  // The kernel body exists only in the sm_90+ binaries of this build.
  return attr.binaryVersion >= 90;
}

bool launch_row_resident(DType dtype, const KernelParams& p, const Plan& plan, cudaStream_t stream) {
  switch (dtype) {
    case DType::kFloat32: return launch_typed<float>(p, plan, stream);
    case DType::kFloat16: return launch_typed<__half>(p, plan, stream);
    case DType::kBFloat16: return launch_typed<__nv_bfloat16>(p, plan, stream);
    default: throw_invalid("logits: unsupported dtype");
  }
}

}  // namespace logitless::ce
