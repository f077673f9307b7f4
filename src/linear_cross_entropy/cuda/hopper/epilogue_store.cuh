// The output tile of an epilogue that writes one (E, the gradient): [128, 256] values in T through shared memory and
// TMA stores, which drain while the next tile's WGMMAs run. Each consumer warpgroup writes its 64 rows in kChunks
// chunks of 64 columns into one of two 8 KB buffers (128-byte swizzle: a chunk is one TMA box), stmatrix putting
// four 8 x 8 blocks of the WGMMA accumulator layout per instruction, and its first thread stores the chunk; a buffer
// is rewritten once the store issued from it two chunks before has read it (waited for one chunk before). The TMA
// clips rows and columns past the output's end.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_types.h>
#include <cute/tensor.hpp>

#include <cstdint>
#include <type_traits>

#include "common/check.h"
#include "linear_cross_entropy/cuda/hopper/mainloop.cuh"  // kBM, kBN

namespace logitless::lce::hopper {

template <typename T>
__device__ __forceinline__ uint32_t pack2(float a, float b) {
  if constexpr (std::is_same_v<T, cutlass::bfloat16_t>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

template <typename T>
struct TileStore {
  static constexpr int kCols = 64;  // columns of a chunk: one 128-byte swizzle row of T
  static constexpr int kChunks = kBN / kCols;
  static constexpr int kBarrier = 1;  // named barriers kBarrier + w: consumer warpgroup w (0 is __syncthreads)
  // One chunk of a consumer warpgroup: its 64 rows by kCols columns, 128-byte swizzled (a TMA box).
  using SmemChunk = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<T>{}, make_shape(Int<kBM / 2>{}, Int<kCols>{})));

  struct SharedStorage {
    alignas(1024) cute::array_aligned<T, 2 * kBM * kCols, 1024> e;  // two chunk buffers of both warpgroups
  };

  static auto make_tma(T* out, int m, int n, int64_t ld) {
    Tensor mE = make_tensor(make_gmem_ptr(out), make_shape(m, n), make_stride(ld, Int<1>{}));  // (m, n)
    return make_tma_copy(SM90_TMA_STORE{}, mE, SmemChunk{});
  }
  using Tma = decltype(make_tma(nullptr, 0, 0, 0));

  // out: [m, n], row stride ld; the plan's buffers are 16-byte aligned with rows of a multiple of 8 elements.
  static Tma to_underlying_arguments(void* out, int64_t m, int64_t n, int64_t ld) {
    if (reinterpret_cast<uintptr_t>(out) % 16 != 0 || ld % 8 != 0)
      throw_invalid(
          "linear cross-entropy fused GEMM: expected a 16-byte aligned output with rows of a multiple of 8 "
          "elements (the workspace's alignment), got another");
    return make_tma(static_cast<T*>(out), static_cast<int>(m), static_cast<int>(n), ld);
  }

  // val(e): the value of accumulator element e, called once per element in order. wgl: the consumer warpgroup, tw:
  // the thread in it.
  template <class Val>
  __device__ __forceinline__ static void store(const Tma& tma, SharedStorage& smem, int wgl, int tw, int mt, int nt,
                                               int m, int n, Val&& val) {
    const int lane = tw & 31, k = lane >> 3, i = lane & 7;
    const int r = 16 * (tw >> 5) + 8 * (k & 1) + i;  // the row (of the warpgroup's 64) whose address this lane gives
    Tensor mE = tma.get_tma_tensor(make_shape(m, n));
    CUTE_UNROLL
    for (int c = 0; c < kChunks; ++c) {
      T* buf = smem.e.data() + (c & 1) * (kBM * kCols) + wgl * (kBM / 2 * kCols);
      // The chunk's values first, all of them (independent exponentials in flight), then the buffer.
      constexpr int kVals = kCols / 2;  // per thread: 2 rows x kCols / 4 columns
      float v[kVals];
      CUTE_UNROLL
      for (int q = 0; q < kVals; ++q) v[q] = val(c * kVals + q);
      uint32_t packed[kVals / 2];
      CUTE_UNROLL
      for (int q = 0; q < kVals / 2; ++q) packed[q] = pack2<T>(v[2 * q], v[2 * q + 1]);
      const uint32_t row_addr = cast_smem_ptr_to_uint(buf) + r * (kCols * sizeof(T));
      CUTE_UNROLL
      for (int jj = 0; jj < kCols / 8; jj += 2) {  // two 8-column blocks of the chunk per instruction
        const int q = 2 * jj;                      // packed pairs of blocks jj, jj + 1: top, bottom, top, bottom
        const uint32_t addr = row_addr + (((jj + (k >> 1)) ^ i) << 4);  // the 16-byte chunk, swizzled by row % 8
        asm volatile("stmatrix.sync.aligned.x4.m8n8.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(packed[q]),
                     "r"(packed[q + 1]), "r"(packed[q + 2]), "r"(packed[q + 3]));
      }
      tma_store_fence();  // the writes above, visible to the TMA unit
      // One barrier per chunk: before it, the first thread waits until every store it issued has read its buffer,
      // so that after it this chunk can be stored and the next written into the other buffer.
      if (tw == 0) tma_store_wait<0>();
      cutlass::arch::NamedBarrier::sync(128, kBarrier + wgl);
      if (tw == 0) {
        Tensor gE = local_tile(mE, Shape<Int<kBM / 2>, Int<kCols>>{}, make_coord(2 * mt + wgl, nt * kChunks + c));
        Tensor sE = make_tensor(make_smem_ptr(buf), SmemChunk{});
        auto cta = tma.get_slice(Int<0>{});
        copy(tma, cta.partition_S(sE), cta.partition_D(gE));
        tma_store_arrive();
      }
    }
  }

  // At the end of a consumer warpgroup: the shared memory stays until the last stores have read it.
  __device__ __forceinline__ static void drain(int tw) {
    if (tw == 0) tma_store_wait<0>();
  }
};

}  // namespace logitless::lce::hopper
