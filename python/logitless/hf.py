"""Hugging Face transformers (5.x) drop-in: `patch` a causal language model so that its RMSNorm modules run
``logitless.rms_norm`` and its loss runs ``logitless.linear_cross_entropy`` from the last hidden states, the
``[tokens, vocab]`` logits never formed; `unpatch` puts everything back.

What `patch(model)` changes, on that instance only (the model classes and other instances are untouched):

* ``rms_norm=True``: every RMSNorm module of the architecture (the decoder layers' norms, the final norm,
  Qwen3's and Gemma 3's q/k norms) is replaced by ``logitless.nn.RMSNorm.from_module(module)``, which keeps
  the module's weight Parameter (the same object: optimizers, state dicts and tied references see no change)
  and its eps; Gemma's get offset 1 and float32 casting as the originals compute them.
* ``cross_entropy=True``: the instance gets its own ``forward``. Called with ``labels``, it runs the decoder
  (``model.model``), applies ``logits_to_keep`` to the hidden states as the original does, and computes the
  loss the original's ``ForCausalLMLoss`` would compute: labels shifted inside the loss (position t predicts
  labels[t + 1], the last position predicts nothing) or ``shift_labels`` taken as given, ``ignore_index``
  (default -100), the mean over counted tokens, or with ``num_items_in_batch`` the sum divided by it
  (gradient accumulation's normalization); Gemma's ``final_logit_softcapping`` caps the logits inside the
  kernel. The output's ``logits`` is None. Called without labels, it is the original forward: logits as
  before (generation, evaluation without labels). The loss runs inside a call of ``lm_head`` (see
  `logitless.heads`), so a head wrapped on its own by FSDP2's ``fully_shard`` or partitioned by ZeRO-3 has its
  weight gathered for it and its gradient reduced as when the original forward calls it.

The fused loss is float32, like the original's (which upcasts the logits); it differs from it by the rounding
of the logits to the model's dtype that the original does before its upcast, i.e. within the dtype's noise.
One deliberate difference: a mean over a batch whose labels are all ignore_index is 0 with zero gradient
(the original gives NaN).

A model whose ``loss_function`` was replaced by a custom one keeps computing it: the patched forward defers
to the original forward then (the logits are formed, as the custom loss needs them).
"""
from __future__ import annotations

import inspect
import types
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from .heads import through_module
from .linear_cross_entropy import linear_cross_entropy
from .nn import RMSNorm

__all__ = ["patch", "unpatch", "is_patched", "SUPPORTED_ARCHITECTURES"]


@dataclass(frozen=True)
class _Architecture:
    norm: str       # class name of the architecture's RMSNorm module
    softcap: bool   # the forward applies config.final_logit_softcapping to the logits


# The causal LMs whose forward the patch reproduces. Their 5.x forwards share one shape: every named argument
# but labels and logits_to_keep (and **kwargs) goes to the decoder, then the slice of the hidden states,
# lm_head, the optional softcap and ForCausalLMLoss. _forward_parameters guards it.
_ARCHITECTURES: Dict[str, _Architecture] = {
    "LlamaForCausalLM": _Architecture("LlamaRMSNorm", softcap=False),
    "MistralForCausalLM": _Architecture("MistralRMSNorm", softcap=False),
    "Qwen2ForCausalLM": _Architecture("Qwen2RMSNorm", softcap=False),
    "Qwen3ForCausalLM": _Architecture("Qwen3RMSNorm", softcap=False),
    "Gemma2ForCausalLM": _Architecture("Gemma2RMSNorm", softcap=True),
    "Gemma3ForCausalLM": _Architecture("Gemma3RMSNorm", softcap=True),
}
SUPPORTED_ARCHITECTURES: Tuple[str, ...] = tuple(_ARCHITECTURES)

# Named arguments the forward must have (5.0 to 5.2x; the earlier releases also take cache_position).
_REQUIRED_PARAMETERS = ("input_ids", "attention_mask", "labels", "logits_to_keep")

# Options of linear_cross_entropy that patch() passes through; the others are fixed by the model's loss.
_LOSS_OPTIONS = ("z_loss", "schedule", "chunk_tokens", "chunk_vocab", "memory_budget", "check_targets",
                 "vocab_parallel")

