"""Trainers: one call, `use_logitless(trainer)`, makes a Hugging Face ``Trainer`` or TRL's ``SFTTrainer`` and
``GRPOTrainer`` compute their losses and logged metrics from the last hidden states with logitless's fused ops.

* ``transformers.Trainer`` (and any trainer whose loss is the model's own, given ``labels``): the model it trains is
  patched with `logitless.patch` (fused linear cross-entropy, RMSNorm): the module inside whatever wraps it (DDP,
  DeepSpeed, FSDP1's ``.module``, ``torch.compile``, PEFT).
* TRL (``trl>=1.16,<1.17`` tested; 1.15 accepted with a warning): these versions already score tokens through a
  "fused LM head": TRL replaces the forward of the model it trains (and of the reference model) by one that, called
  with ``fused_lm_head=True``, runs the decoder and returns per-token ``log_probs`` (and ``entropy``, ``is_top1``, ``label_mask``) instead of logits.
  `use_logitless` replaces that forward in turn by one that computes the same fields with
  ``logitless.linear_selective_log_softmax`` (log-probs with their gradient, entropy, and ``is_top1`` for SFT's
  ``mean_token_accuracy``, all from one pass over each chunk's logits), inside a call of the LM head
  (`logitless.linear_head_loss`, so FSDP2 and ZeRO-3 gather its weight). That covers SFT's loss, its
  ``mean_token_accuracy`` and ``entropy``, and GRPO's old-policy and reference log-probs.
* ``SFTTrainer`` with its default ``loss_type="nll"``: the loss, ``-sum(log_probs) / count``, weighs every token
  alike, so the head's gradient is computed in the forward instead (``logitless.linear_cross_entropy``'s
  gradient-in-forward schedule: three logits-sized GEMMs, where the log-probs' recomputing backward takes four), with
  the entropy and ``is_top1`` from the same pass (``return_row_stats``); ``log_probs`` are the negated per-token
  losses. Other loss types (``dft``, whose per-token weights are the probabilities) and a head with a temperature
  keep the selective log-softmax.
* ``GRPOTrainer``: additionally its loss is computed by ``logitless.linear_grpo_loss`` from the policy's hidden
  states in one fused call, with the trainer's options (beta, epsilon / epsilon_high, loss_type,
  importance_sampling_level, temperature, max_completion_length, the dapo normalizer, gradient accumulation), and its
  metrics (kl, entropy, clip ratios) from the per-token values that call returns. The trainer's class is swapped for a
  subclass that overrides ``_compute_loss`` (the one method; see `LogitlessGRPOMixin`). Options whose loss the fused
  op does not compute are refused by name before anything changes (`UNSUPPORTED_GRPO_OPTIONS`).

Call it after constructing the trainer and before ``train()``::

    trainer = GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=...)
    logitless.integrations.use_logitless(trainer)
    trainer.train()

Differences to what the trainers compute themselves, all within float32 rounding: the logits are never rounded to the
model's dtype before the softmax or the argmax (TRL's chunks are, under bf16 autocast, so its ``is_top1`` sees more
ties, each won by the lower index); the ``entropy`` field is not differentiable (the trainers only log it; GRPO's
entropy bonus, the one use of its gradient, is refused).
"""
from __future__ import annotations

import inspect
import types
import warnings
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch
from torch import Tensor

from .heads import linear_head_loss
from .hf import patch, sharded_refusal
from .linear_cross_entropy import token_losses_uniform_grad
from .linear_policy_loss import linear_grpo_loss, linear_selective_log_softmax

__all__ = ["use_logitless", "LogitlessGRPOMixin", "TESTED_TRL", "UNSUPPORTED_GRPO_OPTIONS"]

# The TRL releases whose fused-LM-head protocol (FusedCausalLMOutput, `fused_lm_head=True`) and GRPO `_compute_loss`
# this module was written against and tested with; pyproject's `trl` extra pins the same range. 1.15 introduced the
# protocol (its GRPO `_compute_loss` is 1.16's line for line) and is accepted with a warning.
TESTED_TRL = (">=1.16", "<1.17")

