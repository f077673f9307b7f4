#include <gtest/gtest.h>

#include <cstdio>

#include "test_util.h"

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  std::printf("logitless %s, CUDA backend %s, %d GPU(s) visible\n", logitless::version(),
              logitless::built_with_cuda() ? "built" : "not built", logitless::cuda_device_count());
  return RUN_ALL_TESTS();
}
