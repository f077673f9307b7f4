// Rotary embedding on CUDA: q and k in one launch, one read and (at most) one write of each element, and one read
// of the token's cos and sin row per pair of units (plan.h explains the CTA's shape).
//
// A thread reads both units of its pair (channels i and i + Dr/2) before it writes either, and all loads of its two
// heads before the first store (the loads are ordered volatile instructions, ldst.cuh): so an output that is its
// input itself (in place) is safe, and each thread has four 16-byte loads in flight. cos and sin go through the
// read-only path: no output may overlap them (api.cpp). Arithmetic in float32, one rounding at the store.
#include <type_traits>
#include <utility>

#include "common/cuda/check.cuh"
#include "common/cuda/ldst.cuh"
#include "common/cuda/vec.cuh"
#include "rope/cuda/params.h"
#include "rope/cuda/plan.h"
#include "rope/problem.h"

namespace logitless::rope {
namespace {

// Element e of 16 bytes of packed T (e a compile-time constant once unrolled, so the word is a register), and two
// floats packed into one 32-bit word of 16-bit T.
__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}
template <typename T>
__device__ __forceinline__ float element(const uint4& v, int e) {
  if constexpr (std::is_same_v<T, float>) {
    return __uint_as_float(word(v, e));
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const uint32_t w = word(v, e / 2);
    return __uint_as_float(e % 2 ? w & 0xFFFF0000u : w << 16);
  } else {
    const uint32_t w = word(v, e / 2);
    return __half2float(__ushort_as_half(static_cast<unsigned short>(e % 2 ? w >> 16 : w & 0xFFFFu)));
  }
}
template <typename T>
__device__ __forceinline__ uint32_t pack2(float a, float b) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
  } else {
    __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
  }
}

// The unit at channel u * kN of a cos or sin row of element type C (kN values: 16 bytes of T's elements, so 16 or 32
// bytes of C), held packed while the two heads that use it are rotated.
template <typename C, int kN>
struct TableUnit {
  static constexpr int kPerWord = 16 / static_cast<int>(sizeof(C));
  static constexpr int kWords = kN / kPerWord;
  static_assert(kN % kPerWord == 0, "a unit of the tables is whole 16-byte words");
  uint4 w[kWords];
  __device__ __forceinline__ void load(const C* row, int64_t u) {
#pragma unroll
    for (int q = 0; q < kWords; ++q) w[q] = ld16_nc(row + u * kN + q * kPerWord);
  }
  __device__ __forceinline__ void set_nan() {
    // Quiet NaNs in C's format: float 0x7FC00000, two bf16 0x7FC0 or two fp16 0x7E00 a word.
    const uint32_t n = std::is_same_v<C, float> ? 0x7FC00000u : std::is_same_v<C, __half> ? 0x7E007E00u : 0x7FC07FC0u;
#pragma unroll
    for (int q = 0; q < kWords; ++q) w[q] = make_uint4(n, n, n, n);
  }
  __device__ __forceinline__ float get(int e) const { return element<C>(w[e / kPerWord], e % kPerWord); }
};

// The vector path's rotation of one pair of units: lo, hi packed T; the outputs packed into out_lo, out_hi:
//   out_lo = x c_lo - sgn y s1,  out_hi = y c_hi + sgn x s2
// which is the forward with (sgn, s1, s2) = (1, s_lo, s_hi) and the inverse (rope.h's transpose) with
// (-1, s_hi, s_lo): the caller loads the sin units in that order. Element by element, a 32-bit word of output at
// a time, so that only a few floats are live at once.
template <typename T, typename C, int kN>
__device__ __forceinline__ void rotate_unit(const uint4& lo, const uint4& hi, const TableUnit<C, kN>& c_lo,
                                            const TableUnit<C, kN>& c_hi, const TableUnit<C, kN>& s1,
                                            const TableUnit<C, kN>& s2, float sgn, uint4& out_lo, uint4& out_hi) {
  constexpr int kPer = kN / 4;  // elements of T a 32-bit word
  uint32_t ol[4], oh[4];
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    float a[kPer], b[kPer];
#pragma unroll
    for (int q = 0; q < kPer; ++q) {
      const int e = w * kPer + q;
      const float x = element<T>(lo, e), y = element<T>(hi, e);
      a[q] = x * c_lo.get(e) - (sgn * y) * s1.get(e);
      b[q] = y * c_hi.get(e) + (sgn * x) * s2.get(e);
    }
    if constexpr (kPer == 1) {
      ol[w] = __float_as_uint(a[0]);
      oh[w] = __float_as_uint(b[0]);
    } else {
      ol[w] = pack2<T>(a[0], a[1]);
      oh[w] = pack2<T>(b[0], b[1]);
    }
  }
  out_lo = make_uint4(ol[0], ol[1], ol[2], ol[3]);
  out_hi = make_uint4(oh[0], oh[1], oh[2], oh[3]);
}

