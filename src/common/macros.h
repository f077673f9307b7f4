#pragma once

// Functions shared by host and device code (the math of an op is written once).
#if defined(__CUDACC__)
#define LOGITLESS_HD __host__ __device__ __forceinline__
#else
#define LOGITLESS_HD inline
#endif
