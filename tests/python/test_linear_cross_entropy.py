"""logitless.linear_cross_entropy and logitless.nn.LinearCrossEntropyLoss against a float64 torch reference
(F.linear + F.cross_entropy, plus z-loss and softcap by hand).

CPU tests run everywhere (the CPU backend is a real backend); CUDA tests skip without a GPU.
Run: PYTHONPATH=build/<dir>/python python -m pytest tests/python -q
"""
import pytest
import torch
import torch.nn.functional as F

import logitless
from _helpers import (
    CPU_GRAD_TOL,
    DTYPES,
    REDUCTIONS,
    SCHEDULES,
    assert_compiled_matches_eager,
    assert_grads_match_central_differences,
    assert_graph_replays_match_eager,
    capture_cuda_graph,
    check_dynamic_shapes_against_torch,
    check_second_backward,
    extra_peak_memory,
    needs_cuda,
    on_a_side_stream_behind_a_sleep,
    upstream_grad,
)
from logitless import linear_cross_entropy
from logitless.linear_cross_entropy import token_losses_uniform_grad

# Error budget against the float64 reference evaluated on the same (already rounded) inputs. The loss is
# float32 whatever the dtype, from float32 logits (CUDA) or double sums (CPU). Gradients come in the inputs'
# dtype; on CUDA they also carry the rounding of the logits' gradient to that dtype before the two GEMMs that
# consume it (as torch's own bf16 backward does): tolerances are relative to each gradient's largest element.
LOSS_RTOL = {"cpu": 2e-5, "cuda": 1e-4}
GRAD_TOL = {"cpu": CPU_GRAD_TOL, "cuda": {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2.5e-2}}

OPTIONS = {
    "plain": {},
    "class_weight": {"class_weight": True},
    "smoothing": {"label_smoothing": 0.1},
    "z_loss": {"z_loss": 1e-2},
    "softcap": {"softcap": 3.0},
    "ignore": {"ignore_index": 2},
    "all": {"class_weight": True, "label_smoothing": 0.2, "z_loss": 1e-3, "softcap": 5.0},
}


# ----------------------------------------------------------------------------------------------------
# Reference and helpers


def reference(hidden, weight, target, bias=None, ignore_index=-100, reduction="mean", label_smoothing=0.0,
              z_loss=0.0, softcap=None, class_weight=None):
    """float64 (loss, lse), autograd-capable in hidden/weight/bias: torch's cross-entropy of F.linear plus the
    z-loss and softcap terms, with the documented mean over no tokens = 0."""
    x = F.linear(hidden.double(), weight.double(), None if bias is None else bias.double())
    if softcap:
        x = softcap * torch.tanh(x / softcap)
    V = x.shape[-1]
    x2, t = x.reshape(-1, V), target.reshape(-1).long()
    w = None if class_weight is None else class_weight.double()
    valid = t != ignore_index
    rows = (F.cross_entropy(x2, t, weight=w, ignore_index=ignore_index, reduction="none",
                            label_smoothing=label_smoothing) if t.numel() else x2.sum(-1))
    lse = torch.where(valid, torch.logsumexp(x2, -1), torch.zeros_like(rows))
    z = z_loss * lse * lse
    rows = rows + z
    if reduction == "none":
        return rows.reshape(target.shape), lse.reshape(target.shape)
    total = rows.sum()
    if reduction == "mean":
        # The class weights normalize the cross-entropy terms; the z-loss term is averaged over the counted tokens.
        denom = (w[t[valid]] if w is not None else torch.ones_like(rows[valid])).sum()
        total = (rows - z).sum() / denom + z.sum() / valid.sum() if denom != 0 else total * 0
    return total, lse.reshape(target.shape)


def make_inputs(shape, H, V, dtype, device="cpu", bias=False, ignore_frac=0.2, ignore_index=-100, seed=0,
                spread=2.0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) * (spread / H ** 0.5)).to(dtype)
    b = (torch.randn(V, generator=g) * 0.5).to(dtype) if bias else None
    target = torch.randint(0, V, shape, generator=g)
    if ignore_frac:
        target[torch.rand(shape, generator=g) < ignore_frac] = ignore_index
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return to(hidden), to(weight), to(b), target.to(device)


def resolve(opts, V, device="cpu"):
    opts = dict(opts)
    if opts.pop("class_weight", False):
        opts["class_weight"] = (torch.rand(V, generator=torch.Generator().manual_seed(7)) + 0.25).to(device)
    return opts


def assert_grad_close(got, want, dtype, device):
    tol = GRAD_TOL[device][dtype]
    scale = want.abs().max().item() if want.numel() else 0.0
    torch.testing.assert_close(got.double(), want.double(), rtol=0, atol=tol * scale + 1e-12)


def assert_loss_close(got, want, device):
    rtol = LOSS_RTOL[device]
    torch.testing.assert_close(got.double(), want.detach(), rtol=rtol, atol=rtol)


def check_against_reference(hidden, weight, target, bias=None, reduction="mean", schedule="auto", **opts):
    """Loss, lse and the gradients of hidden, weight and bias (with a non-trivial upstream gradient)."""
    device = hidden.device.type
    leaves = [t.detach().clone().requires_grad_(True) for t in (hidden, weight)]
    leaves.append(None if bias is None else bias.detach().clone().requires_grad_(True))
    refs = [None if t is None else t.detach().clone().requires_grad_(True) for t in leaves]
    want, want_lse = reference(refs[0], refs[1], target, refs[2], reduction=reduction, **opts)
    gout = upstream_grad(want)
    want.backward(gout.double())

    loss, lse = linear_cross_entropy(leaves[0], leaves[1], target, leaves[2], reduction=reduction,
                                     return_lse=True, schedule=schedule, **opts)
    assert loss.dtype == torch.float32 and loss.shape == want.shape
    assert lse.shape == target.shape and not lse.requires_grad
    assert_loss_close(loss, want, device)
    assert_loss_close(lse, want_lse, device)
    loss.backward(gout.to(loss.dtype))
    for got, ref in zip(leaves, refs):
        if got is not None:
            assert got.grad is not None and got.grad.dtype == got.dtype and got.grad.shape == got.shape
            assert_grad_close(got.grad, ref.grad, hidden.dtype, device)


def schedules_for(reduction):
    return ["recompute"] if reduction == "none" else SCHEDULES


