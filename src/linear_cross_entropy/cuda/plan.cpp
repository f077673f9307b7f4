#include "linear_cross_entropy/cuda/plan.h"

#include <algorithm>

namespace logitless::lce {
namespace {

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

using head::fit_rows;

// Rows per token group: the fewest groups of at most `fit` rows, evenly cut (a short last group would cost a whole
// pass of the float32 grad_weight accumulator for little math), in whole 128-row tiles of the fused GEMM where
// that still fits.
int64_t even_groups(int64_t n, int64_t fit) {
  fit = std::max<int64_t>(fit, 1);
  if (fit >= n) return n;
  const int64_t rows = ceil_div(n, ceil_div(n, fit)), tiled = round_up(rows, 128);
  return tiled <= fit ? tiled : rows;
}

// The exponential form's per-group regions (declare_exp) for groups of `rows` tokens, in bytes.
size_t exp_bytes(const PlanInputs& in, Plan p, int64_t rows) {
  p.group_rows = rows;
  head::WorkspaceLayout L;
  FusedBuffers f;
  declare_exp(in, p, L, &f);
  return L.bytes();
}

// A group's bytes in grad_weight's storage when its exponentials lie there (Plan::dlogits_in_grad_weight): the
// exponentials, then the other regions.
size_t grad_weight_group_bytes(const PlanInputs& in, const Plan& p, int64_t rows) {
  return static_cast<size_t>(round_up(rows * p.ld_logits * in.elem_bytes, 256)) + exp_bytes(in, p, rows);
}

// The most rows (at most n) whose `bytes_of(rows)` fit in `bytes`; 0 if not even one's do. The byte counts grow
// with the rows, so a bisection finds it (a plan that needs it holds several 512-row groups' worth of logits: a few
// microseconds beside milliseconds of GEMMs).
template <typename BytesOf>
int64_t rows_within(size_t bytes, int64_t n, BytesOf bytes_of) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    if (bytes_of(mid) <= bytes)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// The accumulator's tail (head::accumulator_tail_rows) that one call's float32 sums would keep in a 16-bit,
// contiguous grad_weight, leaving `behind` bytes of its storage after it: its rows and bytes, whole 256-byte blocks.
// The steps keep none (their sums outlive a call, and the caller's grad_weight may change between them).
int64_t tail_rows(const PlanInputs& in, size_t behind = 0) {
  if (dw_accumulator_bytes(in) == 0 || in.steps || !in.dw_tail || in.grad_weight_scratch <= behind) return 0;
  return head::accumulator_tail_rows(in.v, in.h, (in.grad_weight_scratch - behind) / 256 * 256);
}
size_t tail_bytes(const PlanInputs& in, int64_t rows) { return static_cast<size_t>(round_up(rows * in.h * 4, 256)); }

// Whether the last group's grad_weight products may write grad_weight (Plan::dw_written_rows): not for the steps,
// whose sums go on over later calls.
bool writes_grad_weight(const PlanInputs& in) { return in.dw_written && !in.steps; }

// The accumulator's tail in grad_weight's storage and the rows the last group's products write: every row where that
// storage holds nothing but the tail's sums. Not where it holds the group's exponentials or regions too, which the
// last products and grad_hidden's read. (A tail shortened to end with them before its own rows would let those
// products write it, but at 16384 x 2048 x 128256 its other rows made cuBLAS choose a slower kernel for every
// accumulating pass; bench/RESULTS.md, fourteenth session.)
void plan_accumulator_rows(const PlanInputs& in, Plan& p) {
  p.dw_tail_rows = tail_rows(in, p.dlogits_in_grad_weight ? grad_weight_group_bytes(in, p, p.group_rows) : 0);
  p.dw_written_rows = writes_grad_weight(in) && !p.exp_in_grad_weight ? in.v - p.dw_tail_rows : 0;
}

}  // namespace

int64_t shard_chunk_tokens(int64_t n, int64_t widest_shard, int64_t chunk_tokens, size_t memory_budget) {
  const int64_t max_rows = std::max<int64_t>(n, 1);
  if (chunk_tokens > 0) return std::min(chunk_tokens, max_rows);
  // 512 tokens at V_r = 64128 with 512 MiB: as many GEMM tiles per logits GEMM as one device's 256-token chunks
  // at V = 128256, and a chunk's exchange (2048 floats a rank) is hidden behind the next chunk's GEMM.
  return std::min(fit_rows(std::max<size_t>(memory_budget, 1) / 4, 4 * round_up(widest_shard, 8)), max_rows);
}

Plan plan_linear_cross_entropy(const PlanInputs& in) {
  Plan p;
  p.pass = in.pass;
  const int64_t N = in.n, H = in.h, V = in.v, es = in.elem_bytes;
  const size_t budget = std::max<size_t>(in.memory_budget, 1);
  const bool grads = in.pass != Pass::kForward;
  p.dlogits_in_place = grads && es == 4;
  // The fused kernels serve the forward, the recompute backward and, in its exponential form (bfloat16, plain
  // options), the gradient in forward; none of them a bias gradient. The gradient in forward's earlier fused
  // form (statistics from the GEMM, float32 logits still kept for the gradient kernel) was slower than the
  // generic path (bench/RESULTS.md, "the gradient in forward on the fused GEMM"): the exponential form keeps no
  // float32 logits at all.
  const bool fused_pass = (in.pass == Pass::kForward && !in.row_stats) || (in.pass == Pass::kBackward && !in.need_db) ||
                          (in.pass == Pass::kForwardBackward && in.fused_exp && !in.need_db);
  if (in.fused && es == 2 && !in.steps && fused_pass) p.kernel = Kernel::kHopperFused;
  const bool fused = p.kernel == Kernel::kHopperFused;
  // The fused forward's statistics: 16 bytes per token and 256-column tile (the row statistics' partials alike).
  const int64_t tiles = ceil_div(V, kFusedTileCols);
  const int64_t stats_row = fused && in.pass != Pass::kBackward ? 4 * kStatsFloats * tiles : 0;
  // The exponential form's other per-token bytes: shift, scale, the target term, a rewrite slot and (for grad_weight)
  // the sort's keys and rows in and out, and one region that serves,
  // one after the other, the tile statistics (read by finish_rows), hidden scaled by row (written by exp_rows,
  // read by the grad_weight GEMM) and the unscaled float32 grad_hidden row (written by the grad_hidden GEMM,
  // which runs after the grad_weight one).
  const bool exp_form = fused && in.pass == Pass::kForwardBackward;
  const int64_t xs_row = in.need_dw ? es * H : 0, dx_row = in.need_dx && !in.grad_hidden_f32 ? 4 * H : 0;
  const int64_t exp_stats_row = 4 * kExpStatsFloats * tiles;
  const int64_t exp_shared_row = exp_form ? std::max({exp_stats_row, xs_row, dx_row}) : 0;
  // A float32 grad_hidden's rows of the group take that region where it fits in them: the grad_hidden GEMM, the
  // last of the group's kernels, writes them only after the region's last reader. The workspace then holds less, and
  // the budget longer groups where it holds more than 2048 tokens (below that they grow within twice the budget).
  p.shared_in_grad_hidden =
      exp_form && in.need_dx && in.grad_hidden_f32 && in.grad_hidden_rows_scratch && exp_shared_row <= 4 * H;
  const int64_t exp_row = exp_form ? 16 + (in.need_dw ? 16 : 0) + (p.shared_in_grad_hidden ? 0 : exp_shared_row) +
                                         (in.row_stats ? stats_row : 0)
                                   : 0;
  p.stats_row = stats_row;
  p.exp_shared_row = exp_shared_row;
  p.sort_bytes = exp_form && in.need_dw ? in.target_sort_bytes : 0;

  if (in.steps) {
    // Chunks of exactly chunk_tokens (every rank's exchange pairs them up). float32 inputs form the gradient in
    // place in the chunk's slot and run the GEMMs per chunk; 16-bit ones narrow it into a group buffer of whole
    // chunks that takes the rest of the budget (or every token, when that costs no more than the float32
    // grad_weight accumulator it saves), as the one-device plan does.
    p.ld_logits = round_up(V, 8);
    p.ld_dlogits = p.ld_logits;
    const int64_t logits_row = 4 * p.ld_logits, grad_row = es * p.ld_logits;
    const int64_t max_rows = std::max<int64_t>(N, 1);
    p.chunk_rows = std::max<int64_t>(1, std::min(in.chunk_tokens, max_rows));
    p.group_rows = p.chunk_rows;
    const size_t slots = static_cast<size_t>(2 * p.chunk_rows * logits_row);
    if (!p.dlogits_in_place) {
      const int64_t all = ceil_div(max_rows, p.chunk_rows) * p.chunk_rows;
      // A float32 grad_weight (autocast over float32 master weights) takes every group's sums itself: the groups
      // grow as on one device, the slots sharing twice the budget.
      const int64_t fit = head::group_fit(budget, slots, grad_row, in.need_dw && in.grad_weight_f32);
      const int64_t fitted = fit / p.chunk_rows * p.chunk_rows;
      p.group_rows = std::min(std::max(fitted, p.chunk_rows), all);
      const size_t acc = dw_accumulator_bytes(in);
      if (p.group_rows < N && acc > 0 && slots + static_cast<size_t>(all * grad_row) <= budget + acc)
        p.group_rows = all;
    }
    p.dw_accumulator = dw_accumulator_bytes(in) > 0 && p.group_rows < N;
    if (in.need_db) p.db_partial_rows = ceil_div(p.chunk_rows, kGradRowsPerBlock);
  } else if (in.pass != Pass::kBackward) {
    // Token chunks of whole rows: the statistics of a row need all of its V logits.
    p.ld_logits = round_up(V, 8);  // 32-byte float32 rows; 16-byte rows of a 16-bit gradient alike
    // The fused forward keeps no logits, only their tile statistics.
    const int64_t logits_row = fused ? stats_row : 4 * p.ld_logits;
    if (fused && grads) {
      // Groups of whole rows, each one GEMM of exponentials (16-bit, the buffer the grad_hidden / grad_weight
      // GEMMs read) and statistics, with no float32 logits: the budget holds the group, or every token when that
      // costs no more than the float32 grad_weight accumulator it saves (as below). With the accumulator, where the
      // group's other per-token regions fit grad_weight's own storage (it holds nothing but the accumulator's tail
      // until the sums are written into it at the end), the budget holds the exponentials alone, and the regions lie
      // there or beside the budget (below).
      const int64_t e_row = es * p.ld_logits, row = e_row + exp_row;
      const int64_t max_rows = std::max<int64_t>(N, 1);
      const size_t acc = dw_accumulator_bytes(in), taken = tail_bytes(in, tail_rows(in));
      const size_t room = in.grad_weight_scratch > taken ? in.grad_weight_scratch - taken : 0;
      const auto rows_in = [](size_t bytes, int64_t per_row) { return static_cast<int64_t>(bytes / per_row); };
      if (in.chunk_tokens > 0) {
        p.group_rows = std::min(in.chunk_tokens, max_rows);
      } else if (acc > 0 && static_cast<size_t>(N * row) <= budget + acc) {
        p.group_rows = max_rows;
      } else {
        // The regions within the budget: it holds whole rows. Where grad_weight's storage could hold them: the budget
        // holds the exponentials of as many rows as the storage holds the regions of.
        int64_t fit = rows_in(budget, row);
        const size_t twice = head::twice_budget(budget);
        // A float32 grad_weight summing over the groups: their exponentials may take up to twice the budget (the
        // other regions beside it) to make passes over it that are not bound by memory (head::group_min_rows).
        if (in.need_dw && in.grad_weight_f32) fit = head::group_min_rows(fit, rows_in(twice, e_row));
        const auto regions = [&](int64_t r) { return exp_bytes(in, p, r); };
        if (acc > 0 && room > 0)
          fit = std::max(fit, std::min(rows_in(budget, e_row), rows_within(room, max_rows, regions)));
        // Or the exponentials there too, in the tail's place: each byte of theirs there moves a byte of sums back
        // into the workspace, which then holds no exponentials. The workspace may so grow by one budget over the
        // plan above (the budget's exponentials beside the longest tail): the group takes up to the storage the
        // longest tail leaves and twice the budget. Taken where that makes fewer groups, so fewer and longer
        // accumulator passes (bench/RESULTS.md: at 256000 classes, 4 groups of 2048 against 8 of 1024). Never one
        // group, whose grad_weight product would write that storage while it reads them.
        const size_t gw_room = std::min(in.grad_weight_scratch, twice > SIZE_MAX - room ? SIZE_MAX : twice + room);
        const int64_t gw_fit =
            taken > 0 && in.dlogits_in_grad_weight
                ? rows_within(gw_room, max_rows - 1, [&](int64_t r) { return grad_weight_group_bytes(in, p, r); })
                : 0;
        p.dlogits_in_grad_weight =
            gw_fit > 0 && ceil_div(max_rows, gw_fit) < ceil_div(max_rows, std::max<int64_t>(fit, 1));
        p.group_rows = even_groups(max_rows, p.dlogits_in_grad_weight ? gw_fit : fit);
      }
      p.chunk_rows = p.group_rows;
      // Where the budget holds the exponentials alone, the regions go to grad_weight's storage only with the
      // exponentials there, or where the last group's products would not write grad_weight anyway (Plan::
      // dw_written_rows); otherwise the workspace holds them beside the budget: their bytes (a few percent of the
      // budget) instead of grad_weight's cast after the products (bench/RESULTS.md, fourteenth session).
      p.exp_in_grad_weight =
          acc > 0 && p.group_rows < N &&
          (p.dlogits_in_grad_weight || (exp_bytes(in, p, p.group_rows) <= room && !writes_grad_weight(in)));
    } else {
      head::ChunkInputs c;
      c.n = N;
      c.chunk_tokens = in.chunk_tokens;
      c.memory_budget = budget;
      // 16-bit inputs: the float32 logits are narrowed into a group buffer of the GEMMs' dtype.
      c.group_row_bytes = grads && !p.dlogits_in_place ? es * p.ld_logits : 0;
      c.dw_accumulator_bytes = dw_accumulator_bytes(in);
      c.float32_grad_weight = grads && in.need_dw && in.grad_weight_f32;
      const head::ChunkPlan cp = head::plan_token_chunks(c, logits_row);
      p.chunk_rows = cp.chunk_rows;
      p.group_rows = cp.group_rows;
    }
    p.ld_dlogits = p.ld_logits;  // in place (float32) or a 16-bit buffer of the same row length
    p.dw_accumulator = grads && dw_accumulator_bytes(in) > 0 && p.group_rows < N;
    if (p.dw_accumulator) plan_accumulator_rows(in, p);
    if (grads && in.need_db) p.db_partial_rows = ceil_div(p.chunk_rows, kGradRowsPerBlock);
  } else {
    // Vocabulary chunks over every token: each chunk of grad_weight rows is complete when written (no
    // grad_weight accumulator); grad_hidden sums over the chunks.
    const int64_t tokens = std::max<int64_t>(N, 1);
    // The fused backward writes the gradient from the GEMM's accumulators: no float32 logits.
    const int64_t per_col = (fused ? 0 : 4 * tokens) + (p.dlogits_in_place ? 0 : es * tokens);
    if (in.chunk_vocab > 0) {
      p.vocab_cols = std::min(in.chunk_vocab, V);
    } else {
      p.vocab_cols = std::min(fit_rows(budget, per_col), V);
      // Whole 256-column tiles of the fused GEMM per chunk.
      if (fused && p.vocab_cols >= kFusedTileCols) p.vocab_cols = p.vocab_cols / kFusedTileCols * kFusedTileCols;
      const size_t acc = in.need_dx && !in.grad_hidden_f32 ? static_cast<size_t>(4 * N * H) : 0;
      if (p.vocab_cols < V && acc > 0 && static_cast<size_t>(per_col * round_up(V, 8)) <= budget + acc)
        p.vocab_cols = V;
    }
    p.vocab_cols = std::max<int64_t>(p.vocab_cols, 1);
    p.ld_logits = round_up(p.vocab_cols, 8);
    p.ld_dlogits = p.ld_logits;
    p.dx_accumulator = in.need_dx && !in.grad_hidden_f32 && p.vocab_cols < V;
    if (in.need_db) p.db_partial_rows = ceil_div(tokens, kGradRowsPerBlock);
  }

  if (in.steps && !fused) p.slot_bytes = round_up(static_cast<int64_t>(p.chunk_rows * p.ld_logits * 4), 256);
  Buffers b;
  head::WorkspaceLayout L;
  declare_workspace(in, p, L, &b);
  p.bytes = L.bytes();
  return p;
}

void declare_workspace(const PlanInputs& in, const Plan& p, head::WorkspaceLayout& L, Buffers* b,
                       head::WorkspaceLayout* grad_weight_scratch) {
  const auto N = static_cast<size_t>(std::max<int64_t>(in.n, 0)), H = static_cast<size_t>(in.h);
  const auto V = static_cast<size_t>(in.v), es = static_cast<size_t>(in.elem_bytes);
  const bool grads = in.pass != Pass::kForward, fused = p.kernel == Kernel::kHopperFused;
  const bool backward = in.pass == Pass::kBackward, exp_form = fused && in.pass == Pass::kForwardBackward;
  LossBuffers& l = b->loss;
  L.add(&l.scalars, 256);
  L.add(&l.targets, N * 8);
  if (!backward && !in.reduction_none) {
    L.add(&l.row_loss, N * 4);
    if (in.z_rows) L.add(&l.row_z, N * 4);
  }
  if (in.pass == Pass::kForwardBackward) L.add(&l.lse, N * 4);
  if (N == 0) return;

  // The engine's stage: backward over vocabulary chunks of every token, otherwise token chunks and groups.
  const auto ld = static_cast<size_t>(p.ld_logits), ldd = static_cast<size_t>(p.ld_dlogits);
  const size_t rows = backward ? N : static_cast<size_t>(p.chunk_rows);
  const size_t grad_rows = backward ? N : static_cast<size_t>(p.group_rows);
  head::HeadBytes h;
  h.cublas = in.cublas_workspace_bytes;
  h.hidden = in.copy_hidden ? N * H * es : 0;
  h.logits = fused ? 0 : in.steps ? 2 * p.slot_bytes : rows * ld * 4;
  h.dlogits = grads && !p.dlogits_in_place && !p.dlogits_in_grad_weight ? grad_rows * ldd * es : 0;
  h.dw_acc = p.dw_accumulator ? (V - static_cast<size_t>(p.dw_tail_rows)) * H * 4 : 0;
  h.dx_acc = p.dx_accumulator ? N * H * 4 : 0;
  h.db = grads && !backward && in.need_db ? V * 4 : 0;
  h.db_partial = grads && in.need_db ? static_cast<size_t>(p.db_partial_rows) * ld * 4 : 0;
  b->head.declare(L, h);

  if (grad_weight_scratch && p.dw_tail_rows > 0) grad_weight_scratch->add(&b->dw_tail, tail_bytes(in, p.dw_tail_rows));
  if (grad_weight_scratch && p.dlogits_in_grad_weight) grad_weight_scratch->add(&b->head.dlogits, grad_rows * ldd * es);
  FusedBuffers& f = b->fused;
  if (fused && !grads) L.add(&f.partials, rows * static_cast<size_t>(p.stats_row));
  if (!exp_form) return;
  if (!p.exp_in_grad_weight) return declare_exp(in, p, L, &f);
  if (grad_weight_scratch) declare_exp(in, p, *grad_weight_scratch, &f);
}

void declare_exp(const PlanInputs& in, const Plan& p, head::WorkspaceLayout& L, FusedBuffers* f) {
  const auto G = static_cast<size_t>(p.group_rows);
  L.add(&f->shift, G * 4);
  L.add(&f->row_scale, G * 4);
  L.add(&f->target_coef, G * 4);
  L.add(&f->fixups, (G + 1) * 4);
  if (in.row_stats) L.add(&f->row_partials, G * static_cast<size_t>(p.stats_row));
  if (in.need_dw) {
    for (int k = 0; k < 2; ++k) L.add(&f->class_keys[k], G * 4), L.add(&f->class_rows[k], G * 4);
    L.add(&f->sort_temp, p.sort_bytes);
  }
  if (p.shared_in_grad_hidden) return;
  const size_t shared = L.add(&f->partials, G * static_cast<size_t>(p.exp_shared_row));
  if (in.need_dw) L.alias(&f->scaled_hidden, shared);
  if (in.need_dx && !in.grad_hidden_f32) L.alias(&f->dx_rows, shared);
}

// Both schedules do the same three GEMMs' work and differ in what they add to it (N·V logits, V·H weight):
//  * recompute: a second logits GEMM (2 N H V FLOPs) and a second float32 logits round trip (4 N V bytes more:
//    18 against 14 per logit), plus its float32 grad_hidden accumulator, read and written by every vocabulary
//    chunk's GEMM after the first (8 N H bytes each);
//  * gradient in forward: its float32 grad_weight accumulator, read and written by every token group's GEMM
//    (counted at 10 V H bytes a group, below; 5 where a 16-bit grad_weight sums in itself: dw_weight_dtype), and
//    each chunk's re-read of the weight where a chunk is too short for its logits GEMM to be compute-bound
//    (2 V H (1 - chunk / kFlopsPerByte) bytes a chunk).
// The model orders the two schedules as they were measured on H100, with the generic kernels and with the fused
// ones, at the three shapes of bench/RESULTS.md's "which schedule "auto" takes for bf16".
bool recompute_is_faster(const PlanInputs& gif) {
  if (gif.pass != Pass::kForwardBackward || gif.steps || gif.elem_bytes != 2 || gif.n <= 0) return false;
  const Plan fb = plan_linear_cross_entropy(gif);
  PlanInputs bw_in = gif;
  bw_in.pass = Pass::kBackward;
  const Plan bw = plan_linear_cross_entropy(bw_in);
  const double N = static_cast<double>(gif.n), H = static_cast<double>(gif.h), V = static_cast<double>(gif.v);
  // An accumulating grad_weight GEMM reads and writes its float32 output in its epilogue, which in cuBLAS does not
  // overlap its math: it takes longer than its 8 V H bytes at copy bandwidth (bench/RESULTS.md), so 10 bytes per
  // element here, and in proportion 5 for a 16-bit output (4 bytes moved). The Hopper kernel of
  // linear_head/cuda/accumulate_gemm.h hides part of it; the model keeps the cuBLAS figure, as measured.
  const bool sums_16bit = gif.need_dw && gif.dw_weight_dtype && !gif.grad_weight_f32 && fb.group_rows < gif.n;
  const double dw_bytes = fb.dw_accumulator ? 10.0 : sums_16bit ? 5.0 : 0.0;
  double gif_cost = static_cast<double>(ceil_div(gif.n, fb.group_rows)) * dw_bytes * V * H;
  const double chunk = static_cast<double>(fb.chunk_rows);
  if (chunk < kFlopsPerByte)
    gif_cost += static_cast<double>(ceil_div(gif.n, fb.chunk_rows)) * 2.0 * V * H * (1.0 - chunk / kFlopsPerByte);
  // The generic recompute's extra float32 logits round trip; the fused schedules keep no float32 logits (both
  // write one 16-bit matrix for the grad_hidden / grad_weight GEMMs), so they differ by the fourth GEMM only.
  const bool fused = fb.kernel == Kernel::kHopperFused;
  double rec_cost = 2.0 * N * H * V / kFlopsPerByte + (fused ? 0.0 : 4.0 * N * V);
  if (bw.dx_accumulator) rec_cost += static_cast<double>(ceil_div(gif.v, bw.vocab_cols) - 1) * 8.0 * N * H;
  return rec_cost < gif_cost;
}

}  // namespace logitless::lce