# GRPOConfig options (and values) whose loss linear_grpo_loss does not compute; `use_logitless` refuses a trainer
# configured with any of them, naming it. Documentation: the checks are in `_grpo_refusals`.
UNSUPPORTED_GRPO_OPTIONS = {
    "loss_type": "cispo, sapo, vespo and luspo (grpo, bnpo, dr_grpo and dapo are supported)",
    "delta": "two-sided clipping of the ratio (delta=None is supported)",
    "use_bias_correction_kl": "with beta != 0, the KL term multiplied by the (differentiable) ratio; set it False",
    "off_policy_mask_threshold": "the off-policy sequence mask (None is supported)",
    "top_entropy_quantile": "the high-entropy token mask (1.0 is supported)",
    "entropy_coef / use_adaptive_entropy": "the entropy bonus, which needs the entropy's gradient",
    "use_vllm + vllm_importance_sampling_correction": "the per-token importance-sampling ratio of vLLM's samples",
    "router_aux_loss_coef": "a mixture-of-experts model's load-balancing loss",
    "final_logit_softcapping": "a softcapped head (Gemma 2/3): the fused log-softmax has no softcap",
}

_STATE = "_logitless_trl"


# ----------------------------------------------------------------------------------------------------
# The one call


def use_logitless(trainer_or_model, *, rms_norm: bool = True, **loss_options):
    """Make a trainer (or a model) use logitless's fused losses. Returns its argument.

    Args:
        trainer_or_model: a ``transformers.Trainer`` (any subclass whose loss is the model's own: SFT-style
            trainers of other libraries, custom ``compute_loss`` that calls ``model(..., labels=...)``), TRL's
            ``SFTTrainer`` or ``GRPOTrainer`` (trl>=1.16,<1.17), or a causal LM (possibly wrapped), which is patched
            with `logitless.patch`.
        rms_norm: also replace the model's RMSNorm modules by ``logitless.nn.RMSNorm`` (see `logitless.patch`).
        **loss_options: for a Trainer or a model, passed to `logitless.patch` (z_loss, schedule, chunk_tokens, ...).

    Call it before ``trainer.train()``; calling it again does nothing more.

    Raises:
        ValueError: an option of the trainer whose loss the fused path cannot compute (named, with what to set
            instead); nothing was changed. `logitless.hf.PatchRefused` (a ValueError) for a model `patch` refuses.
        TypeError: a TRL trainer other than SFTTrainer and GRPOTrainer, or an object that is neither a trainer nor a
            module.
    """
    obj = trainer_or_model
    if isinstance(obj, torch.nn.Module):
        model = _unwrap(obj)
        if _read_trl_head(model) is not None:
            # Its trainer calls it with fused_lm_head=True, which the cross-entropy patch does not serve.
            raise TypeError(f"{type(model).__name__} has TRL's fused LM head: pass the trainer, "
                            f"use_logitless(trainer)")
        patch(model, rms_norm=rms_norm, cross_entropy=True, **loss_options)
        return obj
    try:
        from transformers import Trainer
    except ImportError:  # pragma: no cover - transformers is a dependency of the hf extra
        Trainer = None
    if Trainer is None or not isinstance(obj, Trainer):
        raise TypeError(f"trainer_or_model: expected a transformers Trainer or a torch.nn.Module, got "
                        f"{type(obj).__name__}")
    kind = _trl_kind(obj)
    if kind is None:
        return _use_with_trainer(obj, rms_norm, loss_options)
    if loss_options:
        raise ValueError(f"loss_options: not used with TRL's {type(obj).__name__} (its losses are not the model's "
                         f"cross-entropy), got {', '.join(sorted(loss_options))}")
    _check_trl_version()
    if kind == "sft":
        _use_with_sft(obj, rms_norm)
    else:
        _use_with_grpo(obj, rms_norm)
    return obj


