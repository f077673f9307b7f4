// The CUDA linear cross-entropy on the linear-head engine (linear_head/cuda/engine.h): the engine's GEMMs per
// chunk, the cross-entropy family's row steps (cross_entropy/cuda/steps.h) for each chunk's statistics, this
// family's gradient kernel in between, or the fused Hopper GEMM (kernels_hopper.h). Host code only: it sequences
// launches on the caller's stream; a bad target is read back (eagerly, once per call, not while a CUDA graph is
// captured) behind the prepass, and the host waits for that copy before anything the caller sees is written: before
// the first launch, or behind the first fused logits GEMM where that GEMM writes the workspace alone.
//
// Per call: prepass (targets to contiguous int64, the mean's denominator, the first bad target), then
//   forward:             per token chunk: Z = X_c Wᵀ (+b) in float32; cross-entropy forward -> loss rows, lse
//   gradient in forward: per token chunk as above, then dZ = d(loss)/dZ in the inputs' dtype into the group's
//                        buffer; per group: dX_g = dZ_g W, dW (+)= dZ_gᵀ X_g (float32 accumulation, or in a 16-bit
//                        grad_weight itself: GradWeightAccumulation::kWeightDtype), db += Σ dZ
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
#include <utility>

#include "common/check.h"
#include "common/cuda/check.cuh"
#include "common/cuda/cublas.h"
#include "common/cuda/index_readback.h"
#include "common/debug_hooks.h"
#include "cross_entropy/cuda/steps.h"
#include "linear_cross_entropy/cuda/kernels.h"
#include "linear_cross_entropy/cuda/kernels_hopper.h"
#include "linear_cross_entropy/cuda/plan.h"
#include "linear_cross_entropy/problem.h"
#include "linear_head/cuda/engine.h"
#include "linear_head/cuda/kernels.h"
#include "logitless/vocab_parallel.h"

