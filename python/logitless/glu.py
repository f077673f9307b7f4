"""Gated linear units (SwiGLU, GeGLU): the torch ops (custom_op + fake + autograd) and `swiglu`, `geglu`, `glu`.

Ops (namespace ``logitless``). ``up`` is optional everywhere: without it ``gate`` is the concatenated
projection gate_up [*, 2I] (first half gate, second half up, as Phi-3 computes it) and its gradient comes back as
one [*, 2I] tensor.

* ``glu_forward``: y = act(gate) * up in one read of gate and up and one write of y.
* ``glu_backward``: (grad_gate, grad_up) in one read of grad_y, gate and up and one write of each gradient; the
  activation is recomputed from gate. Without up, grad_gate is the [*, 2I] gradient of gate_up and grad_up is an
  empty tensor (a custom op cannot return None).
* ``glu_backward_``: the same, with the gradients written over gate and up (or gate_up) themselves. It declares
  that mutation (``mutates_args``), so torch bumps their version counter and any other autograd node that saved
  them raises "modified by an inplace operation" instead of reading a gradient.

The forward's registered autograd saves gate and up, which the model holds anyway (they are the outputs of its
projections); nothing else is kept between the passes.

Eager calls run the ops' implementations directly, without the custom-op dispatch (`logitless._autograd.custom_op`
says when and why); that path is also the only one that writes the gradients in place (``inplace_backward``: the
compiler plans its own buffers). Under torch.compile the ops are the path; both run the same code.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _C
from ._autograd import cached, custom_op, enum, no_double_backward
from ._tensor import descriptor, rows_ready, stream

__all__ = ["glu", "swiglu", "geglu", "ACTIVATIONS"]

# Must match logitless::GLUActivation and logitless::GLUAlgo (include/logitless/glu.h).
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1, "gelu": 2}
ALGOS = {"auto": 0, "vector": 1, "scalar": 2}


def _options(activation: int, algo: int) -> _C.GLUOptions:
    """The ops' option arguments (the C++ enum values) as the binding's GLUOptions."""
    return _C.GLUOptions(activation=activation, algo=algo)


_cached_options = cached(_options)


def _halves(gate: Tensor, up: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """(gate, up): the two given tensors, or the two halves of a concatenated gate_up."""
    if up is not None:
        return gate, up
    inter = gate.shape[-1] // 2
    return gate[..., :inter], gate[..., inter:]


def _out_shape(gate: Tensor, up: Optional[Tensor]):
    return gate.shape if up is not None else gate.shape[:-1] + (gate.shape[-1] // 2,)


def _check_concatenated(gate: Tensor) -> None:
    if gate.dim() < 1 or gate.shape[-1] % 2 != 0:
        raise ValueError(f"gate: expected the concatenated gate_up [*, 2I] (a last dimension of even size, since up "
                         f"is None), got shape {list(gate.shape)}")


def _run_forward(gate: Tensor, up: Optional[Tensor], activation: int, algo: int, y: Tensor) -> None:
    g, u = _halves(gate, up)
    _C.glu_forward(descriptor(g, "gate"), descriptor(u, "up"), _cached_options(activation, algo), descriptor(y, "y"),
                   stream(gate.device))


def _run_backward(grad_y: Tensor, gate: Tensor, up: Optional[Tensor], activation: int, algo: int,
                  grad_gate: Tensor, grad_up: Optional[Tensor]) -> None:
    """The C++ backward. Without up, grad_gate is the [*, 2I] gradient of gate_up (grad_up is ignored)."""
    g, u = _halves(gate, up)
    dg, du = _halves(grad_gate, grad_up)
    _C.glu_backward(descriptor(grad_y, "grad_y"), descriptor(g, "gate"), descriptor(u, "up"),
                    _cached_options(activation, algo), descriptor(dg, "grad_gate"), descriptor(du, "grad_up"),
                    stream(gate.device))


def _empty(shape, like: Tensor) -> Tensor:
    return torch.empty(shape, dtype=like.dtype, device=like.device)


# ----------------------------------------------------------------------------------------------------
# The ops. After the tensors, every op takes the arguments of `_options` (custom ops take plain scalars).


@custom_op("logitless::glu_forward")
def _forward(gate: Tensor, up: Optional[Tensor], activation: int, algo: int) -> Tensor:
    """act(gate) * up, or act(gate_up[..., :I]) * gate_up[..., I:] without up."""
    gate = rows_ready(gate)
    up = None if up is None else rows_ready(up)
    y = _empty(_out_shape(gate, up), gate)
    _run_forward(gate, up, activation, algo, y)
    return y


@_forward.register_fake
def _(gate, up, activation, algo):
    return _empty(_out_shape(gate, up), gate)


@custom_op("logitless::glu_backward")
def _backward(grad_y: Tensor, gate: Tensor, up: Optional[Tensor], activation: int,
              algo: int) -> Tuple[Tensor, Tensor]:
    """(grad_gate, grad_up); without up, grad_gate is the [*, 2I] gradient of gate_up and grad_up is empty."""
    grad_y, gate = rows_ready(grad_y), rows_ready(gate)
    up = None if up is None else rows_ready(up)
    grad_gate = _empty(gate.shape, gate)
    grad_up = _empty(up.shape if up is not None else (0,), gate)
    _run_backward(grad_y, gate, up, activation, algo, grad_gate, None if up is None else grad_up)
    return grad_gate, grad_up


@_backward.register_fake
def _(grad_y, gate, up, activation, algo):
    return _empty(gate.shape, gate), _empty(up.shape if up is not None else (0,), gate)


@custom_op("logitless::glu_backward_", mutates_args=("gate", "up"))
def _backward_inplace(grad_y: Tensor, gate: Tensor, up: Optional[Tensor], activation: int, algo: int) -> None:
    """grad_gate written over gate and grad_up over up (or the gradient of gate_up over gate_up). gate and up must
    have their last dimension contiguous and not overlap each other."""
    _run_backward(rows_ready(grad_y), gate, up, activation, algo, gate, up)


@_backward_inplace.register_fake
def _(grad_y, gate, up, activation, algo):
    return None


# ----------------------------------------------------------------------------------------------------
# Autograd.


def _writable(t: Tensor) -> bool:
    """Whether the backward may write a gradient over `t`: an activation the graph produced (it has a grad_fn, and
    so does the tensor it is a view of: never a leaf such as a parameter, nor a view into one), dense, so that the
    kernel's writes do not collide. Whether anything else still reads it is what the version counter checks."""
    if not t.requires_grad or t.grad_fn is None or not t.is_contiguous() or t.dim() == 0:
        return False
    base = t._base
    return base is None or base.grad_fn is not None


