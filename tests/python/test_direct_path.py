"""The direct eager path of the custom ops (logitless._autograd.custom_op): taken by plain eager calls, never where
torch has to see the op (torch.compile, FakeTensorMode, a function mode, a DTensor or other tensor subclass), and the
same results and gradients, bit for bit, as the dispatched op."""
import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import logitless
from logitless import _autograd


class _PassThrough(TorchFunctionMode):
    """A function mode that changes nothing: with it active every call takes the dispatched op."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _PassThroughDispatch(TorchDispatchMode):
    """A dispatch mode that changes nothing; unlike a function mode it stays on through a backward it encloses."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _Dispatched:
    """Every op call through the dispatcher while active: the reference the direct path must match."""

    def __enter__(self):
        self.saved = _autograd.eager_ok
        _autograd.eager_ok = lambda tensors: False

    def __exit__(self, *exc):
        _autograd.eager_ok = self.saved


def _counts():
    return dict(_autograd.direct_calls)


def _grown(before):
    now = _autograd.direct_calls
    return {k: now[k] - before.get(k, 0) for k in now if now[k] != before.get(k, 0)}


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _rms_norm(residual):
    g = _gen()
    x, w, r = torch.randn(6, 32, generator=g), torch.randn(32, generator=g), torch.randn(6, 32, generator=g)
    dy = torch.randn(6, 32, generator=g)

    def run(x, w, r):
        out = logitless.rms_norm(x, w, residual=r if residual else None)
        y = out[0] if residual else out
        return (y * dy).sum() + (out[1].square().sum() if residual else 0)

    return run, [x, w, r]


def _rms_norm_strided_grads(residual):
    """The outputs used transposed: their incoming gradients arrive with a strided last dimension."""
    g = _gen()
    x, w, r = torch.randn(6, 32, generator=g), torch.randn(32, generator=g), torch.randn(6, 32, generator=g)
    dy, ds = torch.randn(32, 6, generator=g), torch.randn(32, 6, generator=g)

    def run(x, w, r):
        out = logitless.rms_norm(x, w, residual=r if residual else None)
        y = out[0] if residual else out
        return (y.t() * dy).sum() + ((out[1].t() * ds).sum() if residual else 0)

    return run, [x, w, r]


def _cross_entropy(reduction):
    g = _gen()
    logits, target = torch.randn(7, 33, generator=g), torch.randint(0, 33, (7,), generator=g)
    target[2] = -100
    up = torch.rand(7, generator=g)

    def run(logits):
        loss = logitless.cross_entropy(logits, target, reduction=reduction, z_loss=1e-3)
        return (loss * up).sum() if reduction == "none" else 3 * loss

    return run, [logits]


def _glu(concatenated, inplace):
    g = _gen()
    gate, up, dy = torch.randn(5, 16, generator=g), torch.randn(5, 16, generator=g), torch.randn(5, 8, generator=g)

    def run(gate, up):
        a, b = gate * 1, up * 1  # activations (the in-place backward writes only over those)
        y = logitless.swiglu(torch.cat([a[:, :8], b[:, :8]], -1)) if concatenated else logitless.swiglu(
            a[:, :8].contiguous(), b[:, :8].contiguous(), inplace_backward=inplace)
        return (y * dy).sum()

    return run, [gate, up]


def _rope():
    g = _gen()
    q, k = torch.randn(2, 4, 6, 16, generator=g), torch.randn(2, 2, 6, 16, generator=g)
    cos, sin = torch.randn(2, 6, 16, generator=g), torch.randn(2, 6, 16, generator=g)
    dq, dk = torch.randn(2, 4, 6, 16, generator=g), torch.randn(2, 2, 6, 16, generator=g)

    def run(q, k):
        qr, kr = logitless.rope(q, k, cos, sin)
        return (qr * dq).sum() + (kr * dk).sum()

    return run, [q, k]


def _policy():
    g = _gen()
    logits = torch.randn(2, 5, 40, generator=g)
    ids, adv = torch.randint(0, 40, (2, 4), generator=g), torch.randn(2, generator=g)
    ref = -torch.rand(2, 4, generator=g)

    def run(logits):
        loss = logitless.grpo_loss(logits, ids, adv, ref_logp=ref)
        return 2 * loss + logitless.selective_log_softmax(logits[:, :-1], ids).sum()

    return run, [logits]


def _linear():
    g = _gen()
    h, w = torch.randn(2, 5, 16, generator=g), 0.3 * torch.randn(40, 16, generator=g)
    ids, adv = torch.randint(0, 40, (2, 4), generator=g), torch.randn(2, generator=g)
    target = torch.randint(0, 40, (2, 5), generator=g)

    def run(h, w):
        total = logitless.linear_cross_entropy(h, w, target) + logitless.linear_cross_entropy(
            h, w, target, schedule="recompute", reduction="sum")
        total = total + logitless.linear_grpo_loss(h, w, ids, adv, beta=0.0)
        return total + logitless.linear_selective_log_softmax(h[:, :-1], w, ids).sum()

    return run, [h, w]


