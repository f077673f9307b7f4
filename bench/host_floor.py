"""How low the host time of one eager RMSNorm / cross-entropy forward + backward can go, against torch's own ops:
the floors of autograd itself (a view's C++ node, an autograd.Function that does nothing), the least
autograd.Function that runs our C++ calls (no checks, no options, nothing cached), and the library's calls, at 4 x 64.

    PYTHONPATH=python python bench/host_floor.py [--device cuda] [--rounds 7] [--one-thread]

Every variant runs a loop of `--calls` fwd+bwd calls up to a synchronization (wall time per call); the variants are
measured in interleaved rounds (each round runs every variant once, in turn), as the host time of these calls drifts
by tens of percent within a minute on a shared host. Printed: the median and the least of the rounds, µs per call.
`--one-thread` repeats the backward variants with autograd's device threads off
(torch.autograd.set_multithreading_enabled(False)): the difference is the hand-off of a CUDA backward to autograd's
device thread, which every backward pays, torch's own included.
"""
from __future__ import annotations

import argparse
import importlib
import statistics
import time

import torch
import torch.nn.functional as F

import logitless
from logitless import _C
from logitless._tensor import descriptor, stream_of, workspace

rms = importlib.import_module("logitless.rms_norm")


class Least(torch.autograd.Function):
    """RMSNorm as the least an autograd.Function over the C++ entry points does (grad_weight included)."""

    @staticmethod
    def forward(ctx, x, w, opts):
        y, rstd = torch.empty_like(x), torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
        _C.rms_norm_forward(descriptor(x, "x"), None, descriptor(w, "w"), opts, descriptor(y, "y"), None,
                            descriptor(rstd, "rstd"), None, stream_of(x))
        ctx.save_for_backward(x, w, rstd)
        ctx.opts = opts
        return y

    @staticmethod
    def backward(ctx, gy):
        x, w, rstd = ctx.saved_tensors
        need_w = ctx.needs_input_grad[1]
        gx, gw = torch.empty_like(x), torch.empty_like(w) if need_w else None
        xd, wd = descriptor(x, "x"), descriptor(w, "w")
        owner, ws = None, None
        if need_w and x.is_cuda:
            owner, ws = workspace(_C.rms_norm_backward_workspace_bytes(xd, wd, ctx.opts), x.device)
        _C.rms_norm_backward(descriptor(gy, "grad_y"), None, xd, wd, descriptor(rstd, "rstd"), ctx.opts,
                             descriptor(gx, "grad_x"), descriptor(gw, "grad_w"), ws, stream_of(x))
        return gx, gw, None


class Identity(torch.autograd.Function):
    """An autograd.Function that does nothing: the cost of a Python autograd node itself."""

    @staticmethod
    def forward(ctx, a):
        return a.view_as(a)

    @staticmethod
    def backward(ctx, g):
        return g


def variants(dev: str):
    x0, dy = torch.randn(4, 64, device=dev), torch.randn(4, 64, device=dev)
    w = torch.randn(64, device=dev, requires_grad=True)
    logits0, target = torch.randn(4, 64, device=dev), torch.randint(0, 64, (4,), device=dev)
    opts = rms._options(1e-6, 0.0, 0, 0, 0)

    def x():
        return x0.clone().requires_grad_(True)

    def logits():
        return logits0.clone().requires_grad_(True)

    return {
        "input clone (in every row below)": lambda: x(),
        "a view's C++ node, fwd+bwd": lambda: x().view_as(x0).backward(dy),
        "autograd.Function doing nothing, fwd+bwd": lambda: Identity.apply(x()).backward(dy),
        "F.rms_norm fwd+bwd": lambda: F.rms_norm(x(), (64,), w, 1e-6).backward(dy),
        "least autograd.Function over our C++ calls": lambda: Least.apply(x(), w, opts).backward(dy),
        "logitless.rms_norm fwd+bwd": lambda: logitless.rms_norm(x(), w).backward(dy),
        "F.rms_norm fwd, no graph": lambda: F.rms_norm(x0, (64,), w.detach(), 1e-6),
        "logitless.rms_norm fwd, no graph": lambda: logitless.rms_norm(x0, w.detach()),
        "F.cross_entropy fwd+bwd": lambda: F.cross_entropy(logits(), target).backward(),
        "logitless.cross_entropy fwd+bwd": lambda: logitless.cross_entropy(logits(), target).backward(),
        "  the same, check_targets=False": lambda: logitless.cross_entropy(logits(), target,
                                                                            check_targets=False).backward(),
    }


def loop_us(fn, calls: int, cuda: bool) -> float:
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def measure(table: dict, rounds: int, calls: int, cuda: bool) -> dict:
    for fn in table.values():
        for _ in range(50):
            fn()
    got = {name: [] for name in table}
    for _ in range(rounds):
        for name, fn in table.items():
            got[name].append(loop_us(fn, calls, cuda))
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--one-thread", action="store_true")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    table = variants(args.device)
    passes = [("", table)]
    if args.one_thread:
        passes.append(("[device threads off] ", {k: v for k, v in table.items() if "fwd+bwd" in k or "C++" in k
                                                 or "Function" in k}))
    print(f"{'variant':68s} {'median µs':>10s} {'least µs':>9s}   ({args.device}, {args.rounds} rounds of "
          f"{args.calls} calls)")
    for prefix, t in passes:
        torch.autograd.set_multithreading_enabled(not prefix)
        for name, v in measure(t, args.rounds, args.calls, cuda).items():
            print(f"{prefix + name:68s} {statistics.median(v):10.1f} {min(v):9.1f}", flush=True)
    torch.autograd.set_multithreading_enabled(True)


if __name__ == "__main__":
    main()