// The rows of the token (b, t) in head 0 of q and of k, inputs and outputs; head h (q's heads first, then k's) is
// a stride away. Computed once per token: per head only that one product remains.
template <typename T>
struct TokenBases {
  const T* q_in;
  T* q_out;
  const T* k_in;
  T* k_out;
};
template <typename T>
__device__ __forceinline__ TokenBases<T> token_bases(const Params& p, int64_t b, int64_t t) {
  TokenBases<T> r;
  r.q_in = static_cast<const T*>(p.q.in) + b * p.q.in_strides[0] + t * p.q.in_strides[2];
  r.q_out = static_cast<T*>(p.q.out) + b * p.q.out_strides[0] + t * p.q.out_strides[2];
  r.k_in = static_cast<const T*>(p.k.in) + b * p.k.in_strides[0] + t * p.k.in_strides[2];
  r.k_out = static_cast<T*>(p.k.out) + b * p.k.out_strides[0] + t * p.k.out_strides[2];
  return r;
}

template <typename T>
struct HeadRows {
  const T* in;
  T* out;
  bool copy_pass;
};
// Field by field: a reference to p.q or p.k picked at run time would copy the kernel's parameters to local memory.
template <typename T>
__device__ __forceinline__ HeadRows<T> head_rows(const Params& p, const TokenBases<T>& tb, int64_t h) {
  const bool is_q = h < p.q.heads;
  const int64_t hh = is_q ? h : h - p.q.heads;
  HeadRows<T> r;
  r.in = (is_q ? tb.q_in : tb.k_in) + hh * (is_q ? p.q.in_strides[1] : p.k.in_strides[1]);
  r.out = (is_q ? tb.q_out : tb.k_out) + hh * (is_q ? p.q.out_strides[1] : p.k.out_strides[1]);
  r.copy_pass = is_q ? p.q.copy_pass : p.k.copy_pass;
  return r;
}

// The token (b, t) of thread z of the CTA's current step, and the rows of cos and sin it uses; valid is false for a
// position outside the tables (nothing is read then: its rotated channels come out NaN).
template <typename C>
struct TokenRows {
  int64_t b, t;
  const C* cos;
  const C* sin;
  bool valid;
};
template <typename C>
__device__ __forceinline__ TokenRows<C> token_rows(const Params& p, int64_t tok) {
  TokenRows<C> r;
  r.b = tok / p.seq;
  r.t = tok - r.b * p.seq;
  r.valid = true;
  if (p.positions) {
    const int64_t at = r.b * p.pos_b + r.t * p.pos_t;
    const int64_t pos = p.pos64 ? __ldg(static_cast<const long long*>(p.positions) + at)
                                : __ldg(static_cast<const int*>(p.positions) + at);
    r.valid = pos >= 0 && pos < p.n_positions;
    const int64_t row = r.valid ? pos : 0;
    r.cos = static_cast<const C*>(p.cos) + row * p.cos_t;
    r.sin = static_cast<const C*>(p.sin) + row * p.sin_t;
  } else {
    r.cos = static_cast<const C*>(p.cos) + r.b * p.cos_b + r.t * p.cos_t;
    r.sin = static_cast<const C*>(p.sin) + r.b * p.sin_b + r.t * p.sin_t;
  }
  return r;
}

// The pass-through channels [Dr, D) of every head of the token, copied where the output is not the input itself.
// Items (head, unit) in 32 bits: a token has at most a few hundred heads of a few hundred units, and a 64-bit
// division costs tens of instructions.
template <typename T, int kN>
__device__ __forceinline__ void copy_pass(const Params& p, const TokenBases<T>& tb, int heads) {
  const int lane = threadIdx.y * blockDim.x + threadIdx.x, lanes = blockDim.x * blockDim.y;
  const int pass = static_cast<int>(p.pass_units), first = static_cast<int>(2 * p.pair_units);  // unit at channel Dr
  for (int it = lane; it < heads * pass; it += lanes) {
    const int h = it / pass, u = first + (it - h * pass);
    const HeadRows<T> r = head_rows<T>(p, tb, h);
    if (!r.copy_pass) continue;
    if constexpr (kN > 1) {
      st16(r.out + u * kN, ld16(r.in + u * kN));
    } else {
      r.out[u] = r.in[u];
    }
  }
}

