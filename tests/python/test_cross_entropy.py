"""logitless.cross_entropy and logitless.nn.CrossEntropyLoss against a float64 torch reference.

CPU tests run everywhere (the CPU backend is a real backend); CUDA tests skip without a GPU.
Run: PYTHONPATH=build/<dir>/python python -m pytest tests/python -q
"""
import math

import pytest
import torch
import torch.nn.functional as F

import logitless
from _helpers import (
    CPU_GRAD_TOL,
    DTYPES,
    REDUCTIONS,
    assert_compiled_matches_eager,
    assert_grads_match_central_differences,
    assert_graph_replays_match_eager,
    capture_cuda_graph,
    check_dynamic_shapes_against_torch,
    extra_peak_memory,
    needs_cuda,
    on_a_side_stream_behind_a_sleep,
    run_or_skip_unavailable,
    upstream_grad,
)
from logitless import cross_entropy

# Error budget against the float64 reference evaluated on the same (already rounded) inputs: the loss is
# float32 whatever the dtype; the gradient is stored in the logits' dtype, so it carries that rounding.
# The CPU backend computes in double; the CUDA kernels accumulate in float32 over up to 256000 terms.
LOSS_RTOL = {"cpu": 2e-5, "cuda": 1e-4}
GRAD_TOL = {"cpu": CPU_GRAD_TOL, "cuda": {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}}

# Option sets covering every argument alone and together (weights, smoothing and ignore_index interact in
# the mean's denominator; z-loss and softcap change lse and the gradient's chain rule).
OPTIONS = {
    "plain": {},
    "weight": {"weight": True},
    "smoothing": {"label_smoothing": 0.1},
    "z_loss": {"z_loss": 1e-2},
    "softcap": {"softcap": 3.0},
    "ignore": {"ignore_index": 2},
    "all": {"weight": True, "label_smoothing": 0.2, "z_loss": 1e-3, "softcap": 5.0, "ignore_index": -100},
}


# ----------------------------------------------------------------------------------------------------
# Reference and helpers


def reference(logits, target, weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0,
              z_loss=0.0, softcap=None):
    """float64 loss (autograd-capable w.r.t. `logits`), lse and z-loss per row; torch's cross-entropy plus
    the z-loss and softcap terms added by hand, with the documented mean over no rows = 0."""
    x = logits.double()
    if softcap:
        x = softcap * torch.tanh(x / softcap)
    V = x.shape[-1]
    x2, t = x.reshape(-1, V), target.reshape(-1).long()
    w = None if weight is None else weight.double()
    valid = t != ignore_index
    per_row = F.cross_entropy(x2, t, weight=w, ignore_index=ignore_index, reduction="none",
                              label_smoothing=label_smoothing) if t.numel() else x2.sum(-1)
    lse = torch.where(valid, torch.logsumexp(x2, -1), torch.zeros_like(per_row))
    z = z_loss * lse * lse
    per_row = per_row + z
    shape = target.shape
    if reduction == "none":
        return per_row.reshape(shape), lse.reshape(shape), z.reshape(shape)
    total = per_row.sum()
    if reduction == "mean":
        # The class weights normalize the cross-entropy terms; the z-loss term is averaged over the counted rows.
        denom = (w[t[valid]] if w is not None else torch.ones_like(per_row[valid])).sum()
        total = (per_row - z).sum() / denom + z.sum() / valid.sum() if denom != 0 else total * 0
    return total, lse.reshape(shape), z.reshape(shape)


def make_inputs(shape, V, dtype, device="cpu", ignore_frac=0.2, ignore_index=-100, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*shape, V, generator=g) * 2).to(dtype)
    target = torch.randint(0, V, shape, generator=g)
    if ignore_frac:
        target[torch.rand(shape, generator=g) < ignore_frac] = ignore_index
    return logits.to(device), target.to(device)


def assert_grad_close(got, want, dtype):
    tol = GRAD_TOL[got.device.type][dtype]
    scale = want.abs().max().item() if want.numel() else 0.0
    torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=tol * scale + 1e-12)


def assert_loss_close(got, want):
    rtol = LOSS_RTOL[got.device.type]
    torch.testing.assert_close(got.double(), want.detach(), rtol=rtol, atol=rtol)


