// The policy-loss row kernel: the cross-entropy streaming kernel's design with a per-token epilogue.
//
// Each row of logits is one token. A row is classified from its weight and id before anything else (masked
// tokens and bad ids are never read: their gradient slice is written with 0 or NaN). Then:
//   1. statistics pass: the shared straight-line loops (common/cuda/chunk_loops.cuh) fold the row into the
//      online-softmax state of logits / temperature (and the entropy accumulator when asked), while one thread
//      reads the chosen logit; a block reduction (and, in a cluster, an exchange through distributed shared
//      memory) gives every thread lse, logp and the entropy;
//   2. epilogue: the token's outputs and c = d(loss)/d(logp) (policy_loss/math.h), from inputs loaded one row
//      ahead so that their latency hides behind the previous row;
//   3. gradient pass: grad_j = c * ([j == id] - p_j) / temperature over the same loops, in place or not.
// The backward variant (kWithLse) starts at 2 from a saved lse (selective log-softmax's backward, and the
// sequence-level loss, whose c needs the whole sequence's log-ratio). The kTop1 variant also folds the row's first
// maximum into pass 1 (common/cuda/first_max.cuh) and writes whether the token's id is it.
//
// HBM traffic per unmasked row of B bytes, against the 2B (one read, one write) floor:
//   * streaming (one CTA per row, 256 threads, up to 8 CTAs per SM): the gradient pass re-reads the row. With 8
//     rows in flight per SM (2.4 MB per SM at B = 300 KB, 317 MB on an H100, six times its 50 MB L2) that read
//     misses L2: 2B read + B written, which is where the cross-entropy kernel of the same design stopped short
//     (bench/RESULTS.md).
//   * cluster (Hopper): C CTAs share a row, each streaming a slice of B / C bytes through both passes and
//     exchanging only the 16-byte state between them. The plan picks C so that the slices in flight (resident
//     CTAs x B / C) stay within an L2 budget (plan.h), so the second read comes from L2: B read + B written from
//     HBM, as the row-resident cross-entropy kernel achieves with shared memory. (The cross-entropy kernel with two
//     reads through L2 stayed well below its row-resident version; bench/RESULTS.md.)
//   * row-resident (Hopper, kernels_row_resident.cu): the slices sit in shared memory instead of L2; the plan picks it
//   for
//     the fused pass wherever the row fits a cluster's shared memory, and this kernel serves everything else.
// A masked row costs only its gradient write (B bytes, 0 when no gradient is asked for); the forward without a
// gradient and the backward from a saved lse read each row once.
#include <algorithm>

#include "common/cuda/check.cuh"
#include "common/cuda/launch_cache.h"
#include "policy_loss/cuda/device.cuh"
#include "policy_loss/cuda/kernels.h"

