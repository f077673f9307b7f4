"""The hostile-input cases of tests/python/test_hostile.py and the child process that runs them.

Every public op gets the inputs a careless or adversarial caller could pass: tensors on the wrong device (meta,
the other kind of device, another CUDA device), wrong dtypes and ranks, shapes that disagree, empty and huge sizes,
NaN and inf in every float input, odd strides (broadcast, overlapping, non-contiguous, non-mergeable), inputs that
alias each other, a second backward and a double backward, and graphs where another consumer shares a gradient
with the op (``h + op(x)``). Each case must end in one of two ways:

* a clear error: ValueError or TypeError (RuntimeError where torch's own autograd raises) whose message names
  the argument at fault;
* a result equal to a float64 torch reference of the documented semantics (rows and tokens that are ignored or
  masked are "not read": the reference never looks at them either).

and no input may change unless the call asked for it (the in-place losses' logits).

The cases run in child processes (``python _hostile.py FAMILY SETUP [FIRST]``), one per op family and device
setup, printing one JSON line when a case starts and one when it ends. A crash (a signal, an abort, a sticky CUDA
error) ends the child in the middle of a case: the parent names that case as failed and starts a new child at
the next one. Case names are known without running anything (the parent collects them).
"""
from __future__ import annotations

import json
import math
import os
import re
import sys
import traceback
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

import logitless
from logitless import nn as lnn

FAMILIES = ["cross_entropy", "selective_log_softmax", "grpo_loss", "linear_cross_entropy",
            "linear_selective_log_softmax", "linear_grpo_loss", "rms_norm", "misc"]
# "cpu": every case on the CPU; "cuda": the same on a GPU; "cpu+cuda" and "cuda+cuda1": only the device-mismatch
# cases, with one argument on the other device.
SETUPS = ["cpu", "cuda", "cpu+cuda", "cuda+cuda1"]


class Failed(Exception):
    """A case's outcome was neither a clear error nor the reference's result."""


# ----------------------------------------------------------------------------------------------------
# Outcome checks.


def expect_error(thunk: Callable[[], object], names, kinds=(ValueError, TypeError), match: Optional[str] = None):
    """thunk() raises one of `kinds`, whose message names one of `names` (a word of its own) and matches `match`."""
    names = [names] if isinstance(names, str) else list(names)
    try:
        thunk()
    except kinds as e:
        msg = str(e)
        if names and not any(re.search(rf"(?<![\w.]){re.escape(n)}(?!\w)", msg) for n in names):
            raise Failed(f"{type(e).__name__} names none of {names}: {msg[:300]}")
        if match is not None and not re.search(match, msg):
            raise Failed(f"{type(e).__name__} does not say {match!r}: {msg[:300]}")
        return
    except Exception as e:  # noqa: BLE001 - a wrong kind of error is a failed case
        raise Failed(f"{type(e).__name__} instead of {[k.__name__ for k in kinds]}: {str(e)[:300]}")
    raise Failed(f"no error (expected one naming {names})")


def _tol(dtype: torch.dtype, device: torch.device) -> Tuple[float, float]:
    if dtype in (torch.float16, torch.bfloat16):
        return 3e-2, 3e-2
    return (1e-5, 1e-6) if device.type == "cpu" else (2e-4, 2e-5)


def assert_same(what: str, got: Optional[torch.Tensor], want: Optional[torch.Tensor], dtype, device,
                infinite_input=False, zeros_may_be_nonfinite=False):
    """got (any dtype, any device) against the float64 reference, NaN where the reference has NaN. A missing
    gradient stands for zeros.

    With an infinite input (`infinite_input`) the comparison holds where the reference is finite; where it is not,
    an output must be non-finite too (NaN and inf alike: which of the two comes out of inf - inf depends on the
    order of operations) and a gradient may be anything. A fused loss may resolve the limit better than autograd's
    chain of ops: with an infinite advantage a clipped token's ratio term passes no gradient, where
    torch.minimum of inf and inf splits an infinite one.

    With `zeros_may_be_nonfinite`, an element the reference gives exactly 0 may be non-finite: the gradient of a
    hidden row that is not read is 0, but on CUDA it comes out of a GEMM as 0 x weight, which is NaN where the
    weight is NaN or inf."""
    if want is None:
        want = torch.zeros(got.shape, dtype=torch.float64) if got is not None else None
        if want is None:
            return
    if got is None:
        got = torch.zeros(want.shape, dtype=torch.float64)
    if tuple(got.shape) != tuple(want.shape):
        raise Failed(f"{what}: expected shape {list(want.shape)}, got {list(got.shape)}")
    rtol, atol = _tol(dtype, device)
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    if zeros_may_be_nonfinite and got.shape == want.shape:
        got = torch.where((want == 0) & ~torch.isfinite(got), torch.zeros_like(got), got)
    if infinite_input:
        finite = torch.isfinite(want)
        if what == "output" and bool((torch.isfinite(got) & ~finite).any()):
            raise Failed(f"{what}: finite where the reference is not: {got} vs {want}")
        got, want = got[finite], want[finite]
    try:
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, equal_nan=True)
    except AssertionError as e:
        raise Failed(f"{what}: {str(e)[:600]}") from None


class Snapshot:
    """Copies of every tensor in `args` (meta tensors have no values to compare); `check` raises when one
    changed, except those in `allowed`."""

    def __init__(self, args: dict):
        self.copies = {k: v.detach().clone() for k, v in args.items()
                       if isinstance(v, torch.Tensor) and v.device.type != "meta"}
        self.args = args

    def check(self, allowed=()):
        for k, c in self.copies.items():
            if k in allowed:
                continue
            now = self.args[k].detach()
            same = now.shape == c.shape and (now.numel() == 0 or bool(
                ((now == c) | (torch.isnan(now) & torch.isnan(c)) if now.is_floating_point() else (now == c)).all()))
            if not same:
                raise Failed(f"input {k} was modified by the call")


# ----------------------------------------------------------------------------------------------------
# Float64 references of the documented semantics.


def ce_reference(logits, target, weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0, z_loss=0.0,
                 softcap=None):
    """logitless.cross_entropy in float64: ignored rows are not read (loss 0, gradient 0); a mean over no counted
    row is 0; the z-loss term is averaged over the counted rows (not over the class weights)."""
    V = logits.shape[-1]
    x = logits.reshape(-1, V)
    t = target.reshape(-1).long()
    keep = t != ignore_index
    rows = x[keep]
    if softcap:
        rows = softcap * torch.tanh(rows / softcap)
    tk = t[keep]
    w = None if weight is None else weight.double()
    per = F.cross_entropy(rows, tk, weight=w, reduction="none", label_smoothing=label_smoothing)
    lse = torch.logsumexp(rows, -1)
    z = z_loss * lse * lse
    if reduction == "none":
        out = torch.zeros(x.shape[0], dtype=torch.float64, device=x.device).masked_scatter(keep, per + z)
        return out.reshape(target.shape)
    if reduction == "sum":
        return per.sum() + z.sum()
    count = int(keep.sum())
    if count == 0:
        return (rows.sum() * 0).reshape(())
    denom = w[tk].sum() if w is not None else torch.tensor(float(count), dtype=torch.float64)
    return per.sum() / denom + z.sum() / count


def selective_reference(logits, ids, temperature=1.0):
    return torch.log_softmax(logits / temperature, -1).gather(-1, ids.long().unsqueeze(-1)).squeeze(-1)


