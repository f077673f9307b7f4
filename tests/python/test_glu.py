"""logitless.glu / swiglu / geglu against a float64 torch reference, torch.library.opcheck, torch.compile,
gradcheck, the in-place backward's safety, and CUDA (graphs, the CPU backend as the reference).

CPU tests run everywhere (the CPU backend is a real backend); CUDA tests skip without a GPU.
Run: PYTHONPATH=build/<dir>/python python -m pytest tests/python/test_glu.py -q
"""
import pytest
import torch
import torch.nn.functional as F

import logitless
from _helpers import DTYPES, capture_cuda_graph, needs_cuda, on_a_side_stream_behind_a_sleep
from logitless import geglu, glu, swiglu

ACTIVATIONS = ["silu", "gelu_tanh", "gelu"]

# Against the float64 reference on the same inputs: one rounding of a float32 result (the backends compute in
# float32 or double and round once), so half an ulp and the float32 error of exp/tanh/erf, relative to the
# element, with a floor relative to the tensor's largest element for results that cancel (dgate near g = -1.28).
TOL = {torch.float32: (1e-5, 1e-6), torch.float16: (1e-3, 1e-5), torch.bfloat16: (8e-3, 1e-4),
       torch.float64: (1e-12, 1e-14)}


def act64(g, activation):
    if activation == "silu":
        return F.silu(g)
    return F.gelu(g, approximate="tanh" if activation == "gelu_tanh" else "none")


def make_inputs(shape, dtype, device="cpu", seed=0, concat=False):
    """(gate, up) of `shape`, or (gate_up, None) with gate_up [*, 2I]; values over the activations' curved range."""
    gen = torch.Generator().manual_seed(seed)
    if concat:
        gu = (torch.randn(*shape[:-1], 2 * shape[-1], generator=gen) * 2.5).to(dtype).to(device)
        return gu, None
    g = (torch.randn(*shape, generator=gen) * 2.5).to(dtype).to(device)
    u = torch.randn(*shape, generator=gen).to(dtype).to(device)
    return g, u


def reference(gate, up, activation, dy):
    """(y, grad_gate, grad_up) in float64 by autograd; grad_up None in the concatenated form."""
    g = gate.detach().double().cpu().requires_grad_(True)
    u = None if up is None else up.detach().double().cpu().requires_grad_(True)
    if u is None:
        a, b = g.chunk(2, dim=-1)
        y = act64(a, activation) * b
    else:
        y = act64(g, activation) * u
    y.backward(dy.double().cpu())
    return y.detach(), g.grad, (None if u is None else u.grad)


def assert_close(got, want, dtype, what):
    rtol, atol = TOL[dtype]
    scale = max(want.abs().max().item(), 1.0) if want.numel() else 1.0
    torch.testing.assert_close(got.double().cpu(), want.double(), rtol=rtol, atol=atol * scale,
                               msg=lambda m: f"{what}: {m}")


def run(fn, gate, up, dy):
    g = gate.detach().clone().requires_grad_(True)
    u = None if up is None else up.detach().clone().requires_grad_(True)
    y = fn(g, u)
    y.backward(dy)
    return y.detach(), g.grad, (None if u is None else u.grad)


