// Launch shapes of the RMSNorm kernels: pure host functions (no CUDA calls) so that a CPU test can check
// every decision. The launchers add only what needs the device: its SM count and the occupancy of the
// chosen kernel.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/debug_hooks.h"
#include "logitless/rms_norm.h"

namespace logitless::rms {

// Values of RMSNormOptions::vectors_per_thread a caller may force (each has a forward and a backward
// register kernel).
inline constexpr int kVectorsPerThread[] = {4, 8};

// The register-path instantiations: 16-byte vectors per thread per row, and whether the thread issues the
// loads of its next row before it reduces the current one (then it holds two rows: more bytes in flight
// per SM, twice the registers). The lists are the one place they are named; the launchers' switches cover
// exactly these.
// smem_dw (backward only): the dW sums live in shared memory and the weight is read from L1 where used, so a
// thread holds only x and dy (and the residual-output gradient) and more rows fit on an SM.
struct KernelVariant {
  int vpt;
  bool prefetch;
  bool smem_dw = false;
};
inline constexpr KernelVariant kForwardVariants[] = {{4, false}, {8, false}, {16, false}, {4, true}, {8, true}};
inline constexpr KernelVariant kBackwardVariants[] = {{4, false}, {8, false},      {2, true},
                                                      {4, true},  {4, true, true}, {8, false, true}};
bool instantiated(bool backward, int vpt, bool prefetch, bool smem_dw = false);

// Registers a thread of each register kernel may use (its __maxnreg__), and so its largest CTA. The data a
// thread holds, in 32-bit registers per 16-byte vector: forward x (4) and, with a fused residual, the
// residual (4) per row held, and the weight (4); backward x and dy (8) and, with a residual, the
// residual-output gradient (4) per row held, 8 float32 dW sums and the weight (4). Prefetching kernels hold
// two rows. Each kernel is built with and without the residual: one built for both would size its registers
// (and so cap its occupancy) for the residual's data even where there is none, leaving the plain norm with
// half the bytes in flight per SM of the fused one. The rest (addresses, loop state, one vector's unpacked
// floats) fits in 48 registers in the fused forward, 56 in the plain one and 64 in the backward: ptxas -v
// (CUDA 13, sm_90a) shows no spills at these caps but 4 to 8 bytes in the plain forward of fp16 at 4 vectors
// and of float32 at 8, and in the fused 8-vector backward of 16-bit x (at the 255 ceiling).
// A lower cap would mean more resident warps, but ptxas uses what it is given.
// With smem_dw the backward holds neither dW sums nor the weight.
constexpr int register_cap(bool backward, int vpt, bool prefetch, bool residual, bool smem_dw = false) {
  const int rows_held = prefetch ? 2 : 1;
  const int per_row = backward ? (residual ? 12 : 8) : (residual ? 8 : 4);
  const int data = vpt * (per_row * rows_held + (backward ? (smem_dw ? 0 : 12) : 4));
  const int cap = (data + (backward ? 64 : residual ? 48 : 56) + 7) / 8 * 8;
  return cap < 255 && vpt < 16 ? cap : 255;
}
constexpr int max_cta_threads(bool backward, int vpt, bool prefetch, bool residual, bool smem_dw = false) {
  const int threads = 65536 / register_cap(backward, vpt, prefetch, residual, smem_dw) / 32 * 32;
  return threads < 1024 ? threads : 1024;
}

// The default register variant for a pass, by whether a residual is fused and by the row's bytes: the
// fastest of bench/cpp/bench_rms_norm.cu's variants on an H100 (bf16, N = 16384, H = 2048 / 4096 / 8192,
// i.e. rows of 4 / 8 / 16 KB). cta_threads is the CTA size aimed at (rows_per_cta = cta_threads / threads
// a row, capped by the kernel's registers); persistent: the forward's CTAs loop over the row groups (a grid
// of as many CTAs as fit), which a prefetching forward needs to have a next row. The backward is always
// persistent. Rows the variant cannot hold fall back to the same width without prefetch, then wider ones (with
// the default's dW placement, then with dW in registers).
struct DefaultVariant {
  int vpt;
  bool prefetch;
  int cta_threads;
  bool persistent;
  bool smem_dw = false;  // backward: the kernel that sums dW in shared memory
};
DefaultVariant default_variant(bool backward, bool residual, int64_t row_bytes);
inline constexpr int kPersistentCtasPerSm = 64;  // "as many as fit": the occupancy bounds it first
inline constexpr int kGenericCtaThreads = 256;
inline constexpr int kGenericElemsPerThread = 8;  // generic path: elements each thread owns per pass

// Rows of more than a warp synchronize on named barrier 1 + row (0 is __syncthreads; the hardware has 16).
inline constexpr int kMaxNamedBarrierRows = 15;

struct Plan {
  RMSNormAlgo algo = RMSNormAlgo::kGeneric;  // kAuto: the request cannot be met (see why_not)
  int vpt = 0;                               // registers: 16-byte vectors each thread holds per row
  bool prefetch = false;                     // registers: the next row's loads are issued before this row is reduced
  int threads_per_row = 1;                   // blockDim.x: a power of two up to 32, else a multiple of 32
  int rows_per_cta = 1;                      // blockDim.y
  // CTAs per SM of a persistent grid (the CTAs loop over the rows): 0 = forward: no loop, one CTA per row
  // group; backward: as many as fit. Otherwise at most this many (and at most what fits).
  int ctas_per_sm = 0;
  size_t smem_bytes = 0;  // dynamic shared memory per CTA
  // Backward: each row slot's dW sums in shared memory (generic: else in its workspace row; registers: the
  // smem_dw kernel, else the sums are in registers).
  bool dw_in_smem = false;
  const char* why_not = nullptr;

