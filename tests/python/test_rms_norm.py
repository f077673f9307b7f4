"""logitless.rms_norm and logitless.nn.RMSNorm against a float64 torch reference and against modules with
Hugging Face's Llama and Gemma RMSNorm semantics (written here, so `transformers` is not needed).

CPU tests run everywhere (the CPU backend is a real backend); CUDA tests skip without a GPU.
Run: PYTHONPATH=build/<dir>/python python -m pytest tests/python/test_rms_norm.py -q
"""
import pytest
import torch

from _helpers import DTYPES, capture_cuda_graph, needs_cuda, on_a_side_stream_behind_a_sleep
from logitless import rms_norm
from logitless.nn import RMSNorm

CASTINGS = ["llama", "gemma", "none"]

# Tolerances against the float64 reference evaluated on the same inputs. Outputs in a 16-bit dtype pass
# through up to three roundings, and a last-bit difference of the float32 rstd may round the normalized value
# the other way: 4 ulps (bf16 2^-8, fp16 2^-11). Gradients are compared relative to their largest element.
OUT_TOL = {torch.float32: (2e-5, 2e-6), torch.float16: (2e-3, 2e-5), torch.bfloat16: (1.6e-2, 2e-4)}
GRAD_TOL = {torch.float32: (1e-4, 2e-5), torch.float16: (2e-3, 1e-4), torch.bfloat16: (1.6e-2, 1e-3)}


# ----------------------------------------------------------------------------------------------------
# Modules with Hugging Face's semantics (the two conventions a checkpoint can be trained with)


class LlamaStyleRMSNorm(torch.nn.Module):
    """Hugging Face's LlamaRMSNorm: statistics in float32, the normalized input cast back to the input dtype
    before the weight multiply (in the weight's dtype, or promoted)."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        h = hidden_states.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(input_dtype)


class GemmaRMSNorm(torch.nn.Module):
    """Gemma's RMSNorm (Hugging Face): zero-centered weight, everything in float32, (1 + weight), one cast."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


class Gemma3nRMSNorm(GemmaRMSNorm):
    """Gemma3n's variant: float32 throughout like Gemma's, but a plain (not zero-centered) weight."""

    def __init__(self, dim, eps=1e-6):
        super().__init__(dim, eps)
        self.weight = torch.nn.Parameter(torch.ones(dim))

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * self.weight.float()).type_as(x)


# ----------------------------------------------------------------------------------------------------
# float64 reference: the documented formulas, rounding to x's dtype where each mode does


class _RoundPassingGradient(torch.autograd.Function):
    """t rounded to a dtype (and back to float64) in the forward; the identity in the backward, in float64.

    `t.to(dt).to(torch.float64)` would not do: autograd casts the gradient of a dtype conversion back to the
    source dtype, so the gradient flowing through it would be rounded to dt as well. In the Llama mode that
    is a = dy * g (the gradient of the rounded normalized value), which rms_norm.h documents as float32 and
    every backend keeps unrounded. The backends' grad_x then differed from the reference by r * (a - round(a)),
    up to half an ulp of a: absolute errors of 7e-4 (fp16) and 6e-3 (bf16) at [37, 896], beyond the
    tolerance's floor where r * a, the dot term and ds cancel to a small gradient."""

    @staticmethod
    def forward(ctx, t, dtype):
        return t.to(dtype).to(torch.float64)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def reference(x, weight, eps=1e-6, offset=0.0, casting="llama", residual=None):
    """(y, s) in float64 with the mode's roundings; differentiable (a rounding passes its gradient through
    unrounded, as the documented backward assumes)."""
    dt = x.dtype

    def rnd(t):
        return _RoundPassingGradient.apply(t, dt)

    s = x.double()
    if residual is not None:
        s = rnd(s + residual.double())
    r = torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)
    g = weight.double() + offset
    if casting == "none":
        r, g = rnd(r), rnd(g)
    if casting == "gemma":
        y = rnd(s * r * g)
    else:
        y = rnd(rnd(s * r) * g)
    return y, s