def check(gate, up, activation, **kw):
    out_shape = gate.shape if up is not None else gate.shape[:-1] + (gate.shape[-1] // 2,)
    dy = torch.randn(out_shape, generator=torch.Generator().manual_seed(1)).to(gate.dtype).to(gate.device)
    got = run(lambda g, u: glu(g, u, activation=activation, **kw), gate, up, dy)
    want = reference(gate, up, activation, dy)
    assert got[0].dtype == gate.dtype and got[0].shape == out_shape
    for a, b, what in zip(got, want, ("y", "grad_gate", "grad_up")):
        if b is None:
            assert a is None
            continue
        assert a.shape == b.shape and a.dtype == gate.dtype, what
        assert_close(a, b, gate.dtype, what)


# ----------------------------------------------------------------------------------------------------
# Against the reference


@pytest.mark.parametrize("concat", [False, True], ids=["separate", "gate_up"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES + [torch.float64], ids=str)
def test_matches_reference(dtype, activation, concat):
    gate, up = make_inputs((3, 5, 96), dtype, concat=concat)
    check(gate, up, activation)


@pytest.mark.parametrize("shape", [(0, 8), (4, 0), (1, 1), (7, 3), (5, 1000), (2, 3, 4, 20)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("concat", [False, True], ids=["separate", "gate_up"])
def test_shapes(shape, concat):
    gate, up = make_inputs(shape, torch.bfloat16, concat=concat)
    check(gate, up, "silu")


@pytest.mark.parametrize("inplace_backward", [False, True])
def test_strided_rows_go_in_without_copy(inplace_backward):
    # The causal-LM shift h[:, :-1] and a padded row stride: rows the kernels address through their strides.
    full, _ = make_inputs((2, 9, 64), torch.float32)
    gate = full[:, :-1]
    up = torch.randn(2, 8, 64)
    assert not gate.is_contiguous()
    check(gate, up, "gelu_tanh", inplace_backward=inplace_backward)
    buf = torch.randn(6, 67)
    check(buf[:, 1:65], torch.randn(6, 64), "silu")


def test_last_dimension_need_not_be_contiguous():
    gate, up = make_inputs((8, 32), torch.float32)
    gt = gate.t().contiguous().t()
    torch.testing.assert_close(swiglu(gt, up), swiglu(gate, up), rtol=0, atol=0)


def test_matches_torch_modules_in_float32():
    gate, up = make_inputs((4, 7, 64), torch.float32)
    torch.testing.assert_close(swiglu(gate, up), F.silu(gate) * up, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(geglu(gate, up), F.gelu(gate, approximate="tanh") * up, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(geglu(gate, up, approximate="none"), F.gelu(gate) * up, rtol=1e-6, atol=1e-5)
    gu = torch.cat([gate, up], dim=-1)
    torch.testing.assert_close(swiglu(gu), swiglu(gate, up), rtol=0, atol=0)


def test_sixteen_bit_rounds_once():
    # The product of the float32 activation and up, rounded once: torch's two roundings differ from it in at most
    # one ulp, and only where the activation's own rounding mattered.
    gate, up = make_inputs((64, 256), torch.bfloat16)
    ours = swiglu(gate, up).float()
    exact = (F.silu(gate.double()) * up.double()).to(torch.bfloat16).float()
    assert torch.equal(ours, exact) or (ours != exact).float().mean() < 1e-3
    torch_way = (F.silu(gate) * up).float()
    assert ((ours - torch_way).abs() <= 2 ** -7 * torch_way.abs() + 1e-30).all()


def test_extreme_gates():
    g = torch.tensor([[-1e4, -100.0, -20.0, 0.0, 20.0, 100.0, 1e4, 3e38]])
    u = torch.ones_like(g)
    for activation in ACTIVATIONS:
        y, dg, du = run(lambda a, b: glu(a, b, activation=activation), g, u, torch.ones_like(g))
        want = reference(g, u, activation, torch.ones_like(g))
        assert torch.isfinite(y[:, :-1]).all() and torch.isfinite(dg).all(), activation
        torch.testing.assert_close(dg.double(), want[1], rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------------
# Autograd


@pytest.mark.parametrize("concat", [False, True], ids=["separate", "gate_up"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gradcheck_float64(activation, concat):
    gate, up = make_inputs((3, 6), torch.float64, concat=concat)
    args = (gate.requires_grad_(True),) if up is None else (gate.requires_grad_(True), up.requires_grad_(True))
    torch.autograd.gradcheck(lambda *a: glu(*a, activation=activation), args)


def test_gradient_only_where_needed_and_no_graph_under_no_grad():
    gate, up = make_inputs((4, 16), torch.float32)
    g = gate.clone().requires_grad_(True)
    swiglu(g, up).sum().backward()
    want = reference(gate, up, "silu", torch.ones(4, 16))
    torch.testing.assert_close(g.grad.double(), want[1])
    with torch.no_grad():
        assert swiglu(g, up).grad_fn is None


def test_double_backward_raises():
    gate, up = make_inputs((3, 8), torch.float32)
    g = gate.requires_grad_(True)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(swiglu(g, up).pow(2).sum(), g, create_graph=True)


@pytest.mark.parametrize("concat", [False, True], ids=["separate", "gate_up"])
def test_eager_path_and_custom_op_path_agree_bitwise(concat):
    gate, up = make_inputs((5, 3, 48), torch.bfloat16, concat=concat)
    dy = torch.randn(5, 3, 48).to(torch.bfloat16)
    outs = []
    for via_op in (False, True):
        if via_op:
            outs.append(run(lambda g, u: torch.ops.logitless.glu_forward(g, u, 1, 0), gate, up, dy))
        else:
            outs.append(run(lambda g, u: geglu(g, u), gate, up, dy))
    for a, b in zip(*outs):
        assert (a is None and b is None) or torch.equal(a, b)


# ----------------------------------------------------------------------------------------------------
# The in-place backward


class _Produce(torch.autograd.Function):
    """An activation as a model's projection makes it: a non-leaf whose producer saved nothing of it."""

    @staticmethod
    def forward(ctx, t):
        return t.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad


@pytest.mark.parametrize("concat", [False, True], ids=["separate", "gate_up"])
def test_inplace_backward_writes_over_gate_and_up_and_declares_it(concat):
    gate, up = make_inputs((6, 32), torch.float32, concat=concat)
    dy = torch.randn(6, 32)
    dy0 = dy.clone()
    want = run(lambda g, u: swiglu(g, u), gate, up, dy)

    g_leaf = gate.clone().requires_grad_(True)
    u_leaf = None if up is None else up.clone().requires_grad_(True)
    g_act = _Produce.apply(g_leaf)
    u_act = None if up is None else _Produce.apply(u_leaf)
    versions = (g_act._version, None if u_act is None else u_act._version)
    y = swiglu(g_act, u_act, inplace_backward=True)
    y.backward(dy)
    assert torch.equal(dy, dy0)  # the incoming gradient is never written
    assert g_act._version > versions[0]
    torch.testing.assert_close(g_act, want[1], rtol=0, atol=0)  # gate's storage now holds its gradient
    torch.testing.assert_close(g_leaf.grad, want[1], rtol=0, atol=0)
    if up is not None:
        assert u_act._version > versions[1]
        torch.testing.assert_close(u_act, want[2], rtol=0, atol=0)
        torch.testing.assert_close(u_leaf.grad, want[2], rtol=0, atol=0)
    # The leaves themselves are never written.
    torch.testing.assert_close(g_leaf, gate, rtol=0, atol=0)


def test_inplace_backward_raises_where_another_node_saved_gate():
    gate, up = make_inputs((6, 32), torch.float32)

    def grads(saver_first, inplace):
        g_leaf, u_leaf = gate.clone().requires_grad_(True), up.clone().requires_grad_(True)
        g_act, u_act = _Produce.apply(g_leaf), _Produce.apply(u_leaf)
        # g_act.pow(2) saves g_act. Autograd runs the later node's backward first: a saver made before swiglu runs
        # after it, and must not read a gradient where gate was.
        if saver_first:
            other = g_act.pow(2).sum()
        loss = swiglu(g_act, u_act, inplace_backward=inplace).sum()
        if not saver_first:
            other = g_act.pow(2).sum()
        (loss + other).backward()
        return g_leaf.grad, u_leaf.grad

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        grads(saver_first=True, inplace=True)
    # A saver whose backward runs first has read gate already: the in-place backward is then correct.
    for a, b in zip(grads(False, True), grads(False, False)):
        assert torch.equal(a, b)


def test_inplace_backward_leaves_leaves_and_views_of_leaves_alone():
    gate, up = make_inputs((6, 32), torch.float32)
    for g, u in ((gate.clone().requires_grad_(True), up.clone().requires_grad_(True)),):
        g0, u0 = g.detach().clone(), u.detach().clone()
        swiglu(g, u, inplace_backward=True).sum().backward()
        assert torch.equal(g.detach(), g0) and torch.equal(u.detach(), u0)
    # Views into a parameter: non-leaves, but writing them would write the parameter.
    p = torch.cat([gate, up], dim=-1).requires_grad_(True)
    p0 = p.detach().clone()
    swiglu(p[:, :32], p[:, 32:], inplace_backward=True).sum().backward()
    assert torch.equal(p.detach(), p0)
    swiglu(p, inplace_backward=True).sum().backward()
    assert torch.equal(p.detach(), p0)


def test_inplace_backward_gives_the_same_gradients_as_out_of_place():
    gate, up = make_inputs((4, 5, 64), torch.bfloat16)
    dy = torch.randn(4, 5, 64).to(torch.bfloat16)
    grads = []
    for inplace in (False, True):
        g_leaf, u_leaf = gate.clone().requires_grad_(True), up.clone().requires_grad_(True)
        geglu(_Produce.apply(g_leaf), _Produce.apply(u_leaf), inplace_backward=inplace).backward(dy)
        grads.append((g_leaf.grad, u_leaf.grad))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------------------------------
# Errors


def test_bad_arguments_raise_value_error_naming_them():
    g, u = make_inputs((4, 6), torch.float32)
    with pytest.raises(ValueError, match="up: expected shape"):
        swiglu(g, u[:, :5])
    with pytest.raises(ValueError, match="up: expected dtype float32"):
        swiglu(g, u.half())
    with pytest.raises(ValueError, match="gate: expected the concatenated gate_up"):
        swiglu(torch.randn(4, 7))
    with pytest.raises(ValueError, match="activation: expected one of"):
        glu(g, u, activation="relu")
    with pytest.raises(ValueError, match="approximate: expected"):
        geglu(g, u, approximate="erf")
    with pytest.raises(ValueError, match="gate: expected dtype"):
        swiglu(g.to(torch.int32), u.to(torch.int32))
    # The C++ entry point names its own arguments: an output that overlaps an input other than in place.
    d, silu = logitless._tensor.descriptor, logitless._C.GLUOptions()
    # Every buffer held in a name: a descriptor keeps only the address, and a temporary's memory could come back as
    # the next buffer (an overlap this call did not mean to test).
    up, grad_gate = u.clone(), torch.empty(4, 6)
    with pytest.raises(ValueError, match="grad_up: expected memory that does not overlap grad_y"):
        logitless._C.glu_backward(d(u, "grad_y"), d(g, "gate"), d(up, "up"), silu, d(grad_gate, "gg"),
                                  d(u, "grad_up"), 0)
    with pytest.raises(ValueError, match="y: expected rows that do not overlap"):
        logitless._C.glu_forward(d(g, "gate"), d(u, "up"), silu, d(torch.empty(6).expand(4, 6), "y"), 0)


# ----------------------------------------------------------------------------------------------------
# torch.library and torch.compile


def _op_samples(device):
    g, u = make_inputs((3, 4, 16), torch.float32, device=device)
    gu, _ = make_inputs((5, 16), torch.bfloat16, device=device, concat=True)
    dy = torch.randn(3, 4, 16, device=device)
    dy2 = torch.randn(5, 16, device=device).to(torch.bfloat16)
    return [
        (torch.ops.logitless.glu_forward.default, (g.clone().requires_grad_(True), u.clone().requires_grad_(True), 0,
                                                   0)),
        (torch.ops.logitless.glu_forward.default, (gu.clone().requires_grad_(True), None, 1, 0)),
        (torch.ops.logitless.glu_backward.default, (dy, g, u, 2, 0)),
        (torch.ops.logitless.glu_backward.default, (dy2, gu, None, 0, 0)),
        (torch.ops.logitless.glu_backward_.default, (dy, g.clone(), u.clone(), 1, 0)),
        (torch.ops.logitless.glu_backward_.default, (dy2, gu.clone(), None, 0, 0)),
    ]


def test_opcheck():
    for op, args in _op_samples("cpu"):
        torch.library.opcheck(op, args)


@pytest.mark.parametrize("concat", [False, True], ids=["separate", "gate_up"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_compile_fullgraph_matches_eager_bitwise(dtype, concat):
    torch._dynamo.reset()
    gate, up = make_inputs((3, 4, 64), dtype, concat=concat)
    dy = torch.randn(3, 4, 64).to(dtype)

    def f(g, u):
        return swiglu(g, u) if u is not None else geglu(g)

    outs = [run(fn, gate, up, dy) for fn in (f, torch.compile(f, fullgraph=True))]
    for a, b in zip(*outs):
        assert (a is None and b is None) or torch.equal(a, b)


def test_compile_with_inplace_backward_and_a_model_around_it():
    torch._dynamo.reset()
    w1, w2 = torch.randn(32, 16) * 0.2, torch.randn(32, 16) * 0.2
    x = torch.randn(2, 5, 16)

    def mlp(x, w1, w2):
        return swiglu(x @ w1.t(), x @ w2.t(), inplace_backward=True).pow(2).sum()

    results = []
    for fn in (mlp, torch.compile(mlp, fullgraph=True)):
        leaves = [t.clone().requires_grad_(True) for t in (x, w1, w2)]
        fn(*leaves).backward()
        results.append([t.grad for t in leaves])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_compile_dynamic_shapes():
    torch._dynamo.reset()
    fn = torch.compile(lambda gu: swiglu(gu[:, :-1]), fullgraph=True, dynamic=True)
    for T in (5, 9):
        gu = torch.randn(2, T + 1, 32, requires_grad=True)
        y = fn(gu)
        y.sum().backward()
        g2 = gu.detach().clone().requires_grad_(True)
        swiglu(g2[:, :-1]).sum().backward()
        torch.testing.assert_close(y, swiglu(gu.detach()[:, :-1]), rtol=0, atol=0)
        torch.testing.assert_close(gu.grad, g2.grad, rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------------
# CUDA


@needs_cuda
@pytest.mark.parametrize("algo", ["auto", "vector", "scalar"])
@pytest.mark.parametrize("concat", [False, True], ids=["separate", "gate_up"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("inter", [3, 96, 1000, 14336])
def test_cuda_matches_reference(inter, dtype, activation, concat, algo):
    es = torch.tensor([], dtype=dtype).element_size()
    if algo == "vector" and (inter * es) % 16:
        pytest.skip("rows the vector kernel does not take")
    gate, up = make_inputs((37, inter), dtype, device="cuda", concat=concat)
    check(gate, up, activation, algo=algo)


@needs_cuda
@pytest.mark.parametrize("concat", [False, True], ids=["separate", "gate_up"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_matches_cpu_backend(dtype, concat):
    gate, up = make_inputs((4, 257, 1408), dtype, concat=concat)
    dy = torch.randn(4, 257, 1408).to(dtype)
    outs = []
    for device in ("cpu", "cuda"):
        g = gate.to(device)
        u = None if up is None else up.to(device)
        for activation in ACTIVATIONS:
            outs.append((device, activation, run(lambda a, b: glu(a, b, activation=activation), g, u, dy.to(device))))
    n = len(ACTIVATIONS)
    for (_, act, cpu), (_, _, gpu) in zip(outs[:n], outs[n:]):
        for a, b, what in zip(gpu, cpu, ("y", "grad_gate", "grad_up")):
            if b is None:
                continue
            # Two roundings (one per backend) of values that agree to float32: one ulp apart at most.
            rtol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
            scale = b.float().abs().max().item()
            torch.testing.assert_close(a.cpu().float(), b.float(), rtol=rtol, atol=1e-5 * scale,
                                       msg=lambda m: f"{act} {what}: {m}")


@needs_cuda
def test_cuda_inplace_backward_in_a_model():
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    w1 = (torch.randn(512, 256, device="cuda") * 0.05).to(torch.bfloat16)
    w2 = (torch.randn(512, 256, device="cuda") * 0.05).to(torch.bfloat16)
    grads = []
    for inplace in (False, True):
        leaves = [t.clone().requires_grad_(True) for t in (x, w1, w2)]
        a, b, c = leaves
        swiglu(a @ b.t(), a @ c.t(), inplace_backward=inplace).float().pow(2).sum().backward()
        grads.append([t.grad for t in leaves])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@needs_cuda
def test_cuda_runs_on_the_current_stream():
    gate, up = make_inputs((256, 4096), torch.bfloat16, device="cuda")
    want = swiglu(gate, up)

    def go():
        g = (gate + 0).requires_grad_(True)
        y = swiglu(g, up)
        y.backward(torch.ones_like(y))
        return y, g.grad

    got, grad = on_a_side_stream_behind_a_sleep(go)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    g2 = gate.clone().requires_grad_(True)
    swiglu(g2, up).backward(torch.ones_like(want))
    torch.testing.assert_close(grad, g2.grad, rtol=0, atol=0)


@needs_cuda
@pytest.mark.parametrize("concat", [False, True], ids=["separate", "gate_up"])
def test_cuda_graph_capture(concat):
    gate, up = make_inputs((64, 2048), torch.bfloat16, device="cuda", concat=concat)
    leaves = [gate.clone().requires_grad_(True)] + ([] if up is None else [up.clone().requires_grad_(True)])

    def step():
        y = swiglu(*leaves)
        y.float().pow(2).sum().backward()
        return y.detach()

    graph, y_graph = capture_cuda_graph(step, leaves)
    graph.replay()
    torch.cuda.synchronize()
    got = [y_graph.clone()] + [t.grad.clone() for t in leaves]
    fresh = [t.detach().clone().requires_grad_(True) for t in leaves]
    y = swiglu(*fresh)
    y.float().pow(2).sum().backward()
    for a, b in zip(got, [y.detach()] + [t.grad for t in fresh]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@needs_cuda
def test_cuda_compile_and_opcheck():
    torch._dynamo.reset()
    gate, up = make_inputs((4, 7, 256), torch.bfloat16, device="cuda")
    dy = torch.randn(4, 7, 256, device="cuda").to(torch.bfloat16)
    f = lambda g, u: swiglu(g, u)  # noqa: E731
    outs = [run(fn, gate, up, dy) for fn in (f, torch.compile(f, fullgraph=True))]
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    for op, args in _op_samples("cuda"):
        torch.library.opcheck(op, args)
