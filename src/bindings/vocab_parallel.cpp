#include <nanobind/stl/tuple.h>

#include "bindings/common.h"

namespace logitless::bindings {

// include/logitless/vocab_parallel.h. A shard travels as (offset, vocab); tensors as descriptors or None; the options
// as the CrossEntropyOptions and LinearCrossEntropyOptions classes that cross_entropy.cpp and linear_cross_entropy.cpp
// bind.
void bind_vocab_parallel(nb::module_& m) {
  using namespace nb::literals;
  m.def(
      "cross_entropy_shard_workspace_bytes",
      [](nb::handle target, const CrossEntropyOptions& options) {
        return cross_entropy_shard_workspace_bytes(to_view(target), options);
      },
      "target"_a.none(), "options"_a);
  m.def(
      "cross_entropy_shard_partials",
      [](nb::handle logits, nb::handle target, nb::handle weight, int64_t offset, int64_t vocab,
         const CrossEntropyOptions& options, nb::handle partials, nb::handle workspace, uintptr_t stream) {
        const CrossEntropyOptions o = options;
        const TensorView l = to_view(logits), t = to_view(target), w = to_view(weight), p = to_view(partials);
        const Workspace ws = to_workspace(workspace);
        nb::gil_scoped_release release;
        cross_entropy_shard_partials(l, t, w, VocabShard{offset, vocab}, o, p, ws, to_stream(stream));
      },
      "logits"_a.none(), "target"_a.none(), "weight"_a.none(), "offset"_a, "vocab"_a, "options"_a, "partials"_a.none(),
      "workspace"_a.none(), "stream"_a);
  m.def(
      "cross_entropy_shard_finalize",
      [](nb::handle partials, nb::handle target, nb::handle weight, int64_t vocab, const CrossEntropyOptions& options,
         nb::handle loss, nb::handle lse, nb::handle z_loss, nb::handle workspace, uintptr_t stream) {
        const CrossEntropyOptions o = options;
        const TensorView p = to_view(partials), t = to_view(target), w = to_view(weight), l = to_view(loss),
                         s = to_view(lse), z = to_view(z_loss);
        const Workspace ws = to_workspace(workspace);
        nb::gil_scoped_release release;
        cross_entropy_shard_finalize(p, t, w, vocab, o, l, s, z, ws, to_stream(stream));
      },
      "partials"_a.none(), "target"_a.none(), "weight"_a.none(), "vocab"_a, "options"_a, "loss"_a.none(),
      "lse"_a.none(), "z_loss"_a.none(), "workspace"_a.none(), "stream"_a);
  m.def(
      "cross_entropy_shard_backward",
      [](nb::handle logits, nb::handle target, nb::handle weight, int64_t offset, int64_t vocab, nb::handle lse,
         nb::handle grad_loss, const CrossEntropyOptions& options, nb::handle grad_logits, nb::handle workspace,
         uintptr_t stream) {
        const CrossEntropyOptions o = options;
        const TensorView l = to_view(logits), t = to_view(target), w = to_view(weight), s = to_view(lse),
                         gl = to_view(grad_loss), g = to_view(grad_logits);
        const Workspace ws = to_workspace(workspace);
        nb::gil_scoped_release release;
        cross_entropy_shard_backward(l, t, w, VocabShard{offset, vocab}, s, gl, o, g, ws, to_stream(stream));
      },
      "logits"_a.none(), "target"_a.none(), "weight"_a.none(), "offset"_a, "vocab"_a, "lse"_a.none(),
      "grad_loss"_a.none(), "options"_a, "grad_logits"_a.none(), "workspace"_a.none(), "stream"_a);

  m.def(
      "linear_cross_entropy_shard_partials_workspace_bytes",
      [](nb::handle hidden, nb::handle weight, nb::handle target, int64_t offset, int64_t vocab,
         const LinearCrossEntropyOptions& options) {
        return linear_cross_entropy_shard_partials_workspace_bytes(to_view(hidden), to_view(weight), to_view(target),
                                                                   VocabShard{offset, vocab}, options);
      },
      "hidden"_a.none(), "weight"_a.none(), "target"_a.none(), "offset"_a, "vocab"_a, "options"_a);
  m.def(
      "linear_cross_entropy_shard_partials",
      [](nb::handle hidden, nb::handle weight, nb::handle bias, nb::handle target, nb::handle class_weight,
         int64_t offset, int64_t vocab, const LinearCrossEntropyOptions& options, nb::handle partials,
         nb::handle workspace, uintptr_t stream) {
        const LinearCrossEntropyOptions o = options;
        const TensorView h = to_view(hidden), w = to_view(weight), b = to_view(bias), t = to_view(target),
                         cw = to_view(class_weight), p = to_view(partials);
        const Workspace ws = to_workspace(workspace);
        nb::gil_scoped_release release;
        linear_cross_entropy_shard_partials(h, w, b, t, cw, VocabShard{offset, vocab}, o, p, ws, to_stream(stream));
      },
      "hidden"_a.none(), "weight"_a.none(), "bias"_a.none(), "target"_a.none(), "class_weight"_a.none(), "offset"_a,
      "vocab"_a, "options"_a, "partials"_a.none(), "workspace"_a.none(), "stream"_a);
  m.def(
      "linear_cross_entropy_shard_backward_workspace_bytes",
      [](nb::handle hidden, nb::handle weight, nb::handle target, nb::handle grad_hidden, nb::handle grad_weight,
         nb::handle grad_bias, int64_t offset, int64_t vocab, const LinearCrossEntropyOptions& options) {
        return linear_cross_entropy_shard_backward_workspace_bytes(
            to_view(hidden), to_view(weight), to_view(target), to_view(grad_hidden), to_view(grad_weight),
            to_view(grad_bias), VocabShard{offset, vocab}, options);
      },
      "hidden"_a.none(), "weight"_a.none(), "target"_a.none(), "grad_hidden"_a.none(), "grad_weight"_a.none(),
      "grad_bias"_a.none(), "offset"_a, "vocab"_a, "options"_a);
  m.def(
      "linear_cross_entropy_shard_backward",
      [](nb::handle hidden, nb::handle weight, nb::handle bias, nb::handle target, nb::handle class_weight,
         int64_t offset, int64_t vocab, nb::handle lse, nb::handle grad_loss, const LinearCrossEntropyOptions& options,
         nb::handle grad_hidden, nb::handle grad_weight, nb::handle grad_bias, nb::handle workspace, uintptr_t stream) {
        const LinearCrossEntropyOptions o = options;
        const TensorView h = to_view(hidden), w = to_view(weight), b = to_view(bias), t = to_view(target),
                         cw = to_view(class_weight), s = to_view(lse), gl = to_view(grad_loss),
                         gh = to_view(grad_hidden), gw = to_view(grad_weight), gb = to_view(grad_bias);
        const Workspace ws = to_workspace(workspace);
        nb::gil_scoped_release release;
        linear_cross_entropy_shard_backward(h, w, b, t, cw, VocabShard{offset, vocab}, s, gl, o, gh, gw, gb, ws,
                                            to_stream(stream));
      },
      "hidden"_a.none(), "weight"_a.none(), "bias"_a.none(), "target"_a.none(), "class_weight"_a.none(), "offset"_a,
      "vocab"_a, "lse"_a.none(), "grad_loss"_a.none(), "options"_a, "grad_hidden"_a.none(), "grad_weight"_a.none(),
      "grad_bias"_a.none(), "workspace"_a.none(), "stream"_a);
  m.def(
      "linear_cross_entropy_shard_chunk_tokens",
      [](int64_t n_tokens, int64_t widest_shard, const LinearCrossEntropyOptions& options) {
        return linear_cross_entropy_shard_chunk_tokens(n_tokens, widest_shard, options);
      },
      "n_tokens"_a, "widest_shard"_a, "options"_a);
  m.def(
      "linear_cross_entropy_shard_steps",
      [](nb::handle hidden, nb::handle weight, nb::handle target, nb::handle grad_hidden, nb::handle grad_weight,
         nb::handle grad_bias, int64_t offset, int64_t vocab, const LinearCrossEntropyOptions& options) {
        const LinearCrossEntropyShardSteps s = linear_cross_entropy_shard_steps(
            to_view(hidden), to_view(weight), to_view(target), to_view(grad_hidden), to_view(grad_weight),
            to_view(grad_bias), VocabShard{offset, vocab}, options);
        return nb::make_tuple(s.chunk_tokens, s.num_chunks, s.workspace_bytes);
      },
      "hidden"_a.none(), "weight"_a.none(), "target"_a.none(), "grad_hidden"_a.none(), "grad_weight"_a.none(),
      "grad_bias"_a.none(), "offset"_a, "vocab"_a, "options"_a);
  m.def(
      "linear_cross_entropy_shard_forward_backward_step",
      [](int step, int64_t chunk, nb::handle partials, nb::handle hidden, nb::handle weight, nb::handle bias,
         nb::handle target, nb::handle class_weight, int64_t offset, int64_t vocab,
         const LinearCrossEntropyOptions& options, nb::handle loss, nb::handle lse, nb::handle grad_hidden,
         nb::handle grad_weight, nb::handle grad_bias, nb::handle workspace, uintptr_t stream) {
        const LinearCrossEntropyOptions o = options;
        const TensorView p = to_view(partials), h = to_view(hidden), w = to_view(weight), b = to_view(bias),
                         t = to_view(target), cw = to_view(class_weight), l = to_view(loss), s = to_view(lse),
                         gh = to_view(grad_hidden), gw = to_view(grad_weight), gb = to_view(grad_bias);
        const Workspace ws = to_workspace(workspace);
        nb::gil_scoped_release release;
        linear_cross_entropy_shard_forward_backward_step(static_cast<ShardStep>(step), chunk, p, h, w, b, t, cw,
                                                         VocabShard{offset, vocab}, o, l, s, gh, gw, gb, ws,
                                                         to_stream(stream));
      },
      "step"_a, "chunk"_a, "partials"_a.none(), "hidden"_a.none(), "weight"_a.none(), "bias"_a.none(),
      "target"_a.none(), "class_weight"_a.none(), "offset"_a, "vocab"_a, "options"_a, "loss"_a.none(), "lse"_a.none(),
      "grad_hidden"_a.none(), "grad_weight"_a.none(), "grad_bias"_a.none(), "workspace"_a.none(), "stream"_a);
}

}  // namespace logitless::bindings
