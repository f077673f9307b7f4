// The Hopper cross-entropy kernel: each row is read from HBM exactly once.
//
// A bf16 row of 128256 logits is 256 KB, more than one SM's shared memory (227 KB), and the gradient needs
// the row's log-sum-exp before its first element can be written. A thread-block cluster of C CTAs therefore
// shares a row: CTA r bulk-copies its 1/C slice into shared memory (TMA, completing on an mbarrier), reduces
// it to a partial (max, sum of exp, sum of w*x), and the partials are exchanged through distributed shared
// memory (common/cuda/cluster_exchange.cuh: st.async and an mbarrier, no cluster barrier). Every CTA then finishes
// the row's statistics itself and writes the gradient of its slice straight from shared memory. HBM traffic is
// one read of the logits and one write of the gradient, in place or not.
//
// Each CTA keeps `stages` slices in flight: while row k is reduced, rows k+1..k+stages-1 are landing. Rows
// whose target is ignore_index (or out of range) are never loaded.
#include <cooperative_groups.h>
#include <cuda/ptx>

#include "common/cuda/check.cuh"
#include "common/cuda/cluster_exchange.cuh"
#include "common/cuda/launch_cache.h"
#include "cross_entropy/cuda/device.cuh"
#include "cross_entropy/cuda/kernels.h"

namespace logitless::ce {
namespace {

namespace cg = cooperative_groups;

struct ResidentShape {
  int64_t slice;  // elements per CTA
  int stages;
  int stage_bytes;
  int pieces;     // bulk copies per slice
  int pipelined;  // overlap row k's exchange with row k+1's statistics (holds one more stage)
};

// One row's state between its statistics pass and its gradient pass.
struct RowState {
  int64_t row = 0, t = 0;
  RowKind kind = RowKind::kIgnored;
  int stage = 0;
  float w_t = 1.f, gscale = 1.f, zscale = 0.f;  // the target's class weight and the gradient's upstream factors
                                                // (the cross-entropy term's and the z-loss term's)
  float4 partial;  // this CTA's (max, sum of exp, sum of w x, the target's logit on rank 0) over its slice
};

// Pipelined mode publishes row k's partials and waits for its peers' only after computing the statistics of
// row k+1 (which it publishes once row k's exchange completed: one exchange is outstanding at a time). It hides
// the exchange but holds a second stage while it does, which leaves one fewer row in flight; on H100 it lost at
// 3 stages (bench/RESULTS.md), so it is a plan option.
template <typename T, bool kGeneral>
__global__ void __launch_bounds__(kMaxThreads, kMinCtasPerSm)
    row_resident_kernel(const __grid_constant__ KernelParams p, const ResidentShape shape) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int kVec = Vec<T>::kN;
  constexpr int64_t kEs = sizeof(T);
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ __align__(8) uint64_t bars[kMaxStages];
  __shared__ ClusterExchange<kMaxCluster> xchg;  // partials of every CTA of the cluster, double-buffered by row
  __shared__ float4 red[32];

  if (aborted(p)) return;  // every CTA of every cluster, before any exchange
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  const int csize = static_cast<int>(cluster.num_blocks());
  const int64_t cluster_id = blockIdx.x / csize;
  const int64_t num_clusters = gridDim.x / csize;
  const int tid = threadIdx.x;
  const int64_t slice_begin = rank * shape.slice;
  const int64_t len = max(static_cast<int64_t>(0), min(shape.slice, p.vocab - slice_begin));
  const int S = shape.stages;
  const ChunkLoops<T, kGeneral> loops{p};

  if (tid == 0) {
    for (int s = 0; s < S; ++s) cuda::ptx::mbarrier_init(&bars[s], 1);
    xchg.init();  // fences every initialization at cluster scope
  }
  // Also guarantees every CTA of the cluster runs before anyone writes into a peer's shared memory.
  cluster.sync();

