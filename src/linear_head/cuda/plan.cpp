#include "linear_head/cuda/plan.h"

#include <algorithm>

namespace logitless::head {
namespace {

// Tokens of a float32 logits chunk when the gradient of every token is held (no grad_weight accumulator): the
// logits GEMM of 1024 tokens does 1024 FLOP per byte of the weight it reads, past the H100's balance point.
constexpr int64_t kGrownChunkRows = 1024;

int64_t fit_in_steps(size_t bytes, int64_t per_item, int64_t step) {
  const int64_t n = static_cast<int64_t>(bytes / static_cast<size_t>(std::max<int64_t>(per_item, 1)));
  return n >= step ? n / step * step : std::max<int64_t>(n, 1);
}

}  // namespace

int64_t fit_rows(size_t bytes, int64_t per_item) { return fit_in_steps(bytes, per_item, 128); }

int64_t group_fit(size_t budget, size_t used, int64_t row, bool float32_sums) {
  const int64_t fit = fit_rows(budget > used ? budget - used : 0, row);
  if (!float32_sums) return fit;
  const size_t twice = twice_budget(budget);
  return group_min_rows(fit, fit_rows(twice > used ? twice - used : 0, row));
}

ChunkPlan plan_token_chunks(const ChunkInputs& in, int64_t chunk_row_bytes) {
  const int64_t N = in.n, max_rows = std::max<int64_t>(N, 1);
  const size_t budget = std::max<size_t>(in.memory_budget, 1);
  ChunkPlan p;
  if (in.group_row_bytes == 0) {  // one buffer per chunk: the group is the chunk
    p.chunk_rows = std::min(in.chunk_tokens > 0 ? in.chunk_tokens : fit_rows(budget, chunk_row_bytes), max_rows);
    p.group_rows = p.chunk_rows;
    return p;
  }
  // The GEMM writes float32 logits (the loss needs them exact) and the loss's gradient kernel narrows them into a
  // separate 16-bit buffer that the grad_hidden / grad_weight GEMMs read. Only the 16-bit gradient has to be held
  // for a whole group. The split of the budget weighs two costs: each chunk's logits GEMM re-reads the weight
  // (2 V H bytes a chunk), each group past the first reads and writes the float32 grad_weight accumulator (8 V H
  // bytes a group). Their sum over the tokens is least with 1 / (1 + sqrt 2) of the budget for the float32 chunk;
  // 2/5 of it, in 64-token steps, where 128-token steps would give away up to a third of its share at V=256000
  // (384-token chunks and 1280-token groups at V=128256 with 512 MiB, 192 and 640 at V=256000).
  const int64_t grad_row = in.group_row_bytes;
  const int64_t chunk_fit = fit_in_steps(budget / 5 * 2, chunk_row_bytes, 64);
  if (in.chunk_tokens > 0) {
    p.group_rows = std::min(in.chunk_tokens, max_rows);
    p.chunk_rows = std::min(p.group_rows, chunk_fit);
    return p;
  }
  p.chunk_rows = std::min(chunk_fit, max_rows);
  const size_t used = static_cast<size_t>(p.chunk_rows * chunk_row_bytes);
  p.group_rows = std::min(std::max(group_fit(budget, used, grad_row, in.float32_grad_weight), p.chunk_rows), max_rows);
  // Several groups with a 16-bit grad_weight need a float32 accumulator of 4 V H bytes. When holding every token's
  // gradient takes no more than the budget plus that accumulator, do that instead: one grad_weight GEMM over all
  // tokens, no accumulation traffic, and no more memory.
  const size_t acc = in.dw_accumulator_bytes;
  if (p.group_rows < N && acc > 0 &&
      static_cast<size_t>(p.chunk_rows * chunk_row_bytes + N * grad_row) <= budget + acc) {
    p.group_rows = N;
    // The float32 chunk may then grow into the rest of that allowance, up to kGrownChunkRows tokens: each chunk's
    // logits GEMM re-reads the whole weight, which at 256 tokens is as much time as its math.
    const size_t room = budget + acc - static_cast<size_t>(N * grad_row);
    p.chunk_rows =
        std::min(max_rows, std::max(p.chunk_rows, std::min(kGrownChunkRows, fit_rows(room, chunk_row_bytes))));
  }
  return p;
}

int64_t accumulator_tail_rows(int64_t v, int64_t h, size_t bytes) {
  if (v <= 0 || h <= 0) return 0;
  // t tail rows: their float32 copy [256, 256 + 4 t h) must end by the 16-bit row v - t at byte 2 (v - t) h, and
  // the rows before the tail start at a 128-row tile.
  const int64_t row32 = 4 * h, by_order = (2 * v * h - 256) / (6 * h);
  const int64_t by_room = static_cast<int64_t>(bytes / static_cast<size_t>(row32));
  const int64_t most = std::max<int64_t>(0, std::min(by_order, by_room));
  const int64_t split = (v - most + 127) / 128 * 128;
  return split >= v ? 0 : v - split;
}

}  // namespace logitless::head