_STATE = "_logitless_patch"


@dataclass
class _PatchState:
    architecture: str
    cross_entropy: bool
    loss_options: Dict[str, Any]
    softcap: Optional[float]
    # (parent module, attribute name, original module) for every RMSNorm replaced.
    norms: List[Tuple[torch.nn.Module, str, torch.nn.Module]] = field(default_factory=list)
    had_instance_forward: bool = False
    instance_forward: Any = None
    # The original forward's named parameters in order (without self): how positional arguments map.
    parameters: Tuple[str, ...] = ()
    # From transformers, looked up at patch time (an import inside the forward would stop torch.compile's
    # tracing): the standard loss, the output class, the hidden-state slicing of logits_to_keep.
    standard_loss: Any = None
    output_class: Any = None
    slice_hidden: Any = None


# ----------------------------------------------------------------------------------------------------
# Public API.


def patch(model: torch.nn.Module, rms_norm: bool = True, cross_entropy: bool = True,
          **loss_options) -> torch.nn.Module:
    """Patch a transformers causal LM in place (see the module docstring) and return `model`.

    Args:
        model: an instance of one of SUPPORTED_ARCHITECTURES (or of a subclass), e.g. from
            ``AutoModelForCausalLM.from_pretrained``. A ``torch.compile``d model is patched through to the
            module it wraps; patch before compiling to avoid a recompilation.
        rms_norm: replace the RMSNorm modules by ``logitless.nn.RMSNorm``.
        cross_entropy: compute the loss with ``logitless.linear_cross_entropy`` when labels are given.
        **loss_options: passed on to ``linear_cross_entropy``: z_loss, schedule, chunk_tokens, chunk_vocab,
            memory_budget, check_targets, vocab_parallel (z_loss adds a term the original loss does not have;
            vocab_parallel=True for an lm_head whose weight is a tensor-parallel DTensor sharded along the
            vocabulary).

    A patched model is first unpatched, so patching again with other options replaces the earlier patch.

    Raises:
        ValueError: for an architecture not supported (the message lists those that are), an unknown loss
            option, or cross_entropy=True on a model whose loss_function is not the standard causal-LM loss.
        RuntimeError: if the installed transformers' forward does not have the signature the patch
            reproduces.
    """
    given, model = model, _unwrap(model)
    name = _architecture_of(model)
    arch = _ARCHITECTURES[name]
    unknown = sorted(set(loss_options) - set(_LOSS_OPTIONS))
    if unknown:
        raise ValueError(f"loss_options: expected any of {', '.join(_LOSS_OPTIONS)}, got {', '.join(unknown)}")
    if cross_entropy:
        parameters, signature = _forward_parameters(model)
        if not _uses_standard_loss(model):
            loss = getattr(model.loss_function, "__name__", model.loss_function)
            raise ValueError(f"model: expected the standard causal-LM loss (ForCausalLMLoss) to fuse, got "
                             f"loss_function {loss!r}; pass cross_entropy=False to patch only the RMSNorm modules")
    if is_patched(model):
        unpatch(model)

    softcap = getattr(model.config, "final_logit_softcapping", None) if arch.softcap else None
    state = _PatchState(architecture=name, cross_entropy=bool(cross_entropy), loss_options=dict(loss_options),
                        softcap=float(softcap) if softcap else None)
    if rms_norm:
        _replace_norms(model, arch.norm, state)
    if cross_entropy:
        from transformers.modeling_outputs import CausalLMOutputWithPast

        state.standard_loss, state.output_class, state.slice_hidden = (_standard_loss(), CausalLMOutputWithPast,
                                                                       _hidden_slicer())
        state.had_instance_forward = "forward" in model.__dict__
        state.instance_forward = model.__dict__.get("forward")
        state.parameters = parameters
        # A bound method, not a closure over the model: copy.deepcopy(model) then binds the copy's forward to
        # the copy. It shows the original's signature, which is what transformers' Trainer inspects (the
        # dataset columns it keeps, whether the model takes num_items_in_batch).
        model.forward = types.MethodType(_forward_with_signature(signature), model)
    object.__setattr__(model, _STATE, state)
    return given


