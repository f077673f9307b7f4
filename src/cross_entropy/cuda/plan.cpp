#include "cross_entropy/cuda/plan.h"

namespace logitless::ce {

namespace {
int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
}  // namespace

Plan plan_cross_entropy(const PlanInputs& in) {
  Plan streaming;
  streaming.algo = CrossEntropyAlgo::kStreaming;
  // Residency pays only when the row is read twice (statistics, then gradient). A loss-only forward or a
  // backward from a saved lse reads it once; auto streams those on every GPU (all SMs, no cluster barrier).
  if (in.requested == CrossEntropyAlgo::kStreaming || in.backward_only) return streaming;
  if (in.requested == CrossEntropyAlgo::kAuto && in.forward_only) return streaming;

  const bool want_resident = in.requested == CrossEntropyAlgo::kRowResident;
  if (!in.row_resident_capable || in.vocab <= 0) {
    if (want_resident) {
      Plan none;
      none.algo = CrossEntropyAlgo::kAuto;
      return none;
    }
    return streaming;
  }
  const int64_t vec = 16 / in.elem_bytes;  // elements per 16-byte chunk
  auto slice_of = [&](int c) { return round_up(ceil_div(in.vocab, c), vec); };
  // +16: the slice lands at the row's misalignment inside the stage (at most 15 bytes of lead-in).
  auto stage_of = [&](int64_t slice) { return round_up(slice * in.elem_bytes + 16, 128); };
  // First choice for long rows: the smallest cluster whose slices let two stages share an SM, as one CTA of two
  // stages where the row is split (a cluster of 2 or more), as two CTAs of one stage otherwise. With the partials
  // exchanged through st.async and an mbarrier, the two-stage clusters beat two one-stage CTAs per SM on H100
  // wherever the row is split, and lose where one CTA holds a row (bench/RESULTS.md, commits b29e50a, bc253ae).
  // While the exchange was a cluster barrier, whose release fenced every warp's outstanding stores, two one-stage
  // CTAs were ahead even at 16384 x 128256.
  if (in.smem_per_sm > 0) {
    for (int c = 1; c <= kMaxCluster; ++c) {
      const int64_t stage = stage_of(slice_of(c));
      if (stage < kMinSharedStage) break;  // short rows: several stages per CTA serve them (below)
      if (2 * (stage + kPerCtaReserve) > in.smem_per_sm || stage > in.smem_per_block) continue;
      Plan p;
      p.algo = CrossEntropyAlgo::kRowResident;
      p.cluster = c;
      p.slice = slice_of(c);
      p.stage_bytes = static_cast<size_t>(stage);
      p.stages = c >= 2 && 2 * stage <= in.smem_per_block ? 2 : 1;
      p.smem_bytes = p.stage_bytes * p.stages;
      p.threads = kMaxThreads;
      return p;
    }
  }
  // Otherwise the smallest cluster whose slices fit two stages: on H100 every larger cluster was slower, since the
  // per-row cluster overhead grows with the cluster (bench/RESULTS.md).
  for (int c = 1; c <= kMaxCluster; ++c) {
    // Slices are whole 16-byte chunks so that every CTA's slice has the same alignment as the row start.
    const int64_t slice = slice_of(c);
    const int64_t stage = stage_of(slice);
    const int64_t stages = stage > 0 ? in.smem_per_block / stage : 0;
    // Two stages at least: the next row's load must overlap this row's math.
    if (stages < 2) continue;
    // A cluster wider than needed only adds barrier latency; a single CTA per row must also leave room for
    // the slice to be read while the next one lands, which 2+ stages guarantee.
    Plan p;
    p.algo = CrossEntropyAlgo::kRowResident;
    p.cluster = c;
    p.slice = slice;
    p.stage_bytes = static_cast<size_t>(stage);
    p.stages = static_cast<int>(stages < kMaxStages ? stages : kMaxStages);
    p.smem_bytes = p.stage_bytes * p.stages;
    // Enough warps to keep shared-memory reads and the exp unit busy on long slices; small slices use small
    // CTAs so that several share an SM.
    const int64_t chunks = ceil_div(slice * in.elem_bytes, 16);
    p.threads = chunks >= 512 ? kMaxThreads : 128;
    return p;
  }
  if (want_resident) {
    Plan none;
    none.algo = CrossEntropyAlgo::kAuto;
    return none;
  }
  return streaming;  // rows too long for a cluster's shared memory
}

}  // namespace logitless::ce
