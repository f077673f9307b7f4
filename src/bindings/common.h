// Conversions shared by the binding files. The binding holds no logic: it turns Python values into the
// public C++ API's types and calls it.
#pragma once

#include <nanobind/nanobind.h>

#include <cstdint>

#include "logitless/logitless.h"

namespace logitless::bindings {

namespace nb = nanobind;

// A tensor travels as None or as the tuple (data_ptr, dtype_code, device_type, device_index, sizes, strides)
// that python/logitless/_tensor.py builds from a torch.Tensor.
TensorView to_view(nb::handle obj);
Workspace to_workspace(nb::handle obj);  // None or (ptr, bytes)
inline StreamHandle to_stream(uintptr_t s) { return reinterpret_cast<StreamHandle>(s); }

// Conversions more than one family's bindings need, each defined next to its own family's bindings.
// linear_cross_entropy.cpp: the options tuple (ignore_index, reduction (the C++ enum value), label_smoothing,
// z_loss, softcap, check_targets, chunk_tokens, chunk_vocab, memory_budget).
LinearCrossEntropyOptions lce_options(nb::handle options);
// policy_loss.cpp: the outputs, each None (not wanted) or a tensor.
PolicyLossOutputs policy_outputs(nb::handle loss, nb::handle per_token_loss, nb::handle kl, nb::handle is_clipped,
                                 nb::handle logp, nb::handle entropy, nb::handle lse);

}  // namespace logitless::bindings
