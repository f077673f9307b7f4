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
bool public_vpt(int vpt) {
  for (int v : kVectorsPerThread)
    if (v == vpt) return true;
  return false;
}
// Threads for a row that needs `want` of them: groups of up to 32 are powers of two (they reduce with xor
// shuffles inside a warp), longer rows are whole warps.
int row_threads(int64_t want) { return static_cast<int>(want <= 32 ? next_pow2(want) : round_up(want, 32)); }

// The register plan for one kernel variant, or why it cannot run these rows.
const char* register_plan(const PlanInputs& in, const KernelVariant& k, int cta_threads, bool persistent, Plan* out) {
  const int vpt = k.vpt;
  const int64_t per_vec = 16 / in.elem_bytes;
  if (!in.vector_ok || in.hidden % per_vec != 0)
    return "rows are not all 16-byte aligned, or H is not a multiple of 16 bytes";
  const int64_t want = ceil_div(in.hidden / per_vec, vpt);
  const int max_threads = max_cta_threads(in.backward, vpt, k.prefetch, in.residual, k.smem_dw);
  if (want > max_threads) return "H is too large to keep a row in registers at this vectors_per_thread";
  Plan p;
  p.algo = RMSNormAlgo::kRegisters;
  p.vpt = vpt;
  p.prefetch = k.prefetch;
  p.dw_in_smem = k.smem_dw;
  p.threads_per_row = row_threads(want);
  // Whole rows only: a row of more threads than the target is one row a CTA.
  p.rows_per_cta = std::max(1, std::min(cta_threads, max_threads) / p.threads_per_row);
  if (p.threads_per_row > 32) p.rows_per_cta = std::min(p.rows_per_cta, kMaxNamedBarrierRows);
  // The backward is persistent by construction (0: as many CTAs as fit); a prefetching forward only has a
  // next row to fetch in a persistent grid.
  p.ctas_per_sm = !in.backward && (persistent || k.prefetch) ? kPersistentCtasPerSm : 0;
  p.smem_bytes = plan_smem_bytes(p, in);
  if (p.smem_bytes > static_cast<size_t>(in.smem_per_block) && p.dw_in_smem) {
    p.rows_per_cta = 1;  // one row's dW sums may still fit
    p.smem_bytes = plan_smem_bytes(p, in);
  }
  if (p.smem_bytes > static_cast<size_t>(in.smem_per_block)) return "the row's dW sums do not fit in shared memory";
  *out = p;
  return nullptr;
}
}  // namespace

DefaultVariant default_variant(bool backward, bool residual, int64_t row_bytes) {
  // The fastest variant of each kind and row size in a sweep on H100 (16384 rows, bf16, against a device-to-device
  // copy; bench/RESULTS.md, "RMSNorm kernels at the new forward default" and "RMSNorm with dW sums in shared memory
  // for long rows"). Rows over 8 KB take the kernels that sum dW in shared memory and read the weight from L1: a
  // thread then holds only its rows, and two CTAs fit on an SM where one did; at 4 KB rows those kernels lose, and
  // 8 KB rows keep the register plan, not having been swept.
  if (!backward) {
    if (residual) return {4, false, 256, false};
    // 8 vectors, 128-thread CTAs, one row group a CTA beat 4 vectors with prefetch in a persistent grid at every
    // row size once the kernels without a residual stopped being built with its registers. Only rows of whole
    // warps at 8 vectors (multiples of 4 KB) take it: others (H = 5120 bf16, short rows) keep the 4-vector plan,
    // whose thread counts fit them.
    if (row_bytes % (8 * 16 * 32) == 0) return {8, false, 128, false};
    return {4, true, row_bytes > 4096 && row_bytes <= 8192 ? 256 : 128, true};
  }
  if (residual) {
    if (row_bytes <= 4096) return {2, true, 256, false};
    if (row_bytes <= 8192) return {2, true, 512, false};
    return {4, true, 256, false, true};
  }
  if (row_bytes <= 8192) return {2, true, 128, false};
  return {8, false, 256, false, true};
}

bool instantiated(bool backward, int vpt, bool prefetch, bool smem_dw) {
  if (backward) {
    for (const KernelVariant& k : kBackwardVariants)
      if (k.vpt == vpt && k.prefetch == prefetch && k.smem_dw == smem_dw) return true;
  } else {
    for (const KernelVariant& k : kForwardVariants)
      if (k.vpt == vpt && k.prefetch == prefetch && k.smem_dw == smem_dw) return true;
  }
  return false;
}

