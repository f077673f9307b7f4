// The generic CUDA path (any GPU from sm_80): cuBLAS GEMMs per chunk, the cross-entropy family's row kernel
// for each chunk's statistics, and this family's gradient kernel in between. Host code only: it sequences
// launches on the caller's stream and never synchronizes, except to report a bad target (eagerly, once per
// call, and not while a CUDA graph is captured).
//
// Per call: prepass (targets to contiguous int64, the mean's denominator, the first bad target), then
//   forward:             per token chunk: Z = X_c Wᵀ (+b) in float32; cross-entropy forward -> loss rows, lse
//   gradient in forward: per token chunk as above, then dZ = d(loss)/dZ in the inputs' dtype into the group's
//                        buffer; per group: dX_g = dZ_g W, dW (+)= dZ_gᵀ X_g (float32 accumulation), db += Σ dZ
//                        (fused, params.h's ExpGradParams: per token group the GEMM writes E = exp(Z - shift) and
//                        the statistics; per row the scale s and E's target element; dX_g = s ⊙ (E_g W),
//                        dW (+)= E_gᵀ (s ⊙ X_g))
//   backward:            per vocabulary chunk v: Z = X W_vᵀ (+b_v); dZ from the saved lse; dX (+)= dZ W_v;
//                        dW_v = dZᵀ X (final: every token is in this product); db_v = Σ dZ
// and for a vocabulary shard (include/logitless/vocab_parallel.h), whose weight rows are classes offset + j:
//   partials:            per token chunk: Z = X_c W_rᵀ (+b_r); the cross-entropy family's shard partials
//   backward:            as above, the gradient kernel comparing targets in global classes
//   steps:               logits(k): Z_k into slot k % 2, its partials; gradient(k): the family's finalize of the
//                        chunk's gathered partials -> lse and losses; dZ_k into the group buffer (or in place);
//                        a group's GEMMs after its last chunk; the last chunk finishes dW, db and the loss
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>

#include "common/cuda/check.cuh"
#include "common/cuda/cublas.h"
#include "linear_cross_entropy/cuda/kernels.h"
#include "linear_cross_entropy/cuda/kernels_hopper.h"
#include "linear_cross_entropy/cuda/plan.h"
#include "linear_cross_entropy/problem.h"
#include "logitless/cross_entropy.h"
#include "logitless/vocab_parallel.h"

