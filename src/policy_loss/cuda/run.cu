// Policy losses and selective log-softmax on CUDA: the per-call sequence
//   1. prepass: per sequence (per 8192-token segment for selective log-softmax), the sum of token weights and the
//      first unmasked bad id; then one CTA folds those into the batch's total, the first bad token overall and
//      each sequence's reduction factor;
//   2. in eager mode, read back the first bad token (common/cuda/index_readback.h) and throw before anything is
//      written;
//   3. the row kernel (kernels_streaming.cu): token level, the outputs and (fused) the gradient in one pass; sequence
//   level,
//      statistics only, then the sequence kernel (the shared ratio, the per-token terms, the sequence's loss),
//      then the row kernel again from the saved lse for the gradient;
//   4. a deterministic one-CTA sum of the loss, and zeros for the unused last position's gradient.
// Nothing synchronizes with the host except step 2, which is skipped while a CUDA graph is being captured.
#include <algorithm>
#include <utility>

#include "common/cuda/check.cuh"
#include "common/cuda/index_readback.h"
#include "policy_loss/cuda/kernels.h"
#include "policy_loss/cuda/steps.h"
#include "policy_loss/cuda/tokens.cuh"
#include "policy_loss/math.h"
#include "policy_loss/problem.h"

namespace logitless::pl {
namespace {

constexpr int kReduceThreads = 1024;
constexpr int kSeqThreads = 256;
constexpr int64_t kSelectiveSegment = 8192;  // tokens per prepass CTA for selective log-softmax

size_t align256(size_t x) { return (x + 255) / 256 * 256; }

int64_t segments(Op op, int64_t n_seqs, int64_t n_rows) {
  return op == Op::kSelective ? (n_rows + kSelectiveSegment - 1) / kSelectiveSegment : n_seqs;
}

// Deterministic block sums (fixed tree): every thread gets the result.
template <typename F>
__device__ F block_sum(F v, F* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  F r = 0;
  for (int i = 0; i < nwarps; ++i) r += scratch[i];
  __syncthreads();
  return r;
}

__device__ long long block_min(long long v, long long* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  long long r = scratch[0];
  for (int i = 1; i < nwarps; ++i) r = min(r, scratch[i]);
  __syncthreads();
  return r;
}

// One CTA per segment of `seg_len` tokens: its weight sum and first unmasked bad id.
__global__ void __launch_bounds__(kSeqThreads) prepass_kernel(const KernelParams p, int64_t seg_len, int64_t n_segs) {
  __shared__ double sh_d[kSeqThreads / 32];
  __shared__ long long sh_b[kSeqThreads / 32];
  for (int64_t s = blockIdx.x; s < n_segs; s += gridDim.x) {
    const int64_t lo = s * seg_len, hi = min(p.n_rows, lo + seg_len);
    double w = 0;
    long long bad = p.n_rows;
    for (int64_t r = lo + threadIdx.x; r < hi; r += blockDim.x) {
      const float wr = token_weight(p, r);
      if (wr == 0.f) continue;
      w += wr;
      const int64_t id = token_id(p, r);
      if ((id < 0 || id >= p.vocab) && r < bad) bad = r;
    }
    w = block_sum(w, sh_d);
    bad = block_min(bad, sh_b);
    if (threadIdx.x == 0) {
      p.seq[s].weight = static_cast<float>(w);
      p.seq[s].first_bad = bad;
      p.seq[s].loss = 0;
      p.seq[s].ratio = 1.f;
      p.seq[s].ratio_coeff = 0.f;
    }
  }
}

// One CTA: the batch's total weight, the first bad token, and every sequence's reduction factor.
__global__ void __launch_bounds__(kReduceThreads)
    totals_kernel(const KernelParams p, int64_t n_segs, PolicyLossType type, int64_t max_len, double num_items) {
  __shared__ double sh_d[kReduceThreads / 32];
  __shared__ long long sh_b[kReduceThreads / 32];
  double w = 0;
  long long bad = p.n_rows;
  for (int64_t s = threadIdx.x; s < n_segs; s += blockDim.x) {
    w += p.seq[s].weight;
    bad = min(bad, p.seq[s].first_bad);
  }
  const double total = block_sum(w, sh_d);
  bad = block_min(bad, sh_b);
  if (threadIdx.x == 0) {
    p.scalars->total_weight = total;
    p.scalars->first_bad = bad;
  }
  if (p.op == static_cast<int>(RowOp::kSelective)) return;
  for (int64_t s = threadIdx.x; s < n_segs; s += blockDim.x)
    p.seq[s].factor =
        static_cast<float>(seq_factor<double>(type, p.seq[s].weight, total, p.n_seqs, max_len, num_items));
}

// Sequence level, one CTA per sequence, after the statistics pass wrote logp: the shared ratio R = exp(S), its
// share of every token's c, each token's outputs, and the sequence's share of the loss.
__global__ void __launch_bounds__(kSeqThreads) sequence_kernel(const KernelParams p) {
  __shared__ double sh[kSeqThreads / 32];
  const TermOptions<float> o{p.beta, p.eps_low, p.eps_high, p.has_old != 0, p.has_ref != 0};
  for (int64_t b = blockIdx.x; b < p.n_seqs; b += gridDim.x) {
    const int64_t lo = b * p.seq_len, hi = lo + p.seq_len;
    double s = 0;
    for (int64_t r = lo + threadIdx.x; r < hi; r += blockDim.x) {
      const float w = token_weight(p, r);
      if (w == 0.f) continue;
      const float logp = p.out_logp[r];
      const float old = p.has_old ? p.old_logp[p.old_rows.offset(r)] : logp;
      s += static_cast<double>(w) * (static_cast<double>(logp) - old);
    }
    s = block_sum(s, sh);
    const SeqStats st = p.seq[b];
    const float adv = p.adv[b * p.adv_stride];
    const float ratio = static_cast<float>(exp(s / seq_denominator<double>(st.weight)));
    double loss = 0;
    for (int64_t r = lo + threadIdx.x; r < hi; r += blockDim.x) {
      const float w = token_weight(p, r);
      float tl = 0.f, kl = 0.f;
      uint8_t clipped = 0;
      if (w != 0.f) {
        const float ref = p.has_ref ? p.ref_logp[p.ref_rows.offset(r)] : 0.f;
        const TokenTerms<float> t = token_terms_seq<float>(p.out_logp[r], ref, adv, ratio, o);
        tl = t.loss;
        kl = t.kl;
        clipped = t.clipped ? 1 : 0;
        loss += static_cast<double>(w) * st.factor * t.loss;
      }
      if (p.out_loss) p.out_loss[r] = tl;
      if (p.out_kl) p.out_kl[r] = kl;
      if (p.out_clipped) p.out_clipped[r] = clipped;
    }
    loss = block_sum(loss, sh);
    if (threadIdx.x == 0) {
      p.seq[b].ratio = ratio;
      p.seq[b].ratio_coeff = seq_ratio_coeff<float>(ratio, adv, st.factor, st.weight, o);
      p.seq[b].loss = loss;
    }
  }
}

// c = d(loss)/d(logp) of each token of [first, first + n) from its saved logp: the row kernel's forward
// epilogue (token level) and backward coefficient (sequence level), for a caller that forms the gradient of the
// logits itself.
__global__ void coefficients_kernel(const KernelParams p, int64_t first, int64_t n, float* coeff) {
  const TermOptions<float> o{p.beta, p.eps_low, p.eps_high, p.has_old != 0, p.has_ref != 0};
  const float gscale = p.grad_scale ? p.grad_scale[0] : 1.f;
  const bool seq = p.op == static_cast<int>(RowOp::kPolicySequence);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = first + i;
    const float w = token_weight(p, r);
    float c = 0.f;
    if (w != 0.f) {
      const int64_t id = token_id(p, r);
      if (id < 0 || id >= p.vocab) {
        c = NAN;
      } else {
        const int64_t b = r / p.seq_len;
        const SeqStats st = p.seq[b];
        const float adv = p.adv[b * p.adv_stride];
        const float logp = p.out_logp[r];
        const float ref = p.has_ref ? p.ref_logp[p.ref_rows.offset(r)] : 0.f;
        if (seq) {
          const TokenTerms<float> t = token_terms_seq<float>(logp, ref, adv, st.ratio, o);
          c = (w * st.factor * t.dlogp + w * st.ratio_coeff) * gscale;
        } else {
          const float old = p.has_old ? p.old_logp[p.old_rows.offset(r)] : logp;
          const TokenTerms<float> t = token_terms<float>(logp, old, ref, adv, o);
          c = w * st.factor * t.dlogp * gscale;
        }
      }
    }
    coeff[r] = c;
  }
}

// The loss: the tokens' shares (token level) or the sequences' (sequence level), summed in a fixed order.
__global__ void __launch_bounds__(kReduceThreads)
    finalize_kernel(const KernelParams p, int sequence_level, float* loss) {
  __shared__ double sh[kReduceThreads / 32];
  double s = 0;
  if (sequence_level) {
    for (int64_t b = threadIdx.x; b < p.n_seqs; b += blockDim.x) s += p.seq[b].loss;
  } else {
    for (int64_t r = threadIdx.x; r < p.n_rows; r += blockDim.x) s += p.row_loss[r];
  }
  s = block_sum(s, sh);
  if (threadIdx.x == 0) loss[0] = static_cast<float>(s);
}

__global__ void zero_scalar_kernel(float* loss) { loss[0] = 0.f; }

struct WorkspaceLayout {
  size_t seq = 0, row_loss = 0, logp = 0, lse = 0, total = 0;
};

WorkspaceLayout layout_of(Op op, int64_t n_seqs, int64_t n_rows, ImportanceSamplingLevel level) {
  WorkspaceLayout w;
  const size_t n = static_cast<size_t>(std::max<int64_t>(n_rows, 0));
  w.seq = kScalarsBytes;
  w.row_loss =
      w.seq + align256(static_cast<size_t>(std::max<int64_t>(segments(op, n_seqs, n_rows), 0)) * sizeof(SeqStats));
  w.logp = w.row_loss + (op == Op::kPolicy ? align256(n * sizeof(float)) : 0);
  const bool seq = op == Op::kPolicy && level == ImportanceSamplingLevel::kSequence;
  // Sequence level: the statistics pass keeps logp and lse for the sequence kernel and the gradient pass.
  w.lse = w.logp + (seq ? align256(n * sizeof(float)) : 0);
  w.total = w.lse + (seq ? align256(n * sizeof(float)) : 0);
  return w;
}

KernelParams make_params(const Problem& pr, char* ws, const WorkspaceLayout& wl) {
  KernelParams k;
  k.logits = static_cast<const char*>(pr.logits);
  k.logits_rows = pr.logits_rows;
  k.ids = pr.ids;
  k.ids_is64 = pr.ids_dtype == DType::kInt64;
  k.ids_rows = pr.ids_rows;
  k.mask = pr.mask;
  k.mask_dtype = static_cast<int32_t>(pr.mask_dtype);
  k.mask_rows = pr.mask_rows;
  k.old_logp = pr.old_logp;
  k.old_rows = pr.old_rows;
  k.ref_logp = pr.ref_logp;
  k.ref_rows = pr.ref_rows;
  k.adv = pr.advantages;
  k.adv_stride = pr.adv_stride;
  k.grad = static_cast<char*>(pr.grad);
  k.grad_rows = pr.grad_rows;
  k.out_logp = pr.logp;
  k.out_entropy = pr.entropy;
  k.out_lse = pr.lse;
  k.out_loss = pr.per_token_loss;
  k.out_kl = pr.kl;
  k.out_clipped = pr.is_clipped;
  k.out_top1 = pr.is_top1;
  k.scalars = reinterpret_cast<Scalars*>(ws);
  k.seq = reinterpret_cast<SeqStats*>(ws + wl.seq);
  if (pr.op == Op::kPolicy) k.row_loss = reinterpret_cast<float*>(ws + wl.row_loss);
  k.grad_scale = pr.grad_scale;
  k.n_rows = pr.n_rows;
  k.vocab = pr.vocab;
  k.seq_len = std::max<int64_t>(pr.seq_len, 1);
  k.n_seqs = pr.n_seqs;
  k.slice = pr.vocab;
  k.op = static_cast<int32_t>(pr.op == Op::kSelective ? RowOp::kSelective
                              : pr.sequence_level()   ? RowOp::kPolicySequence
                                                      : RowOp::kPolicyToken);
  k.has_old = pr.old_logp != nullptr;
  k.has_ref = pr.ref_logp != nullptr;
  k.inv_temp = static_cast<float>(1.0 / pr.temperature);
  k.scale_l2 = static_cast<float>(1.4426950408889634 / pr.temperature);
  k.beta = static_cast<float>(pr.beta);
  k.eps_low = static_cast<float>(pr.eps_low);
  k.eps_high = static_cast<float>(pr.eps_high);
  return k;
}

// The row kernel with the plan for this call: fused (statistics and gradient in one pass) decides whether a
// cluster is worth it.
void run_rows(const Problem& pr, const KernelParams& base, RowsVariant v, bool fused, cudaStream_t stream) {
  const DeviceInfo& info = device_info(pr.device.index);
  RowsPlanInputs in;
  in.vocab = pr.vocab;
  in.elem_bytes = static_cast<int>(dtype_size(pr.dtype));
  in.fused = fused;
  in.cluster_capable = cluster_launch_available(pr.device.index);
  // The first maximum is folded in by one CTA per row; a pass that reads each row once streams anyway.
  in.requested = v.top1 ? PolicyLossAlgo::kStreaming : pr.algo;
  in.cluster_size = pr.cluster_size;
  in.threads = pr.threads;
  in.ctas_per_sm = rows_ctas_per_sm(pr.dtype, v, plan_threads(in));
  // The row-resident kernel serves the fused pass only (the one pass that needs the row twice).
  in.resident_capable = fused && !v.with_lse && rows_resident_available(pr.device.index);
  in.smem_per_block = info.max_smem_per_block_optin - 2048;  // room for its static shared memory (about 1 KB)
  in.smem_per_sm = info.max_smem_per_sm;
  RowsPlan plan = plan_rows(in);
  if (plan.algo == PolicyLossAlgo::kAuto)
    throw_invalid(
        str_cat("algo: expected an algorithm this GPU can run; cluster and row_resident need thread-block "
                "clusters (sm_90 and a build for it), row_resident also rows that fit 16 CTAs' shared "
                "memory, got V=",
                pr.vocab, " on sm_", info.sm_major, info.sm_minor));
  KernelParams p = base;
  p.slice = plan.slice;
  if (plan.algo == PolicyLossAlgo::kRowResident) {
    if (launch_rows_resident(pr.dtype, v, p, plan, stream)) return;
    if (pr.algo == PolicyLossAlgo::kRowResident)
      throw_invalid(str_cat("algo: row_resident cannot place a cluster of ", plan.cluster, " CTAs with ",
                            plan.smem_bytes, " bytes of shared memory each on this GPU"));
  } else if (launch_rows(pr.dtype, v, p, plan, info.sm_count, stream)) {
    return;
  }
  if (pr.algo == PolicyLossAlgo::kCluster)
    throw_invalid(str_cat("algo: cluster cannot place a cluster of ", plan.cluster, " CTAs on this GPU"));
  // Auto: no cluster of that size fits here; stream instead.
  RowsPlan streaming;
  streaming.threads = pr.threads > 0 ? pr.threads : 256;
  streaming.slice = pr.vocab;
  p.slice = pr.vocab;
  launch_rows(pr.dtype, v, p, streaming, info.sm_count, stream);
}

KernelParams with_chunk(const KernelParams& base, const Chunk& c) {
  KernelParams k = base;
  k.logits = static_cast<const char*>(c.logits);
  k.logits_rows = c.logits_rows;
  k.grad = static_cast<char*>(c.grad);
  k.grad_rows = c.grad_rows;
  k.first_token = c.first_token;
  k.n_rows = c.n_tokens;
  return k;
}

}  // namespace

