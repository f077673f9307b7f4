#include "bindings/common.h"

namespace logitless::bindings {

// After the tensors, a RopeOptions. Tensor arguments accept None.
void bind_rope(nb::module_& m) {
  using namespace nb::literals;
  OptionsClass<RopeOptions>(m, "RopeOptions")
      .field("inverse", &RopeOptions::inverse)
      .enum_field("algo", &RopeOptions::algo);

  m.def(
      "rope_apply",
      [](nb::handle q, nb::handle k, nb::handle cos, nb::handle sin, nb::handle position_ids,
         const RopeOptions& options, nb::handle q_out, nb::handle k_out, uintptr_t stream) {
        const RopeOptions o = options;
        const TensorView qv = to_view(q), kv = to_view(k), cv = to_view(cos), sv = to_view(sin),
                         pv = to_view(position_ids), qo = to_view(q_out), ko = to_view(k_out);
        nb::gil_scoped_release release;
        rope_apply(qv, kv, cv, sv, pv, o, qo, ko, to_stream(stream));
      },
      "q"_a.none(), "k"_a.none(), "cos"_a.none(), "sin"_a.none(), "position_ids"_a.none(), "options"_a,
      "q_out"_a.none(), "k_out"_a.none(), "stream"_a);
}

}  // namespace logitless::bindings
