"""Rotary position embedding of queries and keys: the torch op (custom_op + fake + autograd) and `rope`.

Op (namespace ``logitless``):

* ``rope``: (q_rot, k_rot) = (rotate(q), rotate(k)) in one launch for both (any number of heads each), one read
  of q and k and one write of each result; ``inverse=True`` applies the transpose of the rotation, which is the
  backward: the op's registered autograd calls the op itself with ``inverse`` flipped, so its second derivative
  is the op again. Without k, k_rot is an empty tensor (a custom op cannot return None).

The rotation is Hugging Face's ``q * cos + rotate_half(q) * sin`` over the first Dr channels (Dr = cos's last
dimension; the rest pass through), see include/logitless/rope.h. cos and sin get no gradient.

Eager calls run the op's implementation directly, without the custom-op dispatch (`logitless._autograd.custom_op`
says when and why). Rotating in place (``inplace=True``) is `_Rope`, an autograd.Function declared with
``mark_dirty``, in eager mode; under torch.compile the op is the path (an in-place call is the op followed by a copy
into q and k, which the compiler may elide).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _C
from ._autograd import custom_op, eager_ok, enum
from ._tensor import descriptor, rows_ready, stream

__all__ = ["rope"]

# Must match logitless::RopeAlgo (include/logitless/rope.h).
ALGOS = {"auto": 0, "vector": 1, "scalar": 2}


def _out_like(t: Tensor) -> Tensor:
    # The input's own layout where it is dense (a [B, T, H, D] projection seen as [B, H, T, D] stays so, as
    # torch's elementwise ops keep it), else contiguous.
    return torch.empty_like(t)


def _run(q: Tensor, k: Optional[Tensor], cos: Tensor, sin: Tensor, position_ids: Optional[Tensor], inverse: bool,
         algo: int, q_out: Tensor, k_out: Optional[Tensor]) -> None:
    _C.rope_apply(descriptor(q, "q"), descriptor(k, "k"), descriptor(cos, "cos"), descriptor(sin, "sin"),
                  descriptor(position_ids, "position_ids"), _C.RopeOptions(inverse=bool(inverse), algo=algo),
                  descriptor(q_out, "q_out"), descriptor(k_out, "k_out"), stream(q.device))


def _rotated(q: Tensor, k: Optional[Tensor], cos: Tensor, sin: Tensor, position_ids: Optional[Tensor],
             inverse: bool, algo: int) -> Tuple[Tensor, Optional[Tensor]]:
    """The rotation into fresh outputs (inputs already _last_contiguous)."""
    q_out = _out_like(q)
    k_out = None if k is None else _out_like(k)
    _run(q, k, cos, sin, position_ids, inverse, algo, q_out, k_out)
    return q_out, k_out


def _ready(q: Tensor, k: Optional[Tensor], cos: Tensor, sin: Tensor, position_ids: Optional[Tensor]):
    return (rows_ready(q), None if k is None else rows_ready(k), rows_ready(cos),
            rows_ready(sin), position_ids)


# ----------------------------------------------------------------------------------------------------
# The op.


@custom_op("logitless::rope")
def _rope(q: Tensor, k: Optional[Tensor], cos: Tensor, sin: Tensor, position_ids: Optional[Tensor], inverse: bool,
          algo: int) -> Tuple[Tensor, Tensor]:
    """(q_rot, k_rot); k_rot is empty without k. inverse: the transpose of the rotation (the backward)."""
    q, k, cos, sin, position_ids = _ready(q, k, cos, sin, position_ids)
    q_out, k_out = _rotated(q, k, cos, sin, position_ids, inverse, algo)
    return q_out, (k_out if k_out is not None else q.new_empty((0,)))


@_rope.register_fake
def _(q, k, cos, sin, position_ids, inverse, algo):
    return _out_like(rows_ready(q)), (_out_like(rows_ready(k)) if k is not None else q.new_empty((0,)))


def _grads(grad_q: Optional[Tensor], grad_k: Optional[Tensor], cos, sin, position_ids, inverse: bool, algo: int):
    """(grad_q, grad_k): the transposed rotation of the incoming gradients (either may be None), through the op, so
    that under create_graph=True its own derivative (the rotation) is recorded."""
    if grad_q is None and grad_k is None:
        return None, None

    def rotate(a, b):
        ra, rb = _rope(a, b, cos, sin, position_ids, inverse, algo)
        return ra, (rb if b is not None else None)

    if grad_q is None:  # the rotation is the same for any head: k's gradient alone goes in as the first operand
        return None, rotate(grad_k, None)[0]
    return rotate(grad_q, grad_k)


def _setup(ctx, inputs, output):
    q, k, cos, sin, position_ids, inverse, algo = inputs
    ctx.save_for_backward(cos, sin, position_ids)
    ctx.inverse, ctx.algo, ctx.has_k = inverse, algo, k is not None
    ctx.set_materialize_grads(False)


def _rope_grad(ctx, grad_q, grad_k):
    cos, sin, position_ids = ctx.saved_tensors
    gq, gk = _grads(grad_q, grad_k if ctx.has_k else None, cos, sin, position_ids, not ctx.inverse, ctx.algo)
    return gq, gk, None, None, None, None, None


_rope.register_autograd(_rope_grad, setup_context=_setup)


class _Rope(torch.autograd.Function):
    """The eager in-place rotation of q and k (declared with mark_dirty, so autograd versions them as it does torch's
    own in-place ops), the same C++ call as the op. Returns (q, k), or q alone without k (a Function that modifies a
    view in place may return one tensor only)."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, position_ids, algo):
        ctx.save_for_backward(cos, sin, position_ids)
        ctx.algo = algo
        ctx.set_materialize_grads(False)
        _run(q, k, cos, sin, position_ids, False, algo, q, k)
        ctx.mark_dirty(*((q,) if k is None else (q, k)))
        return q if k is None else (q, k)

    @staticmethod
    def backward(ctx, grad_q, grad_k=None):
        cos, sin, position_ids = ctx.saved_tensors
        gq, gk = _grads(grad_q, grad_k, cos, sin, position_ids, True, ctx.algo)
        return gq, gk, None, None, None, None


