// Cross-entropy on CUDA: the per-call sequence
//   1. prepass (one CTA): mean denominator, sum of class weights, first out-of-range target;
//   2. in eager mode, start copying the first bad row back to the host;
//   3. the row kernel (row-resident on Hopper, streaming elsewhere, streaming for the backward);
//   4. for sum/mean, a deterministic one-CTA reduction of the per-row losses;
//   5. in eager mode, wait for the copy of step 2 and throw if a target is bad. The kernels of steps 3 and 4 were
//      told so (KernelParams::abort_on_bad): they write nothing, so the call fails with every output untouched,
//      the logits included when the gradient goes in place, and the GPU never waits for the host.
// Nothing synchronizes with the host except step 5, which is skipped while a CUDA graph is being captured.
#include <algorithm>

#include "common/cuda/check.cuh"
#include "common/cuda/index_readback.h"
#include "cross_entropy/cuda/device.cuh"
#include "cross_entropy/cuda/kernels.h"
#include "cross_entropy/cuda/plan.h"
#include "cross_entropy/cuda/steps.h"
#include "cross_entropy/problem.h"

namespace logitless::ce {
namespace {

constexpr int kReduceThreads = 1024;

size_t align256(size_t x) { return (x + 255) / 256 * 256; }

// Fixed thread count and fixed per-thread order: the sums come out bit-identical on every run.
__global__ void __launch_bounds__(kReduceThreads) prepass_kernel(const KernelParams p, const Prepass q) {
  __shared__ double sh_d[kReduceThreads / 32];
  __shared__ long long sh_b[kReduceThreads / 32], sh_c[kReduceThreads / 32];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  double denom = 0;
  long long bad = p.n_rows, count = 0;
  for (int64_t i = tid; i < p.n_rows; i += blockDim.x) {
    const int64_t t = load_target(p, i);
    if (q.targets_out) q.targets_out[i] = t;
    const RowKind k = classify(p, t);
    if (k == RowKind::kValid) denom += target_weight(p, t), ++count;
    if (k == RowKind::kBad && i < bad) bad = i;
  }
  double wsum = static_cast<double>(p.vocab_total);  // W is over the whole vocabulary, also for a shard
  for (int o = 16; o > 0; o >>= 1) {
    denom += __shfl_xor_sync(0xFFFFFFFFu, denom, o);
    count += __shfl_xor_sync(0xFFFFFFFFu, count, o);
    bad = min(bad, __shfl_xor_sync(0xFFFFFFFFu, bad, o));
  }
  if (lane == 0) sh_d[warp] = denom, sh_b[warp] = bad, sh_c[warp] = count;
  __syncthreads();
  if (p.weight && p.eps != 0.f) {  // W is only used by label smoothing
    double w = 0;
    for (int64_t j = tid; j < p.vocab_total; j += blockDim.x) w += target_weight(p, j);
    for (int o = 16; o > 0; o >>= 1) w += __shfl_xor_sync(0xFFFFFFFFu, w, o);
    __shared__ double sh_w[kReduceThreads / 32];
    if (lane == 0) sh_w[warp] = w;
    __syncthreads();
    if (tid == 0) {
      wsum = 0;
      for (int i = 0; i < kReduceThreads / 32; ++i) wsum += sh_w[i];
    }
  }
  if (tid == 0) {
    double d = 0;
    long long b = p.n_rows, c = 0;
    for (int i = 0; i < kReduceThreads / 32; ++i) d += sh_d[i], b = min(b, sh_b[i]), c += sh_c[i];
    const bool mean = q.reduction == Reduction::kMean;
    q.out->inv_denom = mean ? (d != 0 ? static_cast<float>(1.0 / d) : 0.f) : 1.f;
    q.out->inv_count = mean ? (c != 0 ? static_cast<float>(1.0 / static_cast<double>(c)) : 0.f) : 1.f;
    q.out->weight_sum = static_cast<float>(wsum);
    q.out->first_bad = b;
    if (q.rows_out) *q.rows_out = Scalars{1.f, 1.f, static_cast<float>(wsum), b};
  }
}

__global__ void __launch_bounds__(kReduceThreads)
    finalize_kernel(const float* row_loss, int64_t n_rows, const Scalars* scalars, float* loss, int abort_on_bad) {
  __shared__ double sh[kReduceThreads / 32];
  if (abort_on_bad && scalars->first_bad < n_rows) return;  // as the row kernels (KernelParams::abort_on_bad)
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  double s = 0;
  for (int64_t i = tid; i < n_rows; i += blockDim.x) s += row_loss[i];
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xFFFFFFFFu, s, o);
  if (lane == 0) sh[warp] = s;
  __syncthreads();
  if (tid == 0) {
    double total = 0;
    for (int i = 0; i < kReduceThreads / 32; ++i) total += sh[i];
    // The rows' losses are their shares of the mean already (write_row_outputs). No rows: the sum is 0 and so is
    // the mean.
    loss[0] = n_rows > 0 ? static_cast<float>(total) : 0.f;
  }
}

// Every shard's partials of each row [n_shards, N] combined in rank order (include/logitless/vocab_parallel.h),
// then the row's outputs as the row kernels write them. One thread per row: R float4 reads each.
__global__ void combine_partials_kernel(const KernelParams p, const float4* partials, int64_t n_shards) {
  if (aborted(p)) return;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < p.n_rows;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = load_target(p, i);
    const RowKind kind = classify(p, t);
    RowStats st{0.f, 0.f, 0.f};
    if (kind == RowKind::kValid) {
      float M = -INFINITY;
      for (int64_t r = 0; r < n_shards; ++r) M = max_nan(M, partials[r * p.n_rows + i].x);
      float s = 0.f;
      for (int64_t r = 0; r < n_shards; ++r) {
        const float4 q = partials[r * p.n_rows + i];
        if (q.x != -INFINITY) s += q.y * expf(q.x - M);  // accurate exp: R terms per row, not a hot loop
        st.x_target += q.z;
        st.sum_wx += q.w;
      }
      // NaN, +inf (an infinite logit) or -inf (every logit -inf) as the maximum: NaN, as for one device.
      st.lse = isfinite(M) ? M + logf(s) : NAN;
    }
    write_row_outputs(p, i, kind, st, t);
  }
}

}  // namespace