namespace logitless::lce {
namespace {

CrossEntropyOptions ce_options(const LinearCrossEntropyOptions& o) {
  CrossEntropyOptions c;
  c.ignore_index = o.ignore_index;
  c.reduction = Reduction::kNone;  // per token; this file reduces over the chunks
  c.label_smoothing = o.label_smoothing;
  c.z_loss = o.z_loss;
  c.softcap = o.softcap;
  c.check_targets = false;  // the prepass checked every token once
  return c;
}

Pass pass_of(Mode m) {
  switch (m) {
    case Mode::kForward:
    case Mode::kPartials:
      return Pass::kForward;
    case Mode::kBackward:
      return Pass::kBackward;
    default:
      return Pass::kForwardBackward;
  }
}

bool is_step(Mode m) { return m == Mode::kStepLogits || m == Mode::kStepGradient; }

// On unless the environment says LOGITLESS_LCE_KERNEL=generic (for benchmarks: the same process cannot switch
// through the Python module); tests switch it with debug::set_fused_kernels.
bool fused_default() {
  const char* v = std::getenv("LOGITLESS_LCE_KERNEL");
  return v == nullptr || std::strcmp(v, "generic") != 0;
}
std::atomic<bool> g_fused_enabled{fused_default()};
// The gradient in forward's exponential form (params.h, ExpGradParams) is the fastest plan for bfloat16, but its
// grad_weight error exceeds the library's bound relative to torch's own bfloat16 error (the target element and
// hidden scaled by row are each rounded to bfloat16; bench/RESULTS.md, "Accuracy against float64"). So it is off
// unless the environment says LOGITLESS_LCE_EXP_FORM=1 (benchmarks); tests switch it with debug::set_exp_form.
bool exp_form_default() {
  const char* v = std::getenv("LOGITLESS_LCE_EXP_FORM");
  return v != nullptr && std::strcmp(v, "1") == 0;
}
std::atomic<bool> g_exp_form_enabled{exp_form_default()};
std::atomic<bool> g_force_fixups{false};
thread_local Kernel t_last_kernel = Kernel::kCublasChunked;

// Whether the fused Hopper kernels can run this call (the planner picks them for the forward and the backward):
// one device's calls (a backward of a vocabulary shard too), on operands a TMA descriptor takes. hidden's copy (rows
// without one stride) is contiguous in the workspace, whose pointer run_cuda checks.
bool fused_allowed(const Problem& p) {
  if (!g_fused_enabled.load(std::memory_order_relaxed)) return false;
  if (p.mode != Mode::kForward && p.mode != Mode::kForwardBackward && p.mode != Mode::kBackward) return false;
  const void* x = p.hidden_uniform ? p.hidden_data : nullptr;
  const int64_t ldx = p.hidden_uniform ? p.hidden_ld : p.hidden;
  return fused_gemm_supported(p.device.index, p.dtype, x, ldx, p.weight.data, p.weight.ld, p.hidden);
}

PlanInputs plan_inputs(const Problem& p) {
  PlanInputs in;
  in.pass = pass_of(p.mode);
  in.n = p.n_tokens;
  in.h = p.hidden;
  in.v = p.vocab;
  in.elem_bytes = static_cast<int>(dtype_size(p.dtype));
  in.need_dx = p.grad_hidden.data != nullptr;
  in.need_dw = p.grad_weight.data != nullptr;
  in.need_db = p.grad_bias != nullptr;
  in.grad_hidden_f32 = in.need_dx && p.grad_hidden.dtype == DType::kFloat32;
  in.grad_weight_f32 = in.need_dw && p.grad_weight.dtype == DType::kFloat32;
  in.copy_hidden = !p.hidden_uniform;
  // The partials go to the caller; no per-token loss is reduced here.
  in.reduction_none = p.options.reduction == Reduction::kNone || p.mode == Mode::kPartials;
  // Not only with class weights (where the z-loss terms' divisor differs): the workspace queries do not see them.
  in.z_rows = p.options.reduction == Reduction::kMean && p.options.z_loss != 0.0;
  in.steps = is_step(p.mode);
  in.fused = fused_allowed(p);
  in.fused_exp = g_exp_form_enabled.load(std::memory_order_relaxed) && p.dtype == DType::kBFloat16 &&
                 p.options.softcap == 0.0 && p.options.label_smoothing == 0.0;
  in.chunk_tokens = p.options.chunk_tokens;
  in.chunk_vocab = p.options.chunk_vocab;
  in.memory_budget = p.options.memory_budget;
  in.cublas_workspace_bytes = cublas_workspace_for(device_info(p.device.index).sm_major);
  const Device dev = p.device;
  const int64_t V = p.vocab;
  const CrossEntropyOptions co = ce_options(p.options);
  in.ce_workspace_bytes = [dev, V, co](int64_t rows) {
    const TensorView logits = TensorView::make(nullptr, DType::kFloat32, dev, {rows, V});
    const TensorView target = TensorView::make(nullptr, DType::kInt64, dev, {rows});
    return cross_entropy_workspace_bytes(logits, target, TensorView{}, co);
  };
  return in;
}

// Reads the first bad target back and throws; called only when it is safe to synchronize.
void throw_if_bad_target(const Problem& p, const Scalars* scalars, const int64_t* targets, cudaStream_t stream) {
  long long first_bad = 0;
  LOGITLESS_CUDA_CHECK(
      cudaMemcpyAsync(&first_bad, &scalars->first_bad, sizeof(first_bad), cudaMemcpyDeviceToHost, stream));
  LOGITLESS_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (first_bad >= p.n_tokens) return;
  int64_t value = 0;
  LOGITLESS_CUDA_CHECK(cudaMemcpy(&value, targets + first_bad, sizeof(value), cudaMemcpyDeviceToHost));
  throw_invalid(str_cat("target: expected values in [0, ", p.vocab_total, ") or ignore_index (", p.options.ignore_index,
                        "), got ", value, " at row ", first_bad, " (the first bad row)"));
}

// Everything one call needs, resolved against its workspace.
struct Run {
  const Problem& p;
  const Plan& plan;
  cudaStream_t stream;
  char* ws;
  int sm_count = 0;
  Scalars* scalars = nullptr;
  int64_t* targets = nullptr;
  cublasHandle_t blas = nullptr;
  const void* x = nullptr;  // hidden rows as a GEMM operand [N, H] (ldx)
  int64_t ldx = 0;

  template <typename T>
  T* at(size_t off) const {
    return off == Plan::kNone ? nullptr : reinterpret_cast<T*>(ws + off);
  }

  const void* weight_rows(int64_t v0) const {
    return static_cast<const char*>(p.weight.data) + v0 * p.weight.ld * dtype_size(p.dtype);
  }
  const void* hidden_rows(int64_t r0) const { return static_cast<const char*>(x) + r0 * ldx * dtype_size(p.dtype); }