namespace logitless::lce {
namespace {

namespace hooks = ::logitless::debug;  // the registry (common/debug_hooks.h), not this family's debug names
using head::Engine;
using hooks::Hook;

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

// Whether the fused Hopper kernels can run this call (the planner picks them for the forward and the backward):
// one device's calls (a backward of a vocabulary shard too), on operands a TMA descriptor takes. hidden's copy (rows
// without one stride) is contiguous in the workspace, whose pointer run_cuda checks.
bool fused_allowed(const Problem& p) {
  if (!hooks::hook(Hook::kLceFusedKernels)) return false;
  if (p.mode != Mode::kForward && p.mode != Mode::kForwardBackward && p.mode != Mode::kBackward) return false;
  const void* x = p.hidden_uniform ? p.hidden_data : nullptr;
  const int64_t ldx = p.hidden_uniform ? p.hidden_ld : p.hidden;
  return fused_gemm_supported(p.device.index, p.dtype, x, ldx, p.weight.data, p.weight.ld, p.hidden);
}

// What a contiguous grad_weight of that dtype offers as scratch (PlanInputs::grad_weight_scratch): its storage less
// the up to 256 bytes that aligning the scratch's start may skip.
size_t grad_weight_scratch_bytes(const Problem& p, DType dtype) {
  const size_t bytes = static_cast<size_t>(p.vocab) * static_cast<size_t>(p.hidden) * dtype_size(dtype);
  return bytes > 256 ? bytes - 256 : 0;
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
  in.dw_weight_dtype = p.options.grad_weight_accumulation == GradWeightAccumulation::kWeightDtype;
  in.copy_hidden = !p.hidden_uniform;
  // The partials go to the caller; no per-token loss is reduced here.
  in.reduction_none = p.options.reduction == Reduction::kNone || p.mode == Mode::kPartials;
  // Not only with class weights (where the z-loss terms' divisor differs): the workspace queries do not see them.
  in.z_rows = p.options.reduction == Reduction::kMean && p.options.z_loss != 0.0;
  in.steps = is_step(p.mode);
  in.fused = fused_allowed(p);
  in.fused_exp = hooks::hook(Hook::kLceExpForm) != 0 && p.dtype == DType::kBFloat16 && p.options.softcap == 0.0 &&
                 p.options.label_smoothing == 0.0;
  in.chunk_tokens = p.options.chunk_tokens;
  in.chunk_vocab = p.options.chunk_vocab;
  in.memory_budget = p.options.memory_budget;
  in.row_stats = p.options.row_stats;
  in.cublas_workspace_bytes = head::cublas_workspace_for(device_info(p.device.index).sm_major);
  if (in.fused && in.fused_exp && in.pass == Pass::kForwardBackward && in.need_dw)
    in.target_sort_bytes = exp_target_sort_bytes(p.n_tokens);
  if (in.need_dw && !in.grad_weight_f32 && p.grad_weight.ld == p.hidden)
    in.grad_weight_scratch = grad_weight_scratch_bytes(p, p.grad_weight.dtype);
  const head::Matrix& dx = p.grad_hidden;
  in.grad_hidden_rows_scratch =
      in.grad_hidden_f32 && dx.ld == p.hidden && p.hidden % 4 == 0 && reinterpret_cast<uintptr_t>(dx.data) % 16 == 0;
  in.dw_tail = hooks::hook(Hook::kLceDwTail) != 0;
  in.dw_written = hooks::hook(Hook::kLceDwWritten) != 0;
  in.dlogits_in_grad_weight = hooks::hook(Hook::kLceDwTail) == 1;
  return in;
}

// One strided dimension of `rows` rows, as the public API's layouts collapse it.
RowLayout rows_layout(int64_t rows, int64_t stride) {
  RowLayout L;
  L.sizes[0] = rows;
  L.strides[0] = rows == 1 ? 0 : stride;
  return L;
}

// Everything one call needs, resolved against its workspace.
struct Run {
  const Problem& p;
  const Plan& plan;
  const Engine& e;
  const Buffers& b;
  ce::Scalars* scalars = nullptr;
  ce::Scalars* row_scalars = nullptr;
  int64_t* targets = nullptr;
  // The target check's read-back while it is in flight (run_cuda). The host waits for it before the first launch
  // that writes what the caller sees; where that comes after the first logits GEMM, the GPU runs the GEMM meanwhile
  // instead of idling while the host wakes (checks_behind_logits).
  mutable IndexReadback* pending_check = nullptr;
  int sm_count() const { return e.sm_count(); }
  cudaStream_t stream() const { return e.stream(); }

  // Throws naming the first bad target, if the check found one; a no-op once settled or where nothing was checked.
  void settle_targets() const {
    if (!pending_check) return;
    IndexReadback& rb = *std::exchange(pending_check, nullptr);
    ce::throw_if_bad_target(rb, p.n_tokens, targets, DType::kInt64, rows_layout(p.n_tokens, 1), p.vocab_total,
                            p.options.ignore_index);
  }

  // Whether the check may settle after the first fused logits GEMM is queued: before it only the prepass, hidden's
  // copy, the shift and that GEMM run, and they write the workspace alone (not grad_weight's storage). The kernels
  // take a bad target as a NaN row without reading out of bounds, as they do with check_targets off.
  bool checks_behind_logits() const {
    if (!fused() || p.n_tokens == 0) return false;
    if (p.mode == Mode::kForward) return true;
    return p.mode == Mode::kForwardBackward && !plan.exp_in_grad_weight && !plan.dlogits_in_grad_weight &&
           !plan.shared_in_grad_hidden;
  }

  // Token group g0's region of Plan::exp_shared_row bytes a row: its own rows of grad_hidden, or the workspace's.
  float* shared_region(int64_t g0) const {
    if (!plan.shared_in_grad_hidden) return b.fused.partials;
    return static_cast<float*>(p.grad_hidden.data) + g0 * p.grad_hidden.ld;
  }

