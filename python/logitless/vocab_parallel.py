"""Vocabulary-parallel (tensor-parallel) cross-entropy and linear cross-entropy over torch.distributed.

Reached through ``logitless.cross_entropy(..., process_group=pg)`` and ``logitless.linear_cross_entropy(...,
process_group=pg)``, or by passing a DTensor sharded along the vocabulary (logits ``Shard(-1)``; an LM head's
weight ``Shard(0)`` with ``vocab_parallel=True``, since an FSDP2 parameter shard has that placement too). Every
rank holds a slice of the vocabulary, in rank order, and sees every token: the logits are never gathered. The C++
core (include/logitless/vocab_parallel.h) computes per-shard partial statistics and the gradients; this module does
the communication, with torch.distributed only:

* forward: one all_gather of the per-token partial statistics (4 floats a token and rank), after which every rank
  finalizes the same loss and lse. The linear variant's gradient-in-forward schedule gathers them a token chunk at
  a time (an O(chunk) collective per chunk, O(N) in all), started asynchronously so that the next chunk's logits
  GEMM runs while it is in flight, which keeps three GEMMs per rank (see the header for why that matters).
* backward: the logits' gradient is local. The linear variant's partial gradient of the hidden states (float32)
  is all_reduced over the group, or reduce_scattered under ``sequence_parallel=True`` (where each rank passes only
  its own tokens, gathered here, and gets back only their gradient); grad_weight and grad_bias are the shard's.

The shard layout: with a process group, each rank's local width is exchanged once per call (an all_gather of one
integer: on NCCL, one host synchronization); with a DTensor it comes from the placement (torch.chunk's split).
Every rank must call with the same tokens, targets and options; an error raised on some ranks only (a bad shape on
one rank) leaves the others waiting in a collective, as with any collective code.

FSDP2 (and anything that frees and regathers a weight between forward and backward): the recompute schedule saves
the weight with ``save_for_backward`` and reads its storage only in the backward, from the tensor autograd hands
back, so a regathered weight is read where it is then. The gradient-in-forward schedule reads the weight only in
the forward (the gradients are computed there, held until the backward and scaled by the upstream gradient), so it
never touches a resharded weight; FSDP2's regather before the backward is then simply unused by this loss.

Under ``torch.autocast`` (bfloat16 or float16) float32 operands are cast to its dtype for the products, as on one
device, and the gradients of float32 arguments come back in float32, written so by the kernels. The hidden states
are cast before they are gathered under sequence parallelism (half the bytes). The gradient-in-forward schedule's
16-bit copies live only in its forward; the recompute schedule keeps the arguments themselves and casts the weight
again in the backward, from the tensor autograd hands back (a regathered weight included), so that no 16-bit copy of
the weight is held between the passes.

The vocabulary-parallel path runs eagerly (an autograd.Function calling the extension and torch.distributed);
torch.compile treats it as an opaque region (a graph break).
"""
from __future__ import annotations

import copy
from typing import NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from . import _C
from ._autograd import REDUCTION_NONE, cast_operands, no_double_backward, scale_saved
from ._tensor import descriptor, stream, workspace

__all__ = ["VocabShard", "shard_of_group", "shard_of_dtensor", "is_dtensor"]

_STEP_LOGITS, _STEP_GRADIENT = 0, 1


class VocabShard(NamedTuple):
    """This rank's place in the vocabulary: its classes are [offset, offset + width) of `vocab`."""

    group: Optional[dist.ProcessGroup]
    rank: int
    world: int
    offset: int
    vocab: int
    widths: Tuple[int, ...]  # every rank's width, rank order

    @property
    def width(self) -> int:
        return self.widths[self.rank]


