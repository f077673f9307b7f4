#include "bindings/common.h"

namespace logitless::bindings {

namespace {
PolicyLossOptions make_options(int loss_type, int level, double beta, double eps_low, double eps_high,
                               double temperature, int64_t max_completion_length, double num_items_in_batch,
                               bool check_ids, int algo, int cluster_size, int threads) {
  PolicyLossOptions o;
  o.loss_type = static_cast<PolicyLossType>(loss_type);
  o.importance_sampling_level = static_cast<ImportanceSamplingLevel>(level);
  o.beta = beta;
  o.eps_low = eps_low;
  o.eps_high = eps_high;
  o.temperature = temperature;
  o.max_completion_length = max_completion_length;
  o.num_items_in_batch = num_items_in_batch;
  o.check_ids = check_ids;
  o.algo = static_cast<PolicyLossAlgo>(algo);
  o.cluster_size = cluster_size;
  o.threads = threads;
  return o;
}

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
// one missing, which C++ then reports by name). The options follow the tensors in PolicyLossOptions' order.
void bind_policy_loss(nb::module_& m) {
  using namespace nb::literals;
  m.def(
      "policy_loss_workspace_bytes",
      [](nb::handle logits, nb::handle ids, nb::handle adv, nb::handle mask, nb::handle old, nb::handle ref,
         int loss_type, int level, double beta, double eps_low, double eps_high, double temperature, int64_t max_len,
         double num_items, bool check_ids, int algo, int cluster_size, int threads) {
        return policy_loss_workspace_bytes(make_inputs(logits, ids, adv, mask, old, ref),
                                           make_options(loss_type, level, beta, eps_low, eps_high, temperature,
                                                        max_len, num_items, check_ids, algo, cluster_size, threads));
      },
      "logits"_a.none(), "completion_ids"_a.none(), "advantages"_a.none(), "completion_mask"_a.none(),
      "old_logp"_a.none(), "ref_logp"_a.none(), "loss_type"_a, "importance_sampling_level"_a, "beta"_a, "eps_low"_a,
      "eps_high"_a, "temperature"_a, "max_completion_length"_a, "num_items_in_batch"_a, "check_ids"_a, "algo"_a,
      "cluster_size"_a, "threads"_a);
  m.def(
      "policy_loss_forward",
      [](nb::handle logits, nb::handle ids, nb::handle adv, nb::handle mask, nb::handle old, nb::handle ref,
         int loss_type, int level, double beta, double eps_low, double eps_high, double temperature, int64_t max_len,
         double num_items, bool check_ids, int algo, int cluster_size, int threads, nb::handle loss,
         nb::handle per_token_loss, nb::handle kl, nb::handle is_clipped, nb::handle logp, nb::handle entropy,
         nb::handle lse, nb::handle workspace, uintptr_t stream) {
        const PolicyLossInputs in = make_inputs(logits, ids, adv, mask, old, ref);
        const PolicyLossOptions o = make_options(loss_type, level, beta, eps_low, eps_high, temperature, max_len,
                                                 num_items, check_ids, algo, cluster_size, threads);
        const PolicyLossOutputs out = policy_outputs(loss, per_token_loss, kl, is_clipped, logp, entropy, lse);
        const Workspace ws = to_workspace(workspace);
        nb::gil_scoped_release release;
        policy_loss_forward(in, o, out, ws, to_stream(stream));
      },
      "logits"_a.none(), "completion_ids"_a.none(), "advantages"_a.none(), "completion_mask"_a.none(),
      "old_logp"_a.none(), "ref_logp"_a.none(), "loss_type"_a, "importance_sampling_level"_a, "beta"_a, "eps_low"_a,
      "eps_high"_a, "temperature"_a, "max_completion_length"_a, "num_items_in_batch"_a, "check_ids"_a, "algo"_a,
      "cluster_size"_a, "threads"_a, "loss"_a.none(), "per_token_loss"_a.none(), "kl"_a.none(),
      "is_clipped"_a.none(), "logp"_a.none(), "entropy"_a.none(), "lse"_a.none(), "workspace"_a.none(), "stream"_a);
  m.def(
      "policy_loss_forward_backward",
      [](nb::handle logits, nb::handle ids, nb::handle adv, nb::handle mask, nb::handle old, nb::handle ref,
         int loss_type, int level, double beta, double eps_low, double eps_high, double temperature, int64_t max_len,
         double num_items, bool check_ids, int algo, int cluster_size, int threads, nb::handle loss,
         nb::handle per_token_loss, nb::handle kl, nb::handle is_clipped, nb::handle logp, nb::handle entropy,
         nb::handle lse, nb::handle grad_logits, nb::handle grad_scale, nb::handle workspace, uintptr_t stream) {
        const PolicyLossInputs in = make_inputs(logits, ids, adv, mask, old, ref);
        const PolicyLossOptions o = make_options(loss_type, level, beta, eps_low, eps_high, temperature, max_len,
                                                 num_items, check_ids, algo, cluster_size, threads);
        const PolicyLossOutputs out = policy_outputs(loss, per_token_loss, kl, is_clipped, logp, entropy, lse);
        const TensorView g = to_view(grad_logits), gs = to_view(grad_scale);
        const Workspace ws = to_workspace(workspace);
        nb::gil_scoped_release release;
        policy_loss_forward_backward(in, o, out, g, gs, ws, to_stream(stream));
      },
      "logits"_a.none(), "completion_ids"_a.none(), "advantages"_a.none(), "completion_mask"_a.none(),
      "old_logp"_a.none(), "ref_logp"_a.none(), "loss_type"_a, "importance_sampling_level"_a, "beta"_a, "eps_low"_a,
      "eps_high"_a, "temperature"_a, "max_completion_length"_a, "num_items_in_batch"_a, "check_ids"_a, "algo"_a,
      "cluster_size"_a, "threads"_a, "loss"_a.none(), "per_token_loss"_a.none(), "kl"_a.none(),
      "is_clipped"_a.none(), "logp"_a.none(), "entropy"_a.none(), "lse"_a.none(), "grad_logits"_a.none(),
      "grad_scale"_a.none(), "workspace"_a.none(), "stream"_a);

  m.def(
      "selective_log_softmax_workspace_bytes",
      [](nb::handle logits, nb::handle ids, double temperature, bool check_ids) {
        SelectiveLogSoftmaxOptions o;
        o.temperature = temperature;
        o.check_ids = check_ids;
        return selective_log_softmax_workspace_bytes(to_view(logits), to_view(ids), o);
      },
      "logits"_a.none(), "ids"_a.none(), "temperature"_a, "check_ids"_a);
  m.def(
      "selective_log_softmax_forward",
      [](nb::handle logits, nb::handle ids, double temperature, bool check_ids, nb::handle logp, nb::handle entropy,
         nb::handle lse, nb::handle workspace, uintptr_t stream) {
        SelectiveLogSoftmaxOptions o;
        o.temperature = temperature;
        o.check_ids = check_ids;
        const TensorView l = to_view(logits), i = to_view(ids), lp = to_view(logp), e = to_view(entropy),
                         s = to_view(lse);
        const Workspace ws = to_workspace(workspace);
        nb::gil_scoped_release release;
        selective_log_softmax_forward(l, i, o, lp, e, s, ws, to_stream(stream));
      },
      "logits"_a.none(), "ids"_a.none(), "temperature"_a, "check_ids"_a, "logp"_a.none(), "entropy"_a.none(),
      "lse"_a.none(), "workspace"_a.none(), "stream"_a);
  m.def(
      "selective_log_softmax_backward",
      [](nb::handle logits, nb::handle ids, nb::handle lse, nb::handle grad_logp, double temperature,
         nb::handle grad_logits, nb::handle workspace, uintptr_t stream) {
        SelectiveLogSoftmaxOptions o;
        o.temperature = temperature;
        const TensorView l = to_view(logits), i = to_view(ids), s = to_view(lse), gl = to_view(grad_logp),
                         g = to_view(grad_logits);
        const Workspace ws = to_workspace(workspace);
        nb::gil_scoped_release release;
        selective_log_softmax_backward(l, i, s, gl, o, g, ws, to_stream(stream));
      },
      "logits"_a.none(), "ids"_a.none(), "lse"_a.none(), "grad_logp"_a.none(), "temperature"_a,
      "grad_logits"_a.none(), "workspace"_a.none(), "stream"_a);
}

}  // namespace logitless::bindings
