"""Where the host time of one eager forward + backward goes, part by part, at a tiny shape, on the CPU backend or on
a GPU (--device cuda: the same host code plus the stream lookups, the CUDA workspace and the launches).

    PYTHONPATH=python python bench/host_breakdown.py [--device cuda]

Each part is timed alone in a loop (the least of several loops); "per call" multiplies it by how often one fwd+bwd
does it. On the CPU the clock is this thread's CPU time, so that other work on a shared host does not count. On a
GPU it is wall time up to a synchronization: autograd runs a CUDA backward on its own device thread, whose time the
calling thread's CPU clock would miss. The parts overlap the totals only roughly: they are a map of the cost, not a
decomposition that sums exactly.
"""
from __future__ import annotations

import argparse
import importlib
import time

import torch
import torch.nn.functional as F

import logitless
from host_floor import Identity, Least  # bench/ is on the path: this script runs from it
from logitless import _C
from logitless._tensor import descriptor
from logitless._tensor import stream as _stream


def host_us(fn, cuda: bool, n: int = 3000, repeats: int = 7) -> float:
    clock = time.perf_counter if cuda else time.thread_time
    for _ in range(200):
        fn()
    best = float("inf")
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        t0 = clock()
        for _ in range(n):
            fn()
        if cuda:
            torch.cuda.synchronize()
        best = min(best, (clock() - t0) / n * 1e6)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    dev = ap.parse_args().device
    cuda = dev == "cuda"
    x0, w, dy = torch.randn(4, 64, device=dev), torch.randn(64, device=dev, requires_grad=True), \
        torch.randn(4, 64, device=dev)
    logits0, target = torch.randn(4, 64, device=dev), torch.randint(0, 64, (4,), device=dev)
    a, g = torch.randn(4, 64, device=dev, requires_grad=True), torch.ones(4, 64, device=dev)
    op = torch.ops.logitless.rms_norm_forward.default
    rn = importlib.import_module("logitless.rms_norm")

    impl = getattr(rn._forward, "impl", None) or rn._forward._init_fn
    opts = rn._options(1e-6, 0.0, 0, 0, 0)
    y, rstd = torch.empty(4, 64, device=dev), torch.empty(4, device=dev)
    xd, wd, yd, rd = (descriptor(t, "t") for t in (x0, w, y, rstd))
    stream = _stream(x0.device)
    gx, gw = torch.empty_like(x0), torch.empty_like(w)
    parts = [
        ("rms_norm fwd+bwd, total", 1, lambda: logitless.rms_norm(x0.clone().requires_grad_(True), w).backward(dy)),
        ("F.rms_norm fwd+bwd, total (torch's CPU composite)", 1,
         lambda: F.rms_norm(x0.clone().requires_grad_(True), (64,), w, 1e-6).backward(dy)),
        ("cross_entropy fwd+bwd, total", 1,
         lambda: logitless.cross_entropy(logits0.clone().requires_grad_(True), target).backward()),
        ("F.cross_entropy fwd+bwd, total", 1,
         lambda: F.cross_entropy(logits0.clone().requires_grad_(True), target).backward()),
        ("input clone + requires_grad (in every total)", 1, lambda: x0.clone().requires_grad_(True)),
        ("autograd: Function.apply + engine + Tensor.backward", 1, lambda: Identity.apply(a).backward(g)),
        ("autograd: a view's C++ node + engine + Tensor.backward", 1, lambda: a.view_as(a).backward(g)),
        ("least autograd.Function over the C++ calls (no dW), fwd+bwd", 1,
         lambda: Least.apply(x0.clone().requires_grad_(True), w.detach(), opts).backward(dy)),
        ("custom-op dispatch, rms_norm_forward (op minus its impl)", 2,
         lambda: op(x0, w, None, 1e-6, 0.0, 0, 0, 0)),
        ("  its impl called directly", 2, lambda: impl(x0, w, None, 1e-6, 0.0, 0, 0, 0)),
        ("options struct built from keywords", 2, lambda: rn._options(1e-6, 0.0, 0, 0, 0)),
        ("tensor descriptor", 13, lambda: descriptor(x0, "x")),
        ("torch.empty of an output", 5, lambda: torch.empty((4, 64), dtype=torch.float32, device=x0.device)),
        ("C++ entry point (rms_norm_forward, 4 x 64)", 1,
         lambda: _C.rms_norm_forward(xd, None, wd, opts, yd, None, rd, None, stream)),
        ("the backward op's body (workspace, descriptors, C++ call)", 1,
         lambda: rn._run_backward(dy, None, x0, w, rstd, opts, gx, gw)),
        ("stream lookup", 3, lambda: _stream(x0.device)),
        ("torch.compiler.is_compiling()", 4, torch.compiler.is_compiling),
    ]
    cached = getattr(rn, "_cached_options", None)
    if cached is not None:
        parts.append(("options struct from the cache", 2, lambda: cached(1e-6, 0.0, 0, 0, 0)))
    from logitless import _autograd

    if hasattr(_autograd, "eager_ok"):
        parts.append(("eager_ok (modes, subclasses, devices) over 3 tensors", 2,
                      lambda: _autograd.eager_ok((x0, w, None))))
    print(f"{'part':60s} {'µs each':>8s} {'x/call':>6s} {'µs/call':>8s}   ({dev}, "
          f"{'wall time' if cuda else 'CPU time of this thread'})")
    for name, count, fn in parts:
        us = host_us(fn, cuda)
        print(f"{name:60s} {us:8.2f} {count:6d} {us * count:8.2f}")


if __name__ == "__main__":
    main()
