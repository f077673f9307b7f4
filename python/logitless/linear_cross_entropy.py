"""Fused linear cross-entropy: the loss of a language model's head from its hidden states, the logits
``hidden @ weight.T (+ bias)`` never held in full. The torch ops (custom_op + fake + autograd) and
`linear_cross_entropy`.

Two schedules (include/logitless/linear_cross_entropy.h has the details), both exact:

* gradient in the forward (reduction sum/mean): ``logitless::linear_cross_entropy_forward_backward_out``
  computes the loss and the gradients for hidden, weight and bias in one pass over token chunks (three GEMMs in
  all) into buffers allocated inside `_FusedLinearCrossEntropy`; its backward multiplies them by the incoming
  gradient in place (``logitless::scale_rows_``, which skips a factor of exactly 1, so the usual
  ``loss.backward()`` costs three small launches) and hands them on. Why an autograd.Function around a
  mutating op rather than a functional op: see `logitless.cross_entropy._FusedCrossEntropy`, the same design.
* recompute (reduction none, float16 inputs, or ``schedule="recompute"``): ``logitless::linear_cross_entropy_
  forward`` keeps the per-token lse; its registered backward ``logitless::linear_cross_entropy_backward``
  recomputes the logits a vocabulary chunk at a time (four GEMMs in all, the least memory).

float16 takes the recompute schedule under "auto": its gradient of the logits, formed before the incoming
gradient is known, would be too small for float16 (a loss scaler's factor arrives only in the backward) and
flush to zero; the recompute backward forms it with that factor applied. For bfloat16 on CUDA, "auto" asks the
library's cost model (``logitless::linear_cross_entropy_recompute_is_faster``): where the memory budget forces the
gradient-in-forward schedule to sum grad_weight over many token groups in float32 (large V·H with a small budget,
or with the generic kernels at V=256000), the recompute schedule's fourth GEMM costs less.
"""
from __future__ import annotations

import inspect
from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from . import _C
from ._autograd import (
    DEFAULT_MEMORY_BUDGET,
    REDUCTION_NONE,
    REDUCTIONS,
    SCHEDULES,
    autocast_dtype,
    cached,
    cast_operands,
    custom_op,
    enum,
    no_double_backward,
    scale_saved,
)
from ._checks import check_bias, check_float, check_int64, check_process_group, check_rows, check_tensors, register_fake
from ._tensor import DEVICE_CODES, DTYPE_CODES, descriptor, rows_ready, stream, workspace
from .heads import refuse_sharded_weight

__all__ = ["linear_cross_entropy", "auto_schedule", "SCHEDULES", "DEFAULT_MEMORY_BUDGET", "GRAD_WEIGHT_ACCUMULATIONS"]

# Must match logitless::GradWeightAccumulation (include/logitless/linear_cross_entropy.h).
GRAD_WEIGHT_ACCUMULATIONS = {"float32": 0, "weight_dtype": 1}

# ----------------------------------------------------------------------------------------------------
# Calls into C++. Every op takes, after its tensors, the arguments of `_options` in its order (custom ops take
# plain scalars; 0 for the chunk counts: from the budget).


def _options(ignore_index: int, reduction: int, label_smoothing: float, z_loss: float, softcap: float,
             check_targets: bool, chunk_tokens: int, chunk_vocab: int, memory_budget: int,
             grad_weight_accumulation: int, row_stats: bool = False) -> _C.LinearCrossEntropyOptions:
    """The ops' option arguments (reduction and grad_weight_accumulation as the C++ enum values) as the binding's
    LinearCrossEntropyOptions, field by field by name; `row_stats`: the row-statistics ops' (not an op argument)."""
    return _C.LinearCrossEntropyOptions(ignore_index=ignore_index, reduction=reduction,
                                        label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
                                        check_targets=check_targets, chunk_tokens=chunk_tokens,
                                        chunk_vocab=chunk_vocab, memory_budget=memory_budget,
                                        grad_weight_accumulation=grad_weight_accumulation, row_stats=row_stats)


_cached_options = cached(_options)


def _scalars(ignore_index, reduction, label_smoothing, z_loss, softcap, check_targets, chunk_tokens, chunk_vocab,
             memory_budget, grad_weight_accumulation) -> tuple:
    """linear_cross_entropy's options, checked, as the ops' option arguments in `_options`' order."""
    for name, value in (("chunk_tokens", chunk_tokens), ("chunk_vocab", chunk_vocab)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name}: expected a count >= 1 (or None: from memory_budget), got {value!r}")
    if not isinstance(memory_budget, int) or memory_budget < 1:
        raise ValueError(f"memory_budget: expected a number of bytes >= 1, got {memory_budget!r}")
    return (check_int64(ignore_index, "ignore_index"), enum(REDUCTIONS, reduction, "reduction"),
            check_float(label_smoothing, "label_smoothing"), check_float(z_loss, "z_loss"),
            check_float(softcap or 0.0, "softcap"), bool(check_targets), check_int64(chunk_tokens or 0, "chunk_tokens"),
            check_int64(chunk_vocab or 0, "chunk_vocab"), check_int64(memory_budget, "memory_budget"),
            enum(GRAD_WEIGHT_ACCUMULATIONS, grad_weight_accumulation, "grad_weight_accumulation"))


