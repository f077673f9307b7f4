// logitless: gated linear units of a transformer MLP, forward and backward: SwiGLU (Llama, Mistral, Qwen)
// and GeGLU (Gemma), y = act(gate) * up.
//
// Shapes (N = number of rows = product of the leading dimensions, I = the intermediate size):
//   gate   [*, I]  fp32 / fp16 / bf16 (float64 on the CPU); last dimension contiguous (stride 1); leading
//                  dimensions may have any strides that do not overlap rows
//   up     [*, I]  gate's dtype, shape and device, last dimension contiguous
//   y      [*, I]  gate's dtype and shape, last dimension contiguous
// A concatenated projection gate_up [*, 2I] (Phi-3: the first half is the gate, the second the up
// projection) goes in as two views of one buffer, gate = gate_up[..., :I] and up = gate_up[..., I:] (row
// stride 2I); its gradient comes out the same way, as two views of one [*, 2I] buffer.
//
// Activations, per element, in float32 (the CPU backend in double), one rounding to the dtype at the end:
//   kSiLU      act(g) = g * sigmoid(g)                                          SwiGLU
//   kGeluTanh  act(g) = g/2 * (1 + tanh(sqrt(2/pi) * (g + 0.044715 g^3)))      GeGLU, Gemma's gelu_pytorch_tanh
//   kGelu      act(g) = g/2 * (1 + erf(g / sqrt(2)))                            GeGLU with the exact GELU
// Torch modules round act(gate) to the dtype before the product; here it stays float32 (one rounding
// instead of two).
//
// Backward, from dy = dL/dy: dL/dup = dy * act(g), dL/dgate = dy * up * act'(g). The activation is
// recomputed from gate: nothing but gate and up (which the model holds anyway) is kept between the passes.
#pragma once

#include <cstdint>

#include "logitless/tensor.h"

namespace logitless {

enum class GLUActivation : int32_t { kSiLU = 0, kGeluTanh = 1, kGelu = 2 };

// Which kernel runs on CUDA. kAuto takes 16-byte vectors where every row allows them; kVector where one
// does not raises an Error; kScalar (one element a thread access, any alignment) exists to test that path.
enum class GLUAlgo : int32_t { kAuto = 0, kVector = 1, kScalar = 2 };

struct GLUOptions {
  GLUActivation activation = GLUActivation::kSiLU;
  GLUAlgo algo = GLUAlgo::kAuto;
};

// One read of gate and up, one write of y. y may be gate or up itself (same pointer and strides): each
// element is read before the thread that reads it writes there.
void glu_forward(const TensorView& gate, const TensorView& up, const GLUOptions& options, const TensorView& y,
                 StreamHandle stream);

// grad_y     [*, I]  gate's dtype and shape, last dimension contiguous
// gate, up           as in the forward
// grad_gate  [*, I]  gate's dtype and shape, last dimension contiguous; may be gate itself
// grad_up    [*, I]  the same; may be up itself
// One read of grad_y, gate and up, one write of grad_gate and grad_up. Writing the gradients over gate and up
// (in place) saves two [*, I] buffers where nothing else reads gate and up afterwards. Neither gradient may
// overlap grad_y, the other gradient, or the other input.
void glu_backward(const TensorView& grad_y, const TensorView& gate, const TensorView& up, const GLUOptions& options,
                  const TensorView& grad_gate, const TensorView& grad_up, StreamHandle stream);

}  // namespace logitless