  // Z [rows, width] (float32, ld) = X[r0 : r0 + rows] · W[v0 : v0 + width]ᵀ (+ bias[v0 : v0 + width]).
  void logits(float* z, int64_t ld, int64_t r0, int64_t rows, int64_t v0, int64_t width) const {
    if (p.bias) launch_fill_bias(z, ld, rows, width, p.bias, p.bias_dtype, p.bias_stride, v0, sm_count, stream);
    gemm_row_major(blas, false, true, rows, width, p.hidden, hidden_rows(r0), ldx, weight_rows(v0), p.weight.ld,
                   p.dtype, z, ld, DType::kFloat32, /*accumulate=*/p.bias != nullptr);
  }

  // The cross-entropy family's forward over a chunk of float32 logits: per-token loss, lse and (where the plan
  // keeps them) z-loss terms.
  void row_stats(const float* z, int64_t ld, int64_t r0, int64_t rows, float* loss_rows, float* lse_rows) const {
    const TensorView zv = TensorView::make(const_cast<float*>(z), DType::kFloat32, p.device, {rows, p.vocab}, {ld, 1});
    const TensorView tv = TensorView::make(targets + r0, DType::kInt64, p.device, {rows});
    const TensorView wv = p.class_weight ? TensorView::make(const_cast<float*>(p.class_weight), DType::kFloat32,
                                                            p.device, {p.vocab}, {p.class_weight_stride})
                                         : TensorView{};
    const TensorView lv = TensorView::make(loss_rows, DType::kFloat32, p.device, {rows});
    const TensorView sv = lse_rows ? TensorView::make(lse_rows, DType::kFloat32, p.device, {rows}) : TensorView{};
    cross_entropy_forward(zv, tv, wv, ce_options(p.options), lv, sv, z_view(r0, rows),
                          Workspace{at<char>(plan.off_ce), plan.ce_bytes}, stream);
  }

  // The z-loss terms of tokens [r0, r0 + rows): a float32 view of the plan's region, or none.
  float* z_rows(int64_t r0) const { return plan.off_row_z == Plan::kNone ? nullptr : at<float>(plan.off_row_z) + r0; }
  TensorView z_view(int64_t r0, int64_t rows) const {
    float* zr = z_rows(r0);
    return zr ? TensorView::make(zr, DType::kFloat32, p.device, {rows}) : TensorView{};
  }

  bool fused() const { return plan.kernel == Kernel::kHopperFused; }

  // The fused GEMM of tokens [r0, r0 + rows) against classes [v0, v0 + cols).
  FusedGemmParams fused_params(int64_t r0, int64_t rows, int64_t v0, int64_t cols) const {
    FusedGemmParams f;
    f.dtype = p.dtype;
    f.x = hidden_rows(r0);
    f.ldx = ldx;
    f.w = weight_rows(v0);
    f.ldw = p.weight.ld;
    f.m = rows;
    f.n = cols;
    f.k = p.hidden;
    f.col0 = v0;
    f.bias = p.bias;
    f.bias_dtype = p.bias_dtype;
    f.bias_stride = p.bias_stride;
    f.target = targets + r0;
    f.ce = grad_params().ce;
    return f;
  }

  // The fused forward of a token chunk: tile statistics in the GEMM's epilogue, then the rows' loss and lse.
  void fused_row_stats(int64_t r0, int64_t rows, float* loss_rows, float* lse_rows) const {
    FusedGemmParams f = fused_params(r0, rows, 0, p.vocab);
    f.partials = at<float>(plan.off_partials);
    launch_fused_stats(f, sm_count, stream);
    launch_finish_rows(f.partials, rows, (p.vocab + kFusedTileCols - 1) / kFusedTileCols, targets + r0, nullptr, f.ce,
                       scalars, loss_rows, lse_rows, z_rows(r0), sm_count, stream);
  }

