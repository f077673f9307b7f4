"""Policy losses (GRPO, BNPO, Dr. GRPO, DAPO; PPO-clip or GSPO ratios; k3 KL) and selective log-softmax from
the last hidden states and the output layer: the logits ``hidden @ weight.T (+ bias)`` exist only a chunk of
tokens at a time (include/logitless/linear_policy_loss.h). The torch ops (custom_op + fake + autograd) and the
public functions `linear_grpo_loss` and `linear_selective_log_softmax`.

Schedules of `linear_grpo_loss`, both exact:

* gradient in the forward: ``logitless::linear_policy_loss_forward_backward_out`` computes the loss and the
  gradients for hidden, weight and bias (upstream gradient 1) into buffers allocated inside
  `_FusedLinearPolicyLoss`; its backward scales them in place by the incoming gradient and hands them on (the
  linear cross-entropy's design: see `logitless.linear_cross_entropy`). Token level: three GEMMs in all;
  sequence level: four (the whole sequence's ratio is needed before any gradient).
* recompute (float16 under "auto", or ``schedule="recompute"``): ``logitless::linear_policy_loss_forward`` keeps
  the per-token logp and lse; its registered backward ``logitless::linear_policy_loss_backward`` recomputes the
  logits chunk by chunk with the incoming gradient applied: four GEMMs, and a float16 gradient formed with a loss
  scaler's factor (which arrives only in the backward) does not flush to zero.

`linear_selective_log_softmax` is a custom op whose registered backward recomputes the logits (its upstream
gradient is per token, known only in the backward).
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from . import _C
from ._autograd import DEFAULT_MEMORY_BUDGET, SCHEDULES, cached, custom_op, enum, no_double_backward, scale_saved
from ._checks import check_bias, check_float, check_index_dtype, check_int64, check_rows, check_tensors, register_fake
from ._tensor import descriptor, rows_ready, stream, workspace
from .heads import refuse_sharded_weight
from .policy_loss import _MASK_DTYPES, IMPORTANCE_SAMPLING_LEVELS, LOSS_TYPES, PolicyLossOutputs, _as, _check_mask_dtype

__all__ = ["linear_grpo_loss", "linear_selective_log_softmax"]

# ----------------------------------------------------------------------------------------------------
# Calls into C++. The policy ops take, after their tensors, the arguments of `_options` in its order (custom ops
# take plain scalars).

_PASS_FORWARD, _PASS_FORWARD_BACKWARD, _PASS_BACKWARD = 0, 1, 2


def _options(loss_type: int, level: int, beta: float, eps_low: float, eps_high: float, temperature: float,
             max_completion_length: int, num_items_in_batch: float, check_ids: bool, chunk_tokens: int,
             memory_budget: int) -> _C.LinearPolicyLossOptions:
    """The policy ops' option arguments (loss_type and level as the C++ enum values) as the binding's
    LinearPolicyLossOptions, field by field by name (the row kernel's tiles stay the planner's choice)."""
    policy = _C.PolicyLossOptions(loss_type=loss_type, importance_sampling_level=level, beta=beta, eps_low=eps_low,
                                  eps_high=eps_high, temperature=temperature,
                                  max_completion_length=max_completion_length,
                                  num_items_in_batch=num_items_in_batch, check_ids=check_ids)
    return _C.LinearPolicyLossOptions(policy=policy, chunk_tokens=chunk_tokens, memory_budget=memory_budget)


_cached_options = cached(_options)


def _selective_options(temperature: float, check_ids: bool, chunk_tokens: int,
                       memory_budget: int) -> _C.LinearSelectiveLogSoftmaxOptions:
    """The selective ops' option arguments as the binding's LinearSelectiveLogSoftmaxOptions."""
    return _C.LinearSelectiveLogSoftmaxOptions(temperature=temperature, check_ids=check_ids,
                                               chunk_tokens=chunk_tokens, memory_budget=memory_budget)


def _outputs(hidden: Tensor, ids: Tensor, want_per_token: bool, want_entropy: bool):
    # (loss, per_token_loss, kl, is_clipped, logp, entropy, lse): logp and lse always (the recompute backward
    # reads them); the others empty unless asked for (a custom op cannot return None).
    f32 = dict(dtype=torch.float32, device=hidden.device)
    shape = ids.shape if want_per_token else (0,)
    return (torch.empty((), **f32), torch.empty(shape, **f32), torch.empty(shape, **f32),
            torch.empty(shape, dtype=torch.bool, device=hidden.device), torch.empty(ids.shape, **f32),
            torch.empty(ids.shape if want_entropy else (0,), **f32), torch.empty(ids.shape, **f32))


def _grad_outputs(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], need_hidden: bool, need_weight: bool,
                  need_bias: bool) -> Tuple[Tensor, Tensor, Tensor]:
    # Fresh contiguous buffers (grad_hidden's positions then have one stride); a gradient nobody needs is empty.
    def make(like: Optional[Tensor], need: bool) -> Tensor:
        if like is None or not need:
            return torch.empty(0, dtype=hidden.dtype, device=hidden.device)
        return torch.empty(like.shape, dtype=like.dtype, device=like.device)

    return make(hidden, need_hidden), make(weight, need_weight), make(bias, need_bias)


def _inputs(hidden, weight, bias, ids, adv, mask, old, ref):
    return [descriptor(hidden, "hidden"), descriptor(weight, "weight"), descriptor(bias, "bias"),
            descriptor(ids, "completion_ids"), descriptor(adv, "advantages"), descriptor(mask, "completion_mask"),
            descriptor(old, "old_logp"), descriptor(ref, "ref_logp")]


def _out_descriptors(outs, want_per_token: bool, want_entropy: bool):
    loss, ptl, kl, clipped, logp, entropy, lse = outs
    d = [descriptor(loss, "loss")]
    d += [descriptor(t, n) if want_per_token else None
          for t, n in ((ptl, "per_token_loss"), (kl, "kl"), (clipped, "is_clipped"))]
    d += [descriptor(logp, "logp"), descriptor(entropy, "entropy") if want_entropy else None, descriptor(lse, "lse")]
    return d


def _run(hidden, weight, bias, ids, adv, mask, old, ref, options, want_per_token, want_entropy, grads):
    outs = _outputs(hidden, ids, want_per_token, want_entropy)
    tensors = _inputs(hidden, weight, bias, ids, adv, mask, old, ref)
    out_desc = _out_descriptors(outs, want_per_token, want_entropy)
    if grads is None:
        owner, ws = workspace(_C.linear_policy_loss_workspace_bytes(_PASS_FORWARD, *tensors, options, None, None, None),
                              hidden.device)
        _C.linear_policy_loss_forward(*tensors, options, *out_desc, ws, stream(hidden.device))
    else:
        g = [descriptor(t, n) if t is not None else None
             for t, n in zip(grads, ("grad_hidden", "grad_weight", "grad_bias"))]
        owner, ws = workspace(_C.linear_policy_loss_workspace_bytes(_PASS_FORWARD_BACKWARD, *tensors, options, *g),
                              hidden.device)
        _C.linear_policy_loss_forward_backward(*tensors, options, *out_desc, *g, None, ws, stream(hidden.device))
    del owner  # freed in stream order: the caching allocator reuses it only for later work on this stream
    return outs


# ----------------------------------------------------------------------------------------------------
# The policy ops.


@custom_op("logitless::linear_policy_loss_forward")
def _forward(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], completion_ids: Tensor, advantages: Tensor,
             completion_mask: Optional[Tensor], old_logp: Optional[Tensor], ref_logp: Optional[Tensor], loss_type: int,
             level: int, beta: float, eps_low: float, eps_high: float, temperature: float, max_completion_length: int,
             num_items_in_batch: float, check_ids: bool, chunk_tokens: int, memory_budget: int, want_per_token: bool,
             want_entropy: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(loss, per_token_loss, kl, is_clipped, logp, entropy, lse): one GEMM over token chunks; logp and lse are
    what the backward needs."""
    options = _cached_options(loss_type, level, beta, eps_low, eps_high, temperature, max_completion_length,
                       num_items_in_batch, check_ids, chunk_tokens, memory_budget)
    return _run(hidden, weight, bias, completion_ids, advantages, completion_mask, old_logp, ref_logp, options,
                want_per_token, want_entropy, None)