  // The cross-entropy problem of rows [r0, r0 + rows): their targets, per-row outputs only.
  ce::Problem ce_problem(ce::Mode mode, int64_t r0, int64_t rows) const {
    ce::Problem c;
    c.mode = mode;
    c.n_rows = rows;
    c.vocab = mode == ce::Mode::kFinalize ? p.vocab_total : p.vocab;
    c.vocab_offset = mode == ce::Mode::kFinalize ? 0 : p.vocab_offset;
    c.vocab_total = p.vocab_total;
    c.dtype = DType::kFloat32;
    c.device = p.device;
    c.target = targets + r0;
    c.target_dtype = DType::kInt64;
    c.target_rows = rows_layout(rows, 1);
    c.weight = p.class_weight;
    c.weight_stride = p.class_weight_stride;
    c.ignore_index = p.options.ignore_index;
    c.reduction = Reduction::kNone;  // per token; this file reduces over the chunks
    c.label_smoothing = static_cast<float>(p.options.label_smoothing);
    c.z_loss_scale = static_cast<float>(p.options.z_loss);
    c.softcap = static_cast<float>(p.options.softcap);
    c.check_targets = false;  // the prepass checked every token once
    return c;
  }

  // The cross-entropy family's row step over a chunk of float32 logits [rows, ld] (forward or a shard's partials).
  void ce_rows(ce::Mode mode, const float* z, int64_t ld, int64_t r0, int64_t rows, float* loss_rows, float* lse_rows,
               float* partials) const {
    ce::Problem c = ce_problem(mode, r0, rows);
    c.logits = z;
    c.logits_rows = rows_layout(rows, ld);
    c.loss = loss_rows;
    c.lse = lse_rows;
    c.z_loss = mode == ce::Mode::kForward ? z_rows(r0) : nullptr;
    c.partials = partials;
    ce::launch_rows(c, ce::make_params(c, row_scalars, loss_rows), stream());
  }

  // The loss rows and lse of a chunk from every shard's partials [R, rows, 4].
  void shard_finalize(const float* gathered, int64_t r0, int64_t rows, float* loss_rows, float* lse_rows) const {
    ce::Problem c = ce_problem(ce::Mode::kFinalize, r0, rows);
    c.partials_in = gathered;
    c.n_shards = p.n_shards;
    c.loss = loss_rows;
    c.lse = lse_rows;
    c.z_loss = z_rows(r0);
    ce::launch_rows(c, ce::make_params(c, row_scalars, loss_rows), stream());
  }

  // The z-loss terms of tokens [r0, r0 + rows): a float32 view of the plan's region, or none.
  float* z_rows(int64_t r0) const { return b.loss.row_z ? b.loss.row_z + r0 : nullptr; }

  bool fused() const { return plan.kernel == Kernel::kHopperFused; }

  // The fused GEMM of tokens [r0, r0 + rows) against classes [v0, v0 + cols).
  FusedGemmParams fused_params(int64_t r0, int64_t rows, int64_t v0, int64_t cols) const {
    FusedGemmParams f;
    f.dtype = p.dtype;
    f.x = e.x_rows(r0);
    f.ldx = e.io().ldx;
    f.w = e.w_rows(v0);
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
    f.partials = b.fused.partials;
    launch_fused_stats(f, sm_count(), stream());
    settle_targets();
    launch_finish_rows(f.partials, kStatsFloats, rows, (p.vocab + kFusedTileCols - 1) / kFusedTileCols, targets + r0,
                       nullptr, f.ce, scalars, loss_rows, lse_rows, z_rows(r0), sm_count(), stream());
  }

  ExpGradParams exp_params(int64_t g0, int64_t rows, float* lse) const {
    ExpGradParams x;
    x.rows = rows;
    x.h = p.hidden;
    x.v = p.vocab;
    x.x = e.x_rows(g0);
    x.ldx = e.io().ldx;
    x.w = p.weight.data;
    x.ldw = p.weight.ld;
    x.bias = p.bias;
    x.bias_dtype = p.bias_dtype;
    x.bias_stride = p.bias_stride;
    x.target = targets + g0;
    x.ce = grad_params().ce;
    x.scalars = scalars;
    x.upstream = p.grad_scale && p.grad_scale_per_row ? p.grad_scale + g0 : p.grad_scale;
    x.upstream_per_row = p.grad_scale_per_row;
    x.lse = lse + g0;
    x.shift = b.fused.shift;
    x.scale = b.fused.row_scale;
    x.target_coef = b.fused.target_coef;
    x.class_keys = b.fused.class_keys[0];
    x.class_rows = b.fused.class_rows[0];
    x.e = b.head.dlogits;
    x.ld_e = plan.ld_dlogits;
    x.xs = p.grad_weight.data ? shared_region(g0) : nullptr;
    x.fixups = b.fused.fixups;
    x.force_fixups = hooks::hook(Hook::kLceExpFixupAll) ? 1 : 0;
    return x;
  }

