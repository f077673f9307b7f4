"""logitless's own fwd+bwd time (median of 8 after 2 warm-ups, CUDA events) at the linear cross-entropy, linear
policy-loss and cross-entropy shapes, for whichever build is on PYTHONPATH. Run it alternately with two builds on
one machine to compare them (before and after a restructuring); it prints one JSON line of milliseconds.

    PYTHONPATH=build/old/python python3 bench/own_fwd_bwd.py; PYTHONPATH=build/new/python python3 bench/own_fwd_bwd.py
"""
import json

import torch

import logitless

DEV, BF16 = "cuda", torch.bfloat16


def median_ms(fn, iters=8):
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def leaf(*shape, scale=1.0):
    return (torch.randn(*shape, device=DEV, dtype=BF16) * scale).requires_grad_()


def main():
    torch.manual_seed(0)
    out = {}
    for n, h, v in ((8192, 4096, 128256), (16384, 2048, 128256)):
        x, w, y = leaf(n, h), leaf(v, h, scale=0.02), torch.randint(0, v, (n,), device=DEV)

        def lce():
            x.grad = w.grad = None
            logitless.linear_cross_entropy(x, w, y).backward()

        out[f"lce {n}x{h}x{v}"] = median_ms(lce)
        del x, w
    b, length, h, v = 8, 1024, 4096, 150000
    x, w = leaf(b, length + 1, h), leaf(v, h, scale=0.02)
    ids, adv = torch.randint(0, v, (b, length), device=DEV), torch.randn(b, device=DEV)

    def grpo():
        x.grad = w.grad = None
        logitless.linear_grpo_loss(x, w, ids, adv, beta=0.0).backward()

    out[f"linear_grpo {b}x{length}x{h}x{v}"] = median_ms(grpo)
    del x, w
    logits, target = leaf(16384, 128256), torch.randint(0, 128256, (16384,), device=DEV)

    def ce():
        logits.grad = None
        logitless.cross_entropy(logits, target).backward()

    out["ce 16384x128256"] = median_ms(ce)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
