// Tile choices for the policy-loss row kernel: one pure host function (no CUDA calls) so that a CPU test can
// check every decision.
#pragma once

#include <cstdint>

#include "logitless/policy_loss.h"

namespace logitless::pl {

inline constexpr int kMaxThreads = 512;  // the kernel's __launch_bounds__
inline constexpr int kMaxCluster = 16;   // above 8 needs the non-portable cluster size (H100 allows 16)

// The L2 budget for the rows a cluster kernel holds between its two passes, per SM: the gradient pass re-reads a
// CTA's slice, and that read comes from L2 only if every slice in flight on the GPU still fits there. 160 KB per
// SM is 21 MB on an H100's 132 SMs, under half of its 50 MB L2; the rest holds the gradient's dirty lines on their
// way to HBM. (A first choice from that budget; bench/cpp/bench_policy_loss.cu sweeps the alternatives.)
inline constexpr int64_t kSliceBudgetPerSm = 160 * 1024;
// Below this many bytes per row the streaming kernel's second read hits L2 already (8 rows of 64 KB per SM are
// 68 MB in flight on an H100 only at full occupancy, and a row that short is read in microseconds).
inline constexpr int64_t kClusterMinRowBytes = 64 * 1024;

// The row-resident kernel (kernels_row_resident.cu) keeps each CTA's slice of a row in shared memory: 1 read + 1 write
// of the row in the fused pass. Its plan follows the one the cross-entropy kernel settled on (bench/RESULTS.md):
// one stage per CTA, the smallest cluster whose slice lets two CTAs share an SM, 256 threads, well ahead of two
// reads through L2.
inline constexpr int kResidentMaxThreads = 256;  // its __launch_bounds__ (two CTAs per SM: up to 128 registers)
inline constexpr int kResidentMaxStages = 4;     // rows in flight per CTA (more than one only for short rows)
// Shared memory a resident CTA costs beyond its stages: its static shared memory (under 1 KB) and the 1 KB the
// driver reserves per CTA, rounded up.
inline constexpr int64_t kResidentReserve = 4096;

struct RowsPlan {
  PolicyLossAlgo algo = PolicyLossAlgo::kStreaming;  // kAuto: the request cannot run here (the caller raises)
  int cluster = 1;                                   // CTAs sharing a row
  int threads = 256;                                 // per CTA
  int64_t slice = 0;                                 // elements of a row per CTA (the vocabulary without a cluster)
  // Row-resident only: shared-memory stages per CTA (one row slice each), bytes per stage and in all.
  int stages = 0;
  int64_t stage_bytes = 0;
  int64_t smem_bytes = 0;
};

struct RowsPlanInputs {
  int64_t vocab = 0;
  int elem_bytes = 2;
  bool fused = false;             // statistics and gradient in one pass over each row (the only case a cluster helps)
  bool cluster_capable = false;   // the device and this build can launch thread-block clusters (sm_90+)
  int ctas_per_sm = 2;            // resident CTAs per SM at `threads` (the occupancy calculator's answer)
  bool resident_capable = false;  // the device and this build can run the row-resident kernel (sm_90+)
  int smem_per_block = 0;         // dynamic shared memory a CTA may opt into (bytes)
  int smem_per_sm = 0;            // shared memory of one SM (bytes; 0: unknown)
  PolicyLossAlgo requested = PolicyLossAlgo::kAuto;
  int cluster_size = 0;  // 0: chosen here
  int threads = 0;       // 0: chosen here
};

// Threads per CTA the plan will use (what the caller asks the occupancy calculator about).
int plan_threads(const RowsPlanInputs& in);

RowsPlan plan_rows(const RowsPlanInputs& in);

}  // namespace logitless::pl