  // The gradient in forward on the fused path (plan: kHopperFused, pass kForwardBackward), one token group at a
  // time: see params.h's ExpGradParams.
  void fused_forward_backward() const {
    const int64_t N = p.n_tokens, H = p.hidden, V = p.vocab, G = plan.group_rows;
    const int64_t tiles = (V + kFusedTileCols - 1) / kFusedTileCols;
    float* lse = p.lse ? p.lse : b.loss.lse;
    const head::DwAccumulator acc = dw_accumulator();
    for (int64_t g0 = 0; g0 < N; g0 += G) {
      const int64_t rows = std::min(G, N - g0);
      const ExpGradParams x = exp_params(g0, rows, lse);
      launch_target_shift(x, sm_count(), stream());
      FusedGemmParams f = fused_params(g0, rows, 0, V);
      f.partials = shared_region(g0);
      f.row_partials = p.entropy ? b.fused.row_partials : nullptr;
      f.shift = x.shift;
      f.dlogits = x.e;
      f.ld_dlogits = x.ld_e;
      launch_fused_exp(f, sm_count(), stream());
      settle_targets();
      launch_finish_rows(f.partials, kExpStatsFloats, rows, tiles, targets + g0, x.shift, f.ce, scalars, loss_rows(g0),
                         lse + g0, z_rows(g0), sm_count(), stream());
      if (p.entropy)  // before exp_rows: the statistics' region is then overwritten
        launch_finish_row_stats(f.partials, f.row_partials, rows, tiles, targets + g0, lse + g0, f.ce, p.entropy + g0,
                                p.is_top1 + g0, sm_count(), stream());
      launch_exp_rows(x, sm_count(), stream());
      // grad_weight first: the scaled hidden rows it reads share their region with the float32 grad_hidden
      // rows (plan.cpp), which the grad_hidden GEMM then writes.
      if (p.grad_weight.data) {  // dW (+)= E_gᵀ (s ⊙ X_g) and the target terms
        const TargetSort sort{b.fused.class_keys[1], b.fused.class_rows[1], b.fused.sort_temp, plan.sort_bytes};
        const TargetRowsOut dw =
            acc ? TargetRowsOut{acc.head, acc.tail, acc.split, DType::kFloat32, H}
                : TargetRowsOut{p.grad_weight.data, nullptr, V, p.grad_weight.dtype, p.grad_weight.ld};
        // The first group's product sets the sums, so its target terms follow it; the last group's, where it
        // writes grad_weight, must find them in the sums already.
        const int64_t written = acc.rows_written_by(g0, rows, N, V);
        if (written > 0) launch_grad_weight_targets(x, sort, dw, stream());
        e.grad_weight_sums(x.e, x.ld_e, rows, x.xs, H, acc, /*accumulate=*/g0 > 0, written);
        if (written == 0) launch_grad_weight_targets(x, sort, dw, stream());
      }
      if (p.grad_hidden.data) {  // dX_g = s ⊙ (E_g W) + target terms: float32 rows (in place if float32)
        const head::Matrix dx = p.grad_hidden.rows_from(g0);
        const head::Matrix y = dx.dtype == DType::kFloat32 ? dx : head::Matrix{b.fused.dx_rows, DType::kFloat32, H};
        e.grad_hidden_gemm(x.e, x.ld_e, rows, 0, V, y, false);
        launch_grad_hidden_rows(x, static_cast<const float*>(y.data), y.ld, dx.data, dx.dtype, dx.ld, sm_count(),
                                stream());
      }
    }
    e.finish(acc, nullptr);
    reduce_loss();
  }

