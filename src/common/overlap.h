// Whether two strided views can share an element, finer than comparing byte ranges: the halves of a
// concatenated gate_up, or the q and k heads of one fused qkv projection, have interleaved rows whose byte
// ranges overlap though no element is shared. A sufficient test (false may mean "cannot tell").
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "common/layout.h"
#include "logitless/tensor.h"

namespace logitless {

// True when a and b share no element: their byte ranges are apart; or both have the same dtype and number of
// dimensions, the leading dimensions where they agree in size and stride (the "outer" ones: a row of both,
// e.g. batch and token) address windows that never meet, and inside one window the elements of a (offsets
// [0, extent of a's other dimensions)) and those of b (shifted by d = b - a) lie in disjoint intervals.
inline bool views_disjoint(const TensorView& a, const TensorView& b) {
  const auto sa = byte_span(a), sb = byte_span(b);
  if (!sa.first || !sb.first || sa.second <= sb.first || sb.second <= sa.first) return true;
  if (a.dtype != b.dtype || a.ndim != b.ndim || a.ndim < 1) return false;
  const int64_t es = dtype_size(a.dtype);
  const int64_t bytes = static_cast<const char*>(b.data) - static_cast<const char*>(a.data);
  if (bytes % es != 0) return false;
  const int64_t d = bytes / es;
  std::vector<std::pair<int64_t, int64_t>> outer;  // (stride, size)
  int64_t ext_a = 1, ext_b = 1;                    // elements spanned by the other dimensions
  for (int i = 0; i < a.ndim; ++i) {
    if (a.strides[i] < 0 || b.strides[i] < 0) return false;
    const bool shared = i < a.ndim - 1 && a.sizes[i] == b.sizes[i] && a.strides[i] == b.strides[i];
    if (shared) {
      if (a.sizes[i] > 1) outer.push_back({a.strides[i], a.sizes[i]});
    } else {
      ext_a += (a.sizes[i] - 1) * a.strides[i];
      ext_b += (b.sizes[i] - 1) * b.strides[i];
    }
  }
  if (!(ext_a <= d || d + ext_b <= 0)) return false;                      // inside a window the two intervals meet
  int64_t extent = std::max(ext_a, d + ext_b) - std::min<int64_t>(0, d);  // the window
  std::sort(outer.begin(), outer.end());
  for (const auto& [stride, size] : outer) {
    if (stride < extent) return false;
    extent += stride * (size - 1);
  }
  return true;
}

// The same elements in the same order: a kernel that reads each element before the same thread writes it may
// take `b` as `a`'s output.
inline bool same_view(const TensorView& a, const TensorView& b) {
  if (a.data != b.data || a.ndim != b.ndim || a.dtype != b.dtype) return false;
  for (int d = 0; d < a.ndim; ++d)
    if (a.sizes[d] != b.sizes[d] || (a.sizes[d] != 1 && a.strides[d] != b.strides[d])) return false;
  return true;
}

// An output against one input (absent: nothing to check): it may be that input itself where `may_alias` (the op
// writes in place), and must share no element with it otherwise. Throws naming the output.
void check_output_vs(const TensorView& out, const char* out_name, const TensorView& other, const char* other_name,
                     bool may_alias);

}  // namespace logitless
