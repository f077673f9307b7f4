// The Hopper logits GEMM with the cross-entropy in its epilogue (see hopper.h).
//
// One persistent CTA per SM, three warpgroups: the first issues the TMA loads of A (tokens, [128, 64] tiles) and B
// (classes, [256, 64] tiles) into a 4-stage ring of 128-byte-swizzled shared memory; the other two each own 64
// rows of the 128 x 256 output tile and run m64n256k16 WGMMAs on it (float32 accumulators, 128 per thread). A
// stage goes back to the producer as soon as both consumer warpgroups' WGMMAs on it have retired, so the loads
// of the next tile overlap the epilogue of this one.
//
// CTAs run in clusters of two on adjacent token tiles of one class tile: each loads its own A and half of B,
// multicast to both, so a CTA reads 32 KB per k step from L2 instead of 48. A stage is refilled only when the
// consumers of both CTAs have released it (its empty barrier counts four arrivals). Tile pairs go in groups of 8,
// class tiles inner, so a wave of clusters shares a few token and class tiles in L2.
//
// Epilogue, per thread: two rows (r and r + 8 of its warp's 16) and 64 columns (pairs at 8-column steps): the
// accumulator layout of WGMMA. Row statistics reduce over the 4 lanes that share a row.
#include "linear_cross_entropy/cuda/hopper.h"

#include <algorithm>
#include <mutex>

#include "common/cuda/check.cuh"
#include "cross_entropy/cuda/device.cuh"
#include "linear_cross_entropy/cuda/dtype_io.cuh"

#if defined(LOGITLESS_WITH_CUTLASS)
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/numeric_types.h>
#endif

namespace logitless::lce {

#if defined(LOGITLESS_WITH_CUTLASS)
namespace {

using namespace cute;

constexpr int kBM = 128, kBN = static_cast<int>(kFusedTileCols), kBK = 64, kStages = 4;
constexpr int kThreads = 384;     // a producer warpgroup, two consumer warpgroups
constexpr int kCluster = 2;       // CTAs per cluster: token tiles sharing one class tile
constexpr int kGroupTiles = 8;    // token-tile pairs per raster group
constexpr int kMaxDevices = 64;   // devices whose launch configuration is remembered (others ask every launch)

enum class Epi { kStats, kGrad, kExp };  // hopper.h: statistics, gradient, statistics and exponentials

template <typename T>
struct MmaOf;
template <>
struct MmaOf<cutlass::bfloat16_t> {
  using Op = SM90_64x256x16_F32BF16BF16_SS<GMMA::Major::K, GMMA::Major::K>;
};
template <>
struct MmaOf<cutlass::half_t> {
  using Op = SM90_64x256x16_F32F16F16_SS<GMMA::Major::K, GMMA::Major::K>;
};

template <typename T>
struct Config {
  using SmemA = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<T>{},
                                       make_shape(Int<kBM>{}, Int<kBK>{}, Int<kStages>{})));
  using SmemB = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<T>{},
                                       make_shape(Int<kBN>{}, Int<kBK>{}, Int<kStages>{})));
  using TiledMma = decltype(make_tiled_mma(typename MmaOf<T>::Op{}, Layout<Shape<_2, _1, _1>>{}));
  static constexpr uint32_t kStageBytes = (kBM + kBN) * kBK * sizeof(T);
};

template <typename T>
struct SharedStorage {
  alignas(1024) cute::array_aligned<T, kBM * kBK * kStages, 1024> a;
  alignas(1024) cute::array_aligned<T, kBN * kBK * kStages, 1024> b;
  alignas(8) uint64_t full[kStages];
  alignas(8) uint64_t empty[kStages];
};

template <typename T>
constexpr size_t kSmemBytes = sizeof(SharedStorage<T>) + 1024;  // + room to align the dynamic base to 1024

__device__ __forceinline__ void tile_coords(int tile, int num_m, int num_n, int& mt, int& nt) {
  const int per_group = kGroupTiles * num_n;
  const int g = tile / per_group, first = g * kGroupTiles;
  const int rows = min(kGroupTiles, num_m - first);
  const int r = tile - g * per_group;
  mt = first + r % rows;
  nt = r / rows;
}

