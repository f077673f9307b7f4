// Tile choices for the cross-entropy kernels: one pure host function (no CUDA calls) so that a CPU test can
// check every decision.
#pragma once

#include <cstddef>
#include <cstdint>

#include "logitless/cross_entropy.h"

namespace logitless::ce {

// The row-resident kernel keeps up to kMaxStages rows in flight per CTA; 3 stages of 64 KB already keep
// ~128 KB of loads in flight per SM, 5x what the HBM latency needs, so more stages would only cost
// occupancy on short rows.
inline constexpr int kMaxStages = 4;
inline constexpr int kMaxCluster = 16;  // 16 needs the non-portable cluster size (H100 allows it)
inline constexpr int kStreamingThreads = 256;
// The row-resident kernel's thread bound: 256 threads and three CTAs per SM cap it at 80 registers a thread (a
// few bytes of spills), against 128 under a 512-thread bound. On H100 the tighter bound was faster with one CTA a
// row and with 4-CTA clusters, and no slower for the planned 3-CTA clusters (bench/RESULTS.md, "the row-resident
// kernel's thread bound").
inline constexpr int kMaxThreads = 256;
inline constexpr int kMinCtasPerSm = 3;
// Shared memory each resident CTA costs beyond its dynamic stages: its static shared memory (about 2 KB) and
// the 1 KB the driver reserves per CTA, rounded up.
inline constexpr int64_t kPerCtaReserve = 4096;
// Rows whose one-stage slice would be shorter than this (16K bf16 elements) keep the multi-stage plan: short
// rows need several rows in flight per CTA, not several CTAs.
inline constexpr int64_t kMinSharedStage = 32 * 1024;

struct Plan {
  CrossEntropyAlgo algo = CrossEntropyAlgo::kStreaming;
  int cluster = 1;  // CTAs sharing one row (row-resident)
  int stages = 0;   // shared-memory row slices in flight per CTA (row-resident)
  int threads = kStreamingThreads;
  int64_t slice = 0;       // elements of a row each CTA of the cluster owns (row-resident)
  size_t stage_bytes = 0;  // shared memory per stage
  size_t smem_bytes = 0;   // dynamic shared memory per CTA
  int copy_pieces = 1;     // bulk copies per slice (row-resident)
  int grid_clusters = 0;   // clusters to launch; 0: as many as the occupancy calculator says fit
  bool pipelined =
      false;  // row-resident: a row's exchange overlaps the next row's statistics (kernels_row_resident.cu)
};

struct PlanInputs {
  int64_t vocab = 0;
  int elem_bytes = 2;
  bool backward_only = false;         // the gradient from a saved lse needs no row residency
  bool forward_only = false;          // the loss alone needs no row residency either
  bool row_resident_capable = false;  // the device and this build can run the Hopper kernel
  int smem_per_block = 0;             // dynamic shared memory a CTA may opt into (bytes)
  int smem_per_sm = 0;                // shared memory of one SM (bytes; 0: unknown, one CTA per SM assumed)
  CrossEntropyAlgo requested = CrossEntropyAlgo::kAuto;
};

// Returns the plan; kRowResident requested where it cannot run yields algo == kAuto (the caller raises).
Plan plan_cross_entropy(const PlanInputs& in);

}  // namespace logitless::ce
