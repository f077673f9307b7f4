#include "linear_head/cuda/engine.h"

#include "common/cuda/check.cuh"
#include "common/cuda/cublas.h"
#include "common/debug_hooks.h"
#include "linear_head/cuda/accumulate_gemm.h"
#include "linear_head/cuda/kernels.h"
#include "linear_head/cuda/plan.h"

namespace logitless::head {

const void* Engine::x_rows(int64_t r0) const {
  return static_cast<const char*>(io_.x) + r0 * io_.ldx * static_cast<int64_t>(dtype_size(io_.dtype));
}

const void* Engine::w_rows(int64_t v0) const { return io_.w.rows_from(v0).data; }

void Engine::logits(float* z, int64_t ld, int64_t r0, int64_t rows, int64_t v0, int64_t width) const {
  if (io_.bias) launch_fill_bias(z, ld, rows, width, io_.bias, io_.bias_dtype, io_.bias_stride, v0, sm_count_, stream_);
  gemm_row_major(blas_, false, true, rows, width, io_.h, x_rows(r0), io_.ldx, w_rows(v0), io_.w.ld, io_.dtype, z, ld,
                 DType::kFloat32, /*accumulate=*/io_.bias != nullptr);
}

void Engine::grad_hidden_gemm(const void* dz, int64_t ld_dz, int64_t rows, int64_t v0, int64_t cols, const Matrix& dx,
                              bool accumulate) const {
  gemm_row_major(blas_, false, false, rows, io_.h, cols, dz, ld_dz, w_rows(v0), io_.w.ld, io_.dtype, dx.data, dx.ld,
                 dx.dtype, accumulate);
}

void Engine::grad_weight_gemm(const void* dz, int64_t ld_dz, int64_t rows, int64_t cols, const void* x, int64_t ldx,
                              const Matrix& dw, bool accumulate, bool tail, const Matrix& out) const {
  // A token group after the first: see accumulate_gemm.h. The Hopper kernel writes a bfloat16 out itself; any other
  // out, or a product it declines, is cast from the float32 sums after it.
  const int64_t kernel = debug::hook(debug::Hook::kHeadAccumulateGemm);
  bool done = false, wrote_out = false;
  if (accumulate && dw.dtype == DType::kFloat32 && kernel) {
    AccumulateGemm g{io_.dtype, cols, io_.h, rows, dz, ld_dz, x, ldx, static_cast<float*>(dw.data), dw.ld};
    g.any_k = tail || kernel == 2;
    g.tail = tail;
    if (out.data && out.dtype == DType::kBFloat16) {
      g.out = out.data;
      g.ldo = out.ld;
    }
    done = launch_accumulate_gemm(g, io_.device, sm_count_, stream_);
    wrote_out = done && g.out;
  }
  if (!done)
    gemm_row_major(blas_, true, false, cols, io_.h, rows, dz, ld_dz, x, ldx, io_.dtype, dw.data, dw.ld, dw.dtype,
                   accumulate);
  if (out.data && !wrote_out)
    launch_cast(static_cast<float*>(dw.data), dw.ld, cols, io_.h, out.data, out.dtype, out.ld, 1, sm_count_, stream_);
}

void Engine::grad_weight_sums(const void* dz, int64_t ld_dz, int64_t rows, const void* x, int64_t ldx,
                              const DwAccumulator& acc, bool accumulate, int64_t written) const {
  if (!acc) return grad_weight_gemm(dz, ld_dz, rows, io_.v, x, ldx, io_.grad_weight, accumulate);
  const int64_t split = acc.head_rows(io_.v), es = static_cast<int64_t>(dtype_size(io_.dtype));
  // Rows [v0, v0 + cols) of grad_weight, their sums at `sums`.
  const auto part = [&](int64_t v0, int64_t cols, float* sums, bool tail, bool write) {
    if (cols <= 0) return;
    const Matrix out = write ? io_.grad_weight.rows_from(v0) : Matrix{};
    grad_weight_gemm(static_cast<const char*>(dz) + v0 * es, ld_dz, rows, cols, x, ldx,
                     Matrix{sums, DType::kFloat32, io_.h}, accumulate, tail, out);
  };
  // The tail's rows on the Hopper kernel at every group length: for a third of the vocabulary cuBLAS picks a
  // kernel slower per row than its whole-vocabulary one (bench/RESULTS.md, "the accumulator's tail"). Its product
  // first: the head's written rows lie over its float32 sums.
  if (acc.tail) part(split, io_.v - split, acc.tail, /*tail=*/true, written > 0);
  part(0, written, acc.head, false, true);
  part(written, split - written, acc.head + written * io_.h, false, false);
}

void Engine::group_gemms(const void* dz, int64_t ld_dz, int64_t g0, int64_t rows, const DwAccumulator& acc) const {
  if (io_.grad_hidden.data) {
    const Matrix dx = io_.grad_hidden.rows_from(g0);
    if (io_.v == 0) {  // an empty vocabulary shard contributes nothing (a GEMM over k = 0 would leave dx unwritten)
      launch_cast(nullptr, 0, rows, io_.h, dx.data, dx.dtype, dx.ld, 1, sm_count_, stream_);
    } else {
      grad_hidden_gemm(dz, ld_dz, rows, 0, io_.v, dx, false);
    }
  }
  if (io_.grad_weight.data)
    grad_weight_sums(dz, ld_dz, rows, x_rows(g0), io_.ldx, acc, /*accumulate=*/g0 > 0,
                     acc.rows_written_by(g0, rows, io_.n, io_.v));
}

void Engine::bias_sums(const float* db_partial, int64_t rows, int64_t ld, float* db) const {
  launch_column_sums(db_partial, (rows + kGradRowsPerBlock - 1) / kGradRowsPerBlock, ld, io_.v, db, nullptr,
                     DType::kFloat32, 1, stream_);
}

void Engine::finish(const DwAccumulator& acc, const float* db) const {
  const Matrix& gw = io_.grad_weight;
  const int64_t split = acc.head_rows(io_.v), written = std::min(acc.written, split);
  if (acc.tail && written == 0) {
    const Matrix rows = gw.rows_from(split);
    launch_cast(acc.tail, io_.h, io_.v - split, io_.h, rows.data, rows.dtype, rows.ld, 1, sm_count_, stream_);
  }
  if (acc && split > written) {
    const Matrix rows = gw.rows_from(written);
    launch_cast(acc.head + written * io_.h, io_.h, split - written, io_.h, rows.data, rows.dtype, rows.ld, 1, sm_count_,
                stream_);
  }
  if (db)
    launch_cast(db, io_.v, 1, io_.v, io_.grad_bias, io_.grad_bias_dtype, 0, io_.grad_bias_stride, sm_count_, stream_);
}

void Engine::zero_grads(int64_t dx_rows) const {
  const Matrix &gx = io_.grad_hidden, &gw = io_.grad_weight;
  if (gx.data) launch_cast(nullptr, 0, dx_rows, io_.h, gx.data, gx.dtype, gx.ld, 1, sm_count_, stream_);
  if (gw.data) launch_cast(nullptr, 0, io_.v, io_.h, gw.data, gw.dtype, gw.ld, 1, sm_count_, stream_);
  if (io_.grad_bias)
    launch_cast(nullptr, 0, 1, io_.v, io_.grad_bias, io_.grad_bias_dtype, 0, io_.grad_bias_stride, sm_count_, stream_);
}

void Engine::clear(float* buffer, int64_t floats) const {
  LOGITLESS_CUDA_CHECK(cudaMemsetAsync(buffer, 0, static_cast<size_t>(floats) * 4, stream_));
}

}  // namespace logitless::head
