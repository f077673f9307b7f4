"""Vocabulary-parallel linear cross-entropy: one GPU against R GPUs on the same global problem, in one run.

    torchrun --nproc_per_node=2 bench/distributed.py            # or: python bench/distributed.py (spawns 2)
    torchrun --nproc_per_node=2 bench/distributed.py --n 16384 --h 4096 --v 128256 --iters 20

(with the extension importable, e.g. PYTHONPATH=build/<dir>/python; `--cpu --n 64 --h 32 --v 1000` smoke-tests the
script on the CPU over gloo). Every rank builds the same global problem
(bf16 hidden [N, H], weight [V, H], targets; rank 0's, broadcast). One GPU: `logitless.linear_cross_entropy` on the
whole weight, forward + backward of the mean loss with gradients for hidden and weight, timed on every rank's GPU at
once (the GPUs are independent; rank 0's time is reported). R GPUs: each rank holds V/R rows of the weight and calls
the same function with `process_group=`: the forward exchanges 4 floats per token and rank, the backward
all_reduces grad_hidden. A step's time is the slowest rank's (CUDA events around the call, after a barrier), the
median over iterations. Both schedules are timed; the speedup that counts is the default (gradient in the forward)
on one GPU against the default on R. Before timing, R GPUs' loss and gradients are checked against one GPU's.

Target (issue "vocabulary parallelism"): N=16384, H=4096, V=128256 bf16, two H200s >= 1.8x one H200.

`--autocast`: float32 hidden and weight (master weights), every call under torch.autocast(bfloat16), float32
gradients; one more row times R GPUs on the same float32 inputs without autocast (float32 products).
`--peers`: one more row, what a user of plain torch tensor parallelism runs on R GPUs: the head as DTensors (hidden
replicated, the weight's rows sharded), F.linear (logits sharded along the vocabulary, [N, V/R] on each rank) and
F.cross_entropy on the float32 logits under torch's loss_parallel(), eager.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist


class _Source(torch.autograd.Function):
    """Hands `x` on as a non-leaf that requires grad; its backward drops the gradient (no accumulation timed)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return None


def _step(lce, hidden, weight, target, autocast=False, **kw):
    h = _Source.apply(hidden)
    w = _Source.apply(weight)
    h.retain_grad()
    w.retain_grad()
    with torch.autocast(hidden.device.type, dtype=torch.bfloat16, enabled=autocast):
        loss = lce(h, w, target, **kw)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def _torch_tp_step(hidden, shard, target, mesh, vocab, autocast):
    """Plain torch tensor parallelism of the head: DTensor F.linear, then cross-entropy under loss_parallel()."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import loss_parallel

    h = _Source.apply(hidden)
    w = _Source.apply(shard)
    h.retain_grad()
    w.retain_grad()
    hd = DTensor.from_local(h, mesh, [Replicate()], run_check=False)
    wd = DTensor.from_local(w, mesh, [Shard(0)], run_check=False, shape=(vocab, shard.shape[1]),
                            stride=(shard.shape[1], 1))
    with torch.autocast(hidden.device.type, dtype=torch.bfloat16, enabled=autocast):
        logits = torch.nn.functional.linear(hd, wd)
    with loss_parallel():
        loss = torch.nn.functional.cross_entropy(logits.float(), target)
        loss.backward()
    return loss.to_local().detach(), h.grad, w.grad


def _check(got, want, off, width):
    (loss, dx, dw), (loss1, dx1, dw1) = got, want
    return (f"loss rel {abs(float(loss) - float(loss1)) / abs(float(loss1)):.1e}, "
            f"grad_hidden rel L2 {_rel(dx, dx1):.1e}, grad_weight rel L2 {_rel(dw, dw1[off:off + width]):.1e}")


def _peak_mib(fn, dev) -> float:
    """The largest rank's peak memory over one call of fn (0 on the CPU)."""
    peak = torch.zeros(1, device=dev)
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        fn()
        peak += torch.cuda.max_memory_allocated() / 2 ** 20
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return float(peak)