size_t cuda_workspace_bytes(Op op, int64_t n_seqs, int64_t n_rows, ImportanceSamplingLevel level) {
  return layout_of(op, n_seqs, n_rows, level).total;
}

PolicySteps::PolicySteps(const Problem& pr, Workspace ws, cudaStream_t stream)
    : pr_(pr), ws_(static_cast<char*>(ws.data)), stream_(stream) {
  const WorkspaceLayout wl = layout_of(pr.op, pr.n_seqs, pr.n_rows, pr.level);
  base_ = make_params(pr, ws_, wl);
  if (pr.sequence_level()) {
    // The statistics pass keeps logp and lse for the sequence kernel and the gradient pass (the caller's outputs
    // when it asked for them, workspace otherwise).
    if (!base_.out_logp) base_.out_logp = reinterpret_cast<float*>(ws_ + wl.logp);
    if (!base_.out_lse) base_.out_lse = reinterpret_cast<float*>(ws_ + wl.lse);
  }
}

Chunk PolicySteps::whole() const {
  Chunk c;
  c.logits = pr_.logits;
  c.logits_rows = pr_.logits_rows;
  c.grad = pr_.grad;
  c.grad_rows = pr_.grad_rows;
  c.first_token = 0;
  c.n_tokens = pr_.n_rows;
  return c;
}

