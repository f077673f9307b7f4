// Stand-ins for the device queries when the library is built without its CUDA backend.
#include "logitless/version.h"

namespace logitless {
bool built_with_cuda() { return false; }
int cuda_device_count() { return 0; }
}  // namespace logitless