namespace logitless::pl {
namespace {

namespace cg = cooperative_groups;
using namespace rows_dev;

// The statistics pass's view of the partial first / last chunk of a row (its other slots masked out) in the first
// maximum: its classes may lie below those of the whole chunks, so it goes through the general merge.
template <int kVec>
__device__ __forceinline__ void first_max_partial(FirstMax& top, const float* v, uint32_t mask, int64_t class0) {
#pragma unroll
  for (int i = 0; i < kVec; ++i)
    if ((mask >> i) & 1u) top.merge(v[i], class0 + i);
}

template <typename T, bool kWithLse, bool kEntropy, bool kTop1>
__global__ void __launch_bounds__(kMaxThreads, 2) rows_kernel(const __grid_constant__ KernelParams p) {
  using Elem = PolicyElem<T, kEntropy, kTop1>;
  constexpr int kVec = Vec<T>::kN;
  constexpr int64_t kEs = sizeof(T);
  __shared__ float4 red[32];
  const int tid = threadIdx.x;
  int rank = 0, csize = 1;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  __shared__ ClusterExchange<kMaxCluster> xchg;  // every CTA's state of the row, double-buffered by row
  cg::cluster_group cluster = cg::this_cluster();
  rank = static_cast<int>(cluster.block_rank());
  csize = static_cast<int>(cluster.num_blocks());
  if (csize > 1 && tid == 0) xchg.init();
  // Every CTA of the cluster runs (and its exchange is initialized) before anyone writes into a peer's shared memory.
  if (csize > 1) cluster.sync();
  typename ClusterExchange<kMaxCluster>::Cursor xcur;
#endif
  const int64_t group = blockIdx.x / csize, groups = gridDim.x / csize;
  const int64_t slice_begin = rank * p.slice;
  const int64_t len = max(static_cast<int64_t>(0), min(p.slice, p.vocab - slice_begin));
  const RowChunkLoops<T, Elem> loops{Elem{p.scale_l2}};
  const float gscale = p.grad_scale ? p.grad_scale[0] : 1.f;

  Token cur;
  if (group < p.n_rows) cur = load_token(p, p.first_token + group);
  for (int64_t row = group; row < p.n_rows; row += groups) {
    const int64_t next = row + groups;
    const Token tk = cur;
    if (next < p.n_rows) cur = load_token(p, p.first_token + next);  // consumed by the next iteration
    const int kind = kind_of(p, tk);
    char* gdst = p.grad ? p.grad + (p.grad_rows.offset(row) + slice_begin) * kEs : nullptr;
    if (kind != kValid) {
      if (!kWithLse && rank == 0 && tid == 0) write_skipped(p, p.first_token + row, kind);
      if (gdst) {
        const ChunkSpan<T> gspan(gdst, len);
        float v[kVec];
#pragma unroll
        for (int i = 0; i < kVec; ++i) v[i] = kind == kBad ? NAN : 0.f;
        for (int64_t q = tid; q < gspan.nchunks; q += blockDim.x) store_chunk(gspan, q, gdst, true, v);
      }
      continue;
    }
    const char* src = p.logits + (p.logits_rows.offset(row) + slice_begin) * kEs;
    const ChunkSpan<T> span(src, len);
    // Slices up to 2^35 bytes: chunk indices fit in int.
    const int q_lo = span.mis ? 1 : 0, q_hi = static_cast<int>(span.end / 16);
    const int64_t j0 = slice_begin - span.mis / kEs;
    const int part = partial_chunk_of_thread(span);
    const int64_t t_local = tk.id - slice_begin;  // the chosen class within this CTA's slice, if it is there
    const bool owns_t = t_local >= 0 && t_local < len;
    float lse, c;
    if constexpr (kWithLse) {
      const TokenInputs in = load_inputs<true>(p, p.first_token + row);
      lse = in.lse;
      c = backward_coeff(p, in, tk.w, gscale);
    } else {
      // Issued before the statistics pass, consumed after it: the loop hides their latency.
      const TokenInputs in = load_inputs<false>(p, p.first_token + row);
      typename Elem::Acc acc;
      loops.stats(span.base, q_lo, q_hi, j0, acc);
      if (part >= 0) {
        float v[kVec];
        const uint32_t mask = load_chunk(span, part, nullptr, v);
        if constexpr (kTop1) first_max_partial<kVec>(acc.top, v, mask, slice_begin + span.elem(part, 0));
#pragma unroll
        for (int i = 0; i < kVec; ++i) v[i] = (mask >> i) & 1u ? v[i] : -INFINITY;
        loops.elem.template add<kVec>(acc, v);
      }
      // The chosen logit is read before the reduction's barriers, hence before any thread of this CTA (the only
      // one that writes this slice) can overwrite it in place. It travels as the plain sum.
      float xt = 0.f;
      if (tid == 0 && owns_t) xt = Vec<T>::load1(src + t_local * kEs);
      block_online_scaled<kEntropy>(acc.m, acc.s, acc.u, xt, p.scale_l2, red);
      if constexpr (kTop1) {  // one CTA per row (launch_rows refuses a cluster): the block has the whole row
        __shared__ FirstMax top_red[32];
        block_first_max(acc.top, top_red);
        if (rank == 0 && tid == 0) p.out_top1[p.first_token + row] = is_first_max(acc.m, acc.top, tk.id) ? 1 : 0;
      }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      if (csize > 1) cluster_merge<kEntropy>(xchg, xcur, rank, csize, p.scale_l2, acc.m, acc.s, acc.u, xt);
#endif
      lse = acc.m == -INFINITY ? NAN : fmaf(acc.m, p.inv_temp, logf(acc.s));
      const float logp = fmaf(xt, p.inv_temp, -lse);
      const float entropy = kEntropy ? online_entropy(acc.s, acc.u) : 0.f;
      c = forward_epilogue(p, p.first_token + row, in, tk.w, lse, logp, entropy, rank == 0 && tid == 0, gscale);
    }
    if (!gdst) continue;
    // grad_j = c ([j == id] - p_j) / T = a p_j - [j == id] b with a = b = -c / T.
    const Coeffs g{-c * p.inv_temp, -c * p.inv_temp};
    const float lse_l2 = lse * kLog2e;
    int q_t = -1, slot_t = 0;
    if (owns_t) {
      const int64_t b = span.mis + t_local * kEs;
      q_t = static_cast<int>(b >> 4);
      slot_t = static_cast<int>((b & 15) / kEs);
    }
    if ((reinterpret_cast<uintptr_t>(gdst) & 15u) == static_cast<uintptr_t>(span.mis)) {
      loops.template grad<true>(span.base, q_lo, q_hi, j0, g, lse_l2, q_t, slot_t, tk.id, span, gdst);
    } else {
      loops.template grad<false>(span.base, q_lo, q_hi, j0, g, lse_l2, q_t, slot_t, tk.id, span, gdst);
    }
    if (part >= 0) {
      float v[kVec];
      const uint32_t mask = load_chunk(span, part, nullptr, v);
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        const float d = g.a * fast_exp2(fmaf(v[i], p.scale_l2, -lse_l2)) - (span.elem(part, i) == t_local ? g.b : 0.f);
        v[i] = (mask >> i) & 1u ? d : 0.f;
      }
      store_chunk(span, part, gdst, false, v);
    }
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // No CTA may exit while a peer could still write its state into this CTA's shared memory.
  if (csize > 1) cluster.sync();
#endif
}

template <typename T>
__global__ void __launch_bounds__(256) zero_rows_kernel(char* base, int64_t stride, int64_t n, int64_t vocab) {
  constexpr int kVec = Vec<T>::kN;
  for (int64_t row = blockIdx.x; row < n; row += gridDim.x) {
    char* dst = base + row * stride * static_cast<int64_t>(sizeof(T));
    const ChunkSpan<T> span(dst, vocab);
    float v[kVec] = {};
    for (int64_t q = threadIdx.x; q < span.nchunks; q += blockDim.x) store_chunk(span, q, dst, true, v);
  }
}

// ---- instantiations: the only place that lists them -----------------------------------------------------------
// 3 dtypes x {statistics (+ fused gradient), statistics with entropy, backward from a saved lse}, and the first
// maximum with either statistics pass for float32 logits only (its one user is the fused linear head's forward,
// whose logits chunks are float32). The cluster exchange is a runtime branch of the same kernels (compiled for
// sm_90 only), not another instantiation.
using KernelFn = void (*)(KernelParams);

template <typename T>
KernelFn rows_fn(RowsVariant v) {
  if (v.with_lse) return rows_kernel<T, true, false, false>;
  return v.entropy ? rows_kernel<T, false, true, false> : rows_kernel<T, false, false, false>;
}

KernelFn rows_fn(DType dtype, RowsVariant v) {
  if (v.top1) {
    if (dtype != DType::kFloat32 || v.with_lse)
      throw_invalid("is_top1: computed in the statistics pass over float32 logits only");
    return v.entropy ? rows_kernel<float, false, true, true> : rows_kernel<float, false, false, true>;
  }
  switch (dtype) {
    case DType::kFloat32:
      return rows_fn<float>(v);
    case DType::kFloat16:
      return rows_fn<__half>(v);
    case DType::kBFloat16:
      return rows_fn<__nv_bfloat16>(v);
    default:
      throw_invalid("logits: unsupported dtype");
  }
}

}  // namespace

bool cluster_launch_available(int device) {
  const DeviceInfo& info = device_info(device);
  if (info.sm_major < 9) return false;
  // The cluster exchange exists only in the sm_90+ binaries of this build.
  return launch_cache::binary_version(reinterpret_cast<const void*>(rows_kernel<__nv_bfloat16, false, false, false>)) >=
         90;
}

int rows_ctas_per_sm(DType dtype, RowsVariant v, int threads) {
  return launch_cache::max_active_blocks(reinterpret_cast<const void*>(rows_fn(dtype, v)), threads, 0);
}

// Clusters of `cfg`'s size that fit the device at once (0: none, or the size is not supported here).
static int max_active_clusters(KernelFn kernel, const cudaLaunchConfig_t& cfg, int cluster) {
  const void* fn = reinterpret_cast<const void*>(kernel);
  if (cluster > 8) launch_cache::allow_non_portable_clusters(fn);  // refused: the query below finds no cluster
  return launch_cache::max_active_clusters(fn, cfg);
}

bool launch_rows(DType dtype, RowsVariant v, const KernelParams& p, const RowsPlan& plan, int sm_count,
                 cudaStream_t stream) {
  if (plan.threads < 32 || plan.threads > kMaxThreads || plan.cluster < 1 || plan.cluster > kMaxCluster)
    throw_invalid(str_cat("policy_loss: row plan needs 32..", kMaxThreads, " threads and 1..", kMaxCluster,
                          " CTAs per cluster, got ", plan.threads, " and ", plan.cluster));
  if (v.top1 && plan.algo == PolicyLossAlgo::kCluster)
    throw_invalid("is_top1: computed by one CTA per row, not by a cluster plan (its exchange carries no argmax)");
  const KernelFn kernel = rows_fn(dtype, v);
  debug::last_rows_plan.set(plan);
  if (plan.algo != PolicyLossAlgo::kCluster) {
    const int per_sm = std::max(1, rows_ctas_per_sm(dtype, v, plan.threads));
    // Persistent CTAs, rows strided across them: one wave, so that each CTA's prefetch of its next token pays.
    const int64_t grid = std::max<int64_t>(1, std::min<int64_t>(p.n_rows, static_cast<int64_t>(sm_count) * per_sm));
    kernel<<<static_cast<unsigned>(grid), plan.threads, 0, stream>>>(p);
    LOGITLESS_CUDA_CHECK_LAUNCH("policy-loss row kernel");
    return true;
  }
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = plan.cluster;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  cfg.blockDim = dim3(plan.threads);
  cfg.stream = stream;
  cfg.gridDim = dim3(plan.cluster);
  const int max_clusters = max_active_clusters(kernel, cfg, plan.cluster);
  if (max_clusters <= 0) return false;
  const int64_t clusters = std::max<int64_t>(1, std::min<int64_t>(max_clusters, p.n_rows));
  cfg.gridDim = dim3(static_cast<unsigned>(clusters * plan.cluster));
  LOGITLESS_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, p));
  return true;
}

void launch_zero_rows(DType dtype, char* base, int64_t stride, int64_t n, int64_t vocab, cudaStream_t stream) {
  if (n <= 0 || vocab <= 0) return;
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(n, 1024));
  switch (dtype) {
    case DType::kFloat32:
      zero_rows_kernel<float><<<grid, 256, 0, stream>>>(base, stride, n, vocab);
      break;
    case DType::kFloat16:
      zero_rows_kernel<__half><<<grid, 256, 0, stream>>>(base, stride, n, vocab);
      break;
    case DType::kBFloat16:
      zero_rows_kernel<__nv_bfloat16><<<grid, 256, 0, stream>>>(base, stride, n, vocab);
      break;
    default:
      throw_invalid("grad_logits: unsupported dtype");
  }
  LOGITLESS_CUDA_CHECK_LAUNCH("zero rows");
}

}  // namespace logitless::pl