__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xFFFFFFFFu, v, 1);
  return v + __shfl_xor_sync(0xFFFFFFFFu, v, 2);
}

template <typename T>
__device__ __forceinline__ void store_pair(T* dst, bool both, float a, float b) {
  if constexpr (std::is_same_v<T, cutlass::bfloat16_t>) {
    if (both) {
      *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(a, b);
    } else {
      *reinterpret_cast<__nv_bfloat16*>(dst) = __float2bfloat16_rn(a);
    }
  } else {
    if (both) {
      *reinterpret_cast<__half2*>(dst) = __floats2half2_rn(a, b);
    } else {
      *reinterpret_cast<__half*>(dst) = __float2half_rn(a);
    }
  }
}

// The accumulators plus the bias: the raw logits, as the generic path's GEMM writes them.
template <class Acc, class Crd>
__device__ __forceinline__ void add_bias(const FusedGemmParams& p, Acc& acc, const Crd& crd, int64_t n0,
                                         int64_t cols_left) {
  if (!p.bias) return;
  CUTE_UNROLL
  for (int e = 0; e < size(acc); ++e) {
    const int c = get<1>(crd(e));
    if (c < cols_left) acc(e) += load_as_float(p.bias, p.bias_dtype, (p.col0 + n0 + c) * p.bias_stride);
  }
}

// Per (row, tile): max, sum of exp, the target's logit, sum of w x (kGeneral: soft cap and label smoothing).
template <bool kGeneral, class Acc, class Crd>
__device__ __forceinline__ void epilogue_stats(const FusedGemmParams& p, Acc& acc, const Crd& crd, int64_t m0,
                                               int64_t n0, int nt) {
  const int64_t rows_left = p.m - m0, cols_left = p.n - n0;
  add_bias(p, acc, crd, n0, cols_left);
  int row[2];
  int64_t tcol[2];  // the target's column within this tile (outside [0, kBN) when elsewhere)
  float mx[2] = {-INFINITY, -INFINITY};
  CUTE_UNROLL
  for (int i = 0; i < 2; ++i) {
    row[i] = get<0>(crd(2 * i));
    tcol[i] = -1;
    if (row[i] < rows_left) {
      const int64_t t = p.target[m0 + row[i]];
      if (ce::classify(p.ce, t) == ce::RowKind::kValid) tcol[i] = ce::target_column(p.ce, t) - p.col0 - n0;
    }
  }
  CUTE_UNROLL
  for (int e = 0; e < size(acc); ++e) {
    const int i = (e >> 1) & 1, c = get<1>(crd(e));
    float x = acc(e);
    if constexpr (kGeneral) x = ce::capped(p.ce, x);
    x = c < cols_left ? x : -INFINITY;
    acc(e) = x;
    mx[i] = fmaxf(mx[i], x);
  }
  float s[2] = {0.f, 0.f}, xt[2] = {0.f, 0.f}, swx[2] = {0.f, 0.f};
  CUTE_UNROLL
  for (int i = 0; i < 2; ++i) mx[i] = quad_max(mx[i]);
  // A tile row of -inf only (masked classes) adds nothing, rather than exp(-inf - -inf).
  const float ml2[2] = {mx[0] == -INFINITY ? 0.f : mx[0] * ce::kLog2e, mx[1] == -INFINITY ? 0.f : mx[1] * ce::kLog2e};
  CUTE_UNROLL
  for (int e = 0; e < size(acc); ++e) {
    const int i = (e >> 1) & 1, c = get<1>(crd(e));
    const float x = acc(e);
    s[i] += ce::fast_exp2(fmaf(x, ce::kLog2e, -ml2[i]));
    if (c == tcol[i]) xt[i] = x;
    if constexpr (kGeneral) {
      if (p.ce.eps != 0.f && c < cols_left) swx[i] = fmaf(ce::class_weight(p.ce, p.col0 + n0 + c), x, swx[i]);
    }
  }
  const int lane = threadIdx.x & 31;
  CUTE_UNROLL
  for (int i = 0; i < 2; ++i) {
    float si = quad_sum(s[i]), xti = quad_sum(xt[i]), swxi = quad_sum(swx[i]);
    float mi = mx[i];
    // NaN anywhere in the tile's row (or +inf, whose exp(x - m) is NaN): the whole row is NaN.
    if (isnan(si)) mi = si = NAN;
    if ((lane & 3) == 0 && row[i] < rows_left)
      reinterpret_cast<float4*>(p.partials)[(m0 + row[i]) * ((p.n + kBN - 1) / kBN) + nt] =
          make_float4(mi, si, xti, swxi);
  }
}

