// Rotary embedding: argument validation and dispatch. Every check happens here, before any backend runs, so
// a bad call never touches memory.
#include <vector>

#include "common/check.h"
#include "common/host_float.h"
#include "common/layout.h"
#include "common/overlap.h"
#include "logitless/rope.h"
#include "rope/problem.h"

namespace logitless {
namespace {

using rope::Problem;

bool float_ok(const TensorView& t) {
  return t.dtype == DType::kFloat32 || t.dtype == DType::kFloat16 || t.dtype == DType::kBFloat16 ||
         (t.dtype == DType::kFloat64 && t.device.type == DeviceType::kCPU);
}

void check_last_contiguous(const TensorView& t, const char* name) {
  LOGITLESS_CHECK_ARG(t.stride(-1) == 1 || t.size(-1) <= 1, name, "a last dimension with stride 1",
                      str_cat("stride ", t.stride(-1)));
}

// q: [B, Hq, T, D].
void check_q(const TensorView& q) {
  check_defined(q, "q");
  LOGITLESS_CHECK_ARG(q.device.type == DeviceType::kCPU || q.device.type == DeviceType::kCUDA, "q",
                      "a CPU or CUDA tensor", static_cast<int>(q.device.type));
  LOGITLESS_CHECK_ARG(float_ok(q), "q",
                      q.device.type == DeviceType::kCPU ? "dtype float32, float16, bfloat16 or float64"
                                                        : "dtype float32, float16 or bfloat16 (float64 on the CPU)",
                      dtype_name(q.dtype));
  LOGITLESS_CHECK_ARG(q.ndim == 4, "q", "4 dimensions ([B, H, T, D])", str_cat("shape ", shape_str(q)));
  check_last_contiguous(q, "q");
  check_nonnull(q, "q");
}

// A [B, H, T, D] tensor of the call with q's dtype, device, B, T and D; `heads` its H (-1: any).
void check_heads_like(const TensorView& t, const char* name, const TensorView& q, int64_t heads) {
  check_defined(t, name);
  LOGITLESS_CHECK_ARG(t.dtype == q.dtype, name, str_cat("dtype ", dtype_name(q.dtype), " (q's)"), dtype_name(t.dtype));
  check_device(t, name, q.device);
  const bool ok = t.ndim == 4 && t.sizes[0] == q.sizes[0] && t.sizes[2] == q.sizes[2] && t.sizes[3] == q.sizes[3] &&
                  (heads < 0 || t.sizes[1] == heads);
  LOGITLESS_CHECK_ARG(ok, name,
                      heads < 0
                          ? str_cat("shape [", q.sizes[0], ", H, ", q.sizes[2], ", ", q.sizes[3], "] (q's B, T, D)")
                          : str_cat("shape [", q.sizes[0], ", ", heads, ", ", q.sizes[2], ", ", q.sizes[3], "]"),
                      str_cat("shape ", shape_str(t)));
  check_last_contiguous(t, name);
  check_nonnull(t, name);
}

// Rows of D elements of a [B, H, T, D] output must not share memory (a broadcast head, a stride < D).
void check_rows_disjoint(const TensorView& t, const char* name) {
  if (t.numel() == 0) return;
  const auto L = collapse_rows(t.sizes, 3, {t.strides}, name);
  LOGITLESS_CHECK_ARG(rows_disjoint(L[0], t.sizes[3]), name, "rows of D elements that do not overlap",
                      "overlapping rows (a broadcast or a stride < D)");
}

void fill_heads(rope::Heads& h, const TensorView& in, const TensorView& out) {
  h.in = in.data;
  h.out = out.data;
  h.heads = in.sizes[1];
  for (int d = 0; d < 3; ++d) {
    // Strides of dimensions of size 1 are never multiplied by anything but 0; zero them so that the kernels'
    // alignment test does not trip over an arbitrary one.
    h.in_strides[d] = in.sizes[d] == 1 ? 0 : in.strides[d];
    h.out_strides[d] = out.sizes[d] == 1 ? 0 : out.strides[d];
  }
  h.copy_pass = !same_view(in, out);
}

}  // namespace

void rope_apply(const TensorView& q, const TensorView& k, const TensorView& cos, const TensorView& sin,
                const TensorView& position_ids, const RopeOptions& options, const TensorView& q_out,
                const TensorView& k_out, StreamHandle stream) {
  LOGITLESS_CHECK_ARG(
      options.algo == RopeAlgo::kAuto || options.algo == RopeAlgo::kVector || options.algo == RopeAlgo::kScalar, "algo",
      "auto, vector or scalar", static_cast<int>(options.algo));
  check_q(q);
  const int64_t B = q.sizes[0], T = q.sizes[2], D = q.sizes[3];
  const bool has_k = k.defined();
  if (has_k) check_heads_like(k, "k", q, -1);
  // The kernels index a token's heads and channels in 32 bits.
  const int64_t token_elems = (q.sizes[1] + (has_k ? k.sizes[1] : 0)) * D;
  LOGITLESS_CHECK_ARG(token_elems <= 0x7FFFFFFF, "q", "at most 2^31 - 1 elements of q and k a token", token_elems);
  check_heads_like(q_out, "q_out", q, q.sizes[1]);
  if (has_k) {
    LOGITLESS_CHECK_ARG(k_out.defined(), "k_out", "a tensor (k was given)", "None");
    check_heads_like(k_out, "k_out", q, k.sizes[1]);
  } else {
    LOGITLESS_CHECK_ARG(!k_out.defined(), "k_out", "None (no k was given)", "a tensor");
  }

  // cos and sin: the same dtype (float32 or q's), shape and device.
  check_defined(cos, "cos");
  check_defined(sin, "sin");
  LOGITLESS_CHECK_ARG(cos.dtype == q.dtype || cos.dtype == DType::kFloat32, "cos",
                      str_cat("dtype ", dtype_name(q.dtype), " (q's) or float32"), dtype_name(cos.dtype));
  LOGITLESS_CHECK_ARG(sin.dtype == cos.dtype, "sin", str_cat("dtype ", dtype_name(cos.dtype), " (cos's)"),
                      dtype_name(sin.dtype));
  check_device(cos, "cos", q.device);
  check_device(sin, "sin", q.device);
  LOGITLESS_CHECK_ARG(cos.ndim >= 1, "cos", "at least 1 dimension", "a 0-d tensor");
  check_shape(sin, "sin", cos, cos.ndim, "cos's shape");
  check_last_contiguous(cos, "cos");
  check_last_contiguous(sin, "sin");
  check_nonnull(cos, "cos");
  check_nonnull(sin, "sin");
  const int64_t Dr = cos.size(-1);
  LOGITLESS_CHECK_ARG(Dr >= 2 && Dr % 2 == 0 && Dr <= D, "cos",
                      str_cat("a last dimension (the rotary width) that is even and in [2, ", D, "] (q's head dim)"),
                      str_cat("shape ", shape_str(cos)));

  Problem p;
  p.batch = B;
  p.seq = T;
  p.head_dim = D;
  p.rot_dim = Dr;
  p.dtype = q.dtype;
  p.cs_dtype = cos.dtype;
  p.device = q.device;
  p.inverse = options.inverse;
  p.algo = options.algo;
  p.cos = cos.data;
  p.sin = sin.data;

  const bool has_pos = position_ids.defined();
  if (has_pos) {
    check_index_dtype(position_ids, "position_ids");
    check_device(position_ids, "position_ids", q.device);
    const bool ok = (position_ids.ndim == 1 && position_ids.sizes[0] == T) ||
                    (position_ids.ndim == 2 && (position_ids.sizes[0] == B || position_ids.sizes[0] == 1) &&
                     position_ids.sizes[1] == T);
    LOGITLESS_CHECK_ARG(ok, "position_ids", str_cat("shape [", B, ", ", T, "], [1, ", T, "] or [", T, "]"),
                        str_cat("shape ", shape_str(position_ids)));
    check_nonnull(position_ids, "position_ids");
    LOGITLESS_CHECK_ARG(cos.ndim == 2, "cos", "shape [P, Dr] (a table indexed by position_ids)",
                        str_cat("shape ", shape_str(cos)));
    p.positions = position_ids.data;
    p.pos_dtype = position_ids.dtype;
    if (position_ids.ndim == 1) {
      p.pos_t = position_ids.strides[0];
    } else {
      p.pos_b = position_ids.sizes[0] == 1 ? 0 : position_ids.strides[0];
      p.pos_t = position_ids.strides[1];
    }
    p.n_positions = cos.sizes[0];
    p.cos_t = cos.strides[0];
    p.sin_t = sin.strides[0];
  } else {
    const bool ok = (cos.ndim == 2 && cos.sizes[0] == T) ||
                    (cos.ndim == 3 && (cos.sizes[0] == B || cos.sizes[0] == 1) && cos.sizes[1] == T);
    LOGITLESS_CHECK_ARG(ok, "cos", str_cat("shape [", B, ", ", T, ", Dr], [1, ", T, ", Dr] or [", T, ", Dr]"),
                        str_cat("shape ", shape_str(cos)));
    if (cos.ndim == 2) {
      p.cos_t = cos.strides[0];
      p.sin_t = sin.strides[0];
    } else {
      p.cos_b = cos.sizes[0] == 1 ? 0 : cos.strides[0];
      p.sin_b = sin.sizes[0] == 1 ? 0 : sin.strides[0];
      p.cos_t = cos.strides[1];
      p.sin_t = sin.strides[1];
    }
    if (T == 1) p.cos_t = p.sin_t = 0;  // never multiplied by anything but 0
  }

  // In place: q_out may be q itself, k_out k itself. Nothing else may overlap an output.
  check_rows_disjoint(q_out, "q_out");
  check_output_vs(q_out, "q_out", q, "q", true);
  check_output_vs(q_out, "q_out", k, "k", false);
  check_output_vs(q_out, "q_out", cos, "cos", false);
  check_output_vs(q_out, "q_out", sin, "sin", false);
  check_output_vs(q_out, "q_out", position_ids, "position_ids", false);
  if (has_k) {
    check_rows_disjoint(k_out, "k_out");
    check_output_vs(k_out, "k_out", k, "k", true);
    check_output_vs(k_out, "k_out", q, "q", false);
    check_output_vs(k_out, "k_out", q_out, "q_out", false);
    check_output_vs(k_out, "k_out", cos, "cos", false);
    check_output_vs(k_out, "k_out", sin, "sin", false);
    check_output_vs(k_out, "k_out", position_ids, "position_ids", false);
  }
  fill_heads(p.q, q, q_out);
  if (has_k) fill_heads(p.k, k, k_out);

  if (B == 0 || T == 0 || (p.q.heads == 0 && p.k.heads == 0)) return;
  if (q.device.type == DeviceType::kCPU) {
    // The CPU backend can afford to look at the positions first: one out of range is a bad argument.
    if (has_pos) {
      const int64_t rows = position_ids.ndim == 2 ? position_ids.sizes[0] : 1;
      for (int64_t b = 0; b < rows; ++b)
        for (int64_t t = 0; t < T; ++t) {
          const int64_t pos = load_index(position_ids.data, position_ids.dtype, b * p.pos_b + t * p.pos_t);
          if (pos < 0 || pos >= p.n_positions)
            throw_expected("position_ids", str_cat("values in [0, ", p.n_positions, ") (the rows of cos and sin)"),
                           str_cat(pos, " at [", b, ", ", t, "]"));
        }
    }
    (void)stream;
    rope::run_cpu(p);
    return;
  }
#if defined(LOGITLESS_WITH_CUDA)
  check_cuda_target("q", q.device, stream);
  rope::run_cuda(p, stream);
#else
  throw_runtime("rope: logitless was built without its CUDA backend; CUDA tensors are not supported");
#endif
}

}  // namespace logitless