@register_fake(_forward)
def _(hidden, weight, bias, completion_ids, *rest):
    return _outputs(hidden, completion_ids, rest[-2], rest[-1])


@custom_op("logitless::linear_policy_loss_forward_backward_out",
           mutates_args=("grad_hidden", "grad_weight", "grad_bias"))
def _forward_backward_out(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], completion_ids: Tensor,
                          advantages: Tensor, completion_mask: Optional[Tensor], old_logp: Optional[Tensor],
                          ref_logp: Optional[Tensor], loss_type: int, level: int, beta: float, eps_low: float,
                          eps_high: float, temperature: float, max_completion_length: int, num_items_in_batch: float,
                          check_ids: bool, chunk_tokens: int, memory_budget: int, want_per_token: bool,
                          want_entropy: bool, grad_hidden: Optional[Tensor], grad_weight: Optional[Tensor],
                          grad_bias: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """As linear_policy_loss_forward, and the gradients of the loss (upstream gradient 1) written into the given
    buffers (None: not computed) in the same call."""
    options = _cached_options(loss_type, level, beta, eps_low, eps_high, temperature, max_completion_length,
                       num_items_in_batch, check_ids, chunk_tokens, memory_budget)
    return _run(hidden, weight, bias, completion_ids, advantages, completion_mask, old_logp, ref_logp, options,
                want_per_token, want_entropy, (grad_hidden, grad_weight, grad_bias))


