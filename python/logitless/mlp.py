"""A gated MLP, ``down(act(gate(x)) * up(x))``, that keeps only x, gate and up for the backward.

Run as separate modules, the MLP saves x, gate and up (for the gated unit's backward) and also the unit's output h
(for down's weight gradient): a [tokens, intermediate] tensor per layer, the largest activation a decoder layer
keeps. `gated_mlp` recomputes h in the backward from the saved gate and up (one fused pass, as its forward), and
writes the gradients of gate and up over the saved gate and up, which belong to it alone. That recompute is the
whole cost: a read of gate and up and a write of h, beside the MLP's three GEMMs.

When x is the unchanged output of an eager `logitless.rms_norm` call (a decoder layer's post-attention norm), x is
not saved either: the norm's backward already keeps what it normalized, and the MLP's backward recomputes x from
that with one more norm forward (`_norm_recipes`): one [tokens, hidden] tensor less per layer.

Under activation checkpointing (torch.utils.checkpoint, non-reentrant) both savings are moot: nothing saved outlives
the layer's backward, and the layer's forward reruns before it anyway. There h and x are saved as they are, instead of
being computed a third time.

Eager calls run `_GatedMLP` (an autograd.Function over F.linear and the gated unit's C++ entry points). Under
torch.compile the composition of F.linear and `logitless.glu` is traced instead: the compiler plans its own
buffers and decides itself what to recompute.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _norm_recipes
from ._autograd import checkpointed, eager_ok, enum, no_double_backward
from .glu import ACTIVATIONS, ALGOS, _run_backward, _run_forward, glu

__all__ = ["gated_mlp"]

_AUTO = ALGOS["auto"]


def _unit(gate: Tensor, up: Optional[Tensor], act: int) -> Tensor:
    """act(gate) * up (up None: the halves of the concatenated gate_up)."""
    shape = gate.shape if up is not None else gate.shape[:-1] + (gate.shape[-1] // 2,)
    h = torch.empty(shape, dtype=gate.dtype, device=gate.device)
    _run_forward(gate, up, act, _AUTO, h)
    return h


def _sum_rows(t2: Tensor, like: Optional[Tensor], needed: bool) -> Optional[Tensor]:
    return t2.sum(0).to(like.dtype) if needed and like is not None else None


class _GatedMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, b_gate, b_up, b_down, act):
        gate = F.linear(x, w_gate, b_gate)
        up = None if w_up is None else F.linear(x, w_up, b_up)
        h = _unit(gate, up, act)
        y = F.linear(h, w_down, b_down)
        # Under activation checkpointing the layer's forward runs again before its backward: h kept from that run
        # costs no memory past this layer's backward, so it is saved rather than computed a third time.
        ctx.keep_h = checkpointed()
        # x straight from an eager rms_norm: keep what the norm's backward keeps anyway and recompute x from it.
        made = _norm_recipes.recipe(x)
        ctx.x_inputs, ctx.recompute_x = (len(made[0]), made[1]) if made else (1, None)
        ctx.save_for_backward(*(made[0] if made else (x,)), gate, up, w_gate, w_up, w_down,
                              h if ctx.keep_h else None)
        ctx.act, ctx.has_bias = act, (b_gate is not None, b_up is not None, b_down is not None)
        ctx.consumed = False
        ctx.set_materialize_grads(False)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        no_double_backward("gated_mlp")
        if ctx.consumed:  # the saved gate and up hold gradients now
            raise RuntimeError("logitless.gated_mlp: a second backward through the same forward (retain_graph=True) "
                               "is not supported: the first one wrote its gradients over the saved activations")
        if grad_y is None:
            return (None,) * 8
        saved = ctx.saved_tensors
        k = ctx.x_inputs
        x = ctx.recompute_x(*saved[:k]) if ctx.recompute_x else saved[0]
        gate, up, w_gate, w_up, w_down, h = saved[k:]
        need = ctx.needs_input_grad
        dy2 = grad_y.reshape(-1, grad_y.shape[-1])
        if h is None:
            h = _unit(gate, up, ctx.act)
        h2 = h.reshape(-1, h.shape[-1])
        grad_w_down = dy2.t().mm(h2).to(w_down.dtype) if need[3] else None
        grad_b_down = _sum_rows(dy2, w_down, need[6])
        # d(loss)/dh into h's own buffer: h is not needed past down's weight gradient.
        torch.mm(dy2, w_down.to(dy2.dtype), out=h2)
        ctx.consumed = True
        _run_backward(h, gate, up, ctx.act, _AUTO, gate, up)  # over the saved gate and up: no one else holds them
        del h, h2
        x2 = x.reshape(-1, x.shape[-1])
        g2 = gate.reshape(-1, gate.shape[-1])
        u2 = None if up is None else up.reshape(-1, up.shape[-1])
        grad_x = None
        if need[0]:
            grad_x = g2.mm(w_gate.to(g2.dtype))
            if u2 is not None:
                grad_x.addmm_(u2, w_up.to(u2.dtype))
            grad_x = grad_x.reshape(x.shape).to(x.dtype)
        grad_w_gate = g2.t().mm(x2.to(g2.dtype)).to(w_gate.dtype) if need[1] else None
        grad_w_up = u2.t().mm(x2.to(u2.dtype)).to(w_up.dtype) if u2 is not None and need[2] else None
        grad_b_gate = _sum_rows(g2, w_gate, need[4])
        grad_b_up = _sum_rows(u2, w_up, need[5]) if u2 is not None else None
        return grad_x, grad_w_gate, grad_w_up, grad_w_down, grad_b_gate, grad_b_up, grad_b_down, None


def _composed(x, w_gate, w_up, w_down, b_gate, b_up, b_down, activation):
    gate = F.linear(x, w_gate, b_gate)
    up = None if w_up is None else F.linear(x, w_up, b_up)
    return F.linear(glu(gate, up, activation=activation), w_down, b_down)


def gated_mlp(x: Tensor, gate_weight: Tensor, up_weight: Optional[Tensor], down_weight: Tensor,
              gate_bias: Optional[Tensor] = None, up_bias: Optional[Tensor] = None,
              down_bias: Optional[Tensor] = None, *, activation: str = "silu") -> Tensor:
    """``F.linear(glu(F.linear(x, gate_weight, gate_bias), F.linear(x, up_weight, up_bias)), down_weight,
    down_bias)``, saving x, gate and up only (see the module's docstring).

    Args:
        x: [*, H], float32, float16 or bfloat16 (float64 on the CPU).
        gate_weight: [I, H]; with ``up_weight=None`` the concatenated [2I, H] (gate rows first, then up: Phi-3's
            gate_up_proj).
        up_weight: [I, H] or None.
        down_weight: [H_out, I].
        gate_bias, up_bias, down_bias: optional biases of the three projections (with ``up_weight=None``,
            gate_bias is the [2I] bias of the concatenated projection).
        activation: ``"silu"`` (SwiGLU), ``"gelu_tanh"`` or ``"gelu"`` (GeGLU), as `logitless.glu`.

    Under ``torch.autocast`` the operands are cast to its dtype first, as F.linear would cast them; the gradients
    flow back through those casts to the original dtypes.

    Raises:
        ValueError: an unknown activation, or shapes that do not chain (named).
        RuntimeError: a second backward through one forward (retain_graph=True), or a double backward.
    """
    act = enum(ACTIVATIONS, activation, "activation")
    if gate_weight.dim() != 2 or down_weight.dim() != 2 or \
            (up_weight is not None and up_weight.shape != gate_weight.shape):
        raise ValueError(f"gate_weight, up_weight, down_weight: expected [I, H], [I, H] (or None with gate_weight "
                         f"[2I, H]) and [H_out, I], got {list(gate_weight.shape)}, "
                         f"{None if up_weight is None else list(up_weight.shape)}, {list(down_weight.shape)}")
    inter = gate_weight.shape[0] if up_weight is not None else gate_weight.shape[0] // 2
    if x.shape[-1:] != gate_weight.shape[1:] or down_weight.shape[1] != inter or \
            (up_weight is None and gate_weight.shape[0] % 2):
        raise ValueError(f"x, gate_weight, down_weight: expected x [*, H] with gate_weight [I, H] (or [2I, H]) and "
                         f"down_weight [H_out, I], got {list(x.shape)}, {list(gate_weight.shape)}, "
                         f"{list(down_weight.shape)}")
    operands = (x, gate_weight, up_weight, down_weight, gate_bias, up_bias, down_bias)
    if not eager_ok(operands):  # compiling, a mode, a tensor subclass or a meta tensor: the traceable composition
        return _composed(*operands, activation)
    device = x.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        operands = tuple(t.to(dtype) if t is not None and t.is_floating_point() else t for t in operands)
        with torch.autocast(device, enabled=False):
            return _GatedMLP.apply(*operands, act)
    return _GatedMLP.apply(*operands, act)
