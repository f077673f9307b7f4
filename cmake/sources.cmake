# Every source of the library in one place. Each op family adds its api/cpu files and its CUDA files.
set(LOGITLESS_CXX_SOURCES
  src/common/error.cpp
  src/common/layout.cpp
  src/common/tensor.cpp
  src/cross_entropy/api.cpp
  src/cross_entropy/cpu.cpp
  src/cross_entropy/cuda/plan.cpp
  src/linear_cross_entropy/api.cpp
  src/linear_cross_entropy/cpu.cpp
  src/linear_cross_entropy/cuda/plan.cpp
  src/policy_loss/api.cpp
  src/policy_loss/cpu.cpp
  src/policy_loss/cuda/plan.cpp
  src/rms_norm/api.cpp
  src/rms_norm/cpu.cpp
  src/rms_norm/cuda/plan.cpp
)
# Compiled only with the CUDA backend.
set(LOGITLESS_CUDA_SOURCES
  src/common/cuda/cublas.cpp
  src/common/cuda/device_info.cu
  src/cross_entropy/cuda/launch.cu
  src/cross_entropy/cuda/row_resident.cu
  src/cross_entropy/cuda/streaming.cu
  src/linear_cross_entropy/cuda/generic.cpp
  src/linear_cross_entropy/cuda/kernels.cu
  src/policy_loss/cuda/launch.cu
  src/policy_loss/cuda/rows.cu
  src/rms_norm/cuda/forward.cu
  src/rms_norm/cuda/backward.cu
)
# Compiled only without it.
set(LOGITLESS_NO_CUDA_SOURCES
  src/common/no_cuda.cpp
)
