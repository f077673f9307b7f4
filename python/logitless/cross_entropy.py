"""Cross-entropy over given logits: the torch ops (custom_op + fake + autograd) and `cross_entropy`.

Three schedules, chosen by `cross_entropy` from what autograd needs:

* no gradient needed: `logitless::cross_entropy_forward`, one read of the logits.
* reduction sum/mean with a gradient: the gradient of the reduced loss is computed in the forward pass
  (one read of the logits, one write of the gradient) by `logitless::cross_entropy_forward_backward_out`
  into a fresh buffer, or by `logitless::cross_entropy_forward_backward_` over the logits themselves
  (inplace_backward=True), and saved; the backward only multiplies it by the incoming gradient, in place,
  with `logitless::scale_rows_`, which skips rows whose scale is exactly 1, so the usual
  `loss.backward()` costs one small launch. Both run inside `_FusedCrossEntropy` (an autograd.Function;
  its docstring says why).
* reduction none with a gradient: `logitless::cross_entropy_forward` saves the per-row lse and its
  registered backward calls `logitless::cross_entropy_backward` with the per-row incoming gradient (that
  gradient is not known in the forward, so it cannot be fused there). Eager calls run the same formula through
  `_EagerCrossEntropy`, over the ops' implementations.

In place, the op that overwrites the logits declares the mutation, so torch bumps their version counter
and any other autograd node that saved them (tanh or softmax save their output) raises torch's "modified
by an inplace operation" error in its backward instead of using the gradient as if it were the logits.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from . import _C, _autograd
from ._autograd import (
    REDUCTION_NONE,
    REDUCTIONS,
    cached,
    cached_settings,
    custom_op,
    direct_apply,
    empty_rows,
    enum,
    no_double_backward,
    scale_saved,
)
from ._checks import (
    check_float,
    check_int64,
    check_process_group,
    check_rows,
    check_tensors,
    check_writable_rows,
    is_dtensor,
    register_fake,
)
from ._tensor import descriptor, stream, stream_of, workspace

__all__ = ["cross_entropy"]

# Must match logitless::CrossEntropyAlgo (include/logitless/cross_entropy.h); REDUCTIONS: see _autograd.
ALGOS = {"auto": 0, "row_resident": 1, "streaming": 2}

# ----------------------------------------------------------------------------------------------------
# Calls into C++. Every op allocates its outputs with torch (so CUDA graphs and the caching allocator
# see them) and passes torch's current stream.


def _options(ignore_index: int, reduction: int, label_smoothing: float, z_loss: float, softcap: float,
             check_targets: bool, algo: int) -> _C.CrossEntropyOptions:
    """The ops' option arguments (their schema's order, reduction and algo as the C++ enum values) as the
    binding's CrossEntropyOptions, field by field by name."""
    return _C.CrossEntropyOptions(ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
                                  z_loss=z_loss, softcap=softcap, check_targets=check_targets, algo=algo)


_cached_options = cached(_options)


def _params(ignore_index, reduction, label_smoothing, z_loss, softcap, check_targets, algo) -> tuple:
    """The public function's scalar arguments, checked, as the ops' option arguments (in `_options`' order)."""
    red, algo_code = enum(REDUCTIONS, reduction, "reduction"), enum(ALGOS, algo, "algo")
    return (check_int64(ignore_index, "ignore_index"), red, check_float(label_smoothing, "label_smoothing"),
            check_float(z_loss, "z_loss"), check_float(0.0 if softcap is None else softcap, "softcap"),
            bool(check_targets), algo_code)


@cached_settings
def _settings(*args) -> Tuple[tuple, _C.CrossEntropyOptions]:
    """An eager call's (`_params`, the binding's options over them), checked once per distinct argument tuple.
    torch.compile traces `_params` instead: the binding's objects are no values a graph can hold."""
    params = _params(*args)
    return params, _cached_options(*params)


