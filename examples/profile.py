#!/usr/bin/env python3
"""One training step (forward, backward, AdamW) of the Llama model of examples/finetune.py under
torch.profiler, before and after ``logitless.patch``: the top ops by device time (CPU time without a GPU),
a Chrome trace per mode (open it in https://ui.perfetto.dev or chrome://tracing), and a short summary.

The same model and the same batch serve every mode, in order: baseline, then patched, then (with
--modes ...,liger, on a GPU with liger_kernel importable) unpatched and Liger's RMSNorm and fused linear
cross-entropy applied. Each mode runs --warmup unprofiled steps first, so that the profiled step sees
allocator, cuBLAS and autotuning state settled. Data and model as in finetune.py (the tokenized standard
library, random weights; nothing downloaded).

Output (--out DIR): profile.md (summary and tables), trace_<mode>.json.gz, and the tables on stdout.

    PYTHONPATH=build/<dir>/python python examples/profile.py                        # tiny config without a GPU
    PYTHONPATH=build/<dir>/python python examples/profile.py --batch 4 --seq 2048 --out profile-out
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

# This file's name is the standard library's `profile`: with the script's directory first on the path, an
# `import profile` anywhere (cProfile does one) would find this file. Put the directory last instead; the
# finetune module next to it is still found.
_HERE = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0] or os.getcwd()) == _HERE:
    sys.path.append(sys.path.pop(0))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import finetune  # noqa: E402

GIB = 1 << 30


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default=None)
    p.add_argument("--config", choices=tuple(finetune.CONFIGS), default=None)
    p.add_argument("--batch", type=int, default=None, help="default as finetune.py: 8 on cuda, 4 on cpu")
    p.add_argument("--seq", type=int, default=None, help="default 2048 on cuda, 128 on cpu")
    p.add_argument("--modes", default="baseline,logitless",
                   help="comma-separated: baseline, logitless, liger, liger-full")
    p.add_argument("--warmup", type=int, default=2, dest="warmup_steps",
                   help="unprofiled steps before the profiled one, per mode")
    p.add_argument("--row-limit", type=int, default=20, help="rows of each ops table")
    p.add_argument("--out", default="profile-out")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None)
    p.add_argument("--attn", default="sdpa")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--tokenizer-vocab", type=int, default=32000)
    p.add_argument("--corpus-mb", type=float, default=None)
    p.add_argument("--cache", default=None)
    args = p.parse_args(argv)
    args.steps = None
    args.warmup = 5  # finetune's learning-rate warm-up
    return finetune.resolve_defaults(args, p)  # finetune's defaults for the options the two share


def timed_steps(model, opt, sched, ids, n, device):
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        finetune.train_step(model, opt, sched, ids)
    if device == "cuda":
        torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t0) / n


# Where a step's device time goes, by kernel name (first match wins): the GEMMs a step cannot avoid, attention,
# the optimizer, logitless's and Liger's (Triton) kernels, and what is left (torch's elementwise and reduction
# kernels, copies, casts).
CATEGORIES = (
    ("GEMM", ("gemm", "xmma", "nvjet", "cutlass", "wgmma", "sm90_", "sm80_", "ampere_", "cublas")),
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("optimizer", ("multi_tensor", "adam", "foreach")),
    ("logitless", ("logitless",)),
    ("Liger / Triton", ("liger", "triton", "_kernel_")),
    ("copies and casts", ("copy", "memcpy", "memset", "cast", "fill")),
)


def by_category(events):
    """{category: device ms} over the kernels: device events that are not user annotations (the device-side ranges
    of custom ops and record_function blocks, whose time is their kernels' again)."""
    totals = {}
    for e in events:
        us = getattr(e, "self_device_time_total", 0)
        if us <= 0 or getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        if getattr(e, "is_user_annotation", False):
            continue
        name = e.key.lower()
        cat = next((c for c, keys in CATEGORIES if any(k in name for k in keys)), "other (elementwise, reductions)")
        totals[cat] = totals.get(cat, 0.0) + us / 1e3
    return totals


def profile_mode(mode, model, opt, sched, ids, args, out):
    device = args.device
    gpu = device == "cuda"
    for _ in range(args.warmup_steps):
        finetune.train_step(model, opt, sched, ids)
    step_ms = timed_steps(model, opt, sched, ids, 3, device)
    if gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with profile(activities=activities, profile_memory=True) as prof:
        finetune.train_step(model, opt, sched, ids)
        if gpu:
            torch.cuda.synchronize()
    trace = out / f"trace_{mode}.json.gz"  # gzip: a step of the 1B model is tens of MB of JSON; Perfetto reads it
    prof.export_chrome_trace(str(trace))
    events = prof.key_averages()
    sort_by = "self_device_time_total" if gpu else "self_cpu_time_total"
    table = events.table(sort_by=sort_by, row_limit=args.row_limit, max_name_column_width=70)
    total_us = sum(getattr(e, sort_by) for e in events)
    peak = torch.cuda.max_memory_allocated() if gpu else None
    return dict(mode=mode, step_ms=step_ms, profiled_us=total_us, peak=peak, table=table, trace=trace.name,
                ops=len(events), categories=by_category(events) if gpu else {})


def main(argv=None):
    args = parse_args(argv)
    import logitless
    device = args.device
    gpu = device == "cuda"
    if gpu:
        torch.backends.cuda.matmul.allow_tf32 = True
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokens_path, corpus = finetune.corpus_tokens(args, finetune.CONFIGS[args.config]["vocab_size"])
    ids = finetune.Batches(np.load(tokens_path), args.seq, args.seed).next(args.batch).to(device)
    model = finetune.build_model(args, device)
    opt, sched = finetune.make_optimizer(model, args, device)

    results = []
    for mode in args.mode_list:
        if mode in finetune.LIGER_MODES:
            why = finetune.liger_unavailable(device)
            if why:
                print(f"liger: skipped: {why}", file=sys.stderr)
                continue
        logitless.unpatch(model)  # liger after logitless: one patch at a time
        finetune.apply_mode(model, mode)
        print(f"{mode}: {args.warmup_steps} warm-up steps, then one profiled step", file=sys.stderr, flush=True)
        results.append(profile_mode(mode, model, opt, sched, ids, args, out))

    what = "device" if gpu else "CPU"
    cfg = finetune.CONFIGS[args.config]
    lines = [
        "# One training step under torch.profiler",
        "",
        f"- device: {torch.cuda.get_device_name(0) if gpu else 'CPU'}; versions: "
        + ", ".join(f"{k} {v}" for k, v in finetune.versions().items()),
        f"- model: {args.config} Llama shape (hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, vocab "
        f"{cfg['vocab_size']}), {args.dtype}, attention {args.attn}; batch {args.batch} x {args.seq} tokens of the "
        f"tokenized standard library ({corpus['tokens']} tokens, BPE {corpus['tokenizer_vocab']})",
        "- one step = forward, backward, gradient clipping, AdamW; step time measured without the profiler "
        "(mean of 3 steps)",
        "- command: `" + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:]) + "`",
        "",
        f"| mode | step (ms) | self {what} time in the profiled step (ms) | "
        + ("peak memory (GiB) | " if gpu else "") + "distinct ops | trace |",
        "|---|---:|---:|" + ("---:|" if gpu else "") + "---:|---|",
    ]
    for r in results:
        lines.append(f"| {r['mode']} | {r['step_ms']:.1f} | {r['profiled_us'] / 1e3:.1f} | "
                     + (f"{r['peak'] / GIB:.2f} | " if gpu else "") + f"{r['ops']} | {r['trace']} |")
    cats = sorted({c for r in results for c in r["categories"]},
                  key=lambda c: -max(r["categories"].get(c, 0.0) for r in results))
    if cats:
        lines += ["", "## Device time by kind of kernel (ms in the profiled step)", "",
                  "| kernels | " + " | ".join(r["mode"] for r in results) + " |",
                  "|---|" + "---:|" * len(results)]
        for c in cats:
            lines.append(f"| {c} | " + " | ".join(f"{r['categories'].get(c, 0.0):.1f}" for r in results) + " |")
        lines.append("| total | " + " | ".join(f"{sum(r['categories'].values()):.1f}" for r in results) + " |")
    for r in results:
        lines += ["", f"## {r['mode']}: top {args.row_limit} by self {what} time", "", "```", r["table"].rstrip(),
                  "```"]
    text = "\n".join(lines) + "\n"
    (out / "profile.md").write_text(text)
    print(text)
    print(f"report: {out / 'profile.md'}; traces: {', '.join(r['trace'] for r in results)}", file=sys.stderr)


if __name__ == "__main__":
    main()
