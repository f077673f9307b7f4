#include "policy_loss/cuda/plan.h"

#include <algorithm>

namespace logitless::pl {

namespace {
int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

bool wants_cluster(const RowsPlanInputs& in) {
  if (in.requested == PolicyLossAlgo::kStreaming) return false;
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

RowsPlan plan_rows(const RowsPlanInputs& in) {
  RowsPlan p;
  p.threads = plan_threads(in);
  p.slice = in.vocab;
  if (!wants_cluster(in)) return p;
  if (!in.cluster_capable) {
    p.algo = PolicyLossAlgo::kAuto;  // asked for a cluster where none can run
    return p;
  }
  const int64_t row_bytes = in.vocab * in.elem_bytes;
  int c = in.cluster_size;
  if (c <= 0) {
    // The smallest cluster whose slices in flight fit the L2 budget: larger clusters only add barrier latency.
    c = static_cast<int>(std::clamp<int64_t>(ceil_div(row_bytes * std::max(in.ctas_per_sm, 1), kSliceBudgetPerSm),
                                             2, 8));
  }
  p.algo = PolicyLossAlgo::kCluster;
  p.cluster = std::clamp(c, 1, kMaxCluster);
  // Slices are whole 16-byte chunks, so every CTA's slice has the alignment of the row's start.
  const int64_t vec = 16 / in.elem_bytes;
  p.slice = std::max<int64_t>(round_up(ceil_div(std::max<int64_t>(in.vocab, 1), p.cluster), vec), vec);
  return p;
}

}  // namespace logitless::pl
