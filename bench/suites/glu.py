"""GLU (SwiGLU, GeGLU): logitless against its peers, bf16 activations.

Shapes are "NxI" strings (tokens x intermediate size; Llama-3-8B: 16384 x 14336). Each shape runs SwiGLU with gate
and up as two tensors and as the two halves of one concatenated [N, 2I] projection (Phi-3's gate_up), and GeGLU
(tanh, Gemma's) with two tensors.

The GB/s column counts the minimum traffic in elements of 2 bytes: a forward reads gate and up and writes y
(3 x N x I elements); the backward reads the incoming gradient, gate and up and writes both gradients (5); fwd+bwd
is their sum (8). Targets, as ratios to the device copy timed in the same run (its GB/s count one read and one
write of an N x I tensor): >= 90% forward and fwd+bwd.

Every fwd+bwd row gets gate and up from `Source`, an autograd node whose backward is free and whose outputs are
non-leaf activations as a model's projections hand them over (so `inplace_backward` may write over them, as it
would in a model), so only the GLU's own backward is timed. Peers that write their gradients over gate and up
(Liger, logitless with inplace_backward) get fresh copies of the inputs from their setup (untimed).

On CUDA every timed row is then re-timed as CUDA-graph replays (suites/rms_norm.py's procedure, which says why);
those rows say "CUDA graph (eager <ms>)".
"""
from __future__ import annotations

from typing import List

import torch
import torch.nn.functional as F

from common import Context, Impl, Row, Source, release, run_impls
from suites.rms_norm import _retime_with_graphs

QUICK_SHAPES = ["256x1024", "64x4096"]
DEFAULT_SHAPES = ["16384x14336"]

DTYPE = torch.bfloat16


def parse_shape(text: str):
    n, i = text.lower().split("x")
    return int(n), int(i)


def torch_swiglu(gate, up):
    # Hugging Face's LlamaMLP: act_fn(gate_proj(x)) * up_proj(x).
    return F.silu(gate) * up


def torch_swiglu_concat(gate_up):
    # Phi-3's MLP: gate, up = gate_up.chunk(2, dim=-1); up * act(gate).
    gate, up = gate_up.chunk(2, dim=-1)
    return up * F.silu(gate)


def torch_geglu(gate, up):
    # Gemma's MLP: gelu_pytorch_tanh(gate) * up.
    return F.gelu(gate, approximate="tanh") * up


def _liger():
    try:
        from liger_kernel.ops.geglu import LigerGELUMulFunction
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    except Exception as e:  # absent, or present but unusable here
        return None, f"skipped: liger_kernel not importable ({type(e).__name__})"
    return (LigerSiLUMulFunction.apply, LigerGELUMulFunction.apply), None