// d(loss)/dZ of the tile from the rows' lse, into dlogits in T.
template <typename T, bool kGeneral, class Acc, class Crd>
__device__ __forceinline__ void epilogue_grad(const FusedGemmParams& p, Acc& acc, const Crd& crd, int64_t m0,
                                              int64_t n0) {
  const int64_t rows_left = p.m - m0, cols_left = p.n - n0;
  add_bias(p, acc, crd, n0, cols_left);
  const float W = p.scalars->weight_sum, inv_denom = p.scalars->inv_denom;
  int row[2];
  ce::RowKind kind[2];
  int64_t tcol[2];  // the target's column relative to this tile's first (the chunk's col0 + n0)
  ce::GradCoeffs g[2];
  float lse_l2[2];
  CUTE_UNROLL
  for (int i = 0; i < 2; ++i) {
    row[i] = get<0>(crd(2 * i));
    kind[i] = ce::RowKind::kIgnored;
    tcol[i] = -1;
    g[i] = ce::GradCoeffs{0.f, 0.f, 0.f};
    lse_l2[i] = 0.f;
    if (row[i] < rows_left) {
      const int64_t r = m0 + row[i], t = p.target[r];
      kind[i] = ce::classify(p.ce, t);
      if (kind[i] == ce::RowKind::kValid) {
        const float lse = p.lse[r];
        float scale = inv_denom;
        if (p.upstream) scale *= p.upstream[p.upstream_per_row ? r : 0];
        g[i] = ce::row_grad_coeffs(lse, ce::target_weight(p.ce, t), W, p.ce.eps, p.ce.inv_v, p.ce.z, scale);
        lse_l2[i] = lse * ce::kLog2e;
        tcol[i] = ce::target_column(p.ce, t) - p.col0 - n0;
      }
    }
  }
  CUTE_UNROLL
  for (int e = 0; e < size(acc); ++e) {
    const int i = (e >> 1) & 1, c = get<1>(crd(e));
    float d;
    if constexpr (kGeneral) {
      // grad_elem compares columns of the shard: shift both by the tile's first column.
      d = ce::grad_elem(p.ce, g[i], lse_l2[i], ce::capped(p.ce, acc(e)), p.col0 + n0 + c, p.col0 + n0 + tcol[i]);
    } else {
      d = g[i].a * ce::fast_exp2(fmaf(acc(e), ce::kLog2e, -lse_l2[i]));
      if (c == tcol[i]) d -= g[i].b;
    }
    if (kind[i] != ce::RowKind::kValid) d = kind[i] == ce::RowKind::kBad ? NAN : 0.f;
    acc(e) = d;
  }
  T* out = static_cast<T*>(p.dlogits);
  CUTE_UNROLL
  for (int e = 0; e < size(acc); e += 2) {
    const int r = get<0>(crd(e)), c = get<1>(crd(e));
    if (r >= rows_left || c >= cols_left) continue;
    store_pair(out + (m0 + r) * p.ld_dlogits + n0 + c, c + 1 < cols_left, acc(e), acc(e + 1));
  }
}

