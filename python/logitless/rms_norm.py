"""RMSNorm: the torch ops (custom_op + fake + autograd) and `rms_norm`.

Ops (namespace ``logitless``):

* ``rms_norm_forward``: (y, residual_out, rstd) in one read of x (and residual) and one write. Without a
  residual, residual_out is an empty tensor (a custom op cannot return None).
* ``rms_norm_backward``: (grad_x, grad_weight) in one read of x, grad_y (and grad_residual_out) and one
  write of grad_x; grad_weight is reduced in float32 through a workspace, deterministically.

grad_x always goes to a fresh buffer, never over the incoming grad_y: autograd hands the same gradient tensor to
every consumer of a value (in ``h + rms_norm(x, w)`` h's gradient is that very tensor), so writing into it would
corrupt another tensor's gradient, and no version counter catches that (nothing saved it). Autograd gives no way
to learn that an incoming gradient is ours alone, so there is no in-place variant here (the C++ API keeps one for
callers that own their buffers).

The forward's registered autograd saves what the forward normalized (x, or residual_out) and rstd.

Eager calls run the ops' implementations directly, without the custom-op dispatch (`logitless._autograd.custom_op`
says when and why), those that need a gradient through `_EagerRMSNorm`; torch.compile and callers of
torch.ops.logitless.* get the ops. Both are the same code.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from . import _C, _autograd, _norm_recipes
from ._autograd import (
    cached,
    cached_settings,
    checkpointed,
    custom_op,
    direct_apply,
    empty_rows,
    enum,
    no_double_backward,
)
from ._checks import check_float, check_int64, check_rows, check_tensors, register_fake, rows_collapse
from ._tensor import descriptor, rows_ready, stream_of, workspace

__all__ = ["rms_norm", "CASTING_MODES"]

# Must match logitless::RMSNormCasting and logitless::RMSNormAlgo (include/logitless/rms_norm.h).
CASTING_MODES = {"llama": 0, "gemma": 1, "none": 2}
ALGOS = {"auto": 0, "registers": 1, "generic": 2}


def _options(eps: float, offset: float, casting: int, algo: int, vectors_per_thread: int) -> _C.RMSNormOptions:
    """The ops' option arguments (casting and algo as the C++ enum values) as the binding's RMSNormOptions, field by
    field by name."""
    return _C.RMSNormOptions(eps=eps, offset=offset, casting=casting, algo=algo, vectors_per_thread=vectors_per_thread)


_cached_options = cached(_options)


def _scalars(eps, offset, casting_mode, algo, vectors_per_thread) -> tuple:
    """The public function's scalar arguments, checked, as the ops' option arguments (in `_options`' order)."""
    return (check_float(eps, "eps"), check_float(offset, "offset"), enum(CASTING_MODES, casting_mode, "casting_mode"),
            enum(ALGOS, algo, "algo"), check_int64(vectors_per_thread, "vectors_per_thread"))


@cached_settings
def _settings(*args) -> Tuple[tuple, _C.RMSNormOptions]:
    """An eager call's (`_scalars`, the binding's options over them), checked once per distinct argument tuple.
    torch.compile traces `_scalars` instead: the binding's objects are no values a graph can hold."""
    scalars = _scalars(*args)
    return scalars, _cached_options(*scalars)


def _forward_outputs(x: Tensor, has_residual: bool) -> Tuple[Tensor, Tensor, Tensor]:
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    s = torch.empty(x.shape if has_residual else (0,), dtype=x.dtype, device=x.device)
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    return y, s, rstd


def _weight_grad_output(weight: Tensor, need: bool) -> Tensor:
    return torch.empty(weight.shape if need else (0,), dtype=weight.dtype, device=weight.device)


def _run_forward(x: Tensor, weight: Tensor, residual: Optional[Tensor], options: _C.RMSNormOptions, y: Tensor,
                 s: Optional[Tensor], rstd: Optional[Tensor]) -> None:
    """The C++ forward into the given outputs; x, weight and residual already _rows_ready / contiguous."""
    _C.rms_norm_forward(descriptor(x, "x"), descriptor(residual, "residual"), descriptor(weight, "weight"),
                        options, descriptor(y, "y"), descriptor(s, "residual_out"), descriptor(rstd, "rstd"), None,
                        stream_of(x))


def _run_backward(grad_y: Tensor, grad_residual_out: Optional[Tensor], x: Tensor, weight: Tensor, rstd: Tensor,
                  options: _C.RMSNormOptions, grad_x: Tensor, grad_weight: Optional[Tensor]) -> None:
    """The C++ backward into grad_x (a fresh buffer) and grad_weight (None where not needed)."""
    xd, wd = descriptor(x, "x"), descriptor(weight, "weight")
    owner, ws = None, None
    if grad_weight is not None and x.is_cuda:
        owner, ws = workspace(_C.rms_norm_backward_workspace_bytes(xd, wd, options), x.device)
    _C.rms_norm_backward(descriptor(grad_y, "grad_y"), descriptor(grad_residual_out, "grad_residual_out"), xd, wd,
                         descriptor(rstd, "rstd"), options, descriptor(grad_x, "grad_x"),
                         descriptor(grad_weight, "grad_weight"), ws, stream_of(x))
    del owner  # freed in stream order: the caching allocator reuses it only for later work on this stream


def _backward_impl(grad_y: Tensor, grad_residual_out: Optional[Tensor], x: Tensor, weight: Tensor, rstd: Tensor,
                   options: _C.RMSNormOptions, need_weight_grad: bool) -> Tuple[Tensor, Optional[Tensor]]:
    """The backward op's body without the op's contract: (grad_x, grad_weight or None). grad_y and
    grad_residual_out already rows_ready; x, weight and rstd made so here (a saved tensor comes back from a
    saved-tensor hook in whatever layout the hook gives it)."""
    grad_x = empty_rows(grad_y)
    grad_weight = empty_rows(weight) if need_weight_grad else None
    _run_backward(grad_y, grad_residual_out, rows_ready(x), weight.contiguous(), rstd.contiguous(), options, grad_x,
                  grad_weight)
    return grad_x, grad_weight


# ----------------------------------------------------------------------------------------------------
# The ops. After the tensors, every op takes the arguments of `_options` in its order (custom ops take plain
# scalars).


@custom_op("logitless::rms_norm_forward")
def _forward(x: Tensor, weight: Tensor, residual: Optional[Tensor], eps: float, offset: float, casting: int,
             algo: int, vectors_per_thread: int) -> Tuple[Tensor, Tensor, Tensor]:
    """(y, residual_out, rstd); residual_out = x + residual (empty without a residual)."""
    x, weight = rows_ready(x), weight.contiguous()
    residual = None if residual is None else rows_ready(residual)
    y, s, rstd = _forward_outputs(x, residual is not None)
    _run_forward(x, weight, residual, _cached_options(eps, offset, casting, algo, vectors_per_thread), y,
                 s if residual is not None else None, rstd)
    return y, s, rstd


@register_fake(_forward)
def _(x, weight, residual, *options):
    return _forward_outputs(x, residual is not None)


@custom_op("logitless::rms_norm_backward")
def _backward(grad_y: Tensor, grad_residual_out: Optional[Tensor], x: Tensor, weight: Tensor, rstd: Tensor,
              eps: float, offset: float, casting: int, algo: int, vectors_per_thread: int,
              need_weight_grad: bool) -> Tuple[Tensor, Tensor]:
    """(grad_x, grad_weight); grad_weight is empty unless need_weight_grad. x is what the forward normalized
    (x, or residual_out), rstd the forward's."""
    grad_residual_out = None if grad_residual_out is None else rows_ready(grad_residual_out)
    grad_x, grad_weight = _backward_impl(rows_ready(grad_y), grad_residual_out, x, weight, rstd,
                                         _cached_options(eps, offset, casting, algo, vectors_per_thread),
                                         need_weight_grad)
    return grad_x, grad_weight if need_weight_grad else _weight_grad_output(weight, False)


@register_fake(_backward)
def _(grad_y, grad_residual_out, x, weight, rstd, eps, offset, casting, algo, vectors_per_thread, need_weight_grad):
    return torch.empty(grad_y.shape, dtype=grad_y.dtype, device=grad_y.device), _weight_grad_output(weight,
                                                                                                   need_weight_grad)


# The ops' names, as the direct path counts and profiles its calls.
_FORWARD_NAME, _BACKWARD_NAME = _forward.name, _backward.name

# ----------------------------------------------------------------------------------------------------
# Autograd.


def _grads(ctx, grad_y: Optional[Tensor], grad_s: Optional[Tensor], direct: bool = False):
    """(grad_x, grad_weight, grad_residual) from the saved (what was normalized, weight, rstd). `direct`: the forward
    took the direct path (`_EagerRMSNorm`); the backward op's implementation then runs without the op's layers
    where the gradients are eager_ok too (not so under compiled autograd or a mode entered for the backward)."""
    no_double_backward("rms_norm")
    xs, weight, rstd = ctx.saved_tensors
    need_x = ctx.needs_input_grad[0] or (ctx.has_residual and ctx.needs_input_grad[2])
    need_w = ctx.needs_input_grad[1]
    if not (need_x or need_w):
        return None, None, None
    if grad_y is None:  # only residual_out was used
        grad_y = torch.zeros(xs.shape, dtype=xs.dtype, device=xs.device)
    grad_s = grad_s if ctx.has_residual else None
    if not (grad_y.is_contiguous() and (grad_s is None or grad_s.is_contiguous())):
        grad_y, grad_s = _strided_grads(xs, grad_y, grad_s)
    if direct and _autograd.eager_ok((grad_y, grad_s)):
        grad_x, grad_w = direct_apply(_backward_impl, _BACKWARD_NAME, grad_y, grad_s, xs, weight, rstd,
                                      ctx.cpp_options, need_w)
    else:
        grad_x, grad_w = _backward(grad_y, grad_s, xs, weight, rstd, *ctx.options, need_w)
    grad_x = grad_x if need_x else None
    return grad_x, (grad_w if need_w else None), (grad_x if ctx.has_residual else None)


def _strided_grads(xs: Tensor, grad_y: Tensor, grad_s: Optional[Tensor]) -> Tuple[Tensor, Optional[Tensor]]:
    """Incoming gradients that are not contiguous, as the kernels take them (contiguous ones are already: their rows
    merge wherever those of what was normalized merge)."""
    grad_y = rows_ready(grad_y)
    grad_s = None if grad_s is None else rows_ready(grad_s)
    # They have whatever layout autograd produced (e.g. a permuted view's gradient). Where their rows and those of
    # what was normalized do not collapse jointly to the strided dimensions the kernels index, they are copied: they
    # are not the caller's arguments to fix.
    if not rows_collapse(xs.dim() - 1, xs, grad_y, *(() if grad_s is None else (grad_s,))):
        grad_y = grad_y.contiguous()
        grad_s = None if grad_s is None else grad_s.contiguous()
    return grad_y, grad_s


def _forward_setup(ctx, inputs, output):
    x, weight, residual, eps, offset, casting, algo, vpt = inputs
    _, s, rstd = output
    ctx.mark_non_differentiable(rstd)
    # The backward needs what was normalized: x itself, or x + residual (already in memory as an output).
    ctx.save_for_backward(s if residual is not None else x, weight, rstd)
    ctx.has_residual = residual is not None
    # The op's own arguments, passed on to the backward op: what torch.compile traces here may be symbolic, which
    # the binding's struct could not hold.
    ctx.options = (eps, offset, casting, algo, vpt)
    # An output nobody used arrives as None instead of a materialized tensor of zeros (a wasted N x H read).
    ctx.set_materialize_grads(False)


def _forward_grad(ctx, grad_y, grad_s, grad_rstd):
    grad_x, grad_w, grad_res = _grads(ctx, grad_y, grad_s)
    return (grad_x, grad_w, grad_res) + (None,) * 5


_forward.register_autograd(_forward_grad, setup_context=_forward_setup)


class _EagerRMSNorm(torch.autograd.Function):
    """rms_norm's direct path with a gradient: the forward op's registered autograd formula, as one
    autograd.Function that calls the ops' implementations. The same C++ calls over the same tensors as the ops (the
    same bits), without what the generic path repeats per call: the DirectOp and `_Direct` layers of both ops, an
    empty residual_out and grad_weight made only because an op must return a tensor, rstd as an output to mark
    non-differentiable, and re-readying tensors the forward already made ready.

    forward(x, weight, residual, scalars, options): x already rows_ready; `scalars` the ops' option arguments,
    `options` the binding's over them. Returns y, or (y, residual_out) with a residual."""

    @staticmethod
    def forward(ctx, x, weight, residual, scalars, options):
        weight = weight.contiguous()
        y = empty_rows(x)
        s = None if residual is None else empty_rows(x)
        # One float per row, flat: the C++ side counts its elements, and an int size is the cheapest to allocate.
        rstd = torch.empty(x.shape[:-1].numel(), dtype=torch.float32, device=x.device)
        _run_forward(x, weight, None if residual is None else rows_ready(residual), options, y, s, rstd)
        # As _forward_setup saves (the generic backward below reads the same ctx).
        ctx.save_for_backward(x if s is None else s, weight, rstd)
        ctx.has_residual = residual is not None
        ctx.options, ctx.cpp_options = scalars, options
        ctx.set_materialize_grads(False)
        return y if s is None else (y, s)

    @staticmethod
    def backward(ctx, grad_y, grad_s=None):
        return _grads(ctx, grad_y, grad_s, direct=True) + (None, None)


def _forward_without_graph(x: Tensor, weight: Tensor, residual: Optional[Tensor],
                           options: _C.RMSNormOptions) -> Tuple[Tensor, Optional[Tensor]]:
    """The direct path of a call that records no graph: (y, residual_out or None), and no rstd (nothing will read
    it; the C++ forward takes it as optional)."""
    y = empty_rows(x)
    s = None if residual is None else empty_rows(x)
    _run_forward(x, weight.contiguous(), None if residual is None else rows_ready(residual), options, y, s, None)
    return y, s


def _remember(y: Tensor, normalized: Tensor, weight: Tensor, scalars: tuple) -> None:
    """What the backward keeps (what was normalized, the weight) recomputes y, for an op that would save it (not
    under activation checkpointing, where saving y costs no memory past the layer's backward)."""
    _norm_recipes.remember(y, (normalized, weight), lambda n, w: _forward(n, w, None, *scalars)[0])


# ----------------------------------------------------------------------------------------------------
# The public function.


def rms_norm(
    x: Tensor,
    weight: Tensor,
    eps: float = 1e-6,
    offset: float = 0.0,
    casting_mode: str = "llama",
    residual: Optional[Tensor] = None,
    *,
    algo: str = "auto",
    vectors_per_thread: int = 0,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """RMSNorm over the last dimension: ``y = x * rsqrt(mean(x**2, -1) + eps) * (weight + offset)``.

    Statistics are always float32. `casting_mode` says where values are rounded to x's dtype, to match the
    module a model was trained with:

    * ``"llama"``: Hugging Face's LlamaRMSNorm (and Mistral, Qwen2, ...): the normalized x is rounded to x's
      dtype, then multiplied by the weight: ``weight * (x.float() * rstd).to(x.dtype)``.
    * ``"gemma"``: Gemma's RMSNorm: everything in float32 and one rounding at the end:
      ``(x.float() * rstd * (offset + weight.float())).to(x.dtype)``; use offset=1.0 for Gemma's
      zero-centered weights.
    * ``"none"``: as a module computed entirely in x's dtype: rstd, ``x * rstd``, ``weight + offset`` and the
      product are each rounded to x's dtype (the sum of squares is still accumulated in float32).

    With float32 tensors the three agree. The output keeps x's dtype even with a float32 weight (where the
    Llama module would promote it to float32).

    Args:
        x: [*, H] float32, float16 or bfloat16, CPU or CUDA, at most 8 dimensions. Rows may be strided (a view
            such as ``h[:, :-1]`` needs no copy); the last dimension is made contiguous if it is not. The leading
            dimensions must collapse, jointly with residual's, to at most 3 strided dimensions (size-1 dimensions
            dropped, neighbours merged where contiguous in both; any view of a tensor of up to 4 dimensions
            qualifies); otherwise a ValueError names the tensor to make contiguous.
        weight: [H], x's dtype or float32 (the model's dtype or float32 master weights).
        eps: > 0, added to the mean of squares.
        offset: added to the weight (1.0 for Gemma).
        casting_mode: "llama", "gemma" or "none" (see above).
        residual: optional [*, H] in x's dtype: the fused residual add. Returns ``(y, s)`` with
            ``s = x + residual`` (rounded to x's dtype, what a model carries on as its residual stream) and
            ``y = rms_norm(s)``. Gradients flowing into both outputs are handled; x and residual get the same
            gradient.
        algo: CUDA kernel, for tests and benchmarks: "auto", "registers" (row in registers, 16-byte accesses)
            or "generic" (any H and alignment).
        vectors_per_thread: with the register kernel, 16-byte vectors per thread (0 = auto, 4 or 8).

    Returns:
        y ([*, H], x's dtype), or ``(y, x + residual)`` with a residual.

    Raises:
        ValueError: on a bad argument (dtype, shape, eps <= 0, unknown casting_mode), naming it.

    grad_weight is reduced in float32 without atomics: the same inputs on the same GPU give the same bits on
    every run. Double backward is not supported.
    """
    args = (eps, offset, casting_mode, algo, vectors_per_thread)
    scalars, options = (_scalars(*args), None) if torch.compiler.is_compiling() else _settings(*args)
    check_tensors((("x", x), ("weight", weight), ("residual", residual)), optional=("residual",))
    # Made ready here rather than only inside the op: the op's autograd saves its x argument, and a backward that got
    # the caller's x with a strided last dimension would copy it a second time.
    x = rows_ready(x)
    if x.dim() > 4:  # (rows of fewer dimensions always collapse) judged as the C++ side will see them
        res = None if residual is None else rows_ready(residual)
        check_rows(x.dim() - 1, (("x", x), ("residual", res)))
    if _autograd.eager_ok((x, weight, residual)):
        if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or
                                        (residual is not None and residual.requires_grad)):
            out = direct_apply(_EagerRMSNorm.apply, _FORWARD_NAME, x, weight, residual, scalars, options)
            y, s = (out, None) if residual is None else out
            if not checkpointed():
                _remember(y, x if residual is None else s, weight, scalars)
        else:
            y, s = direct_apply(_forward_without_graph, _FORWARD_NAME, x, weight, residual, options)
        return y if residual is None else (y, s)
    y, s, _ = _forward(x, weight, residual, *scalars)
    if y.requires_grad and not torch.compiler.is_compiling() and not checkpointed():
        _remember(y, x if residual is None else s, weight, scalars)
    return y if residual is None else (y, s)
