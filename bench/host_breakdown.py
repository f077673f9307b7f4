"""Where the host time of one eager forward + backward goes, part by part, on the CPU backend at a tiny shape (the
host code is the same as on CUDA; only the stream lookup and the CUDA workspace differ).

    PYTHONPATH=python python bench/host_breakdown.py

Each part is timed alone in a loop (the least of several loops, in CPU time of this thread, so that other work on a
shared host does not count); "per call" multiplies it by how often one fwd+bwd does it. The parts overlap the
totals only roughly: they are a map of the cost, not a decomposition that sums exactly.
"""
from __future__ import annotations

import importlib
import time

import torch
import torch.nn.functional as F

import logitless
from logitless import _C
from logitless._tensor import descriptor


def cpu_us(fn, n: int = 3000, repeats: int = 7) -> float:
    for _ in range(200):
        fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.thread_time()
        for _ in range(n):
            fn()
        best = min(best, (time.thread_time() - t0) / n * 1e6)
    return best


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a):
        return a.view_as(a)

    @staticmethod
    def backward(ctx, g):
        return g


def main() -> None:
    x0, w, dy = torch.randn(4, 64), torch.randn(64, requires_grad=True), torch.randn(4, 64)
    logits0, target = torch.randn(4, 64), torch.randint(0, 64, (4,))
    a, g = torch.randn(4, 64, requires_grad=True), torch.ones(4, 64)
    op = torch.ops.logitless.rms_norm_forward.default
    rn = importlib.import_module("logitless.rms_norm")

    impl = getattr(rn._forward, "impl", None) or rn._forward._init_fn
    opts = rn._options(1e-6, 0.0, 0, 0, 0)
    y, rstd = torch.empty(4, 64), torch.empty(4)
    xd, wd, yd, rd = (descriptor(t, "t") for t in (x0, w, y, rstd))
    parts = [
        ("rms_norm fwd+bwd, total", 1, lambda: logitless.rms_norm(x0.clone().requires_grad_(True), w).backward(dy)),
        ("F.rms_norm fwd+bwd, total (torch's CPU composite)", 1,
         lambda: F.rms_norm(x0.clone().requires_grad_(True), (64,), w, 1e-6).backward(dy)),
        ("cross_entropy fwd+bwd, total", 1,
         lambda: logitless.cross_entropy(logits0.clone().requires_grad_(True), target).backward()),
        ("F.cross_entropy fwd+bwd, total", 1,
         lambda: F.cross_entropy(logits0.clone().requires_grad_(True), target).backward()),
        ("input clone + requires_grad (in every total)", 1, lambda: x0.clone().requires_grad_(True)),
        ("autograd: Function.apply + engine + Tensor.backward", 1, lambda: _Identity.apply(a).backward(g)),
        ("custom-op dispatch, rms_norm_forward (op minus its impl)", 2,
         lambda: op(x0, w, None, 1e-6, 0.0, 0, 0, 0)),
        ("  its impl called directly", 2, lambda: impl(x0, w, None, 1e-6, 0.0, 0, 0, 0)),
        ("options struct built from keywords", 2, lambda: rn._options(1e-6, 0.0, 0, 0, 0)),
        ("tensor descriptor", 13, lambda: descriptor(x0, "x")),
        ("torch.empty of an output", 5, lambda: torch.empty((4, 64), dtype=torch.float32, device=x0.device)),
        ("C++ entry point (rms_norm_forward, 4 x 64)", 1,
         lambda: _C.rms_norm_forward(xd, None, wd, opts, yd, None, rd, None, 0)),
        ("torch.compiler.is_compiling()", 4, torch.compiler.is_compiling),
    ]
    cached = getattr(rn, "_cached_options", None)
    if cached is not None:
        parts.append(("options struct from the cache", 2, lambda: cached(1e-6, 0.0, 0, 0, 0)))
    from logitless import _autograd

    if hasattr(_autograd, "eager_ok"):
        parts.append(("eager_ok (modes, subclasses, devices) over 3 tensors", 2,
                      lambda: _autograd.eager_ok((x0, w, None))))
    print(f"{'part':60s} {'µs each':>8s} {'x/call':>6s} {'µs/call':>8s}")
    for name, count, fn in parts:
        us = cpu_us(fn)
        print(f"{name:60s} {us:8.2f} {count:6d} {us * count:8.2f}")


if __name__ == "__main__":
    main()
