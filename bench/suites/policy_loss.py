"""GRPO loss over bf16 logits: logitless against seed 003's Triton kernel and torch reference, and Liger's GRPO loss.

Shapes are "BxLxV" strings: B completions of L tokens over a vocabulary of V; the logits are the model's
[B, L+1, V] output (the last position unused), and every other sequence has its second half masked, as in seed
003's notebook. The setting is the seed's: reference KL with beta = 0.04, no old policy (ratio 1 with gradient),
temperature 1. The seed kernels are loaded from --seed-dir (default ../shared/seeds/baselines), never copied.

The GB/s column counts one read and one write of the whole logits tensor for fwd+bwd rows, one read for forward
rows, whatever a kernel actually moves (masked rows need no read): the "% copy BW" column is then the copy's time
over the row's time, and the target for "logitless fwd+bwd, in place" is >= 83.3% (at most 1.2x the time of one
read plus one write of the logits at copy bandwidth).

Every fwd+bwd row takes its logits from `_Source`, an autograd node whose backward is free, so only the loss's
own backward is timed; implementations that overwrite their input get a fresh copy per call, made outside the
timed region. Losses are checked against a float32 torch computation (the sum over unmasked tokens of the
per-token loss for the peers, which return per-token losses; the GRPO mean for logitless).

Shapes "BxLxHxV" (four numbers) bench the loss from hidden states instead: logitless.linear_grpo_loss (the
logits never in memory) against the same loss through materialized logits (hidden @ weight.T in bf16, then
logitless.grpo_loss in place, or eager torch in float32), every row one forward + backward with gradients for
hidden and weight. The yardstick there is the three cuBLAS GEMMs any of them must run (X·Wᵀ, dZ·W, dZᵀ·X over
the B (L+1) positions), timed in the same run; each row's note gives its time over theirs. "peak extra MiB" is
what a call allocates beyond its inputs, the gradients included (2 (B (L+1) + V) H bytes of them).

LOGITLESS_BENCH_VARIANTS=1 adds rows for each CUDA kernel variant (streaming; clusters of 2, 4, 8 CTAs at 256
and 512 threads; row-resident clusters of 3, 4 and 6 CTAs at 256 threads, 4 at 128): the data the planner's
defaults (src/policy_loss/cuda/plan.h) should follow.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import List, Optional

import torch

from common import Context, Impl, Row, failure_note, peak_extra_mib, release, run_impls, time_call

QUICK_SHAPES = ["2x64x32000", "2x16x64x4096"]
DEFAULT_SHAPES = ["8x1024x150000", "8x1024x4096x150000"]

DTYPE = torch.bfloat16
BETA = 0.04
REPO = Path(__file__).resolve().parents[2]
SEED_DIRS = [REPO / ".." / "shared" / "seeds" / "baselines", REPO / "shared" / "seeds" / "baselines"]


def parse_shape(text: str):
    b, l, v = text.lower().split("x")
    return int(b), int(l), int(v)


class _Source(torch.autograd.Function):
    """Hands `x` on as a non-leaf that requires grad, as a copy (`copy=True`, for callers that overwrite it) or a
    view; its backward drops the gradient, so only the loss's own backward is timed."""

    @staticmethod
    def forward(ctx, x, copy):
        return x.clone() if copy else x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return None, None


