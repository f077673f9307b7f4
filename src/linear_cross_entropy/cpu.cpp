// Linear cross-entropy on the CPU: the oracle the CUDA path is tested against, and a real backend.
//
// Per chunk of tokens: the logits in double (products of the inputs' values summed in double) rounded to
// float32, the cross-entropy family's CPU backend over them (its math, in double, with the gradient written
// in place over the chunk), then the three gradient products in double. Both schedules compute the same
// numbers here; only the CUDA path's memory and time differ between them. A vocabulary shard's calls
// (include/logitless/vocab_parallel.h) run the same chunks over the shard's rows of the weight; the steps of
// its gradient-in-forward sequence keep their float64 accumulators in the caller's (host) workspace.
//
// GradWeightAccumulation::kWeightDtype: a 16-bit grad_weight sums over the token groups of the CUDA generic plan
// for the same options (plan.cpp, a pure function) in its own dtype, so the running sum is rounded to that dtype
// after each group, where the GPU's accumulating GEMM rounds it: this oracle shows that loss of precision.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "common/check.h"
#include "common/host_float.h"
#include "cross_entropy/problem.h"
#include "linear_cross_entropy/cuda/plan.h"
#include "linear_cross_entropy/problem.h"

namespace logitless::lce {
namespace {

// Below this many multiply-adds per product a call stays on one thread: an OpenMP team next to PyTorch's own
// runtime costs milliseconds to wake, more than such a product takes.
constexpr int64_t kParallelMacs = int64_t{1} << 20;

// What every chunk of one call shares: the targets (checked), the mean's denominator, the weight as float and
// the bias as double.
class Cpu {
 public:
  Cpu(const Problem& p, bool check) : p_(p), N_(p.n_tokens), H_(p.hidden), V_(p.vocab) {
    const auto& o = p.options;
    target_.resize(static_cast<size_t>(N_));
    double denom = 0, count = 0;
    for (int64_t i = 0; i < N_; ++i) {
      const int64_t t = load_index(p.target, p.target_dtype, p.target_rows.offset(i));
      target_[i] = t;
      if (t == o.ignore_index) continue;
      if (t < 0 || t >= p.vocab_total) {
        if (check && o.check_targets)
          throw_invalid(str_cat("target: expected values in [0, ", p.vocab_total, ") or ignore_index (", o.ignore_index,
                                "), got ", t, " at row ", i, " (the first bad row)"));
        continue;  // its loss and gradient are NaN; the denominator counts only valid rows
      }
      denom += p.class_weight ? static_cast<double>(p.class_weight[t * p.class_weight_stride]) : 1.0;
      count += 1;
    }
    // Mean over no rows is 0 with gradient 0 (the cross-entropy family's convention), not NaN. The z-loss terms
    // are divided by the count of tokens, the rest by their summed class weights (as the family does).
    const bool mean = o.reduction == Reduction::kMean;
    inv_denom_ = mean ? (denom != 0 ? 1.0 / denom : 0.0) : 1.0;
    inv_count_ = mean ? (count != 0 ? 1.0 / count : 0.0) : 1.0;
    // The weight as float (exact for every input dtype), [V, H] contiguous.
    w_.resize(static_cast<size_t>(V_ * H_));
    for (int64_t j = 0; j < V_; ++j)
      for (int64_t k = 0; k < H_; ++k) w_[j * H_ + k] = load_float(p.weight.data, p.dtype, j * p.weight.ld + k);
    bias_.assign(static_cast<size_t>(V_), 0.0);
    if (p.bias)
      for (int64_t j = 0; j < V_; ++j) bias_[j] = load_float(p.bias, p.bias_dtype, j * p.bias_stride);
  }

  double inv_denom() const { return inv_denom_; }
  double inv_count() const { return inv_count_; }

  // The reduced loss from the tokens' losses (z-loss terms included) and their z-loss terms: the sums in a fixed
  // order (deterministic), each over its own denominator.
  float reduced_loss(const float* loss_rows, const float* z_rows) const {
    double total = 0, total_z = 0;
    for (int64_t i = 0; i < N_; ++i) {
      total += static_cast<double>(loss_rows[i]) - z_rows[i];
      total_z += z_rows[i];
    }
    return static_cast<float>(total * inv_denom_ + (total_z != 0 ? total_z * inv_count_ : 0.0));
  }

  // Chunks of about 16 MB of float32 logits.
  int64_t chunk_rows() const {
    return std::max<int64_t>(1, std::min<int64_t>(N_, (int64_t{1} << 22) / std::max<int64_t>(V_, 1)));
  }

