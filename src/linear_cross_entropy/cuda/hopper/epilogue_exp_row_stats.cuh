// The gradient in forward's epilogue with the row statistics (LinearCrossEntropyOptions::row_stats): everything
// EpilogueExp writes (E, and the (base, sum of E) statistics per (row, tile), under its far-tile rule), and per (row,
// tile) into row_partials [m, tiles, 4]:
//   (A = Σ E (z - base), the tile's maximum logit, its first column (int bits), 1 if the tile holds a NaN logit)
// with the same E and base as the statistics, so that over the row's tiles k, with lse the row's:
//   entropy = Σ_k exp(base_k - lse) ((lse - base_k) s_k - A_k)    (each term is Σ_j p_j (lse - z_j) >= 0: no
//                                                                   cancellation between large numbers)
// and the first maximum is the smallest column among the tiles holding the row's largest maximum
// (launch_finish_row_stats, kernels.h). The maximum and its column are of the raw logits (no soft cap on this path).
// An element of -inf adds 0 to A (its E is 0; its distance to base is clamped so that no 0 * -inf is formed); a tile
// of -inf only has maximum -inf and any column (the row's answer is then column 0, which the finish knows from the
// maximum).
#pragma once

#include <cfloat>
#include <climits>

#include "linear_cross_entropy/cuda/hopper/epilogue_exp.cuh"

namespace logitless::lce::hopper {

struct ExpRowStatsArguments : ExpArguments {
  float* row_partials = nullptr;  // [m, rows.col_tiles(), 4]
};

template <typename T>
struct EpilogueExpRowStats {
  using Exp = EpilogueExp<T>;
  using Store = typename Exp::Store;
  using Arguments = ExpRowStatsArguments;
  struct Params {
    typename Exp::Params exp;
    float* row_partials;
  };
  using SharedStorage = typename Exp::SharedStorage;
  using Rows = typename Exp::Rows;

  static Params to_underlying_arguments(const Arguments& a) {
    return {Exp::to_underlying_arguments(a), a.row_partials};
  }

  template <class Crd>
  __device__ __forceinline__ static Rows load_rows(const Params& p, const Crd& crd, int64_t m0) {
    return Exp::load_rows(p.exp, crd, m0);
  }

  template <class Acc, class Crd>
  __device__ __forceinline__ static void apply(const Params& p, const Rows& d, Acc& acc, const Crd& crd,
                                               const TileAt& t, SharedStorage& smem, int wgl, int tw) {
    const LogitRows& lr = p.exp.rows;
    const bool full = t.m0 + kBM <= lr.m && t.n0 + kBN <= lr.n;  // uniform over the CTA
    full ? tile<true>(p, d, acc, crd, t, smem, wgl, tw) : tile<false>(p, d, acc, crd, t, smem, wgl, tw);
  }

  __device__ __forceinline__ static void drain(int tw) { Store::drain(tw); }

 private:
  // The first column of each row's maximum within the tile (over its quad), and whether the row holds a NaN.
  template <class Acc, class Crd>
  __device__ __forceinline__ static void first_columns(const Acc& acc, const Crd& crd, const TileAt& t,
                                                       const float mx[2], int first[2], int nan[2]) {
    first[0] = first[1] = INT_MAX;
    nan[0] = nan[1] = 0;
    CUTE_UNROLL
    for (int e = 0; e < size(acc); ++e) {
      const int i = (e >> 1) & 1, c = get<1>(crd(e));
      if (acc(e) == mx[i]) first[i] = min(first[i], c);
      nan[i] |= acc(e) != acc(e);
    }
    CUTE_UNROLL
    for (int i = 0; i < 2; ++i) {
      CUTE_UNROLL
      for (int o = 1; o <= 2; o <<= 1) {
        first[i] = min(first[i], __shfl_xor_sync(0xFFFFFFFFu, first[i], o));
        nan[i] |= __shfl_xor_sync(0xFFFFFFFFu, nan[i], o);
      }
      first[i] = first[i] == INT_MAX ? static_cast<int>(t.n0) : static_cast<int>(t.n0) + first[i];
    }
  }

  template <bool kFull, class Acc, class Crd>
  __device__ __forceinline__ static void tile(const Params& p, const Rows& d, Acc& acc, const Crd& crd, const TileAt& t,
                                              SharedStorage& smem, int wgl, int tw) {
    const LogitRows& lr = p.exp.rows;
    const int64_t cols_left = lr.n - t.n0;
    add_bias(lr, acc, crd, t.n0, cols_left);
    float mx[2], m_out[2], sel[2][kLanes] = {}, dot[2][kLanes] = {};
    Exp::template row_maxima<kFull>(acc, crd, cols_left, mx);  // NaN dropped: the NaN flag below tells such a tile
    int first[2], nan[2];
    first_columns(acc, crd, t, mx, first, nan);
    typename Exp::RowExp x;
    CUTE_UNROLL
    for (int i = 0; i < 2; ++i) m_out[i] = Exp::row_base(p.exp, x, d, i, mx[i]);
    Store::store(p.exp.tma_e, smem, wgl, tw, t.mt, t.nt, static_cast<int>(lr.m), static_cast<int>(lr.n), [&](int e) {
      const int i = (e >> 1) & 1, q = (e >> 2) % kLanes;
      const float v = ce::fast_exp2(fmaf(acc(e), ce::kLog2e, -x.c_l2[i]));
      sel[i][q] += v;
      dot[i][q] = fmaf(v, fmaxf(acc(e) - x.base[i], -FLT_MAX), dot[i][q]);
      return x.valid[i] ? v : x.fill[i];
    });
    CUTE_UNROLL
    for (int i = 0; i < 2; ++i) {
      float si = 0.f, ai = 0.f;
      CUTE_UNROLL
      for (int q = 0; q < kLanes; ++q) si += sel[i][q], ai += dot[i][q];
      si = quad_sum(si);
      ai = quad_sum(ai);
      float mo = m_out[i];
      if (isnan(si)) mo = si = ai = NAN;  // NaN or +inf in the tile's row, as EpilogueExp
      store_tile_stats(lr, p.exp.partials, d.t, i, t.m0, t.nt, make_float2(mo, si));
      store_tile_stats(lr, p.row_partials, d.t, i, t.m0, t.nt,
                       make_float4(ai, mx[i], __int_as_float(first[i]), nan[i] ? 1.f : 0.f));
    }
  }
};

}  // namespace logitless::lce::hopper
