#include "bindings/common.h"

namespace logitless::bindings {

void bind_linear_cross_entropy(nb::module_& m) {
  using namespace nb::literals;
  using O = LinearCrossEntropyOptions;
  OptionsClass<O>(m, "LinearCrossEntropyOptions")
      .field("ignore_index", &O::ignore_index)
      .enum_field("reduction", &O::reduction)
      .field("label_smoothing", &O::label_smoothing)
      .field("z_loss", &O::z_loss)
      .field("softcap", &O::softcap)
      .field("check_targets", &O::check_targets)
      .field("chunk_tokens", &O::chunk_tokens)
      .field("chunk_vocab", &O::chunk_vocab)
      .field("memory_budget", &O::memory_budget)
      .enum_field("grad_weight_accumulation", &O::grad_weight_accumulation)
      .field("row_stats", &O::row_stats);

  m.def(
      "linear_cross_entropy_recompute_is_faster",
      [](int64_t n, int64_t h, int64_t v, int32_t dtype, int32_t device_type, int32_t device_index, bool need_dx,
         bool need_dw, bool need_db, const LinearCrossEntropyOptions& options) {
        return linear_cross_entropy_recompute_is_faster(n, h, v, static_cast<DType>(dtype),
                                                        Device{static_cast<DeviceType>(device_type), device_index},
                                                        need_dx, need_dw, need_db, options);
      },
      "n"_a, "h"_a, "v"_a, "dtype"_a, "device_type"_a, "device_index"_a, "need_grad_hidden"_a, "need_grad_weight"_a,
      "need_grad_bias"_a, "options"_a);
  m.def(
      "linear_cross_entropy_forward_workspace_bytes",
      [](nb::handle hidden, nb::handle weight, nb::handle target, const LinearCrossEntropyOptions& options) {
        return linear_cross_entropy_forward_workspace_bytes(to_view(hidden), to_view(weight), to_view(target), options);
      },
      "hidden"_a.none(), "weight"_a.none(), "target"_a.none(), "options"_a);
  m.def(
      "linear_cross_entropy_forward_backward_workspace_bytes",
      [](nb::handle hidden, nb::handle weight, nb::handle target, nb::handle grad_hidden, nb::handle grad_weight,
         nb::handle grad_bias, const LinearCrossEntropyOptions& options) {
        return linear_cross_entropy_forward_backward_workspace_bytes(to_view(hidden), to_view(weight), to_view(target),
                                                                     to_view(grad_hidden), to_view(grad_weight),
                                                                     to_view(grad_bias), options);
      },
      "hidden"_a.none(), "weight"_a.none(), "target"_a.none(), "grad_hidden"_a.none(), "grad_weight"_a.none(),
      "grad_bias"_a.none(), "options"_a);
  m.def(
      "linear_cross_entropy_backward_workspace_bytes",
      [](nb::handle hidden, nb::handle weight, nb::handle target, nb::handle grad_hidden, nb::handle grad_weight,
         nb::handle grad_bias, const LinearCrossEntropyOptions& options) {
        return linear_cross_entropy_backward_workspace_bytes(to_view(hidden), to_view(weight), to_view(target),
                                                             to_view(grad_hidden), to_view(grad_weight),
                                                             to_view(grad_bias), options);
      },
      "hidden"_a.none(), "weight"_a.none(), "target"_a.none(), "grad_hidden"_a.none(), "grad_weight"_a.none(),
      "grad_bias"_a.none(), "options"_a);
  m.def(
      "linear_cross_entropy_forward",
      [](nb::handle hidden, nb::handle weight, nb::handle bias, nb::handle target, nb::handle class_weight,
         const LinearCrossEntropyOptions& options, nb::handle loss, nb::handle lse, nb::handle workspace,
         uintptr_t stream, nb::handle entropy, nb::handle is_top1) {
        const LinearCrossEntropyOptions o = options;
        const TensorView h = to_view(hidden), w = to_view(weight), b = to_view(bias), t = to_view(target),
                         cw = to_view(class_weight), l = to_view(loss), s = to_view(lse);
        const LinearCrossEntropyRowStats rs{to_view(entropy), to_view(is_top1)};
        const Workspace ws = to_workspace(workspace);
        nb::gil_scoped_release release;
        linear_cross_entropy_forward(h, w, b, t, cw, o, l, s, ws, to_stream(stream), rs);
      },
      "hidden"_a.none(), "weight"_a.none(), "bias"_a.none(), "target"_a.none(), "class_weight"_a.none(), "options"_a,
      "loss"_a.none(), "lse"_a.none(), "workspace"_a.none(), "stream"_a, "entropy"_a.none() = nb::none(),
      "is_top1"_a.none() = nb::none());
  m.def(
      "linear_cross_entropy_forward_backward",
      [](nb::handle hidden, nb::handle weight, nb::handle bias, nb::handle target, nb::handle class_weight,
         const LinearCrossEntropyOptions& options, nb::handle loss, nb::handle lse, nb::handle grad_hidden,
         nb::handle grad_weight, nb::handle grad_bias, nb::handle grad_scale, nb::handle workspace, uintptr_t stream,
         nb::handle entropy, nb::handle is_top1) {
        const LinearCrossEntropyOptions o = options;
        const TensorView h = to_view(hidden), w = to_view(weight), b = to_view(bias), t = to_view(target),
                         cw = to_view(class_weight), l = to_view(loss), s = to_view(lse), gh = to_view(grad_hidden),
                         gw = to_view(grad_weight), gb = to_view(grad_bias), gs = to_view(grad_scale);
        const LinearCrossEntropyRowStats rs{to_view(entropy), to_view(is_top1)};
        const Workspace ws = to_workspace(workspace);
        nb::gil_scoped_release release;
        linear_cross_entropy_forward_backward(h, w, b, t, cw, o, l, s, gh, gw, gb, gs, ws, to_stream(stream), rs);
      },
      "hidden"_a.none(), "weight"_a.none(), "bias"_a.none(), "target"_a.none(), "class_weight"_a.none(), "options"_a,
      "loss"_a.none(), "lse"_a.none(), "grad_hidden"_a.none(), "grad_weight"_a.none(), "grad_bias"_a.none(),
      "grad_scale"_a.none(), "workspace"_a.none(), "stream"_a, "entropy"_a.none() = nb::none(),
      "is_top1"_a.none() = nb::none());
  m.def(
      "linear_cross_entropy_backward",
      [](nb::handle hidden, nb::handle weight, nb::handle bias, nb::handle target, nb::handle class_weight,
         nb::handle lse, nb::handle grad_loss, const LinearCrossEntropyOptions& options, nb::handle grad_hidden,
         nb::handle grad_weight, nb::handle grad_bias, nb::handle workspace, uintptr_t stream) {
        const LinearCrossEntropyOptions o = options;
        const TensorView h = to_view(hidden), w = to_view(weight), b = to_view(bias), t = to_view(target),
                         cw = to_view(class_weight), s = to_view(lse), gl = to_view(grad_loss),
                         gh = to_view(grad_hidden), gw = to_view(grad_weight), gb = to_view(grad_bias);
        const Workspace ws = to_workspace(workspace);
        nb::gil_scoped_release release;
        linear_cross_entropy_backward(h, w, b, t, cw, s, gl, o, gh, gw, gb, ws, to_stream(stream));
      },
      "hidden"_a.none(), "weight"_a.none(), "bias"_a.none(), "target"_a.none(), "class_weight"_a.none(), "lse"_a.none(),
      "grad_loss"_a.none(), "options"_a, "grad_hidden"_a.none(), "grad_weight"_a.none(), "grad_bias"_a.none(),
      "workspace"_a.none(), "stream"_a);
}

}  // namespace logitless::bindings