CASES = {
    "rms_norm": lambda: _rms_norm(False), "rms_norm_residual": lambda: _rms_norm(True),
    "rms_norm_strided_grads": lambda: _rms_norm_strided_grads(False),
    "rms_norm_residual_strided_grads": lambda: _rms_norm_strided_grads(True),
    "cross_entropy_mean": lambda: _cross_entropy("mean"), "cross_entropy_none": lambda: _cross_entropy("none"),
    "glu": lambda: _glu(False, False), "glu_inplace": lambda: _glu(False, True),
    "glu_gate_up": lambda: _glu(True, False),
    "rope": _rope, "policy": _policy, "linear": _linear,
}


def _run(case, mode=None):
    fn, inputs = CASES[case]()
    leaves = [t.clone().requires_grad_(True) for t in inputs]
    before = _counts()
    if mode is None:
        out = fn(*leaves)
        out.backward()
    else:
        with mode:
            out = fn(*leaves)
            out.backward()
    return out.detach(), [t.grad for t in leaves], _grown(before)


@pytest.mark.parametrize("case", list(CASES))
def test_eager_takes_the_direct_path_and_matches_the_op_bitwise(case):
    out, grads, direct = _run(case)
    assert direct, "the eager call never took the direct path"
    ref_out, ref_grads, ref_direct = _run(case, _Dispatched())
    assert not ref_direct, f"the direct path ran: {ref_direct}"
    assert torch.equal(out, ref_out)
    for a, b in zip(grads, ref_grads):
        assert (a is None and b is None) or torch.equal(a, b)


def test_forward_and_backward_ops_both_go_direct():
    _, _, direct = _run("rms_norm")
    assert direct == {"logitless::rms_norm_forward": 1, "logitless::rms_norm_backward": 1}
    _, _, direct = _run("cross_entropy_mean")
    assert direct == {"logitless::cross_entropy_forward_backward_out": 1, "logitless::scale_rows_": 1}


@pytest.mark.parametrize("case", ["rms_norm", "rms_norm_residual", "cross_entropy_none"])
def test_a_mode_entered_for_the_backward_takes_the_backward_op(case):
    """A direct forward's backward runs the backward op where the backward is not eager_ok itself (as under a
    mode entered only for it), with the same bits."""
    fn, inputs = CASES[case]()
    leaves = [t.clone().requires_grad_(True) for t in inputs]
    before = _counts()
    out = fn(*leaves)
    forward = _grown(before)
    with _PassThroughDispatch():
        out.backward()
    assert forward and _grown(before) == forward
    _, ref_grads, _ = _run(case)
    for a, b in zip([t.grad for t in leaves], ref_grads):
        assert (a is None and b is None) or torch.equal(a, b)


def test_no_grad_call_goes_direct_without_a_graph():
    x, w = torch.randn(3, 8, requires_grad=True), torch.randn(8)
    before = _counts()
    with torch.no_grad():
        y = logitless.rms_norm(x, w)
    assert _grown(before) == {"logitless::rms_norm_forward": 1} and y.grad_fn is None


@pytest.mark.parametrize("case", ["rms_norm", "cross_entropy_mean", "glu", "rope", "policy"])
def test_compile_never_takes_the_direct_path(case):
    torch._dynamo.reset()
    fn, inputs = CASES[case]()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    leaves = [t.clone().requires_grad_(True) for t in inputs]
    before = _counts()
    out = compiled(*leaves)
    out.backward()
    assert not _grown(before)
    ref_out, ref_grads, _ = _run(case)
    torch.testing.assert_close(out.detach(), ref_out)
    for a, b in zip([t.grad for t in leaves], ref_grads):
        torch.testing.assert_close(a, b)


def test_fake_tensor_mode_never_takes_the_direct_path():
    from torch._subclasses.fake_tensor import FakeTensorMode

    before = _counts()
    with FakeTensorMode():
        x, w = torch.randn(4, 8), torch.randn(8)
        y = logitless.rms_norm(x, w)
        loss = logitless.cross_entropy(torch.randn(4, 10, requires_grad=True), torch.zeros(4, dtype=torch.long))
    assert not _grown(before)
    assert y.shape == (4, 8) and loss.shape == ()


def test_tensor_subclasses_and_meta_tensors_never_take_the_direct_path():
    class Sub(torch.Tensor):
        pass

    x = torch.randn(2, 3)
    assert _autograd.eager_ok([x, None, torch.nn.Parameter(x)])
    assert not _autograd.eager_ok([x.as_subclass(Sub)])
    assert not _autograd.eager_ok([torch.empty(2, 3, device="meta")])
    with _PassThrough():
        assert not _autograd.eager_ok([x])
        before = _counts()
        logitless.rms_norm(x, torch.randn(3))
        assert not _grown(before)
    # Meta tensors are shape inference through the fake kernels, as before.
    before = _counts()
    y = logitless.rms_norm(torch.empty(4, 8, device="meta"), torch.empty(8, device="meta"))
    assert y.device.type == "meta" and y.shape == (4, 8) and not _grown(before)


