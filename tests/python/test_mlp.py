"""logitless.gated_mlp: the gated MLP that saves x, gate and up only, against the composition of torch's ops."""
import pytest
import torch
import torch.nn.functional as F

import logitless
from _helpers import needs_cuda
from logitless.glu import glu

ACTS = {"silu": F.silu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "gelu": F.gelu}


def _operands(n=6, h=8, inter=12, concat=False, bias=False, dtype=torch.float64, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * 0.5).to(device, dtype).requires_grad_()

    w_gate = r(2 * inter if concat else inter, h)
    w_up = None if concat else r(inter, h)
    biases = (r(w_gate.shape[0]), None if concat else r(inter), r(h)) if bias else (None, None, None)
    return r(3, n, h), w_gate, w_up, r(h, inter), *biases


def _reference(x, w_gate, w_up, w_down, b_gate, b_up, b_down, activation="silu"):
    z = F.linear(x, w_gate, b_gate)
    gate, up = (z.chunk(2, dim=-1) if w_up is None else (z, F.linear(x, w_up, b_up)))
    return F.linear(ACTS[activation](gate) * up, w_down, b_down)


def _grads(fn, operands, dy):
    for t in operands:
        if t is not None:
            t.grad = None
    y = fn(*operands)
    y.backward(dy)
    return y.detach(), [None if t is None else t.grad.clone() for t in operands]


