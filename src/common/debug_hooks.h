// The library's test and benchmark switches, in one registry. Each hook is a named integer with a default, read by
// the code it steers at the start of a call and set by tests (by enum) or by benchmark harnesses (by name). The
// library never reads the environment: a harness that takes a switch from its command line or environment sets
// the hook itself. Hooks of other types (a function that rewrites a plan, the record of the last launch) are
// Slots declared by the family they steer. Not public API.
#pragma once

#include <cstdint>
#include <mutex>

namespace logitless::debug {

enum class Hook : int {
  // Linear cross-entropy: the fused Hopper kernels where they apply (1, the default) or the generic cuBLAS path.
  kLceFusedKernels,
  // Linear cross-entropy: the gradient in forward's exponential form (linear_cross_entropy/cuda/params.h,
  // ExpGradParams) where it applies (1, the default), or the generic gradient in forward (tests, benchmarks).
  kLceExpForm,
  // Linear cross-entropy: every valid row through the exponential form's rewrite, a path real inputs seldom reach.
  kLceExpFixupAll,
  // Linear heads: the Hopper accumulating grad_weight product (linear_head/cuda/accumulate_gemm.h) where it applies
  // (1, the default), at every group length it takes (2: benchmarks), with the accumulator's tail on the head's
  // tiling (3: benchmarks), or cuBLAS for every product (0: tests, benchmarks).
  kHeadAccumulateGemm,
  // Linear cross-entropy: the fused exponentials (with or without row statistics) and the bare mainloop on the
  // ping-pong schedule (1: linear_cross_entropy/cuda/hopper/kernel_pingpong.cuh) or the cooperative one (0, the
  // default: hopper/kernel.cuh).
  kLceFusedPingPong,
  // Linear cross-entropy: the float32 grad_weight accumulator's last rows in grad_weight's own storage where it
  // can hold them, and the exponentials in their place where that makes fewer token groups (1, the default:
  // linear_cross_entropy/cuda/plan.h, Plan::dw_tail_rows and dlogits_in_grad_weight), the tail alone (2) or all of
  // the accumulator in the workspace (0) (benchmarks).
  kLceDwTail,
  // Linear cross-entropy: the fused exponentials of an interior tile taken on the row's shift with no maximum first
  // (1, the default: linear_cross_entropy/cuda/hopper/epilogue_exp.cuh, EpilogueExp::tile_on_shift), or after the
  // tile's
  // maximum everywhere (0: tests, benchmarks).
  kLceExpOnShift,
  // Linear cross-entropy: the last token group's grad_weight products write a 16-bit grad_weight where the plan
  // allows (1, the default: linear_cross_entropy/cuda/plan.h, Plan::dw_written_rows), or the float32 sums are cast
  // into it after them (0: tests, benchmarks).
  kLceDwWritten,
  kCount
};

int64_t hook(Hook h);
void set_hook(Hook h, int64_t value);
// The hook of that name ("lce_fused_kernels", "lce_exp_form", "lce_exp_fixup_all", "head_accumulate_gemm",
// "lce_fused_pingpong", "lce_dw_tail", "lce_exp_on_shift", "lce_dw_written") set; false if none has it.
bool set_hook(const char* name, int64_t value);

// A typed hook or observer shared by every thread: a plan rewrite a test or benchmark sets and a launcher reads,
// or what a launcher ran, which the test reads back. A family declares each as an inline variable of its debug
// namespace, so that the library and its tests see one instance.
template <class T>
class Slot {
 public:
  T get() const {
    std::lock_guard<std::mutex> lock(mu_);
    return value_;
  }
  void set(const T& value) {
    std::lock_guard<std::mutex> lock(mu_);
    value_ = value;
  }

 private:
  mutable std::mutex mu_;
  T value_{};
};

}  // namespace logitless::debug
