// The gradient in forward's epilogue (plain options, params.h's ExpGradParams): E = exp(z - shift) of every element
// in T (0 in ignored rows, NaN in rows with a bad target; TileStore) and, per (row, tile), the sum of E as the
// statistics of a tile whose maximum is shift: (shift, sum of E), two floats (plan.h, kExpStatsFloats). One
// exponential per element serves both. A tile whose maximum is more than kFarNats above shift (its E would
// overflow) takes its own maximum as the base of its statistics instead; exp_rows sends such rows to exp_fixup
// (lse - shift > kExpRange), which rewrites E. So does a target logit of -inf (a class masked by its bias). A tile
// whose E all underflow is negligible beside the target's own E of 1. The target's logit is shift itself
// (launch_finish_rows' target_logit).
//
// Interior tiles take E on shift at once and look for the tile's maximum only where a row's sum shows a far tile
// (tile_on_shift); tiles at the problem's edge, and warps with a row whose shift is not finite, take the maximum first
// (tile), and base E on it too where it is far.
#pragma once

#include "linear_cross_entropy/cuda/hopper/epilogue_rows.cuh"
#include "linear_cross_entropy/cuda/hopper/epilogue_store.cuh"
#include "linear_cross_entropy/cuda/params.h"  // kExpRange

namespace logitless::lce::hopper {

struct ExpArguments {
  LogitRows rows;
  float* partials = nullptr;     // [m, rows.col_tiles(), kExpStatsFloats]
  const float* shift = nullptr;  // [m]
  void* e = nullptr;             // [m, ld_e] in the inputs' dtype
  int64_t ld_e = 0;
  bool on_shift = true;  // interior tiles on shift where the rows allow (EpilogueExp::tile_on_shift); off: tests
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
    bool on_shift;
  };
  using SharedStorage = typename Store::SharedStorage;

  static Params to_underlying_arguments(const Arguments& a) {
    return {a.rows, a.partials, a.shift, Store::to_underlying_arguments(a.e, a.rows.m, a.rows.n, a.ld_e), a.on_shift};
  }

  struct Rows {
    RowTargets t;
    float shift[2];
  };
  template <class Crd>
  __device__ __forceinline__ static Rows load_rows(const Params& p, const Crd& crd, int64_t m0) {
    Rows d;
    d.shift[0] = d.shift[1] = 0.f;
    d.t = load_row_targets(p.rows, crd, m0, [&](int i, int64_t r) { d.shift[i] = p.shift[r]; });
    return d;
  }

  template <class Acc, class Crd>
  __device__ __forceinline__ static void apply(const Params& p, const Rows& d, Acc& acc, const Crd& crd,
                                               const TileAt& t, SharedStorage& smem, int wgl, int tw) {
    const bool full = t.m0 + kBM <= p.rows.m && t.n0 + kBN <= p.rows.n;  // uniform over the CTA
    // A warp's rows all with a finite shift (the usual case): no maximum before the exponentials (tile_on_shift). A
    // vote, so that what the warp does next is uniform over it (its quads reduce with shuffles).
    if (full && p.on_shift && __all_sync(0xFFFFFFFFu, isfinite(d.shift[0]) && isfinite(d.shift[1])))
      tile_on_shift(p, d, acc, crd, t, smem, wgl, tw);
    else if (full)
      tile<true>(p, d, acc, crd, t, smem, wgl, tw);
    else
      tile<false>(p, d, acc, crd, t, smem, wgl, tw);
  }

  __device__ __forceinline__ static void drain(int tw) { Store::drain(tw); }

  // The far-tile rule above (epilogue_exp_row_stats.cuh bases its sums alike).
  static constexpr float kFarNats = 64.f;
  static constexpr float kFarSum = 6.2351491e27f;  // e^kFarNats
  static_assert(kFarNats > kExpRange, "rows with a tile based on its maximum must be rewritten");

  // From here to the private part: shared with EpilogueExpRowStats, which bases its exponentials alike.
  //
  // The row data of the thread's rows as the exponentials need it: E's base, that times log2(e) (INFINITY in a row
  // without a target: E = 0 there, stored as fill), and what such a row stores (NaN for a bad target).
  struct RowExp {
    float base[2], c_l2[2], fill[2];
    bool valid[2];
  };
  __device__ __forceinline__ static void set_row(const Params& p, RowExp& x, const Rows& d, int i, float base) {
    const ce::RowKind kind = d.t.kind(p.rows, i);
    x.valid[i] = kind == ce::RowKind::kValid;
    x.base[i] = base;
    x.c_l2[i] = x.valid[i] ? base * ce::kLog2e : INFINITY;
    x.fill[i] = kind == ce::RowKind::kBad ? NAN : 0.f;
  }

  // The tile's maximum of each of the thread's rows, over its quad (columns past the problem set to -inf first).
  // NaN only where every element is (fmaxf drops NaN).
  template <bool kFull, class Acc, class Crd>
  __device__ __forceinline__ static void row_maxima(Acc& acc, const Crd& crd, int64_t cols_left, float (&mx)[2]) {
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
    CUTE_UNROLL
    for (int i = 0; i < 2; ++i) {
      mx[i] = mxl[i][0];
      CUTE_UNROLL
      for (int q = 1; q < kLanes; ++q) mx[i] = fmaxf(mx[i], mxl[i][q]);
      mx[i] = quad_max(mx[i]);
    }
  }

