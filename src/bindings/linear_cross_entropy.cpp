#include "bindings/common.h"

namespace logitless::bindings {

// The options tuple: see common.h.
LinearCrossEntropyOptions lce_options(nb::handle options) {
  const auto t = nb::cast<nb::tuple>(options);
  if (t.size() != 9) throw Error(Error::Kind::kInvalidArgument, "linear_cross_entropy options: expected a 9-tuple");
  LinearCrossEntropyOptions o;
  o.ignore_index = nb::cast<int64_t>(t[0]);
  o.reduction = static_cast<Reduction>(nb::cast<int>(t[1]));
  o.label_smoothing = nb::cast<double>(t[2]);
  o.z_loss = nb::cast<double>(t[3]);
  o.softcap = nb::cast<double>(t[4]);
  o.check_targets = nb::cast<bool>(t[5]);
  o.chunk_tokens = nb::cast<int64_t>(t[6]);
  o.chunk_vocab = nb::cast<int64_t>(t[7]);
  o.memory_budget = nb::cast<size_t>(t[8]);
  return o;
}

// After the input tensors, every function takes the options tuple (see lce_options). Tensor arguments accept None.
void bind_linear_cross_entropy(nb::module_& m) {
  using namespace nb::literals;
  m.def(
      "linear_cross_entropy_recompute_is_faster",
      [](int64_t n, int64_t h, int64_t v, int32_t dtype, int32_t device_type, int32_t device_index, bool need_dx,
         bool need_dw, bool need_db, nb::handle options) {
        return linear_cross_entropy_recompute_is_faster(n, h, v, static_cast<DType>(dtype),
                                                        Device{static_cast<DeviceType>(device_type), device_index},
                                                        need_dx, need_dw, need_db, lce_options(options));
      },
      "n"_a, "h"_a, "v"_a, "dtype"_a, "device_type"_a, "device_index"_a, "need_grad_hidden"_a, "need_grad_weight"_a,
      "need_grad_bias"_a, "options"_a);
  m.def(
      "linear_cross_entropy_forward_workspace_bytes",
      [](nb::handle hidden, nb::handle weight, nb::handle target, nb::handle options) {
        return linear_cross_entropy_forward_workspace_bytes(to_view(hidden), to_view(weight), to_view(target),
                                                            lce_options(options));
      },
      "hidden"_a.none(), "weight"_a.none(), "target"_a.none(), "options"_a);
  m.def(
      "linear_cross_entropy_forward_backward_workspace_bytes",
      [](nb::handle hidden, nb::handle weight, nb::handle target, nb::handle grad_hidden, nb::handle grad_weight,
         nb::handle grad_bias, nb::handle options) {
        return linear_cross_entropy_forward_backward_workspace_bytes(
            to_view(hidden), to_view(weight), to_view(target), to_view(grad_hidden), to_view(grad_weight),
            to_view(grad_bias), lce_options(options));
      },
      "hidden"_a.none(), "weight"_a.none(), "target"_a.none(), "grad_hidden"_a.none(), "grad_weight"_a.none(),
      "grad_bias"_a.none(), "options"_a);
  m.def(
      "linear_cross_entropy_backward_workspace_bytes",
      [](nb::handle hidden, nb::handle weight, nb::handle target, nb::handle grad_hidden, nb::handle grad_weight,
         nb::handle grad_bias, nb::handle options) {
        return linear_cross_entropy_backward_workspace_bytes(to_view(hidden), to_view(weight), to_view(target),
                                                             to_view(grad_hidden), to_view(grad_weight),
                                                             to_view(grad_bias), lce_options(options));
      },
      "hidden"_a.none(), "weight"_a.none(), "target"_a.none(), "grad_hidden"_a.none(), "grad_weight"_a.none(),
      "grad_bias"_a.none(), "options"_a);
  m.def(
      "linear_cross_entropy_forward",
      [](nb::handle hidden, nb::handle weight, nb::handle bias, nb::handle target, nb::handle class_weight,
         nb::handle options, nb::handle loss, nb::handle lse, nb::handle workspace, uintptr_t stream) {
        const auto o = lce_options(options);
        const TensorView h = to_view(hidden), w = to_view(weight), b = to_view(bias), t = to_view(target),
                         cw = to_view(class_weight), l = to_view(loss), s = to_view(lse);
        const Workspace ws = to_workspace(workspace);
        nb::gil_scoped_release release;
        linear_cross_entropy_forward(h, w, b, t, cw, o, l, s, ws, to_stream(stream));
      },
      "hidden"_a.none(), "weight"_a.none(), "bias"_a.none(), "target"_a.none(), "class_weight"_a.none(),
      "options"_a, "loss"_a.none(), "lse"_a.none(), "workspace"_a.none(), "stream"_a);
  m.def(
      "linear_cross_entropy_forward_backward",
      [](nb::handle hidden, nb::handle weight, nb::handle bias, nb::handle target, nb::handle class_weight,
         nb::handle options, nb::handle loss, nb::handle lse, nb::handle grad_hidden, nb::handle grad_weight,
         nb::handle grad_bias, nb::handle grad_scale, nb::handle workspace, uintptr_t stream) {
        const auto o = lce_options(options);
        const TensorView h = to_view(hidden), w = to_view(weight), b = to_view(bias), t = to_view(target),
                         cw = to_view(class_weight), l = to_view(loss), s = to_view(lse), gh = to_view(grad_hidden),
                         gw = to_view(grad_weight), gb = to_view(grad_bias), gs = to_view(grad_scale);
        const Workspace ws = to_workspace(workspace);
        nb::gil_scoped_release release;
        linear_cross_entropy_forward_backward(h, w, b, t, cw, o, l, s, gh, gw, gb, gs, ws, to_stream(stream));
      },
      "hidden"_a.none(), "weight"_a.none(), "bias"_a.none(), "target"_a.none(), "class_weight"_a.none(),
      "options"_a, "loss"_a.none(), "lse"_a.none(), "grad_hidden"_a.none(), "grad_weight"_a.none(),
      "grad_bias"_a.none(), "grad_scale"_a.none(), "workspace"_a.none(), "stream"_a);
  m.def(
      "linear_cross_entropy_backward",
      [](nb::handle hidden, nb::handle weight, nb::handle bias, nb::handle target, nb::handle class_weight,
         nb::handle lse, nb::handle grad_loss, nb::handle options, nb::handle grad_hidden, nb::handle grad_weight,
         nb::handle grad_bias, nb::handle workspace, uintptr_t stream) {
        const auto o = lce_options(options);
        const TensorView h = to_view(hidden), w = to_view(weight), b = to_view(bias), t = to_view(target),
                         cw = to_view(class_weight), s = to_view(lse), gl = to_view(grad_loss),
                         gh = to_view(grad_hidden), gw = to_view(grad_weight), gb = to_view(grad_bias);
        const Workspace ws = to_workspace(workspace);
        nb::gil_scoped_release release;
        linear_cross_entropy_backward(h, w, b, t, cw, s, gl, o, gh, gw, gb, ws, to_stream(stream));
      },
      "hidden"_a.none(), "weight"_a.none(), "bias"_a.none(), "target"_a.none(), "class_weight"_a.none(),
      "lse"_a.none(), "grad_loss"_a.none(), "options"_a, "grad_hidden"_a.none(), "grad_weight"_a.none(),
      "grad_bias"_a.none(), "workspace"_a.none(), "stream"_a);
}

}  // namespace logitless::bindings
