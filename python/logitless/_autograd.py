"""What the op modules share: the autograd helpers of the fused schedules, and the tables and constants more than
one family uses.

Every op module imports from here at its top, and this module imports none of them, so the op modules need no
import inside a function to break a cycle.

The fused schedules (cross-entropy and policy loss over logits, the linear heads, the vocabulary-parallel path)
compute the gradient in the forward pass and save it; their backward only multiplies it by the incoming gradient
(`scale_saved`, through the ``logitless::scale_rows_`` op) and refuses a double backward (`no_double_backward`).
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import _C
from ._checks import register_fake
from ._tensor import descriptor, stream

__all__ = ["REDUCTIONS", "REDUCTION_NONE", "SCHEDULES", "DEFAULT_MEMORY_BUDGET", "enum", "no_double_backward",
           "scale_saved"]

# Must match logitless::Reduction (include/logitless/cross_entropy.h); the linear cross-entropy and the
# vocabulary-parallel path use the same enum.
REDUCTIONS = {"none": 0, "sum": 1, "mean": 2}
REDUCTION_NONE = REDUCTIONS["none"]

# The linear heads' schedules and default chunk budget (linear_cross_entropy and linear_policy_loss), as the C++
# options' default memory_budget.
SCHEDULES = ("auto", "gradient_in_forward", "recompute")
DEFAULT_MEMORY_BUDGET = 512 << 20


def enum(table: dict, value, name: str) -> int:
    """The C++ enum value of the string `value` in `table`, or ValueError naming the argument and the choices."""
    code = table.get(value) if isinstance(value, str) else None
    if code is None:
        raise ValueError(f"{name}: expected one of {', '.join(map(repr, table))}, got {value!r}")
    return code


def no_double_backward(name: str) -> None:
    """Raise where a backward runs under create_graph=True, naming the public function `name`.

    Backward runs with grad mode on only under create_graph=True. The gradients computed here have no graph of
    their own, so a second derivative would silently miss this loss's term: refuse instead.
    """
    if torch.is_grad_enabled():
        raise RuntimeError(f"logitless.{name}: double backward (create_graph=True) is not supported")


@torch.library.custom_op("logitless::scale_rows_", mutates_args=("grad",), device_types=("cpu", "cuda"))
def _scale_rows(grad: Tensor, scale: Tensor) -> None:
    """grad[i, :] *= scale ([] or one per row, float32, on grad's device); rows with scale exactly 1 are
    not touched."""
    _C.scale_rows(descriptor(grad, "grad"), descriptor(scale, "scale"), stream(grad.device))


@register_fake(_scale_rows)
def _(grad, scale):
    return None


def scale_saved(grad: Tensor, scale: Tensor) -> Tensor:
    """The backward of a gradient computed in the forward: `grad` times the upstream `scale` (float32, [] or one
    per row), in place in eager mode (free: rows with scale 1 are skipped) and out of place under torch.compile.

    Functionalization turns an in-place scale of a saved tensor into a copy plus a scale of the copy, so in place
    saves nothing there, and that copy goes wrong where inductor lays the saved tensor out differently from eager:
    the copy is an as_strided with the strides traced in eager. Inductor pads the rows of intermediates (on CUDA by
    default: a float32 row of 4099 gets a stride of 4128); when the logits are a view of such a buffer (a matmul's
    output reshaped) an in-place forward writes the gradient into it and saves it with padded strides, and the copy
    read it as if contiguous. A product reads the real strides.
    """
    if torch.compiler.is_compiling():
        s = scale if scale.dim() == 0 else scale.reshape(scale.shape + (1,) * (grad.dim() - scale.dim()))
        return (grad * s).to(grad.dtype)
    _scale_rows(grad, scale)
    return grad
