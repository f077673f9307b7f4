// Row addressing for tensors shaped [*, V]: the leading dimensions are collapsed jointly across the
// tensors of one call (two adjacent dimensions merge only where they merge in every tensor), and what
// remains (at most kMaxRowDims) maps a flat row index to an element offset. This is what lets the
// shifted view logits[:, :-1, :] of a [B, T+1, V] tensor, and its targets[:, 1:], go in without a copy.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "common/macros.h"
#include "logitless/tensor.h"

namespace logitless {

inline constexpr int kMaxRowDims = 3;

struct RowLayout {
  int32_t nd = 1;                          // 1..kMaxRowDims
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

// The one stride of the rows of `t`'s `nd` leading dimensions when they collapse to a single strided dimension,
// or -1. A tensor of one row (or none) may give its rows any stride: `extent` stands in.
int64_t uniform_row_stride(const TensorView& t, int nd, const char* what, int64_t extent);

// [first, last) bytes a view can touch (both null for no elements).
std::pair<const char*, const char*> byte_span(const TensorView& t);

// Throws an invalid-argument Error naming `out_name` when `out` shares memory with `other`.
void check_disjoint(const TensorView& out, const char* out_name, const TensorView& other, const char* other_name);

// A call's outputs against its inputs: no output may share memory with an input or with another output, since the
// kernels read the inputs while they write (absent views pass). Throws naming the output. An output an op may
// write in place of an input (a gradient over the logits) is checked against that input by the op itself and left
// out of `inputs` here.
struct NamedView {
  const TensorView& view;
  const char* name;
};
void check_outputs_apart(const std::vector<NamedView>& outputs, const std::vector<NamedView>& inputs);

}  // namespace logitless
