#include "common/cuda/cublas.h"

#include <vector>

#include "common/cuda/check.cuh"

namespace logitless {

void throw_cublas(cublasStatus_t status, const char* what, const char* file, int line) {
  throw_runtime(str_cat("cuBLAS error in ", what, ": ", cublasGetStatusName(status), " (",
                        cublasGetStatusString(status), ") at ", file, ":", line));
}

namespace {

cudaDataType cuda_type(DType t) {
  switch (t) {
    case DType::kFloat32:
      return CUDA_R_32F;
    case DType::kFloat16:
      return CUDA_R_16F;
    case DType::kBFloat16:
      return CUDA_R_16BF;
    default:
      throw_invalid(str_cat("gemm: unsupported dtype ", dtype_name(t)));
  }
}

}  // namespace

cublasHandle_t cublas_handle(cudaStream_t stream, void* ws, size_t bytes) {
  // Never destroyed: a handle destroyed at thread or process exit may outlive the CUDA context it belongs to
  // (PyTorch leaks its handles for the same reason).
  thread_local std::vector<cublasHandle_t> handles;
  int device = 0;
  LOGITLESS_CUDA_CHECK(cudaGetDevice(&device));
  if (static_cast<size_t>(device) >= handles.size()) handles.resize(device + 1, nullptr);
  if (!handles[device]) {
    if (stream_is_capturing(stream))
      throw_runtime(
          "cuBLAS handle: the first call on this thread and device is inside a CUDA graph capture; make one "
          "call before capturing (cublasCreate allocates memory, which capture forbids)");
    LOGITLESS_CUBLAS_CHECK(cublasCreate(&handles[device]));
  }
  cublasHandle_t h = handles[device];
  // Order matters: cublasSetStream resets the workspace to cuBLAS's default pool.
  LOGITLESS_CUBLAS_CHECK(cublasSetStream(h, stream));
  if (ws && bytes) LOGITLESS_CUBLAS_CHECK(cublasSetWorkspace(h, ws, bytes));
  return h;
}

void gemm_row_major(cublasHandle_t handle, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const void* a,
                    int64_t lda, const void* b, int64_t ldb, DType ab_dtype, void* c, int64_t ldc, DType c_dtype,
                    bool accumulate) {
  if (m == 0 || n == 0 || k == 0) return;
  // cuBLAS is column-major: a row-major X [r, s] with leading dimension ld is the column-major Xᵀ [s, r] with
  // the same ld. So the row-major C = A'·B' is computed as the column-major Cᵀ = B'ᵀ·A'ᵀ, whose operands are
  // B's and A's storage with the transposes as given.
  const float alpha = 1.f, beta = accumulate ? 1.f : 0.f;
  const cudaDataType ab = cuda_type(ab_dtype), ct = cuda_type(c_dtype);
  LOGITLESS_CUBLAS_CHECK(cublasGemmEx(handle, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N,
                                      static_cast<int>(n), static_cast<int>(m), static_cast<int>(k), &alpha, b, ab,
                                      static_cast<int>(ldb), a, ab, static_cast<int>(lda), &beta, c, ct,
                                      static_cast<int>(ldc), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

}  // namespace logitless
