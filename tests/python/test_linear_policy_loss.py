"""logitless.linear_grpo_loss and logitless.linear_selective_log_softmax against a float64 torch reference that
computes the logits explicitly (hidden @ weight.T + bias in float64) and applies the policy loss's reference
(tests/python/test_policy_loss.py) to them.

CPU tests run everywhere (the CPU backend is a real backend); CUDA tests skip without a GPU.
Run: PYTHONPATH=build/<dir>/python python -m pytest tests/python/test_linear_policy_loss.py -q
"""
import pytest
import torch

import logitless
from _helpers import (
    CPU_GRAD_TOL,
    DTYPES,
    SCHEDULES,
    assert_compiled_matches_eager,
    assert_grads_match_central_differences,
    assert_graph_replays_match_eager,
    capture_cuda_graph,
    check_second_backward,
    extra_peak_memory,
    needs_cuda,
    on_a_side_stream_behind_a_sleep,
)
from logitless import grpo_loss, linear_grpo_loss, linear_selective_log_softmax
from test_policy_loss import (
    BAD_POLICY_ARGUMENTS,
    LEVELS,
    LOSS_TYPES,
    OPTIONS,
    assert_close,
    assert_loss_and_per_token_close,
    assert_per_token_outputs_close,
    policy_arguments,
    reference,
    reference_grad_unit,
    reference_kwargs,
)

# Error budget against the float64 reference on the same (already rounded) inputs. The loss and per-token values
# are float32 (CUDA: from float32 logits of a GEMM); the gradients are stored in the inputs' dtype (CUDA: the
# logits' gradient is rounded to it before the two GEMMs, as torch's own backward does).
LOSS_TOL = {"cpu": 2e-5, "cuda": 2e-4}
GRAD_TOL = {"cpu": CPU_GRAD_TOL, "cuda": {torch.float32: 2e-4, torch.float16: 6e-3, torch.bfloat16: 2.5e-2}}


# ----------------------------------------------------------------------------------------------------
# Inputs and reference