void PolicySteps::begin() {
  if (pr_.n_rows <= 0) return;
  const int64_t n_segs = segments(pr_.op, pr_.n_seqs, pr_.n_rows);
  const int64_t seg_len = pr_.op == Op::kSelective ? kSelectiveSegment : base_.seq_len;
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(n_segs, 65535));
  prepass_kernel<<<grid, kSeqThreads, 0, stream_>>>(base_, seg_len, n_segs);
  LOGITLESS_CUDA_CHECK_LAUNCH("policy-loss prepass");
  totals_kernel<<<1, kReduceThreads, 0, stream_>>>(base_, n_segs, pr_.loss_type, pr_.max_completion_length,
                                                   pr_.num_items_in_batch);
  LOGITLESS_CUDA_CHECK_LAUNCH("policy-loss totals");
  if (pr_.check_ids && !stream_is_capturing(stream_))
    readback_ = &IndexReadback::start(pr_.device.index, &base_.scalars->first_bad, stream_);
}

void PolicySteps::check_ids() {
  if (!readback_) return;
  const std::optional<BadIndex> bad =
      std::exchange(readback_, nullptr)->first_bad(pr_.n_rows, pr_.ids, pr_.ids_dtype, pr_.ids_rows);
  if (!bad) return;
  if (pr_.op == Op::kSelective)
    throw_invalid(str_cat("ids: expected values in [0, ", pr_.vocab, "), got ", bad->value, " at row ", bad->row,
                          " (the first bad row)"));
  throw_invalid(str_cat("completion_ids: expected values in [0, ", pr_.vocab, ") at unmasked tokens, got ", bad->value,
                        " at [", bad->row / pr_.seq_len, ", ", bad->row % pr_.seq_len, "] (the first bad token)"));
}