// 16-byte units. C: the tables' element type (T, or float beside 16-bit T).
template <typename T, typename C>
__global__ void __launch_bounds__(kMaxThreads, kMinCtasPerSm) rope_vector(const Params p) {
  constexpr int kN = Vec<T>::kN;
  using Table = TableUnit<C, kN>;
  // Head and channel indices in 32 bits (a head has at most a few hundred units, a model a few hundred heads): the
  // kernel is register-bound, and every 64-bit index is two registers.
  const int heads = static_cast<int>(p.q.heads + p.k.heads), hstep = static_cast<int>(blockDim.y);
  const int pair_units = static_cast<int>(p.pair_units);
  const float sgn = p.inverse ? -1.f : 1.f;
  for (int64_t tok = static_cast<int64_t>(blockIdx.x) * blockDim.z + threadIdx.z; tok < p.tokens;
       tok += static_cast<int64_t>(gridDim.x) * blockDim.z) {
    const TokenRows<C> tr = token_rows<C>(p, tok);
    const TokenBases<T> tb = token_bases<T>(p, tr.b, tr.t);
    for (int pu = threadIdx.x; pu < pair_units; pu += blockDim.x) {
      const int hu = pu + pair_units;                                  // the unit at channel + Dr/2
      const int s1u = p.inverse ? hu : pu, s2u = p.inverse ? pu : hu;  // rotate_unit's s1 and s2
      // Two heads at a time, h and h + blockDim.y: their four loads and the pair's cos and sin before the stores.
      // The tables are read again for each two heads (from L1: the CTA's other head lanes read the same row) rather
      // than held across them, which took more registers than the kernel had to spare at full occupancy.
      for (int h = threadIdx.y; h < heads; h += 2 * hstep) {
        const bool second = h + hstep < heads;
        const HeadRows<T> r0 = head_rows<T>(p, tb, h);
        const HeadRows<T> r1 = head_rows<T>(p, tb, second ? h + hstep : h);
        uint4 lo[2], hi[2];
        lo[0] = ld16(r0.in + pu * kN);
        hi[0] = ld16(r0.in + hu * kN);
        if (second) {
          lo[1] = ld16(r1.in + pu * kN);
          hi[1] = ld16(r1.in + hu * kN);
        }
        Table c_lo, c_hi, s1, s2;
        if (tr.valid) {
          c_lo.load(tr.cos, pu), c_hi.load(tr.cos, hu), s1.load(tr.sin, s1u), s2.load(tr.sin, s2u);
        } else {
          c_lo.set_nan(), c_hi.set_nan(), s1.set_nan(), s2.set_nan();
        }
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          if (j == 1 && !second) break;
          uint4 out_lo, out_hi;
          rotate_unit<T, C, kN>(lo[j], hi[j], c_lo, c_hi, s1, s2, sgn, out_lo, out_hi);
          T* out = j == 0 ? r0.out : r1.out;
          st16(out + pu * kN, out_lo);
          st16(out + hu * kN, out_hi);
        }
      }
    }
    if (p.pass_units > 0) copy_pass<T, kN>(p, tb, heads);
  }
}

// Element accesses, any alignment: the same walk with units of one element.
template <typename T, typename C>
__global__ void __launch_bounds__(kMaxThreads) rope_scalar(const Params p) {
  const int heads = static_cast<int>(p.q.heads + p.k.heads), hstep = static_cast<int>(blockDim.y);
  const float sgn = p.inverse ? -1.f : 1.f;
  for (int64_t tok = static_cast<int64_t>(blockIdx.x) * blockDim.z + threadIdx.z; tok < p.tokens;
       tok += static_cast<int64_t>(gridDim.x) * blockDim.z) {
    const TokenRows<C> tr = token_rows<C>(p, tok);
    const TokenBases<T> tb = token_bases<T>(p, tr.b, tr.t);
    for (int64_t i = threadIdx.x; i < p.pair_units; i += blockDim.x) {
      const int64_t j = i + p.pair_units;
      const float nan = __int_as_float(0x7FC00000);
      // As rotate_unit: out_i = x c_i - sgn y s1, out_j = y c_j + sgn x s2.
      const float c_lo = tr.valid ? Vec<C>::load1(tr.cos + i) : nan, c_hi = tr.valid ? Vec<C>::load1(tr.cos + j) : nan;
      const float s1 = tr.valid ? Vec<C>::load1(tr.sin + (p.inverse ? j : i)) : nan;
      const float s2 = tr.valid ? Vec<C>::load1(tr.sin + (p.inverse ? i : j)) : nan;
      for (int h = threadIdx.y; h < heads; h += hstep) {
        const HeadRows<T> r = head_rows<T>(p, tb, h);
        const float x = Vec<T>::load1(r.in + i), y = Vec<T>::load1(r.in + j);
        Vec<T>::store1(r.out + i, x * c_lo - (sgn * y) * s1);
        Vec<T>::store1(r.out + j, y * c_hi + (sgn * x) * s2);
      }
    }
    if (p.pass_units > 0) copy_pass<T, 1>(p, tb, heads);
  }
}

