// 16-byte global accesses as explicit vector instructions, for the elementwise kernels (glu, rope) whose outputs
// may be their inputs (in place). The loads are volatile and the stores clobber memory, so program order
// survives: a thread's loads of an element come before its store to it, and a warp issues its loads together
// before its stores instead of one round trip per vector. The read-only (non-coherent) load is for tensors no
// output may overlap (api.cpp checks that).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace logitless {

__device__ __forceinline__ uint4 ld16(const void* p) {
  uint4 v;
  asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ uint4 ld16_nc(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ void st16(void* p, const uint4& v) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace logitless
