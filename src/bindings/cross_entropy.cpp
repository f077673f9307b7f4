#include "bindings/common.h"

namespace logitless::bindings {

// Every tensor argument is declared .none(): nanobind rejects None for a plain handle otherwise, and None is
// how Python says "absent" (an optional tensor, or a required one missing, which C++ then reports by name).
void bind_cross_entropy(nb::module_& m) {
  using namespace nb::literals;
  OptionsClass<CrossEntropyOptions>(m, "CrossEntropyOptions")
      .field("ignore_index", &CrossEntropyOptions::ignore_index)
      .enum_field("reduction", &CrossEntropyOptions::reduction)
      .field("label_smoothing", &CrossEntropyOptions::label_smoothing)
      .field("z_loss", &CrossEntropyOptions::z_loss)
      .field("softcap", &CrossEntropyOptions::softcap)
      .field("check_targets", &CrossEntropyOptions::check_targets)
      .enum_field("algo", &CrossEntropyOptions::algo);

  m.def(
      "cross_entropy_workspace_bytes",
      [](nb::handle logits, nb::handle target, nb::handle weight, const CrossEntropyOptions& options) {
        return cross_entropy_workspace_bytes(to_view(logits), to_view(target), to_view(weight), options);
      },
      "logits"_a.none(), "target"_a.none(), "weight"_a.none(), "options"_a);
  m.def(
      "cross_entropy_forward",
      [](nb::handle logits, nb::handle target, nb::handle weight, const CrossEntropyOptions& options, nb::handle loss,
         nb::handle lse, nb::handle zl, nb::handle workspace, uintptr_t stream) {
        const CrossEntropyOptions o = options;
        const TensorView l = to_view(logits), t = to_view(target), w = to_view(weight), lo = to_view(loss),
                         ls = to_view(lse), z = to_view(zl);
        const Workspace ws = to_workspace(workspace);
        nb::gil_scoped_release release;
        cross_entropy_forward(l, t, w, o, lo, ls, z, ws, to_stream(stream));
      },
      "logits"_a.none(), "target"_a.none(), "weight"_a.none(), "options"_a, "loss"_a.none(), "lse"_a.none(),
      "z_loss_out"_a.none(), "workspace"_a.none(), "stream"_a);
  m.def(
      "cross_entropy_forward_backward",
      [](nb::handle logits, nb::handle target, nb::handle weight, const CrossEntropyOptions& options, nb::handle loss,
         nb::handle lse, nb::handle zl, nb::handle grad_logits, nb::handle grad_scale, nb::handle workspace,
         uintptr_t stream) {
        const CrossEntropyOptions o = options;
        const TensorView l = to_view(logits), t = to_view(target), w = to_view(weight), lo = to_view(loss),
                         ls = to_view(lse), z = to_view(zl), g = to_view(grad_logits), gs = to_view(grad_scale);
        const Workspace ws = to_workspace(workspace);
        nb::gil_scoped_release release;
        cross_entropy_forward_backward(l, t, w, o, lo, ls, z, g, gs, ws, to_stream(stream));
      },
      "logits"_a.none(), "target"_a.none(), "weight"_a.none(), "options"_a, "loss"_a.none(), "lse"_a.none(),
      "z_loss_out"_a.none(), "grad_logits"_a.none(), "grad_scale"_a.none(), "workspace"_a.none(), "stream"_a);
  m.def(
      "cross_entropy_backward",
      [](nb::handle logits, nb::handle target, nb::handle weight, nb::handle lse, nb::handle grad_loss,
         const CrossEntropyOptions& options, nb::handle grad_logits, nb::handle workspace, uintptr_t stream) {
        const CrossEntropyOptions o = options;
        const TensorView l = to_view(logits), t = to_view(target), w = to_view(weight), ls = to_view(lse),
                         gl = to_view(grad_loss), g = to_view(grad_logits);
        const Workspace ws = to_workspace(workspace);
        nb::gil_scoped_release release;
        cross_entropy_backward(l, t, w, ls, gl, o, g, ws, to_stream(stream));
      },
      "logits"_a.none(), "target"_a.none(), "weight"_a.none(), "lse"_a.none(), "grad_loss"_a.none(), "options"_a,
      "grad_logits"_a.none(), "workspace"_a.none(), "stream"_a);
  m.def(
      "scale_rows",
      [](nb::handle grad, nb::handle scale, uintptr_t stream) {
        const TensorView g = to_view(grad), s = to_view(scale);
        nb::gil_scoped_release release;
        scale_rows(g, s, to_stream(stream));
      },
      "grad"_a.none(), "scale"_a.none(), "stream"_a);
}

}  // namespace logitless::bindings