// The gradient in forward (plain options, params.h's ExpGradParams): the statistics of epilogue_stats and
// E = exp(z - shift) of every element in T (0 in ignored rows, NaN in rows with a bad target). One exponential per
// element serves both: a tile's sum of exp(z - max) is the sum of E times exp(shift - max), except where the tile
// maximum is more than 64 nats from shift, where the tile sums again relative to its maximum.
template <typename T, class Acc, class Crd>
__device__ __forceinline__ void epilogue_exp(const FusedGemmParams& p, Acc& acc, const Crd& crd, int64_t m0,
                                             int64_t n0, int nt) {
  const int64_t rows_left = p.m - m0, cols_left = p.n - n0;
  add_bias(p, acc, crd, n0, cols_left);
  int row[2];
  int64_t tcol[2];
  float fill[2], c_l2[2], mx[2] = {-INFINITY, -INFINITY}, xt[2] = {0.f, 0.f}, se[2] = {0.f, 0.f};
  bool valid[2];
  CUTE_UNROLL
  for (int i = 0; i < 2; ++i) {
    row[i] = get<0>(crd(2 * i));
    tcol[i] = -1;
    fill[i] = 0.f;
    c_l2[i] = 0.f;
    valid[i] = false;
    if (row[i] < rows_left) {
      const int64_t t = p.target[m0 + row[i]];
      const ce::RowKind kind = ce::classify(p.ce, t);
      valid[i] = kind == ce::RowKind::kValid;
      if (valid[i]) {
        tcol[i] = ce::target_column(p.ce, t) - p.col0 - n0;
        c_l2[i] = p.shift[m0 + row[i]] * ce::kLog2e;
      } else if (kind == ce::RowKind::kBad) {
        fill[i] = NAN;
      }
    }
  }
  CUTE_UNROLL
  for (int e = 0; e < size(acc); ++e) {
    const int i = (e >> 1) & 1, c = get<1>(crd(e));
    const float x = c < cols_left ? acc(e) : -INFINITY;
    acc(e) = x;
    mx[i] = fmaxf(mx[i], x);
    if (c == tcol[i]) xt[i] = x;
  }
  T* out = static_cast<T*>(p.dlogits);
  CUTE_UNROLL
  for (int e = 0; e < size(acc); e += 2) {
    const int i = (e >> 1) & 1, r = get<0>(crd(e)), c = get<1>(crd(e));
    const float e0 = ce::fast_exp2(fmaf(acc(e), ce::kLog2e, -c_l2[i]));
    const float e1 = ce::fast_exp2(fmaf(acc(e + 1), ce::kLog2e, -c_l2[i]));
    se[i] += e0 + e1;
    if (r >= rows_left || c >= cols_left) continue;
    store_pair(out + (m0 + r) * p.ld_dlogits + n0 + c, c + 1 < cols_left, valid[i] ? e0 : fill[i],
               valid[i] ? e1 : fill[i]);
  }
  const int lane = threadIdx.x & 31;
  CUTE_UNROLL
  for (int i = 0; i < 2; ++i) {
    const float mi = quad_max(mx[i]);
    const float ml2 = mi == -INFINITY ? 0.f : mi * ce::kLog2e;
    float si = quad_sum(se[i]) * ce::fast_exp2(c_l2[i] - ml2);
    // Far from shift either way (E of this tile overflows, or underflows while exp(shift - max) overflows): sum
    // again. NaN compares false; the sum is NaN already.
    const bool far = fabsf(ml2 - c_l2[i]) > 64.f * ce::kLog2e;
    if (__any_sync(0xFFFFFFFFu, far)) {
      float s = 0.f;
      CUTE_UNROLL
      for (int e = 0; e < size(acc); ++e)
        if (((e >> 1) & 1) == i) s += ce::fast_exp2(fmaf(acc(e), ce::kLog2e, -ml2));
      s = quad_sum(s);
      if (far) si = s;
    }
    if (mi == -INFINITY) si = 0.f;
    const float xti = quad_sum(xt[i]);
    float m_out = mi;
    if (isnan(si)) m_out = si = NAN;  // NaN or +inf in the tile's row, as epilogue_stats
    if ((lane & 3) == 0 && row[i] < rows_left)
      reinterpret_cast<float4*>(p.partials)[(m0 + row[i]) * ((p.n + kBN - 1) / kBN) + nt] =
          make_float4(m_out, si, xti, 0.f);
  }
}