void PolicySteps::rows(const Chunk& c) {
  if (c.n_tokens <= 0) return;
  KernelParams k = with_chunk(base_, c);
  const bool seq_level = pr_.sequence_level();
  if (seq_level) k.grad = nullptr;  // the sequence level's gradient needs every sequence's ratio first
  // Token level: outputs, the loss's shares and (with a gradient) the gradient, in one pass over each row.
  run_rows(pr_, k, RowsVariant{false, k.out_entropy != nullptr, k.out_top1 != nullptr}, k.grad != nullptr, stream_);
}

void PolicySteps::sequence() {
  if (!pr_.sequence_level() || pr_.n_seqs <= 0 || pr_.n_rows <= 0) return;
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(pr_.n_seqs, 65535));
  sequence_kernel<<<grid, kSeqThreads, 0, stream_>>>(base_);
  LOGITLESS_CUDA_CHECK_LAUNCH("policy-loss sequence terms");
}

void PolicySteps::rows_backward(const Chunk& c) {
  if (c.n_tokens <= 0 || !c.grad) return;
  KernelParams k = with_chunk(base_, c);
  if (pr_.op == Op::kSelective) {
    k.lse_in = pr_.lse_in;
    k.grad_logp = pr_.grad_logp;
  } else {
    k.lse_in = base_.out_lse;
    k.logp_in = base_.out_logp;
  }
  run_rows(pr_, k, RowsVariant{true, false}, false, stream_);
}

