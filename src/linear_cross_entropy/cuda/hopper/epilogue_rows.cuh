// What the cross-entropy epilogues of the Hopper logits GEMM share. A consumer thread holds two rows of the tile
// (r and r + 8 of its warp's 16) and 64 columns (pairs at 8-column steps): the accumulator layout of WGMMA. Row
// statistics reduce over the 4 lanes that share a row. The tensor cores wait for the epilogue: it costs its own
// length per tile, so it is kept short (no masks in interior tiles, independent chains, row data loaded ahead of
// it).
#pragma once

#include <cute/tensor.hpp>

#include <cstdint>

#include "cross_entropy/cuda/device.cuh"
#include "linear_cross_entropy/cuda/dtype_io.cuh"
#include "linear_cross_entropy/cuda/hopper/mainloop.cuh"  // kBM, kBN
#include "logitless/tensor.h"

namespace logitless::lce::hopper {

constexpr int kLanes = 4;  // independent accumulation chains per row in the epilogues

// The logits of a launch: tokens [0, m) against classes col0 .. col0 + n (relative to ce.vocab_offset).
struct LogitRows {
  int64_t m = 0, n = 0;
  int64_t col0 = 0;
  const void* bias = nullptr;  // bias[(col0 + c) * bias_stride] or nullptr
  DType bias_dtype = DType::kFloat32;
  int64_t bias_stride = 1;
  const int64_t* target = nullptr;  // [m]
  ce::KernelParams ce;              // ignore_index, vocab_total, vocab_offset, eps, inv_v, z, softcap, weight

  __host__ __device__ int64_t col_tiles() const { return (n + kBN - 1) / kBN; }
};

__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xFFFFFFFFu, v, 1);
  return v + __shfl_xor_sync(0xFFFFFFFFu, v, 2);
}

// The tile at hand: token tile mt (rows m0 ..), class tile nt (columns n0 ..).
struct TileAt {
  int mt, nt;
  int64_t m0, n0;
};

// The thread's two rows and their targets, loaded ahead of the epilogue (kernel_common.cuh) and classified in it:
// nothing uses a loaded value before the epilogue, so the loads have the tile's k loop to land.
struct RowTargets {
  int row[2];    // within the tile
  int64_t t[2];  // as loaded; ignore_index for rows past the last

  __device__ __forceinline__ ce::RowKind kind(const LogitRows& p, int i) const { return ce::classify(p.ce, t[i]); }
  // The target's column relative to column 0 of this launch (any value unless the row is valid).
  __device__ __forceinline__ int64_t tcol(const LogitRows& p, int i) const {
    return ce::target_column(p.ce, t[i]) - p.col0;
  }
};

// more(i, r): an epilogue's own loads for row i (global row r) when it is in the problem; loads that depend on the
// target wait for the epilogue, where it is classified.
template <class Crd, class More>
__device__ __forceinline__ RowTargets load_row_targets(const LogitRows& p, const Crd& crd, int64_t m0, More&& more) {
  RowTargets d;
  const int64_t rows_left = p.m - m0;
  CUTE_UNROLL
  for (int i = 0; i < 2; ++i) {
    d.row[i] = get<0>(crd(2 * i));
    d.t[i] = p.ce.ignore_index;
    if (d.row[i] < rows_left) {
      const int64_t r = m0 + d.row[i];
      d.t[i] = p.target[r];
      more(i, r);
    }
  }
  return d;
}

// The accumulators plus the bias: the raw logits, as the generic path's GEMM writes them.
template <class Acc, class Crd>
__device__ __forceinline__ void add_bias(const LogitRows& p, Acc& acc, const Crd& crd, int64_t n0, int64_t cols_left) {
  if (!p.bias) return;
  const int64_t col = p.col0 + n0;  // of the tile's column 0
  CUTE_UNROLL
  for (int e = 0; e < size(acc); ++e) {
    const int c = get<1>(crd(e));
    if (c < cols_left) acc(e) += load_as_float(p.bias, p.bias_dtype, (col + c) * p.bias_stride);
  }
}

// Per (row, class tile) statistics into partials [m, col_tiles] of records V (float4, or the exponential form's
// float2: plan.h, kExpStatsFloats), from the lane that holds column 0 of the row.
template <typename V>
__device__ __forceinline__ void store_tile_stats(const LogitRows& p, float* partials, const RowTargets& d, int i,
                                                 int64_t m0, int nt, V v) {
  if ((threadIdx.x & 3) == 0 && d.row[i] < p.m - m0)
    reinterpret_cast<V*>(partials)[(m0 + d.row[i]) * p.col_tiles() + nt] = v;
}

}  // namespace logitless::lce::hopper