using Kernel = void (*)(Params);

template <typename T, typename C>
Kernel pick(bool vector) {
  return vector ? rope_vector<T, C> : rope_scalar<T, C>;
}

Kernel pick(DType dtype, bool cs_f32, bool vector) {
  switch (dtype) {
    case DType::kFloat32:
      return pick<float, float>(vector);
    case DType::kFloat16:
      return cs_f32 ? pick<__half, float>(vector) : pick<__half, __half>(vector);
    case DType::kBFloat16:
      return cs_f32 ? pick<__nv_bfloat16, float>(vector) : pick<__nv_bfloat16, __nv_bfloat16>(vector);
    default:
      throw_invalid(str_cat("q: expected dtype float32, float16 or bfloat16, got ", dtype_name(dtype)));
  }
}

bool strides_aligned16(const int64_t* strides, int n, int64_t elem_bytes) {
  for (int d = 0; d < n; ++d)
    if ((strides[d] * elem_bytes) % 16 != 0) return false;
  return true;
}

bool operand_aligned16(const Heads& h, int64_t es) {
  if (h.heads == 0) return true;
  return aligned16(h.in) && aligned16(h.out) && strides_aligned16(h.in_strides, 3, es) &&
         strides_aligned16(h.out_strides, 3, es);
}

}  // namespace

void run_cuda(const Problem& p, StreamHandle stream) {
  const int64_t tokens = p.batch * p.seq;
  if (tokens == 0 || p.q.heads + p.k.heads == 0) return;
  DeviceGuard guard(p.device.index);
  const int64_t es = dtype_size(p.dtype), cs_es = dtype_size(p.cs_dtype);
  PlanInputs in;
  in.tokens = tokens;
  in.heads = p.q.heads + p.k.heads;
  in.head_dim = p.head_dim;
  in.rot_dim = p.rot_dim;
  in.elem_bytes = static_cast<int>(es);
  const int64_t cs_strides[] = {p.cos_b, p.cos_t, p.sin_b, p.sin_t};
  in.vector_ok = operand_aligned16(p.q, es) && operand_aligned16(p.k, es) && aligned16(p.cos) && aligned16(p.sin) &&
                 strides_aligned16(cs_strides, 4, cs_es) && (p.rot_dim / 2 * cs_es) % 16 == 0;
  in.requested = p.algo;
  const Plan plan = plan_rope(in);
  if (plan.why_not)
    throw_invalid(
        str_cat("algo: expected a kernel that can run these arguments, got vector, which cannot: ", plan.why_not));

  Params kp;
  for (const auto& [dst, src] : {std::pair<Operand*, const Heads*>{&kp.q, &p.q}, {&kp.k, &p.k}}) {
    dst->in = src->in;
    dst->out = src->out;
    dst->heads = src->heads;
    for (int d = 0; d < 3; ++d) {
      dst->in_strides[d] = src->in_strides[d];
      dst->out_strides[d] = src->out_strides[d];
    }
    dst->copy_pass = src->copy_pass;
  }
  kp.seq = p.seq;
  kp.tokens = tokens;
  kp.half = p.rot_dim / 2;
  kp.rot_dim = p.rot_dim;
  kp.pair_units = plan.pair_units;
  kp.pass_units = plan.pass_units;
  kp.cos = p.cos;
  kp.sin = p.sin;
  kp.cos_b = p.cos_b;
  kp.cos_t = p.cos_t;
  kp.sin_b = p.sin_b;
  kp.sin_t = p.sin_t;
  kp.cs_f32 = p.cs_dtype == DType::kFloat32 && p.dtype != DType::kFloat32;
  kp.positions = p.positions;
  kp.pos64 = p.pos_dtype == DType::kInt64;
  kp.pos_b = p.pos_b;
  kp.pos_t = p.pos_t;
  kp.n_positions = p.n_positions;
  kp.inverse = p.inverse;
  const Kernel kernel = pick(p.dtype, kp.cs_f32, plan.vector);
  kernel<<<static_cast<unsigned>(plan.grid), dim3(plan.x, plan.y, plan.z), 0, static_cast<cudaStream_t>(stream)>>>(kp);
  LOGITLESS_CUDA_CHECK_LAUNCH("rope");
}

}  // namespace logitless::rope