def _new_outputs(hidden: Tensor, target: Tensor, reduction: int) -> Tuple[Tensor, Tensor]:
    # loss: [] for sum/mean, the leading shape [*] for none; lse: [*]. Always float32.
    f32 = dict(dtype=torch.float32, device=hidden.device)
    return torch.empty(target.shape if reduction == REDUCTION_NONE else (), **f32), torch.empty(target.shape, **f32)


def _grad_outputs(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], need_hidden: bool, need_weight: bool,
                  need_bias: bool, float32: bool = False) -> Tuple[Tensor, Tensor, Tensor]:
    # A custom op cannot return None: a gradient nobody needs is an empty tensor. `float32`: every gradient in
    # float32 whatever the operands' dtype (the kernels write float32 gradients of 16-bit operands).
    def make(like: Optional[Tensor], need: bool) -> Tensor:
        if like is None or not need:
            return torch.empty(0, dtype=hidden.dtype, device=hidden.device)
        return torch.empty(like.shape, dtype=torch.float32 if float32 else like.dtype, device=like.device)

    return make(hidden, need_hidden), make(weight, need_weight), make(bias, need_bias)


def _row_stats_outputs(hidden: Tensor, target: Tensor) -> Tuple[Tensor, Tensor]:
    # entropy (float32) and is_top1 (bool), one per token.
    return (torch.empty(target.shape, dtype=torch.float32, device=hidden.device),
            torch.empty(target.shape, dtype=torch.bool, device=hidden.device))


def _row_stats_descriptors(row_stats: Optional[Tuple[Tensor, Tensor]]) -> dict:
    if row_stats is None:
        return {}
    return dict(entropy=descriptor(row_stats[0], "entropy"), is_top1=descriptor(row_stats[1], "is_top1"))


def _run_forward_backward(hidden, weight, bias, target, class_weight, options, grad_hidden, grad_weight, grad_bias):
    """(loss, lse), or with options.row_stats (loss, lse, entropy, is_top1)."""
    loss, lse = _new_outputs(hidden, target, options.reduction)
    stats = _row_stats_outputs(hidden, target) if options.row_stats else None
    h, w, t = descriptor(hidden, "hidden"), descriptor(weight, "weight"), descriptor(target, "target")
    gh, gw, gb = (descriptor(grad_hidden, "grad_hidden"), descriptor(grad_weight, "grad_weight"),
                  descriptor(grad_bias, "grad_bias"))
    owner, ws = workspace(_C.linear_cross_entropy_forward_backward_workspace_bytes(h, w, t, gh, gw, gb, options),
                          hidden.device)
    _C.linear_cross_entropy_forward_backward(h, w, descriptor(bias, "bias"), t,
                                             descriptor(class_weight, "class_weight"), options,
                                             descriptor(loss, "loss"), descriptor(lse, "lse"), gh, gw, gb, None, ws,
                                             stream(hidden.device), **_row_stats_descriptors(stats))
    del owner  # freed in stream order: the caching allocator reuses it only for later work on this stream
    return (loss, lse) + (stats or ())


def _run_forward(hidden, weight, bias, target, class_weight, options):
    """(loss, lse), or with options.row_stats (loss, lse, entropy, is_top1)."""
    loss, lse = _new_outputs(hidden, target, options.reduction)
    stats = _row_stats_outputs(hidden, target) if options.row_stats else None
    h, w, t = descriptor(hidden, "hidden"), descriptor(weight, "weight"), descriptor(target, "target")
    owner, ws = workspace(_C.linear_cross_entropy_forward_workspace_bytes(h, w, t, options), hidden.device)
    _C.linear_cross_entropy_forward(h, w, descriptor(bias, "bias"), t, descriptor(class_weight, "class_weight"),
                                    options, descriptor(loss, "loss"), descriptor(lse, "lse"), ws,
                                    stream(hidden.device), **_row_stats_descriptors(stats))
    del owner
    return (loss, lse) + (stats or ())


def _recompute_is_faster(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], scalars: tuple,
                         dtype: Optional[torch.dtype] = None) -> bool:
    # The library's cost model of the two CUDA plans (shapes and dtypes only, so it also runs while torch.compile
    # traces with fake tensors); False on the CPU and for float32. `scalars`: the ops' option arguments, made the
    # binding's struct only past that test (torch.compile cannot trace its construction). `dtype`: the products'
    # dtype where it is not hidden's (under autocast).
    dtype = dtype or hidden.dtype
    if hidden.device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return False
    h = int(hidden.shape[-1])
    n = int(hidden.numel()) // h if h else 0
    return bool(_C.linear_cross_entropy_recompute_is_faster(
        n, h, int(weight.shape[0]), DTYPE_CODES[dtype], DEVICE_CODES["cuda"], hidden.device.index or 0,
        hidden.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad, _options(*scalars)))


def _needs_grad(hidden: Tensor, weight: Tensor, bias: Optional[Tensor]) -> bool:
    return torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad or
                                        (bias is not None and bias.requires_grad))