  // grad_weight's float32 sums over token groups (none without Plan::dw_accumulator): the workspace's rows and the
  // plan's tail in grad_weight's storage.
  head::DwAccumulator dw_accumulator() const {
    if (!plan.dw_accumulator) return {};
    return head::DwAccumulator{b.head.dw_acc, plan.dw_tail_rows > 0 ? b.dw_tail : nullptr, p.vocab - plan.dw_tail_rows,
                               plan.dw_written_rows};
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

  // The gradient kernel over a chunk of whole rows [r0, r0 + rows) of logits z into dz; `upstream`: times the
  // incoming gradient (the steps take none).
  void chunk_grad(const float* z, int64_t ld, int64_t r0, int64_t rows, void* dz, int64_t ld_dz, float* db_partial,
                  const float* lse, bool upstream = true) const {
    GradParams g = grad_params();
    if (upstream) {
      g.upstream = p.grad_scale && p.grad_scale_per_row ? p.grad_scale + r0 : p.grad_scale;
      g.upstream_per_row = p.grad_scale_per_row;
    }
    g.logits = z;
    g.ld_logits = ld;
    g.dlogits = dz;
    g.ld_dlogits = ld_dz;
    g.db_partial = db_partial;
    g.target = targets + r0;
    g.lse = lse + r0;
    g.rows = rows;
    g.width = p.vocab;
    g.col0 = 0;
    launch_grad(g, p.dtype, stream());
  }

  void reduce_loss() const {
    if (p.options.reduction != Reduction::kNone)
      head::launch_reduce_loss(b.loss.row_loss, z_rows(0), p.n_tokens, scalars, p.loss, stream());
  }

  float* loss_rows(int64_t r0) const {
    return p.options.reduction == Reduction::kNone ? p.loss + r0 : b.loss.row_loss + r0;
  }

  head::SweepBuffers sweep_buffers(float* logits) const {
    head::SweepBuffers s;
    s.chunk_rows = plan.chunk_rows;
    s.group_rows = plan.group_rows;
    s.logits = logits;
    s.ld_logits = plan.ld_logits;
    s.dlogits = b.head.dlogits;  // nullptr when in place
    s.ld_dlogits = plan.ld_dlogits;
    s.dw_acc = dw_accumulator();
    s.db = b.head.db;
    s.db_partial = b.head.db_partial;
    return s;
  }

  void forward() const {
    if (fused()) {
      for (int64_t r0 = 0; r0 < p.n_tokens; r0 += plan.chunk_rows) {
        const int64_t rows = std::min(plan.chunk_rows, p.n_tokens - r0);
        fused_row_stats(r0, rows, loss_rows(r0), p.lse ? p.lse + r0 : nullptr);
      }
    } else {
      CrossEntropyRows loss{{}, *this, p.lse};
      head::sweep(e, sweep_buffers(b.head.logits), loss, false);
    }
    reduce_loss();
  }

  void forward_backward() const {
    if (fused()) return fused_forward_backward();
    CrossEntropyRows loss{{}, *this, p.lse ? p.lse : b.loss.lse};
    head::sweep(e, sweep_buffers(b.head.logits), loss, true);
    reduce_loss();
  }

  // A shard's partial statistics of every token (the recompute schedule's forward).
  void partials() const {
    ShardPartialRows loss{{}, *this, p.partials};
    head::sweep(e, sweep_buffers(b.head.logits), loss, false);
  }

  // The steps' logits slot of chunk k.
  float* slot(int64_t k) const {
    return reinterpret_cast<float*>(reinterpret_cast<char*>(b.head.logits) + (k % 2) * plan.slot_bytes);
  }

  void step_logits() const {
    const int64_t k = p.step_chunk, S = plan.chunk_rows, r0 = k * S, rows = std::min(S, p.n_tokens - r0);
    float* db = b.head.db;
    if (k == 0 && db) e.clear(db, p.vocab);
    e.logits(slot(k), plan.ld_logits, r0, rows, 0, p.vocab);
    ce_rows(ce::Mode::kPartials, slot(k), plan.ld_logits, r0, rows, nullptr, nullptr, p.partials);
  }

  // As forward_backward's chunk, from the chunk's gathered partials; the group's GEMMs after its last chunk.
  void step_gradient() const {
    const int64_t N = p.n_tokens, S = plan.chunk_rows, G = plan.group_rows;
    const int64_t k = p.step_chunk, r0 = k * S, rows = std::min(S, N - r0);
    const int64_t g0 = r0 / G * G, grows = std::min(G, N - g0);  // the group: whole chunks
    const head::SweepBuffers s = sweep_buffers(slot(k));         // in place: G = S
    float* lse = p.lse ? p.lse : b.loss.lse;
    shard_finalize(p.partials_in, r0, rows, loss_rows(r0), lse + r0);
    void* dz = s.dlogits ? static_cast<char*>(s.dlogits) + (r0 - g0) * s.ld_dlogits * dtype_size(p.dtype)
                         : static_cast<void*>(s.logits);
    chunk_grad(s.logits, s.ld_logits, r0, rows, dz, s.ld_dlogits, s.db ? s.db_partial : nullptr, lse, false);
    if (s.db) e.bias_sums(s.db_partial, rows, s.ld_logits, s.db);
    if (r0 + rows == g0 + grows) e.group_gemms(s.dlogits ? s.dlogits : s.logits, s.ld_dlogits, g0, grows, s.dw_acc);
    if (r0 + rows == N) {  // the last chunk: the gradients and the loss are complete
      e.finish(s.dw_acc, s.db);
      reduce_loss();
    }
  }

  // Vocabulary chunks over every token: dZ_v, then dX (+)= dZ_v W_v and dW_v = dZ_vᵀ X.
  void backward() const {
    const int64_t N = p.n_tokens, H = p.hidden, V = p.vocab, C = plan.vocab_cols;
    float* z = b.head.logits;
    void* dz = b.head.dlogits ? b.head.dlogits : static_cast<void*>(z);
    float* dx_acc = b.head.dx_acc;
    const head::Matrix dx = dx_acc ? head::Matrix{dx_acc, DType::kFloat32, H} : p.grad_hidden;
    GradParams g = grad_params();
    g.upstream = p.grad_scale;
    g.upstream_per_row = p.grad_scale_per_row;
    g.target = targets;
    g.lse = p.lse;
    g.logits = z;
    g.ld_logits = plan.ld_logits;
    g.dlogits = dz;
    g.ld_dlogits = plan.ld_dlogits;
    g.db_partial = p.grad_bias ? b.head.db_partial : nullptr;
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
        launch_fused_grad(f, sm_count(), stream());
      } else {
        e.logits(z, plan.ld_logits, 0, N, v0, cols);
        g.width = cols;
        g.col0 = v0;
        launch_grad(g, p.dtype, stream());
      }
      if (p.grad_bias)
        head::launch_column_sums(g.db_partial, plan.db_partial_rows, plan.ld_logits, cols, nullptr,
                                 static_cast<char*>(p.grad_bias) + v0 * p.grad_bias_stride * es_gb, p.grad_bias_dtype,
                                 p.grad_bias_stride, stream());
      if (p.grad_hidden.data) e.grad_hidden_gemm(dz, plan.ld_dlogits, N, v0, cols, dx, /*accumulate=*/v0 > 0);
      if (p.grad_weight.data)
        e.grad_weight_gemm(dz, plan.ld_dlogits, N, cols, e.io().x, e.io().ldx, p.grad_weight.rows_from(v0), false);
    }
    const head::Matrix& gx = p.grad_hidden;
    if (dx_acc) head::launch_cast(dx_acc, H, N, H, gx.data, gx.dtype, gx.ld, 1, sm_count(), stream());
    if (V == 0 && gx.data)  // an empty shard: no vocabulary chunk wrote grad_hidden
      head::launch_cast(nullptr, 0, N, H, gx.data, gx.dtype, gx.ld, 1, sm_count(), stream());
  }

