"""Linear cross-entropy against the three cuBLAS GEMMs it replaces, in one process: a quick probe of the CUDA
plan's chunking (memory_budget, chunk_tokens) that skips the peers of bench/bench.py.

    python3 bench/lce_probe.py [--shapes 8192x4096x128256,4096x4096x128256] [--budgets-mib 512]
                               [--schedules auto,gradient_in_forward,recompute] [--tag NAME] [--kernels]
                               [--inputs probe|bench] [--hook NAME=V1,V2,...] [--autocast]

Prints, per shape and budget: the GEMMs' time (X·Wᵀ, dZ·W, dZᵀ·X in bf16), the time of
linear_cross_entropy(x, w, t).backward() (bf16, default options), their ratio, and the peak memory beyond the
inputs (dX and dW included). Medians of 7 rounds after one warm-up, each round timing the GEMMs and every
schedule once in turn (so that all see the same clocks of a GPU under load). On an H100 the library's fused
Hopper kernels run where they apply; LOGITLESS_LCE_KERNEL=generic in the environment measures the cuBLAS path
instead, LOGITLESS_LCE_EXP_FORM=0 the generic gradient in forward (the exponential form is the default), and
LOGITLESS_HEAD_ACCUMULATE_GEMM=0 cuBLAS for grad_weight's accumulating products, and LOGITLESS_LCE_PINGPONG=1 the
ping-pong schedule of the fused exponentials' kernel (cooperative by default). This harness sets the library's
debug hooks from them (src/common/debug_hooks.h), through the extension's _set_debug_hook.
--kernels adds a profile of 3 more rounds (torch.profiler): per function, the host time of a call, the GPU's busy
time and span, and its largest kernels.
--hook runs each schedule once per value of a library hook (src/common/debug_hooks.h), in the same interleaved
rounds: two settings of one switch compared on the same clocks.
--inputs bench draws hidden ~ N(0, 1) and weight ~ N(0, 4 / H) as bench.py does (logits of standard deviation 2)
instead of hidden × 0.5 and weight × 0.02 (about 0.6): an H100's GEMMs run several percent slower on the former.
--autocast makes hidden and weight float32 and calls the op under torch.autocast(bfloat16) (float32 master weights,
as transformers' Trainer runs them with bf16=True); the GEMMs stay bf16 (on copies made once), so the ratio is to
the same yardstick as the bf16 call's.
"""
import argparse
import os

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