def make_inputs(B, L, H, V, dtype, option="full", device="cpu", aligned=False, bias=True, seed=0):
    """hidden [B, L+1, H] (or [B, L, H] aligned), weight [V, H], bias [V] and the policy inputs of `option`."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, L if aligned else L + 1, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) * (2.0 / max(H, 1) ** 0.5)).to(dtype)
    b = (torch.randn(V, generator=g) * 0.5).to(dtype) if bias else None
    return dict(hidden=hidden.to(device), weight=weight.to(device), bias=None if b is None else b.to(device),
                **policy_arguments(g, B, L, V, option, logits_of(hidden, weight, b), device))


def logits_of(hidden, weight, bias):
    z = hidden.double() @ weight.double().t()
    return z if bias is None else z + bias.double()


def split(inputs):
    args = (inputs["hidden"], inputs["weight"], inputs["completion_ids"], inputs["advantages"])
    kw = {k: v for k, v in inputs.items() if k not in ("hidden", "weight", "completion_ids", "advantages")}
    return args, kw


def leaves(*tensors):
    """float64 leaves for the reference (None stays None)."""
    return [None if t is None else t.detach().double().requires_grad_(True) for t in tensors]


def assert_grad_close(got, want, tol, unit=0.0):
    """`tol` relative to each element and to the gradient's natural size: its largest element, or `unit` where
    that is larger (an element can cancel to 0, at V = 1 all do, while its error scales with the coefficients)."""
    want = want.to(torch.float64)
    s = want.abs().max().item() if want.numel() else 0.0
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * max(s, unit, 1e-12))


def check_against_reference(inputs, loss_type="grpo", level="token", schedule="auto", upstream=1.3, extra=None):
    """Loss, every per-token output and the gradients of hidden, weight and bias (through an upstream factor)."""
    extra = dict(extra or {})
    if loss_type == "dr_grpo":
        extra.setdefault("max_completion_length", inputs["completion_ids"].shape[1] + 3)
    (hidden, weight, ids, adv), kw = split(inputs)
    bias = kw["bias"]
    rh, rw, rb = leaves(hidden, weight, bias)
    want, want_tok = reference(logits_of(rh, rw, rb), ids, adv, loss_type=loss_type, importance_sampling_level=level,
                               **reference_kwargs(kw), **extra)
    (upstream * want).backward()

    h, w, b = (None if t is None else t.detach().clone().requires_grad_(True) for t in (hidden, weight, bias))
    kw = dict(kw, bias=b)
    loss, tok = linear_grpo_loss(h, w, ids, adv, loss_type=loss_type, importance_sampling_level=level,
                                 return_per_token=True, schedule=schedule, **kw, **extra)
    dev = hidden.device.type
    assert_loss_and_per_token_close(loss, tok, want, want_tok, ids, LOSS_TOL[dev])
    mismatch = (tok.is_clipped.cpu() != want_tok["is_clipped"].cpu()).sum().item()
    assert mismatch <= (1 if dev == "cuda" else 0)  # CUDA: a ratio within rounding of the clip edge
    (upstream * loss).backward()
    tol = GRAD_TOL[dev][hidden.dtype]
    assert h.grad.dtype == hidden.dtype and w.grad.dtype == weight.dtype
    # The logits' gradient is c ([j == id] - p_j) / T per token: its unit is the largest |c| / T, and the products
    # carry it times the other operand's size.
    unit = reference_grad_unit(want_tok["logp"], adv, upstream, kw, loss_type=loss_type,
                               importance_sampling_level=level, **extra)
    amax = lambda t: t.abs().max().item() if t.numel() else 0.0  # noqa: E731
    assert_grad_close(h.grad, rh.grad, tol, unit * amax(weight))
    assert_grad_close(w.grad, rw.grad, tol, unit * amax(hidden))
    if b is not None:
        assert_grad_close(b.grad, rb.grad, tol, unit)
    return loss, tok, (h.grad, w.grad, None if b is None else b.grad)


# ----------------------------------------------------------------------------------------------------
# Values and gradients (CPU backend)


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_reference(dtype, loss_type, level, option):
    inputs = make_inputs(3, 5, 16, 37, dtype, option, bias=option != "plain",
                         seed=hash((loss_type, level, option)) % 1000)
    check_against_reference(inputs, loss_type, level)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_schedules_match_reference(loss_type, level, schedule):
    inputs = make_inputs(4, 3, 12, 29, torch.float32, "full", seed=7)
    check_against_reference(inputs, loss_type, level, schedule=schedule)


@pytest.mark.parametrize("level", LEVELS)
def test_matches_grpo_loss_over_the_logits(level):
    # The same loss as logitless.grpo_loss over logits materialized in float64 (and rounded to float32).
    inputs = make_inputs(3, 6, 16, 41, torch.float32, "full", seed=11)
    (hidden, weight, ids, adv), kw = split(inputs)
    logits = logits_of(hidden, weight, kw.pop("bias")).float()
    want, want_tok = grpo_loss(logits, ids, adv, importance_sampling_level=level, return_per_token=True, **kw)
    got, tok = linear_grpo_loss(hidden, weight, ids, adv, bias=inputs["bias"], importance_sampling_level=level,
                                return_per_token=True, **kw)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(tok, want_tok):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_dapo_global_normalizer():
    inputs = make_inputs(3, 6, 8, 23, torch.float32, "full", seed=3)
    count = float((inputs["completion_mask"] != 0).sum())
    check_against_reference(inputs, "dapo", extra=dict(num_items_in_batch=2.5 * count))


@pytest.mark.parametrize(
    "B,L,H,V,aligned", [(1, 1, 8, 7, False), (2, 3, 5, 1, False), (2, 4, 1, 3, False), (3, 5, 6, 11, True),
                        (0, 4, 8, 9, False), (3, 0, 8, 9, False)],
    ids=["one_token", "V1", "H1", "aligned", "B0", "L0"])
@pytest.mark.parametrize("level", LEVELS)
def test_shapes(B, L, H, V, aligned, level):
    for schedule in SCHEDULES:
        inputs = make_inputs(B, L, H, V, torch.float32, "full", aligned=aligned)
        check_against_reference(inputs, "grpo", level, schedule=schedule)


def test_strided_views_go_in_without_copy_by_the_caller():
    # hidden: the completion's positions of a longer sequence's states; a padded weight; ids a view of
    # prompt+completion ids; the mask and log-probs transposed.
    B, L, H, V, P = 3, 5, 8, 19, 4
    inputs = make_inputs(B, L, H, V, torch.float32, "full", seed=5)
    states = torch.randn(B, P + L + 1, H)
    states[:, P:] = inputs["hidden"]
    inputs["hidden"] = states[:, -(L + 1):]
    wide = torch.randn(V, H + 3)
    wide[:, :H] = inputs["weight"]
    inputs["weight"] = wide[:, :H]
    prompt_completion = torch.randint(0, V, (B, P + L))
    prompt_completion[:, P:] = inputs["completion_ids"]
    inputs["completion_ids"] = prompt_completion[:, -L:]
    for k in ("completion_mask", "old_logp", "ref_logp"):
        inputs[k] = inputs[k].t().contiguous().t()
    assert not inputs["hidden"].is_contiguous() and not inputs["weight"].is_contiguous()
    for level in LEVELS:
        for schedule in SCHEDULES:
            check_against_reference(dict(inputs), "grpo", level, schedule=schedule)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_all_masked_is_zero_with_zero_gradient(loss_type, level, schedule):
    inputs = make_inputs(2, 4, 6, 9, torch.float32, "full")
    inputs["completion_mask"] = torch.zeros_like(inputs["completion_mask"])
    (hidden, weight, ids, adv), kw = split(inputs)
    h, w, b = (t.clone().requires_grad_(True) for t in (hidden, weight, kw.pop("bias")))
    loss, tok = linear_grpo_loss(h, w, ids, adv, bias=b, loss_type=loss_type, importance_sampling_level=level,
                                 max_completion_length=4, return_per_token=True, schedule=schedule, **kw)
    assert loss.item() == 0.0
    for t in tok:
        assert (t == 0).all()
    loss.backward()
    for x in (h, w, b):
        assert (x.grad == 0).all()


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_masked_tokens_and_last_position_get_zero_gradient(schedule):
    inputs = make_inputs(4, 6, 8, 13, torch.float32, "full", seed=9)
    (hidden, weight, ids, adv), kw = split(inputs)
    h = hidden.clone().requires_grad_(True)
    linear_grpo_loss(h, weight, ids, adv, schedule=schedule, **kw).backward()
    mask = inputs["completion_mask"] != 0
    assert (h.grad[:, -1] == 0).all()
    assert (h.grad[:, :-1][~mask] == 0).all()
    assert (h.grad[:, :-1][mask].abs().sum(-1) > 0).all()


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("trainable", ["hidden", "weight", "bias", "hidden+bias"])
def test_only_some_inputs_need_grad(trainable, schedule):
    inputs = make_inputs(2, 4, 6, 11, torch.float32, "full", seed=4)
    (hidden, weight, ids, adv), kw = split(inputs)
    h, w, b = hidden.clone(), weight.clone(), kw.pop("bias").clone()
    for name, t in (("hidden", h), ("weight", w), ("bias", b)):
        t.requires_grad_(name in trainable.split("+"))
    linear_grpo_loss(h, w, ids, adv, bias=b, schedule=schedule, **kw).backward()
    rh, rw, rb = leaves(hidden, weight, inputs["bias"])
    want, _ = reference(logits_of(rh, rw, rb), ids, adv, **reference_kwargs(kw))
    want.backward()
    for name, t, r in (("hidden", h, rh), ("weight", w, rw), ("bias", b, rb)):
        if name in trainable.split("+"):
            assert_grad_close(t.grad, r.grad, 2e-5)
        else:
            assert t.grad is None


def test_no_grad_and_per_token_outputs():
    inputs = make_inputs(2, 5, 6, 17, torch.float32, "full")
    (hidden, weight, ids, adv), kw = split(inputs)
    h = hidden.clone().requires_grad_(True)
    with torch.no_grad():
        loss = linear_grpo_loss(h, weight, ids, adv, **kw)
    assert not loss.requires_grad
    loss2, tok = linear_grpo_loss(h, weight, ids, adv, return_per_token=True, **kw)
    assert isinstance(tok, logitless.policy_loss.PolicyLossOutputs)
    torch.testing.assert_close(loss, loss2.detach())


# Finite differences. The C++ API takes float32/16/bf16 only, so gradcheck runs in float32 with a wide step and
# loose tolerances: enough to catch a wrong formula; the precise check is test_matches_reference.
def _fd_inputs(level):
    inputs = make_inputs(2, 3, 4, 7, torch.float32, "full", seed=13)
    (hidden, weight, ids, adv), kw = split(inputs)
    bias = kw.pop("bias")
    kw.update(importance_sampling_level=level)
    return hidden, weight, bias, ids, adv, kw


@pytest.mark.filterwarnings("ignore:Input #[0-9]+ requires gradient and is not a double")
@pytest.mark.parametrize("level", LEVELS)
def test_gradcheck_recompute(level):
    # The recompute schedule's backward is a pure function of saved tensors: gradcheck may call it many times.
    hidden, weight, bias, ids, adv, kw = _fd_inputs(level)
    fn = lambda h, w, b: linear_grpo_loss(h, w, ids, adv, bias=b, schedule="recompute", **kw)  # noqa: E731
    args = tuple(t.clone().requires_grad_(True) for t in (hidden, weight, bias))
    assert torch.autograd.gradcheck(fn, args, eps=1e-3, atol=2e-3, rtol=2e-2)


@pytest.mark.filterwarnings("ignore:Input #[0-9]+ requires gradient and is not a double")
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_selective_gradcheck(temperature):
    g = torch.Generator().manual_seed(8)
    h = torch.randn(2, 3, 5, generator=g, requires_grad=True)
    w = (torch.randn(7, 5, generator=g) * 0.7).requires_grad_(True)
    b = (torch.randn(7, generator=g) * 0.3).requires_grad_(True)
    ids = torch.randint(0, 7, (2, 3), generator=g)
    fn = lambda h, w, b: linear_selective_log_softmax(h, w, ids, b, temperature)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (h, w, b), eps=1e-3, atol=2e-3, rtol=2e-2)


@pytest.mark.parametrize("level", LEVELS)
def test_finite_differences_gradient_in_forward(level):
    # This schedule's backward consumes the gradients computed in the forward (a second backward raises), which
    # gradcheck's repeated backward passes trip over. Same central differences, by hand.
    hidden, weight, bias, ids, adv, kw = _fd_inputs(level)
    h, w, b = (t.clone().requires_grad_(True) for t in (hidden, weight, bias))
    f = lambda h_, w_, b_: linear_grpo_loss(h_, w_, ids, adv, bias=b_, schedule="gradient_in_forward",  # noqa: E731
                                            **kw)
    (2.0 * f(h, w, b)).backward()
    assert_grads_match_central_differences(f, (h, w, b), scale=2.0)


def test_second_backward_over_retained_graph():
    hidden, weight, bias, ids, adv, kw = _fd_inputs("token")
    h = hidden.clone().requires_grad_(True)
    check_second_backward(lambda schedule: linear_grpo_loss(h, weight, ids, adv, bias=bias, schedule=schedule, **kw),
                          h, (h,))


def test_double_backward_raises():
    hidden, weight, bias, ids, adv, kw = _fd_inputs("token")
    h = hidden.clone().requires_grad_(True)
    for schedule in SCHEDULES:
        loss = linear_grpo_loss(h, weight, ids, adv, bias=bias, schedule=schedule, **kw)
        with pytest.raises(RuntimeError, match="double backward"):
            torch.autograd.grad(loss, h, create_graph=True)
    logp = linear_selective_log_softmax(h, weight, ids.new_zeros(h.shape[:-1]))
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(logp.sum(), h, create_graph=True)


# ----------------------------------------------------------------------------------------------------
# Bad input


def _bad(**changes):
    inputs = make_inputs(2, 3, 5, 9, torch.float32, "full")
    inputs.update(changes)
    return inputs


KEYWORDS = ("loss_type", "importance_sampling_level", "schedule", "chunk_tokens", "memory_budget")


@pytest.mark.parametrize(
    "changes,name",
    [
        (dict(hidden=torch.randn(2, 5, 5)), "hidden"),
        (dict(hidden=torch.randn(3, 4, 5)), "hidden"),
        (dict(hidden=torch.randn(8, 5)), "hidden"),
        (dict(hidden=torch.randn(2, 4, 5, dtype=torch.float64)), "hidden"),
        (dict(weight=torch.randn(9, 4)), "weight"),
        (dict(weight=torch.randn(9, 5, dtype=torch.float16)), "weight"),
        (dict(bias=torch.randn(8)), "bias"),
        (dict(completion_ids=torch.zeros(2, 5, dtype=torch.long)), "hidden"),
        *BAD_POLICY_ARGUMENTS,
        (dict(schedule="fastest"), "schedule"),
        (dict(chunk_tokens=0), "chunk_tokens"),
        (dict(memory_budget=0), "memory_budget"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_bad_arguments_raise_value_error_naming_them(changes, name):
    inputs = _bad(**{k: v for k, v in changes.items() if k not in KEYWORDS})
    extra = {k: v for k, v in changes.items() if k in KEYWORDS}
    (hidden, weight, ids, adv), kw = split(inputs)
    for requires_grad in (False, True):
        with pytest.raises(ValueError, match=name):
            linear_grpo_loss(hidden.clone().requires_grad_(requires_grad and hidden.is_floating_point()), weight, ids,
                             adv, **kw, **extra)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_id_out_of_range_names_first_unmasked_token(schedule):
    inputs = make_inputs(2, 4, 5, 9, torch.float32, "full")
    (hidden, weight, ids, adv), kw = split(inputs)
    ids = ids.clone()
    ids[0, 3] = 50  # masked (sequence 0's second half): ignored
    ids[1, 2] = 9   # the first bad unmasked token
    ids[1, 3] = -2
    with pytest.raises(ValueError, match=r"completion_ids.*got 9 at \[1, 2\]"):
        linear_grpo_loss(hidden.requires_grad_(True), weight, ids, adv, schedule=schedule, **kw)


def test_unchecked_bad_id_gives_nan():
    inputs = make_inputs(2, 3, 5, 9, torch.float32, "plain", bias=False)
    (hidden, weight, ids, adv), kw = split(inputs)
    ids = ids.clone()
    ids[1, 1] = 99
    h = hidden.clone().requires_grad_(True)
    loss, tok = linear_grpo_loss(h, weight, ids, adv, check_ids=False, return_per_token=True, **kw)
    assert torch.isnan(loss) and torch.isnan(tok.logp[1, 1]) and torch.isfinite(tok.logp[0]).all()
    loss.backward()
    assert torch.isnan(h.grad[1, 1]).all() and torch.isfinite(h.grad[0]).all()


def test_selective_bad_input():
    h, w = torch.randn(4, 3), torch.randn(5, 3)
    with pytest.raises(ValueError, match=r"ids: expected values in \[0, 5\), got 5 at row 2"):
        linear_selective_log_softmax(h, w, torch.tensor([0, 1, 5, 2]))
    with pytest.raises(ValueError, match="ids: expected shape"):
        linear_selective_log_softmax(h, w, torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="weight"):
        linear_selective_log_softmax(h, torch.randn(5, 4), torch.tensor([0, 1, 2, 3]))
    with pytest.raises(ValueError, match="temperature"):
        linear_selective_log_softmax(h, w, torch.tensor([0, 1, 2, 3]), temperature=-1.0)


# ----------------------------------------------------------------------------------------------------
# Selective log-softmax


def _sel_reference(hidden, weight, bias, ids, temperature):
    rh, rw, rb = leaves(hidden, weight, bias)
    lp = (logits_of(rh, rw, rb) / temperature).log_softmax(-1)
    return lp.gather(-1, ids.long()[..., None])[..., 0], -(lp.exp() * lp).sum(-1), (rh, rw, rb)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,H,V", [((5,), 8, 37), ((2, 3), 16, 200), ((0,), 4, 5), ((4,), 3, 1)],
                         ids=["1d", "2d", "empty", "V1"])
def test_selective_matches_reference(shape, H, V, dtype, temperature):
    g = torch.Generator().manual_seed(6)
    hidden = torch.randn(*shape, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) * 0.5).to(dtype)
    bias = torch.randn(V, generator=g)  # float32 bias with 16-bit inputs
    ids = torch.randint(0, V, shape, generator=g)
    want, want_ent, (rh, rw, rb) = _sel_reference(hidden, weight, bias, ids, temperature)
    up = torch.linspace(-1, 1, want.numel()).reshape(shape).double()
    (want * up).sum().backward()
    h, w, b = (t.clone().requires_grad_(True) for t in (hidden, weight, bias))
    logp, ent = linear_selective_log_softmax(h, w, ids, b, temperature, return_entropy=True)
    assert logp.shape == shape and logp.dtype == torch.float32
    assert_close(logp, want.detach(), 2e-5)
    assert_close(ent, want_ent.detach(), 2e-5)
    (logp * up.float()).sum().backward()
    tol = GRAD_TOL["cpu"][dtype]
    unit = 1.0 / temperature  # the largest |grad_logp| / T: what multiplies ([j == id] - p_j)
    amax = lambda t: t.abs().max().item() if t.numel() else 0.0  # noqa: E731
    assert_grad_close(h.grad, rh.grad, tol, unit * amax(weight))
    assert_grad_close(w.grad, rw.grad, tol, unit * amax(hidden))
    assert b.grad.dtype == torch.float32
    assert_grad_close(b.grad, rb.grad, 2e-5, unit)


def _top1_operands(dtype, device="cpu"):
    """Integer-valued operands, so that every logit is exact in any order of summation (ties are ties everywhere):
    class 3 has copies at 7 and 30, and an indicator column lifts the three to the top of every fourth row; row 5's
    hidden state has a NaN."""
    g = torch.Generator().manual_seed(9)
    N, H, V = 64, 7, 40
    weight = torch.randint(-3, 4, (V, H), generator=g).float()
    weight[:, -1] = 0
    weight[3, -1] = 40
    weight[[7, 30]] = weight[3].clone()
    hidden = torch.randint(-2, 3, (N, H), generator=g).float()
    hidden[:, -1] = (torch.arange(N) % 4 == 0).float()
    hidden[5, 0] = float("nan")
    bias = torch.randint(-2, 3, (V,), generator=g).float()
    bias[[7, 30]] = bias[3].item()
    first = logits_of(hidden, weight, bias).argmax(-1)
    # Ids that answer both ways: the first maximum, a tie's later copy, or any class.
    ids = torch.where(torch.arange(N) % 3 == 0, first, torch.randint(0, V, (N,), generator=g))
    ids[::8] = 30
    return [t.to(device) for t in (hidden.to(dtype), weight.to(dtype), bias, ids)]


def _top1_reference(hidden, weight, bias, ids):
    z = logits_of(hidden, weight, bias)
    return (z.argmax(-1) == ids) & ~z.isnan().any(-1)  # torch.argmax takes a NaN for the max: documented False


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_selective_top1_is_the_first_argmax(dtype, device):
    hidden, weight, bias, ids = _top1_operands(dtype, device)
    want = _top1_reference(hidden, weight, bias, ids)
    assert want.any() and (~want & (ids == 30) & (hidden[:, -1] == 1)).any()  # both answers, and a tie lost
    h = hidden.clone().requires_grad_(True)
    logp, ent, top1 = linear_selective_log_softmax(h, weight, ids, bias, 0.6, return_entropy=True, return_top1=True)
    assert top1.dtype == torch.bool and top1.shape == ids.shape and not top1.requires_grad
    assert torch.equal(top1, want)
    lp_only, top1_only = linear_selective_log_softmax(hidden, weight, ids, bias, 0.6, return_top1=True,
                                                      chunk_tokens=5 if device == "cuda" else None)
    assert torch.equal(top1_only, want)
    torch.testing.assert_close(lp_only, logp.detach(), equal_nan=True, rtol=0, atol=0)
    logp.nan_to_num().sum().backward()  # the flag changes nothing about the gradient's path
    assert h.grad is not None
    compiled = torch.compile(lambda x: linear_selective_log_softmax(x, weight, ids, bias, return_top1=True)[1],
                             fullgraph=True)
    assert torch.equal(compiled(hidden), want)


def test_selective_matches_old_policy_logp():
    # What a trainer computes for old_logp / ref_logp: the policy loss's own logp of the same tokens.
    inputs = make_inputs(3, 6, 8, 23, torch.float32, "plain", seed=12)
    (hidden, weight, ids, adv), kw = split(inputs)
    with torch.no_grad():
        lp = linear_selective_log_softmax(hidden[:, :-1], weight, ids, inputs["bias"], kw["temperature"])
        _, tok = linear_grpo_loss(hidden, weight, ids, adv, return_per_token=True, **kw)
    torch.testing.assert_close(lp, tok.logp, rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------------------------------
# torch.library and torch.compile


def _op_samples(device="cpu"):
    inputs = make_inputs(2, 3, 6, 9, torch.float32, "full", device=device)
    (hidden, weight, ids, adv), kw = split(inputs)
    bias, mask, old, ref = kw["bias"], kw["completion_mask"], kw["old_logp"], kw["ref_logp"]
    opts = lambda t, lvl, pt: (t, lvl, 0.04, 0.2, 0.28, 0.7, 6, 0.0, True, 0, 1 << 20, pt, pt)  # noqa: E731
    bopts = lambda t, lvl: (t, lvl, 0.04, 0.2, 0.28, 0.7, 6, 0.0, 0, 1 << 20)  # noqa: E731
    ops = torch.ops.logitless
    tensors = (hidden, weight, bias, ids, adv, mask, old, ref)
    logp, lse = ops.linear_policy_loss_forward(*tensors, *opts(0, 1, False))[4::2]
    flat_h, flat_ids = hidden[:, :-1].reshape(-1, 6), ids.clamp(min=0).reshape(-1)
    sel_lse = ops.linear_selective_log_softmax_forward(flat_h, weight, bias, flat_ids, 0.7, True, 0, 1 << 20, False,
                                                       False)[2]
    return [
        (ops.linear_policy_loss_forward, tensors + opts(0, 0, True)),
        (ops.linear_policy_loss_forward, (hidden.clone().requires_grad_(True), weight, None, ids.clamp(min=0), adv,
                                          None, None, ref) + opts(2, 1, False)),
        (ops.linear_policy_loss_forward_backward_out,
         tensors + opts(1, 1, True) + (torch.empty_like(hidden), torch.empty_like(weight), torch.empty_like(bias))),
        (ops.linear_policy_loss_forward_backward_out,
         tensors + opts(3, 0, False) + (None, torch.empty_like(weight), None)),
        (ops.linear_policy_loss_backward,
         tensors + (logp, lse, torch.tensor(1.5, device=device)) + bopts(0, 1) + (True, True, True)),
        (ops.linear_selective_log_softmax_forward,
         (flat_h, weight, bias, flat_ids, 0.7, True, 0, 1 << 20, True, True)),
        (ops.linear_selective_log_softmax_forward,
         (flat_h.clone().requires_grad_(True), weight, None, flat_ids, 1.0, True, 0, 1 << 20, False, False)),
        (ops.linear_selective_log_softmax_forward,
         (flat_h.clone().requires_grad_(True), weight, bias, flat_ids, 0.7, True, 0, 1 << 20, False, True)),
        (ops.linear_selective_log_softmax_backward,
         (flat_h, weight, bias, flat_ids, sel_lse, torch.rand(6, device=device), 0.7, 0, 1 << 20, True, False, True)),
    ]


@pytest.mark.parametrize("index", range(9))
def test_opcheck(index):
    op, args = _op_samples()[index]
    torch.library.opcheck(op, args)


def _model(h, W, b, ids, adv, mask, old, ref, level, schedule):
    loss = linear_grpo_loss(h, W, ids, adv, bias=b, completion_mask=mask, old_logp=old, ref_logp=ref,
                            temperature=0.9, importance_sampling_level=level, schedule=schedule)
    lp = linear_selective_log_softmax(h[:, :-1], W, ids.clamp(min=0), b, 0.9)
    return loss + 0.1 * lp.mean()


COMPILE_CASES = [(level, schedule) for level in LEVELS for schedule in SCHEDULES]


@pytest.mark.parametrize("level,schedule", COMPILE_CASES)
def test_compile_fullgraph_matches_eager(level, schedule):
    torch._dynamo.reset()
    inputs = make_inputs(3, 5, 16, 33, torch.float32, "full", seed=4)
    (hidden, weight, ids, adv), kw = split(inputs)
    h, W, b = (t.clone().requires_grad_(True) for t in (hidden, weight, kw["bias"]))
    args = (ids, adv, kw["completion_mask"], kw["old_logp"], kw["ref_logp"], level, schedule)
    assert_compiled_matches_eager(_model, (h, W, b), *args, upstream=2, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------------
# CUDA


@needs_cuda
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("V", [1, 3, 4099, 32003, 150000])
def test_cuda_matches_reference(V, dtype, level, schedule):
    B, L, H = (2, 3, 64) if V >= 32003 else (4, 9, 64)
    inputs = make_inputs(B, L, H, V, dtype, "full", device="cuda", seed=V)
    check_against_reference(inputs, "grpo", level, schedule=schedule)


@needs_cuda
@pytest.mark.parametrize("chunk_tokens", [None, 7, 150])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("option", list(OPTIONS))
def test_cuda_matches_cpu_backend(option, loss_type, chunk_tokens):
    # Chunks: from the budget; shorter than a sequence (cut at sequence ends); whole sequences (several groups).
    inputs = make_inputs(8, 65, 128, 8191, torch.bfloat16, option, seed=1)
    extra = dict(max_completion_length=70) if loss_type == "dr_grpo" else {}
    outs = []
    for device in ("cpu", "cuda"):
        (hidden, weight, ids, adv), kw = split({k: (v.to(device) if torch.is_tensor(v) else v)
                                                for k, v in inputs.items()})
        for level in LEVELS:
            for schedule in SCHEDULES:
                h, w = hidden.detach().clone().requires_grad_(True), weight.detach().clone().requires_grad_(True)
                loss, tok = linear_grpo_loss(h, w, ids, adv, loss_type=loss_type, importance_sampling_level=level,
                                             return_per_token=True, schedule=schedule,
                                             chunk_tokens=chunk_tokens if device == "cuda" else None, **kw, **extra)
                loss.backward()
                outs.append((loss.cpu(), [t.cpu() for t in tok], h.grad.cpu(), w.grad.cpu()))
    half = len(outs) // 2
    for (lc, tc, hc, wc), (lg, tg, hg, wg) in zip(outs[:half], outs[half:]):
        torch.testing.assert_close(lg, lc, rtol=1e-4, atol=1e-5)
        assert_per_token_outputs_close(tg, tc)
        assert_grad_close(hg, hc, GRAD_TOL["cuda"][torch.bfloat16])
        assert_grad_close(wg, wc, GRAD_TOL["cuda"][torch.bfloat16])


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_selective_matches_cpu(dtype):
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(300, 96, generator=g).to(dtype)
    weight = (torch.randn(32003, 96, generator=g) * 0.2).to(dtype)
    ids = torch.randint(0, 32003, (300,), generator=g)
    ids[::2] = logits_of(hidden, weight, None).argmax(-1)[::2]  # is_top1 answers both ways
    res = []
    for device in ("cpu", "cuda"):
        h, w = hidden.detach().to(device).requires_grad_(True), weight.detach().to(device).requires_grad_(True)
        logp, ent, top1 = linear_selective_log_softmax(h, w, ids.to(device), temperature=0.7, return_entropy=True,
                                                       return_top1=True, chunk_tokens=100 if device == "cuda" else None)
        logp.backward(torch.linspace(-1, 1, 300, device=device))
        res.append((logp.cpu(), ent.cpu(), h.grad.cpu(), w.grad.cpu(), top1.cpu()))
    # float32 logits may rank two classes within rounding of each other otherwise than the CPU's float64 ones.
    top2 = logits_of(hidden, weight, None).topk(2, -1).values
    near_tie = (top2[:, 0] - top2[:, 1]) <= 1e-4 * top2[:, 0].abs().clamp(min=1)
    assert torch.equal(res[1][4] | near_tie, res[0][4] | near_tie) and res[0][4].sum() >= 100
    torch.testing.assert_close(res[1][0], res[0][0], rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(res[1][1], res[0][1], rtol=1e-5, atol=2e-5)
    unit = 1.0 / 0.7  # max |grad_logp| / T
    assert_grad_close(res[1][2], res[0][2], GRAD_TOL["cuda"][dtype], unit * weight.abs().max().item())
    assert_grad_close(res[1][3], res[0][3], GRAD_TOL["cuda"][dtype], unit * hidden.abs().max().item())


@needs_cuda
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_cuda_runs_on_the_current_stream(schedule):
    inputs = make_inputs(4, 16, 64, 32000, torch.bfloat16, "full", device="cuda")
    (hidden, weight, ids, adv), kw = split(inputs)
    want = linear_grpo_loss(hidden, weight, ids, adv, **kw)
    h = torch.zeros_like(hidden, requires_grad=True)

    def run():
        got = linear_grpo_loss(h + hidden, weight, ids, adv, schedule=schedule, **kw)
        got.backward()
        return got

    got = on_a_side_stream_behind_a_sleep(run)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    hr = hidden.detach().clone().requires_grad_(True)
    linear_grpo_loss(hr, weight, ids, adv, schedule=schedule, **kw).backward()
    torch.testing.assert_close(h.grad, hr.grad, rtol=1e-4, atol=1e-5)


@needs_cuda
def test_cuda_bad_id_raises_eagerly():
    inputs = make_inputs(2, 4, 16, 100, torch.float32, "plain", device="cuda")
    (hidden, weight, ids, adv), kw = split(inputs)
    ids = ids.clone()
    ids[1, 0] = 100
    with pytest.raises(ValueError, match=r"completion_ids.*got 100 at \[1, 0\]"):
        linear_grpo_loss(hidden, weight, ids, adv, **kw)


@needs_cuda
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("level", LEVELS)
def test_cuda_graph_capture(level, schedule):
    inputs = make_inputs(4, 16, 32, 4099, torch.float32, "full", device="cuda", seed=21)
    (hidden, weight, ids, adv), kw = split(inputs)
    h, W = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    opts = dict(importance_sampling_level=level, schedule=schedule, chunk_tokens=20, **kw)

    def step():
        loss = linear_grpo_loss(h, W, ids, adv, **opts)
        loss.backward()
        return loss.detach()

    def refill(gen):
        h.copy_(torch.randn(h.shape, generator=gen).cuda())
        adv.copy_(torch.randn(adv.shape, generator=gen).cuda())

    graph, static_loss = capture_cuda_graph(step, (h, W))
    assert_graph_replays_match_eager(graph, static_loss, (h, W), refill,
                                     lambda hr, Wr: linear_grpo_loss(hr, Wr, ids, adv, **opts))


@needs_cuda
def test_cuda_compile_and_opcheck():
    for op, args in _op_samples("cuda"):
        torch.library.opcheck(op, args)
    torch._dynamo.reset()
    inputs = make_inputs(4, 64, 64, 4099, torch.float32, "full", device="cuda", seed=4)
    (hidden, weight, ids, adv), kw = split(inputs)
    h, W, b = (t.clone().requires_grad_(True) for t in (hidden, weight, kw["bias"]))
    for level, schedule in COMPILE_CASES:
        args = (ids, adv, kw["completion_mask"], kw["old_logp"], kw["ref_logp"], level, schedule)
        assert_compiled_matches_eager(_model, (h, W, b), *args, rtol=1e-4, atol=1e-5)


@needs_cuda
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("level", LEVELS)
def test_cuda_logits_never_in_memory(level, schedule):
    # Peak memory beyond the inputs and the gradients stays below one bf16 copy of the logits.
    B, L, H, V = 4, 1023, 512, 32000
    inputs = make_inputs(B, L, H, V, torch.bfloat16, "full", device="cuda", bias=False)
    (hidden, weight, ids, adv), kw = split(inputs)
    logits_bytes = B * (L + 1) * V * 2
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    grads_bytes = h.numel() * 2 + w.numel() * 2
    extra = extra_peak_memory(lambda: linear_grpo_loss(h, w, ids, adv, importance_sampling_level=level,
                                                       schedule=schedule, memory_budget=64 << 20, **kw).backward())
    extra -= grads_bytes
    assert extra < logits_bytes, f"{extra / 2**20:.0f} MiB extra for {logits_bytes / 2**20:.0f} MiB of bf16 logits"