void PolicySteps::coefficients(int64_t first_token, int64_t n_tokens, float* coeff) {
  if (pr_.op != Op::kPolicy || n_tokens <= 0) return;
  if (!base_.out_logp) throw_invalid("policy-loss coefficients: the problem needs a logp output to read them from");
  const int64_t blocks = std::min<int64_t>((n_tokens + kSeqThreads - 1) / kSeqThreads, 4096);
  coefficients_kernel<<<static_cast<unsigned>(blocks), kSeqThreads, 0, stream_>>>(base_, first_token, n_tokens, coeff);
  LOGITLESS_CUDA_CHECK_LAUNCH("policy-loss coefficients");
}

void PolicySteps::finish() {
  if (pr_.op != Op::kPolicy) return;
  if (pr_.n_rows > 0) {
    finalize_kernel<<<1, kReduceThreads, 0, stream_>>>(base_, pr_.sequence_level() ? 1 : 0, pr_.loss);
  } else {
    zero_scalar_kernel<<<1, 1, 0, stream_>>>(pr_.loss);  // no tokens: loss 0
  }
  LOGITLESS_CUDA_CHECK_LAUNCH("policy-loss finalize");
}

void run_cuda(const Problem& pr, Workspace ws, StreamHandle stream_handle) {
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_handle);
  DeviceGuard guard(pr.device.index);
  PolicySteps s(pr, ws, stream);
  const Chunk all = s.whole();
  if (pr.mode == Mode::kBackward) {  // selective log-softmax from the saved lse: one read, one write
    s.rows_backward(all);
    return;
  }
  s.begin();
  s.check_ids();
  s.rows(all);
  if (pr.sequence_level()) {
    s.sequence();
    if (pr.mode == Mode::kForwardBackward) s.rows_backward(all);
  }
  s.finish();
  if (pr.op == Op::kPolicy && pr.mode == Mode::kForwardBackward && pr.n_pad > 0)
    launch_zero_rows(pr.dtype, pr.grad_pad, pr.grad_pad_stride, pr.n_pad, pr.vocab, stream);
}

}  // namespace logitless::pl
