// The row-resident policy-loss kernel (Hopper): the fused pass (statistics, outputs and gradient) reads each row
// from HBM exactly once.
//
// A bf16 row of V = 150000 logits is 300 KB, more than an SM's 227 KB of shared memory, and the gradient needs the
// row's lse before its first element can be written. A thread-block cluster of C CTAs therefore shares a row: CTA r
// bulk-copies its 1/C slice into a shared-memory stage (common/cuda/resident.cuh), folds it into the online-softmax
// state of logits / temperature (with the entropy accumulator when asked) over the shared chunk loops, and the
// states are exchanged through distributed shared memory (device.cuh). Every CTA then has the row's lse,
// logp and entropy, computes the token's c = d(loss)/d(logp) as the streaming kernel does (device.cuh), and
// writes grad_j = c ([j == id] - p_j) / temperature of its slice straight from shared memory, in place or not.
// HBM traffic per unmasked row of B bytes: B read + B written, against 2B read + B written by the streaming kernel
// and B from HBM plus B from L2 by the cluster kernel (kernels_streaming.cu).
//
// The plan (plan.cpp) gives each CTA one stage for long rows and two CTAs per SM; short rows, asked for explicitly,
// get up to kResidentMaxStages stages and keep that many rows in flight per CTA. A token that is masked (or has a
// bad id) is classified before its copy is issued: its row is never read, its gradient slice is written with 0
// (NaN for a bad id).

#include <algorithm>

#include "common/cuda/check.cuh"
#include "common/cuda/launch_cache.h"
#include "common/cuda/resident.cuh"
#include "policy_loss/cuda/device.cuh"
#include "policy_loss/cuda/kernels.h"

namespace logitless::pl {
namespace {

namespace cg = cooperative_groups;
using namespace rows_dev;

struct ResidentShape {
  int stages;
  int stage_bytes;
};

template <typename T, bool kEntropy>
__global__ void __launch_bounds__(kResidentMaxThreads, 2)
    resident_rows_kernel(const __grid_constant__ KernelParams p, const ResidentShape shape) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using Elem = PolicyElem<T, kEntropy>;
  constexpr int kVec = Vec<T>::kN;
  constexpr int64_t kEs = sizeof(T);
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ __align__(8) uint64_t bars[kResidentMaxStages];
  __shared__ ClusterExchange<kMaxCluster> xchg;  // every CTA's state of the row, double-buffered by row
  __shared__ float4 red[32];

  cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  const int csize = static_cast<int>(cluster.num_blocks());
  const int64_t group = blockIdx.x / csize, groups = gridDim.x / csize;
  const int tid = threadIdx.x;
  const int64_t slice_begin = rank * p.slice;
  const int64_t len = max(static_cast<int64_t>(0), min(p.slice, p.vocab - slice_begin));
  const int S = shape.stages;
  const RowChunkLoops<T, Elem> loops{Elem{p.scale_l2}};
  const float gscale = p.grad_scale ? p.grad_scale[0] : 1.f;

  if (tid == 0) {
    for (int s = 0; s < S; ++s) cuda::ptx::mbarrier_init(&bars[s], 1);
    xchg.init();  // fences every initialization at cluster scope
  }
  // Also guarantees every CTA of the cluster runs before anyone writes into a peer's shared memory.
  cluster.sync();

  auto row_of = [&](int64_t k) { return group + k * groups; };
  auto slice_src = [&](int64_t row) { return p.logits + (p.logits_rows.offset(row) + slice_begin) * kEs; };
  auto stage_ptr = [&](int s) { return smem + static_cast<size_t>(s) * shape.stage_bytes; };
  // Thread 0: starts the copy of iteration k's slice into stage k % S, if its token (`tk`) is read at all.
  auto issue = [&](int64_t k, const Token& tk) {
    const int64_t row = row_of(k);
    if (row >= p.n_rows || kind_of(p, tk) != kValid) return;
    copy_whole_chunks(ChunkSpan<T>(slice_src(row), len), stage_ptr(static_cast<int>(k % S)),
                      &bars[static_cast<int>(k % S)]);
  };
  auto token_of = [&](int64_t k) { return row_of(k) < p.n_rows ? load_token(p, p.first_token + row_of(k)) : Token{}; };
  if (tid == 0)
    for (int k = 0; k < S; ++k) issue(k, token_of(k));