def _inplace_ok(gate: Tensor, up: Optional[Tensor]) -> bool:
    if not _writable(gate):
        return False
    if up is None:
        return True
    # Two separate tensors: both writable, and in different storages (halves of one buffer passed separately
    # take the out-of-place path; the concatenated form writes that buffer in place).
    return _writable(up) and gate.untyped_storage().data_ptr() != up.untyped_storage().data_ptr()


def _grads(ctx, grad_y: Optional[Tensor]):
    """(grad_gate, grad_up) from the saved gate and up; grad_up is None without up."""
    no_double_backward("glu")
    if grad_y is None:
        return None, None
    gate, up = ctx.saved_tensors if ctx.has_up else (ctx.saved_tensors[0], None)
    act, algo = ctx.activation, ctx.algo
    # An incoming gradient in an unusual layout (e.g. the stride-0 gradient of y.sum()) is copied: its rows must
    # collapse jointly with those of gate and up.
    grad_y = grad_y if grad_y.is_contiguous() else grad_y.contiguous()
    # `inplace` is set on the direct eager path only (glu's inplace_backward).
    if getattr(ctx, "inplace", False) and _inplace_ok(gate, up):
        # The op declares the mutation: any other node that saved gate or up now raises when it unpacks them,
        # instead of reading a gradient.
        _backward_inplace(grad_y, gate, up, act, algo)
        # Handed on as plain tensors (the saved ones carry the forward's graph).
        return gate.detach(), (None if up is None else up.detach())
    grad_gate, grad_up = _backward(grad_y, gate, up, act, algo)
    return grad_gate, (None if up is None else grad_up)