  // No tokens: the sums are empty. grad_hidden has no rows; grad_weight and grad_bias are zero.
  void empty() const {
    if (p.mode == Mode::kPartials) return;  // no rows of partials
    if (p.mode != Mode::kBackward) reduce_loss();
    if (p.mode != Mode::kForward) e.zero_grads(0);
  }

  // The loss side of the engine's sweep (linear_head/cuda/engine.h): the cross-entropy's row step per chunk, and
  // with a gradient this family's gradient kernel.
  struct CrossEntropyRows : head::PlainChunks {
    const Run& r;
    float* lse;  // per token, or nullptr (forward without an lse output)
    void rows(const Chunk& c, const float* z, int64_t ld) const {
      r.ce_rows(ce::Mode::kForward, z, ld, c.row0, c.rows, r.loss_rows(c.row0), lse ? lse + c.row0 : nullptr, nullptr);
      if (r.p.entropy)  // before grad: a float32 chunk's gradient overwrites its logits
        launch_chunk_row_stats(z, ld, c.rows, r.p.vocab, r.targets + c.row0, r.grad_params().ce, r.p.entropy + c.row0,
                               r.p.is_top1 + c.row0, r.sm_count(), r.stream());
    }
    void grad(const Chunk& c, const float* z, int64_t ld, void* dz, int64_t ld_dz, float* db_partial) const {
      r.chunk_grad(z, ld, c.row0, c.rows, dz, ld_dz, db_partial, lse);
    }
  };
  // A vocabulary shard's partial statistics per chunk (no gradient).
  struct ShardPartialRows : head::PlainChunks {
    const Run& r;
    float* partials;  // [N, 4]
    void rows(const Chunk& c, const float* z, int64_t ld) const {
      r.ce_rows(ce::Mode::kPartials, z, ld, c.row0, c.rows, nullptr, nullptr, partials + c.row0 * kShardStats);
    }
    void grad(const Chunk&, const float*, int64_t, void*, int64_t, float*) const {}
  };
};

// The prepass over every token: contiguous int64 targets, the call's scalars and the chunks' per-row ones.
void prepass(const Problem& p, const Run& r, cudaStream_t stream) {
  ce::KernelParams k;
  k.target = p.target;
  k.target_is64 = p.target_dtype == DType::kInt64;
  k.target_rows = p.target_rows;
  k.weight = p.class_weight;
  k.weight_stride = p.class_weight_stride;
  k.n_rows = p.n_tokens;
  k.vocab_total = p.vocab_total;  // targets and class weights are of the whole vocabulary (also for a shard)
  k.ignore_index = p.options.ignore_index;
  k.eps = static_cast<float>(p.options.label_smoothing);
  ce::Prepass q;
  q.reduction = p.options.reduction == Reduction::kMean ? Reduction::kMean : Reduction::kSum;
  q.out = r.scalars;
  q.rows_out = r.row_scalars;
  q.targets_out = r.targets;
  ce::launch_prepass(k, q, stream);
}

}  // namespace