  uint32_t phase_bits = 0;  // expected parity of each stage's barrier
  typename ClusterExchange<kMaxCluster>::Cursor xcur;
  for (int64_t k = 0;; ++k) {
    const int64_t row = row_of(k);
    if (row >= p.n_rows) break;
    const int s = static_cast<int>(k % S);
    const int64_t r = p.first_token + row;
    // Thread 0 loads the token of the row its next copy is for now, so that the copy is issued without that
    // latency once this row's stage is free.
    Token ahead;
    if (tid == 0) ahead = token_of(k + S);
    const Token tk = load_token(p, r);
    const int kind = kind_of(p, tk);
    char* gdst = p.grad ? p.grad + (p.grad_rows.offset(row) + slice_begin) * kEs : nullptr;
    if (kind != kValid) {
      if (rank == 0 && tid == 0) write_skipped(p, r, kind);
      if (gdst) {
        const ChunkSpan<T> gspan(gdst, len);
        float v[kVec];
#pragma unroll
        for (int i = 0; i < kVec; ++i) v[i] = kind == kBad ? NAN : 0.f;
        for (int64_t q = tid; q < gspan.nchunks; q += blockDim.x) store_chunk(gspan, q, gdst, true, v);
      }
    } else {
      const TokenInputs in = load_inputs<false>(p, r);  // issued before the wait: the copy hides their latency
      const char* src = slice_src(row);
      const ChunkSpan<T> span(src, len);
      // Slices up to 2^35 bytes: chunk indices fit in int. Whole chunks [q_lo, q_hi) sit in the stage; a partial
      // first / last chunk is read from global memory by thread 0 / 1.
      const int q_lo = span.mis ? 1 : 0, q_hi = static_cast<int>(span.end / 16);
      const int64_t j0 = slice_begin - span.mis / kEs;
      const int part = partial_chunk_of_thread(span);
      const int64_t t_local = tk.id - slice_begin;  // the chosen class within this CTA's slice, if it is there
      const bool owns_t = t_local >= 0 && t_local < len;
      const int64_t t_byte = span.mis + t_local * kEs;  // from the span's first chunk
      const unsigned char* stage = stage_ptr(s);
      wait_stage(&bars[s], (phase_bits >> s) & 1u);
      phase_bits ^= 1u << s;

      typename Elem::Acc acc;
      loops.stats(reinterpret_cast<const char*>(stage), q_lo, q_hi, j0, acc);
      if (part >= 0) {
        float v[kVec];
        const uint32_t mask = load_chunk(span, part, nullptr, v);
#pragma unroll
        for (int i = 0; i < kVec; ++i) v[i] = (mask >> i) & 1u ? v[i] : -INFINITY;
        loops.elem.template add<kVec>(acc, v);
      }
      // The chosen logit, from the stage when its chunk is whole (only this CTA ever writes its slice, after this).
      float xt = 0.f;
      if (tid == 0 && owns_t) {
        const int q = static_cast<int>(t_byte >> 4);
        xt = q >= q_lo && q < q_hi ? Vec<T>::load1(reinterpret_cast<const char*>(stage) + t_byte)
                                   : Vec<T>::load1(src + t_local * kEs);
      }
      block_online_scaled<kEntropy>(acc.m, acc.s, acc.u, xt, p.scale_l2, red);
      if (csize > 1) cluster_merge<kEntropy>(xchg, xcur, rank, csize, p.scale_l2, acc.m, acc.s, acc.u, xt);
      const float lse = acc.m == -INFINITY ? NAN : fmaf(acc.m, p.inv_temp, logf(acc.s));
      const float logp = fmaf(xt, p.inv_temp, -lse);
      const float entropy = kEntropy ? online_entropy(acc.s, acc.u) : 0.f;
      const float c = forward_epilogue(p, r, in, tk.w, lse, logp, entropy, rank == 0 && tid == 0, gscale);
      if (gdst) {
        // grad_j = c ([j == id] - p_j) / T = a p_j - [j == id] b with a = b = -c / T.
        const Coeffs g{-c * p.inv_temp, -c * p.inv_temp};
        const float lse_l2 = lse * kLog2e;
        int q_t = -1, slot_t = 0;
        if (owns_t) {
          q_t = static_cast<int>(t_byte >> 4);
          slot_t = static_cast<int>((t_byte & 15) / kEs);
        }
        const char* st = reinterpret_cast<const char*>(stage);
        if ((reinterpret_cast<uintptr_t>(gdst) & 15u) == static_cast<uintptr_t>(span.mis)) {
          loops.template grad<true>(st, q_lo, q_hi, j0, g, lse_l2, q_t, slot_t, tk.id, span, gdst);
        } else {
          loops.template grad<false>(st, q_lo, q_hi, j0, g, lse_l2, q_t, slot_t, tk.id, span, gdst);
        }
        if (part >= 0) {
          float v[kVec];
          const uint32_t mask = load_chunk(span, part, nullptr, v);
#pragma unroll
          for (int i = 0; i < kVec; ++i) {
            const float d =
                g.a * fast_exp2(fmaf(v[i], p.scale_l2, -lse_l2)) - (span.elem(part, i) == t_local ? g.b : 0.f);
            v[i] = (mask >> i) & 1u ? d : 0.f;
          }
          store_chunk(span, part, gdst, false, v);
        }
      }
    }
    __syncthreads();  // this row's stage is consumed: it may be refilled
    if (tid == 0) issue(k + S, ahead);
  }
  // No CTA may exit while a peer could still write its state into this CTA's shared memory.
  cluster.sync();
#endif
}

// ---- instantiations: the only place that lists them -----------------------------------------------------------
// 3 dtypes x {statistics, statistics with entropy}; the fused pass is the only one that runs here.
using KernelFn = void (*)(KernelParams, ResidentShape);

template <typename T>
KernelFn resident_fn(bool entropy) {
  return entropy ? resident_rows_kernel<T, true> : resident_rows_kernel<T, false>;
}

KernelFn resident_fn(DType dtype, bool entropy) {
  switch (dtype) {
    case DType::kFloat32:
      return resident_fn<float>(entropy);
    case DType::kFloat16:
      return resident_fn<__half>(entropy);
    case DType::kBFloat16:
      return resident_fn<__nv_bfloat16>(entropy);
    default:
      throw_invalid("logits: unsupported dtype");
  }
}

}  // namespace