def _takes_recompute(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], schedule: str, scalars: tuple,
                     sharded: bool, compute_dtype: Optional[torch.dtype]) -> bool:
    """Whether a call takes the recompute schedule: as asked, or under "auto" for reduction none and float16
    products, and where the library's cost model says so (one device, gradients needed)."""
    if schedule != "auto":
        return schedule == "recompute"
    if scalars[1] == REDUCTION_NONE or torch.float16 in (hidden.dtype, compute_dtype):
        return True
    return not sharded and _needs_grad(hidden, weight, bias) and _recompute_is_faster(hidden, weight, bias, scalars,
                                                                                      compute_dtype)


def auto_schedule(hidden: Tensor, weight: Tensor, target: Optional[Tensor] = None, bias: Optional[Tensor] = None,
                  **options) -> str:
    """The schedule ``linear_cross_entropy(hidden, weight, target, bias, **options)`` takes under
    ``schedule="auto"``: "recompute" or "gradient_in_forward", decided as that call decides it (for bfloat16 on
    CUDA by the library's cost model, from the shapes, the options and which of hidden, weight and bias require
    grad; under the caller's autocast and grad mode). Runs nothing on the device.

    Args:
        hidden, weight, bias: as in `linear_cross_entropy` (only their shapes, dtypes, device and requires_grad
            are read).
        target: not read; there so that a call's arguments can be passed as they are.
        options: `linear_cross_entropy`'s keyword options of a single-device call (not `schedule`, nor the
            vocabulary-parallel ones), checked as that call checks them.

    A call that needs no gradient runs its forward alone, whichever name this returns.
    """
    if options.keys() & {"schedule", "process_group", "vocab_parallel", "sequence_parallel"}:
        raise ValueError("auto_schedule: expected the options of a single-device call under schedule='auto'")
    args = inspect.signature(linear_cross_entropy).bind(hidden, weight, target, bias, **options)
    args.apply_defaults()
    scalars = _scalars(*(args.arguments[name] for name in inspect.signature(_scalars).parameters))
    recompute = _takes_recompute(hidden, weight, bias, "auto", scalars, False, autocast_dtype(hidden, weight))
    return "recompute" if recompute else "gradient_in_forward"


# ----------------------------------------------------------------------------------------------------
# The ops.


@custom_op("logitless::linear_cross_entropy_forward")
def _forward(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor, class_weight: Optional[Tensor],
             ignore_index: int, reduction: int, label_smoothing: float, z_loss: float, softcap: float,
             check_targets: bool, chunk_tokens: int, chunk_vocab: int, memory_budget: int,
             grad_weight_accumulation: int) -> Tuple[Tensor, Tensor]:
    """(loss, lse): one GEMM over token chunks; lse is what the backward needs."""
    options = _cached_options(ignore_index, reduction, label_smoothing, z_loss, softcap, check_targets, chunk_tokens,
                              chunk_vocab, memory_budget, grad_weight_accumulation)
    return _run_forward(hidden, weight, bias, target, class_weight, options)


@register_fake(_forward)
def _(hidden, weight, bias, target, class_weight, ignore_index, reduction, *options):
    return _new_outputs(hidden, target, reduction)


@custom_op("logitless::linear_cross_entropy_forward_backward_out",
           mutates_args=("grad_hidden", "grad_weight", "grad_bias"))