# ----------------------------------------------------------------------------------------------------
# Values and gradients (CPU backend)


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_reference(dtype, reduction, option):
    V, H = 37, 12
    opts = resolve(OPTIONS[option], V)
    hidden, weight, bias, target = make_inputs((3, 5), H, V, dtype, bias=option in ("plain", "all"),
                                               ignore_index=opts.get("ignore_index", -100))
    for schedule in schedules_for(reduction):
        check_against_reference(hidden, weight, target, bias, reduction=reduction, schedule=schedule, **opts)


@pytest.mark.parametrize(
    "shape,H,V",
    [((0,), 8, 7), ((1,), 8, 7), ((5,), 4, 1), ((4,), 1, 3), ((2,), 9, 32003), ((2, 3, 4), 6, 11), ((), 5, 9)],
    ids=["N0", "N1", "V1", "H1", "V32003", "3d", "unbatched"],
)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_shapes(shape, H, V, reduction):
    hidden, weight, bias, target = make_inputs(shape, H, V, torch.float32, bias=True, ignore_frac=0.0)
    for schedule in schedules_for(reduction):
        check_against_reference(hidden, weight, target, bias, reduction=reduction, schedule=schedule)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_shifted_view_goes_in(dtype):
    # The language-model shift: hidden[:, :-1] predicts tokens[:, 1:]; both are non-contiguous views.
    B, T, H, V = 2, 6, 10, 29
    full, weight, bias, tokens = make_inputs((B, T + 1), H, V, dtype, bias=True, ignore_frac=0.1)
    hidden, target = full[:, :-1, :], tokens[:, 1:]
    assert not hidden.is_contiguous() and not target.is_contiguous()
    for reduction in REDUCTIONS:
        for schedule in schedules_for(reduction):
            check_against_reference(hidden, weight, target, bias, reduction=reduction, schedule=schedule,
                                    label_smoothing=0.1)


def test_strided_weight_and_target():
    # A weight that is a slice of a wider matrix (row stride > H), targets every other element.
    H, V = 8, 13
    hidden, wide, _, _ = make_inputs((6,), H + 3, V, torch.float32)
    hidden = hidden[:, :H].contiguous()
    weight = wide[:, :H]
    target = torch.randint(0, V, (12,), generator=torch.Generator().manual_seed(3))[::2]
    assert weight.stride(0) == H + 3 and target.stride(0) == 2
    for reduction in REDUCTIONS:
        check_against_reference(hidden, weight, target, reduction=reduction, z_loss=1e-3)


@pytest.mark.parametrize("target_dtype", [torch.int32, torch.int64], ids=str)
def test_target_dtypes(target_dtype):
    hidden, weight, _, target = make_inputs((8,), 6, 13, torch.float32)
    check_against_reference(hidden, weight, target.to(target_dtype))


def test_float32_bias_with_bf16_inputs():
    hidden, weight, _, target = make_inputs((6,), 8, 11, torch.bfloat16)
    bias = torch.randn(11, generator=torch.Generator().manual_seed(4))
    check_against_reference(hidden, weight, target, bias)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("trainable", ["hidden", "weight", "bias"])
def test_only_some_inputs_need_grad(trainable, schedule):
    # A frozen lm_head (LoRA), frozen features, a bias alone: only the gradients asked for are computed.
    hidden, weight, bias, target = make_inputs((5,), 6, 9, torch.float32, bias=True)
    leaves = {"hidden": hidden.clone(), "weight": weight.clone(), "bias": bias.clone()}
    leaves[trainable].requires_grad_(True)
    linear_cross_entropy(leaves["hidden"], leaves["weight"], target, leaves["bias"], schedule=schedule).backward()
    refs = {k: v.detach().clone().requires_grad_(k == trainable) for k, v in leaves.items()}
    reference(refs["hidden"], refs["weight"], target, refs["bias"])[0].backward()
    for k, v in leaves.items():
        if k == trainable:
            torch.testing.assert_close(v.grad, refs[k].grad.float(), rtol=1e-5, atol=1e-6)
        else:
            assert v.grad is None


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_all_ignored_mean_is_zero_not_nan(reduction):
    hidden = torch.randn(4, 6, requires_grad=True)
    weight = torch.randn(9, 6, requires_grad=True)
    target = torch.full((4,), -100)
    for schedule in schedules_for(reduction):
        hidden.grad = weight.grad = None
        loss = linear_cross_entropy(hidden, weight, target, reduction=reduction, schedule=schedule)
        assert (loss == 0).all()
        loss.sum().backward()
        assert (hidden.grad == 0).all() and (weight.grad == 0).all()


def test_return_lse_and_no_grad():
    hidden, weight, bias, target = make_inputs((5,), 6, 8, torch.float32, bias=True)
    loss, lse = linear_cross_entropy(hidden, weight, target, bias, return_lse=True)
    _, want_lse = reference(hidden, weight, target, bias)
    assert_loss_close(lse, want_lse, "cpu")
    assert (lse[target == -100] == 0).all()
    with torch.no_grad():
        h = hidden.clone().requires_grad_(True)
        out = linear_cross_entropy(h, weight, target, bias)
    assert out.grad_fn is None
    torch.testing.assert_close(out, loss)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_schedules_agree(reduction):
    hidden, weight, bias, target = make_inputs((16,), 12, 50, torch.bfloat16, bias=True)
    grads = []
    for schedule in SCHEDULES:
        leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
        linear_cross_entropy(*leaves[:2], target, leaves[2], reduction=reduction, label_smoothing=0.1,
                             schedule=schedule).backward(torch.tensor(1.7))
        grads.append([t.grad.float() for t in leaves])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2 * b.abs().max().item())


# ----------------------------------------------------------------------------------------------------
# Finite differences. The C++ API takes float32/16/bf16 only, so gradcheck runs in float32 with a wide step
# and loose tolerances: enough to catch a wrong formula (a sign, a missing term, a bad chain rule); the
# precise check is test_matches_reference against the float64 reference's autograd.

GRADCHECK_OPTS = dict(label_smoothing=0.1, z_loss=1e-2, softcap=4.0)


def _gradcheck_inputs():
    g = torch.Generator().manual_seed(5)
    h = torch.randn(3, 5, generator=g, requires_grad=True)
    w = (torch.randn(7, 5, generator=g) * 0.7).requires_grad_(True)
    b = (torch.randn(7, generator=g) * 0.3).requires_grad_(True)
    t = torch.tensor([1, -100, 6])
    cw = torch.rand(7, generator=g) + 0.5
    return h, w, b, t, cw