def _scratch(ld, td, wd, options: _C.CrossEntropyOptions, logits: Tensor):
    """The call's workspace from the descriptors of logits, target and weight (made once per call: the call itself
    takes the same ones). None on the CPU, whose size is always 0, without asking."""
    if not logits.is_cuda:
        return None, None
    return workspace(_C.cross_entropy_workspace_bytes(ld, td, wd, options), logits.device)


def _float32_rows(g: Tensor) -> Tensor:
    """An upstream gradient as the C++ side takes it: float32 and contiguous (loss.sum() gives an expanded one). The
    usual one is already, and costs no dispatcher call here."""
    return g if g.dtype == torch.float32 and g.is_contiguous() else g.to(torch.float32).contiguous()


def _new_outputs(logits: Tensor, target: Tensor, reduction: int) -> Tuple[Tensor, Tensor, Tensor]:
    # loss: [] for sum/mean, the leading shape [*] for none; lse and z_loss: [*]. Always float32.
    f32 = dict(dtype=torch.float32, device=logits.device)
    loss = torch.empty(target.shape if reduction == REDUCTION_NONE else (), **f32)
    return loss, torch.empty(target.shape, **f32), torch.empty(target.shape, **f32)


def _outputs(logits: Tensor, target: Tensor, reduction: int) -> Tuple[Tensor, Tensor, Tensor]:
    """The implementations' `_new_outputs` (the same shapes, dtype and contiguous layout): empty_like of the target
    costs a third of a torch.empty that parses shape, dtype and device (target shares the logits' device)."""
    lse = torch.empty_like(target, dtype=torch.float32, memory_format=torch.contiguous_format)
    z = torch.empty_like(target, dtype=torch.float32, memory_format=torch.contiguous_format)
    if reduction == REDUCTION_NONE:
        return torch.empty_like(target, dtype=torch.float32, memory_format=torch.contiguous_format), lse, z
    return torch.empty((), dtype=torch.float32, device=logits.device), lse, z


def _run_forward_backward(logits: Tensor, target: Tensor, weight: Optional[Tensor], options: _C.CrossEntropyOptions,
                          grad: Tensor, stats: bool = True) -> Tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """(loss, lse, z_loss) and the gradient written into `grad`; without `stats`, lse and z_loss are not made
    (None: optional outputs of the C++ call)."""
    if stats:
        loss, lse, z = _outputs(logits, target, options.reduction)
    else:
        loss, lse, z = torch.empty((), dtype=torch.float32, device=logits.device), None, None
    ld, td, wd = descriptor(logits, "logits"), descriptor(target, "target"), descriptor(weight, "weight")
    owner, ws = _scratch(ld, td, wd, options, logits)
    _C.cross_entropy_forward_backward(ld, td, wd, options, descriptor(loss, "loss"), descriptor(lse, "lse"),
                                      descriptor(z, "z_loss"), descriptor(grad, "grad_logits"), None, ws,
                                      stream_of(logits))
    del owner  # freed in stream order: the caching allocator reuses it only for later work on this stream
    return loss, lse, z


# ----------------------------------------------------------------------------------------------------
# The ops. After the tensors, every op takes the arguments of `_options` in its order (custom ops take plain
# scalars). Fake kernels only need the reduction for the loss's shape.


@custom_op("logitless::cross_entropy_forward")
def _forward(logits: Tensor, target: Tensor, weight: Optional[Tensor], ignore_index: int, reduction: int,
             label_smoothing: float, z_loss: float, softcap: float, check_targets: bool,
             algo: int) -> Tuple[Tensor, Tensor, Tensor]:
    """(loss, lse, z_loss) with one read of the logits."""
    options = _cached_options(ignore_index, reduction, label_smoothing, z_loss, softcap, check_targets, algo)
    loss, lse, z = _outputs(logits, target, reduction)
    ld, td, wd = descriptor(logits, "logits"), descriptor(target, "target"), descriptor(weight, "weight")
    owner, ws = _scratch(ld, td, wd, options, logits)
    _C.cross_entropy_forward(ld, td, wd, options, descriptor(loss, "loss"), descriptor(lse, "lse"),
                             descriptor(z, "z_loss"), ws, stream(logits.device))
    del owner
    return loss, lse, z


