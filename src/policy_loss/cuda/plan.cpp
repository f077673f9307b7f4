#include "policy_loss/cuda/plan.h"

#include <algorithm>

namespace logitless::pl {

namespace {
int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

bool wants_cluster(const RowsPlanInputs& in) {
  if (in.requested == PolicyLossAlgo::kStreaming || in.requested == PolicyLossAlgo::kRowResident) return false;
  if (in.requested == PolicyLossAlgo::kCluster) return true;
  // Auto: only the fused pass reads a row twice, and only long rows miss L2 on the second read.
  return in.fused && in.cluster_capable && in.vocab * in.elem_bytes >= kClusterMinRowBytes;
}
}  // namespace

int plan_threads(const RowsPlanInputs& in) {
  if (in.threads > 0) return in.threads;
  // Streaming: one CTA per row, 8 per SM, as the cross-entropy kernel. Cluster: few resident CTAs, so that the
  // slices in flight fit L2, each with enough threads to keep 32 KB of loads in flight per SM.
  return wants_cluster(in) ? 512 : 256;
}

// The row-resident plan, or algo == kAuto when the row does not fit a cluster's shared memory here.
RowsPlan plan_resident(const RowsPlanInputs& in) {
  RowsPlan none;
  none.algo = PolicyLossAlgo::kAuto;
  if (!in.resident_capable || in.smem_per_block <= 0) return none;
  const int64_t vocab = std::max<int64_t>(in.vocab, 1);
  const int64_t vec = 16 / in.elem_bytes;  // elements per 16-byte chunk
  // Slices are whole 16-byte chunks, so every CTA's slice has the alignment of the row's start.
  auto slice_of = [&](int c) { return round_up(ceil_div(vocab, c), vec); };
  // +16: the slice lands at the row's misalignment inside its stage (up to 15 bytes of lead-in).
  auto stage_of = [&](int64_t slice) { return round_up(slice * in.elem_bytes + 16, 128); };
  auto two_per_sm = [&](int64_t stage) {
    return in.smem_per_sm <= 0 || 2 * (stage + kResidentReserve) <= in.smem_per_sm;
  };
  int c = in.cluster_size;
  if (c <= 0) {
    // The smallest cluster whose one-stage slices let two CTAs share an SM: while one CTA waits for its copy or its
    // peers, the other computes (the cross-entropy kernel with one CTA of two stages per SM was latency-bound).
    for (c = 1; c <= kMaxCluster; ++c) {
      const int64_t stage = stage_of(slice_of(c));
      if (stage <= in.smem_per_block && two_per_sm(stage)) break;
    }
    if (c > kMaxCluster) return none;  // rows too long even for 16 CTAs
  }
  const int64_t slice = slice_of(c);
  const int64_t stage = stage_of(slice);
  if (stage > in.smem_per_block) return none;
  RowsPlan p;
  p.algo = PolicyLossAlgo::kRowResident;
  p.cluster = std::clamp(c, 1, kMaxCluster);
  p.slice = slice;
  p.threads = in.threads > 0 ? std::min(in.threads, kResidentMaxThreads) : kResidentMaxThreads;
  // As many stages as two CTAs per SM leave room for (one for the long rows the auto plan serves; short rows,
  // asked for explicitly, keep several rows in flight per CTA).
  const int64_t per_cta = in.smem_per_sm > 0
                              ? std::min<int64_t>(in.smem_per_sm / 2 - kResidentReserve, in.smem_per_block)
                              : in.smem_per_block;
  p.stages = static_cast<int>(std::clamp<int64_t>(per_cta / stage, 1, kResidentMaxStages));
  p.stage_bytes = stage;
  p.smem_bytes = stage * p.stages;
  return p;
}

RowsPlan plan_rows(const RowsPlanInputs& in) {
  RowsPlan p;
  p.threads = plan_threads(in);
  p.slice = in.vocab;
  if (in.requested == PolicyLossAlgo::kRowResident) {
    // Residency serves a row read twice; a pass that reads each row once streams (as the cross-entropy plan).
    if (!in.fused) return p;
    return plan_resident(in);
  }
  if (in.requested == PolicyLossAlgo::kAuto && in.fused && in.vocab * in.elem_bytes >= kClusterMinRowBytes) {
    const RowsPlan r = plan_resident(in);
    if (r.algo == PolicyLossAlgo::kRowResident) return r;
  }
  if (!wants_cluster(in)) return p;
  if (!in.cluster_capable) {
    p.algo = PolicyLossAlgo::kAuto;  // asked for a cluster where none can run
    return p;
  }
  const int64_t row_bytes = in.vocab * in.elem_bytes;
  int c = in.cluster_size;
  if (c <= 0) {
    // The smallest cluster whose slices in flight fit the L2 budget: larger clusters only add barrier latency.
    c = static_cast<int>(
        std::clamp<int64_t>(ceil_div(row_bytes * std::max(in.ctas_per_sm, 1), kSliceBudgetPerSm), 2, 8));
  }
  p.algo = PolicyLossAlgo::kCluster;
  p.cluster = std::clamp(c, 1, kMaxCluster);
  // Slices are whole 16-byte chunks, so every CTA's slice has the alignment of the row's start.
  const int64_t vec = 16 / in.elem_bytes;
  p.slice = std::max<int64_t>(round_up(ceil_div(std::max<int64_t>(in.vocab, 1), p.cluster), vec), vec);
  return p;
}

}  // namespace logitless::pl
