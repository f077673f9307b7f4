// Launch shape of the rotary-embedding kernel: a pure host function (no CUDA calls), so that a CPU test can check
// every decision.
//
// A CTA rotates z tokens (b, t), all heads of q and k of each. Its threads are (x, y, z): x runs over a head's
// pairs of units (16-byte vectors, or elements on the scalar path; a pair is the unit at channel i and the one at
// i + Dr/2), y over the heads, z over the CTA's tokens. A thread rotates its pair in heads y, y + blockDim.y, ...,
// two heads at a time (their four loads in flight together), with the pair's cos and sin read once for the two:
// the tables come from DRAM once per token and from L1 for the other heads. The head lanes are sized so that each
// thread takes at least two heads where there are two and the lanes divide the heads evenly: Llama-3-8B's 32 + 8
// heads of 128 bf16 channels take 8 x 20 threads, 2 heads each.
#pragma once

#include <cstdint>

#include "logitless/rope.h"

namespace logitless::rope {

inline constexpr int kMaxPairLanes = 64;  // blockDim.x; longer heads loop over their pairs
inline constexpr int kTargetThreads = 256;
inline constexpr int kMaxThreads = 256;  // the kernel's launch bound
inline constexpr int kMaxBlockZ = 64;    // the hardware's limit on blockDim.z
// The vector kernel's launch bound asks for two such CTAs an SM, a cap of 128 registers a thread: it needs about 100
// (two heads' units, four table units and their 64-bit addresses), and at a cap of 80 it spilled.
inline constexpr int kMinCtasPerSm = 2;
inline constexpr int64_t kMaxGrid = 0x7FFFFFFF;

struct PlanInputs {
  int64_t tokens = 0;    // B * T
  int64_t heads = 0;     // Hq + Hk
  int64_t head_dim = 0;  // D
  int64_t rot_dim = 0;   // Dr
  int elem_bytes = 2;
  bool vector_ok = false;  // bases and strides of every operand (and of cos and sin) 16-byte aligned
  RopeAlgo requested = RopeAlgo::kAuto;
};

struct Plan {
  bool vector = false;
  int64_t pair_units = 0, pass_units = 0;
  int x = 1, y = 1, z = 1;  // blockDim
  int64_t grid = 0;
  const char* why_not = nullptr;  // set: the requested kernel cannot run these arguments
  int threads() const { return x * y * z; }
};

Plan plan_rope(const PlanInputs& in);

}  // namespace logitless::rope