@register_fake(_forward)
def _(logits, target, weight, ignore_index, reduction, *options):
    return _new_outputs(logits, target, reduction)


@custom_op("logitless::cross_entropy_forward_backward_out", mutates_args=("grad_logits",))
def _forward_backward_out(logits: Tensor, target: Tensor, weight: Optional[Tensor], ignore_index: int,
                          reduction: int, label_smoothing: float, z_loss: float, softcap: float,
                          check_targets: bool, algo: int, grad_logits: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """(loss, lse, z_loss), and the gradient of the reduced loss (upstream gradient 1) written into
    `grad_logits` (the logits' shape and dtype, memory apart from them) in the same pass."""
    options = _cached_options(ignore_index, reduction, label_smoothing, z_loss, softcap, check_targets, algo)
    return _run_forward_backward(logits, target, weight, options, grad_logits)


@register_fake(_forward_backward_out)
def _(logits, target, weight, ignore_index, reduction, *options_and_grad):
    return _new_outputs(logits, target, reduction)


@custom_op("logitless::cross_entropy_forward_backward_", mutates_args=("logits",))
def _forward_backward_inplace(logits: Tensor, target: Tensor, weight: Optional[Tensor], ignore_index: int,
                              reduction: int, label_smoothing: float, z_loss: float, softcap: float,
                              check_targets: bool, algo: int) -> Tuple[Tensor, Tensor, Tensor]:
    """As cross_entropy_forward_backward_out, but the gradient overwrites `logits` (no N x V allocation)."""
    options = _cached_options(ignore_index, reduction, label_smoothing, z_loss, softcap, check_targets, algo)
    return _run_forward_backward(logits, target, weight, options, logits)


@register_fake(_forward_backward_inplace)
def _(logits, target, weight, ignore_index, reduction, *options):
    return _new_outputs(logits, target, reduction)


@custom_op("logitless::cross_entropy_backward")
def _backward(logits: Tensor, target: Tensor, weight: Optional[Tensor], lse: Tensor, grad_loss: Tensor,
              ignore_index: int, reduction: int, label_smoothing: float, z_loss: float, softcap: float,
              check_targets: bool, algo: int) -> Tensor:
    """grad_logits from the forward's lse: float32 grad_loss is [] for sum/mean, [*] (contiguous) for none."""
    options = _cached_options(ignore_index, reduction, label_smoothing, z_loss, softcap, check_targets, algo)
    grad = empty_rows(logits)
    ld, td, wd = descriptor(logits, "logits"), descriptor(target, "target"), descriptor(weight, "weight")
    owner, ws = _scratch(ld, td, wd, options, logits)
    _C.cross_entropy_backward(ld, td, wd, descriptor(lse, "lse"), descriptor(grad_loss, "grad_loss"), options,
                              descriptor(grad, "grad_logits"), ws, stream(logits.device))
    del owner
    return grad


@register_fake(_backward)
def _(logits, *rest):
    return torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)


# ----------------------------------------------------------------------------------------------------
# Autograd.

# lse and the per-row z-loss are reported, not differentiated: their gradient is not what the C++
# backward computes (it is the loss's), so they leave the ops detached rather than with a wrong formula.


def _forward_setup(ctx, inputs, output):
    logits, target, weight, *options = inputs
    _, lse, z = output
    ctx.mark_non_differentiable(lse, z)
    ctx.save_for_backward(logits, target, weight, lse)
    ctx.options = options
    # lse and z carry no gradient: no zero tensors made for them on every backward.
    ctx.set_materialize_grads(False)