def _unwrap(model):
    """The causal LM inside whatever wraps it: torch.compile, DDP / DataParallel / DeepSpeed / FSDP1 (``.module``),
    PEFT (``get_base_model()``)."""
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        inner = getattr(model, "_orig_mod", None)
        if isinstance(inner, torch.nn.Module):
            model = inner
            continue
        inner = getattr(model, "module", None)
        if isinstance(inner, torch.nn.Module) and not hasattr(model, "get_output_embeddings"):
            model = inner
            continue
        base = getattr(model, "get_base_model", None)
        if callable(base) and hasattr(model, "peft_config"):
            model = base()
            continue
    return model


# ----------------------------------------------------------------------------------------------------
# transformers.Trainer


def _use_with_trainer(trainer, rms_norm: bool, loss_options: Dict[str, Any]):
    # Trainer.compute_loss takes the labels out of the inputs for these two and computes the loss from the logits
    # itself: the model would never see labels, and the fused loss would silently not run.
    reasons = []
    if getattr(trainer, "label_smoother", None) is not None:
        reasons.append("label_smoothing_factor > 0: Trainer smooths the loss over the logits; set it to 0")
    if getattr(trainer, "compute_loss_func", None) is not None:
        reasons.append("compute_loss_func: a custom loss over the logits; remove it, or use the logits path")
    if reasons:
        raise ValueError(f"{type(trainer).__name__}: not changed, its loss needs the logits:\n  - " +
                         "\n  - ".join(reasons))
    patch(_unwrap(trainer.model), rms_norm=rms_norm, cross_entropy=True, **loss_options)
    return trainer


# ----------------------------------------------------------------------------------------------------
# TRL: which trainer, which version, and the fused-LM-head forward it installed


def _trl_kind(trainer) -> Optional[str]:
    module = type(trainer).__module__ or ""
    is_trl = any(c.__module__.startswith("trl.") for c in type(trainer).__mro__)
    if not is_trl and not module.startswith("trl."):
        return None
    from trl import GRPOTrainer, SFTTrainer

    if isinstance(trainer, GRPOTrainer):
        return "grpo"
    if isinstance(trainer, SFTTrainer):
        return "sft"
    raise TypeError(f"{type(trainer).__name__}: logitless.integrations supports TRL's SFTTrainer and GRPOTrainer "
                    f"(and transformers.Trainer); this trainer's losses are not mapped")


def _check_trl_version() -> None:
    import trl
    from packaging.version import Version

    version = Version(trl.__version__)
    low, high = (Version(s.lstrip("<>=")) for s in TESTED_TRL)
    if version < Version("1.15"):
        raise ValueError(f"trl {trl.__version__}: logitless.integrations needs trl{','.join(TESTED_TRL)} (the "
                         f"releases whose trainers score tokens through a fused LM head); pip install "
                         f"'logitless[trl]'")
    if not low <= version < high:
        warnings.warn(f"trl {trl.__version__} is outside the tested range trl{','.join(TESTED_TRL)}; "
                      f"logitless.integrations checks TRL's fused-LM-head forward before replacing it, but the "
                      f"trainers' loss code may have changed", stacklevel=3)


@dataclass
class _TrlHead:
    """What TRL's add_fused_lm_head fixed for one model, read from the forward it installed, and that forward."""

    trl_forward: Any            # the bound method TRL installed (put back by nothing here; kept for reference)
    original_forward: Any       # the forward TRL wrapped (the model's own): the path without fused_lm_head
    temperature: float
    cast_lm_head_to_fp32: bool
    outputs: Tuple[str, ...]
    logit_scale: float
    softcap: Optional[float]
    backbone_attr: str
    text_config: Any
    # The trainer reduces the log-probs as -sum / count (SFT's nll loss): one upstream gradient for every token.
    uniform_log_prob_grad: bool = False


_TRL_CLOSURE = ("original_forward", "temperature", "cast_lm_head_to_fp32", "outputs", "logit_scale",
                "final_logit_softcapping", "backbone_attr", "text_config")


