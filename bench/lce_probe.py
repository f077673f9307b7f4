"""Linear cross-entropy against the three cuBLAS GEMMs it replaces, in one process: a quick probe of the CUDA
plan's chunking (memory_budget, chunk_tokens) that skips the peers of bench/bench.py.

    python3 bench/lce_probe.py [--shapes 8192x4096x128256,4096x4096x128256] [--budgets-mib 512]
                               [--schedules auto,gradient_in_forward,recompute] [--tag NAME]

Prints, per shape and budget: the GEMMs' time (X·Wᵀ, dZ·W, dZᵀ·X in bf16), the time of
linear_cross_entropy(x, w, t).backward() (bf16, default options), their ratio, and the peak memory beyond the
inputs (dX and dW included). Medians of 7 runs after one warm-up. On an H100 the library's fused Hopper kernels
run where they apply; LOGITLESS_LCE_KERNEL=generic in the environment measures the cuBLAS path instead.
"""
import argparse

import torch

import logitless


def median_ms(fn, runs=7):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="8192x4096x128256,4096x4096x128256", help="NxHxV, comma-separated")
    ap.add_argument("--budgets-mib", default="512", help="memory_budget values in MiB, comma-separated")
    ap.add_argument("--schedules", default="auto", help="schedule values, comma-separated")
    ap.add_argument("--tag", default="", help="a label printed at the start of each line")
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
        gemms = median_ms(lambda: (torch.mm(xd, wd.t(), out=z), dz @ wd, dz.t() @ xd))
        del z, dz
        runs = [(int(b) << 20, s) for b in args.budgets_mib.split(",") for s in args.schedules.split(",")]
        for budget, schedule in runs:
            def run():
                x.grad = w.grad = None
                logitless.linear_cross_entropy(x, w, t, memory_budget=budget, schedule=schedule).backward()

            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            ms = median_ms(run)
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20
            print(f"{args.tag} N={n} H={h} V={v} budget {budget >> 20} MiB {schedule}: GEMMs {gemms:.2f} ms, "
                  f"linear_cross_entropy {ms:.2f} ms = {ms / gemms:.3f}x, peak extra {peak:.0f} MiB (dX, dW included)",
                  flush=True)


if __name__ == "__main__":
    main()