  // The gradient in forward on the fused path (plan: kHopperFused, pass kForwardBackward), one token group at a
  // time: see params.h's ExpGradParams.
  void fused_forward_backward() const {
    const int64_t N = p.n_tokens, H = p.hidden, V = p.vocab, G = plan.group_rows;
    const int64_t tiles = (V + kFusedTileCols - 1) / kFusedTileCols;
    float* lse = p.lse ? p.lse : at<float>(plan.off_lse);
    float* dw_acc = at<float>(plan.off_dw);
    const GradParams g = grad_params();
    for (int64_t g0 = 0; g0 < N; g0 += G) {
      const int64_t rows = std::min(G, N - g0);
      ExpGradParams e;
      e.rows = rows;
      e.h = H;
      e.v = V;
      e.x = hidden_rows(g0);
      e.ldx = ldx;
      e.w = p.weight.data;
      e.ldw = p.weight.ld;
      e.bias = p.bias;
      e.bias_dtype = p.bias_dtype;
      e.bias_stride = p.bias_stride;
      e.target = targets + g0;
      e.ce = g.ce;
      e.scalars = scalars;
      e.upstream = p.grad_scale && p.grad_scale_per_row ? p.grad_scale + g0 : p.grad_scale;
      e.upstream_per_row = p.grad_scale_per_row;
      e.lse = lse + g0;
      e.shift = at<float>(plan.off_shift);
      e.scale = at<float>(plan.off_row_scale);
      e.e = at<void>(plan.off_dlogits);
      e.ld_e = plan.ld_dlogits;
      e.xs = at<void>(plan.off_scaled_hidden);
      e.fixups = at<int>(plan.off_fixups);
      e.force_fixups = g_force_fixups.load(std::memory_order_relaxed) ? 1 : 0;
      launch_target_shift(e, sm_count, stream);
      FusedGemmParams f = fused_params(g0, rows, 0, V);
      f.partials = at<float>(plan.off_partials);
      f.shift = e.shift;
      f.dlogits = e.e;
      f.ld_dlogits = e.ld_e;
      launch_fused_exp(f, sm_count, stream);
      launch_finish_rows(f.partials, rows, tiles, targets + g0, e.shift, f.ce, scalars, loss_rows(g0), lse + g0,
                         z_rows(g0), sm_count, stream);
      launch_exp_rows(e, sm_count, stream);
      // grad_weight first: the scaled hidden rows it reads share their region with the float32 grad_hidden
      // rows (plan.cpp), which the grad_hidden GEMM then writes.
      if (p.grad_weight.data) {  // dW (+)= E_gᵀ (s ⊙ X_g)
        void* dw = dw_acc ? static_cast<void*>(dw_acc) : p.grad_weight.data;
        const int64_t ldw = dw_acc ? H : p.grad_weight.ld;
        const DType dwt = dw_acc ? DType::kFloat32 : p.grad_weight.dtype;
        gemm_row_major(blas, true, false, V, H, rows, e.e, e.ld_e, e.xs, H, p.dtype, dw, ldw, dwt,
                       /*accumulate=*/g0 > 0);
      }
      if (p.grad_hidden.data) {  // dX_g = s ⊙ (E_g W): float32 rows, scaled on the way out (in place if float32)
        char* dx = static_cast<char*>(p.grad_hidden.data) + g0 * p.grad_hidden.ld * dtype_size(p.grad_hidden.dtype);
        float* y = p.grad_hidden.dtype == DType::kFloat32 ? reinterpret_cast<float*>(dx) : at<float>(plan.off_dx_rows);
        const int64_t ldy = p.grad_hidden.dtype == DType::kFloat32 ? p.grad_hidden.ld : H;
        gemm_row_major(blas, false, false, rows, H, V, e.e, e.ld_e, p.weight.data, p.weight.ld, p.dtype, y, ldy,
                       DType::kFloat32, false);
        launch_cast(y, ldy, rows, H, dx, p.grad_hidden.dtype, p.grad_hidden.ld, 1, sm_count, stream, e.scale);
      }
    }
    if (dw_acc)
      launch_cast(dw_acc, H, V, H, p.grad_weight.data, p.grad_weight.dtype, p.grad_weight.ld, 1, sm_count, stream);
    reduce_loss();
  }

  VocabShard shard() const { return VocabShard{p.vocab_offset, p.vocab_total}; }
  TensorView class_weight_view() const {
    return p.class_weight ? TensorView::make(const_cast<float*>(p.class_weight), DType::kFloat32, p.device,
                                             {p.vocab_total}, {p.class_weight_stride})
                          : TensorView{};
  }

  // A shard's partial statistics of a chunk of float32 logits (the cross-entropy family's).
  void shard_partials(const float* z, int64_t ld, int64_t r0, int64_t rows, float* out) const {
    const TensorView zv = TensorView::make(const_cast<float*>(z), DType::kFloat32, p.device, {rows, p.vocab}, {ld, 1});
    const TensorView tv = TensorView::make(targets + r0, DType::kInt64, p.device, {rows});
    const TensorView pv = TensorView::make(out, DType::kFloat32, p.device, {rows, kShardStats});
    cross_entropy_shard_partials(zv, tv, class_weight_view(), shard(), ce_options(p.options), pv,
                                 Workspace{at<char>(plan.off_ce), plan.ce_bytes}, stream);
  }

  // The loss rows and lse of a chunk from every shard's partials [R, rows, 4].
  void shard_finalize(const float* gathered, int64_t r0, int64_t rows, float* loss_rows, float* lse_rows) const {
    const TensorView gv =
        TensorView::make(const_cast<float*>(gathered), DType::kFloat32, p.device, {p.n_shards, rows, kShardStats});
    const TensorView tv = TensorView::make(targets + r0, DType::kInt64, p.device, {rows});
    const TensorView lv = TensorView::make(loss_rows, DType::kFloat32, p.device, {rows});
    const TensorView sv = TensorView::make(lse_rows, DType::kFloat32, p.device, {rows});
    cross_entropy_shard_finalize(gv, tv, class_weight_view(), p.vocab_total, ce_options(p.options), lv, sv,
                                 z_view(r0, rows), Workspace{at<char>(plan.off_ce), plan.ce_bytes}, stream);
  }