def _forward_grad(ctx, grad_loss, grad_lse, grad_z, direct: bool = False):
    """`direct`: the forward took the direct path (`_EagerCrossEntropy`); the backward op's implementation then runs
    without the op's layers where the incoming gradient is eager_ok too."""
    no_double_backward("cross_entropy")
    if grad_loss is None:  # no gradient reached the loss
        return (None,) * 10
    logits, target, weight, lse = ctx.saved_tensors
    if not ctx.needs_input_grad[0]:
        return (None,) * 10
    grad_loss = _float32_rows(grad_loss)
    if direct and _autograd.eager_ok((grad_loss,)):
        grad = _backward.run_direct(logits, target, weight, lse, grad_loss, *ctx.options)
    else:
        grad = _backward(logits, target, weight, lse, grad_loss, *ctx.options)
    return (grad,) + (None,) * 9


_forward.register_autograd(_forward_grad, setup_context=_forward_setup)


class _EagerCrossEntropy(torch.autograd.Function):
    """The forward op with its registered autograd formula, as one autograd.Function over the ops' implementations:
    the direct path of an eager_ok call that needs a gradient through the per-row loss (reduction none). The generic
    path (logitless._autograd's _Direct) runs the same code behind more layers per call.

    forward(logits, target, weight, options): `options` the ops' option arguments."""

    @staticmethod
    def forward(ctx, logits, target, weight, options):
        out = _forward.run_direct(logits, target, weight, *options)
        _forward_setup(ctx, (logits, target, weight, *options), out)
        return out

    @staticmethod
    def backward(ctx, grad_loss, grad_lse, grad_z):
        return _forward_grad(ctx, grad_loss, grad_lse, grad_z, direct=True)[:4]


class _FusedCrossEntropy(torch.autograd.Function):
    """Loss and gradient in one pass (reduction sum/mean); backward scales the saved gradient in place.

    Why an autograd.Function around mutating ops rather than a functional op with register_autograd:
    the saved gradient is scaled in place in backward (that is what makes backward free), and a
    functional op would have to return that buffer as an output, visible to its caller and mutated
    later behind its back (torch.compile's partitioner rejects exactly that). Here the buffer is
    allocated inside forward and never leaves it; for inplace_backward the buffer is the logits, and
    the op that overwrites them declares it (mutates_args), so torch bumps their version counter and
    any other node that saved them raises in its backward. No ctx.mark_dirty: the tensor it would have
    us return as a rebased output holds a gradient, which nothing could differentiate further.

    forward(logits, target, weight, inplace, direct, params, options, stats): `direct` when the call is eager_ok
    (the ops' implementations then run without the ops' layers, see logitless._autograd), `params` the ops' option
    arguments, `options` the binding's over them. Returns (loss, lse, z_loss), or the loss alone without `stats` (a
    direct call that returns neither lse nor z_loss, which are then not made).
    """

    @staticmethod
    def forward(ctx, logits, target, weight, inplace, direct, params, options, stats):
        if inplace:
            op, args = _forward_backward_inplace, (logits, target, weight, *params)
            grad = logits
        else:
            grad = empty_rows(logits)
            op, args = _forward_backward_out, (logits, target, weight, *params, grad)
        if direct and not inplace:  # a fresh buffer: no other node can have saved it, no version to bump
            loss, lse, z = direct_apply(_run_forward_backward, op.name, logits, target, weight, options, grad, stats)
        else:
            loss, lse, z = op.run_direct(*args) if direct else op(*args)
        ctx.direct = direct
        # Saved after the mutation: this node's own version check passes, and a later write to the
        # buffer (or a second backward over a retained graph, after the scaling below) is caught.
        ctx.save_for_backward(grad)
        # lse and z never get a gradient (non-differentiable): without this, autograd would allocate and fill
        # a zero tensor for each of them on every backward, for nothing.
        ctx.set_materialize_grads(False)
        if not stats:
            return loss
        ctx.mark_non_differentiable(lse, z)
        return loss, lse, z

    @staticmethod
    def backward(ctx, grad_loss, grad_lse=None, grad_z=None):
        no_double_backward("cross_entropy")
        if grad_loss is None:  # no gradient reached the loss (the other outputs carry none)
            return (None,) * 8
        (grad,) = ctx.saved_tensors
        return (scale_saved(grad, _float32_rows(grad_loss), ctx.direct),) + (None,) * 7


