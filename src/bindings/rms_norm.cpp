#include "bindings/common.h"

namespace logitless::bindings {

// After the tensors, every function takes an RMSNormOptions. Tensor arguments accept None.
void bind_rms_norm(nb::module_& m) {
  using namespace nb::literals;
  using O = RMSNormOptions;
  OptionsClass<O>(m, "RMSNormOptions")
      .field("eps", &O::eps)
      .field("offset", &O::offset)
      .enum_field("casting", &O::casting)
      .enum_field("algo", &O::algo)
      .field("vectors_per_thread", &O::vectors_per_thread);

  m.def(
      "rms_norm_forward_workspace_bytes",
      [](nb::handle x, nb::handle weight, const RMSNormOptions& options) {
        return rms_norm_forward_workspace_bytes(to_view(x), to_view(weight), options);
      },
      "x"_a.none(), "weight"_a.none(), "options"_a);
  m.def(
      "rms_norm_backward_workspace_bytes",
      [](nb::handle x, nb::handle weight, const RMSNormOptions& options) {
        return rms_norm_backward_workspace_bytes(to_view(x), to_view(weight), options);
      },
      "x"_a.none(), "weight"_a.none(), "options"_a);
  m.def(
      "rms_norm_forward",
      [](nb::handle x, nb::handle residual, nb::handle weight, const RMSNormOptions& options, nb::handle y,
         nb::handle residual_out, nb::handle rstd, nb::handle workspace, uintptr_t stream) {
        const RMSNormOptions o = options;
        const TensorView xv = to_view(x), rv = to_view(residual), wv = to_view(weight), yv = to_view(y),
                         sv = to_view(residual_out), rs = to_view(rstd);
        const Workspace ws = to_workspace(workspace);
        nb::gil_scoped_release release;
        rms_norm_forward(xv, rv, wv, o, yv, sv, rs, ws, to_stream(stream));
      },
      "x"_a.none(), "residual"_a.none(), "weight"_a.none(), "options"_a, "y"_a.none(), "residual_out"_a.none(),
      "rstd"_a.none(), "workspace"_a.none(), "stream"_a);
  m.def(
      "rms_norm_backward",
      [](nb::handle grad_y, nb::handle grad_residual_out, nb::handle x, nb::handle weight, nb::handle rstd,
         const RMSNormOptions& options, nb::handle grad_x, nb::handle grad_weight, nb::handle workspace,
         uintptr_t stream) {
        const RMSNormOptions o = options;
        const TensorView gy = to_view(grad_y), gr = to_view(grad_residual_out), xv = to_view(x), wv = to_view(weight),
                         rs = to_view(rstd), gx = to_view(grad_x), gw = to_view(grad_weight);
        const Workspace ws = to_workspace(workspace);
        nb::gil_scoped_release release;
        rms_norm_backward(gy, gr, xv, wv, rs, o, gx, gw, ws, to_stream(stream));
      },
      "grad_y"_a.none(), "grad_residual_out"_a.none(), "x"_a.none(), "weight"_a.none(), "rstd"_a.none(), "options"_a,
      "grad_x"_a.none(), "grad_weight"_a.none(), "workspace"_a.none(), "stream"_a);
}

}  // namespace logitless::bindings