@pytest.mark.filterwarnings("ignore:Input #[0-9]+ requires gradient and is not a double")
def test_gradcheck_recompute():
    # The recompute schedule's backward is a pure function of saved tensors: gradcheck may call it many times.
    h, w, b, t, cw = _gradcheck_inputs()
    fn = lambda h, w, b: linear_cross_entropy(h, w, t, b, class_weight=cw, reduction="none",  # noqa: E731
                                              **GRADCHECK_OPTS)
    assert torch.autograd.gradcheck(fn, (h, w, b), eps=1e-3, atol=2e-3, rtol=2e-2)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_finite_differences_gradient_in_forward(reduction):
    # This schedule computes the gradients once, in the forward, and its backward consumes them (a second
    # backward over the same graph raises), which gradcheck's repeated backward passes trip over. Same
    # central differences, by hand.
    h, w, b, t, cw = _gradcheck_inputs()
    f = lambda h_, w_, b_: linear_cross_entropy(h_, w_, t, b_, class_weight=cw, reduction=reduction,  # noqa: E731
                                                schedule="gradient_in_forward", **GRADCHECK_OPTS)
    (2.0 * f(h, w, b)).backward()
    assert_grads_match_central_differences(f, (h, w, b), scale=2.0)


def test_second_backward_over_retained_graph():
    h, w, b, t, cw = _gradcheck_inputs()
    check_second_backward(lambda schedule: linear_cross_entropy(h, w, t, b, schedule=schedule), h, (h, w, b))


def test_double_backward_raises():
    h, w, b, t, cw = _gradcheck_inputs()
    for schedule in SCHEDULES:
        loss = linear_cross_entropy(h, w, t, b, schedule=schedule)
        with pytest.raises(RuntimeError, match="double backward"):
            torch.autograd.grad(loss, h, create_graph=True)


# ----------------------------------------------------------------------------------------------------
# grad_weight_accumulation="weight_dtype": a 16-bit grad_weight summed over token groups in itself.


def _grads_with(accumulation, hidden, weight, target, **opts):
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    loss = linear_cross_entropy(h, w, target, schedule="gradient_in_forward", grad_weight_accumulation=accumulation,
                                **opts)
    loss.backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_weight_dtype_accumulation_rounds_grad_weight_per_token_group(dtype):
    # Groups of 16 tokens (chunk_tokens): the CPU backend rounds grad_weight's running sum after each, as the GPU's
    # accumulating GEMM does. Loss and grad_hidden are bit-identical; grad_weight is the per-group rounding of the
    # float64 sums, within a unit in the last place of its largest element.
    N, H, V, G = 96, 24, 80, 16
    hidden, weight, _, target = make_inputs((N,), H, V, dtype, ignore_frac=0.0)
    f32 = _grads_with("float32", hidden, weight, target, reduction="sum", chunk_tokens=G)
    wd = _grads_with("weight_dtype", hidden, weight, target, reduction="sum", chunk_tokens=G)
    assert torch.equal(wd[0], f32[0]) and torch.equal(wd[1], f32[1])
    assert wd[2].dtype == dtype and not torch.equal(wd[2], f32[2])
    running = torch.zeros(V, H, dtype=torch.float64)
    for g0 in range(0, N, G):
        w = weight.double().requires_grad_(True)
        reference(hidden[g0:g0 + G].double(), w, target[g0:g0 + G], reduction="sum")[0].backward()
        running = (running + w.grad).float().to(dtype).double()
    ulp = 2.0 ** (torch.frexp(running.abs().max()).exponent.item() - 1 - (7 if dtype == torch.bfloat16 else 10))
    diff = (wd[2].double() - running).abs()
    assert diff.max().item() <= ulp and (diff == 0).double().mean().item() >= 0.99
    # One group (the default budget holds every token): the float32 accumulation's result exactly.
    assert torch.equal(_grads_with("weight_dtype", hidden, weight, target)[2],
                       _grads_with("float32", hidden, weight, target)[2])


def test_weight_dtype_accumulation_is_a_no_op_for_float32_and_recompute():
    hidden, weight, _, target = make_inputs((40,), 16, 50, torch.float32)
    for schedule in ("gradient_in_forward", "recompute"):
        got = _grads_with("weight_dtype", hidden, weight, target, chunk_tokens=8)
        want = _grads_with("float32", hidden, weight, target, chunk_tokens=8)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), schedule
    hidden, weight, _, target = make_inputs((40,), 16, 50, torch.bfloat16)
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    linear_cross_entropy(h, w, target, schedule="recompute", chunk_tokens=8,
                         grad_weight_accumulation="weight_dtype").backward()
    h2, w2 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    linear_cross_entropy(h2, w2, target, schedule="recompute", chunk_tokens=8).backward()
    assert torch.equal(w.grad, w2.grad) and torch.equal(h.grad, h2.grad)