  GradParams grad_params() const {
    GradParams g;
    g.scalars = scalars;
    g.ce.vocab = p.vocab;
    g.ce.vocab_offset = p.vocab_offset;
    g.ce.vocab_total = p.vocab_total;
    g.ce.ignore_index = p.options.ignore_index;
    g.ce.eps = static_cast<float>(p.options.label_smoothing);
    g.ce.inv_v = 1.f / static_cast<float>(p.vocab_total);
    g.ce.z = static_cast<float>(p.options.z_loss);
    g.ce.softcap = static_cast<float>(p.options.softcap);
    g.ce.weight = p.class_weight;
    g.ce.weight_stride = p.class_weight_stride;
    return g;
  }

  void reduce_loss() const {
    if (p.options.reduction != Reduction::kNone)
      launch_reduce_loss(at<float>(plan.off_row_loss), z_rows(0), p.n_tokens, scalars, p.loss, stream);
  }

  float* loss_rows(int64_t r0) const {
    return p.options.reduction == Reduction::kNone ? p.loss + r0 : at<float>(plan.off_row_loss) + r0;
  }

  void forward() const {
    const int64_t N = p.n_tokens, S = plan.chunk_rows;
    float* z = at<float>(plan.off_logits);
    for (int64_t r0 = 0; r0 < N; r0 += S) {
      const int64_t rows = std::min(S, N - r0);
      if (fused()) {
        fused_row_stats(r0, rows, loss_rows(r0), p.lse ? p.lse + r0 : nullptr);
        continue;
      }
      logits(z, plan.ld_logits, r0, rows, 0, p.vocab);
      row_stats(z, plan.ld_logits, r0, rows, loss_rows(r0), p.lse ? p.lse + r0 : nullptr);
    }
    reduce_loss();
  }

  void forward_backward() const {
    if (fused()) return fused_forward_backward();
    const int64_t N = p.n_tokens, H = p.hidden, V = p.vocab, S = plan.chunk_rows, G = plan.group_rows;
    const int64_t es = dtype_size(p.dtype);
    float* z = at<float>(plan.off_logits);
    char* dz = plan.dlogits_in_place ? reinterpret_cast<char*>(z) : at<char>(plan.off_dlogits);
    float* lse = p.lse ? p.lse : at<float>(plan.off_lse);
    float* db = at<float>(plan.off_db);
    float* dw_acc = at<float>(plan.off_dw);
    if (db) LOGITLESS_CUDA_CHECK(cudaMemsetAsync(db, 0, static_cast<size_t>(V) * 4, stream));
    GradParams g = grad_params();
    g.upstream = p.grad_scale;
    g.upstream_per_row = p.grad_scale_per_row;
    for (int64_t g0 = 0; g0 < N; g0 += G) {
      const int64_t grows = std::min(G, N - g0);
      for (int64_t r0 = g0; r0 < g0 + grows; r0 += S) {
        const int64_t rows = std::min(S, g0 + grows - r0);
        logits(z, plan.ld_logits, r0, rows, 0, V);
        row_stats(z, plan.ld_logits, r0, rows, loss_rows(r0), lse + r0);
        g.logits = z;
        g.ld_logits = plan.ld_logits;
        g.dlogits = dz + (r0 - g0) * plan.ld_dlogits * es;
        g.ld_dlogits = plan.ld_dlogits;
        g.db_partial = db ? at<float>(plan.off_db_partial) : nullptr;
        g.target = targets + r0;
        g.lse = lse + r0;
        if (p.grad_scale_per_row) g.upstream = p.grad_scale + r0;
        g.rows = rows;
        g.width = V;
        g.col0 = 0;
        launch_grad(g, p.dtype, stream);
        if (db)
          launch_column_sums(g.db_partial, (rows + kGradRowsPerBlock - 1) / kGradRowsPerBlock, plan.ld_logits, V, db,
                             nullptr, DType::kFloat32, 1, stream);
      }
      // The group's gradients: its rows of grad_hidden are final; grad_weight sums over groups in float32.
      if (p.grad_hidden.data) {
        char* dx = static_cast<char*>(p.grad_hidden.data) + g0 * p.grad_hidden.ld * dtype_size(p.grad_hidden.dtype);
        gemm_row_major(blas, false, false, grows, H, V, dz, plan.ld_dlogits, p.weight.data, p.weight.ld, p.dtype, dx,
                       p.grad_hidden.ld, p.grad_hidden.dtype, false);
      }
      if (p.grad_weight.data) {
        void* dw = dw_acc ? static_cast<void*>(dw_acc) : p.grad_weight.data;
        const int64_t ldw = dw_acc ? H : p.grad_weight.ld;
        const DType dwt = dw_acc ? DType::kFloat32 : p.grad_weight.dtype;
        gemm_row_major(blas, true, false, V, H, grows, dz, plan.ld_dlogits, hidden_rows(g0), ldx, p.dtype, dw, ldw, dwt,
                       /*accumulate=*/g0 > 0);
      }
    }
    if (dw_acc)
      launch_cast(dw_acc, H, V, H, p.grad_weight.data, p.grad_weight.dtype, p.grad_weight.ld, 1, sm_count, stream);
    if (db) launch_cast(db, V, 1, V, p.grad_bias, p.grad_bias_dtype, 0, p.grad_bias_stride, sm_count, stream);
    reduce_loss();
  }

