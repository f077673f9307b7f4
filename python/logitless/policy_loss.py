"""Policy-gradient losses over logits (GRPO, BNPO, Dr. GRPO, DAPO; PPO-clip at the token level or GSPO's ratio
at the sequence level; k3 KL penalty) and selective log-softmax: the torch ops (custom_op + fake + autograd)
and the public functions `grpo_loss` and `selective_log_softmax`.

Schedules, chosen by `grpo_loss` from what autograd needs:

* no gradient needed: ``logitless::policy_loss_forward``, one read of the unmasked rows.
* with a gradient: the gradient of the loss (upstream gradient 1) is computed in the forward by
  ``logitless::policy_loss_forward_backward_out`` into a fresh buffer, or by
  ``logitless::policy_loss_forward_backward_`` over the logits themselves (``inplace_backward=True``), and saved;
  the backward multiplies it by the incoming gradient in place with ``logitless::scale_rows_`` (the
  cross-entropy family's op), which skips the work when that gradient is exactly 1, so the usual
  ``loss.backward()`` costs one small launch. At the token level the forward reads each unmasked row once and
  writes its gradient in the same pass; at the sequence level it reads the rows twice (statistics, then the
  gradient from the saved log-sum-exp, once every sequence's ratio is known).

`selective_log_softmax` is a custom op whose registered backward recomputes the gradient from the saved
log-sum-exp (one read of the logits, one write).

In place, the op that overwrites the logits declares the mutation, so any other autograd node that saved them
raises torch's "modified by an inplace operation" error in its backward instead of using the gradient.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple, Union

import torch
from torch import Tensor

from . import _C
from ._autograd import cached, custom_op, enum, no_double_backward, scale_saved
from ._checks import (
    check_float,
    check_index_dtype,
    check_int64,
    check_rows,
    check_tensors,
    check_writable_rows,
    register_fake,
)
from ._tensor import descriptor, stream, workspace

__all__ = ["grpo_loss", "selective_log_softmax", "PolicyLossOutputs", "LOSS_TYPES", "IMPORTANCE_SAMPLING_LEVELS"]

# Must match logitless::PolicyLossType, ImportanceSamplingLevel and PolicyLossAlgo (include/logitless/policy_loss.h).
LOSS_TYPES = {"grpo": 0, "bnpo": 1, "dr_grpo": 2, "dapo": 3}
IMPORTANCE_SAMPLING_LEVELS = {"token": 0, "sequence": 1}
ALGOS = {"auto": 0, "streaming": 1, "cluster": 2, "row_resident": 3}

_MASK_DTYPES = (torch.bool, torch.uint8, torch.int32, torch.int64, torch.float32)


class PolicyLossOutputs(NamedTuple):
    """Per-token values, [B, L] each; masked tokens hold 0 (False). Detached: only the loss is differentiable."""

    per_token_loss: Tensor  # float32, -min(r A, clip(r) A) + beta kl (unweighted by the mask)
    kl: Tensor  # float32, k3 estimator of KL(policy || reference); 0 without ref_logp
    is_clipped: Tensor  # bool, the clip is active (the ratio term passes no gradient)
    logp: Tensor  # float32, log-probability of the completion token at temperature
    entropy: Tensor  # float32, entropy of the token's distribution at temperature


# ----------------------------------------------------------------------------------------------------
# Calls into C++. Outputs are allocated with torch (so CUDA graphs and the caching allocator see them) and run on
# torch's current stream. After the tensors, the policy ops take the arguments of `_options` in its order (custom
# ops take plain scalars), then want_per_token and want_entropy.


def _options(loss_type: int, level: int, beta: float, eps_low: float, eps_high: float, temperature: float,
             max_completion_length: int, num_items_in_batch: float, check_ids: bool, algo: int, cluster_size: int,
             threads: int) -> _C.PolicyLossOptions:
    """The policy ops' option arguments (loss_type, level and algo as the C++ enum values) as the binding's
    PolicyLossOptions, field by field by name."""
    return _C.PolicyLossOptions(loss_type=loss_type, importance_sampling_level=level, beta=beta, eps_low=eps_low,
                                eps_high=eps_high, temperature=temperature,
                                max_completion_length=max_completion_length, num_items_in_batch=num_items_in_batch,
                                check_ids=check_ids, algo=algo, cluster_size=cluster_size, threads=threads)


_cached_options = cached(_options)


def _policy_outputs(logits: Tensor, ids: Tensor, want_per_token: bool, want_entropy: bool):
    # (loss, per_token_loss, kl, is_clipped, logp, entropy); the ones not asked for are empty (a custom op cannot
    # return None).
    f32 = dict(dtype=torch.float32, device=logits.device)
    shape = ids.shape if want_per_token else (0,)
    loss = torch.empty((), **f32)
    per_token = [torch.empty(shape, **f32), torch.empty(shape, **f32),
                 torch.empty(shape, dtype=torch.bool, device=logits.device), torch.empty(shape, **f32)]
    entropy = torch.empty(ids.shape if want_entropy else (0,), **f32)
    return (loss, *per_token, entropy)


def _views(outs, want_per_token: bool, want_entropy: bool):
    loss, ptl, kl, clipped, logp, entropy = outs
    if not want_per_token:
        ptl = kl = clipped = logp = None
    return [loss, ptl, kl, clipped, logp, entropy if want_entropy else None]


def _run_policy(logits, ids, adv, mask, old, ref, options, want_per_token, want_entropy, grad):
    outs = _policy_outputs(logits, ids, want_per_token, want_entropy)
    tensors = [descriptor(logits, "logits"), descriptor(ids, "completion_ids"), descriptor(adv, "advantages"),
               descriptor(mask, "completion_mask"), descriptor(old, "old_logp"), descriptor(ref, "ref_logp")]
    owner, ws = workspace(_C.policy_loss_workspace_bytes(*tensors, options), logits.device)
    views = _views(outs, want_per_token, want_entropy)
    names = ["loss", "per_token_loss", "kl", "is_clipped", "logp", "entropy"]
    out_desc = [descriptor(t, n) for t, n in zip(views, names)] + [None]  # lse: not kept
    if grad is None:
        _C.policy_loss_forward(*tensors, options, *out_desc, ws, stream(logits.device))
    else:
        _C.policy_loss_forward_backward(*tensors, options, *out_desc, descriptor(grad, "grad_logits"), None, ws,
                                        stream(logits.device))
    del owner  # freed in stream order: the caching allocator reuses it only for later work on this stream
    return outs


@custom_op("logitless::policy_loss_forward")
def _policy_forward(logits: Tensor, completion_ids: Tensor, advantages: Tensor, completion_mask: Optional[Tensor],
                    old_logp: Optional[Tensor], ref_logp: Optional[Tensor], loss_type: int, level: int, beta: float,
                    eps_low: float, eps_high: float, temperature: float, max_completion_length: int,
                    num_items_in_batch: float, check_ids: bool, algo: int, cluster_size: int, threads: int,
                    want_per_token: bool, want_entropy: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(loss, per_token_loss, kl, is_clipped, logp, entropy), one read of the unmasked rows; the per-token
    outputs are empty unless asked for."""
    options = _cached_options(loss_type, level, beta, eps_low, eps_high, temperature, max_completion_length,
                       num_items_in_batch, check_ids, algo, cluster_size, threads)
    return _run_policy(logits, completion_ids, advantages, completion_mask, old_logp, ref_logp, options,
                       want_per_token, want_entropy, None)