bool rows_resident_available(int device) {
  const DeviceInfo& info = device_info(device);
  if (info.sm_major < 9) return false;
  cudaFuncAttributes attr{};
  if (cudaFuncGetAttributes(&attr, resident_rows_kernel<__nv_bfloat16, false>) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return attr.binaryVersion >= 90;  // the kernel body exists only in the sm_90+ binaries of this build
}

bool launch_rows_resident(DType dtype, RowsVariant v, const KernelParams& p, const RowsPlan& plan,
                          cudaStream_t stream) {
  if (v.with_lse)
    throw_invalid("policy_loss: the row-resident kernel runs the fused pass only, not the backward from a saved lse");
  if (v.top1) throw_invalid("is_top1: computed by the streaming kernel only (a pass that reads each row once)");
  if (plan.threads < 32 || plan.threads > kResidentMaxThreads || plan.threads % 32 != 0)
    throw_invalid(str_cat("policy_loss: row-resident plan needs a whole number of warps up to ", kResidentMaxThreads,
                          " threads, got ", plan.threads));
  if (plan.stages < 1 || plan.stages > kResidentMaxStages || plan.cluster < 1 || plan.cluster > kMaxCluster ||
      plan.stage_bytes <= 0 || plan.stage_bytes % 16 != 0 || plan.smem_bytes < plan.stage_bytes * plan.stages)
    throw_invalid(str_cat("policy_loss: row-resident plan needs 1..", kResidentMaxStages,
                          " stages of whole 16-byte "
                          "chunks and 1..",
                          kMaxCluster, " CTAs per cluster, got ", plan.stages, " stages of ", plan.stage_bytes,
                          " bytes and ", plan.cluster, " CTAs"));
  const int64_t es = static_cast<int64_t>(dtype_size(dtype));
  if (p.slice != plan.slice || plan.slice * es + 16 > plan.stage_bytes || plan.slice * plan.cluster < p.vocab)
    throw_invalid(str_cat("policy_loss: row-resident slices of ", plan.slice, " elements x ", plan.cluster,
                          " CTAs must cover V=", p.vocab, " and fit stages of ", plan.stage_bytes, " bytes"));
  const KernelFn kernel = resident_fn(dtype, v.entropy);
  debug::last_rows_plan.set(plan);
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = plan.cluster;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  cfg.blockDim = dim3(plan.threads);
  cfg.dynamicSmemBytes = static_cast<size_t>(plan.smem_bytes);
  cfg.stream = stream;
  cfg.gridDim = dim3(plan.cluster);
  const void* fn = reinterpret_cast<const void*>(kernel);
  if (launch_cache::reserve_dynamic_smem(fn, static_cast<size_t>(plan.smem_bytes)) != cudaSuccess)
    return false;  // more shared memory than this device allows: no cluster fits
  if (plan.cluster > 8 && launch_cache::allow_non_portable_clusters(fn) != cudaSuccess)
    return false;  // no cluster above 8 CTAs here
  const int max_clusters = launch_cache::max_active_clusters(fn, cfg);
  if (max_clusters <= 0) return false;
  // Persistent clusters, one wave, rows strided across them.
  const int64_t clusters = std::max<int64_t>(1, std::min<int64_t>(max_clusters, p.n_rows));
  cfg.gridDim = dim3(static_cast<unsigned>(clusters * plan.cluster));
  const ResidentShape shape{plan.stages, static_cast<int>(plan.stage_bytes)};
  LOGITLESS_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, p, shape));
  return true;
}

}  // namespace logitless::pl
