// What the C++ micro-benchmarks share: a CUDA-call check that ends the program, and counter-based uniform numbers
// for filling inputs on the device (the same values for a seed whatever the launch shape).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

// A failed CUDA or cuBLAS call: its text and the reason, then the end of the program.
[[noreturn]] inline void bench_fail(const char* call, const std::string& why) {
  std::fprintf(stderr, "%s failed: %s\n", call, why.c_str());
  std::exit(1);
}

#define CK(x)                                                    \
  do {                                                           \
    const cudaError_t e = (x);                                   \
    if (e != cudaSuccess) bench_fail(#x, cudaGetErrorString(e)); \
  } while (0)

// The same for a cuBLAS call (where the including file has cublas_v2.h).
#define CB(x)                                                                            \
  do {                                                                                   \
    const cublasStatus_t s = (x);                                                        \
    if (s != CUBLAS_STATUS_SUCCESS) bench_fail(#x, std::to_string(static_cast<int>(s))); \
  } while (0)

// Device 0's properties, with stdout line-buffered so that the rows printed so far survive a timeout.
inline cudaDeviceProp bench_device() {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  return prop;
}

// The GEMM micro-benchmarks' command line: `[D0 D1 D2 [rounds [variant...]]]`, three problem sizes, the timed
// rounds and the variants to run (none named: every one). Sizes and rounds must be whole numbers >= 1: anything else
// (a variant's name where a size belongs, say) ends the program with a usage line rather than timing a product of
// size 0.
struct GemmBenchArgs {
  int64_t dims[3];
  int rounds;
  std::vector<std::string> only;
  GemmBenchArgs(int argc, char** argv, int64_t d0, int64_t d1, int64_t d2, int default_rounds)
      : dims{d0, d1, d2}, rounds(default_rounds), only(argv + std::min(argc, 5), argv + argc) {
    if (argc >= 2 && argc < 4) usage(argv[0], "expected three sizes");
    if (argc >= 4)
      for (int i = 0; i < 3; ++i) dims[i] = positive(argv[0], argv[1 + i]);
    if (argc >= 5) rounds = static_cast<int>(std::min<int64_t>(positive(argv[0], argv[4]), 1000000));
  }
  bool wants(const std::string& name) const {
    return only.empty() || std::find(only.begin(), only.end(), name) != only.end();
  }

 private:
  [[noreturn]] static void usage(const char* prog, const std::string& why) {
    std::fprintf(stderr, "%s: %s\nusage: %s [D0 D1 D2 [rounds [variant...]]]\n", prog, why.c_str(), prog);
    std::exit(2);
  }
  static int64_t positive(const char* prog, const char* text) {
    char* end = nullptr;
    const long long v = std::strtoll(text, &end, 10);
    if (end == text || *end != '\0' || v < 1)
      usage(prog, std::string("expected a whole number >= 1, got '") + text + "'");
    return v;
  }
};

// A uniform number in [0, 1) for counter i under seed (splitmix64 of the counter).
__device__ __forceinline__ float hash_uniform(uint64_t i, uint64_t seed) {
  uint64_t z = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return (z >> 40) * (1.0f / 16777216.0f);
}
