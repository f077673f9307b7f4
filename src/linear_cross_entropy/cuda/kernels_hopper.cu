// The Hopper logits GEMM with the cross-entropy in its epilogue (see kernels_hopper.h).
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
// accumulator layout of WGMMA. Row statistics reduce over the 4 lanes that share a row. An output tile (E, the
// gradient) goes through two 8 KB chunk buffers per consumer warpgroup and TMA stores that drain while the next
// tile's WGMMAs run (stage_and_store). The tensor cores wait for the epilogue: it costs its own length per tile, so
// it is kept short (no masks in interior tiles, independent chains, row data loaded during the last k block).
#include "linear_cross_entropy/cuda/kernels_hopper.h"

#include <algorithm>
#include <mutex>

#include "common/cuda/check.cuh"
#include "cross_entropy/cuda/device.cuh"
#include "linear_cross_entropy/cuda/dtype_io.cuh"

#if defined(LOGITLESS_WITH_CUTLASS)
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/numeric_types.h>
#include <cute/tensor.hpp>
#endif

namespace logitless::lce {

#if defined(LOGITLESS_WITH_CUTLASS)
namespace {

using namespace cute;

constexpr int kBM = 128, kBN = static_cast<int>(kFusedTileCols), kBK = 64, kStages = 4;
constexpr int kThreads = 384;    // a producer warpgroup, two consumer warpgroups
constexpr int kCluster = 2;      // CTAs per cluster: token tiles sharing one class tile
constexpr int kGroupTiles = 8;   // token-tile pairs per raster group
constexpr int kMaxDevices = 64;  // devices whose launch configuration is remembered (others ask every launch)
constexpr int kEpiCols = 64;     // columns of an output chunk (stage_and_store): one 128-byte swizzle row of T
constexpr int kEpiChunks = kBN / kEpiCols;
constexpr int kEpiBarrier = 1;  // named barriers kEpiBarrier + w: consumer warpgroup w (0 is __syncthreads)
constexpr int kLanes = 4;       // independent accumulation chains per row in the epilogues

// kernels_hopper.h: statistics, gradient, statistics and exponentials; kNone: no epilogue
// (debug::launch_fused_mainloop)
enum class Epi { kStats, kGrad, kExp, kNone };

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
  using SmemA =
      decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<T>{}, make_shape(Int<kBM>{}, Int<kBK>{}, Int<kStages>{})));
  using SmemB =
      decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<T>{}, make_shape(Int<kBN>{}, Int<kBK>{}, Int<kStages>{})));
  using TiledMma = decltype(make_tiled_mma(typename MmaOf<T>::Op{}, Layout<Shape<_2, _1, _1>>{}));
  static constexpr uint32_t kStageBytes = (kBM + kBN) * kBK * sizeof(T);
};

// One output chunk of a consumer warpgroup: its 64 rows by kEpiCols columns, 128-byte swizzled (a TMA box).
template <typename T>
using SmemEChunk = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<T>{}, make_shape(Int<kBM / 2>{}, Int<kEpiCols>{})));

