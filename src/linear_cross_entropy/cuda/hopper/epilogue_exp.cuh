// The gradient in forward's epilogue (plain options, params.h's ExpGradParams): E = exp(z - shift) of every element
// in T (0 in ignored rows, NaN in rows with a bad target; TileStore) and, per (row, tile), the sum of E as the
// statistics of a tile whose maximum is shift: (shift, sum of E, 0, 0). One exponential per element serves both. A
// tile whose maximum is more than kFarNats above shift (its E would overflow) takes its own maximum as the base
// instead, for E and the statistics alike; exp_rows sends such rows to exp_fixup (lse - shift > kExpRange), which
// rewrites E. So does a target logit of -inf (a class masked by its bias). A tile whose E all underflow is
// negligible beside the target's own E of 1. The target's logit is shift itself (launch_finish_rows' target_logit).
#pragma once

#include "linear_cross_entropy/cuda/hopper/epilogue_rows.cuh"
#include "linear_cross_entropy/cuda/hopper/epilogue_store.cuh"
#include "linear_cross_entropy/cuda/params.h"  // kExpRange

namespace logitless::lce::hopper {

struct ExpArguments {
  LogitRows rows;
  float* partials = nullptr;     // [m, rows.col_tiles(), 4]
  const float* shift = nullptr;  // [m]
  void* e = nullptr;             // [m, ld_e] in the inputs' dtype
  int64_t ld_e = 0;
};

template <typename T>
struct EpilogueExp {
  using Store = TileStore<T>;
  using Arguments = ExpArguments;
  struct Params {
    LogitRows rows;
    float* partials;
    const float* shift;
    typename Store::Tma tma_e;
  };
  using SharedStorage = typename Store::SharedStorage;

  static Params to_underlying_arguments(const Arguments& a) {
    return {a.rows, a.partials, a.shift, Store::to_underlying_arguments(a.e, a.rows.m, a.rows.n, a.ld_e)};
  }

  struct Rows {
    RowTargets t;
    float shift[2];
  };
  template <class Crd>
  __device__ __forceinline__ static Rows load_rows(const Params& p, const Crd& crd, int64_t m0) {
    Rows d;
    d.shift[0] = d.shift[1] = 0.f;
    d.t = load_row_targets(p.rows, crd, m0, [&](int i, int64_t r, int64_t, ce::RowKind) { d.shift[i] = p.shift[r]; });
    return d;
  }

  template <class Acc, class Crd>
  __device__ __forceinline__ static void apply(const Params& p, const Rows& d, Acc& acc, const Crd& crd,
                                               const TileAt& t, SharedStorage& smem, int wgl, int tw) {
    const bool full = t.m0 + kBM <= p.rows.m && t.n0 + kBN <= p.rows.n;  // uniform over the CTA
    full ? tile<true>(p, d, acc, crd, t, smem, wgl, tw) : tile<false>(p, d, acc, crd, t, smem, wgl, tw);
  }

  __device__ __forceinline__ static void drain(int tw) { Store::drain(tw); }

  // The far-tile rule above (epilogue_exp_row_stats.cuh bases its sums alike).
  static constexpr float kFarNats = 64.f;
  static_assert(kFarNats > kExpRange, "rows with a tile based on its maximum must be rewritten");

 private:
  // kFull: every row and column of the tile is in the problem (no masks; most tiles).
  template <bool kFull, class Acc, class Crd>
  __device__ __forceinline__ static void tile(const Params& p, const Rows& d, Acc& acc, const Crd& crd, const TileAt& t,
                                              SharedStorage& smem, int wgl, int tw) {
    const LogitRows& lr = p.rows;
    const int64_t cols_left = lr.n - t.n0;
    add_bias(lr, acc, crd, t.n0, cols_left);
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
      valid[i] = d.t.kind[i] == ce::RowKind::kValid;
      const float shift = d.shift[i];
      // The base: shift, or the tile's maximum where that is far above shift (or shift is -inf, or NaN: the
      // comparison fails); 0 with m_out = -inf for a tile of -inf only, as EpilogueStats.
      float base = mx - shift <= kFarNats ? shift : mx;
      m_out[i] = base;
      if (mx == -INFINITY) base = 0.f, m_out[i] = -INFINITY;
      c_l2[i] = valid[i] ? base * ce::kLog2e : INFINITY;  // rows without a target: E = 0 (stored as fill), sum 0
      fill[i] = d.t.kind[i] == ce::RowKind::kBad ? NAN : 0.f;
    }
    Store::store(p.tma_e, smem, wgl, tw, t.mt, t.nt, static_cast<int>(lr.m), static_cast<int>(lr.n), [&](int e) {
      const int i = (e >> 1) & 1;
      const float x = ce::fast_exp2(fmaf(acc(e), ce::kLog2e, -c_l2[i]));
      sel[i][(e >> 2) % kLanes] += x;
      return valid[i] ? x : fill[i];
    });
    CUTE_UNROLL
    for (int i = 0; i < 2; ++i) {
      float si = 0.f;
      CUTE_UNROLL
      for (int q = 0; q < kLanes; ++q) si += sel[i][q];
      si = quad_sum(si);
      float mo = m_out[i];
      if (isnan(si)) mo = si = NAN;  // NaN or +inf in the tile's row, as EpilogueStats
      store_tile_stats(lr, p.partials, d.t, i, t.m0, t.nt, make_float4(mo, si, 0.f, 0.f));
    }
  }
};

}  // namespace logitless::lce::hopper
