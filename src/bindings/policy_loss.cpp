#include "bindings/common.h"

namespace logitless::bindings {

namespace {

PolicyLossInputs make_inputs(nb::handle logits, nb::handle ids, nb::handle adv, nb::handle mask, nb::handle old,
                             nb::handle ref) {
  PolicyLossInputs in;
  in.logits = to_view(logits);
  in.completion_ids = to_view(ids);
  in.advantages = to_view(adv);
  in.completion_mask = to_view(mask);
  in.old_logp = to_view(old);
  in.ref_logp = to_view(ref);
  return in;
}

}  // namespace

PolicyLossOutputs policy_outputs(nb::handle loss, nb::handle per_token_loss, nb::handle kl, nb::handle is_clipped,
                                 nb::handle logp, nb::handle entropy, nb::handle lse) {
  PolicyLossOutputs out;
  out.loss = to_view(loss);
  out.per_token_loss = to_view(per_token_loss);
  out.kl = to_view(kl);
  out.is_clipped = to_view(is_clipped);
  out.logp = to_view(logp);
  out.entropy = to_view(entropy);
  out.lse = to_view(lse);
  return out;
}

// Every tensor argument is declared .none(): None is how Python says "absent" (an optional tensor, or a required
// one missing, which C++ then reports by name). A PolicyLossOptions follows the input tensors.
void bind_policy_loss(nb::module_& m) {
  using namespace nb::literals;
  using O = PolicyLossOptions;
  OptionsClass<O>(m, "PolicyLossOptions")
      .enum_field("loss_type", &O::loss_type)
      .enum_field("importance_sampling_level", &O::importance_sampling_level)
      .field("beta", &O::beta)
      .field("eps_low", &O::eps_low)
      .field("eps_high", &O::eps_high)
      .field("temperature", &O::temperature)
      .field("max_completion_length", &O::max_completion_length)
      .field("num_items_in_batch", &O::num_items_in_batch)
      .field("check_ids", &O::check_ids)
      .enum_field("algo", &O::algo)
      .field("cluster_size", &O::cluster_size)
      .field("threads", &O::threads);
  using S = SelectiveLogSoftmaxOptions;
  OptionsClass<S>(m, "SelectiveLogSoftmaxOptions")
      .field("temperature", &S::temperature)
      .field("check_ids", &S::check_ids);

  m.def(
      "policy_loss_workspace_bytes",
      [](nb::handle logits, nb::handle ids, nb::handle adv, nb::handle mask, nb::handle old, nb::handle ref,
         const PolicyLossOptions& options) {
        return policy_loss_workspace_bytes(make_inputs(logits, ids, adv, mask, old, ref), options);
      },
      "logits"_a.none(), "completion_ids"_a.none(), "advantages"_a.none(), "completion_mask"_a.none(),
      "old_logp"_a.none(), "ref_logp"_a.none(), "options"_a);
  m.def(
      "policy_loss_forward",
      [](nb::handle logits, nb::handle ids, nb::handle adv, nb::handle mask, nb::handle old, nb::handle ref,
         const PolicyLossOptions& options, nb::handle loss, nb::handle per_token_loss, nb::handle kl,
         nb::handle is_clipped, nb::handle logp, nb::handle entropy, nb::handle lse, nb::handle workspace,
         uintptr_t stream) {
        const PolicyLossInputs in = make_inputs(logits, ids, adv, mask, old, ref);
        const PolicyLossOptions o = options;
        const PolicyLossOutputs out = policy_outputs(loss, per_token_loss, kl, is_clipped, logp, entropy, lse);
        const Workspace ws = to_workspace(workspace);
        nb::gil_scoped_release release;
        policy_loss_forward(in, o, out, ws, to_stream(stream));
      },
      "logits"_a.none(), "completion_ids"_a.none(), "advantages"_a.none(), "completion_mask"_a.none(),
      "old_logp"_a.none(), "ref_logp"_a.none(), "options"_a, "loss"_a.none(), "per_token_loss"_a.none(), "kl"_a.none(),
      "is_clipped"_a.none(), "logp"_a.none(), "entropy"_a.none(), "lse"_a.none(), "workspace"_a.none(), "stream"_a);
  m.def(
      "policy_loss_forward_backward",
      [](nb::handle logits, nb::handle ids, nb::handle adv, nb::handle mask, nb::handle old, nb::handle ref,
         const PolicyLossOptions& options, nb::handle loss, nb::handle per_token_loss, nb::handle kl,
         nb::handle is_clipped, nb::handle logp, nb::handle entropy, nb::handle lse, nb::handle grad_logits,
         nb::handle grad_scale, nb::handle workspace, uintptr_t stream) {
        const PolicyLossInputs in = make_inputs(logits, ids, adv, mask, old, ref);
        const PolicyLossOptions o = options;
        const PolicyLossOutputs out = policy_outputs(loss, per_token_loss, kl, is_clipped, logp, entropy, lse);
        const TensorView g = to_view(grad_logits), gs = to_view(grad_scale);
        const Workspace ws = to_workspace(workspace);
        nb::gil_scoped_release release;
        policy_loss_forward_backward(in, o, out, g, gs, ws, to_stream(stream));
      },
      "logits"_a.none(), "completion_ids"_a.none(), "advantages"_a.none(), "completion_mask"_a.none(),
      "old_logp"_a.none(), "ref_logp"_a.none(), "options"_a, "loss"_a.none(), "per_token_loss"_a.none(), "kl"_a.none(),
      "is_clipped"_a.none(), "logp"_a.none(), "entropy"_a.none(), "lse"_a.none(), "grad_logits"_a.none(),
      "grad_scale"_a.none(), "workspace"_a.none(), "stream"_a);

  m.def(
      "selective_log_softmax_workspace_bytes",
      [](nb::handle logits, nb::handle ids, const SelectiveLogSoftmaxOptions& options) {
        return selective_log_softmax_workspace_bytes(to_view(logits), to_view(ids), options);
      },
      "logits"_a.none(), "ids"_a.none(), "options"_a);
  m.def(
      "selective_log_softmax_forward",
      [](nb::handle logits, nb::handle ids, const SelectiveLogSoftmaxOptions& options, nb::handle logp,
         nb::handle entropy, nb::handle lse, nb::handle workspace, uintptr_t stream) {
        const SelectiveLogSoftmaxOptions o = options;
        const TensorView l = to_view(logits), i = to_view(ids), lp = to_view(logp), e = to_view(entropy),
                         s = to_view(lse);
        const Workspace ws = to_workspace(workspace);
        nb::gil_scoped_release release;
        selective_log_softmax_forward(l, i, o, lp, e, s, ws, to_stream(stream));
      },
      "logits"_a.none(), "ids"_a.none(), "options"_a, "logp"_a.none(), "entropy"_a.none(), "lse"_a.none(),
      "workspace"_a.none(), "stream"_a);
  m.def(
      "selective_log_softmax_backward",
      [](nb::handle logits, nb::handle ids, nb::handle lse, nb::handle grad_logp,
         const SelectiveLogSoftmaxOptions& options, nb::handle grad_logits, nb::handle workspace, uintptr_t stream) {
        const SelectiveLogSoftmaxOptions o = options;
        const TensorView l = to_view(logits), i = to_view(ids), s = to_view(lse), gl = to_view(grad_logp),
                         g = to_view(grad_logits);
        const Workspace ws = to_workspace(workspace);
        nb::gil_scoped_release release;
        selective_log_softmax_backward(l, i, s, gl, o, g, ws, to_stream(stream));
      },
      "logits"_a.none(), "ids"_a.none(), "lse"_a.none(), "grad_logp"_a.none(), "options"_a, "grad_logits"_a.none(),
      "workspace"_a.none(), "stream"_a);
}

}  // namespace logitless::bindings