def check_against_reference(logits, target, reduction="mean", inplace_backward=False, algo="auto", **opts):
    """Loss, lse, z-loss and gradient (with a non-trivial upstream gradient) against the reference."""
    dtype = logits.dtype
    ref_in = logits.detach().clone().requires_grad_(True)
    want, want_lse, want_z = reference(ref_in, target, reduction=reduction, **opts)
    gout = upstream_grad(want)
    want.backward(gout.double())

    leaf = logits.detach().clone().requires_grad_(True)
    # A non-leaf on the way in, as in a model (inplace_backward refuses leaves).
    x = leaf * 1 if inplace_backward else leaf
    loss, lse, z = cross_entropy(x, target, reduction=reduction, return_lse=True, return_z_loss=True,
                                 inplace_backward=inplace_backward, algo=algo, **opts)
    assert loss.dtype == torch.float32 and loss.shape == want.shape
    assert_loss_close(loss, want)
    assert_loss_close(lse, want_lse)
    assert_loss_close(z, want_z)
    assert not lse.requires_grad and not z.requires_grad
    loss.backward(gout.to(loss.dtype))
    assert_grad_close(leaf.grad, ref_in.grad, dtype)


def resolve(opts, V, device="cpu"):
    opts = dict(opts)
    if opts.pop("weight", False):
        opts["weight"] = torch.rand(V, generator=torch.Generator().manual_seed(7), dtype=torch.float64).to(device) + 0.1
    return opts


# ----------------------------------------------------------------------------------------------------
# Values and gradients (CPU backend)


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_reference(dtype, reduction, option):
    V = 37
    opts = resolve(OPTIONS[option], V)
    logits, target = make_inputs((3, 5), V, dtype, ignore_index=opts.get("ignore_index", -100))
    check_against_reference(logits, target, reduction=reduction, **opts)