bool cuda_recompute_is_faster(const Problem& p, bool need_dx, bool need_dw, bool need_db) {
  DeviceGuard guard(p.device.index);
  PlanInputs in = plan_inputs(p);  // p carries no gradient outputs: say which ones the call would have
  in.need_dx = need_dx;
  in.need_dw = need_dw;
  in.need_db = need_db;
  in.grad_hidden_f32 = in.grad_weight_f32 = false;                              // in the inputs' dtype
  if (need_dw) in.grad_weight_scratch = grad_weight_scratch_bytes(p, p.dtype);  // ... with contiguous rows
  return recompute_is_faster(in);
}

// The names tests have always called, now switches of the common registry (common/debug_hooks.h).
namespace debug {
void set_fused_kernels(bool enabled) { hooks::set_hook(Hook::kLceFusedKernels, enabled); }
void set_exp_fixup_all(bool enabled) { hooks::set_hook(Hook::kLceExpFixupAll, enabled); }
void set_exp_form(bool enabled) { hooks::set_hook(Hook::kLceExpForm, enabled); }
bool fused_kernels_enabled() { return hooks::hook(Hook::kLceFusedKernels) != 0; }
}  // namespace debug

size_t cuda_workspace_bytes(const Problem& p) {
  DeviceGuard guard(p.device.index);
  return plan_linear_cross_entropy(plan_inputs(p)).bytes;
}