def grpo_reference(logits, completion_ids, advantages, completion_mask=None, old_logp=None, ref_logp=None, beta=0.04,
                   eps_low=0.2, eps_high=0.2, temperature=1.0, loss_type="grpo", importance_sampling_level="token",
                   max_completion_length=None, num_items_in_batch=None):
    """logitless.grpo_loss in float64; masked tokens are not read (their logits and ids may hold anything)."""
    B, L = completion_ids.shape
    w = torch.ones(B, L, dtype=torch.float64) if completion_mask is None else completion_mask.double()
    on = w != 0
    x = logits[:, :L]
    x = torch.where(on.unsqueeze(-1), x, torch.zeros_like(x)) / temperature
    ids = torch.where(on, completion_ids.long(), torch.zeros_like(completion_ids.long()))
    logp = torch.log_softmax(x, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    logp = torch.where(on, logp, torch.zeros_like(logp))
    old = logp.detach() if old_logp is None else torch.where(on, old_logp.double(), torch.zeros_like(logp))
    if importance_sampling_level == "token":
        ratio = torch.exp(logp - old)
    else:
        s = (w * (logp - old)).sum(-1) / w.sum(-1).clamp(min=1)
        ratio = torch.exp(s).unsqueeze(-1).expand(B, L)
    A = advantages.double().unsqueeze(-1)
    ptl = -torch.minimum(ratio * A, ratio.clamp(1 - eps_low, 1 + eps_high) * A)
    if beta > 0:
        ref = torch.where(on, ref_logp.double(), torch.zeros_like(logp))
        ptl = ptl + beta * (torch.exp(ref - logp) - (ref - logp) - 1)
    wl = torch.where(on, w * ptl, torch.zeros_like(ptl))
    if loss_type == "grpo":
        return (wl.sum(-1) / w.sum(-1).clamp(min=1)).mean() if B else wl.sum()
    if loss_type == "bnpo":
        return wl.sum() / w.sum().clamp(min=1)
    if loss_type == "dr_grpo":
        return wl.sum() / (B * max_completion_length)
    return wl.sum() / (num_items_in_batch if num_items_in_batch else w.sum().clamp(min=1))


def rms_reference(x, weight, eps=1e-6, offset=0.0, residual=None):
    s = x if residual is None else x + residual
    y = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * (weight + offset)
    return (y, s) if residual is not None else y


def linear_logits(hidden, weight, bias=None, rows=None):
    """hidden @ weight.T + bias; hidden rows outside `rows` (a bool mask of the leading shape) are zeros first: the
    documented semantics give them gradient 0, where 0 @ weight would carry a NaN of the weight into it."""
    if rows is not None:
        hidden = torch.where(rows.unsqueeze(-1), hidden, torch.zeros_like(hidden))
    out = hidden @ weight.transpose(0, 1)
    return out if bias is None else out + bias


# ----------------------------------------------------------------------------------------------------
# Specs: per public function, its arguments, its call and its reference.


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _randn(g, shape, dev, dtype=torch.float32, scale=1.0):
    if str(dev) == "meta":  # nothing allocated: the huge-size cases make shapes only
        return torch.empty(shape, dtype=dtype, device="meta")
    return (scale * torch.randn(shape, generator=g)).to(dtype).to(dev)


def _randint(g, hi, shape, dev):
    if str(dev) == "meta":
        return torch.empty(shape, dtype=torch.long, device="meta")
    return torch.randint(0, max(hi, 1), shape, generator=g).to(dev)


def _rand(g, shape, dev, lo):
    if str(dev) == "meta":
        return torch.empty(shape, device="meta")
    return (torch.rand(shape, generator=g) + lo).to(dev)


class Spec:
    """One public function: `make(dev, **sizes_and_overrides)` returns its arguments (a dict, tensors on `dev`),
    `call(args)` runs it and returns its differentiable output, `reference(args)` runs the float64 reference.
    `tensors` lists the tensor arguments in signature order, `optional` those that may be None, `grads` those that
    take a gradient, `options` the keyword arguments `call` passes on when present."""

    name = ""
    tensors: List[str] = []
    optional: Tuple[str, ...] = ()
    grads: List[str] = []
    options: List[str] = []
    # Arguments converted to float32 (any real dtype is accepted) and argument -> integer dtypes accepted.
    converted: Tuple[str, ...] = ()
    ids: Dict[str, Tuple[torch.dtype, ...]] = {}
    floats = ("float_options",)

    def make(self, dev, **over) -> dict:
        raise NotImplementedError

    def full(self, dev) -> dict:
        """Arguments with every optional tensor present."""
        return self.make(dev)

    def call(self, a: dict):
        raise NotImplementedError

    def reference(self, a: dict):
        raise NotImplementedError

    def opts(self, a):
        return {k: a[k] for k in self.options if k in a}


class CrossEntropy(Spec):
    name = "cross_entropy"
    tensors = ["logits", "target", "weight"]
    optional = ("weight",)
    grads = ["logits"]
    options = ["weight", "ignore_index", "reduction", "label_smoothing", "z_loss", "softcap", "inplace_backward"]
    converted = ("weight",)
    ids = {"target": (torch.int32, torch.int64)}

    def make(self, dev, N=6, V=7, seed=0, **over):
        g = _gen(seed)
        a = dict(logits=_randn(g, (N, V), dev, scale=2.0), target=_randint(g, V, (N,), dev), weight=None)
        a.update(over)
        return a

    def full(self, dev):
        return self.make(dev, weight=_rand(_gen(1), (7,), dev, 1.0))

    def call(self, a):
        return logitless.cross_entropy(a["logits"], a["target"], **self.opts(a))

    def reference(self, a):
        o = {k: a[k] for k in self.options if k in a and k != "inplace_backward"}
        return ce_reference(a["logits"], a["target"], **o)


class SelectiveLogSoftmax(Spec):
    name = "selective_log_softmax"
    tensors = ["logits", "ids"]
    grads = ["logits"]
    options = ["temperature"]
    ids = {"ids": (torch.int32, torch.int64, torch.int16, torch.uint8)}

    def make(self, dev, N=6, V=7, seed=0, **over):
        g = _gen(seed)
        a = dict(logits=_randn(g, (N, V), dev, scale=2.0), ids=_randint(g, V, (N,), dev))
        a.update(over)
        return a

    def call(self, a):
        return logitless.selective_log_softmax(a["logits"], a["ids"], **self.opts(a))

    def reference(self, a):
        return selective_reference(a["logits"], a["ids"], **self.opts(a))


GRPO_OPTIONS = ["completion_mask", "old_logp", "ref_logp", "beta", "eps_low", "eps_high", "temperature", "loss_type",
                "importance_sampling_level", "max_completion_length", "num_items_in_batch"]


def _grpo_inputs(g, B, L, dev):
    if str(dev) == "meta":
        mask = torch.empty(B, L, dtype=torch.bool, device="meta")
    else:
        mask = torch.rand(B, L, generator=g) > 0.25
        mask[:, :1] = True
        mask = mask.to(dev)
    return dict(advantages=_randn(g, (B,), dev), completion_mask=mask, old_logp=-_rand(g, (B, L), dev, 1.0),
                ref_logp=-_rand(g, (B, L), dev, 1.0))


class GRPO(Spec):
    name = "grpo_loss"
    tensors = ["logits", "completion_ids", "advantages", "completion_mask", "old_logp", "ref_logp"]
    optional = ("completion_mask", "old_logp", "ref_logp")
    grads = ["logits"]
    options = GRPO_OPTIONS + ["inplace_backward"]
    converted = ("advantages", "completion_mask", "old_logp", "ref_logp")
    ids = {"completion_ids": (torch.int32, torch.int64, torch.int16, torch.uint8)}

    def make(self, dev, B=2, L=4, V=7, seed=0, **over):
        g = _gen(seed)
        a = dict(logits=_randn(g, (B, L + 1, V), dev, scale=2.0), completion_ids=_randint(g, V, (B, L), dev))
        a.update(_grpo_inputs(g, B, L, dev))
        a.update(over)
        return a

    def call(self, a):
        return logitless.grpo_loss(a["logits"], a["completion_ids"], a["advantages"], **self.opts(a))

    def reference(self, a):
        return grpo_reference(a["logits"], a["completion_ids"], a["advantages"],
                              **{k: a[k] for k in GRPO_OPTIONS if k in a})


class LinearCrossEntropy(Spec):
    name = "linear_cross_entropy"
    tensors = ["hidden", "weight", "target", "bias", "class_weight"]
    optional = ("bias", "class_weight")
    grads = ["hidden", "weight", "bias"]
    options = ["bias", "ignore_index", "reduction", "label_smoothing", "z_loss", "softcap", "class_weight", "schedule",
               "chunk_tokens", "chunk_vocab", "memory_budget"]
    converted = ("class_weight",)
    ids = {"target": (torch.int32, torch.int64)}

    def make(self, dev, N=6, H=5, V=7, seed=0, **over):
        g = _gen(seed)
        a = dict(hidden=_randn(g, (N, H), dev), weight=_randn(g, (V, H), dev), target=_randint(g, V, (N,), dev),
                 bias=None)
        a.update(over)
        return a

    def full(self, dev):
        return self.make(dev, bias=_randn(_gen(1), (7,), dev), class_weight=_rand(_gen(2), (7,), dev, 1.0))

    def call(self, a):
        return logitless.linear_cross_entropy(a["hidden"], a["weight"], a["target"], **self.opts(a))

    def reference(self, a):
        o = {k: a[k] for k in ("ignore_index", "reduction", "label_smoothing", "z_loss", "softcap") if k in a}
        counted = a["target"] != o.get("ignore_index", -100)
        return ce_reference(linear_logits(a["hidden"], a["weight"], a.get("bias"), counted), a["target"],
                            weight=a.get("class_weight"), **o)


class LinearSelective(Spec):
    name = "linear_selective_log_softmax"
    tensors = ["hidden", "weight", "ids", "bias"]
    optional = ("bias",)
    grads = ["hidden", "weight", "bias"]
    options = ["bias", "temperature", "chunk_tokens", "memory_budget"]
    ids = {"ids": (torch.int32, torch.int64, torch.int16, torch.uint8)}

    def make(self, dev, N=6, H=5, V=7, seed=0, **over):
        g = _gen(seed)
        a = dict(hidden=_randn(g, (N, H), dev), weight=_randn(g, (V, H), dev), ids=_randint(g, V, (N,), dev),
                 bias=None)
        a.update(over)
        return a

    def full(self, dev):
        return self.make(dev, bias=_randn(_gen(1), (7,), dev))

    def call(self, a):
        return logitless.linear_selective_log_softmax(a["hidden"], a["weight"], a["ids"], **self.opts(a))

    def reference(self, a):
        return selective_reference(linear_logits(a["hidden"], a["weight"], a.get("bias")), a["ids"],
                                   **{k: a[k] for k in ("temperature",) if k in a})


class LinearGRPO(Spec):
    name = "linear_grpo_loss"
    tensors = ["hidden", "weight", "completion_ids", "advantages", "bias", "completion_mask", "old_logp", "ref_logp"]
    optional = ("bias", "completion_mask", "old_logp", "ref_logp")
    grads = ["hidden", "weight", "bias"]
    options = GRPO_OPTIONS + ["bias", "schedule", "chunk_tokens", "memory_budget"]
    converted = ("advantages", "completion_mask", "old_logp", "ref_logp")
    ids = {"completion_ids": (torch.int32, torch.int64, torch.int16, torch.uint8)}

    def make(self, dev, B=2, L=4, H=5, V=7, seed=0, **over):
        g = _gen(seed)
        a = dict(hidden=_randn(g, (B, L + 1, H), dev), weight=_randn(g, (V, H), dev),
                 completion_ids=_randint(g, V, (B, L), dev), bias=None)
        a.update(_grpo_inputs(g, B, L, dev))
        a.update(over)
        return a

    def full(self, dev):
        return self.make(dev, bias=_randn(_gen(1), (7,), dev))

    def call(self, a):
        return logitless.linear_grpo_loss(a["hidden"], a["weight"], a["completion_ids"], a["advantages"],
                                          **self.opts(a))

    def reference(self, a):
        B, L = a["completion_ids"].shape
        mask = a.get("completion_mask")
        read = torch.zeros(a["hidden"].shape[:2], dtype=torch.bool)
        read[:, :L] = True if mask is None else mask.cpu() != 0
        logits = linear_logits(a["hidden"], a["weight"], a.get("bias"), read)
        return grpo_reference(logits, a["completion_ids"], a["advantages"],
                              **{k: a[k] for k in GRPO_OPTIONS if k in a})


class RMSNorm(Spec):
    name = "rms_norm"
    tensors = ["x", "weight", "residual"]
    optional = ("residual",)
    grads = ["x", "weight", "residual"]
    options = ["eps", "offset", "residual", "vectors_per_thread"]

    def make(self, dev, N=6, H=8, seed=0, **over):
        g = _gen(seed)
        a = dict(x=_randn(g, (N, H), dev), weight=_rand(g, (H,), dev, 0.5), residual=None)
        a.update(over)
        return a

    def full(self, dev):
        return self.make(dev, residual=_randn(_gen(1), (6, 8), dev))

    def call(self, a):
        out = logitless.rms_norm(a["x"], a["weight"], **self.opts(a))
        # One differentiable output: y + s / 2 weighs the gradients of both outputs.
        return out if a.get("residual") is None else out[0] + 0.5 * out[1]

    def reference(self, a):
        out = rms_reference(a["x"], a["weight"], **{k: a[k] for k in ("eps", "offset", "residual") if k in a})
        return out if a.get("residual") is None else out[0] + 0.5 * out[1]


SPECS = {s.name: s for s in (CrossEntropy(), SelectiveLogSoftmax(), GRPO(), LinearCrossEntropy(), LinearSelective(),
                             LinearGRPO(), RMSNorm())}
FLOAT_OPTIONS = {"cross_entropy": ["label_smoothing", "z_loss", "softcap"], "selective_log_softmax": ["temperature"],
                 "grpo_loss": ["beta", "eps_low", "eps_high", "temperature", "num_items_in_batch"],
                 "linear_cross_entropy": ["label_smoothing", "z_loss", "softcap"],
                 "linear_selective_log_softmax": ["temperature"],
                 "linear_grpo_loss": ["beta", "eps_low", "temperature"], "rms_norm": ["eps", "offset"]}
INT_OPTIONS = {"cross_entropy": ["ignore_index"],
               "linear_cross_entropy": ["ignore_index", "chunk_tokens", "chunk_vocab", "memory_budget"],
               "grpo_loss": ["max_completion_length"],
               "linear_grpo_loss": ["max_completion_length", "chunk_tokens", "memory_budget"],
               "linear_selective_log_softmax": ["chunk_tokens", "memory_budget"], "rms_norm": ["vectors_per_thread"]}


# ----------------------------------------------------------------------------------------------------
# Running a case against the reference.


def _upstream(shape, seed=7) -> torch.Tensor:
    return torch.rand(shape, generator=_gen(seed), dtype=torch.float64) + 0.5


def leaf(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.detach().clone().requires_grad_(True)


def with_grads(spec: Spec, a: dict) -> dict:
    """The arguments that take gradients made leaves that require them."""
    for k in spec.grads:
        if isinstance(a.get(k), torch.Tensor) and a[k].is_floating_point():
            a[k] = leaf(a[k])
    return a


def reference_args(spec: Spec, a: dict, grads=()) -> dict:
    """Float64 CPU copies of the tensor arguments (the ones in `grads` as leaves that require grad)."""
    ref = dict(a)
    for k in spec.tensors:
        v = a.get(k)
        if isinstance(v, torch.Tensor):
            c = v.detach().cpu()
            c = c.double() if c.is_floating_point() or c.dtype == torch.bool and k in spec.converted else c
            ref[k] = c.requires_grad_(True) if k in grads else c
    return ref


def run_against_reference(spec: Spec, a: dict, backward=True, allowed_changes=(), infinite_input=False,
                          zeros_may_be_nonfinite=False):
    """Forward, and backward with a random upstream gradient where a leaf requires grad, against the reference; no
    input changes."""
    first = a[spec.tensors[0]]
    dtype, device = first.dtype, first.device
    leaves = [k for k in spec.grads if isinstance(a.get(k), torch.Tensor) and a[k].requires_grad and a[k].is_leaf]
    ref = reference_args(spec, a, leaves)  # before the call: an in-place call overwrites its logits
    snap = Snapshot(a)
    out = spec.call(a)
    want = spec.reference(ref)
    assert_same("output", out, want, dtype, device, infinite_input)
    snap.check(allowed=allowed_changes)
    if not (backward and leaves):
        return
    u = _upstream(want.shape)
    out.backward(u.to(out.dtype).to(out.device))
    want.backward(u)
    for k in leaves:
        assert_same(f"grad of {k}", a[k].grad, ref[k].grad, dtype, device, infinite_input, zeros_may_be_nonfinite)


def expect_refusal(spec: Spec, a: dict, names, kinds=(ValueError, TypeError), match=None):
    snap = Snapshot(a)
    expect_error(lambda: spec.call(a), names, kinds=kinds, match=match)
    snap.check()


# ----------------------------------------------------------------------------------------------------
# The cases every family gets.


def _device_cases(spec: Spec, dev: str, other: str):
    """Each tensor argument in turn on `other`, the rest on `dev`: an error naming it."""
    cases = []
    for k in spec.tensors:
        def case(k=k):
            a = with_grads(spec, spec.full(dev))
            a[k] = a[k].detach().to(other)
            expect_refusal(spec, a, [k])
        cases.append((f"{k} on {other}", case))
    return cases


def _out_shape(spec: Spec, a: dict):
    if spec.name in ("selective_log_softmax", "linear_selective_log_softmax"):
        return tuple(a["ids"].shape)
    if spec.name == "rms_norm":
        return tuple(a["x"].shape)
    return ()


def _meta_result(spec: Spec, a: dict):
    """All tensors on meta: outputs of the right shape on meta (the fake kernels), or a refusal naming one."""
    try:
        out = spec.call(a)
    except (ValueError, TypeError) as e:
        if not any(re.search(rf"(?<!\w){k}(?!\w)", str(e)) for k in spec.tensors):
            raise Failed(f"error names no argument: {e}")
        return
    if out.device.type != "meta" or tuple(out.shape) != _out_shape(spec, a):
        raise Failed(f"expected a meta tensor of shape {list(_out_shape(spec, a))}, got {out}")


def _type_cases(spec: Spec, dev: str):
    """None (where a tensor is required), a list, and a number in place of each tensor argument."""
    cases = []
    for k in spec.tensors:
        for val in (None, [1.0, 2.0], 3):
            if val is None and k in spec.optional:
                continue

            def case(k=k, val=val):
                a = spec.full(dev)
                a[k] = val
                expect_refusal(spec, a, [k])
            cases.append((f"{k}={'None' if val is None else type(val).__name__}", case))
    return cases


def _dtype_rank_cases(spec: Spec, dev: str):
    """Each tensor argument as float64, int64, bool and complex64, and with one dimension more and one fewer."""
    cases = []
    for k in spec.tensors:
        for dt in (torch.float64, torch.int64, torch.bool, torch.complex64):
            def case(k=k, dt=dt):
                a = spec.full(dev)
                a[k] = a[k].to(dt)
                accepted = (k in spec.converted and not dt.is_complex) or dt in spec.ids.get(k, ())
                if accepted:
                    run_against_reference(spec, a, backward=False)
                else:
                    expect_refusal(spec, a, [k])
            cases.append((f"{k} as {str(dt).replace('torch.', '')}", case))
        for more in (True, False):
            def case(k=k, more=more):
                a = spec.full(dev)
                v = a[k]
                if not more and v.dim() == 0:
                    return
                a[k] = v.unsqueeze(0) if more else v[0]
                # A tensor whose leading shape the others follow: the error may name either side.
                leading = k in ("logits", "hidden", "x", "target", "ids", "completion_ids")
                expect_refusal(spec, a, [k] + ([n for n in spec.tensors if n != k] if leading else []))
            cases.append((f"{k} with one dimension {'more' if more else 'fewer'}", case))
    return cases


def _size_cases(spec: Spec, dev: str):
    cases = []
    rows = "B" if spec.name.endswith("grpo_loss") else "N"
    last = "H" if spec.name == "rms_norm" else "V"
    for val in (0, 1):
        def case(val=val):
            run_against_reference(spec, with_grads(spec, spec.make(dev, **{rows: val})))
        cases.append((f"{rows}={val}", case))
    if rows == "B":
        def no_tokens():
            run_against_reference(spec, with_grads(spec, spec.make(dev, L=0)))
        cases.append(("L=0", no_tokens))

    def last_one():
        a = with_grads(spec, spec.make(dev, **{last: 1}))
        for k in ("target", "ids", "completion_ids"):
            if k in a:
                a[k] = torch.zeros_like(a[k])
        run_against_reference(spec, a)
    cases.append((f"{last}=1", last_one))

    def last_zero():
        a = spec.make(dev, **{last: 0})
        for k in ("target", "ids", "completion_ids"):
            if k in a:
                a[k] = torch.zeros_like(a[k])
        expect_refusal(spec, a, [spec.tensors[0], "weight"])
    cases.append((f"{last}=0", last_zero))

    def large_last():
        # A row longer than any tile, of odd length.
        run_against_reference(spec, with_grads(spec, spec.make(dev, **({last: 4099} if last == "H" else
                                                                       {last: 70001}))))
    cases.append((f"large odd {last}", large_last))

    def meta_all():
        _meta_result(spec, spec.full("meta"))
    cases.append(("every tensor on meta", meta_all))

    def huge_meta():
        # Products of sizes past 2**32 elements: shapes only, on meta, where nothing is allocated.
        big = {"N": 1 << 20, "B": 1 << 10, "L": 1 << 10, last: 1 << 13}
        params = spec.make.__code__.co_varnames
        _meta_result(spec, spec.make("meta", **{k: v for k, v in big.items() if k in params}))
    cases.append(("huge sizes on meta", huge_meta))
    return cases


def _index_cases(spec: Spec, dev: str):
    """Ids that disagree with the rows in shape, and ids out of range."""
    idx = next((k for k in spec.tensors if k in spec.ids), None)
    if idx is None:
        return []
    cases = []

    def shorter():
        a = spec.make(dev)
        a[idx] = a[idx][..., :-1]
        expect_refusal(spec, a, [idx, spec.tensors[0]])
    cases.append((f"{idx} shorter than the rows", shorter))
    for bad in (-3, 7, 2 ** 40):
        def out_of_range(bad=bad):
            a = spec.make(dev)
            t = a[idx].clone()
            t.view(-1)[0] = bad
            a[idx] = t
            if "completion_mask" in a:
                a["completion_mask"] = torch.ones_like(a["completion_mask"])
            expect_refusal(spec, a, [idx])
        cases.append((f"{idx} with {bad}", out_of_range))
    return cases


def _option_cases(spec: Spec, dev: str):
    """Integers outside int64 or not integers; floats that are not numbers, not finite, or negative."""
    cases = []
    for k in INT_OPTIONS.get(spec.name, []):
        for val in (2 ** 63, -(2 ** 64), "7", 1.5):
            def case(k=k, val=val):
                a = spec.make(dev, **{k: val})
                if k == "max_completion_length":
                    a["loss_type"] = "dr_grpo"
                expect_refusal(spec, a, [k])
            cases.append((f"{k}={val!r}", case))
    for k in FLOAT_OPTIONS[spec.name]:
        for val in ("x", float("nan"), float("inf"), -1.0):
            def case(k=k, val=val):
                a = spec.make(dev, **{k: val})
                if k == "num_items_in_batch":
                    a["loss_type"] = "dapo"
                if k == "offset" and val == -1.0:  # any finite offset is valid
                    run_against_reference(spec, with_grads(spec, a))
                    return
                expect_refusal(spec, a, [k])
            cases.append((f"{k}={val!r}", case))
    return cases


def _poison_cases(spec: Spec, dev: str):
    """NaN, +inf and -inf in one element of every float input: the reference's result (non-finite where it is)."""
    cases = []
    for k in spec.tensors:
        for val in (float("nan"), float("inf"), float("-inf")):
            def case(k=k, val=val):
                a = with_grads(spec, spec.full(dev))
                v = a[k]
                if not v.is_floating_point():
                    return
                p = v.detach().clone()
                p.view(-1)[min(3, p.numel() - 1)] = val
                a[k] = p.requires_grad_(v.requires_grad)
                run_against_reference(spec, a, infinite_input=math.isinf(val),
                                      zeros_may_be_nonfinite=spec.name.startswith("linear") and k == "weight")
            cases.append((f"{val} in {k}", case))
    return cases


def _second_rows_arg(spec: Spec) -> str:
    return {"cross_entropy": "target", "selective_log_softmax": "ids", "linear_cross_entropy": "target",
            "linear_selective_log_softmax": "ids", "rms_norm": "residual"}[spec.name]


def _stride_cases(spec: Spec, dev: str):
    main = spec.tensors[0]  # logits, hidden or x: [*, last]
    copies_last = spec.name.startswith("linear") or spec.name == "rms_norm"
    cases = []

    def broadcast_rows():
        a = spec.full(dev)
        src = leaf(a[main][..., :1, :])
        a[main] = src.expand(a[main].shape)
        ref = reference_args(spec, a)
        r = src.detach().cpu().double().requires_grad_(True)
        ref[main] = r.expand(a[main].shape)
        out = spec.call(a)
        want = spec.reference(ref)
        assert_same("output", out, want, src.dtype, src.device)
        u = _upstream(want.shape)
        out.backward(u.to(out.device).to(out.dtype))
        want.backward(u)
        assert_same(f"grad of {main}", src.grad, r.grad, src.dtype, src.device)
    cases.append((f"{main} with broadcast rows (stride 0)", broadcast_rows))

    def overlapping_rows():
        a = spec.full(dev)
        v = a[main]
        flat = torch.randn(v.numel(), generator=_gen(9)).to(v.dtype).to(v.device)
        strides = list(v.stride())
        strides[-2] = 1  # each row starts one element after the one before it
        a[main] = flat.as_strided(v.shape, strides)
        run_against_reference(spec, a, backward=False)
    cases.append((f"{main} with overlapping rows", overlapping_rows))

    def strided_last():
        a = with_grads(spec, spec.full(dev))
        v = a[main].detach()
        t = torch.zeros(v.shape + (2,), dtype=v.dtype, device=v.device)
        t[..., 0] = v
        a[main] = t[..., 0]
        if copies_last:
            run_against_reference(spec, a)
        else:
            expect_refusal(spec, a, [main], match="stride")
    cases.append((f"{main} with a non-contiguous last dimension", strided_last))

    if spec.name.endswith("grpo_loss"):  # [B, L, .] only: nothing to collapse
        return cases
    second = _second_rows_arg(spec)

    def five_dims(bad):
        def case():
            a = spec.full(dev)
            shape = (2, 3, 2, 3)
            a[main] = torch.randn(shape + (a[main].shape[-1],), generator=_gen(11)).to(dev)
            if second == "residual":
                a[second] = torch.randn(shape + (a[main].shape[-1],), generator=_gen(12)).to(dev)
            else:
                a[second] = torch.randint(0, 7, shape, generator=_gen(12)).to(dev)
            if bad:
                # Four leading dimensions no two of which merge: a permuted copy, permuted back.
                t = a[bad]
                perm = [2, 0, 3, 1] + list(range(4, t.dim()))
                a[bad] = t.permute(perm).contiguous().permute([perm.index(i) for i in range(t.dim())])
                expect_refusal(spec, a, [bad])
            else:
                run_against_reference(spec, with_grads(spec, a))
        return case
    cases.append((f"5-d {main} with 4 non-mergeable leading dimensions", five_dims(main)))
    cases.append((f"5-d, {second} with 4 non-mergeable dimensions", five_dims(second)))
    cases.append(("5-d, contiguous", five_dims(None)))
    return cases


def _graph_cases(spec: Spec, dev: str):
    """Double backward, a second backward, and other consumers sharing gradients with the op."""
    x = spec.grads[0]
    cases = []

    def double_backward():
        a = with_grads(spec, spec.make(dev))
        out = spec.call(a)
        expect_error(lambda: torch.autograd.grad(out.sum(), [a[x]], create_graph=True), [], kinds=(RuntimeError,),
                     match="double backward")
    cases.append(("double backward", double_backward))

    def backward_twice():
        a = with_grads(spec, spec.make(dev))
        out = spec.call(a)
        u = _upstream(out.shape).to(out.dtype).to(out.device)
        out.backward(u, retain_graph=True)
        first = a[x].grad.clone()
        try:
            out.backward(u)
        except RuntimeError as e:  # a gradient computed in the forward is consumed by the first backward
            if "modified by an inplace operation" not in str(e):
                raise Failed(f"second backward: {e}")
            return
        assert_same("gradient after two backwards", a[x].grad, 2 * first.double(), first.dtype, first.device)
    cases.append(("backward twice", backward_twice))

    def shared_upstream():
        # h + op(x): the add hands one gradient tensor to both consumers; h's must stay the upstream one.
        a = with_grads(spec, spec.make(dev))
        ref = reference_args(spec, a, [x])
        out = spec.call(a)
        h = torch.zeros(out.shape, device=out.device, requires_grad=True)
        u = _upstream(out.shape, seed=3).float().to(out.device)
        ((h + out.float()) * u).sum().backward()
        if not torch.equal(h.grad, u):
            raise Failed("the other consumer's gradient changed")
        (spec.reference(ref) * u.double().cpu()).sum().backward()
        assert_same(f"grad of {x}", a[x].grad, ref[x].grad, a[x].dtype, a[x].device)
    cases.append(("h + op(x): one gradient tensor for two consumers", shared_upstream))

    def input_used_twice():
        # op(x) + (x * c).sum(): x's producer sums two gradients, one of them the op's.
        a = with_grads(spec, spec.make(dev))
        src = a[x]
        a[x] = src * 1.0
        ref = reference_args(spec, a, [x])
        c = torch.rand(src.shape, generator=_gen(5)).to(src.dtype).to(src.device)
        out = spec.call(a)
        u = _upstream(out.shape, seed=4).float().to(out.device)
        ((out.float() * u).sum() + (a[x] * c).float().sum()).backward()
        ((spec.reference(ref) * u.double().cpu()).sum() + (ref[x] * c.double().cpu()).sum()).backward()
        assert_same(f"grad of {x}", src.grad, ref[x].grad, src.dtype, src.device)
    cases.append(("op(x) + f(x): the input used twice", input_used_twice))

    if len(spec.grads) > 1:
        def weight_used_twice():
            # The head's weight also read elsewhere (a tied embedding): its .grad sums both.
            a = with_grads(spec, spec.make(dev))
            w = a["weight"]
            ref = reference_args(spec, a, ["weight"])
            out = spec.call(a)
            ((out.float() * 1.5).sum() + (w * 2.0).sum()).backward()
            ((spec.reference(ref) * 1.5).sum() + (ref["weight"] * 2.0).sum()).backward()
            assert_same("grad of weight", w.grad, ref["weight"].grad, w.dtype, w.device)
        cases.append(("the weight used twice", weight_used_twice))
    return cases


# ----------------------------------------------------------------------------------------------------
# Cases of one family.


def _inplace_case(spec: Spec, dev: str, alias: Optional[str]):
    """An in-place loss (the gradient written over the logits) against the reference; with `alias`, that input is
    a view of the logits themselves (absurd, but it must not be read while it is overwritten)."""
    def case():
        shape = (6, 7) if spec.name == "cross_entropy" else (2, 5, 7)
        src = (2 * torch.randn(shape, generator=_gen(2))).to(dev).requires_grad_(True)
        logits = src * 1.0
        a = spec.make(dev, logits=logits, inplace_backward=True)
        if alias == "weight":
            with torch.no_grad():
                logits[0].abs_().add_(0.5)  # positive class weights
            a["weight"] = logits.detach()[0]
        elif alias == "old_logp":
            a["old_logp"] = logits.detach()[:, :4, 0]
        ref = reference_args(spec, a, ["logits"])
        want = spec.reference(ref)
        out = spec.call(a)
        assert_same("loss", out, want, torch.float32, out.device)
        out.backward(torch.tensor(1.5, device=out.device))
        (want * 1.5).backward()
        assert_same("grad", src.grad, ref["logits"].grad, torch.float32, out.device)
    return case


def _cross_entropy_cases(spec: Spec, dev: str):
    cases = []

    def nan_weight_untargeted():
        # A NaN weight of a class no row targets is never used (label smoothing 0): loss and gradient finite.
        a = with_grads(spec, spec.make(dev))
        free = [c for c in range(7) if c not in a["target"].tolist()]
        w = torch.rand(7, generator=_gen(3)) + 0.5
        w[free[0]] = float("nan")
        a["weight"] = w.to(dev)
        run_against_reference(spec, a)
        if not bool(torch.isfinite(a["logits"].grad).all()):
            raise Failed("a NaN weight of an untargeted class made the gradient NaN")
    cases.append(("NaN weight of an untargeted class", nan_weight_untargeted))

    def z_loss_weight_scale():
        # The z-loss term is averaged over the counted rows: scaling every class weight leaves the loss alone.
        a = spec.make(dev, weight=_rand(_gen(3), (7,), dev, 0.5), z_loss=0.1)
        one = spec.call(a)
        a["weight"] = a["weight"] * 10
        assert_same("loss with every weight x10", spec.call(a), one.double(), torch.float32, one.device)
        run_against_reference(spec, with_grads(spec, a))
    cases.append(("z-loss with the class weights scaled", z_loss_weight_scale))

    for red in ("mean", "sum", "none"):
        def every_option(red=red):
            a = spec.make(dev, weight=_rand(_gen(3), (7,), dev, 0.5), reduction=red, label_smoothing=0.1, z_loss=1e-2,
                          softcap=5.0, ignore_index=2)
            run_against_reference(spec, with_grads(spec, a))
        cases.append((f"every option, reduction {red}", every_option))

    def all_ignored():
        a = with_grads(spec, spec.make(dev, ignore_index=3))
        a["target"] = torch.full_like(a["target"], 3)
        run_against_reference(spec, a)
    cases.append(("every row ignored", all_ignored))

    def nan_in_ignored_row():
        # An ignored row is not read: NaN there changes nothing (torch's own gradient would be NaN there).
        a = spec.make(dev, ignore_index=-1)
        x, t = a["logits"].clone(), a["target"].clone()
        x[2], t[2] = float("nan"), -1
        a.update(logits=leaf(x), target=t)
        run_against_reference(spec, a)
    cases.append(("NaN in an ignored row", nan_in_ignored_row))

    cases.append(("inplace_backward", _inplace_case(spec, dev, None)))
    cases.append(("inplace_backward, the weight a view of the logits", _inplace_case(spec, dev, "weight")))

    def inplace_broadcast():
        src = torch.randn(1, 7).to(dev).requires_grad_(True)
        expect_refusal(spec, spec.make(dev, logits=(src * 1.0).expand(6, 7), inplace_backward=True), ["logits"])
    cases.append(("inplace_backward over broadcast rows", inplace_broadcast))

    def inplace_leaf():
        a = spec.make(dev, inplace_backward=True)
        a["logits"] = leaf(a["logits"])
        expect_refusal(spec, a, ["logits"])
    cases.append(("inplace_backward on a leaf", inplace_leaf))

    def bad_process_group():
        a = spec.make(dev)
        expect_error(lambda: logitless.cross_entropy(a["logits"], a["target"], process_group=object()),
                     ["process_group"])
    cases.append(("process_group=object()", bad_process_group))

    def bad_reduction():
        expect_refusal(spec, spec.make(dev, reduction="avg"), ["reduction"])
    cases.append(("reduction='avg'", bad_reduction))
    return cases


def _grpo_cases(spec: Spec, dev: str):
    cases = []
    x = spec.tensors[0]

    def nan_ref_beta0():
        # beta = 0: the reference log-probs are never used, NaN or not.
        a = with_grads(spec, spec.make(dev, beta=0.0))
        a["ref_logp"] = torch.full_like(a["ref_logp"], float("nan"))
        run_against_reference(spec, a)
        if not bool(torch.isfinite(a[x].grad).all()):
            raise Failed("beta=0 with a NaN ref_logp made the gradient NaN")
    cases.append(("beta=0 with NaN ref_logp", nan_ref_beta0))

    def masked_token_not_read():
        # A masked token's logits (or hidden state) and id are not read: NaN and an id out of range change nothing.
        a = spec.make(dev)
        m = a["completion_mask"]
        b, pos = [int(i) for i in (~m).nonzero()[0]]
        ids = a["completion_ids"].clone()
        ids[b, pos] = 10 ** 6
        a["completion_ids"] = ids
        if spec.name == "grpo_loss":
            v = a[x].clone()
            v[b, pos] = float("nan")
            a[x] = leaf(v)
            run_against_reference(spec, a)
        else:  # linear: those rows must be finite (they enter the GEMMs); the id is still not read
            run_against_reference(spec, with_grads(spec, a))
    cases.append(("a masked token's bad values are not read", masked_token_not_read))

    for lt, level in (("grpo", "sequence"), ("bnpo", "token"), ("dr_grpo", "token"), ("dapo", "sequence")):
        def loss_type(lt=lt, level=level):
            a = spec.make(dev, loss_type=lt, importance_sampling_level=level, max_completion_length=6,
                          num_items_in_batch=5.0)
            run_against_reference(spec, with_grads(spec, a))
        cases.append((f"loss_type {lt}, {level} level", loss_type))

    def all_masked():
        a = with_grads(spec, spec.make(dev))
        a["completion_mask"] = torch.zeros_like(a["completion_mask"])
        run_against_reference(spec, a)
    cases.append(("every token masked", all_masked))

    def no_ref():
        a = spec.make(dev)
        a["ref_logp"] = None
        expect_refusal(spec, a, ["ref_logp"])
    cases.append(("beta > 0 without ref_logp", no_ref))

    if spec.name == "grpo_loss":
        cases.append(("inplace_backward", _inplace_case(spec, dev, None)))
        cases.append(("inplace_backward, old_logp a view of the logits", _inplace_case(spec, dev, "old_logp")))

        def inplace_broadcast():
            src = torch.randn(1, 5, 7).to(dev).requires_grad_(True)
            a = spec.make(dev, logits=(src * 1.0).expand(2, 5, 7), inplace_backward=True)
            expect_refusal(spec, a, ["logits"])
        cases.append(("inplace_backward over broadcast rows", inplace_broadcast))
    else:
        for schedule in ("gradient_in_forward", "recompute"):
            def with_bias(schedule=schedule):
                a = spec.make(dev, bias=_randn(_gen(4), (7,), dev), schedule=schedule)
                run_against_reference(spec, with_grads(spec, a))
            cases.append((f"schedule {schedule} with a bias", with_bias))
    return cases


def _linear_cases(spec: Spec, dev: str):
    cases = []
    if spec.name == "linear_cross_entropy":
        for schedule in ("gradient_in_forward", "recompute"):
            for red in ("mean", "sum"):
                def every_option(schedule=schedule, red=red):
                    a = spec.make(dev, bias=_randn(_gen(3), (7,), dev), class_weight=_rand(_gen(4), (7,), dev, 0.5),
                                  reduction=red, label_smoothing=0.1, z_loss=1e-2, softcap=5.0, ignore_index=2,
                                  schedule=schedule)
                    run_against_reference(spec, with_grads(spec, a))
                cases.append((f"every option, {schedule}, reduction {red}", every_option))

        def bad_process_group():
            a = spec.make(dev)
            expect_error(lambda: logitless.linear_cross_entropy(a["hidden"], a["weight"], a["target"],
                                                                process_group=object()), ["process_group"])
        cases.append(("process_group=object()", bad_process_group))

    def tied():
        # hidden and weight one tensor (a tied embedding read as both): both gradients reach it.
        w = torch.randn(7, 5, generator=_gen(3)).to(dev).requires_grad_(True)
        a = spec.make(dev, N=7, hidden=w, weight=w)
        out = spec.call(a)
        wr = w.detach().cpu().double().requires_grad_(True)
        ref = reference_args(spec, a)
        ref.update(hidden=wr, weight=wr)
        want = spec.reference(ref)
        u = _upstream(want.shape)
        out.backward(u.float().to(out.device))
        want.backward(u)
        assert_same("grad", w.grad, wr.grad, torch.float32, w.device)
    if spec.name != "linear_grpo_loss":  # its hidden is [B, L + 1, H]
        cases.append(("hidden and weight one tensor", tied))

    for what, bias in (("of the wrong size", lambda: torch.randn(6)), ("in float64", lambda: torch.randn(7).double()),
                       ("with two dimensions", lambda: torch.randn(7, 1))):
        def bad_bias(bias=bias):
            a = spec.make(dev, bias=bias().to(dev).requires_grad_(True))
            a["hidden"] = leaf(a["hidden"])
            expect_refusal(spec, a, ["bias"])
        cases.append((f"a bias {what}, requiring grad", bad_bias))
    return cases


def _rms_norm_cases(spec: Spec, dev: str):
    cases = []

    def residual_offset():
        a = spec.make(dev, residual=_randn(_gen(3), (6, 8), dev), offset=1.0, eps=1e-5)
        run_against_reference(spec, with_grads(spec, a))
    cases.append(("residual and offset", residual_offset))

    def x_is_residual():
        x = torch.randn(6, 8, generator=_gen(4)).to(dev).requires_grad_(True)
        a = spec.make(dev, x=x, residual=x)
        out = spec.call(a)
        xr = x.detach().cpu().double().requires_grad_(True)
        want = rms_reference(xr, a["weight"].cpu().double(), residual=xr)
        want = want[0] + 0.5 * want[1]
        u = _upstream(want.shape)
        out.backward(u.float().to(out.device))
        want.backward(u)
        assert_same("grad of x", x.grad, xr.grad, torch.float32, x.device)
    cases.append(("x and residual one tensor", x_is_residual))

    def post_norm():
        # Gemma 2/3's post-norms: the output joins the residual stream, whose gradient is the very same tensor.
        a = with_grads(spec, spec.make(dev))
        h = torch.randn(6, 8).to(dev).requires_grad_(True)
        u = (torch.rand(6, 8, generator=_gen(6)) + 0.5).to(dev)
        (h + logitless.rms_norm(a["x"], a["weight"])).backward(u)
        if not torch.equal(h.grad, u):
            raise Failed("the residual stream's gradient changed")
        xr = a["x"].detach().cpu().double().requires_grad_(True)
        rms_reference(xr, a["weight"].detach().cpu().double()).backward(u.double().cpu())
        assert_same("grad of x", a["x"].grad, xr.grad, torch.float32, h.device)
    cases.append(("post-norm into the residual stream", post_norm))

    def permuted_gradient():
        # A 5-d output used through a permutation: the incoming gradient's rows do not collapse (copied inside).
        w = spec.make(dev)["weight"]
        x = torch.randn(2, 3, 2, 3, 8, generator=_gen(7)).to(dev).requires_grad_(True)
        u = torch.rand(3, 2, 3, 2, 8, generator=_gen(8)).to(dev)
        (logitless.rms_norm(x, w).permute(1, 0, 3, 2, 4).contiguous() * u).sum().backward()
        xr = x.detach().cpu().double().requires_grad_(True)
        (rms_reference(xr, w.cpu().double()).permute(1, 0, 3, 2, 4) * u.cpu().double()).sum().backward()
        assert_same("grad of x", x.grad, xr.grad, torch.float32, x.device)
    cases.append(("an incoming gradient with non-mergeable rows", permuted_gradient))

    def inplace_gone():
        a = spec.make(dev)
        expect_error(lambda: logitless.rms_norm(a["x"], a["weight"], inplace_backward=True), ["inplace_backward"],
                     kinds=(TypeError,))
    cases.append(("inplace_backward is refused", inplace_gone))
    return cases


def _misc_cases(dev: str, other: Optional[str]):
    """The nn modules, the HF patch's entry points, and DTensor arguments."""
    cases = []
    device_names = ["logits", "input", "target", "weight", "hidden", "class_weight", "x"]

    def module_device(make_call, where):
        def case():
            expect_error(make_call(where), device_names)
        return case

    def ce_call(where):
        m = lnn.CrossEntropyLoss(weight=torch.rand(7) + 0.5).to(other if where == "module" else dev)
        x = torch.randn(6, 7).to(other if where == "input" else dev)
        t = torch.randint(0, 7, (6,)).to(other if where == "target" else dev)
        return lambda: m(x, t)

    def lce_call(where):
        m = lnn.LinearCrossEntropyLoss(class_weight=torch.rand(7) + 0.5).to(other if where == "module" else dev)
        h = torch.randn(6, 5).to(other if where == "hidden" else dev)
        w = torch.randn(7, 5).to(other if where == "weight" else dev)
        return lambda: m(h, w, torch.randint(0, 7, (6,)).to(dev))

    def rms_call(where):
        m = lnn.RMSNorm(8).to(other if where == "module" else dev)
        x = torch.randn(6, 8).to(other if where == "x" else dev)
        return lambda: m(x)

    shown = other or "meta"
    if other is None:
        other = "meta"

        def ce_module():
            m = lnn.CrossEntropyLoss(weight=torch.rand(7) + 0.5, label_smoothing=0.1, z_loss=1e-2).to(dev)
            x = leaf(torch.randn(6, 7, generator=_gen(1)).to(dev))
            t = torch.randint(0, 7, (6,), generator=_gen(2)).to(dev)
            out = m(x, t)
            xr = x.detach().cpu().double().requires_grad_(True)
            want = ce_reference(xr, t.cpu(), weight=m.weight.cpu(), label_smoothing=0.1, z_loss=1e-2)
            assert_same("loss", out, want, torch.float32, x.device)
            out.backward()
            want.backward()
            assert_same("grad", x.grad, xr.grad, torch.float32, x.device)
        cases.append(("CrossEntropyLoss against the reference", ce_module))

        def rms_module():
            m = lnn.RMSNorm(8, eps=1e-5, offset=1.0).to(dev)
            with torch.no_grad():
                m.weight.copy_(torch.randn(8, generator=_gen(9)))
            x, r = (leaf(torch.randn(6, 8, generator=_gen(s)).to(dev)) for s in (3, 4))
            y, s = m(x, r)
            u = torch.rand(6, 8, generator=_gen(5)).to(dev)
            (y * u + s).sum().backward()
            xr, rr, wr = (t.detach().cpu().double().requires_grad_(True) for t in (x, r, m.weight))
            yr, sr = rms_reference(xr, wr, 1e-5, 1.0, rr)
            (yr * u.cpu().double() + sr).sum().backward()
            for name, got, want in (("x", x.grad, xr.grad), ("residual", r.grad, rr.grad),
                                    ("weight", m.weight.grad, wr.grad)):
                assert_same(f"grad of {name}", got, want, torch.float32, x.device)
        cases.append(("RMSNorm with a residual against the reference", rms_module))

        def rms_module_inplace():
            expect_error(lambda: lnn.RMSNorm(8, inplace_backward=True), ["inplace_backward"], kinds=(TypeError,))
            expect_error(lambda: lnn.RMSNorm.from_module(lnn.RMSNorm(8), inplace_backward=True), ["inplace_backward"],
                         kinds=(TypeError,))
        cases.append(("RMSNorm(inplace_backward=True) is refused", rms_module_inplace))

        def unpatch_none():
            expect_error(lambda: logitless.unpatch(None), ["model"])
            expect_error(lambda: logitless.hf.is_patched(None), ["model"])
        if dev == "cpu":
            cases.append(("unpatch(None) and is_patched(None)", unpatch_none))

        if dev == "cpu":
            for spec in SPECS.values():
                def dtensor(spec=spec):
                    # A DTensor (here replicated over a mesh of one) where the op takes none: refused by name.
                    import torch.distributed as dist
                    from torch.distributed.device_mesh import init_device_mesh
                    from torch.distributed.tensor import DTensor, Replicate

                    if not dist.is_initialized():
                        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
                        os.environ.setdefault("MASTER_PORT", str(20000 + os.getpid() % 20000))
                        dist.init_process_group("gloo", rank=0, world_size=1)
                    mesh = init_device_mesh("cpu", (1,))
                    for k in spec.tensors:
                        if spec.name == "cross_entropy" and k == "logits":
                            continue  # DTensor logits are vocabulary parallelism (logitless.vocab_parallel)
                        a = spec.full("cpu")
                        a[k] = DTensor.from_local(a[k], mesh, [Replicate()])
                        expect_refusal(spec, a, [k], match="DTensor")
                cases.append((f"{spec.name}: a DTensor argument", dtensor))
    cases += [(f"CrossEntropyLoss, {w} on {shown}", module_device(ce_call, w)) for w in ("input", "target", "module")]
    cases += [(f"LinearCrossEntropyLoss, {w} on {shown}", module_device(lce_call, w))
              for w in ("hidden", "weight", "module")]
    cases += [(f"RMSNorm, {w} on {shown}", module_device(rms_call, w)) for w in ("x", "module")]
    return cases


def cases_for(family: str, setup: str) -> List[Tuple[str, Callable]]:
    """The (name, thunk) cases of one family on one setup. Names are stable and listed without running anything
    (every tensor is made inside the thunks)."""
    dev, other = {"cpu": ("cpu", None), "cuda": ("cuda", None), "cpu+cuda": ("cuda", "cpu"),
                  "cuda+cuda1": ("cuda:0", "cuda:1")}[setup]
    if family == "misc":
        return _misc_cases(dev, other)
    spec = SPECS[family]
    if other is not None:
        return _device_cases(spec, dev, other)
    cases = _device_cases(spec, dev, "meta") + _type_cases(spec, dev) + _dtype_rank_cases(spec, dev)
    cases += _size_cases(spec, dev) + _index_cases(spec, dev) + _option_cases(spec, dev)
    cases += _poison_cases(spec, dev) + _stride_cases(spec, dev) + _graph_cases(spec, dev)
    if family == "cross_entropy":
        cases += _cross_entropy_cases(spec, dev)
    if family.endswith("grpo_loss"):
        cases += _grpo_cases(spec, dev)
    if family.startswith("linear"):
        cases += _linear_cases(spec, dev)
    if family == "rms_norm":
        cases += _rms_norm_cases(spec, dev)
    names = [n for n, _ in cases]
    assert len(names) == len(set(names)), f"duplicate case names in {family}"
    return cases


# ----------------------------------------------------------------------------------------------------
# The child process: python _hostile.py FAMILY SETUP [FIRST]


def _emit(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main(argv: List[str]) -> int:
    family, setup = argv[0], argv[1]
    first = int(argv[2]) if len(argv) > 2 else 0
    cuda = "cuda" in setup
    for i, (name, thunk) in enumerate(cases_for(family, setup)):
        if i < first:
            continue
        _emit({"index": i, "case": name, "event": "start"})
        ok, detail = True, ""
        try:
            thunk()
        except Failed as e:
            ok, detail = False, str(e)
        except Exception as e:  # noqa: BLE001 - anything else fails the case too, with where it came from
            ok, detail = False, f"{type(e).__name__}: {str(e)[:500]}\n{traceback.format_exc()[-1500:]}"
        if cuda:
            try:
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - a sticky CUDA error spoils every later case: start afresh
                _emit({"index": i, "case": name, "event": "end", "ok": False, "detail": f"CUDA error: {e}"})
                return 3
        _emit({"index": i, "case": name, "event": "end", "ok": ok, "detail": detail})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