def profile_rounds(names, fns, rounds=3):
    """Per function, from `rounds` more interleaved rounds under torch.profiler: the call's time on the host clock
    (launch to synchronize), the GPU's busy time and the span of its kernels, the idle time before the first
    kernel, and the busiest kernels; medians over the rounds. Kernels belong to the call whose host range holds
    their start (each call ends with a synchronize, so none runs into the next)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for r in range(rounds):
            for i, fn in enumerate(fns):
                with record_function(f"probe_call:{i}:{r}"):
                    fn()
                    torch.cuda.synchronize()
    events = prof.events()
    calls = sorted((ev.time_range.start, ev.time_range.end, int(ev.name.split(":")[1])) for ev in events
                   if ev.name.startswith("probe_call:") and ev.device_type == torch.autograd.DeviceType.CPU)
    # The device-side copies of the record_function ranges are annotations, not kernels.
    kernels = sorted((ev for ev in events
                      if ev.device_type == torch.autograd.DeviceType.CUDA and not ev.name.startswith("probe_call:")),
                     key=lambda ev: ev.time_range.start)
    per_fn = [[] for _ in fns]
    for start, end, i in calls:
        ks = [k for k in kernels if start <= k.time_range.start < end]
        per_fn[i].append((end - start, ks, start))

    def med(vals):
        return sorted(vals)[len(vals) // 2]

    for i, name in enumerate(names):
        walls, busys, spans, leads, totals = [], [], [], [], {}
        for wall, ks, start in per_fn[i]:
            walls.append(wall)
            busys.append(sum(k.time_range.elapsed_us() for k in ks))
            spans.append(ks[-1].time_range.end - ks[0].time_range.start if ks else 0)
            leads.append(ks[0].time_range.start - start if ks else 0)
            for k in ks:
                totals.setdefault(k.name, []).append(k.time_range.elapsed_us())
        n = max(1, len(per_fn[i]))
        print(f"  [{name}] host {med(walls) / 1000:.3f} ms, GPU busy {med(busys) / 1000:.3f} ms over a span of "
              f"{med(spans) / 1000:.3f} ms, first kernel after {med(leads) / 1000:.3f} ms "
              f"(medians of {len(per_fn[i])} calls)")
        for kname, us in sorted(totals.items(), key=lambda kv: -sum(kv[1]))[:8]:
            print(f"    {sum(us) / n / 1000:8.3f} ms  {len(us) / n:5.1f}x  {kname[:110]}")


# The library's defaults of the hooks this harness sets (src/common/debug_hooks.cpp).
DEFAULT_HOOKS = {"lce_fused_kernels": 1, "lce_exp_form": 1, "head_accumulate_gemm": 1, "lce_fused_pingpong": 0}


def set_hooks_from_environment():
    """The library reads no environment: the switches this harness takes from it become the library's hooks."""
    hooks = {"lce_fused_kernels": int(os.environ.get("LOGITLESS_LCE_KERNEL", "") != "generic"),
             "lce_exp_form": int(os.environ.get("LOGITLESS_LCE_EXP_FORM", "") != "0"),
             "head_accumulate_gemm": int(os.environ.get("LOGITLESS_HEAD_ACCUMULATE_GEMM", "") != "0"),
             "lce_fused_pingpong": int(os.environ.get("LOGITLESS_LCE_PINGPONG", "") == "1")}
    setter = getattr(logitless._C, "_set_debug_hook", None)
    if setter is None:
        if hooks != DEFAULT_HOOKS:
            raise SystemExit("this build's extension has no _set_debug_hook: LOGITLESS_* switches cannot take effect")
        return
    for name, value in hooks.items():
        if not setter(name, value) and value != DEFAULT_HOOKS[name]:
            raise SystemExit(f"this build's extension has no hook {name}: its switch cannot take effect")


def label(budget, schedule, hook_value, chunk_tokens):
    hook = "" if hook_value is None else f" hook={hook_value}"
    chunks = f" chunk_tokens={chunk_tokens}" if chunk_tokens else ""
    return f"budget {budget >> 20} MiB {schedule}{hook}{chunks}"


