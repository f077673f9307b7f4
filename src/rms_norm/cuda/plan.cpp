#include "rms_norm/cuda/plan.h"

#include <algorithm>

namespace logitless::rms {

namespace {
int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t round_up(int64_t x, int64_t m) { return ceil_div(x, m) * m; }
int64_t next_pow2(int64_t x) {
  int64_t p = 1;
  while (p < x) p <<= 1;
  return p;
}
bool instantiated(int vpt) {
  for (int v : kVectorsPerThread)
    if (v == vpt) return true;
  return false;
}
// Threads for a row that needs `want` of them: groups of up to 32 are powers of two (they reduce with xor
// shuffles inside a warp), longer rows are whole warps.
int row_threads(int64_t want) { return static_cast<int>(want <= 32 ? next_pow2(want) : round_up(want, 32)); }
}  // namespace

Plan plan_rms_norm(const PlanInputs& in) {
  const int64_t H = in.hidden;
  if (in.requested != RMSNormAlgo::kGeneric) {
    const bool must = in.requested == RMSNormAlgo::kRegisters;
    const int vpt = in.vpt ? in.vpt : kDefaultVectorsPerThread;
    const int64_t per_vec = 16 / in.elem_bytes;
    const char* why = nullptr;
    if (!instantiated(vpt)) {
      why = "vectors_per_thread is not one the register kernels are built for (4 or 8)";
    } else if (!in.vector_ok || H % per_vec != 0) {
      why = "rows are not all 16-byte aligned, or H is not a multiple of 16 bytes";
    } else {
      const int64_t want = ceil_div(H / per_vec, vpt);
      const int max_threads = max_cta_threads(in.backward, vpt);
      if (want > max_threads) {
        why = "H is too large to keep a row in registers at this vectors_per_thread";
      } else {
        Plan p;
        p.algo = RMSNormAlgo::kRegisters;
        p.vpt = vpt;
        p.threads_per_row = row_threads(want);
        const int target = in.backward ? std::min(kBackwardCtaThreads, max_threads) : kForwardCtaThreads;
        p.rows_per_cta = std::max(1, target / p.threads_per_row);
        if (p.threads_per_row > 32) p.rows_per_cta = std::min(p.rows_per_cta, kMaxNamedBarrierRows);
        // Backward CTAs of several rows add their rows' dW sums in one shared row of H floats (at most
        // 8192 floats here, since a CTA of several rows has at most 256 threads per row: under the 48 KB
        // that needs no opt-in). A single-row CTA writes its registers straight to the workspace.
        if (in.backward && p.rows_per_cta > 1) p.smem_bytes = static_cast<size_t>(H) * sizeof(float);
        return p;
      }
    }
    if (must) {
      Plan none;
      none.algo = RMSNormAlgo::kAuto;
      none.why_not = why;
      return none;
    }
  }
  Plan p;
  p.algo = RMSNormAlgo::kGeneric;
  p.threads_per_row =
      row_threads(std::min<int64_t>(kGenericCtaThreads, std::max<int64_t>(1, ceil_div(H, kGenericElemsPerThread))));
  p.rows_per_cta = std::max(1, kGenericCtaThreads / p.threads_per_row);
  if (p.threads_per_row > 32) p.rows_per_cta = std::min(p.rows_per_cta, kMaxNamedBarrierRows);
  if (in.backward) {
    // Each row slot of the CTA sums its dW in shared memory. Several slots per CTA only happen for
    // H <= 2048 (tpr = ceil(H / 8) < 256), i.e. at most 8 KB; a single slot fits up to the opt-in limit
    // (H = 58K floats on an H100). Longer rows sum in their own workspace row (read-modify-write, in L2).
    const size_t bytes = static_cast<size_t>(p.rows_per_cta) * static_cast<size_t>(H) * sizeof(float);
    p.dw_in_smem = bytes <= static_cast<size_t>(in.smem_per_block);
    if (p.dw_in_smem) p.smem_bytes = bytes;
  }
  return p;
}

BackwardGrid backward_grid(const Plan& plan, int64_t n_rows, int sm_count, int ctas_per_sm) {
  BackwardGrid g;
  if (n_rows <= 0) return g;
  const int64_t slots = plan.rows_per_cta;
  const int64_t resident = static_cast<int64_t>(std::max(sm_count, 1)) * std::max(ctas_per_sm, 1);
  int64_t ctas = std::min(resident, ceil_div(n_rows, slots));
  const int64_t iters = ceil_div(n_rows, ctas * slots);
  ctas = ceil_div(n_rows, iters * slots);
  g.ctas = ctas;
  const bool per_slot = plan.algo == RMSNormAlgo::kGeneric && !plan.dw_in_smem;
  g.partial_rows = per_slot ? ctas * slots : ctas;
  return g;
}

}  // namespace logitless::rms
