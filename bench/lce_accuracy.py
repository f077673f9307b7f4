"""Accuracy of the linear cross-entropy's loss and gradients against float64 math on the same bf16 values, beside
torch eager in bf16 and the peers that are installed (Liger FLCE, Apple CCE).

    python3 bench/lce_accuracy.py [--shapes 2048x1024x32000,4096x4096x128256]

Per shape (hidden ~ N(0, 1), weight ~ N(0, 4 / H): logits of standard deviation 2; mean loss; bf16 inputs): the
loss's relative error, and grad_hidden's and grad_weight's relative L2 error ||g - g64|| / ||g64||, where g64 is
float64 autograd through torch's own cross-entropy. The issue's bound: loss <= 1e-5, gradients <= 1.5x torch bf16.
The "weight_dtype accumulation" row sums grad_weight over token groups in bf16 (grad_weight_accumulation=
"weight_dtype"); its error grows with the number of groups, which the default 512 MiB budget makes 1 where every
token's gradient fits it (2048 x 1024 x 32000: the same result as the float32 accumulation) and 7 at
8192 x 4096 x 128256 (groups of 1280 tokens).
"""
import argparse

import torch
import torch.nn.functional as F

import logitless


def rel_l2(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def run(fn, hidden, weight):
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    loss = fn(h, w)
    loss.backward()
    return loss.detach().double().item(), h.grad, w.grad


def peers():
    out = []
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
        liger = LigerFusedLinearCrossEntropyLoss()
        out.append(("Liger FLCE", lambda t: (lambda h, w: liger(w, h, t))))
    except Exception as e:  # absent or unusable
        print(f"  (Liger FLCE skipped: {type(e).__name__})")
    try:
        from cut_cross_entropy import linear_cross_entropy as cce
        out.append(("Apple CCE", lambda t: (lambda h, w: cce(h, w, t))))
    except Exception as e:
        print(f"  (Apple CCE skipped: {type(e).__name__})")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="2048x1024x32000,4096x4096x128256")
    args = ap.parse_args()
    others = peers()
    print("| N × H × V | impl | loss rel err | grad_hidden rel L2 | grad_weight rel L2 |")
    print("|---|---|---:|---:|---:|")
    for shape in args.shapes.split(","):
        n, h, v = (int(s) for s in shape.split("x"))
        g = torch.Generator(device="cuda").manual_seed(0)
        hidden = torch.randn(n, h, device="cuda", generator=g).bfloat16()
        weight = (torch.randn(v, h, device="cuda", generator=g) * (2.0 / h ** 0.5)).bfloat16()
        target = torch.randint(0, v, (n,), device="cuda", generator=g)
        ref = run(lambda x, w: F.cross_entropy(x @ w.t(), target), hidden.double(), weight.double())
        impls = [
            ("logitless gradient in forward",
             lambda x, w: logitless.linear_cross_entropy(x, w, target, schedule="gradient_in_forward")),
            ("logitless gradient in forward, weight_dtype accumulation",
             lambda x, w: logitless.linear_cross_entropy(x, w, target, schedule="gradient_in_forward",
                                                         grad_weight_accumulation="weight_dtype")),
            ("logitless recompute", lambda x, w: logitless.linear_cross_entropy(x, w, target, schedule="recompute")),
            ("torch eager bf16", lambda x, w: F.cross_entropy(x @ w.t(), target)),
            ("torch eager bf16, fp32 upcast", lambda x, w: F.cross_entropy((x @ w.t()).float(), target)),
        ] + [(name, make(target)) for name, make in others]
        for name, fn in impls:
            try:
                loss, gh, gw = run(fn, hidden, weight)
                print(f"| {n} × {h} × {v} | {name} | {abs(loss - ref[0]) / abs(ref[0]):.1e} | {rel_l2(gh, ref[1]):.2e} "
                      f"| {rel_l2(gw, ref[2]):.2e} |", flush=True)
            except Exception as e:
                print(f"| {n} × {h} × {v} | {name} | failed: {type(e).__name__} | | |", flush=True)
            torch.cuda.empty_cache()
        del ref
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
