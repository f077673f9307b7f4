"""torch.nn modules over the logitless ops."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .cross_entropy import cross_entropy

__all__ = ["CrossEntropyLoss"]


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
