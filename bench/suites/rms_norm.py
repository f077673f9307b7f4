"""RMSNorm: logitless against its peers, bf16 activations and weight (Llama casting).

Shapes are "NxH" strings (rows x hidden size). The GB/s column counts the minimum traffic in elements of
2 bytes: a forward reads x and writes y (4 bytes an element); the backward reads x, dy and writes dx (6);
fwd+bwd is their sum (10). With the fused residual add the forward also reads the residual and writes
x + residual, and the backward reads the gradient of x + residual: 8 + 8 bytes. The weight, rstd and the dW
partial sums are not counted (under 1% at these shapes). Targets, as ratios to the device copy timed in the
same run (its GB/s count one read and one write): forward >= 94%, fwd+bwd >= 88%.

Every fwd+bwd row gets x from `_Source`, an autograd node whose backward is free, so only the norm's own
backward is timed, with a fresh non-leaf input as a model would hand it over.

Timing on CUDA: every implementation (logitless and its peers alike) is first timed eagerly by
common.run_impls (which also checks its output and measures its peak extra memory), then each call is
captured as a CUDA graph per rotating buffer set (torch.cuda.graph on static inputs, after a warm-up on a side
stream) and the replays are timed instead: at 16384 x 2048 a call is ~40 us of GPU work, and the eager numbers
measured the host's dispatch (autograd, custom-op and Python overhead) more than the kernels. Those rows say
"CUDA graph (eager <ms>)"; where capture fails the eager time stays and the note says so. The copy yardstick is
timed eagerly (one cudaMemcpy per call, no host-side work to hide).

The logitless defaults (src/rms_norm/cuda/plan.cpp, default_variant) depend on the row size and on whether a
residual is fused, as measured by bench/cpp/bench_rms_norm.cu: the forward holds 4 vectors a thread, and
without a residual prefetches its next row in a persistent grid; the backward holds 2 vectors a thread (4 for
rows over 8 KB) and prefetches its next row. The "vpt 8" rows force 8 vectors a thread (the public
vectors_per_thread option) for comparison.
"""
from __future__ import annotations

from typing import List

import torch

from common import Context, Impl, Row, release, run_impls, time_call

QUICK_SHAPES = ["256x1024", "64x4096"]
DEFAULT_SHAPES = ["16384x2048", "16384x4096", "16384x8192"]

DTYPE = torch.bfloat16
EPS = 1e-6


def parse_shape(text: str):
    n, h = text.lower().split("x")
    return int(n), int(h)


class _Source(torch.autograd.Function):
    """Hands `x` on as a non-leaf that requires grad; its backward drops the gradient."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return None


def hf_llama_rms_norm(x, weight):
    # Hugging Face's LlamaRMSNorm forward, the eager baseline models run.
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    return weight * h.to(x.dtype)


def _liger(H, device):
    try:
        from liger_kernel.transformers.rms_norm import LigerRMSNorm
    except Exception as e:  # absent, or present but unusable here
        return None, f"skipped: liger_kernel not importable ({type(e).__name__})"
    return LigerRMSNorm(H, eps=EPS).to(device=device, dtype=DTYPE), None


def _graph_ms(ctx: Context, fn, setup, k: int) -> float:
    """Median ms of a replay of fn(*setup(j)) captured as one CUDA graph per buffer set j < k (the replays
    cycle through them like the eager timing does). Raises when capture fails."""
    side = torch.cuda.Stream(ctx.device)
    side.wait_stream(torch.cuda.current_stream(ctx.device))
    with torch.cuda.stream(side):  # warm-up off the capture: compilation, autotuning, allocator growth
        for j in range(k):
            fn(*setup(j))
    torch.cuda.current_stream(ctx.device).wait_stream(side)
    graphs, keep = [], []
    for j in range(k):
        args = setup(j)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = fn(*args)
        graphs.append(g)
        keep.append((args, out))  # static inputs and outputs live as long as their graph
    ms = time_call(ctx, lambda j: graphs[j].replay(), lambda i: (i % k,))
    del graphs, keep
    return ms


def _retime_with_graphs(ctx: Context, impls, rows: List[Row], k: int) -> None:
    """Replace each timed row's eager time by its CUDA-graph replay time (see the module docstring)."""
    for impl, row in zip(impls, rows):
        if row.ms is None:
            continue
        try:
            ms = _graph_ms(ctx, impl.fn, impl.setup, k)
        except Exception as e:  # a peer that cannot be captured keeps its eager time
            reason = str(e).splitlines()[0][:80] if str(e) else ""
            row.note = "; ".join(n for n in (row.note, f"eager (graph capture failed: {type(e).__name__} {reason})")
                                 if n)
            release(ctx)
            continue
        row.note = "; ".join(n for n in (row.note, f"CUDA graph (eager {row.ms:.3f} ms)") if n)
        if row.gbps is not None and row.ms:
            row.gbps *= row.ms / ms
            row.pct_copy *= row.ms / ms
        row.ms = ms
        release(ctx)


