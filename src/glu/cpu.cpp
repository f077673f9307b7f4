// GLU on the CPU: the oracle the CUDA kernels are tested against, and a real backend. It computes in double
// and rounds once to the dtype, so it is at least as accurate as the GPU's float32.
#include "common/host_double.h"
#include "glu/math.h"
#include "glu/problem.h"

namespace logitless::glu {
namespace {

// Below this many elements a call runs on one thread: an OpenMP team costs more than the work.
constexpr int64_t kParallelElems = int64_t{1} << 16;

// Rows are split into blocks of columns so that a single folded row (N * I elements) is spread over threads too.
constexpr int64_t kColumnBlock = 4096;

template <GLUActivation A>
void run(const Problem& p) {
  const int64_t W = p.width, blocks_per_row = (W + kColumnBlock - 1) / kColumnBlock;
  const int64_t blocks = p.n_rows * blocks_per_row;
  const DType dt = p.dtype;
#pragma omp parallel for schedule(static) if (p.n_rows * W >= kParallelElems)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t row = b / blocks_per_row, c0 = (b % blocks_per_row) * kColumnBlock;
    const int64_t c1 = c0 + kColumnBlock < W ? c0 + kColumnBlock : W;
    const int64_t go = p.gate_rows.offset(row), uo = p.up_rows.offset(row);
    if (!p.backward) {
      const int64_t yo = p.y_rows.offset(row);
      for (int64_t j = c0; j < c1; ++j) {
        // Both inputs are read before y is written: y may be gate or up.
        const double g = load_double(p.gate, dt, go + j), u = load_double(p.up, dt, uo + j);
        store_double(p.y, dt, yo + j, activation<A>(g, static_cast<double*>(nullptr)) * u);
      }
    } else {
      const int64_t dyo = p.grad_y_rows.offset(row), dgo = p.grad_gate_rows.offset(row),
                    duo = p.grad_up_rows.offset(row);
      for (int64_t j = c0; j < c1; ++j) {
        const double g = load_double(p.gate, dt, go + j), u = load_double(p.up, dt, uo + j),
                     dy = load_double(p.grad_y, dt, dyo + j);
        double dact = 0;
        const double act = activation<A>(g, &dact);
        store_double(p.grad_gate, dt, dgo + j, dy * u * dact);
        store_double(p.grad_up, dt, duo + j, dy * act);
      }
    }
  }
}

}  // namespace

void run_cpu(const Problem& p) {
  switch (p.activation) {
    case GLUActivation::kSiLU:
      return run<GLUActivation::kSiLU>(p);
    case GLUActivation::kGeluTanh:
      return run<GLUActivation::kGeluTanh>(p);
    case GLUActivation::kGelu:
      return run<GLUActivation::kGelu>(p);
  }
}

}  // namespace logitless::glu
