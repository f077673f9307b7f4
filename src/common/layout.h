// Row addressing for tensors shaped [*, V]: the leading dimensions are collapsed jointly across the
// tensors of one call (two adjacent dimensions merge only where they merge in every tensor), and what
// remains (at most kMaxRowDims) maps a flat row index to an element offset. This is what lets the
// shifted view logits[:, :-1, :] of a [B, T+1, V] tensor, and its targets[:, 1:], go in without a copy.
#pragma once

#include <cstdint>
#include <vector>

#include "common/macros.h"
#include "logitless/tensor.h"

namespace logitless {

inline constexpr int kMaxRowDims = 3;

struct RowLayout {
  int32_t nd = 1;                       // 1..kMaxRowDims
  int64_t sizes[kMaxRowDims] = {1, 1, 1};  // outermost first
  int64_t strides[kMaxRowDims] = {0, 0, 0};

  // Element offset of flat row `row` (row-major over sizes). All int64: N * V > 2^31 is normal.
  LOGITLESS_HD int64_t offset(int64_t row) const {
    if (nd == 1) return row * strides[0];
    int64_t off = 0;
    for (int d = nd - 1; d > 0; --d) {
      const int64_t q = row / sizes[d];
      off += (row - q * sizes[d]) * strides[d];
      row = q;
    }
    return off + row * strides[0];
  }
};

// Collapses the `nd` leading dimensions `sizes` shared by several tensors, each given by its strides over
// those dimensions, into one RowLayout per tensor. Throws (naming `what`) when more than kMaxRowDims
// dimensions remain.
std::vector<RowLayout> collapse_rows(const int64_t* sizes, int nd, const std::vector<const int64_t*>& strides,
                                     const char* what);

// True when no two rows of `layout` (each `row_extent` elements long, stride 1) share an element.
bool rows_disjoint(const RowLayout& layout, int64_t row_extent);

}  // namespace logitless