  // x [rows, H] = the chunk's hidden rows as float; z [rows, V] = its logits (float32 rounding of a double sum).
  void logits(int64_t c0, int64_t rows, std::vector<float>& x, std::vector<float>& z) const {
    x.resize(static_cast<size_t>(rows * H_));
    z.resize(static_cast<size_t>(rows * V_));
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t off = p_.hidden_rows.offset(c0 + i);
      for (int64_t k = 0; k < H_; ++k) x[i * H_ + k] = load_float(p_.hidden_data, p_.dtype, off + k);
    }
    const bool parallel = rows * V_ * H_ >= kParallelMacs;
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t e = 0; e < rows * V_; ++e) {
      const int64_t i = e / V_, j = e - i * V_;
      const float* xi = &x[i * H_];
      const float* wj = &w_[j * H_];
      double acc = bias_[j];
      for (int64_t k = 0; k < H_; ++k) acc += static_cast<double>(xi[k]) * wj[k];
      z[e] = static_cast<float>(acc);
    }
  }

  // options.row_stats of the chunk's rows from their float32 logits z [rows, V] (before the cross-entropy turns them
  // into the gradient in place): the entropy of the softmax of the capped logits in double, the first maximum of z.
  void row_stats(int64_t c0, int64_t rows, const float* z) const {
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t t = target_[c0 + i];
      float entropy = 0.f;
      bool top1 = false;
      if (t != p_.options.ignore_index) {
        const bool bad = t < 0 || t >= p_.vocab_total;
        entropy = bad ? NAN : static_cast<float>(row_entropy(z + i * V_));
        top1 = !bad && first_max_is(z + i * V_, t);
      }
      p_.entropy[c0 + i] = entropy;
      p_.is_top1[c0 + i] = top1 ? 1 : 0;
    }
  }

  // The cross-entropy family's problem over a chunk of float32 logits z [rows, V] (or no logits: kFinalize),
  // per token (reduction none): this file reduces over all chunks.
  ce::Problem ce_chunk(ce::Mode mode, int64_t c0, int64_t rows, float* z) const {
    const auto& o = p_.options;
    ce::Problem q;
    q.mode = mode;
    q.n_rows = rows;
    q.vocab = mode == ce::Mode::kFinalize ? p_.vocab_total : V_;
    q.vocab_offset = mode == ce::Mode::kFinalize ? 0 : p_.vocab_offset;
    q.vocab_total = p_.vocab_total;
    q.dtype = DType::kFloat32;
    q.logits = z;
    q.logits_rows.nd = 1;
    q.logits_rows.sizes[0] = rows;
    q.logits_rows.strides[0] = V_;
    q.target = target_.data() + c0;
    q.target_dtype = DType::kInt64;
    q.target_rows.nd = 1;
    q.target_rows.sizes[0] = rows;
    q.target_rows.strides[0] = 1;
    q.weight = p_.class_weight;
    q.weight_stride = p_.class_weight_stride;
    q.ignore_index = o.ignore_index;
    q.reduction = Reduction::kNone;
    q.label_smoothing = static_cast<float>(o.label_smoothing);
    q.z_loss_scale = static_cast<float>(o.z_loss);
    q.softcap = static_cast<float>(o.softcap);
    q.check_targets = false;  // checked once, over every token
    q.device = p_.device;
    if (mode == ce::Mode::kForwardBackward || mode == ce::Mode::kBackward) {
      q.grad = z;  // in place: each row is read whole before its gradient is written
      q.grad_rows = q.logits_rows;
    }
    return q;
  }

  // z holds g = d(loss)/d(logits) of the chunk (x its hidden rows): grad_hidden's rows of the chunk are written,
  // dw [V, H] and db [V] (float64, either may be null) accumulate.
  void grads(int64_t c0, int64_t rows, const std::vector<float>& x, const std::vector<float>& z, double* dw,
             double* db) const {
    const bool parallel = rows * V_ * H_ >= kParallelMacs;
    if (p_.grad_hidden.data) {
#pragma omp parallel if (parallel)
      {
        std::vector<double> acc(static_cast<size_t>(H_));
#pragma omp for schedule(static)
        for (int64_t i = 0; i < rows; ++i) {
          std::fill(acc.begin(), acc.end(), 0.0);
          for (int64_t j = 0; j < V_; ++j) {
            const double g = z[i * V_ + j];
            const float* wj = &w_[j * H_];
            for (int64_t k = 0; k < H_; ++k) acc[k] += g * wj[k];
          }
          const int64_t off = (c0 + i) * p_.grad_hidden.ld;
          for (int64_t k = 0; k < H_; ++k)
            store_float(p_.grad_hidden.data, p_.grad_hidden.dtype, off + k, static_cast<float>(acc[k]));
        }
      }
    }
    if (dw || db) {
#pragma omp parallel for schedule(static) if (parallel)
      for (int64_t j = 0; j < V_; ++j) {
        double* dwj = dw ? &dw[j * H_] : nullptr;
        double bsum = 0;
        for (int64_t i = 0; i < rows; ++i) {
          const double g = z[i * V_ + j];
          bsum += g;
          if (dwj) {
            const float* xi = &x[i * H_];
            for (int64_t k = 0; k < H_; ++k) dwj[k] += g * xi[k];
          }
        }
        if (db) db[j] += bsum;
      }
    }
  }

  // The running grad_weight sum rounded as a 16-bit grad_weight that sums in itself holds it between groups (via
  // float32, as the GEMM's float32 result is rounded).
  void round_weight_grad(double* dw) const {
    const bool bf16 = p_.grad_weight.dtype == DType::kBFloat16;
    for (int64_t e = 0; e < V_ * H_; ++e) {
      const float f = static_cast<float>(dw[e]);
      dw[e] = bf16 ? bf16_bits_to_float(float_to_bf16_bits(f)) : half_bits_to_float(float_to_half_bits(f));
    }
  }

  // The accumulated grad_weight and grad_bias to their outputs.
  void store_weight_grads(const double* dw, const double* db) const {
    if (p_.grad_weight.data)
      for (int64_t j = 0; j < V_; ++j)
        for (int64_t k = 0; k < H_; ++k)
          store_float(p_.grad_weight.data, p_.grad_weight.dtype, j * p_.grad_weight.ld + k,
                      static_cast<float>(dw[j * H_ + k]));
    if (p_.grad_bias)
      for (int64_t j = 0; j < V_; ++j)
        store_float(p_.grad_bias, p_.grad_bias_dtype, j * p_.grad_bias_stride, static_cast<float>(db[j]));
  }

 private:
  double capped(double y) const {
    const double c = p_.options.softcap;
    return c > 0 ? c * std::tanh(y / c) : y;
  }

  // -Σ p ln p of softmax(capped(z)); NaN where the lse is (a NaN or +inf logit, or -inf only).
  double row_entropy(const float* z) const {
    double m = -INFINITY;
    for (int64_t j = 0; j < V_; ++j) {
      const double x = capped(z[j]);
      if (std::isnan(x)) return NAN;
      m = std::max(m, x);
    }
    if (std::isinf(m)) return NAN;
    double sum = 0;
    for (int64_t j = 0; j < V_; ++j) sum += std::exp(capped(z[j]) - m);
    const double lse = m + std::log(sum);
    double h = 0;
    for (int64_t j = 0; j < V_; ++j) {
      const double lp = capped(z[j]) - lse, pj = std::exp(lp);
      if (pj > 0) h -= pj * lp;  // 0 log 0 = 0
    }
    return h;
  }

  // Whether class t (a global class: == its column, the call being unsharded) is the first maximum of z
  // (torch.argmax's answer): a row with a NaN logit has none; a row of -inf only answers 0.
  bool first_max_is(const float* z, int64_t t) const {
    int64_t first = 0;
    for (int64_t j = 0; j < V_; ++j) {
      if (std::isnan(z[j])) return false;
      if (z[j] > z[first]) first = j;
    }
    return first == t;
  }

  const Problem& p_;
  int64_t N_, H_, V_;
  std::vector<int64_t> target_;
  double inv_denom_ = 1.0, inv_count_ = 1.0;
  std::vector<float> w_;
  std::vector<double> bias_;
};