KernelParams make_params(const Problem& pr, const Scalars* scalars, float* row_loss) {
  KernelParams k;
  k.logits = static_cast<const char*>(pr.logits);
  k.logits_rows = pr.logits_rows;
  k.target = pr.target;
  k.target_is64 = pr.target_dtype == DType::kInt64;
  k.target_rows = pr.target_rows;
  k.weight = pr.weight;
  k.weight_stride = pr.weight_stride;
  k.row_loss = row_loss;
  k.lse = pr.lse;
  k.z_loss = pr.z_loss;
  k.grad = static_cast<char*>(pr.grad);
  k.grad_rows = pr.grad_rows;
  k.lse_in = pr.lse_in;
  k.grad_scale = pr.grad_scale;
  k.grad_scale_per_row = pr.grad_scale_per_row;
  k.scalars = scalars;
  k.partials = pr.partials;
  k.n_rows = pr.n_rows;
  k.vocab = pr.vocab;
  k.vocab_offset = pr.vocab_offset;
  k.vocab_total = pr.total_vocab();
  k.ignore_index = pr.ignore_index;
  k.eps = pr.label_smoothing;
  k.inv_v = 1.f / static_cast<float>(pr.total_vocab());
  k.z = pr.z_loss_scale;
  k.softcap = pr.softcap;
  return k;
}

void throw_if_bad_target(IndexReadback& rb, int64_t n_rows, const void* targets, DType dtype, const RowLayout& rows,
                         int64_t vocab, int64_t ignore_index) {
  if (const std::optional<BadIndex> bad = rb.first_bad(n_rows, targets, dtype, rows))
    throw_invalid(str_cat("target: expected values in [0, ", vocab, ") or ignore_index (", ignore_index, "), got ",
                          bad->value, " at row ", bad->row, " (the first bad row)"));
}

size_t cuda_workspace_bytes(int64_t n_rows, int64_t vocab, bool has_weight, const CrossEntropyOptions& o) {
  (void)vocab;
  (void)has_weight;
  (void)o;
  // Scalars, then one float per row for the sum/mean partials.
  return kScalarsBytes + align256(static_cast<size_t>(std::max<int64_t>(n_rows, 0)) * sizeof(float));
}

void launch_prepass(const KernelParams& p, const Prepass& q, cudaStream_t stream) {
  launch_kernel("launch of cross-entropy prepass", prepass_kernel, dim3(1), dim3(kReduceThreads), 0, stream, p, q);
}

