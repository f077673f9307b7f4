// GLU forward and backward on CUDA: elementwise over rows, one read of each input and one write of each output.
//
// A CTA takes chunk c of row r (plan.h): thread t owns units c * chunk + t + k * blockDim.x, k < kUnitsPerThread, so
// each warp-wide access is one contiguous span. Every load of the chunk is issued before the first store (the
// loads are ordered volatile instructions, ldst.cuh), which is what makes an output that is its input itself safe
// (y over gate, grad_gate over gate, grad_up over up: the same thread reads an element before it writes it) and
// keeps 2 (forward) or 3 (backward) x kUnitsPerThread loads in flight per thread. The arithmetic is float32 with
// one rounding at the store.
#include <type_traits>

#include "common/cuda/check.cuh"
#include "common/cuda/ldst.cuh"
#include "common/cuda/vec.cuh"
#include "glu/cuda/params.h"
#include "glu/cuda/plan.h"
#include "glu/math.h"
#include "glu/problem.h"

namespace logitless::glu {
namespace {

// A unit of T: one 16-byte vector of Vec<T>::kN elements, or (kVector false) one element. Loaded units stay packed
// (Raw) until their turn to be computed: unpacked, the backward's 3 x kUnitsPerThread vectors of 16-bit elements
// would hold 48 registers where they hold 24.
template <typename T, bool kVector>
struct Unit {
  static constexpr int kN = kVector ? Vec<T>::kN : 1;
  using Raw = std::conditional_t<kVector, uint4, float>;
  __device__ static Raw load(const T* row, int64_t u) {
    if constexpr (kVector) {
      return ld16(row + u * kN);
    } else {
      return Vec<T>::load1(row + u);
    }
  }
  __device__ static void unpack(const Raw& r, float* f) {
    if constexpr (kVector) {
      Vec<T>::unpack(r, f);
    } else {
      f[0] = r;
    }
  }
  __device__ static void store(T* row, int64_t u, const float* f) {
    if constexpr (kVector) {
      st16(row + u * kN, Vec<T>::pack(f));
    } else {
      Vec<T>::store1(row + u, f[0]);
    }
  }
};

template <typename T, bool kVector, GLUActivation A>
__global__ void __launch_bounds__(kMaxThreads) glu_forward_kernel(const Params p) {
  using U = Unit<T, kVector>;
  constexpr int kN = U::kN;
  for (int64_t row = blockIdx.y; row < p.n_rows; row += gridDim.y) {
    const T* gate = static_cast<const T*>(p.gate) + p.gate_rows.offset(row);
    const T* up = static_cast<const T*>(p.up) + p.up_rows.offset(row);
    T* y = static_cast<T*>(p.y) + p.y_rows.offset(row);
    for (int64_t c = blockIdx.x; c < p.chunks; c += gridDim.x) {
      const int64_t u0 = c * blockDim.x * kUnitsPerThread + threadIdx.x;
      typename U::Raw g[kUnitsPerThread], u[kUnitsPerThread];
#pragma unroll
      for (int k = 0; k < kUnitsPerThread; ++k) {
        const int64_t i = u0 + static_cast<int64_t>(k) * blockDim.x;
        if (i < p.units) {
          g[k] = U::load(gate, i);
          u[k] = U::load(up, i);
        }
      }
#pragma unroll
      for (int k = 0; k < kUnitsPerThread; ++k) {
        const int64_t i = u0 + static_cast<int64_t>(k) * blockDim.x;
        if (i < p.units) {
          float gf[kN], out[kN];
          U::unpack(g[k], gf);
          U::unpack(u[k], out);
#pragma unroll
          for (int e = 0; e < kN; ++e) out[e] *= activation<A>(gf[e], static_cast<float*>(nullptr));
          U::store(y, i, out);
        }
      }
    }
  }
}

template <typename T, bool kVector, GLUActivation A>
__global__ void __launch_bounds__(kMaxThreads) glu_backward_kernel(const Params p) {
  using U = Unit<T, kVector>;
  constexpr int kN = U::kN;
  for (int64_t row = blockIdx.y; row < p.n_rows; row += gridDim.y) {
    const T* gate = static_cast<const T*>(p.gate) + p.gate_rows.offset(row);
    const T* up = static_cast<const T*>(p.up) + p.up_rows.offset(row);
    const T* dy = static_cast<const T*>(p.grad_y) + p.grad_y_rows.offset(row);
    T* dgate = static_cast<T*>(p.grad_gate) + p.grad_gate_rows.offset(row);
    T* dup = static_cast<T*>(p.grad_up) + p.grad_up_rows.offset(row);
    for (int64_t c = blockIdx.x; c < p.chunks; c += gridDim.x) {
      const int64_t u0 = c * blockDim.x * kUnitsPerThread + threadIdx.x;
      typename U::Raw g[kUnitsPerThread], u[kUnitsPerThread], d[kUnitsPerThread];
#pragma unroll
      for (int k = 0; k < kUnitsPerThread; ++k) {
        const int64_t i = u0 + static_cast<int64_t>(k) * blockDim.x;
        if (i < p.units) {
          d[k] = U::load(dy, i);
          g[k] = U::load(gate, i);
          u[k] = U::load(up, i);
        }
      }
#pragma unroll
      for (int k = 0; k < kUnitsPerThread; ++k) {
        const int64_t i = u0 + static_cast<int64_t>(k) * blockDim.x;
        if (i < p.units) {
          float gf[kN], dg[kN], du[kN];
          U::unpack(g[k], gf);
          U::unpack(u[k], dg);
          U::unpack(d[k], du);
#pragma unroll
          for (int e = 0; e < kN; ++e) {
            float dact;
            const float act = activation<A>(gf[e], &dact);
            dg[e] *= du[e] * dact;  // dy * up * act'(gate)
            du[e] *= act;           // dy * act(gate)
          }
          U::store(dgate, i, dg);
          U::store(dup, i, du);
        }
      }
    }
  }
}

using Kernel = void (*)(Params);

template <typename T, bool kVector>
Kernel pick(bool backward, GLUActivation a) {
  switch (a) {
    case GLUActivation::kSiLU:
      return backward ? glu_backward_kernel<T, kVector, GLUActivation::kSiLU>
                      : glu_forward_kernel<T, kVector, GLUActivation::kSiLU>;
    case GLUActivation::kGeluTanh:
      return backward ? glu_backward_kernel<T, kVector, GLUActivation::kGeluTanh>
                      : glu_forward_kernel<T, kVector, GLUActivation::kGeluTanh>;
    case GLUActivation::kGelu:
      return backward ? glu_backward_kernel<T, kVector, GLUActivation::kGelu>
                      : glu_forward_kernel<T, kVector, GLUActivation::kGelu>;
  }
  throw_invalid(str_cat("activation: expected silu, gelu_tanh or gelu, got ", static_cast<int>(a)));
}

template <typename T>
Kernel pick(bool backward, bool vector, GLUActivation a) {
  return vector ? pick<T, true>(backward, a) : pick<T, false>(backward, a);
}

Kernel pick(DType dtype, bool backward, bool vector, GLUActivation a) {
  switch (dtype) {
    case DType::kFloat32:
      return pick<float>(backward, vector, a);
    case DType::kFloat16:
      return pick<__half>(backward, vector, a);
    case DType::kBFloat16:
      return pick<__nv_bfloat16>(backward, vector, a);
    default:
      throw_invalid(str_cat("gate: expected dtype float32, float16 or bfloat16, got ", dtype_name(dtype)));
  }
}

// True when every row of the tensor starts 16-byte aligned (an absent tensor counts as aligned).
bool rows_aligned16(const void* base, const RowLayout& rows, int64_t n_rows, int64_t elem_bytes) {
  if (base == nullptr) return true;
  if (!aligned16(base)) return false;
  if (n_rows <= 1) return true;
  for (int d = 0; d < rows.nd; ++d)
    if (rows.sizes[d] > 1 && (rows.strides[d] * elem_bytes) % 16 != 0) return false;
  return true;
}

}  // namespace

void run_cuda(const Problem& p, StreamHandle stream) {
  if (p.n_rows == 0 || p.width == 0) return;
  DeviceGuard guard(p.device.index);
  const int64_t es = dtype_size(p.dtype);
  PlanInputs in;
  in.n_rows = p.n_rows;
  in.width = p.width;
  in.elem_bytes = static_cast<int>(es);
  in.vector_ok = rows_aligned16(p.gate, p.gate_rows, p.n_rows, es) && rows_aligned16(p.up, p.up_rows, p.n_rows, es);
  if (p.backward) {
    in.vector_ok = in.vector_ok && rows_aligned16(p.grad_y, p.grad_y_rows, p.n_rows, es) &&
                   rows_aligned16(p.grad_gate, p.grad_gate_rows, p.n_rows, es) &&
                   rows_aligned16(p.grad_up, p.grad_up_rows, p.n_rows, es);
  } else {
    in.vector_ok = in.vector_ok && rows_aligned16(p.y, p.y_rows, p.n_rows, es);
  }
  in.requested = p.algo;
  const Plan plan = plan_glu(in);
  if (plan.why_not)
    throw_invalid(
        str_cat("algo: expected a kernel that can run these arguments, got vector, which cannot: ", plan.why_not));
  const Kernel kernel = pick(p.dtype, p.backward, plan.vector, p.activation);

  Params kp;
  kp.gate = p.gate;
  kp.gate_rows = p.gate_rows;
  kp.up = p.up;
  kp.up_rows = p.up_rows;
  kp.grad_y = p.grad_y;
  kp.grad_y_rows = p.grad_y_rows;
  kp.y = p.y;
  kp.y_rows = p.y_rows;
  kp.grad_gate = p.grad_gate;
  kp.grad_gate_rows = p.grad_gate_rows;
  kp.grad_up = p.grad_up;
  kp.grad_up_rows = p.grad_up_rows;
  kp.n_rows = p.n_rows;
  kp.units = plan.units;
  kp.chunks = plan.chunks;
  kernel<<<dim3(static_cast<unsigned>(plan.grid_x), static_cast<unsigned>(plan.grid_y)), plan.threads, 0,
           static_cast<cudaStream_t>(stream)>>>(kp);
  if (p.backward) {
    LOGITLESS_CUDA_CHECK_LAUNCH("glu backward");
  } else {
    LOGITLESS_CUDA_CHECK_LAUNCH("glu forward");
  }
}

}  // namespace logitless::glu