template <typename T, Epi kEpi, bool kGeneral, class TmaA, class TmaB>
__global__ void __launch_bounds__(kThreads, 1)
    fused_kernel(const __grid_constant__ FusedGemmParams p, const __grid_constant__ TmaA tma_a,
                 const __grid_constant__ TmaB tma_b) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Cfg = Config<T>;
  using FullBarrier = cutlass::arch::ClusterTransactionBarrier;
  using EmptyBarrier = cutlass::arch::ClusterBarrier;
  extern __shared__ char smem_raw[];
  auto& smem = *reinterpret_cast<SharedStorage<T>*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  Tensor sA = make_tensor(make_smem_ptr(smem.a.data()), typename Cfg::SmemA{});  // (BM, BK, stage)
  Tensor sB = make_tensor(make_smem_ptr(smem.b.data()), typename Cfg::SmemB{});  // (BN, BK, stage)

  const int m = static_cast<int>(p.m), n = static_cast<int>(p.n), k = static_cast<int>(p.k);
  const int num_m = (m + kBM - 1) / kBM, num_n = (n + kBN - 1) / kBN;
  const int k_tiles = (k + kBK - 1) / kBK;
  const int wg = threadIdx.x / 128;

  const int rank = static_cast<int>(cute::block_rank_in_cluster());
  const int pairs = (num_m + kCluster - 1) / kCluster * num_n, clusters = gridDim.x / kCluster;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      FullBarrier::init(&smem.full[s], 1);
      EmptyBarrier::init(&smem.empty[s], 2 * kCluster);  // each consumer warpgroup of both CTAs
    }
    cutlass::arch::fence_barrier_init();
  }
  cute::cluster_sync();  // the peer's barriers are initialized before anything multicasts into them

  if (wg == 0) {
    cutlass::arch::warpgroup_reg_dealloc<40>();
    if (threadIdx.x == 0) {
      Tensor mA = tma_a.get_tma_tensor(make_shape(m, k));
      Tensor mB = tma_b.get_tma_tensor(make_shape(n, k));
      int stage = 0;
      uint32_t phase = 0;
      for (int pair = blockIdx.x / kCluster; pair < pairs; pair += clusters) {
        int mp, nt;
        tile_coords(pair, (num_m + kCluster - 1) / kCluster, num_n, mp, nt);
        const int mt = mp * kCluster + rank;  // past the last token tile when num_m is odd: zeros, nothing stored
        Tensor gA = local_tile(mA, make_shape(Int<kBM>{}, Int<kBK>{}), make_coord(mt, _));  // (BM, BK, k)
        Tensor gB = local_tile(mB, make_shape(Int<kBN>{}, Int<kBK>{}), make_coord(nt, _));  // (BN, BK, k)
        auto [tAgA, tAsA] = tma_partition(tma_a, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sA), group_modes<0, 2>(gA));
        auto [tBgB, tBsB] =
            tma_partition(tma_b, rank, Layout<Int<kCluster>>{}, group_modes<0, 2>(sB), group_modes<0, 2>(gB));
        for (int kt = 0; kt < k_tiles; ++kt) {
          EmptyBarrier::wait(&smem.empty[stage], phase ^ 1);
          FullBarrier::arrive_and_expect_tx(&smem.full[stage], Cfg::kStageBytes);  // A, our half of B, the peer's
          copy(tma_a.with(smem.full[stage]), tAgA(_, kt), tAsA(_, stage));
          copy(tma_b.with(smem.full[stage], static_cast<uint16_t>((1u << kCluster) - 1)), tBgB(_, kt), tBsB(_, stage));
          if (++stage == kStages) stage = 0, phase ^= 1;
        }
      }
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<232>();
    typename Cfg::TiledMma mma;
    const int ct = threadIdx.x - 128;
    auto thr = mma.get_thread_slice(ct);
    Tensor tCsA = thr.partition_A(sA);
    Tensor tCsB = thr.partition_B(sB);
    Tensor tCrA = thr.make_fragment_A(tCsA);  // (MMA, MMA_M, MMA_K, stage): descriptors
    Tensor tCrB = thr.make_fragment_B(tCsB);
    Tensor crd = thr.partition_C(make_identity_tensor(make_shape(Int<kBM>{}, Int<kBN>{})));
    Tensor acc = partition_fragment_C(mma, make_shape(Int<kBM>{}, Int<kBN>{}));
    const bool releaser = (ct & 127) == 0;
    // A stage is free for the producers once this warpgroup's WGMMAs on it have retired: tell both CTAs.
    const auto release = [&](int s) {
      CUTE_UNROLL
      for (int c = 0; c < kCluster; ++c) EmptyBarrier::arrive(&smem.empty[s], c, releaser);
    };
    int stage = 0;
    uint32_t phase = 0;
    for (int pair = blockIdx.x / kCluster; pair < pairs; pair += clusters) {
      int mp, nt;
      tile_coords(pair, (num_m + kCluster - 1) / kCluster, num_n, mp, nt);
      const int mt = mp * kCluster + rank;
      mma.accumulate_ = GMMA::ScaleOut::Zero;
      int prev = -1;
      for (int kt = 0; kt < k_tiles; ++kt) {
        FullBarrier::wait(&smem.full[stage], phase);
        warpgroup_fence_operand(acc);
        warpgroup_arrive();
        CUTE_UNROLL
        for (int kb = 0; kb < size<2>(tCrA); ++kb) {
          cute::gemm(mma, tCrA(_, _, kb, stage), tCrB(_, _, kb, stage), acc);
          mma.accumulate_ = GMMA::ScaleOut::One;
        }
        warpgroup_commit_batch();
        warpgroup_wait<1>();  // the previous k tile's WGMMAs have retired: its stage is free
        warpgroup_fence_operand(acc);
        if (prev >= 0) release(prev);
        prev = stage;
        if (++stage == kStages) stage = 0, phase ^= 1;
      }
      warpgroup_wait<0>();
      warpgroup_fence_operand(acc);
      if (prev >= 0) release(prev);
      const int64_t m0 = static_cast<int64_t>(mt) * kBM, n0 = static_cast<int64_t>(nt) * kBN;
      if constexpr (kEpi == Epi::kGrad) {
        epilogue_grad<T, kGeneral>(p, acc, crd, m0, n0);
      } else if constexpr (kEpi == Epi::kExp) {
        epilogue_exp<T>(p, acc, crd, m0, n0, nt);
      } else {
        epilogue_stats<kGeneral>(p, acc, crd, m0, n0, nt);
      }
    }
  }
  // Neither CTA leaves while its peer may still multicast into its shared memory or arrive on its barriers.
  __syncwarp();
  cute::cluster_sync();
