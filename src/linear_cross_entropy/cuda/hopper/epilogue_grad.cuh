// The backward epilogue: d(loss)/dZ of the tile from the rows' lse, in the inputs' dtype, straight into the buffer
// the grad_hidden and grad_weight GEMMs read (TileStore).
#pragma once

#include "linear_cross_entropy/cuda/hopper/epilogue_rows.cuh"
#include "linear_cross_entropy/cuda/hopper/epilogue_store.cuh"
#include "linear_cross_entropy/cuda/params.h"  // Scalars

namespace logitless::lce::hopper {

struct GradArguments {
  LogitRows rows;
  const float* lse = nullptr;       // [m]
  const float* upstream = nullptr;  // nullptr (1), [1] or [m] (upstream_per_row)
  int upstream_per_row = 0;
  const Scalars* scalars = nullptr;
  void* dlogits = nullptr;  // [m, ld_dlogits] in the inputs' dtype
  int64_t ld_dlogits = 0;
};

// kGeneral: soft cap and label smoothing.
template <typename T, bool kGeneral>
struct EpilogueGrad {
  using Store = TileStore<T>;
  using Arguments = GradArguments;
  struct Params {
    LogitRows rows;
    const float* lse;
    const float* upstream;
    int upstream_per_row;
    const Scalars* scalars;
    typename Store::Tma tma_dlogits;
  };
  using SharedStorage = typename Store::SharedStorage;

  static Params to_underlying_arguments(const Arguments& a) {
    return {a.rows,     a.lse,
            a.upstream, a.upstream_per_row,
            a.scalars,  Store::to_underlying_arguments(a.dlogits, a.rows.m, a.rows.n, a.ld_dlogits)};
  }

  struct Rows {
    RowTargets t;
    float lse[2];
    float scale[2];   // the upstream factor times 1 / denominator
    float zscale[2];  // the upstream factor times 1 / count (the z-loss term's)
  };
  template <class Crd>
  __device__ __forceinline__ static Rows load_rows(const Params& p, const Crd& crd, int64_t m0) {
    Rows d;
    CUTE_UNROLL
    for (int i = 0; i < 2; ++i) d.lse[i] = 0.f, d.scale[i] = d.zscale[i] = 1.f;
    d.t = load_row_targets(p.rows, crd, m0, [&](int i, int64_t r) {
      d.lse[i] = p.lse[r];
      const float up = p.upstream ? p.upstream[p.upstream_per_row ? r : 0] : 1.f;
      d.scale[i] = p.scalars->inv_denom * up;
      d.zscale[i] = p.scalars->inv_count * up;
    });
    return d;
  }

  template <class Acc, class Crd>
  __device__ __forceinline__ static void apply(const Params& p, const Rows& d, Acc& acc, const Crd& crd,
                                               const TileAt& t, SharedStorage& smem, int wgl, int tw) {
    const bool full = t.m0 + kBM <= p.rows.m && t.n0 + kBN <= p.rows.n;  // uniform over the CTA
    full ? tile<true>(p, d, acc, crd, t, smem, wgl, tw) : tile<false>(p, d, acc, crd, t, smem, wgl, tw);
  }

  __device__ __forceinline__ static void drain(int tw) { Store::drain(tw); }

 private:
  // kFull: every row and column of the tile is in the problem (no masks; most tiles).
  template <bool kFull, class Acc, class Crd>
  __device__ __forceinline__ static void tile(const Params& p, const Rows& d, Acc& acc, const Crd& crd, const TileAt& t,
                                              SharedStorage& smem, int wgl, int tw) {
    const LogitRows& lr = p.rows;
    const int64_t n0 = t.n0, cols_left = lr.n - n0;
    add_bias(lr, acc, crd, n0, cols_left);
    const float W = p.scalars->weight_sum;
    const int c0 = get<1>(crd(0));
    int64_t tcol[2];  // the target's column relative to this tile's first
    int trel[2];      // and to this thread's first column (-1: not in the tile, or no target), as EpilogueStats
    ce::GradCoeffs g[2];
    float lse_l2[2], fill[2];
    bool valid[2];
    CUTE_UNROLL
    for (int i = 0; i < 2; ++i) {
      const ce::RowKind kind = d.t.kind(lr, i);
      valid[i] = kind == ce::RowKind::kValid;
      fill[i] = kind == ce::RowKind::kBad ? NAN : 0.f;
      tcol[i] = d.t.tcol(lr, i) - n0;
      trel[i] = valid[i] && tcol[i] - c0 >= 0 && tcol[i] - c0 < kBN ? static_cast<int>(tcol[i] - c0) : -1;
      // The class weight's load waits for the target's classification, here.
      g[i] = valid[i] ? ce::row_grad_coeffs(d.lse[i], ce::target_weight(lr.ce, d.t.t[i]), W, lr.ce.eps, lr.ce.inv_v,
                                            lr.ce.z, d.scale[i], d.zscale[i])
                      : ce::GradCoeffs{0.f, 0.f, 0.f};
      lse_l2[i] = valid[i] ? d.lse[i] * ce::kLog2e : 0.f;
    }
    Store::store(p.tma_dlogits, smem, wgl, tw, t.mt, t.nt, static_cast<int>(lr.m), static_cast<int>(lr.n), [&](int e) {
      const int i = (e >> 1) & 1, c = get<1>(crd(e));
      float v;
      if constexpr (kGeneral) {
        // grad_elem compares columns of the shard: shift both by the tile's first column. Columns past the end of
        // an edge tile have no class weight to read (and the TMA store clips them).
        v = kFull || c < cols_left ? ce::grad_elem(lr.ce, g[i], lse_l2[i], ce::capped(lr.ce, acc(e)), lr.col0 + n0 + c,
                                                   lr.col0 + n0 + tcol[i])
                                   : 0.f;
      } else {
        v = g[i].a * ce::fast_exp2(fmaf(acc(e), ce::kLog2e, -lse_l2[i]));
        if (c - c0 == trel[i]) v -= g[i].b;
      }
      return valid[i] ? v : fill[i];
    });
  }
};

}  // namespace logitless::lce::hopper
