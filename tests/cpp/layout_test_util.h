// A linear head's plan with its workspace carved at a fake base (addresses only, never dereferenced): every stage's
// pointers become offsets from it, and the regions are listed. Shared by the linear cross-entropy, vocabulary-parallel
// and linear policy-loss plan tests.
#pragma once

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "linear_head/cuda/plan.h"

namespace logitless::test {

inline constexpr uintptr_t kFakeBase = uintptr_t{1} << 40;
inline constexpr size_t kNone = ~size_t{0};
inline size_t off(const void* ptr) {
  return ptr ? static_cast<size_t>(reinterpret_cast<uintptr_t>(ptr) - kFakeBase) : kNone;
}

template <class PlanT, class BuffersT>
struct LaidPlan : PlanT {
  BuffersT b;
  std::vector<std::pair<size_t, size_t>> regions;
};

template <class PlanT, class BuffersT, class InputsT>
LaidPlan<PlanT, BuffersT> lay_plan(const InputsT& in, PlanT (*plan)(const InputsT&),
                                   void (*declare)(const InputsT&, const PlanT&, head::WorkspaceLayout&, BuffersT*)) {
  LaidPlan<PlanT, BuffersT> l;
  static_cast<PlanT&>(l) = plan(in);
  head::WorkspaceLayout L;
  declare(in, l, L, &l.b);
  L.carve(reinterpret_cast<void*>(kFakeBase));
  l.regions = L.regions();
  EXPECT_EQ(L.bytes(), l.bytes);
  return l;
}

}  // namespace logitless::test