  // The base of row i's statistics and E in a tile of maximum mx: shift, or the tile's maximum where that is far
  // above shift (or shift is -inf, or NaN: the comparison fails); for a tile of -inf only, statistics based on -inf
  // (as EpilogueStats) and E on 0. Returns the statistics' base.
  __device__ __forceinline__ static float row_base(const Params& p, RowExp& x, const Rows& d, int i, float mx) {
    const float shift = d.shift[i];
    if (mx == -INFINITY) {
      set_row(p, x, d, i, 0.f);
      return -INFINITY;
    }
    const float base = mx - shift <= kFarNats ? shift : mx;
    set_row(p, x, d, i, base);
    return base;
  }

 private:
  // E of every element into the output tile, and the sums of each row's E over the thread's columns in sel (kLanes
  // chains per row, in element order). kValid: every row of the warp has a target (no fill to select).
  template <bool kValid = false, class Acc>
  __device__ __forceinline__ static void store_exps(const Params& p, const RowExp& x, Acc& acc, const TileAt& t,
                                                    SharedStorage& smem, int wgl, int tw, float (&sel)[2][kLanes]) {
    const LogitRows& lr = p.rows;
    Store::store(p.tma_e, smem, wgl, tw, t.mt, t.nt, static_cast<int>(lr.m), static_cast<int>(lr.n), [&](int e) {
      const int i = (e >> 1) & 1;
      const float v = ce::fast_exp2(fmaf(acc(e), ce::kLog2e, -x.c_l2[i]));
      sel[i][(e >> 2) % kLanes] += v;
      return kValid || x.valid[i] ? v : x.fill[i];
    });
  }

  // Row i's sum over its quad, the statistics (base, sum) stored; NaN or +inf in the tile's row makes both NaN
  // (as EpilogueStats).
  __device__ __forceinline__ static float row_sum(const float (&sel)[2][kLanes], int i) {
    float si = 0.f;
    CUTE_UNROLL
    for (int q = 0; q < kLanes; ++q) si += sel[i][q];
    return quad_sum(si);
  }
  __device__ __forceinline__ static void store_stats(const Params& p, const Rows& d, int i, const TileAt& t, float base,
                                                     float si) {
    if (isnan(si)) base = si = NAN;
    store_tile_stats(p.rows, p.partials, d.t, i, t.m0, t.nt, make_float2(base, si));
  }

  // kFull: every row and column of the tile is in the problem (no masks; most tiles).
  template <bool kFull, class Acc, class Crd>
  __device__ __forceinline__ static void tile(const Params& p, const Rows& d, Acc& acc, const Crd& crd, const TileAt& t,
                                              SharedStorage& smem, int wgl, int tw) {
    const int64_t cols_left = p.rows.n - t.n0;
    add_bias(p.rows, acc, crd, t.n0, cols_left);
    float mx[2], base[2], sel[2][kLanes] = {};
    row_maxima<kFull>(acc, crd, cols_left, mx);
    RowExp x;
    CUTE_UNROLL
    for (int i = 0; i < 2; ++i) base[i] = row_base(p, x, d, i, mx[i]);
    store_exps(p, x, acc, t, smem, wgl, tw, sel);
    CUTE_UNROLL
    for (int i = 0; i < 2; ++i) store_stats(p, d, i, t, base[i], row_sum(sel, i));
  }

  // An interior tile whose rows all have a finite shift: E on shift with no maximum taken first, which is what the
  // rule above gives wherever no row's sum exceeds e^kFarNats (a tile whose maximum is more than kFarNats above
  // shift has a sum beyond that). Where one does (or a logit is +inf or NaN), the warp takes the maxima then and
  // the statistics by the rule, from the accumulators, which still hold the tile. The E it stored on shift differ
  // from the rule's only in rows whose base would have been the tile's maximum, which exp_fixup rewrites.
  template <class Acc, class Crd>
  __device__ __forceinline__ static void tile_on_shift(const Params& p, const Rows& d, Acc& acc, const Crd& crd,
                                                       const TileAt& t, SharedStorage& smem, int wgl, int tw) {
    add_bias(p.rows, acc, crd, t.n0, kBN);
    RowExp x;
    float sel[2][kLanes] = {}, si[2];
    CUTE_UNROLL
    for (int i = 0; i < 2; ++i) set_row(p, x, d, i, d.shift[i]);
    if (__all_sync(0xFFFFFFFFu, x.valid[0] && x.valid[1]))  // uniform over the warp, as Store::store must be
      store_exps<true>(p, x, acc, t, smem, wgl, tw, sel);
    else
      store_exps(p, x, acc, t, smem, wgl, tw, sel);
    CUTE_UNROLL
    for (int i = 0; i < 2; ++i) si[i] = row_sum(sel, i);
    if (__any_sync(0xFFFFFFFFu, !(si[0] <= kFarSum) || !(si[1] <= kFarSum))) {
      float mx[2], base[2], sums[2][kLanes] = {};
      row_maxima<true>(acc, crd, kBN, mx);
      CUTE_UNROLL
      for (int i = 0; i < 2; ++i) base[i] = row_base(p, x, d, i, mx[i]);
      CUTE_UNROLL
      for (int e = 0; e < size(acc); ++e) {
        const int i = (e >> 1) & 1;
        sums[i][(e >> 2) % kLanes] += ce::fast_exp2(fmaf(acc(e), ce::kLog2e, -x.c_l2[i]));
      }
      CUTE_UNROLL
      for (int i = 0; i < 2; ++i) store_stats(p, d, i, t, base[i], row_sum(sums, i));
      return;
    }
    CUTE_UNROLL
    for (int i = 0; i < 2; ++i) store_stats(p, d, i, t, d.shift[i], si[i]);
  }
};

}  // namespace logitless::lce::hopper
