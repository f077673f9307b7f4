// What the C++ micro-benchmarks share: a CUDA-call check that ends the program, and counter-based uniform numbers
// for filling inputs on the device (the same values for a seed whatever the launch shape).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#define CK(x)                                                             \
  do {                                                                    \
    cudaError_t e = (x);                                                  \
    if (e != cudaSuccess) {                                               \
      std::fprintf(stderr, "%s failed: %s\n", #x, cudaGetErrorString(e)); \
      std::exit(1);                                                       \
    }                                                                     \
  } while (0)

// A uniform number in [0, 1) for counter i under seed (splitmix64 of the counter).
__device__ __forceinline__ float hash_uniform(uint64_t i, uint64_t seed) {
  uint64_t z = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return (z >> 40) * (1.0f / 16777216.0f);
}