def _read_trl_head(model) -> Optional[_TrlHead]:
    """The settings of TRL's fused-LM-head forward on `model`, or None if it has none. The values live in that
    forward's closure (add_fused_lm_head keeps no other record); a closure without every expected name is a TRL
    whose protocol this module does not know, refused rather than guessed."""
    state = model.__dict__.get(_STATE)
    if state is not None:
        return state
    forward = model.__dict__.get("forward")
    function = getattr(forward, "__func__", None)
    code = getattr(function, "__code__", None)
    if code is None or code.co_name != "_fused_forward" or "trl" not in code.co_filename.replace("\\", "/").split("/"):
        return None
    values = inspect.getclosurevars(function).nonlocals
    missing = [n for n in _TRL_CLOSURE if n not in values]
    if missing:
        import trl

        raise ValueError(f"{type(model).__name__}: TRL {trl.__version__}'s fused LM head keeps no "
                         f"{', '.join(missing)}; logitless.integrations knows trl{','.join(TESTED_TRL)}")
    return _TrlHead(trl_forward=forward, original_forward=values["original_forward"],
                    temperature=float(values["temperature"]), cast_lm_head_to_fp32=bool(values["cast_lm_head_to_fp32"]),
                    outputs=tuple(values["outputs"]), logit_scale=float(values["logit_scale"]),
                    softcap=values["final_logit_softcapping"], backbone_attr=values["backbone_attr"],
                    text_config=values["text_config"])


def _head_refusals(model, head: _TrlHead):
    reasons = []
    if head.softcap is not None:
        reasons.append(f"final_logit_softcapping={head.softcap} (the model's config): "
                       f"{UNSUPPORTED_GRPO_OPTIONS['final_logit_softcapping']}")
    extra = sorted(set(head.outputs) - {"log_probs", "entropy", "is_top1"})
    if extra:
        reasons.append(f"TRL asks the fused head for {', '.join(extra)}, which logitless does not compute")
    if head.logit_scale <= 0:
        reasons.append(f"logit_scale={head.logit_scale}: a non-positive logit scale")
    if getattr(model.get_output_embeddings(), "weight", None) is None:
        reasons.append("the output embeddings have no weight")
    return reasons


def _trl_models(trainer):
    """The models TRL gave a fused LM head: the trained one (PEFT's base model) and the reference model."""
    models = [_unwrap(trainer.model)]
    ref = getattr(trainer, "ref_model", None)
    if ref is not None:
        models.append(_unwrap(ref))
    return models


def _install(trainer, rms_norm: bool, reasons, temperature: Optional[float] = None):
    """Checks every model, then (only if nothing was refused) patches the norms and replaces TRL's forward."""
    heads = []
    for model in _trl_models(trainer):
        head = _read_trl_head(model)
        if head is None:
            reasons.append(f"{type(model).__name__}: TRL's fused LM head is not installed on it (construct the "
                           f"trainer first; trl{','.join(TESTED_TRL)})")
            continue
        reasons += [f"{type(model).__name__}: {r}" for r in _head_refusals(model, head)]
        # patch would refuse it after the other model was patched: refused here, first.
        refusal = sharded_refusal(model, "call use_logitless before the models are sharded") if rms_norm else None
        if refusal is not None:
            reasons.append(f"{type(model).__name__}: {refusal}")
        if temperature is not None and head.temperature != temperature:
            reasons.append(f"{type(model).__name__}: TRL's fused head divides by temperature {head.temperature}, "
                           f"the trainer samples at {temperature}")
        heads.append((model, head))
    if reasons:
        raise ValueError(f"{type(trainer).__name__}: not changed; logitless cannot compute what it is configured "
                         f"to:\n  - " + "\n  - ".join(reasons))
    for model, head in heads:
        if rms_norm:
            patch(model, rms_norm=True, cross_entropy=False)
        if _STATE not in model.__dict__:
            object.__setattr__(model, _STATE, head)
            forward = types.MethodType(_fused_forward, model)
            forward = _with_signature(forward, head.trl_forward)
            model.forward = forward


def _with_signature(forward, like):
    # generate() validates its keyword arguments against the forward's signature: show the model's own, as TRL's
    # forward does.
    def wrapper(*args, **kwargs):
        return forward(*args, **kwargs)

    try:
        wrapper.__signature__ = inspect.signature(like)
    except (TypeError, ValueError):
        pass
    wrapper.__doc__ = getattr(like, "__doc__", None)
    wrapper.__wrapped_logitless__ = forward
    return wrapper