  int threads() const { return threads_per_row * rows_per_cta; }
};

struct PlanInputs {
  int64_t hidden = 0;
  int elem_bytes = 2;
  bool backward = false;
  bool vector_ok = false;  // every row of every tensor starts 16-byte aligned and H is a whole number of vectors
  bool residual = false;   // forward: a residual is added; backward: a residual-output gradient is added
  RMSNormAlgo requested = RMSNormAlgo::kAuto;
  int vpt = 0;                     // requested vectors per thread; 0 = auto
  int smem_per_block = 48 * 1024;  // dynamic shared memory a CTA may opt into
};

Plan plan_rms_norm(const PlanInputs& in);

// nullptr when the kernels can run `p` for these inputs (a plan the planner made, or one a debug hook
// rewrote), else why not. Sets nothing; the launchers refuse a plan with a reason.
const char* plan_error(const Plan& p, const PlanInputs& in);

// Dynamic shared memory a plan needs: backward register CTAs of several rows add their dW sums in one shared
// row of H floats; the generic backward with dw_in_smem one row per slot.
size_t plan_smem_bytes(const Plan& p, const PlanInputs& in);

// A persistent grid: as many CTAs as fit on the device at once, but no more than the rows need, and sized
// so that every CTA runs the same number of row iterations where the rows allow it (16384 rows on 1056
// slots would otherwise end with a 16th iteration that is half empty).
struct PersistentGrid {
  int64_t ctas = 0;
  int64_t partial_rows = 0;  // backward: float32 rows of H in the workspace: one per CTA, or one per row slot
};
PersistentGrid persistent_grid(const Plan& plan, int64_t n_rows, int sm_count, int ctas_per_sm);

// Workspace rows are padded to a multiple of 4 floats so that each row is 16-byte aligned.
inline int64_t workspace_row_stride(int64_t hidden) { return (hidden + 3) / 4 * 4; }
inline size_t workspace_bytes(const PersistentGrid& g, int64_t hidden) {
  return static_cast<size_t>(g.partial_rows) * static_cast<size_t>(workspace_row_stride(hidden)) * sizeof(float);
}

// Benchmark and test hooks (not part of the public API): a function that may rewrite each plan before it is
// checked (plan_error) and launched, and what the last launch of each pass ran. The backward applies the
// hook to its workspace query too, so the two agree while the hook stays the same.
namespace debug {
using PlanHook = void (*)(Plan& plan, const PlanInputs& in);
inline logitless::debug::Slot<PlanHook> plan_hook;
struct LaunchRecord {
  Plan plan;
  int64_t ctas = 0;
};
inline logitless::debug::Slot<LaunchRecord> last_forward, last_backward;
}  // namespace debug

}  // namespace logitless::rms
