"""Fused linear cross-entropy: logitless against its peers and against the GEMMs it cannot avoid, bf16.

Shapes are "NxHxV" strings (tokens x hidden size x vocabulary). Every row is one forward + backward of the
mean loss with gradients for hidden and weight (the three GEMM rows: the products alone). The yardstick is
the three cuBLAS GEMMs a fused linear cross-entropy replaces, timed in the same run through torch.matmul:
X·Wᵀ [N, V], dZ·W [N, H] and dZᵀ·X [V, H]. The implementations are timed in interleaved rounds with the yardstick
around each round (`_timed_in_rounds`), so that a drift of the clocks over the run weighs on every row alike;
each row's note gives its time over the yardstick's (the median of its rounds' ratios, and their range) and its TFLOP/s
counted as 6·N·H·V (the three products: what a step needs) and, for the recompute schedule, 8·N·H·V (what it
executes). "peak extra MiB" is the memory a call allocates beyond its inputs, gradients included (dX + dW
alone are 2·(N + V)·H bytes). "logitless wdtype-acc" is the gradient in forward with
grad_weight_accumulation="weight_dtype": grad_weight summed over token groups in bf16, no float32 accumulator, so
its extra memory is the gradients plus the budget.

Inputs come through `_Source`, an autograd node whose backward drops the gradient: no gradient accumulation
into .grad is timed, and every implementation gets fresh non-leaf tensors as a model would hand them over.
"""
from __future__ import annotations

import dataclasses
import statistics
from typing import List

import torch
import torch.nn.functional as F

from common import Context, Row, failure_note, interleaved_rounds, peak_extra_mib, release, time_call

QUICK_SHAPES = ["64x128x2048"]
DEFAULT_SHAPES = ["8192x4096x128256", "4096x4096x128256", "8192x2304x256000"]

DTYPE = torch.bfloat16
# Interleaved rounds of the timed calls (_timed_in_rounds), and the untimed calls each round starts with (the
# allocator's cache is emptied between implementations).
ROUNDS = 5
ROUND_WARMUP = 2


def parse_shape(text: str):
    n, h, v = text.lower().split("x")
    return int(n), int(h), int(v)


