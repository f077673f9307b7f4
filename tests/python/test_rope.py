"""logitless.rope against a float64 torch reference in Hugging Face's convention (apply_rotary_pos_emb, written
here so `transformers` is not needed), torch.library.opcheck, torch.compile, gradcheck, the in-place forward, and
CUDA (graphs, the CPU backend as the reference).

CPU tests run everywhere (the CPU backend is a real backend); CUDA tests skip without a GPU.
Run: PYTHONPATH=build/<dir>/python python -m pytest tests/python/test_rope.py -q
"""
import math

import pytest
import torch

from _helpers import DTYPES, capture_cuda_graph, needs_cuda, on_a_side_stream_behind_a_sleep
from logitless import rope

# One rounding of a float32 (or double) result, relative to the element, with a floor relative to the tensor's
# largest element for outputs where the two products cancel.
TOL = {torch.float32: (1e-5, 1e-6), torch.float16: (1e-3, 1e-5), torch.bfloat16: (8e-3, 1e-4),
       torch.float64: (1e-12, 1e-14)}


# ----------------------------------------------------------------------------------------------------
# Hugging Face's convention


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def hf_apply_rotary(q, k, cos, sin):
    """apply_rotary_pos_emb with partial rotary (the pass-through channels after the rotated ones)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    dr = cos.shape[-1]

    def one(x):
        xr, xp = x[..., :dr], x[..., dr:]
        return torch.cat((xr * cos + rotate_half(xr) * sin, xp), dim=-1)

    return one(q), (None if k is None else one(k))


def llama3_inv_freq(dim, base=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, old_context=8192):
    """Llama-3's scaled inverse frequencies (the rope_type "llama3" of Hugging Face's rotary module)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    low_wavelen, high_wavelen = old_context / low_freq_factor, old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def cos_sin(position_ids, dim, dtype, llama3=False):
    """What LlamaRotaryEmbedding returns for position_ids [B, T]: cos, sin [B, T, dim] in `dtype`."""
    inv_freq = llama3_inv_freq(dim) if llama3 else 1.0 / (10000.0 ** (torch.arange(0, dim, 2).double() / dim))
    freqs = position_ids.double()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def make_qk(B, Hq, Hk, T, D, dtype, layout="bhtd", device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)

    def one(H):
        if layout == "bthd":  # the projection's [B, T, H, D], seen as [B, H, T, D]
            return torch.randn(B, T, H, D, generator=gen).to(dtype).to(device).transpose(1, 2)
        return torch.randn(B, H, T, D, generator=gen).to(dtype).to(device)

    return one(Hq), (one(Hk) if Hk else None)


def assert_close(got, want, dtype, what):
    rtol, atol = TOL[dtype]
    scale = max(want.abs().max().item(), 1.0) if want.numel() else 1.0
    torch.testing.assert_close(got.double().cpu(), want.double().cpu(), rtol=rtol, atol=atol * scale,
                               msg=lambda m: f"{what}: {m}")


def run(fn, q, k, gq, gk):
    """fn(q, k) and the gradients of sum(q_rot * gq) + sum(k_rot * gk)."""
    qa = q.detach().clone().requires_grad_(True)
    ka = None if k is None else k.detach().clone().requires_grad_(True)
    qr, kr = fn(qa, ka)
    loss = (qr.double() * gq.double()).sum() + (0 if k is None else (kr.double() * gk.double()).sum())
    loss.backward()
    return qr.detach(), (None if k is None else kr.detach()), qa.grad, (None if k is None else ka.grad)


def check(q, k, cos, sin, position_ids=None, ref_cos=None, ref_sin=None, **kw):
    """logitless.rope against the float64 reference (ref_cos/ref_sin: the [B, T, Dr] values, when cos/sin are
    tables)."""
    gen = torch.Generator().manual_seed(7)
    gq = torch.randn(q.shape, generator=gen).to(q.dtype).to(q.device)
    gk = None if k is None else torch.randn(k.shape, generator=gen).to(q.dtype).to(q.device)
    got = run(lambda a, b: rope(a, b, cos, sin, position_ids, **kw), q, k, gq, gk)
    rc = (cos if ref_cos is None else ref_cos).double().cpu()
    rs = (sin if ref_sin is None else ref_sin).double().cpu()
    # The reference takes [B or 1, T, Dr]: [T, Dr] and the unsqueezed [B, 1, T, Dr] are the same values.
    rc, rs = ((t[None] if t.dim() == 2 else t.squeeze(1) if t.dim() == 4 else t) for t in (rc, rs))
    want = run(lambda a, b: hf_apply_rotary(a, b, rc, rs), q.double().cpu(), None if k is None else k.double().cpu(),
               gq.cpu(), None if gk is None else gk.cpu())
    for a, b, what in zip(got, want, ("q_rot", "k_rot", "grad_q", "grad_k")):
        if b is None:
            assert a is None, what
            continue
        assert a.shape == b.shape and a.dtype == q.dtype, what
        assert_close(a, b, q.dtype, what)
    return got