  // A shard's partial statistics of every token (the recompute schedule's forward).
  void partials() const {
    const int64_t N = p.n_tokens, S = plan.chunk_rows;
    float* z = at<float>(plan.off_logits);
    for (int64_t r0 = 0; r0 < N; r0 += S) {
      const int64_t rows = std::min(S, N - r0);
      logits(z, plan.ld_logits, r0, rows, 0, p.vocab);
      shard_partials(z, plan.ld_logits, r0, rows, p.partials + r0 * kShardStats);
    }
  }

  // The steps' logits slot of chunk k.
  float* slot(int64_t k) const { return reinterpret_cast<float*>(ws + plan.off_logits + (k % 2) * plan.slot_bytes); }

  void step_logits() const {
    const int64_t k = p.step_chunk, S = plan.chunk_rows, r0 = k * S, rows = std::min(S, p.n_tokens - r0);
    float* db = at<float>(plan.off_db);
    if (k == 0 && db) LOGITLESS_CUDA_CHECK(cudaMemsetAsync(db, 0, static_cast<size_t>(p.vocab) * 4, stream));
    logits(slot(k), plan.ld_logits, r0, rows, 0, p.vocab);
    shard_partials(slot(k), plan.ld_logits, r0, rows, p.partials);
  }

  // As forward_backward's chunk, from the chunk's gathered partials; the group's GEMMs after its last chunk.
  void step_gradient() const {
    const int64_t N = p.n_tokens, H = p.hidden, V = p.vocab, S = plan.chunk_rows, G = plan.group_rows;
    const int64_t es = dtype_size(p.dtype);
    const int64_t k = p.step_chunk, r0 = k * S, rows = std::min(S, N - r0);
    const int64_t g0 = r0 / G * G, grows = std::min(G, N - g0);  // the group: whole chunks
    float* z = slot(k);
    char* dz = plan.dlogits_in_place ? reinterpret_cast<char*>(z) : at<char>(plan.off_dlogits);  // in place: G = S
    float* lse = p.lse ? p.lse : at<float>(plan.off_lse);
    float* db = at<float>(plan.off_db);
    float* dw_acc = at<float>(plan.off_dw);
    shard_finalize(p.partials_in, r0, rows, loss_rows(r0), lse + r0);
    GradParams g = grad_params();
    g.logits = z;
    g.ld_logits = plan.ld_logits;
    g.dlogits = dz + (r0 - g0) * plan.ld_dlogits * es;
    g.ld_dlogits = plan.ld_dlogits;
    g.db_partial = db ? at<float>(plan.off_db_partial) : nullptr;
    g.target = targets + r0;
    g.lse = lse + r0;
    g.rows = rows;
    g.width = V;
    g.col0 = 0;
    launch_grad(g, p.dtype, stream);
    if (db)
      launch_column_sums(g.db_partial, (rows + kGradRowsPerBlock - 1) / kGradRowsPerBlock, plan.ld_logits, V, db,
                         nullptr, DType::kFloat32, 1, stream);
    if (r0 + rows == g0 + grows) {  // the group's last chunk: its GEMMs
      if (p.grad_hidden.data) {
        char* dx = static_cast<char*>(p.grad_hidden.data) + g0 * p.grad_hidden.ld * dtype_size(p.grad_hidden.dtype);
        if (V == 0) {  // an empty shard contributes nothing (a GEMM over k = 0 would leave dx unwritten)
          launch_cast(nullptr, 0, grows, H, dx, p.grad_hidden.dtype, p.grad_hidden.ld, 1, sm_count, stream);
        } else {
          gemm_row_major(blas, false, false, grows, H, V, dz, plan.ld_dlogits, p.weight.data, p.weight.ld, p.dtype, dx,
                         p.grad_hidden.ld, p.grad_hidden.dtype, false);
        }
      }
      if (p.grad_weight.data) {
        void* dw = dw_acc ? static_cast<void*>(dw_acc) : p.grad_weight.data;
        const int64_t ldw = dw_acc ? H : p.grad_weight.ld;
        const DType dwt = dw_acc ? DType::kFloat32 : p.grad_weight.dtype;
        gemm_row_major(blas, true, false, V, H, grows, dz, plan.ld_dlogits, hidden_rows(g0), ldx, p.dtype, dw, ldw, dwt,
                       /*accumulate=*/g0 > 0);
      }
    }
    if (r0 + rows == N) {  // the last chunk: the gradients and the loss are complete
      if (dw_acc)
        launch_cast(dw_acc, H, V, H, p.grad_weight.data, p.grad_weight.dtype, p.grad_weight.ld, 1, sm_count, stream);
      if (db) launch_cast(db, V, 1, V, p.grad_bias, p.grad_bias_dtype, 0, p.grad_bias_stride, sm_count, stream);
      reduce_loss();
    }
  }

