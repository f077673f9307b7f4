#include "bindings/common.h"

namespace logitless::bindings {

namespace {

LinearPolicyLossInputs make_inputs(nb::handle hidden, nb::handle weight, nb::handle bias, nb::handle ids,
                                   nb::handle adv, nb::handle mask, nb::handle old, nb::handle ref) {
  LinearPolicyLossInputs in;
  in.hidden = to_view(hidden);
  in.weight = to_view(weight);
  in.bias = to_view(bias);
  in.completion_ids = to_view(ids);
  in.advantages = to_view(adv);
  in.completion_mask = to_view(mask);
  in.old_logp = to_view(old);
  in.ref_logp = to_view(ref);
  return in;
}

LinearPolicyLossGrads make_grads(nb::handle grad_hidden, nb::handle grad_weight, nb::handle grad_bias) {
  LinearPolicyLossGrads g;
  g.grad_hidden = to_view(grad_hidden);
  g.grad_weight = to_view(grad_weight);
  g.grad_bias = to_view(grad_bias);
  return g;
}

}  // namespace

// Tensor arguments accept None (absent). The workspace queries take the entry point as `pass`: 0 forward, 1
// forward-backward, 2 backward (selective: 0 forward, 2 backward).
void bind_linear_policy_loss(nb::module_& m) {
  using namespace nb::literals;
  using O = LinearPolicyLossOptions;
  OptionsClass<O>(m, "LinearPolicyLossOptions")
      .field("policy", &O::policy)
      .field("chunk_tokens", &O::chunk_tokens)
      .field("memory_budget", &O::memory_budget);
  using S = LinearSelectiveLogSoftmaxOptions;
  OptionsClass<S>(m, "LinearSelectiveLogSoftmaxOptions")
      .field("temperature", &S::temperature)
      .field("check_ids", &S::check_ids)
      .field("chunk_tokens", &S::chunk_tokens)
      .field("memory_budget", &S::memory_budget);

  m.def(
      "linear_policy_loss_workspace_bytes",
      [](int pass, nb::handle hidden, nb::handle weight, nb::handle bias, nb::handle ids, nb::handle adv,
         nb::handle mask, nb::handle old, nb::handle ref, const LinearPolicyLossOptions& options,
         nb::handle grad_hidden, nb::handle grad_weight, nb::handle grad_bias) {
        const LinearPolicyLossInputs in = make_inputs(hidden, weight, bias, ids, adv, mask, old, ref);
        const LinearPolicyLossOptions o = options;
        const LinearPolicyLossGrads g = make_grads(grad_hidden, grad_weight, grad_bias);
        if (pass == 0) return linear_policy_loss_forward_workspace_bytes(in, o);
        if (pass == 1) return linear_policy_loss_forward_backward_workspace_bytes(in, o, g);
        return linear_policy_loss_backward_workspace_bytes(in, o, g);
      },
      "pass"_a, "hidden"_a.none(), "weight"_a.none(), "bias"_a.none(), "completion_ids"_a.none(), "advantages"_a.none(),
      "completion_mask"_a.none(), "old_logp"_a.none(), "ref_logp"_a.none(), "options"_a, "grad_hidden"_a.none(),
      "grad_weight"_a.none(), "grad_bias"_a.none());
  m.def(
      "linear_policy_loss_forward",
      [](nb::handle hidden, nb::handle weight, nb::handle bias, nb::handle ids, nb::handle adv, nb::handle mask,
         nb::handle old, nb::handle ref, const LinearPolicyLossOptions& options, nb::handle loss,
         nb::handle per_token_loss, nb::handle kl, nb::handle is_clipped, nb::handle logp, nb::handle entropy,
         nb::handle lse, nb::handle workspace, uintptr_t stream) {
        const LinearPolicyLossInputs in = make_inputs(hidden, weight, bias, ids, adv, mask, old, ref);
        const LinearPolicyLossOptions o = options;
        const PolicyLossOutputs out = policy_outputs(loss, per_token_loss, kl, is_clipped, logp, entropy, lse);
        const Workspace ws = to_workspace(workspace);
        nb::gil_scoped_release release;
        linear_policy_loss_forward(in, o, out, ws, to_stream(stream));
      },
      "hidden"_a.none(), "weight"_a.none(), "bias"_a.none(), "completion_ids"_a.none(), "advantages"_a.none(),
      "completion_mask"_a.none(), "old_logp"_a.none(), "ref_logp"_a.none(), "options"_a, "loss"_a.none(),
      "per_token_loss"_a.none(), "kl"_a.none(), "is_clipped"_a.none(), "logp"_a.none(), "entropy"_a.none(),
      "lse"_a.none(), "workspace"_a.none(), "stream"_a);
  m.def(
      "linear_policy_loss_forward_backward",
      [](nb::handle hidden, nb::handle weight, nb::handle bias, nb::handle ids, nb::handle adv, nb::handle mask,
         nb::handle old, nb::handle ref, const LinearPolicyLossOptions& options, nb::handle loss,
         nb::handle per_token_loss, nb::handle kl, nb::handle is_clipped, nb::handle logp, nb::handle entropy,
         nb::handle lse, nb::handle grad_hidden, nb::handle grad_weight, nb::handle grad_bias, nb::handle grad_scale,
         nb::handle workspace, uintptr_t stream) {
        const LinearPolicyLossInputs in = make_inputs(hidden, weight, bias, ids, adv, mask, old, ref);
        const LinearPolicyLossOptions o = options;
        const PolicyLossOutputs out = policy_outputs(loss, per_token_loss, kl, is_clipped, logp, entropy, lse);
        const LinearPolicyLossGrads g = make_grads(grad_hidden, grad_weight, grad_bias);
        const TensorView gs = to_view(grad_scale);
        const Workspace ws = to_workspace(workspace);
        nb::gil_scoped_release release;
        linear_policy_loss_forward_backward(in, o, out, g, gs, ws, to_stream(stream));
      },
      "hidden"_a.none(), "weight"_a.none(), "bias"_a.none(), "completion_ids"_a.none(), "advantages"_a.none(),
      "completion_mask"_a.none(), "old_logp"_a.none(), "ref_logp"_a.none(), "options"_a, "loss"_a.none(),
      "per_token_loss"_a.none(), "kl"_a.none(), "is_clipped"_a.none(), "logp"_a.none(), "entropy"_a.none(),
      "lse"_a.none(), "grad_hidden"_a.none(), "grad_weight"_a.none(), "grad_bias"_a.none(), "grad_scale"_a.none(),
      "workspace"_a.none(), "stream"_a);
  m.def(
      "linear_policy_loss_backward",
      [](nb::handle hidden, nb::handle weight, nb::handle bias, nb::handle ids, nb::handle adv, nb::handle mask,
         nb::handle old, nb::handle ref, const LinearPolicyLossOptions& options, nb::handle logp, nb::handle lse,
         nb::handle grad_loss, nb::handle grad_hidden, nb::handle grad_weight, nb::handle grad_bias,
         nb::handle workspace, uintptr_t stream) {
        const LinearPolicyLossInputs in = make_inputs(hidden, weight, bias, ids, adv, mask, old, ref);
        const LinearPolicyLossOptions o = options;
        const LinearPolicyLossGrads g = make_grads(grad_hidden, grad_weight, grad_bias);
        const TensorView lp = to_view(logp), s = to_view(lse), gl = to_view(grad_loss);
        const Workspace ws = to_workspace(workspace);
        nb::gil_scoped_release release;
        linear_policy_loss_backward(in, o, lp, s, gl, g, ws, to_stream(stream));
      },
      "hidden"_a.none(), "weight"_a.none(), "bias"_a.none(), "completion_ids"_a.none(), "advantages"_a.none(),
      "completion_mask"_a.none(), "old_logp"_a.none(), "ref_logp"_a.none(), "options"_a, "logp"_a.none(),
      "lse"_a.none(), "grad_loss"_a.none(), "grad_hidden"_a.none(), "grad_weight"_a.none(), "grad_bias"_a.none(),
      "workspace"_a.none(), "stream"_a);

  m.def(
      "linear_selective_log_softmax_workspace_bytes",
      [](int pass, nb::handle hidden, nb::handle weight, nb::handle ids, const LinearSelectiveLogSoftmaxOptions& o,
         nb::handle grad_hidden, nb::handle grad_weight, nb::handle grad_bias) {
        if (pass == 0)
          return linear_selective_log_softmax_forward_workspace_bytes(to_view(hidden), to_view(weight), to_view(ids),
                                                                      o);
        return linear_selective_log_softmax_backward_workspace_bytes(to_view(hidden), to_view(weight), to_view(ids), o,
                                                                     make_grads(grad_hidden, grad_weight, grad_bias));
      },
      "pass"_a, "hidden"_a.none(), "weight"_a.none(), "ids"_a.none(), "options"_a, "grad_hidden"_a.none(),
      "grad_weight"_a.none(), "grad_bias"_a.none());
  m.def(
      "linear_selective_log_softmax_forward",
      [](nb::handle hidden, nb::handle weight, nb::handle bias, nb::handle ids,
         const LinearSelectiveLogSoftmaxOptions& options, nb::handle logp, nb::handle entropy, nb::handle lse,
         nb::handle is_top1, nb::handle workspace, uintptr_t stream) {
        const LinearSelectiveLogSoftmaxOptions o = options;
        const TensorView h = to_view(hidden), w = to_view(weight), b = to_view(bias), i = to_view(ids),
                         lp = to_view(logp), e = to_view(entropy), s = to_view(lse), t1 = to_view(is_top1);
        const Workspace ws = to_workspace(workspace);
        nb::gil_scoped_release release;
        linear_selective_log_softmax_forward(h, w, b, i, o, lp, e, s, t1, ws, to_stream(stream));
      },
      "hidden"_a.none(), "weight"_a.none(), "bias"_a.none(), "ids"_a.none(), "options"_a, "logp"_a.none(),
      "entropy"_a.none(), "lse"_a.none(), "is_top1"_a.none(), "workspace"_a.none(), "stream"_a);
  m.def(
      "linear_selective_log_softmax_backward",
      [](nb::handle hidden, nb::handle weight, nb::handle bias, nb::handle ids, nb::handle lse, nb::handle grad_logp,
         const LinearSelectiveLogSoftmaxOptions& options, nb::handle grad_hidden, nb::handle grad_weight,
         nb::handle grad_bias, nb::handle workspace, uintptr_t stream) {
        const LinearSelectiveLogSoftmaxOptions o = options;
        const TensorView h = to_view(hidden), w = to_view(weight), b = to_view(bias), i = to_view(ids),
                         s = to_view(lse), gl = to_view(grad_logp);
        const LinearPolicyLossGrads g = make_grads(grad_hidden, grad_weight, grad_bias);
        const Workspace ws = to_workspace(workspace);
        nb::gil_scoped_release release;
        linear_selective_log_softmax_backward(h, w, b, i, s, gl, o, g, ws, to_stream(stream));
      },
      "hidden"_a.none(), "weight"_a.none(), "bias"_a.none(), "ids"_a.none(), "lse"_a.none(), "grad_logp"_a.none(),
      "options"_a, "grad_hidden"_a.none(), "grad_weight"_a.none(), "grad_bias"_a.none(), "workspace"_a.none(),
      "stream"_a);
}

}  // namespace logitless::bindings