# ----------------------------------------------------------------------------------------------------
# Against the reference


@pytest.mark.parametrize("cs_f32", [False, True], ids=["cs_same", "cs_f32"])
@pytest.mark.parametrize("partial", [False, True], ids=["full", "partial"])
@pytest.mark.parametrize("layout", ["bhtd", "bthd"])
@pytest.mark.parametrize("dtype", DTYPES + [torch.float64], ids=str)
def test_matches_reference(dtype, layout, partial, cs_f32):
    B, Hq, Hk, T, D = 2, 4, 2, 7, 64
    dr = D // 2 if partial else D
    q, k = make_qk(B, Hq, Hk, T, D, dtype, layout)
    pos = torch.arange(T).expand(B, T) + torch.tensor([[0], [5]])
    cos, sin = cos_sin(pos, dr, torch.float32 if cs_f32 else dtype)
    check(q, k, cos, sin)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_llama3_scaling_and_broadcast_batch(dtype):
    q, k = make_qk(3, 8, 2, 33, 128, dtype, "bthd")
    cos, sin = cos_sin(torch.arange(1000, 1033)[None], 128, dtype, llama3=True)  # [1, T, D]: every sequence
    check(q, k, cos, sin)
    check(q, k, cos[0], sin[0])  # [T, D]
    check(q, k, cos[:, None], sin[:, None])  # [B, 1, T, D], as apply_rotary_pos_emb unsqueezes it