size_t plan_smem_bytes(const Plan& p, const PlanInputs& in) {
  const size_t row = static_cast<size_t>(in.hidden) * sizeof(float);
  if (!in.backward) return 0;
  if (p.algo == RMSNormAlgo::kRegisters)
    return p.dw_in_smem ? static_cast<size_t>(p.rows_per_cta) * row : p.rows_per_cta > 1 ? row : 0;
  return p.dw_in_smem ? static_cast<size_t>(p.rows_per_cta) * row : 0;
}

Plan plan_rms_norm(const PlanInputs& in) {
  const int64_t H = in.hidden;
  if (in.requested != RMSNormAlgo::kGeneric) {
    const bool must = in.requested == RMSNormAlgo::kRegisters;
    const char* why = nullptr;
    if (in.vpt != 0 && !public_vpt(in.vpt)) {
      why = "vectors_per_thread is not one the register kernels are built for (4 or 8)";
    } else {
      // The default variant for these rows first, then the same width prefetching and holding one row, then
      // (auto only) wider ones, which reach the longest rows; all with the default's dW placement first, then
      // with dW in registers. A forced width keeps the default's prefetch and CTA size where its kernel exists.
      const DefaultVariant d = default_variant(in.backward, in.residual, in.hidden * in.elem_bytes);
      const int vpt = in.vpt ? in.vpt : d.vpt;
      for (const bool sm : {d.smem_dw, false}) {
        const KernelVariant tries[] = {{vpt, d.prefetch, sm}, {vpt, true, sm},      {vpt, false, sm},
                                       {2 * vpt, false, sm},  {4 * vpt, false, sm}, {8 * vpt, false, sm}};
        for (const KernelVariant& k : tries) {
          if (k.vpt != vpt && in.vpt != 0) break;
          if (!instantiated(in.backward, k.vpt, k.prefetch, k.smem_dw)) continue;
          Plan p;
          why = register_plan(in, k, d.cta_threads, d.persistent && k.prefetch == d.prefetch, &p);
          if (!why) return p;
        }
        if (!d.smem_dw) break;
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
    p.smem_bytes = plan_smem_bytes(p, in);
  }
  return p;
}

const char* plan_error(const Plan& p, const PlanInputs& in) {
  const int tpr = p.threads_per_row, rows = p.rows_per_cta;
  if (tpr < 1 || rows < 1) return "threads_per_row and rows_per_cta must be >= 1";
  if (tpr <= 32 ? (tpr & (tpr - 1)) != 0 : tpr % 32 != 0)
    return "threads_per_row must be a power of two up to 32, else a multiple of 32";
  if (p.threads() % 32 != 0) return "a CTA must be whole warps";
  if (tpr > 32 && rows > kMaxNamedBarrierRows) return "rows of several warps: at most 15 rows a CTA";
  if (p.ctas_per_sm < 0) return "ctas_per_sm must be >= 0";
  if (p.smem_bytes != plan_smem_bytes(p, in)) return "smem_bytes does not match the plan";
  if (p.smem_bytes > static_cast<size_t>(in.smem_per_block)) return "more shared memory than a CTA may have";
  if (p.algo == RMSNormAlgo::kGeneric) {
    if (p.threads() > kGenericCtaThreads) return "a generic CTA has at most 256 threads";
    if (!in.backward && p.ctas_per_sm != 0) return "the generic forward runs one CTA per row group";
    return nullptr;
  }
  if (p.algo != RMSNormAlgo::kRegisters) return "no kernel for this algo";
  if (p.dw_in_smem && !in.backward) return "dW sums in shared memory are a backward plan";
  if (!instantiated(in.backward, p.vpt, p.prefetch, p.dw_in_smem))
    return "no register kernel of this width, prefetch and dW placement";
  const int64_t per_vec = 16 / in.elem_bytes;
  if (!in.vector_ok || in.hidden % per_vec != 0) return "rows are not all 16-byte aligned";
  if (static_cast<int64_t>(tpr) * p.vpt * per_vec < in.hidden) return "the row's threads do not cover H";
  if (p.threads() > max_cta_threads(in.backward, p.vpt, p.prefetch, in.residual, p.dw_in_smem))
    return "more threads than the kernel's bound";
  return nullptr;
}

PersistentGrid persistent_grid(const Plan& plan, int64_t n_rows, int sm_count, int ctas_per_sm) {
  PersistentGrid g;
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