class _Source(torch.autograd.Function):
    """Hands `x` on as a non-leaf view that requires grad; its backward drops the gradient."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return None


def _timed_in_rounds(ctx: Context, shape: str, gemms, ready, impl_rows: List[Row], nhv: float) -> List[Row]:
    """The yardstick row and the implementations' times. A GPU under sustained load lowers its clocks, and they
    drift over a run: the implementations run in ROUNDS interleaved rounds, with the yardstick (the three products
    back to back, one call) timed before each round and after the last. An implementation's ratio is the median over the
    rounds of its time over the mean of the yardstick timings around its round (with their range); its ms the
    median of its rounds."""
    per_round = dataclasses.replace(ctx, warmup=ROUND_WARMUP, iters=max(1, ctx.iters // ROUNDS))

    # The three products back to back as one call, in blocks of as many calls as an implementation's: a short
    # block after the idle moment between blocks would run at clocks the longer ones do not keep.
    def products():
        return [fn() for _, fn, _ in gemms]

    def yardstick():
        return time_call(per_round, products, lambda i: ())

    def measure(step):
        return yardstick() if step is None else time_call(per_round, step[0], step[1])

    steps = {"yardstick": None, **ready}
    got = interleaved_rounds(steps, measure, ROUNDS, between=lambda: release(ctx))
    around = got.pop("yardstick") + [yardstick()]
    gemm_ms = statistics.median(around)
    rows = [Row(op="linear_cross_entropy", shape=shape, impl="3 cuBLAS GEMMs (yardstick)", ms=gemm_ms,
                note=f"{6.0 * nhv / (gemm_ms * 1e-3) / 1e12:.3g} TFLOP/s at 6NHV; median of {len(around)} timings "
                     f"around {ROUNDS} interleaved rounds ({min(around):.2f}-{max(around):.2f} ms)")]
    for row in impl_rows:
        times = got.get(row.impl)
        if isinstance(times, Exception):
            row.note = failure_note(times)
        elif times is not None:
            _, _, flops_per, note = ready[row.impl]
            row.ms = statistics.median(times)
            ratios = sorted(t / (0.5 * (around[r] + around[r + 1])) for r, t in enumerate(times))
            tf = f"{6.0 * nhv / (row.ms * 1e-3) / 1e12:.3g} TFLOP/s at 6NHV"
            if flops_per == 8:
                tf += f", {8.0 * nhv / (row.ms * 1e-3) / 1e12:.3g} at 8NHV"
            row.note = (f"{statistics.median(ratios):.2f}x GEMMs (rounds {ratios[0]:.2f}-{ratios[-1]:.2f}x); {tf}; "
                        f"{note}")
        rows.append(row)
    return rows


def _reference_loss(hidden, weight, target, chunk=1024):
    # The mean loss in float32 (no TF32), a chunk of tokens at a time; every target is valid.
    w = weight.float()
    total = 0.0
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for s in range(0, hidden.shape[0], chunk):
            logits = hidden[s:s + chunk].float() @ w.t()
            total += F.cross_entropy(logits, target[s:s + chunk], reduction="sum").item()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    return total / hidden.shape[0]


def _liger():
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
    except Exception as e:  # absent, or present but unusable here
        return None, f"skipped: liger_kernel not importable ({type(e).__name__})"
    loss = LigerFusedLinearCrossEntropyLoss()
    return (lambda h, w, t: loss(w, h, t)), None  # Liger takes the weight first


def _cce():
    try:
        from cut_cross_entropy import linear_cross_entropy as cce
    except Exception as e:
        return None, f"skipped: cut_cross_entropy not importable ({type(e).__name__})"
    return (lambda h, w, t: cce(h, w, t)), None


def _torch_loss(h, w, t):
    # What a Hugging Face causal LM does: bf16 logits, upcast to float32 for the loss.
    return F.cross_entropy((h @ w.t()).float(), t)


def _under_autocast(fn):
    """fn on float32 copies of hidden and weight under torch.autocast(bfloat16), as the Hugging Face Trainer's bf16=True
    runs a model with float32 master weights."""
    def call(h, w, t):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return fn(h, w, t)

    return call


def run(ctx: Context, shapes: List[str]) -> List[Row]:
    import logitless
    from logitless.linear_cross_entropy import auto_schedule

    rows: List[Row] = []
    for text in shapes:
        N, H, V = parse_shape(text)
        shape = f"N={N} H={H} V={V} bf16"
        gen = torch.Generator(device=ctx.device).manual_seed(0)
        hidden = torch.randn(N, H, device=ctx.device, dtype=DTYPE, generator=gen)
        weight = (torch.randn(V, H, device=ctx.device, generator=gen) * (2.0 / H ** 0.5)).to(DTYPE)
        target = torch.randint(0, V, (N,), device=ctx.device, generator=gen)
        want = _reference_loss(hidden, weight, target)

        def check(loss, tol):
            err = abs(float(loss) - want) / max(abs(want), 1e-6)
            return f"loss rel err {err:.1e}" if err < tol else f"LOSS MISMATCH: {float(loss):.6g} vs {want:.6g}"

        def fwd_bwd(loss_fn):
            def step(h, w, t):
                loss = loss_fn(h, w, t)
                loss.backward()
                return loss.detach()

            return step

        def fresh(i):
            return _Source.apply(hidden.requires_grad_(True)), _Source.apply(weight.requires_grad_(True)), target

        hidden32 = weight32 = None
        if ctx.is_cuda:
            hidden32, weight32 = hidden.float(), weight.float()

        def fresh32(i):
            return _Source.apply(hidden32.requires_grad_(True)), _Source.apply(weight32.requires_grad_(True)), target

        # The yardstick: the three products, as torch.matmul runs them (cuBLAS), with a bf16 dZ of the logits'
        # shape standing in for the gradient of the logits.
        dz = torch.randn(N, V, device=ctx.device, dtype=DTYPE, generator=gen)
        x, w_ = hidden.detach(), weight.detach()
        gemms = [
            ("cuBLAS X·Wᵀ [N,V]", lambda: torch.matmul(x, w_.t()), 2.0 * N * H * V),
            ("cuBLAS dZ·W [N,H]", lambda: torch.matmul(dz, w_), 2.0 * N * H * V),
            ("cuBLAS dZᵀ·X [V,H]", lambda: torch.matmul(dz.t(), x), 2.0 * N * H * V),
        ]
        # Each product alone first (its own row); the yardstick proper is timed in the rounds below.
        for name, fn, f in gemms:
            ms = time_call(ctx, fn, lambda i: ())
            rows.append(Row(op="linear_cross_entropy", shape=shape, impl=name, ms=ms,
                            note=f"{f / (ms * 1e-3) / 1e12:.3g} TFLOP/s (timed alone, before the rounds)"))

        lce = logitless.linear_cross_entropy
        # What "auto" takes for the timed calls, whose operands both require grad.
        auto = auto_schedule(hidden.detach().requires_grad_(), weight.detach().requires_grad_(), target)
        impls = [
            ("logitless gradient-in-forward", fwd_bwd(lambda h, w, t: lce(h, w, t, schedule="gradient_in_forward")),
             1e-4, 6, fresh),
            ("logitless wdtype-acc", fwd_bwd(lambda h, w, t: lce(h, w, t, schedule="gradient_in_forward",
                                                                   grad_weight_accumulation="weight_dtype")), 1e-4, 6,
             fresh),
            ("logitless recompute", fwd_bwd(lambda h, w, t: lce(h, w, t, schedule="recompute")), 1e-4, 8, fresh),
            (f"logitless auto (took {auto})", fwd_bwd(lce), 1e-4, 6, fresh),
            ("torch eager (fp32 upcast)", fwd_bwd(_torch_loss), 1e-2, 6, fresh),
        ]
        if ctx.is_cuda:
            # Peak extra memory of this row includes its float32 gradients (4 (N + V) H bytes).
            impls.append(("logitless, float32 inputs under autocast(bf16)", fwd_bwd(_under_autocast(lce)), 1e-4, 6,
                          fresh32))
        notes: List[Row] = []
        if ctx.is_cuda:
            compiled = torch.compile(_torch_loss, fullgraph=True, dynamic=False)
            impls.append(("torch.compile", fwd_bwd(compiled), 1e-2, 6, fresh))
            peers = (("Liger FLCE", _liger()), ("Apple CCE", _cce()))
            for name, (fn, why) in peers:
                if fn is not None:
                    impls.append((name, fwd_bwd(fn), 1e-2, 6, fresh))
                else:
                    notes.append(Row(op="linear_cross_entropy", shape=shape, impl=name, note=why))
            # What a user of float32 master weights would run instead of ours under autocast: the same peers on the
            # same float32 inputs (a second compiled function: its graph is traced under autocast).
            mixed = torch.compile(_torch_loss, fullgraph=True, dynamic=False)
            impls.append(("torch.compile, float32 inputs under autocast(bf16)", fwd_bwd(_under_autocast(mixed)), 1e-2,
                          6, fresh32))
            for name, (fn, _) in peers:
                if fn is not None:
                    impls.append((f"{name}, float32 inputs under autocast(bf16)", fwd_bwd(_under_autocast(fn)), 1e-2,
                                  6, fresh32))
        impl_rows = [Row(op="linear_cross_entropy", shape=shape, impl=name) for name, *_ in impls]
        ready = {}  # name -> (fn, inputs, FLOPs per N H V, check's note): the implementations that ran
        for row, (name, fn, tol, flops_per, inputs) in zip(impl_rows, impls):
            try:
                note = check(fn(*inputs(0)), tol)  # the first call also compiles and autotunes
                row.peak_extra_mib = peak_extra_mib(ctx, fn, inputs)
                ready[name] = (fn, inputs, flops_per, note)
            except Exception as e:  # one failing peer (OOM, missing kernel) must not end the run
                row.note = failure_note(e)
            release(ctx)
        rows += _timed_in_rounds(ctx, shape, gemms, ready, impl_rows, N * H * V)
        del hidden32, weight32, dz
        release(ctx)
        rows += notes
        hidden.requires_grad_(False)
        weight.requires_grad_(False)
        del hidden, weight, target
        release(ctx)
    return rows


if __name__ == "__main__":  # pragma: no cover - run through bench/bench.py
    raise SystemExit("run: python bench/bench.py --ops linear_cross_entropy")
