"""Rotary embedding of q and k: logitless against its peers, bf16.

Shapes are "BxTxHqxHkxD" strings (batch, sequence, query heads, key/value heads, head dim; Llama-3-8B at 16384
tokens: 8x2048x32x8x128). q and k are what a model hands over: the [B, T, H, D] projections seen as [B, H, T, D]
(transposed views); cos and sin are [1, T, D] in bf16, as Hugging Face's rotary module returns them for
position_ids [1, T].

The GB/s column counts the minimum traffic: a forward reads q and k and writes their rotations (2 x B x T x
(Hq + Hk) x D elements of 2 bytes) and reads cos and sin once (2 x T x D); the backward moves the same for the
gradients; fwd+bwd is their sum. Targets, as ratios to the device copy of q and k timed in the same run (its GB/s
count one read and one write): >= 90% forward and fwd+bwd.

Every fwd+bwd row gets q and k from `Source`, an autograd node whose backward is free (non-leaf activations, so
the in-place rotation is allowed as in a model), so only the rotation's own backward is timed. Peers that rotate in
the inputs' storage (Liger, logitless with inplace=True) get fresh copies from their setup (untimed).

On CUDA every timed row is then re-timed as CUDA-graph replays (suites/rms_norm.py's procedure, which says why);
those rows say "CUDA graph (eager <ms>)".
"""
from __future__ import annotations

from typing import List

import torch

from common import Context, Impl, Row, Source, release, run_impls
from suites.rms_norm import _retime_with_graphs

QUICK_SHAPES = ["2x64x8x2x64", "1x128x4x4x128"]
DEFAULT_SHAPES = ["8x2048x32x8x128"]

DTYPE = torch.bfloat16


def parse_shape(text: str):
    b, t, hq, hk, d = (int(v) for v in text.lower().split("x"))
    return b, t, hq, hk, d


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def hf_apply_rotary_pos_emb(q, k, cos, sin):
    # Hugging Face's apply_rotary_pos_emb (unsqueeze_dim=1), the eager baseline models run.
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def _liger():
    try:
        from liger_kernel.ops.rope import LigerRopeFunction
    except Exception as e:  # absent, or present but unusable here
        return None, f"skipped: liger_kernel not importable ({type(e).__name__})"
    return LigerRopeFunction.apply, None


def cos_sin(T, D, device):
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, D, 2, device=device, dtype=torch.float32) / D))
    freqs = torch.arange(T, device=device, dtype=torch.float32)[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)[None]
    return emb.cos().to(DTYPE), emb.sin().to(DTYPE)


