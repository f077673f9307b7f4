// Cross-entropy of two rows on the CPU backend through the public API, checked against the formula.
#include <cmath>
#include <cstdio>

#include "logitless/logitless.h"

int main() {
  using namespace logitless;
  float logits[2][4] = {{1.f, 2.f, 0.5f, -1.f}, {0.f, 0.f, 3.f, 1.f}};
  int64_t target[2] = {1, 2};
  float loss = 0.f;
  const Device cpu{DeviceType::kCPU, 0};
  CrossEntropyOptions opt;  // torch's defaults: mean over the rows, ignore_index -100
  cross_entropy_forward(TensorView::make(logits, DType::kFloat32, cpu, {2, 4}),
                        TensorView::make(target, DType::kInt64, cpu, {2}), TensorView{}, opt,
                        TensorView::make(&loss, DType::kFloat32, cpu, {}), TensorView{}, TensorView{}, Workspace{},
                        nullptr);
  double expect = 0;
  for (int i = 0; i < 2; ++i) {
    double s = 0;
    for (float v : logits[i]) s += std::exp(static_cast<double>(v));
    expect += (std::log(s) - logits[i][target[i]]) / 2;
  }
  std::printf("logitless %s: loss %.6f, expected %.6f\n", version(), loss, expect);
  return std::abs(loss - expect) < 1e-5 ? 0 : 1;
}
