// Kernel parameters of the rotary-embedding kernel: plain pointers, int64 sizes and strides.
#pragma once

#include <cstdint>

namespace logitless::rope {

struct Operand {  // q or k: [B, H, T, D], element (b, h, t, c) at b * s[0] + h * s[1] + t * s[2] + c
  const void* in = nullptr;
  void* out = nullptr;
  int64_t heads = 0;
  int64_t in_strides[3] = {0, 0, 0};
  int64_t out_strides[3] = {0, 0, 0};
  bool copy_pass = false;  // out-of-place: the pass-through channels are copied
};

struct Params {
  Operand q, k;
  int64_t seq = 0;            // T
  int64_t tokens = 0;         // B * T
  int64_t half = 0;           // Dr / 2 (elements)
  int64_t rot_dim = 0;        // Dr
  int64_t pair_units = 0;     // a head's pairs of units (units: 16-byte vectors, or elements on the scalar path)
  int64_t pass_units = 0;     // a head's pass-through units, channels [Dr, D)
  const void* cos = nullptr;  // the row of token (b, t): see problem.h
  const void* sin = nullptr;
  int64_t cos_b = 0, cos_t = 0, sin_b = 0, sin_t = 0;
  bool cs_f32 = false;  // cos and sin are float32 beside 16-bit q and k
  const void* positions = nullptr;
  bool pos64 = true;
  int64_t pos_b = 0, pos_t = 0, n_positions = 0;
  bool inverse = false;
};

}  // namespace logitless::rope