void run_cuda(const Problem& p, Workspace ws, StreamHandle stream_handle) {
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_handle);
  DeviceGuard guard(p.device.index);
  const PlanInputs in = plan_inputs(p);  // once per call: it asks cub for the exponential form's sort storage
  const Plan plan = plan_linear_cross_entropy(in);
  check_workspace(ws, plan.bytes);
  debug::last_kernel.set(plan.kernel);
  debug::last_exp_in_grad_weight.set(plan.exp_in_grad_weight);
  debug::last_dw_tail_rows.set(plan.dw_tail_rows);
  debug::last_dw_written_rows.set(plan.dw_written_rows);
  debug::last_dlogits_in_grad_weight.set(plan.dlogits_in_grad_weight);
  debug::last_group_rows.set(plan.group_rows);
  debug::last_shared_in_grad_hidden.set(plan.shared_in_grad_hidden);
  Buffers b;
  head::WorkspaceLayout layout, scratch;
  declare_workspace(in, plan, layout, &b, &scratch);
  layout.carve(ws.data);
  if (plan.exp_in_grad_weight || plan.dw_tail_rows > 0) {  // at grad_weight's first 256-aligned byte
                                                           // (grad_weight_scratch left room for it)
    const uintptr_t gw = reinterpret_cast<uintptr_t>(p.grad_weight.data);
    scratch.carve(reinterpret_cast<void*>((gw + 255) / 256 * 256));
  }
  // Rows without one stride are read from their contiguous copy.
  const head::HeadIO io = b.head.hidden ? head::head_io(p, p.n_tokens, b.head.hidden, p.hidden)
                                        : head::head_io(p, p.n_tokens, p.hidden_data, p.hidden_ld);
  const int sm_count = device_info(p.device.index).sm_count;
  cublasHandle_t blas = p.n_tokens > 0 ? cublas_handle(stream, b.head.cublas, in.cublas_workspace_bytes) : nullptr;
  const Engine engine(io, blas, sm_count, stream);
  Run r{p, plan, engine, b};
  r.scalars = b.loss.scalars;
  r.row_scalars = reinterpret_cast<ce::Scalars*>(reinterpret_cast<char*>(b.loss.scalars) + kRowScalarsAt);
  r.targets = b.loss.targets;

  // The steps of one sequence share the first step's prepass (and its one check) through the workspace.
  const bool later_step = is_step(p.mode) && !(p.mode == Mode::kStepLogits && p.step_chunk == 0);
  if (!later_step) {
    prepass(p, r, stream);
    if (p.mode != Mode::kBackward && p.options.check_targets && !stream_is_capturing(stream))
      r.pending_check = &IndexReadback::start(p.device.index, &r.scalars->first_bad, stream);
  }
  if (b.head.hidden && !later_step)
    head::launch_copy_rows(p.hidden_data, p.hidden_rows, p.n_tokens, p.hidden, static_cast<int>(dtype_size(p.dtype)),
                           b.head.hidden, sm_count, stream);
  // Nothing the caller sees is written before the check settles: a bad target leaves every output untouched.
  if (!r.checks_behind_logits()) r.settle_targets();
  if (p.n_tokens == 0) {
    r.empty();
    return;
  }
  if (plan.kernel == Kernel::kHopperFused && reinterpret_cast<uintptr_t>(ws.data) % 16 != 0)
    throw_invalid(
        "workspace: expected a 16-byte aligned pointer (the fused Hopper kernels read and write buffers "
        "there through TMA descriptors), got a misaligned one");
  switch (p.mode) {
    case Mode::kForward:
      return r.forward();
    case Mode::kForwardBackward:
      return r.forward_backward();
    case Mode::kBackward:
      return r.backward();
    case Mode::kPartials:
      return r.partials();
    case Mode::kStepLogits:
      return r.step_logits();
    case Mode::kStepGradient:
      return r.step_gradient();
  }
}

}  // namespace logitless::lce