def run(ctx: Context, shapes: List[str]) -> List[Row]:
    import logitless

    rows: List[Row] = []
    for text in shapes:
        B, T, Hq, Hk, D = parse_shape(text)
        es = torch.tensor([], dtype=DTYPE).element_size()
        qk_bytes = B * T * (Hq + Hk) * D * es
        table_bytes = 2 * T * D * es
        gen = torch.Generator(device=ctx.device).manual_seed(0)
        k = ctx.rotation(2 * qk_bytes)

        def buffers():
            return [(torch.randn(B, T, Hq, D, device=ctx.device, dtype=DTYPE, generator=gen),
                     torch.randn(B, T, Hk, D, device=ctx.device, dtype=DTYPE, generator=gen)) for _ in range(k)]

        qks, grads = buffers(), buffers()
        cos, sin = cos_sin(T, D, ctx.device)
        anchor = torch.zeros((), device=ctx.device, requires_grad=True)
        want_q, want_k = hf_apply_rotary_pos_emb(qks[0][0].transpose(1, 2).float(), qks[0][1].transpose(1, 2).float(),
                                                 cos.float(), sin.float())

        def check(out):
            # Relative to the largest element: the two products cancel where an output is small, and torch rounds
            # each product and their sum to bf16.
            q_rot, k_rot = out
            err = max(((a.float() - w).abs().max() / w.abs().max()).item()
                      for a, w in ((q_rot, want_q), (k_rot, want_k)))
            return "q, k ok" if err < 1e-2 else f"MISMATCH: max err {err:.3g} of the largest element"

        def views(i, fresh=False, source=False):
            q, kk = qks[i % k]
            if fresh:  # for the callers that rotate in the inputs' storage
                q, kk = q.clone(), kk.clone()
            if source:
                q, kk = Source.apply(q, anchor), Source.apply(kk, anchor)
            return q.transpose(1, 2), kk.transpose(1, 2)

        def plain(i):
            return views(i)

        def plain_fresh(i):
            return views(i, fresh=True)

        def sources(i, fresh=False):
            dq, dk = grads[i % k]
            return (*views(i, fresh=fresh, source=True), dq.transpose(1, 2), dk.transpose(1, 2))

        def sources_fresh(i):
            return sources(i, fresh=True)

        def forward_only(fn):
            def step(q, kk):
                with torch.no_grad():
                    return fn(q, kk)

            return step

        def fwd_bwd(fn):
            def step(q, kk, dq, dk):
                q_rot, k_rot = fn(q, kk)
                torch.autograd.backward([q_rot, k_rot], [dq, dk])
                return q_rot.detach(), k_rot.detach()

            return step

        def backward_setup(i):  # the forward runs here, untimed (before the start event)
            q, kk, dq, dk = sources(i)
            return logitless.rope(q, kk, cos, sin), dq, dk

        def backward_only(out, dq, dk):
            torch.autograd.backward(list(out), [dq, dk], retain_graph=True)

        def ours(q, kk):
            return logitless.rope(q, kk, cos, sin)

        def ours_inplace(q, kk):
            return logitless.rope(q, kk, cos, sin, inplace=True)

        def hf(q, kk):
            return hf_apply_rotary_pos_emb(q, kk, cos, sin)

        one = 2 * qk_bytes + table_bytes
        impls = [
            Impl("logitless forward", forward_only(ours), plain, one, check),
            Impl("logitless forward, in place", forward_only(ours_inplace), plain_fresh, one, check),
            Impl("logitless backward only", backward_only, backward_setup, one),
            Impl("logitless fwd+bwd", fwd_bwd(ours), sources, 2 * one, check),
            Impl("logitless fwd+bwd, in place", fwd_bwd(ours_inplace), sources_fresh, 2 * one, check),
            Impl("torch eager forward", forward_only(hf), plain, one, check),
            Impl("torch eager fwd+bwd", fwd_bwd(hf), sources, 2 * one, check),
        ]
        notes: List[Row] = []
        if ctx.is_cuda:
            compiled = torch.compile(hf_apply_rotary_pos_emb, fullgraph=True, dynamic=False)

            def hf_compiled(q, kk):
                return compiled(q, kk, cos, sin)

            impls.append(Impl("torch.compile forward", forward_only(hf_compiled), plain, one, check))
            impls.append(Impl("torch.compile fwd+bwd", fwd_bwd(hf_compiled), sources, 2 * one, check))
            liger, why = _liger()
            if liger is not None:
                def lig(q, kk):
                    return liger(q, kk, cos, sin)

                impls.append(Impl("Liger forward", forward_only(lig), plain_fresh, one, check))
                impls.append(Impl("Liger fwd+bwd", fwd_bwd(lig), sources_fresh, 2 * one, check))
            else:
                notes.append(Row(op="rope", shape="", impl="Liger", note=why))
        shape = f"B={B} T={T} Hq={Hq} Hk={Hk} D={D} bf16"
        for r in notes:
            r.shape = shape
        timed = run_impls(ctx, op="rope", shape=shape, impls=impls, copy_bytes=qk_bytes)
        if ctx.is_cuda:
            _retime_with_graphs(ctx, impls, timed, k)
        rows += timed + notes
        qks.clear(), grads.clear()
        release(ctx)
    return rows


if __name__ == "__main__":  # pragma: no cover - run through bench/bench.py
    raise SystemExit("run: python bench/bench.py --ops rope")