  auto row_of = [&](int64_t k) { return cluster_id + k * num_clusters; };
  auto slice_src = [&](int64_t row) { return p.logits + (p.logits_rows.offset(row) + slice_begin) * kEs; };
  auto stage_ptr = [&](int s) {
    return reinterpret_cast<const char*>(smem) + static_cast<size_t>(s) * shape.stage_bytes;
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
    const int64_t nq = q1 - q0;  // as `pieces` bulk copies on one barrier
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
  typename ClusterExchange<kMaxCluster>::Cursor xcur;
  const float W = p.scalars->weight_sum, inv_denom = p.scalars->inv_denom, inv_count = p.scalars->inv_count;
  // Targets are loaded one row ahead: a row's classification decides whether to wait for its slice.
  auto target_of = [&](int64_t k) -> int64_t {
    const int64_t row = row_of(k);
    return row < p.n_rows ? load_target(p, row) : 0;
  };
  int64_t t_ahead = target_of(0);

  // Statistics of iteration k's row: waits for its slice and reduces it. Returns false past the last row.
  // Called for k = 0, 1, 2, ... in turn.
  auto begin_row = [&](int64_t k, RowState& r) -> bool {
    r.row = row_of(k);
    if (r.row >= p.n_rows) return false;
    r.stage = static_cast<int>(k % S);
    r.t = t_ahead;
    t_ahead = target_of(k + 1);
    r.kind = classify(p, r.t);
    if (r.kind != RowKind::kValid) return true;
    // Loaded before the wait, used after the exchange: their latency hides behind the slice's.
    r.w_t = target_weight(p, r.t);
    r.gscale = row_grad_scale(p, r.row, inv_denom);
    if (p.z != 0.f) r.zscale = row_grad_scale(p, r.row, inv_count);
    const ChunkSpan<T> span(slice_src(r.row), len);
    // Read before this row's partials go out, and sent with them (the data dependency orders the load before the
    // stores): peers overwrite the row (in place) only once they hold every partial.
    float x_t = 0.f;
    if (rank == 0 && tid == 0) x_t = capped(p, Vec<T>::load1(p.logits + (p.logits_rows.offset(r.row) + r.t) * kEs));
    while (!cuda::ptx::mbarrier_try_wait_parity(&bars[r.stage], (phase_bits >> r.stage) & 1u)) {
    }
    phase_bits ^= 1u << r.stage;
    // Whole chunks [q_lo, q_hi) sit in shared memory; a partial first / last chunk is read from global
    // memory by thread 0 / 1.
    const int q_lo = span.mis ? 1 : 0, q_hi = static_cast<int>(span.end / 16);
    const int64_t j0 = slice_begin - span.mis / kEs;
    float m = -INFINITY, se = 0.f, swx = 0.f;
    loops.stats(stage_ptr(r.stage), q_lo, q_hi, j0, m, se, swx);
    const int part = partial_chunk_of_thread(span);
    if (part >= 0) {
      float v[kVec];
      const uint32_t mask = load_chunk(span, part, nullptr, v);
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        const bool ok = (mask >> i) & 1u;
        v[i] = ok ? capped(p, v[i]) : -INFINITY;
        if (p.eps != 0.f && ok) swx += class_weight(p, slice_begin + span.elem(part, i)) * v[i];
      }
      online_add<kVec>(m, se, v);
    }
    block_online(m, se, swx, red);
    r.partial = make_float4(m, se, swx, x_t);
    return true;
  };

  // Sends row r's partial to every CTA of the cluster. It follows the block reduction's __syncthreads(), which
  // follows every thread's read of the previous exchange, as ClusterExchange requires.
  auto publish = [&](const RowState& r) {
    if (r.kind == RowKind::kValid) xchg.publish(xcur, rank, csize, r.partial);
  };

  // Waits for the peers' partials of row r, writes its outputs and the gradient of this CTA's slice.
  auto finish_row = [&](const RowState& r) {
    char* gdst = p.grad ? p.grad + (p.grad_rows.offset(r.row) + slice_begin) * kEs : nullptr;
    if (r.kind != RowKind::kValid) {
      // Ignored rows: loss 0, gradient 0. Out-of-range targets (checks off): NaN. Nothing is read.
      if (rank == 0 && tid == 0) write_row_outputs(p, r.row, r.kind, RowStats{0.f, 0.f, 0.f}, r.t);
      if (gdst) {
        const ChunkSpan<T> gspan(gdst, len);
        float v[kVec];
#pragma unroll
        for (int i = 0; i < kVec; ++i) v[i] = r.kind == RowKind::kBad ? NAN : 0.f;
        for (int64_t q = tid; q < gspan.nchunks; q += blockDim.x) store_chunk(gspan, q, gdst, true, v);
      }
      return;
    }
    const float4* parts = xchg.wait(xcur);
    float M = -INFINITY, S_sum = 0.f, SWX = 0.f, X_T = 0.f;
    for (int c = 0; c < csize; ++c) {
      const float4 pr = parts[c];
      online_merge(M, S_sum, pr.x, pr.y);
      SWX += pr.z;
      X_T += pr.w;  // rank 0's only
    }
    const float lse = M == -INFINITY ? NAN : M + logf(S_sum);
    if (rank == 0 && tid == 0) write_row_outputs(p, r.row, r.kind, RowStats{lse, X_T, SWX}, r.t);
    if (!gdst) return;
    const ChunkSpan<T> span(slice_src(r.row), len);
    const int q_lo = span.mis ? 1 : 0, q_hi = static_cast<int>(span.end / 16);
    const int64_t j0 = slice_begin - span.mis / kEs;
    const GradCoeffs g = row_grad_coeffs(lse, r.w_t, W, p.eps, p.inv_v, p.z, r.gscale, r.zscale);
    const float lse_l2 = lse * kLog2e;
    const int64_t t_local = r.t - slice_begin;
    int q_t = -1, slot_t = 0;
    if (t_local >= 0 && t_local < len) {
      const int64_t b = span.mis + t_local * kEs;
      q_t = static_cast<int>(b >> 4);
      slot_t = static_cast<int>((b & 15) / kEs);
    }
    if ((reinterpret_cast<uintptr_t>(gdst) & 15u) == static_cast<uintptr_t>(span.mis)) {
      loops.template grad<true>(stage_ptr(r.stage), q_lo, q_hi, j0, g, lse_l2, q_t, slot_t, r.t, span, gdst);
    } else {
      loops.template grad<false>(stage_ptr(r.stage), q_lo, q_hi, j0, g, lse_l2, q_t, slot_t, r.t, span, gdst);
    }
    const int part = partial_chunk_of_thread(span);
    if (part >= 0) {
      float v[kVec];
      const uint32_t mask = load_chunk(span, part, nullptr, v);
#pragma unroll
      for (int i = 0; i < kVec; ++i)
        v[i] = (mask >> i) & 1u ? grad_elem(p, g, lse_l2, capped(p, v[i]), slice_begin + span.elem(part, i), r.t) : 0.f;
      store_chunk(span, part, gdst, false, v);
    }
  };

