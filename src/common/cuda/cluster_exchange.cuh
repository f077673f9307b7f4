// Exchange of a row's 16-byte partial state among the CTAs of a thread-block cluster, with no cluster barrier.
//
// Thread 0 of each CTA stores its state into slot `rank` of every peer's buffer with st.async; each store signals
// the receiving CTA's mbarrier (complete-tx, a release at cluster scope). A CTA's threads wait on their own
// mbarrier (an acquire at cluster scope) until all `csize` states have landed, then read the slots in rank order,
// so that every CTA merges the same values in the same order and agrees on the result to the bit. A cluster of one
// CTA stores its state locally and arrives (st.async needs a peer-addressable cluster).
//
// Against the cluster barrier this replaces (barrier.cluster.arrive.release by every thread, then wait): the release
// compiles to a GPU-scope fence per warp, which waits for the warp's outstanding global stores (the gradient of the
// previous row), and every CTA then waits for the slowest warp of the slowest peer. Here only the states travel.
//
// Two buffers alternate by row, each with its own mbarrier. A peer can store row k+2's state into the buffer of
// row k only after it has received this CTA's state of row k+1, which thread 0 sends after a CTA barrier: callers
// must run a __syncthreads() between every thread's read of one exchange and the next publish (the block reduction
// that precedes each publish does). The kernel must not exit while a peer may still store into it (a final
// cluster.sync()).
#pragma once

#include <cooperative_groups.h>
#include <cuda/ptx>

#include <cstdint>

namespace logitless {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
template <int kMaxCluster>
struct ClusterExchange {
  float4 slots[2][kMaxCluster];
  uint64_t bars[2];
  // Per-thread progress (every thread keeps its own copy, in registers).
  struct Cursor {
    int buf = 0;          // the buffer of the next exchange
    uint32_t phases = 0;  // the phase parity each buffer's mbarrier is waiting for
  };

  // Thread 0, before the kernel's first cluster.sync() (which makes the barriers visible to the peers).
  __device__ void init() {
    cuda::ptx::mbarrier_init(&bars[0], 1);
    cuda::ptx::mbarrier_init(&bars[1], 1);
    cuda::ptx::fence_mbarrier_init(cuda::ptx::sem_release, cuda::ptx::scope_cluster);
  }

  // Sends this CTA's state to every CTA of the cluster (itself included). Called by every thread; thread 0 acts.
  __device__ void publish(const Cursor& c, int rank, int csize, float4 v) {
    if (threadIdx.x != 0) return;
    uint64_t* bar = &bars[c.buf];
    if (csize == 1) {  // a cluster of one CTA (or no cluster launch): a plain store, and the arrive releases it
      slots[c.buf][0] = v;
      cuda::ptx::mbarrier_arrive(cuda::ptx::sem_release, cuda::ptx::scope_cta, cuda::ptx::space_shared, bar);
      return;
    }
    // One arrival per phase (this one), and csize states of 16 bytes. A peer's state may land first: the
    // transaction count goes below zero until this expect, and the phase cannot complete before the arrival.
    cuda::ptx::mbarrier_arrive_expect_tx(cuda::ptx::sem_release, cuda::ptx::scope_cta, cuda::ptx::space_shared, bar,
                                         static_cast<uint32_t>(csize * sizeof(float4)));
    const uint32_t slot = static_cast<uint32_t>(__cvta_generic_to_shared(&slots[c.buf][rank]));
    const uint32_t bar_addr = static_cast<uint32_t>(__cvta_generic_to_shared(bar));
    for (int dst = 0; dst < csize; ++dst) {
      uint32_t rslot, rbar;
      asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(rslot) : "r"(slot), "r"(dst));
      asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(rbar) : "r"(bar_addr), "r"(dst));
      asm volatile(
          "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];" ::"r"(rslot),
          "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "r"(rbar)
          : "memory");
    }
  }

  // Waits for every CTA's state of the current exchange and returns the slots (csize of them, by rank). Called by
  // every thread; advances the cursor.
  __device__ const float4* wait(Cursor& c) {
    uint64_t* bar = &bars[c.buf];
    const uint32_t parity = (c.phases >> c.buf) & 1u;
    while (!cuda::ptx::mbarrier_try_wait_parity(cuda::ptx::sem_acquire, cuda::ptx::scope_cluster, bar, parity)) {
    }
    c.phases ^= 1u << c.buf;
    const float4* s = slots[c.buf];
    c.buf ^= 1;
    return s;
  }
};
#endif

}  // namespace logitless