#endif
}

template <typename T, Epi kEpi, bool kGeneral>
void launch_typed(const FusedGemmParams& p, int sm_count, cudaStream_t stream) {
  using Cfg = Config<T>;
  const int m = static_cast<int>(p.m), n = static_cast<int>(p.n), k = static_cast<int>(p.k);
  Tensor mA = make_tensor(make_gmem_ptr(static_cast<const T*>(p.x)), make_shape(m, k), make_stride(p.ldx, Int<1>{}));
  Tensor mB = make_tensor(make_gmem_ptr(static_cast<const T*>(p.w)), make_shape(n, k), make_stride(p.ldw, Int<1>{}));
  auto tma_a = make_tma_copy(SM90_TMA_LOAD{}, mA, typename Cfg::SmemA{}(_, _, 0));
  auto tma_b = make_tma_copy(SM90_TMA_LOAD_MULTICAST{}, mB, typename Cfg::SmemB{}(_, _, 0), Int<kCluster>{});
  auto* kernel = &fused_kernel<T, kEpi, kGeneral, decltype(tma_a), decltype(tma_b)>;
  const int smem = static_cast<int>(kSmemBytes<T>);
  const int64_t pairs = ((p.m + kCluster * kBM - 1) / (kCluster * kBM)) * ((p.n + kBN - 1) / kBN);
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = kCluster;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = static_cast<size_t>(smem);
  cfg.stream = stream;
  // As many clusters as fit at once (the GPCs may not pair every SM), at most one per tile pair. The shared-memory
  // opt-in and that count are per kernel and device: asked once (the occupancy query alone costs more host time
  // than a launch), under a lock, for each device of the process.
  static std::mutex mu;
  static int resident_of[kMaxDevices] = {};
  int device = 0;
  LOGITLESS_CUDA_CHECK(cudaGetDevice(&device));
  int resident = 0;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (device >= kMaxDevices || resident_of[device] == 0) {
      LOGITLESS_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      cfg.gridDim = dim3(static_cast<unsigned>(kCluster * std::max(1, sm_count / kCluster)));
      if (cudaOccupancyMaxActiveClusters(&resident, kernel, &cfg) != cudaSuccess || resident < 1) {
        (void)cudaGetLastError();
        resident = std::max(1, sm_count / kCluster);
      }
      if (device < kMaxDevices) resident_of[device] = resident;
    }
    resident = device < kMaxDevices ? resident_of[device] : resident;
  }
  cfg.gridDim = dim3(static_cast<unsigned>(kCluster * std::min<int64_t>(pairs, resident)));
  LOGITLESS_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, p, tma_a, tma_b));
  LOGITLESS_CUDA_CHECK_LAUNCH("linear cross-entropy fused logits GEMM");
}