template <typename T>
struct SharedStorage {
  alignas(1024) cute::array_aligned<T, kBM * kBK * kStages, 1024> a;
  alignas(1024) cute::array_aligned<T, kBN * kBK * kStages, 1024> b;
  alignas(1024) cute::array_aligned<T, 2 * kBM * kEpiCols, 1024> e;  // two chunk buffers of both warpgroups
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

// The rows of a thread's accumulators (r and r + 8 of its warp's 16), what the epilogues read of them, loaded while
// the tile's last WGMMAs drain.
struct RowData {
  int row[2];             // within the tile
  ce::RowKind kind[2];    // rows past the last: ignored
  int64_t tcol[2];        // the target's column relative to column 0 of this launch (any value unless valid)
  float v[2];             // exp: shift; grad: lse
  float scale[2], wt[2];  // grad: the upstream factor times 1 / denominator; the target's class weight
  float zscale[2];        // grad: the upstream factor times 1 / count (the z-loss term's)
};

template <Epi kEpi, class Crd>
__device__ __forceinline__ RowData load_rows(const FusedGemmParams& p, const Crd& crd, int64_t m0) {
  RowData d;
  const int64_t rows_left = p.m - m0;
  CUTE_UNROLL
  for (int i = 0; i < 2; ++i) {
    d.row[i] = get<0>(crd(2 * i));
    d.kind[i] = ce::RowKind::kIgnored;
    d.tcol[i] = -1;
    d.v[i] = 0.f;
    d.scale[i] = d.wt[i] = d.zscale[i] = 1.f;
    if (d.row[i] < rows_left) {
      const int64_t r = m0 + d.row[i], t = p.target[r];
      d.kind[i] = ce::classify(p.ce, t);
      d.tcol[i] = ce::target_column(p.ce, t) - p.col0;
      if constexpr (kEpi == Epi::kExp) d.v[i] = p.shift[r];
      if constexpr (kEpi == Epi::kGrad) {
        d.v[i] = p.lse[r];
        const float up = p.upstream ? p.upstream[p.upstream_per_row ? r : 0] : 1.f;
        d.scale[i] = p.scalars->inv_denom * up;
        d.zscale[i] = p.scalars->inv_count * up;
        if (d.kind[i] == ce::RowKind::kValid) d.wt[i] = ce::target_weight(p.ce, t);
      }
    }
  }
  return d;
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

template <typename T>
__device__ __forceinline__ uint32_t pack2(float a, float b) {
  if constexpr (std::is_same_v<T, cutlass::bfloat16_t>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

// The tile's [128, 256] output in T (E or the gradient) through shared memory and TMA stores, which drain while the
// next tile's WGMMAs run. Each consumer warpgroup writes its 64 rows in kEpiChunks chunks of 64 columns into one of
// two 8 KB buffers (128-byte swizzle: a chunk is one TMA box), stmatrix putting four 8 x 8 blocks of the WGMMA
// accumulator layout per instruction, and its first thread stores the chunk; a buffer is rewritten once the store
// issued from it two chunks before has read it (waited for one chunk before). The TMA clips rows and columns past
// the output's end.
// val(e): the value of accumulator element e, called once per element in order.
template <typename T, class TmaE, class Val>
__device__ __forceinline__ void stage_and_store(const TmaE& tma_e, T* ebuf, int wgl, int tw, int mt, int nt, int m,
                                                int n, Val&& val) {
  const int lane = tw & 31, k = lane >> 3, i = lane & 7;
  const int r = 16 * (tw >> 5) + 8 * (k & 1) + i;  // the row (of the warpgroup's 64) whose address this lane gives
  Tensor mE = tma_e.get_tma_tensor(make_shape(m, n));
  CUTE_UNROLL
  for (int c = 0; c < kEpiChunks; ++c) {
    T* buf = ebuf + (c & 1) * (kBM * kEpiCols) + wgl * (kBM / 2 * kEpiCols);
    // The chunk's values first, all of them (independent exponentials in flight), then the buffer.
    constexpr int kVals = kEpiCols / 2;  // per thread: 2 rows x kEpiCols / 4 columns
    float v[kVals];
    CUTE_UNROLL
    for (int q = 0; q < kVals; ++q) v[q] = val(c * kVals + q);
    uint32_t packed[kVals / 2];
    CUTE_UNROLL
    for (int q = 0; q < kVals / 2; ++q) packed[q] = pack2<T>(v[2 * q], v[2 * q + 1]);
    const uint32_t row_addr = cast_smem_ptr_to_uint(buf) + r * (kEpiCols * sizeof(T));
    CUTE_UNROLL
    for (int jj = 0; jj < kEpiCols / 8; jj += 2) {  // two 8-column blocks of the chunk per instruction
      const int q = 2 * jj;                         // packed pairs of blocks jj, jj + 1: top, bottom, top, bottom
      const uint32_t addr = row_addr + (((jj + (k >> 1)) ^ i) << 4);  // the 16-byte chunk, swizzled by row % 8
      asm volatile("stmatrix.sync.aligned.x4.m8n8.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(packed[q]),
                   "r"(packed[q + 1]), "r"(packed[q + 2]), "r"(packed[q + 3]));
    }
    tma_store_fence();  // the writes above, visible to the TMA unit
    // One barrier per chunk: before it, the first thread waits until every store it issued has read its buffer,
    // so that after it this chunk can be stored and the next written into the other buffer.
    if (tw == 0) tma_store_wait<0>();
    cutlass::arch::NamedBarrier::sync(128, kEpiBarrier + wgl);
    if (tw == 0) {
      Tensor gE = local_tile(mE, Shape<Int<kBM / 2>, Int<kEpiCols>>{}, make_coord(2 * mt + wgl, nt * kEpiChunks + c));
      Tensor sE = make_tensor(make_smem_ptr(buf), SmemEChunk<T>{});
      auto cta = tma_e.get_slice(Int<0>{});
      copy(tma_e, cta.partition_S(sE), cta.partition_D(gE));
      tma_store_arrive();
    }
  }
}

// Per (row, tile): max, sum of exp, the target's logit, sum of w x (kGeneral: soft cap and label smoothing).
// kFull: every row and column of the tile is in the problem (no masks; most tiles).
template <bool kGeneral, bool kFull, class Acc, class Crd>
__device__ __forceinline__ void epilogue_stats(const FusedGemmParams& p, const RowData& d, Acc& acc, const Crd& crd,
                                               int64_t m0, int64_t n0, int nt) {
  const int64_t rows_left = p.m - m0, cols_left = p.n - n0;
  add_bias(p, acc, crd, n0, cols_left);
  // The target's column relative to this thread's first column of the tile (-1: not in the tile, or no target),
  // so that each element compares it with a constant.
  const int c0 = get<1>(crd(0));
  int trel[2];
  // Maxima and sums in kLanes independent chains per row (a single chain of 64 dependent instructions per row
  // leaves the epilogue waiting on latencies).
  float mxl[2][kLanes];
  CUTE_UNROLL
  for (int i = 0; i < 2; ++i) {
    const int64_t t = d.tcol[i] - n0 - c0;
    trel[i] = d.kind[i] == ce::RowKind::kValid && t >= 0 && t < kBN ? static_cast<int>(t) : -1;
    CUTE_UNROLL
    for (int q = 0; q < kLanes; ++q) mxl[i][q] = -INFINITY;
  }
  CUTE_UNROLL
  for (int e = 0; e < size(acc); ++e) {
    const int i = (e >> 1) & 1, q = (e >> 2) % kLanes, c = get<1>(crd(e));
    float x = acc(e);
    if constexpr (kGeneral) x = ce::capped(p.ce, x);
    if constexpr (!kFull) x = c < cols_left ? x : -INFINITY;
    acc(e) = x;
    mxl[i][q] = fmaxf(mxl[i][q], x);
  }
  float mx[2], s[2] = {0.f, 0.f}, xt[2] = {0.f, 0.f}, swx[2] = {0.f, 0.f};
  CUTE_UNROLL
  for (int i = 0; i < 2; ++i) {
    mx[i] = mxl[i][0];
    CUTE_UNROLL
    for (int q = 1; q < kLanes; ++q) mx[i] = fmaxf(mx[i], mxl[i][q]);
    mx[i] = quad_max(mx[i]);
  }
  // A tile row of -inf only (masked classes) adds nothing, rather than exp(-inf - -inf).
  const float ml2[2] = {mx[0] == -INFINITY ? 0.f : mx[0] * ce::kLog2e, mx[1] == -INFINITY ? 0.f : mx[1] * ce::kLog2e};
  float sl[2][kLanes] = {};
  constexpr int kGroup = 16;  // exponentials computed before they are summed: independent, in flight together
  CUTE_UNROLL
  for (int e0 = 0; e0 < size(acc); e0 += kGroup) {
    float ex[kGroup];
    CUTE_UNROLL
    for (int u = 0; u < kGroup; ++u) ex[u] = ce::fast_exp2(fmaf(acc(e0 + u), ce::kLog2e, -ml2[((e0 + u) >> 1) & 1]));
    CUTE_UNROLL
    for (int u = 0; u < kGroup; ++u) {
      const int e = e0 + u, i = (e >> 1) & 1, q = (e >> 2) % kLanes, c = get<1>(crd(e));
      const float x = acc(e);
      sl[i][q] += ex[u];
      if (c - c0 == trel[i]) xt[i] = x;
      if constexpr (kGeneral) {
        if (p.ce.eps != 0.f && (kFull || c < cols_left))
          swx[i] = fmaf(ce::class_weight(p.ce, p.col0 + n0 + c), x, swx[i]);
      }
    }
  }
  CUTE_UNROLL
  for (int i = 0; i < 2; ++i) {
    CUTE_UNROLL
    for (int q = 0; q < kLanes; ++q) s[i] += sl[i][q];
  }
  const int lane = threadIdx.x & 31;
  CUTE_UNROLL
  for (int i = 0; i < 2; ++i) {
    float si = quad_sum(s[i]), xti = quad_sum(xt[i]), swxi = quad_sum(swx[i]);
    float mi = mx[i];
    // NaN anywhere in the tile's row (or +inf, whose exp(x - m) is NaN): the whole row is NaN.
    if (isnan(si)) mi = si = NAN;
    if ((lane & 3) == 0 && d.row[i] < rows_left)
      reinterpret_cast<float4*>(p.partials)[(m0 + d.row[i]) * ((p.n + kBN - 1) / kBN) + nt] =
          make_float4(mi, si, xti, swxi);
  }
}

// d(loss)/dZ of the tile from the rows' lse, into dlogits in T (stage_and_store). kFull: as epilogue_stats.
template <typename T, bool kGeneral, bool kFull, class Acc, class Crd, class TmaE>
__device__ __forceinline__ void epilogue_grad(const FusedGemmParams& p, const RowData& d, Acc& acc, const Crd& crd,
                                              int64_t m0, int64_t n0, int mt, int nt, const TmaE& tma_e, T* ebuf,
                                              int wgl, int tw) {
  const int64_t cols_left = p.n - n0;
  add_bias(p, acc, crd, n0, cols_left);
  const float W = p.scalars->weight_sum;
  const int c0 = get<1>(crd(0));
  int64_t tcol[2];  // the target's column relative to this tile's first
  int trel[2];      // and to this thread's first column (-1: not in the tile, or no target), as epilogue_stats
  ce::GradCoeffs g[2];
  float lse_l2[2], fill[2];
  bool valid[2];
  CUTE_UNROLL
  for (int i = 0; i < 2; ++i) {
    valid[i] = d.kind[i] == ce::RowKind::kValid;
    fill[i] = d.kind[i] == ce::RowKind::kBad ? NAN : 0.f;
    tcol[i] = d.tcol[i] - n0;
    trel[i] = valid[i] && tcol[i] - c0 >= 0 && tcol[i] - c0 < kBN ? static_cast<int>(tcol[i] - c0) : -1;
    g[i] = valid[i] ? ce::row_grad_coeffs(d.v[i], d.wt[i], W, p.ce.eps, p.ce.inv_v, p.ce.z, d.scale[i], d.zscale[i])
                    : ce::GradCoeffs{0.f, 0.f, 0.f};
    lse_l2[i] = valid[i] ? d.v[i] * ce::kLog2e : 0.f;
  }
  stage_and_store<T>(tma_e, ebuf, wgl, tw, mt, nt, static_cast<int>(p.m), static_cast<int>(p.n), [&](int e) {
    const int i = (e >> 1) & 1, c = get<1>(crd(e));
    float v;
    if constexpr (kGeneral) {
      // grad_elem compares columns of the shard: shift both by the tile's first column. Columns past the end of
      // an edge tile have no class weight to read (and the TMA store clips them).
      v = kFull || c < cols_left
              ? ce::grad_elem(p.ce, g[i], lse_l2[i], ce::capped(p.ce, acc(e)), p.col0 + n0 + c, p.col0 + n0 + tcol[i])
              : 0.f;
    } else {
      v = g[i].a * ce::fast_exp2(fmaf(acc(e), ce::kLog2e, -lse_l2[i]));
      if (c - c0 == trel[i]) v -= g[i].b;
    }
    return valid[i] ? v : fill[i];
  });
}

// The gradient in forward (plain options, params.h's ExpGradParams): E = exp(z - shift) of every element in T (0 in
// ignored rows, NaN in rows with a bad target; stage_and_store) and, per (row, tile), the sum of E as the statistics
// of a tile whose maximum is shift: (shift, sum of E, 0, 0). One exponential per element serves both. A tile whose
// maximum is more than kFarNats above shift (its E would overflow) takes its own maximum as the base instead, for
// E and the statistics alike; exp_rows sends such rows to exp_fixup (lse - shift > kExpRange), which rewrites E.
// So does a target logit of -inf (a class masked by its bias). A tile whose E all underflow is negligible beside
// the target's own E of 1. The target's logit is shift itself (launch_finish_rows' target_logit). kFull: as
// epilogue_stats.
template <typename T, bool kFull, class Acc, class Crd, class TmaE>
__device__ __forceinline__ void epilogue_exp(const FusedGemmParams& p, const RowData& d, Acc& acc, const Crd& crd,
                                             int64_t m0, int64_t n0, int mt, int nt, const TmaE& tma_e, T* ebuf,
                                             int wgl, int tw) {
  constexpr float kFarNats = 64.f;
  static_assert(kFarNats > kExpRange, "rows with a tile based on its maximum must be rewritten");
  const int64_t rows_left = p.m - m0, cols_left = p.n - n0;
  add_bias(p, acc, crd, n0, cols_left);
  if constexpr (!kFull) {  // masked columns: exp(-inf) = 0 in the sum, and nothing in the maximum
    CUTE_UNROLL
    for (int e = 0; e < size(acc); ++e)
      if (get<1>(crd(e)) >= cols_left) acc(e) = -INFINITY;
  }
  float mxl[2][kLanes];
  CUTE_UNROLL
  for (int i = 0; i < 2; ++i) {
    CUTE_UNROLL
    for (int q = 0; q < kLanes; ++q) mxl[i][q] = -INFINITY;
  }
  CUTE_UNROLL
  for (int e = 0; e < size(acc); ++e) {
    float& m = mxl[(e >> 1) & 1][(e >> 2) % kLanes];
    m = fmaxf(m, acc(e));
  }
  float m_out[2], c_l2[2], fill[2], sel[2][kLanes] = {};
  bool valid[2];
  CUTE_UNROLL
  for (int i = 0; i < 2; ++i) {
    float mx = mxl[i][0];
    CUTE_UNROLL
    for (int q = 1; q < kLanes; ++q) mx = fmaxf(mx, mxl[i][q]);
    mx = quad_max(mx);  // NaN only where every element is (fmaxf drops NaN): the sum below is NaN then
    valid[i] = d.kind[i] == ce::RowKind::kValid;
    const float shift = d.v[i];
    // The base: shift, or the tile's maximum where that is far above shift (or shift is -inf, or NaN: the
    // comparison fails); 0 with m_out = -inf for a tile of -inf only, as epilogue_stats.
    float base = mx - shift <= kFarNats ? shift : mx;
    m_out[i] = base;
    if (mx == -INFINITY) base = 0.f, m_out[i] = -INFINITY;
    c_l2[i] = valid[i] ? base * ce::kLog2e : INFINITY;  // rows without a target: E = 0 (stored as fill), sum 0
    fill[i] = d.kind[i] == ce::RowKind::kBad ? NAN : 0.f;
  }
  stage_and_store<T>(tma_e, ebuf, wgl, tw, mt, nt, static_cast<int>(p.m), static_cast<int>(p.n), [&](int e) {
    const int i = (e >> 1) & 1;
    const float x = ce::fast_exp2(fmaf(acc(e), ce::kLog2e, -c_l2[i]));
    sel[i][(e >> 2) % kLanes] += x;
    return valid[i] ? x : fill[i];
  });
  const int lane = threadIdx.x & 31;
  CUTE_UNROLL
  for (int i = 0; i < 2; ++i) {
    float si = 0.f;
    CUTE_UNROLL
    for (int q = 0; q < kLanes; ++q) si += sel[i][q];
    si = quad_sum(si);
    float mo = m_out[i];
    if (isnan(si)) mo = si = NAN;  // NaN or +inf in the tile's row, as epilogue_stats
    if ((lane & 3) == 0 && d.row[i] < rows_left)
      reinterpret_cast<float4*>(p.partials)[(m0 + d.row[i]) * ((p.n + kBN - 1) / kBN) + nt] =
          make_float4(mo, si, 0.f, 0.f);
  }
}

// TmaE: the TMA store of the output (kGrad, kExp); unused otherwise.
template <typename T, Epi kEpi, bool kGeneral, class TmaA, class TmaB, class TmaE>
__global__ void __launch_bounds__(kThreads, 1)
    fused_kernel(const __grid_constant__ FusedGemmParams p, const __grid_constant__ TmaA tma_a,
                 const __grid_constant__ TmaB tma_b, const __grid_constant__ TmaE tma_e) {
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
      const int64_t m0 = static_cast<int64_t>(mt) * kBM, n0 = static_cast<int64_t>(nt) * kBN;
      RowData d{};
      if constexpr (kEpi != Epi::kNone) d = load_rows<kEpi>(p, crd, m0);  // while the last WGMMAs run
      warpgroup_wait<0>();
      warpgroup_fence_operand(acc);
      if (prev >= 0) release(prev);
      const bool full = m0 + kBM <= p.m && n0 + kBN <= p.n;  // uniform over the CTA
      const int wgl = wg - 1, tw = ct & 127;
      if constexpr (kEpi == Epi::kGrad) {
        full ? epilogue_grad<T, kGeneral, true>(p, d, acc, crd, m0, n0, mt, nt, tma_e, smem.e.data(), wgl, tw)
             : epilogue_grad<T, kGeneral, false>(p, d, acc, crd, m0, n0, mt, nt, tma_e, smem.e.data(), wgl, tw);
      } else if constexpr (kEpi == Epi::kExp) {
        full ? epilogue_exp<T, true>(p, d, acc, crd, m0, n0, mt, nt, tma_e, smem.e.data(), wgl, tw)
             : epilogue_exp<T, false>(p, d, acc, crd, m0, n0, mt, nt, tma_e, smem.e.data(), wgl, tw);
      } else if constexpr (kEpi == Epi::kNone) {
        if (acc(0) == 0x1p100f && p.partials) p.partials[0] = acc(1);  // keeps the accumulators live, never taken
        if (p.debug_spin > 0) {  // an epilogue of debug_spin cycles that does nothing (the benchmark's spin rows)
          const long long t0 = clock64();
          while (clock64() - t0 < p.debug_spin) {
          }
        }
      } else {
        full ? epilogue_stats<kGeneral, true>(p, d, acc, crd, m0, n0, nt)
             : epilogue_stats<kGeneral, false>(p, d, acc, crd, m0, n0, nt);
      }
    }
    // The shared memory stays until the last stores have read it.
    if constexpr (kEpi == Epi::kGrad || kEpi == Epi::kExp) {
      if ((ct & 127) == 0) tma_store_wait<0>();
    }
  }
  // Neither CTA leaves while its peer may still multicast into its shared memory or arrive on its barriers.
  __syncwarp();
  cute::cluster_sync();
#endif
}

template <typename T, Epi kEpi, bool kGeneral, class TmaA, class TmaB, class TmaE>
void launch_kernel(const FusedGemmParams& p, int sm_count, cudaStream_t stream, const TmaA& tma_a, const TmaB& tma_b,
                   const TmaE& tma_e) {
  auto* kernel = &fused_kernel<T, kEpi, kGeneral, TmaA, TmaB, TmaE>;
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
  LOGITLESS_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, p, tma_a, tma_b, tma_e));
  LOGITLESS_CUDA_CHECK_LAUNCH("linear cross-entropy fused logits GEMM");
}

