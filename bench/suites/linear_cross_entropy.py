"""Fused linear cross-entropy: logitless against its peers and against the GEMMs it cannot avoid, bf16.

Shapes are "NxHxV" strings (tokens x hidden size x vocabulary). Every row is one forward + backward of the
mean loss with gradients for hidden and weight (the three GEMM rows: the products alone). The yardstick is
the three cuBLAS GEMMs a fused linear cross-entropy replaces, timed in the same run through torch.matmul:
X·Wᵀ [N, V], dZ·W [N, H] and dZᵀ·X [V, H]; each row's note gives its time over theirs and its TFLOP/s
counted as 6·N·H·V (the three products: what a step needs) and, for the recompute schedule, 8·N·H·V (what it
executes). "peak extra MiB" is the memory a call allocates beyond its inputs, gradients included (dX + dW
alone are 2·(N + V)·H bytes). "logitless wdtype-acc" is the gradient in forward with
grad_weight_accumulation="weight_dtype": grad_weight summed over token groups in bf16, no float32 accumulator, so
its extra memory is the gradients plus the budget.

Inputs come through `_Source`, an autograd node whose backward drops the gradient: no gradient accumulation
into .grad is timed, and every implementation gets fresh non-leaf tensors as a model would hand them over.
"""
from __future__ import annotations

from typing import List

import torch
import torch.nn.functional as F

from common import Context, Row, peak_extra_mib, release, time_call

QUICK_SHAPES = ["64x128x2048"]
DEFAULT_SHAPES = ["8192x4096x128256", "4096x4096x128256", "8192x2304x256000"]

DTYPE = torch.bfloat16


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
        flop = 6.0 * N * H * V

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
        # A GPU under sustained load runs slower than an idle one: the yardstick is timed before the
        # implementations and again after them, and the ratios are to the mean of the two.
        gemm_rows = []
        for name, fn, f in gemms:
            ms = time_call(ctx, fn, lambda i: ())
            gemm_rows.append(Row(op="linear_cross_entropy", shape=shape, impl=name, ms=ms,
                                 note=f"{f / (ms * 1e-3) / 1e12:.3g} TFLOP/s (timed before the implementations)"))
        rows += gemm_rows
        gemm_first = sum(r.ms for r in gemm_rows)

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
        timed = []  # (row, its note without the ratio)
        for name, fn, tol, flops_per, inputs in impls:
            row = Row(op="linear_cross_entropy", shape=shape, impl=name)
            try:
                note = check(fn(*inputs(0)), tol)
                row.ms = time_call(ctx, fn, inputs)
                row.peak_extra_mib = peak_extra_mib(ctx, fn, inputs)
                tf = f"{flop / (row.ms * 1e-3) / 1e12:.3g} TFLOP/s at 6NHV"
                if flops_per == 8:
                    tf += f", {8.0 * N * H * V / (row.ms * 1e-3) / 1e12:.3g} at 8NHV"
                timed.append((row, f"{tf}; {note}"))
            except Exception as e:  # one failing peer (OOM, missing kernel) must not end the run
                row.note = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
            release(ctx)
            rows.append(row)
        gemm_last = sum(time_call(ctx, fn, lambda i: ()) for _, fn, _ in gemms)
        del hidden32, weight32
        gemm_ms = 0.5 * (gemm_first + gemm_last)
        rows.insert(len(rows) - len(impls), Row(
            op="linear_cross_entropy", shape=shape, impl="3 cuBLAS GEMMs (yardstick)", ms=gemm_ms,
            note=f"{flop / (gemm_ms * 1e-3) / 1e12:.3g} TFLOP/s at 6NHV; mean of {gemm_first:.2f} ms before the "
                 f"implementations and {gemm_last:.2f} ms after"))
        for row, note in timed:
            row.note = f"{row.ms / gemm_ms:.2f}x GEMMs; {note}"
        del dz
        release(ctx)
        rows += notes
        hidden.requires_grad_(False)
        weight.requires_grad_(False)
        del hidden, weight, target
        release(ctx)
    return rows


if __name__ == "__main__":  # pragma: no cover - run through bench/bench.py
    raise SystemExit("run: python bench/bench.py --ops linear_cross_entropy")