template <Epi kEpi>
void launch(const FusedGemmParams& p, int sm_count, cudaStream_t stream) {
  if (p.m <= 0 || p.n <= 0) return;
  const bool general = p.ce.softcap > 0.f || p.ce.eps != 0.f;
  if (p.dtype == DType::kBFloat16) {
    general ? launch_typed<cutlass::bfloat16_t, kEpi, true>(p, sm_count, stream)
            : launch_typed<cutlass::bfloat16_t, kEpi, false>(p, sm_count, stream);
  } else {
    general ? launch_typed<cutlass::half_t, kEpi, true>(p, sm_count, stream)
            : launch_typed<cutlass::half_t, kEpi, false>(p, sm_count, stream);
  }
}

}  // namespace

bool debug::fused_kernels_built() { return true; }

bool fused_gemm_supported(int device, DType dtype, const void* x, int64_t ldx, const void* w, int64_t ldw, int64_t k) {
  if (dtype != DType::kBFloat16 && dtype != DType::kFloat16) return false;
  const DeviceInfo& info = device_info(device);
  if (info.sm_major != 9 || info.sm_minor != 0) return false;
  if (info.max_smem_per_block_optin < static_cast<int>(kSmemBytes<cutlass::bfloat16_t>)) return false;
  const auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  return k >= 1 && aligned(x) && aligned(w) && ldx % 8 == 0 && ldw % 8 == 0;
}

void launch_fused_stats(const FusedGemmParams& p, int sm_count, cudaStream_t stream) {
  launch<Epi::kStats>(p, sm_count, stream);
}

void launch_fused_grad(const FusedGemmParams& p, int sm_count, cudaStream_t stream) {
  launch<Epi::kGrad>(p, sm_count, stream);
}

void launch_fused_exp(const FusedGemmParams& p, int sm_count, cudaStream_t stream) {
  if (p.m <= 0 || p.n <= 0) return;
  if (p.dtype != DType::kBFloat16 || p.ce.softcap > 0.f || p.ce.eps != 0.f)
    throw_invalid("linear cross-entropy fused exponentials: bfloat16 inputs without soft cap or label smoothing only");
  launch_typed<cutlass::bfloat16_t, Epi::kExp, false>(p, sm_count, stream);
}

#else  // built without CUTLASS: the generic path serves every device

bool debug::fused_kernels_built() { return false; }
bool fused_gemm_supported(int, DType, const void*, int64_t, const void*, int64_t, int64_t) { return false; }
void launch_fused_stats(const FusedGemmParams&, int, cudaStream_t) {
  throw_runtime("linear cross-entropy: the fused Hopper kernels were not built (no CUTLASS headers)");
}
void launch_fused_grad(const FusedGemmParams&, int, cudaStream_t) {
  throw_runtime("linear cross-entropy: the fused Hopper kernels were not built (no CUTLASS headers)");
}
void launch_fused_exp(const FusedGemmParams&, int, cudaStream_t) {
  throw_runtime("linear cross-entropy: the fused Hopper kernels were not built (no CUTLASS headers)");
}

#endif

}  // namespace logitless::lce
