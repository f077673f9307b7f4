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
// so a stage's bytes and its pointers cannot disagree (the workspace query and the run declare the same way), and
// a loss adds its own stage without touching the others. HeadBuffers below is the engine's stage.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace logitless::head {

// Rows per CTA of the gradient kernels: their bias-gradient partial sums are one float32 row of the chunk's width
// per 32 rows, small enough to keep (a 256-token chunk of V=128256: 4 MB) while a 256-token chunk still gives 8
// CTAs per 1024 columns, about 1000 CTAs at V=128256.
inline constexpr int64_t kGradRowsPerBlock = 32;

// cuBLAS's recommended workspace: 32 MiB on Hopper and later, 4 MiB before.
inline size_t cublas_workspace_for(int sm_major) { return sm_major >= 9 ? size_t{32} << 20 : size_t{4} << 20; }

// A chunk length from a byte count: whole multiples of 128 rows (a GEMM tile edge) once there is room for 128,
// otherwise whatever fits, and at least 1 (a budget smaller than one row still makes progress).
int64_t fit_rows(size_t bytes, int64_t per_item);

// Token chunks of whole rows (a row's statistics need all of its V logits) and the groups of them whose gradient
// is held for one grad_hidden / grad_weight GEMM pair.
struct ChunkInputs {
  int64_t n = 0;             // rows
  int64_t chunk_tokens = 0;  // the caller's chunk (0: from the budget); with groups, the group's rows
  size_t memory_budget = 0;
  int64_t group_row_bytes = 0;       // a row of the group's gradient buffer; 0: none (forward, or in place)
  size_t dw_accumulator_bytes = 0;   // the float32 grad_weight accumulator several groups would need (0: none)
  bool float32_grad_weight = false;  // grad_weight is float32 and takes the groups' sums itself (group_min_rows)
};
struct ChunkPlan {
  int64_t chunk_rows = 0, group_rows = 0;
};
// chunk_row_bytes: what a chunk holds per row (float32 logits, or a fused kernel's statistics).
ChunkPlan plan_token_chunks(const ChunkInputs& in, int64_t chunk_row_bytes);

// Where a float32 grad_weight takes the sums of several token groups itself, each group's grad_weight product
// reads and writes all of it (8 V H bytes) for 2 V H FLOPs a token, so short groups spend their passes on memory
// (bench/RESULTS.md, twelfth and sixteenth sessions). A group shorter than this from the budget grows toward it, as
// far as `stretched` (the rows that twice_budget holds) allows: group_min_rows(fit, stretched).
inline constexpr int64_t kFloat32SumsGroupRows = 2048;
inline int64_t group_min_rows(int64_t fit, int64_t stretched) {
  return fit >= kFloat32SumsGroupRows ? fit : std::max(fit, std::min(kFloat32SumsGroupRows, stretched));
}
// Twice a budget, saturating: how far a plan may stretch it (the groups above, and the linear cross-entropy's
// exponentials in grad_weight's storage).
inline size_t twice_budget(size_t budget) { return budget > SIZE_MAX / 2 ? SIZE_MAX : 2 * budget; }
// Token groups of `row` bytes a row beside `used` bytes of the budget (a float32 logits chunk, or the steps' two
// slots): as many as the rest holds, and where a float32 grad_weight takes the groups' sums (float32_sums), grown
// toward kFloat32SumsGroupRows as far as the rest of twice the budget holds (group_min_rows).
int64_t group_fit(size_t budget, size_t used, int64_t row, bool float32_sums);