def _apply_inplace(q, k, cos, sin, position_ids, algo):
    out = _Rope.apply(q, k, cos, sin, position_ids, algo)
    return (out, None) if k is None else out


# ----------------------------------------------------------------------------------------------------
# The public function.


def _tables(t: Tensor) -> Tensor:
    # Hugging Face's apply_rotary_pos_emb unsqueezes cos and sin to [B, 1, T, Dr] for the heads; the squeezed form
    # is what the kernels index.
    if t.dim() == 4 and t.shape[1] == 1:
        t = t.squeeze(1)
    return rows_ready(t)


def rope(q: Tensor, k: Optional[Tensor], cos: Tensor, sin: Tensor, position_ids: Optional[Tensor] = None,
         inplace: bool = False, *, algo: str = "auto") -> Tuple[Tensor, Optional[Tensor]]:
    """Rotary position embedding of q and k in one kernel, in Hugging Face's convention:
    ``q * cos + rotate_half(q) * sin`` (``apply_rotary_pos_emb``), with partial rotary where cos and sin are
    narrower than the head dimension (the first Dr channels rotate, the rest pass through: Phi, GLM, StableLM).

    Args:
        q: [B, Hq, T, D] float32, float16 or bfloat16 (float64 on the CPU), CPU or CUDA; any strides with the last
            dimension contiguous (the usual ``proj(x).view(B, T, H, D).transpose(1, 2)`` goes in without a copy).
        k: [B, Hk, T, D] in q's dtype, or None; Hk may differ from Hq (grouped-query attention).
        cos, sin: what the model's rotary module returns: [B or 1, T, Dr] (or [T, Dr], or the [B, 1, T, Dr] that
            apply_rotary_pos_emb unsqueezes), float32 or q's dtype, Dr even and <= D. Llama-3's frequency scaling
            and the other rope variants only change these values. They get no gradient (an error if they require
            one).
        position_ids: optional [B, T] or [1, T] (int32/int64): then cos and sin are tables [P, Dr] whose row p is
            position p, and token t of sequence b takes row position_ids[b, t]. A position outside [0, P) raises on
            the CPU; on CUDA it cannot be checked without a sync, so that token's rotated channels come out NaN.
        inplace: rotate q and k in their own storage and return them (the mutation is declared to autograd, which
            raises if anything saved q or k, or if either is a leaf that requires grad). Default: new tensors in
            q's and k's layout.
        algo: CUDA kernel, for tests and benchmarks: "auto", "vector" (16-byte accesses) or "scalar".

    Returns:
        (q_rot, k_rot), k_rot None without k. Arithmetic in float32, one rounding to the dtype (torch's expression
        rounds each product and the sum, so 16-bit results may differ from it in the last bit).

    Raises:
        ValueError: on a bad argument (dtype, shape, rotary width, position out of range on the CPU), naming it.
    """
    code = enum(ALGOS, algo, "algo")
    cos, sin = _tables(cos), _tables(sin)
    if torch.is_grad_enabled():
        for t, name in ((cos, "cos"), (sin, "sin")):
            if t.requires_grad:
                raise ValueError(f"{name}: expected a tensor that does not require grad (rope gives cos and sin no "
                                 f"gradient; detach them), got one that requires grad")
    if inplace and not eager_ok((q, k, cos, sin, position_ids)):  # traced (or a mode, a subclass): the op, copied
        q_rot, k_rot = _rope(q, k, cos, sin, position_ids, False, code)
        q.copy_(q_rot)
        if k is not None:
            k.copy_(k_rot)
        return q, k
    needs_graph = torch.is_grad_enabled() and (q.requires_grad or (k is not None and k.requires_grad))
    if inplace:
        if not needs_graph:
            _run(q, k, cos, sin, position_ids, False, code, q, k)
            return q, k
        if q._base is None and (k is None or k._base is None):
            return _apply_inplace(q, k, cos, sin, position_ids, code)
        # Autograd lets a Function that modifies a view in place return that one tensor only: q and k (views of
        # their projections, as a model makes them) are then rotated by one launch each.
        q = _Rope.apply(q, None, cos, sin, position_ids, code)
        if k is not None:
            k = _Rope.apply(k, None, cos, sin, position_ids, code)
        return q, k
    q_rot, k_rot = _rope(q, k, cos, sin, position_ids, False, code)
    return q_rot, (None if k is None else k_rot)