# ----------------------------------------------------------------------------------------------------
# The public function.


def cross_entropy(
    logits: Tensor,
    target: Tensor,
    weight: Optional[Tensor] = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: Optional[float] = None,
    return_lse: bool = False,
    return_z_loss: bool = False,
    inplace_backward: bool = False,
    *,
    check_targets: bool = True,
    algo: str = "auto",
    process_group=None,
) -> Union[Tensor, Tuple[Tensor, ...]]:
    """Cross-entropy of `logits` [*, V] against class indices `target` [*] (class dimension last).

    Same names and meaning as ``torch.nn.functional.cross_entropy``, with the classes in the last
    dimension (torch puts them in dimension 1 of [N, C, d1, ...]). Per row i with target t,
    x = softcap * tanh(logits / softcap) if softcap else logits, w = weight (or ones), eps = label_smoothing::

        loss_i = (1 - eps) * w_t * (lse_i - x_t) + eps / V * sum_j w_j * (lse_i - x_j) + z_loss * lse_i**2

    Args:
        logits: [*, V] float32, float16 or bfloat16 on the CPU or a CUDA device, at most 8 dimensions. The last
            dimension must be contiguous (stride 1). The leading ones (the rows) may have any strides, 0 included,
            as long as they collapse, jointly with target's, to at most 3 strided dimensions: size-1 dimensions
            are dropped and two neighbours merge where they are contiguous with each other in both tensors. Any
            view of a tensor of up to 4 dimensions qualifies, so a shifted view such as ``logits[:, :-1, :]`` goes
            in without a copy; otherwise a ValueError names the tensor to make contiguous.
        target: [*] int32 or int64 class indices, the leading shape of `logits`, strides as above.
        weight: optional [V] per-class weights of any float dtype (used as float32; no gradient flows to it).
        ignore_index: rows with this target get loss 0 and gradient 0 and are not read.
        reduction: "mean" (sum divided by the summed weights of the targets not ignored, as torch does),
            "sum" or "none" (loss per row, shape [*]). When every row is ignored (or N = 0) the mean is 0
            with gradient 0, where torch gives NaN.
        label_smoothing: in [0, 1], torch's label smoothing.
        z_loss: >= 0, adds z_loss * lse**2 per row (PaLM's z-loss), inside the reduction; with reduction
            "mean" these terms are averaged over the rows not ignored, unweighted (as Liger does), so the loss
            does not depend on the scale of `weight`.
        softcap: None/0 for no cap, or > 0 to cap the logits as softcap * tanh(logits / softcap) first.
        return_lse: also return the per-row log-sum-exp [*] (float32, of the capped logits; 0 for ignored
            rows).
        return_z_loss: also return the per-row z-loss term z_loss * lse**2 [*] (float32), e.g. to log it.
        inplace_backward: for reduction sum/mean, write the gradient into the storage of `logits` during
            the forward (no extra [*, V] memory). Afterwards `logits` holds the gradient, not the logits:
            do not read it. Autograd's version counter still protects other users of `logits`: a node that
            saved it (e.g. ``tanh``, which saves its output) raises "modified by an inplace operation" in
            backward. `logits` must not be a leaf that requires grad. Ignored for reduction none (its
            gradient needs the upstream per-row gradient, known only in backward) and when no gradient is
            needed (the logits are then left untouched).
        check_targets: check the targets eagerly (on CUDA this reads one number back, a host
            synchronization per call; it is skipped anyway while a CUDA graph is captured). False trusts them:
            a bad row then gets a NaN loss and gradient instead of an error.
        algo: CUDA kernel choice, for tests and benchmarks: "auto", "row_resident" (Hopper) or "streaming".
        process_group: vocabulary parallelism. `logits` [*, V_r] is then this rank's slice of the vocabulary
            (the ranks' slices in rank order tile [0, V); widths may differ, or be 0), `target` holds global class
            indices of every row and `weight`, if given, the whole vocabulary's [V]; the result is the unsharded
            loss, computed with one all_gather of 4 floats per row and rank (no logits gathered), the gradient of
            each shard's logits without communication. A DTensor `logits` sharded along its last dimension
            (``Shard(-1)``) does the same over its mesh. Every option works as above (the vocabulary-parallel path
            runs eagerly: see logitless.vocab_parallel).

    Returns:
        The float32 loss ([] for sum/mean, [*] for none), or a tuple ``(loss, lse)``, ``(loss, z_loss)`` or
        ``(loss, lse, z_loss)`` when asked for. lse and z_loss are detached (no gradient flows through them;
        use the `z_loss` argument for a differentiable z-loss).

    Raises:
        ValueError: on a bad argument, naming it; for a target outside [0, V) that is not ignore_index,
            naming the first bad row (checked eagerly; skipped while a CUDA graph is captured, where such a
            row's loss and gradient are NaN instead).

    Autograd: for sum/mean the gradient is computed in the forward pass and the backward only scales it (in
    place), so it can be consumed once: a second backward through the same call (retain_graph=True) raises
    torch's "modified by an inplace operation" error; reduce a reduction="none" loss yourself if you need
    that. Double backward (create_graph=True) is not supported.
    """
    scalars = (ignore_index, reduction, label_smoothing, z_loss, softcap, check_targets, algo)
    params, options = (_params(*scalars), None) if torch.compiler.is_compiling() else _settings(*scalars)
    red = params[1]
    check_process_group(process_group)
    # The vocabulary-parallel path takes DTensors (logits sharded; target and weight made local there).
    sharded = process_group is not None or is_dtensor(logits)
    check_tensors((("logits", logits), ("target", target), ("weight", weight)), optional=("weight",),
                  dtensor_ok=("logits", "target", "weight") if sharded else ())
    if not sharded:
        check_rows(logits.dim() - 1, (("logits", logits), ("target", target)))
    inplace_backward = bool(inplace_backward)
    if weight is not None:
        # A copy where the gradient overwrites the logits: a weight that shares their memory (a view of them, or a
        # float32 weight that .to() hands back as is) would be read while it is overwritten.
        weight = weight.detach().to(torch.float32, copy=inplace_backward)

    if sharded:
        # Imported here, not at the top, only so that `import logitless` does not load the vocabulary-parallel module
        # for single-device use (it imports nothing that imports back: no cycle).
        from . import vocab_parallel

        loss, lse, z = vocab_parallel.cross_entropy(logits, target, weight, _options(*params), inplace_backward,
                                                    process_group)
        if not (return_lse or return_z_loss):
            return loss
        return (loss,) + ((lse,) if return_lse else ()) + ((z,) if return_z_loss else ())

    needs_grad = torch.is_grad_enabled() and logits.requires_grad
    if needs_grad and red == REDUCTION_NONE and _autograd.eager_ok((logits, target, weight)):
        loss, lse, z = _EagerCrossEntropy.apply(logits, target, weight, params)
    elif not needs_grad or red == REDUCTION_NONE:
        loss, lse, z = _forward(logits, target, weight, *params)
    else:
        if inplace_backward:
            # Overwriting a leaf that requires grad (or a view of one) would destroy a parameter and hand
            # autograd its own storage as the gradient; torch refuses in-place ops there too.
            owner = logits._base if logits._base is not None else logits
            if owner.is_leaf and owner.requires_grad:
                raise ValueError("logits: inplace_backward=True needs logits computed by an op (e.g. a matmul); "
                                 "got a leaf tensor that requires grad (or a view of one), whose values it would "
                                 "overwrite")
            check_writable_rows(logits, "logits", "inplace_backward=True")
        direct = _autograd.eager_ok((logits, target, weight))
        stats = return_lse or return_z_loss or not direct
        out = _FusedCrossEntropy.apply(logits, target, weight, inplace_backward, direct, params, options, stats)
        if not stats:
            return out
        loss, lse, z = out

    if not (return_lse or return_z_loss):
        return loss
    return (loss,) + ((lse,) if return_lse else ()) + ((z,) if return_z_loss else ())