// grad_weight's float32 sums over token groups, in up to two parts: rows [0, split) in the workspace, rows
// [split, v) at the start of a 16-bit grad_weight's own storage, which holds nothing else until the sums are cast
// into it at the end. That cast writes the tail's 16-bit rows first, then the head's (engine.h, Engine::finish).
// With `written`, the last group's products write the 16-bit rows themselves instead, the tail's first, then the
// head's rows [0, written): rows whose storage holds nothing the group still reads once the tail's product has read
// its sums. The head's other rows are cast at the end.
struct DwAccumulator {
  float* head = nullptr;  // rows [0, split), row stride h; nullptr: no accumulator
  float* tail = nullptr;  // rows [split, v), row stride h; nullptr where split == v
  int64_t split = 0;
  int64_t written = 0;  // 0: every row cast at the end
  explicit operator bool() const { return head != nullptr; }
  int64_t head_rows(int64_t v) const { return tail ? split : v; }  // rows [0, head_rows) at head
  // The head's rows [0, k) that the products of token group [g0, g0 + rows) of n write into grad_weight: `written`
  // for the last group where there are several (the first group's products set the sums; they write nothing), else
  // 0. The one place that recognises that group.
  int64_t rows_written_by(int64_t g0, int64_t rows, int64_t n, int64_t v) const {
    return g0 > 0 && g0 + rows == n ? std::min(written, head_rows(v)) : 0;
  }
};

// The most rows of float32 sums (a tail, as above) that a 16-bit grad_weight [v, h] with contiguous rows holds in
// `bytes` of its storage from its first 256-aligned byte: whole 128-row tiles from the end, no more than fit, and
// only as many as leave the tail's float32 copy ending before the 16-bit rows it is cast into begin (the tail's
// cast then overwrites none of it; `bytes` is at most the storage less 256, so the copy starts within 255 bytes
// of the rows' start).
int64_t accumulator_tail_rows(int64_t v, int64_t h, size_t bytes);

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
    slots_.push_back({reinterpret_cast<void**>(ptr), at, bytes});
    return at;
  }
  // A pointer to a region declared before (regions that take turns share one).
  template <typename T>
  void alias(T** ptr, size_t at) {
    if (at != kNone) slots_.push_back({reinterpret_cast<void**>(ptr), at, 0});
  }
  size_t bytes() const { return end_; }
  // Every declared pointer set to its region of `ws` (address arithmetic only: a test may carve a fake base).
  void carve(void* ws) const {
    for (const Slot& s : slots_) *s.ptr = reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(ws) + s.at);
  }
  // The regions (offset, bytes) in declaration order, aliases left out.
  std::vector<std::pair<size_t, size_t>> regions() const {
    std::vector<std::pair<size_t, size_t>> r;
    for (const Slot& s : slots_)
      if (s.bytes) r.push_back({s.at, s.bytes});
    return r;
  }

 private:
  struct Slot {
    void** ptr;
    size_t at, bytes;
  };
  size_t end_ = 0;
  std::vector<Slot> slots_;
};

// The engine's stage (engine.h): cuBLAS's workspace, hidden's contiguous copy, the float32 logits (a chunk, the
// steps' two slots, or a backward's vocabulary chunk), the logits' gradient in the GEMMs' dtype, and the float32
// sums. A loss's planner sizes each region (0: absent) and declares the stage among its own.
struct HeadBytes {
  size_t cublas = 0, hidden = 0, logits = 0, dlogits = 0, dw_acc = 0, dx_acc = 0, db = 0, db_partial = 0;
};
struct HeadBuffers {
  void* cublas = nullptr;
  void* hidden = nullptr;
  float* logits = nullptr;
  void* dlogits = nullptr;
  float* dw_acc = nullptr;  // [v, h]
  float* dx_acc = nullptr;  // [n, h]
  float* db = nullptr;      // [v]
  float* db_partial = nullptr;
  void declare(WorkspaceLayout& L, const HeadBytes& n) {
    L.add(&cublas, n.cublas);
    L.add(&hidden, n.hidden);
    L.add(&logits, n.logits);
    L.add(&dlogits, n.dlogits);
    L.add(&dw_acc, n.dw_acc);
    L.add(&dx_acc, n.dx_acc);
    L.add(&db, n.db);
    L.add(&db_partial, n.db_partial);
  }
};

}  // namespace logitless::head