def unpatch(model: torch.nn.Module) -> torch.nn.Module:
    """Undo `patch`: the original RMSNorm modules back in their places and the instance's forward as it was.
    Returns `model`; one that is not patched is left unchanged."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    given, model = model, _unwrap(model)
    state: Optional[_PatchState] = model.__dict__.get(_STATE)
    if state is None:
        return given
    for parent, attr, original in reversed(state.norms):
        setattr(parent, attr, original)
    if state.cross_entropy:
        if state.had_instance_forward:
            model.forward = state.instance_forward
        else:
            model.__dict__.pop("forward", None)
    del model.__dict__[_STATE]
    return given


def is_patched(model: torch.nn.Module) -> bool:
    """Whether `patch` was applied to this model (and not undone)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    return _STATE in _unwrap(model).__dict__


# ----------------------------------------------------------------------------------------------------
# Patching.


def _unwrap(model):
    # torch.compile(model) returns an OptimizedModule around the original module.
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, torch.nn.Module) else model


def _architecture_of(model) -> str:
    for cls in type(model).__mro__:
        if cls.__name__ in _ARCHITECTURES and cls.__module__.startswith("transformers."):
            return cls.__name__
    raise ValueError(f"model: expected a causal LM of a supported architecture ({', '.join(SUPPORTED_ARCHITECTURES)}) "
                     f"or a subclass of one, got {type(model).__module__}.{type(model).__name__}")


def _original_forward_function(model):
    for cls in type(model).__mro__:
        if "forward" in cls.__dict__:
            return cls.__dict__["forward"]
    raise RuntimeError(f"{type(model).__name__} has no forward")


def _forward_parameters(model) -> Tuple[Tuple[str, ...], inspect.Signature]:
    """The named parameters of the original forward (without self) and its signature, checked against the
    shape the patched forward reproduces."""
    signature = inspect.signature(_original_forward_function(model))  # through functools.wraps decorators
    params = list(signature.parameters.values())[1:]
    names = tuple(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    has_kwargs = any(p.kind == p.VAR_KEYWORD for p in params)
    missing = [n for n in _REQUIRED_PARAMETERS if n not in names]
    if missing or not has_kwargs or not hasattr(model, "model") or not hasattr(model, "lm_head"):
        import transformers

        raise RuntimeError(f"{type(model).__name__}.forward: expected the parameters {', '.join(_REQUIRED_PARAMETERS)} "
                           f"and **kwargs, and the submodules model and lm_head; got ({', '.join(names)}"
                           f"{', **kwargs' if has_kwargs else ''}) with transformers {transformers.__version__}; "
                           f"pass cross_entropy=False")
    return names, signature.replace(parameters=params)


def _standard_loss():
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss


def _uses_standard_loss(model) -> bool:
    return model.loss_function is _standard_loss()


def _replace_norms(model, norm_class: str, state: _PatchState) -> None:
    replacements: Dict[int, RMSNorm] = {}
    sites = []
    for parent_name, parent in model.named_modules(remove_duplicate=False):
        for attr, child in parent.named_children():
            if type(child).__name__ == norm_class:
                sites.append((parent, attr, child))
    for parent, attr, child in sites:
        new = replacements.get(id(child))
        if new is None:
            new = replacements[id(child)] = RMSNorm.from_module(child)
        setattr(parent, attr, new)
        state.norms.append((parent, attr, child))


# ----------------------------------------------------------------------------------------------------
# The forward.


def _call_original(self, state: _PatchState, **kwargs):
    if state.had_instance_forward:
        return state.instance_forward(**kwargs)
    return _original_forward_function(self)(self, **kwargs)


def _slice_inline(hidden: Tensor, logits_to_keep) -> Tensor:
    index = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    return hidden[:, index, :]


def _hidden_slicer():
    try:
        from transformers.modeling_utils import slice_logits_to_keep
    except ImportError:  # the earlier 5.x releases slice inline, as above
        return _slice_inline
    return slice_logits_to_keep


def _forward_with_signature(signature: inspect.Signature):
    def forward(self, *args, **kwargs):
        return _patched_forward(self, *args, **kwargs)

    forward.__signature__ = signature.replace(
        parameters=[inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)] +
        list(signature.parameters.values()))
    forward.__doc__ = _patched_forward.__doc__
    return forward


