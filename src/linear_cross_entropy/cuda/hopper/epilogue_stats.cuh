// The forward epilogue: per (row, 256-column tile) the partial statistics of include/logitless/vocab_parallel.h
// (max, sum of exp, the target's logit, sum of w x) into partials; launch_finish_rows (kernels.h) combines the
// tiles into lse and the loss.
#pragma once

#include "linear_cross_entropy/cuda/hopper/epilogue_rows.cuh"

namespace logitless::lce::hopper {

struct StatsArguments {
  LogitRows rows;
  float* partials = nullptr;  // [m, rows.col_tiles(), 4]
};

// kGeneral: soft cap and label smoothing.
template <typename T, bool kGeneral>
struct EpilogueStats {
  using Arguments = StatsArguments;
  using Params = StatsArguments;
  struct SharedStorage {};

  static Params to_underlying_arguments(const Arguments& a) { return a; }

  using Rows = RowTargets;
  template <class Crd>
  __device__ __forceinline__ static Rows load_rows(const Params& p, const Crd& crd, int64_t m0) {
    return load_row_targets(p.rows, crd, m0, [](int, int64_t) {});
  }

  template <class Acc, class Crd>
  __device__ __forceinline__ static void apply(const Params& p, const Rows& d, Acc& acc, const Crd& crd,
                                               const TileAt& t, SharedStorage&, int, int) {
    const bool full = t.m0 + kBM <= p.rows.m && t.n0 + kBN <= p.rows.n;  // uniform over the CTA
    full ? tile<true>(p, d, acc, crd, t) : tile<false>(p, d, acc, crd, t);
  }

  __device__ __forceinline__ static void drain(int) {}

 private:
  // kFull: every row and column of the tile is in the problem (no masks; most tiles).
  template <bool kFull, class Acc, class Crd>
  __device__ __forceinline__ static void tile(const Params& p, const Rows& d, Acc& acc, const Crd& crd,
                                              const TileAt& t) {
    const LogitRows& lr = p.rows;
    const int64_t n0 = t.n0, cols_left = lr.n - n0;
    add_bias(lr, acc, crd, n0, cols_left);
    // The target's column relative to this thread's first column of the tile (-1: not in the tile, or no target),
    // so that each element compares it with a constant.
    const int c0 = get<1>(crd(0));
    int trel[2];
    // Maxima and sums in kLanes independent chains per row (a single chain of 64 dependent instructions per row
    // leaves the epilogue waiting on latencies).
    float mxl[2][kLanes];
    CUTE_UNROLL
    for (int i = 0; i < 2; ++i) {
      const int64_t tc = d.tcol(p.rows, i) - n0 - c0;
      trel[i] = d.kind(p.rows, i) == ce::RowKind::kValid && tc >= 0 && tc < kBN ? static_cast<int>(tc) : -1;
      CUTE_UNROLL
      for (int q = 0; q < kLanes; ++q) mxl[i][q] = -INFINITY;
    }
    CUTE_UNROLL
    for (int e = 0; e < size(acc); ++e) {
      const int i = (e >> 1) & 1, q = (e >> 2) % kLanes, c = get<1>(crd(e));
      float x = acc(e);
      if constexpr (kGeneral) x = ce::capped(lr.ce, x);
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
          if (lr.ce.eps != 0.f && (kFull || c < cols_left))
            swx[i] = fmaf(ce::class_weight(lr.ce, lr.col0 + n0 + c), x, swx[i]);
        }
      }
    }
    CUTE_UNROLL
    for (int i = 0; i < 2; ++i) {
      CUTE_UNROLL
      for (int q = 0; q < kLanes; ++q) s[i] += sl[i][q];
    }
    CUTE_UNROLL
    for (int i = 0; i < 2; ++i) {
      float si = quad_sum(s[i]), xti = quad_sum(xt[i]), swxi = quad_sum(swx[i]);
      float mi = mx[i];
      // NaN anywhere in the tile's row (or +inf, whose exp(x - m) is NaN): the whole row is NaN.
      if (isnan(si)) mi = si = NAN;
      store_tile_stats(lr, p.partials, d, i, t.m0, t.nt, make_float4(mi, si, xti, swxi));
    }
  }
};

}  // namespace logitless::lce::hopper