def run(ctx: Context, shapes: List[str]) -> List[Row]:
    import logitless

    rows: List[Row] = []
    for text in shapes:
        N, I = parse_shape(text)
        nbytes = N * I * torch.tensor([], dtype=DTYPE).element_size()
        gen = torch.Generator(device=ctx.device).manual_seed(0)
        k = ctx.rotation(3 * nbytes)
        gates = [2 * torch.randn(N, I, device=ctx.device, dtype=DTYPE, generator=gen) for _ in range(k)]
        ups = [torch.randn(N, I, device=ctx.device, dtype=DTYPE, generator=gen) for _ in range(k)]
        gate_ups = [torch.cat([g, u], dim=-1) for g, u in zip(gates, ups)]
        dys = [torch.randn(N, I, device=ctx.device, dtype=DTYPE, generator=gen) for _ in range(k)]
        anchor = torch.zeros((), device=ctx.device, requires_grad=True)

        def checker(want):
            def check(y):
                # bf16 outputs: an ulp or two (torch rounds the activation before the product, logitless does not).
                err = ((y.float() - want).abs() / (want.abs() + 1e-2)).max().item()
                return "y ok" if err < 2e-2 else f"Y MISMATCH: max rel err {err:.3g}"

            return check

        check_swi = checker(F.silu(gates[0].float()) * ups[0].float())
        check_gel = checker(F.gelu(gates[0].float(), approximate="tanh") * ups[0].float())

        def plain(i):
            return gates[i % k], ups[i % k]

        def plain_concat(i):
            return (gate_ups[i % k],)

        def sources(i, fresh=False):
            g, u = gates[i % k], ups[i % k]
            if fresh:  # for the callers that write their gradients over gate and up
                g, u = g.clone(), u.clone()
            return Source.apply(g, anchor), Source.apply(u, anchor), dys[i % k]

        def sources_fresh(i):
            return sources(i, fresh=True)

        def sources_concat(i, fresh=False):
            gu = gate_ups[i % k].clone() if fresh else gate_ups[i % k]
            return Source.apply(gu, anchor), dys[i % k]

        def sources_concat_fresh(i):
            return sources_concat(i, fresh=True)

        def forward_only(fn):
            def step(*args):
                with torch.no_grad():
                    return fn(*args)

            return step

        def fwd_bwd(fn):
            def step(*args):
                *inputs, dy = args
                y = fn(*inputs)
                y.backward(dy)
                return y.detach()

            return step

        def backward_setup(fn):
            def setup(i):  # the forward runs here, untimed (before the start event)
                g, u, dy = sources(i)
                return fn(g, u), dy

            return setup

        def backward_only(y, dy):
            y.backward(dy, retain_graph=True)  # keeps gate and up saved for a graph replaying this backward

        swi, geg = logitless.swiglu, logitless.geglu
        fwd, both = 3 * nbytes, 8 * nbytes
        impls = [
            Impl("logitless swiglu forward", forward_only(swi), plain, fwd, check_swi),
            Impl("logitless swiglu backward only", backward_only, backward_setup(swi), 5 * nbytes),
            Impl("logitless swiglu fwd+bwd", fwd_bwd(swi), sources, both, check_swi),
            Impl("logitless swiglu fwd+bwd, in place", fwd_bwd(lambda g, u: swi(g, u, inplace_backward=True)),
                 sources_fresh, both, check_swi),
            Impl("logitless swiglu(gate_up) forward", forward_only(swi), plain_concat, fwd, check_swi),
            Impl("logitless swiglu(gate_up) fwd+bwd", fwd_bwd(swi), sources_concat, both, check_swi),
            Impl("logitless swiglu(gate_up) fwd+bwd, in place", fwd_bwd(lambda gu: swi(gu, inplace_backward=True)),
                 sources_concat_fresh, both, check_swi),
            Impl("logitless geglu forward", forward_only(geg), plain, fwd, check_gel),
            Impl("logitless geglu fwd+bwd", fwd_bwd(geg), sources, both, check_gel),
            Impl("torch eager swiglu forward", forward_only(torch_swiglu), plain, fwd, check_swi),
            Impl("torch eager swiglu fwd+bwd", fwd_bwd(torch_swiglu), sources, both, check_swi),
            Impl("torch eager swiglu(gate_up) fwd+bwd", fwd_bwd(torch_swiglu_concat), sources_concat, both,
                 check_swi),
            Impl("torch eager geglu fwd+bwd", fwd_bwd(torch_geglu), sources, both, check_gel),
        ]
        notes: List[Row] = []
        if ctx.is_cuda:
            c_swi = torch.compile(torch_swiglu, fullgraph=True, dynamic=False)
            c_cat = torch.compile(torch_swiglu_concat, fullgraph=True, dynamic=False)
            c_geg = torch.compile(torch_geglu, fullgraph=True, dynamic=False)
            impls += [
                Impl("torch.compile swiglu forward", forward_only(c_swi), plain, fwd, check_swi),
                Impl("torch.compile swiglu fwd+bwd", fwd_bwd(c_swi), sources, both, check_swi),
                Impl("torch.compile swiglu(gate_up) fwd+bwd", fwd_bwd(c_cat), sources_concat, both, check_swi),
                Impl("torch.compile geglu fwd+bwd", fwd_bwd(c_geg), sources, both, check_gel),
            ]
            liger, why = _liger()
            if liger is not None:
                l_swi, l_geg = liger
                impls += [
                    Impl("Liger swiglu forward", forward_only(l_swi), plain, fwd, check_swi),
                    Impl("Liger swiglu fwd+bwd", fwd_bwd(l_swi), sources_fresh, both, check_swi),
                    Impl("Liger geglu forward", forward_only(l_geg), plain, fwd, check_gel),
                    Impl("Liger geglu fwd+bwd", fwd_bwd(l_geg), sources_fresh, both, check_gel),
                ]
            else:
                notes.append(Row(op="glu", shape="", impl="Liger", note=why))
        shape = f"N={N} I={I} bf16"
        for r in notes:
            r.shape = shape
        timed = run_impls(ctx, op="glu", shape=shape, impls=impls, copy_bytes=nbytes)
        if ctx.is_cuda:
            _retime_with_graphs(ctx, impls, timed, k)
        rows += timed + notes
        gates.clear(), ups.clear(), gate_ups.clear(), dys.clear()
        release(ctx)
    return rows


if __name__ == "__main__":  # pragma: no cover - run through bench/bench.py
    raise SystemExit("run: python bench/bench.py --ops glu")