# ----------------------------------------------------------------------------------------------------
# SFTTrainer


def _use_with_sft(trainer, rms_norm: bool):
    reasons = []
    # These two compute SFT's loss from the logits (the fused forward only feeds the metrics there).
    if getattr(trainer, "compute_loss_func", None) is not None:
        reasons.append("compute_loss_func: a custom loss over the logits; remove it")
    if getattr(trainer, "label_smoother", None) is not None:
        reasons.append("label_smoothing_factor > 0: smoothed over the logits; set it to 0")
    if getattr(trainer, "aux_loss_enabled", False):
        reasons.append(f"router_aux_loss_coef={trainer.router_aux_loss_coef}: "
                       f"{UNSUPPORTED_GRPO_OPTIONS['router_aux_loss_coef']}; set it to 0.0")
    _install(trainer, rms_norm, reasons)
    # nll: compute_loss sums -log_probs over the tokens and divides by their count (the only gradient the log-probs
    # get). dft weighs each token by its probability: no one gradient for all.
    uniform = getattr(trainer.args, "loss_type", "nll") == "nll"
    for model in _trl_models(trainer):
        model.__dict__[_STATE].uniform_log_prob_grad = uniform


# ----------------------------------------------------------------------------------------------------
# GRPOTrainer


def _grpo_refusals(trainer):
    args = trainer.args
    reasons = []
    if trainer.loss_type not in ("grpo", "bnpo", "dr_grpo", "dapo"):
        reasons.append(f"loss_type={trainer.loss_type!r}: {UNSUPPORTED_GRPO_OPTIONS['loss_type']}")
    if getattr(args, "delta", None) is not None:
        reasons.append(f"delta={args.delta}: {UNSUPPORTED_GRPO_OPTIONS['delta']}")
    if trainer.beta != 0.0 and getattr(args, "use_bias_correction_kl", False):
        reasons.append(f"use_bias_correction_kl=True with beta={trainer.beta}: "
                       f"{UNSUPPORTED_GRPO_OPTIONS['use_bias_correction_kl']}")
    if getattr(trainer, "off_policy_mask_threshold", None) is not None:
        reasons.append(f"off_policy_mask_threshold={trainer.off_policy_mask_threshold}: "
                       f"{UNSUPPORTED_GRPO_OPTIONS['off_policy_mask_threshold']}")
    if getattr(trainer, "top_entropy_quantile", 1.0) < 1.0:
        reasons.append(f"top_entropy_quantile={trainer.top_entropy_quantile}: "
                       f"{UNSUPPORTED_GRPO_OPTIONS['top_entropy_quantile']}")
    if getattr(trainer, "_entropy_bonus_enabled", False):
        reasons.append(f"entropy_coef={trainer.entropy_coef}, use_adaptive_entropy="
                       f"{getattr(trainer, 'use_adaptive_entropy', False)}: "
                       f"{UNSUPPORTED_GRPO_OPTIONS['entropy_coef / use_adaptive_entropy']}")
    if getattr(trainer, "use_vllm", False) and getattr(trainer, "vllm_importance_sampling_correction", False):
        reasons.append("use_vllm=True with vllm_importance_sampling_correction=True: "
                       f"{UNSUPPORTED_GRPO_OPTIONS['use_vllm + vllm_importance_sampling_correction']}; set the "
                       "correction False")
    if getattr(trainer, "aux_loss_enabled", False):
        reasons.append(f"router_aux_loss_coef={trainer.router_aux_loss_coef}: "
                       f"{UNSUPPORTED_GRPO_OPTIONS['router_aux_loss_coef']}; set it to 0.0")
    if trainer.loss_type == "dr_grpo" and not trainer.max_completion_length:
        reasons.append("loss_type='dr_grpo' without max_completion_length")
    from trl import GRPOTrainer

    own = getattr(type(trainer), "_compute_loss", None)
    if own is not GRPOTrainer._compute_loss and own is not LogitlessGRPOMixin._compute_loss:
        reasons.append(f"{type(trainer).__name__} overrides _compute_loss, which logitless would replace")
    return reasons


