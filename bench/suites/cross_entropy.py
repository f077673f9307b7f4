"""Cross-entropy over given logits: logitless against its peers, bf16.

Shapes are "NxV" strings (rows x vocabulary). Every fwd+bwd row times the forward and the backward of the
loss alone: its logits come from `_Source`, an autograd node whose backward is free, so no producer's
backward (and no gradient accumulation) is timed, and every implementation gets a fresh non-leaf tensor
as a model would hand it over. Those that overwrite their input (logitless in place, Liger) get a fresh
copy per call, made outside the timed region. The GB/s column counts the minimum traffic: one read of
the logits for a forward, one read and one write for fwd+bwd.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import List, Optional

import torch
import torch.nn.functional as F

from common import Context, Impl, Row, release, run_impls

QUICK_SHAPES = ["256x32000", "64x128256"]
DEFAULT_SHAPES = ["16384x128256", "4096x256000"]

DTYPE = torch.bfloat16
REPO = Path(__file__).resolve().parents[2]
SEED_DIRS = [REPO / ".." / "shared" / "seeds" / "baselines", REPO / "shared" / "seeds" / "baselines"]


def parse_shape(text: str):
    n, v = text.lower().split("x")
    return int(n), int(v)


class _Source(torch.autograd.Function):
    """Hands `x` on as a non-leaf that requires grad, as a copy (`copy=True`, for callers that overwrite
    it) or a view; its backward drops the gradient, so only the loss's own backward is timed."""

    @staticmethod
    def forward(ctx, x, copy):
        return x.clone() if copy else x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return None, None


def _load_seed(seed_dir: Optional[str]):
    dirs = [Path(seed_dir)] if seed_dir else SEED_DIRS
    for d in dirs:
        path = d / "seed000_cross_entropy.py"
        if path.is_file():
            spec = importlib.util.spec_from_file_location("seed000_cross_entropy", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module.seed_cross_entropy, None
    return None, f"skipped: seed000_cross_entropy.py not found in {', '.join(str(d) for d in dirs)}"


def _liger():
    try:
        from liger_kernel.transformers.cross_entropy import LigerCrossEntropyLoss
    except Exception as e:  # absent, or present but unusable here
        return None, f"skipped: liger_kernel not importable ({type(e).__name__})"
    return LigerCrossEntropyLoss(), None


def _reference_loss(x, target, chunk=1024):
    # Mean loss in float32 by torch, a chunk of rows at a time (a float32 copy of all the logits would not
    # fit beside the rest at the large shapes); every target is valid, so the mean divides by N.
    total = 0.0
    for s in range(0, x.shape[0], chunk):
        total += F.cross_entropy(x[s:s + chunk].float(), target[s:s + chunk], reduction="sum").item()
    return total / x.shape[0]


def run(ctx: Context, shapes: List[str]) -> List[Row]:
    import logitless

    algo = ctx.options.get("algo", "auto")
    rows: List[Row] = []
    for text in shapes:
        N, V = parse_shape(text)
        nbytes = N * V * torch.tensor([], dtype=DTYPE).element_size()
        gen = torch.Generator(device=ctx.device).manual_seed(0)
        k = ctx.rotation(nbytes)
        srcs = [torch.randn(N, V, device=ctx.device, dtype=DTYPE, generator=gen).requires_grad_(True)
                for _ in range(k)]
        target = torch.randint(0, V, (N,), device=ctx.device, generator=gen)
        want = _reference_loss(srcs[0].detach(), target)

        def check(loss):
            got = float(loss)
            err = abs(got - want) / max(abs(want), 1e-6)
            # bf16 peers return a bf16 loss (8 bits of mantissa): 1% is their rounding, more is a bug.
            return "loss ok" if err < 1e-2 else f"LOSS MISMATCH: {got:.6g} vs {want:.6g}"

        def fresh(copy):
            return lambda i: (_Source.apply(srcs[i % k], copy), target)

        def plain(i):
            return (srcs[i % k].detach(), target)

        def fwd_bwd(loss_fn):
            def step(x, t):
                loss = loss_fn(x, t)
                loss.backward()
                return loss.detach()

            return step

        def no_grad(loss_fn):
            def step(x, t):
                with torch.no_grad():
                    return loss_fn(x, t)

            return step

        one, two = nbytes, 2 * nbytes
        ce = logitless.cross_entropy
        impls = [
            Impl("logitless forward (loss only)", no_grad(lambda x, t: ce(x, t, algo=algo)), plain, one, check),
            Impl("logitless fwd+bwd, in place", fwd_bwd(lambda x, t: ce(x, t, inplace_backward=True, algo=algo)),
                 fresh(True), two, check),
            Impl("logitless fwd+bwd", fwd_bwd(lambda x, t: ce(x, t, algo=algo)), fresh(False), two, check),
            Impl("torch eager forward", no_grad(F.cross_entropy), plain, one, check),
            Impl("torch eager fwd+bwd", fwd_bwd(F.cross_entropy), fresh(False), two, check),
        ]
        notes: List[Row] = []
        if ctx.is_cuda:
            compiled = torch.compile(F.cross_entropy, fullgraph=True, dynamic=False)
            impls.append(Impl("torch.compile fwd+bwd", fwd_bwd(compiled), fresh(False), two, check))
            liger, why = _liger()
            if liger is not None:
                impls.append(Impl("Liger fwd+bwd (in place)", fwd_bwd(liger), fresh(True), two, check))
            else:
                notes.append(Row(op="cross_entropy", shape="", impl="Liger", note=why))
            try:
                seed, why = _load_seed(ctx.options.get("seed_dir"))
            except Exception as e:  # e.g. triton missing
                seed, why = None, f"skipped: seed 000 failed to load ({type(e).__name__}: {e})"
            if seed is not None:
                impls.append(Impl("seed 000 Triton fwd+bwd", fwd_bwd(seed), fresh(False), two, check))
            else:
                notes.append(Row(op="cross_entropy", shape="", impl="seed 000", note=why))
        shape = f"N={N} V={V} bf16"
        for r in notes:
            r.shape = shape
        rows += run_impls(ctx, op="cross_entropy", shape=shape, impls=impls, copy_bytes=nbytes) + notes
        srcs.clear()  # the next shape's inputs should not have to fit beside these
        release(ctx)
    return rows


if __name__ == "__main__":  # pragma: no cover - run through bench/bench.py
    raise SystemExit("run: python bench/bench.py --ops cross_entropy")
