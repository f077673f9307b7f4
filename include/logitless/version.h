#pragma once

#define LOGITLESS_VERSION_MAJOR 0
#define LOGITLESS_VERSION_MINOR 1
#define LOGITLESS_VERSION_PATCH 0

namespace logitless {
const char* version();
// True when the library was built with its CUDA backend (a GPU may still be absent at run time).
bool built_with_cuda();
// Number of CUDA devices visible now (0 without a GPU or without the CUDA backend).
int cuda_device_count();
}  // namespace logitless