# ----------------------------------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize(
    "kwargs,name",
    [
        (dict(reduction="avg"), "reduction"),
        (dict(schedule="fastest"), "schedule"),
        (dict(schedule="gradient_in_forward", reduction="none"), "schedule"),
        (dict(chunk_tokens=0), "chunk_tokens"),
        (dict(chunk_vocab=-3), "chunk_vocab"),
        (dict(memory_budget=0), "memory_budget"),
        (dict(label_smoothing=1.5), "label_smoothing"),
        (dict(z_loss=-1.0), "z_loss"),
        (dict(softcap=-2.0), "softcap"),
        (dict(grad_weight_accumulation="bf16"), "grad_weight_accumulation"),
        (dict(grad_weight_accumulation=None), "grad_weight_accumulation"),
        (dict(weight=torch.randn(7, 5)), "weight"),                       # H mismatch
        (dict(weight=torch.randn(7, 6, dtype=torch.float64)), "weight"),  # dtype
        (dict(weight=torch.randn(7, 6).bfloat16()), "weight"),            # mixed dtypes
        (dict(bias=torch.randn(6)), "bias"),                              # wrong length
        (dict(class_weight=torch.ones(5)), "class_weight"),
        (dict(target=torch.zeros(4)), "target"),
        (dict(target=torch.zeros(3, dtype=torch.long)), "target"),
        (dict(hidden=torch.randn(4, 6, dtype=torch.float64)), "hidden"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_bad_arguments_raise_value_error_naming_them(kwargs, name):
    args = dict(hidden=torch.randn(4, 6), weight=torch.randn(7, 6), target=torch.tensor([0, 1, 2, 3]))
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        linear_cross_entropy(**args)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_target_out_of_range_names_first_bad_row(schedule):
    h = torch.randn(5, 6, requires_grad=True)
    w = torch.randn(7, 6, requires_grad=True)
    t = torch.tensor([0, 1, -100, 7, -3])
    with pytest.raises(ValueError, match="target.*got 7 at row 3"):
        linear_cross_entropy(h, w, t, schedule=schedule)


def test_unchecked_bad_target_gives_nan_row():
    h = torch.randn(4, 6, requires_grad=True)
    w = torch.randn(7, 6)
    t = torch.tensor([0, 9, 2, -100])
    loss = linear_cross_entropy(h, w, t, reduction="none", check_targets=False)
    assert torch.isnan(loss[1]) and torch.isfinite(loss[[0, 2, 3]]).all()
    loss.sum().backward()
    assert torch.isnan(h.grad[1]).all() and torch.isfinite(h.grad[[0, 2, 3]]).all()


# ----------------------------------------------------------------------------------------------------
# torch.library and torch.compile


def _op_samples(device="cpu"):
    hidden, weight, bias, target = make_inputs((4,), 6, 9, torch.float32, device=device, bias=True)
    cw = torch.rand(9, device=device) + 0.5
    options = (-100, 2, 0.1, 1e-2, 0.0, True, 0, 0, 1 << 20, 0)
    none_options = (-100, 0, 0.0, 0.0, 2.0, True, 2, 4, 1 << 20, 0)
    weight_dtype = (-100, 1, 0.0, 0.0, 0.0, True, 2, 0, 1 << 20, 1)  # grad_weight summed in its dtype
    lse = torch.logsumexp(F.linear(hidden, weight, bias), -1)
    ops = torch.ops.logitless
    req = lambda t: t.clone().requires_grad_(True)  # noqa: E731
    return [
        (ops.linear_cross_entropy_forward, (hidden, weight, bias, target, cw) + options),
        (ops.linear_cross_entropy_forward, (req(hidden), req(weight), req(bias), target, None) + none_options),
        (ops.linear_cross_entropy_forward, (req(hidden), weight, None, target, cw) + options),
        (ops.linear_cross_entropy_forward_backward_out,
         (hidden, weight, bias, target, cw) + options + (torch.empty_like(hidden), torch.empty_like(weight),
                                                         torch.empty_like(bias))),
        (ops.linear_cross_entropy_forward_backward_out,
         (hidden, weight, None, target, None) + weight_dtype + (None, torch.empty_like(weight), None)),
        (ops.linear_cross_entropy_backward,
         (hidden, weight, bias, target, cw, lse, torch.tensor(1.5, device=device)) + options
         + (True, True, True, False)),
        (ops.linear_cross_entropy_backward,
         (hidden, weight, None, target, None, lse, torch.rand(4, device=device)) + none_options
         + (True, False, False, True)),
    ]


@pytest.mark.parametrize("index", range(7))
def test_opcheck(index):
    op, args = _op_samples()[index]
    torch.library.opcheck(op, args)


def _model(h, W, b, t, reduction, schedule):
    loss = linear_cross_entropy(h, W, t, b, reduction=reduction, schedule=schedule, label_smoothing=0.1,
                                z_loss=1e-3, softcap=8.0)
    return loss.sum() if reduction == "none" else loss


@pytest.mark.parametrize("reduction,schedule", [("mean", "gradient_in_forward"), ("mean", "recompute"),
                                                ("none", "recompute")])
def test_compile_fullgraph_matches_eager(reduction, schedule):
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(4)
    h = torch.randn(12, 16, generator=g, requires_grad=True)
    W = torch.randn(33, 16, generator=g, requires_grad=True)
    b = torch.randn(33, generator=g, requires_grad=True)
    t = torch.randint(0, 33, (12,), generator=g)
    assert_compiled_matches_eager(_model, (h, W, b), t, reduction, schedule, upstream=2, rtol=1e-5, atol=1e-6)


def test_compile_dynamic_shapes():
    check_dynamic_shapes_against_torch(lambda h, W, t, red: linear_cross_entropy(h, W, t, reduction=red))


# ----------------------------------------------------------------------------------------------------
# nn.LinearCrossEntropyLoss


@pytest.mark.parametrize("kwargs", [{}, {"reduction": "sum"}, {"reduction": "none"}, {"ignore_index": 1},
                                    {"label_smoothing": 0.15}, {"class_weight": True, "z_loss": 1e-3}],
                         ids=["default", "sum", "none", "ignore", "smoothing", "weighted"])
def test_nn_module_matches_function_and_torch(kwargs):
    V, H = 12, 7
    kwargs = resolve(kwargs, V)
    hidden, weight, bias, target = make_inputs((10,), H, V, torch.float32, bias=True, ignore_frac=0.0)
    m = logitless.nn.LinearCrossEntropyLoss(**kwargs)
    h = hidden.clone().requires_grad_(True)
    loss = m(h, weight, target, bias)
    opts = {k: v for k, v in kwargs.items()}
    want, _ = reference(hidden, weight, target, bias, **opts)
    assert_loss_close(loss, want, "cpu")
    loss.sum().backward()
    assert h.grad is not None
    if not kwargs.get("z_loss"):
        torch_loss = torch.nn.CrossEntropyLoss(weight=kwargs.get("class_weight"), ignore_index=m.ignore_index,
                                               reduction=m.reduction, label_smoothing=m.label_smoothing)
        torch.testing.assert_close(loss, torch_loss(F.linear(hidden, weight, bias), target), rtol=1e-5, atol=1e-6)


def test_nn_module_state_and_repr():
    cw = torch.rand(8) + 0.5
    m = logitless.nn.LinearCrossEntropyLoss(class_weight=cw, z_loss=1e-2, softcap=4.0, schedule="recompute",
                                            chunk_tokens=64, grad_weight_accumulation="weight_dtype")
    assert "class_weight" in dict(m.named_buffers())
    r = repr(m)
    assert "z_loss=0.01" in r and "schedule='recompute'" in r and "chunk_tokens=64" in r
    assert "grad_weight_accumulation='weight_dtype'" in r
    assert "grad_weight_accumulation" not in repr(logitless.nn.LinearCrossEntropyLoss())


# ----------------------------------------------------------------------------------------------------
# CUDA (skipped without a GPU)


@needs_cuda
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("V", [1, 3, 4099, 32003, 128256])
def test_cuda_matches_reference(V, dtype, reduction):
    N, H = (5, 64) if V >= 32003 else (37, 96)
    opts = resolve(OPTIONS["all"], V, device="cuda")
    hidden, weight, bias, target = make_inputs((N,), H, V, dtype, device="cuda", bias=True, spread=6.0)
    for schedule in schedules_for(reduction):
        check_against_reference(hidden, weight, target, bias, reduction=reduction, schedule=schedule, **opts)


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_matches_cpu_backend(dtype):
    # Same inputs on both backends, through the shifted view; small chunks force several token groups and
    # vocabulary chunks on the GPU.
    V, H = 5003, 48
    full, weight, bias, tokens = make_inputs((2, 65), H, V, dtype, bias=True, ignore_frac=0.1)
    for schedule in SCHEDULES:
        outs = []
        for device, chunks in (("cpu", {}), ("cuda", {}), ("cuda", dict(chunk_tokens=37, chunk_vocab=999))):
            leaves = [t.detach().to(device).requires_grad_(True) for t in (full, weight, bias)]
            loss, lse = linear_cross_entropy(leaves[0][:, :-1, :], leaves[1], tokens.to(device)[:, 1:], leaves[2],
                                             label_smoothing=0.1, z_loss=1e-4, return_lse=True, schedule=schedule,
                                             **chunks)
            loss.backward()
            outs.append([loss.cpu(), lse.cpu()] + [t.grad.cpu() for t in leaves])
        for got in outs[1:]:
            torch.testing.assert_close(got[0], outs[0][0], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(got[1], outs[0][1], rtol=1e-5, atol=1e-4)
            for g, w in zip(got[2:], outs[0][2:]):
                assert_grad_close(g, w, dtype, "cuda")


def _rel_l2(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@needs_cuda
@pytest.mark.parametrize("logit_std", [2.0, 8.0])
@pytest.mark.parametrize("schedule,chunk_tokens", [(s, None) for s in SCHEDULES] + [("gradient_in_forward", 512)])
def test_cuda_precision_against_torch_bf16(schedule, chunk_tokens, logit_std):
    # Against float64 math on the same bf16 values: the loss to 1e-5 relative; grad_hidden and grad_weight each no
    # worse than 1.5x the error of torch's bf16 F.cross_entropy(F.linear(h, w).float(), t) on the same inputs, on
    # logits of standard deviation 2 and 8 (peaked rows). chunk_tokens=512: several token groups (a float32
    # grad_weight accumulator) instead of one.
    N, H, V = 2048, 1024, 32000
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(N, H, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(V, H, device="cuda", generator=g) / H ** 0.5 * logit_std).bfloat16()
    target = torch.randint(0, V, (N,), device="cuda", generator=g)

    def grads(fn, dtype):
        # Fresh leaves per call: hidden.to(bfloat16) would be hidden itself, and a second backward into it would
        # add to (and alias) the first call's .grad, so both errors below would be the same tensor's.
        h = hidden.to(dtype, copy=True).requires_grad_(True)
        w = weight.to(dtype, copy=True).requires_grad_(True)
        loss = fn(h, w)
        loss.backward()
        return loss.detach().double(), h.grad, w.grad

    exact = grads(lambda h, w: F.cross_entropy(h @ w.t(), target), torch.float64)
    torch_bf16 = grads(lambda h, w: F.cross_entropy(F.linear(h, w).float(), target), torch.bfloat16)
    ours = grads(lambda h, w: linear_cross_entropy(h, w, target, schedule=schedule, chunk_tokens=chunk_tokens),
                 torch.bfloat16)
    assert abs(ours[0].item() - exact[0].item()) <= 1e-5 * abs(exact[0].item())
    for i, name in ((1, "grad_hidden"), (2, "grad_weight")):
        theirs, mine = _rel_l2(torch_bf16[i], exact[i]), _rel_l2(ours[i], exact[i])
        assert mine <= 1.5 * theirs, f"{name}: relative L2 error {mine:.3g} vs torch bf16 {theirs:.3g}"


@needs_cuda
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_cuda_runs_on_the_current_stream(schedule):
    # The input is written on a side stream behind a long sleep: anything launched on another stream would
    # read it before it is there.
    hidden, weight, _, target = make_inputs((512,), 256, 8000, torch.bfloat16, device="cuda")
    want = linear_cross_entropy(hidden, weight, target)
    leaf = torch.zeros_like(hidden, requires_grad=True)

    def run():
        got = linear_cross_entropy(leaf + hidden, weight, target, schedule=schedule)
        got.backward()
        return got

    got = on_a_side_stream_behind_a_sleep(run)
    ref = hidden.detach().clone().requires_grad_(True)
    reference(ref, weight, target)[0].backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert_grad_close(leaf.grad, ref.grad, torch.bfloat16, "cuda")


@needs_cuda
def test_cuda_bad_target_raises_eagerly():
    h = torch.randn(6, 32, device="cuda")
    w = torch.randn(100, 32, device="cuda")
    t = torch.tensor([0, 1, 2, 3, 100, 5], device="cuda")
    with pytest.raises(ValueError, match="target.*row 4"):
        linear_cross_entropy(h, w, t)


@needs_cuda
@pytest.mark.parametrize("reduction,schedule", [("mean", "gradient_in_forward"), ("mean", "recompute"),
                                                ("none", "recompute")])
def test_cuda_graph_capture(reduction, schedule):
    N, H, V = 256, 64, 4099
    g = torch.Generator().manual_seed(21)
    h = torch.randn(N, H, generator=g).cuda().requires_grad_(True)
    W = (torch.randn(V, H, generator=g) * 0.2).cuda().requires_grad_(True)
    b = torch.randn(V, generator=g).cuda().requires_grad_(True)
    t = torch.randint(0, V, (N,), generator=g).cuda()
    opts = dict(reduction=reduction, schedule=schedule, label_smoothing=0.1, z_loss=1e-3, chunk_tokens=100,
                chunk_vocab=1500)

    def step():
        loss = linear_cross_entropy(h, W, t, b, **opts)
        (loss.sum() if reduction == "none" else loss).backward()
        return loss.detach()

    def refill(gen):
        h.copy_(torch.randn(N, H, generator=gen).cuda())
        t.copy_(torch.randint(0, V, (N,), generator=gen).cuda())

    graph, static_loss = capture_cuda_graph(step, (h, W, b))
    assert_graph_replays_match_eager(graph, static_loss, (h, W, b), refill,
                                     lambda hr, Wr, br: linear_cross_entropy(hr, Wr, t, br, **opts))


@needs_cuda
def test_cuda_compile_fullgraph():
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(4)
    h = torch.randn(256, 64, generator=g).cuda().requires_grad_(True)
    W = torch.randn(4099, 64, generator=g).cuda().requires_grad_(True)
    b = torch.randn(4099, generator=g).cuda().requires_grad_(True)
    t = torch.randint(0, 4099, (256,), generator=g).cuda()
    for reduction, schedule in [("mean", "gradient_in_forward"), ("mean", "recompute"), ("none", "recompute")]:
        assert_compiled_matches_eager(_model, (h, W, b), t, reduction, schedule, rtol=1e-4, atol=1e-5)


@needs_cuda
def test_cuda_opcheck():
    for op, args in _op_samples("cuda"):
        torch.library.opcheck(op, args)


@needs_cuda
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_cuda_logits_never_in_memory(schedule):
    # Peak memory beyond the inputs stays below one bf16 copy of the logits (gradients included).
    N, H, V = 4096, 512, 32000
    hidden, weight, _, target = make_inputs((N,), H, V, torch.bfloat16, device="cuda")
    logits_bytes = N * V * 2
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    extra = extra_peak_memory(lambda: linear_cross_entropy(h, w, target, schedule=schedule,
                                                           memory_budget=64 << 20).backward())
    assert extra < logits_bytes, f"{extra / 2**20:.0f} MiB extra for {logits_bytes / 2**20:.0f} MiB of bf16 logits"


# ----------------------------------------------------------------------------------------------------
# schedule="auto" for bfloat16 asks the library's cost model (shapes only: the weight here is a broadcast view).

def _shape_only(n, h, v, device, dtype=torch.bfloat16):
    hidden = torch.empty(1, h, dtype=dtype, device=device, requires_grad=True).expand(n, h)
    weight = torch.empty(1, h, dtype=dtype, device=device, requires_grad=True).expand(v, h)
    return hidden, weight


def test_auto_schedule_on_the_cpu():
    from logitless.linear_cross_entropy import auto_schedule
    hidden, weight = _shape_only(8192, 2304, 256000, "cpu")
    assert auto_schedule(hidden, weight) == "gradient_in_forward"  # no cost model on the CPU
    assert auto_schedule(hidden, weight, reduction="none") == "recompute"
    assert auto_schedule(*_shape_only(8, 16, 32, "cpu", torch.float16)) == "recompute"
    with torch.autocast("cpu", dtype=torch.float16):
        assert auto_schedule(*_shape_only(8, 16, 32, "cpu", torch.float32)) == "recompute"
    with pytest.raises(ValueError, match="memory_budget"):
        auto_schedule(hidden, weight, memory_budget=0)
    with pytest.raises(ValueError, match="single-device"):
        auto_schedule(hidden, weight, schedule="recompute")
    with pytest.raises(TypeError):
        auto_schedule(hidden, weight, not_an_option=1)


@needs_cuda
def test_auto_schedule_takes_recompute_where_the_accumulator_costs_more():
    from logitless.linear_cross_entropy import auto_schedule
    # An eighth of the default budget: 103 float32 grad_weight accumulations (generic kernels: 79-token groups), 8
    # with the Hopper kernels' exponentials in grad_weight's storage (911-token groups); at the default budget the
    # latter take 3 (2048-token groups): the gradient in forward.
    assert auto_schedule(*_shape_only(8192, 2304, 256000, "cuda"), memory_budget=64 << 20) == "recompute"
    hopper = torch.cuda.get_device_capability() == (9, 0)
    assert auto_schedule(*_shape_only(8192, 2304, 256000, "cuda")) == ("gradient_in_forward" if hopper else "recompute")
    assert auto_schedule(*_shape_only(16384, 2048, 128256, "cuda")) == "gradient_in_forward"
    assert auto_schedule(*_shape_only(8192, 4096, 128256, "cuda")) == "gradient_in_forward"


# ----------------------------------------------------------------------------------------------------
# Under torch.autocast: the products in its dtype, the gradients in the arguments' dtypes.


@pytest.mark.parametrize("schedule", ["gradient_in_forward", "recompute"])
@pytest.mark.parametrize("bias_dtype", [None, torch.float32, torch.bfloat16])
def test_autocast_runs_the_products_in_its_dtype(schedule, bias_dtype):
    g = torch.Generator().manual_seed(5)
    h = torch.randn(2, 9, 32, generator=g).requires_grad_()
    w = (torch.randn(70, 32, generator=g) * 0.3).requires_grad_()
    b = None if bias_dtype is None else torch.randn(70, generator=g).to(bias_dtype).requires_grad_()
    t = torch.randint(0, 70, (2, 9), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = logitless.linear_cross_entropy(h, w, t, b, schedule=schedule)
    loss.backward()
    # The reference: float32 tensors holding the bf16-rounded operands, without autocast.
    hr, wr = h.detach().bfloat16().float().requires_grad_(), w.detach().bfloat16().float().requires_grad_()
    br = None if b is None else b.detach().float().requires_grad_()
    want = logitless.linear_cross_entropy(hr, wr, t, br, schedule=schedule)
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
    assert h.grad.dtype == w.grad.dtype == torch.float32
    torch.testing.assert_close(h.grad, hr.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(w.grad, wr.grad, rtol=1e-5, atol=1e-7)
    if b is not None:
        assert b.grad.dtype == bias_dtype
        torch.testing.assert_close(b.grad.float(), br.grad.to(bias_dtype).float(), rtol=1e-2, atol=1e-3)
    # Not the float32 products: the rounding of the operands shows in the per-token losses.
    bias = None if b is None else b.detach().float()
    full = logitless.linear_cross_entropy(h.detach(), w.detach(), t, bias, reduction="none")
    rounded = logitless.linear_cross_entropy(hr.detach(), wr.detach(), t, bias, reduction="none")
    assert (full - rounded).abs().max().item() > 1e-4


def test_autocast_leaves_operands_in_its_dtype_alone():
    g = torch.Generator().manual_seed(6)
    h, w = torch.randn(5, 16, generator=g).bfloat16(), torch.randn(40, 16, generator=g).bfloat16()
    t = torch.randint(0, 40, (5,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = logitless.linear_cross_entropy(h, w, t)
    torch.testing.assert_close(got, logitless.linear_cross_entropy(h, w, t), rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------------
# return_row_stats: per-token entropy and is_top1 beside the loss


def row_stats_reference(hidden, weight, target, bias=None, ignore_index=-100, softcap=None):
    """float64 (entropy, is_top1) per token: the entropy of softmax of the capped logits, whether the target is
    torch.argmax of the logits; 0 and False for ignored tokens."""
    z = F.linear(hidden.double(), weight.double(), None if bias is None else bias.double())
    x = softcap * torch.tanh(z / softcap) if softcap else z
    logp = x.log_softmax(-1)
    entropy = -torch.where(logp == float("-inf"), 0.0, logp.exp() * logp).sum(-1)  # 0 log 0 = 0; NaN stays
    valid = target != ignore_index
    entropy = torch.where(valid, entropy, torch.zeros_like(entropy))
    # The library's convention where torch.argmax would pick a NaN: a row with a NaN logit has no top-1.
    top1 = valid & (z.argmax(-1) == target.clamp(min=0)) & ~z.isnan().any(-1)
    return entropy, top1


def assert_row_stats(got_entropy, got_top1, want_entropy, want_top1, atol=1e-5):
    assert got_entropy.dtype == torch.float32 and got_top1.dtype == torch.bool
    assert not got_entropy.requires_grad and not got_top1.requires_grad
    torch.testing.assert_close(got_entropy.double().cpu(), want_entropy.cpu(), rtol=1e-5, atol=atol)
    assert torch.equal(got_top1.cpu(), want_top1.cpu())


@pytest.mark.parametrize("option", ["plain", "class_weight", "smoothing", "z_loss", "softcap", "ignore", "all"])
@pytest.mark.parametrize("reduction,schedule", [("mean", "gradient_in_forward"), ("sum", "recompute"),
                                                ("none", "recompute"), ("mean", "auto")])
def test_row_stats_match_reference_and_leave_the_loss_alone(reduction, schedule, option):
    hidden, weight, bias, target = make_inputs((3, 7), 16, 37, torch.float32, bias=True, seed=11)
    # A target that is its row's maximum: the answer True is reached too.
    target[0, 0] = F.linear(hidden[0, 0], weight, bias).argmax()
    opts = resolve(OPTIONS[option], 37)
    if "ignore_index" in opts:
        target[target == -100] = opts["ignore_index"]
    leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    loss, lse, entropy, top1 = linear_cross_entropy(*leaves[:2], target, leaves[2], reduction=reduction,
                                                    schedule=schedule, return_lse=True, return_row_stats=True, **opts)
    want_e, want_t = row_stats_reference(hidden, weight, target, bias, opts.get("ignore_index", -100),
                                         opts.get("softcap"))
    assert want_t.any()
    assert_row_stats(entropy, top1, want_e, want_t)
    upstream_grad(loss).mul(loss).sum().backward() if reduction == "none" else loss.backward()
    plain = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    loss2, lse2 = linear_cross_entropy(*plain[:2], target, plain[2], reduction=reduction, schedule=schedule,
                                       return_lse=True, **opts)
    upstream_grad(loss2).mul(loss2).sum().backward() if reduction == "none" else loss2.backward()
    torch.testing.assert_close(loss, loss2, rtol=0, atol=0)
    torch.testing.assert_close(lse, lse2, rtol=0, atol=0)
    for a, b in zip(leaves, plain):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)


def test_row_stats_outputs_order_and_no_grad():
    hidden, weight, _, target = make_inputs((6,), 8, 11, torch.float32, seed=2)
    loss, entropy, top1 = linear_cross_entropy(hidden, weight, target, return_row_stats=True)
    assert loss.shape == () and entropy.shape == top1.shape == (6,)
    with torch.no_grad():
        loss2, entropy2, top12 = linear_cross_entropy(hidden.requires_grad_(True), weight, target,
                                                      return_row_stats=True)
    torch.testing.assert_close(entropy, entropy2, rtol=0, atol=0)
    assert torch.equal(top1, top12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_row_stats_ties_masked_classes_nan_rows(dtype):
    # An identity weight: the logits are hidden + bias exactly (also in bfloat16), so ties are exact.
    V = 20
    weight = torch.eye(V, dtype=dtype)
    hidden = (torch.arange(6 * V).reshape(6, V) % 7 * 0.25).to(dtype)
    hidden[0, [3, 9]] = hidden[1, [3, 9]] = 4.0  # a tie: the first maximum is 3
    hidden[4, 5] = float("nan")
    bias = torch.zeros(V, dtype=dtype)
    bias[12] = float("-inf")
    target = torch.tensor([3, 9, 12, -100, 5, 0])
    loss, entropy, top1 = linear_cross_entropy(hidden, weight, target, bias, reduction="none",
                                               return_row_stats=True)
    assert top1.tolist() == [True, False, False, False, False, False]
    assert torch.isnan(entropy[4]) and entropy[3] == 0 and torch.isfinite(entropy[[0, 1, 2, 5]]).all()
    want_e, want_t = row_stats_reference(hidden, weight, target, bias)
    torch.testing.assert_close(entropy.double(), want_e, rtol=1e-5, atol=1e-5, equal_nan=True)
    # Every class masked: no finite lse (entropy NaN), and torch.argmax's index 0.
    loss, entropy, top1 = linear_cross_entropy(hidden[:2], weight, torch.tensor([0, 1]),
                                               torch.full((V,), float("-inf"), dtype=dtype), reduction="none",
                                               return_row_stats=True)
    assert top1.tolist() == [True, False] and torch.isnan(entropy).all()


def test_row_stats_refused_with_vocab_parallel():
    hidden, weight, _, target = make_inputs((4,), 8, 11, torch.float32)
    with pytest.raises(ValueError, match="return_row_stats: not supported with vocabulary parallelism"):
        linear_cross_entropy(hidden, weight, target, return_row_stats=True, vocab_parallel=True)


def _row_stats_op_samples(device="cpu"):
    hidden, weight, bias, target = make_inputs((4,), 6, 9, torch.float32, device=device, bias=True)
    options = (-100, 2, 0.1, 1e-2, 0.0, True, 0, 0, 1 << 20, 0)
    none_options = (-100, 0, 0.0, 0.0, 2.0, True, 2, 4, 1 << 20, 0)
    ops = torch.ops.logitless
    req = lambda t: t.clone().requires_grad_(True)  # noqa: E731
    return [
        (ops.linear_cross_entropy_forward_row_stats, (hidden, weight, bias, target, None) + options),
        (ops.linear_cross_entropy_forward_row_stats,
         (req(hidden), req(weight), req(bias), target, None) + none_options),
        (ops.linear_cross_entropy_forward_backward_row_stats_out,
         (hidden, weight, bias, target, None) + options + (torch.empty_like(hidden), torch.empty_like(weight), None)),
    ]


@pytest.mark.parametrize("index", range(3))
def test_row_stats_opcheck(index):
    op, args = _row_stats_op_samples()[index]
    torch.library.opcheck(op, args)


def _row_stats_model(h, W, b, t, schedule):
    loss, entropy, top1 = linear_cross_entropy(h, W, t, b, schedule=schedule, return_row_stats=True)
    return loss + 0 * entropy.sum() + 0 * top1.sum()


@pytest.mark.parametrize("schedule", ["gradient_in_forward", "recompute"])
def test_row_stats_compile_fullgraph_matches_eager(schedule):
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(3)
    h = torch.randn(12, 16, generator=g, requires_grad=True)
    W = torch.randn(29, 16, generator=g, requires_grad=True)
    b = torch.randn(29, generator=g, requires_grad=True)
    t = torch.randint(0, 29, (12,), generator=g)
    assert_compiled_matches_eager(_row_stats_model, (h, W, b), t, schedule, rtol=1e-5, atol=1e-6)


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("schedule,chunk_tokens", [("gradient_in_forward", None), ("gradient_in_forward", 96),
                                                   ("recompute", None)])
def test_cuda_row_stats_match_cpu_backend(dtype, schedule, chunk_tokens):
    # bfloat16 with gradient_in_forward runs the fused exponential form on Hopper (its row-statistics epilogue).
    hidden, weight, bias, target = make_inputs((333,), 128, 7777, dtype, seed=5)
    # Every fifth target is its row's maximum, so that True answers are checked too (random targets almost never are).
    target[::5] = F.linear(hidden[::5].double(), weight.double()).argmax(-1)
    want_loss, want_e, want_t = linear_cross_entropy(hidden, weight, target, return_row_stats=True)
    h = hidden.cuda().requires_grad_(True)
    w = weight.cuda().requires_grad_(True)
    loss, entropy, top1 = linear_cross_entropy(h, w, target.cuda(), schedule=schedule, chunk_tokens=chunk_tokens,
                                               return_row_stats=True)
    loss.backward()
    torch.testing.assert_close(loss.cpu(), want_loss, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(entropy.cpu(), want_e, rtol=2e-4, atol=2e-4)
    # Rows whose target is within float32 rounding of another class may rank otherwise: none at this seed's margins.
    assert (top1.cpu() != want_t).sum().item() <= 1
    assert want_t.sum().item() >= 333 // 5 - 1


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_row_stats_exact_ties(dtype):
    V = 520  # three 256-column tiles of the fused GEMM
    weight = torch.eye(V, dtype=dtype)
    hidden = (torch.arange(8 * V).reshape(8, V) % 7 * 0.25).to(dtype)
    hidden[0, [10, 300]] = hidden[1, [10, 300]] = 9.0  # a tie across tiles
    hidden[2, [3, 4]] = 8.0  # within a tile
    hidden[3, 7] = float("nan")
    hidden[5, 400] = 80.0  # a tile far above the target's logit
    hidden[6, 60] = -100.0  # the target far below the maximum
    bias = torch.zeros(V, dtype=dtype)
    bias[200] = float("-inf")
    target = torch.tensor([10, 300, 4, 0, -100, 5, 60, 200])
    want_e, want_t = row_stats_reference(hidden, weight, target, bias)
    h = hidden.cuda().requires_grad_(True)
    w = weight.cuda().requires_grad_(True)
    for schedule in ("gradient_in_forward", "recompute"):
        loss, entropy, top1 = linear_cross_entropy(h, w, target.cuda(), bias.cuda(), schedule=schedule,
                                                   return_row_stats=True)
        loss.backward()
        torch.testing.assert_close(entropy.double().cpu(), want_e, rtol=1e-4, atol=1e-4, equal_nan=True)
        assert torch.equal(top1.cpu(), want_t), schedule


@needs_cuda
def test_cuda_row_stats_opcheck():
    for op, args in _row_stats_op_samples("cuda"):
        torch.library.opcheck(op, args)


def _uniform_case(upstream_of_ignored):
    hidden, weight, bias, target = make_inputs((5, 7), 16, 37, torch.float32, bias=True, seed=21)
    leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    loss, _, _ = token_losses_uniform_grad(*leaves[:2], target, leaves[2])
    upstream = torch.full_like(loss, -0.25)
    upstream[target == -100] = upstream_of_ignored
    loss.backward(upstream)
    return (hidden, weight, bias, target), leaves, upstream


@pytest.mark.parametrize("upstream_of_ignored", [-0.25, 3.0])
def test_uniform_token_losses_match_reduction_none(upstream_of_ignored):
    # The ignored tokens' upstream gradient does not count: their gradient rows are 0 either way.
    (hidden, weight, bias, target), leaves, upstream = _uniform_case(upstream_of_ignored)
    assert (target == -100).any() and (target != -100).any()
    ref = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    want = linear_cross_entropy(ref[0], ref[1], target, ref[2], reduction="none")
    want.backward(upstream)
    for got, exp in zip(leaves, ref):
        torch.testing.assert_close(got.grad, exp.grad, rtol=1e-5, atol=1e-6)


def test_uniform_token_losses_refuse_an_upstream_that_differs_between_scored_tokens():
    hidden, weight, bias, target = make_inputs((5, 7), 16, 37, torch.float32, bias=True, seed=21)
    h = hidden.clone().requires_grad_(True)
    loss, _, _ = token_losses_uniform_grad(h, weight, target, bias)
    upstream = torch.full_like(loss, -0.25)
    upstream[(target != -100).nonzero()[0].tolist()] = -0.5
    with pytest.raises(ValueError, match="differ between scored tokens"):
        loss.backward(upstream)
