"""Linear cross-entropy against the three cuBLAS GEMMs it replaces, in one process: a quick probe of the CUDA
plan's chunking (memory_budget, chunk_tokens) that skips the peers of bench/bench.py.

    python3 bench/lce_probe.py [--shapes 8192x4096x128256,4096x4096x128256] [--budgets-mib 512]
                               [--schedules auto,gradient_in_forward,recompute] [--tag NAME] [--kernels]

Prints, per shape and budget: the GEMMs' time (X·Wᵀ, dZ·W, dZᵀ·X in bf16), the time of
linear_cross_entropy(x, w, t).backward() (bf16, default options), their ratio, and the peak memory beyond the
inputs (dX and dW included). Medians of 7 rounds after one warm-up, each round timing the GEMMs and every
schedule once in turn (so that all see the same clocks of a GPU under load). On an H100 the library's fused
Hopper kernels run where they apply; LOGITLESS_LCE_KERNEL=generic in the environment measures the cuBLAS path
instead.
--kernels adds, per line, the GPU time of each kernel of one more call (torch.profiler), largest first.
"""
import argparse

import torch

import logitless


def time_ms(fn):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b)


def interleaved_medians(fns, rounds=7):
    """Median ms of each function, timed in turns (one call of each per round, after one warm-up call each):
    a GPU under sustained load lowers its clocks, so whatever is timed first on an idle GPU would run faster."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    times = [[] for _ in fns]
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            times[i].append(time_ms(fn))
    return [sorted(t)[len(t) // 2] for t in times]


def print_kernels(fn):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = sorted((ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda ev: ev.time_range.start)
    totals = {}
    for ev in kernels:
        calls, us = totals.get(ev.name, (0, 0.0))
        totals[ev.name] = (calls + 1, us + ev.time_range.elapsed_us())
    busy = sum(us for _, us in totals.values())
    span = kernels[-1].time_range.end - kernels[0].time_range.start if kernels else 0
    print(f"    GPU busy {busy / 1000:.3f} ms over a span of {span / 1000:.3f} ms")
    for name, (calls, us) in sorted(totals.items(), key=lambda kv: -kv[1][1])[:12]:
        print(f"    {us / 1000:8.3f} ms  {calls:4d}x  {name[:110]}")
    gaps = sorted(((b.time_range.start - a.time_range.end, a.name, b.name) for a, b in zip(kernels, kernels[1:])),
                  reverse=True)[:4]
    for gap, a, b in gaps:
        print(f"    idle {gap / 1000:7.3f} ms between {a[:50]} and {b[:50]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="8192x4096x128256,4096x4096x128256", help="NxHxV, comma-separated")
    ap.add_argument("--budgets-mib", default="512", help="memory_budget values in MiB, comma-separated")
    ap.add_argument("--schedules", default="auto", help="schedule values, comma-separated")
    ap.add_argument("--tag", default="", help="a label printed at the start of each line")
    ap.add_argument("--kernels", action="store_true", help="per-kernel GPU time of one call (torch.profiler)")
    args = ap.parse_args()
    for shape in args.shapes.split(","):
        n, h, v = (int(s) for s in shape.split("x"))
        g = torch.Generator(device="cuda").manual_seed(0)
        x = (torch.randn(n, h, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_(True)
        w = (torch.randn(v, h, device="cuda", generator=g) * 0.02).bfloat16().requires_grad_(True)
        t = torch.randint(0, v, (n,), device="cuda", generator=g)
        z = torch.empty(n, v, device="cuda", dtype=torch.bfloat16)
        dz = torch.randn(n, v, device="cuda", dtype=torch.bfloat16, generator=g)
        xd, wd = x.detach(), w.detach()
        runs = [(int(b) << 20, s) for b in args.budgets_mib.split(",") for s in args.schedules.split(",")]

        def make_run(budget, schedule):
            def run():
                x.grad = w.grad = None
                logitless.linear_cross_entropy(x, w, t, memory_budget=budget, schedule=schedule).backward()
            return run

        fns = [make_run(b, s) for b, s in runs]
        gemms, *times = interleaved_medians([lambda: (torch.mm(xd, wd.t(), out=z), dz @ wd, dz.t() @ xd)] + fns)
        del z, dz
        for (budget, schedule), run, ms in zip(runs, fns, times):
            torch.cuda.synchronize()
            x.grad = w.grad = None
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            run()
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20
            print(f"{args.tag} N={n} H={h} V={v} budget {budget >> 20} MiB {schedule}: GEMMs {gemms:.2f} ms, "
                  f"linear_cross_entropy {ms:.2f} ms = {ms / gemms:.3f}x, peak extra {peak:.0f} MiB (dX, dW included)",
                  flush=True)
            if args.kernels:
                print_kernels(run)


if __name__ == "__main__":
    main()