def test_dtensor_never_takes_the_direct_path():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    # A group of one over an in-process store: no port, no environment variable left for other tests' processes.
    mine = not dist.is_initialized()
    if mine:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        _check_dtensor(init_device_mesh("cpu", (1,)), DTensor, Replicate)
    finally:
        if mine:
            dist.destroy_process_group()


def _check_dtensor(mesh, DTensor, Replicate):
    x = DTensor.from_local(torch.randn(4, 8), mesh, [Replicate()])
    assert not _autograd.eager_ok([x])
    from logitless.rms_norm import _forward

    before = _counts()
    w = DTensor.from_local(torch.randn(8), mesh, [Replicate()])
    # The dispatched op meets DTensor's dispatch (no sharding rule registered), never the C++ entry point.
    with pytest.raises((NotImplementedError, RuntimeError)):
        _forward(x, w, None, 1e-6, 0.0, 0, 0, 0)
    assert not _grown(before)


@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_every_needed_gradient_and_used_output_matches_the_op_bitwise(residual):
    """Which inputs need a gradient and which outputs reach the loss (y unused: no incoming gradient for it)."""
    g = _gen()
    x0, w0, r0 = torch.randn(2, 3, 16, generator=g), torch.randn(16, generator=g), torch.randn(2, 3, 16, generator=g)
    dy, ds = torch.randn(2, 3, 16, generator=g), torch.randn(2, 3, 16, generator=g)

    def run(needs, use_y, use_s):
        x, w, r = (t.clone().requires_grad_(n) for t, n in zip((x0, w0, r0), needs))
        out = logitless.rms_norm(x, w, residual=r if residual else None)
        y, s = out if residual else (out, None)
        total = (y * dy).sum() if use_y else 0
        total = total + (s * ds).sum() if use_s else total
        total.backward()
        return [t.grad for t in (x, w, r)]

    uses = [(True, False), (False, True), (True, True)] if residual else [(True, False)]
    only_residual = [(False, False, True)] if residual else []
    for needs in [(True, True, residual), (True, False, False), (False, True, False)] + only_residual:
        for use_y, use_s in uses:
            got = run(needs, use_y, use_s)
            with _Dispatched():
                want = run(needs, use_y, use_s)
            for a, b in zip(got, want):
                assert (a is None and b is None) or torch.equal(a, b)


def test_checked_settings_are_cached_by_value_and_type():
    """The eager paths check their scalar arguments once per distinct tuple: True equals 1 as a key, and a check that
    refuses a bool must still see it after an equal int passed."""
    logits, target = torch.randn(4, 10, requires_grad=True), torch.randint(0, 10, (4,))
    logitless.cross_entropy(logits, target, ignore_index=1).backward()
    with pytest.raises(TypeError, match="ignore_index"):
        logitless.cross_entropy(logits, target, ignore_index=True)
    x, w = torch.randn(3, 8, requires_grad=True), torch.randn(8)
    logitless.rms_norm(x, w, vectors_per_thread=0)
    with pytest.raises(TypeError, match="vectors_per_thread"):
        logitless.rms_norm(x, w, vectors_per_thread=False)
    # An argument that cannot be a key is checked every time, with the argument's own error.
    with pytest.raises(TypeError, match="eps"):
        logitless.rms_norm(x, w, eps=[1e-6])
    # A 0-d tensor is read on every call: changed in place, the next call sees its new value.
    eps = torch.tensor(1e-6, dtype=torch.float64)
    y1 = logitless.rms_norm(x * 1e-3, w, eps=eps)
    eps.fill_(1.0)
    y2 = logitless.rms_norm(x * 1e-3, w, eps=eps)
    torch.testing.assert_close(y2, logitless.rms_norm(x * 1e-3, w, eps=1.0))
    assert not torch.allclose(y1, y2)


@pytest.mark.parametrize("stats", [(False, False), (True, False), (False, True), (True, True)])
def test_cross_entropy_direct_call_makes_only_the_statistics_asked_for(stats):
    """The fused eager path skips lse and z-loss unless returned; loss and gradient are the op path's bits either
    way, and what is returned is the op path's too."""
    g = _gen(3)
    logits0, target = torch.randn(6, 33, generator=g), torch.randint(0, 33, (6,), generator=g)
    return_lse, return_z = stats

    def run():
        logits = logits0.clone().requires_grad_(True)
        out = logitless.cross_entropy(logits, target, z_loss=1e-3, return_lse=return_lse, return_z_loss=return_z)
        outs = out if isinstance(out, tuple) else (out,)
        outs[0].backward()
        return outs, logits.grad

    before = _counts()
    outs, grad = run()
    assert _grown(before) == {"logitless::cross_entropy_forward_backward_out": 1, "logitless::scale_rows_": 1}
    with _PassThrough():
        ref_outs, ref_grad = run()
    assert len(outs) == len(ref_outs) == 1 + return_lse + return_z
    for a, b in zip(outs, ref_outs):
        assert torch.equal(a, b)
    assert all(not t.requires_grad for t in outs[1:])
    assert torch.equal(grad, ref_grad)