def run(ctx: Context, shapes: List[str]) -> List[Row]:
    import logitless

    rows: List[Row] = []
    for text in shapes:
        N, H = parse_shape(text)
        nbytes = N * H * torch.tensor([], dtype=DTYPE).element_size()
        gen = torch.Generator(device=ctx.device).manual_seed(0)
        k = ctx.rotation(nbytes)
        xs = [torch.randn(N, H, device=ctx.device, dtype=DTYPE, generator=gen) for _ in range(k)]
        res = [torch.randn(N, H, device=ctx.device, dtype=DTYPE, generator=gen) for _ in range(k)]
        dys = [torch.randn(N, H, device=ctx.device, dtype=DTYPE, generator=gen) for _ in range(k)]
        weight = (1 + 0.1 * torch.randn(H, device=ctx.device, generator=gen)).to(DTYPE).requires_grad_(True)
        def checker(want):
            def check(y):
                # bf16 outputs: 2 ulps of rounding (one per side), relative to the element or 1e-2.
                err = ((y.float() - want).abs() / (want.abs() + 1e-2)).max().item()
                return "y ok" if err < 2e-2 else f"Y MISMATCH: max rel err {err:.3g}"

            return check

        check = checker(hf_llama_rms_norm(xs[0], weight.detach()).float())
        check_res = checker(hf_llama_rms_norm(xs[0] + res[0], weight.detach()).float())

        def plain(i):
            return (xs[i % k],)

        def source(i):
            weight.grad = None  # dW is written, not accumulated into an older one
            return (_Source.apply(xs[i % k]), dys[i % k])

        def source_fresh_dy(i):  # for the callers that overwrite dy (Liger's backward writes dx over it)
            weight.grad = None
            return (_Source.apply(xs[i % k]), dys[i % k].clone())

        def source_res(i):
            weight.grad = None
            return (_Source.apply(xs[i % k]), _Source.apply(res[i % k]), dys[i % k])

        def forward_only(fn):
            def step(x):
                with torch.no_grad():
                    return fn(x)

            return step

        def fwd_bwd(fn):
            def step(x, dy):
                y = fn(x)
                y.backward(dy)
                return y.detach()

            return step

        def fwd_bwd_res(fn):
            def step(x, r, dy):
                y, s = fn(x, r)
                torch.autograd.backward([y, s], [dy, dy])
                return y.detach()

            return step

        def backward_setup(fn):
            def setup(i):  # the forward runs here, untimed (before the start event)
                weight.grad = None
                return (fn(_Source.apply(xs[i % k])), dys[i % k])

            return setup

        def backward_only(y, dy):
            y.backward(dy, retain_graph=True)  # keeps rstd alive for a graph replaying this backward

        ln = logitless.rms_norm
        fwd, bwd, both = 2 * nbytes, 3 * nbytes, 5 * nbytes
        impls = [
            Impl("logitless forward", forward_only(lambda x: ln(x, weight, EPS)), plain, fwd, check),
            Impl("logitless forward (vpt 8)", forward_only(lambda x: ln(x, weight, EPS, vectors_per_thread=8)),
                 plain, fwd, check),
            Impl("logitless backward only", backward_only, backward_setup(lambda x: ln(x, weight, EPS)), bwd),
            Impl("logitless fwd+bwd", fwd_bwd(lambda x: ln(x, weight, EPS)), source, both, check),
            Impl("logitless fwd+bwd (vpt 8)", fwd_bwd(lambda x: ln(x, weight, EPS, vectors_per_thread=8)), source,
                 both, check),
            Impl("logitless fwd+bwd +residual",
                 fwd_bwd_res(lambda x, r: ln(x, weight, EPS, residual=r)), source_res, 8 * nbytes, check_res),
            Impl("torch eager forward", forward_only(lambda x: hf_llama_rms_norm(x, weight)), plain, fwd, check),
            Impl("torch eager fwd+bwd", fwd_bwd(lambda x: hf_llama_rms_norm(x, weight)), source, both, check),
        ]
        notes: List[Row] = []
        if ctx.is_cuda:
            compiled = torch.compile(hf_llama_rms_norm, fullgraph=True, dynamic=False)
            impls.append(Impl("torch.compile forward", forward_only(lambda x: compiled(x, weight)), plain, fwd,
                              check))
            impls.append(Impl("torch.compile fwd+bwd", fwd_bwd(lambda x: compiled(x, weight)), source, both,
                              check))
            liger, why = _liger(H, ctx.device)
            if liger is not None:
                with torch.no_grad():
                    liger.weight.copy_(weight)
                impls.append(Impl("Liger forward", forward_only(liger), plain, fwd, check))
                impls.append(Impl("Liger fwd+bwd", fwd_bwd(liger), source_fresh_dy, both, check))
            else:
                notes.append(Row(op="rms_norm", shape="", impl="Liger", note=why))
        shape = f"N={N} H={H} bf16"
        for r in notes:
            r.shape = shape
        timed = run_impls(ctx, op="rms_norm", shape=shape, impls=impls, copy_bytes=nbytes)
        if ctx.is_cuda:
            _retime_with_graphs(ctx, impls, timed, k)
        rows += timed + notes
        xs.clear(), res.clear(), dys.clear()
        release(ctx)
    return rows


if __name__ == "__main__":  # pragma: no cover - run through bench/bench.py
    raise SystemExit("run: python bench/bench.py --ops rms_norm")
