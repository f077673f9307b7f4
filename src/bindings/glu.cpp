#include "bindings/common.h"

namespace logitless::bindings {

// After the tensors, every function takes a GLUOptions. Tensor arguments accept None (the C++ side names a
// missing one).
void bind_glu(nb::module_& m) {
  using namespace nb::literals;
  OptionsClass<GLUOptions>(m, "GLUOptions")
      .enum_field("activation", &GLUOptions::activation)
      .enum_field("algo", &GLUOptions::algo);

  m.def(
      "glu_forward",
      [](nb::handle gate, nb::handle up, const GLUOptions& options, nb::handle y, uintptr_t stream) {
        const GLUOptions o = options;
        const TensorView gv = to_view(gate), uv = to_view(up), yv = to_view(y);
        nb::gil_scoped_release release;
        glu_forward(gv, uv, o, yv, to_stream(stream));
      },
      "gate"_a.none(), "up"_a.none(), "options"_a, "y"_a.none(), "stream"_a);
  m.def(
      "glu_backward",
      [](nb::handle grad_y, nb::handle gate, nb::handle up, const GLUOptions& options, nb::handle grad_gate,
         nb::handle grad_up, uintptr_t stream) {
        const GLUOptions o = options;
        const TensorView dy = to_view(grad_y), gv = to_view(gate), uv = to_view(up), dg = to_view(grad_gate),
                         du = to_view(grad_up);
        nb::gil_scoped_release release;
        glu_backward(dy, gv, uv, o, dg, du, to_stream(stream));
      },
      "grad_y"_a.none(), "gate"_a.none(), "up"_a.none(), "options"_a, "grad_gate"_a.none(), "grad_up"_a.none(),
      "stream"_a);
}

}  // namespace logitless::bindings
