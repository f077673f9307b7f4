"""Losses computed from a linear head's weight without calling the head: how to keep a sharding wrapper in the loop.

The fused losses take the head's ``weight`` tensor and never call the head module, so nothing that hooks the
module's call runs: FSDP2's ``fully_shard`` (which all-gathers a unit's parameters in a pre-forward hook and
reduce-scatters their gradients in a post-backward hook) and DeepSpeed ZeRO-3 (which gathers a partitioned
parameter around the module's forward) would leave the weight sharded or empty, and its gradient unreduced.

`through_module` runs a function *as* a module's forward (forward redirection): inside ``module(*args)``, so
every hook runs around it; `linear_head_loss` does that for a loss of ``(hidden, head.weight, ..., bias=head.bias)``.
Tensors that need a gradient must be among the arguments (FSDP2 attaches its post-backward hook to the forward's
inputs); the weight and bias are read inside the call, when a wrapper has gathered them.

`refuse_sharded_weight` is the other half: a DTensor weight reached without an explicit word from the caller is
refused, since an FSDP2 shard and a tensor-parallel (vocabulary) shard carry the same ``Shard(0)`` placement.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor
from torch.nn.modules import module as module_mod

from ._checks import is_dtensor  # imports nothing of torch.distributed

__all__ = ["through_module", "linear_head_loss", "refuse_sharded_weight"]


def _has_call_hooks(module: torch.nn.Module) -> bool:
    # Global hooks (torch.nn.modules.module.register_module_forward_*_hook) run for every call as well.
    own = (module._forward_pre_hooks, module._forward_hooks, module._backward_hooks, module._backward_pre_hooks)
    shared = (module_mod._global_forward_pre_hooks, module_mod._global_forward_hooks,
              module_mod._global_backward_hooks, module_mod._global_backward_pre_hooks)
    return any(len(h) for h in own + shared)


def through_module(module: torch.nn.Module, fn: Callable[..., Any], *args, **kwargs):
    """``fn(*args, **kwargs)``, run as the forward of ``module(*args, **kwargs)``.

    A module without call hooks gains nothing from the detour, so `fn` is then called directly (no attribute
    swapped, nothing for torch.compile to trace around). Otherwise the instance's ``forward`` is replaced for
    this one call and put back before `fn` runs (so a call of `module` inside `fn` is an ordinary one) and in any
    case before this returns.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module: expected a torch.nn.Module, got {type(module).__name__}")
    if not _has_call_hooks(module):
        return fn(*args, **kwargs)
    had_own = "forward" in module.__dict__
    own = module.__dict__.get("forward")

    def restore():
        if had_own:
            module.forward = own
        else:
            module.__dict__.pop("forward", None)

    def redirected(*a, **k):
        restore()
        return fn(*a, **k)

    module.forward = redirected
    try:
        return module(*args, **kwargs)
    finally:
        restore()


def linear_head_loss(head: torch.nn.Module, loss: Callable[..., Any], hidden: Tensor, *args, **kwargs):
    """``loss(hidden, head.weight, *args, bias=head.bias, **kwargs)`` inside a call of `head` (see
    `through_module`); ``bias`` is passed only when the head has one. Tensor arguments that need a gradient
    besides `hidden` go in `args`.

    For example, with the head wrapped on its own by FSDP2::

        loss = logitless.linear_head_loss(model.lm_head, logitless.linear_cross_entropy, hidden, labels)
        loss = logitless.linear_head_loss(model.lm_head, logitless.linear_grpo_loss, hidden, ids, advantages,
                                          completion_mask=mask, beta=0.0)
    """
    if not isinstance(head, torch.nn.Module) or not isinstance(getattr(head, "weight", None), Tensor):
        raise TypeError(f"head: expected a linear module with a weight tensor (e.g. model.lm_head), got "
                        f"{type(head).__name__}")

    def forward(h, *a, **k):
        # Read here, not before the call: a sharding wrapper has gathered them by now.
        if getattr(head, "bias", None) is not None:
            k = dict(k, bias=head.bias)
        return loss(h, head.weight, *a, **k)

    return through_module(head, forward, hidden, *args, **kwargs)


def refuse_sharded_weight(weight: Tensor, bias: Optional[Tensor], vocab_parallel_remedy: bool) -> None:
    """Raise if `weight` (or `bias`) is a DTensor: the caller did not say it is a tensor-parallel shard."""
    for name, t in (("weight", weight), ("bias", bias)):
        if not is_dtensor(t):
            continue
        remedy = ("pass vocab_parallel=True to compute the loss over the vocabulary shards of the DTensor's mesh"
                  if vocab_parallel_remedy else "vocabulary parallelism is not supported by this loss")
        raise ValueError(
            f"{name}: got a DTensor (placements {tuple(t.placements)}), which has two readings: (1) a parameter "
            f"sharded for data parallelism (FSDP2's fully_shard, ZeRO-3): call the loss inside the head's forward so "
            f"the wrapper gathers it and reduces its gradient, e.g. logitless.linear_head_loss(model.lm_head, loss, "
            f"hidden, ...) (logitless.patch does this); (2) a tensor-parallel shard of the vocabulary: {remedy}")
