// Rotary embedding on the CPU: the oracle the CUDA kernels are tested against, and a real backend. It
// computes in double and rounds once to the dtype.
#include <vector>

#include "common/host_double.h"
#include "rope/problem.h"

namespace logitless::rope {
namespace {

constexpr int64_t kParallelElems = int64_t{1} << 16;

// The heads of one operand at token (b, t), given that token's cos and sin rows (c, s, Dr values each).
void rotate_token(const Problem& p, const Heads& x, int64_t b, int64_t t, const double* c, const double* s) {
  const int64_t D = p.head_dim, Dr = p.rot_dim, h = Dr / 2;
  const DType dt = p.dtype;
  for (int64_t head = 0; head < x.heads; ++head) {
    const int64_t io = b * x.in_strides[0] + head * x.in_strides[1] + t * x.in_strides[2];
    const int64_t oo = b * x.out_strides[0] + head * x.out_strides[1] + t * x.out_strides[2];
    for (int64_t i = 0; i < h; ++i) {
      // Both elements of the pair are read before either is written: out may be in itself.
      const double lo = load_double(x.in, dt, io + i), hi = load_double(x.in, dt, io + i + h);
      double out_lo, out_hi;
      if (!p.inverse) {
        out_lo = lo * c[i] - hi * s[i];
        out_hi = hi * c[i + h] + lo * s[i + h];
      } else {
        out_lo = lo * c[i] + hi * s[i + h];
        out_hi = hi * c[i + h] - lo * s[i];
      }
      store_double(x.out, dt, oo + i, out_lo);
      store_double(x.out, dt, oo + i + h, out_hi);
    }
    if (x.copy_pass)
      for (int64_t j = Dr; j < D; ++j) store_double(x.out, dt, oo + j, load_double(x.in, dt, io + j));
  }
}

}  // namespace

void run_cpu(const Problem& p) {
  const int64_t B = p.batch, T = p.seq, Dr = p.rot_dim;
  const int64_t work = B * T * (p.q.heads + p.k.heads) * p.head_dim;
#pragma omp parallel if (work >= kParallelElems)
  {
    std::vector<double> c(static_cast<size_t>(Dr)), s(static_cast<size_t>(Dr));
#pragma omp for schedule(static)
    for (int64_t bt = 0; bt < B * T; ++bt) {
      const int64_t b = bt / T, t = bt % T;
      int64_t co, so;
      if (p.positions) {
        // api.cpp has checked every position against the table's rows.
        const int64_t pos = load_index(p.positions, p.pos_dtype, b * p.pos_b + t * p.pos_t);
        co = pos * p.cos_t;
        so = pos * p.sin_t;
      } else {
        co = b * p.cos_b + t * p.cos_t;
        so = b * p.sin_b + t * p.sin_t;
      }
      for (int64_t j = 0; j < Dr; ++j) {
        c[j] = load_double(p.cos, p.cs_dtype, co + j);
        s[j] = load_double(p.sin, p.cs_dtype, so + j);
      }
      rotate_token(p, p.q, b, t, c.data(), s.data());
      if (p.k.heads > 0) rotate_token(p, p.k, b, t, c.data(), s.data());
    }
  }
}

}  // namespace logitless::rope