  void backward() const {
    const int64_t N = p.n_tokens, H = p.hidden, V = p.vocab, C = plan.vocab_cols;
    float* z = at<float>(plan.off_logits);
    void* dz = plan.dlogits_in_place ? static_cast<void*>(z) : at<void>(plan.off_dlogits);
    float* dx_acc = at<float>(plan.off_dx);
    GradParams g = grad_params();
    g.upstream = p.grad_scale;
    g.upstream_per_row = p.grad_scale_per_row;
    g.target = targets;
    g.lse = p.lse;
    g.logits = z;
    g.ld_logits = plan.ld_logits;
    g.dlogits = dz;
    g.ld_dlogits = plan.ld_dlogits;
    g.db_partial = p.grad_bias ? at<float>(plan.off_db_partial) : nullptr;
    g.rows = N;
    const int64_t es_gb = dtype_size(p.grad_bias_dtype);
    for (int64_t v0 = 0; v0 < V; v0 += C) {
      const int64_t cols = std::min(C, V - v0);
      if (fused()) {  // the gradient straight from the GEMM's accumulators (no bias gradient on this path)
        FusedGemmParams f = fused_params(0, N, v0, cols);
        f.lse = p.lse;
        f.upstream = p.grad_scale;
        f.upstream_per_row = p.grad_scale_per_row;
        f.scalars = scalars;
        f.dlogits = dz;
        f.ld_dlogits = plan.ld_dlogits;
        launch_fused_grad(f, sm_count, stream);
      } else {
        logits(z, plan.ld_logits, 0, N, v0, cols);
        g.width = cols;
        g.col0 = v0;
        launch_grad(g, p.dtype, stream);
      }
      if (p.grad_bias)
        launch_column_sums(g.db_partial, plan.db_partial_rows, plan.ld_logits, cols, nullptr,
                           static_cast<char*>(p.grad_bias) + v0 * p.grad_bias_stride * es_gb, p.grad_bias_dtype,
                           p.grad_bias_stride, stream);
      if (p.grad_hidden.data) {
        void* dx = dx_acc ? static_cast<void*>(dx_acc) : p.grad_hidden.data;
        const int64_t ld = dx_acc ? H : p.grad_hidden.ld;
        const DType dt = dx_acc ? DType::kFloat32 : p.grad_hidden.dtype;
        gemm_row_major(blas, false, false, N, H, cols, dz, plan.ld_dlogits, weight_rows(v0), p.weight.ld, p.dtype, dx,
                       ld, dt, /*accumulate=*/v0 > 0);
      }
      if (p.grad_weight.data) {
        char* dw = static_cast<char*>(p.grad_weight.data) + v0 * p.grad_weight.ld * dtype_size(p.grad_weight.dtype);
        gemm_row_major(blas, true, false, cols, H, N, dz, plan.ld_dlogits, x, ldx, p.dtype, dw, p.grad_weight.ld,
                       p.grad_weight.dtype, false);
      }
    }
    if (dx_acc)
      launch_cast(dx_acc, H, N, H, p.grad_hidden.data, p.grad_hidden.dtype, p.grad_hidden.ld, 1, sm_count, stream);
    if (V == 0 && p.grad_hidden.data)  // an empty shard: no vocabulary chunk wrote grad_hidden
      launch_cast(nullptr, 0, N, H, p.grad_hidden.data, p.grad_hidden.dtype, p.grad_hidden.ld, 1, sm_count, stream);
  }

