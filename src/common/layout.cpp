#include "common/layout.h"
#include "common/overlap.h"

#include <algorithm>
#include <numeric>

#include "common/check.h"

namespace logitless {

namespace {
// How many strided dimensions one tensor's leading dimensions collapse to on their own (as below, for k = 1).
int collapsed_alone(const int64_t* sizes, int nd, const int64_t* strides) {
  int count = 0;
  int64_t size = 0, stride = 0;
  for (int d = nd - 1; d >= 0; --d) {
    if (sizes[d] == 1) continue;
    if (count > 0 && strides[d] == stride * size) {
      size *= sizes[d];
    } else {
      ++count;
      size = sizes[d];
      stride = strides[d];
    }
  }
  return count;
}
}  // namespace

std::vector<RowLayout> collapse_rows(const int64_t* sizes, int nd, const std::vector<const int64_t*>& strides,
                                     const char* what) {
  const size_t k = strides.size();
  // Work innermost-first; drop size-1 dimensions (their strides are irrelevant).
  std::vector<int64_t> sz;
  std::vector<std::vector<int64_t>> st(k);
  for (int d = nd - 1; d >= 0; --d) {
    if (sizes[d] == 1) continue;
    bool merge = !sz.empty();
    for (size_t t = 0; merge && t < k; ++t) merge = strides[t][d] == st[t].back() * sz.back();
    if (merge) {
      sz.back() *= sizes[d];
    } else {
      sz.push_back(sizes[d]);
      for (size_t t = 0; t < k; ++t) st[t].push_back(strides[t][d]);
    }
  }
  if (static_cast<int>(sz.size()) > kMaxRowDims) {
    // The tensors of one call collapse jointly, and only `what` has a name here: say so when its own layout is
    // not the one at fault, rather than send its caller to copy the wrong tensor.
    if (k > 1 && collapsed_alone(sizes, nd, strides[0]) <= kMaxRowDims) {
      throw_invalid(str_cat(what, ": expected leading dimensions that collapse to at most ", kMaxRowDims,
                            " strided dimensions jointly with the tensors indexed by the same rows, got ", sz.size(),
                            " (", what,
                            " alone collapses far enough: another of them, e.g. the target, ids, residual"
                            " or gradient, is laid out differently; make that one contiguous first)"));
    }
    throw_invalid(str_cat(what, ": expected leading dimensions that collapse to at most ", kMaxRowDims,
                          " strided dimensions, got ", sz.size(), " (make the tensor contiguous first)"));
  }
  std::vector<RowLayout> out(k);
  for (size_t t = 0; t < k; ++t) {
    RowLayout& L = out[t];
    if (sz.empty()) {  // zero leading dimensions, or all of size 1: one row
      L.nd = 1;
      L.sizes[0] = 1;
      L.strides[0] = 0;
      continue;
    }
    L.nd = static_cast<int32_t>(sz.size());
    for (int d = 0; d < L.nd; ++d) {  // back to outermost-first
      L.sizes[d] = sz[L.nd - 1 - d];
      L.strides[d] = st[t][L.nd - 1 - d];
    }
  }
  return out;
}

bool rows_disjoint(const RowLayout& layout, int64_t row_extent) {
  std::vector<int> order(layout.nd);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int a, int b) { return layout.strides[a] < layout.strides[b]; });
  int64_t extent = row_extent;  // elements spanned by one step of the next-larger dimension must exceed this
  for (int i : order) {
    if (layout.sizes[i] <= 1) continue;
    if (layout.strides[i] < extent) return false;
    extent = layout.strides[i] * (layout.sizes[i] - 1) + extent;
  }
  return true;
}

int64_t uniform_row_stride(const TensorView& t, int nd, const char* what, int64_t extent) {
  int64_t rows = 1;
  for (int d = 0; d < nd; ++d) rows *= t.sizes[d];
  if (rows <= 1) return extent;
  const RowLayout L = collapse_rows(t.sizes, nd, {t.strides}, what)[0];
  return L.nd == 1 ? L.strides[0] : -1;
}

std::pair<const char*, const char*> byte_span(const TensorView& t) {
  if (!t.defined() || t.numel() == 0) return {nullptr, nullptr};
  int64_t hi = 0;
  for (int d = 0; d < t.ndim; ++d) hi += (t.sizes[d] - 1) * t.strides[d];
  const char* b = static_cast<const char*>(t.data);
  return {b, b + (hi + 1) * static_cast<int64_t>(dtype_size(t.dtype))};
}

void check_disjoint(const TensorView& out, const char* out_name, const TensorView& other, const char* other_name) {
  const auto a = byte_span(out), b = byte_span(other);
  if (!a.first || !b.first) return;
  LOGITLESS_CHECK_ARG(a.second <= b.first || b.second <= a.first, out_name,
                      str_cat("memory that does not overlap ", other_name), "an overlapping buffer");
}

void check_output_vs(const TensorView& out, const char* out_name, const TensorView& other, const char* other_name,
                     bool may_alias) {
  if (!other.defined()) return;
  if (may_alias && same_view(out, other)) return;
  if (views_disjoint(out, other)) return;
  throw_expected(out_name,
                 may_alias ? str_cat(other_name, " itself (in place) or memory that does not overlap ", other_name)
                           : str_cat("memory that does not overlap ", other_name),
                 "an overlapping buffer");
}

void check_outputs_apart(const std::vector<NamedView>& outputs, const std::vector<NamedView>& inputs) {
  for (auto o = outputs.begin(); o != outputs.end(); ++o) {
    for (const NamedView& i : inputs) check_disjoint(o->view, o->name, i.view, i.name);
    for (auto o2 = outputs.begin(); o2 != o; ++o2) check_disjoint(o->view, o->name, o2->view, o2->name);
  }
}

}  // namespace logitless
