# Every source of the library in one place. Each op family adds its api/cpu files and its CUDA files.
#
# A family's cuda/ directory names its files by role, so that the same question has the same answer in every
# family: run.cpp (run.cu where it launches small kernels of its own) is the host-side runner that defines what
# problem.h declares for CUDA (plans, workspace, the sequence of launches and GEMMs); kernels.cu holds the
# kernels and their launchers (kernels_<variant>.cu where a family has several), kernels.h declares those
# launchers to the runner, device.cuh holds the device-side pieces its kernel files share, params.h the kernel
# parameters and plan.h/plan.cpp the tile choices a CPU test can check. glu, rope and rms_norm define their CUDA
# entry points in their kernel files, next to the kernels they launch (rms_norm's shared host helpers: run.h).
# linear_head/ is no op of its own but the engine under every loss computed from hidden states (cuda/engine.h): its
# checks, chunk planning, workspace stages, GEMM sequence and shared kernels.
set(LOGITLESS_CXX_SOURCES
  src/common/debug_hooks.cpp
  src/common/error.cpp
  src/common/layout.cpp
  src/common/tensor.cpp
  src/cross_entropy/api.cpp
  src/cross_entropy/cpu.cpp
  src/cross_entropy/cuda/plan.cpp
  src/glu/api.cpp
  src/glu/cpu.cpp
  src/glu/cuda/plan.cpp
  src/linear_cross_entropy/api.cpp
  src/linear_cross_entropy/cpu.cpp
  src/linear_cross_entropy/cuda/plan.cpp
  src/linear_head/cuda/plan.cpp
  src/linear_head/checks.cpp
  src/linear_policy_loss/api.cpp
  src/linear_policy_loss/cpu.cpp
  src/linear_policy_loss/cuda/plan.cpp
  src/policy_loss/api.cpp
  src/policy_loss/cpu.cpp
  src/policy_loss/cuda/plan.cpp
  src/rms_norm/api.cpp
  src/rms_norm/cpu.cpp
  src/rms_norm/cuda/plan.cpp
  src/rope/api.cpp
  src/rope/cpu.cpp
  src/rope/cuda/plan.cpp
)
# Compiled only with the CUDA backend.
set(LOGITLESS_CUDA_SOURCES
  src/common/cuda/cublas.cpp
  src/common/cuda/device_info.cu
  src/common/cuda/index_readback.cpp
  src/common/cuda/launch_cache.cpp
  src/cross_entropy/cuda/kernels_row_resident.cu
  src/cross_entropy/cuda/kernels_streaming.cu
  src/cross_entropy/cuda/run.cu
  src/glu/cuda/kernels.cu
  src/linear_cross_entropy/cuda/kernels.cu
  src/linear_cross_entropy/cuda/kernels_exp_grad.cu
  src/linear_cross_entropy/cuda/kernels_hopper.cu
  src/linear_cross_entropy/cuda/kernels_row_stats.cu
  src/linear_cross_entropy/cuda/run.cpp
  src/linear_head/cuda/accumulate_gemm.cu
  src/linear_head/cuda/engine.cpp
  src/linear_head/cuda/kernels.cu
  src/linear_policy_loss/cuda/kernels.cu
  src/linear_policy_loss/cuda/run.cpp
  src/policy_loss/cuda/kernels_row_resident.cu
  src/policy_loss/cuda/kernels_streaming.cu
  src/policy_loss/cuda/run.cu
  src/rms_norm/cuda/kernels_backward.cu
  src/rms_norm/cuda/kernels_forward.cu
  src/rope/cuda/kernels.cu
)
# Compiled only without it.
set(LOGITLESS_NO_CUDA_SOURCES
  src/common/no_cuda.cpp
)
