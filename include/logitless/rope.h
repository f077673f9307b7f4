// logitless: rotary position embedding of the queries and keys of attention, in one launch for both, in
// Hugging Face's convention (the rotate_half form):
//   out = x * cos + rotate_half(x) * sin,  rotate_half(x) = cat(-x[..., h:Dr], x[..., :h]),  h = Dr / 2
// i.e. per pair (i, i + h) of the first Dr channels, with c = cos and s = sin at those channels:
//   out_i     = x_i c_i         - x_{i+h} s_i
//   out_{i+h} = x_{i+h} c_{i+h} + x_i s_{i+h}
// and channels [Dr, D) pass through unchanged (partial rotary: Phi, GLM, StableLM).
//
// Shapes:
//   q        [B, Hq, T, D]  fp32 / fp16 / bf16 (float64 on the CPU); any strides, last dimension contiguous
//                           (the usual [B, T, H, D] projection transposed to [B, H, T, D] goes in as that view)
//   k        [B, Hk, T, D]  optional; q's dtype, B, T and D; Hk may differ from Hq (grouped-query attention)
//   cos, sin [Bc, T, Dr] or [T, Dr]   what the model's rotary module returns (Bc = 1 or B; any strides, last
//                           dimension contiguous), float32 or q's dtype, both the same; Dr even, 2 <= Dr <= D
//     with position_ids:  [P, Dr]     a table of P positions, row p the position p
//   position_ids [Bp, T]    optional, int32 / int64, Bp = 1 or B: row position_ids[b, t] of the tables rotates
//                           token t of sequence b. A position outside [0, P) never reads out of bounds: the CUDA
//                           kernels give that token NaN in its rotated channels, the CPU backend raises.
//   q_out, k_out            q's and k's dtype and shape, any strides with the last dimension contiguous; each
//                           may be its input itself (same pointer and strides) to rotate in place.
// Arithmetic in float32 (the CPU backend in double), one rounding to the dtype.
//
// The backward is the same pass with options.inverse (the transpose of the rotation above, which for the
// cos/sin of a rotary module, equal on both halves, is the rotation by -sin):
//   dx_i      = dout_i c_i         + dout_{i+h} s_{i+h}
//   dx_{i+h}  = dout_{i+h} c_{i+h} - dout_i s_i
// from q_out's and k_out's gradients. cos and sin get no gradient.
#pragma once

#include <cstdint>

#include "logitless/tensor.h"

namespace logitless {

// Which kernel runs on CUDA: kAuto takes 16-byte vectors where the tensors allow them; kVector where they do
// not raises an Error; kScalar (element accesses, any alignment) exists to test that path.
enum class RopeAlgo : int32_t { kAuto = 0, kVector = 1, kScalar = 2 };

struct RopeOptions {
  bool inverse = false;  // the backward: out = transpose of the rotation applied to the input
  RopeAlgo algo = RopeAlgo::kAuto;
};

// One read of q and k (and one row of cos and sin per token), one write of q_out and k_out. In place, the
// pass-through channels are neither read nor written.
void rope_apply(const TensorView& q, const TensorView& k, const TensorView& cos, const TensorView& sin,
                const TensorView& position_ids, const RopeOptions& options, const TensorView& q_out,
                const TensorView& k_out, StreamHandle stream);

}  // namespace logitless
