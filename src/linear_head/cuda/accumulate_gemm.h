// grad_weight's product for a token group after the first, on Hopper: D (float32) += Aᵀ B with A = dZ [k, m] and
// B = x [k, n], both 16-bit and row-major. cuBLAS reads and writes the float32 D in an epilogue that does not
// overlap its math, which costs a product with a short k (a token group: one read and one write of V · H floats
// against 2 V H k FLOPs) a large share of its time. This one is CUTLASS's warp-specialized ping-pong kernel: one
// warp group's epilogue (D loaded by TMA ahead of it) runs while the other's math does. It serves groups of fewer
// than kCublasAccumulatesFrom tokens: from there on, cuBLAS's own accumulating kernel is the faster one (H100,
// bench/cpp/bench_accumulate_gemm.cu; bench/RESULTS.md, "the accumulating grad_weight product").
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "logitless/tensor.h"

namespace logitless::head {

inline constexpr int64_t kCublasAccumulatesFrom = 2048;
// With AccumulateGemm::out, up to this many tokens too: cuBLAS's product would leave a cast of the sums after it.
inline constexpr int64_t kWritesOutUpTo = 2048;

struct AccumulateGemm {
  DType dtype = DType::kBFloat16;  // of a and b
  int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;  // [k, m], row stride lda
  int64_t lda = 0;
  const void* b = nullptr;  // [k, n], row stride ldb
  int64_t ldb = 0;
  float* d = nullptr;  // [m, n], row stride ldd: d += aᵀ b
  int64_t ldd = 0;
  bool any_k = false;  // run it from kCublasAccumulatesFrom tokens on too (an accumulator's tail: engine.cpp)
  bool tail = false;   // the accumulator's tail rows (engine.cpp): their own tiling (accumulate_gemm.cu)
  // Where set: out (bfloat16 [m, n], row stride ldo) = d + aᵀ b, and d is only read. The last token group's
  // product, which writes a 16-bit grad_weight itself instead of leaving the float32 sums to a cast after it.
  void* out = nullptr;
  int64_t ldo = 0;
};

// Runs it and returns true where this build has the kernel and the device and operands suit it (compute
// capability 9.0, bfloat16, k below kCublasAccumulatesFrom unless any_k or (with out) up to kWritesOutUpTo, what the
// kernel's TMA descriptors take);
// false, having done nothing, otherwise (the caller runs cuBLAS, and casts into out itself).
bool launch_accumulate_gemm(const AccumulateGemm& g, int device, int sm_count, cudaStream_t stream);

}  // namespace logitless::head