// Rows per token group after which the running grad_weight sum is rounded to grad_weight's 16-bit dtype: the CUDA
// generic plan's groups for these options (the vocabulary-parallel steps': whole chunks); 0 where nothing is rounded
// between groups (float32 accumulation, a float32 or no grad_weight, the recompute backward).
int64_t dw_rounding_rows(const Problem& p) {
  const bool gradient_in_forward = p.mode == Mode::kForwardBackward || p.mode == Mode::kStepGradient;
  if (!gradient_in_forward || !p.grad_weight.data || p.grad_weight.dtype == DType::kFloat32 ||
      p.options.grad_weight_accumulation != GradWeightAccumulation::kWeightDtype)
    return 0;
  PlanInputs in;
  in.pass = Pass::kForwardBackward;
  in.n = p.n_tokens;
  in.h = p.hidden;
  in.v = p.vocab;
  in.elem_bytes = static_cast<int>(dtype_size(p.dtype));
  in.need_dx = p.grad_hidden.data != nullptr;
  in.need_dw = true;
  in.need_db = p.grad_bias != nullptr;
  in.grad_hidden_f32 = in.need_dx && p.grad_hidden.dtype == DType::kFloat32;
  in.dw_weight_dtype = true;
  in.copy_hidden = !p.hidden_uniform;
  in.reduction_none = p.options.reduction == Reduction::kNone;
  in.steps = p.mode == Mode::kStepGradient;
  in.chunk_tokens = p.options.chunk_tokens;
  in.memory_budget = p.options.memory_budget;
  return std::max<int64_t>(plan_linear_cross_entropy(in).group_rows, 1);
}

}  // namespace