def _forward_backward_out(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor,
                          class_weight: Optional[Tensor], ignore_index: int, reduction: int, label_smoothing: float,
                          z_loss: float, softcap: float, check_targets: bool, chunk_tokens: int, chunk_vocab: int,
                          memory_budget: int, grad_weight_accumulation: int, grad_hidden: Optional[Tensor],
                          grad_weight: Optional[Tensor], grad_bias: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """(loss, lse), and the gradients of the reduced loss (upstream gradient 1) written into the given buffers
    (None: not computed) in the same pass."""
    options = _cached_options(ignore_index, reduction, label_smoothing, z_loss, softcap, check_targets, chunk_tokens,
                              chunk_vocab, memory_budget, grad_weight_accumulation)
    return _run_forward_backward(hidden, weight, bias, target, class_weight, options, grad_hidden, grad_weight,
                                 grad_bias)


@register_fake(_forward_backward_out)
def _(hidden, weight, bias, target, class_weight, ignore_index, reduction, *rest):
    return _new_outputs(hidden, target, reduction)


@custom_op("logitless::linear_cross_entropy_backward")
def _backward(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor, class_weight: Optional[Tensor],
              lse: Tensor, grad_loss: Tensor, ignore_index: int, reduction: int, label_smoothing: float,
              z_loss: float, softcap: float, check_targets: bool, chunk_tokens: int, chunk_vocab: int,
              memory_budget: int, grad_weight_accumulation: int, need_hidden: bool, need_weight: bool,
              need_bias: bool, grads_float32: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """(grad_hidden, grad_weight, grad_bias) from the forward's lse, times grad_loss (float32: [] for sum/mean,
    [*] contiguous for none), in the operands' dtypes or (grads_float32) in float32; a gradient not needed comes
    back empty."""
    options = _cached_options(ignore_index, reduction, label_smoothing, z_loss, softcap, check_targets, chunk_tokens,
                              chunk_vocab, memory_budget, grad_weight_accumulation)
    gh, gw, gb = _grad_outputs(hidden, weight, bias, need_hidden, need_weight, need_bias, grads_float32)
    d = lambda t, need, name: descriptor(t, name) if need else None  # noqa: E731
    h, w, t = descriptor(hidden, "hidden"), descriptor(weight, "weight"), descriptor(target, "target")
    ghd, gwd, gbd = d(gh, need_hidden, "grad_hidden"), d(gw, need_weight, "grad_weight"), d(gb, need_bias, "grad_bias")
    owner, ws = workspace(_C.linear_cross_entropy_backward_workspace_bytes(h, w, t, ghd, gwd, gbd, options),
                          hidden.device)
    _C.linear_cross_entropy_backward(h, w, descriptor(bias, "bias"), t, descriptor(class_weight, "class_weight"),
                                     descriptor(lse, "lse"), descriptor(grad_loss, "grad_loss"), options, ghd, gwd, gbd,
                                     ws, stream(hidden.device))
    del owner
    return gh, gw, gb


@register_fake(_backward)
def _(hidden, weight, bias, target, class_weight, lse, grad_loss, *rest):
    need_hidden, need_weight, need_bias, grads_float32 = rest[-4:]
    return _grad_outputs(hidden, weight, bias, need_hidden, need_weight, need_bias, grads_float32)


# ----------------------------------------------------------------------------------------------------
# Autograd.


def _forward_setup(ctx, inputs, output):
    hidden, weight, bias, target, class_weight, *options = inputs
    _, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(hidden, weight, bias, target, class_weight, lse)
    ctx.options = options


def _forward_grad(ctx, grad_loss, grad_lse):
    no_double_backward("linear_cross_entropy")
    hidden, weight, bias, target, class_weight, lse = ctx.saved_tensors
    need = ctx.needs_input_grad[:3]
    if not any(need):
        return (None,) * 15
    # An upstream gradient may be expanded (loss.sum() gives a stride-0 one); C++ wants it contiguous.
    g = grad_loss.to(torch.float32).contiguous()
    gh, gw, gb = _backward(hidden, weight, bias, target, class_weight, lse, g, *ctx.options, need[0], need[1],
                           need[2] and bias is not None, False)
    return (gh if need[0] else None, gw if need[1] else None, gb if need[2] else None) + (None,) * 12


_forward.register_autograd(_forward_grad, setup_context=_forward_setup)


# The row statistics' ops (linear_cross_entropy's return_row_stats): the two forward ops above, also returning each
# token's entropy (float32) and is_top1 (bool), not differentiated.


@custom_op("logitless::linear_cross_entropy_forward_row_stats")
def _forward_row_stats(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor,
                       class_weight: Optional[Tensor], ignore_index: int, reduction: int, label_smoothing: float,
                       z_loss: float, softcap: float, check_targets: bool, chunk_tokens: int, chunk_vocab: int,
                       memory_budget: int, grad_weight_accumulation: int) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(loss, lse, entropy, is_top1): one GEMM over token chunks."""
    options = _cached_options(ignore_index, reduction, label_smoothing, z_loss, softcap, check_targets, chunk_tokens,
                              chunk_vocab, memory_budget, grad_weight_accumulation, True)
    return _run_forward(hidden, weight, bias, target, class_weight, options)


@register_fake(_forward_row_stats)
def _(hidden, weight, bias, target, class_weight, ignore_index, reduction, *options):
    return _new_outputs(hidden, target, reduction) + _row_stats_outputs(hidden, target)


def _forward_row_stats_setup(ctx, inputs, output):
    hidden, weight, bias, target, class_weight, *options = inputs
    _, lse, entropy, top1 = output
    ctx.mark_non_differentiable(lse, entropy, top1)
    ctx.save_for_backward(hidden, weight, bias, target, class_weight, lse)
    ctx.options = options


def _forward_row_stats_grad(ctx, grad_loss, grad_lse, grad_entropy, grad_top1):
    return _forward_grad(ctx, grad_loss, grad_lse)


_forward_row_stats.register_autograd(_forward_row_stats_grad, setup_context=_forward_row_stats_setup)


@custom_op("logitless::linear_cross_entropy_forward_backward_row_stats_out",
           mutates_args=("grad_hidden", "grad_weight", "grad_bias"))
def _forward_backward_row_stats_out(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor,
                                    class_weight: Optional[Tensor], ignore_index: int, reduction: int,
                                    label_smoothing: float, z_loss: float, softcap: float, check_targets: bool,
                                    chunk_tokens: int, chunk_vocab: int, memory_budget: int,
                                    grad_weight_accumulation: int, grad_hidden: Optional[Tensor],
                                    grad_weight: Optional[Tensor],
                                    grad_bias: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """As linear_cross_entropy_forward_backward_out, also returning entropy and is_top1."""
    options = _cached_options(ignore_index, reduction, label_smoothing, z_loss, softcap, check_targets, chunk_tokens,
                              chunk_vocab, memory_budget, grad_weight_accumulation, True)
    return _run_forward_backward(hidden, weight, bias, target, class_weight, options, grad_hidden, grad_weight,
                                 grad_bias)


@register_fake(_forward_backward_row_stats_out)
def _(hidden, weight, bias, target, class_weight, ignore_index, reduction, *rest):
    return _new_outputs(hidden, target, reduction) + _row_stats_outputs(hidden, target)


class _AutocastRecompute(torch.autograd.Function):
    """The recompute schedule under autocast: the forward op on 16-bit copies of float32 operands, which it keeps
    for the backward (one 16-bit copy of the weight between the passes); the backward writes each gradient in
    float32 and hands it to the argument in its own dtype, with no 16-bit gradient of a float32 weight on top."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, class_weight, scalars, compute_dtype, row_stats=False):
        dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        hidden, weight, bias = cast_operands(hidden, weight, bias, compute_dtype)
        outs = (_forward_row_stats if row_stats else _forward)(hidden, weight, bias, target, class_weight, *scalars)
        ctx.mark_non_differentiable(*outs[1:])
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden, weight, bias, target, class_weight, outs[1])
        ctx.scalars, ctx.dtypes = scalars, dtypes
        return outs

    @staticmethod
    def backward(ctx, grad_loss, *unused):
        no_double_backward("linear_cross_entropy")
        hidden, weight, bias, target, class_weight, lse = ctx.saved_tensors
        need = ctx.needs_input_grad[:3]
        if grad_loss is None or not any(need):
            return (None,) * 8
        g = grad_loss.to(torch.float32).contiguous()
        grads = _backward(hidden, weight, bias, target, class_weight, lse, g, *ctx.scalars, need[0], need[1],
                          need[2] and bias is not None, True)
        out = tuple(t.to(dtype) if n and dtype is not None else None for t, n, dtype in zip(grads, need, ctx.dtypes))
        return out + (None,) * 5


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """Loss and gradients in one pass (reduction sum/mean); backward scales the saved gradients in place."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, class_weight, scalars, compute_dtype=None, row_stats=False):
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_bias = bias is not None and ctx.needs_input_grad[2]
        # In the arguments' own dtypes: under autocast a float32 weight's gradient is written in float32 directly
        # (it is then its own accumulator over token groups), and the 16-bit copies below live only in this call.
        gh, gw, gb = _grad_outputs(hidden, weight, bias, need_hidden, need_weight, need_bias)
        hidden, weight, bias = cast_operands(hidden, weight, bias, compute_dtype)
        op = _forward_backward_row_stats_out if row_stats else _forward_backward_out
        outs = op(hidden, weight, bias, target, class_weight, *scalars, gh if need_hidden else None,
                  gw if need_weight else None, gb if need_bias else None)
        ctx.mark_non_differentiable(*outs[1:])
        # lse takes no gradient: no zeros materialized for it in the backward.
        ctx.set_materialize_grads(False)
        ctx.needs = (need_hidden, need_weight, need_bias)
        # Saved after they were written: a later write to them (or a second backward over a retained graph,
        # after the in-place scaling below) fails autograd's version check instead of reusing them.
        ctx.save_for_backward(gh, gw, gb)
        return outs

    @staticmethod
    def backward(ctx, grad_loss, *unused):
        no_double_backward("linear_cross_entropy")
        grads = ctx.saved_tensors
        if grad_loss is None:  # no gradient reached the loss: nothing flows to the inputs
            return (None,) * 8
        scale = grad_loss.to(torch.float32).contiguous()
        out = []
        for g, need in zip(grads, ctx.needs):
            out.append(scale_saved(g, scale) if need else None)
        return tuple(out) + (None,) * 5


class _UniformTokenLosses(torch.autograd.Function):
    """Per-token losses (reduction none) with the gradient of their sum computed in the forward (three GEMMs, as
    gradient_in_forward), for callers whose upstream gradient is one value for every scored token, as that of
    ``-sum(log_probs) / count``: the backward scales the saved gradients by that value. Another upstream gradient
    cannot be applied to the saved sums, so it is refused (`_uniform_scale`) rather than turned into a wrong one."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, scalars):
        need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2])
        gh, gw, gb = _grad_outputs(hidden, weight, bias, *need)
        loss, lse, entropy, top1 = _forward_backward_row_stats_out(hidden, weight, bias, target, None, *scalars,
                                                                   *(g if n else None for g, n in zip((gh, gw, gb),
                                                                                                      need)))
        ctx.mark_non_differentiable(entropy, top1)
        ctx.set_materialize_grads(False)
        ctx.needs = need
        ctx.save_for_backward(gh, gw, gb, target)
        return loss, entropy, top1

    @staticmethod
    def backward(ctx, grad_loss, *unused):
        no_double_backward("linear_cross_entropy")
        *grads, target = ctx.saved_tensors
        if grad_loss is None or grad_loss.numel() == 0:
            return (None,) * 5
        scale = _uniform_scale(grad_loss, target != -100)
        return tuple(scale_saved(g, scale) if n else None for g, n in zip(grads, ctx.needs)) + (None, None)