def _time(fn, iters, warmup, dev):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        if dev.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end)
        else:  # the --cpu smoke test
            t0 = time.perf_counter()
            fn()
            ms = (time.perf_counter() - t0) * 1e3
        t = torch.tensor([ms], device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's time
        times.append(float(t))
    return statistics.median(times)


def _rel(a, b):
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def main(rank: int, world: int, args) -> None:
    import logitless

    if args.cpu:
        dev = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world)
    else:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world)
        dev = torch.device("cuda", rank)
    N, H, V = args.n, args.h, args.v
    gen = torch.Generator(device=dev).manual_seed(0)  # rank 0's inputs are broadcast below
    dtype = torch.float32 if args.autocast else torch.bfloat16
    hidden = torch.randn(N, H, device=dev, generator=gen).to(dtype)
    weight = (torch.randn(V, H, device=dev, generator=gen) * (2.0 / H ** 0.5)).to(dtype)
    target = torch.randint(0, V, (N,), device=dev, generator=gen)
    for t in (hidden, weight, target):
        dist.broadcast(t, 0)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    per = -(-V // world)
    off, width = min(V, rank * per), max(0, min(V, (rank + 1) * per) - min(V, rank * per))
    shard = weight.detach()[off:off + width].clone().requires_grad_(True)
    group = dist.group.WORLD
    ac = args.autocast
    sharded = dict(process_group=group, chunk_tokens=args.chunk_tokens or None)  # the R-GPU calls' options
    if args.memory_budget_mib:
        sharded["memory_budget"] = args.memory_budget_mib << 20
    lce = logitless.linear_cross_entropy

    # Correctness: R GPUs (and the peer) against one.
    calls = {s: (lambda s=s: _step(lce, hidden, shard, target, ac, schedule=s, **sharded))
             for s in ("gradient_in_forward", "recompute")}
    if args.peers:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(dev.type, (world,))
        calls["torch loss_parallel"] = lambda: _torch_tp_step(hidden, shard, target, mesh, V, ac)
    want = _step(lce, hidden, weight, target, ac)
    rows = [(name, _check(fn(), want, off, width)) for name, fn in calls.items()]
    del want

    flop = 6.0 * N * H * V
    results = []
    for schedule in ("gradient_in_forward", "recompute"):
        one = _time(lambda: _step(lce, hidden, weight, target, ac, schedule=schedule), args.iters, args.warmup, dev)
        results.append((schedule, one, _time(calls[schedule], args.iters, args.warmup, dev)))
    extra = []  # (row name, R-GPU ms, note)
    if ac:  # the same float32 inputs without autocast: float32 products
        f32 = _time(lambda: _step(lce, hidden, shard, target, **sharded), args.iters, args.warmup, dev)
        extra.append(("float32 products", f32, "the same inputs without autocast"))
    if args.peers:
        peer = calls["torch loss_parallel"]
        ms = _time(peer, args.iters, args.warmup, dev)
        extra.append(("torch loss_parallel", ms, f"eager, peak {_peak_mib(peer, dev):.0f} MiB a rank"))
    peak = _peak_mib(calls["gradient_in_forward"], dev)

    if rank == 0:
        name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU (smoke test)"
        inputs = "float32 under autocast(bf16)" if ac else "bf16"
        print(f"linear cross-entropy, N={N} H={H} V={V} {inputs}, fwd+bwd of the mean loss (grad_hidden and "
              f"grad_weight); {world} x {name}; logitless {logitless.__version__}; median of {args.iters}")
        print()
        print(f"{'schedule':<22}{'1 GPU ms':>10}{f'{world} GPUs ms':>12}{'speedup':>9}{'1 GPU TFLOP/s':>15}"
              f"{'per GPU TFLOP/s':>17}")
        for schedule, one, many in results:
            print(f"{schedule:<22}{one:>10.2f}{many:>12.2f}{one / many:>8.2f}x{flop / one / 1e9:>15.0f}"
                  f"{flop / many / world / 1e9:>17.0f}")
        for label, ms, note in extra:
            print(f"{label:<22}{'':>10}{ms:>12.2f}   ({world} GPUs, {note}: "
                  f"{ms / results[0][2]:.2f}x the default's time)")
        print()
        default_one = results[0][1]
        best_many = results[0][2]
        print(f"speedup (default schedule, {world} GPUs vs 1): {default_one / best_many:.2f}x "
              f"(target >= 1.8x on two H200s)")
        print(f"peak memory per rank with {world} GPUs: {peak:.0f} MiB")
        for schedule, check in rows:
            print(f"check {schedule}: {check}")
    dist.barrier()
    dist.destroy_process_group()


def _spawned(rank, world, args):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    main(rank, world, args)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--h", type=int, default=4096)
    ap.add_argument("--v", type=int, default=128256)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--gpus", type=int, default=2, help="GPUs when not launched by torchrun (spawned here)")
    ap.add_argument("--port", type=int, default=29512)
    ap.add_argument("--cpu", action="store_true", help="smoke-test the script on the CPU (gloo; use small shapes)")
    ap.add_argument("--autocast", action="store_true", help="float32 inputs under torch.autocast(bfloat16)")
    ap.add_argument("--chunk-tokens", type=int, default=0, help="chunk_tokens of the R-GPU calls (0: the default)")
    ap.add_argument("--peers", action="store_true", help="also time plain torch tensor parallelism (loss_parallel)")
    ap.add_argument("--memory-budget-mib", type=int, default=0, help="memory_budget of the R-GPU calls (0: default)")
    args = ap.parse_args()
    if "RANK" in os.environ:
        main(int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"]), args)
    else:
        if not args.cpu and torch.cuda.device_count() < args.gpus:
            sys.exit(f"needs {args.gpus} GPUs, found {torch.cuda.device_count()}")
        import torch.multiprocessing as mp

        mp.spawn(_spawned, args=(args.gpus, args), nprocs=args.gpus)