@pytest.mark.parametrize("option", ["plain", "all"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_inplace_backward_matches_reference(dtype, reduction, option):
    V = 41
    opts = resolve(OPTIONS[option], V)
    logits, target = make_inputs((4, 3), V, dtype)
    check_against_reference(logits, target, reduction=reduction, inplace_backward=True, **opts)


@pytest.mark.parametrize(
    "shape,V",
    [((0,), 7), ((1,), 7), ((5,), 1), ((4,), 3), ((2,), 32003), ((2, 3, 4), 11), ((), 9)],
    ids=["N0", "N1", "V1", "V3", "V32003", "3d", "unbatched"],
)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_shapes(shape, V, reduction):
    logits, target = make_inputs(shape, V, torch.float32, ignore_frac=0.0)
    check_against_reference(logits, target, reduction=reduction)
    if reduction != "none":
        check_against_reference(logits, target, reduction=reduction, inplace_backward=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_shifted_view_goes_in_without_copy(dtype):
    # The language-model shift: logits[:, :-1] predicts tokens[:, 1:]. Both are non-contiguous views.
    B, T, V = 2, 6, 29
    full, tokens = make_inputs((B, T + 1), V, dtype, ignore_frac=0.1)
    logits, target = full[:, :-1, :], tokens[:, 1:]
    assert not logits.is_contiguous() and not target.is_contiguous()
    for reduction in REDUCTIONS:
        check_against_reference(logits, target, reduction=reduction, label_smoothing=0.1)

    # In place, the gradient lands in the storage of `full` itself: proof that the view itself reached
    # C++ rather than a contiguous copy of it; the last position is left alone.
    full_req = full.clone().requires_grad_(True)
    base = full_req * 1
    loss = cross_entropy(base[:, :-1, :], target, inplace_backward=True)
    ref = logits.detach().clone().requires_grad_(True)
    reference(ref, target)[0].backward()
    assert_grad_close(base[:, :-1, :].detach(), ref.grad, dtype)
    torch.testing.assert_close(base[:, -1, :].detach(), full[:, -1, :])
    loss.backward()
    assert_grad_close(full_req.grad[:, :-1], ref.grad, dtype)
    assert (full_req.grad[:, -1] == 0).all()


def test_padded_rows_and_strided_target():
    # Rows with stride > V (a slice of a wider buffer), targets every other element.
    V = 19
    wide, _ = make_inputs((6,), V + 5, torch.float32, ignore_frac=0.0)
    logits = wide[:, :V]
    target = torch.randint(0, V, (12,), generator=torch.Generator().manual_seed(3))[::2]
    assert logits.stride(0) == V + 5 and target.stride(0) == 2
    for reduction in REDUCTIONS:
        check_against_reference(logits, target, reduction=reduction, z_loss=1e-3)


@pytest.mark.parametrize("target_dtype", [torch.int32, torch.int64], ids=str)
def test_target_dtypes(target_dtype):
    logits, target = make_inputs((8,), 13, torch.float32)
    check_against_reference(logits, target.to(target_dtype), reduction="mean")


@pytest.mark.parametrize("weight_dtype", [torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_weight_of_any_float_dtype(weight_dtype):
    V = 10
    logits, target = make_inputs((6,), V, torch.float32)
    weight = (torch.rand(V, generator=torch.Generator().manual_seed(2)) + 0.5).to(weight_dtype)
    got = cross_entropy(logits, target, weight=weight)
    want, _, _ = reference(logits, target, weight=weight.float())
    assert_loss_close(got, want)


@pytest.mark.parametrize("inplace_backward", [False, True])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_all_ignored_mean_is_zero_not_nan(reduction, inplace_backward):
    if inplace_backward and reduction == "none":
        pytest.skip("inplace_backward applies to sum/mean")
    leaf = torch.randn(4, 6, requires_grad=True)
    target = torch.full((4,), -100)
    loss = cross_entropy(leaf * 1, target, reduction=reduction, inplace_backward=inplace_backward)
    assert (loss == 0).all()
    loss.sum().backward()
    assert (leaf.grad == 0).all()


def test_return_values_and_order():
    logits, target = make_inputs((5,), 8, torch.float32)
    loss = cross_entropy(logits, target)
    assert isinstance(loss, torch.Tensor)
    loss2, lse = cross_entropy(logits, target, return_lse=True)
    loss3, z = cross_entropy(logits, target, z_loss=0.5, return_z_loss=True)
    _, lse4, z4 = cross_entropy(logits, target, z_loss=0.5, return_lse=True, return_z_loss=True)
    torch.testing.assert_close(loss2, loss)
    torch.testing.assert_close(lse4, lse)
    torch.testing.assert_close(z4, z)
    torch.testing.assert_close(z, 0.5 * lse * lse)
    assert lse.shape == target.shape and lse.dtype == torch.float32
    assert (lse[target == -100] == 0).all()


def test_no_grad_leaves_logits_untouched_even_inplace():
    logits, target = make_inputs((4,), 9, torch.float32)
    before = logits.clone()
    x = logits.clone().requires_grad_(True) * 1
    with torch.no_grad():
        cross_entropy(x, target, inplace_backward=True)
    torch.testing.assert_close(x.detach(), before)


# The C++ API takes float32/16/bf16 only, so gradients cannot be checked by finite differences in float64
# here. Float32 with a wide step and loose tolerances still catches a wrong formula (a sign, a missing
# term, a bad chain rule); the precise check is test_matches_reference against the float64 reference's
# autograd.
GRADCHECK_OPTS = dict(label_smoothing=0.1, z_loss=1e-2, softcap=4.0)


def _gradcheck_inputs():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 7, generator=g, requires_grad=True)
    t = torch.tensor([1, -100, 6])
    w = torch.rand(7, generator=g) + 0.5
    return x, t, w


@pytest.mark.filterwarnings("ignore:Input #0 requires gradient and is not a double")
def test_gradcheck_float32_reduction_none():
    # torch.autograd.gradcheck differentiates one graph many times (retain_graph=True); the reduction none
    # schedule (saved lse, gradient computed in backward) supports that, so it gets the real gradcheck.
    x, t, w = _gradcheck_inputs()
    fn = lambda x: cross_entropy(x, t, weight=w, reduction="none", **GRADCHECK_OPTS)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x,), eps=1e-3, atol=2e-3, rtol=2e-2)


@pytest.mark.parametrize("inplace_backward", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_finite_differences_fused(reduction, inplace_backward):
    # The fused sum/mean schedules compute the gradient once, in the forward, and their backward consumes
    # it (a second backward over the same graph raises, see test_second_backward_over_retained_graph_raises),
    # which gradcheck's repeated backward passes trip over. Same central differences, by hand.
    x, t, w = _gradcheck_inputs()
    f = lambda v: cross_entropy(v, t, weight=w, reduction=reduction, **GRADCHECK_OPTS)  # noqa: E731
    xi = x * 1
    (2.0 * cross_entropy(xi if inplace_backward else x, t, weight=w, reduction=reduction,
                         inplace_backward=inplace_backward, **GRADCHECK_OPTS)).backward()
    assert_grads_match_central_differences(f, (x,), scale=2.0)


# ----------------------------------------------------------------------------------------------------
# In place: gradient in the logits' storage, and autograd's version counter as the safety net


def test_inplace_writes_gradient_into_logits_storage():
    g = torch.Generator().manual_seed(11)
    h = torch.randn(6, 8, generator=g, requires_grad=True)
    W = torch.randn(13, 8, generator=g, requires_grad=True)
    t = torch.randint(0, 13, (6,), generator=g)

    logits = h @ W.t()
    ptr = logits.data_ptr()
    loss = cross_entropy(logits, t, inplace_backward=True)
    # After the forward the logits' storage holds d(loss)/d(logits).
    ref_logits = (h @ W.t()).detach().requires_grad_(True)
    reference(ref_logits, t)[0].backward()
    assert logits.data_ptr() == ptr
    torch.testing.assert_close(logits.detach(), ref_logits.grad, rtol=1e-5, atol=1e-7)

    (3.0 * loss).backward()
    h2, W2 = h.detach().clone().requires_grad_(True), W.detach().clone().requires_grad_(True)
    (3.0 * F.cross_entropy(h2 @ W2.t(), t)).backward()
    torch.testing.assert_close(h.grad, h2.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(W.grad, W2.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("producer", ["tanh", "sigmoid", "exp", "softmax"])
def test_inplace_raises_when_another_node_saved_the_logits(producer):
    # These ops save their output for their backward; overwriting it with the gradient must not give
    # wrong gradients: torch's version counter makes their backward raise.
    x = torch.randn(4, 9, requires_grad=True)
    t = torch.randint(0, 9, (4,))
    fn = {"tanh": torch.tanh, "sigmoid": torch.sigmoid, "exp": torch.exp,
          "softmax": lambda v: torch.softmax(v, -1)}[producer]
    y = fn(x)
    loss = cross_entropy(y, t, inplace_backward=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_inplace_without_it_the_same_graph_is_fine():
    x = torch.randn(4, 9, requires_grad=True)
    t = torch.randint(0, 9, (4,))
    cross_entropy(torch.tanh(x), t).backward()
    want = x.grad.clone()
    x.grad = None
    xr = x.detach().clone().requires_grad_(True)
    F.cross_entropy(torch.tanh(xr), t).backward()
    torch.testing.assert_close(want, xr.grad)


def test_inplace_refuses_a_leaf_and_views_of_one():
    x = torch.randn(3, 6, requires_grad=True)
    t = torch.tensor([0, 1, 2])
    for logits in (x, x[:, :5], x.view(3, 2, 3)[:, 0, :]):
        with pytest.raises(ValueError, match="logits"):
            cross_entropy(logits, t[: logits.shape[0]], inplace_backward=True)
    assert x.grad is None


@pytest.mark.parametrize("inplace_backward", [False, True])
def test_second_backward_over_retained_graph_raises(inplace_backward):
    # The saved gradient is scaled in place by the first backward; a second one must not scale it again.
    x = torch.randn(3, 5, requires_grad=True)
    loss = cross_entropy(x * 1, torch.tensor([0, 1, 2]), inplace_backward=inplace_backward)
    loss.backward(torch.tensor(2.0), retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_double_backward_raises():
    x = torch.randn(3, 5, requires_grad=True)
    t = torch.tensor([0, 1, 2])
    for reduction in ["mean", "none"]:
        loss = cross_entropy(x, t, reduction=reduction).sum()
        with pytest.raises(RuntimeError, match="double backward"):
            torch.autograd.grad(loss, x, create_graph=True)


# ----------------------------------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize(
    "kwargs,name",
    [
        (dict(reduction="avg"), "reduction"),
        (dict(algo="fastest"), "algo"),
        (dict(label_smoothing=1.5), "label_smoothing"),
        (dict(z_loss=-1.0), "z_loss"),
        (dict(softcap=-2.0), "softcap"),
        (dict(weight=torch.ones(5)), "weight"),
        (dict(target=torch.zeros(4)), "target"),
        (dict(target=torch.zeros(3, dtype=torch.long)), "target"),
        (dict(logits=torch.randn(4, 7, dtype=torch.float64)), "logits"),
        (dict(logits=torch.randn(7, 4).t()), "logits"),
        (dict(logits=torch.randn(4, 7).to(torch.complex64)), "logits"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_bad_arguments_raise_value_error_naming_them(kwargs, name):
    args = dict(logits=torch.randn(4, 7), target=torch.tensor([0, 1, 2, 3]))
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        cross_entropy(**args)


@pytest.mark.parametrize("requires_grad", [False, True])
def test_target_out_of_range_names_first_bad_row(requires_grad):
    x = torch.randn(5, 7, requires_grad=requires_grad)
    t = torch.tensor([0, 1, -100, 7, -3])
    with pytest.raises(ValueError, match="target.*row 3"):
        cross_entropy(x, t)


def test_unchecked_bad_target_gives_nan_row():
    x = torch.randn(4, 7, requires_grad=True)
    t = torch.tensor([0, 9, 2, -100])
    loss = cross_entropy(x, t, reduction="none", check_targets=False)
    assert torch.isnan(loss[1]) and torch.isfinite(loss[[0, 2, 3]]).all()
    loss.sum().backward()
    assert torch.isnan(x.grad[1]).all() and torch.isfinite(x.grad[[0, 2, 3]]).all()


# ----------------------------------------------------------------------------------------------------
# torch.library and torch.compile


def _op_samples(device="cpu"):
    logits, target = make_inputs((4,), 9, torch.float32, device=device)
    weight = torch.rand(9, device=device) + 0.5
    options = (-100, 2, 0.1, 1e-2, 0.0, True, 0)
    lse = torch.logsumexp(logits, -1)
    ops = torch.ops.logitless
    return [
        (ops.cross_entropy_forward, (logits, target, weight) + options),
        (ops.cross_entropy_forward,
         (logits.clone().requires_grad_(True), target, None, -100, 0, 0.0, 0.0, 2.0, True, 0)),
        (ops.cross_entropy_forward, (logits.clone().requires_grad_(True), target, weight) + options),
        (ops.cross_entropy_forward_backward_out, (logits, target, weight) + options + (torch.empty_like(logits),)),
        (ops.cross_entropy_forward_backward_, (logits.clone(), target, weight) + options),
        (ops.cross_entropy_backward, (logits, target, weight, lse, torch.tensor(1.5, device=device)) + options),
        (ops.cross_entropy_backward,
         (logits, target, None, lse, torch.rand(4, device=device), -100, 0, 0.0, 0.0, 0.0, False, 0)),
        (ops.scale_rows_, (torch.randn(4, 9, device=device), torch.tensor(0.5, device=device))),
        (ops.scale_rows_, (torch.randn(4, 9, device=device), torch.tensor([1.0, 2.0, 1.0, 0.5], device=device))),
    ]


# The ops other than cross_entropy_forward run only inside autograd formulas (grad mode off), so they are
# checked with inputs that do not require grad.
@pytest.mark.parametrize("index", range(9))
def test_opcheck(index):
    op, args = _op_samples()[index]
    torch.library.opcheck(op, args)


def _model(h, W, t, reduction, inplace_backward):
    loss = cross_entropy(h @ W.t(), t, reduction=reduction, inplace_backward=inplace_backward,
                         label_smoothing=0.1, z_loss=1e-3, softcap=8.0)
    return loss.sum() if reduction == "none" else loss


@pytest.mark.parametrize("reduction,inplace_backward", [("mean", False), ("mean", True), ("none", False)])
def test_compile_fullgraph_matches_eager(reduction, inplace_backward):
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(4)
    h = torch.randn(12, 16, generator=g, requires_grad=True)
    W = torch.randn(33, 16, generator=g, requires_grad=True)
    t = torch.randint(0, 33, (12,), generator=g)
    assert_compiled_matches_eager(_model, (h, W), t, reduction, inplace_backward, upstream=2, rtol=1e-5, atol=1e-6)


# Inductor pads the rows of intermediates on CUDA (comprehensive padding), and on the CPU when asked: the logits are
# then a matmul's output with padded rows, the in-place forward writes the gradient into that buffer and saves it
# with those strides. The backward must read them as they are (a scale in place compiled into a copy that read
# the saved gradient as contiguous).
@pytest.mark.parametrize("shape", [(12,), (3, 4)])
@pytest.mark.parametrize("inplace_backward", [False, True])
def test_compile_fullgraph_with_padded_rows_matches_eager(shape, inplace_backward):
    cfg = torch._inductor.config
    if not hasattr(cfg, "disable_padding_cpu"):
        pytest.skip("this torch has no switch for inductor's padding on the CPU")
    from torch._inductor import metrics

    torch._dynamo.reset()
    g = torch.Generator().manual_seed(5)
    V = 1031  # more than inductor's 1024-element threshold and not a multiple of 32: rows padded to 1056
    h = torch.randn(*shape, 16, generator=g, requires_grad=True)
    W = torch.randn(V, 16, generator=g, requires_grad=True)
    t = torch.randint(0, V, shape, generator=g)
    with cfg.patch(disable_padding_cpu=False, comprehensive_padding=True, fx_graph_cache=False):
        metrics.reset()
        assert_compiled_matches_eager(_model, (h, W), t, "mean", inplace_backward, upstream=2, rtol=1e-5, atol=1e-6)
        assert metrics.num_comprehensive_padding > 0, "the test needs inductor to pad the matmul's rows"


def test_compile_dynamic_shapes():
    check_dynamic_shapes_against_torch(lambda h, W, t, red: cross_entropy(h @ W.t(), t, reduction=red))


def test_compile_inplace_on_a_graph_input():
    # The logits come from outside the compiled region; the compiled call mutates its input.
    torch._dynamo.reset()
    fn = torch.compile(lambda x, t: cross_entropy(x, t, inplace_backward=True), fullgraph=True)
    h = torch.randn(6, 8, requires_grad=True)
    W = torch.randn(13, 8, requires_grad=True)
    t = torch.randint(0, 13, (6,))
    fn(h @ W.t(), t).backward()
    h2, W2 = h.detach().clone().requires_grad_(True), W.detach().clone().requires_grad_(True)
    F.cross_entropy(h2 @ W2.t(), t).backward()
    torch.testing.assert_close(h.grad, h2.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(W.grad, W2.grad, rtol=1e-5, atol=1e-6)

    y = torch.tanh(h @ W.t())  # tanh saves y, which the compiled call then overwrites: must raise
    loss = fn(y, t)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_compile_fullgraph_no_grad_and_shifted_view():
    torch._dynamo.reset()

    @torch.compile(fullgraph=True)
    def shifted(full, tokens):
        return cross_entropy(full[:, :-1, :], tokens[:, 1:], return_lse=True)

    full, tokens = make_inputs((2, 5), 17, torch.float32)
    loss, lse = shifted(full, tokens)
    want, want_lse, _ = reference(full[:, :-1, :], tokens[:, 1:])
    assert_loss_close(loss, want)
    assert_loss_close(lse, want_lse)


def test_compile_inplace_after_tanh_gives_correct_gradients():
    # Inside a compiled graph torch functionalizes the mutation, so tanh's backward sees its own output,
    # not the gradient: correct gradients rather than an error, and never wrong ones.
    torch._dynamo.reset()

    @torch.compile(fullgraph=True)
    def f(x, t):
        return cross_entropy(torch.tanh(x) * 1, t, inplace_backward=True) + cross_entropy(torch.tanh(x), t)

    x = torch.randn(4, 9, requires_grad=True)
    t = torch.randint(0, 9, (4,))
    f(x, t).backward()
    xr = x.detach().clone().requires_grad_(True)
    (2 * F.cross_entropy(torch.tanh(xr), t)).backward()
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------------
# nn.CrossEntropyLoss


@pytest.mark.filterwarnings("ignore:size_average and reduce args will be deprecated")
@pytest.mark.parametrize(
    "kwargs",
    [{}, {"reduction": "sum"}, {"reduction": "none"}, {"ignore_index": 1}, {"label_smoothing": 0.15},
     {"weight": True, "label_smoothing": 0.05, "ignore_index": 0}, {"size_average": False}],
    ids=["default", "sum", "none", "ignore", "smoothing", "weighted", "legacy"],
)
def test_nn_module_matches_torch(kwargs):
    V = 12
    kwargs = resolve(kwargs, V)
    if "weight" in kwargs:
        kwargs["weight"] = kwargs["weight"].float()
    logits, target = make_inputs((10,), V, torch.float32, ignore_frac=0.0)
    ours, theirs = logitless.nn.CrossEntropyLoss(**kwargs), torch.nn.CrossEntropyLoss(**kwargs)
    a, b = logits.clone().requires_grad_(True), logits.clone().requires_grad_(True)
    la, lb = ours(a, target), theirs(b, target)
    torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-6)
    gout = upstream_grad(la)
    la.backward(gout)
    lb.backward(gout)
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)


def test_nn_module_extras_and_state():
    V = 8
    w = torch.rand(V) + 0.5
    m = logitless.nn.CrossEntropyLoss(weight=w, z_loss=1e-2, softcap=4.0, inplace_backward=True)
    assert "weight" in dict(m.named_buffers())
    assert "z_loss=0.01" in repr(m)
    x = torch.randn(2, 3, V, requires_grad=True)
    t = torch.randint(0, V, (2, 3))
    loss = m(x * 1, t)
    want, _, _ = reference(x.detach(), t, weight=w, z_loss=1e-2, softcap=4.0)
    assert_loss_close(loss, want)
    loss.backward()
    assert x.grad is not None


# ----------------------------------------------------------------------------------------------------
# CUDA (skipped without a GPU)


def _cuda_algos():
    # row_resident needs a Hopper-class cluster launch; the C++ API raises where the device cannot run it.
    return ["auto", "streaming", "row_resident"]


@needs_cuda
@pytest.mark.parametrize("algo", _cuda_algos())
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("V", [1, 3, 4099, 32003, 128256])
def test_cuda_matches_reference(V, dtype, reduction, algo):
    N = 5 if V >= 32003 else 37
    opts = resolve(OPTIONS["all"], V, device="cuda")
    logits, target = make_inputs((N,), V, dtype, device="cuda")
    for inplace in ([False, True] if reduction != "none" else [False]):
        run_or_skip_unavailable(lambda: check_against_reference(logits, target, reduction=reduction,
                                                                inplace_backward=inplace, algo=algo, **opts),
                                "algo", "row_resident")


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_matches_cpu_backend(dtype):
    # Same inputs on both backends; the CPU backend is the oracle.
    V = 50257
    full, tokens = make_inputs((2, 65), V, dtype, ignore_frac=0.1)
    outs = []
    for device in ("cpu", "cuda"):
        x = full.detach().to(device).requires_grad_(True)
        loss, lse = cross_entropy(x[:, :-1, :], tokens.to(device)[:, 1:], label_smoothing=0.1, z_loss=1e-4,
                                  return_lse=True)
        loss.backward()
        outs.append((loss.cpu(), lse.cpu(), x.grad.cpu()))
    (lc, sc, gc), (lg, sg, gg) = outs
    torch.testing.assert_close(lg, lc, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(sg, sc, rtol=1e-4, atol=1e-4)
    assert_grad_close(gg, gc, dtype)


@needs_cuda
@pytest.mark.parametrize("inplace_backward", [False, True])
def test_cuda_runs_on_the_current_stream(inplace_backward):
    # The input is written on a side stream behind a long sleep: a kernel launched on any stream other than
    # torch's current one would run before that write and read memory that does not hold the logits yet.
    logits, target = make_inputs((64,), 32000, torch.bfloat16, device="cuda")
    want = cross_entropy(logits, target)
    leaf = torch.zeros_like(logits, requires_grad=True)

    def run():
        got = cross_entropy(leaf + logits, target, inplace_backward=inplace_backward)
        got.backward()
        return got

    got = on_a_side_stream_behind_a_sleep(run)
    ref = logits.detach().clone().requires_grad_(True)
    reference(ref, target)[0].backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert_grad_close(leaf.grad, ref.grad, torch.bfloat16)


@needs_cuda
def test_cuda_bad_target_raises_eagerly():
    x = torch.randn(6, 100, device="cuda")
    t = torch.tensor([0, 1, 2, 3, 100, 5], device="cuda")
    with pytest.raises(ValueError, match="target.*row 4"):
        cross_entropy(x, t)


@needs_cuda
@pytest.mark.parametrize("inplace_backward", [False, True])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_cuda_graph_capture(reduction, inplace_backward):
    if inplace_backward and reduction == "none":
        pytest.skip("inplace_backward applies to sum/mean")
    N, H, V = 64, 32, 4099
    g = torch.Generator().manual_seed(21)
    h = torch.randn(N, H, generator=g).cuda().requires_grad_(True)
    W = torch.randn(V, H, generator=g).cuda().requires_grad_(True)
    t = torch.randint(0, V, (N,), generator=g).cuda()
    opts = dict(reduction=reduction, inplace_backward=inplace_backward, label_smoothing=0.1, z_loss=1e-3)

    def step():
        loss = cross_entropy(h @ W.t(), t, **opts)
        (loss.sum() if reduction == "none" else loss).backward()
        return loss.detach()

    def refill(gen):
        h.copy_(torch.randn(N, H, generator=gen).cuda())
        t.copy_(torch.randint(0, V, (N,), generator=gen).cuda())

    graph, static_loss = capture_cuda_graph(step, (h, W))
    assert_graph_replays_match_eager(
        graph, static_loss, (h, W), refill,
        lambda hr, Wr: cross_entropy(hr @ Wr.t(), t, reduction=reduction, label_smoothing=0.1, z_loss=1e-3))


@needs_cuda
def test_cuda_graph_capture_skips_target_check():
    # No synchronization is possible during capture: the bad row's loss is NaN instead of an error.
    x = torch.randn(4, 50, device="cuda")
    t = torch.tensor([0, 1, 2, 3], device="cuda")
    cross_entropy(x, t, reduction="none")  # warm up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = cross_entropy(x, t, reduction="none")
    t.copy_(torch.tensor([0, 99, 2, 3]))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.isnan(loss[1]) and torch.isfinite(loss[[0, 2, 3]]).all()


@needs_cuda
def test_cuda_compile_fullgraph():
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(4)
    h = torch.randn(256, 64, generator=g).cuda().requires_grad_(True)
    W = torch.randn(4099, 64, generator=g).cuda().requires_grad_(True)
    t = torch.randint(0, 4099, (256,), generator=g).cuda()
    for reduction, inplace in [("mean", False), ("mean", True), ("none", False)]:
        assert_compiled_matches_eager(_model, (h, W), t, reduction, inplace, rtol=1e-4, atol=1e-5)


@needs_cuda
def test_cuda_opcheck():
    for op, args in _op_samples("cuda"):
        torch.library.opcheck(op, args)


@needs_cuda
def test_cuda_inplace_needs_no_extra_logits_sized_memory():
    N, V = 2048, 32000
    logits, target = make_inputs((N,), V, torch.bfloat16, device="cuda")
    nbytes = logits.numel() * logits.element_size()
    for inplace, bound in ((True, nbytes // 8), (False, nbytes + nbytes // 8)):
        x = logits.clone().requires_grad_(True)
        y = x * 1
        extra = extra_peak_memory(cross_entropy, y, target, inplace_backward=inplace)
        assert extra < bound, f"inplace={inplace}: {extra} extra bytes for {nbytes} bytes of logits"
        del x, y


@needs_cuda
def test_cuda_beyond_int32_offsets():
    # N * V > 2^31: the last rows sit past the int32 range of element offsets.
    N, V = 16896, 128256
    assert N * V > 2**31
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(N, V, device="cuda", dtype=torch.bfloat16, generator=g)
    t = torch.randint(0, V, (N,), device="cuda", generator=g)
    y = x.clone().requires_grad_(True)
    z = y * 1
    loss = cross_entropy(z, t, reduction="sum", inplace_backward=True)
    tail = slice(N - 4, N)
    ref = x[tail].clone().requires_grad_(True)
    want = reference(ref, t[tail], reduction="none")[0]
    want.sum().backward()
    rows = cross_entropy(x[tail], t[tail], reduction="none")
    torch.testing.assert_close(rows.double(), want.detach(), rtol=1e-5, atol=1e-5)
    assert_grad_close(z.detach()[tail], ref.grad, torch.bfloat16)
    assert math.isfinite(loss.item())