def _uniform_scale(grad_loss: Tensor, scored: Tensor) -> Tensor:
    """The one upstream gradient of the scored tokens (0 where none is scored: the saved gradients are 0 then). The
    ignored tokens' upstream does not matter (their saved gradient rows are 0). A non-uniform one raises where the
    check can wait for the device; while torch.compile traces or a CUDA graph captures it cannot, and the scale is
    NaN instead, so that the gradients show it."""
    g = grad_loss.to(torch.float32)
    hi = torch.where(scored, g, float("-inf")).amax()
    lo = torch.where(scored, g, float("inf")).amin()
    any_scored = scored.any()
    uniform = (hi == lo) | ~any_scored
    capturing = g.is_cuda and torch.cuda.is_current_stream_capturing()
    if not (torch.compiler.is_compiling() or capturing) and not bool(uniform):
        raise ValueError("token_losses_uniform_grad: the per-token losses got upstream gradients that differ between "
                         "scored tokens; it serves only reductions that weigh every token alike (loss.sum() / count). "
                         "Use linear_cross_entropy(reduction='none') for any other")
    return torch.where(any_scored, torch.where(uniform, hi, torch.full_like(hi, float("nan"))), torch.zeros_like(hi))


def token_losses_uniform_grad(hidden: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor] = None, *,
                              check_targets: bool = True,
                              memory_budget: int = DEFAULT_MEMORY_BUDGET) -> Tuple[Tensor, Tensor, Tensor]:
    """(loss, entropy, is_top1), each [*]: the per-token cross-entropy of ``hidden @ weight.T + bias`` (no
    options; -100 ignored) with ``return_row_stats``, for a caller that reduces the losses with one weight for every
    token (``loss.sum() / count``: supervised fine-tuning). Where a gradient is needed it is computed in the forward
    (gradient_in_forward's three GEMMs, where reduction "none" otherwise takes the recompute schedule's four), and
    the backward applies the upstream gradient's one value over the scored tokens: upstream gradients that differ
    between scored tokens raise a ValueError in the backward. Not under autocast or with a DTensor weight (the caller
    casts and gathers)."""
    check_tensors((("hidden", hidden), ("weight", weight), ("target", target), ("bias", bias)), optional=("bias",))
    hidden, weight = rows_ready(hidden), rows_ready(weight)
    check_bias(bias, weight, hidden)
    check_rows(hidden.dim() - 1, (("hidden", hidden), ("target", target)), jointly=False)
    scalars = _scalars(-100, "none", 0.0, 0.0, None, check_targets, None, None, memory_budget, "float32")
    if _needs_grad(hidden, weight, bias):
        return _UniformTokenLosses.apply(hidden, weight, bias, target, scalars)
    loss, _, entropy, top1 = _forward_row_stats(hidden, weight, bias, target, None, *scalars)
    return loss, entropy, top1