def _use_with_grpo(trainer, rms_norm: bool):
    _install(trainer, rms_norm, _grpo_refusals(trainer), temperature=trainer.temperature)
    cls = type(trainer)
    if not issubclass(cls, LogitlessGRPOMixin):
        trainer.__class__ = _logitless_subclass(cls)


_SUBCLASSES: Dict[type, type] = {}


def _logitless_subclass(cls: type) -> type:
    # One subclass per trainer class, so that isinstance checks against the user's class still hold and every
    # method but _compute_loss is theirs.
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        sub = type(f"Logitless{cls.__name__}", (LogitlessGRPOMixin, cls), {"__module__": __name__})
        _SUBCLASSES[cls] = sub
    return sub


@dataclass
class _GRPORequest:
    """Passed as ``fused_lm_head=`` through the model's call (and whatever wraps it: DDP, FSDP, PEFT): the policy
    loss is computed inside the forward, from the decoder's output, by linear_grpo_loss in a call of the head."""

    completion_ids: Tensor
    advantages: Tensor
    completion_mask: Tensor
    old_logp: Optional[Tensor]
    ref_logp: Optional[Tensor]
    options: Dict[str, Any]

    def __bool__(self) -> bool:
        return True


class LogitlessGRPOMixin:
    """GRPOTrainer's ``_compute_loss`` by ``logitless.linear_grpo_loss`` from the policy's last hidden states (no
    logits, no per-token graph), logging the metrics TRL logs (kl, entropy, clip_ratio/*) from the per-token values
    the fused call returns. `use_logitless` puts it in front of a GRPOTrainer's class; it may also be used as a base
    directly: ``class MyTrainer(LogitlessGRPOMixin, GRPOTrainer)`` followed by ``use_logitless(trainer)``."""

    def _compute_loss(self, model, inputs):
        extra = sorted(k for k in ("pixel_values", "image_grid_thw", "pixel_attention_mask", "image_sizes",
                                   "token_type_ids", "mm_token_type_ids", "image_position_ids", "num_images")
                       if inputs.get(k) is not None)
        if extra:
            raise ValueError(f"logitless GRPO: multimodal inputs ({', '.join(extra)}) are not supported")
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        advantages = inputs["advantages"]
        if advantages.dim() != 1:
            raise ValueError(f"advantages: logitless GRPO takes one advantage per sequence ([B]), got shape "
                             f"{tuple(advantages.shape)}")
        old = inputs.get("old_per_token_logps")
        ref = inputs["ref_per_token_logps"] if self.beta != 0.0 else None
        mode = "train" if self.model.training else "eval"
        # TRL divides every loss type but dapo by the accumulation steps here (the Trainer does not); dapo's
        # normalizer is the step's completion tokens per process, rescaled to one accumulation window.
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        num_items = None
        if self.loss_type == "dapo":
            normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                normalizer = normalizer * self.current_gradient_accumulation_steps / self.args.steps_per_generation
            num_items = float(normalizer)
        options = dict(beta=float(self.beta), eps_low=float(self.epsilon_low), eps_high=float(self.epsilon_high),
                       loss_type=self.loss_type, importance_sampling_level=self.importance_sampling_level,
                       max_completion_length=self.max_completion_length if self.loss_type == "dr_grpo" else None,
                       num_items_in_batch=num_items)
        request = _GRPORequest(completion_ids, advantages, mask, old, ref, options)
        with self.accelerator.autocast():
            out = model(input_ids=input_ids, attention_mask=attention_mask, fused_lm_head=request)
        loss = out.loss if self.loss_type == "dapo" else out.loss / accumulation
        self._log_grpo_metrics(mode, out, mask, advantages, old)
        return loss

    def _log_grpo_metrics(self, mode, out, mask, advantages, old):
        from trl.trainer.utils import nanmax, nanmin

        mask = mask.to(torch.float32)

        def global_masked_mean(x):  # over the unmasked tokens of every process ([B, 1]: over the sequences)
            if x.shape[1] == 1:
                local = torch.stack([x.sum(), torch.tensor(float(x.shape[0]), device=x.device)])
            else:
                local = torch.stack([(x * mask).sum(), mask.sum()])
            totals = self.accelerator.reduce(local, reduction="sum")
            return (totals[0] / totals[1].clamp(min=1.0)).item()

        def masked_seq_mean(x):
            return x.squeeze(1) if x.shape[1] == 1 else (x * mask).sum(-1) / mask.sum(-1)

        if self.beta != 0.0:
            self._metrics[mode]["kl"].append(global_masked_mean(out.kl))
        self._metrics[mode]["entropy"].append(global_masked_mean(out.entropy))
        # The ratio as the loss formed it, from the log-probs the fused call returns.
        logp = out.log_probs
        log_ratio = logp - (logp if old is None else old.to(logp.dtype))
        if self.importance_sampling_level == "sequence":
            log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
        ratio = torch.exp(log_ratio)
        adv = advantages.unsqueeze(1)
        low = ((ratio < 1 - self.epsilon_low) & (adv < 0)).float()
        high = ((ratio > 1 + self.epsilon_high) & (adv > 0)).float()
        metrics = self._metrics[mode]
        metrics["clip_ratio/low_mean"].append(global_masked_mean(low))
        metrics["clip_ratio/high_mean"].append(global_masked_mean(high))
        metrics["clip_ratio/region_mean"].append(global_masked_mean(torch.maximum(low, high)))
        metrics["clip_ratio/low_min"].append(nanmin(self.accelerator.gather(masked_seq_mean(low))).item())
        metrics["clip_ratio/high_max"].append(nanmax(self.accelerator.gather(masked_seq_mean(high))).item())