def _load_seed(seed_dir: Optional[str]):
    dirs = [Path(seed_dir)] if seed_dir else SEED_DIRS
    for d in dirs:
        path = d / "seed003_grpo.py"
        if path.is_file():
            spec = importlib.util.spec_from_file_location("seed003_grpo", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module, None
    return None, f"skipped: seed003_grpo.py not found in {', '.join(str(d) for d in dirs)}"


def _liger():
    try:
        from liger_kernel.transformers.grpo_loss import triton_grpo_loss
    except Exception as e:  # absent, or present but unusable here
        return None, f"skipped: liger_kernel GRPO loss not importable ({type(e).__name__})"
    return triton_grpo_loss, None


def _reference(logits, ids, adv, mask, ref):
    """float32 per-token losses of the seed's setting, one sequence at a time (a float32 copy of all the logits
    would not fit beside the rest): (grpo loss, sum of masked per-token losses)."""
    B, L = ids.shape
    w = mask.float()
    tok = torch.empty(B, L, device=logits.device)
    for b in range(B):
        lp = logits[b, :L].float().log_softmax(-1).gather(-1, ids[b, :, None])[:, 0]
        d = ref[b] - lp
        tok[b] = -adv[b] + BETA * (torch.exp(d) - d - 1)
    grpo = ((w * tok).sum(-1) / w.sum(-1).clamp(min=1)).mean()
    return grpo.item(), (w * tok).sum().item()


def _linear_reference(hidden, weight, ids, adv, mask, ref):
    """The GRPO loss of the seed's setting from hidden states in float32 (no TF32), one sequence at a time."""
    B, L = ids.shape
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        w = weight.float()
        tok = torch.empty(B, L, device=hidden.device)
        for b in range(B):
            lp = (hidden[b, :L].float() @ w.t()).log_softmax(-1).gather(-1, ids[b, :, None])[:, 0]
            d = ref[b] - lp
            tok[b] = -adv[b] + BETA * (torch.exp(d) - d - 1)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    m = mask.float()
    return ((m * tok).sum(-1) / m.sum(-1).clamp(min=1)).mean().item()


def _eager_grpo(logits, ids, adv, mask, ref):
    """The seed's setting in eager torch over given logits, in float32 (what a trainer without fused kernels
    runs)."""
    L = ids.shape[1]
    lp = logits[:, :L].float().log_softmax(-1).gather(-1, ids[..., None])[..., 0]
    d = ref - lp
    tok = -adv[:, None] * torch.exp(lp - lp.detach()) + BETA * (torch.exp(d) - d - 1)
    m = mask.float()
    return ((m * tok).sum(-1) / m.sum(-1).clamp(min=1)).mean()


def _linear_rows(ctx: Context, text: str) -> List[Row]:
    """linear_grpo_loss against materialized logits, at B completions of L tokens, hidden size H, vocabulary V."""
    import logitless

    B, L, H, V = (int(x) for x in text.lower().split("x"))
    N = B * (L + 1)
    op = "policy_loss (hidden states)"
    shape = f"B={B} L={L} H={H} V={V} bf16, half of every other sequence masked"
    gen = torch.Generator(device=ctx.device).manual_seed(0)
    hidden = torch.randn(B, L + 1, H, device=ctx.device, dtype=DTYPE, generator=gen)
    weight = (torch.randn(V, H, device=ctx.device, generator=gen) * (2.0 / H ** 0.5)).to(DTYPE)
    ids = torch.randint(0, V, (B, L), device=ctx.device, generator=gen)
    adv = torch.randn(B, device=ctx.device, generator=gen)
    mask = torch.ones(B, L, dtype=torch.int32, device=ctx.device)
    mask[::2, L // 2:] = 0
    with torch.no_grad():  # reference log-probs: the policy's own, perturbed (a realistic KL)
        ref = logitless.linear_selective_log_softmax(hidden[:, :-1], weight, ids)
        ref = ref + 0.1 * torch.randn(ref.shape, device=ctx.device, generator=gen)
        want = _linear_reference(hidden, weight, ids, adv, mask, ref)
    rows: List[Row] = []

    # The yardstick: the three products over all positions, as torch.matmul runs them (cuBLAS).
    x, dz = hidden.reshape(N, H), torch.randn(N, V, device=ctx.device, dtype=DTYPE, generator=gen)
    gemm_ms = 0.0
    for name, fn in (("cuBLAS X·Wᵀ [N,V]", lambda: torch.matmul(x, weight.t())),
                     ("cuBLAS dZ·W [N,H]", lambda: torch.matmul(dz, weight)),
                     ("cuBLAS dZᵀ·X [V,H]", lambda: torch.matmul(dz.t(), x))):
        ms = time_call(ctx, fn, lambda i: ())
        gemm_ms += ms
        rows.append(Row(op=op, shape=shape, impl=name, ms=ms,
                        note=f"{2.0 * N * H * V / (ms * 1e-3) / 1e12:.3g} TFLOP/s"))
    rows.append(Row(op=op, shape=shape, impl="3 cuBLAS GEMMs (yardstick)", ms=gemm_ms,
                    note=f"{6.0 * N * H * V / (gemm_ms * 1e-3) / 1e12:.3g} TFLOP/s"))
    del x, dz
    release(ctx)

    kw = dict(completion_mask=mask, ref_logp=ref, beta=BETA)

    def fresh(i):
        return (_Source.apply(hidden.requires_grad_(True), False), _Source.apply(weight.requires_grad_(True), False))

    def step(fn):
        def run_step(h, w):
            loss = fn(h, w)
            loss.backward()
            return loss.detach()

        return run_step

    lin = logitless.linear_grpo_loss
    impls = [
        ("logitless linear_grpo_loss (gradient in forward)", step(lambda h, w: lin(h, w, ids, adv, **kw)), 1e-3),
        ("logitless linear_grpo_loss, recompute",
         step(lambda h, w: lin(h, w, ids, adv, schedule="recompute", **kw)), 1e-3),
        ("logitless linear_grpo_loss, sequence level (GSPO)",
         step(lambda h, w: lin(h, w, ids, adv, importance_sampling_level="sequence", **kw)), None),
        ("torch h @ Wᵀ (bf16) + logitless grpo_loss in place",
         step(lambda h, w: logitless.grpo_loss(h @ w.t(), ids, adv, inplace_backward=True, **kw)), 2e-2),
        ("torch h @ Wᵀ (bf16) + eager float32 GRPO", step(lambda h, w: _eager_grpo(h @ w.t(), ids, adv, mask, ref)),
         2e-2),
    ]
    for name, fn, tol in impls:
        row = Row(op=op, shape=shape, impl=name)
        try:
            note = ""
            if tol is not None:
                got = float(fn(*fresh(0)))
                err = abs(got - want) / max(abs(want), 1e-6)
                note = f"loss rel err {err:.1e}" if err < tol else f"LOSS MISMATCH: {got:.6g} vs {want:.6g}"
            row.ms = time_call(ctx, fn, fresh)
            row.peak_extra_mib = peak_extra_mib(ctx, fn, fresh)
            row.note = "; ".join(n for n in (f"{row.ms / gemm_ms:.2f}x GEMMs", note) if n)
        except Exception as e:  # one failing peer (OOM) must not end the run
            row.note = failure_note(e)
        release(ctx)
        rows.append(row)
    hidden.requires_grad_(False)
    weight.requires_grad_(False)
    del hidden, weight
    release(ctx)
    return rows


def run(ctx: Context, shapes: List[str]) -> List[Row]:
    import logitless

    rows: List[Row] = []
    variants = os.environ.get("LOGITLESS_BENCH_VARIANTS", "") not in ("", "0")
    for text in shapes:
        if text.lower().count("x") == 3:  # BxLxHxV: from hidden states
            rows += _linear_rows(ctx, text)
            continue
        B, L, V = parse_shape(text)
        gen = torch.Generator(device=ctx.device).manual_seed(0)
        logits = torch.randn(B, L + 1, V, device=ctx.device, dtype=DTYPE, generator=gen)
        nbytes = logits.numel() * logits.element_size()
        ids = torch.randint(0, V - 1, (B, L), device=ctx.device, generator=gen)
        adv = torch.randn(B, device=ctx.device, generator=gen)
        mask = torch.ones(B, L, dtype=torch.int32, device=ctx.device)
        mask[::2, L // 2:] = 0
        with torch.no_grad():  # reference log-probs: the policy's own, perturbed (a realistic KL)
            ref = logitless.selective_log_softmax(logits[:, :-1], ids)
            ref = ref + 0.1 * torch.randn(ref.shape, device=ctx.device, generator=gen)
        with torch.no_grad():
            want_grpo, want_sum = _reference(logits, ids, adv, mask, ref)
        logits.requires_grad_(True)  # the source of every fwd+bwd row's fresh non-leaf input

        def check_grpo(loss):
            got = float(loss)
            err = abs(got - want_grpo) / max(abs(want_grpo), 1e-6)
            return "loss ok" if err < 1e-3 else f"LOSS MISMATCH: {got:.6g} vs {want_grpo:.6g}"

        def check_sum(loss):
            got = float(loss)
            err = abs(got - want_sum) / max(abs(want_sum), 1e-6)
            # bf16 peers compute the log-softmax of bf16 logits in bf16 (8 bits of mantissa).
            return "loss ok" if err < 2e-2 else f"LOSS MISMATCH: {got:.6g} vs {want_sum:.6g}"

        def fresh(copy):
            return lambda i: (_Source.apply(logits, copy),)

        def plain(i):
            return (logits.detach(),)

        def step(fn):
            def run_step(x):
                loss = fn(x)
                loss.backward()
                return loss.detach()

            return run_step

        def no_grad(fn):
            def run_step(x):
                with torch.no_grad():
                    return fn(x)

            return run_step

        kw = dict(completion_mask=mask, ref_logp=ref, beta=BETA)
        grpo = logitless.grpo_loss
        one, two = nbytes, 2 * nbytes
        impls = [
            Impl("logitless fwd+bwd, in place", step(lambda x: grpo(x, ids, adv, inplace_backward=True, **kw)),
                 fresh(True), two, check_grpo),
            Impl("logitless fwd+bwd", step(lambda x: grpo(x, ids, adv, **kw)), fresh(False), two, check_grpo),
            Impl("logitless fwd+bwd, sequence level (GSPO), in place",
                 step(lambda x: grpo(x, ids, adv, importance_sampling_level="sequence", inplace_backward=True, **kw)),
                 fresh(True), two),
            Impl("logitless forward (loss only)", no_grad(lambda x: grpo(x, ids, adv, **kw)), plain, one, check_grpo),
            Impl("logitless forward + per-token outputs",
                 no_grad(lambda x: grpo(x, ids, adv, return_per_token=True, **kw)[0]), plain, one, check_grpo),
            Impl("logitless selective_log_softmax (ref logp)",
                 no_grad(lambda x: logitless.selective_log_softmax(x[:, :-1], ids)), plain, one),
        ]
        if variants and ctx.is_cuda:
            op = torch.ops.logitless.policy_loss_forward_backward_
            for algo, cluster, threads in [(1, 0, 256), (1, 0, 512), (2, 2, 256), (2, 2, 512), (2, 4, 256),
                                           (2, 4, 512), (2, 8, 256), (2, 8, 512), (3, 3, 256), (3, 4, 256),
                                           (3, 4, 128), (3, 6, 256)]:
                name = ("streaming" if algo == 1 else f"cluster {cluster}" if algo == 2
                        else f"row-resident {cluster}")
                opts = (0, 0, BETA, 0.2, 0.2, 1.0, 0, 0.0, True, algo, cluster, threads, False, False)
                impls.append(Impl(f"variant: {name}, {threads} threads (fused op, in place)",
                                  lambda x, opts=opts: op(x, ids, adv.float(), mask, None, ref, *opts)[0],
                                  lambda i: (logits.detach().clone(),), two, check_grpo))
        notes: List[Row] = []
        seed, why = (None, None)
        if ctx.is_cuda:
            try:
                seed, why = _load_seed(ctx.options.get("seed_dir"))
            except Exception as e:  # e.g. triton missing
                seed, why = None, f"skipped: seed 003 failed to load ({type(e).__name__}: {e})"
        else:
            why = "skipped: the seed kernels need a GPU"
        if seed is not None:
            mask_i = mask.to(torch.int32).contiguous()
            impls.append(Impl("seed 003 Triton fwd+bwd (in place)",
                              step(lambda x: seed.triton_grpo_loss(x, ref, ids, adv, BETA, mask_i,
                                                                   inplace=True).sum()),
                              fresh(True), two, check_sum))
            impls.append(Impl("seed 003 torch reference fwd+bwd",
                              step(lambda x: seed.torch_grpo_loss(x, ref, ids, adv, BETA, mask_i).sum()),
                              fresh(False), two, check_sum))
        else:
            notes.append(Row(op="policy_loss", shape="", impl="seed 003", note=why))
        liger, why = _liger() if ctx.is_cuda else (None, "skipped: Liger needs a GPU")
        if liger is not None:
            def liger_loss(x):
                out = liger(x, None, ref, ids, adv, mask, temperature=1.0, beta=BETA, eps_low=0.2, eps_high=0.2,
                            inplace=True)
                per_token = out[0] if isinstance(out, (tuple, list)) else out
                return per_token if per_token.dim() == 0 else (per_token * mask).sum()

            impls.append(Impl("Liger GRPO fwd+bwd (in place)", step(liger_loss), fresh(True), two, check_sum))
        else:
            notes.append(Row(op="policy_loss", shape="", impl="Liger", note=why))
        shape = f"B={B} L={L} V={V} bf16, half of every other sequence masked"
        for r in notes:
            r.shape = shape
        rows += run_impls(ctx, op="policy_loss", shape=shape, impls=impls, copy_bytes=nbytes) + notes
        del logits
        release(ctx)
    return rows


if __name__ == "__main__":  # pragma: no cover - run through bench/bench.py
    raise SystemExit("run: python bench/bench.py --ops policy_loss")