# ----------------------------------------------------------------------------------------------------
# The public function.


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Optional[Tensor] = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: Optional[float] = None,
    class_weight: Optional[Tensor] = None,
    return_lse: bool = False,
    return_row_stats: bool = False,
    schedule: str = "auto",
    chunk_tokens: Optional[int] = None,
    chunk_vocab: Optional[int] = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    grad_weight_accumulation: str = "float32",
    check_targets: bool = True,
    process_group=None,
    vocab_parallel: bool = False,
    sequence_parallel: bool = False,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Cross-entropy of the logits ``hidden @ weight.T + bias`` against class indices `target`, without
    the logits in memory: ``F.cross_entropy(F.linear(hidden, weight, bias).flatten(0, -2), target.flatten())``
    (with z-loss and softcap as in `logitless.cross_entropy`), computed a chunk of logits at a time.

    Args:
        hidden: [*, H] float32, float16 or bfloat16 on the CPU or a CUDA device, at most 8 dimensions (a last
            dimension that is not contiguous is copied). Leading dimensions may have any strides as long as they
            collapse to at most 3 strided dimensions (size-1 dimensions dropped, neighbours merged where
            contiguous with each other; any view of a tensor of up to 4 dimensions qualifies):
            ``h[:, :-1, :]`` goes in without a copy by the caller. Otherwise a ValueError names the tensor.
        weight: [V, H], hidden's dtype (an lm_head's ``weight`` or a tied embedding).
        target: [*] int32 or int64 class indices, the leading shape of `hidden`, strides as hidden's (on their
            own: the two need not merge alike).
        bias: optional [V], hidden's dtype or float32.
        ignore_index, reduction, label_smoothing, z_loss, softcap: as in `logitless.cross_entropy` (torch's
            names and meaning; z_loss adds ``z_loss * lse**2`` per token, averaged for reduction "mean" over
            the tokens not ignored, unweighted; softcap caps the logits as
            ``softcap * tanh(logits / softcap)``). A mean over only ignored tokens (or none) is 0 with
            gradient 0, where torch gives NaN.
        class_weight: optional [V] per-class weights (torch's cross-entropy ``weight``), any float dtype, used
            as float32; no gradient flows to it.
        return_lse: also return the per-token log-sum-exp [*] (float32, of the capped logits; 0 for ignored
            tokens; detached).
        return_row_stats: also return, per token, the entropy of the softmax the loss uses (float32 [*], of the
            capped logits: label smoothing, z-loss and class weights change the loss, not that softmax) and
            whether the target is the first maximum of the logits (bool [*], torch.argmax's answer: the lowest
            index among equal maxima, compared before the cap, which never reorders them); 0 and False for ignored
            tokens; a row with a NaN logit has entropy NaN and is_top1 False. Not differentiated. Computed in the
            same pass as the loss (on CUDA from the float32 logits the GEMM produced, so classes within float32
            rounding of each other may rank otherwise than in exact arithmetic). Not with vocabulary parallelism
            (ValueError): its exchange carries no entropy or argmax.
        schedule: "auto", "gradient_in_forward" (reduction sum/mean: gradients computed in the forward, the
            backward only scales them; three GEMMs) or "recompute" (the forward keeps lse, the backward
            recomputes the logits; four GEMMs, the least memory). "auto" takes recompute for reduction none,
            for float16, and for bfloat16 on CUDA where the library's cost model expects it to be faster (see
            the module docstring); gradient_in_forward otherwise.
        chunk_tokens, chunk_vocab: CUDA chunk sizes (tokens per chunk; vocabulary rows per chunk of the
            recompute backward). None: from `memory_budget`.
        memory_budget: bytes of chunk scratch on CUDA (default 512 MiB); see linear_cross_entropy.h for what
            comes on top (a float32 grad_weight accumulator where needed, cuBLAS's workspace). Where
            gradient_in_forward cannot hold every token's gradient of the logits, a larger budget makes fewer,
            longer token groups and so fewer passes over that accumulator: on an H100, 1 GiB took 16384 tokens
            × 2048 × 128256 from 1.15x to 1.06x the three GEMMs' time, for 0.5 GB more (README, "Limits").
        grad_weight_accumulation: where gradient_in_forward sums a 16-bit grad_weight over token groups (it has
            several where the budget does not hold every token's gradient of the logits): "float32" (default) in a
            float32 accumulator of 4·V·H bytes on top of the budget (about a third of it in grad_weight's own
            storage where its rows are contiguous), rounded once at the end; "weight_dtype" in the
            16-bit grad_weight itself, each group's GEMM adding to it and rounding the running sum (as Liger
            does): no accumulator, so the extra memory stays within the budget, at the price of one rounding per
            token group (the error grows with their number). The CPU backend rounds alike after each group of the
            CUDA plan for the same options. No effect on the loss, on the other gradients, on a float32 weight or
            gradient, or on the recompute schedule (its grad_weight rows are final when written).
        check_targets: raise on a target outside [0, V) that is not ignore_index (on CUDA this reads one number
            back, a host synchronization per call; skipped while a CUDA graph is captured, where such a
            token's loss is NaN instead).
        process_group: vocabulary parallelism (tensor parallelism of the LM head). `weight` [V_r, H] (and `bias`
            [V_r]) are then this rank's rows of the head, the ranks' rows in rank order tiling [0, V) (widths may
            differ, or be 0); `hidden` and `target` are every token on every rank; `class_weight`, if given, is the
            whole vocabulary's [V]. The result is the unsharded loss: the logits are never gathered, the forward
            exchanges 4 floats per token and rank (per token chunk with gradient_in_forward, overlapped with the
            next chunk's GEMM), grad_hidden is summed over the ranks (one all_reduce, in float32) and
            grad_weight / grad_bias are each rank's own. Works under FSDP2 (see logitless.vocab_parallel for how
            each schedule treats a weight regathered for the backward).
        vocab_parallel: `weight` (and `bias`) are DTensors sharded along the vocabulary (``Shard(0)``) over a
            mesh dimension, tensor parallelism as above over that dimension's group. Without it a DTensor weight
            is refused: an FSDP2 parameter shard has the same placement and must be gathered, not split over
            (`logitless.linear_head_loss` runs the loss inside the head's call, where FSDP2 gathers it).
        sequence_parallel: with vocabulary parallelism, `hidden` [*, H] and `target` [*] are this rank's tokens
            only (the same count on every rank, in rank order); they are all_gathered here, grad_hidden is
            reduce_scattered back to them, and per-token outputs (reduction none, lse) are this rank's tokens'.

    Returns:
        The float32 loss ([] for sum/mean, [*] for none), or a tuple: ``(loss, lse)`` with return_lse,
        ``(loss, entropy, is_top1)`` with return_row_stats, ``(loss, lse, entropy, is_top1)`` with both.

    Raises:
        ValueError: on a bad argument, naming it (shapes, dtypes, a target out of range with its row).

    Under ``torch.autocast`` (CUDA or CPU, bfloat16 or float16) a float32 hidden or weight is cast to the autocast
    dtype for the products, as F.linear would be, and its gradient comes back in float32, written so by the kernels:
    with float32 master weights the float32 grad_weight is itself the accumulator over token groups, and the extra
    memory beside the workspace is the 16-bit copy of the weight (kept for the backward by the recompute schedule,
    freed after the forward by gradient_in_forward). With a float32 hidden, each token group's scratch rows lie in
    its own rows of the float32 grad_hidden where they fit. Because each token group's product reads and writes the
    whole float32 grad_weight, groups shorter than 2048 tokens grow toward that as far as twice `memory_budget`
    holds (1000 MiB of scratch at 256000 classes; the budget alone holds 2048 tokens up to 131072 classes). A
    float32 bias stays float32. With vocabulary parallelism the products run in the autocast dtype too and the
    gradients of float32 arguments are float32; there the recompute schedule casts the weight again in the backward
    instead of keeping a copy, and the token chunks are the steps' own (their groups over a float32 grad_weight grow
    likewise; include/logitless/vocab_parallel.h).

    Autograd: gradients flow to hidden, weight and bias. With gradient_in_forward the gradients are computed
    once and consumed by the backward: a second backward through the same call (retain_graph=True) raises
    torch's "modified by an inplace operation" error; use schedule="recompute" for that. Double backward is
    not supported.
    """
    red = enum(REDUCTIONS, reduction, "reduction")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule: expected one of {', '.join(map(repr, SCHEDULES))}, got {schedule!r}")
    if schedule == "gradient_in_forward" and red == REDUCTION_NONE:
        raise ValueError("schedule: expected 'auto' or 'recompute' for reduction='none' (its upstream gradient is "
                         "known only in the backward), got 'gradient_in_forward'")
    scalars = _scalars(ignore_index, reduction, label_smoothing, z_loss, softcap, check_targets, chunk_tokens,
                       chunk_vocab, memory_budget, grad_weight_accumulation)
    check_process_group(process_group)
    # DTensors are sorted out below (vocabulary parallelism, or refused on the local path).
    check_tensors((("hidden", hidden), ("weight", weight), ("target", target), ("bias", bias),
                   ("class_weight", class_weight)), optional=("bias", "class_weight"),
                  dtensor_ok=("hidden", "weight", "target", "bias", "class_weight"))
    if class_weight is not None:
        class_weight = class_weight.detach().to(torch.float32)
    hidden, weight = rows_ready(hidden), rows_ready(weight)
    sharded = process_group is not None or bool(vocab_parallel)
    row_stats = bool(return_row_stats)
    if sharded and row_stats:
        raise ValueError("return_row_stats: not supported with vocabulary parallelism (process_group or "
                         "vocab_parallel): the shards' exchange carries no entropy or argmax")
    # Imported here, not at the top, only so that `import logitless` does not load the vocabulary-parallel module for
    # single-device use (it imports nothing that imports back: no cycle).
    from . import vocab_parallel as vp

    if not sharded:
        refuse_sharded_weight(weight, bias, vocab_parallel_remedy=True)
    elif vocab_parallel and process_group is None and not vp.is_dtensor(weight):
        raise ValueError("vocab_parallel: expected a DTensor weight sharded along the vocabulary (or pass "
                         "process_group= with this rank's rows of the weight), got a plain tensor")
    compute_dtype = autocast_dtype(hidden, weight)
    recompute = _takes_recompute(hidden, weight, bias, schedule, scalars, sharded, compute_dtype)
    if sharded:
        loss, lse = vp.linear_cross_entropy(hidden, weight, target, bias, class_weight, _options(*scalars), recompute,
                                            process_group, bool(sequence_parallel), compute_dtype)
        return (loss, lse) if return_lse else loss
    if sequence_parallel:
        raise ValueError("sequence_parallel: expected a process_group or vocab_parallel=True (vocabulary parallelism)")
    check_tensors((("hidden", hidden), ("weight", weight), ("target", target), ("bias", bias),
                   ("class_weight", class_weight)), optional=("bias", "class_weight"))
    # Under autocast any 16-bit or float32 bias goes in (cast like the operands, or kept in float32).
    casts = compute_dtype is not None and bias is not None and bias.dtype in (torch.float16, torch.bfloat16)
    check_bias(bias, weight, hidden, dtype=bias.dtype if casts else None)
    check_rows(hidden.dim() - 1, (("hidden", hidden), ("target", target)), jointly=False)
    needs_grad = _needs_grad(hidden, weight, bias)
    if needs_grad and recompute and compute_dtype is not None:
        outs = _AutocastRecompute.apply(hidden, weight, bias, target, class_weight, scalars, compute_dtype, row_stats)
    elif not needs_grad or recompute:
        hidden, weight, bias = cast_operands(hidden, weight, bias, compute_dtype)
        outs = (_forward_row_stats if row_stats else _forward)(hidden, weight, bias, target, class_weight, *scalars)
    else:
        outs = _FusedLinearCrossEntropy.apply(hidden, weight, bias, target, class_weight, scalars, compute_dtype,
                                              row_stats)
    result = outs[:1] + (outs[1:2] if return_lse else ()) + (tuple(outs[2:4]) if row_stats else ())
    return result if len(result) > 1 else result[0]