# ----------------------------------------------------------------------------------------------------
# The forward that replaces TRL's fused LM head


class _GRPOOutput(dict):
    """The fused GRPO call's loss and per-token values ([B, L], detached, 0 at masked tokens), by attribute. A dict,
    which DDP's search for the output's tensors walks."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def _fused_forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None,
                   **kwargs):
    """TRL's fused-LM-head protocol with logitless's ops: without ``fused_lm_head`` the model's own forward; with it,
    the decoder, then the head's call computes TRL's FusedCausalLMOutput fields, or (given a `_GRPORequest`) the
    GRPO loss."""
    head_state: _TrlHead = self.__dict__[_STATE]
    if not fused_lm_head:
        for name, value in (("labels", labels), ("shift_labels", shift_labels),
                            ("num_items_in_batch", num_items_in_batch)):
            if value is not None:
                kwargs[name] = value
        return head_state.original_forward(*args, **kwargs)
    kwargs["use_cache"] = False
    if getattr(head_state.text_config, "output_router_logits", False) or kwargs.get("output_router_logits"):
        raise ValueError("logitless: a mixture-of-experts load-balancing loss (output_router_logits) is not "
                         "computed by the fused head; set router_aux_loss_coef to 0.0")
    hidden = getattr(self, head_state.backbone_attr)(*args, **kwargs).last_hidden_state
    head = self.get_output_embeddings()
    hidden = hidden.to(head.weight.device)
    if isinstance(fused_lm_head, _GRPORequest):
        return _grpo_forward(head, head_state, hidden, fused_lm_head)
    if shift_labels is None:
        hidden, labels = hidden[:, :-1], labels[:, 1:]
    else:
        labels = shift_labels
    labels = labels.to(head.weight.device)
    mask = labels != -100
    want_entropy = "entropy" in head_state.outputs
    want_top1 = "is_top1" in head_state.outputs
    # Only the scored positions go through the head (a copy of their rows, [n, H]: small beside their logits).
    rows, ids = hidden[mask], labels[mask]
    if head_state.uniform_log_prob_grad and head_state.temperature == 1.0:
        logp, entropy, top1 = linear_head_loss(head, _score_uniform, rows, ids, state=head_state)
        entropy, top1 = (entropy if want_entropy else None), (top1 if want_top1 else None)
    else:
        logp, entropy, top1 = linear_head_loss(head, _score, rows, ids, state=head_state, want_entropy=want_entropy,
                                               want_top1=want_top1)
    # masked_scatter keeps the output connected to the graph when no label is scored (a zero with a gradient).
    log_probs = logp.new_zeros(mask.shape).masked_scatter(mask, logp)
    entropy = None if entropy is None else entropy.new_zeros(mask.shape).masked_scatter(mask, entropy)
    is_top1 = None if top1 is None else top1.new_zeros(mask.shape).masked_scatter(mask, top1)
    count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    from trl.trainer.utils import FusedCausalLMOutput

    return FusedCausalLMOutput(loss=-log_probs.sum() / count, log_probs=log_probs, entropy=entropy, is_top1=is_top1,
                               label_mask=mask)


def _operands(h: Tensor, weight: Tensor, bias: Optional[Tensor], state: _TrlHead):
    """The head's operands as TRL's fused head computes with them: float32 when it casts the head, the autocast dtype
    under autocast (the fused op is not autocast itself), the logit scale folded into the rows."""
    device_type = h.device.type
    if state.cast_lm_head_to_fp32:
        h, weight = h.float(), weight.float()
        bias = None if bias is None else bias.float()
    elif torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        h, weight = h.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    elif h.dtype != weight.dtype:
        h = h.to(weight.dtype)
    if state.logit_scale != 1.0:
        # scale * (h W^T + b) = (scale h) W^T + scale b
        h = h * state.logit_scale
        bias = None if bias is None else bias * state.logit_scale
    return h, weight, bias


def _score(h: Tensor, weight: Tensor, ids: Tensor, bias: Optional[Tensor] = None, *, state: _TrlHead,
           want_entropy: bool, want_top1: bool):
    """(log_probs, entropy or None, is_top1 or None) of the rows `h` at `ids`; run as the head's forward."""
    h, weight, bias = _operands(h, weight, bias, state)
    # The operands are in the compute dtype now (TRL turns autocast off for a head cast to float32). is_top1 comes
    # from the same pass over the logits as the log-probs: a positive scale or temperature does not move the argmax.
    with torch.autocast(h.device.type, enabled=False):
        logp, entropy, *top1 = linear_selective_log_softmax(h, weight, ids, bias, temperature=state.temperature,
                                                            return_entropy=True, return_top1=want_top1)
    return logp, (entropy if want_entropy else None), (top1[0] if top1 else None)