@pytest.mark.parametrize("activation", list(ACTS))
@pytest.mark.parametrize("concat", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_torch_in_float64(activation, concat, bias):
    ops = _operands(concat=concat, bias=bias)
    dy = torch.randn(3, 6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    want, want_g = _grads(lambda *t: _reference(*t, activation=activation), ops, dy)
    got, got_g = _grads(lambda *t: logitless.gated_mlp(*t, activation=activation), ops, dy)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(got_g, want_g):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_saves_x_gate_and_up_only():
    """What the backward keeps beyond the parameters: x, gate and up; the composition keeps h on top."""
    ops = _operands(n=32, h=8, inter=64)
    params = {id(t) for t in ops[1:] if t is not None}

    def saved_elements(fn):
        seen = {}

        def pack(t):
            if id(t) not in params and t.data_ptr() not in seen:
                seen[t.data_ptr()] = t.numel()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(*ops)
        return sum(seen.values())

    x_gate_up = 3 * 32 * 8 + 2 * 3 * 32 * 64
    assert saved_elements(logitless.gated_mlp) == x_gate_up
    assert saved_elements(lambda *t: F.linear(glu(F.linear(t[0], t[1]), F.linear(t[0], t[2])), t[3])) > x_gate_up


def _norm_then_mlp(residual, dtype, device):
    """rms_norm (with or without its fused residual add) feeding gated_mlp, as a patched decoder layer runs them."""
    ops = _operands(n=32, h=8, inter=64, dtype=dtype, device=device)
    norm_w = torch.rand(8, dtype=torch.float64).add(0.5).to(device, dtype).requires_grad_()
    base = (torch.randn(3, 32, 8, dtype=torch.float64) * 0.5).to(device, dtype).requires_grad_()
    res = (torch.randn(3, 32, 8, dtype=torch.float64) * 0.5).to(device, dtype).requires_grad_() if residual else None

    def run(detach_x):
        y = logitless.rms_norm(base, norm_w, residual=res)
        y = y[0] if residual else y
        # detach_x: the MLP gets a copy that is no norm output (it must save it), with the gradient routed back.
        x = y.clone() if detach_x else y
        return logitless.gated_mlp(x, *ops[1:])

    return run, [base, norm_w, res] + [t for t in ops[1:] if t is not None]


@pytest.mark.parametrize("residual", [False, True])
def test_the_norms_output_is_recomputed_not_saved(residual):
    """Fed by rms_norm, gated_mlp saves the norm's input instead of its output, and its gradients are the same."""
    run, leaves = _norm_then_mlp(residual, torch.float32, "cpu")
    leaves = [t for t in leaves if t is not None]
    dy = torch.randn(3, 32, 8, generator=torch.Generator().manual_seed(1))
    grads = []
    for detach_x in (True, False):
        for t in leaves:
            t.grad = None
        outputs = []

        def pack(t):
            outputs.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = run(detach_x)
        y.backward(dy)
        grads.append([t.grad.clone() for t in leaves])
        # Distinct storages saved for the backward: with the norm's output recomputed, one [3, 32, 8] less.
        ptrs = {t.data_ptr(): t.numel() for t in outputs if t.numel() == 3 * 32 * 8}
        if detach_x:
            saved_with_copy = len(ptrs)
        else:
            assert len(ptrs) == saved_with_copy - 1
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_norm_output_changed_in_place_is_saved_as_it_is():
    run_ops = _operands(n=4, h=8, inter=16, dtype=torch.float32)
    norm_w = torch.ones(8, requires_grad=True)
    base = torch.randn(3, 4, 8, requires_grad=True)
    y = logitless.rms_norm(base, norm_w).mul(1.0)  # not the norm's output: no recipe
    z = logitless.rms_norm(base, norm_w)
    z.mul_(2.0)  # the norm's output, changed after the norm: its recipe no longer holds
    for x in (y, z):
        # The weights' gradients depend on the x the backward uses: the changed one, as the forward saw it.
        w_gate = run_ops[1]
        w_gate.grad = None
        logitless.gated_mlp(x, *run_ops[1:]).sum().backward(retain_graph=True)
        got = w_gate.grad.clone()
        w_gate.grad = None
        _reference(x.detach(), *run_ops[1:]).sum().backward()
        torch.testing.assert_close(got, w_gate.grad, rtol=1e-5, atol=1e-6)


def test_under_checkpointing_h_and_x_are_saved_not_computed_again(monkeypatch):
    """Inside torch.utils.checkpoint (non-reentrant, transformers' default) the layer reruns its forward before the
    backward: the gated unit and the norm run twice in all (forward, rerun), not three times, and the gradients are
    the same."""
    import importlib

    from torch.utils.checkpoint import checkpoint

    mlp, rms = importlib.import_module("logitless.mlp"), importlib.import_module("logitless.rms_norm")

    run, leaves = _norm_then_mlp(True, torch.float32, "cpu")
    leaves = [t for t in leaves if t is not None]
    dy = torch.randn(3, 32, 8, generator=torch.Generator().manual_seed(2))
    calls, norms = [], []
    # The norm's C++ forward, which its eager path and its op (the recompute's) both call.
    unit, norm = mlp._unit, rms._run_forward
    monkeypatch.setattr(mlp, "_unit", lambda *a: calls.append(1) or unit(*a))
    monkeypatch.setattr(rms, "_run_forward", lambda *a: norms.append(1) or norm(*a))
    grads, counts = [], []
    for wrap in (lambda: run(False), lambda: checkpoint(run, False, use_reentrant=False)):
        for t in leaves:
            t.grad = None
        calls.clear()
        norms.clear()
        wrap().backward(dy)
        grads.append([t.grad.clone() for t in leaves])
        counts.append((len(calls), len(norms)))
    # plain: forward + the backward's recomputes; checkpointed: forward + the rerun, nothing recomputed on top
    assert counts == [(2, 2), (2, 2)]
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_only_the_needed_gradients():
    x, w_gate, w_up, w_down, *_ = _operands()
    w_gate.requires_grad_(False)
    x.requires_grad_(False)
    logitless.gated_mlp(x, w_gate, w_up, w_down).sum().backward()
    assert x.grad is None and w_gate.grad is None and w_up.grad is not None and w_down.grad is not None
    with torch.no_grad():
        assert logitless.gated_mlp(x, w_gate, w_up, w_down).grad_fn is None


def test_second_backward_raises_instead_of_reading_gradients():
    ops = _operands()
    y = logitless.gated_mlp(*ops).sum()
    y.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        y.backward()


def test_autocast_casts_like_linear_and_returns_gradients_in_the_leaves_dtype():
    ops = _operands(dtype=torch.float32)
    dy = torch.randn(3, 6, 8, generator=torch.Generator().manual_seed(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, want_g = _grads(_reference, ops, dy.bfloat16())
        got, got_g = _grads(logitless.gated_mlp, ops, dy.bfloat16())
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    for a, b, t in zip(got_g, want_g, ops):
        if t is not None:
            assert a.dtype == t.dtype == torch.float32
            torch.testing.assert_close(a, b, rtol=5e-2, atol=5e-2)


def test_bad_arguments_name_them():
    x, w_gate, w_up, w_down, *_ = _operands()
    with pytest.raises(ValueError, match="activation"):
        logitless.gated_mlp(x, w_gate, w_up, w_down, activation="relu")
    with pytest.raises(ValueError, match="down_weight"):
        logitless.gated_mlp(x, w_gate, w_up, w_down.t())
    with pytest.raises(ValueError, match="up_weight"):
        logitless.gated_mlp(x, w_gate, w_up[:-1], w_down)
    with pytest.raises(ValueError, match="x, gate_weight"):
        logitless.gated_mlp(x[..., :-1], w_gate, w_up, w_down)


@pytest.mark.parametrize("concat", [False, True])
def test_compile_fullgraph_matches_eager(concat):
    ops = _operands(concat=concat, dtype=torch.float32)
    dy = torch.randn(3, 6, 8, generator=torch.Generator().manual_seed(3))
    want, want_g = _grads(logitless.gated_mlp, ops, dy)
    torch._dynamo.reset()
    got, got_g = _grads(torch.compile(logitless.gated_mlp, fullgraph=True), ops, dy)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(got_g, want_g):
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@needs_cuda
@pytest.mark.parametrize("concat", [False, True])
def test_cuda_bf16_matches_torch_and_saves_less(concat):
    ops = _operands(n=512, h=256, inter=1024, concat=concat, dtype=torch.bfloat16, device="cuda")
    dy = torch.randn(3, 512, 256, device="cuda", dtype=torch.bfloat16)
    ref64 = [None if t is None else t.detach().double().requires_grad_() for t in ops]
    want, want_g = _grads(_reference, ref64, dy.double())
    bf_ref, bf_g = _grads(_reference, ops, dy)
    got, got_g = _grads(logitless.gated_mlp, ops, dy)

    def err(a, b):
        return ((a.double() - b).norm() / b.norm()).item()

    assert err(got, want) <= 1.5 * err(bf_ref, want) + 1e-3
    for a, b, c in zip(got_g, want_g, bf_g):
        if a is not None:
            assert err(a, b) <= 1.5 * err(c, b) + 1e-3

