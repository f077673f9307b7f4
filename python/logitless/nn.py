"""torch.nn modules over the logitless ops."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .cross_entropy import cross_entropy
from .linear_cross_entropy import DEFAULT_MEMORY_BUDGET, linear_cross_entropy
from .rms_norm import CASTING_MODES, rms_norm

__all__ = ["CrossEntropyLoss", "LinearCrossEntropyLoss", "RMSNorm"]


class CrossEntropyLoss(torch.nn.Module):
    """Drop-in for ``torch.nn.CrossEntropyLoss`` computed by ``logitless.cross_entropy``.

    The constructor takes torch's arguments in torch's order (weight, size_average, ignore_index, reduce,
    reduction, label_smoothing; size_average and reduce are torch's deprecated spellings of reduction)
    plus the keyword-only z_loss, softcap and inplace_backward of ``logitless.cross_entropy``.

    Shapes differ in one respect: the class dimension is LAST. ``forward(input, target)`` takes input
    [*, V] and target [*] (class indices), e.g. [B, T, V] logits with [B, T] targets as a language model
    produces them, where torch wants [N, C, d1, ...] with the classes in dimension 1. For 2-D [N, C]
    input the two agree. Class-probability targets (float target of the input's shape) are not supported.

    The loss is float32 whatever the input's dtype; a mean over only ignored rows is 0 (torch: NaN).
    ``weight`` is a buffer, as in torch, so ``.to(device)`` moves it.
    """

    def __init__(
        self,
        weight: Optional[Tensor] = None,
        size_average=None,
        ignore_index: int = -100,
        reduce=None,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
        *,
        z_loss: float = 0.0,
        softcap: Optional[float] = None,
        inplace_backward: bool = False,
    ) -> None:
        super().__init__()
        if size_average is not None or reduce is not None:
            reduction = torch.nn._reduction.legacy_get_string(size_average, reduce)
        self.register_buffer("weight", weight)
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.z_loss = z_loss
        self.softcap = softcap
        self.inplace_backward = inplace_backward

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        return cross_entropy(input, target, weight=self.weight, ignore_index=self.ignore_index,
                             reduction=self.reduction, label_smoothing=self.label_smoothing, z_loss=self.z_loss,
                             softcap=self.softcap, inplace_backward=self.inplace_backward)

    def extra_repr(self) -> str:
        parts = [f"ignore_index={self.ignore_index}", f"reduction={self.reduction!r}"]
        for name, off in (("label_smoothing", 0.0), ("z_loss", 0.0), ("softcap", None), ("inplace_backward", False)):
            if getattr(self, name) != off:
                parts.append(f"{name}={getattr(self, name)!r}")
        return ", ".join(parts)


class LinearCrossEntropyLoss(torch.nn.Module):
    """Cross-entropy of a linear head's logits from its hidden states: ``logitless.linear_cross_entropy``.

    ``LinearCrossEntropyLoss(ignore_index=-100, reduction="mean", label_smoothing=0.0, *, z_loss=0.0,
    softcap=None, class_weight=None, schedule="auto", chunk_tokens=None, chunk_vocab=None,
    memory_budget=512 MiB, grad_weight_accumulation="float32")``; ``forward(hidden, weight, target, bias=None)``
    with hidden [*, H], weight [V, H] (e.g. ``model.lm_head.weight``), target [*], and returns the float32 loss.
    ``class_weight`` (torch's cross-entropy ``weight``) is a buffer, so ``.to(device)`` moves it. The argument order
    of ``forward`` is the function's (hidden first; Liger's module takes the weight first).
    """

    def __init__(
        self,
        ignore_index: int = -100,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
        *,
        z_loss: float = 0.0,
        softcap: Optional[float] = None,
        class_weight: Optional[Tensor] = None,
        schedule: str = "auto",
        chunk_tokens: Optional[int] = None,
        chunk_vocab: Optional[int] = None,
        memory_budget: int = DEFAULT_MEMORY_BUDGET,
        grad_weight_accumulation: str = "float32",
    ) -> None:
        super().__init__()
        self.register_buffer("class_weight", class_weight)
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.z_loss = z_loss
        self.softcap = softcap
        self.schedule = schedule
        self.chunk_tokens = chunk_tokens
        self.chunk_vocab = chunk_vocab
        self.memory_budget = memory_budget
        self.grad_weight_accumulation = grad_weight_accumulation

    def forward(self, hidden: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor] = None) -> Tensor:
        return linear_cross_entropy(hidden, weight, target, bias, ignore_index=self.ignore_index,
                                    reduction=self.reduction, label_smoothing=self.label_smoothing,
                                    z_loss=self.z_loss, softcap=self.softcap, class_weight=self.class_weight,
                                    schedule=self.schedule, chunk_tokens=self.chunk_tokens,
                                    chunk_vocab=self.chunk_vocab, memory_budget=self.memory_budget,
                                    grad_weight_accumulation=self.grad_weight_accumulation)

    def extra_repr(self) -> str:
        parts = [f"ignore_index={self.ignore_index}", f"reduction={self.reduction!r}"]
        for name, off in (("label_smoothing", 0.0), ("z_loss", 0.0), ("softcap", None), ("schedule", "auto"),
                          ("chunk_tokens", None), ("chunk_vocab", None), ("memory_budget", DEFAULT_MEMORY_BUDGET),
                          ("grad_weight_accumulation", "float32")):
            if getattr(self, name) != off:
                parts.append(f"{name}={getattr(self, name)!r}")
        return ", ".join(parts)


class RMSNorm(torch.nn.Module):
    """RMSNorm over the last dimension computed by ``logitless.rms_norm`` (see it for the formulas).

    ``RMSNorm(hidden_size, eps=1e-6, offset=0.0, casting_mode="llama")`` has a [hidden_size] weight
    initialized to ones, or to zeros when offset != 0 (zero-centered weights, as Gemma's). ``forward(x)``
    returns y; ``forward(x, residual)`` returns ``(rms_norm(x + residual), x + residual)``.

    ``RMSNorm.from_module(m)`` wraps a Hugging Face RMSNorm module: it keeps the module's weight Parameter
    (the same object, so optimizers and state dicts see no change) and its eps (``variance_epsilon`` or
    ``eps``). Gemma's modules (class names starting with "Gemma", except Gemma3n's, whose weight is not
    zero-centered) get offset=1.0 and casting "gemma"; Gemma3n's get offset 0 and casting "gemma"; a module
    that carries ``offset`` / ``casting_mode`` attributes keeps them; everything else is Llama-style. Pass
    offset= or casting_mode= to override the detection (e.g. OLMo-2 multiplies in float32 and rounds once:
    casting_mode="gemma" with offset 0).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, offset: float = 0.0, casting_mode: str = "llama",
                 device=None, dtype=None) -> None:
        super().__init__()
        init = torch.zeros if offset != 0 else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, device=device, dtype=dtype))
        self.eps = eps
        self.offset = offset
        self.casting_mode = casting_mode

    def forward(self, x: Tensor, residual: Optional[Tensor] = None):
        return rms_norm(x, self.weight, eps=self.eps, offset=self.offset, casting_mode=self.casting_mode,
                        residual=residual)

    @classmethod
    def from_module(cls, module: torch.nn.Module, *, offset: Optional[float] = None,
                    casting_mode: Optional[str] = None) -> RMSNorm:
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.nn.Parameter) or weight.dim() != 1:
            raise ValueError(f"module: expected an RMSNorm module with a 1-d weight Parameter, got "
                             f"{type(module).__name__} with weight {None if weight is None else tuple(weight.shape)}")
        eps = None
        for name in ("variance_epsilon", "eps", "epsilon"):
            if isinstance(getattr(module, name, None), (int, float)):
                eps = float(getattr(module, name))
                break
        if eps is None:
            raise ValueError(f"module: expected an eps attribute (variance_epsilon or eps), got none on "
                             f"{type(module).__name__}")
        name = type(module).__name__.lower()
        if name.startswith("gemma3n"):
            det_offset, det_casting = 0.0, "gemma"
        elif name.startswith("gemma"):
            det_offset, det_casting = 1.0, "gemma"
        else:
            det_offset = float(getattr(module, "offset", 0.0))
            det_casting = getattr(module, "casting_mode", "llama")
            if det_casting not in CASTING_MODES:
                det_casting = "llama"
        norm = cls.__new__(cls)
        torch.nn.Module.__init__(norm)
        norm.weight = weight
        norm.eps = eps
        norm.offset = det_offset if offset is None else float(offset)
        norm.casting_mode = det_casting if casting_mode is None else casting_mode
        return norm

    def extra_repr(self) -> str:
        parts = [f"{self.weight.shape[0]}", f"eps={self.eps}"]
        if self.offset != 0:
            parts.append(f"offset={self.offset}")
        parts.append(f"casting_mode={self.casting_mode!r}")
        return ", ".join(parts)
