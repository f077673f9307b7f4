// The validated, framework-free description of one rotary-embedding call that every backend consumes.
// api.cpp builds it (all argument checking happens there); cpu.cpp and cuda/ only compute.
#pragma once

#include <cstdint>

#include "logitless/rope.h"

namespace logitless::rope {

// One [B, H, T, D] operand: element (b, h, t, c) at b * strides[0] + h * strides[1] + t * strides[2] + c.
struct Heads {
  const void* in = nullptr;
  void* out = nullptr;
  int64_t heads = 0;
  int64_t in_strides[3] = {0, 0, 0};
  int64_t out_strides[3] = {0, 0, 0};
  bool copy_pass = false;  // out is not in itself: the pass-through channels [Dr, D) are copied
};

struct Problem {
  int64_t batch = 0, seq = 0, head_dim = 0, rot_dim = 0;  // B, T, D, Dr
  DType dtype = DType::kFloat32;                          // q, k and the outputs
  DType cs_dtype = DType::kFloat32;                       // cos and sin: float32 or dtype
  Device device;
  bool inverse = false;
  RopeAlgo algo = RopeAlgo::kAuto;

  Heads q, k;  // k.heads == 0 without k

  // Row of cos / sin for token (b, t): without positions at b * cs_b + t * cs_t (cs_b = 0 broadcasts one
  // batch row); with positions at position_ids[b * pos_b + t * pos_t] * cs_t.
  const void* cos = nullptr;
  const void* sin = nullptr;
  int64_t cos_b = 0, cos_t = 0, sin_b = 0, sin_t = 0;
  const void* positions = nullptr;  // optional
  DType pos_dtype = DType::kInt64;
  int64_t pos_b = 0, pos_t = 0;
  int64_t n_positions = 0;  // rows of the tables
};

void run_cpu(const Problem& p);

#if defined(LOGITLESS_WITH_CUDA)
void run_cuda(const Problem& p, StreamHandle stream);
#endif

}  // namespace logitless::rope