def _patched_forward(self, *args, **kwargs):
    """The causal LM's forward; with labels, the loss by logitless.linear_cross_entropy and no logits."""
    state: _PatchState = self.__dict__[_STATE]
    if len(args) > len(state.parameters):
        raise TypeError(f"forward: expected at most {len(state.parameters)} positional arguments, got {len(args)}")
    for name in state.parameters[:len(args)]:
        if name in kwargs:
            raise TypeError(f"forward: got multiple values for argument {name!r}")
    kwargs.update(zip(state.parameters, args))
    labels = kwargs.get("labels")
    custom_loss = self.__dict__.get("_loss_function")
    if labels is None or (custom_loss is not None and custom_loss is not state.standard_loss):
        return _call_original(self, state, **kwargs)
    del kwargs["labels"]
    logits_to_keep = kwargs.pop("logits_to_keep", 0)
    # As transformers' can_return_tuple: return_dict from the call, else from the config.
    return_dict = kwargs.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    # Every other argument goes to the decoder, as the original forward passes them.
    outputs = self.model(**kwargs)
    hidden = state.slice_hidden(outputs.last_hidden_state, logits_to_keep)
    loss = _causal_lm_loss(self, state, hidden, labels, num_items_in_batch=kwargs.get("num_items_in_batch"),
                           ignore_index=kwargs.get("ignore_index", -100), shift_labels=kwargs.get("shift_labels"))
    output = state.output_class(loss=loss, logits=None, past_key_values=outputs.past_key_values,
                                hidden_states=outputs.hidden_states, attentions=outputs.attentions)
    return output if return_dict else output.to_tuple()


def _causal_lm_loss(self, state: _PatchState, hidden: Tensor, labels: Tensor, num_items_in_batch, ignore_index: int,
                    shift_labels: Optional[Tensor]) -> Tensor:
    """ForCausalLMLoss(lm_head(hidden) (softcapped), labels, ...) without the logits."""
    if shift_labels is not None:
        h, target = hidden, shift_labels
    elif labels.shape == hidden.shape[:-1] and hidden.dim() >= 2:
        # The shift as views: position t predicts labels[t + 1]; the last position, whose padded label the
        # original ignores, is left out (the same loss, one row less).
        h, target = hidden[..., :-1, :], labels[..., 1:]
    else:
        pad = torch.full(labels.shape[:-1] + (1,), ignore_index, dtype=labels.dtype, device=labels.device)
        h, target = hidden, torch.cat((labels[..., 1:], pad), dim=-1)
    target = target.to(h.device)
    if target.shape != h.shape[:-1]:
        # The original flattens both (logits.view(-1, V), labels.view(-1)): only the counts must agree.
        if target.numel() * h.shape[-1] != h.numel():
            raise ValueError(f"labels: expected {h.numel() // max(h.shape[-1], 1)} labels for the hidden states "
                             f"{tuple(h.shape)} (after logits_to_keep), got shape {tuple(target.shape)}")
        h, target = h.reshape(-1, h.shape[-1]), target.reshape(-1)
    reduction = "mean" if num_items_in_batch is None else "sum"

    def head_loss(h: Tensor, target: Tensor) -> Tensor:
        # The head's parameters are read here, inside its call: a wrapper that shards them (FSDP2, ZeRO-3) has
        # gathered them, and reduces their gradients after the backward.
        weight, bias = self.lm_head.weight, self.lm_head.bias
        # lm_head runs in the autocast dtype under autocast; the fused op gets its operands already cast.
        device_type = h.device.type
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            h, weight = h.to(dtype), weight.to(dtype)
            bias = None if bias is None else bias.to(dtype)
        elif h.dtype != weight.dtype:
            h = h.to(weight.dtype)
        return linear_cross_entropy(h, weight, target, bias, ignore_index=ignore_index, reduction=reduction,
                                    softcap=state.softcap, **state.loss_options)

    loss = through_module(self.lm_head, head_loss, h, target)
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss
