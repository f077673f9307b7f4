// Launch shape of the GLU kernels: a pure host function (no CUDA calls), so that a CPU test can check every
// decision.
//
// The kernels are elementwise over rows of `width` elements. A CTA takes a chunk of a row, kUnitsPerThread units
// a thread (a unit is a 16-byte vector, or one element on the scalar path), all loads of a chunk before its
// stores: each thread has 2 (forward) or 3 (backward) x kUnitsPerThread 16-byte loads in flight. grid.x covers
// a row's chunks and grid.y the rows (both loop where the grid's limits are reached). The CTA size is picked so
// that the chunks tile the row with little idle tail: at Llama-3-8B's I = 14336 (1792 bf16 vectors) a 256-thread
// CTA of 512 vectors would leave an eighth of its last chunk's threads without work.
#pragma once

#include <cstdint>

#include "logitless/glu.h"

namespace logitless::glu {

inline constexpr int kUnitsPerThread = 2;
inline constexpr int kMaxThreads = 512;  // the kernels' launch bound
inline constexpr int64_t kMaxGridX = 0x7FFFFFFF;
inline constexpr int64_t kMaxGridY = 65535;

struct PlanInputs {
  int64_t n_rows = 0;
  int64_t width = 0;  // elements a row
  int elem_bytes = 2;
  bool vector_ok = false;  // every base and row stride 16-byte aligned and width a whole number of vectors
  GLUAlgo requested = GLUAlgo::kAuto;
};

struct Plan {
  bool vector = false;
  int threads = 0;  // blockDim.x
  int64_t units = 0, chunks = 0;
  int64_t grid_x = 0, grid_y = 0;
  const char* why_not = nullptr;  // set: the requested kernel cannot run these arguments
};

Plan plan_glu(const PlanInputs& in);

}  // namespace logitless::glu