def loss_gradient(xd, wd, t):
    """The gradient of the mean cross-entropy of X·Wᵀ in bf16, as torch's backward multiplies it: (softmax − onehot)
    / n, computed a slice of rows at a time to bound the float32 temporaries."""
    n = xd.shape[0]
    dz = torch.empty(n, wd.shape[0], device=xd.device, dtype=torch.bfloat16)
    for r0 in range(0, n, 1024):
        rows = torch.softmax((xd[r0:r0 + 1024] @ wd.t()).float(), dim=1)
        rows[torch.arange(rows.shape[0], device=xd.device), t[r0:r0 + 1024]] -= 1.0
        dz[r0:r0 + 1024] = (rows / n).bfloat16()
    return dz


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="8192x4096x128256,4096x4096x128256", help="NxHxV, comma-separated")
    ap.add_argument("--budgets-mib", default="512", help="memory_budget values in MiB, comma-separated")
    ap.add_argument("--schedules", default="auto", help="schedule values, comma-separated")
    ap.add_argument("--tag", default="", help="a label printed at the start of each line")
    ap.add_argument("--inputs", default="probe", choices=("probe", "bench"),
                    help="input scaling: the probe's (small logits) or bench.py's (logits of standard deviation 2)")
    ap.add_argument("--kernels", action="store_true",
                    help="per-kernel GPU time of 3 more interleaved rounds, the GEMMs included (torch.profiler)")
    ap.add_argument("--chunk-tokens", default="0", help="chunk_tokens values, comma-separated (0: the plan's)")
    ap.add_argument("--hook", default="", help="NAME=V1,V2,...: each schedule once per value of that hook")
    ap.add_argument("--autocast", action="store_true",
                    help="float32 hidden and weight, the op under torch.autocast(bfloat16)")
    ap.add_argument("--loss-dz", action="store_true",
                    help="also time the three GEMMs with dZ the mean loss's gradient of these logits (bf16, as "
                         "torch's backward has it) instead of random numbers, in the same rounds")
    args = ap.parse_args()
    set_hooks_from_environment()
    hook_name, _, hook_values = args.hook.partition("=")
    hook_values = [int(v) for v in hook_values.split(",")] if hook_name else [None]
    if hook_name and not logitless._C._set_debug_hook(hook_name, hook_values[0]):
        raise SystemExit(f"this build's extension has no hook {hook_name}")
    for shape in args.shapes.split(","):
        n, h, v = (int(s) for s in shape.split("x"))
        g = torch.Generator(device="cuda").manual_seed(0)
        x_scale, w_scale = (0.5, 0.02) if args.inputs == "probe" else (1.0, 2.0 / h ** 0.5)
        dtype = torch.float32 if args.autocast else torch.bfloat16
        x = (torch.randn(n, h, device="cuda", generator=g) * x_scale).to(dtype).requires_grad_(True)
        w = (torch.randn(v, h, device="cuda", generator=g) * w_scale).to(dtype).requires_grad_(True)
        t = torch.randint(0, v, (n,), device="cuda", generator=g)
        z = torch.empty(n, v, device="cuda", dtype=torch.bfloat16)
        dz = torch.randn(n, v, device="cuda", dtype=torch.bfloat16, generator=g)
        xd, wd = x.detach().bfloat16(), w.detach().bfloat16()
        runs = [(int(b) << 20, s, hv, int(c)) for b in args.budgets_mib.split(",") for s in args.schedules.split(",")
                for hv in hook_values for c in args.chunk_tokens.split(",")]

        def make_run(budget, schedule, hook_value, chunk_tokens):
            def run():
                if hook_value is not None:
                    logitless._C._set_debug_hook(hook_name, hook_value)
                x.grad = w.grad = None
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.autocast):
                    loss = logitless.linear_cross_entropy(x, w, t, memory_budget=budget, schedule=schedule,
                                                          chunk_tokens=chunk_tokens or None)
                loss.backward()
            return run

        fns = [make_run(*r) for r in runs]
        yardsticks = [lambda: (torch.mm(xd, wd.t(), out=z), dz @ wd, dz.t() @ xd)]
        if args.loss_dz:
            dz_loss = loss_gradient(xd, wd, t)
            yardsticks.append(lambda: (torch.mm(xd, wd.t(), out=z), dz_loss @ wd, dz_loss.t() @ xd))
        all_fns = yardsticks + fns
        gemms, *times = interleaved_medians(all_fns)
        if args.loss_dz:
            loss_gemms = times.pop(0)
            print(f"{args.tag} N={n} H={h} V={v}: GEMMs with random dZ {gemms:.2f} ms, with the loss's dZ "
                  f"{loss_gemms:.2f} ms = {loss_gemms / gemms:.3f}x", flush=True)
        if args.kernels:
            names = ["GEMMs"] + (["GEMMs, the loss's dZ"] if args.loss_dz else [])
            profile_rounds(names + [label(*r) for r in runs], all_fns)
        del z, dz, xd, wd, all_fns, yardsticks
        for (budget, schedule, hv, ct), run, ms in zip(runs, fns, times):
            torch.cuda.synchronize()
            x.grad = w.grad = None
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            run()
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20
            kind = " float32 under autocast" if args.autocast else ""
            against_loss = f" ({ms / loss_gemms:.3f}x the loss's dZ GEMMs)" if args.loss_dz else ""
            print(f"{args.tag} N={n} H={h} V={v}{kind} {label(budget, schedule, hv, ct)}: GEMMs {gemms:.2f} ms, "
                  f"linear_cross_entropy {ms:.2f} ms = {ms / gemms:.3f}x{against_loss}, peak extra {peak:.0f} MiB "
                  "(dX, dW included)", flush=True)


if __name__ == "__main__":
    main()