template <typename T, Epi kEpi, bool kGeneral>
void launch_typed(const FusedGemmParams& p, int sm_count, cudaStream_t stream) {
  using Cfg = Config<T>;
  const int m = static_cast<int>(p.m), n = static_cast<int>(p.n), k = static_cast<int>(p.k);
  Tensor mA = make_tensor(make_gmem_ptr(static_cast<const T*>(p.x)), make_shape(m, k), make_stride(p.ldx, Int<1>{}));
  Tensor mB = make_tensor(make_gmem_ptr(static_cast<const T*>(p.w)), make_shape(n, k), make_stride(p.ldw, Int<1>{}));
  auto tma_a = make_tma_copy(SM90_TMA_LOAD{}, mA, typename Cfg::SmemA{}(_, _, 0));
  auto tma_b = make_tma_copy(SM90_TMA_LOAD_MULTICAST{}, mB, typename Cfg::SmemB{}(_, _, 0), Int<kCluster>{});
  if constexpr (kEpi == Epi::kGrad || kEpi == Epi::kExp) {
    // The output through TMA stores: 16-byte aligned rows (the plan's buffers are).
    if (reinterpret_cast<uintptr_t>(p.dlogits) % 16 != 0 || p.ld_dlogits % 8 != 0)
      throw_invalid(
          "linear cross-entropy fused GEMM: expected a 16-byte aligned output with rows of a multiple of 8 "
          "elements (the workspace's alignment), got another");
    Tensor mE =
        make_tensor(make_gmem_ptr(static_cast<T*>(p.dlogits)), make_shape(m, n), make_stride(p.ld_dlogits, Int<1>{}));
    auto tma_e = make_tma_copy(SM90_TMA_STORE{}, mE, SmemEChunk<T>{});
    launch_kernel<T, kEpi, kGeneral>(p, sm_count, stream, tma_a, tma_b, tma_e);
  } else {
    launch_kernel<T, kEpi, kGeneral>(p, sm_count, stream, tma_a, tma_b, tma_a);
  }
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

void debug::launch_fused_mainloop(const FusedGemmParams& p, int sm_count, cudaStream_t stream) {
  if (p.m <= 0 || p.n <= 0) return;
  launch_typed<cutlass::bfloat16_t, Epi::kNone, false>(p, sm_count, stream);
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
void debug::launch_fused_mainloop(const FusedGemmParams&, int, cudaStream_t) {
  throw_runtime("linear cross-entropy: the fused Hopper kernels were not built (no CUTLASS headers)");
}

#endif

}  // namespace logitless::lce
