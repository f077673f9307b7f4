"""Where an eager call's host time goes on a GPU host: wall time of loops of one forward + backward (logitless beside
torch's own op), a profile of every Python thread (autograd runs a CUDA backward on its device thread) and
torch.profiler's op table at a small real shape.

    PYTHONPATH=python python bench/host_profile.py [--device cuda] [--no-yappi]

The thread profile needs yappi (pip install yappi) and is skipped without it. Its per-call figures include the
profiler's own overhead: read them as shares, not as times.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import logitless


def wall_us(fn, cuda: bool, n: int = 2000) -> float:
    """Least of 5 loops of n calls, µs a call, synchronized at each loop's end."""
    for _ in range(200):
        fn()
    best = float("inf")
    for _ in range(5):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        if cuda:
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return best


def calls(dev: str, n: int, h: int, v: int, dtype: torch.dtype):
    """name -> a fwd+bwd call: RMSNorm [n, h] and cross-entropy [n, v], logitless and torch."""
    x0 = torch.randn(n, h, device=dev, dtype=dtype)
    w = torch.ones(h, device=dev, dtype=dtype, requires_grad=True)
    dy = torch.randn_like(x0)
    logits0 = torch.randn(n, v, device=dev, dtype=dtype)
    t = torch.randint(0, v, (n,), device=dev)

    def rms(norm):
        def call():
            x = x0.clone().requires_grad_()
            w.grad = None
            norm(x).backward(dy)
        return call

    def ce(loss):
        def call():
            loss(logits0.clone().requires_grad_()).backward()
        return call

    return {
        "rms_norm": rms(lambda x: logitless.rms_norm(x, w, 1e-6)),
        "F.rms_norm": rms(lambda x: F.rms_norm(x, (h,), w, 1e-6)),
        "cross_entropy": ce(lambda z: logitless.cross_entropy(z, t)),
        "F.cross_entropy": ce(lambda z: F.cross_entropy(z.float(), t)),
    }


def thread_profile(fn, cuda: bool, n: int = 3000, rows: int = 30) -> None:
    import yappi

    yappi.set_clock_type("wall")
    yappi.clear_stats()
    yappi.start(builtins=True, profile_threads=True)
    for _ in range(n):
        fn()
    if cuda:
        torch.cuda.synchronize()
    yappi.stop()
    print("  self µs  incl µs  calls/call  thread  function")
    for s in sorted(yappi.get_func_stats(), key=lambda s: -s.tsub)[:rows]:
        print(f"  {s.tsub / n * 1e6:7.2f}  {s.ttot / n * 1e6:7.2f}  {s.ncall / n:10.1f}  {s.ctx_id:6d}  "
              f"{s.module.split('/')[-1]}:{s.lineno} {s.name}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    ap.add_argument("--no-yappi", action="store_true", help="skip the thread profile")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    tiny = calls(args.device, 4, 64, 64, torch.float32)
    print(f"fwd+bwd at 4 x 64 float32 ({args.device}), wall µs a call:")
    for name, fn in tiny.items():
        print(f"  {name:16s} {wall_us(fn, cuda):8.1f}")
    if not args.no_yappi:
        try:
            import yappi  # noqa: F401
        except ImportError:
            print("(yappi is not installed: no thread profile)")
        else:
            for name in ("rms_norm", "cross_entropy"):
                print(f"\n{name}, every thread, by self time (µs a call, profiler overhead included):")
                thread_profile(tiny[name], cuda)
    if not cuda:
        return
    from torch.profiler import ProfilerActivity, profile

    real = calls(args.device, 2048, 2048, 32000, torch.bfloat16)
    for name, fn in real.items():
        print(f"\n{name} at 2048 rows (bf16; H 2048, V 32000): {wall_us(fn, cuda, 500):.1f} µs a call (wall)")
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=10, max_name_column_width=60))


if __name__ == "__main__":
    main()