  RowState cur, nxt;
  if (shape.pipelined) {
    bool have = begin_row(0, cur);
    if (have) publish(cur);
    for (int64_t k = 0; have; ++k) {
      const bool have_next = begin_row(k + 1, nxt);  // overlaps the peers' arrival at row k's barrier
      finish_row(cur);
      __syncthreads();  // cur's stage is consumed: it may be refilled
      if (tid == 0) issue(k + S);
      if (have_next) publish(nxt);
      cur = nxt;
      have = have_next;
    }
  } else {
    for (int64_t k = 0; begin_row(k, cur); ++k) {
      publish(cur);
      finish_row(cur);
      __syncthreads();  // cur's stage is consumed: it may be refilled
      if (tid == 0) issue(k + S);
    }
  }
  // No CTA may exit while a peer could still write its partial into this CTA's shared memory.
  cluster.sync();
#endif
}

template <typename T>
int launch_typed(const KernelParams& p, const Plan& plan, int device, cudaStream_t stream) {
  // The pipelined loop reads row k+1's stage while row k's is still held: one stage would deadlock it. The
  // plain loop runs with one stage (no prefetch within the CTA; other CTAs on the SM can overlap it).
  const int min_stages = plan.pipelined ? 2 : 1;
  if (plan.threads < 32 || plan.threads > kMaxThreads || plan.threads % 32 != 0)
    throw_invalid(str_cat("cross_entropy: row-resident plan needs a whole number of warps up to ", kMaxThreads,
                          " threads, got ", plan.threads));
  if (plan.stages < min_stages || plan.stages > kMaxStages || plan.cluster < 1 || plan.cluster > kMaxCluster)
    throw_invalid(str_cat("cross_entropy: row-resident plan needs ", min_stages, "..", kMaxStages, " stages and 1..",
                          kMaxCluster, " CTAs per cluster, got ", plan.stages, " and ", plan.cluster));
  const bool general = p.softcap > 0.f || p.eps != 0.f;
  auto kernel = general ? row_resident_kernel<T, true> : row_resident_kernel<T, false>;
  const void* fn = reinterpret_cast<const void*>(kernel);
  if (const cudaError_t err = launch_cache::reserve_dynamic_smem(device, fn, plan.smem_bytes); err != cudaSuccess)
    throw_cuda(err, "cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize)", __FILE__, __LINE__);
  if (plan.cluster > 8)
    if (const cudaError_t err = launch_cache::allow_non_portable_clusters(device, fn); err != cudaSuccess)
      throw_cuda(err, "cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed)", __FILE__,
                 __LINE__);
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
  // 0 where the cluster size is not supported here: not an error, the caller falls back.
  const int max_clusters = launch_cache::max_active_clusters(device, fn, cfg);
  if (max_clusters <= 0) return 0;
  // Persistent clusters: one wave, rows strided across them.
  const int64_t clusters = std::min<int64_t>(plan.grid_clusters > 0 ? plan.grid_clusters : max_clusters, p.n_rows);
  debug::row_resident_max_clusters.set(max_clusters);
  cfg.gridDim = dim3(static_cast<unsigned>(clusters * plan.cluster));
  const ResidentShape shape{plan.slice, plan.stages, static_cast<int>(plan.stage_bytes), std::max(1, plan.copy_pieces),
                            plan.pipelined ? 1 : 0};
  LOGITLESS_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, p, shape));
  return static_cast<int>(clusters);
}

}  // namespace

bool row_resident_available(int device) {
  const DeviceInfo& info = device_info(device);
  if (info.sm_major < 9) return false;
  // The kernel body exists only in the sm_90+ binaries of this build (asked once per device: the launch cache).
  const void* kernel = reinterpret_cast<const void*>(row_resident_kernel<__nv_bfloat16, false>);
  return launch_cache::binary_version(device, kernel) >= 90;
}

int launch_row_resident(DType dtype, const KernelParams& p, const Plan& plan, int device, cudaStream_t stream) {
  switch (dtype) {
    case DType::kFloat32:
      return launch_typed<float>(p, plan, device, stream);
    case DType::kFloat16:
      return launch_typed<__half>(p, plan, device, stream);
    case DType::kBFloat16:
      return launch_typed<__nv_bfloat16>(p, plan, device, stream);
    default:
      throw_invalid("logits: unsupported dtype");
  }
}

}  // namespace logitless::ce
