// Host-side pieces every linear head plans with (no CUDA calls, so CPU tests can check them): the gradient
// kernels' row blocks, cuBLAS's workspace, and the workspace composed stage by stage.
//
// A workspace is a sequence of stages. A stage is a small type that knows its regions: it declares their bytes for
// a problem and then carves them from the caller's buffer, in the same order, through one WorkspaceLayout:
//
//   struct MyStage {
//     float* rows = nullptr;                                    // float32 [n]
//     void declare(WorkspaceLayout& L, int64_t n) { L.add(&rows, n * 4); }
//   };
//   WorkspaceLayout L;  stage_a.declare(L, ...); stage_b.declare(L, ...);   // L.bytes(): the workspace size
//   L.carve(ws);                                                           // every declared pointer set
//
// so a stage's bytes and its pointers cannot disagree, and a loss adds its own stage without touching the others.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace logitless::head {

// Rows per CTA of the gradient kernels: their bias-gradient partial sums are one float32 row of the chunk's width
// per 32 rows, small enough to keep (a 256-token chunk of V=128256: 4 MB) while a 256-token chunk still gives 8
// CTAs per 1024 columns, about 1000 CTAs at V=128256.
inline constexpr int64_t kGradRowsPerBlock = 32;

// cuBLAS's recommended workspace: 32 MiB on Hopper and later, 4 MiB before.
inline size_t cublas_workspace_for(int sm_major) { return sm_major >= 9 ? size_t{32} << 20 : size_t{4} << 20; }

class WorkspaceLayout {
 public:
  static constexpr size_t kNone = ~size_t{0};
  // Reserves `bytes` (rounded up to 256) and returns the region's offset.
  size_t add(size_t bytes) {
    const size_t at = end_;
    end_ += (bytes + 255) / 256 * 256;
    return at;
  }
  // The same, and `*ptr` set to the region when carve() runs. bytes 0: no region, *ptr stays nullptr.
  template <typename T>
  size_t add(T** ptr, size_t bytes) {
    if (bytes == 0) return kNone;
    const size_t at = add(bytes);
    slots_.push_back({reinterpret_cast<void**>(ptr), at});
    return at;
  }
  // A pointer to a region declared before (regions that take turns share one).
  template <typename T>
  void alias(T** ptr, size_t at) {
    if (at != kNone) slots_.push_back({reinterpret_cast<void**>(ptr), at});
  }
  size_t bytes() const { return end_; }
  void carve(void* ws) const {
    for (const Slot& s : slots_) *s.ptr = static_cast<char*>(ws) + s.at;
  }

 private:
  struct Slot {
    void** ptr;
    size_t at;
  };
  size_t end_ = 0;
  std::vector<Slot> slots_;
};

}  // namespace logitless::head