void launch_rows(const Problem& pr, const KernelParams& kp, cudaStream_t stream) {
  if (pr.n_rows <= 0) return;
  const DeviceInfo& info = device_info(pr.device.index);
  if (pr.mode == Mode::kFinalize) {
    const int64_t blocks = std::min<int64_t>((pr.n_rows + 255) / 256, static_cast<int64_t>(info.sm_count) * 8);
    combine_partials_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(
        kp, reinterpret_cast<const float4*>(pr.partials_in), pr.n_shards);
    LOGITLESS_CUDA_CHECK_LAUNCH("cross-entropy shard finalize");
    return;
  }
  if (pr.mode == Mode::kPartials || pr.vocab_offset != 0 || pr.vocab != pr.total_vocab()) {
    // A vocabulary shard: its partial statistics, or its backward from the global lse. Both read each row once,
    // which the streaming kernel does on every GPU (the row-resident kernel serves whole rows read twice).
    launch_streaming(pr.dtype, kp, pr.mode == Mode::kBackward, info.sm_count, stream);
    debug::last_launch.set(debug::LaunchRecord{Plan{}, 0});
    return;
  }
  PlanInputs in;
  in.vocab = pr.vocab;
  in.elem_bytes = static_cast<int>(dtype_size(pr.dtype));
  in.backward_only = pr.mode == Mode::kBackward;
  in.forward_only = pr.mode == Mode::kForward;
  in.row_resident_capable = row_resident_available(pr.device.index);
  in.smem_per_block = info.max_smem_per_block_optin - 4096;  // room for the static shared memory (about 2 KB)
  in.smem_per_sm = info.max_smem_per_sm;
  in.requested = pr.algo;
  Plan plan = plan_cross_entropy(in);
  if (const debug::PlanHook hook = debug::plan_hook.get()) hook(plan);
  if (plan.algo == CrossEntropyAlgo::kAuto)
    throw_invalid(
        str_cat("algo: expected an algorithm this GPU can run; row_resident needs a Hopper GPU (sm_90) "
                "and rows that fit a cluster's shared memory, got V=",
                pr.vocab, " on sm_", info.sm_major, info.sm_minor));
  int clusters = 0;
  if (plan.algo == CrossEntropyAlgo::kRowResident) {
    clusters = launch_row_resident(pr.dtype, kp, plan, pr.device.index, stream);
    if (clusters == 0 && pr.algo == CrossEntropyAlgo::kRowResident)
      throw_invalid(str_cat("algo: row_resident cannot place a cluster of ", plan.cluster, " CTAs on this GPU"));
  }
  if (clusters == 0) launch_streaming(pr.dtype, kp, pr.mode == Mode::kBackward, info.sm_count, stream);
  debug::last_launch.set(debug::LaunchRecord{plan, clusters});
}

void run_cuda(const Problem& pr, Workspace ws, StreamHandle stream_handle) {
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_handle);
  DeviceGuard guard(pr.device.index);
  Scalars* scalars = static_cast<Scalars*>(ws.data);
  float* partials = reinterpret_cast<float*>(static_cast<char*>(ws.data) + kScalarsBytes);
  const bool loss_out = pr.mode != Mode::kBackward && pr.mode != Mode::kPartials;
  float* row_loss = loss_out ? (pr.reduction == Reduction::kNone ? pr.loss : partials) : nullptr;
  KernelParams kp = make_params(pr, scalars, row_loss);
  IndexReadback* readback = nullptr;

  if (pr.n_rows > 0) {
    launch_prepass(kp, Prepass{pr.reduction, scalars}, stream);
    const bool checks = pr.mode != Mode::kBackward;  // the backward trusts the forward's check
    // Eager mode reads the first bad row back without stalling the GPU: the kernels are queued right behind the
    // copy and write nothing if there is one; the host waits for the copy (not the kernels) and throws.
    if (checks && pr.check_targets && !stream_is_capturing(stream)) {
      kp.abort_on_bad = 1;
      readback = &IndexReadback::start(pr.device.index, &scalars->first_bad, stream);
    }
    launch_rows(pr, kp, stream);
  }
  if (loss_out && pr.reduction != Reduction::kNone) {
    launch_kernel("launch of cross-entropy finalize", finalize_kernel, dim3(1), dim3(kReduceThreads), 0, stream,
                  partials, pr.n_rows, scalars, pr.loss, kp.abort_on_bad);
  }
  // The kernels queued since the read-back started write nothing on a bad target.
  if (readback)
    throw_if_bad_target(*readback, pr.n_rows, pr.target, pr.target_dtype, pr.target_rows, pr.total_vocab(),
                        pr.ignore_index);
}

void scale_rows_cuda(void* grad, DType dtype, const RowLayout& rows, int64_t n_rows, int64_t vocab, const float* scale,
                     bool per_row, Device device, StreamHandle stream) {
  DeviceGuard guard(device.index);
  launch_scale_rows(dtype, static_cast<char*>(grad), rows, n_rows, vocab, scale, per_row,
                    device_info(device.index).sm_count, static_cast<cudaStream_t>(stream));
}

}  // namespace logitless::ce