@register_fake(_forward_backward_out)
def _(hidden, weight, bias, completion_ids, *rest):
    return _outputs(hidden, completion_ids, rest[-5], rest[-4])


@custom_op("logitless::linear_policy_loss_backward")
def _backward(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], completion_ids: Tensor, advantages: Tensor,
              completion_mask: Optional[Tensor], old_logp: Optional[Tensor], ref_logp: Optional[Tensor], logp: Tensor,
              lse: Tensor, grad_loss: Tensor, loss_type: int, level: int, beta: float, eps_low: float,
              eps_high: float, temperature: float, max_completion_length: int, num_items_in_batch: float,
              chunk_tokens: int, memory_budget: int, need_hidden: bool, need_weight: bool,
              need_bias: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """(grad_hidden, grad_weight, grad_bias) times grad_loss (float32 []), from the forward's logp and lse; a
    gradient not needed comes back empty."""
    options = _cached_options(loss_type, level, beta, eps_low, eps_high, temperature, max_completion_length,
                       num_items_in_batch, False, chunk_tokens, memory_budget)
    gh, gw, gb = _grad_outputs(hidden, weight, bias, need_hidden, need_weight, need_bias)
    tensors = _inputs(hidden, weight, bias, completion_ids, advantages, completion_mask, old_logp, ref_logp)
    g = [descriptor(t, n) if need else None
         for t, n, need in ((gh, "grad_hidden", need_hidden), (gw, "grad_weight", need_weight),
                            (gb, "grad_bias", need_bias))]
    owner, ws = workspace(_C.linear_policy_loss_workspace_bytes(_PASS_BACKWARD, *tensors, options, *g), hidden.device)
    _C.linear_policy_loss_backward(*tensors, options, descriptor(logp, "logp"), descriptor(lse, "lse"),
                                   descriptor(grad_loss, "grad_loss"), *g, ws, stream(hidden.device))
    del owner
    return gh, gw, gb


@register_fake(_backward)
def _(hidden, weight, bias, *rest):
    return _grad_outputs(hidden, weight, bias, *rest[-3:])


def _forward_setup(ctx, inputs, output):
    hidden, weight, bias, ids, adv, mask, old, ref, *options = inputs
    _, ptl, kl, clipped, logp, entropy, lse = output
    ctx.mark_non_differentiable(ptl, kl, clipped, logp, entropy, lse)
    ctx.save_for_backward(hidden, weight, bias, ids, adv, mask, old, ref, logp, lse)
    # All but check_ids (the forward checked the ids), want_per_token and want_entropy.
    ctx.options = tuple(options[:8]) + tuple(options[9:11])