def reference_grads_none(x, weight, eps, offset, residual, dy, ds):
    """The documented backward for casting "none", in float64: its rstd is rounded, and the backward uses that
    rounded value throughout (autograd through `reference` would differentiate the unrounded rsqrt instead;
    the two differ where r * a and s * r^3 * sum(a s) / H cancel, e.g. for H = 1)."""
    dt = x.dtype

    def rnd(t):
        return t.to(dt).to(torch.float64)

    s = x.double() if residual is None else rnd(x.double() + residual.double())
    H = s.shape[-1]
    r = rnd(torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps))
    g = rnd(weight.double() + offset)
    a = dy.double() * g
    dx = r * a - s * r ** 3 * (a * s).sum(-1, keepdim=True) / H
    if residual is not None:
        dx = dx + ds.double()
    dw = (dy.double() * rnd(s * r)).reshape(-1, H).sum(0)
    return dx, dw


def make_inputs(shape, dtype, weight_dtype=None, offset=0.0, residual=False, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    H = shape[-1]
    scale = torch.rand(*shape[:-1], 1, generator=g) * 4 + 0.25  # rows of different scales
    x = (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)
    w = ((0.0 if offset else 1.0) + 0.2 * torch.randn(H, generator=g)).to(weight_dtype or dtype).to(device)
    res = torch.randn(*shape, generator=g).to(dtype).to(device) if residual else None
    return x, w, res


def assert_close_scaled(got, want, tol, what=""):
    rtol, atol = tol
    scale = max(want.abs().max().item(), 1.0) if want.numel() else 1.0
    torch.testing.assert_close(got.double(), want.double(), rtol=rtol, atol=atol * scale, msg=lambda m: f"{what}: {m}")


def run_and_grads(fn, x, w, res, dy, ds):
    """Outputs of fn(x, w, res) and the gradients of sum(y * dy) (+ sum(s * ds)) w.r.t. x, w, res."""
    x = x.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(True)
    res = None if res is None else res.detach().clone().requires_grad_(True)
    out = fn(x, w, res)
    y, s = out if isinstance(out, tuple) else (out, None)
    loss = (y.double() * dy.double()).sum()
    if res is not None:
        loss = loss + (s.double() * ds.double()).sum()
    loss.backward()
    return y.detach(), (None if s is None else s.detach()), x.grad, w.grad, (None if res is None else res.grad)


def check_against_reference(x, w, res, casting, offset=0.0, eps=1e-6, **kw):
    dt = x.dtype
    g = torch.Generator().manual_seed(1)
    dy = torch.randn(x.shape, generator=g).to(dt).to(x.device)
    ds = torch.randn(x.shape, generator=g).to(dt).to(x.device)
    got = run_and_grads(lambda a, b, c: rms_norm(a, b, eps=eps, offset=offset, casting_mode=casting, residual=c,
                                                 **kw), x, w, res, dy, ds)
    want = run_and_grads(lambda a, b, c: reference(a, b, eps, offset, casting, c) if c is not None
                         else reference(a, b, eps, offset, casting)[0], x.cpu(), w.cpu(), None if res is None
                         else res.cpu(), dy.cpu(), ds.cpu())
    if casting == "none":
        dx, dw = reference_grads_none(x.cpu(), w.cpu(), eps, offset, None if res is None else res.cpu(), dy.cpu(),
                                      ds.cpu())
        want = (want[0], want[1], dx, dw, None if res is None else dx)
    assert got[0].dtype == dt and got[0].shape == x.shape
    assert_close_scaled(got[0].cpu(), want[0], OUT_TOL[dt], "y")
    if res is not None:
        assert_close_scaled(got[1].cpu(), want[1], OUT_TOL[dt], "residual_out")
        assert_close_scaled(got[4].cpu(), want[4], GRAD_TOL[dt], "grad_residual")
    assert got[2].dtype == dt
    assert_close_scaled(got[2].cpu(), want[2], GRAD_TOL[dt], "grad_x")
    assert got[3].dtype == w.dtype
    # grad_weight sums dy * n with n rounded to x's dtype: the looser of the two dtypes.
    wtol = max(GRAD_TOL[w.dtype], GRAD_TOL[dt])
    assert_close_scaled(got[3].cpu(), want[3], wtol, "grad_weight")


# ----------------------------------------------------------------------------------------------------
# Against the reference


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_llama_reference_gradient_keeps_dy_times_weight_unrounded(dtype):
    # The reference's Llama gradient is rms_norm.h's formula in float64, a = dy * g unrounded, rounded once at
    # the end. [37, 896] with a residual is where a reference that rounded a to the dtype disagreed with the
    # backends (see _RoundPassingGradient): the CPU backend must pass there too, so CI catches that without a GPU.
    x, w, res = make_inputs((37, 896), dtype, residual=True)
    g = torch.Generator().manual_seed(1)
    dy = torch.randn(x.shape, generator=g).to(dtype)
    ds = torch.randn(x.shape, generator=g).to(dtype)
    _, _, gx, _, gres = run_and_grads(lambda a, b, c: reference(a, b, 1e-6, 0.0, "llama", c), x, w, res, dy, ds)
    s = (x.double() + res.double()).to(dtype).double()
    r = torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6)
    a = dy.double() * w.double()
    want = (r * a - s * r ** 3 * (a * s).mean(-1, keepdim=True) + ds.double()).to(dtype)
    assert torch.equal(gx, want) and torch.equal(gres, want)
    check_against_reference(x, w, res, "llama")


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("weight_f32", [False, True], ids=["wsame", "wf32"])
@pytest.mark.parametrize("casting", CASTINGS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_reference(dtype, casting, weight_f32, residual):
    offset = 1.0 if casting == "gemma" else 0.0
    x, w, res = make_inputs((3, 11, 96), dtype, torch.float32 if weight_f32 else dtype, offset, residual)
    check_against_reference(x, w, res, casting, offset=offset, eps=1e-5)


@pytest.mark.parametrize("shape", [(0, 64), (1, 1), (1, 4096), (7, 3), (5, 4097), (2, 3, 4, 20)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("casting", CASTINGS)
def test_shapes(shape, casting):
    offset = 1.0 if casting == "gemma" else 0.0
    for residual in (False, True):
        x, w, res = make_inputs(shape, torch.bfloat16, offset=offset, residual=residual)
        check_against_reference(x, w, res, casting, offset=offset)


def test_strided_rows_go_in_without_copy():
    # The causal-LM shift h[:, :-1] has rows H apart inside a [B, T+1, H] buffer.
    full, w, _ = make_inputs((2, 9, 64), torch.bfloat16)
    x = full[:, :-1]
    assert not x.is_contiguous()
    check_against_reference(x, w, None, "llama")
    # Padded rows (row stride H + 3): misaligned for 16-byte vectors, the generic path.
    buf = torch.randn(6, 67).to(torch.bfloat16)
    check_against_reference(buf[:, 1:65], w, None, "gemma", offset=1.0)


def test_last_dimension_need_not_be_contiguous():
    x, w, _ = make_inputs((8, 32), torch.float32)
    xt = x.t().contiguous().t()  # same values, column-major
    torch.testing.assert_close(rms_norm(xt, w), rms_norm(x, w), rtol=0, atol=0)


@pytest.mark.parametrize("algo", ["registers", "generic"])
def test_algo_choice_on_cpu_is_ignored(algo):
    # The CPU backend has one algorithm; the CUDA-only knobs are accepted and change nothing there.
    x, w, _ = make_inputs((4, 64), torch.bfloat16)
    torch.testing.assert_close(rms_norm(x, w, algo=algo), rms_norm(x, w), rtol=0, atol=0)


def test_modes_agree_in_float32():
    x, w, _ = make_inputs((5, 40), torch.float32)
    ys = [rms_norm(x, w, casting_mode=m) for m in CASTINGS]
    torch.testing.assert_close(ys[1], ys[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ys[2], ys[0], rtol=1e-6, atol=1e-7)


@pytest.mark.filterwarnings("ignore:Input #")
def test_gradcheck_float32():
    # Float32 (the op has no float64 path): finite differences with a step well above float32's resolution.
    for casting, offset in (("llama", 0.0), ("gemma", 1.0)):
        x, w, res = make_inputs((3, 7), torch.float32, offset=offset, residual=True)
        x, w, res = (t.requires_grad_(True) for t in (x, w, res))
        torch.autograd.gradcheck(
            lambda a, b, c: rms_norm(a, b, eps=1e-5, offset=offset, casting_mode=casting, residual=c),
            (x, w, res), eps=1e-3, atol=5e-3, rtol=2e-2)


def test_gradient_flows_into_both_outputs_and_only_where_needed():
    x, w, res = make_inputs((4, 16), torch.float32, residual=True)
    # Only residual_out used: grad_x = grad_residual = its incoming gradient; weight gets zero.
    x1, w1, r1 = (t.clone().requires_grad_(True) for t in (x, w, res))
    _, s = rms_norm(x1, w1, residual=r1)
    (3 * s).sum().backward()
    torch.testing.assert_close(x1.grad, torch.full_like(x, 3.0))
    torch.testing.assert_close(r1.grad, torch.full_like(x, 3.0))
    torch.testing.assert_close(w1.grad, torch.zeros_like(w))
    # No grad for the weight requested: none computed, x still gets one.
    x2 = x.clone().requires_grad_(True)
    rms_norm(x2, w).sum().backward()
    assert x2.grad is not None
    # Under no_grad nothing is saved and the output has no graph.
    with torch.no_grad():
        assert rms_norm(x2, w).grad_fn is None


def test_the_incoming_gradient_is_never_written():
    # Autograd hands one gradient tensor to every consumer of a value: in h + rms_norm(x, w) the add's backward
    # passes the same tensor on to h and to rms_norm, so a write into it would change h's gradient. The gradient
    # of x goes to a fresh buffer, whatever the layout of the incoming one.
    x, w, res = make_inputs((6, 32), torch.float32, residual=True)
    for residual in (None, res):
        for g in (torch.randn(6, 32), torch.randn(6, 64)[:, ::2], torch.randn(32).expand(6, 32)):
            g0 = g.clone()
            xa = x.clone().requires_grad_(True)
            out = rms_norm(xa, w, residual=residual)
            v0 = g._version
            if residual is None:
                out.backward(g)
            else:
                torch.autograd.backward(list(out), [g, g])
            assert g._version == v0 and torch.equal(g, g0)
            assert xa.grad.data_ptr() != g.data_ptr()


def test_a_gradient_shared_with_another_consumer_stays_right():
    # Gemma 2/3's post-norms: the norm's output is added to the residual stream, whose gradient is the same tensor.
    x, w, _ = make_inputs((6, 32), torch.float32)
    upstream = torch.randn(6, 32)
    h = torch.randn(6, 32, requires_grad=True)
    xa = x.clone().requires_grad_(True)
    (h + rms_norm(xa, w)).backward(upstream)
    torch.testing.assert_close(h.grad, upstream, rtol=0, atol=0)
    xr = x.double().requires_grad_(True)
    reference(xr, w.double(), 1e-6, 0.0, "llama")[0].backward(upstream.double())
    torch.testing.assert_close(xa.grad, xr.grad.float(), rtol=1e-5, atol=1e-6)


def test_inplace_backward_is_gone():
    x, w, _ = make_inputs((2, 8), torch.float32)
    with pytest.raises(TypeError):
        rms_norm(x, w, inplace_backward=True)
    with pytest.raises(TypeError):
        RMSNorm(8, inplace_backward=True)
    assert not hasattr(torch.ops.logitless, "rms_norm_backward_")


def test_double_backward_raises():
    x, w, _ = make_inputs((3, 8), torch.float32)
    x.requires_grad_(True)
    (gx,) = torch.autograd.grad(rms_norm(x, w).pow(2).sum(), x, create_graph=False)
    assert gx.shape == x.shape
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(rms_norm(x, w).pow(2).sum(), x, create_graph=True)


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_eager_path_and_custom_op_path_agree_bitwise(residual):
    # Eager calls skip the custom-op dispatch (rms_norm.py says why); torch.compile and direct callers use the
    # ops. Both must be the same computation.
    x, w, res = make_inputs((5, 3, 48), torch.bfloat16, torch.float32, residual=residual)
    dy, ds = torch.randn(5, 3, 48).to(torch.bfloat16), torch.randn(5, 3, 48).to(torch.bfloat16)
    outs = []
    for via_op in (False, True):
        xa, wa = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        ra = None if res is None else res.clone().requires_grad_(True)
        if via_op:
            y, s, _ = torch.ops.logitless.rms_norm_forward(xa, wa, ra, 1e-6, 0.0, 0, 0, 0)
        else:
            out = rms_norm(xa, wa, residual=ra)
            y, s = out if residual else (out, None)
        if residual:
            torch.autograd.backward([y, s], [dy.clone(), ds.clone()])
        else:
            y.backward(dy.clone())
        outs.append([y.detach(), xa.grad, wa.grad] + ([s.detach(), ra.grad] if residual else []))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_no_grad_call_builds_no_graph():
    x, w, _ = make_inputs((4, 32), torch.float32)
    w.requires_grad_(True)
    with torch.no_grad():
        y = rms_norm(x, w)
    assert y.grad_fn is None and not y.requires_grad
    torch.testing.assert_close(y, rms_norm(x, w.detach()), rtol=0, atol=0)


def test_dw_is_deterministic_on_cpu():
    x, w, _ = make_inputs((64, 96), torch.bfloat16, torch.float32)
    grads = []
    for _ in range(2):
        wa = w.clone().requires_grad_(True)
        rms_norm(x, wa).float().pow(2).sum().backward()
        grads.append(wa.grad)
    assert torch.equal(grads[0], grads[1])


# ----------------------------------------------------------------------------------------------------
# Hugging Face-style modules and from_module


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["llama", "gemma"])
def test_matches_hf_style_modules(kind, dtype):
    H = 128
    g = torch.Generator().manual_seed(3)
    hf = LlamaStyleRMSNorm(H, eps=1e-5) if kind == "llama" else GemmaRMSNorm(H, eps=1e-6)
    with torch.no_grad():
        hf.weight.copy_(hf.weight + 0.3 * torch.randn(H, generator=g))
    hf = hf.to(dtype)
    ours = RMSNorm.from_module(hf)
    assert ours.weight is hf.weight
    assert ours.casting_mode == kind and ours.offset == (1.0 if kind == "gemma" else 0.0)
    x = (torch.randn(4, 10, H, generator=g) * 3).to(dtype)
    dy = torch.randn(4, 10, H, generator=g).to(dtype)
    outs = []
    for mod in (hf, ours):
        xa = x.clone().requires_grad_(True)
        mod.zero_grad()
        y = mod(xa)
        y.backward(dy)
        outs.append((y.detach(), xa.grad, mod.weight.grad.clone()))
    (yh, gxh, gwh), (yo, gxo, gwo) = outs
    assert yo.dtype == yh.dtype == dtype
    # Same rounding points: y agrees to the last bit except where float32 sums of squares in a different order
    # round the normalized value the other way (at most 1 ulp, rarely).
    ulp = {torch.float32: 1e-6, torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}[dtype]
    assert ((yo.float() - yh.float()).abs() <= ulp * yh.float().abs() + 1e-6).all()
    if dtype != torch.float32:  # in float32 the order of the sums shows in the last bit nearly everywhere
        assert (yo == yh).float().mean() > 0.95
    assert_close_scaled(gxo, gxh, GRAD_TOL[dtype], "grad_x")
    # The module's autograd rounds each dy * n (and, for Llama, dy * weight) to the dtype before summing; the
    # kernels keep float32 until the end. So grad_weight agrees to the module's own rounding noise: ~4 ulps of
    # the dtype relative to the largest element.
    assert_close_scaled(gwo, gwh, (GRAD_TOL[dtype][0], 4 * ulp), "grad_weight")


def test_llama_style_module_with_float32_weight():
    # HF promotes y to float32 when the weight is float32; logitless keeps x's dtype (the same values,
    # rounded once more).
    H = 64
    hf = LlamaStyleRMSNorm(H)
    with torch.no_grad():
        hf.weight.add_(0.1 * torch.randn(H))
    x = torch.randn(3, H).to(torch.bfloat16)
    ours = RMSNorm.from_module(hf)
    torch.testing.assert_close(ours(x), hf(x).to(torch.bfloat16), rtol=0, atol=0)


def test_from_module_detection_and_overrides():
    gem = RMSNorm.from_module(GemmaRMSNorm(16, eps=1e-6))
    assert (gem.offset, gem.casting_mode, gem.eps) == (1.0, "gemma", 1e-6)
    g3n = RMSNorm.from_module(Gemma3nRMSNorm(16))
    assert (g3n.offset, g3n.casting_mode) == (0.0, "gemma")
    lla = RMSNorm.from_module(LlamaStyleRMSNorm(16, eps=1e-5))
    assert (lla.offset, lla.casting_mode, lla.eps) == (0.0, "llama", 1e-5)

    class OtherNorm(torch.nn.Module):  # a module that states its convention (as some libraries' do)
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(16))
            self.variance_epsilon = 1e-6
            self.offset = 1.0
            self.casting_mode = "gemma"

    oth = RMSNorm.from_module(OtherNorm())
    assert (oth.offset, oth.casting_mode) == (1.0, "gemma")
    ovr = RMSNorm.from_module(LlamaStyleRMSNorm(16), casting_mode="gemma", offset=0.0)
    assert (ovr.offset, ovr.casting_mode) == (0.0, "gemma")
    # The weight is shared: a state dict round trip and an optimizer step see one parameter.
    hf = LlamaStyleRMSNorm(16)
    ours = RMSNorm.from_module(hf)
    assert list(ours.state_dict()) == ["weight"]
    assert ours.state_dict()["weight"].data_ptr() == hf.weight.data_ptr()
    with pytest.raises(ValueError, match="module"):
        RMSNorm.from_module(torch.nn.Linear(4, 4))


def test_nn_module_defaults_and_residual():
    m = RMSNorm(32, eps=1e-5)
    assert torch.equal(m.weight, torch.ones(32)) and "eps=1e-05" in repr(m)
    assert torch.equal(RMSNorm(8, offset=1.0, casting_mode="gemma").weight, torch.zeros(8))
    x, _, res = make_inputs((4, 32), torch.float32, residual=True)
    y, s = m(x, res)
    torch.testing.assert_close(s, x + res)
    torch.testing.assert_close(y, rms_norm(x + res, m.weight, eps=1e-5))


# ----------------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"eps": 0.0}, "eps: expected a finite value > 0"),
        ({"eps": -1e-6}, "eps: expected a finite value > 0"),
        ({"weight": torch.ones(31)}, r"weight: expected shape \[32\]"),
        ({"weight": torch.ones(32, dtype=torch.float16)}, "weight: expected dtype bfloat16 .x's. or float32"),
        ({"residual": torch.ones(4, 32, dtype=torch.float16)}, "residual: expected dtype bfloat16"),
        ({"residual": torch.ones(4, 31, dtype=torch.bfloat16)}, r"residual: expected shape \[4, 32\]"),
        ({"casting_mode": "mistral"}, "casting_mode: expected one of"),
        ({"algo": "fast"}, "algo: expected one of"),
        ({"vectors_per_thread": 3}, "vectors_per_thread: expected 0"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(kwargs, match):
    x = torch.randn(4, 32).to(torch.bfloat16)
    args = {"weight": torch.ones(32, dtype=torch.bfloat16)}
    args.update(kwargs)
    weight = args.pop("weight")
    with pytest.raises(ValueError, match=match):
        rms_norm(x, weight, **args)


def test_bad_x_dtype():
    with pytest.raises(ValueError, match="x: expected dtype float32, float16 or bfloat16, got float64"):
        rms_norm(torch.randn(2, 4, dtype=torch.float64), torch.ones(4, dtype=torch.float64))


# ----------------------------------------------------------------------------------------------------
# torch.library and torch.compile


def _op_samples(device="cpu"):
    x, w, res = make_inputs((4, 24), torch.float32, residual=True, device=device)
    opts = (1e-6, 0.0, 0, 0, 0)
    ops = torch.ops.logitless
    y, s, rstd = ops.rms_norm_forward(x, w, res, *opts)
    _, _, rstd_x = ops.rms_norm_forward(x, w, None, *opts)
    dy = torch.randn_like(x)
    return [
        (ops.rms_norm_forward, (x, w, None) + opts),
        (ops.rms_norm_forward, (x.clone().requires_grad_(True), w.clone().requires_grad_(True), None, 1e-5, 1.0, 1,
                                0, 0)),
        (ops.rms_norm_forward, (x.clone().requires_grad_(True), w.clone().requires_grad_(True),
                                res.clone().requires_grad_(True)) + opts),
        (ops.rms_norm_backward, (dy, None, x, w, rstd_x) + opts + (True,)),
        (ops.rms_norm_backward, (dy, torch.randn_like(x), s, w, rstd) + opts + (False,)),
    ]


@pytest.mark.parametrize("index", range(5))
def test_opcheck(index):
    op, args = _op_samples()[index]
    torch.library.opcheck(op, args)


def _block(x, res, w1, w2):
    # A pre-norm block's shape: add the residual, normalize, and feed the next layer.
    y, s = rms_norm(x, w1, residual=res)
    z = rms_norm(torch.tanh(y) + s, w2, casting_mode="gemma", offset=1.0)
    return z.float().pow(2).sum()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_compile_fullgraph_matches_eager(dtype):
    torch._dynamo.reset()
    x, w1, res = make_inputs((2, 5, 32), dtype, residual=True)
    w2 = 0.1 * torch.randn(32).to(dtype)
    results = []
    for fn in (_block, torch.compile(_block, fullgraph=True)):
        args = [t.clone().requires_grad_(True) for t in (x, res, w1, w2)]
        loss = fn(*args)
        loss.backward()
        results.append([loss.detach()] + [a.grad for a in args])
    # Inductor fuses the tanh and add between the two norms without rounding the intermediate to bf16 (eager
    # rounds it), so in bf16 the second norm sees inputs 1 ulp apart: bf16 tolerances against the gradients'
    # scale there, float32 ones otherwise.
    tol = (1e-5, 1e-6) if dtype == torch.float32 else (GRAD_TOL[dtype][0], 2e-2)
    for a, b, what in zip(*results, ("loss", "grad_x", "grad_residual", "grad_w1", "grad_w2")):
        assert_close_scaled(a.float(), b.float(), tol, what)


def _assert_compiled_alone_is_bit_exact(x, w, res):
    """rms_norm with a residual, compiled alone with fullgraph=True: the same outputs and gradients, bit
    for bit."""
    torch._dynamo.reset()

    def f(a, b, c):
        return rms_norm(a, b, residual=c)

    outs = []
    for fn in (f, torch.compile(f, fullgraph=True)):
        args = [t.clone().requires_grad_(True) for t in (x, w, res)]
        y, s = fn(*args)
        torch.autograd.backward([y, s], [torch.ones_like(y), torch.full_like(s, 0.5)])
        outs.append([y.detach(), s.detach()] + [a.grad for a in args])
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_compile_fullgraph_alone_is_bit_exact():
    _assert_compiled_alone_is_bit_exact(*make_inputs((3, 4, 64), torch.bfloat16, residual=True))


def test_compile_dynamic_shapes_and_strided_input():
    torch._dynamo.reset()
    fn = torch.compile(lambda h, w: rms_norm(h[:, :-1], w), fullgraph=True, dynamic=True)
    w = torch.randn(16)
    for T in (5, 9):
        h = torch.randn(2, T + 1, 16, requires_grad=True)
        y = fn(h, w)
        y.sum().backward()
        h2 = h.detach().clone().requires_grad_(True)
        rms_norm(h2[:, :-1], w).sum().backward()
        torch.testing.assert_close(y, rms_norm(h.detach()[:, :-1], w), rtol=0, atol=0)
        torch.testing.assert_close(h.grad, h2.grad, rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------------
# CUDA


@needs_cuda
@pytest.mark.parametrize("algo", ["auto", "registers", "generic"])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("casting", CASTINGS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("H", [3, 896, 4096, 5120, 8192, 16384])
def test_cuda_matches_reference(H, dtype, casting, residual, algo):
    if algo == "registers" and (H % (16 // torch.tensor([], dtype=dtype).element_size()) or
                                H * torch.tensor([], dtype=dtype).element_size() > 32768):
        pytest.skip("rows the register kernel does not take")
    offset = 1.0 if casting == "gemma" else 0.0
    x, w, res = make_inputs((37, H), dtype, torch.float32 if casting == "gemma" else dtype, offset, residual,
                            device="cuda")
    check_against_reference(x, w, res, casting, offset=offset, algo=algo)


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_matches_cpu_backend(dtype):
    full, w, _ = make_inputs((4, 257, 4096), dtype)
    g = torch.Generator().manual_seed(1)
    res, dy, ds = (torch.randn(4, 256, 4096, generator=g).to(dtype) for _ in range(3))
    # Both backwards get the same incoming gradients. A loss of y itself (y.pow(2)) would not give them: the
    # two forwards sum the squares in float32 in different orders, so round(s * r) may round the other way (1 ulp
    # of y at ~170 of the 4M float16 elements), and dy = 2y carries that ulp into grad_x as r * g * 2 ulp(y),
    # up to 1.9x the grad tolerance where grad_x is small. The forwards' y are compared on their own.
    outs = []
    for device in ("cpu", "cuda"):
        x = full.to(device)[:, :-1].requires_grad_(False)
        # Fresh leaves on each device: w.to("cpu") is w itself, so requires_grad_ on it would make the shared w
        # a leaf, and w.to("cuda") a non-leaf whose .grad stays None.
        xa = x.detach().clone().requires_grad_(True)
        wa = w.detach().to(device).requires_grad_(True)
        ra = res.detach().to(device).requires_grad_(True)
        y, s = rms_norm(xa, wa, residual=ra)
        torch.autograd.backward([y, s], [dy.to(device), ds.to(device)])
        outs.append([t.detach().cpu() for t in (y, s, xa.grad, wa.grad)])
    (yc, sc, gxc, gwc), (yg, sg, gxg, gwg) = outs
    assert torch.equal(sg, sc)
    assert_close_scaled(yg, yc, OUT_TOL[dtype], "y")
    assert_close_scaled(gxg, gxc, GRAD_TOL[dtype], "grad_x")
    assert_close_scaled(gwg, gwc, GRAD_TOL[dtype], "grad_weight")


@needs_cuda
@pytest.mark.parametrize("algo", ["auto", "generic"])
def test_cuda_grad_weight_is_bitwise_deterministic(algo):
    x, w, res = make_inputs((8192, 4096), torch.bfloat16, residual=True, device="cuda")
    dy = torch.randn_like(x)
    grads = []
    for _ in range(3):
        wa = w.clone().requires_grad_(True)
        xa = x.clone().requires_grad_(True)
        y, _ = rms_norm(xa, wa, residual=res, algo=algo)
        y.backward(dy)
        grads.append((wa.grad, xa.grad))
    for gw, gx in grads[1:]:
        assert torch.equal(gw, grads[0][0]) and torch.equal(gx, grads[0][1])


@needs_cuda
def test_cuda_runs_on_the_current_stream():
    # The input is written on a side stream behind a long sleep: a kernel on any other stream would read it
    # before that write.
    x, w, _ = make_inputs((256, 4096), torch.bfloat16, device="cuda")
    want = rms_norm(x, w)

    def run():
        xa = (x + 0).requires_grad_(True)
        wa = w.clone().requires_grad_(True)
        got = rms_norm(xa, wa)
        got.backward(torch.ones_like(got))
        return got, xa, wa

    got, xa, wa = on_a_side_stream_behind_a_sleep(run)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    xb, wb = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    rms_norm(xb, wb).backward(torch.ones_like(want))
    torch.testing.assert_close(xa.grad, xb.grad, rtol=0, atol=0)
    torch.testing.assert_close(wa.grad, wb.grad, rtol=0, atol=0)


@needs_cuda
def test_cuda_graph_capture():
    x, w, res = make_inputs((64, 2048), torch.bfloat16, residual=True, device="cuda")
    xa, wa, ra = (t.clone().requires_grad_(True) for t in (x, w, res))

    def step():
        y, s = rms_norm(xa, wa, residual=ra)
        (y.float().pow(2).sum() + s.float().sum()).backward()
        return y.detach()

    graph, y_graph = capture_cuda_graph(step, (xa, wa, ra))
    graph.replay()
    torch.cuda.synchronize()
    got = (y_graph.clone(), xa.grad.clone(), wa.grad.clone())
    xb, wb, rb = (t.clone().requires_grad_(True) for t in (x, w, res))
    y, s = rms_norm(xb, wb, residual=rb)
    (y.float().pow(2).sum() + s.float().sum()).backward()
    for a, b in zip(got, (y.detach(), xb.grad, wb.grad)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@needs_cuda
def test_cuda_compile_and_opcheck():
    _assert_compiled_alone_is_bit_exact(*make_inputs((4, 7, 256), torch.bfloat16, residual=True, device="cuda"))
    for op, args in _op_samples("cuda"):
        torch.library.opcheck(op, args)
