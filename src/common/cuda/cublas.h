// cuBLAS for the library's GEMMs: one handle per device and host thread, bound per call to the caller's
// stream and a workspace the caller provides, and a row-major GEMM in the library's terms.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "common/check.h"

namespace logitless {

[[noreturn]] void throw_cublas(cublasStatus_t status, const char* what, const char* file, int line);

#define LOGITLESS_CUBLAS_CHECK(expr)                                                             \
  do {                                                                                           \
    const cublasStatus_t st_ = (expr);                                                           \
    if (st_ != CUBLAS_STATUS_SUCCESS) ::logitless::throw_cublas(st_, #expr, __FILE__, __LINE__); \
  } while (0)

// The calling thread's handle for the current device, created on first use (cublasCreate allocates device
// memory, which a stream that is capturing a CUDA graph forbids: the first call per device and thread must
// come before any capture, as a warm-up does), set to `stream` and to the caller's workspace `ws` of `bytes`
// (so cuBLAS allocates nothing itself, which graph capture needs; bytes 0 leaves cuBLAS its default pool).
// Per thread because the stream and workspace are settings of the handle: two threads sharing one would race
// between setting them and enqueueing a GEMM (PyTorch's autograd runs backward on its own thread).
cublasHandle_t cublas_handle(cudaStream_t stream, void* ws, size_t bytes);

// C = A' · B' (+ C when `accumulate`) with row-major operands, fp32 accumulation (CUBLAS_COMPUTE_32F: bf16 /
// fp16 inputs on tensor cores, fp32 inputs exact, never TF32):
//   C [m, n] (ldc)   A' = A [m, k] (lda), or Aᵀ with A stored [k, m] when `trans_a`
//                    B' = B [k, n] (ldb), or Bᵀ with B stored [n, k] when `trans_b`
// A and B share a dtype (fp32 / fp16 / bf16); C is that dtype or float32. Sizes and leading dimensions must be
// below 2^31 (the callers check); m, n or k of 0 is a no-op.
void gemm_row_major(cublasHandle_t handle, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const void* a,
                    int64_t lda, const void* b, int64_t ldb, DType ab_dtype, void* c, int64_t ldc, DType c_dtype,
                    bool accumulate);

}  // namespace logitless
