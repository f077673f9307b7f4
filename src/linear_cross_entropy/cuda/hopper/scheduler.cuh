// The persistent tile order of the Hopper logits GEMM. A work unit is a pair of adjacent token tiles (one per CTA of
// a cluster) against one class tile; a cluster takes units blockIdx.x / kCluster, then every gridDim.x / kCluster.
// Units go in groups of kGroupTiles pairs, class tiles inner, so that a wave of clusters shares a few token and
// class tiles in L2.
#pragma once

#include <cstdint>

namespace logitless::lce::hopper {

template <int kBM, int kBN, int kCluster>
struct GroupedPairScheduler {
  static constexpr int kGroupTiles = 8;  // token-tile pairs per raster group

  struct Params {
    int pair_rows;  // pairs of token tiles, the last one possibly half past the end
    int num_n;      // class tiles
    int pairs;      // work units
  };

  static Params to_underlying_arguments(int64_t m, int64_t n) {
    const int num_m = static_cast<int>((m + kBM - 1) / kBM), num_n = static_cast<int>((n + kBN - 1) / kBN);
    const int pair_rows = (num_m + kCluster - 1) / kCluster;
    return {pair_rows, num_n, pair_rows * num_n};
  }
  static int64_t work_units(const Params& p) { return p.pairs; }

  struct Tile {
    int mt, nt;  // token tile (one past the last when their count is odd: nothing to store), class tile
  };

  __device__ __forceinline__ static int first_unit() { return static_cast<int>(blockIdx.x) / kCluster; }
  __device__ __forceinline__ static int unit_stride() { return static_cast<int>(gridDim.x) / kCluster; }

  // The tile of this CTA (rank in the cluster) in work unit u.
  __device__ __forceinline__ static Tile tile(const Params& p, int u, int rank) {
    const int per_group = kGroupTiles * p.num_n;
    const int g = u / per_group, first = g * kGroupTiles;
    const int rows = min(kGroupTiles, p.pair_rows - first);
    const int r = u - g * per_group;
    return {(first + r % rows) * kCluster + rank, r / rows};
  }
};

}  // namespace logitless::lce::hopper