  // No tokens: the sums are empty. grad_hidden has no rows; grad_weight and grad_bias are zero.
  void empty() const {
    if (p.mode == Mode::kPartials) return;  // no rows of partials
    if (p.mode != Mode::kBackward) reduce_loss();
    if (p.mode == Mode::kForward) return;
    if (p.grad_weight.data)
      launch_cast(nullptr, 0, p.vocab, p.hidden, p.grad_weight.data, p.grad_weight.dtype, p.grad_weight.ld, 1, sm_count,
                  stream);
    if (p.grad_bias)
      launch_cast(nullptr, 0, 1, p.vocab, p.grad_bias, p.grad_bias_dtype, 0, p.grad_bias_stride, sm_count, stream);
  }
};

}  // namespace

bool cuda_recompute_is_faster(const Problem& p, bool need_dx, bool need_dw, bool need_db) {
  DeviceGuard guard(p.device.index);
  PlanInputs in = plan_inputs(p);  // p carries no gradient outputs: say which ones the call would have
  in.need_dx = need_dx;
  in.need_dw = need_dw;
  in.need_db = need_db;
  in.grad_hidden_f32 = in.grad_weight_f32 = false;  // in the inputs' dtype
  return recompute_is_faster(in);
}

namespace debug {
void set_fused_kernels(bool enabled) { g_fused_enabled.store(enabled, std::memory_order_relaxed); }
void set_exp_fixup_all(bool enabled) { g_force_fixups.store(enabled, std::memory_order_relaxed); }
void set_exp_form(bool enabled) { g_exp_form_enabled.store(enabled, std::memory_order_relaxed); }
bool fused_kernels_enabled() { return g_fused_enabled.load(std::memory_order_relaxed); }
Kernel last_kernel() { return t_last_kernel; }
}  // namespace debug

size_t cuda_workspace_bytes(const Problem& p) {
  DeviceGuard guard(p.device.index);
  return plan_linear_cross_entropy(plan_inputs(p)).bytes;
}

void run_cuda(const Problem& p, Workspace ws, StreamHandle stream_handle) {
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_handle);
  DeviceGuard guard(p.device.index);
  const Plan plan = plan_linear_cross_entropy(plan_inputs(p));
  t_last_kernel = plan.kernel;
  Run r{p, plan, stream, static_cast<char*>(ws.data)};
  r.sm_count = device_info(p.device.index).sm_count;
  r.scalars = r.at<Scalars>(plan.off_scalars);
  r.targets = r.at<int64_t>(plan.off_targets);

  PrepassParams pp;
  pp.target = p.target;
  pp.target_is64 = p.target_dtype == DType::kInt64;
  pp.target_rows = p.target_rows;
  pp.n = p.n_tokens;
  pp.vocab = p.vocab_total;  // targets and class weights are of the whole vocabulary (also for a shard)
  pp.ignore_index = p.options.ignore_index;
  pp.class_weight = p.class_weight;
  pp.class_weight_stride = p.class_weight_stride;
  pp.mean = p.options.reduction == Reduction::kMean;
  pp.need_weight_sum = p.class_weight != nullptr && p.options.label_smoothing != 0.0;
  pp.targets_out = r.targets;
  pp.scalars = r.scalars;
  // The steps of one sequence share the first step's prepass (and its one check) through the workspace.
  const bool later_step = is_step(p.mode) && !(p.mode == Mode::kStepLogits && p.step_chunk == 0);
  if (!later_step) {
    launch_prepass(pp, stream);
    if (p.mode != Mode::kBackward && p.options.check_targets && !stream_is_capturing(stream))
      throw_if_bad_target(p, r.scalars, r.targets, stream);
  }

  if (p.n_tokens == 0) {
    r.empty();
    return;
  }
  r.x = p.hidden_data;
  r.ldx = p.hidden_ld;
  if (!p.hidden_uniform) {
    void* copy = r.at<void>(plan.off_hidden);
    if (!later_step)
      launch_copy_rows(p.hidden_data, p.hidden_rows, p.n_tokens, p.hidden, static_cast<int>(dtype_size(p.dtype)), copy,
                       r.sm_count, stream);
    r.x = copy;
    r.ldx = p.hidden;
  }
  r.blas = cublas_handle(stream, r.at<void>(plan.off_cublas), plan.cublas_bytes);
  if (plan.kernel == Kernel::kHopperFused && reinterpret_cast<uintptr_t>(ws.data) % 16 != 0)
    throw_invalid(
        "workspace: expected a 16-byte aligned pointer (the fused Hopper kernels read and write buffers "
        "there through TMA descriptors), got a misaligned one");
  switch (p.mode) {
    case Mode::kForward:
      r.forward();
      break;
    case Mode::kForwardBackward:
      r.forward_backward();
      break;
    case Mode::kBackward:
      r.backward();
      break;
    case Mode::kPartials:
      r.partials();
      break;
    case Mode::kStepLogits:
      r.step_logits();
      break;
    case Mode::kStepGradient:
      r.step_gradient();
      break;
  }
}

}  // namespace logitless::lce