def _forward_grad(ctx, grad_loss, *unused):
    no_double_backward("linear_grpo_loss")
    hidden, weight, bias, ids, adv, mask, old, ref, logp, lse = ctx.saved_tensors
    need = ctx.needs_input_grad[:3]
    if not any(need):
        return (None,) * 21
    gh, gw, gb = _backward(hidden, weight, bias, ids, adv, mask, old, ref, logp, lse,
                           grad_loss.to(torch.float32).contiguous(), *ctx.options, need[0], need[1],
                           need[2] and bias is not None)
    return (gh if need[0] else None, gw if need[1] else None, gb if need[2] else None) + (None,) * 18


_forward.register_autograd(_forward_grad, setup_context=_forward_setup)


class _FusedLinearPolicyLoss(torch.autograd.Function):
    """Loss and gradients in the forward; backward scales the saved gradients in place by the incoming one."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, adv, mask, old, ref, *options):
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_bias = bias is not None and ctx.needs_input_grad[2]
        gh, gw, gb = _grad_outputs(hidden, weight, bias, need_hidden, need_weight, need_bias)
        outs = _forward_backward_out(hidden, weight, bias, ids, adv, mask, old, ref, *options,
                                     gh if need_hidden else None, gw if need_weight else None,
                                     gb if need_bias else None)
        ctx.mark_non_differentiable(*outs[1:])
        ctx.needs = (need_hidden, need_weight, need_bias)
        # Saved after they were written: a later write to them (or a second backward over a retained graph, after
        # the in-place scaling below) fails autograd's version check instead of reusing them.
        ctx.save_for_backward(gh, gw, gb)
        return outs

    @staticmethod
    def backward(ctx, grad_loss, *unused):
        no_double_backward("linear_grpo_loss")
        scale = grad_loss.to(torch.float32).contiguous()
        out = [scale_saved(g, scale) if need else None for g, need in zip(ctx.saved_tensors, ctx.needs)]
        return tuple(out) + (None,) * 18


def _check_chunking(chunk_tokens, memory_budget):
    if chunk_tokens is not None and (not isinstance(chunk_tokens, int) or chunk_tokens < 1):
        raise ValueError(f"chunk_tokens: expected a count >= 1 (or None: from memory_budget), got {chunk_tokens!r}")
    if not isinstance(memory_budget, int) or memory_budget < 1:
        raise ValueError(f"memory_budget: expected a number of bytes >= 1, got {memory_budget!r}")
    if chunk_tokens is not None:
        check_int64(chunk_tokens, "chunk_tokens")
    check_int64(memory_budget, "memory_budget")


def linear_grpo_loss(
    hidden: Tensor,
    weight: Tensor,
    completion_ids: Tensor,
    advantages: Tensor,
    *,
    bias: Optional[Tensor] = None,
    completion_mask: Optional[Tensor] = None,
    old_logp: Optional[Tensor] = None,
    ref_logp: Optional[Tensor] = None,
    beta: float = 0.04,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    temperature: float = 1.0,
    loss_type: str = "grpo",
    importance_sampling_level: str = "token",
    max_completion_length: Optional[int] = None,
    num_items_in_batch: Optional[float] = None,
    return_per_token: bool = False,
    check_ids: bool = True,
    schedule: str = "auto",
    chunk_tokens: Optional[int] = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
) -> Union[Tensor, Tuple[Tensor, PolicyLossOutputs]]:
    """`logitless.grpo_loss` of the logits ``hidden @ weight.T (+ bias)``, without the [B, L, V] logits in
    memory: they are computed a chunk of tokens at a time, and the gradients flow to hidden, weight and bias.

    Everything about the loss (the formulas, `loss_type`, `importance_sampling_level`, the mask, old and
    reference log-probs, `beta`, the clip range, `temperature`, `max_completion_length`, `num_items_in_batch`,
    `return_per_token`, `check_ids`, an all-masked batch) is as in `logitless.grpo_loss`, with ``hidden @ weight.T
    + bias`` in the place of the logits.

    Args:
        hidden: [B, L+1, H] float32/float16/bfloat16, the last hidden states over the completion and the position
            after it, as `grpo_loss` takes the logits (position l predicts completion token l; the last position
            is unused: no slicing by the caller), or [B, L, H] already aligned. Any strides with a contiguous last
            dimension (a view ``h[:, -(L + 1):]`` of the whole sequence's states is copied once inside).
        weight: [V, H], hidden's dtype: the lm_head's weight (or the tied embedding).
        completion_ids, advantages: [B, L] ids and [B] advantages, as in `grpo_loss`.
        bias: optional [V], hidden's dtype or float32.
        schedule: "auto", "gradient_in_forward" (the gradients are computed in the forward and the backward only
            scales them) or "recompute" (the forward keeps logp and lse per token, the backward recomputes the
            logits with the incoming gradient applied). "auto" takes gradient_in_forward, and recompute for
            float16 (see the module docstring).
        chunk_tokens: CUDA: positions whose logits' gradient is held at once; None: from `memory_budget`.
        memory_budget: bytes of chunk scratch on CUDA (default 512 MiB; include/logitless/linear_policy_loss.h says
            what comes on top).

    Returns:
        The float32 scalar loss, or ``(loss, PolicyLossOutputs)`` with return_per_token (detached per-token
        values, 0 at masked tokens). Only the loss is differentiable: w.r.t. hidden, weight and bias.

    Raises:
        ValueError: on a bad argument, naming it: shapes that disagree (hidden vs completion_ids, weight's hidden
            size, the mask, log-probs and advantages), an id outside [0, V) at an unmasked token (naming the
            first), beta > 0 without ref_logp, dr_grpo without max_completion_length.

    Autograd: with gradient_in_forward the gradients are computed once and consumed by the backward: a second
    backward through the same call (retain_graph=True) raises torch's "modified by an inplace operation" error;
    use schedule="recompute" for that. Double backward is not supported. Masked tokens' and the unused position's
    hidden rows get gradient 0 (their logits are computed in the GEMMs but never read; those rows must be finite).
    """
    ltype = enum(LOSS_TYPES, loss_type, "loss_type")
    level = enum(IMPORTANCE_SAMPLING_LEVELS, importance_sampling_level, "importance_sampling_level")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule: expected one of {', '.join(map(repr, SCHEDULES))}, got {schedule!r}")
    refuse_sharded_weight(weight, bias, vocab_parallel_remedy=False)
    _check_chunking(chunk_tokens, memory_budget)
    check_tensors((("hidden", hidden), ("weight", weight), ("completion_ids", completion_ids),
                   ("advantages", advantages), ("bias", bias), ("completion_mask", completion_mask),
                   ("old_logp", old_logp), ("ref_logp", ref_logp)),
                  optional=("bias", "completion_mask", "old_logp", "ref_logp"))
    check_bias(bias, weight, hidden)
    if max_completion_length is not None:
        max_completion_length = check_int64(max_completion_length, "max_completion_length")
    check_index_dtype(completion_ids, "completion_ids")
    _check_mask_dtype(completion_mask)
    ids = completion_ids if completion_ids.dtype in (torch.int32, torch.int64) else completion_ids.long()
    adv = advantages.detach().to(torch.float32)
    mask = completion_mask
    if mask is not None:
        mask = mask.detach()
        if mask.dtype not in _MASK_DTYPES:
            mask = mask.to(torch.float32)
    old, ref = _as(old_logp, torch.float32), _as(ref_logp, torch.float32)
    hidden, weight = rows_ready(hidden), rows_ready(weight)
    # The ops' option arguments, in `_options`' order, then want_per_token and want_entropy.
    options = (ltype, level, check_float(beta, "beta"), check_float(eps_low, "eps_low"),
               check_float(eps_high, "eps_high"), check_float(temperature, "temperature"),
               int(max_completion_length or 0), check_float(num_items_in_batch or 0.0, "num_items_in_batch"),
               bool(check_ids), int(chunk_tokens or 0), int(memory_budget), bool(return_per_token),
               bool(return_per_token))

    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad or
                                              (bias is not None and bias.requires_grad))
    recompute = schedule == "recompute" or (schedule == "auto" and hidden.dtype == torch.float16)
    if not needs_grad or recompute:
        outs = _forward(hidden, weight, bias, ids, adv, mask, old, ref, *options)
    else:
        outs = _FusedLinearPolicyLoss.apply(hidden, weight, bias, ids, adv, mask, old, ref, *options)
    loss, ptl, kl, clipped, logp, entropy, _ = outs
    if not return_per_token:
        return loss
    return loss, PolicyLossOutputs(ptl, kl, clipped, logp, entropy)


# ----------------------------------------------------------------------------------------------------
# Selective log-softmax


def _sel_outputs(hidden: Tensor, ids: Tensor, want_entropy: bool, want_top1: bool):
    f32 = dict(dtype=torch.float32, device=hidden.device)
    return (torch.empty(ids.shape, **f32), torch.empty(ids.shape if want_entropy else (0,), **f32),
            torch.empty(ids.shape, **f32),
            torch.empty(ids.shape if want_top1 else (0,), dtype=torch.bool, device=hidden.device))


@custom_op("logitless::linear_selective_log_softmax_forward")
def _sel_forward(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], ids: Tensor, temperature: float,
                 check_ids: bool, chunk_tokens: int, memory_budget: int, want_entropy: bool,
                 want_top1: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(logp, entropy, lse, is_top1) of the logits hidden [*, H] · weightᵀ (+ bias) at ids [*]; entropy and is_top1
    are empty unless asked for."""
    logp, entropy, lse, top1 = _sel_outputs(hidden, ids, want_entropy, want_top1)
    options = _selective_options(temperature, check_ids, chunk_tokens, memory_budget)
    h, w, i = descriptor(hidden, "hidden"), descriptor(weight, "weight"), descriptor(ids, "ids")
    owner, ws = workspace(_C.linear_selective_log_softmax_workspace_bytes(_PASS_FORWARD, h, w, i, options, None, None,
                                                                          None), hidden.device)
    _C.linear_selective_log_softmax_forward(h, w, descriptor(bias, "bias"), i, options, descriptor(logp, "logp"),
                                            descriptor(entropy, "entropy") if want_entropy else None,
                                            descriptor(lse, "lse"), descriptor(top1, "is_top1") if want_top1 else None,
                                            ws, stream(hidden.device))
    del owner
    return logp, entropy, lse, top1


@register_fake(_sel_forward)
def _(hidden, weight, bias, ids, temperature, check_ids, chunk_tokens, memory_budget, want_entropy, want_top1):
    return _sel_outputs(hidden, ids, want_entropy, want_top1)


@custom_op("logitless::linear_selective_log_softmax_backward")
def _sel_backward(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], ids: Tensor, lse: Tensor, grad_logp: Tensor,
                  temperature: float, chunk_tokens: int, memory_budget: int, need_hidden: bool, need_weight: bool,
                  need_bias: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """(grad_hidden, grad_weight, grad_bias) of sum(grad_logp * logp), from the forward's lse."""
    gh, gw, gb = _grad_outputs(hidden, weight, bias, need_hidden, need_weight, need_bias)
    options = _selective_options(temperature, False, chunk_tokens, memory_budget)
    h, w, i = descriptor(hidden, "hidden"), descriptor(weight, "weight"), descriptor(ids, "ids")
    g = [descriptor(t, n) if need else None
         for t, n, need in ((gh, "grad_hidden", need_hidden), (gw, "grad_weight", need_weight),
                            (gb, "grad_bias", need_bias))]
    owner, ws = workspace(_C.linear_selective_log_softmax_workspace_bytes(_PASS_BACKWARD, h, w, i, options, *g),
                          hidden.device)
    _C.linear_selective_log_softmax_backward(h, w, descriptor(bias, "bias"), i, descriptor(lse, "lse"),
                                             descriptor(grad_logp, "grad_logp"), options, *g, ws,
                                             stream(hidden.device))
    del owner
    return gh, gw, gb


@register_fake(_sel_backward)
def _(hidden, weight, bias, *rest):
    return _grad_outputs(hidden, weight, bias, *rest[-3:])


def _sel_setup(ctx, inputs, output):
    hidden, weight, bias, ids, temperature, check_ids, chunk_tokens, memory_budget, want_entropy, want_top1 = inputs
    _, entropy, lse, top1 = output
    ctx.mark_non_differentiable(entropy, lse, top1)
    ctx.save_for_backward(hidden, weight, bias, ids, lse)
    ctx.options = (temperature, chunk_tokens, memory_budget)


def _sel_grad(ctx, grad_logp, grad_entropy, grad_lse, grad_top1):
    no_double_backward("linear_selective_log_softmax")
    hidden, weight, bias, ids, lse = ctx.saved_tensors
    need = ctx.needs_input_grad[:3]
    if not any(need):
        return (None,) * 10
    gh, gw, gb = _sel_backward(hidden, weight, bias, ids, lse, grad_logp.to(torch.float32).contiguous(),
                               *ctx.options, need[0], need[1], need[2] and bias is not None)
    return (gh if need[0] else None, gw if need[1] else None, gb if need[2] else None) + (None,) * 7


_sel_forward.register_autograd(_sel_grad, setup_context=_sel_setup)


def linear_selective_log_softmax(hidden: Tensor, weight: Tensor, ids: Tensor, bias: Optional[Tensor] = None,
                                 temperature: float = 1.0, return_entropy: bool = False, *, return_top1: bool = False,
                                 check_ids: bool = True, chunk_tokens: Optional[int] = None,
                                 memory_budget: int = DEFAULT_MEMORY_BUDGET) -> Union[Tensor, Tuple[Tensor, ...]]:
    """``log_softmax((hidden @ weight.T + bias) / temperature, -1).gather(-1, ids[..., None])[..., 0]`` without the
    [*, V] logits in memory (a chunk of tokens at a time): the old-policy and reference log-probs of GRPO from
    hidden states.

    Args:
        hidden: [*, H] float32/float16/bfloat16, at most 8 dimensions (a last dimension that is not contiguous
            is copied); no shift is applied (pass ``h[:, :-1]`` with ``ids[:, 1:]``-style aligned views). hidden's
            and ids' leading dimensions may each have any strides that collapse to at most 3 strided dimensions
            (as in `logitless.linear_cross_entropy`).
        weight: [V, H], hidden's dtype. bias: optional [V], hidden's dtype or float32.
        ids: [*] int32/int64, hidden's leading shape, every id in [0, V) (a ValueError names the first bad row).
        temperature: > 0. return_entropy: also return the entropy per row (not differentiated).
        return_top1: also return whether each id is the top-1 class, ``(hidden @ weight.T + bias).argmax(-1) == ids``
            (the first maximum wins a tie, as torch.argmax), computed in the same pass over the logits as logp: a
            bool tensor, not differentiated. A row with a NaN logit gives False. On CUDA two classes whose float32
            logits are equal count as a tie even where exact arithmetic would separate them.
        chunk_tokens, memory_budget: CUDA chunking, as in `linear_grpo_loss`.

    Returns:
        logp [*] float32, differentiable w.r.t. hidden, weight and bias (the backward recomputes the logits); with
        return_entropy and/or return_top1, ``(logp, entropy)``, ``(logp, is_top1)`` or ``(logp, entropy, is_top1)``.
    """
    refuse_sharded_weight(weight, bias, vocab_parallel_remedy=False)
    _check_chunking(chunk_tokens, memory_budget)
    check_tensors((("hidden", hidden), ("weight", weight), ("ids", ids), ("bias", bias)), optional=("bias",))
    check_bias(bias, weight, hidden)
    check_index_dtype(ids, "ids")
    if ids.dtype not in (torch.int32, torch.int64):
        ids = ids.long()
    hidden, weight = rows_ready(hidden), rows_ready(weight)
    check_rows(hidden.dim() - 1, (("hidden", hidden), ("ids", ids)), jointly=False)
    logp, entropy, _, top1 = _sel_forward(hidden, weight, bias, ids, check_float(temperature, "temperature"),
                                          bool(check_ids), int(chunk_tokens or 0), int(memory_budget),
                                          bool(return_entropy), bool(return_top1))
    outs = (logp,) + ((entropy,) if return_entropy else ()) + ((top1,) if return_top1 else ())
    return outs if len(outs) > 1 else logp