void run_cpu(const Problem& p) {
  const int64_t N = p.n_tokens, H = p.hidden, V = p.vocab;
  const auto& o = p.options;
  // Targets first: a bad one is reported before any output is written (the backward trusts the forward).
  const Cpu cpu(p, /*check=*/p.mode != Mode::kBackward);
  const bool grads = p.mode == Mode::kForwardBackward || p.mode == Mode::kBackward;
  // Per-token upstream factors of the gradient: incoming gradient (if any) over the mean's denominators (the
  // cross-entropy term's and the z-loss term's).
  std::vector<float> row_scale, row_z_scale;
  if (grads) {
    row_scale.resize(static_cast<size_t>(N));
    row_z_scale.resize(static_cast<size_t>(N));
    for (int64_t i = 0; i < N; ++i) {
      const double up = p.grad_scale ? p.grad_scale[p.grad_scale_per_row ? i : 0] : 1.0;
      row_scale[i] = static_cast<float>(up * cpu.inv_denom());
      row_z_scale[i] = static_cast<float>(up * cpu.inv_count());
    }
  }
  std::vector<float> row_loss(static_cast<size_t>(N)), row_z(static_cast<size_t>(N)), lse_buf;
  float* lse = p.lse;
  if (!lse) {
    lse_buf.resize(static_cast<size_t>(N));
    lse = lse_buf.data();
  }
  std::vector<double> dw(p.grad_weight.data ? static_cast<size_t>(V * H) : 0, 0.0);
  std::vector<double> db(p.grad_bias ? static_cast<size_t>(V) : 0, 0.0);

  const int64_t chunk = cpu.chunk_rows(), rounding = dw_rounding_rows(p);
  std::vector<float> x, z;
  for (int64_t c0 = 0; c0 < N;) {
    // Chunks end at the rounding groups' ends.
    const int64_t group_end = rounding ? std::min(N, (c0 / rounding + 1) * rounding) : N;
    const int64_t rows = std::min(chunk, group_end - c0);
    cpu.logits(c0, rows, x, z);
    if (p.entropy) cpu.row_stats(c0, rows, z.data());
    const ce::Mode mode = p.mode == Mode::kForward    ? ce::Mode::kForward
                          : p.mode == Mode::kPartials ? ce::Mode::kPartials
                          : p.mode == Mode::kBackward ? ce::Mode::kBackward
                                                      : ce::Mode::kForwardBackward;
    ce::Problem q = cpu.ce_chunk(mode, c0, rows, z.data());
    const bool none = o.reduction == Reduction::kNone;
    q.loss = none && p.loss ? p.loss + c0 : row_loss.data() + c0;
    if (p.mode == Mode::kPartials) q.partials = p.partials + c0 * 4;
    if (p.mode == Mode::kBackward) {
      q.lse_in = p.lse + c0;
    } else {
      q.lse = lse + c0;
      q.z_loss = row_z.data() + c0;
    }
    if (grads) {
      q.grad_scale = row_scale.data() + c0;
      q.z_grad_scale = row_z_scale.data() + c0;
      q.grad_scale_per_row = true;
    }
    ce::run_cpu(q);
    if (grads) cpu.grads(c0, rows, x, z, dw.empty() ? nullptr : dw.data(), db.empty() ? nullptr : db.data());
    c0 += rows;
    if (rounding && c0 == group_end) cpu.round_weight_grad(dw.data());
  }

  if ((p.mode == Mode::kForward || p.mode == Mode::kForwardBackward) && o.reduction != Reduction::kNone)
    p.loss[0] = cpu.reduced_loss(row_loss.data(), row_z.data());
  if (grads) cpu.store_weight_grads(dw.data(), db.data());
}

