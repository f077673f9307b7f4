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

}  // namespace logitless::bindings