@pytest.mark.parametrize("pos_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("pos_batch", [1, 2])
def test_position_ids_index_tables(pos_batch, pos_dtype):
    B, T, D, P = 2, 9, 32, 40
    q, k = make_qk(B, 3, 1, T, D, torch.bfloat16)
    table_cos, table_sin = cos_sin(torch.arange(P)[None], D, torch.float32)
    table_cos, table_sin = table_cos[0], table_sin[0]  # [P, D]
    gen = torch.Generator().manual_seed(3)
    pos = torch.randint(0, P, (pos_batch, T), generator=gen).to(pos_dtype)
    full = pos.long().expand(B, T)
    check(q, k, table_cos, table_sin, pos, ref_cos=table_cos[full], ref_sin=table_sin[full])
    first = pos[0].long().expand(B, T)
    check(q, k, table_cos, table_sin, pos[0], ref_cos=table_cos[first], ref_sin=table_sin[first])  # [T]


@pytest.mark.parametrize("shape", [(0, 2, 1, 5, 8), (1, 1, 0, 1, 2), (2, 3, 5, 0, 16), (1, 2, 1, 3, 6),
                                   (3, 1, 1, 4, 10)], ids=lambda s: "x".join(map(str, s)))
def test_shapes(shape):
    B, Hq, Hk, T, D = shape
    q, k = make_qk(B, Hq, Hk, T, D, torch.float32)
    cos, sin = cos_sin(torch.arange(T)[None], D - 2 if D > 2 else D, torch.float32)
    check(q, k, cos, sin)


def test_general_cos_sin_halves_use_the_transpose():
    # cos and sin whose two halves differ (not what a rotary module makes): the backward is the transpose of the
    # forward's linear map, not the rotation by -sin.
    q, k = make_qk(2, 2, 1, 5, 16, torch.float64)
    gen = torch.Generator().manual_seed(1)
    cos, sin = torch.randn(2, 5, 16, generator=gen).double(), torch.randn(2, 5, 16, generator=gen).double()
    check(q, k, cos, sin)
    qa = q.clone().requires_grad_(True)
    torch.autograd.gradcheck(lambda a: rope(a, None, cos, sin)[0], (qa,))


def test_strided_q_from_a_fused_qkv_projection():
    B, T, Hq, Hk, D = 2, 6, 4, 2, 32
    qkv = torch.randn(B, T, (Hq + 2 * Hk) * D).to(torch.bfloat16)
    q = qkv[..., : Hq * D].view(B, T, Hq, D).transpose(1, 2)
    k = qkv[..., Hq * D: (Hq + Hk) * D].view(B, T, Hk, D).transpose(1, 2)
    cos, sin = cos_sin(torch.arange(T)[None], D, torch.bfloat16)
    check(q, k, cos, sin)


def test_output_keeps_the_input_layout():
    q, k = make_qk(2, 4, 2, 5, 16, torch.float32, "bthd")
    cos, sin = cos_sin(torch.arange(5)[None], 16, torch.float32)
    qr, kr = rope(q, k, cos, sin)
    assert qr.stride() == q.stride() and kr.stride() == k.stride()


def test_k_none():
    q, _ = make_qk(2, 3, 0, 5, 16, torch.float32)
    cos, sin = cos_sin(torch.arange(5)[None], 16, torch.float32)
    got = check(q, None, cos, sin)
    assert got[1] is None


# ----------------------------------------------------------------------------------------------------
# Autograd


@pytest.mark.parametrize("partial", [False, True], ids=["full", "partial"])
@pytest.mark.parametrize("with_positions", [False, True], ids=["cos_bt", "positions"])
def test_gradcheck_and_gradgradcheck_float64(with_positions, partial):
    q, k = make_qk(2, 2, 1, 4, 8, torch.float64, "bthd")
    dr = 4 if partial else 8
    if with_positions:
        table = cos_sin(torch.arange(10)[None], dr, torch.float64)
        cos, sin = table[0][0], table[1][0]
        pos = torch.tensor([[3, 1, 4, 1], [5, 9, 2, 6]])
    else:
        cos, sin = cos_sin(torch.arange(4).expand(2, 4) + torch.tensor([[0], [2]]), dr, torch.float64)
        pos = None
    args = (q.detach().clone().requires_grad_(True), k.detach().clone().requires_grad_(True))
    f = lambda a, b: rope(a, b, cos, sin, pos)  # noqa: E731
    torch.autograd.gradcheck(f, args)
    torch.autograd.gradgradcheck(f, args)


def test_gradient_of_one_output_only():
    q, k = make_qk(1, 2, 2, 3, 8, torch.float64)
    cos, sin = cos_sin(torch.arange(3)[None], 8, torch.float64)
    for use in (0, 1):
        qa, ka = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
        rope(qa, ka, cos, sin)[use].sum().backward()
        x = (q, k)[use].clone().requires_grad_(True)
        hf_apply_rotary(x, None, cos, sin)[0].sum().backward()
        torch.testing.assert_close((qa.grad, ka.grad)[use], x.grad)
        assert (qa.grad, ka.grad)[1 - use] is None


def test_cos_sin_requiring_grad_raise():
    q, k = make_qk(1, 2, 1, 3, 8, torch.float32)
    cos, sin = cos_sin(torch.arange(3)[None], 8, torch.float32)
    with pytest.raises(ValueError, match="cos: expected a tensor that does not require grad"):
        rope(q, k, cos.requires_grad_(True), sin)
    with torch.no_grad():
        rope(q, k, cos, sin)  # nothing is differentiated: fine


def test_eager_path_and_custom_op_path_agree_bitwise():
    q, k = make_qk(2, 4, 2, 5, 32, torch.bfloat16, "bthd")
    cos, sin = cos_sin(torch.arange(5)[None], 16, torch.float32)
    gq, gk = torch.randn(q.shape).to(q.dtype), torch.randn(k.shape).to(k.dtype)
    a = run(lambda x, y: rope(x, y, cos, sin), q, k, gq, gk)
    b = run(lambda x, y: torch.ops.logitless.rope(x, y, cos, sin, None, False, 0), q, k, gq, gk)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


# ----------------------------------------------------------------------------------------------------
# In place


def test_inplace_rotates_q_and_k_in_their_storage():
    q, k = make_qk(2, 4, 2, 5, 32, torch.float32, "bthd")
    cos, sin = cos_sin(torch.arange(5)[None], 32, torch.float32)
    want = rope(q, k, cos, sin)
    qa, ka = q.clone(), k.clone()
    pq, pk = qa.data_ptr(), ka.data_ptr()
    out = rope(qa, ka, cos, sin, inplace=True)
    assert out[0] is qa and out[1] is ka and qa.data_ptr() == pq and ka.data_ptr() == pk
    torch.testing.assert_close(qa, want[0], rtol=0, atol=0)
    torch.testing.assert_close(ka, want[1], rtol=0, atol=0)


def test_inplace_under_autograd_matches_out_of_place():
    B, T, H, D = 2, 5, 4, 16
    x = torch.randn(B, T, 16)
    w = torch.randn(H * D + 2 * D, 16) * 0.3
    cos, sin = cos_sin(torch.arange(T)[None], D, torch.float32)
    grads = []
    for inplace in (False, True):
        xa, wa = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        qkv = xa @ wa.t()
        q = qkv[..., : H * D].view(B, T, H, D).transpose(1, 2)
        k = qkv[..., H * D:].view(B, T, 2, D).transpose(1, 2)
        qr, kr = rope(q, k, cos, sin, inplace=inplace)
        if inplace:
            assert qr is q and kr is k
        (qr.pow(2).sum() + (kr * 3).sum()).backward()
        grads.append((xa.grad, wa.grad))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_inplace_is_declared_to_autograd():
    q, k = make_qk(1, 2, 1, 3, 8, torch.float32)
    cos, sin = cos_sin(torch.arange(3)[None], 8, torch.float32)
    # On a leaf that requires grad, torch's own rule: an error.
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        rope(q.clone().requires_grad_(True), k, cos, sin, inplace=True)
    # A node that saved q before it was rotated raises instead of using the rotated values.
    qa = q.clone().requires_grad_(True)
    qn = qa * 1
    other = qn.pow(2).sum()
    v0 = qn._version
    rope(qn, None, cos, sin, inplace=True)
    assert qn._version > v0
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        other.backward()


# ----------------------------------------------------------------------------------------------------
# Errors


def test_bad_arguments_raise_value_error_naming_them():
    q, k = make_qk(2, 2, 1, 3, 8, torch.float32)
    cos, sin = cos_sin(torch.arange(3)[None], 8, torch.float32)
    with pytest.raises(ValueError, match="cos: expected a last dimension .* even"):
        rope(q, k, cos[..., :7], sin[..., :7])
    with pytest.raises(ValueError, match="cos: expected a last dimension"):
        rope(q, k, torch.cat([cos, cos], -1), torch.cat([sin, sin], -1))
    with pytest.raises(ValueError, match="k: expected shape"):
        rope(q, k[..., :4], cos, sin)
    with pytest.raises(ValueError, match="k: expected dtype float32"):
        rope(q, k.double(), cos, sin)
    with pytest.raises(ValueError, match="cos: expected dtype float32"):
        rope(q, k, cos.double(), sin.double())
    with pytest.raises(ValueError, match="sin: expected dtype"):
        rope(q.half(), k.half(), cos, sin.half())
    with pytest.raises(ValueError, match="q: expected 4 dimensions"):
        rope(q[0], None, cos, sin)
    with pytest.raises(ValueError, match="cos: expected shape"):
        rope(q, k, cos[:, :2], sin[:, :2])
    table = cos_sin(torch.arange(4)[None], 8, torch.float32)
    with pytest.raises(ValueError, match=r"position_ids: expected values in \[0, 4\)"):
        rope(q, k, table[0][0], table[1][0], torch.tensor([[0, 1, 4], [0, 1, 2]]))
    with pytest.raises(ValueError, match="position_ids: expected shape"):
        rope(q, k, table[0][0], table[1][0], torch.tensor([[0, 1], [0, 1]]))
    with pytest.raises(ValueError, match="cos: expected shape \\[P, Dr\\]"):
        rope(q, k, cos, sin, torch.tensor([[0, 1, 2]]))
    with pytest.raises(ValueError, match="algo: expected"):
        rope(q, k, cos, sin, algo="fast")
    with pytest.raises(ValueError, match="q_out: expected memory that does not overlap k"):
        rope(q, q, cos, sin, inplace=True)


# ----------------------------------------------------------------------------------------------------
# torch.library and torch.compile


def _op_samples(device):
    q, k = make_qk(2, 4, 2, 5, 16, torch.float32, "bthd", device=device)
    cos, sin = cos_sin(torch.arange(5)[None], 8, torch.float32)
    table = cos_sin(torch.arange(12)[None], 16, torch.bfloat16)
    qb, kb = make_qk(2, 2, 1, 5, 16, torch.bfloat16, device=device)
    pos = torch.tensor([[0, 3, 5, 7, 11], [1, 1, 2, 2, 3]], device=device)
    return [
        (torch.ops.logitless.rope.default, (q.detach().requires_grad_(True), k.detach().requires_grad_(True),
                                            cos.to(device), sin.to(device), None, False, 0)),
        (torch.ops.logitless.rope.default, (qb.requires_grad_(True), None, table[0][0].to(device),
                                            table[1][0].to(device), pos, True, 0)),
        (torch.ops.logitless.rope.default, (qb.detach(), kb, table[0][0].to(device), table[1][0].to(device), pos,
                                            False, 0)),
    ]


def test_opcheck():
    for op, args in _op_samples("cpu"):
        torch.library.opcheck(op, args)


@pytest.mark.parametrize("inplace", [False, True])
def test_compile_fullgraph_matches_eager(inplace):
    torch._dynamo.reset()
    B, T, H, D = 2, 5, 4, 32
    x = torch.randn(B, T, 16)
    w = torch.randn(H * D + 2 * D, 16) * 0.3
    cos, sin = cos_sin(torch.arange(T)[None], 16, torch.float32)

    def attn_in(x, w):
        qkv = x @ w.t()
        q = qkv[..., : H * D].view(B, T, H, D).transpose(1, 2)
        k = qkv[..., H * D:].view(B, T, 2, D).transpose(1, 2)
        qr, kr = rope(q, k, cos, sin, inplace=inplace)
        return qr.pow(2).sum() + (kr * 3).sum()

    results = []
    for fn in (attn_in, torch.compile(attn_in, fullgraph=True)):
        xa, wa = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        loss = fn(xa, wa)
        loss.backward()
        results.append((loss.detach(), xa.grad, wa.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_compile_bit_exact_alone_and_dynamic():
    torch._dynamo.reset()
    q, k = make_qk(2, 4, 2, 5, 32, torch.bfloat16, "bthd")
    cos, sin = cos_sin(torch.arange(5)[None], 32, torch.bfloat16)
    gq, gk = torch.randn(q.shape).to(q.dtype), torch.randn(k.shape).to(k.dtype)
    f = lambda a, b: rope(a, b, cos, sin)  # noqa: E731
    for a, b in zip(run(f, q, k, gq, gk), run(torch.compile(f, fullgraph=True), q, k, gq, gk)):
        assert torch.equal(a, b)
    torch._dynamo.reset()
    g = torch.compile(lambda a, b, c, s: rope(a, b, c, s), fullgraph=True, dynamic=True)
    for T in (3, 7):
        q, k = make_qk(1, 2, 1, T, 16, torch.float32)
        cos, sin = cos_sin(torch.arange(T)[None], 16, torch.float32)
        for a, b in zip(g(q, k, cos, sin), rope(q, k, cos, sin)):
            assert torch.equal(a, b)


# ----------------------------------------------------------------------------------------------------
# CUDA


@needs_cuda
@pytest.mark.parametrize("algo", ["auto", "vector", "scalar"])
@pytest.mark.parametrize("cs_f32", [False, True], ids=["cs_same", "cs_f32"])
@pytest.mark.parametrize("rot", ["full", "half", "quarter"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("D", [64, 128, 80])
def test_cuda_matches_reference(D, dtype, rot, cs_f32, algo):
    dr = {"full": D, "half": D // 2, "quarter": D // 4}[rot]
    es = torch.tensor([], dtype=dtype).element_size()
    if algo == "vector" and ((dr // 2) * es % 16 or D * es % 16):
        pytest.skip("a layout the vector kernel does not take")
    q, k = make_qk(2, 32, 8, 37, D, dtype, "bthd", device="cuda")
    pos = torch.arange(37).expand(2, 37) + torch.tensor([[0], [100]])
    cos, sin = cos_sin(pos, dr, torch.float32 if cs_f32 else dtype, llama3=True)
    check(q, k, cos.cuda(), sin.cuda(), algo=algo)
    table = cos_sin(torch.arange(200)[None], dr, torch.float32 if cs_f32 else dtype)
    tc, ts = table[0][0].cuda(), table[1][0].cuda()
    check(q, k, tc, ts, pos.cuda(), ref_cos=tc[pos.cuda()], ref_sin=ts[pos.cuda()], algo=algo)


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_matches_cpu_backend_and_inplace(dtype):
    q, k = make_qk(4, 32, 8, 257, 128, dtype, "bthd")
    cos, sin = cos_sin(torch.arange(257).expand(4, 257), 128, dtype, llama3=True)
    cpu = rope(q, k, cos, sin)
    gpu = rope(q.cuda(), k.cuda(), cos.cuda(), sin.cuda())
    qc, kc = q.cuda().clone(), k.cuda().clone()
    rope(qc, kc, cos.cuda(), sin.cuda(), inplace=True)
    rtol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    for a, b in zip(gpu, cpu):
        torch.testing.assert_close(a.cpu().float(), b.float(), rtol=rtol, atol=1e-5)
    assert torch.equal(qc, gpu[0]) and torch.equal(kc, gpu[1])


@needs_cuda
def test_cuda_out_of_range_positions_give_nan_not_a_fault():
    q, k = make_qk(1, 2, 1, 4, 16, torch.float32, device="cuda")
    table = cos_sin(torch.arange(4)[None], 8, torch.float32)
    pos = torch.tensor([[0, 1, 7, -1]], device="cuda")
    qr, kr = rope(q, k, table[0][0].cuda(), table[1][0].cuda(), pos)
    torch.cuda.synchronize()
    assert torch.isfinite(qr[:, :, :2]).all() and torch.isnan(qr[:, :, 2:, :8]).all()
    assert torch.equal(qr[:, :, :, 8:], q[:, :, :, 8:])


@needs_cuda
def test_cuda_runs_on_the_current_stream():
    q, k = make_qk(2, 32, 8, 256, 128, torch.bfloat16, "bthd", device="cuda")
    cos, sin = cos_sin(torch.arange(256)[None], 128, torch.bfloat16)
    cos, sin = cos.cuda(), sin.cuda()
    want = rope(q, k, cos, sin)
    got = on_a_side_stream_behind_a_sleep(lambda: rope(q + 0, k + 0, cos, sin))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@needs_cuda
@pytest.mark.parametrize("inplace", [False, True])
def test_cuda_graph_capture(inplace):
    B, T, H, D = 2, 64, 8, 128
    x = torch.randn(B, T, 256, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn((H + 2) * D, 256, device="cuda") * 0.05).to(torch.bfloat16)
    cos, sin = cos_sin(torch.arange(T)[None], D, torch.bfloat16)
    cos, sin = cos.cuda(), sin.cuda()
    leaves = [x.clone().requires_grad_(True), w.clone().requires_grad_(True)]

    def step():
        qkv = leaves[0] @ leaves[1].t()
        q = qkv[..., : H * D].view(B, T, H, D).transpose(1, 2)
        k = qkv[..., H * D:].view(B, T, 2, D).transpose(1, 2)
        qr, kr = rope(q, k, cos, sin, inplace=inplace)
        loss = qr.float().pow(2).sum() + kr.float().sum()
        loss.backward()
        return loss.detach()

    graph, loss_graph = capture_cuda_graph(step, leaves)
    graph.replay()
    torch.cuda.synchronize()
    got = [loss_graph.clone()] + [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    want = [step()] + [t.grad for t in leaves]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@needs_cuda
def test_cuda_compile_and_opcheck():
    torch._dynamo.reset()
    q, k = make_qk(2, 8, 2, 33, 128, torch.bfloat16, "bthd", device="cuda")
    cos, sin = cos_sin(torch.arange(33)[None], 128, torch.bfloat16)
    cos, sin = cos.cuda(), sin.cuda()
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    f = lambda a, b: rope(a, b, cos, sin)  # noqa: E731
    for a, b in zip(run(f, q, k, gq, gk), run(torch.compile(f, fullgraph=True), q, k, gq, gk)):
        assert torch.equal(a, b)
    for op, args in _op_samples("cuda"):
        torch.library.opcheck(op, args)