// ---- the vocabulary-parallel steps ----------------------------------------------------------------------------
// Host workspace: float64 grad_weight [V, H] and grad_bias [V] accumulators (when wanted), then float64 per-token
// shares of the reduced loss [N].

namespace {
struct StepState {
  double* dw = nullptr;
  double* db = nullptr;
  double* row_loss = nullptr;
};

StepState step_state(const Problem& p, Workspace ws) {
  StepState s;
  auto* base = static_cast<double*>(ws.data);
  size_t at = 0;
  if (p.grad_weight.data) s.dw = base + at, at += static_cast<size_t>(p.vocab * p.hidden);
  if (p.grad_bias) s.db = base + at, at += static_cast<size_t>(p.vocab);
  s.row_loss = base + at;
  return s;
}
}  // namespace

size_t cpu_step_workspace_bytes(const Problem& p) {
  size_t doubles = static_cast<size_t>(p.n_tokens);
  if (p.grad_weight.data) doubles += static_cast<size_t>(p.vocab * p.hidden);
  if (p.grad_bias) doubles += static_cast<size_t>(p.vocab);
  return doubles * sizeof(double);
}

void run_cpu_step(const Problem& p, Workspace ws) {
  const int64_t N = p.n_tokens, H = p.hidden, V = p.vocab, S = p.options.chunk_tokens;
  const int64_t k = p.step_chunk, c0 = k * S, rows = std::min(S, N - c0);
  const StepState st = step_state(p, ws);
  // The first step checks the targets (every rank raises the same error before any exchange).
  const Cpu cpu(p, /*check=*/p.mode == Mode::kStepLogits && k == 0);
  std::vector<float> x, z;
  if (p.mode == Mode::kStepLogits) {
    if (k == 0) {
      if (st.dw) std::fill(st.dw, st.dw + V * H, 0.0);
      if (st.db) std::fill(st.db, st.db + V, 0.0);
    }
    cpu.logits(c0, rows, x, z);
    ce::Problem q = cpu.ce_chunk(ce::Mode::kPartials, c0, rows, z.data());
    q.partials = p.partials;
    ce::run_cpu(q);
    return;
  }
  // The chunk's losses and lse from every shard's partials, then its gradients from that lse.
  std::vector<float> loss_rows(static_cast<size_t>(rows)), z_rows(static_cast<size_t>(rows)),
      lse_buf(static_cast<size_t>(rows));
  float* lse = p.lse ? p.lse + c0 : lse_buf.data();
  ce::Problem f = cpu.ce_chunk(ce::Mode::kFinalize, c0, rows, nullptr);
  f.partials_in = p.partials_in;
  f.n_shards = p.n_shards;
  f.loss = loss_rows.data();
  f.lse = lse;
  f.z_loss = z_rows.data();
  ce::run_cpu(f);
  // Each token's share of the reduced loss: its cross-entropy term over the target weights' sum, its z-loss term
  // over the count.
  for (int64_t i = 0; i < rows; ++i) {
    const double zt = z_rows[i];
    st.row_loss[c0 + i] =
        (static_cast<double>(loss_rows[i]) - zt) * cpu.inv_denom() + (zt != 0 ? zt * cpu.inv_count() : 0.0);
  }

  cpu.logits(c0, rows, x, z);
  ce::Problem b = cpu.ce_chunk(ce::Mode::kBackward, c0, rows, z.data());
  const float scale = static_cast<float>(cpu.inv_denom()), z_scale = static_cast<float>(cpu.inv_count());
  b.lse_in = lse;
  b.grad_scale = &scale;
  b.z_grad_scale = &z_scale;
  b.grad_scale_per_row = false;
  ce::run_cpu(b);
  cpu.grads(c0, rows, x, z, st.dw, st.db);
  const int64_t rounding = dw_rounding_rows(p);  // groups of whole chunks
  if (rounding && ((c0 + rows) % rounding == 0 || c0 + rows == N)) cpu.round_weight_grad(st.dw);

  if (c0 + rows == N) {  // the last chunk: the loss and the weight's gradients are complete
    double total = 0;
    for (int64_t i = 0; i < N; ++i) total += st.row_loss[i];  // fixed order: deterministic
    p.loss[0] = static_cast<float>(total);
    cpu.store_weight_grads(st.dw, st.db);
  }
}

}  // namespace logitless::lce
