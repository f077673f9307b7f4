"""Eager calls: one forward + backward per family, logitless beside the torch composition it replaces and Liger, and
the host time each of them spends per call.

Shapes are "family:dims" strings, the dims in the family's own suite format (rms_norm NxH, cross_entropy NxV, glu
NxI, rope BxTxHqxHkxD, grpo_loss and selective_log_softmax BxLxV, linear_cross_entropy NxHxV, linear_grpo_loss and
linear_selective_log_softmax BxLxHxV). The default shapes are the two small ones where host time showed (RMSNorm
2048 x 2048, cross-entropy 1024 x 32000) and the smallest shape of each family's own suite.

Every row is one eager forward + backward, timed per call as bench/common.py times everything (CUDA events around
the call, so a GPU that waits for the host counts the wait; no CUDA graphs here: the host is what is measured), in
interleaved rounds (`_rounds`): the ms column is the median of the rounds, and the logitless row's ratio the median
of the rounds' own ratios. The
differentiable inputs come from `Source`, a node whose backward is free, so only the op's own backward is timed;
weights are leaves whose .grad is cleared before each call. torch.compile of the torch composition runs on CUDA
only (as in the other suites); the logitless row's note gives its time over the faster torch row, the targets being
<= 1.3x (cross-entropy: <= 1.0x).

Host rows ("<impl> host"): the CPU wall time per call of a loop of fwd+bwd calls at the family's tiny shape (every
argument made before the loop, no synchronization inside it), so the GPU never holds the host back: the time the
host spends enqueueing one call, in the ms column, with the µs in the note.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, List, Tuple

import torch
import torch.nn.functional as F

from common import Context, Row, Source, failure_note, interleaved_rounds, release, time_call

QUICK_SHAPES = ["rms_norm:64x256", "cross_entropy:32x1024", "glu:64x256", "rope:1x32x4x2x64", "grpo_loss:2x16x1024",
                "selective_log_softmax:2x16x1024", "linear_cross_entropy:64x64x1024",
                "linear_grpo_loss:2x16x64x1024", "linear_selective_log_softmax:2x16x64x1024"]
DEFAULT_SHAPES = ["rms_norm:2048x2048", "rms_norm:16384x2048", "cross_entropy:1024x32000",
                  "cross_entropy:4096x256000", "glu:16384x14336", "rope:8x2048x32x8x128", "grpo_loss:8x1024x150000",
                  "selective_log_softmax:8x1024x150000", "linear_cross_entropy:4096x4096x128256",
                  "linear_grpo_loss:8x1024x4096x150000", "linear_selective_log_softmax:8x1024x4096x150000"]

# The shape at which each family's host time is taken: a few rows, so that no kernel outlasts its enqueueing.
TINY = {"rms_norm": "4x64", "cross_entropy": "4x64", "glu": "4x64", "rope": "1x4x2x1x32", "grpo_loss": "2x4x64",
        "selective_log_softmax": "2x4x64", "linear_cross_entropy": "8x32x64", "linear_grpo_loss": "2x4x32x64",
        "linear_selective_log_softmax": "2x4x32x64"}
HOST_CALLS = 200
# Interleaved rounds per shape (see `_rounds`).
ROUNDS = 7
DTYPE = torch.bfloat16  # on CUDA (see _dtype)
EPS = 1e-6
BETA = 0.04


Step = Callable[..., object]  # one forward + backward over setup(i)'s arguments
# A family at a shape: its forwards by implementation name, how a forward becomes a fwd+bwd step, and the setup.
Case = Tuple[Dict[str, Callable[..., object]], Callable[[Callable[..., object]], Step], Callable[[int], tuple]]


def _dims(text: str) -> List[int]:
    return [int(v) for v in text.lower().split("x")]


def _dtype(ctx: Context) -> torch.dtype:
    # bf16 on CUDA; float32 on the CPU, where torch's bf16 kernels are slow enough to hide the host time measured.
    return DTYPE if ctx.is_cuda else torch.float32


def _randn(ctx: Context, *shape, scale: float = 1.0) -> torch.Tensor:
    return (scale * torch.randn(*shape, device=ctx.device)).to(_dtype(ctx))


def _liger(path: str, name: str, ctx: Context):
    """A Liger callable, or None off CUDA or where liger_kernel is not importable."""
    if not ctx.is_cuda:
        return None
    try:
        module = __import__(path, fromlist=[name])
        return getattr(module, name)
    except Exception:  # absent, or present but unusable here
        return None


def _scalar(fn):
    """fwd+bwd of a loss: fn(*inputs).backward()."""
    def step(*inputs):
        loss = fn(*inputs)
        loss.backward()
        return loss.detach()

    return step


def _with_grad(fn):
    """fwd+bwd of a map: fn(*inputs).backward(upstream), the upstream gradient the last argument."""
    def step(*args):
        out = fn(*args[:-1])
        out.backward(args[-1])
        return out.detach()

    return step


def _upstream(grad):
    """fwd+bwd of a map with a fixed upstream gradient."""
    def make(fn):
        def step(*inputs):
            out = fn(*inputs)
            out.backward(grad)
            return out.detach()

        return step

    return make


def _rms_norm(ctx: Context, dims) -> Case:
    import logitless

    N, H = dims
    x, dy = _randn(ctx, N, H), _randn(ctx, N, H)
    w = (1 + 0.1 * torch.randn(H, device=ctx.device)).to(_dtype(ctx)).requires_grad_(True)
    anchor = torch.zeros((), device=ctx.device, requires_grad=True)
    fns = {"logitless": lambda a: logitless.rms_norm(a, w, EPS), "torch": lambda a: F.rms_norm(a, (H,), w, EPS)}
    cls = _liger("liger_kernel.transformers.rms_norm", "LigerRMSNorm", ctx)
    if cls is not None:
        liger = cls(H, eps=EPS).to(device=ctx.device, dtype=_dtype(ctx))
        fns["Liger"] = liger

    def setup(i):
        w.grad = None
        if cls is not None:
            liger.weight.grad = None
        return Source.apply(x, anchor), dy.clone() if cls is not None else dy  # Liger's backward writes over dy

    return fns, _with_grad, setup


def _cross_entropy(ctx: Context, dims) -> Case:
    import logitless

    N, V = dims
    logits = _randn(ctx, N, V)
    target = torch.randint(0, V, (N,), device=ctx.device)
    anchor = torch.zeros((), device=ctx.device, requires_grad=True)
    fns = {"logitless": lambda a: logitless.cross_entropy(a, target), "torch": lambda a: F.cross_entropy(a, target)}
    cls = _liger("liger_kernel.transformers.cross_entropy", "LigerCrossEntropyLoss", ctx)
    if cls is not None:
        liger = cls()
        fns["Liger"] = lambda a: liger(a.clone(), target)  # its forward writes over the logits
    # Not a default: shows what the eager target check costs (the call waits for the check's result before it
    # returns, so the GPU runs dry while the host enqueues what follows).
    fns["logitless, check_targets=False"] = lambda a: logitless.cross_entropy(a, target, check_targets=False)
    return fns, _scalar, lambda i: (Source.apply(logits, anchor),)


def _glu(ctx: Context, dims) -> Case:
    import logitless

    N, I = dims
    gate, up, dy = _randn(ctx, N, I), _randn(ctx, N, I), _randn(ctx, N, I)
    anchor = torch.zeros((), device=ctx.device, requires_grad=True)
    fns = {"logitless": logitless.swiglu, "torch": lambda g, u: F.silu(g) * u}
    fn = _liger("liger_kernel.ops.swiglu", "LigerSiLUMulFunction", ctx)
    if fn is not None:
        fns["Liger"] = fn.apply
    return fns, _with_grad, lambda i: (Source.apply(gate, anchor), Source.apply(up, anchor), dy)


def _rope(ctx: Context, dims) -> Case:
    import logitless
    from suites.rope import cos_sin, hf_apply_rotary_pos_emb

    B, T, Hq, Hk, D = dims
    q, k = _randn(ctx, B, T, Hq, D), _randn(ctx, B, T, Hk, D)
    dq, dk = _randn(ctx, B, Hq, T, D), _randn(ctx, B, Hk, T, D)
    cos, sin = (t.to(_dtype(ctx)) for t in cos_sin(T, D, ctx.device))
    anchor = torch.zeros((), device=ctx.device, requires_grad=True)

    def both(fn):
        def step(a, b):
            qr, kr = fn(a, b)
            torch.autograd.backward([qr, kr], [dq, dk])
            return qr.detach()

        return step

    fns = {"logitless": lambda a, b: logitless.rope(a, b, cos, sin),
           "torch": lambda a, b: hf_apply_rotary_pos_emb(a, b, cos, sin)}
    fn = _liger("liger_kernel.ops.rope", "LigerRopeFunction", ctx)
    if fn is not None:
        fns["Liger"] = lambda a, b: fn.apply(a.clone(), b.clone(), cos, sin)  # it rotates in place
    return fns, both, lambda i: (Source.apply(q, anchor).transpose(1, 2), Source.apply(k, anchor).transpose(1, 2))


def _policy_inputs(ctx: Context, B: int, L: int, V: int):
    ids = torch.randint(0, V, (B, L), device=ctx.device)
    adv = torch.randn(B, device=ctx.device)
    mask = torch.ones(B, L, dtype=torch.int32, device=ctx.device)
    mask[::2, L // 2:] = 0
    ref = -torch.rand(B, L, device=ctx.device) * 5
    return ids, adv, mask, ref


def _torch_grpo(logits, ids, adv, mask, ref):
    # GRPO over logits in float32 (suites/policy_loss.py's eager reference, without the slice: L + 1 positions).
    from suites.policy_loss import _eager_grpo

    return _eager_grpo(logits, ids, adv, mask, ref)


def _grpo_loss(ctx: Context, dims) -> Case:
    import logitless

    B, L, V = dims
    logits = _randn(ctx, B, L + 1, V)
    ids, adv, mask, ref = _policy_inputs(ctx, B, L, V)
    anchor = torch.zeros((), device=ctx.device, requires_grad=True)
    fns = {"logitless": lambda a: logitless.grpo_loss(a, ids, adv, completion_mask=mask, ref_logp=ref, beta=BETA),
           "torch": lambda a: _torch_grpo(a, ids, adv, mask, ref)}
    fn = _liger("liger_kernel.transformers.grpo_loss", "triton_grpo_loss", ctx)
    if fn is not None:
        def liger(a):
            out = fn(a.clone(), None, ref, ids, adv, mask, temperature=1.0, beta=BETA, eps_low=0.2, eps_high=0.2,
                     inplace=True)
            return (out[0] if isinstance(out, tuple) else out).sum()

        fns["Liger"] = liger
    return fns, _scalar, lambda i: (Source.apply(logits, anchor),)


def _torch_selective(logits, ids):
    return logits.float().log_softmax(-1).gather(-1, ids[..., None])[..., 0]


def _selective_log_softmax(ctx: Context, dims) -> Case:
    import logitless

    B, L, V = dims
    logits = _randn(ctx, B, L, V)
    ids = torch.randint(0, V, (B, L), device=ctx.device)
    g = torch.rand(B, L, device=ctx.device)
    anchor = torch.zeros((), device=ctx.device, requires_grad=True)
    fns = {"logitless": lambda a: logitless.selective_log_softmax(a, ids), "torch": lambda a: _torch_selective(a, ids)}
    return fns, _upstream(g), lambda i: (Source.apply(logits, anchor),)


def _linear_inputs(ctx: Context, N: int, H: int, V: int):
    hidden = _randn(ctx, N, H)
    weight = _randn(ctx, V, H, scale=2.0 / H ** 0.5).requires_grad_(True)
    anchor = torch.zeros((), device=ctx.device, requires_grad=True)
    return hidden, weight, anchor


def _linear_cross_entropy(ctx: Context, dims) -> Case:
    import logitless
    from suites.linear_cross_entropy import _torch_loss

    N, H, V = dims
    hidden, weight, anchor = _linear_inputs(ctx, N, H, V)
    target = torch.randint(0, V, (N,), device=ctx.device)
    fns = {"logitless": lambda h: logitless.linear_cross_entropy(h, weight, target),
           "torch": lambda h: _torch_loss(h, weight, target)}
    cls = _liger("liger_kernel.transformers.fused_linear_cross_entropy", "LigerFusedLinearCrossEntropyLoss", ctx)
    if cls is not None:
        liger = cls()
        fns["Liger"] = lambda h: liger(weight, h, target)  # Liger takes the weight first

    def setup(i):
        weight.grad = None
        return (Source.apply(hidden, anchor),)

    return fns, _scalar, setup


def _linear_grpo_loss(ctx: Context, dims) -> Case:
    import logitless

    B, L, H, V = dims
    hidden, weight, anchor = _linear_inputs(ctx, B * (L + 1), H, V)
    hidden = hidden.view(B, L + 1, H)
    ids, adv, mask, ref = _policy_inputs(ctx, B, L, V)
    fns = {"logitless": lambda h: logitless.linear_grpo_loss(h, weight, ids, adv, completion_mask=mask, ref_logp=ref,
                                                            beta=BETA),
           "torch": lambda h: _torch_grpo(h @ weight.t(), ids, adv, mask, ref)}

    def setup(i):
        weight.grad = None
        return (Source.apply(hidden, anchor),)

    return fns, _scalar, setup


def _linear_selective_log_softmax(ctx: Context, dims) -> Case:
    import logitless

    B, L, H, V = dims
    hidden, weight, anchor = _linear_inputs(ctx, B * L, H, V)
    hidden = hidden.view(B, L, H)
    ids = torch.randint(0, V, (B, L), device=ctx.device)
    g = torch.rand(B, L, device=ctx.device)
    fns = {"logitless": lambda h: logitless.linear_selective_log_softmax(h, weight, ids),
           "torch": lambda h: _torch_selective(h @ weight.t(), ids)}
    step = _upstream(g)

    def setup(i):
        weight.grad = None
        return (Source.apply(hidden, anchor),)

    return fns, step, setup


FAMILIES = {"rms_norm": _rms_norm, "cross_entropy": _cross_entropy, "glu": _glu, "rope": _rope,
            "grpo_loss": _grpo_loss, "selective_log_softmax": _selective_log_softmax,
            "linear_cross_entropy": _linear_cross_entropy, "linear_grpo_loss": _linear_grpo_loss,
            "linear_selective_log_softmax": _linear_selective_log_softmax}


def _steps(ctx: Context, case: Case, compile_torch: bool) -> Tuple[Dict[str, Step], Callable[[int], tuple]]:
    """The fwd+bwd steps by name, with the torch composition compiled as well (as the other suites compile it:
    fullgraph, static shapes, the backward run by autograd) where asked and on CUDA."""
    fns, make_step, setup = case
    if compile_torch and ctx.is_cuda:
        fns = dict(fns, **{"torch.compile": torch.compile(fns["torch"], fullgraph=True, dynamic=False)})
    return {name: make_step(fn) for name, fn in fns.items()}, setup


def host_us(ctx: Context, step: Step, setup: Callable[[int], tuple], calls: int = HOST_CALLS) -> float:
    """CPU wall µs per call of a loop of `calls` steps whose arguments were made beforehand, started on an idle
    device."""
    args = [setup(i) for i in range(calls)]
    ctx.sync()
    t0 = time.perf_counter()
    for a in args:
        step(*a)
    us = (time.perf_counter() - t0) / calls * 1e6
    ctx.sync()
    return us


def _rounds(steps: Dict[str, Step], measure: Callable[[Step], float]) -> Dict[str, List[float]]:
    """`measure` of every step in ROUNDS interleaved rounds (common.interleaved_rounds): the host time of these
    calls drifts by tens of percent within a minute on a shared host."""
    return interleaved_rounds(steps, measure, ROUNDS)


def _ratio_note(got: Dict[str, List[float]], ours: str) -> str:
    """Ours over the faster torch row, round by round (the median of the rounds' ratios, and their range)."""
    torch_rows = [v for k, v in got.items() if k.startswith("torch") and not isinstance(v, Exception)]
    if isinstance(got[ours], Exception) or not torch_rows:
        return ""
    ratios = sorted(o / min(t[i] for t in torch_rows) for i, o in enumerate(got[ours]))
    return f"{statistics.median(ratios):.2f}x the faster torch row (rounds {ratios[0]:.2f}-{ratios[-1]:.2f}x)"


def _timed_rows(ctx: Context, family: str, shape: str, steps: Dict[str, Step], setup) -> List[Row]:
    got = _rounds(steps, lambda step: time_call(ctx, step, setup))
    rows = []
    for name, v in got.items():
        row = Row(op=f"host: {family}", shape=shape, impl=f"{name} fwd+bwd")
        if isinstance(v, Exception):
            row.note = failure_note(v)
        else:
            row.ms = statistics.median(v)
        rows.append(row)
    rows[0].note = rows[0].note or _ratio_note(got, next(iter(steps)))
    release(ctx)
    return rows


def _host_rows(ctx: Context, family: str) -> List[Row]:
    text = TINY[family]
    steps, setup = _steps(ctx, FAMILIES[family](ctx, _dims(text)), compile_torch=False)
    for step in steps.values():  # warm-up
        for i in range(3):
            step(*setup(i))
    got = _rounds(steps, lambda step: host_us(ctx, step, setup))
    rows = []
    for name, v in got.items():
        row = Row(op=f"host: {family}", shape=text, impl=f"{name} host")
        if isinstance(v, Exception):
            row.note = failure_note(v)
        else:
            # The least of the rounds: other work on the host only ever adds time.
            row.ms, row.note = min(v) * 1e-3, f"{min(v):.1f} µs of host time per fwd+bwd call"
        rows.append(row)
    ratio = _ratio_note(got, next(iter(steps)))
    if ratio and rows[0].ms is not None:
        rows[0].note += f"; {ratio}"
    release(ctx)
    return rows


def run(ctx: Context, shapes: List[str]) -> List[Row]:
    rows: List[Row] = []
    hosted = set()
    for spec in shapes:
        family, _, text = spec.partition(":")
        if family not in FAMILIES:
            raise ValueError(f"host: unknown family {family!r} in {spec!r}; expected one of {', '.join(FAMILIES)}")
        if family not in hosted:
            rows += _host_rows(ctx, family)
            hosted.add(family)
        steps, setup = _steps(ctx, FAMILIES[family](ctx, _dims(text)), compile_torch=True)
        rows += _timed_rows(ctx, family, text, steps, setup)
        del steps, setup
        release(ctx)
    return rows


if __name__ == "__main__":  # pragma: no cover - run through bench/bench.py
    raise SystemExit("run: python bench/bench.py --ops host")
