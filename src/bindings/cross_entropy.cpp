#include "bindings/common.h"

namespace logitless::bindings {

namespace {
CrossEntropyOptions make_options(int64_t ignore_index, int reduction, double label_smoothing, double z_loss,
                                 double softcap, bool check_targets, int algo) {
  CrossEntropyOptions o;
  o.ignore_index = ignore_index;
  o.reduction = static_cast<Reduction>(reduction);
  o.label_smoothing = label_smoothing;
  o.z_loss = z_loss;
  o.softcap = softcap;
  o.check_targets = check_targets;
  o.algo = static_cast<CrossEntropyAlgo>(algo);
  return o;
}
}  // namespace

// Every tensor argument is declared .none(): nanobind rejects None for a plain handle otherwise, and None is
// how Python says "absent" (an optional tensor, or a required one missing, which C++ then reports by name).
void bind_cross_entropy(nb::module_& m) {
  using namespace nb::literals;
  m.def(
      "cross_entropy_workspace_bytes",
      [](nb::handle logits, nb::handle target, nb::handle weight, int64_t ignore_index, int reduction,
         double label_smoothing, double z_loss, double softcap, bool check_targets, int algo) {
        return cross_entropy_workspace_bytes(
            to_view(logits), to_view(target), to_view(weight),
            make_options(ignore_index, reduction, label_smoothing, z_loss, softcap, check_targets, algo));
      },
      "logits"_a.none(), "target"_a.none(), "weight"_a.none(), "ignore_index"_a, "reduction"_a,
      "label_smoothing"_a, "z_loss"_a, "softcap"_a, "check_targets"_a, "algo"_a);
  m.def(
      "cross_entropy_forward",
      [](nb::handle logits, nb::handle target, nb::handle weight, int64_t ignore_index, int reduction,
         double label_smoothing, double z_loss, double softcap, bool check_targets, int algo, nb::handle loss,
         nb::handle lse, nb::handle zl, nb::handle workspace, uintptr_t stream) {
        const auto o = make_options(ignore_index, reduction, label_smoothing, z_loss, softcap, check_targets, algo);
        const TensorView l = to_view(logits), t = to_view(target), w = to_view(weight), lo = to_view(loss),
                         ls = to_view(lse), z = to_view(zl);
        const Workspace ws = to_workspace(workspace);
        nb::gil_scoped_release release;
        cross_entropy_forward(l, t, w, o, lo, ls, z, ws, to_stream(stream));
      },
      "logits"_a.none(), "target"_a.none(), "weight"_a.none(), "ignore_index"_a, "reduction"_a,
      "label_smoothing"_a, "z_loss"_a, "softcap"_a, "check_targets"_a, "algo"_a, "loss"_a.none(), "lse"_a.none(),
      "z_loss_out"_a.none(), "workspace"_a.none(), "stream"_a);
  m.def(
      "cross_entropy_forward_backward",
      [](nb::handle logits, nb::handle target, nb::handle weight, int64_t ignore_index, int reduction,
         double label_smoothing, double z_loss, double softcap, bool check_targets, int algo, nb::handle loss,
         nb::handle lse, nb::handle zl, nb::handle grad_logits, nb::handle grad_scale, nb::handle workspace,
         uintptr_t stream) {
        const auto o = make_options(ignore_index, reduction, label_smoothing, z_loss, softcap, check_targets, algo);
        const TensorView l = to_view(logits), t = to_view(target), w = to_view(weight), lo = to_view(loss),
                         ls = to_view(lse), z = to_view(zl), g = to_view(grad_logits), gs = to_view(grad_scale);
        const Workspace ws = to_workspace(workspace);
        nb::gil_scoped_release release;
        cross_entropy_forward_backward(l, t, w, o, lo, ls, z, g, gs, ws, to_stream(stream));
      },
      "logits"_a.none(), "target"_a.none(), "weight"_a.none(), "ignore_index"_a, "reduction"_a,
      "label_smoothing"_a, "z_loss"_a, "softcap"_a, "check_targets"_a, "algo"_a, "loss"_a.none(), "lse"_a.none(),
      "z_loss_out"_a.none(), "grad_logits"_a.none(), "grad_scale"_a.none(), "workspace"_a.none(), "stream"_a);
  m.def(
      "cross_entropy_backward",
      [](nb::handle logits, nb::handle target, nb::handle weight, nb::handle lse, nb::handle grad_loss,
         int64_t ignore_index, int reduction, double label_smoothing, double z_loss, double softcap,
         bool check_targets, int algo, nb::handle grad_logits, nb::handle workspace, uintptr_t stream) {
        const auto o = make_options(ignore_index, reduction, label_smoothing, z_loss, softcap, check_targets, algo);
        const TensorView l = to_view(logits), t = to_view(target), w = to_view(weight), ls = to_view(lse),
                         gl = to_view(grad_loss), g = to_view(grad_logits);
        const Workspace ws = to_workspace(workspace);
        nb::gil_scoped_release release;
        cross_entropy_backward(l, t, w, ls, gl, o, g, ws, to_stream(stream));
      },
      "logits"_a.none(), "target"_a.none(), "weight"_a.none(), "lse"_a.none(), "grad_loss"_a.none(),
      "ignore_index"_a, "reduction"_a, "label_smoothing"_a, "z_loss"_a, "softcap"_a, "check_targets"_a, "algo"_a,
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
