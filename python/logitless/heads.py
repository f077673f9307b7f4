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

__all__ = ["through_module", "linear_head_loss", "as_vocab_sharded", "beside", "refuse_sharded_weight"]


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

    A head that torch's tensor parallelism shards along the vocabulary (``ColwiseParallel``) takes
    ``vocab_parallel=True``: its input hook makes `hidden` a DTensor, and its output hook, which expects the
    head's logits, gets a vocabulary-sharded stand-in (`as_vocab_sharded`) while the loss's own result is returned.
    """
    if not isinstance(head, torch.nn.Module) or not isinstance(getattr(head, "weight", None), Tensor):
        raise TypeError(f"head: expected a linear module with a weight tensor (e.g. model.lm_head), got "
                        f"{type(head).__name__}")
    held = []

    def forward(h, *a, **k):
        # Read here, not before the call: a sharding wrapper has gathered them by now.
        if getattr(head, "bias", None) is not None:
            k = dict(k, bias=head.bias)
        if len(a) != len(args):  # a hook kept only the first input (torch's tensor-parallel styles do)
            a = args
        out = loss(h, head.weight, *a, **k)
        if not is_dtensor(h):
            return out
        held.append(out)
        first = out[0] if isinstance(out, tuple) else out
        return as_vocab_sharded(first.sum().reshape((1,) * h.dim()), h)

    arrived = through_module(head, forward, hidden, *args, **kwargs)
    if not held:
        return arrived
    out = held[0]
    if isinstance(out, tuple):
        return (beside(out[0], arrived), *out[1:])
    return beside(out, arrived)


def as_vocab_sharded(out: Tensor, hidden) -> Tensor:
    """A tensor-parallel head's input hook made `hidden` a DTensor, and its output hook takes the head's output for
    logits sharded along the vocabulary (a DTensor it redistributes or unwraps): `out` as such, one column a rank,
    sharded over the mesh dimensions where hidden is replicated."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    placements = [Shard(out.dim() - 1) if isinstance(p, Replicate) else p for p in hidden.placements]
    return DTensor.from_local(out, hidden.device_mesh, placements, run_check=False)


class _Beside(torch.autograd.Function):
    @staticmethod
    def forward(ctx, value, other):
        ctx.other = (other.shape, other.dtype, other.device)
        return value.clone()  # not a view: callers add to a loss in place (a model's router losses)

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.other
        return grad, torch.zeros(shape, dtype=dtype, device=device)


def beside(value: Tensor, other) -> Tensor:
    """`value`, with `other` (what hooks on a module's output made of a stand-in) in its graph at a zero gradient:
    a sharding wrapper's hook on the head's output (FSDP2's) then runs in the backward before the loss's own
    backward needs the gathered weight. No arithmetic joins them, so a NaN in either stays where it was."""
    other = other.to_local() if is_dtensor(other) else other
    if not isinstance(other, Tensor) or not other.requires_grad or not torch.is_grad_enabled():
        return value
    return _Beside.apply(value, other)


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