@register_fake(_policy_forward)
def _(logits, completion_ids, *rest):
    return _policy_outputs(logits, completion_ids, rest[-2], rest[-1])


@custom_op("logitless::policy_loss_forward_backward_out", mutates_args=("grad_logits",))
def _policy_forward_backward_out(logits: Tensor, completion_ids: Tensor, advantages: Tensor,
                                 completion_mask: Optional[Tensor], old_logp: Optional[Tensor],
                                 ref_logp: Optional[Tensor], loss_type: int, level: int, beta: float, eps_low: float,
                                 eps_high: float, temperature: float, max_completion_length: int,
                                 num_items_in_batch: float, check_ids: bool, algo: int, cluster_size: int,
                                 threads: int, want_per_token: bool, want_entropy: bool,
                                 grad_logits: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """As policy_loss_forward, and the gradient of the loss (upstream gradient 1) written into `grad_logits`
    (the logits' shape and dtype, memory apart from them)."""
    options = _cached_options(loss_type, level, beta, eps_low, eps_high, temperature, max_completion_length,
                       num_items_in_batch, check_ids, algo, cluster_size, threads)
    return _run_policy(logits, completion_ids, advantages, completion_mask, old_logp, ref_logp, options,
                       want_per_token, want_entropy, grad_logits)


@register_fake(_policy_forward_backward_out)
def _(logits, completion_ids, *rest):
    return _policy_outputs(logits, completion_ids, rest[-3], rest[-2])


@custom_op("logitless::policy_loss_forward_backward_", mutates_args=("logits",))
def _policy_forward_backward_inplace(logits: Tensor, completion_ids: Tensor, advantages: Tensor,
                                     completion_mask: Optional[Tensor], old_logp: Optional[Tensor],
                                     ref_logp: Optional[Tensor], loss_type: int, level: int, beta: float,
                                     eps_low: float, eps_high: float, temperature: float,
                                     max_completion_length: int, num_items_in_batch: float, check_ids: bool,
                                     algo: int, cluster_size: int, threads: int, want_per_token: bool,
                                     want_entropy: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """As policy_loss_forward_backward_out, with the gradient written over `logits` (no extra logits-sized
    memory; the unused last position becomes 0 too)."""
    options = _cached_options(loss_type, level, beta, eps_low, eps_high, temperature, max_completion_length,
                       num_items_in_batch, check_ids, algo, cluster_size, threads)
    return _run_policy(logits, completion_ids, advantages, completion_mask, old_logp, ref_logp, options,
                       want_per_token, want_entropy, logits)


@register_fake(_policy_forward_backward_inplace)
def _(logits, completion_ids, *rest):
    return _policy_outputs(logits, completion_ids, rest[-2], rest[-1])


class _FusedPolicyLoss(torch.autograd.Function):
    """Loss and gradient in the forward; backward scales the saved gradient in place by the incoming one.

    An autograd.Function around mutating ops, as cross_entropy's fused schedule (its docstring says why): the
    buffer scaled in backward is allocated inside forward and never leaves it, or is the logits, whose overwrite
    the op declares.
    """

    @staticmethod
    def forward(ctx, logits, completion_ids, advantages, completion_mask, old_logp, ref_logp, inplace, *options):
        if inplace:
            outs = _policy_forward_backward_inplace(logits, completion_ids, advantages, completion_mask, old_logp,
                                                    ref_logp, *options)
            grad = logits
        else:
            grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
            outs = _policy_forward_backward_out(logits, completion_ids, advantages, completion_mask, old_logp,
                                                ref_logp, *options, grad)
        ctx.mark_non_differentiable(*outs[1:])
        # Saved after the mutation: this node's own version check passes, and a later write to the buffer (or a
        # second backward over a retained graph, after the scaling below) is caught.
        ctx.save_for_backward(grad)
        return outs

    @staticmethod
    def backward(ctx, grad_loss, *unused):
        no_double_backward("grpo_loss")
        (grad,) = ctx.saved_tensors
        return (scale_saved(grad, grad_loss.to(torch.float32).contiguous()),) + (None,) * 20


def _as(t: Optional[Tensor], dtype: torch.dtype, copy: bool = False) -> Optional[Tensor]:
    return None if t is None else t.detach().to(dtype, copy=copy)


def _check_mask_dtype(mask: Optional[Tensor]) -> None:
    # Other dtypes are converted to float32 weights; a complex one would lose its imaginary part silently.
    if mask is not None and mask.dtype.is_complex:
        raise ValueError(f"completion_mask: expected bool, integer or real float token weights, got {mask.dtype}")


def grpo_loss(
    logits: Tensor,
    completion_ids: Tensor,
    advantages: Tensor,
    *,
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
    inplace_backward: bool = False,
    return_per_token: bool = False,
    check_ids: bool = True,
    algo: str = "auto",
) -> Union[Tensor, Tuple[Tensor, PolicyLossOutputs]]:
    """The GRPO-family policy loss over the policy's logits, fused: no log-softmax, probabilities or per-token
    graph is materialized; the gradient w.r.t. the logits is written in the same pass that reads them.

    Per token (b, l) with weight w = completion_mask[b, l], A = advantages[b], x = logits / temperature::

        logp  = log_softmax(x)[completion_ids[b, l]]
        ratio = exp(logp - old_logp)                         importance_sampling_level="token" (PPO-clip)
              = exp(sum_l w (logp - old_logp) / max(sum_l w, 1))  "sequence" (GSPO), shared by the sequence
        kl    = exp(ref_logp - logp) - (ref_logp - logp) - 1      (k3; 0 without ref_logp)
        per_token_loss = -min(ratio A, clamp(ratio, 1 - eps_low, 1 + eps_high) A) + beta kl

    Without `old_logp` the ratio is ``exp(logp - logp.detach())``: 1, with the gradient of logp (a single update
    per generation, as in the seed notebook and TRL). The loss reduces ``w * per_token_loss`` by `loss_type`
    (denominators that count tokens are clamped at 1, as TRL clamps them):

    * ``"grpo"``: mean over each sequence's tokens, then over the B sequences.
    * ``"bnpo"``: sum over all tokens / max(sum of w, 1).
    * ``"dr_grpo"``: sum / (B * max_completion_length); `max_completion_length` is required.
    * ``"dapo"``: sum / num_items_in_batch, TRL's normalizer: the number of completion tokens of the whole
      optimizer step (every gradient-accumulation micro-batch) divided by the number of processes. Without
      `num_items_in_batch` it is this batch's token count and dapo equals bnpo; with it, every micro-batch of a
      step shares one normalizer, where bnpo normalizes each by its own count.

    An all-masked batch (or sequence) contributes loss 0 and gradient 0 (where the same formulas in torch would
    give 0/0 for an unclamped mean).

    Args:
        logits: [B, L+1, V] float32/float16/bfloat16, the model's output for the completion with the position
            after it (``model(..., logits_to_keep=L + 1).logits``): position l predicts completion token l and the
            last position is unused — the shift is implicit, no slicing or copy. [B, L, V] (already aligned) is
            accepted too. The last dimension must be contiguous; the others may have any strides.
        completion_ids: [B, L] int32/int64 (any strides, e.g. ``input_ids[:, -L:]``). Ids at masked tokens are
            never read, so padding may hold anything.
        advantages: [B], one per sequence.
        completion_mask: [B, L] bool / integer / float token weights (0 = masked), or None for all ones.
        old_logp: [B, L] log-probabilities of the completion under the sampling policy (e.g. from
            `selective_log_softmax` under ``torch.no_grad()``), or None.
        ref_logp: [B, L] log-probabilities under the reference model; required when beta > 0.
        beta: weight of the KL penalty (>= 0).
        eps_low, eps_high: the clip range [1 - eps_low, 1 + eps_high] (DAPO's clip-higher: eps_high > eps_low).
        temperature: the logits are divided by it (> 0), as the sampler did.
        loss_type, importance_sampling_level, max_completion_length, num_items_in_batch: see above.
        inplace_backward: write the gradient into the storage of `logits` during the forward (no extra
            logits-sized memory). Afterwards `logits` holds the gradient (0 at masked tokens and at the last
            position), not the logits: do not read it. A node that saved `logits` raises "modified by an inplace
            operation" in backward. `logits` must not be a leaf that requires grad. Ignored when no gradient is
            needed.
        return_per_token: also return a `PolicyLossOutputs` of per-token values (including the entropy, which
            costs a few more operations per logit, still within a memory-bound pass).
        check_ids: check that unmasked ids are in [0, V) (on CUDA this reads one number back per call; skipped
            during CUDA graph capture, where a bad token's values and gradient row are NaN instead).
        algo: CUDA kernel choice, for tests and benchmarks: "auto", "streaming", "cluster" or "row_resident"
            (both Hopper; row_resident keeps each row in shared memory for the fused gradient pass).

    Returns:
        The float32 scalar loss, or ``(loss, PolicyLossOutputs)`` with return_per_token. Only the loss is
        differentiable, and only w.r.t. `logits` (advantages, old and reference log-probs are constants of the
        loss, as in every trainer); the entropy is reported, never differentiated.

    Raises:
        ValueError: on a bad argument, naming it: shapes that disagree (logits vs completion_ids, the mask, the
            log-probs and advantages), an id outside [0, V) at an unmasked token (naming the first), beta > 0
            without ref_logp, dr_grpo without max_completion_length.

    Autograd: the gradient is computed in the forward and the backward only scales it (in place), so it can be
    consumed once: a second backward through the same call (retain_graph=True) raises torch's "modified by an
    inplace operation" error. Double backward (create_graph=True) is not supported.
    """
    ltype = enum(LOSS_TYPES, loss_type, "loss_type")
    level = enum(IMPORTANCE_SAMPLING_LEVELS, importance_sampling_level, "importance_sampling_level")
    algo_code = enum(ALGOS, algo, "algo")
    check_tensors((("logits", logits), ("completion_ids", completion_ids), ("advantages", advantages),
                   ("completion_mask", completion_mask), ("old_logp", old_logp), ("ref_logp", ref_logp)),
                  optional=("completion_mask", "old_logp", "ref_logp"))
    if max_completion_length is not None:
        max_completion_length = check_int64(max_completion_length, "max_completion_length")
    check_index_dtype(completion_ids, "completion_ids")
    _check_mask_dtype(completion_mask)
    needs_grad = torch.is_grad_enabled() and logits.requires_grad
    # Where the gradient overwrites the logits, every other input is read from a copy: one that shares their memory
    # (a view of them, or a float32 tensor that .to() hands back as is) would be read while it is overwritten.
    # They are [B, L] or [B]: nothing next to the [B, L, V] logits.
    copy = bool(inplace_backward) and needs_grad
    ids = completion_ids if completion_ids.dtype in (torch.int32, torch.int64) else completion_ids.long()
    ids = ids.clone() if copy else ids
    adv = advantages.detach().to(torch.float32, copy=copy)
    mask = completion_mask
    if mask is not None:
        mask = mask.detach()
        mask = mask.to(mask.dtype if mask.dtype in _MASK_DTYPES else torch.float32, copy=copy)
    old, ref = _as(old_logp, torch.float32, copy), _as(ref_logp, torch.float32, copy)
    # The ops' option arguments, in `_options`' order, then want_per_token and want_entropy.
    opts = (ltype, level, check_float(beta, "beta"), check_float(eps_low, "eps_low"),
            check_float(eps_high, "eps_high"), check_float(temperature, "temperature"),
            int(max_completion_length or 0), check_float(num_items_in_batch or 0.0, "num_items_in_batch"),
            bool(check_ids), algo_code, 0, 0, bool(return_per_token), bool(return_per_token))

    if not needs_grad:
        outs = _policy_forward(logits, ids, adv, mask, old, ref, *opts)
    else:
        # Overwriting a leaf that requires grad (or a view of one) would destroy a parameter and hand autograd
        # its own storage as the gradient; torch refuses in-place ops there too.
        owner = logits._base if logits._base is not None else logits
        if inplace_backward and owner.is_leaf and owner.requires_grad:
            raise ValueError("logits: inplace_backward=True needs logits computed by an op (e.g. a matmul); got a "
                             "leaf tensor that requires grad (or a view of one), whose values it would overwrite")
        if inplace_backward:
            check_writable_rows(logits, "logits", "inplace_backward=True")
        outs = _FusedPolicyLoss.apply(logits, ids, adv, mask, old, ref, bool(inplace_backward), *opts)
    loss = outs[0]
    if not return_per_token:
        return loss
    return loss, PolicyLossOutputs(*outs[1:])


# ----------------------------------------------------------------------------------------------------
# Selective log-softmax


def _selective_outputs(logits: Tensor, ids: Tensor, want_entropy: bool):
    f32 = dict(dtype=torch.float32, device=logits.device)
    return (torch.empty(ids.shape, **f32), torch.empty(ids.shape if want_entropy else (0,), **f32),
            torch.empty(ids.shape, **f32))


@custom_op("logitless::selective_log_softmax_forward")
def _selective_forward(logits: Tensor, ids: Tensor, temperature: float, check_ids: bool,
                       want_entropy: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """(logp, entropy, lse) of logits [*, V] at ids [*]; entropy is empty unless asked for."""
    logp, entropy, lse = _selective_outputs(logits, ids, want_entropy)
    ld, idd = descriptor(logits, "logits"), descriptor(ids, "ids")
    options = _C.SelectiveLogSoftmaxOptions(temperature=temperature, check_ids=check_ids)
    owner, ws = workspace(_C.selective_log_softmax_workspace_bytes(ld, idd, options), logits.device)
    _C.selective_log_softmax_forward(ld, idd, options, descriptor(logp, "logp"),
                                     descriptor(entropy, "entropy") if want_entropy else None,
                                     descriptor(lse, "lse"), ws, stream(logits.device))
    del owner
    return logp, entropy, lse


@register_fake(_selective_forward)
def _(logits, ids, temperature, check_ids, want_entropy):
    return _selective_outputs(logits, ids, want_entropy)


@custom_op("logitless::selective_log_softmax_backward")
def _selective_backward(logits: Tensor, ids: Tensor, lse: Tensor, grad_logp: Tensor, temperature: float) -> Tensor:
    """grad_logits = grad_logp ([j == id] - p_j) / temperature from the forward's lse."""
    grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    ld, idd = descriptor(logits, "logits"), descriptor(ids, "ids")
    # The workspace is sized without the id check (the forward checked the ids); the backward call itself keeps
    # check_ids at its default.
    owner, ws = workspace(_C.selective_log_softmax_workspace_bytes(
        ld, idd, _C.SelectiveLogSoftmaxOptions(temperature=temperature, check_ids=False)), logits.device)
    _C.selective_log_softmax_backward(ld, idd, descriptor(lse, "lse"), descriptor(grad_logp, "grad_logp"),
                                      _C.SelectiveLogSoftmaxOptions(temperature=temperature),
                                      descriptor(grad, "grad_logits"), ws, stream(logits.device))
    del owner
    return grad


@register_fake(_selective_backward)
def _(logits, ids, lse, grad_logp, temperature):
    return torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)


def _selective_setup(ctx, inputs, output):
    logits, ids, temperature, check_ids, want_entropy = inputs
    _, entropy, lse = output
    ctx.mark_non_differentiable(entropy, lse)
    ctx.save_for_backward(logits, ids, lse)
    ctx.temperature = temperature


def _selective_grad(ctx, grad_logp, grad_entropy, grad_lse):
    no_double_backward("selective_log_softmax")
    logits, ids, lse = ctx.saved_tensors
    grad = None
    if ctx.needs_input_grad[0]:
        grad = _selective_backward(logits, ids, lse, grad_logp.to(torch.float32).contiguous(), ctx.temperature)
    return grad, None, None, None, None


_selective_forward.register_autograd(_selective_grad, setup_context=_selective_setup)


def selective_log_softmax(logits: Tensor, ids: Tensor, temperature: float = 1.0, return_entropy: bool = False,
                          *, check_ids: bool = True) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """``log_softmax(logits / temperature, -1).gather(-1, ids[..., None])[..., 0]`` without the [*, V]
    log-softmax: the old-policy and reference log-probs of GRPO (one read of the logits, float32 result).

    Args:
        logits: [*, V] float32/float16/bfloat16, at most 8 dimensions, last dimension contiguous; no shift is
            applied: pass ``logits[:, :-1]`` with ``ids[:, 1:]``-style aligned views, no copy needed. The leading
            dimensions may have any strides as long as they collapse, jointly with ids', to at most 3 strided
            dimensions (size-1 dimensions dropped, neighbours merged where contiguous in both; any view of a tensor
            of up to 4 dimensions qualifies; otherwise a ValueError names the tensor to make contiguous).
        ids: [*] int32/int64, every id in [0, V) (a ValueError names the first bad row), strides as above.
        temperature: > 0.
        return_entropy: also return the entropy of softmax(logits / temperature) per row (not differentiated).

    Returns:
        logp [*] float32 (differentiable w.r.t. logits: the backward reads the logits once and writes the
        gradient once, from the saved log-sum-exp), or ``(logp, entropy)``.
    """
    check_tensors((("logits", logits), ("ids", ids)))
    check_index_dtype(ids, "ids")
    check_rows(logits.dim() - 1, (("logits", logits), ("ids", ids)))
    if ids.dtype not in (torch.int32, torch.int64):
        ids = ids.long()
    logp, entropy, _ = _selective_forward(logits, ids, check_float(temperature, "temperature"), bool(check_ids),
                                          bool(return_entropy))
    return (logp, entropy) if return_entropy else logp