def _score_uniform(h: Tensor, weight: Tensor, ids: Tensor, bias: Optional[Tensor] = None, *, state: _TrlHead):
    """As `_score` (temperature 1), for a trainer whose log-probs' upstream gradient is one value for every token:
    the linear cross-entropy's per-token losses with their gradient computed in the forward, entropy and is_top1
    from the same pass; log-probs = -losses."""
    h, weight, bias = _operands(h, weight, bias, state)
    with torch.autocast(h.device.type, enabled=False):
        loss, entropy, top1 = token_losses_uniform_grad(h, weight, ids, bias)
    return -loss, entropy, top1


def _grpo_forward(head, state: _TrlHead, hidden: Tensor, request: _GRPORequest):
    length = request.completion_ids.shape[1]
    # Positions P-1 .. T-1 of the whole sequence's states: position l predicts completion token l, the last one is
    # unused (linear_grpo_loss's implicit shift).
    h = hidden[:, -(length + 1):]
    loss, per_token = linear_head_loss(head, _policy_loss, h, request.completion_ids, request.advantages,
                                       state=state, request=request)
    return _GRPOOutput(loss=loss, log_probs=per_token.logp, entropy=per_token.entropy, kl=per_token.kl,
                       is_clipped=per_token.is_clipped)


def _policy_loss(h: Tensor, weight: Tensor, completion_ids: Tensor, advantages: Tensor, bias: Optional[Tensor] = None,
                 *, state: _TrlHead, request: _GRPORequest):
    h, weight, bias = _operands(h, weight, bias, state)
    with torch.autocast(h.device.type, enabled=False):
        return linear_grpo_loss(h, weight, completion_ids, advantages, bias=bias,
                                completion_mask=request.completion_mask, old_logp=request.old_logp,
                                ref_logp=request.ref_logp, temperature=state.temperature, return_per_token=True,
                                **request.options)
