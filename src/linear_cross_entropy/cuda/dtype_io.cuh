// The linear head's element access (linear_head/cuda/dtype_io.cuh) under this family's names.
#pragma once

#include "linear_head/cuda/dtype_io.cuh"

namespace logitless::lce {
using head::load_as_float;
using head::store_as;
}  // namespace logitless::lce
