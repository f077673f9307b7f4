#include "bindings/common.h"

namespace logitless::bindings {

namespace {
RMSNormOptions make_options(double eps, double offset, int casting, int algo, int vectors_per_thread) {
  RMSNormOptions o;
  o.eps = eps;
  o.offset = offset;
  o.casting = static_cast<RMSNormCasting>(casting);
  o.algo = static_cast<RMSNormAlgo>(algo);
  o.vectors_per_thread = vectors_per_thread;
  return o;
}
}  // namespace

// After the tensors, every function takes the RMSNormOptions fields in this order: eps, offset, casting,
// algo, vectors_per_thread (casting and algo as the C++ enum values). Tensor arguments accept None.
void bind_rms_norm(nb::module_& m) {
  using namespace nb::literals;
  m.def(
      "rms_norm_forward_workspace_bytes",
      [](nb::handle x, nb::handle weight, double eps, double offset, int casting, int algo, int vpt) {
        return rms_norm_forward_workspace_bytes(to_view(x), to_view(weight),
                                                make_options(eps, offset, casting, algo, vpt));
      },
      "x"_a.none(), "weight"_a.none(), "eps"_a, "offset"_a, "casting"_a, "algo"_a, "vectors_per_thread"_a);
  m.def(
      "rms_norm_backward_workspace_bytes",
      [](nb::handle x, nb::handle weight, double eps, double offset, int casting, int algo, int vpt) {
        return rms_norm_backward_workspace_bytes(to_view(x), to_view(weight),
                                                 make_options(eps, offset, casting, algo, vpt));
      },
      "x"_a.none(), "weight"_a.none(), "eps"_a, "offset"_a, "casting"_a, "algo"_a, "vectors_per_thread"_a);
  m.def(
      "rms_norm_forward",
      [](nb::handle x, nb::handle residual, nb::handle weight, double eps, double offset, int casting, int algo,
         int vpt, nb::handle y, nb::handle residual_out, nb::handle rstd, nb::handle workspace, uintptr_t stream) {
        const auto o = make_options(eps, offset, casting, algo, vpt);
        const TensorView xv = to_view(x), rv = to_view(residual), wv = to_view(weight), yv = to_view(y),
                         sv = to_view(residual_out), rs = to_view(rstd);
        const Workspace ws = to_workspace(workspace);
        nb::gil_scoped_release release;
        rms_norm_forward(xv, rv, wv, o, yv, sv, rs, ws, to_stream(stream));
      },
      "x"_a.none(), "residual"_a.none(), "weight"_a.none(), "eps"_a, "offset"_a, "casting"_a, "algo"_a,
      "vectors_per_thread"_a, "y"_a.none(), "residual_out"_a.none(), "rstd"_a.none(), "workspace"_a.none(),
      "stream"_a);
  m.def(
      "rms_norm_backward",
      [](nb::handle grad_y, nb::handle grad_residual_out, nb::handle x, nb::handle weight, nb::handle rstd,
         double eps, double offset, int casting, int algo, int vpt, nb::handle grad_x, nb::handle grad_weight,
         nb::handle workspace, uintptr_t stream) {
        const auto o = make_options(eps, offset, casting, algo, vpt);
        const TensorView gy = to_view(grad_y), gr = to_view(grad_residual_out), xv = to_view(x),
                         wv = to_view(weight), rs = to_view(rstd), gx = to_view(grad_x), gw = to_view(grad_weight);
        const Workspace ws = to_workspace(workspace);
        nb::gil_scoped_release release;
        rms_norm_backward(gy, gr, xv, wv, rs, o, gx, gw, ws, to_stream(stream));
      },
      "grad_y"_a.none(), "grad_residual_out"_a.none(), "x"_a.none(), "weight"_a.none(), "rstd"_a.none(), "eps"_a,
      "offset"_a, "casting"_a, "algo"_a, "vectors_per_thread"_a, "grad_x"_a.none(), "grad_weight"_a.none(),
      "workspace"_a.none(), "stream"_a);
}

}  // namespace logitless::bindings