def _forward_setup(ctx, inputs, output):
    gate, up, activation, algo = inputs
    ctx.save_for_backward(*((gate,) if up is None else (gate, up)))
    ctx.has_up = up is not None
    ctx.activation, ctx.algo = activation, algo
    ctx.set_materialize_grads(False)


def _forward_grad(ctx, grad_y):
    grad_gate, grad_up = _grads(ctx, grad_y)
    return grad_gate, grad_up, None, None


_forward.register_autograd(_forward_grad, setup_context=_forward_setup)


# ----------------------------------------------------------------------------------------------------
# The public functions.


def glu(gate: Tensor, up: Optional[Tensor] = None, *, activation: str = "silu", inplace_backward: bool = False,
        algo: str = "auto") -> Tensor:
    """A gated linear unit, ``act(gate) * up``, fused: one read of gate and up and one write in the forward, and
    one read of the incoming gradient, gate and up and one write of each gradient in the backward (the activation
    is recomputed from gate, so nothing but gate and up is saved).

    Args:
        gate: [*, I] float32, float16 or bfloat16 (float64 on the CPU), CPU or CUDA: the gate projection. With
            ``up=None``, the concatenated projection gate_up [*, 2I] instead: its first half is the gate and its
            second half the up projection (Phi-3's layout); its gradient is then one [*, 2I] tensor too.
        up: [*, I], gate's dtype and shape: the up projection, or None (see gate).
        activation: ``"silu"`` (SwiGLU: Llama, Mistral, Qwen), ``"gelu_tanh"`` (GeGLU with the tanh
            approximation: Gemma's ``gelu_pytorch_tanh``) or ``"gelu"`` (the exact, erf-based GELU).
        inplace_backward: write the gradients over gate and up (or gate_up) instead of fresh buffers, saving two
            [*, I] allocations in the backward. Done only where that is safe to attempt: gate and up are
            activations the graph produced (not leaves, nor views into leaves), contiguous, and in separate storages
            (or the one gate_up); otherwise the backward silently writes fresh buffers. The mutation is declared to
            autograd (their version counters are bumped), so if anything else saved gate or up for its own
            backward, that backward raises "modified by an inplace operation" rather than read a gradient. Values of
            gate and up read after the backward (by hooks, or by code holding them) are the gradients. The incoming
            gradient is never written. Under torch.compile the backward writes fresh buffers (the compiler plans its
            own memory).
        algo: CUDA kernel, for tests and benchmarks: "auto", "vector" (16-byte accesses) or "scalar".

    Returns:
        y [*, I] in gate's dtype. The activation and the product are computed in float32 and rounded once (torch
        modules round the activation to the dtype first, so 16-bit results may differ from theirs in the last bit).

    Raises:
        ValueError: on a bad argument (dtype, shape, unknown activation), naming it.

    Double backward is not supported.
    """
    act = enum(ACTIVATIONS, activation, "activation")
    algo_code = enum(ALGOS, algo, "algo")
    if up is None:
        _check_concatenated(gate)
    return _forward(gate, up, act, algo_code, ctx_attrs=_INPLACE if inplace_backward else None)


_INPLACE = {"inplace": True}


def swiglu(gate: Tensor, up: Optional[Tensor] = None, *, inplace_backward: bool = False) -> Tensor:
    """SwiGLU, ``silu(gate) * up`` (the MLP of Llama, Mistral, Qwen); ``swiglu(gate_up)`` for a concatenated
    [*, 2I] projection. See `glu` for the arguments."""
    return glu(gate, up, activation="silu", inplace_backward=inplace_backward)


def geglu(gate: Tensor, up: Optional[Tensor] = None, *, approximate: str = "tanh",
          inplace_backward: bool = False) -> Tensor:
    """GeGLU, ``gelu(gate, approximate) * up``: ``approximate="tanh"`` is Gemma's ``gelu_pytorch_tanh``,
    ``"none"`` the exact erf-based GELU (torch.nn.functional.gelu's names). ``geglu(gate_up)`` for a concatenated
    [*, 2I] projection. See `glu` for the arguments."""
    if approximate not in ("tanh", "none"):
        raise ValueError(f"approximate: expected 'tanh' or 'none', got {approximate!r}")
    return glu(gate, up, activation="gelu_tanh" if approximate == "tanh" else "gelu",
               inplace_backward=inplace_backward)