def shard_of_group(group: Optional[dist.ProcessGroup], width: int, device: torch.device) -> VocabShard:
    """The layout of a vocabulary split over `group` in rank order, from each rank's local `width` (one all_gather
    of an integer on `device`)."""
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    mine = torch.tensor([width], dtype=torch.int64, device=device)
    every = torch.empty(world, dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(every, mine, group=group)
    widths = tuple(int(w) for w in every.tolist())
    return VocabShard(group, rank, world, sum(widths[:rank]), sum(widths), widths)


def is_dtensor(t) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor
        return False
    return isinstance(t, DTensor)


def shard_of_dtensor(t, dim: int, name: str) -> Tuple[Tensor, Optional[VocabShard]]:
    """(local tensor, shard) of a DTensor along dimension `dim` (the vocabulary). The local tensor comes from
    ``to_local()`` (differentiable: its gradient goes back as a DTensor of the same placements). A tensor replicated
    over its whole mesh gives shard None (nothing is split)."""
    from torch.distributed.tensor import Replicate, Shard

    mesh, placements = t.device_mesh, t.placements
    dim = dim % t.dim()
    sharded = [i for i, p in enumerate(placements) if isinstance(p, Shard) and p.dim % t.dim() == dim]
    others = [p for i, p in enumerate(placements) if i not in sharded and not isinstance(p, Replicate)]
    if len(sharded) > 1 or others:
        raise ValueError(f"{name}: expected a DTensor sharded along the vocabulary (dimension {dim}) over one mesh "
                         f"dimension and replicated over the others, got placements {tuple(placements)}")
    local = t.to_local()
    if not sharded:
        return local, None
    mesh_dim = sharded[0]
    group = mesh.get_group(mesh_dim)
    world, rank = mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim)
    vocab = t.shape[dim]
    chunk = -(-vocab // world)  # torch.chunk's split, as Shard places it
    widths = tuple(max(0, min(vocab, (r + 1) * chunk) - min(vocab, r * chunk)) for r in range(world))
    if local.shape[dim] != widths[rank]:
        raise ValueError(f"{name}: expected this rank's shard to hold {widths[rank]} of the {vocab} classes (an even "
                         f"split in rank order), got {local.shape[dim]}")
    return local, VocabShard(group, rank, world, min(vocab, rank * chunk), vocab, widths)


# ----------------------------------------------------------------------------------------------------
# Collectives (torch.distributed; nothing else here communicates).


def _all_gather(t: Tensor, shard: VocabShard, async_op: bool = False, out: Optional[Tensor] = None):
    """Every rank's `t` stacked along a new first dimension: [R, *t.shape] (rank order)."""
    t = t.contiguous()
    if out is None:
        out = torch.empty((shard.world,) + tuple(t.shape), dtype=t.dtype, device=t.device)
    if shard.world == 1 or t.numel() == 0:  # (every rank has the same number of rows: none to exchange)
        out.copy_(t.unsqueeze(0))
        return (out, None) if async_op else out
    flat = out.view((shard.world * t.shape[0],) + tuple(t.shape[1:]))
    work = dist.all_gather_into_tensor(flat, t, group=shard.group, async_op=async_op)
    return (out, work) if async_op else out


def _sum_over_ranks(t: Tensor, shard: VocabShard) -> Tensor:
    if shard.world > 1 and t.numel() > 0:
        dist.all_reduce(t, group=shard.group)
    return t


def _sum_scatter_rows(t: Tensor, shard: VocabShard) -> Tensor:
    """Sum over the ranks of `t` [R * n, ...], each rank keeping its own n rows (sequence parallelism)."""
    n = t.shape[0] // shard.world
    if shard.world == 1:
        return t
    if t.numel() == 0:
        return t[:n]
    out = torch.empty((n,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    dist.reduce_scatter_tensor(out, t.contiguous(), group=shard.group)
    return out


def _gather_tokens(hidden: Tensor, target: Tensor, shard: VocabShard) -> Tuple[Tensor, Tensor]:
    """Sequence parallelism: every rank's tokens, in rank order ([R * n, H] and [R * n])."""
    h = hidden.reshape(-1, hidden.shape[-1])
    t = target.reshape(-1)
    return (_all_gather(h, shard).view(-1, h.shape[-1]), _all_gather(t, shard).view(-1))


# ----------------------------------------------------------------------------------------------------
# Cross-entropy over given logits.


def _ce_outputs(target: Tensor, reduction: int):
    f32 = dict(dtype=torch.float32, device=target.device)
    loss = torch.empty(target.shape if reduction == REDUCTION_NONE else (), **f32)
    return loss, torch.empty(target.shape, **f32), torch.empty(target.shape, **f32)


def _ce_forward(logits, target, weight, shard: VocabShard, params: _C.CrossEntropyOptions):
    """(loss, lse, z_loss): this shard's partials, one all_gather, finalize (the same bits on every rank)."""
    dev = target.device
    owner, ws = workspace(_C.cross_entropy_shard_workspace_bytes(descriptor(target, "target"), params), dev)
    partials = torch.empty(target.shape + (4,), dtype=torch.float32, device=dev)
    _C.cross_entropy_shard_partials(descriptor(logits, "logits"), descriptor(target, "target"),
                                    descriptor(weight, "weight"), shard.offset, shard.vocab, params,
                                    descriptor(partials, "partials"), ws, stream(dev))
    gathered = _all_gather(partials.view(-1, 4), shard)
    loss, lse, z = _ce_outputs(target, params.reduction)
    _C.cross_entropy_shard_finalize(descriptor(gathered, "partials"), descriptor(target, "target"),
                                    descriptor(weight, "weight"), shard.vocab, params, descriptor(loss, "loss"),
                                    descriptor(lse, "lse"), descriptor(z, "z_loss"), ws, stream(dev))
    del owner
    return loss, lse, z


def _ce_backward(logits, target, weight, shard: VocabShard, lse, grad_loss, params, grad):
    dev = target.device
    owner, ws = workspace(_C.cross_entropy_shard_workspace_bytes(descriptor(target, "target"), params), dev)
    _C.cross_entropy_shard_backward(descriptor(logits, "logits"), descriptor(target, "target"),
                                    descriptor(weight, "weight"), shard.offset, shard.vocab, descriptor(lse, "lse"),
                                    descriptor(grad_loss, "grad_loss"), params, descriptor(grad, "grad_logits"), ws,
                                    stream(dev))
    del owner
    return grad


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Loss from the shards' partials; the backward of each shard from the global lse (no communication). With
    `inplace` (reduction sum/mean) the gradient overwrites the local logits in the forward and the backward scales
    it, as logitless.cross_entropy(inplace_backward=True) does on one device."""

    @staticmethod
    def forward(ctx, logits, target, weight, shard, params, inplace):
        loss, lse, z = _ce_forward(logits, target, weight, shard, params)
        ctx.mark_non_differentiable(lse, z)
        ctx.inplace = inplace
        if inplace:
            one = torch.ones((), dtype=torch.float32, device=target.device)
            _ce_backward(logits, target, weight, shard, lse, one, params, logits)
            # The logits now hold their gradient: a node that saved them must fail its version check.
            torch.autograd.graph.increment_version(logits)
            ctx.save_for_backward(logits)
        else:
            ctx.shard, ctx.params = shard, params
            ctx.save_for_backward(logits, target, weight, lse)
        return loss, lse, z

    @staticmethod
    def backward(ctx, grad_loss, grad_lse, grad_z):
        no_double_backward("cross_entropy")
        g = grad_loss.to(torch.float32).contiguous()
        if ctx.inplace:
            (grad,) = ctx.saved_tensors
            return (scale_saved(grad, g),) + (None,) * 5
        logits, target, weight, lse = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return (None,) * 6
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        return (_ce_backward(logits, target, weight, ctx.shard, lse, g, ctx.params, grad),) + (None,) * 5


def cross_entropy(logits: Tensor, target: Tensor, weight: Optional[Tensor], params: _C.CrossEntropyOptions,
                  inplace: bool, process_group) -> Tuple[Tensor, Tensor, Tensor]:
    """The vocabulary-parallel path of logitless.cross_entropy: (loss, lse, z_loss)."""
    given = logits
    if is_dtensor(target):
        target = target.to_local()
    if is_dtensor(weight):
        weight = weight.full_tensor()
    if is_dtensor(logits):
        if process_group is not None:
            raise ValueError("process_group: expected None with DTensor logits (the DTensor's mesh is the group)")
        logits, shard = shard_of_dtensor(logits, -1, "logits")
        if shard is None:  # replicated: nothing is split
            shard = VocabShard(None, 0, 1, 0, logits.shape[-1], (logits.shape[-1],))
    else:
        shard = shard_of_group(process_group, logits.shape[-1], logits.device)
    if weight is not None and weight.shape != (shard.vocab,):
        raise ValueError(f"weight: expected shape [{shard.vocab}] (the whole vocabulary's class weights), "
                         f"got {list(weight.shape)}")
    needs_grad = torch.is_grad_enabled() and logits.requires_grad
    inplace = bool(inplace) and needs_grad and params.reduction != REDUCTION_NONE
    if inplace:
        # The caller's tensor, not its local shard: to_local() of a DTensor parameter is never a leaf, yet it is the
        # parameter's own storage.
        owner = given._base if given._base is not None else given
        if owner.is_leaf and owner.requires_grad:
            raise ValueError("logits: inplace_backward=True needs logits computed by an op (e.g. a matmul); got a "
                             "leaf tensor that requires grad (or a view of one), whose values it would overwrite")
    if not needs_grad:
        return _ce_forward(logits, target, weight, shard, params)
    return _VocabParallelCrossEntropy.apply(logits, target, weight, shard, params, inplace)


# ----------------------------------------------------------------------------------------------------
# Linear cross-entropy.


def _ce_params(options: _C.LinearCrossEntropyOptions) -> _C.CrossEntropyOptions:
    # The cross-entropy family's options from the linear one's (targets were checked by the partials call; the
    # kernel choice stays automatic).
    return _C.CrossEntropyOptions(ignore_index=options.ignore_index, reduction=options.reduction,
                                  label_smoothing=options.label_smoothing, z_loss=options.z_loss,
                                  softcap=options.softcap, check_targets=False)


def _rank_rows(t: Tensor, shard: VocabShard) -> Tensor:
    n = t.shape[0] // shard.world
    return t[shard.rank * n:(shard.rank + 1) * n]


class _Tokens(NamedTuple):
    hidden: Tensor  # [N, H] or [*, H]: every token (gathered under sequence parallelism)
    target: Tensor
    local_shape: torch.Size  # the caller's target shape (this rank's tokens)
    sequence_parallel: bool


def _tokens(hidden, target, shard, sequence_parallel) -> _Tokens:
    if sequence_parallel:
        h, t = _gather_tokens(hidden, target, shard)
        return _Tokens(h, t, target.shape, True)
    return _Tokens(hidden, target, target.shape, False)


def _lce_finalize(tok: _Tokens, class_weight, shard, options, gathered):
    dev = tok.target.device
    params = _ce_params(options)
    loss, lse, _ = _ce_outputs(tok.target, options.reduction)
    owner, ws = workspace(_C.cross_entropy_shard_workspace_bytes(descriptor(tok.target, "target"), params), dev)
    _C.cross_entropy_shard_finalize(descriptor(gathered, "partials"), descriptor(tok.target, "target"),
                                    descriptor(class_weight, "class_weight"), shard.vocab, params,
                                    descriptor(loss, "loss"), descriptor(lse, "lse"), None, ws, stream(dev))
    del owner
    return loss, lse


def _lce_forward_recompute(tok: _Tokens, weight, bias, class_weight, shard, options):
    """(loss, lse) over every token: partials (one GEMM over token chunks), one all_gather, finalize."""
    dev = tok.target.device
    h, w, t = descriptor(tok.hidden, "hidden"), descriptor(weight, "weight"), descriptor(tok.target, "target")
    owner, ws = workspace(_C.linear_cross_entropy_shard_partials_workspace_bytes(h, w, t, shard.offset, shard.vocab,
                                                                                   options), dev)
    partials = torch.empty(tok.target.shape + (4,), dtype=torch.float32, device=dev)
    _C.linear_cross_entropy_shard_partials(h, w, descriptor(bias, "bias"), t, descriptor(class_weight, "class_weight"),
                                           shard.offset, shard.vocab, options, descriptor(partials, "partials"), ws,
                                           stream(dev))
    del owner
    return _lce_finalize(tok, class_weight, shard, options, _all_gather(partials.view(-1, 4), shard))


def _local_outputs(tok: _Tokens, shard, loss, lse, reduction):
    """Under sequence parallelism a per-token output is returned for this rank's tokens only."""
    if not tok.sequence_parallel:
        return loss, lse
    lse = _rank_rows(lse.reshape(-1), shard).reshape(tok.local_shape)
    if reduction == REDUCTION_NONE:
        loss = _rank_rows(loss.reshape(-1), shard).reshape(tok.local_shape)
    return loss, lse


def _finish_grad_hidden(gh: Tensor, shape: torch.Size, dtype: torch.dtype, shard: VocabShard,
                        sequence_parallel: bool) -> Tensor:
    """Every rank's float32 partial sums [N, H] -> the gradient of this rank's hidden states (`shape`, `dtype`):
    summed over the ranks, or summed and scattered by tokens under sequence parallelism; rounded once."""
    gh = gh.reshape(-1, gh.shape[-1])
    gh = _sum_scatter_rows(gh, shard) if sequence_parallel else _sum_over_ranks(gh, shard)
    return gh.to(dtype).view(shape)


class _VocabParallelLinearRecompute(torch.autograd.Function):
    """Recompute schedule: the forward keeps the global lse; the backward recomputes this shard's logits from the
    weight autograd hands back (read then, never earlier) and sums grad_hidden over the ranks."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, class_weight, shard, options, sequence_parallel, compute_dtype):
        ctx.hidden_meta = (hidden.shape, hidden.dtype)
        ctx.compute_dtype = compute_dtype
        h, w, b = cast_operands(hidden, weight, bias, compute_dtype)
        tok = _tokens(h, target, shard, sequence_parallel)
        loss, lse = _lce_forward_recompute(tok, w, b, class_weight, shard, options)
        ctx.shard, ctx.options, ctx.sp = shard, options, sequence_parallel
        # The arguments themselves are kept, not their 16-bit copies: no copy of the weight lives between the passes,
        # and the backward reads the weight autograd hands back (cast again there).
        if sequence_parallel:  # the gathered tokens: an intermediate, kept for the backward
            ctx.full = (tok.hidden, tok.target)
            ctx.save_for_backward(weight, bias, class_weight, lse)
        else:
            ctx.full = None
            ctx.save_for_backward(hidden, weight, bias, target, class_weight, lse)
        out_loss, out_lse = _local_outputs(tok, shard, loss, lse, options.reduction)
        ctx.mark_non_differentiable(out_lse)
        return out_loss, out_lse

    @staticmethod
    def backward(ctx, grad_loss, grad_lse):
        no_double_backward("linear_cross_entropy")
        shard, options = ctx.shard, ctx.options
        if ctx.sp:
            weight, bias, class_weight, lse = ctx.saved_tensors
            hidden, target = ctx.full
        else:
            hidden, weight, bias, target, class_weight, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        need_b = need_b and bias is not None
        if not (need_h or need_w or need_b):
            return (None,) * 8
        g = grad_loss.to(torch.float32).contiguous()
        if ctx.sp and options.reduction == REDUCTION_NONE:  # every token's upstream gradient, in rank order
            g = _all_gather(g.reshape(-1), shard).view(-1)
        dev = target.device
        # float32 partial sums of grad_hidden: summed over the ranks before the one rounding to hidden's dtype.
        gh = torch.empty(hidden.shape, dtype=torch.float32, device=dev) if need_h else None
        # In the arguments' dtypes: under autocast the kernels write a float32 weight's gradient directly.
        gw = torch.empty(weight.shape, dtype=weight.dtype, device=dev) if need_w else None
        gb = torch.empty(bias.shape, dtype=bias.dtype, device=dev) if need_b else None
        hidden, weight, bias = cast_operands(hidden, weight, bias, ctx.compute_dtype)  # (gathered tokens: cast already)
        d = descriptor
        h, w, t = d(hidden, "hidden"), d(weight, "weight"), d(target, "target")
        ghd, gwd, gbd = d(gh, "grad_hidden"), d(gw, "grad_weight"), d(gb, "grad_bias")
        owner, ws = workspace(_C.linear_cross_entropy_shard_backward_workspace_bytes(
            h, w, t, ghd, gwd, gbd, shard.offset, shard.vocab, options), dev)
        _C.linear_cross_entropy_shard_backward(h, w, d(bias, "bias"), t, d(class_weight, "class_weight"),
                                               shard.offset, shard.vocab, d(lse, "lse"), d(g, "grad_loss"), options,
                                               ghd, gwd, gbd, ws, stream(dev))
        del owner
        dx = None
        if need_h:
            dx = _finish_grad_hidden(gh, *ctx.hidden_meta, shard, ctx.sp)
        return dx, gw, gb, None, None, None, None, None, None


def _lce_forward_backward_steps(tok: _Tokens, weight, bias, class_weight, shard, options, need, grad_dtypes):
    """The gradient-in-forward schedule in steps: (loss, lse, grad_hidden partial float32, grad_weight, grad_bias),
    the last two in `grad_dtypes` (the arguments' own: float32 for float32 parameters under autocast, written so by
    the kernels). Chunk k's partials are gathered asynchronously while chunk k + 1's logits are computed."""
    dev = tok.target.device
    N = tok.target.numel()
    need_h, need_w, need_b = need
    gh = torch.empty(tok.hidden.shape, dtype=torch.float32, device=dev) if need_h else None
    gw = torch.empty(weight.shape, dtype=grad_dtypes[0], device=dev) if need_w else None
    gb = torch.empty(bias.shape, dtype=grad_dtypes[1], device=dev) if need_b else None
    chunk = _C.linear_cross_entropy_shard_chunk_tokens(N, max(shard.widths), options)
    options = copy.copy(options)  # the caller's, unchanged
    options.chunk_tokens = chunk
    d = descriptor
    h, w, t, b, cw = (d(tok.hidden, "hidden"), d(weight, "weight"), d(tok.target, "target"), d(bias, "bias"),
                      d(class_weight, "class_weight"))
    ghd, gwd, gbd = d(gh, "grad_hidden"), d(gw, "grad_weight"), d(gb, "grad_bias")
    _, chunks, nbytes = _C.linear_cross_entropy_shard_steps(h, w, t, ghd, gwd, gbd, shard.offset, shard.vocab, options)
    owner, ws = workspace(nbytes, dev)
    loss = torch.empty((), dtype=torch.float32, device=dev)
    lse = torch.empty(tok.target.shape, dtype=torch.float32, device=dev)
    partials = torch.empty(N, 4, dtype=torch.float32, device=dev)
    gathered = torch.empty(shard.world * N * 4, dtype=torch.float32, device=dev)
    ld, sd = d(loss, "loss"), d(lse, "lse")
    s = stream(dev)

    def rows(k):
        return k * chunk, min(chunk, N - k * chunk)

    def logits_step(k):
        r0, n = rows(k)
        mine = partials[r0:r0 + n]
        _C.linear_cross_entropy_shard_forward_backward_step(_STEP_LOGITS, k, d(mine, "partials"), h, w, b, t, cw,
                                                            shard.offset, shard.vocab, options, ld, sd, ghd, gwd, gbd,
                                                            ws, s)
        every = gathered[shard.world * r0 * 4:shard.world * (r0 + n) * 4].view(shard.world, n, 4)
        _, work = _all_gather(mine, shard, async_op=True, out=every)
        return every, work

    pending = logits_step(0) if chunks else None
    for k in range(chunks):
        every, work = pending
        if k + 1 < chunks:
            pending = logits_step(k + 1)  # its GEMM overlaps chunk k's exchange
        if work is not None:
            work.wait()  # on CUDA: the current stream waits for the collective, the host does not
        _C.linear_cross_entropy_shard_forward_backward_step(_STEP_GRADIENT, k, d(every, "partials"), h, w, b, t, cw,
                                                            shard.offset, shard.vocab, options, ld, sd, ghd, gwd, gbd,
                                                            ws, s)
    del owner
    return loss, lse, gh, gw, gb


class _VocabParallelLinearFused(torch.autograd.Function):
    """Gradient-in-forward schedule (reduction sum/mean): the gradients are computed in the forward; the backward
    scales them by the upstream gradient and sums grad_hidden over the ranks."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, class_weight, shard, options, sequence_parallel, compute_dtype):
        need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2])
        grad_dtypes = (weight.dtype, None if bias is None else bias.dtype)
        h, w, b = cast_operands(hidden, weight, bias, compute_dtype)  # 16-bit copies that live only in this call
        tok = _tokens(h, target, shard, sequence_parallel)
        loss, lse, gh, gw, gb = _lce_forward_backward_steps(tok, w, b, class_weight, shard, options, need,
                                                            grad_dtypes)
        ctx.shard, ctx.sp, ctx.need = shard, sequence_parallel, need
        ctx.hidden_meta = (hidden.shape, hidden.dtype)
        ctx.save_for_backward(gh, gw, gb)
        _, out_lse = _local_outputs(tok, shard, loss, lse, options.reduction)
        ctx.mark_non_differentiable(out_lse)
        return loss, out_lse

    @staticmethod
    def backward(ctx, grad_loss, grad_lse):
        no_double_backward("linear_cross_entropy")
        gh, gw, gb = ctx.saved_tensors
        scale = grad_loss.to(torch.float32).contiguous()
        dx = dw = db = None
        if ctx.need[0]:
            dx = _finish_grad_hidden(scale_saved(gh, scale), *ctx.hidden_meta, ctx.shard, ctx.sp)
        if ctx.need[1]:
            dw = scale_saved(gw, scale)
        if ctx.need[2]:
            db = scale_saved(gb, scale)
        return dx, dw, db, None, None, None, None, None, None


def linear_cross_entropy(hidden: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor],
                         class_weight: Optional[Tensor], options: _C.LinearCrossEntropyOptions, recompute: bool,
                         process_group, sequence_parallel: bool,
                         compute_dtype: Optional[torch.dtype] = None) -> Tuple[Tensor, Tensor]:
    """The vocabulary-parallel path of logitless.linear_cross_entropy: (loss, lse). compute_dtype: the products'
    dtype under autocast (float32 operands cast to it, their gradients float32), or None."""
    if is_dtensor(hidden):
        hidden = hidden.to_local()
    if is_dtensor(target):
        target = target.to_local()
    if is_dtensor(class_weight):
        class_weight = class_weight.full_tensor()
    if is_dtensor(weight):
        if process_group is not None:
            raise ValueError("process_group: expected None with a DTensor weight (the DTensor's mesh is the group)")
        weight, shard = shard_of_dtensor(weight, 0, "weight")
        if bias is not None:
            if not is_dtensor(bias):
                raise ValueError("bias: expected a DTensor placed like weight (sharded along the vocabulary)")
            bias, _ = shard_of_dtensor(bias, 0, "bias")
        if shard is None:
            shard = VocabShard(None, 0, 1, 0, weight.shape[0], (weight.shape[0],))
    else:
        if is_dtensor(bias):
            bias = bias.to_local()
        shard = shard_of_group(process_group, weight.shape[0], weight.device)
    if sequence_parallel and shard.world == 1:
        sequence_parallel = False
    if class_weight is not None and class_weight.shape != (shard.vocab,):
        raise ValueError(f"class_weight: expected shape [{shard.vocab}] (the whole vocabulary's class weights), "
                         f"got {list(class_weight.shape)}")
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad or
                                              (bias is not None and bias.requires_grad))
    if not needs_grad:
        hidden, weight, bias = cast_operands(hidden, weight, bias, compute_dtype)
        tok = _tokens(hidden, target, shard, sequence_parallel)
        loss, lse = _lce_forward_recompute(tok, weight, bias, class_weight, shard, options)
        return _local_outputs(tok, shard, loss, lse, options.reduction)
    # No tokens at all: no steps to walk; the recompute schedule's calls handle the empty case.
    n_tokens = target.numel() * (shard.world if sequence_parallel else 1)
    fn = _VocabParallelLinearRecompute if recompute or n_tokens == 0 else _VocabParallelLinearFused
    return fn.apply(hidden, weight, bias, target, class_weight, shard, options, sequence_parallel, compute_dtype)
