// Launch shapes of the RMSNorm kernels: pure host functions (no CUDA calls) so that a CPU test can check
// every decision. The launchers add only what needs the device: its SM count and the occupancy of the
// chosen kernel.
#pragma once

#include <cstddef>
#include <cstdint>

#include "logitless/rms_norm.h"

namespace logitless::rms {

// The register-path instantiations: 16-byte vectors per thread per row. The list is the one place they
// are named; the launchers' switches cover exactly these.
inline constexpr int kVectorsPerThread[] = {4, 8};
inline constexpr int kDefaultVectorsPerThread = 4;

// Largest CTA each register kernel is compiled for (its __launch_bounds__). The forward at 4 vectors keeps
// a row in 16 registers, so a 1024-thread CTA (64 registers a thread) still fits; the backward holds x, dy
// and float32 dW sums (16 registers per bf16 vector), so it is bounded at 512 (128 registers) and 256 for
// 8 vectors.
constexpr int max_cta_threads(bool backward, int vpt) {
  return backward ? (vpt <= 4 ? 512 : 256) : (vpt <= 4 ? 1024 : 512);
}

// Target CTA sizes: the forward launches one row group per CTA and relies on many small, independent CTAs
// per SM. Registers are allocated per warp (56 a thread for the 4-vector forward on sm_90a, so 36 warps fit):
// 128-thread CTAs fill 36 warps where 256-thread ones stop at 32. The backward is persistent and combines
// the dW sums of its rows in shared memory at the end, so larger CTAs mean fewer partial rows in the
// workspace.
inline constexpr int kForwardCtaThreads = 128;
inline constexpr int kBackwardCtaThreads = 512;
inline constexpr int kGenericCtaThreads = 256;
inline constexpr int kGenericElemsPerThread = 8;  // generic path: elements each thread owns per pass

// Rows of more than a warp synchronize on named barrier 1 + row (0 is __syncthreads; the hardware has 16).
inline constexpr int kMaxNamedBarrierRows = 15;

struct Plan {
  RMSNormAlgo algo = RMSNormAlgo::kGeneric;  // kAuto: the request cannot be met (see why_not)
  int vpt = 0;              // registers: 16-byte vectors each thread holds per row
  int threads_per_row = 1;  // blockDim.x: a power of two up to 32, else a multiple of 32
  int rows_per_cta = 1;     // blockDim.y
  size_t smem_bytes = 0;    // dynamic shared memory per CTA
  bool dw_in_smem = false;  // generic backward: each row slot's dW sums in shared memory (else the workspace)
  const char* why_not = nullptr;

  int threads() const { return threads_per_row * rows_per_cta; }
};

struct PlanInputs {
  int64_t hidden = 0;
  int elem_bytes = 2;
  bool backward = false;
  bool vector_ok = false;  // every row of every tensor starts 16-byte aligned and H is a whole number of vectors
  RMSNormAlgo requested = RMSNormAlgo::kAuto;
  int vpt = 0;             // requested vectors per thread; 0 = auto
  int smem_per_block = 48 * 1024;  // dynamic shared memory a CTA may opt into
};

Plan plan_rms_norm(const PlanInputs& in);

// The persistent backward grid: as many CTAs as fit on the device at once, but no more than the rows need,
// and sized so that every CTA runs the same number of row iterations where the rows allow it (16384 rows on
// 1056 slots would otherwise leave 3% of the time to a last, partly empty iteration).
struct BackwardGrid {
  int64_t ctas = 0;
  int64_t partial_rows = 0;  // float32 rows of H in the workspace: one per CTA, or one per row slot
};
BackwardGrid backward_grid(const Plan& plan, int64_t n_rows, int sm_count, int ctas_per_sm);

// Workspace rows are padded to a multiple of 4 floats so that each row is 16-byte aligned.
inline int64_t workspace_row_stride(int64_t hidden) { return (hidden + 3) / 4 * 4; }
inline size_t workspace_bytes(const BackwardGrid& g, int64_t hidden) {
  return static_cast<size_t>(g.partial_rows) * static_cast<size_t>(workspace_row_stride(hidden)) * sizeof(float);
}

}  // namespace logitless::rms
